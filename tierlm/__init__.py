"""tierlm: a multi-tenant LLM inference server.

`from tierlm import LLM, SamplingParams` gives the offline engine with no server at all.
"""
from tierlm.config import EngineConfig
from tierlm.engine.async_engine import AsyncEngine
from tierlm.engine.llm import LLM
from tierlm.engine.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput, StreamDelta
from tierlm.models.lora import LoRARequest
from tierlm.sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams, ThinkBlock, ThinkingBudget

__all__ = ["LLM", "SamplingParams", "PoolingParams", "StructuredOutputsParams", "ThinkBlock", "ThinkingBudget",
           "AsyncEngine", "EngineConfig", "RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "StreamDelta",
           "LoRARequest"]
__version__ = "0.1.0"
