"""The `localllm` command line: parse, call the library, render. No model logic here.

stdout carries only generated text; progress, stats and errors go to stderr. Errors are one
`Error: ...` line and exit 1 (no traceback without --debug); Ctrl-C exits 130.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from localllm.errors import LocalLLMError

app = typer.Typer(
    name="localllm",
    help="Run GGUF language models locally.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


@app.command()
def run(
    model: str = typer.Argument(..., help="A model file (PATH.gguf)."),
    prompt: str | None = typer.Argument(None, help="Answer this once and exit."),
    raw: bool = typer.Option(False, "--raw", help="Plain completion: no chat template."),
    temperature: float = typer.Option(0.8, "--temperature", "--temp", help="0 means greedy."),
    top_k: int = typer.Option(40, "--top-k", help="0 disables it."),
    top_p: float = typer.Option(0.95, "--top-p"),
    min_p: float = typer.Option(0.05, "--min-p"),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty"),
    seed: int | None = typer.Option(None, "--seed", help="Random seed for sampling."),
    max_tokens: int = typer.Option(256, "-n", "--max-tokens", help="Tokens to generate at most."),
    ctx_size: int | None = typer.Option(
        None, "-c", "--ctx-size", help="Context size (default: min(model's, 4096))."
    ),
    threads: int | None = typer.Option(None, "-t", "--threads", help="CPU threads."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Generate text from MODEL for PROMPT (or stdin) and print it to stdout."""
    from localllm.generate import stream_generate
    from localllm.models import load_model
    from localllm.sampling import make_logits_processors, make_sampler

    sampler = make_sampler(temperature, top_k, top_p, min_p, seed)
    processors = make_logits_processors(repeat_penalty)
    text = _prompt_text(prompt)
    path = Path(model)
    if not path.is_file():
        raise LocalLLMError(f"model file {model} not found")
    loaded = load_model(path, n_ctx=ctx_size, n_threads=threads)
    try:
        for response in stream_generate(
            loaded,
            text,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=processors,
            parse_special=not raw,
        ):
            sys.stdout.write(response.text)
            sys.stdout.flush()
        if sys.stdout.isatty():
            sys.stdout.write("\n")
    finally:
        loaded.close()


def _prompt_text(prompt: str | None) -> str:
    """PROMPT, with piped stdin in front of it (stdin, a blank line, then PROMPT)."""
    piped = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    if piped and prompt:
        return piped.rstrip("\n") + "\n\n" + prompt
    if piped or prompt:
        return piped or prompt
    raise LocalLLMError(
        'no prompt given: pass PROMPT, e.g. localllm run MODEL "Hello", or pipe text in'
    )


def main() -> None:
    """Console entry point: map errors and Ctrl-C to one line on stderr and an exit code."""
    debug = "--debug" in sys.argv or os.environ.get("LOCALLLM_DEBUG") == "1"
    try:
        app()
    except LocalLLMError as e:
        if debug:
            raise
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as e:  # anything unforeseen still gets one line, not a traceback
        if debug:
            raise
        print(f"Error: {type(e).__name__}: {e} (run with --debug for details)", file=sys.stderr)
        sys.exit(EXIT_ERROR)


if __name__ == "__main__":
    main()
