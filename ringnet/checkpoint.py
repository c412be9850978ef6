"""HDF5 checkpoints: one data set per parameter name, optimizer state, step counters.

Layout::

    /params/<name>            full tensor, PyTorch layout (conv (out,in,kh,kw), linear (out,in))
    /momentum/<name>          SGD momentum buffer of that parameter (same shape)
    /prev_params/<name>       delay-1 runs only: the weights the next step computes on
    /lookahead_base/<name>    delay 1 with the lookahead compensation only: w[t-1] of the
                              look-ahead point (see ringnet.parallel.exchange.Lookahead)
    attrs: format ("ringnet-checkpoint"), version, model, mode, delay, ranks, step, epoch,
           dtype, and the hyperparameters a resume continues with (HYPERPARAMETERS)

Files are written to a temporary name next to the target and renamed on success, so
an interrupted save never replaces a good checkpoint with a half-written one.
"""
import os

import h5py
import numpy as np

from ringnet.data.hdf5 import atomic_output
from ringnet.errors import UsageError

__all__ = ["save_checkpoint", "load_checkpoint", "load_lookahead_base", "check_writable",
           "resume_settings", "HYPERPARAMETERS", "FORMAT"]

FORMAT = "ringnet-checkpoint"
VERSION = 1

# Settings stored as attributes that a resumed run continues with unless told otherwise.
HYPERPARAMETERS = ("batch_size", "lr", "lr_policy", "gamma", "stepsize", "power", "momentum",
                   "weight_decay", "seed")


def check_writable(path):
    """Raise UsageError unless a checkpoint can be created at ``path``."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    existing = directory
    while not os.path.isdir(existing):          # the first folder that exists must be writable
        parent = os.path.dirname(existing)
        if parent == existing or os.path.exists(existing):
            raise UsageError(f"cannot write checkpoint {path}: {existing} is not a folder")
        existing = parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write checkpoint {path}: folder {existing} is not writable")
    if os.path.isdir(path):
        raise UsageError(f"cannot write checkpoint {path}: it is a folder")


def save_checkpoint(path, params, momentum=None, prev_params=None, /, lookahead_base=None, **attrs):
    """Write named host arrays and scalar ``attrs`` to ``path`` atomically.

    The arrays are positional only, so ``attrs`` may hold a ``momentum`` setting.

    An OS error becomes a UsageError naming the file; the old file at ``path`` is untouched.
    """
    try:
        return _write(path, params, momentum, prev_params, attrs, lookahead_base)
    except OSError as exc:
        raise UsageError(f"cannot write checkpoint {path} ({exc})") from None


def _write(path, params, momentum, prev_params, attrs, lookahead_base=None):
    with atomic_output(path, suffix=".h5.tmp") as tmp:
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
    return path


def load_checkpoint(path):
    """Return ``(params, momentum or None, prev_params or None, attrs)`` read from ``path``.

    Raises :class:`UsageError` when the file is missing, unreadable or not a checkpoint.
    """
    try:
        f = h5py.File(path, "r")
    except FileNotFoundError:
        raise UsageError(f"checkpoint {path} does not exist") from None
    except OSError as exc:
        raise UsageError(f"checkpoint {path} is not a readable HDF5 file ({exc})") from None
    with f:
        if f.attrs.get("format") != FORMAT or "params" not in f:
            raise UsageError(f"{path} is not a ringnet checkpoint")
        try:
            groups = {}
            for group_name in ("params", "momentum", "prev_params"):
                groups[group_name] = ({name: ds[()] for name, ds in f[group_name].items()}
                                      if group_name in f else None)
            attrs = {key: (value.item() if isinstance(value, np.generic) else value)
                     for key, value in f.attrs.items()}
        except (OSError, KeyError, ValueError) as exc:
            raise UsageError(f"checkpoint {path} is corrupt ({exc})") from None
    return groups["params"], groups["momentum"], groups["prev_params"], attrs


def load_lookahead_base(path):
    """Return the named ``/lookahead_base`` arrays of checkpoint ``path``, or None if it has none."""
    try:
        with h5py.File(path, "r") as f:
            if "lookahead_base" not in f:
                return None
            return {name: ds[()] for name, ds in f["lookahead_base"].items()}
    except (OSError, KeyError, ValueError) as exc:
        raise UsageError(f"checkpoint {path} is corrupt ({exc})") from None


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
        if isinstance(stored, bytes):
            stored = stored.decode()
        if stored is None or (isinstance(stored, str) and not stored):
            continue
        asked = given.get(name)
        if asked is None:
            settings[name] = stored
        elif asked != stored:
            overridden.append((name, stored, asked))
    return settings, overridden
