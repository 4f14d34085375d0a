"""tierlm's CPU kernels against PyTorch references: the bf16-weight GEMM, the paged decode
attention (float32, bf16 and fp8 caches, GQA, sliding windows, odd block sizes; shapes off its vector
path declined), the engine with and without them, and a build that fails."""
from __future__ import annotations

import logging
import random

import pytest
import torch

from tierlm import LLM, SamplingParams
from tierlm.models import cpu_kernels
from tierlm.models.attention import AttentionMetadata, DecodeGroup, PrefillSeq, paged_attention
from tierlm.models.cpu_linear import Bf16DecodeLinear, add_bf16_decode_path
from tierlm.models.kv_dtype import to_storage

needs_avx512 = pytest.mark.skipif(not cpu_kernels.has_avx512(), reason="the kernels need AVX-512")


@needs_avx512
@pytest.mark.parametrize("m", [1, 3, 14, 15, 29, 40, 64])
@pytest.mark.parametrize("k,n,bias", [(64, 33, False), (300, 77, True), (896, 1152, False)])
def test_bf16_weight_gemm_matches_float64(m, k, n, bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    y = cpu_kernels.gemm_bf16w(x, cpu_kernels.pack_bf16(w), n, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    # Same weights, float32 arithmetic: within the rounding bound of a k-term float32 sum.
    bound = (k + 2) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0))
    assert y.shape == (m, n)
    assert ((y.double() - ref).abs() <= bound).all()


@needs_avx512
def test_bf16_decode_linear_routes_by_batch_size(monkeypatch):
    lin = torch.nn.Linear(96, 50, bias=True)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
    wrapped = Bf16DecodeLinear(lin, max_rows=8)
    calls = []
    real = cpu_kernels.gemm_bf16w
    monkeypatch.setattr(cpu_kernels, "gemm_bf16w", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        for rows in (1, 8, 9, 40):
            x = torch.randn(rows, 96)
            assert torch.allclose(wrapped(x), lin(x), atol=1e-5)
        x3 = torch.randn(2, 3, 96)  # leading dims are flattened and restored
        assert torch.allclose(wrapped(x3), lin(x3), atol=1e-5)
    assert calls == [1, 8, 6]


@needs_avx512
def test_only_bf16_exact_float32_weights_are_wrapped():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    with torch.no_grad():
        model[0].weight.copy_(model[0].weight.to(torch.bfloat16).float())
        model[1].weight.add_(1e-4)  # no longer bf16-representable
    assert add_bf16_decode_path(model) == 1
    assert isinstance(model[0], Bf16DecodeLinear) and isinstance(model[1], torch.nn.Linear)


def _reference_decode(q, cache, tables, lens, scale, window, sinks=None):
    """float64 attention of each query row over its first lens[i] keys; `sinks` ([hq]): a logit
    per head in the softmax, dropped after it, as gpt-oss's reference computes it."""
    cache = cache.float()  # fp8 has no indexing kernels
    hkv, d = cache.shape[3], cache.shape[4]
    g = q.shape[1] // hkv
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        L = int(lens[i])
        k = cache[0][tables[i]].reshape(-1, hkv, d)[:L].float().repeat_interleave(g, 1)
        v = cache[1][tables[i]].reshape(-1, hkv, d)[:L].float().repeat_interleave(g, 1)
        s = torch.einsum("hd,lhd->hl", q[i].double(), k.double()) * scale
        if window is not None:
            s[:, : max(0, L - window)] = float("-inf")
        if sinks is not None:
            p = torch.softmax(torch.cat((s, sinks.double()[:, None]), -1), -1)[:, :-1]
        else:
            p = torch.softmax(s, -1)
        out[i] = torch.einsum("hl,lhd->hd", p, v.double()).float()
    return out


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("hq,hkv,d,bs,window", [(14, 2, 64, 16, None), (8, 8, 128, 16, 37), (6, 2, 16, 5, None),
                                              (32, 2, 256, 7, 10), (4, 4, 32, 16, 1)])
def test_decode_attention_matches_reference(dtype, hq, hkv, d, bs, window):
    g = torch.Generator().manual_seed(hq * 100 + d + bs)
    num_blocks, max_blocks = 64, 40
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(dtype)
    lens = torch.tensor([1, 2, bs, bs + 1, 57, 130, max_blocks * bs])
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), hq, d, generator=g)
    out = cpu_kernels.decode_attention(q, cache, tables, lens, d ** -0.5, window)
    ref = _reference_decode(q, cache, tables, lens, d ** -0.5, window)
    assert (out - ref).abs().max().item() < 2e-5


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("hq,hkv,d,bs,window", [(14, 2, 64, 16, None), (8, 8, 128, 16, 37), (6, 2, 16, 5, None),
                                              (4, 4, 32, 16, 1)])
def test_decode_attention_with_sinks_matches_reference(dtype, hq, hkv, d, bs, window):
    """gpt-oss's sinks in the kernel: each head's logit joins its softmax's max and sum and adds
    no value; sinks far above every score (the output shrinks towards 0), far below (plain
    attention) and among them, over 1 key up to 640."""
    g = torch.Generator().manual_seed(hq * 100 + d + bs + 1)
    num_blocks, max_blocks = 64, 40
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(dtype)
    lens = torch.tensor([1, 2, bs, bs + 1, 57, 130, max_blocks * bs])
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), hq, d, generator=g)
    sinks = torch.randn(hq, generator=g) * 2
    sinks[0], sinks[-1] = 30.0, -30.0
    out = cpu_kernels.decode_attention(q, cache, tables, lens, d ** -0.5, window, sinks=sinks)
    ref = _reference_decode(q, cache, tables, lens, d ** -0.5, window, sinks)
    assert (out - ref).abs().max().item() < 2e-5
    plain = _reference_decode(q, cache, tables, lens, d ** -0.5, window)
    assert (ref - plain).abs().max().item() > 0.1  # the sinks change the answer


@needs_avx512
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_decode_attention_takes_bf16_queries_and_answers_in_bf16(cache_dtype):
    """A CPU computing in bf16: queries widened, attention in float32, the answer rounded once."""
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 40, 16, 2, 64, generator=g).to(cache_dtype)
    lens = torch.tensor([1, 17, 300, 64])
    tables = torch.stack([torch.randperm(40, generator=g)[:20] for _ in lens])
    q = torch.randn(len(lens), 14, 64, generator=g).to(torch.bfloat16)
    assert cpu_kernels.decode_attention_supported(q, cache)
    out = cpu_kernels.decode_attention(q, cache, tables, lens, 0.125, None)
    ref = _reference_decode(q.float(), cache, tables, lens, 0.125, None)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5).all()  # float32 math, one bf16 rounding


@needs_avx512
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_bf16_compute_engine_with_kernels_equals_pytorch_path(kv_cache_dtype, checkpoints):
    """bf16 arithmetic throughout (compute_dtype bfloat16): the first decode of a concurrent
    batch through the kernel gives PyTorch's gather-and-SDPA logits within bf16 rounding (later
    tokens may part ways at near-ties: each path rounds its own way), and prefill logits equal."""
    rng = random.Random(3)
    prompts = [[rng.randrange(200) for _ in range(L)] for L in (3, 17, 31, 1, 48, 9, 64, 25)]
    kw = dict(dtype="bfloat16", compute_dtype="bfloat16", kv_cache_memory=4 << 20, load_progress=False,
              device="cpu", kv_cache_dtype=kv_cache_dtype)
    rows, real = {}, cpu_kernels.decode_attention
    for kernels in (True, False):
        llm = LLM(str(checkpoints["llama"]), cpu_kernels=kernels, **kw)
        calls, captured, sampler = [], [], llm.engine.sampler
        llm.engine.sampler = lambda logits, reqs, s=sampler, c=captured: c.append(logits.clone()) or s(logits, reqs)
        try:
            cpu_kernels.decode_attention = lambda *a, **k: calls.append(1) or real(*a, **k)
            _greedy(llm, prompts, 2)  # the prefill step, then one decode step of all 8
        finally:
            cpu_kernels.decode_attention = real
        assert bool(calls) == kernels and len(captured) == 2
        rows[kernels] = captured
    assert torch.equal(rows[True][0], rows[False][0])
    assert (rows[True][1] - rows[False][1]).abs().max().item() < 0.1  # ~2.5 bf16 ulps measured


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_decode_attention_reads_every_fp8_code_exactly(dtype):
    """With one key, attention returns that key's value row: every finite fp8 code (subnormals,
    both signs, the largest) comes back as torch's own conversion gives it, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[torch.isfinite(codes.view(dtype).float())]  # e4m3: 254 codes; e5m2: 248
    d = 256
    cache = torch.zeros(2, 4, 16, 1, d, dtype=torch.uint8)
    cache[1, 2, 0, 0, : len(codes)] = codes
    cache = cache.view(dtype)
    q = torch.randn(3, 2, d)
    out = cpu_kernels.decode_attention(q, cache, torch.tensor([[2], [2], [2]]), torch.tensor([1, 1, 1]), 0.1, None)
    expect = cache[1, 2, 0, 0].float()
    assert out is not None and torch.equal(out, expect.expand(3, 2, d))


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 4099])
@pytest.mark.parametrize("to", [torch.float32, torch.bfloat16])
def test_fp8_widen_is_exact_for_every_code_and_length(dtype, n, to):
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[torch.isfinite(codes.view(dtype).float())]
    x = codes[torch.randint(len(codes), (2, n), generator=torch.Generator().manual_seed(n))].view(dtype)
    out = cpu_kernels.fp8_widen(x[:, 1:], to)  # a strided view: read as its values, not its storage
    assert out is not None and out.dtype == to and out.shape == (2, n - 1)
    assert torch.equal(out.float(), x[:, 1:].float())
    assert cpu_kernels.fp8_widen(torch.zeros(3), to) is None  # not fp8: the caller converts
    assert cpu_kernels.fp8_widen(x, torch.float16) is None


@needs_avx512
@pytest.mark.parametrize("bad", ["nan_key", "inf_key", "nan_query", "nan_sink", "inf_sink"])
def test_decode_attention_propagates_nan_as_pytorch_does(bad):
    """The exp's clamp took a NaN score (or inf - inf) for -87, a weight of ~1e-38: a NaN key or
    query gave a finite answer (a plain average of V for a NaN query) where PyTorch's softmax,
    and HF, give NaN, hiding an overflow instead of showing it. Likewise a NaN or +inf sink
    (gpt-oss) gave its head an all-zero output (the NaN sum's reciprocal taken as 0), where
    the SDPA paths and HF give NaN."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 4, 8, 1, 16, generator=g)
    q = torch.randn(2, 2, 16, generator=g)
    tables, lens = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]), torch.tensor([20, 20])
    sinks = torch.tensor([0.5, -1.0]) if bad.endswith("sink") else None
    if bad == "nan_query":
        q[0] = float("nan")  # row 1 stays finite
    elif bad.endswith("sink"):  # head 0 of both rows; head 1 stays finite
        sinks[0] = float("nan") if bad == "nan_sink" else float("inf")
    else:  # read by both rows; an inf key scores +inf for a query whose 6th value is positive
        cache[0, 0, 3, 0, 5] = float("nan") if bad == "nan_key" else float("inf")
        q[:, :, 5] = 1.0
    out = cpu_kernels.decode_attention(q, cache, tables, lens, 0.25, None, sinks=sinks)
    ref = _reference_decode(q, cache, tables, lens, 0.25, None, sinks)
    assert ref.isnan().any() and torch.equal(out.isnan(), ref.isnan()), (out, ref)
    finite = ~ref.isnan()
    if finite.any():
        assert (out[finite] - ref[finite]).abs().max().item() < 2e-5


@needs_avx512
def test_kernel_wrappers_take_any_integer_tables_and_any_bias_layout():
    """The kernels read int64 tables and lens and n contiguous float32 biases: int32 tables
    crashed the process, and a strided or float64 bias gave a wrong product, silently."""
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 8, 4, 2, 32, generator=g)
    q = torch.randn(2, 4, 32, generator=g)
    tables, lens = torch.tensor([[3, 1, 0], [2, 5, 7]]), torch.tensor([9, 12])
    ref = _reference_decode(q, cache, tables, lens, 0.2, None)
    out = cpu_kernels.decode_attention(q, cache, tables.to(torch.int32), lens.to(torch.int32), 0.2, None)
    assert (out - ref).abs().max().item() < 2e-5
    x, w = torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g).bfloat16().float()
    packed = cpu_kernels.pack_bf16(w.bfloat16())
    for bias in (torch.randn(80, generator=g)[::2], torch.randn(40, generator=g, dtype=torch.float64)):
        y = cpu_kernels.gemm_bf16w(x, packed, 40, bias)
        assert (y - torch.nn.functional.linear(x, w, bias.float())).abs().max().item() < 1e-4


@needs_avx512
def test_decode_attention_refuses_tables_shorter_than_the_context():
    """The kernel would read past the tables (another row's entries, or past the tensor: a
    segfault) rather than fail: the wrapper refuses first."""
    cache = torch.randn(2, 8, 1, 2, 16)
    q = torch.randn(2, 2, 16)
    tables = torch.tensor([[0], [1]])  # one 1-slot block each ...
    with pytest.raises(ValueError, match="a context of 2 keys but block tables of 1 blocks x 1 slots"):
        cpu_kernels.decode_attention(q, cache, tables, torch.tensor([2, 2]), 0.25, None)  # ... for 2 keys


@needs_avx512
@pytest.mark.parametrize("block_size", [1, 3])
def test_engine_with_one_slot_blocks_warms_up_and_matches_larger_blocks(llama_dir, block_size):
    """The start-up warm-up's decodes attend to two keys: with 1-slot blocks their tables need
    two entries (one made the kernel read past them and crash)."""
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = []
    for bs in (block_size, 16):
        llm = LLM(str(llama_dir), dtype="float32", block_size=bs, max_num_seqs=64, kv_cache_memory=1 << 22,
                  max_num_batched_tokens=8, load_progress=False)
        outs.append([o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], list(range(3, 40))], greedy)])
    assert outs[0] == outs[1]


@needs_avx512
@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("n,ctx,window", [(1, 57, None), (5, 300, None), (5, 300, 37), (16, 130, 7), (17, 130, None),
                                          (9, 9, None)])
def test_short_chunks_over_a_cached_context_run_as_decode_rows(dtype, n, ctx, window):
    """Up to 16 queries over a cached context (speculative guesses, a prompt's tail after a
    prefix hit) go through the decode kernel, query i over the first ctx - n + 1 + i keys; longer
    chunks and fresh prompts (nothing cached before them) keep the gather and SDPA. Either way
    the float64 reference's answer, and the PyTorch path's."""
    g = torch.Generator().manual_seed(n * 1000 + ctx)
    hq, hkv, d, bs = 14, 2, 64, 16
    blocks = -(-ctx // bs)
    cache = torch.randn(2, blocks + 3, bs, hkv, d, generator=g).to(dtype)
    table = torch.randperm(blocks + 3, generator=g)[:blocks]
    pos = torch.arange(ctx - n, ctx)
    slots = table[pos // bs] * bs + pos % bs
    q, k, v = torch.randn(n, hq, d, generator=g), torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    outs, calls, real = {}, [], cpu_kernels.decode_attention
    for kernels in (True, False):
        c = cache.clone()
        meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillSeq(0, n, ctx, table)], block_size=bs,
                                 cpu_kernels=kernels)
        try:
            cpu_kernels.decode_attention = lambda *a, **kw: calls.append(kernels) or real(*a, **kw)
            outs[kernels] = paged_attention(q, k, v, c, meta, 0.125, window)
        finally:
            cpu_kernels.decode_attention = real
    assert calls == ([True] if n <= 16 and n < ctx else [])
    written = cache.clone()
    written[0].view(-1, hkv, d)[slots] = to_storage(k, dtype)
    written[1].view(-1, hkv, d)[slots] = to_storage(v, dtype)
    ref = _reference_decode(q, written, table.expand(n, -1), torch.arange(ctx - n + 1, ctx + 1), 0.125, window)
    for out in outs.values():
        assert (out - ref).abs().max().item() < 2e-5
    assert (outs[True] - outs[False]).abs().max().item() < 2e-5


@pytest.mark.parametrize("hq,hkv,d", [(4, 1, 24), (34, 2, 32), (4, 2, 272)])
def test_attention_shapes_off_the_vector_path_use_pytorch(hq, hkv, d):
    """Head sizes that are not a multiple of 16 (or past 256) and more than 16 query heads per KV
    head are declined, by the Python check and by the kernel itself; paged_attention then runs its
    PyTorch path and still matches the reference."""
    cache = torch.randn(2, 8, 4, hkv, d)
    tables, lens, q = torch.tensor([[3, 1, 5]]), torch.tensor([10]), torch.randn(1, hq, d)
    assert not cpu_kernels.decode_attention_supported(q, cache)
    assert cpu_kernels.decode_attention(q, cache, tables, lens, 0.2, None) is None
    meta = AttentionMetadata(slot_mapping=torch.tensor([tables[0, 2] * 4 + 1]), block_size=4,
                             decode_groups=[DecodeGroup(0, 1, tables, lens)])
    k, v = torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    out = paged_attention(q, k, v, cache, meta, 0.2)  # writes k, v at position 9 first
    assert torch.allclose(out, _reference_decode(q, cache, tables, lens, 0.2, None), atol=1e-5)


def _greedy(llm, prompts, n):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@needs_avx512
@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2_moe"])
def test_bf16_engine_with_kernels_equals_pytorch_path(arch, checkpoints):
    """A bf16 checkpoint computed in float32: the kernels (bf16 weights for linear layers and MoE
    experts, in-place bf16 KV reads) give the PyTorch path's tokens for a concurrent batch, and
    logits within float32 rounding."""
    rng = random.Random(3)
    prompts = [[rng.randrange(200) for _ in range(L)] for L in (3, 17, 31, 1, 48, 9, 64, 25)]
    kw = dict(dtype="bfloat16", compute_dtype="float32", kv_cache_memory=4 << 20, load_progress=False,
              device="cpu")  # the CPU kernels' test, also on a machine with a GPU
    fast = LLM(str(checkpoints[arch]), **kw)
    slow = LLM(str(checkpoints[arch]), cpu_kernels=False, **kw)
    for llm, on in ((fast, True), (slow, False)):
        layer = llm.engine.runner.model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj, Bf16DecodeLinear) == on
        if arch != "llama":
            assert (layer.mlp.bf16_experts is not None) == on
    assert _greedy(fast, prompts, 12) == _greedy(slow, prompts, 12)
    rows = {}
    for name, llm in (("fast", fast), ("slow", slow)):
        sampler, captured = llm.engine.sampler, []
        llm.engine.sampler = lambda logits, reqs, s=sampler, c=captured: c.append(logits.clone()) or s(logits, reqs)
        _greedy(llm, prompts[:4], 5)
        rows[name] = torch.cat(captured)
    assert (rows["fast"] - rows["slow"]).abs().max().item() < 1e-3


def test_failed_build_falls_back_to_pytorch(monkeypatch, tmp_path, caplog, llama_dir):
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="tierlm.models.cpu_kernels"):
        assert cpu_kernels.library() is None
    assert "building tierlm's CPU kernels failed" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))  # no half-built library left behind
    llm = LLM(str(llama_dir), dtype="bfloat16", compute_dtype="float32", kv_cache_memory=4 << 20, load_progress=False,
              device="cpu")
    assert not isinstance(llm.engine.runner.model.layers[0].mlp.down_proj, Bf16DecodeLinear)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
