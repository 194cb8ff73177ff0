"""Matrix products: the skinny GEMM of decode-sized batches and its tuned tiles."""
