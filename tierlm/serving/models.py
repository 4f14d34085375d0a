"""The served models: name → engine, and their start/stop as one unit.

A request's `model` field picks the engine. Names come from `--model NAME=DIR`, or the
engine's own `model_name` when a single model is served.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from tierlm.serving.errors import NotFound

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine

logger = logging.getLogger("tierlm.serving")


class ModelRegistry:
    def __init__(self, engines: dict[str, "AsyncEngine"]) -> None:
        if not engines:
            raise ValueError("no models to serve; pass a model directory or --model NAME=DIR")
        self._engines = dict(engines)
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

    async def start(self) -> None:
        for name, engine in self._engines.items():
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
