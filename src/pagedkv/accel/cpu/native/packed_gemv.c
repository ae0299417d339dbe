/* Products of a few rows with a weight in oneDNN's packed layout, read where oneDNN keeps it
 * (see pagedkv/accel/cpu/packed_gemv.py, which checks the layout, builds and calls this file).
 *
 * The layout, for a weight [out, in] (`out` rows, `in` columns) repacked by oneDNN for
 * products of many rows: blocks of BLOCK_OUT outputs by BLOCK_IN inputs, output blocks
 * outermost, each block's input blocks after it, so one block of outputs reads one contiguous
 * run of memory; inside a block, for each group of PAIR consecutive inputs, the BLOCK_OUT
 * outputs' PAIR weights side by side. Float32: 64 outputs by 16 inputs, PAIR 1 ("AB16b64a");
 * bfloat16: 32 or 64 outputs by 32 inputs, PAIR 2 (the pairs a bfloat16 dot product reads;
 * "AB16b32a2b" where the CPU has AMX, "AB16b64a2b" where it has no AMX). Both dimensions are
 * padded with zeros to whole blocks.
 *
 * Why not oneDNN's own kernel: for one to a few rows the product only streams the weight, and
 * oneDNN's reads each weight on one stream per thread. Here each thread reads STREAMS output
 * blocks at once, which the hardware prefetchers follow better: on a two-core AMX Xeon the
 * 0.6B shape's layer weights streamed at 25 GB/s in float32 and 28 GB/s in bfloat16 against
 * oneDNN's 17 and 18 on the same packed tensors. With more rows the product is bound by the
 * multiply-adds instead; the wide entries at the end of the file keep to that rate.
 *
 * Arithmetic: every product summed in float32 (bfloat16 inputs and weights converted exactly,
 * or paired by the CPU's bfloat16 dot product where it has one), the bias added to the sum,
 * the result rounded once to the output dtype (to nearest even for bfloat16). The order of the
 * sum differs from oneDNN's, so float32 results differ from it in the last places.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "inline.h"
/* The bfloat16 dot product's path where the CPU has one, unless built PAGEDKV_PORTABLE (the
 * tests build both paths). */
#if defined(__AVX512BF16__) && !defined(PAGEDKV_PORTABLE)
#define BF16_DOT_PRODUCT 1
#else
#define BF16_DOT_PRODUCT 0
#endif
/* The float32 wide entry's 16-lane path where the CPU has AVX-512, unless built portable. */
#if defined(__AVX512F__) && !defined(PAGEDKV_PORTABLE)
#define WIDE_F32 1
#else
#define WIDE_F32 0
#endif
#if BF16_DOT_PRODUCT || WIDE_F32
#include <immintrin.h>
#endif

/* The most rows one call of gemv_f32, gemv_bf16 or gemv_bf16_o64 takes (the wide entries
 * below take 5 to WIDE_ROWS; the caller sends more to oneDNN). */
#define MAX_ROWS 4
/* Output blocks a thread reads at once. */
#define STREAMS 4
#define F32_OUT 64
#define F32_IN 16
#define BF16_OUT 32
/* The widest bfloat16 output block a layout has ("AB16b64a2b"). */
#define BF16_MAX_OUT 64
#define BF16_IN 32

static inline int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

/* `rows` rows of `in_features` items of `item` bytes, `x_stride` items apart, copied into a
 * new zeroed buffer of rows `padded_in` items apart (the caller frees it); NULL if it cannot
 * be allocated. */
static void *padded_rows(const void *x, int64_t x_stride, int64_t rows, int64_t in_features,
                         int64_t padded_in, size_t item) {
    char *xp = calloc((size_t)(rows * padded_in), item);
    if (xp != NULL)
        for (int64_t r = 0; r < rows; ++r)
            memcpy(xp + (size_t)(r * padded_in) * item,
                   (const char *)x + (size_t)(r * x_stride) * item, item * (size_t)in_features);
    return xp;
}

/* Float32: `count` (<= STREAMS) output blocks from `first`, every row; sums into acc[s][r][o]. */
INLINE void f32_blocks(const float *weight, const float *x, int64_t padded_in, int64_t rows,
                       int64_t first, int count, float acc[STREAMS][MAX_ROWS][F32_OUT]) {
    memset(acc, 0, sizeof(float) * STREAMS * MAX_ROWS * F32_OUT);
    const float *block[STREAMS];
    for (int s = 0; s < count; ++s) block[s] = weight + (first + s) * padded_in * F32_OUT;
    for (int64_t i = 0; i < padded_in; ++i)
        for (int s = 0; s < count; ++s) {
            const float *w = block[s] + i * F32_OUT;
            for (int64_t r = 0; r < rows; ++r) {
                const float xv = x[r * padded_in + i];
                float *a = acc[s][r];
#pragma omp simd
                for (int o = 0; o < F32_OUT; ++o) a[o] += xv * w[o];
            }
        }
}

/* fn(weight, x, padded_in, rows, ...) with the row count `rows` (1..MAX_ROWS) passed as a
 * constant, so that each inlined copy of the block loops keeps its sums in registers rather
 * than in memory between inputs: the 0.6B shape's float32 layer weights at one row streamed
 * at 25 GB/s with the count a variable and 27-28 GB/s so (bfloat16: 24 and 25 GB/s), two
 * threads of a two-core AMX Xeon. */
#define WITH_CONSTANT_ROWS(fn, weight, x, padded_in, rows, ...) \
    WITH_ONE_OF_FOUR(1, 2, 3, MAX_ROWS, fn, weight, x, padded_in, rows, __VA_ARGS__)
_Static_assert(MAX_ROWS == 4, "WITH_CONSTANT_ROWS names the counts 1 to 3, then MAX_ROWS");

/* fn(weight, x, padded_in, rows, ...) with `rows` one of the constants a, b, c, else d. */
#define WITH_ONE_OF_FOUR(a, b, c, d, fn, weight, x, padded_in, rows, ...) \
    switch (rows) {                                                        \
    case a: fn(weight, x, padded_in, a, __VA_ARGS__); break;               \
    case b: fn(weight, x, padded_in, b, __VA_ARGS__); break;               \
    case c: fn(weight, x, padded_in, c, __VA_ARGS__); break;               \
    default: fn(weight, x, padded_in, d, __VA_ARGS__); break;              \
    }

/* out[r, o] = sum_i x[r, i] * weight[o, i] (+ bias[o]), float32; x rows `x_stride` apart,
 * out rows `out_stride` apart. Returns 0, or 1 when rows exceed MAX_ROWS or scratch cannot be
 * allocated (then `out` is unwritten). */
int gemv_f32(const float *weight, const float *x, int64_t x_stride, const float *bias,
             float *out, int64_t out_stride, int64_t rows, int64_t out_features,
             int64_t in_features, int threads) {
    if (rows < 1 || rows > MAX_ROWS) return 1;
    const int64_t padded_in = blocks_of(in_features, F32_IN) * F32_IN;
    const int64_t out_blocks = blocks_of(out_features, F32_OUT);
    float *xp = padded_rows(x, x_stride, rows, in_features, padded_in, sizeof(float));
    if (xp == NULL) return 1;
    const int64_t groups = blocks_of(out_blocks, STREAMS);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; ++g) {
        float acc[STREAMS][MAX_ROWS][F32_OUT];
        const int64_t first = g * STREAMS;
        const int count = (int)(out_blocks - first < STREAMS ? out_blocks - first : STREAMS);
        WITH_CONSTANT_ROWS(f32_blocks, weight, xp, padded_in, rows, first, count, acc)
        for (int s = 0; s < count; ++s) {
            const int64_t base = (first + s) * F32_OUT;
            const int64_t n = out_features - base < F32_OUT ? out_features - base : F32_OUT;
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t o = 0; o < n; ++o)
                    out[r * out_stride + base + o] = acc[s][r][o] + (bias ? bias[base + o] : 0.0f);
        }
    }
    free(xp);
    return 0;
}

/* Bfloat16: `count` output blocks of `block_out` outputs from `first`; acc[s][r][o] holds
 * output o's sum. `x` holds each row's padded inputs, as bfloat16 pairs. */
INLINE void bf16_blocks(const uint16_t *weight, const uint16_t *x, int64_t padded_in,
                        int64_t rows, int block_out, int64_t first, int count,
                        float acc[STREAMS][MAX_ROWS][2 * BF16_MAX_OUT]) {
    const uint16_t *block[STREAMS];
    for (int s = 0; s < count; ++s) block[s] = weight + (first + s) * padded_in * block_out;
#if BF16_DOT_PRODUCT
    /* One dot product of 32 pairs: 16 outputs' sums of two products, into 16 float32 lanes
     * whose even and odd parities are not separated; a block's pairs of one input pair are
     * block_out / 16 such vectors side by side. */
    enum { LANES = 16 };
    const int vectors = block_out / LANES;
    __m512 sums[STREAMS][MAX_ROWS][BF16_MAX_OUT / LANES];
    for (int s = 0; s < STREAMS; ++s)
        for (int r = 0; r < MAX_ROWS; ++r)
            for (int q = 0; q < BF16_MAX_OUT / LANES; ++q) sums[s][r][q] = _mm512_setzero_ps();
    const uint32_t *pairs = (const uint32_t *)x;
    for (int64_t i = 0; i < padded_in / 2; ++i)
        for (int s = 0; s < count; ++s) {
            const uint16_t *w = block[s] + i * 2 * block_out;
            __m512bh wv[BF16_MAX_OUT / LANES];
            for (int q = 0; q < vectors; ++q)
                wv[q] = (__m512bh)_mm512_loadu_si512(w + q * 2 * LANES);
            for (int64_t r = 0; r < rows; ++r) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pairs[r * padded_in / 2 + i]);
                for (int q = 0; q < vectors; ++q)
                    sums[s][r][q] = _mm512_dpbf16_ps(sums[s][r][q], wv[q], xv);
            }
        }
    for (int s = 0; s < count; ++s)
        for (int64_t r = 0; r < rows; ++r)
            for (int q = 0; q < vectors; ++q)
                _mm512_storeu_ps(acc[s][r] + q * LANES, sums[s][r][q]);
#else
    float pair_sums[BF16_MAX_OUT];
    for (int s = 0; s < count; ++s)
        for (int64_t r = 0; r < rows; ++r)
            memset(acc[s][r], 0, sizeof(float) * 2 * (size_t)block_out);
    for (int64_t i = 0; i < padded_in; i += 2)
        for (int s = 0; s < count; ++s) {
            const uint16_t *w = block[s] + i * block_out;
            float wf[2 * BF16_MAX_OUT];
#pragma omp simd
            for (int j = 0; j < 2 * block_out; ++j) wf[j] = from_bf16(w[j]);
            for (int64_t r = 0; r < rows; ++r) {
                const float x0 = from_bf16(x[r * padded_in + i]);
                const float x1 = from_bf16(x[r * padded_in + i + 1]);
                float *a = acc[s][r];
#pragma omp simd
                for (int j = 0; j < 2 * block_out; ++j) a[j] += ((j & 1) ? x1 : x0) * wf[j];
            }
        }
    /* Fold the parities, so acc[..][0..block_out) holds the outputs as in the path above. */
    for (int s = 0; s < count; ++s)
        for (int64_t r = 0; r < rows; ++r) {
            for (int o = 0; o < block_out; ++o)
                pair_sums[o] = acc[s][r][2 * o] + acc[s][r][2 * o + 1];
            memcpy(acc[s][r], pair_sums, sizeof(float) * (size_t)block_out);
        }
#endif
}

/* The bfloat16 form of gemv_f32 for a layout of `block_out`-output blocks (a constant in
 * each caller's inlined copy): bfloat16 x, bias and out, sums in float32. Both layouts read
 * STREAMS blocks at once: on a two-core Zen 4, 64-output blocks read 2 at a time streamed no
 * faster at two to four rows (31 GB/s either way, 113 weights of the 0.6B shape) and slower
 * at one. */
INLINE int gemv_bf16_blocks_of(const uint16_t *weight, const uint16_t *x, int64_t x_stride,
                               const uint16_t *bias, uint16_t *out, int64_t out_stride,
                               int64_t rows, int64_t out_features, int64_t in_features,
                               int threads, int block_out) {
    if (rows < 1 || rows > MAX_ROWS) return 1;
    const int64_t padded_in = blocks_of(in_features, BF16_IN) * BF16_IN;
    const int64_t out_blocks = blocks_of(out_features, block_out);
    uint16_t *xp = padded_rows(x, x_stride, rows, in_features, padded_in, sizeof(uint16_t));
    if (xp == NULL) return 1;
    const int64_t groups = blocks_of(out_blocks, STREAMS);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; ++g) {
        float acc[STREAMS][MAX_ROWS][2 * BF16_MAX_OUT];
        const int64_t first = g * STREAMS;
        const int count = (int)(out_blocks - first < STREAMS ? out_blocks - first : STREAMS);
        WITH_CONSTANT_ROWS(bf16_blocks, weight, xp, padded_in, rows, block_out, first, count, acc)
        for (int s = 0; s < count; ++s) {
            const int64_t base = (first + s) * block_out;
            const int64_t n = out_features - base < block_out ? out_features - base : block_out;
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t o = 0; o < n; ++o) {
                    const float b = bias ? from_bf16(bias[base + o]) : 0.0f;
                    out[r * out_stride + base + o] = to_bf16(acc[s][r][o] + b);
                }
        }
    }
    free(xp);
    return 0;
}

/* Bfloat16 weights in "AB16b32a2b" (32-output blocks: oneDNN's layout where the CPU has AMX). */
int gemv_bf16(const uint16_t *weight, const uint16_t *x, int64_t x_stride, const uint16_t *bias,
              uint16_t *out, int64_t out_stride, int64_t rows, int64_t out_features,
              int64_t in_features, int threads) {
    return gemv_bf16_blocks_of(weight, x, x_stride, bias, out, out_stride, rows, out_features,
                               in_features, threads, BF16_OUT);
}

/* Bfloat16 weights in "AB16b64a2b" (64-output blocks: oneDNN's layout where the CPU has a
 * bfloat16 dot product but no AMX, as AMD's Zen 4). */
int gemv_bf16_o64(const uint16_t *weight, const uint16_t *x, int64_t x_stride,
                  const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t rows,
                  int64_t out_features, int64_t in_features, int threads) {
    return gemv_bf16_blocks_of(weight, x, x_stride, bias, out, out_stride, rows, out_features,
                               in_features, threads, 2 * BF16_OUT);
}

/* Products of 5 to WIDE_ROWS rows with weights in 64-output blocks ("AB16b64a" float32,
 * "AB16b64a2b" bfloat16 where the CPU has the bfloat16 dot product). At eight rows the
 * products are bound by the multiply-adds' rate rather than the memory's, and the sums of every
 * row do not fit in the registers; so each block is read in chunks of 4 KB (CHUNK inputs or
 * input pairs), both halves of the rows in turn (four rows' sums in registers at a time, the
 * second half reading the chunk from the first-level cache), and a thread asks for its next
 * chunk of each stream while it computes this one. Measured on a two-core Zen 4, the 0.6B
 * shape's 113 weights at eight rows, same process: bfloat16 50-57 ms here against 57-69 ms
 * through oneDNN (both halves passed over the whole blocks in turn: 72-79 ms, the second pass
 * reading from memory again); float32 99-111 ms against 105-166 ms. */
#define WIDE_ROWS 8
#define WIDE_OUT 64
#define CHUNK 16

/* fn(..., rows, ...) with the row count `rows` (5..WIDE_ROWS) a constant in each copy. */
#define WITH_CONSTANT_WIDE_ROWS(fn, weight, x, padded_in, rows, ...) \
    WITH_ONE_OF_FOUR(5, 6, 7, WIDE_ROWS, fn, weight, x, padded_in, rows, __VA_ARGS__)
_Static_assert(WIDE_ROWS == 8, "WITH_CONSTANT_WIDE_ROWS names the counts 5 to 7, then WIDE_ROWS");

/* The four vectors of sums of `rows` (<= 4) rows, loaded from and stored back to `sums`
 * ([4 rows][4 vectors][16 lanes]), around the body that adds one chunk into a[r][q]. */
#define WIDE_HALF(BODY)                                                                 \
    __m512 a[4][4];                                                                     \
    for (int r = 0; r < 4; ++r)                                                         \
        for (int q = 0; q < 4; ++q) a[r][q] = _mm512_loadu_ps(sums + (r * 4 + q) * 16); \
    BODY                                                                                \
    for (int r = 0; r < 4; ++r)                                                         \
        for (int q = 0; q < 4; ++q) _mm512_storeu_ps(sums + (r * 4 + q) * 16, a[r][q]);

#if WIDE_F32
INLINE void wide_half_f32(const float *chunk, const float *x, int64_t padded_in, int rows,
                          float *sums) {
    WIDE_HALF(
        for (int i = 0; i < CHUNK; ++i) {
            __m512 wv[4];
            for (int q = 0; q < 4; ++q) wv[q] = _mm512_loadu_ps(chunk + i * WIDE_OUT + q * 16);
            for (int r = 0; r < rows; ++r) {
                const __m512 xv = _mm512_set1_ps(x[r * padded_in + i]);
                for (int q = 0; q < 4; ++q) a[r][q] = _mm512_fmadd_ps(wv[q], xv, a[r][q]);
            }
        })
}
#endif

#if BF16_DOT_PRODUCT
INLINE void wide_half_bf16(const uint16_t *chunk, const uint16_t *x, int64_t padded_in,
                           int rows, float *sums) {
    const uint32_t *pairs = (const uint32_t *)x;
    WIDE_HALF(
        for (int i = 0; i < CHUNK; ++i) {
            __m512bh wv[4];
            for (int q = 0; q < 4; ++q)
                wv[q] = (__m512bh)_mm512_loadu_si512(chunk + 2 * (i * WIDE_OUT + q * 16));
            for (int r = 0; r < rows; ++r) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pairs[r * padded_in / 2 + i]);
                for (int q = 0; q < 4; ++q) a[r][q] = _mm512_dpbf16_ps(a[r][q], wv[q], xv);
            }
        })
}
#endif

/* NAME(weight, x, padded_in, rows, first, count, acc): `count` blocks from `first`, `rows`
 * rows of x (each padded_in wide), summed into acc[s][r][o]; a chunk is CHUNK * PER inputs
 * (PER: inputs stored together, 1 or 2). */
#define DEFINE_WIDE_BLOCKS(NAME, T, HALF, PER)                                                \
    INLINE void NAME(const T *weight, const T *x, int64_t padded_in, int rows, int64_t first, \
                     int count, float acc[STREAMS][WIDE_ROWS][WIDE_OUT]) {                     \
        memset(acc, 0, sizeof(float) * STREAMS * WIDE_ROWS * WIDE_OUT);                       \
        const int64_t step = CHUNK * PER;                                                     \
        for (int64_t c = 0; c < padded_in; c += step)                                         \
            for (int s = 0; s < count; ++s) {                                                 \
                const T *chunk = weight + ((first + s) * padded_in + c) * WIDE_OUT;           \
                for (int64_t k = 0; k < step * WIDE_OUT; k += 64 / (int64_t)sizeof(T))       \
                    __builtin_prefetch(chunk + step * WIDE_OUT + k, 0, 2);                    \
                HALF(chunk, x + c, padded_in, 4, &acc[s][0][0]);                              \
                HALF(chunk, x + 4 * padded_in + c, padded_in, rows - 4, &acc[s][4][0]);       \
            }                                                                                 \
    }

/* NAME: the entry point for rows 5..WIDE_ROWS of T, with IN-input blocks, BLOCKS computing
 * and STORE writing out[...] = acc + bias. */
#define DEFINE_WIDE_PRODUCT(NAME, T, IN, BLOCKS, STORE)                                         \
    int NAME(const T *weight, const T *x, int64_t x_stride, const T *bias, T *out,              \
             int64_t out_stride, int64_t rows, int64_t out_features, int64_t in_features,       \
             int threads) {                                                                     \
        if (rows <= MAX_ROWS || rows > WIDE_ROWS) return 1;                                     \
        const int64_t padded_in = blocks_of(in_features, IN) * IN;                              \
        const int64_t out_blocks = blocks_of(out_features, WIDE_OUT);                           \
        T *xp = padded_rows(x, x_stride, rows, in_features, padded_in, sizeof(T));             \
        if (xp == NULL) return 1;                                                               \
        const int64_t groups = blocks_of(out_blocks, STREAMS);                                  \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                      \
        for (int64_t g = 0; g < groups; ++g) {                                                  \
            float acc[STREAMS][WIDE_ROWS][WIDE_OUT];                                            \
            const int64_t first = g * STREAMS;                                                  \
            const int count = (int)(out_blocks - first < STREAMS ? out_blocks - first : STREAMS); \
            WITH_CONSTANT_WIDE_ROWS(BLOCKS, weight, xp, padded_in, rows, first, count, acc)     \
            for (int s = 0; s < count; ++s) {                                                   \
                const int64_t base = (first + s) * WIDE_OUT;                                    \
                const int64_t n = out_features - base < WIDE_OUT ? out_features - base : WIDE_OUT; \
                for (int64_t r = 0; r < rows; ++r)                                              \
                    for (int64_t o = 0; o < n; ++o)                                             \
                        STORE(out[r * out_stride + base + o], acc[s][r][o], bias, base + o);    \
            }                                                                                   \
        }                                                                                       \
        free(xp);                                                                               \
        return 0;                                                                               \
    }

#define STORE_F32(dst, sum, bias, o) dst = (sum) + ((bias) ? (bias)[o] : 0.0f)
#define STORE_BF16(dst, sum, bias, o) dst = to_bf16((sum) + ((bias) ? from_bf16((bias)[o]) : 0.0f))

/* out[r, o] = sum_i x[r, i] * weight[o, i] (+ bias[o]) for 5 to WIDE_ROWS rows, float32
 * weights in "AB16b64a" (gemv_f32_wide) and bfloat16 ones in "AB16b64a2b"
 * (gemv_bf16_o64_wide), each defined only in a build that has its path, as its *_wide_ready()
 * says (the caller asks it first). Each returns 0, or 1 when rows are out of that range or
 * scratch cannot be allocated (then `out` is unwritten). */
#if WIDE_F32
DEFINE_WIDE_BLOCKS(wide_blocks_f32, float, wide_half_f32, 1)
DEFINE_WIDE_PRODUCT(gemv_f32_wide, float, F32_IN, wide_blocks_f32, STORE_F32)
#endif
int f32_wide_ready(void) { return WIDE_F32; }

#if BF16_DOT_PRODUCT
DEFINE_WIDE_BLOCKS(wide_blocks_bf16, uint16_t, wide_half_bf16, 2)
DEFINE_WIDE_PRODUCT(gemv_bf16_o64_wide, uint16_t, BF16_IN, wide_blocks_bf16, STORE_BF16)
#endif
int bf16_wide_ready(void) { return BF16_DOT_PRODUCT; }
