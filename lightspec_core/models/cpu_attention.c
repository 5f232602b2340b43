/* Attention of decode and verify rows straight from the paged KV pool, for float32 on a CPU.
 *
 * The reference is models/paged.py's attend_pool (and transformers' eager attention); this is the
 * same arithmetic with the loops a CPU wants. One task is one request: its query heads and rows
 * share every key and value tile, so each tile is read from memory once (the reference reads each
 * key once per query row and head), and the blocks' tiles are fetched ahead of their use.
 *
 * Pool layout (models/paged.py): a tile is one block of one KV head, keys transposed as
 * [head_dim][block_size], values as [block_size][head_dim]; ``tiles`` lists a request's tile
 * indices per KV head in context order: tiles[(r * kv_heads + h) * tiles_per_head + b].
 *
 * For query row t of request r (packed row starts[r] + t, position positions[row]) and query head
 * h * G + g: keys 0..position are visible; scores are q.k * scale, the softmax is taken over the
 * visible keys only (no -inf masking, so fast-math's finite-math assumption holds), and the output
 * is sum_j e_j v_j / sum_j e_j.
 *
 * Built with -O3 -march=native -ffast-math -fopenmp by native.py; the OpenMP runtime is the one
 * torch already loaded (same soname), so these loops share torch's thread pool and its
 * torch.set_num_threads setting instead of adding a second pool that spins against it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Issues prefetches into L2 for ``bytes`` starting at ``p``. A request's tiles are scattered over the
 * pool (block tables), so without them every tile starts with misses the hardware prefetcher does
 * not see coming. The window runs PREFETCH_BYTES ahead, keys and values together, and lands in L2,
 * not L1: one block ahead into L1 leaves a thread at about 6 GB/s on scattered tables (its line fill
 * buffers full); this reads 64 requests x 300 tokens of keys and values 1.2-1.5x as fast (18-35 %
 * less time a layer, one or two threads, decode or 5-token verification). */
#define PREFETCH_BYTES 131072
static inline void prefetch(const float *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 1);
}

/* keys and values of block b, every KV head */
static inline void prefetch_block(const float *key_pool, const float *value_pool, const int64_t *tiles,
                                  int64_t tiles_per_head, int64_t b, int kv_heads, int64_t tile) {
    for (int h = 0; h < kv_heads; h++) {
        prefetch(key_pool + tiles[h * tiles_per_head + b] * tile, tile * 4);
        prefetch(value_pool + tiles[h * tiles_per_head + b] * tile, tile * 4);
    }
}

/* One task: request ``r`` (its rows start..start+qlen-1) with every KV head. The heads of a block
 * are one contiguous stretch of the pool (see models/paged.py), read block by block. ``hd`` and
 * ``bs`` are compile-time constants at the common sizes (attend_sized), so the loops over a tile's
 * keys and a head's dimensions vectorise to whole registers.
 * Query i of KV head h is row t = i / group, query head h * group + i % group. */
static inline __attribute__((always_inline)) void attend_task(
    const float *restrict q, float *restrict out, int64_t row_stride, const float *restrict key_pool,
    const float *restrict value_pool, const int64_t *restrict tiles, int64_t tiles_per_head, int64_t start,
    int64_t qlen, const int64_t *restrict positions, int kv_heads, int group, const int hd, const int bs,
    float scale, float *restrict scores, float *restrict acc, float *restrict qbuf) {
    if (qlen <= 0) return; /* a request with no rows: its context would be read at positions[start - 1] */
    const int64_t nq = qlen * group; /* queries per KV head */
    const int64_t tile = (int64_t)hd * bs;
    const int64_t ctx = positions[start + qlen - 1] + 1; /* the last row sees the most keys */
    const int64_t nb = (ctx + bs - 1) / bs;
    const int64_t span = nb * bs; /* one query's scores */

    for (int h = 0; h < kv_heads; h++)
        for (int64_t i = 0; i < nq; i++) {
            const float *restrict src = q + (start + i / group) * row_stride + ((int64_t)h * group + i % group) * hd;
            for (int d = 0; d < hd; d++) qbuf[(h * nq + i) * hd + d] = src[d];
        }
    const int64_t ahead = PREFETCH_BYTES / (2 * kv_heads * tile * 4) > 1 ? PREFETCH_BYTES / (2 * kv_heads * tile * 4) : 1;
    for (int64_t b = 0; b < nb && b < ahead; b++)
        prefetch_block(key_pool, value_pool, tiles, tiles_per_head, b, kv_heads, tile);
    for (int64_t b = 0; b < nb; b++) {
        if (b + ahead < nb) prefetch_block(key_pool, value_pool, tiles, tiles_per_head, b + ahead, kv_heads, tile);
        for (int h = 0; h < kv_heads; h++) {
            const float *restrict kt = key_pool + tiles[h * tiles_per_head + b] * tile;
            for (int64_t i = 0; i < nq; i++) {
                const float *restrict qi = qbuf + (h * nq + i) * hd;
                float *restrict s = scores + (h * nq + i) * span + b * bs;
#pragma omp simd
                for (int j = 0; j < bs; j++) s[j] = 0.f;
                for (int d = 0; d < hd; d++) {
                    const float qd = qi[d];
                    const float *restrict kd = kt + (int64_t)d * bs;
#pragma omp simd
                    for (int j = 0; j < bs; j++) s[j] += qd * kd[j];
                }
            }
        }
    }
    /* softmax numerators in place over each query's visible keys; the sums stay for the end */
    for (int64_t hi = 0; hi < kv_heads * nq; hi++) {
        const int64_t n = positions[start + (hi % nq) / group] + 1;
        float *restrict s = scores + hi * span;
        float m = s[0];
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf((s[j] - m) * scale);
            sum += s[j];
        }
        qbuf[hi * hd] = sum; /* the query itself is no longer needed */
    }
    for (int64_t i = 0; i < kv_heads * nq * hd; i++) acc[i] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        if (nb > ahead && b + 1 < nb) /* a long context's first values may have left L2 again */
            for (int h = 0; h < kv_heads; h++) prefetch(value_pool + tiles[h * tiles_per_head + b + 1] * tile, tile * 4);
        for (int h = 0; h < kv_heads; h++) {
            const float *restrict vt = value_pool + tiles[h * tiles_per_head + b] * tile;
            for (int64_t i = 0; i < nq; i++) {
                const int64_t left = positions[start + i / group] + 1 - b * bs;
                const int64_t jmax = left < bs ? left : bs;
                const float *restrict p = scores + (h * nq + i) * span + b * bs;
                float *restrict o = acc + (h * nq + i) * hd;
                for (int64_t j = 0; j < jmax; j++) {
                    const float w = p[j];
                    const float *restrict v = vt + j * hd;
#pragma omp simd
                    for (int d = 0; d < hd; d++) o[d] += w * v[d];
                }
            }
        }
    }
    for (int h = 0; h < kv_heads; h++)
        for (int64_t i = 0; i < nq; i++) {
            float *restrict dst = out + (start + i / group) * row_stride + ((int64_t)h * group + i % group) * hd;
            const float inv = 1.f / qbuf[(h * nq + i) * hd];
            const float *restrict a = acc + (h * nq + i) * hd;
#pragma omp simd
            for (int d = 0; d < hd; d++) dst[d] = a[d] * inv;
        }
}

/* Sizes where hd and bs are multiples of 16 take attend_blocked: the same sums in the same order
 * per query, with the query loop turned inside out. attend_task adds a query's 32 products of a key
 * block into one register, each product waiting for the last (a fused multiply-add's latency, four
 * cycles, per product); here a register of each of QB queries takes its product in turn, so the
 * chains run side by side and one load of a key or value row serves QB queries. Per query the
 * arithmetic is the same whatever else the task holds: queries are padded to a multiple of QB (pad
 * queries are zero and never written out), and every query runs over every key of the task's
 * blocks, with a weight of exactly zero for keys past its position (the pool holds finite values,
 * so those terms add nothing), so a decode row and the same row inside a verification agree to the
 * bit. 64 requests x 5 rows x 256 keys, one thread on AVX2: a layer 2.3x as fast as attend_task. */
/* Vectors of the CPU's own width: GCC lowers a wider vector type (16 floats on AVX2) piecewise and
 * keeps the halves on the stack, 3-4x slower than attend_task there. A lane is one key (scores) or
 * one dimension (outputs), so per lane the arithmetic is the same at any width. */
#if defined(__AVX512F__)
#define VW 16 /* floats a vector */
#define NREG 32 /* vector registers */
#else
#define VW 8
#define NREG 16
#endif
#define QB 8 /* queries a pass of the key loop: QB accumulators, and a register each for a load and a query */
typedef float vf __attribute__((vector_size(VW * 4)));

static inline vf loadv(const float *p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}
static inline void storev(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
static inline vf maxv(vf a, vf b) {
    vf r;
    for (int e = 0; e < VW; e++) r[e] = a[e] > b[e] ? a[e] : b[e];
    return r;
}

/* Queries of one KV head share its key and value tiles, so a pass over them loads each key or value
 * vector once for all of them: the score loop is then a small matrix product, n queries by CW key
 * vectors over the head's dimensions, and the value loop n queries by CW output vectors over the
 * block's keys, with n * CW accumulators (n <= QH), CW loads and n broadcasts a step. The passes of
 * QB queries across KV heads below load a key or value vector per query (each query has its own
 * tile pointer), two loads a multiply-add; they stay for a decode row's few queries a head, too few
 * to keep the FMA units busy alone. Per query the sums are the same, in the same order, so the two
 * kinds of pass give the same bits: 32 requests x 5 rows x 220 keys, one thread on AVX2, a layer's
 * attention 1.25-1.38x as fast with the pool in cache, 1.1-1.25x from memory. */
#define CW 2 /* vectors across a pass; a key block or a value row is 1, 2, 4 or more of them */
#define QH ((NREG - 1 - CW) / CW < QB ? (NREG - 1 - CW) / CW : QB) /* queries a pass: 6 on AVX2, 8 on AVX-512 */

/* c[r][0..cw*VW) (= 0, or += when ``add``) sum over t < len of a[r * lda + t] * b[t * ldb + 0..cw*VW), r < n */
static inline __attribute__((always_inline)) void head_pass(const int n, const int cw, const float *restrict a,
                                                           int64_t lda, const float *restrict b, int64_t ldb,
                                                           int64_t len, float *restrict c, int64_t ldc, const int add) {
    vf acc[QB][CW];
#pragma GCC unroll 8
    for (int r = 0; r < n; r++)
        for (int e = 0; e < cw; e++) acc[r][e] = add ? loadv(c + r * ldc + e * VW) : (vf){0};
    /* not unrolled: a loop unrolled whole puts a query's adds in one block, where -ffast-math lets GCC
     * regroup them (at hd 128 the outputs then differed from the cross-head passes' in the last bit) */
#pragma GCC unroll 1
    for (int64_t t = 0; t < len; t++) {
        vf w[CW];
        for (int e = 0; e < cw; e++) w[e] = loadv(b + t * ldb + e * VW);
#pragma GCC unroll 8
        for (int r = 0; r < n; r++) {
            const float x = a[r * lda + t];
            for (int e = 0; e < cw; e++) acc[r][e] += x * w[e];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < n; r++)
        for (int e = 0; e < cw; e++) storev(c + r * ldc + e * VW, acc[r][e]);
}

/* head_pass with n a constant (1..QB), so its accumulators are registers */
#define HEAD_PASS(N, ...)                                                                              \
    switch (N) {                                                                                       \
        case 1: head_pass(1, __VA_ARGS__); break;                                                      \
        case 2: head_pass(2, __VA_ARGS__); break;                                                      \
        case 3: head_pass(3, __VA_ARGS__); break;                                                      \
        case 4: head_pass(4, __VA_ARGS__); break;                                                      \
        case 5: head_pass(5, __VA_ARGS__); break;                                                      \
        case 6: head_pass(6, __VA_ARGS__); break;                                                      \
        case 7: head_pass(7, __VA_ARGS__); break;                                                      \
        default: head_pass(8, __VA_ARGS__); break;                                                     \
    }

static inline __attribute__((always_inline)) void attend_blocked(
    const float *restrict q, float *restrict out, int64_t row_stride, const float *restrict key_pool,
    const float *restrict value_pool, const int64_t *restrict tiles, int64_t tiles_per_head, int64_t start,
    int64_t qlen, const int64_t *restrict positions, int kv_heads, int group, const int hd, const int bs,
    float scale, float *restrict scores, float *restrict acc, float *restrict qbuf) {
    if (qlen <= 0) return; /* as in attend_task */
    /* query f of the task: KV head f / nq, its i = f % nq as in attend_task; padded to np */
    const int64_t nq = qlen * group;
    const int64_t nf = nq * kv_heads, np = (nf + QB - 1) / QB * QB;
    const int64_t tile = (int64_t)hd * bs;
    const int64_t ctx = positions[start + qlen - 1] + 1;
    const int64_t nb = (ctx + bs - 1) / bs;
    const int64_t span = nb * bs;
    const int kv = bs / VW, ov = hd / VW; /* vectors in a key block's scores / in a value row */
    const int cw = kv < CW ? kv : CW, cwv = ov < CW ? ov : CW; /* vectors across a head pass */
    /* passes within a KV head where its queries alone keep enough multiply-adds in flight */
    const int by_head = nq * cw >= 8;

    for (int64_t f = 0; f < np; f++) {
        float *dst = qbuf + f * hd;
        if (f < nf) {
            const int64_t h = f / nq, i = f % nq;
            const float *src = q + (start + i / group) * row_stride + (h * group + i % group) * hd;
            for (int d = 0; d < hd; d++) dst[d] = src[d];
        } else
            for (int d = 0; d < hd; d++) dst[d] = 0.f;
    }
    const int64_t ahead = PREFETCH_BYTES / (2 * kv_heads * tile * 4) > 1 ? PREFETCH_BYTES / (2 * kv_heads * tile * 4) : 1;
    for (int64_t b = 0; b < nb && b < ahead; b++)
        prefetch_block(key_pool, value_pool, tiles, tiles_per_head, b, kv_heads, tile);
    for (int64_t b = 0; b < nb; b++) {
        if (b + ahead < nb) prefetch_block(key_pool, value_pool, tiles, tiles_per_head, b + ahead, kv_heads, tile);
        if (by_head) {
            for (int h = 0; h < kv_heads; h++) {
                const float *restrict kt = key_pool + tiles[h * tiles_per_head + b] * tile;
                for (int c = 0; c < kv; c += cw)
                    for (int64_t i0 = 0; i0 < nq; i0 += QH) {
                        const int n = nq - i0 < QH ? nq - i0 : QH;
                        HEAD_PASS(n, cw, qbuf + (h * nq + i0) * hd, hd, kt + c * VW, bs, hd,
                                  scores + (h * nq + i0) * span + b * bs + c * VW, span, 0)
                    }
            }
            continue;
        }
        for (int64_t f0 = 0; f0 < np; f0 += QB) {
            const float *kt[QB];
#pragma GCC unroll 8
            for (int k = 0; k < QB; k++) {
                const int64_t h = f0 + k < nf ? (f0 + k) / nq : 0;
                kt[k] = key_pool + tiles[h * tiles_per_head + b] * tile;
            }
            const float *restrict qi = qbuf + f0 * hd;
            for (int c = 0; c < kv; c++) {
                vf s[QB];
#pragma GCC unroll 8
                for (int k = 0; k < QB; k++) s[k] = (vf){0};
                for (int d = 0; d < hd; d++)
#pragma GCC unroll 8
                    for (int k = 0; k < QB; k++) s[k] += qi[k * hd + d] * loadv(kt[k] + (int64_t)d * bs + c * VW);
#pragma GCC unroll 8
                for (int k = 0; k < QB; k++) storev(scores + (f0 + k) * span + b * bs + c * VW, s[k]);
            }
        }
    }
    /* softmax numerators over each query's visible keys, zero past them; the sums stay for the end */
    for (int64_t f = 0; f < np; f++) {
        float *restrict s = scores + f * span;
        const int64_t n = f < nf ? positions[start + (f % nq) / group] + 1 : 0; /* a pad query: none */
        float m = n ? s[0] : 0.f;
        if (n >= 4 * VW) { /* the maximum in four chains (any order gives the same maximum) */
            vf m4[4] = {loadv(s), loadv(s + VW), loadv(s + 2 * VW), loadv(s + 3 * VW)};
            int64_t j = 4 * VW;
            for (; j + 4 * VW <= n; j += 4 * VW)
                for (int k = 0; k < 4; k++) m4[k] = maxv(m4[k], loadv(s + j + VW * k));
            for (int k = 0; k < 4; k++)
                for (int e = 0; e < VW; e++) m = m4[k][e] > m ? m4[k][e] : m;
            for (; j < n; j++) m = s[j] > m ? s[j] : m;
        } else
            for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
#pragma omp simd simdlen(16)
        for (int64_t j = 0; j < n; j++) s[j] = expf((s[j] - m) * scale);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) sum += s[j];
        for (int64_t j = n; j < span; j++) s[j] = 0.f;
        qbuf[f * hd] = sum;
    }
    for (int64_t i = 0; i < np * hd; i++) acc[i] = 0.f;
    /* queries a pass of the value loop: two vectors of each one's output, in half the registers */
    const int pb = (ov >= 2 ? NREG / 4 : NREG / 2) < QB ? (ov >= 2 ? NREG / 4 : NREG / 2) : QB;
    for (int64_t b = 0; b < nb; b++) {
        if (nb > ahead && b + 1 < nb) /* a long context's first values may have left L2 again */
            for (int h = 0; h < kv_heads; h++) prefetch(value_pool + tiles[h * tiles_per_head + b + 1] * tile, tile * 4);
        if (by_head) {
            for (int h = 0; h < kv_heads; h++) {
                const float *restrict vt = value_pool + tiles[h * tiles_per_head + b] * tile;
                for (int c = 0; c < ov; c += cwv)
                    for (int64_t i0 = 0; i0 < nq; i0 += QH) {
                        const int n = nq - i0 < QH ? nq - i0 : QH;
                        HEAD_PASS(n, cwv, scores + (h * nq + i0) * span + b * bs, span, vt + c * VW, hd, bs,
                                  acc + (h * nq + i0) * hd + c * VW, hd, 1)
                    }
            }
            continue;
        }
        for (int64_t f0 = 0; f0 < np; f0 += pb) {
            const float *vt[QB];
            for (int k = 0; k < pb; k++) {
                const int64_t h = f0 + k < nf ? (f0 + k) / nq : 0;
                vt[k] = value_pool + tiles[h * tiles_per_head + b] * tile;
            }
            const float *restrict p = scores + f0 * span + b * bs;
            for (int c = 0; c < ov; c += 2) { /* two vectors of each query's output at a time */
                const int w = ov - c < 2 ? ov - c : 2;
                float *restrict a = acc + f0 * hd + c * VW;
                vf o[QB][2];
#pragma GCC unroll 8
                for (int k = 0; k < pb; k++)
                    for (int e = 0; e < w; e++) o[k][e] = loadv(a + k * hd + e * VW);
                for (int j = 0; j < bs; j++)
#pragma GCC unroll 8
                    for (int k = 0; k < pb; k++) {
                        const float pk = p[k * span + j];
                        const float *v = vt[k] + (int64_t)j * hd + c * VW;
                        o[k][0] += pk * loadv(v);
                        if (w > 1) o[k][1] += pk * loadv(v + VW);
                    }
#pragma GCC unroll 8
                for (int k = 0; k < pb; k++)
                    for (int e = 0; e < w; e++) storev(a + k * hd + e * VW, o[k][e]);
            }
        }
    }
    for (int64_t f = 0; f < nf; f++) {
        const int64_t h = f / nq, i = f % nq;
        float *restrict dst = out + (start + i / group) * row_stride + (h * group + i % group) * hd;
        const float inv = 1.f / qbuf[f * hd];
        const float *restrict a = acc + f * hd;
#pragma omp simd
        for (int d = 0; d < hd; d++) dst[d] = a[d] * inv;
    }
}

#define SIZED(HD, BS)                                                                                  \
    if (hd == HD && bs == BS) {                                                                        \
        attend_blocked(q, out, row_stride, key_pool, value_pool, tiles, tiles_per_head, start, qlen,    \
                       positions, kv_heads, group, HD, BS, scale, scores, acc, qbuf);                  \
        return;                                                                                        \
    }

/* attend_blocked where hd and bs are common sizes (compile-time constants), else attend_task */
static void attend_sized(const float *q, float *out, int64_t row_stride, const float *key_pool,
                         const float *value_pool, const int64_t *tiles, int64_t tiles_per_head, int64_t start,
                         int64_t qlen, const int64_t *positions, int kv_heads, int group, int hd, int bs,
                         float scale, float *scores, float *acc, float *qbuf) {
    SIZED(32, 16) SIZED(64, 16) SIZED(128, 16) SIZED(32, 32) SIZED(64, 32) SIZED(128, 32)
    attend_task(q, out, row_stride, key_pool, value_pool, tiles, tiles_per_head, start, qlen, positions,
                kv_heads, group, hd, bs, scale, scores, acc, qbuf);
}

/* q, out: [rows, heads * hd] with rows ``row_stride`` floats apart; key_pool, value_pool: one
 * layer's tiles; tiles: [n_req, kv_heads, tiles_per_head]; starts, qlens: [n_req]; positions:
 * [rows]. Returns 0, or -1 when scratch memory was not had. */
int lightspec_paged_attention(const float *q, float *out, int64_t row_stride, const float *key_pool,
                              const float *value_pool, const int64_t *tiles, int64_t tiles_per_head,
                              const int64_t *starts, const int64_t *qlens, int64_t n_req,
                              const int64_t *positions, int heads, int kv_heads, int hd, int bs,
                              float scale) {
    const int group = heads / kv_heads;
    int64_t max_q = 0;
    for (int64_t r = 0; r < n_req; r++) max_q = qlens[r] > max_q ? qlens[r] : max_q;
    const int64_t queries = (max_q * heads + QB - 1) / QB * QB; /* a task's, padded */
    const int64_t scores_len = queries * tiles_per_head * bs;
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * (scores_len + 2 * queries * (int64_t)hd));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 2)
        for (int64_t r = 0; r < n_req; r++) {
            if (!scratch) continue;
            float *acc = scratch + scores_len, *qbuf = acc + queries * hd;
            attend_sized(q, out, row_stride, key_pool, value_pool, tiles + r * kv_heads * tiles_per_head,
                         tiles_per_head, starts[r], qlens[r], positions, kv_heads, group, hd, bs, scale,
                         scratch, acc, qbuf);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
