"""SoftmaxCrossEntropy: mean cross-entropy of softmax(logits), via log-sum-exp."""
from ringnet.backend import get_array_module

__all__ = ["SoftmaxCrossEntropy"]


class SoftmaxCrossEntropy:
    """loss = mean_b (logsumexp(z_b) - z_b[label_b])."""

    def __init__(self):
        self._cache = None

    def forward(self, logits, labels):
        """Return the mean loss over the batch as a 0-d array; cache softmax for backward."""
        xp = get_array_module(logits)
        b, k = logits.shape                                      # (B, K)
        labels = xp.asarray(labels).astype(xp.int64, copy=False).reshape(-1)
        if labels.shape[0] != b:
            raise ValueError(f"{labels.shape[0]} labels for a batch of {b}")
        shifted = logits - logits.max(axis=1, keepdims=True)     # <= 0: exp cannot overflow
        exp = xp.exp(shifted)
        total = exp.sum(axis=1)                                  # (B,)
        picked = xp.take_along_axis(shifted, labels[:, None], axis=1)[:, 0]
        loss = (xp.log(total) - picked).mean()
        exp /= total[:, None]                                    # softmax, (B, K)
        self._cache = (exp, labels)
        return loss

    def backward(self):
        """Return dlogits = (softmax - onehot(labels)) / B."""
        # d/dz_j [logsumexp(z) - z_y] = softmax_j - [j == y]; the batch mean divides by B.
        if self._cache is None:
            raise RuntimeError("SoftmaxCrossEntropy.backward called before forward")
        xp = get_array_module(self._cache[0])
        probs, labels = self._cache
        b = probs.shape[0]
        grad = probs.copy()
        grad[xp.arange(b), labels] -= 1
        grad *= grad.dtype.type(1.0 / b)
        return grad
