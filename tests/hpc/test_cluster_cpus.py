"""Each node of ``hpc/cluster.sh start --nodes K --cpus-per-node C`` has cores of its own:
its processes run in a control group of the node's own, held to C cores by CFS bandwidth.

On a 2-node cluster of C = min(1, cores / 4) each and links of 1 Gbit/s (started here in a
temporary folder; half the machine left to what runs outside it):

* every process of a node is in the node's group: an srun task, a rank mpirun starts
  through the cluster's launcher, a command of the launcher itself (``/proc/self/cgroup``);
* a node is held to its quota: busy loops, twice as many as the machine has cores, use C
  cores of CPU time (the group's cpuacct.usage), and ``status`` shows the time;
* train's ``group_cpu_s`` is the node's CPU over the training loop: within what the group
  used around the job, at least the run's compute, about C cores of the loop's time;
* isolation: the LeNet step of an srun task on the first node takes as long whether the
  second node idles or runs a job of busy loops, twice as many as the machine has cores
  (the loops stopped and let run in turns of half a second during the training, its steps
  sorted by turn on the trace's timeline; the median of three runs' ratios, within 10%);
* a held node acknowledges TCP data at once (its route's ``quickack 1``): split-fc across
  the two nodes' 1 Gbit/s link sends no loss probes, or a quarter as many as with delayed
  acknowledgements;
* a node that failed and came back runs in its group again.

Run as a script, the same isolation measurement prints the figure docs/clusters.md shows on
a cluster of your choosing (as root)::

    python tests/hpc/test_cluster_cpus.py --nodes 4 --cpus-per-node 0.5
"""
import argparse
import bisect
import json
import math
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
                               running, script)

CORES = len(os.sched_getaffinity(0))
# Half the machine to the two nodes: CFS runs the groups in turns within each period on the
# cores they share, and a node gets its quota in full only with cores to spare (on 2 cores,
# 2 nodes of 1 core: the first node's step 0-20% slower with the second busy; 2 nodes of
# 0.5 core: within 5%).
CPUS = min(1.0, CORES / 4)
# the first node's training: LeNet on synthetic data, one thread a rank
STEP = ["-m", "ringnet.train", "--model", "lenet", "--dataset", "synthetic", "--no-eval",
        "--quiet", "--json"]


def start_cluster(state, nodes, cpus, link=None):
    """Start a cluster in folder ``state`` (links of rate ``link``; None: unshaped); (its
    Cluster, its RINGNET_SLURM_* settings)."""
    port, subnet, prefix = free_settings()
    state_env = {"RINGNET_SLURM_DIR": str(state), "RINGNET_SLURM_PORT": str(port)}
    env = dict(os.environ, **state_env)
    args = ["start", "--nodes", str(nodes), "--cpus-per-node", str(cpus), "--prefix", prefix,
            "--subnet", subnet] + (["--link", link] if link else [])
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
    # shaped as the 4-node benchmarks' clusters are (a rank on one node sends nothing)
    started, env = start_cluster(tmp_path_factory.mktemp("cpus") / "slurm", 2, CPUS, "1gbit")
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

def strays(name):
    """{pid: its cpu group} of the live processes in node ``name``'s network namespace that
    are not in the node's group. A process of a step that just ended can be listed in the
    namespace and gone from the group (exited, or a zombie, which the kernel takes out of
    its group): such a pid counts only if it still runs outside the group a moment later."""
    def outside():
        listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                text=True).stdout.split()
        found = {}
        for pid in {int(p) for p in listed} - group_pids(cpu_group(name)):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                with open(f"/proc/{pid}/cgroup") as f:
                    where = cpu_line(f.read())
            except (OSError, IndexError, AttributeError):
                continue                        # exited meanwhile
            if state not in "ZX" and where != f"/ringnet-{name}":
                found[pid] = where
        return found
    first = outside()
    if not first:
        return first
    time.sleep(1.0)
    return {pid: where for pid, where in outside().items() if pid in first}


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
        assert strays(name) == {}
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

def training(name, steps, ranks=1, *extra):
    """The srun command line of ``ranks`` tasks on node ``name`` training LeNet ``steps``
    steps (more than one rank: in the ring, delay 0)."""
    mode = ["--mode", "ring", "--delay", "0"] if ranks > 1 else []
    return ["srun", "-w", name, "-n", str(ranks), "--mpi=pmi2", sys.executable, *STEP, *mode,
            "--steps", str(steps), *extra]


# Each run of the first node's training alternates windows of this length with the other
# nodes' loops stopped and running: this machine's speed drifts by a fifth over seconds, so
# runs minutes apart (or even one after the other) compare the drift, and windows of half a
# second (fifty quota periods) set side by side within one run compare the neighbours.
WINDOW_S = 0.5
WARMUP_STEPS = 5                     # the first steps allocate: left out of either side


def loop_pids(names):
    """The busy loops' processes on nodes ``names`` (a BusyJob's tasks; not slurmstepd)."""
    return [pid for name in names
            for pid in running(group_pids(cpu_group(name)), b"while :; do :; done")]


def signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def window_steps(trace, switches):
    """The step times (ms) of rank 0 in ``trace``, by window: {window index: [ms, ...]}; a
    step counts where it starts and ends within one window. ``switches``: (perf_counter
    time, the loops running) at each window's start."""
    origin = trace["otherData"]["origin_s"]
    steps = sorted((e for e in trace["traceEvents"] if e.get("cat") == "step" and e["pid"] == 0),
                   key=lambda e: e["ts"])[WARMUP_STEPS:]
    times = [t for t, _ in switches] + [math.inf]
    windows = {}
    for e in steps:
        start, end = origin + e["ts"] / 1e6, origin + (e["ts"] + e["dur"]) / 1e6
        i = bisect.bisect_right(times, start) - 1
        if i >= 0 and end < times[i + 1]:
            windows.setdefault(i, []).append(e["dur"] / 1e3)
    return windows


def isolation(cluster, runs=3, steps=300, ranks=1):
    """The step of ``ranks`` ranks on the first node with the others idle and with every
    other node running a job of busy loops (twice the machine's cores on each), after one
    warm-up run: in each of ``runs`` trainings of ``steps`` steps the loops are stopped
    (SIGSTOP) and let run (SIGCONT) in turns of WINDOW_S, and the steps are sorted by window
    on the trace's timeline. Returns (each run's mean idle step, each run's mean busy step,
    cores used outside the nodes' groups meanwhile, the mean step of each idle window of 5
    steps or more: the machine's own drift over seconds)."""
    first, others = cluster.names[0], cluster.names[1:]
    warm = cluster.run(training(first, 10, ranks), timeout=300)    # the files read once
    assert warm.returncode == 0, warm.stderr[-3000:]
    idle, busy, drift = [], [], []
    burners, loops = [], []
    try:
        for name in others:
            burners.append(BusyJob(cluster, name, 2 * CORES))
        end = time.monotonic() + 30
        while len(loops) < 2 * CORES * len(others) and time.monotonic() < end:
            time.sleep(0.2)             # slurmstepd starts the job's tasks one by one
            loops = loop_pids(others)
        assert len(loops) == 2 * CORES * len(others), f"busy loops found: {loops}"
        outside_start = busy_seconds() - sum(usage_s(n) for n in cluster.names)
        wall_start = time.monotonic()
        with tempfile.TemporaryDirectory() as folder:
            for run in range(runs):
                path = os.path.join(folder, f"run{run}.json")
                signal_all(loops, signal.SIGSTOP)
                proc = subprocess.Popen(training(first, steps, ranks, "--trace", path),
                                        env=cluster.env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
                switches, running = [(time.perf_counter(), False)], False
                deadline = time.monotonic() + 300
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(max(0.0, switches[-1][0] + WINDOW_S - time.perf_counter()))
                    running = not running
                    signal_all(loops, signal.SIGCONT if running else signal.SIGSTOP)
                    switches.append((time.perf_counter(), running))
                if proc.poll() is None:
                    proc.kill()
                out, err = proc.communicate()
                assert proc.returncode == 0, err[-3000:]
                with open(path) as f:
                    windows = window_steps(json.load(f), switches)
                stopped = [t for i, ts in windows.items() if not switches[i][1] for t in ts]
                running_steps = [t for i, ts in windows.items() if switches[i][1] for t in ts]
                drift += [statistics.mean(ts) for i, ts in windows.items()
                          if not switches[i][1] and len(ts) >= 5]
                assert len(stopped) >= 10 and len(running_steps) >= 10, \
                    f"steps within the windows: {len(stopped)} idle, {len(running_steps)} busy"
                idle.append(statistics.mean(stopped))
                busy.append(statistics.mean(running_steps))
        outside = busy_seconds() - sum(usage_s(n) for n in cluster.names) - outside_start
        return idle, busy, outside / (time.monotonic() - wall_start), drift
    finally:
        signal_all(loops, signal.SIGCONT)
        for burner in burners:
            burner.stop()


def busy_over_idle(idle, busy):
    """The median of each run's busy step over its idle one (windows of one run alternate
    every WINDOW_S: what changes on the machine meanwhile falls on both)."""
    return statistics.median(b / i for i, b in zip(idle, busy))


@pytest.mark.alone
def test_a_step_on_one_node_takes_as_long_when_the_other_is_busy(cluster):
    idle, busy, outside, _ = isolation(cluster)
    # Processes outside the cluster (another program on this machine) compete with the
    # node's task once they and the busy node take more than the cores the cluster leaves:
    # the comparison then says nothing about the quota.
    spare = CORES - 2 * CPUS
    if outside > spare / 2:
        pytest.skip(f"this machine is not quiet: {outside:.2f} cores used outside the "
                    f"cluster during the runs, of {spare:g} the cluster leaves (idle {idle}, "
                    f"busy {busy} ms)")
    ratio = busy_over_idle(idle, busy)
    assert 0.9 <= ratio <= 1.1, f"busy / idle {ratio:.3f}: idle {idle}, busy {busy} ms"


# -- what a run spent of its node's quota ---------------------------------------------------

def test_train_reports_the_cpu_its_node_spent_over_the_loop(cluster):
    name = cluster.names[0]
    before = usage_s(name)
    run = cluster.run(training(name, 60))
    used = usage_s(name) - before
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    got, loop = summary["group_cpu_s"], summary["train_s"]
    # the loop's part of what the node's group used around the whole job (start-up and
    # exit outside it), at least the training thread's own compute in the loop
    assert summary["compute_cpu_s"] <= got <= used + 0.01, (got, used, summary["compute_cpu_s"])
    # a busy rank spends its node's budget, and no more: about C cores over the loop
    assert 0.3 * CPUS <= got / loop <= 1.1 * CPUS + 0.02, f"{got:.3f} s of CPU in {loop:.3f} s"


# -- a held node's acknowledgements ---------------------------------------------------------

def tcp_counters(name):
    """Node ``name``'s TCP counters: the TcpExt lines of /proc/net/netstat in its namespace."""
    text = subprocess.run(["ip", "netns", "exec", name, "cat", "/proc/net/netstat"],
                          capture_output=True, text=True, timeout=30, check=True).stdout
    lines = text.splitlines()
    for head, values in zip(lines[::2], lines[1::2]):
        if head.startswith("TcpExt:"):
            return dict(zip(head.split()[1:], map(int, values.split()[1:])))
    raise AssertionError(f"no TcpExt counters in node {name}'s /proc/net/netstat")


def node_route(name):
    """Node ``name``'s route to the cluster's subnet, as ``ip route`` prints it."""
    return subprocess.run(["ip", "-n", name, "-4", "route", "show", "dev", "eth0"],
                          capture_output=True, text=True, timeout=30, check=True).stdout.strip()


def acknowledge_at_once(cluster, on):
    """Set (or clear) ``quickack`` on every node's route, the rest of the route as it is."""
    for name in cluster.names:
        words = node_route(name).split()
        if "quickack" in words:
            del words[words.index("quickack"):words.index("quickack") + 2]
        words = [w for w in words if w != "linkdown"]
        subprocess.run(["ip", "-n", name, "route", "replace", *words, "dev", "eth0",
                        "quickack", str(int(on))], check=True, timeout=30)


def loss_probes(cluster, steps):
    """The TCP loss probes both nodes sent while split-fc trained LeNet ``steps`` steps across
    them, one rank a node."""
    before = [tcp_counters(name)["TCPLossProbes"] for name in cluster.names]
    run = cluster.run(["srun", "-N", "2", "--ntasks-per-node", "1", "--mpi=pmi2",
                       sys.executable, *STEP, "--mode", "split-fc", "--steps", str(steps)])
    assert run.returncode == 0, run.stderr[-2000:]
    return sum(tcp_counters(name)["TCPLossProbes"] - b for name, b in zip(cluster.names, before))


def test_a_held_node_acknowledges_at_once(cluster):
    """A node held by its quota would send a delayed acknowledgement only when it runs again,
    milliseconds later, past the sender's loss-probe timeout: the sender probes, and the
    exchange stalls for tens of milliseconds now and then (on a node with cores of its own,
    none of this). Each node's route acknowledges at once (``quickack 1``): split-fc's
    exchanges across the 1 Gbit/s link then send no loss probes (at most a quarter of what
    the same run sends with delayed acknowledgements, one every few dozen steps here)."""
    for name in cluster.names:
        assert "quickack 1" in node_route(name), node_route(name)
    steps = 500
    quick = loss_probes(cluster, steps)
    try:
        acknowledge_at_once(cluster, False)
        delayed = loss_probes(cluster, steps)
    finally:
        acknowledge_at_once(cluster, True)
    assert all("quickack 1" in node_route(name) for name in cluster.names)
    if delayed < 8:
        pytest.skip(f"with delayed acknowledgements the nodes sent {delayed} loss probes in "
                    f"{steps} steps ({quick} acknowledging at once): nodes of {CPUS:g} core "
                    "are not held long enough here to compare")
    assert quick <= delayed / 4, f"{quick} loss probes acknowledging at once, " \
        f"{delayed} with delayed acknowledgements, in {steps} steps"


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
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=1, help="ranks on the first node")
    args = parser.parse_args()
    why = missing_for_a_cluster()
    if why:
        sys.exit(f"no cluster here: {why}")
    with tempfile.TemporaryDirectory() as folder:
        started, env = start_cluster(os.path.join(folder, "slurm"), args.nodes, args.cpus_per_node)
        try:
            idle, busy, outside, drift = isolation(started, args.runs, args.steps,
                                                   args.ranks)
        finally:
            script("stop", env=env)
    a, b = statistics.median(idle), statistics.median(busy)
    ratio = busy_over_idle(idle, busy)
    print(f"{args.nodes} nodes of {args.cpus_per_node:g} core(s) on {CORES} cores: the LeNet "
          f"step of {args.ranks} rank(s) on the first node, {args.runs} runs of "
          f"{args.steps} steps, the other nodes' loops stopped and running in turns of "
          f"{WINDOW_S:g} s")
    print(f"  other nodes idle: {a:.1f} ms  ({', '.join(f'{x:.1f}' for x in idle)})")
    print(f"  other nodes busy: {b:.1f} ms  ({', '.join(f'{x:.1f}' for x in busy)})")
    print(f"  busy / idle, the median of the runs' ratios: {ratio:.3f} "
          f"({(ratio - 1) * 100:+.1f}%)")
    print(f"  CPU used outside the cluster meanwhile: {outside:.2f} cores")
    print(f"  the idle windows' mean steps, {WINDOW_S:g} s each: {min(drift):.1f} to "
          f"{max(drift):.1f} ms (the machine's own drift)")


if __name__ == "__main__":
    main()
