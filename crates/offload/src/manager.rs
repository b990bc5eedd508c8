//! SparseKVCacheManager: host pool, device hot buffers, the diff and the loads.

use std::sync::Arc;

use attn_op::{Element, KvCache, KvLayout, PagedKv};
use kv_blocks::RequestId;
use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::exec::{Load, execute_loads};
use crate::host::{HostLayout, HostPool, HostShape, HostStore};
use crate::hot::HotBuffer;
use crate::{OffloadError, StepStats};

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
            .max_requests
            .checked_mul(c.hot_pages + 1)
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
        Ok(SparseKvCacheManager {
            config,
            host: Arc::new(RwLock::new(host)),
            free_host: (0..c.host_pages as u32).rev().collect(),
            device,
            free_bases: (0..c.max_requests)
                .rev()
                .map(|r| r * (c.hot_pages + 1))
                .collect(),
            requests: FxHashMap::default(),
            totals: StepStats::default(),
        })
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
                host_pages: Vec::new(),
                lens: vec![0; c.layers],
                hot: vec![HotBuffer::new(c.hot_pages); c.layers],
            },
        );
        Ok(())
    }

    /// Ends a request: its host pages and device buffer go back to the pools.
    pub fn end_request(&mut self, id: RequestId) -> Result<(), OffloadError> {
        let r = self
            .requests
            .remove(&id)
            .ok_or(OffloadError::UnknownRequest(id))?;
        self.free_host.extend(r.host_pages.iter().rev());
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
        let r = self
            .requests
            .get(&id)
            .ok_or(OffloadError::UnknownRequest(id))?;
        let start = r.lens[layer];
        let need = (start + n)
            .div_ceil(c.page_size)
            .saturating_sub(r.host_pages.len());
        if need > self.free_host.len() {
            return Err(OffloadError::HostExhausted {
                needed: need,
                free: self.free_host.len(),
            });
        }
        let at = self.free_host.len() - need;
        let taken: Vec<u32> = self.free_host.drain(at..).rev().collect();
        let r = self
            .requests
            .get_mut(&id)
            .expect("looked up above, and nothing removed it since");
        r.host_pages.extend(taken);
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

    /// One decode step of (request, layer): `pages` are the selected logical pages, ascending
    /// and unique (the union over KV heads of a selection). Brings the current page up to date
    /// in the reserved slot, diffs the rest against the hot buffer, executes the loads, and
    /// returns the device page table.
    pub fn step(
        &mut self,
        id: RequestId,
        layer: usize,
        pages: &[i32],
    ) -> Result<StepPlan, OffloadError> {
        let c = self.config;
        let layer = self.check_layer(layer)?;
        let r = self
            .requests
            .get_mut(&id)
            .ok_or(OffloadError::UnknownRequest(id))?;
        let len = r.lens[layer];
        let num_pages = len.div_ceil(c.page_size);
        if len == 0 {
            return Err(OffloadError::Invalid(format!(
                "{id:?} layer {layer} holds no tokens"
            )));
        }
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
        let hb = &mut r.hot[layer];
        let mut loads = Vec::new();
        // The current page: whatever of it the reserved slot lacks comes from the host.
        let reserved_block = (r.base + c.hot_pages) as u32;
        let valid = len - current as usize * c.page_size;
        if hb.reserved_page != current {
            hb.reserved_page = current;
            hb.reserved_tokens = 0;
        }
        if hb.reserved_tokens < valid {
            loads.push(Load {
                layer,
                host_page: r.host_pages[current as usize],
                first: hb.reserved_tokens as u32,
                tokens: (valid - hb.reserved_tokens) as u32,
                device_block: reserved_block,
            });
            hb.reserved_tokens = valid;
        }
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
        };
        execute_loads(&*self.host.read(), &loads, &mut self.device[layer].write())?;
        self.totals.add(&stats);
        Ok(StepPlan {
            block_table,
            seq_len,
            loads,
            stats,
        })
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
