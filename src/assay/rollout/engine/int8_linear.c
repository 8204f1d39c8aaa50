/* y = x @ (q * scale).T + bias for a decode step's few rows (M <= INT8_ROWS) on weight-only int8:
 * q int8 per output feature, symmetric (w ~ q * scale[n], |q| <= 127), packed into panels of
 * INT8_PANEL output features, wp [panels, K, INT8_PANEL] (zeros past N), the layout skinny_linear_f32
 * reads in float32. At a few rows a GEMM is bound by reading its weight: int8 reads a quarter of the
 * bytes. Each panel row is widened to float32 once and multiplied into every row's accumulators; the
 * per-feature scale is applied once, at the end (sum_k x_k q_nk, then times scale_n).
 *   x [M, K] with rows xrs apart, y [M, N] contiguous, scale [N], bias [N] or NULL.
 * AVX-512 (panels of 16) or AVX2 + FMA (panels of 8) where the build has them; a portable loop otherwise
 * (the same sums in another order). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__)
#define INT8_PANEL 16
#else
#define INT8_PANEL 8
#endif
#define INT8_ROWS 8

int int8_panel_f32(void) { return INT8_PANEL; }
int int8_rows_f32(void) { return INT8_ROWS; }

#if defined(__AVX512F__)
#include <immintrin.h>

/* A panel row of 16 features on a 512-bit register; each row's FMA broadcasts its x from memory itself. With
 * 32 registers, up to 24 accumulators (M * chains): on a Zen 4 this ran 3 to 8 rows 2.3-2.4x faster than the
 * AVX2 panels of 8, whose time jumped 2.2x from 2 rows to 3 (docs/experiments.md K6). */
typedef __m512 vec;
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_widen(const int8_t *w) /* a panel row, int8 to float32 */
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}
static inline vec vec_fma(const float *x, vec w, vec acc) { return _mm512_fmadd_ps(_mm512_set1_ps(*x), w, acc); }
static inline vec vec_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline void vec_store(float *out, vec v) { _mm512_storeu_ps(out, v); }
#define INT8_CHAINS(M) ((M) <= 6 ? 4 : 3)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* A panel row of 8 features on a 256-bit register: M * chains + 2 <= 16 keeps the accumulators in the 16
 * vector registers. */
typedef __m256 vec;
static inline vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec vec_widen(const int8_t *w) /* a panel row, int8 to float32 */
{
    __m128i raw;
    memcpy(&raw, w, 8); /* the low 8 bytes of raw */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
}
static inline vec vec_fma(const float *x, vec w, vec acc) { return _mm256_fmadd_ps(_mm256_broadcast_ss(x), w, acc); }
static inline vec vec_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline void vec_store(float *out, vec v) { _mm256_storeu_ps(out, v); }
#define INT8_CHAINS(M) ((M) <= 3 ? 4 : (M) == 4 ? 3 : (M) <= 7 ? 2 : 1)
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* U independent accumulator chains per row (k modulo U): at one row a single chain would wait on the
 * FMA's latency every k. */
static inline __attribute__((always_inline)) void int8_panel(const int M, const int U, const float *x, int64_t xrs,
                                                               const int8_t *w, int64_t K, float out[][INT8_PANEL])
{
    vec acc[INT8_ROWS][4];
    for (int m = 0; m < M; m++)
        for (int u = 0; u < U; u++) acc[m][u] = vec_zero();
    int64_t k = 0;
    for (; k + U <= K; k += U) {
        _mm_prefetch((const char *)(w + k * INT8_PANEL + 2048), _MM_HINT_NTA);
        for (int u = 0; u < U; u++) {
            const vec wv = vec_widen(w + (k + u) * INT8_PANEL);
            for (int m = 0; m < M; m++) acc[m][u] = vec_fma(x + m * xrs + k + u, wv, acc[m][u]);
        }
    }
    for (; k < K; k++) {
        const vec wv = vec_widen(w + k * INT8_PANEL);
        for (int m = 0; m < M; m++) acc[m][0] = vec_fma(x + m * xrs + k, wv, acc[m][0]);
    }
    for (int m = 0; m < M; m++) {
        vec s = acc[m][0];
        for (int u = 1; u < U; u++) s = vec_add(s, acc[m][u]);
        vec_store(out[m], s);
    }
}

static void panel_sums(int64_t M, const float *x, int64_t xrs, const int8_t *w, int64_t K, float out[][INT8_PANEL])
{
    switch (M) { /* constants per case: every accumulator stays in a register */
    case 1: int8_panel(1, INT8_CHAINS(1), x, xrs, w, K, out); break;
    case 2: int8_panel(2, INT8_CHAINS(2), x, xrs, w, K, out); break;
    case 3: int8_panel(3, INT8_CHAINS(3), x, xrs, w, K, out); break;
    case 4: int8_panel(4, INT8_CHAINS(4), x, xrs, w, K, out); break;
    case 5: int8_panel(5, INT8_CHAINS(5), x, xrs, w, K, out); break;
    case 6: int8_panel(6, INT8_CHAINS(6), x, xrs, w, K, out); break;
    case 7: int8_panel(7, INT8_CHAINS(7), x, xrs, w, K, out); break;
    default: int8_panel(8, INT8_CHAINS(8), x, xrs, w, K, out); break;
    }
}
#else
static void panel_sums(int64_t M, const float *x, int64_t xrs, const int8_t *w, int64_t K, float out[][INT8_PANEL])
{
    for (int64_t m = 0; m < M; m++)
        for (int j = 0; j < INT8_PANEL; j++) out[m][j] = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        float wv[INT8_PANEL];
        for (int j = 0; j < INT8_PANEL; j++) wv[j] = (float)w[k * INT8_PANEL + j];
        for (int64_t m = 0; m < M; m++) {
            const float xk = x[m * xrs + k];
            for (int j = 0; j < INT8_PANEL; j++) out[m][j] += xk * wv[j];
        }
    }
}
#endif

int int8_linear_f32(const float *x, int64_t xrs, const int8_t *wp, const float *scale, const float *bias, float *y,
                    int64_t M, int64_t N, int64_t K, int threads)
{
    if (M < 1 || M > INT8_ROWS) return -1;
    const int64_t panels = (N + INT8_PANEL - 1) / INT8_PANEL;
#pragma omp parallel for schedule(static) num_threads(threads) if (N * K > PARALLEL_MIN)
    for (int64_t p = 0; p < panels; p++) {
        float out[INT8_ROWS][INT8_PANEL];
        panel_sums(M, x, xrs, wp + p * K * INT8_PANEL, K, out);
        const int64_t n0 = p * INT8_PANEL, width = N - n0 < INT8_PANEL ? N - n0 : INT8_PANEL;
        for (int64_t m = 0; m < M; m++) {
            float *dst = y + m * N + n0;
            for (int64_t j = 0; j < width; j++)
                dst[j] = bias != NULL ? out[m][j] * scale[n0 + j] + bias[n0 + j] : out[m][j] * scale[n0 + j];
        }
    }
    return 0;
}
