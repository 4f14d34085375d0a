"""What the serving layer needs to know about a model's vocabulary, computed once per tokenizer:

- each token's raw bytes, for OpenAI logprobs' `bytes` (a token may be part of a multi-byte
  character, which `decode([id])` can only show as U+FFFD);
- the most bytes of text one token can stand for, which gives a lower bound on a text's token
  count without tokenizing it, so a hopelessly long prompt is refused at once.

Both are read from the `tokenizers` backend of a fast tokenizer; for anything else tokens fall
back to `decode([id])` and no bound is given (such prompts are simply tokenized).
"""
from __future__ import annotations

import json
import math
import re
import threading
import weakref
from collections.abc import Callable
from functools import lru_cache
from typing import Any

# A normalizer may contract text (NFKC/NFC composition: three conjoining Hangul jamo, 9 bytes,
# become one 3-byte syllable); this factor keeps the bound sound for the normalizers allowed below.
NORMALIZER_SAFETY_FACTOR = 4
# Normalizers that never drop characters (those that may, like Strip, StripAccents, BertNormalizer
# or SentencePiece's Precompiled map, allow no bound at all: a text of dropped characters has no tokens).
_SAFE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "Sequence"}
# Pre-tokenizers that keep every character (Whitespace, BertPreTokenizer, ... drop whitespace).
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts", "Sequence"}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: byte-level BPE's characters → the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _state(component: Any) -> dict[str, Any] | None:
    """A tokenizers component (normalizer, pre-tokenizer, decoder) as its JSON config."""
    if component is None:
        return None
    try:
        return json.loads(component.__getstate__())
    except Exception:
        return {"type": "unknown"}


def _children(node: dict[str, Any]) -> list[dict[str, Any]]:
    for key in ("normalizers", "pretokenizers", "decoders"):
        if isinstance(node.get(key), list):
            return node[key]
    return []


def _find(node: dict[str, Any] | None, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """The first component in `node`'s tree (itself, then inside Sequences) that `match`es."""
    if node is None:
        return None
    if match(node):
        return node
    return next((found for child in _children(node) if (found := _find(child, match)) is not None), None)


def _has_type(node: dict[str, Any] | None, name: str) -> bool:
    return _find(node, lambda n: n.get("type") == name) is not None


def _keeps_text(node: dict[str, Any], allowed: set[str]) -> bool:
    """Whether a normalizer / pre-tokenizer (config) keeps every character of its input."""
    kind = node.get("type")
    if kind not in allowed:
        return False
    if kind == "Sequence":
        return all(_keeps_text(child, allowed) for child in _children(node))
    if kind == "Replace":  # only a plain string replaced by one at least as long
        pattern = node.get("pattern", {}).get("String")
        return isinstance(pattern, str) and len(str(node.get("content", "")).encode()) >= len(pattern.encode())
    if kind in ("Split", "Punctuation"):
        return node.get("behavior") != "Removed"
    return True


class Vocabulary:
    """Raw bytes per token id (cached) and the token-count lower bound of one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._added: dict[int, Any] = {}
        decoder = pre = normalizer = None
        if backend is not None:
            self._added = dict(backend.get_added_tokens_decoder())
            decoder, pre = _state(backend.decoder), _state(backend.pre_tokenizer)
            normalizer = _state(backend.normalizer)
        self._texts: dict[int, str] = {}
        self._byte_level = _has_type(decoder, "ByteLevel") or _has_type(pre, "ByteLevel")
        self._wordpiece_prefix = _wordpiece_prefix(decoder)
        self._metaspace = _has_type(decoder, "Metaspace") or _has_type(pre, "Metaspace") or _replaces_metaspace(decoder)
        model = getattr(backend, "model", None)
        self._byte_fallback = bool(getattr(model, "byte_fallback", False)) or _has_type(decoder, "ByteFallback")
        self.max_token_bytes = self._max_token_bytes(backend, model, pre, normalizer)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text `token_id` stands for (a partial UTF-8 character stays partial)."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute_bytes(token_id)
        return cached

    def token_text(self, token_id: int) -> str:
        """The text `token_id` stands for, as its bytes spell it, so a logprobs entry's `token`
        and `bytes` agree and the tokens join into the text (a Metaspace piece's "▁" is the space
        it stands for, which `decode([id])` drops; a WordPiece "##" is no text); U+FFFD where the
        bytes are part of a character, as OpenAI shows such a token."""
        cached = self._texts.get(token_id)
        if cached is None:
            try:
                cached = self.token_bytes(token_id).decode("utf-8")
            except UnicodeDecodeError:
                cached = self._tokenizer.decode([token_id])
            self._texts[token_id] = cached
        return cached

    def name(self, token_id: int, as_id: bool = False) -> str:
        """How a logprobs entry names a token: `token_text`, or (vLLM's return_tokens_as_token_ids)
        "token_id:N", which tells apart tokens whose texts are alike (parts of one character)."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)

    def _compute_bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:  # matched against the raw text, never byte-mapped
            return str(added.content).encode()
        piece = self._backend.id_to_token(token_id) if self._backend is not None else None
        if piece is not None:
            if self._byte_level:
                table = byte_decoder()
                if all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
            if self._byte_fallback and (m := _BYTE_FALLBACK.fullmatch(piece)):
                return bytes([int(m.group(1), 16)])
            if self._metaspace:
                return piece.replace(_METASPACE, " ").encode()
            if self._wordpiece_prefix is not None:  # a word's continuation, or a new word after a space
                prefix = self._wordpiece_prefix
                return (piece[len(prefix):] if piece.startswith(prefix) else " " + piece).encode()
        return self._tokenizer.decode([token_id]).encode()

    def min_tokens(self, text: str) -> int | None:
        """A lower bound on the tokens `text` encodes to; None where this tokenizer allows none."""
        if self.max_token_bytes is None:
            return None
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return math.ceil(size / self.max_token_bytes)

    def _max_token_bytes(self, backend: Any, model: Any, pre: dict[str, Any] | None,
                         normalizer: dict[str, Any] | None) -> int | None:
        """The most bytes of input text one token can cover (times a safety factor where a
        normalizer may contract the text), or None where no sound bound exists."""
        if backend is None or type(model).__name__ != "BPE":
            return None  # WordPiece/WordLevel/Unigram turn a whole unknown word (any length) into one token
        pieces = backend.get_vocab(False)
        every_byte = (self._byte_level and all(c in pieces for c in byte_decoder())) or (
            bool(model.byte_fallback) and all(f"<0x{b:02X}>" in pieces for b in range(256)))
        if not every_byte and (model.unk_token is None or model.fuse_unk):
            # Characters outside the vocabulary then vanish (no unk token) or a run of them,
            # however long, becomes one token (fuse_unk); else each is one unk token of <= 4 bytes.
            return None
        if pre is not None and not _keeps_text(pre, _SAFE_PRE_TOKENIZERS):
            return None
        if normalizer is not None and not _keeps_text(normalizer, _SAFE_NORMALIZERS):
            return None
        if any(t.lstrip or t.rstrip for t in self._added.values()):
            return None  # such a token also swallows the whitespace next to it, however much
        # Byte-level pieces are one character per byte; other pieces cover at most their own
        # UTF-8 length (a metaspace "▁" is 3 bytes for one space, "<0xAB>" 6 for one byte).
        longest = max((len(p) if self._byte_level else len(p.encode()) for p in pieces), default=1)
        longest = max([longest, 4, *(len(str(t.content).encode()) for t in self._added.values())])  # 4: an unk char
        return longest * (NORMALIZER_SAFETY_FACTOR if normalizer is not None else 1)


def _wordpiece_prefix(decoder: dict[str, Any] | None) -> str | None:
    """A WordPiece decoder's continuation prefix ("##"); None for other decoders."""
    found = _find(decoder, lambda n: n.get("type") == "WordPiece")
    return None if found is None else str(found.get("prefix", "##"))


def _replaces_metaspace(decoder: dict[str, Any] | None) -> bool:
    """Llama-2 style decoders: Replace("▁", " ") instead of a Metaspace decoder."""
    return _find(decoder, lambda n: n.get("type") == "Replace"
                 and n.get("pattern", {}).get("String") == _METASPACE) is not None


_vocabularies: "weakref.WeakKeyDictionary[Any, Vocabulary]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def vocabulary(tokenizer: Any) -> Vocabulary:
    """The tokenizer's Vocabulary, built on first use (reads the whole vocabulary: call it off
    the event loop the first time, e.g. through `asyncio.to_thread`)."""
    with _lock:
        found = _vocabularies.get(tokenizer)
    if found is None:
        found = Vocabulary(tokenizer)
        with _lock:
            found = _vocabularies.setdefault(tokenizer, found)
    return found
