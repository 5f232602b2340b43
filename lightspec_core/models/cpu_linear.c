/* Linear layers on a CPU in float32: y[i][j] = x[i] . w[j] (+ bias[j]), from weights packed once.
 *
 * lightspec_pack lays a weight [n][k] out as panels of NR output rows, [n / NR][k][NR] (the last
 * panel zero-padded): a panel's k-th NR values are one step of NR dot products. The product walks
 * each panel once from memory and keeps it in cache while every activation row uses it, MR rows at
 * a time: per step of k, the panel's NR values in NV vector loads, MR broadcasts and MR * NV fused
 * multiply-adds into as many vector accumulators, so the loop runs near the FMA units' rate and no
 * horizontal sums are needed. Panels are shared out among the threads.
 *
 * Each output is its own accumulator lane summed over k in order, whatever the number of rows and
 * threads: a row's result is the same alone or with others (a decode step and a verification
 * agree to the bit). The vector types are GCC's generic vectors, one register wide.
 *
 * Built by native.py with -O3 -march=native -fopenmp; the loops run in torch's OpenMP pool.
 */
#include <stdint.h>
#include <string.h>

/* VL: floats in one of the machine's vector registers. The kernel's vectors are that wide so that
 * its accumulators stay in registers: GCC keeps a dozen vectors wider than the registers in memory
 * (64-byte vectors on AVX2 made the product about twenty times slower). */
#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
/* The micro-kernel's shape: MR * NV accumulators, NV panel vectors and a broadcast fit the
 * registers (AVX-512: 24 + 4 + 1 of 32; AVX2: 12 + 2 + 1 of 16; NEON: 16 + 8 + 1 of 32). On AVX-512
 * four vectors across (NR = 64) ran 1.13-1.21x as fast as two (6 x 32) at 64-320 rows of the
 * default model's layer shapes on two threads, 1.09-1.14x at 16 (the LM head's 0.88-1.01x): each
 * broadcast row value feeds four FMAs instead of two, so the loop issues fewer loads per FMA. On
 * AVX2 six rows by two vectors (6 x 16) ran the same shapes at 82-98 GFLOP/s on one thread of an
 * AMD EPYC where two rows by four (2 x 32: 8 accumulators) ran 49-74: twelve accumulators hide the
 * FMA latency that eight leave exposed, and a step of k issues 8 loads for 12 FMAs, not 6 for 8. */
#if VL == 16
#define NR 64
#define MR 6
#elif VL == 8
#define NR 16
#define MR 6
#else
#define NR 32
#define MR 2
#endif
#define NV (NR / VL) /* vectors across a panel */
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vf_unaligned __attribute__((vector_size(VL * 4), aligned(4)));

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store(float *p, vf v) { *(vf_unaligned *)p = v; }

int64_t lightspec_packed_size(int64_t n, int64_t k) { return (n + NR - 1) / NR * k * NR; }

void lightspec_pack(const float *restrict w, int64_t n, int64_t k, float *restrict out) {
    const int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t t = 0; t < k; t++)
            for (int j = 0; j < NR; j++) {
                const int64_t row = p * NR + j;
                out[(p * k + t) * NR + j] = row < n ? w[row * k + t] : 0.f;
            }
}

/* ROWS (<= MR) rows of x against one panel: y[r][0..cols) for r < ROWS, bias added. */
#define MICRO(ROWS)                                                                                    \
    static void micro_##ROWS(const float *restrict x, int64_t k, const float *restrict panel,         \
                             const float *restrict bias, float *restrict y, int64_t ldy, int64_t cols) { \
        vf acc[ROWS][NV];                                                                              \
        for (int r = 0; r < ROWS; r++)                                                                 \
            for (int v = 0; v < NV; v++) acc[r][v] = (vf){0};                                          \
        for (int64_t t = 0; t < k; t++) {                                                              \
            vf w[NV];                                                                                  \
            for (int v = 0; v < NV; v++) w[v] = load(panel + t * NR + v * VL);                         \
            for (int r = 0; r < ROWS; r++) {                                                           \
                const float xs = x[r * k + t];                                                         \
                for (int v = 0; v < NV; v++) acc[r][v] += xs * w[v];                                   \
            }                                                                                          \
        }                                                                                              \
        float b[NR] = {0};                                                                             \
        if (bias) memcpy(b, bias, cols * sizeof(float));                                               \
        for (int r = 0; r < ROWS; r++) {                                                               \
            if (cols == NR) {                                                                          \
                for (int v = 0; v < NV; v++) store(y + r * ldy + v * VL, acc[r][v] + load(b + v * VL)); \
            } else {                                                                                   \
                float tmp[NR];                                                                         \
                for (int v = 0; v < NV; v++) store(tmp + v * VL, acc[r][v] + load(b + v * VL));        \
                memcpy(y + r * ldy, tmp, cols * sizeof(float));                                        \
            }                                                                                          \
        }                                                                                              \
    }
#if MR == 6
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6)
#else
MICRO(1) MICRO(2)
#endif

/* One to three rows against one panel are ROWS * NV chains of dependent fused multiply-adds (two
 * to six on AVX2), too few to cover the units' latency. Such a product takes G whole panels side
 * by side instead, ROWS * G * NV chains (eight to twelve, as the six-row kernel has): on one
 * thread of an AMD EPYC (AVX2), weights in cache, three runs of six shapes ran 1.0-1.35x as fast at
 * one row and mostly 1.0-1.5x at two and three, with single runs at three rows down to 0.87x (4096
 * x 256 once, 2048 x 256 twice). Each output is still its own lane's sum over k in order: the same
 * bits as micro_ROWS gives it. */
#define WIDE(ROWS, G)                                                                                  \
    static void wide_##ROWS(const float *restrict x, int64_t k, const float *restrict panel,          \
                            const float *restrict bias, float *restrict y, int64_t ldy) {             \
        vf acc[ROWS][G * NV];                                                                          \
        for (int r = 0; r < ROWS; r++)                                                                 \
            for (int v = 0; v < G * NV; v++) acc[r][v] = (vf){0};                                      \
        for (int64_t t = 0; t < k; t++) {                                                              \
            float xs[ROWS];                                                                            \
            for (int r = 0; r < ROWS; r++) xs[r] = x[r * k + t];                                       \
            for (int g = 0; g < G; g++)                                                                \
                for (int v = 0; v < NV; v++) {                                                         \
                    const vf w = load(panel + (g * k + t) * NR + v * VL);                              \
                    for (int r = 0; r < ROWS; r++) acc[r][g * NV + v] += xs[r] * w;                    \
                }                                                                                      \
        }                                                                                              \
        float b[G * NR] = {0};                                                                         \
        if (bias) memcpy(b, bias, sizeof(b));                                                          \
        for (int r = 0; r < ROWS; r++)                                                                 \
            for (int v = 0; v < G * NV; v++) store(y + r * ldy + v * VL, acc[r][v] + load(b + v * VL)); \
    }
#define CHAINS(ROWS, G) ((ROWS) * (G) * NV)
#define G_1 (CHAINS(1, 4) <= 12 ? 4 : CHAINS(1, 2) <= 12 ? 2 : 1)
#define G_2 (CHAINS(2, 2) <= 12 ? 2 : 1)
#define G_3 (MR == 6 && CHAINS(3, 2) <= 12 ? 2 : 1) /* micro_3 exists where MR is 6 */
WIDE(1, G_1) WIDE(2, G_2) WIDE(3, G_3)

/* m (1 to 3) rows against g panels from ``first`` on, side by side where they are whole. */
static void few_rows(const float *restrict x, int64_t m, int64_t k, const float *restrict packed, int64_t n,
                     const float *restrict bias, float *restrict y, int64_t first, int g) {
    const float *panel = packed + first * k * NR, *b = bias ? bias + first * NR : NULL;
    if ((first + g) * NR <= n) {
        if (m == 1) wide_1(x, k, panel, b, y + first * NR, n);
        else if (m == 2) wide_2(x, k, panel, b, y + first * NR, n);
        else wide_3(x, k, panel, b, y + first * NR, n);
        return;
    }
    for (int64_t p = first; p * NR < n && p < first + g; p++, panel += k * NR, b = b ? b + NR : NULL) {
        const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
        if (m == 1) micro_1(x, k, panel, b, y + p * NR, n, cols);
        else if (m == 2) micro_2(x, k, panel, b, y + p * NR, n, cols);
#if MR == 6
        else micro_3(x, k, panel, b, y + p * NR, n, cols);
#endif
    }
}

/* x: [m][k] contiguous, packed: lightspec_pack of w [n][k], bias: [n] or NULL, y: [m][n].
 * A task is one panel and a stretch of rows: the whole of them where there are panels enough for
 * every thread, else each panel's rows cut into as many stretches as it takes to give each thread
 * work (a narrow layer on many cores). */
void lightspec_linear(const float *restrict x, int64_t m, int64_t k, const float *restrict packed, int64_t n,
                      const float *restrict bias, float *restrict y, int threads) {
    if (m <= 0) return;
    const int64_t panels = (n + NR - 1) / NR;
    const int g = m == 1 ? G_1 : m == 2 ? G_2 : m == 3 ? G_3 : 1;
    if (g > 1 && panels >= (int64_t)g * threads) { /* a task: g panels */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t first = 0; first < panels; first += g) few_rows(x, m, k, packed, n, bias, y, first, g);
        return;
    }
    const int64_t blocks = (m + MR - 1) / MR; /* of MR rows */
    int64_t cuts = panels >= threads ? 1 : (threads + panels - 1) / panels;
    cuts = cuts < blocks ? cuts : blocks;
    const int64_t stretch = (blocks + cuts - 1) / cuts * MR; /* rows of a task */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < panels * cuts; task++) {
        const int64_t p = task / cuts, first = task % cuts * stretch;
        const int64_t last = first + stretch < m ? first + stretch : m;
        const float *panel = packed + p * k * NR;
        const float *b = bias ? bias + p * NR : NULL;
        const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
        float *yp = y + p * NR;
        int64_t i = first;
#if MR == 6
        for (; i + 6 <= last; i += 6) micro_6(x + i * k, k, panel, b, yp + i * n, n, cols);
        switch (last - i) {
            case 5: micro_5(x + i * k, k, panel, b, yp + i * n, n, cols); break;
            case 4: micro_4(x + i * k, k, panel, b, yp + i * n, n, cols); break;
            case 3: micro_3(x + i * k, k, panel, b, yp + i * n, n, cols); break;
            case 2: micro_2(x + i * k, k, panel, b, yp + i * n, n, cols); break;
            case 1: micro_1(x + i * k, k, panel, b, yp + i * n, n, cols); break;
        }
#else
        for (; i + 2 <= last; i += 2) micro_2(x + i * k, k, panel, b, yp + i * n, n, cols);
        if (i < last) micro_1(x + i * k, k, panel, b, yp + i * n, n, cols);
#endif
    }
}

/* Each row's index of its first largest value, as torch's max(-1).indices and argmax give it (a
 * row with NaN: its first NaN, torch taking NaN for the largest). y: [m][n] contiguous, out: [m].
 * Two vectorised passes over a row, its largest value and then the first index holding it, instead
 * of torch's index-carrying reduction, which takes 0.85 ms of a 320-row verification step's 21. */
void lightspec_argmax_rows(const float *restrict y, int64_t m, int64_t n, int64_t *restrict out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (m * n >= 65536)
    for (int64_t r = 0; r < m; r++) {
        const float *restrict row = y + r * n;
        float top = row[0];
        int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
        for (int64_t j = 0; j < n; j++) {
            top = row[j] > top ? row[j] : top;
            nan |= row[j] != row[j];
        }
        int64_t first = n;
        if (nan) {
#pragma omp simd reduction(min : first)
            for (int64_t j = 0; j < n; j++) first = row[j] != row[j] && j < first ? j : first;
        } else {
#pragma omp simd reduction(min : first)
            for (int64_t j = 0; j < n; j++) first = row[j] == top && j < first ? j : first;
        }
        out[r] = first;
    }
}
