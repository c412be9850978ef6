"""Clusters side by side, and what a killed job leaves: ``hpc/cluster.sh`` numbers each
start's jobs from a block of ids of its own, and a job's epilog removes the MPICH shared
memory its ranks left in /dev/shm.

MPICH names a job's shared-memory segment after the job (``mpich_shm_<hash>_0``, the hash
taken from the job and step id under srun); ranks killed before MPI_Finalize leave it there,
and a later job of the same id finds it and fails (or hangs) in MPI_Init.

* two clusters at once (2 nodes, and a single node, each with its own RINGNET_SLURM_DIR and
  RINGNET_SLURM_PORT) number their jobs from blocks apart, and a start afresh from another;
* a job whose ranks were killed: as it ends its epilog removes the segment its ranks made,
  and leaves a segment made before the job and segments another process has open or mapped;
* a cluster started afresh after a killed job whose epilog never ran (the cluster stopped
  under it) runs a 2-rank MPI job: its id is not the killed job's;
* a finished job's state is on record (jobcomp/filetxt, ``sacct -c``) after it has left
  ``squeue``, and ``sbatch --wait`` still returns within a poll or two of the job's end.

The clusters are started here, in temporary folders; starting them needs SLURM (and root
for the 2-node one), and the tests skip saying which is missing.
"""
import getpass
import mmap
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from test_cluster_runs import (Cluster, free_settings, long_folder, missing_for_a_cluster, script,
                               socket_room)

PROGRAM = r"""
import os, re, sys, time
from mpi4py import MPI
c = MPI.COMM_WORLD
with open("/proc/self/maps") as f:
    segments = sorted(set(re.findall(r"/dev/shm/mpich_shm_\S+", f.read())))
print(c.rank, os.getpid(), os.environ["SLURM_JOB_ID"], ",".join(segments) or "-", flush=True)
c.Barrier()
time.sleep(float(sys.argv[1]))
"""


def missing_slurm():
    absent = [t for t in ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sacct")
              if shutil.which(t) is None]
    if absent:
        return f"{', '.join(absent)} not found: apt-get install slurmctld slurmd slurm-client munge"
    return None


needs_slurm = pytest.mark.skipif(missing_slurm() is not None, reason=f"no SLURM: {missing_slurm()}")


def start_single(state):
    """A single-node cluster in folder ``state`` on a free port: its Cluster."""
    port, _, _ = free_settings()
    state_env = {"RINGNET_SLURM_DIR": str(state), "RINGNET_SLURM_PORT": str(port)}
    env = dict(os.environ, **state_env)
    started = script("start", env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    return Cluster(state_env, "", script("env", env=env).stdout)


def stop(cluster):
    """Cancel what still runs there (a test that failed half way), then stop the cluster: a
    single node's stop ends the daemons, not the jobs' steps."""
    env = dict(os.environ, **cluster.state_env)
    if script("status", env=env).returncode == 0:
        cluster.run(["scancel", "-u", getpass.getuser()], timeout=30)
        end = time.monotonic() + 20
        while cluster.run(["squeue", "-h"], timeout=30).stdout.strip() and time.monotonic() < end:
            time.sleep(0.5)
    return script("stop", env=env)


def job_ids(cluster):
    """(FirstJobId, MaxJobId) of the cluster's slurm.conf."""
    with open(os.path.join(cluster.state_env["RINGNET_SLURM_DIR"], "slurm.conf")) as f:
        text = f.read()
    found = dict(re.findall(r"^(FirstJobId|MaxJobId)=(\d+)$", text, re.M))
    assert set(found) == {"FirstJobId", "MaxJobId"}, "no job id range in slurm.conf"
    return int(found["FirstJobId"]), int(found["MaxJobId"])


def apart(*ranges):
    ranges = sorted(ranges)
    return all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))


class Job:
    """``srun -n 2`` of PROGRAM sleeping ``seconds``: its ranks' pids, job id and segments."""

    def __init__(self, cluster, tmp_path, seconds, *srun):
        program = tmp_path / "ranks.py"
        program.write_text(PROGRAM)
        self.out = tmp_path / f"job-{time.monotonic_ns()}.out"
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(["srun", "-n", "2", "--mpi=pmi2", *srun, sys.executable,
                                          str(program), str(seconds)], stdout=out,
                                         stderr=subprocess.STDOUT, env=cluster.env,
                                         start_new_session=True)
        self.rows = []

    def started(self, timeout=90):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            rows = [l.split() for l in self.out.read_text().splitlines()
                    if re.match(r"\d+ \d+ ", l)]
            if len(rows) == 2:
                self.rows = rows
                return self
            assert self.proc.poll() is None, self.out.read_text()[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"the ranks did not start: {self.out.read_text()[-3000:]}")

    @property
    def pids(self):
        return [int(r[1]) for r in self.rows]

    @property
    def id(self):
        return int(self.rows[0][2])

    @property
    def segments(self):
        return sorted({s for r in self.rows for s in r[3].split(",") if s != "-"})

    def kill_ranks(self):
        for pid in self.pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def kill_srun(self):
        """srun and the helper it forks (one process group)."""
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def wait(self, timeout=60):
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill_srun()


def wait_until(predicate, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    why = missing_slurm()
    if why:
        pytest.skip(f"no SLURM: {why}")
    cluster = start_single(tmp_path_factory.mktemp("single") / "slurm")
    try:
        yield cluster
    finally:
        stopped = stop(cluster)
        assert stopped.returncode == 0, stopped.stderr


# -- clusters side by side ------------------------------------------------------------------

def test_clusters_side_by_side_number_their_jobs_apart(single, tmp_path):
    why = missing_for_a_cluster()
    if why:
        pytest.skip(f"no 2-node cluster here: {why}")
    port, subnet, prefix = free_settings()
    state_env = {"RINGNET_SLURM_DIR": str(tmp_path / "nodes"), "RINGNET_SLURM_PORT": str(port)}
    env = dict(os.environ, **state_env)
    started = script("start", "--nodes", "2", "--prefix", prefix, "--subnet", subnet, env=env)
    assert started.returncode == 0, started.stderr
    nodes = Cluster(state_env, "", script("env", env=env).stdout)
    try:
        assert apart(job_ids(single), job_ids(nodes)), (job_ids(single), job_ids(nodes))
        # a 2-rank MPI job on each, at the same time
        jobs = [Job(single, tmp_path, 1), Job(nodes, tmp_path, 1, "-N", "2")]
        for job, cluster in zip(jobs, (single, nodes)):
            job.started()
            first, last = job_ids(cluster)
            assert first <= job.id <= last, (job.id, first, last)
        for job in jobs:
            assert job.wait() == 0, job.out.read_text()[-3000:]
        # the single node started afresh (its folder gone) takes another block again
        again = start_single(tmp_path / "again")
        try:
            assert apart(job_ids(single), job_ids(nodes), job_ids(again))
        finally:
            assert stop(again).returncode == 0
    finally:
        stopped = stop(nodes)
        assert stopped.returncode == 0, stopped.stderr


# -- what a killed job leaves ---------------------------------------------------------------

def test_a_killed_jobs_shared_memory_goes_with_it(single, tmp_path):
    tag = f"ringnet_test_{os.getpid()}"
    before = f"/dev/shm/mpich_shm_{tag}_before"         # made before the job, open by none
    open_ = f"/dev/shm/mpich_shm_{tag}_open"            # made during it, open elsewhere
    mapped = f"/dev/shm/mpich_shm_{tag}_mapped"         # made during it, mapped elsewhere
    with open(before, "wb") as f:
        f.write(b"\0" * 4096)
    time.sleep(0.05)
    held = None
    try:
        job = Job(single, tmp_path, 120).started()
        assert job.segments, "MPICH made no shared-memory segment for the 2 ranks"
        held = open(open_, "wb")
        with open(mapped, "wb+") as f:
            f.write(b"\0" * 4096)
            f.flush()
            view = mmap.mmap(f.fileno(), 4096)
        job.kill_ranks()
        job.wait()
        epilog = os.path.join(single.state_env["RINGNET_SLURM_DIR"], "log", "epilog.log")
        wait_until(lambda: os.path.exists(epilog) and f"job {job.id} " in open(epilog).read(),
                   30, "the job's epilog")
        for segment in job.segments:
            assert not os.path.exists(segment), f"{segment} is left"
            assert f"job {job.id} on " in open(epilog).read() and segment in open(epilog).read()
        assert os.path.exists(before) and os.path.exists(open_) and os.path.exists(mapped)
        view.close()
    finally:
        if held:
            held.close()
        for name in (before, open_, mapped):
            if os.path.exists(name):
                os.unlink(name)


def test_a_start_afresh_after_killed_jobs_runs_mpi(tmp_path):
    why = missing_slurm()
    if why:
        pytest.skip(f"no SLURM: {why}")
    first = start_single(tmp_path / "first")
    left = []
    try:
        killed = Job(first, tmp_path, 120).started()
        left = killed.segments
        assert left, "MPICH made no shared-memory segment for the 2 ranks"
        # the cluster stops under the job (no epilog runs), then its ranks are killed
        stopped = script("stop", env=dict(os.environ, **first.state_env))
        assert stopped.returncode == 0, stopped.stderr
        steps = {int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
                 for pid in killed.pids}
        killed.kill_ranks()
        for pid in steps:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        killed.kill_srun()                 # it waits for a controller that is gone
        assert all(os.path.exists(s) for s in left), "the killed ranks' segment is gone already"
        # a cluster started afresh: another folder, so no state of the first
        fresh = start_single(tmp_path / "fresh")
        try:
            job = Job(fresh, tmp_path, 0)
            code = job.wait(timeout=90)
            out = job.out.read_text()
            assert code == 0, out[-3000:]
            job.started(timeout=1)
            assert job.id != killed.id and not set(job.segments) & set(left), (job.id, killed.id)
        finally:
            assert stop(fresh).returncode == 0
    finally:
        stop(first)
        for segment in left:
            if os.path.exists(segment):
                os.unlink(segment)


# -- a finished job on record ---------------------------------------------------------------

def test_a_finished_jobs_state_is_on_record(single, tmp_path):
    start = time.monotonic()
    failed = single.run(["sbatch", "--wait", "--parsable", f"--output={tmp_path}/%j.out",
                         "--wrap", "sleep 1; exit 3"])
    took = time.monotonic() - start
    assert failed.returncode == 3, failed.stderr
    # MinJobAge above 5 would make sbatch poll after 2, 8 and 32 s: this returned at 4 or 6
    assert took < 9, f"sbatch --wait took {took:.1f} s for a 1 s job"
    failed_id = int(failed.stdout.strip().split(";")[0])
    cancelled = single.run(["sbatch", "--parsable", f"--output={tmp_path}/%j.out",
                            "--wrap", "sleep 60"])
    cancelled_id = int(cancelled.stdout.strip().split(";")[0])
    wait_until(lambda: single.run(["squeue", "-h", "-j", str(cancelled_id), "-o", "%t"])
               .stdout.strip() == "R", 30, "the job to run")
    assert single.run(["scancel", str(cancelled_id)]).returncode == 0
    # gone from squeue once MinJobAge has passed, but on record
    wait_until(lambda: not single.run(["squeue", "-h", "-j", f"{failed_id},{cancelled_id}"])
               .stdout.strip(), 30, "the jobs to leave squeue")
    record = os.path.join(single.state_env["RINGNET_SLURM_DIR"], "log", "jobcomp.log")
    lines = {int(re.search(r"^JobId=(\d+) ", l).group(1)): l for l in open(record)}
    assert "JobState=FAILED" in lines[failed_id] and " ExitCode=3:0" in lines[failed_id]
    assert "JobState=CANCELLED" in lines[cancelled_id]
    sacct = single.run(["sacct", "-c", "-n", "-P", "-o", "JobID,State", "-j",
                        f"{failed_id},{cancelled_id}"])
    assert sacct.returncode == 0, sacct.stderr
    states = dict(l.split("|")[:2] for l in sacct.stdout.split())
    assert states == {str(failed_id): "FAILED", str(cancelled_id): "CANCELLED"}, sacct.stdout


# -- the folder's length: SLURM's step sockets live in it ----------------------------------

@pytest.mark.skipif(missing_slurm() is not None, reason=f"no SLURM: {missing_slurm()}")
def test_a_folder_too_long_for_slurm_s_sockets_is_one_line_and_makes_nothing():
    host = socket.gethostname().split(".")[0]
    room = socket_room("spool", host)
    base, state = long_folder(room + 1)
    try:
        port, _, _ = free_settings()
        env = dict(os.environ, RINGNET_SLURM_DIR=state, RINGNET_SLURM_PORT=str(port))
        proc = script("start", env=env)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
        sock = f"{state}/spool/{host}_67043327.4294967291"
        assert len(sock) == 108
        assert lines[0] == (
            f"hpc/cluster.sh: RINGNET_SLURM_DIR={state} is too long: SLURM's socket {sock} "
            f"would take 108 characters, over the 107 of a Unix socket's path; choose a folder "
            f"of at most {room} characters"), lines[0]
        assert os.listdir(base) == [], "start made something"
    finally:
        if os.listdir(base):
            script("stop", env=env)         # the start went ahead: stop what it started
        shutil.rmtree(base)


@pytest.mark.skipif(missing_slurm() is not None, reason=f"no SLURM: {missing_slurm()}")
def test_a_folder_of_the_longest_length_allowed_runs_a_batch_job(tmp_path):
    """At the bound the start gives, a batch job (and its srun step) runs to its end: the
    bound is not stricter than SLURM's (one character more, slurmd cannot make the batch
    step's socket and ``sbatch --wait`` never returns)."""
    host = socket.gethostname().split(".")[0]
    room = socket_room("spool", host)
    base, state = long_folder(room)
    cluster = None
    try:
        cluster = start_single(state)
        out = tmp_path / "job.out"
        done = cluster.run(["sbatch", "--wait", "-o", str(out), "--wrap", "srun -n 1 hostname"],
                           timeout=90)
        assert done.returncode == 0, done.stdout + done.stderr
        assert out.read_text().split() == [host]
    finally:
        if cluster is not None:
            stop(cluster)
        shutil.rmtree(base)
