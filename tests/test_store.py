"""The model store: name validation, the catalog, manifests, blobs, list/remove, local files."""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf_writer import gguf_bytes
from real_models import REPO, model_path

from localllm import store as store_mod
from localllm.errors import LocalLLMError
from localllm.store import (
    Catalog,
    CatalogEntry,
    Store,
    detect_quant,
    find_model,
    load_catalog,
    quant_from_file_name,
    read_file_type,
    validate_name,
    validate_remote_file,
)

HOSTILE_NAMES = [
    "../evil",
    "/etc/passwd",
    "a/../../b",
    "a/./b",
    "a\x00b",
    "a\\b",
    "..\\evil",
    "a\nb",
    "a\tb",
    "",
    ".hidden",
    "a b",
    "a:b:c",
    "a//b",
    "x" * 600,
]


def tiny_gguf(file_type: int | None = 15, pad: int = 1000) -> bytes:
    metadata = {"general.architecture": "llama", "general.description": "x" * pad}
    if file_type is not None:
        metadata["general.file_type"] = file_type
    return gguf_bytes(metadata)


def add_blob(store: Store, name: str, data: bytes, source: str = "test") -> None:
    store.tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = store.tmp_dir / "incoming"
    tmp.write_bytes(data)
    store.install(name, tmp, sha256=hashlib.sha256(data).hexdigest(), source=source)


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*")} if path.exists() else set()


@pytest.fixture
def catalog() -> Catalog:
    entry = CatalogEntry(name="tiny:1m", hf_repo="u/tiny", hf_file="tiny.gguf", default=True)
    return Catalog({entry.name: entry})


@pytest.fixture
def store(catalog) -> Store:
    return Store(catalog=catalog)


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_names_are_rejected_everywhere(name, store, tmp_path):
    before = files_under(tmp_path)
    with pytest.raises(LocalLLMError):
        validate_name(name)
    with pytest.raises(LocalLLMError):
        validate_remote_file(name)
    with pytest.raises(LocalLLMError):
        store.canonical_name(name)
    with pytest.raises(LocalLLMError):
        store.resolve(name)
    with pytest.raises(LocalLLMError):
        store.remove(name)
    with pytest.raises(LocalLLMError):
        store.partial_path(name)
    assert files_under(tmp_path) == before


def test_names_too_long_once_quoted_are_rejected(store):
    name = "a/" * 70 + "a"  # 141 characters, but each "/" becomes "%2F" in the manifest's name
    with pytest.raises(LocalLLMError):
        store.resolve(name)


def test_good_names_and_their_canonical_form(store):
    for name in ["smollm2:135m", "qwen2.5-coder:0.5b", "hf.co/bartowski/Llama-3.2-1B-GGUF:Q4_K_M"]:
        assert validate_name(name) == name
    assert validate_remote_file("sub/dir/Model-Q4_K_M.gguf") == "sub/dir/Model-Q4_K_M.gguf"
    assert store.canonical_name("tiny") == "tiny:1m"  # the catalog's default tag
    assert store.canonical_name("TINY:1M") == "tiny:1m"
    assert store.canonical_name("other") == "other"  # not in the catalog: left alone
    assert store.canonical_name("hf.co/User/Repo") == "hf.co/User/Repo:Q4_K_M"
    assert store.canonical_name("hf.co/User/Repo:q8_0") == "hf.co/User/Repo:Q8_0"
    assert store.canonical_name("huggingface.co/User/Repo") == "hf.co/User/Repo:Q4_K_M"
    assert store.canonical_name("https://huggingface.co/User/Repo:Q6_K") == "hf.co/User/Repo:Q6_K"
    with pytest.raises(LocalLLMError, match="hf.co/USER/REPO"):
        store.canonical_name("hf.co/onlyuser")


def test_root_comes_from_localllm_home(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    assert Store().root == (tmp_path / "home").resolve()
    assert Store(tmp_path / "explicit").root == (tmp_path / "explicit").resolve()
    monkeypatch.delenv("LOCALLLM_HOME")
    assert Store().root == (Path.home() / ".localllm").resolve()


def test_repo_catalog_is_valid_and_matches_the_fetch_script():
    catalog = load_catalog()
    assert catalog.defaults["smollm2"] == "smollm2:135m"
    for entry in catalog.entries.values():
        assert entry.hf_repo or entry.wheels, entry.name
    # The three test models are pinned: size and sha256 as scripts/fetch-test-models has them.
    script = runpy.run_path(str(REPO / "scripts" / "fetch-test-models"))
    for test_name, short_name in [
        ("smollm2-135m", "smollm2:135m"),
        ("gemma3-270m", "gemma3:270m"),
        ("qwen2.5-coder-0.5b", "qwen2.5-coder:0.5b"),
    ]:
        _file, size, sha256, parts = script["MODELS"][test_name]
        entry = catalog.get(short_name)
        assert (entry.size, entry.sha256) == (size, sha256)
        assert [(w.package, w.version, w.member) for w in entry.wheels] == parts


@pytest.mark.parametrize(
    "body, message",
    [
        ('[models."a:1"]\nhf = "u/r"\nfile = "../../evil.gguf"\n', "remote file name"),
        ('[models."a:1"]\nhf = "u/r"\nfile = "/etc/passwd"\n', "remote file name"),
        ('[models."a:1"]\nhf = "../r"\nfile = "m.gguf"\n', "invalid model name"),
        ('[models."a:1"]\nhf = "u/r"\nfile = "m.gguf"\nsha256 = "abc"\n', "sha256"),
        ('[models."a:1"]\ndescription = "no source"\n', "at least one source"),
        ('[models."A:1"]\nhf = "u/r"\nfile = "m.gguf"\n', "lower-case"),
        ('[models."a:1"]\nhf = "u/r"\nfile = "m.gguf"\nsize = 1\nbogus = 2\n', "unknown keys"),
        ('[models."a:1"\n', "not valid TOML"),
    ],
)
def test_bad_catalog_entries_are_rejected(tmp_path, body, message):
    path = tmp_path / "models.toml"
    path.write_text(body)
    with pytest.raises(LocalLLMError, match=message):
        load_catalog(path)


def test_install_list_remove_with_shared_blob(store):
    data_a, data_b = tiny_gguf(15), tiny_gguf(7)
    add_blob(store, "tiny:1m", data_a)
    add_blob(store, "copy:1", data_a)
    add_blob(store, "other:1", data_b)
    models = store.list()
    assert [m.name for m in models] == ["copy:1", "other:1", "tiny:1m"]
    tiny = store.resolve("tiny")  # the bare name means the default tag
    assert tiny is not None and tiny.name == "tiny:1m"
    assert tiny.in_store and tiny.path.parent == store.blobs_dir
    assert tiny.size == len(data_a)
    assert tiny.sha256 == hashlib.sha256(data_a).hexdigest()
    assert tiny.path.name == f"sha256-{tiny.sha256}"
    assert (tiny.quant, store.resolve("other:1").quant) == ("Q4_K_M", "Q8_0")
    assert tiny.source == "test"
    assert len(list(store.blobs_dir.iterdir())) == 2

    store.remove("copy:1")  # the blob is still used by tiny:1m
    assert tiny.path.exists()
    store.remove("tiny:1m")
    assert not tiny.path.exists()
    assert [m.name for m in store.list()] == ["other:1"]
    with pytest.raises(LocalLLMError, match="not installed"):
        store.remove("tiny:1m")
    assert list(store.tmp_dir.iterdir()) == []


def test_reinstalling_a_name_drops_its_old_blob(store):
    add_blob(store, "tiny:1m", tiny_gguf(15))
    old = store.resolve("tiny:1m").path
    add_blob(store, "tiny:1m", tiny_gguf(7))
    assert not old.exists()
    assert store.resolve("tiny:1m").quant == "Q8_0"


def test_resolve_ignores_a_model_whose_file_is_gone(store):
    add_blob(store, "tiny:1m", tiny_gguf())
    store.resolve("tiny:1m").path.unlink()
    assert store.resolve("tiny:1m") is None
    assert [m.name for m in store.list()] == ["tiny:1m"]  # still listed, so it can be removed
    store.remove("tiny:1m")


def test_damaged_manifests_are_reported_and_never_followed(store, tmp_path):
    outside = tmp_path / "precious.gguf"
    outside.write_bytes(b"keep me")
    store.manifests_dir.mkdir(parents=True)
    store.manifest_path("bad:1").write_text("{not json")
    with pytest.raises(LocalLLMError, match="damaged"):
        store.resolve("bad:1")
    relative = os.path.relpath(outside, store.blobs_dir)
    manifest = {"name": "evil:1", "blob": relative, "size": 7, "sha256": "0" * 64,
                "source": "x", "modified": "2025-01-01T00:00:00+00:00"}  # fmt: skip
    store.manifest_path("evil:1").write_text(json.dumps(manifest))
    with pytest.raises(LocalLLMError, match="damaged"):
        store.remove("evil:1")
    assert outside.read_bytes() == b"keep me"


def test_local_file_is_registered_in_place(store, tmp_path, monkeypatch):
    path = tmp_path / "My Model.Q8_0.gguf"
    path.write_bytes(tiny_gguf(file_type=None))
    model = store.register_file(path)
    assert model.name == "my-model.q8_0"
    assert model.path == path.resolve() and not model.in_store
    assert model.quant == "Q8_0"  # no general.file_type: taken from the file name
    assert model.source == "file"
    manifest = json.loads(store.manifest_path(model.name).read_text())
    assert manifest["path"] == str(path.resolve())
    assert not store.blobs_dir.exists()

    calls = []
    monkeypatch.setattr(store_mod, "sha256_file", lambda *a: calls.append(a) or "0" * 64)
    assert store.register_file(path) == model  # unchanged file: not hashed again
    assert calls == []

    assert store.resolve("my-model.q8_0") == model
    store.remove("my-model.q8_0")
    assert path.exists()  # only unregistered
    assert store.list() == []


def test_register_rejects_missing_and_non_gguf_files(store, tmp_path):
    with pytest.raises(LocalLLMError, match="no such file"):
        store.register_file(tmp_path / "missing.gguf")
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"hello world")
    with pytest.raises(LocalLLMError, match="not a GGUF file"):
        store.register_file(not_gguf)
    assert store.list() == []


def test_free_space_check(store, monkeypatch):
    usage = shutil.disk_usage(store.root.parent)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=10 * 2**20))
    with pytest.raises(LocalLLMError, match="not enough disk space"):
        store.check_free_space(10**9)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=10**12))
    store.check_free_space(10**9)


def test_quant_detection(tmp_path):
    assert quant_from_file_name("Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_from_file_name("SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert quant_from_file_name("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") == "Q4_K_M"
    assert quant_from_file_name("model-IQ4_XS.gguf") == "IQ4_XS"
    assert quant_from_file_name("model-bf16.gguf") == "BF16"
    assert quant_from_file_name("model.gguf") is None
    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_gguf(file_type=18, pad=10))
    assert read_file_type(path) == 18
    assert detect_quant(path, "whatever-Q8_0.gguf") == "Q6_K"  # the header wins over the name
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16)  # truncated header
    assert read_file_type(path) is None


def test_quant_of_a_real_model():
    path = model_path("smollm2-135m")
    assert detect_quant(path) == "Q4_1"


def test_the_catalog_is_package_data():
    """A wheel install has no repository around it: the catalog lives inside the package."""
    import localllm
    from localllm.store import catalog_file

    assert Path(str(catalog_file())).parent == Path(localllm.__file__).parent
    assert load_catalog().get("smollm2:135m") is not None


@pytest.mark.slow
def test_the_wheel_carries_the_catalog(tmp_path):
    """`pip install .` (not -e) must ship models.toml; scripts/check-wheel (CI) then runs a
    catalog model from such an install."""
    import subprocess
    import sys
    import zipfile

    repo = Path(__file__).resolve().parent.parent
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(repo)],
        check=True,
    )
    (wheel,) = tmp_path.glob("localllm-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert "localllm/models.toml" in zf.namelist()


# ---------------------------------------------------------------------------------------------
# find_model: what a run/show/bench/serve argument names


def test_find_model_of_a_path_uses_the_file_in_place(store, tmp_path, monkeypatch):
    path = tmp_path / "Some-Model.gguf"
    path.write_bytes(tiny_gguf())
    monkeypatch.chdir(tmp_path)
    found = find_model("./Some-Model.gguf", store)
    assert (found.path, found.name, found.installed) == (path.resolve(), "Some-Model.gguf", None)
    assert store.list() == []  # a path is not registered
    with pytest.raises(LocalLLMError, match="model file ./missing.gguf not found"):
        find_model("./missing.gguf", store)


def test_find_model_of_an_installed_name_and_of_one_that_is_not(store):
    add_blob(store, "tiny:1m", tiny_gguf())
    found = find_model("tiny", store)  # the bare name means the default tag
    assert found.name == "tiny:1m" and found.installed == store.resolve("tiny:1m")
    assert found.path == found.installed.path
    with pytest.raises(LocalLLMError, match=r"other:1 is not installed; run `localllm pull other"):
        find_model("other:1", store)  # without `pull`, nothing is pulled
    found.path.unlink()
    with pytest.raises(LocalLLMError, match=r"the file of tiny:1m .* is missing.*localllm rm"):
        find_model("tiny", store, pull=lambda *a: pytest.fail("a missing file is not pulled"))


def gguf_with_a_tensor() -> bytes:
    weight = np.arange(64, dtype=np.float32).reshape(8, 8)
    return gguf_bytes({"general.architecture": "llama"}, [("w.weight", 0, (8, 8), weight)])


@pytest.mark.parametrize("damage", ["truncated tensor data", "bad header"])
def test_a_broken_local_file_is_not_registered(store, tmp_path, damage):
    data = gguf_with_a_tensor()
    path = tmp_path / "broken.gguf"
    if damage == "truncated tensor data":
        path.write_bytes(data[:-100])  # the header is whole: only the tensor is cut short
        message = "runs past the end of the file"
    else:
        path.write_bytes(data[:4] + b"\x03\x00\x00\x00" + b"\xff" * 16 + data[24:])
        message = "corrupt GGUF file"
    with pytest.raises(LocalLLMError, match=message):
        store.register_file(path)
    assert store.list() == [] and not store.manifests_dir.exists()
    path.write_bytes(data)  # whole again: registered
    assert store.register_file(path).name == "broken"


def test_a_directory_is_not_a_model_file(store, tmp_path, monkeypatch):
    folder = tmp_path / "somedir"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    for given in ["./somedir", "somedir/", str(folder)]:
        with pytest.raises(LocalLLMError, match=r"is a directory, not a \.gguf file; give the"):
            find_model(given, store)
    with pytest.raises(LocalLLMError, match=r"^somedir is a directory"):
        store.register_file(Path("somedir"))
    (folder / "model.gguf").write_bytes(tiny_gguf())
    with pytest.raises(LocalLLMError, match=r"a \.gguf file in it, such as somedir/model\.gguf$"):
        find_model("./somedir", store)
    assert store.list() == []
