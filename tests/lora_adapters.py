"""PEFT LoRA adapters for the tiny test checkpoints, built with peft itself (the reference)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import _auto

# What each adapter adapts, in the checkpoint's own module names (Phi-3 stores q/k/v and
# gate/up fused, so its adapters target the fused modules).
TARGETS = {
    "a1": (["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "a2": (["k_proj", "up_proj"], ["qkv_proj"]),
}


def build_adapter(base: Path, arch: str, out: Path, targets: list[str], r: int = 8, alpha: int = 16, seed: int = 1,
                  **config) -> Path:
    """A LoRA adapter with random A and B (peft's init_lora_weights=False: B is not zero, so the
    adapter changes what the model says), saved with peft's save_pretrained."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = _auto(arch).from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                  init_lora_weights=False, **config))
    peft_model.save_pretrained(str(out))
    return out


def standard_adapters(base: Path, arch: str, root: Path) -> dict[str, Path]:
    """a1: rank 8 on q, v, o, gate and down; a2: rank 4 on k and up, rsLoRA scaling."""
    fused = arch == "phi3"
    return {
        "a1": build_adapter(base, arch, root / "a1", TARGETS["a1"][fused], r=8, alpha=16, seed=1),
        "a2": build_adapter(base, arch, root / "a2", TARGETS["a2"][fused], r=4, alpha=8, seed=2, use_rslora=True),
    }


def peft_model(base: Path, arch: str, adapter: Path | None):
    """transformers' model on `base`, with the adapter applied by peft (None: the base alone)."""
    from peft import PeftModel
    model = _auto(arch).from_pretrained(str(base), dtype=torch.float32).eval()
    return PeftModel.from_pretrained(model, str(adapter)).eval() if adapter is not None else model


def greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()
