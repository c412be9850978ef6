"""HDF5 checkpoints: one data set per parameter name, optimizer state, step counters.

Layout::

    /params/<name>            full tensor, PyTorch layout (conv (out,in,kh,kw), linear (out,in))
    /momentum/<name>          SGD momentum buffer of that parameter (same shape)
    /prev_params/<name>       delay-1 runs only: the weights the next step computes on
    /lookahead_base/<name>    delay 1 with the lookahead compensation only: w[t-1] of the
                              look-ahead point (see ringnet.parallel.delayed_update.Lookahead)
    attrs: format ("ringnet-checkpoint"), version, model, mode, delay, ranks, step, epoch,
           dtype, the hyperparameters a resume continues with (HYPERPARAMETERS)

There is no random-stream state to store: Dropout masks are a hash of (seed, step, layer,
sample, element) (:class:`ringnet.layers.Dropout`), and seed and step are attributes, so
a resumed run applies the masks the uninterrupted run would have, on a CPU or a GPU.
Version 1 files also hold ``rng`` (JSON: NumPy stream states of the former stream-drawn
Dropout masks); they load, ``attrs["rng"]`` is returned and nothing uses it.

Durability: the file is written to ``<name>.<host>.<pid>.<random>.h5.tmp`` next to the
target, flushed to disk (``fsync``), renamed onto the target, and the folder is
fsynced, so an interrupted save never replaces a good checkpoint with a half-written
one. SIGTERM and SIGINT during the write remove the temporary file; temporaries that
a killed process (``kill -9``) left behind are swept by the next save to the same
target. :func:`check_writable` tries a real write and compares the free space with
the checkpoint's size before training, not after it.
"""
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time

import h5py
import numpy as np

from ringnet.data.hdf5 import file_mode
from ringnet.errors import InputError, SetupError
from ringnet.control import fault_point

__all__ = ["save_checkpoint", "load_checkpoint", "load_lookahead_base", "check_writable",
           "checkpoint_bytes", "stale_temporaries", "temporaries_guard", "resume_settings",
           "stored_step",
           "HYPERPARAMETERS", "FORMAT"]

FORMAT = "ringnet-checkpoint"
VERSION = 2          # 2: no rng attribute (stateless dropout masks)

# Settings stored as attributes that a resumed run continues with unless told otherwise.
HYPERPARAMETERS = ("batch_size", "lr", "lr_policy", "gamma", "stepsize", "power", "momentum",
                   "weight_decay", "seed", "warmup_steps", "dtype", "shuffle", "augment", "dataset")
TMP_SUFFIX = ".h5.tmp"
# A temporary of another host (shared file system) counts as stale after this long.
FOREIGN_STALE_S = 24 * 3600
_HOST = socket.gethostname().replace(".", "_")


def checkpoint_bytes(num_params, itemsize, tensors=4):
    """Return an upper estimate of a checkpoint's size: ``tensors`` groups of every parameter
    (params, momentum, and at delay 1 prev_params and the look-ahead's lookahead_base)."""
    return int(num_params) * int(itemsize) * int(tensors) + (1 << 20)


def check_writable(path, nbytes=0):
    """Raise unless a checkpoint of ``nbytes`` can be written at ``path``.

    InputError when ``path`` names a folder; SetupError when the file system refuses.
    Creates missing folders, writes and removes a small test file (a read-only or
    full file system fails here), and compares the free space with ``nbytes``.
    """
    if os.path.isdir(path):
        raise InputError(f"cannot write checkpoint {path}: it is a folder")
    target = os.path.realpath(path) if os.path.islink(path) else path     # a link's target
    directory = os.path.dirname(os.path.abspath(target))
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError(f"cannot write checkpoint {path}: {existing} is not a folder")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise SetupError(f"cannot write checkpoint {path}: cannot create folder {directory} "
                         f"({exc.strerror or exc})") from None
    probe = None
    try:
        fd, probe = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=TMP_SUFFIX, dir=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise SetupError(f"cannot write checkpoint {path}: a test write in {directory} failed "
                         f"({exc.strerror or exc})") from None
    finally:
        if probe is not None and os.path.exists(probe):
            os.remove(probe)
    free = shutil.disk_usage(directory).free
    if nbytes and free < nbytes:
        raise SetupError(f"cannot write checkpoint {path}: {free / 2**20:.1f} MiB free in "
                         f"{directory}, the checkpoint needs about {nbytes / 2**20:.1f} MiB")


def _tmp_prefix(path):
    return f"{os.path.basename(path)}.{_HOST}.{os.getpid()}."


def _pid_alive(pid):
    """Return True while process ``pid`` exists on this host and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def stale_temporaries(path):
    """Return the temporaries of ``path`` whose writer is gone (killed during a save)."""
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path) + "."
    stale = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if not (name.startswith(base) and name.endswith(TMP_SUFFIX)):
            continue
        parts = name[len(base):-len(TMP_SUFFIX)].split(".")
        full = os.path.join(directory, name)
        if len(parts) == 3 and parts[0] == _HOST and parts[1].isdigit():
            if not _pid_alive(int(parts[1])) and int(parts[1]) != os.getpid():
                stale.append(full)
            continue
        try:    # another host's, or an older ringnet's name without host and pid
            if time.time() - os.path.getmtime(full) > FOREIGN_STALE_S:
                stale.append(full)
        except OSError:
            pass
    return sorted(stale)


# Checkpoint temporaries being written, on any thread (set operations are atomic under the
# GIL, so a signal handler can read it without a lock the interrupted thread might hold).
_LIVE = set()


class _RemoveOnSignal:
    """While active, SIGTERM and SIGINT remove ``tmp`` and every other checkpoint temporary
    still being written before the process ends.

    Handlers can only be installed from the main thread: a write on another thread (the
    periodic saver's) registers its temporary, and the thread that started it holds a
    :func:`temporaries_guard` on the main thread until it is done.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, tmp=None):
        self.tmp = tmp
        self.previous = {}

    def _handler(self, signum, frame):
        previous = self.previous.get(signum)
        if getattr(previous, "graceful", False):
            # a graceful stop only notes the signal (ringnet.stopping): the save goes on
            previous(signum, frame)
            return
        for tmp in list(_LIVE):
            try:
                os.remove(tmp)
            except OSError:
                pass
        previous = self.previous.get(signum)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)

    def __enter__(self):
        if self.tmp is not None:
            _LIVE.add(self.tmp)
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc):
        for signum, previous in self.previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self.previous = {}
        if self.tmp is not None:
            _LIVE.discard(self.tmp)
        return False


def temporaries_guard():
    """A context manager for the main thread while a checkpoint is written on another: SIGTERM
    and SIGINT then remove that write's temporary before the process ends."""
    return _RemoveOnSignal(None)


def _fsync_dir(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass        # some file systems cannot fsync a folder
    finally:
        os.close(fd)


def _check_finite(path, groups):
    for group_name, tensors in groups:
        for name, array in (tensors or {}).items():
            array = np.asarray(array)
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                bad = int(array.size - np.count_nonzero(np.isfinite(array)))
                raise InputError(f"checkpoint {path}: {group_name}/{name} holds {bad} NaN or "
                                 "infinite value(s); it cannot be trained from")


def save_checkpoint(path, params, momentum=None, prev_params=None, /, lookahead_base=None,
                    **attrs):
    """Write named host arrays and scalar ``attrs`` to ``path`` atomically.

    The arrays are positional only, so ``attrs`` may hold a ``momentum`` setting.

    Refuses non-finite weights; an OS error becomes a SetupError naming the file; the
    old file at ``path`` is untouched in every case.
    """
    _check_finite(path, (("params", params), ("momentum", momentum), ("prev_params", prev_params),
                         ("lookahead_base", lookahead_base)))
    # Through a symbolic link: write its target (next to it) and leave the link in place.
    path = os.path.realpath(path) if os.path.islink(path) else path
    for stale in stale_temporaries(path):
        try:
            os.remove(stale)
        except OSError:
            pass
    try:
        return _write(path, params, momentum, prev_params, lookahead_base, attrs)
    except OSError as exc:
        raise SetupError(f"cannot write checkpoint {path} ({exc})") from None


def _write(path, params, momentum, prev_params, lookahead_base, attrs):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=TMP_SUFFIX, dir=directory)
    os.close(fd)
    with _RemoveOnSignal(tmp):
        try:
            os.chmod(tmp, file_mode())
            with h5py.File(tmp, "w") as f:
                f.attrs["format"] = FORMAT
                f.attrs["version"] = VERSION
                for key, value in attrs.items():
                    f.attrs[key] = "" if value is None else value
                for group_name, tensors in (("params", params), ("momentum", momentum),
                                            ("prev_params", prev_params),
                                            ("lookahead_base", lookahead_base)):
                    if tensors is None:
                        continue
                    group = f.create_group(group_name)
                    for name, array in tensors.items():
                        group.create_dataset(name, data=np.asarray(array))
                fault_point("save-write")
            with open(tmp, "rb+") as written:
                os.fsync(written.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
    _fsync_dir(directory)
    return path


def load_checkpoint(path):
    """Return ``(params, momentum or None, prev_params or None, attrs)`` read from ``path``.

    ``attrs["rng"]`` is a version-1 file's dict of former Dropout stream states (None
    otherwise; unused).
    Raises :class:`~ringnet.errors.InputError` when the file is missing, unreadable, not a checkpoint,
    or holds non-finite values.
    """
    try:
        f = h5py.File(path, "r")
    except FileNotFoundError:
        raise InputError(f"checkpoint {path} does not exist") from None
    except OSError as exc:
        raise InputError(f"checkpoint {path} is not a readable HDF5 file ({exc})") from None
    with f:
        if f.attrs.get("format") != FORMAT or "params" not in f:
            raise InputError(f"{path} is not a ringnet checkpoint")
        try:
            groups = {}
            for group_name in ("params", "momentum", "prev_params"):
                groups[group_name] = ({name: ds[()] for name, ds in f[group_name].items()}
                                      if group_name in f else None)
            attrs = {key: (value.item() if isinstance(value, np.generic) else
                           value.decode() if isinstance(value, bytes) else value)
                     for key, value in f.attrs.items()}
            attrs["rng"] = json.loads(attrs["rng"]) if attrs.get("rng") else None
        except (OSError, KeyError, ValueError, AttributeError) as exc:
            raise InputError(f"checkpoint {path} is corrupt ({exc})") from None
    _check_finite(path, groups.items())
    return groups["params"], groups["momentum"], groups["prev_params"], attrs


def stored_step(path):
    """Return the step of the ringnet checkpoint at ``path`` (attributes only), or None when
    there is no file or it is not a readable checkpoint."""
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                return None
            step = f.attrs.get("step")
            return int(step) if step is not None else 0
    except (OSError, ValueError, TypeError):
        return None


def load_lookahead_base(path):
    """Return the named ``/lookahead_base`` arrays of checkpoint ``path``, or None if it has none."""
    try:
        with h5py.File(path, "r") as f:
            if "lookahead_base" not in f:
                return None
            base = {name: ds[()] for name, ds in f["lookahead_base"].items()}
    except (OSError, KeyError, ValueError) as exc:
        raise InputError(f"checkpoint {path} is corrupt ({exc})") from None
    _check_finite(path, (("lookahead_base", base),))
    return base


def resume_settings(attrs, given):
    """Return ``(settings, overridden)`` for a run resumed from a checkpoint's ``attrs``.

    ``given`` maps each name in HYPERPARAMETERS to the value asked for on the command
    line, or None where nothing was asked. ``settings`` holds the checkpoint's value of
    every setting not asked for (settings the checkpoint lacks are left out); ``overridden``
    lists ``(name, checkpoint value, asked value)`` where the two differ.
    """
    settings, overridden = {}, []
    for name in HYPERPARAMETERS:
        stored = attrs.get(name)
        if stored is None or (isinstance(stored, str) and not stored):
            continue
        asked = given.get(name)
        if asked is None:
            settings[name] = stored
        elif asked != stored:
            overridden.append((name, stored, asked))
    return settings, overridden
