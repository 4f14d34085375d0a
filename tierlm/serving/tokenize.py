"""vLLM's /tokenize and /detokenize: a prompt, or a conversation rendered by the model's chat
template exactly as /v1/chat/completions renders it, as the model's token ids; and ids back to
text. Clients use them to count and cut prompts with the server's own tokenizer and template.
Free of the tenant's limits, as count_tokens is; errors in OpenAI's shape, as vLLM's.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tierlm.serving.errors import InvalidRequest
from tierlm.serving.generation import refuse_too_long_to_count
from tierlm.serving.openai import build_chat_prompt, read_file_parts
from tierlm.serving.protocol_openai import ChatCompletionRequest, _Body
from tierlm.serving.state import server_state
from tierlm.serving.validation import validate_body

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine

router = APIRouter()

# The chat fields /tokenize passes on to the chat route's rendering, as the client sent them.
_CHAT_FIELDS = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                "documents")


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None  # checked as /v1/chat/completions checks them
    tools: list[Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[Any] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt (text) or messages (a conversation), not both or neither")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def _engine(state: Any, name: str | None, allowed: frozenset[str] | None) -> tuple[str, "AsyncEngine"]:
    """The model named, or the only base model served (vLLM's `model` is optional; a LoRA
    adapter tokenizes as its base model does)."""
    if name is None:
        names = [n for n, _ in state.models.items() if allowed is None or n in allowed]
        if len(names) != 1:
            raise InvalidRequest(f"model: this server serves {len(names)} models; name one of {', '.join(names)}",
                                 param="model")
        name = names[0]
    return name, state.models.get(name, allowed)


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    state = server_state(request)
    context = state.identify(request)
    body = await state.parse(request, TokenizeRequest, counting=True)
    name, engine = _engine(state, body.model, context.models)
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        refuse_too_long_to_count(engine, name, body.prompt, "prompt", "tokenizes")
        ids = await asyncio.to_thread(engine.tokenizer.encode, body.prompt, add_special_tokens=special)
    else:
        if body.add_special_tokens:  # (the template writes the special tokens a conversation has)
            raise InvalidRequest("add_special_tokens: a conversation's special tokens are the chat template's; leave "
                                 "it out or false with messages", param="add_special_tokens")
        given = body.model_dump(include=set(_CHAT_FIELDS), exclude_none=True)
        chat = validate_body(ChatCompletionRequest, {"model": name, **given})
        await read_file_parts(state, context, chat)  # (text files uploaded through /v1/files, as the chat route)
        prompt = await build_chat_prompt(engine, chat, state.models.tool_calls(name), state.models.reasoning(name),
                                         check_length=False)
        ids = list(prompt.token_ids)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                              "token_strs": engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs
                              else None}
    return JSONResponse(answer)


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    state = server_state(request)
    context = state.identify(request)
    body = await state.parse(request, DetokenizeRequest, counting=True)
    name, engine = _engine(state, body.model, context.models)
    vocab = len(engine.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"tokens: token ids must be in [0, {vocab}) for model '{name}'; got {bad[:5]}",
                             param="tokens")
    return JSONResponse({"prompt": await asyncio.to_thread(engine.tokenizer.decode, body.tokens)})
