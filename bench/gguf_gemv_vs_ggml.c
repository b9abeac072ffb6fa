/* One input row times each SmolLM2 Q4_1 layer shape (and the Q8_0 LM head): our few-row kernel
 * (gguf_blocks.c's qb32_linear_desc) against llama.cpp's own dot (ggml_vec_dot_q4_1_q8_1 /
 * q8_0_q8_0 per output row after quantize_row_q8_1 / q8_0, as its CPU matmul runs a decode row),
 * on the same random blocks, in process CPU time, best of REPS. COPIES copies of each shape are
 * walked in turn, so with 30 (a model's layers) the blocks stream from memory as in a decode,
 * with 1 they stay in cache (the kernels' compute rate). Run with OMP_NUM_THREADS=1.
 *
 *   cc -O2 -march=native bench/gguf_gemv_vs_ggml.c -o /tmp/gemv -ldl -lm
 *   OMP_NUM_THREADS=1 /tmp/gemv $(ls -t ~/.cache/serverless_llm/cpu_native/gguf_blocks-*.so | head -1) \
 *       .venv/lib/python3.11/site-packages/llama_cpp/lib/libggml-cpu.so PATH COPIES REPS
 * PATH: 3 float inputs (22-bit codes), 0 int8 inputs (kernels/gguf_blocks.py PATHS). */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    const uint8_t *qs;
    const void *d, *c;
    int64_t N, K, bits, path, group, scale_bytes;
} qb32_t;
typedef void (*lin_t)(const float *, int64_t, int64_t, const void *, const float *, float *,
                      int64_t);
typedef void (*dot_t)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
typedef void (*qrow_t)(const float *, void *, int64_t);

static double cpu(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint16_t small_half(void) { /* a float16 in [0.001, 0.011) */
    float f = (rand() / (float)RAND_MAX) * 0.01f + 0.001f;
    uint32_t b;
    memcpy(&b, &f, 4);
    return (uint16_t)(((((b >> 23) & 0xff) - 127 + 15) << 10) | ((b >> 13) & 0x3ff));
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s ours.so libggml-cpu.so PATH COPIES REPS\n", argv[0]);
        return 2;
    }
    void *ours = dlopen(argv[1], RTLD_NOW), *gg = dlopen(argv[2], RTLD_NOW);
    if (!ours || !gg) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 1;
    }
    lin_t lin = (lin_t)dlsym(ours, "qb32_linear_desc");
    dot_t d41 = (dot_t)dlsym(gg, "ggml_vec_dot_q4_1_q8_1");
    dot_t d80 = (dot_t)dlsym(gg, "ggml_vec_dot_q8_0_q8_0");
    qrow_t q81 = (qrow_t)dlsym(gg, "quantize_row_q8_1"), q80 = (qrow_t)dlsym(gg, "quantize_row_q8_0");
    void (*init)(void) = (void (*)(void))dlsym(gg, "ggml_cpu_init");
    init(); /* ggml's float16 tables */
    int path = atoi(argv[3]), copies = atoi(argv[4]), reps = atoi(argv[5]);
    int64_t shapes[][3] = {{960, 576, 4}, {576, 576, 4}, {3072, 576, 4}, {576, 1536, 4},
                           {49152, 576, 8}};
    for (int si = 0; si < 5; si++) {
        int64_t N = shapes[si][0], K = shapes[si][1], bits = shapes[si][2], nb = K / 32;
        int cp = bits == 8 ? 1 : copies;
        size_t fb = bits == 4 ? 20 : 34; /* a file block's bytes */
        uint8_t **file = malloc(cp * sizeof(void *));
        qb32_t *w = malloc(cp * sizeof(qb32_t));
        for (int c = 0; c < cp; c++) {
            file[c] = malloc(N * nb * fb);
            uint8_t *qs = malloc(N * nb * (bits == 4 ? 16 : 32));
            uint16_t *d = malloc(N * nb * 2), *cc = malloc(N * nb * 2);
            for (int64_t b = 0; b < N * nb; b++) {
                uint8_t *f = file[c] + b * fb;
                uint16_t h = small_half(), m = small_half() | 0x8000;
                memcpy(f, &h, 2);
                d[b] = h;
                if (bits == 4) { /* Q4_1: d, m, 16 bytes of nibbles; ours: u, d, c = m */
                    memcpy(f + 2, &m, 2);
                    cc[b] = m;
                    for (int j = 0; j < 16; j++) f[4 + j] = qs[b * 16 + j] = (uint8_t)rand();
                } else { /* Q8_0: d, 32 signed bytes; ours: u = q + 128, c = -128 d */
                    cc[b] = (uint16_t)(h + (7 << 10)) | 0x8000;
                    for (int j = 0; j < 32; j++) {
                        int8_t v = (int8_t)rand();
                        f[2 + j] = (uint8_t)v;
                        qs[b * 32 + j] = (uint8_t)(v + 128);
                    }
                }
            }
            w[c] = (qb32_t){qs, d, cc, N, K, bits, path, 32, 2};
        }
        float *x = malloc(K * 4), *out = malloc(N * 4);
        for (int i = 0; i < K; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
        void *y = malloc(nb * 40);
        double best_o = 1e9, best_g = 1e9;
        for (int r = 0; r < reps; r++) { /* alternating, best of each */
            double t = cpu();
            for (int c = 0; c < cp; c++) lin(x, K, 1, &w[c], NULL, out, N);
            t = cpu() - t;
            best_o = t < best_o ? t : best_o;
            t = cpu();
            for (int c = 0; c < cp; c++) {
                (bits == 4 ? q81 : q80)(x, y, K);
                for (int64_t n = 0; n < N; n++)
                    (bits == 4 ? d41 : d80)((int)K, out + n, 0, file[c] + n * nb * fb, 0, y, 0, 1);
            }
            t = cpu() - t;
            best_g = t < best_g ? t : best_g;
        }
        double bytes = (double)cp * N * nb * fb;
        printf("%6ld x %4ld %s x%2d (%5.1f MB): ours %7.1f us %5.1f GB/s | llama.cpp %7.1f us "
               "%5.1f GB/s | %.2fx\n",
               (long)N, (long)K, bits == 4 ? "Q4_1" : "Q8_0", cp, bytes / 1e6, best_o / cp * 1e6,
               bytes / best_o / 1e9, best_g / cp * 1e6, bytes / best_g / 1e9, best_g / best_o);
    }
    return 0;
}
