"""tierlm against Hugging Face transformers on the same weights, every architecture."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from tests.conftest import ARCHS, has_sinks, rounded_kv_attention
from tierlm import LLM, SamplingParams
from tierlm.engine.runner import kv_bytes_per_block


def _prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 17, 31, 1, 48, 9, 64, 25, 40][:n]
    return [[rng.randrange(vocab - 10) for _ in range(L)] for L in lengths]


class _Capture:
    """Records the logits the engine samples from (observes; changes nothing)."""

    def __init__(self, sampler):
        self.sampler, self.rows = sampler, []

    def __call__(self, logits, reqs):
        # Kept on the CPU, where the reference model runs, whatever the engine's device.
        self.rows.append((logits.detach().cpu().clone(), [r.request_id for r in reqs]))
        return self.sampler(logits, reqs)


# PyTorch ops only, the fast CPU configuration (oneDNN-packed weights, tierlm's kernels), and
# every step through the fixed-shape path a CUDA graph records (padded rows and tokens, scratch
# slots, one SDPA call; on CPU run eagerly).
@pytest.mark.parametrize("cpu_linear,cpu_kernels,graphs", [("plain", False, False), ("packed", True, False),
                                                           ("plain", False, True)], ids=["plain", "packed", "graphs"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match_transformers(arch, cpu_linear, cpu_kernels, graphs, checkpoints, hf_models):
    hf = hf_models[arch]
    llm = LLM(str(checkpoints[arch]), dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=20,
              load_progress=False, cpu_linear=cpu_linear, cpu_kernels=cpu_kernels, cuda_graphs=graphs)
    if cpu_linear == "packed":
        from tierlm.models.cpu_linear import PackedLinear
        assert isinstance(llm.engine.runner.model.layers[0].self_attn.qkv_proj, PackedLinear)
    cap = _Capture(llm.engine.sampler)
    llm.engine.sampler = cap
    prompt = _prompts(7, hf.config.get_text_config().vocab_size)[6]  # 64 tokens: 4 prefill chunks of <= 20
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    gen = out[0].outputs[0].token_ids
    full = torch.tensor([prompt + gen])
    with torch.no_grad():
        ref = hf(full).logits[0]
    ours = torch.cat([row for row, _ in cap.rows])  # one row per step: prefill end, then decodes
    expect = ref[len(prompt) - 1: len(prompt) - 1 + len(gen)]
    assert ours.shape == expect.shape
    assert (ours - expect).abs().max().item() < 1e-3
    if graphs:
        _assert_fixed_shape_steps_ran(llm, arch)
        # All 4 chunks and 5 decodes; an MoE model's one-token decodes stay eager.
        assert llm.engine.runner.graphs.steps == (4 if any(llm.engine.args.moe_layers) else llm.engine.steps)


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


SETTINGS = {
    "block16": dict(block_size=16, cpu_linear="plain"),
    "chunked": dict(block_size=16, max_num_batched_tokens=24, cpu_linear="packed"),
    "odd_block": dict(block_size=7, max_num_batched_tokens=40),
    "preempt": dict(block_size=8, max_num_batched_tokens=64, small_pool=True),
    # Fixed-shape steps (what a CUDA graph records), with prefill chunks small enough to use them too.
    # 16 rows cover the 9 prompts; fewer recorded decode shapes on a GPU.
    "graphs": dict(block_size=16, max_num_batched_tokens=40, max_num_seqs=16, cuda_graphs=True),
    # Speculative decoding: guesses from one-token matches (made at nearly every step), checked
    # as short chunks; accepted ones register their blocks for the prefix cache.
    "speculative": dict(block_size=4, max_num_batched_tokens=48,
                        speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1}),
    # ... and with preemptions, in a pool too small for all of them at once.
    "spec_preempt": dict(block_size=8, max_num_batched_tokens=64, small_pool=True,
                         speculative_config={"num_speculative_tokens": 5, "prompt_lookup_min": 1}),
}


@pytest.fixture(scope="module")
def hf_greedy_refs(hf_models):
    refs = {}
    for arch, hf in hf_models.items():
        refs[arch] = [_hf_greedy(hf, p, 12) for p in _prompts(9, hf.config.get_text_config().vocab_size)]
    return refs


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_token_identical(arch, setting, checkpoints, hf_models, hf_greedy_refs):
    kw = dict(SETTINGS[setting])
    small = kw.pop("small_pool", False)
    llm = LLM(str(checkpoints[arch]), dtype="float32", kv_cache_memory=8 << 20, load_progress=False, **kw)
    if small:
        # Rebuild with a pool that holds ~2.5 of the 9 sequences at their final length.
        per = kv_bytes_per_block(llm.engine.args, torch.float32, kw["block_size"])
        llm = LLM(str(checkpoints[arch]), dtype="float32", kv_cache_memory=per * 24, load_progress=False, **kw)
    prompts = _prompts(9, hf_models[arch].config.get_text_config().vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == hf_greedy_refs[arch]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    if small:
        assert llm.engine.scheduler.num_preemptions > 0
    if kw.get("speculative_config"):  # guesses were checked, and some kept
        stats = llm.engine.stats()
        assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    if kw.get("cuda_graphs"):
        _assert_fixed_shape_steps_ran(llm, arch)
    assert llm.engine.pool.num_used == 0


def _assert_fixed_shape_steps_ran(llm, arch: str) -> None:
    graphs = llm.engine.runner.graphs
    assert graphs.steps > 0 and graphs.enabled
    if any(llm.engine.args.moe_layers):  # every expert on every token, from experts / top-k tokens up
        args = llm.engine.args
        assert graphs.min_tokens == -(-args.num_experts // args.num_experts_per_tok) > 1


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "gpt_oss", "glm4_moe"])
def test_bf16_weights_and_kv_with_float32_compute(arch, checkpoints, hf_models):
    """The CPU fast path: bf16 weights and KV cache, float32 arithmetic (on this CPU through
    tierlm's bf16-weight kernels for linear layers and experts): HF on the same bf16-exact
    weights, its attention reading K/V rounded to bf16 as the cache stores them, gives the same
    logits at the prefill (which attends to its own keys as stored) and at every decode."""
    llm = LLM(str(checkpoints[arch]), dtype="bfloat16", compute_dtype="float32", kv_cache_memory=1 << 20,
              load_progress=False)
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    assert next(llm.engine.runner.model.parameters()).dtype == torch.float32
    hf = hf_models[arch]
    ref_model = type(hf)(copy.deepcopy(hf.config))  # its own config: the session's model keeps its attention
    # GLM-4.5's routers stay float32, unrounded, in a bf16 model (transformers' _keep_in_fp32_modules_strict).
    fp32 = getattr(ref_model, "_keep_in_fp32_modules_strict", None) or []
    ref_model.load_state_dict({k: v if any(m in k for m in fp32) else v.to(torch.bfloat16).float()
                               for k, v in hf.state_dict().items()})
    ref_model.set_attn_implementation(rounded_kv_attention(torch.bfloat16, eager=has_sinks(hf)))
    cap = _Capture(llm.engine.sampler)
    llm.engine.sampler = cap
    prompt = _prompts(3, hf.config.get_text_config().vocab_size)[2]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    with torch.no_grad():
        ref = ref_model.eval()(torch.tensor([prompt + out[0].outputs[0].token_ids])).logits[0]
    ours = torch.cat([row for row, _ in cap.rows])
    expect = ref[len(prompt) - 1: len(prompt) + 2]
    assert (ours - expect).abs().max().item() < 1e-3
    pure = LLM(str(checkpoints[arch]), dtype="bfloat16", compute_dtype="bfloat16", kv_cache_memory=1 << 20,
               load_progress=False)
    assert next(pure.engine.runner.model.parameters()).dtype == torch.bfloat16
    assert len(pure.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, ignore_eos=True))[0]
               .outputs[0].token_ids) == 3


# Each Qwen type windows its own layers: Qwen3-MoE every layer (it ignores layer_types), Qwen2-MoE the
# even ones below max_window_layers, or those layer_types names. Configs as transformers 5 saves them
# and as the hub ships them (no layer_types); prompts longer than the window of 8.
WINDOWED = {
    "qwen3_moe": ("qwen3_moe", {}, [8, 8, 8, 8]),
    "qwen3_moe_layer_types": ("qwen3_moe", {"layer_types": ["full_attention"] * 4}, [8, 8, 8, 8]),
    "qwen2_moe_hub": ("qwen2_moe", {"layer_types": None, "max_window_layers": 3}, [8, None, 8, None]),
    "qwen2_moe_layer_types": ("qwen2_moe", {"layer_types": ["full_attention", "full_attention", "sliding_attention",
                                                            "full_attention"]}, [None, None, 8, None]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(WINDOWED))
def test_moe_sliding_window_layers_match_transformers(case, tmp_path):
    import json

    from tests.conftest import _auto, build_checkpoint
    arch, edit, windows = WINDOWED[case]
    path = build_checkpoint(arch, tmp_path / case, num_hidden_layers=4, use_sliding_window=True, sliding_window=8)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(edit)
    cfg = {k: v for k, v in cfg.items() if not (k in edit and v is None)}  # None: leave the field out
    (path / "config.json").write_text(json.dumps(cfg))
    hf = _auto(arch).from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = _prompts(5, hf.config.vocab_size)[1:5:2]  # 17 and 48 tokens
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, block_size=4, load_progress=False)
    assert llm.engine.args.sliding_windows == windows
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 10) for p in prompts]


def _rewrite_weights(path, edit) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.slow
@pytest.mark.parametrize("stored", ["both_different", "lm_head_only"])
def test_tied_checkpoint_storing_lm_head_loads_as_transformers_does(stored, tmp_path, caplog):
    """tie_word_embeddings with a stored lm_head.weight: transformers keeps a different one untied
    (and warns), and ties the other way when the checkpoint has no embeddings."""
    from tests.conftest import _auto, build_checkpoint
    path = build_checkpoint("qwen2", tmp_path / stored)  # tie_word_embeddings: true, embeddings stored
    if stored == "both_different":
        _rewrite_weights(path, lambda t: t.update({"lm_head.weight": torch.randn_like(t["model.embed_tokens.weight"])}))
    else:
        _rewrite_weights(path, lambda t: t.update({"lm_head.weight": t.pop("model.embed_tokens.weight")}))
    hf = _auto("qwen2").from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = _prompts(3, hf.config.vocab_size)
    with caplog.at_level("WARNING", logger="tierlm.models.loader"):
        llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False)
    untied = [r.getMessage() for r in caplog.records if "untied" in r.getMessage()]
    assert len(untied) == (stored == "both_different") and all(str(path) in m for m in untied)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 10) for p in prompts]
