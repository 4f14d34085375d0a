"""Fixed-shape steps (engine/graphs.py): bucketing, padding that touches no real block, prefix
hits, and requests that come and go between steps of the same bucket. On CPU the steps run
eagerly in the shapes a CUDA graph records; tests/models/test_parity.py checks them against
transformers for every architecture."""
from __future__ import annotations

import random

import pytest
import torch

from tierlm import LLM, SamplingParams
from tierlm.engine.graphs import MAX_TOKENS, MAX_WIDTH, Bucket, StepGraphs


def _prompts(n: int, seed: int, lo: int = 1, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(path, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_memory": 4 << 20, "load_progress": False, **kw}
    return LLM(str(path), **kw)


class _Req:
    def __init__(self, computed: int, total: int) -> None:
        self.num_computed_tokens, self.num_tokens = computed, total


def _graphs(max_rows: int = 64, max_blocks: int = 250) -> StepGraphs:
    cache = torch.zeros(2, 9, 16, 1, 4)
    return StepGraphs(torch.nn.Identity(), [cache], 16, scratch_block=8, max_rows=max_rows, max_blocks=max_blocks)


def test_decode_shapes_recorded_ahead_keep_the_smallest_and_record_the_largest_first():
    from tierlm.engine.graphs import MAX_GRAPHS, decode_shapes
    few = decode_shapes(max_rows=6, max_blocks=20, min_rows=1, have=set())
    assert {(b.rows, b.blocks) for b in few} == {(r, k) for r in (1, 2, 4, 8) for k in (1, 2, 4, 8, 16)}
    assert [b.rows * b.blocks for b in few] == sorted((b.rows * b.blocks for b in few), reverse=True)
    many = decode_shapes(max_rows=512, max_blocks=1 << 16, min_rows=2, have={Bucket(2, 1, 1)})
    assert len(many) == MAX_GRAPHS - 1 < 9 * 17  # more shapes than room: the smallest are kept
    assert Bucket(2, 1, 2) in many and Bucket(512, 1, 1 << 16) not in many and Bucket(1, 1, 1) not in many
    assert Bucket(2, 1, 1) not in many  # recorded already


def test_buckets_round_up_and_refuse_what_padding_would_waste():
    g = _graphs()
    assert g.bucket_for([(_Req(40, 41), 1)] * 3) == Bucket(rows=4, width=1, blocks=4)  # 41 tokens: 3 blocks -> 4
    assert g.bucket_for([(_Req(2000, 2032), 32)]) == Bucket(rows=1, width=32, blocks=128)  # a prefix hit's tail
    assert g.bucket_for([(_Req(0, 20), 20)]) == Bucket(rows=1, width=32, blocks=2)
    assert g.bucket_for([(_Req(0, MAX_WIDTH + 1), MAX_WIDTH + 1)]) is None  # a long chunk: eager
    assert g.bucket_for([(_Req(0, 64), 64)] * 9) is None  # 16 x 64 tokens > MAX_TOKENS
    assert 16 * 64 > MAX_TOKENS
    # Eight decodes beside one 32-token chunk would pad 40 tokens to 16 x 32: eager.
    assert g.bucket_for([(_Req(10, 11), 1)] * 8 + [(_Req(0, 32), 32)]) is None
    assert g.bucket_for([(_Req(3900, 3901), 1)]) == Bucket(rows=1, width=1, blocks=250)  # capped at max_model_len's
    assert g.bucket_for([(_Req(4000, 4001), 1)]) is None  # past max_model_len: never scheduled, but not padded
    assert _graphs(max_rows=4).bucket_for([(_Req(1, 2), 1)] * 5) is None  # more rows than the engine runs
    g.enabled = False  # after a failed recording
    assert g.bucket_for([(_Req(40, 41), 1)]) is None


def test_only_a_device_side_assert_counts_as_a_lost_context():
    """A failed capture falls back to eager steps; only an assert (the context is gone) is raised.
    Both messages end with torch's hint about device-side assertions (an H100 run re-raised every
    failed capture because of it)."""
    from tierlm.engine.graphs import context_lost
    hint = ("\nCUDA kernel errors might be asynchronously reported at some other API call\n"
            "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
    capture = RuntimeError("CUDA error: operation failed due to a previous error during capture" + hint)
    assert not context_lost(capture)
    assert context_lost(RuntimeError("CUDA error: device-side assert triggered" + hint))
    try:
        try:
            raise RuntimeError("CUDA error: device-side assert triggered" + hint)
        except RuntimeError:
            raise capture
    except RuntimeError as chained:  # the assert as the context of what the capture's exit raised
        assert context_lost(chained)


def test_mixed_traffic_matches_eager_steps_and_padding_touches_no_real_block(llama_dir):
    """Requests of many lengths finish at different steps and new ones take their blocks, so a
    bucket is reused with fewer rows than it last held: its padding must carry nothing over."""
    prompts = _prompts(14, seed=3)
    params = [SamplingParams(max_tokens=1 + (7 * i) % 13, temperature=0, ignore_eos=True) for i in range(14)]
    runs = {}
    for graphs in (False, True):
        # A pool of 40 blocks of 8 tokens for 14 requests of up to 82 tokens: blocks are reused.
        llm = _engine(llama_dir, cuda_graphs=graphs, block_size=8, max_num_seqs=6, max_num_batched_tokens=48,
                      kv_cache_memory=40 * 8 * 2 * 2 * 2 * 16 * 4, enable_prefix_caching=False)
        assert llm.engine.pool.num_blocks == 40
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[graphs] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.pool.num_used == 0
    runner = llm.engine.runner
    assert runner.graphs.steps > 10 and len(runner.graphs.buckets) > 3
    assert runs[True] == runs[False]
    # The scratch block lies past the pool: no request's table can name it.
    assert runner.kv_caches[0].shape[1] == llm.engine.pool.num_blocks + 1
    assert runner.graphs.scratch_slot == llm.engine.pool.num_blocks * 8


def test_prefix_hit_runs_its_tail_as_one_small_fixed_shape_step(llama_dir):
    prefix = _prompts(1, seed=5, lo=200, hi=200)[0]
    tail = [7, 8, 9, 10, 11]
    cold = _engine(llama_dir, enable_prefix_caching=False).generate(
        {"prompt_token_ids": prefix + tail}, SamplingParams(max_tokens=6, temperature=0))
    llm = _engine(llama_dir, cuda_graphs=True)
    llm.generate({"prompt_token_ids": prefix + [1, 2]}, SamplingParams(max_tokens=1))
    steps = llm.engine.runner.graphs.steps
    hit = llm.generate({"prompt_token_ids": prefix + tail}, SamplingParams(max_tokens=6, temperature=0))
    assert hit[0].num_cached_tokens == 192  # 12 full blocks of 16
    assert hit[0].outputs[0].token_ids == cold[0].outputs[0].token_ids
    assert llm.engine.runner.graphs.steps == steps + 6  # the 13-token tail, then 5 decodes
    assert Bucket(rows=1, width=16, blocks=16) in llm.engine.runner.graphs.buckets


def test_moe_steps_run_every_expert_when_grouping_would_touch_them_all(checkpoints):
    """Mixtral's test model: 4 experts, top-2. Steps of 2+ tokens go through fixed shapes (every
    expert on every token, weighted by routing); single decodes stay eager and grouped."""
    prompts = _prompts(6, seed=6, hi=30)
    params = [SamplingParams(max_tokens=3 + i, temperature=0, ignore_eos=True) for i in range(6)]
    runs = {}
    for graphs in (False, True):
        llm = _engine(checkpoints["mixtral"], cuda_graphs=graphs, max_num_batched_tokens=32)
        runs[graphs] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                        params)]
    g = llm.engine.runner.graphs
    assert g.min_tokens == 2 and g.steps > 5
    assert g.bucket_for([(_Req(3, 4), 1)]) is None and g.bucket_for([(_Req(3, 4), 1)] * 2) is not None
    assert runs[True] == runs[False]
    assert not any(m.static_shapes for m in g.moe)  # set only while a fixed-shape step runs


def test_the_cli_flag_reaches_the_engine():
    from tierlm.cli import build_parser, engine_kwargs
    args = build_parser().parse_args(["serve", "--cuda-graphs"])
    assert engine_kwargs(args)["cuda_graphs"] is True
    assert engine_kwargs(build_parser().parse_args(["serve"]))["cuda_graphs"] is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to record graphs")
def test_recorded_graphs_replay_the_eager_tokens_on_cuda(llama_dir):
    prompts = _prompts(10, seed=4)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        llm = _engine(llama_dir, device="cuda", cuda_graphs=graphs, max_num_batched_tokens=64)
        runs[graphs] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                        params)]
    g = llm.engine.runner.graphs
    assert g.enabled and g.recorded > 0 and g.steps > 0  # recorded (at start-up, and as seen), replayed
    assert runs[True] == runs[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to record graphs")
def test_a_dead_engine_collected_while_another_records_does_not_break_its_capture(llama_dir):
    """A dead engine's graphs freed by the cycle collector in the middle of another engine's
    capture invalidated it (an H100 run: 3 parity tests and a hypothesis example failed so)."""
    import gc
    first = _engine(llama_dir, device="cuda", cuda_graphs=True, max_num_seqs=8)
    assert first.engine.runner.graphs.recorded > 0
    cycle = [first]
    cycle.append(cycle)  # only the cycle collector can free it now
    del first, cycle
    thresholds = gc.get_threshold()
    gc.set_threshold(1)  # collect at almost every allocation: inside the next capture, unless kept off
    try:
        second = _engine(llama_dir, device="cuda", cuda_graphs=True, max_num_seqs=8)
    finally:
        gc.set_threshold(*thresholds)
    g = second.engine.runner.graphs
    assert g.enabled and g.recorded > 0
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert second.generate({"prompt_token_ids": [5, 6, 7]}, greedy)[0].outputs[0].token_ids == \
        _engine(llama_dir, device="cuda").generate({"prompt_token_ids": [5, 6, 7]}, greedy)[0].outputs[0].token_ids


def test_rows_that_sample_come_first_whatever_the_step_order(llama_dir):
    """The logits returned are the sampling rows' own, in the order of the requests returned,
    also when a row that does not sample (a partial prefill chunk) comes first in the step."""
    llm = _engine(llama_dir, cuda_graphs=True, max_num_batched_tokens=64)
    eng = llm.engine
    a = eng.add_request({"prompt_token_ids": _prompts(1, seed=8, lo=60, hi=60)[0]}, SamplingParams(max_tokens=2))
    b = eng.add_request({"prompt_token_ids": _prompts(1, seed=9, lo=5, hi=5)[0]}, SamplingParams(max_tokens=2))
    sched = eng.scheduler.schedule()
    assert [(r, n) for r, n in sched.scheduled] == [(a, 60), (b, 4)]  # b's last token waits for the next step
    sched.scheduled.reverse()
    runner, graphs = eng.runner, eng.runner.graphs
    samplers, logits, scored = runner.execute(sched)
    assert graphs.steps == 1 and samplers == [a] and scored == []
    runner.graphs = None
    eager_samplers, eager_logits, _ = runner.execute(sched)
    runner.graphs = graphs
    assert eager_samplers == [a]
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)


def test_decode_shapes_recorded_ahead_write_only_the_scratch_block(llama_dir):
    """What start-up records on CUDA, run here eagerly: buffers of padding only. The real blocks
    (here holding a finished request's cached prefix) are left bit for bit as they were."""
    llm = _engine(llama_dir, cuda_graphs=True, max_num_seqs=4)
    llm.generate({"prompt_token_ids": _prompts(1, seed=7, lo=60, hi=60)[0]}, SamplingParams(max_tokens=2))
    runner = llm.engine.runner
    n = llm.engine.pool.num_blocks
    before = [c[:, :n].clone() for c in runner.kv_caches]
    runner.graphs.record_decode_buckets(max_blocks=8)
    assert {(b.rows, b.width, b.blocks) for b in runner.graphs.buckets} >= {
        (r, 1, k) for r in (1, 2, 4) for k in (1, 2, 4, 8)}
    assert all(torch.equal(c[:, :n], old) for c, old in zip(runner.kv_caches, before))
    assert any(c[:, n].abs().sum() > 0 for c in runner.kv_caches)  # the padding's K/V went to the scratch block
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    p = _prompts(1, seed=7, lo=60, hi=60)[0]
    assert llm.generate({"prompt_token_ids": p}, greedy)[0].outputs[0].token_ids == \
        _engine(llama_dir).generate({"prompt_token_ids": p}, greedy)[0].outputs[0].token_ids
