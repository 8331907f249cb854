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
#include <omp.h>
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
    float *qkv, *gate_up, *act; /* [m, (Hq+2Hkv) D], [m, 2 I], [m, I] */
    void *q, *out;             /* [m, Hq D] in the model's dtype: the attention kernel's */
    uint16_t *xb;              /* [m, max(hidden, I)]: a product's input as bf16 */
    int64_t *rows;             /* [m]: 0..m-1 */
} Scratch;

/* Scratch's row widths that depend on the model: qkv_proj's output, (Hq + 2 Hkv) D, and xb's,
 * the widest product input, max(hidden, I). */
static int64_t qkv_width(const DecodeModel *md) {
    return (md->num_heads + 2 * md->num_kv_heads) * md->head_dim;
}
static int64_t xb_width(const DecodeModel *md) {
    return md->hidden > md->intermediate ? md->hidden : md->intermediate;
}
/* Bytes of one element in the model's dtype (q, out and the step's output). */
static int64_t elem_bytes(const DecodeModel *md) { return md->is_bf16 ? 2 : 4; }

/* xb[0:n] = x[0:n] as bf16; x holds bf16 values already (rounded), so this is exact. */
static void to_bf16_row(const float *x, uint16_t *xb, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) store16(xb, i, _mm512_loadu_ps(x + i), 1);
#endif
    for (; i < n; i++) xb[i] = float_to_bf16(x[i]);
}

/* Each row: y += res (fp32, the sum); res = y in the dtype; normed = RMSNorm(y) (bf16: also
 * into xb, the next product's input). Rows go to the region's threads. */
static void add_norm_rows(const DecodeModel *md, const void *w, int64_t m, Scratch *s) {
    const int64_t h = md->hidden;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        float *sum = s->y + r * h, *res = s->res + r * h;
        for (int64_t i = 0; i < h; i++) sum[i] += res[i];
        for (int64_t i = 0; i < h; i++) res[i] = rnd(sum[i], md->is_bf16);
        rms_norm(sum, w, md->norm_eps, h, s->normed + r * h, md->is_bf16);
        if (md->is_bf16) to_bf16_row(s->normed + r * h, s->xb + r * h, h);
    }
}

/* Whether a product of m rows runs on `panels` (w packed, or NULL). */
static int on_panels(const DecodeModel *md, const void *panels, int64_t m) {
    return panels != NULL && PANEL_F32 && m >= md->panel_min_rows;
}

/* y = x W^T + bias, rounded to the dtype: the product of a linear layer, on `panels` where
 * on_panels. bf16 reads xb (and x too on widened panels: panel_gemm.h), fp32 x. Shared by the
 * region's threads; y is whole for each of them on return. */
static void linear(const DecodeModel *md, const float *x, const uint16_t *xb, const void *w,
                   const void *panels, const void *bias, float *y, int64_t m, int64_t n,
                   int64_t k) {
    if (on_panels(md, panels, m))
        panel_gemm_shared(x, xb, panels, bias, y, m, n, k, md->is_bf16);
    else
        decode_gemv_shared(x, xb, w, bias, y, m, n, k, md->is_bf16);
}

/* q/k norms (Qwen3), rotary embedding, the cache write and the attention kernel's query, for
 * each row of the step's qkv; rows go to the region's threads (each writes its own cache
 * slot). Positions were checked against the rotary table before the step. */
static void rope_and_write_kv(const DecodeModel *md, const DecodeLayer *L, int64_t m,
                              const int64_t *positions, const int64_t *slots, Scratch *s) {
    const int64_t d = md->head_dim, hq = md->num_heads * d, hkv = md->num_kv_heads * d;
    const int bf = md->is_bf16;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        float *q = s->qkv + r * (hq + 2 * hkv), *k = q + hq, *v = k + hkv;
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
}

/* act = SiLU(gate) * up per row (bf16: also into xb); rows go to the region's threads. */
static void silu_rows(const DecodeModel *md, int64_t m, Scratch *s) {
    const int64_t inter = md->intermediate;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const float *g = s->gate_up + r * 2 * inter;
        silu_mul(g, g + inter, s->act + r * inter, inter, md->is_bf16);
        if (md->is_bf16) to_bf16_row(s->act + r * inter, s->xb + r * inter, inter);
    }
}

/* o_proj's input as fp32 values where its product reads them: a bf16 attention output on
 * widened panels is widened into s->qkv (free once the cache write has read it); otherwise the
 * output as it is (fp32, or bf16 read as xb). */
static const float *o_proj_input(const DecodeModel *md, const DecodeLayer *L, int64_t m,
                                 Scratch *s) {
    const int64_t hq = md->num_heads * md->head_dim;
    if (!(md->is_bf16 && PANEL_WIDENS_BF16 && on_panels(md, L->o_panels, m)))
        return (const float *)s->out;
    const uint16_t *out = (const uint16_t *)s->out;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < hq; i++) s->qkv[r * hq + i] = bf16_to_float(out[r * hq + i]);
    return s->qkv;
}

/* The step's tables, the same for every layer. */
typedef struct {
    int64_t m, table_stride;
    const int64_t *positions, *slots;
    const int32_t *block_table, *seq_lens;
} StepRows;

/* One decoder layer over the step's rows: s->y and s->res in, the same out. Called by every
 * thread of the enclosing region (the step's, or a thread's team of one for its own rows):
 * each stage's loop is shared, and its closing barrier orders it before the next stage's
 * reads. buf: this thread's attention scratch. */
static void layer_step(const DecodeModel *md, const DecodeLayer *L, const StepRows *st,
                       Scratch *s, float *buf) {
    const int64_t h = md->hidden, d = md->head_dim, hq = md->num_heads * d, m = st->m;
    const int64_t qkv_n = qkv_width(md), inter = md->intermediate;
    const int bf = md->is_bf16;
    add_norm_rows(md, L->input_norm, m, s);
    linear(md, s->normed, s->xb, L->qkv, L->qkv_panels, L->qkv_bias, s->qkv, m, qkv_n, h);
    rope_and_write_kv(md, L, m, st->positions, st->slots, s);
    const Work w = {s->q, L->key_cache, L->value_cache, s->rows, st->block_table, st->seq_lens,
                    s->out, m, md->num_heads, md->num_kv_heads, d, md->block_size,
                    st->table_stride, hq, hq, md->cache_block_stride, md->scale, bf};
    attend_shared(&w, buf);
    /* The attention's output, in the dtype, is o_proj's input: bf16 as xb, fp32 as x. */
    linear(md, o_proj_input(md, L, m, s), (const uint16_t *)s->out, L->o_proj, L->o_panels,
           L->o_bias, s->y, m, h, hq);
    add_norm_rows(md, L->post_norm, m, s);
    linear(md, s->normed, s->xb, L->gate_up, L->gate_up_panels, L->gate_up_bias, s->gate_up, m,
           2 * inter, h);
    silu_rows(md, m, s);
    linear(md, s->act, s->xb, L->down, L->down_panels, L->down_bias, s->y, m, h, inter);
}

static void *alloc_scratch(const DecodeModel *md, int64_t m, Scratch *s) {
    const int64_t h = md->hidden, hq = md->num_heads * md->head_dim;
    const int64_t qkv_n = qkv_width(md), inter = md->intermediate, widest = xb_width(md);
    const int64_t floats = m * (3 * h + qkv_n + 2 * hq + 3 * inter) + m * widest / 2 + 2 * m + 16;
    float *base = malloc((size_t)floats * sizeof(float));
    if (base == NULL) return NULL;
    float *p = base;
    s->rows = (int64_t *)p, p += 2 * m; /* first: 8-byte aligned */
    s->res = p, p += m * h;
    s->y = p, p += m * h;
    s->normed = p, p += m * h;
    s->qkv = p, p += m * qkv_n;
    s->q = p, p += m * hq; /* room for fp32; bf16 uses half */
    s->out = p, p += m * hq;
    s->gate_up = p, p += 2 * m * inter;
    s->act = p, p += m * inter;
    s->xb = (uint16_t *)p;
    for (int64_t r = 0; r < m; r++) s->rows[r] = r;
    return base;
}

/* Every layer and the final norm over the step's rows, then the output into `hidden`, on the
 * threads of the enclosing region (a team of one: all of it on this thread). */
static void all_layers(const DecodeModel *md, const StepRows *st, Scratch *s, void *hidden,
                       float *buf) {
    for (int64_t l = 0; l < md->num_layers; l++) layer_step(md, &md->layers[l], st, s, buf);
    add_norm_rows(md, md->final_norm, st->m, s);
    const int64_t n = st->m * md->hidden;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) store(hidden, i, s->normed[i], md->is_bf16);
}

/* A row's share of a step's work, in multiply-adds per layer: its products (the same for
 * every row) and its attention over seq_len cached tokens, each of whose multiply-adds costs
 * ATTN_MAC_COST of a product's (it reads the cache from memory, for one row; the default
 * model's per-stage times give 5-6, docs/cpu.md#rows-per-thread). */
#define ATTN_MAC_COST 5
static int64_t row_cost(const DecodeModel *md, int64_t seq_len) {
    const int64_t h = md->hidden, hq = md->num_heads * md->head_dim, inter = md->intermediate;
    const int64_t products = qkv_width(md) * h + hq * h + 3 * inter * h;
    return products + ATTN_MAC_COST * 2 * hq * seq_len;
}

/* The cost of rows [r0, r1): row_cost summed. */
static int64_t rows_cost(const DecodeModel *md, const StepRows *st, int64_t r0, int64_t r1) {
    int64_t sum = 0;
    for (int64_t r = r0; r < r1; r++) sum += row_cost(md, st->seq_lens[r]);
    return sum;
}

/* The first row of share t of nt: the step's rows cut into nt runs of about equal cost
 * (row_cost), at whole blocks of PANEL_ROWS rows (a block going to the run that holds its
 * larger half): a run's products then have no partial block but possibly its last. */
static int64_t share_start(const DecodeModel *md, const StepRows *st, int t, int nt) {
    const int64_t goal = rows_cost(md, st, 0, st->m) / nt * t;
    int64_t r = 0, before = 0; /* before: the cost of rows [0, r) */
    while (r < st->m) {
        const int64_t end = r + PANEL_ROWS < st->m ? r + PANEL_ROWS : st->m;
        const int64_t c = rows_cost(md, st, r, end);
        if (before + c / 2 >= goal) break;
        before += c;
        r = end;
    }
    return r;
}

/* Rows [r0, r1) of the step as a step of their own: its tables and scratch from row r0. */
static void rows_view(const DecodeModel *md, const StepRows *st, const Scratch *s, int64_t r0,
                      int64_t r1, StepRows *view, Scratch *sv) {
    const int64_t h = md->hidden, hq = md->num_heads * md->head_dim, inter = md->intermediate;
    const int64_t qkv_n = qkv_width(md), widest = xb_width(md), elem = elem_bytes(md);
    *view = (StepRows){r1 - r0, st->table_stride, st->positions + r0, st->slots + r0,
                       st->block_table + r0 * st->table_stride, st->seq_lens + r0};
    *sv = (Scratch){s->res + r0 * h, s->y + r0 * h, s->normed + r0 * h, s->qkv + r0 * qkv_n,
                    s->gate_up + r0 * 2 * inter, s->act + r0 * inter,
                    (char *)s->q + r0 * hq * elem, (char *)s->out + r0 * hq * elem,
                    s->xb + r0 * widest, s->rows}; /* rows: 0.. serves any prefix */
}

/* Whether the step's rows go to the threads in runs (own_rows) rather than each stage's loop
 * to all of them (all_layers on the team): where the rows make whole blocks of PANEL_ROWS
 * that the threads can share equally, so that the runs' products multiply no more blocks than
 * the stages' column split does (a thread of 12 rows runs two blocks, 8 + 4, where the column
 * split gives each thread half of three); and for at most ROW_SPLIT_MAX_THREADS threads, as
 * each thread reads every weight (the column split reads each weight once): measured on two
 * cores only. */
#define ROW_SPLIT_MAX_THREADS 2
static int split_by_rows(int64_t m, int nt) {
    const int64_t blocks = (m + PANEL_ROWS - 1) / PANEL_ROWS;
    return nt > 1 && nt <= ROW_SPLIT_MAX_THREADS && blocks >= nt && blocks % nt == 0;
}

/* This thread's share of the rows through every layer, alone: no row of it depends on another
 * thread's until the step ends, so the threads meet once a step instead of at each stage's
 * barrier (nine a layer), where a thread that the OS has taken off its core holds up the
 * others; and each row's activations stay in the cache of the core that made them, where
 * the stages' column and row splits moved half of them between the cores at each stage. */
static void own_rows(const DecodeModel *md, const StepRows *st, Scratch *s, void *hidden,
                     float *buf) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t r0 = share_start(md, st, t, nt);
    const int64_t r1 = t + 1 < nt ? share_start(md, st, t + 1, nt) : st->m;
    if (r1 <= r0) return;
    StepRows view;
    Scratch sv;
    rows_view(md, st, s, r0, r1, &view, &sv);
    void *out = (char *)hidden + r0 * md->hidden * elem_bytes(md);
#pragma omp parallel num_threads(1) /* a team of one: every stage's loop is this thread's */
    all_layers(md, &view, &sv, out, buf);
}

/* The step on the threads of one OpenMP region: a region per product left the row operations
 * between them to one thread while the others waited. Returns 0, or 2 where a thread could
 * not allocate its attention scratch (then no thread ran a layer). */
static int run_layers(const DecodeModel *md, const StepRows *st, Scratch *s, void *hidden,
                      int num_threads) {
    const Work sizes = {.rows = s->rows, .seq_lens = st->seq_lens, .num_reqs = st->m,
                        .num_heads = md->num_heads, .num_kv_heads = md->num_kv_heads,
                        .head_dim = md->head_dim, .block_size = md->block_size};
    const size_t scratch = (size_t)scratch_floats(&sizes) * sizeof(float);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *buf = malloc(scratch);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        int stop; /* the same for every thread: read after the barrier */
#pragma omp atomic read
        stop = failed;
        const int nt = omp_get_num_threads(); /* the same for every thread */
        if (!stop && split_by_rows(st->m, nt))
            own_rows(md, st, s, hidden, buf);
        else if (!stop)
            all_layers(md, st, s, hidden, buf);
        free(buf);
    }
    return failed ? 2 : 0;
}

/* Returns 0 on success; 1: no memory for the scratch, 2: a thread had no memory for the
 * attention's scratch (nothing computed), 3: a position past the rotary table. */
int decode_step(const DecodeModel *md, void *hidden, int64_t m, const int64_t *positions,
                const int64_t *slots, const int32_t *block_table, int64_t table_stride,
                const int32_t *seq_lens, int num_threads) {
    for (int64_t r = 0; r < m; r++)
        if (positions[r] < 0 || positions[r] >= md->max_position) return 3;
    Scratch s;
    void *base = alloc_scratch(md, m, &s);
    if (base == NULL) return 1;
    const int64_t h = md->hidden;
    for (int64_t i = 0; i < m * h; i++) s.y[i] = load(hidden, i, md->is_bf16);
    memset(s.res, 0, (size_t)(m * h) * sizeof(float)); /* layer 0: y + 0 is the embedding */
    const StepRows st = {m, table_stride, positions, slots, block_table, seq_lens};
    const int status = run_layers(md, &st, &s, hidden, num_threads);
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
    free(xb);
    return 0;
}
