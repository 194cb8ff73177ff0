"""Sampling kernels: the Gumbel-max draw and the top-p cut-off by radix select."""
