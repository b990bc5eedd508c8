//! Run lists: jobs over a batch's sequences, the runs of their pages, and a list cut into the
//! chunks and units the kernel walks.

use super::{CHUNK, Job, MAX_ROWS_ALL_HEADS, Q_TILE, Run, SPLIT_CHUNKS};
use crate::meta::Seq;

/// Jobs for every (sequence, query tile) and KV heads; `list_of(seq, head)` names the run list,
/// and `shared(seq)` says whether all KV heads of the sequence attend the same list (then its
/// decode-sized jobs take every head at once, reading each token's heads as one contiguous
/// row). Which heads a job takes changes no bit of any row's result.
pub(crate) fn jobs_for(
    seqs: &[Seq<'_>],
    kv_heads: usize,
    group: usize,
    shared: impl Fn(usize) -> bool,
    list_of: impl Fn(usize, usize) -> usize,
) -> Vec<Job> {
    let mut jobs = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        let mut lo = 0;
        while lo < seq.q_len {
            let hi = (lo + Q_TILE).min(seq.q_len);
            if shared(s) && (hi - lo) * kv_heads * group <= MAX_ROWS_ALL_HEADS {
                jobs.push(Job {
                    seq: s,
                    h0: 0,
                    h1: kv_heads,
                    q_lo: lo,
                    q_hi: hi,
                    list: list_of(s, 0),
                });
            } else {
                for h in 0..kv_heads {
                    jobs.push(Job {
                        seq: s,
                        h0: h,
                        h1: h + 1,
                        q_lo: lo,
                        q_hi: hi,
                        list: list_of(s, h),
                    });
                }
            }
            lo = hi;
        }
    }
    jobs
}

/// Runs covering logical positions `0..len` page by page.
pub(crate) fn dense_runs(seq: &Seq<'_>, len: usize, block_size: usize) -> Vec<Run> {
    (0..len.div_ceil(block_size))
        .map(|p| page_run(seq, p, len, block_size))
        .collect()
}

/// The run of logical page `page` of a sequence of `len` tokens.
pub(crate) fn page_run(seq: &Seq<'_>, page: usize, len: usize, block_size: usize) -> Run {
    let pos = page * block_size;
    Run {
        pos: pos as u32,
        slot: (seq.blocks[page] as usize * block_size) as u32,
        len: (len - pos).min(block_size) as u32,
        chunk: 0,
    }
}

/// `runs` cut into chunks of [`CHUNK`] consecutive tokens of the list, each run numbered with
/// its chunk (a run that straddles two chunks is cut in two), and where the cut list splits
/// into units of [`SPLIT_CHUNKS`] chunks: ascending run indices from 0 to its length, at least
/// one unit even for an empty list. One pass into vectors sized once: a B8 L4K decode cuts
/// 2048 runs a call, on the caller's thread while the others wait.
pub(super) fn at_chunks(runs: &[Run]) -> (Vec<Run>, Vec<usize>) {
    let tokens: usize = runs.iter().map(|r| r.len as usize).sum();
    let chunk = CHUNK as usize;
    // A run is cut once more at each chunk boundary inside it.
    let mut out = Vec::with_capacity(runs.len() + tokens / chunk + 1);
    let mut cuts = Vec::with_capacity(tokens / (chunk * SPLIT_CHUNKS) + 2);
    cuts.push(0);
    let mut seen = 0u32;
    for &r in runs {
        let (mut pos, mut slot, end) = (r.pos, r.slot, r.pos + r.len);
        while pos < end {
            let (c, off) = (seen / CHUNK, seen % CHUNK);
            // A unit starts with the first run of every SPLIT_CHUNKS-th chunk but the first.
            if off == 0 && c > 0 && (c as usize).is_multiple_of(SPLIT_CHUNKS) {
                cuts.push(out.len());
            }
            let len = (CHUNK - off).min(end - pos);
            out.push(Run {
                pos,
                slot,
                len,
                chunk: c,
            });
            seen += len;
            slot += len;
            pos += len;
        }
    }
    cuts.push(out.len());
    (out, cuts)
}

/// The runs of a chunked run list's first chunk (none for an empty list).
pub(super) fn first_chunk(runs: &[Run]) -> &[Run] {
    let n = runs.first().map_or(0, |first| {
        runs.iter().take_while(|r| r.chunk == first.chunk).count()
    });
    &runs[..n]
}

/// The chunks that consecutive runs of a list cut and numbered by [`at_chunks`] touch: the
/// whole list's, or a unit's.
pub(super) fn chunk_count(runs: &[Run]) -> usize {
    match (runs.first(), runs.last()) {
        (Some(first), Some(last)) => (last.chunk - first.chunk) as usize + 1,
        _ => 0,
    }
}
