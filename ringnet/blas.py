"""Pin BLAS/OpenMP threads per MPI rank (and OpenBLAS's kernels) before NumPy is imported,
and say which BLAS ran (:func:`describe`, :func:`describe_line`)."""
import os
import sys

from ringnet.placement import cpu_quota, local_ranks_on_node

__all__ = ["blas_threads_for_rank",
           "check_blas_threads", "configure_blas_threads", "blas_threads_in_use",
           "openblas_coretype", "configure_blas_kernels", "KERNEL_VARS", "describe",
           "describe_line", "pin_one_thread"]

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")

# srun's --cpu-bind kinds that give each task cores of its own (its affinity is then the
# task's, not the node's to share).
_SLURM_BINDINGS = ("mask_cpu", "map_cpu", "mask_ldom", "map_ldom", "cores", "threads",
                   "sockets", "ldoms", "rank")


def _positive(text):
    """``text`` as a positive int, or None (unset, empty, not a number, 0 or less)."""
    text = (text or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def _affinity():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def blas_threads_for_rank(environ=None, cores=None, quota=None):
    """Return the BLAS thread count for this rank, and why.

    ``RINGNET_BLAS_THREADS`` wins. Otherwise this rank's share of the cores: its own CPU
    affinity where srun bound each task to cores of its own, else the node's usable cores
    (the affinity) divided evenly among its ranks
    (:func:`ringnet.placement.local_ranks_on_node`), at least 1;
    under srun at most ``SLURM_CPUS_PER_TASK``, the cores the allocation gave each task
    (never more than the share: a node that claims more CPUs than it has must not be
    oversubscribed); and at most the whole cores of the CPU quota the process's control
    group allows (:func:`ringnet.placement.cpu_quota`: a container's ``--cpus``, a node of
    ``hpc/cluster.sh --cpus-per-node``) divided among the node's ranks. Under a quota of
    half a core, a second OpenBLAS thread spins on the budget the first needs: LeNet's
    step at 64 images took 83 to 109 ms with two threads, 34 to 39 ms with one.
    ``cores``: the affinity's size and ``quota`` the quota in cores (both read when
    ``cores`` is None; ``quota`` None: no quota).
    """
    env = os.environ if environ is None else environ
    forced = _positive(env.get("RINGNET_BLAS_THREADS"))
    if forced:
        return forced
    if cores is None:
        cores, quota = _affinity(), cpu_quota()
    in_step = env.get("SLURM_STEP_ID") is not None
    bind = env.get("SLURM_CPU_BIND_TYPE", "")
    bound = in_step and any(kind in bind for kind in _SLURM_BINDINGS)
    # this rank's share: its own cores when srun bound it, else the node's divided evenly
    ranks = local_ranks_on_node(env)
    share = cores if bound else max(1, cores // ranks)
    if quota is not None:
        share = min(share, max(1, int(quota / ranks + 1e-9)))
    per_task = _positive(env.get("SLURM_CPUS_PER_TASK"))
    if per_task and in_step:
        return max(1, min(per_task, share))
    return share


def check_blas_threads(environ=None):
    """Raise UsageError naming ``RINGNET_BLAS_THREADS`` unless it is unset, empty or a whole
    number >= 1 (what :func:`configure_blas_threads` can use; it ignores any other value,
    since it runs before an entry point can report one)."""
    env = os.environ if environ is None else environ
    value = env.get("RINGNET_BLAS_THREADS")
    if value is not None and value.strip() and _positive(value) is None:
        from ringnet.errors import UsageError
        raise UsageError(f"RINGNET_BLAS_THREADS={value!r} is not a whole number of threads >= 1")


def configure_blas_threads():
    """Set the thread variables unless the user already set ``OMP_NUM_THREADS`` (to a
    positive number: an empty or other value counts as unset), and OpenBLAS's kernels
    (:func:`configure_blas_kernels`).

    Only effective before NumPy (or CuPy) is first imported in this process.
    """
    asked = _positive(os.environ.get("OMP_NUM_THREADS"))
    if asked and "RINGNET_BLAS_THREADS" not in os.environ:
        n = str(asked)
    else:
        n = str(blas_threads_for_rank())
    forced = _positive(os.environ.get("RINGNET_BLAS_THREADS")) is not None
    for var in _THREAD_VARS:
        if var == "OMP_NUM_THREADS" or not _positive(os.environ.get(var)) or forced:
            os.environ[var] = n
    configure_blas_kernels()
    return int(n)


def pin_one_thread():
    """One BLAS thread (and ringnet's allocator settings), fixed before NumPy is first
    imported: what a program that times compute core for core calls first. Returns whether
    it pinned them; when NumPy is already loaded (imported as a library) the caller's
    setting stays."""
    if "numpy" in sys.modules:
        return False
    os.environ["RINGNET_BLAS_THREADS"] = "1"
    from ringnet.allocator import configure_allocator
    configure_blas_threads()
    configure_allocator()
    return True


def blas_threads_in_use():
    """Return the threads the loaded BLAS library uses (threadpoolctl), else what the
    thread variables ask for, else None."""
    try:
        from threadpoolctl import threadpool_info
        counts = [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]
        if counts:
            return max(counts)
    except Exception:       # noqa: BLE001 - a report, never a reason to fail
        pass
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        if _positive(os.environ.get(var)):
            return _positive(os.environ.get(var))
    return None


def _cpuinfo():
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def openblas_coretype(cpuinfo=None):
    """Return the OpenBLAS core type to ask for on this CPU, or None to keep OpenBLAS's own.

    On AMD family 25 with AVX-512 (Zen 4) OpenBLAS picks its SkylakeX (AVX-512) kernels;
    its Haswell (AVX2) kernels ran the GEMM shapes of ringnet's convolutions up to 10%
    faster there, and the cifar10_quick training step about 8% faster against the same
    PyTorch step (``python -m ringnet.bench layers --vs torch``). Elsewhere (Intel,
    Zen 1-3, which OpenBLAS already gives AVX2 kernels, Zen 5 with full-width AVX-512,
    other architectures) nothing is measured, so nothing is changed. ``cpuinfo``: the
    text of /proc/cpuinfo (read when None).
    """
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break                                # the first processor's block only
            continue
        fields.setdefault(key.strip(), value.strip())
    if (fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25"
            and "avx512f" in fields.get("flags", "").split()):
        return "Haswell"
    return None


def configure_blas_kernels():
    """Set ``OPENBLAS_CORETYPE`` to :func:`openblas_coretype`'s choice unless the user set it.

    Only effective before NumPy is first imported (OpenBLAS reads it when it loads); other
    BLAS libraries (MKL, which PyTorch links) ignore it. Returns the value now in effect
    (None: OpenBLAS's own choice).
    """
    if "OPENBLAS_CORETYPE" not in os.environ:
        choice = openblas_coretype()
        if choice is not None:
            os.environ["OPENBLAS_CORETYPE"] = choice
    return os.environ.get("OPENBLAS_CORETYPE") or None


# What a reader of a benchmark needs to tell its BLAS apart: OpenBLAS reads these two
# when it loads (the kernels it picks, the cache size it blocks for). They are reported,
# never changed here.
KERNEL_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def describe(load_numpy=True):
    """Return what BLAS this process runs: ``{"libraries": [...], "threads": n, "env": {...}}``.

    ``libraries``: one dict per BLAS library loaded (threadpoolctl's ``internal_api``,
    ``version``, ``architecture`` -- the kernels it chose --, ``num_threads``,
    ``threading_layer``); ``threads``: the most threads any of them runs (None when none
    was found); ``env``: the value of each of :data:`KERNEL_VARS`, None where unset.
    ``load_numpy``: import NumPy first, so that the BLAS it links is loaded and seen.
    Never raises, never sets or unsets a variable.
    """
    libraries = []
    try:
        if load_numpy:
            import importlib
            importlib.import_module("numpy")        # loads the BLAS it links
        from threadpoolctl import threadpool_info
        for info in threadpool_info():
            if info.get("user_api") == "blas":
                libraries.append({key: info.get(key) for key in
                                  ("internal_api", "version", "architecture", "num_threads",
                                   "threading_layer")})
    except Exception:       # noqa: BLE001 - a report, never a reason to fail
        pass
    threads = max((lib["num_threads"] for lib in libraries if lib["num_threads"]), default=None)
    return {"libraries": libraries, "threads": threads,
            "env": {var: os.environ.get(var) for var in KERNEL_VARS}}


def describe_line(info=None, threads=None, per_rank=False):
    """Return :func:`describe`'s facts as one line, e.g. ``BLAS: openblas 0.3.27 (SkylakeX
    kernels, pthreads), 1 thread; OPENBLAS_CORETYPE unset, OPENBLAS_L2_SIZE=512``.

    ``threads``: the thread count that ran, where it is not this process's (the ranks a
    benchmark launches, pinned to one each); ``per_rank``: say "per rank" after it.
    """
    info = describe() if info is None else info
    parts = []
    for lib in info["libraries"]:
        detail = ", ".join(x for x in (f"{lib['architecture']} kernels" if lib["architecture"]
                                       else None, lib["threading_layer"]) if x)
        parts.append(f"{lib['internal_api']} {lib['version'] or '(version unknown)'}"
                     + (f" ({detail})" if detail else ""))
    text = " + ".join(parts) if parts else "not identified (threadpoolctl found no BLAS library)"
    count = threads if threads is not None else info["threads"]
    if count is not None:
        text += f", {count} thread{'' if count == 1 else 's'}{' per rank' if per_rank else ''}"
    env = ", ".join(f"{var}={value}" if value is not None else f"{var} unset"
                    for var, value in info["env"].items())
    return f"BLAS: {text}; {env}"
