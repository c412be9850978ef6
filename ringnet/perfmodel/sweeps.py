"""Prediction rows over N for every (mode, delay), crossovers, and the research's setting."""
from ringnet.perfmodel.prediction import predict
from ringnet.perfmodel.profiling import compute_profile
from ringnet.perfmodel.profiles import make_system
from ringnet.perfmodel.topology import HIERARCHICAL_MODES, between_choice, spans_nodes
from ringnet.models import build_model
from ringnet.parallel import MODES as REGISTRY

__all__ = ["MODES", "DEFAULT_MODELS", "DEFAULT_NP", "DEFAULT_PROFILES", "PAPER", "PAPER_NP",
           "sweep", "crossovers", "paper_rows", "communicates", "fits",
           "REFERENCE", "hierarchical_rows", "between_label"]

DEFAULT_MODELS = ("lenet", "cifar10_quick")
DEFAULT_NP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _mode_rows():
    """(mode, delay) in the order tables print them: every mode of the registry at its
    default delay, and a mode that defaults to the delayed update (the ring) also at delay
    0 (what the delayed update buys)."""
    rows = []
    for mode in REGISTRY.values():
        rows.append((mode.name, mode.default_delay))
        if mode.default_delay == 1:
            rows.append((mode.name, 0))
    return tuple(rows)


# the one-process mode every speedup is measured against
REFERENCE = next(name for name, mode in REGISTRY.items() if mode.communicator is None)


def communicates(mode):
    """True when ``mode`` runs on several ranks (every mode but the one-process reference)."""
    return REGISTRY[mode].communicator is not None


def fits(mode, model, n):
    """True when ``mode``'s strategy can run ``model`` on ``n`` ranks."""
    return REGISTRY[mode].strategy.fits(model, n)


MODES = _mode_rows()
DEFAULT_PROFILES = ("pcie3/eth-10g", "pcie5/ib-hdr", "nvlink4/ib-hdr")
# The research's setting: 4 GPUs, Caffe's per-GPU batches (LeNet 64, cifar10_quick 100).
PAPER = {"lenet": (64, 3.77), "cifar10_quick": (100, 3.79)}
PAPER_NP = 4


def sweep(system, model, nps, batch, scaling, modes=MODES, topology="flat"):
    """Return prediction rows for every (mode, delay) and N; speedup over single at N=1.
    ``topology`` "hierarchical": only the N where the ranks span nodes. Every row names its
    ``topology`` and the exchange's algorithm ``between`` nodes (:func:`between_label`),
    and gives its ``floor_ms`` (the step of one rank alone at its share of the batch: the
    compute, with no exchange) and ``residual_ms`` (what the exchange leaves on the step)."""
    base = predict(system, model, REFERENCE, 0, 1, batch).step_s
    floors = {}

    def floor(n):
        if n not in floors:
            per_rank = batch if scaling == "weak" else max(1, batch // n)
            floors[n] = predict(system, model, REFERENCE, 0, 1, per_rank).step_s
        return floors[n]

    rows = []
    for mode, delay in modes:
        for n in nps:
            if not communicates(mode) and n != 1:
                continue
            global_batch = batch * n if scaling == "weak" else batch
            if scaling == "strong" and batch % n:
                continue
            if not fits(mode, model, n):
                continue
            if topology != "flat" and not spans_nodes(system.at(n), n):
                continue
            pred = predict(system, model, mode, delay, n, global_batch, topology)
            # weak scaling: N ranks do N times the work of one step at N=1
            speedup = base / pred.step_s * (n if scaling == "weak" else 1)
            rows.append({"model": model.name, "mode": mode, "delay": delay, "np": n,
                         "profile": system.name, "step_ms": pred.step_s * 1e3,
                         "speedup": speedup, "efficiency": speedup / n,
                         "comm_ms": pred.comm_s * 1e3, "bytes_per_rank": pred.bytes_mean,
                         "topology": topology,
                         "between": between_label(system.at(n), model, mode, n, topology),
                         "floor_ms": floor(n) * 1e3,
                         "residual_ms": (pred.step_s - floor(n)) * 1e3})
    return rows


def between_label(system, model, mode, n, topology):
    """The exchange between nodes a row's prediction runs: for the hierarchical ring on full
    nodes the cost model's algorithm (ring or rhd) over the channels; "leaders" where one
    leader per node exchanges; on one node "-"; flat, the mode's own structure."""
    local = min(n, system.ranks_per_node)
    if n <= local or not communicates(mode):
        return "-"
    if topology == "flat":
        return REGISTRY[mode].communicator or "-"
    if mode == "ring" and n % local == 0:
        size, _ = REGISTRY[mode].strategy.exchange_region(model)
        nbytes = size * model.dtype.itemsize
        return between_choice(system, n, nbytes / local)[0]
    return "leaders"


def hierarchical_rows(system, model, nps, batch, scaling):
    """Prediction rows of the modes with a hierarchical exchange (:data:`HIERARCHICAL_MODES`),
    hierarchical, at the N where the ranks span nodes; each says whether it beats the flat
    exchange there ("flat_ms")."""
    rows = sweep(system, model, nps, batch, scaling, HIERARCHICAL_MODES, "hierarchical")
    flat = {(r["mode"], r["delay"], r["np"]): r for r in
            sweep(system, model, sorted({r["np"] for r in rows}), batch, scaling, HIERARCHICAL_MODES)}
    for r in rows:
        r["flat_ms"] = flat[(r["mode"], r["delay"], r["np"])]["step_ms"]
    return rows


def crossovers(system, model, batch, scaling, max_np, modes=MODES):
    """Return rows {faster, than, from_np}: the smallest N where one mode's time per image
    drops below another's, searched on powers of two and refined by bisection."""
    def per_image(mode_delay, n):
        gb = batch * n if scaling == "weak" else batch
        return predict(system, model, mode_delay[0], mode_delay[1], n, gb).step_s / gb

    def valid(n):
        return scaling == "weak" or (n <= batch and batch % n == 0)

    candidates = [md for md in modes if communicates(md[0])]
    grid = [n for n in (2 ** k for k in range(1, 31)) if n <= max_np and valid(n)]
    found = []
    for i, a in enumerate(candidates):
        for b in candidates[i + 1:]:
            ns = [n for n in grid if all(fits(m[0], model, n) for m in (a, b))]
            prev = None
            for lo, hi in zip([None] + ns, ns):
                sign = per_image(a, hi) < per_image(b, hi)
                if prev is not None and sign != prev:
                    lo_n, hi_n = lo, hi
                    while hi_n - lo_n > 1:          # first N in (lo, hi] with the new order
                        mid = (lo_n + hi_n) // 2
                        if not valid(mid):
                            break
                        if (per_image(a, mid) < per_image(b, mid)) == sign:
                            hi_n = mid
                        else:
                            lo_n = mid
                    winner, loser = (a, b) if sign else (b, a)
                    found.append({"model": model.name, "profile": system.name,
                                  "faster": mode_label(*winner), "than": mode_label(*loser),
                                  "from_np": hi_n})
                prev = sign
    return found


def mode_label(mode, delay):
    return f"{mode} d{delay}"


def paper_rows(compute_name, profile, dtype="float32"):
    """Predict the research's setting: 4 GPUs, Caffe's per-GPU batch, every mode."""
    compute = compute_profile(compute_name, tuple(PAPER), dtype)
    system = make_system(profile, compute, PAPER_NP)
    rows = []
    for name, (batch, reported) in PAPER.items():
        model = build_model(name, dtype=dtype)
        for row in sweep(system, model, (PAPER_NP,), batch, "weak"):
            row["reported_speedup"] = reported if (row["mode"], row["delay"]) == ("ring", 1) else None
            row["batch_per_gpu"] = batch
            rows.append(row)
    return rows, compute, system
