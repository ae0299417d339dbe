/* Paged decode attention: one query row per sequence over its positions where they lie in
 * the pool (see pagedkv/store/native_decode.py, which builds and calls this file).
 *
 * For each sequence, on the OpenMP threads of the calling process (torch's own runtime, which
 * it loaded first under the same name): the scores of each query head against each of the
 * sequence's first `lengths[b]` positions (keys at the slots `kv_index[b, p]`), a softmax in
 * float32, and the weighted sum of the values. Positions at or past `lengths[b]` are never
 * read, so stale slots cannot reach the result. Every key and value row is read once, in its
 * own dtype, and converted to float32 as it is used.
 *
 * Shapes (row-major, contiguous): query [n, heads, dim] float32 or bfloat16; keys and values
 * [slots, kv_heads, dim] of the pool's dtype; kv_index [n, width] int64; lengths [n] int64,
 * each in 1..width; out [n, heads, dim] of the query's dtype. heads is a multiple of
 * kv_heads. The caller checks all of it; this file trusts it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"
#include "inline.h"

/* How many positions ahead a task asks for its next key and value rows. Rows are reached
 * through the slot index, which the hardware prefetcher cannot follow: read on demand, each
 * waits for memory. Measured on a two-core Xeon (AVX-512, torch 2.13), 32 sequences of 150
 * positions with Qwen3-0.6B's heads in a pool larger than the cache, one (sequence, KV head)
 * pair per task: bfloat16 8.5 ms without, 3.5 / 2.7 / 3.1 ms with 4 / 8 / 16 ahead; float32
 * 9.6 ms, 5.0 / 3.5 / 4.5 ms. With a task per sequence (all its KV heads, a 2 KB row per
 * position), on a two-core AMX Xeon, the 0.6B shape's 28 layers at 32 sequences of 130-160
 * positions: 37-40 ms asked 8 ahead into every cache level, 34-36 ms asked 16 ahead into the
 * second level and beyond (the hint below), 35 ms 32 ahead, 36 ms 4 ahead; in the engine's
 * decode step 35.6 -> 32.3 ms in bfloat16, 50.3 -> 47.3 in float32. */
#define AHEAD 16

/* Ask for the `bytes` bytes at `row` to be brought into the second-level cache and beyond
 * (not the first, whose few miss buffers a whole row's requests at once would fill; measured
 * faster above). */
static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64)
        __builtin_prefetch((const char *)row + offset, 0, 2);
}

/* Portable loops, for any head dimension on any CPU: q . key, acc += w * value over `dim`
 * values (`buffer` holds `dim` floats for a converted row), and a row of scores turned into
 * its softmax in place. */

static inline const float *row_float32(const float *row, float *buffer, int64_t dim) {
    (void)buffer;
    (void)dim;
    return row;
}

/* A bfloat16 is the top half of a float32. */
static inline const float *row_bfloat16(const uint16_t *row, float *buffer, int64_t dim) {
    union bits32 { uint32_t bits; float value; } *out = (union bits32 *)buffer;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[d].bits = (uint32_t)row[d] << 16;
    return buffer;
}

#define DEFINE_PORTABLE(SUFFIX, T)                                                           \
    static inline float dot_##SUFFIX(const float *q, const T *key, float *buffer,            \
                                     int64_t dim) {                                         \
        const float *k = row_##SUFFIX(key, buffer, dim);                                    \
        float s = 0.0f;                                                                     \
        _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < dim; ++d) s += q[d] * k[d]; \
        return s;                                                                           \
    }                                                                                       \
    static inline void axpy_##SUFFIX(float *acc, float w, const T *value, float *buffer,    \
                                     int64_t dim) {                                         \
        const float *v = row_##SUFFIX(value, buffer, dim);                                  \
        _Pragma("omp simd") for (int64_t d = 0; d < dim; ++d) acc[d] += w * v[d];           \
    }
DEFINE_PORTABLE(float32, float)
DEFINE_PORTABLE(bfloat16, uint16_t)

static inline void softmax(float *s, int64_t len) {
    float top = s[0], total = 0.0f;
    for (int64_t p = 1; p < len; ++p) top = s[p] > top ? s[p] : top;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < len; ++p) {
        s[p] = exp_nonpositive(s[p] - top);
        total += s[p];
    }
    float inverse = 1.0f / total;
#pragma omp simd
    for (int64_t p = 0; p < len; ++p) s[p] *= inverse;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The same three with AVX-512, the dot product and the sum for head dimensions that are a
 * multiple of 16. The compiler's own reduction above keeps one accumulator, so each dot
 * product waits on a chain of dependent multiply-adds, then sums its lanes through memory,
 * and it leaves exp_nonpositive scalar; here four accumulators run side by side, lanes are
 * summed in registers, rows are converted as they are loaded, and exp runs 16 lanes wide. */

static inline __m512 load16_float32(const float *row) { return _mm512_loadu_ps(row); }

static inline __m512 load16_bfloat16(const uint16_t *row) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)row));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

#define DEFINE_VECTOR(SUFFIX, T)                                                             \
    static inline float dot16_##SUFFIX(const float *q, const T *key, float *buffer,          \
                                       int64_t dim) {                                       \
        (void)buffer;                                                                       \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                         \
        int64_t d = 0;                                                                      \
        for (; d + 64 <= dim; d += 64) {                                                    \
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16_##SUFFIX(key + d), a0);     \
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 16), load16_##SUFFIX(key + d + 16), a1); \
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 32), load16_##SUFFIX(key + d + 32), a2); \
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 48), load16_##SUFFIX(key + d + 48), a3); \
        }                                                                                   \
        for (; d < dim; d += 16)                                                            \
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16_##SUFFIX(key + d), a0);     \
        return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))); \
    }                                                                                       \
    static inline void axpy16_##SUFFIX(float *acc, float w, const T *value, float *buffer,  \
                                       int64_t dim) {                                       \
        (void)buffer;                                                                       \
        __m512 weight = _mm512_set1_ps(w);                                                  \
        for (int64_t d = 0; d < dim; d += 16)                                               \
            _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(weight, load16_##SUFFIX(value + d),   \
                                                      _mm512_loadu_ps(acc + d)));           \
    }
DEFINE_VECTOR(float32, float)
DEFINE_VECTOR(bfloat16, uint16_t)

static inline void softmax16(float *s, int64_t len) {
    __m512 top = _mm512_set1_ps(s[0]);
    int64_t p = 0;
    for (; p + 16 <= len; p += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + p));
    float most = _mm512_reduce_max_ps(top);
    for (; p < len; ++p) most = s[p] > most ? s[p] : most;
    __m512 shift = _mm512_set1_ps(most), sum = _mm512_setzero_ps();
    for (p = 0; p + 16 <= len; p += 16) {
        __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + p), shift));
        _mm512_storeu_ps(s + p, e);
        sum = _mm512_add_ps(sum, e);
    }
    float total = _mm512_reduce_add_ps(sum);
    for (; p < len; ++p) {
        s[p] = exp_nonpositive(s[p] - most);
        total += s[p];
    }
    __m512 inverse = _mm512_set1_ps(1.0f / total);
    for (p = 0; p + 16 <= len; p += 16)
        _mm512_storeu_ps(s + p, _mm512_mul_ps(_mm512_loadu_ps(s + p), inverse));
    for (; p < len; ++p) s[p] *= 1.0f / total;
}
#endif

/* One task: KV heads h0 .. h0 + span - 1 of one sequence. The span's rows of one slot lie side
 * by side, and a page's slots one after another, so a task reads runs of `span * dim` values
 * rather than single rows a slot apart. `query` and `out` point at the span's first query
 * head; `scratch` holds span * group * (len + dim) + dim floats. */
#define DEFINE_TASK(NAME, T, DOT, AXPY, SOFTMAX)                                             \
    static void NAME(const float *query, const void *key_pool, const void *value_pool,      \
                     const int64_t *index, int64_t len, float *out, int64_t h0,             \
                     int64_t span, int64_t kv_heads, int64_t group, int64_t dim,            \
                     float scale, float *scratch) {                                         \
        const T *keys = key_pool, *values = value_pool;                                     \
        int64_t rows = span * group, bytes = span * dim * (int64_t)sizeof(T);               \
        float *scores = scratch, *acc = scratch + rows * len, *buffer = acc + rows * dim;   \
        for (int64_t p = 0; p < len; ++p) {                                                 \
            if (p + AHEAD < len)                                                            \
                prefetch_row(keys + (index[p + AHEAD] * kv_heads + h0) * dim, bytes);       \
            const T *k = keys + (index[p] * kv_heads + h0) * dim;                           \
            for (int64_t r = 0; r < rows; ++r)                                              \
                scores[r * len + p] = DOT(query + r * dim, k + r / group * dim, buffer, dim) * scale; \
        }                                                                                   \
        for (int64_t r = 0; r < rows; ++r) SOFTMAX(scores + r * len, len);                  \
        memset(acc, 0, sizeof(float) * (size_t)(rows * dim));                               \
        for (int64_t p = 0; p < len; ++p) {                                                 \
            if (p + AHEAD < len)                                                            \
                prefetch_row(values + (index[p + AHEAD] * kv_heads + h0) * dim, bytes);     \
            const T *v = values + (index[p] * kv_heads + h0) * dim;                         \
            for (int64_t r = 0; r < rows; ++r)                                              \
                AXPY(acc + r * dim, scores[r * len + p], v + r / group * dim, buffer, dim); \
        }                                                                                   \
        memcpy(out, acc, sizeof(float) * (size_t)(rows * dim));                             \
    }

#if defined(__AVX512F__)
/* The most 16-lane chunks of a head the register-blocked task below holds in registers (head
 * dimensions up to 128, Qwen3's). */
#define MAX_CHUNKS 8

/* The same task for a head of `chunks` 16-lane chunks (a constant in each copy), each row
 * held in registers. Scores: every position's key row of one KV head is loaded and converted
 * once for all its `group` query heads (above, once per query head). Sums: the weighted values
 * of `2` or `4` query heads accumulate in registers over all positions, one KV head at a time,
 * instead of being loaded and stored at every position. Each sum is formed in the same order,
 * from the same operations, as by dot16 and axpy16, so the results are bit for bit those of
 * the task above. The first pass over a KV head's values asks for the span's rows ahead; the
 * later ones find them in the cache. */
#define DEFINE_BLOCKED(SUFFIX, T)                                                            \
    INLINE void blocked_##SUFFIX(const float *query, const T *keys, const T *values,         \
                                 const int64_t *index, int64_t len, float *out, int64_t h0,  \
                                 int64_t span, int64_t kv_heads, int64_t group, float scale, \
                                 float *scores, const int chunks) {                         \
        const int64_t dim = 16 * (int64_t)chunks, bytes = span * dim * (int64_t)sizeof(T);  \
        const int per_pass = chunks > 4 ? 2 : 4, full = chunks / 4 * 4;                     \
        for (int64_t p = 0; p < len; ++p) {                                                 \
            if (p + AHEAD < len)                                                            \
                prefetch_row(keys + (index[p + AHEAD] * kv_heads + h0) * dim, bytes);       \
            const T *k = keys + (index[p] * kv_heads + h0) * dim;                           \
            for (int64_t hk = 0; hk < span; ++hk) {                                         \
                __m512 key[MAX_CHUNKS];                                                     \
                for (int c = 0; c < chunks; ++c) key[c] = load16_##SUFFIX(k + hk * dim + 16 * c); \
                for (int64_t g = 0; g < group; ++g) {                                       \
                    const float *q = query + (hk * group + g) * dim;                        \
                    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(),                \
                                   _mm512_setzero_ps(), _mm512_setzero_ps()};               \
                    for (int c = 0; c < full; ++c)                                          \
                        a[c % 4] = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), key[c], a[c % 4]); \
                    for (int c = full; c < chunks; ++c)                                     \
                        a[0] = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), key[c], a[0]);  \
                    __m512 sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])); \
                    scores[(hk * group + g) * len + p] = _mm512_reduce_add_ps(sum) * scale; \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int64_t r = 0; r < span * group; ++r) softmax16(scores + r * len, len);        \
        for (int64_t hk = 0; hk < span; ++hk) {                                             \
            for (int64_t g0 = 0; g0 < group; g0 += per_pass) {                              \
                int64_t rows = group - g0 < per_pass ? group - g0 : per_pass;               \
                int first_pass = hk == 0 && g0 == 0;                                        \
                const float *w = scores + (hk * group + g0) * len;                          \
                __m512 acc[4][MAX_CHUNKS];                                                  \
                for (int i = 0; i < per_pass; ++i)                                          \
                    for (int c = 0; c < chunks; ++c) acc[i][c] = _mm512_setzero_ps();       \
                for (int64_t p = 0; p < len; ++p) {                                         \
                    if (first_pass && p + AHEAD < len)                                      \
                        prefetch_row(values + (index[p + AHEAD] * kv_heads + h0) * dim, bytes); \
                    const T *v = values + (index[p] * kv_heads + h0 + hk) * dim;            \
                    __m512 value[MAX_CHUNKS];                                               \
                    for (int c = 0; c < chunks; ++c) value[c] = load16_##SUFFIX(v + 16 * c); \
                    for (int i = 0; i < per_pass; ++i) {                                    \
                        if (i >= rows) break;                                               \
                        __m512 weight = _mm512_set1_ps(w[i * len + p]);                     \
                        for (int c = 0; c < chunks; ++c)                                    \
                            acc[i][c] = _mm512_fmadd_ps(weight, value[c], acc[i][c]);       \
                    }                                                                       \
                }                                                                           \
                for (int64_t i = 0; i < rows; ++i)                                          \
                    for (int c = 0; c < chunks; ++c)                                        \
                        _mm512_storeu_ps(out + (hk * group + g0 + i) * dim + 16 * c, acc[i][c]); \
            }                                                                               \
        }                                                                                   \
    }
DEFINE_BLOCKED(float32, float)
DEFINE_BLOCKED(bfloat16, uint16_t)

/* One task function per dtype and chunk count, in the shape of the tasks above (`scratch`
 * starts with the scores). */
#define DEFINE_BLOCKED_TASK(SUFFIX, T, CHUNKS)                                               \
    static void blocked##CHUNKS##_##SUFFIX(const float *query, const void *key_pool,         \
                                           const void *value_pool, const int64_t *index,    \
                                           int64_t len, float *out, int64_t h0, int64_t span, \
                                           int64_t kv_heads, int64_t group, int64_t dim,     \
                                           float scale, float *scratch) {                   \
        (void)dim;                                                                          \
        blocked_##SUFFIX(query, key_pool, value_pool, index, len, out, h0, span, kv_heads,  \
                         group, scale, scratch, CHUNKS);                                    \
    }
#define DEFINE_BLOCKED_TASKS(SUFFIX, T)                                                      \
    DEFINE_BLOCKED_TASK(SUFFIX, T, 1) DEFINE_BLOCKED_TASK(SUFFIX, T, 2)                      \
    DEFINE_BLOCKED_TASK(SUFFIX, T, 3) DEFINE_BLOCKED_TASK(SUFFIX, T, 4)                      \
    DEFINE_BLOCKED_TASK(SUFFIX, T, 5) DEFINE_BLOCKED_TASK(SUFFIX, T, 6)                      \
    DEFINE_BLOCKED_TASK(SUFFIX, T, 7) DEFINE_BLOCKED_TASK(SUFFIX, T, 8)
DEFINE_BLOCKED_TASKS(float32, float)
DEFINE_BLOCKED_TASKS(bfloat16, uint16_t)
#endif

typedef void (*task_fn)(const float *, const void *, const void *, const int64_t *, int64_t,
                        float *, int64_t, int64_t, int64_t, int64_t, int64_t, float, float *);

DEFINE_TASK(task_float32, float, dot_float32, axpy_float32, softmax)
DEFINE_TASK(task_bfloat16, uint16_t, dot_bfloat16, axpy_bfloat16, softmax)
#if defined(__AVX512F__)
DEFINE_TASK(task16_float32, float, dot16_float32, axpy16_float32, softmax16)
DEFINE_TASK(task16_bfloat16, uint16_t, dot16_bfloat16, axpy16_bfloat16, softmax16)
#endif

/* The whole group, shared out over `threads` threads as tasks of `span` KV heads: all of a
 * sequence's heads where there are sequences enough to keep every thread busy (four tasks
 * per thread), fewer where not. Returns 0, or 1 if a scratch buffer could not be allocated
 * (then `out` is incomplete). */
static int decode(task_fn task, int query_bfloat16, const void *query, const void *keys,
                  const void *values, const int64_t *kv_index, const int64_t *lengths,
                  void *out, int64_t num_seqs, int64_t width, int64_t heads, int64_t kv_heads,
                  int64_t dim, float scale, int threads) {
    int64_t group = heads / kv_heads, span = kv_heads;
    while (span % 2 == 0 && num_seqs * (kv_heads / span) < 4 * (int64_t)threads) span /= 2;
    int64_t parts = kv_heads / span;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads) reduction(| : failed)
    for (int64_t b = 0; b < num_seqs; ++b) {
        for (int64_t part = 0; part < parts; ++part) {
            int64_t len = lengths[b], h0 = part * span, rows = span * group;
            int64_t task_floats = rows * (len + dim) + dim;
            int64_t io_floats = query_bfloat16 ? 2 * rows * dim : 0;
            float *scratch = malloc(sizeof(float) * (size_t)(task_floats + io_floats));
            if (scratch == NULL) {
                failed = 1;
                continue;
            }
            int64_t first = (b * heads + h0 * group) * dim;
            const float *q = (const float *)query + first;
            float *o = (float *)out + first;
            if (query_bfloat16) {
                /* The span's query rows converted exactly, its result rounded once at the end:
                 * bit for bit what converting the whole query and result around the call
                 * gives, without two more passes over them. */
                float *q32 = scratch + task_floats;
                const uint16_t *q16 = (const uint16_t *)query + first;
                for (int64_t i = 0; i < rows * dim; ++i) q32[i] = from_bf16(q16[i]);
                q = q32;
                o = q32 + rows * dim;
            }
            task(q, keys, values, kv_index + b * width, len, o, h0, span, kv_heads, group, dim,
                 scale, scratch);
            if (query_bfloat16) {
                uint16_t *o16 = (uint16_t *)out + first;
                for (int64_t i = 0; i < rows * dim; ++i) o16[i] = to_bf16(o[i]);
            }
            free(scratch);
        }
    }
    return failed;
}

/* The entry point: `bfloat16` nonzero for a bfloat16 pool, zero for a float32 one;
 * `query_bfloat16` nonzero for a bfloat16 query and result, zero for float32 ones. */
int paged_decode(int bfloat16, int query_bfloat16, const void *query, const void *keys,
                 const void *values, const int64_t *kv_index, const int64_t *lengths, void *out,
                 int64_t num_seqs, int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                 float scale, int threads) {
    task_fn task = bfloat16 ? task_bfloat16 : task_float32;
#if defined(__AVX512F__)
    static const task_fn blocked[2][MAX_CHUNKS] = {
        {blocked1_float32, blocked2_float32, blocked3_float32, blocked4_float32,
         blocked5_float32, blocked6_float32, blocked7_float32, blocked8_float32},
        {blocked1_bfloat16, blocked2_bfloat16, blocked3_bfloat16, blocked4_bfloat16,
         blocked5_bfloat16, blocked6_bfloat16, blocked7_bfloat16, blocked8_bfloat16}};
    if (dim % 16 == 0) task = bfloat16 ? task16_bfloat16 : task16_float32;
    if (dim % 16 == 0 && dim <= 16 * MAX_CHUNKS) task = blocked[bfloat16 != 0][dim / 16 - 1];
#endif
    return decode(task, query_bfloat16, query, keys, values, kv_index, lengths, out, num_seqs,
                  width, heads, kv_heads, dim, scale, threads);
}
