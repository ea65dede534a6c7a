"""`localllm show` reports each architecture's particulars, read from the file itself."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from localllm.cli import app

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "architectures"


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("gemma2", ["attention softcap", "final softcap", "sliding window"]),
        ("llama-yarn", ["rope scaling        yarn x4 of 64"]),
        ("llama3-rope-freqs", ["rope scaling        llama3 (rope_freqs.weight)"]),
        ("granite", ["embedding multiplier", "residual multiplier", "logit divisor"]),
        ("qwen3", ["attention heads     4 (1 K/V)"]),
        ("bert-cls", ["pooling             cls", "Chat template (none: an embedding model)"]),
        ("nomic-bert", ["pooling             mean"]),
    ],
)
def test_show_lists_the_architecture_particulars(fixture, expected):
    result = CliRunner().invoke(app, ["show", str(FIXTURES / f"{fixture}.gguf")])
    assert result.exit_code == 0, result.output
    for text in expected:
        assert text in result.stdout, (text, result.stdout)


def test_a_moe_model_shows_its_experts():
    path = FIXTURES / "qwen3moe.gguf"
    if not path.exists():
        pytest.skip("no MoE fixture in this checkout")
    result = CliRunner().invoke(app, ["show", str(path)])
    assert result.exit_code == 0, result.output
    assert "used per token" in result.stdout
