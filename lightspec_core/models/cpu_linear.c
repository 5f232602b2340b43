/* Linear layers of a few rows, for float32 on a CPU: y[i][j] = x[i] . w[j] (+ bias[j]).
 *
 * At a few rows a layer's cost is reading its weight matrix once from memory. Each weight row is
 * read once, contiguously, and dotted with every activation row while it sits in L1; the weight rows
 * are shared out among the threads in equal stretches. torch's products (sgemv, and sgemm for a
 * few rows) reached about half the bandwidth of this loop on the machines measured (see
 * cpu_linear.py). Each output is one dot product whose arithmetic does not depend on the number
 * of rows, so a row's result is the same alone or with others (a decode step and a verification
 * agree to the bit).
 *
 * Built with -O3 -march=native -ffast-math -fopenmp by native.py: the dot product vectorises to
 * whole registers with several partial sums, and the loop runs in torch's OpenMP pool.
 */
#include <stdint.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t k) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t t = 0; t < k; t++) s += a[t] * b[t];
    return s;
}

/* x: [m][k], w: [n][k], bias: [n] or NULL, y: [m][n], all contiguous. */
void lightspec_linear(const float *restrict x, int64_t m, int64_t k, const float *restrict w, int64_t n,
                      const float *restrict bias, float *restrict y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j++) {
        const float *restrict wj = w + j * k;
        const float b = bias ? bias[j] : 0.f;
        for (int64_t i = 0; i < m; i++) y[i * n + j] = dot(x + i * k, wj, k) + b;
    }
}
