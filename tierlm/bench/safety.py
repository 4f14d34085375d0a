"""`tierlm bench safety`: the streaming phrase check's cost per token, against regex peers.

The output side of the safety layer (serving/safety.py) reads every streamed token and must
decide, after each one, how much of the answer can be shown and whether a phrase just ended.
The project's target is at most 20 µs per token. This benchmark feeds one generated token
stream, a token at a time, to:

- `tierlm`: `Scanner.feed(token)` then `held_from` (serving/phrase_scan.py, Aho–Corasick);
- `regex_window`: what a typical streaming filter does: one compiled `re` alternation of every
  phrase, re-run per token over the text that can still hold a match ending in that token (the
  last L + 1 characters, L the longest phrase, plus the token), holding back the last L;
- `regex_full`: the naive filter, re-searching the whole answer per token (quadratic: run only
  for small phrase counts and when it fits a time budget; the JSON says why it was skipped).

Both regex peers must find *every* match, as the scanner does, or the comparison would flatter
them: the pattern is a lookahead `(?=(...))` so overlapping matches are found, and the phrase
list is prefix-free (no phrase begins another), because an alternation reports one phrase per
starting point. A whole-word phrase that ends at the end of the text so far is not decided
until the next character (`(?!\\w)` holds at the text's end, but the next token may go on with
the word): it counts on the token that brings that character, or at the end of the stream.

Every run checks that the systems found the same (phrase, start, end) matches; a difference is
printed and the command exits with status 1. Also measured: the one-shot input check
(`PhraseSet.find_all` over the whole text against `re.finditer`), in µs per 1,000 characters;
and the built-in detectors (serving/pattern_scan.py: e-mail, card numbers, ...) streamed over
text with personal data planted in it, tierlm's scanner against the window filter (`finditer`
over the last 2 W characters per token, holding back W = 256), both checked against `finditer`
over the whole text.
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
import string
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from tierlm.cli import at_least, in_range

TARGET_US_PER_TOKEN = 20.0
DEFAULT_PHRASES = [10, 100, 1000, 10000]
SYSTEMS = ("tierlm", "regex_window", "regex_full")

Found = set[tuple[int, int, int]]  # (phrase index, start, end) in the original text

# Filler that makes the text read like English (and gives non-whole-word phrases words to hide in).
_COMMON = ("the of and to in is it that was for on are with as his they be at one have this from or "
           "had by not word but what some we can out other were all there when up use your how said "
           "an each she which do their time if will way about many then them write would like so "
           "these her long make thing see him two has look more day could go come did number sound "
           "no most people my over know water than call first who may down side been now find").split()


@dataclass(frozen=True)
class Workload:
    """One phrase count's inputs: the phrases (text, whole_word) and the token stream."""

    phrases: list[tuple[str, bool]]
    tokens: list[str]
    planted: int  # phrases planted whole in the stream (each is a match)

    @property
    def text(self) -> str:
        return "".join(self.tokens)

    @property
    def longest(self) -> int:
        return max(len(p) for p, _ in self.phrases)


def make_phrases(n: int, seed: int) -> list[tuple[str, bool]]:
    """`n` phrases of 1–3 random words (3–10 lowercase letters), every second one whole-word.

    Prefix-free: a candidate that begins an earlier phrase, or that an earlier one begins, is
    drawn again (see the module docstring). The first k of the list are the list for k, so a
    sweep's smaller sets are parts of its larger ones."""
    rng = random.Random(f"safety-phrases-{seed}")
    taken: set[str] = set()
    prefixes: set[str] = set()  # every prefix of every phrase taken
    out: list[tuple[str, bool]] = []
    while len(out) < n:
        words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 10)))
                 for _ in range(rng.randint(1, 3))]
        phrase = " ".join(words)
        if phrase in prefixes or any(phrase[:k] in taken for k in range(3, len(phrase))):
            continue
        taken.add(phrase)
        prefixes.update(phrase[:k] for k in range(1, len(phrase) + 1))
        out.append((phrase, len(out) % 2 == 1))
    return out


def make_workload(phrases: list[tuple[str, bool]], n_tokens: int, seed: int) -> Workload:
    """A stream of `n_tokens` tokens of English-like ASCII text, split as a detokenizer streams it.

    Words come from common English words, random filler and words of the phrases (so the
    scanner often walks part of a phrase and gives up); a whole phrase, in varied case, is
    planted every ~200 tokens. Words are separated by one white-space character (a space, now
    and then a newline, after a comma or full stop), which goes at the start of the next token;
    tokens are 1–6 characters."""
    rng = random.Random(f"safety-text-{seed}-{len(phrases)}")
    phrase_words = sorted({w for p, _ in phrases for w in p.split()})
    filler = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 9))) for _ in range(150)]
    vocab = _COMMON + filler + rng.sample(phrase_words, min(200, len(phrase_words)))
    weights = [1.0 / (rank + 1) ** 0.8 for rank in range(len(vocab))]
    rng.shuffle(weights)  # phrase words get no fixed place in the frequency ranking
    tokens: list[str] = []
    planted_ends: list[int] = []  # token index each planted phrase ends in
    next_plant = rng.randint(150, 250)
    sep = ""
    while len(tokens) < n_tokens:
        if len(tokens) >= next_plant:
            text, _ = rng.choice(phrases)
            text = rng.choice((str.lower, str.lower, str.title, str.upper))(text)
            next_plant = len(tokens) + rng.randint(150, 250)
            plant = True
        else:
            text = rng.choice(vocab) if rng.random() < 0.3 else rng.choices(vocab, weights)[0]
            plant = False
        piece = sep + text
        while piece:
            cut = rng.randint(1, 6)
            tokens.append(piece[:cut])
            piece = piece[cut:]
        if plant:
            planted_ends.append(len(tokens) - 1)
        r = rng.random()
        sep = "\n" if r < 0.02 else ", " if r < 0.07 else ". " if r < 0.11 else " "
    tokens = tokens[:n_tokens]
    return Workload(phrases, tokens, sum(end < n_tokens for end in planted_ends))


def regex_source(phrases: Sequence[tuple[str, bool]]) -> str:
    """One alternation of every phrase inside a lookahead: a zero-width match at each start
    position, so finditer also finds matches that overlap."""
    alts = []
    for phrase, whole_word in phrases:
        body = r"\s+".join(re.escape(w) for w in phrase.split())
        alts.append(rf"(?<!\w){body}(?!\w)" if whole_word else body)
    return "(?=(" + "|".join(alts) + "))"


def _phrase_of(phrases: Sequence[tuple[str, bool]]) -> Callable[[str], int]:
    """Matched text -> phrase index (phrases are unique and prefix-free, so one fits)."""
    index = {p: i for i, (p, _) in enumerate(phrases)}
    return lambda text: index[" ".join(text.lower().split())]


def run_tierlm(phrase_set, tokens: Sequence[str]) -> tuple[float, Found, float]:
    """(seconds, matches, mean characters held back after a token)."""
    return _run_scanner(phrase_set.scanner(), tokens, lambda m: (m.phrase, m.start, m.end))


def _run_scanner(scanner, tokens: Sequence[str], key: Callable) -> tuple[float, set, float]:
    """A tierlm scanner fed a token at a time: (seconds, matches as `key`s, mean characters held)."""
    found = []
    held = fed = 0
    t0 = time.perf_counter()
    for tok in tokens:
        found += scanner.feed(tok)
        fed += len(tok)
        held += fed - scanner.held_from
    found += scanner.finish()
    elapsed = time.perf_counter() - t0
    return elapsed, {key(m) for m in found}, held / max(1, len(tokens))


def run_regex(pattern: re.Pattern, phrases: Sequence[tuple[str, bool]], tokens: Sequence[str],
              window: bool) -> tuple[float, Found, float]:
    """The regex peers: re-search the last L + 1 characters plus the new token (`window`) or
    the whole text so far, per token; count a match once, on the token holding the character
    that decides it (its last one; for a whole-word phrase, the one after it)."""
    phrase_of = _phrase_of(phrases)
    whole = [w for _, w in phrases]
    longest = max(len(p) for p, _ in phrases)
    keep = longest + 1 if window else None  # + 1: the character a leading (?<!\w) looks at
    finditer = pattern.finditer
    found: list[tuple[int, int, int]] = []
    tail, base, held = "", 0, 0  # base: the original offset of tail[0]
    t0 = time.perf_counter()
    for tok in tokens:
        text = tail + tok
        old, n = len(tail), len(text)
        for m in finditer(text):
            s, e = m.span(1)
            if e < old:  # decided by an earlier token
                continue
            i = phrase_of(m.group(1))
            if (old <= e < n) if whole[i] else e > old:
                found.append((i, base + s, base + e))
        held += min(base + n, longest)  # a phrase's first L - 1 characters, or a whole word's L
        if keep is not None and n > keep:
            base += n - keep
            tail = text[-keep:]
        else:
            tail = text
    n = len(tail)
    for m in finditer(tail):  # the end of the text decides the whole-word phrases that end there
        s, e = m.span(1)
        if e == n and whole[i := phrase_of(m.group(1))]:
            found.append((i, base + s, base + e))
    elapsed = time.perf_counter() - t0
    return elapsed, set(found), held / max(1, len(tokens))


def first_difference(name_a: str, a: Found, name_b: str, b: Found,
                     phrases: Sequence[tuple[str, bool]]) -> str | None:
    """The earliest match (by end, then start) one system found and the other did not; None if
    they agree."""
    diff = sorted(a ^ b, key=lambda m: (m[2], m[1], m[0]))
    if not diff:
        return None
    i, s, e = diff[0]
    who, other = (name_a, name_b) if diff[0] in a else (name_b, name_a)
    phrase, whole_word = phrases[i]
    return (f"{who} found phrase {i} {phrase!r}{' (whole word)' if whole_word else ''} at [{s}, {e}) and "
            f"{other} did not ({len(a)} vs {len(b)} matches, {len(diff)} differ)")


def _median_run(run: Callable[[], tuple[float, Found, float]], repeats: int) -> tuple[list[float], Found, float]:
    times, first, held = [], None, 0.0
    for _ in range(repeats):
        t, found, held = run()
        times.append(t)
        first = found if first is None else first
    return times, first, held


def bench_one(n: int, args: argparse.Namespace, phrases: list[tuple[str, bool]]) -> dict:
    """Every system on one phrase count: result rows, the input check, and any disagreement."""
    from tierlm.serving.phrase_scan import compile_phrases

    work = make_workload(phrases, args.tokens, args.seed)
    t0 = time.perf_counter()
    phrase_set = compile_phrases(phrases)
    tierlm_compile = time.perf_counter() - t0
    source = regex_source(phrases)
    t0 = time.perf_counter()
    pattern = re.compile(source, re.IGNORECASE)
    regex_compile = time.perf_counter() - t0
    tokens, T = work.tokens, len(work.tokens)

    runs: dict[str, Callable[[], tuple[float, Found, float]]] = {
        "tierlm": lambda: run_tierlm(phrase_set, tokens),
        "regex_window": lambda: run_regex(pattern, phrases, tokens, window=True),
    }
    skipped = _full_skip_reason(n, args, pattern, phrases, tokens)
    if skipped is None:
        runs["regex_full"] = lambda: run_regex(pattern, phrases, tokens, window=False)
    rows, found = [], {}
    for system, run in runs.items():
        times, found[system], held = _median_run(run, args.repeats)
        samples = [t / T * 1e6 for t in times]
        row = {"system": system, "phrases": n, "us_per_token": statistics.median(samples),
               "samples_us_per_token": samples,
               "compile_s": tierlm_compile if system == "tierlm" else regex_compile,
               "matches": len(found[system]), "mean_held_chars": held}
        if system == "tierlm":
            row["meets_target"] = row["us_per_token"] <= TARGET_US_PER_TOKEN
        rows.append(row)
    if skipped is not None:
        rows.append({"system": "regex_full", "phrases": n, "us_per_token": None, "compile_s": regex_compile,
                     "matches": None, "skipped": skipped})

    differences = [f"{n} phrases: {d}" for other in found if other != "tierlm"
                   if (d := first_difference("tierlm", found["tierlm"], other, found[other], phrases))]
    check = _input_check(n, work.text, phrase_set, pattern, phrases, args.repeats)
    if check["first_difference"] is not None:
        differences.append(f"{n} phrases, input check: {check['first_difference']}")
    by = {r["system"]: r for r in rows}
    shown = ", ".join(f"{s} {r['us_per_token']:.1f} µs/token" for s, r in by.items() if r["us_per_token"] is not None)
    print(f"{n} phrases ({T} tokens, {len(work.text)} chars, {work.planted} planted, {len(found['tierlm'])} matches): "
          f"{shown}; regex_window/tierlm {by['regex_window']['us_per_token'] / by['tierlm']['us_per_token']:.1f}x"
          + (f"; regex_full skipped: {skipped}" if skipped else ""), flush=True)
    return {"rows": rows, "input_check": check, "differences": differences,
            "text": {"phrases": n, "tokens": T, "chars": len(work.text), "planted": work.planted,
                     "longest_phrase_chars": work.longest}}


def _full_skip_reason(n: int, args: argparse.Namespace, pattern: re.Pattern, phrases, tokens) -> str | None:
    """Why regex_full is not run for `n` phrases, or None. Its time grows with the square of the
    tokens, so a run over the first few hundred tokens predicts the rest."""
    if n > args.full_max_phrases:
        return f"more than --full-max-phrases {args.full_max_phrases} phrases"
    probe = tokens[:min(len(tokens), 300)]
    elapsed, _, _ = run_regex(pattern, phrases, probe, window=False)
    estimate = elapsed * (len(tokens) / len(probe)) ** 2 * args.repeats
    if estimate > args.full_budget_s:
        return f"would take about {estimate:.0f} s (--full-budget-s {args.full_budget_s:g})"
    return None


def _input_check(n: int, text: str, phrase_set, pattern: re.Pattern, phrases, repeats: int) -> dict:
    """The prompt check: the whole text at once. (µs per 1,000 characters, median of repeats.)"""
    phrase_of = _phrase_of(phrases)
    tierlm_t, regex_t = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ours = phrase_set.find_all(text)
        tierlm_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        theirs = [(phrase_of(m.group(1)), m.start(1), m.end(1)) for m in pattern.finditer(text)]
        regex_t.append(time.perf_counter() - t0)
    ours_set = {(m.phrase, m.start, m.end) for m in ours}
    per_k = 1e9 / len(text)  # seconds -> µs per 1,000 characters
    row = {"phrases": n, "chars": len(text),
           "tierlm_us_per_1k_chars": statistics.median(tierlm_t) * per_k,
           "regex_us_per_1k_chars": statistics.median(regex_t) * per_k,
           "tierlm_matches": len(ours_set), "regex_matches": len(set(theirs))}
    row["regex_over_tierlm"] = row["regex_us_per_1k_chars"] / row["tierlm_us_per_1k_chars"]
    row["first_difference"] = first_difference("find_all", ours_set, "re.finditer", set(theirs), phrases)
    return row


def run(args: argparse.Namespace) -> dict:
    from tierlm.bench.outputs import check_outputs, write_json
    outs = check_outputs({"--json": args.json, "--plot": args.plot})
    args.json, args.plot = outs["--json"], outs["--plot"]
    counts = sorted(args.phrases)
    all_phrases = make_phrases(counts[-1], args.seed)
    results, checks, texts, differences = [], [], [], []
    for n in counts:
        one = bench_one(n, args, all_phrases[:n])
        results += one["rows"]
        checks.append(one["input_check"])
        texts.append(one["text"])
        differences += one["differences"]
    by = {(r["system"], r["phrases"]): r for r in results}
    ratios = []
    for n in counts:
        base = by[("tierlm", n)]["us_per_token"]
        ratio = {"phrases": n, "regex_window_over_tierlm": by[("regex_window", n)]["us_per_token"] / base}
        full = by[("regex_full", n)]["us_per_token"]
        ratio["regex_full_over_tierlm"] = None if full is None else full / base
        ratios.append(ratio)
    result = {"phrases": counts, "tokens": args.tokens, "seed": args.seed, "repeats": args.repeats,
              "target_us_per_token": TARGET_US_PER_TOKEN,
              "tierlm_meets_target": all(by[("tierlm", n)]["meets_target"] for n in counts),
              "results": results, "ratios": ratios, "input_check": checks, "texts": texts,
              "agree": not differences, "differences": differences}
    result["detectors"] = bench_detectors(args)
    if not result["detectors"]["agree"]:
        result["agree"] = False
        result["differences"].append("detectors: tierlm, regex_window and finditer over the whole text differ")
    _print_summary(result)
    write_json(args.json, result)
    if args.plot is not None:
        plot_safety(result, args.plot)
    return result


# ---- detectors (serving/pattern_scan.py) ---------------------------------------------

_PII = ("jane.doe@example.com", "ops+alerts@mail.example.org", "4111 1111 1111 1111", "5500-0000-0000-0004",
        "123-45-6789", "192.168.1.20", "AKIAIOSFODNN7EXAMPLE")
DETECTOR_WINDOW = 256  # characters a window filter re-reads per token: the longest e-mail address, about


def make_detector_tokens(n_tokens: int, seed: int) -> tuple[list[str], int]:
    """English-like words with personal data planted about once in 70 words, cut into tokens of
    1-6 characters: (tokens, items planted whole in them)."""
    rng = random.Random(seed)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < n_tokens * 6:  # enough text for n_tokens tokens
        words.append(rng.choice(_PII) if rng.random() < 0.015 else rng.choice(_COMMON))
    text = " ".join(words)
    tokens, at = [], 0
    while len(tokens) < n_tokens:
        size = rng.randint(1, 6)
        tokens.append(text[at:at + size])
        at += size
    planted, end = 0, 0
    for w in words:
        end += len(w) + 1
        planted += w in _PII and end - 1 <= at
    return tokens, planted


def run_detectors_tierlm(patterns, tokens: Sequence[str]) -> tuple[float, set, float]:
    return _run_scanner(patterns.scanner(), tokens, lambda m: (m.detector, m.start, m.end))


def run_detectors_window(patterns, tokens: Sequence[str]) -> tuple[float, set, float]:
    """The usual streaming filter: per token, `finditer` over the last 2 W characters (W =
    DETECTOR_WINDOW); a match is final once it ends W characters before the end of the text so
    far (or the text has ended), and the last W characters are held. Matches starting in the
    first W / 2 characters scanned are left out: the scan may have cut them, and any real one
    there was final in an earlier scan (the planted items are under W / 2 long)."""
    W, find_all = DETECTOR_WINDOW, patterns.find_all
    found: set = set()
    text, fed, held = "", 0, 0
    t0 = time.perf_counter()
    for tok in tokens:
        text += tok
        fed += len(tok)
        start = max(0, fed - 2 * W)
        for m in find_all(text[start:]):
            if start + m.end <= fed - W and (start == 0 or m.start >= W // 2):
                found.add((m.detector, start + m.start, start + m.end))
        held += min(W, fed)
    start = max(0, fed - 2 * W)
    for m in find_all(text[start:]):
        if start == 0 or m.start >= W // 2:
            found.add((m.detector, start + m.start, start + m.end))
    return time.perf_counter() - t0, found, held / max(1, len(tokens))


def bench_detectors(args: argparse.Namespace) -> dict:
    """The built-in detectors streamed: tierlm's scanner against the window filter."""
    from tierlm.serving.pattern_scan import BUILTIN, PatternSet
    patterns = PatternSet(list(BUILTIN.values()))
    tokens, planted = make_detector_tokens(args.tokens, args.seed)
    rows, found = {}, {}
    for name, fn in (("tierlm", run_detectors_tierlm), ("regex_window", run_detectors_window)):
        times, matches, held = [], None, 0.0
        for _ in range(args.repeats):
            t, matches, held = fn(patterns, tokens)
            times.append(t)
        found[name] = matches
        rows[name] = {"system": name, "us_per_token": statistics.median(times) / len(tokens) * 1e6,
                      "matches": len(matches), "mean_held_chars": held}
    reference = {(m.detector, m.start, m.end) for m in patterns.find_all("".join(tokens))}
    return {"detectors": sorted(BUILTIN), "tokens": len(tokens), "planted": planted, "window_chars": DETECTOR_WINDOW,
            "results": list(rows.values()),
            "regex_window_over_tierlm": rows["regex_window"]["us_per_token"] / rows["tierlm"]["us_per_token"],
            "tierlm_meets_target": rows["tierlm"]["us_per_token"] <= TARGET_US_PER_TOKEN,
            "agree": found["tierlm"] == found["regex_window"] == reference}


def _print_summary(result: dict) -> None:
    print(f"\n{'phrases':>8} {'system':<13} {'µs/token':>10} {'compile s':>10} {'matches':>8} {'held chars':>10}")
    for r in sorted(result["results"], key=lambda r: (r["phrases"], SYSTEMS.index(r["system"]))):
        if r["us_per_token"] is None:
            print(f"{r['phrases']:>8} {r['system']:<13} {'skipped':>10}  ({r['skipped']})")
            continue
        print(f"{r['phrases']:>8} {r['system']:<13} {r['us_per_token']:>10.2f} {r['compile_s']:>10.4f} "
              f"{r['matches']:>8} {r['mean_held_chars']:>10.1f}")
    for r in result["ratios"]:
        full = r["regex_full_over_tierlm"]
        print(f"{r['phrases']} phrases: regex_window / tierlm {r['regex_window_over_tierlm']:.1f}x"
              + ("" if full is None else f", regex_full / tierlm {full:.0f}x"))
    for c in result["input_check"]:
        print(f"input check, {c['phrases']} phrases: tierlm {c['tierlm_us_per_1k_chars']:.0f} µs / 1k chars, "
              f"re.finditer {c['regex_us_per_1k_chars']:.0f} ({c['regex_over_tierlm']:.1f}x)")
    met = "meets" if result["tierlm_meets_target"] else "does NOT meet"
    print(f"tierlm {met} the {result['target_us_per_token']:g} µs/token target at every phrase count; "
          f"matches {'agree' if result['agree'] else 'DISAGREE'}")
    d = result["detectors"]
    rows = {r["system"]: r for r in d["results"]}
    print(f"detectors ({', '.join(d['detectors'])}), {d['tokens']} tokens, {d['planted']} planted: tierlm "
          f"{rows['tierlm']['us_per_token']:.2f} µs/token (holds {rows['tierlm']['mean_held_chars']:.1f} chars), "
          f"regex_window {rows['regex_window']['us_per_token']:.2f} (holds {rows['regex_window']['mean_held_chars']:.0f}),"
          f" {d['regex_window_over_tierlm']:.1f}x; {rows['tierlm']['matches']} matches, "
          f"{'agree' if d['agree'] else 'DISAGREE'}")
    for d in result["differences"][:1]:
        print(f"first difference: {d}")


def plot_safety(result: dict, path: str) -> str:
    """µs per token against phrase count, both axes log (the systems are orders of magnitude
    apart), the target as a dashed line."""
    from tierlm.bench.plots import line_plot
    series: dict[str, tuple[list[float], list[float]]] = {}
    for system in SYSTEMS:
        pts = [(r["phrases"], r["us_per_token"]) for r in result["results"]
               if r["system"] == system and r["us_per_token"] is not None]
        if pts:
            series[system] = ([x for x, _ in pts], [y for _, y in pts])
    xs = result["phrases"]
    target = f"target ({result['target_us_per_token']:g} µs)"
    series[target] = ([xs[0], xs[-1]], [result["target_us_per_token"]] * 2)
    return line_plot(path, series, f"Streaming phrase check, {result['tokens']} tokens fed one at a time",
                     "phrases", "µs per token (median)", logx=True, logy=True,
                     styles={target: {"linestyle": "--", "color": "gray", "marker": None}})


def _count_list(text: str) -> list[int]:
    try:  # an empty item ("10,,100") is refused, not skipped
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated phrase counts of at least 1, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"a phrase count is given twice in {text!r}; give each once")
    return values


def _main(args: argparse.Namespace) -> int:
    return 0 if run(args)["agree"] else 1


def add_cli(sub) -> None:
    p = sub.add_parser("safety", help="the streaming phrase check's cost per token: tierlm vs regex filters")
    p.add_argument("--phrases", type=_count_list, default=DEFAULT_PHRASES,
                   help="comma-separated phrase counts to sweep (default: 10,100,1000,10000)")
    p.add_argument("--tokens", type=at_least(1, int), default=5000,
                   help="tokens in the streamed text (regex_window takes ~6 ms a token at 10,000 phrases)")
    p.add_argument("--repeats", type=at_least(1, int), default=3, help="timed runs per system (the median is reported)")
    p.add_argument("--full-max-phrases", type=at_least(0, int), default=100,
                   help="run regex_full (re-search the whole text per token) only up to this many phrases")
    p.add_argument("--full-budget-s", type=in_range(float, 0), default=60.0,
                   help="skip regex_full where its runs are predicted to take longer than this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=_main)
