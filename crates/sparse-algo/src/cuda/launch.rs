//! [`SelectKernels`]' launches: the scoring kernels, `pick_rows`, and the checks of the pools
//! they read.

use attn_op::DType;
use attn_op::cuda::{CudaElement, DeviceBatch, Launch, page_walk_rows_fit};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::{
    DeviceRepPool, DeviceTopK, Inputs, PICK_HIST_BYTES, PICK_THREADS, Rule, SCORE_THREADS,
    ScoreArgs, SelectKernels, TC_GROUP, TC_PAGES, TC_WARPS, TILE_BYTES, device_err, ints_ok,
    to_i32, to_u32, type_index,
};
use crate::{AlgoError, Quest, RepShape, minmax};

impl SelectKernels {
    /// The estimate: `quest_score_*` over every (selection row, head, tile of mid pages).
    pub(super) fn launch_score<T: CudaElement>(
        &self,
        inputs: &Inputs<'_, T>,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let Inputs {
            quest,
            q_heads,
            meta,
            ..
        } = *inputs;
        let c = quest.config();
        let (kvh, d) = (meta.layout().kv_heads, meta.layout().head_dim);
        let g = q_heads / kvh;
        let heads = if c.shared_heads { kvh } else { 1 };
        // Threads per page: the fewest that keep a tile of SCORE_THREADS / tpp rows within
        // TILE_BYTES.
        let row_bytes = 2 * d * size_of::<T>();
        let mut tpp = 1;
        while tpp < SCORE_THREADS && SCORE_THREADS / tpp * row_bytes > TILE_BYTES {
            tpp *= 2;
        }
        let tile_pages = SCORE_THREADS / tpp;
        let smem = g * d * (size_of::<f32>() + size_of::<T>()) + 2 * tile_pages * (row_bytes + 16);
        if smem > self.score_smem_max {
            return Err(AlgoError::Invalid(format!(
                "a group of {g} query heads of {d} needs {smem} bytes of shared memory; the \
                 device offers {}",
                self.score_smem_max
            )));
        }
        let tiles = meta
            .max_kv_len()
            .div_ceil(c.page_size)
            .div_ceil(tile_pages)
            .max(1);
        let items = out.sel_rows * heads * tiles;
        // As many CTAs as the device holds at once, each taking a run of consecutive items.
        let func = &self.quest[type_index::<T>()].1;
        let per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(to_u32(SCORE_THREADS)?, smem, None)
            .map_err(device_err)?;
        let resident = (self.sms * per_sm as usize).max(1);
        let per_cta = items.div_ceil(resident);
        let ctas = items.div_ceil(per_cta);
        let (items, per_cta) = (to_i32(items)?, to_i32(per_cta)?);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(ctas)?, 1, 1),
            block_dim: (to_u32(SCORE_THREADS)?, 1, 1),
            shared_mem_bytes: to_u32(smem)?,
        };
        self.launch_scores(func, inputs, out, (tpp, tiles), (items, per_cta), cfg)
    }

    /// The tensor-core scoring kernel for `T`, a group of `g` query heads and head dim `d`, if
    /// it takes that shape.
    pub(super) fn tc_kernel<T: CudaElement>(
        &self,
        g: usize,
        d: usize,
        e4m3: bool,
    ) -> Option<&CudaFunction> {
        let table = if e4m3 {
            &self.quest_tc8
        } else {
            &self.quest_tc
        };
        let by_type = match T::DTYPE {
            DType::F32 => return None,
            DType::F16 => &table[0],
            DType::BF16 => &table[1],
        };
        if g > TC_GROUP {
            return None;
        }
        match d {
            64 => Some(&by_type[0]),
            128 => Some(&by_type[1]),
            _ => None,
        }
    }

    /// The estimate on tensor cores: `quest_score_tc_*` (function `func`) over every (selection
    /// row, head, tile of 16 mid pages), each warp taking a run of consecutive items.
    pub(super) fn launch_score_tc<T: CudaElement>(
        &self,
        func: &CudaFunction,
        inputs: &Inputs<'_, T>,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let Inputs { quest, meta, .. } = *inputs;
        let c = quest.config();
        let kvh = meta.layout().kv_heads;
        let heads = if c.shared_heads { kvh } else { 1 };
        let tiles = meta
            .max_kv_len()
            .div_ceil(c.page_size)
            .min(out.score_stride)
            .div_ceil(TC_PAGES)
            .max(1);
        let items = out.sel_rows * heads * tiles;
        let per_warp = items.div_ceil(self.tc_resident_warps);
        let ctas = items.div_ceil(per_warp).div_ceil(TC_WARPS);
        let (items, per_warp) = (to_i32(items)?, to_i32(per_warp)?);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(ctas)?, 1, 1),
            block_dim: (to_u32(TC_WARPS * 32)?, 1, 1),
            shared_mem_bytes: 0,
        };
        // tpp is unused there: a warp scores whole pages.
        self.launch_scores(func, inputs, out, (1, tiles), (items, per_warp), cfg)
    }

    /// Launches a Quest scoring kernel (`func`: `quest_score_*` or `quest_score_tc_*`, one
    /// signature) with `tpp` threads per page and `tiles` tiles per (row, head), each CTA
    /// (`quest_score_*`) or warp (`quest_score_tc_*`) taking `per` of the `items`.
    pub(super) fn launch_scores<T: CudaElement>(
        &self,
        func: &CudaFunction,
        inputs: &Inputs<'_, T>,
        out: &mut DeviceTopK,
        (tpp, tiles): (usize, usize),
        (items, per): (i32, i32),
        cfg: LaunchConfig,
    ) -> Result<(), AlgoError> {
        let (quest, meta, pool) = (inputs.quest, inputs.meta, inputs.pool);
        let c = quest.config();
        let args = ScoreArgs {
            q_heads: to_i32(inputs.q_heads)?,
            layer: to_i32(inputs.layer)?,
            num_slots: to_i32(pool.slots)?,
            max_pages: to_i32(pool.max_pages)?,
            kvh: to_i32(meta.layout().kv_heads)?,
            d: to_i32(meta.layout().head_dim)?,
            ps: to_i32(c.page_size)?,
            budget: to_i32(quest.budget_pages())?,
            sink_tokens: to_i32(c.always.sink_tokens as usize)?,
            recent_tokens: to_i32(c.always.recent_tokens as usize)?,
            shared: i32::from(c.shared_heads),
            tpp: to_i32(tpp)?,
            score_stride: to_i32(out.score_stride)?,
            tiles: to_i32(tiles)?,
        };
        let mut b = Launch::new(&self.stream, func);
        b.dependent(self.dependent);
        b.arg(inputs.q).arg(meta.cu_seqlens_q());
        match &pool.e4m3 {
            Some((codes, _)) => b.arg(codes),
            None => b.arg(&pool.data),
        };
        b.arg(inputs.slots)
            .arg(meta.seq_lens_kv())
            .arg(&args)
            .arg(&items)
            .arg(&per)
            .arg(&mut out.scores);
        // The step's value where the rows are published, else a null pointer, which the
        // kernels never read.
        let no_epoch: u64 = 0;
        if inputs.publish {
            b.arg(&mut out.epoch);
        } else {
            b.arg(&no_epoch);
        }
        // `quest_score_tc8_*`'s last argument: the scale exponents.
        if let Some((_, exps)) = &pool.e4m3 {
            b.arg(exps);
        }
        // SAFETY: the arguments follow `quest_score_*` and `quest_score_tc_*` in
        // kernels/select.cu (the latter compiled for this element type and head dim, with at
        // most 8 heads per group: `tc_kernel`); q holds total_q * q_heads * d elements and
        // every sequence has a query row; the pool's shape and extent were checked against the
        // batch, and the kernels read only pages below a row's mid end; scores hold
        // score_stride keys per selection row and the kernels write below min(mid,
        // score_stride); the callers sized the dynamic shared memory of `quest_score_*` for the
        // group's g d queries, their g d element-sized masks and two tiles of SCORE_THREADS /
        // tpp padded rows (within the limit set at load); slots are range-checked in the
        // kernels; the epoch, where given, holds one value; an E4M3 pool (which only
        // `quest_score_tc8_*` is given, with its exponents last) holds a code per value and an
        // exponent per (page, head).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The rows: `pick_rows`, one CTA per selection row, selecting `rule`'s pick from the score
    /// keys (none with a budget of 0) of sequences whose slot, where `slots` is given with the
    /// pool's slot count, is valid. With `keys_stored` (the scoring kernel wrote every key a row
    /// reads), the keys are left as they are; else they are zeroed for the next launch. With
    /// `publish` (the scoring just launched advanced the step's value), each row's flag is set to
    /// that value once the row is written, and where the rows are few enough for the page walk each
    /// id is also stored tagged with the value as it is final. With a budget, the launch right
    /// before must be the rows' scoring kernel: the rows' plan (forced pages, padding, lengths) is
    /// written before the kernel waits for it (kernels/select.cu, `pick_body`).
    #[allow(
        clippy::too_many_arguments,
        reason = "the rows' inputs and how the launch treats its keys and flags"
    )]
    pub(super) fn launch_pick(
        &self,
        meta: &DeviceBatch,
        slots: Option<(&CudaSlice<i32>, usize)>,
        rule: Rule,
        keys_stored: bool,
        publish: bool,
        out: &mut DeviceTopK,
    ) -> Result<(), AlgoError> {
        let kvh = meta.layout().kv_heads;
        let keys = out.score_stride * size_of::<u32>();
        let keys_smem = PICK_HIST_BYTES + keys <= self.pick_smem_max;
        let cfg = LaunchConfig {
            grid_dim: (to_u32(out.sel_rows)?, 1, 1),
            block_dim: (to_u32(PICK_THREADS)?, 1, 1),
            shared_mem_bytes: to_u32(PICK_HIST_BYTES + if keys_smem { keys } else { 0 })?,
        };
        let ints = [
            slots.map_or(0, |(_, n)| n),
            kvh,
            rule.page_size,
            rule.budget_pages,
            rule.always.sink_tokens as usize,
            rule.always.recent_tokens as usize,
            usize::from(out.shared),
            out.score_stride,
            usize::from(keys_smem),
            out.sel.max_len,
            out.copies,
            usize::from(!keys_stored),
        ]
        .map(to_i32);
        let ints = ints_ok(ints)?;
        // A null pointer where the rows take no slots.
        let no_slots: u64 = 0;
        // Ids tagged only where the page walk may read them (the tensor-core kernel never
        // does), by a kernel of their own; not in a traced step, whose walk then waits for the
        // whole launch.
        let rows = out.sel_rows * out.copies;
        let tagged = publish && !self.trace && page_walk_rows_fit(rows, out.sel.max_len, self.sms);
        let pick = if self.trace {
            &self.traced.1
        } else if tagged {
            &self.pick_tagged
        } else {
            &self.pick
        };
        let mut b = Launch::new(&self.stream, pick);
        b.dependent(self.dependent);
        match slots {
            Some((s, _)) => b.arg(s),
            None => b.arg(&no_slots),
        };
        b.arg(meta.seq_lens_kv())
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(&ints[4])
            .arg(&ints[5])
            .arg(&ints[6])
            .arg(&mut out.scores)
            .arg(&ints[7])
            .arg(&ints[8])
            .arg(&mut out.sel.ids)
            .arg(&mut out.sel.lens)
            .arg(&mut out.covered)
            .arg(&ints[9])
            .arg(&ints[10])
            .arg(&ints[11]);
        // Published rows: each row's flag set to the next epoch once it is written; else a null
        // pointer, which the kernel never reads.
        let no_flags: u64 = 0;
        out.published = publish;
        out.tagged = tagged;
        if publish {
            b.arg(&mut out.ready).arg(&out.epoch);
        } else {
            b.arg(&no_flags).arg(&no_flags);
        }
        if out.tagged {
            b.arg(&mut out.tags);
        } else {
            b.arg(&no_flags);
        }
        // SAFETY: the arguments follow `pick_rows` (and its twins, the same arguments) in
        // kernels/select.cu; scores hold
        // score_stride keys for each of the sel_rows CTAs, checked against the batch by the
        // callers (a budget of 0 reads none); ids, lens and covered hold sel_rows * copies rows
        // of max_len; the dynamic shared memory holds the two histograms, and with keys_smem a
        // row of keys after them (within the limit set at load); slots, where given, hold
        // num_seqs entries and are range-checked in the kernel; the flags, where given, hold
        // sel_rows entries, one per CTA, the epoch one value, and the tags sel_rows * copies
        // rows of max_len, as ids does; a null pointer is never read.
        unsafe { b.launch(cfg) }?;
        // A budget of 0 reads and writes no keys.
        if rule.budget_pages > 0 {
            out.keys_left = keys_stored;
        }
        Ok(())
    }

    /// Checks a pool against Quest's min/max shape for the batch's layout (see
    /// [`Self::check_pool`]); the layout's KV heads and head dim.
    pub(super) fn check_quest_pool<T: CudaElement>(
        &self,
        quest: &Quest,
        meta: &DeviceBatch,
        layer: usize,
        slots: &CudaSlice<i32>,
        pool: &DeviceRepPool<T>,
    ) -> Result<(usize, usize), AlgoError> {
        let (kvh, d) = (meta.layout().kv_heads, meta.layout().head_dim);
        let want = minmax::shape(quest.config().page_size, kvh, d);
        self.check_pool(want, d, meta, layer, slots, pool)?;
        if pool.summary() != quest.config().summary {
            return Err(AlgoError::Invalid(format!(
                "the pool stores {:?} summaries, Quest is configured for {:?}",
                pool.summary(),
                quest.config().summary
            )));
        }
        Ok((kvh, d))
    }

    /// Checks a pool against the shape an algorithm needs (`want`, vectors of `dim`
    /// elements), the layer, the batch's lengths and the slots.
    pub(super) fn check_pool<T: CudaElement>(
        &self,
        want: RepShape,
        dim: usize,
        meta: &DeviceBatch,
        layer: usize,
        slots: &CudaSlice<i32>,
        pool: &DeviceRepPool<T>,
    ) -> Result<(), AlgoError> {
        if pool.shape != want {
            return Err(AlgoError::Invalid(format!(
                "the pool holds {:?}, the algorithm needs {want:?}",
                pool.shape
            )));
        }
        if !dim.is_multiple_of(16) {
            return Err(AlgoError::Invalid(format!(
                "the device kernels take vectors of a multiple of 16 elements, not {dim}"
            )));
        }
        if layer >= pool.layers {
            return Err(AlgoError::Invalid(format!(
                "layer {layer} outside a pool of {} layers",
                pool.layers
            )));
        }
        crate::error::check_len("slots", slots.len(), &[meta.num_seqs()])?;
        if meta.max_kv_len() > pool.max_tokens() {
            return Err(AlgoError::Invalid(format!(
                "a sequence of {} tokens exceeds the pool's {} per request",
                meta.max_kv_len(),
                pool.max_tokens()
            )));
        }
        Ok(())
    }
}
