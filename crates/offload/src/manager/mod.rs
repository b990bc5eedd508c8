//! SparseKVCacheManager: host pool, device hot buffers, the diff and the loads.

use std::sync::Arc;

use attn_op::{Element, KvCache, KvLayout, PagedKv};
use kv_blocks::RequestId;
use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::exec::{CpuExecutor, Load, TransferExecutor};
use crate::host::{HostLayout, HostPool, HostShape, HostStore};
use crate::hot::HotBuffer;
use crate::{OffloadError, StepStats};

mod step;

/// Settings of a [`SparseKvCacheManager`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadConfig {
    /// Tokens per page, on the host and in the device hot buffer.
    pub page_size: usize,
    /// LRU slots (pages) per (request, layer) hot buffer, besides the reserved slot for the
    /// current page; at least the number of pages a step selects (2–4x is typical).
    pub hot_pages: usize,
    /// Layers.
    pub layers: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Pages in the host pool, shared by every request.
    pub host_pages: usize,
    /// Requests that can be in sparse mode at once (device hot buffers).
    pub max_requests: usize,
    /// Layout of the host pool.
    pub layout: HostLayout,
    /// Who picks a request's host pages.
    #[serde(default)]
    pub host_alloc: HostAlloc,
}

/// Who picks the host pages of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostAlloc {
    /// The manager keeps a free list and takes pages as tokens arrive.
    #[default]
    Own,
    /// The caller gives them ([`SparseKvCacheManager::begin_request_with_prefix`],
    /// [`SparseKvCacheManager::extend_host_pages`]): host page `i` is kv-blocks' secondary
    /// (host tier) block `i`, so a prefix cached in the host tier is used where it lies, and
    /// the pages are the caller's to free.
    External,
}

/// The device page table of one (request, layer) step, ready for attention over the device
/// pool: `block_table[i]` is the device block holding the i-th selected page, and `seq_len`
/// counts the selected tokens (the current page counts only its valid tokens, so when it is
/// selected it must be last, which ascending selections guarantee).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepPlan {
    /// Device blocks of the selected pages, in selection order.
    pub block_table: Vec<i32>,
    /// Tokens covered by the selected pages.
    pub seq_len: usize,
    /// Device slots (`block * page_size + offset`) of the step's new tokens, in order, for the
    /// engine's `set_kv` before attention (empty for [`SparseKvCacheManager::step`]).
    pub new_slots: Vec<i32>,
    /// The loads this step needs (already executed by [`SparseKvCacheManager::step`]).
    pub loads: Vec<Load>,
    /// Hits, misses and bytes of the step.
    pub stats: StepStats,
}

/// Per request: device blocks, host pages, tokens per layer, one hot buffer per layer.
#[derive(Clone, Debug)]
struct Request {
    base: usize,
    host_pages: Vec<u32>,
    lens: Vec<usize>,
    hot: Vec<HotBuffer>,
}

/// The hierarchical KV cache of sparse-mode requests (SGLang's SparseKVCacheManager and
/// HiSparse in one): every token of every request lives in a host pool; the device keeps, per
/// (request, layer), a hot buffer of `hot_pages` pages in LRU order plus a reserved slot for the
/// current page. Each decode step's selection is diffed against the buffer: hits stay, misses
/// take the least recently used evictable slots and are loaded from the host; nothing selected
/// is evicted and nothing resident is reloaded.
///
/// The device tier is one [`PagedKv`] per layer with `max_requests * (hot_pages + 1)` blocks
/// of `page_size` tokens (on the CPU, a second memory region; the CUDA backend swaps in device
/// memory behind the same layout). Request `r` owns blocks `r * (hot_pages + 1)..` in every
/// layer.
#[derive(Debug)]
pub struct SparseKvCacheManager<T: Element> {
    config: OffloadConfig,
    host: Arc<RwLock<HostPool<T>>>,
    free_host: Vec<u32>,
    device: Vec<Arc<RwLock<PagedKv<T>>>>,
    free_bases: Vec<usize>,
    requests: FxHashMap<RequestId, Request>,
    totals: StepStats,
    executor: Box<dyn TransferExecutor<T>>,
}

impl<T: Element> SparseKvCacheManager<T> {
    /// Allocates the host pool and the device pools.
    pub fn new(config: OffloadConfig) -> Result<Self, OffloadError> {
        let c = config;
        if [
            c.page_size,
            c.hot_pages,
            c.layers,
            c.kv_heads,
            c.head_dim,
            c.max_requests,
        ]
        .contains(&0)
        {
            return Err(OffloadError::Config(format!("a zero size in {c:?}")));
        }
        if u32::try_from(c.host_pages).is_err() {
            return Err(OffloadError::Config(format!(
                "{} host pages exceed the u32 page ids",
                c.host_pages
            )));
        }
        let too_big = || OffloadError::Config(format!("pools of {c:?} overflow memory"));
        let host = HostPool::new(
            HostShape {
                layers: c.layers,
                pages: c.host_pages,
                page_size: c.page_size,
                kv_heads: c.kv_heads,
                head_dim: c.head_dim,
            },
            c.layout,
        )
        .ok_or_else(too_big)?;
        let blocks = c
            .hot_pages
            .checked_add(1)
            .and_then(|per| per.checked_mul(c.max_requests))
            .ok_or_else(too_big)?;
        let layout = KvLayout {
            num_blocks: blocks,
            block_size: c.page_size,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
        };
        let device = (0..c.layers)
            .map(|_| PagedKv::new(layout).map(|kv| Arc::new(RwLock::new(kv))))
            .collect::<Result<_, _>>()?;
        let own = c.host_alloc == HostAlloc::Own;
        Ok(SparseKvCacheManager {
            config,
            host: Arc::new(RwLock::new(host)),
            free_host: (0..c.host_pages as u32).rev().filter(|_| own).collect(),
            device,
            free_bases: (0..c.max_requests)
                .rev()
                .map(|r| r * (c.hot_pages + 1))
                .collect(),
            requests: FxHashMap::default(),
            totals: StepStats::default(),
            executor: Box::new(CpuExecutor),
        })
    }

    /// Replaces the executor that runs each step's loads (the default is [`CpuExecutor`]).
    pub fn with_executor(mut self, executor: Box<dyn TransferExecutor<T>>) -> Self {
        self.executor = executor;
        self
    }

    /// The configuration.
    pub fn config(&self) -> OffloadConfig {
        self.config
    }

    /// The device pool of `layer`, `[max_requests * (hot_pages + 1), page_size, heads, dim]`.
    pub fn device(&self, layer: usize) -> Arc<RwLock<PagedKv<T>>> {
        Arc::clone(&self.device[layer])
    }

    /// The host pool.
    pub fn host(&self) -> Arc<RwLock<HostPool<T>>> {
        Arc::clone(&self.host)
    }

    /// Free host pages.
    pub fn free_host_pages(&self) -> usize {
        self.free_host.len()
    }

    /// Live requests.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Totals over every step so far.
    pub fn totals(&self) -> StepStats {
        self.totals
    }

    /// Starts a sparse-mode request: takes a device hot buffer for it in every layer.
    pub fn begin_request(&mut self, id: RequestId) -> Result<(), OffloadError> {
        self.begin(id, Vec::new(), 0)
    }

    /// Starts a sparse-mode request whose first `tokens` tokens already lie in the host pool,
    /// every layer, in `pages` (logical order; [`HostAlloc::External`] only): a prefix reused
    /// from kv-blocks' host tier. Nothing is copied; the first decode step loads only what its
    /// selection needs.
    pub fn begin_request_with_prefix(
        &mut self,
        id: RequestId,
        pages: &[u32],
        tokens: usize,
    ) -> Result<(), OffloadError> {
        self.check_external(pages)?;
        if tokens > pages.len() * self.config.page_size {
            return Err(OffloadError::Invalid(format!(
                "{tokens} prefix tokens in {} pages of {}",
                pages.len(),
                self.config.page_size
            )));
        }
        self.begin(id, pages.to_vec(), tokens)
    }

    /// Gives a request more host pages, after those it has ([`HostAlloc::External`] only).
    pub fn extend_host_pages(&mut self, id: RequestId, pages: &[u32]) -> Result<(), OffloadError> {
        self.check_external(pages)?;
        self.requests
            .get_mut(&id)
            .ok_or(OffloadError::UnknownRequest(id))?
            .host_pages
            .extend_from_slice(pages);
        Ok(())
    }

    fn check_external(&self, pages: &[u32]) -> Result<(), OffloadError> {
        if self.config.host_alloc != HostAlloc::External {
            return Err(OffloadError::Config(
                "host pages are given by the caller only with host_alloc = external".into(),
            ));
        }
        match pages
            .iter()
            .find(|&&p| p as usize >= self.config.host_pages)
        {
            Some(p) => Err(OffloadError::Invalid(format!(
                "host page {p} outside the pool of {}",
                self.config.host_pages
            ))),
            None => Ok(()),
        }
    }

    fn begin(
        &mut self,
        id: RequestId,
        host_pages: Vec<u32>,
        tokens: usize,
    ) -> Result<(), OffloadError> {
        if self.requests.contains_key(&id) {
            return Err(OffloadError::DuplicateRequest(id));
        }
        let base = self
            .free_bases
            .pop()
            .ok_or(OffloadError::NoDeviceBuffer(self.config.max_requests))?;
        let c = self.config;
        self.requests.insert(
            id,
            Request {
                base,
                host_pages,
                lens: vec![tokens; c.layers],
                hot: vec![HotBuffer::new(c.hot_pages); c.layers],
            },
        );
        Ok(())
    }

    /// Ends a request: its device buffer goes back, and its host pages too unless the caller
    /// gave them ([`HostAlloc::External`]).
    pub fn end_request(&mut self, id: RequestId) -> Result<(), OffloadError> {
        let r = self
            .requests
            .remove(&id)
            .ok_or(OffloadError::UnknownRequest(id))?;
        if self.config.host_alloc == HostAlloc::Own {
            self.free_host.extend(r.host_pages.iter().rev());
        }
        self.free_bases.push(r.base);
        Ok(())
    }

    /// Tokens of `layer` the host holds for the request.
    pub fn len(&self, id: RequestId, layer: usize) -> Result<usize, OffloadError> {
        Ok(self.request(id)?.lens[self.check_layer(layer)?])
    }

    /// The host pages of a request, in logical order.
    pub fn host_pages(&self, id: RequestId) -> Result<&[u32], OffloadError> {
        Ok(&self.request(id)?.host_pages)
    }

    /// The hot buffer of (request, layer).
    pub fn hot_buffer(&self, id: RequestId, layer: usize) -> Result<&HotBuffer, OffloadError> {
        Ok(&self.request(id)?.hot[self.check_layer(layer)?])
    }

    /// Host pages an append of `n` tokens to (request, layer) would take.
    pub fn host_pages_needed(
        &self,
        id: RequestId,
        layer: usize,
        n: usize,
    ) -> Result<usize, OffloadError> {
        let r = self.request(id)?;
        let len = r.lens[self.check_layer(layer)?];
        Ok(len
            .saturating_add(n)
            .div_ceil(self.config.page_size)
            .saturating_sub(r.host_pages.len()))
    }

    /// Appends tokens to the host copy of `layer` (`k` and `v` are `[n, kv_heads, head_dim]`):
    /// the prompt after prefill, or each decode token's backup. Host pages are taken as needed;
    /// if the pool cannot hold them, nothing is written. A token of the page in the reserved
    /// slot is written there too.
    pub fn append(
        &mut self,
        id: RequestId,
        layer: usize,
        k: &[T],
        v: &[T],
    ) -> Result<(), OffloadError> {
        let c = self.config;
        let layer = self.check_layer(layer)?;
        let stride = c.kv_heads * c.head_dim;
        if k.len() != v.len() || !k.len().is_multiple_of(stride) {
            return Err(OffloadError::Invalid(format!(
                "k and v of {} and {} elements for tokens of {stride}",
                k.len(),
                v.len()
            )));
        }
        let n = k.len() / stride;
        let start = self.take_host_pages(id, layer, n)?;
        let r = self
            .requests
            .get_mut(&id)
            .expect("take_host_pages found it, and nothing removed it since");
        let mut host = self.host.write();
        let mut device = self.device[layer].write();
        let hb = &mut r.hot[layer];
        let reserved_block = r.base + c.hot_pages;
        for i in 0..n {
            let pos = start + i;
            let (page, off) = (pos / c.page_size, pos % c.page_size);
            let (tk, tv) = (
                &k[i * stride..(i + 1) * stride],
                &v[i * stride..(i + 1) * stride],
            );
            host.write_token(layer, r.host_pages[page] as usize, off, tk, tv);
            if off == 0 && hb.reserved_page >= 0 && hb.reserved_page + 1 == page as i32 {
                // A new page begins while decoding: it takes over the reserved slot (the page
                // just completed stays on the host, like any other page).
                hb.reserved_page = page as i32;
                hb.reserved_tokens = 0;
            }
            if hb.reserved_page == page as i32 && hb.reserved_tokens == off {
                let slot = (reserved_block * c.page_size + off) as i32;
                device.set_kv(&[slot], tk, tv)?;
                hb.reserved_tokens += 1;
            }
        }
        r.lens[layer] = start + n;
        Ok(())
    }

    /// Takes the host positions of the next `n` tokens of (request, `layer`) without writing
    /// them: host pages as [`append`](Self::append) takes them, the length advanced, and the
    /// tokens' rows within the layer's host tensor (`host_page * page_size + offset`)
    /// answered for the caller to fill (a device kernel writing the page-locked pool, say)
    /// before anything reads them. The reserved slot of the request's hot buffer is not
    /// written: a caller that reserves keeps its own device copy. If the pool cannot hold the
    /// tokens, nothing changes.
    pub fn reserve_tokens(
        &mut self,
        id: RequestId,
        layer: usize,
        n: usize,
    ) -> Result<Vec<usize>, OffloadError> {
        let layer = self.check_layer(layer)?;
        let start = self.take_host_pages(id, layer, n)?;
        let ps = self.config.page_size;
        let r = self
            .requests
            .get_mut(&id)
            .expect("take_host_pages found it, and nothing removed it since");
        r.lens[layer] = start + n;
        Ok((start..start + n)
            .map(|pos| r.host_pages[pos / ps] as usize * ps + pos % ps)
            .collect())
    }

    /// Gives (request, `layer`) the host pages `n` more tokens need and answers its length
    /// before them; nothing changes when the pool cannot hold them.
    fn take_host_pages(
        &mut self,
        id: RequestId,
        layer: usize,
        n: usize,
    ) -> Result<usize, OffloadError> {
        let c = self.config;
        let r = self
            .requests
            .get_mut(&id)
            .ok_or(OffloadError::UnknownRequest(id))?;
        let start = r.lens[layer];
        // Saturating: a count past `usize` needs more pages than any pool has.
        let need = start
            .saturating_add(n)
            .div_ceil(c.page_size)
            .saturating_sub(r.host_pages.len());
        if need > 0 && c.host_alloc == HostAlloc::External {
            return Err(OffloadError::MissingHostPages { needed: need });
        }
        if need > self.free_host.len() {
            return Err(OffloadError::HostExhausted {
                needed: need,
                free: self.free_host.len(),
            });
        }
        let at = self.free_host.len() - need;
        r.host_pages.extend(self.free_host.drain(at..).rev());
        Ok(start)
    }

    fn request(&self, id: RequestId) -> Result<&Request, OffloadError> {
        self.requests
            .get(&id)
            .ok_or(OffloadError::UnknownRequest(id))
    }

    fn check_layer(&self, layer: usize) -> Result<usize, OffloadError> {
        if layer < self.config.layers {
            Ok(layer)
        } else {
            Err(OffloadError::Invalid(format!(
                "layer {layer} of {}",
                self.config.layers
            )))
        }
    }
}
