"""Metrics, traces and the per-request log line: what the server tells operators about itself.

Three outputs, one source. Every generation request gets a `RequestTelemetry` (created by
`TelemetryMiddleware` when the request arrives, fed by the engine stream as deltas come back,
finished when the response has been sent); from it come

- Prometheus metrics (`GET /metrics`), named like vLLM's where the meaning is the same
  (`tierlm:time_to_first_token_seconds` ~ `vllm:time_to_first_token_seconds`), labelled by
  model and tenant. Engine-wide state (running/waiting requests, KV blocks, preemptions,
  prefix-cache lookups, step size) is read from `engine.stats()` at scrape time by
  `EngineCollector`, so the engine loop never pays for metrics;
- OpenTelemetry traces, only when asked for (`--otlp-endpoint`): a SERVER span per request that
  continues the caller's `traceparent`, with `queue`, `prefill` and `decode` children built
  afterwards from the engine's timestamps, and GenAI semantic-convention attributes;
- one JSON line per finished request on the `tierlm.requests` logger.

Each app owns its `Telemetry` (its own `CollectorRegistry` and tracer provider), so tests
and multi-app processes never share or clash on global state.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping
from urllib.parse import urlparse

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tierlm.serving.errors import OPENAI_PATHS

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from tierlm.engine.outputs import StreamDelta
    from tierlm.sampling_params import SamplingParams

logger = logging.getLogger("tierlm.serving")
request_log = logging.getLogger("tierlm.requests")

# The routes that run the model (text, or embeddings), and the GenAI operation each performs.
GENERATION_ROUTES: dict[str, str] = {
    "/v1/messages": "chat",
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
    "/v1/embeddings": "embeddings",
    # vLLM's score and rerank (serving/rerank.py): embeddings compared
    "/score": "embeddings", "/v1/score": "embeddings",
    "/rerank": "embeddings", "/v1/rerank": "embeddings", "/v2/rerank": "embeddings",
}
DEFAULT_TENANT = "default"
UNKNOWN_MODEL = "unknown"  # the request failed before its model was resolved (bad body, no such model)

# Latency buckets (seconds) wide enough for a CPU server: vLLM's, plus a longer tail.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# monotonic seconds → wall-clock ns, for spans built after the fact from engine timestamps.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def _wall_ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


# ---- metrics ---------------------------------------------------------------------------


class Metrics:
    """The request-level Prometheus metrics of one app, in its own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        lbl = ["model", "tenant"]

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, lbl, buckets=tuple(buckets), registry=registry)

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, lbl + (extra or []), registry=registry)

        self.requests = counter("tierlm:requests", "Generation requests by route and final HTTP status "
                                "(a stream that ends in an error event counts with that error's status).",
                                ["route", "status"])
        self.request_success = counter("tierlm:request_success", "Requests that finished generating, by reason.",
                                       ["finished_reason"])
        self.prompt_tokens = counter("tierlm:prompt_tokens", "Prompt tokens of requests that started generating "
                                     "(whole prompts, prefix-cache hits included).")
        self.generation_tokens = counter("tierlm:generation_tokens", "Output tokens generated.")
        self.prefix_cache_hit_tokens = counter("tierlm:prefix_cache_hit_tokens",
                                               "Prompt tokens served from the prefix cache instead of computed.")
        self.ttft = hist("tierlm:time_to_first_token_seconds",
                         "Arrival of the HTTP request to its first output token.", TTFT_BUCKETS)
        self.tpot = hist("tierlm:time_per_output_token_seconds",
                         "Mean time per output token after the first, per request.", TPOT_BUCKETS)
        self.itl = hist("tierlm:inter_token_latency_seconds", "Time between consecutive output tokens.",
                        TPOT_BUCKETS)
        self.e2e = hist("tierlm:e2e_request_latency_seconds", "Arrival to last output token.", REQUEST_BUCKETS)
        self.queue = hist("tierlm:request_queue_time_seconds",
                          "Time a request waited in the engine before its first step.", REQUEST_BUCKETS)
        self.prefill = hist("tierlm:request_prefill_time_seconds",
                            "First engine step to first output token (prompt processing).", REQUEST_BUCKETS)
        self.decode = hist("tierlm:request_decode_time_seconds", "First to last output token.", REQUEST_BUCKETS)
        self.request_prompt_tokens = hist("tierlm:request_prompt_tokens", "Prompt length per finished request.",
                                          TOKEN_BUCKETS)
        self.request_generation_tokens = hist("tierlm:request_generation_tokens",
                                              "Output length per finished request.", TOKEN_BUCKETS)
        self.rate_limited = Counter("tierlm:rate_limited_requests", "Requests refused (429) at admission because "
                                    "their tenant was over a limit: requests, tokens (per minute) or concurrency.",
                                    ["tenant", "reason"], registry=registry)
        self.limits_store_failures = Counter(
            "tierlm:limits_store_failures", "Calls to the shared limits store (--limits-store) that failed or "
            "timed out; the server then limits its tenants on its own for a few seconds.", registry=registry)

        self.batch_requests = Counter("tierlm:batch_requests", "Requests of batches (Anthropic's "
                                      "/v1/messages/batches, OpenAI's /v1/batches) by how they ended: succeeded, "
                                      "errored (for OpenAI's: any answer but 2xx), canceled or expired.",
                                      ["tenant", "result"], registry=registry)
        self.batches_in_progress = Gauge("tierlm:batches_in_progress", "Batches (both APIs') not yet ended.",
                                         registry=registry)
        self.files_bytes = Gauge("tierlm:files_bytes", "Bytes of the files the Files APIs hold (uploads and batches' "
                                 "results; uploads are refused past tierlm:files_capacity_bytes).", registry=registry)
        self.files_capacity_bytes = Gauge("tierlm:files_capacity_bytes", "The most bytes uploads may bring the "
                                          "files to (--files-max-bytes).", registry=registry)

        self.sla_shed = Counter("tierlm:sla_shed_requests", "Requests refused (529/503) before reaching the engine "
                                "because of their tier's time-to-first-token target: 'estimate' (the engine's "
                                "estimate was past it) or 'breaker' (the tier's circuit breaker was open).",
                                ["model", "tier", "reason"], registry=registry)
        self.sla_fallbacks = Counter("tierlm:sla_fallbacks", "Requests the SLA guard refused for `model` and "
                                     "its `fallback` model served instead (--fallback-model).",
                                     ["model", "fallback", "tier", "reason"], registry=registry)
        self.sla_breaker_trips = Counter("tierlm:sla_breaker_trips", "Times a tier's SLA circuit breaker on a "
                                         "model opened (too many of its requests missed their target).",
                                         ["model", "tier"], registry=registry)
        self.safety = counter("tierlm:safety_actions", "What the safety layer did, per policy: 'input' (a prompt "
                              "refused), 'output' (an answer stopped), 'redact' (a phrase of an answer masked).",
                              ["policy", "action"])

    def forget_model(self, model: str) -> None:
        """Drop every series of `model`, a LoRA adapter unloaded at run time: else each adapter
        name ever served kept its series (~230 lines of /metrics per tenant that used it) for good.
        A request of it still running when it is unloaded adds its series back as it ends."""
        for metric in vars(self).values():
            names = getattr(metric, "_labelnames", ())
            if "model" in names:
                at = names.index("model")
                for values in list(metric._metrics):
                    if values[at] == model:
                        metric.remove(*values)

    def count_refusal(self, tenant: str, reason: str) -> None:
        self.rate_limited.labels(tenant, reason).inc()

    def count_trip(self, model: str, tier: str) -> None:
        self.sla_breaker_trips.labels(model, tier).inc()


@dataclass
class _EngineFigures:
    """What `EngineCollector` exports, with the EngineStats field each comes from."""

    name: str
    doc: str
    source: str
    kind: str  # "gauge" | "counter"


ENGINE_FIGURES = (
    _EngineFigures("tierlm:num_requests_running", "Requests in the engine's running batch.", "num_running", "gauge"),
    _EngineFigures("tierlm:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting", "gauge"),
    _EngineFigures("tierlm:kv_blocks_used", "KV-cache blocks held by running requests.", "kv_blocks_used", "gauge"),
    _EngineFigures("tierlm:kv_blocks_total", "KV-cache blocks in the device pool.", "kv_blocks_total", "gauge"),
    _EngineFigures("tierlm:step_batch_tokens", "Tokens computed in the engine's latest step.", "last_step_tokens",
                   "gauge"),
    _EngineFigures("tierlm:step_batch_seqs", "Requests in the engine's latest step.", "last_step_seqs", "gauge"),
    _EngineFigures("tierlm:num_preemptions", "Requests preempted (KV freed, recomputed later).", "num_preemptions",
                   "counter"),
    _EngineFigures("tierlm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                   "prefix_cache_queries", "counter"),
    _EngineFigures("tierlm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits",
                   "counter"),
    _EngineFigures("tierlm:computed_prompt_tokens", "Prompt tokens run through the model (cache hits excluded, "
                   "recomputation after preemption included).", "prompt_tokens", "counter"),
    _EngineFigures("tierlm:engine_generation_tokens", "Tokens sampled by the engine (all clients).",
                   "generation_tokens", "counter"),
    _EngineFigures("tierlm:engine_steps", "Engine steps run.", "steps", "counter"),
    _EngineFigures("tierlm:spec_decode_num_drafts", "Steps of a request that checked speculative guesses "
                   "(n-gram lookup).", "spec_drafts", "counter"),
    _EngineFigures("tierlm:spec_decode_num_draft_tokens", "Speculative guesses checked by the model.",
                   "spec_draft_tokens", "counter"),
    _EngineFigures("tierlm:spec_decode_num_accepted_tokens", "Speculative guesses accepted (tokens that took no "
                   "step of their own).", "spec_accepted_tokens", "counter"),
    _EngineFigures("tierlm:kv_evictions", "Cached device KV blocks evicted to make room.", "kv_evictions",
                   "counter"),
    _EngineFigures("tierlm:kv_promoted_blocks", "KV blocks copied up from a lower tier to the device.",
                   "kv_promoted_blocks", "counter"),
    _EngineFigures("tierlm:kv_demoted_blocks", "KV blocks copied down from the device to a lower tier.",
                   "kv_demoted_blocks", "counter"),
    _EngineFigures("tierlm:kv_promoted_bytes", "Bytes of KV promoted to the device.", "kv_promoted_bytes",
                   "counter"),
    _EngineFigures("tierlm:kv_demoted_bytes", "Bytes of KV demoted from the device.", "kv_demoted_bytes",
                   "counter"),
    _EngineFigures("tierlm:kv_write_backlog_bytes", "Bytes of KV queued in host memory for the disk or Redis "
                   "writer (beyond the host tier; bounded at 1 GiB, writes past it are dropped).",
                   "kv_write_backlog_bytes", "gauge"),
    _EngineFigures("tierlm:kv_staged_bytes", "Bytes of KV read from disk or Redis, held in host memory until "
                   "promoted to the device.", "kv_staged_bytes", "gauge"),
    _EngineFigures("tierlm:kv_held_bytes", "Bytes of KV from lower tiers kept by requests waiting for device "
                   "room (bounded at 1 GiB; past it a request keeps the head of its prefix).", "kv_held_bytes",
                   "gauge"),
)


class EngineCollector(Collector):
    """Reads `engine.stats()` of every served model when Prometheus scrapes.

    Pull, not push: the engine keeps its own cheap counters and nobody touches them between
    scrapes. Stats are read from another thread without a lock; each figure is a plain int, so
    a scrape may be one step stale, never torn.
    """

    def __init__(self, engines: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self._engines = engines

    def collect(self) -> Iterator[Any]:
        families: dict[str, Any] = {}
        for f in ENGINE_FIGURES:
            cls = GaugeMetricFamily if f.kind == "gauge" else CounterMetricFamily
            families[f.name] = cls(f.name, f.doc, labels=["model"])
        usage = GaugeMetricFamily("tierlm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                                  labels=["model"])
        tiers: dict[str, CounterMetricFamily] = {}  # per lower KV tier (host, disk, redis): its counters
        held = GaugeMetricFamily("tierlm:kv_tier_blocks", "KV blocks held now in a lower tier (host, disk).",
                                 labels=["model", "tier"])
        room = GaugeMetricFamily("tierlm:kv_tier_capacity_blocks", "Capacity of a lower KV tier, in blocks.",
                                 labels=["model", "tier"])
        cache_info = GaugeMetricFamily("tierlm:cache_config_info", "The device KV pool's shape (always 1): what "
                                       "K/V are stored as, tokens per block and blocks (vLLM's cache_config_info).",
                                       labels=["model", "cache_dtype", "block_size", "num_blocks"])
        lora = GaugeMetricFamily("tierlm:lora_requests", "Requests of each LoRA adapter now, running or waiting "
                                 "(every loaded adapter, 0 when idle).", labels=["model", "adapter", "state"])
        parts = GaugeMetricFamily("tierlm:kv_partition_blocks", "Cached device KV blocks no request holds, in a "
                                  "tenant's cache partition (kv_cache_share).", labels=["model", "tenant"])
        part_room = GaugeMetricFamily("tierlm:kv_partition_capacity_blocks", "Device KV blocks a tenant's cache "
                                      "partition keeps safe from other tenants' traffic.", labels=["model", "tenant"])
        host_parts = GaugeMetricFamily("tierlm:kv_host_partition_blocks", "Host-tier KV blocks in a tenant's "
                                       "partition of the host tier (kv_cache_share).", labels=["model", "tenant"])
        host_room = GaugeMetricFamily("tierlm:kv_host_partition_capacity_blocks", "Host-tier KV blocks a tenant's "
                                      "partition keeps safe from other tenants' traffic.", labels=["model", "tenant"])
        for model, engine in self._engines():
            try:
                stats = engine.stats()
            except Exception:  # a dead or fake engine must not break the whole scrape
                logger.debug("stats() of model %s failed; skipping it in /metrics", model, exc_info=True)
                continue
            for f in ENGINE_FIGURES:
                value = getattr(stats, f.source, None)
                if isinstance(value, (int, float)):
                    families[f.name].add_metric([model], float(value))
            used, total = getattr(stats, "kv_blocks_used", None), getattr(stats, "kv_blocks_total", None)
            if used is not None and total:
                usage.add_metric([model], used / total)
            if getattr(stats, "kv_cache_dtype", None):
                cache_info.add_metric([model, stats.kv_cache_dtype, str(stats.block_size), str(total)], 1.0)
            for tier, counts in (getattr(stats, "kv_tiers", None) or {}).items():
                for key, value in counts.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        name = f"tierlm:kv_tier_{key}"
                        if name not in tiers:
                            tiers[name] = CounterMetricFamily(name, f"KV tier counter '{key}' (see tierlm.kv.tiers).",
                                                              labels=["model", "tier"])
                        tiers[name].add_metric([model, tier], float(value))
            for tier, use in (getattr(stats, "kv_tier_usage", None) or {}).items():
                held.add_metric([model, tier], float(use["blocks"]))
                room.add_metric([model, tier], float(use["capacity"]))
            for adapter, counts in (getattr(stats, "lora_requests", None) or {}).items():
                for state, n in counts.items():
                    lora.add_metric([model, adapter, state], float(n))
            for source, blocks, capacity in (("kv_cache_partitions", parts, part_room),
                                             ("kv_host_partitions", host_parts, host_room)):
                for tenant, use in (getattr(stats, source, None) or {}).items():
                    blocks.add_metric([model, tenant or DEFAULT_TENANT], float(use["blocks"]))
                    capacity.add_metric([model, tenant or DEFAULT_TENANT], float(use["capacity"]))
        yield from families.values()
        yield usage
        yield cache_info
        yield from tiers.values()
        yield held
        yield room
        yield lora
        yield parts
        yield part_room
        yield host_parts
        yield host_room

    def describe(self) -> Iterator[Any]:
        return iter(())  # names are fixed, but describing would make registration call collect()


# ---- tracing ---------------------------------------------------------------------------


def otlp_traces_url(endpoint: str) -> str:
    """`http://collector:4318` → `http://collector:4318/v1/traces`; a URL with a path is kept."""
    parsed = urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"--otlp-endpoint must be an http(s) URL such as http://localhost:4318, got '{endpoint}'")
    return endpoint if parsed.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def make_tracer_provider(*, otlp_endpoint: str | None = None, span_exporter: "SpanExporter | None" = None,
                         service_name: str = "tierlm") -> "TracerProvider | None":
    """A tracer provider for one app, or None when tracing is off.

    `span_exporter` is exported synchronously (tests pass an `InMemorySpanExporter`); the OTLP
    exporter is batched so a slow collector never slows requests down.
    """
    if otlp_endpoint is None and span_exporter is None:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    if otlp_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_traces_url(otlp_endpoint))))
    return provider


# ---- the per-request object ------------------------------------------------------------


@dataclass
class RequestTelemetry:
    """One generation request as telemetry sees it: timestamps, token counts, outcome.

    All times are `time.monotonic()` seconds. Called only from the event loop.
    """

    owner: "Telemetry | None"
    route: str
    request_id: str
    arrival: float = field(default_factory=time.monotonic)
    model: str = UNKNOWN_MODEL
    tenant: str = DEFAULT_TENANT
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_prompt_tokens: int = 0  # every prompt's once (a batch of prompts; `n` choices share one)
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # all choices' (OpenAI `n`: one engine request per choice)
    # Prompt index (a batch of prompts: completions, embeddings) -> the tokens handed to the
    # engine (known before any output), and -> (prompt, cached) tokens as the engine reported them.
    _submitted: dict[int, int] = field(default_factory=dict)
    _prompts: dict[int, tuple[int, int]] = field(default_factory=dict)
    _prompt_of: dict[str, int] = field(default_factory=dict)  # engine request id -> its prompt's index
    _counted: set[int] = field(default_factory=set)  # prompts already in the token counters
    # Engine request id -> its output tokens so far: the choices of one HTTP request each report
    # their own running count (the last to report stood for all of them).
    _outputs: dict[str, int] = field(default_factory=dict)
    _last_token: dict[str, float] = field(default_factory=dict)  # engine request id -> its last token's time
    finish_reason: str | None = None
    _finish_of: dict[str, str] = field(default_factory=dict)  # engine request id -> its choice's finish reason
    # The id the client gets (chatcmpl-..., cmpl-..., msg_..., resp_...), set by the route: the
    # span's gen_ai.response.id, so traces join the client's logs (the server's is tierlm.request_id).
    response_id: str | None = None
    engine_arrival: float | None = None
    engine_first_scheduled: float | None = None
    engine_first_token: float | None = None
    error_status: int | None = None
    error_type: str | None = None
    status: int | None = None
    span: "Span | None" = None
    finished: bool = False
    shed: bool = False  # the SLA guard refused it (on_shed)
    # A cache warm (Anthropic's max_tokens 0): the prompt length the client is told; None otherwise
    warm_prompt_tokens: int | None = None
    # Prompt index -> the length of a prompt an input policy refused (never run, never charged),
    # which the client's usage still reports
    _refused: dict[int, int] = field(default_factory=dict)

    @property
    def usage_prompt_tokens(self) -> int:
        """The prompt tokens the client's usage reports: a refused prompt's too, though the
        engine never ran it (so the token counters, and the tenant's bill, leave it out)."""
        return self.num_prompt_tokens + sum(self._refused.values())

    @property
    def submitted_prompt_tokens(self) -> int:
        """Every prompt handed to the engine, once each: what the request costs even if it ends
        before any output."""
        return sum(self._submitted.values())

    # -- fed by the engine stream ------------------------------------------------------------
    def on_engine_request(self, model: str, params: "SamplingParams | None" = None, *,
                          tenant: str | None = None, prompt_tokens: int = 0, request_id: str | None = None,
                          prompt_index: int = 0) -> None:
        """Engine request `request_id` was resolved to a model and handed to its engine with
        prompt `prompt_index` of the HTTP request (its n choices share one), of `prompt_tokens`."""
        self.model = model
        self.tenant = tenant or DEFAULT_TENANT
        self._submitted[prompt_index] = max(self._submitted.get(prompt_index, 0), prompt_tokens)
        if request_id is not None:
            self._prompt_of[request_id] = prompt_index
        if params is not None:
            self.max_tokens, self.temperature, self.top_p = params.max_tokens, params.temperature, params.top_p
        if self.warm_prompt_tokens is not None:
            self.max_tokens = 0

    def on_shed(self, model: str, tier: str, reason: str) -> None:
        """The SLA guard refused the request before its engine saw it (sla.py): its tenant's
        requests_per_minute unit is given back when it ends (TenancyMiddleware)."""
        self.model = model
        self.shed = True
        if self.owner:
            self.owner.metrics.sla_shed.labels(model, tier, reason).inc()

    def on_fallback(self, model: str, fallback: str, tier: str, reason: str) -> None:
        """The SLA guard refused the request for `model`; `fallback` serves it (sla.py)."""
        if self.owner:
            self.owner.metrics.sla_fallbacks.labels(model, fallback, tier, reason).inc()

    def on_safety(self, model: str, policy: str, action: str) -> None:
        """The safety layer refused the prompt ('input'), stopped the answer ('output') or
        masked a phrase of it ('redact') for `policy` (safety.py)."""
        self.model = model
        if action != "redact":
            self.finish_reason = "content_filter"
        if self.owner:
            self.owner.metrics.safety.labels(model, self.tenant, policy, action).inc()

    def on_refused_prompt(self, num_prompt_tokens: int, prompt_index: int = 0) -> None:
        """An input policy refused prompt `prompt_index`, of `num_prompt_tokens` (after
        `on_safety`): the client's usage still reports them, so the log line and span do too."""
        self._refused[prompt_index] = num_prompt_tokens

    def warming(self, num_prompt_tokens: int) -> None:
        """The request only warms the cache (Anthropic's max_tokens 0): the one token the engine
        runs is never shown, so it is not counted (no output, no TTFT), and the prompt counted is
        the client's `num_prompt_tokens` (the engine may have run all but its last token)."""
        self.warm_prompt_tokens = num_prompt_tokens

    def on_delta(self, delta: "StreamDelta") -> None:
        now = time.monotonic()
        metrics = self.owner.metrics if self.owner else None
        warm = self.warm_prompt_tokens is not None
        n = 0 if warm else len(delta.token_ids)
        num_prompt = self.warm_prompt_tokens if warm else delta.num_prompt_tokens
        prompt = self._prompt_of.get(delta.request_id, 0)
        pooled = delta.embedding is not None
        if metrics is not None and prompt not in self._counted and (n or warm or pooled):
            lbl = (self.model, self.tenant)
            metrics.prompt_tokens.labels(*lbl).inc(num_prompt)
            metrics.prefix_cache_hit_tokens.labels(*lbl).inc(delta.num_cached_tokens)
            self._counted.add(prompt)
        if n and metrics is not None:
            lbl = (self.model, self.tenant)
            if self.first_token_at is None:
                metrics.ttft.labels(*lbl).observe(now - self.arrival)
            if delta.request_id in self._last_token:  # a choice's gaps from its own previous token
                gap = (now - self._last_token[delta.request_id]) / n
                itl = metrics.itl.labels(*lbl)
                for _ in range(n):
                    itl.observe(gap)
            metrics.generation_tokens.labels(*lbl).inc(n)
        if n:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = self._last_token[delta.request_id] = now
        elif (warm or pooled) and delta.finished:
            self.last_token_at = now  # the warm's or embedding's end: its e2e latency
        self._prompts[prompt] = (num_prompt, delta.num_cached_tokens)
        self.num_prompt_tokens = sum(p for p, _ in self._prompts.values())
        self.num_cached_tokens = sum(c for _, c in self._prompts.values())
        self._outputs[delta.request_id] = 0 if warm else delta.num_output_tokens
        self.num_output_tokens = sum(self._outputs.values())
        # Engine-side timestamps (optional: engines that do not report them leave these None).
        self.engine_arrival = getattr(delta, "arrival_time", None) or self.engine_arrival
        self.engine_first_scheduled = getattr(delta, "first_scheduled_time", None) or self.engine_first_scheduled
        self.engine_first_token = getattr(delta, "first_token_time", None) or self.engine_first_token
        if delta.finished:  # a warm ends at its length, as its client is told, whatever its dropped token was
            self.finish_reason = "length" if warm and delta.finish_reason != "abort" else delta.finish_reason
            if self.finish_reason is not None:
                self._finish_of[delta.request_id] = self.finish_reason

    @property
    def finish_reasons(self) -> list[str]:
        """Every choice's finish reason, in the order the choices were submitted (OpenTelemetry's
        gen_ai.response.finish_reasons: one per generation); else the request's one reason."""
        order = [r for r in self._prompt_of if r in self._finish_of]
        order += [r for r in self._finish_of if r not in self._prompt_of]
        reasons = [self._finish_of[r] for r in order]
        if self.finish_reason is not None and self.finish_reason not in reasons:
            reasons = [self.finish_reason]  # set outside the engine stream (a safety refusal)
        return reasons

    @property
    def choice_count(self) -> int:
        """Choices per prompt (OpenAI's `n`): engine requests handed in for one prompt."""
        per_prompt: dict[int, int] = {}
        for prompt in self._prompt_of.values():
            per_prompt[prompt] = per_prompt.get(prompt, 0) + 1
        return max(per_prompt.values(), default=1)

    def on_error(self, error: BaseException) -> None:
        """The request failed after it reached the engine (possibly mid-stream, after a 200)."""
        style = "openai" if self.route in OPENAI_PATHS else "anthropic"
        status_for = getattr(error, "status_for", None)  # APIError: the status this API's clients see
        self.error_status = int(status_for(style) if status_for else getattr(error, "status", 500))
        self.error_type = getattr(error, "anthropic_type", None) or type(error).__name__

    # -- the end -----------------------------------------------------------------------------
    def finish(self, http_status: int) -> None:
        """Record the outcome once: counters, latency histograms, span and log line."""
        if self.finished:
            return
        self.finished = True
        self.status = self.error_status if (self.error_status is not None and http_status < 400) else http_status
        owner = self.owner
        if owner is None:
            return
        try:
            self._record(owner)
        except Exception:  # telemetry must never fail a request
            logger.exception("recording telemetry for %s failed", self.request_id)

    @property
    def ok(self) -> bool:
        return self.status is not None and self.status < 400 and self.finish_reason not in (None, "abort")

    def latencies(self) -> dict[str, float | None]:
        """Seconds: ttft, e2e, tpot, queue, prefill, decode (None when not applicable)."""
        out: dict[str, float | None] = dict.fromkeys(("ttft", "e2e", "tpot", "queue", "prefill", "decode"))
        if self.first_token_at is not None:
            out["ttft"] = self.first_token_at - self.arrival
        if self.last_token_at is not None:
            out["e2e"] = self.last_token_at - self.arrival
            if self.first_token_at is not None:
                out["decode"] = self.last_token_at - self.first_token_at
                longest = max(self._outputs.values(), default=0)  # choices decode side by side
                if longest > 1:
                    out["tpot"] = out["decode"] / (longest - 1)
        if self.engine_arrival is not None and self.engine_first_scheduled is not None:
            out["queue"] = max(self.engine_first_scheduled - self.engine_arrival, 0.0)
            if self.engine_first_token is not None:
                out["prefill"] = max(self.engine_first_token - self.engine_first_scheduled, 0.0)
        return out

    def _record(self, owner: "Telemetry") -> None:
        m = owner.metrics
        lbl = (self.model, self.tenant)
        m.requests.labels(*lbl, self.route, str(self.status)).inc()
        lat = self.latencies()
        if self.ok:
            m.request_success.labels(*lbl, self.finish_reason).inc()
            for name, hist in (("e2e", m.e2e), ("tpot", m.tpot), ("queue", m.queue), ("prefill", m.prefill),
                               ("decode", m.decode)):
                if lat[name] is not None:
                    hist.labels(*lbl).observe(lat[name])
            m.request_prompt_tokens.labels(*lbl).observe(self.usage_prompt_tokens)
            m.request_generation_tokens.labels(*lbl).observe(self.num_output_tokens)
        trace_id = self._end_span(lat) if self.span is not None else None
        if owner.log_requests:
            request_log.info(json.dumps(self.log_record(lat, trace_id), separators=(",", ":")))

    def log_record(self, lat: dict[str, float | None] | None = None, trace_id: str | None = None) -> dict[str, Any]:
        lat = lat or self.latencies()

        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1000, 3)

        record: dict[str, Any] = {
            "event": "request", "request_id": self.request_id, "model": self.model, "tenant": self.tenant,
            "route": self.route, "status": self.status, "finish_reason": self.finish_reason,
            "prompt_tokens": self.usage_prompt_tokens, "cached_tokens": self.num_cached_tokens,
            "output_tokens": self.num_output_tokens, "ttft_ms": ms(lat["ttft"]),
            "duration_ms": ms(time.monotonic() - self.arrival), "queue_ms": ms(lat["queue"]),
        }
        if self.error_type is not None:
            record["error"] = self.error_type
        if trace_id is not None:
            record["trace_id"] = trace_id
        return record

    def _end_span(self, lat: dict[str, float | None]) -> str:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        span = self.span
        assert span is not None and self.owner is not None and self.owner.tracer is not None
        attrs: dict[str, Any] = {
            "gen_ai.request.model": self.model, "gen_ai.response.model": self.model,
            "gen_ai.response.id": self.response_id or self.request_id,
            "gen_ai.usage.input_tokens": self.usage_prompt_tokens,
            "gen_ai.usage.output_tokens": self.num_output_tokens,
            "gen_ai.usage.cache_read.input_tokens": self.num_cached_tokens,
            "http.response.status_code": int(self.status or 0),
            "tierlm.tenant": self.tenant,
        }
        if self.finish_reasons:
            attrs["gen_ai.response.finish_reasons"] = self.finish_reasons
        if self.choice_count != 1:
            attrs["gen_ai.request.choice.count"] = self.choice_count
        for key, value in (("max_tokens", self.max_tokens), ("temperature", self.temperature),
                           ("top_p", self.top_p)):
            if value is not None:
                attrs[f"gen_ai.request.{key}"] = value
        for key, name in (("time_to_first_token", "ttft"), ("e2e", "e2e"), ("time_in_queue", "queue"),
                          ("time_in_model_prefill", "prefill"), ("time_in_model_decode", "decode")):
            if lat[name] is not None:
                attrs[f"gen_ai.latency.{key}"] = lat[name]  # vLLM's span attribute names
        span.update_name(f"{GENERATION_ROUTES.get(self.route, 'chat')} {self.model}")
        span.set_attributes(attrs)
        if self.status is not None and self.status >= 400:
            # OpenTelemetry's HTTP conventions: error.type on every failure; a server span's status
            # is ERROR only for 5xx (a 4xx is the client's error, not the server's).
            span.set_attribute("error.type", self.error_type or str(self.status))
            if self.status >= 500:
                span.set_status(Status(StatusCode.ERROR, self.error_type or f"HTTP {self.status}"))
        # Children from the engine's own clock: queue → prefill → decode.
        parent = trace.set_span_in_context(span)
        tracer = self.owner.tracer
        phases = []
        if self.engine_arrival is not None and self.engine_first_scheduled is not None:
            phases.append(("queue", self.engine_arrival, self.engine_first_scheduled))
            if self.engine_first_token is not None:
                phases.append(("prefill", self.engine_first_scheduled, self.engine_first_token))
        elif self.first_token_at is not None:  # an engine without timestamps: the serving-side view
            phases.append(("prefill", self.arrival, self.first_token_at))
        if self.first_token_at is not None and self.last_token_at is not None:
            start = self.engine_first_token if self.engine_first_token is not None else self.first_token_at
            phases.append(("decode", start, max(self.last_token_at, start)))
        for name, start, end in phases:
            child = tracer.start_span(name, context=parent, start_time=_wall_ns(start))
            if name == "decode":
                child.set_attribute("gen_ai.usage.output_tokens", self.num_output_tokens)
            elif name == "prefill":
                child.set_attribute("gen_ai.usage.input_tokens", self.num_prompt_tokens)
                child.set_attribute("gen_ai.usage.cache_read.input_tokens", self.num_cached_tokens)
            child.end(end_time=_wall_ns(end))
        span.end()
        return format(span.get_span_context().trace_id, "032x")


# ---- the app-wide object ---------------------------------------------------------------


class Telemetry:
    """An app's metrics registry, tracer and request log: build one per app.

    `engines` returns the (model name, engine) pairs to read stats from at scrape time.
    Tracing is on when `otlp_endpoint` or `span_exporter` is given.
    """

    def __init__(self, engines: Callable[[], Iterable[tuple[str, Any]]] | Mapping[str, Any] | None = None, *,
                 otlp_endpoint: str | None = None, span_exporter: "SpanExporter | None" = None,
                 service_name: str = "tierlm", log_requests: bool = True,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self._engines: Callable[[], Iterable[tuple[str, Any]]] = lambda: ()
        if engines is not None:
            self.watch(engines)
        self.registry.register(EngineCollector(lambda: self._engines()))
        self.tracer_provider = make_tracer_provider(otlp_endpoint=otlp_endpoint, span_exporter=span_exporter,
                                                    service_name=service_name)
        self.tracer: "Tracer | None" = (self.tracer_provider.get_tracer("tierlm.serving")
                                        if self.tracer_provider is not None else None)
        self.log_requests = log_requests

    def watch(self, engines: Callable[[], Iterable[tuple[str, Any]]] | Mapping[str, Any]) -> None:
        """Read engine stats from `engines` (name → engine, or a callable giving the pairs) at scrape."""
        if isinstance(engines, Mapping):
            mapping = engines
            self._engines = lambda: list(mapping.items())
        else:
            self._engines = engines

    def start_request(self, route: str, request_id: str, headers: Mapping[str, str] | None = None,
                      arrival: float | None = None) -> RequestTelemetry:
        rt = RequestTelemetry(owner=self, route=route, request_id=request_id)
        if arrival is not None:
            rt.arrival = arrival
        if self.tracer is not None:
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            parent = TraceContextTextMapPropagator().extract(dict(headers or {}))
            rt.span = self.tracer.start_span(
                GENERATION_ROUTES.get(route, "chat"), context=parent, kind=SpanKind.SERVER,
                start_time=_wall_ns(rt.arrival),
                attributes={"gen_ai.operation.name": GENERATION_ROUTES.get(route, "chat"),
                            "gen_ai.system": "tierlm", "gen_ai.provider.name": "tierlm",
                            "http.request.method": "POST", "http.route": route,
                            "tierlm.request_id": request_id})
        return rt

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def metrics_endpoint(self, request: Request) -> Response:
        """`GET /metrics` in Prometheus text format (no auth, like /health: scrapers carry no key)."""
        return Response(self.render(), media_type=CONTENT_TYPE_LATEST)

    def shutdown(self) -> None:
        """Flush spans still buffered for the OTLP collector."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()


def request_telemetry(request: Request) -> RequestTelemetry:
    """The request's telemetry, or a fresh no-op one where no middleware installed it."""
    rt = request.scope.get("state", {}).get("telemetry")
    if rt is None:
        return RequestTelemetry(owner=None, route=request.url.path, request_id="")
    return rt


class TelemetryMiddleware:
    """Opens a `RequestTelemetry` for each generation request and finishes it with the final
    status once the response is fully sent (or the client left: 499, or it crashed: 500).

    It must sit inside `RequestIdMiddleware`, which sets the request id it reads.
    """

    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app = app
        self.telemetry = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        state = scope.setdefault("state", {}) if scope["type"] == "http" else {}
        if (scope["type"] != "http" or scope.get("method") != "POST" or path not in GENERATION_ROUTES
                or state.get("telemetry") is not None):  # an observer installed further out wins
            await self.app(scope, receive, send)
            return
        rt = self.telemetry.start_request(path, state.get("request_id", ""), Headers(scope=scope))
        state["telemetry"] = rt
        status: int | None = None
        complete = False

        async def send_and_watch(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True

        try:
            await self.app(scope, receive, send_and_watch)
        except Exception:
            rt.finish(500)
            raise
        except BaseException:  # cancelled: the connection went away
            rt.finish(499)
            raise
        else:
            rt.finish(status if (complete and status is not None) else (499 if status is not None else 500))


def configure_request_log(stream: Any = None) -> None:
    """Send the per-request JSON lines, bare (no timestamp prefix), to `stream` (stderr).

    Other loggers keep their human-readable format. Idempotent.
    """
    if any(getattr(h, "_tierlm_request_log", False) for h in request_log.handlers):
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler._tierlm_request_log = True  # type: ignore[attr-defined]
    request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False
