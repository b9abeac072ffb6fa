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
 * The product, int8 inputs: each row of x is quantized per block of 32 to int8 (scale
 * a = max|x| / 127, codes round-half-even(x / a)), so a group's contribution to out is
 *   d * a * sum(u * q) + c * (a * sum(q)),
 * the sum over products of unsigned and signed bytes: VPDPBUSD on AVX-512 VNNI. Elsewhere (and
 * with the portable path) a plain C loop computes the same integers. Float inputs (AVX-512):
 * d * sum(u * x) + c * sum(x), x as it is.
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
int qb32_has_float(void) { return HAVE_VNNI512; }

/* A qb32 weight as one pointer (gguf_blocks.py's QB32Desc; cpu_native.c's whole decoder layer
 * calls qb32_linear_desc with it through its decoder_layer_t.qlinear). */
typedef struct {
    const uint8_t *qs;
    const void *d, *c;   /* float16 or float32, [N, K / group] */
    int64_t N, K, bits;  /* bits: 4 (nibbles), 5, 6 or 8 (a byte each) */
    int64_t path;        /* qb32_linear's */
    int64_t group;       /* inputs per (d, c): 32 or 16 (byte codes only) */
    int64_t scale_bytes; /* 2: float16 d and c; 4: float32 */
} qb32_t;

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

/* One row of x into int8 codes q[K], per-block scales a[K/32] and a * sum(q) per group of
 * `group` inputs s[K/group]. */
static void quantize_row(const float *x, int64_t K, int group, int8_t *q, float *a, float *s) {
    int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float scale = amax / 127.0f;
        float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0, first = 0;
        for (int i = 0; i < 32; i++) {
            int v = (int)nearbyintf(xb[i] * inv);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            q[b * 32 + i] = (int8_t)v;
            sum += v;
            if (i == 15) first = sum;
        }
        a[b] = scale;
        if (group == 16) {
            s[2 * b] = scale * (float)first;
            s[2 * b + 1] = scale * (float)(sum - first);
        } else {
            s[b] = scale * (float)sum;
        }
    }
}

/* Integer dots of one block's codes u with input codes qb: dot[0] over the block (group 32) or
 * its first 16 inputs, dot[1] over its second 16 inputs (group 16). */
static inline __attribute__((always_inline)) void block_dots(const uint8_t *u, int bits,
                                                              int group, const int8_t *qb,
                                                              int32_t dot[2]) {
    /* one loop over the block where it has one group (32 trips: the compiler vectorizes it;
     * two loops of 16 get unrolled whole instead, which runs ~5x slower) */
    if (group == 32) {
        int32_t t = 0;
        if (bits == 4) {
            for (int j = 0; j < 16; j++)
                t += (int32_t)(u[j] & 15) * qb[j] + (int32_t)(u[j] >> 4) * qb[j + 16];
        } else {
            for (int j = 0; j < 32; j++) t += (int32_t)u[j] * qb[j];
        }
        dot[0] = t;
        dot[1] = 0;
        return;
    }
    int32_t lo = 0, hi = 0; /* groups of 16: byte codes only */
    for (int j = 0; j < 16; j++) lo += (int32_t)u[j] * qb[j];
    for (int j = 16; j < 32; j++) hi += (int32_t)u[j] * qb[j];
    dot[0] = lo;
    dot[1] = hi;
}

/* Block b's sum of d * dot over its groups. */
static inline __attribute__((always_inline)) float block_scaled(const void *d, int f32,
                                                                int group, int64_t b,
                                                                const int32_t dot[2]) {
    if (group == 16)
        return scale_at(d, f32, 2 * b) * (float)dot[0] + scale_at(d, f32, 2 * b + 1) * (float)dot[1];
    return scale_at(d, f32, b) * (float)dot[0];
}

/* out[m] for the rows m < mt of one output row: the portable path. */
static inline __attribute__((always_inline)) void row_scalar(const uint8_t *qs, const void *d, const void *c, int64_t nb, int bits,
                       int group, int f32, const int8_t *q, const float *a, const float *s,
                       int64_t K, int mt, float *acc) {
    int64_t bb = bits == 4 ? 16 : 32, ng = K / group;
    for (int m = 0; m < mt; m++) {
        const int8_t *qm = q + m * K;
        const float *am = a + m * nb, *sm = s + m * ng;
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int32_t dot[2];
            block_dots(qs + b * bb, bits, group, qm + b * 32, dot);
            total += am[b] * block_scaled(d, f32, group, b, dot);
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

/* n (2 or 4, constant after inlining) scales from i into the low lanes. */
static inline __attribute__((always_inline)) __m128 scales_n(const void *p, int f32, int64_t i,
                                                             int n) {
    if (f32) {
        float t[4] = {0, 0, 0, 0};
        memcpy(t, (const float *)p + i, (size_t)n * 4);
        return _mm_loadu_ps(t);
    }
    uint64_t h = 0;
    memcpy(&h, (const uint16_t *)p + i, (size_t)n * 2);
    return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)h));
}
#endif

#if HAVE_AVX2
/* The same with AVX2, one block a step: VPMADDUBSW (unsigned codes of 6 bits or fewer times
 * signed input bytes; for 8-bit codes, |u - 128| times the input with u - 128's sign, so no pair
 * sum saturates, and the 128 * d moves to the offsets), VPMADDWD to int32, a float FMA by the
 * group's two scales. */
static inline __attribute__((always_inline)) void row_avx2(const uint8_t *qs, const void *d, const void *c, int64_t nb, int bits,
                     int group, int f32, const int8_t *q, const float *a, const float *s,
                     int64_t K, int mt, float *acc) {
    __m256 sum[4];
    for (int m = 0; m < mt; m++) sum[m] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    int64_t ng = K / group;
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
            __m256i x = _mm256_loadu_si256((const __m256i *)(q + m * K + b * 32));
            __m256i p = bits == 8 ? _mm256_maddubs_epi16(_mm256_abs_epi8(u),
                                                         _mm256_sign_epi8(x, u))
                                  : _mm256_maddubs_epi16(u, x);
            __m256i dot = _mm256_madd_epi16(p, ones);
            float am = a[m * nb + b];
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
        const float *sm = s + m * ng;
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
/* Sixteen offsets from g0 (masked past ng). */
static inline __m512 offsets16(const void *c, int f32, int64_t g0, __mmask16 mask) {
    if (f32) return _mm512_maskz_loadu_ps(mask, (const float *)c + g0);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)c + g0));
}

/* Float inputs (path 3): the codes widened to float32 in registers and multiplied with x as
 * it is, d * sum(u * x) + c * sum(x) per group (s holds each group's sum(x)): the dequantized
 * weight's product up to float32 rounding, no int8 rounding of x. */
static inline __attribute__((always_inline)) void row_float(const uint8_t *qs, const void *d, const void *c, int64_t nb, int bits,
                      int group, int f32, const float *x, int64_t ldx, const float *s, int mt,
                      float *acc) {
    __m512 sum[4];
    for (int m = 0; m < mt; m++) sum[m] = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    int64_t ng = nb * 32 / group;
    for (int64_t b = 0; b < nb; b++) {
        __m128i u0, u1;
        if (bits == 4) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(qs + b * 16));
            u0 = _mm_and_si128(raw, low);
            u1 = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        } else {
            u0 = _mm_loadu_si128((const __m128i *)(qs + b * 32));
            u1 = _mm_loadu_si128((const __m128i *)(qs + b * 32 + 16));
        }
        __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u0));
        __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u1));
        if (group == 16) {
            __m512 d0 = _mm512_set1_ps(scale_fast(d, f32, 2 * b));
            __m512 d1 = _mm512_set1_ps(scale_fast(d, f32, 2 * b + 1));
            for (int m = 0; m < mt; m++) {
                const float *xb = x + m * ldx + b * 32;
                sum[m] = _mm512_fmadd_ps(_mm512_mul_ps(f0, _mm512_loadu_ps(xb)), d0, sum[m]);
                sum[m] = _mm512_fmadd_ps(_mm512_mul_ps(f1, _mm512_loadu_ps(xb + 16)), d1, sum[m]);
            }
        } else {
            __m512 wd = _mm512_set1_ps(scale_fast(d, f32, b));
            for (int m = 0; m < mt; m++) {
                const float *xb = x + m * ldx + b * 32;
                __m512 t = _mm512_mul_ps(f0, _mm512_loadu_ps(xb));
                t = _mm512_fmadd_ps(f1, _mm512_loadu_ps(xb + 16), t);
                sum[m] = _mm512_fmadd_ps(t, wd, sum[m]);
            }
        }
    }
    for (int64_t g0 = 0; g0 < ng; g0 += 16) {
        int64_t left = ng - g0;
        __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512 cv = offsets16(c, f32, g0, mask);
        for (int m = 0; m < mt; m++)
            sum[m] = _mm512_fmadd_ps(cv, _mm512_maskz_loadu_ps(mask, s + m * ng + g0), sum[m]);
    }
    for (int m = 0; m < mt; m++) acc[m] = _mm512_reduce_add_ps(sum[m]);
}

/* The same with VPDPBUSD, two blocks per step; mt (1..4) constant after inlining. */
static inline __attribute__((always_inline)) void row_vnni(
    const uint8_t *qs, const void *d, const void *c, int64_t nb, int bits, int group, int f32,
    const int8_t *q, const float *a2, const float *s, int64_t K, int mt, float *acc,
    const int8_t *x4, const float *a4) {
    __m512 sum[4];
    for (int m = 0; m < mt; m++) sum[m] = _mm512_setzero_ps();
    const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i quads = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    int64_t b = 0, ng = K / group;
    if (bits == 4) {
        /* four blocks a step: x4 holds each group of four blocks' codes as the low nibbles of
         * 64 weight bytes line up (inputs 0-15 of each block, then inputs 16-31 of each) */
        const __m512i low = _mm512_set1_epi8(0x0f);
        for (; b + 4 <= nb; b += 4) {
            __m512i raw = _mm512_loadu_si512((const void *)(qs + b * 16));
            __m512i lo = _mm512_and_si512(raw, low);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            __m512 wd = _mm512_permutexvar_ps(quads, _mm512_castps128_ps512(scales_n(d, f32, b, 4)));
            for (int m = 0; m < mt; m++) {
                const int8_t *xm = x4 + m * K + b * 32;
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                  _mm512_loadu_si512((const void *)xm));
                dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512((const void *)(xm + 64)));
                __m512 scale = _mm512_mul_ps(wd, _mm512_loadu_ps(a4 + m * nb * 4 + b * 4));
                sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, sum[m]);
            }
        }
    }
    for (; b + 2 <= nb; b += 2) {
        __m512i u;
        if (bits == 4) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + b * 16));
            __m256i lo = _mm256_and_si256(raw, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            /* [lo0 lo1 | hi0 hi1] in 128-bit lanes -> [lo0 hi0 lo1 hi1]: block b, block b+1 */
            __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            u = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
        } else {
            u = _mm512_loadu_si512((const void *)(qs + b * 32));
        }
        /* int32 lane i of the dot covers inputs 4i..4i+3 of the two blocks: groups of 32 take
         * one scale per 8 lanes, groups of 16 one per 4 */
        __m512 wd = group == 16
                        ? _mm512_permutexvar_ps(quads, _mm512_castps128_ps512(
                                                           scales_n(d, f32, 2 * b, 4)))
                        : _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(
                                                           scales_n(d, f32, b, 2)));
        for (int m = 0; m < mt; m++) {
            __m512i x = _mm512_loadu_si512((const void *)(q + m * K + b * 32));
            __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
            __m512 scale = _mm512_mul_ps(wd, _mm512_loadu_ps(a2 + (m * nb + b) * 8));
            sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, sum[m]);
        }
    }
    float tail[4] = {0, 0, 0, 0};
    if (b < nb) { /* an odd last block */
        for (int m = 0; m < mt; m++) {
            int32_t dot[2];
            block_dots(qs + b * (bits == 4 ? 16 : 32), bits, group, q + m * K + b * 32, dot);
            tail[m] = a2[(m * nb + b) * 8] * block_scaled(d, f32, group, b, dot);
        }
    }
    /* the offsets: sum over groups of c * (a * sum(q)), sixteen groups a step */
    for (int64_t g0 = 0; g0 < ng; g0 += 16) {
        int64_t left = ng - g0;
        __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512 cv = offsets16(c, f32, g0, mask);
        for (int m = 0; m < mt; m++)
            sum[m] = _mm512_fmadd_ps(cv, _mm512_maskz_loadu_ps(mask, s + m * ng + g0), sum[m]);
    }
    for (int m = 0; m < mt; m++) acc[m] = _mm512_reduce_add_ps(sum[m]) + tail[m];
}
#endif

/* One call's state, shared by its output rows. */
typedef struct {
    const qb32_t *w;
    const float *x, *bias;
    int64_t ldx, M, K, nb, ng, ldo;
    const int8_t *q, *x4;
    const float *a, *a2, *a4, *s, *xs;
    int use_float, use_vnni, use_avx2;
    float *out;
} run_t;

/* Output row n for every row of x; group and f32 are constants in each of the copies below, so
 * their branches and index arithmetic fold away inside the row functions. */
static inline __attribute__((always_inline)) void one_row(const run_t *r, int64_t n,
                                                           const int group, const int f32) {
    const qb32_t *w = r->w;
    int64_t nb = r->nb, ng = r->ng, K = r->K, M = r->M, ldx = r->ldx, sb = f32 ? 4 : 2;
    int bits = (int)w->bits;
    const uint8_t *qn = w->qs + n * nb * (bits == 4 ? 16 : 32);
    const void *dn = (const char *)w->d + n * ng * sb, *cn = (const char *)w->c + n * ng * sb;
    float bn = r->bias ? r->bias[n] : 0.0f;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        int mt = M - m0 < 4 ? (int)(M - m0) : 4;
        float acc[4];
        const int8_t *qm = r->q + m0 * K;
#if HAVE_VNNI512
        if (r->use_float) {
            row_float(qn, dn, cn, nb, bits, group, f32, r->x + m0 * ldx, ldx, r->xs + m0 * ng, mt,
                      acc);
        } else if (r->use_vnni) {
            const float *a2m = r->a2 + m0 * nb * 8, *sm = r->s + m0 * ng;
            const float *a4m = r->a4 + m0 * nb * 4;
            const int8_t *x4m = r->x4 + m0 * K;
#define VNNI_ROWS(T)                                                                              \
    row_vnni(qn, dn, cn, nb, bits, group, f32, qm, a2m, sm, K, T, acc, x4m, a4m)
            switch (mt) {
            case 1: VNNI_ROWS(1); break;
            case 2: VNNI_ROWS(2); break;
            case 3: VNNI_ROWS(3); break;
            default: VNNI_ROWS(4); break;
            }
#undef VNNI_ROWS
        } else
#endif
#if HAVE_AVX2
            if (r->use_avx2) {
            row_avx2(qn, dn, cn, nb, bits, group, f32, qm, r->a + m0 * nb, r->s + m0 * ng, K, mt,
                     acc);
        } else
#endif
        {
            row_scalar(qn, dn, cn, nb, bits, group, f32, qm, r->a + m0 * nb, r->s + m0 * ng, K,
                       mt, acc);
        }
        for (int m = 0; m < mt; m++) r->out[(m0 + m) * r->ldo + n] = acc[m] + bn;
    }
}

/* Every output row, split across the OpenMP threads; one copy per layout kind. */
#define ALL_ROWS(NAME, G, F)                                                                      \
    static void NAME(const run_t *r) {                                                            \
        int64_t N = r->w->N;                                                                      \
        _Pragma("omp parallel for schedule(static) if (N * r->M * r->K > (1 << 16))")             \
        for (int64_t n = 0; n < N; n++) one_row(r, n, G, F);                                      \
    }
ALL_ROWS(rows_g32_f16, 32, 0)
ALL_ROWS(rows_g32_f32, 32, 1)
ALL_ROWS(rows_g16_f16, 16, 0)
ALL_ROWS(rows_g16_f32, 16, 1)
#undef ALL_ROWS

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) times the weight^T (+ bias).
 * w->path: 0 the best this build has, 1 the portable C loop, 2 AVX2 (where built), 3 float
 * inputs (AVX-512 builds; else the best int8 path). */
static void qb32_run(const float *x, int64_t ldx, int64_t M, const qb32_t *w, const float *bias,
                     float *out, int64_t ldo) {
    int64_t K = w->K, path = w->path, nb = K / 32;
    int group = (int)w->group, f32 = w->scale_bytes == 4;
    int64_t ng = K / group;
    int8_t *q = malloc((size_t)(M * K + 64));
    float *a = malloc(sizeof(float) * (size_t)(M * nb));
    float *a2 = malloc(sizeof(float) * (size_t)(M * nb * 8 + 16));
    float *s = malloc(sizeof(float) * (size_t)(M * ng));
    /* x4, a4: the 4-bit VNNI path's codes, each group of four blocks as its weight bytes
     * line up (see row_vnni), and each block's scale four times */
    int8_t *x4 = malloc((size_t)(M * K + 64));
    float *a4 = malloc(sizeof(float) * (size_t)(M * nb * 4 + 16));
    for (int64_t m = 0; m < M; m++) {
        quantize_row(x + m * ldx, K, group, q + m * K, a + m * nb, s + m * ng);
        for (int64_t b = 0; b < nb; b++) {
            for (int i = 0; i < 8; i++) a2[(m * nb + b) * 8 + i] = a[m * nb + b];
            for (int i = 0; i < 4; i++) a4[(m * nb + b) * 4 + i] = a[m * nb + b];
        }
        const int8_t *qm = q + m * K;
        int8_t *xm = x4 + m * K;
        memcpy(xm, qm, (size_t)K);
        for (int64_t b = 0; b + 4 <= nb; b += 4)
            for (int j = 0; j < 4; j++)
                for (int h = 0; h < 2; h++)
                    memcpy(xm + b * 32 + h * 64 + j * 16, qm + (b + j) * 32 + h * 16, 16);
    }
    int use_float = HAVE_VNNI512 && path == 3;
    float *xs = use_float ? malloc(sizeof(float) * (size_t)(M * ng)) : NULL;
    if (use_float) /* each group's sum of x, for the c term */
        for (int64_t m = 0; m < M; m++)
            for (int64_t b = 0; b < nb; b++) {
                const float *xb = x + m * ldx + b * 32;
                float t0 = 0.0f, t1 = 0.0f;
                for (int i = 0; i < 16; i++) t0 += xb[i];
                for (int i = 16; i < 32; i++) t1 += xb[i];
                if (group == 16) {
                    xs[m * ng + 2 * b] = t0;
                    xs[m * ng + 2 * b + 1] = t1;
                } else {
                    xs[m * ng + b] = t0 + t1;
                }
            }
    if (path == 3 && !HAVE_VNNI512) path = 0;
    run_t r = {w, x, bias, ldx, M, K, nb, ng, ldo, q, x4, a, a2, a4, s, xs,
               use_float, HAVE_VNNI512 && path == 0, HAVE_AVX2 && (path == 0 || path == 2), out};
    if (group == 16)
        (f32 ? rows_g16_f32 : rows_g16_f16)(&r);
    else
        (f32 ? rows_g32_f32 : rows_g32_f16)(&r);
    free(q);
    free(a);
    free(a2);
    free(s);
    free(x4);
    free(a4);
    free(xs);
}

/* qb32_run for a layout of 32-input groups and float16 scales (Q4_0, Q4_1, Q8_0), its weight
 * as separate pointers. bits: 4 or 8. */
void qb32_linear(const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *qs,
                 const uint16_t *d, const uint16_t *c, int64_t N, int64_t bits,
                 const float *bias, float *out, int64_t ldo, int64_t path) {
    qb32_t w = {qs, d, c, N, K, bits, path, 32, 2};
    qb32_run(x, ldx, M, &w, bias, out, ldo);
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
 * to whole micro-kernel widths with zeros), so the micro-kernel broadcasts one weight value and
 * multiplies it into two vectors of rows: GEMM_NR weight rows x 2 vectors of x rows in
 * registers. Each output is sum over k in order, one accumulator per output: the dequantized
 * weight's product up to float32 summation order. */

#define GEMM_NB 48  /* weight rows a thread dequantizes at a time (a multiple of GEMM_NR) */
#define GEMM_KC 128 /* inputs per tile: 4 blocks */
#if defined(__AVX512F__)
#define GEMM_NR 12 /* weight rows per micro-kernel: 24 accumulators of AVX-512's 32 registers */
#else
#define GEMM_NR 6 /* 12 accumulators of AVX2's 16 */
#endif
#define GEMM_MC 256 /* rows of x per pass (bounds the transposed copy and the accumulators) */

#if defined(__AVX512F__)
#define GV 16
typedef __m512 gvec;
#define G_LOAD(p) _mm512_loadu_ps(p)
#define G_STORE(p, v) _mm512_storeu_ps((p), (v))
#define G_BCAST(p) _mm512_set1_ps(*(p))
#define G_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#elif defined(__AVX2__) && defined(__FMA__)
#define GV 8
typedef __m256 gvec;
#define G_LOAD(p) _mm256_loadu_ps(p)
#define G_STORE(p, v) _mm256_storeu_ps((p), (v))
#define G_BCAST(p) _mm256_broadcast_ss(p)
#define G_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
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
#endif

/* acc[i, 0..2GV) += sum over k < kc of w[i, k] * xt[k, 0..2GV), for i < NR; named registers. */
#define GM_DECL(i) gvec c##i##0 = G_LOAD(acc + i * lda), c##i##1 = G_LOAD(acc + i * lda + GV);
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
                               int64_t kc, float *acc, int64_t lda) {                             \
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
                             int64_t);
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

/* Blocks [b0, b0 + nblk) of 32 inputs of output row n as floats into dst: d * u + c with one
 * rounding (a fused multiply-add), as `dequantize` rounds its float64 value once. Any layout of
 * qb32_t: 4-bit nibbles or a byte a code, 32 or 16 inputs per (d, c), float16 or float32. */
static void dequant_blocks(const qb32_t *w, int64_t n, int64_t b0, int64_t nblk, float *dst) {
    int64_t nb = w->K / 32, bb = w->bits == 4 ? 16 : 32, group = w->group;
    int64_t ng = w->K / group, sb = w->scale_bytes, f32 = sb == 4;
    const uint8_t *qs = w->qs + n * nb * bb;
    const void *d = (const char *)w->d + n * ng * sb, *c = (const char *)w->c + n * ng * sb;
    for (int64_t b = b0; b < b0 + nblk; b++) {
        const uint8_t *u = qs + b * bb;
        float *o = dst + (b - b0) * 32;
        int64_t g0 = b * 32 / group, g1 = group == 16 ? g0 + 1 : g0;
#if defined(__AVX512F__)
        __m128i u0, u1;
        if (w->bits == 4) {
            __m128i raw = _mm_loadu_si128((const __m128i *)u), low = _mm_set1_epi8(0x0f);
            u0 = _mm_and_si128(raw, low);
            u1 = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        } else {
            u0 = _mm_loadu_si128((const __m128i *)u);
            u1 = _mm_loadu_si128((const __m128i *)(u + 16));
        }
        __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u0));
        __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u1));
        _mm512_storeu_ps(o, _mm512_fmadd_ps(f0, _mm512_set1_ps(scale_at(d, (int)f32, g0)),
                                            _mm512_set1_ps(scale_at(c, (int)f32, g0))));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(f1, _mm512_set1_ps(scale_at(d, (int)f32, g1)),
                                                 _mm512_set1_ps(scale_at(c, (int)f32, g1))));
#else
        float d0 = scale_at(d, (int)f32, g0), c0 = scale_at(c, (int)f32, g0);
        float d1 = scale_at(d, (int)f32, g1), c1 = scale_at(c, (int)f32, g1);
        for (int j = 0; j < 16; j++) {
            float lo = w->bits == 4 ? (float)(u[j] & 15) : (float)u[j];
            float hi = w->bits == 4 ? (float)(u[j] >> 4) : (float)u[j + 16];
            o[j] = fmaf(d0, lo, c0);
            o[j + 16] = fmaf(d1, hi, c1);
        }
#endif
    }
}

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) times the weight^T (+ bias), x as it is.
 * For steps of many rows: gguf_blocks.py measures, per shape, from how many rows it wins. */
void qb32_gemm_desc(const float *x, int64_t ldx, int64_t M, const void *desc, const float *bias,
                    float *out, int64_t ldo) {
    const qb32_t *w = desc;
    int64_t K = w->K, N = w->N;
    int64_t step = 2 * GV;
    int64_t mcap = M < GEMM_MC ? M : GEMM_MC;
    int64_t mpcap = (mcap + step - 1) / step * step;
    float *xt = malloc(sizeof(float) * (size_t)(K * mpcap + 16));
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_MC) {
        int64_t mc = M - m0 < GEMM_MC ? M - m0 : GEMM_MC;
        int64_t mp = (mc + step - 1) / step * step;
        /* eight rows of x at a time: eight sequential reads, eight adjacent writes per k */
#pragma omp parallel for schedule(static) if (mc * K > (1 << 15))
        for (int64_t mb = 0; mb < mp; mb += 8) {
            for (int64_t k = 0; k < K; k++) {
                float *dst = xt + k * mp + mb;
                for (int64_t i = 0; i < 8; i++)
                    dst[i] = mb + i < mc ? x[(m0 + mb + i) * ldx + k] : 0.0f;
            }
        }
        int64_t tiles = (N + GEMM_NB - 1) / GEMM_NB;
#pragma omp parallel if (mc * N * K > (1 << 18))
        {
            float *buf = malloc(sizeof(float) * GEMM_NB * GEMM_KC);
            float *acc = malloc(sizeof(float) * (size_t)(GEMM_NB * mp));
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                int64_t n0 = t * GEMM_NB, nt = N - n0 < GEMM_NB ? N - n0 : GEMM_NB;
                memset(acc, 0, sizeof(float) * (size_t)(nt * mp));
                for (int64_t k0 = 0; k0 < K; k0 += GEMM_KC) {
                    int64_t kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;
                    for (int64_t i = 0; i < nt; i++)
                        dequant_blocks(w, n0 + i, k0 / 32, kc / 32, buf + i * GEMM_KC);
                    for (int64_t mm = 0; mm < mp; mm += step)
                        for (int64_t i0 = 0; i0 < nt; i0 += GEMM_NR) {
                            int nr = nt - i0 < GEMM_NR ? (int)(nt - i0) : GEMM_NR;
                            GEMM_MICROS[nr](buf + i0 * GEMM_KC, GEMM_KC, xt + k0 * mp + mm, mp,
                                            kc, acc + i0 * mp + mm, mp);
                        }
                }
                for (int64_t m = 0; m < mc; m++) {
                    float *o = out + (m0 + m) * ldo + n0;
                    for (int64_t i = 0; i < nt; i++)
                        o[i] = acc[i * mp + m] + (bias ? bias[n0 + i] : 0.0f);
                }
            }
            free(buf);
            free(acc);
        }
    }
    free(xt);
}

/* out[r, K] = the dequantized rows idx[r] of the weight (the token embedding's lookup). */
void qb32_rows_desc(const void *desc, const int64_t *idx, int64_t count, float *out) {
    const qb32_t *w = desc;
    int64_t K = w->K, nb = K / 32;
#pragma omp parallel for schedule(static) if (count * K > (1 << 16))
    for (int64_t r = 0; r < count; r++) {
        int64_t n = idx[r];
        if (n < 0 || n >= w->N) { /* the caller checks; never read outside the weight */
            memset(out + r * K, 0, sizeof(float) * (size_t)K);
            continue;
        }
        dequant_blocks(w, n, 0, nb, out + r * K);
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
