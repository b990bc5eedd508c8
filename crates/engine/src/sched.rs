//! The batching scheduler: many requests at once through one model, with continuous batching,
//! chunked prefill, kv-blocks allocation and prefix reuse, admission by a device-memory
//! budget, per-request sparse configurations, streamed tokens and cancellation.

use std::collections::VecDeque;
use std::time::Instant;

use attn_op::Element;
use coordinator::{Capacity, Mode, SparseConfig, SparseCoordinator};
use kv_blocks::{GroupId, KvCacheConfig, KvCacheManager, RequestId, RequestSpec, Tier};
use offload::{HostAlloc, StepStats};
use serde::{Deserialize, Serialize};

use crate::capacity::{BlockGeometry, Footprint, footprint};
use crate::error::RequestError;
use crate::kv::{Batch, KvStore};
use crate::model::{Model, ModelConfig};
use crate::sample::{Sampler, Sampling};
use crate::step::{GroupRun, StepAttention};
use crate::{EngineError, Tokenizer};

/// A batching engine over one model: [`submit`](Self::submit) requests, call
/// [`step`](Self::step) until [`is_idle`](Self::is_idle), and read the [`Event`]s each step
/// returns (tokens as they are sampled, then a report per finished request).
///
/// Memory, in the terms of the layers below:
/// - the **device tier** is kv-blocks' primary pool (the engine's own [`KvStore`]: dense
///   requests, and every request during its prefill) plus, per sparse-mode request, the
///   coordinator's hot buffers and representations;
/// - the **host tier** is kv-blocks' secondary pool (cached prefix blocks evicted from the
///   device) and each sparse configuration's host KV pool.
///
/// A request is admitted (first come, first served) only when its worst case fits what the
/// running requests have reserved of [`SchedulerConfig::device_bytes`]: a dense request
/// reserves the blocks of its prompt and every token it may generate; a sparse-mode request
/// whose layers are all sparse reserves its prompt's blocks until its prefill ends, then
/// only its hot buffers and representations (its blocks go back to kv-blocks, which keeps
/// the full ones for prefix reuse). A sparse-mode request with dense layers keeps its blocks:
/// those layers read them. Reservations count shared prefix blocks once per request, so an
/// admitted request never runs out of blocks and nothing is ever preempted.
pub struct Scheduler<'m, T: Element> {
    model: &'m Model,
    tokenizer: Option<&'m Tokenizer>,
    config: SchedulerConfig,
    kv: KvCacheManager,
    device: KvStore<T>,
    host: KvStore<T>,
    coords: Vec<Coord<T>>,
    waiting: VecDeque<Pending>,
    running: Vec<Live>,
    next_id: u64,
    reserved: u64,
    block_bytes: u64,
    poisoned: bool,
}

/// Sizes and limits of a [`Scheduler`] (TOML `[engine]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Tokens per KV block (a power of two ≥ 2).
    pub block_size: usize,
    /// The device budget in bytes: KV blocks, hot buffers and representations.
    pub device_bytes: u64,
    /// Bytes of kv-blocks' host tier (cached prefix blocks offloaded from the device).
    pub host_bytes: u64,
    /// Bytes of each sparse configuration's host KV pool.
    pub sparse_host_bytes: u64,
    /// Sparse-mode requests at once per sparse configuration.
    pub sparse_slots: usize,
    /// New tokens per forward: every decode token, then prefill chunks up to this.
    pub max_batch_tokens: usize,
    /// Requests running at once.
    pub max_running: usize,
    /// Longest sequence (prompt and generation); `None`: the model's context.
    pub max_seq: Option<usize>,
}

impl SchedulerConfig {
    /// Checks the sizes that every use of the table needs: a block size that is a power of two
    /// ≥ 2, and at least one batch token and one running request.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bs = self.block_size;
        if bs < 2 || !bs.is_power_of_two() || self.max_batch_tokens == 0 {
            return Err(EngineError::Invalid(format!(
                "block_size {bs} (a power of two ≥ 2) and max_batch_tokens {} (≥ 1)",
                self.max_batch_tokens
            )));
        }
        if self.max_running == 0 {
            return Err(EngineError::Invalid("max_running 0".into()));
        }
        Ok(())
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            block_size: 16,
            device_bytes: 1 << 30,
            host_bytes: 1 << 30,
            sparse_host_bytes: 1 << 30,
            sparse_slots: 4,
            max_batch_tokens: 512,
            max_running: 16,
            max_seq: None,
        }
    }
}

/// One request.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// How tokens are picked and when generation stops.
    pub sampling: Sampling,
    /// Hierarchical sparse attention for this request; `None`: dense.
    pub sparse: Option<SparseConfig>,
}

/// What a [`Scheduler::step`] reports.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A request was admitted: its blocks are allocated, `reused_tokens` of its prompt came
    /// from the prefix cache, and it runs in sparse mode or not.
    Admitted {
        /// The request.
        id: u64,
        /// Prompt tokens reused from earlier requests.
        reused_tokens: usize,
        /// Whether it runs hierarchical sparse attention.
        sparse: bool,
    },
    /// A token was sampled (it is part of the output).
    Token {
        /// The request.
        id: u64,
        /// The token.
        token: u32,
    },
    /// A request finished; its memory is released.
    Finished(Box<Report>),
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model's end-of-sequence token (not in the output).
    Eos,
    /// `max_tokens` were generated.
    Length,
    /// A stop string appeared.
    Stop,
    /// [`Scheduler::cancel`].
    Cancelled,
}

/// A finished request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// The request.
    pub id: u64,
    /// Why it ended.
    pub reason: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens reused from the prefix cache.
    pub reused_tokens: usize,
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Whether it ran in sparse mode.
    pub sparse: bool,
    /// Device bytes it reserved at most (during its prefill).
    pub device_bytes: u64,
    /// Device bytes it reserved while decoding.
    pub decode_device_bytes: u64,
    /// Seconds from submission to admission.
    pub queued_s: f64,
    /// Seconds from submission to the first token (`None`: none was sampled).
    pub first_token_s: Option<f64>,
    /// Seconds from submission to the end.
    pub total_s: f64,
}

/// What the scheduler holds right now: after every request ended, only `cached` blocks may
/// remain in either tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Requests admitted and not finished.
    pub running: usize,
    /// Device bytes the running requests reserved.
    pub reserved_bytes: u64,
    /// Device blocks referenced by requests.
    pub device_blocks_used: u32,
    /// Device blocks kept only for prefix reuse.
    pub device_blocks_cached: u32,
    /// Host blocks referenced by requests.
    pub host_blocks_used: u32,
    /// Host blocks kept only for prefix reuse.
    pub host_blocks_cached: u32,
    /// Pages of the sparse host pools taken by requests.
    pub sparse_host_pages_used: usize,
    /// Requests in sparse mode.
    pub sparse_requests: usize,
}

/// A sparse configuration's coordinator and its ledgers.
struct Coord<T: Element> {
    config: SparseConfig,
    coord: SparseCoordinator<T>,
    /// Host pages reserved by its requests, the pool's size, and the bytes of a page.
    host_reserved: usize,
    host_pages: usize,
    page_bytes: u64,
    /// Sparse-mode requests it holds.
    requests: usize,
}

/// A submitted request not yet admitted.
struct Pending {
    id: u64,
    request: Request,
    /// Index into `coords` of its sparse configuration.
    coord: Option<usize>,
    submitted: Instant,
}

/// A running request.
struct Live {
    id: u64,
    prompt: Vec<u32>,
    sampling: Sampling,
    sampler: Sampler,
    /// Its coordinator, while it runs in sparse mode.
    coord: Option<usize>,
    /// Whether it holds kv-blocks blocks (and writes its KV to the device store).
    on_device: bool,
    /// Whether its blocks go back when its prefill ends (sparse mode, every layer sparse).
    drop_blocks: bool,
    /// Tokens whose KV is written: positions `0..computed`.
    computed: usize,
    /// Generated tokens; the last one waits for its forward.
    out: Vec<u32>,
    reserve: u64,
    decode_reserve: u64,
    host_pages: usize,
    report: Report,
    submitted: Instant,
}

impl Live {
    fn rid(&self) -> RequestId {
        RequestId(self.id)
    }

    fn prefilling(&self) -> bool {
        self.computed < self.prompt.len()
    }
}

/// What a step's forward takes besides the batch (which knows the tokens' positions): every
/// new token, and the rows whose logits are sampled.
#[derive(Default)]
struct Inputs {
    tokens: Vec<u32>,
    logits_for: Vec<usize>,
}

impl<'m, T: Element> Scheduler<'m, T> {
    /// A scheduler over `model`; `tokenizer` is needed for stop strings and end-of-sequence.
    pub fn new(
        model: &'m Model,
        tokenizer: Option<&'m Tokenizer>,
        config: SchedulerConfig,
    ) -> Result<Self, EngineError> {
        let c = &model.config;
        config.validate()?;
        let bs = config.block_size;
        let block_bytes = c.kv_bytes_per_token(size_of::<T>()).saturating_mul(bs) as u64;
        let blocks = |bytes: u64| u32::try_from(bytes / block_bytes).unwrap_or(u32::MAX >> 1);
        let (primary, secondary) = (blocks(config.device_bytes), blocks(config.host_bytes));
        if primary == 0 {
            return Err(EngineError::Invalid(format!(
                "device_bytes {} hold no block of {block_bytes} bytes",
                config.device_bytes
            )));
        }
        let kv = KvCacheManager::new(KvCacheConfig::new(bs as u32, primary, secondary))?;
        Ok(Scheduler {
            model,
            tokenizer,
            device: KvStore::new(c, primary as usize, bs)?,
            host: KvStore::new(c, secondary as usize, bs)?,
            kv,
            config,
            coords: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            reserved: 0,
            block_bytes,
            poisoned: false,
        })
    }

    /// Queues a request and returns its id. A request that could never run is rejected here
    /// with a [`RequestError`], and nothing of it is kept.
    pub fn submit(&mut self, request: Request) -> Result<u64, EngineError> {
        let c = &self.model.config;
        let limit = self.config.max_seq.unwrap_or(c.context).min(c.context);
        check_request(c, &request.prompt, &request.sampling, limit)?;
        if !request.sampling.stop.is_empty() && self.tokenizer.is_none() {
            return Err(RequestError::NoTokenizer.into());
        }
        let total = request.prompt.len() + request.sampling.max_tokens;
        let coord = match &request.sparse {
            None => None,
            Some(cfg) => Some(self.coord_for(cfg, limit)?),
        };
        let plan = self.plan(coord, request.prompt.len(), total);
        let budget = self.config.device_bytes;
        if plan.reserve > budget {
            return Err(RequestError::TooBig {
                what: "device memory",
                need: plan.reserve,
                budget,
            }
            .into());
        }
        if let (Some(ci), true) = (coord, plan.sparse) {
            let co = &self.coords[ci];
            if plan.host_pages > co.host_pages {
                return Err(RequestError::TooBig {
                    what: "sparse host memory",
                    need: plan.host_pages as u64 * co.page_bytes,
                    budget: co.host_pages as u64 * co.page_bytes,
                }
                .into());
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Pending {
            id,
            request,
            coord,
            submitted: Instant::now(),
        });
        Ok(id)
    }

    /// Ends a waiting or running request now; its report says [`FinishReason::Cancelled`].
    pub fn cancel(&mut self, id: u64) -> Result<Report, EngineError> {
        if let Some(i) = self.waiting.iter().position(|p| p.id == id) {
            let p = self.waiting.remove(i).expect("the position was just found");
            let t = p.submitted.elapsed().as_secs_f64();
            return Ok(Report {
                id,
                reason: FinishReason::Cancelled,
                prompt_tokens: p.request.prompt.len(),
                reused_tokens: 0,
                tokens: Vec::new(),
                sparse: false,
                device_bytes: 0,
                decode_device_bytes: 0,
                queued_s: t,
                first_token_s: None,
                total_s: t,
            });
        }
        let i = self
            .running
            .iter()
            .position(|l| l.id == id)
            .ok_or(RequestError::Unknown(id))?;
        let live = self.running.swap_remove(i);
        self.finish(live, FinishReason::Cancelled)
    }

    /// Whether no request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// What is held now.
    pub fn usage(&self) -> Usage {
        let pool = |tier| {
            self.kv
                .usage(GroupId(0), tier)
                .expect("the scheduler's kv-blocks manager has group 0")
        };
        let (d, h) = (pool(Tier::Primary), pool(Tier::Secondary));
        let sparse_host_pages_used = self
            .coords
            .iter()
            .filter_map(|c| c.coord.manager())
            .map(|m| m.config().host_pages - m.free_host_pages())
            .sum();
        Usage {
            waiting: self.waiting.len(),
            running: self.running.len(),
            reserved_bytes: self.reserved,
            device_blocks_used: d.used,
            device_blocks_cached: d.cached,
            host_blocks_used: h.used,
            host_blocks_cached: h.cached,
            sparse_host_pages_used,
            sparse_requests: self.coords.iter().map(|c| c.requests).sum(),
        }
    }

    /// Hot-buffer hits, misses and bytes moved by every sparse configuration so far.
    pub fn sparse_totals(&self) -> StepStats {
        let mut total = StepStats::default();
        for m in self.coords.iter().filter_map(|c| c.coord.manager()) {
            total.add(&m.totals());
        }
        total
    }

    /// Checks kv-blocks' invariants (reference counts against block tables, pool accounting).
    pub fn audit(&self) -> Result<(), String> {
        self.kv.audit()
    }

    /// One forward: admits what fits, then runs every decode token and prefill chunks up to
    /// [`SchedulerConfig::max_batch_tokens`], samples, and releases finished requests. After
    /// an error the scheduler refuses further steps.
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        if self.poisoned {
            return Err(EngineError::Invalid(
                "the scheduler stopped at an earlier error".into(),
            ));
        }
        self.poisoned = true;
        let mut events = Vec::new();
        self.admit(&mut events)?;
        self.forward(&mut events)?;
        self.poisoned = false;
        Ok(events)
    }

    fn bs(&self) -> usize {
        self.config.block_size
    }

    fn geometry(&self) -> BlockGeometry {
        BlockGeometry {
            tokens: self.bs(),
            bytes: self.block_bytes,
        }
    }

    /// The coordinator of `config`, made on first use.
    fn coord_for(&mut self, config: &SparseConfig, limit: usize) -> Result<usize, EngineError> {
        if let Some(i) = self.coords.iter().position(|c| &c.config == config) {
            return Ok(i);
        }
        let shape = self.model.config.shape();
        let lowered = config
            .lower(shape, None)
            .map_err(|e| RequestError::Sparse(e.to_string()))?;
        let page = lowered.page_size;
        let page_bytes = self.geometry().token_bytes(page);
        let host_pages = (self.config.sparse_host_bytes / page_bytes.max(1)) as usize;
        let coord = SparseCoordinator::<T>::new(
            shape,
            lowered,
            Capacity {
                max_requests: self.config.sparse_slots.max(1),
                max_tokens: limit,
                host_pages: host_pages.max(1),
                host_alloc: HostAlloc::Own,
            },
        )
        .map_err(|e| RequestError::Sparse(e.to_string()))?;
        self.coords.push(Coord {
            config: config.clone(),
            coord,
            host_reserved: 0,
            host_pages: host_pages.max(1),
            page_bytes,
            requests: 0,
        });
        Ok(self.coords.len() - 1)
    }

    /// What a request of `prompt` tokens and `total` at most reserves.
    fn plan(&self, coord: Option<usize>, prompt: usize, total: usize) -> Footprint {
        footprint(
            coord.map(|i| self.coords[i].coord.lowered()),
            self.model.config.shape(),
            size_of::<T>(),
            self.geometry(),
            prompt,
            total,
        )
    }

    /// Admits waiting requests in order while they fit.
    fn admit(&mut self, events: &mut Vec<Event>) -> Result<(), EngineError> {
        while let Some(p) = self.waiting.front() {
            if self.running.len() >= self.config.max_running {
                break;
            }
            let prompt = p.request.prompt.len();
            let plan = self.plan(p.coord, prompt, prompt + p.request.sampling.max_tokens);
            if self.reserved + plan.reserve > self.config.device_bytes {
                break;
            }
            if let (Some(ci), true) = (p.coord, plan.sparse) {
                let co = &self.coords[ci];
                if co.requests >= self.config.sparse_slots
                    || co.host_reserved + plan.host_pages > co.host_pages
                {
                    break;
                }
            }
            let p = self.waiting.pop_front().expect("front was just seen");
            let live = self.start(p, &plan)?;
            events.push(Event::Admitted {
                id: live.id,
                reused_tokens: live.report.reused_tokens,
                sparse: live.report.sparse,
            });
            self.running.push(live);
        }
        Ok(())
    }

    /// Allocates an admitted request's blocks, reuses its cached prefix, and begins it in its
    /// coordinator.
    fn start(&mut self, p: Pending, plan: &Footprint) -> Result<Live, EngineError> {
        let rid = RequestId(p.id);
        let sampler = Sampler::new(&p.request.sampling)?;
        let out = self
            .kv
            .add_request(RequestSpec::new(rid, p.request.prompt.clone()))?;
        let reused = out.reused_tokens as usize;
        let prompt_len = p.request.prompt.len();
        let begun = self
            .run_transfers()
            .and_then(|()| match (p.coord, plan.sparse) {
                (Some(ci), true) => self
                    .begin_sparse(ci, rid, prompt_len, reused)
                    .map(|()| Some(ci)),
                _ => Ok(None),
            });
        let coord = match begun {
            Ok(c) => c,
            Err(e) => {
                // Nothing of the request stays behind.
                let _ = self.kv.release(rid);
                return Err(e);
            }
        };
        if let Some(ci) = coord {
            let co = &mut self.coords[ci];
            co.requests += 1;
            co.host_reserved += plan.host_pages;
        }
        self.reserved += plan.reserve;
        Ok(Live {
            id: p.id,
            sampler,
            coord,
            on_device: true,
            drop_blocks: plan.drop_blocks,
            computed: reused,
            out: Vec::new(),
            reserve: plan.reserve,
            decode_reserve: plan.decode_reserve,
            host_pages: plan.host_pages,
            report: Report {
                id: p.id,
                reason: FinishReason::Length,
                prompt_tokens: prompt_len,
                reused_tokens: reused,
                tokens: Vec::new(),
                sparse: plan.sparse,
                device_bytes: plan.reserve,
                decode_device_bytes: plan.decode_reserve,
                queued_s: p.submitted.elapsed().as_secs_f64(),
                first_token_s: None,
                total_s: 0.0,
            },
            prompt: p.request.prompt,
            sampling: p.request.sampling,
            submitted: p.submitted,
        })
    }

    /// Begins a sparse-mode request in coordinator `ci` and hands it the `reused` prompt
    /// tokens kv-blocks found cached; on error the coordinator holds nothing of it.
    fn begin_sparse(
        &mut self,
        ci: usize,
        rid: RequestId,
        prompt_len: usize,
        reused: usize,
    ) -> Result<(), EngineError> {
        let table = self.table(rid)?;
        let co = &mut self.coords[ci].coord;
        let mode = co.on_request_begin(rid, prompt_len)?;
        debug_assert_eq!(mode, Mode::Sparse, "plan() predicts the coordinator's mode");
        if reused > 0 {
            let device = &self.device;
            let r = co.on_prefix_cached(rid, reused, |layer| device.gather(layer, &table, reused));
            if let Err(e) = r {
                let _ = co.on_request_end(rid);
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// A request's device block table as the data contract's `i32`s.
    fn table(&self, id: RequestId) -> Result<Vec<i32>, EngineError> {
        let table = self.kv.block_table(id, GroupId(0))?;
        Ok(table
            .iter()
            .map(|b| b.map_or(-1, kv_blocks::BlockId::as_i32))
            .collect())
    }

    /// Executes kv-blocks' pending copies between the device and host stores.
    fn run_transfers(&mut self) -> Result<(), EngineError> {
        for t in self.kv.take_transfers() {
            let n = t.num_tokens.map_or(self.bs(), |n| n as usize);
            let (s, d) = (t.src.block.index(), t.dst.block.index());
            match (t.src.tier, t.dst.tier) {
                (Tier::Primary, Tier::Primary) => self.device.copy_block(None, s, d, n)?,
                (Tier::Secondary, Tier::Secondary) => self.host.copy_block(None, s, d, n)?,
                (Tier::Primary, Tier::Secondary) => {
                    self.host.copy_block(Some(&self.device), s, d, n)?;
                }
                (Tier::Secondary, Tier::Primary) => {
                    self.device.copy_block(Some(&self.host), s, d, n)?;
                }
            }
        }
        Ok(())
    }

    /// Picks the batch, runs the forward, samples, and finishes requests.
    fn forward(&mut self, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let work = self.pick_work();
        if work.is_empty() {
            return Ok(());
        }
        let (batch, inputs) = self.batch_of(&work)?;
        // One group per coordinator (or none), over its contiguous requests.
        let mut groups: Vec<GroupRun> = Vec::new();
        for (j, &(i, n)) in work.iter().enumerate() {
            let c = self.running[i].coord;
            match groups.last_mut() {
                Some(g) if g.coord == c => g.requests.push((RequestId(self.running[i].id), n)),
                _ => groups.push(GroupRun::new(c, j, RequestId(self.running[i].id), n)),
            }
        }
        for g in &mut groups {
            g.prepare(&batch);
            if let Some(c) = g.coord {
                self.coords[c].coord.forward_begin(&g.requests)?;
            }
        }
        let mut attn = StepAttention {
            store: &mut self.device,
            coords: self.coords.iter_mut().map(|c| &mut c.coord).collect(),
            groups: &mut groups,
            model: self.model,
        };
        let logits = self.model.forward(
            &inputs.tokens,
            &batch.positions(),
            &mut attn,
            &inputs.logits_for,
        )?;
        for g in &groups {
            if let Some(c) = g.coord {
                self.coords[c].coord.forward_end()?;
            }
        }
        let done = self.take_tokens(&work, &logits, events)?;
        self.run_transfers()?;
        for (id, reason) in done {
            let i = self
                .running
                .iter()
                .position(|l| l.id == id)
                .expect("finished requests are running");
            let live = self.running.swap_remove(i);
            let report = self.finish(live, reason)?;
            events.push(Event::Finished(Box::new(report)));
        }
        Ok(())
    }

    /// The step's work: (running index, new tokens), decode tokens first, then prefill
    /// chunks, within the token budget; each coordinator's requests (or those of none)
    /// contiguous.
    fn pick_work(&self) -> Vec<(usize, usize)> {
        let mut budget = self.config.max_batch_tokens;
        let mut work: Vec<(usize, usize)> = Vec::new();
        for (i, l) in self.running.iter().enumerate() {
            if !l.prefilling() && budget > 0 {
                work.push((i, 1));
                budget -= 1;
            }
        }
        for (i, l) in self.running.iter().enumerate() {
            if l.prefilling() && budget > 0 {
                let n = (l.prompt.len() - l.computed).min(budget);
                work.push((i, n));
                budget -= n;
            }
        }
        work.sort_by_key(|&(i, _)| self.running[i].coord.map_or(0, |c| c + 1));
        work
    }

    /// The batch metadata of `work` over the device's blocks, and the model's inputs.
    fn batch_of(&self, work: &[(usize, usize)]) -> Result<(Batch, Inputs), EngineError> {
        let bs = self.bs();
        let mut tables = Vec::with_capacity(work.len());
        for &(i, _) in work {
            let l = &self.running[i];
            tables.push(if l.on_device {
                self.table(l.rid())?
            } else {
                Vec::new()
            });
        }
        let max_blocks = tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut batch = Batch {
            cu_seqlens_q: vec![0],
            max_blocks,
            ..Batch::default()
        };
        let mut inputs = Inputs::default();
        for (&(i, n), table) in work.iter().zip(&tables) {
            let l = &self.running[i];
            let start = l.computed;
            for p in start..start + n {
                inputs.tokens.push(if p < l.prompt.len() {
                    l.prompt[p]
                } else {
                    l.out[p - l.prompt.len()]
                });
                batch.slots.push(match table.get(p / bs) {
                    Some(&b) if b >= 0 => b * bs as i32 + (p % bs) as i32,
                    _ => -1,
                });
            }
            if start + n >= l.prompt.len() {
                inputs.logits_for.push(inputs.tokens.len() - 1);
            }
            batch.cu_seqlens_q.push(inputs.tokens.len() as i32);
            batch.seq_lens_kv.push((start + n) as i32);
            batch.block_table.extend_from_slice(table);
            batch
                .block_table
                .extend(std::iter::repeat_n(-1, max_blocks - table.len()));
        }
        Ok((batch, inputs))
    }

    /// Counts `work`'s tokens as computed, and samples the next token of every request whose
    /// prompt is in (`logits`: a row each, in `work`'s order): the requests that finished, and
    /// why.
    fn take_tokens(
        &mut self,
        work: &[(usize, usize)],
        logits: &[f32],
        events: &mut Vec<Event>,
    ) -> Result<Vec<(u64, FinishReason)>, EngineError> {
        let vocab = self.model.config.vocab;
        let mut row = 0;
        let mut done = Vec::new();
        for &(i, n) in work {
            let l = &mut self.running[i];
            l.computed += n;
            if l.on_device {
                self.kv.commit_computed(l.rid(), l.computed as u32)?;
            }
            if l.computed < l.prompt.len() {
                continue;
            }
            let logits = &logits[row * vocab..(row + 1) * vocab];
            row += 1;
            if l.drop_blocks && l.on_device {
                // The prompt is in the host pool and every layer is sparse: the blocks go
                // back (kv-blocks keeps the full ones for prefix reuse).
                self.kv.release(l.rid())?;
                l.on_device = false;
                self.reserved -= l.reserve - l.decode_reserve;
                l.reserve = l.decode_reserve;
            }
            let token = l.sampler.sample(logits);
            if l.report.first_token_s.is_none() {
                l.report.first_token_s = Some(l.submitted.elapsed().as_secs_f64());
            }
            if l.sampling.stop_at_eos && self.tokenizer.and_then(Tokenizer::eos) == Some(token) {
                done.push((l.id, FinishReason::Eos));
                continue;
            }
            l.out.push(token);
            events.push(Event::Token { id: l.id, token });
            let stopped = match self.tokenizer {
                Some(tok) if !l.sampling.stop.is_empty() => {
                    let text = tok.decode(&l.out)?;
                    l.sampling.stop.iter().any(|s| text.contains(s.as_str()))
                }
                _ => false,
            };
            if stopped {
                done.push((l.id, FinishReason::Stop));
            } else if l.out.len() == l.sampling.max_tokens {
                done.push((l.id, FinishReason::Length));
            } else if l.on_device {
                self.kv.append_token(l.rid(), token)?;
            }
        }
        Ok(done)
    }

    /// Releases a request's memory everywhere and writes its report.
    fn finish(&mut self, live: Live, reason: FinishReason) -> Result<Report, EngineError> {
        if live.on_device {
            self.kv.release(live.rid())?;
        }
        if let Some(ci) = live.coord {
            let co = &mut self.coords[ci];
            co.coord.on_request_end(live.rid())?;
            co.requests -= 1;
            co.host_reserved -= live.host_pages;
        }
        self.reserved -= live.reserve;
        let mut report = live.report;
        report.reason = reason;
        report.tokens = live.out;
        report.total_s = live.submitted.elapsed().as_secs_f64();
        Ok(report)
    }
}

/// Rejects a request that cannot run: an empty prompt, one longer than `limit` with its
/// generation, tokens outside the vocabulary, or sampling values that cannot sample.
pub(crate) fn check_request(
    config: &ModelConfig,
    prompt: &[u32],
    sampling: &Sampling,
    limit: usize,
) -> Result<(), RequestError> {
    sampling.validate()?;
    if prompt.is_empty() {
        return Err(RequestError::EmptyPrompt);
    }
    if prompt.len().saturating_add(sampling.max_tokens) > limit {
        return Err(RequestError::TooLong {
            prompt: prompt.len(),
            max_tokens: sampling.max_tokens,
            limit,
        });
    }
    if let Some(&token) = prompt.iter().find(|&&t| t as usize >= config.vocab) {
        return Err(RequestError::OutOfVocab {
            token,
            vocab: config.vocab,
        });
    }
    Ok(())
}
