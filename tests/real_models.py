"""The three real test models, fetched on first use, and llama.cpp's output for them.

A test asks for a model with `model_path(name)`. The first ask in a session runs the fetch code
of scripts/fetch-test-models (in this process, through runpy: its table of files, sizes and
checksums stays the only one), which downloads and verifies the model into
$LOCALLLM_TEST_MODELS (default ~/.cache/localllm/test-models) when it is missing and costs one
stat() when it is there. A model that cannot be had makes its tests skip, or fail under CI=true;
conftest.py says so once, at the end of the run.

`reference(name)` is llama.cpp's output for a model, from tests/reference/ (made by
scripts/make-llama-cpp-references).
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
FETCH_COMMAND = ".venv/bin/python scripts/fetch-test-models"

_fetch_script = runpy.run_path(str(REPO / "scripts" / "fetch-test-models"))
MODEL_NAMES = list(_fetch_script["MODELS"])

# In the message of every skip (or CI failure) for want of a model: conftest counts them by it.
UNAVAILABLE = "real test model unavailable"
# model name -> why it could not be fetched, for the summary at the end of the run
problems: dict[str, str] = {}


@functools.cache
def _fetch(name: str) -> Path | None:
    """The model's path, downloaded if missing; None (and the reason in `problems`) on failure."""
    try:
        return _fetch_script["fetch"](name)
    except SystemExit as e:  # the script's own errors: "Error: ..."
        problems[name] = str(e.code).removeprefix("Error: ")
    except (OSError, subprocess.SubprocessError) as e:
        problems[name] = f"{type(e).__name__}: {e}"
    return None


def models_dir() -> Path:
    return _fetch_script["models_dir"]()


def model_path(name: str) -> Path:
    """Path of a real test model, fetched on first use; without it the test skips (under
    CI=true it fails)."""
    path = _fetch(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{UNAVAILABLE}: {name} ({problems[name]})")
        # One message for every model, so that `-ra` folds the skips into one line.
        pytest.skip(f"{UNAVAILABLE} (see the summary at the end of the run)")
    return path


def reference(name: str) -> dict:
    """llama.cpp's tokenizations and greedy continuations for a real test model."""
    return json.loads((REFERENCE_DIR / f"{name}.json").read_text(encoding="utf-8"))
