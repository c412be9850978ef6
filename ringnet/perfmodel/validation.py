"""Validation: the model's prediction beside ``ringnet.train`` measured on this machine."""
import argparse
import dataclasses
import os
import statistics
import sys
import time

import numpy as np

from ringnet.perfmodel.calibration import calibrate
from ringnet.perfmodel.codefacts import OLD_FACTS, code_facts, facts
from ringnet.perfmodel.compute import compute_from_json, fit_batch_times
from ringnet.perfmodel.prediction import predict
from ringnet.perfmodel.profiling import measure_compute
from ringnet.perfmodel.sweeps import MODES, REFERENCE, mode_label, communicates, fits
from ringnet.perfmodel.profiles import make_system
from ringnet.models import build_model

__all__ = ["VALIDATION_NP", "VALIDATION_MODES", "validate", "validation_rows", "measured_ms",
           "measured_note", "row_error", "row_label", "diagnose", "SpeedProbe", "drift_of",
           "drift_note", "run_speed", "row_error_at_run", "budget_note", "waits_note"]

VALIDATION_NP = (1, 2, 4)
VALIDATION_MODES = tuple(md for md in MODES if communicates(md[0]))
PROBE_S = 0.3                    # a speed probe times a model's steps for this long ...
PROBE_STEPS = 3                  # ... and at least this many


class SpeedProbe:
    """The machine's speed now, as each model's step shows it: the step's loss and gradients
    at the validation's batch, in this process, back to back for PROBE_S (at least
    PROBE_STEPS calls). A shared machine's speed drifts by a fifth or more over seconds and
    minutes; probed when the profile is measured and just before and after each run, it
    says how much faster or slower the machine ran that run than it ran the profile."""

    def __init__(self, models, batch, seed=0):
        rng = np.random.default_rng(seed)
        self.nets = {}
        for name in models:
            net = build_model(name, seed=seed)
            x = rng.normal(size=(batch,) + net.input_shape).astype(net.dtype)
            y = rng.integers(0, net.num_classes, size=batch)
            self.nets[name] = (net, x, y)
            self.ms(name)                               # the first call allocates

    def ms(self, name):
        """The mean step of model ``name`` in ms, timed now."""
        net, x, y = self.nets[name]
        calls, start = 0, time.perf_counter()
        with np.errstate(over="ignore", invalid="ignore"):
            while True:
                net.loss_and_grad(x, y)
                calls += 1
                elapsed = time.perf_counter() - start
                if elapsed >= PROBE_S and calls >= PROBE_STEPS:
                    return 1e3 * elapsed / calls


def validate(models, batch, steps, repeats, mpirun="mpirun", iters=7, timeout=600,
             nps=VALIDATION_NP, per_node=None, probe=None):
    """Measure, in each of ``repeats`` rounds: the compute profile, the local calibration, and
    ``python -m ringnet.train`` (as ``bench scaling`` runs it) for every mode at each N.

    Returns a record that :func:`validation_rows` turns into predicted-beside-measured rows;
    each round's prediction uses that round's inputs (a shared machine's speed drifts).
    ``mpirun`` is the launcher's command line; ``per_node``: the calibration's and the
    runs' ranks placed that many to a node (``srun --mpi=pmi2`` on a cluster; None: as the
    launcher likes). Where the ranks fill more than one node of ``per_node`` ranks, each mode
    with a hierarchical exchange runs with ``--topology flat`` and ``hierarchical``.
    ``probe``: the :class:`SpeedProbe` (default one of ``models`` at ``batch``) timed right
    after each round's profile (the round's ``probe_ms``) and just before and after each run
    (the run's ``probe_ms``, the two): :func:`validation_rows` says how far the machine
    drifted between."""
    from ringnet.cluster import placed
    from ringnet.jobs import train_run
    from ringnet.parallel import hierarchical_modes
    # bench scaling's defaults: the synthetic data set on the CPU, train's own recipe
    args = argparse.Namespace(model=None, dataset="synthetic", batch_size=batch, steps=steps,
                              transport="auto", device="cpu", mpirun=mpirun, launcher=None,
                              timeout=timeout, lr=None, seed=None, data_dir=None,
                              delay_compensation=None)
    configs = [(m, REFERENCE, 0, 1, None) for m in models]
    configs += [(m, mode, delay, n, topology) for m in models for n in nps
                for mode, delay in VALIDATION_MODES if fits(mode, build_model(m), n)
                for topology in _topologies(mode, n, per_node, hierarchical_modes())]
    probe = probe or SpeedProbe(models, batch)
    rounds = []
    for round_ in range(repeats):
        compute = measure_compute(models)
        speed = {name: probe.ms(name) for name in models}
        calibration = calibrate(tuple(n for n in nps if n > 1), compute, mpirun, iters,
                                models=models, batch=batch, scaling="strong", per_node=per_node)
        measured = []
        for i, (name, mode, delay, n, topology) in enumerate(configs):
            args.model = name
            before = probe.ms(name)
            result = train_run(args, mode, delay, placed(n, per_node),
                               extra=("--topology", topology) if topology else ())
            after = probe.ms(name)
            steps_run = max(int(result.get("steps") or steps), 1)
            measured.append({"model": name, "mode": mode, "delay": delay, "np": n,
                             **({"topology": topology} if topology else {}),
                             "step_ms": result["step_ms"], "nodes": result.get("nodes", 1),
                             **({"step_mean_ms": result["step_mean_ms"]}
                                if "step_mean_ms" in result else {}),
                             # per step, mean over ranks: where the time went, and
                             # the CPU the ranks' control groups (on a cluster: their
                             # nodes) used, against the quota the calibration records
                             **{f"{part}_ms": 1e3 * result[f"{key}_s"] / steps_run
                                for part, key in (("compute", "compute"),
                                                  ("compute_cpu", "compute_cpu"),
                                                  ("exposed", "comm_wait"),
                                                  ("update", "update"), ("data", "data"),
                                                  ("group_cpu", "group_cpu"),
                                                  ("wait_cpu", "wait_cpu"))
                                if result.get(f"{key}_s") is not None},
                             # the training thread's waits for transfers per step, and
                             # those that polled out their spin and slept
                             **{f"{key}_per_step": result[key] / steps_run
                                for key in ("waits", "waits_slept") if key in result},
                             "probe_ms": [before, after]})
            print(f"\r[round {round_ + 1}/{repeats}] {i + 1}/{len(configs)} ", end="",
                  file=sys.stderr, flush=True)
        rounds.append({"compute": compute.to_json(), "calibration": calibration,
                       "measured": measured, "probe_ms": speed})
    print(file=sys.stderr)
    return {"batch_size": batch, "steps": steps, "rounds": rounds, "code": code_facts(),
            "launcher": mpirun, "ranks_per_node": per_node,
            "load_average": list(os.getloadavg())}


def _topologies(mode, n, per_node, hierarchical):
    """The --topology values a validation runs ``mode`` at N with: flat and hierarchical
    where N ranks fill more than one node of ``per_node`` and the mode has a hierarchical
    exchange; (None,) (train's own choice) elsewhere."""
    if per_node and per_node > 1 and n > per_node and mode in hierarchical:
        return ("flat", "hierarchical")
    return (None,)


def row_label(row):
    """A validation row's mode, delay and (where it was chosen) topology: "ring d1 hier"."""
    label = mode_label(row["mode"], row["delay"])
    return label + " hier" if row.get("topology") == "hierarchical" else label


def validation_rows(record):
    """Return [{model, mode, delay, np, predicted_ms, measured_ms, error, errors, spread, parts}]:
    every configuration measured, none left out. ``predicted_ms``/``measured_ms`` are medians
    over the rounds; ``errors`` each round's own error (that round's prediction, from that
    round's profile and calibration, against that round's measurement) and ``error`` their
    median, so a drift of the machine between rounds is not mistaken for a model error;
    ``spread`` = (max - min) / median of the measured step. Where the record has the speed
    probe's times, ``drift`` lists each run's :func:`drift_of` and ``error_followed`` is the
    error of predictions that take the round's profile at the speed the machine had around
    each run (on this project's machines that cancelled the drift in some records and added
    to it in others: the probe, one process timing one model's step for 0.3 s, follows the
    machine only in part). Where the record has each run's compute CPU time and the
    profile's (:func:`run_speed`), ``at_run_ms`` is the prediction with the profile at the
    run's own speed, ``errors_at_run`` each round's error of it and ``error_at_run`` their
    median, ``speed`` each run's :func:`run_speed`."""
    with facts(record.get("code", OLD_FACTS)):       # as the code that was measured ran
        return _validation_rows(record)


def drift_of(rnd, m):
    """How much slower the machine ran validation entry ``m`` than its round's profile: the
    speed probe's step around the run (the mean of before and after) over the probe's step
    when the profile was measured; 1.0 where the record has no probe."""
    ref = (rnd.get("probe_ms") or {}).get(m["model"])
    around = m.get("probe_ms")
    if not ref or not around:
        return 1.0
    return statistics.mean(around) / ref


def run_speed(rnd, m, batch):
    """How much slower the machine computed during validation entry ``m`` than when its
    round's profile was measured, from the run itself: the CPU time its training threads
    spent in their forward and backward per step (the ranks' mean, ``compute_cpu_ms``)
    over the CPU time the profile's steps took for the same work (``compute_cpu_ms`` of
    the profile at the run's batch per rank; split-fc's FC layers compute the whole batch
    for 1/N of their outputs, the work of the batch per rank). CPU time, not wall time:
    the time a quota held the thread, or another thread ran, does not count, so what is
    left is the machine's speed (and the contention the run met); None where the record
    lacks either."""
    ref = ((rnd.get("compute") or {}).get("compute_cpu_ms") or {}).get(m["model"])
    got = m.get("compute_cpu_ms")
    if not ref or not got:
        return None
    points = {int(b): v for b, v in ref.items()}
    local = batch / m["np"]
    at = points.get(local)                   # measured at that batch, else its line
    if at is None and len(points) == 1:
        (b, v), = points.items()
        at = v * local / b
    elif at is None:
        fixed, per_sample = fit_batch_times(list(points), list(points.values()))
        at = fixed + per_sample * local
    return got / at if at > 0 else None


def _validation_rows(record):
    batch = record["batch_size"]
    table = {}
    for rnd in record["rounds"]:
        system = _round_system(rnd)
        for m in rnd["measured"]:
            key = (m["model"], m["mode"], m["delay"], m["np"], m.get("topology"))
            model = build_model(m["model"])

            def on(sys_):
                return predict(sys_, model, m["mode"], m["delay"], m["np"], batch,
                               topology=m.get("topology") or "flat")
            pred, drift = on(system), drift_of(rnd, m)
            # the profile at the speed the machine had around the run; the link as calibrated
            moved = pred if drift == 1.0 else on(
                dataclasses.replace(system, compute=system.compute.scaled(drift)))
            speed = run_speed(rnd, m, batch)
            # the profile at the speed the run's own CPU time shows (contention included)
            at_run = None if speed is None else on(dataclasses.replace(
                system, compute=system.compute.scaled(speed), as_run=True))
            entry = table.setdefault(key, {"predicted": [], "measured": [], "parts": [],
                                           "followed": [], "drift": [], "at_run": [],
                                           "speed": [], "cpu": [], "outside": [],
                                           "waits": [], "simulated": [], "budget": []})
            entry["predicted"].append(pred.step_s * 1e3)
            entry["followed"].append(moved.step_s * 1e3)
            entry["drift"].append(drift)
            if at_run is not None:
                entry["at_run"].append(at_run.step_s * 1e3)
                entry["speed"].append(speed)
            entry["measured"].append(measured_ms(m, system))
            part = at_run or pred      # the parts of the prediction the table judges
            parts = {"compute": (part.compute_s * 1e3, m.get("compute_ms")),
                     "exposed": (part.exposed_s * 1e3, m.get("exposed_ms")),
                     "update": (part.update_s * 1e3, m.get("update_ms")),
                     "data": (0.0, m.get("data_ms"))}
            entry["parts"].append(parts)
            entry["cpu"].append(_node_cpu(part, m))
            entry["outside"].append(_outside_ms(m))
            entry["waits"].append(_waits(m))
            entry["simulated"].append(_simulated(part))
            spent = _budget_spent(m, system)
            if spent is not None:
                entry["budget"].append(spent)
    rows = []
    for k, v in table.items():
        parts = {}
        for part in ("compute", "exposed", "update", "data"):
            pred = statistics.median(p[part][0] for p in v["parts"])
            got = [p[part][1] for p in v["parts"] if p[part][1] is not None]
            parts[part] = (pred, statistics.median(got) if got else None)
        # paired: each round's prediction against that round's measurement, then the median
        errors = [(p - m) / m for p, m in zip(v["predicted"], v["measured"])]
        followed = [(p - m) / m for p, m in zip(v["followed"], v["measured"])]
        at_run = {}
        if len(v["at_run"]) == len(v["measured"]):
            each = [(p - m) / m for p, m in zip(v["at_run"], v["measured"])]
            at_run = {"at_run_ms": statistics.median(v["at_run"]), "errors_at_run": each,
                      "error_at_run": statistics.median(each), "speed": v["speed"]}
        cpu = {}
        if all(o is not None for o in v["outside"]):
            cpu["outside_ms"] = statistics.median(v["outside"])
        if all(w is not None for w in v["waits"]):
            cpu["waits"] = {name: statistics.median(w[name] for w in v["waits"])
                            for name in v["waits"][0]}
        if len(v["budget"]) == len(v["measured"]):
            cpu["budget"] = v["budget"]
        if all(w is not None for w in v["simulated"]):
            cpu["simulated"] = {name: statistics.median(w[name] for w in v["simulated"])
                                for name in v["simulated"][0]}
        if v["cpu"] and all(c is not None for c in v["cpu"]):
            cpu["cpu"] = {name: _median_of_known(c[name] for c in v["cpu"])
                          for name in v["cpu"][0]}
        rows.append({"model": k[0], "mode": k[1], "delay": k[2], "np": k[3],
                     **({"topology": k[4]} if k[4] else {}),
                     "predicted_ms": statistics.median(v["predicted"]),
                     "measured_ms": statistics.median(v["measured"]), **at_run,
                     "error": statistics.median(errors), "errors": errors,
                     "drift": v["drift"], "error_followed": statistics.median(followed),
                     "spread": (max(v["measured"]) - min(v["measured"]))
                     / statistics.median(v["measured"]), "parts": parts, **cpu})
    return rows


def _median_of_known(values):
    """The median of the values that are not None; None where none is."""
    known = [x for x in values if x is not None]
    return statistics.median(known) if known else None


def _outside_ms(m):
    """The CPU validation entry ``m``'s node spent a step outside the training thread's
    compute and update spans (the transfers, the step's glue, the data loader): its
    control group's CPU less those; None where the run could not read them."""
    if any(m.get(k) is None for k in ("group_cpu_ms", "compute_cpu_ms", "update_ms")):
        return None
    return max(0.0, m["group_cpu_ms"] - m["compute_cpu_ms"] - m["update_ms"])


def _waits(m):
    """The training thread's waits for transfers per step in validation entry ``m``:
    {"cpu_ms" (their CPU), "count", "slept" (those that polled out their spin and slept)};
    None where the run did not count them (records before it did)."""
    if any(m.get(k) is None for k in ("wait_cpu_ms", "waits_per_step", "waits_slept_per_step")):
        return None
    return {"cpu_ms": m["wait_cpu_ms"], "count": m["waits_per_step"],
            "slept": m["waits_slept_per_step"]}


def _simulated(prediction):
    """The waits per step of a prediction that simulated them (nodes held to a quota whose
    ranks wait for each other, :func:`~ringnet.perfmodel.prediction.held_waits`), as
    :func:`_waits` gives the measured ones; None where it did not."""
    held = prediction.held
    if held is None:
        return None
    return {"cpu_ms": held.wait_cpu_s * 1e3, "count": held.waits, "slept": held.held}


def _node_cpu(prediction, m):
    """Where a node's CPU quota bounds a predicted step (its CPU time over the quota) and
    the run measured its control group's CPU: {"predicted_ms", "transfers_ms" (None where
    the calibration did not price them), "measured_ms"}; else None. (What of it fell
    outside the compute and update is the row's own ``outside_ms``.)"""
    if prediction.node_cpu_s is None or m.get("group_cpu_ms") is None:
        return None
    transfers = prediction.transfers_cpu_s
    return {"predicted_ms": prediction.node_cpu_s * 1e3,
            "transfers_ms": None if transfers is None else transfers * 1e3,
            "measured_ms": m["group_cpu_ms"]}


def _round_system(rnd):
    """The system a validation round's prediction uses: its profile and its calibration
    (placed on a cluster: make_system takes the placement and the quota from the latter)."""
    return make_system("local", compute_from_json(rnd["compute"]), 1, rnd["calibration"])


def measured_ms(m, system):
    """The measured step of validation entry ``m``: the median step, or on nodes held to a
    CPU quota (``system.quota``) the mean step where the record has it. A quota ends each
    step at whole periods of it, so runs of one work have steps a period apart and their
    median is one of those values; the mean is the rate the quota allows, the model's."""
    if system.quota is not None and m.get("step_mean_ms") is not None:
        return m["step_mean_ms"]
    return m["step_ms"]


def drift_note(rows):
    """One line on the machine's drift around the runs (the speed probe), and how the rows
    would read if the predictions followed it; None where the record has no probe."""
    drifts = [d for r in rows for d in r.get("drift", ()) if d != 1.0]
    if not drifts:
        return None
    errors = [abs(r["error_followed"]) for r in rows]
    return (f"the machine's speed during each run against its round's profile (the speed "
            f"probe: each model's step in this process, {PROBE_S:g} s before and after the "
            f"run): {min(drifts):.2f} to {max(drifts):.2f}x the profile's time, median "
            f"{statistics.median(drifts):.2f}; predictions that took the profile at that "
            f"speed: median |error| {100 * statistics.median(errors):.0f}%, "
            f"{sum(e <= 0.10 for e in errors)} within 10%, {sum(e <= 0.15 for e in errors)} "
            f"within 15% of {len(errors)}")


def _budget_spent(m, system):
    """How much of its quota validation entry ``m``'s nodes spent: their CPU per step
    (``group_cpu_ms``) over the quota's share of the measured step; None where the run did
    not read its control group's CPU or no quota held it."""
    if system.quota is None or m.get("group_cpu_ms") is None:
        return None
    return m["group_cpu_ms"] / (system.quota * measured_ms(m, system))


def budget_note(record):
    """One line on how much of their CPU quota the runs' nodes spent, where the record has
    each run's control-group CPU (train's ``group_cpu_s`` per step, ``group_cpu_ms``) and
    its calibration a quota: per N, the CPU per step over the quota's share of the mean
    step (1.0: every node spent its whole budget; the step is its CPU over the quota);
    None elsewhere."""
    by_n = {}
    for rnd in record["rounds"]:
        system = _round_system(rnd)
        if system.quota is None:
            continue
        for m in rnd["measured"]:
            spent = _budget_spent(m, system)
            if spent is not None:
                by_n.setdefault(m["np"], []).append(spent)
    if not by_n:
        return None
    parts = [f"N = {n}: {min(v):.2f} to {max(v):.2f} (median {statistics.median(v):.2f})"
             for n, v in sorted(by_n.items())]
    return ("the nodes' CPU per step (train's group_cpu_s) over their quota's share of the "
            "mean step, run by run: " + "; ".join(parts))


def waits_note(rows):
    """One line on the training thread's waits for transfers where the runs counted them:
    for each row whose runs waited, the medians over its rounds of train's ``waits``,
    ``waits_slept`` and ``wait_cpu_s`` per step, beside the CPU the model prices the step's
    transfers at where a node's quota bounds the step, or where the model simulated the
    waits (nodes held to a quota, :func:`~ringnet.perfmodel.prediction.held_waits`) the
    simulated figures; None where no row waited."""
    said = []
    for r in rows:
        waits = r.get("waits")
        if not waits or not waits["count"]:
            continue
        text = (f"{r['model']} {row_label(r)} N={r['np']}: {waits['count']:.1f} waits, "
                f"{waits['slept']:.1f} past the spin, {waits['cpu_ms']:.2f} ms")
        sim = r.get("simulated")
        priced = (r.get("cpu") or {}).get("transfers_ms")
        if sim is not None:
            text += (f" (simulated: {sim['count']:.1f} waits, {sim['slept']:.1f} past the "
                     f"spin, {sim['cpu_ms']:.2f} ms)")
        elif priced is not None:
            text += f" (the model's transfers: {priced:.2f} ms)"
        said.append(text)
    if not said:
        return None
    return ("the training thread's waits for transfers per step, where the runs waited "
            "(train's waits, waits_slept and wait_cpu_s; medians over the rounds): "
            + "; ".join(said))


def measured_note(record):
    """One line on what a record's measured column is: each run's median step, or on nodes
    held to a CPU quota (the calibration says so) each run's mean step, where it has one."""
    systems = [(_round_system(rnd), rnd) for rnd in record["rounds"]]
    quotas = sorted({system.quota for system, _ in systems} - {None})
    means = any(measured_ms(m, system) != m["step_ms"]
                for system, rnd in systems for m in rnd["measured"])
    if quotas and means:
        return (f"measured: each run's mean step (nodes held to a CPU quota of "
                f"{', '.join(f'{q:g}' for q in quotas)} core: a step ends at whole periods of it)")
    return "measured: each run's median step"


def row_error_at_run(row):
    """A validation row's error with the profile at each run's own speed (:func:`run_speed`),
    or None where the record cannot say it."""
    return row.get("error_at_run")


def row_error(row):
    """A validation row's error: the median of its rounds' paired errors (records reprinted
    by older code: the error of the medians)."""
    if "error" in row:
        return row["error"]
    return (row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]


def diagnose(row, rows):
    """Say where a validation row's error comes from: the part of the step (compute, exposed
    communication, update, data loading the model does not charge) that differs most, or
    where a node's CPU quota bounds the predicted step, the node's CPU per step predicted
    (and the transfers' part of it) against the run's control group's, and
    how far the machine itself moved (the spread of this row's rounds; the N=1 rows of the
    same model, which all do the same work). Where the row has the prediction at each run's
    own speed, its error and parts are that prediction's."""
    err = row_error_at_run(row)
    if err is None:
        err = row_error(row)
    measured = {k: v for k, v in row["parts"].items() if v[1] is not None}
    words = []
    cpu = row.get("cpu")
    if cpu:
        # the quota bounds the step: its parts in time say less than the node's CPU
        said = f"the node's CPU per step (the step is it over the quota): predicted " \
               f"{cpu['predicted_ms']:.1f} ms"
        if cpu.get("transfers_ms") is not None:
            said += f", {cpu['transfers_ms']:.1f} of it the transfers"
        said += f"; measured {cpu['measured_ms']:.1f} ms"
        if row.get("outside_ms") is not None:
            said += (f", {row['outside_ms']:.1f} of it outside the training thread's compute "
                     f"and update (the transfers, the step's glue, the data loader")
            # the same mode on one rank: its glue and loader, without transfers
            alone = [r["outside_ms"] for r in rows if r["model"] == row["model"]
                     and r["mode"] == row["mode"] and r["np"] == 1
                     and r.get("outside_ms") is not None]
            if alone:
                said += f"; {statistics.median(alone):.1f} ms at N=1, which sends nothing"
            said += ")"
        waits = row.get("waits")
        if waits and waits["count"]:
            said += (f"; {waits['cpu_ms']:.1f} ms in the training thread's waits for "
                     f"transfers ({waits['count']:.1f} a step, {waits['slept']:.1f} of them "
                     f"past the spin, a peer held up")
            sim = row.get("simulated")
            if sim is not None:
                said += (f"; simulated {sim['cpu_ms']:.1f} ms, {sim['count']:.1f} a step, "
                         f"{sim['slept']:.1f} past the spin")
            said += ")"
        spent = row.get("budget")
        if spent:
            said += (f"; its nodes spent {min(spent):.2f} to {max(spent):.2f} of their quota's "
                     f"share of the step, round by round")
        words.append(said)
    elif measured:
        diffs = {k: p - m for k, (p, m) in measured.items()}
        worst = max(diffs, key=lambda k: abs(diffs[k]))
        what = {"compute": "compute (the profile or the contention at this N)",
                "exposed": "exposed communication (the link or the overlap)",
                "update": "the update", "data": "data loading (not modelled)"}[worst]
        words.append(f"{what}: predicted {measured[worst][0]:.1f} ms, measured "
                     f"{measured[worst][1]:.1f} ms")
    ones = [r["measured_ms"] for r in rows if r["model"] == row["model"] and r["np"] == 1]
    if len(ones) > 1:
        floor = (max(ones) - min(ones)) / statistics.median(ones)
        words.append(f"same-work N=1 rows of {row['model']} differ by {100 * floor:.0f}%")
    words.append(f"rounds of this row differ by {100 * row['spread']:.0f}%")
    return f"{row_label(row)} N={row['np']} {100 * err:+.0f}%: " + "; ".join(words)
