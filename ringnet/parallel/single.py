"""single: one process, ``w[t+1] = upd(w[t], G_t(w[t]))`` — the reference every mode is compared to."""
from ringnet.parallel.base import DataParallelStrategy

__all__ = ["SingleStrategy"]


class SingleStrategy(DataParallelStrategy):
    """The whole batch, the whole update, no communication."""
    name = "single"

    def __init__(self, model, make_optimizer, world=None, delay=0):
        super().__init__(model, make_optimizer, world, comm=None, delay=delay)
