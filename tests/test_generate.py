"""stream_generate's contract: stop strings, max_tokens, Ctrl-C between steps."""

import os
import signal
import threading

import pytest
from real_models import model_path

from localllm.generate import generate, stream_generate
from localllm.models import load_model


@pytest.fixture(scope="module")
def smollm():
    model = load_model(model_path("smollm2-135m"), n_ctx=256, device="cpu")
    yield model
    model.close()


def test_max_tokens_and_finish_reason(smollm):
    responses = list(stream_generate(smollm, "The capital of France is", max_tokens=5))
    assert responses[-1].finish_reason == "length"
    assert responses[-1].generation_tokens == 5
    assert [r.finish_reason for r in responses[:-1]] == [None] * (len(responses) - 1)


def test_stop_string_is_not_emitted(smollm):
    full = generate(smollm, "The capital of France is", max_tokens=12)
    stop = full[3:6]
    text = generate(smollm, "The capital of France is", max_tokens=12, stop=[stop])
    assert text == full[: full.index(stop)]


def test_ctrl_c_stops_between_steps_and_restores_the_handler(smollm):
    """SIGINT during generation becomes KeyboardInterrupt at the next step, never inside a
    kernel; the previous SIGINT handler is back afterwards."""
    before = signal.getsignal(signal.SIGINT)
    steps = stream_generate(smollm, "Once upon a time", max_tokens=50)
    next(steps)
    os.kill(os.getpid(), signal.SIGINT)  # only sets a flag while generation runs
    with pytest.raises(KeyboardInterrupt):
        for _ in steps:
            pass
    assert signal.getsignal(signal.SIGINT) is before


def long_prompt(model, n_tokens: int) -> list[int]:
    words = "the quick brown fox jumps over the lazy dog and keeps on running " * n_tokens
    return model.tokenizer.encode(words, add_special=False)[:n_tokens]


def test_ctrl_c_during_a_long_prompt_stops_within_one_layer(smollm):
    """SIGINT in the middle of a prefill is taken before the next layer, not after the whole
    prompt; the cache keeps the completed chunks only, and the next prompt reuses them."""
    n_layers, n_batch = smollm.config.n_layers, smollm.transformer.n_batch
    ids = long_prompt(smollm, 200)
    checks = []
    signal_at = n_layers + 10  # layer 10 of the second chunk

    def should_stop():
        checks.append(1)
        if len(checks) == signal_at:
            os.kill(os.getpid(), signal.SIGINT)
        return False

    smollm.transformer.cache.clear()
    with pytest.raises(KeyboardInterrupt):
        next(stream_generate(smollm, ids, max_tokens=5, should_stop=should_stop))
    assert len(checks) == signal_at  # the check right after the signal raised
    cache = smollm.transformer.cache
    assert cache.tokens == ids[:n_batch]  # chunk one whole, nothing of the cut chunk two
    first = next(stream_generate(smollm, ids, max_tokens=1))
    assert first.cached_tokens == n_batch


def test_should_stop_cancels_a_long_prompt(smollm):
    """The server's check (a client that left) stops a prefill the same way, off the main
    thread too, where no signal handler can be installed."""
    from localllm.generate import Cancelled

    ids = long_prompt(smollm, 200)
    checks = []

    def should_stop():
        checks.append(1)
        return len(checks) > 5

    def run():
        smollm.transformer.cache.clear()
        next(stream_generate(smollm, ids, max_tokens=5, should_stop=should_stop))

    run_off_main = []
    thread = threading.Thread(target=lambda: run_off_main.append(_raises(run, Cancelled)))
    thread.start()
    thread.join(120)
    assert run_off_main == [True]
    assert len(checks) == 6
    assert smollm.transformer.cache.n_past == 0  # the first chunk was cut too


def _raises(fn, error) -> bool:
    try:
        fn()
    except error:
        return True
    return False
