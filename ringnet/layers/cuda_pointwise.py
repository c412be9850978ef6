"""The element-wise fused CUDA kernels of the GPU path: dropout masks, ReLU (with the bias
of the layer before, and its gradient), softmax cross-entropy (with the last layer's bias
and its gradient). Declared as :mod:`ringnet.layers.cuda_kernels`'s kernels are (parameter
list and CUDA body) in the same registry (:mod:`ringnet.layers.cuda_registry`); their NumPy
emulations are testing code, in :mod:`ringnet.testing.cuda_emulation`."""
from ringnet.layers.cuda_registry import declare_kernel


declare_kernel("dropout_mask",
               [("mask", "T*"), ("n", "long long"), ("first", "unsigned long long"),
                ("keys", "const unsigned long long*"), ("threshold", "unsigned long long"),
                ("scale", "T")], r"""
  FOR_EACH(idx, n) {
    unsigned long long v = (first + (unsigned long long)idx) * 0x9E3779B97F4A7C15ULL + keys[0];
    v = mix64(v);
    v ^= keys[1];
    v = mix64(v);
    mask[idx] = (v >> 11) >= threshold ? scale : (T)0;
  }
""")


# ReLU, elementwise over dense memory (both operands in one memory order). The forward
# is NumPy's maximum(x, 0) exactly (x where x > 0 or x is NaN, else +0: NaN passes
# through, -0 becomes +0); the backward is NumPy's multiply(dy, y > 0): dy times 1 or 0 (NaN * 0 stays
# NaN, -dy * 0 is -0), not a select. With ``has_bias`` the forward is max(x + bias, 0), the
# bias of the layer before (its channel: memory is (outer, C, inner) around the channel
# axis), so that layer skips its own pass adding it.
declare_kernel("relu_fwd", [("x", "const T*"), ("y", "T*"), ("n", "long long"), ("bias", "const T*"),
                     ("inner", "long long"), ("C", "int"), ("has_bias", "int")], r"""
  FOR_EACH(idx, n) {
    T v = x[idx];
    if (has_bias) v += bias[(idx / inner) % C];
    y[idx] = (v > (T)0 || v != v) ? v : (T)0;
  }
""")


declare_kernel("relu_bwd", [("dy", "const T*"), ("y", "const T*"), ("dx", "T*"), ("n", "long long")],
               r"""
  FOR_EACH(idx, n) {
    dx[idx] = dy[idx] * (T)(y[idx] > (T)0);
  }
""")


# The same backward with the bias gradient of the layer before (its forward bias the
# forward above added): one thread per channel c of (outer, C, inner) memory, which writes
# the channel's dx and adds it up in memory order into dbias[c]. Meant for a Linear's
# (B, K) output (outer B, inner 1), where consecutive threads read consecutive columns.
declare_kernel("relu_bwd_bias",
               [("dy", "const T*"), ("y", "const T*"), ("dx", "T*"), ("dbias", "T*"), ("n", "long long"),
                ("outer", "long long"), ("inner", "long long")], r"""
  FOR_EACH(c, n) {
    T acc = 0;
    for (long long o = 0; o < outer; ++o) {
      for (long long t = 0; t < inner; ++t) {
        long long idx = (o * n + c) * inner + t;
        T g = dy[idx] * (T)(y[idx] > (T)0);
        dx[idx] = g;
        acc += g;
      }
    }
    dbias[c] = acc;
  }
""")


# Softmax cross-entropy, its gradient and the correct count in two launches and no host
# read: one thread per sample row (its logits, plus the last layer's bias when
# ``has_bias``, so that layer skips its own pass adding it; their max and first argmax as
# NumPy's max and argmax: a NaN wins, ties go to the first class; log-sum-exp; the loss
# of the row; the gradient row (softmax - onehot) * scale, scale = 1/B), then a kernel
# whose thread 0 adds the rows' losses and hits in sample order (no atomics: the same
# sums every run) into two device scalars, and, with ``has_dbias``, whose thread k adds
# column k of the gradient in sample order: the last layer's bias gradient.
declare_kernel("xent_rows",
               [("logits", "const T*"), ("labels", "const long long*"), ("grad", "T*"),
                ("row_loss", "T*"), ("hit", "unsigned char*"), ("n", "long long"), ("K", "int"),
                ("scale", "T"), ("invalid", "T"), ("bias", "const T*"), ("has_bias", "int")], r"""
  FOR_EACH(b, n) {
    long long row = b * K;
    for (int j = 0; j < K; ++j) {
      T z = logits[row + j];
      if (has_bias) z += bias[j];
      grad[row + j] = z;
    }
    T m = grad[row];
    int arg = 0;
    for (int j = 1; j < K; ++j) {
      T v = grad[row + j];
      if (v > m || (v != v && m == m)) {
        m = v;
        arg = j;
      }
    }
    long long y = labels[b];
    T picked = invalid;
    if (y >= 0 && y < K) {
      picked = grad[row + y] - m;
    }
    T total = 0;
    for (int j = 0; j < K; ++j) {
      T e = exp(grad[row + j] - m);
      grad[row + j] = e;
      total += e;
    }
    row_loss[b] = log(total) - picked;
    hit[b] = (unsigned char)(arg == y);
    for (int j = 0; j < K; ++j) {
      T g = grad[row + j] / total;
      if (j == y) {
        g -= (T)1;
      }
      grad[row + j] = g * scale;
    }
  }
""")


declare_kernel("xent_total",
               [("row_loss", "const T*"), ("hit", "const unsigned char*"), ("loss", "T*"),
                ("correct", "long long*"), ("n", "long long"), ("B", "int"), ("grad", "const T*"),
                ("dbias", "T*"), ("K", "int"), ("has_dbias", "int")], r"""
  FOR_EACH(idx, n) {
    if (idx == 0) {
      T acc = 0;
      long long count = 0;
      for (int b = 0; b < B; ++b) {
        acc += row_loss[b];
        count += hit[b];
      }
      loss[0] = acc / (T)B;
      correct[0] = count;
    }
    if (has_dbias) {
      T column = 0;
      for (int b = 0; b < B; ++b) {
        column += grad[b * K + idx];
      }
      dbias[idx] = column;
    }
  }
""")


# A CUDA-graph run (:mod:`ringnet.graphs`): the step's loss and correct count, which the
# replayed graph writes to the same place every step, copied into slot ``slot`` of two
# rings, so that each step's values stay until the host reads them.
declare_kernel("step_record", [("loss", "const T*"), ("correct", "const long long*"),
                        ("ring_loss", "T*"), ("ring_correct", "long long*"),
                        ("slot", "long long")], r"""
  FOR_EACH(idx, 1) {
    ring_loss[slot] = loss[0];
    ring_correct[slot] = correct[0];
  }
""")
