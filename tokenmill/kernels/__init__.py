"""Kernels: Triton kernels and CPU kernel wrappers, by what they compute; tensors in and out."""
