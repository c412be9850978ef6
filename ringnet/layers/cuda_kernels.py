"""Fused CUDA kernels of the GPU path: max/average pooling, im2col and col2im here; dropout
masks, ReLU and softmax cross-entropy in :mod:`ringnet.layers.cuda_pointwise`.

On a GPU each of these layers' generic array code is a storm of small launches (a few
ufuncs per kernel tap); here each is one kernel, compiled once per dtype and cached.
Every kernel is a *gather*: one thread per output element sums, in a fixed order, what
lands on it (a bias gradient: one thread per channel sums its column), so there are no
atomics and the results do not change from run to run.
The orders are the NumPy layers' orders (taps in row-major kernel order), so max,
argmax and dropout masks are bit-identical to the NumPy path, and the sums are too
(``--fmad=false`` keeps ``acc + a * b`` from becoming one differently rounded FMA).

Each kernel is declared once (:func:`ringnet.layers.cuda_registry.declare_kernel`): its parameter list (which also makes
the CUDA signature) and its CUDA body. Its NumPy *emulation*, with the same parameters and
the same index arithmetic for all threads at once, statement by statement (one NumPy lane
per CUDA thread; ``continue`` becomes a lane mask), is testing code: it lives in
:mod:`ringnet.testing.cuda_emulation`, registered under the kernel's name. The host
wrappers (:mod:`ringnet.layers.cuda_ops`) call :func:`launch`, which runs the CUDA kernel
for CuPy arrays and, for NumPy arrays, checks every argument against the declared C types
and runs the emulation, so the CPU tests run the wrappers and the kernels' index logic
against the NumPy layers. The layers call these wrappers only on CuPy arrays; their NumPy
paths do not use this module, and a training job never imports the emulations.
"""
# The registry, and every kernel in it once this module is imported: the element-wise ones
# (dropout masks, ReLU, the loss) are declared in their own module.
from ringnet.layers import cuda_pointwise  # noqa: F401
from ringnet.layers.cuda_registry import (KERNELS, MAX_BLOCKS, OPTIONS, THREADS,  # noqa: F401
                                          declare_kernel, launch, source)

__all__ = ["KERNELS", "declare_kernel", "source", "launch"]

# --- kernels. Arrays are C-contiguous; batch-last (C, H, W, B) for images, so the
# threads of a warp (consecutive b) read consecutive addresses for every tap.

_GEOMETRY = [("C", "int"), ("H", "int"), ("W", "int"), ("B", "int"), ("Ho", "int"),
             ("Wo", "int"), ("kh", "int"), ("kw", "int"), ("sh", "int"), ("sw", "int"),
             ("ph", "int"), ("pw", "int")]


# The strides, in elements, of a pool backward's dy over its (C, Ho, Wo, B) axes: dy may
# come in any memory order (from a Linear's dx, batch-first) without a copy to batch-last.
_DY_STRIDES = [("ds_c", "long long"), ("ds_h", "long long"), ("ds_w", "long long"),
               ("ds_b", "long long")]


declare_kernel("maxpool_fwd",
               [("x", "const T*"), ("y", "T*"), ("argmax", "unsigned char*"), ("n", "long long")]
               + _GEOMETRY + [("neg_inf", "T"), ("bias", "const T*"), ("has_bias", "int")], r"""
  FOR_EACH(idx, n) {
    int b = (int)(idx % B);
    long long rest = idx / B;
    int ox = (int)(rest % Wo);
    rest /= Wo;
    int oy = (int)(rest % Ho);
    long long c = rest / Ho;
    T m = neg_inf;
    int arg = 0;
    for (int i = 0; i < kh; ++i) {
      int r = oy * sh + i - ph;
      if (r < 0 || r >= H) continue;
      for (int j = 0; j < kw; ++j) {
        int q = ox * sw + j - pw;
        if (q < 0 || q >= W) continue;
        T v = x[((c * H + r) * W + q) * B + b];
        if (has_bias) v += bias[c];
        if (v > m) {
          m = v;
          arg = i * kw + j;
        } else if (v != v) {
          m = v;
        }
      }
    }
    y[idx] = m;
    argmax[idx] = (unsigned char)arg;
  }
""")


declare_kernel("maxpool_bwd",
               [("dy", "const T*"), ("argmax", "const unsigned char*"), ("dx", "T*"),
                ("n", "long long")] + _GEOMETRY + _DY_STRIDES, r"""
  FOR_EACH(idx, n) {
    int b = (int)(idx % B);
    long long rest = idx / B;
    int q = (int)(rest % W);
    rest /= W;
    int r = (int)(rest % H);
    long long c = rest / H;
    T acc = 0;
    for (int i = 0; i < kh; ++i) {
      int dr = r + ph - i;
      if (dr < 0 || dr % sh != 0) continue;
      int oy = dr / sh;
      if (oy >= Ho) continue;
      for (int j = 0; j < kw; ++j) {
        int dq = q + pw - j;
        if (dq < 0 || dq % sw != 0) continue;
        int ox = dq / sw;
        if (ox >= Wo) continue;
        long long o = ((c * Ho + oy) * Wo + ox) * B + b;
        if (argmax[o] == i * kw + j) acc += dy[c * ds_c + oy * ds_h + ox * ds_w + b * ds_b];
      }
    }
    dx[idx] = acc;
  }
""")


declare_kernel("avgpool_fwd",
               [("x", "const T*"), ("inv", "const T*"), ("y", "T*"), ("n", "long long")]
               + _GEOMETRY, r"""
  FOR_EACH(idx, n) {
    int b = (int)(idx % B);
    long long rest = idx / B;
    int ox = (int)(rest % Wo);
    rest /= Wo;
    int oy = (int)(rest % Ho);
    long long c = rest / Ho;
    T acc = 0;
    for (int i = 0; i < kh; ++i) {
      int r = oy * sh + i - ph;
      if (r < 0 || r >= H) continue;
      for (int j = 0; j < kw; ++j) {
        int q = ox * sw + j - pw;
        if (q < 0 || q >= W) continue;
        acc += x[((c * H + r) * W + q) * B + b];
      }
    }
    y[idx] = acc * inv[oy * Wo + ox];
  }
""")


declare_kernel("avgpool_bwd",
               [("dy", "const T*"), ("inv", "const T*"), ("dx", "T*"), ("n", "long long")]
               + _GEOMETRY + _DY_STRIDES, r"""
  FOR_EACH(idx, n) {
    int b = (int)(idx % B);
    long long rest = idx / B;
    int q = (int)(rest % W);
    rest /= W;
    int r = (int)(rest % H);
    long long c = rest / H;
    T acc = 0;
    for (int i = 0; i < kh; ++i) {
      int dr = r + ph - i;
      if (dr < 0 || dr % sh != 0) continue;
      int oy = dr / sh;
      if (oy >= Ho) continue;
      for (int j = 0; j < kw; ++j) {
        int dq = q + pw - j;
        if (dq < 0 || dq % sw != 0) continue;
        int ox = dq / sw;
        if (ox >= Wo) continue;
        acc += dy[c * ds_c + oy * ds_h + ox * ds_w + b * ds_b] * inv[oy * Wo + ox];
      }
    }
    dx[idx] = acc;
  }
""")


declare_kernel("col2im",
               [("cols", "const T*"), ("dx", "T*"), ("n", "long long")] + _GEOMETRY, r"""
  FOR_EACH(idx, n) {
    int b = (int)(idx % B);
    long long rest = idx / B;
    int q = (int)(rest % W);
    rest /= W;
    int r = (int)(rest % H);
    long long c = rest / H;
    T acc = 0;
    for (int i = 0; i < kh; ++i) {
      int dr = r + ph - i;
      if (dr < 0 || dr % sh != 0) continue;
      int oy = dr / sh;
      if (oy >= Ho) continue;
      for (int j = 0; j < kw; ++j) {
        int dq = q + pw - j;
        if (dq < 0 || dq % sw != 0) continue;
        int ox = dq / sw;
        if (ox >= Wo) continue;
        acc += cols[((((c * kh + i) * kw + j) * Ho + oy) * Wo + ox) * B + b];
      }
    }
    dx[idx] = acc;
  }
""")


declare_kernel("im2col",
               [("x", "const T*"), ("cols", "T*"), ("n", "long long")] + _GEOMETRY
               + [("xs_c", "long long"), ("xs_h", "long long"), ("xs_w", "long long"),
                 ("xs_b", "long long")], r"""
  FOR_EACH(idx, n) {
    int b = (int)(idx % B);
    long long rest = idx / B;
    int ox = (int)(rest % Wo);
    rest /= Wo;
    int oy = (int)(rest % Ho);
    rest /= Ho;
    int j = (int)(rest % kw);
    rest /= kw;
    int i = (int)(rest % kh);
    long long c = rest / kh;
    int r = oy * sh + i - ph;
    int q = ox * sw + j - pw;
    T v = 0;
    if (r >= 0 && r < H && q >= 0 && q < W) v = x[c * xs_c + r * xs_h + q * xs_w + b * xs_b];
    cols[idx] = v;
  }
""")
