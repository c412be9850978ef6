"""Nodes held to a CFS quota whose ranks wait for each other: the held waits, simulated.

A node held to a quota of q cores runs its rank at a full core's speed until it has used
q of the period and holds it for the rest. The nodes' periods do not line up, so a rank
that reaches a blocking collective often finds a peer held: it spins (spending its own
node's budget) for the wait's spin, then sleeps between polls until the peer's next
period lets it go on. :func:`simulate` runs a step of CPU segments and ring collectives on
N such nodes, phase by phase, as the code waits (``MpiTransport._poll``), and returns the
step and what the waits cost. Where the nodes that share a machine outnumber its CPUs, the
machine's CPUs hold them as well as their quotas: there it runs the nodes together, event
by event, sharing each machine's CPUs among the ranks that compute, a spinning wait taking
only what they leave (it yields).
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
# where the nodes run together on shared CPUs (each step an event walk of them all): the
# sharing soon locks them into one pattern whatever their periods' phases (on the cluster
# records' steps 4 phases of 40 steps gave the step of 8 of 100 to 1e-12)
SHARED_PHASES, SHARED_STEPS, SHARED_WARMUP = 4, 40, 10
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
    """Whether N nodes on the machines ``hosts`` can each run at a full core's speed while
    the others do (:func:`share`): :func:`simulate` then runs them phase by phase, each on
    its own, else together on the machines' shared CPUs."""
    return share(n, hosts) >= 1.0


def _phases(n, period):
    if n == 2:
        return [[0.0, period * k / PHASES] for k in range(PHASES)]
    rng = random.Random(n)
    return [[0.0] + [rng.uniform(0, period) for _ in range(n - 1)] for _ in range(PHASES)]


def simulate(step, n, quota, period, spin_s, poll_cpu_s, poll_extra_s, pause_step_s,
             max_pause_s, hosts=None):
    """Simulate ``step`` (a list of :class:`Cpu` and :class:`Sync`, the same on every rank,
    repeated) on ``n`` nodes, each held to ``quota`` cores of every ``period``, the periods
    at relative phases (:data:`PHASES` of them, averaged). A waiting rank spins for
    ``spin_s`` of wall time (spending its budget while it runs), then polls, each poll
    costing ``poll_cpu_s`` and sleeping its pause (ramped by ``pause_step_s`` up to
    ``max_pause_s``) plus ``poll_extra_s``; it goes on when a poll or its spin sees the
    round done. ``hosts`` ({"hosts", "cpus"}, the nodes filling the machines in order):
    where the nodes of a machine outnumber its CPUs (:func:`applies`), the nodes run
    together on them (:func:`_together`); None or else: each on a core of its own. Returns a
    :class:`Held`."""
    if hosts and not applies(n, hosts):
        return _together(step, n, quota, period, hosts, spin_s, poll_cpu_s, poll_extra_s,
                       pause_step_s, max_pause_s)
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


def _rounds(step):
    """``step`` as the ranks walk it: ("cpu", seconds) and, per round of a collective,
    ("sync", latency, polls)."""
    walk = []
    for item in step:
        if isinstance(item, Cpu):
            if item.seconds > 0:
                walk.append(("cpu", item.seconds, False))
        else:
            walk += [("sync", item.latency_s, item.polls)] * item.rounds
    return walk


def _together(step, n, quota, period, hosts, spin_s, poll_cpu_s, poll_extra_s, pause_step_s,
            max_pause_s):
    """:func:`simulate` where the nodes that share a machine outnumber its CPUs: all ranks
    run together, event by event. On each machine the ranks that compute (or poll) share
    its CPUs evenly, at most a core each; a spinning wait yields, so it runs on what they
    leave (shared evenly, at most a core); a node held by its quota runs nothing until its
    next period, and every CPU second a rank gets spends its node's budget. A round ends
    for a rank ``latency`` after it and both its neighbours have entered it; a spin sees
    that at once where its node is not held, else when it runs again. A stream's wait
    (``polls`` False) takes no CPU. The step is each rank's own, averaged."""
    walk = _rounds(step)
    length, budget = len(walk), quota * period
    phased, steps, warmup = SHARED_PHASES, SHARED_STEPS, SHARED_WARMUP
    per, cpus = -(-n // hosts["hosts"]), hosts["cpus"]
    machines = [list(range(m, min(m + per, n))) for m in range(0, n, per)]
    totals = [0.0] * 5
    every = _phases(n, period)[:phased]
    for phases in every:
        t = 0.0
        at = [0] * n                       # each rank's place in the walk, counted from 0
        state, left, until, pause = ["cpu"] * n, [0.0] * n, [0.0] * n, [0.0] * n
        entered = {}                       # (rank, place) -> when it entered that round
        # each node's current period ends ...
        end = [phases[i] - period * math.ceil(phases[i] / period) + period for i in range(n)]
        used = [0.0] * n                   # ... and the budget spent in it
        cpu, wait_cpu, waits, held = [0.0] * n, [0.0] * n, [0] * n, [0] * n
        marks = [[] for _ in range(n)]

        def done(i):
            g = at[i]
            ends = [entered.get((k % n, g)) for k in (i - 1, i, i + 1)]
            return None if None in ends else max(ends) + walk[g % length][1]

        def enter(i):
            g = at[i]
            if g % length == 0 and g // length in (warmup, warmup + steps):
                marks[i].append((t, cpu[i], waits[i], held[i], wait_cpu[i]))
                if g // length == warmup + steps:
                    state[i] = "end"
                    return
            kind, value, polls = walk[g % length]
            if kind == "cpu":
                state[i], left[i] = "cpu", value
                return
            entered[(i, g)] = t
            if polls:
                waits[i] += 1
                state[i], until[i], pause[i] = "spin", t + spin_s, 0.0
            else:
                state[i] = "block"

        for i in range(n):
            enter(i)
        while state.count("end") < n:
            free = [budget - used[i] > _EPS for i in range(n)]     # not held by its quota
            rate = [0.0] * n
            for machine in machines:
                busy = [i for i in machine if state[i] in ("cpu", "poll") and free[i]]
                spin = [i for i in machine if state[i] == "spin" and free[i]]
                each = min(1.0, cpus / len(busy)) if busy else 0.0
                for i in busy:
                    rate[i] = each
                if spin:
                    rest = min(1.0, max(0.0, cpus - each * len(busy)) / len(spin))
                    for i in spin:
                        rate[i] = rest
            step_s = min(end) - t
            finish = [None] * n
            for i in range(n):
                if rate[i] > 0:
                    step_s = min(step_s, (budget - used[i]) / rate[i])
                    if state[i] in ("cpu", "poll"):
                        step_s = min(step_s, left[i] / rate[i])
                if state[i] in ("spin", "sleep") and until[i] > t:
                    step_s = min(step_s, until[i] - t)
                if state[i] in ("spin", "block", "sleep", "poll"):
                    finish[i] = done(i)
                    if finish[i] is None:
                        continue
                    if finish[i] > t + _EPS:
                        step_s = min(step_s, finish[i] - t)
                    elif state[i] == "block" or state[i] == "spin" and free[i]:
                        step_s = 0.0            # it goes on now
            step_s = max(step_s, 0.0)
            for i in range(n):
                if rate[i] > 0:
                    c = rate[i] * step_s
                    used[i] += c
                    cpu[i] += c
                    if state[i] in ("cpu", "poll"):
                        left[i] -= c
                    if state[i] in ("spin", "poll"):
                        wait_cpu[i] += c
            t += step_s
            for i in range(n):
                if end[i] - t <= _EPS:
                    end[i], used[i] = end[i] + period, 0.0
            for i in range(n):
                s, seen = state[i], finish[i] is not None and finish[i] <= t + _EPS
                runs = budget - used[i] > _EPS             # after this step's spending
                if s == "cpu" and left[i] <= _EPS or s == "block" and seen \
                        or s == "spin" and runs and seen:
                    at[i] += 1
                    enter(i)
                elif s == "spin" and runs and until[i] <= t + _EPS:
                    held[i] += 1
                    state[i], left[i] = "poll", poll_cpu_s
                elif s == "sleep" and until[i] <= t + _EPS:
                    state[i], left[i] = "poll", poll_cpu_s
                elif s == "poll" and left[i] <= _EPS:
                    if seen:
                        at[i] += 1
                        enter(i)
                    else:
                        pause[i] = min(max_pause_s, pause[i] + pause_step_s)
                        state[i], until[i] = "sleep", t + pause[i] + poll_extra_s
        for j in range(5):
            totals[j] += sum(b[j] - a[j] for a, b in marks) / (steps * n)
    return Held(*(v / len(every) for v in totals))
