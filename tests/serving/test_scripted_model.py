"""The scripted models the serving tests rely on really follow their scripts in the engine."""
from __future__ import annotations

import pytest

from tests.serving.scripted_model import ENGINE_OPTIONS, Script, build_scripted_model, chat_prompt_ids
from tierlm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llms(scripted_models):
    return {name: LLM(str(model.path), **ENGINE_OPTIONS) for name, model in scripted_models.items()}


def test_every_script_is_followed(scripted_models, llms):
    for name, model in scripted_models.items():
        llm, eos = llms[name], llms[name].engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
        for script, ids in zip(model.scripts, model.reply_ids):
            turns = 3 if script.loop else 1
            params = SamplingParams(temperature=0, max_tokens=turns * len(ids) + (0 if script.loop else 5))
            (out,) = llm.generate([script.prompt_ids], [params])[0].outputs
            if script.loop:  # runs until max_tokens, repeating itself
                assert (out.text, out.finish_reason) == (script.reply * turns, "length"), name
                assert out.token_ids == ids * turns
            else:  # the reply, then EOS
                assert (out.text, out.finish_reason) == (script.reply, "stop"), name
                assert out.token_ids == ids + [eos]


def test_sampling_follows_the_script_and_off_script_prompts_end_at_once(scripted_models, llms, demo_tokenizer):
    llm, model = llms["scripted"], scripted_models["scripted"]
    chat = chat_prompt_ids(demo_tokenizer, messages=[{"role": "user", "content": "anything at all"}])
    hot = SamplingParams(temperature=2.0, top_p=1.0, seed=5, max_tokens=100, logprobs=1)
    (out,) = llm.generate([chat], [hot])[0].outputs
    assert out.text == model.scripts[0].reply and all(lp.logprob > -1e-3 for lp in out.logprobs)
    (off,) = llm.generate([demo_tokenizer.encode("no script ends like this")],
                          [SamplingParams(temperature=0, max_tokens=20)])[0].outputs
    assert off.text == "" and off.finish_reason == "stop" and len(off.token_ids) == 1


def test_contradictory_scripts_are_refused(demo_tokenizer, tmp_path):
    chat = chat_prompt_ids(demo_tokenizer)
    with pytest.raises(ValueError, match="no segmentation"):
        build_scripted_model(tmp_path, [Script(chat, "yes"), Script(chat, "no")], demo_tokenizer)
