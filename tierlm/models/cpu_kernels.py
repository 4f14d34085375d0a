"""tierlm's own CPU kernels (csrc/cpu_kernels.c), built for this CPU on first use and called via ctypes.

Why: on CPU a decode step is bound by streaming the weights and by attention's gather-and-convert
passes, which PyTorch cannot fuse. The kernels read bf16 weights and a bf16 or fp8 paged KV cache
in place and compute in float32 (see the C file); a third widens gathered fp8 K/V to float32 or
bf16, several times faster than torch's own (scalar) conversion. They are compiled with the
system C compiler (`-O3 -march=native -fopenmp`, about a second) into ~/.cache/tierlm/kernels, keyed by the source
and this CPU's flags. They need AVX-512. Without it, without a compiler, or with
TIERLM_CPU_KERNELS=0 (EngineConfig.cpu_kernels=False), everything runs on the PyTorch paths
instead: same results, just slower, and one log line says why.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from tierlm.models.demo import cache_root
from tierlm.models.kv_dtype import is_fp8

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None = None
_tried = False
_avx512 = False  # whether the loaded library has its AVX-512 kernels (read once, not per call)
_lock = threading.Lock()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    return cache_root() / "kernels"  # $TIERLM_CACHE or ~/.cache/tierlm, like the demo model


def _build() -> Path | None:
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{key}.so"
    if out.is_file():
        return out
    cc_env, found = os.environ.get("CC"), shutil.which("gcc") or shutil.which("cc")
    cc = shlex.split(cc_env) if cc_env else [found] if found else []
    if not cc:
        log.warning("no C compiler found: tierlm's CPU kernels are off (decode runs slower); "
                    "install gcc to enable them")
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build into a temporary name, then rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([*cc, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if res.returncode != 0:
            log.warning("building tierlm's CPU kernels failed, using the PyTorch paths instead:\n%s",
                        res.stderr.strip()[-2000:])
            return None
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it is disabled or cannot be built (logged once)."""
    if _tried:
        return _lib
    with _lock:  # engines loading in parallel threads wait for one build instead of skipping it
        return _load()


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, _avx512
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("TIERLM_CPU_KERNELS", "1") == "0":
        log.info("TIERLM_CPU_KERNELS=0: tierlm's CPU kernels are off")
        return None
    try:
        path = _build()
        if path is None:
            return None
        # Load PyTorch first: the kernels then bind to the OpenMP runtime it already loaded.
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("loading tierlm's CPU kernels failed (%s); using the PyTorch paths instead", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    cint = ctypes.c_int
    lib.tierlm_pack_bf16.argtypes = [ptr, i64, i64, ptr, cint]
    lib.tierlm_pack_bf16.restype = None
    lib.tierlm_gemm_bf16w.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, cint]
    lib.tierlm_gemm_bf16w.restype = ctypes.c_int
    lib.tierlm_decode_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, cint, i64, ptr, i64, ptr,
                                            i64, ctypes.c_float, ptr, ptr, cint]
    lib.tierlm_decode_attention.restype = ctypes.c_int
    lib.tierlm_fp8_widen.argtypes = [ptr, ptr, i64, cint, cint, cint]
    lib.tierlm_fp8_widen.restype = ctypes.c_int
    _avx512 = bool(lib.tierlm_has_avx512())
    if not _avx512:
        log.info("this CPU has no AVX-512: tierlm's CPU kernels are off, the PyTorch paths run")
    _lib = lib
    return lib


def has_avx512() -> bool:
    """Whether the kernels are built with AVX-512 (both need it; otherwise PyTorch paths run)."""
    return library() is not None and _avx512


# ---------------------------------------------------------------- bf16-weight GEMM

def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 weight -> the kernel's panel layout (int32 storage, 64-byte aligned rows)."""
    lib = library()
    assert lib is not None and weight.dtype == torch.bfloat16 and weight.dim() == 2
    w = weight.detach().contiguous()
    n, k = w.shape
    out = torch.empty(-(-n // 32) * k * 16 + 16, dtype=torch.int32)
    # Align the panels to 64 bytes (the kernel uses aligned vector loads).
    shift = (-out.data_ptr() % 64) // 4
    packed = out[shift: shift + (out.numel() - 16)]
    lib.tierlm_pack_bf16(w.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
    return packed


def gemm_bf16w(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [M, K] float32 @ W^T (+ bias) with W packed by pack_bf16; None past the kernel's row limit (224)."""
    lib = library()
    m, k = x.shape
    x = x.contiguous()
    if bias is not None:  # the kernel reads n contiguous floats: a strided or float64 bias read garbage
        bias = bias.to(torch.float32).contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    scratch = torch.empty(m * k, dtype=torch.float32)
    rc = lib.tierlm_gemm_bf16w(x.data_ptr(), m, k, packed.data_ptr(), n,
                               bias.data_ptr() if bias is not None else None, y.data_ptr(), scratch.data_ptr(),
                               torch.get_num_threads())
    return y if rc == 0 else None


# ---------------------------------------------------------------- paged decode attention

# The cache dtypes the kernel reads in place, by the code it knows them by (KV_* in the C file).
_KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def decode_attention_supported(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """CPU, float32 or bf16 queries (bf16 ones are widened, attended in float32 and rounded back:
    on a CPU that computes in bf16, ~3x faster than PyTorch's gather and SDPA at 16 rows of
    320 keys), a contiguous float32/bf16/fp8 cache, and a shape on the kernel's vector path:
    head_dim a multiple of 16 up to 256, at most 16 query heads per KV head."""
    hq, d, hkv = q.shape[1], q.shape[2], cache.shape[3]
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and cache.dtype in _KV_KINDS
            and cache.is_contiguous() and d % 16 == 0 and d <= 256 and hq % hkv == 0 and hq // hkv <= 16
            and has_avx512())


def decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor,
                     scale: float, window: int | None, longest: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """q [B, Hq, D] float32 or bf16 (the output's dtype), one token per sequence; cache [2,
    blocks, block_size, Hkv, D] of a dtype decode_attention_supported accepts (fp8 is read as
    stored: no scale).
    `longest`: max(lens) when the caller knows it (read once per step, not per layer).
    `sinks`: [Hq] logits that join each head's softmax without a value (gpt-oss).
    None where the kernel declined (see decode_attention_supported; or out of scratch memory)."""
    lib = library()
    b, hq, d = q.shape
    out_dtype = q.dtype
    q = q.to(torch.float32).contiguous()
    # The kernel reads int64s: int32 tables were read as pairs of ids (a segfault). No-ops for
    # the runner's own int64 tensors.
    tables = block_tables.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    longest = (int(lens.max()) if b else 0) if longest is None else longest
    if longest > tables.shape[1] * cache.shape[2]:
        # The kernel trusts the tables to cover every key: reading past them reads another
        # row's entries, or past the tensor (a crash, not an exception). Refuse instead.
        raise ValueError(f"decode attention: a context of {longest} keys but block tables of "
                         f"{tables.shape[1]} blocks x {cache.shape[2]} slots")
    out = torch.empty_like(q)
    kc, vc = cache[0], cache[1]
    if sinks is not None:  # the kernel reads hq contiguous floats
        sinks = sinks.detach().to(torch.float32).contiguous()
    rc = lib.tierlm_decode_attention(q.data_ptr(), b, hq, cache.shape[3], d, kc.data_ptr(), vc.data_ptr(),
                                     _KV_KINDS[cache.dtype], cache.shape[2], tables.data_ptr(),
                                     tables.shape[1], lens.data_ptr(), window or 0, scale,
                                     sinks.data_ptr() if sinks is not None else None, out.data_ptr(),
                                     torch.get_num_threads())
    return out.to(out_dtype) if rc == 0 else None


# ---------------------------------------------------------------- fp8 -> float32 / bf16

def fp8_widen(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A CPU fp8 tensor as float32 or bf16 (exact either way); None where the kernels are off or
    the dtypes are others."""
    if (not has_avx512() or x.device.type != "cpu" or not is_fp8(x.dtype)
            or dtype not in (torch.float32, torch.bfloat16)):
        return None
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    rc = library().tierlm_fp8_widen(x.data_ptr(), out.data_ptr(), x.numel(), _KV_KINDS[x.dtype],
                                    int(dtype == torch.bfloat16), torch.get_num_threads())
    return out if rc == 0 else None
