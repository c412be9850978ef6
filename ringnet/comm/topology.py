"""The machine the ranks run on: the cores a node's ranks share, whether it is crowded
(more ranks than cores), and how long a rank polls a pending message before yielding."""
import os

__all__ = ["node_cores", "crowded", "lean_spins", "LEAN_SPINS", "OVERSUBSCRIBED_SPINS"]

# Polls of MPI_Testall before a wait is handed to the transport (which yields the core,
# then sleeps, and raises CommTimeoutError at its deadline). A small message completes
# within a few polls while every rank has a core. Where the launcher put more ranks on
# the node than they have cores (:func:`node_cores`), the awaited peer is usually descheduled,
# and polling only delays it: yield after OVERSUBSCRIBED_SPINS (measured with 3 and 4
# ranks on 2 cores: 64 polls 0.30-0.46x native at 8 B, 2 polls 0.57-0.95x).
LEAN_SPINS = 64
OVERSUBSCRIBED_SPINS = 2


def node_cores():
    """The cores the node's ranks share: this process's CPU affinity, or, where the launcher
    bound it to a single core (each rank to its own), the machine's."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = 0
    return affinity if affinity > 1 else (os.cpu_count() or 1)


def crowded(ranks_here=None, cores=None):
    """Whether this node holds more ranks (``local_ranks_on_node``) than cores
    (:func:`node_cores`)."""
    from ringnet.blas import local_ranks_on_node
    if ranks_here is None:
        ranks_here = local_ranks_on_node()
    if cores is None:
        cores = node_cores()
    return ranks_here > cores


def lean_spins(ranks_here=None, cores=None):
    """Testall polls before yielding: LEAN_SPINS while each of the node's ranks has a core,
    else OVERSUBSCRIBED_SPINS (:func:`crowded`)."""
    return OVERSUBSCRIBED_SPINS if crowded(ranks_here, cores) else LEAN_SPINS
