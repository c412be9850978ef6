"""Build datasets/digits.h5 from scikit-learn's copy of the UCI handwritten digits.

Run once (``python datasets/make_digits.py``); the result is committed. scikit-learn
is needed only here, never at run time.

Source: E. Alpaydin and C. Kaynak, "Optical Recognition of Handwritten Digits",
UCI Machine Learning Repository, 1998, https://doi.org/10.24432/C50P49 (CC BY 4.0).
"""
import argparse
import sys
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ringnet.data.hdf5 import atomic_output, write_dataset  # noqa: E402

SOURCE = ("UCI ML Repository: Optical Recognition of Handwritten Digits "
          "(E. Alpaydin, C. Kaynak, 1998), https://doi.org/10.24432/C50P49; "
          "copy shipped with scikit-learn (sklearn.datasets.load_digits)")
LICENCE = "CC BY 4.0"
NOTE = "pixels are the original counts 0..16 (4x4 blocks of a 32x32 bitmap), kept as-is in uint8"


def stratified_split(labels, test_fraction, seed):
    """Return (train_index, test_index), sorted, with each class split in proportion."""
    rng = np.random.default_rng(seed)
    n_test_total = int(np.ceil(len(labels) * test_fraction))
    classes, counts = np.unique(labels, return_counts=True)
    # Largest-remainder allocation so the class quotas add up to the exact test size.
    quota = counts * n_test_total / len(labels)
    n_test = np.floor(quota).astype(int)
    short = n_test_total - n_test.sum()
    n_test[np.argsort(-(quota - n_test), kind="stable")[:short]] += 1
    test = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, n_test)]
    test = np.sort(np.concatenate(test))
    train = np.setdiff1d(np.arange(len(labels)), test)
    return train, test


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "digits.h5"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-fraction", type=float, default=0.2)
    args = parser.parse_args(argv)

    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("ringnet: error: make_digits.py needs scikit-learn (pip install scikit-learn); "
              "training never does", file=sys.stderr)
        return 2
    digits = load_digits()
    images = digits.images  # (1797, 8, 8) float64 holding integers 0..16
    if not np.array_equal(images, np.round(images)) or images.min() < 0 or images.max() > 16:
        print("ringnet: error: unexpected pixel values in sklearn's digits", file=sys.stderr)
        return 2
    images = images.astype(np.uint8)[:, None]  # (N, 1, 8, 8)
    labels = digits.target.astype(np.int64)
    train, test = stratified_split(labels, args.test_fraction, args.seed)

    with atomic_output(args.out, suffix=".h5.tmp") as tmp:
        write_dataset(tmp, images[train], labels[train], images[test], labels[test],
                      classes=[str(c) for c in range(10)], name="digits",
                      source=SOURCE, licence=LICENCE)
        with h5py.File(tmp, "a") as f:
            # Row numbers into load_digits(), so the file can be checked against sklearn.
            f["train"].create_dataset("source_index", data=train.astype(np.int64))
            f["test"].create_dataset("source_index", data=test.astype(np.int64))
            f.attrs["note"] = NOTE
            f.attrs["split_seed"] = args.seed
    print(f"wrote {args.out}: train {len(train)}, test {len(test)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
