"""ringnet under a real SLURM: the hpc/*.sbatch scripts, srun, mpirun inside an allocation.

The cluster is the single node that ``hpc/cluster.sh start`` brings up (CI does that);
without it the tests that need SLURM are skipped. The reference for every multi-rank
run is the same run under plain ``mpirun`` outside SLURM: identical loss.
"""
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest

from ringnet.bench.fault_cases import srun_cases
from ringnet.errors import EXIT_USAGE, UsageError
from ringnet.placement import check_world_size

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "hpc", "cluster.sh")
TRAIN = ["python", "-m", "ringnet.train", "--steps", "4", "--no-eval", "--json", "--seed", "3"]
# The hpc scripts' rank count (their --ntasks-per-node on one node).
SCRIPT_RANKS = 4


def _slurm_env():
    """Return the environment for SLURM commands, or None when no test cluster runs."""
    try:
        status = subprocess.run(["bash", CLUSTER, "status"], capture_output=True, text=True,
                                timeout=60)
        conf = subprocess.run(["bash", CLUSTER, "env"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    if status.returncode != 0 or "idle" not in status.stdout and "mix" not in status.stdout:
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "HYDRA_"))}
    for line in conf.splitlines():      # export A=B [C=D ...]: one node prints SLURM_CONF only
        if line.startswith("export "):
            env.update(pair.split("=", 1) for pair in line.split()[1:] if "=" in pair)
    env.update(OMP_NUM_THREADS="1",
               RINGNET_BLAS_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    # The jobs' `python` is this interpreter.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


SLURM_ENV = _slurm_env()
needs_slurm = pytest.mark.skipif(SLURM_ENV is None,
                                 reason="no SLURM test cluster (start one: hpc/cluster.sh start)")


def run(cmd, timeout=300, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, env=SLURM_ENV, timeout=timeout,
                          **kwargs)


def summary_of(text):
    lines = [l for l in text.splitlines() if l.startswith("{")]
    assert lines, text[-3000:]
    return json.loads(lines[-1])


def _mpirun_reference(ranks):
    env = {k: v for k, v in (SLURM_ENV or os.environ).items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["mpirun", "-np", str(ranks), sys.executable, *TRAIN[1:]],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return summary_of(proc.stdout)


@pytest.fixture(scope="module")
def reference():
    """The same 2-rank run under plain mpirun, outside SLURM."""
    return _mpirun_reference(2)


@pytest.fixture(scope="module")
def script_reference():
    """The same run on the sbatch scripts' rank count under plain mpirun, outside SLURM."""
    return _mpirun_reference(SCRIPT_RANKS)


def _directive(script, option):
    """Return the value of ``#SBATCH --OPTION=VALUE`` in hpc/SCRIPT."""
    with open(os.path.join(ROOT, "hpc", script)) as f:
        return re.search(rf"^#SBATCH --{option}=(\S+)", f.read(), re.M).group(1)


def sbatch(script, tmp_path, *args, options=()):
    """Submit ``script`` as its header documents it, ``sbatch [options] hpc/SCRIPT [flags]``
    from ``tmp_path``, plus ``--wait`` only (it changes nothing in the job, it makes sbatch
    return when the job ends); return (exit code, job output, job id)."""
    cmd = ["sbatch", "--wait", *options, os.path.join("hpc", script), *args]
    os.symlink(os.path.join(ROOT, "hpc"), tmp_path / "hpc")
    try:
        proc = run(cmd, timeout=400, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", _directive(script, "job-name")], env=SLURM_ENV)
        raise
    match = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert match, (proc.stdout, proc.stderr)
    job = match.group(1)
    # The log is where the script's --output line puts it: the submit folder.
    with open(tmp_path / _directive(script, "output").replace("%j", job)) as f:
        return proc.returncode, f.read(), job


@needs_slurm
def test_cluster_start_is_idempotent():
    proc = run(["bash", CLUSTER, "start"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "already running" in proc.stdout


@needs_slurm
def test_train_sbatch(tmp_path, script_reference):
    # --json with the log in a file of its own (docs/clusters.md, "Batch logs and PMI"):
    # srun forwards stdout and stderr in pieces of at most 1 KiB, in no fixed order between
    # the two, so in one shared file a log line can land inside the JSON line.
    rc, out, job = sbatch("train.sbatch", tmp_path, *TRAIN[3:], "--json-file", "summary.json",
                          options=["--error=log-%j.err"])
    log = (tmp_path / f"log-{job}.err").read_text()
    assert rc == 0, log[-3000:]
    assert re.search(rf"ring \(delay 1[^)]*\) on {SCRIPT_RANKS} rank\(s\)", log), log
    assert re.search(r"^step 4/4  epoch 0\.18  loss \d", log, re.M), log  # progress without a tty
    summary = summary_of(out)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary   # --json-file
    assert summary["ranks"] == SCRIPT_RANKS and summary["steps"] == 4
    assert summary["train_loss"] == pytest.approx(script_reference["train_loss"], rel=1e-6)


@needs_slurm
def test_train_sbatch_bad_flag_fails_the_job(tmp_path):
    rc, out, _ = sbatch("train.sbatch", tmp_path, "--model", "nosuch")
    assert rc != 0
    errors = [l for l in out.splitlines() if l.startswith("ringnet: error:")]
    assert len(errors) == 1 and "unknown model 'nosuch'" in errors[0], out
    assert "Traceback" not in out


@needs_slurm
def test_scaling_sbatch(tmp_path):
    rc, out, job = sbatch("scaling.sbatch", tmp_path, "--np", "1", "2", "--modes", "ring",
                          "--delays", "1", "--model", "digits", "--dataset", "digits",
                          "--steps", "3", "--repeats", "1")
    assert rc == 0, out[-3000:]
    rows = [l.split() for l in out.splitlines() if re.match(r"\s*(single|ring)\s+\d", l)]
    assert [(r[0], r[2]) for r in rows] == [("single", "1"), ("ring", "2")], out
    with open(tmp_path / f"scaling-{job}.csv") as f:
        lines = f.read().splitlines()
    assert lines[0].startswith("mode,delay,np,") and len(lines) == 3


@needs_slurm
@pytest.mark.parametrize("script", ["train.sbatch", "scaling.sbatch"])
def test_gpu_lines_take_effect_once_uncommented(script, tmp_path):
    """The two lines marked "change this" are what a GPU partition needs: as written SLURM
    skips them ("##SBATCH"); with one "#" removed it reads them, and this node, which has
    no GPUs and no `gpu` partition, refuses each as it would refuse the same sbatch option."""
    with open(os.path.join(ROOT, "hpc", script)) as f:
        text = f.read()
    marked = [l for l in text.splitlines() if l.startswith("##SBATCH")]
    assert [l.split()[1].split("=")[0] for l in marked] == ["--gpus-per-node", "--partition"]
    assert all("# change this:" in l for l in marked), marked

    def test_only(body):
        path = tmp_path / script
        path.write_text(body)
        return run(["sbatch", "--test-only", str(path)], cwd=tmp_path, timeout=60)

    proc = test_only(text)
    assert proc.returncode == 0, proc.stderr
    proc = test_only(text.replace("##SBATCH --partition", "#SBATCH --partition"))
    assert proc.returncode != 0 and "invalid partition specified: gpu" in proc.stderr, proc.stderr
    proc = test_only(text.replace("##SBATCH --gpus-per-node", "#SBATCH --gpus-per-node"))
    assert proc.returncode != 0 and "Invalid generic resource" in proc.stderr, proc.stderr


@needs_slurm
def test_srun_two_ranks_equal_mpirun(reference):
    proc = run(["srun", "-n", "2", "--time=10", *TRAIN])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(proc.stdout)
    assert summary["ranks"] == 2
    assert summary["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-6)


@needs_slurm
def test_srun_without_pmi_is_one_clear_error():
    # --mpi=none: each task starts as its own one-rank MPI job.
    proc = run(["srun", "--mpi=none", "-n", "2", "--time=10", *TRAIN])
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr)
    errors = [l for l in proc.stderr.splitlines() if l.startswith("ringnet:")]
    assert len(errors) == 1, proc.stderr
    assert "srun started 2 tasks but MPI sees a world of 1 rank" in errors[0]
    assert "Traceback" not in proc.stderr and not proc.stdout.strip()
    others = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("ringnet:")]
    assert all(l.startswith("srun:") for l in others), proc.stderr


@needs_slurm
def test_mpirun_inside_an_allocation(reference):
    proc = run(["salloc", "-n", "2", "--time=10", "mpirun", "-np", "2", *TRAIN])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(proc.stdout)
    assert summary["ranks"] == 2
    assert summary["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-6)


def test_sbatch_script_refuses_to_run_outside_a_job():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for script in ("train.sbatch", "scaling.sbatch"):
        proc = subprocess.run(["bash", os.path.join(ROOT, "hpc", script)], capture_output=True,
                              text=True, env=env, timeout=60)
        assert proc.returncode == 2 and "must run inside a SLURM job" in proc.stderr


def test_world_size_check():
    step = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}
    with pytest.raises(UsageError, match="srun started 2 tasks"):
        check_world_size(1, step)
    with pytest.raises(SystemExit) as info:       # task 1 exits quietly: one line per job
        check_world_size(1, dict(step, SLURM_PROCID="1"))
    assert info.value.code == EXIT_USAGE
    check_world_size(2, step)                            # srun with PMI: a world of 2
    check_world_size(1, {"SLURM_STEP_NUM_TASKS": "1"})   # one task
    check_world_size(1, {"SLURM_NTASKS": "4"})           # python in a batch script, no srun
    check_world_size(1, {})


# Progress in a job log: no terminal, so plain lines instead of a bar.

def test_progress_lines_with_a_clock():
    from ringnet.progress import Progress
    now = [0.0]
    out = io.StringIO()
    p = Progress(total=20, initial=0, batch_size=8, steps_per_epoch=7, interactive=False,
                 interval=10, file=out, clock=lambda: now[0])
    for step in range(1, 21):
        now[0] += 3.0                          # 3 s per step
        p.update(step, loss=float(step))
    lines = out.getvalue().splitlines()
    # at each epoch end (7, 14), at the last step, and when 10 s passed since the last line
    steps = [int(l.split()[1].split("/")[0]) for l in lines]
    assert steps == [4, 7, 11, 14, 18, 20], lines
    assert lines[0] == ("step 4/20  epoch 0.57  loss 2.5000 (mean of last 4 steps)  3 images/s  "
                        "ETA 0:00:48")
    # step 7: losses 5..7, 3 steps * 8 images / 9 s; 3 s/step * 13 steps left
    assert lines[1] == ("step 7/20  epoch 1.00  loss 6.0000 (mean of last 3 steps)  3 images/s  "
                        "ETA 0:00:39")
    assert lines[-1].endswith("ETA 0:00:00")


def _train_without_terminal(*args, **env):
    # A new session has no controlling terminal, like a batch job.
    return subprocess.run([sys.executable, "-m", "ringnet.train", *args], capture_output=True,
                          text=True, timeout=300, start_new_session=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1",
                                   **env))


def test_progress_without_a_terminal_prints_a_line_per_epoch():
    proc = _train_without_terminal("--steps", "50", "--no-eval")    # 22 steps per epoch
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("step ")]
    assert [l.split()[1] for l in lines] == ["22/50", "44/50", "50/50"], proc.stderr
    assert [l.split()[3] for l in lines] == ["1.00", "2.00", "2.27"]
    assert all(re.search(r"loss \d+\.\d{4} \(mean of last \d+ steps\)  \d+ images/s  "
                         r"ETA \d:\d\d:\d\d$", l) for l in lines)
    assert "\r" not in proc.stderr                 # no bar redrawn into the log


def test_progress_interval_from_the_environment():
    proc = _train_without_terminal("--steps", "5", "--no-eval", RINGNET_PROGRESS_SECONDS="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len([l for l in proc.stderr.splitlines() if l.startswith("step ")]) == 5
    proc = _train_without_terminal("--steps", "5", RINGNET_PROGRESS_SECONDS="soon")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("ringnet: error: RINGNET_PROGRESS_SECONDS='soon' is not a "
                                   "number of seconds >= 0")


def _stepd_alive(job):
    """Whether a slurmstepd of ``job`` still runs on this machine. Its title "slurmstepd:
    [JOB.STEP]" is cut to the length of its command line, so a long job id shows only in
    part: a title that is the start of this job's counts (erring towards alive)."""
    title = f"slurmstepd: [{job}.".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                shown = f.read().split(b"\0")[0]
        except OSError:
            continue
        if shown.startswith(b"slurmstepd: [") and len(shown) > len(b"slurmstepd: [") and (
                shown.startswith(title) or title.startswith(shown)):
            return True
    return False


def _job_state(job):
    out = run(["scontrol", "show", "job", job], timeout=30).stdout
    state = re.search(r"JobState=(\S+)", out)
    restarts = re.search(r"Restarts=(\d+)", out)
    return (state.group(1) if state else None), int(restarts.group(1)) if restarts else 0


def _submit_train_sbatch(tmp_path, flags):
    """Submit hpc/train.sbatch with ``flags`` from ``tmp_path``; return (job id, its log)
    once the run has printed its header (and a second more)."""
    os.symlink(os.path.join(ROOT, "hpc"), tmp_path / "hpc")
    proc = run(["sbatch", "--parsable", os.path.join("hpc", "train.sbatch"), *flags],
               cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    log = tmp_path / _directive("train.sbatch", "output").replace("%j", job)
    end = time.monotonic() + 240
    while time.monotonic() < end and not (log.exists() and "ringnet: ring" in log.read_text()):
        time.sleep(0.2)
    time.sleep(1.0)
    return job, log


@needs_slurm
def test_scancel_stops_train_sbatch_for_good_with_the_checkpoint_written(tmp_path):
    """scancel JOB (SIGTERM): the ranks stop at a step boundary with the checkpoint written,
    the script says it does not requeue, and the job ends without a restart (it requeued
    itself on SIGTERM too, going back to pending)."""
    from ringnet.checkpoint import stored_step
    flags = ["--steps", "100000", "--no-eval", "--no-progress", "--save", "ck.h5",
             "--save-every", "100000"]
    job, log = _submit_train_sbatch(tmp_path, flags)
    try:
        assert run(["scancel", job], timeout=30).returncode == 0
        end = time.monotonic() + 120
        while time.monotonic() < end and "not requeueing" not in log.read_text():
            time.sleep(0.5)
        time.sleep(3.0)         # a requeue (the old behaviour) would show by now
        state, restarts = _job_state(job)
    finally:
        if _job_state(job)[0] not in ("COMPLETED", "FAILED", "CANCELLED", None):
            run(["scancel", "--signal=KILL", job], timeout=30)
    out = log.read_text()
    assert restarts == 0 and state != "PENDING", (state, restarts, out[-3000:])
    # the ranks name the signal that reached them first: scancel's SIGTERM from slurmstepd,
    # or the SIGUSR1 that the launcher passes its SIGTERM on to srun as (seen once in CI)
    stops = re.findall(r"^stopped by SIG(?:TERM|USR1) at step (\d+) of 100000", out, re.M)
    assert len(stops) == 1, out[-3000:]
    assert f"not requeueing job {job}" in out and "requeueing job" not in out.replace(
        "not requeueing job", ""), out[-3000:]
    assert stored_step(tmp_path / "ck.h5") == int(stops[0])


@needs_slurm
def test_a_signalled_train_sbatch_saves_requeues_and_ends_as_an_uninterrupted_run(tmp_path):
    """SLURM's --signal=B:USR1@120 (here sent at once with scancel --signal=USR1 --batch):
    the script passes it on, the ranks stop at a step boundary with the checkpoint written,
    the job requeues itself and its second run continues (--resume auto) to the weights
    of an uninterrupted mpirun run, bit for bit."""
    import numpy as np
    from ringnet.checkpoint import load_checkpoint
    flags = ["--steps", "600", "--no-eval", "--no-progress", "--save", "ck.h5",
             "--save-every", "100"]
    straight = tmp_path / "straight.h5"
    env = {k: v for k, v in SLURM_ENV.items() if not k.startswith("SLURM_")}
    ref = subprocess.run(["mpirun", "-np", str(SCRIPT_RANKS), sys.executable, "-m", "ringnet.train",
                          *flags[:-3], str(straight), *flags[-2:]],
                         capture_output=True, text=True, env=env, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    job, log = _submit_train_sbatch(tmp_path, flags)
    try:
        assert run(["scancel", "--signal=USR1", "--batch", job], timeout=30).returncode == 0
        end = time.monotonic() + 240
        requeued = None
        while time.monotonic() < end:
            state, restarts = _job_state(job)
            second = restarts >= 1 and "resuming from" in log.read_text()
            if state == "COMPLETED" or (second and state in ("FAILED", "CANCELLED", "TIMEOUT")):
                break           # (right after the requeue the first run shows as FAILED)
            if state == "PENDING" and restarts >= 1:
                if requeued is None:
                    requeued = time.monotonic()
                # slurmctld holds a requeued job back for about two minutes before it is
                # eligible again; the test lets it start once two seconds have passed (the
                # first run's credential is revoked as of the second it ended, and a run
                # started in that same second is killed as "Job credential revoked": seen
                # once in CI, the job then ends FAILED for good) and the first run's
                # slurmstepd are gone (a new step 0 beside the old one's loses its PMI-2
                # exchange)
                if time.monotonic() - requeued > 2.0 and not _stepd_alive(job) and \
                        "Reason=BeginTime" in run(["scontrol", "show", "job", job], timeout=30).stdout:
                    run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=30)
            time.sleep(0.5)
    finally:
        state, restarts = _job_state(job)
        if state not in ("COMPLETED", "FAILED", "CANCELLED", None):
            run(["scancel", job], timeout=30)
    out = log.read_text()
    assert state == "COMPLETED" and restarts == 1, (state, restarts, out[-3000:])
    stops = re.findall(r"^stopped by SIGUSR1 at step (\d+) of 600", out, re.M)
    assert len(stops) == 1, out[-3000:]
    assert f"requeueing job {job}" in out
    assert re.search(rf"^resuming from ck.h5 at step {stops[0]}", out, re.M), out[-3000:]
    got, want = load_checkpoint(tmp_path / "ck.h5")[0], load_checkpoint(straight)[0]
    assert all(np.array_equal(got[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def fault_files(tmp_path_factory):
    from ringnet.bench import faults
    return faults.prepare(str(tmp_path_factory.mktemp("faults")))


@needs_slurm
@pytest.mark.parametrize("case", srun_cases(), ids=lambda c: c.name)
def test_bench_faults_srun_case(case, fault_files, monkeypatch):
    """`python -m ringnet.bench faults --slurm`'s cases: srun reports the other tasks of a
    job that one rank ended as killed (137), whatever that rank's reason; the launcher takes
    each rank's own (a divergence 3, a bad data set or flag 2, a SIGTERM 75) and relaunches
    none of them; a rank killed is relaunched."""
    from ringnet.bench import faults
    for name, value in SLURM_ENV.items():
        monkeypatch.setenv(name, value)
    outcome = faults.run_case(case, fault_files, timeout=10.0)
    assert outcome.ok, "; ".join(outcome.problems) + "\n" + outcome.output[-3000:]
