"""ringnet.hosts: the job's nodes read from its launcher, the probe after a failure, and the
launcher relaunching on the nodes that answered.

The launcher's own commands are faked here (a stand-in ``mpirun`` that records what it was
asked); tests/hpc/test_cluster_node_loss.py does the same with real nodes that fail.
"""
import json
import os
import subprocess
import sys

from ringnet.hosts import JobNodes, hydra_hosts
from ringnet.launch import Launcher


class _Out:
    def __init__(self, returncode=0, stdout="", stderr=""):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def test_hydra_hosts_from_the_command_a_file_or_the_environment(tmp_path):
    assert hydra_hosts(["mpirun", "-hosts", "a,b:2", "-ppn", "2"], {}) == (
        ["mpirun", "-ppn", "2"], ["a", "b"])
    assert hydra_hosts(["mpiexec", "--host=c,d"], {})[1] == ["c", "d"]
    hosts = tmp_path / "hosts"
    hosts.write_text("# the nodes\nn1:4\n\nn2  # second\n")
    assert hydra_hosts(["mpirun", "-f", str(hosts)], {}) == (["mpirun"], ["n1", "n2"])
    assert hydra_hosts(["mpirun"], {"HYDRA_HOST_FILE": str(hosts)})[1] == ["n1", "n2"]
    # the command's hosts win over the environment's; no hosts at all: unknown
    assert hydra_hosts(["mpirun", "-hosts", "x,y"], {"HYDRA_HOST_FILE": str(hosts)})[1] == ["x", "y"]
    assert hydra_hosts(["mpirun"], {})[1] is None
    assert hydra_hosts(["mpirun", "-f", str(tmp_path / "missing")], {})[1] is None


def test_job_nodes_of_an_allocation_and_of_mpirun():
    asked = []

    def scontrol(cmd, **kwargs):
        asked.append(cmd)
        return _Out(stdout="kn1\nkn2\nkn3\n")

    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "kn[1-3]", "SLURM_NTASKS_PER_NODE": "2"}
    nodes = JobNodes.of(["srun", "--mpi=pmi2"], 6, env, run=scontrol)
    assert (nodes.kind, nodes.names, nodes.per_node) == ("srun", ["kn1", "kn2", "kn3"], 2)
    assert asked == [["scontrol", "show", "hostnames", "kn[1-3]"]]
    assert nodes.on(["kn1", "kn3"]) == ["srun", "--mpi=pmi2", "--overlap", "--nodes=2",
                                        "--nodelist=kn1,kn3"]
    # srun outside an allocation, one node, another launcher: nothing to probe
    assert JobNodes.of(["srun"], 6, {}, run=scontrol) is None
    assert JobNodes.of(["srun"], 2, dict(env, SLURM_JOB_NODELIST="kn1"),
                       run=lambda *a, **k: _Out(stdout="kn1\n")) is None
    assert JobNodes.of(["mpirun", "-hosts", "a"], 2, {}) is None
    assert JobNodes.of(["launch-it", "-hosts", "a,b"], 2, {}) is None
    hydra = JobNodes.of(["mpirun", "-hosts", "a,b", "-ppn", "3"], 5, {})
    assert (hydra.kind, hydra.names, hydra.per_node) == ("hydra", ["a", "b"], 3)
    assert hydra.on(["b"]) == ["mpirun", "-ppn", "3", "-hosts", "b"]


def test_probe_keeps_the_nodes_that_answer_and_says_why_the_others_did_not():
    def run(cmd, timeout, **kwargs):
        node = cmd[cmd.index("-hosts") + 1]
        assert cmd[-3:] == ["-n", "1", "hostname"]
        if node == "b":
            return _Out(255, stderr="[proxy:0@b] connect failed\nerror: unable to reach b\nbye\n")
        if node == "c":
            raise subprocess.TimeoutExpired(cmd, timeout)
        return _Out(0, stdout=node)

    nodes = JobNodes("hydra", ["mpirun"], ["a", "b", "c", "d"], 1, run=run)
    answering, why = nodes.probe(timeout=7)
    assert answering == ["a", "d"]
    assert why == {"b": "mpirun exit 255: error: unable to reach b",
                   "c": "no answer within 7 s"}


FAKE_MPIRUN = r"""#!{python}
import json, os, sys
args = sys.argv[1:]
hosts = args[args.index("-hosts") + 1] if "-hosts" in args else "all"
if args[-1] == "hostname":                    # a probe: node b is gone
    sys.exit(0 if hosts != "b" else 255)
log = os.path.join({folder!r}, "jobs")
with open(log, "a") as f:
    f.write(json.dumps(args) + "\n")
with open(log) as f:
    first = len(f.readlines()) == 1
sys.exit(1 if first else 0)                   # the first job fails, its relaunch succeeds
"""


def test_the_launcher_relaunches_on_the_nodes_that_answer(tmp_path, capsys):
    fake = tmp_path / "mpirun"
    fake.write_text(FAKE_MPIRUN.format(python=sys.executable, folder=str(tmp_path)))
    fake.chmod(0o755)
    launch_cmd = [str(fake), "-hosts", "a,b", "-ppn", "2"]
    launcher = Launcher(4, ["--steps", "10"], launch_cmd=launch_cmd, batch_size=64,
                        nodes=JobNodes.of(launch_cmd, 4, {}), env=dict(os.environ))
    assert launcher.run() == 0
    jobs = [json.loads(line) for line in (tmp_path / "jobs").read_text().splitlines()]
    assert len(jobs) == 2
    # the first launch as given; the relaunch on node a alone, with the ranks a held
    assert jobs[0][:6] == ["-hosts", "a,b", "-ppn", "2", "-np", "4"]
    assert jobs[1][:6] == ["-ppn", "2", "-hosts", "a", "-np", "2"]
    err = capsys.readouterr().err
    assert "node b does not answer (mpirun exit 255): relaunching without it" in err
    assert "relaunch 1 of 3 on 2 rank(s) on node(s) a from the start" in err


def test_no_node_answering_ends_the_launcher(tmp_path, capsys):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\nexit 9\n")
    fake.chmod(0o755)
    launch_cmd = [str(fake), "-hosts", "a,b"]
    launcher = Launcher(2, [], launch_cmd=launch_cmd, batch_size=64,
                        nodes=JobNodes.of(launch_cmd, 2, {}), env=dict(os.environ))
    assert launcher.run() == 9
    assert len(launcher.attempts) == 1
    assert "no node of the job answers: not relaunching" in capsys.readouterr().err
