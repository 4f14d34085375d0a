"""Acceptance: the real server with the real engine (built-in demo model), driven by the
official anthropic and openai SDKs. The demo model's weights are random, so assertions are
about the protocol, never about the words; greedy decoding makes outputs repeatable."""
from __future__ import annotations

import anthropic
import openai
import pytest

from tests.serving.harness import SMALL_BODY_LIMIT, sdk_clients

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def model(demo_engine) -> str:
    return demo_engine.model_name


@pytest.fixture(scope="module")
def claude(demo_server) -> anthropic.Anthropic:
    return sdk_clients(demo_server.url)[0]


@pytest.fixture(scope="module")
def oai(demo_server) -> openai.OpenAI:
    return sdk_clients(demo_server.url)[1]


def input_total(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_create_and_count_tokens(claude, model):
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    msg = claude.messages.create(model=model, max_tokens=8, messages=messages)
    assert isinstance(msg, anthropic.types.Message)
    assert msg.id.startswith("msg_") and msg.model == model and msg.role == "assistant"
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= msg.usage.output_tokens <= 8
    count = claude.messages.count_tokens(model=model, messages=messages)
    assert count.input_tokens == input_total(msg.usage) > 0


def test_stream_text_and_final_message(claude, model):
    with claude.messages.stream(model=model, max_tokens=10, messages=[{"role": "user", "content": "Tell a story"}],
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert "".join(b.text for b in final.content if b.type == "text") == text
    assert final.usage.output_tokens >= 1
    again = claude.messages.create(model=model, max_tokens=10, messages=[{"role": "user", "content": "Tell a story"}],
                                   extra_body=GREEDY)
    assert "".join(b.text for b in again.content) == text  # stream and non-stream agree under greedy


def test_system_blocks(claude, model):
    plain = claude.messages.count_tokens(model=model, messages=[{"role": "user", "content": "Hi"}])
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in French."}]
    counted = claude.messages.count_tokens(model=model, system=system, messages=[{"role": "user", "content": "Hi"}])
    msg = claude.messages.create(model=model, max_tokens=4, system=system,
                                 messages=[{"role": "user", "content": "Hi"}])
    assert counted.input_tokens > plain.input_tokens
    assert input_total(msg.usage) == counted.input_tokens


def test_stop_sequences(claude, model):
    # Greedy output is repeatable: generate once, then stop on a character from its middle.
    # Random weights often produce invalid UTF-8 (shown as U+FFFD), so look for a prompt whose
    # answer has plain characters to stop on.
    for prompt in ("The quick brown fox", "Hello, world! How are you today?", "Numbers: 0 1 2 3"):
        messages = [{"role": "user", "content": prompt}]
        for _ in range(2):  # the second run takes the same (prefix-cached) path as the runs below
            reference = claude.messages.create(model=model, max_tokens=16, messages=messages, extra_body=GREEDY)
        text = "".join(b.text for b in reference.content)
        candidates = [c for c in text[1:] if c.isascii() and c.isalnum()]
        if candidates:
            break
    else:
        pytest.skip(f"the random model's answers have no plain character to stop on (last: {text!r})")
    stop = candidates[len(candidates) // 2]
    expected = text[: text.find(stop)]
    msg = claude.messages.create(model=model, max_tokens=16, messages=messages, stop_sequences=["\x00never", stop],
                                 extra_body=GREEDY)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in msg.content) == expected
    with claude.messages.stream(model=model, max_tokens=16, messages=messages, stop_sequences=[stop],
                                extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_assistant_prefill(claude, model):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    msg = claude.messages.create(model=model, max_tokens=6, messages=messages)
    count = claude.messages.count_tokens(model=model, messages=messages)
    with_turn = claude.messages.count_tokens(model=model, messages=messages[:1])
    assert input_total(msg.usage) == count.input_tokens
    # the prompt ends inside the assistant turn (the prefill), not with a fresh assistant header
    assert count.input_tokens > with_turn.input_tokens
    assert msg.stop_reason in ("end_turn", "max_tokens")


def test_prefill_with_trailing_whitespace_is_a_bad_request(claude, model):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is "}]
    with pytest.raises(anthropic.BadRequestError, match="final assistant content cannot end with trailing whitespace"):
        claude.messages.create(model=model, max_tokens=6, messages=messages)


def test_models(claude, oai, model):
    assert model in [m.id for m in claude.models.list()]
    assert claude.models.retrieve(model).id == model
    assert model in [m.id for m in oai.models.list()]


def test_anthropic_errors_are_sdk_exceptions(claude, demo_server, model):
    ok = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=demo_server.url, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=4, messages=ok)
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=ok)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": ""}])
    assert "messages.0: all messages must have non-empty content" in info.value.message
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=model, max_tokens=10**7, messages=ok)
    with pytest.raises(anthropic.BadRequestError, match="output_config.format: this json cannot be followed"):
        claude.messages.create(model=model, max_tokens=4, messages=ok, output_config={
            "format": {"type": "json_schema", "schema": {"type": "object", "properties": 5}}})
    with pytest.raises(anthropic.ContentTooLargeError):
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "x" * SMALL_BODY_LIMIT}])
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("no-such-model")
    state = demo_server.app.state.tierlm
    state.draining = True
    try:
        with pytest.raises(anthropic.OverloadedError):
            claude.messages.create(model=model, max_tokens=4, messages=ok)
    finally:
        state.draining = False


def test_openai_chat(oai, model):
    done = oai.chat.completions.create(model=model, max_tokens=6, messages=[{"role": "user", "content": "Hi"}])
    assert done.object == "chat.completion" and done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.completion_tokens >= 1
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    chunks = list(oai.chat.completions.create(model=model, max_tokens=6, stream=True,
                                              stream_options={"include_usage": True},
                                              messages=[{"role": "user", "content": "Hi"}]))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_openai_chat_logprobs_and_seed(oai, model):
    kwargs = dict(model=model, max_tokens=5, seed=7, temperature=1.0, logprobs=True, top_logprobs=2,
                  messages=[{"role": "user", "content": "Hi"}])
    a, b = oai.chat.completions.create(**kwargs), oai.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content  # same seed, same sample
    tokens = a.choices[0].logprobs.content
    assert tokens and all(len(t.top_logprobs) == 2 for t in tokens)


def test_openai_completions(oai, model):
    done = oai.completions.create(model=model, prompt="Once upon a time", max_tokens=5)
    assert done.object == "text_completion" and done.usage.completion_tokens >= 1
    chunks = list(oai.completions.create(model=model, prompt="Once upon a time", max_tokens=5, stream=True,
                                         stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens >= 1


def test_openai_sdk_none_arguments_mean_the_defaults(oai, model):
    """The SDK sends null for a None argument, and OpenAI documents these fields as nullable
    (null: the default). They were refused: `max_tokens: input should be a valid integer`."""
    done = oai.completions.create(model=model, prompt="Once upon a time", max_tokens=None, echo=None, stream=None,
                                  temperature=0)
    assert done.object == "text_completion" and not done.choices[0].text.startswith("Once upon a time")
    assert done.usage.completion_tokens == 16 or done.choices[0].finish_reason == "stop"  # the default: 16
    chat = oai.chat.completions.create(model=model, max_tokens=None, stream=None, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}], extra_body={"ignore_eos": None})
    assert chat.object == "chat.completion" and chat.usage.completion_tokens >= 1


def test_openai_errors_are_sdk_exceptions(oai, demo_server, model):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=demo_server.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model, messages=[])
    assert info.value.param == "messages"


def test_api_keys_never_share_cached_prefixes(model):
    """Usage says whether a prompt was cached, so a prefix cached for one API key must not be
    for another (it was: bob's usage showed what alice had sent); each key shares with itself,
    and a client's cache_salt only narrows that."""
    import uuid

    from tests.serving.harness import ServerThread
    from tierlm.engine.async_engine import AsyncEngine
    from tierlm.serving.app import build_app
    from tierlm.serving.auth import ApiKeyAuth

    engine = AsyncEngine.from_model(None, device="cpu", max_model_len=1024, kv_cache_memory=8 << 20,
                                    load_progress=False)  # its own: an engine runs on one server's loop
    app = build_app({model: engine}, ApiKeyAuth.from_keys({"alice": "sk-alice", "bob": "sk-bob"}))
    server = ServerThread(app).start()
    try:
        text = f"{uuid.uuid4().hex} " + "lorem ipsum dolor " * 30
        clients = {who: (anthropic.Anthropic(base_url=server.url, api_key=f"sk-{who}", max_retries=0),
                         openai.OpenAI(base_url=server.url + "/v1", api_key=f"sk-{who}", max_retries=0))
                   for who in ("alice", "bob")}

        def cached(who: str, salt: str | None = None) -> tuple[int, int]:
            extra = {"cache_salt": salt} if salt else None
            claude, oai = clients[who]
            msg = claude.messages.create(model=model, max_tokens=1, messages=[{"role": "user", "content": text}],
                                         extra_body=extra)
            chat = oai.chat.completions.create(model=model, max_tokens=1, **GREEDY,
                                               messages=[{"role": "user", "content": text}], extra_body=extra)
            return msg.usage.cache_read_input_tokens, chat.usage.prompt_tokens_details.cached_tokens

        first = cached("alice")
        assert first[0] == 0 and first[1] > 0  # alice's second request hits her own prefix
        assert cached("bob")[0] == 0  # not alice's
        assert cached("bob")[0] > 0  # his own, now
        assert cached("alice", "team")[0] == 0 and cached("bob", "team")[0] == 0  # a shared salt shares nothing
    finally:
        server.stop()


def test_cache_salt_keeps_cached_prefixes_apart(claude, oai, model):
    """vLLM's `cache_salt` request field (sent with the SDKs' extra_body): equal prompts with
    different salts never share cached blocks; the same salt does."""
    import uuid
    text = f"{uuid.uuid4().hex} " + "lorem ipsum dolor " * 30  # new to the cache

    def openai_cached(salt: str | None) -> int:
        r = oai.completions.create(model=model, prompt=text, max_tokens=1, **GREEDY,
                                   extra_body={"cache_salt": salt} if salt else None)
        return r.usage.prompt_tokens_details.cached_tokens

    assert openai_cached("alice") == 0
    assert openai_cached("alice") > 0
    assert openai_cached("bob") == 0 and openai_cached(None) == 0  # nor unsalted
    assert openai_cached(None) > 0 and openai_cached("alice") > 0

    def claude_cached(salt: str | None) -> int:
        msg = claude.messages.create(model=model, max_tokens=1, messages=[{"role": "user", "content": text}],
                                     extra_body={"cache_salt": salt} if salt else None)
        return msg.usage.cache_read_input_tokens

    assert claude_cached("carol") == 0 and claude_cached("carol") > 0 and claude_cached("dave") == 0
    for bad in ("", 7):
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            oai.completions.create(model=model, prompt=text, max_tokens=1, extra_body={"cache_salt": bad})
        with pytest.raises(anthropic.BadRequestError, match="cache_salt"):
            claude.messages.create(model=model, max_tokens=1, messages=[{"role": "user", "content": text}],
                                   extra_body={"cache_salt": bad})
