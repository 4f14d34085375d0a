"""The served models: name → engine, and their start/stop as one unit.

A request's `model` field picks the engine. Names come from `--model NAME=DIR`, or the
engine's own `model_name` when a single model is served. A LoRA adapter loaded on an engine
is a model of its own name too (as in vLLM): the routes get an `AdapterEngine`, the base
engine with that adapter applied to everything it runs.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from tierlm.errors import TierlmError
from tierlm.serving import tools as toolcalls
from tierlm.serving.errors import InvalidRequest, NotFound
from tierlm.serving.reasoning import ReasoningFormat, reasoning_format
from tierlm.serving.reasoning import check_parser as check_reasoning_parser

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine

logger = logging.getLogger("tierlm.serving")


class AdapterEngine:
    """A base model's engine seen through one of its LoRA adapters. Everything is the base
    engine's (tokenizer, chat template, context length, stats) except `generate`, which runs
    with the adapter: so every route that takes an engine serves an adapter unchanged."""

    def __init__(self, engine: "AsyncEngine", adapter: str, base: str) -> None:
        self._engine = engine
        self.adapter = adapter
        self.base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, **kwargs: Any):
        return self._engine.generate(*args, lora=self.adapter, **kwargs)


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
        """Every model a request may name: the base models, then each one's LoRA adapters."""
        return list(self._engines) + [a for _, a in self.adapters()]

    def adapters(self) -> list[tuple[str, str]]:
        """(base model, adapter) for every LoRA adapter loaded now."""
        return [(base, a) for base, engine in self._engines.items() for a in _loras(engine)]

    def items(self) -> list[tuple[str, "AsyncEngine"]]:
        """The base models' engines (each once, whatever adapters it serves)."""
        return list(self._engines.items())

    def names_for(self, allowed: frozenset[str] | None) -> list[str]:
        """The models a tenant may use and see, given its `models` list (`allowed`; None: every one)."""
        return [n for n in self.names if allowed is None or n in allowed]

    def get(self, name: str, allowed: frozenset[str] | None = None) -> "AsyncEngine":
        """The engine serving `name`. `allowed`: the models the asking tenant may use (None:
        every one); any other is a 404 exactly like a model not served, so a tenant learns
        nothing of the others' models (nor of their LoRA adapters)."""
        engine = self._engines.get(name) if allowed is None or name in allowed else None
        if engine is not None:
            return engine
        for base, adapter in self.adapters():
            if adapter == name and (allowed is None or name in allowed):
                return AdapterEngine(self._engines[base], adapter, base)  # type: ignore[return-value]
        raise NotFound(
            f"model '{name}' is not served here; available: {', '.join(self.names_for(allowed)) or 'none'}",
            param="model",
            code="model_not_found",
        )

    def check_adapter_name(self, name: str) -> None:
        """An adapter may not take a name a request already means something else by."""
        if name in self.names:
            raise InvalidRequest(f"model '{name}' is already served here; choose another adapter name",
                                 param="lora_name")

    def _tokenizer_owner(self, name: str) -> str:
        """The base model whose tokenizer `name` uses (an adapter's is its base's): the formats
        below are kept per base model, not per adapter name, which runtime loading makes
        unbounded (each name loaded and unloaded once left its entries behind)."""
        engine = self.get(name)
        return engine.base if isinstance(engine, AdapterEngine) else name

    def tool_calls(self, name: str) -> toolcalls.ToolCallFormat:
        """How model `name` writes tool calls (`--tool-call-parser`), worked out once."""
        name = self._tokenizer_owner(name)
        found = self._tool_calls.get(name)
        if found is None:
            found = self._tool_calls[name] = toolcalls.tool_call_format(self.tool_call_parser,
                                                                       self.get(name).tokenizer)
        return found

    def reasoning(self, name: str) -> ReasoningFormat | None:
        """Model `name`'s think markers (`--reasoning-parser`; None: its answers are all text),
        worked out once."""
        name = self._tokenizer_owner(name)
        if name not in self._reasoning:
            self._reasoning[name] = reasoning_format(self.reasoning_parser, self.get(name).tokenizer)
        return self._reasoning[name]

    async def start(self) -> None:
        for name, engine in self._engines.items():
            syntax = self.tool_calls(name).syntax.name
            how = "detected from the chat template" if self.tool_call_parser == "auto" else "--tool-call-parser"
            logger.info("model %s: tool calls parsed as %s (%s)", name, syntax, how)
            fmt = self.reasoning(name)
            thinks = ("none (answers are text)" if fmt is None
                      else "harmony's analysis channel" if fmt.harmony else "<think> blocks")
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

    def describe(self, name: str, allowed: frozenset[str] | None = None) -> dict[str, Any]:
        """One model as both SDKs read it (OpenAI's and Anthropic's fields side by side), with
        vLLM's lineage: `root`, the directory it was loaded from, and `parent`, for an adapter
        its base model's name (null for a base model)."""
        engine = self.get(name, allowed)
        context = int(getattr(engine, "max_model_len", 0) or 0)
        model_dir = getattr(getattr(engine, "engine", None), "model_dir", None)
        lineage = {"parent": None, "root": None if model_dir is None else str(model_dir)}
        if isinstance(engine, AdapterEngine):
            try:
                root = engine.lora_path(engine.adapter)
            except TierlmError:  # unloaded since `get` found it
                root = None
            lineage = {"parent": engine.base, "root": root}
        return lineage | {
            # OpenAI
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "tierlm",
            "max_model_len": context or None,  # (vLLM's name; clients size prompts by it)
            # Anthropic
            "type": "model",
            "display_name": name,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
            "lifecycle": "active",
            "max_input_tokens": context or None,
            "max_tokens": context or None,
        }


def _loras(engine: Any) -> list[str]:
    """An engine's adapters (engines that serve none, or stand-ins in tests, have none)."""
    listing = getattr(engine, "list_loras", None)
    return listing() if callable(listing) else []
