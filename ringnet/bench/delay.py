"""python -m ringnet.bench delay — delay-1 compensations side by side, in one process.

The delay-1 recurrence needs no MPI to be run exactly: one process computes step t's
gradient at the weights the delayed update would give it. This benchmark trains the
same model, data, seed and batches with

* ``single``     synchronous SGD (delay 0), the reference;
* ``none``       the plain delay-1 recurrence, g_t = G_t(w[t-1]);
* ``lookahead``  the default compensation (``ringnet.parallel.delayed_update.Lookahead``),
  with its fields changed by ``/warm=W`` (W synchronous steps first), ``/k=K``, ``/c=C``
  (``lookahead/warm=0`` has no warm-up; ``lookahead/k=5/warm=0`` is the earlier fixed k
  without it; an option not given keeps the default's value);

these through ringnet's own delayed-exchange engine, and, for comparison, any
of these variants of the recurrence written out here (joined with '+'):

* ``dc:L``     DC-ASGD (Zheng et al. 2017): g + L * g*g*(w[t] - w[t-1]);
* ``dca:L``    DC-ASGD, adaptive: L / sqrt(ms) with ms the 0.95-average of g*g;
* ``mom:M``    momentum M instead of the run's;  ``lrs:S``  lr * S;
* ``warm:K``   the first K steps synchronous;
* ``pred:C``   gradient at w[t-1] + C (w[t-1] - w[t-2]);
* ``own:N``    N ranks simulated (the batch split in N equal shards), each computing
  its gradient at its own prediction of w[t], the update of w[t-1] with its own
  gradient of step t-1: w[t-1] + mu (w[t-1] - w[t-2]) - lr (g_r[t-1] + wd w[t-1])
  (own:1 is synchronous SGD up to rounding).

It prints test accuracy per (variant, lr, momentum), mean over seeds, or ``div@S``
when the loss became NaN/inf at step S; a run whose final test accuracy is under twice
chance counts as failed too (``dead``). ``--metric loss`` reports the mean training loss
of the last quarter of the steps instead (no test evaluation; for runs too short to
learn the test set, where only stability can be read): a run fails when that is not
below its first step's loss, as ``grew`` when it is more than 5% above it (it blew up
without reaching NaN), else as ``dead`` (it stayed flat). ``--markdown`` prints the README's table: for one lr and
momentum a row per variant and a column per seed; for a sweep a row per lr and a column
per momentum, each cell the variants' means joined by " / " ("–" where any seed diverged
or did not learn; with ``--metric loss``, "grew" where a seed's loss grew and none
reached NaN).

``--speed`` instead times ``mpirun -np N python -m ringnet.train --mode ring --delay 1``
with ``--delay-compensation none``, ``lookahead --warmup-steps 0`` (the compensated
recurrence) and ``lookahead --warmup-steps STEPS`` (``warm-up``: every step synchronous,
as in the default warm-up), interleaved (one launch per round and variant, ABBA order,
STEPS steps each; ``step_ms`` is the run's median step), and prints per N the median ms
per step of each, the medians of the per-round ratios lookahead / none and warm-up /
lookahead, the load average, and what the default warm-up costs once per run. N = 1 is the delayed engine without exchange
(the compensation's extra vector work against the whole step). It then times the step
boundary alone (the look-ahead point and the update, ``gradients_ready``) of both
engines in one process, alternating every step, and prints the extra milliseconds as
a share of each N's step. The timing runs use lr 0.001, where neither recurrence
diverges.
"""
import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

from ringnet.data import ShardedLoader, iterate_eval, open_dataset
from ringnet.data.catalog import Split
from ringnet.bench import machine, options
from ringnet.tables import markdown
from ringnet.errors import UsageError
from ringnet.cli import ArgumentParser
from ringnet.models import MODELS, build_model
from ringnet.optim import SGD, LRPolicy
from ringnet.parallel.delayed_update import lookahead_warmup

__all__ = ["main", "run", "seeds_table", "sweep_table", "engine_variant"]

ENGINE = ("single", "none", "lookahead")
# --metric loss: a late loss more than this fraction above the first step's "grew" (the run
# blew up without reaching NaN); not below the first step's but within it: "dead" (flat)
GREW = 0.05
_KEYS = {"dc", "dca", "mom", "lrs", "warm", "pred", "own"}


def engine_variant(text):
    """Return the Lookahead of an engine variant (``lookahead/warm=W/k=K/c=C``), None for
    single, or raise UsageError; None is returned for written-out variants too (check
    :func:`is_engine` first)."""
    from ringnet.parallel.delayed_update import COMPENSATIONS
    name, *options = text.split("/")
    if name == "single" and not options:
        return None
    if name not in COMPENSATIONS or (options and name != "lookahead"):
        raise UsageError(f"bad variant {text!r}: use single, none, lookahead[/warm=W][/k=K][/c=C] "
                         f"or {'|'.join(sorted(_KEYS))}:VALUE joined with '+'")
    base = COMPENSATIONS[name]
    fields = {"warm": "warmup", "k": "k", "c": "c"}
    changes = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in fields:
            raise UsageError(f"bad variant {text!r}: options are warm=W, k=K, c=C")
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"bad variant {text!r}: {value!r} is not a number") from None
        if not (math.isfinite(number) and number >= 0) or (key == "warm" and number != int(number)) \
                or (key == "k" and number == 0):
            raise UsageError(f"bad variant {text!r}: {key} must be a number "
                             + {"warm": ">= 0 (whole)", "k": "> 0", "c": ">= 0"}[key])
        changes[fields[key]] = int(number) if key == "warm" else number
    return dataclasses.replace(base, **changes) if changes else base


def is_engine(text):
    """Whether ``text`` names a run through ringnet's own engine (single, none, lookahead...)."""
    return text.split("/")[0] in ENGINE


def parse_variant(text):
    """Return {key: value} of a written-out variant ('pred:2+mom:0.98'), or raise UsageError."""
    out = {}
    for part in text.split("+"):
        key, _, value = part.partition(":")
        if key not in _KEYS or not value:
            raise UsageError(f"bad variant {text!r}: use single, none, lookahead or "
                             f"{'|'.join(sorted(_KEYS))}:VALUE joined with '+'")
        try:
            out[key] = float(value)
        except ValueError:
            raise UsageError(f"bad variant {text!r}: {value!r} is not a number") from None
    if "own" in out and not (out["own"] >= 1 and out["own"] == int(out["own"])):
        raise UsageError(f"bad variant {text!r}: own:N takes a whole number of ranks >= 1")
    return out


def _accuracy(model, ds, dtype):
    correct = 0
    for x, y in iterate_eval(ds.test, 500, rank=0, size=1, dtype=dtype, mean=ds.mean, std=ds.std):
        correct += int(model.evaluate(x, y)[1])
    return correct / max(1, len(ds.test))


class _WrittenOut:
    """The delay-1 recurrence with one of the screening variants, on the bare model."""

    def __init__(self, model, variant, lr, momentum, weight_decay, dtype):
        self.model, self.v = model, variant
        self.opt = SGD(model.num_params, LRPolicy("fixed", lr * variant.get("lrs", 1.0)),
                       momentum=variant.get("mom", momentum), weight_decay=weight_decay,
                       dtype=dtype)
        self.w = model.params.copy()
        self.w1 = self.w.copy()
        self.w2 = self.w.copy()
        self.ms = np.zeros_like(self.w)
        self.t = self.model.params.dtype.type
        self.ranks = int(variant.get("own", 0))
        self.own = None             # own:N: each simulated rank's gradient of the last step

    def _own_step(self, x, y, it, sync):
        """own:N: the mean gradient of N shards, each at its rank's prediction of w[t]."""
        t, n = self.t, self.ranks
        if len(x) % n:
            raise UsageError(f"own:{n}: the batch of {len(x)} does not split in {n} shards")
        size, grads, losses = len(x) // n, [], []
        for r in range(n):
            if sync:
                self.model.params[...] = self.w
            else:
                w1, lr = self.w1, t(self.opt.lr_policy(it - 1))
                self.model.params[...] = (w1 + t(self.opt.momentum) * (w1 - self.w2)
                                          - lr * (self.own[r] + t(self.opt.weight_decay) * w1))
            losses.append(float(self.model.loss_and_grad(x[r * size:(r + 1) * size],
                                                         y[r * size:(r + 1) * size])[0]))
            grads.append(self.model.grads.copy())
        self.own = grads
        return sum(losses) / n, sum(grads[1:], grads[0].copy()) / t(n)

    def step(self, x, y, it):
        v, t = self.v, self.t
        sync = it == 0 or it < v.get("warm", 0)
        point = self.w if sync else self.w1 + t(v.get("pred", 0.0)) * (self.w1 - self.w2)
        if self.ranks:
            loss, g = self._own_step(x, y, it, sync)
        else:
            self.model.params[...] = point
            loss, _ = self.model.loss_and_grad(x, y)
            g = self.model.grads.copy()
        if "dca" in v:
            self.ms *= t(0.95)
            self.ms += t(0.05) * g * g
        if not sync and ("dc" in v or "dca" in v):
            scale = t(v["dc"]) if "dc" in v else t(v["dca"]) / np.sqrt(self.ms + t(1e-7))
            g += scale * g * g * (self.w - point)
        new = self.w.copy()
        self.opt.step(new, g, it)
        self.w2, self.w1, self.w = self.w1, self.w, new
        return loss

    def eval_model(self):
        self.model.params[...] = self.w
        return self.model


class _Engine:
    """single / none / lookahead through ringnet's delayed-exchange engine (one process)."""

    def __init__(self, model, name, lr, momentum, weight_decay, dtype):
        from ringnet.parallel.base import DataParallelStrategy

        def make_optimizer(n):
            return SGD(n, LRPolicy("fixed", lr), momentum=momentum, weight_decay=weight_decay,
                       dtype=dtype)
        delay = 0 if name == "single" else 1
        self.strategy = DataParallelStrategy(model, make_optimizer, None, delay=delay,
                                             lookahead=engine_variant(name))

    def step(self, x, y, it):
        return self.strategy.step(x, y, it)[0]

    def eval_model(self):
        return self.strategy.eval_model()


def run(model_name, dataset, variant, lr, momentum, epochs, seed, batch_size=64,
        weight_decay=5e-4, subset=None, data_dir=None, dtype="float32", metric="accuracy"):
    """Train one variant; return a dict with the test accuracy (``metric="loss"``: the mean
    training loss of the last quarter of the steps, no test evaluation) and status."""
    spec = MODELS[model_name]
    ds = open_dataset(dataset, seed=seed, data_dir=data_dir, input_shape=spec.input_shape,
                      num_classes=spec.num_classes)
    try:
        train = ds.train
        if subset:
            train = Split(np.asarray(train.images[:subset]), train.labels[:subset])
        model = build_model(model_name, dtype=dtype, seed=seed)
        engine = is_engine(variant)
        runner = (_Engine if engine else _WrittenOut)(
            model, variant if engine else parse_variant(variant), lr, momentum,
            weight_decay, dtype)
        loader = ShardedLoader(train, batch_size, seed=seed, dtype=dtype, mean=ds.mean,
                               std=ds.std, prefetch=0)
        total = int(round(epochs * loader.steps_per_epoch))
        status, it, t0, losses = "ok", 0, time.perf_counter(), []
        while it < total and status == "ok":
            batches = loader.epoch(it // loader.steps_per_epoch)
            for x, y in batches:
                # A diverging run is reported as div@STEP, not as NumPy overflow warnings.
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                    losses.append(float(runner.step(x, y, it)))
                if not math.isfinite(losses[-1]):
                    status = f"div@{it}"
                    break
                it += 1
                if it >= total:
                    break
            batches.close()
        acc = late_loss = float("nan")
        if status == "ok":
            model = runner.eval_model()
            late_loss = statistics.mean(losses[-max(1, len(losses) // 4):])
            if not np.all(np.isfinite(np.asarray(model.params))):
                status = f"div@{it}"
            elif metric == "loss":
                if late_loss > (1.0 + GREW) * losses[0]:
                    status = "grew"         # blew up without reaching NaN
                elif not late_loss < losses[0]:
                    status = "dead"         # no descent: the loss stayed where it began
            else:
                acc = _accuracy(model, ds, dtype)
                if acc < 2.0 / spec.num_classes:
                    status = "dead"
        return {"model": model_name, "dataset": dataset, "variant": variant, "lr": lr,
                "momentum": momentum, "seed": seed, "epochs": epochs, "steps": total,
                "subset": subset, "status": status, "test_accuracy": acc,
                "first_loss": losses[0] if losses else float("nan"), "train_loss": late_loss,
                "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        ds.close()


def _abba(repeats, names=("none", "lookahead")):
    """Variant order per round: ``names``, then reversed, ... (ABBA)."""
    for r in range(repeats):
        yield tuple(names) if r % 2 == 0 else tuple(reversed(names))


# --speed: the train flags of each timed variant. lookahead without warm-up is the
# compensated recurrence; "warm-up" runs every step as a warm-up step (synchronous).
SPEED_RUNS = {"none": ["--delay-compensation", "none"],
              "lookahead": ["--delay-compensation", "lookahead", "--warmup-steps", "0"],
              "warm-up": ["--delay-compensation", "lookahead", "--warmup-steps", "{steps}"]}


def speed(model_name, dataset, nranks, steps=20, repeats=6, batch_size=64, data_dir=None,
          mpirun="mpirun", timeout=1800, lr=0.001):
    """Return {variant: [step_ms, per round]} of ``ring --delay 1`` under mpirun, interleaved."""
    from ringnet.bench.scaling import run_config
    args = SimpleNamespace(mpirun=mpirun, model=model_name, dataset=dataset,
                           batch_size=batch_size, steps=steps, transport="auto", device="cpu",
                           lr=lr, seed=0, data_dir=data_dir, timeout=timeout)
    times = {name: [] for name in SPEED_RUNS}
    for order in _abba(repeats, tuple(SPEED_RUNS)):
        for name in order:
            extra = [a.format(steps=steps) for a in SPEED_RUNS[name]]
            summary = run_config(args, "ring", 1, nranks, extra=extra)
            times[name].append(summary["step_ms"])
    return times


def boundary_cost(model_name, dataset, steps=40, batch_size=64, data_dir=None, dtype="float32",
                  lr=0.001, momentum=0.9):
    """Return {variant: [ms per step]} of the delayed engine's step boundary, in one process.

    Both engines train their own copy of the model on the same batches; only
    ``gradients_ready`` (drain, the front/look-ahead point, the update) is timed, the two
    alternating every step (ABBA), so the compensation's extra vector work is measured
    without the noise of the forward/backward around it.
    """
    spec = MODELS[model_name]
    ds = open_dataset(dataset, seed=0, data_dir=data_dir, input_shape=spec.input_shape,
                      num_classes=spec.num_classes)
    try:
        loader = ShardedLoader(ds.train, batch_size, seed=0, dtype=dtype, mean=ds.mean,
                               std=ds.std, prefetch=0)
        batches = loader.epoch(0)
        data = [next(batches) for _ in range(min(steps, loader.steps_per_epoch))]
        batches.close()
    finally:
        ds.close()
    # lookahead without its warm-up: every timed boundary is the compensated one
    engines = {name: _Engine(build_model(model_name, dtype=dtype, seed=0), variant, lr, momentum,
                             5e-4, dtype).strategy
               for name, variant in (("none", "none"), ("lookahead", "lookahead/warm=0"))}
    times = {name: [] for name in engines}
    for it, order in enumerate(_abba(steps + 2)):
        x, y = data[it % len(data)]
        for name in order:
            strategy = engines[name]
            strategy.model.loss_and_grad(x, y)
            t0 = time.perf_counter()
            strategy.engine.gradients_ready(it)
            if it >= 2:                 # the first two steps allocate
                times[name].append(1000 * (time.perf_counter() - t0))
    return times


def _speed_report(title, times):
    ratios = [a / b for a, b in zip(times["lookahead"], times["none"])]
    print(f"{title}: ms per step, median of {len(ratios)} interleaved rounds "
          f"(load average {os.getloadavg()[0]:.1f})")
    for name, values in times.items():
        print(f"  {name:>10} {statistics.median(values):9.2f}   rounds: "
              + " ".join(f"{v:.1f}" for v in values))
    print(f"  ratio lookahead / none: median {statistics.median(ratios):.3f} "
          f"(rounds {min(ratios):.3f} .. {max(ratios):.3f})")
    if "warm-up" in times:
        warm = [a / b for a, b in zip(times["warm-up"], times["lookahead"])]
        print(f"  ratio warm-up / lookahead: median {statistics.median(warm):.3f} "
              f"(rounds {min(warm):.3f} .. {max(warm):.3f})")
    return statistics.median(ratios)


def build_parser():
    p = ArgumentParser(prog="python -m ringnet.bench delay", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_model(p, "digits")
    options.add_dataset(p, "digits")
    p.add_argument("--variants", default="single,none,lookahead",
                   help="comma list (default %(default)s)")
    options.add_lr(p, [0.01], "learning rates; every one is run with every --momentum")
    p.add_argument("--momentum", type=float, nargs="+", default=[0.9], help="momenta (default 0.9)")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="weight decay (default 0.0005)")
    options.add_epochs(p, 1, type=float)
    p.add_argument("--seeds", type=int, nargs="+", default=[0],
                   help="seeds; one run each (default 0)")
    options.add_batch_size(p)
    p.add_argument("--subset", type=int, default=None, help="train on the first N images only")
    options.add_data_dir(p)
    p.add_argument("--metric", choices=("accuracy", "loss"), default="accuracy",
                   help="accuracy: test accuracy at the end (default); loss: the mean training "
                        "loss of the last quarter of the steps, no test evaluation (a run "
                        "whose loss does not end below its first step's fails: 'grew' when "
                        "more than 5%% above it, i.e. it blew up without NaN, else 'dead', flat)")
    options.add_json(p, "one JSON line per run as it ends, instead of the table (with "
                        "--markdown: before it)")
    options.add_markdown(p, "print the result", ": one lr and momentum: a row per variant and a "
                         "column per seed; several: a row per lr, a column per momentum, the "
                         "variants' means in each cell")
    p.add_argument("--speed", action="store_true",
                   help="time the delay-1 step with none and lookahead, interleaved, and print the ratio")
    options.add_steps(p, 20, "--speed: steps per round")
    options.add_repeats(p, 6, "--speed: rounds per variant")
    options.add_np(p, [1, 2], "--speed: rank counts to time ring --delay 1 at")
    options.add_mpirun(p)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.model not in MODELS:
        raise UsageError(f"unknown model {args.model!r}; choose one of {', '.join(MODELS)}")
    # --speed times ranks of one BLAS thread each; the sweeps run here, in this process
    run = machine.begin(out=sys.stderr if args.json else None,
                        **({"threads": 1, "per_rank": True} if args.speed else {}))
    code = _main(args)
    run.end(out=sys.stderr if args.json else None)
    return code


def _main(args):
    if args.speed:
        if args.steps < 1 or args.repeats < 1 or min(args.np) < 1:
            raise UsageError("--steps, --repeats and --np must be >= 1")
        if args.batch_size % max(args.np):
            raise UsageError(f"--batch-size {args.batch_size} is not divisible by every --np")
        what = f"{args.model} on {args.dataset}, global batch {args.batch_size}"
        steps, warmups = {}, {}
        for n in args.np:
            times = speed(args.model, args.dataset, n, args.steps, args.repeats,
                          args.batch_size, args.data_dir, args.mpirun)
            _speed_report(f"{what}, ring delay 1, mpirun -np {n}", times)
            steps[n] = statistics.median(times["none"])
            warmups[n] = statistics.median(times["warm-up"]) - statistics.median(times["lookahead"])
        cost = boundary_cost(args.model, args.dataset, 2 * args.steps,
                             args.batch_size, args.data_dir)
        extra = statistics.median(cost["lookahead"]) - statistics.median(cost["none"])
        print(f"{what}, step boundary and update alone (one process, alternating every step, "
              f"median of {len(cost['none'])}): none {statistics.median(cost['none']):.2f} ms, "
              f"lookahead {statistics.median(cost['lookahead']):.2f} ms, extra {extra:.2f} ms")
        for n, ms in steps.items():
            print(f"  extra / ring delay 1 step at N={n} ({ms:.1f} ms): {100 * extra / ms:+.2f} %")
        w = lookahead_warmup(0.9)
        for n, ms in warmups.items():
            print(f"  the default warm-up ({w} synchronous steps at momentum 0.9) at N={n}: "
                  f"{w} x {ms:+.2f} ms = {w * ms / 1000:+.2f} s once per run")
        return 0
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if is_engine(v):
            engine_variant(v)
        else:
            parse_variant(v)
    rows = {}
    for lr in args.lr:
        for mu in args.momentum:
            for v in variants:
                for seed in args.seeds:
                    r = run(args.model, args.dataset, v, lr, mu, args.epochs, seed,
                            args.batch_size, args.weight_decay, args.subset, args.data_dir,
                            metric=args.metric)
                    rows.setdefault((v, lr, mu), []).append(r)
                    if args.json:
                        print(json.dumps(r), flush=True)
                    else:
                        print(f"\r{v} lr {lr} momentum {mu} seed {seed}: {r['status']} "
                              f"{r['test_accuracy']:.4f}      ", end="", file=sys.stderr, flush=True)
    if args.json and not args.markdown:
        return 0
    print(file=sys.stderr)
    print(f"# model {args.model}, data {args.dataset}"
          f"{f' (first {args.subset} training images)' if args.subset else ''}, "
          f"{args.epochs:g} epochs, global batch {args.batch_size}, weight decay "
          f"{args.weight_decay:g}, seeds {' '.join(map(str, args.seeds))}; one process")
    if args.markdown:
        sweep = len(args.lr) > 1 or len(args.momentum) > 1
        print((sweep_table if sweep else seeds_table)(rows, args.metric))
        return 0
    what = "test acc (mean)" if args.metric == "accuracy" else "late loss (mean)"
    print(f"{'variant':>28} {'lr':>7} {'momentum':>8} {what:>16}  per seed")
    for (v, lr, mu), results in rows.items():
        mean = _mean(results, args.metric)
        mean = "failed" if mean is None else (f"{100 * mean:.2f}%" if args.metric == "accuracy"
                                              else f"{mean:.4f}")
        each = " ".join((f"{100 * r['test_accuracy']:.2f}" if args.metric == "accuracy"
                         else f"{r['train_loss']:.4f}") if r["status"] == "ok" else r["status"]
                        for r in results)
        print(f"{v:>28} {lr:>7g} {mu:>8g} {mean:>16}  {each}")
    return 0


def _mean(results, metric):
    """Mean of the metric over seeds, or None if any seed failed."""
    key = "test_accuracy" if metric == "accuracy" else "train_loss"
    if any(r["status"] != "ok" for r in results):
        return None
    return statistics.mean(r[key] for r in results)


def _label(variant):
    return variant if variant == "single" else f"`{variant}`"


def _failure(status, metric):
    if status.startswith("div@"):
        return f"diverged at step {status[4:]}"
    if status == "grew":
        return "loss grew"
    return "chance accuracy" if metric == "accuracy" else "no descent"


def _failed_part(results):
    """A sweep cell's part for a variant whose seeds did not all end ok: "grew" where a
    seed's loss grew and none diverged, else "–"."""
    statuses = {r["status"] for r in results}
    if "grew" in statuses and not any(s.startswith("div@") for s in statuses):
        return "grew"
    return "–"


def seeds_table(rows, metric="accuracy"):
    """The ``--markdown`` table of one (lr, momentum): a row per variant, a column per seed
    and the mean ("–" where a seed failed)."""
    seeds = [r["seed"] for r in next(iter(rows.values()))]
    header = ["variant"] + [f"seed {s}" for s in seeds] + ["mean"]
    out = []
    for (v, _, _), results in rows.items():
        cells = [(f"{100 * r['test_accuracy']:.2f}%" if metric == "accuracy"
                  else f"{r['train_loss']:.3f}") if r["status"] == "ok"
                 else _failure(r["status"], metric) for r in results]
        mean = _mean(results, metric)
        cells.append("–" if mean is None else
                     (f"{100 * mean:.2f}%" if metric == "accuracy" else f"{mean:.3f}"))
        out.append([_label(v)] + cells)
    return markdown(header, out)


def sweep_table(rows, metric="accuracy"):
    """The ``--markdown`` table of an lr x momentum sweep: a row per lr, a column per
    momentum, each cell the variants' means (test accuracy in %, or the late training
    loss) in the order of the first column's title; "–" where a seed diverged or did not
    learn, "grew" where a seed's loss grew (and none diverged)."""
    variants = list(dict.fromkeys(v for v, _, _ in rows))
    lrs = list(dict.fromkeys(lr for _, lr, _ in rows))
    mus = list(dict.fromkeys(mu for _, _, mu in rows))
    header = ["lr: " + " / ".join(_label(v) for v in variants)] + [f"momentum {m:g}" for m in mus]
    out = []
    for lr in lrs:
        row = [f"{lr:g}"]
        for mu in mus:
            parts = []
            for v in variants:
                mean = _mean(rows[(v, lr, mu)], metric)
                parts.append(_failed_part(rows[(v, lr, mu)]) if mean is None else
                             (f"{100 * mean:.1f}" if metric == "accuracy" else f"{mean:.3g}"))
            row.append(" / ".join(parts))
        out.append(row)
    return markdown(header, out)
