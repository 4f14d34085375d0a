"""Load a local Hugging Face checkpoint directory into tierlm's fused modules.

Reads config.json, single-file or sharded safetensors (model.safetensors.index.json),
and generation_config.json. Never touches the network. Every failure names the file and
what to do, because a half-loaded model would only fail later and more obscurely.
"""
from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from tierlm.errors import ModelLoadError
from tierlm.models.config import ModelArgs, load_config_dict, parse_config
from tierlm.models.kv_scales import KV_SCALE_NAME
from tierlm.models.llama import CausalLM
from tierlm.models.moe import keep_routers_in_fp32
from tierlm.models.quantized import (MXFP4_BLOCKS, MXFP4_SCALES, PACKED_SUFFIX, QuantizedWeights, check_mxfp4_name,
                                     dequantize, dequantize_mxfp4, is_activation_scale, is_quantized, part_of,
                                     quantization_of, weight_name)
from tierlm.models.registry import ARCHITECTURES, resolve_architecture

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: CausalLM
    args: ModelArgs
    dtype: torch.dtype  # weights / activations (compute)
    device: torch.device
    eos_token_ids: list[int]
    generation_defaults: dict
    kv_dtype: torch.dtype | None = None  # KV cache storage (the requested dtype; the engine applies kv_cache_dtype)

    def __post_init__(self) -> None:
        if self.kv_dtype is None:
            self.kv_dtype = self.dtype


_FP32_FASTER: dict[torch.dtype, bool] = {}


def cpu_prefers_fp32(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies float32 matrices clearly faster than `dtype` ones.

    On CPUs without AMX, PyTorch's bf16/fp16 GEMMs often run at about half the float32 rate,
    so computing in float32 (weights upcast once, KV cache kept in `dtype`) is faster and no
    less accurate. Measured once per process on a layer-sized GEMM rather than guessed.
    """
    if dtype not in _FP32_FASTER:
        import torch.nn.functional as F
        from tierlm.models.cpu_linear import time_ratio

        x, w = torch.randn(128, 1024), torch.randn(2048, 1024)
        xd, wd = x.to(dtype), w.to(dtype)
        with torch.inference_mode():
            _FP32_FASTER[dtype] = time_ratio(lambda: F.linear(x, w), lambda: F.linear(xd, wd)) < 1 / 1.3
    return _FP32_FASTER[dtype]


def _available_ram() -> int:
    import os
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def resolve_compute_dtype(compute: str | torch.dtype, dtype: torch.dtype, device: torch.device,
                          weight_bytes: int = 0) -> torch.dtype:
    if isinstance(compute, torch.dtype):
        return compute
    if compute == "auto":
        upcast_bytes = weight_bytes * 4 // max(1, torch.empty((), dtype=dtype).element_size())
        fits = upcast_bytes + weight_bytes < 0.5 * _available_ram()  # float32 copy + bf16 decode copy
        if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and fits and cpu_prefers_fp32(dtype):
            log.info("this CPU runs float32 GEMMs faster than %s ones: computing in float32, KV cache in %s "
                     "(set compute_dtype to force one)", dtype, dtype)
            return torch.float32
        return dtype
    if compute not in _DTYPES:
        raise ModelLoadError(f"compute_dtype '{compute}' is not supported; use auto or one of {', '.join(_DTYPES)}")
    return _DTYPES[compute]


def resolve_dtype(dtype: str | torch.dtype, args: ModelArgs, device: torch.device,
                  model_dir: Path | None = None) -> torch.dtype:
    """The model's dtype; 'auto': config.json's, else (given the checkpoint's `model_dir`) its
    first floating-point weight's, as transformers' dtype='auto' reads it."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        stored = args.torch_dtype or (stored_dtype(weight_files(model_dir)) if model_dir is not None else None)
        chosen = _DTYPES.get(str(stored), torch.float32)
        if chosen == torch.float16 and device.type == "cpu":
            log.info("checkpoint is float16; using bfloat16 on CPU (faster, same range as float32; "
                     "its weights lose 3 bits of mantissa: give dtype float16 to keep them exact)")
            chosen = torch.bfloat16
        return chosen
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype '{dtype}' is not supported; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


# safetensors' names of the floating-point dtypes a model takes (float8 weights are quantized ones).
_STORED_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def stored_dtype(files: list[Path]) -> str | None:
    """The dtype of the checkpoint's first floating-point tensor (float8 and FP4 bytes skipped),
    which transformers' dtype='auto' takes when config.json names none: OpenAI's gpt-oss configs
    name none, and their bf16 weights beside the MXFP4 experts make it bf16 there, not float32
    (twice the memory once the experts are dequantized)."""
    for f in files:  # transformers reads the first file only; one of MXFP4 blocks alone has no float
        with _weights_file(f) as st:
            for name in st.keys():
                if (kind := st.get_slice(name).get_dtype()) in _STORED_FLOATS:
                    return _STORED_FLOATS[kind]
    return None


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is corrupt ({type(e).__name__}: {e}); re-export the checkpoint") from None
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise ModelLoadError(f"{index} is corrupt (its weight_map is not an object of tensor name to file name); "
                                 "re-export the checkpoint")
        names = sorted(set(weight_map.values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {model_dir}; tierlm loads safetensors only "
            "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))")
    return files


_EXPERT = re.compile(r"^(layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERT = re.compile(r"^(layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")


# GPT-OSS's experts and router (transformers' layout: gate_up_proj [E, H, 2I] with gate and up
# interleaved column by column, down_proj [E, I, H], biases beside them).
_GPT_OSS_MOE = re.compile(r"^(layers\.\d+)\.mlp\.(?:experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)"
                          r"|router\.(weight|bias))$")
# Checkpoint tensors that fill their parameter alone, rearranged on the way (see `_copy`).
_SINGLE = frozenset({"whole", "transposed", "interleaved"})
# tierlm's parameters that the checkpoint names otherwise (`_target` maps them), by model type:
# a missing one is named as the checkpoint would hold it (b13 is in no gpt-oss checkpoint).
_STORED_AS = {
    "gpt_oss": {".mlp.w13": ".mlp.experts.gate_up_proj", ".mlp.b13": ".mlp.experts.gate_up_proj_bias",
                ".mlp.w2": ".mlp.experts.down_proj", ".mlp.b2": ".mlp.experts.down_proj_bias",
                ".mlp.gate.weight": ".mlp.router.weight", ".mlp.gate.bias": ".mlp.router.bias"},
    "glm4_moe": {".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"},
}


_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_LANGUAGE_MODEL = ("language_model.model.", "model.language_model.", "language_model.")


_LAYER = re.compile(r"^layers\.(\d+)\.")


def _target(name: str, model_type: str = "", num_layers: int | None = None) -> tuple[str, object] | None:
    """Map an HF tensor name to (tierlm parameter, where in it). None = ignore."""
    if name.startswith(_VISION):
        return None  # a multimodal checkpoint's vision side: tierlm serves its language model
    for prefix in _LANGUAGE_MODEL:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.startswith("model."):
        name = name[len("model."):]
    if "rotary_emb" in name or KV_SCALE_NAME.match(name):
        return None  # computed; fp8 KV scales are read by models/kv_scales.py
    if model_type == "glm4_moe":
        if num_layers is not None and (m := _LAYER.match(name)) and int(m.group(1)) >= num_layers:
            return None  # GLM-4.5's multi-token-prediction layer after the last one (transformers skips it too)
        name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.").replace(
            ".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
    if model_type == "gpt_oss" and (m := _GPT_OSS_MOE.match(name)):
        layer, expert, router = m.groups()
        if router is not None:
            return f"{layer}.mlp.gate.{router}", ("whole",)
        return {"gate_up_proj": (f"{layer}.mlp.w13", ("interleaved", True)),
                "gate_up_proj_bias": (f"{layer}.mlp.b13", ("interleaved", False)),
                "down_proj": (f"{layer}.mlp.w2", ("transposed",)),
                "down_proj_bias": (f"{layer}.mlp.b2", ("whole",))}[expert]
    if m := _EXPERT.match(name):
        layer, e, w = m.group(1), int(m.group(2)), m.group(3)
        if w in ("w2", "down_proj"):
            return f"{layer}.mlp.w2", ("expert", e, None)
        return f"{layer}.mlp.w13", ("expert", e, 0 if w in ("w1", "gate_proj") else 1)
    if m := _FUSED_EXPERT.match(name):
        return f"{m.group(1)}.mlp.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}", ("whole",)
    name = name.replace(".block_sparse_moe.", ".mlp.")
    name = name.replace(".mlp.gate.weight", ".mlp.gate.weight")
    for proj, shard in (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)):
        if f".self_attn.{proj}." in name:
            return name.replace(proj, "qkv_proj"), ("qkv", shard)
    for proj, shard in (("gate_proj", 0), ("up_proj", 1)):
        if f".{proj}." in name:
            return name.replace(proj, "gate_up_proj"), ("halves", shard)
    return name, ("whole",)


def _copy(param: torch.Tensor, where: tuple, tensor: torch.Tensor, args: ModelArgs,
          round_to: torch.dtype | None = None, label: str = "tensor") -> None:
    """Copy checkpoint `tensor` (`label`: its name and file, for errors) into its part of `param`."""
    kind = where[0]
    if kind == "transposed":  # [E, I, H] -> tierlm's [E, H, I]
        dst, tensor = param, tensor.transpose(-1, -2)
    elif kind == "interleaved":  # gate, up, gate, up, ... -> all gates, then all ups
        if where[1]:  # gate_up_proj [E, H, 2I] -> tierlm's [E, 2I, H]
            tensor = tensor.transpose(-1, -2)
        dst = param
        if tensor.dim() >= 2 and tensor.shape[1] % 2 == 0:  # otherwise the shape check below names it
            tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
    elif kind == "whole":
        dst = param
    elif kind == "qkv":
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        start = [0, q, q + kv][where[1]]
        dst = param.narrow(0, start, q if where[1] == 0 else kv)
    elif kind == "halves":
        half = param.shape[0] // 2
        dst = param.narrow(0, where[1] * half, half)
    else:  # expert
        _, e, shard = where
        if e >= param.shape[0]:
            key = {"mixtral": "num_local_experts", "glm4_moe": "n_routed_experts"}.get(args.model_type, "num_experts")
            raise ModelLoadError(f"{label} is expert {e}, but config.json's {key} is {param.shape[0]} "
                                 f"(experts 0-{param.shape[0] - 1}); config.json does not match the weights")
        dst = param[e]
        if shard is not None:
            half = dst.shape[0] // 2
            dst = dst.narrow(0, shard * half, half)
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"shape mismatch: {label} has shape {tuple(tensor.shape)}, the model expects "
                             f"{tuple(dst.shape)}; config.json does not match the weights")
    # Weights take the requested dtype's precision even when computed in a wider one.
    dst.copy_(tensor.to(round_to) if round_to is not None else tensor)


_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "halves": ("gate_proj", "up_proj")}
_EXPERT_NAMES = {"w1": ("w1", "w3", "w2"), "gate_proj": ("gate_proj", "up_proj", "down_proj")}


def _unfilled(pname: str, parts: dict[tuple, str], param: torch.Tensor, model_type: str = "") -> list[str]:
    """The checkpoint tensors that parameter `pname` still lacks, named as the checkpoint names
    the parts it has (`parts`: where in the parameter -> which tensor filled it), or as
    `model_type`'s checkpoints name the parameter where none of it was loaded (_STORED_AS).

    tierlm fuses q/k/v, gate/up and every expert into one parameter each: that one of a
    parameter's parts was loaded says nothing of the others, and a part never loaded is
    uninitialised memory (the model would run, on garbage)."""
    if any(where[0] in _SINGLE for where in parts):
        return []
    if not parts:
        renames = _STORED_AS.get(model_type, {})
        return [next((pname.removesuffix(ours) + theirs for ours, theirs in renames.items() if pname.endswith(ours)),
                     pname)]
    where, seen = next(iter(parts.items()))
    kind = where[0]
    if kind in _PARTS:
        names = _PARTS[kind]
        return [seen.replace(f".{names[where[1]]}.", f".{names[i]}.") for i in range(len(names))
                if (kind, i) not in parts]
    m = re.search(r"experts\.\d+\.(\w+)\.weight$", seen)
    family = _EXPERT_NAMES["w1" if m.group(1) in ("w1", "w2", "w3") else "gate_proj"]
    shards = (0, 1) if pname.endswith("w13") else (None,)
    return [f"{seen[:m.start()]}experts.{e}.{family[2 if s is None else s]}.weight"
            for e in range(param.shape[0]) for s in shards if ("expert", e, s) not in parts]


_TIED = {"lm_head.weight": "embed_tokens.weight", "embed_tokens.weight": "lm_head.weight"}


def _untie_if_different(model: CausalLM, params: dict[str, torch.nn.Parameter], pname: str, tensor: torch.Tensor,
                        round_to: torch.dtype | None, model_dir: Path) -> None:
    """A tied checkpoint that stores both embeddings and lm_head: transformers ties them only if
    they are equal, else it warns and keeps the stored lm_head. Called with the second of the two
    (`tensor`, for `pname`), while the shared parameter holds the first."""
    shared = params[pname]
    if tuple(shared.shape) != tuple(tensor.shape):
        return  # _copy names the mismatch
    # `tensor` is as read (on the CPU), `shared` already on the engine's device.
    stored = (tensor.to(round_to) if round_to is not None else tensor).to(device=shared.device, dtype=shared.dtype)
    if torch.equal(shared, stored):
        return
    head = shared.detach().clone() if pname == "embed_tokens.weight" else torch.empty_like(shared)
    model.lm_head.weight = torch.nn.Parameter(head, requires_grad=shared.requires_grad)
    params["lm_head.weight"] = model.lm_head.weight
    model.args.tie_word_embeddings = False
    log.warning("%s: config.json ties lm_head to the embeddings (tie_word_embeddings), but the checkpoint stores "
                "a different lm_head.weight; using it untied, as transformers does (set tie_word_embeddings to "
                "false in config.json to silence this)", model_dir)


def check_model_dir(model_dir: str | Path) -> Path:
    """The checkpoint directory as a Path, or a ModelLoadError saying it is not there."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist; pass a local Hugging Face checkpoint directory")
    return model_dir


def load_model(model_dir: str | Path, device: torch.device, dtype: str | torch.dtype = "auto",
               max_positions: int | None = None, progress: bool = True,
               compute_dtype: str | torch.dtype | None = None, cpu_linear: str = "auto",
               cpu_kernels: bool = True) -> LoadedModel:
    model_dir = check_model_dir(model_dir)
    cfg = load_config_dict(model_dir)
    arch = resolve_architecture(cfg)
    args = parse_config(cfg, arch)
    quant = quantization_of(cfg, str(model_dir))
    kv_dtype = resolve_dtype(dtype, args, device, model_dir)
    files = weight_files(model_dir)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    if quant is not None:
        parts, weight_bytes = _quantized_index(files, quant, kv_dtype)
    else:
        weight_bytes = sum(f.stat().st_size for f in files)
    torch_dtype = resolve_compute_dtype(compute_dtype or kv_dtype, kv_dtype, device, weight_bytes)
    max_positions = max_positions or args.max_position_embeddings
    with torch.device("meta"):
        model = ARCHITECTURES[arch](args, max_positions)
    model = model.to_empty(device=device).to(torch_dtype)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.build_rope(max_positions, device)  # buffers, not weights: computed, not loaded
    fp32 = keep_routers_in_fp32(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, dict[tuple, str]] = {}  # parameter -> the parts of it the checkpoint filled -> by which tensor
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
               desc=f"Loading {model_dir.name}", disable=not progress)
    round_to = kv_dtype if kv_dtype != torch_dtype else None
    with torch.no_grad():
        for name, tensor, label in checkpoint_tensors(files, quant, parts, kv_dtype,
                                                      wanted=lambda n: _target(n, args.model_type,
                                                                               args.num_layers) is not None,
                                                      done=lambda f: bar.update(f.stat().st_size)):
            pname, where = _target(name, args.model_type, args.num_layers)
            if pname not in params:
                raise ModelLoadError(f"unexpected {label} for {arch}; is config.json from the same checkpoint?")
            with _failing_as(label):
                if args.tie_word_embeddings and pname in _TIED and _TIED[pname] in loaded:
                    _untie_if_different(model, params, pname, tensor, round_to, model_dir)
                _copy(params[pname], where, tensor, args, None if pname in fp32 else round_to, label)
            loaded.setdefault(pname, {})[where] = name
    bar.close()
    if args.tie_word_embeddings and "lm_head.weight" in loaded:  # tied, stored as lm_head only: transformers loads it
        loaded.setdefault("embed_tokens.weight", loaded["lm_head.weight"])
    missing = [m for n, p in params.items() if not (n == "lm_head.weight" and args.tie_word_embeddings)
               for m in _unfilled(n, loaded.get(n, {}), p, args.model_type)]
    if missing:
        which = f"tensor {missing[0]}" if len(missing) == 1 else f"{len(missing)} tensors, e.g. {', '.join(missing[:3])}"
        raise ModelLoadError(f"checkpoint in {model_dir} lacks {which}; "
                             "the weights are incomplete or belong to another model")
    model.eval()
    if quant is not None:
        log.info("%s: %s weights (%s) dequantized to %s as they loaded: memory and speed are the unquantized "
                 "model's (no low-precision kernels)", model_dir.name, quant.method, quant.stored_as(), torch_dtype)
    if device.type == "cpu" and torch_dtype == torch.float32 and cpu_linear != "plain":
        from tierlm.models.cpu_linear import add_bf16_decode_path, pack_linears, packing_pays_off
        if kv_dtype == torch.bfloat16 and cpu_linear == "auto" and cpu_kernels:
            n = add_bf16_decode_path(model)
            if n:
                log.info("%d linear layers / expert stacks keep bf16 weights for decode batches (tierlm CPU kernel)",
                         n)
        if cpu_linear == "packed" or packing_pays_off():
            log.info("packed %d linear layers for oneDNN (faster float32 GEMMs on this CPU)", pack_linears(model))
    gen = _generation_config(model_dir)
    eos = list(dict.fromkeys(args.eos_token_ids + _as_list(gen.get("eos_token_id"))))
    return LoadedModel(model, args, torch_dtype, device, eos, gen, kv_dtype=kv_dtype)


def checkpoint_tensors(files: list[Path], quant: QuantizedWeights | None, parts: dict[str, dict[str, torch.Tensor]],
                       dtype: torch.dtype, wanted: Callable[[str], bool] | None = None,
                       done: Callable[[Path], None] | None = None) -> Iterator[tuple[str, torch.Tensor, str]]:
    """The checkpoint's weights as (name, tensor, label), named as transformers names the
    parameters they load into, those stored quantized dequantized to `dtype`; `label` names the
    stored tensor and its file, for errors.

    `X.weight_packed` (packed ints) is `X.weight`; MXFP4 `X_blocks` + `X_scales` is `X`, in
    transformers' dequantized layout (gpt-oss: `experts.gate_up_proj` [E, H, 2I], `experts.down_proj`
    [E, I, H]). Parts (scales, zero points: `parts`, from _quantized_index) and activation scales
    are not weights and not yielded. `wanted(name)`: read this one (a multimodal checkpoint's
    vision tower is not read at all); `done(file)`: after each file (a progress bar)."""
    seen: set[str] = set()
    for f in files:
        with _weights_file(f) as st:
            for stored in st.keys():
                if part_of(stored) is not None or is_activation_scale(stored):
                    if quant is None:
                        raise ModelLoadError(f"{f.name} holds quantization scales ('{stored}') but config.json "
                                             "declares no quantization_config; re-export the checkpoint")
                    continue  # read beforehand (a weight's), or not used (quantized activations')
                name = weight_name(stored)
                seen.add(name)
                if wanted is not None and not wanted(name):
                    continue
                tensor = st.get_tensor(stored)
                label = f"tensor '{stored}' in {f}"
                if name in parts or is_quantized(tensor):
                    with _failing_as(label):
                        tensor = _dequantized(tensor, parts.get(name), quant, label, dtype)
                yield name, tensor, label
        if done is not None:
            done(f)
    if quant is not None and quant.method == "mxfp4" and (orphans := sorted(set(parts) - seen)):
        raise ModelLoadError(f"checkpoint holds MXFP4 scales '{orphans[0]}{MXFP4_SCALES}' but not their blocks "
                             f"'{orphans[0]}{MXFP4_BLOCKS}'; re-export the checkpoint")


@contextmanager
def _failing_as(label: str) -> Iterator[None]:
    """Whatever goes wrong loading a tensor, a ModelLoadError saying which tensor of which file."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load {label} ({type(e).__name__}: {e}); re-export the checkpoint") from e


@contextmanager
def _weights_file(f: Path) -> Iterator:
    """`f` open for reading tensors; its damage (or a read that fails) as a ModelLoadError."""
    try:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            yield st
    except SafetensorError as e:
        raise ModelLoadError(f"{f} is corrupt or truncated ({e}); re-download or re-export it") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {f} ({e})") from None


def _quantized_index(files: list[Path], quant: QuantizedWeights,
                     dtype: torch.dtype) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """One pass over a quantized checkpoint's files before its weights load: each weight's parts
    (scales, zero points, packed shapes) by the weight's name, read first since a shard may hold
    a weight's parts and another the weight (they are small beside the weights: one per block,
    channel or group; a bf16 scale per 4-bit group of 128 is ~3%), and the weights' size once
    loaded in `dtype`, from the headers: each value at `dtype`'s size, `32 / bits` of them per
    packed int32 word. Not the file size scaled by bits: its unquantized tensors (embeddings,
    lm_head, norms) load at their size, and parts and activation scales not at all."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    values = 0
    for f in files:
        with _weights_file(f) as st:
            for name in st.keys():
                if quant.method == "mxfp4" and st.get_slice(name).get_dtype() == "U8":  # MXFP4 is bytes
                    check_mxfp4_name(name, str(f))
                if (found := part_of(name)) is not None:
                    parts.setdefault(found[0], {})[found[1]] = st.get_tensor(name)
                elif not is_activation_scale(name):
                    numel = math.prod(st.get_slice(name).get_shape())
                    if name.endswith(PACKED_SUFFIX):
                        numel = numel * 32 // quant.bits
                    elif weight_name(name) != name and name.endswith(MXFP4_BLOCKS):
                        numel *= 2  # two FP4 values a byte
                    values += numel
    return parts, values * torch.empty((), dtype=dtype).element_size()


def _dequantized(tensor: torch.Tensor, parts: dict[str, torch.Tensor] | None, quant: QuantizedWeights | None,
                 label: str, dtype: torch.dtype) -> torch.Tensor:
    """A weight stored quantized (float8, integers, FP4 bytes), or with scales, multiplied back
    (in `dtype`). Read as it is, or without its scales, it would load as garbage."""
    if quant is None:
        raise ModelLoadError(f"{label} is {tensor.dtype} but config.json declares no quantization_config; "
                             "re-export the checkpoint with its quantization_config")
    if quant.method == "mxfp4":  # in `dtype` itself, as transformers computes them (not float32, then rounded)
        return dequantize_mxfp4(tensor, (parts or {}).get("scale"), dtype, label)
    return dequantize(tensor, parts or {}, quant, label).to(dtype)


def _as_list(v) -> list[int]:
    if v is None:
        return []
    return [int(v)] if isinstance(v, int) else [int(x) for x in v]


def _generation_config(model_dir: Path) -> dict:
    p = model_dir / "generation_config.json"
    if not p.is_file():
        return {}
    try:
        gen = json.loads(p.read_text())
    except json.JSONDecodeError:
        log.warning("%s is not valid JSON; ignoring it", p)
        return {}
    if not isinstance(gen, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(gen), "a number")
        log.warning("%s is not a JSON object (it holds %s); ignoring it", p, kind)
        return {}
    return gen
