"""The one cost model of ringnet's exchanges: which of auto's all-reduce algorithms is fastest
for a message size and N (below), and what an exchange costs over a placement of ranks on
nodes, flat or hierarchical (:func:`exchange_cost`, :func:`between_nodes`: what
``--topology auto``, the multi-channel exchange's choice between nodes and ``bench model``
all price with).

Every algorithm is built from the transport's point-to-point calls, like the ring:

=========  ========================  ==========================  =====================
algorithm  messages (latency terms)  bytes sent by busiest rank  bytes it adds
=========  ========================  ==========================  =====================
rd         log2 p + 2f               (log2 p + 2f) n             (log2 p + f) n
direct     N-1 (in one round)        (N-1) n                     (N-1) n
rhd        2 log2 p + 2f             2 (p-1)/p n + 2f n          (p-1)/p n + f n
ring       2 (N-1)                   2 (N-1)/N n                 (N-1)/N n
native     as rhd (MPICH's own)      as rhd                      as rhd
=========  ========================  ==========================  =====================

``rd``: recursive doubling. ``direct``: every rank sends its buffer to every other rank
at once and sums all N in rank order (one round, but N-1 messages to post and poll).
``rhd``: recursive halving (reduce-scatter) then recursive doubling (all-gather). ``p`` is the largest power of two
<= N; when N is not one (f = 1), the first 2(N-p) ranks fold in pairs before and unfold
after. ``ring``: :class:`~ringnet.comm.ring.RingCommunicator`. The communicator that runs them is
:class:`~ringnet.comm.auto.AutoCommunicator`.

``native`` is the MPI library's own all-reduce (one blocking MPI_Allreduce). It is priced
as what MPICH runs for all but the smallest messages, recursive halving-doubling with the
fold, but in C: :data:`NATIVE_ALPHA` per message (no Python between messages) and
:data:`NATIVE_BETA` per byte sent or added (MPICH copies every byte through shared-memory
cells, and its large messages measured 1.2-2.8x slower than the lean ``rhd`` and ``ring``).
So the model delegates where its own messages cost more than MPI's whole call: at N = 2
(2 cores, quiet) native up to 8 B (:data:`NATIVE_TINY_BYTES`), rd up to 12 KB, native up
to 1.9 MB (MPI_Allreduce measured 1.5-2.2x the lean rd from 16 KB, where MPICH's
rendezvous starts), rhd from there; crowded (3 and 4 ranks
on 2 cores) native up to 570 KB at N = 3 and 5.1 MB at N = 4 (the lean algorithms measured
0.4-0.8x MPI_Allreduce below those sizes, 1.1-2.9x above).

The choice minimises the alpha-beta-gamma cost ``messages * ALPHA + sent * BETA +
added * GAMMA`` of the table (:func:`cost`). ALPHA is the cost of one message (posting and
polling it from Python, the peer being scheduled: it dwarfs the wire latency, so messages
posted together still cost one ALPHA each), BETA of a byte moved, GAMMA of a byte added.
``python -m ringnet.bench comm --algos auto,native,direct,rd,rhd,ring --fit`` fits them
to measured rows (and native's two to its rows). Without native (:data:`ALGORITHMS` as the
candidates: on a stream, over NCCL) their switch points (:func:`thresholds`) at
the constants below are: rd up to 160 KB then rhd (= the ring's cost) at N = 2; direct up to
80 KB then ring at N = 3; rd up to 91 KB then rhd at N = 4. On 2 cores shared by many
processes (load average ~27) every extra message costs a meeting of two ranks that the
scheduler delays: at 64 KiB rd and direct, even through the slower transport path, measured
1.6-4x faster there than the lean rhd and ring that a small alpha (4 us, the lean path's
own Python cost) picked. Where the launcher put more ranks on a node than it has cores
(:func:`ringnet.placement.node_cores`), on any node, the communicator chooses with
:data:`ALPHA_OVERSUBSCRIBED` instead (``alpha``, ``oversubscribed``): the ranks agree on
that once, when the communicator is made, so every rank computes the same choice from
(n, N) and that flag (:func:`constants`); ties go to the earlier of :data:`CHOICES`.
"""
import math

__all__ = ["ALGORITHMS", "NATIVE", "CHOICES", "NATIVE_ACROSS_NODES_BELOW", "ALPHA", "BETA", "GAMMA", "ALPHA_OVERSUBSCRIBED",
           "NATIVE_ALPHA", "NATIVE_BETA", "NATIVE_ALPHA_OVERSUBSCRIBED", "NATIVE_BETA_OVERSUBSCRIBED",
           "NATIVE_TINY_BYTES",
           "constants", "terms", "cost", "fit", "fit_native", "choose", "thresholds", "pow2_below",
           "LINK_SPECS", "SOFTWARE_ALPHA_S", "INTRA", "INTER", "BETWEEN_NODES", "heap_levels", "is_pow2", "between_phases", "between_nodes",
           "exchange_cost", "PIPELINE_ALPHA_OVER_BETA", "PIPELINE_MIN_BYTES",
           "PIPELINE_MAX_BYTES", "pipeline_piece_bytes"]

ALGORITHMS = ("rd", "direct", "rhd", "ring")     # built from point-to-point messages
NATIVE = "native"                                # the MPI library's own all-reduce
CHOICES = ALGORITHMS + (NATIVE,)

ALPHA = 20e-6           # s per message (the lean path's Python is ~2 us; the rest is waiting
                        # for the peer to be scheduled on a shared, loaded host)
BETA = 0.25e-9          # s per byte sent (4 GB/s)
GAMMA = 0.25e-9         # s per byte added (4 GB/s: two reads and a write, one core)
# Where a node holds more ranks than cores, every message is a meeting of two ranks that
# the scheduler must both run. Measured with 4 and 3 ranks on 2 cores (median x native
# of 6-8 runs of 100 calls per size, interleaved): N = 4, rd 0.76/0.82/0.81/0.78 at
# 128K/256K/512K/1M against rhd 0.46/0.56/0.65/0.79; N = 3, direct 0.88/0.81/0.71/0.77
# against the ring 0.51/0.65/0.83/1.10. This alpha puts the switches between those sizes
# (N = 4: rhd from 548 KB; N = 3: the ring from 480 KB).
ALPHA_OVERSUBSCRIBED = 120e-6
# MPI_Allreduce (MPICH 5.0, 2 cores, quiet): per message and per byte sent or added, fitted
# to its measured switch points against the lean algorithms (see the module's text).
NATIVE_ALPHA = 10.7e-6
NATIVE_BETA = 0.2567e-9
NATIVE_ALPHA_OVERSUBSCRIBED = 5e-6
NATIVE_BETA_OVERSUBSCRIBED = 0.29e-9
# MPICH's MPI_Allreduce of at most this many bytes takes a quicker path of its own (N = 2,
# 2 cores: 1.9 us at 8 B against 3.1 us at 16 B and the lean rd's 2.4-2.5 us at both):
# priced as a single message.
NATIVE_TINY_BYTES = 8


# Pipelining cuts a rooted transfer into pieces so that piece k+1 is on the wire while
# piece k is being added or forwarded. With depth D (hops the data crosses), k pieces of
# c bytes cost about (k + D - 1)(alpha + c beta): the piece that minimises this for an
# n-byte buffer is c* = sqrt(n alpha / ((D - 1) beta)). With alpha ~ 20 us per message
# (ALPHA) and beta ~ 0.2 ns/B (5 GB/s shared memory, measured with ``python -m ringnet.bench
# comm``) and D - 1 = 1 that is sqrt(n * 1e5 B): 0.6 MiB at 4 MiB, 2.5 MiB at 64 MiB.
# Below PIPELINE_MIN_BYTES one message is cheaper than any cut.
PIPELINE_ALPHA_OVER_BETA = 1e5          # bytes: alpha / beta
PIPELINE_MIN_BYTES = 256 << 10
PIPELINE_MAX_BYTES = 4 << 20


def pipeline_piece_bytes(nbytes):
    """The piece a pipelined rooted transfer of ``nbytes`` is cut into (see above)."""
    piece = int((nbytes * PIPELINE_ALPHA_OVER_BETA) ** 0.5)
    return min(max(piece, PIPELINE_MIN_BYTES), PIPELINE_MAX_BYTES)


def constants(oversubscribed=False):
    """The model's constants for :func:`cost` and :func:`choose`: those of a node with a core
    per rank, or, ``oversubscribed``, of one holding more ranks than cores."""
    if oversubscribed:
        return {"alpha": ALPHA_OVERSUBSCRIBED, "native_alpha": NATIVE_ALPHA_OVERSUBSCRIBED,
                "native_beta": NATIVE_BETA_OVERSUBSCRIBED}
    return {"alpha": ALPHA, "native_alpha": NATIVE_ALPHA, "native_beta": NATIVE_BETA}


def pow2_below(n):
    """The largest power of two <= ``n`` (``n`` >= 1)."""
    return 1 << (n.bit_length() - 1)


def terms(algorithm, nbytes, n):
    """Return (messages, bytes sent by the busiest rank, bytes it adds) of the table above."""
    if n <= 1:
        return 0, 0, 0
    p = pow2_below(n)
    log_p = p.bit_length() - 1
    f = int(p != n)
    if algorithm == "direct":
        return n - 1, (n - 1) * nbytes, (n - 1) * nbytes
    if algorithm == "rd":
        return log_p + 2 * f, (log_p + 2 * f) * nbytes, (log_p + f) * nbytes
    if algorithm in ("rhd", NATIVE):
        return (2 * log_p + 2 * f, 2 * (p - 1) / p * nbytes + 2 * f * nbytes,
                (p - 1) / p * nbytes + f * nbytes)
    if algorithm == "ring":
        return 2 * (n - 1), 2 * (n - 1) / n * nbytes, (n - 1) / n * nbytes
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: choose {', '.join(CHOICES)}")


def cost(algorithm, nbytes, n, alpha=ALPHA, beta=BETA, gamma=GAMMA, native_alpha=NATIVE_ALPHA,
         native_beta=NATIVE_BETA):
    """Return the modelled seconds of one all-reduce of ``nbytes`` over ``n`` ranks
    (``native``: with ``native_alpha`` per message and ``native_beta`` per byte sent or added)."""
    rounds, sent, added = terms(algorithm, nbytes, n)
    if algorithm == NATIVE:
        return _native_rounds(rounds, nbytes) * native_alpha + (sent + added) * native_beta
    return rounds * alpha + sent * beta + added * gamma


def _native_rounds(rounds, nbytes):
    """``native``'s messages: one up to :data:`NATIVE_TINY_BYTES`, else the table's."""
    return min(rounds, 1) if nbytes <= NATIVE_TINY_BYTES else rounds


def fit(samples):
    """Least-squares (alpha, beta, gamma) from [(algorithm, nbytes, n, seconds)], relative error."""
    import numpy as np  # noqa: WPS433
    rows = np.array([terms(a, b, n) for a, b, n, _ in samples], np.float64)
    seconds = np.array([s for *_, s in samples], np.float64)
    weights = 1.0 / seconds
    solution = np.linalg.lstsq(rows * weights[:, None], seconds * weights, rcond=None)[0]
    return tuple(float(max(x, 0.0)) for x in solution)


def fit_native(samples):
    """Least-squares (native_alpha, native_beta) from [(nbytes, n, seconds)] of MPI's own
    all-reduce, relative error (the terms of ``native`` in the table above)."""
    import numpy as np  # noqa: WPS433
    rows = np.array([(_native_rounds(r, b), s + a)
                     for b, (r, s, a) in ((b, terms(NATIVE, b, n)) for b, n, _ in samples)],
                    np.float64)
    seconds = np.array([s for *_, s in samples], np.float64)
    weights = 1.0 / seconds
    solution = np.linalg.lstsq(rows * weights[:, None], seconds * weights, rcond=None)[0]
    return tuple(float(max(x, 0.0)) for x in solution)


# Across nodes the messages cross a network and MPI's own all-reduce takes them below this
# size: on 3 and 4 nodes of half a core at 1 Gbit/s (bench comm --algos auto,native under
# srun) the model's picks of ours measured 0.83-0.90x MPICH's at 1-64 KiB on 3 nodes (direct)
# and 0.98-1.06x at 4, while from 1 MiB up the ring measured 1.6-2.6x MPICH's on 3 nodes and
# halving-doubling 0.95-1.01x on 4.
NATIVE_ACROSS_NODES_BELOW = 1 << 20


def choose(nbytes, n, candidates=CHOICES, nodes=1, **constants):
    """Return the candidate with the least :func:`cost` (ties: the earlier in ``candidates``,
    so an algorithm of ours before ``native``); where the ranks span ``nodes`` > 1 nodes,
    ``native`` (when a candidate) below :data:`NATIVE_ACROSS_NODES_BELOW` bytes."""
    if nodes > 1 and NATIVE in candidates and nbytes < NATIVE_ACROSS_NODES_BELOW:
        return NATIVE
    return min(candidates, key=lambda a: (cost(a, nbytes, n, **constants), candidates.index(a)))


def thresholds(n, max_bytes=1 << 30, candidates=CHOICES, nodes=1, **constants):
    """Return [(first byte count, algorithm)] where the choice changes, from 1 byte up."""
    out, nbytes = [], 1
    while nbytes <= max_bytes:
        algorithm = choose(nbytes, n, candidates, nodes, **constants)
        if not out or out[-1][1] != algorithm:
            out.append((nbytes, algorithm))
        nbytes = _next_switch(nbytes, n, algorithm, max_bytes, candidates, dict(constants, nodes=nodes))
    return out


def _next_switch(nbytes, n, algorithm, max_bytes, candidates, constants):
    """Smallest byte count above ``nbytes`` whose choice differs (bisection over doublings)."""
    high = nbytes * 2
    while high <= max_bytes and choose(high, n, candidates, **constants) == algorithm:
        high *= 2
    if high > max_bytes:
        return high
    low = high // 2
    while high - low > 1:
        mid = (low + high) // 2
        if choose(mid, n, candidates, **constants) == algorithm:
            low = mid
        else:
            high = mid
    return high



# -- links from spec sheets (what bench model's profiles are made of) ----------------------
# β: per direction, from the spec sheets named in ``source``. α is never on a spec sheet:
# it is the hardware latency named there plus SOFTWARE_ALPHA_S, the per-message cost of
# ringnet's Python-level isendrecv + wait (stated, not measured; ``local`` measures its own).
SOFTWARE_ALPHA_S = 15e-6
# name: (hardware latency s, beta B/s per direction, source of both)
LINK_SPECS = {
    "pcie3": (5e-6, 15.75e9, "PCIe 3.0 x16: 8 GT/s x 16 lanes, 128b/130b = 15.75 GB/s per direction (PCI-SIG "
                             "PCIe Base Specification 3.0); GPU peer copy latency ~5 us"),
    "pcie5": (5e-6, 63.0e9, "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b = 63.0 GB/s per direction (PCI-SIG PCIe "
                            "Base Specification 5.0)"),
    "nvlink4": (3e-6, 450e9, "NVLink 4 on H100 SXM: 900 GB/s total per GPU = 450 GB/s per direction (NVIDIA H100 "
                             "Tensor Core GPU datasheet)"),
    "ib-hdr": (0.6e-6, 25e9, "InfiniBand HDR: 200 Gb/s per port = 25 GB/s per direction, sub-0.6 us latency "
                             "(NVIDIA ConnectX-6 VPI adapter product brief)"),
    "eth-10g": (25e-6, 1.25e9, "10 Gigabit Ethernet: 10 Gb/s = 1.25 GB/s per direction (IEEE 802.3ae); ~25 us "
                               "TCP small-message latency through the kernel stack"),
}


# -- exchanges over a placement: flat, through one leader per node, or in channels ----------
# (alpha s per message, beta s per byte) of a hop within a node (the shared-memory constants
# above) and between nodes: 10 Gbit/s Ethernet, 1.25 GB/s per direction, with ~40 us per
# message (TCP through the kernel stack, ~25 us, and the Python-level send/wait).
INTRA = (ALPHA, BETA)
INTER = (LINK_SPECS["eth-10g"][0] + SOFTWARE_ALPHA_S, 1 / LINK_SPECS["eth-10g"][1])
# The algorithms of the step between nodes of the multi-channel exchange (ringnet.comm.channels).
BETWEEN_NODES = ("ring", "rhd")


def heap_levels(n):
    """Depth of a binary heap of ``n`` ranks (rounds of a tree reduce)."""
    return max(0, math.ceil(math.log2(n + 1)) - 1)


def is_pow2(n):
    """True when ``n`` is a power of two (1, 2, 4, ...)."""
    return n > 0 and n & (n - 1) == 0


def between_phases(algorithm, nbytes, nodes):
    """The reduce-scatter between ``nodes`` nodes of a channel's ``nbytes`` as phases:
    [(messages, bytes per message, bytes added)], one entry per step, in order ("ring":
    M-1 steps of nbytes/M; "rhd": log2 M halving steps of nbytes/2, nbytes/4, ...). The
    all-gather is the same steps reversed, without the adds."""
    if nodes <= 1:
        return []
    if algorithm == "ring":
        return [(1, nbytes / nodes, nbytes / nodes)] * (nodes - 1)
    if algorithm == "rhd":
        if not is_pow2(nodes):
            raise ValueError(f"recursive halving needs a power-of-two node count, got {nodes}")
        steps, part = [], nbytes
        while part * nodes > nbytes * 1.0000001:
            part /= 2
            steps.append((1, part, part))
        return steps
    raise ValueError(f"unknown algorithm between nodes {algorithm!r}: choose {', '.join(BETWEEN_NODES)}")


def between_nodes(nbytes, nodes, link=INTER, gamma=GAMMA, share=1.0):
    """Return (algorithm, seconds) of the cheapest exchange (reduce-scatter + all-gather)
    of a channel's ``nbytes`` between ``nodes`` nodes over ``link`` (alpha, beta), where
    ``share`` channels share each link (1: a link per rank). Both algorithms move the same
    bytes; rhd takes 2 log2 M messages against the ring's 2(M-1), where M is a power of
    two (ties: the ring)."""
    best = None
    for algorithm in BETWEEN_NODES:
        if algorithm == "rhd" and not is_pow2(nodes):
            continue
        phases = between_phases(algorithm, nbytes, nodes)
        seconds = sum(2 * m * link[0] + 2 * b * link[1] * share + a * gamma for m, b, a in phases)
        if best is None or seconds < best[1]:
            best = (algorithm, seconds)
    return best


def _time(link, messages, nbytes):
    return messages * link[0] + nbytes * link[1]


def exchange_cost(route, topology, nbytes, per_node, intra=INTRA, inter=INTER, gamma=GAMMA,
                  links_per_node=None):
    """Modelled seconds of one exchange (reduce and distribution) of ``nbytes`` on ``route``
    ("ring": reduce-scatter + all-gather; "tree": reduce + broadcast) over nodes holding
    ``per_node`` ranks each, flat or hierarchical: what ``--topology auto`` compares and
    what ``bench model`` predicts (:func:`ringnet.perfmodel.topology.hierarchical_items`
    follows the same phases).

    Flat ring: 2(N-1) lockstep steps of n/N bytes, each as slow as the ring's slowest hop
    (between nodes when there are several). Flat tree: per heap level both children's n
    bytes into a rank, over a hop between nodes when there are several. Hierarchical ring
    with L ranks on every node (:mod:`ringnet.comm.channels`): a ring reduce-scatter and
    all-gather within the node over L regions, and each of the L channels' exchange of n/L
    bytes between the M nodes by :func:`between_nodes`, the channels sharing a node's
    ``links_per_node`` links (None: one per rank). Hierarchical with nodes of different
    sizes, and the hierarchical tree: the busiest node's L-1 ranks send n to their leader
    and get n back (plus their shards for the ring), and the leaders run the same structure
    over M nodes between nodes.
    """
    n, nodes, local = sum(per_node), len(per_node), max(per_node)
    if n <= 1:
        return 0.0
    link = inter if nodes > 1 else intra
    if topology == "flat" or nodes == 1 or nodes == n:
        if route == "ring":
            return _time(link, 2 * (n - 1), 2 * (n - 1) * nbytes / n) + (n - 1) / n * nbytes * gamma
        depth = heap_levels(n)
        return 2 * _time(link, depth, 2 * depth * nbytes) + 2 * depth * nbytes * gamma
    if route == "ring" and len(set(per_node)) == 1:
        within = 2 * _time(intra, local - 1, (local - 1) / local * nbytes) \
            + (local - 1) / local * nbytes * gamma
        share = local / min(local, links_per_node) if links_per_node else 1.0
        return within + between_nodes(nbytes / local, nodes, inter, gamma, share)[1]
    inside = (local - 1) * nbytes
    within = 2 * _time(intra, local - 1, inside) + inside * gamma
    if route == "ring":
        within += 2 * _time(intra, local - 1, inside / n)
        between = _time(inter, 2 * (nodes - 1), 2 * (nodes - 1) * nbytes / nodes) \
            + (nodes - 1) / nodes * nbytes * gamma
    else:
        depth = heap_levels(nodes)
        between = 2 * _time(inter, depth, 2 * depth * nbytes) + 2 * depth * nbytes * gamma
    return within + between
