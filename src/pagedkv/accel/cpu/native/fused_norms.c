/* RMSNorm with the residual add before it, and RMSNorm with the RoPE rotation after it, each
 * one pass over its rows (see pagedkv/accel/cpu/fused_norms.py, which builds and calls this file).
 *
 * The arithmetic is transformers' Qwen3, operation for operation, in the same order and with
 * the same roundings: the sum `x + residual` rounded to the dtype; the mean of the squares in
 * float32 (the one difference: the order of that sum's terms); `x * rsqrt(mean + eps)` in
 * float32, rounded to the dtype; times the weight, rounded; then, for the rotation,
 * `x * cos` and `rotate_half(x) * sin` each rounded, and their sum rounded. Built with
 * -ffp-contract=off, so no product is fused into a sum: every rounding is the one torch makes.
 *
 * Rows are `dim` contiguous elements, `stride` elements apart (a head of a fused q/k/v
 * product); outputs are contiguous. Float32 or bfloat16 throughout (`bfloat16` nonzero),
 * weights and RoPE tables in the same dtype. The caller checks shapes; this file trusts them.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"
#include "inline.h"

/* Rows below which a call runs on the calling thread alone: a decode step's few rows cost
 * less than waking the other threads. */
#define PARALLEL_ROWS 64

/* Every loop below is written for the compiler to vectorize: the dtype is a constant in each
 * inlined copy (the entry points branch on it once), loops have no branches, and the sum of
 * squares is an `omp simd` reduction (the one reordering the arithmetic allows). Measured on
 * a two-core AMX Xeon, both threads, a 512-token step of the 0.6B shape, bfloat16, against
 * scalar loops of the same arithmetic that tested the dtype per element: add_rms_norm of
 * [512, 1024] 289 -> 145 us, the query heads' norm and rotation [512, 16, 128] 712 -> 430 us
 * (float32: 318 -> 150, 564 -> 260). */

/* Element i of a row of the dtype as float32, a float32 rounded to the dtype (identity for
 * float32), and a float32 stored in the dtype. */
INLINE float load(const void *base, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}
INLINE float round_to(float f, int bf16) { return bf16 ? from_bf16(to_bf16(f)) : f; }
INLINE void store(void *base, int64_t i, float f, int bf16) {
    if (bf16)
        ((uint16_t *)base)[i] = to_bf16(f);
    else
        ((float *)base)[i] = f;
}

/* `row` (float32, already rounded to the dtype) normalised and scaled in place. */
INLINE void normalise(float *row, const void *weight, int64_t dim, float eps, int bf16) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t d = 0; d < dim; ++d) total += row[d] * row[d];
    float inverse = 1.0f / sqrtf(total / (float)dim + eps);
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d)
        row[d] = round_to(load(weight, d, bf16) * round_to(row[d] * inverse, bf16), bf16);
}

INLINE void add_rms_norm_rows(const void *x, const void *residual, void *sum_out, void *out,
                              const void *weight, int64_t rows, int64_t dim, float eps,
                              int threads, int bf16) {
#pragma omp parallel for num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        float row[16384];
        int64_t first = r * dim;
        if (residual != NULL) {
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) {
                float v = round_to(load(x, first + d, bf16) + load(residual, first + d, bf16), bf16);
                store(sum_out, first + d, v, bf16);
                row[d] = v;
            }
        } else {
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) row[d] = load(x, first + d, bf16);
        }
        normalise(row, weight, dim, eps, bf16);
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) store(out, first + d, row[d], bf16);
    }
}

/* out = norm(x + residual) and sum_out = x + residual, or out = norm(x) when `residual` is
 * NULL (then `sum_out` is unused); x, residual and sum_out [rows, dim] contiguous. Returns 0,
 * or 1 when `dim` exceeds the row buffer. */
int add_rms_norm(int bf16, const void *x, const void *residual, void *sum_out, void *out,
                 const void *weight, int64_t rows, int64_t dim, float eps, int threads) {
    if (dim > 16384) return 1;
    if (bf16)
        add_rms_norm_rows(x, residual, sum_out, out, weight, rows, dim, eps, threads, 1);
    else
        add_rms_norm_rows(x, residual, sum_out, out, weight, rows, dim, eps, threads, 0);
    return 0;
}

/* out = x * cos + rotated * sin over `n` elements, each product rounded, then the sum. */
INLINE void rotate_part(const float *x, const float *rotated, float sign, const void *cos,
                        const void *sin, int64_t table, void *out, int64_t first, int64_t n,
                        int bf16) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) {
        float a = round_to(x[d] * load(cos, table + d, bf16), bf16);
        float b = round_to(sign * rotated[d] * load(sin, table + d, bf16), bf16);
        store(out, first + d, a + b, bf16);
    }
}

INLINE void rms_norm_rope_rows(const void *x, void *out, const void *weight, const void *cos,
                               const void *sin, int64_t tokens, int64_t heads, int64_t dim,
                               int64_t stride, float eps, int threads, int bf16) {
    int64_t half = dim / 2;
#pragma omp parallel for collapse(2) num_threads(threads) if (tokens * heads >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
            float row[1024];
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) row[d] = load(x, t * stride + h * dim + d, bf16);
            normalise(row, weight, dim, eps, bf16);
            int64_t first = (t * heads + h) * dim;
            /* rotate_half: the first half pairs with the negated second, the second with the
             * first (negation is exact, so the sign may multiply first). */
            rotate_part(row, row + half, -1.0f, cos, sin, t * dim, out, first, half, bf16);
            rotate_part(row + half, row, 1.0f, cos, sin, t * dim + half, out, first + half, half,
                        bf16);
        }
    }
}

/* out[t, h] = rotate(norm(x[t, h]), cos[t], sin[t]) for `tokens` x `heads` rows of `dim`
 * (even), row (t, h) at x + t * stride + h * dim; cos and sin [tokens, dim] contiguous, out
 * [tokens, heads, dim] contiguous. Returns 0, or 1 when `dim` exceeds the row buffer. */
int rms_norm_rope(int bf16, const void *x, void *out, const void *weight, const void *cos,
                  const void *sin, int64_t tokens, int64_t heads, int64_t dim, int64_t stride,
                  float eps, int threads) {
    if (dim > 1024) return 1;
    if (bf16)
        rms_norm_rope_rows(x, out, weight, cos, sin, tokens, heads, dim, stride, eps, threads, 1);
    else
        rms_norm_rope_rows(x, out, weight, cos, sin, tokens, heads, dim, stride, eps, threads, 0);
    return 0;
}
