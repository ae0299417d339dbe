/* exp(x) for x <= 0, in float32, for the softmax sums of the C kernels (included by name; see
 * pagedkv/native/build.py). Relative error below 2e-7: 2^n * 2^f with |f| <= 1/2, 2^f by its
 * Taylor series to degree 8. Below -87 the result is that of -87 (about 1.6e-38), so a sum
 * never meets a denormal. exp16_nonpositive takes the same steps 16 lanes at a time, and so
 * gives the same values. */
#ifndef PAGEDKV_FAST_EXP_H
#define PAGEDKV_FAST_EXP_H

#include <stdint.h>

static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float y = x * 1.44269504088896341f;
    int32_t n = (int32_t)(y - 0.5f); /* y <= 0: rounds to nearest */
    float f = (y - (float)n) * 0.693147180559945309f;
    float p = 1.0f + f * (1.0f + f * (1.0f / 2 + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120
              + f * (1.0f / 720 + f * (1.0f / 5040 + f * (1.0f / 40320))))))));
    union { int32_t bits; float value; } scale = { .bits = (n + 127) << 23 };
    return p * scale.value;
}

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512i n = _mm512_cvttps_epi32(_mm512_sub_ps(y, _mm512_set1_ps(0.5f)));
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, _mm512_cvtepi32_ps(n)),
                             _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 40320);
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0f / 5040));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0f / 2));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#endif
