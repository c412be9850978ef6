"""A node lost in training, on the 2-node cluster of tests/hpc/test_cluster_runs.py (skips
without root or SLURM, as there): ``hpc/cluster.sh fail-node`` kills every process of the
node (its slurmd and the job's ranks) and takes its link down.

* ``python -m ringnet.launch`` under mpirun across the nodes, and inside ``sbatch -N 2
  hpc/train.sbatch`` (srun, ``--no-kill``), notices the node no longer answers and
  continues on the surviving node from the last periodic checkpoint, at the ranks that
  node holds; what is lost is the steps since that checkpoint, no more;
* the batch host lost: SLURM requeues the job, which continues on the surviving node from
  the checkpoint once its node count is lowered (``scontrol update``, as docs/clusters.md
  says).
"""
import os
import re
import subprocess
import sys
import time

from test_cluster_runs import CLUSTER, RANKS_PER_NODE, ROOT, cluster  # noqa: F401

SAVE_EVERY = 20
STEPS = 200
TRAIN = ["--model", "lenet", "--dataset", "synthetic", "--steps", str(STEPS), "--no-eval",
         "--mode", "ring", "--no-progress", "--save-every", str(SAVE_EVERY)]
# The transfer deadline of the ranks left behind, and how long the launcher waits for a
# node to answer its probe (srun to a dead node waits until then): short ones keep the
# tests short.
FAST = {"RINGNET_COMM_TIMEOUT": "4", "RINGNET_PROBE_TIMEOUT": "5"}


def _env(tmp_path):
    """The job's settings: the short deadline, and the test's folder as TMPDIR: a launcher
    on the failed node is killed with it and cannot remove its temporary folder."""
    return dict(FAST, TMPDIR=str(tmp_path))


def _checkpoint_step(path):
    from ringnet.launch import checkpoint_step
    return checkpoint_step(str(path))


def _node(cluster, verb, name):
    proc = cluster.run(["bash", CLUSTER, verb, name], env=cluster.state_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _wait_for(predicate, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class _Lost:
    """Fail node ``name`` once the job wrote its first checkpoint; bring it back after."""

    def __init__(self, cluster, name, checkpoint):
        self.cluster, self.name, self.checkpoint = cluster, name, checkpoint

    def __enter__(self):
        _wait_for(lambda: (_checkpoint_step(self.checkpoint) or 0) >= SAVE_EVERY, 180,
                  "the first checkpoint")
        _node(self.cluster, "fail-node", self.name)
        return self

    def __exit__(self, *exc):
        _node(self.cluster, "revive-node", self.name)
        _wait_for(lambda: _responding(self.cluster, self.name), 180,
                  f"{self.name} back in service")


def _responding(cluster, name):
    """Whether SLURM has node ``name`` in service again (a state without "*", not down)."""
    state = cluster.run(["sinfo", "-h", "-n", name, "-o", "%t"]).stdout.strip()
    return bool(state) and "*" not in state and not state.startswith(("down", "drain"))


def _relaunch_line(text):
    lines = [l for l in text.splitlines() if "ringnet.launch: the job on" in l]
    assert len(lines) == 1, text[-4000:]
    return lines[0]


def _check_continued(text, checkpoint, survivor, lost_node):
    """The launcher's account: the lost node named, a relaunch on the survivor's ranks from
    the checkpoint, at most the steps since it lost, the job finished."""
    assert re.search(rf"node {lost_node} does not answer \(.+\): relaunching without it", text), \
        text[-4000:]
    line = _relaunch_line(text)
    match = re.search(r"failed at step (\d+).*?(\d+) step\(s\) lost; relaunch 1 of \d+ on "
                      rf"{RANKS_PER_NODE} rank\(s\) on node\(s\) {survivor} from checkpoint "
                      rf"{re.escape(str(checkpoint))} \(step (\d+)\)", line)
    assert match, line
    failed, lost, resumed = map(int, match.groups())
    assert resumed % SAVE_EVERY == 0 and resumed >= SAVE_EVERY
    assert lost == failed - resumed
    # nothing lost beyond the checkpoint: it is the newest the job could have written
    assert 0 <= lost <= SAVE_EVERY + 2, line
    header = [l for l in text.splitlines() if l.startswith("ringnet: ring")][-1]
    assert f"on {RANKS_PER_NODE} rank(s)" in header and "nodes x" not in header, header
    assert re.search(rf"done: {STEPS} steps", text), text[-3000:]
    assert _checkpoint_step(checkpoint) == STEPS


def test_launch_under_mpirun_continues_on_the_surviving_node(cluster, tmp_path):
    first, second = cluster.names[:2]
    checkpoint = tmp_path / "ck.h5"
    log = tmp_path / "log"
    cmd = [sys.executable, "-m", "ringnet.launch", "-n", str(2 * RANKS_PER_NODE),
           "--launcher", f"mpirun -ppn {RANKS_PER_NODE}", "--",
           *TRAIN, "--save", str(checkpoint)]
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                               env=dict(cluster.env, **_env(tmp_path)))
        try:
            with _Lost(cluster, second, checkpoint):
                code = job.wait(timeout=300)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    text = log.read_text()
    assert code == 0, text[-4000:]
    _check_continued(text, checkpoint, first, second)


def _sbatch(cluster, tmp_path, *options):
    proc = cluster.run(["sbatch", "--parsable", f"--ntasks-per-node={RANKS_PER_NODE}",
                        "--cpus-per-task=1", f"--chdir={tmp_path}",
                        f"--output={tmp_path}/job.out", *options,
                        os.path.join(ROOT, "hpc", "train.sbatch"), "--",
                        *TRAIN, "--save", str(tmp_path / "ck.h5")],
                       env=_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _job_state(cluster, job):
    out = cluster.run(["scontrol", "show", "job", "-o", job]).stdout
    state = re.search(r"JobState=(\S+)", out)
    return state.group(1) if state else "GONE"


def test_sbatch_job_continues_on_the_surviving_node(cluster, tmp_path):
    first, second = cluster.names[:2]
    job = _sbatch(cluster, tmp_path, "-N", "2")
    try:
        with _Lost(cluster, second, tmp_path / "ck.h5"):       # not the batch host
            _wait_for(lambda: "ringnet.launch: done" in (tmp_path / "job.out").read_text()
                      or _job_state(cluster, job) not in ("RUNNING", "PENDING", "CONFIGURING"),
                      300, "the job to end")
    finally:
        cluster.run(["scancel", job])
    text = (tmp_path / "job.out").read_text()
    assert "ringnet.launch: done after 1 relaunch(es)" in text, text[-4000:]
    _check_continued(text, tmp_path / "ck.h5", first, second)


def test_requeued_sbatch_job_continues_on_the_surviving_node(cluster, tmp_path):
    """The batch host lost: the script dies with it, SLURM requeues the job (--requeue);
    lowering its node count lets it start on the survivor, where --resume auto continues."""
    first, second = cluster.names[:2]
    job = _sbatch(cluster, tmp_path, "-N", "1-2", "--no-kill=off")
    checkpoint = tmp_path / "ck.h5"
    try:
        with _Lost(cluster, first, checkpoint):                # the batch host
            saved = _checkpoint_step(checkpoint)
            _wait_for(lambda: _job_state(cluster, job) == "PENDING", 120, "the requeue")
            update = cluster.run(["scontrol", "update", f"JobId={job}", "NumNodes=1-2",
                                  f"NumTasks={RANKS_PER_NODE}", "StartTime=now"])
            assert update.returncode == 0, update.stderr
            _wait_for(lambda: f"done: {STEPS} steps" in (tmp_path / "job.out").read_text(),
                      300, "the requeued job to finish")
    finally:
        cluster.run(["scancel", job])
    text = (tmp_path / "job.out").read_text()
    resumed = [int(s) for s in re.findall(r"resuming from \S+ at step (\d+)", text)]
    assert len(resumed) == 1 and resumed[0] >= saved, text[-4000:]
    header = [l for l in text.splitlines() if l.startswith("ringnet: ring")][-1]
    assert f"on {RANKS_PER_NODE} rank(s)" in header, header
    assert _checkpoint_step(checkpoint) == STEPS
    out = cluster.run(["scontrol", "show", "job", "-o", job]).stdout
    assert "Restarts=1" in out or not out, out


def test_fail_and_revive_node_refuse_what_they_cannot_do(cluster, tmp_path):
    for args, needle in ((["fail-node", "nosuchnode"], "not a node of the cluster"),
                         (["revive-node", cluster.names[0]], "its slurmd runs; the node has not failed"),
                         (["fail-node"], "give one node name")):
        proc = cluster.run(["bash", CLUSTER, *args], env=cluster.state_env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
    empty = dict(cluster.state_env, RINGNET_SLURM_DIR=str(tmp_path / "none"))
    proc = cluster.run(["bash", CLUSTER, "fail-node", cluster.names[0]], env=empty)
    assert proc.returncode == 2 and "no K-node cluster runs" in proc.stderr, proc.stderr
