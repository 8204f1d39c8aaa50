/* Sampling a token per row from softmax(logits * inv_temp), with no truncation (the RL default: top-k,
 * top-p and min-p off), by inverse CDF at a given uniform, with its logprob: what sampler.py's PyTorch
 * path does in a dozen passes and allocations over [rows, vocab], in three reads of each row here.
 *
 * Row r: y = logits[r] * inv_temp[r]; m = max y; e_j = exp(y_j - m), s = sum e_j (in double). The token
 * is the first j whose running sum e_0 + ... + e_j exceeds u[r] * s, found a block of BLOCK entries at a
 * time (each block's sum is kept from the summing pass, so only the block it falls in is scanned again);
 * its logprob is y_j - m - log s. A token of probability zero is never drawn. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#define BLOCK 64

/* 0 on success; -1 out of memory; -2 a row's logits hold a NaN or no finite value. */
int sample_rows_f32(const float *logits, int64_t N, int64_t V, const float *inv_temp, const double *u,
                    int64_t *tokens, float *logprobs, int threads)
{
    const int64_t blocks = (V + BLOCK - 1) / BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (N * V > PARALLEL_MIN)
    {
        double *sums = malloc(sizeof(double) * blocks);
        if (sums == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < N; r++) {
            if (sums == NULL) continue;
            const float *x = logits + r * V, t = inv_temp[r];
            float m = -INFINITY;
#pragma omp simd reduction(max : m)
            for (int64_t j = 0; j < V; j++) m = x[j] * t > m ? x[j] * t : m; /* a NaN is caught in s below */
            double s = 0.0;
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t end = (b + 1) * BLOCK < V ? (b + 1) * BLOCK : V;
                float part = 0.0f;
#pragma omp simd reduction(+ : part)
                for (int64_t j = b * BLOCK; j < end; j++) part += expf(x[j] * t - m);
                sums[b] = part;
                s += part;
            }
            /* isfinite holds: the kernels build with IEEE semantics (no -ffast-math, see cpu_kernel.py) */
            if (!isfinite(s) || s < 1.0) { /* e_j = 1 at the maximum: a NaN or no finite logit */
#pragma omp atomic write
                failed = 2;
                continue;
            }
            const double target = u[r] * s;
            double run = 0.0;
            int64_t b = 0; /* the block the target falls in: run sums the blocks in the order s did */
            while (b < blocks - 1 && run + sums[b] <= target) run += sums[b++];
            const int64_t end = (b + 1) * BLOCK < V ? (b + 1) * BLOCK : V;
            int64_t pick = b * BLOCK;
            for (int64_t j = b * BLOCK; j < end; j++) {
                const float e = expf(x[j] * t - m);
                if (e > 0.0f) pick = j; /* rounding (a sum in another order) may end the block short of the target */
                run += e;
                if (e > 0.0f && run > target) break;
            }
            tokens[r] = pick;
            logprobs[r] = (float)(x[pick] * t - m - log(s));
        }
        free(sums);
    }
    return -failed;
}
