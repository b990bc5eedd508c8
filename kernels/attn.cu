// Attention kernels of attn-op's CUDA backend. The CPU implementation in crates/attn-op is the
// specification; every kernel here is checked against it by `attn-op`'s `gpu` example.
//
// Layouts (the shared data contract):
//   KV pool, per layer, K and V each: [num_blocks, block_size, kv_heads, D], slot = block * bs + off.
//   q: [total_q, q_heads, D]; out: [total_q, q_heads, D] f32; lse: [total_q, q_heads] f32 (natural log).
//   cu_q: [num_seqs + 1]; kv_lens: [num_seqs]; block_table: [num_seqs * max_blocks], -1 padded.
//   selections: ids [num_seqs * kv_heads * sel_max], -1 padded, lens [num_seqs * kv_heads].
//
// Every index read from device memory is checked before it addresses the KV pool: an id outside
// its range is skipped, never dereferenced.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef int i32;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF (-__int_as_float(0x7f800000))
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// ---------------------------------------------------------------------------------------------
// Element loads: 8 consecutive elements into f32 registers (one or two 16-byte loads).

struct Raw8 {
    uint4 a;
    uint4 b;  // used by f32 only
};

__device__ __forceinline__ void load_raw(const float* p, Raw8& r) {
    r.a = __ldg(reinterpret_cast<const uint4*>(p));
    r.b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
}
__device__ __forceinline__ void load_raw(const __half* p, Raw8& r) {
    r.a = __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ void load_raw(const __nv_bfloat16* p, Raw8& r) {
    r.a = __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ void unpack(const float*, const Raw8& r, float* f) {
    f[0] = __uint_as_float(r.a.x); f[1] = __uint_as_float(r.a.y);
    f[2] = __uint_as_float(r.a.z); f[3] = __uint_as_float(r.a.w);
    f[4] = __uint_as_float(r.b.x); f[5] = __uint_as_float(r.b.y);
    f[6] = __uint_as_float(r.b.z); f[7] = __uint_as_float(r.b.w);
}
// The two 16-bit types unpack alike: four pairs, each widened by the type's own conversion.
__device__ __forceinline__ float2 widen2(const __half*, u32 w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 widen2(const __nv_bfloat16*, u32 w) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
template <typename H>
__device__ __forceinline__ void unpack(const H* tag, const Raw8& r, float* f) {
    const u32 w[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 v = widen2(tag, w[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}

// ---------------------------------------------------------------------------------------------
// Attention core.
//
// One CTA of WARPS warps handles ROWS query rows of one (sequence, KV head) over one split of
// that row's key list. Rows are the flattened (query, head in group) pairs of the KV head, so the
// query heads of a group read each key once. A "stream" is the LANES = D / 8 lanes that hold one
// key; each stream walks every NSTREAMS-th key of the split with its own online-softmax state,
// and the streams are merged through shared memory at the end. Scores are kept in base 2.
//
// mode 0: dense, key t is position t.
// mode 1: page list, key t is position sel[t / bs] * bs + t % bs.
// mode 2: token list, key t is position sel[t].

// Where the keys of one (sequence, KV head) live, and the fetch of one step's keys: stream key
// t, t + NSTREAMS, ... (U of them) as raw 16-byte vectors, with their positions (-1: none).
template <typename T, int D>
struct Keys {
    const T* __restrict__ kc;
    const T* __restrict__ vc;
    const i32* __restrict__ sel;
    const i32* __restrict__ table;
    int mode, bs, num_pages, kv_len, num_blocks, kv_heads, h, e0, t1;

    template <int U, int NSTREAMS>
    __device__ __forceinline__ void fetch(int t_first, Raw8* kr, Raw8* vr, int* pos) const {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int t = t_first + u * NSTREAMS;
            int p = -1;
            if (t < t1) {
                if (mode == 0) {
                    p = t;
                } else if (mode == 1) {
                    const int page = sel[t / bs];
                    p = (page >= 0 && page < num_pages) ? page * bs + t % bs : -1;
                } else {
                    p = sel[t];
                }
                if (p >= kv_len) p = -1;
            }
            const int blk = p >= 0 ? table[p / bs] : -1;
            if (blk < 0 || blk >= num_blocks) p = -1;
            pos[u] = p;
            if (p >= 0) {
                const size_t off = (((size_t)blk * bs + p % bs) * kv_heads + h) * D + e0;
                load_raw(kc + off, kr[u]);
                load_raw(vc + off, vr[u]);
            } else {
                kr[u].a = kr[u].b = vr[u].a = vr[u].b = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    }
};

template <typename T, int D, int ROWS, int U, bool PIPE>
__device__ __forceinline__ void attn_core(
    const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
    const i32* __restrict__ cu_q, const i32* __restrict__ kv_lens,
    const i32* __restrict__ block_table, i32 max_blocks, i32 num_blocks,
    i32 mode, const i32* __restrict__ sel_ids, const i32* __restrict__ sel_lens, i32 sel_max,
    i32 kv_heads, i32 group, i32 bs, float scale, i32 window, i32 sinks,
    const float* __restrict__ sink_logits, i32 has_sinks, i32 chunk, i32 split_out,
    float* __restrict__ out, float* __restrict__ lse, i32 total_rows) {
    constexpr int WARPS = 4;
    constexpr int LANES = D / 8;
    constexpr int TPW = 32 / LANES;
    constexpr int NSTREAMS = WARPS * TPW;
    const int q_heads = kv_heads * group;

    // Grid: x = (split, KV head) with heads fastest, so the CTAs reading the heads of one token
    // range run together and read neighbouring memory; y = row tile; z = sequence.
    const int seq = blockIdx.z;
    const int h = blockIdx.x % kv_heads;
    const int sh = seq * kv_heads + h;
    const int split = blockIdx.x / kv_heads;
    const int row0 = blockIdx.y * ROWS;

    const int q_start = cu_q[seq];
    const int q_len = cu_q[seq + 1] - q_start;
    const int kv_len = kv_lens[seq];
    if (row0 >= q_len * group) return;

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int sub = lane / LANES;
    const int e0 = (lane % LANES) * 8;
    const int stream = warp * TPW + sub;

    // Rows: query position, output row, and q pre-scaled into base 2.
    float qv[ROWS][8];
    int rpos[ROWS];
    int orow[ROWS];
    int max_pos = -1;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int rr = row0 + r;
        const int qi = rr / group;
        const int g = rr % group;
        if (qi < q_len) {
            rpos[r] = kv_len - q_len + qi;
            orow[r] = (q_start + qi) * q_heads + h * group + g;
            max_pos = max(max_pos, rpos[r]);
            Raw8 raw;
            load_raw(q + (size_t)orow[r] * D + e0, raw);
            unpack(q, raw, qv[r]);
#pragma unroll
            for (int e = 0; e < 8; e++) qv[r][e] *= scale * LOG2E;
        } else {
            rpos[r] = -1;
            orow[r] = -1;
#pragma unroll
            for (int e = 0; e < 8; e++) qv[r][e] = 0.f;
        }
    }

    // This split's keys.
    int n_keys;
    const i32* sel = nullptr;
    if (mode == 0) {
        n_keys = min(kv_len, max_pos + 1);
    } else {
        const int cnt = min(max(sel_lens[sh], 0), sel_max);
        sel = sel_ids + (size_t)sh * sel_max;
        n_keys = mode == 1 ? cnt * bs : cnt;
    }
    const int t0 = split * chunk;
    const int t1 = min(n_keys, t0 + chunk);
    const int num_pages = (kv_len + bs - 1) / bs;
    const i32* table = block_table + (size_t)seq * max_blocks;

    float m[ROWS], l[ROWS], acc[ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        m[r] = NEG_INF;
        l[r] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[r][e] = 0.f;
    }

    // Software pipeline: the keys of the next step (their indices, then K and V) are loaded
    // while this step's keys are scored and accumulated.
    const Keys<T, D> keys{kc, vc, sel, table, mode, bs, num_pages, kv_len, num_blocks, kv_heads,
                          h, e0, t1};
    Raw8 kr[U], vr[U];
    int pos[U];
    keys.template fetch<U, NSTREAMS>(t0 + stream, kr, vr, pos);
#pragma unroll 1
    for (int base = t0; base < t1; base += NSTREAMS * U) {
        Raw8 kn[U], vn[U];
        int pn[U];
        if (PIPE) keys.template fetch<U, NSTREAMS>(base + NSTREAMS * U + stream, kn, vn, pn);
        float s[U][ROWS];
#pragma unroll
        for (int u = 0; u < U; u++) {
            float kf[8];
            unpack(kc, kr[u], kf);
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < 8; e++) d = fmaf(qv[r][e], kf[e], d);
#pragma unroll
                for (int o = LANES / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                const int p = pos[u];
                const int rp = rpos[r];
                bool vis = p >= 0 && p <= rp;
                if (window > 0) vis = vis && (p > rp - window || p < sinks);
                s[u][r] = vis ? d : NEG_INF;
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float mt = m[r];
#pragma unroll
            for (int u = 0; u < U; u++) mt = fmaxf(mt, s[u][r]);
            if (mt == NEG_INF) continue;
            // Rescale only when the running max grows, which after the first keys is rare.
            if (mt > m[r]) {
                const float alpha = exp2f(m[r] - mt);
                m[r] = mt;
                l[r] *= alpha;
#pragma unroll
                for (int e = 0; e < 8; e++) acc[r][e] *= alpha;
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                // A masked key weighs exp2(-inf) = 0 and its V was zeroed by the fetch.
                const float pr = exp2f(s[u][r] - mt);
                float vf[8];
                unpack(vc, vr[u], vf);
                l[r] += pr;
#pragma unroll
                for (int e = 0; e < 8; e++) acc[r][e] = fmaf(pr, vf[e], acc[r][e]);
            }
        }
        if (!PIPE) keys.template fetch<U, NSTREAMS>(base + NSTREAMS * U + stream, kn, vn, pn);
#pragma unroll
        for (int u = 0; u < U; u++) {
            kr[u] = kn[u];
            vr[u] = vn[u];
            pos[u] = pn[u];
        }
    }

    // Merge the streams: shared [NSTREAMS][ROWS][D] accumulators and [NSTREAMS][ROWS] m, l.
    extern __shared__ float smem[];
    float* s_acc = smem;
    float* s_m = s_acc + NSTREAMS * ROWS * D;
    float* s_l = s_m + NSTREAMS * ROWS;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int e = 0; e < 8; e++) s_acc[(stream * ROWS + r) * D + e0 + e] = acc[r][e];
        if (e0 == 0) {
            s_m[stream * ROWS + r] = m[r];
            s_l[stream * ROWS + r] = l[r];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < ROWS * D; i += blockDim.x) {
        const int r = i / D;
        const int d = i % D;
        int rr = row0 + r;
        int qi = rr / group;
        if (qi >= q_len) continue;
        const int g = rr % group;
        const int orw = (q_start + qi) * q_heads + h * group + g;
        float M = NEG_INF;
        for (int st = 0; st < NSTREAMS; st++) M = fmaxf(M, s_m[st * ROWS + r]);
        float L = 0.f, A = 0.f;
        if (M != NEG_INF) {
            for (int st = 0; st < NSTREAMS; st++) {
                const float w = exp2f(s_m[st * ROWS + r] - M);
                L += w * s_l[st * ROWS + r];
                A += w * s_acc[(st * ROWS + r) * D + d];
            }
        }
        if (split_out) {
            // A normalized partial over this split, merged later by attn_merge.
            const size_t pr = (size_t)split * total_rows + orw;
            out[pr * D + d] = L > 0.f ? A / L : 0.f;
            if (d == 0) lse[pr] = L > 0.f ? (M + log2f(L)) * LN2 : NEG_INF;
        } else {
            float scale_acc = 1.f;
            float Mn = M * LN2;  // natural log from here
            if (has_sinks) {
                const float sk = sink_logits[h * group + g];
                const float m2 = fmaxf(Mn, sk);
                scale_acc = Mn == NEG_INF ? 0.f : __expf(Mn - m2);
                L = L * scale_acc + __expf(sk - m2);
                Mn = m2;
            }
            out[(size_t)orw * D + d] = L > 0.f ? A * scale_acc / L : 0.f;
            if (d == 0 && lse != nullptr) lse[orw] = L > 0.f ? Mn + logf(L) : NEG_INF;
        }
    }
}

#define ATTN_KERNEL(NAME, T, D, ROWS, U, PIPE, MINB)                                            \
    extern "C" __global__ void __launch_bounds__(128, MINB) NAME(                                    \
        const T* q, const T* kc, const T* vc, const i32* cu_q, const i32* kv_lens,             \
        const i32* block_table, i32 max_blocks, i32 num_blocks, i32 mode, const i32* sel_ids,  \
        const i32* sel_lens, i32 sel_max, i32 kv_heads, i32 group, i32 bs, float scale,        \
        i32 window, i32 sinks, const float* sink_logits, i32 has_sinks, i32 chunk,             \
        i32 split_out, float* out, float* lse, i32 has_lse, i32 total_rows) {                  \
        attn_core<T, D, ROWS, U, PIPE>(q, kc, vc, cu_q, kv_lens, block_table, max_blocks,            \
                                 num_blocks, mode, sel_ids, sel_lens, sel_max, kv_heads,       \
                                 group, bs, scale, window, sinks, sink_logits, has_sinks,      \
                                 chunk, split_out, out, has_lse ? lse : nullptr, total_rows);  \
    }

// Variants: rows per CTA 4 (decode with groups up to 4) or 8; U keys per stream and step;
// pipelined or not; the minimum resident CTAs the register budget must allow.
#define ATTN_FOR_TYPE(TN, T)                                       \
    ATTN_KERNEL(attn_##TN##_d64_r4, T, 64, 4, 2, true, 4)         \
    ATTN_KERNEL(attn_##TN##_d64_r8, T, 64, 8, 2, false, 2)        \
    ATTN_KERNEL(attn_##TN##_d128_r4, T, 128, 4, 2, true, 4)       \
    ATTN_KERNEL(attn_##TN##_d128_r8, T, 128, 8, 2, false, 2)      \
    ATTN_KERNEL(attn_##TN##_d256_r4, T, 256, 4, 2, false, 2)      \
    ATTN_KERNEL(attn_##TN##_d256_r8, T, 256, 8, 1, false, 2)

ATTN_FOR_TYPE(f32, float)
ATTN_FOR_TYPE(f16, __half)
ATTN_FOR_TYPE(bf16, __nv_bfloat16)

// Variants of the bf16 decode kernel of record, for the bench's sweep (Gpu::set_variant).
ATTN_KERNEL(attn_bf16_d128_r4_u4, __nv_bfloat16, 128, 4, 4, false, 4)
ATTN_KERNEL(attn_bf16_d128_r4_u4p, __nv_bfloat16, 128, 4, 4, true, 3)
ATTN_KERNEL(attn_bf16_d128_r4_u1p, __nv_bfloat16, 128, 4, 1, true, 4)

// ---------------------------------------------------------------------------------------------
// Merge of stacked partial results: parts_out [n_parts, rows, D], parts_lse [n_parts, rows];
// one CTA per row, one thread per element. With sink logits (per q head, row % q_heads) the sink
// joins the denominator with a zero value, as in the CPU implementation.

extern "C" __global__ void attn_merge(const float* __restrict__ parts_out,
                                      const float* __restrict__ parts_lse, i32 n_parts, i32 rows,
                                      i32 D, const float* __restrict__ sink_logits,
                                      i32 has_sinks, i32 q_heads, float* __restrict__ out,
                                      float* __restrict__ lse, i32 has_lse) {
    const int r = blockIdx.x;
    float M = NEG_INF;
    for (int p = 0; p < n_parts; p++) M = fmaxf(M, parts_lse[(size_t)p * rows + r]);
    float sk = NEG_INF;
    if (has_sinks) sk = sink_logits[r % q_heads];
    const float m2 = fmaxf(M, sk);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float L = 0.f, A = 0.f;
        if (m2 != NEG_INF) {
            for (int p = 0; p < n_parts; p++) {
                const float lp = parts_lse[(size_t)p * rows + r];
                if (lp == NEG_INF) continue;
                const float w = __expf(lp - m2);
                L += w;
                A += w * parts_out[((size_t)p * rows + r) * D + d];
            }
            if (has_sinks) L += __expf(sk - m2);
        }
        out[(size_t)r * D + d] = L > 0.f ? A / L : 0.f;
        if (d == 0 && has_lse) lse[r] = L > 0.f ? m2 + logf(L) : NEG_INF;
    }
}

// ---------------------------------------------------------------------------------------------
// KV append through the flat slot view: token i of k, v ([n, kv_heads, D]) goes to slot
// slot_mapping[i]; -1 skips it and so does any slot outside the pool. One thread per 16 bytes.

extern "C" __global__ void set_kv(const i32* __restrict__ slots, i32 n, const uint4* __restrict__ k,
                                  const uint4* __restrict__ v, uint4* __restrict__ kc,
                                  uint4* __restrict__ vc, i32 vecs_per_token, i32 num_slots) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * vecs_per_token) return;
    const int tok = i / vecs_per_token;
    const int w = i % vecs_per_token;
    const int s = slots[tok];
    if (s < 0 || s >= num_slots) return;
    const size_t dst = (size_t)s * vecs_per_token + w;
    kc[dst] = k[i];
    vc[dst] = v[i];
}

// ---------------------------------------------------------------------------------------------
// gather_page_offsets: per (sequence, KV head) row, selected blocks of sel_bs tokens (unordered,
// duplicates allowed) become sorted unique logical pages of bs tokens, with the tokens they
// cover. One CTA of 256 threads per row; a bitmap of the sequence's pages in shared memory.
// Ids outside the sequence are counted in *invalid and skipped.

extern "C" __global__ void __launch_bounds__(256) gather_pages(
    const i32* __restrict__ ids, const i32* __restrict__ lens, i32 max_len,
    const i32* __restrict__ kv_lens, i32 kv_heads, i32 sel_bs, i32 bs, i32* __restrict__ pages,
    i32* __restrict__ counts, i32* __restrict__ out_kv_lens, i32 max_pages,
    i32* __restrict__ invalid) {
    extern __shared__ u32 bits[];
    __shared__ int scan[256];
    const int row = blockIdx.x;
    const int seq = row / kv_heads;
    const int kv_len = kv_lens[seq];
    const int num_pages = (kv_len + bs - 1) / bs;
    const int n_sel = (kv_len + sel_bs - 1) / sel_bs;
    const int words = (num_pages + 31) / 32;
    for (int w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0u;
    __syncthreads();
    const int len = min(max(lens[row], 0), max_len);
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        const int id = ids[(size_t)row * max_len + i];
        if (id < 0 || id >= n_sel) {
            atomicAdd(invalid, 1);
            continue;
        }
        int p0, p1;
        if (sel_bs >= bs) {
            p0 = (int)((long long)id * sel_bs / bs);
            p1 = min(p0 + sel_bs / bs, num_pages);
        } else {
            p0 = (int)((long long)id * sel_bs / bs);
            p1 = p0 + 1;
        }
        for (int p = p0; p < p1; p++) atomicOr(&bits[p / 32], 1u << (p % 32));
    }
    __syncthreads();
    // Each thread owns a contiguous run of words; an exclusive scan of their popcounts gives
    // where each thread writes, so the output comes out ascending.
    const int per = (words + blockDim.x - 1) / blockDim.x;
    const int w0 = threadIdx.x * per;
    const int w1 = min(words, w0 + per);
    int c = 0;
    for (int w = w0; w < w1; w++) c += __popc(bits[w]);
    scan[threadIdx.x] = c;
    __syncthreads();
    for (int o = 1; o < 256; o <<= 1) {
        const int x = threadIdx.x >= o ? scan[threadIdx.x - o] : 0;
        __syncthreads();
        scan[threadIdx.x] += x;
        __syncthreads();
    }
    int at = scan[threadIdx.x] - c;
    i32* dst = pages + (size_t)row * max_pages;
    for (int w = w0; w < w1; w++) {
        u32 b = bits[w];
        while (b) {
            const int bit = __ffs(b) - 1;
            b &= b - 1;
            dst[at++] = w * 32 + bit;
        }
    }
    const int total = scan[blockDim.x - 1];
    for (int i = total + threadIdx.x; i < max_pages; i += blockDim.x) dst[i] = -1;
    if (threadIdx.x == 0) {
        counts[row] = total;
        int tokens = total * bs;
        const int last = num_pages - 1;
        if (last >= 0 && (bits[last / 32] >> (last % 32)) & 1u) tokens -= num_pages * bs - kv_len;
        out_kv_lens[row] = tokens;
    }
}

// ---------------------------------------------------------------------------------------------
// KV compaction: per (sequence, KV head) row, keep[j] (strictly ascending) moves to position j.
// Since keep[j] >= j, a chunk's sources lie at or after the chunk itself: reading a whole chunk
// into shared memory before writing it never reads a token already overwritten.

template <typename T>
__device__ void compact_core(T* __restrict__ kc, T* __restrict__ vc, const i32* __restrict__ keep,
                             const i32* __restrict__ keep_lens, i32 max_len,
                             const i32* __restrict__ block_table, i32 max_blocks,
                             i32 kv_heads, i32 D, i32 bs, char* smem_raw) {
    constexpr int CHUNK = 16;
    const int row = blockIdx.x;
    const int seq = row / kv_heads;
    const int h = row % kv_heads;
    const int n = keep_lens[row];
    const i32* src = keep + (size_t)row * max_len;
    const i32* table = block_table + (size_t)seq * max_blocks;
    T* sk = reinterpret_cast<T*>(smem_raw);
    T* sv = sk + CHUNK * D;
    for (int c0 = 0; c0 < n; c0 += CHUNK) {
        const int cn = min(CHUNK, n - c0);
        for (int i = threadIdx.x; i < cn * D; i += blockDim.x) {
            const int p = src[c0 + i / D];
            const size_t off = (((size_t)table[p / bs] * bs + p % bs) * kv_heads + h) * D + i % D;
            sk[i] = kc[off];
            sv[i] = vc[off];
        }
        __syncthreads();
        for (int i = threadIdx.x; i < cn * D; i += blockDim.x) {
            const int p = c0 + i / D;
            const size_t off = (((size_t)table[p / bs] * bs + p % bs) * kv_heads + h) * D + i % D;
            kc[off] = sk[i];
            vc[off] = sv[i];
        }
        __syncthreads();
    }
}

#define COMPACT_KERNEL(TN, T)                                                                  \
    extern "C" __global__ void compact_##TN(T* kc, T* vc, const i32* keep, const i32* keep_lens, \
                                            i32 max_len, const i32* block_table, i32 max_blocks, \
                                            i32 kv_heads, i32 D, i32 bs) {                     \
        extern __shared__ char smem_c[];                                                       \
        compact_core<T>(kc, vc, keep, keep_lens, max_len, block_table, max_blocks, kv_heads,   \
                        D, bs, smem_c);                                                        \
    }

COMPACT_KERNEL(f32, float)
COMPACT_KERNEL(f16, __half)
COMPACT_KERNEL(bf16, __nv_bfloat16)
