/* Linears on GGUF block-quantized weights kept in their low-bit form (kernels/gguf_blocks.py
 * repacks the file's blocks into the layout below, builds and loads this file, and holds the
 * torch references it is tested against).
 *
 * The layout ("qb32"): a weight [N, K] with K a multiple of 32, in blocks of 32 consecutive
 * inputs of one output row; every block's values are w = d * u + c with u an unsigned code:
 *   - 4-bit (Q4_0, Q4_1): qs [N, K/32, 16] bytes, byte j of a block holding u of input j in
 *     its low nibble and of input j + 16 in its high nibble (the file's own order);
 *   - 8-bit (Q8_0): qs [N, K/32, 32] bytes, u = q + 128 (the signed code moved to unsigned);
 *   - d [N, K/32] and c [N, K/32] float16: Q4_1's scale and min; Q4_0's scale and -8 * scale;
 *     Q8_0's scale and -128 * scale.
 *
 * The product: each row of x is quantized per block of 32 to int8 (scale a = max|x| / 127,
 * codes round-half-even(x / a)), so a block's contribution to out is
 *   d * a * sum(u * q) + c * (a * sum(q)),
 * the sum over 32 products of unsigned and signed bytes: one VPDPBUSD per two blocks on
 * AVX-512 VNNI. Elsewhere (and with `scalar`) a plain C loop computes the same integers.
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

/* One row of x into int8 codes q[K], per-block scales a[nb] and a * sum(q) s[nb]. */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *a, float *s) {
    int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float scale = amax / 127.0f;
        float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int v = (int)nearbyintf(xb[i] * inv);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            q[b * 32 + i] = (int8_t)v;
            sum += v;
        }
        a[b] = scale;
        s[b] = scale * (float)sum;
    }
}

/* out[m] for the rows m < mt of one output row n: the portable path. */
static void row_scalar(const uint8_t *qs, const uint16_t *d, const uint16_t *c, int64_t nb,
                       int bits, const int8_t *q, const float *a, const float *s, int64_t K,
                       int mt, float *acc) {
    int64_t bb = bits == 4 ? 16 : 32;
    for (int m = 0; m < mt; m++) {
        const int8_t *qm = q + m * K;
        const float *am = a + m * nb, *sm = s + m * nb;
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *u = qs + b * bb;
            const int8_t *qb = qm + b * 32;
            int32_t dot = 0;
            if (bits == 4) {
                for (int j = 0; j < 16; j++)
                    dot += (int32_t)(u[j] & 15) * qb[j] + (int32_t)(u[j] >> 4) * qb[j + 16];
            } else {
                for (int j = 0; j < 32; j++) dot += (int32_t)u[j] * qb[j];
            }
            total += half_to_float(d[b]) * am[b] * (float)dot + half_to_float(c[b]) * sm[b];
        }
        acc[m] = total;
    }
}

#if HAVE_AVX2
/* The same with AVX2, one block a step: VPMADDUBSW (unsigned 4-bit codes times signed input
 * bytes; for Q8_0, |q| times the input with q's sign, so no pair sum saturates), VPMADDWD to
 * int32, a float FMA by the block's two scales. */
static void row_avx2(const uint8_t *qs, const uint16_t *d, const uint16_t *c, int64_t nb,
                     int bits, const int8_t *q, const float *a, const float *s, int64_t K,
                     int mt, float *acc) {
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
            u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + b * 32)), flip);
        }
        float wd = _cvtsh_ss(d[b]);
        for (int m = 0; m < mt; m++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(q + m * K + b * 32));
            __m256i p = bits == 4 ? _mm256_maddubs_epi16(u, x)
                                  : _mm256_maddubs_epi16(_mm256_abs_epi8(u),
                                                         _mm256_sign_epi8(x, u));
            __m256i dot = _mm256_madd_epi16(p, ones);
            sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(wd * a[m * nb + b]),
                                     sum[m]);
        }
    }
    for (int m = 0; m < mt; m++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum[m]), _mm256_extractf128_ps(sum[m], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        float total = _mm_cvtss_f32(h);
        if (bits == 4) /* Q8_0 summed q itself, not u = q + 128: c = -128d is already in */
            for (int64_t b = 0; b < nb; b++) total += _cvtsh_ss(c[b]) * s[m * nb + b];
        acc[m] = total;
    }
}
#endif

#if HAVE_VNNI512
/* Float inputs (path 3): the codes widened to float32 in registers and multiplied with x as
 * it is, d * sum(u * x) + c * sum(x) per block (s holds each block's sum(x)): the dequantized
 * weight's product up to float32 rounding, no int8 rounding of x. */
static void row_float(const uint8_t *qs, const uint16_t *d, const uint16_t *c, int64_t nb,
                      int bits, const float *x, int64_t ldx, const float *s, int mt,
                      float *acc) {
    __m512 sum[4];
    for (int m = 0; m < mt; m++) sum[m] = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
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
        __m512 wd = _mm512_set1_ps(_cvtsh_ss(d[b]));
        for (int m = 0; m < mt; m++) {
            const float *xb = x + m * ldx + b * 32;
            __m512 t = _mm512_mul_ps(f0, _mm512_loadu_ps(xb));
            t = _mm512_fmadd_ps(f1, _mm512_loadu_ps(xb + 16), t);
            sum[m] = _mm512_fmadd_ps(t, wd, sum[m]);
        }
    }
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        int64_t left = nb - b0;
        __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512 cv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, c + b0));
        for (int m = 0; m < mt; m++)
            sum[m] = _mm512_fmadd_ps(cv, _mm512_maskz_loadu_ps(mask, s + m * nb + b0), sum[m]);
    }
    for (int m = 0; m < mt; m++) acc[m] = _mm512_reduce_add_ps(sum[m]);
}

/* The same with VPDPBUSD, two blocks per step; mt (1..4) constant after inlining. */
static inline __attribute__((always_inline)) void row_vnni(
    const uint8_t *qs, const uint16_t *d, const uint16_t *c, int64_t nb, int bits,
    const int8_t *q, const float *a2, const float *s, int64_t K, int mt, float *acc,
    const int8_t *x4, const float *a4) {
    __m512 sum[4];
    for (int m = 0; m < mt; m++) sum[m] = _mm512_setzero_ps();
    const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    int64_t b = 0;
    if (bits == 4) {
        /* four blocks a step: x4 holds each group of four blocks' codes as the low nibbles of
         * 64 weight bytes line up (inputs 0-15 of each block, then inputs 16-31 of each) */
        const __m512i low = _mm512_set1_epi8(0x0f);
        const __m512i quads = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        for (; b + 4 <= nb; b += 4) {
            __m512i raw = _mm512_loadu_si512((const void *)(qs + b * 16));
            __m512i lo = _mm512_and_si512(raw, low);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            uint64_t dq;
            memcpy(&dq, d + b, 8);
            __m512 wd = _mm512_permutexvar_ps(
                quads, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128((long long)dq))));
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
        uint32_t dd;
        memcpy(&dd, d + b, 4);
        __m512 wd = _mm512_permutexvar_ps(
            lanes, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dd))));
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
            const int8_t *qb = q + m * K + b * 32;
            const uint8_t *ub = qs + b * (bits == 4 ? 16 : 32);
            int32_t dot = 0;
            if (bits == 4) {
                for (int j = 0; j < 16; j++)
                    dot += (int32_t)(ub[j] & 15) * qb[j] + (int32_t)(ub[j] >> 4) * qb[j + 16];
            } else {
                for (int j = 0; j < 32; j++) dot += (int32_t)ub[j] * qb[j];
            }
            tail[m] = half_to_float(d[b]) * a2[(m * nb + b) * 8] * (float)dot;
        }
    }
    /* the offsets: sum over blocks of c * (a * sum(q)), sixteen blocks a step */
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        int64_t left = nb - b0;
        __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512 cv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, c + b0));
        for (int m = 0; m < mt; m++)
            sum[m] = _mm512_fmadd_ps(cv, _mm512_maskz_loadu_ps(mask, s + m * nb + b0), sum[m]);
    }
    for (int m = 0; m < mt; m++) acc[m] = _mm512_reduce_add_ps(sum[m]) + tail[m];
}
#endif

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) times the qb32 weight^T (+ bias).
 * bits: 4 or 8. path: 0 the best this build has, 1 the portable C loop, 2 AVX2 (where built),
 * 3 float inputs (AVX-512 builds; else the best int8 path). */
void qb32_linear(const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *qs,
                 const uint16_t *d, const uint16_t *c, int64_t N, int64_t bits,
                 const float *bias, float *out, int64_t ldo, int64_t path) {
    int64_t nb = K / 32;
    int8_t *q = malloc((size_t)(M * K + 64));
    float *a = malloc(sizeof(float) * (size_t)(M * nb));
    float *a2 = malloc(sizeof(float) * (size_t)(M * nb * 8 + 16));
    float *s = malloc(sizeof(float) * (size_t)(M * nb));
    /* x4, a4: the 4-bit VNNI path's codes, each group of four blocks as its weight bytes
     * line up (see row_vnni), and each block's scale four times */
    int8_t *x4 = malloc((size_t)(M * K + 64));
    float *a4 = malloc(sizeof(float) * (size_t)(M * nb * 4 + 16));
    for (int64_t m = 0; m < M; m++) {
        quantize_row(x + m * ldx, K, q + m * K, a + m * nb, s + m * nb);
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
    float *xs = use_float ? malloc(sizeof(float) * (size_t)(M * nb)) : NULL;
    if (use_float) /* each block's sum of x, for the c term */
        for (int64_t m = 0; m < M; m++)
            for (int64_t b = 0; b < nb; b++) {
                float t = 0.0f;
                for (int i = 0; i < 32; i++) t += x[m * ldx + b * 32 + i];
                xs[m * nb + b] = t;
            }
    if (path == 3 && !HAVE_VNNI512) path = 0;
    int use_vnni = HAVE_VNNI512 && path == 0, use_avx2 = HAVE_AVX2 && (path == 0 || path == 2);
    int64_t bb = bits == 4 ? 16 : 32;
    int64_t work = N * M * K;
#pragma omp parallel for schedule(static) if (work > (1 << 16))
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = qs + n * nb * bb;
        const uint16_t *dn = d + n * nb, *cn = c + n * nb;
        float bn = bias ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int mt = M - m0 < 4 ? (int)(M - m0) : 4;
            float acc[4];
            const int8_t *qm = q + m0 * K;
#if HAVE_VNNI512
            if (use_float) {
                row_float(qn, dn, cn, nb, (int)bits, x + m0 * ldx, ldx, xs + m0 * nb, mt, acc);
            } else if (use_vnni) {
                const float *a2m = a2 + m0 * nb * 8, *sm = s + m0 * nb, *a4m = a4 + m0 * nb * 4;
                const int8_t *x4m = x4 + m0 * K;
                switch (mt) {
                case 1: row_vnni(qn, dn, cn, nb, (int)bits, qm, a2m, sm, K, 1, acc, x4m, a4m); break;
                case 2: row_vnni(qn, dn, cn, nb, (int)bits, qm, a2m, sm, K, 2, acc, x4m, a4m); break;
                case 3: row_vnni(qn, dn, cn, nb, (int)bits, qm, a2m, sm, K, 3, acc, x4m, a4m); break;
                default: row_vnni(qn, dn, cn, nb, (int)bits, qm, a2m, sm, K, 4, acc, x4m, a4m); break;
                }
            } else
#endif
#if HAVE_AVX2
                if (use_avx2) {
                row_avx2(qn, dn, cn, nb, (int)bits, qm, a + m0 * nb, s + m0 * nb, K, mt, acc);
            } else
#endif
            {
                row_scalar(qn, dn, cn, nb, (int)bits, qm, a + m0 * nb, s + m0 * nb, K, mt,
                           acc);
            }
            for (int m = 0; m < mt; m++) out[(m0 + m) * ldo + n] = acc[m] + bn;
        }
    }
    (void)use_vnni;
    (void)use_avx2;
    free(q);
    free(a);
    free(a2);
    free(s);
    free(x4);
    free(a4);
    free(xs);
}

/* A qb32 weight as one pointer, for callers in other libraries (cpu_native.c's whole decoder
 * layer calls qb32_linear_desc through its decoder_layer_t.qlinear). */
typedef struct {
    const uint8_t *qs;
    const uint16_t *d, *c;
    int64_t N, K, bits;
    int64_t path; /* qb32_linear's */
} qb32_t;

void qb32_linear_desc(const float *x, int64_t ldx, int64_t M, const void *desc,
                      const float *bias, float *out, int64_t ldo) {
    const qb32_t *w = desc;
    qb32_linear(x, ldx, M, w->K, w->qs, w->d, w->c, w->N, w->bits, bias, out, ldo, w->path);
}
