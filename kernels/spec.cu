// Attention over the pages a step is likely to select (the previous step's selection, or a hot
// buffer's pages) while the step's top-k runs: a prototype for issue 7's B1 L128K step
// (kernels/NOTES.md, session 74), run by `gpu_select spec` only. bf16 KV, head dim 128, pages of
// 16 tokens (the selection's page is the KV page), 4 query heads a KV head.
//
// `spec_pages` writes one normalized partial per page of a row's likely pages (ascending): the
// group's query rows over that page's tokens, [rows, width, 4, 128] f32, and their natural-log
// LSEs [rows, width, 4]. `spec_finish` runs after the step's top-k: for each row and query head
// it computes the partials of the selected pages the likely ones lack, then merges the partials
// of every selected page into the output: attention over the selection, in f32 throughout.

#include <cuda_bf16.h>

typedef int i32;
typedef unsigned int u32;

#define SPEC_D 128
#define SPEC_G 4
#define SPEC_PS 16
#define SPEC_NEG_INF (-__int_as_float(0x7f800000))
#define SPEC_LN2 0.6931471805599453f
#define SPEC_FULL 0xffffffffu
// The widest selection row `spec_finish` stages in shared memory.
#define SPEC_MAXW 256
#define FIN_WARPS 16

__device__ __forceinline__ float spec_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float spec_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Four bf16 (little-endian in two words) widened to f32.
__device__ __forceinline__ void spec_bf4(uint2 w, float* f) {
    f[0] = __uint_as_float(w.x << 16);
    f[1] = __uint_as_float(w.x & 0xffff0000u);
    f[2] = __uint_as_float(w.y << 16);
    f[3] = __uint_as_float(w.y & 0xffff0000u);
}

// One round of a warp's transpose-reduction: 2C values a lane become C, each the sum over the
// two lanes that differ in bit O of value k (lanes with the bit set keep the upper half).
template <int C, int O>
__device__ __forceinline__ void spec_fold(float* s, int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int k = 0; k < C; k++) {
        const float lo = s[k], hi = s[k + C];
        const float send = up ? lo : hi;
        const float keep = up ? hi : lo;
        s[k] = keep + __shfl_xor_sync(SPEC_FULL, send, O);
    }
}

// One warp: the normalized partial of one page (pool block `block`, its first `valid` tokens)
// of KV head h for NH query heads, whose queries (scaled by the softmax scale and log2 e) this
// lane holds for dims 4 lane .. 4 lane + 3. Writes out_o[hq * 128 + d] and out_lse[hq] (natural
// log). p is this warp's 64 floats of shared memory.
template <int NH>
__device__ __forceinline__ void spec_page(const float (&qs)[NH][4], const uint2* __restrict__ kc,
                                          const uint2* __restrict__ vc, i32 block, i32 valid,
                                          i32 kv_heads, i32 h, float* __restrict__ out_o,
                                          float* __restrict__ out_lse, float* p) {
    const int lane = threadIdx.x & 31;
    const size_t step = (size_t)kv_heads * (SPEC_D / 4);
    const size_t base = (size_t)block * SPEC_PS * step + (size_t)h * (SPEC_D / 4) + lane;
    uint2 kr[SPEC_PS], vr[SPEC_PS];
#pragma unroll
    for (int j = 0; j < SPEC_PS; j++) kr[j] = j < valid ? kc[base + j * step] : make_uint2(0u, 0u);
#pragma unroll
    for (int j = 0; j < SPEC_PS; j++) vr[j] = j < valid ? vc[base + j * step] : make_uint2(0u, 0u);
    // s[hq * 16 + j]: this lane's part of query head hq's score of key j.
    float s[NH * SPEC_PS];
#pragma unroll
    for (int j = 0; j < SPEC_PS; j++) {
        float k[4];
        spec_bf4(kr[j], k);
#pragma unroll
        for (int hq = 0; hq < NH; hq++)
            s[hq * SPEC_PS + j] =
                qs[hq][0] * k[0] + qs[hq][1] * k[1] + qs[hq][2] * k[2] + qs[hq][3] * k[3];
    }
    // Reduced over the warp: with NH = 4 lane l ends with scores 2 l and 2 l + 1 (head l / 8,
    // keys 2 (l % 8) and 2 (l % 8) + 1); with NH = 1 with score l / 2 (both lanes of a pair).
    float a, b;
    int j0;
    if constexpr (NH == 4) {
        spec_fold<32, 16>(s, lane);
        spec_fold<16, 8>(s, lane);
        spec_fold<8, 4>(s, lane);
        spec_fold<4, 2>(s, lane);
        spec_fold<2, 1>(s, lane);
        j0 = 2 * (lane & 7);
        a = j0 < valid ? s[0] : SPEC_NEG_INF;
        b = j0 + 1 < valid ? s[1] : SPEC_NEG_INF;
    } else {
        spec_fold<8, 16>(s, lane);
        spec_fold<4, 8>(s, lane);
        spec_fold<2, 4>(s, lane);
        spec_fold<1, 2>(s, lane);
        s[0] += __shfl_xor_sync(SPEC_FULL, s[0], 1);
        j0 = lane >> 1;
        // Each score sits in two lanes: the odd one stands aside from the sums.
        a = (j0 < valid && (lane & 1) == 0) ? s[0] : SPEC_NEG_INF;
        b = SPEC_NEG_INF;
    }
    // The row maximum and sum over the lanes of one query head (8 lanes, or all 32).
    float m = fmaxf(a, b);
    const int span = NH == 4 ? 8 : 32;
#pragma unroll
    for (int o = 1; o < span; o <<= 1) m = fmaxf(m, __shfl_xor_sync(SPEC_FULL, m, o));
    const float pa = spec_exp2(a - m), pb = spec_exp2(b - m);
    float l = pa + pb;
#pragma unroll
    for (int o = 1; o < span; o <<= 1) l += __shfl_xor_sync(SPEC_FULL, l, o);
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
    for (int j = 0; j < SPEC_PS; j++) {
        float v[4];
        spec_bf4(vr[j], v);
#pragma unroll
        for (int hq = 0; hq < NH; hq++) {
            const float w = p[hq * SPEC_PS + j];
#pragma unroll
            for (int d = 0; d < 4; d++) acc[hq][d] += w * v[d];
        }
    }
#pragma unroll
    for (int hq = 0; hq < NH; hq++) {
        const float lh = __shfl_sync(SPEC_FULL, l, hq * 8);
        const float mh = __shfl_sync(SPEC_FULL, m, hq * 8);
        const float inv = 1.0f / lh;
        reinterpret_cast<float4*>(out_o + hq * SPEC_D)[lane] =
            make_float4(acc[hq][0] * inv, acc[hq][1] * inv, acc[hq][2] * inv, acc[hq][3] * inv);
        if (lane == 0) out_lse[hq] = (mh + spec_log2(lh)) * SPEC_LN2;
    }
    __syncwarp();
}

// The pool block of page `page` of sequence seq and its valid tokens; -1 where the page is
// outside the sequence or the table.
__device__ __forceinline__ i32 spec_block(const i32* __restrict__ block_table, i32 max_blocks,
                                          i32 num_blocks, i32 seq, i32 page, i32 kv_len,
                                          i32* valid) {
    *valid = min(SPEC_PS, kv_len - page * SPEC_PS);
    if (page < 0 || page >= max_blocks || *valid <= 0) return -1;
    const i32 b = block_table[(size_t)seq * max_blocks + page];
    return (b >= 0 && b < num_blocks) ? b : -1;
}

// Query head h * 4 + hq0 + i (i < NH) of sequence seq's last query row, scaled.
template <int NH>
__device__ __forceinline__ void spec_queries(const __nv_bfloat16* __restrict__ q, i32 qrow,
                                             i32 q_heads, i32 h, i32 hq0, float scale2,
                                             float (&qs)[NH][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < NH; i++) {
        const uint2 w = reinterpret_cast<const uint2*>(
            q + ((size_t)qrow * q_heads + h * SPEC_G + hq0 + i) * SPEC_D)[lane];
        spec_bf4(w, qs[i]);
#pragma unroll
        for (int d = 0; d < 4; d++) qs[i][d] *= scale2;
    }
}

// The pool block of page `page` and its valid tokens, as spec_block, from the sequence's
// block-table row staged in shared memory.
__device__ __forceinline__ i32 spec_block_staged(const i32* tab, i32 max_blocks, i32 num_blocks,
                                                 i32 page, i32 kv_len, i32* valid) {
    *valid = min(SPEC_PS, kv_len - page * SPEC_PS);
    if (page < 0 || page >= max_blocks || *valid <= 0) return -1;
    const i32 b = tab[page];
    return (b >= 0 && b < num_blocks) ? b : -1;
}

// `spec_pages`' mode bits (session 75's variants of the late walk).
// The row's length is not read: its places past the row's pages hold -1 (the top-k pads).
#define SPEC_NO_LEN 1
// The sequence's block-table row is staged in dynamic shared memory before the wait.
#define SPEC_STAGED 2
// The CTA's four pages are merged into one partial (place blockIdx.x of a row of
// ceil(width / 4)), so that the finish reads a quarter of the partials.
#define SPEC_MERGE 4

// Grid (ceil(width / 4), rows); 4 warps, a warp per page of the row's likely set (or, after the
// top-k, of its selection). With SPEC_STAGED, the launch gives max_blocks i32 of dynamic shared
// memory.
extern "C" __global__ void __launch_bounds__(128) spec_pages_bf16_d128(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kc,
    const __nv_bfloat16* __restrict__ vc, const i32* __restrict__ cu_q,
    const i32* __restrict__ kv_lens, const i32* __restrict__ block_table, i32 max_blocks,
    i32 num_blocks, i32 kv_heads, i32 q_heads, const i32* __restrict__ ids,
    const i32* __restrict__ lens, i32 width, float scale2, float* __restrict__ part_o,
    float* __restrict__ part_lse, const unsigned int* flags, const unsigned int* epoch,
    i32 published, i32 mode) {
    __shared__ float p_smem[4][64];
    __shared__ __align__(16) float s_o[4][SPEC_G * SPEC_D];
    __shared__ float s_lse[4][SPEC_G];
    extern __shared__ __align__(16) i32 s_table[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.y;
    const int seq = row / kv_heads, h = row % kv_heads;
    const bool staged = (mode & SPEC_STAGED) != 0, merge = (mode & SPEC_MERGE) != 0;
    // The top-k never writes the block table: staged before the wait.
    // (16-byte loads, eight in flight a thread: the host gives a max_blocks divisible by 4.)
    if (staged) {
        const int4* src = reinterpret_cast<const int4*>(block_table + (size_t)seq * max_blocks);
        int4* dst = reinterpret_cast<int4*>(s_table);
        const int n4 = max_blocks / 4;
        for (int t0 = threadIdx.x; t0 < n4; t0 += blockDim.x * 8) {
            int4 r[8];
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (t0 + u * (int)blockDim.x < n4) r[u] = src[t0 + u * blockDim.x];
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (t0 + u * (int)blockDim.x < n4) dst[t0 + u * blockDim.x] = r[u];
        }
    }
    // After the top-k on its stream (the pages it selected): with `published`, each CTA waits
    // for its row's flag (kernels/pdl.cuh), else for the whole top-k. On a stream of its own,
    // the PDL calls are no-ops. The rows are read past L1 either way.
    if (published) {
        pdl_launch_dependents();
        wait_flag(flags + blockIdx.y, __ldcg(epoch));
    } else {
        pdl_wait();
        pdl_launch_dependents();
    }
    if (staged) __syncthreads();
    const int i = blockIdx.x * 4 + warp;
    const int n = (mode & SPEC_NO_LEN) ? width : min(max(__ldcg(lens + row), 0), width);
    const size_t at = (size_t)row * width + i;
    float* o = merge ? s_o[warp] : part_o + at * SPEC_G * SPEC_D;
    float* lse = merge ? s_lse[warp] : part_lse + at * SPEC_G;
    bool live = false;
    if (i < n) {
        const i32 page = __ldcg(ids + at);
        i32 valid;
        const i32 block =
            staged ? spec_block_staged(s_table, max_blocks, num_blocks, page, kv_lens[seq], &valid)
                   : spec_block(block_table, max_blocks, num_blocks, seq, page, kv_lens[seq],
                                &valid);
        if (block >= 0) {
            float qs[SPEC_G][4];
            spec_queries<SPEC_G>(q, cu_q[seq + 1] - 1, q_heads, h, 0, scale2, qs);
            spec_page<SPEC_G>(qs, reinterpret_cast<const uint2*>(kc),
                              reinterpret_cast<const uint2*>(vc), block, valid, kv_heads, h, o,
                              lse, p_smem[warp]);
            live = true;
        }
    }
    // A place past the row's pages, or a page outside the sequence, holds an empty partial's
    // LSE, so that a merge may read every place without the row's length (a merge skips the
    // output of an empty partial).
    if (!live && (merge || i < width) && lane < SPEC_G) lse[lane] = SPEC_NEG_INF;
    if (!merge) return;
    __syncthreads();
    // Thread t merges query head t / 32's dims 4 (t % 32) .. + 3 over the CTA's four pages.
    const int hq = threadIdx.x >> 5;
    float m = SPEC_NEG_INF;
#pragma unroll
    for (int w = 0; w < 4; w++) m = fmaxf(m, s_lse[w][hq]);
    float l = 0.0f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m != SPEC_NEG_INF) {
#pragma unroll
        for (int w = 0; w < 4; w++) {
            if (s_lse[w][hq] == SPEC_NEG_INF) continue;
            const float c = spec_exp2((s_lse[w][hq] - m) * 1.4426950408889634f);
            const float4 v = reinterpret_cast<const float4*>(s_o[w] + hq * SPEC_D)[lane];
            l += c;
            acc.x += c * v.x;
            acc.y += c * v.y;
            acc.z += c * v.z;
            acc.w += c * v.w;
        }
    }
    const int places = (width + 3) / 4;
    const size_t g = (size_t)row * places + blockIdx.x;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    reinterpret_cast<float4*>(part_o + (g * SPEC_G + hq) * SPEC_D)[lane] =
        make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    if (lane == 0)
        part_lse[g * SPEC_G + hq] = m == SPEC_NEG_INF ? m : m + spec_log2(l) * SPEC_LN2;
}

// Grid (ceil(width * 64 / 256), rows); asks L2 for every 128-byte line of K and V of the row's
// likely pages (64 a page), a thread a line, so that a walk after the top-k finds them there.
extern "C" __global__ void __launch_bounds__(256) spec_warm_bf16_d128(
    const __nv_bfloat16* __restrict__ kc, const __nv_bfloat16* __restrict__ vc,
    const i32* __restrict__ kv_lens, const i32* __restrict__ block_table, i32 max_blocks,
    i32 num_blocks, i32 kv_heads, const i32* __restrict__ ids, const i32* __restrict__ lens,
    i32 width) {
    const int row = blockIdx.y;
    const int seq = row / kv_heads, h = row % kv_heads;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int i = t >> 6, l = t & 63, j = (l & 31) >> 1;
    const int n = min(max(lens[row], 0), width);
    if (i >= n) return;
    i32 valid;
    const i32 b = spec_block(block_table, max_blocks, num_blocks, seq,
                             ids[(size_t)row * width + i], kv_lens[seq], &valid);
    if (b < 0 || j >= valid) return;
    const __nv_bfloat16* base = l < 32 ? kc : vc;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(
        base + (((size_t)b * SPEC_PS + j) * kv_heads + h) * SPEC_D + (l & 1) * (SPEC_D / 2)));
}

// Grid (rows, 4): one CTA of FIN_WARPS warps per (row, query head of the group), launched as a
// dependent of the top-k's pick_rows, after spec_pages has finished (an event on its stream).
// Every warp merges its share of the partials of the selected pages the likely ones hold, then
// computes its share of the other selected pages (their K and V asked of L2 first) and merges
// those, from shared memory. Writes out[qrow, h * 4 + hq, :].
extern "C" __global__ void __launch_bounds__(FIN_WARPS * 32) spec_finish_bf16_d128(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kc,
    const __nv_bfloat16* __restrict__ vc, const i32* __restrict__ cu_q,
    const i32* __restrict__ kv_lens, const i32* __restrict__ block_table, i32 max_blocks,
    i32 num_blocks, i32 kv_heads, i32 q_heads, const i32* __restrict__ new_ids,
    const i32* __restrict__ new_lens, i32 new_width, const i32* __restrict__ prev_ids,
    const i32* __restrict__ prev_lens, i32 prev_width, const float* __restrict__ part_o,
    const float* __restrict__ part_lse, i32 late, float scale2, float* __restrict__ out) {
    constexpr int BATCH = 8;
    __shared__ i32 s_new[SPEC_MAXW];
    __shared__ i32 s_prev[SPEC_MAXW];
    __shared__ i32 s_hit[SPEC_MAXW];
    __shared__ i32 s_mblock[SPEC_MAXW];
    __shared__ i32 s_mvalid[SPEC_MAXW];
    __shared__ int s_count[2];
    __shared__ float p_smem[FIN_WARPS][64];
    __shared__ __align__(16) float s_part[FIN_WARPS][SPEC_D + 4];
    __shared__ float4 s_acc[FIN_WARPS][32];
    __shared__ float s_m[FIN_WARPS];
    __shared__ float s_l[FIN_WARPS];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int row = blockIdx.x, hq = blockIdx.y;
    const int seq = row / kv_heads, h = row % kv_heads;
    // Before the wait, what the top-k never writes: the sequence's block-table row into L2,
    // and the pages walked early into shared memory. (`late`: the walk was of the top-k's own
    // rows, and every selected page has its partial at its own index.)
    for (int t = tid * 32; !late && t < max_blocks; t += blockDim.x * 32)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(block_table + (size_t)seq * max_blocks + t));
    const int np = late ? 0 : min(max(prev_lens[row], 0), min(prev_width, SPEC_MAXW));
    for (int t = tid; t < np; t += blockDim.x) s_prev[t] = prev_ids[(size_t)row * prev_width + t];
    if (tid < 2) s_count[tid] = 0;
    pdl_wait();
    pdl_launch_dependents();
    // A late walk reads every place of the row (its walk left an empty partial past the row's
    // pages), so it needs neither the row's length nor its pages.
    const int nn = late ? min(new_width, SPEC_MAXW)
                        : min(max(new_lens[row], 0), min(new_width, SPEC_MAXW));
    for (int t = late ? nn : tid; t < nn; t += blockDim.x)
        s_new[t] = new_ids[(size_t)row * new_width + t];
    if (late) {
        for (int t = tid; t < nn; t += blockDim.x) s_hit[t] = t;
        if (tid == 0) s_count[0] = nn;
    }
    __syncthreads();
    // Each new page: a hit (its index in the ascending previous selection) or a miss, whose
    // pool block is looked up now (the table row is in L2).
    const i32 kv_len = kv_lens[seq];
    for (int k = late ? nn : tid; k < nn; k += blockDim.x) {
        const i32 page = s_new[k];
        int lo = 0, hi = np;
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (s_prev[mid] < page) lo = mid + 1;
            else hi = mid;
        }
        if (lo < np && s_prev[lo] == page) {
            s_hit[atomicAdd(&s_count[0], 1)] = lo;
        } else {
            const int m = atomicAdd(&s_count[1], 1);
            i32 valid;
            s_mblock[m] = spec_block(block_table, max_blocks, num_blocks, seq, page, kv_len, &valid);
            s_mvalid[m] = valid;
        }
    }
    __syncthreads();
    const int nh = s_count[0], nm = s_count[1];
    // Every missed page's K and V rows asked of L2 at once (64 lines of 128 bytes a page), so
    // that the warps computing them one after another find them there.
    for (int t = tid; t < nm * 64; t += blockDim.x) {
        const int m = t >> 6, l = t & 63, j = (l & 31) >> 1;
        const i32 b = s_mblock[m];
        if (b < 0 || j >= s_mvalid[m]) continue;
        const __nv_bfloat16* base = l < 32 ? kc : vc;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(
            base + (((size_t)b * SPEC_PS + j) * kv_heads + h) * SPEC_D + (l & 1) * (SPEC_D / 2)));
    }
    float M = SPEC_NEG_INF, L = 0.0f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    auto join = [&](float lse, float4 v) {
        if (lse == SPEC_NEG_INF) return;
        if (lse > M) {
            const float c = spec_exp2((M - lse) * 1.4426950408889634f);
            L *= c;
            acc.x *= c;
            acc.y *= c;
            acc.z *= c;
            acc.w *= c;
            M = lse;
        }
        const float w = spec_exp2((lse - M) * 1.4426950408889634f);
        L += w;
        acc.x += w * v.x;
        acc.y += w * v.y;
        acc.z += w * v.z;
        acc.w += w * v.w;
    };
    // Every warp: its share of the hits' partials (their loads issued together), then its
    // share of the misses.
    for (int i0 = warp; i0 < nh; i0 += FIN_WARPS * BATCH) {
        float lv[BATCH];
        float4 vv[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; u++) {
            const int i = i0 + u * FIN_WARPS;
            lv[u] = SPEC_NEG_INF;
            vv[u] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < nh) {
                const size_t at = ((size_t)row * prev_width + s_hit[i]) * SPEC_G + hq;
                lv[u] = part_lse[at];
                vv[u] = reinterpret_cast<const float4*>(part_o + at * SPEC_D)[lane];
            }
        }
#pragma unroll
        for (int u = 0; u < BATCH; u++) join(lv[u], vv[u]);
    }
    if (warp < nm) {
        float qs[1][4];
        spec_queries<1>(q, cu_q[seq + 1] - 1, q_heads, h, hq, scale2, qs);
        float* part = s_part[warp];
        for (int m = warp; m < nm; m += FIN_WARPS) {
            if (s_mblock[m] < 0) continue;
            spec_page<1>(qs, reinterpret_cast<const uint2*>(kc),
                         reinterpret_cast<const uint2*>(vc), s_mblock[m], s_mvalid[m], kv_heads,
                         h, part, part + SPEC_D, p_smem[warp]);
            join(part[SPEC_D], reinterpret_cast<const float4*>(part)[lane]);
            __syncwarp();
        }
    }
    s_acc[warp][lane] = acc;
    if (lane == 0) {
        s_m[warp] = M;
        s_l[warp] = L;
    }
    __syncthreads();
    if (warp == 0) {
        float mm = SPEC_NEG_INF;
        for (int w = 0; w < FIN_WARPS; w++) mm = fmaxf(mm, s_m[w]);
        float ll = 0.0f;
        float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int w = 0; w < FIN_WARPS; w++) {
            if (s_m[w] == SPEC_NEG_INF) continue;
            const float c = spec_exp2((s_m[w] - mm) * 1.4426950408889634f);
            ll += c * s_l[w];
            const float4 a = s_acc[w][lane];
            r.x += c * a.x;
            r.y += c * a.y;
            r.z += c * a.z;
            r.w += c * a.w;
        }
        const float inv = ll > 0.0f ? 1.0f / ll : 0.0f;
        const int qrow = cu_q[seq + 1] - 1;
        reinterpret_cast<float4*>(out + ((size_t)qrow * q_heads + h * SPEC_G + hq) * SPEC_D)[lane] =
            make_float4(r.x * inv, r.y * inv, r.z * inv, r.w * inv);
    }
}

// A thread block cluster's rank of this CTA, its barrier (release, acquire), and a float of
// another CTA's shared memory.
__device__ __forceinline__ unsigned spec_cl_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void spec_cl_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::
                     : "memory");
}

__device__ __forceinline__ float spec_cl_load(const float* p, unsigned rank) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    unsigned r;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
    return v;
}

// Grid (CL_CTAS, rows), clusters of the CL_CTAS CTAs of a row: the late walk and its merge in
// one kernel (session 75). Warp w of CTA c walks the row's selected pages c * CL_WARPS + w,
// + CL_CTAS * CL_WARPS, ..., merging them in registers; the CTA merges its warps in shared
// memory; after the cluster's barrier, CTA r < 4 merges query head r over the cluster's CTAs
// from their shared memory and writes out[qrow, h * 4 + r, :]. No partial leaves the
// multiprocessors.
template <int CL_CTAS, int CL_WARPS>
__device__ __forceinline__ void spec_cluster_body(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kc,
    const __nv_bfloat16* __restrict__ vc, const i32* __restrict__ cu_q,
    const i32* __restrict__ kv_lens, const i32* __restrict__ block_table, i32 max_blocks,
    i32 num_blocks, i32 kv_heads, i32 q_heads, const i32* __restrict__ ids, i32 width,
    float scale2, float* __restrict__ out) {
    __shared__ float p_smem[CL_WARPS][64];
    __shared__ __align__(16) float s_o[CL_WARPS][SPEC_G * SPEC_D];
    __shared__ float s_lse[CL_WARPS][SPEC_G];
    __shared__ float s_wl[CL_WARPS][SPEC_G];
    __shared__ float s_acc[SPEC_G][SPEC_D];
    __shared__ float s_m[SPEC_G];
    __shared__ float s_l[SPEC_G];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned rank = spec_cl_rank();
    const int row = blockIdx.y;
    const int seq = row / kv_heads, h = row % kv_heads;
    pdl_wait();
    pdl_launch_dependents();
    const i32 kv_len = kv_lens[seq];
    float qs[SPEC_G][4];
    spec_queries<SPEC_G>(q, cu_q[seq + 1] - 1, q_heads, h, 0, scale2, qs);
    float M[SPEC_G], L[SPEC_G];
    float4 acc[SPEC_G];
#pragma unroll
    for (int hq = 0; hq < SPEC_G; hq++) {
        M[hq] = SPEC_NEG_INF;
        L[hq] = 0.0f;
        acc[hq] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int i = rank * CL_WARPS + warp; i < width; i += CL_CTAS * CL_WARPS) {
        i32 valid;
        const i32 block = spec_block(block_table, max_blocks, num_blocks, seq,
                                     __ldcg(ids + (size_t)row * width + i), kv_len, &valid);
        if (block < 0) continue;
        spec_page<SPEC_G>(qs, reinterpret_cast<const uint2*>(kc),
                          reinterpret_cast<const uint2*>(vc), block, valid, kv_heads, h, s_o[warp],
                          s_lse[warp], p_smem[warp]);
#pragma unroll
        for (int hq = 0; hq < SPEC_G; hq++) {
            const float lse = s_lse[warp][hq];
            if (lse == SPEC_NEG_INF) continue;
            const float4 v = reinterpret_cast<const float4*>(s_o[warp] + hq * SPEC_D)[lane];
            if (lse > M[hq]) {
                const float c = spec_exp2((M[hq] - lse) * 1.4426950408889634f);
                L[hq] *= c;
                acc[hq].x *= c;
                acc[hq].y *= c;
                acc[hq].z *= c;
                acc[hq].w *= c;
                M[hq] = lse;
            }
            const float w = spec_exp2((lse - M[hq]) * 1.4426950408889634f);
            L[hq] += w;
            acc[hq].x += w * v.x;
            acc[hq].y += w * v.y;
            acc[hq].z += w * v.z;
            acc[hq].w += w * v.w;
        }
        __syncwarp();
    }
    // The warp's state (unnormalized sums, maximum, weight sum) into its shared memory.
#pragma unroll
    for (int hq = 0; hq < SPEC_G; hq++) {
        reinterpret_cast<float4*>(s_o[warp] + hq * SPEC_D)[lane] = acc[hq];
        if (lane == 0) {
            s_lse[warp][hq] = M[hq];
            s_wl[warp][hq] = L[hq];
        }
    }
    __syncthreads();
    // Item t: query head t / 128, dim t % 128, over the CTA's warps.
    for (int t = tid; t < SPEC_G * SPEC_D; t += CL_WARPS * 32) {
        const int hq = t >> 7, d = t & 127;
        float mm = SPEC_NEG_INF;
#pragma unroll
        for (int w = 0; w < CL_WARPS; w++) mm = fmaxf(mm, s_lse[w][hq]);
        float ll = 0.0f, a = 0.0f;
        if (mm != SPEC_NEG_INF) {
#pragma unroll
            for (int w = 0; w < CL_WARPS; w++) {
                if (s_lse[w][hq] == SPEC_NEG_INF) continue;
                const float c = spec_exp2((s_lse[w][hq] - mm) * 1.4426950408889634f);
                ll += c * s_wl[w][hq];
                a += c * s_o[w][hq * SPEC_D + d];
            }
        }
        s_acc[hq][d] = a;
        if (d == 0) {
            s_m[hq] = mm;
            s_l[hq] = ll;
        }
    }
    spec_cl_sync();
    if (rank < SPEC_G && tid < SPEC_D) {
        const int hq = rank, d = tid;
        float m[CL_CTAS], l[CL_CTAS], a[CL_CTAS];
#pragma unroll
        for (int c = 0; c < CL_CTAS; c++) {
            m[c] = spec_cl_load(&s_m[hq], c);
            l[c] = spec_cl_load(&s_l[hq], c);
            a[c] = spec_cl_load(&s_acc[hq][d], c);
        }
        float mm = SPEC_NEG_INF;
#pragma unroll
        for (int c = 0; c < CL_CTAS; c++) mm = fmaxf(mm, m[c]);
        float ll = 0.0f, r = 0.0f;
        if (mm != SPEC_NEG_INF) {
#pragma unroll
            for (int c = 0; c < CL_CTAS; c++) {
                if (m[c] == SPEC_NEG_INF) continue;
                const float w = spec_exp2((m[c] - mm) * 1.4426950408889634f);
                ll += w * l[c];
                r += w * a[c];
            }
        }
        const int qrow = cu_q[seq + 1] - 1;
        out[((size_t)qrow * q_heads + h * SPEC_G + hq) * SPEC_D + d] = ll > 0.0f ? r / ll : 0.0f;
    }
    // No CTA leaves while another may still read its shared memory.
    spec_cl_sync();
}

#define SPEC_CLUSTER(NAME, CTAS, WARPS)                                                       \
    extern "C" __global__ void __cluster_dims__(CTAS, 1, 1) __launch_bounds__(WARPS * 32, 1) \
        NAME(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kc,       \
             const __nv_bfloat16* __restrict__ vc, const i32* __restrict__ cu_q,              \
             const i32* __restrict__ kv_lens, const i32* __restrict__ block_table,            \
             i32 max_blocks, i32 num_blocks, i32 kv_heads, i32 q_heads,                       \
             const i32* __restrict__ ids, i32 width, float scale2, float* __restrict__ out) { \
        spec_cluster_body<CTAS, WARPS>(q, kc, vc, cu_q, kv_lens, block_table, max_blocks,     \
                                       num_blocks, kv_heads, q_heads, ids, width, scale2,     \
                                       out);                                                  \
    }

// Clusters of 8 CTAs of 16 warps, and (a non-portable size) of 16 CTAs of 8 warps.
SPEC_CLUSTER(spec_cluster_bf16_d128, 8, 16)
SPEC_CLUSTER(spec_cluster16_bf16_d128, 16, 8)
