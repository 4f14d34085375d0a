"""Telemetry: metrics, traces and request log lines, first on a scripted app, then on the real server.

The scripted app (a Starlette route that feeds `RequestTelemetry` hand-made deltas with known
timestamps) pins the exact numbers; the real-server tests send known traffic through
`build_app` over the demo engine and check the counts and histograms /metrics reports, the
span tree an in-memory exporter receives, and the JSON log line.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tierlm.engine.outputs import StreamDelta
from tierlm.kv.tiers import TierStats
from tierlm.sampling_params import SamplingParams
from tierlm.serving.telemetry import (
    EngineCollector,
    Telemetry,
    TelemetryMiddleware,
    otlp_traces_url,
    request_telemetry,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text → {(sample name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text_or_samples, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels` (0 if none)."""
    s = samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    return sum(v for (n, lbl), v in s.items() if n == name and all(dict(lbl).get(k) == x for k, x in labels.items()))


def in_memory_exporter():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    return InMemorySpanExporter()


# ---- a scripted app ----------------------------------------------------------------------


class _SetRequestId:
    """Stands in for the server's RequestIdMiddleware (outermost, sets scope state request_id)."""

    def __init__(self, app) -> None:
        self.app = app
        self.n = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.n += 1
            scope.setdefault("state", {})["request_id"] = f"req_{self.n}"
        await self.app(scope, receive, send)


def scripted_app(telemetry: Telemetry):
    """POST /v1/completions: 4 output tokens 10 ms apart, engine timestamps 5 ms queue, 20 ms prefill.
    ?fail=1 fails with 400 before reaching the engine; ?midstream=1 fails after the first token."""

    async def completions(request: Request):
        rt = request_telemetry(request)
        if request.query_params.get("fail"):
            return JSONResponse({"error": "bad"}, status_code=400)
        choices = int(request.query_params.get("choices", 1))  # OpenAI `n`: one engine request each
        reasons = request.query_params.get("reasons", ",".join(["length"] * choices)).split(",")
        ids = [f"r-{c}" if choices > 1 else "r" for c in range(choices)]
        for rid in ids:
            rt.on_engine_request("m1", SamplingParams(max_tokens=4, temperature=0.5, top_p=0.9), request_id=rid)
        t0 = time.monotonic()
        times = dict(arrival_time=t0, first_scheduled_time=t0 + 0.005, first_token_time=t0 + 0.025)
        for i in range(4):
            for c in reversed(range(choices)):  # the last choice reports first: the span still lists them in order
                time.sleep(0.01)
                if i == 1 and request.query_params.get("midstream"):
                    from tierlm.serving.errors import Overloaded
                    rt.on_error(Overloaded("overloaded"))
                    return JSONResponse({"partial": True})  # the stream's 200 already went out
                rt.on_delta(StreamDelta(ids[c], "x", [7], finished=i == 3,
                                        finish_reason=reasons[c] if i == 3 else None, num_prompt_tokens=12,
                                        num_cached_tokens=4, num_output_tokens=i + 1, **times))
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/metrics", telemetry.metrics_endpoint, methods=["GET"])])
    return _SetRequestId(TelemetryMiddleware(app, telemetry))


async def _post(app, path: str, **kw) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post(path, json={}, **kw)


async def _get(app, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.get(path)


async def test_request_metrics_count_tokens_and_latencies():
    tel = Telemetry(log_requests=False)
    app = scripted_app(tel)
    for _ in range(2):
        assert (await _post(app, "/v1/completions")).status_code == 200
    assert (await _post(app, "/v1/completions?fail=1")).status_code == 400
    r = await _get(app, "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = samples(r.text)
    lbl = dict(model="m1", tenant="default")
    assert value(s, "tierlm:requests_total", route="/v1/completions", status="200", **lbl) == 2
    # The 400 never reached an engine, so its model is unknown.
    assert value(s, "tierlm:requests_total", route="/v1/completions", status="400", model="unknown") == 1
    assert value(s, "tierlm:request_success_total", finished_reason="length", **lbl) == 2
    assert value(s, "tierlm:prompt_tokens_total", **lbl) == 24
    assert value(s, "tierlm:prefix_cache_hit_tokens_total", **lbl) == 8
    assert value(s, "tierlm:generation_tokens_total", **lbl) == 8
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert value(s, f"tierlm:{name}_count", **lbl) == 2, name
    assert value(s, "tierlm:inter_token_latency_seconds_count", **lbl) == 6  # 3 gaps per request
    # Engine timestamps: 5 ms queue, 20 ms prefill, exactly.
    assert value(s, "tierlm:request_queue_time_seconds_sum", **lbl) == pytest.approx(0.010)
    assert value(s, "tierlm:request_prefill_time_seconds_sum", **lbl) == pytest.approx(0.040)
    # Serving-side clocks: 4 tokens 10 ms apart → ITL ≈ 10 ms, TPOT ≈ 10 ms, TTFT ≥ 10 ms.
    itl_mean = value(s, "tierlm:inter_token_latency_seconds_sum", **lbl) / 6
    assert 0.009 <= itl_mean < 0.05
    assert value(s, "tierlm:time_to_first_token_seconds_sum", **lbl) / 2 >= 0.009
    assert value(s, "tierlm:time_to_first_token_seconds_bucket", le="0.005", **lbl) == 0


async def test_the_choices_of_one_request_count_their_own_token_gaps():
    """OpenAI `n`: the choices share one request's record; each choice's gaps were measured from
    whichever choice spoke last (a quarter of the real gap with n=4), and a choice's first token
    counted as a gap."""
    tel = Telemetry(log_requests=False)
    app = scripted_app(tel)
    assert (await _post(app, "/v1/completions?choices=2")).status_code == 200
    s = samples((await _get(app, "/metrics")).text)
    lbl = dict(model="m1", tenant="default")
    assert value(s, "tierlm:generation_tokens_total", **lbl) == 8
    assert value(s, "tierlm:request_generation_tokens_sum", **lbl) == 8  # both choices' tokens
    assert value(s, "tierlm:inter_token_latency_seconds_count", **lbl) == 6  # 3 gaps per choice (7 before)
    itl_mean = value(s, "tierlm:inter_token_latency_seconds_sum", **lbl) / 6
    assert 0.019 <= itl_mean < 0.1  # each choice speaks every 20 ms (10 ms before)


async def test_midstream_error_counts_with_the_error_status():
    tel = Telemetry(log_requests=False)
    app = scripted_app(tel)
    assert (await _post(app, "/v1/completions?midstream=1")).status_code == 200
    s = samples(tel.render().decode())
    assert value(s, "tierlm:requests_total", status="503", model="m1") == 1  # Overloaded, as OpenAI clients see it
    assert value(s, "tierlm:request_success_total") == 0
    assert value(s, "tierlm:e2e_request_latency_seconds_count") == 0
    assert value(s, "tierlm:generation_tokens_total") == 1  # the token that was streamed still counts


async def test_span_tree_and_genai_attributes_continue_the_callers_trace():
    exporter = in_memory_exporter()
    tel = Telemetry(span_exporter=exporter, log_requests=False)
    app = scripted_app(tel)
    assert (await _post(app, "/v1/completions", headers={"traceparent": TRACEPARENT})).status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"text_completion m1", "queue", "prefill", "decode"}
    root = spans["text_completion m1"]
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_SPAN_ID
    for name in ("queue", "prefill", "decode"):
        child = spans[name]
        assert child.parent.span_id == root.context.span_id and child.context.trace_id == root.context.trace_id
        assert root.start_time <= child.start_time <= child.end_time
    assert spans["queue"].end_time == spans["prefill"].start_time
    assert spans["prefill"].end_time == spans["decode"].start_time
    assert (spans["prefill"].end_time - spans["prefill"].start_time) == pytest.approx(20e6, abs=1e4)
    a = root.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == "m1" and a["gen_ai.response.model"] == "m1"
    assert a["gen_ai.usage.input_tokens"] == 12 and a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.usage.cache_read.input_tokens"] == 4
    assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.request.top_p"] == 0.9
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.response.id"] == "req_1" and a["http.response.status_code"] == 200
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.005)
    from opentelemetry.trace import SpanKind, StatusCode
    assert root.kind == SpanKind.SERVER and root.status.status_code != StatusCode.ERROR
    assert "gen_ai.request.choice.count" not in a  # n = 1: left out, as OpenTelemetry's GenAI conventions say


async def test_span_lists_every_choices_finish_reason_in_choice_order():
    """gen_ai.response.finish_reasons is one reason per generation (OpenTelemetry's GenAI
    conventions); it held only the last choice's to finish."""
    exporter = in_memory_exporter()
    app = scripted_app(Telemetry(span_exporter=exporter, log_requests=False))
    assert (await _post(app, "/v1/completions?choices=3&reasons=length,stop,stop")).status_code == 200
    (root,) = [s for s in exporter.get_finished_spans() if s.name.startswith("text_completion")]
    assert tuple(root.attributes["gen_ai.response.finish_reasons"]) == ("length", "stop", "stop")
    assert root.attributes["gen_ai.request.choice.count"] == 3


async def test_failed_request_span_follows_http_conventions_and_no_tracing_means_no_spans():
    """OpenTelemetry's HTTP conventions: a 4xx sets error.type but leaves a server span's status
    unset (the client's error, not the server's)."""
    exporter = in_memory_exporter()
    app = scripted_app(Telemetry(span_exporter=exporter, log_requests=False))
    await _post(app, "/v1/completions?fail=1")
    (span,) = exporter.get_finished_spans()
    from opentelemetry.trace import StatusCode
    assert span.status.status_code == StatusCode.UNSET
    assert span.attributes["http.response.status_code"] == 400 and span.attributes["error.type"]
    assert Telemetry(log_requests=False).tracer is None


async def test_one_json_log_line_per_request(caplog):
    app = scripted_app(Telemetry())
    with caplog.at_level(logging.INFO, logger="tierlm.requests"):
        await _post(app, "/v1/completions")
        await _post(app, "/v1/completions?fail=1")
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tierlm.requests"]
    assert len(lines) == 2
    ok, bad = lines
    assert ok["request_id"] == "req_1" and ok["model"] == "m1" and ok["status"] == 200
    assert ok["finish_reason"] == "length" and ok["prompt_tokens"] == 12 and ok["output_tokens"] == 4
    assert ok["cached_tokens"] == 4 and ok["ttft_ms"] > 0 and ok["duration_ms"] >= ok["ttft_ms"]
    assert bad["status"] == 400 and bad["finish_reason"] is None and bad["ttft_ms"] is None


def test_engine_collector_reads_stats_at_scrape_time():
    @dataclass
    class Stats:
        num_running: int = 3
        num_waiting: int = 2
        kv_blocks_used: int = 25
        kv_blocks_total: int = 100
        num_preemptions: int = 1
        prefix_cache_queries: int = 640
        prefix_cache_hits: int = 160
        prompt_tokens: int = 480
        generation_tokens: int = 50
        steps: int = 9
        last_step_tokens: int = 7
        last_step_seqs: int = 5
        kv_tiers: dict | None = None

    class Engine:
        def __init__(self):
            self.stats_obj = Stats()

        def stats(self):
            return self.stats_obj

    class Broken:
        def stats(self):
            raise RuntimeError("dead")

    engine = Engine()
    tel = Telemetry({"a": engine, "b": Broken()}, log_requests=False)
    s = samples(tel.render().decode())
    assert value(s, "tierlm:num_requests_running", model="a") == 3
    assert value(s, "tierlm:num_requests_waiting", model="a") == 2
    assert value(s, "tierlm:kv_blocks_used", model="a") == 25
    assert value(s, "tierlm:kv_blocks_total", model="a") == 100
    assert value(s, "tierlm:kv_cache_usage_perc", model="a") == 0.25
    assert value(s, "tierlm:num_preemptions_total", model="a") == 1
    assert value(s, "tierlm:prefix_cache_queries_total", model="a") == 640
    assert value(s, "tierlm:prefix_cache_hits_total", model="a") == 160
    assert value(s, "tierlm:step_batch_tokens", model="a") == 7
    assert value(s, "tierlm:step_batch_seqs", model="a") == 5
    assert value(s, "tierlm:num_requests_running", model="b") == 0  # skipped, scrape still works
    engine.stats_obj = Stats(num_running=0, kv_tiers={"host": {"hits": 4, "misses": 1}})
    s = samples(tel.render().decode())
    assert value(s, "tierlm:num_requests_running", model="a") == 0
    assert value(s, "tierlm:kv_tier_hits_total", model="a", tier="host") == 4


def test_lower_tier_counters_and_occupancy_from_a_real_engine(llama_dir, tmp_path):
    from tierlm import LLM
    with LLM(str(llama_dir), dtype="float32", kv_cache_memory=4 << 20, block_size=8, load_progress=False,
             kv_host_capacity="4 blocks", kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks") as llm:
        tel = Telemetry({"m": llm.engine}, log_requests=False)
        s = samples(tel.render().decode())
        assert value(s, "tierlm:kv_tier_blocks", model="m", tier="disk") == 0
        llm.generate([{"prompt_token_ids": list(range(5, 85))}], SamplingParams(max_tokens=2, ignore_eos=True))
        demoted = llm.engine.offload_prefix_cache()
        s = samples(tel.render().decode())
        assert value(s, "tierlm:kv_tier_blocks", model="m", tier="host") == 4
        assert value(s, "tierlm:kv_tier_capacity_blocks", model="m", tier="host") == 4
        assert value(s, "tierlm:kv_tier_blocks", model="m", tier="disk") == demoted - 4
        assert value(s, "tierlm:kv_tier_capacity_blocks", model="m", tier="disk") == 64
        assert value(s, "tierlm:kv_tier_evictions_total", model="m", tier="host") == demoted - 4
        assert value(s, "tierlm:kv_write_backlog_bytes", model="m") == 0  # all written
        req = llm.engine.add_request({"prompt_token_ids": list(range(5, 85))}, SamplingParams(max_tokens=2))
        llm.engine.kv.prefetching = True
        llm.engine.kv.prefetch(req)  # the disk part of its prefix read into host memory
        llm.engine.store.flush()
        staged = llm.engine.store.staged_bytes
        assert staged > 0 and value(samples(tel.render().decode()), "tierlm:kv_staged_bytes", model="m") == staged
        while llm.engine.has_unfinished():
            llm.engine.step()


def test_apps_do_not_share_registries():
    a, b = Telemetry(log_requests=False), Telemetry(log_requests=False)
    a.metrics.generation_tokens.labels("m", "default").inc(5)
    assert value(b.render().decode(), "tierlm:generation_tokens_total") == 0
    assert value(a.render().decode(), "tierlm:generation_tokens_total") == 5


def test_otlp_endpoint_url():
    assert otlp_traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert otlp_traces_url("https://x/custom/path") == "https://x/custom/path"
    with pytest.raises(ValueError, match="otlp-endpoint"):
        otlp_traces_url("collector:4318")
    tel = Telemetry(otlp_endpoint="http://127.0.0.1:9/v1/traces", log_requests=False)
    assert tel.tracer is not None
    tel.shutdown()


def test_otlp_export_reaches_a_collector():
    """--otlp-endpoint really ships spans: a stand-in collector decodes the OTLP/HTTP protobuf."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            received.append((self.path, self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        tel = Telemetry(otlp_endpoint=f"http://127.0.0.1:{httpd.server_port}", log_requests=False)
        rt = tel.start_request("/v1/messages", "req_x", {"traceparent": TRACEPARENT})
        rt.on_engine_request("m2")
        rt.on_delta(StreamDelta("r", "a", [1], finished=True, finish_reason="stop", num_prompt_tokens=3,
                                num_output_tokens=1))
        rt.finish(200)
        tel.shutdown()  # flushes the batch
    finally:
        httpd.shutdown()
    assert [path for path, _ in received] == ["/v1/traces"]
    req = ExportTraceServiceRequest.FromString(received[0][1])
    spans = [sp for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans]
    root = next(sp for sp in spans if sp.name == "chat m2")
    assert root.trace_id.hex() == TRACE_ID
    attrs = {kv.key: kv.value for kv in root.attributes}
    assert attrs["gen_ai.usage.input_tokens"].int_value == 3
    service = {kv.key: kv.value.string_value for rs in req.resource_spans for kv in rs.resource.attributes}
    assert service["service.name"] == "tierlm"


def test_engine_collector_is_a_prometheus_collector():
    assert list(EngineCollector(lambda: []).describe()) == []


def test_grafana_dashboard_only_uses_exported_metrics():
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).parents[2] / "deploy" / "grafana" / "tierlm-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"tierlm:[a-z0-9_]+", e)}
    tel = Telemetry(log_requests=False)
    exported = set()
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    for family in tel.registry.collect():
        exported |= {family.name + s for s in suffixes.get(family.type, [""])}
    from tierlm.serving.telemetry import ENGINE_FIGURES
    exported |= {f.name + ("_total" if f.kind == "counter" else "") for f in ENGINE_FIGURES}
    exported |= {"tierlm:kv_cache_usage_perc", "tierlm:kv_tier_blocks", "tierlm:kv_tier_capacity_blocks"}
    exported |= {f"tierlm:kv_tier_{k}_total" for k in TierStats.__dataclass_fields__}  # one counter per field
    assert used and used <= exported, used - exported
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


# ---- the real server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced_server():
    """build_app over its own demo engine, with telemetry tracing into an in-memory exporter."""
    from tests.serving.harness import API_KEY, ServerThread
    from tierlm.engine.async_engine import AsyncEngine
    from tierlm.serving.app import build_app
    from tierlm.serving.auth import ApiKeyAuth

    engine = AsyncEngine.from_model(None, device="cpu", max_model_len=1024, kv_cache_memory=32 << 20,
                                    max_num_seqs=16, load_progress=False)
    exporter = in_memory_exporter()
    tel = Telemetry(span_exporter=exporter)
    app = build_app({engine.model_name: engine}, ApiKeyAuth.from_keys({"alice": API_KEY}), telemetry=tel)
    server = ServerThread(app).start()
    yield server, engine, exporter
    server.stop()


def _client(server) -> httpx.Client:
    from tests.serving.harness import API_KEY
    return httpx.Client(base_url=server.url, timeout=120,
                        headers={"x-api-key": API_KEY, "authorization": f"Bearer {API_KEY}",
                                 "anthropic-version": "2023-06-01"})


@pytest.mark.slow
def test_known_traffic_gives_exact_counts_and_histograms(traced_server, caplog):
    from tests.serving.harness import parse_sse
    server, engine, exporter = traced_server
    model = engine.model_name
    before = samples(_client(server).get("/metrics").text)
    prompt_tokens = output_tokens = cached = 0
    gaps = 0
    with _client(server) as c, caplog.at_level(logging.INFO, logger="tierlm.requests"):
        # 3 completions; the last repeats the first's 40-token prompt, so 32 tokens (2 blocks) hit the cache.
        prompts = [list(range(100, 140)), list(range(200, 240)), list(range(100, 140))]
        for p in prompts:
            r = c.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": 6, "ignore_eos": True})
            assert r.status_code == 200, r.text
            u = r.json()["usage"]
            prompt_tokens += u["prompt_tokens"]
            output_tokens += u["completion_tokens"]
            cached += u["prompt_tokens_details"]["cached_tokens"]
            gaps += u["completion_tokens"] - 1
        assert cached == 32
        # 2 streamed Anthropic messages.
        for i in range(2):
            r = c.post("/v1/messages", json={"model": model, "max_tokens": 5, "stream": True,
                                             "messages": [{"role": "user", "content": f"hello number {i}"}]})
            assert r.status_code == 200
            frames = parse_sse(r.text)
            start = next(d for e, d in frames if e == "message_start")["message"]["usage"]
            end = next(d for e, d in frames if e == "message_delta")["usage"]
            prompt_tokens += start["input_tokens"] + start["cache_read_input_tokens"]
            cached += start["cache_read_input_tokens"]
            output_tokens += end["output_tokens"]
            gaps += end["output_tokens"] - 1
        # Failures: a prompt that cannot fit (400, before the engine) and an unknown model (404).
        assert c.post("/v1/completions", json={"model": model, "prompt": [5] * 10,
                                               "max_tokens": 5000}).status_code == 400
        assert c.post("/v1/completions", json={"model": model, "prompt": "x",
                                               "temperature": 9}).status_code == 400  # a bad field
        assert c.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
        time.sleep(0.1)  # each request is recorded just after its last byte is sent
        text = c.get("/metrics").text
    after = samples(text)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    lbl = dict(model=model, tenant="default")
    assert delta("tierlm:requests_total", route="/v1/completions", status="200", **lbl) == 3
    assert delta("tierlm:requests_total", route="/v1/messages", status="200", **lbl) == 2
    assert delta("tierlm:requests_total", route="/v1/completions", status="400", model=model) == 2  # served
    assert delta("tierlm:requests_total", route="/v1/completions", status="404", model="unknown") == 1
    assert delta("tierlm:request_success_total", **lbl) == 5
    assert delta("tierlm:prompt_tokens_total", **lbl) == prompt_tokens
    assert delta("tierlm:generation_tokens_total", **lbl) == output_tokens
    assert delta("tierlm:prefix_cache_hit_tokens_total", **lbl) == cached
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens"):
        assert delta(f"tierlm:{name}_count", **lbl) == 5, name
    assert delta("tierlm:inter_token_latency_seconds_count", **lbl) == gaps
    assert delta("tierlm:request_generation_tokens_sum", **lbl) == output_tokens
    # Latency sums are consistent: every request's TTFT fits inside its E2E latency.
    assert 0 < delta("tierlm:time_to_first_token_seconds_sum", **lbl) <= delta("tierlm:e2e_request_latency_seconds_sum", **lbl)
    # Engine-side figures, read at scrape time.
    assert value(after, "tierlm:num_requests_running", model=model) == 0
    assert value(after, "tierlm:num_requests_waiting", model=model) == 0
    assert value(after, "tierlm:kv_blocks_total", model=model) > 0
    assert delta("tierlm:prefix_cache_hits_total", model=model) >= 32
    assert delta("tierlm:prefix_cache_queries_total", model=model) >= delta("tierlm:prefix_cache_hits_total", model=model)
    assert delta("tierlm:engine_generation_tokens_total", model=model) == output_tokens
    assert delta("tierlm:computed_prompt_tokens_total", model=model) == prompt_tokens - cached
    # One JSON log line per request, failures included.
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tierlm.requests"]
    assert sorted(ln["status"] for ln in lines) == [200] * 5 + [400, 400, 404]
    assert sorted(ln["model"] for ln in lines if ln["status"] >= 400) == sorted([model, model, "unknown"])
    assert sum(ln["output_tokens"] for ln in lines) == output_tokens
    assert all(ln["request_id"].startswith("req_") for ln in lines)


@pytest.mark.slow
def test_real_request_trace_tree(traced_server):
    server, engine, exporter = traced_server
    exporter.clear()
    with _client(server) as c:
        r = c.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                   json={"model": engine.model_name, "max_tokens": 4, "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": "trace me"}]})
        assert r.status_code == 200
    usage = [json.loads(line[6:]) for line in r.text.splitlines()
             if line.startswith("data: {") and '"usage":{' in line][-1]["usage"]
    deadline = time.monotonic() + 5
    while len(exporter.get_finished_spans()) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)  # the request span ends just after the last byte is sent
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.parent is not None and s.parent.is_remote]
    assert root.name == f"chat {engine.model_name}"
    assert format(root.context.trace_id, "032x") == TRACE_ID
    children = sorted((s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id),
                      key=lambda s: s.start_time)
    assert [s.name for s in children] == ["queue", "prefill", "decode"]
    assert root.start_time <= children[0].start_time and children[-1].end_time <= root.end_time
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == engine.model_name
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 4
    assert a["gen_ai.request.max_tokens"] == 4
    # The id the client got, to join traces with client logs; the server's own id beside it.
    chunk_ids = {json.loads(line[6:])["id"] for line in r.text.splitlines() if line.startswith("data: {")}
    assert len(chunk_ids) == 1 and a["gen_ai.response.id"] == chunk_ids.pop().strip()
    assert a["gen_ai.response.id"].startswith("chatcmpl-") and a["tierlm.request_id"] == r.headers["request-id"]


@pytest.mark.slow
@pytest.mark.parametrize("path, body", [("/v1/score", {"text_1": "query", "text_2": ["doc one", "doc two"]}),
                                        ("/v1/rerank", {"query": "query", "documents": ["doc one", "doc two"]})])
def test_score_and_rerank_spans_carry_the_id_their_client_got(traced_server, path, body):
    server, engine, exporter = traced_server
    exporter.clear()
    with _client(server) as c:
        r = c.post(path, json={"model": engine.model_name, **body})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 5
    while not any(s.parent is None for s in exporter.get_finished_spans()) and time.monotonic() < deadline:
        time.sleep(0.02)  # the request span ends just after the last byte is sent
    (root,) = [s for s in exporter.get_finished_spans() if s.parent is None]
    assert root.attributes["gen_ai.response.id"] == r.json()["id"]
    assert root.attributes["tierlm.request_id"] == r.headers["request-id"]


def test_a_tenants_host_tier_partition_shows_in_metrics(llama_dir):
    """A partitioned tenant's prefix offloaded from the device lands in its host-tier partition:
    `tierlm:kv_host_partition_blocks` counts it, beside the partition's capacity."""
    from tierlm import LLM
    with LLM(str(llama_dir), dtype="float32", kv_cache_memory=4 << 20, block_size=8, load_progress=False,
             kv_host_capacity="40 blocks") as llm:
        tel = Telemetry({"m": llm.engine}, log_requests=False)
        req = llm.engine.add_request({"prompt_token_ids": list(range(5, 85))}, SamplingParams(max_tokens=2),
                                     tenant_id="gold", kv_cache_share=0.25)
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert req.is_finished
        demoted = llm.engine.offload_prefix_cache()
        s = samples(tel.render().decode())
        assert demoted == 10
        assert value(s, "tierlm:kv_host_partition_blocks", model="m", tenant="gold") == 10
        assert value(s, "tierlm:kv_host_partition_capacity_blocks", model="m", tenant="gold") == 10
