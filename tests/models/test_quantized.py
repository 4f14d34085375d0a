"""Quantized checkpoints (quant_method fp8 and compressed-tensors) load dequantized, as
transformers loads them without kernels for them; what would load as garbage is refused by name."""
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
from tierlm.models.quantized import QuantizedWeights, dequantize, unpack_int32

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


FP8 = QuantizedWeights("fp8", "weight_scale_inv", frozenset({torch.float8_e4m3fn}), (4, 4))


def test_dequantize_matches_a_per_element_reference():
    """Each element times the scale of its block: a grid that overhangs the weight (ceil
    division, as DeepSeek's and Qwen's 128 x 128 blocks do on dimensions that are no multiple),
    stacked experts, one scale for the whole tensor, a grid of another layout than the block."""
    torch.manual_seed(0)
    w = (torch.randn(2, 10, 7) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, 2) + 0.5  # blocks of 4 x 4: 3 x 2 of them cover 10 x 7
    got = dequantize(w, {"scale": s}, FP8, "w")
    want = torch.empty(2, 10, 7)
    for e in range(2):
        for i in range(10):
            for j in range(7):
                want[e, i, j] = w[e, i, j].float() * s[e, i // 4, j // 4]
    assert torch.equal(got, want)
    assert torch.equal(dequantize(w[0], {"scale": torch.tensor([0.25])}, FP8, "w"), w[0].float() * 0.25)
    rows = torch.rand(10, 1)  # one per output channel, whatever the configured block
    assert torch.equal(dequantize(w[0], {"scale": rows}, FP8, "w"), w[0].float() * rows)
    with pytest.raises(ModelLoadError, match="a 2 x 3 grid does not cover a 10 x 7 weight"):
        dequantize(w[0], {"scale": torch.rand(2, 3)}, FP8, "w")


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_unpacking_reverses_compressed_tensors_packing(bits):
    """Densely packed values (straddling words where the width does not divide 32), rows of a
    count that fills no whole word, back to the signed values compressed-tensors packed."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    torch.manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    values = torch.randint(lo, hi + 1, (3, 37), dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_to_int32(values, bits), bits, 37), values.to(torch.int16))
    packed_rows = pack_to_int32(values, bits, packed_dim=0)  # (zero points: packed along the rows)
    assert torch.equal(unpack_int32(packed_rows.T.contiguous(), bits, 3).T, values.to(torch.int16))


def _edit(path: Path, tensors=None, quant=None) -> None:
    if tensors is not None:
        t = load_file(path / "model.safetensors")
        tensors(t)
        save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    if quant is not None:
        cfg = json.loads((path / "config.json").read_text())
        quant(cfg)
        (path / "config.json").write_text(json.dumps(cfg))


NAME = "model.layers.0.self_attn.q_proj.weight"  # (its parts: NAME + "_scale", ...)
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
                       "has scales .* but is torch.int8, which quant_method 'fp8' as configured does not store"),
    "wrong_grid": (lambda t: t.update({NAME + "_scale_inv": torch.ones(3, 3)}), None,
                   "a 3 x 3 grid does not cover a 64 x 64 weight"),
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


def _compressed_group(kind: str, bits: int, strategy: str, symmetric: bool = True, group: int | None = None,
                      block: list[int] | None = None, static_inputs: bool = False, int8_inputs: bool = False) -> dict:
    weights = {"num_bits": bits, "type": kind, "strategy": strategy, "symmetric": symmetric, "dynamic": False,
               "group_size": group, "block_structure": block, "actorder": None}
    inputs = {"num_bits": 8, "type": kind, "strategy": "tensor" if static_inputs else "token", "symmetric": True,
              "dynamic": not static_inputs} if bits == 8 or int8_inputs else None
    return {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "output_activations": None}


def _scales_of(w: torch.Tensor, args: dict, top: float) -> torch.Tensor:
    """One scale per tensor, output channel, group of columns or block (the largest magnitude at `top`)."""
    r, c = w.shape
    a = w.abs()
    if args["strategy"] == "tensor":
        m = a.amax().reshape(1)
    elif args["strategy"] == "channel":
        m = a.amax(dim=1, keepdim=True)
    elif args["strategy"] == "group":
        m = a.reshape(r, c // args["group_size"], args["group_size"]).amax(dim=-1)
    else:
        bm, bn = args["block_structure"]
        padded = torch.nn.functional.pad(a, (0, -c % bn, 0, -r % bm))
        m = padded.reshape(-(-r // bm), bm, -(-c // bn), bn).amax(dim=(1, 3))
    return m.clamp(min=1e-6) / top


def to_compressed_tensors(path: Path, fmt: str, group: dict, dtype: torch.dtype = torch.bfloat16,
                          experts: tuple[str, dict] | None = None) -> Path:
    """Rewrite `path` as compressed-tensors would save it (llm-compressor's output): linear
    weights quantized per `group`'s weight args (packed into int32 with compressed-tensors' own
    packer for `pack-quantized`), scales in `dtype` (the model's, which the rest is cast to);
    routers and lm_head left unquantized, as recipes ignore them. `experts`: the MoE experts'
    own (format, group), a `mixed-precision` checkpoint (Kimi's FP8 attention, INT4 experts)."""
    out = {}
    for name, w in load_file(path / "model.safetensors").items():
        if not _LINEAR.match(name):
            out[name] = w.to(dtype)
        else:
            out.update(_compressed(name[:-len(".weight")], w, *(experts if experts and ".experts." in name
                                                                  else (fmt, group)), dtype))
    (path / "model.safetensors").unlink()
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
    groups = {"group_0": group}
    if experts is not None:
        groups = {"group_0": {**group, "format": fmt},
                  "group_1": {**experts[1], "targets": ["re:.*experts.*"], "format": experts[0]}}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors",
                                  "format": fmt if experts is None else "mixed-precision",
                                  "quantization_status": "compressed", "kv_cache_scheme": None,
                                  "sparsity_config": {}, "transform_config": {},  # (as compressed-tensors writes)
                                  "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"],
                                  "config_groups": groups}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _compressed(stem: str, w: torch.Tensor, fmt: str, group: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weight `stem`.weight's tensors as compressed-tensors saves them."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    args = group["weights"]
    bits, kind = args["num_bits"], args["type"]
    out = {}
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if kind == "float":
        s = _scales_of(w, args, 448.0).to(dtype)
        q = (w / _expand(s.float(), w.shape)).to(torch.float8_e4m3fn)
        zp = None
    elif args["symmetric"]:
        s = _scales_of(w, args, float(hi)).to(dtype)
        q = torch.round(w / _expand(s.float(), w.shape)).clamp(lo, hi).to(torch.int8)
        zp = None
    else:  # asymmetric: the group's [min, max] onto [lo, hi]
        r, c = w.shape
        g = args["group_size"]
        mn, mx = w.reshape(r, c // g, g).amin(-1).clamp(max=0), w.reshape(r, c // g, g).amax(-1).clamp(min=0)
        s = ((mx - mn) / (hi - lo)).clamp(min=1e-6).to(dtype)
        zp = (lo - torch.round(mn / s.float())).clamp(lo, hi).to(torch.int8)
        q = torch.round(w / _expand(s.float(), w.shape) + _expand(zp.float(), w.shape)).clamp(lo, hi).to(torch.int8)
    if fmt == "pack-quantized":
        out[stem + ".weight_packed"] = pack_to_int32(q, bits)
        out[stem + ".weight_shape"] = torch.tensor(w.shape)
    else:
        out[stem + ".weight"] = q
    out[stem + ".weight_scale"] = s
    if zp is not None:
        out[stem + ".weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0) if fmt == "pack-quantized" else zp
    if group["input_activations"] is not None and not group["input_activations"]["dynamic"]:
        out[stem + ".input_scale"] = torch.tensor([0.02], dtype=dtype)
    return out


def _expand(s: torch.Tensor, shape) -> torch.Tensor:
    """Per-tensor / per-row / per-group / per-block values over a 2-D weight (blocks cut to it)."""
    r, c = shape
    if s.numel() == 1:
        return s.reshape(())
    gr, gc = s.shape
    br, bc = -(-r // gr), -(-c // gc)
    return s.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]


COMPRESSED = {
    "fp8_dynamic": ("llama", "float-quantized", _compressed_group("float", 8, "channel")),
    "fp8_block": ("qwen3", "float-quantized", _compressed_group("float", 8, "block", block=[16, 48])),
    "w8a8_int_static": ("phi3", "int-quantized", _compressed_group("int", 8, "channel", static_inputs=True)),
    "w4a16": ("llama", "pack-quantized", _compressed_group("int", 4, "group", group=16)),
    "w4a16_asym": ("qwen2", "pack-quantized", _compressed_group("int", 4, "group", symmetric=False, group=32)),
    "w8a16_tensor": ("granite", "pack-quantized", _compressed_group("int", 8, "tensor")),
    # W4A8 (4-bit weights, int8 activations): compressed-tensors picks int-quantized, one int8 per 4-bit value
    "w4a8_int": ("llama", "int-quantized", _compressed_group("int", 4, "group", group=16, int8_inputs=True)),
    "moe_w4a16": ("qwen2_moe", "pack-quantized", _compressed_group("int", 4, "group", group=16)),
    "moe_fp8": ("mixtral", "float-quantized", _compressed_group("float", 8, "channel")),
    "qwen3_moe_w4a16": ("qwen3_moe", "pack-quantized", _compressed_group("int", 4, "group", group=16)),
    "moe_mixed_fp8_int4": ("qwen2_moe", "float-quantized", _compressed_group("float", 8, "channel"),
                           ("pack-quantized", _compressed_group("int", 4, "group", group=16))),
}


@pytest.mark.parametrize("case", list(COMPRESSED))
def test_compressed_tensors_checkpoint_gives_transformers_weights_and_tokens(case, tmp_path):
    """compressed-tensors checkpoints as llm-compressor writes them (FP8 per channel and per
    block, INT8 with static activation scales, 4-bit ints one per int8 (W4A8), 4-bit groups
    packed into int32 with and without zero points, 8-bit packed per tensor, FP8 attention beside
    INT4 experts (mixed-precision); bf16 scales): the weights equal what transformers'
    compressed-tensors decompressor gives, bit for bit, and so do greedy tokens."""
    from transformers import CompressedTensorsConfig
    arch, fmt, group, *experts = COMPRESSED[case]
    path = to_compressed_tensors(build_checkpoint(arch, tmp_path / arch), fmt, group, experts=next(iter(experts), None))
    hf = _auto(arch).from_pretrained(str(path), dtype=torch.float32,
                                     quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    hf = hf.float()  # (transformers leaves packed experts in the scales' dtype, bf16: computed in it, not in float32)
    with torch.no_grad():  # in the checkpoint's dtype, as its weights are (dense layers' already are: transformers
        for param in hf.parameters():  # rounds their products to the scales' dtype; it leaves FP8 experts' in
            param.copy_(param.to(torch.bfloat16))  # the dtype asked for, here float32)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False, cpu_linear="plain")
    ours = llm.engine.runner.model.layers[0]
    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    if arch == "phi3":
        assert torch.equal(ours.self_attn.qkv_proj.weight, attn.qkv_proj.weight)
        assert torch.equal(ours.mlp.gate_up_proj.weight, mlp.gate_up_proj.weight)
    else:
        assert torch.equal(ours.self_attn.qkv_proj.weight,
                           torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    if hasattr(mlp, "experts"):  # (transformers stacks each layer's experts as tierlm does)
        assert torch.equal(ours.mlp.w13, mlp.experts.gate_up_proj)
        assert torch.equal(ours.mlp.w2, mlp.experts.down_proj)
    elif arch != "phi3":
        assert torch.equal(ours.mlp.gate_up_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    if not hasattr(mlp, "experts"):
        assert torch.equal(ours.mlp.down_proj.weight, mlp.down_proj.weight)
    prompts = [list(range(5, 40)), [7, 3, 99, 12, 5, 60, 8]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 10) for p in prompts]


def _group_edit(**weights):
    return lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)


CT_REFUSED = {
    "nvfp4": (None, lambda c: c["quantization_config"].update(format="nvfp4-pack-quantized"),
              "compressed-tensors format 'nvfp4-pack-quantized', which tierlm cannot load"),
    "mixed_nvfp4_group": (None, lambda c: (c["quantization_config"].update(format="mixed-precision"),
                                           c["quantization_config"]["config_groups"]["group_0"].update(
                                               format="nvfp4-pack-quantized")),
                          "format 'nvfp4-pack-quantized' of a mixed-precision group, which tierlm cannot load"),
    "frozen": (None, lambda c: c["quantization_config"].update(quantization_status="frozen"),
               "weights in status 'frozen', not 'compressed'"),
    "actorder_group": (None, _group_edit(actorder="group"), "activation-ordered groups"),
    "g_idx": (lambda t: t.update({NAME + "_g_idx": torch.zeros(64, dtype=torch.int32)}), None,
              f"tensor '{NAME}_packed' in .* has a g_idx"),
    "float4": (None, _group_edit(type="float"), "4-bit float weights in format 'pack-quantized'"),
    "token_strategy": (None, _group_edit(strategy="token"), "weight strategy 'token'"),
    "no_shape": (lambda t: t.pop(NAME + "_shape"), None, "packed weights without their weight_shape"),
    "sparse_24_bitmask": (None, lambda c: c["quantization_config"].update(
        sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"]}),
        "compressed-tensors sparsity format 'sparse-24-bitmask' .*, which tierlm cannot load"),
    # zero points whose words cannot hold a row each: unpacked short, they spread as a smaller grid over other blocks
    "zero_points_short": (lambda t: t.update({NAME + "_zero_point": torch.zeros(1, 4, dtype=torch.int32)}), None,
                          re.escape("zero points [1, 4] are not 64 rows of 4-bit values packed into int32 words")),
    "zero_points_flat": (lambda t: t.update({NAME + "_zero_point": torch.zeros(1, dtype=torch.int32)}), None,
                         re.escape("zero points [1] are not 64 rows")),
    "online_transform": (None, lambda c: c["quantization_config"].update(transform_config={"config_groups": {"u": {
        "type": "random-hadamard", "apply": [{"targets": ["Linear"], "location": "weight_input", "inverse": True},
                                             {"targets": ["Linear"], "location": "input"}]}}}),
        "transforms applied at run time .*location 'input'"),
    "short_words": (lambda t: t.update({NAME + "_packed": t[NAME + "_packed"][:, :3].contiguous()}), None,
                    re.escape("[64, 3] words of 4-bit values cannot hold a [64, 64] weight")),
}


@pytest.mark.parametrize("case", list(CT_REFUSED))
def test_compressed_tensors_checkpoints_tierlm_cannot_read_are_refused_by_name(case, tmp_path):
    tensors, quant, says = CT_REFUSED[case]
    path = to_compressed_tensors(build_checkpoint("llama", tmp_path / case), "pack-quantized",
                                 _compressed_group("int", 4, "group", group=16))
    _edit(path, tensors, quant)
    with pytest.raises(ModelLoadError, match=says):
        LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False)


@pytest.mark.parametrize("config", [
    {"format": "dense", "config_groups": {}},
    {"sparsity_config": {"format": "dense", "sparsity_structure": "2:4"}},  # pruned, stored dense: no format
    {"format": "dense", "transform_config": {"config_groups": {"r1": {"type": "hadamard", "apply": [  # folded in
        {"targets": ["Linear"], "location": "weight_input"}, {"targets": ["Linear"], "location": "weight_output"}]}}}},
], ids=["dense", "sparse_stored_dense", "offline_transforms"])
def test_a_dense_compressed_tensors_checkpoint_loads_as_it_is(config, tmp_path):
    """Format `dense`, or a sparsity config stored dense and no quantization: the weights are
    stored unquantized (a scheme for the KV cache only, a pruned model, say); rotations folded
    into the weights (SpinQuant's R1, R2) need nothing at run time."""
    path = build_checkpoint("llama", tmp_path / "dense")
    plain = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False)
    _edit(path, None, lambda c: c.update(quantization_config={"quant_method": "compressed-tensors", **config}))
    dense = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 30))}
    assert dense.generate(prompt, sp)[0].outputs[0].token_ids == plain.generate(prompt, sp)[0].outputs[0].token_ids


@pytest.mark.parametrize("fmt,group", [("pack-quantized", _compressed_group("int", 4, "group", group=16)),
                                       ("float-quantized", _compressed_group("float", 8, "channel"))],
                         ids=["w4a16", "fp8"])
def test_the_memory_estimate_is_the_dequantized_models_size(fmt, group, tmp_path, monkeypatch):
    """What resolve_compute_dtype weighs (the float32 upcast: does it fit?) is the model's size
    once loaded, as for an unquantized checkpoint: not the file scaled by 16 / bits, which counts
    the bf16 embeddings and lm_head (a fifth of an 8B model, most of a tiny one) 4 times over in a
    4-bit checkpoint, and the scales as weights."""
    import tierlm.models.loader as loader
    path = build_checkpoint("llama", tmp_path / "m")
    want = sum(t.numel() for t in load_file(path / "model.safetensors").values()) * 2  # bf16, as loaded
    to_compressed_tensors(path, fmt, group)
    seen = []
    real = loader.resolve_compute_dtype
    monkeypatch.setattr(loader, "resolve_compute_dtype", lambda *a: seen.append(a[3]) or real(*a))
    LLM(str(path), dtype="bfloat16", kv_cache_memory=4 << 20, load_progress=False)
    assert seen == [want]


def test_fp8_scales_stored_as_e8m0_exponents_are_powers_of_two(tmp_path):
    """MXFP8 checkpoints store each block's scale as a uint8 exponent e (scale 2^(e - 127)), as
    transformers reads them; multiplying by the byte itself made weights hundreds of times too large."""
    path = to_fp8(build_checkpoint("llama", tmp_path / "e8m0"))
    _edit(path, lambda t: t.update({n: (torch.log2(s).round() + 127).to(torch.uint8)
                                    for n, s in list(t.items()) if n.endswith("_scale_inv")}))
    hf = _auto("llama").from_pretrained(str(path)).eval()
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False, cpu_linear="plain")
    ours = llm.engine.runner.model.layers[0].self_attn.o_proj.weight
    assert torch.equal(ours, hf.model.layers[0].self_attn.o_proj.weight)
    prompt = list(range(5, 40))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == _hf_greedy(hf, prompt, 10)


def test_fp8_kv_cache_scales_load_beside_quantized_weights(tmp_path):
    """llm-compressor's FP8 weights with a kv_cache_scheme: the weights dequantize as without it
    and each layer's k_scale / v_scale reach the fp8 KV cache (models/kv_scales.py)."""
    path = to_compressed_tensors(build_checkpoint("llama", tmp_path / "kv"), "float-quantized",
                                 _compressed_group("float", 8, "channel"))
    given = [(0.05, 0.03), (0.1, 0.02)]
    _edit(path, lambda t: t.update({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(s)
                                    for i, pair in enumerate(given) for n, s in zip("kv", pair)}),
          lambda c: c["quantization_config"].update(kv_cache_scheme={
              "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}))
    kw = dict(dtype="float32", kv_cache_memory=4 << 20, load_progress=False, cpu_linear="plain")
    fp8 = LLM(str(path), kv_cache_dtype="fp8", kv_cache_scales="checkpoint", **kw)
    assert fp8.engine.kv_scales == [(float(torch.tensor(k)), float(torch.tensor(v))) for k, v in given]
    plain = LLM(str(path), **kw)
    assert torch.equal(fp8.engine.runner.model.layers[0].self_attn.qkv_proj.weight,
                       plain.engine.runner.model.layers[0].self_attn.qkv_proj.weight)


def test_serve_refuses_an_unreadable_quantized_checkpoint_in_one_line(tmp_path):
    """`tierlm serve` on a checkpoint tierlm cannot read: exit status 2 and one error line naming
    the reason, as for any ModelLoadError, not a traceback or a server that answers garbage."""
    import subprocess
    import sys
    from tests.serving.test_cli import free_port
    path = to_compressed_tensors(build_checkpoint("llama", tmp_path / "nvfp4"), "pack-quantized",
                                 _compressed_group("int", 4, "group", group=16))
    _edit(path, None, CT_REFUSED["nvfp4"][1])
    proc = subprocess.run([sys.executable, "-m", "tierlm.cli", "serve", str(path), "--device", "cpu", "--port",
                           str(free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert "compressed-tensors format 'nvfp4-pack-quantized', which tierlm cannot load" in proc.stderr


@pytest.mark.parametrize("fmt,kind,bits", [("pack-quantized", "int", 2), ("pack-quantized", "int", 3),
                                           ("pack-quantized", "int", 8), ("int-quantized", "int", 4),
                                           ("naive-quantized", "int", 8), ("float-quantized", "float", 8)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_equals_compressed_tensors_decompressor(fmt, kind, bits, scale_dtype):
    """Every strategy (blocks overhanging a 40 x 72 weight), symmetric or with zero points (packed
    along the rows for channels and groups), scales in each float dtype: what compressed-tensors'
    own compressor writes, read back as its decompressor reads it, bit for bit."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from tierlm.models.quantized import quantization_of
    torch.manual_seed(bits)
    w = (torch.randn(40, 72) * 0.05 + 0.01).to(scale_dtype)
    for strategy, symmetric in [(s, sym) for s in ("tensor", "channel", "group", "block") for sym in (True, False)
                                if sym or kind == "int"]:
        weights = {"num_bits": bits, "type": kind, "strategy": strategy, "symmetric": symmetric,
                   "group_size": 24 if strategy == "group" else None,
                   "block_structure": [16, 32] if strategy == "block" else None}
        args = QuantizationArgs(**weights)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        scale, zero = calculate_qparams(*_ranges(w.float(), weights), args)
        state = {"weight": w, "weight_scale": scale.to(scale_dtype),
                 "weight_zero_point": None if symmetric else torch.round(zero).to(torch.int8)}
        compressor = BaseCompressor.get_value_from_registry(fmt)
        stored = compressor.compress(state, scheme)
        want = compressor.decompress(dict(stored), scheme)["weight"]
        cfg = {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {
            "g": {"targets": ["Linear"], "weights": weights}}}}
        parts = {k.removeprefix("weight_"): v for k, v in stored.items() if k not in ("weight", "weight_packed")}
        got = dequantize(stored.get("weight", stored.get("weight_packed")), parts, quantization_of(cfg, "w"), "w")
        assert torch.equal(got.to(want.dtype), want), (strategy, symmetric)


def _ranges(w: torch.Tensor, args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor's, each output channel's, group's or block's (min, max)."""
    r, c = w.shape
    if args["strategy"] == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args["strategy"] == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args["strategy"] == "group":
        g = w.reshape(r, c // args["group_size"], args["group_size"])
        return g.amin(-1), g.amax(-1)
    bm, bn = args["block_structure"]
    b = torch.nn.functional.pad(w, (0, -c % bn, 0, -r % bm))
    b = b.reshape(b.shape[0] // bm, bm, b.shape[1] // bn, bn)
    return b.amin((1, 3)), b.amax((1, 3))


def test_the_load_log_names_what_the_weights_are_stored_as(tmp_path, caplog):
    """FP8 attention beside 4-bit packed experts: both named (the log said '4-bit' for all)."""
    import logging
    path = to_compressed_tensors(build_checkpoint("qwen2_moe", tmp_path / "m"), "float-quantized",
                                 _compressed_group("float", 8, "channel"),
                                 experts=("pack-quantized", _compressed_group("int", 4, "group", group=16)))
    with caplog.at_level(logging.INFO, logger="tierlm.models.loader"):
        LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False)
    assert "compressed-tensors weights (float8, 4-bit ints packed in int32) dequantized to" in caplog.text


@pytest.mark.parametrize("arch,name", [("llama", "lm_head"), ("qwen3", "model.embed_tokens")],
                         ids=["lm_head", "tied_embeddings"])
def test_a_quantized_lm_head_or_embedding_gives_transformers_weights_and_tokens(arch, name, tmp_path):
    """Recipes that quantize lm_head or the embeddings (targets Embedding; tied to lm_head in
    Qwen3): dequantized as the linear layers are, both ends equal transformers'."""
    from transformers import CompressedTensorsConfig
    group = _compressed_group("int", 8, "channel")
    path = to_compressed_tensors(build_checkpoint(arch, tmp_path / arch), "int-quantized", group)
    _edit(path, lambda t: t.update(_compressed(name, t.pop(name + ".weight").float(), "int-quantized", group,
                                              torch.bfloat16)),
          lambda c: c["quantization_config"].update(ignore=[], config_groups={"group_0": {
              **group, "targets": ["Linear", "Embedding"]}}))
    assert load_file(path / "model.safetensors")[name + ".weight"].dtype == torch.int8
    hf = _auto(arch).from_pretrained(str(path), dtype=torch.float32,
                                     quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(param.to(torch.bfloat16))
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False, cpu_linear="plain")
    ours = llm.engine.runner.model
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(ours.embed_tokens.weight, hf.model.embed_tokens.weight)
    prompt = list(range(5, 40))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == _hf_greedy(hf, prompt, 10)
