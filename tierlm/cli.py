"""`tierlm serve | generate | bench ...` — one entry point, subcommands in their own modules."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from typing import NoReturn

from tierlm.errors import TierlmError


def at_least(low: float, kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: `kind` of the text, refused below `low` (and NaN) with a message naming the value."""
    def parse(text: str) -> float:
        value = kind(text)
        if not value >= low:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"must be at least {low:g}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value" messages
    return parse


def in_range(kind: Callable[[str], float], low: float, high: float | None = None, *,
             low_open: bool = False, high_open: bool = False) -> Callable[[str], float]:
    """An argparse type: `kind` of the text within [low, high] (an end left out with `low_open` /
    `high_open`), refused (and NaN) with argparse's one-line error naming the flag, before anything loads."""
    def parse(text: str) -> float:
        value = kind(text)
        ok = (value > low if low_open else value >= low) and (
            high is None or (value < high if high_open else value <= high))
        if not ok:  # NaN fails every comparison
            if high is None:
                raise argparse.ArgumentTypeError(f"must be {'more than' if low_open else 'at least'} {low:g}, "
                                                 f"got {text}")
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}{low:g}, {high:g}"
                                             f"{')' if high_open else ']'}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from tierlm.engine.fairness import SCHEDULING_POLICIES
    from tierlm.kv.policies import DEFAULT_POLICY, POLICIES
    from tierlm.models.kv_dtype import KV_CACHE_DTYPES
    from tierlm.models.kv_scales import KV_CACHE_SCALES

    p.add_argument("--model", default=None, help="local Hugging Face checkpoint dir (default: built-in demo model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--compute-dtype", default="auto",
                   help="auto (float32 on CPUs where its GEMMs are faster) | float32 | bfloat16 | float16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--scheduling-policy", default="fair", choices=SCHEDULING_POLICIES,
                   help="within one priority: 'fair' shares the engine equally between tenants (the least "
                        "served goes next), 'fcfs' runs requests in arrival order (default: fair)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="device KV pool: a size ('8GiB'), a count ('2000 blocks') or bytes "
                        "(default: a share of free memory)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="what K/V are stored as: auto (the model's dtype) | float32 | bfloat16 | float16 | fp8 "
                        "(= fp8_e4m3, 1 byte per value: twice a bf16 pool's tokens) | fp8_e5m2 (default: auto)")
    p.add_argument("--kv-cache-scales", default="auto", choices=list(KV_CACHE_SCALES),
                   help="fp8 caches: per-layer k/v scales from the checkpoint, else calibrated at load (auto) | "
                        "the checkpoint's, else 1.0 as vLLM does (checkpoint) | always calibrated (calibrate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="record decode steps and short prefill chunks as CUDA graphs and replay them "
                        "(measured on one H100: a prefix hit 22 -> 6 ms; opt-in until its fixes run on a GPU)")
    p.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="auto: the sampling settings of the model's generation_config.json (temperature, top_p, "
                        "top_k, min_p, repetition_penalty) serve requests that leave them unset, as vLLM does | "
                        "vllm: tierlm's own defaults (temperature 1, no filters)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding by n-gram lookup, vLLM\'s shape: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                        "(default: off)")
    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters (PEFT checkpoints) on the base model, chosen per request")
    lora.add_argument("--max-loras", type=at_least(1, int), default=4,
                      help="distinct adapters in one batch; requests of others wait for a slot (default: 4)")
    lora.add_argument("--max-lora-rank", type=at_least(1, int), default=64,
                      help="the largest rank an adapter may have (default: 64)")
    kv = p.add_argument_group("KV cache tiers")
    kv.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                    help="turn off automatic prefix caching")
    kv.add_argument("--eviction-policy", default=DEFAULT_POLICY, choices=POLICIES, help="device pool eviction policy (see tierlm bench cache)")
    kv.add_argument("--kv-host-capacity", default=None, help="host-memory tier size: '2GiB', '1000 blocks' or bytes")
    kv.add_argument("--kv-disk-dir", default=None, help="directory for the local-disk tier (off if not given; kept across restarts, one engine at a time)")
    kv.add_argument("--kv-disk-capacity", default=None, help="disk tier size: '20GiB', '100000 blocks' or bytes (default: half of the free space "
                    "plus what the tier's own entries use)")
    kv.add_argument("--kv-disk-write-through", action="store_true",
                    help="write every computed block to disk at once (a crash then leaves the cache on disk; "
                         "default: only what host memory evicts, and everything on a clean stop)")
    kv.add_argument("--kv-remote", default=None, metavar="URL", help="shared Redis tier, e.g. redis://127.0.0.1:6379/0")
    kv.add_argument("--kv-remote-capacity", default=None,
                    help="sets the Redis server's maxmemory (volatile-lru, a TTL on every tierlm key): '50GiB', "
                         "blocks or bytes; only for a Redis dedicated to the KV cache (default: the server's own limit)")
    kv.add_argument("--kv-remote-ttl", type=int, default=None, help="seconds a block lives in Redis")
    kv.add_argument("--kv-tier-policy", default=DEFAULT_POLICY, choices=POLICIES,
                    help="eviction policy of the host and disk tiers (unless set per tier)")
    kv.add_argument("--kv-prefetch", default=None, action=argparse.BooleanOptionalAction,
                    help="read a new request's disk/Redis prefix in the background while the engine steps "
                         "(default: on for CUDA or with --kv-remote, else off on CPU)")
    kv.add_argument("--kv-read-timeout", type=float, default=5.0,
                    help="seconds a request waits for its disk/Redis prefix before starting without the rest "
                         "(recomputed); a slower Redis round trip counts as an outage (default: 5)")
    kv.add_argument("--kv-host-policy", default=None, choices=POLICIES, help="host tier policy (default: --kv-tier-policy)")
    kv.add_argument("--kv-disk-policy", default=None, choices=POLICIES, help="disk tier policy (default: --kv-tier-policy)")
    kv.add_argument("--kv-policy-history", type=int, default=1 << 18, metavar="BLOCKS",
                    help="blocks a learning eviction policy (duel, gittins, ...) remembers per tier, ~340 bytes "
                         "each (default: 262144, ~85 MiB)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(device=args.device, dtype=args.dtype, compute_dtype=args.compute_dtype, block_size=args.block_size,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                scheduling_policy=args.scheduling_policy, max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                kv_cache_dtype=args.kv_cache_dtype, kv_cache_scales=args.kv_cache_scales, seed=args.seed,
                enable_prefix_caching=args.prefix_caching, eviction_policy=args.eviction_policy,
                kv_host_capacity=args.kv_host_capacity, kv_disk_dir=args.kv_disk_dir,
                kv_disk_capacity=args.kv_disk_capacity, kv_remote=args.kv_remote,
                kv_remote_capacity=args.kv_remote_capacity, kv_remote_ttl=args.kv_remote_ttl,
                kv_tier_policy=args.kv_tier_policy,
                kv_host_policy=args.kv_host_policy, kv_disk_policy=args.kv_disk_policy,
                kv_prefetch=args.kv_prefetch, kv_disk_write_through=args.kv_disk_write_through,
                kv_read_timeout=args.kv_read_timeout, kv_policy_history=args.kv_policy_history,
                cuda_graphs=args.cuda_graphs, enable_lora=args.enable_lora, max_loras=int(args.max_loras),
                max_lora_rank=int(args.max_lora_rank), speculative_config=args.speculative_config,
                generation_config=args.generation_config)


def _generate(args: argparse.Namespace) -> int:
    """Bad input (settings, model directory, sampling parameters) ends in `main`'s one error line."""
    from tierlm import AsyncEngine, SamplingParams
    from tierlm.models.demo import RANDOM_WEIGHTS_NOTICE

    if args.model is None:
        print(f"note: {RANDOM_WEIGHTS_NOTICE}", file=sys.stderr)
    # Checked before the model loads (seconds to minutes); the parser already checked each flag's range.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed if args.temperature > 0 else None)
    params.validate()
    kw = engine_kwargs(args)
    kw["max_num_seqs"] = 1 if args.max_num_seqs == 64 else args.max_num_seqs  # one prompt: size KV for one
    engine = AsyncEngine.from_model(args.model, **kw)

    async def run() -> None:
        await engine.start()
        try:
            prompt = engine.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
            async for d in engine.generate(prompt, params):
                sys.stdout.write(d.text)
                sys.stdout.flush()
                if d.finished:
                    sys.stdout.write("\n")
                    print(f"[{d.num_output_tokens} tokens, finish_reason={d.finish_reason}]", file=sys.stderr)
        finally:
            await engine.shutdown()

    asyncio.run(run())
    return 0


class _Parser(argparse.ArgumentParser):
    """Bad command-line input is one `error:` line and a pointer to --help (argparse's default
    prints the whole usage first, two dozen lines for `serve`); subcommands inherit this."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nsee: {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tierlm", description="tierlm: multi-tenant LLM inference server")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="debug | info | warning | error | critical (any case; default: info)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    _add_engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=in_range(int, 1), default=64)
    g.add_argument("--temperature", type=in_range(float, 0, 100), default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=in_range(float, 0, 1, low_open=True), default=1.0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.set_defaults(func=_generate)

    try:
        from tierlm.serving.cli import add_serve_parser
        add_serve_parser(sub)
    except ImportError:  # serving layer not installed in this build
        pass

    from tierlm.kv.cli import add_cli as add_kv_cli
    add_kv_cli(sub)
    from tierlm.dist.cli import add_router_parser
    add_router_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks (JSON + PNG, ratios against a peer in the same run)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from tierlm.bench import throughput
    throughput.add_cli(bsub)
    for mod in ("cache", "prefix", "score", "serve", "sweep", "fairness", "sla", "safety", "router", "limits",
                "batches", "lora", "spec", "kv_dtype"):
        try:
            m = __import__(f"tierlm.bench.{mod}", fromlist=["add_cli"])
        except ImportError:
            continue
        if hasattr(m, "add_cli"):
            m.add_cli(bsub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # (imports torch: a second or so)
    except KeyboardInterrupt:  # Ctrl-C at once: status 130, as later, without the import's traceback
        return 130
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve --replicas` starts each replica with it
    if extra:  # argparse takes a subcommand's positional list only before its options
        more = getattr(args, "more_positionals", None)
        if more and extra[0] == "--":
            extra = extra[1:]
        unknown = [x for x in extra if x.startswith("-")] if more else extra
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        getattr(args, more).extend(extra)
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command (`args.func`): bad input or a missing file is one line and exit
    status 2, not a traceback; Ctrl-C is exit status 130 (as a shell reports SIGINT), also without one:
    `serve` has shut down gracefully and saved its KV cache by the time uvicorn re-raises it.
    Also the entry of the modules runnable with `python -m`."""
    logging.basicConfig(level=getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (TierlmError, ValueError, OSError) as e:
        logging.getLogger("tierlm").debug("%s failed", getattr(args, "command", args.func.__module__),
                                          exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
