"""hpc/cluster.sh with --nodes K: the cluster it makes, what stop leaves, and bad input.

A cluster is started here in a temporary folder with its own node names, addresses and
port, so it runs beside any other (CI's single node included). Checked against the
system's own view, not the script's: the namespaces (`ip netns`), the addresses and host
names inside them, each node's route (`ip route`: quick acknowledgements), the tbf on both
ends of each link (`tc`), each node's control group and its CPU quota (the cgroup files),
SLURM's nodes (`srun hostname`), mpirun through the cluster's launcher, and, after stop,
that no namespace, link, mount, control group, daemon or file of it is left. Each bad
input is one line, a non-zero exit, and nothing made.
Starting a cluster needs root and SLURM; those tests skip saying why.
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from test_cluster_runs import (CLUSTER, ROOT, free_settings, long_folder, missing_for_a_cluster,
                               parse_env, running, script, socket_room)

WHY_NOT = missing_for_a_cluster()
needs_a_cluster = pytest.mark.skipif(WHY_NOT is not None, reason=f"no cluster here: {WHY_NOT}")


def snapshot(state):
    """What a start could leave behind: links, namespaces, mounts, processes, files, control
    groups."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    with open("/proc/mounts") as f:
        mounts = sorted(l for l in f if str(state) in l)
    procs = running([pid for pid in os.listdir("/proc") if pid.isdigit()], str(state).encode())
    files = sorted(os.path.join(d, n) for d, dirs, names in os.walk(state) for n in dirs + names) \
        if os.path.exists(state) else None
    return {"links": sorted(l.split(":")[1].strip().split("@")[0] for l in links.splitlines()),
            "netns": sorted(netns.split()), "mounts": mounts, "procs": sorted(procs),
            "files": files, "run-netns": os.path.isdir("/run/netns"), "cgroups": cgroups()}


def cgroups():
    """The nodes' control groups on this machine (cgroup v1 hierarchies, or v2's root)."""
    return sorted(glob.glob("/sys/fs/cgroup/*/ringnet-*") + glob.glob("/sys/fs/cgroup/ringnet-*"))


def cpu_group(name):
    """Node ``name``'s group of the cpu controller (v1's cpu hierarchy, or v2)."""
    for path in (f"/sys/fs/cgroup/cpu/ringnet-{name}", f"/sys/fs/cgroup/cpu,cpuacct/ringnet-{name}",
                 f"/sys/fs/cgroup/ringnet-{name}"):
        if os.path.isdir(path):
            return path
    raise AssertionError(f"no control group of node {name}: {cgroups()}")


def quota_of(group):
    """(quota, period) in microseconds, from the group's own files."""
    if os.path.exists(f"{group}/cpu.max"):
        with open(f"{group}/cpu.max") as f:
            quota, period = f.read().split()
        return int(quota), int(period)
    with open(f"{group}/cpu.cfs_quota_us") as q, open(f"{group}/cpu.cfs_period_us") as p:
        return int(q.read()), int(p.read())


def group_pids(group):
    with open(f"{group}/cgroup.procs") as f:
        return {int(pid) for pid in f.read().split()}


@pytest.fixture
def settings(tmp_path):
    port, subnet, prefix = free_settings()
    state = tmp_path / "state"
    env = dict(os.environ, RINGNET_SLURM_DIR=str(state), RINGNET_SLURM_PORT=str(port))
    return {"env": env, "state": state, "port": port, "subnet": subnet, "prefix": prefix,
            "base": subnet.rsplit(".", 1)[0]}


def one_line_error(proc, code=2):
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("hpc/cluster.sh: "), proc.stderr
    assert proc.stdout == "", proc.stdout
    return lines[0]


def _start(s, *extra):
    return script("start", "--prefix", s["prefix"], "--subnet", s["subnet"], *extra, env=s["env"])


# -- bad input: one line, a non-zero exit, nothing made ------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--nodes", "0"], "--nodes 0: give 1 or more nodes"),
    (["--nodes", "two"], "--nodes two: give a whole number"),
    (["--nodes", "254"], "--nodes 254: at most 253 nodes fit in"),
    (["--link", "1gbit"], "--link 1gbit shapes the links between nodes: give --nodes 2 or more"),
    (["--nodes", "2", "--prefix", "Node_"], "--prefix Node_: 1 to 8 lower-case letters"),
    (["--nodes", "2", "--subnet", "8.8.8.0/24"], "--subnet 8.8.8.0/24: give a private /24"),
    (["--nodes", "2", "--colour", "red"], "start: unknown option --colour"),
    (["--nodes", "2", "--cpus-per-node", "0"], "--cpus-per-node 0: give more than 0 cores"),
    (["--nodes", "2", "--cpus-per-node", "0.000"], "--cpus-per-node 0.000: give more than 0 cores"),
    (["--nodes", "2", "--cpus-per-node", "-1"], "--cpus-per-node -1: give a number of cores"),
    (["--nodes", "2", "--cpus-per-node", "half"], "--cpus-per-node half: give a number of cores"),
    (["--nodes", "2", "--cpus-per-node", "1e-1"], "--cpus-per-node 1e-1: give a number of cores"),
    (["--nodes", "2", "--cpus-per-node", "0.0001"],
     "--cpus-per-node 0.0001: give 0.001 cores or more"),
    (["--nodes", "2", "--cpus-per-node", str(len(os.sched_getaffinity(0)))],
     f"--cpus-per-node {len(os.sched_getaffinity(0))}: 2 nodes of {len(os.sched_getaffinity(0))} "
     f"cores are {2 * len(os.sched_getaffinity(0))} cores, more than this machine's "
     f"{len(os.sched_getaffinity(0))}"),
    (["--cpus-per-node", "1"],
     "--cpus-per-node 1 gives each node of a cluster its own cores: give --nodes 2 or more"),
    (["--nodes", "2", "--cpu-period", "999"],
     "--cpu-period 999: give the quota's period in microseconds, 1000 to 1000000"),
    (["--nodes", "2", "--cpu-period", "1000001"],
     "--cpu-period 1000001: give the quota's period in microseconds, 1000 to 1000000"),
    (["--nodes", "2", "--cpu-period", "2ms"],
     "--cpu-period 2ms: give the quota's period in microseconds, 1000 to 1000000"),
    (["--nodes", "2", "--cpus-per-node", "0.5", "--cpu-period", "1000"],
     "--cpu-period 1000: 0.5 cores of it are less than 1 ms; give a longer period"),
    (["--cpu-period", "2000"],
     "--cpu-period 2000 sets the period of the nodes' CPU quota: give --nodes 2 or more"),
])
def test_bad_values_are_one_line_and_make_nothing(settings, args, needle):
    before = snapshot(settings["state"])
    proc = script("start", *args, env=settings["env"])
    assert needle in one_line_error(proc)
    assert snapshot(settings["state"]) == before


@needs_a_cluster
def test_a_rate_tc_refuses_is_undone(settings):
    """tc refuses the rate only once the first link exists: start undoes what it made."""
    before = snapshot(settings["state"])
    line = one_line_error(_start(settings, "--nodes", "2", "--link", "fast"))
    assert "--link fast: tc refuses it" in line and "fast" in line.split("(", 1)[1], line
    assert snapshot(settings["state"]) == before


@needs_a_cluster
def test_a_daemon_that_does_not_start_is_undone(settings):
    """slurmctld refuses the configuration (a node of "lots" CPUs) once the nodes exist."""
    before = snapshot(settings["state"])
    settings["env"]["RINGNET_SLURM_CPUS"] = "lots"
    line = one_line_error(_start(settings, "--nodes", "2", "--link", "1gbit"))
    assert line.startswith("hpc/cluster.sh: slurmctld did not start (slurmctld: fatal:"), line
    assert snapshot(settings["state"]) == before


@needs_a_cluster
def test_a_node_named_as_this_machine_is_refused(settings):
    before = snapshot(settings["state"])
    clash = f"{settings['prefix']}2"
    proc = subprocess.run(["unshare", "--uts", "sh", "-c", f'hostname {clash} && exec bash "$0" "$@"',
                           CLUSTER, "start", "--nodes", "2", "--prefix", settings["prefix"],
                           "--subnet", settings["subnet"]],
                          capture_output=True, text=True, env=settings["env"], timeout=60)
    assert f"node name {clash} is this machine's host name" in one_line_error(proc)
    assert snapshot(settings["state"]) == before


@needs_a_cluster
def test_a_folder_too_long_for_the_nodes_sockets_is_refused(settings):
    """A node's batch-step socket, STATE/spool/NODE/NODE_<job id>.4294967291, would pass a
    Unix socket's 107 bytes: one line naming the longest folder that fits, and nothing
    made (the single node's bound, and that it is SLURM's: tests/hpc/test_cluster_jobs.py)."""
    node = f"{settings['prefix']}2"
    room = socket_room(f"spool/{node}", node)
    base, state = long_folder(room + 1)
    settings["env"]["RINGNET_SLURM_DIR"] = state
    try:
        before = snapshot(state)
        line = one_line_error(_start(settings, "--nodes", "2"))
        assert line.endswith(f"over the 107 of a Unix socket's path; choose a folder of at most "
                             f"{room} characters"), line
        assert f"{state}/spool/{settings['prefix']}1/" in line, line
        assert snapshot(state) == before
    finally:
        if os.path.exists(state):
            script("stop", env=settings["env"])
        shutil.rmtree(base)


def cpu_hierarchy():
    """Where the cpu controller's groups are made: v1's cpu hierarchy, else v2's root."""
    with open("/proc/mounts") as f:
        mounts = [line.split() for line in f]
    for _, where, kind, options, *_ in mounts:
        if kind == "cgroup" and "cpu" in options.split(","):
            return where
    return next(where for _, where, kind, *_ in mounts if kind == "cgroup2")


@needs_a_cluster
def test_without_a_cpu_controller_it_says_so(settings):
    """No hierarchy offers the cpu controller (every cgroup file system unmounted, in a mount
    namespace of the start's own): one line, and nothing made."""
    before = snapshot(settings["state"])
    unmount = ("awk '$3 == \"cgroup\" || $3 == \"cgroup2\" {print $2}' /proc/mounts | tac | "
               'while read -r m; do umount "$m" || exit 1; done && exec bash "$0" "$@"')
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", unmount,
                           CLUSTER, "start", "--nodes", "2", "--prefix", settings["prefix"],
                           "--subnet", settings["subnet"]],
                          capture_output=True, text=True, env=settings["env"], timeout=60)
    assert "no cpu controller to hold each node to its cores" in one_line_error(proc)
    assert snapshot(settings["state"]) == before


@needs_a_cluster
def test_a_control_group_taken_is_refused(settings):
    taken = os.path.join(cpu_hierarchy(), f"ringnet-{settings['prefix']}2")
    os.mkdir(taken)
    try:
        before = snapshot(settings["state"])
        line = one_line_error(_start(settings, "--nodes", "2"))
        assert f"control group {taken} exists already: choose another --prefix" in line, line
        assert snapshot(settings["state"]) == before
    finally:
        os.rmdir(taken)


def test_without_root_it_says_so(settings):
    args = ["start", "--nodes", "2", "--prefix", settings["prefix"], "--subnet", settings["subnet"]]
    if os.geteuid() == 0:
        # The checkout may sit where only root can enter (a clone in /root, a mktemp -d
        # folder): the unprivileged user runs a copy from a folder it can reach.
        reachable = tempfile.mkdtemp(prefix="ringnet-cluster-")
        try:
            os.chmod(reachable, 0o755)
            copy = os.path.join(reachable, "cluster.sh")
            shutil.copyfile(CLUSTER, copy)
            os.chmod(copy, 0o755)
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", copy, *args]
            before = snapshot(settings["state"])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=settings["env"],
                                  timeout=60, cwd=reachable)
        finally:
            shutil.rmtree(reachable)
    else:
        before = snapshot(settings["state"])
        proc = subprocess.run(["bash", CLUSTER, *args], capture_output=True, text=True,
                              env=settings["env"], timeout=60)
    assert "--nodes 2 needs root" in one_line_error(proc)
    assert snapshot(settings["state"]) == before


def test_stop_with_nothing_started_says_so(settings):
    before = snapshot(settings["state"])
    line = one_line_error(script("stop", env=settings["env"]), code=3)
    assert f"nothing to stop: no cluster runs in {settings['state']}" in line
    assert snapshot(settings["state"]) == before


# -- a cluster, checked from outside, and what stop leaves ---------------------------------

def _settled(state, limit=15.0):
    """The snapshot once two taken 0.5 s apart agree (a job's epilog ends on its own time)."""
    import time
    last, end = snapshot(state), time.monotonic() + limit
    while time.monotonic() < end:
        time.sleep(0.5)
        now = snapshot(state)
        if now == last:
            return now
        last = now
    return last


def _sh(*cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (cmd, proc.stderr)
    return proc.stdout


@needs_a_cluster
def test_start_makes_the_nodes_and_stop_removes_all_of_it(settings, tmp_path):
    s, k = settings, 3
    names = [f"{s['prefix']}{i}" for i in range(1, k + 1)]
    before = snapshot(s["state"])
    started = _start(s, "--nodes", str(k), "--link", "10gbit", "--cpu-period", "4000")
    assert started.returncode == 0, started.stderr
    try:
        assert started.stdout.startswith(f"SLURM running: {k} nodes {names[0]}..{names[-1]}")
        status = script("status", env=s["env"])
        assert status.returncode == 0, status.stdout + status.stderr
        state = s["state"]
        for i, name in enumerate(names):
            address = f"{s['base']}.{i + 2}"
            assert f"node {name}: address {address}, host name {name}, link {name}-h up " \
                "(tbf 10Gbit to the node, 10Gbit from it), slurmd running" in status.stdout, \
                status.stdout
            # the system's view of the node: its address, its host name, tbf on both ends
            assert f"inet {address}/24" in _sh("ip", "-n", name, "addr", "show", "dev", "eth0")
            # its route to the others acknowledges TCP data at once
            route = _sh("ip", "-n", name, "-4", "route", "show", "dev", "eth0")
            assert f"src {address} quickack 1" in route, route
            assert _sh("nsenter", f"--uts={state}/uts/{name}", "hostname").strip() == name
            for qdisc in (_sh("tc", "qdisc", "show", "dev", f"{name}-h"),
                          _sh("tc", "-n", name, "qdisc", "show", "dev", "eth0")):
                assert "tbf" in qdisc and "rate 10Gbit" in qdisc, qdisc
            assert f"{name}-h" in _sh("ip", "link", "show", "master", f"{s['prefix']}-br")
            # its control group: this machine's cores shared out (no --cpus-per-node) in
            # periods of --cpu-period, and every process in the node's namespace (its
            # slurmd) runs in it
            group = cpu_group(name)
            cores = len(os.sched_getaffinity(0))
            quota, period = quota_of(group)
            assert period == 4000 and abs(quota - cores / k * period) <= 1, (quota, period)
            in_netns = {int(p) for p in _sh("ip", "netns", "pids", name).split()}
            assert in_netns and in_netns <= group_pids(group), (in_netns, group_pids(group))
            assert f"CPU quota {quota / period:g} cores ({quota} of every 4000 us), " \
                in status.stdout
        env = dict(os.environ, **parse_env(script("env", env=s["env"]).stdout))
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])
        # SLURM runs a task on every node, each in its own namespace
        hosts = subprocess.run(["srun", "-N", str(k), "hostname"], capture_output=True,
                               text=True, env=env, timeout=120)
        assert hosts.returncode == 0, hosts.stderr
        assert sorted(hosts.stdout.split()) == names
        # mpirun reaches every node through the hosts file and the launcher env names
        hosts = subprocess.run(["mpirun", "-np", str(k), "hostname"], capture_output=True,
                               text=True, env=env, timeout=120, cwd=str(tmp_path))
        assert hosts.returncode == 0, hosts.stderr
        assert sorted(hosts.stdout.split()) == names
        assert env["MPIR_CVAR_CH4_NETMOD"] == "ofi" and env["MPIR_CVAR_NOLOCAL"] == "1"

        # taken already: this cluster's node names, its subnet, its port; and start twice
        # (the snapshot once the srun job's epilog, which runs after srun returns, is done)
        running = _settled(s["state"])
        other = dict(s["env"], RINGNET_SLURM_DIR=str(tmp_path / "other"),
                     RINGNET_SLURM_PORT=str(s["port"] + 2))
        clash = script("start", "--nodes", "2", "--prefix", s["prefix"], "--subnet",
                       "10.27.254.0/24", env=other)
        assert f"network namespace {names[0]} exists already" in one_line_error(clash)
        clash = script("start", "--nodes", "2", "--prefix", "rtzz", "--subnet", s["subnet"], env=other)
        assert f"--subnet {s['subnet']}: {s['prefix']}-br has an address in it" in one_line_error(clash)
        clash = script("start", "--nodes", "2", "--prefix", "rtzz", "--subnet", "10.27.254.0/24",
                       env=dict(other, RINGNET_SLURM_PORT=str(s["port"])))
        assert f"port {s['port']} is taken" in one_line_error(clash)
        again = _start(s, "--nodes", str(k))
        assert f"a {k}-node cluster already runs in {state}" in one_line_error(again)
        again = script("start", env=s["env"])
        assert f"a {k}-node cluster runs in {state}" in one_line_error(again)
        assert _settled(s["state"]) == running
        assert not os.path.exists(tmp_path / "other")
        assert script("status", env=s["env"]).returncode == 0
    finally:
        stopped = script("stop", env=s["env"])
    assert stopped.returncode == 0, stopped.stderr
    assert f"removed the {k}-node cluster" in stopped.stdout
    assert snapshot(s["state"]) == before
    assert script("status", env=s["env"]).returncode != 0
    one_line_error(script("stop", env=s["env"]), code=3)


@needs_a_cluster
def test_a_link_taken_down_shows_in_status(settings):
    s = settings
    started = _start(s, "--nodes", "2")
    assert started.returncode == 0, started.stderr
    try:
        link = f"{s['prefix']}2-h"
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        status = script("status", env=s["env"])
        assert status.returncode == 3
        assert f"link {link} down" in status.stdout and f"link {s['prefix']}1-h up" in status.stdout
        assert "tbf" not in status.stdout, "an unshaped cluster shows no rate"
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
        assert script("status", env=s["env"]).returncode == 0
    finally:
        assert script("stop", env=s["env"]).returncode == 0


@needs_a_cluster
def test_the_link_rate_bounds_a_transfer(settings, tmp_path):
    """4 MiB from a rank on one node to a rank on the other cannot take less than the
    bytes over the rate (less one burst of each of the two tbf it crosses)."""
    s = settings
    started = _start(s, "--nodes", "2", "--link", "200mbit")
    assert started.returncode == 0, started.stderr
    try:
        env = dict(os.environ, **parse_env(script("env", env=s["env"]).stdout))
        env = {k: v for k, v in env.items() if not k.startswith(("PMI_", "SLURM_JOB"))}
        program = tmp_path / "send.py"
        program.write_text(
            "import time, numpy as np\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
            "b = np.ones(1 << 20, np.float32)\nbest = 1e9\n"
            "for _ in range(3):\n    c.Barrier()\n    t = time.perf_counter()\n"
            "    if c.rank == 0:\n        c.Send(b, 1); c.Recv(b[:1], 1)\n"
            "    else:\n        c.Recv(b, 0); c.Send(b[:1], 0)\n"
            "    best = min(best, time.perf_counter() - t)\n"
            "if c.rank == 0:\n    print(best, MPI.Get_processor_name())\n")
        proc = subprocess.run(["mpirun", "-np", "2", sys.executable, str(program)],
                              capture_output=True, text=True, env=env, timeout=120,
                              cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        seconds, node = proc.stdout.split()
        assert node == f"{s['prefix']}1"
        burst = 256 * 1024         # each tbf lets a burst of 64 KiB pass at once; two of them
        assert float(seconds) >= (4 * 2 ** 20 - burst) * 8 / 200e6, seconds
    finally:
        assert script("stop", env=s["env"]).returncode == 0
