"""Mixture-of-experts kernels: routing and the routed experts' grouped GEMMs."""
