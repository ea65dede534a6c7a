"""Continuous batching: concurrent sequences share one forward pass per step, and each gets
exactly what it gets alone (logits bit for bit, greedy tokens), prompt chunks included."""

import threading
from pathlib import Path

import numpy as np
import pytest
from call_counter import record_passes
from real_models import MODEL_NAMES, model_path

from localllm.generate import stream_generate
from localllm.models import load_model
from localllm.models.transformer import Transformer
from localllm.server_engine import _END, Engine, Sequence

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time, there", "1, 2, 3, 4,"]


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "architectures"


@pytest.fixture(scope="module", params=MODEL_NAMES)
def model(request):
    model = load_model(model_path(request.param), n_ctx=256, device="cpu")
    yield model
    model.close()


def _alone(t: Transformer, prompt: list[int], steps: int) -> list[np.ndarray]:
    """The logits of greedy decoding, the sequence alone, one call per step."""
    cache = t.new_cache()
    logits = [t.forward(prompt, 0, cache=cache)]
    for i in range(steps):
        token = int(np.argmax(logits[-1]))
        logits.append(t.forward([token], len(prompt) + i, cache=cache))
    return logits


def test_forward_batch_equals_each_sequence_alone(model):
    """Four sequences in one pass per step — first all four prompts together, then a mix of
    decode tokens and a late prompt — get the logits they get alone, bit for bit."""
    t = model.transformer
    assert t.batches_exactly  # quantized weights: integer dot products all through
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    steps = 6
    alone = [_alone(t, p, steps) for p in prompts]

    caches = [t.new_cache() for _ in prompts]
    parts = [(caches[k], 0, np.array(prompts[k]), True) for k in range(3)]
    outs = dict(enumerate(t.forward_batch(parts)))  # the fourth arrives one step later
    got = {k: [outs[k]] for k in range(3)}
    pos = {k: len(prompts[k]) for k in range(3)}
    while any(len(got.get(k, [])) <= steps for k in range(4)):
        parts, who = [], []
        for k, logits in got.items():
            if len(logits) <= steps:
                token = int(np.argmax(logits[-1]))
                parts.append((caches[k], pos[k], np.array([token]), True))
                who.append(k)
                pos[k] += 1
        if 3 not in got:  # the late prompt joins the decode tokens of the others
            parts.append((caches[3], 0, np.array(prompts[3]), True))
            who.append(3)
            pos[3] = len(prompts[3])
        for k, logits in zip(who, t.forward_batch(parts), strict=True):
            got.setdefault(k, []).append(logits)
    for k in range(4):
        assert len(got[k]) == steps + 1
        for step, (a, b) in enumerate(zip(alone[k], got[k], strict=True)):
            assert np.array_equal(a, b), f"sequence {k}, step {step}"


def _run_on_engine(engine: Engine, model, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy answers of concurrent sequences on the engine (as the server runs them)."""
    texts = [[] for _ in prompts]
    errors: list[BaseException] = []
    done = threading.Semaphore(0)

    def start(prompt):
        cache = model.transformer.new_cache()
        return (r.text for r in stream_generate(model, prompt, max_tokens, cache=cache))

    def emitter(k):
        def emit(item):
            if isinstance(item, BaseException):
                errors.append(item)
            elif item is not _END:
                texts[k].append(item)
                return
            done.release()

        return emit

    for k, prompt in enumerate(prompts):
        engine.submit(Sequence(lambda p=prompt: start(p), emitter(k)))
    for _ in prompts:
        assert done.acquire(timeout=300)
    assert not errors, errors
    return ["".join(t) for t in texts]


def test_engine_runs_concurrent_requests_in_one_pass_per_step(monkeypatch):
    """Four greedy requests on the engine answer exactly what each answers alone, in about as
    many passes as one of them needs (not four times as many), with small prompt chunks: the
    prompts run beside the decode tokens of the others."""
    model = load_model(model_path("smollm2-135m"), n_ctx=256, device="cpu")
    passes = record_passes(monkeypatch)
    model.transformer.n_batch = 8  # chunked prefill: prompts of 5-11 tokens take 1-2 chunks
    engine = Engine(parallel=4, max_queue=0)
    try:
        alone = [_run_on_engine(engine, model, [p], 12)[0] for p in PROMPTS]
        passes_alone = len(passes)
        passes.clear()
        together = _run_on_engine(engine, model, PROMPTS, 12)
    finally:
        engine.stop()
        model.close()
    assert together == alone
    assert all(sum(p) <= 8 for p in passes), passes  # a pass never exceeds the chunk size
    assert max(len(p) for p in passes) == 4  # all four sequences shared passes
    # alone: ~13 passes each (a prompt chunk or two, then one per token); together the four
    # share them, and prompt chunks queue behind the budget for a few steps at most
    assert len(passes) < passes_alone / 2, (len(passes), passes_alone)


class _Cache:
    """Stands in for a KV cache of unlimited pages, named for its sequence."""

    def __init__(self, name: str) -> None:
        self.name = name

    def trim(self, n: int) -> None:
        pass

    def prepare(self, start: int, n: int) -> None:
        pass


class _CountingModel:
    """Stands in for a Transformer: records each pass as [(sequence, tokens)]."""

    n_batch = 4

    def __init__(self):
        self.passes = []

    def forward_batch(self, parts):
        self.passes.append([(cache.name, len(ids)) for cache, _, ids, _ in parts])
        return [np.zeros(1, np.float32) if wants else None for *_, wants in parts]


def test_a_full_kv_pool_preempts_the_newest_and_the_answers_stay_the_same(monkeypatch):
    """Three sequences whose pages outgrow a hard pool of one context: the newest give theirs
    back and run their tokens again later (from what the prefix cache still holds), the oldest
    always advances, and every answer is the one it gets alone."""
    from localllm.batching import Request

    model = load_model(model_path("smollm2-135m"), n_ctx=128, device="cpu")
    preempted = []
    preempt = Request.preempt
    monkeypatch.setattr(Request, "preempt", lambda r: preempted.append(r.age) or preempt(r))
    model.transformer.size_pool(128, hard=True)  # 2 pages of 64; each sequence needs 2
    engine = Engine(parallel=3, max_queue=0)
    try:
        alone = [_run_on_engine(engine, model, [p], 70)[0] for p in PROMPTS[:3]]
        assert not preempted
        together = _run_on_engine(engine, model, PROMPTS[:3], 70)
        assert model.transformer.pool.n_pages == 2
    finally:
        engine.stop()
        model.close()
    assert together == alone
    assert preempted


def test_batcher_keeps_room_for_prompts_and_rotates_decode_tokens():
    """More decoding sequences than the batch holds, and a long prompt: the prompt advances
    every step (half the batch), and every decoding sequence gets its turn."""
    from greenlet import getcurrent, greenlet

    from localllm.batching import Batcher

    model, batcher = _CountingModel(), Batcher(getcurrent())

    def sequence(name, n_tokens, calls):
        def run():
            for _ in range(calls):
                batcher.forward(model, np.zeros(n_tokens, np.int64), 0, _Cache(name), None)

        g = greenlet(run)
        g.batcher, g.parked = batcher, None
        return g

    decoders = [f"d{k}" for k in range(6)]
    for g in [sequence(name, 1, 3) for name in decoders] + [sequence("prompt", 10, 1)]:
        g.switch()  # runs to its first model call, where it waits
    while batcher.requests:
        batcher.step()
    assert all(sum(n for _, n in p) <= model.n_batch for p in model.passes)
    prompt_steps = [dict(p).get("prompt", 0) for p in model.passes]
    assert prompt_steps[:5] == [2] * 5 and sum(prompt_steps) == 10
    served = [{name for name, _ in p} for p in model.passes]
    for name in decoders:
        assert sum(name in s for s in served) == 3
        waits = [i for i, s in enumerate(served) if name in s]
        assert max(b - a for a, b in zip([-1, *waits], waits)) <= 3  # never left out for long


def test_a_pass_holds_the_engines_step_tokens_below_the_models_chunk_size():
    """A sequence alone prefills in the transformer's chunks (n_batch); batched passes take at
    most the engine's step_tokens (serve --batch-size), however large n_batch is."""
    from greenlet import getcurrent, greenlet

    from localllm.batching import Batcher

    model, batcher = _CountingModel(), Batcher(getcurrent(), step_tokens=3)
    model.n_batch = 16

    def sequence(name, n_tokens):
        def run():
            batcher.forward(model, np.zeros(n_tokens, np.int64), 0, _Cache(name), None)

        g = greenlet(run)
        g.batcher, g.parked = batcher, None
        return g

    for g in (sequence("decode", 1), sequence("prompt", 11)):
        g.switch()
    while batcher.requests:
        batcher.step()
    assert all(sum(n for _, n in p) <= 3 for p in model.passes), model.passes
    assert sum(dict(p).get("prompt", 0) for p in model.passes) == 11


@pytest.mark.parametrize("name", ["gpt-oss", "gemma2", "qwen3moe"])
def test_float_weights_take_turns_and_answer_as_alone(name, monkeypatch):
    """F16 weights run on the float kernels, whose sums depend on the tile a row is in: such a
    model's sequences take one pass each (chunks cut where `forward` cuts them), and answer as
    alone. The fixtures bring sinks and alternating windows, softcaps, experts."""
    model = load_model(FIXTURES / f"{name}.gguf", n_ctx=256, device="cpu")
    assert not model.transformer.batches_exactly
    passes = record_passes(monkeypatch)
    model.transformer.n_batch = 8
    engine = Engine(parallel=3, max_queue=0)
    try:
        prompts = [model.tokenizer.decode(list(range(5 + k, 25 + 3 * k))) for k in range(3)]
        alone = [_run_on_engine(engine, model, [p], 8)[0] for p in prompts]
        together = _run_on_engine(engine, model, prompts, 8)
    finally:
        engine.stop()
        model.close()
    assert together == alone
    assert {len(p) for p in passes} == {1}
