"""Every Triton kernel of tokenmill, with its launcher and its tile/launch tables, grouped by
what it computes: ``attention/`` (paged attention and the KV-cache write), ``gemm/`` (the
skinny GEMM of decode-sized batches and the GEMMs that dequantize int4 and GGUF weights inside
the product), ``moe/`` (routed experts), ``sampling/`` (Gumbel-max draws, top-p), ``norm``,
``activation`` and ``rotary`` (element-wise fusions), ``staging`` (the step-input scatter),
and the device helpers ``pdl`` (programmatic dependent launches) and ``device`` (SM count,
launch counters). ``quant/`` holds the torch side of the weight formats: GGUF block
unpacking and dequantization, int4 repacking and torch's CPU int4 kernel.

Kernels take tensors and integers and return tensors: no ``nn.Module``, no configuration
object, no environment variable. Layers in ``tokenmill.model`` decide which kernel runs
(from ``KernelConfig``, the device and the shapes); their torch code is the CPU path and the
reference the kernels are tested against.
"""
