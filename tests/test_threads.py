"""Threads: the default count (physical cores), the pool settings, and the tuner that runs on
fewer threads while other processes hold cores (driven by a fake clock: no timing here)."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from real_models import model_path

from localllm.backend import CPUBackend
from localllm.threads import GOMP_SPINCOUNT, ThreadTuner, configure_environment, physical_cores

# seconds per decoded token, measured on qwen2.5-0.5b on 2 cores (tok/s 70 / 40, and with a busy
# loop on one core: 9 / 40)
IDLE = {1: 1 / 40, 2: 1 / 70}
BUSY = {1: 1 / 40, 2: 1 / 9}


class Machine:
    """A fake clock that a step advances by what its thread count costs on this machine."""

    def __init__(self, costs):
        self.now, self.costs, self.counts = 0.0, costs, []

    def clock(self) -> float:
        return self.now

    def run(self, tuner: ThreadTuner, n_steps: int, n_tokens: int = 1) -> list[int]:
        used = []
        for _ in range(n_steps):
            with tuner.step(n_tokens) as n:
                self.now += self.costs[n] * n_tokens
            used.append(n)
        return used


def tuner_on(machine, max_threads=2, **kwargs) -> tuple[ThreadTuner, list[int]]:
    calls: list[int] = []
    return ThreadTuner(max_threads, calls.append, clock=machine.clock, **kwargs), calls


def test_idle_cores_run_on_all_threads():
    machine = Machine(IDLE)
    tuner, set_calls = tuner_on(machine)
    used = machine.run(tuner, 1000)
    assert used.count(2) >= 0.98 * len(used)
    assert machine.now <= 1.01 * 1000 * IDLE[2]  # tries of 1 thread cost under 1%
    assert set_calls[0] == 2 and len(set_calls) < 20  # Numba is told only on a change


def test_a_busy_core_moves_decode_to_one_thread():
    machine = Machine(BUSY)
    tuner, _ = tuner_on(machine)
    used = machine.run(tuner, 1000)
    assert used[10:].count(1) >= 0.98 * len(used[10:])
    assert machine.now <= 1.05 * 1000 * BUSY[1]  # never slower than -t 1 by more than 5%


def test_load_that_comes_and_goes():
    machine = Machine(IDLE)
    tuner, _ = tuner_on(machine)
    machine.run(tuner, 200)
    machine.costs = BUSY  # another process starts: the next step is much slower, and noticed
    used = machine.run(tuner, 50)
    assert used[2:].count(1) >= 46  # on 1 thread after two steps, but for a try of 2
    machine.costs = IDLE  # it ends: tries of 2 threads find it out within the longest interval
    used = machine.run(tuner, 400)
    settled = used[tuner.max_interval + 2 :]
    assert settled.count(2) >= len(settled) - 2


def test_prefill_follows_decode_until_it_has_its_own_figures():
    machine = Machine(BUSY)
    tuner, _ = tuner_on(machine)
    machine.run(tuner, 20)  # decode has found that 1 thread is faster
    assert machine.run(tuner, 1, n_tokens=64) == [1]
    used = machine.run(tuner, 100, n_tokens=64)
    assert used.count(1) >= 90


def test_an_explicit_thread_count_is_kept():
    machine = Machine(BUSY)
    tuner, set_calls = tuner_on(machine, tune=False)
    assert set(machine.run(tuner, 100)) == {2}
    assert set_calls == [2]


def test_many_cores_try_half_of_them_too():
    assert ThreadTuner(16, lambda n: None).candidates == [1, 8, 16]
    assert ThreadTuner(1, lambda n: None).candidates == [1]


def test_physical_cores_count_smt_siblings_once(tmp_path):
    for cpu, siblings in enumerate(["0,2", "1,3", "0,2", "1,3"]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(siblings + "\n")
        (topology / "physical_package_id").write_text("0\n")
    assert physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert physical_cores({0, 2}, tmp_path) == 1  # both threads of one core
    assert physical_cores({0, 1, 7}, tmp_path) == 3  # no topology for cpu7: every CPU counts


def test_pool_settings_leave_the_users_alone():
    env: dict[str, str] = {}
    configure_environment(env)
    assert env["GOMP_SPINCOUNT"] == GOMP_SPINCOUNT and env["OPENBLAS_NUM_THREADS"] == "1"
    env = {"OMP_WAIT_POLICY": "ACTIVE", "OPENBLAS_NUM_THREADS": "4"}
    configure_environment(env)
    assert "GOMP_SPINCOUNT" not in env and env["OPENBLAS_NUM_THREADS"] == "4"


def test_default_threads_are_tuned_and_t_is_exact():
    assert CPUBackend().thread_tuner.candidates[0] == 1
    assert CPUBackend(n_threads=1).thread_tuner.candidates == [1]


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU")
def test_thread_count_does_not_change_the_logits():
    """The tuner may switch counts between steps: every row is computed by one thread, so the
    logits are the same bits with 1 or 2 threads."""
    from localllm.models import load_model

    results = []
    for n in (1, 2):
        model = load_model(model_path("smollm2-135m"), n_ctx=64, n_threads=n, device="cpu")
        try:
            prefill = model.transformer.forward(list(range(1, 40)), 0, all_logits=True)
            decode = model.transformer.forward([5], 39)
            results.append((prefill, decode))
        finally:
            model.close()
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
