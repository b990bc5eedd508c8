//! Selections in the shared format, the always-include rules, and the deterministic top-k.

use std::ops::Range;

use attn_op::Selection;
use serde::{Deserialize, Serialize};

use crate::{AlgoError, Decode, RepPool};

/// Per (sequence, KV head) selected logical ids, ascending: `ids` is `[num_seqs, kv_heads,
/// max_len]` padded with -1 and `lens` is `[num_seqs, kv_heads]` (the shared selection format).
/// An id names a page of `page_size` tokens (1: a token), never a physical address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopK {
    /// Selected ids, row-major `[num_seqs, kv_heads, max_len]`, -1 padded.
    pub ids: Vec<i32>,
    /// Valid ids per row, `[num_seqs, kv_heads]`.
    pub lens: Vec<i32>,
    /// Row width of `ids`.
    pub max_len: usize,
    /// KV heads per sequence.
    pub kv_heads: usize,
    /// Tokens per selected id.
    pub page_size: usize,
}

impl TopK {
    /// Packs rows (one per (sequence, KV head), each ascending) into the padded format.
    pub fn from_rows(rows: &[Vec<i32>], kv_heads: usize, page_size: usize) -> TopK {
        let max_len = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = vec![-1; rows.len() * max_len];
        for (r, row) in rows.iter().enumerate() {
            ids[r * max_len..r * max_len + row.len()].copy_from_slice(row);
        }
        TopK {
            ids,
            lens: rows.iter().map(|r| r.len() as i32).collect(),
            max_len,
            kv_heads,
            page_size,
        }
    }

    /// Sequences covered.
    pub fn num_seqs(&self) -> usize {
        self.lens.len().checked_div(self.kv_heads).unwrap_or(0)
    }

    /// The valid ids of (sequence, KV head). Like slice indexing, it panics outside the
    /// selection or on a malformed one; the metrics check a selection before reading it.
    pub fn row(&self, seq: usize, head: usize) -> &[i32] {
        let r = seq * self.kv_heads + head;
        &self.ids[r * self.max_len..r * self.max_len + self.lens[r] as usize]
    }

    /// The selection as attn-op takes it ([`attn_op::gather_page_offsets`] with
    /// `sel_block_size = page_size`, [`attn_op::token_sparse_attention`] or
    /// [`attn_op::compact_kv`] when `page_size` is 1).
    pub fn as_selection(&self) -> Selection<'_> {
        Selection {
            ids: &self.ids,
            lens: &self.lens,
            max_len: self.max_len,
        }
    }

    /// The same selection at token granularity: every selected page expanded to its tokens,
    /// clipped to the sequence (`seq_lens[s]` tokens). `seq_lens` holds a length for every
    /// sequence of a well-formed selection, as for [`TopK::row`].
    pub fn to_tokens(&self, seq_lens: &[usize]) -> TopK {
        let ps = self.page_size;
        let rows: Vec<Vec<i32>> = (0..self.lens.len())
            .map(|r| {
                let len = seq_lens[r / self.kv_heads];
                let row = self.row(r / self.kv_heads, r % self.kv_heads);
                row.iter()
                    .flat_map(|&p| (p as usize * ps)..((p as usize + 1) * ps).min(len))
                    .map(|t| t as i32)
                    .collect()
            })
            .collect();
        TopK::from_rows(&rows, self.kv_heads, 1)
    }
}

/// Pages every decode selection contains whatever the scores say, shared by all algorithms:
/// the pages holding the first `sink_tokens` tokens (attention sinks) and those holding the last
/// `recent_tokens` tokens. The page of the newest token is always included (the query attends
/// itself), so `recent_tokens` 0 acts as 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlwaysInclude {
    /// Leading tokens always attended.
    pub sink_tokens: u32,
    /// Trailing tokens always attended (at least the newest).
    pub recent_tokens: u32,
}

impl Default for AlwaysInclude {
    /// Only the current page: Quest's rule (the last, partial page is attended, not estimated).
    fn default() -> Self {
        AlwaysInclude {
            sink_tokens: 0,
            recent_tokens: 1,
        }
    }
}

impl AlwaysInclude {
    /// The most forced pages a row with pages of `ps` tokens can have: the sink pages plus the
    /// most pages `recent_tokens` consecutive tokens can touch (at least one token, the
    /// newest). `r` tokens touch at most `(r - 1).div_ceil(ps) + 1` pages, one more than they
    /// fill where they straddle a page boundary; every sequence length reaches the bound for
    /// some alignment, so it is exact, not loose.
    pub fn max_forced_pages(&self, ps: usize) -> usize {
        let ps = ps.max(1);
        let recent = (self.recent_tokens as usize).max(1);
        (self.sink_tokens as usize).div_ceil(ps) + (recent - 1).div_ceil(ps) + 1
    }

    /// The most pages one decode row can hold under a budget of `budget_tokens` with pages of
    /// `ps` tokens. A row's scored pages fill only what its forced pages leave of the budget's
    /// `budget_tokens / ps` pages ([`Plan::new`]), so a row holds the larger of the two
    /// counts, not their sum.
    pub(crate) fn max_row_pages(&self, budget_tokens: usize, ps: usize) -> usize {
        (budget_tokens / ps.max(1)).max(self.max_forced_pages(ps))
    }
}

/// How one (sequence, KV head) row of a decode selection is assembled: pages `0..head.end` and
/// `tail.start..num_pages` are forced, `pick` more are chosen by score from `mid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) num_pages: usize,
    pub(crate) head: Range<usize>,
    pub(crate) mid: Range<usize>,
    pub(crate) tail: Range<usize>,
    pub(crate) pick: usize,
}

impl Plan {
    /// The plan for a sequence of `len` tokens, pages of `ps` tokens, a budget of
    /// `budget_pages` pages. With no more pages than the budget, everything is selected and
    /// nothing is estimated (`mid` empty, all forced).
    pub(crate) fn new(len: usize, ps: usize, budget_pages: usize, always: AlwaysInclude) -> Plan {
        let n = len.div_ceil(ps);
        if n <= budget_pages {
            return Plan {
                num_pages: n,
                head: 0..n,
                mid: n..n,
                tail: n..n,
                pick: 0,
            };
        }
        let recent = (always.recent_tokens.max(1) as usize).min(len);
        let tail_start = (len - recent) / ps;
        let head_end = (always.sink_tokens as usize).div_ceil(ps).min(tail_start);
        let forced = head_end + (n - tail_start);
        Plan {
            num_pages: n,
            head: 0..head_end,
            mid: head_end..tail_start,
            tail: tail_start..n,
            pick: budget_pages
                .saturating_sub(forced)
                .min(tail_start - head_end),
        }
    }

    /// The row: forced pages plus `chosen` (ids in `mid`, any order), ascending.
    pub(crate) fn assemble(&self, mut chosen: Vec<i32>) -> Vec<i32> {
        chosen.sort_unstable();
        let mut row = Vec::with_capacity(self.head.len() + chosen.len() + self.tail.len());
        row.extend(self.head.clone().map(|p| p as i32));
        row.extend(chosen);
        row.extend(self.tail.clone().map(|p| p as i32));
        row
    }
}

/// The ids `offset + i` of the `k` largest `scores[i]`, in no particular order. Ties go to the
/// lower id; NaN ranks below every number. The result depends only on the inputs. `scores`
/// is shorter than 2^32 (a row of pages or tokens of one sequence).
pub(crate) fn top_k(scores: &[f32], offset: usize, k: usize) -> Vec<i32> {
    let k = k.min(scores.len());
    if k == 0 {
        return Vec::new();
    }
    // One u64 a score, ascending in the wanted order: the score's rank in `f32::total_cmp`'s
    // order (NaN as negative infinity), inverted, above the id. The k least keys are the k
    // largest scores with ties to the lower id, compared without going back to `scores`.
    let mut keys: Vec<u64> = scores
        .iter()
        .enumerate()
        .map(|(i, &s)| (u64::from(!total_rank(s)) << 32) | i as u64)
        .collect();
    if k < keys.len() {
        keys.select_nth_unstable(k - 1);
        keys.truncate(k);
    }
    keys.into_iter()
        .map(|key| ((key & u64::from(u32::MAX)) as usize + offset) as i32)
        .collect()
}

/// `s`'s rank as a u32 that orders as `f32::total_cmp` does, NaN counted as negative infinity.
fn total_rank(s: f32) -> u32 {
    let bits = if s.is_nan() { f32::NEG_INFINITY } else { s }.to_bits();
    if bits >> 31 == 1 {
        !bits
    } else {
        bits | 1 << 31
    }
}

/// Budget in tokens → pages, rejecting budgets below one page.
pub(crate) fn budget_pages(budget_tokens: usize, page_size: usize) -> Result<usize, AlgoError> {
    if page_size == 0 {
        return Err(AlgoError::Config("page size 0".to_owned()));
    }
    if budget_tokens < page_size {
        return Err(AlgoError::Config(format!(
            "a budget of {budget_tokens} tokens is below one page of {page_size}"
        )));
    }
    Ok(budget_tokens / page_size)
}

/// One plan per sequence, checking that representations cover every page to be estimated.
pub(crate) fn plans(
    step: &Decode<'_>,
    pool: &RepPool,
    ps: usize,
    budget_pages: usize,
    always: AlwaysInclude,
) -> Result<Vec<Plan>, AlgoError> {
    step.seq_lens
        .iter()
        .zip(step.slots)
        .map(|(&len, &slot)| {
            let plan = Plan::new(len, ps, budget_pages, always);
            let built = pool.tokens(step.layer, slot)?;
            if plan.pick > 0 && built < plan.mid.end * ps {
                return Err(AlgoError::Invalid(format!(
                    "slot {slot}: representations cover {built} tokens, estimation needs {}",
                    plan.mid.end * ps
                )));
            }
            Ok(plan)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `top_k` against a full sort by (score descending in `total_cmp`'s order, NaN as negative
    /// infinity; id ascending), over rows full of ties, signed zeros, infinities and NaNs.
    #[test]
    fn top_k_takes_the_largest_with_ties_to_the_lower_id() {
        let values = [
            f32::NAN,
            f32::NEG_INFINITY,
            -1.5,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
            -f32::NAN,
        ];
        let mut next = crate::xorshift(0x2545_f491);
        for round in 0..300 {
            let n = 1 + round % 97;
            let scores: Vec<f32> = (0..n)
                .map(|_| values[next() as usize % values.len()])
                .collect();
            let key = |i: usize| {
                let s = scores[i];
                if s.is_nan() { f32::NEG_INFINITY } else { s }
            };
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
            for k in [0, 1, n / 2, n, n + 3] {
                let mut got = top_k(&scores, 7, k);
                got.sort_unstable();
                let mut want: Vec<i32> = order.iter().take(k).map(|&i| i as i32 + 7).collect();
                want.sort_unstable();
                assert_eq!(got, want, "round {round}, k {k}: {scores:?}");
            }
        }
    }
}
