"""Converters and `python -m ringnet.datasets`: sources written here in the original formats.

Reference: the arrays the test itself wrote into the idx files, pickle batches and PNGs;
the converted HDF5 file must hold them pixel for pixel with the right labels.
"""
import gzip
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from ringnet import datasets
from ringnet.data import convert
from ringnet.errors import InputError

REPO = Path(__file__).resolve().parents[2]
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# --------------------------------------------------------------------------- writers of the original formats


def write_idx(path, array, magic, gz, declared=None):
    """Write ``array`` as an idx file: big-endian magic, big-endian dims, raw uint8 data."""
    dims = array.shape if declared is None else declared
    data = struct.pack(f">I{len(dims)}I", magic, *dims) + np.ascontiguousarray(array, np.uint8).tobytes()
    Path(path).write_bytes(gzip.compress(data) if gz else data)


def make_mnist(folder, gz=True, n_train=12, n_test=7, seed=0):
    """Write the four MNIST idx files to ``folder``; return {split: (images (N,28,28), labels)}."""
    rng = np.random.default_rng(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    parts = {}
    suffix = ".gz" if gz else ""
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        image_stem, label_stem = convert.MNIST_FILES[split]
        write_idx(folder / (image_stem + suffix), images, 2051, gz)
        write_idx(folder / (label_stem + suffix), labels, 2049, gz)
        parts[split] = (images, labels)
    return parts


def py2_pickle(obj):
    """Serialise ``obj`` the way Python 2's cPickle did at protocol 2 (str as BINSTRING).

    This is the byte layout of the published CIFAR-10 python batches: dict keys and the
    array's raw bytes are Python 2 ``str``, the array goes through numpy's _reconstruct.
    """
    out = [b"\x80\x02"]

    def emit(o):
        if isinstance(o, dict):
            out.append(b"}(")
            for key, value in o.items():
                emit(key)
                emit(value)
            out.append(b"u")
        elif isinstance(o, list):
            out.append(b"](")
            for value in o:
                emit(value)
            out.append(b"e")
        elif isinstance(o, tuple):
            out.append(b"(")
            for value in o:
                emit(value)
            out.append(b"t")
        elif isinstance(o, bytes):
            out.append(b"U" + bytes([len(o)]) + o if len(o) < 256 else b"T" + struct.pack("<I", len(o)) + o)
        elif isinstance(o, bool):
            out.append(b"\x88" if o else b"\x89")
        elif isinstance(o, int):
            out.append(b"J" + struct.pack("<i", o))
        elif o is None:
            out.append(b"N")
        elif isinstance(o, np.ndarray):
            assert o.dtype == np.uint8
            out.append(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n")
            emit((0,))
            emit(b"b")
            out.append(b"\x87R")  # TUPLE3, REDUCE
            out.append(b"(J\x01\x00\x00\x00")
            emit(tuple(o.shape))
            out.append(b"cnumpy\ndtype\n")
            emit((b"u1", 0, 1))
            out.append(b"R")
            emit((3, b"|", None, None, None, -1, -1, 0))
            out.append(b"b")  # BUILD the dtype
            emit(False)
            emit(o.tobytes())
            out.append(b"tb")  # state tuple, BUILD the array
        else:
            raise TypeError(type(o))

    emit(obj)
    out.append(b".")
    return b"".join(out)


def cifar_batches(n_per_batch=3, n_test=4, seed=0):
    """Return {file name: dict} for the five train batches, test_batch and batches.meta."""
    rng = np.random.default_rng(seed)
    batches = {}
    for name, n in [(f"data_batch_{i}", n_per_batch) for i in range(1, 6)] + [("test_batch", n_test)]:
        batches[name] = {
            b"batch_label": name.encode(),
            b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"filenames": [f"img_{i}.png".encode() for i in range(n)],
        }
    batches["batches.meta"] = {b"num_cases_per_batch": n_per_batch,
                               b"label_names": [c.encode() for c in CIFAR_CLASSES], b"num_vis": 3072}
    return batches


def write_cifar(target, batches, style):
    """Write ``batches`` as an extracted folder (py3 protocol 2) or a tar.gz of py2-style pickles."""
    target = Path(target)
    if style == "dir":
        folder = target / convert.CIFAR10_DIR
        folder.mkdir(parents=True)
        for name, obj in batches.items():
            (folder / name).write_bytes(pickle.dumps(obj, protocol=2))
        return target
    with tarfile.open(target, "w:gz") as tar:
        for name, obj in batches.items():
            data = py2_pickle(obj)
            info = tarfile.TarInfo(f"{convert.CIFAR10_DIR}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return target


def expected_cifar(batches):
    """Images (N, 3, 32, 32) from the documented row layout: 1024 R, 1024 G, 1024 B, row-major."""
    parts = {}
    for split, names in convert.CIFAR10_BATCHES.items():
        data = np.concatenate([batches[n][b"data"] for n in names])
        images = np.stack([data[:, 0:1024], data[:, 1024:2048], data[:, 2048:3072]], axis=1)
        parts[split] = (images.reshape(-1, 3, 32, 32), np.concatenate([batches[n][b"labels"] for n in names]))
    return parts


def run_cli(*args, timeout=60):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ringnet.datasets", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def read_h5(path):
    with h5py.File(path, "r") as f:
        return ({s: (f[s]["images"][()], f[s]["labels"][()]) for s in ("train", "test")},
                [c.decode() if isinstance(c, bytes) else c for c in f.attrs["classes"]])


# --------------------------------------------------------------------------- successful conversions


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "raw"])
def test_convert_mnist_pixel_for_pixel(tmp_path, gz):
    source = make_mnist(tmp_path / "src", gz=gz)
    out = tmp_path / "mnist.h5"
    assert datasets.main(["convert", "mnist", str(tmp_path / "src"), "--out", str(out)]) == 0
    parts, classes = read_h5(out)
    assert classes == [str(d) for d in range(10)]
    for split, (images, labels) in source.items():
        got_images, got_labels = parts[split]
        assert got_images.dtype == np.uint8 and got_images.shape == (len(images), 1, 28, 28)
        np.testing.assert_array_equal(got_images[:, 0], images, err_msg=f"{split} images")
        np.testing.assert_array_equal(got_labels, labels, err_msg=f"{split} labels")
        assert got_labels.dtype == np.int64


def test_convert_mnist_name_records_set_source_and_licence(tmp_path, monkeypatch):
    make_mnist(tmp_path / "src")
    monkeypatch.setenv("RINGNET_DATA", str(tmp_path / "data"))
    assert datasets.main(["convert", "mnist", str(tmp_path / "src"), "--name", "fashion-mnist"]) == 0
    out = tmp_path / "data" / "fashion-mnist.h5"          # default output named after --name
    summary = datasets.info(out)
    assert summary["name"] == "fashion-mnist"
    assert "Zalando" in summary["source"] and summary["licence"].startswith("MIT")
    assert summary["classes"][0] == "T-shirt/top" and summary["classes"][9] == "Ankle boot"
    # plain MNIST keeps its own record; an unknown name records the folder, no licence
    datasets.main(["convert", "mnist", str(tmp_path / "src"), "--out", str(tmp_path / "m.h5")])
    assert datasets.info(tmp_path / "m.h5")["licence"].startswith("CC BY-SA")
    datasets.main(["convert", "mnist", str(tmp_path / "src"), "--name", "kmnist",
                   "--out", str(tmp_path / "k.h5")])
    other = datasets.info(tmp_path / "k.h5")
    assert other["name"] == "kmnist" and other["licence"] == ""
    assert str((tmp_path / "src").resolve()) in other["source"]


@pytest.mark.parametrize("style", ["tar.gz", "dir"])
def test_convert_cifar10_pixel_for_pixel(tmp_path, style):
    batches = cifar_batches()
    src = write_cifar(tmp_path / ("cifar-10-python.tar.gz" if style == "tar.gz" else "extracted"), batches, style)
    out = tmp_path / "cifar10.h5"
    assert datasets.main(["convert", "cifar10", str(src), "--out", str(out)]) == 0
    parts, classes = read_h5(out)
    assert classes == CIFAR_CLASSES
    for split, (images, labels) in expected_cifar(batches).items():
        np.testing.assert_array_equal(parts[split][0], images, err_msg=f"{split} images")
        np.testing.assert_array_equal(parts[split][1], labels, err_msg=f"{split} labels")
    # One pixel checked by hand against the layout: green channel, row 1, column 2 of image 0.
    assert parts["train"][0][0, 1, 1, 2] == batches["data_batch_1"][b"data"][0, 1024 + 32 + 2]


def test_convert_imagefolder_split_and_pixels(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(1)
    counts = {"bus": 5, "car": 7, "truck": 3}
    sources = {}  # pixel bytes (H, W, 3) -> class index
    for label, (name, count) in enumerate(sorted(counts.items())):
        (tmp_path / "src" / name).mkdir(parents=True)
        for i in range(count):
            pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels, "RGB").save(tmp_path / "src" / name / f"{i}.png")
            sources[pixels.tobytes()] = label
    # A grayscale file becomes three equal channels; a file of another size is resized.
    gray = rng.integers(0, 256, (8, 8), dtype=np.uint8)
    Image.fromarray(gray, "L").save(tmp_path / "src" / "car" / "gray.png")
    sources[np.repeat(gray[:, :, None], 3, axis=2).tobytes()] = 1
    Image.new("RGB", (13, 5), (10, 200, 30)).save(tmp_path / "src" / "truck" / "wide.png")
    sources[np.tile(np.array([10, 200, 30], np.uint8), (8, 8, 1)).tobytes()] = 2
    (tmp_path / "src" / "truck" / "notes.txt").write_text("not an image")
    per_class = [5, 8, 4]

    out = tmp_path / "vehicles.h5"
    args = ["convert", "imagefolder", str(tmp_path / "src"), "--size", "8", "--test-fraction", "0.4",
            "--seed", "3", "--out", str(out)]
    assert datasets.main(args) == 0
    parts, classes = read_h5(out)
    assert classes == ["bus", "car", "truck"]
    seen = []
    for split in ("train", "test"):
        images, labels = parts[split]
        assert images.shape[1:] == (3, 8, 8)
        for image, label in zip(images, labels):
            key = image.transpose(1, 2, 0).tobytes()
            assert key in sources, f"{split} image not among the sources"
            assert sources[key] == label, f"{split} image has label {label}, source class {sources[key]}"
            seen.append(key)
    assert sorted(seen) == sorted(sources), "every source image exactly once"
    expected_test = [int(round(0.4 * n)) for n in per_class]
    assert np.bincount(parts["test"][1], minlength=3).tolist() == expected_test
    assert np.bincount(parts["train"][1], minlength=3).tolist() == [n - t for n, t in zip(per_class, expected_test)]

    # Same seed, same split; the info command reports the same counts.
    again = tmp_path / "again.h5"
    datasets.main(args[:-1] + [str(again)])
    np.testing.assert_array_equal(read_h5(again)[0]["test"][0], parts["test"][0])
    result = run_cli("info", out, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["splits"]["test"]["per_class"] == dict(zip(classes, expected_test))
    assert summary["image_shape"] == [3, 8, 8]


def test_stratified_split_counts_and_seed():
    labels = np.repeat(np.arange(4), [10, 3, 1, 6])
    masks = [convert.stratified_split(labels, 0.25, seed) for seed in (0, 0, 1)]
    np.testing.assert_array_equal(masks[0], masks[1])
    assert not np.array_equal(masks[0], masks[2])
    assert np.bincount(labels[masks[0]], minlength=4).tolist() == [round(2.5), round(0.75), 0, round(1.5)]


def test_info_text_and_json(tmp_path):
    source = make_mnist(tmp_path / "src")
    out = tmp_path / "m.h5"
    datasets.main(["convert", "mnist", str(tmp_path / "src"), "--out", str(out)])
    summary = datasets.info(out)
    import hashlib
    assert summary["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    for split, (_, labels) in source.items():
        assert summary["splits"][split]["count"] == len(labels)
        assert list(summary["splits"][split]["per_class"].values()) == np.bincount(labels, minlength=10).tolist()
    result = run_cli("info", out)
    assert result.returncode == 0 and summary["sha256"] in result.stdout


# --------------------------------------------------------------------------- malformed input: exit 2, no output


def _mnist_with(tmp_path, mutate):
    make_mnist(tmp_path / "src", gz=False)
    mutate(tmp_path / "src")
    return ["convert", "mnist", tmp_path / "src"]


def _bad_magic(src):
    data = bytearray((src / "train-images-idx3-ubyte").read_bytes())
    data[3] = 0x04  # 2052
    (src / "train-images-idx3-ubyte").write_bytes(bytes(data))


def _truncated_idx(src):
    path = src / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])


def _count_mismatch(src):
    labels = np.zeros(11, np.uint8)  # 12 train images
    write_idx(src / "train-labels-idx1-ubyte", labels, 2049, gz=False)


def _label_out_of_range(src):
    write_idx(src / "t10k-labels-idx1-ubyte", np.array([0, 1, 2, 10, 4, 5, 6], np.uint8), 2049, gz=False)


def _corrupt_gzip(src):
    data = bytearray(gzip.compress((src / "train-images-idx3-ubyte").read_bytes()))
    data[len(data) // 2] ^= 0xFF
    (src / "train-images-idx3-ubyte").unlink()
    (src / "train-images-idx3-ubyte.gz").write_bytes(bytes(data))


def _truncated_gzip(src):
    data = gzip.compress((src / "t10k-labels-idx1-ubyte").read_bytes())
    (src / "t10k-labels-idx1-ubyte").unlink()
    (src / "t10k-labels-idx1-ubyte.gz").write_bytes(data[:-12])


def _missing_file(src):
    (src / "t10k-labels-idx1-ubyte").unlink()


def _cifar_dir_with(tmp_path, change):
    batches = cifar_batches()
    change(batches)
    write_cifar(tmp_path / "src", batches, "dir")
    return ["convert", "cifar10", tmp_path / "src"]


class _Exploit:
    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def _corrupt_tar(tmp_path):
    path = write_cifar(tmp_path / "cifar-10-python.tar.gz", cifar_batches(), "tar.gz")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return ["convert", "cifar10", path]


def _not_a_tar(tmp_path):
    path = tmp_path / "cifar-10-python.tar.gz"
    path.write_bytes(gzip.compress(b"x" * 5000))
    return ["convert", "cifar10", path]


BAD_INPUTS = {
    "mnist-bad-magic": (lambda p: _mnist_with(p, _bad_magic), "bad magic number 2052"),
    "mnist-truncated-idx": (lambda p: _mnist_with(p, _truncated_idx), "but the file holds"),
    "mnist-count-mismatch": (lambda p: _mnist_with(p, _count_mismatch), "12 images"),
    "mnist-label-range": (lambda p: _mnist_with(p, _label_out_of_range), "label 10 outside 0..9"),
    "mnist-corrupt-gzip": (lambda p: _mnist_with(p, _corrupt_gzip), "gzip"),
    "mnist-truncated-gzip": (lambda p: _mnist_with(p, _truncated_gzip), "gzip"),
    "mnist-missing-file": (lambda p: _mnist_with(p, _missing_file), "t10k-labels-idx1-ubyte"),
    "cifar-corrupt-tar": (_corrupt_tar, "corrupt or truncated archive"),
    "cifar-not-a-tar": (_not_a_tar, "corrupt or truncated archive"),
    "cifar-missing-key": (lambda p: _cifar_dir_with(p, lambda b: b["data_batch_2"].pop(b"labels")),
                          "missing key b'labels'"),
    "cifar-extra-key": (lambda p: _cifar_dir_with(p, lambda b: b["test_batch"].update({b"mean": 1})),
                        "unexpected keys"),
    "cifar-label-range": (lambda p: _cifar_dir_with(p, lambda b: b["test_batch"][b"labels"].__setitem__(0, 10)),
                          "label outside 0..9"),
    "cifar-data-shape": (lambda p: _cifar_dir_with(
        p, lambda b: b["data_batch_1"].update({b"data": np.zeros((3, 3000), np.uint8)})), "(N, 3072)"),
    "cifar-count-mismatch": (lambda p: _cifar_dir_with(p, lambda b: b["data_batch_3"][b"labels"].pop()),
                             "3 images but 2 labels"),
    "cifar-forbidden-global": (
        lambda p: _cifar_dir_with(p, lambda b: b["data_batch_1"].update({b"data": _Exploit(p / "PWNED")})),
        "forbidden global posix.system"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_malformed_input_refused(tmp_path, case):
    build, needle = BAD_INPUTS[case]
    args = build(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = run_cli(*args, "--out", out_dir / "x.h5")
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringnet: error:"), result.stderr
    assert "Traceback" not in result.stderr
    assert needle in lines[0], lines[0]
    assert os.listdir(out_dir) == [], "no output or temp file left behind"
    assert not (tmp_path / "PWNED").exists(), "the forbidden global was executed"


def test_forbidden_codec_refused():
    # _codecs.encode is allowed only for str -> latin1 bytes (how Python 3 writes bytes at protocol 2).
    class Bomb:
        def __reduce__(self):
            import codecs
            return (codecs.encode, (b"x" * 10, "zlib_codec"))
    data = pickle.dumps({b"data": Bomb(), b"labels": []}, protocol=2)
    with pytest.raises(InputError, match="_codecs.encode allowed only"):
        convert.load_cifar_batch(data, "batch")


def test_bad_arguments_one_line(tmp_path):
    result = run_cli("convert", "imagefolder", tmp_path, "--test-fraction", "1.5", "--out", tmp_path / "x.h5")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "ringnet: error: --test-fraction must be in [0, 1), got 1.5"]
    result = run_cli("convert", "svhn", tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "invalid choice" in result.stderr
    (tmp_path / "fake.h5").write_text("not hdf5")
    result = run_cli("info", tmp_path / "fake.h5")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "is not a readable HDF5 file" in result.stderr


def test_data_module_and_datasets_alias_are_one_command():
    """``python -m ringnet.data`` is the CLI; ``python -m ringnet.datasets`` runs the same main."""
    from ringnet.data import __main__ as data_main
    assert datasets.main is data_main.main
    digits = Path(__file__).resolve().parents[2] / "datasets" / "digits.h5"
    outputs = [subprocess.run([sys.executable, "-m", module, "info", str(digits), "--json"],
                              capture_output=True, text=True, timeout=120)
               for module in ("ringnet.data", "ringnet.datasets")]
    assert [o.returncode for o in outputs] == [0, 0], outputs[0].stderr + outputs[1].stderr
    assert json.loads(outputs[0].stdout)["sha256"] == json.loads(outputs[1].stdout)["sha256"]


def _convert_cli(*args):
    return subprocess.run([sys.executable, "-m", "ringnet.datasets", "convert", "imagefolder",
                           *map(str, args)], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _one_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("ringnet: error:"), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_imagefolder_bad_inputs_are_one_line_each(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    src = tmp_path / "src"
    for name in ("a", "b"):
        (src / name).mkdir(parents=True)
        Image.new("RGB", (4, 4), (1, 2, 3)).save(src / name / "x.png")
    # an impossible --size: no traceback, no file
    _one_error(_convert_cli(src, "--size", "10000000", "--out", tmp_path / "o.h5"), "--size 10000000")
    assert not (tmp_path / "o.h5").exists()
    # a decompression bomb, named
    big = src / "b" / "bomb.png"
    Image.new("1", (20000, 20000)).save(big)      # 400 Mpixel: over PIL's bomb limit
    _one_error(_convert_cli(src, "--size", "8", "--out", tmp_path / "o.h5"), str(big), "too large")
    big.unlink()
    # a class folder whose name is not UTF-8
    os.mkdir(os.fsencode(src) + b"/caf\xe9")
    Image.new("RGB", (4, 4)).save(os.fsdecode(os.fsencode(src) + b"/caf\xe9/x.png"))
    _one_error(_convert_cli(src, "--size", "8", "--out", tmp_path / "o.h5"), "not a UTF-8 name")
