//! Executing transfers: host → device page loads (the diff's misses), kv-blocks' tier moves,
//! and a worker thread that runs loads of the next layer while the current one computes.

use std::sync::Arc;
use std::thread::JoinHandle;

use attn_op::{Element, KvCache, KvLayout, PagedKv};
use crossbeam::channel::{Receiver, Sender, bounded, unbounded};
use kv_blocks::{Tier, Transfer};
use parking_lot::RwLock;

use crate::OffloadError;
use crate::host::{HostShape, HostStore};

/// One load: tokens `first..first + tokens` of a host page into the same offsets of a device
/// block of `layer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Load {
    /// The layer.
    pub layer: usize,
    /// Host page.
    pub host_page: u32,
    /// First token of the page to copy.
    pub first: u32,
    /// Tokens to copy.
    pub tokens: u32,
    /// Device block.
    pub device_block: u32,
}

/// Whatever moves KV between tiers: the CPU executor copies memory ([`CpuExecutor`]); the CUDA
/// backend implements it with its zero-copy gather kernel. The manager hands every step's load
/// list to its executor ([`SparseKvCacheManager::with_executor`]).
///
/// [`SparseKvCacheManager::with_executor`]: crate::SparseKvCacheManager::with_executor
pub trait TransferExecutor<T: Element>: Send + Sync + std::fmt::Debug {
    /// Executes a step's loads (host page ranges into device blocks of one layer); checks them
    /// all before copying any.
    fn loads(
        &self,
        host: &dyn HostStore<T>,
        loads: &[Load],
        device: &mut PagedKv<T>,
    ) -> Result<(), OffloadError>;

    /// Executes kv-blocks' tier moves for one window group over per-layer block tensors.
    fn block_transfers(
        &self,
        transfers: &[Transfer],
        primary: &mut [PagedKv<T>],
        secondary: &mut [PagedKv<T>],
    ) -> Result<(), OffloadError>;
}

/// The CPU executor: [`execute_loads`] and [`execute_block_transfers`].
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuExecutor;

impl<T: Element> TransferExecutor<T> for CpuExecutor {
    fn loads(
        &self,
        host: &dyn HostStore<T>,
        loads: &[Load],
        device: &mut PagedKv<T>,
    ) -> Result<(), OffloadError> {
        execute_loads(host, loads, device)
    }

    fn block_transfers(
        &self,
        transfers: &[Transfer],
        primary: &mut [PagedKv<T>],
        secondary: &mut [PagedKv<T>],
    ) -> Result<(), OffloadError> {
        execute_block_transfers(transfers, primary, secondary)
    }
}

/// Executes loads with plain memory copies (the CPU executor; the CUDA backend runs a zero-copy
/// kernel over the same list). Checks every load before copying any.
pub fn execute_loads<T: Element>(
    host: &dyn HostStore<T>,
    loads: &[Load],
    device: &mut PagedKv<T>,
) -> Result<(), OffloadError> {
    let shape = host.shape();
    let layout = device.layout();
    check_loads(shape, layout, loads)?;
    let stride = layout.token_stride();
    let page = shape.page_size * stride;
    let (mut bk, mut bv) = (vec![T::default(); page], vec![T::default(); page]);
    let (k, v) = device.tensors_mut();
    for l in loads {
        let n = (l.first + l.tokens) as usize * stride;
        host.read_page(l.layer, l.host_page as usize, &mut bk[..n], &mut bv[..n]);
        let a = l.first as usize * stride;
        let dst = l.device_block as usize * page;
        k[dst + a..dst + n].copy_from_slice(&bk[a..n]);
        v[dst + a..dst + n].copy_from_slice(&bv[a..n]);
    }
    Ok(())
}

/// Checks that `loads` fit a host pool of `shape` and a device pool of `layout` (the same page
/// shape, every page, block and token range inside), for the CPU and the device executors.
pub(crate) fn check_loads(
    shape: HostShape,
    layout: KvLayout,
    loads: &[Load],
) -> Result<(), OffloadError> {
    if layout.block_size != shape.page_size
        || layout.kv_heads != shape.kv_heads
        || layout.head_dim != shape.head_dim
    {
        return Err(OffloadError::Invalid(format!(
            "device pool {layout:?} does not match host pages {shape:?}"
        )));
    }
    match loads.iter().find(|l| {
        l.layer >= shape.layers
            || l.host_page as usize >= shape.pages
            || l.device_block as usize >= layout.num_blocks
            || l.first as usize + l.tokens as usize > shape.page_size
    }) {
        Some(l) => Err(OffloadError::Invalid(format!("load out of range: {l:?}"))),
        None => Ok(()),
    }
}

/// Executes kv-blocks' transfer commands for one window group over per-layer block tensors of
/// both tiers (`primary[l]`, `secondary[l]`), in order: offloads, onboards and partial copies.
pub fn execute_block_transfers<T: Element>(
    transfers: &[Transfer],
    primary: &mut [PagedKv<T>],
    secondary: &mut [PagedKv<T>],
) -> Result<(), OffloadError> {
    if primary.len() != secondary.len() {
        return Err(OffloadError::Invalid(format!(
            "{} primary and {} secondary layers",
            primary.len(),
            secondary.len()
        )));
    }
    for (p, s) in primary.iter().zip(secondary.iter()) {
        let (a, b) = (p.layout(), s.layout());
        if (a.block_size, a.kv_heads, a.head_dim) != (b.block_size, b.kv_heads, b.head_dim) {
            return Err(OffloadError::Invalid(format!(
                "tier layouts differ: {a:?} vs {b:?}"
            )));
        }
    }
    let blocks = |t: Tier| match t {
        Tier::Primary => primary.first().map_or(0, |p| p.layout().num_blocks),
        Tier::Secondary => secondary.first().map_or(0, |p| p.layout().num_blocks),
    };
    for t in transfers {
        for loc in [t.src, t.dst] {
            if loc.block.index() >= blocks(loc.tier) {
                return Err(OffloadError::Invalid(format!(
                    "transfer out of range: {t:?}"
                )));
            }
        }
    }
    for l in 0..primary.len() {
        for t in transfers {
            let layout = primary[l].layout();
            let stride = layout.token_stride();
            let page = layout.block_size * stride;
            let n = t
                .num_tokens
                .map_or(layout.block_size, |n| n as usize)
                .min(layout.block_size)
                * stride;
            let (src_o, dst_o) = (t.src.block.index() * page, t.dst.block.index() * page);
            let copy = |src: &PagedKv<T>, dst_k: &mut [T], dst_v: &mut [T]| {
                dst_k[dst_o..dst_o + n].copy_from_slice(&src.k()[src_o..src_o + n]);
                dst_v[dst_o..dst_o + n].copy_from_slice(&src.v()[src_o..src_o + n]);
            };
            match (t.src.tier, t.dst.tier) {
                (Tier::Primary, Tier::Secondary) => {
                    let (k, v) = secondary[l].tensors_mut();
                    copy(&primary[l], k, v);
                }
                (Tier::Secondary, Tier::Primary) => {
                    let (k, v) = primary[l].tensors_mut();
                    copy(&secondary[l], k, v);
                }
                (tier, _) => {
                    let pool = if tier == Tier::Primary {
                        &mut primary[l]
                    } else {
                        &mut secondary[l]
                    };
                    let (k, v) = pool.tensors_mut();
                    k.copy_within(src_o..src_o + n, dst_o);
                    v.copy_within(src_o..src_o + n, dst_o);
                }
            }
        }
    }
    Ok(())
}

/// A load job for the [`Pipeline`]: loads of one layer between shared pools.
pub struct Job<T: Element> {
    /// The host pool to read.
    pub host: Arc<RwLock<dyn HostStore<T>>>,
    /// The layer's device pool to write.
    pub device: Arc<RwLock<PagedKv<T>>>,
    /// What to copy.
    pub loads: Vec<Load>,
}

/// The completion event of a submitted job.
#[derive(Debug)]
pub struct Ticket(Receiver<Result<(), OffloadError>>);

impl Ticket {
    /// Blocks until the job is done and returns its result.
    pub fn wait(self) -> Result<(), OffloadError> {
        self.0
            .recv()
            .unwrap_or_else(|_| Err(OffloadError::Invalid("the IO worker stopped".to_owned())))
    }
}

/// A job with the sender that completes its ticket.
type Queued<T> = (Job<T>, Sender<Result<(), OffloadError>>);

/// A worker thread executing load jobs in submission order, so the loads of layer `l + 1`
/// run while layer `l` computes; each job completes a [`Ticket`] (a per-layer event).
pub struct Pipeline<T: Element> {
    jobs: Option<Sender<Queued<T>>>,
    worker: Option<JoinHandle<()>>,
}

impl<T: Element> Pipeline<T> {
    /// Starts the worker.
    pub fn new() -> Self {
        let (tx, rx) = unbounded::<Queued<T>>();
        let worker = std::thread::spawn(move || {
            for (job, done) in rx {
                let r = execute_loads(&*job.host.read(), &job.loads, &mut job.device.write());
                // A dropped ticket means nobody waits; the loads happened all the same.
                let _ = done.send(r);
            }
        });
        Pipeline {
            jobs: Some(tx),
            worker: Some(worker),
        }
    }

    /// Queues a job; its ticket completes when the loads are in the device pool.
    pub fn submit(&self, job: Job<T>) -> Ticket {
        let (done, ticket) = bounded(1);
        if let Some(jobs) = &self.jobs
            && let Err(e) = jobs.send((job, done))
        {
            let (_, done) = e.into_inner();
            let _ = done.send(Err(OffloadError::Invalid(
                "the IO worker stopped".to_owned(),
            )));
        }
        Ticket(ticket)
    }
}

impl<T: Element> Default for Pipeline<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Element> Drop for Pipeline<T> {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
