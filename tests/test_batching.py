"""Continuous batching: concurrent sequences share one forward pass per step, and each gets
exactly what it gets alone (logits bit for bit, greedy tokens), prompt chunks included."""

import threading

import numpy as np
import pytest
from real_models import MODEL_NAMES, model_path

from localllm.generate import stream_generate
from localllm.models import load_model
from localllm.models.transformer import Transformer
from localllm.server_engine import _END, Engine, Sequence

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time, there", "1, 2, 3, 4,"]


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
    passes: list[list[int]] = []
    original = Transformer.forward_batch

    def counting(self, parts):
        passes.append([len(ids) for _, _, ids, _ in parts])
        return original(self, parts)

    monkeypatch.setattr(Transformer, "forward_batch", counting)
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
