// Kernels of sparse-algo's CUDA backend: Quest's per-page key min/max and its fused estimate +
// top-k, with the same contracts as the CPU implementation in crates/sparse-algo (the
// specification; the `gpu_select` example checks each kernel against it).
//
// Layouts (the shared data contract):
//   keys    [num_blocks, block_size, kv_heads, d], addressed through block_table[s, max_blocks]
//   reps    [layers, slots, max_pages, kv_heads, 2 d]: per page and KV head, kmax then kmin, in
//           the keys' element type (a max or min of elements is an element: nothing is rounded)
//   q       [total_q, q_heads, d]: a sequence's decode query is its last row, cu_q[s + 1] - 1
// Every index read from memory is range-checked before it addresses memory.
//
// Compiled after kernels/common.cuh (the integer typedefs and block_scan).

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define SEL_THREADS 256
#define NEG_INF_F (-__int_as_float(0x7f800000))

// ---------------------------------------------------------------------------------------------
// Vectors of 16 bytes: Vec16<T>::N elements, widened to f32 and narrowed back (exactly, for
// values that came from T).

// The two 16-bit types: pairs widened and narrowed (round to nearest) by the type's own
// conversions.
__device__ __forceinline__ float2 widen2(const __half*, u32 w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 widen2(const __nv_bfloat16*, u32 w) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
__device__ __forceinline__ u32 narrow2(const __half*, float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const u32*>(&h);
}
__device__ __forceinline__ u32 narrow2(const __nv_bfloat16*, float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const u32*>(&h);
}
template <typename H> struct Vec16 {
    static constexpr int N = 8;
    static __device__ __forceinline__ void widen(uint4 r, float* f) {
        const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 v = widen2(static_cast<const H*>(nullptr), w[i]);
            f[2 * i] = v.x;
            f[2 * i + 1] = v.y;
        }
    }
    static __device__ __forceinline__ uint4 narrow(const float* f) {
        const H* tag = nullptr;
        return make_uint4(narrow2(tag, f[0], f[1]), narrow2(tag, f[2], f[3]),
                          narrow2(tag, f[4], f[5]), narrow2(tag, f[6], f[7]));
    }
};

// f32: four elements, bit for bit.
template <> struct Vec16<float> {
    static constexpr int N = 4;
    static __device__ __forceinline__ void widen(uint4 r, float* f) {
        f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
        f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
    }
    static __device__ __forceinline__ uint4 narrow(const float* f) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                          __float_as_uint(f[3]));
    }
};

// ---------------------------------------------------------------------------------------------
// Quest's plan for one sequence (select.rs, Plan::new): pages 0..head_end and tail_start..n are
// forced, `pick` more come from mid = head_end..tail_start by score. With no more pages than the
// budget, every page is forced and nothing is estimated.

struct Plan {
    int n, head_end, tail_start, pick;
    __device__ Plan(int len, int ps, int budget, int sink_tokens, int recent_tokens) {
        n = (len + ps - 1) / ps;
        if (n <= budget) {
            head_end = n;
            tail_start = n;
            pick = 0;
            return;
        }
        const int recent = min(max(recent_tokens, 1), len);
        tail_start = (len - recent) / ps;
        head_end = min((sink_tokens + ps - 1) / ps, tail_start);
        const int forced = head_end + (n - tail_start);
        pick = min(max(budget - forced, 0), tail_start - head_end);
    }
    __device__ int mid() const { return tail_start - head_end; }
};

// ---------------------------------------------------------------------------------------------
// Min/max maintenance. The pages a step touched are recomputed from the keys: the tokens this
// step added to sequence s are its last q_len = cu_q[s + 1] - cu_q[s] (a prefill: all of them;
// a decode step: one), so pages (len - q_len) / ps .. ceil(len / ps) change. One thread per
// (page, KV head, 16-byte vector), looping over the page's tokens. Grid: (chunks, seqs).

template <typename T>
__device__ void minmax_body(const T* __restrict__ k, i32 num_blocks, i32 bs, i32 kvh, i32 d,
                            const i32* __restrict__ block_table, i32 max_blocks,
                            const i32* __restrict__ cu_q, const i32* __restrict__ seq_lens,
                            const i32* __restrict__ slots, T* __restrict__ reps, i32 layer,
                            i32 num_slots, i32 max_pages, i32 ps) {
    typedef Vec16<T> V;
    const int s = blockIdx.y;
    const int len = seq_lens[s];
    const int q_len = cu_q[s + 1] - cu_q[s];
    const int slot = slots[s];
    if (len <= 0 || slot < 0 || slot >= num_slots) return;
    const int first = max(len - max(q_len, 0), 0) / ps;
    const int last = min((len + ps - 1) / ps, max_pages);
    const int vecs = d / V::N;
    const long items = (long)(last - first) * kvh * vecs;
    const long item = (long)blockIdx.x * SEL_THREADS + threadIdx.x;
    if (item >= items) return;
    const int v = (int)(item % vecs);
    const int h = (int)((item / vecs) % kvh);
    const int p = first + (int)(item / ((long)vecs * kvh));
    float hi[V::N], lo[V::N], x[V::N];
#pragma unroll
    for (int i = 0; i < V::N; i++) {
        hi[i] = NEG_INF_F;
        lo[i] = -NEG_INF_F;
    }
    // The page's tokens, one block segment at a time: one table lookup per segment, then
    // independent loads.
    const int t_end = min(p * ps + ps, len);
    const size_t token_stride = (size_t)kvh * d;
    for (int t0 = p * ps; t0 < t_end;) {
        const int bi = t0 / bs;
        const int seg_end = min(t_end, (bi + 1) * bs);
        const int blk = bi < max_blocks ? block_table[(size_t)s * max_blocks + bi] : -1;
        if (blk >= 0 && blk < num_blocks) {
            const T* src = k + ((size_t)blk * bs * kvh + h) * d + (size_t)v * V::N;
#pragma unroll 8
            for (int t = t0; t < seg_end; t++) {
                V::widen(__ldg(reinterpret_cast<const uint4*>(src + (t % bs) * token_stride)), x);
#pragma unroll
                for (int i = 0; i < V::N; i++) {
                    hi[i] = fmaxf(hi[i], x[i]);
                    lo[i] = fminf(lo[i], x[i]);
                }
            }
        }
        t0 = seg_end;
    }
    const size_t base =
        ((((size_t)layer * num_slots + slot) * max_pages + p) * kvh + h) * 2 * d + (size_t)v * V::N;
    *reinterpret_cast<uint4*>(reps + base) = V::narrow(hi);
    *reinterpret_cast<uint4*>(reps + base + d) = V::narrow(lo);
}

// ---------------------------------------------------------------------------------------------
// Scores as ordered keys: a float's bits mapped so unsigned order is Rust's total_cmp order,
// NaN first mapped to -inf (it ranks below every number). Every real score's key is above 0,
// the value the score buffer holds between launches.

__device__ __forceinline__ u32 order_key(float s) {
    if (s != s) s = NEG_INF_F;
    const u32 b = __float_as_uint(s);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Keys other CTAs wrote, read past L1 (they live in L2), or a copy in shared memory.
template <bool SMEM>
__device__ __forceinline__ u32 key_at(const u32* keys, int i) {
    return SMEM ? keys[i] : __ldcg(keys + i);
}

// The ids of the `pick` largest keys of keys[0..n) in ascending id order, written to out; ties go
// to the lower id. The pick-th largest key T is found by bisection over the keys' range (the
// largest T that at least `pick` keys reach; one count per step, at most 32 steps); then, in
// id order, every key above T is taken, and the first (pick - #above) keys equal to T.
template <bool SMEM>
__device__ void select_top(const u32* keys, int n, int pick, int id0, i32* out) {
    __shared__ u32 red[2][SEL_THREADS / 32];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    u32 lo = 0xffffffffu, top = 0;
    for (int i = tid; i < n; i += SEL_THREADS) {
        const u32 key = key_at<SMEM>(keys, i);
        lo = min(lo, key);
        top = max(top, key);
    }
    lo = __reduce_min_sync(0xffffffffu, lo);
    top = __reduce_max_sync(0xffffffffu, top);
    if (lane == 0) {
        red[0][warp] = lo;
        red[1][warp] = top;
    }
    __syncthreads();
    for (int w = 0; w < SEL_THREADS / 32; w++) {
        lo = min(lo, red[0][w]);
        top = max(top, red[1][w]);
    }
    __syncthreads();
    // Every key reaches lo; none reaches hi.
    unsigned long long hi = (unsigned long long)top + 1;
    for (int step = 0; hi - lo > 1; step++) {
        const u32 mid = (u32)(lo + (hi - lo) / 2);
        int c = 0;
#pragma unroll 8
        for (int i = tid; i < n; i += SEL_THREADS) c += key_at<SMEM>(keys, i) >= mid;
        c = (int)__reduce_add_sync(0xffffffffu, (u32)c);
        // Two buffers by parity: a thread writing step + 2's sums has passed step + 1's barrier,
        // so every thread has read step's.
        if (lane == 0) red[step & 1][warp] = (u32)c;
        __syncthreads();
        int reached = 0;
        for (int w = 0; w < SEL_THREADS / 32; w++) reached += (int)red[step & 1][w];
        if (reached >= pick) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    // lo is T. Each thread owns a run of consecutive ids so a scan keeps id order.
    const u32 t = lo;
    const int per = (n + SEL_THREADS - 1) / SEL_THREADS;
    const int a = min(n, tid * per), b = min(n, a + per);
    int eq = 0, above = 0;
    for (int i = a; i < b; i++) {
        const u32 key = key_at<SMEM>(keys, i);
        eq += key == t;
        above += key > t;
    }
    int total;
    const int eq_first = block_scan<SEL_THREADS>(eq, &total);
    block_scan<SEL_THREADS>(above, &total);
    const int remaining = pick - total;
    int eq_seen = eq_first;
    int take = 0;
    for (int i = a; i < b; i++) {
        const u32 key = key_at<SMEM>(keys, i);
        take += key > t || (key == t && eq_seen++ < remaining);
    }
    int at = block_scan<SEL_THREADS>(take, &total);
    eq_seen = eq_first;
    for (int i = a; i < b; i++) {
        const u32 key = key_at<SMEM>(keys, i);
        if (key > t || (key == t && eq_seen++ < remaining)) out[at++] = id0 + i;
    }
}

// ---------------------------------------------------------------------------------------------
// Quest estimate + top-k in one launch. Grid: (tiles of mid pages, selection rows, heads per
// row). A selection row is (sequence, KV head), or a sequence when `shared` (one selection from
// every query head). A CTA stages a tile of one KV head's [kmax ‖ kmin] rows in shared memory;
// `tpp` threads share a page, each scoring some of the group's query heads:
// sum_d max(q_d kmin_d, q_d kmax_d) in score.rs's order (16 lanes, each rounded step by step,
// then the lanes in order). The CPU adds wmax kmax + wmin kmin, one product of which is zero:
// the term is the larger of q kmax and q kmin, a zero never changes a sum that starts at +0,
// so scores equal the CPU's bit for bit (for finite keys). A page's key is its best score,
// merged over threads and heads by atomicMax into scores[row, page - head_end]. The last CTA of
// a row (a counter per row, reset by it) selects (from a shared-memory copy of the row's keys
// when `keys_smem`; it zeroes them after) and writes the row: forced head pages, the chosen
// ones, the tail, -1 padding; `copies` output rows per selection row (shared: 1 or kv_heads),
// their lengths and the tokens they cover.

#define QJ 2              // query heads a thread scores per pass over its page
#define TILE_BYTES 65536  // min/max rows staged in shared memory per CTA (before padding)

// 16 bytes global -> shared without registers (cp.async, sm_80 and later), and the wait for all.
__device__ __forceinline__ void copy16(void* smem, const void* gmem) {
#if __CUDA_ARCH__ >= 800
    const u32 at = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(gmem));
#else
    *reinterpret_cast<uint4*>(smem) = __ldg(reinterpret_cast<const uint4*>(gmem));
#endif
}
__device__ __forceinline__ void copy16_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::);
#endif
}

template <typename T>
__device__ void quest_body(const T* __restrict__ q, const i32* __restrict__ cu_q, i32 q_heads,
                           const T* __restrict__ reps, i32 layer, i32 num_slots, i32 max_pages,
                           const i32* __restrict__ slots, const i32* __restrict__ seq_lens,
                           i32 kvh, i32 d, i32 ps, i32 budget, i32 sink_tokens,
                           i32 recent_tokens, i32 shared, i32 tpp, u32* __restrict__ scores,
                           i32 score_stride, i32 keys_smem, i32* __restrict__ counters,
                           i32* __restrict__ ids, i32* __restrict__ lens,
                           i32* __restrict__ covered, i32 width, i32 copies) {
    typedef Vec16<T> V;
    // Dynamic shared memory: the group's queries [g, d] (NaN read as 0, as the CPU's weights
    // max(q, 0) and min(q, 0) read it), then the tile of min/max rows; the selecting CTA later
    // reuses all of it for the row's keys.
    extern __shared__ float w[];
    __shared__ int s_last;
    const int row = blockIdx.y;
    const int s = shared ? row : row / kvh;
    const int h = shared ? (int)blockIdx.z : row % kvh;
    const int g = q_heads / kvh;
    const int len = seq_lens[s];
    const int slot = slots[s];
    const bool valid = len > 0 && slot >= 0 && slot < num_slots;
    const Plan plan(max(len, 1), ps, budget, sink_tokens, recent_tokens);
    u32* row_keys = scores + (size_t)row * score_stride;
    const int tile_pages = SEL_THREADS / tpp;
    const int i0 = blockIdx.x * tile_pages;
    const int npg = min(tile_pages, min(plan.mid(), score_stride) - i0);

    if (valid && plan.pick > 0 && npg > 0) {
        unsigned char* tile = reinterpret_cast<unsigned char*>(w + g * d);
        // Stage the tile's rows: page head_end + i0 + r of head h.
        const int row_bytes = 2 * d * (int)sizeof(T);
        const int pitch = row_bytes + 16;
        const int vr = row_bytes / 16;
        const size_t page_stride = (size_t)kvh * 2 * d;
        const T* rep0 = reps +
                        ((((size_t)layer * num_slots + slot) * max_pages + plan.head_end + i0) *
                             kvh + h) * 2 * d;
        for (int v = threadIdx.x; v < npg * vr; v += SEL_THREADS) {
            const int r = v / vr, c = v - r * vr;
            copy16(tile + r * pitch + c * 16, rep0 + r * page_stride + c * (16 / sizeof(T)));
        }
        const T* qrow = q + ((size_t)(cu_q[s + 1] - 1) * q_heads + (size_t)h * g) * d;
        for (int i = threadIdx.x * V::N; i < g * d; i += SEL_THREADS * V::N) {
            float x[V::N];
            V::widen(__ldg(reinterpret_cast<const uint4*>(qrow + i)), x);
#pragma unroll
            for (int j = 0; j < V::N; j++) w[i + j] = x[j] == x[j] ? x[j] : 0.0f;
        }
        copy16_wait();
        __syncthreads();
        const int r = threadIdx.x % tile_pages;
        const int sub = threadIdx.x / tile_pages;
        if (r < npg) {
            const unsigned char* mine = tile + r * pitch;
            u32 best = 0;
            // Query heads sub, sub + tpp, ...; QJ of them per pass over the row.
            for (int j0 = sub; j0 < g; j0 += QJ * tpp) {
                float acc[QJ][16];
#pragma unroll
                for (int j = 0; j < QJ; j++)
#pragma unroll
                    for (int l = 0; l < 16; l++) acc[j][l] = 0.0f;
                for (int c = 0; c < d; c += 16) {
#pragma unroll
                    for (int u = 0; u < 16; u += 8) {
                        // Elements c + u .. c + u + 8 of kmax and kmin: lanes u .. u + 8.
                        float hi[8], lo[8];
#pragma unroll
                        for (int k = 0; k < 8; k += V::N) {
                            const int e = c + u + k;
                            V::widen(*reinterpret_cast<const uint4*>(mine + e * sizeof(T)),
                                     hi + k);
                            V::widen(*reinterpret_cast<const uint4*>(mine + (d + e) * sizeof(T)),
                                     lo + k);
                        }
#pragma unroll
                        for (int j = 0; j < QJ; j++) {
                            const int jj = j0 + j * tpp;
                            if (jj < g) {
                                const float4* qv =
                                    reinterpret_cast<const float4*>(w + jj * d + c + u);
                                const float4 qa = qv[0], qb = qv[1];
                                const float qq[8] = {qa.x, qa.y, qa.z, qa.w,
                                                     qb.x, qb.y, qb.z, qb.w};
#pragma unroll
                                for (int l = 0; l < 8; l++)
                                    acc[j][u + l] = __fadd_rn(
                                        acc[j][u + l], fmaxf(__fmul_rn(qq[l], hi[l]),
                                                             __fmul_rn(qq[l], lo[l])));
                            }
                        }
                    }
                }
#pragma unroll
                for (int j = 0; j < QJ; j++) {
                    if (j0 + j * tpp >= g) continue;
                    float sc = 0.0f;
#pragma unroll
                    for (int l = 0; l < 16; l++) sc = __fadd_rn(sc, acc[j][l]);
                    best = max(best, order_key(sc));
                }
            }
            if (best != 0) atomicMax(row_keys + i0 + r, best);
        }
    }

    // The last CTA of the row selects and writes it.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int total = gridDim.x * (shared ? gridDim.z : 1);
        s_last = atomicAdd(counters + row, 1) == total - 1;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const int out_row0 = shared ? row * copies : row;
    i32* out = ids + (size_t)out_row0 * width;
    int count = 0, tokens = 0;
    if (valid) {
        const int pick = min(plan.pick, score_stride);
        if (pick > 0) {
            const int n = min(plan.mid(), score_stride);
            if (keys_smem) {
                // The row's keys fit in shared memory (the weights' space, free by now).
                u32* sk = reinterpret_cast<u32*>(w);
#pragma unroll 8
                for (int i = threadIdx.x; i < n; i += SEL_THREADS) sk[i] = __ldcg(row_keys + i);
                __syncthreads();
                select_top<true>(sk, n, pick, plan.head_end, out + plan.head_end);
            } else {
                select_top<false>(row_keys, n, pick, plan.head_end, out + plan.head_end);
            }
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += SEL_THREADS) row_keys[i] = 0;
        }
        const int tail = plan.n - plan.tail_start;
        for (int i = threadIdx.x; i < plan.head_end; i += SEL_THREADS) out[i] = i;
        for (int i = threadIdx.x; i < tail; i += SEL_THREADS)
            out[plan.head_end + pick + i] = plan.tail_start + i;
        count = plan.head_end + pick + tail;
        tokens = (count - 1) * ps + (len - (plan.n - 1) * ps);
    }
    for (int i = count + threadIdx.x; i < width; i += SEL_THREADS) out[i] = -1;
    __syncthreads();
    for (int c = 1; c < (shared ? copies : 1); c++)
        for (int i = threadIdx.x; i < width; i += SEL_THREADS)
            out[(size_t)c * width + i] = out[i];
    if (threadIdx.x == 0) {
        for (int c = 0; c < (shared ? copies : 1); c++) {
            lens[out_row0 + c] = count;
            covered[out_row0 + c] = tokens;
        }
        counters[row] = 0;
    }
}

#define SELECT_KERNELS(NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(SEL_THREADS) quest_minmax_##NAME(             \
        const T* __restrict__ k, i32 num_blocks, i32 bs, i32 kvh, i32 d,                        \
        const i32* __restrict__ block_table, i32 max_blocks, const i32* __restrict__ cu_q,      \
        const i32* __restrict__ seq_lens, const i32* __restrict__ slots, T* __restrict__ reps,  \
        i32 layer, i32 num_slots, i32 max_pages, i32 ps) {                                       \
        minmax_body<T>(k, num_blocks, bs, kvh, d, block_table, max_blocks, cu_q, seq_lens,      \
                       slots, reps, layer, num_slots, max_pages, ps);                           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(SEL_THREADS, 3) quest_select_##NAME(             \
        const T* __restrict__ q, const i32* __restrict__ cu_q, i32 q_heads,                     \
        const T* __restrict__ reps, i32 layer, i32 num_slots, i32 max_pages,                    \
        const i32* __restrict__ slots, const i32* __restrict__ seq_lens, i32 kvh, i32 d,        \
        i32 ps, i32 budget, i32 sink_tokens, i32 recent_tokens, i32 shared, i32 tpp,            \
        u32* __restrict__ scores, i32 score_stride, i32 keys_smem, i32* __restrict__ counters,  \
        i32* __restrict__ ids, i32* __restrict__ lens, i32* __restrict__ covered, i32 width,    \
        i32 copies) {                                                                            \
        quest_body<T>(q, cu_q, q_heads, reps, layer, num_slots, max_pages, slots, seq_lens,     \
                      kvh, d, ps, budget, sink_tokens, recent_tokens, shared, tpp, scores,      \
                      score_stride, keys_smem, counters, ids, lens, covered, width, copies);    \
    }

SELECT_KERNELS(f32, float)
SELECT_KERNELS(f16, __half)
SELECT_KERNELS(bf16, __nv_bfloat16)
