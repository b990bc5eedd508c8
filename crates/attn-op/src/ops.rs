//! The public entry points: dense paged attention, sparse page-list and token-level attention,
//! the gather of page offsets, the merge of partial results, and KV compaction.

use crate::error::check_len;
use crate::kernel::{Run, dense_runs, execute, jobs_for, page_run};
use crate::meta::Seq;
use crate::{AttnError, AttnParams, BatchMeta, Element, PagedKv, Selection};

/// Where an attention call writes: the output `[total_q, q_heads, head_dim]` in f32 and,
/// optionally, the natural-log log-sum-exp of each row's scores `[total_q, q_heads]` (-inf for a
/// row that saw no key), which [`merge_attention`] needs.
pub struct AttnOut<'a> {
    /// The normalized output.
    pub out: &'a mut [f32],
    /// The log-sum-exp, if wanted.
    pub lse: Option<&'a mut [f32]>,
}

/// Checks q and the outputs against the batch, returns the validated sequences and group size.
fn check_io<'m, T: Element>(
    q: &[T],
    kv: &PagedKv<T>,
    meta: &BatchMeta<'m>,
    params: &AttnParams,
    dst: &AttnOut<'_>,
) -> Result<(Vec<Seq<'m>>, usize), AttnError> {
    let layout = kv.layout_ref();
    let group = params.validate(layout)?;
    let seqs = meta.validate(layout)?;
    let (total, heads) = (meta.total_q(), params.q_heads);
    check_len("q", q.len(), &[total, heads, layout.head_dim])?;
    check_len("out", dst.out.len(), &[total, heads, layout.head_dim])?;
    if let Some(lse) = &dst.lse {
        check_len("lse", lse.len(), &[total, heads])?;
    }
    Ok((seqs, group))
}

/// Batched causal attention over a paged KV cache for a mixed batch of prefills and decodes.
///
/// Query `i` of sequence `s` (rows `cu_seqlens_q[s]..cu_seqlens_q[s + 1]` of `q`, which is
/// `[total_q, q_heads, head_dim]`) sits at position `seq_lens_kv[s] - q_len_s + i` and attends
/// keys `0..=` that position (narrowed by `params.window`, with `params.sink_tokens`). The query
/// heads of one KV group read each KV page once.
pub fn paged_attention<T: Element>(
    q: &[T],
    kv: &PagedKv<T>,
    meta: &BatchMeta<'_>,
    params: &AttnParams,
    dst: AttnOut<'_>,
) -> Result<(), AttnError> {
    let (seqs, group) = check_io(q, kv, meta, params, &dst)?;
    let layout = kv.layout_ref();
    let lists: Vec<Vec<Run>> = seqs
        .iter()
        .map(|s| dense_runs(s, s.kv_len, layout.block_size))
        .collect();
    let jobs = jobs_for(&seqs, layout.kv_heads, group, |_| true, |s, _| s);
    execute(kv, q, params, group, &seqs, &jobs, &lists, dst.out, dst.lse);
    Ok(())
}

/// The output of [`gather_page_offsets`]: per (sequence, KV head), the selected logical KV pages
/// sorted and unique, in the shared selection format, plus the effective KV length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatheredPages {
    /// `[num_seqs, kv_heads, max_pages]` logical page ids, ascending, padded with -1.
    pub pages: Vec<i32>,
    /// `[num_seqs, kv_heads]` valid entries of each row.
    pub counts: Vec<i32>,
    /// `[num_seqs, kv_heads]` tokens covered by the selected pages (a last partial page counts
    /// only its valid tokens).
    pub kv_lens: Vec<i32>,
    /// Row width of `pages`.
    pub max_pages: usize,
}

impl GatheredPages {
    /// The pages as a [`Selection`] for [`sparse_page_attention`].
    pub fn as_selection(&self) -> Selection<'_> {
        Selection {
            ids: &self.pages,
            lens: &self.counts,
            max_len: self.max_pages,
        }
    }
}

/// Turns per (sequence, KV head) selections of blocks of `sel_block_size` tokens (unordered,
/// duplicates allowed; finer or coarser than the KV pages, as long as one size divides the other)
/// into sorted unique logical KV pages, with the effective KV length of each row.
pub fn gather_page_offsets(
    selection: &Selection<'_>,
    sel_block_size: usize,
    seq_lens_kv: &[i32],
    block_size: usize,
    kv_heads: usize,
) -> Result<GatheredPages, AttnError> {
    if sel_block_size == 0
        || block_size == 0
        || !(sel_block_size.is_multiple_of(block_size) || block_size.is_multiple_of(sel_block_size))
    {
        return Err(AttnError::Invalid(format!(
            "selection blocks of {sel_block_size} tokens do not tile KV pages of {block_size}"
        )));
    }
    if let Some(&bad) = seq_lens_kv.iter().find(|&&l| l < 0) {
        return Err(AttnError::Metadata(format!("negative KV length {bad}")));
    }
    let n = seq_lens_kv.len();
    let len = |s: usize| seq_lens_kv[s] as usize;
    let rows = selection.rows(n, kv_heads, "selected block", |s| {
        len(s).div_ceil(sel_block_size)
    })?;
    let max_pages = (0..n)
        .map(|s| len(s).div_ceil(block_size))
        .max()
        .unwrap_or(0);
    let mut out = GatheredPages {
        pages: vec![-1; n * kv_heads * max_pages],
        counts: vec![0; n * kv_heads],
        kv_lens: vec![0; n * kv_heads],
        max_pages,
    };
    let mut scratch = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        let kv_len = len(r / kv_heads);
        let num_pages = kv_len.div_ceil(block_size);
        scratch.clear();
        for &id in *row {
            let first = id as usize * sel_block_size / block_size;
            let last = ((id as usize + 1) * sel_block_size)
                .div_ceil(block_size)
                .min(num_pages);
            scratch.extend(first..last.max(first + 1));
        }
        scratch.sort_unstable();
        scratch.dedup();
        let dst = &mut out.pages[r * max_pages..];
        let mut tokens = 0;
        for (i, &p) in scratch.iter().enumerate() {
            dst[i] = p as i32;
            tokens += (kv_len - p * block_size).min(block_size);
        }
        out.counts[r] = scratch.len() as i32;
        out.kv_lens[r] = tokens as i32;
    }
    Ok(out)
}

/// Attention reading only selected pages: for each (sequence, KV head), `pages` lists logical KV
/// pages in strictly ascending order (as [`gather_page_offsets`] produces). Causality, window and
/// sinks apply within the selection. With every page selected it equals [`paged_attention`] bit
/// for bit.
pub fn sparse_page_attention<T: Element>(
    q: &[T],
    kv: &PagedKv<T>,
    meta: &BatchMeta<'_>,
    pages: &Selection<'_>,
    params: &AttnParams,
    dst: AttnOut<'_>,
) -> Result<(), AttnError> {
    let (seqs, group) = check_io(q, kv, meta, params, &dst)?;
    let layout = kv.layout_ref();
    let bs = layout.block_size;
    let rows = pages.rows(seqs.len(), layout.kv_heads, "page", |s| {
        seqs[s].kv_len.div_ceil(bs)
    })?;
    let mut lists = Vec::with_capacity(rows.len());
    for (r, row) in rows.iter().enumerate() {
        if row.windows(2).any(|w| w[0] >= w[1]) {
            return Err(AttnError::Invalid(format!(
                "pages of row {r} are not strictly ascending; use gather_page_offsets"
            )));
        }
        let seq = &seqs[r / layout.kv_heads];
        lists.push(
            row.iter()
                .map(|&p| page_run(seq, p as usize, seq.kv_len, bs))
                .collect(),
        );
    }
    run_per_head(kv, q, params, group, &seqs, &lists, dst);
    Ok(())
}

/// Runs attention with one run list per (sequence, KV head), in that order.
fn run_per_head<T: Element>(
    kv: &PagedKv<T>,
    q: &[T],
    params: &AttnParams,
    group: usize,
    seqs: &[Seq<'_>],
    lists: &[Vec<Run>],
    dst: AttnOut<'_>,
) {
    let kvh = kv.layout_ref().kv_heads;
    // A selection shared by a sequence's KV heads (Quest's `shared_heads`, say) is attended
    // as dense decode is, every head at once.
    let shared = |s: usize| {
        let heads = &lists[s * kvh..(s + 1) * kvh];
        heads.iter().all(|l| *l == heads[0])
    };
    let jobs = jobs_for(seqs, kvh, group, shared, |s, h| s * kvh + h);
    execute(kv, q, params, group, seqs, &jobs, lists, dst.out, dst.lse);
}

/// Token-level sparse attention (DSA / MLA style): for each (sequence, KV head), `tokens` lists
/// the logical positions to attend, in any order and without duplicates.
pub fn token_sparse_attention<T: Element>(
    q: &[T],
    kv: &PagedKv<T>,
    meta: &BatchMeta<'_>,
    tokens: &Selection<'_>,
    params: &AttnParams,
    dst: AttnOut<'_>,
) -> Result<(), AttnError> {
    let (seqs, group) = check_io(q, kv, meta, params, &dst)?;
    let layout = kv.layout_ref();
    let bs = layout.block_size;
    let rows = tokens.rows(seqs.len(), layout.kv_heads, "token", |s| seqs[s].kv_len)?;
    let mut lists = Vec::with_capacity(rows.len());
    let mut sorted = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        sorted.clear();
        sorted.extend_from_slice(row);
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(AttnError::Invalid(format!("row {r} selects a token twice")));
        }
        let seq = &seqs[r / layout.kv_heads];
        lists.push(token_runs(seq, &sorted, bs));
    }
    run_per_head(kv, q, params, group, &seqs, &lists, dst);
    Ok(())
}

/// Ascending positions coalesced into runs that stay inside one page.
fn token_runs(seq: &Seq<'_>, sorted: &[i32], bs: usize) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for &t in sorted {
        let pos = t as usize;
        if let Some(last) = runs.last_mut()
            && (last.pos + last.len) as usize == pos
            && !pos.is_multiple_of(bs)
        {
            last.len += 1;
            continue;
        }
        runs.push(Run {
            pos: pos as u32,
            slot: seq.slot(pos, bs) as u32,
            len: 1,
            chunk: 0,
        });
    }
    runs
}

/// One partial attention result for [`merge_attention`]: output `[n, q_heads, head_dim]` and
/// log-sum-exp `[n, q_heads]`.
#[derive(Clone, Copy, Debug)]
pub struct AttnPart<'a> {
    /// The normalized output of the part.
    pub out: &'a [f32],
    /// Its log-sum-exp.
    pub lse: &'a [f32],
}

/// Merges attention results computed over disjoint key sets (chunks of a sequence, memory
/// tiers) into the result over their union: with `m = max lse_i` and `w_i = exp(lse_i - m)`,
/// `out = sum w_i out_i / sum w_i` and `lse = m + ln(sum w_i)`. Parts that saw no key
/// (`lse = -inf`) weigh nothing; if all are empty the row is 0 with `lse = -inf`.
pub fn merge_attention(
    parts: &[AttnPart<'_>],
    head_dim: usize,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<(), AttnError> {
    if head_dim == 0 {
        return Err(AttnError::Invalid("head_dim 0".to_owned()));
    }
    let rows = lse.len();
    check_len("out", out.len(), &[rows, head_dim])?;
    for p in parts {
        check_len("part lse", p.lse.len(), &[rows])?;
        check_len("part out", p.out.len(), &[rows, head_dim])?;
    }
    for r in 0..rows {
        let m = parts
            .iter()
            .map(|p| p.lse[r])
            .fold(f32::NEG_INFINITY, f32::max);
        let dst = &mut out[r * head_dim..(r + 1) * head_dim];
        dst.fill(0.0);
        if m == f32::NEG_INFINITY {
            lse[r] = f32::NEG_INFINITY;
            continue;
        }
        let mut total = 0.0f32;
        for p in parts {
            let w = (p.lse[r] - m).exp();
            total += w;
            for (o, x) in dst.iter_mut().zip(&p.out[r * head_dim..(r + 1) * head_dim]) {
                *o += w * x;
            }
        }
        dst.iter_mut().for_each(|o| *o /= total);
        lse[r] = m + total.ln();
    }
    Ok(())
}

/// KV compaction after prefill: for each (sequence, KV head), `keep` lists strictly ascending
/// positions to keep; they move, in place, to the front of the sequence. Every KV head of a
/// sequence must keep the same number of tokens; the new KV lengths (`[num_seqs]`, for
/// `seq_lens_kv`) are returned. Ascending order is what makes the in-place move safe: a token
/// never lands on a position that is still to be read.
pub fn compact_kv<T: Element>(
    kv: &mut PagedKv<T>,
    seq_lens_kv: &[i32],
    block_table: &[i32],
    max_blocks: usize,
    keep: &Selection<'_>,
) -> Result<Vec<i32>, AttnError> {
    let layout = *kv.layout_ref();
    let (seqs, rows, new_lens) = check_keep(&layout, seq_lens_kv, block_table, max_blocks, keep)?;
    let kvh = layout.kv_heads;
    let bs = layout.block_size;
    let d = layout.head_dim;
    let (k, v) = kv.tensors_mut();
    for (r, row) in rows.iter().enumerate() {
        let (seq, head) = (&seqs[r / kvh], r % kvh);
        for (j, &src_pos) in row.iter().enumerate() {
            let src_pos = src_pos as usize;
            if src_pos == j {
                continue;
            }
            let src = layout.offset(seq.slot(src_pos, bs), head);
            let dst = layout.offset(seq.slot(j, bs), head);
            k.copy_within(src..src + d, dst);
            v.copy_within(src..src + d, dst);
        }
    }
    Ok(new_lens)
}

/// The validated sequences of a compaction, the keep rows, and the new KV lengths. Shared by the
/// CPU compaction and the CUDA one.
pub(crate) type KeepPlan<'m, 'k> = (Vec<Seq<'m>>, Vec<&'k [i32]>, Vec<i32>);

/// Checks a compaction's metadata and keep lists (equal counts per sequence, strictly
/// ascending positions inside the sequence).
pub(crate) fn check_keep<'m, 'k>(
    layout: &crate::KvLayout,
    seq_lens_kv: &'m [i32],
    block_table: &'m [i32],
    max_blocks: usize,
    keep: &Selection<'k>,
) -> Result<KeepPlan<'m, 'k>, AttnError> {
    let cu: Vec<i32> = vec![0; seq_lens_kv.len() + 1];
    let meta = BatchMeta {
        cu_seqlens_q: &cu,
        seq_lens_kv,
        block_table,
        max_blocks,
    };
    // The sequences borrow the local `cu`; re-borrow their blocks from `block_table` itself.
    let seqs: Vec<Seq<'m>> = meta
        .validate(layout)?
        .iter()
        .enumerate()
        .map(|(i, s)| Seq {
            blocks: &block_table[i * max_blocks..i * max_blocks + s.blocks.len()],
            ..*s
        })
        .collect();
    let kvh = layout.kv_heads;
    let rows = keep.rows(seqs.len(), kvh, "kept token", |s| seqs[s].kv_len)?;
    let mut new_lens = Vec::with_capacity(seqs.len());
    for (s, seq_rows) in rows.chunks(kvh).enumerate() {
        let n = seq_rows[0].len();
        if seq_rows.iter().any(|r| r.len() != n) {
            return Err(AttnError::Invalid(format!(
                "sequence {s}: KV heads keep different numbers of tokens"
            )));
        }
        if let Some(r) = seq_rows
            .iter()
            .position(|r| r.windows(2).any(|w| w[0] >= w[1]))
        {
            return Err(AttnError::Invalid(format!(
                "sequence {s} head {r}: kept positions are not strictly ascending"
            )));
        }
        new_lens.push(n as i32);
    }
    Ok((seqs, rows, new_lens))
}
