"""Model loading: configs, weight files (safetensors, GGUF, dummy) and the model builder."""
