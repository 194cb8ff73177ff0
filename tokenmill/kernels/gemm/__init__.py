"""Matrix products: the skinny GEMM of decode-sized batches and its tuned tiles, and the GEMMs
that dequantize int4 (AWQ/GPTQ/compressed-tensors) and GGUF-block weights inside the product."""
