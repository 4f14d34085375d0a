"""Per-layer fp8 KV scales (`kv_cache_scales`): keys and values past fp8's range stored without
saturating, against transformers reading the same scaled rounding; a checkpoint's own scales
read under every name vLLM knows; calibration deterministic; bad scales refused."""
from __future__ import annotations

import logging
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.test_kv_dtype import GREEDY, _fp8_refs, _tokens_and_logits
from tests.models.test_parity import _hf_greedy, _prompts
from tierlm import LLM
from tierlm.config import EngineConfig
from tierlm.errors import ModelLoadError
from tierlm.models.kv_scales import HEADROOM, checkpoint_kv_scales, pow2_scale

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
KW = dict(dtype="float32", kv_cache_memory=8 << 20, load_progress=False)


@pytest.fixture(scope="module")
def large_kv_dir(tmp_path_factory):
    """Qwen2 (q/k/v biases) with its key and value projections x1000 and its query and output
    projections / 1000: float attention is unchanged, but keys and values reach the thousands,
    past e4m3's 448, as a trained model's outlier keys can."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import build_checkpoint
    out = build_checkpoint("qwen2", tmp_path_factory.mktemp("large_kv") / "qwen2")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            for t in (a.k_proj.weight, a.k_proj.bias, a.v_proj.weight, a.v_proj.bias):
                t.mul_(1000)
            for t in (a.q_proj.weight, a.q_proj.bias, a.o_proj.weight):
                t.div_(1000)
    model.save_pretrained(str(out))
    return out, model.eval()


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def _largest_stored(llm: LLM) -> float:
    return max(c.float().abs().max().item() for c in llm.engine.runner.kv_caches)


def test_keys_and_values_past_the_fp8_range_are_scaled_into_it(large_kv_dir):
    """Unscaled (vLLM's default without scales), e4m3 saturates those keys and values: the
    first logits of each prompt move by ~2-3 from the float32 cache's, and the answers are no
    longer the model's. Calibrated scales store them within range: the tokens of transformers
    reading the same scaled rounding, logits within fp8's rounding (~0.05-0.2) of float32's."""
    path, hf = large_kv_dir
    prompts = _prompts(6, hf.config.vocab_size)
    plain = LLM(str(path), **KW)
    unscaled = LLM(str(path), kv_cache_dtype="fp8", kv_cache_scales="checkpoint", **KW)
    scaled = LLM(str(path), kv_cache_dtype="fp8", **KW)
    assert all(k >= 8 and v >= 8 for k, v in scaled.engine.kv_scales)  # values in the thousands / 448 x 4
    firsts = {}
    for name, llm in (("plain", plain), ("unscaled", unscaled), ("scaled", scaled)):
        runs = [_tokens_and_logits(llm, p) for p in prompts]
        firsts[name] = (torch.stack([logits[0] for _, logits, _ in runs]), [tokens for tokens, _, _ in runs])
    assert _largest_stored(unscaled) == E4M3_MAX and _largest_stored(scaled) < E4M3_MAX
    err = {name: (firsts[name][0] - firsts["plain"][0]).abs().amax(dim=1) for name in ("unscaled", "scaled")}
    assert (err["unscaled"] > 1).all() and (err["scaled"] < err["unscaled"] / 5).all(), err
    assert sum(a == b for a, b in zip(firsts["unscaled"][1], firsts["plain"][1])) <= 1
    assert firsts["scaled"][1] == _fp8_refs(hf, scaled, prompts, 12)


def _with_scales(src, dst, scales: dict[str, torch.Tensor]):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    save_file({**load_file(str(f)), **scales}, str(f), metadata={"format": "pt"})
    return dst


def test_a_checkpoints_scales_are_read_and_attended_with(llama_dir, hf_models, tmp_path):
    """Scales that are no powers of two, as llm-compressor writes them (a 0-d and a 1-element
    tensor): kept as given (auto and checkpoint), the tokens of transformers reading the same
    rounding; `calibrate` measures its own; a float32 cache ignores them."""
    hf = hf_models["llama"]
    calibrated = LLM(str(llama_dir), kv_cache_dtype="fp8", **KW).engine.kv_scales
    given = [(k * 1.37, v * 0.71) for k, v in calibrated]
    tensors = {}
    for i, (k, v) in enumerate(given):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])
    path = _with_scales(llama_dir, tmp_path / "scaled", tensors)
    as_stored = [(float(torch.tensor(k)), float(torch.tensor(v))) for k, v in given]  # float32, as written
    prompts = _prompts(9, hf.config.vocab_size)
    for mode in ("auto", "checkpoint"):
        llm = LLM(str(path), kv_cache_dtype="fp8", kv_cache_scales=mode, max_num_batched_tokens=24, **KW)
        assert llm.engine.kv_scales == as_stored
        assert _generate(llm, prompts) == _fp8_refs(hf, llm, prompts, 12)
    assert LLM(str(path), kv_cache_dtype="fp8", kv_cache_scales="calibrate", **KW).engine.kv_scales == calibrated
    plain = LLM(str(path), **KW)
    assert plain.engine.kv_scales is None
    assert _generate(plain, prompts[:3]) == [_hf_greedy(hf, p, 12) for p in prompts[:3]]


def test_every_scale_name_vllm_reads(tmp_path, caplog):
    """kv_scale (both sides), k_proj / v_proj output_scale (older exports), behind a language-
    model prefix; a per-head tensor gives its largest; a layer without scales keeps 1.0 and is
    named in a warning."""
    f = tmp_path / "model.safetensors"
    save_file({"model.layers.0.self_attn.kv_scale": torch.tensor(0.25),
               "language_model.model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.5]),
               "language_model.model.layers.1.self_attn.v_proj.output_scale": torch.tensor([0.1, 0.3]),
               "model.layers.1.mlp.down_proj.weight": torch.zeros(2, 2)}, str(f))
    with caplog.at_level(logging.WARNING, logger="tierlm.models.kv_scales"):
        got = checkpoint_kv_scales([f], num_layers=3)
    assert got == [(0.25, 0.25), (0.5, float(torch.tensor(0.3))), (1.0, 1.0)]
    assert "k_scale of layer 2, v_scale of layer 2" in caplog.text
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2)}, str(f))
    assert checkpoint_kv_scales([f], num_layers=1) is None


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_a_scale_that_is_not_positive_and_finite_is_refused_by_name(llama_dir, tmp_path, bad):
    path = _with_scales(llama_dir, tmp_path / "bad", {"model.layers.1.self_attn.v_scale": torch.tensor(bad)})
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.1\.self_attn\.v_scale' in .* is not a "
                                             r"positive finite KV scale.*kv_cache_scales=calibrate"):
        LLM(str(path), kv_cache_dtype="fp8", **KW)
    assert LLM(str(path), kv_cache_dtype="fp8", kv_cache_scales="calibrate", **KW).engine.kv_scales is not None


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_calibrated_scales_are_the_smallest_power_of_two_leaving_the_headroom(dtype):
    top = torch.finfo(dtype).max
    for amax in (1e-4, 0.37, 1.0, 56.0, 112.0, 447.0, 1e3, 3e5):
        s = pow2_scale(amax, dtype)
        assert math.log2(s).is_integer()
        assert amax * HEADROOM / s <= top < amax * HEADROOM / (s / 2)
    assert [pow2_scale(a, dtype) for a in (0.0, float("nan"), float("inf"))] == [1.0, 1.0, 1.0]


def test_calibration_is_deterministic_and_only_fp8_caches_are_scaled(llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="tierlm.models.kv_scales")
    first = LLM(str(llama_dir), kv_cache_dtype="fp8", **KW).engine
    assert re.search(r"fp8 KV cache scales per layer, calibrated on \d+ tokens in [\d.]+ s: keys 2\^-?\d+",
                     caplog.text)
    assert LLM(str(llama_dir), kv_cache_dtype="fp8_e4m3", **KW).engine.kv_scales == first.kv_scales
    short = LLM(str(llama_dir), kv_cache_dtype="fp8", max_model_len=24, **KW)  # fewer positions than the text
    assert len(short.engine.kv_scales) == len(first.kv_scales)
    assert "calibrated on 24 tokens" in caplog.text
    assert [(a.self_attn.k_scale, a.self_attn.v_scale) for a in first.runner.model.layers] == first.kv_scales
    for name in ("auto", "bfloat16"):
        engine = LLM(str(llama_dir), kv_cache_dtype=name, kv_cache_scales="calibrate", **KW).engine
        assert engine.kv_scales is None
        assert all(a.self_attn.k_scale == a.self_attn.v_scale == 1.0 for a in engine.runner.model.layers)


@pytest.mark.parametrize("bad", ["none", "AUTO", "", None, 1.0])
def test_unknown_kv_cache_scales_are_refused_before_loading(bad):
    with pytest.raises(ValueError, match="kv_cache_scales must be one of auto, checkpoint, calibrate"):
        EngineConfig(model="/nonexistent", kv_cache_scales=bad).validate()
