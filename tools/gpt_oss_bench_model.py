"""A gpt-oss-shaped random-weight checkpoint (180M parameters: 6 layers, 16 experts, 4 a token, sinks,
alternating 128-token windows) for `tierlm bench throughput --model DIR`: python tools/gpt_oss_bench_model.py DIR"""
import sys
from pathlib import Path

import torch
from transformers import GptOssConfig, GptOssForCausalLM

from tierlm.models.demo import build_tokenizer

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
tok = build_tokenizer(out)
torch.manual_seed(0)
cfg = GptOssConfig(vocab_size=len(tok) + 10, hidden_size=768, intermediate_size=768, num_hidden_layers=6,
                   num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_local_experts=16,
                   num_experts_per_tok=4, sliding_window=128, max_position_embeddings=4096,
                   rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0},
                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
m = GptOssForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(str(out))
print(sum(p.numel() for p in m.parameters()) / 1e6, "M params")
