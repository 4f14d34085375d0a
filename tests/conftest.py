"""Shared fixtures: tiny random-weight HF checkpoints of every supported architecture."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def ref_tol(cpu: float, cuda: float) -> float:
    """A tolerance against transformers' reference (run on the CPU) for an engine that runs on
    CUDA wherever a test leaves the device to it. There float32 matmuls may run as TF32 (~1e-3
    relative): on an H100, float32 prompt logprobs differed by up to 2.3e-3 and last hidden
    states by up to 9e-3, against 2e-4 / 1e-4 on the CPU."""
    return cuda if torch.cuda.is_available() else cpu

ARCHS = ["llama", "llama31", "llama_yarn", "mistral", "ministral", "mistral3_mm", "ministral3_mm", "qwen2", "qwen3",
         "phi3", "phi4_mini", "phi4_mini_longrope", "granite", "smollm3", "gemma3", "gemma3_mm", "mixtral",
         "qwen2_moe", "qwen3_moe", "gpt_oss", "glm4_moe", "olmo2", "olmo3"]


def _config(arch: str, vocab: int, **extra):
    from transformers import (Gemma3Config, Gemma3TextConfig, Glm4MoeConfig, GptOssConfig, GraniteConfig, LlamaConfig,
                              Ministral3Config, MinistralConfig, Mistral3Config, MistralConfig, MixtralConfig,
                              Olmo2Config, Olmo3Config, Phi3Config, PixtralVisionConfig, Qwen2Config, Qwen2MoeConfig,
                              Qwen3Config, Qwen3MoeConfig, SiglipVisionConfig, SmolLM3Config)
    common = {**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                     initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None), **extra}
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "llama31":
        return LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                           rope_theta=500000.0)
    if arch == "llama_yarn":  # prompts run past the original 32 positions, into the interpolated range
        return LlamaConfig(**common, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 32})
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=24)
    if arch == "ministral":  # a window on some layers only
        return MinistralConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=16,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if arch == "smollm3":  # a layer without RoPE (NoPE) among rotated ones
        return SmolLM3Config(**{**common, "num_hidden_layers": 3}, no_rope_layers=[1, 0, 1])
    if arch == "mistral3_mm":  # Mistral Small 3.1's layout: a Mistral language model beside a Pixtral encoder
        text = MistralConfig(**common, head_dim=32, sliding_window=None)
        vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=28, patch_size=14, head_dim=16)
        return Mistral3Config(text_config=text, vision_config=vision, image_token_index=vocab + 1, spatial_merge_size=2)
    if arch == "ministral3_mm":  # Ministral 3's: queries scaled past original_max_position_embeddings, a window
        text = Ministral3Config(**common, head_dim=16, sliding_window=24, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5})
        vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=28, patch_size=14, head_dim=16)
        return Mistral3Config(text_config=text, vision_config=vision, image_token_index=vocab + 1, spatial_merge_size=2)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": 96}, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=None)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**common, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                              num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)
    if arch == "qwen3":  # q/k norms, a head_dim that is not hidden / heads, biases on q, k, v and o
        return Qwen3Config(**common, head_dim=32, attention_bias=True, tie_word_embeddings=True)
    if arch == "phi3":  # fused qkv and gate_up tensors in the checkpoint itself; a sliding window
        return Phi3Config(**common, sliding_window=20)
    if arch == "phi4_mini":  # Phi-4-mini's RoPE over the first 3/4 of each head (12 of 16 dims), the rest passed through
        return Phi3Config(**common, partial_rotary_factor=0.75)
    if arch == "phi4_mini_longrope":  # Phi-4-mini's whole RoPE: longrope over 3/4 of each head. With an original
        # length of 1 every sequence is past it from its second token on (position 0 is unrotated), so transformers
        # rotates every test sequence with the long factors, as tierlm does when it serves longer sequences than
        # the original length (layers.py: _longrope); tests/models/test_longrope.py covers both sides of a real one.
        return Phi3Config(**common, partial_rotary_factor=0.75, original_max_position_embeddings=1, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "attention_factor": 1.19,
            "short_factor": [1.0, 1.1, 1.3, 1.9, 2.6, 3.5], "long_factor": [1.0, 1.4, 2.9, 7.7, 15.0, 31.0]})
    if arch == "granite":  # Granite 3's scalars: embeddings, residual branches, attention scale, logits
        return GraniteConfig(**common, embedding_multiplier=12.0, residual_multiplier=0.22,
                             attention_multiplier=0.0078125, logits_scaling=8.0, tie_word_embeddings=True)
    if arch == "gemma3":  # sandwich (1 + w) norms, GeGLU, two RoPE bases, sliding layers, sqrt(hidden) embeddings
        return Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                sliding_window=12, rope_parameters={
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if arch == "gemma3_mm":  # the multimodal checkpoint (4B and up): its language model, vision weights skipped
        text = _config("gemma3", vocab).to_dict()
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,  # image ids: never in a prompt
                            image_token_index=vocab + 1, boi_token_index=vocab + 2, eoi_token_index=vocab + 3)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    if arch == "gpt_oss":  # attention sinks, biased experts with a clamped SwiGLU (limit 1: a quarter of
        # the gate/up values clamp), a router with a bias, alternating sliding layers, untruncated YaRN
        return GptOssConfig(**{**common, "intermediate_size": extra.get("intermediate_size", 48)}, head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=12, swiglu_limit=1.0, rope_parameters={
                                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0})
    if arch == "olmo2":  # norms after attention and MLP only, q/k norms over whole projections
        return Olmo2Config(**common)
    if arch == "olmo3":  # and sliding layers on their own RoPE base beside a YaRN-scaled full layer
        n = extra.get("num_hidden_layers", 3)
        return Olmo3Config(**{**common, "num_hidden_layers": n}, sliding_window=12,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"] if n == 3 else None,
                           rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                               "original_max_position_embeddings": 256},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if arch == "glm4_moe":  # GLM-4.5: a dense first layer, then 8 experts in 4 groups (the best 2 groups chosen by
        # sigmoid scores plus a randomised correction bias), two shared experts, qkv biases, q/k norms, half-rotary heads
        return Glm4MoeConfig(**common, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                             n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                             routed_scaling_factor=0.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True)
    raise ValueError(arch)


def _auto(arch: str):
    """transformers' auto class for `arch`: Mistral 3 is an image-text-to-text model only."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if arch in ("mistral3_mm", "ministral3_mm") else AutoModelForCausalLM


def build_checkpoint(arch: str, out: Path, seed: int = 0, **extra) -> Path:
    """`arch`'s tiny checkpoint in `out`; `extra` overrides or adds config fields (e.g. num_hidden_layers)."""
    from tierlm.models.demo import build_tokenizer
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    torch.manual_seed(seed)
    model = _auto(arch).from_config(_config(arch, len(tok) + 10, **extra), dtype=torch.float32)
    with torch.no_grad():  # norms start at all-ones (biases at zeros): make each differ, so a swapped or skipped one shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or (arch == "gpt_oss" and name.endswith(("bias", "sinks"))):
                param.add_(0.2 * torch.randn_like(param))
        for name, buf in model.named_buffers():  # GLM-4.5's router correction (zeros): large enough to change choices
            if name.endswith("e_score_correction_bias"):
                buf.add_(0.3 * torch.randn_like(buf))
    model.save_pretrained(str(out))
    return out


def has_sinks(hf) -> bool:
    """Whether transformers model `hf` has attention sinks (gpt-oss), which its SDPA path leaves
    out: a reference for it must use its eager attention (`rounded_kv_attention(eager=True)`)."""
    return any(name.endswith(".sinks") for name, _ in hf.named_parameters())


def rounded_kv_attention(dtype: torch.dtype, scales: list[tuple[float, float]] | None = None,
                         eager: bool = False) -> str:
    """Register with transformers, and name, an SDPA attention whose keys and values are first
    rounded to `dtype` (after RoPE, where tierlm stores them; saturated to its range), with
    SDPA's own masks (sliding windows included): the reference for a KV cache stored in
    `dtype`. `scales`: per layer (k_scale, v_scale), the values rounded as x / scale and read
    back times scale (an fp8 cache's scales, models/kv_scales.py). transformers keeps its cache
    unrounded and rounds again at each step, which gives the same values (rounding is
    idempotent, and so is dividing and multiplying by a power of two). `eager`: the model's own
    eager attention instead of SDPA, for a model whose attention SDPA would change (GPT-OSS's
    sinks, which transformers' SDPA path leaves out)."""
    import hashlib
    import inspect

    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import eager_mask, sdpa_mask

    top = torch.finfo(dtype).max

    def rounded(t: torch.Tensor, scale: float) -> torch.Tensor:
        return (t / scale).clamp(-top, top).to(dtype).to(t.dtype) * scale

    def attention(module, query, key, value, attention_mask, **kw):
        ks, vs = scales[module.layer_idx] if scales is not None else (1.0, 1.0)
        base = inspect.getmodule(type(module)).eager_attention_forward if eager else sdpa_attention_forward
        return base(module, query, rounded(key, ks), rounded(value, vs), attention_mask, **kw)

    name = f"kv_rounded_{str(dtype).replace('torch.', '')}" + ("_eager" if eager else "")
    if scales is not None:
        name += "_" + hashlib.sha256(repr(scales).encode()).hexdigest()[:12]
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask if eager else sdpa_mask)
    return name


@pytest.fixture
def sdpa_masks(monkeypatch) -> list:
    """The attn_mask of every SDPA call tierlm's attention makes, recorded (the calls run)."""
    import tierlm.models.attention as attention
    masks: list = []
    sdpa = attention.F.scaled_dot_product_attention

    def spy(*a, attn_mask=None, **kw):
        masks.append(attn_mask)
        return sdpa(*a, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    return masks


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {a: build_checkpoint(a, root / a) for a in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def hf_models(checkpoints):
    return {a: _auto(a).from_pretrained(str(p), dtype=torch.float32).eval() for a, p in checkpoints.items()}


KV_SMALL = 64 * 1024  # bytes: a handful of blocks for the tiny models, forces preemption


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server on 127.0.0.1 (random port) that a test can stop and restart."""

    def __init__(self, tmp: Path, password: str | None = None, tls: bool = False, unix: bool = False) -> None:
        import shutil as _sh
        exe = _sh.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does this)")
        self.exe, self.tmp, self.port = exe, tmp, _free_port()
        self.password = password
        self.proc = None
        self.socket = tmp / "redis.sock" if unix else None
        self.cert = None
        if tls:  # a self-signed certificate for 127.0.0.1
            import subprocess
            if _sh.which("openssl") is None:
                pytest.skip("openssl is not installed")
            self.cert, key = tmp / "cert.pem", tmp / "key.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                            "-out", str(self.cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                            "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)

    @property
    def url(self) -> str:
        """Without the CA for a TLS server: give `?ssl_ca_certs={self.cert}` to trust it."""
        if self.socket:
            return f"unix://{self.socket}?db=0"
        scheme = "rediss" if self.cert else "redis"
        return f"{scheme}://{f':{self.password}@' if self.password else ''}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import subprocess
        import time
        import redis
        ports = ["--port", str(self.port)]
        if self.socket:
            ports += ["--unixsocket", str(self.socket)]
        if self.cert:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.cert),
                     "--tls-key-file", str(self.cert.with_name("key.pem")), "--tls-ca-cert-file", str(self.cert),
                     "--tls-auth-clients", "no"]
        self.proc = subprocess.Popen([self.exe, *ports, "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.tmp)]
                                     + (["--requirepass", self.password] if self.password else []),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, ssl=bool(self.cert),
                             ssl_ca_certs=str(self.cert) if self.cert else None,
                             socket_connect_timeout=1, socket_timeout=1)
        for _ in range(100):
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None and self.cert:
                    pytest.skip("this redis-server was built without TLS")
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


def _running(srv: RedisServer):
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def redis_server(tmp_path):
    yield from _running(RedisServer(tmp_path))


@pytest.fixture
def redis_server_with_password(tmp_path):
    yield from _running(RedisServer(tmp_path, password="s3cret-pw"))


@pytest.fixture
def redis_server_on_a_unix_socket(tmp_path):
    yield from _running(RedisServer(tmp_path, unix=True))


@pytest.fixture
def redis_server_with_tls(tmp_path):
    yield from _running(RedisServer(tmp_path, tls=True))
