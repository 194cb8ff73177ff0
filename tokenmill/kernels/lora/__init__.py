"""Batched LoRA products: each row of a batch gets its own adapter's ``B (A x)`` in one
launch (``sgmv.py``)."""
