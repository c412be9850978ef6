"""Nodes held to a CFS quota whose ranks wait for each other: the held waits, simulated.

A node held to a quota of q cores runs its rank at a full core's speed until it has used
q of the period and holds it for the rest. The nodes' periods do not line up, so a rank
that reaches a blocking collective often finds a peer held: it spins (spending its own
node's budget) for the wait's spin, then sleeps between polls until the peer's next
period lets it go on. :func:`simulate` runs a step of CPU segments and ring collectives on
N such nodes, phase by phase, as the code waits (``MpiTransport._poll``), and returns the
step and what the waits cost. It holds where the nodes that share a machine can all run
at a full core at once (one rank a node); where they cannot, the machine's cores hold
them as well and the simulation does not apply.
"""
import dataclasses
import math
import random

__all__ = ["Cpu", "Sync", "Held", "simulate", "applies", "share", "PHASES", "STEPS", "WARMUP"]

# relative period phases simulated (evenly spaced at N = 2, drawn with a fixed seed beyond)
PHASES = 8
# steps simulated per phase, after WARMUP steps that settle the ranks into their pattern
STEPS = 100
WARMUP = 30
_EPS = 1e-12


@dataclasses.dataclass(frozen=True)
class Cpu:
    """CPU seconds every rank's threads spend here (at a full core's speed)."""
    seconds: float


@dataclasses.dataclass(frozen=True)
class Sync:
    """A ring collective of ``rounds`` rounds, each a neighbour exchange whose messages take
    ``latency_s`` once both neighbours have posted them. ``polls``: the training thread
    waits, spinning then sleeping between polls (False: a stream's wait, priced elsewhere)."""
    rounds: int
    latency_s: float
    polls: bool = True


@dataclasses.dataclass
class Held:
    """Per step and rank: the wall time, the CPU, the blocking waits, those of them past the
    spin (a peer held up), and the CPU the waits cost."""
    step_s: float
    cpu_s: float
    waits: float
    held: float
    wait_cpu_s: float


class _Node:
    """One node's quota: its budget spent per period (periods start at ``phase``)."""

    def __init__(self, quota, period, phase):
        self.budget, self.period, self.phase = quota * period, period, phase
        self.used = {}

    def _window(self, t):
        m = math.floor((t - self.phase) / self.period)
        end = self.phase + (m + 1) * self.period
        if end - t < _EPS:
            m, end = m + 1, end + self.period
        return m, end

    def run(self, t, cpu, until=math.inf):
        """Run from wall time ``t`` until ``cpu`` seconds are spent or the wall clock reaches
        ``until``: return (the wall time it ends, the CPU spent). Held past its budget, the
        node runs again when its next period starts."""
        spent = 0.0
        while cpu - spent > _EPS and t < until - _EPS:
            m, end = self._window(t)
            left = self.budget - self.used.get(m, 0.0)
            if left <= _EPS:
                t = end
                continue
            r = min(cpu - spent, left, end - t, until - t)
            t += r
            spent += r
            self.used[m] = self.used.get(m, 0.0) + r
        return t, spent


def share(n, hosts):
    """The share of a core each of N nodes, one rank each, gets on the machines ``hosts``
    ({"hosts": how many, "cpus": each one's}, as the calibration names them) while all of
    them compute at once: 1 where the nodes that share a machine do not outnumber its
    CPUs, else its CPUs over those nodes (the kernel shares the CPUs out evenly)."""
    return min(1.0, hosts["cpus"] / -(-n // hosts["hosts"]))


def applies(n, hosts):
    """Whether :func:`simulate` holds for N nodes on the machines ``hosts``: each can run
    at a full core's speed while the others do (:func:`share`)."""
    return share(n, hosts) >= 1.0


def _phases(n, period):
    if n == 2:
        return [[0.0, period * k / PHASES] for k in range(PHASES)]
    rng = random.Random(n)
    return [[0.0] + [rng.uniform(0, period) for _ in range(n - 1)] for _ in range(PHASES)]


def simulate(step, n, quota, period, spin_s, poll_cpu_s, poll_extra_s, pause_step_s,
             max_pause_s):
    """Simulate ``step`` (a list of :class:`Cpu` and :class:`Sync`, the same on every rank,
    repeated) on ``n`` nodes, each held to ``quota`` cores of every ``period``, the periods
    at relative phases (:data:`PHASES` of them, averaged). A waiting rank spins for
    ``spin_s`` of wall time (spending its budget while it runs), then polls, each poll
    costing ``poll_cpu_s`` and sleeping its pause (ramped by ``pause_step_s`` up to
    ``max_pause_s``) plus ``poll_extra_s``; it goes on when a poll or its spin sees the
    round done. Returns a :class:`Held`."""
    totals = [0.0] * 5
    every = _phases(n, period)
    for phases in every:
        nodes = [_Node(quota, period, p) for p in phases]
        t = [0.0] * n
        cpu = [0.0] * n
        waits = held = wait_cpu = 0.0
        start = None
        for s in range(WARMUP + STEPS):
            if s == WARMUP:
                start, cpu = max(t), [0.0] * n
                waits = held = wait_cpu = 0.0
            for item in step:
                if isinstance(item, Cpu):
                    for i in range(n):
                        t[i], c = nodes[i].run(t[i], item.seconds)
                        cpu[i] += c
                    continue
                for _ in range(item.rounds):
                    done = [max(t[i - 1], t[i], t[(i + 1) % n]) + item.latency_s
                            for i in range(n)]
                    for i in range(n):
                        if not item.polls:
                            t[i] = max(t[i], done[i])
                            continue
                        waits += 1
                        a = t[i]
                        t[i], c = nodes[i].run(a, math.inf, min(done[i], a + spin_s))
                        if t[i] >= done[i] - _EPS:
                            # the spin saw it done (or, held meanwhile, sees it on its return)
                            cpu[i] += c
                            wait_cpu += c
                            continue
                        held += 1
                        pause = 0.0
                        while True:
                            t[i], p = nodes[i].run(t[i], poll_cpu_s)
                            c += p
                            if t[i] >= done[i]:
                                break
                            pause = min(max_pause_s, pause + pause_step_s)
                            t[i] += pause + poll_extra_s
                        cpu[i] += c
                        wait_cpu += c
        k = STEPS * n
        for j, v in enumerate(((max(t) - start) / STEPS, sum(cpu) / k, waits / k, held / k,
                               wait_cpu / k)):
            totals[j] += v
    return Held(*(v / len(every) for v in totals))
