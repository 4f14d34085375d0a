"""The safety layer: prompts and answers checked against phrase policies, as they stream.

A policies file (`tierlm serve --safety-policies FILE`, TOML) names phrase lists and what to do
when one appears:

    [policies.credentials]
    phrases = ["BEGIN RSA PRIVATE KEY", "sk-live-"]
    phrases_file = "credentials.txt"   # more phrases, one per line ('#' comments), beside this file
    detect = ["aws_access_key_id"]     # built-in detectors (pattern_scan.py): email, credit_card,
                                       #   us_ssn, ipv4, aws_access_key_id
    patterns = ['(?i)acct-\d{6}']      # regular expressions of your own (the `regex` module's syntax)
    check = "both"                     # "input" (the prompt), "output" (the answer) or "both" (default)
    action = "block"                   # "block" (default) or "redact" (answers only)
    whole_word = false                 # true: "ass" does not match inside "class" (default false)
    replacement = "[redacted]"         # what a redacted phrase becomes
    tiers = ["bronze"]                 # only for these tiers' requests ...
    tenants = ["acme"]                 # ... or these tenants' (neither: every request)

Phrases are compared case-folded, with runs of white space as one space (phrase_scan.py), on
text, not token ids: the same words tokenize differently in different contexts and models.
Detectors and patterns match the text as it is (pattern_scan.py; `(?i)` for any case); a
policy needs phrases, detectors or patterns, and may mix them.

- **Input.** The prompt (the engine's token ids, decoded, special tokens left out: every route
  and template, system prompt and tool results included) is read before the SLA guard and the
  engine see it. A match of any input policy ends the request at once: HTTP 200, nothing
  generated, Anthropic `stop_reason: "refusal"`, OpenAI `finish_reason: "content_filter"`
  (Responses API: `incomplete`, reason `content_filter`); no token is charged.
- **Output.** The answer's text (its reasoning and tool calls too) is read as it streams. Text
  that may still become a phrase is held back, and nothing else (the automaton's depth: `a` is
  shown at once, `sk-li` waits for what follows). A `block` match stops the request there (its
  KV blocks freed at once): the client never sees the phrase, and the answer ends with the
  refusal / content_filter reason; a `redact` match is replaced by its `replacement` and the
  answer goes on. Token logprobs of a stream delta that held redacted text are dropped (they
  would spell it).

Why held deltas and not held characters: a delta carries its tokens' logprobs; showing part of
its text would show them all.

Patterns that run out of time (pattern_scan.SCAN_TIMEOUT_S per prompt or per delta) cannot
vouch for the text: it counts as matching (`Rules.timed_out`), so a prompt is refused and an
answer stopped, rather than the event loop held for as long as the pattern backtracks.
"""
from __future__ import annotations

import logging
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Literal, Protocol, Sequence

from tierlm.engine.outputs import StreamDelta, TokenLogprob
from tierlm.serving.pattern_scan import BUILTIN, Detector, PatternSet, PatternTimeout, compile_pattern
from tierlm.serving.phrase_scan import PhraseSet, normalise

logger = logging.getLogger("tierlm.serving")

FINISH_REASON = "content_filter"  # the engine-level finish reason of a request the layer ended
Check = Literal["input", "output", "both"]
Action = Literal["block", "redact"]
_POLICY_KEYS = {"phrases", "phrases_file", "detect", "patterns", "check", "action", "whole_word", "replacement",
                "tiers", "tenants"}
MAX_PHRASE_CHARS = 1000


class PolicyFileError(ValueError):
    """A policies file that cannot be used; the message names the file, the policy and the key."""


@dataclass(frozen=True)
class Policy:
    name: str
    phrases: tuple[str, ...]
    check: Check = "both"
    action: Action = "block"
    whole_word: bool = False
    replacement: str = "[redacted]"
    tiers: frozenset[str] = frozenset()
    tenants: frozenset[str] = frozenset()
    detectors: tuple[Detector, ...] = ()  # built-in detectors and the policy's own patterns

    def applies_to(self, tier: str | None, tenant: str | None) -> bool:
        if not self.tiers and not self.tenants:
            return True
        return (tier is not None and tier in self.tiers) or (tenant is not None and tenant in self.tenants)

    @property
    def checks_input(self) -> bool:
        return self.check in ("input", "both")

    @property
    def checks_output(self) -> bool:
        return self.check in ("output", "both")


@dataclass(frozen=True)
class Hit:
    """A match in the text: the policy it breaks and the span of original characters."""

    policy: Policy
    start: int
    end: int


@dataclass(frozen=True)
class Rules:
    """Compiled phrases and detectors of some policies, with the policy behind each."""

    phrases: PhraseSet | None
    phrase_owners: tuple[Policy, ...]  # phrase index → its policy
    patterns: PatternSet | None
    pattern_owners: tuple[Policy, ...]  # detector index → its policy

    @classmethod
    def of(cls, policies: Iterable[Policy]) -> "Rules | None":
        phrases: list[str] = []
        phrase_owners: list[Policy] = []
        detectors: list[Detector] = []
        pattern_owners: list[Policy] = []
        for policy in policies:
            for phrase in policy.phrases:
                phrases.append(normalise(phrase, policy.whole_word))
                phrase_owners.append(policy)
            detectors += policy.detectors
            pattern_owners += [policy] * len(policy.detectors)
        if not phrases and not detectors:
            return None
        return cls(PhraseSet(phrases) if phrases else None, tuple(phrase_owners),
                   PatternSet(detectors) if detectors else None, tuple(pattern_owners))

    def hits(self, phrase_matches: Sequence[Any] = (), pattern_matches: Sequence[Any] = ()) -> list[Hit]:
        """Both kinds of matches as hits, in the order they end in the text."""
        found = [Hit(self.phrase_owners[m.phrase], m.start, m.end) for m in phrase_matches]
        found += [Hit(self.pattern_owners[m.detector], m.start, m.end) for m in pattern_matches]
        return sorted(found, key=lambda h: (h.end, h.start))

    def find_all(self, text: str) -> list[Hit]:
        return self.hits(self.phrases.find_all(text) if self.phrases is not None else (),
                         self.patterns.find_all(text) if self.patterns is not None else ())

    def timed_out(self, error: PatternTimeout, what: str) -> Policy:
        """The policy a text is refused or stopped by when its patterns ran out of time: they
        cannot vouch for it, so it counts as matching (a blocking policy's if any has patterns;
        a redact policy's cannot be redacted, with no span: it blocks too)."""
        owners = list(dict.fromkeys(self.pattern_owners))
        policy = next((p for p in owners if p.action == "block"), owners[0])
        logger.warning("safety patterns of %s: %s in %s, so it counts as matching policy '%s' (%s); rewrite the "
                       "slow pattern without nested repetition such as (a|aa)+", ", ".join(
                           f"'{p.name}'" for p in owners), error, what, policy.name,
                       "refused" if what == "a prompt" else "stopped")
        return policy

    @staticmethod
    def first_block(hits: Sequence[Hit]) -> Policy | None:
        """The policy that blocks on these hits (the first to end), if any does."""
        for h in hits:
            if h.policy.action == "block":
                return h.policy
        return None


@dataclass(frozen=True)
class RequestSafety:
    """What one request is checked against (its tier's and tenant's policies)."""

    input: Rules | None
    output: Rules | None

    def check_prompt(self, text: str) -> Policy | None:
        """The policy a prompt's text breaks (any match blocks), or None."""
        if self.input is None:
            return None
        try:
            hits = self.input.find_all(text)
        except PatternTimeout as e:
            return self.input.timed_out(e, "a prompt")
        return hits[0].policy if hits else None

    def output_guard(self, markup: "Markup | None" = None) -> "OutputGuard | None":
        return OutputGuard(self.output, markup) if self.output is not None else None


@dataclass
class SafetyPolicies:
    """Every policy of the file, and each request's compiled selection (cached per selection)."""

    policies: tuple[Policy, ...] = ()
    _compiled: dict[tuple[str, ...], RequestSafety | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.policies)

    def compile_all(self, selections: Iterable[tuple[str | None, str | None]]) -> None:
        """Compile every (tier, tenant) selection now, so no request waits for it (a long phrase
        list takes seconds)."""
        for tier, tenant in selections:
            self.for_request(tier, tenant)

    def for_request(self, tier: str | None, tenant: str | None) -> RequestSafety | None:
        chosen = [p for p in self.policies if p.applies_to(tier, tenant)]
        key = tuple(p.name for p in chosen)
        if key not in self._compiled:
            safety = RequestSafety(Rules.of(p for p in chosen if p.checks_input),
                                   Rules.of(p for p in chosen if p.checks_output))
            self._compiled[key] = safety if (safety.input or safety.output) else None
        return self._compiled[key]

    @classmethod
    def from_file(cls, path: str | Path, tiers: Iterable[str] | None = None,
                  tenants: Iterable[str] | None = None, key_owner: dict[str, str] | None = None) -> "SafetyPolicies":
        """Read and check a policies file; `tiers` and `tenants` are the names a policy may list
        (None: there are none, no tenants file); `key_owner` maps the key ids of grouped tenants
        to their tenant, to name it where a policy lists such a key (it matched no request)."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise PolicyFileError(f"safety policies file {path}: cannot be read ({exc.strerror or exc})") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise PolicyFileError(f"safety policies file {path}: not valid TOML ({exc})") from None
        unknown = set(data) - {"policies"}
        if unknown:
            raise PolicyFileError(f"safety policies file {path}: unknown key(s) {sorted(unknown)}; "
                                  "policies go in [policies.NAME] tables")
        table = data.get("policies", {})
        if not isinstance(table, dict) or not table:
            raise PolicyFileError(f"safety policies file {path}: no [policies.NAME] table; add one, or leave "
                                  "--safety-policies out")
        known_tiers = set(tiers) if tiers is not None else None
        known_tenants = set(tenants) if tenants is not None else None
        policies = tuple(_policy(path, name, spec, known_tiers, known_tenants, key_owner or {})
                         for name, spec in table.items())
        return cls(policies)


def _policy(path: Path, name: str, spec: Any, tiers: set[str] | None, tenants: set[str] | None,
            key_owner: dict[str, str]) -> Policy:
    where = f"safety policies file {path}: policy '{name}'"
    if not isinstance(spec, dict):
        raise PolicyFileError(f"{where}: must be a table of keys")
    unknown = set(spec) - _POLICY_KEYS
    if unknown:
        raise PolicyFileError(f"{where}: unknown key(s) {sorted(unknown)}; the keys are {sorted(_POLICY_KEYS)}")
    phrases = _strings(where, "phrases", spec.get("phrases", []))
    if "phrases_file" in spec:
        if not isinstance(spec["phrases_file"], str):
            raise PolicyFileError(f"{where}: phrases_file must be a path")
        listed = (path.parent / spec["phrases_file"])
        try:
            lines = listed.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise PolicyFileError(f"{where}: phrases_file {listed} cannot be read ({exc})") from None
        phrases += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    detectors = _detectors(where, spec)
    check = spec.get("check", "both")
    action = spec.get("action", "block")
    whole_word = spec.get("whole_word", False)
    replacement = spec.get("replacement", "[redacted]")
    if check not in ("input", "output", "both"):
        raise PolicyFileError(f"{where}: check must be 'input', 'output' or 'both', not {check!r}")
    if action not in ("block", "redact"):
        raise PolicyFileError(f"{where}: action must be 'block' or 'redact', not {action!r}")
    if action == "redact" and check == "input":
        raise PolicyFileError(f"{where}: 'redact' applies to answers (a prompt that matches is refused); "
                              "use check 'output' or 'both', or action 'block'")
    if not isinstance(whole_word, bool):
        raise PolicyFileError(f"{where}: whole_word must be true or false")
    if not isinstance(replacement, str):
        raise PolicyFileError(f"{where}: replacement must be a string")
    if not phrases and not detectors:
        raise PolicyFileError(f"{where}: nothing to look for; give 'phrases', 'phrases_file', 'detect' or "
                              "'patterns'")
    for phrase in phrases:
        if len(phrase) > MAX_PHRASE_CHARS:
            raise PolicyFileError(f"{where}: a phrase of {len(phrase)} characters (at most {MAX_PHRASE_CHARS}): "
                                  f"{phrase[:40]!r}...")
        if not normalise(phrase, whole_word):
            raise PolicyFileError(f"{where}: the phrase {phrase!r} is only white space")
    if action == "redact":  # (compiling a long phrase list takes a while: only where it is needed)
        own = Rules.of([Policy(name, tuple(phrases), whole_word=whole_word, detectors=detectors)])
        if own is not None and own.find_all(replacement):
            raise PolicyFileError(f"{where}: its replacement {replacement!r} matches the policy itself")
    listed_tiers = frozenset(_strings(where, "tiers", spec.get("tiers", [])))
    listed_tenants = frozenset(_strings(where, "tenants", spec.get("tenants", [])))
    for kind, names, known in (("tier", listed_tiers, tiers), ("tenant", listed_tenants, tenants)):
        if names and known is None:
            raise PolicyFileError(f"{where}: lists {kind}s, which come from a tenants file; pass --tenants, or "
                                  f"drop '{kind}s' to apply the policy to every request")
        if known is not None and (missing := names - known):
            grouped = {k: key_owner[k] for k in sorted(missing) if k in key_owner}
            if kind == "tenant" and grouped:
                key, owner = next(iter(grouped.items()))
                raise PolicyFileError(f"{where}: lists key id(s) {sorted(grouped)} under 'tenants', but '{key}' is a "
                                      f"key of tenant '{owner}' and policies apply per tenant; list '{owner}' instead")
            raise PolicyFileError(f"{where}: unknown {kind}(s) {sorted(missing)}; the tenants file has "
                                  f"{sorted(known)}")
    return Policy(name, tuple(phrases), check, action, whole_word, replacement, listed_tiers, listed_tenants,
                  detectors)


def _detectors(where: str, spec: dict) -> tuple[Detector, ...]:
    """The policy's `detect` (built-in names) and `patterns` (its own), checked and compiled."""
    named = _strings(where, "detect", spec.get("detect", []))
    unknown = [n for n in named if n not in BUILTIN]
    if unknown:
        raise PolicyFileError(f"{where}: unknown detector(s) {unknown}; the built-in ones are {sorted(BUILTIN)} "
                              "(give a regular expression of your own in 'patterns')")
    found = [BUILTIN[n] for n in dict.fromkeys(named)]
    for i, pattern in enumerate(_strings(where, "patterns", spec.get("patterns", []))):
        try:
            compile_pattern(pattern, probe_speed=True)
        except ValueError as exc:
            raise PolicyFileError(f"{where}: patterns[{i}]: {exc}") from None
        found.append(Detector(f"pattern {i}", pattern))
    return tuple(found)


def _strings(where: str, key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PolicyFileError(f"{where}: {key} must be a list of strings")
    return list(value)


class Markup(Protocol):
    """A reader of an answer's format that knows which of its characters a client never sees
    (reasoning.AnswerSplitter: harmony's markers and message headers, a think block's markers and
    the blank space dropped around them), fed the answer as it streams."""

    def feed(self, text: str) -> Any: ...

    def finish(self) -> Any: ...

    def markup(self) -> tuple[int, list[tuple[int, int]]]:
        """(characters decided so far, spans of them never shown, new since the last call)."""
        ...


# What the scanners read in place of markup: no phrase holds it, and it ends a whole word
MASK = "\ufdd0"


@dataclass
class _Held:
    delta: StreamDelta
    start: int  # where its text starts in the answer (original characters)

    @property
    def end(self) -> int:
        return self.start + len(self.delta.text)


class OutputGuard:
    """One answer's text against output rules, delta by delta.

    `feed` returns the deltas that may be shown now (in order, redactions applied) and the
    policy that blocked the answer, if one did: then nothing more is shown.

    With `markup`, the text only the answer's format reads (harmony's markers and headers:
    `<|start|>assistant<|channel|>analysis<|message|>`; a think block's `<think>`, `</think>`) is
    scanned as MASK characters: a policy reads what the client does. Scanned as written, "anal"
    (not whole-word) stopped every gpt-oss answer at its first header, "think" every Qwen3 or
    DeepSeek-R1 answer at its first marker, and a redaction could rewrite a header (reasoning
    shown as text, a call's recipient masked). Text whose part in the format is not known yet is
    held back; redactions never touch markup."""

    def __init__(self, rules: Rules, markup: Markup | None = None) -> None:
        self.rules = rules
        self._markup = markup
        self._unscanned = ""  # text fed, not scanned yet (its markup not known yet)
        self._hidden: list[tuple[int, int]] = []  # markup spans, scanned as MASK
        self._phrases = rules.phrases.scanner() if rules.phrases is not None else None
        self._patterns = rules.patterns.scanner() if rules.patterns is not None else None
        self._fed = 0
        self._held: list[_Held] = []
        self._spans: list[tuple[int, int, str]] = []  # redactions not yet shown: (start, end, replacement)
        self._shift = 0  # characters the redactions shown so far added (text_start of later logprobs)
        self.redacted: list[Policy] = []  # one entry per redaction, for telemetry

    def feed(self, delta: StreamDelta) -> tuple[list[StreamDelta], Policy | None]:
        start, self._fed = self._fed, self._fed + len(delta.text)
        phrases = patterns = ()
        text, until = self._scannable(delta)
        if self._phrases is not None:
            phrases = self._phrases.feed(text) + (self._phrases.finish() if delta.finished else [])
            until = min(until, self._phrases.held_from)
        if self._patterns is not None:
            try:
                patterns = self._patterns.feed(text) + (self._patterns.finish() if delta.finished else [])
            except PatternTimeout as e:
                self._held.clear()
                return [], self.rules.timed_out(e, "an answer")
            until = min(until, self._patterns.held_from)
        hits = self.rules.hits(phrases, patterns)
        self._held.append(_Held(delta, start))
        blocked = self.rules.first_block(hits)
        if blocked is not None:
            self._held.clear()
            return [], blocked
        for h in hits:
            self.redacted.append(h.policy)
            for i, (s, e) in enumerate(self._shown_parts(h.start, h.end)):
                self._add_span(s, e, h.policy.replacement if i == 0 else "")
        if delta.finished:
            until = self._fed
        shown: list[StreamDelta] = []
        while self._held and self._held[0].end <= until:
            shown.append(self._redacted(self._held.pop(0)))
        return shown, None

    def _scannable(self, delta: StreamDelta) -> tuple[str, int]:
        """(the text to scan now, where the text decided so far ends): the delta's text, or with
        `markup`, the text whose part is now known, its markup as MASK characters."""
        if self._markup is None:
            return delta.text, self._fed
        self._markup.feed(delta.text)
        if delta.finished:
            self._markup.finish()
        decided, hidden = self._markup.markup()
        self._hidden += hidden
        begin = self._fed - len(self._unscanned) - len(delta.text)
        pending = self._unscanned + delta.text
        scan, self._unscanned = list(pending[:decided - begin]), pending[decided - begin:]
        for s, e in hidden:
            lo, hi = max(s, begin) - begin, min(e, decided) - begin
            if hi > lo:
                scan[lo:hi] = MASK * (hi - lo)
        return "".join(scan), decided

    def _shown_parts(self, start: int, end: int) -> list[tuple[int, int]]:
        """[start, end) less the markup in it (a redaction never rewrites the format)."""
        parts, at = [], start
        for s, e in sorted(self._hidden):
            if s < end and e > at:
                if s > at:
                    parts.append((at, s))
                at = max(at, e)
        if at < end:
            parts.append((at, end))
        return parts

    def _add_span(self, start: int, end: int, replacement: str) -> None:
        """Merge [start, end) into the pending redactions (overlapping ones become one)."""
        self._spans = _merged(self._spans, start, end, replacement)

    def _redacted(self, held: _Held) -> StreamDelta:
        delta, ds, de = held.delta, held.start, held.end
        touched = [(s, e, r) for s, e, r in self._spans if s < de and e > ds]
        if not touched:
            if self._shift and delta.logprobs:
                delta = replace(delta, logprobs=[_shifted(lp, self._shift) for lp in delta.logprobs])
            return delta
        text, at = [], ds
        for s, e, r in touched:
            if s >= ds:
                text.append(delta.text[at - ds:s - ds])
                text.append(r)
                self._shift += len(r) - (e - s)
            at = max(at, min(e, de))
        text.append(delta.text[at - ds:])
        self._spans = [span for span in self._spans if span[1] > de]
        # Its token ids and logprobs would spell what was taken out (vLLM's return_token_ids,
        # logprobs): the delta goes without both, as a blocked answer's last one does.
        return replace(delta, text="".join(text), token_ids=[], logprobs=None)


    def screen_calls(self, calls: list[Any]) -> tuple[list[Any], Policy | None]:
        """Parsed tool calls as their client will read them: names, keys and string values after
        JSON decoding. The text scan saw the JSON as written, where `Z\\u00fcrich`, `\\"` or a
        `\\n` between words hide a phrase that the decoded arguments spell. A block match drops
        every call (the answer is stopped); a redact match masks it in that string, but not in a
        call's name: that is one of the tools the client offered (the parser keeps no other), so it
        reveals nothing, and masked it would call no tool the client has."""
        try:
            screened = [replace(c, name=self._screen_name(c.name), arguments=self._screen(c.arguments))
                        for c in calls]
        except _Blocked as b:
            return [], b.policy
        except PatternTimeout as e:
            return [], self.rules.timed_out(e, "a tool call")
        return screened, None

    def _screen_name(self, name: str) -> str:
        """A tool's name, kept as offered: raises _Blocked on a block match."""
        if (blocked := self.rules.first_block(self.rules.find_all(name))) is not None:
            raise _Blocked(blocked)
        return name

    def _screen(self, value: Any) -> Any:
        """`value` with every string (dict keys too) through `_screen_text`, copied. Iterative:
        arguments are nested as deep as the model wrote them."""
        root = [value]
        todo: list[tuple[Any, Any]] = [(root, 0)]
        while todo:
            holder, key = todo.pop()
            node = holder[key]
            if isinstance(node, dict):
                holder[key] = node = {self._screen_text(k) if isinstance(k, str) else k: v for k, v in node.items()}
                todo.extend((node, k) for k in node)
            elif isinstance(node, list):
                holder[key] = node = list(node)
                todo.extend((node, i) for i in range(len(node)))
            elif isinstance(node, str):
                holder[key] = self._screen_text(node)
        return root[0]

    def _screen_text(self, value: str) -> str:
        """One decoded string: raises _Blocked on a block match, else the redactions applied."""
        hits = self.rules.find_all(value)
        if (blocked := self.rules.first_block(hits)) is not None:
            raise _Blocked(blocked)
        spans: list[tuple[int, int, str]] = []
        for h in hits:
            self.redacted.append(h.policy)
            spans = _merged(spans, h.start, h.end, h.policy.replacement)
        for s, e, r in reversed(spans):
            value = value[:s] + r + value[e:]
        return value


def _merged(spans: list[tuple[int, int, str]], start: int, end: int,
            replacement: str) -> list[tuple[int, int, str]]:
    """Redaction `spans` (sorted, disjoint) with [start, end) added: overlapping ones become
    one, with the replacement of the one that starts first."""
    keep = []
    for s, e, r in spans:
        if s < end and start < e:
            start, end, replacement = min(start, s), max(end, e), (r if s < start else replacement)
        else:
            keep.append((s, e, r))
    return sorted([*keep, (start, end, replacement)])


class _Blocked(Exception):
    def __init__(self, policy: Policy) -> None:
        self.policy = policy


def _shifted(lp: TokenLogprob, shift: int) -> TokenLogprob:
    return replace(lp, text_start=max(0, lp.text_start + shift))


def refused_delta(request_id: str, num_prompt_tokens: int, policy: Policy) -> StreamDelta:
    """The whole answer to a prompt an input policy refused: nothing generated."""
    return StreamDelta(request_id=request_id, text="", token_ids=[], finished=True, finish_reason=FINISH_REASON,
                       stop_reason=policy.name, num_prompt_tokens=num_prompt_tokens)


def blocked_delta(last: StreamDelta, policy: Policy) -> StreamDelta:
    """The last delta of an answer an output policy stopped (counters as the engine had them)."""
    return replace(last, text="", token_ids=[], logprobs=None, finished=True, finish_reason=FINISH_REASON,
                   stop_reason=policy.name)
