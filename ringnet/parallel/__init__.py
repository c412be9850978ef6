"""Training strategies: how one optimizer step uses the ranks.

=========  ======================================================  ===========  =============
mode       what happens per step                                   update work  default delay
=========  ======================================================  ===========  =============
single     one process, whole batch                                whole model  0
ring       ring reduce-scatter, own-shard update, ring all-gather  1/N per rank 1
tree       binary-tree reduce to rank 0, root update, tree bcast   rank 0       0
master     workers -> rank 0 point-to-point, root update, answers  rank 0       0
split-fc   conv data-parallel (ring), FC model-parallel            1/N per rank 0
=========  ======================================================  ===========  =============
"""
from ringnet.errors import UsageError

__all__ = ["create", "STRATEGIES"]

STRATEGIES = {
    "single": "ringnet.parallel.single:SingleStrategy",
    "ring": "ringnet.parallel.ring:RingStrategy",
    "tree": "ringnet.parallel.tree:TreeStrategy",
    "master": "ringnet.parallel.master:MasterStrategy",
    "split-fc": "ringnet.parallel.split_fc:SplitFCStrategy",
}

_COMMUNICATOR = {"ring": "ring", "tree": "tree", "master": "master", "split-fc": "ring"}


def _load(path):
    import importlib
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def create(mode, model, make_optimizer, world, delay=0, transport="auto"):
    """Return the strategy for ``mode`` on ``world`` (an mpi4py communicator or None)."""
    if mode not in STRATEGIES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(STRATEGIES)}")
    cls = _load(STRATEGIES[mode])
    if mode == "single":
        return cls(model, make_optimizer, world, delay=delay)
    from ringnet import comm as ringcomm
    try:
        communicator = ringcomm.create(_COMMUNICATOR[mode], transport=transport, mpi_comm=world)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return cls(model, make_optimizer, world, communicator, delay=delay)
