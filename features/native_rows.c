/* Feature rows of tracked blocks: the native twin of FeatureState's numpy rows.
 *
 * kv_feature_rows fills one float32 row per slot, exactly as
 * features.state.FeatureState._rows_numpy does: every value is computed in the
 * type numpy computes it in (int64 differences, double products and quotients)
 * and rounded to float32 once, the same way. Nothing here calls a transcendental
 * function: the decay multipliers and the request-level rates come in computed by
 * numpy. Built with -ffp-contract=off (no fused multiply-add).
 *
 * Layout arguments (int64 arrays, see features/native_rows.py):
 * Arguments: slots, n; each state table (int64, int32, uint8, float32 columns) as
 * its address and row width; the layout (below); now_ms, num_requests; dbl; out.
 *
 *   src: LAST, CHILD, EXT, FIRST (int64 columns); REQORD, REQLEN, HITLEN, ROOT,
 *        COUNT, DEPTH, PARENT (int32 columns); FLAGS, TIERS (uint8 columns);
 *        k (gaps), num_hl (decayed counters), root_hl, num_direct, num_rl,
 *        then num_direct int32 source columns.
 *   dst: known, gap0, dec0, since_last, age, requests_since, blocks_to_tail,
 *        ever_tail, hit_fraction, child, ext, parent_time, parent_count,
 *        root_decayed, root_extended, tier_rank, then num_direct destinations,
 *        then num_rl request-level destinations.
 * The layout is one int64 array: src (at 0), then dst (at LAYOUT_DST), then the
 * float32 tier rank of each tier mask (16 values, at LAYOUT_TIER_RANKS, 8 int64
 * slots); dbl: missing, no_tier_rank, scale[num_hl], rates[num_rl].
 */
#include <stdint.h>

enum { S_LAST, S_CHILD, S_EXT, S_FIRST, S_REQORD, S_REQLEN, S_HITLEN, S_ROOT, S_COUNT,
       S_DEPTH, S_PARENT, S_FLAGS, S_TIERS, S_K, S_NUM_HL, S_ROOT_HL, S_NUM_DIRECT,
       S_NUM_RL, S_DIRECT0 };
enum { D_KNOWN, D_GAP0, D_DEC0, D_SINCE_LAST, D_AGE, D_REQUESTS_SINCE, D_TO_TAIL,
       D_EVER_TAIL, D_HIT_FRACTION, D_CHILD, D_EXT, D_PARENT_TIME, D_PARENT_COUNT,
       D_ROOT_DECAYED, D_ROOT_EXTENDED, D_TIER_RANK, D_DIRECT0 };

enum { LAYOUT_DST = 64, LAYOUT_TIER_RANKS = 128, LAYOUT_WIDTH = 136, LAYOUT_SIZE = 137 };

void kv_feature_rows(const int64_t *slots, int64_t n, const int64_t *i64, int64_t w64,
                     const int32_t *i32, int64_t w32, const uint8_t *u8, int64_t w8,
                     const float *f32, int64_t wf, const int64_t *layout, int64_t now,
                     int64_t num_requests, const double *dbl, float *out) {
    const int64_t *src = layout, *dst = layout + LAYOUT_DST;
    const float *tier_rank_of_mask = (const float *)(layout + LAYOUT_TIER_RANKS);
    const int64_t width = layout[LAYOUT_WIDTH];
    const int64_t k = src[S_K], num_hl = src[S_NUM_HL], root_hl = src[S_ROOT_HL];
    const int64_t num_direct = src[S_NUM_DIRECT], num_rl = src[S_NUM_RL];
    const float missing = (float)dbl[0], no_tier_rank = (float)dbl[1];
    const double *scale = dbl + 2, *rates = dbl + 2 + num_hl;
    const int64_t *rl_dst = dst + D_DIRECT0 + num_direct;
    for (int64_t r = 0; r < n; ++r) {
        float *o = out + r * width;
        const int64_t slot = slots[r];
        if (slot < 0) {
            for (int64_t c = 0; c < width; ++c) o[c] = missing;
            o[dst[D_KNOWN]] = 0.0f;
            o[dst[D_TIER_RANK]] = no_tier_rank;
        } else {
            const int64_t *I = i64 + slot * w64;
            const int32_t *J = i32 + slot * w32;
            const uint8_t *U = u8 + slot * w8;
            const float *F = f32 + slot * wf;
            const int32_t count = J[src[S_COUNT]];
            o[dst[D_KNOWN]] = 1.0f;
            /* A block read c times has c - 1 gaps; the rest of the register is noise. */
            for (int64_t g = 0; g < k; ++g)
                o[dst[D_GAP0] + g] = g < (int64_t)count - 1 ? F[g] : missing;
            for (int64_t h = 0; h < num_hl; ++h)
                o[dst[D_DEC0] + h] = (float)((double)F[k + h] * scale[h]);
            for (int64_t d = 0; d < num_direct; ++d)
                o[dst[D_DIRECT0 + d]] = (float)J[src[S_DIRECT0 + d]];
            o[dst[D_SINCE_LAST]] = (float)(now - I[src[S_LAST]]);
            o[dst[D_AGE]] = (float)(now - I[src[S_FIRST]]);
            o[dst[D_REQUESTS_SINCE]] = (float)(num_requests - (int64_t)J[src[S_REQORD]]);
            const int32_t reqlen = J[src[S_REQLEN]];
            o[dst[D_TO_TAIL]] = (float)(reqlen - 1 - J[src[S_DEPTH]]);
            o[dst[D_EVER_TAIL]] = (float)(U[src[S_FLAGS]] & 1);
            o[dst[D_HIT_FRACTION]] =
                (float)((double)J[src[S_HITLEN]] / (double)(reqlen > 1 ? reqlen : 1));
            /* CHILD and EXT hold ts + 1: zero means never. numpy's where() makes these
             * doubles first (an int64 beside a float), so they round through double. */
            const int64_t child = I[src[S_CHILD]], ext = I[src[S_EXT]];
            o[dst[D_CHILD]] = child > 0 ? (float)(double)(now + 1 - child) : missing;
            o[dst[D_EXT]] = ext > 0 ? (float)(double)(now + 1 - ext) : missing;
            const int32_t parent = J[src[S_PARENT]], root = J[src[S_ROOT]];
            if (parent >= 0) {
                o[dst[D_PARENT_TIME]] = (float)(double)(now - i64[parent * w64 + src[S_LAST]]);
                o[dst[D_PARENT_COUNT]] = (float)(double)i32[parent * w32 + src[S_COUNT]];
            } else {
                o[dst[D_PARENT_TIME]] = missing;
                o[dst[D_PARENT_COUNT]] = missing;
            }
            if (root >= 0) {
                const int64_t rext = i64[root * w64 + src[S_EXT]];
                o[dst[D_ROOT_DECAYED]] =
                    (float)((double)f32[root * wf + k + root_hl] * scale[root_hl]);
                o[dst[D_ROOT_EXTENDED]] = rext > 0 ? (float)(double)(now + 1 - rext) : missing;
            } else {
                o[dst[D_ROOT_DECAYED]] = missing;
                o[dst[D_ROOT_EXTENDED]] = missing;
            }
            o[dst[D_TIER_RANK]] = tier_rank_of_mask[U[src[S_TIERS]] & 15];
        }
        for (int64_t j = 0; j < num_rl; ++j) o[rl_dst[j]] = (float)rates[j];
    }
}

/* One request's update of its blocks' rows: the native twin of the numpy block at
 * the end of FeatureState._observe_access (_observe_rows_numpy), bit for bit. Rows
 * are gathered first and written back in request order, so a block read twice by
 * one request ends as numpy leaves it (the last position's copy wins).
 *
 * obs (int64): LAST, CHILD, EXT, FIRST (int64 columns); REQORD, COUNT, DEPTH, PARENT,
 *     NCHILD (int32 columns; REQORD..REQORD+7 are the per-request columns, ROOT
 *     last); FLAGS (uint8 column); k; num_hl; ever_tail flag.
 * vals (int64): the 7 per-request values before ROOT (request ordinal, length, input
 *     and output tokens, hit length, turn, turn gap), each within int32.
 * new_pos: positions of blocks new to the state, ascending.
 * scratch: n * (w64 * 8 + w32 * 4 + wf * 4) bytes.
 */
enum { O_LAST, O_CHILD, O_EXT, O_FIRST, O_REQORD, O_COUNT, O_DEPTH, O_PARENT, O_NCHILD,
       O_FLAGS, O_K, O_NUM_HL, O_EVER_TAIL };

void kv_observe_rows(const int64_t *sl, int64_t n, int64_t *i64, int64_t w64, int32_t *i32,
                     int64_t w32, uint8_t *u8, int64_t w8, float *f32, int64_t wf,
                     const int64_t *obs, int64_t t, const float *weights,
                     const int64_t *new_pos, int64_t num_new, const int64_t *vals,
                     int64_t *scored, unsigned char *scratch) {
    const int64_t k = obs[O_K], num_hl = obs[O_NUM_HL];
    int64_t *I = (int64_t *)scratch;
    int32_t *J = (int32_t *)(I + n * w64);
    float *F = (float *)(J + n * w32);
    for (int64_t i = 0; i < n; ++i) {
        for (int64_t c = 0; c < w64; ++c) I[i * w64 + c] = i64[sl[i] * w64 + c];
        for (int64_t c = 0; c < w32; ++c) J[i * w32 + c] = i32[sl[i] * w32 + c];
        for (int64_t c = 0; c < wf; ++c) F[i * wf + c] = f32[sl[i] * wf + c];
    }
    for (int64_t i = 0; i < n; ++i) {
        int64_t *Ii = I + i * w64;
        int32_t *Ji = J + i * w32;
        float *Fi = F + i * wf;
        for (int64_t g = k - 1; g >= 1; --g) Fi[g] = Fi[g - 1]; /* shift the gaps */
        if (k > 0) Fi[0] = (float)(t - Ii[obs[O_LAST]]);
        for (int64_t h = 0; h < num_hl; ++h) Fi[k + h] = Fi[k + h] + weights[h];
        Ii[obs[O_LAST]] = t;
        if (i < n - 1) Ii[obs[O_CHILD]] = t + 1;
    }
    /* A new block is first seen now, and a new child of the block before it. */
    for (int64_t j = 0; j < num_new; ++j) {
        const int64_t p = new_pos[j];
        I[p * w64 + obs[O_FIRST]] = t;
        if (p > 0) J[(p - 1) * w32 + obs[O_NCHILD]] += 1;
    }
    if (num_new > 0)
        for (int64_t i = 0; i < new_pos[num_new - 1]; ++i) I[i * w64 + obs[O_EXT]] = t + 1;
    for (int64_t i = 0; i < n; ++i) {
        int32_t *Ji = J + i * w32;
        for (int64_t v = 0; v < 7; ++v) Ji[obs[O_REQORD] + v] = (int32_t)vals[v];
        Ji[obs[O_REQORD] + 7] = (int32_t)sl[0];
        Ji[obs[O_COUNT]] += 1;
        Ji[obs[O_DEPTH]] = (int32_t)i;
        Ji[obs[O_PARENT]] = i == 0 ? -1 : (int32_t)sl[i - 1];
    }
    for (int64_t i = 0; i < n; ++i) {
        for (int64_t c = 0; c < w64; ++c) i64[sl[i] * w64 + c] = I[i * w64 + c];
        for (int64_t c = 0; c < w32; ++c) i32[sl[i] * w32 + c] = J[i * w32 + c];
        for (int64_t c = 0; c < wf; ++c) f32[sl[i] * wf + c] = F[i * wf + c];
        scored[sl[i]] = 0;
    }
    u8[sl[n - 1] * w8 + obs[O_FLAGS]] |= (uint8_t)obs[O_EVER_TAIL];
}
