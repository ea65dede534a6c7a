"""The `localllm` command line: parse, call the library, render. No model logic here.

stdout carries only generated text (and the output of list/show); progress, stats, warnings and
errors go to stderr, without colour or spinners when it is not a terminal. Exit codes: 0 ok,
1 error (one `Error: ...` line, no traceback without --debug), 2 usage, 130 interrupted.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager, nullcontext
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import typer
from typer.core import TyperGroup

from localllm.errors import LocalLLMError
from localllm.sampling import DEFAULTS

if TYPE_CHECKING:  # imported where used, so that `localllm list` starts fast
    from localllm.store import InstalledModel, ModelFile, Store

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_DEBUG_KEY = "localllm.debug"


class _Commands(TyperGroup):
    """Maps what escapes any command to an exit code, so every command (including ones added
    later) reports errors the same way."""

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.TyperException, typer.Exit, typer.Abort):
            raise  # usage errors (exit 2) and deliberate exits
        except KeyboardInterrupt:
            _stderr("Interrupted.")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except OSError as e:
            if e.errno == errno.EPIPE:
                raise  # a closed pipe (`| head`): Typer exits quietly
            return _fail(ctx, e)
        except Exception as e:
            return _fail(ctx, e)


def _fail(ctx: typer.Context, error: Exception) -> None:
    if ctx.meta.get(_DEBUG_KEY) or os.environ.get("LOCALLLM_DEBUG") == "1":
        raise error
    if isinstance(error, LocalLLMError):
        _stderr(f"Error: {error}")
    else:  # a bug, not the user's doing: still one line, and how to see more
        _stderr(f"Error: {type(error).__name__}: {error} (run with --debug for the traceback)")
    raise typer.Exit(EXIT_ERROR)


def _set_debug(ctx: typer.Context, value: bool) -> bool:
    if value:
        ctx.meta[_DEBUG_KEY] = True  # meta is shared by the whole context chain
    return value


app = typer.Typer(
    name="localllm",
    cls=_Commands,
    help=(
        "Run GGUF language models locally.\n\n"
        "Models are kept in $LOCALLLM_HOME (default ~/.localllm). Every command takes --debug "
        "to show tracebacks. Exit codes: 0 ok, 1 error, 2 usage, 130 interrupted."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("localllm")
        except PackageNotFoundError:  # a source tree that was never installed
            number = "unknown (not installed; pip install -e .)"
        print(f"localllm {number}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_print_version,
        help="Print the version and exit.",
    ),
) -> None:
    """Run GGUF language models locally."""


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


# Options shared by the commands that load a model (run, and later serve and bench).
DEBUG = typer.Option(False, "--debug", help="Show tracebacks.", callback=_set_debug)
CTX_SIZE = typer.Option(
    None, "-c", "--ctx-size", min=1, help="Context size in tokens [default: min(model's, 4096)]."
)
THREADS = typer.Option(
    None,
    "-t",
    "--threads",
    min=1,
    help="CPU threads, exactly [default: up to the physical cores, fewer while measuring shows "
    "other processes keep them busy].",
)
DEVICE = typer.Option(Device.auto, "--device", help="Where to compute (auto: CUDA if usable).")


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _isatty(stream: Any) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False


def _err_console():
    """A Rich console on stderr; it draws colour and spinners only on a terminal."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


@contextmanager
def _spinner(message: str) -> Iterator[None]:
    """A transient spinner on stderr while something slow happens (nothing when not a tty)."""
    console = _err_console()
    if not console.is_terminal:
        yield
        return
    with console.status(message):
        yield


# ---------------------------------------------------------------------------------------------
# Finding and loading models (also for serve and bench)


def _pull_with_progress(name: str, store: Store) -> InstalledModel:
    """Pull a model for `run` or `bench` with a progress bar on stderr, as `localllm pull` does."""
    from localllm.pull import pull, rich_progress  # httpx, huggingface_hub: only to pull

    with rich_progress(f"pulling {store.canonical_name(name)}") as progress:
        return pull(name, store, progress, status=_stderr)


def find_or_pull(name: str) -> ModelFile:
    """The store.ModelFile for a path, an installed name, or a name pulled now."""
    from localllm.store import find_model

    return find_model(name, pull=_pull_with_progress, status=_stderr)


def open_model(
    name: str, ctx_size: int | None, threads: int | None, device: Device, spinner: bool = True
) -> tuple[Any, str]:
    """Resolve (pulling if needed) and load a model: (localllm.models.Model, display name).

    `spinner` shows one on stderr while loading (if stderr is a terminal).
    """
    from localllm.models import load_model

    found = find_or_pull(name)
    with _spinner(f"loading {found.name}") if spinner else nullcontext():
        model = load_model(found.path, n_ctx=ctx_size, n_threads=threads, device=device.value)
    return model, found.name


# ---------------------------------------------------------------------------------------------
# run


def _positive(value: float) -> float:
    if value <= 0:
        raise typer.BadParameter(f"{value} is not > 0.")
    return value


@app.command()
def run(
    model: str = typer.Argument(
        ..., metavar="NAME", help="A model name (smollm2:135m, hf.co/USER/REPO[:QUANT]) or a .gguf"
    ),
    prompt: str | None = typer.Argument(
        None, metavar="PROMPT", help="Answer this once and exit (piped stdin goes before it)."
    ),
    system: str | None = typer.Option(None, "--system", help="System prompt."),
    raw: bool = typer.Option(False, "--raw", help="Plain completion: no chat template."),
    temperature: float = typer.Option(
        DEFAULTS["temperature"], "--temperature", "--temp", min=0.0, help="0 means greedy."
    ),
    top_k: int = typer.Option(DEFAULTS["top_k"], "--top-k", min=0, help="0 disables it."),
    top_p: float = typer.Option(DEFAULTS["top_p"], "--top-p", min=0.0, max=1.0, callback=_positive),
    min_p: float = typer.Option(DEFAULTS["min_p"], "--min-p", min=0.0, max=1.0),
    repeat_penalty: float = typer.Option(
        DEFAULTS["repeat_penalty"], "--repeat-penalty", callback=_positive, help="1 disables it."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Random seed for sampling."),
    max_tokens: int = typer.Option(
        -1,
        "-n",
        "--max-tokens",
        min=-1,
        help="Tokens to generate at most; -1: until the end of text or a full context.",
    ),
    ctx_size: int | None = CTX_SIZE,
    threads: int | None = THREADS,
    device: Device = DEVICE,
    verbose: bool = typer.Option(
        False, "--verbose", help="Print timings and token rates on stderr."
    ),
    truncate: bool = typer.Option(
        False, "--truncate", help="Keep the end of a prompt too long for the context (warns)."
    ),
    output_format: str | None = typer.Option(
        None,
        "--format",
        metavar="json|SCHEMA.json",
        help="Answer in JSON: any object (json), or following the JSON schema in a file.",
    ),
    think: bool | None = typer.Option(
        None,
        "--think/--no-think",
        help="Thinking models: think and show the thoughts (also in a pipe), or do not think. "
        "Default: as the model's template has it; thoughts dimmed on a terminal, left out of "
        "a pipe.",
    ),
    prompt_cache: bool = typer.Option(
        True,
        "--prompt-cache/--no-prompt-cache",
        help="Read a prompt seen before back from the prompt cache on disk instead of "
        "prefilling it again; a prompt and reply of 256 tokens or more is written to it (in "
        "LOCALLLM_HOME, at most LOCALLLM_PROMPT_CACHE_BYTES, default 4 GiB).",
    ),
    debug: bool = DEBUG,
) -> None:
    """Chat with a model, or answer a prompt once.

    Interactive when stdin and stdout are terminals and no PROMPT is given; otherwise one-shot,
    with only the reply on stdout. The model is pulled first if it is not installed.
    """
    from localllm.options import Options

    if raw and system is not None:
        raise typer.BadParameter("a system prompt needs the chat template", param_hint="--system")
    options = Options(temperature, top_k, top_p, min_p, repeat_penalty, seed, max_tokens)
    json_schema = _json_schema(output_format)  # before loading: fail fast
    interactive = prompt is None and _isatty(sys.stdin) and _isatty(sys.stdout)
    text = None if interactive else _prompt_text(prompt)  # before loading: fail fast
    loaded, label = open_model(model, ctx_size, threads, device, spinner=_isatty(sys.stdout))
    try:
        loaded.check_generates()
        if interactive:
            _chat(loaded, label, system, raw, options, verbose, think, json_schema, prompt_cache)
        else:
            args = (options, verbose, truncate, think, json_schema, prompt_cache)
            _one_shot(loaded, text, system, raw, *args)
    finally:
        loaded.close()


def _json_schema(value: str | None) -> Any:
    """--format: False (text), None ("json": any object) or the schema read from a file."""
    if value is None:
        return False
    if value == "json":
        return None
    path = Path(value).expanduser()
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LocalLLMError(f"cannot read the schema file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise LocalLLMError(f"the schema file {path} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise LocalLLMError(f"the schema in {path} must be a JSON object")
    from localllm.constrained import json_grammar

    json_grammar(schema)  # a schema llguidance cannot compile fails here, before loading
    return schema


def _prompt_text(prompt: str | None) -> str:
    """PROMPT, with piped stdin in front of it (stdin, a blank line, then PROMPT)."""
    piped = "" if sys.stdin is None or _isatty(sys.stdin) else sys.stdin.read()
    if piped.strip() and prompt:
        return piped.rstrip("\n") + "\n\n" + prompt
    if piped.strip() or prompt:
        return prompt or piped
    raise LocalLLMError(
        'no prompt given: pass PROMPT, e.g. localllm run smollm2:135m "Hello", or pipe text in'
    )


def _one_shot(
    model,
    text: str,
    system: str | None,
    raw: bool,
    options,
    verbose: bool,
    truncate: bool,
    think: bool | None = None,
    json_schema: Any = False,
    prompt_cache: bool = False,
) -> None:
    start = time.perf_counter()
    conversation = _conversation(model, system, raw, options, think, json_schema, prompt_cache)
    ids, dropped = conversation.ask(text, truncate=truncate)
    if dropped:
        _stderr(
            f"Warning: the prompt did not fit in the context of {model.n_ctx} tokens; its first "
            f"{dropped} tokens were dropped (--truncate), {len(ids)} tokens remain"
        )
    # Thoughts show on a terminal, and in a pipe when --think asks for them.
    show = think is not False and (think is True or _isatty(sys.stdout))
    inside = conversation.reply_opens_thinking
    with closing(conversation.generate(ids)) as replies:
        final = _print_reply(
            replies, sys.stdout, conversation.thinks, show_thinking=show, inside_thinking=inside
        )
    if final.finish_reason == "length" and conversation.context_is_full():
        _stderr(f"Warning: the reply stopped because the context ({model.n_ctx} tokens) is full")
    if verbose:
        from localllm.describe import format_stats

        total = model.load_seconds + time.perf_counter() - start  # Ollama's total includes load
        _stderr(format_stats(final, model.load_seconds, total))


def _print_reply(
    replies: Iterator[Any],
    out: TextIO,
    thinks: bool = False,
    show_thinking: bool = True,
    inside_thinking: bool = False,
) -> Any:
    """Write a reply to `out` as it streams and return its last response.

    The text ends with exactly one newline, on a terminal or not (so `| wc -l` counts the last
    line, and a file gets a final newline); a reply that ends with one gets none added. On a
    terminal a spinner turns on stderr while the prompt is prefilled. A thinking model's thoughts
    are set apart (thinking.ThinkingDisplay), or left out without `show_thinking`.
    """
    from localllm.thinking import ThinkingDisplay

    tty = _isatty(out)
    display = ThinkingDisplay(
        out.write, thinks=thinks, show=show_thinking, dim=tty, inside=inside_thinking
    )
    finished = False
    try:
        with _spinner("thinking") if tty else nullcontext():
            first = next(replies)
        for final in itertools.chain([first], replies):
            display.write(final.text)
            out.flush()
        finished = True
    finally:  # also after Ctrl-C: the shell prompt starts on a line of its own
        display.close()
        last_char = display.last_char
        if last_char != "\n" and (last_char or finished or tty):
            out.write("\n")
        out.flush()
    return final


def _chat(
    model,
    label: str,
    system: str | None,
    raw: bool,
    options,
    verbose: bool,
    think=None,
    json_schema: Any = False,
    prompt_cache: bool = False,
) -> None:
    from localllm.chat import ChatSession

    conversation = _conversation(model, system, raw, options, think, json_schema, prompt_cache)
    ChatSession(conversation, label, verbose=verbose).run()


def _conversation(model, system, raw, options, think, json_schema, prompt_cache):
    """The Conversation `run` holds, one-shot or in the chat, with its flags applied."""
    from localllm.conversation import Conversation

    conversation = Conversation(model, system=system, raw=raw, options=options)
    conversation.think = think
    conversation.json_schema = json_schema
    if prompt_cache:
        conversation.use_prompt_cache()
    return conversation


# ---------------------------------------------------------------------------------------------
# pull, list, show, rm


@app.command()
def pull(
    model: str = typer.Argument(
        ..., metavar="NAME", help="smollm2:135m, hf.co/USER/REPO[:QUANT], or ./file.gguf"
    ),
    debug: bool = DEBUG,
) -> None:
    """Download a model into the store.

    Resumable: after Ctrl-C or a dropped connection, pull again to continue. The file's sha256
    is checked before the model counts as installed. A local .gguf file is registered in place,
    not copied.
    """
    from localllm.pull import is_path, rich_progress
    from localllm.pull import pull as pull_model
    from localllm.store import Store, format_bytes

    store = Store()
    what = model if is_path(model) else store.canonical_name(model)
    try:
        with rich_progress("hashing" if is_path(model) else f"pulling {what}") as progress:
            installed = pull_model(model, store, progress, status=_stderr)
    except KeyboardInterrupt:
        _stderr(f"Interrupted. Run `localllm pull {model}` again to resume.")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    where = "registered in place" if not installed.in_store else f"in {store.root}"
    quant = f", {installed.quant}" if installed.quant else ""
    _stderr(f"{installed.name}: {format_bytes(installed.size)}{quant}, {where}")


@app.command("list")
def list_models(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    debug: bool = DEBUG,
) -> None:
    """List the installed models (also: ls).

    A table of NAME, SIZE, QUANT and MODIFIED on stdout; where the store is on stderr.
    """
    from localllm.store import Store, format_bytes

    store = Store()
    models = store.list()
    if as_json:
        rows = [
            {
                "name": m.name,
                "size": m.size,
                "quant": m.quant,
                "modified": m.modified.isoformat(),
                "path": str(m.path),
                "sha256": m.sha256,
                "source": m.source,
                "in_store": m.in_store,
                "missing": not m.path.is_file(),
            }
            for m in models
        ]
        print(json.dumps({"store": str(store.root), "models": rows}, indent=2))
        return
    now = datetime.now(timezone.utc)
    table = [("NAME", "SIZE", "QUANT", "MODIFIED")]
    for m in models:
        name = m.name if m.path.is_file() else f"{m.name} (file missing)"
        table.append((name, format_bytes(m.size), m.quant or "-", _ago(m.modified, now)))
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        print("    ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "    " + row[3])
    count = f"{len(models)} model{'s' * (len(models) != 1)}"
    _stderr(f"{count} in {store.root} (set LOCALLLM_HOME to use another store)")


# `ls`, as in Ollama: the same command, kept out of the command list (`list` names it).
app.command("ls", hidden=True)(list_models)


def _span(seconds: int) -> str | None:
    """'3 minutes' (the largest whole unit, as Ollama shows times), None under a second."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds >= size:
            n = seconds // size
            return f"{n} {unit}{'s' * (n != 1)}"
    return None


def _ago(when: datetime, now: datetime) -> str:
    """'3 minutes ago', as Ollama's list shows it."""
    span = _span(max(0, int((now - when).total_seconds())))
    return f"{span} ago" if span else "just now"


@app.command()
def show(
    model: str = typer.Argument(..., metavar="NAME", help="An installed model or a .gguf file."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    debug: bool = DEBUG,
) -> None:
    """Show what a model is, read from its GGUF file.

    Architecture, parameters (counted from the tensor shapes), context length, quantization,
    the tensor types with their shares of the tensor bytes, chat template and license.
    """
    from localllm.describe import describe_model, info_rows, printable
    from localllm.gguf import read_gguf
    from localllm.store import find_model

    found = find_model(model)  # never pulls
    path, label = found.path, found.name
    with read_gguf(path) as gguf:
        info = describe_model(gguf)
    info = {"model": label, **info}
    if as_json:
        # ASCII-escaped: no control character from the file reaches the terminal.
        print(json.dumps(info, indent=2, default=str))
        return
    print(f"  {printable(label)}")
    for key, value in info_rows(info):
        print(f"    {key:<20}{printable(value if value is not None else '-')}")
    print(f"\n  Chat template ({info['chat_template_source']})")
    for line in info["chat_template"].splitlines():
        print(f"    {printable(line)}")
    print("\n  License")
    print(f"    {printable(info['license'] or '-')}")


@app.command()
def rm(
    model: str = typer.Argument(..., metavar="NAME", help="An installed model."),
    debug: bool = DEBUG,
) -> None:
    """Remove a model from the store.

    Its file is deleted unless another name uses it; a registered local file is only forgotten.
    """
    from localllm.store import Store

    removed = Store().remove(model)
    if removed.in_store:
        _stderr(f"deleted {removed.name}")
    else:
        _stderr(f"forgot {removed.name} (the file {removed.path} was left in place)")


# The server (`serve`, localllm.server.serve) and `bench` commands are defined after this line;
# they load models with open_model() and take the CTX_SIZE, THREADS, DEVICE and DEBUG options.


SERVE_MODELS = typer.Option(
    None,
    "--model",
    "-m",
    metavar="NAME",
    help="Model to serve: an installed name or a .gguf path; repeat for more "
    "[default: every installed model]. Never pulled: run `localllm pull` first.",
)

SERVE_CORS_ORIGINS = typer.Option(
    None,
    "--cors-origin",
    metavar="ORIGIN",
    help="Let web pages from ORIGIN (e.g. http://localhost:3000) use the API (CORS); repeat for "
    "more; * allows any (warns) [default: $LOCALLLM_ORIGINS, comma-separated; else none].",
)


@app.command()
def serve(
    model: list[str] | None = SERVE_MODELS,
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on; 0.0.0.0 exposes it to the network."
    ),
    # 8357 = localllm.server.DEFAULT_PORT, written out so that other commands skip FastAPI.
    port: int = typer.Option(8357, "--port", "-p", min=1, max=65535, help="Port."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="LOCALLLM_API_KEY",
        help="Require 'Authorization: Bearer KEY' (clients pass it as their OpenAI API key).",
    ),
    ctx_size: int | None = CTX_SIZE,
    threads: int | None = THREADS,
    device: Device = DEVICE,
    parallel: int = typer.Option(
        4,
        "--parallel",
        min=1,
        help="Requests run at once, their tokens in one batched pass per step.",
    ),
    max_queue: int = typer.Option(
        32, "--max-queue", min=0, help="Requests that may wait beyond those; more get 503."
    ),
    batch_size: int = typer.Option(
        64,
        "--batch-size",
        "-b",
        min=1,
        help="Tokens per batched pass (decode tokens and prompt chunks): a long new prompt "
        "holds running streams back by one such pass per step.",
    ),
    kv_size: int | None = typer.Option(
        None,
        "--kv-size",
        min=1,
        help="Positions of K/V a model's pool holds for all its requests, in pages of 64 "
        "(default: --parallel x the context size). Requests take pages as they grow; finished "
        "ones leave theirs cached for requests that repeat their prefix, until needed.",
    ),
    cors_origin: list[str] | None = SERVE_CORS_ORIGINS,
    keep_alive: str = typer.Option(
        "5m",
        "--keep-alive",
        envvar="LOCALLLM_KEEP_ALIVE",
        help="How long an idle model stays loaded: a duration (30s, 5m, 1h) or seconds; "
        "-1 keeps it loaded. Ollama requests may ask for their own (keep_alive).",
    ),
    debug: bool = DEBUG,
) -> None:
    """Serve OpenAI's, Ollama's and Anthropic's APIs (/v1/chat/completions, /api/chat,
    /v1/messages, ...) on localhost."""
    from localllm.server import serve as run_server
    from localllm.server_ollama import keep_alive_seconds

    try:
        keep = keep_alive_seconds(keep_alive)
    except ValueError as e:
        raise LocalLLMError(f"--keep-alive: {e}") from None

    # Comma-separated, like OLLAMA_ORIGINS; the option, when given, replaces the variable.
    origins = cors_origin or os.environ.get("LOCALLLM_ORIGINS", "").split(",")
    run_server(
        model or [],
        host=host,
        port=port,
        api_key=api_key,
        n_ctx=ctx_size,
        n_threads=threads,
        device=device.value,
        parallel=parallel,
        max_queue=max_queue,
        batch_size=batch_size,
        kv_size=kv_size,
        log_level="debug" if debug else "info",
        cors_origins=origins,
        keep_alive=keep,
    )


PARALLEL_STREAMS = typer.Option(
    None,
    "--parallel",
    "-np",
    min=1,
    help="Concurrent streams on the server's engine (repeatable, e.g. -np 4 -np 8): aggregate "
    "tok/s beside one stream's and time to first token, like llama-batched-bench.",
)


@app.command()
def bench(
    model: str = typer.Argument(..., metavar="MODEL", help="A model name or a .gguf path."),
    prompt_tokens: int = typer.Option(512, "-p", "--prompt-tokens", min=0, help="Prefill length."),
    gen_tokens: int = typer.Option(128, "-n", "--gen-tokens", min=0, help="Tokens to decode."),
    depth: int = typer.Option(
        0, "-d", "--depth", min=0, help="Tokens already in the KV cache before the prompt."
    ),
    repetitions: int = typer.Option(
        3, "-r", "--repetitions", min=1, help="Runs; the median counts."
    ),
    threads: int | None = THREADS,
    device: Device = DEVICE,
    bandwidth: bool = typer.Option(
        True, "--bandwidth/--no-bandwidth", help="Also measure the machine's read bandwidth."
    ),
    parallel: list[int] | None = PARALLEL_STREAMS,
    as_json: bool = typer.Option(
        False, "--json", help="Also print one JSON object as the last line of stdout."
    ),
    debug: bool = DEBUG,
) -> None:
    """Measure prefill (pp512) and decode after it (tg128), GB/s and peak RSS, like llama-bench."""
    from localllm.bench import bench as run_bench

    found = find_or_pull(model)
    if parallel:
        args = (prompt_tokens, gen_tokens, threads, device, repetitions, as_json)
        _bench_parallel(found, parallel, *args)
        return
    result = run_bench(
        found.path,
        found.name,
        prompt_tokens,
        gen_tokens,
        repetitions,
        threads,
        device.value,
        depth=depth,
        bandwidth=bandwidth,
    )
    at = f" @ d{depth}" if depth else ""
    print(f"model        {result.model} ({result.device}, {result.threads} threads)")
    print(f"load         {result.load_s:.2f} s")
    print(f"prefill      {result.prefill_tok_s:.1f} tok/s  (pp{prompt_tokens}{at})")
    print(f"decode       {result.decode_tok_s:.1f} tok/s  (tg{gen_tokens} after the prompt{at})")
    streamed = f"{result.decode_weight_gb_s:.1f} GB/s of weights"
    if result.read_bandwidth_gb_s:
        share = result.decode_weight_gb_s / result.read_bandwidth_gb_s
        streamed += f", {share:.0%} of the {result.read_bandwidth_gb_s:.1f} GB/s read bandwidth"
    if result.mapped_read_gb_s:
        share = result.decode_weight_gb_s / result.mapped_read_gb_s
        streamed += f", {share:.0%} of a plain read of them ({result.mapped_read_gb_s:.1f} GB/s)"
    print(f"streamed     {streamed} ({result.weight_gb_per_token:.3f} GB per token)")
    print(f"peak RSS     {result.peak_rss_mb:.0f} MiB")
    if as_json:
        print(json.dumps(result.as_dict()))


def _bench_parallel(found, streams, n_prompt, n_gen, threads, device, reps, as_json) -> None:
    from localllm.bench import bench_parallel

    counts = sorted(set(streams) | {1})  # one stream alone is what the ratio is against
    results = bench_parallel(
        found.path, found.name, counts, n_prompt, n_gen, threads, device.value, reps
    )
    first = results[0]
    print(
        f"model        {first.model} ({first.threads} threads), prompt {first.prompt_tokens}, "
        f"{first.gen_tokens} tokens per stream, best of {reps}"
    )
    print("streams  aggregate tok/s  x one  decode tok/s  TTFT median / max (s)")
    for r in results:
        ratio = r.aggregate_tok_s / first.aggregate_tok_s if first.aggregate_tok_s else 0.0
        ttft = sorted(r.ttft_s)
        print(
            f"{r.streams:7d}  {r.aggregate_tok_s:15.1f}  {ratio:5.2f}  {r.decode_tok_s:12.1f}  "
            f"{ttft[len(ttft) // 2]:.2f} / {ttft[-1]:.2f}"
        )
    if as_json:
        print(json.dumps([r.as_dict() for r in results]))


# ---------------------------------------------------------------------------------------------
# ps, stop: a running server's loaded models (localllm.client, Ollama's /api/ps and keep_alive 0)

SERVER_HOST = typer.Option(
    None,
    "--host",
    help="The server: HOST, HOST:PORT or a URL [default: $LOCALLLM_HOST, else 127.0.0.1:8357].",
)
SERVER_PORT = typer.Option(None, "--port", "-p", min=1, max=65535, help="The server's port.")
SERVER_KEY = typer.Option(
    None, "--api-key", envvar="LOCALLLM_API_KEY", help="The key the server was started with."
)


@app.command()
def ps(
    as_json: bool = typer.Option(False, "--json", help="Print the server's JSON."),
    host: str | None = SERVER_HOST,
    port: int | None = SERVER_PORT,
    api_key: str | None = SERVER_KEY,
    debug: bool = DEBUG,
) -> None:
    """List the models loaded in a running server (`localllm serve`).

    A table of NAME, ID, SIZE (file and KV cache), PROCESSOR, CONTEXT and UNTIL, as `ollama ps`.
    """
    from localllm.client import loaded_models, server_url
    from localllm.store import format_bytes

    models = loaded_models(server_url(host, port), api_key)
    if as_json:
        print(json.dumps({"models": models}, indent=2))
        return
    now = datetime.now(timezone.utc)
    table = [("NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL")]
    for m in models:
        size, vram = int(m.get("size", 0)), int(m.get("size_vram", 0))
        table.append(
            (
                str(m.get("name", "")),
                str(m.get("digest", ""))[:12],
                format_bytes(size),
                _processor(size, vram),
                str(m.get("context_length", "")),
                _until(str(m.get("expires_at", "")), now),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("    ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "    " + row[-1])


def _processor(size: int, vram: int) -> str:
    """Where a model's memory is, as `ollama ps` says it."""
    if vram == 0:
        return "100% CPU"
    if vram == size:
        return "100% GPU"
    if vram > size or size == 0:
        return "Unknown"
    cpu = round((size - vram) / size * 100)
    return f"{cpu}%/{100 - cpu}% CPU/GPU"


def _until(expires_at: str, now: datetime) -> str:
    """'Forever', 'Stopping...' (its unload waits for running requests) or '4 minutes from now'."""
    try:
        when = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return "-"
    seconds = int((when - now).total_seconds())
    if seconds <= 0:
        return "Stopping..."
    if seconds > 20 * 365 * 86400:  # what Ollama shows for a model kept loaded
        return "Forever"
    span = _span(seconds)
    return f"{span} from now" if span else "now"


@app.command()
def stop(
    model: str = typer.Argument(..., metavar="NAME", help="A model loaded in the server."),
    host: str | None = SERVER_HOST,
    port: int | None = SERVER_PORT,
    api_key: str | None = SERVER_KEY,
    debug: bool = DEBUG,
) -> None:
    """Unload a model from a running server (`localllm serve`).

    Requests running on it are not cut short: it is unloaded when the last of them ends. A later
    request loads it again.
    """
    from localllm.client import loaded_models, server_url, unload

    url = server_url(host, port)
    name = unload(url, model, api_key)
    if any(m.get("name") == name for m in loaded_models(url, api_key)):
        _stderr(f"{name} will be unloaded when its running requests end")
    else:
        _stderr(f"{name} is unloaded")


def main() -> None:
    """Console entry point (`localllm`, `python -m localllm`)."""
    app()


if __name__ == "__main__":
    main()
