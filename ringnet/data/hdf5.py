"""The ringnet HDF5 data set layout: read, validate, and write atomically.

Layout (documented in ``datasets/README.md``)::

    /train/images   uint8  (N, C, H, W)
    /train/labels   int64  (N,)          values in [0, num_classes)
    /test/images    uint8  (M, C, H, W)
    /test/labels    int64  (M,)
    attrs: classes (array of str, length num_classes), name, source, licence
"""
import os
import stat
import tempfile

import h5py
import numpy as np

from ringnet.errors import InputError
from ringnet.outputs import file_kind

__all__ = ["SPLITS", "write_dataset", "atomic_output", "validate_file", "image_chunks", "file_mode",
           "verify_file", "FileImages", "member", "open_regular"]

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


def file_mode():
    """Return the mode a plain ``open()`` gives a new file (0666 less the umask)."""
    return 0o666 & ~_umask()


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
        os.chmod(self.tmp, file_mode())
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                os.replace(self.tmp, self.path)
        finally:
            if os.path.exists(self.tmp):        # failed, or the rename itself failed
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
            raise InputError(f"{split} images must be uint8 (N, C, H, W), got {images.dtype} {images.shape}")
        if labels.dtype.kind not in "iu":
            raise InputError(f"{split} labels must be integers, got {labels.dtype}")
        if labels.ndim != 1 or len(labels) != len(images):
            raise InputError(f"{split}: {len(images)} images but labels of shape {labels.shape}")
        if len(labels) and (labels.min() < 0 or labels.max() >= len(classes)):
            raise InputError(f"{split} labels outside [0, {len(classes)})")
        parts[split] = (images, labels.astype(np.int64))
    if parts["train"][0].shape[1:] != parts["test"][0].shape[1:]:
        raise InputError("train and test images differ in shape")
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


def _classes(path, f):
    """Return the class names of open file ``f``: a 1-D array of strings, at least one."""
    if "classes" not in f.attrs:
        raise InputError(f"{path}: missing attribute 'classes'")
    classes = f.attrs["classes"]
    if not isinstance(classes, np.ndarray) or classes.ndim != 1 or not len(classes) \
            or not all(isinstance(c, (str, bytes)) for c in classes):
        raise InputError(f"{path}: attribute 'classes' must be a list of class names, "
                         f"got {type(classes).__name__} {np.asarray(classes).dtype}")
    return [c.decode() if isinstance(c, bytes) else str(c) for c in classes]


def open_regular(path, what):
    """Open ``path`` read-only with h5py after checking it is a regular file (a FIFO would
    block the open, a device is no file); InputError names ``what`` (``data set file``)."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise InputError(f"{what} {path} cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} {path} is not a readable HDF5 file: it is "
                         f"{file_kind(st.st_mode)}")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise InputError(f"{what} {path} is not a readable HDF5 file ({exc})") from None


_LINK_KINDS = {h5py.SoftLink: "a soft link", h5py.ExternalLink: "an external link (to another file)"}


def member(f, name, where, kind=h5py.Dataset):
    """Return the object ``name`` ("train/images") of open file ``f``, reached through hard
    links only, and of ``kind`` (h5py.Dataset or h5py.Group); a data set must hold its data
    in this file (not virtual, no external storage).

    Raises InputError starting with ``where`` (the file): a ringnet file holds its data
    itself, so soft links (which may loop) and external links or storage (which name other
    files) are refused, not followed.
    """
    parts = [p for p in name.split("/") if p]
    obj = f
    for i, part in enumerate(parts):
        here = "/" + "/".join(parts[:i + 1])
        if not isinstance(obj, h5py.Group):
            raise InputError(f"{where}: {here.rsplit('/', 1)[0]} must be a group")
        try:
            link = obj.get(part, getlink=True)
        except (OSError, RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise InputError(f"{where}: {here} cannot be read ({exc})") from None
        if link is None:
            what = "data set" if kind is h5py.Dataset else "group"
            raise InputError(f"{where}: missing {what} /{'/'.join(parts)}")
        if not isinstance(link, h5py.HardLink):
            raise InputError(f"{where}: {here} is {_LINK_KINDS.get(type(link), 'a link')}; a "
                             f"ringnet file holds its data itself and such links are not followed")
        try:
            obj = obj[part]
        except (OSError, RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise InputError(f"{where}: {here} cannot be read ({exc})") from None
    if not isinstance(obj, kind):
        want = "data set" if kind is h5py.Dataset else "group"
        raise InputError(f"{where}: /{'/'.join(parts)} must be a {want}, got a {type(obj).__name__}")
    if kind is h5py.Dataset:
        try:
            virtual, external = obj.is_virtual, obj.external
        except (OSError, RuntimeError, ValueError) as exc:
            raise InputError(f"{where}: /{'/'.join(parts)} cannot be read ({exc})") from None
        if virtual or external:
            raise InputError(f"{where}: /{'/'.join(parts)} keeps its data in other files "
                             f"({'a virtual data set' if virtual else 'external storage'}); a "
                             f"ringnet file holds its data itself")
    return obj


def _dataset(path, f, name):
    """Return the h5py data set ``name`` of ``f`` or raise InputError (missing, a group, a link)."""
    return member(f, name, path)


_TEXT_ATTRS = ("name", "source", "licence")


def validate_file(path):
    """Open ``path`` read-only and check the layout; return the open h5py.File.

    Checks the structure (hard links only, data kept in this file), dtypes and shapes, the
    text attributes, that labels are integers within the classes, and reads every label.
    Raises :class:`~ringnet.errors.InputError` naming the file and the problem.
    :func:`verify_file` also reads every image chunk.
    """
    path = os.fspath(path)
    f = open_regular(path, "data set file")
    try:
        num_classes = len(_classes(path, f))
        for key in _TEXT_ATTRS:
            if key in f.attrs and not isinstance(f.attrs[key], (str, bytes)):
                raise InputError(f"{path}: attribute '{key}' must be text, got "
                                 f"{type(f.attrs[key]).__name__}")
        shape = None
        for split in SPLITS:
            images = _dataset(path, f, f"{split}/images")
            labels = _dataset(path, f, f"{split}/labels")
            if images.dtype != np.uint8 or images.ndim != 4:
                raise InputError(f"{path}: /{split}/images must be uint8 (N, C, H, W), "
                                 f"got {images.dtype} {images.shape}")
            if labels.dtype.kind not in "iu":
                raise InputError(f"{path}: /{split}/labels must be integers, got {labels.dtype} "
                                 "(convert them with the class index of each image)")
            if labels.shape != (images.shape[0],):
                raise InputError(f"{path}: /{split} has {images.shape[0]} images but "
                                 f"labels of shape {labels.shape}")
            if shape is not None and images.shape[1:] != shape:
                raise InputError(f"{path}: train and test images differ in shape")
            shape = images.shape[1:]
            lab = labels[()]
            if lab.size and (lab.min() < 0 or lab.max() >= num_classes):
                raise InputError(f"{path}: /{split}/labels outside [0, {num_classes})")
    except InputError:
        f.close()
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError, AttributeError,
            MemoryError) as exc:
        f.close()
        raise InputError(f"{path} is corrupt ({exc})") from None
    return f


def _rows(index):
    """Describe the rows an index selects: "3..9" for a slice, "4 rows from 0 to 17" otherwise."""
    if isinstance(index, slice):
        return f"{index.start or 0}..{index.stop - 1}" if index.stop is not None else f"{index.start or 0}.."
    rows = np.asarray(index).reshape(-1)
    if rows.size == 1:
        return str(int(rows[0]))
    return f"{rows.size} rows from {int(rows.min())} to {int(rows.max())}" if rows.size else "no rows"


class FileImages:
    """The images of a split left in its file: reads go to the h5py data set, and a read
    that fails (a corrupt chunk, a file changed or truncated under the run) raises
    :class:`~ringnet.errors.InputError` naming the file, the data set and the rows."""

    HINT = "; check it with `python -m ringnet.datasets info --verify FILE`"

    def __init__(self, dataset, path, name, hint=HINT):
        self.dataset, self.hint = dataset, hint
        self.path = os.fspath(path)
        self.name = name                  # "/train/images"
        self.shape, self.dtype, self.chunks = dataset.shape, dataset.dtype, dataset.chunks
        self.ndim, self.nbytes = dataset.ndim, dataset.nbytes

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, index):
        try:
            return self.dataset[index]
        except OSError as exc:
            raise InputError(f"{self.path}: {self.name} {_rows(index)} cannot be read, the file is "
                             f"corrupt ({exc}){self.hint}") from None


def verify_file(path, progress=None):
    """Validate ``path`` and read every chunk of every data set; raise InputError on the first bad one.

    ``progress(done, total)`` is called after each block of images.
    """
    with validate_file(path) as f:
        total = sum(f[f"{split}/images"].shape[0] for split in SPLITS)
        done = 0
        for split in SPLITS:
            images = FileImages(f[f"{split}/images"], path, f"/{split}/images", hint="")
            step = images.chunks[0] if images.chunks else max(1, MAX_CHUNK_IMAGES)
            for start in range(0, images.shape[0], step):
                stop = min(images.shape[0], start + step)
                images[start:stop]
                done += stop - start
                if progress is not None:
                    progress(done, total)
