"""One step of a mode at N ranks, predicted: its compute laid out layer by layer, what the
library says the step sends (``ringnet.parallel.step_traffic``), timed by each route's rule."""
import dataclasses
import functools
import math

import numpy as np

from ringnet.perfmodel import sends
from ringnet.perfmodel.codefacts import boundary_s, code_facts, rooted_concurrent
from ringnet.perfmodel.exchange import RING_KINDS, flat_items, refill, ring_time
from ringnet.perfmodel.held import Cpu, Sync, share, simulate
from ringnet.perfmodel.simulate import layer_timeline, progress_of, simulate_ops
from ringnet.perfmodel.topology import hierarchical_items, spans_nodes
from ringnet.parallel import MODES as REGISTRY
from ringnet.parallel.fc_slices import fc_blocks
from ringnet.parallel.plans import exchange_on_stream
from ringnet.shards import shard_bounds as _shard_bounds

__all__ = ["Prediction", "predict", "transfer_cpu_s", "held_waits", "stream_rate"]


@dataclasses.dataclass
class Prediction:
    """One predicted step: its parts in seconds and the bytes per rank. ``update_s`` is the
    weights' work: this rank's update and, at delay 1, the step boundary's passes. Where a
    node's CPU quota bounds the step (its CPU time over the quota), ``node_cpu_s`` is that
    CPU time and ``transfers_cpu_s`` the part of it the step's transfers cost (None where
    the calibration did not measure it); both None elsewhere. ``held``: where the step's
    waits on peers held by their quotas were simulated (:func:`held_waits`), the
    :class:`~ringnet.perfmodel.held.Held` figures; else None."""
    step_s: float
    compute_s: float
    comm_s: float
    update_s: float
    exposed_s: float
    bytes_mean: float
    bytes_max: int
    node_cpu_s: float = None
    transfers_cpu_s: float = None
    held: object = None


def stream_rate(system, part):
    """The rate (a fraction of its blocking speed) at which ``part``'s exchange moves on the
    stream beside compute: where it is a rooted reduce + broadcast whose route the
    calibration timed beside compute (``System.rooted_rate``), that route's; else the
    ring's (``System.rate``). The ring's every hop forwards a piece that has just arrived,
    so each waits for its rank's thread to get a CPU; the master's workers and root post
    all their pieces at once and forward none, the tree's middle ranks forward theirs:
    where the CPUs are scarce each moves at its own rate."""
    route = part.transfers[0].route if part.transfers else None
    return (system.rooted_rate or {}).get(route, system.rate)


def _hierarchical_on(layout, system, n, part, update_s, after_idle=False):
    """:func:`hierarchical_items` on the nodes of ``layout`` (``system``: the flat one)."""
    return hierarchical_items(layout, n, part, update_s, after_idle)


def predict(system, model, mode, delay, n, batch, topology="flat"):
    """Predict one step of ``mode`` at N ranks; ``batch`` is the global batch (B/N per rank).

    ``topology`` "hierarchical": the hierarchical exchange (:mod:`~ringnet.perfmodel.topology`:
    channels where every node is full, else one leader per node) where the ranks span nodes
    (placed as :meth:`System.layout` says); flat elsewhere."""
    if mode not in REGISTRY:
        raise ValueError(f"unknown mode {mode!r}")
    if REGISTRY[mode].communicator is None:       # one process
        n, delay = 1, 0
    system = system.at(n)
    system = dataclasses.replace(system, ranks_here=min(n, system.ranks_per_node))
    if system.quota is not None and min(n, system.placed_per_node or system.ranks_per_node) == 1:
        return _under_quota(system, model, mode, delay, n, batch, topology)
    return _predict_on(system, model, mode, delay, n, batch, topology)


def _under_quota(system, model, mode, delay, n, batch, topology):
    """One rank on a node held to a CFS quota of q < 1 cores: the kernel lets its threads
    run at a full core's speed until they have used q of the period and holds them for
    the rest. A rank that waits for the network spends no budget meanwhile, so it computes
    at a full core's speed (the profile, measured busy under the quota, times q) for up to
    a period's budget and at the quota's rate past it (``System.quota_period_s``), and the
    step is no shorter than its CPU time over q: compute, updates, and what its transfers
    cost the process where the calibration measured it (:func:`transfer_cpu_s`; else the
    stream's steal). The busy single step is the profile itself. The stream's rate beside
    compute was measured on such a node, where the quota held compute and stream alike
    for 1 - q of the time: running, the transfer moves at that rate / q (at most its
    blocking speed; the rooted routes' own rates alike, where the calibration timed them,
    :func:`stream_rate`); its steal, a ratio of two times both held alike, stands.

    Where the nodes outnumber the CPUs of the machine they share (the calibration's
    ``hosts``; :func:`_shared`), their ranks, which compute at once, each get a share of
    a core below a full one while all compute: the compute runs at that share (and at the
    quota's rate once the period's budget is spent, where the share is the larger), the
    ranks share cores, so no rank's step is its own and the calibration's imbalance,
    measured there with the CPUs shared out, does not lengthen it. The stream beside that
    compute moves at the rate the calibration measured, not that rate / q: there every
    node computed at once on the same shared CPUs, as training's do.

    At delay 1 across nodes the previous step's exchange runs beside the whole of this
    step's compute, its thread polling on the node's other CPU from the same budget: the
    compute never finds the period's budget unspent and is held as the busy profile was
    (measured: its wall time twice its CPU time at half a core). There the compute takes
    the profile as measured, the exchange beside it the rate the calibration measured
    beside one step of the model as training runs it (``System.delayed_rate``; else beside
    compute back to back), and no steal (the thread polls on a CPU of its own; what its
    polls cost the budget is in the CPU time below)."""
    q = system.quota
    free = _unheld(system)
    fast = _predict_on(free, model, mode, delay, n, batch, topology)
    period = system.quota_period_s
    burst = _shared(system, mode, n)
    if burst < 1.0:
        # the nodes outnumber the CPUs of the machine they share, and compute at once: each
        # at its share of a core, until its period's budget is spent (where the share
        # exceeds the quota) and at the quota's rate after; the ranks share cores, so no
        # rank's step is its own (no imbalance), and the stream's polls cost the budget;
        # the stream moves at the rates the calibration measured beside compute there,
        # where every node computed at once on the same shared CPUs (not over q, as free's
        # are: no rank's compute runs at a full core's speed)
        p = _predict_on(dataclasses.replace(
            free, held_after_s=q * period if burst > q and period else math.inf, held_rate=q,
            held_burst=burst, steal=0.0, imbalance=None, rate=system.rate,
            rooted_rate=system.rooted_rate), model, mode, delay, n, batch, topology)
    elif period and fast.compute_s > q * period:
        # a compute longer than one period's budget: the wait before it leaves it that
        # budget at most (the kernel carries none over to the next period), so its first
        # q * period run at a full core's speed and the rest at the quota's rate; there
        # the node's threads are held alike, and the stream's polls cost the budget (the
        # CPU time below) rather than the compute's core, as at delay 1
        p = _predict_on(dataclasses.replace(free, held_after_s=q * period, held_rate=q,
                                            steal=0.0),
                        model, mode, delay, n, batch, topology)
    else:
        p = fast
    if delay and n > 1:
        held = dataclasses.replace(system, quota=None, steal=0.0, rooted_rate=None,
                                   rate=(system.delayed_rate or {}).get(model.name, system.rate))
        p = _predict_on(held, model, mode, delay, n, batch, topology)
    sim = held_waits(system, model, mode, delay, n, batch)
    if sim is not None:
        own = _predict_on(dataclasses.replace(free, steal=0.0), model, mode, delay, n, batch,
                          topology)
        return dataclasses.replace(
            p, step_s=max(sim.step_s, p.step_s), compute_s=own.compute_s / q,
            update_s=own.update_s / q, exposed_s=0.0, node_cpu_s=sim.cpu_s,
            transfers_cpu_s=sim.cpu_s - own.compute_s - own.update_s, held=sim)
    spent = transfer_cpu_s(system, model, mode, n, batch, delay)
    if spent is None:
        busy = (fast.compute_s + fast.update_s) / q
    else:
        # the transfers' CPU as measured replaces the steal, which stood for the part of it
        # the stream took from the compute's core while both ran
        own = _predict_on(dataclasses.replace(free, steal=0.0), model, mode, delay, n, batch,
                          topology)
        busy = (own.compute_s + own.update_s + spent) / q
    if busy <= p.step_s:
        return p
    return dataclasses.replace(p, step_s=busy, compute_s=fast.compute_s / q,
                               update_s=fast.update_s / q, exposed_s=0.0,
                               node_cpu_s=busy * q, transfers_cpu_s=spent)


def _shared(system, mode, n):
    """The share of a core a rank's compute gets where the nodes it runs on outnumber the
    CPUs of the machine they share (:func:`ringnet.perfmodel.held.share`; 1 elsewhere, and
    where the calibration did not name the machines). Split-fc's compute is cut by its
    blocking activation collectives: its ranks' compute alternates with waits, so they do
    not all compute at once, and its step is bounded by the node's CPU time over the quota
    (measured on 4 nodes of 0.5 core on 2 CPUs: LeNet's compute's wall time 1.3 times its
    CPU time, the other modes' 1.7 to 2.0)."""
    if not system.hosts or n < 2 or mode == "split-fc":
        return 1.0
    return share(n, system.hosts)


def _unheld(system):
    """The system a rank held to ``system.quota`` (< 1 core) sees while its budget lasts:
    the profile at a full core's speed, no quota, the stream's rate / q (at most 1)."""
    q = system.quota
    rooted_rate = {route: min(1.0, r / q) for route, r in (system.rooted_rate or {}).items()}
    return dataclasses.replace(system, compute=system.compute.full_speed(q), quota=None,
                               rate=min(1.0, system.rate / q), rooted_rate=rooted_rate or None)


def transfer_cpu_s(system, model, mode, n, batch, delay=0):
    """CPU seconds one step's transfers cost the busiest rank's process, or None where the
    calibration did not measure it (``System.cpu_stream``/``cpu_blocking``): per message
    and per byte the rank sends: on the stream's thread for the exchange where the code
    runs it on a stream (at delay 1, and in its delay-0 buckets), else on the training
    thread's blocking waits, as for split-fc's activations. A message's cost (the
    calibration's, whose messages outlast the waits' spin) is at most the time the message
    takes on its link: a wait that ends sooner spins less. ``system``: as
    :meth:`System.at` gives it for N."""
    if system.cpu_stream is None and system.cpu_blocking is None:
        return None
    if REGISTRY[mode].communicator is None or n < 2:
        return 0.0
    whole, bucketed, buckets = sends.step(model, mode, n, batch, delay)
    pieces = None if rooted_concurrent() else 1
    total = [0.0] * n
    blocking = system.cpu_blocking or system.cpu_stream
    # where the strategies' exchange engine takes no stream (delay 0 and a region that
    # makes one bucket) the training thread exchanges, blocking
    streamed = (system.cpu_stream or system.cpu_blocking if exchange_on_stream(delay, buckets)
                else blocking)
    for transfers, cost in ((whole.activations, blocking),
                            ([t for part in bucketed.parts for t in part.transfers], streamed)):
        total = [a + b for a, b in zip(total, _transfers_cpu(system, n, transfers, cost, pieces))]
    return max(total)


def _transfers_cpu(system, n, transfers, cost, pieces):
    """Per rank, the CPU seconds ``transfers`` cost at ``cost`` per message and per byte
    (:func:`transfer_cpu_s`)."""
    total = [0.0] * n
    for t in transfers:
        link = (system.rooted or {}).get(t.route) or system.link_of(n)
        for r, (msgs, sent) in enumerate(zip(t.messages(n, pieces), t.sent(n))):
            if not msgs:
                continue
            # a wait spins (its cost per message) no longer than the message takes
            lasts = link.alpha_s + sent / msgs / link.beta_Bps
            total[r] += min(cost["per_msg_s"], lasts) * msgs + cost["per_byte_s"] * sent
    return total


def held_waits(system, model, mode, delay, n, batch):
    """Split-fc at delay 0 on N nodes held to a CFS quota, one rank a node: its step, whose
    blocking collectives often find a peer held by its node's quota, simulated
    (:func:`ringnet.perfmodel.held.simulate`): the compute between the collectives at a
    full core's speed, each collective's rounds at the link's time, the waits as the code
    spins and polls (its spin under a quota, the calibration's cost of a sleeping poll).
    Where the nodes that share a machine outnumber its CPUs, the machine's CPUs hold them
    too: the simulation runs them together on those CPUs, a spinning wait yielding to the
    ranks that compute. None where the calibration did not time the polls or name the
    machines the nodes ran on, and for other modes. ``system``: as :meth:`System.at` gives
    it for N."""
    polls, hosts, q = system.polls, system.hosts, system.quota
    if mode != "split-fc" or delay or n < 2 or q is None or not polls or not hosts:
        return None
    from ringnet.comm.mpi_transport import MAX_PAUSE_S, PAUSE_STEP_S, wait_spin_s
    free = _unheld(system)
    cp, name = free.compute, model.name
    slow = free.contention(n, name)
    whole, bucketed, buckets = sends.step(model, mode, n, batch, delay)
    blocks = fc_blocks(model)
    if len(whole.activations) != 1 + 2 * len(blocks):
        return None
    start, local = whole.stop_layer, batch / n
    share = {bname: max(b - a for a, b in _shard_bounds(layer.out_features, n))
             / layer.out_features for bname, layer, _ in blocks}

    def layers(names, b, part, which):
        return sum(cp.layer(name, lname, b, part)[which] for lname in names) * slow

    convs = [lname for lname, _ in model.layers[:start]]
    own = [[bname] + [e for e, _ in extra] for bname, _, extra in blocks]
    acts = whole.activations
    # the step as the training thread runs it: compute, and the collectives it blocks in
    plan = [Cpu(layers(convs, local, 1.0, 0)), acts[0]]
    for k, names in enumerate(own):
        plan += [Cpu(layers(names, batch, share[names[0]], 0)), acts[1 + k]]
    plan.append(Cpu(cp.overhead_s(name, batch) * slow))
    for k, names in enumerate(reversed(own)):
        plan += [Cpu(layers(names, batch, share[names[0]], 1)), acts[1 + len(own) + k]]
    plan.append(Cpu(layers(convs, local, 1.0, 1)))
    (part,) = whole.parts
    fc_rows = sum(max(b - a for a, b in _shard_bounds(layer.out_features, n))
                  * (layer.in_features + 1) for _, layer, _ in blocks)
    tail = (cp.update(part.updated) + cp.update(fc_rows, 2 * len(blocks))) * slow
    if exchange_on_stream(delay, buckets):
        # the conv part's exchange on the stream beside the backward: its CPU from the same
        # budget, and the step waits (without polling) for its last round
        cost = system.cpu_stream or system.cpu_blocking
        streamed = max(_transfers_cpu(system, n, [t for p in bucketed.parts for t in p.transfers],
                                      cost, None if rooted_concurrent() else 1)) if cost else 0.0
        plan += [Cpu(tail + streamed), Sync(1, 0.0, polls=False)]
    else:
        plan += list(part.transfers) + [Cpu(tail)]
    step = _timed_plan(free, n, plan, (system.cpu_blocking or {}).get("per_byte_s", 0.0))
    return simulate(step, n, q, system.quota_period_s, wait_spin_s(q, 1), polls["cpu_s"],
                    polls["extra_s"], PAUSE_STEP_S, MAX_PAUSE_S, hosts=hosts)


def _timed_plan(system, n, plan, per_byte_s):
    """:func:`held_waits`'s step with each of its collectives (the library's transfers in
    ``plan``) a :class:`~ringnet.perfmodel.held.Sync` of N - 1 rounds at the link's time,
    followed by its bytes' CPU (``per_byte_s``). A shaped link's token buckets carry from
    one collective to the next and refill during the compute between them (for its CPU
    time: a hold between them refills them more); the step's first collective meets them as
    the step before left them (the plan walked twice)."""
    tokens = [system.link_of(n).burst_bytes] * n
    for _ in range(2):
        step = []
        for item in plan:
            if isinstance(item, (Cpu, Sync)):
                step.append(item)
                if isinstance(item, Cpu):
                    refill(system, n, tokens, item.seconds)
                continue
            seconds = ring_time(system, item.bounds, item.itemsize, RING_KINDS[item.op],
                                tokens=tokens)
            cpu = per_byte_s * max(item.sent(n))
            refill(system, n, tokens, cpu)
            step += [Sync(n - 1, seconds / (n - 1)), Cpu(cpu)]
    return step


def _predict_on(system, model, mode, delay, n, batch, topology):
    """:func:`predict` on the system an N-rank job sees (``System.at`` taken)."""
    cp = system.compute
    name = model.name
    slow = system.contention(n, name)
    whole, bucketed, bucket_list = sends.step(model, mode, n, batch, delay)
    region = whole.region
    sent = whole.sent()
    bytes_mean, bytes_max = float(np.mean(sent)), int(max(sent))
    progress = progress_of(system, n)
    layers = range(len(model.layers))

    if whole.activations:                       # split FC layers: activations collectives
        blocks = fc_blocks(model)
        fc_start = whole.stop_layer
        fc_names = {lname for lname, _ in model.layers[fc_start:]}
        share = max(max(b - a for a, b in _shard_bounds(layer.out_features, n)) / layer.out_features
                    for _, layer, _ in blocks)
        fc_compute = (cp.step_compute(name, batch, fc_names, share) + cp.overhead_s(name, batch)) * slow
        fc_rows = sum(max(b - a for a, b in _shard_bounds(layer.out_features, n))
                      * (layer.in_features + 1) for _, layer, _ in blocks)
        fc_update = cp.update(fc_rows, 2 * len(blocks)) * slow
        # The activation collectives block the training thread. On a GPU the strategy
        # overlaps each backward reduce-scatter with the same block's dW/db (about half
        # the layer's backward), the conversion layer's also with the FC update.
        hidden = {}
        if system.cores is None:
            for bname, _, _ in blocks:
                hidden[bname] = 0.5 * cp.layer(name, bname, batch, share)[1] * slow
            hidden[blocks[0][0]] += fc_update
        act = 0.0
        for transfer in whole.activations:
            # each follows a layer's compute: a shaped link's token bucket has refilled
            t = ring_time(system, transfer.bounds, transfer.itemsize, RING_KINDS[transfer.op],
                           after_idle=True)
            block = transfer.beside
            act += max(0.0, t - hidden.get(block, 0.0)) if block else t
        local = batch / n
        segments = ([("fwd", i, local, 1.0) for i in layers[:fc_start]]
                    + [("dense", fc_compute + act + fc_update)]
                    + [("bwd", i, local, 1.0) for i in reversed(layers[:fc_start])])
        timeline = layer_timeline(cp, model, segments, slow)
        compute = timeline.end - act - fc_update
        fixed = fc_update
    else:
        local = batch / n
        segments = ([("fwd", i, local, 1.0) for i in layers]
                    + [("dense", cp.overhead_s(name, local) * slow)]
                    + [("bwd", i, local, 1.0) for i in reversed(layers)])
        timeline = layer_timeline(cp, model, segments, slow)
        compute, act, fixed = timeline.end, 0.0, 0.0

    if system.held_after_s is not None:
        timeline = timeline.held(system.held_after_s, system.held_rate, system.held_burst)
        compute = timeline.end - act - fixed

    def update_of(part):
        """The update of the busiest rank's share of a part (the plan says whose it is)."""
        return cp.update(part.updated) * slow

    exchange_items = flat_items
    layout = system.layout() if topology == "hierarchical" else None
    if layout is not None and spans_nodes(layout, n):
        exchange_items = functools.partial(_hierarchical_on, layout)
    (everything,) = whole.parts
    # A step's first collective starts on a link idle since the previous step's exchange
    # ended (the forward at delay 0; at delay 1 the gap between the exchange and the step,
    # on these runs at least the 1 ms a shaped link's token bucket takes to refill): it
    # meets the bucket full. The buckets that follow it during the backward do not.
    exchange = exchange_items(system, n, everything, update_of(everything), after_idle=True)
    comm = sum(t for kind, t in exchange if kind in ("msg", "copy", "peer"))
    # delay 1: the step boundary's element-wise passes over the region, on the training
    # thread after it waited for the previous exchange and before it starts this one
    boundary = (boundary_s(cp, region, code_facts().get("delay_compensation", "lookahead")) * slow
                if delay else 0.0)
    update = update_of(everything) + fixed + boundary
    ops, parts = [], []
    if delay and n > 1:
        ops, parts = [(0.0, exchange)], [everything]
    elif bucket_list:
        ops = [(timeline.ready[layer],
                exchange_items(system, n, part, update_of(part), after_idle=not k))
               for k, ((_, _, layer), part) in enumerate(zip(bucket_list, bucketed.parts))]
        parts = bucketed.parts
    if ops:
        step, shift = simulate_ops(system, timeline, ops, progress,
                                   rates=[stream_rate(system, part) for part in parts])
        compute += shift                # the stream's work the compute waited for on its core
    else:
        step = timeline.end + sum(t for _, t in exchange)
    step += boundary
    if n > 1:
        # ranks beyond the cores: the first wait for peers after the rank's own compute finds
        # some descheduled (measured once per step: the waits that follow in the same step
        # meet peers already in step, and pay the per-message part in the link's latency)
        step += system.wait_s
        # a core per rank: at delay 0 every step ends when its slowest rank's compute does
        # (delay 1 has a step of slack for it); where ranks share cores the wait for
        # descheduled peers above stands for it (System.at keeps no imbalance there)
        if not delay:
            step += compute * ((system.imbalance or {}).get(name, 1.0) - 1.0)
    return Prediction(step, compute, comm + act, update,
                      max(0.0, step - compute - update), bytes_mean, bytes_max)
