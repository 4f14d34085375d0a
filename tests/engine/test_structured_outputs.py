"""Structured outputs in the engine: every answer follows its JSON schema, regular expression
or choice, whatever the (random-weight) model would have written, sampled or greedy, and ends
only once complete; the logprobs reported stay the model's own."""
from __future__ import annotations

import json
import logging
import re

import pytest

from tierlm import LLM, SamplingParams
from tierlm.errors import InvalidRequestError
from tierlm.sampling_params import StructuredOutputsParams

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "ok", "tags", "name"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                         "name": {"type": "string", "maxLength": 6}}}


def follows_schema(value) -> bool:
    """SCHEMA, checked by hand (the reference for the grammar llguidance compiled)."""
    return (isinstance(value, dict) and set(value) == {"n", "ok", "tags", "name"}
            and type(value["n"]) is int and 0 <= value["n"] <= 99 and type(value["ok"]) is bool
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}
            and isinstance(value["name"], str) and len(value["name"]) <= 6)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", kv_cache_memory=4 << 20, max_model_len=256, block_size=8,
               load_progress=False)


def answers(llm, spec: StructuredOutputsParams, temperature: float = 1.0, n: int = 4, **params):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=120, temperature=temperature, seed=7, n=n,
                                                structured_outputs=spec, **params))
    return [c for o in outs for c in o.outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 1.5])
def test_every_answer_follows_the_schema_and_ends_complete(llm, temperature):
    got = answers(llm, StructuredOutputsParams(json=SCHEMA), temperature, n=1 if temperature == 0 else 4)
    for out in got:
        assert out.finish_reason == "stop", out.text
        assert follows_schema(json.loads(out.text)), out.text
        assert out.text == json.dumps(json.loads(out.text), ensure_ascii=False)  # compact, as json.dumps writes it


def test_regex_choice_and_any_json_object(llm):
    for out in answers(llm, StructuredOutputsParams(regex=r"[A-Z][a-z]{1,4}-[0-9]{2}")):
        assert re.fullmatch(r"[A-Z][a-z]{1,4}-[0-9]{2}", out.text) and out.finish_reason == "stop", out.text
    choices = {"red", "green", "a blue one"}
    assert {out.text for out in answers(llm, StructuredOutputsParams(choice=sorted(choices)))} <= choices
    for out in answers(llm, StructuredOutputsParams(json_object=True)):  # (random models write long ones)
        assert isinstance(json.loads(out.text), dict) if out.finish_reason == "stop" else out.text.startswith("{")


def test_a_cut_off_answer_is_the_grammars_prefix(llm):
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=1.0, seed=1,
                                                    structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    text = out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "length" and text.startswith('{"')


def test_logprobs_stay_the_models_own_and_greedy_takes_the_best_allowed(llm):
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0].outputs[0]
    spec = StructuredOutputsParams(choice=["x", "y"])
    tok = llm.engine.tokenizer
    ids = [tok.encode(c, add_special_tokens=False)[0] for c in ("x", "y")]
    got = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0, logprobs=5,
                                                    structured_outputs=spec))[0].outputs[0]
    assert got.logprobs[0].top == plain.logprobs[0].top  # the raw distribution's top 5
    best = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0, allowed_token_ids=ids))
    assert got.token_ids[0] == best[0].outputs[0].token_ids[0]


def test_other_masks_work_inside_the_grammar_and_never_leave_it(llm):
    tok = llm.engine.tokenizer
    digits = {d: tok.encode(d, add_special_tokens=False) for d in "0123456789"}
    assert all(len(v) == 1 for v in digits.values())
    spec = StructuredOutputsParams(regex="[0-9]{3}")
    for out in answers(llm, spec, bad_words=["7"]):
        assert re.fullmatch("[0-689]{3}", out.text), out.text
    # allowed_token_ids that leave the grammar nothing: the grammar wins
    letters = tok.encode("abc", add_special_tokens=False)
    for out in answers(llm, spec, allowed_token_ids=letters):
        assert re.fullmatch("[0-9]{3}", out.text), out.text


def test_a_grammar_that_cannot_be_followed_further_ends_the_request_with_an_error(llm, caplog):
    """llguidance giving up mid-answer (a grammar past its limits) left the rest of the answer
    unconstrained, with 'stop'."""
    with caplog.at_level(logging.WARNING, logger="tierlm.engine"):
        huge = StructuredOutputsParams(regex="(a{1000}){1000}")  # llguidance's limits stop it after a token
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0, structured_outputs=huge))
    got = out[0].outputs[0]
    assert "could not be followed" in caplog.text
    assert got.finish_reason == "error" and set(got.text) <= {"a"}
    assert got.stop_reason.startswith("the structured output could not be followed past")


@pytest.mark.parametrize("spec, says", [
    (StructuredOutputsParams(), "must set exactly one of json, json_object, regex, choice, lark (got none)"),
    (StructuredOutputsParams(regex="a", choice=("b",)), "(got regex, choice)"),
    (StructuredOutputsParams(choice=()), "choice must be a non-empty list"),
    (StructuredOutputsParams(json=5), "json must be a JSON schema"),
    (StructuredOutputsParams(lark=5), "lark must be a string"),
    (StructuredOutputsParams(json={}, lark='start: "a"'), "(got json, lark)"),
])
def test_a_malformed_spec_is_refused_by_name(spec, says):
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as info:
        SamplingParams(structured_outputs=spec)
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize("spec, says", [
    (StructuredOutputsParams(json={"type": "objec"}), "this json cannot be followed: Invalid type: objec"),
    (StructuredOutputsParams(json="{not json"), "the JSON schema is not JSON"),
    (StructuredOutputsParams(regex="(a"), "this regex cannot be followed"),
    (StructuredOutputsParams(regex="[^\\x00-\\U0010FFFF]"), "nothing can follow it"),
    (StructuredOutputsParams(json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "cannot be followed"),
    (StructuredOutputsParams(lark='start: "a" %json {"type": "objec"}'), "this grammar cannot be followed"),
    (StructuredOutputsParams(lark="start: nowhere"), "this grammar cannot be followed"),
])
def test_a_grammar_the_engine_cannot_follow_is_refused_before_it_runs(llm, spec, says):
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as info:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert info.value.param == "structured_outputs"
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks  # nothing half-ran


def test_integers_past_2_to_the_53_are_refused_not_rounded(llm):
    """llguidance reads a schema's numbers as float64: a const of 2**53 + 1 was written as 2**53
    with 'stop', and a maximum of 2**53 + 7 let 2**53 + 8 through. Such a schema is refused by
    name; 2**53 itself, and a large integer in an annotation (`default`), still run."""
    big = 2 ** 53 + 1
    for schema, where in (({"const": big}, "const"),
                          ({"type": "object", "properties": {"n": {"type": "integer", "maximum": 2 ** 53 + 7}}},
                           "properties.n.maximum"),
                          ({"enum": [1, -big]}, "enum.1")):
        with pytest.raises(InvalidRequestError, match=re.escape(f"{where}: ")) as info:
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
                json=schema)))
        assert "past +-2**53" in str(info.value) and info.value.param == "structured_outputs"
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
    ok = {"type": "object", "properties": {"default": {"const": 2 ** 53, "default": big}}, "required": ["default"],
          "additionalProperties": False}
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0, structured_outputs=(
        StructuredOutputsParams(json=ok))))[0].outputs[0]
    assert out.finish_reason == "stop" and json.loads(out.text) == {"default": 2 ** 53}


def test_a_lark_grammar_keeps_its_text_and_its_embedded_schema(llm):
    """tierlm's own `lark` (the server composes one for a required tool call): literal text
    around a `%json` schema, compact as its `x-guidance` asks (a grammar's schemas get no
    defaults: the tool-call grammar sets it on each)."""
    from tierlm.engine.grammar import COMPACT_JSON

    schema = {**SCHEMA, "x-guidance": COMPACT_JSON}
    spec = StructuredOutputsParams(lark='start: "call(" %json ' + json.dumps(schema) + ' ")" | "none"')
    for out in answers(llm, spec, temperature=1.5):
        assert out.finish_reason == "stop", out.text
        if out.text != "none":
            assert out.text.startswith("call(") and out.text.endswith(")"), out.text
            value = json.loads(out.text[5:-1])
            assert follows_schema(value) and out.text[5:-1] == json.dumps(value, ensure_ascii=False)


def test_two_lark_grammars_are_two_cached_grammars(llm):
    """The cache key holds the grammar's text: a second grammar never reuses the first's."""
    for word in ("alpha", "omega"):
        out = answers(llm, StructuredOutputsParams(lark=f'start: "{word}"'), temperature=0, n=1)
        assert [o.text for o in out] == [word] * len(PROMPTS)


def test_the_tokenizer_is_converted_once_and_grammars_compiled_once(llm, monkeypatch):
    """Concurrent first requests each converted the tokenizer (a second apiece for a big
    vocabulary); every sample and every repeat of a schema compiled it again."""
    import threading

    import llguidance.hf

    from tierlm.engine.grammar import GrammarCompiler

    calls = {"convert": 0, "compile": 0}
    convert, compile_schema = llguidance.hf.from_tokenizer, llguidance.LLMatcher.grammar_from_json_schema

    def counted_convert(*args, **kwargs):
        calls["convert"] += 1
        return convert(*args, **kwargs)

    def counted_compile(*args, **kwargs):
        calls["compile"] += 1
        return compile_schema(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", counted_convert)
    monkeypatch.setattr(llguidance.LLMatcher, "grammar_from_json_schema", counted_compile)
    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.args.vocab_size, engine.eos_token_ids)
    spec = StructuredOutputsParams(json=SCHEMA)
    threads = [threading.Thread(target=compiler.follower, args=(spec,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls["convert"] == 1  # (threads may race to the first compile; each compiles at most once)
    before = calls["compile"]
    for _ in range(5):
        compiler.follower(StructuredOutputsParams(json=dict(SCHEMA)))
    assert calls["compile"] == before


def test_a_tokenizer_llguidance_cannot_take_is_a_clear_refusal(llm):
    from transformers import PreTrainedTokenizer

    from tierlm.engine.grammar import GrammarCompiler

    class Slow(PreTrainedTokenizer):  # a Python-only tokenizer: llguidance wants a fast one
        vocab_size = 10

        def get_vocab(self):
            return {str(i): i for i in range(10)}

    compiler = GrammarCompiler(Slow(), 10, frozenset({0}))
    assert not compiler.available()  # (the server then starts a required tool call unconstrained)
    assert llm.engine.grammars.available()
    for _ in range(2):  # (the failure is kept, not tried again each request)
        with pytest.raises(InvalidRequestError, match="this model's tokenizer cannot be used for structured outputs"):
            compiler.follower(StructuredOutputsParams(regex="[0-9]"))


def test_schemas_that_differ_in_property_order_are_two_grammars(llm):
    """The cache keyed schemas with their keys sorted: {q, p} and then {p, q} shared a grammar,
    and the second answered in the first's order."""
    def first_key(order):
        schema = {"type": "object", "properties": {k: {"type": "integer"} for k in order},
                  "required": ["p", "q"], "additionalProperties": False}
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0,
                                                        structured_outputs=StructuredOutputsParams(json=schema)))
        return out[0].outputs[0].text[:4]
    assert first_key("qp") == '{"q"' and first_key("pq") == '{"p"'


def test_bitmasks_unpack_as_the_bits_say():
    import torch

    from tierlm.engine.grammar import unpack_bitmask

    ids = [0, 7, 8, 31, 32, 63, 64, 99]
    row = torch.zeros(4, dtype=torch.int32)
    bits = row.numpy().view("uint32")
    for t in ids:
        bits[t >> 5] |= 1 << (t & 31)
    mask = unpack_bitmask(row.unsqueeze(0), 100)
    assert mask.shape == (1, 100) and mask[0].nonzero().flatten().tolist() == ids
