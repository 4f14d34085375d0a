"""The synchronous engine core: admit requests, run steps, hand back deltas.

`step()` is one scheduler decision + one model forward + sampling + detokenization. Both the
offline `LLM` and the threaded `AsyncEngine` drive this same object, so there is one path.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import numbers
import os
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tierlm.config import EngineConfig, check_kv_pool_memory, default_kv_cache_memory, host_memory, kv_pool_bytes
from tierlm.engine.detokenizer import IncrementalDetokenizer
from tierlm.engine.generation_defaults import sampling_defaults
from tierlm.engine.graphs import StepGraphsConfig
from tierlm.engine.outputs import StreamDelta, TokenLogprob
from tierlm.engine.request import Request, RequestStatus
from tierlm.engine.runner import ModelRunner, kv_bytes_per_block
from tierlm.engine.grammar import GrammarCompiler
from tierlm.engine.loras import LoRARegistry
from tierlm.engine.pooling import pooled_embedding
from tierlm.engine.sampler import Sampler, prompt_logprobs, seeded_generator
from tierlm.engine.load import ArrivalRates, OutputLengths, StepTimeModel, TtftCalibration, estimate_ttft
from tierlm.engine.scheduler import Scheduler
from tierlm.engine.speculative import NgramProposer, SpeculativeConfig
from tierlm.engine.tokenizer import load_tokenizer
from tierlm.errors import InvalidRequestError, ModelLoadError, RequestTooLongError
from tierlm.kv.admin import lock_holder, model_dir_names, write_about
from tierlm.kv.block_pool import BlockPool
from tierlm.kv.manager import BlockIO, KVCacheManager
from tierlm.kv.policies import EvictionPolicy, make_policy, partition_history
from tierlm.kv.store import TieredStore
from tierlm.kv.tiers import (ENTRY_HEADER_BYTES, DiskTier, HostTier, Layout, RedisTier, host_block_bytes,
                             parse_capacity)
from tierlm.models.fingerprint import BackgroundFingerprint, weight_stamps, weights_fingerprint
from tierlm.models.config import load_config_dict, parse_config
from tierlm.models.kv_dtype import resolve_kv_cache_dtype
from tierlm.models.kv_scales import resolve_kv_scales, scales_tag
from tierlm.models.loader import check_model_dir, load_model, resolve_dtype, weight_files
from tierlm.models.lora import LoRAAdapter, LoRARequest
from tierlm.models.registry import resolve_architecture
from tierlm.sampling_params import BadWords, PoolingParams, SamplingParams, ThinkingTracker, bad_words_token_ids, truncate_prompt

log = logging.getLogger(__name__)

# With nothing else to run, an AsyncEngine's step waits this long at most for a prefix read,
# then returns, so its loop takes new requests and aborts while the read goes on.
READ_POLL_S = 0.02


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    last_step_tokens: int
    last_step_seqs: int
    kv_evictions: int = 0
    kv_device_hit_blocks: int = 0  # prefix blocks found on the device (lower tiers: kv_tiers)
    kv_promoted_blocks: int = 0
    kv_promoted_bytes: int = 0
    kv_demoted_blocks: int = 0
    kv_demoted_bytes: int = 0
    kv_tiers: dict | None = None  # per lower tier: hits, misses, stores, evictions, promotions, bytes, corrupt, errors
    kv_tier_usage: dict | None = None  # host and disk: {"blocks": held now, "capacity": blocks}
    # Host memory the lower tiers use beyond the host tier itself: blocks queued for the disk or
    # Redis writer (up to 1 GiB when they cannot keep up), blocks read from disk or Redis
    # waiting to go back to the device, and the lower-tier runs that requests waiting for device
    # room keep for their next try (each up to 1 GiB).
    kv_write_backlog_bytes: int = 0
    kv_staged_bytes: int = 0
    kv_held_bytes: int = 0
    # With LoRA: per adapter (loaded, or still used by requests after its removal), its requests
    # {"running": n, "waiting": n}; None when the engine serves no adapters.
    lora_requests: dict | None = None
    # Tenants' cache partitions (kv_cache_share): per tenant {"blocks": its cached blocks no
    # request holds now, "capacity": the blocks its share keeps}; None when there are none.
    kv_cache_partitions: dict | None = None
    kv_host_partitions: dict | None = None  # the same for the host tier: its blocks, and capacity
    # Speculative decoding (vLLM's spec_decode counters): a request's steps that checked guesses,
    # the guesses checked, and those accepted (each a token that cost no step of its own).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # What K/V are stored as (kv_cache_dtype resolved: "bfloat16", "float8_e4m3fn", ...) and
    # tokens per block: with kv_blocks_total, the pool's shape (vLLM's cache_config_info).
    kv_cache_dtype: str = ""
    block_size: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of prompt tokens served from the cache (any tier)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def model_identity(model_dir: Path, dtype: torch.dtype, kv_dtype: torch.dtype | str,
                   fingerprint: str | None = None, weights_dtype: torch.dtype | None = None) -> str:
    """Mixed into every block hash: engines share cached K/V only for the same weights and dtypes
    (`kv_dtype`: the storage dtype, with an fp8 cache's scales tag where it has scales).
    `weights_dtype`: what the weights were rounded to when it is not the compute dtype `dtype`
    (dtype bfloat16 computed in float32): without it, that engine and one with float32 weights and
    a bfloat16 KV cache had one id, so one was served K/V the other's weights computed.

    The weights part is `weights_fingerprint` (a SHA-256 of config.json and every weight file the
    loader reads, cached per file), passed in when it was computed already; never the directory's
    name, so equal weights under any path share blocks and different weights never do."""
    if fingerprint is None:
        fingerprint = weights_fingerprint(model_dir)
    rounded = f"/weights:{weights_dtype}" if weights_dtype is not None and weights_dtype != dtype else ""
    return f"{fingerprint[:32]}:{dtype}{rounded}:{kv_dtype}"


def disk_tier_dir(root: str | Path, model_id: str, label: str = "model") -> Path:
    """Each model's blocks in a directory of its own under `kv_disk_dir`, so that several models
    (one server, or one after another) never count against or scan each other's entries.
    `label` (the checkpoint directory's name) only makes it readable and keeps two engines serving
    equal weights from different paths out of each other's locked directory; it is not in any
    block key, which `model_id` alone decides."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", label)[:64] or "model"
    return Path(root) / f"{name}-{hashlib.sha256(model_id.encode()).hexdigest()[:12]}"


def check_host_capacity(nbytes: int, others: int = 0) -> None:
    """A host tier larger than the machine's memory would end in the OOM killer, hours in: refuse
    it now. Larger than what is free now, it may still fit once caches are dropped: warn.
    `others`: what this process's other host tiers (other models') may take, as they fill too."""
    mem = host_memory()
    if not nbytes or mem is None:
        return
    total, avail = mem
    gib = 1 << 30

    def also(limit: int) -> str:  # the other tiers named where they are what goes past `limit`
        return (f" and this process's other models' host tiers may take {others / gib:.1f} GiB (kv_host_capacity "
                "is each model's own)") if nbytes <= limit else ""

    if nbytes + others > total:
        raise ValueError(f"kv_host_capacity is {nbytes / gib:.1f} GiB{also(total)} but this machine has "
                         f"{total / gib:.1f} GiB of memory; give at most what it can spare (now {avail / gib:.1f} GiB "
                         "are available)")
    if nbytes + others > avail:
        log.warning("kv_host_capacity is %.1f GiB%s but only %.1f GiB of memory are available now; if the tier "
                    "fills, the system may swap or kill the server. Lower kv_host_capacity",
                    nbytes / gib, also(avail), avail / gib)


def _report_other_disk_dirs(root: Path, own: Path, default_capacity: bool) -> None:
    """Name the other model directories under `kv_disk_dir`: each is another model's, or blocks
    of weights this model no longer has (new weights get a new directory, since the block keys
    change). tierlm never deletes them, as another server may be using them, and each counts
    only against its own capacity, so say they are there. With the default capacity (half the
    free space at start), warn when other engines use the directory now: each took half, so
    together they may fill the disk (two did, here and in separate servers alike)."""
    try:
        names = [name for name in model_dir_names(root) if name != own.name]
        mine = {p.name for p in DiskTier.held_here() if p.parent == root}  # this process's other engines
        live = [name for name in names if name in mine or lock_holder(root / name) is not None] \
            if default_capacity else []
    except OSError:
        return
    others = [name for name in names if name not in mine]
    if others:
        shown = ", ".join(others[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
        log.info("kv_disk_dir %s also holds %d other model director%s (other models, or earlier weights of "
                 "this one): %s. tierlm never deletes them; `tierlm kv ls %s` says which hold weights that are gone",
                 root, len(others), "y" if len(others) == 1 else "ies", shown, root)
    if live:
        log.warning("kv_disk_dir %s is used now by %d other engine%s (%s), and this one's disk tier took the default "
                    "capacity, half of the free space, as each of them may have: together they may fill the disk "
                    "(then each shrinks to what it holds). Give each model a kv_disk_capacity (--kv-disk-capacity; "
                    "it is each model's own)", root, len(live), "" if len(live) == 1 else "s", ", ".join(live[:8]))


def tier_capacities(config: EngineConfig, block_bytes: int, device: torch.device) -> tuple[int, int | None, int]:
    """(host, disk or None for the default, remote) capacities in blocks of `block_bytes`; a
    ValueError names the setting that cannot be read or is under one block."""
    def blocks(knob: str, entry_bytes: int = block_bytes) -> int:
        try:
            return parse_capacity(getattr(config, knob), entry_bytes)
        except ValueError as e:
            raise ValueError(f"{knob}: {e}") from None

    # A size in bytes is what the host tier may take of the machine's memory, pinned rounding included.
    host = blocks("kv_host_capacity", host_block_bytes(block_bytes, pinned=device.type == "cuda"))
    # A disk entry is a file: its header counts against a size in bytes too.
    # None (or an empty string from a config file) is the default; 0 in any form turns the tier off.
    disk = None if config.kv_disk_capacity in (None, "") else blocks("kv_disk_capacity", block_bytes + ENTRY_HEADER_BYTES)
    remote = blocks("kv_remote_capacity") if config.kv_remote_capacity != "" else 0
    return host, disk, remote


# Serve a max_model_len past the checkpoint's max_position_embeddings (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)
ALLOW_LONG_MAX_MODEL_LEN = "TIERLM_ALLOW_LONG_MAX_MODEL_LEN"


def check_sizes_before_loading(config: EngineConfig, cfg: dict, device: torch.device,
                               model_dir: Path | None = None) -> None:
    """Sizes that config.json (`cfg`) alone checks, refused before the weights load, not minutes
    after: a tier capacity or a kv_cache_memory under one KV block, a max_model_len past the
    positions the model was trained on (without rope scaling)."""
    args = parse_config(cfg, resolve_architecture(cfg))
    trained = args.max_position_embeddings
    if (config.max_model_len and config.max_model_len > trained and not args.rope_scaling
            and os.environ.get(ALLOW_LONG_MAX_MODEL_LEN) != "1"):  # (as vLLM refuses it)
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {trained} "
                         "(config.json): it was never trained on positions past that, and its answers there are "
                         f"unreliable; lower max_model_len to {trained} or less, or set {ALLOW_LONG_MAX_MODEL_LEN}=1 "
                         "to serve them anyway")
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype, args, device, model_dir))
    per_block = kv_bytes_per_block(args, kv_dtype, config.block_size)
    tier_capacities(config, per_block, device)
    if config.kv_cache_memory is not None:
        check_kv_pool_memory(kv_pool_bytes(config.kv_cache_memory, per_block), device, available=False)


def build_tiers(config: EngineConfig, block_bytes: int, device: torch.device, model_id: str,
                fence: Callable[[], None] | None = None, label: str = "model",
                about: dict | None = None, layout: Layout | None = None) -> TieredStore | None:
    """The lower KV tiers named in the config, in order host -> disk -> redis (None if none).
    `about` (the checkpoint's path and fingerprint) is recorded in the disk tier's directory,
    for `tierlm kv ls` to tell whether those weights are still there."""
    # Every setting is read before the disk tier claims its directory, so a bad one leaves no lock.
    host, disk, remote = tier_capacities(config, block_bytes, device)
    host_bytes = host * host_block_bytes(block_bytes, pinned=device.type == "cuda")
    check_host_capacity(host_bytes, HostTier.taken_here())
    tiers: list = []
    if host > 0:
        tiers.append(HostTier(host, config.tier_policy("host"), pin=device.type == "cuda", nbytes=host_bytes,
                              history=config.kv_policy_history))
    if config.kv_disk_dir and disk != 0:  # a capacity of 0 turns the tier off: its directory is left alone
        # Absolute, so a later chdir (a library user's) does not move the tier to another directory.
        own = disk_tier_dir(os.path.abspath(config.kv_disk_dir), model_id, label)
        disk_tier = DiskTier(own, disk, config.tier_policy("disk"), block_bytes=block_bytes,
                             history=config.kv_policy_history)
        if disk_tier.usable:  # else off for this run (a full disk; it said so)
            tiers.append(disk_tier)
            if about is not None:
                record = about | {"model_id": model_id, "block_bytes": block_bytes, "started": time.time()}
                write_about(own, record)
                disk_tier.on_reclaim = lambda: write_about(own, record)  # its directory was recreated
            _report_other_disk_dirs(own.parent, own, default_capacity=disk is None)
    if config.kv_remote:
        try:
            tiers.append(RedisTier(config.kv_remote, ttl_s=config.kv_remote_ttl,
                                   capacity_bytes=remote * block_bytes or None))
        except BaseException:
            for t in tiers:
                t.close()
            raise
    return TieredStore(tiers, config.kv_remote_write_through, fence, write_through_disk=config.kv_disk_write_through,
                       read_timeout_s=config.kv_read_timeout, layout=layout) if tiers else None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.device = config.resolve_device()
        if config.model is None:
            from tierlm.models.demo import ensure_demo_model
            model_dir = ensure_demo_model()
        else:
            model_dir = check_model_dir(config.model)  # before the tokenizer's error about missing files
        self.model_dir = model_dir
        self.model_name = config.served_model_name or (
            "tierlm-demo" if config.model is None else model_dir.name)
        self.tokenizer = load_tokenizer(model_dir)
        # Embedding lengths the model was trained to give besides its full one (vLLM reads the
        # same two config.json fields).
        raw_config = load_config_dict(model_dir)
        listed = raw_config.get("matryoshka_dimensions")
        self.matryoshka_dimensions: list[int] | None = (
            [int(d) for d in listed] if isinstance(listed, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                                                         for d in listed) else None)
        self.is_matryoshka = bool(raw_config.get("is_matryoshka")) or self.matryoshka_dimensions is not None
        torch.manual_seed(config.seed)
        # Cached K/V that outlives this process (disk) or leaves it (Redis) is keyed by a hash of
        # the weights, computed alongside the load; blocks that stay in memory need no such key.
        check_sizes_before_loading(config, raw_config, self.device, model_dir)
        persistent = bool(config.kv_disk_dir or config.kv_remote)
        stamps = weight_stamps(model_dir) if persistent else None
        fingerprint = BackgroundFingerprint(model_dir) if persistent else None
        try:
            loaded = load_model(model_dir, self.device, config.dtype, config.max_model_len,
                                progress=config.load_progress, compute_dtype=config.compute_dtype,
                                cpu_linear=config.cpu_linear, cpu_kernels=config.cpu_kernels)
            self.args = loaded.args
            self.dtype = loaded.dtype
            # Sampling settings the model's maker recommends: the server's defaults for requests
            # that leave them unset (serving/generation.py), as vLLM's --generation-config auto.
            self.sampling_defaults = (sampling_defaults(loaded.generation_defaults, f"{model_dir}/generation_config.json")
                                      if config.generation_config == "auto" else {})
            if self.sampling_defaults:
                log.info("%s: generation_config.json recommends %s; requests that leave them unset get them "
                         "(--generation-config vllm: tierlm's own defaults)", model_dir,
                         ", ".join(f"{k}={v}" for k, v in self.sampling_defaults.items()))
            weights_dtype = loaded.kv_dtype  # what load_model rounded the weights to (the model's dtype)
            loaded.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, loaded.kv_dtype)
            # Before anything writes K/V: the warm-up, recorded graphs and every block read them.
            self.kv_scales = resolve_kv_scales(config.kv_cache_scales, loaded, weight_files(model_dir),
                                               self.tokenizer)
            # The RoPE tag: LongRoPE's keys depend on max_model_len (layers.rope_tag).
            kv_tag = f"{loaded.kv_dtype}{scales_tag(self.kv_scales)}{loaded.model.rope.tag}"
            self.max_model_len = config.max_model_len or min(loaded.args.max_position_embeddings, 32768)
            if self.max_model_len > loaded.args.max_position_embeddings and not self.args.rope_scaling:
                log.warning("max_model_len %d exceeds the model's max_position_embeddings %d (%s=1): its answers "
                            "past that are unreliable", self.max_model_len, loaded.args.max_position_embeddings,
                            ALLOW_LONG_MAX_MODEL_LEN)
            bs = config.block_size
            per_block = kv_bytes_per_block(loaded.args, loaded.kv_dtype, bs)
            # Default pool: a share of free memory, but no more than every sequence at full length needs.
            if config.kv_cache_memory is not None:
                budget = kv_pool_bytes(config.kv_cache_memory, per_block)
                check_kv_pool_memory(budget, self.device)  # what is free once the weights are in
            else:
                budget = min(default_kv_cache_memory(self.device),
                             config.max_num_seqs * (self.max_model_len // bs + 1) * per_block)
            num_blocks = budget // per_block
            if 0 < num_blocks * bs < self.max_model_len:
                # No request can be longer than the pool, and one without max_tokens is given
                # max_model_len minus its prompt: every such request (the OpenAI default) was refused.
                log.warning("the KV pool holds %d tokens (%d blocks), fewer than max_model_len %d: requests are "
                            "limited to %d tokens; raise kv_cache_memory (or lower max_model_len) to serve "
                            "longer ones", num_blocks * bs, num_blocks, self.max_model_len, num_blocks * bs)
                self.max_model_len = num_blocks * bs
            self.max_num_batched_tokens = config.max_num_batched_tokens or (2048 if self.device.type == "cuda" else 512)

            def policy(share: float = 1.0) -> EvictionPolicy:
                """The pool's, or a tenant's cache partition's for its share of the pool. A learning
                policy's history is sized by the share: each partition keeping the whole pool's
                (~85 MiB once full, by default) cost that much host memory per partitioned tenant."""
                return make_policy(config.eviction_policy, history=partition_history(config.kv_policy_history, share))

            self.pool = BlockPool(num_blocks, config.enable_prefix_caching, policy(), partition_policy=policy)
            self.runner = ModelRunner(loaded, num_blocks, bs, cpu_kernels=config.cpu_kernels,
                                      graphs=self._graphs_config(config, loaded.args, bs))
            self.loras: LoRARegistry | None = None
            if config.enable_lora:
                self.loras = LoRARegistry(loaded.model, loaded.args, self.device, loaded.dtype,
                                          config.max_lora_rank, reserved={self.model_name})
                self.runner.lora_state = self.loras.state
                for name, path in (config.lora_modules or {}).items():
                    try:
                        self.loras.add(name, path)
                    except InvalidRequestError as e:  # a bad name: the caller's configuration
                        raise ModelLoadError(f"lora_modules: {e}") from None
            if config.warmup:
                t0 = time.monotonic()
                warm_tokens = min(self.max_num_batched_tokens, self.max_model_len)
                self.runner.warm_up(warm_tokens, config.max_num_seqs)
                log.info("warm-up forward (%d prefill tokens, %d decode rows) took %.2f s (warmup=False skips it)",
                         warm_tokens, config.max_num_seqs, time.monotonic() - t0)
            if self.runner.graphs is not None and self.runner.graphs.record:
                t0 = time.monotonic()
                n = self.runner.graphs.record_decode_buckets()
                log.info("recorded %d CUDA graphs for decode steps in %.1f s (longer contexts are recorded when "
                         "first seen)", n, time.monotonic() - t0)
            about = None
            if fingerprint is None:
                model_id = f"process-{uuid.uuid4().hex}:{self.dtype}:{kv_tag}"
            else:
                digest = fingerprint.result()
                model_id = model_identity(model_dir, self.dtype, kv_tag, digest, weights_dtype)
                about = {"model_dir": os.path.abspath(model_dir), "fingerprint": digest}
                if weight_stamps(model_dir) != stamps:  # hashed and loaded bytes may differ
                    raise ModelLoadError(
                        f"the weights in {model_dir} changed while tierlm was loading them (a copy or download "
                        "still under way?); start again once they are complete")
        except BaseException:
            if fingerprint is not None:
                fingerprint.cancel()  # nobody will ask for it: stop hashing
            raise
        # The directory is named after the served name, so one server can serve one checkpoint
        # under two names (two engines, two directories) instead of refusing its own second one.
        self.store = build_tiers(config, per_block, self.device, model_id, fence=self.runner.copies_done,
                                 label=self.model_name, about=about, layout=self.runner.block_layout)
        self.kv = KVCacheManager(self.pool, bs, model_id=model_id, store=self.store,
                                 io=BlockIO(self.runner.read_blocks, self.runner.write_blocks),
                                 prefetch=(self.device.type == "cuda" or bool(config.kv_remote))
                                 if config.kv_prefetch is None else config.kv_prefetch)
        spec = SpeculativeConfig.parse(config.speculative_config)
        self.scheduler = Scheduler(self.kv, self.max_num_batched_tokens, config.max_num_seqs,
                                   config.scheduling_policy, max_loras=config.max_loras,
                                   proposer=None if spec is None else NgramProposer(spec, self.max_model_len))
        # How long a step with nothing to run but a prefix read waits for it: None, until it is
        # done or overdue (a caller stepping in a loop); an AsyncEngine polls (READ_POLL_S).
        self.read_wait_s: float | None = None
        self.sampler = Sampler(config.seed)
        eos = set(loaded.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.grammars = GrammarCompiler(self.tokenizer, self.args.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.logprobs: dict[str, list[TokenLogprob]] = {}
        self._seq = itertools.count()
        # n samples of one request, or a client's fixed list: tokenized once (a per-engine cache)
        self._bad_words_cache = functools.lru_cache(maxsize=64)(self._tokenize_bad_words)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # Speculative decoding: steps of a request that checked guesses, guesses checked, accepted.
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.steps = 0
        self.last_step = (0, 0)
        self.step_time = StepTimeModel()  # what a step of n tokens takes here (load.py)
        self.arrivals = ArrivalRates()  # prompt tokens arriving per second, per priority (load.py)
        self.output_lengths = OutputLengths()  # what finished requests generated (load.py)
        self.ttft_calibration = TtftCalibration()  # the estimate's factor, learnt from outcomes (load.py)
        log.info("engine ready: %s on %s (%s), %d KV blocks x %d tokens (%.1f MiB), max_model_len %d",
                 self.model_name, self.device, str(self.dtype).replace("torch.", ""), num_blocks, bs,
                 num_blocks * per_block / 2**20, self.max_model_len)

    def _graphs_config(self, config: EngineConfig, args, block_size: int) -> StepGraphsConfig | None:
        if not config.cuda_graphs:
            return None
        if self.device.type != "cuda":
            log.info("cuda_graphs on %s: nothing to record; small steps run eagerly in fixed shapes "
                     "(the path a graph records; not faster here)", self.device)
        # MoE: a graph runs every expert on every token; worth it once grouping would touch them all.
        min_tokens = -(-args.num_experts // args.num_experts_per_tok) if any(args.moe_layers) else 1
        return StepGraphsConfig(max_rows=config.max_num_seqs, max_blocks=-(-self.max_model_len // block_size),
                                min_tokens=min_tokens)

    # -- admission -------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                     request_id: str | None = None, *, priority: int = 0, tenant_id: str | None = None,
                     cache_salt: str | None = None, tenant_weight: float = 1.0,
                     kv_share: float | None = None, pooling: PoolingParams | None = None,
                     lora: "str | LoRARequest | None" = None, kv_cache_share: float | None = None) -> Request:
        """Validate and build a request without touching engine state (safe from any thread).
        With `pooling`, it asks for the prompt's embedding (`StreamDelta.embedding`), not tokens:
        of `params` only truncate_prompt_tokens then counts. `lora`: the LoRA adapter to run with,
        a loaded adapter's name or vLLM's LoRARequest (loaded on first use)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams (got {type(params).__name__})",
                                      param="params")
        if pooling is not None and not isinstance(pooling, PoolingParams):
            raise InvalidRequestError(f"pooling must be a PoolingParams (got {type(pooling).__name__})",
                                      param="pooling")
        if pooling is not None and pooling.dimensions is not None:
            self.check_embedding_dimensions(pooling.dimensions)
        if pooling is not None:  # its own: an embedding has no tokens to sample, and one step's room is enough
            params = SamplingParams(max_tokens=1, truncate_prompt_tokens=params.truncate_prompt_tokens
                                    if params is not None else None)
        params = params.checked_copy() if params is not None else SamplingParams()
        if params.n != 1:  # (LLM.generate makes one request per sample)
            raise InvalidRequestError(
                f"n must be 1 for one engine request (got {params.n}); LLM.generate takes n, and elsewhere run n "
                "requests, each with its own seed (seed + i, as vLLM derives them; the same seed draws the same "
                "sample)", param="n")
        # Checked here, not where they are first used: mid-step, one request's bad value failed
        # every request batched with it (priority="x" in the scheduler's sort, cache_salt=123 in
        # the block hashes).
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise InvalidRequestError(f"priority must be an integer (got {priority!r})", param="priority")
        priority = int(priority)  # (a numpy integer is one too)
        if (isinstance(tenant_weight, bool) or not isinstance(tenant_weight, numbers.Real)
                or not 0 < tenant_weight < float("inf")):
            raise InvalidRequestError(f"tenant_weight must be a positive number (got {tenant_weight!r}); 1 is an "
                                      "equal share with the other tenants of its priority", param="tenant_weight")
        for name, share, none in (("kv_share", kv_share, "no quota"),
                                  ("kv_cache_share", kv_cache_share, "no cache partition")):
            if share is not None and (isinstance(share, bool) or not isinstance(share, numbers.Real)
                                      or not 0 < share <= 1):
                raise InvalidRequestError(f"{name} must be a fraction of the KV pool above 0 and at most 1, or None "
                                          f"for {none} (got {share!r})", param=name)
        for name, value in (("request_id", request_id), ("tenant_id", tenant_id), ("cache_salt", cache_salt)):
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(f"{name} must be a string (got {type(value).__name__})", param=name)
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                if isinstance(prompt.get("prompt"), str):  # the ids are what runs; the text is kept, as vLLM does
                    text = prompt["prompt"]
                prompt = prompt["prompt_token_ids"]
                if isinstance(prompt, str):
                    raise InvalidRequestError("'prompt_token_ids' must be a list of token ids, not a string",
                                              param="prompt")
            elif "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise InvalidRequestError("a prompt dict's 'prompt' must be a string", param="prompt")
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        elif getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):  # a 1-D tensor or numpy array
            ids = prompt.tolist()
        else:
            raise InvalidRequestError(f"a prompt is a string, a list of token ids, or a dict with 'prompt' or "
                                      f"'prompt_token_ids' (got {type(prompt).__name__})", param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
        vocab = self.args.vocab_size
        # numpy integers are integers too (a tokenizer may hand them out); bools and floats are not.
        # Plain ints, the usual case, are checked by their set of types, in C: a loop over the ids
        # in Python (a type test, then int() of each) cost ~0.5 ms per 2,000 on every request.
        if set(map(type, ids)) != {int}:
            odd = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
            if odd:
                raise InvalidRequestError(f"prompt token ids must be integers, got a {type(odd[0]).__name__} among "
                                          "them (one prompt is a flat list of ids)", param="prompt")
            ids = [int(t) for t in ids]
        if not (0 <= min(ids) and max(ids) < vocab):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if params.truncate_prompt_tokens is not None:  # vLLM's: the last N tokens; -1: as many as fit
            ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len, params.max_tokens)
        budget = params.thinking_budget
        thinking_ids = (*budget.end_token_ids, *budget.start_token_ids) if budget is not None else ()
        block = params.think_block()  # (the structured output's grammar starts after it)
        for name, asked in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids),
                            ("thinking_budget", thinking_ids),
                            ("structured_outputs", block.token_ids() if block is not None else ())):
            outside = sorted(t for t in asked or () if t >= vocab)
            if outside:  # the sampler would scatter past the logits' last column
                raise InvalidRequestError(f"{name} names token id {outside[0]}, outside the model's vocabulary "
                                          f"[0, {vocab})", param=name)
        allowed = (torch.tensor(sorted(set(params.allowed_token_ids)), dtype=torch.long)
                   if params.allowed_token_ids is not None else None)
        n = len(ids)
        shorten = ("lower truncate_prompt_tokens (-1 keeps as many as fit)" if params.truncate_prompt_tokens
                   is not None else "shorten the prompt")
        if pooling is not None and n == self.max_model_len:  # an embedding needs its n positions, nothing sampled after
            max_tokens = 0
        elif n >= self.max_model_len:
            raise RequestTooLongError(
                f"prompt has {n} tokens but max_model_len is {self.max_model_len}: it leaves no room for output; "
                f"{shorten}", param="prompt")
        else:
            max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds max_model_len "
                f"({self.max_model_len}); lower max_tokens or {shorten}", param="max_tokens")
        need = self.kv.blocks_needed(n + max_tokens)
        if need > self.pool.num_blocks:
            raise RequestTooLongError(
                f"prompt + max_tokens needs {need} KV blocks but the whole pool has {self.pool.num_blocks}; "
                "lower max_tokens or start the engine with more kv_cache_memory", param="max_tokens")
        bad_words = self.bad_words(params.bad_words) if params.bad_words else None
        if allowed is not None:
            self._check_something_allowed(allowed, bad_words, params)
        grammar = self.grammars.follower(params.structured_outputs, block) if params.structured_outputs else None
        # Last: a LoRARequest not yet loaded is loaded here, and only for a request that is otherwise valid.
        adapter = self.lora(lora) if lora is not None else None
        rid = request_id or uuid.uuid4().hex
        gen = seeded_generator(params.seed) if params.seed is not None else None
        return Request(rid, ids, params, max_tokens, self.eos_token_ids, prompt=text, priority=priority,
                       tenant_id=tenant_id, tenant_weight=float(tenant_weight),
                       kv_share=None if kv_share is None else float(kv_share), cache_salt=cache_salt,
                       kv_cache_share=None if kv_cache_share is None else float(kv_cache_share),
                       arrival_seq=next(self._seq), generator=gen,
                       allowed_token_ids=allowed, bad_words=bad_words,
                       thinking=ThinkingTracker(budget) if budget is not None else None, grammar=grammar,
                       pooling=pooling, lora=adapter)

    def check_embedding_dimensions(self, dimensions: int) -> None:
        """vLLM's rule for a shorter embedding: only from a model trained for it (config.json's
        `is_matryoshka` or `matryoshka_dimensions`), and only a length it lists, if it lists any."""
        size = self.args.hidden_size
        if dimensions == size:
            return
        listed = self.matryoshka_dimensions
        if listed is None and not self.is_matryoshka:
            raise InvalidRequestError(f"dimensions: model '{self.model_name}' gives embeddings of {size} dimensions and "
                                      "cannot shorten them (its config.json does not say it was trained to: "
                                      f"is_matryoshka / matryoshka_dimensions); leave dimensions out, or give {size}",
                                      param="dimensions")
        if listed is not None and dimensions not in listed:
            raise InvalidRequestError(f"dimensions: model '{self.model_name}' gives embeddings of "
                                      f"{', '.join(map(str, listed))} dimensions (its matryoshka_dimensions); got "
                                      f"{dimensions}", param="dimensions")
        if dimensions > size:
            raise InvalidRequestError(f"dimensions: model '{self.model_name}' gives embeddings of at most {size} "
                                      f"dimensions; got {dimensions}", param="dimensions")

    # -- LoRA adapters -----------------------------------------------------------------------
    def _lora_registry(self) -> LoRARegistry:
        if self.loras is None:
            raise InvalidRequestError(f"model '{self.model_name}' serves no LoRA adapters; start the engine with "
                                      "enable_lora=True (tierlm serve --enable-lora) to use them",
                                      param="lora_request")
        return self.loras

    def lora(self, lora: "str | LoRARequest | LoRAAdapter") -> "LoRAAdapter":
        """The loaded adapter a request names (vLLM's LoRARequest loads it on first use)."""
        return self._lora_registry().resolve(lora)

    def add_lora(self, name: str | LoRARequest, path: str | None = None) -> "LoRAAdapter":
        """Load a PEFT LoRA adapter as `name` (safe from any thread while the engine steps)."""
        if isinstance(name, LoRARequest):
            name, path = name.lora_name, name.lora_path
        if path is None:
            raise InvalidRequestError("add_lora needs the adapter's directory", param="lora_path")
        return self._lora_registry().add(name, path)

    def remove_lora(self, name: str) -> None:
        """Forget adapter `name`: new requests cannot use it; those using it finish with it."""
        self._lora_registry().remove(name)

    def list_loras(self) -> list[str]:
        return self.loras.names if self.loras is not None else []

    def lora_path(self, name: str) -> str:
        return self._lora_registry().require(name).path

    def _check_something_allowed(self, allowed: torch.Tensor, bad_words: BadWords | None,
                                 params: SamplingParams) -> None:
        """Refuse allowed_token_ids that leave nothing to sample: every one a one-token bad word, or,
        under min_tokens, every one a token that ends the request (held back until then). The
        sampler would draw from a row of -inf: token 0, or the vocabulary's last."""
        usable = set(allowed.tolist()) - set(bad_words.always if bad_words else ())
        if not usable:
            raise InvalidRequestError("allowed_token_ids: every allowed token is a one-token bad word, so no token "
                                      "can be sampled; allow another token or drop that bad word",
                                      param="allowed_token_ids")
        if params.min_tokens:
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if usable <= ends:
                raise InvalidRequestError("allowed_token_ids: every allowed token ends the request (EOS or a stop "
                                          "token), which min_tokens holds back, so no token can be sampled before "
                                          "it; allow another token or drop min_tokens", param="allowed_token_ids")

    def bad_words(self, words: Sequence[str]) -> BadWords:
        """`words` (a request's bad_words) as token ids, from a small cache: the server calls this
        first on a worker thread, so the event loop never tokenizes them (up to 1,024 words)."""
        return self._bad_words_cache(tuple(words))

    def _tokenize_bad_words(self, words: tuple[str, ...]) -> BadWords:
        """`words` tokenized as vLLM does (see bad_words_token_ids); a token outside the model's
        vocabulary (a tokenizer larger than the model) is refused naming the word."""
        vocab = self.args.vocab_size
        token_ids = bad_words_token_ids(self.tokenizer, words)
        for ids in token_ids:
            if any(t >= vocab for t in ids):
                word = self.tokenizer.decode(ids)
                raise InvalidRequestError(f"bad_words' {word!r} has a token id outside the model's vocabulary "
                                          f"[0, {vocab}); remove it", param="bad_words")
        return BadWords(token_ids)

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id '{req.request_id}' is already in use", param="request_id")
        self.requests[req.request_id] = req
        self.detoks[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, req.params.stop, req.params.skip_special_tokens,
            req.params.include_stop_str_in_output, positions=req.params.logprobs is not None,
            keep=frozenset(req.params.keep_special_token_ids or ()))
        if req.params.logprobs is not None:
            self.logprobs[req.request_id] = []
        self.scheduler.add(req)
        self.arrivals.add(req.priority, req.num_prompt_tokens)
        self.kv.prefetch(req)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None, **kw) -> Request:
        req = self.make_request(prompt, params, request_id, **kw)
        self.add(req)
        return req

    def abort(self, request_id: str) -> StreamDelta | None:
        """Stop a request now and free its KV blocks; returns its final delta, or None if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, "abort", None)

    # -- the step --------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StreamDelta]:
        sched = self.scheduler.schedule()
        if not sched.scheduled and sched.reading is not None:
            # Only a prefix read to wait for: wait (up to `read_wait_s`, never past the read
            # timeout), then run the request in this step if its read is done or overdue.
            self.kv.wait_for_read(sched.reading, self.read_wait_s)
            sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        self.steps += 1
        self.last_step = (sched.num_tokens, len(sched.scheduled))
        t0 = time.perf_counter()
        try:
            return self._run_step(sched)
        finally:
            self.step_time.observe(sched.num_tokens, time.perf_counter() - t0)

    def _run_step(self, sched) -> list[StreamDelta]:
        samplers, logits, scored = self.runner.execute(sched)
        pooled: list[tuple[Request, list[float]]] = []
        for rows in scored:  # (before the step's tokens: a prompt's last chunk gives its first token too)
            req = rows.req
            if req.pooling is not None:
                pooled.append((req, pooled_embedding(rows.hidden[-1], req.pooling)))
                continue
            targets = req.prompt_token_ids[rows.start + 1: rows.start + 1 + rows.hidden.shape[0]]
            req.prompt_logprobs.extend(prompt_logprobs(self.runner.model.compute_logits, rows.hidden, targets,
                                                       req.params.prompt_logprobs))
        for req, n in sched.scheduled:
            # The prompt's share of the chunk: a recompute after preemption runs past the prompt.
            self.prompt_tokens += max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
            # (a decode's speculative guesses count once they are accepted, below)
            req.num_computed_tokens += min(n, req.num_tokens - req.num_computed_tokens)
            self.kv.register_computed(req)
        now = time.monotonic()
        deltas = []
        for req, embedding in pooled:  # done once the prompt is in (its blocks now cached for others)
            req.first_token_time = now
            deltas.append(self._finish(req, "stop", None, embedding=embedding))
        if not samplers:
            return deltas
        guessing = any(req.spec_token_ids for req in samplers)
        if not guessing:
            tokens, lps = self.sampler(logits, samplers)
            for req, tok, lp in zip(samplers, tokens, lps):
                deltas.append(self._on_token(req, tok, lp, now))
            return deltas
        tokens, lps = self.sampler(logits, samplers, self._row_drafts(samplers))
        at = 0
        while at < len(samplers):
            req = samplers[at]
            guesses, req.spec_token_ids = req.spec_token_ids, []
            # Row j's token follows the real tokens and the first j guesses: it stands only while
            # every guess before it was the token drawn there. The first token that differs
            # from its row's guess (or the row after the last guess) is the step's last.
            accepted = 0
            for j in range(len(guesses) + 1):
                delta = self._on_token(req, tokens[at + j], lps[at + j], now)
                deltas.append(delta)
                if delta.finished or j == len(guesses) or tokens[at + j] != guesses[j]:
                    break
                accepted += 1
            at += len(guesses) + 1
            if guesses:
                self.spec_drafts += 1
                self.spec_draft_tokens += len(guesses)
                self.spec_accepted_tokens += accepted
                if not req.is_finished:  # accepted guesses' K/V, written this step, now count
                    req.num_computed_tokens += accepted
                    self.kv.register_computed(req)
        return deltas

    @staticmethod
    def _row_drafts(samplers: list[Request]) -> list[int]:
        """Per logits row, the guess it checks (-1: none): a request with guesses has one row per
        guess and one more after the last, consecutive (runner.py)."""
        drafts: list[int] = []
        at = 0
        while at < len(samplers):
            guesses = samplers[at].spec_token_ids
            drafts.extend(guesses)
            drafts.append(-1)
            at += len(guesses) + 1
        return drafts

    def _on_token(self, req: Request, tok: int, lp: TokenLogprob | None, now: float) -> StreamDelta:
        req.append_token(tok)
        self.generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        if lp is not None:
            self.logprobs[req.request_id].append(lp)
        p = req.params
        detok = self.detoks[req.request_id]
        if req.grammar is not None:
            req.grammar.advance(req.output_token_ids)
            if req.grammar.failed is not None:  # (its token, off the grammar or the EOS it was given, unshown)
                return self._finish(req, "error", f"the structured output could not be followed past "
                                    f"{req.grammar.followed} tokens: {req.grammar.failed}")
        stop_token = tok in req.eos_token_ids and not p.ignore_eos
        if stop_token or tok in p.stop_token_ids:
            if p.include_stop_str_in_output:  # the stopping token's own text too, as vLLM does (not
                detok.add(tok, find_stop=False)  # searched for stop strings: the token stopped first,
                detok.flush(find_stop=False)  # even where its text ends part-way through a character)
            return self._finish(req, "stop", None if stop_token else tok, new_token=tok, lp=lp)
        matched = detok.add(tok, find_stop=req.num_output_tokens > p.min_tokens)  # vLLM's: past min_tokens
        self._place_logprobs(req, detok)
        if matched is not None:
            return self._finish(req, "stop", matched, new_token=tok, lp=lp)
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return self._finish(req, "length", None, new_token=tok, lp=lp)
        return self._delta(req, detok.delta(False), [tok], lp, finished=False)

    def _finish(self, req: Request, reason: str, stop_reason, new_token: int | None = None,
                lp: TokenLogprob | None = None, embedding: list[float] | None = None) -> StreamDelta:
        detok = self.detoks.pop(req.request_id)
        held_back = detok.matched_stop is None
        # A character still held for its next bytes is output too (nothing after a stop string).
        detok.flush(find_stop=req.num_output_tokens > req.params.min_tokens)
        self._place_logprobs(req, detok)
        if held_back and detok.matched_stop is not None and reason in ("length", "stop"):
            # The last token completed a stop string but also began a character still unfinished,
            # so the stop was only found now: the text is cut there, and the reason says so.
            reason, stop_reason = "stop", detok.matched_stop
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        if reason in ("stop", "length") and req.pooling is None:  # (a pooling request's 0 is no answer length)
            self.output_lengths.add(req.num_output_tokens)
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        self.logprobs.pop(req.request_id, None)
        delta = self._delta(req, detok.delta(True), [] if new_token is None else [new_token], lp, finished=True)
        delta.finish_reason, delta.stop_reason = reason, stop_reason
        delta.embedding = embedding
        req.final_text = detok.text
        return delta

    def _place_logprobs(self, req: Request, detok: IncrementalDetokenizer) -> None:
        """Where each token's text begins (`TokenLogprob.text_start`), as the detokenizer read it;
        a token it was not given (the stop token ending a request) begins where the text ends."""
        lps = self.logprobs.get(req.request_id)
        if not lps:
            return
        starts = detok.starts
        for i in range(detok.placed_from, len(starts)):
            lps[i].text_start = starts[i]
        for lp in lps[len(starts):]:
            lp.text_start = len(detok.text)

    def _delta(self, req: Request, text: str, toks: list[int], lp, finished: bool) -> StreamDelta:
        # The prompt's logprobs come with its first token (the prompt is scored whole by then).
        first = req.prompt_logprobs is not None and req.num_output_tokens == 1 and bool(toks)
        return StreamDelta(
            request_id=req.request_id, text=text, token_ids=toks, finished=finished,
            logprobs=[lp] if lp is not None else None,
            prompt_logprobs=[None, *req.prompt_logprobs] if first else None, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0), num_output_tokens=req.num_output_tokens,
            arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time)

    # -- introspection ---------------------------------------------------------------------
    def estimate_ttft(self, prompt_tokens: int, priority: int = 0) -> float | None:
        """Seconds a request of `priority` with `prompt_tokens` arriving now would wait for its
        first token (load.py); None before the first step. Safe from any thread (it reads copies
        of the queues, which the engine thread may be changing: an estimate, not a promise)."""
        s = self.scheduler
        raw = estimate_ttft(self.step_time, prompt_tokens=prompt_tokens, priority=priority,
                            running=list(s.running), waiting=list(s.waiting),
                            budget=self.max_num_batched_tokens, max_seqs=s.max_seqs, rates=self.arrivals,
                            outputs=self.output_lengths)
        return None if raw is None else raw * self.ttft_calibration.factor(priority)

    def observe_ttft(self, priority: int, estimate: float, actual: float) -> None:
        """A request admitted on `estimate` (from `estimate_ttft`) got its first token after
        `actual` seconds: the estimate's factor for its priority learns from it."""
        self.ttft_calibration.observe(priority, estimate, actual)

    def distrust_ttft_estimate(self, priority: int, by: float = 2.0) -> None:
        """Requests of `priority` admitted on the estimate came late in bulk (the SLA breaker
        opened): its factor grows at once, rather than by one step a late first token, which
        under a slowdown comes seconds later; outcomes within the estimate bring it back down."""
        self.ttft_calibration.scale(priority, by)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.pool.num_used, kv_blocks_total=self.pool.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.stats.queries, prefix_cache_hits=self.kv.stats.hits,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens, steps=self.steps,
            last_step_tokens=self.last_step[0], last_step_seqs=self.last_step[1],
            kv_evictions=self.pool.evictions, kv_device_hit_blocks=self.kv.stats.device_hit_blocks,
            kv_promoted_blocks=self.kv.stats.promoted_blocks,
            kv_promoted_bytes=self.kv.stats.promoted_bytes, kv_demoted_blocks=self.kv.stats.demoted_blocks,
            kv_demoted_bytes=self.kv.stats.demoted_bytes,
            kv_tiers=self.store.stats() if self.store is not None else None,
            kv_tier_usage=self.store.usage() if self.store is not None else None,
            kv_write_backlog_bytes=self.store.backlog if self.store is not None else 0,
            kv_staged_bytes=self.store.staged_bytes if self.store is not None else 0,
            kv_held_bytes=self.kv.held_bytes, lora_requests=self._lora_requests(),
            kv_cache_partitions={t: {"blocks": p.evictable, "capacity": p.cap}
                                 for t, p in list(self.pool.partitions.items())} or None,
            kv_host_partitions=self.store.partitions() if self.store is not None else None,
            spec_drafts=self.spec_drafts, spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            kv_cache_dtype=str(self.runner.kv_caches[0].dtype).replace("torch.", ""), block_size=self.config.block_size)

    def _lora_requests(self) -> dict | None:
        """Per loaded adapter, its requests running and waiting (None: no LoRA on this engine).
        Read from any thread: the queues are copied first (one step of staleness at most)."""
        if self.loras is None:
            return None
        counts = {name: {"running": 0, "waiting": 0} for name in self.loras.names}
        for state, queue in (("running", list(self.scheduler.running)), ("waiting", list(self.scheduler.waiting))):
            for req in queue:
                if req.lora is not None:
                    counts.setdefault(req.lora.name, {"running": 0, "waiting": 0})[state] += 1
        return counts

    def persist_kv(self) -> int:
        """With a disk tier: move every cached block from the device and host memory down to it
        and wait for the writes, so the next engine on this directory starts warm. While serving,
        chains leave the device tail first, so host memory holds the heads of the chains whose
        tails are on disk: without writing it down too, what a restart finds on disk is mostly
        unreachable tails. The device's blocks go heads first here, so writes cut short by the
        shutdown's deadline still leave prefixes a restart can hit. Returns the blocks moved;
        requests still running keep theirs."""
        if self.store is None or self.store.closed or not any(isinstance(t, DiskTier) for t in self.store.tiers):
            return 0
        t0, dropped = time.monotonic(), self.store.dropped()
        disks = [t for t in self.store.tiers if isinstance(t, DiskTier)]
        stored = sum(t.stats.stores for t in disks)
        hosts = [(level, t) for level, t in enumerate(self.store.tiers) if isinstance(t, HostTier)]
        in_host = sum(len(t) for _, t in hosts)
        if self.pool.cached or in_host:
            log.info("KV %s: writing up to %d cached blocks from the device and host memory down to the disk tier",
                     self.model_name, len(self.pool.cached) + in_host)
        with self.store.lossless():  # past the writer's backlog, wait for room: dropped before
            device = self.pool.evict_all(heads_first=True)  # what lands first is reachable if cut short
            for level, _ in hosts:
                self.store.spill(level)
        landed, lost = self.store.flush(), self.store.dropped() - dropped
        moved = device + in_host  # (a device block passing through host memory counted once)
        written = sum(t.stats.stores for t in disks) - stored
        if moved and not any(t.capacity > 0 for t in disks):
            log.warning("KV %s: the disk tier has no room (capacity 0 blocks: its disk was full), so none of %d "
                        "cached blocks were written there for the next start. Free space in kv_disk_dir",
                        self.model_name, moved)
        elif moved and landed and not lost:
            log.info("KV %s: moved %d cached blocks (%d from the device, %d from host memory) down in %.1f s, for "
                     "the next start: %d newly written to the disk tier, the others there already (or passed on "
                     "below it)", self.model_name, moved, device, in_host, time.monotonic() - t0, written)
        elif moved:
            log.warning("KV %s: not all of %d cached blocks reached the disk tier within the shutdown's %g s "
                        "(%d dropped, %s; a slow disk or Redis): the rest is recomputed after the next start",
                        self.model_name, moved, self.store.close_timeout_s, lost,
                        "all others written" if landed else "writes still queued")
        return moved

    def close(self) -> None:
        """Persist the KV cache to the disk tier (`persist_kv`), finish queued writes and release
        the tiers (the disk directory, which keeps its blocks for the next engine). The engine
        takes no requests after this."""
        if self.store is not None and not self.store.closed:
            with self.store.deadline():  # persisting and closing together: up to close_timeout_s
                self.persist_kv()
                self.store.close()

    def offload_prefix_cache(self) -> int:
        """Push every unreferenced cached device block down to the lower tiers (or drop it if none)."""
        n = self.pool.evict_all()
        if self.store is not None:
            self.store.flush()
        return n

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            template_kwargs: dict | None = None) -> list[int]:
        from tierlm.engine.tokenizer import render_chat
        return render_chat(self.tokenizer, messages, tools, add_generation_prompt, continue_final_message,
                           template_kwargs)

    def chat_text(self, messages: list[dict], tools: list[dict] | None = None,
                  add_generation_prompt: bool = True, continue_final_message: bool = False,
                  template_kwargs: dict | None = None) -> str:
        """The rendered chat as text; `encode_chat_text` of it is `apply_chat_template`'s result."""
        from tierlm.engine.tokenizer import render_chat_text
        return render_chat_text(self.tokenizer, messages, tools, add_generation_prompt, continue_final_message,
                                template_kwargs)

    def encode_chat_text(self, text: str) -> list[int]:
        from tierlm.engine.tokenizer import encode_rendered
        return encode_rendered(self.tokenizer, text)
