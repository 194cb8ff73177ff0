"""Multi-LoRA serving: many low-rank adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of
Large Language Models") on one base model, different adapters on different rows of one batch.

- ``request.py``: ``LoRARequest``, what a request names (vLLM's class and fields);
- ``config.py``: ``LoRAConfig`` and the ``--enable-lora`` family of flags;
- ``peft.py``: reading and checking PEFT adapter folders;
- ``layers.py``: the LoRA wrappers of a linear layer (per-slot A/B stacks), one per
  tensor-parallel split (``--fully-sharded-loras`` shards the adapters further);
- ``manager.py``: the worker's slots on the device and its host LRU of loaded adapters.

The batched products themselves are kernels (``tokenmill/kernels/lora``).
"""
