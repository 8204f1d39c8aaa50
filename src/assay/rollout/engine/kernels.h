/* The C kernels of the engine's float32 CPU path, compiled together into one library (cpu_kernel.py):
 * paged attention (paged_attention.c), the elementwise work between a layer's GEMMs (elementwise.c),
 * the GEMM of a decode step's few rows (skinny_linear.c; int8_linear.c on weight-only int8), a whole
 * decode step (decode_step.c) and
 * sampling a token per row (sampling.c). */
#ifndef ASSAY_KERNELS_H
#define ASSAY_KERNELS_H

#include <stdint.h>

/* The kernels build with IEEE semantics (no -ffast-math: they use infinities as sentinels). Under
 * -ffast-math glibc declares the vector variants of expf and logf (libmvec) itself; here the build
 * declares them where it links libmvec (x86-64 glibc), so their loops still vectorize. libmvec keeps
 * the special values: expf(-inf) is 0, NaN stays NaN. */
#ifdef ASSAY_LIBMVEC
__attribute__((__simd__("notinbranch"))) float expf(float);
__attribute__((__simd__("notinbranch"))) float logf(float);
#endif

/* Below this many elements a pass runs on the calling thread: a decode step of a few dozen rows takes
 * tens of microseconds a pass, less than waking the other threads costs on a busy machine. Prefill
 * passes split, and so do those of a GRPO step's hundreds of decoding rows (0.2-0.3 ms each alone). */
#define PARALLEL_MIN (1 << 16)

int paged_attention_f32(const float *q, const float *k, const float *v, const int64_t *tables,
                        const int64_t *lens, float *out, float *lse, int64_t R, int64_t Hkv, int64_t nq,
                        int64_t D, int64_t bs, int64_t M, int64_t blocks, float scale, int threads);
int paged_attention_shared_f32(const float *q, const float *k, const float *v, const int64_t *tables,
                               const int64_t *lens, const int64_t *members, float *out, float *lse, int64_t C,
                               int64_t G, int64_t B, int64_t Hkv, int64_t nq, int64_t D, int64_t bs, int64_t M,
                               int64_t blocks, float scale, int threads);
int paged_prefill_f32(const float *q, const float *k, const float *v, const int64_t *table, int64_t first,
                      int64_t n, float *out, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t M,
                      int64_t blocks, float scale, int threads);
void add_rms_norm_f32(float *h, const float *delta, const float *bias, const float *w, float *x, int64_t T,
                      int64_t n, int64_t ts, int64_t js, int64_t xts, int64_t xjs, float eps, int threads);
void silu_mul_f32(const float *gate, const float *up, const float *bg, const float *bu, float *act, int64_t R,
                  int64_t Cn, int64_t grs, int64_t ars, int64_t acs, int bias_axis, int threads);
int qkv_rope_f32(const float *q, int64_t qts, int64_t qjs, const float *k, int64_t kts, int64_t kjs,
                 const float *v, int64_t vts, int64_t vjs, const float *bq, const float *bk, const float *bv,
                 const float *cos_t, const float *sin_t, const int64_t *pos, const int64_t *slot, float *q_out,
                 float *k_cache, float *v_cache, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t positions,
                 int64_t slots, int threads);
int skinny_linear_f32(const float *x, int64_t xrs, const float *wp, const float *bias, float *y, int64_t M,
                      int64_t N, int64_t K, int threads);
int skinny_panel_f32(void);
int int8_linear_f32(const float *x, int64_t xrs, const int8_t *wp, const float *scale, const float *bias, float *y,
                    int64_t M, int64_t N, int64_t K, int threads);
int int8_panel_f32(void);
int int8_rows_f32(void);
int skinny_rows_f32(void);
int decode_step_f32(const float *const *w, int64_t layers, float *h, float *x, const float *final_norm,
                    const float *cos_t, const float *sin_t, const int64_t *pos, const int64_t *slot, float *k_cache,
                    float *v_cache, int64_t blocks, int64_t bs, const int64_t *tables, const int64_t *lens,
                    int64_t width, const int64_t *pre_tables, const int64_t *pre_lens, const int64_t *members,
                    int64_t clusters, int64_t group, int64_t pre_width, int64_t M, int64_t n, int64_t H,
                    int64_t Hkv, int64_t D, int64_t inter, int64_t positions, float scale, float eps, int threads);
int sample_rows_f32(const float *logits, int64_t N, int64_t V, const float *inv_temp, const double *u,
                    int64_t *tokens, float *logprobs, int threads);

#endif
