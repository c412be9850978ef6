"""Synthetic image classification data: class patterns plus noise, reproducible from a seed."""
import numpy as np

__all__ = ["make_synthetic"]


def make_synthetic(input_shape, num_classes, n_train=2048, n_test=512, seed=0,
                   signal=0.6):
    """Return (train_images, train_labels, test_images, test_labels) as uint8 NCHW / int64.

    Every class has a fixed random prototype image; a sample is
    ``signal * prototype + (1 - signal) * uniform noise`` in 0..255, so the data
    is learnable yet not trivially separable pixel by pixel. Labels are balanced
    and shuffled. Same arguments, same arrays.
    """
    c, h, w = (int(v) for v in input_shape)
    if min(c, h, w) < 1 or num_classes < 1 or n_train < 0 or n_test < 0:
        raise ValueError(f"bad synthetic data set: shape {input_shape}, "
                         f"{num_classes} classes, {n_train}/{n_test} images")
    if not 0.0 <= signal <= 1.0:
        raise ValueError(f"signal must be in [0, 1], got {signal}")
    rng = np.random.default_rng([int(seed), 0x5157])
    prototypes = rng.random((num_classes, c, h, w), dtype=np.float32) * 255.0

    def draw(n):
        labels = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
        images = rng.random((n, c, h, w), dtype=np.float32)
        images *= (1.0 - signal) * 255.0
        images += signal * prototypes[labels]
        return np.rint(images, out=images).astype(np.uint8), labels

    train_images, train_labels = draw(n_train)
    test_images, test_labels = draw(n_test)
    return train_images, train_labels, test_images, test_labels
