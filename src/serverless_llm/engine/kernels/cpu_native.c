/* The CPU path's fused kernels, float32 (kernels/cpu_native.py builds and loads this file, and
 * holds the torch references they are tested against).
 *
 * Why native code: on a CPU one request's decode step is ~2,000 small torch ops (norms, rotary,
 * the KV write, the gather-and-matmul attention), each a few microseconds of dispatch, besides
 * the linears. Each function here does one such group in one call, reading the paged cache in
 * place (no gather copy); and the linears have a GEMM of their own for the row counts of decode
 * steps. Built with -ffp-contract=off: no implicitly fused multiply-adds, so the element-wise
 * parts (rotary, the KV write, residual adds) round exactly as the torch ops do; reductions
 * (norm statistics, attention, the linears' explicit FMAs) sum in another order than torch.
 *
 * Threads: OpenMP, linked against the libgomp torch has already loaded (one runtime, one team,
 * sized by torch.set_num_threads), used only where a call has enough work to pay for a team.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* An explicit fused multiply-add (the build turns off implicit contraction). */
#ifdef __FMA__
#define MUL_ADD(a, b, c) fmaf((a), (b), (c)) /* one instruction where the target has FMA */
#else
#define MUL_ADD(a, b, c) ((a) * (b) + (c))
#endif

/* What every layer of one step shares. */
typedef struct {
    int64_t num_tokens;     /* T: rows of q, k, v */
    int64_t num_decodes;    /* the first num_decodes rows are decodes: one query each */
    const int64_t *positions;    /* [T] */
    const int64_t *slot_mapping; /* [T]: cache slot of each row's K/V; < 0: not written */
    const int32_t *block_tables; /* [requests, bt_stride]: rows 0..num_decodes-1 are read */
    const int32_t *seq_lens;     /* [requests] */
    int64_t bt_stride;
    int64_t block_size;
} step_t;

/* One attention layer. */
typedef struct {
    int64_t num_heads, num_kv_heads, head_dim;
    float scale;
    float softcap;         /* 0: none */
    const float *slopes;   /* [num_heads] ALiBi slopes, or NULL */
    int64_t window;        /* 0: none; else a query sees keys p - window < j <= p */
    float *k_cache;        /* [blocks, block_size, num_kv_heads, head_dim] at the strides below */
    float *v_cache;
    const float *rope;     /* NULL, or [max_position, rot_dim]: cos half, then sin half */
    int64_t rot_dim;
    int64_t is_neox;       /* 1: rotate halves; 0: interleaved pairs (GPT-J) */
    float clip;            /* 0: none; else q, k, v clamped to [-clip, clip] first */
    int64_t qk_norm;       /* 0: none; 1: RMSNorm over each head; 2: RMSNorm over all heads;
                              3: LayerNorm over each head, a weight per head (no bias);
                              4: LayerNorm over each head, one weight and bias for all heads */
    const float *q_norm;   /* its weights: [head_dim] (1, 4), [heads * head_dim] (2, 3) */
    const float *k_norm;
    float qk_eps;
    const float *q_norm_bias; /* [head_dim] (4), else NULL */
    const float *k_norm_bias;
    const float *sinks;    /* [num_heads] sink logits (gpt-oss): one more softmax term each,
                              with no value; or NULL */
    int64_t chunk;         /* 0: none; else chunked local attention (Llama 4): a query at p
                              sees keys p - p % chunk <= j <= p, its own chunk's */
    int64_t block_stride;  /* floats between blocks, heads and tokens of k_cache and v_cache
                              (head_dim contiguous); 0: the head-major cache's own, */
    int64_t head_stride;   /* num_kv_heads * block_size * head_dim, block_size * head_dim and */
    int64_t token_stride;  /* head_dim. A layer view of narrower entries inside a wider layer's
                              tensor (Gemma 4: kv_cache.layer_view) has the wide tensor's. */
} layer_t;

/* The cache strides of layer L, its zeros (a struct that leaves them unset) made the
 * head-major cache's own. */
static inline void cache_strides(const layer_t *L, int64_t bs, int64_t *sb, int64_t *sh,
                                 int64_t *st) {
    int64_t D = L->head_dim;
    *st = L->token_stride ? L->token_stride : D;
    *sh = L->head_stride ? L->head_stride : bs * D;
    *sb = L->block_stride ? L->block_stride : L->num_kv_heads * bs * D;
}

static inline float sum_squares(const float *x, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += x[i] * x[i];
    return acc;
}

/* x <- weight * (x / sqrt(mean(x^2) + eps)), as rms_norm_reference in float32. */
static inline void rms_inplace(float *x, const float *w, int64_t n, float eps) {
    float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] = w[i] * (x[i] * r);
}

/* x <- (x - mean) / sqrt(var + eps) * w + b over n floats (w, b may be NULL), as F.layer_norm
 * in float32. */
static inline void layer_norm_inplace(float *x, const float *w, const float *b, int64_t n,
                                      float eps) {
    float mean = 0.0f;
#pragma omp simd reduction(+ : mean)
    for (int64_t i = 0; i < n; i++) mean += x[i];
    mean /= (float)n;
    float var = 0.0f;
#pragma omp simd reduction(+ : var)
    for (int64_t i = 0; i < n; i++) var += (x[i] - mean) * (x[i] - mean);
    float inv = 1.0f / sqrtf(var / (float)n + eps);
    for (int64_t i = 0; i < n; i++) {
        float h = (x[i] - mean) * inv;
        if (w) h = h * w[i];
        if (b) h = h + b[i];
        x[i] = h;
    }
}

static inline void rotate(float *x, const float *cs, int64_t rot_dim, int64_t is_neox) {
    int64_t half = rot_dim / 2;
    const float *c = cs, *s = cs + half;
    if (is_neox) {
        for (int64_t i = 0; i < half; i++) {
            float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i] + x1 * s[i];
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            float x1 = x[2 * i], x2 = x[2 * i + 1];
            x[2 * i] = x1 * c[i] - x2 * s[i];
            x[2 * i + 1] = x2 * c[i] + x1 * s[i];
        }
    }
}

static inline void clamp(float *x, int64_t n, float lim) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] < -lim ? -lim : (x[i] > lim ? lim : x[i]);
}

/* Clip, q/k norm and rotary of row t, in place. */
static void prepare_row(const layer_t *L, const step_t *S, int64_t t, float *q, float *k,
                        float *v) {
    int64_t H = L->num_heads, KVH = L->num_kv_heads, D = L->head_dim;
    if (L->clip > 0) {
        clamp(q, H * D, L->clip);
        clamp(k, KVH * D, L->clip);
        clamp(v, KVH * D, L->clip);
    }
    if (L->qk_norm == 1) {
        for (int64_t h = 0; h < H; h++) rms_inplace(q + h * D, L->q_norm, D, L->qk_eps);
        for (int64_t h = 0; h < KVH; h++) rms_inplace(k + h * D, L->k_norm, D, L->qk_eps);
    } else if (L->qk_norm == 2) {
        rms_inplace(q, L->q_norm, H * D, L->qk_eps);
        rms_inplace(k, L->k_norm, KVH * D, L->qk_eps);
    } else if (L->qk_norm == 3) {
        for (int64_t h = 0; h < H; h++)
            layer_norm_inplace(q + h * D, L->q_norm + h * D, NULL, D, L->qk_eps);
        for (int64_t h = 0; h < KVH; h++)
            layer_norm_inplace(k + h * D, L->k_norm + h * D, NULL, D, L->qk_eps);
    } else if (L->qk_norm == 4) {
        for (int64_t h = 0; h < H; h++)
            layer_norm_inplace(q + h * D, L->q_norm, L->q_norm_bias, D, L->qk_eps);
        for (int64_t h = 0; h < KVH; h++)
            layer_norm_inplace(k + h * D, L->k_norm, L->k_norm_bias, D, L->qk_eps);
    }
    if (L->rope) {
        const float *cs = L->rope + S->positions[t] * L->rot_dim;
        for (int64_t h = 0; h < H; h++) rotate(q + h * D, cs, L->rot_dim, L->is_neox);
        for (int64_t h = 0; h < KVH; h++) rotate(k + h * D, cs, L->rot_dim, L->is_neox);
    }
}

static void write_row(const layer_t *L, const step_t *S, int64_t t, const float *k,
                      const float *v) {
    int64_t slot = S->slot_mapping[t];
    if (slot < 0) return;
    int64_t KVH = L->num_kv_heads, D = L->head_dim, bs = S->block_size, sb, sh, st;
    cache_strides(L, bs, &sb, &sh, &st);
    int64_t blk = slot / bs, off = slot % bs;
    for (int64_t h = 0; h < KVH; h++) {
        int64_t at = blk * sb + h * sh + off * st;
        memcpy(L->k_cache + at, k + h * D, D * sizeof(float));
        memcpy(L->v_cache + at, v + h * D, D * sizeof(float));
    }
}

/* exp(x) for x <= 0 (softmax terms), within ~1 ulp of expf: x = k ln2 + r with |r| <= ln2/2
 * (ln2 split in two parts so r is exact), exp(r) by Cephes' degree-6 polynomial, times 2^k
 * built in the exponent bits. Inline arithmetic only, so a loop of it vectorizes (expf is a
 * scalar libm call, and was most of the attention's time). Below -87 (where expf nears the
 * smallest normal float) it returns exp(-87), ~1.6e-38: nothing against the maximum's 1. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    union {
        int32_t i;
        float f;
    } two_k = {.i = ((int32_t)k + 127) << 23};
    return y * two_k.f;
}

/* s[t] = q . keys[t] for n keys of D floats, `stride` floats apart: four keys at a time, so
 * four independent sums hide the adds' latency. */
static inline void key_dots(const float *q, const float *keys, int64_t n, int64_t D,
                            int64_t stride, float *s) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k0 = keys + t * stride, *k1 = k0 + stride, *k2 = k1 + stride,
                    *k3 = k2 + stride;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t d = 0; d < D; d++) {
            float x = q[d];
            a0 += k0[d] * x;
            a1 += k1[d] * x;
            a2 += k2[d] * x;
            a3 += k3[d] * x;
        }
        s[t] = a0;
        s[t + 1] = a1;
        s[t + 2] = a2;
        s[t + 3] = a3;
    }
    for (; t < n; t++) {
        const float *kt = keys + t * stride;
        float a = 0.0f;
#pragma omp simd reduction(+ : a)
        for (int64_t d = 0; d < D; d++) a += kt[d] * q[d];
        s[t] = a;
    }
}

/* 16 floats as one vector (a zmm register with AVX-512, two ymm with AVX2); v16u: the same,
 * loaded and stored at any float's alignment. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

/* key_dots for three query heads at once (q, q + D, q + 2D; scores s, s + ld, s + 2 ld): each
 * key row is loaded once for the three (a KV head's group of query heads), four keys at a time,
 * twelve independent sums. */
static inline void key_dots3(const float *q, const float *keys, int64_t n, int64_t D,
                             int64_t stride, float *s, int64_t ld) {
    const float *q0 = q, *q1 = q + D, *q2 = q + 2 * D;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k0 = keys + t * stride, *k1 = k0 + stride, *k2 = k1 + stride,
                    *k3 = k2 + stride;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f,
              b3 = 0.0f, c0 = 0.0f, c1 = 0.0f, c2 = 0.0f, c3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3)
        for (int64_t d = 0; d < D; d++) {
            float x0 = q0[d], x1 = q1[d], x2 = q2[d];
            float y0 = k0[d], y1 = k1[d], y2 = k2[d], y3 = k3[d];
            a0 += y0 * x0;
            a1 += y1 * x0;
            a2 += y2 * x0;
            a3 += y3 * x0;
            b0 += y0 * x1;
            b1 += y1 * x1;
            b2 += y2 * x1;
            b3 += y3 * x1;
            c0 += y0 * x2;
            c1 += y1 * x2;
            c2 += y2 * x2;
            c3 += y3 * x2;
        }
        s[t] = a0, s[t + 1] = a1, s[t + 2] = a2, s[t + 3] = a3;
        s[ld + t] = b0, s[ld + t + 1] = b1, s[ld + t + 2] = b2, s[ld + t + 3] = b3;
        s[2 * ld + t] = c0, s[2 * ld + t + 1] = c1, s[2 * ld + t + 2] = c2, s[2 * ld + t + 3] = c3;
    }
    if (t < n)
        for (int g = 0; g < 3; g++) key_dots(q + g * D, keys + t * stride, n - t, D, stride,
                                             s + g * ld + t);
}

/* key_dots for two query heads at once (q, q + D; scores s, s + ld). */
static inline void key_dots2(const float *q, const float *keys, int64_t n, int64_t D,
                             int64_t stride, float *s, int64_t ld) {
    const float *q0 = q, *q1 = q + D;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k0 = keys + t * stride, *k1 = k0 + stride, *k2 = k1 + stride,
                    *k3 = k2 + stride;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f,
              b3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
        for (int64_t d = 0; d < D; d++) {
            float x0 = q0[d], x1 = q1[d];
            float y0 = k0[d], y1 = k1[d], y2 = k2[d], y3 = k3[d];
            a0 += y0 * x0;
            a1 += y1 * x0;
            a2 += y2 * x0;
            a3 += y3 * x0;
            b0 += y0 * x1;
            b1 += y1 * x1;
            b2 += y2 * x1;
            b3 += y3 * x1;
        }
        s[t] = a0, s[t + 1] = a1, s[t + 2] = a2, s[t + 3] = a3;
        s[ld + t] = b0, s[ld + t + 1] = b1, s[ld + t + 2] = b2, s[ld + t + 3] = b3;
    }
    if (t < n)
        for (int g = 0; g < 2; g++) key_dots(q + g * D, keys + t * stride, n - t, D, stride,
                                             s + g * ld + t);
}

/* The scores of G query heads (q, q + D, ...; scores s + g * ld) against n keys: heads in threes
 * and twos, so each key row loaded serves several heads. */
static inline void key_dots_heads(const float *q, int64_t G, const float *keys, int64_t n,
                                  int64_t D, int64_t stride, float *s, int64_t ld) {
    int64_t g = 0;
    for (; G - g >= 3 && G - g != 4; g += 3)
        key_dots3(q + g * D, keys, n, D, stride, s + g * ld, ld);
    for (; G - g >= 2; g += 2) key_dots2(q + g * D, keys, n, D, stride, s + g * ld, ld);
    if (g < G) key_dots(q + g * D, keys, n, D, stride, s + g * ld);
}

/* Asks for the cache lines of one (block, head) row of the cache, `bs` tokens of D floats
 * `st` apart from `row`: the next block of a request is anywhere in memory, where the hardware
 * prefetcher cannot guess it. */
static inline void prefetch_block(const float *row, int64_t bs, int64_t D, int64_t st) {
    if (st == D) {
        const char *at = (const char *)row;
        for (int64_t off = 0; off < bs * D * (int64_t)sizeof(float); off += 64)
            __builtin_prefetch(at + off, 0, 3);
        return;
    }
    for (int64_t t = 0; t < bs; t++) {
        const char *at = (const char *)(row + t * st);
        for (int64_t off = 0; off < D * (int64_t)sizeof(float); off += 64)
            __builtin_prefetch(at + off, 0, 3);
    }
}

/* The first key the query at position p sees: 0, or its window's or chunk's first. */
static inline int64_t first_key(const layer_t *L, int64_t p) {
    int64_t first = (L->window > 0 && p - L->window + 1 > 0) ? p - L->window + 1 : 0;
    if (L->chunk > 0 && p - p % L->chunk > first) first = p - p % L->chunk;
    return first;
}

/* One decode's attention for one KV head and its group of query heads: scores (scaled,
 * soft-capped, ALiBi, windowed or chunked), softmax (with the head's sink), weighted values, a
 * cache block at a time. `buf`
 * holds group * (keys it reads) floats. */
static void attend_one(const layer_t *L, const step_t *S, int64_t i, int64_t kh, const float *q,
                       int64_t q_stride, float *out, int64_t out_stride, float *buf) {
    int64_t H = L->num_heads, KVH = L->num_kv_heads, D = L->head_dim, bs = S->block_size;
    int64_t G = H / KVH, sb, sh, st;
    cache_strides(L, bs, &sb, &sh, &st);
    int64_t len = S->seq_lens[i], p = len - 1;
    int64_t first = first_key(L, p);
    int64_t n = len - first;
    const int32_t *table = S->block_tables + i * S->bt_stride;
    const float *qi = q + i * q_stride + kh * G * D;
    float *oi = out + i * out_stride + kh * G * D;
    /* Keys first..len-1 lie in blocks first/bs..(len-1)/bs; block b holds keys
     * [b * bs + t0, b * bs + t1) of them. */
    for (int64_t b = first / bs; b * bs < len; b++) {
        int64_t t0 = b * bs < first ? first - b * bs : 0;
        int64_t t1 = (b + 1) * bs <= len ? bs : len - b * bs;
        const float *kb = L->k_cache + table[b] * sb + kh * sh;
        if ((b + 1) * bs < len)
            prefetch_block(L->k_cache + table[b + 1] * sb + kh * sh, bs, D, st);
        key_dots_heads(qi, G, kb + t0 * st, t1 - t0, D, st, buf + (b * bs + t0 - first), n);
    }
    for (int64_t g = 0; g < G; g++) {
        float *sc = buf + g * n;
        float slope = L->slopes ? L->slopes[kh * G + g] : 0.0f;
        float sink = L->sinks ? L->sinks[kh * G + g] : -INFINITY;
        float mx = sink;
        for (int64_t j = 0; j < n; j++) {
            float s = sc[j] * L->scale;
            if (L->softcap > 0) s = L->softcap * tanhf(s / L->softcap);
            if (L->slopes) s += slope * (float)(first + j - p);
            sc[j] = s;
            mx = s > mx ? s : mx;
        }
        float sum = L->sinks ? exp_nonpositive(sink - mx) : 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) {
            sc[j] = exp_nonpositive(sc[j] - mx);
            sum += sc[j];
        }
        float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; j++) sc[j] *= inv;
    }
    /* The weighted values: 16 of the D outputs of up to three heads at a time held in
     * registers over every key (each value row's 16 floats loaded once for the heads), each
     * output summed over the keys in order, as o[d] += p * v[d] from zero would. */
    int64_t d0 = 0;
    for (; d0 + 16 <= D; d0 += 16)
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
            int64_t gn = G - g0 < 3 ? G - g0 : 3;
            const float *p0 = buf + g0 * n, *p1 = gn > 1 ? p0 + n : p0, *p2 = gn > 2 ? p1 + n : p1;
            v16 o0 = {0}, o1 = {0}, o2 = {0};
            for (int64_t b = first / bs; b * bs < len; b++) {
                int64_t t0 = b * bs < first ? first - b * bs : 0;
                int64_t t1 = (b + 1) * bs <= len ? bs : len - b * bs;
                const float *vb = L->v_cache + table[b] * sb + kh * sh + d0;
                if (d0 == 0 && g0 == 0 && (b + 1) * bs < len)
                    prefetch_block(L->v_cache + table[b + 1] * sb + kh * sh, bs, D, st);
                int64_t j = b * bs - first;
                for (int64_t t = t0; t < t1; t++) {
                    v16 v = *(const v16u *)(vb + t * st);
                    o0 = o0 + p0[j + t] * v;
                    o1 = o1 + p1[j + t] * v;
                    o2 = o2 + p2[j + t] * v;
                }
            }
            *(v16u *)(oi + g0 * D + d0) = o0;
            if (gn > 1) *(v16u *)(oi + (g0 + 1) * D + d0) = o1;
            if (gn > 2) *(v16u *)(oi + (g0 + 2) * D + d0) = o2;
        }
    if (d0 < D) { /* the last D % 16 outputs: a row at a time */
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = d0; d < D; d++) oi[g * D + d] = 0.0f;
        for (int64_t b = first / bs; b * bs < len; b++) {
            int64_t t0 = b * bs < first ? first - b * bs : 0;
            int64_t t1 = (b + 1) * bs <= len ? bs : len - b * bs;
            const float *vb = L->v_cache + table[b] * sb + kh * sh;
            for (int64_t t = t0; t < t1; t++) {
                const float *val = vb + t * st;
                for (int64_t g = 0; g < G; g++) {
                    float pj = buf[g * n + (b * bs + t - first)];
                    float *o = oi + g * D;
                    for (int64_t d = d0; d < D; d++) o[d] += pj * val[d];
                }
            }
        }
    }
}

/* Work (floats touched) above which a call runs on the OpenMP team. */
#define PARALLEL_WORK 32768

/* The attention part of one layer's step: every row's q, k, v (row strides in floats, heads
 * contiguous inside a row) clipped, normed and rotated in place, each row's K/V written to its
 * slot, then the decode rows' attention into out [num_decodes, num_heads * head_dim] (row
 * stride out_stride). Prefill rows are left to the caller, with their q and k prepared. */
void attention_step_f32(const layer_t *L, const step_t *S, float *q, int64_t q_stride, float *k,
                        int64_t k_stride, float *v, int64_t v_stride, float *out,
                        int64_t out_stride) {
    int64_t T = S->num_tokens, KVH = L->num_kv_heads, D = L->head_dim;
    int64_t G = L->num_heads / KVH;
    int64_t row_work = (L->num_heads + 2 * KVH) * D;
#pragma omp parallel for schedule(static) if (T * row_work > PARALLEL_WORK)
    for (int64_t t = 0; t < T; t++) {
        float *qt = q + t * q_stride, *kt = k + t * k_stride, *vt = v + t * v_stride;
        prepare_row(L, S, t, qt, kt, vt);
        write_row(L, S, t, kt, vt);
    }
    int64_t nd = S->num_decodes;
    if (nd == 0) return;
    /* The keys the decodes read (a window's or chunk's only): the work, and the longest. */
    int64_t max_len = 0, total = 0;
    for (int64_t i = 0; i < nd; i++) {
        int64_t len = S->seq_lens[i], keys = len - first_key(L, len - 1);
        max_len = keys > max_len ? keys : max_len;
        total += keys;
    }
    int64_t tasks = nd * KVH;
#pragma omp parallel if (total * KVH * D * 2 > PARALLEL_WORK)
    {
        float *buf = malloc((size_t)(G * max_len) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++)
            attend_one(L, S, task / KVH, task % KVH, q, q_stride, out, out_stride, buf);
        free(buf);
    }
}

/* -- multi-head latent attention (DeepSeek V2/V3): the absorbed decode -------------------- */

/* A latent layer's cache holds one row of W = L + R floats a token (the KV latent after its
 * norm, then the rotary key shared by every head): [blocks, block_size, W], so slot s's row is
 * at s * W. In the absorbed form a decode's query for head h is q[h] = [q_lat | q_pe] (W
 * floats: q_nope already moved into latent space by the caller), its score against key j is
 * q[h] . row_j, and its output the softmax-weighted sum of the latents row_j[0..L), which the
 * caller brings up through W_UV. Every head reads the same rows: a tile of MLA_TILE rows
 * (36 KB at W = 576) is read from memory once and serves all heads' scores and then their
 * values from L1/L2, with an online softmax across tiles (a running maximum and sum a head, the
 * partial output rescaled when the maximum grows). A decode's keys may be cut into splits run
 * by different threads (few decodes, long contexts), merged after by their maxima and sums. */

#define MLA_TILE 16

/* s0[j], s1[j] = q0 . r[j], q1 . r[j] for n rows (two heads at once: each row load serves
 * both; four rows at once: eight independent sums). q1 == NULL: one head. */
static void mla_dots(const float *q0, const float *q1, const float *const *r, int64_t n,
                     int64_t W, float *s0, float *s1) {
    int64_t j = 0;
    if (q1) {
        for (; j + 4 <= n; j += 4) {
            const float *r0 = r[j], *r1 = r[j + 1], *r2 = r[j + 2], *r3 = r[j + 3];
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            float b0 = 0.0f, b1 = 0.0f, b2 = 0.0f, b3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
            for (int64_t d = 0; d < W; d++) {
                float x = q0[d], y = q1[d];
                a0 = MUL_ADD(r0[d], x, a0);
                a1 = MUL_ADD(r1[d], x, a1);
                a2 = MUL_ADD(r2[d], x, a2);
                a3 = MUL_ADD(r3[d], x, a3);
                b0 = MUL_ADD(r0[d], y, b0);
                b1 = MUL_ADD(r1[d], y, b1);
                b2 = MUL_ADD(r2[d], y, b2);
                b3 = MUL_ADD(r3[d], y, b3);
            }
            s0[j] = a0, s0[j + 1] = a1, s0[j + 2] = a2, s0[j + 3] = a3;
            s1[j] = b0, s1[j + 1] = b1, s1[j + 2] = b2, s1[j + 3] = b3;
        }
        for (; j < n; j++) {
            const float *rj = r[j];
            float a = 0.0f, b = 0.0f;
#pragma omp simd reduction(+ : a, b)
            for (int64_t d = 0; d < W; d++) {
                a = MUL_ADD(rj[d], q0[d], a);
                b = MUL_ADD(rj[d], q1[d], b);
            }
            s0[j] = a, s1[j] = b;
        }
        return;
    }
    for (; j + 4 <= n; j += 4) {
        const float *r0 = r[j], *r1 = r[j + 1], *r2 = r[j + 2], *r3 = r[j + 3];
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t d = 0; d < W; d++) {
            float x = q0[d];
            a0 = MUL_ADD(r0[d], x, a0);
            a1 = MUL_ADD(r1[d], x, a1);
            a2 = MUL_ADD(r2[d], x, a2);
            a3 = MUL_ADD(r3[d], x, a3);
        }
        s0[j] = a0, s0[j + 1] = a1, s0[j + 2] = a2, s0[j + 3] = a3;
    }
    for (; j < n; j++) {
        const float *rj = r[j];
        float a = 0.0f;
#pragma omp simd reduction(+ : a)
        for (int64_t d = 0; d < W; d++) a = MUL_ADD(rj[d], q0[d], a);
        s0[j] = a;
    }
}

/* o0 += sum_j p0[j] r[j][0..L), and o1 with p1 (NULL: one head): four rows a pass, so each
 * pass reads and writes the outputs once for four rows. */
static void mla_values(float *o0, float *o1, const float *p0, const float *p1,
                       const float *const *r, int64_t n, int64_t L) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *r0 = r[j], *r1 = r[j + 1], *r2 = r[j + 2], *r3 = r[j + 3];
        float a0 = p0[j], a1 = p0[j + 1], a2 = p0[j + 2], a3 = p0[j + 3];
#pragma omp simd
        for (int64_t d = 0; d < L; d++) {
            float x = MUL_ADD(a1, r1[d], MUL_ADD(a0, r0[d], o0[d]));
            o0[d] = MUL_ADD(a3, r3[d], MUL_ADD(a2, r2[d], x));
        }
        if (o1) {
            float b0 = p1[j], b1 = p1[j + 1], b2 = p1[j + 2], b3 = p1[j + 3];
#pragma omp simd
            for (int64_t d = 0; d < L; d++) {
                float x = MUL_ADD(b1, r1[d], MUL_ADD(b0, r0[d], o1[d]));
                o1[d] = MUL_ADD(b3, r3[d], MUL_ADD(b2, r2[d], x));
            }
        }
    }
    for (; j < n; j++) {
        const float *rj = r[j];
        float a = p0[j];
#pragma omp simd
        for (int64_t d = 0; d < L; d++) o0[d] = MUL_ADD(a, rj[d], o0[d]);
        if (o1) {
            float b = p1[j];
#pragma omp simd
            for (int64_t d = 0; d < L; d++) o1[d] = MUL_ADD(b, rj[d], o1[d]);
        }
    }
}

/* Keys a..b-1 of decode i for all H heads of q [H, W]: o [H, L] gets the unnormalised
 * weighted latents, m [H] the heads' maximum score, l [H] their sums of exp(score - m);
 * sc holds H * MLA_TILE floats. An empty range leaves o = 0, m = -inf, l = 0. */
static void mla_range(const step_t *S, const float *cache, int64_t W, int64_t L, int64_t H,
                      float scale, const float *q, int64_t i, int64_t a, int64_t b, float *o,
                      float *m, float *l, float *sc) {
    int64_t bs = S->block_size;
    const int32_t *table = S->block_tables + i * S->bt_stride;
    memset(o, 0, (size_t)(H * L) * sizeof(float));
    for (int64_t h = 0; h < H; h++) m[h] = -INFINITY, l[h] = 0.0f;
    const float *rows[MLA_TILE];
    for (int64_t t0 = a; t0 < b; t0 += MLA_TILE) {
        int64_t n = b - t0 < MLA_TILE ? b - t0 : MLA_TILE;
        for (int64_t j = 0; j < n; j++) {
            int64_t pos = t0 + j;
            rows[j] = cache + ((int64_t)table[pos / bs] * bs + pos % bs) * W;
        }
        /* Ask for the next tile's rows while this one computes: its block is anywhere in
         * memory, where the hardware prefetcher cannot guess it. */
        for (int64_t pos = t0 + MLA_TILE; pos < b && pos < t0 + 2 * MLA_TILE; pos++) {
            const char *at = (const char *)(cache + ((int64_t)table[pos / bs] * bs + pos % bs) * W);
            for (int64_t off = 0; off < W * (int64_t)sizeof(float); off += 64)
                __builtin_prefetch(at + off, 0, 3);
        }
        for (int64_t h = 0; h < H; h += 2) {
            int two = h + 1 < H;
            mla_dots(q + h * W, two ? q + (h + 1) * W : NULL, rows, n, W, sc + h * MLA_TILE,
                     sc + (h + two) * MLA_TILE);
        }
        for (int64_t h = 0; h < H; h++) {
            float *sh = sc + h * MLA_TILE, mx = m[h];
            for (int64_t j = 0; j < n; j++) {
                sh[j] = sh[j] * scale;
                mx = sh[j] > mx ? sh[j] : mx;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                sh[j] = exp_nonpositive(sh[j] - mx);
                sum += sh[j];
            }
            if (mx > m[h] && m[h] > -INFINITY) { /* the maximum grew: rescale what came before */
                float alpha = exp_nonpositive(m[h] - mx);
                l[h] = l[h] * alpha;
                float *oh = o + h * L;
                for (int64_t d = 0; d < L; d++) oh[d] = oh[d] * alpha;
            }
            l[h] = l[h] + sum;
            m[h] = mx;
        }
        for (int64_t h = 0; h < H; h += 2) {
            int two = h + 1 < H;
            mla_values(o + h * L, two ? o + (h + 1) * L : NULL, sc + h * MLA_TILE,
                       two ? sc + (h + 1) * MLA_TILE : NULL, rows, n, L);
        }
    }
}

/* One latent layer's step: each of the step's rows (rows [T, W], `rows_stride` floats apart;
 * NULL: none) written to its slot of cache [blocks, block_size, W] (slot < 0: skipped), then
 * (q not NULL) the decodes' absorbed attention: q [num_decodes, H, W] (rows q_stride floats
 * apart, heads W apart) -> out [num_decodes, H, L] (rows out_stride apart, heads L apart), the
 * softmax of scale * q[h] . row_j over the decode's keys 0..seq_len-1 weighting row_j[0..L).
 * The dot products and the weighted sums use explicit fused multiply-adds (the attention's
 * arithmetic, where the float32 FMA rate is the limit), so they round once a step. */
void mla_decode_f32(const step_t *S, const float *rows, int64_t rows_stride, float *cache,
                    int64_t W, const float *q, int64_t q_stride, int64_t H, int64_t L, float scale,
                    float *out, int64_t out_stride) {
    if (rows) {
        for (int64_t t = 0; t < S->num_tokens; t++) {
            int64_t slot = S->slot_mapping[t];
            if (slot >= 0) memcpy(cache + slot * W, rows + t * rows_stride, W * sizeof(float));
        }
    }
    int64_t nd = S->num_decodes;
    if (nd == 0 || !q) return;
    int64_t max_len = 0, total = 0;
    for (int64_t i = 0; i < nd; i++) {
        max_len = S->seq_lens[i] > max_len ? S->seq_lens[i] : max_len;
        total += S->seq_lens[i];
    }
    int parallel = total * W * H > PARALLEL_WORK;
    int64_t threads = parallel ? omp_get_max_threads() : 1;
    /* Splits a decode: enough tasks for two a thread, each of at least 4 tiles. */
    int64_t splits = (2 * threads + nd - 1) / nd;
    int64_t most = (max_len + 4 * MLA_TILE - 1) / (4 * MLA_TILE);
    splits = splits < most ? splits : most;
    splits = splits < 1 ? 1 : splits;
    int64_t tasks = nd * splits;
    float *stats = malloc((size_t)(tasks * 2 * H) * sizeof(float));
    float *part = splits > 1 ? malloc((size_t)(tasks * H * L) * sizeof(float)) : NULL;
#pragma omp parallel if (parallel)
    {
        float *sc = malloc((size_t)(H * MLA_TILE) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t i = task / splits, s = task % splits, len = S->seq_lens[i];
            int64_t per = (len + splits - 1) / splits;
            per = (per + MLA_TILE - 1) / MLA_TILE * MLA_TILE;
            int64_t a = s * per < len ? s * per : len, b = a + per < len ? a + per : len;
            float *m = stats + task * 2 * H, *l = m + H;
            float *o = part ? part + task * H * L : out + i * out_stride;
            mla_range(S, cache, W, L, H, scale, q + i * q_stride, i, a, b, o, m, l, sc);
            if (!part)
                for (int64_t h = 0; h < H; h++) {
                    float inv = 1.0f / l[h];
                    for (int64_t d = 0; d < L; d++) o[h * L + d] = o[h * L + d] * inv;
                }
        }
        free(sc);
        if (part) {
#pragma omp for schedule(static)
            for (int64_t ih = 0; ih < nd * H; ih++) {
                int64_t i = ih / H, h = ih % H;
                float mx = -INFINITY;
                for (int64_t s = 0; s < splits; s++) {
                    float ms = stats[(i * splits + s) * 2 * H + h];
                    mx = ms > mx ? ms : mx;
                }
                float *oi = out + i * out_stride + h * L, sum = 0.0f;
                for (int64_t d = 0; d < L; d++) oi[d] = 0.0f;
                for (int64_t s = 0; s < splits; s++) {
                    const float *st = stats + (i * splits + s) * 2 * H;
                    if (!(st[h] > -INFINITY)) continue; /* an empty split */
                    float w = exp_nonpositive(st[h] - mx);
                    sum += w * st[H + h];
                    const float *os = part + ((i * splits + s) * H + h) * L;
#pragma omp simd
                    for (int64_t d = 0; d < L; d++) oi[d] = oi[d] + w * os[d];
                }
                float inv = 1.0f / sum;
                for (int64_t d = 0; d < L; d++) oi[d] = oi[d] * inv;
            }
        }
    }
    free(part);
    free(stats);
}

/* Residual add and norm over rows of n: with `residual`, res_out = x + residual and
 * out = norm(res_out); without, out = norm(x). kind 0: RMSNorm (weight required); kind 1:
 * LayerNorm (weight and bias optional). Rows are `stride` floats apart in x and residual;
 * out and res_out are contiguous. */
void add_norm_f32(const float *x, const float *residual, const float *w, const float *b,
                  float *out, float *res_out, int64_t rows, int64_t n, int64_t stride, float eps,
                  int64_t kind) {
#pragma omp parallel for schedule(static) if (rows * n > PARALLEL_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        float *o = out + r * n;
        if (residual) {
            const float *rr = residual + r * stride;
            float *s = res_out + r * n;
            for (int64_t i = 0; i < n; i++) s[i] = xr[i] + rr[i];
            xr = s;
        }
        if (kind == 0) {
            float inv = 1.0f / sqrtf(sum_squares(xr, n) / (float)n + eps);
            for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
        } else {
            if (o != xr) memcpy(o, xr, (size_t)n * sizeof(float));
            layer_norm_inplace(o, w, b, n, eps);
        }
    }
}

/* -- the MLP's activations ------------------------------------------------------------------ */

/* The activations in float32, as the torch ops (one function each, branch-free, so a loop of
 * one vectorizes). */
static inline float sigmoid(float x) { /* from exp(-|x|): the exp's argument is never positive */
    float e = exp_nonpositive(x >= 0.0f ? -x : x);
    float d = 1.0f / (1.0f + e);
    return x >= 0.0f ? d : e * d;
}
static inline float act_silu(float x) { return x * sigmoid(x); }
/* 0.5 x (1 + tanh(u)) = x sigmoid(2u): no cancellation in 1 + tanh(u) where u < 0. */
static inline float act_gelu_tanh(float x) {
    return x * sigmoid(1.5957691216057308f * (x + 0.044715f * x * x * x));
}
/* 0.5 x (1 + erf(x / sqrt(2))), erf by Abramowitz and Stegun's 7.1.26 (absolute error under
 * 1.5e-7) on exp_nonpositive; for x < 0, 1 + erf is erfc(|x| / sqrt(2)) itself, so small
 * outputs keep their relative precision. */
static inline float act_gelu(float x) {
    float z = fabsf(x) * 0.70710678118654752f;
    float t = 1.0f / (1.0f + 0.3275911f * z);
    float p = 1.061405429f;
    p = p * t - 1.453152027f;
    p = p * t + 1.421413741f;
    p = p * t - 0.284496736f;
    p = p * t + 0.254829592f;
    float erfc = p * t * exp_nonpositive(-z * z);
    return 0.5f * x * (x < 0.0f ? erfc : 2.0f - erfc);
}
static inline float act_relu(float x) { return x > 0.0f ? x : 0.0f; }

/* out [rows, n] = act(x) (plain), or act(gate) * up for x rows [gate | up] of 2n (gated); x rows
 * x_stride apart; kind: kernels/activation.py's ACT_CODES (0 silu, 1 gelu, 2 gelu's tanh
 * approximation, 3 relu). */
void activation_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t n,
                    int64_t kind, int64_t gated) {
#pragma omp parallel for schedule(static) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride, *u = g + n;
        float *o = out + r * n;
#define ACT_LOOP(F)                                                                               \
    if (gated) {                                                                                  \
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++) o[i] = F(g[i]) * u[i];               \
    } else {                                                                                      \
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++) o[i] = F(g[i]);                      \
    }
        switch (kind) {
        case 0: ACT_LOOP(act_silu) break;
        case 1: ACT_LOOP(act_gelu) break;
        case 2: ACT_LOOP(act_gelu_tanh) break;
        default: ACT_LOOP(act_relu) break;
        }
#undef ACT_LOOP
    }
}

/* -- linears ---------------------------------------------------------------------------------- */

/* out [M, N] = x [M, K] times w [N, K] transposed, + b, with w in panels: [ceil(N / 16), K, 16],
 * panel p holding columns 16p..16p+15 of w^T (zero past N), so a panel's k-th 16 floats are what
 * step k of a micro-kernel reads, and the whole weight is read in memory order (`pack_panels` in
 * cpu_native.py makes it).
 *
 * Why our own: at the row counts of decode steps (1-64) a float32 linear on a CPU is bound by
 * streaming the weights and keeping the FMA units fed at once; oneDNN's packed GEMM reaches
 * 35-45% of this machine's float32 peak there. Here each panel is cut into blocks of PANEL_KC
 * steps (8 KB, L1-sized); a block is read once from memory and used by every 6-row
 * micro-kernel of the step from L1, while those micro-kernels prefetch a block a few ahead into
 * L2, so the memory stream and the arithmetic overlap. The micro-kernel keeps a 6 x 16 tile in 12
 * vector registers: per k, two weight loads, six broadcasts of x, twelve fused multiply-adds.
 * Sums run over k in order, one accumulator per output (not torch's order). */

#define PANEL 16
#define PANEL_KC 128
#define PANEL_MR 6
#define PANEL_AHEAD 4 /* blocks prefetched ahead: the memory's latency is ~3 blocks' work */

#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
typedef __m256 vreg;
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps((p), (v))
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define V_ADD(a, b) _mm256_add_ps((a), (b))
#else /* any other target: the compiler's own vectors, multiply then add */
typedef float vreg __attribute__((vector_size(32)));
static inline vreg v_load(const float *p) {
    vreg v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline vreg v_bcast(const float *p) {
    float s = *p;
    return (vreg){s, s, s, s, s, s, s, s};
}
#define V_ZERO() ((vreg){0})
#define V_LOAD(p) v_load(p)
#define V_STORE(p, v) memcpy((p), &(v), sizeof(vreg))
#define V_BCAST(p) v_bcast(p)
#define V_FMA(a, b, c) ((a) * (b) + (c))
#define V_ADD(a, b) ((a) + (b))
#endif

/* One micro-kernel of MR rows (1..6) over kc steps of one panel block, its tile accumulated in
 * c [MR, 16] (ldc apart): zeroed first when `first`, bias added at the end when given. Lines
 * pf[0..pf_lines) (a block ahead) are prefetched into L2 as it goes. Named registers, one
 * pair a row: arrays of vectors are spilled by GCC. */
#define MK_DECL(i) vreg c##i##0, c##i##1;
#define MK_INIT(i)                                                                                \
    if (first) {                                                                                  \
        c##i##0 = V_ZERO();                                                                       \
        c##i##1 = V_ZERO();                                                                       \
    } else {                                                                                      \
        c##i##0 = V_LOAD(c + i * ldc);                                                            \
        c##i##1 = V_LOAD(c + i * ldc + 8);                                                        \
    }
#define MK_STEP(i)                                                                                \
    {                                                                                             \
        vreg a = V_BCAST(x + i * xs + k);                                                         \
        c##i##0 = V_FMA(a, b0, c##i##0);                                                          \
        c##i##1 = V_FMA(a, b1, c##i##1);                                                          \
    }
#define MK_STORE(i)                                                                               \
    if (bias) {                                                                                   \
        c##i##0 = V_ADD(c##i##0, V_LOAD(bias));                                                   \
        c##i##1 = V_ADD(c##i##1, V_LOAD(bias + 8));                                               \
    }                                                                                             \
    V_STORE(c + i * ldc, c##i##0);                                                                \
    V_STORE(c + i * ldc + 8, c##i##1);
#define MK_ROWS1(M) M(0)
#define MK_ROWS2(M) MK_ROWS1(M) M(1)
#define MK_ROWS3(M) MK_ROWS2(M) M(2)
#define MK_ROWS4(M) MK_ROWS3(M) M(3)
#define MK_ROWS5(M) MK_ROWS4(M) M(4)
#define MK_ROWS6(M) MK_ROWS5(M) M(5)
#define MICRO_KERNEL(n)                                                                           \
    static void micro_kernel_##n(const float *x, int64_t xs, const float *w, int64_t kc,          \
                                 float *c, int64_t ldc, int first, const float *bias,             \
                                 const float *pf, int64_t pf_lines) {                             \
        MK_ROWS##n(MK_DECL) MK_ROWS##n(MK_INIT) for (int64_t k = 0; k < kc; k++) {                \
            if (k < pf_lines) __builtin_prefetch(pf + k * PANEL, 0, 2);                           \
            vreg b0 = V_LOAD(w + k * PANEL), b1 = V_LOAD(w + k * PANEL + 8);                      \
            MK_ROWS##n(MK_STEP)                                                                   \
        }                                                                                         \
        MK_ROWS##n(MK_STORE)                                                                      \
    }
MICRO_KERNEL(1)
MICRO_KERNEL(2)
MICRO_KERNEL(3)
MICRO_KERNEL(4)
MICRO_KERNEL(5)
MICRO_KERNEL(6)

typedef void (*micro_kernel_t)(const float *, int64_t, const float *, int64_t, float *, int64_t,
                               int, const float *, const float *, int64_t);
static const micro_kernel_t MICRO_KERNELS[PANEL_MR + 1] = {
    NULL,           micro_kernel_1, micro_kernel_2, micro_kernel_3,
    micro_kernel_4, micro_kernel_5, micro_kernel_6,
};

/* Panel p, all M rows: a full panel straight into out; the last, partial one through a tile. */
static void linear_panel(const float *x, int64_t xs, const float *wp, const float *b, float *out,
                         int64_t M, int64_t N, int64_t K, int64_t p) {
    const float *panel = wp + p * K * PANEL;
    int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
    int64_t blocks_m = (M + PANEL_MR - 1) / PANEL_MR;
    if (cols < PANEL) { /* one pass over K per row block, into a tile */
        float tile[PANEL_MR * PANEL];
        for (int64_t m0 = 0; m0 < M; m0 += PANEL_MR) {
            int mr = M - m0 < PANEL_MR ? (int)(M - m0) : PANEL_MR;
            MICRO_KERNELS[mr](x + m0 * xs, xs, panel, K, tile, PANEL, 1, NULL, NULL, 0);
            for (int i = 0; i < mr; i++)
                for (int64_t j = 0; j < cols; j++)
                    out[(m0 + i) * N + n0 + j] = tile[i * PANEL + j] + (b ? b[n0 + j] : 0.0f);
        }
        return;
    }
    for (int64_t k0 = 0; k0 < K; k0 += PANEL_KC) {
        int64_t kc = K - k0 < PANEL_KC ? K - k0 : PANEL_KC;
        int64_t end = k0 + kc >= K;
        /* The block PANEL_AHEAD blocks on in memory order (this panel's, or a next panel's:
         * the weight is read in memory order); the row blocks after the first (which reads
         * this block) share its lines. Past the weight's end it is a prefetch of nothing, which
         * never faults. */
        const float *ahead = panel + (k0 + PANEL_AHEAD * PANEL_KC) * PANEL;
        int64_t share = blocks_m > 1 ? (kc + blocks_m - 2) / (blocks_m - 1) : 0;
        for (int64_t mb = 0; mb < blocks_m; mb++) {
            int64_t m0 = mb * PANEL_MR;
            int mr = M - m0 < PANEL_MR ? (int)(M - m0) : PANEL_MR;
            int64_t from = mb ? (mb - 1) * share : 0, lines = mb ? share : 0;
            if (from + lines > kc) lines = kc > from ? kc - from : 0;
            MICRO_KERNELS[mr](x + m0 * xs + k0, xs, panel + k0 * PANEL, kc, out + m0 * N + n0, N,
                              k0 == 0, end && b ? b + n0 : NULL, ahead + from * PANEL, lines);
        }
    }
}

#ifdef __AVX512F__
/* The AVX-512 form for steps of 2..64 rows (a batch of decodes): AVX-512 doubles the FMA width,
 * and at 32 rows oneDNN's packed GEMM, its weights streamed from memory as a forward streams
 * them, ran at ~170 GFLOP/s a core on a Zen 5 where this runs at ~235 (its peak ~260).
 * A unit is two adjacent panels (32 columns; an odd last panel alone), computed for the rows in
 * blocks of at most Z_MR (balanced: 32 rows are 11 + 11 + 10) over the whole K, each block's
 * tile in 2 * Z_MR zmm registers (per k: two weight loads, a broadcast a row, two FMAs a row).
 * The first row block reads the unit's weights from memory, the others from L2, and every row
 * block prefetches its share of the next unit's lines into L2, so the memory stream overlaps the
 * arithmetic. x is first copied k-major per row block ([K, rows]), so a step's broadcasts read
 * one pointer. Each output sums over k in order with one accumulator, bias added last: the same
 * roundings as the AVX2 kernel above, so results do not depend on which of the two ran. */
#define Z_MR 12
#define Z_MIN_ROWS 2 /* one row: the AVX2 kernel measured faster (both bound by memory there) */
#define Z_CHUNK_ROWS 256
#define ZK_DECL2(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = _mm512_setzero_ps();
#define ZK_STEP2(i)                                                                               \
    {                                                                                             \
        __m512 a = _mm512_set1_ps(x[k * R + i]);                                                  \
        c##i##0 = _mm512_fmadd_ps(a, b0, c##i##0);                                                \
        c##i##1 = _mm512_fmadd_ps(a, b1, c##i##1);                                                \
    }
#define ZK_STORE2(i)                                                                              \
    if (bias) {                                                                                   \
        c##i##0 = _mm512_add_ps(c##i##0, bb0);                                                    \
        c##i##1 = _mm512_add_ps(c##i##1, bb1);                                                    \
    }                                                                                             \
    _mm512_mask_storeu_ps(c + i * ldc, m0, c##i##0);                                              \
    _mm512_mask_storeu_ps(c + i * ldc + PANEL, m1, c##i##1);
#define ZK_DECL1(i) __m512 c##i##0 = _mm512_setzero_ps();
#define ZK_STEP1(i) c##i##0 = _mm512_fmadd_ps(_mm512_set1_ps(x[k * R + i]), b0, c##i##0);
#define ZK_STORE1(i)                                                                              \
    if (bias) c##i##0 = _mm512_add_ps(c##i##0, bb0);                                              \
    _mm512_mask_storeu_ps(c + i * ldc, m0, c##i##0);
#define MK_ROWS7(M) MK_ROWS6(M) M(6)
#define MK_ROWS8(M) MK_ROWS7(M) M(7)
#define MK_ROWS9(M) MK_ROWS8(M) M(8)
#define MK_ROWS10(M) MK_ROWS9(M) M(9)
#define MK_ROWS11(M) MK_ROWS10(M) M(10)
#define MK_ROWS12(M) MK_ROWS11(M) M(11)
/* Rows x [K, R] (k-major) times panel w0 (and w1, the unit's second) into c (ldc apart),
 * columns masked by m0 (m1), plus bias (NULL: none; read under the masks); the lines pf[0..pfn)
 * prefetched into L2 as it goes, spread over the K steps. */
#define Z_KERNEL(n, P)                                                                            \
    static void zk##P##_##n(const float *x, const float *w0, const float *w1, int64_t K,          \
                            float *c, int64_t ldc, const float *bias, __mmask16 m0, __mmask16 m1, \
                            const char *pf, int64_t pfn) {                                        \
        const int64_t R = n;                                                                      \
        MK_ROWS##n(ZK_DECL##P) int64_t j = 0;                                                     \
        for (int64_t k = 0; k < K; k++) {                                                         \
            while (j < pfn && j * K < (k + 1) * pfn) __builtin_prefetch(pf + 64 * j++, 0, 2);     \
            __m512 b0 = _mm512_loadu_ps(w0 + k * PANEL);                                          \
            __m512 b1 = P == 2 ? _mm512_loadu_ps(w1 + k * PANEL) : b0;                            \
            (void)b1;                                                                             \
            MK_ROWS##n(ZK_STEP##P)                                                                \
        }                                                                                         \
        __m512 bb0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();                \
        __m512 bb1 = bias ? _mm512_maskz_loadu_ps(m1, bias + PANEL) : _mm512_setzero_ps();        \
        (void)bb1;                                                                                \
        MK_ROWS##n(ZK_STORE##P)                                                                   \
    }
#define Z_KERNELS(P)                                                                              \
    Z_KERNEL(1, P) Z_KERNEL(2, P) Z_KERNEL(3, P) Z_KERNEL(4, P) Z_KERNEL(5, P) Z_KERNEL(6, P)      \
    Z_KERNEL(7, P) Z_KERNEL(8, P) Z_KERNEL(9, P) Z_KERNEL(10, P) Z_KERNEL(11, P) Z_KERNEL(12, P)
Z_KERNELS(1)
Z_KERNELS(2)
typedef void (*z_kernel_t)(const float *, const float *, const float *, int64_t, float *, int64_t,
                           const float *, __mmask16, __mmask16, const char *, int64_t);
static const z_kernel_t Z_KERNELS_1[Z_MR + 1] = {NULL,   zk1_1,  zk1_2,  zk1_3, zk1_4,
                                                 zk1_5,  zk1_6,  zk1_7,  zk1_8, zk1_9,
                                                 zk1_10, zk1_11, zk1_12};
static const z_kernel_t Z_KERNELS_2[Z_MR + 1] = {NULL,   zk2_1,  zk2_2,  zk2_3, zk2_4,
                                                 zk2_5,  zk2_6,  zk2_7,  zk2_8, zk2_9,
                                                 zk2_10, zk2_11, zk2_12};

static inline __mmask16 z_cols(int64_t cols) {
    if (cols >= PANEL) return (__mmask16)0xFFFF;
    return cols <= 0 ? (__mmask16)0 : (__mmask16)((1u << cols) - 1u);
}

/* linear_panels_f32 for M >= Z_MIN_ROWS; returns 0 (nothing done) when its buffer cannot be had. */
static int linear_panels_z(const float *x, int64_t xs, const float *wp, const float *b,
                           float *out, int64_t M, int64_t N, int64_t K) {
    int64_t panels = (N + PANEL - 1) / PANEL, units = (panels + 1) / 2;
    int64_t nb = (M + Z_MR - 1) / Z_MR;
    float *xk = malloc(sizeof(float) * M * K);
    if (!xk) return 0;
    for (int64_t mb = 0; mb < nb; mb++) { /* row block mb: rows [mb M / nb, (mb + 1) M / nb) */
        int64_t r0 = mb * M / nb, rows = (mb + 1) * M / nb - r0;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t k = 0; k < K; k++) xk[r0 * K + k * rows + i] = x[(r0 + i) * xs + k];
    }
#pragma omp parallel for schedule(static) if (M * N * K > 262144)
    for (int64_t u = 0; u < units; u++) {
        int64_t p = 2 * u, two = p + 1 < panels, n0 = p * PANEL;
        const float *w0 = wp + p * K * PANEL;
        /* the next unit's lines (none past the weight's end), a share for each row block */
        int64_t next = panels - (p + 2) < 2 ? panels - (p + 2) : 2;
        int64_t lines = next > 0 ? next * K * PANEL * (int64_t)sizeof(float) / 64 : 0;
        int64_t share = (lines + nb - 1) / nb;
        const char *pf = (const char *)(w0 + 2 * K * PANEL);
        __mmask16 m0 = z_cols(N - n0), m1 = z_cols(N - n0 - PANEL);
        for (int64_t mb = 0; mb < nb; mb++) {
            int64_t r0 = mb * M / nb, rows = (mb + 1) * M / nb - r0;
            int64_t from = mb * share, cnt = lines - from < share ? lines - from : share;
            (two ? Z_KERNELS_2 : Z_KERNELS_1)[rows](xk + r0 * K, w0, w0 + K * PANEL, K,
                                                    out + r0 * N + n0, N, b ? b + n0 : NULL, m0,
                                                    m1, pf + 64 * from, cnt > 0 ? cnt : 0);
        }
    }
    free(xk);
    return 1;
}
#endif

void linear_panels_f32(const float *x, int64_t x_stride, const float *wp, const float *b,
                       float *out, int64_t M, int64_t N, int64_t K) {
#ifdef __AVX512F__
    /* Many rows (a prefill's, an expert's share of one) in balanced chunks of at most
     * Z_CHUNK_ROWS: each chunk's k-major copy of x stays in L2 while every unit reads it
     * (unchunked, 1,000 rows ran 1.1-1.4x oneDNN's time; chunked, as fast). */
    if (M >= Z_MIN_ROWS) {
        int64_t chunks = (M + Z_CHUNK_ROWS - 1) / Z_CHUNK_ROWS, done = 1;
        for (int64_t c = 0; c < chunks && done; c++) {
            int64_t r0 = c * M / chunks, r1 = (c + 1) * M / chunks;
            done = linear_panels_z(x + r0 * x_stride, x_stride, wp, b, out + r0 * N, r1 - r0, N,
                                   K);
        }
        if (done) return;
    }
#endif
    int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) if (M * N * K > 262144)
    for (int64_t p = 0; p < panels; p++)
        linear_panel(x, x_stride, wp, b, out, M, N, K, p);
}

/* -- a sparse block's experts ------------------------------------------------------------------ */

/* The experts of a sparse block over a step's T tokens in one call (the CPU float32 path, each
 * expert's weights in panels), in place of the torch glue around one GEMM call per expert
 * (grouping, gathers, the activation, the weighted scatter: serial Python, ~20% of a MoE decode
 * step on one thread and more on two). x [T, H] rows x_stride apart; ids [T, k] (int64) and
 * weights [T, k] (float32), contiguous: each token's experts and their router weights; w13[e]:
 * panels of expert e's [gate | up] rows (2 I of them; I when not gated) over H, w2[e]: panels of
 * its [H, I]; act: activation_f32's kind. out [T, H] (contiguous): each token's sum over its
 * choices, in ascending expert order, of weight * w2 act(w13 x), rounded as
 * kernels/fused_moe.py's fused_moe_reference rounds it (rows grouped by expert in token order,
 * each output row times its weight, then added into zeros in that order). work: T k (2 H + I +
 * (gated ? 2 : 1) I) floats; idx: 2 T k + 2 E + 1 int64s. */
void moe_experts_f32(const float *x, int64_t x_stride, const int64_t *ids, const float *weights,
                     const float *const *w13, const float *const *w2, float *out, int64_t T,
                     int64_t k, int64_t E, int64_t H, int64_t I, int64_t act, int64_t gated,
                     float *work, int64_t *idx) {
    int64_t n = T * k, I13 = gated ? 2 * I : I;
    int64_t *start = idx, *cursor = start + E + 1, *order = cursor + E, *pos = order + n;
    float *rows = work, *h13 = rows + n * H, *a = h13 + n * I13, *y = a + n * I;
    /* a stable counting sort of the choices by expert: order[r] is the choice (t k + i) at row
     * r of the grouped rows, pos[choice] its row */
    for (int64_t e = 0; e <= E; e++) start[e] = 0;
    for (int64_t j = 0; j < n; j++) start[ids[j] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t e = 0; e < E; e++) cursor[e] = start[e];
    for (int64_t j = 0; j < n; j++) {
        int64_t r = cursor[ids[j]]++;
        order[r] = j;
        pos[j] = r;
    }
#pragma omp parallel for schedule(static) if (n * H > PARALLEL_WORK)
    for (int64_t r = 0; r < n; r++)
        memcpy(rows + r * H, x + (order[r] / k) * x_stride, sizeof(float) * H);
    for (int64_t e = 0; e < E; e++)
        if (start[e + 1] > start[e])
            linear_panels_f32(rows + start[e] * H, H, w13[e], NULL, h13 + start[e] * I13,
                              start[e + 1] - start[e], I13, H);
    activation_f32(h13, I13, a, n, I, act, gated);
    for (int64_t e = 0; e < E; e++)
        if (start[e + 1] > start[e])
            linear_panels_f32(a + start[e] * I, I, w2[e], NULL, y + start[e] * H,
                              start[e + 1] - start[e], H, I);
#pragma omp parallel for schedule(static) if (n * H > PARALLEL_WORK)
    for (int64_t t = 0; t < T; t++) {
        int64_t p[k];
        for (int64_t i = 0; i < k; i++) { /* this token's rows, ascending (expert order) */
            int64_t r = pos[t * k + i], j = i;
            for (; j > 0 && p[j - 1] > r; j--) p[j] = p[j - 1];
            p[j] = r;
        }
        float *o = out + t * H;
        const float *y0 = y + p[0] * H;
        float w0 = weights[order[p[0]]];
#pragma omp simd
        for (int64_t h = 0; h < H; h++) o[h] = 0.0f + y0[h] * w0;
        for (int64_t i = 1; i < k; i++) {
            const float *yi = y + p[i] * H;
            float wi = weights[order[p[i]]];
#pragma omp simd
            for (int64_t h = 0; h < H; h++) o[h] += yi[h] * wi;
        }
    }
}

/* -- a whole decoder layer for a decode step of a few rows -------------------------------- */

/* One pre-norm decoder layer: norm, QKV, attention, O, then the MLP (gated: act(gate) * up, or
 * plain: act(up)): sequential (residual add and norm between) or parallel (the MLP reads the
 * same normed stream, or its own norm of it, and the two outputs are summed); its linears'
 * weights in panels (linear_panels_f32; biases optional). */
typedef struct {
    int64_t hidden, q_size, kv_size, inter;
    int64_t norm_kind; /* add_norm_f32's kind: 0 RMSNorm, 1 LayerNorm */
    int64_t act;       /* activation_f32's kind */
    int64_t gated;     /* 1: up_w is [gate | up], 2 * inter rows; 0: inter rows */
    int64_t parallel;  /* 1: GPT-J's, Phi's, Cohere's block */
    int64_t mlp_norm;  /* parallel: 1 if the MLP has its own norm (mlp_w, mlp_b) */
    float eps;
    const float *in_w, *in_b, *mlp_w, *mlp_b;
    const float *qkv_w, *qkv_b, *o_w, *o_b, *up_w, *up_b, *down_w, *down_b;
    /* Linears of another library's weight layout (gguf_blocks.c's qb32_linear_desc): where a
     * linear's descriptor is set, qlinear(x, x_stride, M, descriptor, bias, out, out_stride)
     * computes it instead of the panels. */
    void (*qlinear)(const float *, int64_t, int64_t, const void *, const float *, float *,
                    int64_t);
    const void *qkv_q, *o_q, *up_q, *down_q;
    /* LFM3's attention layers (sequential only): a sigmoid gate a query head from the normed
     * stream, gate_w [gate_heads, hidden] in panels (NULL: none); RMSNorms of the attention's
     * and the MLP's outputs before their residual adds (NULL: none). */
    const float *gate_w;
    int64_t gate_heads;
    const float *post_w, *post_mlp_w;
} decoder_layer_t;

static void layer_linear(const decoder_layer_t *DL, const void *q, const float *x, int64_t xs,
                         const float *w, const float *b, float *out, int64_t M, int64_t N,
                         int64_t K) {
    if (q && DL->qlinear)
        DL->qlinear(x, xs, M, q, b, out, N);
    else
        linear_panels_f32(x, xs, w, b, out, M, N, K);
}

/* The layer over M decode rows (the step's every row): with `residual`, the stream is
 * x + residual, else x. Writes the MLP's output to mlp_out [M, hidden] and the stream after the
 * attention's add to res_out [M, hidden] (the decoder's (x, residual) pair; parallel: the MLP's
 * output plus the attention's, and the stream). `work` holds
 * M * (5 * hidden + q_size + 2 * kv_size + q_size + 3 * inter + gate_heads) floats. */
void decoder_layer_f32(const decoder_layer_t *DL, const layer_t *L, const step_t *S,
                       const float *x, const float *residual, float *mlp_out, float *res_out,
                       float *work, int64_t M) {
    int64_t hd = DL->hidden, qs = DL->q_size, kvs = DL->kv_size, in = DL->inter;
    int64_t qkv_n = qs + 2 * kvs;
    float *h = work, *res1 = h + M * hd, *qkv = res1 + M * hd, *attn = qkv + M * qkv_n;
    float *o = attn + M * qs, *gu = o + M * hd, *act = gu + M * 2 * in, *h2 = act + M * in;
    float *o2 = h2 + M * hd, *gate = o2 + M * hd;
    add_norm_f32(x, residual, DL->in_w, DL->in_b, h, res1, M, hd, hd, DL->eps, DL->norm_kind);
    const float *stream = residual ? res1 : x;
    layer_linear(DL, DL->qkv_q, h, hd, DL->qkv_w, DL->qkv_b, qkv, M, qkv_n, hd);
    attention_step_f32(L, S, qkv, qkv_n, qkv + qs, qkv_n, qkv + qs + kvs, qkv_n, attn, qs);
    if (DL->gate_w) { /* attn * sigmoid(gate(h)), a factor a head */
        int64_t gh = DL->gate_heads, D = qs / gh;
        linear_panels_f32(h, hd, DL->gate_w, NULL, gate, M, gh, hd);
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < gh; j++) {
                float f = sigmoid(gate[m * gh + j]), *a = attn + m * qs + j * D;
                for (int64_t d = 0; d < D; d++) a[d] = a[d] * f;
            }
    }
    layer_linear(DL, DL->o_q, attn, qs, DL->o_w, DL->o_b, o, M, hd, qs);
    if (DL->post_w) {
        add_norm_f32(o, NULL, DL->post_w, NULL, o2, NULL, M, hd, hd, DL->eps, DL->norm_kind);
        o = o2;
    }
    if (DL->parallel) {
        if (DL->mlp_norm)
            add_norm_f32(stream, NULL, DL->mlp_w, DL->mlp_b, h2, NULL, M, hd, hd, DL->eps,
                         DL->norm_kind);
        else
            h2 = h;
        memcpy(res_out, stream, (size_t)(M * hd) * sizeof(float));
    } else {
        add_norm_f32(o, stream, DL->mlp_w, DL->mlp_b, h, res_out, M, hd, hd, DL->eps,
                     DL->norm_kind);
        h2 = h;
    }
    int64_t up_n = DL->gated ? 2 * in : in;
    layer_linear(DL, DL->up_q, h2, hd, DL->up_w, DL->up_b, gu, M, up_n, hd);
    activation_f32(gu, up_n, act, M, in, DL->act, DL->gated);
    if (DL->post_mlp_w) {
        layer_linear(DL, DL->down_q, act, in, DL->down_w, DL->down_b, o2, M, hd, in);
        add_norm_f32(o2, NULL, DL->post_mlp_w, NULL, mlp_out, NULL, M, hd, hd, DL->eps,
                     DL->norm_kind);
    } else {
        layer_linear(DL, DL->down_q, act, in, DL->down_w, DL->down_b, mlp_out, M, hd, in);
    }
    if (DL->parallel) /* attention + MLP, as the torch path adds them */
        for (int64_t i = 0; i < M * hd; i++) mlp_out[i] = o[i] + mlp_out[i];
}

/* -- encoder attention: bidirectional, each request over its own rows ----------------------- */

/* Encoders (BERT and its kin) attend each request's rows to all of its own rows, both ways,
 * with no cache: per (request, head) a small dense softmax(q k^T * scale) v over n rows (n up to
 * a few hundred). Through torch that is an SDPA call a request plus the copies that lay its
 * rows out head-major, tens of microseconds each for the short sentences embedding traffic is
 * made of; here one call does every request and head of the step, reading q, k and v in place
 * (views into the QKV linear's output) and writing the [T, H * D] rows the O projection reads.
 *
 * Per task (request, head) the head's keys are copied once, scaled and transposed, into
 * kt [D, np] (np: n rounded up to 16, zeros past n), so that a block of ENC_QR query rows by 32
 * keys accumulates in registers over d (two key loads and ENC_QR broadcasts per 2 * ENC_QR
 * fused multiply-adds); each row's softmax runs over its keys (all n, or those within a
 * two-sided window: |i - j| < window), and the weighted values accumulate ENC_QR rows by 32
 * values of the head a pass, v's rows read in place. Sums run in another order than torch's. */
#define ENC_QR 8
#define ENC_KB 16 /* kt's rows are padded to a multiple of this */

#ifdef __AVX512F__
#include <immintrin.h>

static inline __mmask16 enc_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}

/* kt[d][j0 + c] = scale * k_{j0 + c}[d] for 16 keys (rows kr, `ks` floats apart; `nk` of them
 * real, the rest zeros) and every d < D: 16 x 16 tiles transposed in registers, one bit of the
 * row and column index swapped a stage. */
static void enc_transpose_keys(const float *kr, int64_t ks, int64_t nk, int64_t D, float scale,
                               float *kt, int64_t np) {
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
    __m512 sv = _mm512_set1_ps(scale);
    for (int64_t dc = 0; dc < D; dc += 16) {
        __mmask16 m = enc_mask(D - dc);
        __m512 r[16];
        for (int64_t c = 0; c < 16; c++)
            r[c] = c < nk ? _mm512_maskz_loadu_ps(m, kr + c * ks + dc) : _mm512_setzero_ps();
        for (int b = 0; b < 4; b++) {
            __m512i il = _mm512_loadu_si512(lo_idx[b]), ih = _mm512_loadu_si512(hi_idx[b]);
            int64_t step = (int64_t)1 << b;
            for (int64_t c = 0; c < 16; c++) {
                if (c & step) continue;
                __m512 a = r[c], e = r[c + step];
                r[c] = _mm512_permutex2var_ps(a, il, e);
                r[c + step] = _mm512_permutex2var_ps(a, ih, e);
            }
        }
        int64_t rows = D - dc < 16 ? D - dc : 16;
        for (int64_t c = 0; c < rows; c++) _mm512_storeu_ps(kt + (dc + c) * np, _mm512_mul_ps(r[c], sv));
    }
}

#define ENC_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

/* sc[r][j] = q_r . kt[:, j] for the block's ENC_QR rows (q rows `qr`) and keys j0..j1-1, both
 * multiples of 16. */
static void enc_scores(const float *const *qr, const float *kt, int64_t np, int64_t D,
                       int64_t j0, int64_t j1, float *sc) {
    int64_t j = j0;
    for (; j + 32 <= j1; j += 32) {
#define DECL(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = _mm512_setzero_ps();
        ENC_ROWS(DECL)
#undef DECL
        const float *kd = kt + j;
        for (int64_t d = 0; d < D; d++, kd += np) {
            __m512 k0 = _mm512_loadu_ps(kd), k1 = _mm512_loadu_ps(kd + 16);
#define STEP(r)                                                                                   \
    {                                                                                             \
        __m512 b = _mm512_set1_ps(qr[r][d]);                                                      \
        a##r##0 = _mm512_fmadd_ps(b, k0, a##r##0);                                                \
        a##r##1 = _mm512_fmadd_ps(b, k1, a##r##1);                                                \
    }
            ENC_ROWS(STEP)
#undef STEP
        }
#define STORE(r)                                                                                  \
    _mm512_storeu_ps(sc + r * np + j, a##r##0);                                                   \
    _mm512_storeu_ps(sc + r * np + j + 16, a##r##1);
        ENC_ROWS(STORE)
#undef STORE
    }
    for (; j < j1; j += 16) {
#define DECL(r) __m512 a##r = _mm512_setzero_ps();
        ENC_ROWS(DECL)
#undef DECL
        const float *kd = kt + j;
        for (int64_t d = 0; d < D; d++, kd += np) {
            __m512 k0 = _mm512_loadu_ps(kd);
#define STEP(r) a##r = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), k0, a##r);
            ENC_ROWS(STEP)
#undef STEP
        }
#define STORE(r) _mm512_storeu_ps(sc + r * np + j, a##r);
        ENC_ROWS(STORE)
#undef STORE
    }
}

/* exp(x) for x <= 0 in 16 lanes: exp_nonpositive's reduction and polynomial, 2^k applied by
 * scalef. */
static inline __m512 enc_exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 k = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, k);
}

/* Row sr's softmax over keys a..b-1 in place (zeros over lo..a-1 and b..hi-1); returns
 * 1 / the sum of its terms (the terms are left unnormalised). */
static float enc_softmax(float *sr, int64_t lo, int64_t a, int64_t b, int64_t hi) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = a; j < b; j += 16)
        mv = _mm512_mask_max_ps(mv, enc_mask(b - j), mv, _mm512_maskz_loadu_ps(enc_mask(b - j), sr + j));
    __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = a; j < b; j += 16) {
        __mmask16 m = enc_mask(b - j);
        __m512 p = enc_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sr + j), mx));
        sum = _mm512_mask_add_ps(sum, m, sum, p);
        _mm512_mask_storeu_ps(sr + j, m, p);
    }
    for (int64_t j = lo; j < a; j++) sr[j] = 0.0f;
    for (int64_t j = b; j < hi; j++) sr[j] = 0.0f;
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* o_r[0..D) = inv[r] * sum_{j in [lo, hi)} sc[r][j] v_j for the block's rows (outputs `orow`,
 * `rows` of them written; v_j = vrow + j * vs). */
static void enc_values(const float *sc, int64_t np, const float *vrow, int64_t vs, int64_t lo,
                       int64_t hi, int64_t D, const float *inv, float *const *orow,
                       int64_t rows) {
    for (int64_t dc = 0; dc < D; dc += 32) {
        __mmask16 m0 = enc_mask(D - dc), m1 = enc_mask(D - dc - 16);
#define DECL(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = _mm512_setzero_ps();
        ENC_ROWS(DECL)
#undef DECL
        for (int64_t j = lo; j < hi; j++) {
            const float *vj = vrow + j * vs + dc;
            __m512 v0 = _mm512_maskz_loadu_ps(m0, vj), v1 = _mm512_maskz_loadu_ps(m1, vj + 16);
#define STEP(r)                                                                                   \
    {                                                                                             \
        __m512 p = _mm512_set1_ps(sc[r * np + j]);                                                \
        a##r##0 = _mm512_fmadd_ps(p, v0, a##r##0);                                                \
        a##r##1 = _mm512_fmadd_ps(p, v1, a##r##1);                                                \
    }
            ENC_ROWS(STEP)
#undef STEP
        }
#define STORE(r)                                                                                  \
    if (r < rows) {                                                                               \
        __m512 s = _mm512_set1_ps(inv[r]);                                                        \
        _mm512_mask_storeu_ps(orow[r] + dc, m0, _mm512_mul_ps(a##r##0, s));                       \
        if (m1) _mm512_mask_storeu_ps(orow[r] + dc + 16, m1, _mm512_mul_ps(a##r##1, s));          \
    }
        ENC_ROWS(STORE)
#undef STORE
    }
}
#undef ENC_ROWS
#else /* any other target: the same steps as plain loops */
static void enc_transpose_keys(const float *kr, int64_t ks, int64_t nk, int64_t D, float scale,
                               float *kt, int64_t np) {
    for (int64_t d = 0; d < D; d++)
        for (int64_t c = 0; c < 16; c++) kt[d * np + c] = c < nk ? kr[c * ks + d] * scale : 0.0f;
}

static void enc_scores(const float *const *qr, const float *kt, int64_t np, int64_t D,
                       int64_t j0, int64_t j1, float *sc) {
    for (int64_t r = 0; r < ENC_QR; r++) {
        float *s = sc + r * np;
        for (int64_t j = j0; j < j1; j++) s[j] = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            float x = qr[r][d];
            const float *kd = kt + d * np;
#pragma omp simd
            for (int64_t j = j0; j < j1; j++) s[j] = MUL_ADD(x, kd[j], s[j]);
        }
    }
}

static float enc_softmax(float *sr, int64_t lo, int64_t a, int64_t b, int64_t hi) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t j = a; j < b; j++) mx = sr[j] > mx ? sr[j] : mx;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = a; j < b; j++) {
        sr[j] = exp_nonpositive(sr[j] - mx);
        sum += sr[j];
    }
    for (int64_t j = lo; j < a; j++) sr[j] = 0.0f;
    for (int64_t j = b; j < hi; j++) sr[j] = 0.0f;
    return 1.0f / sum;
}

static void enc_values(const float *sc, int64_t np, const float *vrow, int64_t vs, int64_t lo,
                       int64_t hi, int64_t D, const float *inv, float *const *orow,
                       int64_t rows) {
    for (int64_t r = 0; r < rows; r++) {
        float *o = orow[r];
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t j = lo; j < hi; j++) {
            float p = sc[r * np + j];
            const float *vj = vrow + j * vs;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] = MUL_ADD(p, vj[d], o[d]);
        }
        for (int64_t d = 0; d < D; d++) o[d] *= inv[r];
    }
}
#endif

/* One (request, head): rows s..s+n-1 of q (head h) over the same rows of k and v (KV head kh),
 * into out's head h. `kt` holds D * np floats, `sc` ENC_QR * np. */
static void encoder_task(const float *q, int64_t qs, const float *k, int64_t ks, const float *v,
                         int64_t vs, float *out, int64_t os, int64_t s, int64_t n, int64_t h,
                         int64_t kh, int64_t D, float scale, int64_t window, float *kt,
                         float *sc) {
    int64_t np = (n + ENC_KB - 1) / ENC_KB * ENC_KB;
    for (int64_t j = 0; j < n; j += 16)
        enc_transpose_keys(k + (s + j) * ks + kh * D, ks, n - j, D, scale, kt + j, np);
    const float *vrow = v + s * vs + kh * D;
    for (int64_t i0 = 0; i0 < n; i0 += ENC_QR) {
        int64_t rows = n - i0 < ENC_QR ? n - i0 : ENC_QR;
        const float *qr[ENC_QR];
        float *orow[ENC_QR];
        for (int64_t r = 0; r < ENC_QR; r++) { /* a short block repeats its last row */
            int64_t i = i0 + (r < rows ? r : rows - 1);
            qr[r] = q + (s + i) * qs + h * D;
            orow[r] = out + (s + i) * os + h * D;
        }
        int64_t lo = 0, hi = n; /* the keys any row of the block sees */
        if (window > 0) {
            lo = i0 - window + 1 > 0 ? i0 - window + 1 : 0;
            hi = i0 + rows - 1 + window < n ? i0 + rows - 1 + window : n;
        }
        int64_t j0 = lo / ENC_KB * ENC_KB, j1 = (hi + ENC_KB - 1) / ENC_KB * ENC_KB;
        enc_scores(qr, kt, np, D, j0, j1, sc);
        float inv[ENC_QR];
        for (int64_t r = 0; r < ENC_QR; r++) {
            int64_t i = i0 + (r < rows ? r : rows - 1), a = lo, b = hi;
            if (window > 0) {
                a = i - window + 1 > 0 ? i - window + 1 : 0;
                b = i + window < n ? i + window : n;
            }
            inv[r] = enc_softmax(sc + r * np, lo, a, b, hi);
        }
        enc_values(sc, np, vrow, vs, lo, hi, D, inv, orow, rows);
    }
}

/* Every request's bidirectional attention: requests are rows starts[i]..starts[i + 1] - 1 of
 * q [T, H, D], k and v [T, KVH, D] (rows qs / ks / vs floats apart, heads contiguous inside a
 * row); out [T, H * D] (rows os apart). window > 0: a query sees keys within window - 1
 * positions either side; 0: all of its request's keys. */
void encoder_attention_f32(const float *q, int64_t qs, const float *k, int64_t ks,
                           const float *v, int64_t vs, float *out, int64_t os,
                           const int64_t *starts, int64_t n_req, int64_t H, int64_t KVH,
                           int64_t D, float scale, int64_t window) {
    int64_t max_n = 0, work = 0;
    for (int64_t i = 0; i < n_req; i++) {
        int64_t n = starts[i + 1] - starts[i];
        max_n = n > max_n ? n : max_n;
        work += n * n;
    }
    if (max_n == 0) return;
    int64_t np = (max_n + ENC_KB - 1) / ENC_KB * ENC_KB, G = H / KVH, tasks = n_req * H;
#pragma omp parallel if (work * H * D > PARALLEL_WORK)
    {
        float *kt = malloc((size_t)((D + ENC_QR) * np) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t i = task / H, h = task % H, n = starts[i + 1] - starts[i];
            if (n > 0)
                encoder_task(q, qs, k, ks, v, vs, out, os, starts[i], n, h, h / G, D, scale,
                             window, kt, kt + D * ((n + ENC_KB - 1) / ENC_KB * ENC_KB));
        }
        free(kt);
    }
}

/* -- the recurrent layers' decode steps ------------------------------------------------------ */

/* One token per request for the recurrent layers (Gated DeltaNet / Kimi Delta Attention, Mamba-2's
 * SSD, Mamba-1's selective scan, the short causal convolution), each request's state read from
 * its slot once and written back once, in place. Why: on a CPU these steps are bound by the
 * states' memory traffic, and the torch references gather the states by slot (index_select),
 * update them in a few passes and scatter them back (index_copy_), reading and writing each state
 * several times. Here one task (request, head) holds its state in L1/L2 between its two passes.
 *
 * Semantics are the references' (kernels/gated_delta.py, ssd.py, selective_scan.py,
 * causal_conv1d.py): has_init[b] == 0 starts request b from zeros without reading its slot (a
 * fresh slot may hold NaN); several rows may name slot 0 (padding: their writes race, their
 * results are never read); the operations in the references' order, so float32 results agree
 * to a few ulps (sums run in another order). */

/* exp(x) for any float32 x, within a few ulps of expf: exp_nonpositive's reduction and
 * polynomial, 2^k applied as two halves so that k from -150 to 128 fits (denormal results
 * included), inf past expf's overflow, NaN kept. Branch-free: a loop of it vectorizes. */
static inline float exp_any(float x) {
    float c = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
    float k = floorf(MUL_ADD(c, 1.44269504088896341f, 0.5f));
    float r = MUL_ADD(k, -0.693359375f, c);
    r = MUL_ADD(k, 2.12194440e-4f, r);
    float y = 1.9875691500e-4f;
    y = MUL_ADD(y, r, 1.3981999507e-3f);
    y = MUL_ADD(y, r, 8.3334519073e-3f);
    y = MUL_ADD(y, r, 4.1665795894e-2f);
    y = MUL_ADD(y, r, 1.6666665459e-1f);
    y = MUL_ADD(y, r, 5.0000001201e-1f);
    y = MUL_ADD(y, r * r, r) + 1.0f;
    int32_t ki = (int32_t)k, k1 = ki >> 1, k2 = ki - k1;
    union {
        int32_t i;
        float f;
    } a = {.i = (k1 + 127) << 23}, b = {.i = (k2 + 127) << 23};
    float e = y * a.f * b.f;
    e = x > 88.72283935546875f ? INFINITY : e;
    return x != x ? x : e;
}

/* Gated delta rule, one token for each of n requests (kernels/gated_delta.py's
 * `_decode_in_place` after `_prepare_qk`). Per (request b, value head h), with S the
 * [Dk, Dv] state of slot slots[b] (zeros where !has_init[b]), hk = h / (Hv / Hk):
 *   q, k <- l2norm(q, k) (x * 1/sqrt(sum x^2 + 1e-6), when l2norm), q <- q * scale
 *   e = exp(g) (a scalar per head, or [Dk] per channel when per_channel)
 *   rk = (k e)^T S, rq = (q e)^T S              (the old state, decayed: one read)
 *   delta = (v - rk) * beta
 *   S <- S * e[:, None] + k delta^T             (in place: one write)
 *   o = rq + (q . k) delta
 * q, k [n, Hk, Dk], v [n, Hv, Dv], g [n, Hv] or [n, Hv, Dk], beta [n, Hv]: strides in floats
 * (rows, heads; the last dim contiguous). state [slots, Hv, Dk, Dv] contiguous; out [n, Hv, Dv]
 * contiguous. */
/* One token of one (request, value head): the body of both functions below; S is the head's
 * [Dk, Dv] state (read only where init), o its Dv outputs. */
static inline void gated_delta_token(const float *qr, const float *kr, const float *vr,
                                     const float *gr, int64_t per_channel, float bt, float *S,
                                     int init, float *o, int64_t Dk, int64_t Dv, float scale,
                                     int64_t l2norm) {
    float qv[Dk], kv[Dk], e[Dk], rk[Dv], rq[Dv];
    float rq_norm = 1.0f, rk_norm = 1.0f;
    if (l2norm) {
        rq_norm = 1.0f / sqrtf(sum_squares(qr, Dk) + 1e-6f);
        rk_norm = 1.0f / sqrtf(sum_squares(kr, Dk) + 1e-6f);
    }
    float qk = 0.0f;
    for (int64_t i = 0; i < Dk; i++) {
        qv[i] = (l2norm ? qr[i] * rq_norm : qr[i]) * scale;
        kv[i] = l2norm ? kr[i] * rk_norm : kr[i];
    }
#pragma omp simd reduction(+ : qk)
    for (int64_t i = 0; i < Dk; i++) qk += qv[i] * kv[i];
    if (per_channel) {
#pragma omp simd
        for (int64_t i = 0; i < Dk; i++) e[i] = exp_any(gr[i]);
    } else {
        float eh = expf(gr[0]);
        for (int64_t i = 0; i < Dk; i++) e[i] = eh;
    }
    for (int64_t j = 0; j < Dv; j++) rk[j] = rq[j] = 0.0f;
    if (init) {
        for (int64_t i = 0; i < Dk; i++) {
            const float *Si = S + i * Dv;
            float ek = kv[i] * e[i], eq = qv[i] * e[i];
#pragma omp simd
            for (int64_t j = 0; j < Dv; j++) {
                rk[j] += ek * Si[j];
                rq[j] += eq * Si[j];
            }
        }
    }
#pragma omp simd
    for (int64_t j = 0; j < Dv; j++) {
        rk[j] = (vr[j] - rk[j]) * bt; /* delta */
        o[j] = rq[j] + qk * rk[j];
    }
    for (int64_t i = 0; i < Dk; i++) {
        float *Si = S + i * Dv;
        float ki = kv[i], ei = e[i];
        if (init) {
#pragma omp simd
            for (int64_t j = 0; j < Dv; j++) Si[j] = Si[j] * ei + ki * rk[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < Dv; j++) Si[j] = ki * rk[j];
        }
    }
}

void gated_delta_decode_f32(const float *q, int64_t q_st, int64_t q_sh, const float *k,
                            int64_t k_st, int64_t k_sh, const float *v, int64_t v_st,
                            int64_t v_sh, const float *g, int64_t g_st, int64_t g_sh,
                            int64_t per_channel, const float *beta, int64_t b_st, int64_t b_sh,
                            float *state, const int32_t *slots, const uint8_t *has_init,
                            float *out, int64_t n, int64_t Hk, int64_t Hv, int64_t Dk,
                            int64_t Dv, float scale, int64_t l2norm) {
    int64_t group = Hv / Hk, tasks = n * Hv;
#pragma omp parallel for schedule(static) if (tasks * Dk * Dv > PARALLEL_WORK)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t b = task / Hv, h = task % Hv, hk = h / group;
        gated_delta_token(q + b * q_st + hk * q_sh, k + b * k_st + hk * k_sh, v + b * v_st + h * v_sh,
                          g + b * g_st + h * g_sh, per_channel, beta[b * b_st + h * b_sh],
                          state + ((int64_t)slots[b] * Hv + h) * Dk * Dv, has_init[b] != 0,
                          out + (b * Hv + h) * Dv, Dk, Dv, scale, l2norm);
    }
}

/* The same rule over prompt chunks, token after token (the recurrent form: each token's state
 * read and written once, in its slot, no chunked matrices): requests b of [0, n), request b's
 * tokens rows starts[b] .. starts[b + 1] - 1 (empty: skipped) in its slot slots[b], from its
 * state where has_init[b] (else zeros); tasks are (request, value head), so a step's prompts
 * share the team. Arguments as gated_delta_decode_f32's, rows indexed by token; out [T, Hv, Dv]
 * contiguous. */
void gated_delta_prefill_f32(const float *q, int64_t q_st, int64_t q_sh, const float *k,
                             int64_t k_st, int64_t k_sh, const float *v, int64_t v_st,
                             int64_t v_sh, const float *g, int64_t g_st, int64_t g_sh,
                             int64_t per_channel, const float *beta, int64_t b_st, int64_t b_sh,
                             float *state, const int32_t *slots, const uint8_t *has_init,
                             const int32_t *starts, float *out, int64_t n, int64_t Hk, int64_t Hv,
                             int64_t Dk, int64_t Dv, float scale, int64_t l2norm) {
    int64_t group = Hv / Hk, tasks = n * Hv;
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t b = task / Hv, h = task % Hv, hk = h / group;
        float *S = state + ((int64_t)slots[b] * Hv + h) * Dk * Dv;
        int init = has_init[b] != 0;
        for (int64_t t = starts[b]; t < starts[b + 1]; t++, init = 1)
            gated_delta_token(q + t * q_st + hk * q_sh, k + t * k_st + hk * k_sh,
                              v + t * v_st + h * v_sh, g + t * g_st + h * g_sh, per_channel,
                              beta[t * b_st + h * b_sh], S, init, out + (t * Hv + h) * Dv, Dk, Dv,
                              scale, l2norm);
    }
}

/* Mamba-2's SSD scan, one token for each of n requests (kernels/ssd.py's `_decode_ref`). Per
 * (request b, head h) with S the [P, N] state of slot slots[b] (zeros where !has_init[b]) and
 * group gr = h / (H / G):
 *   decay = exp(dt A[h]);  S <- S * decay + (dt x) B^T;  y = S C (+ D[h] x)
 * x [n, H, P] (strides x_st, x_sh), dt [n, H] processed (dt_st), A [H], B, C [n, G, N] (row
 * and group strides), D [H] or NULL, state [slots, H, P, N] contiguous, y [n, H, P]
 * contiguous. */
void ssd_decode_f32(const float *x, int64_t x_st, int64_t x_sh, const float *dt, int64_t dt_st,
                    const float *A, const float *B, int64_t B_st, int64_t B_sg, const float *C,
                    int64_t C_st, int64_t C_sg, const float *D, float *state,
                    const int32_t *slots, const uint8_t *has_init, float *y, int64_t n,
                    int64_t H, int64_t G, int64_t P, int64_t N) {
    int64_t R = H / G, tasks = n * H;
#pragma omp parallel for schedule(static) if (tasks * P * N > PARALLEL_WORK)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t b = task / H, h = task % H, gr = h / R;
        float d = dt[b * dt_st + h];
        float decay = expf(d * A[h]);
        const float *xr = x + b * x_st + h * x_sh;
        const float *Bg = B + b * B_st + gr * B_sg, *Cg = C + b * C_st + gr * C_sg;
        float *S = state + ((int64_t)slots[b] * H + h) * P * N;
        float *yr = y + (b * H + h) * P;
        int init = has_init[b] != 0;
        for (int64_t p = 0; p < P; p++) {
            float *Sp = S + p * N;
            float dx = d * xr[p], acc = 0.0f;
            if (init) {
#pragma omp simd reduction(+ : acc)
                for (int64_t m = 0; m < N; m++) {
                    float s = Sp[m] * decay + dx * Bg[m];
                    Sp[m] = s;
                    acc += s * Cg[m];
                }
            } else {
#pragma omp simd reduction(+ : acc)
                for (int64_t m = 0; m < N; m++) {
                    float s = dx * Bg[m];
                    Sp[m] = s;
                    acc += s * Cg[m];
                }
            }
            yr[p] = D ? acc + D[h] * xr[p] : acc;
        }
    }
}

/* Mamba-1's selective scan, one token for each of n requests (kernels/selective_scan.py's
 * decode branch). Per (request b, channel d) with h the [N] state row of slot slots[b] (zeros
 * where !has_init[b]):
 *   h <- h * exp(dt A[d]) + (dt u) B;  y = h . C (+ D[d] u) (* silu(z))
 * u, dt, z [n, Dn] (row strides; dt processed: bias and softplus applied), A [Dn, N]
 * contiguous, B, C [n, N] (row strides), D [Dn] or NULL, z or NULL, state [slots, Dn, N]
 * contiguous, y [n, Dn] (row stride y_st). */
#define SCAN_CHANNELS 64 /* channels per task: a task is 4 KB of state at N = 16 */

/* Channels d0..d1-1 (at most SCAN_CHANNELS) of one request: the per-channel scalars (dt u, the
 * D skip, the gate) in vector passes across channels, the state rows one channel at a time.
 * Inlined with a constant N where it is the usual 16, so the loops over N become straight vector
 * code (a runtime N costs a loop's prologue and epilogue per channel). */
static inline __attribute__((always_inline)) void
scan_channels(const float *restrict u, const float *restrict dt, const float *restrict A,
              const float *restrict Bb, const float *restrict Cb, const float *restrict D,
              const float *restrict z, float *restrict Sb, float *restrict yb, int64_t d0,
              int64_t d1, int64_t N, int init) {
    float du[SCAN_CHANNELS];
#pragma omp simd
    for (int64_t d = d0; d < d1; d++) du[d - d0] = dt[d] * u[d];
    for (int64_t d = d0; d < d1; d++) {
        float dtv = dt[d], dud = du[d - d0], acc = 0.0f;
        const float *Ad = A + d * N;
        float *h = Sb + d * N;
        if (init) {
#pragma omp simd reduction(+ : acc)
            for (int64_t m = 0; m < N; m++) {
                float s = h[m] * exp_any(dtv * Ad[m]) + dud * Bb[m];
                h[m] = s;
                acc += s * Cb[m];
            }
        } else {
#pragma omp simd reduction(+ : acc)
            for (int64_t m = 0; m < N; m++) {
                float s = dud * Bb[m];
                h[m] = s;
                acc += s * Cb[m];
            }
        }
        yb[d] = acc;
    }
    if (D)
#pragma omp simd
        for (int64_t d = d0; d < d1; d++) yb[d] = yb[d] + u[d] * D[d];
    if (z)
#pragma omp simd
        for (int64_t d = d0; d < d1; d++) yb[d] = yb[d] * act_silu(z[d]);
}

void selective_scan_decode_f32(const float *u, int64_t u_st, const float *dt, int64_t dt_st,
                               const float *A, const float *B, int64_t B_st, const float *C,
                               int64_t C_st, const float *D, const float *z, int64_t z_st,
                               float *state, const int32_t *slots, const uint8_t *has_init,
                               float *y, int64_t y_st, int64_t n, int64_t Dn, int64_t N) {
    int64_t blocks = (Dn + SCAN_CHANNELS - 1) / SCAN_CHANNELS, tasks = n * blocks;
#pragma omp parallel for schedule(static) if (n * Dn * N > PARALLEL_WORK)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t b = task / blocks, d0 = task % blocks * SCAN_CHANNELS;
        int64_t d1 = d0 + SCAN_CHANNELS < Dn ? d0 + SCAN_CHANNELS : Dn;
        const float *ub = u + b * u_st, *dtb = dt + b * dt_st, *zb = z ? z + b * z_st : NULL;
        const float *Bb = B + b * B_st, *Cb = C + b * C_st;
        float *Sb = state + (int64_t)slots[b] * Dn * N, *yb = y + b * y_st;
        int init = has_init[b] != 0;
        if (N == 16)
            scan_channels(ub, dtb, A, Bb, Cb, D, zb, Sb, yb, d0, d1, 16, init);
        else
            scan_channels(ub, dtb, A, Bb, Cb, D, zb, Sb, yb, d0, d1, N, init);
    }
}

/* The depthwise causal convolution, one token for each of n requests (kernels/causal_conv1d.py's
 * decode branch). Per (request b, channel c) with s the K-1 previous inputs in slot slots[b]
 * (zeros where !has_init[b]), oldest first:
 *   y = act(sum_j w[c, j] * [s, x][j] (+ bias[c]));  s <- the last K-1 of [s, x]
 * x [n, C] (row stride x_st), w [C, K] contiguous, bias [C] or NULL, conv_state
 * [slots, C, K-1] contiguous, out [n, C] (row stride out_st); silu: 1 for SiLU, 0 for none. */

/* One request's channels; inlined with a constant K for the usual K = 4, so the loops over K
 * unroll and the loop over channels vectorizes (strided loads of the state): one loop for each
 * case of `init` and the bias and the activation in passes of their own, as a loop with a branch
 * does not vectorize. */
static inline __attribute__((always_inline)) void
conv_channels(const float *restrict xb, const float *restrict w, const float *restrict bias,
              float *restrict sb, float *restrict ob, int64_t C, int64_t K, int init, int silu) {
    int64_t Km = K - 1;
    if (init) {
#pragma omp simd
        for (int64_t c = 0; c < C; c++) {
            float *s = sb + c * Km;
            const float *wc = w + c * K;
            float acc = 0.0f, xc = xb[c];
            for (int64_t j = 0; j < Km; j++) acc += s[j] * wc[j];
            ob[c] = acc + xc * wc[Km];
            for (int64_t j = 0; j + 1 < Km; j++) s[j] = s[j + 1]; /* the window shifted */
            s[Km - 1] = xc;
        }
    } else {
#pragma omp simd
        for (int64_t c = 0; c < C; c++) {
            float *s = sb + c * Km;
            float xc = xb[c];
            ob[c] = xc * w[c * K + Km];
            for (int64_t j = 0; j + 1 < Km; j++) s[j] = 0.0f;
            s[Km - 1] = xc;
        }
    }
    if (bias)
#pragma omp simd
        for (int64_t c = 0; c < C; c++) ob[c] = ob[c] + bias[c];
    if (silu)
#pragma omp simd
        for (int64_t c = 0; c < C; c++) ob[c] = act_silu(ob[c]);
}

void conv1d_decode_f32(const float *x, int64_t x_st, const float *w, const float *bias,
                       float *conv_state, const int32_t *slots, const uint8_t *has_init,
                       float *out, int64_t out_st, int64_t n, int64_t C, int64_t K,
                       int64_t silu) {
    int64_t Km = K - 1;
#pragma omp parallel for schedule(static) if (n * C * K > PARALLEL_WORK)
    for (int64_t b = 0; b < n; b++) {
        const float *xb = x + b * x_st;
        float *sb = conv_state + (int64_t)slots[b] * C * Km, *ob = out + b * out_st;
        int init = has_init[b] != 0;
        if (K == 4)
            conv_channels(xb, w, bias, sb, ob, C, 4, init, silu != 0);
        else
            conv_channels(xb, w, bias, sb, ob, C, K, init, silu != 0);
    }
}

/* -- a whole short-convolution layer (LFM2, LFM3) for a decode step ----------------------- */

/* LFM2's gated short convolution as a pre-norm layer, over M decode rows (row b is request b's
 * one token, its window in state slot slots[b]):
 *
 *   h = rms(stream);  B, C, x = in_proj(h);  y = C * conv(B * x);  o = out_proj(y)
 *   [o = rms_post(o)];  h = rms_mlp(o + stream);  m = down(act(gate(h)) * up(h));  [m = rms(m)]
 *
 * (the bracketed norms: LFM3's "sandwich" norms, where post_w / post_mlp_w are set). The same
 * kernels, in the same order, as the module path's native calls (add_norm_f32, the panel GEMM,
 * conv1d_decode_f32, activation_f32; the two products are single roundings, as torch's), so the
 * two agree bit for bit. Every norm is an RMSNorm. */
typedef struct {
    int64_t hidden, channels, kernel, inter;
    int64_t act;   /* activation_f32's kind */
    int64_t gated; /* 1: up_w is [gate | up], 2 * inter rows; 0: inter rows */
    float eps;
    const float *in_w, *post_w, *mlp_w, *post_mlp_w; /* post_w, post_mlp_w: NULL for none */
    const float *in_proj_w, *in_proj_b, *conv_w, *conv_b, *out_w, *out_b;
    const float *up_w, *up_b, *down_w, *down_b;
} conv_layer_t;

/* Writes the MLP's output to mlp_out [M, hidden] and the stream after the mixer's add to res_out
 * [M, hidden] (the decoder's (x, residual) pair); with `residual` the stream is x + residual,
 * else x. conv_state [slots, channels, kernel - 1] is updated in place. `work` holds
 * M * (4 * hidden + 5 * channels + 3 * inter) floats. */
void conv_layer_f32(const conv_layer_t *CL, float *conv_state, const int32_t *slots,
                    const uint8_t *has_init, const float *x, const float *residual,
                    float *mlp_out, float *res_out, float *work, int64_t M) {
    int64_t hd = CL->hidden, C = CL->channels, in = CL->inter;
    int64_t up_n = CL->gated ? 2 * in : in;
    float *h = work, *res1 = h + M * hd, *bcx = res1 + M * hd, *bx = bcx + M * 3 * C;
    float *cv = bx + M * C, *o = cv + M * C, *o2 = o + M * hd, *gu = o2 + M * hd;
    float *act = gu + M * up_n;
    add_norm_f32(x, residual, CL->in_w, NULL, h, res1, M, hd, hd, CL->eps, 0);
    const float *stream = residual ? res1 : x;
    linear_panels_f32(h, hd, CL->in_proj_w, CL->in_proj_b, bcx, M, 3 * C, hd);
    for (int64_t b = 0; b < M; b++) { /* B * x: in_proj's first and last thirds */
        const float *r = bcx + b * 3 * C;
        float *d = bx + b * C;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) d[c] = r[c] * r[2 * C + c];
    }
    conv1d_decode_f32(bx, C, CL->conv_w, CL->conv_b, conv_state, slots, has_init, cv, C, M, C,
                      CL->kernel, 0);
    for (int64_t b = 0; b < M; b++) { /* C * conv: the middle third gates */
        const float *r = bcx + b * 3 * C + C;
        float *d = cv + b * C;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) d[c] = r[c] * d[c];
    }
    linear_panels_f32(cv, C, CL->out_w, CL->out_b, o, M, hd, C);
    if (CL->post_w) {
        add_norm_f32(o, NULL, CL->post_w, NULL, o2, NULL, M, hd, hd, CL->eps, 0);
        o = o2;
    }
    add_norm_f32(o, stream, CL->mlp_w, NULL, h, res_out, M, hd, hd, CL->eps, 0);
    linear_panels_f32(h, hd, CL->up_w, CL->up_b, gu, M, up_n, hd);
    activation_f32(gu, up_n, act, M, in, CL->act, CL->gated);
    if (CL->post_mlp_w) {
        linear_panels_f32(act, in, CL->down_w, CL->down_b, o2, M, hd, in);
        add_norm_f32(o2, NULL, CL->post_mlp_w, NULL, mlp_out, NULL, M, hd, hd, CL->eps, 0);
    } else {
        linear_panels_f32(act, in, CL->down_w, CL->down_b, mlp_out, M, hd, in);
    }
}

/* The same convolution over prompt chunks, token after token through each request's window (as
 * its decodes read it, so a prompt and its decodes round alike): requests b of [0, n), request
 * b's tokens rows starts[b] .. starts[b + 1] - 1 (empty: skipped), slot slots[b], from its window
 * where has_init[b] (else zeros); tasks are (request, block of channels), so a step's prompts
 * share the team. x rows x_st apart, out rows out_st apart (channels contiguous). */
#define CONV_BLOCK 64
void conv1d_prefill_f32(const float *x, int64_t x_st, const float *w, const float *bias,
                        float *conv_state, const int32_t *slots, const uint8_t *has_init,
                        const int32_t *starts, float *out, int64_t out_st, int64_t n, int64_t C,
                        int64_t K, int64_t silu) {
    int64_t Km = K - 1, blocks = (C + CONV_BLOCK - 1) / CONV_BLOCK, tasks = n * blocks;
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t b = task / blocks, c0 = (task % blocks) * CONV_BLOCK;
        int64_t cb = C - c0 < CONV_BLOCK ? C - c0 : CONV_BLOCK;
        float *sb = conv_state + (int64_t)slots[b] * C * Km + c0 * Km;
        const float *wb = w + c0 * K, *bb = bias ? bias + c0 : NULL;
        int init = has_init[b] != 0;
        for (int64_t t = starts[b]; t < starts[b + 1]; t++, init = 1) {
            if (K == 4)
                conv_channels(x + t * x_st + c0, wb, bb, sb, out + t * out_st + c0, cb, 4, init,
                              silu != 0);
            else
                conv_channels(x + t * x_st + c0, wb, bb, sb, out + t * out_st + c0, cb, K, init,
                              silu != 0);
        }
    }
}

/* kernels/causal_conv1d.py's gated_rms_norm_ref in float32, in one call (prefill and decode
 * rows alike): rows (a, b) of x and z [n0, n1, D] (strides s0, s1 in floats; D contiguous),
 * each row's groups of G channels normalised by their own root mean square, gated by silu(z):
 * before: y = w * (x r) * silu(z); else y = w * (h r) with h = x silu(z); r = 1 / sqrt(mean of
 * the group's squares + eps); w [D]; y [n0, n1, D] contiguous. The torch op order (the gate and
 * the row in float32, the weight then the gate multiplied last). */
void gated_rms_norm_f32(const float *x, int64_t x_s0, int64_t x_s1, const float *z, int64_t z_s0,
                        int64_t z_s1, const float *w, float *y, int64_t n0, int64_t n1, int64_t D,
                        int64_t G, float eps, int64_t before) {
    int64_t rows = n0 * n1;
#pragma omp parallel for schedule(static) if (rows * D > PARALLEL_WORK)
    for (int64_t r = 0; r < rows; r++) {
        int64_t a = r / n1, b = r % n1;
        const float *xr = x + a * x_s0 + b * x_s1, *zr = z + a * z_s0 + b * z_s1;
        float *yr = y + r * D;
        float gate[D], h[D];
#pragma omp simd
        for (int64_t i = 0; i < D; i++) gate[i] = act_silu(zr[i]);
        if (before) {
            for (int64_t i = 0; i < D; i++) h[i] = xr[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < D; i++) h[i] = xr[i] * gate[i];
        }
        for (int64_t g0 = 0; g0 < D; g0 += G) {
            float inv = 1.0f / sqrtf(sum_squares(h + g0, G) / (float)G + eps);
            if (before) {
#pragma omp simd
                for (int64_t i = g0; i < g0 + G; i++) yr[i] = w[i] * (h[i] * inv) * gate[i];
            } else {
#pragma omp simd
                for (int64_t i = g0; i < g0 + G; i++) yr[i] = w[i] * (h[i] * inv);
            }
        }
    }
}

/* Mamba-1's selective scan over prompt chunks, token after token in each request's slot (the
 * decode's per-token body, the D skip and the z gate included): requests b of [0, n), request
 * b's tokens rows starts[b] .. starts[b + 1] - 1 (empty: skipped), from its state where
 * has_init[b] (else zeros); tasks are (request, block of channels). Arguments as
 * selective_scan_decode_f32's, rows indexed by token. */
void selective_scan_prefill_f32(const float *u, int64_t u_st, const float *dt, int64_t dt_st,
                                const float *A, const float *B, int64_t B_st, const float *C,
                                int64_t C_st, const float *D, const float *z, int64_t z_st,
                                float *state, const int32_t *slots, const uint8_t *has_init,
                                const int32_t *starts, float *y, int64_t y_st, int64_t n,
                                int64_t Dn, int64_t N) {
    int64_t blocks = (Dn + SCAN_CHANNELS - 1) / SCAN_CHANNELS, tasks = n * blocks;
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t b = task / blocks, d0 = task % blocks * SCAN_CHANNELS;
        int64_t d1 = d0 + SCAN_CHANNELS < Dn ? d0 + SCAN_CHANNELS : Dn;
        float *Sb = state + (int64_t)slots[b] * Dn * N;
        int init = has_init[b] != 0;
        for (int64_t t = starts[b]; t < starts[b + 1]; t++, init = 1) {
            const float *ut = u + t * u_st, *dtt = dt + t * dt_st, *zt = z ? z + t * z_st : NULL;
            const float *Bt = B + t * B_st, *Ct = C + t * C_st;
            float *yt = y + t * y_st;
            if (N == 16)
                scan_channels(ut, dtt, A, Bt, Ct, D, zt, Sb, yt, d0, d1, 16, init);
            else
                scan_channels(ut, dtt, A, Bt, Ct, D, zt, Sb, yt, d0, d1, N, init);
        }
    }
}
