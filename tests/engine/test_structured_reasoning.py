"""A structured output after a think block: a reasoning model thinks unconstrained, then its
answer follows the grammar from the token after `</think>` (vLLM applies the grammar once the
reasoning ends; Anthropic's output_config.format with thinking thinks first).

Scripted checkpoints (tests/serving/scripted_model.py) whose replies are written into their
weights: their thinking holds text no JSON grammar allows, and their answers are not JSON, so
an answer that both keeps its thought and is valid JSON shows where the grammar started.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from tests.serving.scripted_model import ENGINE_OPTIONS, build_templated_models, chat_prompt_ids
from tierlm import LLM, SamplingParams
from tierlm.engine.sampler import grammar_masks
from tierlm.errors import InvalidRequestError
from tierlm.models.demo import CHAT_TEMPLATE
from tierlm.sampling_params import StructuredOutputsParams, ThinkBlock, ThinkingBudget

OPEN_TEMPLATE = CHAT_TEMPLATE + "{% if add_generation_prompt %}<think>\n{% endif %}"  # R1's shape
THINKER, PLAIN, OPENER, PONDERER = "thinker", "plain", "opener", "ponderer"
THOUGHT = "No JSON here: {[ at all"
THINKING_REPLY = f"<think>{THOUGHT}</think>Plain words."
OPEN_REPLY = "Count: {x</think>words"  # the prompt said <think>
PLAIN_REPLY = '{"answer": "maybe"}'  # JSON that starts as the schema's does
PONDERING = "tick tock, "  # thought over and over (the prompt opened the block)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer"],
          "properties": {"answer": {"enum": ["yes", "no"]}}}
SPEC = StructuredOutputsParams(json=SCHEMA)
VALID = {'{"answer": "yes"}', '{"answer": "no"}'}
OPTIONS = ENGINE_OPTIONS


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tierlm.models.demo import build_tokenizer

    root = tmp_path_factory.mktemp("structured-reasoning")
    markers = ("<think>", "</think>")
    return build_templated_models(root, build_tokenizer(root / "demo-tokenizer"), [
        (THINKER, CHAT_TEMPLATE, THINKING_REPLY, markers), (PLAIN, CHAT_TEMPLATE, PLAIN_REPLY, ()),
        (OPENER, OPEN_TEMPLATE, OPEN_REPLY, markers), (PONDERER, OPEN_TEMPLATE, PONDERING, markers),
    ], loop=frozenset({PONDERER}), added=markers)


@pytest.fixture(scope="module")
def llms(models):
    built = {name: LLM(str(m.path), **OPTIONS) for name, m in models.items()}
    yield built
    for llm in built.values():
        llm.close()


def markers(llm) -> tuple[int, int]:
    tok = llm.engine.tokenizer
    return tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")


def block(llm, starts_inside: bool = False) -> ThinkBlock:
    start, end = markers(llm)
    return ThinkBlock(end, start, starts_inside)


def generate(llm, n: int = 3, max_tokens: int = 48, **params):
    """The chat prompt's samples (seeded; sampled, so any allowed token may come)."""
    prompt = chat_prompt_ids(llm.engine.tokenizer)
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=5, n=n, **params))
    return out[0].outputs


def text_of(llm, ids: list[int]) -> str:
    """`ids` as text, without the EOS that ends an answer."""
    return llm.engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_the_model_thinks_unconstrained_then_its_answer_follows_the_grammar(llms, models):
    llm = llms[THINKER]
    start, end = markers(llm)
    script = models[THINKER].reply_tokens(THINKING_REPLY)
    thought = script[: script.index(end) + 1]  # <think> ... </think>, as the script writes it
    for out in generate(llm, structured_outputs=StructuredOutputsParams(json=SCHEMA, after_reasoning=block(llm))):
        assert out.token_ids[: len(thought)] == thought  # the start marker and "{[", which JSON refuses
        answer = text_of(llm, out.token_ids[len(thought):])
        assert answer in VALID and out.finish_reason == "stop", answer  # "Plain words." was not
    # without the block the grammar holds from the first token: no thinking at all
    for out in generate(llm, structured_outputs=SPEC):
        assert out.text in VALID and start not in out.token_ids


def test_an_answer_that_does_not_open_the_block_follows_the_grammar_from_its_first_token(llms):
    """The model chose not to think: its first token is the grammar's (vLLM's rule: with no think
    block at the start, reasoning is over), and so is the rest ("maybe" is not in the enum)."""
    llm = llms[PLAIN]
    start, _ = markers(llm)
    for out in generate(llm, structured_outputs=StructuredOutputsParams(json=SCHEMA, after_reasoning=block(llm))):
        assert out.text in VALID and out.finish_reason == "stop" and start not in out.token_ids, out.text


def test_a_prompt_that_opens_the_block_leaves_the_answer_free_until_its_end(llms, models):
    llm = llms[OPENER]
    _, end = markers(llm)
    script = models[OPENER].reply_tokens(OPEN_REPLY)
    thought = script[: script.index(end) + 1]
    regex = StructuredOutputsParams(regex="[0-9]{3}", after_reasoning=block(llm, starts_inside=True))
    for out in generate(llm, structured_outputs=regex):
        assert out.token_ids[: len(thought)] == thought
        assert re.fullmatch("[0-9]{3}", text_of(llm, out.token_ids[len(thought):])), out.text
    # a block the prompt opened, taken for one the answer opens: the grammar held from the start
    for out in generate(llm, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}",
                                                                        after_reasoning=block(llm))):
        assert re.fullmatch("[0-9]{3}", out.text), out.text


def test_a_thinking_budget_ends_the_block_and_the_grammar_follows(llms):
    """A thinking budget beside a structured output was refused: its forced </think> was off the
    grammar. Now the forced marker ends the thinking and the answer keeps to the grammar."""
    llm = llms[PONDERER]
    start, end = markers(llm)
    budget = ThinkingBudget(6, (end,), (start,), starts_inside=True)
    for spec in (SPEC, StructuredOutputsParams(json=SCHEMA, after_reasoning=block(llm, starts_inside=True))):
        for out in generate(llm, thinking_budget=budget, structured_outputs=spec):
            assert text_of(llm, out.token_ids[:6]).startswith("tick tock") and out.token_ids[6] == end
            assert text_of(llm, out.token_ids[7:]) in VALID and out.finish_reason == "stop", out.text
    # no budget: the model thinks until max_tokens, and nothing constrains it
    free = StructuredOutputsParams(json=SCHEMA, after_reasoning=block(llm, starts_inside=True))
    for out in generate(llm, max_tokens=12, structured_outputs=free):
        assert out.finish_reason == "length" and out.text.startswith("tick tock, tick tock")


def test_a_recompute_after_preemption_keeps_where_each_answer_stands(models, llms):
    """Preemption frees a request's blocks and recomputes them later; its output, and with it
    where its grammar stands (thinking or past the block), is kept: answers match an engine that
    never preempts."""
    small = LLM(str(models[PONDERER].path), **{**OPTIONS, "kv_cache_memory": "12 blocks", "block_size": 8,
                                                "max_num_batched_tokens": 32, "enable_prefix_caching": False})
    try:
        start, end = markers(small)
        params = dict(thinking_budget=ThinkingBudget(14, (end,), (start,), starts_inside=True), structured_outputs=SPEC)
        got = generate(small, n=4, **params)
        assert small.engine.stats().num_preemptions >= 1
        assert [o.token_ids for o in got] == [o.token_ids for o in generate(llms[PONDERER], n=4, **params)]
        for out in got:
            assert out.token_ids[14] == end and text_of(small, out.token_ids[15:]) in VALID, out.text
    finally:
        small.close()


def test_rows_still_thinking_build_no_mask(llms):
    llm = llms[THINKER]
    start, end = markers(llm)
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA,
                                                                                     after_reasoning=block(llm)))
    prompt = chat_prompt_ids(llm.engine.tokenizer)
    reqs = [llm.engine.make_request(prompt, params) for _ in range(3)]
    reqs[1].append_token(start)  # thinking
    for t in (start, 7, end):  # past the block
        reqs[2].append_token(t)
    rows, masks = grammar_masks(reqs, llm.engine.args.vocab_size, torch.device("cpu"))
    assert rows == [0, 2]
    # the answer's first token: the grammar's start, or the start marker (the model may open the
    # block); after the block, the grammar's start alone
    assert masks[1].any() and not masks[1, start]
    opening = masks[1].clone()
    opening[start] = True
    assert torch.equal(masks[0], opening)


def test_a_think_block_the_grammar_cannot_wait_for_is_refused_by_name(llms):
    llm = llms[THINKER]
    start, end = markers(llm)
    cases = [
        (dict(thinking_budget=ThinkingBudget(4, (end, end))), "needs the budget's think markers to be one token each"),
        (dict(thinking_budget=ThinkingBudget(4, (end,), (start, start))), "one token each"),
        (dict(thinking_budget=ThinkingBudget(4, (end,)), after=ThinkBlock(end, start)),
         "is not the thinking_budget's think block"),
        (dict(after=ThinkBlock(-1)), "marker token ids must be non-negative integers"),
        (dict(after=ThinkBlock(end, start, starts_inside="yes")), "starts_inside must be true or false"),
        (dict(after=(end,)), "after_reasoning must be a ThinkBlock"),
    ]
    for kwargs, says in cases:
        spec = StructuredOutputsParams(json=SCHEMA, after_reasoning=kwargs.pop("after", None))
        with pytest.raises(InvalidRequestError, match=re.escape(says)) as info:
            SamplingParams(structured_outputs=spec, **kwargs)
        assert info.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError, match="structured_outputs names token id 99999, outside") as info:
        llm.generate([[5, 6]], SamplingParams(structured_outputs=StructuredOutputsParams(
            json=SCHEMA, after_reasoning=ThinkBlock(99999))))
    assert info.value.param == "structured_outputs"
    # the same block given twice, and numpy's ids, are fine; one grammar serves every block
    import numpy as np
    same = StructuredOutputsParams(json=SCHEMA, after_reasoning=ThinkBlock(np.int64(end)))
    SamplingParams(structured_outputs=same, thinking_budget=ThinkingBudget(4, (end,)))
    assert llm.engine.grammars.grammar(same) is llm.engine.grammars.grammar(SPEC)
    assert json.loads(same.grammar_key()) == json.loads(SPEC.grammar_key())
