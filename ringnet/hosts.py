"""The nodes a job runs on, and which of them still answer after a failure.

``python -m ringnet.launch`` reads the job's nodes from its launcher: inside a SLURM
allocation (the launcher is ``srun``) the allocation's nodes (``SLURM_JOB_NODELIST``);
with MPICH's ``mpiexec``/``mpirun`` the hosts of ``-hosts``/``-host``, of a
``-f``/``-hostfile``/``-machinefile`` file, or of ``$HYDRA_HOST_FILE``. After a failure
it probes every node with that launcher: one task running ``hostname`` there, within
:data:`PROBE_TIMEOUT_S`. A node that does not answer (its processes died, its link is
down) is left out, and the job is relaunched on the nodes that answered, at most as
many ranks on each as the first launch placed there.
"""
import os
import re
import subprocess
import threading

from ringnet.placement import allocation_tasks_per_node

__all__ = ["JobNodes", "PROBE_TIMEOUT_S", "hydra_hosts", "slurm_tasks_alive"]

# Seconds a node has to run one task when probed. A node that lost its slurmd answers
# srun with an error in seconds; one behind a cut link may never answer.
PROBE_TIMEOUT_S = float(os.environ.get("RINGNET_PROBE_TIMEOUT", "30"))
# hydra options that name the hosts: (option, takes a file)
_HOST_OPTIONS = {"-hosts": False, "-host": False, "--host": False, "--hosts": False,
                 "-f": True, "-hostfile": True, "--hostfile": True, "-machinefile": True,
                 "--machinefile": True}


def slurm_tasks_alive(job_id, tasks_per_node, run=subprocess.run):
    """Return the tasks SLURM job ``job_id`` can still start (its nodes x tasks per node).

    After a node failure a job submitted with ``--no-kill`` keeps its other nodes; they
    are what ``scontrol show job`` lists once SLURM has marked the node down. None when
    that cannot be read.
    """
    try:
        out = run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True,
                  text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\bNumNodes=(\d+)", out.stdout or "")
    if out.returncode != 0 or not match:
        return None
    return int(match.group(1)) * tasks_per_node


def _read_host_file(path):
    """Host names of a hydra host file: ``host[:slots]`` per line, ``#`` comments."""
    hosts = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                hosts.append(line.split(":", 1)[0].split()[0])
    return hosts


def _hosts_or_none(read, source, strict):
    """``read(source)``'s hosts; None where the file cannot be read (``strict``: its OSError)."""
    try:
        return read(source)
    except OSError:
        if strict:
            raise
        return None


def _listed_hosts(value):
    return [h.split(":", 1)[0] for h in value.split(",") if h]


def hydra_hosts(launch_cmd, env, strict=False):
    """Return (the launcher without its host options, the hosts it names, or None).

    A host file that cannot be read gives None, or with ``strict`` raises its OSError."""
    base, hosts, words = [], None, list(launch_cmd)
    i = 0
    while i < len(words):
        word = words[i]
        option, eq, value = word.partition("=")
        if option in _HOST_OPTIONS:
            if not eq:
                if i + 1 >= len(words):
                    break
                value, i = words[i + 1], i + 1
            hosts = _hosts_or_none(_read_host_file if _HOST_OPTIONS[option] else _listed_hosts,
                                   value, strict)
        else:
            base.append(word)
        i += 1
    if hosts is None and env.get("HYDRA_HOST_FILE"):
        hosts = _hosts_or_none(_read_host_file, env["HYDRA_HOST_FILE"], strict)
    return base, hosts


def _slurm_nodes(env, run):
    """The allocation's node names (``scontrol show hostnames``), or None."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    try:
        out = run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                  timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    names = (out.stdout or "").split()
    return names if out.returncode == 0 and names else None


class JobNodes:
    """The nodes of a job and how to place a launch on some of them.

    ``kind`` is ``"srun"`` or ``"hydra"``; ``names`` the nodes of the first launch;
    ``per_node`` the most ranks the first launch put on one node.
    """

    def __init__(self, kind, launcher, names, per_node, run=subprocess.run):
        self.kind, self.launcher, self.names = kind, list(launcher), list(names)
        self.per_node, self._run = per_node, run

    @classmethod
    def of(cls, launch_cmd, ranks, env, run=subprocess.run):
        """Return the JobNodes of a job started by ``launch_cmd`` on ``ranks`` ranks, or None
        when its nodes cannot be known or it runs on one node."""
        name = os.path.basename(launch_cmd[0])
        if name == "srun":
            if not env.get("SLURM_JOB_ID"):
                return None
            names = _slurm_nodes(env, run)
            per_node = allocation_tasks_per_node(env)
            launcher = list(launch_cmd)
        elif name in ("mpiexec", "mpirun", "mpiexec.hydra"):
            launcher, names = hydra_hosts(launch_cmd, env)
            per_node = None
        else:
            return None
        if not names or len(names) < 2:
            return None
        per_node = per_node or -(-ranks // len(names))
        return cls("srun" if name == "srun" else "hydra", launcher, names, per_node, run)

    def on(self, names):
        """Return the launcher placing a job on ``names`` alone (the rank count is added later).

        srun: ``--overlap``, because the step that lost a node stays "completing" in SLURM,
        holding its CPUs, until the node is marked down.
        """
        if self.kind == "srun":
            return [*self.launcher, "--overlap", f"--nodes={len(names)}",
                    f"--nodelist={','.join(names)}"]
        return [*self.launcher, "-hosts", ",".join(names)]

    def _probe_command(self, node):
        if self.kind == "srun":
            return [*self.on([node]), "--ntasks=1", "hostname"]
        return [*self.on([node]), "-n", "1", "hostname"]

    def probe(self, names=None, timeout=None):
        """Run one task on every node of ``names`` (default all) at once; return
        ``(answering nodes in order, {node: why it did not answer})``."""
        names = list(self.names if names is None else names)
        timeout = PROBE_TIMEOUT_S if timeout is None else timeout
        why = {}

        def one(node):
            cmd = self._probe_command(node)
            try:
                out = self._run(cmd, capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                why[node] = f"no answer within {timeout:g} s"
                return
            except OSError as exc:
                why[node] = f"cannot run {cmd[0]}: {exc.strerror}"
                return
            if out.returncode != 0:
                lines = [line.strip() for line in (out.stderr or "").splitlines() if line.strip()]
                said = [line for line in lines if "error" in line.lower()] or lines
                why[node] = (f"{os.path.basename(cmd[0])} exit {out.returncode}"
                             + (f": {said[0]}" if said else ""))

        threads = [threading.Thread(target=one, args=(node,), daemon=True) for node in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [node for node in names if node not in why], why
