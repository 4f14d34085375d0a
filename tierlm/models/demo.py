"""The built-in demo checkpoints: built locally, deterministically, no download.

Their weights are RANDOM (fixed seed), so their text is gibberish: they exist so that
`tierlm generate` and `tierlm serve` work on a fresh machine and exercise the whole stack
(sparse-MoE routing, paged KV, chat template, byte-level tokenizer covering all of UTF-8).
Serve a real model with `tierlm serve /path/to/hf-checkpoint`.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEMO_VERSION = "v2"
RANDOM_WEIGHTS_NOTICE = (
    "tierlm is serving its built-in demo model: its weights are RANDOM, so its output is gibberish. "
    "Give a real checkpoint instead: tierlm serve /path/to/hf-model-dir, tierlm generate --model DIR")

# ChatML with Hermes-style tool calls: tools are listed in the system turn and the model
# answers a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures in <tools></tools>:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each call, reply with <tool_call>{\"name\": <function-name>, \"arguments\": <args-json-object>}</tool_call>"
    "<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if message.tool_calls is defined and message.tool_calls %}"
    "{% for call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name if call.function is defined else call.name }}\", "
    "\"arguments\": {{ (call.function.arguments if call.function is defined else call.arguments) | tojson }}}\n</tool_call>{% endfor %}"
    "{% endif %}"
    "{% if not (loop.last and message['role'] == 'assistant' and continue_final_message is defined and continue_final_message) %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiered cache keeps hot blocks close to the device.
Hello, world! How are you today? I am fine, thank you. Multi-tenant inference serves many customers.
Paged attention stores keys and values in fixed-size blocks; continuous batching admits requests every step.
def main():\n    print("hello")\n    return 0\n
{"name": "get_weather", "arguments": {"city": "Paris"}}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2026-11-30
Français: où est la bibliothèque? Deutsch: Größe, Straße. Español: ¿qué tal? Русский: привет мир.
中文：你好，世界。日本語：こんにちは。한국어: 안녕하세요. Emoji: 🙂🚀✨
"""


def cache_root() -> Path:
    """$TIERLM_CACHE, or ~/.cache/tierlm (also when it is set but empty: Path("") is the cwd)."""
    return Path(os.environ.get("TIERLM_CACHE") or Path.home() / ".cache" / "tierlm")


def _synthetic_corpus(vocab_size: int) -> list[str]:
    """Deterministic pseudo-words, enough distinct ones for BPE to reach `vocab_size` merges
    (the fixed corpus alone stops near 650): every id of a large vocabulary then decodes to text."""
    if vocab_size <= 1024:
        return []
    import random
    rng = random.Random(1234)
    syll = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "qu", "ng"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(vocab_size * 3)]
    return [" ".join(words[i:i + 64]) for i in range(0, len(words), 64)]


def build_tokenizer(out_dir: Path, vocab_size: int = 1024):
    """Byte-level BPE (covers every UTF-8 string) trained on a small fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4 + _synthetic_corpus(vocab_size), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_demo_model(out_dir: Path, kind: str = "moe", seed: int = 0) -> Path:
    """Write a small random-weight checkpoint (+ tokenizer) to out_dir."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir)
    vocab = len(tok)
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  bos_token_id=None, eos_token_id=eos[0], pad_token_id=eos[1], tie_word_embeddings=False)
    if kind == "moe":
        cfg = Qwen2MoeConfig(intermediate_size=512, moe_intermediate_size=256, shared_expert_intermediate_size=512,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, **common)
        model = Qwen2MoeForCausalLM(cfg)
    elif kind == "dense":
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=768, **common))
    elif kind == "small":  # a fallback for the others (`tierlm bench sla`): same tokenizer, a fraction of the work
        model = LlamaForCausalLM(LlamaConfig(**{**common, "hidden_size": 128, "num_hidden_layers": 2,
                                                "num_attention_heads": 4, "num_key_value_heads": 2},
                                             intermediate_size=384))
    else:
        raise ValueError(f"unknown demo model kind '{kind}'; use 'moe', 'dense' or 'small'")
    _favour_printable_tokens(model, tok)
    model.save_pretrained(str(out_dir))
    GenerationConfig(eos_token_id=eos, pad_token_id=eos[1]).save_pretrained(str(out_dir))
    return out_dir


def _favour_printable_tokens(model, tok) -> None:
    """Scale up the output rows of tokens that decode to whole printable text (and the EOS rows
    down), so the random model's greedy text is readable gibberish rather than stray UTF-8 bytes."""
    import torch
    with torch.no_grad():
        w = model.lm_head.weight
        for tid in range(w.shape[0]):
            text = tok.decode([tid]) if tid < len(tok) else ""
            good = bool(text) and "\ufffd" not in text and text.isprintable() and tid not in tok.all_special_ids
            w[tid] *= 4.0 if good else 0.25


def ensure_demo_model(kind: str = "moe") -> Path:
    """Path of the cached demo checkpoint, building it on first use (atomically)."""
    target = cache_root() / "models" / f"demo-{kind}-{DEMO_VERSION}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    log.info("building the built-in %s demo model (random weights) in %s", kind, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".demo-{kind}-"))
    try:
        build_demo_model(tmp, kind)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
