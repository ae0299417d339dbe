/* Every decoder layer of a decode step in one call (see pagedkv/accel/cpu/decode_layers.py, which
 * builds and calls this file). Each layer makes the calls the model's modules make, in their
 * order and on buffers of their shapes: the fused norms, the packed products, the SwiGLU
 * activation and the paged decode attention, each reached through the entry point of its own
 * library that the caller passes. So the result is the modules' to the bit, without the ten
 * Python calls a layer that cost a decode step more than its norms and attention together.
 *
 * Per layer, for `rows` decoding sequences of one row each (shapes in elements of the model's
 * dtype, float32 or bfloat16):
 *   input norm      normed = norm(hidden + residual), the sum kept as the next residual (the
 *                   first layer: normed = norm(hidden), whose residual is hidden itself)
 *   qkv product     qkv [rows, (heads + 2 kv_heads) dim] = normed W_qkv^T
 *   q and k norms   q [rows, heads, dim], k [rows, kv_heads, dim]: each head of qkv's q and k
 *                   parts normalised and rotated by cos, sin [rows, dim]
 *   K/V write       k and qkv's v part copied to the layer's pools at the step's slots
 *   attention       attended [rows, heads, dim] over each sequence's kv_index[b, :lengths[b]]
 *   o product       o [rows, hidden]
 *   post norm       normed = norm(o + residual), the sum the new residual
 *   MLP             gate_up [rows, 2 intermediate], act = silu(gate) * up, hidden = act W_down^T
 * The step ends with the last layer's output in `hidden` and its residual in `residual`.
 */
#include <stdint.h>
#include <string.h>

typedef int (*product_fn)(const void *weight, const void *x, int64_t x_stride, const void *bias,
                          void *out, int64_t out_stride, int64_t rows, int64_t out_features,
                          int64_t in_features, int threads);
typedef int (*add_rms_norm_fn)(int bf16, const void *x, const void *residual, void *sum_out,
                               void *out, const void *weight, int64_t rows, int64_t dim,
                               float eps, int threads);
typedef int (*rms_norm_rope_fn)(int bf16, const void *x, void *out, const void *weight,
                                const void *cos, const void *sin, int64_t tokens, int64_t heads,
                                int64_t dim, int64_t stride, float eps, int threads);
typedef void (*swiglu_fn)(int bf16, const void *gate_up, int64_t stride, void *out,
                          int64_t rows, int64_t width, int threads);
typedef int (*decode_fn)(int bfloat16, int query_bfloat16, const void *query, const void *keys,
                         const void *values, const int64_t *kv_index, const int64_t *lengths,
                         void *out, int64_t num_seqs, int64_t width, int64_t heads,
                         int64_t kv_heads, int64_t dim, float scale, int threads);

/* What every layer shares: the kernels and the model's shape. */
struct model {
    add_rms_norm_fn add_rms_norm;
    rms_norm_rope_fn rms_norm_rope;
    swiglu_fn swiglu;
    decode_fn decode;
    int64_t bf16, hidden, heads, kv_heads, dim, intermediate;
    float eps, scale;
};

/* One layer: its norms' weights, its packed weights with the product entry point for this
 * step's row count, and its K/V pools [slots, kv_heads, dim]. */
struct layer {
    const void *input_norm, *post_norm, *q_norm, *k_norm;
    const void *qkv, *o, *gate_up, *down;
    product_fn qkv_product, o_product, gate_up_product, down_product;
    void *keys, *values;
};

/* The step: its rows' slots, attention indices and lengths, rotation tables, and buffers. */
struct step {
    int64_t rows, width;
    const int64_t *slots, *kv_index, *lengths;
    const void *cos, *sin;
    void *hidden, *residual, *spare, *normed, *qkv, *q, *k, *attended, *o, *gate_up, *act;
};

/* Runs `count` layers; returns 0, or the number (from 1) of the layer whose kernel failed. */
int decode_layers(const struct model *m, const struct layer *layers, int64_t count,
                  const struct step *s, int threads) {
    const int64_t es = m->bf16 ? 2 : 4, rows = s->rows, hidden = m->hidden;
    const int64_t q_width = m->heads * m->dim, kv_width = m->kv_heads * m->dim;
    const int64_t qkv_width = q_width + 2 * kv_width, gate_up_width = 2 * m->intermediate;
    const int bf16 = (int)m->bf16;
    for (int64_t l = 0; l < count; ++l) {
        const struct layer *y = &layers[l];
        int failed = 0;
        /* The residual stream before attention: the embeddings in the first layer, then the
         * sum of the last layer's output and its residual, kept in `spare`; the sum after
         * attention goes to `residual`, which the next layer's sum reads. */
        const void *stream = s->hidden;
        if (l == 0) {
            failed |= m->add_rms_norm(bf16, s->hidden, NULL, NULL, s->normed, y->input_norm,
                                      rows, hidden, m->eps, threads);
        } else {
            failed |= m->add_rms_norm(bf16, s->hidden, s->residual, s->spare, s->normed,
                                      y->input_norm, rows, hidden, m->eps, threads);
            stream = s->spare;
        }
        failed |= y->qkv_product(y->qkv, s->normed, hidden, NULL, s->qkv, qkv_width, rows,
                                 qkv_width, hidden, threads);
        const char *qkv = (const char *)s->qkv;
        failed |= m->rms_norm_rope(bf16, qkv, s->q, y->q_norm, s->cos, s->sin, rows, m->heads,
                                   m->dim, qkv_width, m->eps, threads);
        failed |= m->rms_norm_rope(bf16, qkv + q_width * es, s->k, y->k_norm, s->cos, s->sin,
                                   rows, m->kv_heads, m->dim, qkv_width, m->eps, threads);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t slot = s->slots[r] * kv_width * es;
            memcpy((char *)y->keys + slot, (const char *)s->k + r * kv_width * es, kv_width * es);
            memcpy((char *)y->values + slot, qkv + (r * qkv_width + q_width + kv_width) * es,
                   kv_width * es);
        }
        failed |= m->decode(bf16, bf16, s->q, y->keys, y->values, s->kv_index, s->lengths,
                            s->attended, rows, s->width, m->heads, m->kv_heads, m->dim,
                            m->scale, threads);
        failed |= y->o_product(y->o, s->attended, q_width, NULL, s->o, hidden, rows, hidden,
                               q_width, threads);
        failed |= m->add_rms_norm(bf16, s->o, stream, s->residual, s->normed, y->post_norm,
                                  rows, hidden, m->eps, threads);
        failed |= y->gate_up_product(y->gate_up, s->normed, hidden, NULL, s->gate_up,
                                     gate_up_width, rows, gate_up_width, hidden, threads);
        m->swiglu(bf16, s->gate_up, gate_up_width, s->act, rows, m->intermediate, threads);
        failed |= y->down_product(y->down, s->act, m->intermediate, NULL, s->hidden, hidden,
                                  rows, hidden, m->intermediate, threads);
        if (failed) return (int)(l + 1);
    }
    return 0;
}
