/* A function inlined into every caller, so that arguments a caller passes as constants (a
 * dtype flag, a row count) are constants in its copy and the compiler specialises the loops
 * for them (included by name; see pagedkv/native/build.py). */
#ifndef PAGEDKV_INLINE_H
#define PAGEDKV_INLINE_H

#define INLINE static inline __attribute__((always_inline))

#endif
