"""How ringnet splits a range over ranks: one rule for parameters, batches and test sets."""

__all__ = ["shard_bounds"]


def shard_bounds(length, size):
    """Split ``[0, length)`` into ``size`` contiguous shards, the first ``length % size`` one longer."""
    base, extra = divmod(int(length), int(size))
    bounds, start = [], 0
    for r in range(size):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
