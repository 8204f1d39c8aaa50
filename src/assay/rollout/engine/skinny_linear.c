/* y = x @ w.T (+ bias) for a decode step's few rows (M <= SKINNY_ROWS), on w packed into panels of
 * PANEL output features: wp [panels, K, PANEL], panel p holding features p*PANEL .. p*PANEL+PANEL-1
 * (zeros past N). At a few rows a GEMM is bound by reading its weight; here each weight element is
 * read once, and one panel row of it is multiplied into every row's accumulators, which stay in
 * registers for the whole of K (x's elements are broadcast). oneDNN's blocked kernels streamed the
 * engine's decode weights at about half the machine's read rate.
 *   x [M, K] with rows xrs apart, y [M, N] contiguous, bias [N] or NULL. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__)
#define LANES 16
#define PANEL_VECTORS 2 /* 8 rows x 2 = 16 of the 32 vector registers hold accumulators */
#define SKINNY_ROWS 8
#else
#define LANES 8
#define PANEL_VECTORS 1 /* 16 registers; past 2 rows, one FMA per broadcast left it slower than oneDNN */
#define SKINNY_ROWS 2
#endif
#define PANEL (LANES * PANEL_VECTORS)
typedef float vl __attribute__((vector_size(LANES * 4)));
/* Panel rows requested ahead (4 KB), non-temporal: the hardware prefetcher alone left loads and FMAs
 * adding rather than overlapping; measured 1.18x on the decode weights at 8 rows, 1.1x at 4, ~1.03x
 * at 1. Past the last panel it requests bytes it never reads: harmless. */
#define PREFETCH_ROWS 32

int skinny_panel_f32(void) { return PANEL; }
int skinny_rows_f32(void) { return SKINNY_ROWS; }

static inline __attribute__((always_inline)) void skinny_panel(const int M, const float *x, int64_t xrs,
                                                                 const float *w, int64_t K, vl acc[][PANEL_VECTORS])
{
    for (int m = 0; m < M; m++)
        for (int v = 0; v < PANEL_VECTORS; v++) acc[m][v] = (vl){0};
    for (int64_t k = 0; k < K; k++) {
        vl wv[PANEL_VECTORS];
        const char *ahead = (const char *)(w + (k + PREFETCH_ROWS) * PANEL);
        for (int line = 0; line < PANEL * 4; line += 64) __builtin_prefetch(ahead + line, 0, 0);
        for (int v = 0; v < PANEL_VECTORS; v++) memcpy(&wv[v], w + k * PANEL + v * LANES, sizeof(vl));
        for (int m = 0; m < M; m++) {
            const float xk = x[m * xrs + k];
            for (int v = 0; v < PANEL_VECTORS; v++) acc[m][v] += xk * wv[v];
        }
    }
}

int skinny_linear_f32(const float *x, int64_t xrs, const float *wp, const float *bias, float *y, int64_t M,
                      int64_t N, int64_t K, int threads)
{
    if (M < 1 || M > SKINNY_ROWS) return -1;
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads) if (N * K > PARALLEL_MIN)
    for (int64_t p = 0; p < panels; p++) {
        vl acc[8][PANEL_VECTORS];
        const float *w = wp + p * K * PANEL;
        switch (M) { /* a constant row count per case: the compiler keeps every accumulator in a register */
        case 1: skinny_panel(1, x, xrs, w, K, acc); break;
        case 2: skinny_panel(2, x, xrs, w, K, acc); break;
        case 3: skinny_panel(3, x, xrs, w, K, acc); break;
        case 4: skinny_panel(4, x, xrs, w, K, acc); break;
        case 5: skinny_panel(5, x, xrs, w, K, acc); break;
        case 6: skinny_panel(6, x, xrs, w, K, acc); break;
        case 7: skinny_panel(7, x, xrs, w, K, acc); break;
        default: skinny_panel(8, x, xrs, w, K, acc); break;
        }
        const int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
        for (int m = 0; m < M; m++) {
            float row[PANEL];
            memcpy(row, acc[m], sizeof row);
            float *dst = y + m * N + n0;
            for (int64_t j = 0; j < width; j++) dst[j] = bias != NULL ? row[j] + bias[n0 + j] : row[j];
        }
    }
    return 0;
}
