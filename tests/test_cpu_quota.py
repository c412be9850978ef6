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
