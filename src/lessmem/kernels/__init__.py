"""Fused compute on quantized data (dequant-matmul, dequant-attention).

Each kernel has a test oracle, ``*_reference.py`` (slow, float64, obviously correct; only
tests import it), and fast paths per device: native CPU kernels (``*_cpp.py``) and, where
needed, a production torch fallback (``*_torch.py``: ``linear_torch``, ``gguf_linear_torch``,
``attention_torch``) that computes the same thing with vectorized torch ops on any device.
The native CPU kernels are small C++ sources compiled on first use (``_build.load_cpp``)
and cached under ``$LESSMEM_CACHE/kernels``; when no compiler is available, or the tensors
are not on the CPU, the torch fallback runs (without a compiler a warning says so once).
"""
