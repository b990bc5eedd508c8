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
// Compiled after kernels/common.cuh (the integer typedefs).

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
    // A bf16 is the top half of its f32: one shift and one mask.
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
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

//
// With E4M3 summaries (`codes` non-null; sparse_algo::summary), the bounds are stored as one
// E4M3 code each in codes [layers, slots, max_pages, kv_heads, 2 d] and the (page, KV head)'s
// scale exponent in exps [layers, slots, max_pages, kv_heads], instead of in reps. A row's
// d / V::N threads are neighbouring lanes of one warp (the caller checks that they divide
// 32): they find the row's largest finite magnitude by shuffles, so every lane of the warp
// takes part, live or not.

// 2^e for e in -126..=127, exactly.
__device__ __forceinline__ float pow2f(int e) { return __int_as_float((e + 127) << 23); }

#define E4M3_MAX 448.0f
#define SCALE_EXP_MIN (-64)
#define SCALE_EXP_MAX 63

// summary::scale_exp: the least e in the clamp range with amax <= 448 * 2^e (0 for amax 0).
__device__ __forceinline__ int scale_exp(float amax) {
    if (amax == 0.0f) return 0;
    const int k = ((__float_as_int(amax) >> 23) & 0xff) - 127;
    int e = k - 8;
    if (e >= SCALE_EXP_MIN && e <= SCALE_EXP_MAX && amax > E4M3_MAX * pow2f(e)) e++;
    return min(max(e, SCALE_EXP_MIN), SCALE_EXP_MAX);
}

// The E4M3 code of summary::round_dir(y, up): the nearest E4M3 value at or above y (`up`) or
// at or below it, clamped to +-448; a zero result is code 0.
__device__ __forceinline__ u32 e4m3_outward(float y, bool up) {
    if (y != y) return up ? 0x7eu : 0xfeu;
    const float a = fabsf(y);
    const u32 sign = y < 0.0f ? 0x80u : 0u;
    if (a >= E4M3_MAX) return sign | 0x7eu;
    const bool away = up == (y >= 0.0f);
    const int k = ((__float_as_int(a) >> 23) & 0xff) - 127;
    const int kq = max(k, -6) - 3;  // the spacing of E4M3 values at a: 2^kq
    const float steps = a * pow2f(-kq);
    const float v = (away ? ceilf(steps) : floorf(steps)) * pow2f(kq);
    if (v == 0.0f) return 0u;
    if (v < 0.015625f) return sign | (u32)(v * 512.0f);  // a subnormal: v = m 2^-9
    const int kv = ((__float_as_int(v) >> 23) & 0xff) - 127;
    return sign | ((u32)(kv + 7) << 3) | (u32)((v * pow2f(-kv) - 1.0f) * 8.0f);
}

template <typename T>
__device__ void minmax_body(const T* __restrict__ k, i32 num_blocks, i32 bs, i32 kvh, i32 d,
                            const i32* __restrict__ block_table, i32 max_blocks,
                            const i32* __restrict__ cu_q, const i32* __restrict__ seq_lens,
                            const i32* __restrict__ slots, T* __restrict__ reps, i32 layer,
                            i32 num_slots, i32 max_pages, i32 ps,
                            unsigned char* __restrict__ codes, signed char* __restrict__ exps) {
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
    long item = (long)blockIdx.x * SEL_THREADS + threadIdx.x;
    const bool live = item < items;
    if (!live && codes == nullptr) return;
    if (!live) item = 0;  // a row of this sequence, read but not written
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
    const size_t row = (((size_t)layer * num_slots + slot) * max_pages + p) * kvh + h;
    const size_t base = row * 2 * d + (size_t)v * V::N;
    if (codes == nullptr) {
        *reinterpret_cast<uint4*>(reps + base) = V::narrow(hi);
        *reinterpret_cast<uint4*>(reps + base + d) = V::narrow(lo);
        return;
    }
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < V::N; i++) {
        if (isfinite(hi[i])) amax = fmaxf(amax, fabsf(hi[i]));
        if (isfinite(lo[i])) amax = fmaxf(amax, fabsf(lo[i]));
    }
    for (int o = 1; o < vecs; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (!live) return;
    const int e = scale_exp(amax);
    const float inv = pow2f(-e);
    u32 up[2] = {0u, 0u}, down[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < V::N; i++) {
        up[i / 4] |= e4m3_outward(hi[i] * inv, true) << (8 * (i % 4));
        down[i / 4] |= e4m3_outward(lo[i] * inv, false) << (8 * (i % 4));
    }
    if (V::N == 8) {
        *reinterpret_cast<uint2*>(codes + base) = make_uint2(up[0], up[1]);
        *reinterpret_cast<uint2*>(codes + base + d) = make_uint2(down[0], down[1]);
    } else {
        *reinterpret_cast<u32*>(codes + base) = up[0];
        *reinterpret_cast<u32*>(codes + base + d) = down[0];
    }
    if (v == 0) exps[row] = (signed char)e;
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

// Keys the scoring kernel wrote, read past L1, or a copy in shared memory.
template <bool SMEM>
__device__ __forceinline__ u32 key_at(const u32* keys, int i) {
    return SMEM ? keys[i] : __ldcg(keys + i);
}

// The ids of the `pick` largest keys of keys[0..n) in ascending id order, written to out; ties go
// to the lower id. The caller has found the largest key `top` and a `lo` that at least `pick`
// keys reach, and zeroed hist[0]. The pick-th largest key T (the largest T that at least `pick`
// keys reach) is found by histograms over a shrinking key range [lo, hi): each round bins the
// range's keys into SEL_BINS equal bins (shared-memory atomics) and finds the bin where the
// count of keys at or above it reaches `pick`, which becomes the range. Where that bin holds
// exactly the keys still needed, the search ends: all of them are taken. 32-bit keys take at
// most 3 rounds (12 bits each). Rounds alternate between the two histograms of `hist` (2 *
// SEL_BINS ints), each clearing the other one as it bins, so a round costs three barriers:
// binned, warp totals written, bin found.
// Then each warp takes, in id order, every key above T and the first (pick - #above) keys equal
// to T of its run of ids, placed by one scan of the warps' counts. Key i's id is id0 + i, or
// ids[i] where `ids` is given (a list of candidates in id order, pick_candidates); with TAGS
// each id taken is also stored tagged (`TagOut`). Every thread of a CTA of THREADS (1024)
// threads calls it.
#define SEL_BINS 4096

// Where select_top also stores each id it takes, tagged with `step` (pdl.cuh, store_tagged):
// the same place of `at` and of its `copies - 1` copies, `stride` apart.
struct TagOut {
    unsigned long long* at;
    int copies;
    int stride;
    u32 step;
};

template <int THREADS, bool SMEM, bool TRACE, bool TAGS = false>
__device__ int select_top(const u32* keys, int n, int pick, int id0, i32* out, u32 lo, u32 top,
                          int* hist, Trace<TRACE>& tr, const i32* ids = nullptr,
                          TagOut tag = {nullptr, 0, 0, 0u}) {
    constexpr int PER = SEL_BINS / THREADS;  // bins per thread
    constexpr int WARPS = THREADS / 32;
    static_assert(WARPS == 32, "a lane per warp in the scans over warps");
    __shared__ int wsum[WARPS];
    __shared__ u32 found[3];
    __shared__ int2 counts[WARPS];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    // Every key reaches lo; none reaches hi; `above` keys lie at or above hi.
    unsigned long long hi = (unsigned long long)top + 1;
    int above = 0, rounds = 0;
    for (int cur = 0; hi - lo > 1; cur ^= 1, rounds++) {
        int* h = hist + cur * SEL_BINS;
        int* other = hist + (cur ^ 1) * SEL_BINS;
        const unsigned long long span = hi - lo;
        const u32 width = (u32)((span + SEL_BINS - 1) / SEL_BINS);
        // The other histogram was last read before the previous round's second barrier.
#pragma unroll
        for (int j = 0; j < PER; j++) other[tid * PER + j] = 0;
        for (int i = tid; i < n; i += THREADS) {
            const u32 key = key_at<SMEM>(keys, i);
            if (key >= lo && key < hi) atomicAdd(&h[(key - lo) / width], 1);
        }
        __syncthreads();
        // Thread t owns bins SEL_BINS - PER (t + 1) .. SEL_BINS - PER t, so warp 0 owns the top
        // ones and threads in order scan the bins from the top down.
        const int b0 = SEL_BINS - PER * (tid + 1);
        int mine[PER], sum = 0;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            mine[j] = h[b0 + j];
            sum += mine[j];
        }
        const int total = __reduce_add_sync(0xffffffffu, sum);
        if (lane == 0) wsum[warp] = total;
        __syncthreads();
        // Keys in the bins of the warps before this one: each warp scans the warp totals.
        const int w = wsum[lane];
        int upto = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, upto, o);
            if (lane >= o) upto += y;
        }
        const int warp_above = above + __shfl_sync(0xffffffffu, upto - w, warp);
        if (warp_above < pick && warp_above + total >= pick) {
            // The bin is this warp's: the keys in its threads' bins before each thread's.
            int lanes = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, lanes, o);
                if (lane >= o) lanes += y;
            }
            int at_or_above = warp_above + lanes - sum;
#pragma unroll
            for (int j = PER - 1; j >= 0; j--) {
                // at_or_above counts the keys above bin b0 + j; with them, its keys reach pick.
                if (at_or_above < pick && at_or_above + mine[j] >= pick) {
                    found[0] = (u32)(b0 + j);
                    found[1] = (u32)at_or_above;
                    found[2] = at_or_above + mine[j] == pick;
                }
                at_or_above += mine[j];
            }
        }
        __syncthreads();
        // The next round writes wsum and found only after its first barrier, which every
        // thread reaches after reading them here.
        const u32 b = found[0];
        above = (int)found[1];
        const bool whole = found[2] != 0;
        const unsigned long long next_lo = lo + (unsigned long long)b * width;
        hi = min(hi, next_lo + width);
        lo = (u32)next_lo;
        if (whole && lo > 0) {
            // The bin's keys are exactly the ones still needed: every key at or above its
            // start is taken, so T is the key below it, exceeded by `pick` keys.
            lo -= 1;
            above = pick;
            break;
        }
    }
    tr.mark(6, lo);
    // lo is T, and `above` keys exceed it. Warp w owns ids [w0, w1), read 32 at a time (lane i
    // the i-th): its counts by ballot, then one scan of the warps' (greater, equal) counts.
    const u32 t = lo;
    const int remaining = pick - above;
    const int run = ((n + WARPS - 1) / WARPS + 31) & ~31;
    const int w0 = min(n, warp * run), w1 = min(n, w0 + run);
    int gt = 0, eq = 0;
    for (int base = w0; base < w1; base += 32) {
        const int i = base + lane;
        const u32 key = i < w1 ? key_at<SMEM>(keys, i) : 0u;
        gt += __popc(__ballot_sync(0xffffffffu, i < w1 && key > t));
        eq += __popc(__ballot_sync(0xffffffffu, i < w1 && key == t));
    }
    if (lane == 0) counts[warp] = make_int2(gt, eq);
    __syncthreads();
    const int2 c = counts[lane];
    int2 upto = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int ya = __shfl_up_sync(0xffffffffu, upto.x, o);
        const int yb = __shfl_up_sync(0xffffffffu, upto.y, o);
        if (lane >= o) {
            upto.x += ya;
            upto.y += yb;
        }
    }
    // Keys greater than T and equal to T in the warps before this one.
    const int gt_before = __shfl_sync(0xffffffffu, upto.x - c.x, warp);
    int eq_seen = __shfl_sync(0xffffffffu, upto.y - c.y, warp);
    int at = gt_before + min(eq_seen, remaining);
    const u32 below = (1u << lane) - 1u;
    for (int base = w0; base < w1; base += 32) {
        const int i = base + lane;
        const u32 key = i < w1 ? key_at<SMEM>(keys, i) : 0u;
        const u32 eqs = __ballot_sync(0xffffffffu, i < w1 && key == t);
        const bool take =
            i < w1 && (key > t || (key == t && eq_seen + __popc(eqs & below) < remaining));
        const u32 takes = __ballot_sync(0xffffffffu, take);
        if (take) {
            const int p = at + __popc(takes & below);
            const i32 id = ids != nullptr ? ids[i] : id0 + i;
            out[p] = id;
            // Tagged places (pick_body): each copy of the row.
            if (TAGS)
                for (int c = 0; c < tag.copies; c++)
                    store_tagged(tag.at + (size_t)c * tag.stride + p, tag.step, id);
        }
        at += __popc(takes);
        eq_seen += __popc(eqs);
    }
    return rounds;
}

// ---------------------------------------------------------------------------------------------
// Quest estimate, then top-k, in two launches on one stream. A selection row is (sequence, KV
// head), or a sequence when `shared` (one selection from every query head).
//
// quest_score_*: the work items are (selection row, head, tile of mid pages), numbered in that
// order; CTA b takes items b * per_cta .. (b + 1) * per_cta, so a CTA mostly stays on one row
// and head. A tile is one KV head's [kmax ‖ kmin] rows for SCORE_THREADS / tpp pages, staged in
// shared memory with cp.async; two buffers, so the next item's copy runs under this item's math.
// `tpp` threads share a page, each scoring some of the group's query heads: the sum over d of
// q_d kmax_d where q_d >= 0 and q_d kmin_d where it is negative, in score.rs's order (16 lanes,
// each rounded step by step, then the lanes in order). The CPU picks each element's kmax or
// kmin by the query's sign bit and adds one product too (score.rs); the two differ only in
// which side a query of -0 picks, a product of zero either way, and a zero never changes a sum
// that starts at +0, so scores equal the CPU's bit for bit (for finite keys). Masks made once
// per query pick each element's kmax or kmin bits in one logic operation per 32-bit word,
// before widening. A page's key is its best score, merged over threads and heads by atomicMax into
// scores[row, page - head_end].
//
// pick_rows: one CTA of PICK_THREADS per selection row selects from the row's keys (a
// shared-memory copy when `keys_smem`), zeroes them for the next launch (where `zero_keys`: the
// scoring kernels that merge by atomicMax need it; those that store every key do not) and
// writes the row:
// forced head pages, the chosen ones, the tail, -1 padding; `copies` output rows per selection
// row (shared: 1 or kv_heads), their lengths and the tokens they cover. Every algorithm's rows
// come out of it: Quest's and DSA's after their scoring kernels, StreamingLLM's with a budget
// of 0 (forced pages only, no keys read) and no slots (`slots` null). Where `ready` is given,
// each row is then published: its flag, ready[row], set to `epoch` once the row is written,
// for an attention that started before this launch ends (pdl.cuh). `epoch` is the step's
// value, advanced by the scoring launch before this one.

#define QJ 2                 // query heads a thread scores per pass over its page
#define SCORE_THREADS 128    // threads of a scoring CTA
#define TILE_BYTES 32768     // min/max rows of one tile buffer (before padding)
#define PICK_THREADS 1024    // threads of a selecting CTA (32 warps)

// 16 bytes global -> shared without registers (cp.async, sm_80 and later); commit closes a
// group, wait<N> waits until at most N of this thread's groups are in flight.
__device__ __forceinline__ void copy16(void* smem, const void* gmem) {
#if __CUDA_ARCH__ >= 800
    const u32 at = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(gmem));
#else
    *reinterpret_cast<uint4*>(smem) = __ldg(reinterpret_cast<const uint4*>(gmem));
#endif
}
__device__ __forceinline__ void copy16_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void copy16_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Where the step's rows are published (`epoch` non-null), the scoring launch advances the
// step's value once, after its wait: pick_rows sets each row's flag to it, and the attention
// that starts before pick_rows ends waits for it. A value kept in device memory, not passed as
// an argument, so that a replayed CUDA graph of the step advances it too.
__device__ __forceinline__ void advance_epoch(u32* epoch) {
    if (epoch != nullptr && blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(epoch, 1u);
}

// quest_score_*'s integer arguments, one struct (the Rust side mirrors it, #[repr(C)]).
struct ScoreArgs {
    i32 q_heads, layer, num_slots, max_pages, kvh, d, ps, budget, sink_tokens, recent_tokens,
        shared, tpp, score_stride, tiles;
};

// A (selection row, head) of the scoring kernels, numbered rh = row * heads + head: its
// selection row, KV head, its sequence's decode query row (cu_q[s + 1] - 1), scored mid pages
// (0: none; at most score_stride) and the first element of its first mid page's min/max row.
// It reads only the batch's metadata, which the host writes.
struct RowFacts {
    int row, h, q_row, npg;
    size_t rep0;
    __device__ RowFacts(int rh, const ScoreArgs& a, const i32* __restrict__ cu_q,
                        const i32* __restrict__ seq_lens, const i32* __restrict__ slots) {
        const int heads = a.shared ? a.kvh : 1;
        row = rh / heads;
        const int s = a.shared ? row : row / a.kvh;
        h = a.shared ? rh % heads : row % a.kvh;
        npg = 0;
        rep0 = 0;
        q_row = cu_q[s + 1] - 1;
        const int len = seq_lens[s];
        const int slot = slots[s];
        if (len <= 0 || slot < 0 || slot >= a.num_slots) return;
        const Plan plan(len, a.ps, a.budget, a.sink_tokens, a.recent_tokens);
        if (plan.pick <= 0) return;
        npg = min(plan.mid(), a.score_stride);
        rep0 = ((((size_t)a.layer * a.num_slots + slot) * a.max_pages + plan.head_end) * a.kvh +
                h) * 2 * a.d;
    }
};

// A scoring item's coordinates: selection row, KV head, its sequence's decode query row, the
// tile's first mid page and page count (0: nothing to score), and the first element of its
// min/max rows.
struct Item {
    int row, h, q_row, i0, npg;
    size_t rep0;
};

template <typename T>
__device__ void score_body(const T* __restrict__ q, const i32* __restrict__ cu_q,
                           const T* __restrict__ reps, const i32* __restrict__ slots,
                           const i32* __restrict__ seq_lens, const ScoreArgs a, i32 items,
                           i32 per_cta, u32* __restrict__ scores) {
    typedef Vec16<T> V;
    // Dynamic shared memory: the group's queries [g, d] as f32 (NaN read as 0, as the CPU's
    // weights max(q, 0) and min(q, 0) read it), their masks, then two tile buffers.
    extern __shared__ float w[];
    const int g = a.q_heads / a.kvh;
    const int tile_pages = SCORE_THREADS / a.tpp;
    const int row_bytes = 2 * a.d * (int)sizeof(T);
    const int pitch = row_bytes + 16;
    const int vr = row_bytes / 16;
    const size_t page_stride = (size_t)a.kvh * 2 * a.d;
    // Per query element, a mask over its bits in a 32-bit word of a min/max row: set where it
    // reads kmax (the element is >= 0), clear where it reads kmin ([g, d * sizeof(T) / 4]).
    u32* masks = reinterpret_cast<u32*>(w + g * a.d);
    unsigned char* tiles = reinterpret_cast<unsigned char*>(masks + g * a.d * sizeof(T) / 4);
    const int tile_bytes = tile_pages * pitch;
    // This thread's first 16-byte copy of a tile (row c_r, column c_c) and its stride.
    const int c_r = threadIdx.x / vr, c_c = threadIdx.x % vr;
    const int step_r = SCORE_THREADS / vr, step_c = SCORE_THREADS % vr;

    auto locate = [&](int it) {
        const RowFacts f(it / a.tiles, a, cu_q, seq_lens, slots);
        Item m;
        m.row = f.row;
        m.q_row = f.q_row;
        m.h = f.h;
        m.i0 = (it % a.tiles) * tile_pages;
        m.npg = max(0, min(tile_pages, f.npg - m.i0));
        m.rep0 = f.npg > 0 ? f.rep0 + (size_t)m.i0 * page_stride : 0;
        return m;
    };
    // Issues the copies of item m's tile into buffer `buf`.
    auto stage = [&](const Item& m, int buf) {
        const T* src = reps + m.rep0;
        unsigned char* dst = tiles + buf * tile_bytes;
        for (int r = c_r, c = c_c; r < m.npg;) {
            copy16(dst + r * pitch + c * 16, src + r * page_stride + c * (16 / sizeof(T)));
            r += step_r;
            c += step_c;
            if (c >= vr) {
                c -= vr;
                r++;
            }
        }
    };

    const int first = blockIdx.x * per_cta;
    const int last = min(items, first + per_cta);
    if (first >= last) return;
    int have_q = -1;  // the (row, head) whose queries w holds
    Item next = locate(first);
    stage(next, 0);
    copy16_commit();
    for (int it = first; it < last; it++) {
        const int buf = (it - first) & 1;
        const Item m = next;
        if (it + 1 < last) {
            next = locate(it + 1);
            stage(next, buf ^ 1);
        }
        copy16_commit();
        copy16_wait<1>();
        __syncthreads();
        if (m.npg == 0) continue;  // uniform over the CTA
        const int rh = it / a.tiles;
        if (rh != have_q) {
            // The previous item's math finished at its closing barrier.
            const T* qrow = q + ((size_t)m.q_row * a.q_heads + (size_t)m.h * g) * a.d;
            for (int i = threadIdx.x * V::N; i < g * a.d; i += SCORE_THREADS * V::N) {
                float x[V::N];
                V::widen(__ldg(reinterpret_cast<const uint4*>(qrow + i)), x);
                u32 mk[V::N * sizeof(T) / 4] = {};
#pragma unroll
                for (int j = 0; j < V::N; j++) {
                    w[i + j] = x[j] == x[j] ? x[j] : 0.0f;
                    // The element's bits in its 32-bit word, set where it reads kmax.
                    const int bits = 8 * (int)sizeof(T);
                    const u32 ones = bits == 32 ? 0xffffffffu : ((1u << bits) - 1);
                    if (!(w[i + j] < 0.0f)) mk[j * bits / 32] |= ones << (j * bits % 32);
                }
#pragma unroll
                for (int j = 0; j < V::N * (int)sizeof(T) / 4; j++)
                    masks[i * sizeof(T) / 4 + j] = mk[j];
            }
            have_q = rh;
            __syncthreads();
        }
        const int row = m.row, i0 = m.i0, npg = m.npg;
        const int r = threadIdx.x % tile_pages;
        const int sub = threadIdx.x / tile_pages;
        const int d = a.d;
        if (r < npg) {
            const unsigned char* mine = tiles + buf * tile_bytes + r * pitch;
            u32 best = 0;
            // Query heads sub, sub + tpp, ...; QJ of them per pass over the row.
            for (int j0 = sub; j0 < g; j0 += QJ * a.tpp) {
                float acc[QJ][16];
#pragma unroll
                for (int j = 0; j < QJ; j++)
#pragma unroll
                    for (int l = 0; l < 16; l++) acc[j][l] = 0.0f;
                for (int c = 0; c < d; c += 16) {
#pragma unroll
                    for (int u = 0; u < 16; u += 8) {
                        // Elements c + u .. c + u + 8 of kmax and kmin (lanes u .. u + 8), raw.
                        uint4 hi[8 / V::N], lo[8 / V::N];
#pragma unroll
                        for (int k = 0; k < 8 / V::N; k++) {
                            const int e = c + u + k * V::N;
                            hi[k] = *reinterpret_cast<const uint4*>(mine + e * sizeof(T));
                            lo[k] = *reinterpret_cast<const uint4*>(mine + (d + e) * sizeof(T));
                        }
#pragma unroll
                        for (int j = 0; j < QJ; j++) {
                            const int jj = j0 + j * a.tpp;
                            if (jj < g) {
                                const float4* qv =
                                    reinterpret_cast<const float4*>(w + jj * d + c + u);
                                const float4 qa = qv[0], qb = qv[1];
                                const float qq[8] = {qa.x, qa.y, qa.z, qa.w,
                                                     qb.x, qb.y, qb.z, qb.w};
                                // Each element's kmax where its query is >= 0, else its kmin.
                                const uint4* mj = reinterpret_cast<const uint4*>(
                                    masks + (jj * d + c + u) * sizeof(T) / 4);
                                float k8[8];
#pragma unroll
                                for (int k = 0; k < 8 / V::N; k++) {
                                    const uint4 m = mj[k];
                                    V::widen(make_uint4((hi[k].x & m.x) | (lo[k].x & ~m.x),
                                                        (hi[k].y & m.y) | (lo[k].y & ~m.y),
                                                        (hi[k].z & m.z) | (lo[k].z & ~m.z),
                                                        (hi[k].w & m.w) | (lo[k].w & ~m.w)),
                                             k8 + k * V::N);
                                }
#pragma unroll
                                for (int l = 0; l < 8; l++)
                                    acc[j][u + l] =
                                        __fadd_rn(acc[j][u + l], __fmul_rn(qq[l], k8[l]));
                            }
                        }
                    }
                }
#pragma unroll
                for (int j = 0; j < QJ; j++) {
                    if (j0 + j * a.tpp >= g) continue;
                    float sc = 0.0f;
#pragma unroll
                    for (int l = 0; l < 16; l++) sc = __fadd_rn(sc, acc[j][l]);
                    best = max(best, order_key(sc));
                }
            }
            if (best != 0) atomicMax(scores + (size_t)row * a.score_stride + i0 + r, best);
        }
        // Every thread is done with this buffer before the next iteration refills it.
        __syncthreads();
    }
    copy16_wait<0>();
}

// ---------------------------------------------------------------------------------------------
// quest_score_tc_*: the same estimate on tensor cores, for f16 and bf16 keys and groups of at
// most 8 query heads. Since max(q kmax, q kmin) = q+ kmax + q- kmin (q+ = max(q, 0), q- =
// min(q, 0); kmax >= kmin), a page's scores for the group are one row of the product of its
// [kmax ‖ kmin] row (2d elements) with the [q+ ; q-] columns of the group's heads: an MMA
// with 16 pages as M, the heads as N (8, the unused ones zero) and 2d as K. The products of
// two 16-bit elements are exact in f32; only the order of the f32 sums differs from the CPU's,
// so a score may differ from score.rs's in its last bits, and pages whose scores tie within that
// rounding may be chosen differently (the check allows exactly that; `quest_score_*` above is the
// bit-identical kernel).
//
// A warp takes a run of consecutive items (selection row, KV head, tile of 16 mid pages) and
// reads each page's row straight into A fragments (16-byte loads, 512 bytes a row at d 128);
// the queries become B fragments once per (row, head). The k index is permuted the same way
// in A and B: thread (g, t) holds elements 32 i + 8 t .. 32 i + 8 t + 8 of its rows, and MMA
// step (i, w) takes words w and w + 1 of them as the k columns (2t, 2t + 1) and (2t + 8,
// 2t + 9). C holds pages g and g + 8 for heads 2t and 2t + 1; a page's key is the best of its
// group's heads (a max over the quad), stored, or merged by atomicMax into a shared row.

#define TC_WARPS 8  // warps of a tensor-core scoring CTA

// The 16-bit elements of a word kept on one side of zero: where `neg`, the negative ones,
// else the others; NaN and the rest become +0 (the CPU reads a NaN query as 0).
__device__ __forceinline__ constexpr u32 exp_bits(const __half*) { return 0x7c00u; }
__device__ __forceinline__ constexpr u32 exp_bits(const __nv_bfloat16*) { return 0x7f80u; }
template <typename T>
__device__ __forceinline__ u32 signed_half(u32 w, bool neg) {
    // The exponent bits: above them (sign cleared), a NaN.
    const u32 exp = exp_bits(static_cast<const T*>(nullptr));
    u32 out = 0;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u32 h = (w >> (16 * i)) & 0xffffu;
        const bool nan = (h & 0x7fffu) > exp;
        const bool is_neg = (h & 0x8000u) != 0;
        if (!nan && is_neg == neg) out |= h << (16 * i);
    }
    return out;
}

// With E4M3 summaries (E8: `codes` and `exps` as quest_minmax_* writes them with `codes`), a
// thread loads two chunks' codes at once (e8_elem) and widens them to f16 by bit moves alone: code
// bits (s, e, m) become the f16 (s, e, m << 7), which is the code's value times 2^-8 exactly,
// subnormals included. The group's queries become f16 times 2^-eq, with eq putting their
// largest magnitude in [2^14, 2^15): exact for every element above 2^-28 of it (the bf16 or
// f16 element fits f16's wider significand). A page's MMA sums thus come out in units of
// 2^(-8 - eq - e) of the score, e its scale exponent, and are scaled back exactly.
// Each 16-bit lane of `x` holds a code in its low byte: the f16 pair of the two codes' values
// times 2^-8.
__device__ __forceinline__ u32 e4m3x2_f16x2(u32 x) {
    return ((x & 0x007f007fu) << 7) | ((x & 0x00800080u) << 8);
}

// Eight codes (two words, in element order) as four f16 pairs.
__device__ __forceinline__ uint4 e4m3x8_f16x8(uint2 w) {
    return make_uint4(e4m3x2_f16x2(__byte_perm(w.x, 0u, 0x4140)),
                      e4m3x2_f16x2(__byte_perm(w.x, 0u, 0x4342)),
                      e4m3x2_f16x2(__byte_perm(w.y, 0u, 0x4140)),
                      e4m3x2_f16x2(__byte_perm(w.y, 0u, 0x4342)));
}

// E8: the first element of chunk i of a [kmax ‖ kmin] row (or of a query, for i below HALF)
// that thread t of a group of four holds. The k order of an MMA may be permuted freely as long
// as both operands share it, so a thread's two chunks 2j and 2j + 1 are 16 consecutive codes
// (one 16-byte load): elements 64 j + 16 t .. + 16.
__device__ __forceinline__ int e8_elem(int i, int t) { return 64 * (i / 2) + 16 * t + 8 * (i % 2); }

// A if B, else C (std::conditional, which NVRTC's headers may lack).
template <bool B, typename A, typename C>
struct Either {
    typedef A type;
};
template <typename A, typename C>
struct Either<false, A, C> {
    typedef C type;
};

template <typename T, int D, bool TRACE, bool E8>
__device__ void score_tc_body(const T* __restrict__ q, const i32* __restrict__ cu_q,
                              const T* __restrict__ reps, const i32* __restrict__ slots,
                              const i32* __restrict__ seq_lens, const ScoreArgs a, i32 items,
                              i32 per_warp, u32* __restrict__ scores,
                              u32* __restrict__ epoch, const unsigned char* __restrict__ codes,
                              const signed char* __restrict__ exps) {
    typedef typename Either<E8, __half, T>::type M;  // the MMA's element type
    // Traced (the `_traced` kernel): entry, after the wait, the end of warp 0's items.
    Trace<TRACE> tr(0);
    tr.mark(0, 0u);
    constexpr int KC = 2 * D / 32;  // 16-byte chunks of a row per thread
    constexpr int HALF = KC / 2;    // chunks of kmax (then kmin)
    const int lane = threadIdx.x & 31;
    const int gl = lane >> 2;  // A: pages gl and gl + 8; B: head gl of the group
    const int t = lane & 3;
    const int g = a.q_heads / a.kvh;
    const size_t page_stride = (size_t)a.kvh * 2 * D;
    const long warp_id = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long first = warp_id * per_warp;
    const long last = min((long)items, first + per_warp);
    unsigned done = 0;

    uint4 qf[KC];
    int q_exp = 0;  // E8: the queries' scale exponent
    int have = -1;
    // The (row, head)'s sequence facts, set with its queries. The first item's come from the
    // batch's metadata (query offsets, lengths, slots), which only the host writes: read before
    // waiting for the kernel before this one (kernels/pdl.cuh), so that their loads overlap its
    // end and the queries' loads need not wait for the query offsets.
    int row = 0, npg_all = 0;
    size_t rep_row0 = 0;
    if (first >= last) return;
    RowFacts f((int)(first / a.tiles), a, cu_q, seq_lens, slots);
    pdl_enter();
    advance_epoch(epoch);
    tr.mark(1, 0u);
    for (long it = first; it < last; it++) {
        const int tile = (int)(it % a.tiles);
        const int rh = (int)(it / a.tiles);
        if (rh != have) {
            if (have >= 0) f = RowFacts(rh, a, cu_q, seq_lens, slots);
            have = rh;
            row = f.row;
            npg_all = f.npg;
            rep_row0 = f.rep0;
            if (npg_all > 0) {
                const T* qrow = q + ((size_t)f.q_row * a.q_heads + (size_t)f.h * g + gl) * D;
                if (E8) {
                    // The group's elements (NaN read as 0), their largest magnitude, eq.
                    float x[HALF][8];
                    float amax = 0.0f;
#pragma unroll
                    for (int i = 0; i < HALF; i++) {
                        uint4 v = make_uint4(0u, 0u, 0u, 0u);
                        if (gl < g)
                            v = __ldg(reinterpret_cast<const uint4*>(qrow + e8_elem(i, t)));
                        Vec16<T>::widen(v, x[i]);
#pragma unroll
                        for (int j = 0; j < 8; j++) {
                            if (x[i][j] != x[i][j]) x[i][j] = 0.0f;
                            amax = fmaxf(amax, fabsf(x[i][j]));
                        }
                    }
                    // Magnitudes order as their bits do.
                    amax = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(amax)));
                    const int k = ((__float_as_int(amax) >> 23) & 0xff) - 127;
                    q_exp = amax == 0.0f ? 0 : min(max(k - 14, -110), 113);
                    const float inv = pow2f(-q_exp);
#pragma unroll
                    for (int i = 0; i < KC; i++) {
                        const bool neg = i >= HALF;
                        float y[8];
#pragma unroll
                        for (int j = 0; j < 8; j++) {
                            const float xj = x[i % HALF][j];
                            y[j] = (neg ? xj < 0.0f : !(xj < 0.0f)) ? xj * inv : 0.0f;
                        }
                        qf[i] = Vec16<__half>::narrow(y);
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < KC; i++) {
                        uint4 v = make_uint4(0u, 0u, 0u, 0u);
                        if (gl < g) {
                            v = __ldg(
                                reinterpret_cast<const uint4*>(qrow + (i % HALF) * 32 + t * 8));
                            const bool neg = i >= HALF;
                            v = make_uint4(signed_half<T>(v.x, neg), signed_half<T>(v.y, neg),
                                           signed_half<T>(v.z, neg), signed_half<T>(v.w, neg));
                        }
                        qf[i] = v;
                    }
                }
            }
        }
        const int i0 = tile * 16;
        const int npg = min(16, npg_all - i0);
        done++;
        if (npg <= 0) continue;  // uniform over the warp
        uint4 ka[KC], kb[KC];
        // E8: the two pages' scale exponents (row rep_row0 / 2D of exps is the tile's first).
        int ea = 0, eb = 0;
        if (E8) {
            const unsigned char* src = codes + rep_row0 + (size_t)i0 * page_stride;
            uint4 ra[KC / 2], rb[KC / 2];
#pragma unroll
            for (int j = 0; j < KC / 2; j++) {
                const int at = e8_elem(2 * j, t);
                ra[j] = gl < npg
                            ? __ldg(reinterpret_cast<const uint4*>(src + gl * page_stride + at))
                            : make_uint4(0u, 0u, 0u, 0u);
                rb[j] = gl + 8 < npg ? __ldg(reinterpret_cast<const uint4*>(
                                           src + (gl + 8) * page_stride + at))
                                     : make_uint4(0u, 0u, 0u, 0u);
            }
            const signed char* ex = exps + rep_row0 / (2 * D) + (size_t)i0 * a.kvh;
            if (gl < npg) ea = __ldg(ex + (size_t)gl * a.kvh);
            if (gl + 8 < npg) eb = __ldg(ex + (size_t)(gl + 8) * a.kvh);
#pragma unroll
            for (int i = 0; i < KC; i++) {
                const uint4 x = ra[i / 2], y = rb[i / 2];
                ka[i] = e4m3x8_f16x8(i % 2 == 0 ? make_uint2(x.x, x.y) : make_uint2(x.z, x.w));
                kb[i] = e4m3x8_f16x8(i % 2 == 0 ? make_uint2(y.x, y.y) : make_uint2(y.z, y.w));
            }
        } else {
            const T* src = reps + rep_row0 + (size_t)i0 * page_stride + t * 8;
#pragma unroll
            for (int i = 0; i < KC; i++) {
                ka[i] = gl < npg
                            ? __ldg(reinterpret_cast<const uint4*>(src + gl * page_stride + i * 32))
                            : make_uint4(0u, 0u, 0u, 0u);
                kb[i] = gl + 8 < npg ? __ldg(reinterpret_cast<const uint4*>(
                                           src + (gl + 8) * page_stride + i * 32))
                                     : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < KC; i++) {
#pragma unroll
            for (int w = 0; w < 4; w += 2) {
                Mma<M>::run(c, word(ka[i], w), word(kb[i], w), word(ka[i], w + 1),
                              word(kb[i], w + 1), word(qf[i], w), word(qf[i], w + 1));
            }
        }
        if (E8) {
            // Back to the score's units: two exact power-of-two scalings each.
            const float qs = pow2f(q_exp + 8);
            const float sa = pow2f(ea), sb = pow2f(eb);
            c[0] = c[0] * qs * sa;
            c[1] = c[1] * qs * sa;
            c[2] = c[2] * qs * sb;
            c[3] = c[3] * qs * sb;
        }
        // Pages gl (c[0], c[1]) and gl + 8 (c[2], c[3]), heads 2t and 2t + 1: the best real head.
        u32 best[2];
#pragma unroll
        for (int p = 0; p < 2; p++) {
            u32 k = 0;
            if (2 * t < g) k = order_key(c[2 * p]);
            if (2 * t + 1 < g) k = max(k, order_key(c[2 * p + 1]));
            k = max(k, __shfl_xor_sync(0xffffffffu, k, 1));
            k = max(k, __shfl_xor_sync(0xffffffffu, k, 2));
            best[p] = k;
        }
        // A row of one KV head has each page scored here once: stored. A shared row's pages are
        // scored once per KV head: merged.
        u32* dst = scores + (size_t)row * a.score_stride + i0;
        if (a.shared) {
            if (t == 0 && gl < npg && best[0] != 0) atomicMax(dst + gl, best[0]);
            if (t == 0 && gl + 8 < npg && best[1] != 0) atomicMax(dst + gl + 8, best[1]);
        } else {
            if (t == 0 && gl < npg) dst[gl] = best[0];
            if (t == 0 && gl + 8 < npg) dst[gl + 8] = best[1];
        }
    }
    tr.finish(0, done);
}

// Records of traced selecting CTAs start here in attn_trace, after the scoring CTAs'.
#define PICK_TRACE_FIRST 2048

// Keys a selecting thread holds in registers: rows of up to PICK_KEYS * PICK_THREADS keys (8192:
// L128K in pages of 16) are read once.
#define PICK_KEYS 8
// The most candidates (keys at or above the floor) a selecting CTA keeps in shared memory.
#define PICK_CANDIDATES 1024

// A row's candidates in id order: their keys and ids, and the counts of each (key j, warp)
// ballot that place them.
struct Candidates {
    u32 keys[PICK_CANDIDATES];
    i32 ids[PICK_CANDIDATES];
    int counts[PICK_KEYS][PICK_THREADS / 32];
};

// Turns each thread's least and largest key into the row's floor and largest key, the same in
// every thread. The floor: where each of the 32 warps needs to give only per = ceil(pick / 32)
// keys, the smallest over the warps of a warp's per-th largest lane maximum. Every warp then
// has per lanes with a key at or above it, so 32 per >= pick keys reach it (where a warp has
// fewer lanes with keys, the floor is 0, which every key reaches); past 32 a warp, the least
// key. It leaves out of the first histogram, and out of the candidates, the keys far below the
// pick-th. One barrier.
__device__ __forceinline__ void row_floor(u32& lo, u32& top, int pick,
                                          u32 (&red)[2][PICK_THREADS / 32]) {
    const int lane = threadIdx.x & 31;
    const int per = (pick + 31) / 32;
    if (per <= 32) {
        u32 v = top, m = 0;
        for (int r = 0; r < per; r++) {
            m = __reduce_max_sync(0xffffffffu, v);
            if (lane == __ffs(__ballot_sync(0xffffffffu, v == m)) - 1) v = 0;
        }
        lo = m;
    } else {
        lo = __reduce_min_sync(0xffffffffu, lo);
    }
    top = __reduce_max_sync(0xffffffffu, top);
    if (lane == 0) {
        red[0][threadIdx.x >> 5] = lo;
        red[1][threadIdx.x >> 5] = top;
    }
    __syncthreads();
    lo = __reduce_min_sync(0xffffffffu, red[0][lane]);
    top = __reduce_max_sync(0xffffffffu, red[1][lane]);
}

// Gathers the keys at or above `lo` among a row's n keys, key j of thread t being key j *
// PICK_THREADS + t (id id0 plus that), into `c` in id order: the (key j, warp) ballots are
// counted, and each warp places its lanes after the keys of every smaller j and of the warps
// before it in its own j. Returns how many there are, the same in every thread, or -1 where
// more than PICK_CANDIDATES reach `lo` (nothing is written then). Two barriers; traced, marks 7
// (the ballots counted) and 8 (the places found).
template <bool TRACE>
__device__ __forceinline__ int pick_candidates(const u32 (&k)[PICK_KEYS], int n, u32 lo, int id0,
                                               Candidates& c, Trace<TRACE>& tr) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    u32 hit[PICK_KEYS];
#pragma unroll
    for (int j = 0; j < PICK_KEYS; j++) {
        hit[j] = 0;
        if (j * PICK_THREADS < n) {
            const int i = j * PICK_THREADS + threadIdx.x;
            hit[j] = __ballot_sync(0xffffffffu, i < n && k[j] >= lo);
            if (lane == 0) c.counts[j][warp] = __popc(hit[j]);
        }
    }
    __syncthreads();
    tr.mark(7, 0u);
    // Two keys' counts a reduction, 16 bits each (a count is at most PICK_THREADS).
    static_assert(PICK_KEYS % 2 == 0 && PICK_THREADS < 65536, "two counts fit a word");
    int total = 0, at[PICK_KEYS];
#pragma unroll
    for (int j = 0; j < PICK_KEYS; j += 2) {
        at[j] = at[j + 1] = total;
        if (j * PICK_THREADS >= n) continue;  // uniform: no thread holds key j
        const u32 w = (u32)c.counts[j][lane] |
                      ((j + 1) * PICK_THREADS < n ? (u32)c.counts[j + 1][lane] << 16 : 0u);
        const u32 before = __reduce_add_sync(0xffffffffu, lane < warp ? w : 0u);
        const u32 sum = __reduce_add_sync(0xffffffffu, w);
        at[j] += (int)(before & 0xffffu);
        total += (int)(sum & 0xffffu);
        at[j + 1] = total + (int)(before >> 16);
        total += (int)(sum >> 16);
    }
    tr.mark(8, (u32)total);
    if (total > PICK_CANDIDATES) return -1;
    const u32 below = (1u << lane) - 1u;
#pragma unroll
    for (int j = 0; j < PICK_KEYS; j++) {
        if ((hit[j] >> lane) & 1u) {
            const int p = at[j] + __popc(hit[j] & below);
            c.keys[p] = k[j];
            c.ids[p] = id0 + j * PICK_THREADS + (int)threadIdx.x;
        }
    }
    __syncthreads();
    return total;
}

template <bool TRACE, bool TAGS>
__device__ __forceinline__ void pick_body(
    const i32* __restrict__ slots, const i32* __restrict__ seq_lens, i32 num_slots, i32 kvh,
    i32 ps, i32 budget, i32 sink_tokens, i32 recent_tokens, i32 shared,
    u32* __restrict__ scores, i32 score_stride, i32 keys_smem, i32* __restrict__ ids,
    i32* __restrict__ lens, i32* __restrict__ covered, i32 width, i32 copies, i32 zero_keys,
    u32* __restrict__ ready, const u32* __restrict__ epoch, unsigned long long* __restrict__ tags) {
    // Traced (`pick_rows_traced`): entry, after the wait, the keys read and the first
    // histogram's range found, the threshold found and the chosen ids written, the row's
    // other entries written; the candidates gathered (5; 7 and 8 within) and the threshold
    // found (6); the end, with select_top's rounds.
    Trace<TRACE> tr(PICK_TRACE_FIRST);
    tr.mark(0, 0u);
    // Dynamic shared memory: select_top's two histograms, then (keys_smem) the row's keys.
    extern __shared__ int hist[];
    __shared__ u32 red[2][PICK_THREADS / 32];
    __shared__ Candidates cand;
    u32* sk = reinterpret_cast<u32*>(hist + 2 * SEL_BINS);
    // The row's plan comes from the batch's lengths and slots, which only the host writes: read
    // before waiting for the scoring kernel, so their loads overlap its end.
    const int row = blockIdx.x;
    const int s = shared ? row : row / kvh;
    const int len = seq_lens[s];
    const int slot = slots ? slots[s] : 0;
    const bool valid = len > 0 && (!slots || (slot >= 0 && slot < num_slots));
    const Plan plan(max(len, 1), ps, budget, sink_tokens, recent_tokens);
    u32* row_keys = scores + (size_t)row * score_stride;
    const int out_row0 = shared ? row * copies : row;
    i32* out = ids + (size_t)out_row0 * width;
    const int pick = valid ? min(plan.pick, score_stride) : 0;
    const int n = min(plan.mid(), score_stride);
    int rounds = 0;
    // What the row holds besides the chosen pages depends on the plan alone: the forced head
    // and tail pages, the -1 padding, the length and the tokens covered. Where a budget is
    // given, the launch before this one is its scoring kernel (launch_pick's callers), which
    // neither reads nor writes them, and every launch before that one has finished (pdl.cuh):
    // so they are written before the wait, under the scoring kernel's end. The attention after
    // reads them only after this launch, or after the row's flag. Without a budget (StreamingLLM)
    // the launch before may read the rows, and they are written after the wait.
    const bool early = budget > 0;
    if (!early) pdl_enter();
    int count = 0, tokens = 0;
    if (valid) {
        const int tail = plan.n - plan.tail_start;
        for (int i = threadIdx.x; i < plan.head_end; i += PICK_THREADS) out[i] = i;
        for (int i = threadIdx.x; i < tail; i += PICK_THREADS)
            out[plan.head_end + pick + i] = plan.tail_start + i;
        count = plan.head_end + pick + tail;
        tokens = (count - 1) * ps + (len - (plan.n - 1) * ps);
    }
    for (int i = count + threadIdx.x; i < width; i += PICK_THREADS) out[i] = -1;
    if (threadIdx.x == 0) {
        for (int c = 0; c < (shared ? copies : 1); c++) {
            lens[out_row0 + c] = count;
            covered[out_row0 + c] = tokens;
        }
    }
    if (early) pdl_enter();
    // Tagged rows (TAGS, `pick_rows_tagged`, with `ready`): every place of every copy also
    // stored with the step's value (pdl.cuh, store_tagged), the forced pages and the padding
    // now, the chosen ones as select_top takes them. The step's value is final now: the
    // scoring launch advanced it. A kernel of its own: the code for the tags, unused, cost
    // pick_rows 0.5-0.7 us a step (kernels/NOTES.md, session 77).
    const u32 tag_step = TAGS ? __ldcg(epoch) : 0u;
    const int tag_copies = shared ? copies : 1;
    unsigned long long* tag_row = TAGS ? tags + (size_t)out_row0 * width : nullptr;
    if (TAGS) {
        const int chosen_end = plan.head_end + pick;
        for (int i = threadIdx.x; i < width; i += PICK_THREADS) {
            if (valid && i >= plan.head_end && i < chosen_end) continue;
            const i32 id = !valid || i >= count   ? -1
                           : i < plan.head_end    ? i
                                                  : plan.tail_start + (i - chosen_end);
            for (int c = 0; c < tag_copies; c++)
                store_tagged(tag_row + (size_t)c * width + i, tag_step, id);
        }
    }
    tr.mark(1, 0u);
    if (pick > 0) {
        // A row of 3 to PICK_KEYS keys a thread is read once into registers and selected from
        // its candidates, the keys at or above the floor, gathered in shared memory; other rows,
        // and rows whose candidates do not fit, from all their keys (a shared-memory copy where
        // keys_smem). At 2 keys a thread the gathering's two barriers cost more than they save
        // (kernels/NOTES.md, session 37). Either way the first histogram is cleared under the
        // floor's barrier.
        u32 k[PICK_KEYS];
        u32 lo = 0xffffffffu, top = 0;
        const bool in_regs = n > 2 * PICK_THREADS && n <= PICK_KEYS * PICK_THREADS;
        if (in_regs) {
#pragma unroll
            for (int j = 0; j < PICK_KEYS; j++) {
                const int i = j * PICK_THREADS + threadIdx.x;
                k[j] = i < n ? __ldcg(row_keys + i) : 0u;
                if (i < n) {
                    lo = min(lo, k[j]);
                    top = max(top, k[j]);
                }
            }
        } else {
#pragma unroll 8
            for (int i = threadIdx.x; i < n; i += PICK_THREADS) {
                const u32 key = __ldcg(row_keys + i);
                if (keys_smem) sk[i] = key;
                lo = min(lo, key);
                top = max(top, key);
            }
        }
#pragma unroll
        for (int j = 0; j < SEL_BINS / PICK_THREADS; j++)
            hist[threadIdx.x * (SEL_BINS / PICK_THREADS) + j] = 0;
        row_floor(lo, top, pick, red);
        tr.mark(2, lo);
        i32* dst = out + plan.head_end;
        const TagOut tag = {TAGS ? tag_row + plan.head_end : nullptr, tag_copies, width, tag_step};
        const int found = in_regs ? pick_candidates(k, n, lo, plan.head_end, cand, tr) : -1;
        tr.mark(5, (u32)found);
        if (found >= 0) {
            rounds = select_top<PICK_THREADS, true, TRACE, TAGS>(cand.keys, found, pick, 0, dst,
                                                                 lo, top, hist, tr, cand.ids, tag);
        } else if (keys_smem && !in_regs) {
            rounds = select_top<PICK_THREADS, true, TRACE, TAGS>(sk, n, pick, plan.head_end, dst,
                                                                 lo, top, hist, tr, nullptr, tag);
        } else {
            rounds = select_top<PICK_THREADS, false, TRACE, TAGS>(
                row_keys, n, pick, plan.head_end, dst, lo, top, hist, tr, nullptr, tag);
        }
        tr.mark(3, 0u);
        // Once every thread has read the keys, zero them for the next launch where its scoring
        // merges into them by atomicMax. (Zeroing each key as it is copied measured about 3 µs
        // slower at B8: kernels/NOTES.md, session 29.)
        if (zero_keys) {
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += PICK_THREADS) row_keys[i] = 0;
        }
    }
    tr.mark(4, 0u);
    if (shared && copies > 1) {
        __syncthreads();
        for (int c = 1; c < copies; c++)
            for (int i = threadIdx.x; i < width; i += PICK_THREADS)
                out[(size_t)c * width + i] = out[i];
    }
    if (ready) {
        // Publish the row: every thread's writes fenced, then the flag.
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) store_release(ready + row, __ldcg(epoch));
    }
    tr.finish(0, (u32)rounds);
}

#define PICK_KERNEL(NAME, TRACE, TAGS)                                                           \
    extern "C" __global__ void __launch_bounds__(PICK_THREADS) NAME(                             \
        const i32* __restrict__ slots, const i32* __restrict__ seq_lens, i32 num_slots, i32 kvh, \
        i32 ps, i32 budget, i32 sink_tokens, i32 recent_tokens, i32 shared,                      \
        u32* __restrict__ scores, i32 score_stride, i32 keys_smem, i32* __restrict__ ids,        \
        i32* __restrict__ lens, i32* __restrict__ covered, i32 width, i32 copies,                \
        i32 zero_keys, u32* __restrict__ ready, const u32* __restrict__ epoch,                   \
        unsigned long long* __restrict__ tags) {                                                 \
        pick_body<TRACE, TAGS>(slots, seq_lens, num_slots, kvh, ps, budget, sink_tokens,         \
                               recent_tokens, shared, scores, score_stride, keys_smem, ids,      \
                               lens, covered, width, copies, zero_keys, ready, epoch, tags);     \
    }

PICK_KERNEL(pick_rows, false, false)
// For the bench's trace of a whole step.
PICK_KERNEL(pick_rows_traced, true, false)
// Over a published selection whose ids the page walk reads tagged (pdl.cuh).
PICK_KERNEL(pick_rows_tagged, false, true)

// ---------------------------------------------------------------------------------------------
// DSA's trained indexer (dsa.rs, `Dsa` with an `Indexer`): the score of token t of sequence s is
// I(t) = sum_j w_j relu(q_j · k(t)) over the indexer heads j, with the queries q [seqs, heads,
// dim] and weights w [seqs, heads] in f32 and the indexer keys in the representation pool
// [layers, slots, max_tokens, dim] in the keys' element type. Each dot product adds its
// products in score.rs's order (16 lanes, each rounded step by step, then the lanes in order)
// and the heads add in order, every step rounded on its own (no fused multiply-add), so the
// scores equal the CPU's bit for bit. One thread per mid token; a CTA stages its sequence's
// queries and weights and a tile of DSA_THREADS keys (rows padded by 16 bytes) in shared
// memory. Grid: (tiles of mid tokens, seqs). Keys go to scores[s, t - head_end] for pick_rows.

#define DSA_THREADS 128

struct DsaArgs {
    i32 heads, dim, layer, num_slots, max_tokens, topk, sink_tokens, recent_tokens,
        score_stride;
};

template <typename T>
__device__ void dsa_body(const float* __restrict__ q, const float* __restrict__ w,
                         const T* __restrict__ keys, const i32* __restrict__ slots,
                         const i32* __restrict__ seq_lens, const DsaArgs a,
                         u32* __restrict__ scores) {
    extern __shared__ __align__(16) unsigned char dsa_smem[];
    const int s = blockIdx.y;
    const int len = seq_lens[s];
    const int slot = slots[s];
    if (len <= 0 || slot < 0 || slot >= a.num_slots) return;
    const Plan plan(len, 1, a.topk, a.sink_tokens, a.recent_tokens);
    const int t0 = plan.head_end + (int)blockIdx.x * DSA_THREADS;
    const int t_end = min(plan.tail_start, plan.head_end + a.score_stride);
    if (plan.pick == 0 || t0 >= t_end) return;
    const int hd = a.heads * a.dim;
    float* sq = reinterpret_cast<float*>(dsa_smem);
    float* sw = sq + hd;
    // The key tile starts at the next 16-byte boundary after the queries and weights.
    const size_t tile_at = ((size_t)(hd + a.heads) * sizeof(float) + 15) / 16 * 16;
    unsigned char* tile = dsa_smem + tile_at;
    const int row_bytes = a.dim * (int)sizeof(T);
    const int pitch = row_bytes + 16;
    const int vecs = row_bytes / 16;
    for (int i = threadIdx.x; i < hd; i += DSA_THREADS) sq[i] = q[(size_t)s * hd + i];
    for (int i = threadIdx.x; i < a.heads; i += DSA_THREADS) sw[i] = w[(size_t)s * a.heads + i];
    const int rows = min(DSA_THREADS, t_end - t0);
    const unsigned char* src = reinterpret_cast<const unsigned char*>(
        keys + ((size_t)(a.layer * a.num_slots + slot) * a.max_tokens + t0) * a.dim);
    for (int i = threadIdx.x; i < rows * vecs; i += DSA_THREADS) {
        const int r = i / vecs, v = i - r * vecs;
        *reinterpret_cast<uint4*>(tile + r * pitch + v * 16) =
            __ldg(reinterpret_cast<const uint4*>(src + (size_t)r * row_bytes + v * 16));
    }
    __syncthreads();
    if ((int)threadIdx.x >= rows) return;
    typedef Vec16<T> V;
    constexpr int PER16 = 16 / V::N;  // 16-byte vectors per 16 elements
    const unsigned char* mine = tile + threadIdx.x * pitch;
    float score = 0.0f;
    for (int j = 0; j < a.heads; j++) {
        const float* qj = sq + j * a.dim;
        float acc[16];
#pragma unroll
        for (int l = 0; l < 16; l++) acc[l] = 0.0f;
        for (int c = 0; c < a.dim; c += 16) {
            float k[16];
#pragma unroll
            for (int v = 0; v < PER16; v++)
                V::widen(*reinterpret_cast<const uint4*>(mine + (c / V::N + v) * 16),
                         k + v * V::N);
#pragma unroll
            for (int l = 0; l < 16; l++) acc[l] = __fadd_rn(acc[l], __fmul_rn(qj[c + l], k[l]));
        }
        float dot = 0.0f;
#pragma unroll
        for (int l = 0; l < 16; l++) dot = __fadd_rn(dot, acc[l]);
        score = __fadd_rn(score, __fmul_rn(sw[j], fmaxf(dot, 0.0f)));
    }
    const int t = t0 + (int)threadIdx.x;
    scores[(size_t)s * a.score_stride + (t - plan.head_end)] = order_key(score);
}

#define SELECT_KERNELS(NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(SEL_THREADS) quest_minmax_##NAME(             \
        const T* __restrict__ k, i32 num_blocks, i32 bs, i32 kvh, i32 d,                        \
        const i32* __restrict__ block_table, i32 max_blocks, const i32* __restrict__ cu_q,      \
        const i32* __restrict__ seq_lens, const i32* __restrict__ slots, T* __restrict__ reps,  \
        i32 layer, i32 num_slots, i32 max_pages, i32 ps, unsigned char* __restrict__ codes,     \
        signed char* __restrict__ exps) {                                                        \
        minmax_body<T>(k, num_blocks, bs, kvh, d, block_table, max_blocks, cu_q, seq_lens,      \
                       slots, reps, layer, num_slots, max_pages, ps, codes, exps);              \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(SCORE_THREADS) quest_score_##NAME(              \
        const T* __restrict__ q, const i32* __restrict__ cu_q, const T* __restrict__ reps,      \
        const i32* __restrict__ slots, const i32* __restrict__ seq_lens, const ScoreArgs a,     \
        i32 items, i32 per_cta, u32* __restrict__ scores, u32* __restrict__ epoch) {             \
        pdl_enter();                                                                             \
        advance_epoch(epoch);                                                                    \
        score_body<T>(q, cu_q, reps, slots, seq_lens, a, items, per_cta, scores);               \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(DSA_THREADS) dsa_score_##NAME(                  \
        const float* __restrict__ q, const float* __restrict__ w, const T* __restrict__ keys,   \
        const i32* __restrict__ slots, const i32* __restrict__ seq_lens, const DsaArgs a,       \
        u32* __restrict__ scores) {                                                              \
        dsa_body<T>(q, w, keys, slots, seq_lens, a, scores);                                     \
    }

SELECT_KERNELS(f32, float)
SELECT_KERNELS(f16, __half)
SELECT_KERNELS(bf16, __nv_bfloat16)

#define SCORE_TC_KERNEL(NAME, T, D, TRACE)                                                       \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, 2) quest_score_tc_##NAME(         \
        const T* __restrict__ q, const i32* __restrict__ cu_q, const T* __restrict__ reps,      \
        const i32* __restrict__ slots, const i32* __restrict__ seq_lens, const ScoreArgs a,     \
        i32 items, i32 per_warp, u32* __restrict__ scores, u32* __restrict__ epoch) {            \
        score_tc_body<T, D, TRACE, false>(q, cu_q, reps, slots, seq_lens, a, items, per_warp,    \
                                          scores, epoch, nullptr, nullptr);                      \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, 2) quest_score_tc8_##NAME(        \
        const T* __restrict__ q, const i32* __restrict__ cu_q,                                   \
        const unsigned char* __restrict__ codes, const i32* __restrict__ slots,                 \
        const i32* __restrict__ seq_lens, const ScoreArgs a, i32 items, i32 per_warp,           \
        u32* __restrict__ scores, u32* __restrict__ epoch, const signed char* __restrict__ exps) { \
        score_tc_body<T, D, TRACE, true>(q, cu_q, nullptr, slots, seq_lens, a, items, per_warp,  \
                                         scores, epoch, codes, exps);                            \
    }

SCORE_TC_KERNEL(f16_d64, __half, 64, false)
SCORE_TC_KERNEL(f16_d128, __half, 128, false)
SCORE_TC_KERNEL(bf16_d64, __nv_bfloat16, 64, false)
SCORE_TC_KERNEL(bf16_d128, __nv_bfloat16, 128, false)
// For the bench's trace of a whole step.
SCORE_TC_KERNEL(bf16_d128_traced, __nv_bfloat16, 128, true)
