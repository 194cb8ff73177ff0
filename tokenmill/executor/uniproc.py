"""One worker in the engine core's own process (one device, or CPU)."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.scheduler_output import GrammarOutput, SchedulerOutput
from tokenmill.executor.base import Executor
from tokenmill.lora.request import LoRARequest
from tokenmill.worker.worker import Worker


class UniProcExecutor(Executor):
    """Runs a single Worker in-process."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)
        self.worker.warm_up()

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output, grammar_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput):
        return self.worker.execute_model_async(scheduler_output)

    def add_lora(self, lora_request: LoRARequest) -> None:
        self.worker.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.worker.remove_lora(lora_int_id)
