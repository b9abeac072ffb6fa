/* Few-row linears on GGUF K-quant weights (Q4_K, Q5_K, Q6_K) in a dense layout of their own,
 * close to the file's bytes (kernels/gguf_kquants.py repacks the file's super-blocks into it,
 * builds and loads this file, and holds the torch references it is tested against).
 *
 * The layout ("kq"): a weight [N, K] with K a multiple of 256, each output row a run of records,
 * one per super-block of 256 inputs. A record's first 128 bytes are 4-bit codes, in two steps of
 * 64 bytes (128 inputs each); in a step, the 16 inputs of group g (g < 8) sit in bytes 8g..8g+7,
 * input 16g + i in the low nibble of byte 8g + i and input 16g + 8 + i in its high nibble. So the
 * int32 lanes 2g and 2g + 1 of a 512-bit dot hold group g alone, low and high nibbles alike.
 *   - Q4_K (148 bytes): the codes, eight 6-bit sub-scales sc (a byte each), eight 6-bit sub-mins
 *     m, float16 d and dmin. Input j of sub-block i (32 inputs) is d * sc[i] * u - dmin * m[i].
 *   - Q6_K (210 bytes): the low four bits of the 6-bit codes as above, then per step 32 bytes of
 *     top bit pairs (byte k: bits 4-5 the pair of the low-nibble code of byte k, bits 6-7 that of
 *     byte k + 32, bits 0-1 the high-nibble code's of byte k, bits 2-3 of byte k + 32), sixteen
 *     int8 scales (one per 16 inputs), float16 d. Input j of group g is d * scale[g] * (u - 32).
 *   - Q5_K (180 bytes): Q4_K's 148 bytes (the low four bits of the 5-bit codes), then the fifth
 *     bits, 16 bytes a step: 8 for the low-nibble codes, bit k (byte k / 8, bit k % 8) the fifth
 *     bit of the code in byte k's low nibble, then 8 the same for the high nibbles (a 64-bit
 *     byte mask a step and nibble: one masked add on AVX-512). Values as Q4_K's.
 * All are exactly the file's values; 148 / 144, 180 / 176 and 210 / 210 of the file's bytes.
 *
 * The product: as gguf_blocks.c's few-row kernel, each row of x is quantized per block of 32
 * inputs (a = max|x| / L, q = round-half-even(x / a); L = 127, or 127 * 2^14 for "float"
 * inputs held as three bytes, 127 * 2^7 for 15-bit ones held as two), and a group contributes d_g * a * sum(u * q) + c_g * a * sum(q),
 * c_g = -dmin * m (Q4_K, Q5_K) or -32 * d_g (Q6_K). VPDPBUSD on AVX-512 VNNI, a portable C loop
 * elsewhere. Steps of more rows go to gguf_blocks.c's many-row GEMM, a chunk of rows at a time
 * repacked to its layout (qb32) on the way.
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

#if HAVE_VNNI512 && defined(__GFNI__)
#define HAVE_GFNI 1
#else
#define HAVE_GFNI 0
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#define QK 256
#define LEVELS22 2080768 /* 127 * 2^14: "float" inputs */
#define LEVELS15 16256 /* 127 * 2^7: 15-bit inputs, two bytes */
enum { KQ_Q4K = 0, KQ_Q6K = 1, KQ_Q5K = 2 };
static const int64_t REC_BYTES[3] = {148, 210, 180};
#define KQ_HIGH 148 /* Q5_K: the fifth bits after the Q4_K-like fields */

int kq_has_vnni(void) { return HAVE_VNNI512; }
int kq_has_avx2(void) { return HAVE_AVX2; }

typedef void (*linear_fn)(const float *, int64_t, int64_t, const void *, const float *, float *,
                          int64_t);

/* A kq weight (gguf_kquants.py's KQDesc). path: 0 int8 inputs on the best path, 1 int8 on the
 * portable loop, 2 int8 on AVX2, 3 float inputs on the best path, 4 float on the portable loop,
 * 5 float on AVX2 (gguf_blocks.c's numbering), 6-8 the same three for 15-bit inputs (two
 * bytes); the best path is VNNI, else AVX2, else portable. Steps of more than few_rows rows go to `gemm` (gguf_blocks.c's qb32_gemm_desc)
 * where it is set. */
typedef struct {
    const uint8_t *data; /* [N][K / 256][record], or tiled (kq_rec) */
    int64_t N, K, type, path, few_rows;
    linear_fn gemm;
    int64_t tiled; /* records in tiles of KQ_TILE rows (kq_rec) */
} kq_t;

#define KQ_TILE 16

/* Record j of output row n. Row-major: row n's records in order. Tiled: rows in tiles of
 * KQ_TILE (the last one of N % KQ_TILE rows where N is not a multiple), a tile's records
 * super-block by super-block, the tile's rows side by side, so the few-row kernel's tile of 16
 * rows reads one sequential stream. */
static inline const uint8_t *kq_rec(const kq_t *w, int64_t n, int64_t j, int64_t rec) {
    int64_t nsb = w->K / QK;
    if (!w->tiled) return w->data + (n * nsb + j) * rec;
    int64_t t0 = n - n % KQ_TILE, width = w->N - t0 < KQ_TILE ? w->N - t0 : KQ_TILE;
    return w->data + (t0 * nsb + j * width + n % KQ_TILE) * rec;
}

/* What a tile prefetches: the same super-block 16 rows ahead (the next tile's, in either
 * layout); for one row of x on tiled records, 16 KiB ahead in the one stream instead. Measured
 * on one thread, the weights from memory (a 7168x1280 Q4_K, int8 inputs, one row): row-major
 * 23-25 GB/s, tiled 2 KiB ahead ~25, 8 KiB ~32, 16 KiB ~35 (a float32 sum reads 35-39); without
 * software prefetch 11. At four rows the 16 KiB distance lost (Q6_K 14 against 20 GB/s). */
#define KQ_AHEAD 16
#define KQ_AHEAD_BYTES 16384

/* gguf_blocks.c's qb32_t, field for field (gguf_kquants.py's self-check runs the GEMM through
 * it, so a change there turns these kernels off rather than computing wrong). */
typedef struct {
    const uint8_t *qs;
    const void *d, *c;
    int64_t N, K, bits, path, group, scale_bytes;
} qb32_t;

static float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal: man * 2^-24 */
        float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The 256 codes (0..15 for Q4_K, 0..31 for Q5_K, 0..63 for Q6_K) of one record, in input order. */
static void record_codes(const uint8_t *rec, int type, uint8_t *u) {
    for (int s = 0; s < 2; s++) {
        const uint8_t *c = rec + 64 * s, *h = rec + 128 + 32 * s;
        for (int k = 0; k < 64; k++) {
            int t = k / 4, i = k % 4;
            int lo = c[k] & 15, hi = c[k] >> 4;
            if (type == KQ_Q6K) {
                int hk = h[k % 32];
                lo |= (k < 32 ? (hk >> 4) & 3 : (hk >> 6) & 3) << 4;
                hi |= (k < 32 ? hk & 3 : (hk >> 2) & 3) << 4;
            } else if (type == KQ_Q5K) {
                const uint8_t *fb = rec + KQ_HIGH + 16 * s;
                lo |= ((fb[k / 8] >> (k % 8)) & 1) << 4;
                hi |= ((fb[8 + k / 8] >> (k % 8)) & 1) << 4;
            }
            u[16 * t + 8 * s + i] = (uint8_t)lo;
            u[16 * t + 8 * s + 4 + i] = (uint8_t)hi;
        }
    }
}

/* The record's scales and offsets per group of 32 (Q4_K: 8) or 16 (Q6_K: 16) inputs, float32:
 * d * sc and -(dmin * m); d * scale and -32 * (d * scale). Exact (at most 18 bits). */
static int record_scales(const uint8_t *rec, int type, float *d, float *c) {
    if (type != KQ_Q6K) { /* Q4_K, Q5_K */
        float sd = half_to_float(rec + 144), sm = half_to_float(rec + 146);
        for (int i = 0; i < 8; i++) {
            d[i] = sd * (float)rec[128 + i];
            c[i] = -(sm * (float)rec[136 + i]);
        }
        return 8;
    }
    float sd = half_to_float(rec + 208);
    for (int g = 0; g < 16; g++) {
        d[g] = sd * (float)(int8_t)rec[192 + g];
        c[g] = -32.0f * d[g];
    }
    return 16;
}

/* -- the input codes ---------------------------------------------------------------------- */

typedef struct {
    int parts;
    int64_t M, K, nsb, steps;
    int32_t *q; /* portable path: [M][K] codes */
    float *a;   /* [M][K / 32] block scales */
    int8_t *xs; /* VNNI path: [M][nsb][step][parts][2][64], the low- and high-nibble inputs */
    float *s32; /* [M][nsb][16]: a * sum(q) per 32 inputs in lanes 8-15 (0-7 zero) */
    float *s16; /* [M][nsb][16]: -32 * a * sum(q) per 16 inputs */
    float *ag;  /* VNNI path: [M][nsb][16]: group t's block scale (a of block t / 2) */
} xq_t;

static float quantize_block(const float *xb, float levels, int32_t *q) {
#if defined(__AVX512F__)
    __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    float a = amax / levels, inv = a > 0.0f ? 1.0f / a : 0.0f;
    __m512 vi = _mm512_set1_ps(inv), hi = _mm512_set1_ps(levels), lo = _mm512_set1_ps(-levels);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC; /* half to even */
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

static inline int8_t part_of(int32_t q, int parts, int p) {
    if (parts == 1) return (int8_t)q;
    if (parts == 2) return (int8_t)(p == 0 ? q >> 7 : q & 127);
    return (int8_t)(p == 0 ? q >> 14 : (p == 1 ? (q >> 7) & 127 : q & 127));
}

static int quantize_x(const float *x, int64_t ldx, int64_t M, int64_t K, int parts, int stepped,
                      xq_t *X) {
    int64_t nb = K / 32, nsb = K / QK, steps = 2 * nsb;
    memset(X, 0, sizeof *X);
    X->parts = parts, X->M = M, X->K = K, X->nsb = nsb, X->steps = steps;
    X->a = malloc(sizeof(float) * (size_t)(M * nb));
    X->s32 = calloc((size_t)(M * nsb * 16), sizeof(float));
    X->s16 = malloc(sizeof(float) * (size_t)(M * nsb * 16));
    if (stepped) {
        X->xs = aligned_alloc(64, (size_t)(M * nsb * parts * 256));
        X->ag = aligned_alloc(64, sizeof(float) * (size_t)(M * nsb * 16));
    } else {
        X->q = malloc(sizeof(int32_t) * (size_t)(M * K));
    }
    if (!X->a || !X->s32 || !X->s16 || (stepped ? !X->xs || !X->ag : !X->q)) return -1;
    float levels = parts == 1 ? 127.0f : (parts == 2 ? (float)LEVELS15 : (float)LEVELS22);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            int32_t q[32];
            float a = quantize_block(x + m * ldx + b * 32, levels, q);
            int64_t s0 = 0, s1 = 0;
            for (int i = 0; i < 16; i++) s0 += q[i];
            for (int i = 16; i < 32; i++) s1 += q[i];
            int64_t j = b / 8, i8 = b % 8;
            X->a[m * nb + b] = a;
            X->s32[(m * nsb + j) * 16 + 8 + i8] = a * (float)(s0 + s1);
            X->s16[(m * nsb + j) * 16 + 2 * i8] = -32.0f * (a * (float)s0);
            X->s16[(m * nsb + j) * 16 + 2 * i8 + 1] = -32.0f * (a * (float)s1);
            if (!stepped) {
                memcpy(X->q + m * K + b * 32, q, sizeof q);
                continue;
            }
            /* block b is groups 2(b % 8) and 2(b % 8) + 1 of super-block j: input 16t + 8s +
             * 4h + i of the super-block sits at byte 4t + i of step s, low (h = 0) or high */
            int8_t *dst = X->xs + (m * nsb + j) * parts * 256;
            for (int p = 0; p < parts; p++) {
                int8_t bytes[32];
                for (int e = 0; e < 32; e++) bytes[e] = part_of(q[e], parts, p);
                /* four inputs at a time: e = 16 (t - 2 i8) + 8 st + 4 h + i */
                for (int c = 0; c < 8; c++) {
                    int64_t t = 2 * i8 + c / 4, st = (c / 2) % 2, h = c % 2;
                    memcpy(dst + (st * parts + p) * 128 + h * 64 + 4 * t, bytes + 4 * c, 4);
                }
            }
            float *ag = X->ag + (m * nsb + j) * 16;
            ag[2 * i8] = ag[2 * i8 + 1] = a;
        }
    }
    return 0;
}

typedef void (*kq_rows_t)(const kq_t *, const xq_t *, const float *, float *, int64_t, int64_t,
                          int64_t);

static void free_x(xq_t *X) {
    free(X->q);
    free(X->a);
    free(X->xs);
    free(X->s32);
    free(X->s16);
    free(X->ag);
}

/* -- the portable path ---------------------------------------------------------------------- */

static void row_portable(const kq_t *w, const xq_t *X, int64_t n, float *out, int64_t ldo,
                         const float *bias) {
    int type = (int)w->type;
    int64_t rec = REC_BYTES[type], nsb = X->nsb, K = X->K;
    for (int64_t m = 0; m < X->M; m++) {
        const int32_t *q = X->q + m * K;
        const float *a = X->a + m * (K / 32);
        float total = 0.0f;
        for (int64_t j = 0; j < nsb; j++) {
            uint8_t u[QK];
            float d[16], c[16];
            const uint8_t *b = kq_rec(w, n, j, rec);
            record_codes(b, type, u);
            int ng = record_scales(b, type, d, c), gs = QK / ng;
            for (int g = 0; g < ng; g++) {
                int64_t dot = 0;
                for (int i = 0; i < gs; i++) dot += (int64_t)u[g * gs + i] * q[j * QK + g * gs + i];
                total += (d[g] * a[j * 8 + g * gs / 32]) * (float)dot;
            }
            const float *s = type != KQ_Q6K ? X->s32 : X->s16;
            for (int g = 0; g < ng; g++)
                total += type != KQ_Q6K ? c[g] * s[(m * nsb + j) * 16 + 8 + g]
                                        : d[g] * s[(m * nsb + j) * 16 + g];
        }
        out[m * ldo + n] = total + (bias ? bias[n] : 0.0f);
    }
}

/* -- the AVX-512 VNNI path ------------------------------------------------------------------ */

#if HAVE_VNNI512

/* R output rows from n0 times rows m0 .. m0 + MT of x (16 rows for one row of x, 4 for two, 2
 * for three or four), one super-block at a time: int32 lane t of a dot holds group t (16
 * inputs) alone, 8 of its codes a step, so both steps and all parts of the input codes
 * accumulate in one integer dot per row (two chains, a step each, added at the end; VPDPBUSD,
 * parts joined by shifts;
 * |sum| <= 16 * 63 * LEVELS22 < 2^31), converted and scaled once a super-block: the lane's
 * scale is the group's (Q4_K: d * sc of its sub-block t / 2; Q6_K: d * scale[t]) times its input
 * block's (E). Q6_K's top bit pairs are or'ed in from 32 bytes a step. The offsets once a
 * super-block too. */
static inline __attribute__((always_inline)) void kq_tile(const kq_t *w, const xq_t *X,
                                                           int64_t m0, int64_t n0, const int R,
                                                           const int MT, const int P,
                                                           const int T, float *res) {
    const int64_t rec = T == KQ_Q4K ? 148 : (T == KQ_Q5K ? 180 : 210), nsb = X->nsb;
    const int64_t rowb = nsb * rec;
    const __m512i fifth = _mm512_set1_epi8(16);
    __m512 acc[R][MT];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
    const __m512i halves = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i split = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i low = _mm512_set1_epi8(0x0f);
#if HAVE_GFNI
    /* GF2P8AFFINEQB matrices: byte 7 - i of a qword is the mask of input bits whose parity is
     * output bit i. nib_hi: bits 4-7 to 0-3. pair_lo: in the first half bits 4-5 stay, in the
     * second bits 6-7 move to 4-5; pair_hi: bits 0-1 (first half) or 2-3 (second) to 4-5. */
#define KQ_BITS(o4, o5) (((long long)(1 << (o4)) << 24) | ((long long)(1 << (o5)) << 16))
    const __m512i nib_hi = _mm512_set1_epi64(0x1020408000000000LL);
    const __m512i pair_lo = _mm512_inserti64x4(_mm512_set1_epi64(KQ_BITS(4, 5)),
                                               _mm256_set1_epi64x(KQ_BITS(6, 7)), 1);
    const __m512i pair_hi = _mm512_inserti64x4(_mm512_set1_epi64(KQ_BITS(0, 1)),
                                               _mm256_set1_epi64x(KQ_BITS(2, 3)), 1);
#undef KQ_BITS
#else
    const __m512i top = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
#endif
    for (int64_t j = 0; j < nsb; j++) {
        const int8_t *xj[MT];
        for (int m = 0; m < MT; m++) xj[m] = X->xs + ((m0 + m) * nsb + j) * P * 256;
        for (int r = 0; r < R; r++) {
            const uint8_t *b = kq_rec(w, n0 + r, j, rec);
            const char *ahead = (const char *)b + (w->tiled && MT == 1 ? KQ_AHEAD_BYTES : KQ_AHEAD * rowb);
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
            _mm_prefetch(ahead + 128, _MM_HINT_T0);
            if (T != KQ_Q4K) _mm_prefetch(ahead + 192, _MM_HINT_T0);
            /* float16 d (and Q4_K's / Q5_K's dmin after it) */
            __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(
                _mm_cvtsi32_si128(*(const int32_t *)(b + (T != KQ_Q6K ? 144 : 208)))));
            __m512 D;
            if (T != KQ_Q6K) {
                /* lanes 0-7 d * sc, 8-15 dmin * m (the sixteen bytes after the codes) */
                __m512 V = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 128)))),
                    _mm512_permutexvar_ps(split, dd));
                /* the offsets: -(dmin * m) * a * sum(q) per 32 inputs (s32 in lanes 8-15) */
                for (int m = 0; m < MT; m++)
                    acc[r][m] = _mm512_fnmadd_ps(
                        V, _mm512_loadu_ps(X->s32 + ((m0 + m) * nsb + j) * 16), acc[r][m]);
                D = _mm512_permutexvar_ps(halves, V);
            } else {
                D = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128((const __m128i *)(b + 192)))),
                                  _mm512_permutexvar_ps(_mm512_setzero_si512(), dd));
                /* the offsets: d_g * (-32 * a * sum(q)) per 16 inputs */
                for (int m = 0; m < MT; m++)
                    acc[r][m] = _mm512_fmadd_ps(
                        D, _mm512_loadu_ps(X->s16 + ((m0 + m) * nsb + j) * 16), acc[r][m]);
            }
            __m512i lo[2], hi[2];
            for (int s = 0; s < 2; s++) {
                __m512i U = _mm512_loadu_si512(b + 64 * s);
#if HAVE_GFNI
                /* GF(2) affine maps pick bits within each byte: U's high nibble down, and Q6_K's
                 * top pairs into bits 4-5 (the half decides which pair: one matrix a qword) */
                hi[s] = _mm512_gf2p8affine_epi64_epi8(U, nib_hi, 0);
                if (T == KQ_Q6K) {
                    __m512i H = _mm512_broadcast_i64x4(
                        _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * s)));
                    lo[s] = _mm512_ternarylogic_epi32(
                        U, _mm512_gf2p8affine_epi64_epi8(H, pair_lo, 0), low, 0xEC); /* (U & low) | pairs */
                    hi[s] = _mm512_or_si512(hi[s], _mm512_gf2p8affine_epi64_epi8(H, pair_hi, 0));
                } else {
                    lo[s] = _mm512_and_si512(U, low);
                }
#else
                lo[s] = _mm512_and_si512(U, low);
                hi[s] = _mm512_and_si512(_mm512_srli_epi16(U, 4), low);
                if (T == KQ_Q6K) {
                    __m512i H = _mm512_broadcast_i64x4(
                        _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * s)));
                    lo[s] = _mm512_or_si512(lo[s], _mm512_and_si512(_mm512_srlv_epi16(H, shr), top));
                    hi[s] = _mm512_or_si512(hi[s], _mm512_and_si512(_mm512_sllv_epi16(H, shl), top));
                }
#endif
                if (T == KQ_Q5K) { /* the fifth bits: one byte mask a nibble, 16 added */
                    uint64_t fl, fh;
                    memcpy(&fl, b + KQ_HIGH + 16 * s, 8);
                    memcpy(&fh, b + KQ_HIGH + 16 * s + 8, 8);
                    lo[s] = _mm512_mask_add_epi8(lo[s], (__mmask64)fl, lo[s], fifth);
                    hi[s] = _mm512_mask_add_epi8(hi[s], (__mmask64)fh, hi[s], fifth);
                }
            }
            for (int m = 0; m < MT; m++) {
                const int8_t *xr = xj[m];
                /* two chains (one a step), joined at the end: half the latency of one */
                __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
                for (int p = 0; p < P; p++) {
                    if (p) d0 = _mm512_slli_epi32(d0, 7), d1 = _mm512_slli_epi32(d1, 7);
                    const int8_t *x0 = xr + p * 128, *x1 = xr + (P + p) * 128;
                    d0 = _mm512_dpbusd_epi32(d0, lo[0], _mm512_load_si512(x0));
                    d1 = _mm512_dpbusd_epi32(d1, lo[1], _mm512_load_si512(x1));
                    d0 = _mm512_dpbusd_epi32(d0, hi[0], _mm512_load_si512(x0 + 64));
                    d1 = _mm512_dpbusd_epi32(d1, hi[1], _mm512_load_si512(x1 + 64));
                }
                __m512i dot = _mm512_add_epi32(d0, d1);
                __m512 E = _mm512_mul_ps(D, _mm512_load_ps(X->ag + ((m0 + m) * nsb + j) * 16));
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), E, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) res[r * MT + m] = _mm512_reduce_add_ps(acc[r][m]);
}

#define KQ_ROWS 16
#define KQ_COPY(NAME, P, T)                                                                       \
    static void NAME(const kq_t *w, const xq_t *X, const float *bias, float *out, int64_t ldo,   \
                     int64_t n0, int64_t nr) {                                                    \
        float res[KQ_ROWS * 4];                                                                   \
        for (int64_t m0 = 0; m0 < X->M; m0 += 4) {                                                \
            int mt = X->M - m0 < 4 ? (int)(X->M - m0) : 4;                                        \
            int R = mt == 1 ? 16 : (mt == 2 ? 4 : 2);                                              \
            int64_t n = n0;                                                                       \
            for (; n + R <= n0 + nr; n += R) {                                                    \
                switch (mt) {                                                                     \
                case 1: kq_tile(w, X, m0, n, 16, 1, P, T, res); break;                             \
                case 2: kq_tile(w, X, m0, n, 4, 2, P, T, res); break;                             \
                case 3: kq_tile(w, X, m0, n, 2, 3, P, T, res); break;                             \
                default: kq_tile(w, X, m0, n, 2, 4, P, T, res); break;                            \
                }                                                                                 \
                for (int r = 0; r < R; r++)                                                       \
                    for (int m = 0; m < mt; m++)                                                  \
                        out[(m0 + m) * ldo + n + r] = res[r * mt + m] + (bias ? bias[n + r] : 0.0f); \
            }                                                                                     \
            for (; n < n0 + nr; n++) {                                                            \
                switch (mt) {                                                                     \
                case 1: kq_tile(w, X, m0, n, 1, 1, P, T, res); break;                             \
                case 2: kq_tile(w, X, m0, n, 1, 2, P, T, res); break;                             \
                case 3: kq_tile(w, X, m0, n, 1, 3, P, T, res); break;                             \
                default: kq_tile(w, X, m0, n, 1, 4, P, T, res); break;                            \
                }                                                                                 \
                for (int m = 0; m < mt; m++)                                                      \
                    out[(m0 + m) * ldo + n] = res[m] + (bias ? bias[n] : 0.0f);                   \
            }                                                                                     \
        }                                                                                         \
    }
KQ_COPY(kq_p1_q4k, 1, KQ_Q4K)
KQ_COPY(kq_p1_q6k, 1, KQ_Q6K)
KQ_COPY(kq_p3_q4k, 3, KQ_Q4K)
KQ_COPY(kq_p3_q6k, 3, KQ_Q6K)
KQ_COPY(kq_p2_q4k, 2, KQ_Q4K)
KQ_COPY(kq_p2_q6k, 2, KQ_Q6K)
KQ_COPY(kq_p1_q5k, 1, KQ_Q5K)
KQ_COPY(kq_p2_q5k, 2, KQ_Q5K)
KQ_COPY(kq_p3_q5k, 3, KQ_Q5K)
#undef KQ_COPY
static const kq_rows_t KQ_RUNS[3][3] = {{kq_p1_q4k, kq_p1_q6k, kq_p1_q5k},
                                        {kq_p2_q4k, kq_p2_q6k, kq_p2_q5k},
                                        {kq_p3_q4k, kq_p3_q6k, kq_p3_q5k}};
#endif


/* -- the AVX2 path --------------------------------------------------------------------------- */

#if HAVE_AVX2
/* As kq_tile with 256-bit vectors: each 64-byte step is two halves of 8 int32 lanes (groups
 * 0-7 and 8-15), VPMADDUBSW on the low- and high-nibble codes against their input bytes (each
 * pair sum <= 2 * 63 * 127, and the two added <= 32004: no int16 saturates), VPMADDWD to int32,
 * both steps and all parts of a half into one dot, scaled once a super-block. */
static inline __attribute__((always_inline)) void kq_tile_avx2(const kq_t *w, const xq_t *X,
                                                                int64_t m0, int64_t n0,
                                                                const int R, const int MT,
                                                                const int P, const int T,
                                                                float *res) {
    const int64_t rec = T == KQ_Q4K ? 148 : (T == KQ_Q5K ? 180 : 210), nsb = X->nsb;
    const int64_t rowb = nsb * rec;
    /* Q5_K's fifth bits: byte i of a half takes bit i % 8 of mask byte i / 8 */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                            2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i fifth = _mm256_set1_epi8(16);
    __m256 acc[R][MT];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i first = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    const __m256i second = _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4);
    for (int64_t j = 0; j < nsb; j++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *b = kq_rec(w, n0 + r, j, rec);
            const char *ahead = (const char *)b + (w->tiled && MT == 1 ? KQ_AHEAD_BYTES : KQ_AHEAD * rowb);
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
            _mm_prefetch(ahead + 128, _MM_HINT_T0);
            if (T != KQ_Q4K) _mm_prefetch(ahead + 192, _MM_HINT_T0);
            __m128 dd = _mm_cvtph_ps(
                _mm_cvtsi32_si128(*(const int32_t *)(b + (T != KQ_Q6K ? 144 : 208))));
            __m256 d = _mm256_broadcastss_ps(dd), D0, D1;
            if (T != KQ_Q6K) {
                __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                              _mm_loadl_epi64((const __m128i *)(b + 128)))),
                                          d);
                __m256 C = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                             _mm_loadl_epi64((const __m128i *)(b + 136)))),
                                         _mm256_broadcastss_ps(_mm_movehdup_ps(dd)));
                for (int m = 0; m < MT; m++)
                    acc[r][m] = _mm256_fnmadd_ps(
                        C, _mm256_loadu_ps(X->s32 + ((m0 + m) * nsb + j) * 16 + 8), acc[r][m]);
                D0 = _mm256_permutevar8x32_ps(sc, first);
                D1 = _mm256_permutevar8x32_ps(sc, second);
            } else {
                D0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                       _mm_loadl_epi64((const __m128i *)(b + 192)))),
                                   d);
                D1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                       _mm_loadl_epi64((const __m128i *)(b + 200)))),
                                   d);
                for (int m = 0; m < MT; m++) {
                    const float *s16 = X->s16 + ((m0 + m) * nsb + j) * 16;
                    acc[r][m] = _mm256_fmadd_ps(D0, _mm256_loadu_ps(s16), acc[r][m]);
                    acc[r][m] = _mm256_fmadd_ps(D1, _mm256_loadu_ps(s16 + 8), acc[r][m]);
                }
            }
            for (int h = 0; h < 2; h++) {
                __m256i lo[2], hi[2];
                for (int s = 0; s < 2; s++) {
                    __m256i U = _mm256_loadu_si256((const __m256i *)(b + 64 * s + 32 * h));
                    lo[s] = _mm256_and_si256(U, low);
                    hi[s] = _mm256_and_si256(_mm256_srli_epi16(U, 4), low);
                    if (T == KQ_Q6K) {
                        __m256i H = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * s));
                        __m256i pl = h ? _mm256_srli_epi32(H, 2) : H;
                        __m256i ph = h ? _mm256_slli_epi32(H, 2) : _mm256_slli_epi32(H, 4);
                        lo[s] = _mm256_or_si256(lo[s], _mm256_and_si256(pl, top));
                        hi[s] = _mm256_or_si256(hi[s], _mm256_and_si256(ph, top));
                    }
                    if (T == KQ_Q5K) {
                        int32_t fl, fh;
                        memcpy(&fl, b + KQ_HIGH + 16 * s + 4 * h, 4);
                        memcpy(&fh, b + KQ_HIGH + 16 * s + 8 + 4 * h, 4);
                        __m256i ml = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(fl), spread), bit);
                        __m256i mh = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(fh), spread), bit);
                        lo[s] = _mm256_or_si256(lo[s], _mm256_and_si256(_mm256_cmpeq_epi8(ml, bit), fifth));
                        hi[s] = _mm256_or_si256(hi[s], _mm256_and_si256(_mm256_cmpeq_epi8(mh, bit), fifth));
                    }
                }
                for (int m = 0; m < MT; m++) {
                    const int8_t *xr = X->xs + ((m0 + m) * nsb + j) * P * 256 + 32 * h;
                    __m256i dot = _mm256_setzero_si256();
                    for (int p = 0; p < P; p++) {
                        if (p) dot = _mm256_slli_epi32(dot, 7);
                        for (int s = 0; s < 2; s++) {
                            const int8_t *xp = xr + (s * P + p) * 128;
                            __m256i pr = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo[s], _mm256_load_si256((const __m256i *)xp)),
                                _mm256_maddubs_epi16(hi[s],
                                                     _mm256_load_si256((const __m256i *)(xp + 64))));
                            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pr, ones));
                        }
                    }
                    __m256 E = _mm256_mul_ps(
                        h ? D1 : D0, _mm256_load_ps(X->ag + ((m0 + m) * nsb + j) * 16 + 8 * h));
                    acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), E, acc[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) {
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r][m]),
                                  _mm256_extractf128_ps(acc[r][m], 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            res[r * MT + m] = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
        }
}

#define KQ2_ROWS 4
#define KQ2_COPY(NAME, P, T)                                                                      \
    static void NAME(const kq_t *w, const xq_t *X, const float *bias, float *out, int64_t ldo,   \
                     int64_t n0, int64_t nr) {                                                    \
        float res[KQ2_ROWS * 4];                                                                  \
        for (int64_t m0 = 0; m0 < X->M; m0 += 4) {                                                \
            int mt = X->M - m0 < 4 ? (int)(X->M - m0) : 4;                                        \
            int R = mt == 1 ? 4 : (mt == 2 ? 2 : 1);                                              \
            int64_t n = n0;                                                                       \
            for (; n + R <= n0 + nr; n += R) {                                                    \
                switch (mt) {                                                                     \
                case 1: kq_tile_avx2(w, X, m0, n, 4, 1, P, T, res); break;                        \
                case 2: kq_tile_avx2(w, X, m0, n, 2, 2, P, T, res); break;                        \
                case 3: kq_tile_avx2(w, X, m0, n, 1, 3, P, T, res); break;                        \
                default: kq_tile_avx2(w, X, m0, n, 1, 4, P, T, res); break;                       \
                }                                                                                 \
                for (int r = 0; r < R; r++)                                                       \
                    for (int m = 0; m < mt; m++)                                                  \
                        out[(m0 + m) * ldo + n + r] = res[r * mt + m] + (bias ? bias[n + r] : 0.0f); \
            }                                                                                     \
            for (; n < n0 + nr; n++) {                                                            \
                switch (mt) {                                                                     \
                case 1: kq_tile_avx2(w, X, m0, n, 1, 1, P, T, res); break;                        \
                case 2: kq_tile_avx2(w, X, m0, n, 1, 2, P, T, res); break;                        \
                default: break; /* R is 1 for three or four rows: never left over */              \
                }                                                                                 \
                for (int m = 0; m < mt; m++)                                                      \
                    out[(m0 + m) * ldo + n] = res[m] + (bias ? bias[n] : 0.0f);                   \
            }                                                                                     \
        }                                                                                         \
    }
KQ2_COPY(kq2_p1_q4k, 1, KQ_Q4K)
KQ2_COPY(kq2_p1_q6k, 1, KQ_Q6K)
KQ2_COPY(kq2_p3_q4k, 3, KQ_Q4K)
KQ2_COPY(kq2_p3_q6k, 3, KQ_Q6K)
KQ2_COPY(kq2_p2_q4k, 2, KQ_Q4K)
KQ2_COPY(kq2_p2_q6k, 2, KQ_Q6K)
KQ2_COPY(kq2_p1_q5k, 1, KQ_Q5K)
KQ2_COPY(kq2_p2_q5k, 2, KQ_Q5K)
KQ2_COPY(kq2_p3_q5k, 3, KQ_Q5K)
#undef KQ2_COPY
static const kq_rows_t KQ2_RUNS[3][3] = {{kq2_p1_q4k, kq2_p1_q6k, kq2_p1_q5k},
                                         {kq2_p2_q4k, kq2_p2_q6k, kq2_p2_q5k},
                                         {kq2_p3_q4k, kq2_p3_q6k, kq2_p3_q5k}};
#endif

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) times the weight^T (+ bias), x quantized
 * per block of 32 (int8, or 22-bit for "float" inputs). */
void kq_linear_desc(const float *x, int64_t ldx, int64_t M, const void *desc, const float *bias,
                    float *out, int64_t ldo) {
    const kq_t *w = desc;
    int64_t N = w->N, K = w->K, path = w->path;
    int parts = path >= 6 ? 2 : (path >= 3 ? 3 : 1), how = (int)(path % 3); /* 0 best, 1 portable, 2 AVX2 */
    int use_vnni = HAVE_VNNI512 && how == 0;
    int use_avx2 = HAVE_AVX2 && (how == 2 || (how == 0 && !HAVE_VNNI512));
    xq_t X;
    if (quantize_x(x, ldx, M, K, parts, use_vnni || use_avx2, &X)) { /* out of memory: NaNs, never garbage */
        free_x(&X);
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) out[m * ldo + n] = NAN;
        return;
    }
    int parallel = N * M * K > (1 << 16);
#if HAVE_VNNI512
    if (use_vnni) {
        kq_rows_t run = KQ_RUNS[parts - 1][w->type];
        int64_t tiles = (N + KQ_ROWS - 1) / KQ_ROWS;
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t n0 = t * KQ_ROWS;
            run(w, &X, bias, out, ldo, n0, N - n0 < KQ_ROWS ? N - n0 : KQ_ROWS);
        }
        free_x(&X);
        return;
    }
#endif
#if HAVE_AVX2
    if (use_avx2) {
        kq_rows_t run = KQ2_RUNS[parts - 1][w->type];
        int64_t tiles = (N + KQ2_ROWS - 1) / KQ2_ROWS;
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t n0 = t * KQ2_ROWS;
            run(w, &X, bias, out, ldo, n0, N - n0 < KQ2_ROWS ? N - n0 : KQ2_ROWS);
        }
        free_x(&X);
        return;
    }
#endif
    (void)use_avx2;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n = 0; n < N; n++) row_portable(w, &X, n, out, ldo, bias);
    free_x(&X);
}

/* Rows [n0, n0 + nr) of the weight in gguf_blocks.c's qb32 layout (float32 scales): Q4_K as
 * 4-bit codes in 32-input blocks (byte i: input i low, i + 16 high), d * sc and -(dmin * m) per
 * 32; Q5_K a byte a code, the same scales; Q6_K a byte a code, d * scale and -32 * (d * scale)
 * per 16. The same values exactly. */
void kq_to_qb32(const void *desc, int64_t n0, int64_t nr, uint8_t *qs, float *d, float *c) {
    const kq_t *w = desc;
    int type = (int)w->type;
    int64_t rec = REC_BYTES[type], nsb = w->K / QK, bb = type == KQ_Q4K ? 128 : 256;
    int64_t ng = type == KQ_Q6K ? 16 : 8;
#pragma omp parallel for schedule(static) if (nr * w->K > (1 << 18))
    for (int64_t r = 0; r < nr; r++) {
        for (int64_t j = 0; j < nsb; j++) {
            uint8_t u[QK];
            int64_t at = r * nsb + j;
            const uint8_t *b = kq_rec(w, n0 + r, j, rec);
            record_codes(b, type, u);
            record_scales(b, type, d + at * ng, c + at * ng);
            uint8_t *o = qs + at * bb;
            if (type != KQ_Q4K) {
                memcpy(o, u, QK);
                continue;
            }
            for (int b = 0; b < 8; b++)
                for (int i = 0; i < 16; i++)
                    o[b * 16 + i] = (uint8_t)(u[b * 32 + i] | (u[b * 32 + 16 + i] << 4));
        }
    }
}

#define KQ_CHUNK 256 /* weight rows repacked at a time for the GEMM */

/* Steps of <= few_rows rows: the few-row kernel; more: gguf_blocks.c's GEMM on chunks of rows
 * repacked to qb32 (x as it is), or the few-row kernel where no GEMM was given. */
void kq_steps_desc(const float *x, int64_t ldx, int64_t M, const void *desc, const float *bias,
                   float *out, int64_t ldo) {
    const kq_t *w = desc;
    if (M <= w->few_rows || !w->gemm) {
        kq_linear_desc(x, ldx, M, desc, bias, out, ldo);
        return;
    }
    int type = (int)w->type;
    int64_t K = w->K, ng = type == KQ_Q6K ? K / 16 : K / 32, cb = type == KQ_Q4K ? K / 2 : K;
    int64_t bits = type == KQ_Q4K ? 4 : (type == KQ_Q5K ? 5 : 6);
    uint8_t *qs = malloc((size_t)(KQ_CHUNK * cb));
    float *d = malloc(sizeof(float) * (size_t)(KQ_CHUNK * ng));
    float *c = malloc(sizeof(float) * (size_t)(KQ_CHUNK * ng));
    if (qs && d && c) {
        for (int64_t n0 = 0; n0 < w->N; n0 += KQ_CHUNK) {
            int64_t nr = w->N - n0 < KQ_CHUNK ? w->N - n0 : KQ_CHUNK;
            kq_to_qb32(desc, n0, nr, qs, d, c);
            qb32_t q = {qs, d, c, nr, K, bits, 0, type == KQ_Q6K ? 16 : 32, 4};
            w->gemm(x, ldx, M, &q, bias ? bias + n0 : NULL, out + n0, ldo);
        }
    } else {
        kq_linear_desc(x, ldx, M, desc, bias, out, ldo);
    }
    free(qs);
    free(d);
    free(c);
}

/* out[r, K] = the dequantized rows idx[r] (the token embedding's lookup): u * d + c per group,
 * as the reference computes it (u * d exact, one rounding). */
void kq_rows_desc(const void *desc, const int64_t *idx, int64_t count, float *out) {
    const kq_t *w = desc;
    int type = (int)w->type;
    int64_t K = w->K, rec = REC_BYTES[type], nsb = K / QK;
#pragma omp parallel for schedule(static) if (count * K > (1 << 16))
    for (int64_t r = 0; r < count; r++) {
        int64_t n = idx[r];
        if (n < 0 || n >= w->N) {
            memset(out + r * K, 0, sizeof(float) * (size_t)K);
            continue;
        }
        for (int64_t j = 0; j < nsb; j++) {
            const uint8_t *b = kq_rec(w, n, j, rec);
            uint8_t u[QK];
            float d[16], c[16];
            record_codes(b, type, u);
            int ng = record_scales(b, type, d, c), gs = QK / ng;
            for (int i = 0; i < QK; i++)
                out[r * K + j * QK + i] = (float)u[i] * d[i / gs] + c[i / gs];
        }
    }
}

/* A linear of several parts stacked along its outputs, each run by its own function (a kq part
 * by kq_steps_desc, a qb32 part by gguf_blocks.c's qb32_steps_desc), so a fused q/k/v or
 * gate/up whose tensors have different types keeps each in its own layout. The whole-layer
 * decode (cpu_native.c's decoder_layer_t.qlinear) calls it with a kq_multi_t. */
typedef struct {
    linear_fn fn;
    const void *desc;
    int64_t n0;
} kq_part_t;

typedef struct {
    int64_t count;
    const kq_part_t *parts;
} kq_multi_t;

void kq_multi_desc(const float *x, int64_t ldx, int64_t M, const void *desc, const float *bias,
                   float *out, int64_t ldo) {
    const kq_multi_t *mp = desc;
    for (int64_t i = 0; i < mp->count; i++) {
        const kq_part_t *p = mp->parts + i;
        p->fn(x, ldx, M, p->desc, bias ? bias + p->n0 : NULL, out + p->n0, ldo);
    }
}

/* -- the repack from the file's blocks (what gguf_kquants.py's from_file_blocks does in numpy,
 * done here at load: ~10x faster) ------------------------------------------------------------ */

/* The record's code bytes (and Q6_K's pair bytes) from codes u[256] in input order. */
static void pack_codes(const uint8_t *u, int type, uint8_t *rec) {
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < 64; k++) {
            int t = k / 4, i = k % 4;
            uint8_t lo = u[16 * t + 8 * s + i], hi = u[16 * t + 8 * s + 4 + i];
            rec[64 * s + k] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
        }
    if (type == KQ_Q5K) {
        uint8_t *fb = rec + KQ_HIGH;
        memset(fb, 0, 32);
        for (int s = 0; s < 2; s++)
            for (int k = 0; k < 64; k++) {
                int t = k / 4, i = k % 4;
                fb[16 * s + k / 8] |= (uint8_t)(((u[16 * t + 8 * s + i] >> 4) & 1) << (k % 8));
                fb[16 * s + 8 + k / 8] |= (uint8_t)(((u[16 * t + 8 * s + 4 + i] >> 4) & 1) << (k % 8));
            }
        return;
    }
    if (type != KQ_Q6K) return;
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < 32; k++) {
            int t0 = k / 4, t1 = (k + 32) / 4, i = k % 4;
            int pl0 = u[16 * t0 + 8 * s + i] >> 4, ph0 = u[16 * t0 + 8 * s + 4 + i] >> 4;
            int pl1 = u[16 * t1 + 8 * s + i] >> 4, ph1 = u[16 * t1 + 8 * s + 4 + i] >> 4;
            rec[128 + 32 * s + k] = (uint8_t)((pl0 << 4) | (pl1 << 6) | ph0 | (ph1 << 2));
        }
}

/* `count` file super-blocks of `type` (Q4_K: 144 bytes, Q5_K: 176, Q6_K: 210) at `raw` into
 * records at `out` (148, 180 or 210 bytes each). */
void kq_from_file(const uint8_t *raw, int64_t count, int64_t type, uint8_t *out) {
#pragma omp parallel for schedule(static) if (count > 4096)
    for (int64_t j = 0; j < count; j++) {
        uint8_t u[QK];
        if (type == KQ_Q4K || type == KQ_Q5K) {
            int five = type == KQ_Q5K;
            const uint8_t *b = raw + j * (five ? 176 : 144), *q = b + (five ? 48 : 16), *sc = b + 4;
            const uint8_t *qh = b + 16; /* Q5_K: bit i of byte l, the fifth bit of sub-block i's input l */
            uint8_t *r = out + j * (five ? 180 : 148);
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    u[64 * k + l] = q[32 * k + l] & 15;
                    u[64 * k + 32 + l] = q[32 * k + l] >> 4;
                    if (five) {
                        u[64 * k + l] |= (uint8_t)(((qh[l] >> (2 * k)) & 1) << 4);
                        u[64 * k + 32 + l] |= (uint8_t)(((qh[l] >> (2 * k + 1)) & 1) << 4);
                    }
                }
            pack_codes(u, (int)type, r);
            for (int i = 0; i < 4; i++) { /* 6-bit sub-scales and sub-mins: gguf_blocks._k_scales */
                r[128 + i] = sc[i] & 63;
                r[136 + i] = sc[4 + i] & 63;
                r[128 + 4 + i] = (uint8_t)((sc[8 + i] & 15) | ((sc[i] >> 6) << 4));
                r[136 + 4 + i] = (uint8_t)((sc[8 + i] >> 4) | ((sc[4 + i] >> 6) << 4));
            }
            memcpy(r + 144, b, 4); /* d, dmin */
        } else {
            const uint8_t *b = raw + j * 210;
            for (int n = 0; n < 2; n++) {
                const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
                for (int l = 0; l < 32; l++) {
                    u[128 * n + l] = (uint8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                    u[128 * n + l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                    u[128 * n + l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    u[128 * n + l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
            uint8_t *r = out + j * 210;
            pack_codes(u, KQ_Q6K, r);
            memcpy(r + 192, b + 192, 18); /* scales, d */
        }
    }
}
