"""python -m ringnet.train — train a CNN in one of ringnet's parallel structures.

``train(cfg, world)`` is the same run as a function (tests and benchmarks call it).
"""
import collections
import json
import math
import statistics
import sys
import time

import numpy as np

from ringnet import backend
from ringnet.config import TrainConfig, config_from_args
from ringnet.errors import TrainingError, UsageError, collective, import_mpi, run_main
from ringnet.progress import Progress, progress_interval
from ringnet.trace import Tracer, timed

__all__ = ["train", "main", "TrainResult"]


class TrainResult:
    """What a run leaves behind: the summary dict, the strategy and its model."""

    def __init__(self, summary, strategy, config):
        self.summary = summary
        self.strategy = strategy
        self.config = config

    @property
    def model(self):
        return self.strategy.eval_model()


def _world():
    from ringnet.slurm import check_world_size
    world = import_mpi().COMM_WORLD
    check_world_size(world.Get_size())
    return world


def _setup(cfg, world):
    """Resolve the config, pick the device, open the data, build model and strategy."""
    from ringnet.data import ShardedLoader, check_compatible, open_dataset
    from ringnet.models import MODELS, build_model
    from ringnet.optim import SGD, LRPolicy
    from ringnet import parallel

    rank, size = world.Get_rank(), world.Get_size()
    cfg = collective(world, cfg.resolved, size)

    def pick_device():
        try:
            return backend.get_xp(cfg.device)
        except RuntimeError as exc:
            raise UsageError(str(exc)) from None
    xp = collective(world, pick_device)
    if xp is not np:
        from ringnet.comm import local_rank
        backend.bind_device(local_rank(world)[0])

    spec = MODELS[cfg.model]

    def open_data():
        ds = open_dataset(cfg.dataset, seed=cfg.seed, data_dir=cfg.data_dir,
                          input_shape=spec.input_shape, num_classes=spec.num_classes,
                          synthetic_size=cfg.synthetic_size)
        check_compatible(ds, spec.input_shape, spec.num_classes, model=cfg.model)
        if len(ds.train) < cfg.batch_size:
            raise UsageError(f"data set {cfg.dataset} has {len(ds.train)} training images, "
                             f"fewer than one global batch of {cfg.batch_size}")
        return ds
    dataset = collective(world, open_data)
    if cfg.save:
        from ringnet.checkpoint import check_writable
        # Before training, not after hours of it: only rank 0 writes the file.
        collective(world, lambda: check_writable(cfg.save) if rank == 0 else None)
    if cfg.trace:
        from ringnet.trace import check_trace_path
        collective(world, lambda: check_trace_path(cfg.trace) if rank == 0 else None)

    model = build_model(cfg.model, dtype=cfg.dtype, xp=xp, seed=cfg.seed)
    policy = LRPolicy(cfg.lr_policy, cfg.lr, gamma=cfg.gamma, stepsize=cfg.stepsize, power=cfg.power)

    def make_optimizer(n):
        return SGD(n, policy, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                   xp=xp, dtype=cfg.dtype)

    strategy = collective(world, parallel.create, cfg.mode, model, make_optimizer,
                          world if cfg.mode != "single" else None,
                          delay=cfg.delay, transport=cfg.transport)
    loader = ShardedLoader(dataset.train, cfg.batch_size, rank=rank, size=size, seed=cfg.seed,
                           shuffle=cfg.shuffle, xp=xp, dtype=cfg.dtype, mean=dataset.mean,
                           std=dataset.std, augment=cfg.augment)
    return cfg, xp, dataset, model, strategy, loader


def evaluate(strategy, dataset, cfg, world, xp, batch_size=256):
    """Return (test accuracy, mean test loss) over the whole test set, summed over ranks."""
    from ringnet.data import iterate_eval
    model = strategy.eval_model()
    loss_sum, correct = 0.0, 0
    for x, labels in iterate_eval(dataset.test, batch_size, rank=world.Get_rank(),
                                  size=world.Get_size(), xp=xp, dtype=cfg.dtype,
                                  mean=dataset.mean, std=dataset.std):
        mean_loss, c = model.evaluate(x, labels)
        loss_sum += float(mean_loss) * len(labels)
        correct += int(c)
    totals = world.allreduce(np.array([loss_sum, correct], dtype=np.float64))
    n = max(1, len(dataset.test))
    return float(totals[1]) / n, float(totals[0]) / n


def check_replicas(strategy, world, step):
    """Abort when the ranks' weights are not bit-identical (names the ranks that differ)."""
    sums = world.allgather(strategy.checksum())
    differ = [r for r, s in enumerate(sums) if s != sums[0]]
    if differ:
        raise TrainingError(f"replicas diverged at step {step}: weights on rank(s) "
                            f"{', '.join(map(str, differ))} differ from rank 0")


def _interactive():
    """Return True when a person watches: stderr is a terminal, or (under mpirun, where
    stderr is a pipe to the launcher) the process still has a controlling terminal."""
    if sys.stderr.isatty():
        return True
    try:
        with open("/dev/tty", "rb"):
            return True
    except OSError:
        return False


def _log(cfg, world, text):
    if world.Get_rank() == 0 and not cfg.quiet:
        from tqdm import tqdm
        tqdm.write(text, file=sys.stderr if cfg.json else sys.stdout)


def train(cfg=None, world=None, **overrides):
    """Run one training job on ``world`` (default MPI.COMM_WORLD); return a TrainResult."""
    import dataclasses
    cfg = dataclasses.replace(cfg or TrainConfig(), **overrides)
    world = world or _world()
    rank, size = world.Get_rank(), world.Get_size()
    t_start = time.perf_counter()
    cfg, xp, dataset, model, strategy, loader = _setup(cfg, world)

    spe = loader.steps_per_epoch
    total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * spe
    step = 0
    if cfg.resume:
        from ringnet.checkpoint import load_checkpoint
        params, momentum, prev, attrs = collective(world, load_checkpoint, cfg.resume)

        def restore():
            if attrs.get("model") != cfg.model:
                raise UsageError(f"checkpoint {cfg.resume} holds model {attrs.get('model')!r}, "
                                 f"not {cfg.model!r}")
            try:
                strategy.load_full_state(params, momentum, prev if cfg.delay else None)
            except ValueError as exc:
                raise UsageError(f"checkpoint {cfg.resume}: {exc}") from None
        collective(world, restore)
        step = int(attrs.get("step", 0))
        if step >= total_steps:
            _log(cfg, world, f"checkpoint is at step {step}, already >= {total_steps} steps")

    _log(cfg, world, f"ringnet: {cfg.mode} (delay {cfg.delay}) on {size} rank(s), "
                     f"{'GPU' if xp is not np else 'CPU'}, model {cfg.model} "
                     f"({model.num_params:,} parameters), data {dataset.name} "
                     f"({len(dataset.train)} train / {len(dataset.test)} test), "
                     f"global batch {cfg.batch_size}, {total_steps} steps")

    bar = None
    interval = collective(world, progress_interval)
    if rank == 0 and cfg.progress and not cfg.quiet:
        bar = Progress(total_steps, step, cfg.batch_size, spe, _interactive(), interval)

    tracer = Tracer(world, cfg.trace) if cfg.trace else None
    recent = collections.deque(maxlen=spe)    # local losses of the last epoch's worth of steps
    first_step = step
    t_train = time.perf_counter()
    test_acc = test_loss = None
    try:
        while step < total_steps:
            epoch, offset = divmod(step, spe)
            batches = loader.epoch(epoch, start_step=offset)
            for x, labels in timed(batches):
                loss, _ = strategy.step(x, labels, step)
                loss = float(loss)
                if not math.isfinite(loss):
                    raise TrainingError(f"loss is {loss} at step {step} (epoch {epoch}): training "
                                        f"diverged; try a lower --lr (now {cfg.lr})")
                recent.append(loss)
                step += 1
                if bar is not None:
                    bar.update(step, loss)
                if cfg.check_every and step % cfg.check_every == 0:
                    strategy.drain()
                    check_replicas(strategy, world, step)
                if step >= total_steps:
                    break
            if hasattr(batches, "close"):
                batches.close()
            if step % spe == 0 and cfg.eval_every_epoch and step < total_steps:
                strategy.drain()
                test_acc, test_loss = evaluate(strategy, dataset, cfg, world, xp)
                _log(cfg, world, f"epoch {step // spe:3d}  train loss {np.mean(recent):.4f}  "
                                 f"test acc {100 * test_acc:6.2f}%")
        strategy.drain()
    finally:
        if bar is not None:
            bar.close()
        if tracer is not None:
            tracer.stop()
    train_s = time.perf_counter() - t_train

    check_replicas(strategy, world, step)
    test_acc, test_loss = evaluate(strategy, dataset, cfg, world, xp)
    local_loss = float(np.mean(recent)) if recent else float("nan")
    train_loss = world.allreduce(local_loss) / size

    if cfg.save:
        from ringnet.checkpoint import save_checkpoint
        params, momentum, prev = strategy.full_state()

        def save():  # rank 0 writes; every rank learns whether it worked
            if rank == 0:
                save_checkpoint(cfg.save, params, momentum, prev if cfg.delay else None,
                                model=cfg.model, mode=cfg.mode, delay=cfg.delay, ranks=size,
                                step=step, epoch=step // spe, seed=cfg.seed, dtype=cfg.dtype,
                                lr=cfg.lr, lr_policy=cfg.lr_policy)
        collective(world, save)

    stats = strategy.stats
    steps_run = step - first_step
    sent, received = strategy.bytes_moved()
    per_rank = np.array([stats.compute_s, stats.comm_wait_s, stats.update_s, loader.wait_s,
                         stats.comm_total_s, sent, received], dtype=np.float64)
    mean = world.allreduce(per_rank) / size
    MPI = import_mpi()
    busiest = world.allreduce(float(sent), op=MPI.MAX)     # the root of tree/master carries most
    times = stats.step_times[2:] or stats.step_times
    step_ms = 1000 * statistics.median(times) if times else float("nan")
    summary = {
        "mode": cfg.mode, "delay": cfg.delay, "ranks": size, "model": cfg.model,
        "dataset": dataset.name, "device": "gpu" if xp is not np else "cpu",
        "transport": getattr(strategy.transport, "name", None) if strategy.transport else None,
        "dtype": cfg.dtype, "batch_size": cfg.batch_size, "steps": step,
        "epochs": round(step / spe, 3), "test_accuracy": test_acc, "test_loss": test_loss,
        "train_loss": train_loss,
        "images_per_sec": steps_run * cfg.batch_size / train_s if train_s > 0 else 0.0,
        "step_ms": step_ms, "time_s": time.perf_counter() - t_start, "train_s": train_s,
        "compute_s": mean[0], "comm_wait_s": mean[1], "update_s": mean[2], "data_s": mean[3],
        "comm_total_s": mean[4], "overlap": stats.overlap(),
        "bytes_sent": int(mean[5]), "bytes_recv": int(mean[6]),
        "bytes_per_step": int(mean[5] / steps_run) if steps_run else 0,
        "bytes_sent_max": int(busiest),
        "num_params": model.num_params,
    }
    summary.update(getattr(strategy, "extra_summary", lambda: {})())
    _log(cfg, world, f"done: {step} steps, test accuracy {100 * test_acc:.2f}%, "
                     f"{summary['images_per_sec']:.0f} images/s, {summary['time_s']:.1f} s")
    if tracer is not None:
        collective(world, tracer.close, summary)
    if cfg.json and rank == 0:
        print(json.dumps(summary), flush=True)
    return TrainResult(summary, strategy, cfg)


def main(argv=None):
    """Entry point of ``python -m ringnet.train``."""
    cfg = config_from_args(argv)
    result = train(cfg)
    result.strategy.close()
    return 0


if __name__ == "__main__":
    run_main(main)
