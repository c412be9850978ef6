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

Reading: a checkpoint is input from outside. :func:`load_checkpoint` checks every field
before it returns it (the required attributes present, each attribute of its type and
range, the arrays floating point with the same names and shapes in every group, finite,
reached through hard links only); a bad one is an InputError naming the file and the
field. Nothing a checkpoint holds is opened as a path here (its ``dataset`` is the
caller's to judge: :func:`ringnet.data.catalog.find_dataset` with ``names_only``).
"""
import hashlib
import json
import math
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

__all__ = ["save_checkpoint", "load_checkpoint", "content_fingerprint", "load_lookahead_base",
           "check_writable", "checkpoint_bytes", "stale_temporaries", "temporaries_guard", "resume_settings",
           "stored_step", "read_attributes", "check_replaceable",
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


# -- reading: every field is checked before use ---------------------------------------
GROUPS = ("params", "momentum", "prev_params", "lookahead_base")
VERSIONS = (1, 2)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _choices(*names):
    return (lambda v: isinstance(v, str) and v in names, f"one of {', '.join(names)}")


def _models():
    from ringnet.models import MODELS
    return sorted(MODELS)


def _modes():
    from ringnet.parallel import MODES
    return list(MODES)


def _compensations():
    from ringnet.parallel.delayed_update import COMPENSATIONS
    return list(COMPENSATIONS)


# attribute -> (required, test, what the test asks for); a callable returning (test, text)
# is resolved when first needed (the model and mode lists import their packages).
_ATTRIBUTES = {
    "version": (True, lambda v: _is_int(v) and v in VERSIONS,
                f"a version this ringnet reads ({', '.join(map(str, VERSIONS))})"),
    "model": (True, lambda: _choices(*_models())),
    "mode": (True, lambda: _choices(*_modes())),
    "delay": (True, lambda v: _is_int(v) and v in (0, 1), "0 or 1"),
    "delay_compensation": (False, lambda: _choices(*_compensations())),
    "ranks": (True, lambda v: _is_int(v) and v >= 1, "a whole number >= 1"),
    "step": (True, lambda v: _is_int(v) and v >= 0, "a whole number >= 0"),
    "epoch": (True, lambda v: _is_int(v) and v >= 0, "a whole number >= 0"),
    "dtype": (True, lambda: _choices("float32", "float64")),
    "batch_size": (False, lambda v: _is_int(v) and v >= 1, "a whole number >= 1"),
    "lr": (False, lambda v: _is_number(v) and v > 0, "a finite number > 0"),
    "lr_policy": (False, lambda: _choices("fixed", "step", "inv")),
    "gamma": (False, _is_number, "a finite number"),
    "stepsize": (False, lambda v: _is_int(v) and v >= 1, "a whole number >= 1"),
    "power": (False, _is_number, "a finite number"),
    "momentum": (False, lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "weight_decay": (False, lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
    "seed": (False, lambda v: _is_int(v) and v >= 0, "a whole number >= 0"),
    "warmup_steps": (False, lambda v: _is_int(v) and v >= 0, "a whole number >= 0"),
    "shuffle": (False, lambda v: isinstance(v, bool), "true or false"),
    "augment": (False, lambda v: isinstance(v, bool), "true or false"),
    "dataset": (False, lambda v: isinstance(v, str), "a data set name or path"),
    "data_content": (False, lambda v: isinstance(v, str), "text"),
}


def _plain(value):
    """An attribute as a Python value: NumPy scalars become numbers, bytes text."""
    if isinstance(value, np.generic):
        value = value.item()
    return value.decode() if isinstance(value, bytes) else value


def _read_attributes(f, path):
    """Return the validated attributes of open checkpoint ``f`` (InputError names the field)."""
    try:
        fmt = _plain(f.attrs.get("format"))
    except (OSError, RuntimeError, TypeError, ValueError, UnicodeDecodeError):
        fmt = None
    if fmt != FORMAT:
        raise InputError(f"{path} is not a ringnet checkpoint (no format={FORMAT} attribute)")
    attrs = {}
    try:
        names = list(f.attrs)
    except (OSError, RuntimeError, TypeError, ValueError) as exc:
        raise InputError(f"checkpoint {path} is corrupt: its attributes cannot be read "
                         f"({exc})") from None
    for key in names:
        try:
            attrs[key] = _plain(f.attrs[key])
        except (OSError, RuntimeError, TypeError, ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"checkpoint {path}: attribute {key} cannot be read ({exc})") from None
    for key, rule in _ATTRIBUTES.items():
        required, test, *text = rule
        if not text:
            test, text = test()
        else:
            text = text[0]
        if key not in attrs:
            if required:
                raise InputError(f"checkpoint {path}: attribute {key} is missing")
            continue
        value = attrs[key]
        if not required and isinstance(value, str) and value == "":
            continue        # written for a setting that was None
        if not test(value):
            raise InputError(f"checkpoint {path}: attribute {key} must be {text}, got {value!r}")
    if attrs.get("rng"):
        try:
            attrs["rng"] = json.loads(attrs["rng"])
        except (TypeError, ValueError) as exc:
            raise InputError(f"checkpoint {path}: attribute rng is not JSON ({exc})") from None
    else:
        attrs["rng"] = None
    return attrs


def _read_group(f, path, group_name, required=False, read=True):
    """Return {name: array} of group ``group_name`` (None where absent and not required):
    hard links only, floating-point arrays of at least one dimension. ``read=False``:
    {name: shape}, nothing read."""
    from ringnet.data.hdf5 import member
    where = f"checkpoint {path}"
    try:
        present = f.get(group_name, getlink=True) is not None
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise InputError(f"{where}: /{group_name} cannot be read ({exc})") from None
    if not present:
        if required:
            raise InputError(f"{where}: missing group /{group_name}")
        return None
    group = member(f, group_name, where, kind=h5py.Group)
    arrays = {}
    try:
        names = list(group)
    except (OSError, RuntimeError, ValueError) as exc:
        raise InputError(f"{where}: /{group_name} cannot be listed ({exc})") from None
    for name in names:
        ds = member(f, f"{group_name}/{name}", where)
        if ds.dtype.kind != "f" or ds.dtype.itemsize not in (4, 8) or ds.ndim < 1:
            raise InputError(f"{where}: {group_name}/{name} must be an array of float32 or "
                             f"float64, got {ds.dtype} of shape {ds.shape}")
        if not read:
            arrays[name] = ds.shape
            continue
        try:
            arrays[name] = ds[()]
        except (OSError, RuntimeError, ValueError, TypeError, MemoryError) as exc:
            raise InputError(f"{where}: {group_name}/{name} cannot be read ({exc})") from None
    return arrays


def _check_alike(path, params, groups):
    """Every group holds the arrays of ``params``: the same names and shapes."""
    for group_name, arrays in groups:
        if arrays is None:
            continue
        if set(arrays) != set(params):
            odd = sorted(set(arrays) ^ set(params))
            raise InputError(f"checkpoint {path}: /{group_name} and /params hold different "
                             f"arrays ({', '.join(odd[:3])}{', ...' if len(odd) > 3 else ''})")
        for name, array in arrays.items():
            have, want = getattr(array, "shape", array), getattr(params[name], "shape", params[name])
            if have != want:
                raise InputError(f"checkpoint {path}: {group_name}/{name} has shape "
                                 f"{have}, params/{name} {want}")


def _open_checkpoint(path):
    from ringnet.data.hdf5 import open_regular
    return open_regular(path, "checkpoint")


def load_checkpoint(path):
    """Return ``(params, momentum or None, prev_params or None, attrs)`` read from ``path``.

    Every field is checked before it is returned: the attributes (required ones present,
    each of its type and range; :data:`_ATTRIBUTES`), the arrays (reached through hard
    links only, floating point, the same names and shapes in every group, finite).
    ``attrs["rng"]`` is a version-1 file's dict of former Dropout stream states (None
    otherwise; unused). Raises :class:`~ringnet.errors.InputError` naming the file and the
    field when the file is missing, not a regular file, unreadable, not a checkpoint, or
    holds a field it cannot use.
    """
    with _open_checkpoint(path) as f:
        attrs = _read_attributes(f, path)
        params = _read_group(f, path, "params", required=True)
        groups = [(name, _read_group(f, path, name)) for name in GROUPS[1:3]]
    _check_alike(path, params, groups)
    _check_finite(path, [("params", params)] + groups)
    return params, groups[0][1], groups[1][1], attrs


def content_fingerprint(*groups):
    """Return a short hex digest of the arrays in ``groups`` (dicts {name: array}, or None):
    their names, dtypes, shapes and bytes. Two checkpoints whose loaded weights give one
    fingerprint hold the same state, wherever their files are."""
    digest = hashlib.sha256()
    for i, arrays in enumerate(groups):
        digest.update(f"group {i}: {'none' if arrays is None else len(arrays)}\n".encode())
        for name in sorted(arrays or ()):
            array = np.ascontiguousarray(arrays[name])
            digest.update(f"{name} {array.dtype.str} {array.shape}\n".encode())
            digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()[:16]


def read_attributes(path):
    """Return the validated attributes of checkpoint ``path`` (no arrays are read); raise
    InputError as :func:`load_checkpoint` does."""
    with _open_checkpoint(path) as f:
        return _read_attributes(f, path)


def stored_step(path):
    """Return the step of the ringnet checkpoint at ``path`` (attributes only), or None when
    there is no file or it is not a readable, valid checkpoint."""
    try:
        return read_attributes(path)["step"]
    except InputError:
        return None


def check_replaceable(path):
    """Raise InputError unless the file at ``path`` (a --save target) may be replaced by a
    checkpoint: nothing there, an empty file, or a ringnet checkpoint (of any validity).
    Any other file (a data set, a summary) is left alone."""
    try:
        if os.path.getsize(path) == 0:
            return
    except OSError:
        return
    try:
        with h5py.File(path, "r") as f:
            if _plain(f.attrs.get("format")) == FORMAT:
                return
    except (OSError, RuntimeError, TypeError, ValueError, UnicodeDecodeError):
        pass
    raise InputError(f"{path} exists and is not a ringnet checkpoint, which a save would "
                     f"replace; remove it or choose another path")


def load_lookahead_base(path):
    """Return the named ``/lookahead_base`` arrays of checkpoint ``path``, or None if it has
    none (checked as :func:`load_checkpoint` checks every group)."""
    with _open_checkpoint(path) as f:
        base = _read_group(f, path, "lookahead_base")
        params = (_read_group(f, path, "params", required=True, read=False)
                  if base is not None else None)
    if base is None:
        return None
    _check_alike(path, params, [("lookahead_base", base)])
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
