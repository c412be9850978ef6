"""A system's cores (ringnet.perfmodel.system): compute slows down past the cores, and the wait
for a descheduled peer matches a simulation of ranks taking turns on their cores."""
import numpy as np
import pytest

from ringnet import perfmodel as pm
from ringnet.models import build_model

from tests.perfmodel.helpers import round_system


def test_cpu_contention_slows_compute_past_the_cores():
    system = round_system()
    system.cores = 2.0
    assert [system.contention(n) for n in (1, 2, 3, 4)] == [1.0, 1.0, 1.5, 2.0]
    lenet = build_model("lenet")
    free = pm.predict(round_system(), lenet, "ring", 0, 4, 64).compute_s
    assert pm.predict(system, lenet, "ring", 0, 4, 64).compute_s == pytest.approx(2 * free)


def _round_robin_wait(n, cores, slice_s, samples, rng):
    """Simulate: N busy ranks share ``cores`` cores, each core running its N/cores ranks in
    turn for one slice each; a rank blocks on a random peer at a random moment and waits
    until that peer next runs. Returns the mean wait over ``samples`` draws."""
    per_core = max(1, n // cores)                  # N <= cores: each rank has its own
    period = per_core * slice_s
    total = 0.0
    for _ in range(samples):
        peer = int(rng.integers(n))
        turn = peer % per_core                     # its place in its core's rotation
        t = float(rng.uniform(0, 50 * period))
        start = (t // period) * period + turn * slice_s
        while start + slice_s <= t:                # this period's slot is over: the next one
            start += period
        total += max(0.0, start - t)
    return total / samples


@pytest.mark.parametrize("n, cores", [(1, 2), (2, 2), (4, 2), (6, 2), (8, 2), (9, 3), (16, 4)])
def test_scheduling_wait_matches_a_round_robin_simulation(n, cores):
    rng = np.random.default_rng(n * 10 + cores)
    slice_s = 3e-3
    simulated = _round_robin_wait(n, cores, slice_s, 40000, rng)
    assert pm.scheduling_wait(n, cores, slice_s) == pytest.approx(simulated, rel=0.03, abs=1e-9)
    # every rank has a core (N <= cores), or a GPU (no cores): no wait at all
    assert pm.scheduling_wait(min(n, cores), cores, slice_s) == 0.0
    assert pm.scheduling_wait(n, None, slice_s) == 0.0
