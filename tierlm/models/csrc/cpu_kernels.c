/* tierlm CPU kernels, compiled on first use for the host CPU (see tierlm/models/cpu_kernels.py).
 *
 * 1. gemm_bf16w: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for small M (decode batches), with W held
 *    in bfloat16 and all arithmetic in float32. Decode steps stream every weight once per step; with
 *    bf16 weights that is half the bytes of a float32 GEMM, and the result is what a float32 GEMM on
 *    the same (bf16-representable) weights gives, up to summation order.
 * 2. decode_attention: one query token per sequence against its paged K/V (float32, bf16 or fp8
 *    cache), read in place through the block table: no gathered copy, no dtype conversion pass, no
 *    padding mask.
 * 3. fp8_widen: an fp8 cache's gathered blocks widened to float32 or bf16 for the PyTorch
 *    attention paths (prefill chunks over a cached context; decodes the kernel above does not
 *    take, such as bf16 compute), where torch's own conversion is scalar.
 * All need AVX-512 (a build without it reports so, and the callers keep their PyTorch paths).
 *
 * Threads come from the OpenMP runtime PyTorch already loaded (libgomp.so.1), so the kernels share
 * its pool instead of competing with it; callers pass torch.get_num_threads() as `nthreads`.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* ---------------------------------------------------------------- bf16-weight GEMM */
#define NR 32  /* output columns per packed panel: two 16-lane vectors */
#define KC 256 /* K block: a panel slice plus the packed x rows stay in L1 */
#define MR_MAX 14

int tierlm_has_avx512(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Packed layout: panel p (columns [32p, 32p+32)) is K consecutive 64-byte rows; 32-bit lane j of a
 * row holds column 32p+j in its low half and column 32p+16+j in its high half, so one load and one
 * shift / one mask give both float32 vectors. Columns past N are zero. */
void tierlm_pack_bf16(const uint16_t *w, int64_t N, int64_t K, uint32_t *out, int nthreads) {
    int64_t np = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < np; p++)
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < 16; j++) {
                int64_t c0 = p * NR + j, c1 = c0 + 16;
                uint32_t lo = c0 < N ? w[c0 * K + k] : 0, hi = c1 < N ? w[c1 * K + k] : 0;
                out[(p * K + k) * 16 + j] = lo | (hi << 16);
            }
}

#ifdef __AVX512F__
/* MR rows x 32 columns over kc steps of K; xp is the rows' K-slice packed as [kc][MR]. */
#define GEMM_KERNEL(MR)                                                                              \
    static void kern_##MR(const float *xp, const uint32_t *wp, int64_t kc, float *y, int64_t ldy,   \
                          __mmask16 m0, __mmask16 m1, int first, const float *bias) {               \
        __m512 acc0[MR], acc1[MR];                                                                   \
        if (first) {                                                                                 \
            __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();               \
            __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();          \
            for (int m = 0; m < MR; m++) { acc0[m] = b0; acc1[m] = b1; }                             \
        } else {                                                                                     \
            for (int m = 0; m < MR; m++) {                                                           \
                acc0[m] = _mm512_maskz_loadu_ps(m0, y + m * ldy);                                    \
                acc1[m] = _mm512_maskz_loadu_ps(m1, y + m * ldy + 16);                               \
            }                                                                                        \
        }                                                                                            \
        const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);                                      \
        for (int64_t k = 0; k < kc; k++) {                                                           \
            /* The first row block streams the panel from memory: fetch 2 KB ahead (measured ~12%). */ \
            _mm_prefetch((const char *)(wp + (k + 32) * 16), _MM_HINT_T0);                          \
            __m512i v = _mm512_load_si512((const void *)(wp + k * 16));                              \
            __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                               \
            __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(v, hi));                                \
            for (int m = 0; m < MR; m++) {                                                           \
                __m512 xv = _mm512_set1_ps(xp[k * MR + m]);                                          \
                acc0[m] = _mm512_fmadd_ps(xv, w0, acc0[m]);                                          \
                acc1[m] = _mm512_fmadd_ps(xv, w1, acc1[m]);                                          \
            }                                                                                        \
        }                                                                                            \
        for (int m = 0; m < MR; m++) {                                                               \
            _mm512_mask_storeu_ps(y + m * ldy, m0, acc0[m]);                                         \
            _mm512_mask_storeu_ps(y + m * ldy + 16, m1, acc1[m]);                                    \
        }                                                                                            \
    }
GEMM_KERNEL(1) GEMM_KERNEL(2) GEMM_KERNEL(3) GEMM_KERNEL(4) GEMM_KERNEL(5) GEMM_KERNEL(6)
GEMM_KERNEL(7) GEMM_KERNEL(8) GEMM_KERNEL(9) GEMM_KERNEL(10) GEMM_KERNEL(11) GEMM_KERNEL(12)
GEMM_KERNEL(13) GEMM_KERNEL(14)
typedef void (*gemm_kernel)(const float *, const uint32_t *, int64_t, float *, int64_t, __mmask16, __mmask16,
                            int, const float *);
static const gemm_kernel KERNELS[MR_MAX + 1] = {0, kern_1, kern_2, kern_3, kern_4, kern_5, kern_6, kern_7,
                                                kern_8, kern_9, kern_10, kern_11, kern_12, kern_13, kern_14};

static __mmask16 lane_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }
#endif

/* x: [M, K] row-major float32; wp: tierlm_pack_bf16 output; y: [M, N]; xp: scratch of M*K floats.
 * Returns 0, or -1 when M is beyond what the row blocking supports (caller falls back). */
int tierlm_gemm_bf16w(const float *x, int64_t M, int64_t K, const uint32_t *wp, int64_t N, const float *bias,
                      float *y, float *xp, int nthreads) {
#ifdef __AVX512F__
    int64_t nb = (M + MR_MAX - 1) / MR_MAX;
    if (M <= 0 || nb > 16) return -1;
    int64_t mstart[16], mrows[16];
    for (int64_t b = 0, m0 = 0; b < nb; b++) {  /* near-equal row blocks: 32 -> 11, 11, 10 */
        mrows[b] = (M - m0 + (nb - b) - 1) / (nb - b);
        mstart[b] = m0;
        m0 += mrows[b];
    }
    int64_t np = (N + NR - 1) / NR;
#pragma omp parallel num_threads(nthreads)
    {
        /* x packed per K block, per row block, as [kc][rows]: contiguous broadcasts. */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++)
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                int64_t kc = K - k0 < KC ? K - k0 : KC, mr = mrows[b];
                float *dst = xp + k0 * M + mstart[b] * kc;
                for (int64_t k = 0; k < kc; k++)
                    for (int64_t m = 0; m < mr; m++) dst[k * mr + m] = x[(mstart[b] + m) * K + k0 + k];
            }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < np; p++) {
            int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
            __mmask16 m0 = lane_mask(ncols), m1 = lane_mask(ncols - 16);
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                int64_t kc = K - k0 < KC ? K - k0 : KC;
                for (int64_t b = 0; b < nb; b++)
                    KERNELS[mrows[b]](xp + k0 * M + mstart[b] * kc, wp + (p * K + k0) * 16, kc,
                                      y + mstart[b] * N + p * NR, N, m0, m1, k0 == 0, bias ? bias + p * NR : 0);
            }
        }
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)wp; (void)N; (void)bias; (void)y; (void)xp; (void)nthreads;
    return -1;
#endif
}

/* ---------------------------------------------------------------- paged decode attention */
#ifdef __AVX512F__
#define ACHUNK 16 /* keys per step of the AVX-512 path: one vector of scores per query head */

/* exp of x <= 0 (scores minus their max), 16 at a time: Cody-Waite reduction to r in
 * [-ln2/2, ln2/2], degree-6 polynomial, scaled by 2^n; relative error ~2e-7 (float32 rounding). */
static inline __m512 exp512_nonpos(__m512 x) {
    /* -87 first: MAXPS returns its second operand where one is NaN, so a NaN score (or inf - inf)
     * stays NaN, as in PyTorch's softmax; the other order turned it into a weight of ~1e-38 */
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Storage kinds of the K/V cache, as cpu_kernels.py passes them. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_E4M3 = 2, KV_E5M2 = 3 };

/* 16 cached values from element `idx` on, as float32. fp8 goes through float16, which both fp8
 * formats embed exactly: e5m2 is a float16's top byte; e4m3 (bias 7) placed in a float16's
 * sign, exponent and top mantissa bits (bias 15) reads 2^-8 of its value, subnormals included
 * (VCVTPH2PS converts float16 subnormals exactly), so one multiply by 256 restores it. The cache
 * never holds NaN (writes go through nan_to_num), so e4m3's NaN code needs no case. */
static inline __m512 load16(const void *base, int kind, int64_t idx) {
    if (kind == KV_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (kind == KV_E4M3 || kind == KV_E5M2) {
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)base + idx)));
        if (kind == KV_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
        __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
        __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
        return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.0f));
    }
    return _mm512_loadu_ps((const float *)base + idx);
}

/* r[t] lane i = M[t][i]  ->  r[i] lane t = M[t][i] (16x16 float transpose in registers). */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) {
        r[4 * k] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
        r[4 * k + 1] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
        r[4 * k + 2] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
        r[4 * k + 3] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        t[k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);
        t[4 + k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD);
        t[8 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        t[12 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xDD);
        r[4 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xDD);
    }
}

#define HG 8 /* query heads per register group */

/* Walks a block table key by key without a division per key. */
struct cursor {
    int64_t block, offset;
};

static inline void key_rows(struct cursor *cur, int64_t n, const int64_t *table, int64_t block_size, int64_t hkv,
                            int64_t h, int64_t d, int64_t *rows) {
    for (int64_t t = 0; t < n; t++) {
        rows[t] = ((table[cur->block] * block_size + cur->offset) * hkv + h) * d;
        if (++cur->offset == block_size) {
            cur->offset = 0;
            cur->block++;
        }
    }
}

/* One (sequence, KV head) task for head_dim % 16 == 0, d <= 256 and at most 16 query heads per
 * KV head, in two passes over the keys. Pass 1: K is transposed in registers 16 keys at a time,
 * so each query head's 16 scores are one vector of FMAs; scores go to `sc` and a running vector
 * max. Pass 2: exp, a running vector sum, and the V sum with 8 heads' accumulators in registers.
 * Horizontal reductions happen once per head, not once per key block: about 25% faster here than
 * an online softmax with one dot product (and one horizontal sum) per key and head. */
static void attend_avx512(const float *qs, float *os, int64_t g, int64_t d, const void *kc, const void *vc,
                          int kind, int64_t block_size, const int64_t *table, int64_t hkv, int64_t h,
                          int64_t start, int64_t len, float scale, const float *sinks, float *sc) {
    int64_t nv = d / 16, ng = (g + HG - 1) / HG, nk = len - start, ldsc = (nk + 15) / 16 * 16;
    float kt[256 * ACHUNK] __attribute__((aligned(64)));    /* [d][16 keys] */
    float q[2 * HG * 256] __attribute__((aligned(64)));     /* heads padded to a group with zeros */
    float acc[2 * HG * 256] __attribute__((aligned(64)));
    __m512 vmax[2 * HG], vsum[2 * HG];
    memset(q, 0, (size_t)(ng * HG * d) * sizeof(float));
    memcpy(q, qs, (size_t)(g * d) * sizeof(float));
    memset(acc, 0, (size_t)(ng * HG * d) * sizeof(float));
    for (int64_t j = 0; j < ng * HG; j++) {
        vmax[j] = _mm512_set1_ps(-INFINITY);
        vsum[j] = _mm512_setzero_ps();
    }
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    struct cursor cur = {start / block_size, start % block_size};
    for (int64_t t0 = 0; t0 < nk; t0 += ACHUNK) {
        int64_t n = nk - t0 < ACHUNK ? nk - t0 : ACHUNK;
        __mmask16 live = (__mmask16)((1u << n) - 1);
        int64_t rows[ACHUNK];
        key_rows(&cur, n, table, block_size, hkv, h, d, rows);
        for (int64_t c = 0; c < nv; c++) {
            __m512 r[16];
            for (int64_t t = 0; t < ACHUNK; t++) r[t] = t < n ? load16(kc, kind, rows[t] + c * 16) : _mm512_setzero_ps();
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_store_ps(kt + (c * 16 + i) * ACHUNK, r[i]);
        }
        for (int64_t jb = 0; jb < ng * HG; jb += HG) {
            __m512 sv[HG];
            for (int jj = 0; jj < HG; jj++) sv[jj] = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i++) {
                __m512 k = _mm512_load_ps(kt + i * ACHUNK);
                for (int jj = 0; jj < HG; jj++) sv[jj] = _mm512_fmadd_ps(_mm512_set1_ps(q[(jb + jj) * d + i]), k, sv[jj]);
            }
            for (int jj = 0; jj < HG && jb + jj < g; jj++) {
                __m512 x = _mm512_mask_mul_ps(ninf, live, sv[jj], vscale);
                vmax[jb + jj] = _mm512_max_ps(vmax[jb + jj], x);
                _mm512_storeu_ps(sc + (jb + jj) * ldsc + t0, x);
            }
        }
    }
    __m512 m[2 * HG];
    float sink_max[2 * HG];
    for (int64_t j = 0; j < g; j++) {
        float mj = _mm512_reduce_max_ps(vmax[j]);
        /* a sink (gpt-oss) joins the softmax as one more logit without a value: it takes part in
         * the max and in the sum below, and adds nothing to the weighted values */
        if (sinks != NULL && sinks[j] > mj) mj = sinks[j]; /* a NaN max stays NaN */
        sink_max[j] = mj;
        m[j] = _mm512_set1_ps(mj);
    }
    cur = (struct cursor){start / block_size, start % block_size};
    for (int64_t t0 = 0; t0 < nk; t0 += ACHUNK) {
        int64_t n = nk - t0 < ACHUNK ? nk - t0 : ACHUNK;
        __mmask16 live = (__mmask16)((1u << n) - 1);
        float pr[2 * HG][ACHUNK] __attribute__((aligned(64)));
        for (int64_t j = 0; j < ng * HG; j++) {
            __m512 p = j < g ? _mm512_maskz_mov_ps(live, exp512_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sc + j * ldsc + t0), m[j])))
                             : _mm512_setzero_ps();
            vsum[j] = _mm512_add_ps(vsum[j], p);
            _mm512_store_ps(pr[j], p);
        }
        int64_t rows[ACHUNK];
        key_rows(&cur, n, table, block_size, hkv, h, d, rows);
        for (int64_t c = 0; c < nv; c++)
            for (int64_t jb = 0; jb < ng * HG; jb += HG) {
                __m512 a[HG];
                for (int jj = 0; jj < HG; jj++) a[jj] = _mm512_load_ps(acc + (jb + jj) * d + c * 16);
                for (int64_t t = 0; t < n; t++) {
                    __m512 v = load16(vc, kind, rows[t] + c * 16);
                    for (int jj = 0; jj < HG; jj++) a[jj] = _mm512_fmadd_ps(_mm512_set1_ps(pr[jb + jj][t]), v, a[jj]);
                }
                for (int jj = 0; jj < HG; jj++) _mm512_store_ps(acc + (jb + jj) * d + c * 16, a[jj]);
            }
    }
    for (int64_t j = 0; j < g; j++) {
        float total = _mm512_reduce_add_ps(vsum[j]);
        if (sinks != NULL) total += expf(sinks[j] - sink_max[j]);
        /* a NaN total (a NaN sink, or +inf: inf - inf) makes the head NaN, as PyTorch's softmax
         * does, where 0 would hide it behind an all-zero output */
        __m512 inv = _mm512_set1_ps(total > 0.0f ? 1.0f / total : total == total ? 0.0f : NAN);
        for (int64_t c = 0; c < nv; c++)
            _mm512_storeu_ps(os + j * d + c * 16, _mm512_mul_ps(_mm512_load_ps(acc + j * d + c * 16), inv));
    }
}
#endif

/* n fp8 values (KV_E4M3 or KV_E5M2) -> float32, or bf16 with `to_bf16` (the float32's top half:
 * exact, as bf16 holds every fp8 value). Returns 0, or -1 without AVX-512 (dst not written). */
static inline void store16(void *dst, int to_bf16, int64_t at, __m512 v, int64_t n) {
    if (to_bf16) { /* AVX-512F only: a masked 16-bit store would need AVX-512BW */
        __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
        if (n == 16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + at), h);
        } else {
            uint16_t tmp[16];
            _mm256_storeu_si256((__m256i *)tmp, h);
            memcpy((uint16_t *)dst + at, tmp, (size_t)n * sizeof(uint16_t));
        }
    } else {
        _mm512_mask_storeu_ps((float *)dst + at, lane_mask(n), v);
    }
}

int tierlm_fp8_widen(const uint8_t *src, void *dst, int64_t n, int kind, int to_bf16, int nthreads) {
#ifdef __AVX512F__
    if (kind != KV_E4M3 && kind != KV_E5M2) return -1;
    int64_t nv = n / 16;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < nv; i++) store16(dst, to_bf16, i * 16, load16(src, kind, i * 16), 16);
    if (n > nv * 16) {
        uint8_t tail[16] = {0};
        memcpy(tail, src + nv * 16, (size_t)(n - nv * 16));
        store16(dst, to_bf16, nv * 16, load16(tail, kind, 0), n - nv * 16);
    }
    return 0;
#else
    (void)src; (void)dst; (void)n; (void)kind; (void)to_bf16; (void)nthreads;
    return -1;
#endif
}

/* q: [nd, hq, d] float32; k/v cache: [num_blocks, block_size, hkv, d] of `kind` (KV_F32, KV_BF16,
 * KV_E4M3 or KV_E5M2);
 * tables: [nd, max_blocks] int64; lens: [nd] keys per sequence incl. the new one;
 * window > 0 keeps only the last `window` keys. sinks: NULL, or [hq] float32 logits that join each
 * query head's softmax without a value (gpt-oss). out: [nd, hq, d] float32.
 * Returns 0, or -1 (out is then not valid) where this build has no AVX-512, the shape is off the
 * vector path (head_dim % 16 != 0 or > 256, more than 16 query heads per KV head) or scratch
 * memory ran out: the caller then uses its PyTorch path. */
int tierlm_decode_attention(const float *q, int64_t nd, int64_t hq, int64_t hkv, int64_t d, const void *kc,
                            const void *vc, int kind, int64_t block_size, const int64_t *tables,
                            int64_t max_blocks, const int64_t *lens, int64_t window, float scale,
                            const float *sinks, float *out, int nthreads) {
#ifdef __AVX512F__
    int64_t g = hq / hkv;
    if (hkv <= 0 || hq % hkv != 0 || d % 16 != 0 || d > 256 || g > 16) return -1;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t task = 0; task < nd * hkv; task++) {
        int64_t s = task / hkv, h = task % hkv;
        int64_t len = lens[s], start = window > 0 && len > window ? len - window : 0;
        /* scores of the group's heads over all keys: at most 16 x max_model_len floats */
        float *sc = malloc((size_t)(g * ((len - start + 15) / 16 * 16)) * sizeof(float));
        if (sc == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        attend_avx512(q + (s * hq + h * g) * d, out + (s * hq + h * g) * d, g, d, kc, vc, kind, block_size,
                      tables + s * max_blocks, hkv, h, start, len, scale, sinks ? sinks + h * g : NULL, sc);
        free(sc);
    }
    return failed ? -1 : 0;
#else
    (void)q; (void)nd; (void)hq; (void)hkv; (void)d; (void)kc; (void)vc; (void)kind; (void)block_size;
    (void)tables; (void)max_blocks; (void)lens; (void)window; (void)scale; (void)sinks; (void)out; (void)nthreads;
    return -1;
#endif
}
