"""A required tool call follows the tool's schema, token by token, in every syntax.

tool_choice `required` / a named function (Anthropic's `any` / `tool`) starts the call in the
prompt and constrains the rest (serving/tool_grammar.py). The models here have random weights:
whatever they would write, the answer must be exactly one call to an offered tool (the named
one) whose arguments follow its schema, through both official SDKs, streamed or not. Besides the
demo model (Hermes, markers in ordinary tokens), tiny random Llama checkpoints with the chat
templates of Llama 3.1 (llama3_json), Mistral v0.3 (a JSON list after `[TOOL_CALLS]`), newer
Mistral (`[TOOL_CALLS]name[ARGS]{...}`) and Qwen3's shape with Qwen's `<tool_call>` tokens and a
template that trims an assistant message (the prompt ends "<tool_call>", without the newline
tierlm wrote).
"""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest

from tests.serving.harness import API_KEY, ServerThread, record_requests, sdk_clients
from tests.serving.test_anthropic_fidelity import MISTRAL_TEMPLATE
from tests.serving.test_tool_parsers import LLAMA_TEMPLATE, QWEN3_STYLE_TEMPLATE, SPECIALS
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Oslo", "Paris", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "metric": {"type": "boolean"}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["CET", "UTC"]}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather like?"}]

# Newer Mistral templates: a call is `[TOOL_CALLS]name[ARGS]{...}` (tierlm starts a named call so)
MISTRAL_ARGS_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}[INST]{{ message['content'] }}[/INST]"
    "{%- elif message.tool_calls is defined and message.tool_calls %}"
    "{%- for call in message.tool_calls %}[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments|tojson }}"
    "{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}{{ message['content'] }}"
    "{%- endif %}{%- endfor %}"
)
# Qwen3's shape (its call turn opens with an empty think block: the call starts as a prefill),
# trimming the assistant message as some templates do
HERMES_TRIM_TEMPLATE = QWEN3_STYLE_TEMPLATE.replace("{{ message.content or '' }}", "{{ (message.content or '') | trim }}")
MISTRAL_SPECIALS = (*SPECIALS, "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]")
RANDOM_MODELS = {  # name: (template, special tokens, ordinary added tokens)
    "rand-llama3": (LLAMA_TEMPLATE, SPECIALS, ()),
    "rand-mistral": (MISTRAL_TEMPLATE, MISTRAL_SPECIALS, ()),
    "rand-mistral-args": (MISTRAL_ARGS_TEMPLATE, MISTRAL_SPECIALS, ()),
    "rand-hermes-trim": (HERMES_TRIM_TEMPLATE, (), ("<tool_call>", "</tool_call>")),  # as Qwen's tokenizer has them
}
DEMO = "demo"


def build_random_model(out: Path, demo_tokenizer, template: str, specials: tuple[str, ...],
                       plain: tuple[str, ...]) -> Path:
    """A tiny random-weight Llama over the demo tokenizer with `template` and those tokens added."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    demo_tokenizer.save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    if specials:
        tok.add_tokens(list(specials), special_tokens=True)
    if plain:
        tok.add_tokens(list(plain), special_tokens=False)
    tok.chat_template = template
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=None, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def random_engines(demo_tokenizer, tmp_path_factory):
    from tierlm.engine.async_engine import AsyncEngine

    root = tmp_path_factory.mktemp("tool-grammar")
    return {name: AsyncEngine.from_model(str(build_random_model(root / name, demo_tokenizer, *spec)),
                                         served_model_name=name, device="cpu", max_model_len=1024,
                                         kv_cache_memory=8 << 20, max_num_seqs=16, load_progress=False)
            for name, spec in RANDOM_MODELS.items()}


@pytest.fixture(scope="module")
def random_server(random_engines):
    server = ServerThread(build_app(random_engines, ApiKeyAuth.from_keys({"alice": API_KEY}))).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def served(random_server, demo_server, demo_engine):
    """model -> (served name, anthropic client, openai client)."""
    random_clients = sdk_clients(random_server.url)
    demo_clients = sdk_clients(demo_server.url)
    return {DEMO: (demo_engine.model_name, *demo_clients),
            **{name: (name, *random_clients) for name in RANDOM_MODELS}}


def openai_tools(schemas: dict = SCHEMAS) -> list[dict]:
    return [{"type": "function", "function": {"name": n, "description": "a tool", "parameters": s}}
            for n, s in schemas.items()]


def claude_tools(schemas: dict = SCHEMAS) -> list[dict]:
    return [{"name": n, "description": "a tool", "input_schema": s} for n, s in schemas.items()]


def follows(name: str, arguments: dict) -> bool:
    """The tool's schema, checked by hand."""
    if name == "get_time":
        return arguments in ({"zone": "CET"}, {"zone": "UTC"})
    days = arguments.get("days")
    return (name == "get_weather" and set(arguments) - {"metric"} == {"city", "days"}
            and arguments["city"] in ("Oslo", "Paris", "Lima") and type(days) is int and 1 <= days <= 7
            and type(arguments.get("metric", True)) is bool)


MODELS = [DEMO, *RANDOM_MODELS]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("named", [False, True])
def test_openai_required_call_follows_the_schema(served, model, named):
    name, _, oai = served[model]
    choice = {"type": "function", "function": {"name": "get_time"}} if named else "required"
    kwargs = dict(model=name, messages=USER, tools=openai_tools(), tool_choice=choice, max_tokens=120)
    created = [oai.chat.completions.create(**kwargs, seed=i).choices[0] for i in range(3)]
    with oai.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    for got in (*created, streamed):  # (a named choice's call ends with `stop`, as OpenAI's)
        assert got.finish_reason == ("stop" if named else "tool_calls") and not got.message.content
        (call,) = got.message.tool_calls
        assert call.function.name == "get_time" if named else call.function.name in SCHEMAS
        assert follows(call.function.name, json.loads(call.function.arguments)), call.function.arguments


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("named", [False, True])
def test_anthropic_required_call_follows_the_schema(served, model, named):
    name, claude, _ = served[model]
    choice = {"type": "tool", "name": "get_weather"} if named else {"type": "any"}
    kwargs = dict(model=name, max_tokens=120, messages=USER, tools=claude_tools(), tool_choice=choice)
    created = [claude.messages.create(**kwargs) for _ in range(3)]
    with claude.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    for message in (*created, streamed):
        assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
        block = message.content[0]
        assert block.name == "get_weather" if named else block.name in SCHEMAS
        assert follows(block.name, block.input), block.input


def test_the_grammar_follows_the_start_the_prompt_ends_with(served, random_engines, monkeypatch):
    """A template that trims the assistant prefill ends the prompt with "<tool_call>" (and the
    named call's `"arguments":` without its space): the grammar writes what the prompt lacks."""
    engine = random_engines["rand-hermes-trim"]
    asked = record_requests(engine, monkeypatch)
    _, claude, oai = served["rand-hermes-trim"]
    oai.chat.completions.create(model="rand-hermes-trim", messages=USER, tools=openai_tools(), tool_choice="required",
                                max_tokens=120)
    claude.messages.create(model="rand-hermes-trim", max_tokens=120, messages=USER, tools=claude_tools(),
                           tool_choice={"type": "tool", "name": "get_time"})
    prompts = [engine.tokenizer.decode(r.prompt_token_ids) for r in asked]
    assert prompts[0].endswith("</think>\n\n<tool_call>")
    assert prompts[1].endswith('</think>\n\n<tool_call>\n{"name": "get_time", "arguments":')


def test_a_cut_call_is_still_text_with_length(served):
    """The grammar holds the call to its schema; max_tokens can still cut it off."""
    name, claude, oai = served[DEMO]
    got = oai.chat.completions.create(model=name, messages=USER, tools=openai_tools(), tool_choice="required",
                                      max_tokens=3).choices[0]
    assert got.finish_reason == "length" and not got.message.tool_calls and got.message.content
    message = claude.messages.create(model=name, max_tokens=3, messages=USER, tools=claude_tools(),
                                     tool_choice={"type": "any"})
    assert message.stop_reason == "max_tokens" and [b.type for b in message.content] == ["text"]


@pytest.mark.parametrize("schema, says", [
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, "cannot follow this schema"),
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)b"}}}, "look-around"),
    ({"type": "object", "properties": {"x": {"const": 2 ** 53 + 1}}, "required": ["x"]},
     "properties.x.const: 9007199254740993 is past +-2**53"),  # (was called with 2**53)
])
def test_a_schema_a_required_call_cannot_follow_is_a_400_naming_the_tool(served, schema, says):
    name, claude, oai = served[DEMO]
    schemas = {"get_time": TIME, "broken": schema}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=name, messages=USER, tools=openai_tools(schemas), tool_choice="required")
    assert info.value.body["param"] == "tools.1.function.parameters" and says in info.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=name, max_tokens=20, messages=USER, tools=claude_tools(schemas),
                               tool_choice={"type": "any"})
    message = refused.value.body["error"]["message"]
    assert message.startswith("tools.1.input_schema: ") and says in message
    # Named: only that tool's schema is the call's; auto constrains nothing: neither is refused
    named = oai.chat.completions.create(model=name, messages=USER, tools=openai_tools(schemas), max_tokens=60,
                                        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and follows("get_time", json.loads(call.function.arguments))
    auto = oai.chat.completions.create(model=name, messages=USER, tools=openai_tools(schemas), max_tokens=8)
    assert auto.choices[0].finish_reason in ("stop", "length")  # (gibberish: the random model calls nothing)


def test_a_tool_without_parameters_takes_any_json_object(demo_engine):
    """OpenAI's parameters may be left out: the call's arguments are then any JSON object (the
    parsers take nothing else), compact, and the call closes after them."""
    from tierlm.serving.tool_grammar import arguments_schema, call_lark
    from tierlm.serving.tools import HERMES, ToolCallFormat
    from tierlm.sampling_params import StructuredOutputsParams

    written = HERMES.forced_prefix("f")
    lark = call_lark(ToolCallFormat(HERMES), [("f", arguments_schema(None, "tools.0.function.parameters"))], written)
    pristine = demo_engine.engine.grammars.grammar(StructuredOutputsParams(lark=lark))

    def accepts(text: str) -> bool:
        matcher = pristine.deep_copy()
        return all(matcher.consume_token(t) for t in demo_engine.tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()
    assert accepts('{"a": [1, "x"], "b": {}}}\n</tool_call>') and accepts("{}}\n</tool_call>")
    assert not accepts('"x"}\n</tool_call>') and not accepts('{"a":1}}\n</tool_call>')  # (not compact)
    assert not accepts('{}}\n</tool_call> and more')


def test_markers_are_written_as_their_tokens_unless_a_decode_drops_them(demo_tokenizer, tmp_path):
    """Qwen's `<tool_call>` tokens are ordinary added ones: the grammar writes them as those
    tokens. A special one a decode would drop (and tierlm does not keep) is written as text, or
    the call would never show its close; Mistral's special markers are kept, so written as tokens."""
    from transformers import AutoTokenizer

    from tierlm.serving.tools import tool_call_format

    demo_tokenizer.save_pretrained(str(tmp_path))

    def tokenizer(texts, special):
        tok = AutoTokenizer.from_pretrained(str(tmp_path))
        tok.add_tokens(list(texts), special_tokens=special)
        return tok
    plain = tokenizer(["<tool_call>", "</tool_call>"], special=False)
    assert dict(tool_call_format("hermes", plain).marker_tokens) == {
        t: plain.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>")}
    assert tool_call_format("hermes", tokenizer(["<tool_call>", "</tool_call>"], special=True)).marker_tokens == ()
    mistral = tokenizer(SPECIALS, special=True)
    assert {t for t, _ in tool_call_format("mistral", mistral).marker_tokens} == set(SPECIALS) - {"<|python_tag|>"}


def test_keywords_llguidance_does_not_implement_are_not_enforced_nor_refused(served):
    """MCP and zod schemas carry uniqueItems, formats llguidance does not know, if/then: a required
    call follows the rest of the schema (they were 400s); a client's x-guidance is not the grammar's."""
    name, claude, oai = served[DEMO]
    loose = {"type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"enum": ["CET", "UTC"]},
                            "tags": {"type": "array", "uniqueItems": True, "maxItems": 2, "items": {"enum": ["a", "b"]}},
                            "when": {"type": "string", "format": "no-such-format", "maxLength": 4}},
             "x-guidance": {"whitespace_flexible": True, "key_separator": "</tool_call>"}}
    got = oai.chat.completions.create(model=name, messages=USER, tools=openai_tools({"get_time": loose}),
                                      tool_choice="required", max_tokens=120).choices[0]
    (call,) = got.message.tool_calls
    assert got.finish_reason == "tool_calls" and json.loads(call.function.arguments)["zone"] in ("CET", "UTC")
    message = claude.messages.create(model=name, max_tokens=120, messages=USER, tools=claude_tools({"get_time": loose}),
                                     tool_choice={"type": "any"})
    assert message.stop_reason == "tool_use" and message.content[0].input["zone"] in ("CET", "UTC")


def test_two_tools_of_one_name_cannot_take_a_required_call(served):
    name, _, oai = served[DEMO]
    tools = openai_tools() + [{"type": "function", "function": {"name": "get_time", "parameters": WEATHER}}]
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=name, messages=USER, tools=tools, tool_choice="required")
    assert info.value.body["param"] == "tools.2" and "two tools are named 'get_time'" in info.value.body["message"]


@pytest.mark.parametrize("kind", ["string", ["array", "null"]])
def test_a_schema_of_another_type_than_object_is_refused_whatever_tool_choice_says(served, kind):
    """A call's arguments are a JSON object: both APIs refuse a tool whose schema says otherwise,
    under every tool_choice and in count_tokens (as Anthropic's and OpenAI's APIs do); a
    schema without a type is taken as an object's."""
    name, claude, oai = served[DEMO]
    schemas = {"get_time": TIME, "broken": {"type": kind}}
    for choice in (None, "auto", "none", "required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model=name, messages=USER, tools=openai_tools(schemas), max_tokens=2,
                                        **({"tool_choice": choice} if choice else {}))
        assert info.value.body["param"] == "tools.1.function.parameters"
        assert "the schema's type must be 'object'" in info.value.body["message"]
    for choice in (None, {"type": "auto"}, {"type": "none"}, {"type": "any"}):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model=name, max_tokens=2, messages=USER, tools=claude_tools(schemas),
                                   **({"tool_choice": choice} if choice else {}))
        assert refused.value.body["error"]["message"].startswith("tools.1.input_schema: a tool's arguments")
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model=name, messages=USER, tools=claude_tools(schemas))
    untyped = {"get_time": TIME, "loose": {"properties": {"a": {"type": "string"}}}}
    assert claude.messages.count_tokens(model=name, messages=USER, tools=claude_tools(untyped)).input_tokens > 0


def test_the_responses_api_takes_a_required_call_on_the_schema_and_names_its_fields(served):
    name, _, oai = served[DEMO]
    flat = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        created = oai.responses.create(model=name, input="Weather?", tools=flat, tool_choice=choice,
                                       max_output_tokens=120)
        (call,) = [item for item in created.output if item.type == "function_call"]
        assert follows(call.name, json.loads(call.arguments)) and (choice == "required" or call.name == "get_weather")
    broken = flat + [{"type": "function", "name": "broken", "parameters": {"type": "string"}}]
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model=name, input="Weather?", tools=broken, tool_choice="required")
    assert info.value.body["param"] == "tools.2.parameters"


def test_a_diagnosis_leaves_the_shared_cache_alone_and_a_failure_is_remembered(demo_engine, monkeypatch):
    """One bad tool among many: finding which one compiles each alone, kept out of the cache
    other requests share; the failed grammar is not compiled again."""
    import asyncio

    import llguidance

    from tierlm.serving.tool_grammar import call_grammar
    from tierlm.serving.tools import HERMES, ToolCallFormat

    grammars = demo_engine.engine.grammars
    tools = [{"function": {"name": f"t{i}", "parameters": TIME}} for i in range(6)]
    tools.append({"function": {"name": "bad", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/missing"}}}}})
    from tierlm.engine import grammar as grammar_module

    before = len(grammars._grammars)
    compiled = []

    class CountingMatcher:  # llguidance's LLMatcher, counting what is compiled
        def __call__(self, *args, **kwargs):
            compiled.append(1)
            return llguidance.LLMatcher(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(llguidance.LLMatcher, name)

    class Library:
        LLMatcher = CountingMatcher()

        def __getattr__(self, name):
            return getattr(llguidance, name)

    monkeypatch.setattr(grammar_module, "_llguidance", lambda: Library())
    for attempt in range(2):
        with pytest.raises(Exception, match="tools.6.function.parameters"):
            asyncio.run(call_grammar(demo_engine, ToolCallFormat(HERMES), tools, None, HERMES.forced_prefix(None),
                                     "tools.{}.function.parameters"))
        if attempt == 0:
            first = len(compiled)
    assert len(grammars._grammars) == before  # (the six good tools' own grammars were not kept)
    assert first == 8 and len(compiled) - first == 7  # the whole failed once; each alone is a one-off check
