"""The cost model of auto's all-reduce algorithms: which one is fastest for a message size and N.

Every algorithm is built from the transport's point-to-point calls, like the ring:

=========  ========================  ==========================  =====================
algorithm  messages (latency terms)  bytes sent by busiest rank  bytes it adds
=========  ========================  ==========================  =====================
rd         log2 p + 2f               (log2 p + 2f) n             (log2 p + f) n
direct     N-1 (in one round)        (N-1) n                     (N-1) n
rhd        2 log2 p + 2f             2 (p-1)/p n + 2f n          (p-1)/p n + f n
ring       2 (N-1)                   2 (N-1)/N n                 (N-1)/N n
=========  ========================  ==========================  =====================

``rd``: recursive doubling. ``direct``: every rank sends its buffer to every other rank
at once and sums all N in rank order (one round, but N-1 messages to post and poll).
``rhd``: recursive halving (reduce-scatter) then recursive doubling (all-gather). ``p`` is the largest power of two
<= N; when N is not one (f = 1), the first 2(N-p) ranks fold in pairs before and unfold
after. ``ring``: :class:`~ringnet.comm.ring.RingCommunicator`. The communicator that runs them is
:class:`~ringnet.comm.auto.AutoCommunicator`.

The choice minimises the alpha-beta-gamma cost ``messages * ALPHA + sent * BETA +
added * GAMMA`` of the table (:func:`cost`). ALPHA is the cost of one message (posting and
polling it from Python, the peer being scheduled: it dwarfs the wire latency, so messages
posted together still cost one ALPHA each), BETA of a byte moved, GAMMA of a byte added.
``python -m ringnet.bench comm --algos auto,native,direct,rd,rhd,ring --fit`` fits them
to measured rows. Their switch points (:func:`thresholds`, printed by the benchmark) at
the constants below: rd up to 160 KB then rhd (= the ring's cost) at N = 2; direct up to
80 KB then ring at N = 3; rd up to 91 KB then rhd at N = 4. On 2 cores shared by many
processes (load average ~27) every extra message costs a meeting of two ranks that the
scheduler delays: at 64 KiB rd and direct, even through the slower transport path, measured
1.6-4x faster there than the lean rhd and ring that a small alpha (4 us, the lean path's
own Python cost) picked. Where the launcher put more ranks on a node than it has cores
(:func:`ringnet.comm.topology.node_cores`), on any node, the communicator chooses with
:data:`ALPHA_OVERSUBSCRIBED` instead (``alpha``, ``oversubscribed``): the ranks agree on
that once, when the communicator is made, so every rank computes the same choice from
(n, N) and that flag; ties go to the earlier of :data:`ALGORITHMS`.
"""

__all__ = ["ALGORITHMS", "ALPHA", "BETA", "GAMMA", "ALPHA_OVERSUBSCRIBED", "terms", "cost", "fit",
           "choose", "thresholds", "pow2_below"]

ALGORITHMS = ("rd", "direct", "rhd", "ring")

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
    if algorithm == "rhd":
        return (2 * log_p + 2 * f, 2 * (p - 1) / p * nbytes + 2 * f * nbytes,
                (p - 1) / p * nbytes + f * nbytes)
    if algorithm == "ring":
        return 2 * (n - 1), 2 * (n - 1) / n * nbytes, (n - 1) / n * nbytes
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: choose {', '.join(ALGORITHMS)}")


def cost(algorithm, nbytes, n, alpha=ALPHA, beta=BETA, gamma=GAMMA):
    """Return the modelled seconds of one all-reduce of ``nbytes`` over ``n`` ranks."""
    rounds, sent, added = terms(algorithm, nbytes, n)
    return rounds * alpha + sent * beta + added * gamma


def fit(samples):
    """Least-squares (alpha, beta, gamma) from [(algorithm, nbytes, n, seconds)], relative error."""
    import numpy as np  # noqa: WPS433
    rows = np.array([terms(a, b, n) for a, b, n, _ in samples], np.float64)
    seconds = np.array([s for *_, s in samples], np.float64)
    weights = 1.0 / seconds
    solution = np.linalg.lstsq(rows * weights[:, None], seconds * weights, rcond=None)[0]
    return tuple(float(max(x, 0.0)) for x in solution)


def choose(nbytes, n, candidates=ALGORITHMS, **constants):
    """Return the candidate with the least :func:`cost` (ties: the earlier in ``candidates``)."""
    return min(candidates, key=lambda a: (cost(a, nbytes, n, **constants), candidates.index(a)))


def thresholds(n, max_bytes=1 << 30, **constants):
    """Return [(first byte count, algorithm)] where the choice changes, from 1 byte up."""
    out, nbytes = [], 1
    while nbytes <= max_bytes:
        algorithm = choose(nbytes, n, **constants)
        if not out or out[-1][1] != algorithm:
            out.append((nbytes, algorithm))
        nbytes = _next_switch(nbytes, n, algorithm, max_bytes, constants)
    return out


def _next_switch(nbytes, n, algorithm, max_bytes, constants):
    """Smallest byte count above ``nbytes`` whose choice differs (bisection over doublings)."""
    high = nbytes * 2
    while high <= max_bytes and choose(high, n, **constants) == algorithm:
        high *= 2
    if high > max_bytes:
        return high
    low = high // 2
    while high - low > 1:
        mid = (low + high) // 2
        if choose(mid, n, **constants) == algorithm:
            low = mid
        else:
            high = mid
    return high

