"""python -m ringnet.train — train a CNN in one of ringnet's parallel structures.

``train(cfg, world)`` is the same run as a function (tests and benchmarks call it).
"""
if __name__ == "__main__":     # the program, not a library import: note stop signals from the
    from ringnet.early_signals import hold          # first line, pin BLAS threads before NumPy loads
    hold()
    from ringnet import start_watch                 # MPI's start-up bounded (its imports below)
    start_watch.watch()
    from ringnet.allocator import configure_allocator
    from ringnet.blas import configure_blas_threads
    configure_blas_threads()
    configure_allocator()

import collections
import contextlib
import dataclasses
import os
import statistics
import sys
import time

import numpy as np

from ringnet import backend, early_signals, graphs, resume
from ringnet.blas import blas_threads_in_use, check_blas_threads
from ringnet.environment import check_environment, run_knobs
from ringnet.evaluation import check_replicas, evaluate
from ringnet.config import DEFAULTS, TrainConfig, config_from_args, transport_usage_error
from ringnet.errors import (EXIT_STOPPED, USER_ERRORS, InputError, RunInputError,
                            TransportUnavailable, UsageError)
from ringnet.control import (Deadline, agree, check_same_run, collective, current_phase,
                             import_mpi, set_phase, stalled, watchdog)
from ringnet.cli import run_main
from ringnet.layers import Dropout
from ringnet.outputs import CheckpointLock, check_run_files
from ringnet.parallel import MODES
from ringnet.progress import Progress, interactive, print_summary, progress_interval, write_summary
from ringnet.stats import GPU_LOSS_EVERY, LossReads
from ringnet.stopping import StopSignals
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


def _place(cfg, world, device):
    """Bind the GPU and build the transport (parallel modes); return (Placement, transport).

    ``device="cpu"`` touches no CUDA. Collective; a GPU that cannot run is a UsageError.
    """
    from ringnet import comm as ringcomm
    try:
        if MODES[cfg.mode].distributed:
            transport = ringcomm.make_transport(cfg.transport, world, device=device)
            return transport.placement, transport
        from ringnet.placement import layout
        if device == "cpu":
            if cfg.transport == "nccl" and os.environ.get("RINGNET_NCCL", "") != "standin":
                # the check a parallel mode's transport makes, so one process is told the same
                raise TransportUnavailable("transport nccl moves GPU memory, but the device is "
                                           "the CPU", "cpu-device", transport="nccl")
            return ringcomm.Placement("cpu").locate(layout(world)), None
        device_id, bus_id, _ = ringcomm.bind_gpu(world)
        return ringcomm.Placement("gpu", f"GPU {device_id} ({bus_id})").locate(layout(world)), None
    except TransportUnavailable as exc:
        raise transport_usage_error(exc) from None
    except RuntimeError as exc:     # check_gpu: a CuPy that imports but cannot run
        raise UsageError(str(exc)) from None


def setup(cfg, world, dataset_from=None):
    """Resolve the config, pick the device, open the data, build model and strategy.

    Returns ``(cfg, xp, dataset, model, strategy, loader)``: what ``python -m ringnet.train``
    trains with, for a program that runs its steps itself (the performance model's profile).
    ``dataset_from``: the checkpoint ``cfg.dataset`` was read from, if it was (then only a
    name is looked up, never a path). Rank 0 checks the run's files (:func:`_check_files`).
    """
    dataset_given = cfg.dataset is not None
    from ringnet.data import ShardedLoader, check_compatible, open_dataset
    from ringnet.data.catalog import is_dataset_name
    from ringnet.models import MODELS, build_model
    from ringnet.optim import SGD, LRPolicy
    from ringnet import parallel

    rank, size = world.Get_rank(), world.Get_size()
    cfg = collective(world, cfg.resolved, size)
    collective(world, check_environment)      # a bad RINGNET_* value: one line, before any work
    collective(world, check_blas_threads)
    # Before anything whose control flow depends on the settings: every rank runs the same.
    check_same_run(world, config_fingerprint(cfg))

    def pick_device():
        try:
            return backend.get_xp(cfg.device)
        except RuntimeError as exc:
            raise UsageError(f"--device {cfg.device}: {exc}") from None
    xp = collective(world, pick_device)
    if cfg.device == "auto" and size > 1 and any(agree(world, xp is np)):
        xp = np     # some rank has no usable GPU: every rank computes on the CPU
    placement, transport = collective(world, _place, cfg, world, "cpu" if xp is np else "gpu")
    spec = MODELS[cfg.model]

    def open_data():
        if dataset_from is not None and not is_dataset_name(cfg.dataset):
            raise UsageError(f"checkpoint {dataset_from}: attribute dataset is {cfg.dataset!r}, "
                             f"a path; a path read from a file is not opened: pass --dataset "
                             f"with the data set to continue on")
        try:
            ds = open_dataset(cfg.dataset, seed=cfg.seed, data_dir=cfg.data_dir,
                              input_shape=spec.input_shape, num_classes=spec.num_classes,
                              synthetic_size=cfg.synthetic_size,
                              names_only=dataset_from is not None)
        except InputError as exc:
            if dataset_given:
                raise
            raise UsageError(f"{exc} ({cfg.dataset} is the default data set of model "
                             f"{cfg.model}; --dataset synthetic needs no file)") from None
        # The last layer is sized from the data set: any class count >= 2 fits every model.
        check_compatible(ds, spec.input_shape, ds.num_classes, model=cfg.model)
        if ds.num_classes < 2:
            raise UsageError(f"data set {cfg.dataset} has {ds.num_classes} class; "
                             "a classifier needs at least 2")
        if len(ds.train) < cfg.batch_size:
            raise UsageError(f"data set {cfg.dataset} has {len(ds.train)} training images, "
                             f"fewer than one global batch of {cfg.batch_size}")
        ds.mean     # the statistics pass reads every training image: read errors show here
        return ds
    dataset = collective(world, open_data)
    prints = collective(world, dataset.fingerprint)
    check_same_run(world, prints)
    dataset.content = prints["data set content"]     # recorded in checkpoints
    # Rank 0 writes every output: it checks them against each other and its inputs.
    data_file = (cfg.dataset, dataset.path) if dataset.path is not None else None
    collective(world, lambda: _check_files(cfg, data_file) if rank == 0 else None)

    model = build_model(cfg.model, dtype=cfg.dtype, xp=xp, seed=cfg.seed,
                        num_classes=dataset.num_classes)
    if cfg.save:
        from ringnet.checkpoint import check_writable, checkpoint_bytes
        # Before training, not after hours of it: only rank 0 writes the file.
        need = checkpoint_bytes(model.num_params, np.dtype(cfg.dtype).itemsize)
        collective(world, lambda: check_writable(cfg.save, need) if rank == 0 else None)
    policy = LRPolicy(cfg.lr_policy, cfg.lr, gamma=cfg.gamma, stepsize=cfg.stepsize, power=cfg.power)

    def make_optimizer(n):
        return SGD(n, policy, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                   xp=xp, dtype=cfg.dtype)

    strategy = collective(world, parallel.create, cfg.mode, model, make_optimizer,
                          world if MODES[cfg.mode].distributed else None,
                          delay=cfg.delay, transport=transport,
                          compensation=cfg.delay_compensation, warmup=cfg.warmup_steps,
                          topology=cfg.topology, inter_link=cfg.inter_link)
    strategy.placement = placement
    placement.graphs = graphs.setup(cfg.cuda_graphs, strategy, xp)
    loader = ShardedLoader(dataset.train, cfg.batch_size, rank=rank, size=size, seed=cfg.seed,
                           shuffle=cfg.shuffle, xp=xp, dtype=cfg.dtype, mean=dataset.mean,
                           std=dataset.std, augment=cfg.augment)
    return cfg, xp, dataset, model, strategy, loader


def _check_files(cfg, data_file):
    """Rank 0: :func:`ringnet.outputs.check_run_files` of ``cfg``'s files, and an existing
    ``--save`` file must be a checkpoint (or empty), not something else a save would replace."""
    from ringnet.autosave import HEARTBEAT_ENV
    from ringnet.checkpoint import check_replaceable
    check_run_files(save=cfg.save, json_file=cfg.json_file, trace=cfg.trace,
                    heartbeat=os.environ.get(HEARTBEAT_ENV) or None,
                    resume=None if cfg.resume == "auto" else cfg.resume, data_file=data_file)
    if cfg.save:
        try:
            check_replaceable(cfg.save)
        except InputError as exc:
            raise UsageError(f"--save {exc}") from None


def _named_data_file(cfg):
    """(name, path) of a data set given with --dataset; None if not given, synthetic or not
    found (opening it says why later)."""
    from ringnet.data import find_dataset
    try:
        return (cfg.dataset, find_dataset(cfg.dataset, cfg.data_dir)) if cfg.dataset not in \
            (None, "synthetic") else None
    except InputError:
        return None


# Settings that may differ between ranks: where files are and what is printed.
_PER_RANK = ("dataset", "data_dir", "save", "resume", "json", "json_file", "progress", "quiet")


def config_fingerprint(cfg):
    """Return {field: value} of the resolved settings every rank must share."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _PER_RANK}
    fields["save"] = cfg.save is not None        # the paths may differ, whether they are set not
    fields["resume"] = cfg.resume is not None
    prints = {"--" + k.replace("_", "-"): repr(v) for k, v in fields.items()}
    # environment knobs that change what is computed or exchanged, named as they are set
    prints.update({name: "unset" if value is None else repr(value)
                   for name, value in run_knobs().items()})
    return prints


def _transport_deadline(strategy, seconds):
    """Bound every transfer of ``strategy``'s transport by ``seconds``."""
    transport = getattr(strategy, "transport", None)
    if transport is not None and hasattr(transport, "timeout_s"):
        transport.timeout_s = seconds


def _log(cfg, world, text):
    """Write one whole log line on rank 0 (stderr under --json: stdout is the JSON's), flushed."""
    if world.Get_rank() == 0 and not cfg.quiet:
        from tqdm import tqdm
        out = sys.stderr if cfg.json else sys.stdout
        with tqdm.external_write_mode(file=out):   # clears and redraws a progress bar
            out.write(text + "\n")
            out.flush()


def _one_rank_note(cfg):
    """The note of a parallel mode started on one rank (mpirun forgotten): it exchanges
    nothing; how to start N."""
    alone = ("it trains as --mode single" if not cfg.delay else
             f"it trains alone, with the delay-{cfg.delay} update")
    return (f"ringnet: note: mode {cfg.mode} on 1 rank exchanges nothing ({alone}); start N "
            f"ranks with mpirun -np N python -m ringnet.train --mode {cfg.mode} ...")


def _took(read, recent, epoch_losses, spe, bar):
    """Record the losses ``read`` ([(step, loss)]); return the epoch's (first step, [loss])."""
    for step, loss in read:
        recent.append(loss)
        if step % spe == 0 and step > epoch_losses[0]:
            epoch_losses = (step, [])
        epoch_losses[1].append(loss)
        if bar is not None:
            bar.update(step + 1, loss)
    return epoch_losses


def _epoch_line(world, epoch, spe, losses, test_acc, test_loss, deadline):
    """The log line of ``epoch`` (1-based): its train loss is the mean over every rank of the
    losses of the epoch's steps this run made (collective). ``losses``: (first step, [loss])
    of this rank; after a resume inside the epoch the line says which steps it averages."""
    first, mine = losses
    every = agree(world, (float(np.sum(list(mine))), len(mine)), phase="epoch statistics",
                  timeout=deadline.seconds)
    mean = sum(total for total, _ in every) / max(1, sum(n for _, n in every))
    start = (epoch - 1) * spe
    # What the train loss is: the epoch's mean (over every rank); after a resume inside the
    # epoch, the mean of the steps this run made, which the end of the line names.
    label = "" if first > start else " (epoch mean" + (", all ranks)" if len(every) > 1 else ")")
    line = (f"epoch {epoch:3d}  train loss {mean:.4f}{label}  test loss {test_loss:.4f}  "
            f"test acc {100 * test_acc:6.2f}%")
    if first > start:
        line += f"  (train loss of steps {first}-{start + spe - 1} of {start}-{start + spe - 1}: resumed)"
    return line


def train(cfg=None, world=None, **overrides):
    """Run one training job on ``world`` (default MPI.COMM_WORLD); return a TrainResult."""
    cfg = dataclasses.replace(cfg or TrainConfig(), **overrides)
    if world is None:
        from ringnet.placement import check_world_size
        world = import_mpi().COMM_WORLD
        check_world_size(world.Get_size())
    from ringnet.comm.transport import CommTimeoutError     # after import_mpi(): needs mpi4py
    rank, size = world.Get_rank(), world.Get_size()
    t_start = time.perf_counter()
    try:
        # held: the checkpoint's lock, released when the run ends (or with the process)
        with StopSignals() as stopper, contextlib.ExitStack() as held:
            set_phase("setup")
            deadline = collective(world, Deadline)
            stopper.attach(world, lambda: deadline.seconds)
            return _train(cfg, world, deadline, rank, size, t_start, stopper, held)
    except CommTimeoutError as exc:
        raise stalled(world, exc, deadline) from None
    except USER_ERRORS as exc:
        # Set-up and save errors are agreed by every rank; what a rank meets while training
        # or evaluating (a corrupt chunk of a file-backed data set) only it knows: it speaks
        # and the job is aborted, rather than leaving the others waiting for it.
        phase = current_phase()
        if not phase.startswith(("step ", "evaluation", "replica check")):
            raise
        raise RunInputError(f"{phase}: {exc}") from None


def _train(cfg, world, deadline, rank, size, t_start, stopper, held):
    """The run once the deadline is known (see :func:`train`); ``held``: an ExitStack that
    releases what the run holds (its checkpoint's lock) when it ends."""
    asked_batch = cfg.batch_size
    checkpoint = resume_note = resumed = None
    auto_note = None
    auto = cfg.resume == "auto"
    # Communicator creation blocks inside MPI: a watchdog bounds the whole setup.
    with watchdog("setup", 2 * deadline.ceiling + 10):
        # Before any rank branches on --resume or --save: every rank was asked the same.
        resume.check_same_start(cfg, world)
        # Before anything reads or writes: the outputs, against the inputs named so far
        # (checked again with the data set found), then the lock on the checkpoint.
        collective(world, lambda: _check_files(cfg, _named_data_file(cfg)) if rank == 0 else None)
        if cfg.save:
            lock = collective(world, lambda: CheckpointLock(cfg.save) if rank == 0 else None)
            if lock is not None:
                held.callback(lock.release)
                if lock.note:
                    _log(cfg, world, lock.note)
        if auto:
            if not cfg.save:
                collective(world, cfg.resolved, size)       # says what --resume auto needs
            cfg, auto_note = resume.auto(cfg, world)
        if cfg.resume:
            cfg, checkpoint, (resume_note, resumed) = resume.settings(cfg, world)
        dataset_from = (cfg.resume if resumed is not None and "dataset" in resumed["from_checkpoint"]
                        else None)
        cfg, xp, dataset, model, strategy, loader = setup(cfg, world, dataset_from=dataset_from)
        spe = loader.steps_per_epoch
        total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * spe
        if auto and checkpoint is not None and checkpoint[3]["step"] >= total_steps:
            return _finished(cfg, world, size, dataset, strategy, checkpoint[3]["step"],
                             total_steps, resumed)
        step = (resume.restore(cfg, world, strategy, checkpoint, total_steps, dataset, resumed)
                if checkpoint else 0)
        if cfg.save:
            from ringnet.checkpoint import stored_step
            saved = agree(world, stored_step(cfg.save) if rank == 0 else None,
                          phase="setup")[0]
            collective(world, resume.check_not_behind, cfg, saved, step, total_steps)
    _transport_deadline(strategy, deadline.seconds)
    if auto_note:
        _log(cfg, world, auto_note)
    if checkpoint is not None:
        changed = resumed["overridden"].get("data_content")
        if changed:
            resume_note += (f"; overridden: data set content {changed['given']} (checkpoint: "
                            f"{changed['checkpoint']})")
        _log(cfg, world, resume_note)

    batch_text = f"global batch {cfg.batch_size}"
    if asked_batch is None and checkpoint is None and cfg.batch_size != DEFAULTS["batch_size"]:
        batch_text += (f" (the default {DEFAULTS['batch_size']} rounded to a multiple of "
                       f"{size} ranks)")
    steps_text = (f"steps {step} to {total_steps} ({total_steps - step} to run)" if step
                  else f"{total_steps} steps")
    delay_text = f"delay {cfg.delay}" + (f", {cfg.delay_compensation}" if cfg.delay else "")
    if cfg.warmup_steps:
        delay_text += f" after {cfg.warmup_steps} synchronous warm-up steps"
    threads = agree(world, blas_threads_in_use(), phase="setup", timeout=deadline.seconds)
    known = sorted({t for t in threads if t})
    threads_text = ""
    if xp is np and known:
        threads_text = (f", {known[0]}" if len(known) == 1 else f", {known[0]}-{known[-1]}") + \
            f" BLAS thread{'s' if known[-1] > 1 else ''} per rank"
    _log(cfg, world, f"ringnet: {cfg.mode} ({delay_text}) on {size} rank(s), "
                     f"{strategy.placement.describe()}{threads_text}, model {cfg.model} "
                     f"({model.num_params:,} parameters, {model.num_classes} outputs: one per class "
                     f"of the data), data {dataset.name} ({len(dataset.train)} train / "
                     f"{len(dataset.test)} test), {batch_text}, lr {cfg.lr:g}, {steps_text}")
    if size == 1 and MODES[cfg.mode].distributed and not cfg.quiet:
        print(_one_rank_note(cfg), file=sys.stderr, flush=True)     # once: the only rank

    bar = None
    interval = collective(world, progress_interval)
    if rank == 0 and cfg.progress and not cfg.quiet:
        bar = Progress(total_steps, step, cfg.batch_size, spe, interactive(), interval,
                       ranks=size)

    tracer = Tracer(world, cfg.trace) if cfg.trace else None
    recent = collections.deque(maxlen=spe)    # local losses of the last epoch's worth of steps
    losses = LossReads(1 if xp is np else GPU_LOSS_EVERY, spe, cfg.lr)   # read, checked
    epoch_losses = (step, [])                 # (first step, local losses) of the epoch running
    saver = resume.saver(cfg, world, strategy, spe, dataset)   # --save-every, heartbeat
    saver.start(step)
    first_step = step
    # bytes_per_step and the waits count the training steps only
    sent_before, waits_before = strategy.bytes_moved()[0], strategy.wait_totals()
    from ringnet.placement import group_cpu_s
    group_before = group_cpu_s()    # the control group's CPU over the loop (group_cpu_s)
    t_train = time.perf_counter()
    test_acc = test_loss = None
    evals, eval_s = [], 0.0     # [step, epoch, training seconds before it, accuracy]
    fetched = {"data": 0.0}     # the training thread's time getting batches (data_s)
    try:
        # Overflow on the way to a non-finite loss is reported once, below, not as warnings.
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            t_step = time.perf_counter()
            while step < total_steps:
                epoch, offset = divmod(step, spe)
                note = dataset.check_unchanged(epoch, step > first_step)
                if note:
                    _log(cfg, world, note)
                batches = loader.epoch(epoch, start_step=offset)
                for x, labels in timed(batches, totals=fetched):
                    set_phase(f"step {step}")
                    set_dropout_step(strategy.model, step)
                    loss, _ = strategy.step(x, labels, step)
                    epoch_losses = _took(losses.add(step, loss), recent, epoch_losses, spe, bar)
                    step += 1
                    now = time.perf_counter()
                    deadline.record(now - t_step)     # data wait included: it delays peers too
                    t_step = now
                    _transport_deadline(strategy, deadline.seconds)
                    saver.after_step(step, total_steps)
                    if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
                        t_eval = time.perf_counter()
                        strategy.drain()
                        acc, _ = evaluate(strategy, dataset, cfg, world, xp, deadline=deadline)
                        evals.append([step, round(step / spe, 4), t_eval - t_train - eval_s, acc])
                        eval_s += time.perf_counter() - t_eval
                    if cfg.check_every and step % cfg.check_every == 0:
                        strategy.drain()
                        check_replicas(strategy, world, step, deadline)
                    if stopper.agreed():
                        break
                    if step >= total_steps:
                        break
                epoch_losses = _took(losses.read(), recent, epoch_losses, spe, bar)
                if hasattr(batches, "close"):
                    batches.close()
                if stopper.stopped_by:
                    break
                if step % spe == 0 and cfg.eval_every_epoch and step < total_steps:
                    t_eval = time.perf_counter()
                    strategy.drain()
                    test_acc, test_loss = evaluate(strategy, dataset, cfg, world, xp,
                                                   deadline=deadline)
                    eval_s += time.perf_counter() - t_eval
                    _log(cfg, world, _epoch_line(world, step // spe, spe, epoch_losses, test_acc,
                                                 test_loss, deadline))
                    t_step = time.perf_counter()
            set_phase(f"step {step}")
            strategy.drain()
    finally:
        if bar is not None:
            bar.close()
        if tracer is not None:
            tracer.stop()
    train_s = time.perf_counter() - t_train
    group_after = group_cpu_s()
    group_used = group_after - group_before if None not in (group_before, group_after) else float("nan")
    step_bytes = strategy.bytes_moved()[0] - sent_before
    waited = [b - a for a, b in zip(waits_before, strategy.wait_totals())]

    check_replicas(strategy, world, step, deadline)
    stopped = stopper.stopped_by
    if stopped:
        # Stopped by a signal: the time left (a preemption's grace) goes to the checkpoint,
        # not to an evaluation.
        test_acc = test_loss = None
    else:
        test_acc, test_loss = evaluate(strategy, dataset, cfg, world, xp, deadline=deadline)
        if cfg.eval_every:
            evals.append([step, round(step / spe, 4), train_s - eval_s, test_acc])
        if step % spe == 0 and cfg.eval_every_epoch and step > first_step and test_acc is not None:
            _log(cfg, world, _epoch_line(world, step // spe, spe, epoch_losses, test_acc,
                                         test_loss, deadline))

    if cfg.save:
        set_phase("save")
        saver.finish(step)   # rank 0 writes; every rank learns whether it worked
    saver.close()
    if stopped:
        kept = (f"checkpoint {cfg.save} holds it; the same command with --resume auto (or "
                f"--resume {cfg.save}) continues" if cfg.save else
                "no --save, so nothing was written")
        _log(cfg, world, f"stopped by {stopped} at step {step} of {total_steps}: {kept}")

    set_phase("statistics")
    stats = strategy.stats
    stats.resolve()             # device time of the last GPU spans
    steps_run = step - first_step
    sent, received = strategy.bytes_moved()
    # The train loss: every rank's losses of the last epoch's worth of steps, summed as the
    # epoch line sums them, so a run that ends on a whole epoch prints the same value twice.
    per_rank = np.array([stats.compute_s, stats.comm_wait_s, stats.update_s, fetched["data"],
                         stats.comm_total_s, sent, received, step_bytes,
                         float(np.sum(list(recent))), len(recent), stats.compute_cpu_s,
                         group_used, *waited], dtype=np.float64)
    every = np.array(agree(world, per_rank, phase="statistics", timeout=deadline.seconds))
    mean = every.mean(axis=0)
    train_loss = float(sum(every[:, 8]) / sum(every[:, 9])) if len(recent) else float("nan")
    loss_span = ""
    if recent and not (step % spe == 0 and len(recent) == spe and cfg.eval_every_epoch):
        loss_span = f" (mean of steps {step - len(recent)}-{step - 1})"
    busiest = every[:, 5].max()     # the root of tree/master carries most
    times = stats.step_times[2:] or stats.step_times
    step_ms = 1000 * statistics.median(times) if times else float("nan")
    # Under a CPU quota (a node of hpc/cluster.sh --cpus-per-node) a step ends at whole
    # periods of the quota: steps of the same work take one or two periods more or less,
    # and their median lands on one of those values. Their mean is the throughput the
    # quota allows (bench model --validate compares it there).
    step_mean_ms = 1000 * statistics.fmean(times) if times else float("nan")
    summary = {
        "mode": cfg.mode, "delay": cfg.delay, "delay_compensation": cfg.delay_compensation,
        "warmup_steps": cfg.warmup_steps,
        "ranks": size, "model": cfg.model,
        "dataset": dataset.name, "device": "gpu" if xp is not np else "cpu",
        "transport": getattr(strategy.transport, "name", None) if strategy.transport else None,
        "gpu": strategy.placement.gpu, "transport_reason": strategy.placement.reason or None,
        "nodes": strategy.placement.nodes, "rank_nodes": strategy.placement.rank_nodes,
        "rank_local_ranks": strategy.placement.rank_local_ranks,
        "mpi_path": strategy.placement.mpi_path, "progress": strategy.placement.progress,
        "topology": strategy.placement.topology, "cuda_graphs": graphs.status(strategy),
        "dtype": cfg.dtype, "batch_size": cfg.batch_size, "steps": step,
        "epochs": round(step / spe, 3), "test_accuracy": test_acc, "test_loss": test_loss,
        "train_loss": train_loss,
        "images_per_sec": steps_run * cfg.batch_size / (train_s - eval_s) if train_s > eval_s else 0.0,
        "step_ms": step_ms, "step_mean_ms": step_mean_ms,
        "time_s": time.perf_counter() - t_start, "train_s": train_s, "eval_s": eval_s,
        "compute_s": mean[0], "compute_cpu_s": mean[10], "comm_wait_s": mean[1], "update_s": mean[2],
        "data_s": mean[3], "wait_cpu_s": mean[12], "waits": mean[13], "waits_slept": mean[14],
        # the ranks' control groups (a node's, on hpc/cluster.sh): their CPU over the loop
        "group_cpu_s": float(mean[11]) if np.isfinite(mean[11]) else None,
        "comm_total_s": mean[4], "overlap": stats.overlap(),
        "bytes_sent": int(mean[5]), "bytes_recv": int(mean[6]),
        "bytes_per_step": int(mean[7] / steps_run) if steps_run else 0,
        "bytes_sent_max": int(busiest),
        "num_params": model.num_params,
        "blas_threads": known[-1] if known else None,
    }
    if len(known) > 1:
        summary["blas_threads_by_rank"] = threads
    if cfg.eval_every:
        summary["evals"] = evals
    if resumed is not None:
        summary["resumed"] = resumed
    summary.update(getattr(strategy, "extra_summary", lambda: {})())
    if stopped:
        summary["stopped"] = {"signal": stopped, "step": step,
                              "checkpoint": str(cfg.save) if cfg.save else None}
    tested = ("not evaluated (stopped)" if stopped else "no test split" if test_acc is None else
              f"test loss {test_loss:.4f}, test accuracy {100 * test_acc:.2f}%")
    _log(cfg, world, f"{'stopped' if stopped else 'done'}: {step} steps ({step / spe:.2f} epochs), "
                     f"train loss {train_loss:.4f}"
                     f"{loss_span}, {tested}, "
                     f"{summary['images_per_sec']:.0f} images/s, {summary['time_s']:.1f} s")
    if tracer is not None:
        collective(world, tracer.close, summary)
    if cfg.json_file and rank == 0:
        write_summary(cfg.json_file, summary)
    if cfg.json and rank == 0:
        print_summary(summary)
    return TrainResult(summary, strategy, cfg)


def _finished(cfg, world, size, dataset, strategy, done, total_steps, resumed):
    """``--resume auto`` of a run whose checkpoint holds its last step already: the same
    command on every requeue is fine, so say so and exit 0 (its --json-file is left as is)."""
    asked = (f"--steps {cfg.steps}" if cfg.steps is not None else
             f"--epochs {cfg.epochs} ({total_steps} steps)")
    _log(cfg, world, f"--resume auto: checkpoint {cfg.save} is at step {done} and this run "
                     f"asks for {asked}: the run is finished, nothing to do")
    summary = {"mode": cfg.mode, "delay": cfg.delay, "ranks": size, "model": cfg.model,
               "dataset": dataset.name, "steps": done, "resumed": resumed,
               "finished": {"checkpoint": str(cfg.save), "step": done, "steps_asked": total_steps}}
    if cfg.json and world.Get_rank() == 0:
        print_summary(summary)
    return TrainResult(summary, strategy, cfg)


def set_dropout_step(model, step):
    """Point every Dropout layer at global step ``step``: its masks are a function of the
    seed, the step and the sample (no stream state), so a resumed run or another rank
    count applies the same masks as the uninterrupted run."""
    for _, layer in model.layers:
        if isinstance(layer, Dropout):
            layer.step = step


def main(argv=None):
    """Entry point of ``python -m ringnet.train``."""
    with StopSignals():         # a signal after the last step: the run ends as it would have
        result = train(config_from_args(argv))
        set_phase("shutdown")
        # Drains the last exchange (under the transport deadline); then every rank arrives.
        result.strategy.close()
        agree(import_mpi().COMM_WORLD, None, phase="shutdown")
    early_signals.settle()      # the exit code stands, whatever signal comes while exiting
    return EXIT_STOPPED if result.summary.get("stopped") else 0


if __name__ == "__main__":
    start_watch.up()            # MPI is up: the imports above started it
    run_main(main)
