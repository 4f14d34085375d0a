"""OpenAI's /v1/embeddings: each input's embedding from the served model, as vLLM serves a
decoder model converted to embeddings: the last token's final hidden state, L2-normalised
(`PoolingParams`; vLLM's `normalize: false` leaves it raw). Inputs run as engine requests
beside generation, behind the same tenancy and SLA admission; a cached prefix serves all but
the last token. There is no fallback model: another model's vectors lie in another space.
"""
from __future__ import annotations

import base64
import dataclasses
import struct
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from tierlm.sampling_params import PoolingParams, SamplingParams
from tierlm.errors import TierlmError
from tierlm.serving.errors import ContextLengthExceeded, InvalidRequest, from_engine_error
from tierlm.serving.generation import EngineStream, Generation
from tierlm.serving.openai import _collect_all, _open_all, _truncated, completion_prompt_ids
from tierlm.serving.protocol_openai import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from tierlm.serving.responses import json_answer
from tierlm.serving.state import server_state

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine
    from tierlm.serving.auth import RequestContext

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    state = server_state(request)
    context = await state.admit(request)
    body = await state.parse(request, EmbeddingRequest)
    engine = state.models.get(body.model, context.models)
    if body.dimensions is not None:
        try:
            engine.engine.check_embedding_dimensions(body.dimensions)
        except TierlmError as e:
            raise from_engine_error(e, body.model) from None
    inputs = body.inputs()
    fields = ["input"] if len(inputs) == 1 else [f"input.{i}" for i in range(len(inputs))]
    results = await embed_inputs(state, request, context, engine, body, list(zip(inputs, fields)), body.normalize,
                                 dimensions=body.dimensions)
    return await json_answer(lambda: _response(body, results), sum(len(r.embedding or ()) for r in results) // 16)


async def embed_inputs(state: Any, request: Request, context: RequestContext, engine: "AsyncEngine", body: Any,
                       inputs: list[tuple[str | list[int], str]], normalize: bool = True,
                       dimensions: int | None = None) -> list[Generation]:
    """Each (text or token ids, its field's name) embedded, as engine requests run side by side:
    all checked first (a bad one, named, refuses the request before any runs), then run, and
    their results in order. `body` gives the model's name, `truncate_prompt_tokens` and
    `cache_salt`. Shared by /v1/embeddings and the score and rerank routes."""
    ids_list = []
    for item, field_name in inputs:
        ids = _truncated(engine, await completion_prompt_ids(engine, body, item, field_name), body.truncate_prompt_tokens, 0)
        if len(ids) > engine.max_model_len:  # a whole context's worth is embedded (as vLLM: nothing is generated)
            raise ContextLengthExceeded(context=int(engine.max_model_len), prompt_tokens=len(ids), max_tokens=None,
                                        prompt_field=field_name)
        ids_list.append(ids)
    ctx = context.salted(body.cache_salt)
    pooling, params = PoolingParams(normalize=normalize, dimensions=dimensions), SamplingParams(max_tokens=1)
    streams = [EngineStream(engine, body.model, ids, params,
                            ctx if len(ids_list) == 1 else dataclasses.replace(ctx, request_id=f"{ctx.request_id}-{i}"),
                            state.inflight, pooling=pooling, prompt_index=i)
               for i, ids in enumerate(ids_list)]
    await _open_all(streams, request)
    results = await _collect_all(streams, request)
    for (_, where), result in zip(inputs, results):
        if result.embedding is None:  # refused by an input safety policy (its name is in the log and metrics)
            raise InvalidRequest(f"{where} was refused by the server's safety policy '{result.stop_reason}'",
                                 param=where)
    return results


def _response(body: EmbeddingRequest, results: list[Generation]) -> EmbeddingResponse:
    tokens = sum(r.num_prompt_tokens for r in results)
    return EmbeddingResponse(
        data=[Embedding(index=i, embedding=_encoded(r.embedding or [], body.encoding_format))
              for i, r in enumerate(results)],
        model=body.model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as JSON numbers, or (base64, what the `openai` SDK asks for by default) its
    little-endian float32 bytes in base64, which the SDK decodes with numpy."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
