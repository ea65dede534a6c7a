"""`localllm show` reports each architecture's particulars and the tensor types' shares of the
bytes, read from the file itself; `list` names the file's quant."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from typer.testing import CliRunner

from localllm.cli import app
from localllm.describe import byte_share

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


QUANT_FIXTURES = FIXTURES.parent / "quants"


@pytest.mark.parametrize("name", ["IQ4_XS", "IQ1_M"])
def test_show_lists_each_tensor_type_with_its_share_of_the_bytes(name):
    """The types the file holds, the most bytes first, each with its share of the tensor bytes
    (as gguf-py's reader counts them) and its number of tensors."""
    path = QUANT_FIXTURES / f"{name}.gguf"
    n_bytes, counts = {}, {}
    for tensor in gguf.GGUFReader(path).tensors:
        kind = tensor.tensor_type.name
        n_bytes[kind] = n_bytes.get(kind, 0) + int(tensor.n_bytes)
        counts[kind] = counts.get(kind, 0) + 1
    total = sum(n_bytes.values())
    order = sorted(n_bytes, key=lambda kind: -n_bytes[kind])
    assert order[0] == name and len(order) >= 3  # the file's type, then Q6_K embeddings, norms
    expected = ", ".join(f"{k} {100 * n_bytes[k] / total:.1f}% (x{counts[k]})" for k in order)
    result = CliRunner().invoke(app, ["show", str(path)])
    assert result.exit_code == 0, result.output
    assert f"    tensor types        {expected}\n" in result.stdout, result.stdout

    info = json.loads(CliRunner().invoke(app, ["show", str(path), "--json"]).stdout)
    assert info["tensor_bytes"] == {k: n_bytes[k] for k in order}
    assert info["tensor_types"] == {k: counts[k] for k in order}


def test_byte_shares_of_tiny_types_are_not_zero():
    assert byte_share(1, 10_000) == "<0.1%"
    assert byte_share(5, 10_000) == "0.1%"
    assert byte_share(0, 10_000) == "0.0%"
    assert byte_share(2, 3) == "66.7%"


@pytest.mark.parametrize("name", ["IQ4_XS", "IQ1_M"])
def test_list_shows_the_files_quant(name):
    """`list` names an i-quant file's quant (from general.file_type), as Ollama does."""
    path = QUANT_FIXTURES / f"{name}.gguf"
    assert CliRunner().invoke(app, ["pull", str(path)]).exit_code == 0
    listing = CliRunner().invoke(app, ["list"])
    assert listing.exit_code == 0, listing.output
    header, row = listing.stdout.splitlines()
    assert header.split() == ["NAME", "SIZE", "QUANT", "MODIFIED"]
    assert row.split()[3] == name, row
