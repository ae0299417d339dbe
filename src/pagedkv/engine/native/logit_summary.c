/* Each row of logits summarised in two passes: its largest value and the first index holding
 * it, then the log of the sum of exp(x - largest) (see pagedkv/engine/logit_summary.py, which
 * builds and calls this file). A greedy row's token is that index, and any token's
 * log-probability is (x[t] - largest) - log_sum, the log-softmax of that one token, without
 * writing the row's. A row of Qwen3's vocabulary is 300 kB in bfloat16, so the second pass
 * reads it from the core's own cache.
 *
 * Shapes: logits [rows, vocab] float32 or bfloat16, rows `stride` elements apart,
 * 1 <= vocab < 2^31; out: largest, log_sum [rows] float32, index [rows] int64. The caller
 * checks all of it. A row holding a NaN gets a NaN largest (its index and log_sum mean
 * nothing): the first pass notes it as it reads, so the caller finds the rows to fail
 * (ENG-070) in the summary instead of a pass of its own over the logits.
 */
#include <math.h>
#include <stdint.h>

#include "fast_exp.h"

static inline float at_float32(const void *row, int64_t i) { return ((const float *)row)[i]; }

static inline float at_bfloat16(const void *row, int64_t i) {
    union { uint32_t bits; float value; } v = { .bits = (uint32_t)((const uint16_t *)row)[i] << 16 };
    return v.value;
}

/* Portable loops, for any CPU. */
#define DEFINE_PORTABLE(NAME, AT)                                                          \
    static void NAME(const void *row, int64_t vocab, float *largest, int64_t *index,     \
                     float *log_sum) {                                                    \
        float most = AT(row, 0);                                                          \
        int64_t first = 0;                                                                \
        int unordered = isnan(most);                                                      \
        for (int64_t i = 1; i < vocab; ++i) {                                             \
            float x = AT(row, i);                                                         \
            unordered |= isnan(x);                                                        \
            if (x > most) {                                                               \
                most = x;                                                                 \
                first = i;                                                                \
            }                                                                             \
        }                                                                                 \
        float total = 0.0f;                                                               \
        for (int64_t i = 0; i < vocab; ++i) total += exp_nonpositive(AT(row, i) - most);  \
        *largest = unordered ? NAN : most;                                                \
        *index = first;                                                                   \
        *log_sum = logf(total);                                                           \
    }
DEFINE_PORTABLE(portable_float32, at_float32)
DEFINE_PORTABLE(portable_bfloat16, at_bfloat16)

typedef void (*row_fn)(const void *, int64_t, float *, int64_t *, float *);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

/* The same, 16 lanes at a time: each lane keeps its own largest value and the first index
 * where it saw it, and the lanes are merged at the end, the smallest index among those
 * holding the row's largest value winning (torch's argmax). */

static inline __m512 load16_float32(const void *row, int64_t i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)row + i);
}

static inline __m512 load16_bfloat16(const void *row, int64_t i, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#define DEFINE_VECTOR(NAME, LOAD)                                                          \
    static void NAME(const void *row, int64_t vocab, float *largest, int64_t *index,     \
                     float *log_sum) {                                                    \
        __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); \
        __mmask16 m0 = vocab >= 16 ? 0xFFFF : (__mmask16)((1u << vocab) - 1);            \
        /* The first 16 positions start every lane (a row of -inf is then position 0's). */ \
        __m512 top = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m0, LOAD(row, 0, m0));  \
        __m512i at = lane;                                                                \
        __mmask16 unordered = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);                 \
        for (int64_t i = 16; i < vocab; i += 16) {                                        \
            __mmask16 m = vocab - i >= 16 ? 0xFFFF : (__mmask16)((1u << (vocab - i)) - 1); \
            __m512 x = LOAD(row, i, m);                                                   \
            unordered |= _mm512_mask_cmp_ps_mask(m, x, x, _CMP_UNORD_Q);                  \
            __mmask16 greater = _mm512_mask_cmp_ps_mask(m, x, top, _CMP_GT_OQ);           \
            top = _mm512_mask_mov_ps(top, greater, x);                                    \
            at = _mm512_mask_mov_epi32(at, greater,                                       \
                                       _mm512_add_epi32(lane, _mm512_set1_epi32((int)i))); \
        }                                                                                 \
        float most = _mm512_reduce_max_ps(top);                                           \
        __mmask16 holders = _mm512_cmp_ps_mask(top, _mm512_set1_ps(most), _CMP_EQ_OQ);    \
        int64_t first = _mm512_mask_reduce_min_epi32(holders, at);                        \
        __m512 shift = _mm512_set1_ps(most), sum = _mm512_setzero_ps();                   \
        for (int64_t i = 0; i < vocab; i += 16) {                                         \
            __mmask16 m = vocab - i >= 16 ? 0xFFFF : (__mmask16)((1u << (vocab - i)) - 1); \
            __m512 e = exp16_nonpositive(_mm512_sub_ps(LOAD(row, i, m), shift));          \
            sum = _mm512_mask_add_ps(sum, m, sum, e);                                     \
        }                                                                                 \
        *largest = unordered ? NAN : most;                                                \
        *index = first;                                                                   \
        *log_sum = logf(_mm512_reduce_add_ps(sum));                                       \
    }
DEFINE_VECTOR(vector_float32, load16_float32)
DEFINE_VECTOR(vector_bfloat16, load16_bfloat16)
#endif

/* The entry point: `bfloat16` nonzero for bfloat16 logits, zero for float32; `portable`
 * nonzero takes the portable loops even where the vector ones are built (for the tests). */
int logit_summary(int bfloat16, int portable, const void *logits, int64_t rows, int64_t vocab,
                  int64_t stride, float *largest, int64_t *index, float *log_sum, int threads) {
    row_fn summarise = bfloat16 ? portable_bfloat16 : portable_float32;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (!portable) summarise = bfloat16 ? vector_bfloat16 : vector_float32;
#else
    (void)portable;
#endif
    const int64_t bytes = bfloat16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; ++r)
        summarise((const char *)logits + r * stride * bytes, vocab, &largest[r], &index[r],
                  &log_sum[r]);
    return 0;
}
