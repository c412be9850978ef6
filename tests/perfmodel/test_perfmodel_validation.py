"""Validation records (ringnet.perfmodel.validation): the reprint says where the model is off,
a record is predicted as the code it measured ran, and the slowest-rank term brings
docs/bench-model-validation.json's delay-0 rows closer to what they measured."""
import dataclasses
import json
import os

import pytest

from ringnet import perfmodel as pm

from tests.perfmodel.helpers import ROOT, run_model_cli, validation_record


class Probe:
    """A speed probe that reads ``times`` in turn (the last one from then on)."""

    def __init__(self, times):
        self.times, self.calls = list(times), []

    def ms(self, name):
        self.calls.append(name)
        return self.times.pop(0) if len(self.times) > 1 else self.times[0]


def test_validation_reprint_says_where_the_model_is_off(tmp_path):
    row = {"model": "lenet", "mode": "ring", "delay": 0, "np": 2, "step_ms": 100.0,
           "compute_ms": 10.0, "exposed_ms": 85.0, "update_ms": 1.0, "data_ms": 4.0}
    path = tmp_path / "v.json"
    path.write_text(json.dumps(validation_record([row])))
    rows = pm.validation_rows(json.loads(path.read_text()))
    assert len(rows) == 1 and rows[0]["measured_ms"] == 100.0
    predicted_exposed, measured_exposed = rows[0]["parts"]["exposed"]
    assert measured_exposed == 85.0
    text = pm.diagnose(rows[0], rows)
    # the model's exchange of a 1.7 MB gradient on this link is far below 85 ms
    assert predicted_exposed < 40 and "exposed communication" in text and "85.0 ms" in text
    proc = run_model_cli("--compute", "k40", "--models", "lenet", "--profile", "pcie3", "--np", "1", "2",
                         "--validation", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "where the model is off" in proc.stdout and "exposed communication" in proc.stdout
    assert "the code measured: CPU streams poll, no delay-0 buckets" in proc.stdout
    assert "# measured: each run's median step\n" in proc.stdout


def test_a_record_is_predicted_as_the_code_it_measured_ran():
    row = {"model": "lenet", "mode": "ring", "delay": 1, "np": 2, "step_ms": 100.0}
    old = pm.validation_rows(validation_record([row]))[0]["predicted_ms"]
    assert pm.validation_rows(validation_record([row], pm.OLD_FACTS))[0]["predicted_ms"] == old
    # the same record measured with driven progress: the exchange waits for layer boundaries
    driven = dict(pm.OLD_FACTS, progress="driven")
    assert pm.validation_rows(validation_record([row], driven))[0]["predicted_ms"] != old
    with pm.facts(driven):
        assert pm.code_facts() == driven


def test_the_slowest_rank_term_brings_the_record_s_delay0_rows_closer():
    # docs/bench-model-validation.json reprinted with and without the calibration's
    # imbalance: without it a delay-0 step at N = 2 (a core per rank) comes out too fast on
    # average, with it closer, and the record as a whole no worse (tests/test_docs.py checks
    # the figures the docs give of the record against its reprint)
    import copy
    import statistics
    with open(os.path.join(ROOT, "docs", "bench-model-validation.json")) as f:
        record = json.load(f)
    even = copy.deepcopy(record)
    for rnd in even["rounds"]:
        for c in rnd["calibration"]["by_np"].values():
            for m in c["raw"].get("models", {}).values():
                m.pop("imbalance", None)
    with_term, without = pm.validation_rows(record), pm.validation_rows(even)
    assert len(with_term) == len(without) == 32

    def summary(rows):
        errors = [abs(r["error"]) for r in rows]
        return statistics.median(errors), sum(e <= 0.15 for e in errors)
    (m1, k1), (m0, k0) = summary(with_term), summary(without)
    assert m1 <= m0 and k1 >= k0

    def delay0_at_2(rows):
        return statistics.mean(r["error"] for r in rows if r["np"] == 2 and not r["delay"])
    mean0, mean1 = delay0_at_2(without), delay0_at_2(with_term)
    assert mean0 < 0 and abs(mean1) < abs(mean0)


def test_two_ranks_a_node_validate_both_topologies_and_keep_their_rows_apart(monkeypatch):
    """On nodes of two ranks, N = 4 spans two nodes: ring and tree run with --topology flat
    and hierarchical (the others as train chooses, N = 1 and 2 too), and each topology's
    rows are predicted with its own exchange and printed apart."""
    import ringnet.jobs
    from ringnet.perfmodel import validation
    from tests.perfmodel.helpers import waits_raw
    runs = []

    def train_run(args, mode, delay, nranks, extra=()):
        runs.append((mode, delay, str(nranks), tuple(extra)))
        return {"step_ms": 20.0, "steps": 5}
    by_np = {}
    for n in (2, 4):
        raw = waits_raw(n, 0.0, 0.0)
        raw["placement"] = {"per_node": 2, "launcher": "srun --mpi=pmi2"}
        by_np[str(n)] = {"raw": raw}
    compute = pm.roofline_compute("k40", ("lenet",))
    monkeypatch.setattr(ringnet.jobs, "train_run", train_run)
    monkeypatch.setattr(validation, "measure_compute", lambda models: compute)
    monkeypatch.setattr(validation, "calibrate", lambda *a, **k: {"by_np": by_np})
    record = pm.validate(("lenet",), 64, 5, 1, "srun --mpi=pmi2", nps=(1, 2, 4), per_node=2,
                         probe=Probe([10.0]))
    at4 = {(mode, delay): extra for mode, delay, n, extra in runs if n.startswith("4")}
    chosen = [(mode, delay) for mode, delay, n, extra in runs if n.startswith("4")]
    for md in (("ring", 1), ("ring", 0), ("tree", 0)):
        assert chosen.count(md) == 2, runs
    assert chosen.count(("master", 0)) == 1 and at4[("master", 0)] == ()
    assert {extra for mode, _, n, extra in runs if n.startswith("4") and mode == "ring"} == \
        {("--topology", "flat"), ("--topology", "hierarchical")}
    assert all(extra == () for _, _, n, extra in runs if not n.startswith("4"))
    rows = pm.validation_rows(record)
    ring4 = {r.get("topology"): r for r in rows if (r["mode"], r["delay"], r["np"]) == ("ring", 1, 4)}
    assert set(ring4) == {"flat", "hierarchical"}
    assert ring4["flat"]["predicted_ms"] != ring4["hierarchical"]["predicted_ms"]
    assert pm.row_label(ring4["hierarchical"]) == "ring d1 hier" and pm.row_label(ring4["flat"]) == "ring d1"
    table = pm.markdown_validation(rows)
    assert "| lenet | ring d1 hier | \u2013 | \u2013 |" in table


def test_on_nodes_under_a_quota_the_measured_step_is_the_mean(monkeypatch):
    """Train reports its median step and its mean; on nodes held to a CPU quota (the
    calibration says so) a row's measured step is the mean, elsewhere the median, and a
    record without the mean keeps the median."""
    import ringnet.jobs
    from ringnet.perfmodel import validation
    from tests.perfmodel.helpers import waits_raw
    compute = pm.roofline_compute("k40", ("lenet",))
    monkeypatch.setattr(ringnet.jobs, "train_run",
                        lambda *a, **k: {"step_ms": 20.0, "step_mean_ms": 24.0, "steps": 5})
    monkeypatch.setattr(validation, "measure_compute", lambda models: compute)
    # (a quota of a core or more holds no rank back: the median, as without one)
    for quota, want in ((None, 20.0), (1.5, 20.0), (0.5, 24.0)):
        raw = dict(waits_raw(2, 0.0, 0.0), quota=quota)
        monkeypatch.setattr(validation, "calibrate",
                            lambda *a, raw=raw, **k: {"by_np": {"2": {"raw": raw}}})
        record = pm.validate(("lenet",), 64, 5, 1, "mpirun", nps=(1, 2), probe=Probe([10.0]))
        assert record["rounds"][0]["measured"][0]["step_mean_ms"] == 24.0
        rows = pm.validation_rows(record)
        assert {r["measured_ms"] for r in rows} == {want}, quota
        assert pm.measured_note(record) == (
            "measured: each run's median step" if want == 20.0 else
            "measured: each run's mean step (nodes held to a CPU quota of 0.5 core: a step "
            "ends at whole periods of it)")
        for m in record["rounds"][0]["measured"]:
            del m["step_mean_ms"]
        assert {r["measured_ms"] for r in pm.validation_rows(record)} == {20.0}


def test_the_speed_probe_says_how_far_the_machine_drifted_around_each_run(monkeypatch, tmp_path):
    """The speed probe is timed after the profile and before and after each run. Around runs
    where it took 1.25x the profile's time, the rows keep the profile as measured, and say
    how they would read at that speed: every compute time 1.25x, single's step (all
    compute) exactly 1.25x, the ring's at N = 2 less (its link as calibrated)."""
    import ringnet.jobs
    from ringnet.perfmodel import validation
    from tests.perfmodel.helpers import waits_raw
    compute = pm.roofline_compute("k40", ("lenet",))
    compute = dataclasses.replace(compute, device="cpu")
    monkeypatch.setattr(ringnet.jobs, "train_run", lambda *a, **k: {"step_ms": 20.0, "steps": 5})
    monkeypatch.setattr(validation, "measure_compute", lambda models: compute)
    monkeypatch.setattr(validation, "calibrate",
                        lambda *a, **k: {"by_np": {"2": {"raw": waits_raw(2, 0.0, 0.0)}}})
    # after the profile 10 ms; then each run's before and after: 12 and 13 (1.25x)
    probe = Probe([10.0] + [12.0, 13.0] * 20)
    record = pm.validate(("lenet",), 64, 5, 1, "mpirun", nps=(1, 2), probe=probe)
    rnd = record["rounds"][0]
    assert rnd["probe_ms"] == {"lenet": 10.0}
    assert rnd["measured"][0]["probe_ms"] == [12.0, 13.0]
    assert len(probe.calls) == 1 + 2 * len(rnd["measured"])
    without = json.loads(json.dumps(dict(record, rounds=[dict(rnd, probe_ms=None)])))
    rows, still = pm.validation_rows(record), pm.validation_rows(without)
    assert all(r["drift"] == [1.25] for r in rows) and all(r["drift"] == [1.0] for r in still)
    assert [r["predicted_ms"] for r in rows] == [r["predicted_ms"] for r in still]
    by = {(r["mode"], r["delay"], r["np"]): r for r in rows}
    single, ring = by[("single", 0, 1)], by[("ring", 0, 2)]
    at = {key: 20.0 * (1 + r["error_followed"]) for key, r in by.items()}   # followed ms
    assert at[("single", 0, 1)] == pytest.approx(1.25 * single["predicted_ms"])
    assert ring["predicted_ms"] < at[("ring", 0, 2)] < 1.25 * ring["predicted_ms"]
    for r in rows:
        assert r["error"] == pytest.approx((r["predicted_ms"] - 20.0) / 20.0)
    assert pm.drift_note(still) is None
    note = pm.drift_note(rows)
    assert "1.25 to 1.25x the profile's time" in note, note
    path = tmp_path / "v.json"
    path.write_text(json.dumps(record))
    proc = run_model_cli("--compute", "k40", "--models", "lenet", "--profile", "pcie3", "--np", "1", "2",
                         "--validation", str(path))
    assert proc.returncode == 0, proc.stderr
    assert f"  {note}\n" in proc.stdout


def test_the_speed_probe_times_the_model_s_step(monkeypatch):
    """The probe times the step for PROBE_S and at least PROBE_STEPS calls: a step that
    sleeps 10 ms reads 10 ms, in PROBE_STEPS calls where PROBE_S is shorter."""
    import time
    from ringnet.perfmodel import validation
    probe = pm.SpeedProbe(("lenet",), 4)
    calls = []

    class Sleeper:
        def loss_and_grad(self, x, y):
            calls.append(len(x))
            time.sleep(0.01)
    _, x, y = probe.nets["lenet"]
    probe.nets["lenet"] = (Sleeper(), x, y)
    monkeypatch.setattr(validation, "PROBE_S", 0.001)
    ms = probe.ms("lenet")
    assert calls == [4] * validation.PROBE_STEPS
    assert 10.0 <= ms < 14.0, ms
    calls.clear()
    monkeypatch.setattr(validation, "PROBE_S", 0.1)
    ms = probe.ms("lenet")
    assert 8 <= len(calls) <= 10 and 10.0 <= ms < 14.0, (len(calls), ms)


def test_each_run_s_cpu_time_gives_the_speed_its_prediction_takes(monkeypatch, tmp_path):
    """A run whose training threads took 1.5x the profile's CPU time for the same work (the
    profile's compute CPU time at the run's batch per rank) ran on a machine 1.5x slower:
    the row's prediction at the run's speed takes every compute time 1.5x, single's step
    (all compute) exactly, the ring's at N = 2 less (its link as calibrated); the rows keep
    the profile's prediction and its error beside it, and the reprint prints both."""
    import ringnet.jobs
    from ringnet.perfmodel import validation
    from tests.perfmodel.helpers import waits_raw
    compute = pm.roofline_compute("k40", ("lenet",))
    # the profile's compute CPU time per step: 0.1 ms + 0.05 ms an image
    compute = dataclasses.replace(compute, device="cpu",
                                  compute_cpu_ms={"lenet": {16: 0.9, 32: 1.7, 64: 3.3}})

    def train_run(args, mode, delay, nranks, extra=()):
        local = 64 // nranks
        waits = {"wait_cpu_s": 5 * 0.4e-3 * nranks, "waits": 5 * 7.0 * nranks,
                 "waits_slept": 5 * 1.5} if nranks > 1 else {}
        return {"step_ms": 20.0, "steps": 5, "compute_cpu_s": 5 * 1.5 * (0.1 + 0.05 * local) / 1e3,
                "group_cpu_s": 0.05 * nranks if nranks > 1 else None, **waits}
    monkeypatch.setattr(ringnet.jobs, "train_run", train_run)
    monkeypatch.setattr(validation, "measure_compute", lambda models: compute)
    # a core per rank: no contention (the profile at a run's speed would drop it)
    raw = dict(waits_raw(2, 0.0, 0.0), together_s=0.02)
    monkeypatch.setattr(validation, "calibrate", lambda *a, **k: {"by_np": {"2": {"raw": raw}}})
    record = json.loads(json.dumps(pm.validate(("lenet",), 64, 5, 1, "mpirun", nps=(1, 2),
                                               probe=Probe([10.0]))))
    assert record["rounds"][0]["measured"][0]["compute_cpu_ms"] == pytest.approx(1.5 * 3.3)
    # the control groups' CPU per step where the run could read it, nothing where not
    kept = {m["np"]: m.get("group_cpu_ms") for m in record["rounds"][0]["measured"]}
    assert kept == {1: None, 2: pytest.approx(1e3 * 0.1 / 5)}
    # the training thread's waits per step, where the run counted them
    waited = {m["np"]: [m.get(k) for k in ("wait_cpu_ms", "waits_per_step",
                                           "waits_slept_per_step")]
              for m in record["rounds"][0]["measured"]}
    assert waited == {1: [None] * 3, 2: [pytest.approx(0.8), pytest.approx(14.0), 1.5]}
    rows = pm.validation_rows(record)
    by = {(r["mode"], r["delay"], r["np"]): r for r in rows}
    for r in rows:
        assert r["speed"] == [pytest.approx(1.5)]
        assert r["error_at_run"] == pytest.approx((r["at_run_ms"] - 20.0) / 20.0)
        assert r["error"] == pytest.approx((r["predicted_ms"] - 20.0) / 20.0)
    single, ring = by[("single", 0, 1)], by[("ring", 0, 2)]
    assert "waits" not in single
    assert ring["waits"] == {"cpu_ms": pytest.approx(0.8), "count": pytest.approx(14.0),
                             "slept": 1.5}
    assert single["at_run_ms"] == pytest.approx(1.5 * single["predicted_ms"])
    assert ring["predicted_ms"] < ring["at_run_ms"] < 1.5 * ring["predicted_ms"]
    # a batch per rank between the profile's: its line through them
    at = dict(record["rounds"][0]["measured"][0], np=3, compute_cpu_ms=1.5 * (0.1 + 0.05 * 64 / 3))
    assert pm.run_speed(record["rounds"][0], at, 64) == pytest.approx(1.5)
    # a record without the CPU times (older runs): no prediction at the run's speed
    old = json.loads(json.dumps(record))
    for m in old["rounds"][0]["measured"]:
        del m["compute_cpu_ms"]
    assert all("at_run_ms" not in r for r in pm.validation_rows(old))
    assert pm.row_error_at_run(pm.validation_rows(old)[0]) is None
    path = tmp_path / "v.json"
    path.write_text(json.dumps(record))
    proc = run_model_cli("--compute", "k40", "--models", "lenet", "--profile", "pcie3", "--np", "1", "2",
                         "--validation", str(path), "--table", "validation", "--markdown")
    assert proc.returncode == 0, proc.stderr
    cell = (f"{single['predicted_ms']:.3g} / {single['at_run_ms']:.3g} / 20 "
            f"({100 * single['error']:+.0f}%, {100 * single['error_at_run']:+.0f}%)").replace("-", "\u2212")
    assert cell in proc.stdout, proc.stdout
    proc = run_model_cli("--compute", "k40", "--models", "lenet", "--profile", "pcie3", "--np", "1", "2",
                         "--validation", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "at run: the profile taken at each run's own speed" in proc.stdout
    assert "1.50 to 1.50x" in proc.stdout


def test_a_profile_at_a_run_s_speed_counts_no_contention_again():
    """The speed a run's CPU time shows counts the contention it met: the system that takes
    it (``as_run``) slows no rank's compute again."""
    system = pm.System("x", pm.LINKS["pcie3"], pm.LINKS["pcie3"], 4,
                       pm.roofline_compute("k40", ("lenet",)), cores=2.0)
    assert system.contention(4, "lenet") == 2.0
    assert dataclasses.replace(system, as_run=True).contention(4, "lenet") == 1.0


def test_the_budget_note_is_each_run_s_node_cpu_over_its_quota_share_of_the_step():
    """``budget_note`` on the record of docs/scaling.md that holds the nodes' CPU: per N,
    the range of group_cpu_ms / (quota x mean step) over its runs, worked out here from the
    record's own numbers; a record without the nodes' CPU has no such line."""
    import os
    import statistics
    from ringnet.perfmodel.validation import budget_note
    docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs")
    with open(os.path.join(docs, "bench-model-validation-unshaped-at-run-repeat.json")) as f:
        record = json.load(f)
    use = {}
    for rnd in record["rounds"]:
        quota = rnd["calibration"]["by_np"]["2"]["raw"]["quota"]
        for m in rnd["measured"]:
            use.setdefault(m["np"], []).append(m["group_cpu_ms"] / quota / m["step_mean_ms"])
    assert sorted(use) == [1, 2, 4] and all(len(v) == 5 * (12 if n == 1 else 10)
                                            for n, v in use.items())
    note = budget_note(record)
    for n, v in use.items():
        assert (f"N = {n}: {min(v):.2f} to {max(v):.2f} (median {statistics.median(v):.2f})"
                in note), note
    with open(os.path.join(docs, "bench-model-validation-unshaped-at-run.json")) as f:
        assert budget_note(json.load(f)) is None


def test_where_a_quota_bounds_the_step_the_diagnosis_is_the_node_s_cpu():
    """On docs/scaling.md's 1 Gbit/s record of nodes held to half a core, LeNet's split-fc
    at 4 nodes is predicted as its node's CPU time over the quota: the row carries that CPU
    (the at-run step x the quota, round by round), the part of it the transfers cost, and
    what the runs' control groups spent (and of it, outside the training thread's compute
    and update, beside that of the same mode on one node), medians over the rounds worked
    out here from the record itself; the
    diagnosis names them instead of the step's parts in time (the exposed wait there is
    the quota's hold, which the model does not split off). A record without the nodes'
    CPU keeps the parts."""
    import os
    import statistics
    docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs")
    with open(os.path.join(docs, "bench-model-validation-1gbit-avx512-buckets.json")) as f:
        record = json.load(f)
    rows = pm.validation_rows(record)
    row = next(r for r in rows if r["model"] == "lenet" and r["mode"] == "split-fc"
               and r["np"] == 4)
    runs = [m for rnd in record["rounds"] for m in rnd["measured"]
            if m["model"] == "lenet" and m["mode"] == "split-fc" and m["np"] == 4]
    cpu = row["cpu"]
    assert cpu["measured_ms"] == pytest.approx(statistics.median(m["group_cpu_ms"] for m in runs))
    assert row["outside_ms"] == pytest.approx(statistics.median(
        m["group_cpu_ms"] - m["compute_cpu_ms"] - m["update_ms"] for m in runs))
    # the step is the CPU over the quota of 0.5 core, in every round
    steps = [e * m for e, m in zip(row["errors_at_run"],
                                   [m["step_mean_ms"] for m in runs])]
    assert cpu["predicted_ms"] == pytest.approx(
        0.5 * statistics.median(s + m["step_mean_ms"] for s, m in zip(steps, runs)))
    assert 0 < cpu["transfers_ms"] < cpu["predicted_ms"]
    text = pm.diagnose(row, rows)
    assert (f"predicted {cpu['predicted_ms']:.1f} ms, {cpu['transfers_ms']:.1f} of it the "
            f"transfers; measured {cpu['measured_ms']:.1f} ms, {row['outside_ms']:.1f} of it "
            "outside") in text, text
    assert "exposed communication" not in text
    # beside it, what the same mode's runs on one node (no transfers) spent there
    alone = [max(0.0, m["group_cpu_ms"] - m["compute_cpu_ms"] - m["update_ms"])
             for rnd in record["rounds"] for m in rnd["measured"]
             if m["model"] == "lenet" and m["mode"] == "split-fc" and m["np"] == 1]
    assert f"; {statistics.median(alone):.1f} ms at N=1, which sends nothing)" in text
    # a record that holds no counts of the waits says nothing of them
    assert "waits" not in row and "waits for transfers" not in text
    # one that does: their medians over the rounds, named after the node's CPU
    for i, m in enumerate(runs):
        m.update(wait_cpu_ms=0.8 + 0.1 * i, waits_per_step=21.0 - i, waits_slept_per_step=0.2 * i)
    rows = pm.validation_rows(record)
    row = next(r for r in rows if r["model"] == "lenet" and r["mode"] == "split-fc"
               and r["np"] == 4)
    assert row["waits"] == {"cpu_ms": pytest.approx(1.0), "count": 19.0,
                            "slept": pytest.approx(0.4)}
    assert ("; 1.0 ms in the training thread's waits for transfers (19.0 a step, 0.4 of them "
            "past the spin, a peer held up)") in pm.diagnose(row, rows)
    # without the control groups' CPU: the step's parts, as before
    for rnd in record["rounds"]:
        for m in rnd["measured"]:
            m.pop("group_cpu_ms", None)
    rows = pm.validation_rows(record)
    row = next(r for r in rows if r["model"] == "lenet" and r["mode"] == "split-fc"
               and r["np"] == 4)
    assert "cpu" not in row and "exposed communication" in pm.diagnose(row, rows)


def test_the_waits_note_gives_each_waiting_row_s_medians_beside_the_model_s_transfers():
    """``waits_note`` on docs/scaling.md's record whose runs counted their waits: for each
    row whose runs waited on the training thread (split-fc's activations), the medians over
    its rounds of train's waits, waits_slept and wait_cpu_s per step, worked out here from
    the record; rows that did not wait (their exchanges run on a stream) are left out, and
    a record without the counts has no such line."""
    import os
    import statistics
    from ringnet.perfmodel.validation import waits_note
    docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs")
    with open(os.path.join(docs, "bench-model-validation-1gbit-avx512-waits.json")) as f:
        record = json.load(f)
    rows = pm.validation_rows(record)
    note = waits_note(rows)
    waited = {}
    for rnd in record["rounds"]:
        for m in rnd["measured"]:
            waited.setdefault((m["model"], m["mode"], m["delay"], m["np"]), []).append(m)
    said = 0
    for (model, mode, delay, n), runs in waited.items():
        count = statistics.median(m["waits_per_step"] for m in runs)
        if not count:
            assert f"{model} {mode} d{delay} N={n}:" not in note
            continue
        slept = statistics.median(m["waits_slept_per_step"] for m in runs)
        cpu = statistics.median(m["wait_cpu_ms"] for m in runs)
        assert (f"{model} {mode} d{delay} N={n}: {count:.1f} waits, {slept:.1f} past the "
                f"spin, {cpu:.2f} ms") in note, note
        said += 1
    assert said == 4 and note.count(" past the spin, ") == 4
    with open(os.path.join(docs, "bench-model-validation-1gbit-avx512-minsplit.json")) as f:
        assert waits_note(pm.validation_rows(json.load(f))) is None


def test_on_nodes_with_a_core_each_the_simulated_waits_meet_the_measured_ones():
    """docs/scaling.md's record whose calibrations timed a sleeping poll: split-fc's rows at
    2 nodes (2 nodes on a machine of 2 CPUs) carry the simulated waits, and they come within
    a fraction of a wait, and of a millisecond of CPU, of what the runs counted (train's
    waits_slept and wait_cpu_s). At 4 nodes on the machine's 2 CPUs the nodes run together
    on them: the simulated waits count what the runs counted, none of them outlasts its
    spin (the CPUs hold the nodes at the quota's rate, so no budget runs out), and the
    simulated node's CPU a step comes within 10% of what the nodes spent. The report's
    waits line prints both."""
    import os
    from ringnet.perfmodel.validation import waits_note
    docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs")
    with open(os.path.join(docs, "bench-model-validation-unshaped-avx512-held.json")) as f:
        rows = pm.validation_rows(json.load(f))
    note = waits_note(rows)
    split = [r for r in rows if r["mode"] == "split-fc" and r["np"] > 1]
    assert len(split) == 4
    for r in split:
        sim, got = r["simulated"], r["waits"]
        if r["np"] == 4:
            assert sim["count"] == pytest.approx(got["count"], abs=1.0), r["model"]
            assert sim["slept"] == 0, r["model"]
            cpu = r["cpu"]
            assert cpu["predicted_ms"] == pytest.approx(cpu["measured_ms"], rel=0.1), r["model"]
            continue
        assert sim["slept"] == pytest.approx(got["slept"], abs=0.35), r["model"]
        assert sim["cpu_ms"] == pytest.approx(got["cpu_ms"], rel=0.4), r["model"]
        assert sim["count"] == pytest.approx(got["count"], abs=1.0), r["model"]
        assert (f"{r['model']} split-fc d0 N=2: {got['count']:.1f} waits, {got['slept']:.1f} "
                f"past the spin, {got['cpu_ms']:.2f} ms (simulated: {sim['count']:.1f} waits, "
                f"{sim['slept']:.1f} past the spin, {sim['cpu_ms']:.2f} ms)") in note
    assert note.count("(simulated: ") == 4
