"""Each node of ``hpc/cluster.sh start --nodes K --cpus-per-node C`` has cores of its own:
its processes run in a control group of the node's own, held to C cores by CFS bandwidth.

On a 2-node cluster of C = min(1, cores / 4) each (started here in a temporary folder; half
the machine left to what runs outside it):

* every process of a node is in the node's group: an srun task, a rank mpirun starts
  through the cluster's launcher, a command of the launcher itself (``/proc/self/cgroup``);
* a node is held to its quota: busy loops, twice as many as the machine has cores, use C
  cores of CPU time (the group's cpuacct.usage), and ``status`` shows the time;
* isolation: the LeNet step of an srun task on the first node takes as long whether the
  second node idles or runs a job of busy loops, twice as many as the machine has cores
  (the median of interleaved rounds' ratios, within 10%);
* a node that failed and came back runs in its group again.

Run as a script, the same isolation measurement prints the figure docs/clusters.md shows on
a cluster of your choosing (as root)::

    python tests/hpc/test_cluster_cpus.py --nodes 4 --cpus-per-node 0.5
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__":     # run as a script: tests/ holds the conftest the helpers import
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

from test_cluster import cpu_group, group_pids, quota_of  # noqa: E402
from test_cluster_runs import (Cluster, free_settings, missing_for_a_cluster,  # noqa: E402
                               script)

CORES = len(os.sched_getaffinity(0))
# Half the machine to the two nodes: CFS runs the groups in turns within each period on the
# cores they share, and a node gets its quota in full only with cores to spare (on 2 cores,
# 2 nodes of 1 core: the first node's step 0-20% slower with the second busy; 2 nodes of
# 0.5 core: within 5%).
CPUS = min(1.0, CORES / 4)
# the first node's training: LeNet on synthetic data, one thread a rank
STEP = ["-m", "ringnet.train", "--model", "lenet", "--dataset", "synthetic", "--no-eval",
        "--quiet", "--json"]


def start_cluster(state, nodes, cpus):
    """Start a cluster in folder ``state``; (its Cluster, its RINGNET_SLURM_* settings)."""
    port, subnet, prefix = free_settings()
    state_env = {"RINGNET_SLURM_DIR": str(state), "RINGNET_SLURM_PORT": str(port)}
    env = dict(os.environ, **state_env)
    args = ["start", "--nodes", str(nodes), "--cpus-per-node", str(cpus), "--prefix", prefix,
            "--subnet", subnet]
    started = script(*args, env=env)
    assert started.returncode == 0, started.stderr
    status = script("status", env=env)
    if status.returncode != 0:
        script("stop", env=env)
        raise AssertionError(status.stdout + status.stderr)
    return Cluster(state_env, status.stdout, script("env", env=env).stdout), env


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing_for_a_cluster()
    if why:
        pytest.skip(f"no cluster here: {why}")
    started, env = start_cluster(tmp_path_factory.mktemp("cpus") / "slurm", 2, CPUS)
    try:
        yield started
    finally:
        stopped = script("stop", env=env)
        assert stopped.returncode == 0, stopped.stderr


def node_exec(cluster, name, command):
    """The command line that runs ``command`` on node ``name`` through the cluster's launcher."""
    return [cluster.env["HYDRA_LAUNCHER_EXEC"], name, command]


def cpu_line(text):
    """The cpu controller's group in a /proc/PID/cgroup text (v1 'N:cpu:/G' or v2 '0::/G')."""
    v1 = re.search(r"^\d+:(?:[^:]*,)?cpu(?:,[^:]*)?:(\S+)$", text, re.M)
    return v1.group(1) if v1 else re.search(r"^0::(\S+)$", text, re.M).group(1)


def usage_s(name):
    """The CPU seconds node ``name``'s group has used (cpuacct.usage, or v2's cpu.stat)."""
    group = cpu_group(name)
    if os.path.exists(f"{group}/cpu.max"):
        with open(f"{group}/cpu.stat") as f:
            return int(re.search(r"^usage_usec (\d+)", f.read(), re.M).group(1)) / 1e6
    acct = next(p for p in (f"{group}/cpuacct.usage", group.replace("/cpu/", "/cpuacct/")
                            + "/cpuacct.usage") if os.path.exists(p))
    with open(acct) as f:
        return int(f.read()) / 1e9


def busy_seconds():
    """CPU seconds this machine has spent busy (every core, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]                    # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class Burner:
    """``count`` busy loops on node ``name``, started through the cluster's launcher (so in
    the node's group), all in one process group that ``stop`` kills."""

    def __init__(self, cluster, name, count):
        loops = f"for i in $(seq {count}); do (while :; do :; done) & done; wait"
        self.proc = subprocess.Popen(node_exec(cluster, name, loops), start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class BusyJob:
    """A SLURM job of ``count`` busy loops on node ``name``: a neighbour as the node's own
    jobs are, a step whose tasks slurmd starts (a process group of its own, started by hand,
    would count as one process to the kernel's per-session scheduling outside the groups)."""

    def __init__(self, cluster, name, count):
        self.cluster, self.tag = cluster, f"busy-{os.getpid()}-{time.monotonic_ns()}"
        self.proc = subprocess.Popen(["srun", "-w", name, "-n", str(count), "-J", self.tag,
                                      "sh", "-c", "while :; do :; done"], env=cluster.env,
                                     start_new_session=True, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        end = time.monotonic() + 60
        while self.state() != "R":
            assert self.proc.poll() is None and time.monotonic() < end, "the busy job did not start"
            time.sleep(0.1)
        time.sleep(0.5)                 # its tasks started and spinning

    def state(self):
        return self.cluster.run(["squeue", "-h", "-n", self.tag, "-o", "%t"],
                                timeout=30).stdout.strip()

    def stop(self):
        self.cluster.run(["scancel", "-n", self.tag], timeout=30)
        try:
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        end = time.monotonic() + 30
        while self.state() and time.monotonic() < end:
            time.sleep(0.1)


# -- every process of a node in its group ---------------------------------------------------

def test_every_process_of_a_node_runs_in_its_group(cluster):
    tasks = cluster.run(["srun", "-N", "2", "--ntasks-per-node", "1", "sh", "-c",
                         'echo "$SLURMD_NODENAME $(cat /proc/self/cgroup | tr "\\n" " ")"'])
    assert tasks.returncode == 0, tasks.stderr
    seen = {}
    for line in tasks.stdout.splitlines():
        node, groups = line.split(" ", 1)
        seen[node] = cpu_line(groups.replace(" ", "\n"))
    assert seen == {name: f"/ringnet-{name}" for name in cluster.names}, seen
    # mpirun's ranks, one a node, through the launcher; and the launcher's own command
    ranks = cluster.run(["mpirun", "-np", "2", "-ppn", "1", "sh", "-c",
                         'echo "$(hostname) $(cat /proc/self/cgroup | tr "\\n" " ")"'])
    assert ranks.returncode == 0, ranks.stderr
    seen = {l.split(" ", 1)[0]: cpu_line(l.split(" ", 1)[1].replace(" ", "\n"))
            for l in ranks.stdout.splitlines()}
    assert seen == {name: f"/ringnet-{name}" for name in cluster.names}, seen
    for name in cluster.names:
        own = cluster.run(node_exec(cluster, name, "cat /proc/self/cgroup"))
        assert own.returncode == 0, own.stderr
        assert cpu_line(own.stdout) == f"/ringnet-{name}"
        in_netns = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True).stdout.split()
        assert {int(p) for p in in_netns} <= group_pids(cpu_group(name))
        assert quota_of(cpu_group(name)) == (round(CPUS * 10000), 10000)


# -- a node held to its quota ---------------------------------------------------------------

def test_a_node_is_held_to_its_quota(cluster):
    name = cluster.names[0]
    before, start = usage_s(name), time.monotonic()
    burner = Burner(cluster, name, 2 * CORES)
    time.sleep(2.0)
    burner.stop()
    used, wall = usage_s(name) - before, time.monotonic() - start
    # twice as many busy loops as cores would take every core; the quota leaves C of them
    assert used / wall <= CPUS * 1.1 + 0.02, f"{used:.2f} s of CPU in {wall:.2f} s"
    assert used / wall >= CPUS * 0.3, f"{used:.2f} s of CPU in {wall:.2f} s: the loops hardly ran"
    status = script("status", env=dict(os.environ, **cluster.state_env))
    shown = float(re.search(rf"^node {name}: .*, ([\d.]+) s of CPU used$", status.stdout,
                            re.M).group(1))
    assert shown >= before + used - 0.01, status.stdout


# -- isolation ------------------------------------------------------------------------------

def step_ms(cluster, name, steps, ranks=1):
    """``ranks`` srun tasks on node ``name`` train LeNet ``steps`` steps (more than one: in
    the ring, delay 0): the mean step, in ms (the training's time over its steps: its median
    step would leave out the steps another process's turn on the core fell in)."""
    mode = ["--mode", "ring", "--delay", "0"] if ranks > 1 else []
    proc = cluster.run(["srun", "-w", name, "-n", str(ranks), "--mpi=pmi2", sys.executable,
                        *STEP, *mode, "--steps", str(steps)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    return 1000 * summary["train_s"] / summary["steps"]


def isolation(cluster, rounds=4, steps=60, ranks=1):
    """The step of ``ranks`` ranks on the first node with the others idle and with every
    other node running a job of busy loops (twice the machine's cores on each), after one
    warm-up run, in rounds of one of each (idle first in even rounds, busy first in odd ones, so a
    drift of the machine falls on both alike). Returns (idle steps, busy steps, cores used
    outside the nodes' groups meanwhile)."""
    first, others = cluster.names[0], cluster.names[1:]
    step_ms(cluster, first, 10, ranks)             # warm-up: the files read once
    idle, busy = [], []
    outside_start = busy_seconds() - sum(usage_s(n) for n in cluster.names)
    wall_start = time.monotonic()
    for r in range(rounds):
        for loaded in ((False, True) if r % 2 == 0 else (True, False)):
            if not loaded:
                idle.append(step_ms(cluster, first, steps, ranks))
                continue
            burners = [BusyJob(cluster, name, 2 * CORES) for name in others]
            try:
                busy.append(step_ms(cluster, first, steps, ranks))
            finally:
                for burner in burners:
                    burner.stop()
    outside = busy_seconds() - sum(usage_s(n) for n in cluster.names) - outside_start
    return idle, busy, outside / (time.monotonic() - wall_start)


def busy_over_idle(idle, busy):
    """The median of each round's busy step over its idle one (a round's two runs are next
    to each other: what changes on the machine between rounds falls on both)."""
    return statistics.median(b / i for i, b in zip(idle, busy))


def test_a_step_on_one_node_takes_as_long_when_the_other_is_busy(cluster):
    # Six rounds: on a machine in a slow spell single runs of the same step differ by a
    # fifth, and one round's ratio by a tenth; the median of six holds to the quota's effect.
    idle, busy, outside = isolation(cluster, rounds=6)
    # Processes outside the cluster (another program on this machine) compete with the
    # node's task once they and the busy node take more than the cores the cluster leaves:
    # the comparison then says nothing about the quota.
    spare = CORES - 2 * CPUS
    if outside > spare / 2:
        pytest.skip(f"this machine is not quiet: {outside:.2f} cores used outside the "
                    f"cluster during the rounds, of {spare:g} the cluster leaves (idle {idle}, "
                    f"busy {busy} ms)")
    ratio = busy_over_idle(idle, busy)
    assert 0.9 <= ratio <= 1.1, f"busy / idle {ratio:.3f}: idle {idle}, busy {busy} ms"


# -- a node that failed and came back -------------------------------------------------------

def test_a_revived_node_runs_in_its_group_again(cluster):
    name = cluster.names[-1]
    group = cpu_group(name)
    env = dict(os.environ, **cluster.state_env)
    failed = script("fail-node", name, env=env)
    assert failed.returncode == 0, failed.stderr
    deadline = time.monotonic() + 10
    while group_pids(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_pids(group), "the failed node's processes are gone"
    revived = script("revive-node", name, env=env)
    assert revived.returncode == 0, revived.stderr
    assert "slurmd started in its control group" in revived.stdout
    slurmd = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = cluster.run(["sinfo", "-h", "-n", name, "-o", "%t"]).stdout.strip()
        pid_file = os.path.join(cluster.state_env["RINGNET_SLURM_DIR"], f"slurmd-{name}.pid")
        if os.path.exists(pid_file) and state in ("idle", "mix", "alloc"):
            with open(pid_file) as f:
                slurmd = int(f.read())
            break
        time.sleep(0.5)
    assert slurmd is not None, f"{name} did not come back"
    assert slurmd in group_pids(group)
    task = cluster.run(["srun", "-w", name, "cat", "/proc/self/cgroup"])
    assert task.returncode == 0, task.stderr
    assert cpu_line(task.stdout) == f"/ringnet-{name}"


# -- the figure for docs/clusters.md --------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description="The LeNet step of ranks on the first node "
                                     "with the other nodes idle and busy, on a cluster started "
                                     "for it (as root).")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--cpus-per-node", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ranks", type=int, default=1, help="ranks on the first node")
    args = parser.parse_args()
    why = missing_for_a_cluster()
    if why:
        sys.exit(f"no cluster here: {why}")
    with tempfile.TemporaryDirectory() as folder:
        started, env = start_cluster(os.path.join(folder, "slurm"), args.nodes, args.cpus_per_node)
        try:
            idle, busy, outside = isolation(started, args.rounds, args.steps, args.ranks)
        finally:
            script("stop", env=env)
    a, b = statistics.median(idle), statistics.median(busy)
    ratio = busy_over_idle(idle, busy)
    print(f"{args.nodes} nodes of {args.cpus_per_node:g} core(s) on {CORES} cores: the LeNet "
          f"step of {args.ranks} rank(s) on the first node, {args.rounds} rounds of "
          f"{args.steps} steps")
    print(f"  other nodes idle: {a:.1f} ms  ({', '.join(f'{x:.1f}' for x in idle)})")
    print(f"  other nodes busy: {b:.1f} ms  ({', '.join(f'{x:.1f}' for x in busy)})")
    print(f"  busy / idle, the median of the rounds' ratios: {ratio:.3f} "
          f"({(ratio - 1) * 100:+.1f}%)")
    print(f"  CPU used outside the cluster meanwhile: {outside:.2f} cores")


if __name__ == "__main__":
    main()
