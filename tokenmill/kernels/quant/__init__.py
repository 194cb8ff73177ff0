"""Weight quantization formats: unpacking, dequantization and CPU kernel wrappers."""
