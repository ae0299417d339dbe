/* Products of up to 32 bfloat16 rows with a weight in oneDNN's packed bfloat16 layout, read
 * where oneDNN keeps it, on the CPU's AMX tiles (see pagedkv/accel/cpu/packed_gemv.py, which
 * checks the layout, builds and calls this file; packed_gemv.c describes the layout).
 *
 * The layout is already what a tile multiply reads: a block of 32 outputs by 32 inputs holds,
 * for each of its 16 input pairs, the 32 outputs' two weights side by side, so the block's
 * two 16-output halves are two B tiles of 16 rows of 64 bytes, 128 bytes apart. Each thread
 * takes a run of output blocks; for each block it multiplies the rows' 32 inputs (one or two
 * A tiles of up to 16 rows) by the block's two halves into two or four float32 C tiles, over
 * every input block, asking for the weight PREFETCH_BLOCKS blocks ahead.
 *
 * Why not oneDNN's own kernel: for a few rows the product only streams the weight, and
 * oneDNN's AMX kernel streams it far below the memory's rate at these row counts (see
 * packed_gemv.py for the figures).
 *
 * Arithmetic: every product summed in float32 by the tiles (bfloat16 pairs multiplied
 * exactly), the bias added to the sum, the result rounded once to bfloat16, to nearest even.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* The most rows one call takes: two A tiles of 16. */
#define MAX_ROWS 32
#define BLOCK_OUT 32
#define BLOCK_IN 32
/* Elements of one 32 x 32 block. */
#define BLOCK (BLOCK_OUT * BLOCK_IN)
/* How many input blocks ahead a thread asks for its weight. The 0.6B shape's layer weights
 * at 8 rows, two threads, loaded machine: 11-12 GB/s without, 13-15 with 2, 4 or 8 ahead,
 * 13 with 16 or 32 (with 32 rows: 7.5, 8.5-10.5 and 7.5-8.5 GB/s). */
#define PREFETCH_BLOCKS 4

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(PAGEDKV_PORTABLE)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands a process the AMX register state only when asked (arch_prctl). */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* ldtilecfg's 64-byte operand: palette 1, and each tile's rows and bytes per row. */
struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* 1 if this process may use the tiles (asking Linux for them first), else 0. */
int amx_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* out[o] = to_bf16(sums[o] + bias[o]) for the 32 outputs of a block, 16 lanes at a time. */
static inline void round_row(const float *sums, const float *bias, uint16_t *out) {
    for (int half = 0; half < 2; ++half) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + 16 * half), _mm512_loadu_ps(bias + 16 * half));
        __m512i bits = _mm512_castps_si512(v);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i rounded = _mm512_srli_epi32(
            _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
        _mm256_storeu_si256((__m256i *)(out + 16 * half), _mm512_cvtepi32_epi16(rounded));
    }
}

static inline void prefetch_block(const uint16_t *block) {
    for (int offset = 0; offset < BLOCK * 2; offset += 64)
        __builtin_prefetch((const char *)block + offset, 0, 3);
}

/* Tiles: 0 and 1 the rows' inputs (rows 0-15, 16-31), 2 and 3 the block's output halves,
 * 4 and 5 the sums of rows 0-15, 6 and 7 of rows 16-31. */
static void configure(int64_t rows) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    uint8_t low = (uint8_t)(rows < 16 ? rows : 16), high = (uint8_t)(rows - low);
    uint8_t tile_rows[8] = {low, high, 16, 16, low, low, high, high};
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = tile_rows[t];
        config.bytes_per_row[t] = tile_rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&config);
}

/* One output block's sums into sums[32][32]: `block` its first input block, `x` the rows
 * as tiles (see amx_gemm_bf16). `two` nonzero when there are more than 16 rows. */
static void block_sums(const uint16_t *block, const uint16_t *x, int64_t rows,
                       int64_t in_blocks, int two, float sums[MAX_ROWS][BLOCK_OUT]) {
    _tile_zero(4);
    _tile_zero(5);
    if (two) {
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int64_t i = 0; i < in_blocks; ++i) {
        const uint16_t *w = block + i * BLOCK;
        prefetch_block(w + PREFETCH_BLOCKS * BLOCK);
        _tile_loadd(2, w, 128);
        _tile_loadd(3, w + 32, 128);
        _tile_loadd(0, x + i * rows * BLOCK_IN, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (two) {
            _tile_loadd(1, x + (i * rows + 16) * BLOCK_IN, 64);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, &sums[0][0], BLOCK_OUT * 4);
    _tile_stored(5, &sums[0][16], BLOCK_OUT * 4);
    if (two) {
        _tile_stored(6, &sums[16][0], BLOCK_OUT * 4);
        _tile_stored(7, &sums[16][16], BLOCK_OUT * 4);
    }
}

/* out[r, o] = sum_i x[r, i] * weight[o, i] (+ bias[o]), bfloat16 in and out; x rows
 * `x_stride` apart, out rows `out_stride` apart. Returns 0, or 1 when rows are not in
 * 1..MAX_ROWS or scratch cannot be allocated (then `out` is unwritten). The caller has had
 * amx_ready() return 1. */
int amx_gemm_bf16(const uint16_t *weight, const uint16_t *x, int64_t x_stride,
                  const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t rows,
                  int64_t out_features, int64_t in_features, int threads) {
    if (rows < 1 || rows > MAX_ROWS) return 1;
    const int64_t in_blocks = (in_features + BLOCK_IN - 1) / BLOCK_IN;
    const int64_t padded_in = in_blocks * BLOCK_IN;
    const int64_t out_blocks = (out_features + BLOCK_OUT - 1) / BLOCK_OUT;
    /* The rows as A tiles: for each input block, every row's 32 inputs one after another
     * (64 bytes apart, where rows a power-of-two number of kilobytes apart would share a few
     * cache sets), padded with zeros to whole blocks. */
    uint16_t *xp = calloc((size_t)(rows * padded_in), sizeof(uint16_t));
    if (xp == NULL) return 1;
    for (int64_t i = 0; i < in_blocks; ++i) {
        const int64_t n = in_features - i * BLOCK_IN < BLOCK_IN ? in_features - i * BLOCK_IN : BLOCK_IN;
        for (int64_t r = 0; r < rows; ++r)
            memcpy(xp + (i * rows + r) * BLOCK_IN, x + r * x_stride + i * BLOCK_IN,
                   sizeof(uint16_t) * (size_t)n);
    }
    const int two = rows > 16;
#pragma omp parallel num_threads(threads)
    {
        configure(rows);
        float sums[MAX_ROWS][BLOCK_OUT];
#pragma omp for schedule(static)
        for (int64_t j = 0; j < out_blocks; ++j) {
            block_sums(weight + j * in_blocks * BLOCK, xp, rows, in_blocks, two, sums);
            const int64_t base = j * BLOCK_OUT;
            const int64_t n = out_features - base < BLOCK_OUT ? out_features - base : BLOCK_OUT;
            float b[BLOCK_OUT] = {0};
            if (bias)
                for (int64_t o = 0; o < n; ++o) b[o] = from_bf16(bias[base + o]);
            if (n == BLOCK_OUT)
                for (int64_t r = 0; r < rows; ++r) round_row(sums[r], b, out + r * out_stride + base);
            else
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t o = 0; o < n; ++o)
                        out[r * out_stride + base + o] = to_bf16(sums[r][o] + b[o]);
        }
        _tile_release();
    }
    free(xp);
    return 0;
}
#else
/* Without AMX: never ready, and a call is refused. */
int amx_ready(void) { return 0; }

int amx_gemm_bf16(const uint16_t *weight, const uint16_t *x, int64_t x_stride,
                  const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t rows,
                  int64_t out_features, int64_t in_features, int threads) {
    (void)weight, (void)x, (void)x_stride, (void)bias, (void)out, (void)out_stride;
    (void)rows, (void)out_features, (void)in_features, (void)threads;
    return 1;
}
#endif
