"""The served models: name → engine, and their start/stop as one unit.

A request's `model` field picks the engine. Names come from `--model NAME=DIR`, or the
engine's own `model_name` when a single model is served.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from tierlm.serving import tools as toolcalls
from tierlm.serving.errors import NotFound
from tierlm.serving.reasoning import ReasoningFormat, reasoning_format
from tierlm.serving.reasoning import check_parser as check_reasoning_parser

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine

logger = logging.getLogger("tierlm.serving")


class ModelRegistry:
    def __init__(self, engines: dict[str, "AsyncEngine"], tool_call_parser: str = "auto",
                 reasoning_parser: str = "auto") -> None:
        if not engines:
            raise ValueError("no models to serve; pass a model directory or --model NAME=DIR")
        if tool_call_parser != "auto" and tool_call_parser not in toolcalls.PARSERS:
            raise ValueError(f"unknown tool-call parser '{tool_call_parser}'; use auto or one of "
                             f"{', '.join(toolcalls.PARSERS)}")
        check_reasoning_parser(reasoning_parser)
        self._engines = dict(engines)
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self._tool_calls: dict[str, toolcalls.ToolCallFormat] = {}
        self._reasoning: dict[str, ReasoningFormat | None] = {}
        self.created = int(time.time())
        self.started = False

    @property
    def names(self) -> list[str]:
        return list(self._engines)

    def items(self) -> list[tuple[str, "AsyncEngine"]]:
        return list(self._engines.items())

    def get(self, name: str) -> "AsyncEngine":
        engine = self._engines.get(name)
        if engine is None:
            raise NotFound(
                f"model '{name}' is not served here; available: {', '.join(self._engines)}",
                param="model",
                code="model_not_found",
            )
        return engine

    def tool_calls(self, name: str) -> toolcalls.ToolCallFormat:
        """How model `name` writes tool calls (`--tool-call-parser`), worked out once."""
        found = self._tool_calls.get(name)
        if found is None:
            found = self._tool_calls[name] = toolcalls.tool_call_format(self.tool_call_parser,
                                                                       self.get(name).tokenizer)
        return found

    def reasoning(self, name: str) -> ReasoningFormat | None:
        """Model `name`'s think markers (`--reasoning-parser`; None: its answers are all text),
        worked out once."""
        if name not in self._reasoning:
            self._reasoning[name] = reasoning_format(self.reasoning_parser, self.get(name).tokenizer)
        return self._reasoning[name]

    async def start(self) -> None:
        for name, engine in self._engines.items():
            syntax = self.tool_calls(name).syntax.name
            how = "detected from the chat template" if self.tool_call_parser == "auto" else "--tool-call-parser"
            logger.info("model %s: tool calls parsed as %s (%s)", name, syntax, how)
            thinks = "<think> blocks" if self.reasoning(name) is not None else "none (answers are text)"
            how = "detected from the chat template" if self.reasoning_parser == "auto" else "--reasoning-parser"
            logger.info("model %s: reasoning parsed as %s (%s)", name, thinks, how)
            logger.info("starting engine for model %s", name)
            await engine.start()
        self.started = True

    async def shutdown(self) -> None:
        self.started = False
        results = await asyncio.gather(
            *(engine.shutdown() for engine in self._engines.values()), return_exceptions=True
        )
        for name, result in zip(self._engines, results):
            if isinstance(result, BaseException):
                logger.error("engine for model %s failed to shut down cleanly: %r", name, result)

    def describe(self, name: str) -> dict[str, Any]:
        """One model as both SDKs read it (OpenAI's and Anthropic's fields side by side)."""
        engine = self.get(name)
        context = int(getattr(engine, "max_model_len", 0) or 0)
        return {
            # OpenAI
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "tierlm",
            # Anthropic
            "type": "model",
            "display_name": name,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
            "lifecycle": "active",
            "max_input_tokens": context or None,
            "max_tokens": context or None,
        }
