"""Screening of delay-1 variants in one process (the exact recurrence, no MPI).

plain:  g_t = G_t(w[t-1]), w[t+1] = upd(w[t], g_t)
variants (joined with '+'): dc:L (g += L*g*g*(w[t]-w[t-1])), dca:L (adaptive
L/sqrt(ms)), mom:M (momentum M), lrs:S (lr*S), warm:K (K synchronous steps first),
pred:C (gradient at w[t-1] + C*(w[t-1]-w[t-2])), single (delay 0).
"""
import argparse
import json
import sys
import time

import numpy as np

from ringnet.data import ShardedLoader, open_dataset
from ringnet.data.datasets import Split
from ringnet.models import MODELS, build_model
from ringnet.optim import SGD, LRPolicy


def parse(spec):
    out = {}
    for part in spec.split("+"):
        if ":" in part:
            k, v = part.split(":")
            out[k] = float(v)
        else:
            out[part] = True
    return out


def evaluate(model, ds, mean, std, limit=None):
    from ringnet.data import iterate_eval
    correct = 0
    n = 0
    for x, y in iterate_eval(ds.test, 500, rank=0, size=1, dtype="float32", mean=mean, std=std):
        _, c = model.evaluate(x, y)
        correct += int(c)
        n += len(y)
        if limit and n >= limit:
            break
    return correct / n


def run(model_name, dataset, spec, lr, mu, wd, epochs, seed, batch=64, subset=None,
        test_limit=None, eval_every=0, data_dir=None):
    v = parse(spec)
    spec_model = MODELS[model_name]
    ds = open_dataset(dataset, seed=seed, data_dir=data_dir, input_shape=spec_model.input_shape,
                      num_classes=spec_model.num_classes)
    train = ds.train
    if subset:
        train = Split(np.asarray(train.images[:subset]), train.labels[:subset])
    mean, std = ds.mean, ds.std
    model = build_model(model_name, dtype="float32", seed=seed)
    momentum = v.get("mom", mu)
    opt = SGD(model.num_params, LRPolicy("fixed", lr * v.get("lrs", 1.0)), momentum=momentum,
              weight_decay=wd)
    loader = ShardedLoader(train, batch, seed=seed, dtype="float32", mean=mean, std=std, prefetch=0)
    spe = loader.steps_per_epoch
    total = int(round(epochs * spe))
    single = "single" in v
    warm = int(v.get("warm", 0))
    lam = v.get("dc", 0.0)
    lam_a = v.get("dca", 0.0)
    pred = v.get("pred", 0.0)
    ms = np.zeros(model.num_params, np.float32)
    w_cur = model.params.copy()
    w_prev = w_cur.copy()
    w_pp = w_cur.copy()
    curve = []
    t = 0
    status = "ok"
    t0 = time.perf_counter()
    while t < total:
        batches = loader.epoch(t // spe)
        for x, y in batches:
            sync = single or t < warm or t == 0
            if sync:
                point = w_cur
            elif pred:
                point = w_prev + np.float32(pred) * (w_prev - w_pp)
            else:
                point = w_prev
            model.params[...] = point
            loss, _ = model.loss_and_grad(x, y)
            if not np.isfinite(float(loss)):
                status = f"div@{t}"
                break
            g = model.grads.copy()
            if not sync and (lam or lam_a):
                d = w_cur - point
                if lam_a:
                    ms *= np.float32(0.95)
                    ms += np.float32(0.05) * g * g
                    g += np.float32(lam_a) * g * g * d / np.sqrt(ms + np.float32(1e-7))
                else:
                    g += np.float32(lam) * g * g * d
            elif lam_a:
                ms *= np.float32(0.95)
                ms += np.float32(0.05) * g * g
            w_next = w_cur.copy()
            opt.step(w_next, g, t)
            w_pp, w_prev, w_cur = w_prev, w_cur, w_next
            t += 1
            if eval_every and t % eval_every == 0:
                model.params[...] = w_cur
                curve.append((t, evaluate(model, ds, mean, std, test_limit)))
            if t >= total:
                break
        batches.close()
        if status != "ok":
            break
    acc = float("nan")
    if status == "ok":
        model.params[...] = w_cur
        if not np.all(np.isfinite(w_cur)):
            status = "nan-w"
        else:
            acc = evaluate(model, ds, mean, std, test_limit)
    ds.close()
    return {"model": model_name, "dataset": dataset, "spec": spec, "lr": lr, "mu": mu, "seed": seed,
            "epochs": epochs, "subset": subset, "status": status, "acc": acc, "loss": float(loss),
            "curve": curve, "s": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="digits")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--specs", default="single,plain")
    p.add_argument("--lr", type=float, nargs="+", default=[0.01])
    p.add_argument("--mu", type=float, nargs="+", default=[0.9])
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--subset", type=int, default=None)
    p.add_argument("--test-limit", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=0)
    args = p.parse_args(argv)
    for seed in args.seeds:
        for lr in args.lr:
            for mu in args.mu:
                for spec in args.specs.split(","):
                    r = run(args.model, args.dataset, spec, lr, mu, args.wd, args.epochs, seed,
                            args.batch, args.subset, args.test_limit, args.eval_every)
                    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    sys.exit(main())
