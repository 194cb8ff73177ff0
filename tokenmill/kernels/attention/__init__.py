"""Paged-attention kernels: decode (flash-decoding splits), prompt chunks (varlen), the
shared prefix of cascade attention, the KV-cache write, and their launch tables."""
