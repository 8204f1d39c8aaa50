/* Paged attention on the CPU, read straight from the cache blocks.
 *
 * Row r has nq queries per KV head (a decoding sequence's query heads of that KV head, or every
 * member's of a cluster sharing a prefix) and attends keys 0 .. lens[r]-1, whose K/V sit in the
 * cache blocks tables[r][t / block_size], read in place with no gathered copy. Three loops
 * (attend_heads): a whole row a block at a time through all its heads (blocks_kernel, memory-bound),
 * many queries as small matrix products (many_kernel, compute-bound), or one head (row_64 and kin).
 * A prefilling chunk (paged_prefill_f32) runs causal on many_kernel.
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

#include "kernels.h"

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p)
{
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* A key's or an output's run of floats in the decode loop: 512 bits where the CPU has them (AVX-512), so
 * that a 64-float head is four vectors, not eight. */
#if defined(__AVX512F__)
#define WIDE 16
#else
#define WIDE 8
#endif
typedef float vw __attribute__((vector_size(WIDE * 4)));

static inline vw loadw(const float *p)
{
    vw x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* The sum of a wide vector's halves (itself at 8 lanes). */
static inline v8 fold8(vw x)
{
    v8 lo, hi;
    memcpy(&lo, &x, sizeof lo);
    if (WIDE == 8) return lo;
    memcpy(&hi, (const char *)&x + sizeof(vw) - sizeof hi, sizeof hi);
    return lo + hi;
}

static inline float hsum8(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* The eight sums of a[0..7] as one vector, [hsum(a[0]), ..., hsum(a[7])], in three rounds of pairwise
 * adds instead of eight separate reductions. */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t i8v __attribute__((vector_size(32)));
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (i8v){__VA_ARGS__})
#endif

static inline v8 hsum8x8(const v8 *a)
{
    v8 p[4], w[2];
    for (int i = 0; i < 4; i++)
        p[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUF(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        w[i] = SHUF(p[2 * i], p[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUF(p[2 * i], p[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(w[0], w[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(w[0], w[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Raise *top to the largest of s[0 .. n-1], replace each s[t] by exp(s[t] - *top); returns their sum. */
static inline float exp_shifted(float *s, int64_t n, float *top)
{
    float mx = *top, total = 0.0f;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; t++) {
        s[t] = expf(s[t] - mx);
        total += s[t];
    }
    *top = mx;
    return total;
}

/* Softmax of each query's n scores in place; the log-sum-exp goes to lse. */
static void softmax_rows(float *s, int64_t nq, int64_t n, float *lse)
{
    for (int64_t i = 0; i < nq; i++) {
        float *si = s + i * n, top = -INFINITY;
        const float total = exp_shifted(si, n, &top);
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < n; t++) si[t] *= inv;
        lse[i] = top + logf(total);
    }
}

/* The cache offset, in head vectors, of each of a row's n keys for KV head h: key t sits in block
 * table[t / bs] at offset t % bs. Computed once per (row, head), so no inner loop divides. */
static void key_offsets(const int64_t *table, int64_t n, int64_t bs, int64_t Hkv, int64_t h, int64_t *off)
{
    for (int64_t b0 = 0, blk = 0; b0 < n; b0 += bs, blk++) {
        const int64_t base = table[blk] * bs, end = b0 + bs < n ? b0 + bs : n;
        for (int64_t t = b0; t < end; t++) off[t] = (base + t - b0) * Hkv + h;
    }
}

/* Keys and values sit in blocks scattered over the cache, where the hardware prefetcher does not follow:
 * the key pass of one head requests each key's head vector eight keys before it is used, and its value's
 * into L2 for the value pass that follows (a row's values fit there); the value pass requests
 * PREFETCH_KEYS ahead into L1. */
#define PREFETCH_KEYS 8
static inline void prefetch_head(const float *p, int64_t D)
{
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(p + d);
}
static inline void prefetch_head_l2(const float *p, int64_t D)
{
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(p + d, 0, 2);
}

/* One (row, KV head) with a fixed head dimension DIM (a multiple of 8); the values are read once per
 * pair of queries. */
#define ROW_KERNEL(DIM)                                                                                    \
    static void row_##DIM(const float *q, const float *k, const float *v, const int64_t *off, int64_t n,  \
                          float *o, float *lse, float *s, int64_t nq, float scale)                          \
    {                                                                                                        \
        enum { W = DIM / 8 };                                                                                \
        int64_t t = 0;                                                                                       \
        for (; t + 8 <= n; t += 8) { /* eight keys at a time: their eight sums reduce together */            \
            const float *kt[8];                                                                              \
            for (int u = 0; u < 8; u++) kt[u] = k + off[t + u] * DIM;                                        \
            if (t + 16 <= n)                                                                                 \
                for (int u = 0; u < 8; u++) {                                                                \
                    const int64_t at = off[t + 8 + u] * DIM;                                                 \
                    prefetch_head(k + at, DIM);                                                              \
                    prefetch_head_l2(v + at, DIM);                                                           \
                }                                                                                            \
            for (int64_t i = 0; i < nq; i++) {                                                               \
                const float *qi = q + i * DIM;                                                               \
                v8 acc[8];                                                                                   \
                const v8 q0 = load8(qi);                                                                     \
                for (int u = 0; u < 8; u++) acc[u] = q0 * load8(kt[u]);                                      \
                for (int j = 1; j < W; j++) {                                                                \
                    const v8 qj = load8(qi + 8 * j);                                                         \
                    for (int u = 0; u < 8; u++) acc[u] += qj * load8(kt[u] + 8 * j);                         \
                }                                                                                            \
                const v8 r = hsum8x8(acc) * scale;                                                           \
                memcpy(s + i * n + t, &r, sizeof r);                                                         \
            }                                                                                                \
        }                                                                                                    \
        for (; t < n; t++) {                                                                                 \
            const float *kt = k + off[t] * DIM;                                                              \
            v8 key[W];                                                                                       \
            for (int j = 0; j < W; j++) key[j] = load8(kt + 8 * j);                                          \
            for (int64_t i = 0; i < nq; i++) {                                                               \
                const float *qi = q + i * DIM;                                                               \
                v8 acc = load8(qi) * key[0];                                                                 \
                for (int j = 1; j < W; j++) acc += load8(qi + 8 * j) * key[j];                               \
                s[i * n + t] = hsum8(acc) * scale;                                                           \
            }                                                                                                \
        }                                                                                                    \
        softmax_rows(s, nq, n, lse);                                                                         \
        int64_t i = 0;                                                                                       \
        for (; i + 1 < nq; i += 2) {                                                                         \
            const float *w0 = s + i * n, *w1 = w0 + n;                                                       \
            v8 a0[W], a1[W];                                                                                 \
            for (int j = 0; j < W; j++) a0[j] = a1[j] = (v8){0};                                             \
            for (int64_t t = 0; t < n; t++) {                                                                \
                const float *vt = v + off[t] * DIM;                                                          \
                if (t + PREFETCH_KEYS < n) prefetch_head(v + off[t + PREFETCH_KEYS] * DIM, DIM);             \
                const float x0 = w0[t], x1 = w1[t];                                                          \
                for (int j = 0; j < W; j++) {                                                                \
                    const v8 val = load8(vt + 8 * j);                                                        \
                    a0[j] += x0 * val;                                                                       \
                    a1[j] += x1 * val;                                                                       \
                }                                                                                            \
            }                                                                                                \
            memcpy(o + i * DIM, a0, sizeof a0);                                                              \
            memcpy(o + (i + 1) * DIM, a1, sizeof a1);                                                        \
        }                                                                                                    \
        if (i < nq) {                                                                                        \
            const float *wi = s + i * n;                                                                     \
            v8 acc[W];                                                                                       \
            for (int j = 0; j < W; j++) acc[j] = (v8){0};                                                    \
            for (int64_t t = 0; t < n; t++) {                                                                \
                const float *vt = v + off[t] * DIM;                                                          \
                const float w = wi[t];                                                                       \
                for (int j = 0; j < W; j++) acc[j] += w * load8(vt + 8 * j);                                 \
            }                                                                                                \
            memcpy(o + i * DIM, acc, sizeof acc);                                                            \
        }                                                                                                    \
    }

ROW_KERNEL(64)
ROW_KERNEL(128)

static void row_any(const float *q, const float *k, const float *v, const int64_t *off, int64_t n, float *o,
                    float *lse, float *s, int64_t nq, float scale, int64_t D)
{
    for (int64_t t = 0; t < n; t++) {
        const float *kt = k + off[t] * D;
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
        const float *vt = v + off[t] * D;
        for (int64_t i = 0; i < nq; i++) {
            const float w = s[i * n + t];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[i * D + d] += w * vt[d];
        }
    }
}

/* Many queries of one (row, KV head), a cluster's shared prefix: compute-bound, so run as small matrix
 * products with the queries across the vector lanes, QUERY_LANES at a time (transposed once): a score is
 * an FMA of a broadcast key element, with no horizontal sum, the softmax runs down each lane, and the
 * value pass multiplies each value vector into eight queries' accumulators. `token` > 0 (the first of
 * a cluster's heads, all of which this thread runs): also request every head's key and value of the
 * tokens 16 ahead into L2, `token` floats from head h's vector back by h heads. Query i sits at q + i * qs
 * (its output at o + i * qs) and sees keys up to last + i: causal for a prefill chunk, whose first query
 * is at position `last`; a decoding call passes last = n, which masks nothing.
 * scratch: (DIM + n) * QUERY_LANES floats. */
#define QUERY_LANES 16
#define MANY_QUERIES 12 /* from this many queries a (row, head) takes many_kernel */
typedef float vq __attribute__((vector_size(QUERY_LANES * 4)));

static inline __attribute__((always_inline)) void many_kernel(const int DIM, const float *q, int64_t qs,
                                                              const float *k, const float *v, const int64_t *off,
                                                              int64_t n, int64_t last, float *o, float *lse,
                                                              float *scratch, int64_t nq, float scale, int64_t token,
                                                              int64_t h)
{
    enum { L = QUERY_LANES };
    float *qt = scratch, *st = qt + DIM * L; /* qt [DIM][L] the queries; st [n][L] scores, then weights */
    for (int64_t i0 = 0; i0 < nq; i0 += L) {
        const int64_t qn = nq - i0 < L ? nq - i0 : L;
        for (int d = 0; d < DIM; d++)
            for (int l = 0; l < L; l++) qt[d * L + l] = l < qn ? q[(i0 + l) * qs + d] * scale : 0.0f;
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) {
            const float *k0 = k + off[t] * DIM, *k1 = k + off[t + 1] * DIM, *k2 = k + off[t + 2] * DIM,
                        *k3 = k + off[t + 3] * DIM;
            if (t + 8 <= n)
                for (int u = 4; u < 8; u++) prefetch_head(k + off[t + u] * DIM, DIM);
            if (token && i0 == 0 && t + 20 <= n)
                for (int u = 16; u < 20; u++) {
                    prefetch_head_l2(k + (off[t + u] - h) * DIM, token);
                    prefetch_head_l2(v + (off[t + u] - h) * DIM, token);
                }
            vq a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int d = 0; d < DIM; d++) {
                vq qd;
                memcpy(&qd, qt + d * L, sizeof qd);
                a0 += k0[d] * qd, a1 += k1[d] * qd, a2 += k2[d] * qd, a3 += k3[d] * qd;
            }
            memcpy(st + t * L, &a0, sizeof a0), memcpy(st + (t + 1) * L, &a1, sizeof a1);
            memcpy(st + (t + 2) * L, &a2, sizeof a2), memcpy(st + (t + 3) * L, &a3, sizeof a3);
        }
        for (; t < n; t++) {
            const float *kt = k + off[t] * DIM;
            vq a = {0};
            for (int d = 0; d < DIM; d++) {
                vq qd;
                memcpy(&qd, qt + d * L, sizeof qd);
                a += kt[d] * qd;
            }
            memcpy(st + t * L, &a, sizeof a);
        }
        for (int64_t u = last + i0 + 1; u < n; u++) /* causal: lane l sees keys up to last + i0 + l */
            for (int l = 0; l < L; l++)
                if (u > last + i0 + l) st[u * L + l] = -INFINITY;
        float top[L], total[L];
        for (int l = 0; l < L; l++) top[l] = -INFINITY, total[l] = 0.0f;
        for (int64_t u = 0; u < n; u++)
#pragma omp simd
            for (int l = 0; l < L; l++) top[l] = st[u * L + l] > top[l] ? st[u * L + l] : top[l];
        for (int64_t u = 0; u < n; u++)
#pragma omp simd
            for (int l = 0; l < L; l++) {
                st[u * L + l] = expf(st[u * L + l] - top[l]);
                total[l] += st[u * L + l];
            }
        for (int64_t j0 = 0; j0 < qn; j0 += 8) /* eight queries' outputs, a vector of each, per pass */
            for (int c = 0; c < DIM / L; c++) {
                vq a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
                for (int64_t u = 0; u < n; u++) {
                    const float *w = st + u * L + j0;
                    vq val;
                    memcpy(&val, v + off[u] * DIM + c * L, sizeof val);
                    a0 += w[0] * val, a1 += w[1] * val, a2 += w[2] * val, a3 += w[3] * val;
                    a4 += w[4] * val, a5 += w[5] * val, a6 += w[6] * val, a7 += w[7] * val;
                }
                const vq acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
                for (int64_t j = 0; j < 8 && j0 + j < qn; j++) {
                    const vq r = acc[j] * (1.0f / total[j0 + j]);
                    memcpy(o + (i0 + j0 + j) * qs + c * L, &r, sizeof r);
                }
            }
        for (int64_t j = 0; j < qn; j++) lse[i0 + j] = top[j] + logf(total[j]);
    }
}

static void many_64(const float *q, int64_t qs, const float *k, const float *v, const int64_t *off, int64_t n,
                    int64_t last, float *o, float *lse, float *scratch, int64_t nq, float scale, int64_t token,
                    int64_t h)
{
    many_kernel(64, q, qs, k, v, off, n, last, o, lse, scratch, nq, scale, token, h);
}

static void many_128(const float *q, int64_t qs, const float *k, const float *v, const int64_t *off, int64_t n,
                     int64_t last, float *o, float *lse, float *scratch, int64_t nq, float scale, int64_t token,
                     int64_t h)
{
    many_kernel(128, q, qs, k, v, off, n, last, o, lse, scratch, nq, scale, token, h);
}

/* All Hkv heads of one row, a cache block at a time, with an online softmax (the running maximum and
 * sum of each query's scores rescale its output as keys arrive): each block's keys and values, every
 * head, are read from memory once and used while they sit in cache, and the next block this thread
 * reads (`after` past the row's last) is requested into L1 while this one is computed, so reading and
 * computing overlap (requested into L2 instead it ran slower; 512-bit vectors, where there are, add a few
 * percent).
 * q and o [Hkv, nq, DIM], lse [Hkv, nq]; scratch: 2 * Hkv * nq + nq * bs floats. */
static inline __attribute__((always_inline)) void blocks_kernel(const int DIM, const float *q, const float *k,
                                                                const float *v, const int64_t *table, int64_t n,
                                                                const int64_t *after, float *o, float *lse,
                                                                float *scratch, int64_t nq, int64_t Hkv, int64_t bs,
                                                                float scale)
{
    const int W = DIM / WIDE;
    const int64_t token = Hkv * DIM; /* floats of one token's heads, side by side in a block */
    float *top = scratch, *total = top + Hkv * nq, *s = total + Hkv * nq;
    for (int64_t i = 0; i < Hkv * nq; i++) top[i] = -INFINITY, total[i] = 0.0f;
    memset(o, 0, sizeof(float) * Hkv * nq * DIM);
    for (int64_t b0 = 0, blk = 0; b0 < n; b0 += bs, blk++) {
        const int64_t m = n - b0 < bs ? n - b0 : bs;
        const float *kb = k + table[blk] * bs * token, *vb = v + table[blk] * bs * token;
        const int64_t *nb = b0 + bs < n ? table + blk + 1 : after; /* the next block this thread reads */
        const float *kn = nb == NULL ? NULL : k + *nb * bs * token, *vn = nb == NULL ? NULL : v + *nb * bs * token;
        /* the next block's cache lines, requested a few at a time through the score pass so that the
         * requests stay within what the core keeps in flight */
        const int64_t lines = kn == NULL ? 0 : bs * token / 16, calls = Hkv * ((m + 7) / 8) * nq;
        const int64_t each = (lines + calls - 1) / calls;
        int64_t next = 0;
        for (int64_t h = 0; h < Hkv; h++) {
            const float *qh = q + h * nq * DIM;
            float *oh = o + h * nq * DIM, *toph = top + h * nq, *totalh = total + h * nq;
            int64_t t = 0;
            for (; t + 8 <= m; t += 8) { /* eight keys at a time: their eight sums reduce together */
                const float *kt[8];
                for (int u = 0; u < 8; u++) kt[u] = kb + (t + u) * token + h * DIM;
                for (int64_t i = 0; i < nq; i++) {
                    for (int64_t e = 0; e < each && next < lines; e++, next++) {
                        __builtin_prefetch(kn + next * 16, 0, 3);
                        __builtin_prefetch(vn + next * 16, 0, 3);
                    }
                    const float *qi = qh + i * DIM;
                    vw acc[8];
                    const vw q0 = loadw(qi);
                    for (int u = 0; u < 8; u++) acc[u] = q0 * loadw(kt[u]);
                    for (int j = 1; j < W; j++) {
                        const vw qj = loadw(qi + WIDE * j);
                        for (int u = 0; u < 8; u++) acc[u] += qj * loadw(kt[u] + WIDE * j);
                    }
                    v8 halves[8];
                    for (int u = 0; u < 8; u++) halves[u] = fold8(acc[u]);
                    const v8 r = hsum8x8(halves) * scale;
                    memcpy(s + i * bs + t, &r, sizeof r);
                }
            }
            for (; t < m; t++) {
                const float *kt = kb + t * token + h * DIM;
                for (int64_t i = 0; i < nq; i++) {
                    const float *qi = qh + i * DIM;
                    vw acc = loadw(qi) * loadw(kt);
                    for (int j = 1; j < W; j++) acc += loadw(qi + WIDE * j) * loadw(kt + WIDE * j);
                    s[i * bs + t] = hsum8(fold8(acc)) * scale;
                }
            }
            for (int64_t i = 0; i < nq; i++) { /* weights exp(score - running max); rescale what came before */
                const float before = toph[i], sum = exp_shifted(s + i * bs, m, &toph[i]);
                const float keep = expf(before - toph[i]); /* 0 for the first block */
                if (keep != 1.0f)
                    for (int64_t d = 0; d < DIM; d++) oh[i * DIM + d] *= keep;
                totalh[i] = totalh[i] * keep + sum;
            }
            int64_t i = 0;
            for (; i + 1 < nq; i += 2) { /* the values, read once per pair of queries */
                const float *w0 = s + i * bs, *w1 = w0 + bs;
                vw a0[W], a1[W];
                for (int j = 0; j < W; j++)
                    a0[j] = loadw(oh + i * DIM + WIDE * j), a1[j] = loadw(oh + (i + 1) * DIM + WIDE * j);
                for (int64_t u = 0; u < m; u++) {
                    const float *vt = vb + u * token + h * DIM;
                    const float x0 = w0[u], x1 = w1[u];
                    for (int j = 0; j < W; j++) {
                        const vw val = loadw(vt + WIDE * j);
                        a0[j] += x0 * val;
                        a1[j] += x1 * val;
                    }
                }
                memcpy(oh + i * DIM, a0, sizeof a0);
                memcpy(oh + (i + 1) * DIM, a1, sizeof a1);
            }
            if (i < nq) {
                const float *wi = s + i * bs;
                vw acc[W];
                for (int j = 0; j < W; j++) acc[j] = loadw(oh + i * DIM + WIDE * j);
                for (int64_t u = 0; u < m; u++) {
                    const float *vt = vb + u * token + h * DIM;
                    for (int j = 0; j < W; j++) acc[j] += wi[u] * loadw(vt + WIDE * j);
                }
                memcpy(oh + i * DIM, acc, sizeof acc);
            }
        }
        for (; next < lines; next++) { /* a short block has fewer score passes */
            __builtin_prefetch(kn + next * 16, 0, 3);
            __builtin_prefetch(vn + next * 16, 0, 3);
        }
    }
    for (int64_t i = 0; i < Hkv * nq; i++) {
        const float inv = 1.0f / total[i];
        for (int64_t d = 0; d < DIM; d++) o[i * DIM + d] *= inv;
        lse[i] = top[i] + logf(total[i]);
    }
}

static void blocks_64(const float *q, const float *k, const float *v, const int64_t *table, int64_t n,
                      const int64_t *after, float *o, float *lse, float *scratch, int64_t nq, int64_t Hkv, int64_t bs,
                      float scale)
{
    blocks_kernel(64, q, k, v, table, n, after, o, lse, scratch, nq, Hkv, bs, scale);
}

static void blocks_128(const float *q, const float *k, const float *v, const int64_t *table, int64_t n,
                       const int64_t *after, float *o, float *lse, float *scratch, int64_t nq, int64_t Hkv, int64_t bs,
                       float scale)
{
    blocks_kernel(128, q, k, v, table, n, after, o, lse, scratch, nq, Hkv, bs, scale);
}

/* Heads h0 .. h0 + per - 1 of one row over its n keys: q and o [per, nq, D], lse [per, nq]. Many
 * queries go a head at a time as matrix products (many_kernel); otherwise all of a row's heads go a
 * block at a time (blocks_kernel), fewer a head at a time. `after`: the first block of the row this
 * thread takes next, requested while this row's last block is computed. -1: out of memory. */
static int attend_heads(const float *q, const float *k, const float *v, const int64_t *table, int64_t n,
                        const int64_t *after, float *o, float *lse, int64_t nq, int64_t Hkv, int64_t h0, int64_t per,
                        int64_t bs, float scale, int64_t D)
{
    const int fixed = D == 64 || D == 128, many = fixed && nq >= MANY_QUERIES;
    const int by_blocks = fixed && !many && per == Hkv;
    const int64_t scores = many ? (D + n) * QUERY_LANES : nq * n;
    void *scratch = malloc(by_blocks ? sizeof(float) * (2 * Hkv * nq + nq * bs)
                                     : sizeof(int64_t) * n + sizeof(float) * scores); /* key offsets, scores */
    if (scratch == NULL) return -1;
    if (by_blocks)
        (D == 64 ? blocks_64 : blocks_128)(q, k, v, table, n, after, o, lse, scratch, nq, Hkv, bs, scale);
    else
        for (int64_t h = h0; h < h0 + per; h++) {
            int64_t *off = scratch;
            float *s = (float *)(off + n);
            const float *qh = q + (h - h0) * nq * D;
            float *oh = o + (h - h0) * nq * D, *lh = lse + (h - h0) * nq;
            key_offsets(table, n, bs, Hkv, h, off);
            if (many)
                (D == 64 ? many_64 : many_128)(qh, D, k, v, off, n, n, oh, lh, s, nq, scale,
                                               per == Hkv && h == 0 ? Hkv * D : 0, h);
            else if (D == 64)
                row_64(qh, k, v, off, n, oh, lh, s, nq, scale);
            else if (D == 128)
                row_128(qh, k, v, off, n, oh, lh, s, nq, scale);
            else
                row_any(qh, k, v, off, n, oh, lh, s, nq, scale, D);
        }
    free(scratch);
    return 0;
}

/* Whether a row's n keys fit its table of M blocks and each block it names lies in the cache: checked before
 * anything is read, so that a bad table is an error, never a stray read. */
static int table_fits(const int64_t *table, int64_t n, int64_t bs, int64_t M, int64_t blocks)
{
    if (n > M * bs) return 0;
    for (int64_t j = 0; j < (n + bs - 1) / bs; j++)
        if (table[j] < 0 || table[j] >= blocks) return 0;
    return 1;
}

/* The heads of a row each thread task takes: all of them (a block at a time) when every thread gets a
 * row, else one, so that a single long row still splits over the threads. Tasks go to the threads in
 * turn (a static schedule), so a thread knows the row it takes next and requests its first block early. */
static inline int64_t heads_per_task(int64_t rows, int64_t Hkv, int threads)
{
    return rows >= threads ? Hkv : 1;
}

/* 0 on success; -1 out of memory; -2 a row names a block outside the cache or more keys than its table holds
 * (checked before anything is read: a bad table is an error, never a stray read). */
int paged_attention_f32(const float *q, const float *k, const float *v, const int64_t *tables,
                        const int64_t *lens, float *out, float *lse, int64_t R, int64_t Hkv, int64_t nq,
                        int64_t D, int64_t bs, int64_t M, int64_t blocks, float scale, int threads)
{
    for (int64_t r = 0; r < R; r++)
        if (!table_fits(tables + r * M, lens[r], bs, M, blocks)) return -2;
    int failed = 0;
    const int64_t per = heads_per_task(R, Hkv, threads), tasks = R * Hkv / per;
#pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) { /* heads h0 .. h0 + per - 1 of row r */
        const int64_t r = task * per / Hkv, h0 = task * per % Hkv, n = lens[r], at = (r * Hkv + h0) * nq;
        if (n <= 0) {
            memset(out + at * D, 0, sizeof(float) * per * nq * D);
            for (int64_t i = 0; i < per * nq; i++) lse[at + i] = -INFINITY;
            continue;
        }
        const int64_t *after = per == Hkv && r + threads < R && lens[r + threads] > 0 ? tables + (r + threads) * M
                                                                                       : NULL;
        if (attend_heads(q + at * D, k, v, tables + r * M, n, after, out + at * D, lse + at, nq, Hkv, h0, per, bs,
                         scale, D) != 0) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}

/* The prefix shared by a cluster of decoding rows (a GRPO group's prompt), attended once for all its
 * members' queries and merged by log-sum-exp into each member's own part, in place.
 *
 *   members  [C, G] int64  the rows of out/lse (and q) each cluster's members are (-1: padding)
 *   tables   [C, M], lens [C]  the cluster's prefix blocks and keys
 *   q, out   [B, Hkv, nq, D]   out/lse hold each row's own part on entry and the merged result on return
 *   lse      [B, Hkv, nq]
 *
 * A row belongs to at most one cluster, so the clusters' merges never touch the same row.
 */
int paged_attention_shared_f32(const float *q, const float *k, const float *v, const int64_t *tables,
                               const int64_t *lens, const int64_t *members, float *out, float *lse, int64_t C,
                               int64_t G, int64_t B, int64_t Hkv, int64_t nq, int64_t D, int64_t bs, int64_t M,
                               int64_t blocks, float scale, int threads)
{
    for (int64_t c = 0; c < C; c++) {
        if (!table_fits(tables + c * M, lens[c], bs, M, blocks)) return -2;
        for (int64_t g = 0; g < G; g++)
            if (members[c * G + g] >= B) return -2;
    }
    int failed = 0;
    const int64_t per = heads_per_task(C, Hkv, threads), tasks = C * Hkv / per;
#pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) { /* heads h0 .. h0 + per - 1 of cluster c */
        const int64_t c = task * per / Hkv, h0 = task * per % Hkv, n = lens[c];
        const int64_t *mem = members + c * G;
        int64_t real = 0;
        for (int64_t g = 0; g < G; g++) real += mem[g] >= 0;
        if (n <= 0 || real == 0) continue; /* no prefix keys: the own part stands */
        const int64_t rows = real * nq, row = nq * D;
        float *qb = malloc(sizeof(float) * per * rows * (2 * D + 1)); /* the members' queries, outputs, lse */
        if (qb == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *ob = qb + per * rows * D, *lb = ob + per * rows * D;
        for (int64_t h = h0; h < h0 + per; h++)
            for (int64_t g = 0, i = 0; g < G; g++)
                if (mem[g] >= 0)
                    memcpy(qb + ((h - h0) * real + i++) * row, q + (mem[g] * Hkv + h) * row, sizeof(float) * row);
        const int64_t *after = per == Hkv && c + threads < C && lens[c + threads] > 0 ? tables + (c + threads) * M
                                                                                       : NULL;
        if (attend_heads(qb, k, v, tables + c * M, n, after, ob, lb, rows, Hkv, h0, per, bs, scale, D) != 0) {
#pragma omp atomic write
            failed = 1;
            free(qb);
            continue;
        }
        for (int64_t h = h0; h < h0 + per; h++) {
            const float *oh = ob + (h - h0) * rows * D, *lh = lb + (h - h0) * rows;
            for (int64_t g = 0, i = 0; g < G; g++) {
                if (mem[g] < 0) continue;
                float *oo = out + (mem[g] * Hkv + h) * row, *lo = lse + (mem[g] * Hkv + h) * nq;
                for (int64_t j = 0; j < nq; j++, i++) {
                    const float a = lo[j], b = lh[i];
                    if (a < -1e30f) { /* the row had no keys of its own */
                        memcpy(oo + j * D, oh + i * D, sizeof(float) * D);
                        lo[j] = b;
                        continue;
                    }
                    const float top = a > b ? a : b;
                    const float total = top + logf(expf(a - top) + expf(b - top));
                    const float wa = expf(a - total), wb = expf(b - total);
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) oo[j * D + d] = wa * oo[j * D + d] + wb * oh[i * D + d];
                    lo[j] = total;
                }
            }
        }
        free(qb);
    }
    return failed ? -1 : 0;
}

/* Causal attention of one sequence's prefill chunk: its n queries sit at positions first .. first + n - 1
 * and attend keys 0 .. first + n - 1 (the cached ones and the chunk's own, already written), read in place
 * from the blocks of `table`. Compute-bound, so it runs on many_kernel: a task is one query head and up to
 * QUERY_LANES consecutive queries over the keys the last of them sees, the keys past each query masked.
 * Tasks go longest first (the last chunk of queries sees the most keys), to whichever thread is free.
 *   q, out [n, H, D]  (D 64 or 128)   table [M] int64
 * 0 on success; -1 out of memory; -2 the keys exceed the table or a block is outside the cache. */
int paged_prefill_f32(const float *q, const float *k, const float *v, const int64_t *table, int64_t first,
                      int64_t n, float *out, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t M,
                      int64_t blocks, float scale, int threads)
{
    const int64_t keys = first + n;
    if (!table_fits(table, keys, bs, M, blocks) || (D != 64 && D != 128) || H % Hkv != 0) return -2;
    const int64_t chunks = (n + QUERY_LANES - 1) / QUERY_LANES, tasks = chunks * H, group = H / Hkv;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        void *scratch = malloc(sizeof(int64_t) * keys + sizeof(float) * (D + keys) * QUERY_LANES);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (scratch == NULL) continue;
            const int64_t i0 = (chunks - 1 - task / H) * QUERY_LANES, h = task % H;
            const int64_t qn = n - i0 < QUERY_LANES ? n - i0 : QUERY_LANES, seen = first + i0 + qn;
            int64_t *off = scratch;
            float *s = (float *)(off + keys), lse[QUERY_LANES];
            key_offsets(table, seen, bs, Hkv, h / group, off);
            (D == 64 ? many_64 : many_128)(q + (i0 * H + h) * D, H * D, k, v, off, seen, first + i0,
                                           out + (i0 * H + h) * D, lse, s, qn, scale, 0, 0);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
