//! Metadata and selections in device memory.

use cudarc::driver::CudaSlice;

use super::Gpu;
use crate::error::check_len;
use crate::{AttnError, BatchMeta, KvLayout, Selection};

/// The three metadata arrays of a batch on the device, validated on the host (by the same
/// checks as the CPU implementation) before upload, with the host-side facts launches need.
pub struct DeviceBatch {
    pub(crate) cu_seqlens_q: CudaSlice<i32>,
    pub(crate) seq_lens_kv: CudaSlice<i32>,
    pub(crate) block_table: CudaSlice<i32>,
    pub(crate) max_blocks: usize,
    pub(crate) q_lens: Vec<usize>,
    pub(crate) kv_lens: Vec<usize>,
    pub(crate) layout: KvLayout,
}

impl DeviceBatch {
    /// Validates `meta` against `layout` and uploads it.
    pub fn upload(gpu: &Gpu, meta: &BatchMeta<'_>, layout: &KvLayout) -> Result<Self, AttnError> {
        let seqs = meta.validate(layout)?;
        Ok(DeviceBatch {
            cu_seqlens_q: gpu.upload(meta.cu_seqlens_q)?,
            seq_lens_kv: gpu.upload(meta.seq_lens_kv)?,
            block_table: gpu.upload(meta.block_table)?,
            max_blocks: meta.max_blocks,
            q_lens: seqs.iter().map(|s| s.q_len).collect(),
            kv_lens: seqs.iter().map(|s| s.kv_len).collect(),
            layout: *layout,
        })
    }

    /// A batch whose KV lengths and block table already live on the device (written by other
    /// kernels: a selection's covered tokens, a hot-buffer diff's page table); `q_lens` are the
    /// query rows of each sequence, whose prefix sums are uploaded. The KV lengths are known
    /// only to the device: `kv_bound` stands in for each of them on the host, where it shapes
    /// launches (splits, shared memory).
    ///
    /// # Safety
    ///
    /// Every KV length the device holds, now and whenever the batch is used, must lie in
    /// `0..=kv_bound`: kernels size shared memory and splits from the bound and read
    /// `ceil(len / block_size)` entries of each table row.
    pub unsafe fn from_device(
        gpu: &Gpu,
        arrays: DeviceArrays,
        q_lens: Vec<usize>,
        kv_bound: usize,
        layout: &KvLayout,
    ) -> Result<Self, AttnError> {
        let n = q_lens.len();
        let DeviceArrays {
            seq_lens_kv,
            block_table,
            max_blocks,
        } = arrays;
        check_len("seq_lens_kv", seq_lens_kv.len(), &[n])?;
        check_len("block_table", block_table.len(), &[n, max_blocks])?;
        if kv_bound > max_blocks.saturating_mul(layout.block_size) {
            return Err(AttnError::Invalid(format!(
                "KV lengths up to {kv_bound} need more than {max_blocks} blocks of {}",
                layout.block_size
            )));
        }
        let mut cu = Vec::with_capacity(n + 1);
        cu.push(0i32);
        for &q in &q_lens {
            let next = i32::try_from(q)
                .ok()
                .and_then(|q| cu[cu.len() - 1].checked_add(q))
                .ok_or_else(|| AttnError::Invalid(format!("{q} query rows overflow an i32")))?;
            cu.push(next);
        }
        Ok(DeviceBatch {
            cu_seqlens_q: gpu.upload(&cu)?,
            seq_lens_kv,
            block_table,
            max_blocks,
            kv_lens: vec![kv_bound; n],
            q_lens,
            layout: *layout,
        })
    }

    /// Makes `kv_bound` the bound of every KV length (a batch made by
    /// [`DeviceBatch::from_device`] whose lengths grow from one use to the next), checked
    /// against the block table's width as there.
    ///
    /// # Safety
    ///
    /// As for [`DeviceBatch::from_device`]: every KV length the device holds whenever the
    /// batch is next used must lie in `0..=kv_bound`.
    pub unsafe fn set_kv_bound(&mut self, kv_bound: usize) -> Result<(), AttnError> {
        if kv_bound > self.max_blocks * self.layout.block_size {
            return Err(AttnError::Invalid(format!(
                "KV lengths up to {kv_bound} need more than {} blocks of {}",
                self.max_blocks, self.layout.block_size
            )));
        }
        self.kv_lens.fill(kv_bound);
        Ok(())
    }

    /// The KV lengths and the block table, for kernels that rewrite them in place or for a swap
    /// with buffers of the same length.
    ///
    /// # Safety
    ///
    /// What the arrays hold when the batch is next used must meet the contract it was made
    /// under: lengths within the sequences' keys ([`DeviceBatch::upload`]) or within the bound
    /// ([`DeviceBatch::from_device`]), and the lengths of the buffers unchanged.
    pub unsafe fn arrays_mut(&mut self) -> (&mut CudaSlice<i32>, &mut CudaSlice<i32>) {
        (&mut self.seq_lens_kv, &mut self.block_table)
    }

    /// Sequences of the batch.
    pub fn num_seqs(&self) -> usize {
        self.kv_lens.len()
    }

    /// Queries of the batch.
    pub fn total_q(&self) -> usize {
        self.q_lens.iter().sum()
    }

    /// The longest KV length.
    pub fn max_kv_len(&self) -> usize {
        self.kv_lens.iter().copied().max().unwrap_or(0)
    }

    /// The KV lengths on the device (`seq_lens_kv`).
    pub fn seq_lens_kv(&self) -> &CudaSlice<i32> {
        &self.seq_lens_kv
    }

    /// The query prefix sums on the device (`cu_seqlens_q`).
    pub fn cu_seqlens_q(&self) -> &CudaSlice<i32> {
        &self.cu_seqlens_q
    }

    /// The block table on the device, `[num_seqs, max_blocks]`.
    pub fn block_table(&self) -> &CudaSlice<i32> {
        &self.block_table
    }

    /// Columns of the block table.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Query rows of each sequence (host copy).
    pub fn q_lens(&self) -> &[usize] {
        &self.q_lens
    }

    /// KV length of each sequence (host copy); for a batch made by
    /// [`DeviceBatch::from_device`], the bound that stands in for each.
    pub fn kv_lens(&self) -> &[usize] {
        &self.kv_lens
    }

    /// The KV layout the batch was validated against.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }
}

/// A batch's KV lengths and block table, on the device, for [`DeviceBatch::from_device`].
pub struct DeviceArrays {
    /// `[num_seqs]` KV lengths.
    pub seq_lens_kv: CudaSlice<i32>,
    /// `[num_seqs, max_blocks]` block ids.
    pub block_table: CudaSlice<i32>,
    /// Columns of the block table.
    pub max_blocks: usize,
}

/// Per (sequence, KV head) id lists on the device, in the shared format: `ids` is
/// `[rows, max_len]` padded with -1, `lens` is `[rows]` with `rows = num_seqs * kv_heads`.
pub struct DeviceSelection {
    /// The ids.
    pub ids: CudaSlice<i32>,
    /// Valid ids per row.
    pub lens: CudaSlice<i32>,
    /// Row width of `ids`.
    pub max_len: usize,
    /// Rows.
    pub rows: usize,
}

impl DeviceSelection {
    /// Uploads a host selection of `rows` rows after checking its shape and lengths. Ids are
    /// checked on the device, where out-of-range ones are skipped.
    pub fn upload(gpu: &Gpu, sel: &Selection<'_>, rows: usize) -> Result<Self, AttnError> {
        sel.check_shape(rows)?;
        Ok(DeviceSelection {
            ids: gpu.upload(sel.ids)?,
            lens: gpu.upload(sel.lens)?,
            max_len: sel.max_len,
            rows,
        })
    }

    /// Wraps device buffers produced elsewhere (a selection kernel, say), after checking sizes.
    pub fn from_device(
        ids: CudaSlice<i32>,
        lens: CudaSlice<i32>,
        max_len: usize,
    ) -> Result<Self, AttnError> {
        let rows = lens.len();
        check_len("selection ids", ids.len(), &[rows, max_len])?;
        Ok(DeviceSelection {
            ids,
            lens,
            max_len,
            rows,
        })
    }
}

/// Per-row flags through which the launch right before a sparse attention publishes its
/// selection while it still runs (sparse-algo's `SelectKernels::set_publish`): selection row
/// `r` may be read once `flags[r / rows_per_flag]` holds the step's value, `epoch[0]`. See
/// [`Gpu::sparse_page_attention_published`].
#[derive(Clone, Copy, Debug)]
pub struct Published<'a> {
    /// One flag per selecting row.
    pub flags: &'a CudaSlice<u32>,
    /// `[1]` what a flag holds once the current selection's row is written: a value in device
    /// memory, advanced by the launch that scored the selection, so that a replayed CUDA graph
    /// of the step waits for each replay's rows.
    pub epoch: &'a CudaSlice<u32>,
    /// Selection rows per flag: the KV heads where one selecting row is written once per
    /// head, else 1.
    pub rows_per_flag: usize,
    /// `[rows, max_len]` the selection's ids, each with the step's value in its high half
    /// (`(epoch[0] << 32) | id as u32`), stored as each id is final, where the launch tagged
    /// them ([`page_walk_rows_fit`](super::page_walk_rows_fit)): the page walk reads its ids
    /// from here as soon as they carry the step's value, without waiting for the flag
    /// (kernels/pdl.cuh, tagged rows). Untagged rows the walk reads after the whole launch.
    pub tags: Option<&'a CudaSlice<u64>>,
}

/// The output of [`Gpu::gather_page_offsets`]: sorted unique logical pages per (sequence, KV
/// head) and the tokens they cover, like [`GatheredPages`](crate::GatheredPages).
pub struct DeviceGathered {
    /// The pages, usable directly by [`Gpu::sparse_page_attention`].
    pub pages: DeviceSelection,
    /// `[rows]` tokens covered by each row's pages (a last partial page counts its valid tokens).
    pub kv_lens: CudaSlice<i32>,
    /// One counter: selected ids that were outside their sequence (and skipped).
    pub invalid: CudaSlice<i32>,
}
