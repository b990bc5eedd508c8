//! The device entry points: dense, page-list and token-level attention, the merge of partial
//! results, the gather of page offsets, and KV compaction.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{
    CudaElement, DeviceBatch, DeviceGathered, DevicePagedKv, DeviceSelection, Gpu, Launch,
    Published,
};
use super::{WARPS, to_i32, to_u32};
use crate::error::check_len;
use crate::ops::check_keep;
use crate::{AttnError, AttnParams, KvCache, Selection};

/// Which keys a launch reads.
#[derive(Clone, Copy)]
enum Keys<'a> {
    Dense,
    Pages(&'a DeviceSelection),
    Tokens(&'a DeviceSelection),
}

/// The most page ids of one split the tensor-core kernel stages for a published selection
/// (`PUB_IDS` in kernels/attn.cu).
const PUBLISHED_IDS: usize = 256;

/// The most bytes of split-KV partial results one launch may use before it splits less.
const SCRATCH_BUDGET: usize = 256 << 20;

impl Gpu {
    /// [`paged_attention`](crate::paged_attention) on the device: `q` is `[total_q, q_heads,
    /// head_dim]`, `out` `[total_q, q_heads, head_dim]` and `lse` `[total_q, q_heads]`.
    pub fn paged_attention<T: CudaElement>(
        &self,
        q: &CudaSlice<T>,
        kv: &DevicePagedKv<T>,
        meta: &DeviceBatch,
        params: &AttnParams,
        out: &mut CudaSlice<f32>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), AttnError> {
        self.attend(q, kv, meta, Keys::Dense, None, params, out, lse)
    }

    /// [`sparse_page_attention`](crate::sparse_page_attention) on the device. The pages of a
    /// row need not be sorted here (a [`DeviceGathered`] gives them sorted and unique); pages
    /// outside the sequence are skipped. Where [`Gpu::page_walk_fits`] (few rows of decode), the
    /// page walk runs instead of the attention kernel: f32 arithmetic throughout, so not the
    /// attention kernel's bits.
    #[allow(
        clippy::too_many_arguments,
        reason = "the CPU entry point's arguments plus the GPU"
    )]
    pub fn sparse_page_attention<T: CudaElement>(
        &self,
        q: &CudaSlice<T>,
        kv: &DevicePagedKv<T>,
        meta: &DeviceBatch,
        pages: &DeviceSelection,
        params: &AttnParams,
        out: &mut CudaSlice<f32>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), AttnError> {
        self.attend(q, kv, meta, Keys::Pages(pages), None, params, out, lse)
    }

    /// [`sparse_page_attention`](Self::sparse_page_attention) over a selection that the launch
    /// right before it on this stream publishes row by row through `published` (sparse-algo's
    /// `SelectKernels::set_publish`): this launch starts while that one runs, and each of its CTAs
    /// reads its queries and metadata, then waits only for its own row's flag, so the first rows
    /// are attended to while the last ones are still being selected. The page walk
    /// ([`Gpu::page_walk_fits`]) takes published rows too where their ids were tagged: its CTAs
    /// read them from `published.tags` as soon as they carry the step's value. Where neither it nor
    /// the tensor-core kernel runs, or a split spans more than 256 pages, it waits for the whole
    /// launch before it instead, like [`sparse_page_attention`](Self::sparse_page_attention).
    /// Outputs are the same bits.
    ///
    /// # Safety
    /// The launch right before this one on the stream must be the one that writes `pages`, stores
    /// each id tagged with `published.epoch[0]` into `published.tags` (where given) once it is
    /// final, and then sets `published.flags` to `published.epoch[0]` row by row, the launch before
    /// that one (the selection's scoring) must have advanced `published.epoch[0]`, and `q`, `kv`
    /// and `meta` must have been complete before that scoring began: this launch waits for nothing
    /// else, so it could otherwise read them while they are written.
    #[allow(
        clippy::too_many_arguments,
        reason = "sparse_page_attention's arguments plus the flags"
    )]
    pub unsafe fn sparse_page_attention_published<T: CudaElement>(
        &self,
        q: &CudaSlice<T>,
        kv: &DevicePagedKv<T>,
        meta: &DeviceBatch,
        pages: &DeviceSelection,
        published: Published<'_>,
        params: &AttnParams,
        out: &mut CudaSlice<f32>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), AttnError> {
        if published.rows_per_flag == 0
            || published.flags.len() * published.rows_per_flag != pages.rows
            || published.epoch.is_empty()
            || published
                .tags
                .is_some_and(|t| t.len() < pages.rows * pages.max_len)
        {
            return Err(AttnError::Invalid(format!(
                "{} flags of {} rows each, a step value of {} words and {} tagged ids, for a \
                 selection of {} rows of {}",
                published.flags.len(),
                published.rows_per_flag,
                published.epoch.len(),
                published.tags.map_or(0, |t| t.len()),
                pages.rows,
                pages.max_len
            )));
        }
        self.attend(
            q,
            kv,
            meta,
            Keys::Pages(pages),
            Some(published),
            params,
            out,
            lse,
        )
    }

    /// [`token_sparse_attention`](crate::token_sparse_attention) on the device; tokens outside
    /// the sequence are skipped (duplicates are the caller's to avoid, as on the CPU).
    #[allow(
        clippy::too_many_arguments,
        reason = "the CPU entry point's arguments plus the GPU"
    )]
    pub fn token_sparse_attention<T: CudaElement>(
        &self,
        q: &CudaSlice<T>,
        kv: &DevicePagedKv<T>,
        meta: &DeviceBatch,
        tokens: &DeviceSelection,
        params: &AttnParams,
        out: &mut CudaSlice<f32>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), AttnError> {
        self.attend(q, kv, meta, Keys::Tokens(tokens), None, params, out, lse)
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "one launcher behind three entry points"
    )]
    fn attend<T: CudaElement>(
        &self,
        q: &CudaSlice<T>,
        kv: &DevicePagedKv<T>,
        meta: &DeviceBatch,
        keys: Keys<'_>,
        published: Option<Published<'_>>,
        params: &AttnParams,
        out: &mut CudaSlice<f32>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), AttnError> {
        let layout = kv.layout();
        if meta.layout != layout {
            return Err(AttnError::Invalid(format!(
                "the batch was validated for {:?}, the cache is {layout:?}",
                meta.layout
            )));
        }
        let group = params.validate(&layout)?;
        let d = layout.head_dim;
        if ![64, 128, 256].contains(&d) {
            return Err(AttnError::Invalid(format!(
                "device attention is built for head_dim 64, 128 and 256, not {d}"
            )));
        }
        let total_q = meta.total_q();
        check_len("q", q.len(), &[total_q, params.q_heads, d])?;
        check_len("out", out.len(), &[total_q, params.q_heads, d])?;
        if let Some(lse) = &lse {
            check_len("lse", lse.len(), &[total_q, params.q_heads])?;
        }
        let total_rows = total_q * params.q_heads;
        let rows_sel = meta.num_seqs() * layout.kv_heads;
        let bs = layout.block_size;
        let (mode, sel, n_keys) = match keys {
            Keys::Dense => (0, None, meta.max_kv_len().div_ceil(bs) * bs),
            Keys::Pages(s) => (1, Some(s), s.max_len * bs),
            Keys::Tokens(s) => (2, Some(s), s.max_len),
        };
        if let Some(s) = sel
            && s.rows != rows_sel
        {
            return Err(AttnError::Length {
                what: "selection rows",
                expected: rows_sel,
                got: s.rows,
            });
        }
        if total_rows == 0 {
            return Ok(());
        }
        if let Keys::Pages(s) = keys
            && self.page_walk_fits(kv, meta, s, params)
        {
            return self.walk(q, kv, meta, s, published, params, out, lse);
        }
        let sink_buf = match &params.sink_logits {
            Some(s) => Some(self.upload(s)?),
            None => None,
        };

        // Rows per CTA, row tiles per (sequence, KV head), and the split of the keys.
        let max_rows = meta.q_lens.iter().max().copied().unwrap_or(0) * group;
        let kernel = self.attn_kernel(T::DTYPE, d, max_rows)?;
        let tiles = max_rows.div_ceil(kernel.rows);
        let units = meta.num_seqs() * layout.kv_heads * tiles;
        let mut splits = split_count(units, kernel.resident * self.sms, self.waves);
        while splits > 1 && splits * total_rows * (d + 1) * 4 > SCRATCH_BUDGET {
            splits /= 2;
        }
        let chunk = (n_keys.div_ceil(splits).div_ceil(16) * 16).max(self.min_chunk);
        let splits = n_keys.div_ceil(chunk).max(1);
        // A split's keys span at most this many pages of the selection.
        let split_pages = chunk.div_ceil(bs) + 1;
        let mut cfg = LaunchConfig {
            grid_dim: (
                to_u32(splits * layout.kv_heads)?,
                to_u32(tiles)?,
                to_u32(meta.num_seqs())?,
            ),
            block_dim: (to_u32(WARPS * 32)?, 1, 1),
            shared_mem_bytes: to_u32(kernel.smem)?,
        };
        let ints = [
            to_i32(meta.max_blocks)?,
            to_i32(layout.num_blocks)?,
            mode,
            to_i32(sel.map_or(0, |s| s.max_len))?,
            to_i32(layout.kv_heads)?,
            to_i32(group)?,
            to_i32(bs)?,
            to_i32(params.window.map_or(0, |w| w as usize))?,
            to_i32(params.sink_tokens as usize)?,
            i32::from(sink_buf.is_some()),
            to_i32(chunk)?,
            i32::from(lse.is_some()),
            to_i32(splits)?,
            to_i32(total_rows)?,
        ];
        let [
            max_blocks,
            num_blocks,
            mode,
            sel_max,
            kvh,
            group,
            bs,
            window,
            sinks,
            has_sinks,
            chunk,
            has_lse,
            splits_i,
            total_rows_i,
        ] = ints;
        let (sel_ids, sel_lens) =
            sel.map_or((&self.dummy_i32, &self.dummy_i32), |s| (&s.ids, &s.lens));
        let sinks_buf = sink_buf.as_ref().unwrap_or(&self.dummy_f32);

        // Several splits write partials into the scratch buffers; the last split of each unit
        // merges them into `out` and `lse` in the same launch.
        let mut guard = self
            .scratch
            .lock()
            .map_err(|_| AttnError::Device("scratch lock poisoned".to_owned()))?;
        if splits > 1 {
            // Sized by the largest launch so far, in each of rows, elements and units (the
            // head dim of an earlier launch may have been smaller).
            self.scratch_at_least(&mut guard, splits * total_rows, d, units)?;
        }
        // Flags only where the tensor-core kernel runs and every split's page ids fit its
        // staging; otherwise the launch waits for the selection's whole launch, as any launch
        // does. No flags: a null pointer, which the kernel never reads.
        let published = published.filter(|_| split_pages <= PUBLISHED_IDS);
        // The kernel over a published selection walks the same splits in the same order (the
        // same bits); the split was planned for the plain kernel's CTAs a multiprocessor, so
        // it is used only where it holds as many.
        let pub_kernel = kernel
            .published
            .as_ref()
            .filter(|k| k.resident == kernel.resident);
        let (func, published) = match (published, pub_kernel) {
            (Some(p), Some(k)) => {
                // Room for the sequence's block-table row after the merge state, where it fits
                // the kernel's allowance; with none the kernel reads the table in global memory.
                if meta.max_blocks <= k.table_cap {
                    cfg.shared_mem_bytes += to_u32(meta.max_blocks * size_of::<i32>())?;
                }
                (&k.func, Some(p))
            }
            _ => (&kernel.func, None),
        };
        let mut b = Launch::new(&self.stream, func);
        b.dependent(self.dependent);
        push_paged(&mut b, q, kv, meta)
            .arg(&max_blocks)
            .arg(&num_blocks)
            .arg(&mode)
            .arg(sel_ids)
            .arg(sel_lens)
            .arg(&sel_max)
            .arg(&kvh)
            .arg(&group)
            .arg(&bs)
            .arg(&params.scale)
            .arg(&window)
            .arg(&sinks)
            .arg(sinks_buf)
            .arg(&has_sinks)
            .arg(&chunk)
            .arg(out);
        // Without an lse the kernel is told so (has_lse = 0) and never writes the dummy.
        match lse {
            Some(l) => b.arg(l),
            None => b.arg(&self.dummy_f32),
        };
        b.arg(&has_lse);
        // With one split the kernel never touches the scratch: dummies stand in.
        match guard.as_mut().filter(|_| splits > 1) {
            Some(s) => b.arg(&mut s.out).arg(&mut s.lse).arg(&mut s.counters),
            None => b
                .arg(&self.dummy_f32)
                .arg(&self.dummy_f32)
                .arg(&self.dummy_i32),
        };
        b.arg(&splits_i).arg(&total_rows_i);
        let no_flags: u64 = 0;
        let per_flag =
            published.map_or(1i32, |p| i32::try_from(p.rows_per_flag).unwrap_or(i32::MAX));
        match published {
            Some(p) => b.arg(p.flags).arg(p.epoch),
            None => b.arg(&no_flags).arg(&no_flags),
        };
        b.arg(&per_flag);
        // SAFETY: the arguments follow the ATTN_KERNEL signature in kernels/attn.cu; q, out and
        // lse have the lengths checked above; with several splits the kernel writes
        // `splits * total_rows` partial rows and counts `units` units, which the scratch
        // buffers hold; the metadata was validated against this layout on upload, and the
        // kernel range-checks every id it reads from device memory; published flags hold one
        // flag per rows_per_flag selection rows and their epoch a value (checked by the
        // caller), and a null pointer is never read; the kernel stages a table row only in the
        // dynamic shared memory the launch gave beyond the merge state (%dynamic_smem_size).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// [`merge_attention`](crate::merge_attention) on the device, for parts stacked in one
    /// buffer: `parts_out` is `[n_parts, rows, head_dim]` and `parts_lse` `[n_parts, rows]`;
    /// `out` is `[rows, head_dim]` and `lse` `[rows]`.
    pub fn merge_attention(
        &self,
        parts_out: &CudaSlice<f32>,
        parts_lse: &CudaSlice<f32>,
        n_parts: usize,
        head_dim: usize,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<(), AttnError> {
        if head_dim == 0 {
            return Err(AttnError::Invalid("head_dim 0".to_owned()));
        }
        let rows = lse.len();
        check_len("out", out.len(), &[rows, head_dim])?;
        check_len("parts lse", parts_lse.len(), &[n_parts, rows])?;
        check_len("parts out", parts_out.len(), &[n_parts, rows, head_dim])?;
        if rows == 0 {
            return Ok(());
        }
        let (n, r, dd) = (to_i32(n_parts)?, to_i32(rows)?, to_i32(head_dim)?);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(rows)?, 1, 1),
            block_dim: (to_u32(head_dim.div_ceil(32).min(8) * 32)?, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(self.function("attn_merge")?);
        b.arg(parts_out)
            .arg(parts_lse)
            .arg(&n)
            .arg(&r)
            .arg(&dd)
            .arg(out)
            .arg(lse);
        // SAFETY: the arguments follow `attn_merge` in kernels/attn.cu; the parts hold
        // n_parts * rows rows of head_dim, out holds rows * head_dim and lse rows (checked
        // above).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// [`gather_page_offsets`](crate::gather_page_offsets) on the device, for the sequences of
    /// `meta`: rows are (sequence, KV head) and `selection` holds blocks of `sel_block_size`
    /// tokens. Ids outside their sequence are skipped and counted in
    /// [`DeviceGathered::invalid`] (the CPU rejects them).
    pub fn gather_page_offsets(
        &self,
        selection: &DeviceSelection,
        sel_block_size: usize,
        meta: &DeviceBatch,
    ) -> Result<DeviceGathered, AttnError> {
        let layout = meta.layout;
        let bs = layout.block_size;
        if sel_block_size == 0
            || !(sel_block_size.is_multiple_of(bs) || bs.is_multiple_of(sel_block_size))
        {
            return Err(AttnError::Invalid(format!(
                "selection blocks of {sel_block_size} tokens do not tile KV pages of {bs}"
            )));
        }
        let rows = meta.num_seqs() * layout.kv_heads;
        if selection.rows != rows {
            return Err(AttnError::Length {
                what: "selection rows",
                expected: rows,
                got: selection.rows,
            });
        }
        let max_pages = meta.max_kv_len().div_ceil(bs);
        let words = max_pages.div_ceil(32);
        if words * 4 > 48 * 1024 {
            return Err(AttnError::Invalid(format!(
                "{max_pages} pages exceed the device gather's shared-memory bitmap"
            )));
        }
        let mut pages = self.zeros::<i32>(rows * max_pages)?;
        let mut counts = self.zeros::<i32>(rows)?;
        let mut kv_lens = self.zeros::<i32>(rows)?;
        let mut invalid = self.zeros::<i32>(1)?;
        if rows > 0 {
            let ints = [
                to_i32(selection.max_len)?,
                to_i32(layout.kv_heads)?,
                to_i32(sel_block_size)?,
                to_i32(bs)?,
                to_i32(max_pages)?,
            ];
            let [max_len, kvh, sel_bs, bs_i, max_pages_i] = ints;
            let cfg = LaunchConfig {
                grid_dim: (to_u32(rows)?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: to_u32(words.max(1) * 4)?,
            };
            let mut b = self.stream.launch_builder(self.function("gather_pages")?);
            b.arg(&selection.ids)
                .arg(&selection.lens)
                .arg(&max_len)
                .arg(&meta.seq_lens_kv)
                .arg(&kvh)
                .arg(&sel_bs)
                .arg(&bs_i)
                .arg(&mut pages)
                .arg(&mut counts)
                .arg(&mut kv_lens)
                .arg(&max_pages_i)
                .arg(&mut invalid);
            // SAFETY: the arguments follow `gather_pages` in kernels/attn.cu; ids hold
            // rows * max_len, the outputs rows * max_pages and rows, the bitmap has a bit for
            // each page of the longest sequence, and ids outside a sequence are skipped.
            unsafe { b.launch(cfg) }?;
        }
        Ok(DeviceGathered {
            pages: DeviceSelection::from_device(pages, counts, max_pages)?,
            kv_lens,
            invalid,
        })
    }

    /// [`compact_kv`](crate::compact_kv) on the device. The metadata and keep lists come from
    /// the host and are validated exactly as on the CPU; the new KV lengths are returned.
    pub fn compact_kv<T: CudaElement>(
        &self,
        kv: &mut DevicePagedKv<T>,
        seq_lens_kv: &[i32],
        block_table: &[i32],
        max_blocks: usize,
        keep: &Selection<'_>,
    ) -> Result<Vec<i32>, AttnError> {
        let layout = kv.layout();
        let (seqs, _, new_lens) = check_keep(&layout, seq_lens_kv, block_table, max_blocks, keep)?;
        let rows = seqs.len() * layout.kv_heads;
        if rows == 0 {
            return Ok(new_lens);
        }
        let ids = self.upload(keep.ids)?;
        let lens = self.upload(keep.lens)?;
        let table = self.upload(block_table)?;
        let d = layout.head_dim;
        let ints = [
            to_i32(keep.max_len)?,
            to_i32(max_blocks)?,
            to_i32(layout.kv_heads)?,
            to_i32(d)?,
            to_i32(layout.block_size)?,
        ];
        let [max_len, max_blocks_i, kvh, d_i, bs] = ints;
        let cfg = LaunchConfig {
            grid_dim: (to_u32(rows)?, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: to_u32(2 * 16 * d * T::DTYPE.size())?,
        };
        let name = format!("compact_{}", T::KERNEL);
        let (k, v) = kv.tensors_mut();
        let mut b = self.stream.launch_builder(self.function(&name)?);
        b.arg(k)
            .arg(v)
            .arg(&ids)
            .arg(&lens)
            .arg(&max_len)
            .arg(&table)
            .arg(&max_blocks_i)
            .arg(&kvh)
            .arg(&d_i)
            .arg(&bs);
        // SAFETY: the arguments follow `compact_*` in kernels/attn.cu; every kept position and
        // every destination lies inside its sequence, whose blocks are in the pool (validated
        // above), and shared memory holds one chunk of 16 tokens of K and V.
        unsafe { b.launch(cfg) }?;
        Ok(new_lens)
    }
}

/// How many splits of its keys each of `units` (sequence, KV head, row tile) units gets, for a
/// device that holds `slots` CTAs at once and a target of `waves` waves: enough CTAs to fill
/// the target. Where that leaves one split a unit (more units than half the target) and the
/// units fill at most two waves, one split can leave most of the last wave idle (B32 and B64
/// sparse decode on an H200: 256 and 512 units against 396 slots), so the count of 1 to 4
/// whose CTAs fill their last wave best is taken, the smallest on a tie: 3 at both, measured
/// 1.55 -> 1.45 and 1.54 -> 1.32 times the bytes floor (BENCHMARKS.md, session 33). Past two
/// waves the idle share of the last one is smaller, and more splits were not measured there.
fn split_count(units: usize, slots: usize, waves: usize) -> usize {
    let (units, slots) = (units.max(1), slots.max(1));
    let splits = (waves * slots / units).max(1);
    if splits > 1 || units > 2 * slots {
        return splits;
    }
    // Thousandths of the last wave's slots that the CTAs fill.
    let fill = |s: usize| units * s * 1000 / ((units * s).div_ceil(slots) * slots);
    (1..=4).rev().max_by_key(|&s| fill(s)).unwrap_or(1)
}

/// Pushes the buffers that every paged attention kernel's arguments begin with (`ATTN_KERNEL`
/// in kernels/attn.cu, `walk_pages_*` in kernels/walk.cu): q, K and V, then the batch's query
/// offsets, KV lengths and block table.
pub(super) fn push_paged<'a, 'l, T: CudaElement>(
    b: &'l mut Launch<'a>,
    q: &'a CudaSlice<T>,
    kv: &'a DevicePagedKv<T>,
    meta: &'a DeviceBatch,
) -> &'l mut Launch<'a> {
    b.arg(q)
        .arg(kv.k())
        .arg(kv.v())
        .arg(&meta.cu_seqlens_q)
        .arg(&meta.seq_lens_kv)
        .arg(&meta.block_table)
}

#[cfg(test)]
mod tests {
    use super::split_count;

    /// `split_count(units, slots, waves)` is `want` for each case.
    fn check(cases: &[(usize, usize, usize, usize)]) {
        for &(units, slots, waves, want) in cases {
            assert_eq!(
                split_count(units, slots, waves),
                want,
                "split_count({units}, {slots}, {waves})"
            );
        }
    }

    #[test]
    fn splits_fill_whole_waves() {
        // An H200's 132 multiprocessors at 3 CTAs each: 396 slots; 8 KV heads a sequence.
        check(&[
            // B1 and B8: as many splits as fill the target.
            (8, 396, 1, 49),
            (64, 396, 1, 6),
            (64, 396, 2, 12),
            // B25, B32, B64: the split count that fills the last wave best.
            (200, 396, 1, 3),
            (256, 396, 1, 3),
            (512, 396, 1, 3),
            // A unit a slot fills the wave: one split.
            (396, 396, 1, 1),
            // More units than two waves hold: one split, as before.
            (793, 396, 1, 1),
            (1700, 396, 1, 1),
            // Degenerate inputs still give one split or more.
            (0, 0, 1, 1),
            (5, 0, 1, 1),
        ]);
    }
}
