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

/* One 16-byte panel row widened per k for every row's FMA, which broadcasts its x from memory itself. With 32
 * registers, up to 24 accumulators (M * U): on a Zen 4 this ran 3 to 8 rows 2.3-2.4x faster than the AVX2
 * panels of 8, whose time jumped 2.2x from 2 rows to 3 (docs/experiments.md K6). */
static inline __attribute__((always_inline)) void int8_panel(const int M, const int U, const float *x, int64_t xrs,
                                                               const int8_t *w, int64_t K, float out[][INT8_PANEL])
{
    __m512 acc[INT8_ROWS][4];
    for (int m = 0; m < M; m++)
        for (int u = 0; u < U; u++) acc[m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + U <= K; k += U) {
        _mm_prefetch((const char *)(w + (k + 128) * INT8_PANEL), _MM_HINT_NTA);
        for (int u = 0; u < U; u++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(w + (k + u) * INT8_PANEL));
            const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
            for (int m = 0; m < M; m++)
                acc[m][u] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * xrs + k + u]), wv, acc[m][u]);
        }
    }
    for (; k < K; k++) {
        const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + k * INT8_PANEL))));
        for (int m = 0; m < M; m++) acc[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * xrs + k]), wv, acc[m][0]);
    }
    for (int m = 0; m < M; m++) {
        __m512 s = acc[m][0];
        for (int u = 1; u < U; u++) s = _mm512_add_ps(s, acc[m][u]);
        _mm512_storeu_ps(out[m], s);
    }
}

static void panel_sums(int64_t M, const float *x, int64_t xrs, const int8_t *w, int64_t K, float out[][INT8_PANEL])
{
    switch (M) { /* constants per case: every accumulator stays in a register */
    case 1: int8_panel(1, 4, x, xrs, w, K, out); break;
    case 2: int8_panel(2, 4, x, xrs, w, K, out); break;
    case 3: int8_panel(3, 4, x, xrs, w, K, out); break;
    case 4: int8_panel(4, 4, x, xrs, w, K, out); break;
    case 5: int8_panel(5, 4, x, xrs, w, K, out); break;
    case 6: int8_panel(6, 4, x, xrs, w, K, out); break;
    case 7: int8_panel(7, 3, x, xrs, w, K, out); break;
    default: int8_panel(8, 3, x, xrs, w, K, out); break;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* U independent accumulator chains per row (k modulo U): at one row a single chain would wait on the
 * FMA's latency every k; M * U + 2 <= 16 keeps them all in the 16 vector registers. */
static inline __attribute__((always_inline)) void int8_panel(const int M, const int U, const float *x, int64_t xrs,
                                                               const int8_t *w, int64_t K, float out[][INT8_PANEL])
{
    __m256 acc[INT8_ROWS][4];
    for (int m = 0; m < M; m++)
        for (int u = 0; u < U; u++) acc[m][u] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + U <= K; k += U) {
        _mm_prefetch((const char *)(w + (k + 256) * INT8_PANEL), _MM_HINT_NTA);
        for (int u = 0; u < U; u++) {
            __m128i raw;
            memcpy(&raw, w + (k + u) * INT8_PANEL, 8);  /* the low 8 bytes of raw */
            const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
            for (int m = 0; m < M; m++)
                acc[m][u] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * xrs + k + u), wv, acc[m][u]);
        }
    }
    for (; k < K; k++) {
        __m128i raw;
        memcpy(&raw, w + k * INT8_PANEL, 8);
        const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
        for (int m = 0; m < M; m++) acc[m][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * xrs + k), wv, acc[m][0]);
    }
    for (int m = 0; m < M; m++) {
        __m256 s = acc[m][0];
        for (int u = 1; u < U; u++) s = _mm256_add_ps(s, acc[m][u]);
        _mm256_storeu_ps(out[m], s);
    }
}

static void panel_sums(int64_t M, const float *x, int64_t xrs, const int8_t *w, int64_t K, float out[][INT8_PANEL])
{
    switch (M) { /* constants per case: every accumulator stays in a register */
    case 1: int8_panel(1, 4, x, xrs, w, K, out); break;
    case 2: int8_panel(2, 4, x, xrs, w, K, out); break;
    case 3: int8_panel(3, 4, x, xrs, w, K, out); break;
    case 4: int8_panel(4, 3, x, xrs, w, K, out); break;
    case 5: int8_panel(5, 2, x, xrs, w, K, out); break;
    case 6: int8_panel(6, 2, x, xrs, w, K, out); break;
    case 7: int8_panel(7, 2, x, xrs, w, K, out); break;
    default: int8_panel(8, 1, x, xrs, w, K, out); break;
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
