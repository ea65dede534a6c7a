"""`localllm bench`: what it runs where (depth, prompt, decode after it) and what it reports."""

from __future__ import annotations

import json

import numpy as np
from call_counter import record_passes
from real_models import model_path
from typer.testing import CliRunner

from localllm import bench as bench_mod
from localllm.cli import app
from localllm.gguf import read_gguf
from localllm.models.transformer import Transformer


def test_bench_prefills_at_the_depth_and_decodes_after_the_prompt(monkeypatch):
    calls = []
    forward = Transformer.forward

    def spy(self, token_ids, start_pos, *args, **kwargs):
        calls.append((len(token_ids), start_pos))
        return forward(self, token_ids, start_pos, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", spy)
    path = model_path("smollm2-135m")
    result = bench_mod.bench(
        path, "smollm2", n_prompt=6, n_gen=3, repetitions=2, n_threads=1, depth=5, bandwidth=False
    )
    depth_fill, warm_up, runs = calls[:1], calls[1:5], calls[5:]
    assert depth_fill == [(5, 0)]  # the depth once
    assert warm_up == [(6, 5), (1, 11), (1, 12), (1, 13)]
    # Each repetition: the prompt at the depth, then decode after the prompt.
    assert runs == 2 * [(6, 5), (1, 11), (1, 12), (1, 13)]
    assert result.depth == 5 and result.prompt_tokens == 6 and result.gen_tokens == 3
    with read_gguf(path) as gguf:
        tensors = gguf.tensors
        # SmolLM2 ties its output head to the embedding table: every byte is read per token.
        assert "output.weight" not in tensors
        every_byte = sum(t.n_bytes for t in tensors.values())
        assert result.weight_gb_per_token == round(every_byte / 1e9, 4)
    expected = result.weight_gb_per_token * result.decode_tok_s
    assert abs(result.decode_weight_gb_s - expected) < 0.01


def test_an_untied_output_head_reads_one_embedding_row_per_token():
    class T:
        def __init__(self, n_bytes):
            self.n_bytes = n_bytes

    tensors = {"token_embd.weight": T(1000), "output.weight": T(1000), "blk.0.w": T(10)}
    assert bench_mod.weight_bytes_per_token(tensors) == 1010
    # a MoE layer: a token reads the experts it runs (2 of 8), not all of them
    tensors["blk.0.ffn_up_exps.weight"] = T(800)
    assert bench_mod.weight_bytes_per_token(tensors, n_experts=8, n_used=2) == 1210


def test_read_bandwidth_is_measured():
    assert bench_mod.read_bandwidth_gb_s(1, n_bytes=8 << 20, rounds=2) > 0.1
    assert np.isfinite(bench_mod.read_bandwidth_gb_s(2, n_bytes=8 << 20, rounds=1))


def test_bench_command_prints_the_streamed_bandwidth(monkeypatch):
    monkeypatch.setattr(bench_mod, "BANDWIDTH_BYTES", 8 << 20)
    path = str(model_path("smollm2-135m"))
    result = CliRunner().invoke(
        app, ["bench", path, "-p", "4", "-n", "2", "-d", "3", "-r", "1", "-t", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any(line.startswith("streamed") and "read bandwidth" in line for line in lines)
    assert any(line.startswith("streamed") and "plain read of them" in line for line in lines)
    report = json.loads(lines[-1])
    assert report["depth"] == 3 and report["read_bandwidth_gb_s"] > 0
    assert report["mapped_read_gb_s"] > 0


def test_bench_parallel_runs_the_streams_in_shared_passes(monkeypatch):
    """`bench -np 3`: one stream alone, then three at once on the engine, whose decode steps
    share passes; the table has a row per count and --json gives each count's result."""
    passes = record_passes(monkeypatch)
    path = str(model_path("smollm2-135m"))
    out = CliRunner().invoke(app, ["bench", path, "-p", "8", "-n", "5", "-t", "1", "-np", "3",
                                   "-r", "1", "--json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    results = json.loads(out.output.strip().splitlines()[-1])
    assert [r["streams"] for r in results] == [1, 3]
    assert len(results[1]["ttft_s"]) == 3 and results[1]["gen_tokens"] == 5
    assert max(len(p) for p in passes) == 3  # the three streams' tokens in one pass
    assert "aggregate tok/s" in out.output
