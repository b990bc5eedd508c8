//! A decode step of the manager: the selection's diff against the hot buffer, its loads, and
//! the prefetch of an estimated selection.

use attn_op::Element;
use kv_blocks::RequestId;

use super::{SparseKvCacheManager, StepPlan};
use crate::exec::Load;
use crate::hot::HotBuffer;
use crate::{OffloadError, StepStats};

impl<T: Element> SparseKvCacheManager<T> {
    /// One decode step of (request, layer) after the step's tokens were appended: see
    /// [`step_with_new`](Self::step_with_new) with no new tokens.
    pub fn step(
        &mut self,
        id: RequestId,
        layer: usize,
        pages: &[i32],
    ) -> Result<StepPlan, OffloadError> {
        self.step_with_new(id, layer, pages, 0)
    }

    /// One decode step of (request, layer). `pages` are the selected logical pages, ascending
    /// and unique (the union over KV heads of a selection), over the request's tokens plus
    /// `new_tokens` that the forward is about to write: their device slots come back in
    /// [`StepPlan::new_slots`] (the engine writes them there, then hands them to
    /// [`append`](Self::append) for the host backup, which then skips the device). The new
    /// tokens must fall in the current page. Brings the current page up to date in the reserved
    /// slot, diffs the rest against the hot buffer, executes the loads, and returns the device
    /// page table.
    pub fn step_with_new(
        &mut self,
        id: RequestId,
        layer: usize,
        pages: &[i32],
        new_tokens: usize,
    ) -> Result<StepPlan, OffloadError> {
        let layer = self.check_layer(layer)?;
        let len = self.check_step(id, layer, pages, new_tokens)?;
        let plan = self.plan(id, layer, pages, len, new_tokens);
        self.finish(layer, plan)
    }

    /// Loads pages early, before a decode step of (request, layer) whose selection is not
    /// known yet (a speculative selection, made from an estimate of the step's queries).
    /// `pages` are checked as [`step_with_new`](Self::step_with_new) checks a selection:
    /// ascending and unique, over the request's tokens plus `new_tokens` the step will add.
    /// The hot buffer diffs them as a step would: the pages it lacks go into its evictable
    /// slots, least recently used first, loaded from the host now, and `pages` become its
    /// most recently used. The current page stays in the reserved slot, untouched. The step
    /// that follows finds them as hits. Answers what was loaded: `misses` and `loaded_pages`
    /// are the pages loaded early, `steps` is 0. These are not added to
    /// [`totals`](Self::totals), which count steps.
    pub fn prefetch(
        &mut self,
        id: RequestId,
        layer: usize,
        pages: &[i32],
        new_tokens: usize,
    ) -> Result<StepStats, OffloadError> {
        let layer = self.check_layer(layer)?;
        let len = self.check_step(id, layer, pages, new_tokens)?;
        let c = self.config;
        let r = self
            .requests
            .get_mut(&id)
            .expect("the step was checked, so the request is live");
        let current = ((len + new_tokens).div_ceil(c.page_size) - 1) as i32;
        let diff = r.hot[layer].diff(pages, current);
        let loads: Vec<Load> = diff
            .misses
            .iter()
            .map(|&(page, slot)| Load {
                layer,
                host_page: r.host_pages[page as usize],
                first: 0,
                tokens: c.page_size as u32,
                device_block: (r.base + slot as usize) as u32,
            })
            .collect();
        self.executor
            .loads(&*self.host.read(), &loads, &mut self.device[layer].write())?;
        let token_bytes = 2 * c.kv_heads * c.head_dim * size_of::<T>();
        let n = loads.len() as u64;
        Ok(StepStats {
            steps: 0,
            hits: u64::from(diff.hits),
            misses: n,
            loaded_pages: n,
            bytes: n * (c.page_size * token_bytes) as u64,
            reserved_loads: 0,
            reused_plans: 0,
        })
    }

    /// One decode step of several layers that share a selection (one selection per step, as
    /// many engines use for every layer of a group): the diff runs once, and every later
    /// layer whose hot buffer and length equal the first's takes the same plan (same slots,
    /// same loads from its own layer), counted in [`StepStats::reused_plans`]. A layer whose
    /// buffer differs gets its own diff. Every layer is checked before any changes.
    pub fn step_layers(
        &mut self,
        id: RequestId,
        layers: &[usize],
        pages: &[i32],
        new_tokens: usize,
    ) -> Result<Vec<StepPlan>, OffloadError> {
        let mut lens = Vec::with_capacity(layers.len());
        for &l in layers {
            let l = self.check_layer(l)?;
            lens.push(self.check_step(id, l, pages, new_tokens)?);
        }
        let mut out: Vec<StepPlan> = Vec::with_capacity(layers.len());
        // The first layer's buffer before and after its diff, and its plan.
        let mut shared: Option<(HotBuffer, HotBuffer, usize, usize)> = None;
        for (i, (&layer, &len)) in layers.iter().zip(&lens).enumerate() {
            let r = self
                .requests
                .get_mut(&id)
                .expect("checked above, and nothing removed it since");
            let plan = match &shared {
                Some((before, after, first_len, j))
                    if *first_len == len && r.hot[layer] == *before =>
                {
                    r.hot[layer] = after.clone();
                    let mut plan = out[*j].clone();
                    for l in &mut plan.loads {
                        l.layer = layer;
                    }
                    plan.stats.reused_plans = 1;
                    plan
                }
                _ => {
                    let before = r.hot[layer].clone();
                    let plan = self.plan(id, layer, pages, len, new_tokens);
                    let after = self.requests[&id].hot[layer].clone();
                    shared = Some((before, after, len, i));
                    plan
                }
            };
            out.push(self.finish(layer, plan)?);
        }
        Ok(out)
    }

    /// Checks a step; returns the request's length in `layer`.
    fn check_step(
        &self,
        id: RequestId,
        layer: usize,
        pages: &[i32],
        new_tokens: usize,
    ) -> Result<usize, OffloadError> {
        let c = self.config;
        let r = self.request(id)?;
        let len = r.lens[layer];
        let total = len.checked_add(new_tokens).ok_or_else(|| {
            OffloadError::Invalid(format!("{new_tokens} new tokens after {len} overflow"))
        })?;
        if total == 0 {
            return Err(OffloadError::Invalid(format!(
                "{id:?} layer {layer} holds no tokens"
            )));
        }
        if new_tokens > 0 && len / c.page_size != (total - 1) / c.page_size {
            return Err(OffloadError::Invalid(format!(
                "{new_tokens} new tokens after {len} cross a page boundary of {}",
                c.page_size
            )));
        }
        let num_pages = total.div_ceil(c.page_size);
        if let Some(w) = pages.windows(2).find(|w| w[0] >= w[1]) {
            return Err(OffloadError::Invalid(format!(
                "selection not ascending and unique at {w:?}"
            )));
        }
        if let Some(&p) = pages.iter().find(|&&p| p < 0 || p as usize >= num_pages) {
            return Err(OffloadError::Invalid(format!(
                "page {p} outside the request's {num_pages} pages"
            )));
        }
        let current = (num_pages - 1) as i32;
        let others = pages.len() - usize::from(pages.last() == Some(&current));
        if others > c.hot_pages {
            return Err(OffloadError::HotTooSmall {
                selected: others,
                hot: c.hot_pages,
            });
        }
        Ok(len)
    }

    /// Runs the diff of a checked step and builds its plan (loads not yet executed).
    fn plan(
        &mut self,
        id: RequestId,
        layer: usize,
        pages: &[i32],
        len: usize,
        new_tokens: usize,
    ) -> StepPlan {
        let c = self.config;
        let r = self
            .requests
            .get_mut(&id)
            .expect("the step was checked, so the request is live");
        let total = len + new_tokens;
        let current = (total.div_ceil(c.page_size) - 1) as i32;
        let hb = &mut r.hot[layer];
        let mut loads = Vec::new();
        // The current page: whatever of it the reserved slot lacks comes from the host; the new
        // tokens will be written straight into it.
        let reserved_block = r.base + c.hot_pages;
        let valid = total - current as usize * c.page_size;
        let on_host = len - current as usize * c.page_size;
        if hb.reserved_page != current {
            hb.reserved_page = current;
            hb.reserved_tokens = 0;
        }
        if hb.reserved_tokens < on_host {
            loads.push(Load {
                layer,
                host_page: r.host_pages[current as usize],
                first: hb.reserved_tokens as u32,
                tokens: (on_host - hb.reserved_tokens) as u32,
                device_block: reserved_block as u32,
            });
        }
        hb.reserved_tokens = valid;
        let reserved_loads = loads.len();
        let diff = hb.diff(pages, current);
        for &(page, slot) in &diff.misses {
            loads.push(Load {
                layer,
                host_page: r.host_pages[page as usize],
                first: 0,
                tokens: c.page_size as u32,
                device_block: (r.base + slot as usize) as u32,
            });
        }
        let block_table: Vec<i32> = diff
            .slots
            .iter()
            .map(|&s| (r.base + s as usize) as i32)
            .collect();
        let seq_len = pages.len() * c.page_size
            - if pages.last() == Some(&current) {
                c.page_size - valid
            } else {
                0
            };
        let token_bytes = 2 * c.kv_heads * c.head_dim * size_of::<T>();
        let stats = StepStats {
            steps: 1,
            hits: u64::from(diff.hits),
            misses: diff.misses.len() as u64,
            loaded_pages: diff.misses.len() as u64,
            bytes: loads.iter().map(|l| u64::from(l.tokens)).sum::<u64>() * token_bytes as u64,
            reserved_loads: reserved_loads as u64,
            reused_plans: 0,
        };
        StepPlan {
            block_table,
            seq_len,
            new_slots: (on_host..valid)
                .map(|off| (reserved_block * c.page_size + off) as i32)
                .collect(),
            loads,
            stats,
        }
    }

    /// Executes a plan's loads and counts its statistics.
    fn finish(&mut self, layer: usize, plan: StepPlan) -> Result<StepPlan, OffloadError> {
        self.executor.loads(
            &*self.host.read(),
            &plan.loads,
            &mut self.device[layer].write(),
        )?;
        self.totals.add(&plan.stats);
        Ok(plan)
    }
}
