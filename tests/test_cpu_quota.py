"""placement.cpu_quota: the cores a CFS bandwidth quota leaves this process, read from a
made-up /proc/self/cgroup, mount table and cgroup folders (v1 and v2), against the
quota / period written there."""
import pytest

from ringnet import placement


def _v1(tmp_path, groups):
    """A cgroup v1 cpu hierarchy at tmp/cpu with ``groups`` {path: (quota, period)}; the
    process is in the deepest."""
    root = tmp_path / "cpu"
    for path, (quota, period) in groups.items():
        folder = root / path.strip("/") if path != "/" else root
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (folder / "cpu.cfs_period_us").write_text(f"{period}\n")
    deepest = max(groups, key=len)
    (tmp_path / "cgroup").write_text(f"4:memory:/x\n2:cpuacct:/\n1:cpu:{deepest}\n0::/\n")
    (tmp_path / "mounts").write_text(
        f"cgroup {root} cgroup rw,nosuid,nodev,noexec,relatime,cpu 0 0\n"
        f"cgroup {tmp_path / 'mem'} cgroup rw,memory 0 0\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "mounts")


def test_v1_quota_of_the_process_group(tmp_path):
    cgroup, mounts = _v1(tmp_path, {"/": (-1, 100000), "/ringnet-node1": (5000, 10000)})
    assert placement.cpu_quota(cgroup, mounts) == pytest.approx(0.5)


def test_v1_the_tightest_of_the_group_and_its_parents(tmp_path):
    cgroup, mounts = _v1(tmp_path, {"/": (-1, 100000), "/slurm": (15000, 10000),
                                    "/slurm/job_1": (-1, 100000)})
    assert placement.cpu_quota(cgroup, mounts) == pytest.approx(1.5)


def test_the_period_of_the_tightest_quota(tmp_path):
    """cpu_period_s: the period of the quota cpu_quota takes (v1 and v2), None without one."""
    cgroup, mounts = _v1(tmp_path / "a", {"/": (40000, 20000), "/ringnet-node1": (5000, 10000)})
    assert placement.cpu_period_s(cgroup, mounts) == pytest.approx(0.01)
    cgroup, mounts = _v1(tmp_path / "b", {"/": (10000, 20000), "/ringnet-node1": (-1, 10000)})
    assert placement.cpu_period_s(cgroup, mounts) == pytest.approx(0.02)
    cgroup, mounts = _v1(tmp_path / "c", {"/": (-1, 100000)})
    assert placement.cpu_period_s(cgroup, mounts) is None
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cpu.max").write_text("50000 100000\n")
    (tmp_path / "cgroup2").write_text("0::/\n")
    (tmp_path / "mounts2").write_text(f"cgroup2 {root} cgroup2 rw,nosuid 0 0\n")
    assert placement.cpu_period_s(str(tmp_path / "cgroup2"), str(tmp_path / "mounts2")) == \
        pytest.approx(0.1)


def test_v1_no_quota(tmp_path):
    cgroup, mounts = _v1(tmp_path, {"/": (-1, 100000)})
    assert placement.cpu_quota(cgroup, mounts) is None


def test_v2_cpu_max(tmp_path):
    root = tmp_path / "unified"
    (root / "job").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "job" / "cpu.max").write_text("250000 100000\n")
    (tmp_path / "cgroup").write_text("0::/job\n")
    (tmp_path / "mounts").write_text(f"cgroup2 {root} cgroup2 rw,nosuid 0 0\n")
    assert placement.cpu_quota(str(tmp_path / "cgroup"), str(tmp_path / "mounts")) == pytest.approx(2.5)
    (root / "job" / "cpu.max").write_text("max 100000\n")
    assert placement.cpu_quota(str(tmp_path / "cgroup"), str(tmp_path / "mounts")) is None


def test_unreadable_is_no_quota(tmp_path):
    assert placement.cpu_quota(str(tmp_path / "missing"), str(tmp_path / "missing")) is None
    (tmp_path / "cgroup").write_text("1:cpu:/a\n")
    (tmp_path / "mounts").write_text(f"cgroup {tmp_path / 'cpu'} cgroup rw,cpu 0 0\n")
    (tmp_path / "cpu" / "a").mkdir(parents=True)
    (tmp_path / "cpu" / "a" / "cpu.cfs_quota_us").write_text("garbage\n")
    assert placement.cpu_quota(str(tmp_path / "cgroup"), str(tmp_path / "mounts")) is None


def test_node_cores_follow_the_quota(monkeypatch):
    """A quota below the affinity lowers node_cores (a fraction counts as one core)."""
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: set(range(8)))
    for quota, cores in ((None, 8), (0.5, 1), (2.5, 2), (16.0, 8)):
        monkeypatch.setattr(placement, "cpu_quota", lambda q=quota: q)
        assert placement.node_cores() == cores


# -- placement.group_cpu_s: the CPU the process's control group used ------------------------

def test_v1_group_cpu_reads_the_process_s_cpuacct_group(tmp_path):
    # cpu and cpuacct mounted apart (hpc/cluster.sh's groups have the same path in both)
    for where, usage in (("cpuacct", "1500000000"), ("cpuacct/ringnet-node1", "2250000000")):
        (tmp_path / where).mkdir(parents=True, exist_ok=True)
        (tmp_path / where / "cpuacct.usage").write_text(usage + "\n")
    (tmp_path / "cgroup").write_text("4:memory:/x\n3:cpuacct:/ringnet-node1\n"
                                     "1:cpu:/ringnet-node1\n0::/\n")
    (tmp_path / "mounts").write_text(
        f"cgroup {tmp_path / 'cpu'} cgroup rw,cpu 0 0\n"
        f"cgroup {tmp_path / 'cpuacct'} cgroup rw,cpuacct 0 0\n"
        f"cgroup2 {tmp_path / 'unified'} cgroup2 rw 0 0\n")
    assert placement.group_cpu_s(str(tmp_path / "cgroup"),
                                 str(tmp_path / "mounts")) == pytest.approx(2.25)


def test_v1_group_cpu_with_cpu_and_cpuacct_mounted_together(tmp_path):
    (tmp_path / "cpu,cpuacct" / "job").mkdir(parents=True)
    (tmp_path / "cpu,cpuacct" / "job" / "cpuacct.usage").write_text("125000000\n")
    (tmp_path / "cgroup").write_text("2:cpu,cpuacct:/job\n")
    (tmp_path / "mounts").write_text(
        f"cgroup {tmp_path / 'cpu,cpuacct'} cgroup rw,nosuid,cpu,cpuacct 0 0\n")
    assert placement.group_cpu_s(str(tmp_path / "cgroup"),
                                 str(tmp_path / "mounts")) == pytest.approx(0.125)


def test_v2_group_cpu_reads_usage_usec(tmp_path):
    (tmp_path / "unified" / "job").mkdir(parents=True)
    (tmp_path / "unified" / "job" / "cpu.stat").write_text(
        "usage_usec 3500000\nuser_usec 3000000\nsystem_usec 500000\n")
    (tmp_path / "cgroup").write_text("0::/job\n")
    (tmp_path / "mounts").write_text(f"cgroup2 {tmp_path / 'unified'} cgroup2 rw 0 0\n")
    assert placement.group_cpu_s(str(tmp_path / "cgroup"),
                                 str(tmp_path / "mounts")) == pytest.approx(3.5)


def test_group_cpu_unreadable_is_none(tmp_path):
    assert placement.group_cpu_s(str(tmp_path / "missing"), str(tmp_path / "missing")) is None
    (tmp_path / "cgroup").write_text("3:cpuacct:/gone\n")
    (tmp_path / "mounts").write_text(f"cgroup {tmp_path / 'acct'} cgroup rw,cpuacct 0 0\n")
    assert placement.group_cpu_s(str(tmp_path / "cgroup"), str(tmp_path / "mounts")) is None
    (tmp_path / "acct" / "gone").mkdir(parents=True)
    (tmp_path / "acct" / "gone" / "cpuacct.usage").write_text("garbage\n")
    assert placement.group_cpu_s(str(tmp_path / "cgroup"), str(tmp_path / "mounts")) is None


def test_group_cpu_of_this_process_grows_with_its_work():
    # the real files, where this machine has them: the group's time over a busy loop is
    # at least the loop's own CPU time (the group holds this process, maybe more)
    import time
    first = placement.group_cpu_s()
    if first is None:
        pytest.skip("no readable cpuacct or cgroup v2 cpu.stat here")
    c0 = time.process_time()
    while time.process_time() - c0 < 0.2:
        pass
    spent = time.process_time() - c0
    assert placement.group_cpu_s() - first >= 0.95 * spent
