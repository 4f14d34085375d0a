"""Non-streamed answers: a large one is built and serialised in a worker thread, not on the
event loop every other client's stream shares."""
from __future__ import annotations

import asyncio
import json
import threading

from pydantic import BaseModel

from tierlm.serving.responses import OFF_LOOP_ENTRIES, json_answer


class _Answer(BaseModel):
    text: str
    logprobs: list[float]


def test_a_large_answer_is_built_off_the_event_loop_and_a_small_one_on_it():
    built_in: dict[str, int] = {}

    def build(tag: str):
        def make() -> _Answer:
            built_in[tag] = threading.get_ident()
            return _Answer(text="é\u2028", logprobs=[-0.5] * 3)
        return make

    async def main() -> tuple[int, list]:
        small = await json_answer(build("small"), OFF_LOOP_ENTRIES - 1)
        large = await json_answer(build("large"), OFF_LOOP_ENTRIES)
        return threading.get_ident(), [small, large]

    loop_thread, answers = asyncio.run(main())
    assert built_in["small"] == loop_thread and built_in["large"] != loop_thread
    for answer in answers:  # rendered alike, as JSONResponse renders
        assert answer.media_type == "application/json" and answer.status_code == 200
        assert json.loads(answer.body) == {"text": "é\u2028", "logprobs": [-0.5] * 3}
        assert answer.headers["content-length"] == str(len(answer.body))


def test_a_large_answer_built_off_the_loop_equals_its_stream(demo_server):
    """300 tokens with 5 top logprobs: past OFF_LOOP_ENTRIES, so the answer is built in a thread;
    it holds what the same seeded request streams."""
    import httpx

    from tests.serving.harness import API_KEY
    from tests.serving.test_openai_vllm import legacy_logprobs_of

    with httpx.Client(base_url=demo_server.url, timeout=120, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Random words", "max_tokens": 300, "temperature": 1.0, "seed": 5,
                "logprobs": 5, "ignore_eos": True}
        lp = legacy_logprobs_of(c, body)
    assert len(lp["tokens"]) == 300 and 300 * 7 >= OFF_LOOP_ENTRIES
    assert all(len(top) >= 5 for top in lp["top_logprobs"])
