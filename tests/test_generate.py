"""stream_generate's contract: stop strings, max_tokens, Ctrl-C between steps."""

import os
import signal

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
