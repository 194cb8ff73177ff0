"""tokenmill: a high-throughput LLM inference and serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from tokenmill.version import __version__

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; importing it lazily keeps `import tokenmill` light.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
