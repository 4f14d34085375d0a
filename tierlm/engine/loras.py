"""The adapters an engine serves, by name: loaded once, chosen per request.

Adding and removing are safe from any thread while the engine steps: an adapter is loaded
and laid out before it is published (one dict assignment), and a request holds its adapter
object, so one removed while requests use it serves them to their end, and only new requests
no longer find it.
"""
from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import torch
from torch import nn

from tierlm.errors import InvalidRequestError, ModelLoadError
from tierlm.models.config import ModelArgs
from tierlm.models.lora import LoRAAdapter, LoRALinear, LoRARequest, LoRAState, add_lora_layers, load_lora_adapter

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


def check_lora_name(name: object) -> str:
    """An adapter name is what a request's `model` field says: printable, no spaces, ≤ 128 chars."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(f"LoRA adapter name {name!r} is not valid: use 1-128 letters, digits and . _ : / "
                                  "@ + -, starting with a letter or digit", param="lora_name")
    return name


class LoRARegistry:
    def __init__(self, model: nn.Module, args: ModelArgs, device: torch.device, dtype: torch.dtype,
                 max_rank: int, reserved: set[str] | None = None) -> None:
        self.state: LoRAState
        self.layers: dict[str, LoRALinear]
        self.state, self.layers = add_lora_layers(model)
        self.args, self.device, self.dtype, self.max_rank = args, device, dtype, max_rank
        self.reserved = set(reserved or ())  # names adapters may not take (the base model's own)
        self._adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()  # one add or remove at a time (loads run outside it)

    @property
    def names(self) -> list[str]:
        return list(self._adapters)

    def require(self, name: str) -> LoRAAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            have = ", ".join(self._adapters) or "none"
            raise InvalidRequestError(f"LoRA adapter '{name}' is not loaded (loaded: {have}); add it first",
                                      param="lora_request")
        return adapter

    def add(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load the PEFT adapter in `path` as `name`. Loading the same directory again under the
        same name is a no-op; another directory under a taken name is refused."""
        check_lora_name(name)
        if name in self.reserved:
            raise InvalidRequestError(f"LoRA adapter name '{name}' is the base model's own name; choose another",
                                      param="lora_name")
        existing = self._loaded_from(name, path)
        if existing is not None:
            return existing
        adapter = load_lora_adapter(name, path, self.args, self.layers, self.device, self.dtype, self.max_rank)
        with self._lock:  # (another add of this name may have finished while this one loaded)
            if self._loaded_from(name, path) is None:
                self._adapters[name] = adapter
        log.info("LoRA adapter %s loaded from %s: rank %d, %d modules, %.1f MiB", name, path, adapter.rank,
                 len(adapter.weights), adapter.num_parameters * torch.empty((), dtype=self.dtype).element_size() / 2**20)
        return self._adapters[name]

    def _loaded_from(self, name: str, path: str | Path) -> LoRAAdapter | None:
        """`name`'s adapter if it is loaded from `path` already; None if `name` is free. Another
        directory under that name is refused."""
        existing = self._adapters.get(name)
        if existing is not None and Path(existing.path).resolve() != Path(path).resolve():
            raise InvalidRequestError(f"LoRA adapter '{name}' is already loaded from {existing.path}; remove it "
                                      "first, or choose another name", param="lora_name")
        return existing

    def remove(self, name: str) -> None:
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise InvalidRequestError(f"LoRA adapter '{name}' is not loaded (loaded: "
                                          f"{', '.join(self._adapters) or 'none'})", param="lora_name")
        log.info("LoRA adapter %s removed (requests already using it run to their end)", name)

    def resolve(self, lora: str | LoRARequest | LoRAAdapter) -> LoRAAdapter:
        """A request's adapter: a loaded name, or vLLM's LoRARequest (loaded on first use)."""
        if isinstance(lora, LoRAAdapter):
            return lora
        if isinstance(lora, LoRARequest):
            try:
                return self.add(lora.lora_name, lora.lora_path)
            except ModelLoadError as e:
                raise InvalidRequestError(str(e), param="lora_request") from None
        if isinstance(lora, str):
            return self.require(lora)
        raise InvalidRequestError(f"lora_request must be an adapter name or a LoRARequest (got "
                                  f"{type(lora).__name__})", param="lora_request")
