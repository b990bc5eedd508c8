// Kernels of offload's CUDA backend: the hot-buffer diff (HiSparse swap-in) and the zero-copy IO
// between pinned host memory and the device. The CPU implementations in crates/offload are the
// specification (HotBuffer::diff, execute_loads); offload's `gpu_io` example checks each kernel
// against them.
//
// Pointers into pinned host memory are ordinary pointers here: with unified addressing a pinned
// host allocation is readable and writable from kernels, so loads need no cudaMemcpy per page.
// Every index read from memory is range-checked before it addresses memory.
//
// Compiled after kernels/common.cuh (the integer typedefs and block_scan).

// ---------------------------------------------------------------------------------------------
// The diff: one CTA per (request, layer) row. For a row with `hot` slots:
//   lru [rows, hot]        slots oldest first, a permutation of 0..hot (updated in place)
//   slot_page [rows, hot]  the logical page each slot holds, -1 none (updated in place)
//   pages [rows, sel_max], lens [rows]: the selection, ascending and unique
//   current [rows]         the page in the reserved slot (index hot): a hit, never loaded
//   blocks [rows, hot + 1] the device block of each slot, the reserved one last
// Outputs per row: slots and table [rows, sel_max] (the slot and device block of each selected
// page, -1 padded), misses as (page, slot) [rows, sel_max] in selection order, miss and hit
// counts. A selection that does not fit the evictable slots sets errors[row] and changes nothing.
//
// Exactly HotBuffer::diff: walk the LRU oldest first; a slot holding a selected page (not the
// current one) is a hit, the others are evictable in LRU order; the m-th miss (in selection
// order) takes the m-th evictable slot; the new LRU order is the untouched evictables, the slots
// just filled, then the hits.

#define DIFF_THREADS 1024
#define HASH_BITS 12  // 4096 entries: selections up to 2048 pages at load <= 1/2
#define HASH_SIZE (1 << HASH_BITS)

__device__ __forceinline__ u32 hash_page(int page) {
    return ((u32)page * 2654435761u) >> (32 - HASH_BITS);
}

extern "C" __global__ void __launch_bounds__(DIFF_THREADS) hot_diff(
    u32* __restrict__ lru, i32* __restrict__ slot_page, i32 hot,
    const i32* __restrict__ pages, const i32* __restrict__ lens, i32 sel_max,
    const i32* __restrict__ current, const i32* __restrict__ blocks,
    i32* __restrict__ slots_out, i32* __restrict__ table_out, i32* __restrict__ miss_pages,
    i32* __restrict__ miss_slots, i32* __restrict__ miss_counts, i32* __restrict__ hit_counts,
    i32* __restrict__ errors, const i32* __restrict__ buf_rows, i32 num_bufs) {
    // Shared: the hash (page, selection index), the hit flag of each selection index, the old
    // LRU order, and the evictable and hit slots in LRU order; copies of the row's slot pages,
    // blocks and selection (read once, coalesced, instead of one dependent global load per
    // LRU position or selection index).
    __shared__ int h_page[HASH_SIZE];
    __shared__ short h_idx[HASH_SIZE];
    extern __shared__ int dyn[];
    int* s_lru = dyn;                 // [hot]
    int* s_evict = s_lru + hot;       // [hot]
    int* s_hit = s_evict + hot;       // [hot]
    int* s_cls = s_hit + hot;         // [hot]: selection index of each LRU position's page, -1
    int* s_sp = s_cls + hot;          // [hot]: the page of each slot
    int* s_blk = s_sp + hot;          // [hot + 1]: the block of each slot
    int* sel_hit = s_blk + hot + 1;   // [sel_max]
    int* s_sel = sel_hit + sel_max;   // [sel_max]: the selection

    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    // The hot buffer of this selection row: buf_rows[row] (distinct rows, checked on the
    // host), or the row itself.
    const int brow = buf_rows ? buf_rows[row] : row;
    if (brow < 0 || brow >= num_bufs) {
        if (tid == 0) {
            errors[row] = 1;
            miss_counts[row] = 0;
            hit_counts[row] = 0;
        }
        return;
    }
    const int len = min(max(lens[row], 0), sel_max);
    const int cur = current[row];
    const i32* sel = pages + (size_t)row * sel_max;
    u32* lr = lru + (size_t)brow * hot;
    i32* sp = slot_page + (size_t)brow * hot;
    const i32* blk = blocks + (size_t)row * (hot + 1);

    __shared__ int cur_selected;  // whether the selection holds the current page
    if (tid == 0) cur_selected = 0;
#pragma unroll 4
    for (int i = tid; i < HASH_SIZE; i += DIFF_THREADS) h_page[i] = -1;
    // The copies unrolled, so that a thread's global loads are in flight together.
#pragma unroll 4
    for (int i = tid; i < hot; i += DIFF_THREADS) {
        s_lru[i] = (int)lr[i];
        s_sp[i] = sp[i];
    }
#pragma unroll 4
    for (int i = tid; i <= hot; i += DIFF_THREADS) s_blk[i] = blk[i];
#pragma unroll 2
    for (int i = tid; i < sel_max; i += DIFF_THREADS) {
        sel_hit[i] = 0;
        if (i < len) s_sel[i] = sel[i];
    }
    __syncthreads();
    // Insert the selection (the current page is never looked up, so it is left out).
    for (int i = tid; i < len; i += DIFF_THREADS) {
        const int p = s_sel[i];
        if (p >= 0 && p == cur) cur_selected = 1;
        if (p < 0 || p == cur) continue;
        u32 k = hash_page(p);
        while (true) {
            const int prev = atomicCAS(&h_page[k], -1, p);
            if (prev == -1 || prev == p) {
                h_idx[k] = (short)i;
                break;
            }
            k = (k + 1) & (HASH_SIZE - 1);
        }
    }
    __syncthreads();

    // Walk the LRU: each thread classifies a run of consecutive positions.
    const int per = (hot + DIFF_THREADS - 1) / DIFF_THREADS;
    const int a = min(hot, tid * per);
    const int b = min(hot, a + per);
    int n_hit = 0;
    for (int j = a; j < b; j++) {
        const int slot = s_lru[j];
        const int p = (slot >= 0 && slot < hot) ? s_sp[slot] : -1;
        int idx = -1;
        if (p >= 0 && p != cur) {
            u32 k = hash_page(p);
            while (h_page[k] != -1) {
                if (h_page[k] == p) {
                    idx = h_idx[k];
                    break;
                }
                k = (k + 1) & (HASH_SIZE - 1);
            }
        }
        s_cls[j] = idx;
        n_hit += idx >= 0;
    }
    int hits_total;
    const int hit_at = block_scan<DIFF_THREADS>(n_hit, &hits_total);
    const int n_evict = hot - hits_total;
    int hi = hit_at, ev = a - hit_at;
    for (int j = a; j < b; j++) {
        const int slot = s_lru[j];
        const int idx = s_cls[j];
        if (idx >= 0) {
            s_hit[hi++] = slot;
            sel_hit[idx] = 1;
            slots_out[(size_t)row * sel_max + idx] = slot;
            table_out[(size_t)row * sel_max + idx] = s_blk[slot];
        } else {
            s_evict[ev++] = slot;
        }
    }
    __syncthreads();

    // Misses in selection order: the m-th takes the m-th evictable slot.
    const int sper = (len + DIFF_THREADS - 1) / DIFF_THREADS;
    const int sa = min(len, tid * sper);
    const int sb = min(len, sa + sper);
    int n_miss = 0;
    for (int i = sa; i < sb; i++) {
        const int p = s_sel[i];
        n_miss += p >= 0 && p != cur && !sel_hit[i];
    }
    int misses_total;
    int m = block_scan<DIFF_THREADS>(n_miss, &misses_total);
    if (misses_total > n_evict) {
        // Cannot happen when the caller keeps the selection within the buffer; nothing changes.
        if (tid == 0) {
            errors[row] = 1;
            miss_counts[row] = 0;
            hit_counts[row] = 0;
        }
        return;
    }
    for (int i = sa; i < sb; i++) {
        const int p = s_sel[i];
        const size_t o = (size_t)row * sel_max + i;
        if (p < 0) {
            slots_out[o] = -1;
            table_out[o] = -1;
        } else if (p == cur) {
            slots_out[o] = hot;
            table_out[o] = s_blk[hot];
        } else if (!sel_hit[i]) {
            const int slot = s_evict[m];
            sp[slot] = p;
            slots_out[o] = slot;
            table_out[o] = s_blk[slot];
            miss_pages[(size_t)row * sel_max + m] = p;
            miss_slots[(size_t)row * sel_max + m] = slot;
            m++;
        }
    }
    for (int i = len + tid; i < sel_max; i += DIFF_THREADS) {
        const size_t o = (size_t)row * sel_max + i;
        slots_out[o] = -1;
        table_out[o] = -1;
        miss_pages[o] = -1;
        miss_slots[o] = -1;
    }
    for (int i = misses_total + tid; i < len; i += DIFF_THREADS) {
        miss_pages[(size_t)row * sel_max + i] = -1;
        miss_slots[(size_t)row * sel_max + i] = -1;
    }
    // New LRU: evictables not reused, the slots just filled, then the hits.
    const int keep = n_evict - misses_total;
    for (int j = tid; j < hot; j += DIFF_THREADS) {
        int slot;
        if (j < keep) {
            slot = s_evict[misses_total + j];
        } else if (j < n_evict) {
            slot = s_evict[j - keep];
        } else {
            slot = s_hit[j - n_evict];
        }
        lr[j] = (u32)slot;
    }
    if (tid == 0) {
        errors[row] = 0;
        miss_counts[row] = misses_total;
        hit_counts[row] = hits_total + cur_selected;
    }
}

// ---------------------------------------------------------------------------------------------
// Per-head selections and the hot buffer. As on the CPU, a request keeps one hot buffer per layer
// whatever its selections: with one selection per KV head, the buffer holds the union of the
// heads' pages (whole pages, every head), and attention reads each head's own page list through a
// block table of the request's logical pages.
//
// union_heads: one CTA per request merges its `heads` rows of ids [rows * heads, sel_max] (ids
// outside 0..max_pages skipped) into one ascending, unique row of out [rows, out_max], -1 padded,
// with its length in out_lens [rows]; a bitmap of max_pages bits in shared memory sorts them.
//
// page_table: one CTA per request writes table [rows, max_pages]: the device block of each page
// of its diffed selection (pages [rows, sel_max] ascending, the diff's blocks [rows, sel_max] in
// the same order), -1 for every other page.

#define UNION_THREADS 256

extern "C" __global__ void __launch_bounds__(UNION_THREADS) union_heads(
    const i32* __restrict__ ids, const i32* __restrict__ lens, i32 heads, i32 sel_max,
    i32 max_pages, i32* __restrict__ out, i32* __restrict__ out_lens, i32 out_max) {
    extern __shared__ u32 bits[];
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const int words = (max_pages + 31) / 32;
    for (int w = tid; w < words; w += UNION_THREADS) bits[w] = 0;
    __syncthreads();
    for (int h = 0; h < heads; h++) {
        const size_t r = (size_t)row * heads + h;
        const int len = min(max(lens[r], 0), sel_max);
        for (int i = tid; i < len; i += UNION_THREADS) {
            const int p = ids[r * sel_max + i];
            if (p >= 0 && p < max_pages) atomicOr(&bits[p >> 5], 1u << (p & 31));
        }
    }
    __syncthreads();
    // Each thread writes the pages of a run of consecutive words, after those of the runs
    // before it.
    const int per = (words + UNION_THREADS - 1) / UNION_THREADS;
    const int a = min(words, tid * per);
    const int b = min(words, a + per);
    int n = 0;
    for (int w = a; w < b; w++) n += __popc(bits[w]);
    int total;
    int at = block_scan<UNION_THREADS>(n, &total);
    i32* o = out + (size_t)row * out_max;
    for (int w = a; w < b; w++) {
        u32 x = bits[w];
        while (x != 0u) {
            const int bit = __ffs(x) - 1;
            x &= x - 1u;
            if (at < out_max) o[at] = w * 32 + bit;
            at++;
        }
    }
    for (int i = total + tid; i < out_max; i += UNION_THREADS) o[i] = -1;
    if (tid == 0) out_lens[row] = min(total, out_max);
}

extern "C" __global__ void __launch_bounds__(UNION_THREADS) page_table(
    const i32* __restrict__ pages, const i32* __restrict__ lens, i32 sel_max,
    const i32* __restrict__ blocks, i32 max_pages, i32* __restrict__ table) {
    const int row = blockIdx.x;
    i32* t = table + (size_t)row * max_pages;
    for (int i = threadIdx.x; i < max_pages; i += UNION_THREADS) t[i] = -1;
    // The CTA's writes of -1 are visible to all its threads past the barrier, so the blocks
    // written below are the last word.
    __syncthreads();
    const int len = min(max(lens[row], 0), sel_max);
    for (int i = threadIdx.x; i < len; i += UNION_THREADS) {
        const int p = pages[(size_t)row * sel_max + i];
        if (p >= 0 && p < max_pages) t[p] = blocks[(size_t)row * sel_max + i];
    }
}

// tally_diff: one CTA adds a diff's counts over its `rows` rows into totals[3 * at..][3] (hits,
// misses, rows whose selection did not fit), so running totals stay on the device and are read
// once, not after every step.

#define TALLY_THREADS 256

extern "C" __global__ void __launch_bounds__(TALLY_THREADS) tally_diff(
    const i32* __restrict__ hits, const i32* __restrict__ misses, const i32* __restrict__ errors,
    i32 rows, unsigned long long* __restrict__ totals, i32 at) {
    totals += 3 * (size_t)at;
    unsigned long long h = 0, m = 0, e = 0;
    for (int r = threadIdx.x; r < rows; r += TALLY_THREADS) {
        h += (unsigned long long)max(hits[r], 0);
        m += (unsigned long long)max(misses[r], 0);
        e += errors[r] != 0 ? 1ull : 0ull;
    }
    for (int off = 16; off > 0; off >>= 1) {
        h += __shfl_down_sync(0xffffffffu, h, off);
        m += __shfl_down_sync(0xffffffffu, m, off);
        e += __shfl_down_sync(0xffffffffu, e, off);
    }
    if ((threadIdx.x & 31) == 0) {
        if (h != 0) atomicAdd(&totals[0], h);
        if (m != 0) atomicAdd(&totals[1], m);
        if (e != 0) atomicAdd(&totals[2], e);
    }
}

// ---------------------------------------------------------------------------------------------
// Loads of the diff's misses, zero-copy from the pinned host pool into the device pool of one
// layer. Host pool (K and V each): [layers, host_pages, page_elems] (offload's LayerFirst
// layout); device pool: [num_blocks, page_elems] (attn-op's block tensor). Row r's miss m is
// logical page miss_pages[r, m] into slot miss_slots[r, m]: host page host_table[r, page],
// device block blocks[r, slot]. Grid: x = miss chunk, y = row; a warp per (miss, K or V) copies
// the page in 16-byte vectors, several in flight per lane.

#define IO_WARPS 8
#define IO_UNROLL 4

__device__ __forceinline__ void copy_vecs(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                          int n, int lane) {
    int i = lane;
    for (; i + 32 * (IO_UNROLL - 1) < n; i += 32 * IO_UNROLL) {
        uint4 v[IO_UNROLL];
#pragma unroll
        for (int u = 0; u < IO_UNROLL; u++) v[u] = src[i + 32 * u];
#pragma unroll
        for (int u = 0; u < IO_UNROLL; u++) dst[i + 32 * u] = v[u];
    }
    for (; i < n; i += 32) dst[i] = src[i];
}

extern "C" __global__ void __launch_bounds__(IO_WARPS * 32) load_misses(
    const uint4* __restrict__ host_k, const uint4* __restrict__ host_v, i32 layer,
    i32 host_pages, i32 page_vecs, const i32* __restrict__ host_table, i32 max_pages,
    const i32* __restrict__ blocks, i32 hot, const i32* __restrict__ miss_pages,
    const i32* __restrict__ miss_slots, const i32* __restrict__ miss_counts, i32 sel_max,
    uint4* __restrict__ dev_k, uint4* __restrict__ dev_v, i32 num_blocks) {
    const int row = blockIdx.y;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int item = blockIdx.x * IO_WARPS + warp;  // (miss, K or V)
    const int m = item >> 1;
    if (m >= min(miss_counts[row], sel_max)) return;
    const int page = miss_pages[(size_t)row * sel_max + m];
    const int slot = miss_slots[(size_t)row * sel_max + m];
    if (page < 0 || page >= max_pages || slot < 0 || slot > hot) return;
    const int hp = host_table[(size_t)row * max_pages + page];
    const int db = blocks[(size_t)row * (hot + 1) + slot];
    if (hp < 0 || hp >= host_pages || db < 0 || db >= num_blocks) return;
    const size_t src = ((size_t)layer * host_pages + hp) * page_vecs;
    const size_t dst = (size_t)db * page_vecs;
    if (item & 1)
        copy_vecs(host_v + src, dev_v + dst, page_vecs, lane);
    else
        copy_vecs(host_k + src, dev_k + dst, page_vecs, lane);
}

// ---------------------------------------------------------------------------------------------
// Rows by index, either way (host -> device loads of token rows, device -> host backups of new
// tokens): row i copies src[src_idx[i]] to dst[dst_idx[i]], rows of row_vecs 16-byte vectors.
// Indices outside their side's row count are skipped. A warp per row.

extern "C" __global__ void __launch_bounds__(IO_WARPS * 32) copy_rows(
    const uint4* __restrict__ src, uint4* __restrict__ dst, const i32* __restrict__ src_idx,
    const i32* __restrict__ dst_idx, i32 n, i32 row_vecs, i32 src_rows, i32 dst_rows) {
    const int i = blockIdx.x * IO_WARPS + (threadIdx.x >> 5);
    if (i >= n) return;
    const int s = src_idx[i];
    const int d = dst_idx[i];
    if (s < 0 || s >= src_rows || d < 0 || d >= dst_rows) return;
    copy_vecs(src + (size_t)s * row_vecs, dst + (size_t)d * row_vecs, row_vecs, threadIdx.x & 31);
}
