"""A model's generation_config.json sampling settings serve requests that leave them unset (vLLM's
--generation-config auto); `vllm` keeps tierlm's own defaults; a request's own value wins."""
from __future__ import annotations

import json
import logging
import shutil

import httpx
import pytest

from tests.serving.harness import API_KEY, ServerThread
from tierlm.engine.generation_defaults import apply_defaults, sampling_defaults
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth


def test_only_usable_sampling_fields_are_taken(caplog):
    gen = {"do_sample": False, "temperature": 0.7, "top_p": 0.8, "top_k": 20.0, "min_p": None,
           "repetition_penalty": 50, "max_new_tokens": 256, "eos_token_id": 2}
    with caplog.at_level(logging.WARNING, logger="tierlm.engine.generation_defaults"):
        got = sampling_defaults(gen, "m/generation_config.json")
    # do_sample is ignored (as vLLM ignores it); an out-of-range value keeps tierlm's default, named.
    assert got == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert "m/generation_config.json: repetition_penalty = 50 is out of range" in caplog.text
    for bad in ({"temperature": "hot"}, {"top_k": 2.5}, {"top_p": True}, {"temperature": float("nan")}):
        assert sampling_defaults(bad) == {}
    # A request's own value wins, also a falsy one (temperature 0); None takes the default.
    assert apply_defaults({"temperature": 0.0, "top_k": None, "seed": 3}, got) == \
        {"temperature": 0.0, "top_k": 20, "top_p": 0.8, "seed": 3}


@pytest.fixture(scope="module")
def two_engines(llama_dir, tmp_path_factory):
    """One checkpoint whose generation_config.json says top_k 1 (greedy whatever the
    temperature), served as "auto" (the default) and as "vllm"."""
    from tierlm.engine.async_engine import AsyncEngine
    path = tmp_path_factory.mktemp("gencfg") / "m"
    shutil.copytree(llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 1, "temperature": 0.9}))
    common = dict(device="cpu", dtype="float32", kv_cache_memory=8 << 20, load_progress=False)
    auto = AsyncEngine.from_model(str(path), served_model_name="auto", **common)
    plain = AsyncEngine.from_model(str(path), served_model_name="vllm", generation_config="vllm", **common)
    server = ServerThread(build_app({"auto": auto, "vllm": plain}, ApiKeyAuth.from_keys({"alice": API_KEY}))).start()
    yield auto, plain, server
    server.stop()


def test_unset_fields_take_the_models_recommendation(two_engines):
    auto, plain, server = two_engines
    assert auto.sampling_defaults == {"top_k": 1, "temperature": 0.9} and plain.sampling_defaults == {}
    prompt = list(range(40, 72))

    def complete(model: str, **fields) -> list[int]:
        r = httpx.post(server.url + "/v1/completions", headers={"authorization": f"Bearer {API_KEY}"}, timeout=60,
                       json={"model": model, "prompt": prompt, "max_tokens": 24, "ignore_eos": True,
                             "return_token_ids": True, **fields})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    greedy = complete("auto", temperature=0)
    assert complete("auto", seed=1) == greedy  # top_k 1 from generation_config.json
    assert complete("auto", seed=1, temperature=1.0) == greedy  # only the fields the request sets are its own
    # The request's top_k (-1: no limit) wins over the model's; tierlm's defaults with `vllm`.
    assert complete("auto", seed=1, top_k=-1) != greedy
    assert complete("vllm", seed=1) != greedy


def test_an_unknown_generation_config_mode_is_refused(llama_dir):
    from tierlm import LLM
    with pytest.raises(ValueError, match="generation_config must be 'auto'"):
        LLM(str(llama_dir), generation_config="hf")
