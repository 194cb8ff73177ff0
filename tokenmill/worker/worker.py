"""Worker: one device — its initialisation, memory profiling and KV cache sizing."""

from __future__ import annotations

import logging
import os
import shutil

import torch

from tokenmill import envs
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.scheduler_output import GrammarOutput, SchedulerOutput
from tokenmill.hf_config import ModelLoadError
from tokenmill.lora.request import LoRARequest
from tokenmill.worker.host_memory import GiB, check_host_memory
from tokenmill.worker.kv_offload import KVOffloadStore
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.parallel_compile import compile_first
from tokenmill.worker.sleep_mode import SleepMode
from tokenmill.worker.start_up_passes import (
    profile_run,
    warm_up_attention,
    warm_up_multimodal,
    warm_up_sampler,
)

logger = logging.getLogger(__name__)


class Worker:
    """Drives one ModelRunner on one device.

    Start-up order: ``init_device`` -> ``load_model`` -> ``determine_num_blocks`` ->
    ``initialize_cache`` -> ``warm_up``; then ``execute_model`` once per step.
    """

    def __init__(self, config: EngineConfig, rank: int | None = None) -> None:
        """
        Args:
            config: the engine configuration.
            rank: the CUDA device index this worker uses; default: the first device of its
                data-parallel engine core (``data_parallel_rank * world_size``).
        """
        self.config = config
        pc = config.parallel_config
        self.rank = pc.data_parallel_rank * pc.world_size if rank is None else rank
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
            # The ranks of every engine core on this machine share the usable cores.
            threads = envs.cpu_threads()
            if threads:
                torch.set_num_threads(max(1, threads // self._processes_per_machine()))
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner = ModelRunner(self.config, self.device)

    def _processes_per_machine(self) -> int:
        """Worker processes of this engine on a CPU machine: ranks times engine cores."""
        pc = self.config.parallel_config
        return pc.world_size * pc.data_parallel_size

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit.

        ``--kv-cache-memory`` fixes the bytes. Otherwise on CUDA: the card's memory times
        ``--gpu-memory-utilization``, minus what is in use after loading the weights, minus
        the activation peak of a forward pass at the full token budget; on CPU: the CPU
        default (4 GiB). ``--num-gpu-blocks-override`` replaces the result.

        Raises:
            ConfigError: no memory is left for the KV cache, or the CPU's KV cache would
                not fit the memory available.
        """
        runner = self.model_runner
        assert runner is not None
        cc = self.config.cache_config
        per_block = runner.kv_cache_bytes_per_block()
        logger.info("KV cache per token: %s", runner.describe_kv_cache())
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            # The CPU default is the machine's: its processes share it.
            budget = cc.cpu_kv_cache_memory // self._processes_per_machine()
        override = cc.num_gpu_blocks_override
        if override is not None:
            logger.info("KV cache: %d blocks (--num-gpu-blocks-override) instead of the %d "
                        "that fit", override, budget // per_block)
            budget = override * per_block
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
        """Allocate the KV cache and, with ``--kv-offloading-size``, its offload tiers."""
        runner = self.model_runner
        assert runner is not None
        runner.initialize_kv_cache(num_blocks)
        host_slots, disk_slots = self.kv_offload_slots()
        if host_slots:
            assert runner.kv_arena is not None
            cc = self.config.cache_config
            runner.kv_offload = KVOffloadStore(
                runner.kv_arena, host_slots, cc.kv_offloading_disk_path, disk_slots
            )

    def kv_offload_slots(self) -> tuple[int, int]:
        """Blocks the host and disk offload tiers hold ((0, 0) without offloading).

        ``--kv-offloading-size`` and ``--kv-offloading-disk-size`` are the engine's, summed
        over its ranks (as vLLM's): each of the ``world_size`` ranks holds an equal share,
        its part of every block (its KV heads).

        Raises:
            ConfigError: a tier smaller than one block, a host tier larger than the
                memory available, or a disk tier larger than its file system's free space.
        """
        cc = self.config.cache_config
        if not cc.kv_offloading_bytes:
            return 0, 0
        assert self.model_runner is not None
        per_block = self.model_runner.kv_cache_bytes_per_block()
        ranks = self.config.parallel_config.world_size
        host = cc.kv_offloading_bytes // ranks // per_block
        disk = cc.kv_offloading_disk_bytes // ranks // per_block
        if host < 1 or (cc.kv_offloading_disk_path and disk < 1):
            raise ConfigError(
                f"--kv-offloading-size / --kv-offloading-disk-size must hold at least one KV "
                f"block ({per_block} bytes)"
            )
        check_host_memory(host * per_block)
        if cc.kv_offloading_disk_path and disk:
            _check_disk_space(cc.kv_offloading_disk_path, disk * per_block)
        return int(host), int(disk)

    def take_kv_offload_stats(self) -> dict[str, float]:
        """Bytes moved and seconds spent by the offload tiers since the last call."""
        store = self.model_runner.kv_offload if self.model_runner is not None else None
        return store.take_stats() if store is not None else {}

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
        warm_up_multimodal(runner)
        if graphs is not None:
            runner.capture_cuda_graphs()

    # ---- sleep mode and weight updates ---------------------------------------------------

    def _sleep_mode(self) -> SleepMode:
        assert self.model_runner is not None
        if self.model_runner.sleep_mode is None:
            raise ValueError("sleep mode is off: start the engine with --enable-sleep-mode")
        return self.model_runner.sleep_mode

    def sleep(self, level: int = 1) -> None:
        """Free the weights (level 1: kept on the host; level 2: dropped) and the KV cache."""
        self._sleep_mode().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or the KV cache (``None``: both)."""
        self._sleep_mode().wake_up(tags)

    def is_sleeping(self) -> bool:
        mode = self.model_runner.sleep_mode if self.model_runner is not None else None
        return mode is not None and mode.is_sleeping

    def check_weights(self, path: str) -> None:
        """Check that ``path`` fits this worker's share of the model as ``update_weights``
        would load it, writing nothing.

        Raises:
            ValueError: the weights are asleep (wake them first).
            ModelLoadError: the checkpoint cannot be read or does not fit the model.
        """
        self._weights_runner(path).check_weights(path)

    def update_weights(self, path: str) -> None:
        """Load new weights in place from ``path`` (safetensors folder or file, or GGUF),
        after ``check_weights`` passed on every worker (``Executor.check_weights``, which
        ``EngineCore.update_weights`` runs first), so the check is not run again here.

        Raises:
            ValueError: the weights are asleep (wake them first).
            ModelLoadError: the checkpoint cannot be read or does not fit the model.
        """
        self._weights_runner(path).reload_weights(path, checked=True)

    def _weights_runner(self, path: str) -> ModelRunner:
        """The model runner, once ``path`` exists and the weights are awake (raises as
        ``update_weights``)."""
        assert self.model_runner is not None
        if not os.path.exists(path):
            raise ModelLoadError(f"{path}: no such file or directory")
        mode = self.model_runner.sleep_mode
        if mode is not None and "weights" in mode.asleep:
            raise ValueError(
                "the weights are asleep: wake them first (wake_up with tags=['weights'])"
            )
        return self.model_runner

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the weights and the KV cache hold on the device now."""
        runner = self.model_runner
        assert runner is not None
        if runner.sleep_mode is not None:
            return runner.sleep_mode.memory_bytes()
        kv = runner.kv_arena
        return {
            "weights": runner.model_weight_bytes(),
            "kv_cache": 0 if kv is None else kv.numel() * kv.element_size(),
        }

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


def _check_disk_space(path: str, num_bytes: int) -> None:
    """Raise ConfigError unless the file system holding ``path`` (or its nearest existing
    parent) has ``num_bytes`` free: the disk tier's file is sparse, so a full disk would
    otherwise surface as a failed write in the middle of serving."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free
    if num_bytes > free:
        raise ConfigError(
            f"--kv-offloading-disk-size: {num_bytes / GiB:.2f} GiB do not fit the "
            f"{free / GiB:.2f} GiB free under {path}"
        )
