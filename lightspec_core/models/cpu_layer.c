/* A decoder layer's work around attention on a CPU in float32, in two calls instead of about
 * twenty torch operations: at a few rows a step is their dispatch, not their arithmetic.
 *
 * lightspec_layer_pre:  x -> RMSNorm -> fused q/k/v product (+ bias) -> q/k RMSNorm (Qwen3) ->
 *                       rotary embedding -> K/V written into the paged pool, q packed for attention.
 * lightspec_layer_post: attention output -> o product (+ bias) -> residual -> RMSNorm ->
 *                       fused gate/up product -> SiLU(gate) * up -> down product -> residual.
 * lightspec_mtp_head:   one folded MTP head (mtp_heads.FoldedMTPHead) for any number of rows.
 *
 * The products are cpu_linear.c's kernel, passed in as a function pointer (one build of it, one
 * set of packed weights). Everything else works one row at a time with the same instructions
 * whatever the number of rows and threads, so a row's result does not depend on what else is in
 * the step: a decode step, a verification and a step that also carries a prompt chunk agree to the
 * bit, which keeps speculation lossless. Built without -ffast-math (native.STRICT_FLAGS) so the
 * compiler keeps the sums' order as written.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*linear_fn)(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                          const float *bias, float *y, int threads);

/* Vectors of the CPU's own width: GCC lowers a wider vector type (16 floats on AVX2) piecewise,
 * through the stack, which made SiLU 3.5x slower there. Per lane the arithmetic is the same at any
 * width; the sum of squares keeps 16 lane sums (LANES / VW vectors of them), so a row's norm is the
 * same on every CPU. */
#if defined(__AVX512F__)
#define VW 16 /* floats a vector */
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4)));
#define LANES 16

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store(float *p, vf v) { *(vf_unaligned *)p = v; }
static inline vf splat(float s) { return (vf){0} + s; }
static inline vf select_(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* Row stages are worth threads only from this many rows. */
#define PARALLEL_ROWS 16

/* sum of squares: 16 lane sums, then the lanes in order, then the tail */
static float sum_squares(const float *x, int64_t n) {
    vf acc[LANES / VW] = {{0}};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int a = 0; a < LANES / VW; a++) {
            const vf v = load(x + i + a * VW);
            acc[a] += v * v;
        }
    float s = 0.f;
    for (int a = 0; a < LANES / VW; a++)
        for (int l = 0; l < VW; l++) s += acc[a][l];
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

/* out = w * (x / sqrt(mean(x^2) + eps)), as transformers' LlamaRMSNorm in float32 (w NULL: no
 * weight); out may be x */
static void rms_norm(const float *x, int64_t n, const float *w, float eps, float *out) {
    const float r = 1.f / sqrtf(sum_squares(x, n) / (float)n + eps);
    if (w)
        for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
    else
        for (int64_t i = 0; i < n; i++) out[i] = x[i] * r;
}

/* rotate-half rotary embedding of one head in place (the Hugging Face convention) */
static void rotate(float *x, int64_t hd, const float *c, const float *s) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
}

/* e^x, lane-wise: Cephes' expf (range reduction by ln 2, degree-6 polynomial), about one ulp */
static inline vf exp_lanes(vf x) {
    x = select_(x > splat(88.3762626647949f), splat(88.3762626647949f), x);
    x = select_(x < splat(-87.3365478515625f), splat(-87.3365478515625f), x);
    const vf t = x * splat(1.44269504088896341f) + splat(0.5f);
    vi k = __builtin_convertvector(t, vi);  // truncates: one less where t is negative and not whole
    vf kf = __builtin_convertvector(k, vf);
    const vi over = kf > t;
    k += over;  // over is -1 where true
    kf = __builtin_convertvector(k, vf);
    const vf r = x - kf * splat(0.693359375f) + kf * splat(2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.f);
    return p * (vf)((k + 127) << 23);
}

/* out[i] = silu(gate[i]) * up[i] */
static void silu_mul(const float *gate, const float *up, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf g = load(gate + i);
        store(out + i, g / (splat(1.f) + exp_lanes(-g)) * load(up + i));
    }
    if (i < n) {  // the tail through the same lane arithmetic
        float g[VW] = {0}, u[VW] = {0}, o[VW];
        memcpy(g, gate + i, (n - i) * sizeof(float));
        memcpy(u, up + i, (n - i) * sizeof(float));
        const vf gv = load(g);
        store(o, gv / (splat(1.f) + exp_lanes(-gv)) * load(u));
        memcpy(out + i, o, (n - i) * sizeof(float));
    }
}

/* x [n][h]: the residual stream (read). q_out [n][nq*hd]: the rotated queries. The rotated keys
 * and the values go into the pool: key element e of the step (row, kv head, dim) to
 * key_pool[key_elements[e]], value row v (row, kv head) to value_pool[value_rows[v]*hd ...].
 * cos/sin: the rope tables [positions][hd]. q_norm/k_norm [hd] or NULL, qkv_bias or NULL.
 * Returns 0, 1 when out of memory, 2 for a position past the tables. */
int lightspec_layer_pre(const float *x, int64_t n, int64_t h, const float *ln, float eps,
                        const float *qkv_packed, const float *qkv_bias, int64_t nq, int64_t nkv, int64_t hd,
                        const float *q_norm, const float *k_norm, const float *cos_table,
                        const float *sin_table, int64_t table_positions, const int64_t *positions,
                        float *key_pool, const int64_t *key_elements, float *value_pool,
                        const int64_t *value_rows, float *q_out, int threads, linear_fn linear) {
    for (int64_t r = 0; r < n; r++)
        if (positions[r] < 0 || positions[r] >= table_positions) return 2;
    const int64_t width = (nq + 2 * nkv) * hd;
    float *normed = malloc(sizeof(float) * n * h), *qkv = malloc(sizeof(float) * n * width);
    if (!normed || !qkv) {
        free(normed);
        free(qkv);
        return 1;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_ROWS)
    for (int64_t r = 0; r < n; r++) rms_norm(x + r * h, h, ln, eps, normed + r * h);
    linear(normed, n, h, qkv_packed, width, qkv_bias, qkv, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_ROWS)
    for (int64_t r = 0; r < n; r++) {
        float *row = qkv + r * width;
        const float *c = cos_table + positions[r] * hd, *s = sin_table + positions[r] * hd;
        for (int64_t j = 0; j < nq; j++) {
            float *head = row + j * hd;
            if (q_norm) rms_norm(head, hd, q_norm, eps, head);
            rotate(head, hd, c, s);
        }
        memcpy(q_out + r * nq * hd, row, sizeof(float) * nq * hd);
        for (int64_t j = 0; j < nkv; j++) {
            float *key = row + (nq + j) * hd;
            if (k_norm) rms_norm(key, hd, k_norm, eps, key);
            rotate(key, hd, c, s);
            const int64_t *dest = key_elements + (r * nkv + j) * hd;
            for (int64_t d = 0; d < hd; d++) key_pool[dest[d]] = key[d];
            memcpy(value_pool + value_rows[r * nkv + j] * hd, row + (nq + nkv + j) * hd, sizeof(float) * hd);
        }
    }
    free(normed);
    free(qkv);
    return 0;
}

/* x += down(silu(gate) * up) for the normed rows t [n][h], gate and up stacked in gate_up_packed
 * ([2*inter][h]); t is overwritten. Returns 0, or 1 when out of memory. */
static int add_mlp(float *x, float *t, int64_t n, int64_t h, const float *gate_up_packed, const float *gate_up_bias,
                   int64_t inter, const float *down_packed, const float *down_bias, int threads, linear_fn linear) {
    float *gate_up = malloc(sizeof(float) * n * 2 * inter), *act = malloc(sizeof(float) * n * inter);
    if (!gate_up || !act) {
        free(gate_up);
        free(act);
        return 1;
    }
    linear(t, n, h, gate_up_packed, 2 * inter, gate_up_bias, gate_up, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_ROWS)
    for (int64_t r = 0; r < n; r++)
        silu_mul(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, inter, act + r * inter);
    linear(act, n, inter, down_packed, h, down_bias, t, threads);
    for (int64_t i = 0; i < n * h; i++) x[i] += t[i];
    free(gate_up);
    free(act);
    return 0;
}

/* x [n][h]: the residual stream, updated in place; attn [n][attn_dim]: attention's output.
 * Biases may be NULL. gate_up_packed: gate and up stacked ([2*inter][h]). Returns 0, or 1 when
 * out of memory. */
int lightspec_layer_post(float *x, int64_t n, int64_t h, const float *attn, int64_t attn_dim,
                         const float *o_packed, const float *o_bias, const float *ln, float eps,
                         const float *gate_up_packed, const float *gate_up_bias, int64_t inter,
                         const float *down_packed, const float *down_bias, int threads, linear_fn linear) {
    float *t = malloc(sizeof(float) * n * h);
    if (!t) return 1;
    linear(attn, n, attn_dim, o_packed, h, o_bias, t, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_ROWS)
    for (int64_t r = 0; r < n; r++) {
        float *xr = x + r * h, *tr = t + r * h;
        for (int64_t i = 0; i < h; i++) xr[i] += tr[i];
        rms_norm(xr, h, ln, eps, tr);
    }
    const int rc = add_mlp(x, t, n, h, gate_up_packed, gate_up_bias, inter, down_packed, down_bias, threads, linear);
    free(t);
    return rc;
}

/* One folded MTP head (mtp_heads.FoldedMTPHead: norm weights folded into the products) for n rows:
 * x = norm(state) W_state^T + tok_table[token]; x += down(silu(gate) * up)(norm(x));
 * logits = norm(x) W_lm^T. state, next_state [n][h], logits [n][vocab]. Returns 0, 1 when out of
 * memory, 2 for a token past the table's rows. */
int lightspec_mtp_head(const float *state, const int64_t *tokens, int64_t n, int64_t h, float eps,
                       const float *state_packed, const float *tok_table, int64_t table_rows,
                       const float *gate_up_packed, int64_t inter, const float *down_packed,
                       const float *lm_packed, int64_t vocab, float *next_state, float *logits, int threads,
                       linear_fn linear) {
    for (int64_t r = 0; r < n; r++)
        if (tokens[r] < 0 || tokens[r] >= table_rows) return 2;
    float *t = malloc(sizeof(float) * n * h);
    if (!t) return 1;
    for (int64_t r = 0; r < n; r++) rms_norm(state + r * h, h, NULL, eps, t + r * h);
    linear(t, n, h, state_packed, h, NULL, next_state, threads);
    for (int64_t r = 0; r < n; r++) {
        float *x = next_state + r * h;
        const float *e = tok_table + tokens[r] * h;
        for (int64_t i = 0; i < h; i++) x[i] += e[i];
        rms_norm(x, h, NULL, eps, t + r * h);
    }
    const int rc = add_mlp(next_state, t, n, h, gate_up_packed, NULL, inter, down_packed, NULL, threads, linear);
    if (rc == 0) {
        for (int64_t r = 0; r < n; r++) rms_norm(next_state + r * h, h, NULL, eps, t + r * h);
        linear(t, n, h, lm_packed, vocab, NULL, logits, threads);
    }
    free(t);
    return rc;
}
