"""python -m ringnet.data download|convert|info — get data sets into the ringnet HDF5 layout.

``python -m ringnet.datasets`` is the same command (an alias).
"""
import argparse
import json
import os
import sys

import numpy as np

from ringnet.data import convert as _convert
from ringnet.data import download as _download
from ringnet.data.hdf5 import SPLITS, validate_file, verify_file
from ringnet.errors import UsageError
from ringnet.cli import ArgumentParser, run_main
from ringnet.outputs import check_distinct, check_output

__all__ = ["main", "info"]


def info(path, verify=False):
    """Return a dict describing the data set file ``path``: counts, shape, classes, SHA-256.

    ``verify`` also reads every image chunk (a corrupt one raises InputError).
    """
    if verify:
        verify_file(path)
    with validate_file(path) as f:
        classes = [c.decode() if isinstance(c, bytes) else str(c) for c in f.attrs["classes"]]
        splits = {}
        for split in SPLITS:
            labels = f[split]["labels"][()]
            counts = np.bincount(labels, minlength=len(classes)) if labels.size else np.zeros(len(classes), int)
            splits[split] = {"count": int(labels.size),
                             "per_class": {c: int(n) for c, n in zip(classes, counts)}}
        shape = list(f["train"]["images"].shape[1:])
        attrs = {key: str(f.attrs.get(key, "")) for key in ("name", "source", "licence")}
    return {"file": os.fspath(path), "bytes": os.path.getsize(path),
            "sha256": _download.file_sha256(path), **attrs, "image_shape": shape,
            "classes": classes, "splits": splits, "verified": bool(verify)}


def _print_info(summary):
    c, h, w = summary["image_shape"]
    print(f"file      {summary['file']} ({summary['bytes'] / 2**20:.1f} MiB)")
    print(f"sha256    {summary['sha256']}")
    for key in ("name", "source", "licence"):
        if summary[key]:
            print(f"{key:9s} {summary[key]}")
    print(f"images    uint8 {c} x {h} x {w} (C x H x W)")
    print(f"classes   {len(summary['classes'])}")
    width = max([5] + [len(name) for name in summary["classes"]])
    print(f"  {'class':{width}s} " + " ".join(f"{split:>8s}" for split in SPLITS))
    for name in summary["classes"]:
        row = " ".join(f"{summary['splits'][split]['per_class'][name]:8d}" for split in SPLITS)
        print(f"  {name:{width}s} {row}")
    print(f"  {'total':{width}s} " + " ".join(f"{summary['splits'][s]['count']:8d}" for s in SPLITS))
    if summary["verified"]:
        print("verified  every image chunk read without error")


# The formats of `convert`: (name, help, description, (source metavar, its help),
# default output name, [(flag, add_argument settings)] of the format's own options).
_CONVERTERS = (
    ("mnist", "the four idx files of MNIST or Fashion-MNIST",
     "Read train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
     "t10k-labels-idx1-ubyte (each gzipped or not) from SRC_DIR; images become (N, 1, 28, 28). "
     "Also reads any other set in this format, such as Fashion-MNIST (Debian: apt-get install "
     "dataset-fashion-mnist, then SRC_DIR = /usr/share/datasets/fashion-mnist).",
     ("SRC_DIR", None), "NAME",
     [("--name", {"default": "mnist",
                  "help": "data set name stored in the file and default output name (default "
                          "mnist); mnist and fashion-mnist also record their class names, "
                          "source and licence"})]),
    ("cifar10", "the CIFAR-10 python batches",
     "Read data_batch_1..5, test_batch and batches.meta from cifar-10-python.tar.gz or the "
     "extracted cifar-10-batches-py folder. The pickles are loaded with an unpickler that "
     "allows only numpy's array globals; images become (N, 3, 32, 32).",
     ("SRC", "cifar-10-python.tar.gz or the cifar-10-batches-py folder"), "cifar10", []),
    ("imagefolder", "one sub-folder of JPEG/PNG images per class",
     "Read SRC_DIR/<class>/*.png|*.jpg|*.jpeg (classes = sorted sub-folder names), convert to "
     "RGB, resize to SIZE x SIZE and split each class into train and test with a seeded "
     "shuffle. Needs Pillow (pip install 'ringnet[images]').",
     ("SRC_DIR", None), "<SRC_DIR name>",
     [("--size", {"type": int, "default": 64, "help": "output width and height (default 64)"}),
      ("--test-fraction", {"type": float, "default": 0.2,
                           "help": "share of each class put in the test split (default 0.2)"}),
      ("--seed", {"type": int, "default": 0, "help": "seed of the split (default 0)"}),
      ("--name", {"help": "data set name stored in the file (default: SRC_DIR's name)"})]),
)


def _build_parser():
    parser = ArgumentParser(prog="python -m ringnet.datasets",
                     description="Download, convert and inspect data sets in the ringnet HDF5 layout "
                                 "(/train and /test groups with uint8 images (N, C, H, W) and int64 "
                                 "labels, class names in the 'classes' attribute).",
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="examples:\n"
                            "  python -m ringnet.datasets download mnist\n"
                            "  python -m ringnet.datasets convert mnist /usr/share/datasets/fashion-mnist --name fashion-mnist\n"
                            "  python -m ringnet.datasets convert cifar10 cifar-10-python.tar.gz --out cifar10.h5\n"
                            "  python -m ringnet.datasets convert imagefolder cars/ --size 64 --out cars.h5\n"
                            "  python -m ringnet.datasets info datasets/mnist.h5\n"
                            "`python -m ringnet.datasets COMMAND --help` explains each command.")
    commands = parser.add_subparsers(dest="command", metavar="{download,convert,info}", required=True)

    default_dir = _download.download_dir()
    p = commands.add_parser(
        "download", help="fetch MNIST or CIFAR-10, check SHA-256, convert to D/NAME.h5",
        description="Fetch the canonical files of MNIST (four idx .gz files) or CIFAR-10 "
                    "(cifar-10-python.tar.gz), check each against its published SHA-256, and "
                    "convert them to D/NAME.h5. An interrupted download leaves FILE.part, "
                    "which the next run resumes with an HTTP Range request.")
    p.add_argument("name", choices=sorted(_download.REMOTES), help="data set")
    p.add_argument("--dir", default=None, metavar="D",
                   help=f"output folder; raw files go to D/raw/NAME (default: $RINGNET_DATA or {default_dir})")
    p.add_argument("--mirror", metavar="URL", help="base URL to fetch the files from instead of the "
                                                   "built-in mirror list")
    p.add_argument("--keep-raw", action="store_true", help="keep the downloaded files after conversion")
    p.add_argument("--force", action="store_true", help="download and convert even if D/NAME.h5 exists")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="seconds without data before a connection counts as failed (default 30)")

    p = commands.add_parser("convert", help="convert files on disk (mnist, cifar10, imagefolder)",
                            description="Convert data set files already on disk to the ringnet layout. "
                                        "The output is written to a temporary file and renamed on "
                                        "success, so a failure leaves no output behind.")
    formats = p.add_subparsers(dest="format", metavar="{mnist,cifar10,imagefolder}", required=True)
    for name, help_text, description, (src, src_help), out, options in _CONVERTERS:
        q = formats.add_parser(name, help=help_text, description=description)
        q.add_argument("src", metavar=src, help=src_help)
        for flag, settings in options:
            q.add_argument(flag, **settings)
        q.add_argument("--out", metavar="F.h5", help=f"output file (default: {default_dir}/{out}.h5)")

    p = commands.add_parser("info", help="counts, shape, classes and SHA-256 of a data set file",
                            description="Validate F.h5 (layout, integer labels within the classes) and "
                                        "print per-split and per-class counts, the image shape, the "
                                        "classes and the file's SHA-256. --verify also reads every "
                                        "image chunk.")
    p.add_argument("file", metavar="F.h5")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.add_argument("--verify", action="store_true",
                   help="also read every image chunk (finds a corrupt file before training does)")
    return parser


def main(argv=None):
    """Entry point of ``python -m ringnet.data`` (alias ``python -m ringnet.datasets``)."""
    args = _build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "download":
        try:
            _download.download(args.name, args.dir, mirror=args.mirror, keep_raw=args.keep_raw,
                               force=args.force, timeout=args.timeout, log=print)
        except _download.Unreachable as exc:
            if exc.source is None:
                raise
            raise UsageError(f"{exc}; download it elsewhere and run `python -m ringnet.datasets "
                             f"convert {args.name} {exc.source} --out {exc.out}`") from None
    elif args.command == "convert":
        if args.format == "imagefolder":
            default_name = args.name or os.path.basename(os.path.abspath(args.src))
        else:
            default_name = getattr(args, "name", None) or args.format
        out = args.out or os.fspath(_download.download_dir() / f"{default_name}.h5")
        # before reading anything: the output can be written whole and is not the source
        check_output("--out", out, f"{default_name}.h5")
        check_distinct([("src", f"{args.format} source {args.src}", "source", "input", args.src),
                        ("--out", f"--out {out}", "output", "output", out)])
        if args.format == "mnist":
            _convert.convert_mnist(args.src, out, name=args.name)
        elif args.format == "cifar10":
            _convert.convert_cifar10(args.src, out)
        else:
            if args.size < 1:       # the library says the same in its words; here, the flags'
                raise UsageError(f"--size must be positive, got {args.size}")
            if not 0 <= args.test_fraction < 1:
                raise UsageError(f"--test-fraction must be in [0, 1), got {args.test_fraction}")
            _convert.convert_imagefolder(args.src, out, size=args.size, test_fraction=args.test_fraction,
                                         seed=args.seed, name=args.name)
        print(f"wrote {out}")
    else:
        summary = info(args.file, verify=args.verify)
        if args.json:
            print(json.dumps(summary, sort_keys=True))
        else:
            _print_info(summary)
    return 0


if __name__ == "__main__":
    run_main(main)
