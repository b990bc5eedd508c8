//! The page walk (kernels/walk.cu): page-list decode attention a warp a page, then one merge of
//! the pages' partials, for launches whose rows are few enough for one wave. It hands data
//! between multiprocessors once where the tensor-core kernel's split walk and split merge do
//! twice; on an H200 it took B1 L128K's Quest step from 25.0 to 23.7 µs (8 layers in one graph,
//! queued; BENCHMARKS.md, session 75).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::ops::push_paged;
use super::{
    CudaElement, DeviceBatch, DevicePagedKv, DeviceSelection, Gpu, Launch, Published, Scratch,
    to_i32, to_u32,
};
use crate::{AttnError, AttnParams, DType, KvCache, KvLayout};

/// The head dim, query heads a KV head and KV page (block) size the walk is built for.
const WALK_D: usize = 128;
const WALK_GROUP: usize = 4;
const WALK_PAGE: usize = 16;
/// Places (pages of a row) a walking CTA takes, a warp each.
const PLACES_PER_CTA: usize = 4;
/// The most walking CTAs a launch may have, per multiprocessor: one wave, with room left.
const CTAS_PER_SM: usize = 2;
/// The most dynamic shared memory a launch takes without opting in. Where a sequence's
/// block-table row is longer, the walk reads the table in global memory.
const STAGE_BYTES: usize = 48 * 1024;
/// Warps of a merging CTA (`WALK_MERGE_WARPS` in kernels/walk.cu).
const MERGE_WARPS: usize = 16;

/// Whether a selection of `rows` rows of `width` pages is few enough for the page walk on a
/// device of `sms` multiprocessors (at most two walking CTAs of 4 pages a multiprocessor: one
/// wave), whatever its other shapes. A top-k that publishes its rows tags their ids for the
/// walk (`Published::tags`) only where this holds, since the tensor-core kernel never reads
/// them.
pub fn page_walk_rows_fit(rows: usize, width: usize, sms: usize) -> bool {
    width > 0 && rows.saturating_mul(width.div_ceil(PLACES_PER_CTA)) <= CTAS_PER_SM * sms
}

/// The page walk's shapes: `dtype` and `layout` of the cache, each sequence's query count
/// `q_lens`, the selection's `(rows, width)`, the attention's `params`, on a device of `sms`
/// multiprocessors.
fn fits(
    dtype: DType,
    layout: &KvLayout,
    q_lens: &[usize],
    (rows, width): (usize, usize),
    params: &AttnParams,
    sms: usize,
) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
        && layout.head_dim == WALK_D
        && layout.block_size == WALK_PAGE
        && params.q_heads == WALK_GROUP * layout.kv_heads
        && params.window.is_none()
        && params.sink_tokens == 0
        && params.sink_logits.is_none()
        && !q_lens.is_empty()
        && q_lens.iter().all(|&n| n == 1)
        && page_walk_rows_fit(rows, width, sms)
}

impl Gpu {
    /// Whether the page walk runs on the device's page-list decodes (the default), or the
    /// tensor-core kernel always does.
    pub fn page_walk(&self) -> bool {
        self.page_walk
    }

    /// Turns the page walk on or off. Off, every page-list launch runs the attention kernel
    /// (bits equal to dense attention where every page is selected).
    pub fn set_page_walk(&mut self, on: bool) {
        self.page_walk = on;
    }

    /// Whether [`sparse_page_attention`](Self::sparse_page_attention) (and its published form)
    /// over `pages` runs the page walk (kernels/walk.cu) instead of the attention kernel: where
    /// the walk is on and no kernel variant is pinned ([`Gpu::set_variant`]), for f16 and bf16
    /// caches of head dim 128 in pages of 16 tokens, 4 query heads a KV head, a batch of decode
    /// rows (one query a sequence) without window or sinks, and a selection whose rows take at
    /// most two CTAs of 4 pages a multiprocessor. Its arithmetic is f32 throughout; it does
    /// not repeat the attention kernel's bits, so where it runs, every page selected equals
    /// dense attention within rounding rather than bit for bit.
    pub fn page_walk_fits<T: CudaElement>(
        &self,
        kv: &DevicePagedKv<T>,
        meta: &DeviceBatch,
        pages: &DeviceSelection,
        params: &AttnParams,
    ) -> bool {
        self.page_walk
            && self.variant.is_none()
            && fits(
                T::DTYPE,
                &kv.layout(),
                &meta.q_lens,
                (pages.rows, pages.max_len),
                params,
                self.sms,
            )
    }

    /// The page walk over `pages` into `out` (and `lse`): `walk_pages` writes each place's partial
    /// into the scratch, `walk_merge` merges each row's. With `published`, the walk's CTAs read
    /// their ids from the tagged copy as soon as each carries the step's value instead of waiting
    /// for the launch before, and the merge sees each row's flag before it ends (`walk_pages_pub`,
    /// `walk_merge_pub`; the same bits). The caller has checked the lengths of `q`, `out` and
    /// `lse`, that [`Gpu::page_walk_fits`] holds, and the flags' counts, and holds the published
    /// form's contract (`sparse_page_attention_published`).
    #[allow(
        clippy::too_many_arguments,
        reason = "sparse_page_attention's arguments"
    )]
    pub(super) fn walk<T: CudaElement>(
        &self,
        q: &CudaSlice<T>,
        kv: &DevicePagedKv<T>,
        meta: &DeviceBatch,
        pages: &DeviceSelection,
        published: Option<Published<'_>>,
        params: &AttnParams,
        out: &mut CudaSlice<f32>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), AttnError> {
        let layout = kv.layout();
        let (rows, width) = (pages.rows, pages.max_len);
        // The walk reads every place of every row, whatever the row's length.
        if pages.ids.len() < rows * width || pages.lens.len() < rows {
            return Err(AttnError::Invalid(format!(
                "a selection of {rows} rows of {width} holds {} ids and {} lengths",
                pages.ids.len(),
                pages.lens.len()
            )));
        }
        let places = rows * width;
        // Published rows whose ids were tagged (the top-k saw rows the walk may take), with
        // their tags: the walk reads the tags; untagged ones it reads after the whole top-k, as
        // unpublished.
        let tagged = published.and_then(|p| Some((p.tags?, p)));
        let pages_name = match (T::DTYPE, tagged.is_some()) {
            (DType::F16, false) => "walk_pages_f16",
            (DType::BF16, false) => "walk_pages_bf16",
            (DType::F16, true) => "walk_pages_pub_f16",
            (DType::BF16, true) => "walk_pages_pub_bf16",
            (DType::F32, _) => {
                return Err(AttnError::Invalid(
                    "the page walk is built for 16-bit caches".to_owned(),
                ));
            }
        };
        let table = meta.max_blocks * size_of::<i32>();
        let staged = table <= STAGE_BYTES;
        let ints = [
            to_i32(meta.max_blocks)?,
            to_i32(layout.num_blocks)?,
            to_i32(layout.kv_heads)?,
            to_i32(params.q_heads)?,
            to_i32(width)?,
            i32::from(staged),
            i32::from(lse.is_some()),
        ];
        let [
            max_blocks,
            num_blocks,
            kvh,
            q_heads,
            width_i,
            staged_i,
            has_lse,
        ] = ints;
        let scale2 = params.scale * std::f32::consts::LOG2_E;
        let mut guard = self
            .scratch
            .lock()
            .map_err(|_| AttnError::Device("scratch lock poisoned".to_owned()))?;
        let scratch = self.scratch_at_least(&mut guard, places * WALK_GROUP, WALK_D, 0)?;

        let cfg = LaunchConfig {
            grid_dim: (to_u32(width.div_ceil(PLACES_PER_CTA))?, to_u32(rows)?, 1),
            block_dim: (to_u32(PLACES_PER_CTA * 32)?, 1, 1),
            shared_mem_bytes: to_u32(if staged { table } else { 0 })?,
        };
        let mut b = Launch::new(&self.stream, self.function(pages_name)?);
        b.dependent(self.dependent);
        push_paged(&mut b, q, kv, meta)
            .arg(&max_blocks)
            .arg(&num_blocks)
            .arg(&kvh)
            .arg(&q_heads)
            .arg(&pages.ids)
            .arg(&pages.lens)
            .arg(&width_i)
            .arg(&scale2)
            .arg(&mut scratch.out)
            .arg(&mut scratch.lse)
            .arg(&staged_i);
        if let Some((tags, p)) = tagged {
            b.arg(tags).arg(p.epoch);
        }
        // SAFETY: the arguments follow `walk_pages_<type>` in kernels/walk.cu (with `published`,
        // `walk_pages_pub_<type>`, whose tagged ids and step value come last: `rows * width` tags
        // and a value, checked by `sparse_page_attention_published`): q, K and V of a 16-bit cache
        // of head dim 128 in pages of 16 tokens, 4 query heads a KV head (checked by
        // `page_walk_fits`), the batch's metadata (validated against the layout on upload), rows of
        // `width` page ids and their lengths (their sizes checked above), and the scratch's
        // partials, which hold `places * 4` rows of 128 and their LSEs; the kernel range-checks
        // every page and block it reads, and stages the table row only where the launch gave its
        // bytes (`staged`).
        unsafe { b.launch(cfg) }?;

        let cfg = LaunchConfig {
            grid_dim: (to_u32(rows)?, to_u32(WALK_GROUP)?, 1),
            block_dim: (to_u32(MERGE_WARPS * 32)?, 1, 1),
            shared_mem_bytes: 0,
        };
        let merge_name = if tagged.is_some() {
            "walk_merge_pub"
        } else {
            "walk_merge"
        };
        let mut b = Launch::new(&self.stream, self.function(merge_name)?);
        b.dependent(self.dependent);
        b.arg(&meta.cu_seqlens_q)
            .arg(&kvh)
            .arg(&q_heads)
            .arg(&width_i)
            .arg(&scratch.out)
            .arg(&scratch.lse)
            .arg(out);
        // Without an lse the kernel is told so (has_lse = 0) and never writes the dummy.
        match lse {
            Some(l) => b.arg(l),
            None => b.arg(&self.dummy_f32),
        };
        b.arg(&has_lse);
        let per_flag = match tagged {
            Some((_, p)) => to_i32(p.rows_per_flag)?,
            None => 1,
        };
        if let Some((_, p)) = tagged {
            b.arg(p.flags).arg(p.epoch).arg(&per_flag);
        }
        // SAFETY: the arguments follow `walk_merge` in kernels/walk.cu (with `published`,
        // `walk_merge_pub`, whose flags come last: one per `rows_per_flag` rows and a step value,
        // checked by `sparse_page_attention_published`): the batch's query offsets (one query a
        // sequence, checked by `page_walk_fits`), the partials `walk_pages` wrote just before on
        // this stream (it waits for them), and `out` and `lse`, whose lengths the caller checked
        // against the batch's rows.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The scratch in `guard`, grown to hold at least `rows` rows of `dim` partial outputs,
    /// their LSEs and `units` split counters (sized by the largest launch so far in each).
    pub(super) fn scratch_at_least<'g>(
        &self,
        guard: &'g mut Option<Scratch>,
        rows: usize,
        dim: usize,
        units: usize,
    ) -> Result<&'g mut Scratch, AttnError> {
        if guard.as_ref().is_none_or(|s| {
            s.lse.len() < rows || s.out.len() < rows * dim || s.counters.len() < units
        }) {
            let (rows, elems, units) = guard.take().map_or((rows, rows * dim, units), |s| {
                (
                    rows.max(s.lse.len()),
                    (rows * dim).max(s.out.len()),
                    units.max(s.counters.len()),
                )
            });
            *guard = Some(Scratch {
                out: self.zeros(elems)?,
                lse: self.zeros(rows)?,
                counters: self.zeros(units)?,
            });
        }
        guard
            .as_mut()
            .ok_or_else(|| AttnError::Device("the scratch was just allocated".to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::{fits, page_walk_rows_fit};
    use crate::{AttnParams, DType, KvLayout};

    /// A launch's shapes, as `fits` takes them.
    struct Shape {
        dtype: DType,
        layout: KvLayout,
        q_lens: Vec<usize>,
        sel: (usize, usize),
        params: AttnParams,
    }

    /// B1 L128K's step: bf16, 32 query and 8 KV heads of 128, pages of 16, rows of 128 pages.
    fn b1() -> Shape {
        Shape {
            dtype: DType::BF16,
            layout: KvLayout {
                num_blocks: 8192,
                block_size: 16,
                kv_heads: 8,
                head_dim: 128,
            },
            q_lens: vec![1],
            sel: (8, 128),
            params: AttnParams::new(32, 128),
        }
    }

    /// A case: what it is, its change to B1's shapes, and whether the walk takes them.
    type Case = (&'static str, fn(&mut Shape), bool);

    /// For each case, B1's shapes changed by `edit` take the walk on an H200's 132
    /// multiprocessors, or not, as `want` says.
    fn check(cases: &[Case]) {
        for &(what, edit, want) in cases {
            let mut s = b1();
            edit(&mut s);
            let got = fits(s.dtype, &s.layout, &s.q_lens, s.sel, &s.params, 132);
            assert_eq!(got, want, "{what}");
        }
    }

    /// The rows' part alone, which decides whether a published top-k tags its ids: one wave of
    /// two 4-page CTAs a multiprocessor, on 132 multiprocessors unless a case says otherwise.
    #[test]
    fn rows_fit_one_wave_of_two_ctas_a_multiprocessor() {
        let cases: [(&str, usize, usize, usize, bool); 7] = [
            ("B1 L128K, 8 rows of 128", 8, 128, 132, true),
            ("264 CTAs", 1, 1056, 132, true),
            ("265 CTAs", 1, 1057, 132, false),
            ("B8 L32K, 64 rows of 128", 64, 128, 132, false),
            ("empty rows", 8, 0, 132, false),
            ("rows near usize::MAX", usize::MAX, 8, 132, false),
            ("no multiprocessor", 1, 1, 0, false),
        ];
        for (what, rows, width, sms, want) in cases {
            assert_eq!(page_walk_rows_fit(rows, width, sms), want, "{what}");
        }
    }

    #[test]
    fn the_walk_takes_few_decode_rows_of_its_shape() {
        check(&[
            ("B1 L128K, 128 pages", |_| {}, true),
            ("f16", |s| s.dtype = DType::F16, true),
            (
                "B2, 48 pages",
                |s| (s.q_lens, s.sel) = (vec![1, 1], (16, 48)),
                true,
            ),
            ("two CTAs a multiprocessor", |s| s.sel = (1, 1056), true),
            ("one CTA more", |s| s.sel = (1, 1057), false),
            (
                "B8 L32K",
                |s| (s.q_lens, s.sel) = (vec![1; 8], (64, 128)),
                false,
            ),
            (
                "every page of B2 L4K",
                |s| (s.q_lens, s.sel) = (vec![1, 1], (16, 256)),
                false,
            ),
            ("widths near usize::MAX", |s| s.sel = (8, usize::MAX), false),
            ("f32", |s| s.dtype = DType::F32, false),
            ("head dim 64", |s| s.layout.head_dim = 64, false),
            ("pages of 32", |s| s.layout.block_size = 32, false),
            ("GQA 8", |s| s.layout.kv_heads = 4, false),
            ("MHA", |s| s.params.q_heads = 8, false),
            ("a prefill row", |s| s.q_lens = vec![2], false),
            ("no sequence", |s| s.q_lens = Vec::new(), false),
            ("empty rows", |s| s.sel = (8, 0), false),
            ("a window", |s| s.params.window = Some(64), false),
            ("sink tokens", |s| s.params.sink_tokens = 4, false),
            (
                "sink logits",
                |s| s.params.sink_logits = Some(vec![0.5; 32]),
                false,
            ),
        ]);
    }
}
