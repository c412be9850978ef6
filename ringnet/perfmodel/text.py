"""The model's text report: the inputs it used, the tables, crossovers, the research's
setting and the validation, as ``python -m ringnet.bench model`` prints them."""
import os
import statistics

from ringnet.perfmodel.calibration import calibration_record, describe_contention
from ringnet.perfmodel.codefacts import OLD_FACTS, code_facts, describe_facts
from ringnet.perfmodel.compute import profile_method
from ringnet.perfmodel.held import applies, share
from ringnet.perfmodel.links import LINKS
from ringnet.perfmodel.report import markdown_validation, print_tables
from ringnet.perfmodel.sweeps import PAPER_NP, mode_label
from ringnet.perfmodel.validation import (budget_note, diagnose, drift_note, measured_note,
                                          row_error, row_error_at_run, row_label, waits_note)

__all__ = ["print_report", "print_validation"]


def inter_link_hint(n, record):
    """Return the ``--inter-link US,MB/S`` line for a calibration at N = ``n`` whose ranks
    spanned nodes (its placement's ranks per node below ``n``), else None: the fitted link
    is then the one between nodes, which ``--topology auto`` prices."""
    per_node = record.get("raw", {}).get("placement", {}).get("per_node")
    if not per_node or int(per_node) >= n:
        return None
    return (f"across {-(-n // int(per_node))} nodes; python -m ringnet.train --inter-link "
            f"{record['alpha_s'] * 1e6:.3g},{record['beta_Bps'] / 1e6:.4g} prices these links "
            "for --topology auto")


def print_report(args, compute, profiles, calibration, nps, predictions, allreduces, crosses,
                 paper, paper_compute):
    """Print the inputs (compute, the code modelled, links, calibration) and every table but
    the validation's."""
    print(f"# compute: {compute.name} ({compute.source})")
    print(f"# the code modelled: {describe_facts(code_facts())}")
    for spec in profiles:
        if spec in ("local",):
            continue
        for part in dict.fromkeys(spec.split("/")):
            print(f"# link {part}: alpha {LINKS[part].alpha_s * 1e6:.1f} us, beta "
                  f"{LINKS[part].beta_Bps / 1e9:.2f} GB/s ({LINKS[part].source})")
    if calibration:
        for n, c in sorted((int(k), v) for k, v in calibration["by_np"].items()):
            c = calibration_record(n, c["raw"], compute.add_s_per_elem) if "raw" in c else c
            print(f"# local at N={n}: alpha {c['alpha_s'] * 1e6:.1f} us, beta "
                  f"{c['beta_Bps'] / 1e9:.2f} GB/s; beside compute the stream moves at "
                  f"{c['rate']:.2f} of that speed; "
                  f"compute slowdown {max(1.0, n / c['cores']):.2f} (effective cores "
                  f"{c['cores']:.2f}; all ranks busy against one alone: {c['slowdown']:.2f}, "
                  f"{c['raw'].get('cores', '?')} cores here); "
                  f"stream steals {c['steal']:.2f} of a core; {describe_contention(n, c)}")
            for line in calibration_lines(n, c):
                print(f"# local at N={n}: {line}")
    print_tables(predictions, args.batch_size, args.scaling, nps)
    if allreduces:
        print("\n# all-reduce of the whole gradient by the auto communicator (the algorithm the code "
              "picks for the size and N) against the ring, on each profile")
        print(f"  {'model':14s} {'profile':15s} {'N':>5s} {'bytes':>9s} {'auto picks':>10s} "
              f"{'auto ms':>9s} {'ring ms':>9s}")
        for r in allreduces:
            print(f"  {r['model']:14s} {r['profile']:15s} {r['np']:>5d} {r['bytes']:>9d} "
                  f"{r['picked']:>10s} {r['auto_ms']:9.3g} {r['ring_ms']:9.3g}")
    if crosses:
        print("\n# crossovers (time per image): from N on, the first mode is faster")
        for c in crosses:
            print(f"  {c['model']:14s} {c['profile']:15s} {c['faster']:>11s} beats "
                  f"{c['than']:<11s} from N = {c['from_np']}")
    print(f"\n# research setting: {PAPER_NP} GPUs, compute {paper_compute.name} "
          f"({paper_compute.source}), link {args.paper_profile}, Caffe's per-GPU batch")
    print(f"  {'model':14s} {'batch/GPU':>9s} {'mode':>11s} {'step ms':>8s} {'speedup':>8s} "
          f"{'reported':>8s}")
    for r in paper:
        rep = f"{r['reported_speedup']:.2f}" if r["reported_speedup"] else "-"
        print(f"  {r['model']:14s} {r['batch_per_gpu']:>9d} {mode_label(r['mode'], r['delay']):>11s} "
              f"{r['step_ms']:8.3f} {r['speedup']:8.2f} {rep:>8s}")


def print_validation(args, validation, record):
    """Print the validation: predicted beside measured per configuration, where the model is
    off and why, each round's contention and the README's table after a measuring run."""
    print(f"\n# validation on this machine: global batch {args.validate_batch}, "
          f"{args.validate_steps} steps, median of {args.validate_repeats} interleaved rounds; "
          f"the code measured: {describe_facts(record.get('code', OLD_FACTS))}"
          + (f"; load average then {', '.join(f'{x:.1f}' for x in record['load_average'])}"
             if record.get("load_average") else ""))
    methods = sorted({profile_method(rnd["compute"]) for rnd in record["rounds"]})
    print(f"# compute profile of each round: {', '.join(methods)}")
    print(f"# {measured_note(record)}")
    at_run = all(row_error_at_run(r) is not None for r in validation)
    print(f"  {'model':14s} {'mode':>11s} {'N':>3s} {'predicted ms':>12s} "
          + (f"{'at run ms':>9s} " if at_run else "")
          + f"{'measured ms':>11s} {'error':>7s} " + (f"{'at run':>7s} " if at_run else "")
          + f"{'each round':>17s} {'spread':>7s}")
    errors, run_errors = [], []
    for r in validation:
        err = row_error(r)
        errors.append(abs(err))
        each = r.get("errors_at_run" if at_run else "errors") or [err]
        span = (f"{100 * min(each):+.0f}..{100 * max(each):+.0f}%" if len(each) > 1
                else "-")
        if at_run:
            run_errors.append(abs(row_error_at_run(r)))
        print(f"  {r['model']:14s} {row_label(r):>11s} {r['np']:>3d} {r['predicted_ms']:12.2f} "
              + (f"{r['at_run_ms']:9.2f} " if at_run else "")
              + f"{r['measured_ms']:11.2f} {100 * err:+6.1f}% "
              + (f"{100 * row_error_at_run(r):+6.1f}% " if at_run else "")
              + f"{span:>17s} {100 * r['spread']:6.0f}%")
    within = sum(e <= 0.15 for e in errors)
    print(f"  median |error| {100 * statistics.median(errors):.0f}%, "
          f"{sum(e <= 0.10 for e in errors)} within 10%, {within} of {len(errors)} "
          f"within 15% (every configuration measured; error = median over rounds of each "
          f"round's prediction against its measurement); spread = (max - min) / median of "
          f"the measured rounds: {100 * statistics.median(r['spread'] for r in validation):.0f}% "
          "(median)")
    if at_run:
        speeds = [x for r in validation for x in r["speed"]]
        print(f"  at run: the profile taken at each run's own speed (its training threads' CPU "
              f"time in forward and backward per step against the profile's for the same "
              f"work: {min(speeds):.2f} to {max(speeds):.2f}x, median "
              f"{statistics.median(speeds):.2f}; the link as calibrated): median |error| "
              f"{100 * statistics.median(run_errors):.0f}%, {sum(e <= 0.10 for e in run_errors)} "
              f"within 10%, {sum(e <= 0.15 for e in run_errors)} within 15% of "
              f"{len(run_errors)} (the column each round: the rounds' errors at the run's "
              f"speed)")
        each_run = [abs(e) for r in validation for e in r["errors_at_run"]]
        each_profile = [abs(e) for r in validation for e in r["errors"]]
        print(f"  each run on its own ({len(each_run)}): median |error| "
              f"{100 * statistics.median(each_run):.1f}% at the run's speed, "
              f"{sum(e <= 0.10 for e in each_run)} within 10%; "
              f"{100 * statistics.median(each_profile):.1f}% with the profile as measured, "
              f"{sum(e <= 0.10 for e in each_profile)} within 10%")
    drift = drift_note(validation)
    if drift:
        print(f"  {drift}")
    budget = budget_note(record)
    if budget:
        print(f"  {budget}")
    waited = waits_note(validation)
    if waited:
        print(f"  {waited}")
    both = [r for r in validation
            if min(map(abs, r.get("errors") or [1.0])) <= 0.15 < max(map(abs, r.get("errors") or [0.0]))]
    if both:
        print(f"  {len(both)} row(s) within 15% in one round and outside in another: noise "
              "decides them, not the model")
    bar = 0.10 if at_run else 0.15
    off = [r for r, e in zip(validation, run_errors or errors) if e > bar]
    if off:
        where = " at the run's speed" if at_run else ""
        print(f"# where the model{where} is off by more than {100 * bar:.0f}%, and the part of "
              "the step that differs most (where a node's CPU quota bounds the step: the "
              "node's CPU)")
        for r in off:
            print(f"  {r['model']:14s} {diagnose(r, validation)}")
    for i, rnd in enumerate(record["rounds"]):
        for n, c in sorted((int(k), v) for k, v in rnd["calibration"]["by_np"].items()):
            if "raw" in c:
                c = calibration_record(n, c["raw"], rnd["compute"]["add_ns_per_element"] * 1e-9)
                print(f"# round {i + 1}, N={n}: {describe_contention(n, c)}")
                for line in calibration_lines(n, c):
                    print(f"# round {i + 1}, N={n}: {line}")
    print(f"# load average now: {', '.join(f'{x:.2f}' for x in os.getloadavg())} "
          "(timings on a loaded machine move by tens of percent)")
    if args.validate:
        where = args.validation or "FILE"
        print(f"\n# the README's validation table (reprinted by `python -m ringnet.bench model "
              f"--compute k40 --np {' '.join(map(str, sorted({r['np'] for r in validation})))} "
              f"--validation {where} --table validation --markdown`):")
        print(markdown_validation(validation))


def calibration_lines(n, record):
    """The lines the reports print under a calibration ``record`` at N, where it has what
    each needs: the --inter-link its links price at, what the model does under its nodes'
    quota and with their held waits, its transfers' CPU, its delayed exchange's rate."""
    lines = [inter_link_hint(n, record),
             quota_line(record["quota"], n, record.get("hosts")) if record.get("quota") else None,
             held_line(n, record), transfer_cpu_line(record), rooted_rate_line(n, record),
             delayed_rate_line(record)]
    return [line for line in lines if line]


def quota_line(quota, n=None, hosts=None):
    """What the model does with N nodes held to a CFS quota of ``quota`` (< 1) cores, on
    the machines ``hosts`` (as the calibration names them; None: not named)."""
    burst = share(n, hosts) if hosts and n and n > 1 else 1.0
    if burst < 1.0:
        return (f"nodes held to a CPU quota of {quota:g} core, {n} of them {_on(hosts)}: one "
                f"rank a node computes at {burst:.2g} of a core while all compute at once "
                f"(split-fc, whose ranks compute between blocking collectives: at a full "
                f"core's speed while the period's budget lasts), no rank's step its own (the "
                f"CPUs are shared), and no step is shorter than its CPU time / {quota:g}")
    return (f"nodes held to a CPU quota of {quota:g} core: one rank a node computes at a full "
            f"core's speed while the period's budget lasts (the profile times {quota:g}), and "
            f"no step is shorter than its CPU time / {quota:g}")


def _on(hosts):
    """The machines ``hosts`` names, as the report's quota and held lines say them."""
    return f"on {hosts['hosts']} machine(s) of {hosts['cpus']} CPUs"


def held_line(n, record):
    """On nodes held to a quota, how the model simulates split-fc's waits on peers held by
    their quotas at N (:func:`ringnet.perfmodel.prediction.held_waits`): the machines the
    nodes ran on (together on a machine's CPUs where they outnumber them) and a sleeping
    poll's cost as the calibration ``record`` measured them; None where it has no quota or
    did not measure them."""
    polls, hosts = record.get("polls"), record.get("hosts")
    if not record.get("quota") or not polls or not hosts or n < 2:
        return None
    where = f"{n} nodes {_on(hosts)}"
    if not applies(n, hosts):
        where += (": the nodes run together on the machine's CPUs, shared among the ranks "
                  "that compute, a spinning wait taking what they leave")
    return (f"split-fc's waits on peers held by their quotas simulated ({where}): a sleeping "
            f"poll costs {polls['cpu_s'] * 1e6:.1f} us of CPU and sleeps "
            f"{polls['extra_s'] * 1e6:.0f} us beyond its pause")


def transfer_cpu_line(record):
    """What the transfers cost their rank's CPU in a calibration ``record`` (per message and
    per MB sent, blocking and on the stream), or None where it was not measured."""
    costs = [f"{where} {cost['per_msg_s'] * 1e6:.0f} us a message + "
             f"{cost['per_byte_s'] * 1e12:.0f} us a MB sent"
             for where, cost in (("blocking", record.get("cpu_blocking")),
                                 ("on the stream", record.get("cpu_stream"))) if cost]
    return "CPU a transfer costs its rank: " + "; ".join(costs) if costs else None


def rooted_rate_line(n, record):
    """The rate of the tree's and master's reduce + broadcast beside compute that a
    calibration ``record`` measured at N (their buckets beside the backward take it),
    against the ring's; None where it measured none."""
    rates = record.get("rooted_rate")
    if not rates or n < 2:
        return None
    each = ", ".join(f"{rates[route]:.2f} ({route})" for route in ("master", "tree")
                     if route in rates)
    return (f"beside compute a reduce + broadcast moves at {each} of its blocking speed, "
            f"the ring's all-reduce at {record['rate']:.2f}")


def delayed_rate_line(record):
    """On nodes held to a quota, the rate of each model's delayed exchange beside one of its
    steps that a calibration ``record`` measured (the delayed step prices it), against the
    stream's rate beside compute back to back; None where it has none or no quota."""
    rates = record.get("delayed_rate")
    if not rates or not record.get("quota"):
        return None
    each = ", ".join(f"{rate:.2f} ({name})" for name, rate in sorted(rates.items()))
    return (f"the delayed exchange beside one step moves at {each} of its blocking speed "
            f"(beside compute back to back: {record['rate']:.2f})")
