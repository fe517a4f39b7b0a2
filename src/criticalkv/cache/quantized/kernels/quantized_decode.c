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
 * Returns 0, or -1 if a workspace could not be allocated.
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
 */
int ckv_quantized_decode(int64_t S, int64_t Q, int64_t d, int64_t bits, int64_t group, int64_t vgroups,
                         const float *query, const int64_t *perm, float scaling, const uint8_t *p_kc, const uint8_t *p_vc,
                         const uint16_t *p_vs, const uint16_t *p_vz, const uint16_t *p_ks,
                         const uint16_t *p_kz, const int64_t *seg_offsets, const int64_t *blk_entry,
                         const int64_t *blk_row, const int64_t *blk_len, int64_t tail_used,
                         int64_t tail_cap, const uint8_t *t_kc, const uint16_t *t_ks,
                         const uint16_t *t_kz, const uint8_t *t_vc, const uint16_t *t_vs,
                         const uint16_t *t_vz, int64_t r, int64_t res_stride, const float *res_k,
                         const float *res_v, const uint8_t *mask, int64_t mask_t, float *out) {
    int64_t width = d * bits / 8;
    int64_t longest = 0;
    for (int64_t s = 0; s < S; s++) {
        int64_t n = 0;
        for (int64_t k = seg_offsets[s]; k < seg_offsets[s + 1]; k++) n += blk_len[k];
        if (n > longest) longest = n;
    }
    int64_t stride = longest + tail_used * group + r; /* score columns of the longest segment */
    size_t floats = (size_t)(Q * stride + 3 * Q * d + Q + d + Q * vgroups + Q * d + 1);
    float *buf = (float *)malloc(floats * sizeof(float));
    if (buf == NULL) return -1;
    float *scores = buf, *qv = scores + Q * stride;
    Work w = {d, bits, width, vgroups, d / vgroups, Q, qv + Q * d, 0, 0, 0, 0};
    w.qz = w.qs + Q * d;
    w.unp = w.qz + Q;
    w.acc = w.unp + d;
    w.zacc = w.acc + Q * d;
    int64_t tblock_codes = group * width, tblock_vstats = group * vgroups;
    for (int64_t s = 0; s < S; s++) {
        int64_t orig = perm == NULL ? s : perm[s];
        for (int64_t x = 0; x < Q * d; x++) qv[x] = query[orig * Q * d + x] * scaling;
        /* scores: prefix blocks, then tail blocks, then the residual */
        int64_t col = 0;
        for (int64_t k = seg_offsets[s]; k < seg_offsets[s + 1]; k++) {
            block_scores(&w, qv, p_kc + blk_entry[k] * width, p_ks + blk_row[k] * d, p_kz + blk_row[k] * d,
                         blk_len[k], scores + col, stride);
            col += blk_len[k];
        }
        int64_t lp = col;
        for (int64_t b = 0; b < tail_used; b++) {
            int64_t blk = s * tail_cap + b;
            block_scores(&w, qv, t_kc + blk * tblock_codes, t_ks + blk * d, t_kz + blk * d, group,
                         scores + col, stride);
            col += group;
        }
        for (int64_t e = 0; e < r; e++) {
            const float *k = res_k + s * res_stride + e * d;
            for (int64_t i = 0; i < Q; i++) scores[i * stride + col + e] = dot(qv + i * d, k, d);
        }
        col += r;
        /* softmax per row, the tail's columns under the mask */
        for (int64_t i = 0; i < Q; i++) {
            float *row = scores + i * stride;
            if (mask != NULL) {
                const uint8_t *m = mask + (orig * Q + i) * mask_t;
                for (int64_t c = lp; c < col; c++)
                    if (!m[c - lp]) row[c] = -INFINITY;
            }
            float top = -INFINITY;
            for (int64_t c = 0; c < col; c++) top = row[c] > top ? row[c] : top;
            if (top == -INFINITY) { /* nothing to attend to: zeros */
                for (int64_t c = 0; c < col; c++) row[c] = 0.0f;
                continue;
            }
            float total = 0.0f;
            for (int64_t c = 0; c < col; c++) {
                row[c] = expf(row[c] - top);
                total += row[c];
            }
            float inv = 1.0f / total;
            for (int64_t c = 0; c < col; c++) row[c] *= inv;
        }
        /* values, in the same column order */
        memset(w.acc, 0, (size_t)(Q * d) * sizeof(float));
        memset(w.zacc, 0, (size_t)(Q * vgroups) * sizeof(float));
        col = 0;
        for (int64_t k = seg_offsets[s]; k < seg_offsets[s + 1]; k++) {
            int64_t e0 = blk_entry[k];
            block_values(&w, p_vc + e0 * width, p_vs + e0 * vgroups, p_vz + e0 * vgroups, blk_len[k],
                         scores + col, stride);
            col += blk_len[k];
        }
        for (int64_t b = 0; b < tail_used; b++) {
            int64_t blk = s * tail_cap + b;
            block_values(&w, t_vc + blk * tblock_codes, t_vs + blk * tblock_vstats, t_vz + blk * tblock_vstats,
                         group, scores + col, stride);
            col += group;
        }
        float *o = out + orig * Q * d;
        for (int64_t i = 0; i < Q; i++) {
            float *a = w.acc + i * d;
            for (int64_t e = 0; e < r; e++) {
                float p = scores[i * stride + col + e];
                const float *v = res_v + s * res_stride + e * d;
                for (int64_t c = 0; c < d; c++) a[c] += p * v[c];
            }
            for (int64_t c = 0; c < d; c++) o[i * d + c] = a[c] + w.zacc[i * vgroups + c / w.vgw];
        }
    }
    free(buf);
    return 0;
}
