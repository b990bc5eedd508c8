//! The selections a launch writes on the device, and the scratch the selecting kernels reuse.

use attn_op::cuda::{DeviceSelection, Gpu, Published};
use cudarc::driver::CudaSlice;

use crate::{AlgoError, Dsa, Quest, StreamingLlm};

/// The output of [`SelectKernels::quest_topk`](super::SelectKernels::quest_topk) and the scratch it
/// reuses, allocated once for a batch shape and rewritten whole by every launch.
pub struct DeviceTopK {
    /// The selected pages per output row, ascending, -1 padded: rows are (sequence, KV head),
    /// or one per sequence for a head-shared selection made with `per_sequence`.
    pub sel: DeviceSelection,
    /// `[rows]` tokens each row's pages cover (the current, partial page counts its valid
    /// tokens): the KV length of attention over the selected pages gathered in order.
    pub covered: CudaSlice<i32>,
    /// Output rows per selection row (a shared selection written once per KV head, or once).
    pub(super) copies: usize,
    /// One selection row per sequence (shared by its KV heads), else one per (sequence, head).
    pub(super) shared: bool,
    /// `[selection rows, score_stride]` ordered score keys, zero between launches unless
    /// `keys_left`.
    pub(super) scores: CudaSlice<u32>,
    /// The last selection left its keys in `scores` (its scoring kernel stored every key, so
    /// `pick_rows` did not zero them); a scoring kernel that merges by atomicMax needs them
    /// zeroed first.
    pub(super) keys_left: bool,
    pub(super) score_stride: usize,
    /// Selection rows (sequences, or (sequence, KV head) pairs).
    pub(super) sel_rows: usize,
    /// `[selection rows]` flags `pick_rows` sets to the step's value (`epoch`) as it publishes
    /// each row (see [`SelectKernels::set_publish`](super::SelectKernels::set_publish)).
    pub(super) ready: CudaSlice<u32>,
    /// `[1]` the step's value, which each publishing scoring launch advances on the device.
    pub(super) epoch: CudaSlice<u32>,
    /// `[selection rows * copies, width]` a published row's ids, each with the step's value in
    /// its high half, stored by `pick_rows_tagged` as each id is final (kernels/pdl.cuh, tagged
    /// rows).
    pub(super) tags: CudaSlice<u64>,
    /// Whether the last selection was published through `ready` (see [`Self::published`]).
    pub(super) published: bool,
    /// Whether the last published selection also tagged its ids in `tags` (its rows few
    /// enough for the page walk, attn_op's `page_walk_rows_fit`).
    pub(super) tagged: bool,
}

impl DeviceTopK {
    /// Buffers for Quest selections of `num_seqs` sequences of up to `max_tokens` tokens with
    /// `kv_heads` KV heads. A head-shared Quest ([`QuestConfig::shared_heads`]) writes its
    /// selection once per sequence when `per_sequence` (the rows a hot-buffer diff takes), else
    /// once per KV head (the rows attention takes); a per-head Quest needs `per_sequence` false.
    ///
    /// [`QuestConfig::shared_heads`]: crate::QuestConfig::shared_heads
    pub fn new(
        gpu: &Gpu,
        quest: &Quest,
        num_seqs: usize,
        kv_heads: usize,
        max_tokens: usize,
        per_sequence: bool,
    ) -> Result<Self, AlgoError> {
        let shared = quest.config().shared_heads;
        if per_sequence && !shared {
            return Err(AlgoError::Config(
                "one row per sequence needs a head-shared Quest".to_owned(),
            ));
        }
        let stride = max_tokens.div_ceil(quest.config().page_size).max(1);
        let rows = Rows {
            num_seqs,
            kv_heads,
            shared,
            per_sequence,
        };
        Self::alloc(gpu, rows, quest.row_width(), stride)
    }

    /// Buffers for StreamingLLM's rows of `num_seqs` sequences with `kv_heads` KV heads: once
    /// per sequence when `per_sequence`, else once per KV head (every head keeps the same
    /// pages).
    pub fn streaming(
        gpu: &Gpu,
        streaming: &StreamingLlm,
        num_seqs: usize,
        kv_heads: usize,
        per_sequence: bool,
    ) -> Result<Self, AlgoError> {
        let rows = Rows::head_shared(num_seqs, kv_heads, per_sequence);
        // No scores: the rows are forced pages only.
        Self::alloc(gpu, rows, streaming.row_width(), 0)
    }

    /// Buffers for DSA token selections of `num_seqs` sequences of up to `max_tokens` tokens
    /// with `kv_heads` KV heads: once per sequence when `per_sequence`, else once per KV head
    /// (every head gets the same tokens).
    pub fn dsa(
        gpu: &Gpu,
        dsa: &Dsa,
        num_seqs: usize,
        kv_heads: usize,
        max_tokens: usize,
        per_sequence: bool,
    ) -> Result<Self, AlgoError> {
        let rows = Rows::head_shared(num_seqs, kv_heads, per_sequence);
        Self::alloc(gpu, rows, dsa.row_width(), max_tokens.max(1))
    }

    /// Zeroed buffers: `rows`' selection rows of `width` ids and `stride` score keys each.
    fn alloc(gpu: &Gpu, rows: Rows, width: usize, stride: usize) -> Result<Self, AlgoError> {
        let sel_rows = if rows.shared {
            rows.num_seqs
        } else {
            rows.num_seqs * rows.kv_heads
        };
        let copies = if !rows.shared || rows.per_sequence {
            1
        } else {
            rows.kv_heads
        };
        let out_rows = sel_rows * copies;
        Ok(DeviceTopK {
            sel: DeviceSelection::from_device(
                gpu.zeros(out_rows * width)?,
                gpu.zeros(out_rows)?,
                width,
            )?,
            covered: gpu.zeros(out_rows)?,
            copies,
            shared: rows.shared,
            scores: gpu.zeros((sel_rows * stride).max(1))?,
            keys_left: false,
            score_stride: stride,
            sel_rows,
            ready: gpu.zeros(sel_rows.max(1))?,
            epoch: gpu.zeros(1)?,
            tags: gpu.zeros(out_rows * width)?,
            published: false,
            tagged: false,
        })
    }

    /// The flags through which the last
    /// [`SelectKernels::quest_topk`](super::SelectKernels::quest_topk) published its rows
    /// ([`SelectKernels::set_publish`](super::SelectKernels::set_publish)): what
    /// [`Gpu::sparse_page_attention_published`] takes to start before the top-k ends. `None` where
    /// the last selection was not published.
    pub fn published(&self) -> Option<Published<'_>> {
        self.published.then_some(Published {
            flags: &self.ready,
            epoch: &self.epoch,
            rows_per_flag: self.copies,
            tags: self.tagged.then_some(&self.tags),
        })
    }

    /// Checks that these buffers were made for `sel_rows` selection rows of `width`, shared or
    /// not, and, where `scored` is `Some((max_len, ps))`, with room for the score keys of
    /// sequences of `max_len` tokens in pages of `ps` tokens.
    pub(super) fn check(
        &self,
        sel_rows: usize,
        shared: bool,
        width: usize,
        scored: Option<(usize, usize)>,
    ) -> Result<(), AlgoError> {
        if self.sel_rows != sel_rows
            || self.shared != shared
            || self.sel.rows != sel_rows * self.copies
            || self.sel.max_len != width
        {
            return Err(AlgoError::Invalid(format!(
                "top-k buffers of {} rows of {} for {sel_rows} selection rows of {width}",
                self.sel.rows, self.sel.max_len
            )));
        }
        if let Some((max_len, ps)) = scored
            && max_len.div_ceil(ps) > self.score_stride
        {
            return Err(AlgoError::Invalid(format!(
                "sequences of {max_len} tokens; the top-k buffers were made for {}",
                self.score_stride * ps
            )));
        }
        Ok(())
    }
}

/// The shape of a [`DeviceTopK`]'s rows.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rows {
    pub(super) num_seqs: usize,
    pub(super) kv_heads: usize,
    pub(super) shared: bool,
    pub(super) per_sequence: bool,
}

impl Rows {
    /// One selection per sequence, shared by its KV heads.
    fn head_shared(num_seqs: usize, kv_heads: usize, per_sequence: bool) -> Rows {
        Rows {
            num_seqs,
            kv_heads,
            shared: true,
            per_sequence,
        }
    }
}
