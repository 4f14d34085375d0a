"""MXFP4 checkpoints (gpt-oss's experts) read as transformers reads them with
`Mxfp4Config(dequantize=True)`: each `X_blocks` + `X_scales` one tensor `X`, bit for bit; what
transformers would not read either is refused by name."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.models.mxfp4_checkpoints import mxfp4_checkpoint, quantize_mxfp4, tierlm_tensors, tiny_gpt_oss
from tests.models.test_quantized import _edit
from tierlm.errors import ModelLoadError
from tierlm.models.loader import _quantized_index, weight_files
from tierlm.models.quantized import dequantize_mxfp4, quantization_of

_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (2, 6, 3, 16), (3, 40, 2, 16)])
def test_dequantize_equals_transformers_bit_for_bit(shape, dtype):
    """Every byte of blocks and every scale, the extremes too (0: 2^-127, subnormal in float32;
    254: 2^127, products past bf16's range; 255: infinite), give transformers' values, layout
    [E, G x 32, rows] and dtype."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors
    gen = torch.Generator().manual_seed(sum(shape))
    blocks = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 256, shape[:-1], generator=gen, dtype=torch.uint8)
    scales.view(-1)[:5] = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)[:scales.numel()]
    want = _convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize_mxfp4(blocks, scales, dtype, "t")
    assert got.dtype == want.dtype and got.shape == want.shape == (shape[0], shape[2] * 32, shape[1])
    assert torch.equal(got.view(_BITS[dtype]), want.view(_BITS[dtype]))  # bits: NaN, -0.0 and all


def test_quantizing_and_dequantizing_keeps_weights_within_fp4s_step():
    """The test helper's quantizer is the inverse of the layout: weights [E, cols, rows] come
    back where they were, each off by at most half a step of FP4 (2 at the top of 4..6) x scale."""
    w = torch.randn(2, 64, 96) * 0.02
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (2, 96, 2, 16) and scales.shape == (2, 96, 2)
    back = dequantize_mxfp4(blocks, scales, torch.float32, "t")
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1).transpose(1, 2)  # per value, [E, cols, rows]
    assert ((back - w).abs() <= step + 1e-9).all()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    return tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "bf16")


@pytest.mark.parametrize("dtype,layout", [(torch.bfloat16, {}), (torch.bfloat16, {"shards": True}),
                                          (torch.float32, {"random_bytes": True, "shards": True})],
                         ids=["bf16", "bf16_sharded", "fp32_random_bytes_sharded"])
def test_the_loader_reads_transformers_dequantized_parameters(gpt_oss, dtype, layout, tmp_path):
    """What tierlm's loader reads from an MXFP4 gpt-oss checkpoint (blocks and scales in one file
    or in different shards) is, name for name, transformers' parameters loaded with
    Mxfp4Config(dequantize=True): experts `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H]
    bit for bit in the model's dtype, and everything else as stored."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    path = mxfp4_checkpoint(gpt_oss, tmp_path / "mxfp4", **layout)
    hf = AutoModelForCausalLM.from_pretrained(str(path), quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=dtype)
    want = dict(hf.named_parameters())
    ours = tierlm_tensors(path, dtype)
    assert set(ours) == set(want)
    experts = [n for n in want if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 4 and want[GATE_UP].shape == (4, 64, 128)
    for name in experts:
        assert ours[name].dtype == dtype and torch.equal(ours[name], want[name].data), name
    for name in set(want) - set(experts):
        assert torch.equal(ours[name].to(dtype), want[name].data), name


def test_the_memory_estimate_counts_two_values_a_byte(gpt_oss, tmp_path):
    """The loaded size _quantized_index gives resolve_compute_dtype is the unquantized model's:
    each block byte two values, scales nothing."""
    want = sum(t.numel() for t in load_file(gpt_oss / "model.safetensors").values()) * 2  # bf16
    path = mxfp4_checkpoint(gpt_oss, tmp_path / "mxfp4", shards=True)
    quant = quantization_of(json.loads((path / "config.json").read_text()), str(path))
    assert quant.method == "mxfp4" and "FP4" in quant.stored_as()
    assert _quantized_index(weight_files(path), quant, torch.bfloat16)[1] == want


@pytest.mark.parametrize("shards", [False, True], ids=["one_file", "sharded"])
def test_a_config_naming_no_dtype_takes_the_weights_dtype_as_transformers_does(gpt_oss, shards, tmp_path):
    """OpenAI's gpt-oss config.json names no dtype: dtype 'auto' is then the stored weights'
    (bf16 beside the MXFP4 experts), as transformers' is, not float32 (twice the memory, which
    an H100 has not for gpt-oss-20b dequantized)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from tierlm.models.loader import load_model
    path = mxfp4_checkpoint(gpt_oss, tmp_path / "mxfp4", shards=shards)
    cfg = json.loads((path / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        cfg.pop(key, None)
    (path / "config.json").write_text(json.dumps(cfg))
    if not shards:  # transformers reads the first file only: blocks alone there, it refuses dtype uint8
        hf = AutoModelForCausalLM.from_pretrained(str(path), quantization_config=Mxfp4Config(dequantize=True))
        assert hf.dtype == torch.bfloat16
    loaded = load_model(path, torch.device("cpu"), "auto", progress=False, compute_dtype="bfloat16")
    assert loaded.kv_dtype == torch.bfloat16  # the dtype the weights load in (and the KV cache's default)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def _blocks_as(t: dict, name: str) -> None:  # a bf16 q_proj stored as MXFP4, where transformers reads none
    w = t.pop(name).unsqueeze(0)
    t[name.removesuffix(".weight") + "_blocks"], t[name.removesuffix(".weight") + "_scales"] = quantize_mxfp4(w)


MXFP4_REFUSED = {
    "blocks_without_scales": (lambda t: t.pop(GATE_UP + "_scales"), None,
                              f"tensor '{GATE_UP}_blocks' in .* holds MXFP4 blocks but their scales .* are not"),
    "scales_without_blocks": (lambda t: t.pop(GATE_UP + "_blocks"), None,
                              f"holds MXFP4 scales '{GATE_UP}_scales' but not their blocks"),
    "scales_that_do_not_fit": (lambda t: t.update({GATE_UP + "_scales": t[GATE_UP + "_scales"][:, :-1].clone()}),
                               None,
                               r"MXFP4 blocks \[4, 128, 2, 16\] with scales \[4, 127, 2\] do not fit"),
    "blocks_not_of_32": (lambda t: t.update({GATE_UP + "_blocks": t[GATE_UP + "_blocks"][..., :8].contiguous()}), None,
                         r"MXFP4 blocks \[4, 128, 2, 8\] with scales \[4, 128, 2\] do not fit"),
    "scales_not_bytes": (lambda t: t.update({GATE_UP + "_scales": t[GATE_UP + "_scales"].float()}), None,
                         "MXFP4 blocks' scales must be uint8 E8M0 exponents, not torch.float32"),
    "float8_in_mxfp4": (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.float8_e4m3fn)}),
                        None, "tensor 'model.norm.weight' in .* is torch.float8_e4m3fn, which quant_method 'mxfp4' "
                              "does not store"),
    "not_an_expert": (lambda t: _blocks_as(t, "model.layers.0.self_attn.q_proj.weight"), None,
                      re.escape("tensor 'model.layers.0.self_attn.q_proj_") + ".*which tierlm cannot load "
                      r"\(as transformers, it reads MXFP4 only for MoE experts'"),
    "undeclared": (None, lambda c: c.pop("quantization_config"),
                   r"experts\.(gate_up|down)_proj_(blocks|scales).* declares no quantization_config"),
}


@pytest.mark.parametrize("case", list(MXFP4_REFUSED))
def test_mxfp4_checkpoints_that_would_load_as_garbage_are_refused_by_name(gpt_oss, case, tmp_path):
    """Blocks without their scales (or scales without blocks), shapes that are no MXFP4 experts,
    MXFP4 where transformers dequantizes none (it reads only experts' gate_up_proj and
    down_proj), MXFP4 in a checkpoint that declares no quantization: each a ModelLoadError naming
    the tensor and the fix."""
    tensors, config, says = MXFP4_REFUSED[case]
    path = mxfp4_checkpoint(gpt_oss, tmp_path / case)
    _edit(path, tensors, config)
    with pytest.raises(ModelLoadError, match=says):
        tierlm_tensors(path, torch.bfloat16)


@pytest.mark.parametrize("q", [{"quant_method": "modelopt", "quant_algo": "NVFP4"}, {"quant_method": "fp_quant"}])
def test_other_fp4_methods_are_still_refused_naming_what_loads(q):
    with pytest.raises(ModelLoadError, match=f"quant_method {q['quant_method']!r}.*'fp8', 'compressed-tensors' "
                                             r"\(.*\) or 'mxfp4' \(gpt-oss's FP4 experts\)"):
        quantization_of({"quantization_config": q}, "m")
