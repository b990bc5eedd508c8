//! Attention parameters, batch metadata and selections, with their validation.

use crate::error::check_len;
use crate::{AttnError, KvLayout};

/// Parameters of one attention layer.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnParams {
    /// Query heads; a multiple of the KV heads (MHA: equal, GQA: a multiple, MQA: one KV head).
    pub q_heads: usize,
    /// Softmax scale applied to `q · k` (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding window: a query at position `p` sees keys at positions `> p - window` only.
    pub window: Option<u32>,
    /// With a window, the first `sink_tokens` positions stay visible anyway (StreamingLLM).
    pub sink_tokens: u32,
    /// Per query head, a learned sink logit that joins the softmax denominator with a zero value
    /// (gpt-oss style). When results are merged, give it to one part only.
    pub sink_logits: Option<Vec<f32>>,
    /// The widest SIMD build to use; the CPU's own support caps it.
    pub simd: Simd,
}

/// Which build of the inner loops runs. Builds round differently (fused multiply-adds, a
/// polynomial exp), so pinning one makes results reproducible across machines that have it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    /// Plain Rust, on every CPU.
    Portable,
    /// AVX2 + FMA + F16C where the CPU has them.
    Avx2,
    /// AVX-512F where the CPU has it.
    Avx512,
    /// For bf16 caches with a head dim that is a multiple of 32, where the CPU has AVX-512 BF16:
    /// bf16 dot products (`vdpbf16ps`, f32 accumulation) with the queries and the softmax
    /// weights rounded to bf16, as tensor cores round them: half the multiply-add
    /// instructions of [`Simd::Avx512`], at a bf16 rounding of those two operands (relative
    /// 2^-9), so it is never chosen by [`Simd::Auto`]. Whether that is faster depends on the
    /// CPU: on the Emerald Rapids Xeon we measured, `vdpbf16ps` issues at half the rate of
    /// an f32 multiply-add, so this build computes no faster than [`Simd::Avx512`]
    /// (BENCHMARKS.md). Other caches, and CPUs without it, run [`Simd::Avx512`] (or what the
    /// CPU has).
    Avx512Bf16,
    /// The widest of the f32-exact builds the CPU has (not [`Simd::Avx512Bf16`]).
    #[default]
    Auto,
}

impl AttnParams {
    /// Full causal attention with the usual `1 / sqrt(head_dim)` scale.
    pub fn new(q_heads: usize, head_dim: usize) -> Self {
        AttnParams {
            q_heads,
            scale: 1.0 / (head_dim.max(1) as f32).sqrt(),
            window: None,
            sink_tokens: 0,
            sink_logits: None,
            simd: Simd::Auto,
        }
    }

    pub(crate) fn validate(&self, layout: &KvLayout) -> Result<usize, AttnError> {
        if self.q_heads == 0
            || layout.kv_heads == 0
            || !self.q_heads.is_multiple_of(layout.kv_heads)
        {
            return Err(AttnError::Heads {
                q_heads: self.q_heads,
                kv_heads: layout.kv_heads,
            });
        }
        let row_bytes = [layout.head_dim, size_of::<f32>()]
            .into_iter()
            .try_fold(self.q_heads, usize::checked_mul);
        if row_bytes.is_none_or(|b| b > isize::MAX as usize) {
            return Err(AttnError::Invalid(format!(
                "{} query heads of {} elements overflow an output row",
                self.q_heads, layout.head_dim
            )));
        }
        if self.window == Some(0) {
            return Err(AttnError::Invalid(
                "a sliding window of 0 tokens".to_owned(),
            ));
        }
        if !self.scale.is_finite() {
            return Err(AttnError::Invalid(format!("softmax scale {}", self.scale)));
        }
        if let Some(s) = &self.sink_logits {
            check_len("sink_logits", s.len(), &[self.q_heads])?;
        }
        Ok(self.q_heads / layout.kv_heads)
    }

    /// Whether a key at position `pos` is visible from a query at position `p`.
    pub(crate) fn visible(&self, pos: i64, p: i64) -> bool {
        pos <= p
            && match self.window {
                None => true,
                Some(w) => pos > p - i64::from(w) || pos < i64::from(self.sink_tokens),
            }
    }
}

/// The three metadata arrays of a batch, as flat `i32` slices (the shared data contract).
#[derive(Clone, Copy, Debug)]
pub struct BatchMeta<'a> {
    /// `[num_seqs + 1]` prefix sums of query lengths, starting at 0.
    pub cu_seqlens_q: &'a [i32],
    /// `[num_seqs]` KV length of each sequence, the queries' own tokens included.
    pub seq_lens_kv: &'a [i32],
    /// `[num_seqs * max_blocks]` logical-to-physical block map, padded with -1.
    pub block_table: &'a [i32],
    /// Columns of `block_table`.
    pub max_blocks: usize,
}

/// One validated sequence of a batch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seq<'a> {
    pub(crate) q_start: usize,
    pub(crate) q_len: usize,
    pub(crate) kv_len: usize,
    pub(crate) blocks: &'a [i32],
}

impl Seq<'_> {
    /// Absolute position of query `i` of the sequence.
    pub(crate) fn position(&self, i: usize) -> i64 {
        (self.kv_len - self.q_len + i) as i64
    }

    /// Physical slot of logical position `pos` (validated in range).
    pub(crate) fn slot(&self, pos: usize, block_size: usize) -> usize {
        self.blocks[pos / block_size] as usize * block_size + pos % block_size
    }
}

impl<'a> BatchMeta<'a> {
    /// Checks every array against the others and the KV layout, and returns the sequences.
    pub(crate) fn validate(&self, layout: &KvLayout) -> Result<Vec<Seq<'a>>, AttnError> {
        let bad = |m: String| Err(AttnError::Metadata(m));
        let n = self.seq_lens_kv.len();
        if self.cu_seqlens_q.len() != n + 1 {
            return bad(format!(
                "cu_seqlens_q has {} entries for {n} sequences (needs {})",
                self.cu_seqlens_q.len(),
                n + 1
            ));
        }
        if self.cu_seqlens_q[0] != 0 {
            return bad("cu_seqlens_q must start at 0".to_owned());
        }
        let expected = n.checked_mul(self.max_blocks).ok_or_else(|| {
            AttnError::Metadata(format!(
                "{n} sequences x {} blocks overflow",
                self.max_blocks
            ))
        })?;
        if self.block_table.len() != expected {
            return Err(AttnError::Length {
                what: "block_table",
                expected,
                got: self.block_table.len(),
            });
        }
        let mut seqs = Vec::with_capacity(n);
        for s in 0..n {
            let (a, b) = (self.cu_seqlens_q[s], self.cu_seqlens_q[s + 1]);
            let kv = self.seq_lens_kv[s];
            if b < a {
                return bad(format!("cu_seqlens_q decreases at sequence {s}"));
            }
            if kv < 0 || kv < b - a {
                return bad(format!(
                    "sequence {s}: KV length {kv} is shorter than its {} queries",
                    b - a
                ));
            }
            let (kv, q_len) = (kv as usize, (b - a) as usize);
            let need = kv.div_ceil(layout.block_size);
            if need > self.max_blocks {
                return bad(format!(
                    "sequence {s}: {kv} tokens need {need} blocks, the table has {}",
                    self.max_blocks
                ));
            }
            let blocks = &self.block_table[s * self.max_blocks..s * self.max_blocks + need];
            if let Some(&block) = blocks
                .iter()
                .find(|&&b| b < 0 || b as usize >= layout.num_blocks)
            {
                return Err(AttnError::BlockOutOfRange {
                    seq: s,
                    block,
                    num_blocks: layout.num_blocks,
                });
            }
            seqs.push(Seq {
                q_start: a as usize,
                q_len,
                kv_len: kv,
                blocks,
            });
        }
        Ok(seqs)
    }

    /// Total queries of the batch (the last prefix sum).
    pub(crate) fn total_q(&self) -> usize {
        self.cu_seqlens_q.last().map_or(0, |&t| t.max(0) as usize)
    }
}

/// Per (sequence, KV head) lists of ids in the shared selection format: `ids` is
/// `[num_seqs, kv_heads, max_len]` padded with -1, `lens` is `[num_seqs, kv_heads]`.
#[derive(Clone, Copy, Debug)]
pub struct Selection<'a> {
    /// The ids, row-major `[num_seqs, kv_heads, max_len]`.
    pub ids: &'a [i32],
    /// Valid ids per row, `[num_seqs, kv_heads]`.
    pub lens: &'a [i32],
    /// Row width of `ids`.
    pub max_len: usize,
}

impl<'a> Selection<'a> {
    /// Checks that the selection has `rows` rows and every length lies in `0..=max_len`.
    pub(crate) fn check_shape(&self, rows: usize) -> Result<(), AttnError> {
        check_len("selection lens", self.lens.len(), &[rows])?;
        check_len("selection ids", self.ids.len(), &[rows, self.max_len])?;
        if let Some((r, &len)) = self
            .lens
            .iter()
            .enumerate()
            .find(|&(_, &l)| l < 0 || l as usize > self.max_len)
        {
            return Err(AttnError::Metadata(format!(
                "selection row {r}: length {len} outside 0..={}",
                self.max_len
            )));
        }
        Ok(())
    }

    /// The valid ids of row (seq, head); checks shapes and that every id is in `0..limit(seq)`.
    pub(crate) fn rows(
        &self,
        num_seqs: usize,
        kv_heads: usize,
        what: &'static str,
        limit: impl Fn(usize) -> usize,
    ) -> Result<Vec<&'a [i32]>, AttnError> {
        let rows = num_seqs.saturating_mul(kv_heads);
        self.check_shape(rows)?;
        let mut out = Vec::with_capacity(rows);
        for r in 0..rows {
            let len = self.lens[r] as usize;
            let row = &self.ids[r * self.max_len..r * self.max_len + len];
            let lim = limit(r / kv_heads);
            if let Some(&bad) = row.iter().find(|&&i| i < 0 || i as usize >= lim) {
                return Err(AttnError::IndexOutOfRange {
                    what,
                    index: i64::from(bad),
                    limit: lim as i64,
                });
            }
            out.push(row);
        }
        Ok(out)
    }
}
