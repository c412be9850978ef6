"""What exists to check ringnet, beside the library (as ``numpy.testing`` sits beside
NumPy): :mod:`ringnet.testing.recording_cupy`, the recording stand-in for CuPy that the
launch budget and the GPU path's tests run on, :mod:`ringnet.testing.nccl_standin`, the
strict host emulation of CUDA and NCCL that ``RINGNET_NCCL=standin`` selects, and
:mod:`ringnet.testing.cuda_emulation`, the NumPy emulations of the fused CUDA kernels and of
cuBLAS's gemm that a kernel launch or a planned GEMM runs on NumPy arrays."""
