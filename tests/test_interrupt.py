"""Ctrl-C ends a training job with one line, ``ringnet: error: interrupted``, and exit code 130.

Under ``mpirun``, ``python -m ringnet.launch`` and ``launch/local.sh``: each test starts the
real command in a session of its own, waits for its first progress line, and sends SIGINT
to its whole process group, as a terminal's Ctrl-C does. MPICH's mpirun announces the
Ctrl-C on its stdout ("Sending Ctrl-C to processes as requested", "Press Ctrl-C again to
force abort"): those two lines are mpirun's own and expected. Nothing else may appear:
no line per rank, no ``Abort(130)`` lines, no ``BAD TERMINATION`` banner, no traceback, no
file left behind.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import launcher_free_env

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL = os.path.join(ROOT, "launch", "local.sh")
LONG = ["--steps", "100000"]       # runs far longer than any test waits
INTERRUPTED = "ringnet: error: interrupted"
# What MPICH's mpirun prints on its stdout when it receives SIGINT.
MPIRUN_CTRL_C = [r"\[mpiexec@[^\]]+\] Sending Ctrl-C to processes as requested",
                 r"\[mpiexec@[^\]]+\] Press Ctrl-C again to force abort"]


def _env(tmp_path, **extra):
    env = launcher_free_env("SLURM_")
    env.update(OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1",
               RINGNET_PROGRESS_SECONDS="0",           # a progress line after every step
               TMPDIR=str(tmp_path / "tmp"),           # where a stray temporary would show
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    env.update(extra)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "run").mkdir()
    return env


def as_from_a_terminal():
    """A child's Ctrl-C as a terminal gives it: SIGINT (and SIGQUIT) at their default
    action, even where this suite runs in a background job, which ignores both."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def interrupt(cmd, tmp_path, group=True, **env):
    """Start ``cmd`` in ``tmp_path/run``, send SIGINT to its process group (``group``)
    once it printed its first progress line; return (exit code, stdout lines, stderr
    lines), progress and per-epoch lines left out."""
    out_path = tmp_path / "stdout"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path / "run", stdout=out, stderr=subprocess.PIPE,
                                text=True, env=_env(tmp_path, **env), start_new_session=True,
                                preexec_fn=as_from_a_terminal)
        try:
            err = []
            for line in proc.stderr:
                err.append(line)
                if line.startswith("step "):
                    break
            assert err and err[-1].startswith("step "), "".join(err)[-3000:]
            if group:
                os.killpg(proc.pid, signal.SIGINT)
            _, rest = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    stderr = [l for l in "".join(err).splitlines() + rest.splitlines()
              if not l.startswith("step ")]
    stdout = [l for l in out_path.read_text().splitlines()
              if not l.startswith(("epoch ", "ringnet: ring ", "ringnet: single "))]
    return proc.returncode, stdout, stderr


def assert_clean(tmp_path):
    assert os.listdir(tmp_path / "run") == [], "the job left files in its folder"
    assert os.listdir(tmp_path / "tmp") == [], "the job left temporary files"


def assert_mpirun_ctrl_c(stdout):
    assert len(stdout) == len(MPIRUN_CTRL_C), stdout
    assert all(re.fullmatch(p, l) for p, l in zip(MPIRUN_CTRL_C, stdout)), stdout


def test_ctrl_c_under_mpirun_prints_one_line_and_exits_130(tmp_path):
    code, stdout, stderr = interrupt(["mpirun", "-np", "4", sys.executable, "-m",
                                      "ringnet.train", *LONG], tmp_path)
    assert stderr == [INTERRUPTED], stderr
    assert_mpirun_ctrl_c(stdout)
    assert code == 130
    assert_clean(tmp_path)


def _descendants(pid):
    """Return the PIDs of ``pid``'s descendants (from /proc)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    stack, found = [pid], []
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _train_processes(pid, count):
    """Return the PIDs of the ``count`` ringnet.train processes below ``pid``, else None."""
    found = []
    for child in _descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"ringnet.train" in f.read():
                    found.append(child)
        except OSError:
            pass
    return found if len(found) == count else None


# clock_nanosleep, the system call of time.sleep, by machine
NANOSLEEP = {"x86_64": 230, "aarch64": 115}.get(os.uname().machine)


def _in_sleep(pid):
    """Return whether ``pid``'s main thread sleeps in time.sleep now (always True where
    the system call's number is not known here)."""
    if NANOSLEEP is None:
        return True
    try:
        with open(f"/proc/{pid}/syscall") as f:
            return f.read().split()[0] == str(NANOSLEEP)
    except (OSError, IndexError):
        return False


def _status(pid):
    with open(f"/proc/{pid}/status") as f:
        return {key: value.strip() for key, value in
                (line.split(":", 1) for line in f.read().splitlines() if ":" in line)}


def _wait_for(predicate, what):
    for _ in range(6000):                   # a generous bound: the wait ends on the event
        found = predicate()
        if found:
            return found
        time.sleep(0.01)
    raise AssertionError(f"never saw {what}")


def test_ctrl_c_while_a_rank_holds_unread_messages(tmp_path):
    # Rank 1 stops itself on entering the evaluation; the others send it their results
    # and wait. Ctrl-C then reaches all four, and rank 1, continued, ends with the
    # others' messages unread: MPI_Finalize refuses a world communicator in that state.
    env = _env(tmp_path, RINGNET_FAULT="STOP:evaluation:1")
    with open(tmp_path / "stdout", "w") as out:
        proc = subprocess.Popen(["mpirun", "-np", "4", sys.executable, "-m", "ringnet.train",
                                 *LONG], cwd=tmp_path / "run", stdout=out,
                                stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True, preexec_fn=as_from_a_terminal)
        try:
            ranks = _wait_for(lambda: _train_processes(proc.pid, 4), "the 4 ranks")

            def stopped():
                return [pid for pid in ranks if _status(pid)["State"].startswith("T")]
            rank1 = _wait_for(stopped, "rank 1 stopped")[0]
            # The others have sent rank 1 their results once they sleep in agree()'s
            # wait loop (the evaluation itself does not sleep). On the correct code this
            # wait changes nothing; without it, the case under test would not always arise.
            sleeps = {pid: 0 for pid in ranks if pid != rank1}

            def all_waiting():
                for pid in sleeps:
                    sleeps[pid] += _in_sleep(pid)
                return min(sleeps.values()) >= 10
            _wait_for(all_waiting, "the other ranks waiting for rank 1")
            os.killpg(proc.pid, signal.SIGINT)
            # mpirun passes SIGINT on to the stopped rank too; it waits there (pending).
            _wait_for(lambda: int(_status(rank1)["ShdPnd"], 16) & (1 << (signal.SIGINT - 1))
                      or int(_status(rank1)["SigPnd"], 16) & (1 << (signal.SIGINT - 1)),
                      "SIGINT pending on rank 1")
            os.kill(rank1, signal.SIGCONT)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    stderr = [l for l in err.splitlines() if not l.startswith("step ")]
    stdout = [l for l in (tmp_path / "stdout").read_text().splitlines()
              if not l.startswith(("epoch ", "ringnet: ring "))]
    assert stderr == [INTERRUPTED], stderr
    assert_mpirun_ctrl_c(stdout)
    assert proc.returncode == 130
    assert_clean(tmp_path)


def test_ctrl_c_under_ringnet_launch(tmp_path):
    code, stdout, stderr = interrupt([sys.executable, "-m", "ringnet.launch", "-n", "2", "--",
                                      *LONG], tmp_path)
    assert stderr == [INTERRUPTED], stderr      # the job's line; the launcher adds none
    assert_mpirun_ctrl_c(stdout)
    assert code == 130
    assert_clean(tmp_path)                      # the launcher's heartbeat folder is gone too


def test_ctrl_c_under_local_sh(tmp_path):
    code, stdout, stderr = interrupt(["bash", LOCAL, "-n", "2", *LONG], tmp_path)
    assert stderr == [INTERRUPTED], stderr
    assert_mpirun_ctrl_c(stdout)
    assert code == 130
    assert_clean(tmp_path)


def test_ctrl_c_on_one_process(tmp_path):
    code, stdout, stderr = interrupt([sys.executable, "-m", "ringnet.train", *LONG], tmp_path)
    assert (code, stdout, stderr) == (130, [], [INTERRUPTED])
    assert_clean(tmp_path)


def test_sigint_to_one_rank_alone_ends_the_job_naming_it(tmp_path):
    # Not Ctrl-C: rank 1 alone gets SIGINT (kill -INT on its PID). It waits for the others
    # (shutdown.FINALIZE_LIMIT_S), which never come, and then aborts the job.
    code, stdout, stderr = interrupt(["mpirun", "-np", "2", sys.executable, "-m",
                                      "ringnet.train", *LONG], tmp_path, group=False,
                                     RINGNET_FAULT="INT:step 3:1")
    assert stderr[0] == f"[rank 1] {INTERRUPTED}", stderr
    assert all(l.startswith("Abort(130) on node 1") for l in stderr[1:]), stderr
    assert stdout == [] and code == 130
    assert_clean(tmp_path)
