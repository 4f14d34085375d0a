"""tierlm: a multi-tenant LLM inference server.

`from tierlm import LLM, SamplingParams` gives the offline engine with no server at all.

The names below load on first use (PEP 562), not with the package: `tierlm serve` then imports
torch inside its command, where a Ctrl-C in the first second ends with status 130, not with
the import's traceback, and `tierlm --help` answers without loading torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineConfig": "tierlm.config",
    "AsyncEngine": "tierlm.engine.async_engine",
    "LLM": "tierlm.engine.llm",
    "CompletionOutput": "tierlm.engine.outputs",
    "EmbeddingRequestOutput": "tierlm.engine.outputs",
    "RequestOutput": "tierlm.engine.outputs",
    "StreamDelta": "tierlm.engine.outputs",
    "LoRARequest": "tierlm.models.lora",
    "PoolingParams": "tierlm.sampling_params",
    "SamplingParams": "tierlm.sampling_params",
    "StructuredOutputsParams": "tierlm.sampling_params",
    "ThinkBlock": "tierlm.sampling_params",
    "ThinkingBudget": "tierlm.sampling_params",
}

__all__ = ["LLM", "SamplingParams", "PoolingParams", "StructuredOutputsParams", "ThinkBlock", "ThinkingBudget",
           "AsyncEngine", "EngineConfig", "RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "StreamDelta",
           "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tierlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
