"""A model runner's place in the pipeline (pipeline parallelism): what its forward pass
receives from the previous stage and sends to the next.

Between stages travel the hidden states and the residual of the step's tokens as one
``[T, 2H]`` tensor (``DecoderModel``). A stage other than the first reads them from a
persistent buffer bound to its model, so CUDA graphs captured over that buffer stay valid;
a stage other than the last sends its model's output (a graph's static buffer) without
copying it, and waits for that send before the next forward pass writes it again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.distributed.parallel_state import (
    is_first_pipeline_stage,
    is_last_pipeline_stage,
    receive_from_previous_stage,
    send_to_next_stage,
)


class PipelineStage:
    """Receives and sends one stage's activations around each forward pass.

    Args:
        model: the stage's model (a ``DecoderForCausalLM``).
        max_num_tokens: the most tokens a step computes (rows of the input buffer).
        hidden_size: ``H``.
        dtype, device: those of the activations.
    """

    def __init__(
        self,
        model: nn.Module,
        max_num_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.is_first = is_first_pipeline_stage()
        self.is_last = is_last_pipeline_stage()
        self._sending: Any = None  # the last send's work handle, until it completes
        self.input: torch.Tensor | None = None
        if not self.is_first:
            self.input = torch.zeros(max_num_tokens, 2 * hidden_size, dtype=dtype, device=device)
            model.model.stage_input = self.input  # type: ignore[union-attr]

    def before_forward(self, num_tokens: int) -> None:
        """Wait for the previous step's send (its buffer is about to be rewritten), then
        receive this step's input from the previous stage."""
        if self._sending is not None:
            self._sending.wait()
            self._sending = None
        if self.input is not None:
            receive_from_previous_stage(self.input[:num_tokens])

    def after_forward(self, output: torch.Tensor, num_tokens: int) -> None:
        """Start sending the first ``num_tokens`` rows of ``output`` (``[>= T, 2H]``) to the
        next stage; the last stage sends nothing."""
        if not self.is_last:
            self._sending = send_to_next_stage(output[:num_tokens])
