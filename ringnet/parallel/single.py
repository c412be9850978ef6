"""single: one process, ``w[t+1] = upd(w[t], G_t(w[t]))`` — the reference every mode is compared to."""
from ringnet.parallel.base import DataParallelStrategy

__all__ = ["SingleStrategy"]


class SingleStrategy(DataParallelStrategy):
    """The whole batch, the whole update, no communication."""
    name = "single"

    def __init__(self, model, make_optimizer, world=None, delay=0):
        super().__init__(model, make_optimizer, world, comm=None, delay=delay)

    def step(self, x, labels, it):
        if self.graphs is None or self.graphs.optimizer is None:
            return super().step(x, labels, it)
        with self.stats.span("step"):                  # the update is in the graph too
            with self.stats.span("compute", phase="forward_backward_update"):
                return self.graphs.step(x, labels, it)

    def graph_step(self, backend, strict=False, optimizer=None):
        """As the data-parallel modes', with the SGD update inside the graph (delay 0)."""
        inside = not self.delay and self.engine.lookahead is None
        return super().graph_step(backend, strict, self.engine.optimizer if inside else None)
