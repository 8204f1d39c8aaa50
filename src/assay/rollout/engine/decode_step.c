/* A decode step of few rows (at most SKINNY_ROWS, or INT8_ROWS on int8 weights), every layer in one call: the kernels of
 * kernels.h in the order the Python forward calls them, with no return to Python between them.
 * At a few rows the step's C work is ~15 ms on the benchmark model, and the Python around each of its
 * ~70 kernel calls (attribute lookups, layout checks, allocations, ctypes) cost ~2-3 ms more.
 *
 * Activations are token-major: h, x [M, n] (the residual stream and each block's normalized input).
 * Each layer's fourteen weights, in `w[layer * 14 ..]`:
 *   input norm [n], qkv panels, qkv bias, o panels, o bias, post-attention norm [n],
 *   gate|up panels, gate|up bias, down panels, down bias, then the qkv, o, gate|up and down scales
 *   (panels as skinny_linear_f32 reads them, or, where the projection's scales are not NULL, int8
 *   panels as int8_linear_f32 reads them; a bias may be NULL; q, k, v side by side, then gate and up)
 * Caches [layers, blocks, bs, Hkv, D]; tables [M, width] and lens [M] each row's own blocks; a shared
 * prefix, when clusters > 0: pre_tables [clusters, pre_width], pre_lens [clusters], members
 * [clusters, group] (paged_attention_shared_f32). On return x holds the final norm of h.
 * 0 on success; -1 out of memory; -2 a position, slot or block outside its table or the cache. */
#include <stdlib.h>

#include "kernels.h"

enum { IN_NORM, QKV, QKV_BIAS, O, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, QKV_SCALE, O_SCALE,
       GATE_UP_SCALE, DOWN_SCALE, WEIGHTS };

static int linear(const float *x, int64_t xrs, const float *w, const float *scale, const float *bias, float *y,
                  int64_t M, int64_t N, int64_t K, int threads)
{
    if (scale != NULL) return int8_linear_f32(x, xrs, (const int8_t *)w, scale, bias, y, M, N, K, threads);
    return skinny_linear_f32(x, xrs, w, bias, y, M, N, K, threads);
}

int decode_step_f32(const float *const *w, int64_t layers, float *h, float *x, const float *final_norm,
                    const float *cos_t, const float *sin_t, const int64_t *pos, const int64_t *slot, float *k_cache,
                    float *v_cache, int64_t blocks, int64_t bs, const int64_t *tables, const int64_t *lens,
                    int64_t width, const int64_t *pre_tables, const int64_t *pre_lens, const int64_t *members,
                    int64_t clusters, int64_t group, int64_t pre_width, int64_t M, int64_t n, int64_t H,
                    int64_t Hkv, int64_t D, int64_t inter, int64_t positions, float scale, float eps, int threads)
{
    const int64_t qkv_n = (H + 2 * Hkv) * D, layer = blocks * bs * Hkv * D;
    float *qkv = malloc(sizeof(float) * M * (qkv_n + 2 * H * D + H + n + 3 * inter));
    if (qkv == NULL) return -1;
    float *q = qkv + M * qkv_n, *attn = q + M * H * D, *lse = attn + M * H * D, *delta = lse + M * H;
    float *gate_up = delta + M * n, *act = gate_up + M * 2 * inter;
    int rc = 0;
    for (int64_t i = 0; i < layers && rc == 0; i++) {
        const float *const *lw = w + i * WEIGHTS;
        float *kc = k_cache + i * layer, *vc = v_cache + i * layer;
        add_rms_norm_f32(h, i == 0 ? NULL : delta, NULL, lw[IN_NORM], x, M, n, n, 1, n, 1, eps, threads);
        rc = linear(x, n, lw[QKV], lw[QKV_SCALE], lw[QKV_BIAS], qkv, M, qkv_n, n, threads);
        if (rc == 0)
            rc = qkv_rope_f32(qkv, qkv_n, 1, qkv + H * D, qkv_n, 1, qkv + (H + Hkv) * D, qkv_n, 1, NULL, NULL, NULL,
                              cos_t, sin_t, pos, slot, q, kc, vc, M, H, Hkv, D, positions, blocks * bs, threads);
        if (rc == 0)
            rc = paged_attention_f32(q, kc, vc, tables, lens, attn, lse, M, Hkv, H / Hkv, D, bs, width, blocks, scale,
                                     threads);
        if (rc == 0 && clusters > 0)
            rc = paged_attention_shared_f32(q, kc, vc, pre_tables, pre_lens, members, attn, lse, clusters, group, M,
                                            Hkv, H / Hkv, D, bs, pre_width, blocks, scale, threads);
        if (rc == 0) rc = linear(attn, H * D, lw[O], lw[O_SCALE], lw[O_BIAS], delta, M, n, H * D, threads);
        if (rc != 0) break;
        add_rms_norm_f32(h, delta, NULL, lw[POST_NORM], x, M, n, n, 1, n, 1, eps, threads);
        rc = linear(x, n, lw[GATE_UP], lw[GATE_UP_SCALE], lw[GATE_UP_BIAS], gate_up, M, 2 * inter, n, threads);
        if (rc != 0) break;
        silu_mul_f32(gate_up, gate_up + inter, NULL, NULL, act, M, inter, 2 * inter, inter, 1, 1, threads);
        rc = linear(act, inter, lw[DOWN], lw[DOWN_SCALE], lw[DOWN_BIAS], delta, M, n, inter, threads);
    }
    if (rc == 0) add_rms_norm_f32(h, delta, NULL, final_norm, x, M, n, n, 1, n, 1, eps, threads);
    free(qkv);
    return rc;
}
