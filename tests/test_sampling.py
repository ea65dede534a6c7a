"""Samplers and penalties."""

import numpy as np
import pytest

from localllm.errors import LocalLLMError
from localllm.sampling import make_logits_processors, make_sampler


def test_temperature_zero_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert make_sampler(temperature=0)(logits) == 1


def test_seed_makes_sampling_reproducible():
    logits = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    a = [make_sampler(1.0, 0, 1.0, 0.0, seed=7)(logits) for _ in range(3)]
    s1, s2 = make_sampler(1.0, 0, 1.0, 0.0, seed=7), make_sampler(1.0, 0, 1.0, 0.0, seed=7)
    assert [s1(logits) for _ in range(20)] == [s2(logits) for _ in range(20)]
    assert len(set(a)) == 1


def test_top_k_restricts_candidates():
    logits = np.arange(100, dtype=np.float32) / 10
    sampler = make_sampler(temperature=5.0, top_k=3, top_p=1.0, min_p=0.0, seed=0)
    assert {sampler(logits) for _ in range(200)} <= {97, 98, 99}


def test_top_p_and_min_p_cut_the_tail():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    top_p = make_sampler(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0, seed=0)
    assert {top_p(logits) for _ in range(300)} == {0, 1}
    min_p = make_sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5, seed=0)
    assert {min_p(logits) for _ in range(300)} == {0, 1}


def test_sampling_follows_the_distribution():
    logits = np.log(np.array([0.7, 0.2, 0.1], dtype=np.float32))
    sampler = make_sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    counts = np.bincount([sampler(logits) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.7, 0.2, 0.1], atol=0.03)


def test_repeat_penalty_as_llama_cpp():
    (penalize,) = make_logits_processors(repeat_penalty=2.0, repeat_last_n=2)
    logits = np.array([4.0, -4.0, 4.0, 1.0], dtype=np.float32)
    out = penalize([2, 0, 1], logits)  # only the last 2 tokens (0 and 1) count
    np.testing.assert_allclose(out, [2.0, -8.0, 4.0, 1.0])
    (presence,) = make_logits_processors(presence_penalty=0.5, frequency_penalty=0.25)
    np.testing.assert_allclose(presence([3, 3], logits), [4.0, -4.0, 4.0, 0.0])


def test_no_penalty_means_no_processor():
    assert make_logits_processors() == []


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2), dict(top_k=-1)]
)
def test_bad_settings_are_clear_errors(kwargs):
    with pytest.raises(LocalLLMError):
        make_sampler(**kwargs)
