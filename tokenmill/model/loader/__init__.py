"""Model loading: weight files (safetensors, GGUF, dummy) and the model builder."""
