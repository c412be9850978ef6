"""Nodes held to a CFS quota whose ranks wait for each other (ringnet.perfmodel.held): the
event simulation against a plain clock-tick simulation of the same nodes, closed forms,
and the model's use of it for split-fc on such nodes."""
import dataclasses
import math

import pytest

from ringnet import perfmodel as pm
from ringnet.perfmodel import held
from ringnet.perfmodel.held import Cpu, Sync, simulate
from ringnet.models import build_model

SPIN, POLL, EXTRA, PAUSE_STEP, MAX_PAUSE = 5e-4, 1e-5, 4e-5, 1e-5, 1e-3


def _ticked(step, n, quota, period, phases, steps, warmup, dt=5e-6, machines=None, cpus=1):
    """The same nodes on a clock of ``dt`` ticks: each tick a rank with budget left in its
    node's period runs (computes, spins or polls) for the tick, or for what budget is left
    of it; a spinning rank looks at its
    round each tick it runs, a sleeping one wakes at its pause's end and polls. With
    ``machines`` (lists of ranks sharing ``cpus`` CPUs) a rank runs for its share of the
    tick: those that compute or poll share the CPUs (a core at most), those that spin
    share what they leave, and a spinning rank with budget left looks at its round each
    tick. Returns (step, held waits per step and rank, wait CPU per step and rank)."""
    program = []
    for item in step:
        if isinstance(item, Cpu):
            program.append(("cpu", item.seconds))
        else:
            program += [("round", item.latency_s, item.polls)] * item.rounds
    rounds_per_step = sum(1 for p in program if p[0] == "round")
    budget = quota * period
    used = [0.0] * n
    window = [None] * n
    arrived = [dict() for _ in range(n)]            # round number -> arrival time
    pc, reached = [0] * n, [0] * n                  # program index, rounds reached
    state = [None] * n
    done_steps = [0] * n
    finish = [dict() for _ in range(n)]
    held_waits = [0] * n
    wait_cpu = [0.0] * n
    now = 0.0

    def enter(i):
        kind = program[pc[i]]
        if kind[0] == "cpu":
            state[i] = ["cpu", kind[1]]
        else:
            arrived[i][reached[i]] = now
            state[i] = ["spin" if kind[2] else "block", now, reached[i]]

    def advance(i):
        pc[i] += 1
        if pc[i] == len(program):
            pc[i] = 0
            done_steps[i] += 1
            finish[i][done_steps[i]] = now
        enter(i)

    def done_at(i, k):
        left, right = (i - 1) % n, (i + 1) % n
        if any(k not in arrived[j] for j in (left, i, right)):
            return math.inf
        return max(arrived[j][k] for j in (left, i, right)) + program[pc[i]][1]

    for i in range(n):
        enter(i)
    while min(done_steps) < warmup + steps:
        for i in range(n):
            m = math.floor((now - phases[i]) / period)
            if m != window[i]:
                window[i], used[i] = m, 0.0
        tick = [dt] * n
        for machine in machines or []:
            ready = [i for i in machine if used[i] < budget - 1e-12]
            busy = [i for i in ready if state[i][0] in ("cpu", "poll")]
            spin = [i for i in ready if state[i][0] == "spin"]
            for i in machine:
                tick[i] = 0.0
            for i in busy:
                tick[i] = dt * min(1.0, cpus / len(busy))
            for i in spin:
                tick[i] = dt * min(1.0, (cpus - sum(tick[j] for j in busy) / dt) / len(spin))
        for i in range(n):
            s = state[i]
            counted = done_steps[i] >= warmup
            runs = used[i] < budget - 1e-12          # what budget is left, it runs for
            tick[i] = min(tick[i], budget - used[i])
            if s[0] == "cpu":
                if runs and tick[i]:
                    used[i] += tick[i]
                    s[1] -= tick[i]
                    if s[1] <= 1e-12:
                        advance(i)
            elif s[0] == "block":
                if now >= done_at(i, s[2]):
                    reached[i] += 1
                    advance(i)
            elif s[0] == "spin":
                if runs:
                    used[i] += tick[i]
                    wait_cpu[i] += tick[i] if counted else 0.0
                    if now >= done_at(i, s[2]):
                        reached[i] += 1
                        advance(i)
                    elif now - s[1] >= SPIN:
                        state[i] = ["poll", POLL, s[2], 0.0]
                        held_waits[i] += counted
            elif s[0] == "poll":
                if runs and tick[i]:
                    used[i] += tick[i]
                    wait_cpu[i] += tick[i] if counted else 0.0
                    s[1] -= tick[i]
                    if s[1] <= 1e-12:
                        if now >= done_at(i, s[2]):
                            reached[i] += 1
                            advance(i)
                        else:
                            pause = min(MAX_PAUSE, s[3] + PAUSE_STEP)
                            state[i] = ["sleep", now + pause + EXTRA, s[2], pause]
            elif s[0] == "sleep":
                if now >= s[1]:
                    state[i] = ["poll", POLL, s[2], s[3]]
        now += dt
    assert rounds_per_step
    span = (max(f[warmup + steps] for f in finish) - max(f[warmup] for f in finish)) / steps
    return span, sum(held_waits) / n / steps, sum(wait_cpu) / n / steps


STEP = [Cpu(2.5e-3), Sync(1, 6e-5), Cpu(0.4e-3), Sync(1, 8e-4), Cpu(1.6e-3), Sync(2, 5e-5),
        Cpu(1.0e-3), Sync(1, 0.0, polls=False)]


@pytest.mark.parametrize("n", [2, 4])
def test_the_simulation_matches_a_clock_tick_simulation_of_the_same_nodes(n, monkeypatch):
    """Every relative phase of the nodes' periods the model averages over, simulated event
    by event and tick by tick (5 us): the step, the waits past the spin (a peer held, or a
    round longer than the spin) and what the waits cost agree."""
    monkeypatch.setattr(held, "STEPS", 12)
    monkeypatch.setattr(held, "WARMUP", 6)
    got = simulate(STEP, n, 0.5, 0.01, SPIN, POLL, EXTRA, PAUSE_STEP, MAX_PAUSE)
    ticks = [_ticked(STEP, n, 0.5, 0.01, phases, 12, 6) for phases in held._phases(n, 0.01)]
    step, held_waits, wait_cpu = (sum(t[j] for t in ticks) / len(ticks) for j in range(3))
    assert got.step_s == pytest.approx(step, rel=0.03)
    assert got.held == pytest.approx(held_waits, abs=0.15)
    assert got.wait_cpu_s == pytest.approx(wait_cpu, rel=0.1, abs=5e-5)
    assert got.waits == 4                           # the rounds that poll, a step
    # the quota holds them: some waits outlast the spin beyond the one 0.8 ms round
    assert got.held > 1.05


@pytest.mark.parametrize("quota, hosts", [(0.5, {"hosts": 1, "cpus": 2}),
                                          (0.3, {"hosts": 1, "cpus": 2}),
                                          (0.5, {"hosts": 1, "cpus": 3}),
                                          (0.4, {"hosts": 1, "cpus": 1.5}),
                                          (0.5, {"hosts": 2, "cpus": 1})])
def test_nodes_that_outnumber_their_machine_s_cpus_match_a_clock_tick_simulation(
        quota, hosts, monkeypatch):
    """Four nodes on machines with fewer CPUs than nodes, run together event by event
    (the ranks that compute share the CPUs, a spin takes what they leave) and tick by tick
    (5 us): the step, the waits past the spin and what the waits cost agree, where the
    quota holds the nodes (0.3, and 0.5 on 3 CPUs) and where the CPUs do (0.5 on 2)."""
    monkeypatch.setattr(held, "SHARED_STEPS", 12)
    monkeypatch.setattr(held, "SHARED_WARMUP", 6)
    got = simulate(STEP, 4, quota, 0.01, SPIN, POLL, EXTRA, PAUSE_STEP, MAX_PAUSE, hosts=hosts)
    per = 4 // hosts["hosts"]
    machines = [list(range(m, m + per)) for m in range(0, 4, per)]
    ticks = [_ticked(STEP, 4, quota, 0.01, phases, 12, 6, machines=machines, cpus=hosts["cpus"])
             for phases in held._phases(4, 0.01)[:held.SHARED_PHASES]]
    step, held_waits, wait_cpu = (sum(t[j] for t in ticks) / len(ticks) for j in range(3))
    assert got.step_s == pytest.approx(step, rel=0.02)
    assert got.held == pytest.approx(held_waits, abs=0.15)
    assert got.wait_cpu_s == pytest.approx(wait_cpu, rel=0.05, abs=2e-5)
    assert got.waits == 4
    # a spin that yields to the ranks that compute costs less than one on a CPU of its own
    own = simulate(STEP, 4, quota, 0.01, SPIN, POLL, EXTRA, PAUSE_STEP, MAX_PAUSE)
    assert got.wait_cpu_s < own.wait_cpu_s


def test_nodes_sharing_cpus_closed_forms():
    """Two nodes on one CPU with a whole core's quota compute at half a core each and spin
    through the round together at half a core each; four nodes of half a core on two CPUs
    are held by the CPUs at the quota's own rate, never by the quota (the step twice the
    CPU); at a quarter core each the quota holds them (the step the CPU over the quota)."""
    args = (SPIN, POLL, EXTRA, PAUSE_STEP, MAX_PAUSE)
    two = simulate([Cpu(2e-3), Sync(1, 1e-4)], 2, 1.0, 0.01, *args, hosts={"hosts": 1, "cpus": 1})
    assert two.step_s == pytest.approx(4.1e-3, rel=1e-9)
    assert two.cpu_s == pytest.approx(2.05e-3, rel=1e-9)
    assert two.wait_cpu_s == pytest.approx(0.05e-3, rel=1e-9)
    assert (two.waits, two.held) == (1, 0)
    machine = {"hosts": 1, "cpus": 2}
    half = simulate([Cpu(3e-3), Sync(1, 0.0)], 4, 0.5, 0.01, *args, hosts=machine)
    assert half.step_s == pytest.approx(6e-3, rel=1e-9) and half.held == 0
    quarter = simulate([Cpu(3e-3), Sync(1, 0.0, polls=False)], 4, 0.25, 0.01, *args,
                       hosts=machine)
    assert quarter.step_s == pytest.approx(3e-3 / 0.25, rel=0.02)
    assert quarter.cpu_s == pytest.approx(3e-3, rel=1e-9)


def test_a_ring_round_waits_for_both_neighbours(monkeypatch):
    """Three nodes' periods together and one's half a period apart: a rank waits on its
    successor (its send's receiver) as well as on its predecessor, as the tick simulation
    does: the held waits and the step agree with it."""
    monkeypatch.setattr(held, "STEPS", 12)
    monkeypatch.setattr(held, "WARMUP", 6)
    phases = [0.0, 0.0, 0.0, 0.005]
    monkeypatch.setattr(held, "_phases", lambda n, period: [phases])
    got = simulate(STEP, 4, 0.5, 0.01, SPIN, POLL, EXTRA, PAUSE_STEP, MAX_PAUSE)
    step, held_waits, wait_cpu = _ticked(STEP, 4, 0.5, 0.01, phases, 12, 6)
    assert got.step_s == pytest.approx(step, rel=0.03)
    assert got.held == pytest.approx(held_waits, abs=0.1)
    assert got.wait_cpu_s == pytest.approx(wait_cpu, rel=0.1)


def test_without_a_quota_a_step_is_its_cpu_and_its_rounds():
    """A quota of a whole core never holds a node: the step is its CPU plus its rounds'
    times, a wait spins its round's time, and only a round longer than the spin polls."""
    step = [Cpu(2e-3), Sync(1, 1e-4), Cpu(1e-3), Sync(1, 2e-4)]
    got = simulate(step, 2, 1.0, 0.01, SPIN, POLL, EXTRA, PAUSE_STEP, MAX_PAUSE)
    assert got.step_s == pytest.approx(3.3e-3, rel=1e-9)
    assert got.wait_cpu_s == pytest.approx(3e-4, rel=1e-9)
    assert got.cpu_s == pytest.approx(3.3e-3, rel=1e-9)
    assert (got.waits, got.held) == (2, 0)
    longer = simulate([Cpu(2e-3), Sync(1, 7.05e-4)], 2, 1.0, 0.01, SPIN, POLL, EXTRA,
                      PAUSE_STEP, MAX_PAUSE)
    # spin 0.5 ms, then polls at 0.5, 0.56, 0.63 and 0.71 ms (pauses of 10, 20, 30 us,
    # each 40 us longer): the fourth sees the round done
    assert longer.held == 1
    assert longer.wait_cpu_s == pytest.approx(SPIN + 4 * POLL, rel=1e-9)
    assert longer.step_s == pytest.approx(2e-3 + SPIN + 4 * POLL + 60e-6 + 3 * EXTRA, rel=1e-9)


def test_nodes_whose_periods_line_up_never_hold_each_other(monkeypatch):
    """Periods that start together hold every node at once: no wait outlasts the spin, the
    waits cost nothing (their rounds take no time), and the step is its CPU over the quota."""
    monkeypatch.setattr(held, "_phases", lambda n, period: [[0.0] * n])
    step = [Cpu(3e-3), Sync(1, 0.0), Cpu(4.1e-3), Sync(3, 0.0)]
    got = simulate(step, 4, 0.5, 0.01, SPIN, POLL, EXTRA, PAUSE_STEP, MAX_PAUSE)
    assert got.held == 0 and got.wait_cpu_s == 0
    assert got.step_s == pytest.approx(7.1e-3 / 0.5, rel=0.01)
    # offset by half a period, the same nodes hold each other: waits spin and poll, and the
    # step is still the CPU over the quota, that CPU now with the waits'
    monkeypatch.setattr(held, "_phases", lambda n, period: [[0.0, period / 2] * (n // 2)])
    apart = simulate(step, 4, 0.5, 0.01, SPIN, POLL, EXTRA, PAUSE_STEP, MAX_PAUSE)
    assert apart.held > 0 and apart.wait_cpu_s >= apart.held * SPIN
    assert apart.cpu_s == pytest.approx(7.1e-3 + apart.wait_cpu_s, rel=1e-9)
    assert apart.step_s == pytest.approx(apart.cpu_s / 0.5, rel=0.01)
    assert apart.step_s > got.step_s


def _held_system(**calibration):
    """Two nodes of half a core, one rank each, a fast link, CPU-like compute."""
    from tests.perfmodel.test_perfmodel_system import _calibration
    compute = pm.roofline_compute("k40", ("lenet",)).scaled(40.0)
    costs = {"per_msg_s": 4e-5, "per_byte_s": 3e-10}
    system = pm.make_system("local", compute, 1, _calibration(per_node=1)).at(2)
    return dataclasses.replace(system, calibrated=None, inter=pm.Link("fast", 4e-5, 4e9),
                               intra=pm.Link("fast", 4e-5, 4e9), rooted=None, quota=0.5,
                               quota_period_s=0.01, cpu_stream=costs, cpu_blocking=costs,
                               **calibration)


def test_split_fc_on_held_nodes_takes_the_simulated_step_where_the_nodes_fit_the_machine():
    """With a sleeping poll's cost calibrated and the nodes on a machine with a CPU each,
    split-fc's step under a quota is the simulated one (its waits on held peers cost CPU
    the plain CPU-over-quota rule leaves out); other modes and calibrations without the
    polls keep the rule."""
    lenet = build_model("lenet")
    plain = _held_system()
    simulated = _held_system(polls={"cpu_s": POLL, "extra_s": EXTRA},
                             hosts={"hosts": 1, "cpus": 2})
    before = pm.predict(plain, lenet, "split-fc", 0, 2, 64)
    after = pm.predict(simulated, lenet, "split-fc", 0, 2, 64)
    assert before.held is None and after.held is not None
    assert after.step_s == pytest.approx(after.held.step_s)   # the quota bounds it
    assert after.held.held > 0.3                      # peers held up, about once a step
    assert after.step_s > before.step_s
    assert after.node_cpu_s == pytest.approx(after.held.cpu_s)
    costly = _held_system(polls={"cpu_s": 5 * POLL, "extra_s": EXTRA},
                          hosts={"hosts": 1, "cpus": 2})
    assert pm.predict(costly, lenet, "split-fc", 0, 2, 64).step_s > after.step_s
    assert pm.predict(simulated, lenet, "ring", 0, 2, 64).held is None
    # two nodes on one CPU: simulated together on it, the step the node's CPU over the
    # quota, and a spin yields to the peer that computes, so the waits cost less
    crowded = pm.predict(dataclasses.replace(simulated, hosts={"hosts": 1, "cpus": 1}),
                         lenet, "split-fc", 0, 2, 64)
    assert crowded.held is not None and crowded.held.held == 0
    assert crowded.step_s == pytest.approx(crowded.held.cpu_s / 0.5, rel=1e-6)
    assert crowded.held.wait_cpu_s < 0.5 * after.held.wait_cpu_s


def test_a_node_s_share_of_a_core_where_the_nodes_outnumber_the_machine_s_cpus():
    one = {"hosts": 1, "cpus": 2}
    assert [held.share(n, one) for n in (1, 2, 3, 4, 8)] == pytest.approx([1, 1, 2 / 3, 0.5, 0.25])
    # nodes spread over machines in turn: 4 nodes on 2 machines of 2 CPUs have a CPU each
    assert held.share(4, {"hosts": 2, "cpus": 2}) == 1.0
    assert held.share(5, {"hosts": 2, "cpus": 2}) == pytest.approx(2 / 3)
    assert held.applies(2, one) and not held.applies(3, one)


def test_nodes_that_outnumber_the_machine_s_cpus_compute_at_their_share_of_them():
    """Two nodes of half a core on a machine of one CPU compute at once at half a core each:
    a rank's compute is the profile as measured busy under the quota (the machine's CPU
    shared instead of the quota's periods, the same rate), not the full core's speed it
    gets for a period's budget where the machine has a CPU for each; its ranks share the
    CPU, so no rank's step is its own (the calibration's imbalance does not apply). On a
    machine of 3 CPUs shared by 4 nodes a node bursts at 3/4 of a core for its period's
    budget. Split-fc keeps the full core: its ranks' compute alternates with its blocking
    collectives."""
    lenet = build_model("lenet")
    # a slow link and long periods: the rank waits for the network with budget to spare
    slow = pm.Link("slow", 1e-4, 5e7)
    roomy = dataclasses.replace(_held_system(hosts={"hosts": 1, "cpus": 2}), inter=slow,
                                intra=slow, quota_period_s=0.1)
    crowded = dataclasses.replace(roomy, hosts={"hosts": 1, "cpus": 1})
    profile = pm.predict(dataclasses.replace(roomy, quota=None), lenet, "ring", 0, 2, 64)
    fast = pm.predict(roomy, lenet, "ring", 0, 2, 64)
    shared = pm.predict(crowded, lenet, "ring", 0, 2, 64)
    assert shared.compute_s == pytest.approx(profile.compute_s, rel=1e-6)
    assert fast.compute_s < 0.9 * shared.compute_s and shared.step_s > fast.step_s
    skewed = {"imbalance": {"lenet": 1.5}}
    assert pm.predict(dataclasses.replace(roomy, **skewed), lenet, "ring", 0, 2, 64).step_s \
        > fast.step_s + 0.3 * fast.compute_s
    assert pm.predict(dataclasses.replace(crowded, **skewed), lenet, "ring", 0, 2, 64).step_s \
        == pytest.approx(shared.step_s, rel=1e-9)
    # 3/4 of a core for the period's budget (q x period of full-speed work), then q
    c = pm.predict(dataclasses.replace(roomy, quota_period_s=1.0), lenet, "tree", 0, 2, 64)
    full = c.compute_s                                    # all of it within the budget
    period = full / (0.5 * 2)                             # the budget: half the work
    three = dataclasses.replace(roomy, quota_period_s=period, hosts={"hosts": 1, "cpus": 1.5})
    got = pm.predict(three, lenet, "tree", 0, 2, 64)
    assert got.compute_s == pytest.approx(0.5 * full / 0.75 + 0.5 * full / 0.5, rel=1e-6)
    assert pm.predict(crowded, lenet, "split-fc", 0, 2, 64).compute_s == pytest.approx(
        pm.predict(dataclasses.replace(roomy, hosts=None), lenet, "split-fc", 0, 2, 64)
        .compute_s, rel=1e-9)
    # the stream beside that compute at the rate the calibration measured there, where the
    # nodes computed at once on the same CPUs (not over the quota, as on a CPU each): the
    # step of a rank computing at half a core (its work at a full core's speed, the
    # profile times q, held at 0.5 throughout) beside a stream at that very rate; the
    # ring's rate and a rooted route's own alike, and slower than the same rate over q
    for mode, rates, over_q in (("ring", {"rate": 0.3}, {"rate": 0.6}),
                                ("master", {"rooted_rate": {"master": 0.2}},
                                 {"rooted_rate": {"master": 0.4}})):
        on_shared = pm.predict(dataclasses.replace(crowded, steal=0.0, **rates), lenet, mode, 0,
                               2, 64)

        def at_half_a_core(**stream):
            return pm.predict(dataclasses.replace(
                roomy, quota=None, steal=0.0, imbalance=None,
                compute=roomy.compute.full_speed(0.5), held_after_s=math.inf, held_rate=0.5,
                held_burst=0.5, **stream), lenet, mode, 0, 2, 64)
        assert on_shared.step_s == pytest.approx(at_half_a_core(**rates).step_s, rel=1e-9)
        assert on_shared.step_s > at_half_a_core(**over_q).step_s + 1e-3


def test_the_report_says_which_rule_a_quota_s_row_takes():
    from ringnet.perfmodel.text import calibration_lines
    record = {"quota": 0.5, "hosts": {"hosts": 1, "cpus": 2}}
    (two,), (four,) = calibration_lines(2, record), calibration_lines(4, record)
    assert "computes at a full core's speed while the period's budget lasts" in two
    assert "4 of them on 1 machine(s) of 2 CPUs" in four
    assert "computes at 0.5 of a core while all compute at once" in four
    assert "CPU time / 0.5" in two and "CPU time / 0.5" in four
    (three,) = calibration_lines(3, record)
    assert "at 0.67 of a core" in three
    (unnamed,) = calibration_lines(4, {"quota": 0.5})
    assert unnamed == two
    from ringnet.perfmodel.text import held_line
    polled = dict(record, polls={"cpu_s": 8e-6, "extra_s": 6e-5})
    assert "run together on the machine's CPUs" in held_line(4, polled)
    assert "together" not in held_line(2, polled) and "8.0 us of CPU" in held_line(2, polled)
