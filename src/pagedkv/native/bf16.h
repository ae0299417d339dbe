/* bfloat16 <-> float32 for the C kernels (included by name; see pagedkv/native/build.py). A
 * bfloat16 is the top half of a float32; rounding is to nearest even, NaN to the quiet NaN
 * torch makes (c10::BFloat16). */
#ifndef PAGEDKV_BF16_H
#define PAGEDKV_BF16_H

#include <math.h>
#include <stdint.h>

static inline float from_bf16(uint16_t h) {
    union { uint32_t bits; float value; } v = { .bits = (uint32_t)h << 16 };
    return v.value;
}

static inline uint16_t to_bf16(float f) {
    union { float value; uint32_t bits; } v = { .value = f };
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((v.bits + 0x7FFFu + ((v.bits >> 16) & 1u)) >> 16);
}

#endif
