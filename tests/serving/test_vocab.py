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


def test_token_texts_are_their_bytes_and_join_into_the_text(styled):
    """A logprobs entry's `token` is the text its `bytes` spell: a SentencePiece "▁the" is
    " the" (decode([id]) drops that space, so the tokens of a completion did not join into its
    text, nor match its text_offset slices); part of a character is U+FFFD, as OpenAI shows it."""
    style, tokenizer = styled
    vocab = Vocabulary(tokenizer)
    whole = 0
    for text in [*TEXTS, "the fox jumps over the lazy dog", " hello there"]:
        ids = encode(tokenizer, text)
        if any(_not_utf8(vocab.token_bytes(i)) for i in ids):
            continue  # characters split across byte tokens: each such token is U+FFFD
        assert "".join(vocab.token_text(i) for i in ids).encode() == spelled(style, text), text
        whole += 1
    assert whole >= 5
    for i in encode(tokenizer, TEXTS[0]):
        raw = vocab.token_bytes(i)
        assert vocab.token_text(i) == ("\ufffd" if _not_utf8(raw) else raw.decode()), i
    if style != "byte-level":
        [fox] = [i for i in encode(tokenizer, "the fox") if vocab.token_text(i).strip() == "fox"] or [None]
        assert fox is None or vocab.token_text(fox) == " fox" != tokenizer.decode([fox])


def test_wordpiece_token_texts_drop_the_continuation_prefix():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_ids = {"[UNK]": 0, "play": 1, "##ing": 2, "the": 3}
    tok = Tokenizer(models.WordPiece(vocab_ids, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    vocab = Vocabulary(fast)
    ids = fast.encode("the playing", add_special_tokens=False)
    assert [vocab.token_text(i) for i in ids] == [" the", " play", "ing"]
    assert "".join(vocab.token_text(i) for i in ids).strip() == fast.decode(ids)


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


# ---- OpenAI logprobs over HTTP -------------------------------------------------------------


def _logprobs_body(model: str, seed: int, stream: bool) -> dict[str, Any]:
    return {"model": model, "max_tokens": 60, "logprobs": True, "top_logprobs": 2, "seed": seed, "ignore_eos": True,
            "stream": stream, "messages": [{"role": "user", "content": "こんにちは 🙂🚀✨"}]}


def test_logprobs_cover_the_returned_text_however_many_u_fffd_it_holds(demo_server, demo_engine):
    """The demo model's answers hold U+FFFDs (bytes that are no character). Logprobs were matched
    to the text by the tokens' own bytes, which the text's 3-byte U+FFFDs outran: the tokens of a
    matched stop string were returned too. Reference: the same seed's answer without the stop,
    cut where a stop string made of two of its tokens begins."""
    special = {t.content for t in demo_engine.tokenizer.added_tokens_decoder.values() if t.special}

    def joined(tokens: list[dict[str, Any]]) -> str:
        return b"".join(bytes(t["bytes"]) for t in tokens if t["token"] not in special).decode("utf-8", "replace")

    checked = 0
    with httpx.Client(base_url=demo_server.url, headers={"x-api-key": API_KEY}, timeout=120) as client:
        for seed in range(1, 13):
            body = {**_logprobs_body(demo_engine.model_name, seed, False), "ignore_eos": False}
            choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
            text, tokens = choice["message"]["content"], choice["logprobs"]["content"]
            if choice["finish_reason"] == "stop":
                assert tokens[-1]["token"] not in special, seed  # the EOS ends the text, it is not in it
            for i in range(1, len(tokens) - 1):
                pair = tokens[i]["token"] + tokens[i + 1]["token"]
                if "\ufffd" in pair or not pair.strip() or {tokens[i]["token"], tokens[i + 1]["token"]} & special:
                    continue
                at = text.find(pair)
                if at > 0 and "\ufffd" in text[:at] and joined(tokens[:i]) == text[:at]:  # a token boundary
                    cut = client.post("/v1/chat/completions", json={**body, "stop": [pair]}).json()["choices"][0]
                    assert cut["message"]["content"] == text[:at], seed
                    assert [t["token"] for t in cut["logprobs"]["content"]] == [t["token"] for t in tokens[:i]], seed
                    checked += 1
                    break
    assert checked >= 3, checked


def test_completion_text_offsets_index_the_text(demo_server, demo_engine):
    """`text_offset` is where each token's text is in the returned text. Summing the tokens' own
    texts ran off wherever a character spans tokens (its pieces are each a U+FFFD)."""
    special = {t.content for t in demo_engine.tokenizer.added_tokens_decoder.values() if t.special}
    checked = 0
    with httpx.Client(base_url=demo_server.url, headers={"x-api-key": API_KEY}, timeout=120) as client:
        for seed in range(1, 6):
            body = {"model": demo_engine.model_name, "prompt": "こんにちは 🙂🚀✨", "max_tokens": 40, "seed": seed,
                    "logprobs": 0, "ignore_eos": True}
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
            text, lp = choice["text"], choice["logprobs"]
            assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
            for token, offset in zip(lp["tokens"], lp["text_offset"]):
                if "\ufffd" not in token and token not in special:  # whole characters: they are there
                    assert text[offset:offset + len(token)] == token, seed
                    checked += 1
            streamed = [o for _, f in parse_sse(client.post("/v1/completions", json={**body, "stream": True}).text)
                        if isinstance(f, dict) and f["choices"] and f["choices"][0]["logprobs"]
                        for o in f["choices"][0]["logprobs"]["text_offset"]]
            assert streamed == lp["text_offset"]
    assert checked


def test_the_token_that_ends_a_request_is_never_in_its_returned_logprobs():
    """An EOS or stop token has no text (it ends the text): with U+FFFDs in the text, or a
    character still unfinished before it (flushed as U+FFFD), it was returned all the same.
    Here each answer is ended by a stop token right after a token that is part of a character."""
    from tierlm import LLM, SamplingParams
    from tierlm.serving.openai import ReturnedTokens

    llm = LLM(None, device="cpu", max_model_len=256, kv_cache_memory=8 << 20, load_progress=False)
    tok = llm.engine.tokenizer
    prompt = {"prompt_token_ids": tok.encode("こんにちは 🙂🚀✨", add_special_tokens=False)}
    checked = 0
    for seed in range(1, 9):
        free = llm.generate([prompt], SamplingParams(max_tokens=40, seed=seed, logprobs=0, ignore_eos=True))[0]
        ids = free.outputs[0].token_ids
        for m in range(1, len(ids)):
            if ids[m] in ids[:m] or "\ufffd" not in tok.decode(ids[m - 1:m]):
                continue
            params = SamplingParams(max_tokens=40, seed=seed, logprobs=0, ignore_eos=True, stop_token_ids=[ids[m]])
            out = llm.generate([prompt], params)[0].outputs[0]
            assert out.token_ids == ids[:m + 1] and out.finish_reason == "stop"
            returned = ReturnedTokens().add(out.logprobs, out.text)
            assert [lp.token_id for lp in returned] == ids[:m], seed
            checked += 1
            break
    assert checked >= 3, checked
    llm.close()


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
