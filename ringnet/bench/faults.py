"""python -m ringnet.bench faults — inject faults into training runs; print each case's time to exit.

Every case launches ``python -m ringnet.train`` (under mpirun for N > 1) with one fault:

* ``stop``: one rank sends itself SIGSTOP on entering a phase (``RINGNET_FAULT``):
  setup, step 3, evaluation, save (before the weights are gathered), save-write
  (rank 0 halfway through writing the file), statistics, shutdown. The others must
  end the job within the deadline, one line naming the stopped rank and the phase.
* ``kill``: the same with SIGKILL: the launcher ends the job at once.
* ``term``: one rank sends itself SIGTERM (what a time limit, ``scancel`` or a preemption
  sends) on entering a phase: every rank stops at a step boundary, the checkpoint is
  written and the job exits 75 (after the last step: the run ends as it would have, exit 0,
  the final checkpoint written); no error line.
* ``mpmd``: ranks started with different settings, data or environment knobs
  (``mpirun -np 1 A : -np 1 B``): exit 2 naming the field or variable and the ranks.
* ``bad``: bad files, flags and environment: exit 2, one line, no traceback.
* ``disk``: the disk fills while a periodic save writes (``RINGNET_FAULT=ENOSPC:...``):
  exit 2, one line, the previous checkpoint kept.
* ``replaced``: the data file is replaced under the running job (after its step 2): a run
  that reads from the file exits 2 at the next epoch, one line naming the file; a run that
  holds the data in memory trains on and says so once.
* ``launcher``: the launcher (``python -m ringnet.launch``) is killed with SIGKILL after
  step 2: no rank trains on unwatched; the ranks stop with the checkpoint written.
* ``signal``: SIGTERM or SIGUSR1 to mpirun or ``ringnet.launch`` at a moment of the first
  two seconds (once, or again after the stop's save): exit 75.
* outputs that would destroy an input (``--save`` on the data set, a FIFO, a device), and
  ranks that resumed different checkpoints: exit 2 before training, one line.
* ``concurrent``: a second job on the same ``--save`` is refused, naming the holder.
* ``srun`` (with ``--slurm``): ``ringnet.launch --launcher 'srun --mpi=pmi2'``, where srun
  reports the other tasks of a job one rank ended as killed: a divergence ends in 3, a
  missing data set or a corrupt chunk one rank reads in 2, a SIGTERM in 75, none
  relaunched; a rank killed is relaunched.

Each case checks the exit code, the message (exactly one ``ringnet: error:`` line, no
traceback), the time to exit against a bound, that no process of the run is left,
and that the checkpoint the run was asked to overwrite (``--save``) is still a valid
checkpoint with no temporary file beside it except one a killed writer left, which
the next save sweeps. Runs use ``RINGNET_COMM_TIMEOUT`` seconds (``--timeout``).
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import numpy as np

from ringnet.errors import EXIT_STOPPED, InputError, UsageError
from ringnet.outputs import file_kind
from ringnet.cli import ArgumentParser

from ringnet.bench import machine, options
from ringnet.bench.fault_cases import (DEFAULT_TIMEOUT, MODES, SRUN, STOP_PHASES, TRAIN,  # noqa: F401
                                       Case, Outcome, all_cases, quick_cases)

__all__ = ["Case", "Outcome", "all_cases", "quick_cases", "prepare", "run_case", "main",
           "MODES", "STOP_PHASES"]

# -- the files the cases read ----------------------------------------------------------
def _corrupt_chunk(path, name, row):
    """Overwrite the compressed bytes of the chunk of data set ``name`` that holds ``row``."""
    import h5py
    with h5py.File(path, "r") as f:
        images = f[name]
        info = images.id.get_chunk_info_by_coord((row - row % images.chunks[0],) + (0,) * (images.ndim - 1))
    with open(path, "r+b") as raw:
        raw.seek(info.byte_offset + 8)
        raw.write(b"\xff" * max(1, min(info.size - 16, 512)))


def _late_corruption(f, rows=4):
    """Rechunk /test/images by ``rows`` images and return the first row of the last chunk
    that the checks at open do not read (the data fingerprint samples a few images): the
    final evaluation is the first to read it, on the last rank."""
    from ringnet.data.catalog import FINGERPRINT_SAMPLES
    images = f["test/images"][()]
    del f["test/images"]
    f.create_dataset("test/images", data=images, chunks=(rows,) + images.shape[1:], compression="gzip")
    n = len(images)
    sampled = set(np.linspace(0, n - 1, min(n, FINGERPRINT_SAMPLES)).astype(np.int64) // rows)
    return max(c for c in range(n // rows) if c not in sampled) * rows


def prepare(folder, python=sys.executable):
    """Write the data sets and checkpoints the cases use into ``folder``; return it."""
    import h5py
    from ringnet.data import open_dataset
    from ringnet.data.hdf5 import write_dataset
    os.makedirs(folder, exist_ok=True)
    ds = open_dataset("digits")
    tr, te = ds.train, ds.test
    good = os.path.join(folder, "digits.h5")
    write_dataset(good, tr.images, tr.labels, te.images, te.labels, ds.classes, name="digits")
    scrambled = np.random.default_rng(1).permutation(tr.labels)
    write_dataset(os.path.join(folder, "scrambled.h5"), tr.images, scrambled, te.images,
                  te.labels, ds.classes, name="digits")

    def variant(name, edit):
        path = os.path.join(folder, name)
        shutil.copyfile(good, path)
        with h5py.File(path, "r+") as f:
            edit(f)

    def float_labels(value):
        def edit(f):
            labels = f["train/labels"][()].astype(np.float32)
            labels[5] = value
            del f["train/labels"]
            f["train/labels"] = labels
        return edit

    def group_labels(f):
        del f["train/labels"]
        f.create_group("train/labels")
    variant("nan_labels.h5", float_labels(np.nan))
    variant("fractional.h5", float_labels(1.5))
    variant("classes_int.h5", lambda f: f.attrs.__setitem__("classes", 7))
    variant("group.h5", group_labels)
    with open(os.path.join(folder, "not_hdf5.h5"), "w") as f:
        f.write("this is not an HDF5 file\n")
    with open(good, "rb") as src:
        data = src.read()
    with open(os.path.join(folder, "truncated.h5"), "wb") as f:
        f.write(data[:len(data) // 2])
    late = os.path.join(folder, "late_corrupt.h5")
    shutil.copyfile(good, late)
    with h5py.File(late, "r+") as f:
        row = _late_corruption(f)
    _corrupt_chunk(late, "test/images", row)
    shutil.copyfile(good, os.path.join(folder, "corrupt_chunk.h5"))
    _corrupt_chunk(os.path.join(folder, "corrupt_chunk.h5"), "train/images", 0)
    ck = os.path.join(folder, "ck.h5")
    subprocess.run([python, *TRAIN[:2], "--steps", "2", "--quiet", "--no-progress", "--save", ck],
                   check=True, env=_env(), capture_output=True)
    with h5py.File(ck, "r+") as f:
        # at step 0 the runs may overwrite it: a fresh run refuses to overwrite a checkpoint
        # further along than its start (and the cases are about surviving faults, not that)
        f.attrs["step"], f.attrs["epoch"] = 0, 0
    for name, edit in (("ck_other.h5", "content"), ("ck_step3.h5", "step")):
        other = os.path.join(folder, name)
        shutil.copyfile(ck, other)
        with h5py.File(other, "r+") as f:
            if edit == "step":
                f.attrs["step"] = 3
            else:
                first = sorted(f["params"])[0]
                f["params"][first][...] = f["params"][first][()] + np.float32(1e-3)
    os.mkfifo(os.path.join(folder, "fifo"))
    if hasattr(os, "geteuid") and os.geteuid() == 0:      # a character device (/dev/null's)
        os.mknod(os.path.join(folder, "nul"), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    nan = os.path.join(folder, "ck_nan.h5")
    shutil.copyfile(ck, nan)
    with h5py.File(nan, "r+") as f:
        first = sorted(f["params"])[0]
        values = f["params"][first][()]
        values.flat[0] = np.nan
        f["params"][first][...] = values
    return folder


# -- running one case ------------------------------------------------------------------
def _env(extra=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "MPI_", "HYDRA_", "OMPI_"))}
    env.update(OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RINGNET_FAULT", None)
    env.update(extra or {})
    return env


def _digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _processes_under(marker):
    """Return pids whose command line mentions ``marker`` (this run's private folder)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


def _command(case, files, save, python, mpirun):
    run = os.path.dirname(save)

    def fill(args):
        return [a.replace("{dir}", files).replace("{run}", run) for a in args]
    base = list(case.command) if case.command else list(TRAIN)
    train_extra = [] if case.command else ["--save", save]
    if case.per_rank:
        cmd = [mpirun]
        for i, extra in enumerate(case.per_rank):
            mode = ["--mode", case.mode] if case.mode else []
            env = [a for name, value in (case.per_rank_env or ({},) * len(case.per_rank))[i].items()
                   for a in ("-env", name, value)]
            cmd += (([":"] if i else []) + ["-np", "1"] + env + [python] + base + mode
                    + train_extra + fill(case.args) + fill(extra))
        return cmd
    mode = ["--mode", case.mode] if case.mode else []
    argv = [python] + base + (mode if not case.command else []) + train_extra + fill(case.args)
    if case.via == "srun":          # ringnet.launch starting the ranks with srun
        return [python, "-m", "ringnet.launch", "-n", str(case.ranks), "--launcher", SRUN,
                "--max-restarts", "1", "--"] + argv[3:]
    if case.trigger == "kill-launcher" or case.via == "launch":     # the launcher that watches the ranks
        return [python, "-m", "ringnet.launch", "-n", str(case.ranks), "--"] + argv[3:]
    return argv if case.ranks == 1 else [mpirun, "-np", str(case.ranks)] + argv


def _when_step(heartbeat, step, proc, limit_s, log):
    """Wait until rank 0's heartbeat reaches ``step`` (or the run ended); return whether it did.
    Under ``ringnet.launch``, which keeps the heartbeat of its own, until the run's first line
    is out and a moment more."""
    from ringnet.autosave import read_heartbeat
    end = time.monotonic() + limit_s
    while time.monotonic() < end and proc.poll() is None:
        if (read_heartbeat(heartbeat) or 0) >= step:
            return True
        with open(log.name) as seen:
            if any(line.startswith("ringnet: ") for line in seen):
                if "ringnet.launch" in proc.args:
                    time.sleep(1.0)
                    return True
        time.sleep(0.05)
    return False


def _signal(case, proc, log, again=False):
    """Send ``case.signal`` to the launcher; ``again``: once more after the stop's save (the
    line that says the run stopped is out). Return the problems."""
    proc.send_signal(getattr(signal, "SIG" + case.signal))
    if not again:
        return []
    end = time.monotonic() + 60
    while time.monotonic() < end and proc.poll() is None:
        with open(log.name) as seen:
            if any(line.startswith("stopped by SIG") for line in seen):
                proc.send_signal(getattr(signal, "SIG" + case.signal))
                return []
        time.sleep(0.005)
    return ["the run ended before its 'stopped by' line: the second signal was not sent"]


def _second_job(case, proc, run_dir, files, cmd, env):
    """Start ``cmd`` again beside the running job (same --save), then stop the first with
    SIGTERM; return the second's problems: it must end at once with exit 2 and one error
    line matching ``case.message``."""
    try:
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                env=dict(env, RINGNET_HEARTBEAT=os.path.join(run_dir, "heartbeat2")))
    except subprocess.TimeoutExpired:
        return ["the second job still ran after 120 s"]
    finally:
        proc.send_signal(signal.SIGTERM)
    out = second.stdout + second.stderr
    errors = [line for line in out.splitlines() if "ringnet: error:" in line]
    problems = []
    if second.returncode != 2:
        problems.append(f"second job: exit code {second.returncode}, expected 2")
    if len(errors) != 1 or not re.search(case.message, errors[0]):
        problems.append(f"second job: error lines {errors!r} do not match {case.message!r}")
    return problems


def _replace_data(case, proc, run_dir, files, cmd, env):
    """Replace the run's data file by another one (other labels) at the same path."""
    live = os.path.join(run_dir, "live.h5")
    fresh = live + ".new"
    shutil.copyfile(os.path.join(files, "scrambled.h5"), fresh)
    os.replace(fresh, live)
    return []


def _kill_launcher(case, proc, run_dir, files, cmd, env):
    proc.kill()
    return []


def _terminate(case, proc, run_dir, files, cmd, env):
    """SIGTERM to the launcher, as scancel or a shell's kill would send it."""
    proc.send_signal(signal.SIGTERM)
    return []


# what the harness does once step 2 is reached; each returns its problems
TRIGGERS = {"replace-data": _replace_data, "kill-launcher": _kill_launcher,
            "second-job": _second_job, "terminate": _terminate}


def run_case(case, files, timeout=DEFAULT_TIMEOUT, python=sys.executable, mpirun="mpirun"):
    """Run ``case`` with the files of :func:`prepare`; return an Outcome (``ok`` or its problems)."""
    from ringnet.checkpoint import TMP_SUFFIX, load_checkpoint, stale_temporaries
    run_dir = tempfile.mkdtemp(prefix="fault-", dir=files)
    save = os.path.join(run_dir, "ck.h5")
    shutil.copyfile(os.path.join(files, "ck.h5"), save)
    before = _digest(save)
    env = _env({"RINGNET_COMM_TIMEOUT": f"{timeout:g}", **(case.env or {})})
    if case.fault:
        env["RINGNET_FAULT"] = case.fault
    # deadline cases: the deadline, the stall check (half of it) and the setup agreement
    startup = 30.0 * max(1, case.ranks) / 2
    bound = startup + (2.5 * timeout if case.bound == "deadline" else 0.0)
    cmd = _command(case, files, save, python, mpirun)
    if case.trigger == "kill-launcher":     # a launcher killed cannot remove its own folder
        env["TMPDIR"] = run_dir
    live = os.path.join(run_dir, "live.h5")         # a data set the run may name ({run}/live.h5)
    shutil.copyfile(os.path.join(files, "digits.h5"), live)
    live_before = _digest(live)
    specials = {name: os.stat(os.path.join(files, name)).st_mode for name in ("fifo", "nul")
                if os.path.exists(os.path.join(files, name))}
    if case.trigger:
        env["RINGNET_HEARTBEAT"] = os.path.join(run_dir, "heartbeat")
    start = time.monotonic()
    problems = []
    with tempfile.NamedTemporaryFile("w+", dir=run_dir, suffix=".log") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        if case.at is not None:                 # a moment after the launch, step or not
            time.sleep(max(0.0, start + case.at - time.monotonic()))
            if proc.poll() is None:
                problems += _signal(case, proc, log, again=case.trigger == "signal-twice")
            else:
                problems.append(f"the run ended before {case.at:.2f} s")
        elif case.trigger:
            if not _when_step(env["RINGNET_HEARTBEAT"], 2, proc, bound, log):
                problems.append("the run never reached step 2")
            else:
                problems += TRIGGERS[case.trigger](case, proc, run_dir, files, cmd, env)
        try:
            code = proc.wait(timeout=bound + 60)
        except subprocess.TimeoutExpired:
            code = None
            problems.append(f"still running after {bound + 60:.0f} s (hang)")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        output = log.read()
    if case.trigger == "kill-launcher":     # what ends the job is the ranks' own stop
        left = _processes_under(run_dir)
        end = time.monotonic() + bound
        while left and time.monotonic() < end:
            time.sleep(0.2)
            left = _processes_under(run_dir)
    seconds = time.monotonic() - start
    if seconds > bound:
        problems.append(f"took {seconds:.1f} s, bound {bound:.0f} s")
    if case.code is not None and code != case.code:
        problems.append(f"exit code {code}, expected {case.code}")
    if case.code is None and not code:
        problems.append(f"exit code {code}, expected non-zero")
    errors = [line for line in output.splitlines() if "ringnet: error:" in line]
    if case.message is not None and case.kind != "concurrent":    # (its second job's message)
        if len(errors) != 1:
            problems.append(f"{len(errors)} 'ringnet: error:' lines, expected 1")
        if not any(re.search(case.message, line) for line in errors):
            problems.append(f"no error line matches {case.message!r}")
        if "Traceback" in output:
            problems.append("a traceback was printed")
    if case.launcher_message is not None and not re.search(case.launcher_message, output):
        problems.append(f"output does not match {case.launcher_message!r}")
    stops = case.kind in ("term", "signal", "concurrent") or (
        case.kind == "srun" and case.code == EXIT_STOPPED)
    if stops and (errors or "Traceback" in output):
        problems.append(f"{len(errors)} 'ringnet: error:' lines, expected none")
    if case.forbid is not None and re.search(case.forbid, output):
        problems.append(f"output matches {case.forbid!r}")
    left = []
    for _ in range(50):
        left = _processes_under(run_dir)
        if not left:
            break
        time.sleep(0.1)
    if left:
        problems.append(f"processes left: {left}")
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    try:
        step = int(load_checkpoint(save)[3].get("step", 0))
    except InputError as exc:
        step = None
        problems.append(f"checkpoint damaged: {exc}")
    endless = "1000000" in case.args        # --steps 1000000: ended by the harness
    if (stops or case.kind == "launcher") and step is not None:
        steps = int(TRAIN[TRAIN.index("--steps") + 1])
        stopped = code == EXIT_STOPPED or case.kind == "launcher"
        untouched = case.kind == "signal" and step == 0 and _digest(save) == before
        if stopped and not 0 < step < (1000000 if endless else steps) and not untouched:
            problems.append(f"checkpoint at step {step}: not where the run stopped")
        if not stopped and step != steps:
            problems.append(f"checkpoint at step {step}, expected the last step {steps}")
    elif case.kind == "srun" and case.code != 2:
        # diverged, or relaunched after a rank was killed: the checkpoints it saved before
        # are whole and finite (the diverged step's weights are never written)
        if step is not None and not all(np.isfinite(v).all() for v in load_checkpoint(save)[0].values()):
            problems.append(f"checkpoint at step {step} holds non-finite weights")
    elif code != 0 and os.path.exists(save) and _digest(save) != before and case.kind != "stop":
        problems.append("checkpoint changed by a failed run")
    if case.trigger != "replace-data" and _digest(live) != live_before:
        problems.append(f"data set {live} changed by the run")
    for name, mode in specials.items():
        now = os.lstat(os.path.join(files, name)).st_mode
        if stat.S_IFMT(now) != stat.S_IFMT(mode):
            problems.append(f"{name} is no longer {file_kind(mode)}")
    temporaries = sorted(os.path.join(run_dir, n) for n in os.listdir(run_dir) if n.endswith(TMP_SUFFIX))
    for _ in range(100):    # a killed writer may take a moment to be reaped by its launcher
        stale = stale_temporaries(save)
        if stale == temporaries:
            break
        time.sleep(0.1)
    if case.fault and case.fault.startswith("KILL:save-write"):
        if temporaries != stale or len(temporaries) > 1:
            problems.append(f"temporaries {temporaries} not all recognised as stale {stale}")
    elif temporaries and not (case.kind == "stop" and "save-write" in case.fault and temporaries == stale):
        problems.append(f"temporary files left: {temporaries}")
    if not problems:
        shutil.rmtree(run_dir, ignore_errors=True)
    return Outcome(case, code, seconds, bound, problems, output)


# -- the README's summary table ----------------------------------------------------------
GROUPS = (
    ("SIGSTOP in setup", lambda c: c.kind == "stop" and _phase(c) == "setup"),
    ("SIGSTOP at step 3: deadline + stall check", lambda c: c.kind == "stop" and _phase(c).startswith("step")),
    ("SIGSTOP in evaluation, statistics or shutdown",
     lambda c: c.kind == "stop" and _phase(c) in ("evaluation", "statistics", "shutdown")),
    ("SIGSTOP in the save, before or while rank 0 writes",
     lambda c: c.kind == "stop" and _phase(c).startswith("save")),
    ("SIGKILL in any phase: the launcher ends the job", lambda c: c.kind == "kill"),
    ("SIGTERM in any phase: stop at a step boundary, checkpoint saved", lambda c: c.kind == "term"),
    ("MPMD mismatch, bad file, flag or environment: exit 2", lambda c: c.kind in ("mpmd", "bad")),
    ("Disk full, data file replaced, launcher killed",
     lambda c: c.kind in ("disk", "replaced", "launcher")),
    ("SIGTERM/SIGUSR1 to the launcher in the first 2 s, once or twice: exit 75",
     lambda c: c.kind == "signal"),
    ("A second job on the same --save: refused, the first stops gracefully",
     lambda c: c.kind == "concurrent"),
    ("Under srun: each rank's reason reaches the launcher, only a lost rank relaunched",
     lambda c: c.kind == "srun"),
)


def _phase(case):
    return case.fault.split(":")[1] if case.fault else ""


def markdown_table(outcomes):
    """Return the README's table: per group of cases, (count) and min / median / max time to exit."""
    from ringnet.tables import markdown
    rows = []
    for label, member in GROUPS:
        seconds = sorted(o.seconds for o in outcomes if member(o.case))
        if seconds:
            mid = float(np.median(seconds))
            rows.append([f"{label} ({len(seconds)})",
                         f"{seconds[0]:.1f} / {mid:.1f} / {seconds[-1]:.1f}"])
    return markdown(["fault", "time to exit, min / median / max (s)"], rows)


# -- command line ----------------------------------------------------------------------
def _check_slurm():
    """Raise UsageError unless srun is here and its SLURM controller answers."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        raise UsageError("--slurm: srun and sinfo not found (SLURM's client commands)")
    try:
        probe = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                               timeout=20)
    except subprocess.TimeoutExpired:
        probe = None
    states = probe.stdout.split() if probe is not None and probe.returncode == 0 else []
    if not any(s.rstrip("*") in ("idle", "mixed", "allocated") for s in states):
        why = (probe.stderr.strip().splitlines() or ["no node up"])[-1] if probe else "no answer in 20 s"
        raise UsageError(f"--slurm: no SLURM node answers ({why}); start one with "
                         "hpc/cluster.sh start and eval \"$(hpc/cluster.sh env)\"")


def build_parser():
    p = ArgumentParser(prog="python -m ringnet.bench faults", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="only the CI subset")
    p.add_argument("--slurm", action="store_true",
                   help="also the cases under srun (ringnet.launch --launcher 'srun --mpi=pmi2'); "
                        "needs a SLURM that srun reaches, e.g. hpc/cluster.sh's "
                        "(eval \"$(hpc/cluster.sh env)\")")
    p.add_argument("--filter", default=None, metavar="TEXT", help="only cases whose name contains TEXT")
    options.add_timeout(p, DEFAULT_TIMEOUT, "RINGNET_COMM_TIMEOUT of the runs, seconds")
    options.add_mpirun(p)
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    options.add_json(p, "print one JSON line per case")
    options.add_markdown(p, "after the cases, print the summary table (time to exit per group)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")
    cases = quick_cases(args.slurm) if args.quick else all_cases(args.slurm)
    if args.filter:
        cases = [c for c in cases if args.filter in c.name]
    if not cases:
        raise UsageError(f"no case matches {args.filter!r} (see --list)")
    if args.list:
        for case in cases:
            print(case.name)
        return 0
    if shutil.which(args.mpirun) is None:
        raise UsageError(f"{args.mpirun} not found: the fault cases need an MPI launcher")
    if args.slurm:
        _check_slurm()
    run = machine.begin(out=sys.stderr if args.json else None)
    files = tempfile.mkdtemp(prefix="ringnet-faults-")
    failed = 0
    outcomes = []
    try:
        prepare(files)
        if not args.json:
            print(f"{'case':44s} {'exit':>5s} {'time to exit':>13s} {'bound':>6s}  result")
        for case in cases:
            out = run_case(case, files, timeout=args.timeout, mpirun=args.mpirun)
            outcomes.append(out)
            failed += not out.ok
            if args.json:
                print(json.dumps({"case": case.name, "kind": case.kind, "ranks": case.ranks,
                                  "mode": case.mode, "exit": out.code, "seconds": round(out.seconds, 2),
                                  "bound_s": out.bound_s, "ok": out.ok, "problems": out.problems}),
                      flush=True)
            else:
                result = "ok" if out.ok else "FAIL: " + "; ".join(out.problems)
                print(f"{case.name:44s} {str(out.code):>5s} {out.seconds:11.1f} s {out.bound_s:5.0f}s  "
                      f"{result}", flush=True)
        if not args.json:
            print(f"{len(cases) - failed} of {len(cases)} cases passed "
                  f"(RINGNET_COMM_TIMEOUT={args.timeout:g})")
        if args.markdown:
            print(markdown_table(outcomes))
        # correctness, not speed: a busy machine withholds no case's result, but says so
        run.end(out=sys.stderr if args.json else None)
    finally:
        if not args.keep:
            shutil.rmtree(files, ignore_errors=True)
        else:
            print(f"work folder kept: {files}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    from ringnet.cli import run_main
    run_main(main)
