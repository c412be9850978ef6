"""A graceful stop (ringnet.stopping): SIGTERM or SIGUSR1 on any rank or on the launcher stops
every rank at a step boundary with the checkpoint written, exit 75; the same command with
--resume auto continues to the weights of an uninterrupted run, bit for bit."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import launcher_free_env
from ringnet.bench.soak import rank_processes
from ringnet.checkpoint import TMP_SUFFIX, load_checkpoint, stored_step

TRAIN = [sys.executable, "-m", "ringnet.train"]
ARGS = ["--steps", "120", "--no-progress", "--no-eval", "--save-every", "25", "--resume", "auto"]


def _env(**extra):
    env = launcher_free_env()
    env.update(OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1", **extra)
    return env


def _run(cmd, **env):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(**env))


def _weights(path):
    params = load_checkpoint(path)[0]
    return np.concatenate([params[k].ravel() for k in sorted(params)])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("straight") / "ck.h5")
    proc = _run(["mpirun", "-np", "2", *TRAIN, *ARGS, "--save", path])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return _weights(path)


@pytest.mark.parametrize("fault", ["TERM:step 40:1", "USR1:step 40:0", "TERM:save-write:0"])
def test_a_signal_on_one_rank_stops_all_with_the_checkpoint_and_auto_resumes_exactly(
        tmp_path, uninterrupted, fault):
    path = str(tmp_path / "ck.h5")
    cmd = ["mpirun", "-np", "2", *TRAIN, *ARGS, "--save", path]
    proc = _run(cmd, RINGNET_FAULT=fault)
    assert proc.returncode == 75, (proc.returncode, proc.stderr[-2000:])
    stopped = [l for l in proc.stdout.splitlines() if l.startswith("stopped by ")]
    assert len(stopped) == 1, proc.stdout
    step = stored_step(path)
    name = "SIGUSR1" if fault.startswith("USR1") else "SIGTERM"
    assert stopped[0].startswith(f"stopped by {name} at step {step} of 120: checkpoint {path}")
    # the step boundary after the signal (the agreement takes one more step), never later
    first = 25 if "save-write" in fault else 40
    assert first < step <= first + 3, stopped[0]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(TMP_SUFFIX)]
    # what a requeued job does: the same command again
    again = _run(cmd)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.splitlines()[0].startswith(f"resuming from {path} at step {step}")
    assert np.array_equal(_weights(path), uninterrupted)


def test_sigterm_to_the_launcher_is_passed_on_and_not_relaunched(tmp_path):
    path = str(tmp_path / "ck.h5")
    long = [a if a != "120" else "100000" for a in ARGS]
    cmd = [sys.executable, "-m", "ringnet.launch", "-n", "2", "--", *long, "--save", path]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    try:
        out = proc.stdout.readline()    # the header: training starts
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        more, err = proc.communicate(timeout=240)
        out += more
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-2000:]
    assert "not relaunching" in err and "relaunch 1" not in err
    assert f"stopped by SIGTERM at step {stored_step(path)} of 100000" in out


def test_a_fresh_run_refuses_to_overwrite_a_checkpoint_further_along(tmp_path):
    path = str(tmp_path / "ck.h5")
    assert _run([*TRAIN, "--steps", "30", "--quiet", "--save", path]).returncode == 0
    before = os.path.getmtime(path)
    # a fresh run whose first periodic save (step 10) would replace step 30: refused
    proc = _run([*TRAIN, "--steps", "60", "--quiet", "--save", path, "--save-every", "10"])
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines == [f"ringnet: error: --save {path} holds a checkpoint at step 30, further along "
                     f"than this run's first save (step 10), and would be overwritten; continue it with "
                     f"--resume auto (or --resume {path}), or start over with another --save path "
                     f"or after removing it"]
    assert os.path.getmtime(path) == before and stored_step(path) == 30
    proc = _run([*TRAIN, "--steps", "60", "--quiet", "--resume", "auto"])
    assert proc.returncode == 2 and "--resume auto needs --save" in proc.stderr


def test_a_launcher_killed_by_sigkill_leaves_no_rank_training(tmp_path):
    """The job's mpirun gets SIGTERM when its launcher dies: the ranks stop at a step
    boundary with the checkpoint written, instead of training on unwatched."""
    path = str(tmp_path / "ck.h5")
    long = [a if a != "120" else "100000" for a in ARGS]
    cmd = [sys.executable, "-m", "ringnet.launch", "-n", "2", "--", *long, "--save", path]
    # TMPDIR: the killed launcher cannot remove its own temporary folder; pytest's will go
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=_env(TMPDIR=str(tmp_path)))
    proc.stdout.readline()
    time.sleep(0.5)
    proc.kill()
    proc.wait()
    end = time.monotonic() + 60
    while time.monotonic() < end and _ranks_of(path):
        time.sleep(0.2)
    assert not _ranks_of(path), "ranks still train after their launcher was killed"
    step = stored_step(path)
    assert step is not None and 0 < step < 100000


def _ranks_of(path):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"ringnet.train" in argv and path.encode() in argv:
            found.append(pid)
    return found


def _signal_after(cmd, delay, tmp_path, second=False, signum=signal.SIGTERM, sent=None):
    """Start ``cmd`` in ``tmp_path``, send ``signum`` to it after ``delay`` s (and, with
    ``second``, again every 20 ms from the moment it says it stopped while its ranks
    exit, as long as one is alive; each one sent then is appended to the list ``sent``);
    return (exit code, stderr+stdout)."""
    import threading
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    time.sleep(delay)
    proc.send_signal(signum)
    out = []

    def keep_signalling():
        # MPICH's mpiexec signalled after its proxy has exited, before it has noticed,
        # fails to forward the signal and exits 255 itself: a launcher's race, not the job's
        while proc.poll() is None and rank_processes(proc.pid):
            try:
                proc.send_signal(signum)
            except OSError:
                return
            if sent is not None:
                sent.append(time.monotonic())
            time.sleep(0.02)
    for line in proc.stdout:
        out.append(line)
        if second and line.startswith("stopped by"):
            threading.Thread(target=keep_signalling, daemon=True).start()
            second = False
    return proc.wait(timeout=240), "".join(out)


@pytest.mark.parametrize("delay", [0.2, 0.6])
def test_a_signal_in_the_first_second_is_a_graceful_stop(tmp_path, delay):
    """SIGTERM to mpirun while the ranks still import NumPy and mpi4py and MPI starts: the
    ranks note it from their first line and stop at a step boundary with the checkpoint
    written, exit 75 (the default action killed them: MPICH's BAD TERMINATION, exit 15)."""
    cmd = ["mpirun", "-np", "2", *TRAIN, "--model", "lenet", "--dataset", "synthetic",
           "--steps", "400", "--no-progress", "--no-eval", "--save", "ck.h5", "--save-every", "100"]
    code, out = _signal_after(cmd, delay, tmp_path)
    assert code == 75, out[-2000:]
    assert "BAD TERMINATION" not in out, out[-2000:]
    stopped = [l for l in out.splitlines() if l.startswith("stopped by SIGTERM at step")]
    assert len(stopped) == 1, out[-2000:]
    assert stored_step(tmp_path / "ck.h5") == int(stopped[0].split()[5])


def test_a_second_signal_after_the_stop_keeps_exit_75(tmp_path):
    """Signals that keep coming after the stop's save, while the ranks exit, change
    nothing: 75 still (it was 15, and SLURM does not requeue a job that ended so)."""
    cmd = ["mpirun", "-np", "2", *TRAIN, "--model", "lenet", "--dataset", "synthetic",
           "--steps", "400", "--no-eval", "--no-progress", "--save", "ck.h5", "--save-every", "100"]
    sent = []
    code, out = _signal_after(cmd, 1.5, tmp_path, second=True, sent=sent)
    assert code == 75, out[-2000:]
    assert "stopped by SIGTERM at step" in out
    assert sent, "no signal reached the job while its ranks exited"


def test_a_signal_to_the_launcher_before_its_job_starts_is_a_stop(tmp_path):
    """ringnet.launch signalled while it still imports: exit 75 (it was 143 or 15), saying
    that no step was taken, or, where the job had started, its ranks' graceful stop."""
    cmd = [sys.executable, "-m", "ringnet.launch", "-n", "2", "--", "--model", "lenet",
           "--dataset", "synthetic", "--steps", "400", "--no-eval", "--no-progress",
           "--save", "ck.h5", "--save-every", "100"]
    code, out = _signal_after(cmd, 0.15, tmp_path, signum=signal.SIGUSR1)
    assert code == 75, out[-2000:]
    assert ("stopped by SIGUSR1 before the job started" in out
            or "stopped by SIGUSR1 at step" in out), out[-2000:]
