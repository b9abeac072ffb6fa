/* Linears on GGUF block-quantized weights kept in their low-bit form (kernels/gguf_blocks.py
 * repacks the file's blocks into the layout below, builds and loads this file, and holds the
 * torch references it is tested against).
 *
 * The layout ("qb32"): a weight [N, K] with K a multiple of 32, in blocks of 32 consecutive
 * inputs of one output row; every value is w = d * u + c with u an unsigned code and (d, c) the
 * scale and offset of its group of `group` inputs (32, or 16 for Q6_K):
 *   - 4-bit codes (Q4_0, Q4_1, Q4_K): qs [N, K/32, 16] bytes, byte j of a block holding u of
 *     input j in its low nibble and of input j + 16 in its high nibble;
 *   - 5-, 6- and 8-bit codes (Q5_0, Q5_1, Q5_K, Q6_K; Q8_0): qs [N, K/32, 32], one code a
 *     byte (Q8_0: u = q + 128);
 *   - d [N, K/group] and c [N, K/group], float16 (scale_bytes 2) where every value is exact in
 *     it, else float32 (4): the K-quants' sub-block scales d * sc are exact only in float32.
 * gguf_blocks.py maps each file type onto this and docs/quantization.md lists the mappings.
 *
 * The product: each row of x is quantized per block of 32 (scale a = max|x| / L, codes
 * round-half-even(x / a); L = 127 for int8 inputs, 127 * 2^14 for "float" inputs, see
 * quantize_x), so a group's contribution to out is
 *   d * a * sum(u * q) + c * (a * sum(q)),
 * the sum over products of unsigned weight bytes and signed input bytes (a 22-bit code as three
 * bytes): VPDPBUSD on AVX-512 VNNI, VPMADDUBSW on AVX2, a plain C loop elsewhere. Steps of many
 * rows (prefill) take the GEMM at the end of the file, on x as it is.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_VNNI512 1
#else
#define HAVE_VNNI512 0
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

int qb32_has_vnni(void) { return HAVE_VNNI512; }
int qb32_has_avx2(void) { return HAVE_AVX2; }
int qb32_has_float(void) { return 1; } /* 22-bit inputs: every build, portable at worst */

/* A qb32 weight as one pointer (gguf_blocks.py's QB32Desc; cpu_native.c's whole decoder layer
 * calls qb32_linear_desc with it through its decoder_layer_t.qlinear). */
typedef struct {
    const uint8_t *qs;
    const void *d, *c;   /* float16 or float32, [N, K / group] */
    int64_t N, K, bits;  /* bits: 4 (nibbles), 5, 6 or 8 (a byte each) */
    int64_t path;        /* qb32_linear's (low bits), | QB32_GEMM16: the GEMM's inputs */
    int64_t group;       /* inputs per (d, c): 32 or 16 (byte codes only) */
    int64_t scale_bytes; /* 2: float16 d and c; 4: float32 */
} qb32_t;

/* In qb32_t.path, beside the few-row path: the many-row GEMM quantizes x to 16 bits
 * (qb32_gemm16) instead of taking it as it is. */
#define QB32_GEMM16 64

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Scale or offset i of a row's d or c (float32 where f32, else float16). */
static inline float scale_at(const void *p, int f32, int64_t i) {
    return f32 ? ((const float *)p)[i] : half_to_float(((const uint16_t *)p)[i]);
}

/* -- few rows (decode): x quantized per block, integer dots ---------------------------------- */

/* The input codes. Each block of 32 inputs of a row of x gets a scale a = max|x| / L and codes
 * q = round-half-even(x / a) clamped to [-L, L], with L = 127 (int8 inputs, as the Q8 formats
 * intend) or L = LEVELS22 = 127 * 2^14 ("float" inputs: 21 bits and a sign a block, so each
 * input moves by at most a / 2 = max|x| * 2^-22, a few of float32's own units in the last place).
 * A 22-bit code is held as three bytes, q = h * 2^14 + m * 2^7 + l with h in [-127, 127] and
 * m, l in [0, 127], so every path takes its dots a byte at a time:
 *   sum(u * q) = ((sum(u * h) * 2^7) + sum(u * m)) * 2^7 + sum(u * l).
 * A group's contribution to out is then d * a * sum(u * q) + c * (a * sum(q)). */
#define LEVELS22 2080768

/* How a path takes a step's codes: `parts` bytes per input, in one of two orders. */
typedef struct {
    int parts;            /* 1: int8 codes; 3: 22-bit codes, three bytes each */
    int kind;             /* the weight's layout: KIND_NIB, KIND_BYTE or KIND_BYTE16 */
    int64_t M, K, nb, ng; /* rows, inputs, blocks of 32, groups */
    /* natural order (AVX2 and portable paths): xn [M][nb][parts][32], a [M][nb] */
    int8_t *xn;
    float *a;
    /* the VNNI path's order, per step of 4 blocks (4-bit codes) or 2 (byte codes): each part's
     * bytes as the weight's bytes line up (4-bit: inputs 0-15 of each of the 4 blocks, then
     * inputs 16-31 of each; byte codes: as they come), xs [M][steps][parts][64 * nv]; as
     * [M][steps][16] each int32 lane's block scale */
    int8_t *xs;
    float *as;
    int64_t steps, chunks; /* chunks: whole runs of 16 groups */
    float *s;              /* [M][chunks * 16]: a * sum(q) per group, zero past ng */
} xq_t;

enum { KIND_NIB = 0, KIND_BYTE = 1, KIND_BYTE16 = 2 };

static int kind_of(const qb32_t *w) {
    return w->bits == 4 ? KIND_NIB : (w->group == 16 ? KIND_BYTE16 : KIND_BYTE);
}

/* Block xb's codes q[32] for L levels; returns the block's scale a. */
static float quantize_block(const float *xb, float levels, int32_t *q) {
#if defined(__AVX512F__)
    __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    float a = amax / levels, inv = a > 0.0f ? 1.0f / a : 0.0f;
    __m512 vi = _mm512_set1_ps(inv), hi = _mm512_set1_ps(levels), lo = _mm512_set1_ps(-levels);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(x0, vi), rn);
    __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(x1, vi), rn);
    _mm512_storeu_si512(q, _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(r0, lo), hi)));
    _mm512_storeu_si512(q + 16, _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(r1, lo), hi)));
    return a;
#else
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
    float a = amax / levels, inv = a > 0.0f ? 1.0f / a : 0.0f;
    for (int i = 0; i < 32; i++) {
        float v = nearbyintf(xb[i] * inv);
        q[i] = (int32_t)(v > levels ? levels : (v < -levels ? -levels : v));
    }
    return a;
#endif
}

/* Sixteen codes q[0..16) as part p of `parts` bytes each (parts 1: the code itself), at dst. */
static inline void store_part16(const int32_t *q, int parts, int p, int8_t *dst) {
#if defined(__AVX512F__)
    __m512i v = _mm512_loadu_si512(q);
    if (parts == 3)
        v = p == 0 ? _mm512_srai_epi32(v, 14)
                   : _mm512_and_si512(p == 1 ? _mm512_srli_epi32(v, 7) : v, _mm512_set1_epi32(127));
    _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(v));
#else
    for (int i = 0; i < 16; i++) {
        int32_t v = q[i];
        dst[i] = (int8_t)(parts == 1 ? v : (p == 0 ? v >> 14 : (p == 1 ? (v >> 7) & 127 : v & 127)));
    }
#endif
}

/* x's rows quantized for `w` and a path: the VNNI order (stepped) or the natural one. */
static void quantize_x(const float *x, int64_t ldx, int64_t M, const qb32_t *w, int parts,
                       int stepped, xq_t *X) {
    int64_t K = w->K, nb = K / 32;
    int kind = kind_of(w), bps = kind == KIND_NIB ? 4 : 2, nv = kind == KIND_NIB ? 2 : 1;
    int64_t ng = kind == KIND_BYTE16 ? 2 * nb : nb, steps = (nb + bps - 1) / bps;
    int64_t chunks = (ng + 15) / 16;
    size_t rec = (size_t)parts * 64 * nv; /* one step's bytes in the VNNI order */
    memset(X, 0, sizeof *X);
    X->parts = parts, X->kind = kind, X->M = M, X->K = K, X->nb = nb, X->ng = ng;
    X->steps = steps, X->chunks = chunks;
    X->s = malloc(sizeof(float) * (size_t)(M * chunks * 16));
    if (stepped) {
        X->xs = aligned_alloc(64, (size_t)M * steps * rec);
        X->as = aligned_alloc(64, sizeof(float) * (size_t)(M * steps * 16));
    } else {
        X->xn = malloc((size_t)(M * nb * parts * 32));
        X->a = malloc(sizeof(float) * (size_t)(M * nb));
    }
    float levels = parts == 1 ? 127.0f : (float)LEVELS22;
    for (int64_t m = 0; m < M; m++) {
        float *sm = X->s + m * chunks * 16;
        for (int64_t g = ng; g < chunks * 16; g++) sm[g] = 0.0f;
        if (stepped && nb % bps) { /* the last step's missing blocks: zero codes and scales */
            memset(X->xs + ((size_t)m * steps + steps - 1) * rec, 0, rec);
            memset(X->as + (m * steps + steps - 1) * 16, 0, sizeof(float) * 16);
        }
        for (int64_t b = 0; b < nb; b++) {
            int32_t q[32];
            float a = quantize_block(x + m * ldx + b * 32, levels, q);
            int32_t s0 = 0, s1 = 0;
            for (int i = 0; i < 16; i++) s0 += q[i];
            for (int i = 16; i < 32; i++) s1 += q[i];
            if (kind == KIND_BYTE16) {
                sm[2 * b] = a * (float)s0;
                sm[2 * b + 1] = a * (float)s1;
            } else {
                sm[b] = a * (float)(s0 + s1);
            }
            if (!stepped) {
                X->a[m * nb + b] = a;
                int8_t *dst = X->xn + (m * nb + b) * parts * 32;
                for (int p = 0; p < parts; p++) {
                    store_part16(q, parts, p, dst + p * 32);
                    store_part16(q + 16, parts, p, dst + p * 32 + 16);
                }
                continue;
            }
            /* 4-bit codes: inputs 0-15 of the step's block j at j * 16, inputs 16-31 at
             * 64 + j * 16; byte codes as they come */
            int64_t step = b / bps, j = b % bps;
            int64_t at0 = kind == KIND_NIB ? j * 16 : j * 32;
            int64_t at1 = kind == KIND_NIB ? 64 + j * 16 : j * 32 + 16;
            int8_t *dst = X->xs + ((size_t)m * steps + step) * rec;
            for (int p = 0; p < parts; p++) {
                store_part16(q, parts, p, dst + p * 64 * nv + at0);
                store_part16(q + 16, parts, p, dst + p * 64 * nv + at1);
            }
            float *as = X->as + (m * steps + step) * 16;
            for (int t = 0; t < 16; t++)
                if (t / (16 / bps) == j) as[t] = a;
        }
    }
}

static void free_x(xq_t *X) {
    free(X->xn);
    free(X->a);
    free(X->xs);
    free(X->as);
    free(X->s);
}

/* The dot of block b's codes (at u) with x's codes (natural order, at xb): dot[0] over the
 * block (groups of 32) or its first 16 inputs, dot[1] over its second 16 inputs (groups of
 * 16). int64: a 22-bit code times an 8-bit one, 32 of them, passes int32. */
static inline __attribute__((always_inline)) void block_dots(const uint8_t *u, int bits,
                                                              int group, const int8_t *xb,
                                                              int parts, int64_t dot[2]) {
    int64_t lo = 0, hi = 0;
    for (int j = 0; j < 32; j++) { /* one loop of 32 trips: the compiler vectorizes it */
        int32_t code = bits == 4 ? (j < 16 ? u[j] & 15 : u[j - 16] >> 4) : u[j];
        int32_t q = parts == 1 ? xb[j] : xb[j] * 16384 + xb[32 + j] * 128 + xb[64 + j];
        int64_t t = (int64_t)code * q;
        if (group == 16 && j >= 16)
            hi += t;
        else
            lo += t;
    }
    dot[0] = lo;
    dot[1] = hi;
}

/* out[m] for the rows m < mt of one output row: the portable path. */
static inline __attribute__((always_inline)) void row_scalar(const uint8_t *qs, const void *d,
                                                              const void *c, int bits, int group,
                                                              int f32, const xq_t *X, int64_t m0,
                                                              int mt, float *acc) {
    int64_t nb = X->nb, ng = X->ng, bb = bits == 4 ? 16 : 32;
    int parts = X->parts;
    for (int m = 0; m < mt; m++) {
        const int8_t *xm = X->xn + (m0 + m) * nb * parts * 32;
        const float *am = X->a + (m0 + m) * nb, *sm = X->s + (m0 + m) * X->chunks * 16;
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int64_t dot[2];
            block_dots(qs + b * bb, bits, group, xm + b * parts * 32, parts, dot);
            float part = group == 16 ? scale_at(d, f32, 2 * b) * (float)dot[0] +
                                           scale_at(d, f32, 2 * b + 1) * (float)dot[1]
                                     : scale_at(d, f32, b) * (float)dot[0];
            total += am[b] * part;
        }
        for (int64_t g = 0; g < ng; g++) total += scale_at(c, f32, g) * sm[g];
        acc[m] = total;
    }
}

#if HAVE_AVX2 || HAVE_VNNI512
/* The SIMD paths' scale read: F16C's conversion for float16. */
static inline float scale_fast(const void *p, int f32, int64_t i) {
    return f32 ? ((const float *)p)[i] : _cvtsh_ss(((const uint16_t *)p)[i]);
}
#endif

#if HAVE_AVX2
/* The same with AVX2, one block a step: VPMADDUBSW (unsigned codes of 6 bits or fewer times
 * signed input bytes; for 8-bit codes, |u - 128| times the input with u - 128's sign, so no pair
 * sum saturates, and the 128 * d moves to the offsets) and VPMADDWD to int32 for each part of
 * the codes, the parts joined by shifts, then a float FMA by the group's two scales. */
static inline __attribute__((always_inline)) void row_avx2(const uint8_t *qs, const void *d,
                                                            const void *c, int bits, int group,
                                                            int f32, const xq_t *X, int64_t m0,
                                                            int mt, float *acc) {
    int64_t nb = X->nb, ng = X->ng;
    int parts = X->parts;
    __m256 sum[4];
    for (int m = 0; m < mt; m++) sum[m] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++) {
        __m256i u;
        if (bits == 4) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(qs + b * 16));
            __m128i lo = _mm_and_si128(raw, low);
            __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
            u = _mm256_set_m128i(hi, lo);
        } else {
            u = _mm256_loadu_si256((const __m256i *)(qs + b * 32));
            if (bits == 8) u = _mm256_xor_si256(u, flip);
        }
        /* lanes 0-3 of the int32 dot hold inputs 0-15, lanes 4-7 inputs 16-31 */
        float w0 = scale_fast(d, f32, group == 16 ? 2 * b : b);
        float w1 = group == 16 ? scale_fast(d, f32, 2 * b + 1) : w0;
        for (int m = 0; m < mt; m++) {
            const int8_t *xb = X->xn + ((m0 + m) * nb + b) * parts * 32;
            __m256i dot = _mm256_setzero_si256();
            for (int p = 0; p < parts; p++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(xb + p * 32));
                __m256i pr = bits == 8 ? _mm256_maddubs_epi16(_mm256_abs_epi8(u),
                                                              _mm256_sign_epi8(x, u))
                                       : _mm256_maddubs_epi16(u, x);
                dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 7), _mm256_madd_epi16(pr, ones));
            }
            float am = X->a[(m0 + m) * nb + b];
            __m256 scale = group == 16
                               ? _mm256_set_m128(_mm_set1_ps(w1 * am), _mm_set1_ps(w0 * am))
                               : _mm256_set1_ps(w0 * am);
            sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, sum[m]);
        }
    }
    for (int m = 0; m < mt; m++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum[m]), _mm256_extractf128_ps(sum[m], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        float total = _mm_cvtss_f32(h);
        /* 8-bit codes summed (u - 128) * q: the offset is c + 128 d (0 for Q8_0's c = -128 d) */
        const float *sm = X->s + (m0 + m) * X->chunks * 16;
        __m256 off = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= ng; g += 8) {
            __m256 cv = f32 ? _mm256_loadu_ps((const float *)c + g)
                            : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)c + g)));
            if (bits == 8) {
                __m256 dv = f32 ? _mm256_loadu_ps((const float *)d + g)
                                : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)d + g)));
                cv = _mm256_fmadd_ps(dv, _mm256_set1_ps(128.0f), cv);
            }
            off = _mm256_fmadd_ps(cv, _mm256_loadu_ps(sm + g), off);
        }
        __m128 o = _mm_add_ps(_mm256_castps256_ps128(off), _mm256_extractf128_ps(off, 1));
        o = _mm_add_ps(o, _mm_movehl_ps(o, o));
        o = _mm_add_ss(o, _mm_movehdup_ps(o));
        total += _mm_cvtss_f32(o);
        for (; g < ng; g++) {
            float cg = scale_fast(c, f32, g);
            if (bits == 8) cg += 128.0f * scale_fast(d, f32, g);
            total += cg * sm[g];
        }
        acc[m] = total;
    }
}
#endif

#if HAVE_VNNI512
/* Sixteen scales from i (masked past n), as float32. */
static inline __m512 scales16(const void *p, int f32, int64_t i, int64_t n) {
    int64_t left = n - i;
    __mmask16 k = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    if (f32) return _mm512_maskz_loadu_ps(k, (const float *)p + i);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i));
}

#define VNNI_AHEAD 16 /* rows ahead that a tile prefetches (its own rows' place, 16 rows on) */

/* R output rows from n0 times rows m0 .. m0 + MT of x, VPDPBUSD on 64 weight bytes a step
 * (four blocks of 4-bit codes, the low and high nibbles each against their input bytes; two
 * blocks of byte codes), each part of the input codes in turn, joined by shifts (int32 lanes
 * of four inputs' products: |sum| <= 4 * 255 * LEVELS22 < 2^31). int32 lane t of a step holds
 * inputs of one group: groups of 32 with 4-bit codes and groups of 16 take a scale per 4
 * lanes, groups of 32 with byte codes one per 8; the row's scales come sixteen groups at a
 * time and are spread over the lanes by a permute. res[r * MT + m]. R, MT, P, kind and f32
 * are constants after inlining. The weight is prefetched VNNI_AHEAD rows ahead: the hardware
 * prefetcher alone left a decode's stream at ~15 GB/s a core, against ~25 with this. */
static inline __attribute__((always_inline)) void vnni_tile(const qb32_t *w, const xq_t *X,
                                                             int64_t m0, int64_t n0, const int R,
                                                             const int MT, const int P,
                                                             const int kind, const int f32,
                                                             float *res) {
    const int nv = kind == KIND_NIB ? 2 : 1, spc = kind == KIND_BYTE ? 8 : 4;
    const int64_t nb = X->nb, ng = X->ng, steps = X->steps;
    const int64_t rowbytes = nb * (kind == KIND_NIB ? 16 : 32), sb = f32 ? 4 : 2;
    const size_t rec = (size_t)P * 64 * nv;
    __m512 acc[R][MT];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i base = _mm512_srli_epi32(lanes, kind == KIND_BYTE ? 3 : 2);
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t ch = 0; ch < X->chunks; ch++) {
        __m512 D[R];
        for (int r = 0; r < R; r++) {
            const char *dr = (const char *)w->d + (n0 + r) * ng * sb;
            _mm_prefetch(dr + (VNNI_AHEAD * ng + ch * 16) * sb, _MM_HINT_T0);
            _mm_prefetch((const char *)w->c + ((n0 + r + VNNI_AHEAD) * ng + ch * 16) * sb,
                         _MM_HINT_T0);
            D[r] = scales16(dr, f32, ch * 16, ng);
        }
        for (int si = 0; si < spc; si++) {
            int64_t step = ch * spc + si;
            if (step >= steps) break;
            __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(si * (kind == KIND_BYTE ? 2 : 4)));
            int64_t left = rowbytes - step * 64;
            __mmask64 km = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
            for (int r = 0; r < R; r++) {
                const uint8_t *q = w->qs + (n0 + r) * rowbytes + step * 64;
                _mm_prefetch((const char *)q + VNNI_AHEAD * rowbytes, _MM_HINT_T0);
                __m512i U = left >= 64 ? _mm512_loadu_si512(q) : _mm512_maskz_loadu_epi8(km, q);
                __m512i lo = U, hi = U;
                if (kind == KIND_NIB) {
                    lo = _mm512_and_si512(U, low);
                    hi = _mm512_and_si512(_mm512_srli_epi16(U, 4), low);
                }
                __m512 Dq = _mm512_permutexvar_ps(idx, D[r]);
                for (int m = 0; m < MT; m++) {
                    const int8_t *xr = X->xs + ((size_t)(m0 + m) * steps + step) * rec;
                    __m512i dot = _mm512_setzero_si512();
                    for (int p = 0; p < P; p++) {
                        if (p) dot = _mm512_slli_epi32(dot, 7);
                        dot = _mm512_dpbusd_epi32(dot, lo, _mm512_load_si512(xr + p * 64 * nv));
                        if (kind == KIND_NIB)
                            dot = _mm512_dpbusd_epi32(dot, hi,
                                                      _mm512_load_si512(xr + p * 64 * nv + 64));
                    }
                    __m512 sc = _mm512_mul_ps(Dq, _mm512_load_ps(X->as + ((m0 + m) * steps + step) * 16));
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[r][m]);
                }
            }
        }
        /* the offsets: c * (a * sum(q)) for the chunk's sixteen groups */
        for (int r = 0; r < R; r++) {
            __m512 C = scales16((const char *)w->c + (n0 + r) * ng * sb, f32, ch * 16, ng);
            for (int m = 0; m < MT; m++)
                acc[r][m] = _mm512_fmadd_ps(
                    C, _mm512_loadu_ps(X->s + (m0 + m) * X->chunks * 16 + ch * 16), acc[r][m]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) res[r * MT + m] = _mm512_reduce_add_ps(acc[r][m]);
}

/* Rows [n0, n0 + nr) (nr <= 8) for every row of x, tiles of up to 4 rows of x: 8 output rows a
 * tile for one row of x, 4 for two, 2 for three or four (the accumulators in registers), one at
 * a time past the last whole tile. */
#define VNNI_ROWS 8
#define VNNI_COPY(NAME, P, KIND, F32)                                                             \
    static void NAME(const qb32_t *w, const xq_t *X, const float *bias, float *out, int64_t ldo, \
                     int64_t n0, int64_t nr) {                                                    \
        float res[VNNI_ROWS * 4];                                                                 \
        for (int64_t m0 = 0; m0 < X->M; m0 += 4) {                                                \
            int mt = X->M - m0 < 4 ? (int)(X->M - m0) : 4;                                        \
            int R = mt == 1 ? 8 : (mt == 2 ? 4 : 2);                                              \
            int64_t n = n0;                                                                       \
            for (; n + R <= n0 + nr; n += R) {                                                    \
                switch (mt) {                                                                     \
                case 1: vnni_tile(w, X, m0, n, 8, 1, P, KIND, F32, res); break;                   \
                case 2: vnni_tile(w, X, m0, n, 4, 2, P, KIND, F32, res); break;                   \
                case 3: vnni_tile(w, X, m0, n, 2, 3, P, KIND, F32, res); break;                   \
                default: vnni_tile(w, X, m0, n, 2, 4, P, KIND, F32, res); break;                  \
                }                                                                                 \
                for (int r = 0; r < R; r++)                                                       \
                    for (int m = 0; m < mt; m++)                                                  \
                        out[(m0 + m) * ldo + n + r] = res[r * mt + m] + (bias ? bias[n + r] : 0.0f); \
            }                                                                                     \
            for (; n < n0 + nr; n++) {                                                            \
                switch (mt) {                                                                     \
                case 1: vnni_tile(w, X, m0, n, 1, 1, P, KIND, F32, res); break;                   \
                case 2: vnni_tile(w, X, m0, n, 1, 2, P, KIND, F32, res); break;                   \
                case 3: vnni_tile(w, X, m0, n, 1, 3, P, KIND, F32, res); break;                   \
                default: vnni_tile(w, X, m0, n, 1, 4, P, KIND, F32, res); break;                  \
                }                                                                                 \
                for (int m = 0; m < mt; m++)                                                      \
                    out[(m0 + m) * ldo + n] = res[m] + (bias ? bias[n] : 0.0f);                   \
            }                                                                                     \
        }                                                                                         \
    }
VNNI_COPY(vnni_p1_nib_f16, 1, KIND_NIB, 0)
VNNI_COPY(vnni_p1_nib_f32, 1, KIND_NIB, 1)
VNNI_COPY(vnni_p1_byte_f16, 1, KIND_BYTE, 0)
VNNI_COPY(vnni_p1_byte_f32, 1, KIND_BYTE, 1)
VNNI_COPY(vnni_p1_b16_f16, 1, KIND_BYTE16, 0)
VNNI_COPY(vnni_p1_b16_f32, 1, KIND_BYTE16, 1)
VNNI_COPY(vnni_p3_nib_f16, 3, KIND_NIB, 0)
VNNI_COPY(vnni_p3_nib_f32, 3, KIND_NIB, 1)
VNNI_COPY(vnni_p3_byte_f16, 3, KIND_BYTE, 0)
VNNI_COPY(vnni_p3_byte_f32, 3, KIND_BYTE, 1)
VNNI_COPY(vnni_p3_b16_f16, 3, KIND_BYTE16, 0)
VNNI_COPY(vnni_p3_b16_f32, 3, KIND_BYTE16, 1)
#undef VNNI_COPY
typedef void (*vnni_rows_t)(const qb32_t *, const xq_t *, const float *, float *, int64_t,
                            int64_t, int64_t);
static const vnni_rows_t VNNI_RUNS[2][3][2] = {
    {{vnni_p1_nib_f16, vnni_p1_nib_f32}, {vnni_p1_byte_f16, vnni_p1_byte_f32},
     {vnni_p1_b16_f16, vnni_p1_b16_f32}},
    {{vnni_p3_nib_f16, vnni_p3_nib_f32}, {vnni_p3_byte_f16, vnni_p3_byte_f32},
     {vnni_p3_b16_f16, vnni_p3_b16_f32}},
};
#endif

/* Output row n for every row of x by the AVX2 or portable path; group and f32 are constants
 * in each copy below, so their branches fold away inside the row functions. */
static inline __attribute__((always_inline)) void one_row(const qb32_t *w, const xq_t *X,
                                                           int use_avx2, const float *bias,
                                                           float *out, int64_t ldo, int64_t n,
                                                           const int group, const int f32) {
    int64_t nb = X->nb, ng = X->ng, sb = f32 ? 4 : 2;
    int bits = (int)w->bits;
    const uint8_t *qn = w->qs + n * nb * (bits == 4 ? 16 : 32);
    const void *dn = (const char *)w->d + n * ng * sb, *cn = (const char *)w->c + n * ng * sb;
    float bn = bias ? bias[n] : 0.0f;
    for (int64_t m0 = 0; m0 < X->M; m0 += 4) {
        int mt = X->M - m0 < 4 ? (int)(X->M - m0) : 4;
        float acc[4];
#if HAVE_AVX2
        if (use_avx2)
            row_avx2(qn, dn, cn, bits, group, f32, X, m0, mt, acc);
        else
#endif
            row_scalar(qn, dn, cn, bits, group, f32, X, m0, mt, acc);
        (void)use_avx2;
        for (int m = 0; m < mt; m++) out[(m0 + m) * ldo + n] = acc[m] + bn;
    }
}

#define ONE_ROW_COPY(NAME, G, F)                                                                  \
    static void NAME(const qb32_t *w, const xq_t *X, int use_avx2, const float *bias, float *out, \
                     int64_t ldo, int64_t n) {                                                    \
        one_row(w, X, use_avx2, bias, out, ldo, n, G, F);                                         \
    }
ONE_ROW_COPY(row_g32_f16, 32, 0)
ONE_ROW_COPY(row_g32_f32, 32, 1)
ONE_ROW_COPY(row_g16_f16, 16, 0)
ONE_ROW_COPY(row_g16_f32, 16, 1)
#undef ONE_ROW_COPY

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) times the weight^T (+ bias), x quantized
 * per block (int8, or 22-bit for "float" inputs). w->path: 0 int8 inputs on the best path this
 * build has (AVX-512 VNNI, else AVX2, else portable), 1 int8 on the portable C loop, 2 int8 on
 * AVX2 (where built), 3 float inputs on the best path, 4 float on the portable loop, 5 float on
 * AVX2. Output rows are split across the OpenMP threads in runs of VNNI_ROWS. */
static void qb32_run(const float *x, int64_t ldx, int64_t M, const qb32_t *w, const float *bias,
                     float *out, int64_t ldo) {
    int64_t K = w->K, N = w->N, path = w->path & (QB32_GEMM16 - 1);
    int parts = path >= 3 ? 3 : 1, how = (int)(path % 3); /* 0 best, 1 portable, 2 AVX2 */
    int use_vnni = HAVE_VNNI512 && how == 0, use_avx2 = HAVE_AVX2 && how != 1;
    xq_t X;
    quantize_x(x, ldx, M, w, parts, use_vnni, &X);
    int parallel = N * M * K > (1 << 16);
#if HAVE_VNNI512
    if (use_vnni) {
        vnni_rows_t run = VNNI_RUNS[parts == 3][X.kind][w->scale_bytes == 4];
        int64_t tiles = (N + VNNI_ROWS - 1) / VNNI_ROWS;
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t n0 = t * VNNI_ROWS;
            run(w, &X, bias, out, ldo, n0, N - n0 < VNNI_ROWS ? N - n0 : VNNI_ROWS);
        }
        free_x(&X);
        return;
    }
#endif
    int f32 = w->scale_bytes == 4;
    void (*row)(const qb32_t *, const xq_t *, int, const float *, float *, int64_t, int64_t) =
        w->group == 16 ? (f32 ? row_g16_f32 : row_g16_f16) : (f32 ? row_g32_f32 : row_g32_f16);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n = 0; n < N; n++) row(w, &X, use_avx2, bias, out, ldo, n);
    free_x(&X);
}

void qb32_linear_desc(const float *x, int64_t ldx, int64_t M, const void *desc,
                      const float *bias, float *out, int64_t ldo) {
    qb32_run(x, ldx, M, (const qb32_t *)desc, bias, out, ldo);
}
/* -- many rows (prefill): a GEMM on the blocks --------------------------------------------- */

/* out[M, N] = x[M, K] times the qb32 weight^T (+ bias) for steps of many rows, x as it is (no
 * int8 rounding): each thread takes GEMM_NB outputs at a time and, per GEMM_KC inputs,
 * dequantizes that tile of blocks once into a float buffer (d * u + c: d * u is exact in
 * float32, so the one rounding is the dequantized reference's own) that every row of x then
 * reuses from cache. The rows of x are transposed once per call (xt [K, MP], MP the rows padded
 * to whole vectors with zeros), so the micro-kernel broadcasts one weight value and multiplies
 * it into two vectors of rows: GEMM_NR weight rows x 2 vectors of x rows in registers (a last
 * lone vector: GEMM_NR1 weight rows x 1). Each output is sum over k in order, one accumulator
 * per output: the dequantized weight's product up to float32 summation order. At 32 rows this
 * runs at ~80% of the core's float32 FMA peak (the micro-kernel itself at the peak; each
 * dequantized value feeds only two FMAs there); why not the few-row kernel's integer dot:
 * docs/quantization.md. */

#define GEMM_NB 48  /* weight rows a thread dequantizes at a time (a multiple of GEMM_NR) */
#define GEMM_KC 128 /* inputs per tile: 4 blocks */
#if defined(__AVX512F__)
#define GEMM_NR 12 /* weight rows per micro-kernel: 24 accumulators of AVX-512's 32 registers */
#define GEMM_NR1 24 /* the same for one vector of x rows (a step's last <= 16 rows) */
#else
#define GEMM_NR 6 /* 12 accumulators of AVX2's 16 */
#define GEMM_NR1 12
#endif
#define GEMM_MC 256 /* rows of x per pass (bounds the transposed copy and the accumulators) */

#if defined(__AVX512F__)
#define GV 16
typedef __m512 gvec;
#define G_LOAD(p) _mm512_loadu_ps(p)
#define G_STORE(p, v) _mm512_storeu_ps((p), (v))
#define G_BCAST(p) _mm512_set1_ps(*(p))
#define G_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define G_ZERO() _mm512_setzero_ps()
#elif defined(__AVX2__) && defined(__FMA__)
#define GV 8
typedef __m256 gvec;
#define G_LOAD(p) _mm256_loadu_ps(p)
#define G_STORE(p, v) _mm256_storeu_ps((p), (v))
#define G_BCAST(p) _mm256_broadcast_ss(p)
#define G_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define G_ZERO() _mm256_setzero_ps()
#else
#define GV 8
typedef float gvec __attribute__((vector_size(32)));
static inline gvec g_load(const float *p) {
    gvec v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline gvec g_bcast(const float *p) {
    float s = *p;
    return (gvec){s, s, s, s, s, s, s, s};
}
#define G_LOAD(p) g_load(p)
#define G_STORE(p, v) memcpy((p), &(v), sizeof(gvec))
#define G_BCAST(p) g_bcast(p)
#define G_FMA(a, b, c) ((a) * (b) + (c))
#define G_ZERO() ((gvec){0})
#endif

/* acc[i, 0..2GV) += sum over k < kc of w[i, k] * xt[k, 0..2GV), for i < NR (first: acc starts
 * at zero, not read); named registers. */
#define GM_DECL(i)                                                                                \
    gvec c##i##0 = first ? G_ZERO() : G_LOAD(acc + i * lda);                                      \
    gvec c##i##1 = first ? G_ZERO() : G_LOAD(acc + i * lda + GV);
#define GM_STEP(i)                                                                                \
    {                                                                                             \
        gvec wb = G_BCAST(w + i * ldw + k);                                                       \
        c##i##0 = G_FMA(wb, x0, c##i##0);                                                         \
        c##i##1 = G_FMA(wb, x1, c##i##1);                                                         \
    }
#define GM_STORE(i)                                                                               \
    G_STORE(acc + i * lda, c##i##0);                                                              \
    G_STORE(acc + i * lda + GV, c##i##1);
#define GM_ROWS1(M) M(0)
#define GM_ROWS2(M) GM_ROWS1(M) M(1)
#define GM_ROWS3(M) GM_ROWS2(M) M(2)
#define GM_ROWS4(M) GM_ROWS3(M) M(3)
#define GM_ROWS5(M) GM_ROWS4(M) M(4)
#define GM_ROWS6(M) GM_ROWS5(M) M(5)
#define GM_ROWS7(M) GM_ROWS6(M) M(6)
#define GM_ROWS8(M) GM_ROWS7(M) M(7)
#define GM_ROWS9(M) GM_ROWS8(M) M(8)
#define GM_ROWS10(M) GM_ROWS9(M) M(9)
#define GM_ROWS11(M) GM_ROWS10(M) M(10)
#define GM_ROWS12(M) GM_ROWS11(M) M(11)
#define GEMM_MICRO(n)                                                                             \
    static void gemm_micro_##n(const float *w, int64_t ldw, const float *xt, int64_t ldx,        \
                               int64_t kc, float *acc, int64_t lda, int first) {                  \
        GM_ROWS##n(GM_DECL) for (int64_t k = 0; k < kc; k++) {                                    \
            gvec x0 = G_LOAD(xt + k * ldx), x1 = G_LOAD(xt + k * ldx + GV);                       \
            GM_ROWS##n(GM_STEP)                                                                   \
        }                                                                                         \
        GM_ROWS##n(GM_STORE)                                                                      \
    }
GEMM_MICRO(1)
GEMM_MICRO(2)
GEMM_MICRO(3)
GEMM_MICRO(4)
GEMM_MICRO(5)
GEMM_MICRO(6)
typedef void (*gemm_micro_t)(const float *, int64_t, const float *, int64_t, int64_t, float *,
                             int64_t, int);
#if GEMM_NR == 12
GEMM_MICRO(7)
GEMM_MICRO(8)
GEMM_MICRO(9)
GEMM_MICRO(10)
GEMM_MICRO(11)
GEMM_MICRO(12)
static const gemm_micro_t GEMM_MICROS[GEMM_NR + 1] = {
    NULL,         gemm_micro_1, gemm_micro_2, gemm_micro_3,  gemm_micro_4,  gemm_micro_5,
    gemm_micro_6, gemm_micro_7, gemm_micro_8, gemm_micro_9, gemm_micro_10, gemm_micro_11,
    gemm_micro_12,
};
#else
static const gemm_micro_t GEMM_MICROS[GEMM_NR + 1] = {
    NULL, gemm_micro_1, gemm_micro_2, gemm_micro_3, gemm_micro_4, gemm_micro_5, gemm_micro_6,
};
#endif

/* The same for one vector of x rows (GV): GEMM_NR1 weight rows, so that a step's last rows past
 * whole pairs of vectors (a batch of 16 decodes, 48, a prefill's tail) are not padded to two
 * vectors of zeros. */
#define GM1_DECL(i) gvec c##i##0 = first ? G_ZERO() : G_LOAD(acc + i * lda);
#define GM1_STEP(i) c##i##0 = G_FMA(G_BCAST(w + i * ldw + k), x0, c##i##0);
#define GM1_STORE(i) G_STORE(acc + i * lda, c##i##0);
#define GM_ROWS13(M) GM_ROWS12(M) M(12)
#define GM_ROWS14(M) GM_ROWS13(M) M(13)
#define GM_ROWS15(M) GM_ROWS14(M) M(14)
#define GM_ROWS16(M) GM_ROWS15(M) M(15)
#define GM_ROWS17(M) GM_ROWS16(M) M(16)
#define GM_ROWS18(M) GM_ROWS17(M) M(17)
#define GM_ROWS19(M) GM_ROWS18(M) M(18)
#define GM_ROWS20(M) GM_ROWS19(M) M(19)
#define GM_ROWS21(M) GM_ROWS20(M) M(20)
#define GM_ROWS22(M) GM_ROWS21(M) M(21)
#define GM_ROWS23(M) GM_ROWS22(M) M(22)
#define GM_ROWS24(M) GM_ROWS23(M) M(23)
#define GEMM_MICRO1(n)                                                                            \
    static void gemm_micro1_##n(const float *w, int64_t ldw, const float *xt, int64_t ldx,       \
                                int64_t kc, float *acc, int64_t lda, int first) {                 \
        GM_ROWS##n(GM1_DECL) for (int64_t k = 0; k < kc; k++) {                                   \
            gvec x0 = G_LOAD(xt + k * ldx);                                                       \
            GM_ROWS##n(GM1_STEP)                                                                  \
        }                                                                                         \
        GM_ROWS##n(GM1_STORE)                                                                     \
    }
GEMM_MICRO1(1)
GEMM_MICRO1(2)
GEMM_MICRO1(3)
GEMM_MICRO1(4)
GEMM_MICRO1(5)
GEMM_MICRO1(6)
GEMM_MICRO1(7)
GEMM_MICRO1(8)
GEMM_MICRO1(9)
GEMM_MICRO1(10)
GEMM_MICRO1(11)
GEMM_MICRO1(12)
#if GEMM_NR1 == 24
GEMM_MICRO1(13)
GEMM_MICRO1(14)
GEMM_MICRO1(15)
GEMM_MICRO1(16)
GEMM_MICRO1(17)
GEMM_MICRO1(18)
GEMM_MICRO1(19)
GEMM_MICRO1(20)
GEMM_MICRO1(21)
GEMM_MICRO1(22)
GEMM_MICRO1(23)
GEMM_MICRO1(24)
static const gemm_micro_t GEMM_MICROS1[GEMM_NR1 + 1] = {
    NULL,            gemm_micro1_1,  gemm_micro1_2,  gemm_micro1_3,  gemm_micro1_4,
    gemm_micro1_5,   gemm_micro1_6,  gemm_micro1_7,  gemm_micro1_8,  gemm_micro1_9,
    gemm_micro1_10,  gemm_micro1_11, gemm_micro1_12, gemm_micro1_13, gemm_micro1_14,
    gemm_micro1_15,  gemm_micro1_16, gemm_micro1_17, gemm_micro1_18, gemm_micro1_19,
    gemm_micro1_20,  gemm_micro1_21, gemm_micro1_22, gemm_micro1_23, gemm_micro1_24,
};
#else
static const gemm_micro_t GEMM_MICROS1[GEMM_NR1 + 1] = {
    NULL,           gemm_micro1_1, gemm_micro1_2, gemm_micro1_3,  gemm_micro1_4,  gemm_micro1_5,
    gemm_micro1_6,  gemm_micro1_7, gemm_micro1_8, gemm_micro1_9, gemm_micro1_10, gemm_micro1_11,
    gemm_micro1_12,
};
#endif

/* Blocks [b0, b0 + nblk) of 32 inputs of output row n as floats into dst: d * u + c with one
 * rounding (a fused multiply-add), as `dequantize` rounds its float64 value once. BITS4 (4-bit
 * nibbles, else a byte a code), G16 (16 inputs per (d, c), else 32) and F32 (float32 scales, else
 * float16) are constants after inlining, so each layout gets its own branch-free loop. With
 * AVX-512 one VPMOVZXBD of a block's 16 nibble bytes gives both halves' codes (AND 15, >> 4), and
 * the scales are converted by F16C (a software conversion here once took ~40% of a batched
 * decode step). */
static inline __attribute__((always_inline)) void dequant_blocks_t(const qb32_t *w, int64_t n,
                                                                    int64_t b0, int64_t nblk,
                                                                    float *dst, const int BITS4,
                                                                    const int G16, const int F32) {
    int64_t nb = w->K / 32, bb = BITS4 ? 16 : 32, ng = G16 ? 2 * nb : nb, sb = F32 ? 4 : 2;
    const uint8_t *qs = w->qs + n * nb * bb;
    const void *d = (const char *)w->d + n * ng * sb, *c = (const char *)w->c + n * ng * sb;
    for (int64_t b = b0; b < b0 + nblk; b++) {
        const uint8_t *u = qs + b * bb;
        float *o = dst + (b - b0) * 32;
        int64_t g0 = G16 ? 2 * b : b, g1 = G16 ? g0 + 1 : g0;
#if defined(__AVX512F__) && HAVE_AVX2 /* F16C with it */
        float d0 = scale_fast(d, F32, g0), c0 = scale_fast(c, F32, g0);
        float d1 = G16 ? scale_fast(d, F32, g1) : d0, c1 = G16 ? scale_fast(c, F32, g1) : c0;
        __m512i v0, v1;
        if (BITS4) {
            __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u));
            v0 = _mm512_and_si512(raw, _mm512_set1_epi32(15));
            v1 = _mm512_srli_epi32(raw, 4);
        } else {
            v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u));
            v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u + 16)));
        }
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), _mm512_set1_ps(d0),
                                            _mm512_set1_ps(c0)));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), _mm512_set1_ps(d1),
                                                 _mm512_set1_ps(c1)));
#else
        float d0 = scale_at(d, F32, g0), c0 = scale_at(c, F32, g0);
        float d1 = scale_at(d, F32, g1), c1 = scale_at(c, F32, g1);
        for (int j = 0; j < 16; j++) {
            float lo = BITS4 ? (float)(u[j] & 15) : (float)u[j];
            float hi = BITS4 ? (float)(u[j] >> 4) : (float)u[j + 16];
            o[j] = fmaf(d0, lo, c0);
            o[j + 16] = fmaf(d1, hi, c1);
        }
#endif
    }
}

#define DEQUANT_COPY(NAME, B4, G, F)                                                              \
    static void NAME(const qb32_t *w, int64_t n, int64_t b0, int64_t nblk, float *dst) {          \
        dequant_blocks_t(w, n, b0, nblk, dst, B4, G, F);                                          \
    }
DEQUANT_COPY(deq_n32h, 1, 0, 0)
DEQUANT_COPY(deq_n32f, 1, 0, 1)
DEQUANT_COPY(deq_b32h, 0, 0, 0)
DEQUANT_COPY(deq_b32f, 0, 0, 1)
DEQUANT_COPY(deq_b16h, 0, 1, 0)
DEQUANT_COPY(deq_b16f, 0, 1, 1)
#undef DEQUANT_COPY
typedef void (*dequant_t)(const qb32_t *, int64_t, int64_t, int64_t, float *);

/* The dequantizer for w's layout (4-bit codes come only in groups of 32). */
static dequant_t dequant_for(const qb32_t *w) {
    int f32 = w->scale_bytes == 4;
    if (w->bits == 4) return f32 ? deq_n32f : deq_n32h;
    if (w->group == 16) return f32 ? deq_b16f : deq_b16h;
    return f32 ? deq_b32f : deq_b32h;
}

#if defined(__AVX512F__)
/* r[0..16) as rows of a 16 x 16 tile, transposed in place: one bit of the row and column index
 * swapped a stage. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    static const int32_t lo_idx[4][16] = {
        {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
        {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
        {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
        {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    };
    static const int32_t hi_idx[4][16] = {
        {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
        {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
        {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
        {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    };
    /* unrolled whole, so that r stays in registers */
#pragma GCC unroll 4
    for (int b = 0; b < 4; b++) {
        __m512i il = _mm512_loadu_si512(lo_idx[b]), ih = _mm512_loadu_si512(hi_idx[b]);
        int step = 1 << b;
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++) {
            if (c & step) continue;
            __m512 a = r[c], e = r[c + step];
            r[c] = _mm512_permutex2var_ps(a, il, e);
            r[c + step] = _mm512_permutex2var_ps(a, ih, e);
        }
    }
}

static inline __mmask16 mask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}
#endif

/* xt[k, 0..mp) = rows 0..mc of x (row stride ldx) at input k, zeros past mc; K a multiple of 32,
 * mp of 16. AVX-512: 16 x 16 tiles transposed in registers (a scalar loop here took ~2% of a
 * 32-row decode step). Called inside the GEMM's parallel region: its rows are shared out by an
 * orphaned `omp for` (one fork a call, not two). */
static void gemm_transpose_x(const float *x, int64_t ldx, int64_t mc, int64_t mp, int64_t K,
                             float *xt) {
#if defined(__AVX512F__)
#pragma omp for schedule(static)
    for (int64_t mb = 0; mb < mp; mb += 16) {
        for (int64_t k = 0; k < K; k += 16) {
            __m512 r[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                r[i] = mb + i < mc ? _mm512_loadu_ps(x + (mb + i) * ldx + k) : _mm512_setzero_ps();
            transpose16(r);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(xt + (k + i) * mp + mb, r[i]);
        }
    }
#else
    /* eight rows of x at a time: eight sequential reads, eight adjacent writes per k */
#pragma omp for schedule(static)
    for (int64_t mb = 0; mb < mp; mb += 8) {
        for (int64_t k = 0; k < K; k++) {
            float *dst = xt + k * mp + mb;
            for (int64_t i = 0; i < 8; i++) dst[i] = mb + i < mc ? x[(mb + i) * ldx + k] : 0.0f;
        }
    }
#endif
}

/* out[m, i] = acc[i, m] (+ bias[i]) for m < mc, i < nt (acc's rows mp apart, mp a multiple of
 * 16; out's ldo apart). AVX-512: 16 x 16 tiles transposed in registers, the bias added as a
 * vector (the scalar loop here took ~5% of a 32-row decode step). */
static void gemm_store(const float *acc, int64_t mp, int64_t nt, int64_t mc, const float *bias,
                       float *out, int64_t ldo) {
#if defined(__AVX512F__)
    for (int64_t i0 = 0; i0 < nt; i0 += 16) {
        __mmask16 cols = mask16(nt - i0);
        __m512 b = bias ? _mm512_maskz_loadu_ps(cols, bias + i0) : _mm512_setzero_ps();
        for (int64_t m0 = 0; m0 < mc; m0 += 16) {
            __m512 r[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                r[i] = i0 + i < nt ? _mm512_loadu_ps(acc + (i0 + i) * mp + m0) : _mm512_setzero_ps();
            transpose16(r);
            int rows = mc - m0 < 16 ? (int)(mc - m0) : 16;
#pragma GCC unroll 16
            for (int m = 0; m < 16; m++)
                if (m < rows)
                    _mm512_mask_storeu_ps(out + (m0 + m) * ldo + i0, cols, _mm512_add_ps(r[m], b));
        }
    }
#else
    for (int64_t m = 0; m < mc; m++)
        for (int64_t i = 0; i < nt; i++)
            out[m * ldo + i] = acc[i * mp + m] + (bias ? bias[i] : 0.0f);
#endif
}

/* -- many rows with 16-bit inputs: integer dots (VPDPWSSD on AVX-512 VNNI) ------------------ */

/* The float GEMM above runs at the core's float32 FMA peak, so the one way past it is an integer
 * dot. x is quantized per block of 32 as the few-row kernel does, to LEVELS16 = 32767 (16 bits:
 * each input moves by at most max|x| / 65534 of its block, 1/258 of int8's step), and each
 * group's contribution is d * a * sum(u * q) + c * (a * sum(q)), the few-row contract with
 * L = 32767. VPDPWSSD multiplies 16 lanes of two int16 pairs a step (32 products, twice an FMA's
 * 16); a 4-bit code and a 16-bit code are exact in int16 and a group's sum fits int32
 * (32 * 255 * 32767 < 2^31). Per group each accumulator is then converted and scaled once (the
 * scales differ per block, so int32 cannot run across groups). Layout as the float GEMM: the
 * weight tile's codes unpacked to int16 (input order, so one dword broadcast is a pair of
 * inputs), x transposed to pairs of codes per row lane (xt [K/2, MP] int32), its per-group
 * scales and code sums as [groups, MP] floats. Without VNNI the same integers in a portable
 * loop (tests; the engine keeps the float GEMM there). */
#define LEVELS16 32767

int qb32_has_gemm16(void) { return HAVE_VNNI512; } /* where the engine takes it */

/* x's rows m < mp quantized (rows past mc zero): xt's pair lanes [K/2, mp], ag (a per group) and
 * sg (a * sum(q) per group), [ng, mp] each. Called inside the GEMM's parallel region. */
static void quantize_x16(const float *x, int64_t ldx, int64_t mc, int64_t mp, int64_t K,
                         int64_t group, int32_t *xt, int32_t *xr, float *ag, float *sg) {
    int64_t nb = K / 32, per = 32 / group;
#if HAVE_VNNI512
    /* row by row into xr [mp, K/2] (the pairs packed by two narrowing conversions), then xr
     * transposed into xt by 16 x 16 tiles in registers: a store per pair with the stride of xt
     * took ~7% of the GEMM on SmolLM2's shapes */
    int64_t kp = K / 2;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < mp; m++) {
        for (int64_t b = 0; b < nb; b++) {
            int32_t q[32];
            float a = 0.0f;
            if (m < mc)
                a = quantize_block(x + m * ldx + b * 32, (float)LEVELS16, q);
            else
                memset(q, 0, sizeof q);
            __m512i q0 = _mm512_loadu_si512(q), q1 = _mm512_loadu_si512(q + 16);
            __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(q0)),
                                               _mm512_cvtepi32_epi16(q1), 1);
            _mm512_storeu_si512(xr + m * kp + b * 16, pairs);
            int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
            if (per == 2) {
                ag[2 * b * mp + m] = ag[(2 * b + 1) * mp + m] = a;
                sg[2 * b * mp + m] = a * (float)s0;
                sg[(2 * b + 1) * mp + m] = a * (float)s1;
            } else {
                ag[b * mp + m] = a;
                sg[b * mp + m] = a * (float)(s0 + s1);
            }
        }
    }
#pragma omp for schedule(static)
    for (int64_t mb = 0; mb < mp; mb += 16) {
        for (int64_t k = 0; k < kp; k += 16) {
            __m512 r[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) r[i] = _mm512_castsi512_ps(_mm512_loadu_si512(xr + (mb + i) * kp + k));
            transpose16(r);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(xt + (k + i) * mp + mb, _mm512_castps_si512(r[i]));
        }
    }
    return;
#endif
    (void)xr;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < mp; m++) {
        for (int64_t b = 0; b < nb; b++) {
            int32_t q[32];
            float a = 0.0f;
            if (m < mc)
                a = quantize_block(x + m * ldx + b * 32, (float)LEVELS16, q);
            else
                memset(q, 0, sizeof q);
            for (int j = 0; j < 16; j++)
                xt[(b * 16 + j) * mp + m] =
                    (int32_t)(((uint32_t)q[2 * j] & 0xffffu) | ((uint32_t)q[2 * j + 1] << 16));
            for (int64_t h = 0; h < per; h++) {
                int32_t s = 0;
                for (int64_t j = h * group; j < (h + 1) * group; j++) s += q[j];
                ag[(b * per + h) * mp + m] = a;
                sg[(b * per + h) * mp + m] = a * (float)s;
            }
        }
    }
}

/* Blocks [b0, b0 + nblk) of output row n: codes as int16 into u16 (input order), the groups'
 * d and c as float32 into dg, cg. */
static void unpack16(const qb32_t *w, int64_t n, int64_t b0, int64_t nblk, int16_t *u16,
                     float *dg, float *cg) {
    int64_t nb = w->K / 32, bb = w->bits == 4 ? 16 : 32, per = 32 / w->group;
    int64_t ng = nb * per, f32 = w->scale_bytes == 4, sb = w->scale_bytes;
    const uint8_t *qs = w->qs + (n * nb + b0) * bb;
    const char *d = (const char *)w->d + n * ng * sb, *c = (const char *)w->c + n * ng * sb;
    for (int64_t b = 0; b < nblk; b++) {
        const uint8_t *u = qs + b * bb;
        int16_t *o = u16 + b * 32;
#if HAVE_VNNI512
        if (bb == 16) {
            __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)u));
            _mm256_storeu_si256((__m256i *)o, _mm256_and_si256(v, _mm256_set1_epi16(15)));
            _mm256_storeu_si256((__m256i *)(o + 16), _mm256_srli_epi16(v, 4));
        } else {
            _mm512_storeu_si512(o, _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)u)));
        }
#else
        for (int j = 0; j < 16; j++) {
            o[j] = (int16_t)(bb == 16 ? u[j] & 15 : u[j]);
            o[j + 16] = (int16_t)(bb == 16 ? u[j] >> 4 : u[j + 16]);
        }
#endif
    }
#if HAVE_VNNI512
    int64_t n16 = nblk * per; /* at most 16 groups a tile */
    __mmask16 k16 = (__mmask16)((1u << n16) - 1);
    if (f32) {
        _mm512_storeu_ps(dg, _mm512_maskz_loadu_ps(k16, (const float *)d + b0 * per));
        _mm512_storeu_ps(cg, _mm512_maskz_loadu_ps(k16, (const float *)c + b0 * per));
    } else {
        _mm512_storeu_ps(dg, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k16, (const uint16_t *)d + b0 * per)));
        _mm512_storeu_ps(cg, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k16, (const uint16_t *)c + b0 * per)));
    }
#else
    for (int64_t g = 0; g < nblk * per; g++) {
        dg[g] = scale_at(d, (int)f32, b0 * per + g);
        cg[g] = scale_at(c, (int)f32, b0 * per + g);
    }
#endif
}

#define G16_NB 48  /* weight rows unpacked at a time */
#define G16_KC 256 /* inputs per tile: 8 blocks */

#if HAVE_VNNI512
/* acc += x's pairs times the broadcast weight pair wb, in asm: around the intrinsic GCC copied
 * every accumulator twice a dot (the GEMM ran at the float GEMM's speed); the broadcast stays a
 * register shared by the two dots (as a memory operand of each: 8% slower, the loads' ports) */
#define DPWSSD(acc, x, wb) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(wb))
/* acc[i, mm..mm + 16 * NV) += the groups of inputs [0, kc) of weight rows i < NR (int16 codes
 * at u16 + i * G16_KC, scales dg/cg + i * (G16_KC / 16)) against x's pairs (xt, [kc / 2, mp])
 * and group scales (ag, sg, [groups, mp]); first: acc starts at zero. */
#define G16_DECL(i)                                                                               \
    __m512 f##i##0 = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + i * lda);                \
    __m512 f##i##1 = NV == 2 ? (first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + i * lda + 16)) \
                             : _mm512_setzero_ps();                                               \
    __m512i s##i##0, s##i##1;
#define G16_ZERO(i)                                                                               \
    s##i##0 = _mm512_setzero_si512();                                                             \
    s##i##1 = _mm512_setzero_si512();
#define G16_DOT(i)                                                                                \
    {                                                                                             \
        __m512i wb = _mm512_set1_epi32(*(const int32_t *)(u16 + i * G16_KC + 2 * p));             \
        DPWSSD(s##i##0, x0, wb);                                                                  \
        if (NV == 2) DPWSSD(s##i##1, x1, wb);                                                     \
    }
#define G16_FOLD(i)                                                                               \
    {                                                                                             \
        __m512 dv = _mm512_set1_ps(dg[i * lds + g]), cv = _mm512_set1_ps(cg[i * lds + g]);        \
        f##i##0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s##i##0), a0), dv, f##i##0);   \
        f##i##0 = _mm512_fmadd_ps(z0, cv, f##i##0);                                               \
        if (NV == 2) {                                                                            \
            f##i##1 =                                                                             \
                _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s##i##1), a1), dv, f##i##1);     \
            f##i##1 = _mm512_fmadd_ps(z1, cv, f##i##1);                                           \
        }                                                                                         \
    }
#define G16_STORE(i)                                                                              \
    _mm512_storeu_ps(acc + i * lda, f##i##0);                                                     \
    if (NV == 2) _mm512_storeu_ps(acc + i * lda + 16, f##i##1);
#define G16_MICRO(NAME, n, NVV, GROUP)                                                            \
    static void NAME(const int16_t *u16, const float *dg, const float *cg, int64_t lds,          \
                     const int32_t *xt, const float *ag, const float *sg, int64_t mp, int64_t kc, \
                     float *acc, int64_t lda, int first) {                                        \
        enum { NV = NVV };                                                                        \
        GM_ROWS##n(G16_DECL) for (int64_t g = 0; g < kc / GROUP; g++) {                           \
            GM_ROWS##n(G16_ZERO) _Pragma("GCC unroll 16") for (int64_t p = g * (GROUP / 2);       \
                                                                p < (g + 1) * (GROUP / 2); p++) { \
                __m512i x0 = _mm512_loadu_si512(xt + p * mp);                                     \
                __m512i x1 = NV == 2 ? _mm512_loadu_si512(xt + p * mp + 16) : x0;                 \
                GM_ROWS##n(G16_DOT)                                                               \
            }                                                                                     \
            __m512 a0 = _mm512_loadu_ps(ag + g * mp), z0 = _mm512_loadu_ps(sg + g * mp);          \
            __m512 a1 = NV == 2 ? _mm512_loadu_ps(ag + g * mp + 16) : a0;                         \
            __m512 z1 = NV == 2 ? _mm512_loadu_ps(sg + g * mp + 16) : z0;                         \
            GM_ROWS##n(G16_FOLD)                                                                  \
        }                                                                                         \
        GM_ROWS##n(G16_STORE)                                                                     \
    }
typedef void (*g16_micro_t)(const int16_t *, const float *, const float *, int64_t,
                            const int32_t *, const float *, const float *, int64_t, int64_t,
                            float *, int64_t, int);
#define G16_SET(GROUP, NV, SUF)                                                                   \
    G16_MICRO(g16_##SUF##_1, 1, NV, GROUP)                                                        \
    G16_MICRO(g16_##SUF##_2, 2, NV, GROUP)                                                        \
    G16_MICRO(g16_##SUF##_3, 3, NV, GROUP)                                                        \
    G16_MICRO(g16_##SUF##_4, 4, NV, GROUP)                                                        \
    G16_MICRO(g16_##SUF##_5, 5, NV, GROUP)                                                        \
    G16_MICRO(g16_##SUF##_6, 6, NV, GROUP)
G16_SET(32, 2, g32v2)
G16_SET(16, 2, g16v2)
G16_SET(32, 1, g32v1)
G16_SET(16, 1, g16v1)
G16_MICRO(g16_g32v1_7, 7, 1, 32)
G16_MICRO(g16_g32v1_8, 8, 1, 32)
G16_MICRO(g16_g32v1_9, 9, 1, 32)
G16_MICRO(g16_g32v1_10, 10, 1, 32)
G16_MICRO(g16_g32v1_11, 11, 1, 32)
G16_MICRO(g16_g32v1_12, 12, 1, 32)
G16_MICRO(g16_g16v1_7, 7, 1, 16)
G16_MICRO(g16_g16v1_8, 8, 1, 16)
G16_MICRO(g16_g16v1_9, 9, 1, 16)
G16_MICRO(g16_g16v1_10, 10, 1, 16)
G16_MICRO(g16_g16v1_11, 11, 1, 16)
G16_MICRO(g16_g16v1_12, 12, 1, 16)
#define G16_NR 6   /* weight rows x 2 vectors of x rows: 12 int32 + 12 float accumulators */
#define G16_NR1 12 /* x 1 vector */
static const g16_micro_t G16_MICROS[2][G16_NR + 1] = {
    {NULL, g16_g32v2_1, g16_g32v2_2, g16_g32v2_3, g16_g32v2_4, g16_g32v2_5, g16_g32v2_6},
    {NULL, g16_g16v2_1, g16_g16v2_2, g16_g16v2_3, g16_g16v2_4, g16_g16v2_5, g16_g16v2_6},
};
static const g16_micro_t G16_MICROS1[2][G16_NR1 + 1] = {
    {NULL, g16_g32v1_1, g16_g32v1_2, g16_g32v1_3, g16_g32v1_4, g16_g32v1_5, g16_g32v1_6,
     g16_g32v1_7, g16_g32v1_8, g16_g32v1_9, g16_g32v1_10, g16_g32v1_11, g16_g32v1_12},
    {NULL, g16_g16v1_1, g16_g16v1_2, g16_g16v1_3, g16_g16v1_4, g16_g16v1_5, g16_g16v1_6,
     g16_g16v1_7, g16_g16v1_8, g16_g16v1_9, g16_g16v1_10, g16_g16v1_11, g16_g16v1_12},
};
#define G16_MV 16 /* x rows a vector */
#else
#define G16_MV 8
#endif

/* The portable micro-kernel: the same integers and float steps, one output at a time. */
static void g16_portable(const int16_t *u16, const float *dg, const float *cg, int64_t lds,
                         const int32_t *xt, const float *ag, const float *sg, int64_t mp,
                         int64_t kc, int64_t group, int nr, int64_t mm, int64_t mv, float *acc,
                         int64_t lda, int first) {
    for (int i = 0; i < nr; i++)
        for (int64_t m = mm; m < mm + mv; m++) {
            float f = first ? 0.0f : acc[i * lda + m - mm];
            for (int64_t g = 0; g < kc / group; g++) {
                int32_t s = 0;
                for (int64_t p = g * group / 2; p < (g + 1) * group / 2; p++) {
                    int32_t pair = xt[p * mp + m];
                    int16_t x0 = (int16_t)(pair & 0xffff), x1 = (int16_t)((uint32_t)pair >> 16);
                    s += (int32_t)u16[i * G16_KC + 2 * p] * x0 +
                         (int32_t)u16[i * G16_KC + 2 * p + 1] * x1;
                }
                f = fmaf((float)s * ag[g * mp + m], dg[i * lds + g], f);
                f = fmaf(sg[g * mp + m], cg[i * lds + g], f);
            }
            acc[i * lda + m - mm] = f;
        }
}

/* out[M, N] = x[M, K] (16-bit codes per block) times the weight^T (+ bias): the float GEMM's
 * tiling with the integer micro-kernel. portable: the C loop (tests). */
static void qb32_gemm16(const float *x, int64_t ldx, int64_t M, const qb32_t *w,
                        const float *bias, float *out, int64_t ldo, int portable) {
    int64_t K = w->K, N = w->N, group = w->group, ng = K / group;
    int64_t mcap = M < GEMM_MC ? M : GEMM_MC, mv = G16_MV;
    int64_t mpcap = (mcap + mv - 1) / mv * mv;
    int32_t *xt = aligned_alloc(64, sizeof(int32_t) * (size_t)(K / 2 * mpcap + 16));
    int32_t *xr = aligned_alloc(64, sizeof(int32_t) * (size_t)(K / 2 * mpcap + 16));
    float *ag = aligned_alloc(64, sizeof(float) * (size_t)(ng * mpcap + 16));
    float *sg = aligned_alloc(64, sizeof(float) * (size_t)(ng * mpcap + 16));
    int64_t bb = w->bits == 4 ? 16 : 32, rowbytes = K / 32 * bb;
    int gi = group == 16;
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_MC) {
        int64_t mc = M - m0 < GEMM_MC ? M - m0 : GEMM_MC;
        int64_t mp = (mc + mv - 1) / mv * mv;
        int64_t tiles = (N + G16_NB - 1) / G16_NB;
#pragma omp parallel if (mc * N * K > (1 << 18))
        {
            quantize_x16(x + m0 * ldx, ldx, mc, mp, K, group, xt, xr, ag, sg);
            int16_t *u16 = aligned_alloc(64, sizeof(int16_t) * G16_NB * G16_KC);
            float *dg = malloc(sizeof(float) * G16_NB * (G16_KC / 16));
            float *cg = malloc(sizeof(float) * G16_NB * (G16_KC / 16));
            float *acc = aligned_alloc(64, sizeof(float) * (size_t)(G16_NB * mp));
            int64_t lds = G16_KC / 16;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                int64_t n0 = t * G16_NB, nt = N - n0 < G16_NB ? N - n0 : G16_NB;
                for (int64_t k0 = 0; k0 < K; k0 += G16_KC) {
                    int64_t kc = K - k0 < G16_KC ? K - k0 : G16_KC;
                    for (int64_t i = 0; i < nt; i++) {
                        int64_t nn = n0 + G16_NB + i; /* the next tile's blocks into cache */
                        if (nn < N) {
                            const char *q = (const char *)w->qs + nn * rowbytes + k0 / 32 * bb;
                            for (int64_t o = 0; o < kc / 32 * bb; o += 64) __builtin_prefetch(q + o, 0, 3);
                        }
                        unpack16(w, n0 + i, k0 / 32, kc / 32, u16 + i * G16_KC, dg + i * lds,
                                 cg + i * lds);
                    }
                    const int32_t *xk = xt + k0 / 2 * mp;
                    const float *ak = ag + k0 / group * mp, *sk = sg + k0 / group * mp;
                    int first = k0 == 0;
                    if (portable) {
                        for (int64_t i0 = 0; i0 < nt; i0 += 4) {
                            int nr = nt - i0 < 4 ? (int)(nt - i0) : 4;
                            for (int64_t mm = 0; mm < mp; mm += mv)
                                g16_portable(u16 + i0 * G16_KC, dg + i0 * lds, cg + i0 * lds, lds,
                                             xk, ak, sk, mp, kc, group, nr, mm, mv,
                                             acc + i0 * mp + mm, mp, first);
                        }
                        continue;
                    }
#if HAVE_VNNI512
                    int64_t mm = 0;
                    for (; mm + 32 <= mp; mm += 32)
                        for (int64_t i0 = 0; i0 < nt; i0 += G16_NR) {
                            int nr = nt - i0 < G16_NR ? (int)(nt - i0) : G16_NR;
                            G16_MICROS[gi][nr](u16 + i0 * G16_KC, dg + i0 * lds, cg + i0 * lds,
                                               lds, xk + mm, ak + mm, sk + mm, mp, kc,
                                               acc + i0 * mp + mm, mp, first);
                        }
                    if (mm < mp)
                        for (int64_t i0 = 0; i0 < nt; i0 += G16_NR1) {
                            int nr = nt - i0 < G16_NR1 ? (int)(nt - i0) : G16_NR1;
                            G16_MICROS1[gi][nr](u16 + i0 * G16_KC, dg + i0 * lds, cg + i0 * lds,
                                                lds, xk + mm, ak + mm, sk + mm, mp, kc,
                                                acc + i0 * mp + mm, mp, first);
                        }
#else
                    (void)gi;
#endif
                }
                gemm_store(acc, mp, nt, mc, bias ? bias + n0 : NULL, out + m0 * ldo + n0, ldo);
            }
            free(u16);
            free(dg);
            free(cg);
            free(acc);
        }
    }
    free(xt);
    free(xr);
    free(ag);
    free(sg);
}

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) times the weight^T (+ bias), x as it is.
 * For steps of many rows: gguf_blocks.py measures, per shape, from how many rows it wins. */
static void qb32_gemm_float(const float *x, int64_t ldx, int64_t M, const qb32_t *w,
                            const float *bias, float *out, int64_t ldo) {
    int64_t K = w->K, N = w->N;
    int64_t step = GV; /* x's rows are padded to whole vectors; pairs of them a micro-kernel */
    dequant_t deq = dequant_for(w);
    /* a weight row's code bytes and its scales' bytes (each of d and c) */
    int64_t bb = w->bits == 4 ? 16 : 32, rowbytes = K / 32 * bb;
    int64_t sbytes = K / w->group * w->scale_bytes;
    int64_t mcap = M < GEMM_MC ? M : GEMM_MC;
    int64_t mpcap = (mcap + step - 1) / step * step;
    float *xt = malloc(sizeof(float) * (size_t)(K * mpcap + 16));
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_MC) {
        int64_t mc = M - m0 < GEMM_MC ? M - m0 : GEMM_MC;
        int64_t mp = (mc + step - 1) / step * step;
        int64_t tiles = (N + GEMM_NB - 1) / GEMM_NB;
#pragma omp parallel if (mc * N * K > (1 << 18))
        {
            gemm_transpose_x(x + m0 * ldx, ldx, mc, mp, K, xt); /* ends on the for's barrier */
            float *buf = malloc(sizeof(float) * GEMM_NB * GEMM_KC);
            float *acc = malloc(sizeof(float) * (size_t)(GEMM_NB * mp));
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                int64_t n0 = t * GEMM_NB, nt = N - n0 < GEMM_NB ? N - n0 : GEMM_NB;
                for (int64_t k0 = 0; k0 < K; k0 += GEMM_KC) {
                    int64_t kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;
                    for (int64_t i = 0; i < nt; i++) {
                        /* the next tile's same blocks, into cache while this tile computes:
                         * without it the loads waited on memory for ~60% of the dequant */
                        int64_t nn = n0 + GEMM_NB + i;
                        if (nn < N) {
                            const char *q = (const char *)w->qs + nn * rowbytes + k0 / 32 * bb;
                            __builtin_prefetch(q, 0, 3);
                            __builtin_prefetch(q + kc / 32 * bb - 1, 0, 3);
                            if (k0 == 0) {
                                const char *dn = (const char *)w->d + nn * sbytes;
                                const char *cn = (const char *)w->c + nn * sbytes;
                                __builtin_prefetch(dn, 0, 3);
                                __builtin_prefetch(dn + sbytes - 1, 0, 3);
                                __builtin_prefetch(cn, 0, 3);
                                __builtin_prefetch(cn + sbytes - 1, 0, 3);
                            }
                        }
                        deq(w, n0 + i, k0 / 32, kc / 32, buf + i * GEMM_KC);
                    }
                    int64_t mm = 0;
                    for (; mm + 2 * GV <= mp; mm += 2 * GV)
                        for (int64_t i0 = 0; i0 < nt; i0 += GEMM_NR) {
                            int nr = nt - i0 < GEMM_NR ? (int)(nt - i0) : GEMM_NR;
                            GEMM_MICROS[nr](buf + i0 * GEMM_KC, GEMM_KC, xt + k0 * mp + mm, mp,
                                            kc, acc + i0 * mp + mm, mp, k0 == 0);
                        }
                    if (mm < mp) /* one vector of rows left */
                        for (int64_t i0 = 0; i0 < nt; i0 += GEMM_NR1) {
                            int nr = nt - i0 < GEMM_NR1 ? (int)(nt - i0) : GEMM_NR1;
                            GEMM_MICROS1[nr](buf + i0 * GEMM_KC, GEMM_KC, xt + k0 * mp + mm,
                                             mp, kc, acc + i0 * mp + mm, mp, k0 == 0);
                        }
                }
                gemm_store(acc, mp, nt, mc, bias ? bias + n0 : NULL, out + m0 * ldo + n0, ldo);
            }
            free(buf);
            free(acc);
        }
    }
    free(xt);
}

/* The many-row GEMM as the weight's descriptor asks (QB32_GEMM16 in its path: 16-bit inputs,
 * on VNNI, else the portable loop; else x as it is). Callers: gguf_blocks.py, qb32_steps_desc,
 * gguf_kquants.c's repacked tiles (their descriptors without the flag: x as it is). */
void qb32_gemm_desc(const float *x, int64_t ldx, int64_t M, const void *desc, const float *bias,
                    float *out, int64_t ldo) {
    if (((const qb32_t *)desc)->path & QB32_GEMM16)
        qb32_gemm16(x, ldx, M, (const qb32_t *)desc, bias, out, ldo, !HAVE_VNNI512);
    else
        qb32_gemm_float(x, ldx, M, (const qb32_t *)desc, bias, out, ldo);
}

/* One GEMM path by name (tests, benchmarks): 0 x as it is, 1 16-bit inputs on the best path
 * this build has (VNNI, else the portable loop), 2 16-bit inputs, the portable loop. */
void qb32_gemm_path_desc(const float *x, int64_t ldx, int64_t M, const void *desc,
                         const float *bias, float *out, int64_t ldo, int64_t path) {
    if (path == 0)
        qb32_gemm_float(x, ldx, M, (const qb32_t *)desc, bias, out, ldo);
    else
        qb32_gemm16(x, ldx, M, (const qb32_t *)desc, bias, out, ldo, path == 2 || !HAVE_VNNI512);
}

/* out[r, K] = the dequantized rows idx[r] of the weight (the token embedding's lookup). */
void qb32_rows_desc(const void *desc, const int64_t *idx, int64_t count, float *out) {
    const qb32_t *w = desc;
    int64_t K = w->K, nb = K / 32;
    dequant_t deq = dequant_for(w);
#pragma omp parallel for schedule(static) if (count * K > (1 << 16))
    for (int64_t r = 0; r < count; r++) {
        int64_t n = idx[r];
        if (n < 0 || n >= w->N) { /* the caller checks; never read outside the weight */
            memset(out + r * K, 0, sizeof(float) * (size_t)K);
            continue;
        }
        deq(w, n, 0, nb, out + r * K);
    }
}

/* A weight with its few-row/GEMM threshold, for the whole-layer decode (decoder_layer_t.qlinear
 * = qb32_steps_desc): steps of <= few_rows rows take the few-row linear, larger ones the GEMM,
 * so a batch of decodes stays one native call per layer. */
typedef struct {
    qb32_t w;
    int64_t few_rows;
} qb32_steps_t;

void qb32_steps_desc(const float *x, int64_t ldx, int64_t M, const void *desc, const float *bias,
                     float *out, int64_t ldo) {
    const qb32_steps_t *s = desc;
    if (M <= s->few_rows)
        qb32_linear_desc(x, ldx, M, &s->w, bias, out, ldo);
    else
        qb32_gemm_desc(x, ldx, M, &s->w, bias, out, ldo);
}
