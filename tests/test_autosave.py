"""python -m ringnet.launch: a rank killed with kill -9 mid-run, the relaunch, and the exact trajectory.

Reference for every relaunch: the same training flags run without a launcher and
without a failure, as two plain jobs: N = 4 ranks up to the step k the relaunch resumed
from (``--steps k --save``), then the relaunch's rank count from that checkpoint to the
end. The launched run must end with the same checkpoint, bit for bit. The kill is a
real external SIGKILL of one rank's process, found by its PMI rank.
"""
import os
import re
import shutil
import signal
import stat
import subprocess
import sys

import h5py
import numpy as np
import pytest

from ringnet.bench.elastic import kill_rank_after_first_checkpoint
from ringnet.launch import relaunch_size, slurm_tasks_alive
from conftest import launcher_free_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")

EVERY = 10
STEPS = 60
FLAGS = ["--model", "digits", "--dataset", "digits", "--lr", "0.05", "--seed", "3",
         "--no-progress", "--no-eval", "--quiet"]


def _env(extra=None):
    # A clean environment: the test process may itself be an MPI singleton.
    env = launcher_free_env("SLURM_")
    env.update(OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1", RINGNET_COMM_TIMEOUT="60",
               PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


def _train(np_, args, limit=180):
    proc = subprocess.run(["mpirun", "-np", str(np_), sys.executable, "-m", "ringnet.train", *args],
                          capture_output=True, text=True, timeout=limit, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _assert_same_checkpoint(path, reference):
    with h5py.File(path, "r") as got, h5py.File(reference, "r") as ref:
        assert got.attrs["step"] == ref.attrs["step"] == STEPS
        assert set(got) == set(ref), f"groups {set(got)} vs {set(ref)}"
        for group in ref:
            for name in ref[group]:
                assert np.array_equal(got[group][name][()], ref[group][name][()]), \
                    f"{group}/{name} differs from the uninterrupted run"


def _launch(tmp_path, launcher_flags, train_flags, kill_rank, env=None, limit=240,
            sig=signal.SIGKILL):
    save = str(tmp_path / "run.h5")
    cmd = [sys.executable, "-m", "ringnet.launch", *launcher_flags, "--",
           *train_flags, "--steps", str(STEPS), "--save", save, "--save-every", str(EVERY)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(env))
    try:
        seen, _ = kill_rank_after_first_checkpoint(proc, save, kill_rank, limit=120, sig=sig)
        out, err = proc.communicate(timeout=limit)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err, save, seen


RELAUNCH = re.compile(r"failed at step (\d+): (.*)\. (\d+) step\(s\) lost; relaunch 1 of \d+ on "
                      r"(\d+) rank\(s\) from checkpoint (\S+) \(step (\d+)\)")


@needs_mpirun
@pytest.mark.parametrize("mode, delay, batch, launcher_flags, expect_ranks", [
    ("ring", 1, 64, [], 4),                  # transient: the same rank count again
    ("master", 1, 64, ["--shrink"], 2),      # 3 does not divide 64
    ("split-fc", 1, 48, ["--shrink"], 3),
    ("tree", 0, 48, ["--shrink", "--min-ranks", "3"], 3),
])
def test_kill9_of_a_rank_relaunches_onto_the_same_trajectory(tmp_path, mode, delay, batch,
                                                            launcher_flags, expect_ranks):
    train_flags = [*FLAGS, "--mode", mode, "--delay", str(delay), "--batch-size", str(batch)]
    code, out, err, save, seen = _launch(tmp_path, ["-n", "4", "--max-restarts", "2",
                                                    *launcher_flags], train_flags, kill_rank=2)
    assert code == 0, out + err
    match = RELAUNCH.search(err)
    assert match, err
    reached, why, lost, ranks, path, k = match.groups()
    reached, lost, ranks, k = int(reached), int(lost), int(ranks), int(k)
    # hydra's report of the killed process, or a surviving rank's report of its lost peer
    assert "Killed (signal 9)" in why or "ringnet: error:" in why, err
    assert ranks == expect_ranks and path == save, err
    assert k >= seen and k % EVERY == 0 and lost == reached - k, err
    assert 0 <= lost <= EVERY + 2, f"{lost} steps lost with a checkpoint every {EVERY}"
    assert re.search(r"training again on \d+ rank\(s\) [\d.]+ s after the failure", err), err
    assert err.count("relaunch 1 of") == 1 and "relaunch 2 of" not in err, err

    ref_k = str(tmp_path / "ref_k.h5")
    ref = str(tmp_path / "ref.h5")
    _train(4, [*train_flags, "--steps", str(k), "--save", ref_k])
    _train(ranks, [*train_flags, "--steps", str(STEPS), "--resume", ref_k, "--save", ref])
    _assert_same_checkpoint(save, ref)


@needs_mpirun
def test_a_stalled_rank_is_stopped_and_relaunched(tmp_path):
    """SIGSTOP of one rank; the transfer deadline (60 s here) is far off, --stall-timeout 3 acts."""
    train_flags = [*FLAGS, "--mode", "ring", "--delay", "0", "--batch-size", "64"]
    code, out, err, save, _ = _launch(tmp_path, ["-n", "2", "--stall-timeout", "3"], train_flags,
                                      kill_rank=1, sig=signal.SIGSTOP)
    assert code == 0, out + err
    match = RELAUNCH.search(err)
    assert match and match.group(2) == "no step finished for 3 s (a rank stalled)", err
    with h5py.File(save, "r") as f:
        assert f.attrs["step"] == STEPS


@needs_mpirun
def test_under_slurm_the_relaunch_uses_the_tasks_the_allocation_still_has(tmp_path):
    """srun and scontrol stand-ins: the allocation lost a node and has 3 tasks left."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "srun.log"
    srun = bin_dir / "srun"
    srun.write_text(f"""#!/bin/sh
# srun stand-in: records its arguments, runs the job under mpirun
echo "$@" >> {log}
n=""
for a in "$@"; do case "$a" in --ntasks=*) n="${{a#--ntasks=}}";; esac; done
while [ "$1" != "{sys.executable}" ]; do shift; done
exec mpirun -np "$n" "$@"
""")
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\necho \"JobId=77 JobName=x NumNodes=$(cat "
                        f"{tmp_path}/nodes) NumCPUs=4 NumTasks=4\"\n")
    (tmp_path / "nodes").write_text("4")
    for script in (srun, scontrol):
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "77",
           "SLURM_NTASKS_PER_NODE": "1"}
    train_flags = [*FLAGS, "--mode", "ring", "--delay", "0", "--batch-size", "48"]
    # one node of four is gone once the rank is killed: no --shrink, the allocation decides
    (tmp_path / "nodes").write_text("3")
    code, out, err, save, _ = _launch(tmp_path, ["-n", "4"], train_flags, kill_rank=1, env=env)
    assert code == 0, out + err
    calls = log.read_text().splitlines()
    assert len(calls) == 2, calls
    assert calls[0].startswith("--ntasks=4 --kill-on-bad-exit=1 "), calls
    assert calls[1].startswith("--ntasks=3 --kill-on-bad-exit=1 "), calls
    assert calls[1].endswith(f"--resume {save}"), calls
    assert RELAUNCH.search(err).group(4) == "3", err


@needs_mpirun
def test_a_diverged_run_is_not_relaunched(tmp_path):
    save = str(tmp_path / "nan.h5")
    proc = subprocess.run([sys.executable, "-m", "ringnet.launch", "-n", "2", "--max-restarts", "5",
                           "--", *FLAGS, "--lr", "1e6", "--steps", "50", "--save", save,
                           "--save-every", "40"],
                          capture_output=True, text=True, timeout=240, env=_env())
    err = proc.stderr
    assert proc.returncode == 3, err                       # the job's own exit code: diverged
    assert "relaunch 1 of" not in err, err
    assert "training diverged (exit 3)" in err and "not relaunching" in err, err
    assert re.search(r"ringnet: error: loss is nan at step \d+", err), err   # the job's own message
    assert not os.path.exists(save)


@needs_mpirun
def test_bad_input_is_not_relaunched(tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not an HDF5 file")
    proc = subprocess.run([sys.executable, "-m", "ringnet.launch", "-n", "2", "--", *FLAGS,
                           "--dataset", str(bad), "--steps", "5", "--save",
                           str(tmp_path / "ck.h5")],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("ringnet: error:") == 1, proc.stderr
    assert "bad input (exit 2): not relaunching" in proc.stderr
    assert "relaunch 1" not in proc.stderr


def test_a_bad_training_flag_stops_before_any_launch():
    proc = subprocess.run([sys.executable, "-m", "ringnet.launch", "-n", "4", "--", "--batch-size",
                           "63", "--save", "x.h5"], capture_output=True, text=True, timeout=60,
                          env=_env({"MPIRUN": "/nonexistent/mpirun-must-not-run"}))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ringnet: error: --batch-size 63 (the global batch) is not divisible by the 4 ranks; "
        "choose a multiple of 4"], proc.stderr


@pytest.mark.parametrize("previous, batch, min_ranks, shrink, available, expected", [
    (4, 64, 1, False, None, 4),      # transient: the same count
    (4, 64, 1, True, None, 2),       # one fewer, but 3 does not divide 64
    (4, 48, 1, True, None, 3),
    (4, 64, 3, True, None, None),    # nothing >= 3 below 4 divides 64
    (8, 64, 1, False, 6, 4),         # SLURM: 6 tasks left, 6 and 5 do not divide 64
    (2, 64, 1, True, None, 1),
    (1, 64, 1, True, None, None),
])
def test_relaunch_size(previous, batch, min_ranks, shrink, available, expected):
    assert relaunch_size(previous, batch, min_ranks, shrink, available) == expected


def test_relaunch_size_skips_counts_the_mode_cannot_use():
    assert relaunch_size(4, 64, shrink=False, usable=lambda n: n != 4) == 2


def test_slurm_tasks_alive_reads_scontrol():
    class Out:
        returncode, stdout = 0, "JobId=5 NumNodes=3 NumCPUs=24 NumTasks=32"
    assert slurm_tasks_alive("5", 8, run=lambda *a, **k: Out) == 24
    Out.returncode = 1
    assert slurm_tasks_alive("5", 8, run=lambda *a, **k: Out) is None


@pytest.mark.parametrize("script", ["launch/local.sh", "hpc/train.sbatch"])
def test_shell_launchers_relaunch_through_ringnet_launch(tmp_path, script):
    """A stand-in for mpirun/srun that fails once like a killed rank (exit 9), then succeeds."""
    log = tmp_path / "calls.log"
    fake = tmp_path / ("srun" if script.startswith("hpc") else "fake-mpirun")
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n"
                    f"[ $(wc -l < {log}) -ge 2 ] && exit 0\n"
                    "echo 'YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)'\n"
                    "exit 9\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = _env({"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "MPIRUN": str(fake),
                "SLURM_JOB_ID": "9", "SLURM_NTASKS": "2"})
    proc = subprocess.run(["bash", os.path.join(REPO, script), *(["-n", "2"] if "local" in script else []),
                           "--shrink", "--", "--steps", "5", "--batch-size", "8"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    count = "--ntasks=" if script.startswith("hpc") else "-np "
    assert len(calls) == 2 and f"{count}2" in calls[0] and f"{count}1" in calls[1], calls
    assert all(c.endswith("--steps 5 --batch-size 8 --mode ring --delay 1 --batch-size 8")
               for c in calls), calls
    assert "a rank ended: Killed (signal 9)" in proc.stderr, proc.stderr


@needs_mpirun
def test_readme_launch_example_runs_as_written(tmp_path):
    readme = open(os.path.join(REPO, "README.md")).read()
    section = readme[readme.index("## When a rank dies"):]
    command = next(line for line in section.splitlines() if line.startswith("python -m ringnet.launch"))
    args = command.split()
    proc = subprocess.run([sys.executable, *args[1:]], capture_output=True, text=True, timeout=300,
                          env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = int(args[args.index("--steps") + 1])
    with h5py.File(tmp_path / args[args.index("--save") + 1], "r") as f:
        assert f.attrs["step"] == steps and f.attrs["mode"] == "ring"


def test_the_exit_noted_beside_the_heartbeat(tmp_path, monkeypatch):
    """A rank notes the code it ends the job with after the heartbeat's step record; the
    step count stays readable, no file or a 0 notes nothing."""
    from ringnet.autosave import Heartbeat, read_heartbeat
    from ringnet.shutdown import note_exit, noted_exit
    path = tmp_path / "hb"
    monkeypatch.setenv("RINGNET_HEARTBEAT", str(path))
    beat = Heartbeat(0)
    beat.beat(17)
    assert noted_exit(path) is None
    note_exit(0)
    assert noted_exit(path) is None
    note_exit(3)
    beat.beat(18)
    beat.close()
    assert read_heartbeat(path) == 18 and noted_exit(path) == 3
    assert noted_exit(tmp_path / "none") is None
    monkeypatch.delenv("RINGNET_HEARTBEAT")
    note_exit(2)                            # no heartbeat file named: nothing written
    assert noted_exit(path) == 3


def test_rank_pids_takes_the_rank_not_its_forked_child(tmp_path):
    """rank_pids on a made-up /proc: ranks 0 and 1 of a job writing run.h5, rank 1 with a
    forked child (same command line and environment, parent rank 1), a launcher and another
    job's rank: the ranks' own pids, the child left out."""
    from ringnet.bench.elastic import rank_pids

    def process(pid, args, rank=None, parent=1):
        folder = tmp_path / str(pid)
        folder.mkdir()
        (folder / "cmdline").write_bytes(b"\0".join(a.encode() for a in args) + b"\0")
        env = [b"PATH=/usr/bin"] + ([f"PMI_RANK={rank}".encode()] if rank is not None else [])
        (folder / "environ").write_bytes(b"\0".join(env) + b"\0")
        (folder / "status").write_bytes(f"Name:\tpython\nPPid:\t{parent}\n".encode())
    train = ["python", "-m", "ringnet.train", "--save", "run.h5"]
    process(100, ["mpirun", "-n", "2"] + train)
    process(110, train, rank=0, parent=100)
    process(120, train, rank=1, parent=100)
    process(130, train, rank=1, parent=120)          # rank 1's forked child
    process(140, ["python", "-m", "ringnet.train", "--save", "other.h5"], rank=1)
    (tmp_path / "self").mkdir()
    assert rank_pids("run.h5", proc=str(tmp_path)) == {0: 110, 1: 120}
