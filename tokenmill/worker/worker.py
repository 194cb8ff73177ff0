"""Worker: one device — its initialisation, memory profiling and KV cache sizing."""

from __future__ import annotations

import logging

import torch

from tokenmill import envs
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.scheduler_output import GrammarOutput, SchedulerOutput
from tokenmill.lora.request import LoRARequest
from tokenmill.worker.host_memory import GiB, check_host_memory
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.parallel_compile import compile_first
from tokenmill.worker.start_up_passes import profile_run, warm_up_attention, warm_up_sampler

logger = logging.getLogger(__name__)


class Worker:
    """Drives one ModelRunner on one device.

    Start-up order: ``init_device`` -> ``load_model`` -> ``determine_num_blocks`` ->
    ``initialize_cache`` -> ``warm_up``; then ``execute_model`` once per step.
    """

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device("cpu")
        self.model_runner: ModelRunner | None = None
        # Device memory in use when this worker started (CUDA context, other processes):
        # --gpu-memory-utilization bounds what this engine adds on top, as in vLLM.
        self._baseline_used = 0

    def init_device(self) -> None:
        if self.config.device_config.device == "cuda":
            self.device = torch.device("cuda", self.rank)
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
            torch.cuda.synchronize(self.device)  # creates the context before the snapshot
            free, total = torch.cuda.mem_get_info(self.device)
            self._baseline_used = total - free
            wanted = self.config.cache_config.gpu_memory_utilization * total
            if self.config.cache_config.kv_cache_memory is None and free < wanted:
                raise ConfigError(
                    f"only {free / GiB:.2f} GiB of the device's {total / GiB:.2f} GiB are free, "
                    f"less than --gpu-memory-utilization "
                    f"{self.config.cache_config.gpu_memory_utilization} asks for "
                    f"({wanted / GiB:.2f} GiB); lower it or free the device"
                )
        else:
            self.device = torch.device("cpu")
            # Leave one core for the front end (tokenizing, HTTP) when there are several.
            threads = envs.cpu_threads()
            if threads:
                torch.set_num_threads(threads)
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit.

        ``--kv-cache-memory`` fixes the bytes. Otherwise on CUDA: the card's memory times
        ``--gpu-memory-utilization``, minus what is in use after loading the weights, minus
        the activation peak of a forward pass at the full token budget; on CPU: the CPU
        default (4 GiB).

        Raises:
            ConfigError: no memory is left for the KV cache, or the CPU's KV cache would
                not fit the memory available.
        """
        runner = self.model_runner
        assert runner is not None
        cc = self.config.cache_config
        per_block = runner.kv_cache_bytes_per_block()
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = cc.cpu_kv_cache_memory
        if self.device.type == "cpu":
            check_host_memory(budget)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"no memory left for the KV cache ({budget / GiB:.2f} GiB available, one block "
                f"needs {per_block} bytes); raise --gpu-memory-utilization or --kv-cache-memory"
            )
        return int(num_blocks)

    def _profile_cuda_budget(self) -> int:
        """KV cache bytes: ``total * utilization`` minus what loading and a forward pass add.

        What this engine adds is the device memory in use now beyond the start-up baseline
        (weights, buffers, cuBLAS/Triton workspaces) plus the activation peak of
        ``profile_run``, which excludes that pass's own scratch KV cache.
        """
        runner = self.model_runner
        assert runner is not None
        torch.cuda.synchronize()
        _, total = torch.cuda.mem_get_info(self.device)
        compile_first(self.device, lambda: profile_run(runner))
        peak = profile_run(runner)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info(self.device)
        used = total - free_after - self._baseline_used
        weights = runner.model_weight_bytes()
        budget = int(total * self.config.cache_config.gpu_memory_utilization) - used - peak
        logger.info(
            "Memory: %.2f GiB total, %.2f GiB in use before start-up; the engine added %.2f GiB "
            "(model %.2f GiB), activation peak %.2f GiB; %.2f GiB for the KV cache",
            total / GiB, self._baseline_used / GiB, used / GiB, weights / GiB, peak / GiB,
            budget / GiB,
        )
        return budget

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(num_blocks)

    def warm_up(self) -> None:
        """Compile/capture what the device needs before serving (kernel variants, CUDA
        graphs). The passes run twice where Triton compiles in parallel: first only to
        compile their kernels (``tokenmill.worker.parallel_compile``)."""
        runner = self.model_runner
        assert runner is not None
        graphs = None if self.config.enforce_eager else runner.plan_cuda_graphs()

        def passes() -> None:
            warm_up_attention(runner)
            warm_up_sampler(runner)
            if graphs is not None:
                graphs.compile_passes()

        compile_first(self.device, passes)
        warm_up_attention(runner)
        warm_up_sampler(runner)
        if graphs is not None:
            runner.capture_cuda_graphs()

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        assert self.model_runner is not None
        return self.model_runner.execute_model(scheduler_output, grammar_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput):
        """Launch a step; returns a handle whose ``get()`` gives its ModelRunnerOutput."""
        assert self.model_runner is not None
        return self.model_runner.execute_model_async(scheduler_output)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a LoRA adapter into host memory (``ModelRunner.add_lora``)."""
        assert self.model_runner is not None
        self.model_runner.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        assert self.model_runner is not None
        return self.model_runner.remove_lora(lora_int_id)
