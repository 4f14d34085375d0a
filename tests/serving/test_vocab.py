"""Token bytes and the token-count lower bound (tierlm.serving.vocab), on real tokenizers: the
demo model's byte-level BPE and SentencePiece-style BPEs (metaspace, byte fallback) trained here;
then OpenAI logprobs `bytes` over real HTTP (demo model)."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.serving.harness import API_KEY, parse_sse
from tierlm.serving.vocab import NORMALIZER_SAFETY_FACTOR, Vocabulary

_CORPUS = ["The quick brown fox jumps over the lazy dog. Größe Straße café naïve", "hello world hello there"] * 20
TEXTS = ["Hello wörld こんにちは 🙂🚀✨ € the fox  jumps", "a", " " * 3000, "word " * 500, "こんにちは" * 100,
         "🙂" * 100, "\n\n\t" * 200, "hello" * 300]


def sentencepiece_like(style: str, tokenizers_kwargs: dict[str, Any] | None = None) -> Any:
    """A small BPE with byte fallback, SentencePiece style: `llama2` (Prepend + Replace normalizer,
    Replace/ByteFallback/Fuse/Strip decoder, as converted Llama-2 tokenizers have) or `metaspace`
    (a Metaspace pre-tokenizer and decoder)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    if style == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                    prepend_scheme="first")])
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], max_token_length=16,
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    spec = json.loads(tok.to_str())  # the <0xXX> pieces join the model's vocabulary, as in Llama 2's
    for b in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=["byte-level", "llama2", "metaspace"])
def styled(request, demo_tokenizer) -> tuple[str, Any]:
    return request.param, demo_tokenizer if request.param == "byte-level" else sentencepiece_like(request.param)


@pytest.fixture(scope="module")
def tokenizer(styled):
    return styled[1]


def spelled(style: str, text: str) -> bytes:
    """The text as its tokens spell it: SentencePiece styles put a "▁" (a space) in front
    (Metaspace's `first` scheme only where the text does not start with one)."""
    if style == "llama2" or (style == "metaspace" and not text.startswith(" ")):
        return b" " + text.encode()
    return text.encode()


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_token_bytes_join_into_the_text(styled):
    style, tokenizer = styled
    vocab = Vocabulary(tokenizer)
    for text in TEXTS:
        ids = encode(tokenizer, text)
        assert b"".join(vocab.token_bytes(i) for i in ids) == spelled(style, text), text
    partial = [i for i in encode(tokenizer, TEXTS[0]) if _not_utf8(vocab.token_bytes(i))]
    assert partial, "the text should need tokens that are part of a character"


def test_byte_level_token_bytes_match_every_decodable_token(demo_tokenizer):
    vocab = Vocabulary(demo_tokenizer)
    for token_id in range(len(demo_tokenizer)):
        text = demo_tokenizer.decode([token_id])
        if "\ufffd" not in text:
            assert vocab.token_bytes(token_id) == text.encode(), token_id


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_min_tokens_is_a_lower_bound(tokenizer):
    vocab = Vocabulary(tokenizer)
    assert vocab.max_token_bytes is not None
    for text in TEXTS:
        assert vocab.min_tokens(text) <= len(encode(tokenizer, text)), text


def test_the_bound_uses_the_longest_token(demo_tokenizer):
    vocab = Vocabulary(demo_tokenizer)  # byte-level, no normalizer: one character per byte, no factor
    assert vocab.max_token_bytes == max(len(piece) for piece in demo_tokenizer.get_vocab())
    assert vocab.min_tokens("x" * (10 * vocab.max_token_bytes)) == 10
    llama2 = Vocabulary(sentencepiece_like("llama2"))  # has a normalizer: the safety factor applies
    assert llama2.max_token_bytes % NORMALIZER_SAFETY_FACTOR == 0


def _bpe(**parts: Any) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for name, value in parts.items():
        setattr(tok, name, value)
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_no_bound_where_text_can_vanish():
    """Where a normalizer, pre-tokenizer or model may drop or fuse any amount of text, a long
    text can have almost no tokens: such tokenizers get no early refusal at all."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    strip = _bpe(normalizer=normalizers.Strip())
    whitespace = _bpe(pre_tokenizer=pre_tokenizers.Whitespace())
    assert len(encode(whitespace, " " * 5000)) == 0  # why: 5000 bytes, no token
    lstrip = _bpe()
    lstrip.add_tokens([AddedToken("<mask>", lstrip=True)])
    no_unk = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])))
    assert len(encode(no_unk, "ab" + "x" * 5000)) == 2  # why: characters outside the vocabulary vanish
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordPiece({"[UNK]": 0}, unk_token="[UNK]")),
                                        unk_token="[UNK]")
    assert Vocabulary(_bpe()).min_tokens("x" * 100_000) is not None  # each of these changes one thing
    for tok in (strip, whitespace, lstrip, no_unk, wordpiece):
        assert Vocabulary(tok).min_tokens("x" * 100_000) is None


def test_skipped_ids_are_the_tokens_a_decode_skips(demo_tokenizer):
    """Reference: the tokenizer's own decode, token by token, over the whole vocabulary."""
    vocab = Vocabulary(demo_tokenizer)
    skipped = {i for i in range(len(demo_tokenizer))
               if demo_tokenizer.decode([i], skip_special_tokens=True) == ""
               and demo_tokenizer.decode([i], skip_special_tokens=False) != ""}
    assert vocab.skipped_ids == skipped
    assert demo_tokenizer.convert_tokens_to_ids("<|im_start|>") in skipped  # not in all_special_ids
    assert demo_tokenizer.convert_tokens_to_ids("<|im_start|>") not in demo_tokenizer.all_special_ids


def test_logprobs_after_a_skipped_special_token_are_all_returned(demo_tokenizer):
    """A generated <|im_start|> has no text: its bytes were counted towards the text all the
    same, so the logprobs of the last tokens fell "past the text" and were dropped."""
    from types import SimpleNamespace

    from tierlm.engine.outputs import TokenLogprob
    from tierlm.serving.openai import ReturnedTokens

    tok = demo_tokenizer
    ids = (tok.encode("Hello,", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_start|>")]
           + tok.encode(" world!", add_special_tokens=False))
    text = tok.decode(ids, skip_special_tokens=True)
    returned = ReturnedTokens(SimpleNamespace(tokenizer=tok)).add([TokenLogprob(t, -1.0) for t in ids], text)
    assert [lp.token_id for lp in returned] == ids


# ---- OpenAI logprobs over HTTP -------------------------------------------------------------


def _logprobs_body(model: str, seed: int, stream: bool) -> dict[str, Any]:
    return {"model": model, "max_tokens": 60, "logprobs": True, "top_logprobs": 2, "seed": seed, "ignore_eos": True,
            "stream": stream, "messages": [{"role": "user", "content": "こんにちは 🙂🚀✨"}]}


def test_chat_logprobs_bytes_are_each_tokens_raw_bytes(demo_server, demo_engine):
    """Joined, the tokens' `bytes` are the answer (special tokens aside: the text skips them).
    The random-weight demo model writes multi-byte characters over several tokens, and bytes
    that are no character at all (the text has U+FFFD there, as decoding gives)."""
    special = {t.content for t in demo_engine.tokenizer.added_tokens_decoder.values() if t.special}
    partial_seen = 0
    with httpx.Client(base_url=demo_server.url, headers={"x-api-key": API_KEY}, timeout=120) as client:
        for seed in range(1, 6):
            data = client.post("/v1/chat/completions", json=_logprobs_body(demo_engine.model_name, seed, False)).json()
            choice = data["choices"][0]
            tokens = choice["logprobs"]["content"]
            joined = b"".join(bytes(t["bytes"]) for t in tokens if t["token"] not in special)
            assert joined.decode("utf-8", "replace") == choice["message"]["content"], seed
            for t in tokens:
                for entry in (t, *t["top_logprobs"]):
                    if "\ufffd" not in entry["token"]:  # whole characters: the bytes are the text's
                        assert bytes(entry["bytes"]) == entry["token"].encode()
            partial_seen += sum(_not_utf8(bytes(t["bytes"])) for t in tokens)
            frames = parse_sse(client.post("/v1/chat/completions",
                                           json=_logprobs_body(demo_engine.model_name, seed, True)).text)
            streamed = [t for _, f in frames if isinstance(f, dict) and f["choices"]
                        for t in (f["choices"][0]["logprobs"] or {}).get("content", [])]
            # the same seed, the same tokens and bytes (logprobs may differ in the last digits: a
            # prefix-cache hit computes the prompt in other shapes)
            assert [(t["token"], t["bytes"]) for t in streamed] == [(t["token"], t["bytes"]) for t in tokens]
    assert partial_seen, "the answers should hold tokens that are part of a character"
