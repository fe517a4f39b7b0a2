/*
 * Decode attention over criticalkv's quantized storage, one call per layer and step.
 *
 * For every sorted segment (a batch row and KV head) and its Q query rows, the scores over the
 * segment's own entries (no padding): its prefix blocks read through the block list (entry
 * row, block row and length of each block in the pooled prefix), the quantized tail's used
 * blocks, the full-precision residual; the tail and residual columns under the tail mask.
 * Then an exact max-subtracted softmax per row and the probability-weighted values, float32
 * accumulation throughout. A row with nothing to attend to gives zeros.
 *
 * Storage (criticalkv/cache/quantize.py, quantized_store.py): codes c in [0, 2^bits - 1],
 * x = c * scale + zero with float16 scale and zero point. Keys: per channel over a block of
 * entries (one scale and zero point per block and channel); values: per entry over groups of
 * vgw = d / vgroups consecutive channels. 4-bit codes two a byte, channel 2j in the low
 * nibble of byte j, channel 2j + 1 in the high one.
 *
 * Keys are never dequantized: with qs = q * scale (per channel of a block) and
 * qz = q . zero, q . k = qs . c + qz. Values are accumulated as sum p * scale * c per channel
 * and sum p * zero per group, added at the end (the same sums, regrouped).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v;
    uint32_t em = (uint32_t)(h & 0x7fffu);
    v.u = em << 13;
    v.f *= 0x1p112f; /* rebias the exponent: normals and subnormals alike */
    if (em >= 0x7c00u) v.u |= 0x7f800000u; /* infinity, NaN */
    v.u |= (uint32_t)(h & 0x8000u) << 16;
    return v.f;
}
#endif

/* codes of one entry -> d floats in channel order */
static inline void unpack_codes(const uint8_t *codes, int64_t d, int bits, float *out) {
    if (bits == 8) {
        for (int64_t c = 0; c < d; c++) out[c] = (float)codes[c];
        return;
    }
    for (int64_t j = 0; j < d / 2; j++) {
        out[2 * j] = (float)(codes[j] & 15);
        out[2 * j + 1] = (float)(codes[j] >> 4);
    }
}

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc = 0.0f;
    for (int64_t c = 0; c < d; c++) acc += a[c] * b[c];
    return acc;
}

typedef struct {
    int64_t d, bits, width, vgroups, vgw, Q;
    float *qs;   /* (Q, d) query times the block's key scale */
    float *qz;   /* (Q,) query . the block's key zero point */
    float *unp;  /* (d,) one entry's codes */
    float *acc;  /* (Q, d) sum p * scale * code */
    float *zacc; /* (Q, vgroups) sum p * zero */
} Work;

/* scores of `len` entries of one block: keys codes (len, width) from `kc`, stats (d) */
static void block_scores(const Work *w, const float *q, const uint8_t *kc, const uint16_t *ks,
                         const uint16_t *kz, int64_t len, float *scores, int64_t stride) {
    int64_t d = w->d;
    for (int64_t i = 0; i < w->Q; i++) {
        float z = 0.0f;
        for (int64_t c = 0; c < d; c++) {
            w->qs[i * d + c] = q[i * d + c] * half_to_float(ks[c]);
            z += q[i * d + c] * half_to_float(kz[c]);
        }
        w->qz[i] = z;
    }
    for (int64_t e = 0; e < len; e++) {
        unpack_codes(kc + e * w->width, d, (int)w->bits, w->unp);
        for (int64_t i = 0; i < w->Q; i++) scores[i * stride + e] = dot(w->qs + i * d, w->unp, d) + w->qz[i];
    }
}

/* accumulate `len` entries' values weighted by probs[i * stride + e] */
static void block_values(const Work *w, const uint8_t *vc, const uint16_t *vs, const uint16_t *vz,
                         int64_t len, const float *probs, int64_t stride) {
    int64_t d = w->d, ng = w->vgroups, gw = w->vgw;
    for (int64_t e = 0; e < len; e++) {
        unpack_codes(vc + e * w->width, d, (int)w->bits, w->unp);
        for (int64_t g = 0; g < ng; g++) {
            float s = half_to_float(vs[e * ng + g]), z = half_to_float(vz[e * ng + g]);
            for (int64_t i = 0; i < w->Q; i++) {
                float p = probs[i * stride + e];
                float ps = p * s;
                float *a = w->acc + i * d + g * gw;
                const float *u = w->unp + g * gw;
                for (int64_t c = 0; c < gw; c++) a[c] += ps * u[c];
                w->zacc[i * ng + g] += p * z;
            }
        }
    }
}

/*
 * The arguments of one call, laid out once here and once in kernels/quantized_decode.py
 * (DecodeArgs, a ctypes.Structure with the same fields in the same order): every argument is
 * named and typed, and `size` (sizeof as the caller laid it out) is checked before anything is
 * read, so a caller built against another layout is refused (-2) instead of corrupting memory.
 *
 * query (S, Q, d) float32 and out (S, Q, d) float32 in the original segment order: sorted segment s
 * is row perm[s] of both (perm NULL: the identity), and of the tail mask; everything else is in
 * sorted order.
 * Prefix pool: key/value codes (E, width) uint8, value scale/zero (E, vgroups) float16 bits,
 * key scale/zero (NB, d). Segment s owns blocks [seg_offsets[s], seg_offsets[s + 1]) of the block
 * list; block k: entries [blk_entry[k], blk_entry[k] + blk_len[k]) and key statistics row blk_row[k].
 * Tail (may be absent: tail_used 0): (S, tail_cap, group, width) codes, (S, tail_cap, 1, d) key
 * stats, (S, tail_cap, group, vgroups) value stats. Residual: r float32 entries of d per segment,
 * segment s at res_k + s * res_stride. Tail mask (S, Q, mask_t) uint8 (1: attend) over the tail's
 * columns (quantized blocks, then the residual), or NULL: attend to all.
 * threads: segments are shared among this many OpenMP threads (1 without OpenMP).
 */
typedef struct {
    int64_t size;
    int64_t S, Q, d, bits, group, vgroups, threads;
    double scaling;
    const float *query;
    const int64_t *perm;
    const uint8_t *p_kc, *p_vc;
    const uint16_t *p_vs, *p_vz, *p_ks, *p_kz;
    const int64_t *seg_offsets, *blk_entry, *blk_row, *blk_len;
    int64_t tail_used, tail_cap;
    const uint8_t *t_kc;
    const uint16_t *t_ks, *t_kz;
    const uint8_t *t_vc;
    const uint16_t *t_vs, *t_vz;
    int64_t r, res_stride;
    const float *res_k, *res_v;
    const uint8_t *mask;
    int64_t mask_t;
    float *out;
} CkvDecodeArgs;

int64_t ckv_decode_args_size(void) { return (int64_t)sizeof(CkvDecodeArgs); }

/* one thread's workspace over score columns of `stride` (the longest segment's) */
typedef struct {
    float *buf, *scores, *qv;
    Work w;
} Space;

static int space_alloc(Space *sp, const CkvDecodeArgs *a, int64_t stride) {
    int64_t Q = a->Q, d = a->d;
    size_t floats = (size_t)(Q * stride + 3 * Q * d + Q + d + Q * a->vgroups + Q * d + 1);
    sp->buf = (float *)malloc(floats * sizeof(float));
    if (sp->buf == NULL) return -1;
    sp->scores = sp->buf;
    sp->qv = sp->scores + Q * stride;
    Work w = {d, a->bits, d * a->bits / 8, a->vgroups, d / a->vgroups, Q, sp->qv + Q * d, 0, 0, 0, 0};
    w.qz = w.qs + Q * d;
    w.unp = w.qz + Q;
    w.acc = w.unp + d;
    w.zacc = w.acc + Q * d;
    sp->w = w;
    return 0;
}

/* One work item: blocks [k0, k1) of sorted segment s's block list, and, for its last item, the
 * quantized tail blocks and the residual. Long segments are cut into several items (split-K) so
 * that threads share even one segment; each item's softmax is merged exactly afterwards. */
typedef struct {
    int64_t s, k0, k1, with_tail;
} Item;

/* entries of prefix per item before a segment is cut: enough work per item, items enough for threads */
#define ITEM_ENTRIES 256

/* the work items of every segment in order; returns their count (items has room for blocks + S) */
static int64_t make_items(const CkvDecodeArgs *a, Item *items, int64_t *first, int64_t *widest) {
    int64_t n = 0, tail_cols = a->tail_used * a->group + a->r;
    *widest = 0;
    for (int64_t s = 0; s < a->S; s++) {
        first[s] = n;
        int64_t k0 = a->seg_offsets[s], entries = 0;
        for (int64_t k = a->seg_offsets[s]; k < a->seg_offsets[s + 1]; k++) {
            entries += a->blk_len[k];
            if (entries >= ITEM_ENTRIES && k + 1 < a->seg_offsets[s + 1]) {
                items[n++] = (Item){s, k0, k + 1, 0};
                *widest = entries > *widest ? entries : *widest;
                k0 = k + 1;
                entries = 0;
            }
        }
        items[n++] = (Item){s, k0, a->seg_offsets[s + 1], 1};
        *widest = entries + tail_cols > *widest ? entries + tail_cols : *widest;
    }
    first[a->S] = n;
    return n;
}

/* scores of one item's columns: its prefix blocks, then (last item) tail blocks and residual; sets *lp */
static int64_t item_scores(const CkvDecodeArgs *a, Space *sp, const Item *it, int64_t stride, int64_t *lp) {
    const Work *w = &sp->w;
    int64_t d = a->d, Q = a->Q, width = w->width, col = 0, s = it->s;
    for (int64_t k = it->k0; k < it->k1; k++) {
        block_scores(w, sp->qv, a->p_kc + a->blk_entry[k] * width, a->p_ks + a->blk_row[k] * d,
                     a->p_kz + a->blk_row[k] * d, a->blk_len[k], sp->scores + col, stride);
        col += a->blk_len[k];
    }
    *lp = col;
    if (!it->with_tail) return col;
    for (int64_t b = 0; b < a->tail_used; b++) {
        int64_t blk = s * a->tail_cap + b;
        block_scores(w, sp->qv, a->t_kc + blk * a->group * width, a->t_ks + blk * d, a->t_kz + blk * d, a->group,
                     sp->scores + col, stride);
        col += a->group;
    }
    for (int64_t e = 0; e < a->r; e++) {
        const float *k = a->res_k + s * a->res_stride + e * d;
        for (int64_t i = 0; i < Q; i++) sp->scores[i * stride + col + e] = dot(sp->qv + i * d, k, d);
    }
    return col + a->r;
}

/* unnormalised softmax of each query row over `col` columns (the tail's, from lp, under the mask):
 * exp(x - max) in place; the row's max and sum go to part[i * (d + 2)] and [+ 1] (-inf, 0: none) */
static void item_softmax(const CkvDecodeArgs *a, float *scores, int64_t orig, int64_t lp, int64_t col,
                         int64_t stride, float *part) {
    for (int64_t i = 0; i < a->Q; i++) {
        float *row = scores + i * stride;
        if (a->mask != NULL && col > lp) {
            const uint8_t *m = a->mask + (orig * a->Q + i) * a->mask_t;
            for (int64_t c = lp; c < col; c++)
                if (!m[c - lp]) row[c] = -INFINITY;
        }
        float top = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < col; c++) top = row[c] > top ? row[c] : top;
        for (int64_t c = 0; c < col; c++) {
            row[c] = top == -INFINITY ? 0.0f : expf(row[c] - top);
            total += row[c];
        }
        part[i * (a->d + 2)] = top;
        part[i * (a->d + 2) + 1] = total;
    }
}

/* the item's weighted values (unnormalised) into part[i * (d + 2) + 2 ...] */
static void item_values(const CkvDecodeArgs *a, Space *sp, const Item *it, int64_t stride, float *part) {
    Work *w = &sp->w;
    int64_t d = a->d, Q = a->Q, width = w->width, vg = a->vgroups, col = 0, s = it->s;
    memset(w->acc, 0, (size_t)(Q * d) * sizeof(float));
    memset(w->zacc, 0, (size_t)(Q * vg) * sizeof(float));
    for (int64_t k = it->k0; k < it->k1; k++) {
        int64_t e0 = a->blk_entry[k];
        block_values(w, a->p_vc + e0 * width, a->p_vs + e0 * vg, a->p_vz + e0 * vg, a->blk_len[k], sp->scores + col,
                     stride);
        col += a->blk_len[k];
    }
    if (it->with_tail) {
        for (int64_t b = 0; b < a->tail_used; b++) {
            int64_t blk = s * a->tail_cap + b;
            block_values(w, a->t_vc + blk * a->group * width, a->t_vs + blk * a->group * vg,
                         a->t_vz + blk * a->group * vg, a->group, sp->scores + col, stride);
            col += a->group;
        }
    }
    for (int64_t i = 0; i < Q; i++) {
        float *acc = w->acc + i * d, *o = part + i * (d + 2) + 2;
        if (it->with_tail) {
            for (int64_t e = 0; e < a->r; e++) {
                float p = sp->scores[i * stride + col + e];
                const float *v = a->res_v + s * a->res_stride + e * d;
                for (int64_t c = 0; c < d; c++) acc[c] += p * v[c];
            }
        }
        for (int64_t c = 0; c < d; c++) o[c] = acc[c] + w->zacc[i * vg + c / w->vgw];
    }
}

/* segment s's output rows from its items' partial softmaxes (log-sum-exp merge) */
static void merge_items(const CkvDecodeArgs *a, int64_t s, int64_t i0, int64_t i1, const float *parts) {
    int64_t d = a->d, Q = a->Q, row = Q * (d + 2);
    int64_t orig = a->perm == NULL ? s : a->perm[s];
    for (int64_t i = 0; i < Q; i++) {
        float *o = a->out + (orig * Q + i) * d;
        float top = -INFINITY, total = 0.0f;
        for (int64_t t = i0; t < i1; t++) top = parts[t * row + i * (d + 2)] > top ? parts[t * row + i * (d + 2)] : top;
        for (int64_t c = 0; c < d; c++) o[c] = 0.0f;
        if (top == -INFINITY) continue; /* nothing to attend to: zeros */
        for (int64_t t = i0; t < i1; t++) {
            const float *p = parts + t * row + i * (d + 2);
            if (p[0] == -INFINITY) continue;
            float scale = expf(p[0] - top);
            total += scale * p[1];
            for (int64_t c = 0; c < d; c++) o[c] += scale * p[2 + c];
        }
        float inv = 1.0f / total;
        for (int64_t c = 0; c < d; c++) o[c] *= inv;
    }
}

/* Returns 0; -1 if a workspace could not be allocated; -2 if the caller's struct has another size. */
int ckv_quantized_decode(const CkvDecodeArgs *a) {
    if (a == NULL || a->size != (int64_t)sizeof(CkvDecodeArgs)) return -2;
    int64_t blocks = a->seg_offsets[a->S] - a->seg_offsets[0];
    Item *items = (Item *)malloc((size_t)(blocks + a->S + 1) * sizeof(Item));
    int64_t *first = (int64_t *)malloc((size_t)(a->S + 1) * sizeof(int64_t));
    int64_t stride = 0;
    int64_t n = (items && first) ? make_items(a, items, first, &stride) : 0;
    float *parts = (items && first) ? (float *)malloc((size_t)(n * a->Q * (a->d + 2) + 1) * sizeof(float)) : NULL;
    int failed = parts == NULL;
    float scaling = (float)a->scaling;
    int threads = a->threads > 0 ? (int)a->threads : 1;
    if (!failed) {
#pragma omp parallel num_threads(threads)
    {
        Space sp;
        int ok = space_alloc(&sp, a, stride > 0 ? stride : 1) == 0;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n; t++) {
            if (!ok) continue;
            const Item *it = items + t;
            int64_t orig = a->perm == NULL ? it->s : a->perm[it->s];
            for (int64_t x = 0; x < a->Q * a->d; x++) sp.qv[x] = a->query[orig * a->Q * a->d + x] * scaling;
            int64_t lp = 0, col = item_scores(a, &sp, it, stride, &lp);
            float *part = parts + t * a->Q * (a->d + 2);
            item_softmax(a, sp.scores, orig, lp, col, stride, part);
            item_values(a, &sp, it, stride, part);
        }
        if (ok) free(sp.buf);
#pragma omp for schedule(static)
        for (int64_t s = 0; s < a->S; s++)
            if (!failed) merge_items(a, s, first[s], first[s + 1], parts);
    }
    }
    free(items);
    free(first);
    free(parts);
    return failed ? -1 : 0;
}
