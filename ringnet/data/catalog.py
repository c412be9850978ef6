"""Open data sets by name or path: the ringnet HDF5 layout, or synthetic data."""
import hashlib
import os
import re
import sys
from pathlib import Path

import numpy as np

import ringnet
from ringnet.data.hdf5 import FileImages, validate_file
from ringnet.data.synthetic import make_synthetic
from ringnet.errors import InputError, RunInputError

__all__ = ["NAMED", "DOWNLOADABLE", "IN_MEMORY_BYTES", "in_memory_bytes", "Split", "Dataset",
           "default_data_dir", "data_dirs", "find_dataset", "open_dataset", "is_dataset_name",
           "check_compatible", "channel_stats"]

NAMED = ("digits", "mnist", "cifar10", "synthetic")
DOWNLOADABLE = ("mnist", "cifar10")
# Image arrays up to this size are read into memory once; larger ones stay in the
# file and each rank reads only the samples it needs.
IN_MEMORY_BYTES = 1024 << 20      # the default of RINGNET_DATA_IN_MEMORY_MB, in bytes
_STATS_CHUNK = 4096
FINGERPRINT_SAMPLES = 64


def in_memory_bytes():
    """Return ``RINGNET_DATA_IN_MEMORY_MB`` in bytes (default :data:`IN_MEMORY_BYTES`)."""
    value = os.environ.get("RINGNET_DATA_IN_MEMORY_MB", "").strip()
    if not value:
        return IN_MEMORY_BYTES
    if not value.isdigit():
        raise InputError(f"RINGNET_DATA_IN_MEMORY_MB={value!r} is not a whole number of MiB")
    return int(value) << 20


def default_data_dir():
    """Return the ``datasets/`` folder next to the ringnet package."""
    return Path(ringnet.__file__).resolve().parent.parent / "datasets"


def installed_data_dir():
    """Return where a non-editable install puts the embedded data sets (setup.cfg data_files)."""
    return Path(sys.prefix) / "share" / "ringnet" / "datasets"


def data_dirs(data_dir=None):
    """Return the folders searched for ``<name>.h5``, in order, without duplicates."""
    candidates = [data_dir, os.environ.get("RINGNET_DATA") or None, default_data_dir()]
    if installed_data_dir().is_dir():
        candidates.append(installed_data_dir())
    dirs = []
    for d in candidates:
        if d is not None and Path(d).resolve() not in [x.resolve() for x in dirs]:
            dirs.append(Path(d))
    return dirs


def _shape_str(shape):
    return "x".join(str(int(v)) for v in shape)


class Split:
    """One part of a data set: ``images`` uint8 (N, C, H, W), ``labels`` int64 (N,)."""

    def __init__(self, images, labels):
        self.images = images  # numpy array, or FileImages (read from the file on demand)
        self.labels = np.asarray(labels, dtype=np.int64)
        if len(self.labels) != len(images):
            raise ValueError(f"{len(images)} images but {len(self.labels)} labels")

    def __len__(self):
        return len(self.labels)

    @property
    def in_memory(self):
        """Return True when the images are a NumPy array (not read from a file)."""
        return isinstance(self.images, np.ndarray)


def channel_stats(images, chunk=_STATS_CHUNK):
    """Return per-channel (mean, std) of uint8 (N, C, H, W) images, float64, pixel units."""
    n, c = images.shape[0], images.shape[1]
    if n == 0:
        return np.zeros(c), np.ones(c)
    total = np.zeros(c)
    total_sq = np.zeros(c)
    # Chunked so a large file-backed split never needs a float copy of all images.
    for start in range(0, n, chunk):
        block = np.asarray(images[start:start + chunk], dtype=np.float64)
        total += block.sum(axis=(0, 2, 3))
        total_sq += np.einsum("nchw,nchw->c", block, block)
    count = n * images.shape[2] * images.shape[3]
    mean = total / count
    var = np.maximum(total_sq / count - mean * mean, 0.0)
    return mean, np.sqrt(var)


class Dataset:
    """A named data set with ``train`` and ``test`` splits and per-channel statistics."""

    def __init__(self, name, train, test, classes, path=None, attrs=None, file=None):
        self.name = name
        self.train = train
        self.test = test
        self.classes = [str(c) for c in classes]
        self.path = path
        self.attrs = dict(attrs or {})
        self._file = file
        self._stats = None

    @property
    def input_shape(self):
        """Return (C, H, W)."""
        return tuple(int(v) for v in self.train.images.shape[1:])

    @property
    def num_classes(self):
        """Return the number of classes."""
        return len(self.classes)

    def _channel_stats(self):
        if self._stats is None:
            self._stats = channel_stats(self.train.images)
        return self._stats

    def fingerprint(self, samples=FINGERPRINT_SAMPLES):
        """Return {"data set size", "data set shape", "data set classes", "data set content"}.

        The content is a SHA-256 over every label and ``samples`` evenly spaced images
        of each split: cheap for any size, and it differs for different files, a
        different conversion, or scrambled labels. Raises InputError on a read error.
        """
        digest = hashlib.sha256()
        for split in (self.train, self.test):
            digest.update(np.ascontiguousarray(split.labels, dtype=np.int64).tobytes())
            n = len(split)
            index = np.unique(np.linspace(0, n - 1, min(n, samples)).astype(np.int64)) if n else []
            digest.update(np.ascontiguousarray(split.images[index] if n else b"").tobytes())
        return {"data set size": f"{len(self.train)} train / {len(self.test)} test",
                "data set shape": _shape_str(self.input_shape),
                "data set classes": ",".join(self.classes),
                "data set content": "sha256 " + digest.hexdigest()[:16]}

    @property
    def mean(self):
        """Return the per-channel mean of the training images (pixel units)."""
        return self._channel_stats()[0]

    @property
    def std(self):
        """Return the per-channel standard deviation of the training images (pixel units)."""
        return self._channel_stats()[1]

    @property
    def file_backed(self):
        """Whether images are read from the file during the run (not held in memory)."""
        return self._file is not None

    def changed_on_disk(self):
        """Return what changed in this data set's file since it was opened ("replaced",
        "rewritten"), or None (unchanged, or no file: synthetic)."""
        if self.path is None or getattr(self, "_stat", None) is None:
            return None
        try:
            now = os.stat(self.path)
        except OSError:
            return "removed"
        if now.st_ino != self._stat.st_ino or now.st_dev != self._stat.st_dev:
            return "replaced"
        if (now.st_size, now.st_mtime_ns) != (self._stat.st_size, self._stat.st_mtime_ns):
            return "rewritten"
        return None

    def check_unchanged(self, epoch, started):
        """At the start of ``epoch`` (0-based): a data file replaced, rewritten or removed
        under the running job stops a run that reads from it (RunInputError: it would train
        on a mix of old and new samples); a run holding the whole set in memory goes on, and
        the note to say so is returned once (``started``: training had begun). None otherwise."""
        what = self.changed_on_disk()
        if what is None or getattr(self, "_change_noted", False):
            return None
        if self.file_backed:
            raise RunInputError(f"data set file {self.path} was {what} under the running job "
                                f"(seen at the start of epoch {epoch + 1}); restart, or "
                                f"--resume, once it is final")
        self._change_noted = True
        return (f"note: data set file {self.path} was {what} on disk"
                f"{' during the run' if started else ''}; this run trains on the copy it "
                f"read at the start")

    def close(self):
        """Close the underlying file, if any."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return (f"Dataset({self.name!r}, train={len(self.train)}, test={len(self.test)}, "
                f"shape={_shape_str(self.input_shape)}, classes={self.num_classes})")


def _looks_like_path(name):
    name = str(name)
    return name.endswith((".h5", ".hdf5")) or os.sep in name or name.startswith("~")


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def is_dataset_name(name):
    """Return True when ``name`` is a data set name (``mnist``, ``fashion-mnist``), which is
    only looked up as ``<name>.h5`` in :func:`data_dirs`, not a path."""
    return (isinstance(name, str) and _NAME.fullmatch(name) is not None
            and not _looks_like_path(name))


def find_dataset(name, data_dir=None, names_only=False):
    """Return the path of data set ``name`` (a known name or an .h5 path) or raise InputError.

    ``names_only``: ``name`` came from a file, not from the user: it must be a name
    (:func:`is_dataset_name`), looked up in the data folders only, never opened as a path.
    """
    if names_only and not is_dataset_name(name):
        raise InputError(f"data set {name!r} is not a data set name (a path read from a file "
                         f"is not opened)")
    path = Path(os.path.expanduser(str(name)))
    if not names_only and (_looks_like_path(name) or (name not in NAMED and path.is_file())):
        if path.is_dir():
            raise InputError(f"data set {path} is a folder, not a ringnet .h5 file (an image "
                             f"folder converts with: python -m ringnet.datasets convert "
                             f"imagefolder {path} --out NAME.h5)")
        if not path.is_file():
            raise InputError(f"data set file {path} does not exist")
        return path
    dirs = data_dirs(data_dir)
    for d in dirs:
        candidate = d / f"{name}.h5"
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(d) for d in dirs)
    if name in DOWNLOADABLE:
        command = f"python -m ringnet.datasets download {name}"
        if data_dir is not None:
            command += f" --dir {data_dir}"
        raise InputError(f"data set {name} not found (looked for {name}.h5 in {looked}); "
                         f"get it with: {command}")
    if name in NAMED:
        raise InputError(f"data set {name} not found (looked for {name}.h5 in {looked})")
    raise InputError(f"unknown data set {name!r}: choose {', '.join(NAMED)}, "
                     f"a name with <name>.h5 in {looked}, or a path to an .h5 file")


def _open_file(path, label, in_memory):
    stat = os.stat(path)            # before reading: a change while it is read shows later
    f = validate_file(path)
    try:
        splits = {}
        for split in ("train", "test"):
            images = f[split]["images"]
            labels = f[split]["labels"][()]
            keep = in_memory if in_memory is not None else images.nbytes <= in_memory_bytes()
            splits[split] = Split(images[()] if keep else FileImages(images, path, f"/{split}/images"),
                                  labels)
        classes = [c.decode() if isinstance(c, bytes) else str(c) for c in f.attrs["classes"]]
        attrs = {k: f.attrs[k] for k in f.attrs if k != "classes"}
    except (OSError, RuntimeError, KeyError, ValueError, TypeError, MemoryError) as exc:
        f.close()
        raise InputError(f"{path} is corrupt ({exc})") from None
    except BaseException:
        f.close()
        raise
    file_backed = not (splits["train"].in_memory and splits["test"].in_memory)
    if not file_backed:
        f.close()
    dataset = Dataset(label, splits["train"], splits["test"], classes, path=Path(path),
                      attrs=attrs, file=f if file_backed else None)
    dataset._stat = stat
    return dataset


def open_dataset(name, seed=0, data_dir=None, input_shape=None, num_classes=None,
                 synthetic_size=(2048, 512), in_memory=None, names_only=False):
    """Open data set ``name`` ("digits", "mnist", "cifar10", "synthetic" or an .h5 path).

    Named sets are ``<dir>/<name>.h5`` in ``data_dir``, then ``$RINGNET_DATA``, then
    the ``datasets/`` folder next to the package. "synthetic" needs ``input_shape``
    and ``num_classes`` and is reproducible from ``seed``. ``in_memory`` forces
    (True) or forbids (False) reading the images into memory; by default files up
    to ``IN_MEMORY_BYTES`` of images are read. ``names_only``: ``name`` was read from a
    file (a checkpoint): see :func:`find_dataset`. Problems raise
    :class:`~ringnet.errors.InputError`.
    """
    if name == "synthetic":
        if input_shape is None or num_classes is None:
            raise InputError("data set synthetic needs the model's input shape and class count")
        n_train, n_test = synthetic_size
        try:
            arrays = make_synthetic(input_shape, num_classes, n_train, n_test, seed=seed)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        return Dataset("synthetic", Split(*arrays[:2]), Split(*arrays[2:]),
                       [str(c) for c in range(num_classes)],
                       attrs={"name": "synthetic", "source": f"ringnet synthetic, seed {seed}"})
    path = find_dataset(name, data_dir, names_only=names_only)
    label = name if name in NAMED else path.stem
    return _open_file(path, label, in_memory)


def check_compatible(dataset, input_shape, num_classes, model=None):
    """Raise InputError unless ``dataset`` fits a model with this input shape and class count."""
    who = f"model {model}" if model else "the model"
    have = tuple(int(v) for v in dataset.input_shape)
    want = tuple(int(v) for v in input_shape)
    if have != want:
        raise InputError(f"data set {dataset.name} has images {_shape_str(have)} but "
                         f"{who} expects {_shape_str(want)}")
    if dataset.num_classes > num_classes:
        raise InputError(f"data set {dataset.name} has {dataset.num_classes} classes but "
                         f"{who} has only {num_classes} outputs")
