"""OLMo 2 and 3 with config.json as the hub ships them (rope_theta and rope_scaling at the top,
no layer_types), read as transformers reads them. Both run through every test of
tests/models/test_parity.py with transformers 5's own layout."""
from __future__ import annotations

import json
import random

import pytest
import torch

from tests.conftest import build_checkpoint
from tests.models.test_parity import _hf_greedy
from tierlm import LLM, SamplingParams


def _hub_style(path, rope_theta: float, scaling: dict | None) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.pop("layer_types", None)
    cfg["rope_theta"] = rope_theta
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("arch,layers,windows", [
    ("olmo2", 2, [None, None]),
    # without layer_types: three sliding layers, then a full one; the sliding layers on
    # transformers' default base, not the top-level rope_theta (which the full layers take, with the YaRN)
    ("olmo3", 4, [12, 12, 12, None]),
])
def test_hub_config_layout_matches_transformers(arch, layers, windows, tmp_path):
    from transformers import AutoModelForCausalLM
    path = build_checkpoint(arch, tmp_path / arch, num_hidden_layers=layers)
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256} if arch == "olmo3" else None
    _hub_style(path, 20_000.0, scaling)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, block_size=4, load_progress=False)
    args = llm.engine.args
    assert args.sliding_windows == windows
    assert args.rope_theta == 20_000.0
    if arch == "olmo3":
        assert hf.config.rope_parameters["sliding_attention"]["rope_theta"] == args.local_rope_theta == 500_000.0
        assert args.rope_scaling["rope_type"] == "yarn"
    rng = random.Random(4)
    prompts = [[rng.randrange(hf.config.vocab_size - 10) for _ in range(n)] for n in (6, 41)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 8) for p in prompts]
