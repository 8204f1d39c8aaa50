/* The elementwise work between a decoder layer's GEMMs. An activation's element (token t, feature j)
 * sits at p[t * ts + j * js]: token-major [T, n] (ts = n, js = 1, what F.linear returns for a prefill)
 * or feature-major [n, T] (ts = 1, js = T, what weight @ x.T returns for a decode step). The loops run
 * along whichever axis is contiguous, so they vectorize in both layouts. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#define TOKEN_BLOCK 16 /* tokens per parallel task */

/* h += delta (+ bias[j]), when delta is given; then x = w * (h / sqrt(mean_j h^2 + eps)), row by row as
 * Hugging Face's RMSNorm computes it in float32. h and delta share one layout (ts, js), x has its own
 * (xts, xjs): a decode step keeps h feature-major, like the GEMM outputs added to it, and gives the next
 * GEMM its input token-major (MKL is slow on a narrow feature-major operand). */
void add_rms_norm_f32(float *h, const float *delta, const float *bias, const float *w, float *x, int64_t T,
                      int64_t n, int64_t ts, int64_t js, int64_t xts, int64_t xjs, float eps, int threads)
{
    const int64_t tasks = (T + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (T * n > PARALLEL_MIN)
    for (int64_t b = 0; b < tasks; b++) {
        const int64_t t0 = b * TOKEN_BLOCK, t1 = t0 + TOKEN_BLOCK < T ? t0 + TOKEN_BLOCK : T;
        float ss[TOKEN_BLOCK] = {0};
        if (js == 1) { /* token-major: each token's features are contiguous */
            for (int64_t t = t0; t < t1; t++) {
                float *ht = h + t * ts;
                float acc = 0.0f;
                if (delta != NULL) {
                    const float *dt = delta + t * ts;
#pragma omp simd
                    for (int64_t j = 0; j < n; j++) ht[j] += bias != NULL ? dt[j] + bias[j] : dt[j];
                }
#pragma omp simd reduction(+ : acc)
                for (int64_t j = 0; j < n; j++) acc += ht[j] * ht[j];
                ss[t - t0] = acc;
            }
        } else { /* feature-major: each feature's tokens are contiguous */
            for (int64_t j = 0; j < n; j++) {
                float *hj = h + j * js;
                if (delta != NULL) {
                    const float *dj = delta + j * js;
                    const float bj = bias != NULL ? bias[j] : 0.0f;
                    if (bias != NULL)
                        for (int64_t t = t0; t < t1; t++) hj[t * ts] += dj[t * ts] + bj;
                    else
                        for (int64_t t = t0; t < t1; t++) hj[t * ts] += dj[t * ts];
                }
                for (int64_t t = t0; t < t1; t++) ss[t - t0] += hj[t * ts] * hj[t * ts];
            }
        }
        float r[TOKEN_BLOCK];
        for (int64_t t = t0; t < t1; t++) r[t - t0] = (float)(1.0 / sqrt((double)(ss[t - t0] / (float)n) + eps));
        if (js == 1) {
            for (int64_t t = t0; t < t1; t++) {
                const float *ht = h + t * ts;
                float *xt = x + t * xts;
                const float rt = r[t - t0];
#pragma omp simd
                for (int64_t j = 0; j < n; j++) xt[j * xjs] = w[j] * (ht[j] * rt);
            }
        } else {
            for (int64_t t = t0; t < t1; t++) {
                float *xt = x + t * xts;
                const float rt = r[t - t0];
                for (int64_t j = 0; j < n; j++) xt[j * xjs] = w[j] * (h[j * js + t * ts] * rt);
            }
        }
    }
}

/* act = silu(gate + bg) * (up + bu), elementwise over [R, Cn] gate and up, whose rows are contiguous and
 * grs apart (Cn, or more where gate and up are halves of one GEMM's output); act[r, c] is at
 * act[r * ars + c * acs] (the caller asks for token-major). A bias is indexed by the row (bias_axis 0:
 * feature-major) or the column (1: token-major); either may be NULL. */
void silu_mul_f32(const float *gate, const float *up, const float *bg, const float *bu, float *act, int64_t R,
                  int64_t Cn, int64_t grs, int64_t ars, int64_t acs, int bias_axis, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (R * Cn > PARALLEL_MIN)
    for (int64_t r = 0; r < R; r++) {
        const float *g = gate + r * grs, *u = up + r * grs;
        float *a = act + r * ars;
        if (bg == NULL && bu == NULL) {
#pragma omp simd
            for (int64_t c = 0; c < Cn; c++) a[c * acs] = g[c] / (1.0f + expf(-g[c])) * u[c];
        } else {
            for (int64_t c = 0; c < Cn; c++) {
                const int64_t j = bias_axis == 0 ? r : c;
                const float x = bg != NULL ? g[c] + bg[j] : g[c];
                const float y = bu != NULL ? u[c] + bu[j] : u[c];
                a[c * acs] = x / (1.0f + expf(-x)) * y;
            }
        }
    }
}

/* The step after the q, k and v projections: their biases (any may be NULL), rotary embedding of q and k
 * at each token's position (rotate-half form: cos, sin [positions, D]), q into q_out [T, H, D], k and v
 * into the caches [slots, Hkv, D] at slot[t]. q, k and v are activations as above, each with its own
 * strides. 0, or -2 when a position or a slot is out of range (checked before anything is written). */
int qkv_rope_f32(const float *q, int64_t qts, int64_t qjs, const float *k, int64_t kts, int64_t kjs,
                 const float *v, int64_t vts, int64_t vjs, const float *bq, const float *bk, const float *bv,
                 const float *cos_t, const float *sin_t, const int64_t *pos, const int64_t *slot, float *q_out,
                 float *k_cache, float *v_cache, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t positions,
                 int64_t slots, int threads)
{
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= positions || slot[t] < 0 || slot[t] >= slots) return -2;
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (T * (H + Hkv) * D > PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + pos[t] * D, *s = sin_t + pos[t] * D;
        for (int64_t hh = 0; hh < H + Hkv; hh++) {
            const int is_q = hh < H;
            const int64_t head = is_q ? hh : hh - H;
            const float *src = is_q ? q + t * qts : k + t * kts;
            const int64_t sj = is_q ? qjs : kjs;
            const float *b = is_q ? bq : bk;
            float *dst = is_q ? q_out + (t * H + head) * D : k_cache + (slot[t] * Hkv + head) * D;
            for (int64_t d = 0; d < half; d++) {
                const int64_t j1 = head * D + d, j2 = j1 + half;
                const float x1 = b != NULL ? src[j1 * sj] + b[j1] : src[j1 * sj];
                const float x2 = b != NULL ? src[j2 * sj] + b[j2] : src[j2 * sj];
                dst[d] = x1 * c[d] + (-x2) * s[d];
                dst[d + half] = x2 * c[d + half] + x1 * s[d + half];
            }
        }
        const float *vt = v + t * vts;
        float *vd = v_cache + slot[t] * Hkv * D;
        for (int64_t j = 0; j < Hkv * D; j++) vd[j] = bv != NULL ? vt[j * vjs] + bv[j] : vt[j * vjs];
    }
    return 0;
}
