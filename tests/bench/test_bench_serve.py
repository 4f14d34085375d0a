"""`tierlm bench serve` / `sweep`: statistics on synthetic timings, workloads, SSE parsing, and
a small run against the real server whose numbers must agree with the server's /metrics."""
from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from tierlm.bench.serve import (
    SLO,
    BenchRequest,
    RequestResult,
    Target,
    TraceScaling,
    arrival_times,
    latency_stats,
    random_requests,
    run_benchmark,
    send_request,
    summarize,
    timeline,
    trace_requests,
)

TRACE = Path("/work/shared/traces/conversation_trace.jsonl")


def _result(start, ttft, e2el, out, itl=None, ok=True, inp=10):
    return RequestResult(ok=ok, start=start, prompt_len=inp, output_len=out, input_tokens=inp, output_tokens=out,
                         ttft=ttft, e2el=e2el, itl=itl or [], chunk_times=[start + ttft] if ok else [])


# ---- statistics --------------------------------------------------------------------------


def test_latency_stats_match_numpy_in_ms():
    xs = [0.1, 0.2, 0.3, 0.4, 1.0]
    s = latency_stats(xs)
    assert s["mean"] == pytest.approx(400.0)
    assert s["p50"] == pytest.approx(300.0)
    assert s["p90"] == pytest.approx(np.percentile(np.array(xs) * 1000, 90))
    assert s["p99"] == pytest.approx(976.0)
    assert s["min"] == pytest.approx(100.0) and s["max"] == pytest.approx(1000.0)
    assert latency_stats([]) == {k: None for k in ("mean", "std", "min", "max", "p50", "p90", "p99")}


def test_summary_throughput_tpot_and_goodput():
    results = [
        _result(0.0, 0.1, 1.1, 11, itl=[0.1] * 10),  # TPOT = 1.0 / 10 = 100 ms
        _result(0.5, 0.3, 0.8, 6, itl=[0.1] * 5),  # TPOT = 0.5 / 5 = 100 ms, TTFT 300 ms
        _result(1.0, 0.1, 0.3, 3, itl=[0.1, 0.1]),  # TPOT = 0.2 / 2 = 100 ms
        RequestResult(ok=False, start=1.5, prompt_len=10, output_len=5, error="HTTP 500"),
    ]
    s = summarize(results, duration=2.0, slo=SLO(ttft_ms=200, tpot_ms=150))
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_token_throughput"] == pytest.approx(10.0)
    assert s["total_token_throughput"] == pytest.approx(25.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["mean"] == pytest.approx(100.0)
    assert s["e2el_ms"]["mean"] == pytest.approx((1100 + 800 + 300) / 3)
    assert s["good_requests"] == 2  # the 300 ms TTFT misses, the failure never counts
    assert s["goodput"] == pytest.approx(1.0)
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert s["errors"] == {"HTTP 500": 1}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert {"mean", "p50", "p90", "p99"} <= set(s[key])
    assert "goodput" not in summarize(results, 2.0)


def test_slo_parse_and_single_token_answers():
    slo = SLO.parse("ttft_ms=500, tpot_ms=50")
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms) == (500.0, 50.0, None)
    with pytest.raises(ValueError, match="ttft_ms"):
        SLO.parse("latency=5")
    for bad in ("ttft_ms=abc", "ttft_ms=-4", "tpot_ms=0", "e2el_ms=nan"):
        with pytest.raises(ValueError, match="positive milliseconds"):
            SLO.parse(bad)
    one = _result(0, 0.1, 0.1, 1)
    assert one.tpot is None and slo.met(one)  # no TPOT to miss


@pytest.mark.parametrize("flags, says", [(["--num-prompts", "0"], "--num-prompts must be at least 1"),
                                         (["--request-rate", "-1"], "must be positive"),
                                         (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
                                         (["--slo", "ttft_ms=fast"], "positive milliseconds"),
                                         (["--trace", "/no/such/trace.jsonl"], "No such file")])
def test_bad_arguments_fail_before_connecting(flags, says, tmp_path, capsys):
    """Port 1 has no server: had bench serve connected first, the error would be about that."""
    import argparse
    from tierlm.bench.serve import _main, add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://127.0.0.1:1", "--json", str(tmp_path / "o.json"), *flags])
    assert _main(args) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "o.json").exists()


def test_arrivals_poisson_gamma_and_burst():
    assert arrival_times(5, math.inf) == [0.0] * 5
    t = arrival_times(4000, request_rate=4.0, burstiness=1.0, seed=1)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.08)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = np.diff(arrival_times(4000, request_rate=4.0, burstiness=0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.25, rel=0.15)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)  # gamma: CV = 1/sqrt(shape)
    assert arrival_times(10, 2.0, seed=3) == arrival_times(10, 2.0, seed=3)


@pytest.mark.parametrize("duration", [4.0, 4.3])  # 4.3: a last interval of 0.3 s
def test_timeline_conserves_tokens(duration):
    results = [_result(i * 0.5, 0.2, 1.0, 8) for i in range(6)]
    tl = timeline(results, duration=duration, bins=8, min_width=1.0)  # intervals of 1 s
    widths = [1.0] * (len(tl["t_s"]) - 1) + [duration - (len(tl["t_s"]) - 1)]
    assert sum(x * w for x, w in zip(tl["output_tok_per_s"], widths)) == pytest.approx(48)
    assert sum(x * w for x, w in zip(tl["requests_per_s"], widths)) == pytest.approx(6)
    assert tl["t_s"][-1] == pytest.approx(duration - widths[-1] / 2)  # the middle of the short last interval


def test_timeout_bounds_the_whole_request_not_each_read():
    """A server that keeps streaming slowly is cut off at --timeout (httpx's own timeout applies
    to each read, so it would never fire here)."""
    import socket
    import threading
    import time

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def slow(request):
        async def events():
            for _ in range(30):
                await asyncio.sleep(0.1)
                yield b'data: {"choices": [{"text": "x"}]}\n\n'
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", slow, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        target = Target(f"http://127.0.0.1:{sock.getsockname()[1]}", "openai", "m", timeout=0.5)
        reqs = random_requests(3, 10, 5, seed=1)
        results, _ = asyncio.run(run_benchmark(target, reqs, progress=False))
    finally:
        server.should_exit = True
        thread.join(10)
    assert [r.ok for r in results] == [False] * 3
    assert all(r.error == "timed out after 0.5 s (--timeout)" and r.e2el < 2.5 for r in results)


# ---- workloads ---------------------------------------------------------------------------


def test_random_prompts_lengths_and_formats():
    reqs = random_requests(50, 100, 20, range_ratio=0.5, seed=2)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(100 <= t < 600 for r in reqs for t in r.prompt)
    assert reqs[0].prompt[:10] != reqs[1].prompt[:10]  # unrelated prompts
    text = random_requests(3, 40, 5, prompt_format="text")
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 40 for r in text)
    assert random_requests(3, 40, 5, seed=9)[2].prompt == random_requests(3, 40, 5, seed=9)[2].prompt


def _write_trace(path: Path) -> Path:
    rows = [
        {"timestamp": 1000, "input_length": 1500, "output_length": 100, "hash_ids": [1, 2, 3]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 40, "hash_ids": [1, 2, 9]},
        {"timestamp": 4000, "input_length": 300, "output_length": 5, "hash_ids": [7]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("fmt", ["ids", "text"])
def test_trace_replay_equal_hash_ids_give_equal_blocks(tmp_path, fmt):
    trace = _write_trace(tmp_path / "t.jsonl")
    reqs = trace_requests(trace, 10, TraceScaling(block_tokens=16, time_scale=0.5, output_scale=0.1),
                          prompt_format=fmt)
    assert [r.arrival for r in reqs] == [0.0, 1.0, 1.5]
    assert [r.prompt_len for r in reqs] == [47, 35, 10]  # ceil(len * 16 / 512)
    assert [r.output_len for r in reqs] == [10, 4, 1]
    toks = [r.prompt if fmt == "ids" else r.prompt.split() for r in reqs]
    assert [len(t) for t in toks] == [47, 35, 10]
    assert toks[0][:32] == toks[1][:32]  # hash ids 1, 2 shared
    assert toks[0][32:35] != toks[1][32:35]  # 3 vs 9
    capped = trace_requests(trace, 2, TraceScaling(block_tokens=16, max_input=20, max_output=3))
    assert [r.prompt_len for r in capped] == [20, 20] and [r.output_len for r in capped] == [3, 3]


@pytest.mark.skipif(not TRACE.exists(), reason="shared traces not available")
def test_real_trace_prefix_reuse_is_preserved():
    reqs = trace_requests(TRACE, 200, TraceScaling(block_tokens=8), start=0)
    rows = [json.loads(line) for _, line in zip(range(200), TRACE.open())]
    for i in range(1, 200):
        a, b = rows[0]["hash_ids"], rows[i]["hash_ids"]
        shared = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        n = min(shared * 8, reqs[0].prompt_len, reqs[i].prompt_len)
        assert reqs[0].prompt[:n] == reqs[i].prompt[:n]


# ---- the client, against scripted SSE streams ------------------------------------------------


def _sse_transport(frames: list[bytes], status: int = 200):
    def handler(request: httpx.Request) -> httpx.Response:
        handler.body = json.loads(request.content)
        handler.headers = request.headers
        return httpx.Response(status, content=b"".join(frames), headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handler), handler


async def test_openai_stream_parsing_uses_server_usage():
    def data(d):
        return f"data: {json.dumps(d)}\n\n".encode()
    frames = [data({"choices": [{"index": 0, "text": t}]}) for t in ("a", "", "b")]
    # A token that decodes to no text still arrives as a chunk when logprobs were asked for.
    frames += [data({"choices": [{"index": 0, "text": "", "logprobs": {"tokens": [""], "token_logprobs": [-1.0]}}]})]
    frames += [data({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
               data({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5,
                                              "prompt_tokens_details": {"cached_tokens": 4}}}),
               b"data: [DONE]\n\n"]
    transport, handler = _sse_transport(frames)
    target = Target("http://x", "openai", "m", api_key="k", logprobs=0)
    async with httpx.AsyncClient(transport=transport) as client:
        r = await send_request(client, target, BenchRequest([5, 6, 7], 3, 5), 0.0)
    assert r.ok and r.output_tokens == 5 and r.input_tokens == 12 and r.cached_tokens == 4
    assert len(r.itl) == 2 and r.ttft is not None and r.e2el >= r.ttft
    assert handler.body["prompt"] == [5, 6, 7] and handler.body["max_tokens"] == 5
    assert handler.body["stream"] is True and handler.body["ignore_eos"] is True
    assert handler.body["stream_options"] == {"include_usage": True} and handler.body["logprobs"] == 0
    assert handler.headers["authorization"] == "Bearer k"


async def test_anthropic_stream_parsing_and_errors():
    def ev(name, d):
        return f"event: {name}\ndata: {json.dumps({'type': name, **d})}\n\n".encode()
    frames = [ev("message_start", {"message": {"usage": {"input_tokens": 8, "cache_read_input_tokens": 2,
                                                         "output_tokens": 0}}}),
              ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
              ev("ping", {}),
              ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
              ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": " there"}}),
              ev("content_block_stop", {"index": 0}),
              ev("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 3}}),
              ev("message_stop", {})]
    transport, handler = _sse_transport(frames)
    target = Target("http://x", "anthropic", "m", api_key="k")
    async with httpx.AsyncClient(transport=transport) as client:
        r = await send_request(client, target, BenchRequest("hello world", 2, 3), 0.0)
        assert r.ok and r.input_tokens == 10 and r.cached_tokens == 2 and r.output_tokens == 3
        assert len(r.itl) == 1
        assert handler.headers["x-api-key"] == "k" and handler.body["messages"][0]["content"] == "hello world"
        with pytest.raises(ValueError, match="text prompts"):
            target.body(BenchRequest([1, 2], 2, 3))
    err_frames = frames[:4] + [ev("error", {"error": {"type": "overloaded_error", "message": "busy"}})]
    transport, _ = _sse_transport(err_frames)
    async with httpx.AsyncClient(transport=transport) as client:
        r = await send_request(client, target, BenchRequest("x", 1, 3), 0.0)
    assert not r.ok and "busy" in r.error
    transport, _ = _sse_transport([b'{"error": "nope"}'], status=429)
    async with httpx.AsyncClient(transport=transport) as client:
        r = await send_request(client, target, BenchRequest("x", 1, 3), 0.0)
    assert not r.ok and r.error.startswith("HTTP 429")


# ---- against the real server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def live_server():
    from tests.serving.harness import ServerThread
    from tierlm.engine.async_engine import AsyncEngine
    from tierlm.serving.app import build_app
    from tierlm.serving.auth import NoAuth
    from tierlm.serving.telemetry import Telemetry

    engine = AsyncEngine.from_model(None, device="cpu", max_model_len=1024, kv_cache_memory=32 << 20,
                                    max_num_seqs=16, load_progress=False)
    app = build_app({engine.model_name: engine}, NoAuth(), telemetry=Telemetry(log_requests=False))
    server = ServerThread(app).start()
    yield server
    server.stop()


def _metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            key = s.name + ("{route=" + s.labels["route"] + ",status=" + s.labels["status"] + "}"
                            if "route" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def _bench_args(url: str, out: Path, **kw):
    import argparse
    from tierlm.bench.serve import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--base-url", url, "--json", str(out), "--no-progress"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_bench_serve_agrees_with_server_metrics(live_server, tmp_path, api):
    from tierlm.bench.serve import bench
    url = live_server.url
    route = "/v1/completions" if api == "openai" else "/v1/messages"
    before = _metrics(url)
    out = await bench(_bench_args(url, tmp_path / "run.json", api=api, num_prompts=6, input_len=24,
                                  output_len=6, request_rate=50, max_concurrency=3, slo="ttft_ms=60000,tpot_ms=60000"))
    await asyncio.sleep(0.1)
    after = _metrics(url)

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert out["completed"] == 6 and out["failed"] == 0
    assert delta(f"tierlm:requests_total{{route={route},status=200}}") == out["completed"]
    assert delta("tierlm:prompt_tokens_total") == out["total_input_tokens"]
    assert delta("tierlm:generation_tokens_total") == out["total_output_tokens"]
    assert delta("tierlm:prefix_cache_hit_tokens_total") == out["total_cached_tokens"]
    assert delta("tierlm:time_to_first_token_seconds_count") == out["completed"]
    if api == "openai":  # token-id prompts and ignore_eos: exact lengths
        assert out["total_input_tokens"] == 6 * 24 and out["total_output_tokens"] == 6 * 6
    # The client sees the first token after the server sends it (same machine, so only just).
    server_ttft_ms = delta("tierlm:time_to_first_token_seconds_sum") / out["completed"] * 1000
    assert server_ttft_ms <= out["ttft_ms"]["mean"] + 5
    assert out["goodput"] == pytest.approx(out["request_throughput"])
    saved = json.loads((tmp_path / "run.json").read_text())
    assert {"completed", "failed", "request_throughput", "output_token_throughput", "goodput",
            "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"} <= set(saved)
    assert len(saved["requests"]) == 6
    assert all(Path(p).is_file() for p in saved["plots"])


@pytest.mark.slow
def test_bench_sweep_cli_writes_table_and_plot(live_server, tmp_path):
    from tierlm.cli import main
    out = tmp_path / "sweep.json"
    rc = main(["bench", "sweep", "--server", f"demo={live_server.url}", "--request-rates", "20,inf",
               "--num-prompts", "3", "--input-len", "16", "--output-len", "3", "--slo", "ttft_ms=60000",
               "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    runs = data["servers"]["demo"]
    assert [r["request_rate"] for r in runs] == [20, "inf"]
    assert all(r["completed"] == 3 and r["goodput"] > 0 for r in runs)
    assert out.with_suffix(".png").is_file() and out.with_name("sweep_demo.json").is_file()
    assert "| demo | 20 |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("bench", ["serve", "sweep"])
def test_the_json_path_is_checked_before_any_load_is_sent(bench, tmp_path, capsys):
    # a directory or unwritable --json failed only after the whole load run
    from tierlm.cli import main

    argv = ["bench", bench, "--base-url", "http://127.0.0.1:9", "--num-prompts", "2", "--json", str(tmp_path)]
    if bench == "sweep":
        argv += ["--request-rates", "1", "--slo", "ttft_ms=1000"]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and f"--json {tmp_path} is a directory" in err and "Traceback" not in err, err


@pytest.mark.parametrize("bench", ["serve", "sweep"])
@pytest.mark.parametrize("flags, says", [
    (["--trace", str(TRACE), "--trace-start", "-3"], "argument --trace-start: must be at least 0, got -3"),
    (["--trace", str(TRACE), "--trace-time-scale", "0"], "argument --trace-time-scale: must be more than 0, got 0"),
    (["--trace", str(TRACE), "--trace-output-scale", "-1"], "argument --trace-output-scale: must be more than 0, got -1"),
    (["--trace", str(TRACE), "--trace-max-input", "0"], "argument --trace-max-input: must be at least 1, got 0"),
    (["--trace", str(TRACE), "--trace-max-output", "-4"], "argument --trace-max-output: must be at least 1, got -4"),
    (["--trace", str(TRACE), "--trace-block-tokens", "0"], "argument --trace-block-tokens: must be at least 1, got 0"),
    (["--range-ratio", "1"], "argument --range-ratio: must be in [0, 1), got 1"),
    (["--range-ratio", "nan"], "argument --range-ratio: must be in [0, 1), got nan"),
    (["--output-len", "0"], "argument --output-len: must be at least 1, got 0"),
    (["--num-warmups", "-1"], "argument --num-warmups: must be at least 0, got -1"),
    (["--timeout", "0"], "argument --timeout: must be more than 0, got 0"),
    (["--temperature", "-1"], "argument --temperature: must be at least 0, got -1"),
    (["--logprobs", "-1"], "argument --logprobs: must be in [0, 20], got -1"),
    (["--logprobs", "21"], "argument --logprobs: must be in [0, 20], got 21"),
])
def test_out_of_range_options_are_refused_by_the_parser(bench, flags, says, tmp_path, capsys):
    """They were taken, and the run then sent requests built from them (a negative trace start
    read from the first line, a zero timeout failed every request)."""
    from tierlm.cli import main

    argv = ["bench", bench, "--base-url", "http://127.0.0.1:1", "--json", str(tmp_path / "o.json"), *flags]
    with pytest.raises(SystemExit) as e:
        main(argv + (["--slo", "ttft_ms=1000"] if bench == "sweep" else []))
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {says}" in err and err.count("error:") == 1


@pytest.mark.parametrize("bench", ["serve", "sweep"])
@pytest.mark.parametrize("flags, says", [
    (["--api", "anthropic", "--prompt-format", "ids"],
     "--prompt-format ids is for the OpenAI completions route only, not --api anthropic"),
    (["--endpoint", "/v1/chat/completions", "--prompt-format", "ids"],
     "--prompt-format ids is for the OpenAI completions route only, not --endpoint /v1/chat/completions"),
    (["--api", "anthropic", "--logprobs", "1"], "--logprobs applies to the OpenAI API only"),
    (["--trace", "no-such-trace.jsonl"], "cannot read --trace no-such-trace.jsonl: No such file or directory; "
                                         "give a Mooncake JSONL trace file"),
])
def test_conflicting_options_are_refused_before_any_request(bench, flags, says, tmp_path, capsys):
    """Port 1 has no server: had bench connected first, the error would be about that. Anthropic
    with token-id prompts used to send the whole run and fail every request on it."""
    from tierlm.cli import main

    argv = ["bench", bench, "--base-url", "http://127.0.0.1:1", "--model", "m", "--json", str(tmp_path / "o.json"),
            *flags] + (["--slo", "ttft_ms=1000"] if bench == "sweep" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {says}" in err and err.count("error:") == 1 and "Connect" not in err


def test_an_unreachable_server_is_named_with_what_to_do(tmp_path, capsys):
    """It printed httpx's bare `error: All connection attempts failed`."""
    from tierlm.cli import main

    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "1", "--input-len", "4",
                 "--json", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert "error: cannot reach the server at http://127.0.0.1:1 (ConnectError: " in err
    assert "check the URL and that the server is running" in err


@pytest.mark.parametrize("bench", ["serve", "sweep"])
def test_a_refused_model_lookup_is_one_line_with_what_to_do(bench, live_server, tmp_path, capsys, monkeypatch):
    """Without --model, GET /v1/models is asked first; a 401 or 404 there printed httpx's two-line
    status error (with a link to MDN) and said nothing of what to change."""
    from tests.serving.harness import ServerThread
    from tierlm.cli import main
    from tierlm.serving.app import build_app
    from tierlm.serving.auth import ApiKeyAuth
    from tierlm.serving.telemetry import Telemetry

    for name in ("TIERLM_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    engines = dict(live_server.app.state.tierlm.models.items())
    keyed = ServerThread(build_app(engines, ApiKeyAuth.from_keys({"alice": "sk-key"}), manage_engines=False,
                                   telemetry=Telemetry(log_requests=False))).start()
    try:
        for base_url, says in (
            (keyed.url, f"error: GET {keyed.url}/v1/models answered 401 Unauthorized"),
            (live_server.url + "/v1", f"error: GET {live_server.url}/v1/v1/models answered 404 Not Found"),
        ):
            argv = ["bench", bench, "--base-url", base_url, "--num-prompts", "1", "--json", str(tmp_path / "o.json")]
            rc = main(argv + (["--slo", "ttft_ms=1000", "--request-rates", "1"] if bench == "sweep" else []))
            err = capsys.readouterr().err
            line = [l for l in err.splitlines() if l.startswith("error:")]
            assert rc == 2 and len(line) == 1 and line[0].startswith(says), err
            advice = "pass --api-key" if "answered 401" in says else "check --base-url (the server's root, without /v1)"
            assert advice in err  # ("answered 401": the port number may hold "401", as 40195 did)
            assert "developer.mozilla" not in err
    finally:
        keyed.stop()


@pytest.mark.parametrize("bench", ["serve", "sweep"])
def test_when_every_request_fails_the_first_error_is_on_the_console(bench, tmp_path, capsys):
    """With --model given nothing is asked before the run; its failures were only in the JSON."""
    from tierlm.cli import main

    argv = ["bench", bench, "--base-url", "http://127.0.0.1:1", "--model", "m", "--num-prompts", "2",
            "--input-len", "4", "--num-warmups", "0", "--json", str(tmp_path / "o.json")]
    rc = main(argv + (["--slo", "ttft_ms=1000", "--request-rates", "inf"] if bench == "sweep" else ["--no-plot"]))
    err = capsys.readouterr().err
    assert rc == 1  # the sweep exited 0 before
    assert ("error: all 2 requests to http://127.0.0.1:1/v1/completions failed; the first: ConnectError: "
            in err), err
