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

// Built after kernels/walk.cu, whose helpers it uses: attn-op's page walk (walk.cu) is this
// prototype's late walk, shipped in session 75.

typedef unsigned int u32;

#define SPEC_D WALK_D
#define SPEC_G WALK_G
#define SPEC_PS WALK_PS
#define SPEC_NEG_INF WALK_NEG_INF
// The widest selection row `spec_finish` stages in shared memory.
#define SPEC_MAXW 256
#define FIN_WARPS 16

// Grid (ceil(width / 4), rows); 4 warps, a warp per page of the row's likely set (or, after the
// top-k, of its selection). With `staged` (a walk after the top-k), the launch gives max_blocks
// i32 of dynamic shared memory for the sequence's block-table row, staged before the wait;
// else pages are looked up in the table. The row's length is not read: its places past the
// row's pages hold -1 (the top-k pads its rows, as the likely sets are padded).
extern "C" __global__ void __launch_bounds__(128) spec_pages_bf16_d128(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kc,
    const __nv_bfloat16* __restrict__ vc, const i32* __restrict__ cu_q,
    const i32* __restrict__ kv_lens, const i32* __restrict__ block_table, i32 max_blocks,
    i32 num_blocks, i32 kv_heads, i32 q_heads, const i32* __restrict__ ids, i32 width,
    float scale2, float* __restrict__ part_o, float* __restrict__ part_lse,
    const unsigned int* flags, const unsigned int* epoch, i32 published, i32 staged) {
    __shared__ float p_smem[4][64];
    extern __shared__ __align__(16) i32 s_table[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.y;
    const int seq = row / kv_heads, h = row % kv_heads;
    // The top-k never writes the block table, so its row is staged before the wait (16-byte
    // loads, eight in flight a thread, where the row's length and place allow them).
    const i32* seq_table = block_table + (size_t)seq * max_blocks;
    if (staged) walk_stage(seq_table, s_table, max_blocks);
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
    __syncthreads();
    const int i = blockIdx.x * 4 + warp;
    if (i >= width) return;
    const size_t at = (size_t)row * width + i;
    float* o = part_o + at * SPEC_G * SPEC_D;
    float* lse = part_lse + at * SPEC_G;
    i32 valid;
    const i32 page = __ldcg(ids + at);
    const i32 block = walk_block(staged ? s_table : seq_table, max_blocks, num_blocks, page,
                                 kv_lens[seq], &valid);
    if (block < 0) {
        // A place past the row's pages, or a page outside the sequence, holds an empty
        // partial's LSE, so that a merge may read every place without the row's length (a
        // merge skips the output of an empty partial).
        if (lane < SPEC_G) lse[lane] = SPEC_NEG_INF;
        return;
    }
    float qs[SPEC_G][4];
    walk_queries<__nv_bfloat16, SPEC_G>(q, cu_q[seq + 1] - 1, q_heads, h, 0, scale2, qs);
    walk_page<__nv_bfloat16, SPEC_G>(qs, reinterpret_cast<const uint2*>(kc),
                              reinterpret_cast<const uint2*>(vc), block, valid, kv_heads, h, o,
                              lse, p_smem[warp]);
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
    const i32 b = walk_block(block_table + (size_t)seq * max_blocks, max_blocks, num_blocks,
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
// FIXED: a late walk's finish only, `late` then ignored (session 76's probe of what the late
// path costs without the other paths' code).
template <bool FIXED>
__device__ __forceinline__ void spec_finish_body(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kc,
    const __nv_bfloat16* __restrict__ vc, const i32* __restrict__ cu_q,
    const i32* __restrict__ kv_lens, const i32* __restrict__ block_table, i32 max_blocks,
    i32 num_blocks, i32 kv_heads, i32 q_heads, const i32* __restrict__ new_ids,
    const i32* __restrict__ new_lens, i32 new_width, const i32* __restrict__ prev_ids,
    const i32* __restrict__ prev_lens, i32 prev_width, const float* __restrict__ part_o,
    const float* __restrict__ part_lse, i32 late_arg, float scale2, float* __restrict__ out) {
    const bool late = FIXED || late_arg != 0;
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
    if (!late && tid < 2) s_count[tid] = 0;
    pdl_wait();
    pdl_launch_dependents();
    // The output row, asked for now so that its load overlaps the partials'.
    const int qrow = cu_q[seq + 1] - 1;
    // A late walk reads every place of the row (its walk left an empty partial past the row's
    // pages), so it needs neither the row's length nor its pages, and place i holds the i-th
    // partial: no list of hits, and no barrier before the partials' loads.
    const int nn = late ? min(new_width, SPEC_MAXW)
                        : min(max(new_lens[row], 0), min(new_width, SPEC_MAXW));
    for (int t = late ? nn : tid; t < nn; t += blockDim.x)
        s_new[t] = new_ids[(size_t)row * new_width + t];
    if (!late) __syncthreads();
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
            s_mblock[m] = walk_block(block_table + (size_t)seq * max_blocks, max_blocks,
                                     num_blocks, page, kv_len, &valid);
            s_mvalid[m] = valid;
        }
    }
    if (!late) __syncthreads();
    const int nh = late ? nn : s_count[0], nm = late ? 0 : s_count[1];
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
    // Every warp: its share of the hits' partials (their loads issued together), then its
    // share of the misses.
    const auto at = [&](int i0, int u) {
        const int i = i0 + u * FIN_WARPS;
        return ((size_t)row * prev_width + (late ? i : s_hit[i])) * SPEC_G + hq;
    };
    walk_partials<FIN_WARPS, BATCH>(warp, lane, nh, at, part_lse, part_o, M, L, acc);
    if (warp < nm) {
        float qs[1][4];
        walk_queries<__nv_bfloat16, 1>(q, cu_q[seq + 1] - 1, q_heads, h, hq, scale2, qs);
        float* part = s_part[warp];
        for (int m = warp; m < nm; m += FIN_WARPS) {
            if (s_mblock[m] < 0) continue;
            walk_page<__nv_bfloat16, 1>(qs, reinterpret_cast<const uint2*>(kc),
                                 reinterpret_cast<const uint2*>(vc), s_mblock[m], s_mvalid[m],
                                 kv_heads, h, part, part + SPEC_D, p_smem[warp]);
            walk_join(M, L, acc, part[SPEC_D], reinterpret_cast<const float4*>(part)[lane]);
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
        float4 r;
        walk_warps<FIN_WARPS>(s_acc, s_m, s_l, lane, r);
        const size_t o = (size_t)qrow * q_heads + h * SPEC_G + hq;
        reinterpret_cast<float4*>(out + o * SPEC_D)[lane] = r;
    }
}

#define SPEC_FINISH(NAME, FIXED)                                                              \
    extern "C" __global__ void __launch_bounds__(FIN_WARPS * 32) NAME(                        \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kc,            \
        const __nv_bfloat16* __restrict__ vc, const i32* __restrict__ cu_q,                   \
        const i32* __restrict__ kv_lens, const i32* __restrict__ block_table, i32 max_blocks, \
        i32 num_blocks, i32 kv_heads, i32 q_heads, const i32* __restrict__ new_ids,           \
        const i32* __restrict__ new_lens, i32 new_width, const i32* __restrict__ prev_ids,    \
        const i32* __restrict__ prev_lens, i32 prev_width, const float* __restrict__ part_o,  \
        const float* __restrict__ part_lse, i32 late, float scale2, float* __restrict__ out) { \
        spec_finish_body<FIXED>(q, kc, vc, cu_q, kv_lens, block_table, max_blocks, num_blocks, \
                                kv_heads, q_heads, new_ids, new_lens, new_width, prev_ids,    \
                                prev_lens, prev_width, part_o, part_lse, late, scale2, out);  \
    }
SPEC_FINISH(spec_finish_bf16_d128, false)
SPEC_FINISH(spec_finish_late_bf16_d128, true)
