/* Causal attention of a forward's rows against a paged KV pool, one row at a time.

Each (row, head) is computed by one thread, in one fixed order, from the row's own query
and the keys at positions 0..pos of its request: scores, their exact maximum, the
exponentials, then the weighted sum of values, key by key. Nothing depends on which other
rows share the call, so a row's output has the same bits in a prefill, a K+1-row verify, a
re-prefill after failover and a one-row decode.

Vector code without reassociation: a dot product keeps LANES independent partial sums
(what a compiler maps to one SIMD register) and adds them in a fixed tree at the end; the
weighted sum of values is vectorised along the head dimension, whose elements are
independent. Built with -O3 -march=native -ffp-contract=fast (multiply-adds fused: fixed by the
build, not by the data) and without -ffast-math (specdec/native/__init__.py). */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

typedef struct {
    const float *q;        /* [T, H, D], already scaled by 1/sqrt(D) */
    const void *k, *v;     /* [slots, KV, D], float32 or bfloat16 */
    int bf16;
    int64_t H, KV, D, block_size;
    const int64_t *row_pos;    /* [T] the row's position in its request */
    const int64_t *row_table;  /* [T] offset of the row's block table in tables */
    const int64_t *tables;     /* block ids, each request's table contiguous */
    float *out;                /* [T, H, D] */
    int64_t first, last;       /* (row, head) pairs [first, last) of this thread */
    int64_t max_keys;
    int failed;                /* set when scratch memory could not be had */
} job_t;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Row `slot`, head `h` of a pool, as float32 (bf16 pools are widened into buf). */
static inline const float *pool_row(const void *pool, int bf16, int64_t slot, int64_t h,
                                    int64_t KV, int64_t D, float *buf) {
    int64_t at = (slot * KV + h) * D;
    if (!bf16) return (const float *)pool + at;
    const uint16_t *src = (const uint16_t *)pool + at;
    for (int64_t d = 0; d < D; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

/* GCC / Clang vector extension: LANES floats, one AVX-512 register or two AVX2 ones. */
typedef float vec_t __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec_t __attribute__((vector_size(LANES * sizeof(int32_t))));

#ifdef __clang__
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (ivec_t){__VA_ARGS__})
#endif

/* The lanes' sum in a fixed tree, in registers (adding halves, then quarters, ...). */
static inline float lane_sum(vec_t v) {
    v += SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

static inline float dot(const float *a, const float *b, int64_t D) {
    vec_t acc = {0};
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES) {
        vec_t x, y;
        memcpy(&x, a + d, sizeof x);
        memcpy(&y, b + d, sizeof y);
        acc += x * y;
    }
    if (d < D) {  /* a head_dim that is not a multiple of LANES: the rest in one more vector */
        vec_t x = {0}, y = {0};
        memcpy(&x, a + d, sizeof(float) * (size_t)(D - d));
        memcpy(&y, b + d, sizeof(float) * (size_t)(D - d));
        acc += x * y;
    }
    return lane_sum(acc);
}

/* e^x for x <= 0 (a score minus the maximum), within about 2 ulp: x = n ln2 + r, e^r by a
   degree-6 polynomial (Cephes' expf), 2^n by building the exponent bits. Branch-free
   arithmetic, so the loop over a row's keys is vectorised; libm's expf is a call per key. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t H = j->H, KV = j->KV, D = j->D, G = H / KV, S = j->block_size;
    int log2_block = 0;  /* S is a power of two (checked by the caller): shifts, not divisions */
    while (((int64_t)1 << log2_block) < S) log2_block++;
    float *scores = malloc(sizeof(float) * (size_t)j->max_keys);
    float *kbuf = malloc(sizeof(float) * (size_t)D);
    float *vbuf = malloc(sizeof(float) * (size_t)D);
    if (!scores || !kbuf || !vbuf) {
        j->failed = 1;
        j->last = j->first;
    }
    for (int64_t p = j->first; p < j->last; p++) {
        int64_t row = p / H, h = p % H, kvh = h / G;
        const float *q = j->q + (row * H + h) * D;
        const int64_t *table = j->tables + j->row_table[row];
        int64_t n = j->row_pos[row] + 1;
        float m = -INFINITY;
        for (int64_t t = 0; t < n; t++) {  /* key t sits in block table[t / S] at t % S */
            int64_t slot = table[t >> log2_block] * S + (t & (S - 1));
            scores[t] = dot(q, pool_row(j->k, j->bf16, slot, kvh, KV, D, kbuf), D);
            if (scores[t] > m) m = scores[t];
        }
        for (int64_t t = 0; t < n; t++) scores[t] = exp_nonpositive(scores[t] - m);
        float *restrict o = j->out + (row * H + h) * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        float sum = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            int64_t slot = table[t >> log2_block] * S + (t & (S - 1));
            const float *v = pool_row(j->v, j->bf16, slot, kvh, KV, D, vbuf);
            float w = scores[t];
            sum += w;
            for (int64_t d = 0; d < D; d++) o[d] += w * v[d];
        }
        float inv = 1.0f / sum;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
    free(scores);
    free(kbuf);
    free(vbuf);
    return NULL;
}

/* Splits the (row, head) pairs over up to `threads` threads (the caller passes 1 for small
   calls, where starting threads costs more than it saves). Returns 0; -1 when scratch
   memory could not be had, -2 when block_size is not a power of two; a thread that cannot start leaves its pairs to this one. */
int specdec_paged_attention(const float *q, int64_t T, int64_t H, int64_t D,
                            const void *k, const void *v, int bf16, int64_t KV,
                            int64_t block_size, const int64_t *row_pos,
                            const int64_t *row_table, const int64_t *tables,
                            int64_t max_keys, float *out, int threads) {
    int64_t pairs = T * H;
    if (block_size < 1 || (block_size & (block_size - 1))) return -2;
    if (pairs <= 0) return 0;  /* no rows: nothing to compute (jobs[0] would be unset) */
    if (threads < 1) threads = 1;
    if (threads > pairs) threads = (int)pairs;
    job_t jobs[64];
    pthread_t ids[64];
    if (threads > 64) threads = 64;
    for (int i = 0; i < threads; i++) {
        jobs[i] = (job_t){q, k, v, bf16, H, KV, D, block_size, row_pos, row_table, tables, out,
                          pairs * i / threads, pairs * (i + 1) / threads, max_keys, 0};
    }
    int started = 0, failed = 0;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&ids[i], NULL, run, &jobs[i]) != 0) { failed = 1; break; }
        started = i;
    }
    run(&jobs[0]);
    for (int i = 1; i <= started; i++) pthread_join(ids[i], NULL);
    if (failed)  /* the pairs of threads that did not start, on this one */
        for (int i = started + 1; i < threads; i++) run(&jobs[i]);
    for (int i = 0; i < threads; i++)
        if (jobs[i].failed) return -1;
    return 0;
}
