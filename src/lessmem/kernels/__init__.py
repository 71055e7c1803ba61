"""Fused compute on quantized data (dequant-matmul, dequant-attention).

Each kernel has a test oracle, ``*_reference.py`` (slow, float64, obviously correct; only
tests import it), and fast paths per device: native CPU kernels (``*_cpp.py``) and, where
needed, a production torch fallback (``*_torch.py``: ``linear_torch``, ``gguf_linear_torch``,
``attention_torch``) that computes the same thing with vectorized torch ops on any device.
The native CPU kernels are small C++ sources compiled on first use (``_build.load_cpp``)
and cached under ``$LESSMEM_CACHE/kernels``; CUDA backends are Triton (``*_triton.py``).
Callers reach them through torch ops (``ops.py``: attention; ``linear_ops.py``: the
dequant-matmuls), whose dispatcher picks the backend by device; without a compiler, or on a
device without a backend, the torch fallback runs after one warning.
"""
