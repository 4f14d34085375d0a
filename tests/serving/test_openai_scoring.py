"""Scoring text through the OpenAI routes, as evaluation harnesses do: `echo` with `logprobs`
(the prompt's own logprobs first, the first token's null), `max_tokens` 0 (the prompt alone),
batched prompts (choice i × n + j is prompt i's j-th), and vLLM's `prompt_logprobs`. Driven by
the official `openai` SDK against the real server on the built-in demo model, and checked
against transformers' forward pass on the same checkpoint."""
from __future__ import annotations

import openai
import pytest
import torch

from tests.serving.harness import API_KEY, parse_sse, record_requests, sdk_clients

TEXTS = ["The quick brown fox jumps over the lazy dog.", "A tiered cache keeps hot blocks close to the device."]


@pytest.fixture(scope="module")
def oai(demo_server) -> openai.OpenAI:
    return sdk_clients(demo_server.url)[1]


@pytest.fixture(scope="module")
def reference(demo_engine):
    """transformers' log-softmax at every position of a prompt (row i predicts token i + 1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(demo_engine.engine.model_dir), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def _idle(engine) -> bool:
    stats = engine.engine.stats()
    return stats.num_running == stats.num_waiting == 0


def test_echo_with_max_tokens_zero_scores_a_batch_of_prompts_as_transformers_does(oai, demo_engine, reference):
    """lm-evaluation-harness' loglikelihood request: a batch of token-id prompts, echo, logprobs,
    nothing generated. Each choice is its prompt's text, every token's logprob is transformers'
    (the first's null), each top entry holds the token itself and the top 2, usage counts every
    prompt and no output."""
    prompts = [demo_engine.encode(t) for t in TEXTS]
    done = oai.completions.create(model=demo_engine.model_name, prompt=prompts, echo=True, logprobs=2, max_tokens=0)
    assert [c.index for c in done.choices] == [0, 1]
    for choice, ids in zip(done.choices, prompts):
        ref = reference(ids)
        assert choice.text == demo_engine.tokenizer.decode(ids) and choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
        assert lp.tokens == [demo_engine.tokenizer.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
            top = lp.top_logprobs[i]
            assert top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
            best = torch.topk(ref[i - 1], 2).values.tolist()
            assert sorted(top.values(), reverse=True)[0] == pytest.approx(max(best[0], lp.token_logprobs[i]), abs=1e-4)
        # text_offset indexes the echoed text: each token's text starts where it says
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        for i, tok in enumerate(lp.tokens):
            assert choice.text[lp.text_offset[i]:].startswith(tok)
    assert done.usage.prompt_tokens == sum(map(len, prompts)) and done.usage.completion_tokens == 0


def test_one_generated_token_after_the_echoed_prompt_continues_its_logprobs(oai, demo_engine, reference):
    """max_tokens 1 (what newer harnesses send): the prompt's entries, then the generated
    token's, whose logprob is the model's at the prompt's end; a text prompt is echoed as sent."""
    text = TEXTS[0]
    ids = demo_engine.encode(text)
    done = oai.completions.create(model=demo_engine.model_name, prompt=text, echo=True, logprobs=1, max_tokens=1,
                                  temperature=0)
    choice = done.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(text) and len(lp.tokens) == len(ids) + 1
    ref = reference(ids)
    assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)  # greedy: the top token
    assert lp.text_offset[-1] == len(text)
    assert sum(lp.token_logprobs[1:-1]) == pytest.approx(sum(ref[i - 1, ids[i]].item() for i in range(1, len(ids))),
                                                         abs=1e-3)
    assert done.usage.completion_tokens == 1


def test_batched_prompts_number_their_choices_prompt_by_prompt(oai, demo_engine):
    """Two prompts × n=2: choices 0-1 are the first prompt's, 2-3 the second's; each answers as
    that prompt alone does (greedy), and usage counts each prompt once."""
    model = demo_engine.model_name
    done = oai.completions.create(model=model, prompt=TEXTS, n=2, max_tokens=5, temperature=0, echo=True)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    for k, text in enumerate(TEXTS):
        alone = oai.completions.create(model=model, prompt=text, max_tokens=5, temperature=0).choices[0].text
        assert done.choices[2 * k].text == done.choices[2 * k + 1].text == text + alone
    lengths = [len(demo_engine.encode(t)) for t in TEXTS]
    assert done.usage.prompt_tokens == sum(lengths)


def test_streamed_batch_echoes_each_prompt_with_its_logprobs_first(demo_server, demo_engine):
    """Streamed, each choice's first chunk is its prompt's echo with the prompt's logprobs; its
    text and logprob columns then continue with the answer; the closing usage counts both prompts."""
    import httpx

    prompts = [demo_engine.encode(t) for t in TEXTS]
    body = {"model": demo_engine.model_name, "prompt": prompts, "echo": True, "logprobs": 0, "max_tokens": 3,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=demo_server.url, timeout=60) as client:
        raw = client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {API_KEY}"})
        plain = client.post("/v1/completions", json={**body, "stream": False, "stream_options": None},
                            headers={"authorization": f"Bearer {API_KEY}"}).json()
    frames = [data for _, data in parse_sse(raw.text) if data != "[DONE]"]
    texts, columns, first = {0: "", 1: ""}, {0: [], 1: []}, {}
    for frame in frames:
        for c in frame["choices"]:
            first.setdefault(c["index"], c)
            texts[c["index"]] += c["text"]
            if c["logprobs"]:
                columns[c["index"]] += c["logprobs"]["token_logprobs"]
    for k, ids in enumerate(prompts):
        assert first[k]["text"] == demo_engine.tokenizer.decode(ids)
        assert first[k]["logprobs"]["token_logprobs"][0] is None and len(first[k]["logprobs"]["tokens"]) == len(ids)
        assert texts[k] == plain["choices"][k]["text"]
        assert columns[k] == pytest.approx(plain["choices"][k]["logprobs"]["token_logprobs"], abs=1e-5)
    assert frames[-1]["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_vllm_prompt_logprobs_on_completions_and_chat(oai, demo_engine):
    """vLLM's `prompt_logprobs`: per prompt token a dict keyed by token id holding the token's
    own entry (its logprob and rank) and the top N at ranks 1..N; null for the first. The
    completion's agree with its echoed logprobs; chat's cover the rendered conversation."""
    model = demo_engine.model_name
    ids = demo_engine.encode(TEXTS[1])
    done = oai.completions.create(model=model, prompt=ids, echo=True, logprobs=3, max_tokens=1,
                                  extra_body={"prompt_logprobs": 3})
    choice = done.model_dump()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for i in range(1, len(ids)):
        entry = scored[i]
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(choice["logprobs"]["token_logprobs"][i])
        assert own["decoded_token"] == demo_engine.tokenizer.decode([ids[i]])
        # the top 3 at ranks 1-3, and the prompt token's own entry (one of them, or a fourth)
        assert sorted(e["rank"] for e in entry.values()) == ([1, 2, 3] if own["rank"] <= 3 else [1, 2, 3, own["rank"]])
    chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"prompt_logprobs": 0})
    rendered = demo_engine.engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    scored = chat.model_dump()["prompt_logprobs"]
    assert len(scored) == len(rendered) and scored[0] is None
    assert all(list(e) == [str(t)] for e, t in zip(scored[1:], rendered[1:]))
    plain = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert "prompt_logprobs" not in plain.model_dump()  # not asked for: OpenAI's shape, unchanged



def test_chat_choices_after_the_first_do_not_score_the_prompt(oai, demo_engine, monkeypatch):
    """Chat shows one `prompt_logprobs`, the first choice's: the other n - 1 engine requests do
    not score the prompt (each computed it whole, the prefix cache serving none of it)."""
    admitted = record_requests(demo_engine, monkeypatch)
    messages = [{"role": "user", "content": TEXTS[0]}]
    many = oai.chat.completions.create(model=demo_engine.model_name, messages=messages, max_tokens=2, n=3, seed=4,
                                       extra_body={"prompt_logprobs": 1}).model_dump()
    assert [r.params.prompt_logprobs for r in admitted] == [1, None, None]
    one = oai.chat.completions.create(model=demo_engine.model_name, messages=messages, max_tokens=2, seed=4,
                                      extra_body={"prompt_logprobs": 1}).model_dump()
    assert len(many["choices"]) == 3 and many["prompt_logprobs"][0] is one["prompt_logprobs"][0] is None
    for a, b in zip(many["prompt_logprobs"][1:], one["prompt_logprobs"][1:], strict=True):  # (batched beside others)
        want = {t: e["logprob"] for t, e in b.items()}
        assert {t: e["logprob"] for t, e in a.items()} == pytest.approx(want, abs=1e-4)

def test_completion_choices_share_the_prompt_their_first_choice_scores(oai, demo_engine, monkeypatch):
    """n choices of each prompt with echo, logprobs and `prompt_logprobs`: the prompt's first
    engine request alone scores it (each scored one computed it whole, no prefix cache), and
    every choice echoes the same prompt logprobs as n = 1 does."""
    admitted = record_requests(demo_engine, monkeypatch)
    prompts = [demo_engine.encode(t) for t in TEXTS]
    ask = dict(model=demo_engine.model_name, prompt=prompts, echo=True, logprobs=1, max_tokens=2, seed=4,
               extra_body={"prompt_logprobs": 1})
    many = oai.completions.create(n=3, **ask).model_dump()
    assert [r.params.prompt_logprobs for r in admitted] == [1, None, None, 1, None, None]
    one = oai.completions.create(**ask).model_dump()
    for c, choice in enumerate(many["choices"]):
        alone, size = one["choices"][c // 3], len(prompts[c // 3])
        assert choice["logprobs"]["tokens"][:size] == alone["logprobs"]["tokens"][:size]
        assert choice["logprobs"]["token_logprobs"][0] is None and choice["prompt_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:size] == pytest.approx(
            alone["logprobs"]["token_logprobs"][1:size], abs=1e-4)  # (batched beside others)
        for a, b in zip(choice["prompt_logprobs"][1:], alone["prompt_logprobs"][1:], strict=True):
            assert {t: e["logprob"] for t, e in a.items()} == pytest.approx({t: e["logprob"] for t, e in b.items()},
                                                                            abs=1e-4)


def test_streamed_choices_echo_the_prompt_their_first_choice_scores(demo_server, demo_engine, monkeypatch):
    """Streamed with n = 3, echo and logprobs: one engine request scores the prompt, and each
    choice's first chunk is the echo with the same logprobs as the unstreamed n = 1 answer."""
    import httpx

    admitted = record_requests(demo_engine, monkeypatch)
    ids = demo_engine.encode(TEXTS[0])
    body = {"model": demo_engine.model_name, "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 3, "n": 3,
            "stream": True}
    with httpx.Client(base_url=demo_server.url, timeout=60) as client:
        raw = client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {API_KEY}"})
        plain = client.post("/v1/completions", json={**body, "stream": False, "n": 1},
                            headers={"authorization": f"Bearer {API_KEY}"}).json()
    assert [r.params.prompt_logprobs for r in admitted[:3]] == [0, None, None]
    first = {}
    for _, data in parse_sse(raw.text):
        for c in [] if data == "[DONE]" else data["choices"]:
            first.setdefault(c["index"], c)
    want = plain["choices"][0]["logprobs"]["token_logprobs"][:len(ids)]
    for k in range(3):
        assert first[k]["text"] == demo_engine.tokenizer.decode(ids)
        assert first[k]["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)


def test_a_bad_prompt_in_a_batch_refuses_the_whole_batch_and_runs_nothing(oai, demo_engine, monkeypatch):
    """One prompt of the batch out of the vocabulary, or too long: a 400 in OpenAI's shape naming
    it, and not one of the batch's prompts reaches the engine."""
    admitted = record_requests(demo_engine, monkeypatch)
    model = demo_engine.model_name
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=model, prompt=[demo_engine.encode(TEXTS[0]), [10**6]], max_tokens=2)
    assert info.value.body["param"] == "prompt.1" and "token ids" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=model, prompt=["fine", "x " * 5000], max_tokens=2)
    assert info.value.body["param"] == "prompt.1"
    assert admitted == [] and _idle(demo_engine)
