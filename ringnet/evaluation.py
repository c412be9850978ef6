"""What a run checks between steps, across its ranks: the test set's accuracy and loss
(:func:`evaluate`, each rank its share, summed over the ranks) and that every replica's
weights are the same bits (:func:`check_replicas`). Both wait for the other ranks under the
run's deadline."""
import time

from ringnet.control import agree, set_phase
from ringnet.errors import TrainingError

__all__ = ["evaluate", "check_replicas"]


def evaluate(strategy, dataset, cfg, world, xp, batch_size=256, deadline=None):
    """Return (test accuracy, mean test loss) over the whole test set, summed over ranks.

    Returns (None, None) when the data set has no test split.
    """
    from ringnet.data import iterate_eval
    if len(dataset.test) == 0:
        return None, None
    set_phase("evaluation")
    t0 = time.perf_counter()
    model = strategy.eval_model()
    loss_sum, correct = 0.0, 0
    for x, labels in iterate_eval(dataset.test, batch_size, rank=world.Get_rank(),
                                  size=world.Get_size(), xp=xp, dtype=cfg.dtype,
                                  mean=dataset.mean, std=dataset.std):
        mean_loss, c = model.evaluate(x, labels)
        loss_sum += float(mean_loss) * len(labels)
        correct += int(c)
    # Peers evaluate as many samples as this rank: allow twice its own time beyond the deadline.
    local_s = time.perf_counter() - t0
    parts = agree(world, (loss_sum, correct), phase="evaluation",
                  timeout=_timeout(deadline) + 2 * local_s)
    n = len(dataset.test)
    return sum(c for _, c in parts) / n, sum(loss for loss, _ in parts) / n


def _timeout(deadline):
    return deadline.seconds if deadline is not None else None


def check_replicas(strategy, world, step, deadline=None):
    """Abort when the ranks' weights are not bit-identical (names the ranks that differ)."""
    sums = agree(world, strategy.checksum(), phase=f"replica check after step {step}",
                 timeout=_timeout(deadline))
    differ = [r for r, s in enumerate(sums) if s != sums[0]]
    if differ:
        raise TrainingError(f"replicas diverged at step {step}: weights on rank(s) "
                            f"{', '.join(map(str, differ))} differ from rank 0")
