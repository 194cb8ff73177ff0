"""Writing GGUF files as llama.cpp's converter does, for the GGUF loader's tests."""

from __future__ import annotations

from typing import Any


def decoder_writer(
    path: str, arch: str, config: Any, head_count_kv: int | None = None,
    feed_forward_length: int | None = None,
) -> Any:  # fmt: skip
    """A ``gguf.GGUFWriter`` of architecture ``arch`` holding the metadata every llama.cpp
    decoder file has, from a transformers ``config``: layers, context, widths, heads (KV
    heads ``head_count_kv`` where the converter stores another count than the config's),
    RMSNorm epsilon, RoPE base and vocabulary size. ``feed_forward_length``: where the
    converter stores another MLP size than ``intermediate_size``."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(
        config.intermediate_size if feed_forward_length is None else feed_forward_length
    )
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(
        config.num_key_value_heads if head_count_kv is None else head_count_kv
    )
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 1e4))))
    writer.add_vocab_size(config.vocab_size)
    return writer


def finish(writer: Any) -> None:
    """Write ``writer``'s header, metadata and tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
