"""Training runs started as child jobs under a launcher, their summaries read back: what the
benchmarks time (``bench scaling`` and the benchmarks built on it) and what the performance
model's validation measures.

* :func:`run_json`: run a command, return the last JSON object it printed.
* :func:`train_run`: one ``python -m ringnet.train ... --json`` job of a mode and delay on
  N ranks (or a :class:`~ringnet.cluster.Shape` of nodes), one BLAS thread a rank.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

from ringnet import cluster
from ringnet import start_watch
from ringnet.errors import UsageError
from ringnet.parallel import MODES

__all__ = ["run_json", "failure_reason", "train_run", "recipe_flags", "job_env", "job_launch"]


def run_json(cmd, what, env=None, timeout=None):
    """Run ``cmd`` and return the last JSON object it printed on stdout.

    A timeout or a failed run raises one-line UsageErrors naming ``what``; ringnet's own
    error line (a NaN loss, bad input) is preferred to MPI's abort line as the reason. A
    run whose MPI start-up never ended (:mod:`ringnet.start_watch`: the launcher's process
    manager stopped answering, before any of the run's work) is run once more.
    """
    for attempt in (1, 2):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise UsageError(f"{what} ({' '.join(map(str, cmd))}) did not finish within "
                             f"{timeout:.0f} s") from None
        if attempt == 1 and proc.returncode != 0 and start_watch.STALLED in proc.stderr:
            print(f"{what}: MPI start-up stalled, starting it again", file=sys.stderr)
            continue
        break
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        kept = tempfile.NamedTemporaryFile("w", prefix="ringnet-failed-run-", suffix=".log",
                                           delete=False)
        with kept:
            kept.write(f"$ {' '.join(map(str, cmd))}\n# exit {proc.returncode}\n# stdout\n"
                       f"{proc.stdout}\n# stderr\n{proc.stderr}")
        raise UsageError(f"{what} failed (exit {proc.returncode}): {failure_reason(proc.stderr)} "
                         f"(its output: {kept.name})")
    return json.loads(lines[-1])


def failure_reason(stderr):
    """The line of a failed run's stderr that says why: ringnet's own error line, else the
    last line of a Python traceback (the exception), else the last line."""
    errors = stderr.strip().splitlines() or ["(no output)"]
    for line in errors:
        if line.startswith("ringnet: error:") or re.match(r"\[rank \d+\] ringnet: error:", line):
            return line
    raised = [line for line in errors
              if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)\b", line)]
    return raised[-1] if raised else errors[-1]


def job_env():
    """The environment a job's ranks run in: one BLAS thread (and OpenMP thread) a rank."""
    return dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")


def job_launch(args, nranks):
    """The launcher's command line for ``nranks`` (an int or a Shape): ``args.launcher``,
    or ``args.mpirun`` where it has none."""
    return cluster.launch_prefix(getattr(args, "launcher", None) or args.mpirun, nranks)


def recipe_flags(args):
    """The training flags ringnet's runs and the peer's share: --lr (None: the model's
    default of python -m ringnet.train), --seed, --data-dir, where given."""
    flags = ["--lr", str(args.lr)] if args.lr is not None else []
    for flag in ("seed", "data_dir"):
        if getattr(args, flag, None) is not None:
            flags += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return flags


def train_run(args, mode, delay, nranks, length=None, extra=(), batch=None):
    """Run one training job under the launcher; return its --json summary dict.

    ``args``: the model, data set, batch, steps, transport, device, launcher, timeout and
    recipe (``python -m ringnet.bench scaling``'s options). ``length``: the train arguments
    that say how long to run (default ``--steps S``: a timing run, where delay 1 runs
    without the lookahead compensation's synchronous warm-up, ``--warmup-steps 0``, so that
    its steps are the delayed ones; the warm-up is a one-off, timed by ``bench delay
    --speed``); ``extra``: further train arguments; ``batch``: the global batch, if not
    ``--batch-size``.
    """
    timing = length is None
    if length is None:
        length = ["--steps", str(args.steps)]
    env = job_env()
    launch = job_launch(args, nranks)
    cmd = [*launch, sys.executable, "-m", "ringnet.train",
           "--model", args.model, "--dataset", args.dataset, "--mode", mode,
           "--batch-size", str(batch or args.batch_size), *length,
           "--transport", args.transport, "--device", args.device,
           "--json", "--quiet", "--no-progress", "--no-eval", *recipe_flags(args)]
    if MODES[mode].distributed:
        cmd += ["--delay", str(delay)]
        if delay and getattr(args, "delay_compensation", None):
            cmd += ["--delay-compensation", args.delay_compensation]
        if delay and timing:
            cmd += ["--warmup-steps", "0"]
    cmd += list(extra)
    links = cluster.LinkCounters() if isinstance(nranks, cluster.Shape) else None
    before = links.read() if links else None
    result = run_json(cmd, f"{mode} delay {delay} at N={cluster.nodes_text(nranks)}", env=env,
                      timeout=args.timeout)
    after = links.read() if links else None
    if before is not None and after is not None:
        result["link_bytes"] = after - before
    return result
