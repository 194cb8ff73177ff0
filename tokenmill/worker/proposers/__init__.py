"""Speculative proposers that run layers with a KV cache of their own, on the runner's
staged buffers and CUDA graphs (the ``Proposer`` seam is ``tokenmill.spec_decode.proposer``):

- ``model_proposer.py``: what they share: the draft KV cache, the first pass over the
  verified tokens, then ``k - 1`` single-token passes (``draft_passes.py``: one staged upload
  per step, the passes on the device, CUDA graphs of them);
- ``draft_model.py``: a smaller model sharing the target's tokenizer;
- ``eagle.py``: EAGLE / EAGLE-3 heads, and MTP layers of the target.
"""
