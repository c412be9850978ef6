"""Calibration records (ringnet.perfmodel.calibration) from raw timings:

* cores shared past their count, each model's own step's contention, the waits for
  descheduled peers, the slowest rank's lag, the progress beside compute;
* the link fits: ring, tree and master, and a shaped link at its rate, not its burst; the
  cluster file says whether links are shaped;
* a calibration across nodes prints the ``--inter-link`` pair train takes;
* the calibration worker's own output under mpirun (ringnet.perfmodel.worker).
"""
import json
import math
import os

import pytest

from ringnet import perfmodel as pm
from ringnet.perfmodel import calibration, compute as compute_profiles, exchange, worker
from ringnet.models import build_model
from ringnet.shards import shard_bounds

from tests.perfmodel.helpers import ROOT, round_system, waits_raw


def test_calibration_record_from_raw_timings():
    # blocking exchange 10 ms; beside 40 ms of work (30 ms with nothing beside it) it
    # spans 50 ms: 10 ms after the work, so none was done during the 40 ms of overlap
    raw = {"solo_s": 0.020, "together_s": 0.030,
           "blocking": {"4096": 0.004, "1048576": 0.010},
           "streamed": {"1048576": [0.050, 0.040]}}
    record = calibration.calibration_record(2, raw, 0.0)
    assert record["slowdown"] == pytest.approx(1.5)
    assert record["steal"] == pytest.approx(0.25)      # 10 ms lost over 40 ms of overlap
    assert record["rate"] == pytest.approx(1e-3)       # clamped: no progress beside compute
    raw["streamed"] = {"1048576": [0.020, 0.040]}      # done within the work
    assert calibration.calibration_record(2, raw, 0.0)["rate"] == pytest.approx(0.5)


def test_rooted_routes_rates_beside_compute_from_their_own_timings():
    # the master's reduce + broadcast: 30 ms alone; beside 40 ms of work it spans 50 ms,
    # 10 ms after the work, so 20 ms of it moved in the 40 ms of overlap: rate 0.5; the
    # tree's 20 ms alone, done within the work (spans 16 ms): 20 / 16 clamps to 1
    raw = {"solo_s": 0.020, "together_s": 0.030,
           "blocking": {"4096": 0.004, "1048576": 0.010},
           "streamed": {"1048576": [0.050, 0.040]},
           "rooted": {"master": {"1048576": 0.030}, "tree": {"1048576": 0.020}},
           "streamed_rooted": {"master": {"1048576": [0.050, 0.040]},
                               "tree": {"1048576": [0.016, 0.040]}}}
    record = calibration.calibration_record(2, raw, 0.0)
    assert record["rooted_rate"] == pytest.approx({"master": 0.5, "tree": 1.0})
    assert record["rate"] == pytest.approx(1e-3)      # the ring's, from its own timings
    # a route timed beside compute at a size it was not timed alone at gives no rate
    raw["streamed_rooted"]["tree"] = {"65536": [0.016, 0.040]}
    assert calibration.calibration_record(2, raw, 0.0)["rooted_rate"] == pytest.approx(
        {"master": 0.5})
    # the report's line says each route's rate beside the ring's
    from ringnet.perfmodel.text import rooted_rate_line
    assert rooted_rate_line(2, calibration.calibration_record(2, raw, 0.0)) == (
        "beside compute a reduce + broadcast moves at 0.50 (master) of its blocking speed, "
        "the ring's all-reduce at 0.00")
    # older records: none timed, none given (the ring's rate stands for every route)
    del raw["streamed_rooted"]
    assert calibration.calibration_record(2, raw, 0.0)["rooted_rate"] is None
    assert rooted_rate_line(2, calibration.calibration_record(2, raw, 0.0)) is None


def test_ranks_beyond_the_cores_share_them(monkeypatch):
    # 4 ranks busy at once took 2x one alone (waits that sleep): 2 effective cores, each
    # rank's compute 2x slower at N = 4, none at N = 1, 2
    raw = {"cores": 2, "solo_s": 0.02, "together_s": 0.04,
           "blocking": {"4096": 0.004, "1048576": 0.010}, "streamed": {}}
    record = calibration.calibration_record(4, raw, 0.0)
    assert record["cores"] == pytest.approx(2.0) and record["slowdown"] == pytest.approx(2.0)
    system = pm.System("local", None, None, 1 << 30, round_system().compute, calibrated={4: record})
    assert [system.at(n).contention(n) for n in (1, 2, 4)] == pytest.approx([1.0, 1.0, 2.0])
    # 4 ranks on 2 cores timed at 1.6x one alone (a mean over ranks that started and ended
    # apart): they still had only 2 cores, for the work unit and for a model's own step
    raw_fast = dict(raw, together_s=0.032,
                    models={"lenet": {"batch": 16, "solo_s": 0.004, "together_s": 0.0064}})
    fast = calibration.calibration_record(4, raw_fast, 0.0)
    assert fast["cores"] == 2 and fast["model_cores"] == {"lenet": 2}
    fast_system = pm.System("local", None, None, 1 << 30, round_system().compute, calibrated={4: fast})
    assert fast_system.at(4).contention(4, "lenet") == pytest.approx(2.0)
    # on a machine of 16 cores the same 1.6x means 2.5 cores' worth: kept as measured
    roomy = calibration.calibration_record(4, dict(raw_fast, cores=16), 0.0)
    assert roomy["cores"] == pytest.approx(2.5) and roomy["model_cores"]["lenet"] == pytest.approx(2.5)
    # ranks bound one to a core of 16 (affinity 1): the calibration counts the machine's
    # cores, so the cap does not pin 4 ranks to the one core a rank's affinity names
    import os
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert pm.usable_cores() == 16
    # a record of the older worker (its waits spun: 3.3x) names no cores: this machine's
    raw.pop("cores")
    raw["together_s"] = 0.066
    assert calibration.calibration_record(4, raw, 0.0)["cores"] == pm.usable_cores()


def test_calibrated_waits_set_the_step_s_wait_and_each_message_s():
    # at N = 4 on 2 cores the exchange entered after compute waited 6 ms more, plus 0.2 ms
    # per message: the slices are recovered, and at N = 4 the system waits exactly that
    record = calibration.calibration_record(4, waits_raw(4, 6e-3, 2e-4), 0.0)
    unit = pm.scheduling_wait(4, 2, 1.0)                # 1/4 of a slice at N = 4 on 2 cores
    assert unit == pytest.approx(0.25)
    assert record["slice_s"] == pytest.approx(6e-3 / unit)
    assert record["msg_slice_s"] == pytest.approx(2e-4 / unit)
    system = pm.System("local", None, None, 1 << 30, round_system().compute, calibrated={4: record})
    at4 = system.at(4)
    assert at4.wait_s == pytest.approx(6e-3) and at4.msg_wait_s == pytest.approx(2e-4)
    # every message of a blocking ring exchange pays it: 2(N-1) of them
    lenet = build_model("lenet")
    plain = pm.System("local", None, None, 1 << 30, round_system().compute,
                      calibrated={4: dict(record, slice_s=0.0, msg_slice_s=0.0)}).at(4)
    bounds = shard_bounds(lenet.num_params, 4)
    both = [exchange.ring_time(s, bounds, 4, "rs") + exchange.ring_time(s, bounds, 4, "ag") for s in (at4, plain)]
    assert both[0] - both[1] == pytest.approx(6 * 2e-4)
    # the tree's and the master's waits too, one per wait on their critical path
    from ringnet.parallel.plans import RootedPlan
    for mode in ("tree", "master"):
        part = RootedPlan.traffic(1000, 4, lenet.dtype.itemsize, [(0, 1000)], mode)[0]
        items = [exchange.flat_items(s, 4, part, 0.0) for s in (at4, plain)]
        peers = [sec for kind, sec in items[0] if kind == "peer"]
        assert peers and all(p == pytest.approx(2e-4) for p in peers)
        assert [i for i in items[0] if i[0] != "peer"] == items[1]
    # N = 8 from the N = 4 calibration: the closed form scales it, (1-2/8)(8/2-1)/2 / (1/4)
    assert system.at(8).wait_s == pytest.approx(6e-3 * 0.75 * 3 / 2 / 0.25)
    # N = 2 on 2 cores: every rank has a core, whatever the exchanges measured
    two = calibration.calibration_record(2, waits_raw(2, 6e-3, 2e-4), 0.0)
    assert two["slice_s"] == two["msg_slice_s"] == 0.0
    assert pm.System("local", None, None, 1 << 30, round_system().compute,
                     calibrated={2: two}).at(2).wait_s == 0.0
    # a record without these timings (older worker): no wait
    raw = waits_raw(4, 6e-3, 2e-4)
    raw.pop("waits")
    assert calibration.calibration_record(4, raw, 0.0)["slice_s"] == 0.0
    # spec-sheet profiles: none
    assert pm.make_system("pcie3", round_system().compute, 8).wait_s == 0.0


def test_a_delay0_step_waits_for_its_slowest_rank():
    # 2 ranks on 2 cores, lenet's slowest rank 6% behind the mean step by step: a delay-0
    # step is 6% of its compute longer; delay 1 (a step of slack) and single are not
    raw = waits_raw(2, 0.0, 0.0)
    raw["models"] = {"lenet": {"batch": 32, "solo_s": 0.004, "together_s": 0.004, "imbalance": 1.06},
                     "cifar10_quick": {"batch": 32, "solo_s": 0.02, "together_s": 0.02,
                                       "imbalance": 0.99}}
    record = calibration.calibration_record(2, raw, 0.0)
    assert record["imbalance"] == {"lenet": pytest.approx(1.06), "cifar10_quick": 1.0}
    assert "lenet step (batch 32) with all ranks busy 1.00x alone, slowest rank 1.06x the mean" \
        in calibration.describe_contention(2, record)
    lenet = build_model("lenet")

    def local(n, **change):
        return pm.System("local", None, None, 1 << 30, round_system().compute,
                         calibrated={n: dict(record, **change)})
    for mode, delay in (("ring", 0), ("tree", 0), ("master", 0), ("split-fc", 0), ("ring", 1)):
        got = pm.predict(local(2), lenet, mode, delay, 2, 64)
        even = pm.predict(local(2, imbalance={}), lenet, mode, delay, 2, 64)
        extra = 0.06 * got.compute_s if not delay else 0.0
        assert got.step_s - even.step_s == pytest.approx(extra, rel=1e-9, abs=1e-12), (mode, delay)
        assert got.compute_s == even.compute_s
    # records of the older worker carry none
    old = {k: v for k, v in raw["models"]["lenet"].items() if k != "imbalance"}
    assert calibration.calibration_record(2, dict(raw, models={"lenet": old}), 0.0)["imbalance"] == {}
    # 4 ranks on 2 cores: the waits for descheduled peers stand for it
    raw4 = dict(waits_raw(4, 0.0, 0.0), models=raw["models"])
    record4 = calibration.calibration_record(4, raw4, 0.0)
    crowded = pm.System("local", None, None, 1 << 30, round_system().compute, calibrated={4: record4})
    assert crowded.at(4).imbalance is None and crowded.at(2).imbalance == record4["imbalance"]
    assert pm.predict(crowded, lenet, "ring", 0, 4, 64) == pm.predict(
        pm.System("local", None, None, 1 << 30, round_system().compute,
                  calibrated={4: dict(record4, imbalance={})}), lenet, "ring", 0, 4, 64)


def test_contention_is_measured_with_the_model_s_own_step():
    # the work unit: 4 ranks 2x one alone (2 cores); lenet's own step at its per-rank batch:
    # 2.5x (1.6 effective cores); a model the calibration did not time keeps the work unit's
    raw = waits_raw(4, 0.0, 0.0)
    raw["models"] = {"lenet": {"batch": 16, "solo_s": 0.004, "together_s": 0.010}}
    record = calibration.calibration_record(4, raw, 0.0)
    assert record["model_cores"] == {"lenet": pytest.approx(1.6)}
    system = pm.System("local", None, None, 1 << 30, round_system().compute, calibrated={4: record})
    at4 = system.at(4)
    assert at4.contention(4, "lenet") == pytest.approx(2.5)
    assert at4.contention(4, "cifar10_quick") == pytest.approx(2.0)
    assert at4.contention(1, "lenet") == 1.0
    # lenet predicts as on a machine of 1.6 cores; without its own timing, as on one of 2
    lenet = build_model("lenet")

    def local(**change):
        return pm.System("local", None, None, 1 << 30, round_system().compute,
                         calibrated={4: dict(record, **change)})
    for mode, delay in (("ring", 1), ("ring", 0), ("tree", 0)):
        got = pm.predict(system, lenet, mode, delay, 4, 64)
        assert got == pm.predict(local(cores=1.6, model_cores={}), lenet, mode, delay, 4, 64)
        assert got.compute_s > pm.predict(local(model_cores={}), lenet, mode, delay, 4, 64).compute_s
    # GPU / spec-sheet systems: no contention
    assert pm.make_system("pcie3", round_system().compute, 8).contention(4, "lenet") == 1.0


def test_link_fit_recovers_alpha_beta():
    n, alpha, beta = 4, 3e-4, 2e8
    times = [(s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta) for s in (4096, 65536, 1 << 20)]
    fit_alpha, fit_beta = calibration._fit_link(n, times, 0.0)
    assert fit_alpha == pytest.approx(alpha, rel=1e-6)
    assert fit_beta == pytest.approx(beta, rel=1e-6)


@pytest.mark.parametrize("mode", ["tree", "master"])
def test_rooted_link_fit_recovers_alpha_beta(mode):
    n, link = 4, pm.Link("true", 2e-3, 3e8)
    system = pm.System("true", link, link, 1 << 30, compute_profiles.ZERO_COMPUTE)
    timing = exchange.tree_time if mode == "tree" else exchange.master_time
    times = [(s, sum(timing(system, n, s, s // 4))) for s in (4096, 65536, 1 << 20)]
    alpha, beta = calibration._fit_rooted(mode, n, times, 0.0)
    assert alpha == pytest.approx(2e-3, rel=1e-6)
    assert beta == pytest.approx(3e8, rel=1e-6)


def _tbf_ring_times(n, alpha, rate, fast, burst):
    """Ring RS+AG times of each calibration size through a token bucket: each rank's
    2(N-1) messages, the first ``burst`` bytes at the wire's ``fast`` speed, the rest at
    ``rate``."""
    from ringnet.perfmodel.worker import CALIBRATION_SIZES
    out = []
    for size in CALIBRATION_SIZES:
        sent = 2 * (n - 1) / n * size
        out.append((size, 2 * (n - 1) * alpha + min(sent, burst) / fast
                    + max(0.0, sent - burst) / rate))
    return out


def test_a_shaped_link_is_fitted_at_its_rate_not_its_burst():
    from ringnet.perfmodel.calibration import _fit_link, _fit_shaped_link, calibration_record
    times = _tbf_ring_times(2, 40e-6, 125e6, 2e9, 125_000)
    straight = _fit_link(2, times, 0.0)[1]
    alpha, beta = _fit_shaped_link(2, times, 0.0)
    assert straight > 1.3 * 125e6                       # one line through every size
    assert beta == pytest.approx(125e6, rel=0.01)
    assert 40e-6 <= alpha <= 40e-6 + 4096 / 2e9 + 1e-9
    # the record fits a calibration made across shaped links this way, others as before
    raw = {"blocking": {str(s): t for s, t in times}, "together_s": 1.0, "solo_s": 1.0,
           "streamed": {}, "cores": 2}
    assert calibration_record(2, raw, 0.0)["beta_Bps"] == pytest.approx(straight)
    raw["placement"] = {"per_node": 1, "shaped": "1gbit"}
    assert calibration_record(2, raw, 0.0)["beta_Bps"] == pytest.approx(125e6, rel=0.01)


@pytest.mark.parametrize("route", ["tree", "master"])
def test_a_rooted_route_over_shaped_links_is_fitted_with_the_buckets(route):
    """Times a tree or master all-reduce takes on links of 125 MB/s with 125 kB buckets,
    met full (the worker's barrier sleeps before each), at N = 4 and the worker's sizes:
    the fit that counts the buckets as the model does finds the rate (to 2%; exactly at
    zero latency) and the latency, the one that does not a rate that is not the link's."""
    from ringnet.perfmodel import exchange
    from ringnet.perfmodel.calibration import _fit_rooted
    from ringnet.perfmodel.compute import ZERO_COMPUTE
    from ringnet.perfmodel.worker import CALIBRATION_SIZES
    timing = exchange.tree_time if route == "tree" else exchange.master_time
    for alpha in (0.0, 150e-6):
        link = pm.Link("shaped", alpha, 125e6, burst_bytes=125_000)
        system = pm.System("shaped", link, link, 1 << 30, ZERO_COMPUTE)
        times = [(size, sum(timing(system, 4, size, size // 4, after_idle=True)))
                 for size in CALIBRATION_SIZES]
        fitted_alpha, fitted_beta = _fit_rooted(route, 4, times, 0.0, 125_000)
        assert fitted_beta == pytest.approx(125e6, rel=1e-6 if not alpha else 0.02)
        assert fitted_alpha == pytest.approx(alpha, abs=2e-6)
        assert _fit_rooted(route, 4, times, 0.0)[1] != pytest.approx(125e6, rel=0.005)


def test_the_cluster_file_says_whether_links_are_shaped(tmp_path):
    from ringnet.perfmodel.calibration import shaped_links
    (tmp_path / "cluster").write_text("rate=1gbit\nprefix=sc\n")
    assert shaped_links({"SLURM_CONF": str(tmp_path / "slurm.conf")}) == "1gbit"
    (tmp_path / "cluster").write_text("rate=\nprefix=sc\n")
    assert shaped_links({"SLURM_CONF": str(tmp_path / "slurm.conf")}) is None
    assert shaped_links({}) is None


def test_a_calibration_across_nodes_prints_the_inter_link_for_train():
    """The 1 Gbit/s cluster's recorded calibration (2 and 4 nodes, one rank each): the
    printed --inter-link pair reads back as the fitted link, and with it --topology auto
    takes the hierarchical ring for LeNet at 2 nodes x 2 ranks; a calibration on one node
    prints none."""
    from ringnet.perfmodel.text import inter_link_hint
    from ringnet.comm.hierarchical import parse_inter_link
    from ringnet.placement import group
    from ringnet.parallel import topology_choice
    with open(os.path.join(ROOT, "docs", "bench-model-validation-1gbit.json")) as f:
        rnd = json.load(f)["rounds"][0]
    add = rnd["compute"]["add_ns_per_element"] * 1e-9
    for n, entry in rnd["calibration"]["by_np"].items():
        record = calibration.calibration_record(int(n), entry["raw"], add)
        hint = inter_link_hint(int(n), record)
        assert hint.startswith(f"across {n} nodes;"), hint
        pair = hint.split("--inter-link ")[1].split()[0]
        alpha, beta = parse_inter_link(pair)
        assert alpha == pytest.approx(record["alpha_s"], rel=5e-3)
        assert 1 / beta == pytest.approx(record["beta_Bps"], rel=5e-4)
        names = ["a", "a", "b", "b"]
        assert topology_choice("ring", build_model("lenet"), group(names, names, 0),
                               inter_link=pair)[0] == "hierarchical"
        one_node = dict(entry["raw"], placement=dict(entry["raw"]["placement"], per_node=int(n)))
        assert inter_link_hint(int(n), dict(record, raw=one_node)) is None


@pytest.mark.mpi
def test_calibration_worker_times_the_model_steps_and_the_waits(capsys):
    # the worker's own output (one iteration, a tiny batch): what the record is made from
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    assert worker.calibrate_worker(1, ["lenet"], 3) == 0
    out = capsys.readouterr().out.strip().splitlines()
    if world.Get_rank():
        assert out == []
        return
    raw = json.loads(out[-1])
    n = world.Get_size()
    from ringnet.placement import cpu_period_s, cpu_quota
    assert raw["np"] == n and raw["cores"] == pm.usable_cores()
    assert raw["quota"] == cpu_quota() and raw["quota_period_s"] == cpu_period_s()
    assert raw["models"]["lenet"]["batch"] == 3 and raw["models"]["lenet"]["calls"] >= 1
    assert raw["models"]["lenet"]["solo_s"] > 0 and raw["models"]["lenet"]["together_s"] > 0
    assert raw["models"]["lenet"]["imbalance"] >= 1.0 - 1e-12        # a maximum over a mean
    assert sorted(raw["waits"]) == sorted(f"{kind}{c}" for kind in ("idle", "loaded")
                                          for c in pm.LOADED_EXCHANGES)
    assert all(v > 0 for v in raw["waits"].values())
    # the CPU time of each size's blocking exchange and of the stream's thread beside the
    # work unit: no more than the slowest rank's time with two threads busy
    assert sorted(map(int, raw["blocking_cpu"])) == sorted(worker.CALIBRATION_SIZES)
    assert sorted(map(int, raw["streamed_cpu"])) == sorted(worker.STREAM_SIZES)
    for size, spent in raw["blocking_cpu"].items():
        assert 0.0 <= spent <= 2 * raw["blocking"][size] + 1e-3
    for size, spent in raw["streamed_cpu"].items():
        assert 0.0 <= spent <= 2 * max(raw["streamed"][size]) + 1e-3
        if n > 1:       # the stream's thread moved the bytes: it spent some CPU
            assert spent > 0.0
    # the tree's and the master's reduce + broadcast beside the same work: per size, the
    # exchange's own span and the work's time; across ranks each route gets a rate in (0, 1]
    assert sorted(raw["streamed_rooted"]) == ["master", "tree"]
    for route, sizes in raw["streamed_rooted"].items():
        assert sorted(map(int, sizes)) == sorted(worker.STREAM_SIZES)
        assert all(span > 0 and work > 0 for span, work in sizes.values())
    if n > 1:
        rates = calibration.calibration_record(n, raw, 0.0)["rooted_rate"]
        assert sorted(rates) == ["master", "tree"]
        assert all(0.0 < r <= 1.0 for r in rates.values())
    # a sleeping poll's CPU, and its wall time beyond the pause it asked for (which holds
    # that CPU and the sleep's overshoot); every rank on this one machine (one boot id)
    polls = raw["polls"]
    assert 0.0 < polls["cpu_s"] <= polls["extra_s"] < 2e-3
    assert raw["hosts"] == {"hosts": 1, "cpus": os.cpu_count()}
    record = calibration.calibration_record(n, raw, 0.0)
    assert (record["polls"], record["hosts"]) == (raw["polls"], raw["hosts"])
    assert record["model_cores"]["lenet"] > 0
    if n <= raw["cores"]:
        assert record["slice_s"] == record["msg_slice_s"] == 0.0


@pytest.mark.mpi
def test_under_a_quota_the_worker_times_model_steps_over_many_periods(capsys, monkeypatch):
    # a step timed alone right after an idle wait starts with its period's budget unspent:
    # on a node held to a quota the steps run back to back for QUOTA_STEPS_TIMED_S. The
    # worker sizes its calls from one timed step; here that step reads 5 ms, so the count
    # is the rule's own, whatever the cores do meanwhile (they are shared at N > 2)
    from mpi4py import MPI
    import ringnet.placement
    one_step = 0.005

    def timed(fn, iters):
        for _ in range(iters):
            fn()
        return one_step
    monkeypatch.setattr(worker, "median_time", timed)
    calls = {}
    for quota in (None, 0.5):
        monkeypatch.setattr(ringnet.placement, "cpu_quota", lambda quota=quota: quota)
        assert worker.calibrate_worker(1, ["lenet"], 3) == 0
        out = capsys.readouterr().out.strip().splitlines()
        if MPI.COMM_WORLD.Get_rank():
            continue
        raw = json.loads(out[-1])
        assert raw["quota"] == quota
        calls[quota] = raw["models"]["lenet"]["calls"]
        assert raw["models"]["lenet"]["solo_s"] > 0
        # the delayed loop: LeNet's gradient beside as many of its steps
        delayed = raw["delayed"]["lenet"]
        assert delayed["calls"] == calls[quota]
        assert delayed["bytes"] == 4 * build_model("lenet").num_params
        assert delayed["alone_s"] > 0 and delayed["loop_s"] > 0
    if MPI.COMM_WORLD.Get_rank():
        return
    assert worker.steps_timed_s(None) == worker.steps_timed_s(1.0) == worker.STEPS_TIMED_S
    assert worker.steps_timed_s(0.5) == worker.QUOTA_STEPS_TIMED_S > worker.STEPS_TIMED_S
    assert calls[None] == math.ceil(worker.STEPS_TIMED_S / one_step)
    assert calls[0.5] == math.ceil(worker.QUOTA_STEPS_TIMED_S / one_step)


@pytest.mark.parametrize("n", [2, 4])
def test_transfer_cpu_is_fitted_per_message_and_per_byte(n):
    """The CPU time the worker measured for ring all-reduces of its sizes (2(N-1) messages,
    2(N-1)/N of the buffer sent per rank) gives back the per-message and per-byte costs it
    was made from, on the blocking path and the stream's; none in an older record or at
    N = 1, and never a negative cost."""
    def cpu(sizes, per_msg, per_byte):
        return {str(size): 2 * (n - 1) * per_msg + 2 * (n - 1) / n * size * per_byte
                for size in sizes}
    raw = waits_raw(n, 0.0, 0.0)
    raw["blocking_cpu"] = cpu(worker.CALIBRATION_SIZES, 40e-6, 3e-9)
    raw["streamed_cpu"] = cpu(worker.STREAM_SIZES, 150e-6, 1.5e-9)
    record = calibration.calibration_record(n, raw, 0.0)
    assert record["cpu_blocking"] == pytest.approx({"per_msg_s": 40e-6, "per_byte_s": 3e-9},
                                                   rel=1e-6)
    assert record["cpu_stream"] == pytest.approx({"per_msg_s": 150e-6, "per_byte_s": 1.5e-9},
                                                 rel=1e-6)
    from ringnet.perfmodel.text import transfer_cpu_line
    assert transfer_cpu_line(record) == ("CPU a transfer costs its rank: blocking 40 us a "
                                         "message + 3000 us a MB sent; on the stream 150 us a "
                                         "message + 1500 us a MB sent")
    assert calibration.calibration_record(n, waits_raw(n, 0.0, 0.0), 0.0)["cpu_stream"] is None
    assert transfer_cpu_line(calibration.calibration_record(n, waits_raw(n, 0.0, 0.0), 0.0)) is None
    assert calibration.calibration_record(1, dict(raw, np=1), 0.0)["cpu_blocking"] is None
    # CPU that falls with size (noise): a per-message cost only, the mean
    raw["streamed_cpu"] = {str(worker.STREAM_SIZES[0]): 2e-3, str(worker.STREAM_SIZES[1]): 1e-3}
    fitted = calibration.calibration_record(n, raw, 0.0)["cpu_stream"]
    assert fitted == pytest.approx({"per_msg_s": 1.5e-3 / (2 * (n - 1)), "per_byte_s": 0.0})
    # CPU that grows faster than the bytes (a negative intercept): through the origin
    raw["streamed_cpu"] = {str(worker.STREAM_SIZES[0]): 0.0, str(worker.STREAM_SIZES[1]): 1e-3}
    fitted = calibration.calibration_record(n, raw, 0.0)["cpu_stream"]
    assert fitted["per_msg_s"] == 0.0 and fitted["per_byte_s"] > 0


@pytest.mark.parametrize("quota,kept", [(0.5, 0.5), (1.0, None), (2.0, None), (None, None)])
def test_a_calibration_keeps_a_node_s_quota_under_a_core(quota, kept):
    """The worker's quota goes into the record where it is under a core (the model then
    prices a node held to it); a core or more, or none, is no quota to the model."""
    raw = waits_raw(2, 0.0, 0.0)
    raw.update(cores=1, quota=quota)
    assert calibration.calibration_record(2, raw, 0.0)["quota"] == kept


@pytest.mark.parametrize("n", [2, 4])
def test_the_delayed_rate_is_what_the_loop_left_of_the_exchange_beside_one_step(n):
    """The worker's delayed loop: a step of C = 20 ms beside an exchange that alone takes
    E = 30 ms took T; the exchange moved r C during the compute and the rest after it, so
    T = C + E - r C. The record gives back r for loops made with r = 0.8 and 0.1; a loop
    no longer than C + E - C (the exchange hidden whole) is r = 1, one longer than C + E
    is the floor 0.01; a loop no longer than the step says nothing; none at N = 1 or in a
    record without the loop."""
    step, alone = 0.020, 0.030
    raw = waits_raw(n, 0.0, 0.0)
    raw["models"] = {"lenet": {"batch": 64 // n, "calls": 10, "solo_s": step, "together_s": step},
                     "cifar10_quick": {"batch": 64 // n, "calls": 10, "solo_s": step,
                                       "together_s": step}}

    def loop(rate):
        return {"bytes": 4 << 20, "calls": 10, "alone_s": alone, "loop_s": step + alone - rate * step}
    raw["delayed"] = {"lenet": loop(0.8), "cifar10_quick": loop(0.1)}
    rates = calibration.calibration_record(n, raw, 0.0)["delayed_rate"]
    assert rates == pytest.approx({"lenet": 0.8, "cifar10_quick": 0.1}, rel=1e-9)
    from ringnet.perfmodel.text import delayed_rate_line
    record = calibration.calibration_record(n, dict(raw, quota=0.5), 0.0)
    assert delayed_rate_line(record) == (
        "the delayed exchange beside one step moves at 0.10 (cifar10_quick), 0.80 (lenet) of "
        f"its blocking speed (beside compute back to back: {record['rate']:.2f})")
    assert delayed_rate_line(calibration.calibration_record(n, raw, 0.0)) is None   # no quota
    raw["delayed"] = {"lenet": loop(1.5), "cifar10_quick": loop(-2.0)}
    rates = calibration.calibration_record(n, raw, 0.0)["delayed_rate"]
    assert rates == {"lenet": 1.0, "cifar10_quick": 0.01}
    raw["delayed"] = {"lenet": dict(loop(0.5), loop_s=step)}
    assert calibration.calibration_record(n, raw, 0.0)["delayed_rate"] is None
    del raw["delayed"]
    assert calibration.calibration_record(n, raw, 0.0)["delayed_rate"] is None
    raw["delayed"] = {"lenet": loop(0.5)}
    assert calibration.calibration_record(1, dict(raw, np=1), 0.0)["delayed_rate"] is None
