"""localllm's output on a model against llama.cpp's as the reference scripts record it (the
"greedy" cases of tests/fixtures/architectures/*.json and tests/fixtures/quants/*.json), for
test_architectures and test_quant_references."""

from __future__ import annotations

import numpy as np

N_STEPS = 24
# Where llama.cpp's top two logits are closer than this, either token is a fair greedy choice
# (the bound); after such a step the continuations may part, and are compared no further.
NEAR_TIE = 0.3
# Logit tolerances, from the differences measured against llama.cpp over every step of every
# prompt (greedy, both decode kernels, and teacher-forced), and from how much these sharp random
# models amplify rounding: the same model with float32 activations instead of ggml's roundings
# moves its logits by up to 0.07 (F16 weights) and 0.8-2.0 (8-bit quantized weights).
# F16 weights (activations rounded to half, as ggml rounds them): measured at most 0.028.
LOGIT_TOL = 0.1
# Quantized weights (activations quantized to 8-bit blocks, where a value on a rounding boundary
# flips a level): measured at most 0.23 on the architecture cases, 0.41 on the files quantized by
# llama.cpp (tests/fixtures/quants).
LOGIT_TOL_QUANTIZED = 0.5


def greedy(model, prompt: list[int], n_steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill the prompt, then decode one token at a time through the KV cache (as llama.cpp's
    reference did): the argmax tokens and the logits each was chosen from."""
    t = model.transformer
    t.cache.clear()
    logits = t.forward(prompt, 0)
    tokens, rows = [], []
    for step in range(n_steps):
        rows.append(logits)
        tokens.append(int(np.argmax(logits)))
        if step + 1 < n_steps:
            logits = t.forward([tokens[-1]], len(prompt) + step)
    return tokens, rows


def check_greedy(model, ref: dict, tol: float) -> None:
    """N_STEPS greedy steps on each of the reference's prompts: the same tokens as llama.cpp's
    unless after one of its near-ties, the top-5 logits of every step and the whole last logits
    within tol."""
    for i_prompt, expected in enumerate(ref["greedy"]):
        tokens, rows = greedy(model, expected["prompt_ids"], N_STEPS)
        where = (ref["case"], i_prompt)
        for step, (ours, theirs) in enumerate(zip(tokens, expected["greedy_ids"])):
            top = expected["steps"][step]
            ref_logits = np.array(top["top5_logits"])
            diff = np.abs(rows[step][top["top5_ids"]] - ref_logits).max()
            assert diff < tol, (*where, step, diff)
            if ours != theirs:
                gap = ref_logits[0] - ref_logits[1]
                assert gap < NEAR_TIE, (*where, step, ours, theirs, gap)
                break
        else:
            last = np.abs(rows[-1] - np.array(expected["last_logits"])).max()
            assert last < tol, (*where, "last logits", last)


def teacher_forced_logits(transformer, expected) -> np.ndarray:
    """float32[n_steps, vocab]: the logits of each step of llama.cpp's continuation, from one
    pass over prompt + continuation (batched kernels)."""
    ids = expected["prompt_ids"] + expected["greedy_ids"][:-1]
    transformer.cache.clear()
    logits = transformer.forward(ids, 0, all_logits=True)
    return logits[len(expected["prompt_ids"]) - 1 :]


def check_teacher_forced(model, ref: dict, tol: float) -> None:
    """One pass over each prompt + llama.cpp's continuation: every step's top-5 logits within tol,
    its argmax llama.cpp's (or, at a near-tie, its second)."""
    for i_prompt, expected in enumerate(ref["greedy"]):
        logits = teacher_forced_logits(model.transformer, expected)
        for step, top in enumerate(expected["teacher_forced"]):
            ref_logits = np.array(top["top5_logits"])
            diff = np.abs(logits[step][top["top5_ids"]] - ref_logits).max()
            assert diff < tol, (ref["case"], i_prompt, step, diff)
            allowed = {top["top5_ids"][0]}
            if ref_logits[0] - ref_logits[1] < NEAR_TIE:
                allowed.add(top["top5_ids"][1])
            assert int(np.argmax(logits[step])) in allowed, (ref["case"], i_prompt, step)
