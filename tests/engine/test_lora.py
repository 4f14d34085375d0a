"""LoRA adapters on one base model: PEFT checkpoints served per request, checked token for token
against transformers + peft on the same weights, in batches that mix adapters and the base,
through chunked prefill, fixed-shape steps, preemption and the prefix cache."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import KV_SMALL, build_checkpoint
from tests.lora_adapters import TARGETS, build_adapter, greedy, peft_model, standard_adapters
from tierlm import LLM, LoRARequest, SamplingParams
from tierlm.errors import InvalidRequestError, ModelLoadError

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def _prompt(n: int, seed: int, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    """Per architecture: (base checkpoint, {"a1": dir, "a2": dir}), built on first use."""
    built: dict[str, tuple] = {}
    root = tmp_path_factory.mktemp("lora")

    def get(arch: str):
        if arch not in built:
            built[arch] = (checkpoints[arch], standard_adapters(checkpoints[arch], arch, root / arch))
        return built[arch]
    return get


def _llm(base, **kw) -> LLM:
    return LLM(str(base), dtype="float32", block_size=8, max_num_batched_tokens=16, load_progress=False,
               enable_lora=True, **kw)


@pytest.mark.parametrize("arch,graphs", [("llama", False), ("llama", True), ("qwen3", False), ("gemma3", False),
                                         ("phi3", False), ("qwen2_moe", False), ("gpt_oss", False)])
def test_adapters_match_peft_token_for_token_in_a_mixed_batch(arch, graphs, adapters):
    """Four prompts in one batch, 16 tokens a step: two on adapter a1 (rows apart in the batch),
    one on a2 (rsLoRA, other modules), one on the base. Each answer is what transformers + peft
    generate for that adapter alone, and differs from the base model's (the adapter is applied).
    graphs: the fixed-shape (CUDA-graph) step path, which steps with adapters leave."""
    base, ads = adapters(arch)
    llm = _llm(base, cuda_graphs=graphs)
    prompts = [_prompt(20, 1), _prompt(33, 2), _prompt(9, 3), _prompt(14, 4)]
    loras = [LoRARequest("a1", 1, str(ads["a1"])), LoRARequest("a2", 2, str(ads["a2"])), None, "a1"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras)
    base_model = peft_model(base, arch, None)
    for ids, lora, out in zip(prompts, loras, outs):
        name = lora.lora_name if isinstance(lora, LoRARequest) else lora
        want = greedy(peft_model(base, arch, ads[name]) if name else base_model, ids, 8)
        assert out.outputs[0].token_ids == want, (name, out.outputs[0].token_ids, want)
        if name is not None:
            assert want != greedy(base_model, ids, 8)  # (else the check above shows nothing)
    assert llm.engine.pool.num_used == 0  # every block given back


def test_an_adapter_s_embedding_and_prompt_logprobs_are_peft_s(adapters):
    """Pooling and prompt scoring run through the adapter too."""
    base, ads = adapters("llama")
    llm = _llm(base)
    ids = _prompt(21, 5)
    ref = peft_model(base, "llama", ads["a1"])
    with torch.no_grad():
        out = ref(torch.tensor([ids]), output_hidden_states=True)
    emb = llm.embed({"prompt_token_ids": ids}, lora_request=LoRARequest("a1", 1, str(ads["a1"])))[0]
    want = torch.nn.functional.normalize(out.hidden_states[-1][0, -1].float(), dim=0)
    torch.testing.assert_close(torch.tensor(emb.outputs.embedding), want, rtol=1e-4, atol=1e-5)
    scored = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                          lora_request="a1")[0]
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)
    got = [next(iter(e.values())).logprob if isinstance(e, dict) else e.logprob for e in scored.prompt_logprobs[1:]]
    want_lp = [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want_lp), rtol=1e-4, atol=1e-4)


def test_cached_blocks_are_never_shared_across_adapters(adapters, tmp_path):
    """One prompt on the base, a1 and a2: none finds another's blocks. a1 again hits its own,
    and so does a1's directory loaded under a second name (the key is the adapter's content)."""
    base, ads = adapters("llama")
    llm = _llm(base)
    ids = _prompt(41, 6)
    copy = tmp_path / "a1-copy"
    shutil.copytree(ads["a1"], copy)
    runs = [None, LoRARequest("a1", 1, str(ads["a1"])), LoRARequest("a2", 2, str(ads["a2"])), "a1",
            LoRARequest("same-as-a1", 3, str(copy))]
    outs = [llm.generate({"prompt_token_ids": ids}, GREEDY, lora_request=r)[0] for r in runs]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 40, 40]
    assert outs[3].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[4].outputs[0].token_ids
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:3]}) == 3


def test_max_loras_caps_the_adapters_of_a_step_and_every_request_finishes(adapters):
    """max_loras=1: requests of a2 wait while a1 runs (and the reverse); every step holds one
    adapter at most, and all answers are what each gets alone. With a KV pool this small,
    requests are also preempted and recomputed, adapters and all."""
    base, ads = adapters("llama")
    llm = _llm(base, max_loras=1, kv_cache_memory=KV_SMALL)
    eng = llm.engine
    llm.engine.add_lora("a1", str(ads["a1"]))
    llm.engine.add_lora("a2", str(ads["a2"]))
    prompts = [_prompt(30 + i, 10 + i) for i in range(6)]
    names = ["a1", "a2", None, "a2", "a1", None]
    params = SamplingParams(max_tokens=16, temperature=0)
    reqs = [eng.add_request({"prompt_token_ids": p}, params, f"r{i}", lora=n) for i, (p, n) in enumerate(zip(prompts, names))]
    seen = set()
    while eng.has_unfinished():
        eng.step()
        running = {r.lora.name for r in eng.scheduler.running if r.lora is not None}
        assert len(running) <= 1, running
        seen |= running
    assert seen == {"a1", "a2"} and eng.scheduler.num_preemptions > 0
    assert eng.pool.num_used == 0
    for r, p, n in zip(reqs, prompts, names):
        alone = _llm(base).generate({"prompt_token_ids": p}, params,
                                    lora_request=LoRARequest(n, 1, str(ads[n])) if n else None)[0]
        assert r.output_token_ids == alone.outputs[0].token_ids, n


def test_removing_an_adapter_lets_its_requests_finish_and_refuses_new_ones(adapters):
    base, ads = adapters("llama")
    llm = _llm(base, lora_modules={"a1": str(ads["a1"])})
    eng = llm.engine
    assert eng.list_loras() == ["a1"]
    ids = _prompt(20, 20)
    want = llm.generate({"prompt_token_ids": ids}, GREEDY, lora_request="a1")[0].outputs[0].token_ids
    req = eng.add_request({"prompt_token_ids": ids + [5]}, GREEDY, "x", lora="a1")
    eng.step()
    eng.remove_lora("a1")
    with pytest.raises(InvalidRequestError, match="LoRA adapter 'a1' is not loaded"):
        eng.add_request({"prompt_token_ids": ids}, GREEDY, "y", lora="a1")
    while eng.has_unfinished():
        eng.step()
    assert req.is_finished and len(req.output_token_ids) == 8
    assert llm.generate({"prompt_token_ids": ids}, GREEDY, lora_request=LoRARequest(
        "a1", 1, str(ads["a1"])))[0].outputs[0].token_ids == want  # loaded again: the same answer


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_adapters_tierlm_cannot_serve_exactly_are_refused_by_cause(adapters, checkpoints, tmp_path):
    """Each refusal names the adapter and what to do; none leaves the engine changed."""
    base, ads = adapters("llama")
    llm = _llm(base, max_lora_rank=8)
    eng = llm.engine
    wrong_base = build_adapter(checkpoints["qwen3"], "qwen3", tmp_path / "qwen3-a", ["q_proj"])  # q is 128 wide there
    head = build_adapter(base, "llama", tmp_path / "head", ["lm_head"])
    big = build_adapter(base, "llama", tmp_path / "big", ["q_proj"], r=16)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(ads["a1"], corrupt)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    cases = [
        (_edit_config(ads["a1"], tmp_path / "dora", use_dora=True), "DoRA"),
        (_edit_config(ads["a1"], tmp_path / "save", modules_to_save=["lm_head"]), "modules_to_save"),
        (_edit_config(ads["a1"], tmp_path / "bias", bias="all"), "bias='all'"),
        (_edit_config(ads["a1"], tmp_path / "ia3", peft_type="IA3"), "LoRA adapters only"),
        (wrong_base, "another base model"),
        (head, "lm_head"),
        (big, "above max_lora_rank 8"),
        (corrupt, "corrupt"),
        (tmp_path / "nowhere", "not a directory"),
    ]
    for path, says in cases:
        with pytest.raises(ModelLoadError, match=says):
            eng.add_lora("x", str(path))
        with pytest.raises(InvalidRequestError, match=says):  # the same, as a request's error
            eng.add_request({"prompt_token_ids": [5, 6]}, GREEDY, lora=LoRARequest("x", 1, str(path)))
    assert eng.list_loras() == [] and not eng.has_unfinished()
    with pytest.raises(InvalidRequestError, match="base model's own name"):
        eng.add_lora(eng.model_name, str(ads["a1"]))
    with pytest.raises(InvalidRequestError, match="is not valid"):
        eng.add_lora("has space", str(ads["a1"]))
    eng.add_lora("a1", str(ads["a1"]))
    with pytest.raises(InvalidRequestError, match="already loaded from"):
        eng.add_lora("a1", str(ads["a2"]))
    with pytest.raises(InvalidRequestError, match="'nope' is not loaded"):
        eng.add_request({"prompt_token_ids": [5, 6]}, GREEDY, lora="nope")
    plain = LLM(str(base), dtype="float32", load_progress=False)
    with pytest.raises(InvalidRequestError, match="enable_lora=True"):
        plain.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request="a1")
    with pytest.raises(ModelLoadError, match="not a directory"):
        _llm(base, lora_modules={"gone": str(tmp_path / "nowhere")})
    assert llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request="a1")[0].outputs[0].token_ids


def test_an_adapter_s_prefix_leaves_the_device_and_comes_back_only_for_that_adapter(adapters, tmp_path):
    """Host and disk tiers key blocks as the device does: a1's prefix, demoted, is a1's hit
    (under any name: the key is the adapter's content, so a second engine on the same disk
    directory finds it) and a miss for the base model and for a2; the answers are a1's."""
    base, ads = adapters("llama")
    shared, ask = _prompt(70, 30), _prompt(9, 31)
    a1 = LoRARequest("a1", 1, str(ads["a1"]))
    want = _llm(base, enable_prefix_caching=False).generate({"prompt_token_ids": shared + ask}, GREEDY,
                                                            lora_request=a1)[0].outputs[0].token_ids
    disk = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="256 blocks")
    llm = _llm(base, kv_host_capacity="64 blocks", **disk)
    llm.generate({"prompt_token_ids": shared + _prompt(3, 32)}, GREEDY, lora_request=a1)
    assert llm.engine.offload_prefix_cache() > 0 and llm.engine.pool.cached == {}
    for lora in (None, LoRARequest("a2", 2, str(ads["a2"]))):  # not theirs
        assert llm.generate({"prompt_token_ids": shared + ask}, GREEDY, lora_request=lora)[0].num_cached_tokens == 0
    llm.engine.offload_prefix_cache()
    again = llm.generate({"prompt_token_ids": shared + ask}, GREEDY, lora_request="a1")[0]
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == want
    assert llm.engine.stats().kv_tiers["host"]["hits"] >= 8
    llm.close()  # (its disk directory is another engine's once released)
    other = _llm(base, **disk)  # another engine, the same directory; a1 under another name
    renamed = other.generate({"prompt_token_ids": shared + ask}, GREEDY,
                             lora_request=LoRARequest("renamed", 7, str(ads["a1"])))[0]
    # 72: the 9 full blocks of this very prompt, which the last request wrote (for a1) before the close
    assert renamed.num_cached_tokens == 72 and renamed.outputs[0].token_ids == want
    assert other.engine.stats().kv_tiers["disk"]["hits"] == 9


def test_a_name_given_other_weights_never_finds_the_old_weights_blocks(adapters, tmp_path, redis_server):
    """Blocks are keyed by an adapter's content, not its name: "x" pointed at other weights, across
    a restart (its blocks left on disk and in Redis) or by unload and load at run time (its blocks
    on the host, disk and Redis), finds none of the old weights' blocks and answers as a cold
    engine with the new weights does; the new weights' own blocks are hits at once."""
    base, ads = adapters("llama")
    ads = {**ads, "a3": build_adapter(base, "llama", tmp_path / "a3", TARGETS["a1"][0], seed=3)}
    ids = _prompt(70, 40)
    cold = {n: _llm(base, enable_prefix_caching=False).generate({"prompt_token_ids": ids}, GREEDY, lora_request=(
        LoRARequest(n, 1, str(ads[n]))))[0].outputs[0].token_ids for n in ads}
    tiers = dict(kv_host_capacity="64 blocks", kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="256 blocks",
                 kv_remote=redis_server.url)

    def run(llm: LLM) -> tuple[int, list[int]]:
        out = llm.generate({"prompt_token_ids": ids}, GREEDY, lora_request="x")[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    with _llm(base, lora_modules={"x": str(ads["a1"])}, **tiers) as llm:
        assert run(llm) == (0, cold["a1"]) and run(llm)[0] == 64
    with _llm(base, lora_modules={"x": str(ads["a2"])}, **tiers) as llm:  # restarted: x is a2 now
        assert llm.engine.store.tiers[1].wait_indexed(timeout=30)
        assert run(llm) == (0, cold["a2"])
        assert llm.engine.offload_prefix_cache() > 0 and run(llm) == (64, cold["a2"])  # from the lower tiers
        llm.engine.offload_prefix_cache()
        llm.engine.remove_lora("x")
        llm.engine.add_lora("x", str(ads["a3"]))
        assert run(llm) == (0, cold["a3"]) and run(llm) == (64, cold["a3"])
        assert llm.engine.stats().kv_tiers["redis"]["corrupt"] == 0


def test_a_request_waiting_for_an_adapter_slot_is_not_passed_for_ever(adapters):
    """max_loras=1, a1 busy and more a1 requests arriving every few steps, one a2 request
    waiting: once a1's running requests end, a2 takes the slot; the a1 requests that arrived
    after it wait their turn (they would otherwise keep a1's slot busy for ever). A base-model
    request, which needs no slot, is not held up."""
    base, ads = adapters("llama")
    eng = _llm(base, max_loras=1, lora_modules={"a1": str(ads["a1"]), "a2": str(ads["a2"])}).engine
    long = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = eng.add_request({"prompt_token_ids": _prompt(10, 40)}, long, "first", lora="a1")
    eng.step()
    waiting = eng.add_request({"prompt_token_ids": _prompt(10, 41)}, long, "a2", lora="a2")
    later, plain, order = [], None, []
    for i in range(200):
        if i % 3 == 0 and len(later) < 8:
            later.append(eng.add_request({"prompt_token_ids": _prompt(10, 50 + i)}, long, f"a1-{i}", lora="a1"))
        if i == 1:
            plain = eng.add_request({"prompt_token_ids": _prompt(10, 42)}, long, "plain")
        eng.step()
        for r in eng.scheduler.running:
            if r.request_id not in order:
                order.append(r.request_id)
        if not eng.has_unfinished():
            break
    assert first.is_finished and waiting.is_finished and all(r.is_finished for r in later) and plain.is_finished
    assert order.index("a2") < min(order.index(r.request_id) for r in later)
    assert order.index("plain") < order.index("a2")  # (no slot needed: it ran beside a1 at once)


def test_rank_and_alpha_patterns_are_read_as_peft_reads_them(checkpoints, tmp_path):
    """PEFT's per-module ranks (rank_pattern: read from the tensors) and alphas (alpha_pattern:
    a module's own scaling) give peft's answer; a bad alpha is refused by name."""
    base = checkpoints["llama"]
    ad = build_adapter(base, "llama", tmp_path / "patterns", ["q_proj", "v_proj", "down_proj"], r=8, alpha=16,
                       rank_pattern={"q_proj": 4}, alpha_pattern={"v_proj": 64, "down_proj": 2})
    ids = _prompt(15, 60)
    got = _llm(base).generate({"prompt_token_ids": ids}, GREEDY, lora_request=LoRARequest("p", 1, str(ad)))[0]
    assert got.outputs[0].token_ids == greedy(peft_model(base, "llama", ad), ids, 8)
    bad = _edit_config(ad, tmp_path / "bad-alpha", alpha_pattern={"v_proj": "high"})
    with pytest.raises(ModelLoadError, match="lora_alpha and alpha_pattern take positive numbers"):
        _llm(base).engine.add_lora("x", str(bad))


def test_glm_shared_expert_lora_lands_where_its_base_weights_did(checkpoints, tmp_path):
    """GLM-4.5's shared experts are `mlp.shared_experts.*` in its checkpoints and adapters, which the
    loader maps by model type: adapters were mapped without it, so a LoRA on them was refused as
    a module that cannot carry one. (peft on transformers 5 adds LoRA on the fused routed experts
    whenever an adapter names gate/up/down_proj, so this adapter is written as peft lays one out,
    and checked against the base weights with B @ A merged in.)"""
    from safetensors.torch import load_file, save_file
    base = checkpoints["glm4_moe"]
    ad = build_adapter(base, "glm4_moe", tmp_path / "attn", ["q_proj"], r=4, alpha=8)
    tensors = load_file(str(ad / "adapter_model.safetensors"))
    g = torch.Generator().manual_seed(3)
    merged = {k: v.clone() for k, v in load_file(str(base / "model.safetensors")).items()}
    for key in list(tensors):  # q_proj's, merged as peft applies it (alpha / r = 2)
        if key.endswith("lora_A.weight"):
            w = key.removeprefix("base_model.model.").removesuffix("lora_A.weight") + "weight"
            merged[w] += 2.0 * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
    for m in ("gate_proj", "up_proj", "down_proj"):
        w = f"model.layers.1.mlp.shared_experts.{m}.weight"
        a = 0.3 * torch.randn(4, merged[w].shape[1], generator=g)
        b = 0.3 * torch.randn(merged[w].shape[0], 4, generator=g)
        tensors[f"base_model.model.{w.removesuffix('.weight')}.lora_A.weight"] = a
        tensors[f"base_model.model.{w.removesuffix('.weight')}.lora_B.weight"] = b
        merged[w] += 2.0 * b @ a
    save_file(tensors, str(ad / "adapter_model.safetensors"), metadata={"format": "pt"})
    merged_dir = tmp_path / "merged"
    shutil.copytree(base, merged_dir)
    save_file(merged, str(merged_dir / "model.safetensors"), metadata={"format": "pt"})
    ids = _prompt(21, 5)
    got = _llm(base).generate({"prompt_token_ids": ids}, GREEDY, lora_request=LoRARequest("s", 1, str(ad)))
    want = _llm(merged_dir).generate({"prompt_token_ids": ids}, GREEDY)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    plain = _llm(base).generate({"prompt_token_ids": ids}, GREEDY)
    assert want[0].outputs[0].token_ids != plain[0].outputs[0].token_ids  # the adapter changes the answer
