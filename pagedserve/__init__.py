"""pagedserve: a small, readable LLM inference and serving engine.

``from pagedserve import LLM, SamplingParams`` mirrors vLLM's offline API. The heavy names are
imported on first use, so ``import pagedserve`` (and the CLI's start-up) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pagedserve.entrypoints.llm",
    "BeamSearchParams": "pagedserve.beam_search",
    "SamplingParams": "pagedserve.sampling_params",
    "StructuredOutputsParams": "pagedserve.sampling_params",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "LoRARequest": "pagedserve.lora.request",
}
__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
    "BeamSearchParams", "LoRARequest", "__version__",
]

if TYPE_CHECKING:
    from pagedserve.beam_search import BeamSearchParams
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.lora.request import LoRARequest
    from pagedserve.outputs import CompletionOutput, RequestOutput
    from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
