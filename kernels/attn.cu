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

// 2^x by the multi-function unit alone, subnormal results flushed to zero. exp2f and __expf
// without fast math add a range fix around the same instruction (about four more, on a
// dependent chain) so that results below 2^-126 keep their bits; every exponent here is a
// softmax weight against its row's maximum, where such weights are far below f32's
// resolution of the sums they join (kernels/NOTES.md, session 39).
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// e^x the same way, for the natural-log LSEs of the merges and the sink logits.
__device__ __forceinline__ float exp_ftz(float x) { return exp2_ftz(x * LOG2E); }

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
    // sel_cap: the keys the list's row can name (sel_max pages or tokens).
    int mode, bs, num_pages, kv_len, num_blocks, kv_heads, h, e0, t0, t1, sel_cap;

    // The pool slot of key t of the list and its position p; both -1 where the key is past the
    // split, outside the sequence, or on a page the block table does not map. The list entry
    // is read whether or not t is before the split's end (t1 comes from sel_lens): the read
    // stays within the list's row, and so it need not wait for sel_lens.
    __device__ __forceinline__ int slot_of(int t, int& p) const {
        int s = t;
        if (mode != 0) s = t < sel_cap ? sel[mode == 1 ? t / bs : t] : -1;
        p = -1;
        if (t < t1) {
            if (mode == 1) {
                p = (s >= 0 && s < num_pages) ? s * bs + t % bs : -1;
            } else {
                p = s;
            }
            if (p >= kv_len) p = -1;
        }
        const int blk = p >= 0 ? table[p / bs] : -1;
        if (blk < 0 || blk >= num_blocks) p = -1;
        return p >= 0 ? blk * bs + p % bs : -1;
    }

    template <int U, int NSTREAMS>
    __device__ __forceinline__ void fetch(int t_first, Raw8* kr, Raw8* vr, int* pos) const {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int p;
            const int slot = slot_of(t_first + u * NSTREAMS, p);
            pos[u] = p;
            if (p >= 0) {
                const size_t off = ((size_t)slot * kv_heads + h) * D + e0;
                load_raw(kc + off, kr[u]);
                load_raw(vc + off, vr[u]);
            } else {
                kr[u].a = kr[u].b = vr[u].a = vr[u].b = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    }
};

// One attention CTA's place in the grid: x = (split, KV head) with heads fastest, so the CTAs
// reading the heads of one token range run together and read neighbouring memory; y = row tile
// of `rows` rows; z = sequence. Shared by both attention cores.
struct Unit {
    int seq, h, sh, split, row0, q_start, q_len, kv_len;

    __device__ __forceinline__ Unit(int rows, const i32* cu_q, const i32* kv_lens, int kv_heads)
        : seq(blockIdx.z),
          h(blockIdx.x % kv_heads),
          sh(seq * kv_heads + h),
          split(blockIdx.x / kv_heads),
          row0(blockIdx.y * rows),
          q_start(cu_q[seq]),
          q_len(cu_q[seq + 1] - q_start),
          kv_len(kv_lens[seq]) {}

    // Whether the tile is past its sequence's rows (the CTA then has nothing to do).
    __device__ __forceinline__ bool empty(int group) const { return row0 >= q_len * group; }

    // The output row (query, head) of tile row r, -1 for padding past the sequence's rows.
    __device__ __forceinline__ int out_row(int r, int group, int q_heads) const {
        const int rr = row0 + r;
        return rr / group < q_len ? (q_start + rr / group) * q_heads + h * group + rr % group
                                  : -1;
    }

    // The unit's index among the launch's units, for the split counters.
    __device__ __forceinline__ int index() const { return sh * gridDim.y + blockIdx.y; }

    // The position of tile row r (-1: padding past the sequence's rows).
    __device__ __forceinline__ int pos(int r, int group) const {
        const int qi = (row0 + r) / group;
        return qi < q_len ? kv_len - q_len + qi : -1;
    }

    // This split's keys (Keys::t0 .. t1) in the launch's mode. Dense mode stops at the last
    // key the tile's last row sees.
    template <typename T, int D>
    __device__ __forceinline__ Keys<T, D> keys(int rows, int group, const T* kc, const T* vc,
                                               const i32* block_table, int max_blocks,
                                               int num_blocks, int mode, const i32* sel_ids,
                                               const i32* sel_lens, int sel_max, int kv_heads,
                                               int bs, int chunk, int e0,
                                               bool coherent = false) const {
        int n_keys;
        const i32* sel = nullptr;
        const int sel_cap = mode == 1 ? sel_max * bs : sel_max;
        if (mode == 0) {
            n_keys = min(kv_len, kv_len - q_len + min(q_len - 1, (row0 + rows - 1) / group) + 1);
        } else {
            // Past L1 where the list is written while this kernel runs (`coherent`).
            const int len = coherent ? __ldcg(sel_lens + sh) : sel_lens[sh];
            const int cnt = min(max(len, 0), sel_max);
            sel = sel_ids + (size_t)sh * sel_max;
            n_keys = mode == 1 ? cnt * bs : cnt;
        }
        const int t0 = split * chunk;
        return Keys<T, D>{kc, vc, sel, block_table + (size_t)seq * max_blocks, mode, bs,
                          (kv_len + bs - 1) / bs, kv_len, num_blocks, kv_heads, h, e0, t0,
                          min(n_keys, t0 + chunk), sel_cap};
    }
};

// Whether key position p is visible from row position rp (causal, then the sliding window with
// its sink tokens); p = -1 (no key) and rp = -1 (padding row) see nothing.
__device__ __forceinline__ bool visible(int p, int rp, int window, int sinks) {
    bool vis = p >= 0 && p <= rp;
    if (window > 0) vis = vis && (p > rp - window || p < sinks);
    return vis;
}

// Where an attention launch writes. With one split per unit (a row tile of one sequence and
// KV head), each CTA writes its final rows into out and lse (lse may be null). With several,
// each CTA writes a normalized partial of its split into part_out [splits][total_rows][D] and
// part_lse [splits][total_rows]; the last CTA of a unit to finish (counted in counters[unit],
// zero between launches) merges the unit's partials into out and lse and resets the count.
struct Outs {
    float* __restrict__ out;
    float* __restrict__ lse;
    float* __restrict__ part_out;
    float* __restrict__ part_lse;
    i32* __restrict__ counters;
    int splits;
    int total_rows;
};

// Element d of row r merged over n_parts normalized partials (natural-log lse), with an optional
// sink logit joining the denominator with a zero value: writes out[r, d], and lse[r] for d == 0.
__device__ __forceinline__ void merge_elem(const float* parts_out, const float* parts_lse,
                                           int n_parts, int rows, int r, int d, int D,
                                           float sink, bool has_sink, float* out, float* lse) {
    float M = NEG_INF;
    for (int p = 0; p < n_parts; p++) M = fmaxf(M, __ldcg(parts_lse + (size_t)p * rows + r));
    const float m2 = fmaxf(M, has_sink ? sink : NEG_INF);
    float L = 0.f, A = 0.f;
    if (m2 != NEG_INF) {
        for (int p = 0; p < n_parts; p++) {
            const float lp = __ldcg(parts_lse + (size_t)p * rows + r);
            if (lp == NEG_INF) continue;
            const float w = exp_ftz(lp - m2);
            L += w;
            A += w * __ldcg(parts_out + ((size_t)p * rows + r) * D + d);
        }
        if (has_sink) L += exp_ftz(sink - m2);
    }
    out[(size_t)r * D + d] = L > 0.f ? A / L : 0.f;
    if (d == 0 && lse != nullptr) lse[r] = L > 0.f ? m2 + logf(L) : NEG_INF;
}

// Splits whose partials a merge loads at once: MERGE_BATCH where that covers them all, else
// MERGE_WIDE at a time where the registers allow (merge_unit's WIDE), so that 17 splits
// (sparse B1 L128K) merge in one batch of loads instead of two (kernels/NOTES.md, session 37).
#define MERGE_BATCH 16
#define MERGE_WIDE 24

// Four consecutive dims of one row merged over the n normalized partials that load(p, lse,
// v) reads (natural-log lse, -inf for an empty partial), in batches of BATCH loads in flight,
// with an online rescale between batches; an optional sink logit joins the denominator with a
// zero value. Writes the merged dims to out4 and the row's lse to *lse (when lse is not null).
template <int BATCH, typename Load>
__device__ __forceinline__ void merge_dims(int n, Load load, float sink, bool has_sink,
                                           float4* out4, float* lse) {
    float M = NEG_INF, L = 0.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int p0 = 0; p0 < n; p0 += BATCH) {
        float lp[BATCH];
        float4 v[BATCH];
#pragma unroll
        for (int j = 0; j < BATCH; j++) {
            lp[j] = NEG_INF;
            v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (p0 + j < n) load(p0 + j, lp[j], v[j]);
        }
        float mb = M;
#pragma unroll
        for (int j = 0; j < BATCH; j++) mb = fmaxf(mb, lp[j]);
        if (mb == NEG_INF) continue;
        const float c = M == NEG_INF ? 0.f : exp_ftz(M - mb);
        M = mb;
        L *= c;
        a = make_float4(a.x * c, a.y * c, a.z * c, a.w * c);
#pragma unroll
        for (int j = 0; j < BATCH; j++) {
            const float w = exp_ftz(lp[j] - M);  // 0 for an empty partial: M is finite
            L += w;
            a.x += w * v[j].x;
            a.y += w * v[j].y;
            a.z += w * v[j].z;
            a.w += w * v[j].w;
        }
    }
    if (has_sink) {
        const float m2 = fmaxf(M, sink);
        const float c = M == NEG_INF ? 0.f : exp_ftz(M - m2);
        L = L * c + exp_ftz(sink - m2);
        a = make_float4(a.x * c, a.y * c, a.z * c, a.w * c);
        M = m2;
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    *out4 = make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
    if (lse != nullptr) *lse = L > 0.f ? M + logf(L) : NEG_INF;
}

// The merge of a unit's split partials by its last CTA: each thread merges 4 consecutive dims
// of a row, reading every split's partial from global memory (merge_dims), WIDE splits at a
// time where MERGE_BATCH does not cover them all.
template <int D, int ROWS, int WIDE = MERGE_BATCH>
__device__ __forceinline__ void merge_unit(const Unit& u, int group, int q_heads,
                                           const float* __restrict__ sink_logits,
                                           int has_sinks, const Outs& o) {
    constexpr int Q4 = D / 4;
    for (int i = threadIdx.x; i < ROWS * Q4; i += blockDim.x) {
        const int r = i / Q4;
        const int d4 = i % Q4;
        const int orw = u.out_row(r, group, q_heads);
        if (orw < 0) continue;
        const auto load = [&](int p, float& lp, float4& v) {
            const size_t pr = (size_t)p * o.total_rows + orw;
            lp = __ldcg(o.part_lse + pr);
            v = __ldcg(reinterpret_cast<const float4*>(o.part_out + pr * D) + d4);
        };
        const float sink = has_sinks ? sink_logits[orw % q_heads] : NEG_INF;
        float4* out4 = reinterpret_cast<float4*>(o.out + (size_t)orw * D) + d4;
        float* lse = d4 == 0 && o.lse != nullptr ? o.lse + orw : nullptr;
        if (WIDE == MERGE_BATCH || o.splits <= MERGE_BATCH) {
            merge_dims<MERGE_BATCH>(o.splits, load, sink, has_sinks, out4, lse);
        } else {
            merge_dims<WIDE>(o.splits, load, sink, has_sinks, out4, lse);
        }
    }
}

// The end of an attention CTA: the per-stream states in shared memory (accumulators
// [NSTREAMS][ROWS][D], then maxima and sums [NSTREAMS][ROWS], base 2) are merged per row and
// written out (see Outs). Each thread combines 4 consecutive dims of a row, finding the row's
// stream weights itself (the threads of a row find the same). Returns whether this CTA is its
// unit's last split and must merge the unit's partials (merge_unit); the answer is the same
// for every thread of the CTA.
template <int D, int ROWS, int NSTREAMS, bool TRACE>
__device__ __forceinline__ bool finish_rows(const float* __restrict__ smem, const Unit& u,
                                            int group, int q_heads,
                                            const float* __restrict__ sink_logits,
                                            int has_sinks, const Outs& o, Trace<TRACE>& tr) {
    constexpr int Q4 = D / 4;
    const float* s_acc = smem;
    const float* s_m = s_acc + NSTREAMS * ROWS * D;
    const float* s_l = s_m + NSTREAMS * ROWS;
    for (int i = threadIdx.x; i < ROWS * Q4; i += blockDim.x) {
        const int r = i / Q4;
        const int d4 = i % Q4;
        const int orw = u.out_row(r, group, q_heads);
        if (orw < 0) continue;
        float M = NEG_INF;
#pragma unroll
        for (int st = 0; st < NSTREAMS; st++) M = fmaxf(M, s_m[st * ROWS + r]);
        float L = 0.f;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int st = 0; st < NSTREAMS; st++) {
            const float w = M == NEG_INF ? 0.f : exp2_ftz(s_m[st * ROWS + r] - M);
            L += w * s_l[st * ROWS + r];
            const float4 x = reinterpret_cast<const float4*>(s_acc + (st * ROWS + r) * D)[d4];
            a.x += w * x.x;
            a.y += w * x.y;
            a.z += w * x.z;
            a.w += w * x.w;
        }
        float f;
        float* dst;
        if (o.splits > 1) {
            const size_t pr = (size_t)u.split * o.total_rows + orw;
            f = L > 0.f ? 1.f / L : 0.f;
            dst = o.part_out + pr * D;
            if (d4 == 0) o.part_lse[pr] = L > 0.f ? (M + log2f(L)) * LN2 : NEG_INF;
        } else {
            float scale_acc = 1.f;
            float Mn = M * LN2;  // natural log from here
            if (has_sinks) {
                const float sk = sink_logits[orw % q_heads];
                const float m2 = fmaxf(Mn, sk);
                scale_acc = Mn == NEG_INF ? 0.f : exp_ftz(Mn - m2);
                L = L * scale_acc + exp_ftz(sk - m2);
                Mn = m2;
            }
            f = L > 0.f ? scale_acc / L : 0.f;
            dst = o.out + (size_t)orw * D;
            if (d4 == 0 && o.lse != nullptr) o.lse[orw] = L > 0.f ? Mn + logf(L) : NEG_INF;
        }
        reinterpret_cast<float4*>(dst)[d4] = make_float4(a.x * f, a.y * f, a.z * f, a.w * f);
    }
    tr.mark(7, 0u);
    if (o.splits <= 1) return false;
    // Publish the partial and count this split in; the last one merges the unit.
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(o.counters + u.index(), 1) == o.splits - 1;
        if (last) o.counters[u.index()] = 0;
    }
    __syncthreads();
    tr.mark(8, last);
    if (!last) return false;
    __threadfence();
    return true;
}

template <typename T, int D, int ROWS, int U, bool PIPE>
__device__ __forceinline__ void attn_core(
    const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
    const i32* __restrict__ cu_q, const i32* __restrict__ kv_lens,
    const i32* __restrict__ block_table, i32 max_blocks, i32 num_blocks,
    i32 mode, const i32* __restrict__ sel_ids, const i32* __restrict__ sel_lens, i32 sel_max,
    i32 kv_heads, i32 group, i32 bs, float scale, i32 window, i32 sinks,
    const float* __restrict__ sink_logits, i32 has_sinks, i32 chunk, const Outs& o) {
    constexpr int WARPS = 4;
    constexpr int LANES = D / 8;
    constexpr int TPW = 32 / LANES;
    constexpr int NSTREAMS = WARPS * TPW;
    const int q_heads = kv_heads * group;

    const Unit u(ROWS, cu_q, kv_lens, kv_heads);
    if (u.empty(group)) return;

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int sub = lane / LANES;
    const int e0 = (lane % LANES) * 8;
    const int stream = warp * TPW + sub;

    // Rows: query position and q pre-scaled into base 2.
    float qv[ROWS][8];
    int rpos[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        rpos[r] = u.pos(r, group);
        const int rr = u.row0 + r;
        if (rpos[r] >= 0) {
            const int orow = (u.q_start + rr / group) * q_heads + u.h * group + rr % group;
            Raw8 raw;
            load_raw(q + (size_t)orow * D + e0, raw);
            unpack(q, raw, qv[r]);
#pragma unroll
            for (int e = 0; e < 8; e++) qv[r][e] *= scale * LOG2E;
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) qv[r][e] = 0.f;
        }
    }

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
    const Keys<T, D> keys = u.template keys<T, D>(
        ROWS, group, kc, vc, block_table, max_blocks, num_blocks, mode, sel_ids, sel_lens,
        sel_max, kv_heads, bs, chunk, e0);
    Raw8 kr[U], vr[U];
    int pos[U];
    keys.template fetch<U, NSTREAMS>(keys.t0 + stream, kr, vr, pos);
#pragma unroll 1
    for (int base = keys.t0; base < keys.t1; base += NSTREAMS * U) {
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
                s[u][r] = visible(pos[u], rpos[r], window, sinks) ? d : NEG_INF;
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
                const float alpha = exp2_ftz(m[r] - mt);
                m[r] = mt;
                l[r] *= alpha;
#pragma unroll
                for (int e = 0; e < 8; e++) acc[r][e] *= alpha;
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                // A masked key weighs exp2(-inf) = 0 and its V was zeroed by the fetch.
                const float pr = exp2_ftz(s[u][r] - mt);
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
    Trace<false> tr;
    if (finish_rows<D, ROWS, NSTREAMS>(smem, u, group, q_heads, sink_logits, has_sinks, o, tr))
        merge_unit<D, ROWS>(u, group, q_heads, sink_logits, has_sinks, o);
}

#define ATTN_KERNEL(NAME, T, D, ROWS, U, PIPE, MINB)                                            \
    extern "C" __global__ void __launch_bounds__(128, MINB) NAME(                                    \
        const T* q, const T* kc, const T* vc, const i32* cu_q, const i32* kv_lens,             \
        const i32* block_table, i32 max_blocks, i32 num_blocks, i32 mode, const i32* sel_ids,  \
        const i32* sel_lens, i32 sel_max, i32 kv_heads, i32 group, i32 bs, float scale,        \
        i32 window, i32 sinks, const float* sink_logits, i32 has_sinks, i32 chunk, float* out, \
        float* lse, i32 has_lse, float* part_out, float* part_lse, i32* counters, i32 splits,  \
        i32 total_rows, const u32* ready, const u32* epoch, i32 ready_div) {                   \
        /* Published selections are for the tensor-core kernels only: ready is null here. */   \
        pdl_enter();                                                                           \
        const Outs o{out, has_lse ? lse : nullptr, part_out, part_lse, counters, splits,       \
                     total_rows};                                                              \
        attn_core<T, D, ROWS, U, PIPE>(q, kc, vc, cu_q, kv_lens, block_table, max_blocks,            \
                                 num_blocks, mode, sel_ids, sel_lens, sel_max, kv_heads,       \
                                 group, bs, scale, window, sinks, sink_logits, has_sinks,      \
                                 chunk, o);                                                    \
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
// Tensor-core attention for the 16-bit types (head dims 64 and 128).
//
// Same arguments, modes and outputs as attn_core. A CTA takes up to 8 rows of one (sequence, KV
// head); its 4 warps walk the split's keys in tiles of 16 (KT tiles per warp and round, loaded
// together) with mma.sync m16n8k16 (f32 accumulation):
//   S^T (16 keys x 8 rows) = K (16 keys x D) . Q^T (D x 8 rows), D / 16 MMAs;
//   O^T (D x 8 rows) += V^T (D x 16 keys) . P^T (16 keys x 8 rows), D / 16 MMAs.
// With the rows on the narrow N side, the 4 rows of a decode GQA group waste half an MMA, not
// three quarters. The reduction index of an MMA may be permuted freely as long as both operands
// use the same order, so each thread loads whole 16-byte vectors: for K and Q, thread (g, t)
// (g = lane / 4, t = lane % 4) holds dims i * 32 + t * 8 .. + 8 of key g, key g + 8 and row g;
// for V, dims v * 64 + g * 8 .. + 8 of keys 2t, 2t + 1, 2t + 8 and 2t + 9, paired across keys
// with byte permutes. P (f32 in the S^T fragment) is rounded to the 16-bit type and turned into
// the B fragment by movmatrix. A thread's rows are 2t and 2t + 1 in both S^T and O^T, so the
// online softmax (base 2, rescaled only when a maximum grows) needs no exchange but the row
// maximum across the 8 lanes of a column.

__device__ __forceinline__ uint4 load16(const void* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

// The online-softmax state of one warp over the 8 rows of its CTA (rows 2t and 2t + 1 of
// thread (g, t)), and the math of one tile of 16 keys on tensor cores, apart from the walk
// over the keys (attn_mma_core) that feeds it.
template <typename T, int D>
struct WarpRows {
    enum {
        KVEC = D / 32,  // 16-byte vectors of K (and Q) per key and thread
        VVEC = D / 64,  // 16-byte vectors of V per key and thread
        STEPS = D / 16, // MMAs per product
    };
    float acc[STEPS][4];
    float m[2];
    float l[2];

    __device__ __forceinline__ WarpRows() {
#pragma unroll
        for (int i = 0; i < STEPS; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
        m[0] = m[1] = NEG_INF;
        l[0] = l[1] = 0.f;
    }

    // One tile: kf = keys g and g + 8, vf = keys 2t, 2t + 1, 2t + 8, 2t + 9 (see above); kpos
    // = positions of keys g and g + 8 (-1: none); rpos = positions of rows 2t and 2t + 1.
    __device__ __forceinline__ void tile(const uint4 (&qf)[KVEC], const uint4 (&kf)[2][KVEC],
                                         const uint4 (&vf)[4][VVEC], const int (&kpos)[2],
                                         const int (&rpos)[2], float sl2, int window,
                                         int sinks) {
        // S^T = K Q^T: s[0], s[1] = key g, rows 2t, 2t+1; s[2], s[3] = key g + 8.
        float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < STEPS; j++) {
            const int i = j / 2;
            const int w = (j % 2) * 2;
            Mma<T>::run(s, word(kf[0][i], w), word(kf[1][i], w), word(kf[0][i], w + 1),
                        word(kf[1][i], w + 1), word(qf[i], w), word(qf[i], w + 1));
        }
#pragma unroll
        for (int e = 0; e < 4; e++) {
            s[e] = visible(kpos[e / 2], rpos[e % 2], window, sinks) ? s[e] * sl2 : NEG_INF;
        }
        float mx[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(s[r], s[2 + r]);
#pragma unroll
            for (int o = 4; o < 32; o <<= 1)
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], o));
        }
        // Rescale only when a running maximum grows (uniform over the lanes of a column).
        if (mx[0] > m[0] || mx[1] > m[1]) {
            float alpha[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const float mn = fmaxf(m[r], mx[r]);
                alpha[r] = m[r] == NEG_INF ? 0.f : exp2_ftz(m[r] - mn);
                m[r] = mn;
                l[r] *= alpha[r];
            }
#pragma unroll
            for (int i = 0; i < STEPS; i++) {
                acc[i][0] *= alpha[0];
                acc[i][1] *= alpha[1];
                acc[i][2] *= alpha[0];
                acc[i][3] *= alpha[1];
            }
        }
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; e++) p[e] = m[e % 2] == NEG_INF ? 0.f : exp2_ftz(s[e] - m[e % 2]);
        l[0] += p[0] + p[2];
        l[1] += p[1] + p[3];
        const u32 b0 = transpose8x8(Mma<T>::pack(p[0], p[1]));
        const u32 b1 = transpose8x8(Mma<T>::pack(p[2], p[3]));

        // O^T += V^T P^T: A rows are dims, pairs of keys (2t, 2t+1) and (2t+8, 2t+9).
#pragma unroll
        for (int j = 0; j < STEPS; j++) {
            const int v = j / 4;
            const int w = j % 4;
            const u32 x0 = word(vf[0][v], w), x1 = word(vf[1][v], w);
            const u32 x2 = word(vf[2][v], w), x3 = word(vf[3][v], w);
            Mma<T>::run(acc[j], __byte_perm(x0, x1, 0x5410), __byte_perm(x0, x1, 0x7632),
                        __byte_perm(x2, x3, 0x5410), __byte_perm(x2, x3, 0x7632), b0, b1);
        }
    }

    // The end of the walk: the row sums completed over the lanes of a column (each lane summed
    // only its own keys), then the state written to the CTA's shared memory for finish_rows
    // (accumulators [WARPS][8][D], maxima and sums [WARPS][8]).
    __device__ __forceinline__ void store(float* smem, int warps, int warp, int g, int t) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) l[r] += __shfl_xor_sync(0xffffffffu, l[r], o);
        }
        // acc[j][hf * 2 + r] is row 2t + r at dim (j / 4) * 64 + g * 8 + (j % 4) * 2 + hf.
        float* s_acc = smem;
        float* s_m = s_acc + warps * 8 * D;
        float* s_l = s_m + warps * 8;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float* dst = s_acc + (warp * 8 + 2 * t + r) * D + g * 8;
#pragma unroll
            for (int j = 0; j < STEPS; j++) {
                dst[(j / 4) * 64 + (j % 4) * 2] = acc[j][r];
                dst[(j / 4) * 64 + (j % 4) * 2 + 1] = acc[j][2 + r];
            }
            if (g == 0) {
                s_m[warp * 8 + 2 * t + r] = m[r];
                s_l[warp * 8 + 2 * t + r] = l[r];
            }
        }
    }
};

// Row g of the CTA's tile of rows, raw, as thread (g, t) holds it: the B operand of S^T = K Q^T
// (zero for padding rows).
template <typename T, int D>
__device__ __forceinline__ void load_q_rows(const Unit& u, const T* __restrict__ q, int group,
                                            int q_heads, int g, int t, uint4 (&qf)[D / 32]) {
    const int rr = u.row0 + g;
#pragma unroll
    for (int i = 0; i < D / 32; i++) qf[i] = make_uint4(0u, 0u, 0u, 0u);
    if (u.pos(g, group) >= 0) {
        const size_t orow = (size_t)(u.q_start + rr / group) * q_heads + u.h * group + rr % group;
#pragma unroll
        for (int i = 0; i < D / 32; i++) qf[i] = load16(q + orow * D + i * 32 + t * 8);
    }
}

// The most page ids of one split a CTA over a published selection stages in shared memory
// (`PUBLISHED_IDS` on the Rust side, which uses the flags only where every split fits).
#define PUB_IDS 256

// The bytes of dynamic shared memory this launch gave its CTAs.
__device__ __forceinline__ int dynamic_smem_bytes() {
    unsigned n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return (int)n;
}

// Starts copying the sequence's block-table row (`n` entries) into `dst` in shared memory (room
// for `cap` entries: what the launch gave beyond the warps' merge state), 4 bytes a copy
// without registers (cp.async), while the CTA waits for its row's flag: the host wrote the
// table before the step began. Returns `dst`, or null where the row does not fit (the walk
// then reads the table in global memory). published_keys ends the copies and has the walk
// read the table there, not from L2, once the page ids arrive.
__device__ __forceinline__ const i32* pub_table_start(i32* dst, int cap, const i32* row, int n) {
    if (n > cap) return nullptr;
#if __CUDA_ARCH__ >= 800
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const unsigned at = (unsigned)__cvta_generic_to_shared(dst + i);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(at), "l"(row + i));
    }
    asm volatile("cp.async.commit_group;\n" ::);
#else
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = row[i];
#endif
    return dst;
}

// A published selection's keys (always pages: Gpu::sparse_page_attention_published): the
// split's page ids, written while this kernel ran, are read past L1 once (other rows' reads
// may have left stale lines of this row there) into shared memory, which the walk then reads
// instead of the list; the block table, where pub_table_start staged it (`table` not null),
// is read there once its copies end. The ids are loaded for the split's whole chunk, issued
// before the row's length (sel_lens, read in Unit::keys), so that the two loads share one
// round trip instead of the ids waiting for the length (0.4-0.6 µs of the published step,
// kernels/NOTES.md, session 42); entries past the length are never used (slot_of stops at
// t1). The Rust side ensures the ids fit; ids past PUB_IDS would be read as missing.
template <typename T, int D>
__device__ __forceinline__ Keys<T, D> published_keys(const Unit& u, int rows, int group,
                                                     const T* kc, const T* vc,
                                                     const i32* block_table, int max_blocks,
                                                     int num_blocks, const i32* sel_ids,
                                                     const i32* sel_lens, int sel_max,
                                                     int kv_heads, int bs, int chunk,
                                                     const i32* table) {
    constexpr int PER = PUB_IDS / 128;  // ids a thread stages (CTAs of 128 threads)
    __shared__ i32 staged[PUB_IDS];
    const int p0 = u.split * chunk / bs;
    const int np = min(min((u.split * chunk + chunk + bs - 1) / bs, sel_max), p0 + PUB_IDS) - p0;
    const i32* row = sel_ids + (size_t)u.sh * sel_max + p0;
    int id[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int i = j * 128 + (int)threadIdx.x;
        id[j] = i < np ? __ldcg(row + i) : -1;
    }
    Keys<T, D> k = u.template keys<T, D>(rows, group, kc, vc, block_table, max_blocks,
                                         num_blocks, 1, sel_ids, sel_lens, sel_max, kv_heads,
                                         bs, chunk, 0, true);
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int i = j * 128 + (int)threadIdx.x;
        if (i < np) staged[i] = id[j];
    }
    if (table != nullptr) {
#if __CUDA_ARCH__ >= 800
        asm volatile("cp.async.wait_all;\n" ::);
#endif
        k.table = table;
    }
    __syncthreads();
    k.sel = staged - p0;
    k.sel_cap = min(k.sel_cap, (p0 + max(np, 0)) * bs);
    return k;
}

template <typename T, int D, int KT, bool TRACE, bool PUB>
__device__ __forceinline__ void attn_mma_core(
    const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
    const i32* __restrict__ cu_q, const i32* __restrict__ kv_lens,
    const i32* __restrict__ block_table, i32 max_blocks, i32 num_blocks,
    i32 mode, const i32* __restrict__ sel_ids, const i32* __restrict__ sel_lens, i32 sel_max,
    i32 kv_heads, i32 group, i32 bs, float scale, i32 window, i32 sinks,
    const float* __restrict__ sink_logits, i32 has_sinks, i32 chunk, const Outs& o,
    const u32* __restrict__ ready, const u32* __restrict__ epoch, int ready_div,
    Trace<TRACE>& tr) {
    static_assert(D % 64 == 0, "head dim a multiple of 64");
    constexpr int WARPS = 4;
    constexpr int ROWS = 8;
    constexpr int KVEC = D / 32;  // 16-byte vectors of K (and Q) per key and thread
    constexpr int VVEC = D / 64;  // 16-byte vectors of V per key and thread
    const int q_heads = kv_heads * group;

    // The unit's metadata, the split's length and the first tiles' list entries are read at
    // once, before anything waits for any of them (see Keys::slot_of).
    const Unit u(ROWS, cu_q, kv_lens, kv_heads);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    unsigned rounds = 0;
    uint4 qf[KVEC];
    // The warps' merge state (WarpRows::store), then, in a CTA over a published selection,
    // the block-table row where the launch gave it room.
    extern __shared__ float smem[];
    constexpr int MERGE_FLOATS = WARPS * ROWS * (D + 2);
    const i32* staged_table = nullptr;
    if (PUB) {
        // A published page selection (Gpu::sparse_page_attention_published): the launch
        // before this one writes its rows and sets each row's flag, ready[(seq * kv_heads +
        // h) / ready_div], to the step's value, *epoch, which the scoring launch before that
        // one advanced. The metadata, the queries, the block table and *epoch were complete
        // before that launch began, so they are read now; only the selection row waits for
        // its flag.
        load_q_rows<T, D>(u, q, group, q_heads, g, t, qf);
        staged_table = pub_table_start(reinterpret_cast<i32*>(smem + MERGE_FLOATS),
                                       dynamic_smem_bytes() / 4 - MERGE_FLOATS,
                                       block_table + (size_t)u.seq * max_blocks, max_blocks);
        wait_flag(ready + u.sh / ready_div, __ldcg(epoch));
    }
    const Keys<T, D> keys =
        PUB ? published_keys<T, D>(u, ROWS, group, kc, vc, block_table, max_blocks, num_blocks,
                                   sel_ids, sel_lens, sel_max, kv_heads, bs, chunk, staged_table)
            : u.template keys<T, D>(ROWS, group, kc, vc, block_table, max_blocks, num_blocks,
                                    mode, sel_ids, sel_lens, sel_max, kv_heads, bs, chunk, 0);

    // Each warp takes KT tiles of 16 keys per round: tile kt of warp w starts at round base +
    // (w * KT + kt) * 16. Keys g and g + 8 of a tile (K and the mask) are resolved one round
    // ahead, so the index loads of the next round overlap this round's K and V loads.
    constexpr int ROUND = WARPS * KT * 16;
    int kpos[KT][2], kslot[KT][2];
#pragma unroll
    for (int kt = 0; kt < KT; kt++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            kslot[kt][j] = keys.slot_of(keys.t0 + (warp * KT + kt) * 16 + g + 8 * j, kpos[kt][j]);
    tr.mark(2, u.kv_len ^ keys.t1);
    if (u.empty(group)) return;

    if (!PUB) load_q_rows<T, D>(u, q, group, q_heads, g, t, qf);
    // Positions of this thread's rows 2t and 2t + 1 (-1: padding).
    const int rpos[2] = {u.pos(2 * t, group), u.pos(2 * t + 1, group)};
    tr.mark(3, kslot[0][0]);

    const float sl2 = scale * LOG2E;
    WarpRows<T, D> st;

#pragma unroll 1
    for (int base = keys.t0; base < keys.t1; base += ROUND) {
        uint4 kf[KT][2][KVEC], vf[KT][4][VVEC];
#pragma unroll
        for (int kt = 0; kt < KT; kt++) {
            // Keys 2t, 2t+1, 2t+8, 2t+9 (V) take their slots from the lanes that resolved them.
            int vslot[4];
            vslot[0] = __shfl_sync(0xffffffffu, kslot[kt][0], 8 * t);
            vslot[1] = __shfl_sync(0xffffffffu, kslot[kt][0], 8 * t + 4);
            vslot[2] = __shfl_sync(0xffffffffu, kslot[kt][1], 8 * t);
            vslot[3] = __shfl_sync(0xffffffffu, kslot[kt][1], 8 * t + 4);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const T* src = kc + ((size_t)max(kslot[kt][j], 0) * kv_heads + u.h) * D + t * 8;
#pragma unroll
                for (int i = 0; i < KVEC; i++)
                    kf[kt][j][i] =
                        kslot[kt][j] >= 0 ? load16(src + i * 32) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const T* src = vc + ((size_t)max(vslot[j], 0) * kv_heads + u.h) * D + g * 8;
#pragma unroll
                for (int v = 0; v < VVEC; v++)
                    vf[kt][j][v] =
                        vslot[j] >= 0 ? load16(src + v * 64) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        int npos[KT][2], nslot[KT][2];
#pragma unroll
        for (int kt = 0; kt < KT; kt++)
#pragma unroll
            for (int j = 0; j < 2; j++)
                nslot[kt][j] =
                    keys.slot_of(base + ROUND + (warp * KT + kt) * 16 + g + 8 * j, npos[kt][j]);
        if (TRACE && rounds == 0) tr.mark(4, kf[0][0][0].x ^ vf[0][0][0].x);
        rounds++;

#pragma unroll
        for (int kt = 0; kt < KT; kt++) st.tile(qf, kf[kt], vf[kt], kpos[kt], rpos, sl2, window, sinks);
#pragma unroll
        for (int kt = 0; kt < KT; kt++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                kpos[kt][j] = npos[kt][j];
                kslot[kt][j] = nslot[kt][j];
            }
    }

    tr.mark(5, __float_as_uint(st.acc[0][0]));

    st.store(smem, WARPS, warp, g, t);
    __syncthreads();
    tr.mark(6, 0u);
    const bool last =
        finish_rows<D, ROWS, WARPS>(smem, u, group, q_heads, sink_logits, has_sinks, o, tr);
    // Only the tensor-core kernels of head dim 128 (3 CTAs a multiprocessor) have the
    // registers for the wide merge; the others spill with it.
    if (last)
        merge_unit<D, ROWS, D >= 128 ? MERGE_WIDE : MERGE_BATCH>(u, group, q_heads, sink_logits,
                                                                 has_sinks, o);
    tr.finish(last, rounds);
}

// Each tensor-core kernel comes twice: NAME waits for the kernel before it and ignores the
// flags; NAME##_pub takes a published page selection (ready non-null): it lets the next
// launch start, reads its queries and metadata, and waits for its row's flag only. One kernel
// with both paths held 168 registers instead of 152 and slowed the plain one by about 10 %.
#define ATTN_MMA_ONE(NAME, T, D, KT, MINB, TRACE, PUB)                                         \
    extern "C" __global__ void __launch_bounds__(128, MINB) NAME(                              \
        const T* q, const T* kc, const T* vc, const i32* cu_q, const i32* kv_lens,             \
        const i32* block_table, i32 max_blocks, i32 num_blocks, i32 mode, const i32* sel_ids,  \
        const i32* sel_lens, i32 sel_max, i32 kv_heads, i32 group, i32 bs, float scale,        \
        i32 window, i32 sinks, const float* sink_logits, i32 has_sinks, i32 chunk, float* out, \
        float* lse, i32 has_lse, float* part_out, float* part_lse, i32* counters, i32 splits,  \
        i32 total_rows, const u32* ready, const u32* epoch, i32 ready_div) {                   \
        Trace<TRACE> tr;                                                                       \
        tr.mark(0, 0u);                                                                        \
        if (PUB) {                                                                             \
            pdl_launch_dependents();                                                           \
        } else {                                                                               \
            pdl_enter();                                                                       \
        }                                                                                      \
        tr.mark(1, 0u);                                                                        \
        const Outs o{out, has_lse ? lse : nullptr, part_out, part_lse, counters, splits,       \
                     total_rows};                                                              \
        attn_mma_core<T, D, KT, TRACE, PUB>(q, kc, vc, cu_q, kv_lens, block_table, max_blocks, \
                                            num_blocks, mode, sel_ids, sel_lens, sel_max,      \
                                            kv_heads, group, bs, scale, window, sinks,         \
                                            sink_logits, has_sinks, chunk, o, ready, epoch,    \
                                            ready_div, tr);                                    \
    }

#define ATTN_MMA_KERNEL(NAME, T, D, KT, MINB, TRACE)  \
    ATTN_MMA_ONE(NAME, T, D, KT, MINB, TRACE, false) \
    ATTN_MMA_ONE(NAME##_pub, T, D, KT, MINB, TRACE, true)

// Tiles per warp and round, and the CTAs per multiprocessor the register budget allows (at
// head dim 128, a budget of 4 spilled and measured slower than 3 on an H200).
ATTN_MMA_KERNEL(attn_bf16_d64_tc, __nv_bfloat16, 64, 1, 4, false)
ATTN_MMA_KERNEL(attn_bf16_d128_tc, __nv_bfloat16, 128, 1, 3, false)
ATTN_MMA_KERNEL(attn_f16_d64_tc, __half, 64, 1, 4, false)
ATTN_MMA_KERNEL(attn_f16_d128_tc, __half, 128, 1, 3, false)
// For the bench's sweep: two tiles per warp in flight, 2 CTAs per multiprocessor.
ATTN_MMA_KERNEL(attn_bf16_d128_tc2, __nv_bfloat16, 128, 2, 2, false)
// For the bench's trace: the default kernel with per-CTA timestamps (kernels/trace.cuh).
ATTN_MMA_KERNEL(attn_bf16_d128_tct, __nv_bfloat16, 128, 1, 3, true)

// ---------------------------------------------------------------------------------------------
// Merge of stacked partial results (Gpu::merge_attention): parts_out [n_parts, rows, D],
// parts_lse [n_parts, rows]; one CTA per row, one thread per element. Split-KV attention merges
// its own splits in-kernel (finish_rows), with the same merge_elem.

extern "C" __global__ void attn_merge(const float* __restrict__ parts_out,
                                      const float* __restrict__ parts_lse, i32 n_parts, i32 rows,
                                      i32 D, float* __restrict__ out, float* __restrict__ lse) {
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        merge_elem(parts_out, parts_lse, n_parts, rows, blockIdx.x, d, D, NEG_INF, false, out,
                   lse);
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
