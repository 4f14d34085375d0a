"""LoRA adapters served on one base model: PEFT checkpoints loaded onto tierlm's fused layers,
applied per request inside a shared batch.

Many tenants' fine-tunes of one base cost one copy of the base weights: each adapter adds
rank × (in + out) numbers per adapted layer (r = 16 on a 7B model: ~40 MB), and a step mixes
requests of several adapters and of the base. Every adapted linear layer computes the base
projection for all rows, then adds, for each adapter present in the step, its low-rank delta
to that adapter's rows only: `(x[rows] @ A^T) @ B^T`, with PEFT's scaling (alpha / r, or
alpha / sqrt(r) under rsLoRA) folded into B at load time.

tierlm fuses q/k/v and gate/up into one projection each; an adapter's q_proj, k_proj and
v_proj (any subset) share one stacked A ([r_q + r_k + r_v, in]: one matmul for all three), and
each target's B adds into its own columns of the fused output (`BSlice`), so an adapter takes
exactly the memory of its checkpoint. Mapping names onto the fused layers is the loader's own
(`loader._target`): an adapter lands exactly where the base weights did.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from torch import nn

from tierlm.errors import ModelLoadError
from tierlm.models.config import ModelArgs
from tierlm.models.loader import _target

# PEFT settings that change what an adapter computes beyond A, B and a scaling: refused by name
# rather than served wrong. (Settings that only matter for training, such as dropout or the
# initialisation, are ignored.)
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "modules_to_save (fully trained copies of layers)",
    "lora_bias": "lora_bias (a trained bias on lora_B)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style transposed weights)",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. fused MoE experts)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "layer_replication": "layer_replication",
    "use_qalora": "QALoRA",
    "use_bdlora": "block-diagonal LoRA",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}
_PREFIX = "base_model.model."
_ADAPTER_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's handle for an adapter (`vllm.lora.request.LoRARequest`): a name requests use, an
    integer id (kept for vLLM compatibility; tierlm keys adapters by name) and the directory of
    a PEFT checkpoint (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class BSlice(NamedTuple):
    """One target's B in a fused projection: output rows [out_start, out_end) take
    h[:, col_start:col_end] @ b^T, where h = x @ A^T over the stacked A."""

    out_start: int
    out_end: int
    col_start: int
    col_end: int
    b: torch.Tensor  # [out_end - out_start, col_end - col_start], scaling folded in


@dataclass(eq=False)
class LoRAAdapter:
    """A loaded adapter: per adapted module (tierlm's name, e.g. "layers.3.self_attn.qkv_proj"),
    the stacked A [R, in] of its targets in that projection, and each target's scaled B."""

    name: str
    path: str
    rank: int  # the largest rank of any adapted module
    # SHA-256 of the adapter's config and weights as loaded: mixed into every KV block key of its
    # requests (equal adapters under two names share cached blocks; different ones never do).
    fingerprint: str
    weights: dict[str, tuple[torch.Tensor, tuple[BSlice, ...]]] = field(default_factory=dict)

    @property
    def num_parameters(self) -> int:
        return sum(a.numel() + sum(s.b.numel() for s in slices) for a, slices in self.weights.values())


class LoRAState:
    """What adapters the current step runs, shared by every adapted layer of one model: set by
    the runner around a forward, read by `LoRALinear`. `batch` is a list of (adapter, runs):
    the [start, end) runs of the flat batch's token rows that use it. The runner puts each
    adapter's rows together (decodes, then prefills), so an adapter has one or two runs and
    its delta is computed on slices, never on gathered copies."""

    def __init__(self) -> None:
        self.batch: list[tuple[LoRAAdapter, list[tuple[int, int]]]] | None = None


class LoRALinear(nn.Module):
    """A linear layer (nn.Linear or one of cpu_linear's packed forms) plus the low-rank deltas
    of the adapters in the step. With no adapter in the step it is the base layer alone (one
    attribute read more), so fixed-shape (CUDA-graph) steps record nothing of it."""

    def __init__(self, base: nn.Module, key: str, state: LoRAState, out_features: int) -> None:
        super().__init__()
        self.base = base
        self.key = key
        self.state = state
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if not batch:
            return y
        flat_x = x.reshape(-1, x.shape[-1])
        y = y if y.is_contiguous() else y.contiguous()
        flat_y = y.view(-1, y.shape[-1])  # (a view: the deltas land in y)
        for adapter, runs in batch:
            w = adapter.weights.get(self.key)
            if w is None:
                continue
            a, slices = w
            for start, end in runs:
                h = flat_x[start:end] @ a.t()
                rows = flat_y[start:end]
                for s in slices:
                    rows[:, s.out_start:s.out_end].addmm_(h[:, s.col_start:s.col_end], s.b.t())
        return y


# The projections an adapter can target, as tierlm names them (q/k/v and gate/up fused).
ADAPTABLE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def add_lora_layers(model: nn.Module) -> tuple[LoRAState, dict[str, LoRALinear]]:
    """Wrap the attention and MLP projections of every decoder layer (a MoE layer's shared
    expert included; not the embeddings, the LM head, routers or the routed experts' stacks)
    so adapters can be applied; returns the shared state and the wrappers by name."""
    state = LoRAState()
    wrapped: dict[str, LoRALinear] = {}
    for i, layer in enumerate(getattr(model, "layers", ())):
        for name, module in list(layer.named_modules()):
            if isinstance(module, LoRALinear):
                continue
            for child_name in ADAPTABLE:
                child = getattr(module, child_name, None)
                out = getattr(child, "out_features", None)
                if not isinstance(child, nn.Module) or isinstance(child, LoRALinear) or not isinstance(out, int):
                    continue
                key = f"layers.{i}.{name + '.' if name else ''}{child_name}"
                wrapped[key] = LoRALinear(child, key, state, out)
                setattr(module, child_name, wrapped[key])
    return state, wrapped


def _slice(where: tuple, out: int, args: ModelArgs) -> tuple[int, int]:
    """(start, size) of the output rows a target fills in a fused projection (as loader._copy)."""
    kind = where[0]
    if kind == "whole":
        return 0, out
    if kind == "qkv":
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        return [0, q, q + kv][where[1]], q if where[1] == 0 else kv
    if kind == "halves":
        return where[1] * (out // 2), out // 2
    raise ValueError(kind)


def _pattern_value(patterns: dict, module: str, default: float, path: Path) -> float:
    """PEFT's alpha_pattern lookup: a key (a regular expression) matches a module name's dotted
    suffix. The value must be a positive number, as lora_alpha must."""
    value = default
    try:
        for key, candidate in (patterns or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):
                value = candidate
                break
    except (re.error, TypeError, AttributeError) as e:
        raise ModelLoadError(f"LoRA adapter {path}: alpha_pattern cannot be read ({e})") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelLoadError(f"LoRA adapter {path}: the alpha for module '{module}' is {value!r}; lora_alpha and "
                             "alpha_pattern take positive numbers")
    return value


def read_adapter_config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"LoRA adapter {path}: no adapter_config.json; pass a PEFT adapter directory "
                             "(what peft's save_pretrained writes)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"LoRA adapter {path}: adapter_config.json cannot be read ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"LoRA adapter {path}: adapter_config.json is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"LoRA adapter {path}: peft_type is {cfg.get('peft_type')!r}; tierlm serves LoRA "
                             "adapters only")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ModelLoadError(f"LoRA adapter {path}: {what} is not supported (adapter_config.json sets {key}); "
                                 "merge the adapter into the base weights and serve that checkpoint instead")
    if cfg.get("bias", "none") != "none":
        raise ModelLoadError(f"LoRA adapter {path}: bias={cfg['bias']!r} (trained biases) is not supported; "
                             "merge the adapter into the base weights and serve that checkpoint instead")
    return cfg


def load_lora_adapter(name: str, path: str | Path, args: ModelArgs, layers: dict[str, LoRALinear],
                      device: torch.device, dtype: torch.dtype, max_rank: int) -> LoRAAdapter:
    """Read a PEFT LoRA checkpoint and lay it out for tierlm's layers (`layers`: the wrapped
    modules by name). Refuses, naming the cause, what it cannot serve exactly."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"LoRA adapter '{name}': {path} is not a directory; pass a PEFT adapter directory")
    cfg = read_adapter_config(path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ModelLoadError(f"LoRA adapter {path}: no adapter_model.safetensors (tierlm loads safetensors only; "
                             "save the adapter with safe_serialization=True)")
    raw = weights_file.read_bytes()
    try:
        tensors = load_safetensors(raw)
    except (SafetensorError, Exception) as e:  # a truncated file fails in several ways
        raise ModelLoadError(f"LoRA adapter {path}: adapter_model.safetensors is corrupt ({e})") from None
    digest = hashlib.sha256()
    digest.update(json.dumps(cfg, sort_keys=True).encode())
    digest.update(raw)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _ADAPTER_KEY.match(key)
        if m is None:
            raise ModelLoadError(f"LoRA adapter {path}: tensor '{key}' is not a lora_A/lora_B weight; tierlm "
                                 "serves plain LoRA (merge other trained weights into the base checkpoint)")
        pairs.setdefault(m.group("module"), {})[m.group("ab")] = tensor
    if not pairs:
        raise ModelLoadError(f"LoRA adapter {path}: adapter_model.safetensors holds no LoRA weights")
    alpha, rslora = cfg.get("lora_alpha", 8), bool(cfg.get("use_rslora"))
    parts: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for hf_module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ModelLoadError(f"LoRA adapter {path}: module '{hf_module}' has lora_{''.join(ab)} without its pair")
        short = hf_module[len(_PREFIX):] if hf_module.startswith(_PREFIX) else hf_module
        t = _target(short + ".weight", args.model_type, args.num_layers)  # by model type, as the loader maps
        key = t[0][: -len(".weight")] if t is not None and t[0].endswith(".weight") else None
        if t is None or key not in layers or t[1][0] == "expert":
            raise ModelLoadError(f"LoRA adapter {path}: module '{short}' cannot carry a LoRA in tierlm (adapted "
                                 "modules: attention and MLP projections of the decoder layers, not embeddings, the "
                                 "LM head or routed MoE experts)")
        a, b = ab["A"], ab["B"]
        r = a.shape[0] if a.ndim == 2 else 0
        layer = layers[key]
        in_features = getattr(layer.base, "in_features", None)
        start, size = _slice(t[1], layer.out_features, args)
        if (r < 1 or b.ndim != 2 or b.shape != (size, r) or (in_features is not None and a.shape[1] != in_features)
                or any(start < s + n and s < start + size for s, n, _, _ in parts.get(key, []))):
            raise ModelLoadError(f"LoRA adapter {path}: module '{short}' has lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)}, which do not fit the base model's layer ({in_features} in, "
                                 f"{size} out); was the adapter trained on another base model?")
        if r > max_rank:
            raise ModelLoadError(f"LoRA adapter {path}: module '{short}' has rank {r}, above max_lora_rank "
                                 f"{max_rank}; start the engine with a larger max_lora_rank")
        a_alpha = _pattern_value(cfg.get("alpha_pattern"), short, alpha, path)
        scaling = a_alpha / math.sqrt(r) if rslora else a_alpha / r
        parts.setdefault(key, []).append((start, size, a.float(), b.float() * scaling))
        rank = max(rank, r)
    weights = {}
    for key, pieces in parts.items():
        slices, col = [], 0
        for start, size, a, b in sorted(pieces, key=lambda p: p[0]):
            slices.append(BSlice(start, start + size, col, col + a.shape[0],
                                 b.to(device=device, dtype=dtype).contiguous()))
            col += a.shape[0]
        big_a = torch.cat([a for _, _, a, _ in sorted(pieces, key=lambda p: p[0])])
        weights[key] = (big_a.to(device=device, dtype=dtype).contiguous(), tuple(slices))
    return LoRAAdapter(name=name, path=str(path), rank=rank, fingerprint=digest.hexdigest(), weights=weights)
