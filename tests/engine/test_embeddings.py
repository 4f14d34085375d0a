"""Embeddings (`LLM.embed`, `PoolingParams`): the last prompt token's final hidden state, checked
against transformers' base model on the same weights, through chunked prefill beside generation,
the prefix cache, and with or without normalisation."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import ref_tol
from tierlm.engine.llm import LLM
from tierlm.errors import InvalidRequestError
from tierlm.sampling_params import PoolingParams, SamplingParams


def _prompt(n: int, seed: int, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _last_hidden(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden state (after the last norm) at the last token: its base model's output."""
    with torch.no_grad():
        return hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen2_moe"])
def test_embeddings_are_transformers_last_hidden_state(arch, checkpoints, hf_models):
    """Two prompts embedded 16 tokens a step beside a generating request: each vector is the
    base model's last hidden state, L2-normalised (raw with normalize=False); the generation
    beside them is what it is alone."""
    llm = LLM(str(checkpoints[arch]), dtype="float32", block_size=8, max_num_batched_tokens=16, load_progress=False)
    prompts = [_prompt(50, seed=1), _prompt(9, seed=2)]
    gen_prompt = _prompt(20, seed=3)
    eng = llm.engine
    gen = eng.add_request({"prompt_token_ids": gen_prompt}, SamplingParams(max_tokens=6, temperature=0))
    out = llm.embed([{"prompt_token_ids": p} for p in prompts])
    raw = llm.embed({"prompt_token_ids": prompts[0]}, PoolingParams(normalize=False))[0]
    assert gen.is_finished  # it ran alongside (embed steps the engine until everything is done)
    alone = llm.generate({"prompt_token_ids": gen_prompt}, SamplingParams(max_tokens=6, temperature=0))[0]
    assert gen.output_token_ids == alone.outputs[0].token_ids
    for ids, got in zip(prompts, out):
        want = _last_hidden(hf_models[arch], ids)
        assert got.prompt_token_ids == ids and len(got.outputs.embedding) == want.numel()
        torch.testing.assert_close(torch.tensor(got.outputs.embedding), torch.nn.functional.normalize(want, dim=0),
                                   rtol=ref_tol(1e-4, 2e-2), atol=ref_tol(1e-5, 5e-3))
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), _last_hidden(hf_models[arch], prompts[0]),
                               rtol=ref_tol(1e-4, 2e-2), atol=ref_tol(1e-4, 2e-2))


def test_a_cached_prefix_serves_an_embedding_and_its_blocks_serve_generation(llama_dir):
    """Last-token pooling needs only the last position: a repeated prompt is embedded from the
    prefix cache (same vector), and the blocks an embedding computed are a later answer's hit.
    Nothing is left holding blocks."""
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, load_progress=False)
    ids = _prompt(41, seed=4)
    cold, warm = llm.embed({"prompt_token_ids": ids})[0], llm.embed({"prompt_token_ids": ids})[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 40
    torch.testing.assert_close(torch.tensor(warm.outputs.embedding), torch.tensor(cold.outputs.embedding),
                               rtol=1e-5, atol=1e-6)
    answer = llm.generate({"prompt_token_ids": ids + [7, 8]}, SamplingParams(max_tokens=2))[0]
    assert answer.num_cached_tokens == 40
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and llm.engine.pool.num_used == 0


def test_pooling_requests_are_validated_before_anything_runs(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, max_model_len=64, load_progress=False)
    with pytest.raises(InvalidRequestError, match="normalize"):
        PoolingParams(normalize="yes")
    with pytest.raises(InvalidRequestError, match="pooling must be a PoolingParams"):
        llm.engine.make_request([1, 2, 3], None, pooling={"normalize": True})
    with pytest.raises(InvalidRequestError, match="max_model_len"):  # a batch with one prompt too long runs none
        llm.embed([{"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [5] * 65}])
    assert not llm.engine.has_unfinished()
    with pytest.raises(InvalidRequestError, match="max_model_len"):  # generation needs room for a token
        llm.generate({"prompt_token_ids": [5] * 64}, SamplingParams(max_tokens=1))


def test_a_whole_context_is_embedded(llama_dir, hf_models):
    """An embedding generates nothing, so a prompt as long as the context is embedded (as vLLM
    does; it was refused for leaving no room for output), through chunks, and frees its blocks."""
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, max_model_len=64, max_num_batched_tokens=16,
              load_progress=False)
    ids = _prompt(64, seed=5)
    got = llm.embed({"prompt_token_ids": ids}, PoolingParams(normalize=False))[0]
    torch.testing.assert_close(torch.tensor(got.outputs.embedding), _last_hidden(hf_models["llama"], ids),
                               rtol=ref_tol(1e-4, 2e-2), atol=ref_tol(1e-4, 2e-2))
    assert llm.engine.pool.num_used == 0 and not llm.engine.has_unfinished()


def test_matryoshka_dimensions_only_where_the_model_says_it_was_trained_for_them(llama_dir, hf_models, tmp_path):
    """vLLM's rule: a shorter embedding (the first N entries, then normalised) only from a model
    whose config.json has matryoshka_dimensions (and only those lengths) or is_matryoshka."""
    import json
    import shutil
    ids = _prompt(23, seed=8)
    want = _last_hidden(hf_models["llama"], ids)
    plain = LLM(str(llama_dir), dtype="float32", load_progress=False)
    with pytest.raises(InvalidRequestError, match="cannot shorten them"):
        plain.embed({"prompt_token_ids": ids}, PoolingParams(dimensions=16))
    assert len(plain.embed({"prompt_token_ids": ids}, PoolingParams(dimensions=64))[0].outputs.embedding) == 64
    for fields, ok, bad in (({"matryoshka_dimensions": [16, 32, 64]}, 16, 20), ({"is_matryoshka": True}, 20, 65)):
        d = tmp_path / next(iter(fields))
        shutil.copytree(llama_dir, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **fields}))
        llm = LLM(str(d), dtype="float32", load_progress=False)
        got = llm.embed({"prompt_token_ids": ids}, PoolingParams(dimensions=ok))[0].outputs.embedding
        torch.testing.assert_close(torch.tensor(got), torch.nn.functional.normalize(want[:ok], dim=0),
                                   rtol=ref_tol(1e-4, 2e-2), atol=ref_tol(1e-5, 5e-3))
        with pytest.raises(InvalidRequestError, match="dimensions"):
            llm.embed({"prompt_token_ids": ids}, PoolingParams(dimensions=bad))
    with pytest.raises(InvalidRequestError, match="whole number"):
        PoolingParams(dimensions=0)
