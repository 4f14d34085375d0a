"""Engine configuration: one place for every default."""
from __future__ import annotations

import os
import secrets
import urllib.parse
from dataclasses import dataclass, field

import torch

from tierlm.engine.fairness import SCHEDULING_POLICIES
from tierlm.kv.policies import DEFAULT_POLICY, MIN_POLICY_HISTORY, OFFLINE_POLICIES, POLICIES
from tierlm.kv.tiers import block_count, lower_scheme, parse_capacity, redact_url, url_cut_short
from tierlm.models.kv_dtype import check_kv_cache_dtype
from tierlm.models.kv_scales import check_kv_cache_scales

REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")

DEFAULT_BLOCK_SIZE = 16


@dataclass
class EngineConfig:
    """Knobs named like vLLM's. `None` means "derive a sensible value when the model is known"."""

    model: str | None = None  # checkpoint directory; None = the built-in demo model
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (weights as loaded, and the KV cache)
    # "auto": float32 compute for bf16/fp16 weights on CPUs whose float32 GEMM is clearly faster
    # (measured at start-up; KV cache stays in `dtype`); or force one of the dtypes.
    compute_dtype: str | None = "auto"
    # auto | packed | plain: oneDNN-prepacked float32 weights on CPU when faster; "auto" also keeps
    # bf16 weights for decode batches (tierlm's bf16-weight kernel) when the checkpoint is bf16.
    cpu_linear: str = "auto"
    # tierlm's own CPU kernels (bf16-weight decode GEMM, paged decode attention), built with the
    # system C compiler on first use; False = PyTorch ops only (TIERLM_CPU_KERNELS=0 does the same).
    cpu_kernels: bool = True
    # Record small steps (decodes, short prefill chunks) as CUDA graphs and replay them: on a GPU
    # such steps are bound by Python's kernel launches. Off until measured on a GPU; on CPU the
    # same fixed-shape steps run eagerly (what the tests check), which is not faster. MoE steps
    # with fewer tokens than experts / top-k stay eager (see engine/graphs.py).
    cuda_graphs: bool = False
    # "auto": the sampling settings of the model's generation_config.json (temperature, top_p,
    # top_k, min_p, repetition_penalty) serve requests that leave them unset, as vLLM's
    # --generation-config auto does; "vllm": tierlm's own defaults (temperature 1, no filters).
    generation_config: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    # Within one priority: "fair" shares the engine equally between tenants (engine/fairness.py),
    # "fcfs" keeps arrival order. Priority (a tenant's tier) always comes first.
    scheduling_policy: str = "fair"
    max_model_len: int | None = None
    # The device KV pool: bytes (int), a size ("8GiB", "512MiB") or a count ("2000 blocks").
    kv_cache_memory: int | str | None = None
    # What K/V are stored as (vLLM's kv_cache_dtype): auto (the model's dtype) | float32 | bfloat16
    # | float16 | fp8 (= fp8_e4m3) | fp8_e5m2. fp8 fits 2x a bf16 pool's tokens (models/kv_dtype.py).
    kv_cache_dtype: str = "auto"
    # fp8 caches only: per-layer k/v scales (vLLM's k_scale / v_scale; models/kv_scales.py):
    # auto (the checkpoint's, else calibrated at load) | checkpoint (the checkpoint's, else 1.0:
    # vLLM's default) | calibrate.
    kv_cache_scales: str = "auto"
    seed: int | None = 0  # None: a random one
    enable_prefix_caching: bool = True
    eviction_policy: str = DEFAULT_POLICY  # device pool; measured by `tierlm bench cache`
    # Lower KV tiers (all off by default). Capacities: bytes (int), "2GiB", or "1000 blocks".
    kv_host_capacity: int | str | None = None
    kv_disk_dir: str | None = None
    kv_disk_capacity: int | str | None = None
    kv_remote: str | None = None  # e.g. redis://127.0.0.1:6379/0
    # Sets the Redis server's maxmemory (+ volatile-lru, every tierlm key with a TTL); refused on a
    # Redis seen to hold other applications' keys.
    kv_remote_capacity: int | str | None = None
    kv_remote_ttl: int | None = None  # seconds an entry lives in Redis (None: until Redis evicts it)
    kv_tier_policy: str = DEFAULT_POLICY  # host and disk tiers, unless set per tier below
    kv_host_policy: str | None = None  # None = kv_tier_policy
    kv_disk_policy: str | None = None  # None = kv_tier_policy
    # Blocks a learning policy (the Gittins family: duel, the default, and others) remembers per
    # tier, cached or not, to learn reuse odds from: ~340 bytes each (85 MiB at the default).
    kv_policy_history: int = 1 << 18
    kv_remote_write_through: bool = True
    # Also write every newly computed block to the disk tier at once, not only what host memory
    # evicts: a crash (not just a clean stop) then leaves the cache on disk, for a disk write per
    # computed block.
    kv_disk_write_through: bool = False
    # Read a new request's disk/Redis prefix on a background thread while the engine keeps
    # stepping, and admit it when the read is done; False: the step that admits it reads it.
    # None: on for CUDA or with a Redis tier, off otherwise on CPU, where `tierlm bench prefix`
    # measured a disk read competing with the model for the same cores (the newcomer waits a
    # step, the others gain ~4-19%).
    kv_prefetch: bool | None = None
    # Seconds a request waits for its background disk/Redis read before it starts without the
    # rest of it (recomputed); a Redis round trip slower than this counts as an outage.
    kv_read_timeout: float = 5.0
    served_model_name: str | None = None
    # LoRA adapters (PEFT checkpoints) on this base model, chosen per request by name: adapters
    # to load at start (name -> directory; implies enable_lora), and with enable_lora, more may
    # be added while it runs (LLMEngine.add_lora). max_loras: distinct adapters in one step
    # (others wait for a slot); max_lora_rank: the largest rank an adapter may have.
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None
    max_loras: int = 4
    max_lora_rank: int = 64
    # Speculative decoding, vLLM's shape: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2} (engine/speculative.py); None: off.
    speculative_config: dict | str | None = None
    load_progress: bool = True
    # One full-budget forward pass at start-up, so the first real steps do not pay for kernel
    # selection and first-touch allocation (vLLM's profiling run plays the same role).
    warmup: bool = True
    extra: dict = field(default_factory=dict)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device {self.device!r} is not a device torch knows; use auto, cpu, cuda "
                             "or cuda:N") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for but torch sees no CUDA device; use device='cpu'")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r} does not exist: torch sees {torch.cuda.device_count()} CUDA "
                             f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        return dev

    def validate(self) -> None:
        for knob, off in (("model", "the built-in demo model"), ("kv_disk_dir", "no disk tier"),
                          ("kv_remote", "no Redis tier")):
            value = getattr(self, knob)
            if isinstance(value, str) and not value.strip():  # as "$UNSET_VARIABLE" gives
                raise ValueError(f"{knob} is empty (an unset variable?); give a value, or leave it out for {off}")
        for knob in ("model", "kv_disk_dir"):  # "~/..." from a config dict or `--kv-disk-dir=~/x`, which no shell expands
            value = getattr(self, knob)
            if isinstance(value, str) and value.startswith("~"):
                setattr(self, knob, os.path.expanduser(value))
        if self.seed is None:  # as vLLM: a fresh seed for this engine
            self.seed = secrets.randbits(63)
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool) and -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be a whole number from -2**63 to 2**64-1, or None for a random one "
                             f"(got {self.seed!r})")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {self.block_size})")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (got {self.max_model_len}); leave it unset for the "
                             "model's own limit")
        self.resolve_device()  # an unknown or absent device fails here, before anything loads
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' (the model's generation_config.json sampling "
                             f"settings as request defaults) or 'vllm' (tierlm's own) (got {self.generation_config!r})")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)} (got "
                             f"{self.scheduling_policy!r})")
        for knob in ("max_loras", "max_lora_rank"):
            value = getattr(self, knob)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{knob} must be a whole number >= 1 (got {value!r})")
        if self.lora_modules is not None:
            if not isinstance(self.lora_modules, dict) or not all(
                    isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.lora_modules.items()):
                raise ValueError("lora_modules must map adapter names to PEFT adapter directories "
                                 f"(got {self.lora_modules!r})")
            self.enable_lora = True
        from tierlm.engine.speculative import SpeculativeConfig
        SpeculativeConfig.parse(self.speculative_config)  # a bad one fails here, before anything loads
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_kv_cache_scales(self.kv_cache_scales)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 (got {self.max_num_seqs})")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1 (got {self.max_num_batched_tokens})")
        if self.kv_cache_memory is not None:
            amount, in_blocks = kv_pool_size(self.kv_cache_memory)
            if not in_blocks:  # a count of blocks is checked once config.json gives the block's size
                check_kv_pool_memory(amount, self.resolve_device(), available=False)
        if self.kv_disk_dir:
            check_disk_dir(self.kv_disk_dir)
        if not (isinstance(self.kv_read_timeout, (int, float)) and 0 < self.kv_read_timeout < float("inf")):
            raise ValueError(f"kv_read_timeout must be a positive number of seconds (got {self.kv_read_timeout!r})")
        if not (isinstance(self.kv_policy_history, int) and self.kv_policy_history >= MIN_POLICY_HISTORY):
            raise ValueError(f"kv_policy_history must be a whole number of blocks, at least {MIN_POLICY_HISTORY} (got "
                             f"{self.kv_policy_history!r}); fewer records leave the policy too little to learn from")
        if self.kv_remote_ttl is not None and self.kv_remote_ttl <= 0:
            raise ValueError(f"kv_remote_ttl must be a positive number of seconds (got {self.kv_remote_ttl})")
        for knob in ("kv_host_capacity", "kv_disk_capacity", "kv_remote_capacity"):
            try:
                parse_capacity(getattr(self, knob), 1)
            except ValueError as e:
                raise ValueError(f"{knob}: {e}") from None
        if self.kv_remote:
            check_redis_url(self.kv_remote)
        for knob, tier in (("kv_disk_capacity", "kv_disk_dir"), ("kv_disk_write_through", "kv_disk_dir"),
                           ("kv_remote_capacity", "kv_remote"), ("kv_remote_ttl", "kv_remote")):
            if getattr(self, knob) not in (None, False) and not getattr(self, tier):
                raise ValueError(f"{knob} is set but {tier} is not, so that tier is off; give {tier} "
                                 f"to turn it on, or drop {knob}")
        if not self.enable_prefix_caching:
            # Lower tiers hold only blocks the prefix cache evicts: without it they stay empty,
            # while a disk tier still locks its directory from the engines that could use it.
            disk_on = bool(self.kv_disk_dir) and (self.kv_disk_capacity is None
                                                  or parse_capacity(self.kv_disk_capacity, 1) > 0)
            on = [knob for knob, value in (("kv_host_capacity", parse_capacity(self.kv_host_capacity, 1) > 0),
                                           ("kv_disk_dir", disk_on), ("kv_remote", bool(self.kv_remote))) if value]
            if on:
                raise ValueError(f"{', '.join(on)} given with enable_prefix_caching off (--no-prefix-caching): "
                                 "lower KV tiers only hold the prefix cache's blocks, so they would stay empty; "
                                 f"turn prefix caching on, or drop {', '.join(on)}")
        for knob in ("eviction_policy", "kv_tier_policy", "kv_host_policy", "kv_disk_policy"):
            name = getattr(self, knob)
            if name is None and knob in ("kv_host_policy", "kv_disk_policy"):
                continue
            if name in OFFLINE_POLICIES:
                raise ValueError(f"{knob}={name!r} is an offline reference that needs the future (only "
                                 f"`tierlm bench cache` runs it); choose one of {POLICIES}")
            if name not in POLICIES:
                raise ValueError(f"unknown eviction policy {knob}={name!r}; choose one of {POLICIES}")

    def tier_policy(self, tier: str) -> str:
        """The eviction policy of a lower tier ("host" or "disk"): its own knob, else kv_tier_policy."""
        return getattr(self, f"kv_{tier}_policy") or self.kv_tier_policy


def host_memory() -> tuple[int, int] | None:
    """(total, available) bytes of RAM, or None where the system does not say."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        avail = os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError):
        return None
    try:  # MemAvailable counts reclaimable page cache too, as the kernel would
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    return total, avail


def kv_pool_size(value: int | str) -> tuple[int, bool]:
    """(amount, in_blocks) of a kv_cache_memory: bytes (int), a size such as "8GiB", or "N blocks"."""
    try:
        amount = parse_capacity(value, 1)
    except ValueError:
        raise ValueError(f"cannot read kv_cache_memory {value!r}; use a size such as '8GiB' or '512MiB', a count "
                         "such as '2000 blocks', or a byte count") from None
    if amount <= 0:
        raise ValueError(f"kv_cache_memory must be positive (got {value!r}); leave it unset for a share of free memory")
    return amount, block_count(value) is not None


def kv_pool_bytes(value: int | str, per_block: int) -> int:
    """Bytes of the device KV pool that kv_cache_memory asks for, refused when it holds no block."""
    amount, in_blocks = kv_pool_size(value)
    nbytes = amount * per_block if in_blocks else amount
    if nbytes < per_block:
        raise ValueError(f"kv_cache_memory={value!r} holds no KV block ({per_block} bytes each); raise it")
    return nbytes


def check_kv_pool_memory(nbytes: int, device: torch.device, available: bool = True) -> None:
    """Refuse a KV pool the device cannot hold: allocated at once, it would end in the OOM killer
    (on CPU, the whole machine's) or a CUDA out-of-memory error. Against the total before the
    weights load, against what is free after (`available`)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        where = f"{device} has"
    else:
        mem = host_memory()
        if mem is None:
            return
        total, free = mem
        where = "this machine has"
    limit, what = (free, "free now") if available else (total, "in all")
    if nbytes > limit:
        raise ValueError(f"kv_cache_memory is {_size(nbytes)} but {where} {_size(limit)} {what}; "
                         f"give less (leave it unset for a share of free memory)")


def check_redis_url(url: str, option: str = "kv_remote") -> None:
    """Refuse a kv_remote that redis-py would misread, before the weights load: a password with
    an unencoded / # ? or @ (redis-py took part of it for the port or database, and the error
    came minutes later without naming kv_remote), a bad port, a database that is not a
    number, a TLS file that is not there. Errors show the URL with its password hidden."""
    shown = redact_url(url)
    url = lower_scheme(url)
    if not url.startswith(REDIS_URL_SCHEMES):
        raise ValueError(f"{option} {shown!r} is not a Redis URL; use redis://host:port/db "
                         "(or rediss:// for TLS, unix:///path/redis.sock)")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as e:  # e.g. an unclosed [ of an IPv6 host
        raise ValueError(f"{option} {shown!r}: cannot read it ({e}); e.g. redis://[::1]:6379/0") from None
    encode = ("percent-encode the password (and user name): in Python urllib.parse.quote(password, safe=''), "
              "e.g. / is %2F, # is %23, ? is %3F, @ is %40, : is %3A")
    if url_cut_short(parts) and parts.scheme != "unix":
        raise ValueError(f"{option} {shown!r}: the password seems to hold a / # or ? that cuts the URL short; "
                         + encode)
    if parts.scheme != "unix":
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number in range
        except ValueError as e:
            raise ValueError(f"{option} {shown!r}: cannot read the port ({e}); if the password holds a : or @, "
                             + encode) from None
        if parts.port == 0:
            raise ValueError(f"{option} {shown!r}: port 0 is no server's port; Redis listens on 6379 by default")
        host = parts.hostname or ""
        if host and not (host.isascii() and host.isprintable() and " " not in host):
            raise ValueError(f"{option} {shown!r}: the host name {host!r} holds spaces or characters a host "
                             "name cannot; e.g. redis://127.0.0.1:6379/0")
        db = parts.path.strip("/")
        if db and not (db.isascii() and db.isdigit()):  # redis-py would quietly use database 0
            said = repr(db) if "password" not in db.lower() else "a path holding a password"
            raise ValueError(f"{option} {shown!r}: the path names the database and must be a number "
                             f"(got {said}); e.g. redis://host:6379/0")
        _check_db_number(db, shown, option)
    for name, value in urllib.parse.parse_qsl(parts.query):
        if name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path") and not os.path.exists(value):
            raise ValueError(f"{option} {shown!r}: {name} names {value!r}, which does not exist")
        if name == "db" and parts.scheme == "unix" and value.isascii() and value.isdigit():
            _check_db_number(value, shown, option)
        if name == "db" and parts.scheme != "unix":  # redis-py takes it over the path, which logs would show
            raise ValueError(f"{option} {shown!r}: give the database in the path, not as ?db=; e.g. "
                             "redis://host:6379/3")
        if name in ("socket_timeout", "socket_connect_timeout"):
            raise ValueError(f"{option} {shown!r}: tierlm sets {name} itself (a request must never wait "
                             "long on Redis); remove it" + (", and use kv_read_timeout for how long a request may "
                                                        "wait for its prefix" if option == "kv_remote" else ""))
    try:
        from redis.connection import parse_url
    except ImportError:  # the serving extras are not installed: the tier will say so when built
        return
    try:
        parse_url(url)  # what redis-py itself will refuse (a db=abc option, a bad timeout), now
    except ValueError as e:
        raise ValueError(f"{option} {shown!r}: {str(e).replace(url, shown)}") from None


_MAX_REDIS_DB = 2**31 - 1  # SELECT reads a C int: past it Redis answers "out of range", on every connect


def _check_db_number(db: str, shown: str, option: str) -> None:
    """A database number Redis cannot even parse (2**31 and up) started the tier, which then
    failed every connect as an outage, with warnings blaming its memory settings."""
    if db and (len(db.lstrip("0")) > 10 or int(db) > _MAX_REDIS_DB):  # (int() refuses 4,300 digits and more)
        said = db if len(db) <= 20 else f"{db[:20]}... ({len(db)} digits)"
        raise ValueError(f"{option} {shown!r}: database {said} is out of Redis's range; use a database "
                         "number below the server's `databases` setting (default 16), e.g. redis://host:6379/0")


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.1f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


def check_disk_dir(path: str) -> None:
    """The disk tier's directory must be a directory this process can write (or create): said
    before the model loads, not after."""
    p = os.path.abspath(path)
    probe = p
    while not os.path.lexists(probe):  # the nearest existing ancestor is where it would be created
        probe = os.path.dirname(probe)
    if os.path.islink(probe) and not os.path.exists(probe):
        raise ValueError(f"kv_disk_dir {path!r} cannot be created: {probe} is a symbolic link to nothing "
                         f"({os.readlink(probe)!r}); create its target or give another directory")
    if os.path.exists(p) and not os.path.isdir(p):
        raise ValueError(f"kv_disk_dir {path!r} exists and is not a directory; give a directory for the disk tier")
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"kv_disk_dir {path!r} cannot be written here ({probe} is not a writable directory); "
                         "give a writable directory for the disk tier")


def default_kv_cache_memory(device: torch.device) -> int:
    """A share of free memory for KV: 80% of free GPU memory, or 25% of available RAM capped at 8 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    mem = host_memory()
    avail = mem[1] if mem else 4 << 30
    return int(min(avail * 0.25, 8 << 30))
