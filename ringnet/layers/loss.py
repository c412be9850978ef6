"""SoftmaxCrossEntropy: mean cross-entropy of softmax(logits), via log-sum-exp."""
from ringnet.backend import get_array_module, is_gpu_array
from ringnet.layers import cuda_ops

__all__ = ["SoftmaxCrossEntropy"]


class SoftmaxCrossEntropy:
    """loss = mean_b (logsumexp(z_b) - z_b[label_b]).

    On a GPU one fused kernel computes the loss, the gradient and the count of rows whose
    first maximum is at the label (``correct``, a 0-d device int64, None on the CPU), all
    left on the device: reading them is the caller's choice.
    """

    def __init__(self):
        self._cache = None
        self.correct = None

    def forward(self, logits, labels, bias=None, dbias=None):
        """Return the mean loss over the batch as a 0-d array; cache softmax for backward.

        On a GPU the model may hand the kernel the last layer's ``bias`` (the logits are
        ``logits + bias``) and its bias gradient ``dbias``, written here with dlogits."""
        xp = get_array_module(logits)
        b, k = logits.shape                                      # (B, K)
        labels = xp.asarray(labels).astype(xp.int64, copy=False).reshape(-1)
        if labels.shape[0] != b:
            raise ValueError(f"{labels.shape[0]} labels for a batch of {b}")
        if is_gpu_array(logits):
            loss, self.correct, grad = cuda_ops.softmax_cross_entropy(xp, logits, labels,
                                                                      bias, dbias)
            self._cache = (grad, None)
            return loss
        if bias is not None or dbias is not None:
            raise ValueError("SoftmaxCrossEntropy: bias / dbias are for the GPU path "
                             "(fused CUDA kernels)")
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
        probs, labels = self._cache
        if labels is None:                  # the fused kernel wrote it in the forward
            return probs
        xp = get_array_module(probs)
        b = probs.shape[0]
        grad = probs.copy()
        grad[xp.arange(b), labels] -= 1
        grad *= grad.dtype.type(1.0 / b)
        return grad
