"""The local model store: names, the catalog of short names, manifests and blobs.

Everything lives under the store root, `$LOCALLLM_HOME` (default `~/.localllm`):

    manifests/<quoted name>.json   one per installed model: what it is and where its file is
    blobs/sha256-<hex>             pulled GGUF files, content-addressed (two names may share one)
    tmp/                           downloads in progress (`*.partial`), kept for resume
    locks/                         one lock file per model name, so concurrent pulls take turns

A local file registered in place has a manifest that points at its absolute path and no blob.
No user-supplied string ever becomes a path: names are validated against a strict grammar and
then percent-quoted into a single file name; blobs are named by their sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from filelock import FileLock

from localllm.errors import LocalLLMError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the tomli backport
    import tomli as tomllib

Progress = Callable[[int, "int | None"], None]
"""progress(done_bytes, total_bytes or None), called as bytes are downloaded or hashed."""

HF_PREFIX = "hf.co/"
DEFAULT_QUANT = "Q4_K_M"
MANIFEST_FORMAT = 1

# A segment starts with a letter or digit, so "." and ".." (and hidden files) cannot be spelled;
# "/" only separates segments, and no backslash, NUL, control character or space gets through.
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._+-]*"
_NAME_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*(?::{_SEGMENT})?")
_REMOTE_FILE_RE = re.compile(rf"(?:{_SEGMENT}/)*{_SEGMENT}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_BLOB_RE = re.compile(r"sha256-[0-9a-f]{64}")
# Quant tags as they appear in GGUF file names (Q4_K_M, Q8_0, IQ4_XS, F16, BF16, ...).
_QUANT_IN_NAME_RE = re.compile(
    r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.I
)


def is_path(name_or_path: str) -> bool:
    """Whether a `pull`/`run` argument means a local file rather than a model name."""
    looks_like_path = name_or_path.startswith(("/", "./", "../", "~", ".\\"))
    return looks_like_path or name_or_path.lower().endswith((".gguf", "/"))


def check_not_a_directory(path: Path, given: str | Path) -> None:
    """Raise a LocalLLMError saying what to give instead when a model path is a directory."""
    if not path.is_dir():
        return
    try:
        found = sorted(p.name for p in path.glob("*.gguf"))
    except OSError:
        found = []
    example = f", such as {Path(given) / found[0]}" if found else ""
    raise LocalLLMError(
        f"{given} is a directory, not a .gguf file; give the path of a .gguf file in it{example}"
    )


def validate_name(name: str) -> str:
    """Return `name` if it is a safe model name (`NAME[:TAG]`, `/` between segments), else raise."""
    # The limit is on the quoted form, which becomes a file name (at most 255 bytes anywhere).
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or len(quote(name, safe="")) > 200:
        raise LocalLLMError(
            f"invalid model name {name!r}: use letters, digits, '.', '_', '-' and '+', "
            "segments separated by '/', and an optional ':tag'"
        )
    return name


def validate_remote_file(path: str) -> str:
    """Return `path` if it is a safe file name inside a remote repo (no `..`, no absolute path)."""
    if not isinstance(path, str) or len(path) > 500 or not _REMOTE_FILE_RE.fullmatch(path):
        raise LocalLLMError(
            f"refusing the remote file name {path!r}: it is not a plain relative name"
        )
    return path


def quant_from_file_name(file_name: str) -> str | None:
    """The quant tag written in a GGUF file name (`...-Q4_K_M.gguf` -> `Q4_K_M`), if any."""
    found = _QUANT_IN_NAME_RE.findall(Path(file_name).name)
    return found[-1].upper() if found else None


# ---------------------------------------------------------------------------------------------
# The catalog (models.toml)


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the zip member inside it that holds (a part of) the GGUF file."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class CatalogEntry:
    """Where the GGUF behind a short name comes from; sources are tried in the order given."""

    name: str
    description: str = ""
    hf_repo: str | None = None
    hf_file: str | None = None
    revision: str = "main"
    size: int | None = None
    sha256: str | None = None
    wheels: tuple[WheelPart, ...] = ()
    default: bool = False
    # What the file is, so that the catalog test can check it against what localllm runs
    # (support.py); `pull` reads the real header before the download all the same.
    arch: str | None = None  # general.architecture
    quant: str | None = None  # llama.cpp file type (Q4_K_M, Q8_0, ...)


@dataclass(frozen=True)
class Catalog:
    """Short names (`smollm2:135m`) and the default tag of each bare name (`smollm2`)."""

    entries: dict[str, CatalogEntry] = field(default_factory=dict)

    @property
    def defaults(self) -> dict[str, str]:
        """Bare name -> full name of its default entry."""
        return {e.name.split(":")[0]: e.name for e in self.entries.values() if e.default}

    def get(self, name: str) -> CatalogEntry | None:
        """The entry for a canonical name, or None."""
        return self.entries.get(name)


def catalog_file() -> Traversable:
    """The catalog shipped inside the package (package data: a wheel install has it too)."""
    return resources.files("localllm") / "models.toml"


def load_catalog(path: Path | Traversable | None = None) -> Catalog:
    """Read and validate the catalog (default: the package's models.toml, see catalog_file)."""
    path = catalog_file() if path is None else path
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LocalLLMError(f"model catalog {path} is missing; reinstall localllm") from None
    except tomllib.TOMLDecodeError as e:
        raise LocalLLMError(f"model catalog {path} is not valid TOML: {e}") from None
    entries: dict[str, CatalogEntry] = {}
    for name, raw in data.get("models", {}).items():
        entries[name] = _catalog_entry(name, raw, path)
    bare = [e.name.split(":")[0] for e in entries.values() if e.default]
    if len(bare) != len(set(bare)):
        raise LocalLLMError(f"model catalog {path}: more than one default tag for one name")
    return Catalog(entries)


def _catalog_entry(name: str, raw: dict, path: Path) -> CatalogEntry:
    where = f"model catalog {path}, entry {name!r}"
    if name != name.lower() or ":" not in name or name.startswith(HF_PREFIX):
        raise LocalLLMError(f"{where}: names are lower-case NAME:TAG")
    validate_name(name)
    known = {"description", "hf", "file", "revision", "size", "sha256", "wheels", "default"}
    known |= {"arch", "quant"}
    if unknown := set(raw) - known:
        raise LocalLLMError(f"{where}: unknown keys {sorted(unknown)}")
    hf_repo, hf_file = raw.get("hf"), raw.get("file")
    if (hf_repo is None) != (hf_file is None):
        raise LocalLLMError(f"{where}: 'hf' and 'file' go together")
    if hf_repo is not None:
        if hf_repo.count("/") != 1:
            raise LocalLLMError(f"{where}: 'hf' must be USER/REPO")
        validate_name(hf_repo)
        validate_remote_file(hf_file)
    sha256 = raw.get("sha256")
    if sha256 is not None and not _SHA256_RE.fullmatch(sha256):
        raise LocalLLMError(f"{where}: sha256 must be 64 lower-case hex digits")
    wheels = tuple(
        WheelPart(w["package"], w["version"], w["member"]) for w in raw.get("wheels", [])
    )
    if hf_repo is None and not wheels:
        raise LocalLLMError(f"{where}: give at least one source ('hf' + 'file', or 'wheels')")
    return CatalogEntry(
        name=name,
        description=raw.get("description", ""),
        hf_repo=hf_repo,
        hf_file=hf_file,
        revision=raw.get("revision", "main"),
        size=raw.get("size"),
        sha256=sha256,
        wheels=wheels,
        default=bool(raw.get("default", False)),
        arch=raw.get("arch"),
        quant=raw.get("quant"),
    )


# ---------------------------------------------------------------------------------------------
# What a GGUF file is (read by localllm.gguf; imported there, since numpy and the gguf package
# would slow down commands such as `localllm list` that never open a model)


def check_gguf(path: Path) -> dict[str, Any]:
    """The metadata of a whole, readable GGUF file (header, metadata, tensor table, every
    tensor's data inside the file), else LocalLLMError saying what is wrong with it."""
    from localllm.gguf import read_gguf

    with read_gguf(path) as gguf:  # memory-mapped: the tensor data itself is not read
        return gguf.metadata


def read_file_type(path: Path) -> int | None:
    """`general.file_type` from a GGUF header, or None when absent or the header is unreadable."""
    from localllm.gguf import read_metadata

    try:
        return _file_type(read_metadata(path))
    except LocalLLMError:
        return None


def _file_type(metadata: dict[str, Any]) -> int | None:
    value = metadata.get("general.file_type")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def detect_quant(
    path: Path, file_name: str | None = None, metadata: dict[str, Any] | None = None
) -> str | None:
    """The quant of a GGUF: from `general.file_type` (read from `path` unless `metadata` is
    given), else from the (remote) file name."""
    file_type = read_file_type(path) if metadata is None else _file_type(metadata)
    if file_type is not None:
        import gguf

        try:
            name = gguf.LlamaFileType(file_type).name
        except ValueError:
            name = None
        if name:
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    return quant_from_file_name(file_name or path.name)


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    """Hex sha256 of a file, reporting progress while reading."""
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
    return digest.hexdigest()


def format_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as download sizes are usually shown)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# ---------------------------------------------------------------------------------------------
# The store


@dataclass(frozen=True)
class InstalledModel:
    """A model the store knows: where its GGUF file is and what it is."""

    name: str
    path: Path
    size: int
    sha256: str
    quant: str | None
    source: str
    modified: datetime
    in_store: bool  # False: a local file registered in place, which remove() never deletes


class Store:
    """The model store under `root` (default `$LOCALLLM_HOME`, else `~/.localllm`)."""

    def __init__(self, root: Path | None = None, catalog: Catalog | None = None) -> None:
        if root is None:
            root = Path(os.environ.get("LOCALLLM_HOME") or Path.home() / ".localllm")
        self.root = Path(root).expanduser().resolve()
        self._catalog = catalog

    @property
    def catalog(self) -> Catalog:
        """The catalog of short names, read from models.toml on first use."""
        if self._catalog is None:
            self._catalog = load_catalog()
        return self._catalog

    @property
    def manifests_dir(self) -> Path:
        return self.root / "manifests"

    @property
    def blobs_dir(self) -> Path:
        return self.root / "blobs"

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"

    # -- names ----------------------------------------------------------------------------------

    def canonical_name(self, name: str) -> str:
        """The full name of a model: `smollm2` -> `smollm2:135m`, `hf.co/u/r` -> `hf.co/u/r:Q4_K_M`.

        Catalog names are case-insensitive; Hub names keep their case, with the quant upper-cased.
        """
        if not isinstance(name, str):
            raise LocalLLMError(f"invalid model name {name!r}")
        for prefix in ("https://", "http://"):
            name = name.removeprefix(prefix)
        if name.startswith("huggingface.co/"):
            name = HF_PREFIX + name.removeprefix("huggingface.co/")
        validate_name(name)
        if name.startswith(HF_PREFIX):
            repo, _, quant = name.removeprefix(HF_PREFIX).partition(":")
            if repo.count("/") != 1:
                raise LocalLLMError(f"invalid Hub model name {name!r}: use hf.co/USER/REPO[:QUANT]")
            return f"{HF_PREFIX}{repo}:{(quant or DEFAULT_QUANT).upper()}"
        name = name.lower()
        if ":" not in name:
            name = self.catalog.defaults.get(name, name)
        return name

    def _key(self, canonical: str) -> str:
        # Percent-quoting a validated name gives one flat, reversible file name: "/" and ":"
        # become %2F and %3A, and a name cannot start with "." (see _SEGMENT).
        return quote(validate_name(canonical), safe="")

    def manifest_path(self, canonical: str) -> Path:
        return self.manifests_dir / f"{self._key(canonical)}.json"

    def partial_path(self, canonical: str) -> Path:
        """Where a download of this model accumulates until it is verified."""
        return self.tmp_dir / f"{self._key(canonical)}.partial"

    def lock(self, canonical: str) -> FileLock:
        """An inter-process lock for one model name (a pull holds it while it runs)."""
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        return FileLock(locks / f"{self._key(canonical)}.lock")

    # -- reading --------------------------------------------------------------------------------

    def resolve(self, name: str) -> InstalledModel | None:
        """The installed model called `name` (short names allowed), or None if it is not here."""
        model = self.manifest(name)
        return model if model is not None and model.path.is_file() else None

    def manifest(self, name: str) -> InstalledModel | None:
        """The model the store has a manifest for under `name`, whether or not its file is still
        there (see `resolve`), or None."""
        return self._read_manifest(self.manifest_path(self._lookup_name(name)))

    def _lookup_name(self, name: str) -> str:
        # A registered local file may be called exactly what a catalog family is called
        # ("smollm2"), so the exact name wins over the default-tag expansion.
        if isinstance(name, str) and ":" not in name and not name.startswith(HF_PREFIX):
            exact = validate_name(name).lower()
            if self.manifest_path(exact).exists():
                return exact
        return self.canonical_name(name)

    def list(self) -> list[InstalledModel]:
        """All installed models, sorted by name (including ones whose file has gone missing)."""
        if not self.manifests_dir.is_dir():
            return []
        models = [self._read_manifest(p) for p in sorted(self.manifests_dir.glob("*.json"))]
        return sorted((m for m in models if m is not None), key=lambda m: m.name)

    def _read_manifest(self, path: Path) -> InstalledModel | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise LocalLLMError(
                f"manifest {path} is damaged ({e}); delete it and pull again"
            ) from e
        try:
            if data.get("blob") is not None:
                # Never trust a path from disk: a blob reference must be a bare sha256 name.
                if not _BLOB_RE.fullmatch(data["blob"]):
                    raise ValueError(f"bad blob reference {data['blob']!r}")
                file_path, in_store = self.blobs_dir / data["blob"], True
            else:
                file_path, in_store = Path(data["path"]), False
            return InstalledModel(
                name=validate_name(data["name"]),
                path=file_path,
                size=int(data["size"]),
                sha256=data["sha256"],
                quant=data.get("quant"),
                source=data["source"],
                modified=datetime.fromisoformat(data["modified"]),
                in_store=in_store,
            )
        except (KeyError, TypeError, ValueError, LocalLLMError) as e:
            raise LocalLLMError(
                f"manifest {path} is damaged ({e}); delete it and pull again"
            ) from e

    # -- writing --------------------------------------------------------------------------------

    def check_free_space(self, needed: int, directory: Path | None = None) -> None:
        """Raise a clear error when `directory` (default: the store) has less than `needed` free."""
        directory = directory or self.root
        directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(directory).free
        # Keep a little headroom: a disk filled to the last byte breaks other programs.
        margin = 64 * 1024 * 1024
        if free < needed + margin:
            raise LocalLLMError(
                f"not enough disk space in {directory}: need {format_bytes(needed)}, "
                f"{format_bytes(free)} free; free some space or set LOCALLLM_HOME to a larger disk"
            )

    def install(
        self,
        canonical: str,
        file: Path,
        *,
        sha256: str,
        source: str,
        remote_name: str | None = None,
    ) -> InstalledModel:
        """Move a verified download (a file in tmp_dir) into blobs/ and write its manifest.

        The caller has checked the sha256; os.replace makes the blob appear whole or not at all.
        """
        if not _SHA256_RE.fullmatch(sha256):
            raise ValueError(f"not a sha256: {sha256!r}")
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        blob = self.blobs_dir / f"sha256-{sha256}"
        quant = detect_quant(file, remote_name)
        size = file.stat().st_size
        if blob.exists():
            file.unlink()  # the same bytes are already here under another name
        else:
            os.replace(file, blob)
        manifest = {"blob": blob.name}
        return self._write_manifest(canonical, manifest, size, sha256, quant, source)

    def register_file(self, path: str | Path, progress: Progress | None = None) -> InstalledModel:
        """Register a local GGUF in place (it is not copied); its name is the file's stem.

        Registering the same unchanged file again returns the existing entry without rehashing.
        """
        given, path = path, Path(path).expanduser().resolve()
        check_not_a_directory(path, given)
        if not path.is_file():
            raise LocalLLMError(f"no such file: {path}")
        metadata = check_gguf(path)
        stem = re.sub(r"[^A-Za-z0-9._+-]+", "-", path.stem).strip("-._+").lower() or "model"
        canonical = validate_name(stem[:100])
        stat = path.stat()
        manifest_path = self.manifest_path(canonical)
        with self.lock(canonical):
            existing = self._read_manifest(manifest_path)
            if existing is not None and not existing.in_store and existing.path == path:
                data = json.loads(manifest_path.read_text(encoding="utf-8"))
                if data.get("mtime_ns") == stat.st_mtime_ns and existing.size == stat.st_size:
                    return existing
            sha256 = sha256_file(path, progress)
            manifest = {"path": str(path), "mtime_ns": stat.st_mtime_ns}
            quant = detect_quant(path, metadata=metadata)
            return self._write_manifest(canonical, manifest, stat.st_size, sha256, quant, "file")

    def _write_manifest(
        self, canonical: str, fields: dict, size: int, sha256: str, quant: str | None, source: str
    ) -> InstalledModel:
        path = self.manifest_path(canonical)
        previous = self._read_manifest(path) if path.exists() else None
        data = {
            "format": MANIFEST_FORMAT,
            "name": canonical,
            **fields,
            "size": size,
            "sha256": sha256,
            "quant": quant,
            "source": source,
            "modified": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        self.manifests_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=self.manifests_dir, prefix=".", suffix=".tmp", delete=False, encoding="utf-8"
        ) as tmp:
            json.dump(data, tmp, indent=2)
        os.replace(tmp.name, path)
        if previous is not None:
            self._drop_blob_if_unused(previous)
        model = self._read_manifest(path)
        assert model is not None
        return model

    def remove(self, name: str) -> InstalledModel:
        """Forget a model. Its blob is deleted only if it lies in the store and no name uses it.

        A registered local file is only unregistered; the file itself is left alone.
        """
        canonical = self._lookup_name(name)
        path = self.manifest_path(canonical)
        model = self._read_manifest(path)
        if model is None:
            raise LocalLLMError(f"model {canonical} is not installed; see `localllm list`")
        path.unlink()
        self._drop_blob_if_unused(model)
        return model

    def _drop_blob_if_unused(self, model: InstalledModel) -> None:
        if not model.in_store or model.path.parent != self.blobs_dir:
            return
        if any(m.path == model.path for m in self.list()):
            return
        model.path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# What a model argument names (run, show, bench, serve)

Pull = Callable[[str, Store], InstalledModel]
"""pull(name, store): install a model that is not here yet (localllm.pull.pull, with progress)."""


@dataclass(frozen=True)
class ModelFile:
    """The GGUF file a model argument names, and what to call it."""

    path: Path
    name: str  # the installed name, or the file's name for a path given directly
    installed: InstalledModel | None = None  # None for a path given directly


def find_model(
    name_or_path: str,
    store: Store | None = None,
    *,
    pull: Pull | None = None,
    status: Callable[[str], None] | None = None,
) -> ModelFile:
    """The model a `run`, `show`, `bench` or `serve` argument names: a .gguf path (used in place,
    not registered), an installed model, or, given `pull`, one pulled now (saying so to `status`).

    Without `pull`, a model that is not installed is a LocalLLMError saying how to pull it. The
    download stack (httpx, huggingface_hub) is never imported here: only `pull` may need it.
    """
    if is_path(name_or_path):
        path = Path(name_or_path).expanduser()
        check_not_a_directory(path, name_or_path)
        if not path.is_file():
            raise LocalLLMError(f"model file {name_or_path} not found")
        return ModelFile(path.resolve(), path.name)
    store = store or Store()
    installed = store.resolve(name_or_path)
    if installed is None:
        known = store.manifest(name_or_path)
        if known is not None:
            raise LocalLLMError(
                f"the file of {known.name} ({known.path}) is missing; "
                f"pull it again, or forget it with `localllm rm {known.name}`"
            )
        message, to_pull = _not_installed(store, name_or_path)
        if pull is None:
            raise LocalLLMError(f"model {message}; run `localllm pull {to_pull}` first")
        if status is not None:
            status(f"{message}; pulling {'it' if to_pull == name_or_path else to_pull}")
        installed = pull(name_or_path, store)
    return ModelFile(installed.path, installed.name, installed)


def _not_installed(store: Store, name: str) -> tuple[str, str]:
    """(what to say about `name`, which is not installed; the name to pull).

    A name without a tag means its default one (`gemma3` is `gemma3:1b`): that is said, with the
    tags of the same model that are installed, in case one of them was meant.
    """
    canonical = store.canonical_name(name)
    means = ":" not in name.rpartition("/")[2] and canonical != name.lower()
    family = canonical.partition(":")[0]
    others = [
        m.name
        for m in store.list()
        if m.name.partition(":")[0] == family and m.name != canonical and m.path.is_file()
    ]
    message = (
        f"{name} means {canonical}, which is not installed" if means else f"{name} is not installed"
    )
    if others:
        message += f" (installed: {', '.join(others)})"
    return message, canonical if means else name
