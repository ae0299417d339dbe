/* The SwiGLU activation `silu(gate) * up` of a merged gate/up product in one pass over its
 * rows (see pagedkv/accel/cpu/fused_swiglu.py, which builds and calls this file).
 *
 * The arithmetic is torch's, operation for operation: `silu(g) = g / (1 + exp(-g))` in
 * float32, rounded to the dtype; the product with `up` in float32, rounded to the dtype. The
 * one difference is exp itself: torch takes SLEEF's (within one unit in the last place), this
 * file the Cephes polynomial below (the same bound), so a float32 result may differ from
 * torch's by a unit or two in the last place and a bfloat16 one, where that lands on a
 * rounding boundary, by one bfloat16 step. Built with -ffp-contract=off, so no product is
 * fused into a sum except the ones written as such.
 *
 * A row is `2 * width` elements, gate then up, `stride` elements apart (a row of the
 * product); the output is contiguous, `width` a row. Float32 or bfloat16 throughout
 * (`bf16` nonzero). The caller checks shapes; this file trusts them.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "inline.h"

/* Rows below which a call runs on the calling thread alone: a decode step's few rows cost
 * less than waking the other threads. */
#define PARALLEL_ROWS 64

/* The range exp_any computes: above EXP_MAX (just under log(FLT_MAX)) exp overflows; EXP_MIN
 * keeps 2^n within the exponent's range, and far below it (under -17) 1 + exp is 1 already. */
#define EXP_MIN (-88.0f)
#define EXP_MAX 88.72283f

/* exp(t) in float32 for any t: t = n ln2 + f, |f| <= ln2 / 2, ln2 in two parts so that f is
 * exact; exp(f) by Cephes' polynomial; 2^n put into the exponent in two halves, so that n up
 * to 128 does not overflow the bits. Above EXP_MAX the result is infinite; below EXP_MIN it
 * is exp(EXP_MIN), for NaN some number: only `1 + exp(t)` is ever used, which is 1 there as
 * for the true value, and the silu of NaN is NaN by its numerator. */
INLINE float exp_any(float t) {
    const float clamped = fminf(fmaxf(t, EXP_MIN), EXP_MAX);
    const float n = floorf(clamped * 1.44269504088896341f + 0.5f);
    float f = clamped - n * 0.693359375f;
    f = f - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * (f * f) + f + 1.0f;
    const int32_t half = (int32_t)n >> 1;
    union { int32_t bits; float value; } a = { .bits = (half + 127) << 23 };
    union { int32_t bits; float value; } b = { .bits = ((int32_t)n - half + 127) << 23 };
    const float e = p * a.value * b.value;
    return t > EXP_MAX ? INFINITY : e;
}

/* silu(g) * u of one element, each rounded to the dtype (identity for float32). */
INLINE float round_to(float f, int bf16) { return bf16 ? from_bf16(to_bf16(f)) : f; }
INLINE float swiglu_of(float g, float u, int bf16) {
    return round_to(g / (1.0f + exp_any(-g)), bf16) * u;
}

/* The 16-lane path where the CPU has AVX-512, unless built PAGEDKV_PORTABLE (the tests build
 * both paths): the scalar steps above, lane by lane, so both give the same bits. */
#if defined(__AVX512F__) && !defined(PAGEDKV_PORTABLE)
#define LANES16 1
#include <immintrin.h>

static inline __m512 exp16_any(__m512 t) {
    const __m512 clamped = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(EXP_MIN)),
                                         _mm512_set1_ps(EXP_MAX));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_add_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                      _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(clamped, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    f = _mm512_sub_ps(f, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    static const float coefficients[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                         1.6666665459e-1f, 5.0000001201e-1f};
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    for (int c = 0; c < 5; ++c)
        p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(coefficients[c]));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(f, f)), f),
                      _mm512_set1_ps(1.0f));
    const __m512i whole = _mm512_cvtps_epi32(n);
    const __m512i half = _mm512_srai_epi32(whole, 1);
    const __m512i bias = _mm512_set1_epi32(127);
    const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, bias), 23));
    const __m512 b = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(whole, half), bias), 23));
    const __m512 e = _mm512_mul_ps(_mm512_mul_ps(p, a), b);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, _mm512_set1_ps(EXP_MAX), _CMP_GT_OQ), e,
                                _mm512_set1_ps(INFINITY));
}

static inline __m512 round16_to_bf16(__m512 x);

/* silu(g) * u of 16 lanes, as swiglu_of. */
static inline __m512 swiglu16(__m512 g, __m512 u, int bf16) {
    __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                 exp16_any(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    if (bf16) silu = round16_to_bf16(silu);
    return _mm512_mul_ps(silu, u);
}

/* to_bf16 of 16 lanes (nearest even, NaN to 0x7FC0), each in the top half of its lane. */
static inline __m512i bf16_bits16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
    const __m512i top = _mm512_and_si512(rounded, _mm512_set1_epi32((int32_t)0xFFFF0000u));
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), top,
                                   _mm512_set1_epi32(0x7FC00000));
}
static inline __m512 round16_to_bf16(__m512 x) { return _mm512_castsi512_ps(bf16_bits16(x)); }
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void store16_bf16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits16(x), 16)));
}
#else
#define LANES16 0
#endif

/* One row of each dtype: `width` gates and `width` ups into `width` outputs; 16 lanes at a
 * time where the build has them, the rest one by one. */
static void swiglu_row_f32(const float *gate, const float *up, float *out, int64_t width) {
    int64_t j = 0;
#if LANES16
    for (; j + 16 <= width; j += 16)
        _mm512_storeu_ps(out + j, swiglu16(_mm512_loadu_ps(gate + j), _mm512_loadu_ps(up + j), 0));
#endif
    for (; j < width; ++j) out[j] = swiglu_of(gate[j], up[j], 0);
}
static void swiglu_row_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out,
                            int64_t width) {
    int64_t j = 0;
#if LANES16
    for (; j + 16 <= width; j += 16)
        store16_bf16(out + j, swiglu16(load16_bf16(gate + j), load16_bf16(up + j), 1));
#endif
    for (; j < width; ++j) out[j] = to_bf16(swiglu_of(from_bf16(gate[j]), from_bf16(up[j]), 1));
}

/* out[r, j] = silu(gate_up[r, j]) * gate_up[r, width + j] for `rows` rows `stride` elements
 * apart, float32 (`bf16` 0) or bfloat16. */
void swiglu(int bf16, const void *gate_up, int64_t stride, void *out, int64_t rows,
           int64_t width, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        if (bf16) {
            const uint16_t *row = (const uint16_t *)gate_up + r * stride;
            swiglu_row_bf16(row, row + width, (uint16_t *)out + r * width, width);
        } else {
            const float *row = (const float *)gate_up + r * stride;
            swiglu_row_f32(row, row + width, (float *)out + r * width, width);
        }
    }
}
