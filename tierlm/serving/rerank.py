"""vLLM's score and rerank APIs for a model served for embeddings: `/score` (and `/v1/score`)
scores text pairs, `/rerank` (and `/v1/rerank`, and `/v2/rerank` in the shape Jina's and
Cohere's clients send) orders documents by their relevance to a query.

A pair's score is the cosine similarity of its two texts' embeddings (the last token's final
hidden state, normalised: exactly what /v1/embeddings returns), which is how vLLM scores pairs
with an embedding model (a cross-encoder, which reads both texts at once, is another kind of
checkpoint). Each distinct text is embedded once, as engine requests beside generation, behind
the same tenancy, limits and safety policies as /v1/embeddings; a query scored against a
thousand documents is embedded once. Errors come in OpenAI's shape, as vLLM's do.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, TypeVar

import torch
from fastapi import APIRouter
from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tierlm.serving.errors import InvalidRequest
from tierlm.serving.openai_embeddings import embed_inputs
from tierlm.serving.protocol_openai import MAX_EMBEDDING_INPUTS, _Body, _checked_truncation
from tierlm.serving.state import server_state
from tierlm.serving.telemetry import request_telemetry

router = APIRouter()
M = TypeVar("M")

def _texts(value: Any, field: str) -> Any:
    texts = value if isinstance(value, list) else [value]
    if not texts:
        raise ValueError(f"{field} is an empty list; give at least one text")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise ValueError(f"{field} holds {len(texts)} texts; at most {MAX_EMBEDDING_INPUTS} per request: split it")
    empty = [i for i, t in enumerate(texts) if isinstance(t, str) and not t]
    if empty:
        raise ValueError(f"{field}{'' if len(texts) == 1 else f'.{empty[0]}'} is empty; every text needs a token")
    return value


class ScoreRequest(_Body):
    """vLLM's /score body: `text_1` against `text_2`, one to one, one to many or pairwise."""

    model: str = Field(min_length=1)
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)

    _lists = field_validator("text_1", "text_2")(lambda value, info: _texts(value, info.field_name))
    _truncation = field_validator("truncate_prompt_tokens")(lambda value: _checked_truncation(value))


class RerankRequest(_Body):
    """vLLM's /rerank body (Jina's and Cohere's fields): `documents` ordered by relevance to `query`."""

    model: str = Field(min_length=1)
    query: str = Field(min_length=1)
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0)  # the best N (None or 0: every document)
    return_documents: bool = True  # Cohere's: False leaves each result's `document` out
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)

    _lists = field_validator("documents")(lambda value: _texts(value, "documents"))
    _truncation = field_validator("truncate_prompt_tokens")(lambda value: _checked_truncation(value))


def score_pairs(left: list[str], right: list[str]) -> list[tuple[int, int]]:
    """(left index, right index) per pair, by vLLM's rule (1:1, 1:N or N:N): text_1's one text
    against each of text_2's, or two lists of one length side by side (N:1 is refused, as vLLM
    refuses it: text_1 is the query side)."""
    if len(left) == 1:
        return [(0, j) for j in range(len(right))]
    if len(left) != len(right):
        raise InvalidRequest(f"text_1 holds {len(left)} texts and text_2 {len(right)}: give text_1 one text (scored "
                             "against each of text_2's), or two lists of the same length (scored pair by pair)",
                             param="text_2")
    return [(i, i) for i in range(len(left))]


async def _similarities(request: Request, context: Any, body: Any, texts: list[tuple[str, str]],
                        pairs: list[tuple[int, int]]) -> tuple[list[float], int]:
    """Each pair's cosine similarity (`pairs` index `texts`, which are (text, its field), each
    distinct text embedded once) and the prompt tokens embedded."""
    state = server_state(request)
    engine = state.models.get(body.model, context.models)
    distinct: dict[str, tuple[int, str]] = {}
    for text, field in texts:
        distinct.setdefault(text, (len(distinct), field))
    results = await embed_inputs(state, request, context, engine, body, [(t, f) for t, (_, f) in distinct.items()])
    vectors = torch.tensor([r.embedding for r in results], dtype=torch.float32)
    row = [distinct[t][0] for t, _ in texts]
    left = torch.tensor([row[a] for a, _ in pairs])
    right = torch.tensor([row[b] for _, b in pairs])
    scores = (vectors[left] * vectors[right]).sum(dim=-1).clamp(-1.0, 1.0)
    return scores.tolist(), sum(r.num_prompt_tokens for r in results)


async def _admitted(request: Request, cls: type[M]) -> tuple[Any, M]:
    """The caller admitted (auth, tenant, its limits) and the body parsed, in that order."""
    state = server_state(request)
    context = await state.admit(request)
    return context, await state.parse(request, cls)


@router.post("/score")
@router.post("/v1/score")
async def score(request: Request) -> Response:
    context, body = await _admitted(request, ScoreRequest)
    left = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    right = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    pairs = score_pairs(left, right)
    texts = ([(t, "text_1" if len(left) == 1 else f"text_1.{i}") for i, t in enumerate(left)]
             + [(t, "text_2" if len(right) == 1 else f"text_2.{j}") for j, t in enumerate(right)])
    scores, tokens = await _similarities(request, context, body, texts, [(a, len(left) + b) for a, b in pairs])
    response_id = request_telemetry(request).response_id = f"score-{uuid.uuid4().hex}"  # the span's too
    return JSONResponse({
        "id": response_id, "object": "list", "created": int(time.time()), "model": body.model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request) -> Response:
    context, body = await _admitted(request, RerankRequest)
    texts = [(body.query, "query")] + [(d, f"documents.{i}") for i, d in enumerate(body.documents)]
    scores, tokens = await _similarities(request, context, body, texts,
                                         [(0, 1 + i) for i in range(len(body.documents))])
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: body.top_n or None]
    response_id = request_telemetry(request).response_id = f"rerank-{uuid.uuid4().hex}"  # the span's too
    return JSONResponse({
        "id": response_id, "model": body.model, "usage": {"total_tokens": tokens},
        "results": [{"index": i, **({"document": {"text": body.documents[i]}} if body.return_documents else {}),
                     "relevance_score": scores[i]} for i in order]})
