// The page walk: page-list decode attention a warp a page, then one merge of the pages'
// partials (kernels/NOTES.md, session 75). attn-op routes a page-list launch here where its
// rows are few enough for one wave (B1 long-context steps), where it hands data between
// multiprocessors once and the tensor-core kernel's split walk and split merge twice: on an
// H200 B1 L128K's Quest step took 23.7 µs with it and 25.0 without (BENCHMARKS.md).
//
// Shapes: 16-bit KV, head dim 128, 4 query heads a KV head, KV pages (blocks) of 16 tokens,
// decode rows (one query a sequence), no window or sinks. Arithmetic in f32 throughout, with
// the scores and weights in base 2.
//
// `walk_pages_<type>` writes one normalized partial per place of a row: the group's four query
// rows over that page's tokens, [rows, width, 4, 128] f32, and their natural-log LSEs [rows,
// width, 4] (-inf for a place past the row's length, or a page outside the sequence or the
// pool). `walk_merge` merges a row's partials into out [total_q, q_heads, 128] and lse
// [total_q, q_heads].

#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef int i32;

#define WALK_D 128
#define WALK_G 4
#define WALK_PS 16
#define WALK_NEG_INF (-__int_as_float(0x7f800000))
#define WALK_LN2 0.6931471805599453f
#define WALK_LOG2E 1.4426950408889634f
#define WALK_FULL 0xffffffffu
// Warps of a merging CTA, and the partials each warp loads at once (kernels/NOTES.md, session
// 76).
#define WALK_MERGE_WARPS 16
#define WALK_BATCH 8

__device__ __forceinline__ float walk_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float walk_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Four 16-bit elements (little-endian in two words) widened to f32.
__device__ __forceinline__ void walk_widen4(const __nv_bfloat16*, uint2 w, float* f) {
    f[0] = __uint_as_float(w.x << 16);
    f[1] = __uint_as_float(w.x & 0xffff0000u);
    f[2] = __uint_as_float(w.y << 16);
    f[3] = __uint_as_float(w.y & 0xffff0000u);
}

__device__ __forceinline__ void walk_widen4(const __half*, uint2 w, float* f) {
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&w.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&w.y));
    f[0] = a.x;
    f[1] = a.y;
    f[2] = b.x;
    f[3] = b.y;
}

// One round of a warp's transpose-reduction: 2C values a lane become C, each the sum over the
// two lanes that differ in bit O of value k (lanes with the bit set keep the upper half).
template <int C, int O>
__device__ __forceinline__ void walk_fold(float* s, int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int k = 0; k < C; k++) {
        const float lo = s[k], hi = s[k + C];
        const float send = up ? lo : hi;
        const float keep = up ? hi : lo;
        s[k] = keep + __shfl_xor_sync(WALK_FULL, send, O);
    }
}

// One warp: the normalized partial of one page (pool block `block`, its first `valid` tokens)
// of KV head h for NH query heads, whose queries (scaled by the softmax scale and log2 e) this
// lane holds for dims 4 lane .. 4 lane + 3. Writes out_o[hq * 128 + d] and out_lse[hq] (natural
// log). p is this warp's 64 floats of shared memory.
template <typename T, int NH>
__device__ __forceinline__ void walk_page(const float (&qs)[NH][4], const uint2* __restrict__ kc,
                                          const uint2* __restrict__ vc, i32 block, i32 valid,
                                          i32 kv_heads, i32 h, float* __restrict__ out_o,
                                          float* __restrict__ out_lse, float* p) {
    const T* tag = nullptr;
    const int lane = threadIdx.x & 31;
    const size_t step = (size_t)kv_heads * (WALK_D / 4);
    const size_t base = (size_t)block * WALK_PS * step + (size_t)h * (WALK_D / 4) + lane;
    uint2 kr[WALK_PS], vr[WALK_PS];
#pragma unroll
    for (int j = 0; j < WALK_PS; j++) kr[j] = j < valid ? kc[base + j * step] : make_uint2(0u, 0u);
#pragma unroll
    for (int j = 0; j < WALK_PS; j++) vr[j] = j < valid ? vc[base + j * step] : make_uint2(0u, 0u);
    // s[hq * 16 + j]: this lane's part of query head hq's score of key j.
    float s[NH * WALK_PS];
#pragma unroll
    for (int j = 0; j < WALK_PS; j++) {
        float k[4];
        walk_widen4(tag, kr[j], k);
#pragma unroll
        for (int hq = 0; hq < NH; hq++)
            s[hq * WALK_PS + j] =
                qs[hq][0] * k[0] + qs[hq][1] * k[1] + qs[hq][2] * k[2] + qs[hq][3] * k[3];
    }
    // Reduced over the warp: with NH = 4 lane l ends with scores 2 l and 2 l + 1 (head l / 8,
    // keys 2 (l % 8) and 2 (l % 8) + 1); with NH = 1 with score l / 2 (both lanes of a pair).
    float a, b;
    int j0;
    if constexpr (NH == 4) {
        walk_fold<32, 16>(s, lane);
        walk_fold<16, 8>(s, lane);
        walk_fold<8, 4>(s, lane);
        walk_fold<4, 2>(s, lane);
        walk_fold<2, 1>(s, lane);
        j0 = 2 * (lane & 7);
        a = j0 < valid ? s[0] : WALK_NEG_INF;
        b = j0 + 1 < valid ? s[1] : WALK_NEG_INF;
    } else {
        walk_fold<8, 16>(s, lane);
        walk_fold<4, 8>(s, lane);
        walk_fold<2, 4>(s, lane);
        walk_fold<1, 2>(s, lane);
        s[0] += __shfl_xor_sync(WALK_FULL, s[0], 1);
        j0 = lane >> 1;
        // Each score sits in two lanes: the odd one stands aside from the sums.
        a = (j0 < valid && (lane & 1) == 0) ? s[0] : WALK_NEG_INF;
        b = WALK_NEG_INF;
    }
    // The row maximum and sum over the lanes of one query head (8 lanes, or all 32).
    float m = fmaxf(a, b);
    const int span = NH == 4 ? 8 : 32;
#pragma unroll
    for (int o = 1; o < span; o <<= 1) m = fmaxf(m, __shfl_xor_sync(WALK_FULL, m, o));
    const float pa = walk_exp2(a - m), pb = walk_exp2(b - m);
    float l = pa + pb;
#pragma unroll
    for (int o = 1; o < span; o <<= 1) l += __shfl_xor_sync(WALK_FULL, l, o);
    if constexpr (NH == 4) {
        p[2 * lane] = pa;
        p[2 * lane + 1] = pb;
    } else if ((lane & 1) == 0) {
        p[j0] = pa;
    }
    __syncwarp();
    float acc[NH][4];
#pragma unroll
    for (int hq = 0; hq < NH; hq++)
#pragma unroll
        for (int d = 0; d < 4; d++) acc[hq][d] = 0.0f;
#pragma unroll
    for (int j = 0; j < WALK_PS; j++) {
        float v[4];
        walk_widen4(tag, vr[j], v);
#pragma unroll
        for (int hq = 0; hq < NH; hq++) {
            const float w = p[hq * WALK_PS + j];
#pragma unroll
            for (int d = 0; d < 4; d++) acc[hq][d] += w * v[d];
        }
    }
#pragma unroll
    for (int hq = 0; hq < NH; hq++) {
        const float lh = __shfl_sync(WALK_FULL, l, hq * 8);
        const float mh = __shfl_sync(WALK_FULL, m, hq * 8);
        const float inv = 1.0f / lh;
        reinterpret_cast<float4*>(out_o + hq * WALK_D)[lane] =
            make_float4(acc[hq][0] * inv, acc[hq][1] * inv, acc[hq][2] * inv, acc[hq][3] * inv);
        if (lane == 0) out_lse[hq] = (mh + walk_log2(lh)) * WALK_LN2;
    }
    __syncwarp();
}

// The pool block of page `page` of a sequence whose block-table row is `table` (in global or
// shared memory), and its valid tokens; -1 where the page is outside the sequence, the table or
// the pool.
__device__ __forceinline__ i32 walk_block(const i32* table, i32 max_blocks, i32 num_blocks,
                                          i32 page, i32 kv_len, i32* valid) {
    *valid = min(WALK_PS, kv_len - page * WALK_PS);
    if (page < 0 || page >= max_blocks || *valid <= 0) return -1;
    const i32 b = table[page];
    return (b >= 0 && b < num_blocks) ? b : -1;
}

// Query head h * 4 + hq0 + i (i < NH) of query row qrow, scaled, for this lane's dims.
template <typename T, int NH>
__device__ __forceinline__ void walk_queries(const T* __restrict__ q, i32 qrow, i32 q_heads,
                                             i32 h, i32 hq0, float scale2, float (&qs)[NH][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < NH; i++) {
        const uint2 w = reinterpret_cast<const uint2*>(
            q + ((size_t)qrow * q_heads + h * WALK_G + hq0 + i) * WALK_D)[lane];
        walk_widen4(q, w, qs[i]);
#pragma unroll
        for (int d = 0; d < 4; d++) qs[i][d] *= scale2;
    }
}

// Stages `n` i32 from global `src` into shared `dst` with the CTA's threads: 16-byte loads,
// eight in flight a thread, where `n` and `src`'s place allow them.
__device__ __forceinline__ void walk_stage(const i32* __restrict__ src, i32* dst, int n) {
    if ((n & 3) == 0 && ((size_t)src & 15) == 0) {
        const int n4 = n / 4;
        for (int t0 = threadIdx.x; t0 < n4; t0 += blockDim.x * 8) {
            int4 r[8];
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (t0 + u * (int)blockDim.x < n4)
                    r[u] = reinterpret_cast<const int4*>(src)[t0 + u * blockDim.x];
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (t0 + u * (int)blockDim.x < n4)
                    reinterpret_cast<int4*>(dst)[t0 + u * blockDim.x] = r[u];
        }
    } else {
        for (int t = threadIdx.x; t < n; t += blockDim.x) dst[t] = src[t];
    }
}

// Grid (ceil(width / 4), rows); 4 warps, warp w of CTA x taking place 4 x + w of its row
// (sequence row / kv_heads, KV head row % kv_heads). With `staged`, the launch gives max_blocks
// i32 of dynamic shared memory (`table`), and the sequence's block-table row is staged there
// before the wait for the launch that writes the selection (the table is not that launch's to
// write); else pages are looked up in global memory. With PUB (`walk_pages_pub_*`, a published
// selection, pdl.cuh) the CTA signals first, loads its queries too, and then reads its ids
// from the row's tagged copy (`tags`, [rows, width]) once they hold the step's value, *epoch,
// instead of waiting for the launch before.
template <typename T, bool PUB>
__device__ __forceinline__ void walk_pages_body(
    const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
    const i32* __restrict__ cu_q, const i32* __restrict__ kv_lens,
    const i32* __restrict__ block_table, i32 max_blocks, i32 num_blocks, i32 kv_heads,
    i32 q_heads, const i32* __restrict__ ids, const i32* __restrict__ lens, i32 width,
    float scale2, float* __restrict__ part_o, float* __restrict__ part_lse, i32 staged,
    const unsigned long long* __restrict__ tags, const unsigned* __restrict__ epoch,
    i32* table) {
    __shared__ float p_smem[4][64];
    // What the CTA's warps share, loaded once for all four: the sequence's query row and KV
    // length, the row's length, and the CTA's four page ids.
    __shared__ i32 s_seq[2];
    __shared__ i32 s_len;
    __shared__ i32 s_ids[4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.y;
    const int seq = row / kv_heads, h = row % kv_heads;
    const i32* seq_table = block_table + (size_t)seq * max_blocks;
    if (staged) walk_stage(seq_table, table, max_blocks);
    // The sequence's query row and KV length, which only the host uploads, are read before
    // the wait too (through L2: ptxas may sink a read-only load past the wait).
    if (threadIdx.x < 2)
        s_seq[threadIdx.x] = __ldcg(threadIdx.x == 0 ? cu_q + seq + 1 : kv_lens + seq);
    float qs[WALK_G][4];
    const int first = blockIdx.x * 4;
    const int mine = first + (int)threadIdx.x;
    if (PUB) {
        // The queries were complete before the selection's scoring began: they are loaded
        // now. Then warp 0's first lanes each poll their place's tagged id (pdl.cuh) until it
        // holds this step's value; padding is tagged too, so the row's length is not read.
        pdl_launch_dependents();
        walk_queries<T, WALK_G>(q, __ldcg(cu_q + seq + 1) - 1, q_heads, h, 0, scale2, qs);
        if (threadIdx.x < 4) {
            i32 id = -1;
            if (mine < width) {
                const unsigned step = __ldcg(epoch);
                const unsigned long long* p = tags + (size_t)row * width + mine;
                unsigned long long w = load_tagged(p);
                // 64 ns between polls, half poll_flag's sleep (a place is one 8-byte load).
                while ((unsigned)(w >> 32) != step) {
                    __nanosleep(64);
                    w = load_tagged(p);
                }
                id = (i32)(unsigned)w;
            }
            s_ids[threadIdx.x] = id;
            if (threadIdx.x == 0) s_len = width;
        }
    } else {
        pdl_wait();
        pdl_launch_dependents();
        // The row's length and the CTA's ids, which the launch before wrote: read past L1, a
        // load for the CTA rather than one a warp (a row's 32 CTAs read one length).
        if (threadIdx.x < 4) {
            // Both loads in flight before either store (the four lanes' length loads are one
            // request).
            const i32 id = mine < width ? __ldcg(ids + (size_t)row * width + mine) : -1;
            const i32 len = __ldcg(lens + row);
            s_ids[threadIdx.x] = id;
            if (threadIdx.x == 0) s_len = len;
        }
    }
    __syncthreads();
    const int i = first + warp;
    if (i >= width) return;
    const size_t at = (size_t)row * width + i;
    const i32 qrow = s_seq[0] - 1, kv_len = s_seq[1];
    const i32 n = s_len, id = s_ids[warp];
    float* o = part_o + at * WALK_G * WALK_D;
    float* lse = part_lse + at * WALK_G;
    i32 valid;
    const i32 page = i < n ? id : -1;
    const i32 block = staged ? walk_block(table, max_blocks, num_blocks, page, kv_len, &valid)
                             : walk_block(seq_table, max_blocks, num_blocks, page, kv_len, &valid);
    if (block < 0) {
        // An empty partial: its LSE alone, as the merge skips an empty partial's output.
        if (lane < WALK_G) lse[lane] = WALK_NEG_INF;
        return;
    }
    if (!PUB) walk_queries<T, WALK_G>(q, qrow, q_heads, h, 0, scale2, qs);
    walk_page<T, WALK_G>(qs, reinterpret_cast<const uint2*>(kc), reinterpret_cast<const uint2*>(vc),
                         block, valid, kv_heads, h, o, lse, p_smem[warp]);
}

// walk_pages_<type> and, over a published selection, walk_pages_pub_<type> (its tags and step
// value last).
#define WALK_PAGES(TN, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(128) walk_pages_##TN(                        \
        const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,          \
        const i32* __restrict__ cu_q, const i32* __restrict__ kv_lens,                        \
        const i32* __restrict__ block_table, i32 max_blocks, i32 num_blocks, i32 kv_heads,    \
        i32 q_heads, const i32* __restrict__ ids, const i32* __restrict__ lens, i32 width,    \
        float scale2, float* __restrict__ part_o, float* __restrict__ part_lse, i32 staged) { \
        extern __shared__ __align__(16) i32 walk_table[];                                     \
        walk_pages_body<T, false>(q, kc, vc, cu_q, kv_lens, block_table, max_blocks,          \
                                  num_blocks, kv_heads, q_heads, ids, lens, width, scale2,    \
                                  part_o, part_lse, staged, nullptr, nullptr, walk_table);    \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) walk_pages_pub_##TN(                    \
        const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,          \
        const i32* __restrict__ cu_q, const i32* __restrict__ kv_lens,                        \
        const i32* __restrict__ block_table, i32 max_blocks, i32 num_blocks, i32 kv_heads,    \
        i32 q_heads, const i32* __restrict__ ids, const i32* __restrict__ lens, i32 width,    \
        float scale2, float* __restrict__ part_o, float* __restrict__ part_lse, i32 staged,   \
        const unsigned long long* __restrict__ tags, const unsigned* __restrict__ epoch) {    \
        extern __shared__ __align__(16) i32 walk_table[];                                     \
        walk_pages_body<T, true>(q, kc, vc, cu_q, kv_lens, block_table, max_blocks,           \
                                 num_blocks, kv_heads, q_heads, ids, lens, width, scale2,     \
                                 part_o, part_lse, staged, tags, epoch, walk_table);          \
    }

WALK_PAGES(f16, __half)
WALK_PAGES(bf16, __nv_bfloat16)

// Joins a normalized partial (natural-log LSE x, this lane's four dims v) into an online
// softmax state: maximum M, weight sum L, weighted sums acc. An empty partial (x = -inf)
// changes nothing.
__device__ __forceinline__ void walk_join(float& M, float& L, float4& acc, float x, float4 v) {
    if (x == WALK_NEG_INF) return;
    if (x > M) {
        const float c = walk_exp2((M - x) * WALK_LOG2E);
        L *= c;
        acc.x *= c;
        acc.y *= c;
        acc.z *= c;
        acc.w *= c;
        M = x;
    }
    const float w = walk_exp2((x - M) * WALK_LOG2E);
    L += w;
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
}

// Joins this warp's share of n partials into an online softmax state (walk_join): the warp
// takes partials warp, warp + NW, ..., B of them loaded at once (past L1: a launch before wrote
// them). at(i0, u) is the index in part_lse (and the row of 128 in part_o) of partial
// i0 + u * NW; where it is a base from i0 plus a multiple of u, each batch's loads sit at
// constant offsets from one address (walk_merge: 0.5 us a B1 step less than an index computed
// from i0 + u * NW, kernels/NOTES.md, session 76).
template <int NW, int B, typename At>
__device__ __forceinline__ void walk_partials(int warp, int lane, int n, At at,
                                              const float* __restrict__ part_lse,
                                              const float* __restrict__ part_o, float& M,
                                              float& L, float4& acc) {
    for (int i0 = warp; i0 < n; i0 += NW * B) {
        float lv[B];
        float4 vv[B];
#pragma unroll
        for (int u = 0; u < B; u++) {
            lv[u] = WALK_NEG_INF;
            vv[u] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i0 + u * NW < n) {
                const size_t k = at(i0, u);
                lv[u] = __ldcg(part_lse + k);
                vv[u] = __ldcg(reinterpret_cast<const float4*>(part_o + k * WALK_D) + lane);
            }
        }
#pragma unroll
        for (int u = 0; u < B; u++) walk_join(M, L, acc, lv[u], vv[u]);
    }
}

// Merges NW warps' states from shared memory (maxima s_m, weight sums s_l, this lane's sums
// s_acc[w][lane]) into r / ll, this lane's four dims of the normalized output (zeros where no
// warp saw a key), and the natural-log LSE (-inf there).
template <int NW>
__device__ __forceinline__ float walk_warps(const float4 (*s_acc)[32], const float* s_m,
                                            const float* s_l, int lane, float4& out) {
    float mm = WALK_NEG_INF;
    for (int w = 0; w < NW; w++) mm = fmaxf(mm, s_m[w]);
    float ll = 0.0f;
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int w = 0; w < NW; w++) {
        if (s_m[w] == WALK_NEG_INF) continue;
        const float c = walk_exp2((s_m[w] - mm) * WALK_LOG2E);
        ll += c * s_l[w];
        const float4 a = s_acc[w][lane];
        r.x += c * a.x;
        r.y += c * a.y;
        r.z += c * a.z;
        r.w += c * a.w;
    }
    const float inv = ll > 0.0f ? 1.0f / ll : 0.0f;
    out = make_float4(r.x * inv, r.y * inv, r.z * inv, r.w * inv);
    return ll > 0.0f ? mm + walk_log2(ll) * WALK_LN2 : WALK_NEG_INF;
}

// Grid (rows, 4): one CTA of WALK_MERGE_WARPS warps per (row, query head of the group), after
// walk_pages. Each warp merges its share of the row's `width` partials (WALK_BATCH loads at
// once), then warp 0 merges the warps' states and writes out[qrow, h * 4 + hq, :] and, with
// has_lse, lse[qrow, h * 4 + hq] (natural log; a row with no page gets zeros and -inf). With
// PUB (`walk_merge_pub`, after walk_pages_pub) the last warp also sees the row's flag,
// ready[row / ready_div], hold the step's value before the CTA ends: the tags the walk read
// publish only the ids, and the launch after this one may start once it ends, so it must
// find every write of pick_rows done (pdl.cuh).
template <bool PUB>
__device__ __forceinline__ void walk_merge_body(
    const i32* __restrict__ cu_q, i32 kv_heads, i32 q_heads, i32 width,
    const float* __restrict__ part_o, const float* __restrict__ part_lse,
    float* __restrict__ out, float* __restrict__ lse_out, i32 has_lse,
    const unsigned* __restrict__ ready, const unsigned* __restrict__ epoch, i32 ready_div) {
    __shared__ float4 s_acc[WALK_MERGE_WARPS][32];
    __shared__ float s_m[WALK_MERGE_WARPS];
    __shared__ float s_l[WALK_MERGE_WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x, hq = blockIdx.y;
    const int seq = row / kv_heads, h = row % kv_heads;
    // The output row, which only the host uploads, read before the wait (as in walk_pages),
    // by warp 0 alone, which writes the output.
    const int qrow = warp == 0 ? __ldcg(cu_q + seq + 1) - 1 : 0;
    pdl_wait();
    pdl_launch_dependents();
    // The flag, asked for now (relaxed) so that its load overlaps the partials'.
    constexpr int FLAG_WARP = WALK_MERGE_WARPS - 1;
    const bool flagger = PUB && warp == FLAG_WARP && lane == 0;
    unsigned seen = 0, step = 0;
    if (flagger) {
        step = __ldcg(epoch);
        seen = load_relaxed(ready + row / ready_div);
    }
    float M = WALK_NEG_INF, L = 0.0f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    // Partial i of this (row, query head) is place row * width + i's head hq.
    const size_t first = (size_t)row * width * WALK_G + hq;
    const auto at = [&](int i0, int u) {
        return first + (size_t)i0 * WALK_G + (size_t)(u * WALK_MERGE_WARPS * WALK_G);
    };
    walk_partials<WALK_MERGE_WARPS, WALK_BATCH>(warp, lane, width, at, part_lse, part_o, M, L,
                                                acc);
    s_acc[warp][lane] = acc;
    if (lane == 0) {
        s_m[warp] = M;
        s_l[warp] = L;
    }
    __syncthreads();
    if (flagger) {
        // A relaxed load that saw the value, then an acquire fence; else poll (acquire).
        if (seen == step) acquire_fence();
        else poll_flag(ready + row / ready_div, step);
    }
    if (warp != 0) return;
    const size_t o = (size_t)qrow * q_heads + h * WALK_G + hq;
    float4 r;
    const float lse = walk_warps<WALK_MERGE_WARPS>(s_acc, s_m, s_l, lane, r);
    reinterpret_cast<float4*>(out + o * WALK_D)[lane] = r;
    if (has_lse && lane == 0) lse_out[o] = lse;
}

extern "C" __global__ void __launch_bounds__(WALK_MERGE_WARPS * 32) walk_merge(
    const i32* __restrict__ cu_q, i32 kv_heads, i32 q_heads, i32 width,
    const float* __restrict__ part_o, const float* __restrict__ part_lse,
    float* __restrict__ out, float* __restrict__ lse_out, i32 has_lse) {
    walk_merge_body<false>(cu_q, kv_heads, q_heads, width, part_o, part_lse, out, lse_out,
                           has_lse, nullptr, nullptr, 1);
}

extern "C" __global__ void __launch_bounds__(WALK_MERGE_WARPS * 32) walk_merge_pub(
    const i32* __restrict__ cu_q, i32 kv_heads, i32 q_heads, i32 width,
    const float* __restrict__ part_o, const float* __restrict__ part_lse,
    float* __restrict__ out, float* __restrict__ lse_out, i32 has_lse,
    const unsigned* __restrict__ ready, const unsigned* __restrict__ epoch, i32 ready_div) {
    walk_merge_body<true>(cu_q, kv_heads, q_heads, width, part_o, part_lse, out, lse_out,
                          has_lse, ready, epoch, ready_div);
}
