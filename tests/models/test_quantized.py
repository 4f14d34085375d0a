"""FP8 checkpoints (quant_method fp8) load dequantized, as transformers loads them without FP8
kernels; other quantization methods are refused by name."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import _auto, build_checkpoint
from tierlm import LLM, SamplingParams
from tierlm.errors import ModelLoadError
from tierlm.models.quantized import Fp8Weights, dequantize

_LINEAR = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_proj|up_proj|down_proj|gate_up_proj|w1|w2|w3)"
                     r"\.weight$")


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 weight, float32 scales per block): each block's largest magnitude at 448."""
    (r, c), (bm, bn) = w.shape, block
    blocks = w.float().reshape(r // bm, bm, c // bn, bn)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    return (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(r, c), scale


def to_fp8(path: Path, block: tuple[int, int] = (16, 16), activation_scales: bool = False,
           shards: bool = False) -> Path:
    """Rewrite `path`'s linear weights as an FP8 checkpoint the way Qwen3-FP8's are laid out
    (`weight_scale_inv` beside each weight, `quantization_config` in config.json); embeddings,
    norms, routers and lm_head stay as they were. `shards`: weights and scales in different files."""
    tensors = load_file(path / "model.safetensors")
    weights, scales = {}, {}
    for name, w in tensors.items():
        if _LINEAR.match(name):
            weights[name], scales[name + "_scale_inv"] = _quantize(w, block)
            if activation_scales:
                scales[name.replace(".weight", ".input_scale")] = torch.tensor(0.02)
        else:
            weights[name] = w
    (path / "model.safetensors").unlink()
    parts = {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales} if shards \
        else {"model.safetensors": {**weights, **scales}}
    for file, part in parts.items():
        save_file(part, path / file, metadata={"format": "pt"})
    if shards:
        index = {"metadata": {}, "weight_map": {n: f for f, part in parts.items() for n in part}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                  "activation_scheme": "static" if activation_scales else "dynamic"}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,layout", [("llama", {}), ("qwen2_moe", {}), ("phi3", {}),
                                         ("mixtral", {"shards": True, "activation_scales": True})],
                         ids=["llama", "qwen2_moe", "phi3_fused", "mixtral_sharded_static"])
def test_fp8_checkpoint_gives_transformers_weights_and_tokens(arch, layout, tmp_path):
    """The dequantized weights equal transformers' bit for bit (fused qkv and gate/up, experts,
    scales in another shard, activation scales ignored), and so do greedy tokens."""
    path = to_fp8(build_checkpoint(arch, tmp_path / arch), **layout)
    hf = _auto(arch).from_pretrained(str(path)).eval()  # no FP8 kernels on a CPU: transformers dequantizes
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False, cpu_linear="plain")
    ours = llm.engine.runner.model.layers[0]
    attn = hf.model.layers[0].self_attn
    if arch == "phi3":
        assert torch.equal(ours.self_attn.qkv_proj.weight, attn.qkv_proj.weight)
    else:
        assert torch.equal(ours.self_attn.qkv_proj.weight,
                           torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(ours.self_attn.o_proj.weight, attn.o_proj.weight)
    quantized = load_file(next(path.glob("*.safetensors")))
    assert any(t.dtype == torch.float8_e4m3fn for t in quantized.values())  # (the checkpoint really is FP8)
    prompts = [list(range(5, 40)), [7, 3, 99, 12, 5, 60, 8]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 10) for p in prompts]


def test_dequantize_matches_a_per_element_reference():
    """Each element times the scale of its block: a grid that overhangs the weight (ceil
    division, as DeepSeek's and Qwen's 128 x 128 blocks do on dimensions that are no multiple),
    stacked experts, one scale for the whole tensor."""
    torch.manual_seed(0)
    w = (torch.randn(2, 10, 7) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, 2) + 0.5  # blocks of 4 x 4: 3 x 2 of them cover 10 x 7
    got = dequantize(w, s, Fp8Weights((4, 4)), "w")
    want = torch.empty(2, 10, 7)
    for e in range(2):
        for i in range(10):
            for j in range(7):
                want[e, i, j] = w[e, i, j].float() * s[e, i // 4, j // 4]
    assert torch.equal(got, want)
    assert torch.equal(dequantize(w[0], torch.tensor([0.25]), Fp8Weights((4, 4)), "w"), w[0].float() * 0.25)
    grid = torch.rand(5, 7)  # no block size given: read from the grid (10 x 7 in blocks of 2 x 1)
    assert torch.equal(dequantize(w[0], grid, Fp8Weights(None), "w"),
                       w[0].float() * grid.repeat_interleave(2, dim=0))
    with pytest.raises(ModelLoadError, match="2 x 2 scales do not cover a 10 x 7 weight"):
        dequantize(w[0], torch.rand(2, 2), Fp8Weights((4, 4)), "w")


def _edit(path: Path, tensors=None, quant=None) -> None:
    if tensors is not None:
        t = load_file(path / "model.safetensors")
        tensors(t)
        save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    if quant is not None:
        cfg = json.loads((path / "config.json").read_text())
        quant(cfg)
        (path / "config.json").write_text(json.dumps(cfg))


NAME = "model.layers.0.self_attn.q_proj.weight"
REFUSED = {
    "gptq": (lambda t: None, lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}),
             re.escape("quantized checkpoint (quant_method 'gptq'), which tierlm cannot load")),
    "no_method": (lambda t: None, lambda c: c.update(quantization_config={"bits": 4}),
                  re.escape("quantized checkpoint (quant_method None)")),
    "missing_scales": (lambda t: t.pop(NAME + "_scale_inv"), None,
                       f"tensor '{NAME}' in .* is torch.float8_e4m3fn but its scales .* are not in the checkpoint"),
    "fp8_undeclared": (None, lambda c: c.pop("quantization_config"),
                       "is torch.float8_e4m3fn but config.json declares no quantization_config"),
    "packed_experts": (lambda t: t.update({NAME: t[NAME].view(torch.int8)}), None,
                       "has scales .* but is torch.int8, not float8"),
    "wrong_grid": (lambda t: t.update({NAME + "_scale_inv": torch.ones(3, 3)}), None,
                   "3 x 3 scales do not cover a 64 x 64 weight"),
    "bad_block": (None, lambda c: c["quantization_config"].update(weight_block_size=[128]),
                  "weight_block_size must be two positive integers"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_checkpoints_that_would_load_as_garbage_are_refused_by_name(case, tmp_path):
    """A quantization tierlm does not read, FP8 weights without their scales, float8 tensors in
    a checkpoint that declares none, packed FP4 experts, scales that do not fit: each one a
    ModelLoadError naming what and where, not a model that answers in garbage."""
    tensors, quant, says = REFUSED[case]
    path = build_checkpoint("llama", tmp_path / case)
    if case not in ("gptq", "no_method"):
        to_fp8(path)
    _edit(path, tensors, quant)
    with pytest.raises(ModelLoadError, match=says):
        LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False)
