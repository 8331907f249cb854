/* The CPU's decode step of a Llama-family model in one call: every decoder layer and the final
 * norm, for m requests that each decode one token (model/cpu_decode.py builds the tables and
 * decides where it runs).
 *
 * Per layer: RMSNorm (with the residual add), QKV GEMV (+ bias), per-head q/k RMSNorm (Qwen3),
 * neox rotary embedding, the keys and values written into the paged cache at the step's slots,
 * paged decode attention (attention/backends/cpu_native/paged_attention.h, the attention
 * backend's kernel), o_proj GEMV (+ bias), RMSNorm with the residual add, gate/up GEMV,
 * SiLU-and-mul, down GEMV. The torch layers are the reference: activations are kept in fp32
 * buffers but rounded to the model's dtype wherever a torch op of the reference writes a
 * tensor of that dtype (with bf16, each op's output), so the two paths round alike; a GEMV
 * rounds once, after its fp32 sums and bias.
 *
 * Weights, activations and the KV cache all share the model's dtype (bf16 or fp32; `is_bf16`).
 * Layouts (contiguous unless said):
 *   hidden   [m, hidden]: in, the embedded tokens; out, the final norm's output
 *   positions int64 [m], slots int64 [m] (-1: no cache write)
 *   block_table int32 [m, table_stride], seq_lens int32 [m]
 *   cos_sin  [max_position, head_dim]: cos half | sin half
 *   caches   [num_blocks, block_size, num_kv_heads, head_dim], block stride cache_block_stride
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "decode_gemv.h"
#include "panel_gemm.h"
#include "paged_attention.h"
#include "row_ops.h"

typedef struct {
    const void *input_norm, *post_norm;   /* [hidden] */
    const void *qkv, *qkv_bias;           /* [(Hq + 2 Hkv) D, hidden], [(Hq + 2 Hkv) D] or NULL */
    const void *q_norm, *k_norm;          /* [D] or NULL (Qwen3) */
    const void *o_proj, *o_bias;          /* [hidden, Hq D], [hidden] or NULL */
    const void *gate_up, *gate_up_bias;   /* [2 I, hidden], [2 I] or NULL */
    const void *down, *down_bias;         /* [hidden, I], [hidden] or NULL */
    void *key_cache, *value_cache;
    /* The four weights packed for panel_gemm.h, or NULL: batches use decode_gemv.h. */
    const void *qkv_panels, *o_panels, *gate_up_panels, *down_panels;
} DecodeLayer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, cache_block_stride, max_position;
    float norm_eps, qk_norm_eps, scale;
    int is_bf16;
    int64_t panel_min_rows; /* from this many rows on, packed weights go to panel_gemm */
    const void *cos_sin, *final_norm;
    const DecodeLayer *layers;
} DecodeModel;

/* The step's activations (fp32 unless said), one allocation. */
typedef struct {
    float *res, *y, *normed;   /* [m, hidden]: residual stream, sublayer output, norm output */
    float *qkv, *attn, *gate_up, *act;   /* [m, (Hq+2Hkv) D], [m, Hq D], [m, 2 I], [m, I] */
    void *q, *out;             /* [m, Hq D] in the model's dtype: the attention kernel's */
    uint16_t *xb;              /* [m, max(hidden, Hq D, I)]: a GEMV's input as bf16 */
    int64_t *rows;             /* [m]: 0..m-1 */
} Scratch;

static void round_all(float *x, int64_t n, int is_bf16) {
    if (is_bf16)
        for (int64_t i = 0; i < n; i++) x[i] = round_bf16(x[i]);
}

/* Each row: y += res (fp32, the sum); res = y in the dtype; normed = RMSNorm(y). */
static void add_norm(const DecodeModel *md, const void *w, int64_t m, Scratch *s) {
    const int64_t h = md->hidden;
    for (int64_t r = 0; r < m; r++) {
        float *sum = s->y + r * h;
        for (int64_t i = 0; i < h; i++) sum[i] += s->res[r * h + i];
        for (int64_t i = 0; i < h; i++) s->res[r * h + i] = rnd(sum[i], md->is_bf16);
        rms_norm(sum, w, md->norm_eps, h, s->normed + r * h, md->is_bf16);
    }
}

/* y = x W^T + bias, rounded to the dtype: the GEMV of a linear layer; on `panels` (w packed,
 * or NULL) from md->panel_min_rows rows on. */
static void linear(const DecodeModel *md, const float *x, const void *w, const void *panels,
                   const void *bias, float *y, int64_t m, int64_t n, int64_t k, Scratch *s,
                   int num_threads) {
    if (md->is_bf16)
        for (int64_t i = 0; i < m * k; i++) s->xb[i] = float_to_bf16(x[i]);
    if (panels == NULL || m < md->panel_min_rows
        || panel_gemm(x, s->xb, panels, bias, y, m, n, k, md->is_bf16, num_threads) != 0)
        decode_gemv(x, s->xb, w, bias, y, m, n, k, md->is_bf16, num_threads);
    round_all(y, m * n, md->is_bf16);
}

/* q/k norms (Qwen3), rotary embedding, the cache write and the attention kernel's query, for
 * each row of the step's qkv. */
static int rope_and_write_kv(const DecodeModel *md, const DecodeLayer *L, int64_t m,
                             const int64_t *positions, const int64_t *slots, Scratch *s) {
    const int64_t d = md->head_dim, hq = md->num_heads * d, hkv = md->num_kv_heads * d;
    const int bf = md->is_bf16;
    for (int64_t r = 0; r < m; r++) {
        float *q = s->qkv + r * (hq + 2 * hkv), *k = q + hq, *v = k + hkv;
        if (positions[r] < 0 || positions[r] >= md->max_position) return 3;
        if (L->q_norm != NULL) {
            for (int64_t hd = 0; hd < md->num_heads; hd++)
                rms_norm(q + hd * d, L->q_norm, md->qk_norm_eps, d, q + hd * d, bf);
            for (int64_t hd = 0; hd < md->num_kv_heads; hd++)
                rms_norm(k + hd * d, L->k_norm, md->qk_norm_eps, d, k + hd * d, bf);
        }
        rotate(q, md->num_heads, d, md->cos_sin, positions[r], bf);
        rotate(k, md->num_kv_heads, d, md->cos_sin, positions[r], bf);
        for (int64_t i = 0; i < hq; i++) store(s->q, r * hq + i, q[i], bf);
        if (slots[r] < 0) continue;
        const int64_t at = (slots[r] / md->block_size) * md->cache_block_stride
                           + (slots[r] % md->block_size) * hkv;
        for (int64_t i = 0; i < hkv; i++) {
            store(L->key_cache, at + i, k[i], bf);
            store(L->value_cache, at + i, v[i], bf);
        }
    }
    return 0;
}

/* One decoder layer over the step's rows: s->y and s->res in, the same out. */
static int layer_step(const DecodeModel *md, const DecodeLayer *L, int64_t m,
                      const int64_t *positions, const int64_t *slots, const int32_t *block_table,
                      int64_t table_stride, const int32_t *seq_lens, Scratch *s, int threads) {
    const int64_t h = md->hidden, d = md->head_dim, hq = md->num_heads * d;
    const int64_t qkv_n = hq + 2 * md->num_kv_heads * d, inter = md->intermediate;
    const int bf = md->is_bf16;
    add_norm(md, L->input_norm, m, s);
    linear(md, s->normed, L->qkv, L->qkv_panels, L->qkv_bias, s->qkv, m, qkv_n, h, s, threads);
    int status = rope_and_write_kv(md, L, m, positions, slots, s);
    if (status != 0) return status;
    const Work w = {s->q, L->key_cache, L->value_cache, s->rows, block_table, seq_lens, s->out,
                    m, md->num_heads, md->num_kv_heads, d, md->block_size, table_stride,
                    hq, hq, md->cache_block_stride, md->scale, bf};
    if (attend_requests(&w, threads) != 0) return 2;
    for (int64_t i = 0; i < m * hq; i++) s->attn[i] = load(s->out, i, bf);
    linear(md, s->attn, L->o_proj, L->o_panels, L->o_bias, s->y, m, h, hq, s, threads);
    add_norm(md, L->post_norm, m, s);
    linear(md, s->normed, L->gate_up, L->gate_up_panels, L->gate_up_bias, s->gate_up, m,
           2 * inter, h, s, threads);
    for (int64_t r = 0; r < m; r++) {
        const float *g = s->gate_up + r * 2 * inter;
        silu_mul(g, g + inter, s->act + r * inter, inter, bf);
    }
    linear(md, s->act, L->down, L->down_panels, L->down_bias, s->y, m, h, inter, s, threads);
    return 0;
}

static void *alloc_scratch(const DecodeModel *md, int64_t m, Scratch *s) {
    const int64_t h = md->hidden, hq = md->num_heads * md->head_dim;
    const int64_t qkv_n = hq + 2 * md->num_kv_heads * md->head_dim, inter = md->intermediate;
    int64_t widest = h > hq ? h : hq;
    widest = widest > inter ? widest : inter;
    const int64_t floats = m * (3 * h + qkv_n + 3 * hq + 3 * inter) + m * widest / 2 + 2 * m + 16;
    float *base = malloc((size_t)floats * sizeof(float));
    if (base == NULL) return NULL;
    float *p = base;
    s->rows = (int64_t *)p, p += 2 * m; /* first: 8-byte aligned */
    s->res = p, p += m * h;
    s->y = p, p += m * h;
    s->normed = p, p += m * h;
    s->qkv = p, p += m * qkv_n;
    s->attn = p, p += m * hq;
    s->q = p, p += m * hq; /* room for fp32; bf16 uses half */
    s->out = p, p += m * hq;
    s->gate_up = p, p += 2 * m * inter;
    s->act = p, p += m * inter;
    s->xb = (uint16_t *)p;
    for (int64_t r = 0; r < m; r++) s->rows[r] = r;
    return base;
}

/* Returns 0 on success; 1: no memory for the scratch, 2: the attention left requests undone,
 * 3: a position past the rotary table. */
int decode_step(const DecodeModel *md, void *hidden, int64_t m, const int64_t *positions,
                const int64_t *slots, const int32_t *block_table, int64_t table_stride,
                const int32_t *seq_lens, int num_threads) {
    Scratch s;
    void *base = alloc_scratch(md, m, &s);
    if (base == NULL) return 1;
    const int64_t h = md->hidden;
    for (int64_t i = 0; i < m * h; i++) s.y[i] = load(hidden, i, md->is_bf16);
    memset(s.res, 0, (size_t)(m * h) * sizeof(float)); /* layer 0: y + 0 is the embedding */
    int status = 0;
    for (int64_t l = 0; l < md->num_layers && status == 0; l++)
        status = layer_step(md, &md->layers[l], m, positions, slots, block_table, table_stride,
                            seq_lens, &s, num_threads);
    if (status == 0) {
        add_norm(md, md->final_norm, m, &s);
        for (int64_t i = 0; i < m * h; i++) store(hidden, i, s.normed[i], md->is_bf16);
    }
    free(base);
    return status;
}

/* y[m, n] = x[m, k] w^T + bias, rounded to the dtype (x, y fp32): one linear layer of the step,
 * exported for tests and measurements. Returns 1 where the bf16 copy of x cannot be allocated. */
int decode_linear(const float *x, const void *w, const void *bias, float *y, int64_t m,
                  int64_t n, int64_t k, int is_bf16, int num_threads) {
    uint16_t *xb = malloc((size_t)(m * k) * sizeof(uint16_t) + 64);
    if (xb == NULL) return 1;
    for (int64_t i = 0; i < m * k; i++) xb[i] = float_to_bf16(x[i]);
    decode_gemv(x, xb, w, bias, y, m, n, k, is_bf16, num_threads);
    round_all(y, m * n, is_bf16);
    free(xb);
    return 0;
}
