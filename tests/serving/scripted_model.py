"""Scripted models: real Llama checkpoints whose answers are written into their weights.

A random-weight model cannot be made to write `<tool_call>...</tool_call>`, to end on EOS at a
chosen point or to stream a known text, yet the serving tests need all of that end to end. A
scripted model is an ordinary one-layer Llama checkpoint (HF format, with the demo tokenizer and
its ChatML + Hermes chat template) that the real engine loads and runs like any other; only its
weights are set by hand, so that decoding follows a script:

- the next token is a function of the last ORDER (3) tokens. A reply is keyed by the last
  tokens of the prompt that asks for it; every chat prompt ends with the same assistant header,
  so a model gives one answer to every chat request (other replies can hang off other prompt
  endings: an assistant prefill, a plain completion prompt);
- the residual stream holds [current token one-hot | the one-hot of the token 1 back | 2 back |
  a constant 1 | next-token slots]. The embedding writes the current token and the constant.
  Attention head h has a constant query and key whose RoPE'd dot product peaks sharply at
  relative offset h+1, so it copies that token's one-hot into its slot. The MLP has one neuron
  per context of the script, whose SiLU gate is positive only when all ORDER tokens match; it
  writes the scripted next token's slot, which the LM head reads. When no context matches, the
  constant alone speaks, for EOS: anything off-script ends the reply at once;
- text repeats tokens (`<tool_call>` ... `</tool_call>`), so the same context could need two
  successors. The builder picks, per reply, a segmentation into vocabulary tokens (not always
  the canonical one; the byte-level decoder does not mind) whose contexts never contradict.

The scripted token's logit beats every other by about 40, so sampling at any temperature a test
uses still follows the script, and its logprob is ~0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierlm.engine.tokenizer import render_chat

ORDER = 3  # the next token is a function of the last ORDER tokens
MAX_POSITIONS = 1024  # the positional heads are checked up to this many tokens back
ROPE_THETA = 10000.0
_BETA = 20.0  # gate of a context neuron: +BETA/2 when all its tokens match, <= -BETA/2 otherwise
_SCRIPTED_LOGIT = 60.0  # logit of the scripted token; EOS then gets ~8, every other token ~0
_OFF_SCRIPT_EOS_LOGIT = 40.0  # logit of EOS when no context matches
_POSITION_MARGIN = 40.0  # attention score of the wanted offset over any other offset
_SEARCH_BUDGET = 200_000  # segmentation attempts per reply before giving up
# Engines over scripted models: a 512-token context, and a small KV pool that still holds any
# single request (32 blocks of 16 tokens) many times over.
ENGINE_OPTIONS = dict(device="cpu", max_model_len=512, kv_cache_memory=8 << 20, max_num_seqs=16,
                      load_progress=False)


@dataclass
class Script:
    """Answer `reply` to `prompt_ids` (only its last ORDER tokens matter).

    With `loop`, the reply repeats forever instead of ending with EOS (a model that always
    runs to max_tokens, for disconnect and shutdown tests).
    """

    prompt_ids: list[int]
    reply: str
    loop: bool = False


@dataclass
class ScriptedModel:
    path: Path
    scripts: list[Script]
    reply_ids: list[list[int]] = field(default_factory=list)  # per script, as the model emits them

    def reply_tokens(self, reply: str) -> list[int]:
        """The token ids the model generates for `reply` (without the EOS that follows)."""
        for script, ids in zip(self.scripts, self.reply_ids):
            if script.reply == reply:
                return ids
        raise KeyError(f"no script answers {reply!r}")

    def engine(self, name: str | None = None) -> Any:
        """A new real engine over this checkpoint (served as `name`, default the directory name)."""
        from tierlm.engine.async_engine import AsyncEngine

        return AsyncEngine.from_model(str(self.path), served_model_name=name or self.path.name, **ENGINE_OPTIONS)


def build_templated_models(root: Path, tokenizer: Any,
                           specs: list[tuple[str, str, str, tuple[str, ...]]], loop: frozenset[str] = frozenset(),
                           added: tuple[str, ...] = (), eos_tokens: tuple[str, ...] = ()) -> dict[str, ScriptedModel]:
    """One scripted model per (name, chat template, reply to its chat prompt, special tokens it
    writes) under `root`, each over a copy of `tokenizer` with that template and those tokens
    (and `added`) added as special ones (a tool-call or think marker, which a real model writes
    as one special token). The models named in `loop` repeat their reply until max_tokens.
    `eos_tokens`: added tokens that end an answer too (see build_scripted_model)."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(str(root / "tokenizer"))
    built = {}
    for name, template, reply, specials in specs:
        tok = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
        if specials or added:
            tok.add_tokens(list(dict.fromkeys((*added, *specials))), special_tokens=True)
        tok.chat_template = template
        script = Script(chat_prompt_ids(tok), reply, loop=name in loop)
        built[name] = build_scripted_model(root / name, [script], tok, specials=specials, eos_tokens=eos_tokens)
    return built


def chat_prompt_ids(tokenizer: Any, **template_kwargs: Any) -> list[int]:
    """Token ids of a rendered chat prompt (by default one user turn, with the generation prompt)."""
    messages = template_kwargs.pop("messages", [{"role": "user", "content": "Hi"}])
    return render_chat(tokenizer, messages, **template_kwargs)


def build_scripted_model(out: Path, scripts: list[Script], tokenizer: Any,
                         specials: tuple[str, ...] = (), eos_tokens: tuple[str, ...] = ()) -> ScriptedModel:
    """Write the checkpoint (config, weights, tokenizer) to `out`. Replies are spelled in
    ordinary tokens, and in the special tokens `specials` names (a tool-call marker, which a
    real model writes as one special token). `eos_tokens` are EOS ids too in the generation
    config (gpt-oss's lists `<|return|>` and `<|call|>`): a reply that writes one ends there."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pieces = _vocabulary_pieces(tokenizer)
    for text in specials:
        pieces[text] = [tokenizer.convert_tokens_to_ids(text)]
    table: dict[tuple[int, ...], int] = {}
    reply_ids = [_segment(script, pieces, table, eos) for script in scripts]

    tokens = sorted({t for ctx, nxt in table.items() for t in (*ctx, nxt)} - {eos})
    n = len(tokens) + 1  # the last slot is shared by every token off the script
    slot = {t: i for i, t in enumerate(tokens)}
    heads = ORDER - 1  # head h copies the token h+1 positions back
    const, nxt = ORDER * n, ORDER * n + 1  # residual: ORDER one-hot slots, the constant, next-token slots
    hidden = _round_up(nxt + n + 1, 64)
    head_dim = _round_up(n, 32)
    contexts = sorted(table.items())
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=len(contexts), num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, rope_theta=ROPE_THETA,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        emb = model.model.embed_tokens.weight
        emb[:, n - 1] = 1.0
        for t, i in slot.items():
            emb[t, n - 1] = 0.0
            emb[t, i] = 1.0
        emb[:, const] = 1.0
        # Attention input: two ones (token, constant), so input_layernorm scales by g.
        attn = model.model.layers[0].self_attn
        g = math.sqrt(hidden / 2)
        for h in range(heads):
            q, k = offset_query_key(head_dim, offset=h + 1)
            rows = slice(h * head_dim, (h + 1) * head_dim)
            attn.q_proj.weight[rows, const] = q / g
            attn.k_proj.weight[rows, const] = k / g
            for i in range(n):
                attn.v_proj.weight[h * head_dim + i, i] = 1.0 / g
                attn.o_proj.weight[(h + 1) * n + i, h * head_dim + i] = 1.0
        # MLP input: ORDER token ones and the constant, scaled by G. Neuron j fires (gate
        # +BETA/2) only when all ORDER tokens match context j; one mismatch gives -BETA/2.
        mlp = model.model.layers[0].mlp
        G = math.sqrt(hidden / (ORDER + 1))
        for j, (ctx, target) in enumerate(contexts):
            for back, tok in enumerate(reversed(ctx)):
                mlp.gate_proj.weight[j, back * n + slot[tok]] = _BETA / G
            mlp.gate_proj.weight[j, const] = -(ORDER - 0.5) * _BETA / G
            mlp.up_proj.weight[j, const] = 1.0 / G
            mlp.down_proj.weight[nxt + (n if target == eos else slot[target]), j] = 1.0
        # LM head: a fired neuron adds ~BETA/2 to the residual, which the final norm then
        # scales by `fired`; with none fired only the constant speaks, for EOS.
        fired = math.sqrt(hidden / (ORDER + 1 + (_BETA / 2) ** 2))
        head = model.lm_head.weight
        for t, i in [*slot.items(), (eos, n)]:
            head[t, nxt + i] = _SCRIPTED_LOGIT / (_BETA / 2 * fired)
        head[eos, const] = _OFF_SCRIPT_EOS_LOGIT / math.sqrt(hidden / (ORDER + 1))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    model.save_pretrained(str(out))
    eos_ids = [eos, *tokenizer.convert_tokens_to_ids(list(eos_tokens))]
    GenerationConfig(eos_token_id=eos_ids if eos_tokens else eos,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(str(out))
    return ScriptedModel(out, list(scripts), reply_ids)


def _offset_scores(head_dim: int, offset: int) -> torch.Tensor:
    """sum_i cos(theta_i (d - offset)) / sqrt(head_dim) for every relative offset d."""
    half = head_dim // 2
    theta = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    d = torch.arange(MAX_POSITIONS, dtype=torch.float64)
    return torch.cos(theta[None, :] * (d[:, None] - offset)).sum(1) / math.sqrt(head_dim)


def offset_query_key(head_dim: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Constant query and key whose RoPE'd dot product peaks at relative offset `offset`.

    Rotary pair i of the query sits at angle 0 and of the key at angle offset*theta_i, so after
    rotation by their positions the pair contributes a^2 cos(theta_i (p - j - offset)). `a` makes
    the peak beat every other offset in range by `_POSITION_MARGIN`.
    """
    score = _offset_scores(head_dim, offset)
    others = torch.cat([score[:offset], score[offset + 1:]])
    a = math.sqrt(_POSITION_MARGIN / float(score[offset] - others.max()))
    half = head_dim // 2
    theta = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    q, k = torch.zeros(head_dim, dtype=torch.float64), torch.zeros(head_dim, dtype=torch.float64)
    q[:half] = a
    k[:half], k[half:] = a * torch.cos(offset * theta), a * torch.sin(offset * theta)
    return q.float(), k.float()


def _prompt_context(ids: list[int]) -> tuple[int, ...]:
    """The last ORDER tokens as the model sees them at the prompt's last position. Near the
    start, a head looking further back than the prompt goes reads the first token."""
    p = len(ids) - 1
    return tuple(ids[max(p - back, 0)] for back in range(ORDER - 1, -1, -1))


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _vocabulary_pieces(tokenizer: Any) -> dict[str, list[int]]:
    """Text → ids of the ordinary tokens that decode to exactly that text (not an added token
    marked special, `[ARGS]`: a reply spells that in ordinary tokens unless `specials` names it)."""
    from tierlm.engine.detokenizer import skipped_ids

    special = set(tokenizer.all_special_ids) | skipped_ids(tokenizer)
    pieces: dict[str, list[int]] = {}
    for tid in range(len(tokenizer)):
        text = tokenizer.decode([tid])
        if tid not in special and text and "\ufffd" not in text:
            pieces.setdefault(text, []).append(tid)
    return pieces


def _segment(script: Script, pieces: dict[str, list[int]], table: dict[tuple[int, ...], int],
             eos: int) -> list[int]:
    """Token ids spelling `script.reply` whose transitions agree with `table` (which this
    extends). Depth-first over segmentations, longest pieces first."""
    if not script.prompt_ids:
        raise ValueError("a script needs a non-empty prompt")
    start = _prompt_context(script.prompt_ids)
    text = script.reply
    longest = max(map(len, pieces))
    chosen: list[int] = []
    added: list[tuple[int, ...]] = []
    budget = [_SEARCH_BUDGET]

    def bind(ctx: tuple[int, ...], nxt: int) -> bool:
        have = table.get(ctx)
        if have is None:
            table[ctx] = nxt
            added.append(ctx)
            return True
        return have == nxt

    def undo(mark: int) -> None:
        while len(added) > mark:
            del table[added.pop()]

    def context(seq: list[int]) -> tuple[int, ...]:
        return tuple(seq[-ORDER:])

    def finish() -> bool:
        mark = len(added)
        seq = [*start, *chosen]
        if not script.loop:
            if bind(context(seq), eos):
                return True
        elif len(chosen) > ORDER:
            wrapped = seq + chosen[:ORDER]  # ... r[-1] -> r[0] -> r[1] ...: the reply repeats
            if all(bind(context(wrapped[:i]), wrapped[i]) for i in range(len(seq), len(wrapped))):
                return True
        undo(mark)
        return False

    def search(pos: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return False
        if pos == len(text):
            return finish()
        for size in range(min(longest, len(text) - pos), 0, -1):
            for tid in pieces.get(text[pos:pos + size], ()):
                mark = len(added)
                if bind(context([*start, *chosen]), tid):
                    chosen.append(tid)
                    if search(pos + size):
                        return True
                    chosen.pop()
                undo(mark)
        return False

    if not search(0):
        raise ValueError(f"no segmentation of {text!r} fits an order-{ORDER} script together with the "
                         f"other replies of this model (or none within {_SEARCH_BUDGET} tries); reword it "
                         "or give it its own model")
    return list(chosen)


# ---- the scripted models the serving tests talk to ----------------------------------------

TEXT_MODEL = "scripted"  # answers every chat prompt with REPLY
TOOLS_MODEL = "scripted-tools"  # answers every chat prompt with TOOLS_REPLY (prose, then a call)
CALL_MODEL = "scripted-call"  # answers every chat prompt with CALL alone
LOOP_MODEL = "scripted-loop"  # answers every chat prompt with LOOP_REPLY, repeated until max_tokens

REPLY = "alpha beta STOP gamma; one, two"
PREFILL, PREFILL_REPLY = "The answer is (", "B) Helios"  # TEXT_MODEL, after an assistant prefill
COMPLETION_PROMPT, COMPLETION_REPLY = "Hello", " world"  # TEXT_MODEL, as a plain completion
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_PROSE = "Let me look that up."
TOOLS_REPLY = TOOL_PROSE + "\n" + CALL
# TOOLS_MODEL, once tool_choice has started the call (`<tool_call>`, and the name when one is
# required), finishes it:
FORCED_TOOL = "get_weather"
FORCED_REPLY = '{"city": "Oslo"}}\n</tool_call>'  # after a call to FORCED_TOOL was started
FORCED_ANY_REPLY = CALL.removeprefix("<tool_call>\n")  # after `<tool_call>`: its own call, continued
LOOP_REPLY = "tick tock, "


def serving_scripts(tokenizer: Any) -> dict[str, list[Script]]:
    from tierlm.serving.tools import forced_call_prefix

    chat = chat_prompt_ids(tokenizer)
    prefill = chat_prompt_ids(tokenizer, messages=[{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": PREFILL}],
                              add_generation_prompt=False, continue_final_message=True)
    tool = {"type": "function", "function": {"name": FORCED_TOOL, "parameters": {"type": "object"}}}

    def forced(name: str | None) -> list[int]:
        return chat_prompt_ids(tokenizer, messages=[{"role": "user", "content": "Hi"},
                                                    {"role": "assistant", "content": forced_call_prefix(name)}],
                               tools=[tool], add_generation_prompt=False, continue_final_message=True)

    return {
        TEXT_MODEL: [Script(chat, REPLY), Script(prefill, PREFILL_REPLY),
                     Script(tokenizer.encode(COMPLETION_PROMPT), COMPLETION_REPLY)],
        TOOLS_MODEL: [Script(chat, TOOLS_REPLY), Script(forced(FORCED_TOOL), FORCED_REPLY),
                      Script(forced(None), FORCED_ANY_REPLY)],
        CALL_MODEL: [Script(chat, CALL)],
        LOOP_MODEL: [Script(chat, LOOP_REPLY, loop=True)],
    }
