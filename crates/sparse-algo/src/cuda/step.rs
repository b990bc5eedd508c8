//! [`SelectKernels`]' work on a step: the min/max kept up to date, and Quest's, StreamingLLM's
//! and the DSA indexer's rows selected.

use attn_op::cuda::{CudaElement, DeviceBatch, DevicePagedKv};
use attn_op::{DType, KvCache};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{
    DSA_THREADS, DeviceRepPool, DeviceTopK, DsaArgs, Inputs, QuestScoring, Rule, SEL_THREADS,
    SelectKernels, TC_GROUP, device_err, ints_ok, to_i32, to_u32, type_index,
};
use crate::{AlgoError, AlwaysInclude, Dsa, Quest, RepShape, StreamingLlm, Summary};

impl SelectKernels {
    /// Brings the min/max pages of `layer` up to date for the batch `meta` over the keys in
    /// `kv`: sequence `s` (pool slot `slots[s]`) added its last `q_len` tokens this step, so the
    /// pages holding them are recomputed (all of them after a prefill, the current page after a
    /// decode step), as [`Quest::update_representations`] does from the slot's previous length.
    /// A slot outside the pool leaves its sequence untouched.
    ///
    /// [`Quest::update_representations`]: crate::SparseAlgorithm::update_representations
    pub fn update_minmax<T: CudaElement>(
        &self,
        quest: &Quest,
        kv: &DevicePagedKv<T>,
        meta: &DeviceBatch,
        layer: usize,
        slots: &CudaSlice<i32>,
        pool: &mut DeviceRepPool<T>,
    ) -> Result<(), AlgoError> {
        let layout = kv.layout();
        if meta.layout() != &layout {
            return Err(AlgoError::Invalid(format!(
                "the batch was validated against {:?}, the keys are {layout:?}",
                meta.layout()
            )));
        }
        let (kvh, d) = self.check_quest_pool(quest, meta, layer, slots, pool)?;
        let ps = quest.config().page_size;
        let vec = 16 / size_of::<T>();
        // An E4M3 row's threads find its scale by shuffles within one warp.
        if pool.e4m3.is_some() && !32usize.is_multiple_of(d / vec) {
            return Err(AlgoError::Invalid(format!(
                "E4M3 summaries on the device take head dims whose {vec}-element vectors \
                 divide 32, not {d}"
            )));
        }
        let items = meta
            .kv_lens()
            .iter()
            .zip(meta.q_lens())
            .map(|(&len, &q)| (len.div_ceil(ps) - (len - q.min(len)) / ps) * kvh * (d / vec))
            .max()
            .unwrap_or(0);
        if items == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (
                to_u32(items.div_ceil(SEL_THREADS))?,
                to_u32(meta.num_seqs())?,
                1,
            ),
            block_dim: (to_u32(SEL_THREADS)?, 1, 1),
            shared_mem_bytes: 0,
        };
        let ints = [
            layout.num_blocks,
            layout.block_size,
            kvh,
            d,
            meta.max_blocks(),
            layer,
            pool.slots,
            pool.max_pages,
            ps,
        ]
        .map(to_i32);
        let ints = ints_ok(ints)?;
        let mut b = self.stream.launch_builder(&self.quest[type_index::<T>()].0);
        b.arg(kv.k())
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(meta.block_table())
            .arg(&ints[4])
            .arg(meta.cu_seqlens_q())
            .arg(meta.seq_lens_kv())
            .arg(slots)
            .arg(&mut pool.data)
            .arg(&ints[5])
            .arg(&ints[6])
            .arg(&ints[7])
            .arg(&ints[8]);
        // Null pointers (which the kernel never dereferences) for a pool of T values.
        let none: u64 = 0;
        match &mut pool.e4m3 {
            Some((codes, exps)) => b.arg(codes).arg(exps),
            None => b.arg(&none).arg(&none),
        };
        // SAFETY: the arguments follow `quest_minmax_*` in kernels/select.cu; the batch was
        // validated against the keys' layout (block ids are range-checked in the kernel), the
        // pool holds `[layers, slots, max_pages, kv_heads, 2 d]` with every sequence's pages
        // within max_pages (checked above), slots are range-checked in the kernel, and d is a
        // multiple of the 16-byte vector; an E4M3 pool's codes have the same shape and its
        // exponents one per (page, head), and a row's vectors divide a warp (checked above).
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        Ok(())
    }

    /// Quest's decode selection for the batch `meta` (one query row per sequence; the last
    /// row of each sequence's queries is used), from `q` (`[total_q, q_heads, head_dim]`, the
    /// tensor attention reads) and the min/max pages of `layer`, written into `out` as
    /// [`Quest::retrieve_topk`] answers for the same inputs (rows equal, padding -1). Two
    /// launches: the estimate (scores of every mid page, as [`quest_scoring`](Self::quest_scoring)
    /// says), then the top-k of each row.
    ///
    /// [`Quest::retrieve_topk`]: crate::SparseAlgorithm::retrieve_topk
    #[allow(
        clippy::too_many_arguments,
        reason = "the CPU entry point's inputs, as device buffers"
    )]
    pub fn quest_topk<T: CudaElement>(
        &self,
        quest: &Quest,
        q: &CudaSlice<T>,
        q_heads: usize,
        meta: &DeviceBatch,
        layer: usize,
        slots: &CudaSlice<i32>,
        pool: &DeviceRepPool<T>,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let (kvh, d) = self.check_quest_pool(quest, meta, layer, slots, pool)?;
        if q_heads == 0 || !q_heads.is_multiple_of(kvh) {
            return Err(AlgoError::Invalid(format!(
                "{q_heads} query heads over {kvh} KV heads"
            )));
        }
        let n = meta.num_seqs();
        crate::error::check_len("q", q.len(), &[meta.total_q(), q_heads, d])?;
        if let Some(s) = meta.q_lens().iter().position(|&l| l == 0) {
            return Err(AlgoError::Invalid(format!("sequence {s} has no query")));
        }
        let c = quest.config();
        let sel_rows = if c.shared_heads { n } else { n * kvh };
        out.check(
            sel_rows,
            c.shared_heads,
            quest.row_width(),
            Some((meta.max_kv_len(), c.page_size)),
        )?;
        // Rows published only by this launch's scoring and pick_rows (none where nothing
        // runs).
        out.published = false;
        if n == 0 {
            return Ok(());
        }
        let inputs = Inputs {
            quest,
            q,
            q_heads,
            meta,
            layer,
            slots,
            pool,
            publish: self.publish,
        };
        let tc = match (pool.summary(), self.scoring) {
            (Summary::E4m3, _) => {
                Some(self.tc_kernel::<T>(q_heads / kvh, d, true).ok_or_else(|| {
                    AlgoError::Invalid(format!(
                        "E4M3 summaries are scored on tensor cores only: f16 or bf16 queries \
                         of head dim 64 or 128, at most {TC_GROUP} per KV head (not {} of \
                         dim {d})",
                        q_heads / kvh
                    ))
                })?)
            }
            (Summary::Exact, QuestScoring::TensorCores) => {
                self.tc_kernel::<T>(q_heads / kvh, d, false)
            }
            (Summary::Exact, QuestScoring::Exact) => None,
        };
        // The tensor-core kernel stores every key of a per-head row; the others merge by
        // atomicMax into zeroed keys.
        let stores_keys = tc.is_some() && !c.shared_heads;
        if !stores_keys && out.keys_left {
            self.stream
                .memset_zeros(&mut out.scores)
                .map_err(device_err)?;
            out.keys_left = false;
        }
        let tc = match (tc, pool.summary()) {
            (Some(_), summary) if self.trace && T::DTYPE == DType::BF16 && d == 128 => {
                Some(match summary {
                    Summary::Exact => &self.traced.0,
                    Summary::E4m3 => &self.traced.2,
                })
            }
            (other, _) => other,
        };
        match tc {
            Some(f) => self.launch_score_tc(f, &inputs, out)?,
            None => self.launch_score(&inputs, out)?,
        }
        let rule = Rule {
            page_size: c.page_size,
            budget_pages: quest.budget_pages(),
            always: c.always,
        };
        self.launch_pick(
            meta,
            Some((slots, pool.slots)),
            rule,
            stores_keys,
            self.publish,
            out,
        )
    }

    /// StreamingLLM's decode selection for the batch `meta`, written into `out` as
    /// [`StreamingLlm::retrieve_topk`] answers (rows equal, padding -1): the sink and window
    /// pages of every sequence, through the selecting kernel with nothing to score.
    ///
    /// [`StreamingLlm::retrieve_topk`]: crate::SparseAlgorithm::retrieve_topk
    pub fn streaming_topk(
        &self,
        streaming: &StreamingLlm,
        meta: &DeviceBatch,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let c = streaming.config();
        out.check(meta.num_seqs(), true, streaming.row_width(), None)?;
        if meta.num_seqs() == 0 {
            return Ok(());
        }
        let rule = Rule {
            page_size: c.page_size,
            budget_pages: 0,
            always: AlwaysInclude {
                sink_tokens: c.sink_tokens,
                recent_tokens: c.window_tokens,
            },
        };
        // Nothing scored advances the step's value: these rows are never published.
        self.launch_pick(meta, None, rule, false, false, out)
    }

    /// DSA's decode selection with a trained indexer for the batch `meta`, written into `out`
    /// as [`Dsa::retrieve_topk`] answers for the same inputs (rows equal, padding -1). `q` is
    /// `[num_seqs, heads, dim]` indexer queries and `weights` `[num_seqs, heads]` their head
    /// weights (what [`Indexer::queries`] writes), and `pool` holds the indexer keys of
    /// `layer` (see [`DeviceRepPool::data_mut`]); the caller keeps every sequence's keys
    /// written up to its length. Two launches: the scores of every mid token, then the top-k.
    ///
    /// [`Dsa::retrieve_topk`]: crate::SparseAlgorithm::retrieve_topk
    /// [`Indexer::queries`]: crate::Indexer::queries
    #[allow(
        clippy::too_many_arguments,
        reason = "the CPU entry point's inputs, as device buffers"
    )]
    pub fn dsa_topk<T: CudaElement>(
        &self,
        dsa: &Dsa,
        q: &CudaSlice<f32>,
        weights: &CudaSlice<f32>,
        meta: &DeviceBatch,
        layer: usize,
        slots: &CudaSlice<i32>,
        pool: &DeviceRepPool<T>,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let Some(ix) = dsa.indexer() else {
            return Err(AlgoError::Config(
                "the device DSA needs a trained indexer; the fallback reads every key".to_owned(),
            ));
        };
        let (heads, dim) = (ix.heads(), ix.dim());
        let want = RepShape {
            page_size: 1,
            heads: 1,
            width: dim,
        };
        self.check_pool(want, dim, meta, layer, slots, pool)?;
        let n = meta.num_seqs();
        crate::error::check_len("indexer queries", q.len(), &[n, heads, dim])?;
        crate::error::check_len("indexer weights", weights.len(), &[n, heads])?;
        let c = dsa.config();
        out.check(n, true, dsa.row_width(), Some((meta.max_kv_len(), 1)))?;
        if n == 0 {
            return Ok(());
        }
        let tile_at = ((heads * dim + heads) * size_of::<f32>()).div_ceil(16) * 16;
        let smem = tile_at + DSA_THREADS * (dim * size_of::<T>() + 16);
        if smem > self.dsa_smem_max {
            return Err(AlgoError::Invalid(format!(
                "an indexer of {heads} heads of {dim} needs {smem} bytes of shared memory; the \
                 device offers {}",
                self.dsa_smem_max
            )));
        }
        let args = DsaArgs {
            heads: to_i32(heads)?,
            dim: to_i32(dim)?,
            layer: to_i32(layer)?,
            num_slots: to_i32(pool.slots)?,
            max_tokens: to_i32(pool.max_pages)?,
            topk: to_i32(c.topk)?,
            sink_tokens: to_i32(c.always.sink_tokens as usize)?,
            recent_tokens: to_i32(c.always.recent_tokens as usize)?,
            score_stride: to_i32(out.score_stride)?,
        };
        let cfg = LaunchConfig {
            grid_dim: (
                to_u32(meta.max_kv_len().div_ceil(DSA_THREADS).max(1))?,
                to_u32(n)?,
                1,
            ),
            block_dim: (to_u32(DSA_THREADS)?, 1, 1),
            shared_mem_bytes: to_u32(smem)?,
        };
        let mut b = self.stream.launch_builder(&self.dsa[type_index::<T>()]);
        b.arg(q)
            .arg(weights)
            .arg(&pool.data)
            .arg(slots)
            .arg(meta.seq_lens_kv())
            .arg(&args)
            .arg(&mut out.scores);
        // SAFETY: the arguments follow `dsa_score_*` in kernels/select.cu; q and weights hold
        // num_seqs * heads * dim and num_seqs * heads floats (checked above); the pool is
        // `[layers, slots, max_tokens, dim]` with every sequence within max_tokens (checked);
        // scores hold score_stride >= max_kv_len keys per sequence (checked by out.check), and
        // the kernel writes mid tokens below it only; the dynamic shared memory holds the
        // queries, weights and a tile of DSA_THREADS padded key rows (within the limit set at
        // load); dim is a multiple of 16 elements, so rows are 16-byte aligned; slots are
        // range-checked in the kernel.
        unsafe { b.launch(cfg) }.map_err(device_err)?;
        let rule = Rule {
            page_size: 1,
            budget_pages: c.topk,
            always: c.always,
        };
        // `dsa_score_*` stores every mid token's key; the rows are never published (token
        // attention takes no flags).
        self.launch_pick(meta, Some((slots, pool.slots)), rule, true, false, out)
    }
}
