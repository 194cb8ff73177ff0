"""PoolingModelRunner: an embedding model's forward passes on one device.

An encoder (BERT and kin) keeps no KV cache: each input is one bidirectional forward pass
over its whole token sequence. A batch of inputs is right-padded to its longest one and
masked; the pooler turns each input's token states into one vector
(``model/layers/pooler.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.model.attention.selector import get_attn_backend
from tokenmill.model.layers.pooler import Pooler
from tokenmill.model.loader.model_loader import get_model


class PoolingModelRunner:
    """Loads an embedding model on its device and pools padded batches of inputs.

    Args:
        config: the resolved configuration of an embedding model
            (``model_config.pooler_config`` set).

    Raises:
        ValueError: the model is not an embedding model.
        ModelLoadError: the model's files cannot be read.
    """

    def __init__(self, config: EngineConfig) -> None:
        mc = config.model_config
        if mc.pooler_config is None:
            raise ValueError(f"{mc.model} ({mc.architecture}) is not an embedding model")
        self.config = config
        self.hidden_size = mc.hf_config.hidden_size
        self._init_device()
        backend = get_attn_backend(self.device.type)
        self.model = get_model(
            mc, config.load_config, self.device, backend, config.kernel_config
        )
        self.pooler = Pooler(mc.pooler_config)

    def _init_device(self) -> None:
        if self.config.device_config.device == "cuda":
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            threads = envs.cpu_threads()
            if threads:
                torch.set_num_threads(threads)
        torch.manual_seed(self.config.model_config.seed)

    @torch.inference_mode()
    def pool(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Pooled, not yet normalized embeddings of one batch of validated inputs.

        Returns:
            ``[N, H]`` float32 on the CPU, row ``i`` for ``token_ids[i]``.
        """
        longest = max(len(t) for t in token_ids)
        input_ids = torch.zeros(len(token_ids), longest, dtype=torch.long)
        mask = torch.zeros(len(token_ids), longest, dtype=torch.bool)
        for j, row in enumerate(token_ids):
            input_ids[j, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[j, : len(row)] = True
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids, mask)
        return self.pooler(hidden, mask).cpu()
