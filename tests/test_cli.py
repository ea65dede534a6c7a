"""The command line: through Typer's runner, and through real subprocesses for pipes and signals.

Every model command runs on the smallest real model (smollm2-135m) with `-c 512`, a few tokens
and `--device cpu`, so the tests do not depend on a GPU being there. The store is the temporary
LOCALLLM_HOME from conftest; pulls go to the fake Hub of fake_hub.py, never to the network.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf as gguf_py
import httpx
import pytest
from fake_hub import DATA, FILE, REPO, FakeHub
from gguf_writer import write_gguf
from real_models import model_path
from typer.testing import CliRunner

from localllm.cli import app
from localllm.client import server_url
from localllm.errors import LocalLLMError
from localllm.generate import generate
from localllm.gguf import read_gguf
from localllm.models import load_model
from localllm.prompt import chat_prompt_ids, raw_prompt_ids
from localllm.server_cors import CORSPolicy
from localllm.store import Store, format_bytes

ROOT = Path(__file__).resolve().parent.parent
LOCALLLM = [sys.executable, "-m", "localllm"]
FAST = ["-c", "512", "--device", "cpu"]


@pytest.fixture(scope="module")
def smollm():
    """The model in-process, to compute what the CLI should print."""
    model = load_model(model_path("smollm2-135m"), n_ctx=512, device="cpu")
    yield model
    model.close()


def expected_reply(model, ids: list[int], n: int) -> str:
    """What a fresh `localllm run` prints: greedy, from an empty KV cache (a batched prefill and
    a one-token step from the cache may round differently)."""
    model.transformer.cache.clear()
    return generate(model, ids, max_tokens=n)


def printed(reply: str) -> str:
    """What the one-shot run writes for a reply: it, ending with exactly one newline."""
    return reply if reply.endswith("\n") else reply + "\n"


@pytest.fixture
def hub(monkeypatch):
    server = FakeHub()
    server.files[f"{REPO}/{FILE}"] = DATA
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.server.shutdown()
    server.server.server_close()


def as_from_a_terminal() -> None:
    """In a child before exec: SIGINT's default action, as an interactive shell gives a command.
    A test run started in the background of a script (`cmd &`) ignores SIGINT, and a child
    would inherit that: Python then installs no KeyboardInterrupt, and Ctrl-C tests fail."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def invoke(*args: str, input: str = ""):
    return CliRunner().invoke(app, list(args), input=input)


def localllm(
    *args: str, input: str | None = "", timeout: float = 300
) -> subprocess.CompletedProcess:
    """The CLI in a real process with pipes for stdin, stdout and stderr."""
    return subprocess.run(
        [*LOCALLLM, *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("Error: ") and "Traceback" not in stderr
    return lines[0]


# ---------------------------------------------------------------------------------------------
# run, one-shot


def test_piped_stdin_then_prompt_prints_only_the_reply(smollm):
    path = model_path("smollm2-135m")
    piped = "The sky looks blue because air scatters blue sunlight more than red light.\n"
    result = localllm(
        "run", str(path), "Summarize in a few words.", "--temperature", "0", "-n", "6", *FAST,
        input=piped,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # stdin, a blank line, then PROMPT, through the chat template.
    text = piped.rstrip("\n") + "\n\nSummarize in a few words."
    ids = chat_prompt_ids(smollm, [{"role": "user", "content": text}])
    assert result.stdout == printed(expected_reply(smollm, ids, 6))
    assert result.stdout.strip()
    assert "\x1b" not in result.stdout and "\x1b" not in result.stderr
    assert result.stderr == ""  # no spinner, no progress, no stats without --verbose


def test_raw_greedy_output_is_deterministic_and_equals_generate(smollm):
    args = ["run", str(model_path("smollm2-135m")), "The capital of France is", "--raw"]
    args += ["--temperature", "0", "-n", "4", *FAST]
    first, second = invoke(*args), invoke(*args)
    assert first.exit_code == 0, first.output
    expected = expected_reply(smollm, raw_prompt_ids(smollm, "The capital of France is"), 4)
    assert first.stdout == second.stdout == printed(expected)
    assert "Paris" in expected


def test_system_prompt_threads_and_verbose_stats(smollm):
    system = "Answer in one word."
    result = invoke(
        "run", str(model_path("smollm2-135m")), "Hi", "--system", system, "--temperature", "0",
        "-n", "3", "-t", "2", "--verbose", *FAST,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    assert result.stdout == printed(expected_reply(smollm, chat_prompt_ids(smollm, messages), 3))
    # Ollama's --verbose block, on stderr only.
    for field in ("total duration", "load duration", "prompt eval count", "prompt eval rate"):
        assert field + ":" in result.stderr
    assert re.search(r"^eval count: +\d token\(s\)$", result.stderr, re.M)
    assert re.search(r"^eval rate: +[\d.]+ tokens/s$", result.stderr, re.M)
    assert "duration" not in result.stdout

    def seconds(field: str) -> float:  # "1.234s" or "123.45ms"
        value = re.search(rf"^{field}: +([\d.]+)(m?s)$", result.stderr, re.M)
        return float(value[1]) / (1000 if value[2] == "ms" else 1)

    assert seconds("total duration") >= seconds("load duration")  # as Ollama: total includes load


def test_python_dash_m_localllm_runs_the_cli():
    result = localllm("list")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["NAME", "SIZE", "QUANT", "MODIFIED"]
    assert os.environ["LOCALLLM_HOME"] in result.stderr  # says where the store is


def test_ctrl_c_stops_a_one_shot_run_with_exit_130():
    process = subprocess.Popen(
        [*LOCALLLM, "run", str(model_path("smollm2-135m")), "Tell a long story.", *FAST],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=as_from_a_terminal,
    )
    try:
        assert process.stdout.read(1)  # the reply has started streaming
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130
    assert b"Interrupted" in stderr and b"Traceback" not in stderr


# ---------------------------------------------------------------------------------------------
# run, errors


def test_a_missing_model_file_is_one_error_line():
    result = localllm("run", "./no-such-model.gguf", "Hi")
    assert result.returncode == 1
    assert "no-such-model.gguf not found" in one_error_line(result.stderr)
    assert result.stdout == ""


@pytest.mark.parametrize(
    "option",
    [
        ["--temperature", "warm"],
        ["--temperature", "-1"],
        ["--top-p", "0"],
        ["--min-p", "2"],
        ["--repeat-penalty", "0"],
        ["-c", "0"],
        ["-n", "-2"],
        ["--device", "tpu"],
        ["--no-such-option"],
    ],
)
def test_bad_option_values_are_usage_errors(option):
    result = invoke("run", "./model.gguf", "Hi", *option)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


def test_system_with_raw_is_a_usage_error():
    result = invoke("run", "./model.gguf", "Hi", "--raw", "--system", "Be brief.")
    assert result.exit_code == 2


def test_no_prompt_and_nothing_piped_says_how_to_give_one():
    result = invoke("run", str(model_path("smollm2-135m")), input="")
    assert result.exit_code == 1
    assert "no prompt given" in one_error_line(result.stderr)


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty"])
def test_a_broken_gguf_is_one_error_line(tmp_path, kind):
    bad = tmp_path / "broken.gguf"
    if kind == "truncated":
        with open(model_path("smollm2-135m"), "rb") as f:
            bad.write_bytes(f.read(200_000))
    elif kind == "garbage":
        bad.write_bytes(b"GGUF" + b"\xff" * 4096)
    else:
        bad.write_bytes(b"")
    result = invoke("run", str(bad), "Hi", *FAST)
    assert result.exit_code == 1
    assert "broken.gguf" in one_error_line(result.stderr)
    assert result.stdout == ""


def test_a_hostile_chat_template_is_refused_and_nothing_runs(tmp_path):
    source = read_gguf(model_path("smollm2-135m"))
    target = tmp_path / "pwned"
    payload = f"{{{{ cycler.__init__.__globals__.os.popen('touch {target}').read() }}}}"
    metadata = {**source.metadata, "tokenizer.chat_template": payload}
    tensors = [(t.name, t.ggml_type, t.shape, t.data) for t in source.tensors.values()]
    hostile = write_gguf(tmp_path / "hostile.gguf", metadata, tensors)
    source.close()
    result = invoke("run", str(hostile), "Hi", "-n", "2", *FAST)
    assert result.exit_code == 1
    assert "chat template" in one_error_line(result.stderr)
    assert result.stdout == "" and not target.exists()


def test_show_never_sends_control_characters_from_the_file(tmp_path):
    metadata = {
        "general.architecture": "llama",
        "general.license": "\x1b]0;title\x07MIT",
        "tokenizer.chat_template": "{{ '\x1b[2J' }}{{ messages }}\x9b31m",
    }
    path = write_gguf(tmp_path / "odd.gguf", metadata)
    for args in (["show", str(path)], ["show", str(path), "--json"]):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        assert not any(c in result.stdout for c in "\x1b\x07\x9b")
    assert json.loads(result.stdout)["license"] == metadata["general.license"]
    assert json.loads(result.stdout)["parameters"] == 0


def test_debug_shows_the_traceback(tmp_path):
    result = localllm("show", str(tmp_path / "missing.gguf"), "--debug")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "LocalLLMError" in result.stderr


def test_a_prompt_longer_than_the_context_is_a_clear_error_or_truncated_with_warning(smollm):
    path = str(model_path("smollm2-135m"))
    long_text = " ".join(f"word{i}" for i in range(200))  # several hundred tokens
    result = invoke("run", path, long_text, "-c", "64", "-n", "2", "--device", "cpu")
    assert result.exit_code == 1
    error = one_error_line(result.stderr)
    assert "64" in error and "--ctx-size" in error and "--truncate" in error
    assert result.stdout == ""

    result = invoke("run", path, long_text, "-c", "64", "-n", "2", "--device", "cpu", "--truncate")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("Warning: the prompt did not fit in the context of 64")
    assert "dropped" in result.stderr
    assert result.stdout.strip()


# ---------------------------------------------------------------------------------------------
# pull, list, show, rm


def test_list_show_rm_a_registered_local_file(tmp_path):
    source = model_path("smollm2-135m")
    result = invoke("pull", str(source))
    assert result.exit_code == 0, result.output
    assert "registered in place" in result.stderr
    name = "smollm2-135m-instruct.q4_1"

    listing = invoke("list")
    assert listing.exit_code == 0
    header, row = listing.stdout.splitlines()
    assert header.split() == ["NAME", "SIZE", "QUANT", "MODIFIED"]
    assert row.split()[:4] == [name, "98.4", "MB", "Q4_1"]
    assert os.environ["LOCALLLM_HOME"] in listing.stderr

    data = json.loads(invoke("list", "--json").stdout)
    assert data["store"] == str(Store().root)
    [entry] = data["models"]
    assert entry["name"] == name and entry["path"] == str(source.resolve())
    assert entry["size"] == source.stat().st_size and entry["quant"] == "Q4_1"

    shown = invoke("show", name, "--json")
    assert shown.exit_code == 0, shown.output
    info = json.loads(shown.stdout)
    reader = gguf_py.GGUFReader(source)
    assert info["parameters"] == sum(int(t.n_elements) for t in reader.tensors)
    assert info["parameters"] == sum(math.prod(t.shape) for t in reader.tensors)
    assert info["architecture"] == "llama" and info["context_length"] == 8192
    assert info["quantization"] == "Q4_1" and info["license"] == "apache-2.0"
    assert "<|im_start|>" in info["chat_template"] and info["chat_template_source"] == "file"

    text = invoke("show", name).stdout
    assert "134.52M" in text and "architecture        llama" in text
    assert "Chat template (file)" in text and "apache-2.0" in text

    removed = invoke("rm", name)
    assert removed.exit_code == 0 and "left in place" in removed.stderr
    assert source.exists()  # a registered file is only forgotten
    assert invoke("list").stdout.splitlines()[1:] == []


def test_show_a_gguf_path_directly():
    result = invoke("show", str(model_path("smollm2-135m")))
    assert result.exit_code == 0, result.output
    assert "parameters          134.52M" in result.stdout


def test_show_and_rm_of_a_model_that_is_not_installed():
    shown = invoke("show", "smollm2:135m")
    assert shown.exit_code == 1 and "not installed" in one_error_line(shown.stderr)
    removed = invoke("rm", "smollm2:135m")
    assert removed.exit_code == 1 and "not installed" in one_error_line(removed.stderr)


def test_pull_from_the_hub_then_list_and_rm(hub):
    name = f"hf.co/{REPO}:Q4_K_M"
    result = invoke("pull", f"hf.co/{REPO}")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    [model] = Store().list()
    assert model.name == name and model.in_store and model.path.read_bytes() == DATA
    row = invoke("list").stdout.splitlines()[1].split()
    assert row[0] == name and row[3] == "Q4_K_M"
    assert invoke("rm", name).exit_code == 0
    assert not model.path.exists() and Store().list() == []


def test_pull_errors_are_one_line(hub):
    result = invoke("pull", "hf.co/tester/missing-GGUF")
    assert result.exit_code == 1 and "not found" in one_error_line(result.stderr)
    result = invoke("pull", "evil/../../etc:passwd")
    assert result.exit_code == 1
    assert "invalid model name" in one_error_line(result.stderr)


def test_ctrl_c_during_pull_exits_130_and_the_next_pull_resumes(hub):
    # The body stops after its first chunk until the SIGINT is sent, so that the pull cannot
    # finish first however late this process gets to send it; then it goes on, a chunk per 0.2 s.
    hub.hold = threading.Event()
    hub.delay_s = 0.2
    store = Store()
    process = subprocess.Popen(
        [*LOCALLLM, "pull", f"hf.co/{REPO}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=as_from_a_terminal,
    )
    try:
        deadline = time.monotonic() + 60
        partial = store.partial_path(f"hf.co/{REPO}:Q4_K_M")
        while not (partial.exists() and partial.stat().st_size > 0):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        hub.hold.set()  # the pull's read returns, and the signal is taken
        _, stderr = process.communicate(timeout=30)
    finally:
        hub.hold.set()
        process.kill()
    assert process.returncode == 130, stderr
    assert b"again to resume" in stderr and b"Traceback" not in stderr
    have = partial.stat().st_size
    assert 0 < have < len(DATA) and store.list() == []

    hub.delay_s = 0.0
    result = invoke("pull", f"hf.co/{REPO}")
    assert result.exit_code == 0, result.output
    assert hub.gets(f"{REPO}/{FILE}")[-1] == f"bytes={have}-"
    [model] = store.list()
    assert model.path.read_bytes() == DATA


def test_run_pulls_a_missing_model_first(hub, smollm):
    source = model_path("smollm2-135m")
    hub.files["tester/smol-GGUF/SmolLM2-135M-Instruct.Q4_1.gguf"] = source.read_bytes()
    args = ["run", "hf.co/tester/smol-GGUF:Q4_1", "Hi", "--temperature", "0", "-n", "3", *FAST]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "not installed; pulling" in result.stderr
    ids = chat_prompt_ids(smollm, [{"role": "user", "content": "Hi"}])
    assert result.stdout == printed(expected_reply(smollm, ids, 3))
    [model] = Store().list()
    assert model.name == "hf.co/tester/smol-GGUF:Q4_1" and model.size == source.stat().st_size
    n_requests = len(hub.requests)
    assert invoke(*args).exit_code == 0
    assert len(hub.requests) == n_requests  # installed now: no second download


def test_a_registered_file_that_vanished_is_reported(tmp_path):
    copy = tmp_path / "tiny-copy.gguf"
    shutil.copy(model_path("smollm2-135m"), copy)
    assert invoke("pull", str(copy)).exit_code == 0
    copy.unlink()
    assert "(file missing)" in invoke("list").stdout
    result = invoke("run", "tiny-copy", "Hi")
    assert result.exit_code == 1
    assert "is missing" in one_error_line(result.stderr)


def test_finding_an_installed_model_does_not_import_the_download_stack(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(DATA)
    Store().register_file(path)
    code = (
        "import sys; from localllm.cli import find_or_pull; found = find_or_pull('tiny'); "
        "print(found.name, any(m in sys.modules for m in ('httpx2', 'huggingface_hub')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["tiny", "False"]


# ---------------------------------------------------------------------------------------------
# the one-shot reply's final newline


class Piece:
    def __init__(self, text: str) -> None:
        self.text = text


def pieces(*texts: str, interrupt: bool = False):
    for text in texts:
        yield Piece(text)
    if interrupt:
        raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("texts", "written"),
    [
        (["Hello", " world"], "Hello world\n"),
        (["Hello", " world\n"], "Hello world\n"),  # already ends with one: none added
        (["one\n", "two", ""], "one\ntwo\n"),  # the last piece is often empty
        (["done\n", ""], "done\n"),
        ([""], "\n"),  # an empty reply is still one (empty) line
    ],
)
def test_a_one_shot_reply_ends_with_exactly_one_newline(texts, written):
    from localllm.cli import _print_reply

    out = io.StringIO()  # not a terminal, like a pipe or a file
    final = _print_reply(pieces(*texts), out)
    assert out.getvalue() == written and final.text == texts[-1]


def test_an_interrupted_one_shot_reply_still_ends_its_line():
    from localllm.cli import _print_reply

    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        _print_reply(pieces("Once upon", " a", interrupt=True), out)
    assert out.getvalue() == "Once upon a\n"
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        _print_reply(pieces(interrupt=True), out)  # before any text: nothing at all
    assert out.getvalue() == ""


def test_wc_l_counts_a_one_shot_reply_and_a_file_gets_a_final_newline(smollm, tmp_path):
    prompt = "The capital of France is"
    args = [*LOCALLLM, "run", str(model_path("smollm2-135m")), prompt, "--raw"]
    args += ["--temperature", "0", "-n", "4", *FAST]
    out_file = tmp_path / "out.txt"
    command = f"{shlex.join(args)} | tee {shlex.quote(str(out_file))} | wc -l"
    result = subprocess.run(
        command, shell=True, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    expected = printed(expected_reply(smollm, raw_prompt_ids(smollm, prompt), 4))
    assert out_file.read_text() == expected and expected.endswith("\n")
    assert int(result.stdout) == expected.count("\n") >= 1


def test_pull_of_a_broken_file_registers_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open(model_path("smollm2-135m"), "rb") as f:
        (tmp_path / "broken.gguf").write_bytes(f.read(3_000_000))  # cut in the tensor data
    result = invoke("pull", "./broken.gguf")
    assert result.exit_code == 1
    error = one_error_line(result.stderr)
    assert "broken.gguf" in error and "runs past the end of the file" in error
    assert Store().list() == []


@pytest.mark.parametrize("command", ["run", "show", "pull"])
def test_a_directory_given_as_the_model_says_so(tmp_path, monkeypatch, command):
    (tmp_path / "somedir").mkdir()
    monkeypatch.chdir(tmp_path)
    for given in ["./somedir", str(tmp_path)]:
        result = invoke(command, given, *(["Hi"] if command == "run" else []))
        assert result.exit_code == 1
        error = one_error_line(result.stderr)
        assert error.startswith(f"Error: {given} is a directory, not a .gguf file; give the path")
        assert result.stdout == ""


def test_run_of_a_bare_name_names_the_default_tag_it_pulls_and_the_installed_ones(hub):
    from localllm.store import load_catalog

    default = load_catalog().defaults["gemma3"]
    other = next(n for n in load_catalog().entries if n.startswith("gemma3:") and n != default)
    entry = load_catalog().get(default)
    if entry.sha256 is not None or entry.hf_repo is None:
        pytest.skip(f"{default} is pinned to a checksum the fake Hub cannot serve")
    hub.files[f"{entry.hf_repo}/{entry.hf_file}"] = model_path("smollm2-135m").read_bytes()
    store = Store()
    store.tmp_dir.mkdir(parents=True)
    (store.tmp_dir / "incoming").write_bytes(DATA)
    sha256 = hashlib.sha256(DATA).hexdigest()
    store.install(other, store.tmp_dir / "incoming", sha256=sha256, source="test")
    result = invoke("run", "gemma3", "Hi", "--temperature", "0", "-n", "2", *FAST)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == (
        f"gemma3 means {default}, which is not installed (installed: {other}); pulling {default}"
    )
    assert [m.name for m in Store().list()] == sorted([default, other])


def test_version_comes_from_the_installed_package():
    from importlib.metadata import version

    result = localllm("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"localllm {version('localllm')}\n" and result.stderr == ""


def test_ls_is_list(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(DATA)
    Store().register_file(path)
    for args in (["ls"], ["ls", "--json"]):
        listed, aliased = invoke("list", *args[1:]), invoke(*args)
        assert aliased.exit_code == 0, aliased.output
        assert "tiny" in aliased.stdout
        if args == ["ls"]:  # the MODIFIED column may tick over from "just now" in between
            assert [row.split()[:3] for row in aliased.stdout.splitlines()] == [
                row.split()[:3] for row in listed.stdout.splitlines()
            ]
        else:
            assert aliased.stdout == listed.stdout
    assert "(also: ls)" in invoke("--help").stdout


# ---------------------------------------------------------------------------------------------
# serve --cors-origin


def test_serve_takes_cors_origins_from_the_option_or_the_environment(monkeypatch):
    calls = []
    monkeypatch.setattr("localllm.server.serve", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setenv("LOCALLLM_ORIGINS", "http://a.example, http://b.example:3000")
    assert invoke("serve").exit_code == 0
    assert invoke("serve", "--cors-origin", "http://c.example", "--cors-origin", "*").exit_code == 0
    monkeypatch.delenv("LOCALLLM_ORIGINS")
    assert invoke("serve").exit_code == 0
    origins = [call["cors_origins"] for call in calls]
    assert origins[1] == ["http://c.example", "*"]  # the option replaces the variable
    assert [CORSPolicy(o).origins for o in origins] == [
        ["http://a.example", "http://b.example:3000"],
        ["http://c.example", "*"],
        [],
    ]
    # A value that is not an origin is one error line, before anything listens.
    monkeypatch.undo()
    result = invoke("serve", "-m", str(model_path("smollm2-135m")), "--cors-origin", "localhost")
    assert result.exit_code == 1 and "is not an origin" in one_error_line(result.stderr)


# ---------------------------------------------------------------------------------------------
# ps, stop: against a running server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_server_address_from_options_and_environment(monkeypatch):
    monkeypatch.delenv("LOCALLLM_HOST", raising=False)
    assert server_url() == "http://127.0.0.1:8357"
    assert server_url("10.0.0.2", 7) == "http://10.0.0.2:7"
    cases = {
        "127.0.0.1:9000": "http://127.0.0.1:9000",
        "localhost": "http://localhost:8357",
        ":9000": "http://127.0.0.1:9000",
        "0.0.0.0:9000": "http://127.0.0.1:9000",  # where a server listens, not an address
        "[::1]": "http://[::1]:8357",
        "http://[::1]:9000/": "http://[::1]:9000",
        "https://models.example": "https://models.example:443",
        "http://box:8357/localllm": "http://box:8357/localllm",
    }
    for value, url in cases.items():
        monkeypatch.setenv("LOCALLLM_HOST", value)
        assert server_url() == url, value
    monkeypatch.setenv("LOCALLLM_HOST", "box:9")
    assert server_url(None, 7) == "http://box:7"  # --port wins
    assert server_url("other", None) == "http://other:8357"  # --host wins
    for bad in ["ftp://box", "box:port"]:
        monkeypatch.setenv("LOCALLLM_HOST", bad)
        with pytest.raises(LocalLLMError):
            server_url()


def test_ps_and_stop_without_a_server_say_how_to_start_one(monkeypatch):
    port = free_port()  # nothing listens there
    url = f"http://127.0.0.1:{port}"
    expected = f"Error: no localllm server at {url}; start one with `localllm serve`"
    for args in (["ps", "--port", str(port)], ["stop", "smollm2", "--host", f"127.0.0.1:{port}"]):
        result = invoke(*args)
        assert result.exit_code == 1
        assert one_error_line(result.stderr) == expected
    monkeypatch.setenv("LOCALLLM_HOST", f"127.0.0.1:{port}")
    assert one_error_line(invoke("ps", "--json").stderr) == expected
    # The client is the standard library's: neither ps nor the CLI imports httpx.
    check = (
        "import atexit, sys; atexit.register(lambda: print('httpx' in sys.modules)); "
        "from localllm.cli import main; sys.argv = ['localllm', 'ps']; main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 1 and result.stdout == "False\n", result.stderr


def test_ps_and_stop_talk_to_a_running_server(monkeypatch, tmp_path):
    path = model_path("smollm2-135m")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"  # a file, not a pipe nobody reads while the server runs
    KEEP = ["--keep-alive=-1", *FAST]  # loaded until stopped: ps says Forever
    with log.open("w") as stderr:
        server = subprocess.Popen(
            [
                *LOCALLLM,
                "serve",
                "-m",
                str(path),
                "--port",
                str(port),
                "--api-key",
                "k",
                *KEEP,
                *FAST,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + 120  # only against hangs
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "serve did not start"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        result = invoke("ps", "--port", str(port))
        assert result.exit_code == 1 and "API key" in one_error_line(result.stderr)
        monkeypatch.setenv("LOCALLLM_API_KEY", "k")
        result = invoke("ps", "--port", str(port))
        assert result.exit_code == 0, result.output
        assert result.stdout.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]

        name = "SmolLM2-135M-Instruct.Q4_1"
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
            headers={"Authorization": "Bearer k"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        monkeypatch.setenv("LOCALLLM_HOST", f"127.0.0.1:{port}")
        [entry] = json.loads(invoke("ps", "--json").stdout)["models"]
        assert entry["name"] == name and entry["digest"] == digest
        assert entry["size"] > path.stat().st_size and entry["context_length"] == 512
        result = invoke("ps")
        assert result.exit_code == 0, result.output
        header, row = result.stdout.splitlines()
        assert header.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
        size = format_bytes(entry["size"])  # the file and the KV cache
        assert row.split() == [name, digest[:12], *size.split(), "100%", "CPU", "512", "Forever"]

        result = invoke("stop", "no-such-model")
        assert result.exit_code == 1 and "not found" in one_error_line(result.stderr)
        result = invoke("stop", name)
        assert result.exit_code == 0, result.output
        assert result.stderr == f"{name} is unloaded\n" and result.stdout == ""
        assert invoke("ps").stdout.splitlines()[1:] == []
    finally:
        server.terminate()
        server.wait(timeout=60)
        print(log.read_text())  # shown when the test fails
    assert "Traceback" not in log.read_text()
