"""Executor: runs the worker(s) of an engine — in this process, or one process per device."""

from __future__ import annotations

import abc

from tokenmill.config import EngineConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.scheduler_output import GrammarOutput, SchedulerOutput


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

    def execute_model_async(self, scheduler_output: SchedulerOutput):
        """Launch a step without waiting for its tokens; the returned handle's ``get()``
        gives the ModelRunnerOutput (async scheduling)."""
        raise NotImplementedError(f"{type(self).__name__} does not run steps asynchronously")

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release workers and devices."""
