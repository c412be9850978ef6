"""Convert MNIST idx files, CIFAR-10 python batches and image folders to the ringnet HDF5 layout."""
import gzip
import io
import os
import pickle
import tarfile
import zlib
from pathlib import Path

import numpy as np

from ringnet.data.hdf5 import write_dataset
from ringnet.errors import InputError, SetupError

__all__ = ["read_idx", "convert_mnist", "load_cifar_batch", "read_cifar10", "convert_cifar10",
           "read_imagefolder", "convert_imagefolder", "stratified_split",
           "MNIST_FILES", "IDX_SETS", "CIFAR10_BATCHES", "IMAGE_SUFFIXES"]

IDX_IMAGES, IDX_LABELS = 2051, 2049
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CIFAR10_DIR = "cifar-10-batches-py"
CIFAR10_BATCHES = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}
CIFAR10_META = "batches.meta"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_GZIP_MAGIC = b"\x1f\x8b"


def _one_line(exc):
    # Some library messages (tarfile's "could not be opened" list) span several lines.
    return " ".join(str(exc).split()) or type(exc).__name__


# --------------------------------------------------------------------------- MNIST


def _read_maybe_gzip(path):
    """Return the bytes of ``path``, gunzipped when it starts with the gzip magic."""
    raw = Path(path).read_bytes()
    if not raw.startswith(_GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError(f"{path}: corrupt or truncated gzip data ({_one_line(exc)})") from None


def read_idx(path, expect_magic=None):
    """Parse an MNIST idx file (2051 images / 2049 labels, gzipped or not); return a uint8 array."""
    data = _read_maybe_gzip(path)
    if len(data) < 8:
        raise InputError(f"{path}: too short for an idx header ({len(data)} bytes)")
    magic = int.from_bytes(data[:4], "big")
    if magic not in (IDX_IMAGES, IDX_LABELS):
        raise InputError(f"{path}: bad magic number {magic} (expected {IDX_IMAGES} for images "
                         f"or {IDX_LABELS} for labels)")
    if expect_magic is not None and magic != expect_magic:
        raise InputError(f"{path}: magic number {magic}, expected {expect_magic}")
    ndim = 3 if magic == IDX_IMAGES else 1
    header = 4 + 4 * ndim
    if len(data) < header:
        raise InputError(f"{path}: truncated idx header")
    dims = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    declared = int(np.prod(dims))
    actual = len(data) - header
    if actual != declared:
        raise InputError(f"{path}: header declares {'x'.join(map(str, dims))} = {declared} bytes "
                         f"of data but the file holds {actual}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _find_mnist_file(src_dir, stem):
    for name in (stem, stem + ".gz"):
        path = Path(src_dir) / name
        if path.is_file():
            return path
    raise InputError(f"{src_dir}: neither {stem} nor {stem}.gz found")


def read_mnist(src_dir):
    """Return {split: (images (N, 1, 28, 28) uint8, labels int64)} from the idx files in ``src_dir``."""
    if not Path(src_dir).is_dir():
        raise InputError(f"MNIST source {src_dir} is not a directory")
    parts = {}
    for split, (image_stem, label_stem) in MNIST_FILES.items():
        image_path = _find_mnist_file(src_dir, image_stem)
        label_path = _find_mnist_file(src_dir, label_stem)
        images = read_idx(image_path, IDX_IMAGES)
        labels = read_idx(label_path, IDX_LABELS)
        if len(images) != len(labels):
            raise InputError(f"{split}: {len(images)} images in {image_path.name} but "
                             f"{len(labels)} labels in {label_path.name}")
        if labels.size and labels.max() > 9:
            raise InputError(f"{label_path}: label {int(labels.max())} outside 0..9")
        parts[split] = (images[:, None, :, :], labels.astype(np.int64))
    return parts


# Data sets published in the MNIST idx format: what ``convert mnist --name`` records.
IDX_SETS = {
    "mnist": dict(classes=[str(d) for d in range(10)],
                  source="MNIST idx files (http://yann.lecun.com/exdb/mnist/)",
                  licence="CC BY-SA 3.0 (Y. LeCun, C. Cortes, C. J. C. Burges)"),
    "fashion-mnist": dict(classes=["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                                   "Shirt", "Sneaker", "Bag", "Ankle boot"],
                          source="Fashion-MNIST idx files, Zalando Research "
                                 "(https://github.com/zalandoresearch/fashion-mnist)",
                          licence="MIT (Copyright (c) 2017 Zalando SE)"),
}


def convert_mnist(src_dir, out, name="mnist"):
    """Convert the four idx files in ``src_dir`` to ``out``; return ``out``.

    ``name`` is stored in the file; for the sets in ``IDX_SETS`` (mnist, fashion-mnist)
    their class names, source and licence are recorded too, for any other name the
    source is the folder and the licence is left unrecorded.
    """
    parts = read_mnist(src_dir)
    known = IDX_SETS.get(name, dict(classes=[str(d) for d in range(10)],
                                    source=f"idx files in {os.path.abspath(src_dir)}", licence=""))
    return write_dataset(out, *parts["train"], *parts["test"], classes=known["classes"],
                         name=name, source=known["source"], licence=known["licence"])


# --------------------------------------------------------------------------- CIFAR-10


def _latin1_encode(text, encoding="latin1"):
    # Python 3 writes bytes at pickle protocol 2 as _codecs.encode(str, "latin1"); any
    # other codec (zlib, bz2, ...) has no business in a CIFAR batch.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode allowed only as str -> latin1 bytes")
    return text.encode("latin1")


# Taken from a live array's reduce tuple: numpy 1 and 2 keep it in different private modules.
_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _BatchUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals a numpy array needs; every other one is refused."""

    def find_class(self, module, name):
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name}") from None


def _unpickle(data, what):
    try:
        return _BatchUnpickler(io.BytesIO(data), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, MemoryError, OverflowError) as exc:
        raise InputError(f"{what}: not a valid CIFAR-10 pickle ({_one_line(exc)})") from None


_BATCH_KEYS = {b"data", b"labels", b"batch_label", b"filenames"}


def load_cifar_batch(data, what="batch"):
    """Unpickle one CIFAR-10 batch safely; return (images (N, 3, 32, 32) uint8, labels int64)."""
    batch = _unpickle(data, what)
    if not isinstance(batch, dict):
        raise InputError(f"{what}: expected a dict, got {type(batch).__name__}")
    extra = set(batch) - _BATCH_KEYS
    if extra:
        raise InputError(f"{what}: unexpected keys {sorted(map(repr, extra))}")
    for key in (b"data", b"labels"):
        if key not in batch:
            raise InputError(f"{what}: missing key {key!r}")
    pixels, labels = batch[b"data"], batch[b"labels"]
    if not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8 or pixels.ndim != 2 \
            or pixels.shape[1] != 3 * 32 * 32:
        shape = getattr(pixels, "shape", None)
        raise InputError(f"{what}: b'data' must be a uint8 array (N, 3072), got "
                         f"{type(pixels).__name__} {getattr(pixels, 'dtype', '')} {shape}")
    if not isinstance(labels, list) or not all(type(v) is int for v in labels):
        raise InputError(f"{what}: b'labels' must be a list of ints")
    if len(labels) != len(pixels):
        raise InputError(f"{what}: {len(pixels)} images but {len(labels)} labels")
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise InputError(f"{what}: label outside 0..9")
    # Rows are 1024 red, then 1024 green, then 1024 blue values, each plane row-major.
    return pixels.reshape(-1, 3, 32, 32), labels


def _load_cifar_meta(data, what):
    meta = _unpickle(data, what)
    names = meta.get(b"label_names") if isinstance(meta, dict) else None
    if not isinstance(names, list) or len(names) != 10 or not all(isinstance(n, bytes) for n in names):
        raise InputError(f"{what}: b'label_names' must be a list of 10 byte strings")
    return [n.decode("utf-8", "replace") for n in names]


def _cifar_members(src):
    """Yield (name, bytes) for every batch and the meta file from a tar.gz or extracted directory."""
    names = [*CIFAR10_BATCHES["train"], *CIFAR10_BATCHES["test"], CIFAR10_META]
    src = Path(src)
    if src.is_dir():
        base = src / CIFAR10_DIR if (src / CIFAR10_DIR).is_dir() else src
        for name in names:
            if not (base / name).is_file():
                raise InputError(f"{base}: missing CIFAR-10 file {name}")
        return {name: (base / name).read_bytes() for name in names}
    if not src.is_file():
        raise InputError(f"CIFAR-10 source {src} does not exist")
    members = {}
    try:
        # Members are read into memory by name, never extracted, so archive paths cannot escape.
        with tarfile.open(src, "r:*") as tar:
            for name in names:
                try:
                    info = tar.getmember(f"{CIFAR10_DIR}/{name}")
                except KeyError:
                    raise InputError(f"{src}: archive lacks {CIFAR10_DIR}/{name}") from None
                handle = tar.extractfile(info) if info.isfile() else None
                if handle is None:
                    raise InputError(f"{src}: {CIFAR10_DIR}/{name} is not a regular file")
                members[name] = handle.read()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise InputError(f"{src}: corrupt or truncated archive ({_one_line(exc)})") from None
    return members


def read_cifar10(src):
    """Return ({split: (images, labels)}, classes) from the CIFAR-10 python batches at ``src``."""
    members = _cifar_members(src)
    classes = _load_cifar_meta(members[CIFAR10_META], CIFAR10_META)
    parts = {}
    for split, names in CIFAR10_BATCHES.items():
        batches = [load_cifar_batch(members[name], name) for name in names]
        parts[split] = (np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches]))
    return parts, classes


def convert_cifar10(src, out):
    """Convert CIFAR-10 (``cifar-10-python.tar.gz`` or its extracted directory) to ``out``."""
    parts, classes = read_cifar10(src)
    return write_dataset(out, *parts["train"], *parts["test"], classes=classes, name="cifar10",
                         source="CIFAR-10 python batches (https://www.cs.toronto.edu/~kriz/cifar.html)",
                         licence="see https://www.cs.toronto.edu/~kriz/cifar.html (A. Krizhevsky, 2009)")


# --------------------------------------------------------------------------- image folders


def stratified_split(labels, test_fraction, seed):
    """Return boolean mask of test samples: round(fraction * count) per class, chosen by ``seed``."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    is_test = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        count = int(round(test_fraction * len(members)))
        is_test[rng.permutation(members)[:count]] = True
    return is_test


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise SetupError("converting image folders needs Pillow: pip install 'ringnet[images]' "
                         "(or pip install pillow)") from None
    return Image


def read_imagefolder(src_dir, size):
    """Load ``src_dir/<class>/*.{png,jpg,jpeg}`` resized to size x size RGB; return (images, labels, classes)."""
    Image = _pillow()
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise InputError(f"image folder {src_dir} is not a directory")
    if size < 1:
        raise InputError(f"image size must be positive, got {size}")
    classes = sorted(p.name for p in src_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise InputError(f"{src_dir}: no class sub-folders")
    for name in classes:
        try:
            name.encode("utf-8")        # class names are stored as text in the file
        except UnicodeEncodeError:
            raise InputError(f"{src_dir}: class folder {os.fsencode(name)!r} is not a UTF-8 "
                             f"name; rename it") from None
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(p for p in (src_dir / name).iterdir()
                       if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not found:
            raise InputError(f"{src_dir / name}: no .png/.jpg/.jpeg images")
        files += found
        labels += [label] * len(found)
    need = len(files) * size * size * 3
    try:
        images = np.empty((len(files), size, size, 3), dtype=np.uint8)
    except (MemoryError, ValueError):
        raise InputError(f"--size {size}: {len(files)} images of {size}x{size} RGB need "
                         f"{need / 2**30:.1f} GiB, more than this machine can hold") from None
    for i, path in enumerate(files):
        try:
            with Image.open(path) as image:
                image = image.convert("RGB")
                if image.size != (size, size):
                    image = image.resize((size, size), Image.BILINEAR)
                images[i] = np.asarray(image)
        except Image.DecompressionBombError as exc:
            raise InputError(f"{path}: image too large to decode safely ({_one_line(exc)})") from None
        except (OSError, SyntaxError, ValueError) as exc:
            raise InputError(f"{path}: cannot read image ({_one_line(exc)})") from None
    return images.transpose(0, 3, 1, 2), np.asarray(labels, dtype=np.int64), classes


def convert_imagefolder(src_dir, out, size=64, test_fraction=0.2, seed=0, name=None):
    """Convert a one-folder-per-class image tree to ``out`` with a seeded stratified split."""
    if not 0.0 <= test_fraction < 1.0:
        raise InputError(f"test fraction must be in [0, 1), got {test_fraction}")
    images, labels, classes = read_imagefolder(src_dir, size)
    is_test = stratified_split(labels, test_fraction, seed)
    return write_dataset(out, images[~is_test], labels[~is_test], images[is_test], labels[is_test],
                         classes=classes, name=name or Path(src_dir).resolve().name,
                         source=f"image folder {os.path.abspath(src_dir)} (size {size}, "
                                f"test fraction {test_fraction}, seed {seed})")
