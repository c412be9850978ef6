"""mpirun -np N python -m ringnet.bench.ddp — the peer: PyTorch DistributedDataParallel on
ringnet's problem.

The same run as ``mpirun -np N python -m ringnet.train --mode master`` in every respect a
user chooses: the model (``ringnet.bench.layers.torch_model`` of the ringnet model built
from the same seed, so the same initial weights), the data set and its normalisation, the
global batch and the way it is split (ringnet's ``ShardedLoader``: rank r takes the r-th
contiguous B/N of the same globally shuffled batch), the recipe (the model's default lr,
lr policy, momentum and weight decay, resolved by ``TrainConfig``; the update is Caffe's,
``v <- m v + lr(it) (g + wd w); w <- w - v``, as ringnet's SGD), the steps or epochs and
the evaluations (every epoch unless --no-eval, every K steps with --eval-every K). What
differs is the peer's own: DDP averages the gradients over a gloo (CPU) or NCCL (GPU)
process group, bucketed and overlapped with the backward as DDP does, and every rank
updates the whole model. Dropout masks are PyTorch's.

Each rank reads its rank and size from MPI (the launcher is the same mpirun); rank 0 opens
the process group's TCP store on 127.0.0.1 on a free port and broadcasts the port over MPI,
so the ranks must share one node. One torch thread per rank. ``--json`` prints one summary
line on rank 0 with the fields ``ringnet.train --json`` has for what ``bench scaling``
reads (step_ms: the median step, forward to update, the first two left out; images_per_sec;
evals; test_accuracy ...); what DDP does not expose (exposed communication, overlap) is
null. On a GPU each step ends with a device synchronisation, so that its time is the
device's.
"""
if __name__ == "__main__":     # the program: pin BLAS threads before NumPy loads, as train does
    from ringnet.blas import configure_blas_threads
    configure_blas_threads()

import collections
import datetime
import json
import statistics
import sys
import time

import numpy as np

from ringnet.bench import options
from ringnet.cli import ArgumentParser
from ringnet.errors import UsageError

__all__ = ["main", "build_parser", "TORCH_HINT", "require_torch", "caffe_sgd_step"]

TORCH_HINT = ("--vs ddp needs PyTorch, which is not installed: pip install torch==2.13.0 "
              "(the CPU build; or pip install -e \".[bench]\")")


def require_torch():
    """Return the torch module, or raise the one-line UsageError saying how to install it."""
    try:
        import torch
    except ImportError:
        raise UsageError(TORCH_HINT) from None
    return torch


def build_parser():
    p = ArgumentParser(prog="mpirun -np N python -m ringnet.bench.ddp", description=__doc__.split("\n\n")[0])
    options.add_model(p, None, shown="digits, as train's")
    options.add_dataset(p, None, shown="the model's, as train's")
    options.add_data_dir(p)
    options.add_batch_size(p, None, "GLOBAL batch", shown="train's")
    options.add_steps(p, None, "optimizer steps", shown="from --epochs")
    options.add_epochs(p, None, "epochs", shown="the model's")
    options.add_lr(p, None, "base lr", shown="the model's")
    p.add_argument("--lr-policy", choices=("fixed", "step", "inv"), default=None)
    p.add_argument("--gamma", type=float, default=None)
    p.add_argument("--stepsize", type=int, default=None)
    p.add_argument("--power", type=float, default=None)
    p.add_argument("--momentum", type=float, default=None)
    p.add_argument("--weight-decay", type=float, default=None)
    options.add_seed(p, None, shown="train's")
    options.add_dtype(p, None, shown="train's")
    options.add_device(p, "cpu: gloo; gpu: NCCL, one GPU per rank")
    options.add_eval_every(p, 0, "also evaluate every K steps (0: never); --json lists them as "
                                 "train's 'evals'")
    p.add_argument("--no-eval", dest="eval_every_epoch", action="store_false",
                   help="skip the per-epoch evaluation (the final one still runs)")
    options.add_timeout(p, 300, "seconds the process group waits for a rank")
    p.add_argument("--save-weights", default=None, metavar="PATH.npz",
                   help="rank 0 writes the final weights by ringnet's parameter names")
    options.add_json(p, "print one JSON summary line (rank 0)")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors and --json")
    return p


def caffe_sgd_step(torch, params, momenta, lr, momentum, weight_decay):
    """ringnet's update on torch tensors, every parameter at once (torch's foreach kernels,
    as torch.optim.SGD runs): v <- m v + lr (g + wd w); w <- w - v."""
    grads = [p.grad for p in params]
    with torch.no_grad():
        step = torch._foreach_add(grads, params, alpha=weight_decay) if weight_decay else grads
        torch._foreach_mul_(momenta, momentum)
        torch._foreach_add_(momenta, step, alpha=lr)
        torch._foreach_sub_(params, momenta)


def _config(args, size):
    """The recipe ringnet.train resolves for these flags at ``size`` ranks."""
    from ringnet.config import TrainConfig
    fields = {k: getattr(args, k) for k in ("model", "dataset", "data_dir", "batch_size", "steps",
                                            "epochs", "lr", "lr_policy", "gamma", "stepsize",
                                            "power", "momentum", "weight_decay", "seed", "dtype")}
    return TrainConfig(mode="master" if size > 1 else "single", **fields).resolved(size)


def _process_group(torch, world, backend, seconds):
    """Join a process group of every MPI rank over a TCP store on 127.0.0.1 (rank 0's, on a
    port it picked; the others learn it over MPI); return (torch.distributed, the store).
    The caller keeps the store until every rank has left the group (:func:`_leave`)."""
    import torch.distributed as dist
    rank, size = world.Get_rank(), world.Get_size()
    timeout = datetime.timedelta(seconds=seconds)
    store, port = None, None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
        port = store.port
    port = world.bcast(port, root=0)
    if rank:
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return dist, store


def _leave(dist, world, store):
    """Leave the process group, then wait on MPI for every rank. ``store``, the group's TCP
    store, is held by this argument until then (the group drops its own reference): a rank
    0 whose store's server went first would leave a rank still leaving the group to abort
    in gloo ("terminate called without an active exception", exit 6)."""
    dist.destroy_process_group()
    world.Barrier()


def _device(torch, args, local_rank, local_size):
    want = args.device
    if want == "auto":
        want = "gpu" if torch.cuda.is_available() else "cpu"
    if want == "cpu":
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        raise UsageError("--device gpu: this PyTorch sees no CUDA GPU (torch "
                         f"{torch.__version__}); use --device cpu")
    count = torch.cuda.device_count()
    if local_size > count:
        raise UsageError(f"--device gpu: {local_size} ranks on this node but {count} GPU(s); "
                         "NCCL needs a GPU per rank")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank), "nccl"


def main(argv=None):
    args = build_parser().parse_args(argv)
    torch = require_torch()
    from ringnet.control import import_mpi
    mpi = import_mpi()
    world = mpi.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    local = world.Split_type(mpi.COMM_TYPE_SHARED)
    if local.Get_size() != size:
        raise UsageError(f"bench ddp runs its ranks on one node (its process group meets on "
                         f"127.0.0.1); {size} ranks span more than one")
    cfg = _config(args, size)
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed + rank)                  # dropout masks: PyTorch's own
    device, backend = _device(torch, args, local.Get_rank(), local.Get_size())
    from ringnet.bench.layers import torch_model
    from ringnet.data import ShardedLoader, iterate_eval, open_dataset
    from ringnet.models import MODELS, build_model
    from ringnet.optim import LRPolicy
    spec = MODELS[cfg.model]
    t_start = time.perf_counter()
    ds = open_dataset(cfg.dataset, seed=cfg.seed, data_dir=cfg.data_dir, input_shape=spec.input_shape,
                      num_classes=spec.num_classes, synthetic_size=cfg.synthetic_size)
    model = build_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed, num_classes=ds.num_classes)
    net = torch_model(model).to(device)
    dist, store = _process_group(torch, world, backend, args.timeout)
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
    params = list(net.parameters())
    momenta = [torch.zeros_like(p) for p in params]
    policy = LRPolicy(cfg.lr_policy, cfg.lr, gamma=cfg.gamma, stepsize=cfg.stepsize, power=cfg.power)
    loader = ShardedLoader(ds.train, cfg.batch_size, rank=rank, size=size, seed=cfg.seed,
                           shuffle=cfg.shuffle, xp=np, dtype=cfg.dtype, mean=ds.mean, std=ds.std,
                           augment=cfg.augment)
    spe = loader.steps_per_epoch
    total = cfg.steps if cfg.steps is not None else cfg.epochs * spe
    cross_entropy = torch.nn.functional.cross_entropy
    gpu = device.type == "cuda"

    def evaluate():
        net.eval()
        loss_sum, correct = 0.0, 0
        with torch.no_grad():
            for x, labels in iterate_eval(ds.test, 256, rank=rank, size=size, xp=np, dtype=cfg.dtype,
                                          mean=ds.mean, std=ds.std):
                out = net(torch.from_numpy(x).to(device))
                y = torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(device)
                loss_sum += float(cross_entropy(out, y, reduction="sum"))
                correct += int((out.argmax(1) == y).sum())
        net.train()
        parts = world.allgather((loss_sum, correct))
        n = len(ds.test)
        return (sum(c for _, c in parts) / n, sum(s for s, _ in parts) / n) if n else (None, None)

    times, evals, eval_s = [], [], 0.0
    recent = collections.deque(maxlen=spe)      # the last epoch's worth of losses
    step = 0
    world.Barrier()
    t_train = time.perf_counter()
    while step < total:
        epoch, offset = divmod(step, spe)
        for x, labels in loader.epoch(epoch, start_step=offset):
            xt, yt = torch.from_numpy(x), torch.from_numpy(labels)
            if gpu:
                xt, yt = xt.to(device, non_blocking=True), yt.to(device, non_blocking=True)
            t0 = time.perf_counter()
            for p in params:
                p.grad = None
            loss = cross_entropy(ddp(xt), yt)
            loss.backward()
            caffe_sgd_step(torch, params, momenta, policy(step), cfg.momentum, cfg.weight_decay)
            if gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            recent.append(loss.detach())
            step += 1
            if args.eval_every and step % args.eval_every == 0 and step < total:
                t_eval = time.perf_counter()
                acc, _ = evaluate()
                evals.append([step, round(step / spe, 4), t_eval - t_train - eval_s, acc])
                eval_s += time.perf_counter() - t_eval
            if step >= total:
                break
        if step % spe == 0 and args.eval_every_epoch and step < total:
            t_eval = time.perf_counter()
            acc, loss_value = evaluate()
            eval_s += time.perf_counter() - t_eval
            if rank == 0 and not args.quiet:
                print(f"epoch {step // spe:3d}  test loss {loss_value:.4f}  test acc "
                      f"{100 * acc:6.2f}%", file=sys.stderr if args.json else sys.stdout, flush=True)
    train_s = time.perf_counter() - t_train
    test_acc, test_loss = evaluate()
    if args.eval_every:
        evals.append([step, round(step / spe, 4), train_s - eval_s, test_acc])
    losses = [float(v) for v in recent]
    train_loss = float(np.mean(world.allgather(float(np.mean(losses))))) if losses else float("nan")
    if args.save_weights and rank == 0:
        np.savez(args.save_weights, **{k: v.detach().cpu().numpy() for k, v in net.state_dict().items()})
    del ddp                 # its reducer's gloo work goes before the group (then the store)
    _leave(dist, world, store)
    timed = times[2:] or times
    summary = {
        "mode": "ddp", "delay": 0, "ranks": size, "model": cfg.model, "dataset": ds.name,
        "device": "gpu" if gpu else "cpu", "transport": backend, "dtype": cfg.dtype,
        "batch_size": cfg.batch_size, "steps": step, "epochs": round(step / spe, 3),
        "lr": cfg.lr, "lr_policy": cfg.lr_policy, "momentum": cfg.momentum,
        "weight_decay": cfg.weight_decay, "test_accuracy": test_acc, "test_loss": test_loss,
        "train_loss": train_loss,
        "images_per_sec": step * cfg.batch_size / (train_s - eval_s) if train_s > eval_s else 0.0,
        "step_ms": 1000 * statistics.median(timed) if timed else float("nan"),
        "time_s": time.perf_counter() - t_start, "train_s": train_s, "eval_s": eval_s,
        "comm_wait_s": None, "overlap": None, "bytes_per_step": None, "fc_params_per_rank": None,
        "num_params": model.num_params, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if args.eval_every:
        summary["evals"] = evals
    if rank == 0:
        if args.json:
            print(json.dumps(summary), flush=True)
        elif not args.quiet:
            print(f"ddp ({backend}) on {size} rank(s), model {cfg.model}, {step} steps: step "
                  f"{summary['step_ms']:.2f} ms, {summary['images_per_sec']:.0f} images/s, test "
                  f"accuracy {100 * (test_acc or 0):.2f}%")
    return 0


if __name__ == "__main__":
    from ringnet.cli import run_main
    run_main(main)
