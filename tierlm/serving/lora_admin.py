"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Off unless the server is started with --allow-runtime-lora-updating (vLLM: the environment
variable VLLM_ALLOW_RUNTIME_LORA_UPDATING), since loading reads a directory on the server's
disk. On a server with API keys, only the key ids given with --lora-admin-key may call them:
any other key gets a 403, so one tenant cannot load, replace or unload another's adapters.
Answers are vLLM's: plain text on success, an error in OpenAI's shape otherwise. A loaded
adapter is a model of its own name at once (`/v1/models` lists it with its `parent`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from tierlm.errors import InvalidRequestError, ModelLoadError
from tierlm.serving.errors import InvalidRequest, NotFound, PermissionDenied
from tierlm.serving.protocol_openai import _Body
from tierlm.serving.state import server_state

logger = logging.getLogger("tierlm.serving")

router = APIRouter()


@dataclass(frozen=True)
class LoRAUpdates:
    """Who may load and unload adapters at run time: `admin_keys` (key ids), or None where the
    server takes no keys (a loopback server, or --no-auth)."""

    admin_keys: frozenset[str] | None = None


class LoadLoRARequest(_Body):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None  # which served model it adapts (default: the only one)


class UnloadLoRARequest(_Body):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; adapters are known by name here


def _authorize(request: Request):
    state = server_state(request)
    updates: LoRAUpdates | None = getattr(state, "lora_updates", None)
    if updates is None:
        raise NotFound("runtime LoRA updating is off on this server; start it with --allow-runtime-lora-updating "
                       "(or load adapters at start with --lora-modules)")
    context = state.identify(request)
    if updates.admin_keys is not None and context.api_key_id not in updates.admin_keys:
        raise PermissionDenied("this API key may not load or unload LoRA adapters; the server's --lora-admin-key "
                               "ids may")
    return state, context


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    state, context = _authorize(request)
    body = await state.parse(request, LoadLoRARequest)
    bases = [n for n, _ in state.models.items()]
    base = body.base_model_name
    if base is None:
        if len(bases) != 1:
            raise InvalidRequest(f"base_model_name: this server serves {len(bases)} models; name the one the adapter "
                                 f"adapts ({', '.join(bases)})", param="base_model_name")
        base = bases[0]
    elif base not in bases:
        raise InvalidRequest(f"base_model_name: model '{base}' is not served here; serve it, or name one of "
                             f"{', '.join(bases)}", param="base_model_name")
    engine = state.models.get(base)
    # The engine's own rule decides a name it holds: the same directory again is a no-op, another
    # one a 400. A name it does not hold must not be any other model's.
    already = body.lora_name in engine.list_loras()
    if not already:
        state.models.check_adapter_name(body.lora_name)
    try:
        await engine.add_lora(body.lora_name, body.lora_path)
    except (ModelLoadError, InvalidRequestError) as e:
        raise InvalidRequest(str(e), param="lora_path" if isinstance(e, ModelLoadError) else "lora_name") from None
    if already:
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' is already loaded.")
    logger.info("LoRA adapter %s loaded on %s from %s (key %s)", body.lora_name, base, body.lora_path,
                context.api_key_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    state, context = _authorize(request)
    body = await state.parse(request, UnloadLoRARequest)
    for base, adapter in state.models.adapters():
        if adapter == body.lora_name:
            try:
                state.models.get(base).remove_lora(adapter)
            except InvalidRequestError:
                break  # unloaded meanwhile
            request.app.state.telemetry.metrics.forget_model(adapter)
            state.sla.forget_model(adapter)
            logger.info("LoRA adapter %s unloaded from %s (key %s)", adapter, base, context.api_key_id)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
    raise NotFound(f"LoRA adapter '{body.lora_name}' is not loaded here", param="lora_name")
