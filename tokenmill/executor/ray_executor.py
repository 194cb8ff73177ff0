"""The Ray executor: one Ray actor per rank, on one node or several
(``--distributed-executor-backend ray``).

It joins the Ray cluster ``RAY_ADDRESS`` names (``ray start --head`` on the head node,
``ray start --address=HEAD:6379`` on the others), or starts a local one. A placement group
reserves one bundle per rank (one GPU and a CPU each on CUDA; a CPU on CPU), packed onto as
few nodes as possible, so the ranks of a tensor-parallel group share a node where they fit.
Rank 0's node hosts ``torch.distributed``'s rendezvous. A step's ``SchedulerOutput`` is put
in Ray's object store once and every actor reads it from there; each actor runs the same
``RankWorker`` as a worker process of the multiprocess executor.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tokenmill import envs
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput, merge_stage_outputs
from tokenmill.core.scheduler_output import GrammarOutput, SchedulerOutput
from tokenmill.executor.base import Executor, stage_leaders
from tokenmill.executor.multiproc import WorkerDiedError, log_layout, raise_rank_error
from tokenmill.executor.worker_proc import check_rank_method

logger = logging.getLogger(__name__)

# How long the placement group may wait for the cluster to have room (s).
PLACEMENT_TIMEOUT_S = 120.0
# Idle health checks ping the actors at most this often (s).
HEALTH_CHECK_INTERVAL_S = 2.0


class RayRankActor:
    """The body of one rank's Ray actor: a ``RankWorker`` once ``start`` has run."""

    def __init__(self) -> None:
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (for the rendezvous on rank 0)."""
        import ray

        from tokenmill.executor.multiproc import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port("0.0.0.0")

    def start(self, config: EngineConfig, rank: int, init_method: str) -> str:
        from tokenmill.executor.worker_proc import RankWorker

        logging.basicConfig(level=logging.INFO)
        # Ray makes the bundle's GPU the only one the actor sees: device 0.
        self.worker = RankWorker(config, rank, 0, init_method)
        return self.worker.layout()

    def call(self, method: str, reply: bool, *args: Any) -> Any:
        """``method(*args)`` of the rank's worker; its result if ``reply``. (Ray passes the
        value of an object-store reference given as a top-level argument.)"""
        result = getattr(self.worker, method)(*args)
        return result if reply else None

    def ping(self) -> bool:
        return True


class _StepHandle:
    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        self.executor = executor
        self.refs = refs

    def get(self) -> ModelRunnerOutput:
        results = self.executor._get(self.refs)
        return merge_stage_outputs([results[rank] for rank in self.executor.step_ranks])


class RayExecutor(Executor):
    """``tensor_parallel_size * pipeline_parallel_size`` Ray actors in one placement group.

    Raises:
        ConfigError: the cluster cannot hold the placement group, or a rank's
            configuration error.
        ModelLoadError: a rank cannot load the model.
        WorkerDiedError: an actor died or failed.
    """

    def __init__(self, config: EngineConfig) -> None:
        import ray

        super().__init__(config)
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.step_ranks = stage_leaders(pc)
        self.dead_error: str | None = None
        self._last_ping = time.monotonic()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=envs.ray_address(), logging_level=logging.WARNING)
        self.placement_group = self._place()
        try:
            self._start_actors()
        except BaseException:
            self.shutdown()
            raise

    def _place(self) -> Any:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        cuda = self.config.device_config.device == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        group = placement_group([dict(bundle)] * self.world_size, strategy="PACK")
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            raise ConfigError(
                f"the Ray cluster cannot hold {self.world_size} bundles of {bundle} (its "
                f"resources: {ray.cluster_resources()}); add nodes or use fewer ranks"
            )
        return group

    def _start_actors(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cuda = self.config.device_config.device == "cuda"
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if cuda else 0)(RayRankActor)
        self.actors = [
            actor_cls.options(  # type: ignore[attr-defined]
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                )
            ).remote()
            for rank in range(self.world_size)
        ]
        ip, port = self._get([self.actors[0].address.remote()])[0]
        init_method = f"tcp://{ip}:{port}"
        layouts = self._get(
            [a.start.remote(self.config, rank, init_method) for rank, a in enumerate(self.actors)]
        )
        log_layout(self.config, "ray", layouts)

    def _get(self, refs: list[Any]) -> list[Any]:
        """``ray.get`` of one call on every rank, its failures as the engine's errors."""
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            rank = next((i for i, r in enumerate(refs) if _failed(r)), 0)
            cause = e.cause if getattr(e, "cause", None) is not None else e
            self.dead_error = f"rank {rank} failed: {cause}"
            raise_rank_error(rank, type(cause).__name__, str(cause))
        except ray.exceptions.RayActorError as e:
            self.dead_error = f"a Ray actor of the engine died: {e}"
            raise WorkerDiedError(self.dead_error) from None
        raise AssertionError("unreachable")

    def _call(self, method: str, *args: Any, reply_all: bool = True) -> list[Any]:
        return [
            a.call.remote(method, reply_all or rank in self.step_ranks, *args)
            for rank, a in enumerate(self.actors)
        ]

    def determine_num_blocks(self) -> int:
        return min(self._get(self._call("determine_num_blocks")))

    def initialize_cache(self, num_blocks: int) -> None:
        self._get(self._call("initialize_cache", num_blocks))

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """``RankWorker.<method>(*args)`` on every actor (e.g. ``add_lora``), in rank order.

        Raises:
            NotImplementedError: a method ``RankWorker`` does not serve.
        """
        check_rank_method(type(self).__name__, method)
        return self._get(self._call(method, *args))

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output, grammar_output).get()

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> _StepHandle:
        """Submit a step to every actor (its plan put in the object store once); actors run
        calls in the order submitted, so steps may be collected later, in order."""
        import ray

        self.check_health()
        plan = ray.put(scheduler_output)
        return _StepHandle(
            self, self._call("execute_model", plan, grammar_output, reply_all=False)
        )

    def check_health(self) -> None:
        """Raises WorkerDiedError if an actor is gone (pinged every few seconds)."""
        if self.dead_error is not None:
            raise WorkerDiedError(self.dead_error)
        if time.monotonic() - self._last_ping < HEALTH_CHECK_INTERVAL_S:
            return
        self._last_ping = time.monotonic()
        self._get([a.ping.remote() for a in self.actors])

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        self.actors = []
        if getattr(self, "placement_group", None) is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def _failed(ref: Any) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ref)
    except Exception:
        return True
    return False
