"""python -m ringnet.bench soak — does a long run stay flat? Memory, threads and open files per
rank against the step count.

Starts ``ringnet.train`` (under ``mpirun -np N`` for N > 1) for many steps and samples every
rank's resident memory (VmRSS), thread count and open file descriptors from /proc every
``--every`` seconds, with the step count rank 0 last finished (the launcher heartbeat,
``RINGNET_HEARTBEAT``). After the warm-up (the first ``--warmup`` fraction of the steps) it
fits memory against steps by least squares and prints, per rank, the growth per 1,000 steps,
the noise (the residuals' standard deviation) and whether the run stayed flat: the growth
over the measured steps within three times the noise (at least 1 MiB, the allocator's
granularity), and no more threads or open files in the last third of the samples than in
the first. Each rank runs one BLAS thread. Linux only (/proc).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from ringnet.bench import machine, options
from ringnet.jobs import failure_reason
from ringnet.errors import UsageError
from ringnet.cli import ArgumentParser

__all__ = ["main", "fit", "verdict", "rank_processes"]

FLAT_FLOOR_KB = 1024.0


def _read(path):
    with open(path) as f:
        return f.read()


def rank_processes(root):
    """PIDs of the ``ringnet.train`` processes descended from ``root`` (``root`` itself included)."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            ppid = int(_read(f"/proc/{name}/stat").rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            argv = _read(f"/proc/{pid}/cmdline").split("\0")
        except OSError:
            argv = []
        # a Python running the module; not the launcher, whose arguments name it too
        if argv and os.path.basename(argv[0]).startswith("python") and any(
                a == "-m" and b == "ringnet.train" for a, b in zip(argv, argv[1:])):
            found.append(pid)
        todo += children.get(pid, [])
    return sorted(found)


def sample(pid):
    """(RSS in KiB, threads, open files) of ``pid``, or None when it is gone."""
    try:
        fields = dict(line.split(":", 1) for line in _read(f"/proc/{pid}/status").splitlines()
                      if ":" in line)
        return (float(fields["VmRSS"].split()[0]), int(fields["Threads"]),
                len(os.listdir(f"/proc/{pid}/fd")))
    except (OSError, KeyError, ValueError):
        return None


def fit(steps, values):
    """Least-squares line ``values ~ a + b * steps``: return (b, residual standard deviation)."""
    n = len(steps)
    if n < 3:
        raise ValueError("need at least 3 samples")
    mx, my = statistics.fmean(steps), statistics.fmean(values)
    sxx = sum((x - mx) ** 2 for x in steps)
    if sxx == 0:
        raise ValueError("the samples span no steps")
    b = sum((x - mx) * (y - my) for x, y in zip(steps, values)) / sxx
    a = my - b * mx
    resid = [y - (a + b * x) for x, y in zip(steps, values)]
    return b, (sum(r * r for r in resid) / (n - 2)) ** 0.5


def verdict(steps, rss_kb, threads, files):
    """Return the row of one rank: growth per 1,000 steps (KiB), noise (KiB), and whether flat."""
    slope, noise = fit(steps, rss_kb)
    grown = slope * (max(steps) - min(steps))
    third = max(1, len(steps) // 3)
    # threads and files may come and go (a stream's thread, a checkpoint's file); they must
    # not pile up: the last third of the samples holds no more than the first third
    steady = max(threads[-third:]) <= max(threads[:third]) and max(files[-third:]) <= max(files[:third])
    flat = abs(grown) <= max(3 * noise, FLAT_FLOOR_KB) and steady
    return {"samples": len(steps), "rss_mb_first": rss_kb[0] / 1024, "rss_mb_last": rss_kb[-1] / 1024,
            "growth_kb_per_1000_steps": 1000 * slope, "noise_kb": noise,
            "grown_kb": grown, "threads": sorted(set(threads)), "open_files": sorted(set(files)),
            "flat": flat}


def build_parser():
    p = ArgumentParser(prog="python -m ringnet.bench soak", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_np(p, 2, "ranks; 1 runs without mpirun")
    options.add_model(p, "lenet")
    options.add_dataset(p, "synthetic")
    p.add_argument("--mode", default=None, help="train's --mode (default: its own)")
    options.add_steps(p, 12000, "steps to run")
    p.add_argument("--every", type=float, default=2.0, help="seconds between samples (default 2)")
    p.add_argument("--warmup", type=float, default=0.2,
                   help="fraction of the steps left out of the fit (default 0.2)")
    options.add_mpirun(p)
    options.add_json(p, "also print one JSON line with every row")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if not os.path.isdir("/proc/self/fd"):
        raise UsageError("bench soak reads /proc: Linux only")
    if args.np < 1 or args.steps < 10 or not args.every > 0 or not 0 <= args.warmup < 1:
        raise UsageError("--np must be >= 1, --steps >= 10, --every > 0 and --warmup in [0, 1)")
    if args.np > 1 and shutil.which(args.mpirun) is None:
        raise UsageError(f"launcher {args.mpirun!r} not found; `pip install mpich` or pass --mpirun")
    cmd = [sys.executable, "-m", "ringnet.train", "--model", args.model, "--dataset",
           args.dataset, "--steps", str(args.steps), "--no-progress", "--no-eval", "--quiet",
           "--json"] + (["--mode", args.mode] if args.mode else [])
    if args.np > 1:
        cmd = [args.mpirun, "-np", str(args.np)] + cmd
    run = machine.begin(threads=1, per_rank=True)      # the ranks get one thread each
    load_start = run.load_start
    rows = {}
    with tempfile.TemporaryDirectory(prefix="ringnet-soak-") as folder:
        from ringnet.autosave import HEARTBEAT_ENV, read_heartbeat
        beat = os.path.join(folder, "heartbeat")
        # one BLAS thread a rank: this process's own pinning (bench's, for itself) must not
        # reach N ranks sharing the cores, which would oversubscribe them many times over
        env = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1",
                   **{HEARTBEAT_ENV: beat})
        out = open(os.path.join(folder, "out"), "w+")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
        samples = {}        # pid -> [(step, rss, threads, files)]
        try:
            while proc.poll() is None:
                step = read_heartbeat(beat)
                if step is not None and step < args.steps:
                    for pid in rank_processes(proc.pid):
                        got = sample(pid)
                        if got is not None:
                            samples.setdefault(pid, []).append((step, *got))
                print(f"\rstep {step or 0}/{args.steps}", end="", file=sys.stderr, flush=True)
                time.sleep(args.every)
        except KeyboardInterrupt:
            proc.terminate()
            raise
        finally:
            print(file=sys.stderr)
        err = proc.stderr.read()
        if proc.returncode != 0:
            raise UsageError(f"the soak run failed (exit {proc.returncode}): "
                             f"{failure_reason(err)}")
        out.seek(0)
        summary = json.loads([l for l in out.read().splitlines() if l.startswith("{")][-1])
        out.close()
    run.end(out=False)
    load_end = run.load_end
    start = args.warmup * args.steps
    for rank, (pid, rec) in enumerate(sorted(samples.items())):
        kept = [r for r in rec if r[0] >= start]
        if len(kept) < 3:
            raise UsageError(f"only {len(kept)} samples after the warm-up: run more --steps or "
                             f"sample more often (--every)")
        rows[rank] = verdict([r[0] for r in kept], [r[1] for r in kept], [r[2] for r in kept],
                             [r[3] for r in kept])
    print(" ".join(cmd))
    print(f"{summary['steps']} steps, {summary['step_ms']:.2f} ms a step; load average "
          f"{load_start:.2f} at the start, {load_end:.2f} at the end")
    print(f"{'process':>7} {'samples':>7} {'RSS MB':>15} {'KB/1000 steps':>13} {'noise KB':>9} "
          f"{'threads':>8} {'open files':>10}  verdict")
    for rank, row in rows.items():
        print(f"{rank:>7} {row['samples']:>7} {row['rss_mb_first']:>7.1f}-{row['rss_mb_last']:<7.1f} "
              f"{row['growth_kb_per_1000_steps']:>13.1f} {row['noise_kb']:>9.1f} "
              f"{','.join(map(str, row['threads'])):>8} {','.join(map(str, row['open_files'])):>10}  "
              f"{'flat' if row['flat'] else 'GROWS'}")
    if args.json:
        print(json.dumps({"steps": summary["steps"], "np": args.np, "model": args.model,
                          "load_start": load_start, "load_end": load_end,
                          "ranks": list(rows.values())} | run.facts()))
    return 0 if all(row["flat"] for row in rows.values()) else 1


if __name__ == "__main__":
    from ringnet.cli import run_main
    run_main(main)
