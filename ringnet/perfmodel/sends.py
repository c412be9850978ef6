"""What each mode sends per step: the library's own account (``ringnet.parallel.step_traffic``).

Every strategy says what one step sends, from the bounds it runs with (the plans'
shard bounds, split-fc's FC blocks and conversion layer): the model reads that here and
adds only the delay-0 buckets of the code it models (:func:`buckets`, from
:func:`~ringnet.perfmodel.codefacts.code_facts`).
"""
from ringnet.perfmodel.codefacts import code_facts, rooted_concurrent
from ringnet.parallel import step_traffic
from ringnet.parallel.plans import backward_buckets
from ringnet.parallel.traffic import ring_phase_bytes

__all__ = ["ring_phase_bytes", "traffic", "messages", "buckets", "step", "split_fc_plan"]


def buckets(model, stop_layer):
    """The code's delay-0 buckets of ``model.layers[:stop_layer]``: [(lo, hi, layer)] in the
    order the backward completes them, or [] where the code has none (or they are off)."""
    size = code_facts()["bucket_bytes"]
    if not size:
        return []
    return list(backward_buckets(model, stop_layer, size))


def step(model, mode, n, batch, delay=0):
    """Return (whole, bucketed, buckets): the :class:`~ringnet.parallel.traffic.StepTraffic`
    of one step of ``mode`` with its exchange in one part, the same in the code's delay-0
    buckets (where N > 1; ``whole`` where there are none) and those buckets [(lo, hi, layer)]."""
    whole = step_traffic(mode, model, n, batch, delay, buckets=[])
    parts = buckets(model, whole.stop_layer) if not delay and n > 1 else []
    if not parts:
        return whole, whole, []
    return whole, step_traffic(mode, model, n, batch, delay, buckets=parts), parts


def traffic(model, mode, n, batch):
    """Return the bytes each of N ranks sends in one step of ``mode`` (a list of N ints)."""
    return step_traffic(mode, model, n, batch, buckets=[]).sent()


def messages(model, mode, n, batch, delay=0):
    """Return the messages (non-empty sends) each of N ranks posts in one step of ``mode``:
    the library's collectives in the code's delay-0 buckets, the rooted ones in pieces where
    the modelled code cuts them (one message per transfer where it does not)."""
    _, steps, _ = step(model, mode, n, batch, delay)
    return steps.messages(pieces=None if rooted_concurrent() else 1)


def split_fc_plan(model, n, batch):
    """Return split-fc's collectives for one step: [(label, kind, bounds)] in element counts
    ("ag": ring all-gather, "rs": reduce-scatter), the conv prefix's size and the FC blocks."""
    from ringnet.parallel.fc_slices import fc_blocks
    steps = step_traffic("split-fc", model, n, batch, buckets=[])
    return ([(t.label, "ag" if t.op == "allgather" else "rs", t.bounds) for t in steps.transfers()],
            steps.region, fc_blocks(model))
