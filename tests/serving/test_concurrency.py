"""Acceptance: many clients at once against the real engine (demo model)."""
from __future__ import annotations

import asyncio

import anthropic
import httpx
import pytest

from tests.serving.harness import API_KEY, wait_until

CLIENTS = 50


@pytest.mark.slow
def test_50_concurrent_streams_all_complete(demo_server, demo_engine):
    model = demo_engine.model_name

    async def one(client: anthropic.AsyncAnthropic, i: int) -> anthropic.types.Message:
        async with client.messages.stream(model=model, max_tokens=12,
                                          messages=[{"role": "user", "content": f"Client {i} says hello"}]) as s:
            async for _ in s.text_stream:
                pass
            return await s.get_final_message()

    async def run() -> list[anthropic.types.Message]:
        client = anthropic.AsyncAnthropic(base_url=demo_server.url, api_key=API_KEY, max_retries=0, timeout=120)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(CLIENTS)))

    messages = asyncio.run(run())
    assert len(messages) == CLIENTS
    assert all(m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1 for m in messages)
    assert len({m.id for m in messages}) == CLIENTS
    assert wait_until(lambda: demo_engine.stats().kv_blocks_used == 0, timeout=5)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_50_clients_disconnecting_mid_stream_leave_no_kv_blocks(demo_server, demo_engine, path):
    model = demo_engine.model_name
    body = {"model": model, "max_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": "Write a very long story about caches"}]}
    if path == "/v1/chat/completions":
        body["ignore_eos"] = True  # vLLM-style extension: keeps every stream running until we leave
    used_while_streaming: list[int] = []

    async def one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if '"text_delta"' in line or '"content":' in line:
                    used_while_streaming.append(demo_engine.stats().kv_blocks_used)
                    break  # first generated text: hang up
        # leaving the block closes the connection

    async def run() -> None:
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=demo_server.url, headers={"x-api-key": API_KEY},
                                     timeout=120, limits=limits) as client:
            await asyncio.gather(*(one(client) for _ in range(CLIENTS)))

    asyncio.run(run())
    assert len(used_while_streaming) == CLIENTS and max(used_while_streaming) > 0
    assert wait_until(lambda: demo_engine.stats().kv_blocks_used == 0, timeout=5), demo_engine.stats()
    stats = demo_engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
