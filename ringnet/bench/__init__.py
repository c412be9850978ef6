"""Benchmarks: ``python -m ringnet.bench layers|comm|scaling|model|faults|elastic|delay|curves``."""
import statistics

__all__ = ["paired_quartiles"]


def paired_quartiles(ours, theirs):
    """Return the lower and upper quartile of the ratios ours[i] / theirs[i].

    Benchmarks that time two things alternately pair each sample with its partner: a slow
    moment of the machine slows both and leaves their ratio, so these quartiles say how far
    the ratio itself moves, which the two medians' spreads would overstate. (Plain Python:
    this package is imported before ``bench layers`` pins NumPy's BLAS threads.)
    """
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    if len(ratios) < 2:
        return [ratios[0], ratios[0]]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return [q1, q3]
