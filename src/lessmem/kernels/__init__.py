"""Fused compute on quantized data (dequant-matmul, dequant-attention).

One reference implementation per kernel plus fast paths per device. Native CPU
kernels are small C++ sources compiled on first use (``_build.load_cpp``) and cached
under ``$LESSMEM_CACHE/kernels``; when no compiler is available the pure-torch path
is used and a warning says so.
"""
