"""The ringnet HDF5 data set layout: read, validate, and write atomically.

Layout (documented in ``datasets/README.md``)::

    /train/images   uint8  (N, C, H, W)
    /train/labels   int64  (N,)          values in [0, num_classes)
    /test/images    uint8  (M, C, H, W)
    /test/labels    int64  (M,)
    attrs: classes (array of str, length num_classes), name, source, licence
"""
import os
import tempfile

import h5py
import numpy as np

from ringnet.errors import UsageError

__all__ = ["SPLITS", "write_dataset", "atomic_output", "validate_file", "image_chunks"]

SPLITS = ("train", "test")


def _umask():
    """Return the process umask without changing it (os.umask alone must set one)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


CHUNK_BYTES = 64 << 10  # target size of one compressed chunk of images
MAX_CHUNK_IMAGES = 256


def image_chunks(shape):
    """Return the HDF5 chunk shape for images of ``shape`` (N, C, H, W).

    Chunks of about CHUNK_BYTES: a random sample costs one chunk decompression, so
    small chunks keep per-rank random reads cheap (256 CIFAR images per chunk cost
    ~3 ms each), while still compressing well.
    """
    per_image = max(1, int(np.prod(shape[1:])))
    rows = min(MAX_CHUNK_IMAGES, max(1, CHUNK_BYTES // per_image), max(1, shape[0]))
    return (rows,) + tuple(shape[1:])


class atomic_output:
    """Context manager yielding a temp path next to ``path``; renamed onto it on success.

    On any exception the temp file is removed and ``path`` is left as it was, so a
    crash never leaves a half-written file in place of a good one.
    """

    def __init__(self, path, suffix=".tmp"):
        self.path = os.fspath(path)
        self.suffix = suffix
        self.tmp = None

    def __enter__(self):
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=os.path.basename(self.path) + ".",
                                        suffix=self.suffix, dir=directory)
        os.close(fd)
        # mkstemp creates mode 0600; give the result the mode a plain open() would.
        os.chmod(self.tmp, 0o666 & ~_umask())
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            os.replace(self.tmp, self.path)
        elif os.path.exists(self.tmp):
            os.remove(self.tmp)
        return False


def write_dataset(path, train_images, train_labels, test_images, test_labels,
                  classes, name="", source="", licence="", compression="gzip"):
    """Validate the arrays and write them in the ringnet layout, atomically."""
    classes = [str(c) for c in classes]
    parts = {"train": (train_images, train_labels), "test": (test_images, test_labels)}
    for split, (images, labels) in parts.items():
        images = np.asarray(images)
        labels = np.asarray(labels)
        if images.dtype != np.uint8 or images.ndim != 4:
            raise UsageError(f"{split} images must be uint8 (N, C, H, W), got {images.dtype} {images.shape}")
        if labels.ndim != 1 or len(labels) != len(images):
            raise UsageError(f"{split}: {len(images)} images but labels of shape {labels.shape}")
        if len(labels) and (labels.min() < 0 or labels.max() >= len(classes)):
            raise UsageError(f"{split} labels outside [0, {len(classes)})")
        parts[split] = (images, labels.astype(np.int64))
    if parts["train"][0].shape[1:] != parts["test"][0].shape[1:]:
        raise UsageError("train and test images differ in shape")
    with atomic_output(path, suffix=".h5.tmp") as tmp:
        with h5py.File(tmp, "w") as f:
            for split, (images, labels) in parts.items():
                group = f.create_group(split)
                chunks = image_chunks(images.shape) if len(images) else None
                group.create_dataset("images", data=images, chunks=chunks,
                                     compression=compression if len(images) else None)
                group.create_dataset("labels", data=labels)
            f.attrs["classes"] = np.array(classes, dtype=h5py.string_dtype())
            f.attrs["name"] = name
            f.attrs["source"] = source
            f.attrs["licence"] = licence
    return path


def validate_file(path):
    """Open ``path`` read-only and check the layout; return the open h5py.File.

    Raises :class:`UsageError` naming the file and the problem.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise UsageError(f"data set file {path} does not exist")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise UsageError(f"{path} is not a readable HDF5 file ({exc})") from None
    try:
        if "classes" not in f.attrs:
            raise UsageError(f"{path}: missing attribute 'classes'")
        num_classes = len(f.attrs["classes"])
        shape = None
        for split in SPLITS:
            for key in ("images", "labels"):
                if f"{split}/{key}" not in f:
                    raise UsageError(f"{path}: missing data set /{split}/{key}")
            images, labels = f[split]["images"], f[split]["labels"]
            if images.dtype != np.uint8 or images.ndim != 4:
                raise UsageError(f"{path}: /{split}/images must be uint8 (N, C, H, W), "
                                 f"got {images.dtype} {images.shape}")
            if labels.shape != (images.shape[0],):
                raise UsageError(f"{path}: /{split} has {images.shape[0]} images but "
                                 f"labels of shape {labels.shape}")
            if shape is not None and images.shape[1:] != shape:
                raise UsageError(f"{path}: train and test images differ in shape")
            shape = images.shape[1:]
            lab = labels[()]
            if lab.size and (lab.min() < 0 or lab.max() >= num_classes):
                raise UsageError(f"{path}: /{split}/labels outside [0, {num_classes})")
    except UsageError:
        f.close()
        raise
    except (OSError, KeyError, ValueError) as exc:
        f.close()
        raise UsageError(f"{path} is corrupt ({exc})") from None
    return f
