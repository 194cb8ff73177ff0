"""Executor: runs the worker(s) of an engine — in this process, or one process per device."""

from __future__ import annotations

import abc

from tokenmill.config import EngineConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.scheduler_output import GrammarOutput, SchedulerOutput
from tokenmill.lora.peft import LoRAAdapterError
from tokenmill.lora.request import LoRARequest


class Executor(abc.ABC):
    """The engine core's handle on its workers.

    Life cycle: ``__init__`` (loads the model), ``determine_num_blocks``,
    ``initialize_cache(num_blocks)``, then ``execute_model`` per step, ``shutdown``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks that fit on every worker (the minimum over workers)."""

    @abc.abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and warm up (CUDA graphs)."""

    @abc.abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """Run one step; returns the driver worker's output. ``grammar_output`` holds the
        step's grammar bitmasks (structured outputs), if any."""

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ):
        """Launch a step without waiting for its tokens; the returned handle's ``get()``
        gives the ModelRunnerOutput (async scheduling, pipeline micro-batches).
        ``grammar_output`` only where the workers run steps in order (pipeline stages)."""
        raise NotImplementedError(f"{type(self).__name__} does not run steps asynchronously")

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Call ``method(*args)`` on every worker (sleep, wake_up, update_weights, ...);
        returns their results in rank order (vLLM's ``collective_rpc``)."""
        raise NotImplementedError(f"{type(self).__name__} does not call its workers by name")

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a LoRA adapter into every worker's host memory (a no-op when loaded).

        Raises:
            ValueError: LoRA is off, or the adapter cannot be served (the message says why;
                a worker in this process raises it, a rank of several answers it).
        """
        errors = self.collective_rpc("add_lora", (lora_request,))
        error = next((e for e in errors if e), None)
        if error is not None:
            raise LoRAAdapterError(error)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a LoRA adapter from every worker; False when it was not loaded."""
        return all(self.collective_rpc("remove_lora", (lora_int_id,)))

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release workers and devices."""
