"""python -m ringnet.bench elastic — what periodic checkpoints cost, and what a lost rank costs.

1. Save cost: the same run under ``mpirun -np N`` without checkpoints, with
   ``--save-every K`` as shipped (rank 0 writes in the background while every rank
   trains on), and with ``RINGNET_SAVE_SYNC=1`` (rank 0 writes while the others wait),
   in interleaved rounds; the cost of one save is the difference in training time
   divided by the saves, median over rounds.
2. A lost rank: ``python -m ringnet.launch -n N`` with ``--save-every K``, one rank
   killed with SIGKILL once the first checkpoint exists; prints the steps lost, the
   time from the failure to training again, and the whole run against an
   uninterrupted one.
"""
import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from ringnet.bench import machine, options
from ringnet.jobs import run_json
from ringnet.tables import markdown
from ringnet.errors import UsageError
from ringnet.cli import ArgumentParser

__all__ = ["main", "rank_pids", "kill_rank_after_first_checkpoint", "markdown_tables"]


def _modes():
    from ringnet.parallel import distributed_modes
    return distributed_modes()


def build_parser():
    p = ArgumentParser(prog="python -m ringnet.bench elastic", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_np(p, 4)
    options.add_model(p, "cifar10_quick")
    options.add_dataset(p, "synthetic")
    p.add_argument("--mode", default="ring", choices=_modes(),
                   help="parallel mode of every run (default ring)")
    options.add_batch_size(p)
    options.add_steps(p, 60)
    p.add_argument("--every", type=int, default=10, help="--save-every K (default 10)")
    options.add_repeats(p, 3, "interleaved rounds of part 1")
    p.add_argument("--kill-rank", type=int, default=1, help="rank killed in part 2 (default 1)")
    p.add_argument("--shrink", action="store_true", help="part 2 relaunches on fewer ranks")
    options.add_lr(p, 0.001, "learning rate, small enough that no mode diverges in a timing run")
    options.add_mpirun(p)
    options.add_timeout(p)
    options.add_markdown(p, "print the two tables")
    return p


def rank_pids(marker, proc="/proc"):
    """Return {rank: pid} of the ringnet.train processes whose arguments include ``marker``.

    A rank's forked child (between fork and exec, or a worker) carries the rank's command
    line and environment too: a process whose parent is a match of the same rank is that
    child, not the rank, and is left out."""
    found = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            if b"ringnet.train" not in args or marker.encode() not in args:
                continue
            if os.path.basename(args[0]).startswith((b"mpirun", b"mpiexec", b"srun")):
                continue
            with open(f"{proc}/{entry}/environ", "rb") as f:
                environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            with open(f"{proc}/{entry}/status", "rb") as f:
                parent = next((int(line.split()[1]) for line in f if line.startswith(b"PPid:")), 0)
        except (OSError, ValueError, IndexError):
            continue
        rank = environ.get(b"PMI_RANK") or environ.get(b"OMPI_COMM_WORLD_RANK")
        if rank is not None:
            found[int(entry)] = (int(rank), parent)
    return {rank: pid for pid, (rank, parent) in sorted(found.items())
            if found.get(parent, (None,))[0] != rank}


def kill_rank_after_first_checkpoint(proc, save, rank, limit=600, sig=signal.SIGKILL):
    """Send ``sig`` (SIGKILL) to ``rank`` of the job writing ``save`` once its first checkpoint exists.

    Returns (checkpoint step seen, time.monotonic() of the kill).
    """
    from ringnet.launch import checkpoint_step
    deadline = time.monotonic() + limit
    pid = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UsageError("the run ended before a rank could be killed; use more --steps")
        if pid is None:             # found first, so the signal follows the checkpoint at once
            pid = rank_pids(save).get(rank)
        step = checkpoint_step(save) if pid is not None and os.path.exists(save) else None
        if step is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:      # not the rank after all (it ended): look again
                pid = None
                continue
            return step, time.monotonic()
        time.sleep(0.01)
    raise UsageError(f"no checkpoint appeared within {limit:.0f} s")


def _train_flags(args):
    return ["--model", args.model, "--dataset", args.dataset, "--mode", args.mode,
            "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--lr", str(args.lr),
            "--device", "cpu", "--quiet", "--no-progress", "--no-eval"]


def _env(extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
    env.pop("RINGNET_SAVE_SYNC", None)
    env.update(extra or {})
    return env


def _run_train(args, extra_flags, env=None):
    cmd = [args.mpirun, "-np", str(args.np), sys.executable, "-m", "ringnet.train",
           *_train_flags(args), "--json", *extra_flags]
    return run_json(cmd, "training run", env=_env(env), timeout=args.timeout)


def save_cost(args, tmp):
    """Part 1: training time without saves, with background saves, with synchronous saves."""
    path = os.path.join(tmp, "cost.h5")
    every = ["--save", path, "--save-every", str(args.every)]
    variants = {"no periodic save": ([], None),
                "rank 0 writes, others train on": (every, None),
                "rank 0 writes, others wait": (every, {"RINGNET_SAVE_SYNC": "1"})}
    times = {name: [] for name in variants}
    size = 0
    for _ in range(args.repeats):
        for name, (flags, env) in variants.items():
            times[name].append(_run_train(args, flags, env)["train_s"])
            if os.path.exists(path):
                # each run starts fresh: a run refuses to overwrite a checkpoint further along
                size = os.path.getsize(path)
                os.remove(path)
    saves = (args.steps - 1) // args.every
    base = statistics.median(times["no periodic save"])
    rows = []
    for name, values in times.items():
        train_s = statistics.median(values)
        per_save = (train_s - base) / saves * 1000 if saves and name != "no periodic save" else None
        rows.append((name, train_s, per_save))
    return rows, size


def lost_rank(args, tmp):
    """Part 2: one rank killed after the first checkpoint; what the launcher reports."""
    save = os.path.join(tmp, "elastic.h5")
    started = time.monotonic()
    whole = _run_train(args, [])
    uninterrupted_s = time.monotonic() - started
    cmd = [sys.executable, "-m", "ringnet.launch", "-n", str(args.np), "--max-restarts", "1",
           "--launcher", args.mpirun, *(["--shrink"] if args.shrink else []), "--",
           *_train_flags(args), "--save", save, "--save-every", str(args.every)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    try:
        kill_rank_after_first_checkpoint(proc, save, args.kill_rank, limit=args.timeout)
        _, err = proc.communicate(timeout=args.timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    elastic_s = time.monotonic() - started
    if proc.returncode != 0:
        tail = (err.strip().splitlines() or ["(no output)"])[-1]
        raise UsageError(f"the launched run failed (exit {proc.returncode}): {tail}")
    lost = re.search(r"failed at step (\d+).*?(\d+) step\(s\) lost; relaunch 1 of 1 on (\d+) "
                     r"rank\(s\) from checkpoint \S+ \(step (\d+)\)", err)
    again = re.search(r"training again on \d+ rank\(s\) ([\d.]+) s after the failure", err)
    if not lost or not again:
        raise UsageError(f"unexpected launcher output:\n{err}")
    return {"failed_at": int(lost.group(1)), "lost": int(lost.group(2)),
            "ranks": int(lost.group(3)), "resumed_from": int(lost.group(4)),
            "relaunch_s": float(again.group(1)), "elastic_s": elastic_s,
            "uninterrupted_s": uninterrupted_s, "uninterrupted_train_s": whole["train_s"]}


def main(argv=None):
    args = build_parser().parse_args(argv)
    if shutil.which(args.mpirun) is None:
        raise UsageError(f"launcher {args.mpirun!r} not found; `pip install mpich` or pass --mpirun")
    if args.np < 2 or args.batch_size < args.np or args.batch_size % args.np:
        raise UsageError(f"--np must be >= 2 and divide --batch-size {args.batch_size}, "
                         f"got --np {args.np}")
    if not 0 < args.lr < float("inf"):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    if not 0 < args.timeout < float("inf"):
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if not 0 <= args.kill_rank < args.np:
        raise UsageError(f"--kill-rank must be in [0, {args.np})")
    if args.every < 1 or args.steps <= 2 * args.every:
        raise UsageError("--steps must exceed twice --every (at least two periodic saves)")
    if args.repeats < 1:
        raise UsageError("--repeats must be >= 1")
    run = machine.begin(threads=1, per_rank=True)      # the ranks get one thread each
    with tempfile.TemporaryDirectory(prefix="ringnet-bench-elastic-") as tmp:
        rows, size = save_cost(args, tmp)
        failure = lost_rank(args, tmp)
    if args.markdown:
        print(markdown_tables(args, rows, size, failure))
        run.end()
        return 0
    print(f"# model {args.model}, {args.mode} on {args.np} ranks, global batch {args.batch_size}, "
          f"{args.steps} steps, --save-every {args.every} (checkpoint {size / 1e6:.2f} MB), "
          f"median of {args.repeats} interleaved rounds")
    print(f"{'periodic save':>32} {'train s':>9} {'ms per save':>12}")
    for name, train_s, per_save in rows:
        print(f"{name:>32} {train_s:>9.2f} {'-' if per_save is None else f'{per_save:.1f}':>12}")
    f = failure
    print(f"# rank {args.kill_rank} killed (SIGKILL) after the first checkpoint, "
          f"{_launch_text(args)}")
    print(f"failed at step {f['failed_at']}, resumed from step {f['resumed_from']} on {f['ranks']} "
          f"ranks: {f['lost']} steps lost; training again {f['relaunch_s']:.1f} s after the "
          f"failure; whole run {f['elastic_s']:.1f} s against {f['uninterrupted_s']:.1f} s "
          f"uninterrupted")
    run.end()
    return 0


def _launch_text(args):
    return f"python -m ringnet.launch -n {args.np}{' --shrink' if args.shrink else ''}"


# The rows of part 1 as the README words them (save_cost's names are the plain table's).
_SAVE_LABELS = {"no periodic save": "none",
                "rank 0 writes, others train on": "rank 0 writes in the background, all ranks train on",
                "rank 0 writes, others wait": "rank 0 writes, the other ranks wait"}


def markdown_tables(args, rows, size, failure):
    """Return what ``--markdown`` prints: the save-cost table, a line saying which rank was
    killed, and the table of what the relaunch cost."""
    save = markdown(
        [f"periodic save (every {args.every} steps)", "checkpoint", "training time", "cost per save"],
        [[_SAVE_LABELS[name], "–" if per_save is None else f"{size / 1e6:.2f} MB",
          f"{train_s:.2f} s", "–" if per_save is None else f"{per_save:.0f} ms"]
         for name, train_s, per_save in rows])
    f = failure
    lost = markdown(
        ["failed at step", "resumed from step", "on ranks", "steps lost",
         "training again after the failure", "whole run", "uninterrupted run"],
        [[f["failed_at"], f["resumed_from"], f["ranks"], f["lost"], f"{f['relaunch_s']:.1f} s",
          f"{f['elastic_s']:.1f} s", f"{f['uninterrupted_s']:.1f} s"]])
    return (f"{save}\n\nRank {args.kill_rank} killed (SIGKILL) after the first checkpoint; "
            f"`{_launch_text(args)}` relaunched the job:\n\n{lost}")
