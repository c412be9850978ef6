"""Where the ranks run: links per hop, ranks per node, CPU contention (:class:`System`)."""
import dataclasses
import math

from ringnet.perfmodel.compute import ComputeProfile
from ringnet.perfmodel.links import Link, tbf_burst_bytes

__all__ = ["System", "scheduling_wait", "usable_cores"]


@dataclasses.dataclass
class System:
    """Where the ranks run: links per hop, ranks per node, and CPU contention.

    ``cores`` is None for GPUs (compute and transfers do not share a core). On a CPU
    machine (profile ``local``) it is the cores the job's ranks get: N / (the calibration's
    compute with all N ranks busy against one alone, timed with waits that sleep), so on a
    quiet machine the cores of its CPU affinity, and on a shared one what the load leaves
    (records of the older worker, whose waits spun, use the affinity). Ranks beyond them
    share them: each rank's compute takes N / cores times as long (a rank whose stream
    sleeps, as with driven progress, keeps one busy thread);
    ``steal`` is the fraction of its rank's core a polling delay-1 exchange takes while it
    runs, and ``rate`` the fraction of its blocking speed that exchange makes meanwhile
    (measured; ``calibrated`` holds them per calibrated N). ``imbalance`` (per model, only
    where every rank has a core): the slowest rank's step against the ranks' mean, step by
    step with all ranks busy; a delay-0 step ends with its slowest rank.

    ``quota`` (local, calibrated on nodes held to a CFS quota under a core, one rank a
    node): the cores each node's quota grants, of each ``quota_period_s``. Such a node runs
    a thread at a full core's speed while the period's budget lasts and holds it once it is
    spent, so a step whose rank waits for the network computes faster than a busy one (for
    one period's budget: ``held_after_s`` and ``held_rate`` say from when and at what share
    of a core its compute runs after, ``held_burst`` at what share before: below 1 where
    the nodes outnumber the CPUs of the machine they share and compute at once), and no
    step is shorter than its CPU time over the quota
    (:func:`ringnet.perfmodel.prediction.predict`).
    That CPU time counts what the step's transfers cost the rank's process, per message and
    per byte it sends, as the calibration measured them: ``cpu_blocking`` on the training
    thread's blocking waits (split-fc's activations), ``cpu_stream`` on the stream's thread.
    ``delayed_rate`` (per model, where the calibration timed it): the rate of a delayed
    exchange beside one step of the model on such a node, which the delayed step prices
    instead of ``rate`` (measured beside compute back to back).
    """
    name: str
    intra: Link
    inter: Link
    ranks_per_node: int
    compute: ComputeProfile
    cores: float = None
    steal: float = 0.0
    rate: float = 1.0
    rooted_rate: dict = None         # local: route ("tree", "master") -> the rate of its reduce
    #                                  + broadcast beside compute, where measured (else ``rate``)
    rooted: dict = None              # local: mode -> Link calibrated on that communicator
    calibrated: dict = None
    ranks_here: int = 1              # ranks of this job on one node (set per prediction)
    model_cores: dict = None         # local: model -> cores measured with its own step
    wait_s: float = 0.0              # a step's first wait for peers descheduled (N > cores)
    imbalance: dict = None           # local, a core per rank: model -> slowest rank's step / mean
    msg_wait_s: float = 0.0          # each blocking message's wait for them
    placed_per_node: int = None      # local on a cluster: the ranks per node as placed
    links_per_node: int = None       # links between nodes per node (None: one per rank)
    node_link: Link = None           # local on a cluster: the link within one node, calibrated
    #                                  with the ranks on one node (the hierarchical exchange's)
    quota: float = None              # local: a node's CFS quota in cores, where under one
    quota_period_s: float = None     # ... and the period it is a share of
    held_after_s: float = None       # a step's compute runs at a full core's speed this long,
    held_rate: float = None          # ... and at this share of it after (a quota's budget spent)
    held_burst: float = 1.0          # ... and at this share of it before (a machine's CPUs shared)
    cpu_blocking: dict = None        # local: CPU a blocking transfer costs its rank's process
    cpu_stream: dict = None          # ... and one on the stream's thread ({"per_msg_s",
    #                                  "per_byte_s"}: per message and per byte sent)
    polls: dict = None               # local: a wait's sleeping poll ({"cpu_s", "extra_s"})
    hosts: dict = None               # local: {"hosts": machines the ranks ran on, "cpus": each's}
    delayed_rate: dict = None        # local under a quota: model -> the rate of its delayed
    #                                  exchange beside one step of it, as training runs it
    as_run: bool = False             # the compute profile taken at the speed a run's own
    #                                  CPU time showed, which counts the contention it met

    def hop(self, a, b):
        """Return the Link between ranks a and b (ranks fill nodes in order)."""
        same = a // self.ranks_per_node == b // self.ranks_per_node
        return self.intra if same else self.inter

    def link_of(self, n):
        """Return the Link a collective over N ranks waits on: within a node while the N
        ranks fit on one (ranks fill nodes in order), else between nodes."""
        return self.intra if n <= self.ranks_per_node else self.inter

    def at(self, n):
        """Return the system an N-rank job sees (local: the calibration nearest N)."""
        if not self.calibrated:
            return self
        near = min(self.calibrated, key=lambda k: (abs(math.log2(k) - math.log2(max(n, 1))), k))
        c = self.calibrated[near]
        shaped = c.get("raw", {}).get("placement", {}).get("shaped")
        link = Link(f"local@{near}", c["alpha_s"], c["beta_Bps"], "calibrated here",
                    burst_bytes=tbf_burst_bytes(shaped) if shaped else 0.0)
        rooted = {mode: Link(f"local-{mode}@{near}", v["alpha_s"], v["beta_Bps"], "calibrated here",
                             burst_bytes=link.burst_bytes)
                  for mode, v in c.get("rooted", {}).items()}
        # ranks beyond the cores: a blocking wait finds its peer descheduled (the slices the
        # calibration measured, scaled to this N by the closed form); each message likewise
        # (on a cluster: the cores of every node the ranks span, cores_total)
        cores_here = c.get("cores_total") or c.get("raw", {}).get("cores") or usable_cores()
        wait = scheduling_wait(n, cores_here, c.get("slice_s", 0.0))
        per_msg = scheduling_wait(n, cores_here, c.get("msg_slice_s", 0.0))
        return dataclasses.replace(self, intra=link, inter=link, rate=c["rate"], rooted=rooted,
                                   rooted_rate=c.get("rooted_rate") or None,
                                   node_link=self._node_link(),
                                   cores=c.get("cores") or usable_cores(), steal=c["steal"],
                                   model_cores=c.get("model_cores") or None, wait_s=wait,
                                   imbalance=(c.get("imbalance") or None) if n <= cores_here
                                   else None,
                                   msg_wait_s=per_msg, quota=c.get("quota"),
                                   quota_period_s=c.get("quota_period_s"),
                                   cpu_blocking=c.get("cpu_blocking"),
                                   cpu_stream=c.get("cpu_stream"),
                                   delayed_rate=c.get("delayed_rate") or None,
                                   polls=c.get("polls"), hosts=c.get("hosts"))

    def _node_link(self):
        """Local on a cluster with several ranks a node: the link the calibration measured
        with its ranks all on one node (the largest such N), or None."""
        per_node = self.placed_per_node or 1
        one_node = [k for k in self.calibrated if 1 < k <= per_node]
        if not one_node:
            return None
        c = self.calibrated[max(one_node)]
        return Link(f"local-node@{max(one_node)}", c["alpha_s"], c["beta_Bps"], "calibrated here")

    def layout(self):
        """The system the hierarchical exchange sees: local on a cluster, the ranks in blocks
        of the placement, the link within a node the one calibrated on one node, and between
        nodes the one calibrated across them, one a node (the calibration's flat ring put
        one flow on each node's link; a node's channels share it, as its ranks share one
        network interface on hpc/cluster.sh's nodes and most CPU clusters). Else the
        system itself."""
        if self.node_link is None:
            return self
        return dataclasses.replace(self, ranks_per_node=self.placed_per_node, intra=self.node_link,
                                   links_per_node=1)

    def contention(self, n, model=None):
        """Return the compute slowdown of N ranks busy at once on this node: max(1, N / cores),
        ``cores`` measured with ``model``'s own step where the calibration timed it; 1 where
        the profile is taken at a run's own speed (``as_run``), which already counts it."""
        if self.cores is None or self.as_run:
            return 1.0
        cores = (self.model_cores or {}).get(model) or self.cores
        return max(1.0, min(n, self.ranks_per_node) / cores)


def scheduling_wait(n, cores, slice_s):
    """Mean wait of a rank that blocks on a peer when N busy ranks share ``cores`` cores.

    Round robin with time slices ``slice_s``: a peer runs a share cores/N of the time and
    is otherwise off for (N/cores - 1) slices; met at a random moment it is off with
    probability 1 - cores/N, for half an off period on average:
    (1 - cores/N) (N/cores - 1) slice / 2. Zero while every rank has a core (N <= cores;
    GPUs, cluster nodes with a core per rank).
    """
    if not cores or n <= cores or not slice_s:
        return 0.0
    return (1 - cores / n) * (n / cores - 1) * slice_s / 2


def usable_cores():
    """The cores the job's ranks on this node share: this process's CPU affinity, or the
    machine's cores where the launcher bound each rank to one of its own
    (:func:`ringnet.placement.node_cores`)."""
    from ringnet.placement import node_cores
    return node_cores()
