/* Paged attention on the CPU, read straight from the cache blocks.
 *
 * Row r has nq queries per KV head (a decoding sequence's query heads of that KV head, or every
 * member's of a cluster sharing a prefix) and attends keys 0 .. lens[r]-1, whose K/V sit in the
 * cache blocks tables[r][t / block_size]. Keys and values are read once per (row, KV head), with
 * no gathered copy: decoding is memory-bound on the CPU.
 *
 *   q        [R, Hkv, nq, D]               out [R, Hkv, nq, D]
 *   k, v     [blocks, block_size, Hkv, D]  lse [R, Hkv, nq]  log-sum-exp of the scaled scores
 *   tables   [R, M] int64                  lens [R] int64 (a row with no key: out 0, lse -inf)
 *
 * The head dimension is a compile-time constant in the common cases (64, 128) so that a key or a
 * query's accumulator lives in vector registers; other sizes take the generic loop.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p)
{
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline float hsum8(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* Softmax of each query's n scores in place; the log-sum-exp goes to lse. */
static void softmax_rows(float *s, int64_t nq, int64_t n, float *lse)
{
    for (int64_t i = 0; i < nq; i++) {
        float *si = s + i * n;
        float top = si[0];
        for (int64_t t = 1; t < n; t++) top = si[t] > top ? si[t] : top;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < n; t++) {
            si[t] = expf(si[t] - top);
            total += si[t];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < n; t++) si[t] *= inv;
        lse[i] = top + logf(total);
    }
}

#define SLOT(t) ((table[(t) / bs] * bs + (t) % bs) * Hkv + h)

/* One (row, KV head) with a fixed head dimension DIM (a multiple of 8). */
#define ROW_KERNEL(DIM)                                                                                  \
    static void row_##DIM(const float *q, const float *k, const float *v, const int64_t *table, int64_t n, \
                          float *o, float *lse, float *s, int64_t nq, int64_t Hkv, int64_t h, int64_t bs,  \
                          float scale)                                                                     \
    {                                                                                                      \
        enum { W = DIM / 8 };                                                                              \
        for (int64_t t = 0; t < n; t++) {                                                                  \
            const float *kt = k + SLOT(t) * DIM;                                                           \
            v8 key[W];                                                                                     \
            for (int j = 0; j < W; j++) key[j] = load8(kt + 8 * j);                                        \
            for (int64_t i = 0; i < nq; i++) {                                                             \
                const float *qi = q + i * DIM;                                                             \
                v8 acc = load8(qi) * key[0];                                                               \
                for (int j = 1; j < W; j++) acc += load8(qi + 8 * j) * key[j];                             \
                s[i * n + t] = hsum8(acc) * scale;                                                         \
            }                                                                                              \
        }                                                                                                  \
        softmax_rows(s, nq, n, lse);                                                                       \
        for (int64_t i = 0; i < nq; i++) {                                                                 \
            const float *wi = s + i * n;                                                                   \
            v8 acc[W];                                                                                     \
            for (int j = 0; j < W; j++) acc[j] = (v8){0};                                                  \
            for (int64_t t = 0; t < n; t++) {                                                              \
                const float *vt = v + SLOT(t) * DIM;                                                       \
                const float w = wi[t];                                                                     \
                for (int j = 0; j < W; j++) acc[j] += w * load8(vt + 8 * j);                               \
            }                                                                                              \
            memcpy(o + i * DIM, acc, sizeof acc);                                                          \
        }                                                                                                  \
    }

ROW_KERNEL(64)
ROW_KERNEL(128)

static void row_any(const float *q, const float *k, const float *v, const int64_t *table, int64_t n, float *o,
                    float *lse, float *s, int64_t nq, int64_t Hkv, int64_t h, int64_t bs, float scale, int64_t D)
{
    for (int64_t t = 0; t < n; t++) {
        const float *kt = k + SLOT(t) * D;
        for (int64_t i = 0; i < nq; i++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += q[i * D + d] * kt[d];
            s[i * n + t] = dot * scale;
        }
    }
    softmax_rows(s, nq, n, lse);
    memset(o, 0, sizeof(float) * nq * D);
    for (int64_t t = 0; t < n; t++) {
        const float *vt = v + SLOT(t) * D;
        for (int64_t i = 0; i < nq; i++) {
            const float w = s[i * n + t];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[i * D + d] += w * vt[d];
        }
    }
}

/* 0 on success; -1 out of memory; -2 a row names a block outside the cache or more keys than its table holds
 * (checked before anything is read: a bad table is an error, never a stray read). */
int paged_attention_f32(const float *q, const float *k, const float *v, const int64_t *tables,
                        const int64_t *lens, float *out, float *lse, int64_t R, int64_t Hkv, int64_t nq,
                        int64_t D, int64_t bs, int64_t M, int64_t blocks, float scale, int threads)
{
    for (int64_t r = 0; r < R; r++) {
        if (lens[r] > M * bs) return -2;
        for (int64_t j = 0; j < (lens[r] + bs - 1) / bs; j++)
            if (tables[r * M + j] < 0 || tables[r * M + j] >= blocks) return -2;
    }
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t n = lens[r];
            const float *qh = q + (r * Hkv + h) * nq * D;
            float *oh = out + (r * Hkv + h) * nq * D;
            float *lh = lse + (r * Hkv + h) * nq;
            if (n <= 0) {
                memset(oh, 0, sizeof(float) * nq * D);
                for (int64_t i = 0; i < nq; i++) lh[i] = -INFINITY;
                continue;
            }
            float *s = malloc(sizeof(float) * nq * n); /* scores, then weights: [nq, n] */
            if (s == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t *table = tables + r * M;
            if (D == 64)
                row_64(qh, k, v, table, n, oh, lh, s, nq, Hkv, h, bs, scale);
            else if (D == 128)
                row_128(qh, k, v, table, n, oh, lh, s, nq, Hkv, h, bs, scale);
            else
                row_any(qh, k, v, table, n, oh, lh, s, nq, Hkv, h, bs, scale, D);
            free(s);
        }
    }
    return failed ? -1 : 0;
}
