"""Native CPU kernels (C++ in ``csrc/``, built on first use by ``native.native_ops``): the
products of float activations with weights in blocks of 32 integers (``block_gemm``), for
the quantized layers, and paged decode attention straight from the KV cache blocks."""
