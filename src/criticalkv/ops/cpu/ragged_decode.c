/*
 * The CPU implementation of torch.ops.criticalkv.ragged_decode (criticalkv/ops/ragged_decode.py has
 * the layout), one call per layer and step.
 *
 * For every sequence (a batch row and KV head) and its Q query rows, the scores over the sequence's
 * own entries (no padding): its blocks read through the block table (block b holds pool rows
 * [start_b, start_b + block_size), start_b = entry_starts[b] or b * block_size; the last block may be
 * partial), then the dense float32 tail under the tail mask. Then an exact max-subtracted softmax
 * per row and the probability-weighted values, float32 accumulation throughout. A row with nothing
 * to attend to gives zeros.
 *
 * Entries: float32 (bits 32: the op's 16-bit storage in float32), or codes c in [0, 2^bits - 1]
 * (bits 8 or 4), x = c * scale + zero with float16 scale and zero point. Keys: per channel over a
 * block (one scale and zero point per block and channel); values: per entry over groups of
 * vgw = d / vgroups consecutive channels (KIVI's grouping). 4-bit codes two a byte, channel 2j in
 * the low nibble of byte j, channel 2j + 1 in the high one.
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
#pragma omp simd reduction(+ : acc)
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
    if (w->bits == 32) { /* float32 entries: plain dot products */
        const float *k = (const float *)kc;
        for (int64_t e = 0; e < len; e++)
            for (int64_t i = 0; i < w->Q; i++) scores[i * stride + e] = dot(q + i * d, k + e * d, d);
        return;
    }
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
    if (w->bits == 32) {
        const float *v = (const float *)vc;
        for (int64_t e = 0; e < len; e++)
            for (int64_t i = 0; i < w->Q; i++) {
                float p = probs[i * stride + e];
                float *a = w->acc + i * d;
                for (int64_t c = 0; c < d; c++) a[c] += p * v[e * d + c];
            }
        return;
    }
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
 * The arguments of one call, laid out once here and once in ops/cpu/args.py (DecodeArgs, a
 * ctypes.Structure with the same fields in the same order): every argument is named and typed, and
 * `size` (sizeof as the caller laid it out) is checked before anything is read, so a caller built
 * against another layout is refused (-2) instead of corrupting memory.
 *
 * query (S, Q, d) float32 and out (S, Q, d) float32. Pool: keys/values (P, d) float32 (bits 32) or
 * codes (P, width) uint8; value scale/zero (P, vgroups) float16 bits; key scale/zero (P / block_size,
 * d). Block table (S, M) int32, lengths (S,) int32, entry_starts (NB,) int32 or NULL. Tail: t float32
 * entries of d per sequence, sequence s's at tail_k + s * tail_stride (a slice of a larger buffer is read in place); mask (S, Q, t) uint8 (1: attend) or
 * NULL: attend to all. P: pool rows; NB: pool blocks (rows of the key statistics). threads: work
 * items are shared among this many OpenMP threads. Every block the lengths reach is checked to lie
 * inside the pool before anything is read (-3 otherwise).
 */
typedef struct {
    int64_t size;
    int64_t S, Q, d, bits, block_size, vgroups, M, P, NB, threads;
    double scaling;
    const float *query;
    const uint8_t *p_k, *p_v;
    const uint16_t *p_vs, *p_vz, *p_ks, *p_kz;
    const int32_t *table, *lengths, *entry_starts;
    int64_t t, tail_stride;
    const float *tail_k, *tail_v;
    const uint8_t *mask;
    float *out;
} CkvDecodeArgs;

int64_t ckv_decode_args_size(void) { return (int64_t)sizeof(CkvDecodeArgs); }

/* one thread's workspace over score columns of `stride` (the widest item's) */
typedef struct {
    float *buf, *scores, *qv;
    Work w;
} Space;

static int64_t row_width(const CkvDecodeArgs *a) { return a->bits == 32 ? a->d * 4 : a->d * a->bits / 8; }

static int space_alloc(Space *sp, const CkvDecodeArgs *a, int64_t stride) {
    int64_t Q = a->Q, d = a->d;
    size_t floats = (size_t)(Q * stride + 3 * Q * d + Q + d + Q * a->vgroups + Q * d + 1);
    sp->buf = (float *)malloc(floats * sizeof(float));
    if (sp->buf == NULL) return -1;
    sp->scores = sp->buf;
    sp->qv = sp->scores + Q * stride;
    Work w = {d, a->bits, row_width(a), a->vgroups, d / a->vgroups, Q, sp->qv + Q * d, 0, 0, 0, 0};
    w.qz = w.qs + Q * d;
    w.unp = w.qz + Q;
    w.acc = w.unp + d;
    w.zacc = w.acc + Q * d;
    sp->w = w;
    return 0;
}

/* One work item: blocks [j0, j1) of sequence s's row of the block table, and, for its last item,
 * the tail. Long sequences are cut into several items (split-K) so that threads share even one
 * sequence; each item's softmax is merged exactly afterwards. */
typedef struct {
    int64_t s, j0, j1, with_tail;
} Item;

/* entries per item before a sequence is cut: enough work per item, items enough for threads */
#define ITEM_ENTRIES 256

static int64_t blocks_of(const CkvDecodeArgs *a, int64_t s) {
    int64_t n = (a->lengths[s] + a->block_size - 1) / a->block_size;
    return n < a->M ? n : a->M;
}

static int64_t block_len(const CkvDecodeArgs *a, int64_t s, int64_t j) {
    int64_t left = a->lengths[s] - j * a->block_size;
    return left < a->block_size ? left : a->block_size;
}

static int64_t block_start(const CkvDecodeArgs *a, int64_t b) {
    return a->entry_starts != NULL ? (int64_t)a->entry_starts[b] : b * a->block_size;
}

/* entries from block j of sequence s on, read as one run; *next is the block after it. Float32
 * entries (no statistics) coalesce blocks that follow each other in the pool (the 16-bit layouts'
 * one-entry blocks of a tier are consecutive rows); codes go a block at a time (own statistics). */
static int64_t run_of(const CkvDecodeArgs *a, int64_t s, int64_t j, int64_t j1, int64_t *next) {
    int64_t len = block_len(a, s, j), end = block_start(a, a->table[s * a->M + j]) + len;
    *next = j + 1;
    if (a->bits != 32) return len;
    while (*next < j1 && block_start(a, a->table[s * a->M + *next]) == end) {
        int64_t more = block_len(a, s, *next);
        len += more;
        end += more;
        *next += 1;
    }
    return len;
}

/* whether every block that sequence s's length reaches lies inside the pool */
static int sequence_fits(const CkvDecodeArgs *a, int64_t s) {
    if (a->lengths[s] < 0 || a->lengths[s] > a->M * a->block_size) return 0;
    for (int64_t j = 0; j < blocks_of(a, s); j++) {
        int64_t b = a->table[s * a->M + j];
        if (b < 0 || b >= a->NB) return 0;
        int64_t start = block_start(a, b);
        if (start < 0 || start + block_len(a, s, j) > a->P) return 0;
    }
    return 1;
}

/* the work items of every sequence in order; returns their count (items has room for S * (M + 1)),
 * or -1 if a sequence reaches outside the pool */
static int64_t make_items(const CkvDecodeArgs *a, Item *items, int64_t *first, int64_t *widest) {
    int64_t n = 0;
    *widest = 0;
    for (int64_t s = 0; s < a->S; s++) {
        if (!sequence_fits(a, s)) return -1;
        first[s] = n;
        int64_t j0 = 0, entries = 0, nb = blocks_of(a, s);
        for (int64_t j = 0; j < nb; j++) {
            entries += block_len(a, s, j);
            if (entries >= ITEM_ENTRIES && j + 1 < nb) {
                items[n++] = (Item){s, j0, j + 1, 0};
                *widest = entries > *widest ? entries : *widest;
                j0 = j + 1;
                entries = 0;
            }
        }
        items[n++] = (Item){s, j0, nb, 1};
        *widest = entries + a->t > *widest ? entries + a->t : *widest;
    }
    first[a->S] = n;
    return n;
}

/* scores of one item's columns: its blocks, then (last item) the tail; sets *lp to the blocks' columns */
static int64_t item_scores(const CkvDecodeArgs *a, Space *sp, const Item *it, int64_t stride, int64_t *lp) {
    const Work *w = &sp->w;
    int64_t d = a->d, Q = a->Q, width = w->width, col = 0, s = it->s;
    for (int64_t j = it->j0, next; j < it->j1; j = next) {
        int64_t b = a->table[s * a->M + j], start = block_start(a, b), len = run_of(a, s, j, it->j1, &next);
        const uint16_t *ks = a->p_ks == NULL ? NULL : a->p_ks + b * d, *kz = a->p_kz == NULL ? NULL : a->p_kz + b * d;
        block_scores(w, sp->qv, a->p_k + start * width, ks, kz, len, sp->scores + col, stride);
        col += len;
    }
    *lp = col;
    if (!it->with_tail) return col;
    for (int64_t e = 0; e < a->t; e++) {
        const float *k = a->tail_k + s * a->tail_stride + e * d;
        for (int64_t i = 0; i < Q; i++) sp->scores[i * stride + col + e] = dot(sp->qv + i * d, k, d);
    }
    return col + a->t;
}

/* unnormalised softmax of each query row over `col` columns (the tail's, from lp, under the mask):
 * exp(x - max) in place; the row's max and sum go to part[i * (d + 2)] and [+ 1] (-inf, 0: none) */
static void item_softmax(const CkvDecodeArgs *a, float *scores, int64_t s, int64_t lp, int64_t col, int64_t stride,
                         float *part) {
    for (int64_t i = 0; i < a->Q; i++) {
        float *row = scores + i * stride;
        if (a->mask != NULL && col > lp) {
            const uint8_t *m = a->mask + (s * a->Q + i) * a->t;
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
    for (int64_t j = it->j0, next; j < it->j1; j = next) {
        int64_t e0 = block_start(a, a->table[s * a->M + j]), len = run_of(a, s, j, it->j1, &next);
        const uint16_t *vs = a->p_vs == NULL ? NULL : a->p_vs + e0 * vg, *vz = a->p_vz == NULL ? NULL : a->p_vz + e0 * vg;
        block_values(w, a->p_v + e0 * width, vs, vz, len, sp->scores + col, stride);
        col += len;
    }
    for (int64_t i = 0; i < Q; i++) {
        float *acc = w->acc + i * d, *o = part + i * (d + 2) + 2;
        if (it->with_tail) {
            for (int64_t e = 0; e < a->t; e++) {
                float p = sp->scores[i * stride + col + e];
                const float *v = a->tail_v + s * a->tail_stride + e * d;
                for (int64_t c = 0; c < d; c++) acc[c] += p * v[c];
            }
        }
        for (int64_t c = 0; c < d; c++) o[c] = acc[c] + (w->bits == 32 ? 0.0f : w->zacc[i * vg + c / w->vgw]);
    }
}

/* sequence s's output rows from its items' partial softmaxes (log-sum-exp merge) */
static void merge_items(const CkvDecodeArgs *a, int64_t s, int64_t i0, int64_t i1, const float *parts) {
    int64_t d = a->d, Q = a->Q, row = Q * (d + 2);
    for (int64_t i = 0; i < Q; i++) {
        float *o = a->out + (s * Q + i) * d;
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

/* Returns 0; -1 if a workspace could not be allocated; -2 if the caller's struct has another size;
 * -3 if the block table reaches outside the pool (nothing is read then). */
int ckv_ragged_decode(const CkvDecodeArgs *a) {
    if (a == NULL || a->size != (int64_t)sizeof(CkvDecodeArgs)) return -2;
    Item *items = (Item *)malloc((size_t)(a->S * (a->M + 1) + 1) * sizeof(Item));
    int64_t *first = (int64_t *)malloc((size_t)(a->S + 1) * sizeof(int64_t));
    int64_t stride = 0;
    int64_t n = (items && first) ? make_items(a, items, first, &stride) : 0;
    if (n < 0) {
        free(items);
        free(first);
        return -3;
    }
    float *parts = (items && first) ? (float *)malloc((size_t)(n * a->Q * (a->d + 2) + 1) * sizeof(float)) : NULL;
    int failed = parts == NULL;
    float scaling = (float)a->scaling;
    int threads = a->threads > 0 ? (int)a->threads : 1;
    if (!failed) {
#pragma omp parallel num_threads(threads)
    {
        Space sp = {0};
        int ok = space_alloc(&sp, a, stride > 0 ? stride : 1) == 0;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n; t++) {
            if (!ok) continue;
            const Item *it = items + t;
            for (int64_t x = 0; x < a->Q * a->d; x++) sp.qv[x] = a->query[it->s * a->Q * a->d + x] * scaling;
            int64_t lp = 0, col = item_scores(a, &sp, it, stride, &lp);
            float *part = parts + t * a->Q * (a->d + 2);
            item_softmax(a, sp.scores, it->s, lp, col, stride, part);
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
