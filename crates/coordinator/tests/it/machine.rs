//! A proptest state machine over the toy engine. Each case draws a configuration (algorithm,
//! page size, budget, forced pages, hot buffer, sparse threshold, dense layers, prefetch, host
//! pool size), then a sequence of operations: requests begin, prefill in chunks of any size in
//! batches with any others, decode, end; forwards fail (the host pool runs out, or the engine
//! stops in a layer) and are abandoned; malformed calls come in between.
//!
//! - Every sparse row of every forward is checked by `Engine::forward`: its selection equals
//!   the algorithm's own over the request's full KV, and its attention over the hot buffer
//!   equals in-memory attention with that selection (and dense attention where the budget
//!   covers the context).
//! - Every request's mode, phase and length follow what the test expects of them, and the
//!   rows checked are exactly the sparse-mode decode rows of sparse layers.
//! - A malformed call is refused and changes nothing.
//! - An abandoned forward ends exactly the sparse-mode requests a sparse layer reached, and
//!   leaves the others as they were.
//! - At the end every host page and representation slot is back.

use coordinator::{CoordError, Mode, Phase, RequestTracker, SparseConfig};
use kv_blocks::RequestId;
use offload::HostAlloc;
use proptest::prelude::*;
use sparse_algo::{AlgoConfig, AlwaysInclude, QuestConfig, StreamingConfig, Summary};

use crate::util::{Engine, Estimate, MAX, MODEL};

/// The longest prompt: every request can decode at least `MAX - PROMPT` tokens.
const PROMPT: usize = 120;
/// Representation slots of the toy engine (`Engine::new`).
const SLOTS: usize = 3;

/// What a case configures.
#[derive(Clone, Debug)]
struct Setup {
    algo: u8,
    page: usize,
    budget: usize,
    sinks: u32,
    recent: u32,
    shared: bool,
    e4m3: bool,
    /// Hot-buffer tokens as a multiple of the budget (`None`: the default).
    hot: Option<u8>,
    min_prompt: usize,
    /// Bit `l` makes layer `l` dense.
    dense: u8,
    /// Prefetch before every layer's step: none, with the step's own queries, or with others.
    prefetch: u8,
    /// Host pool pages, as a fraction in 256ths of what every slot's longest request takes
    /// (`None`: that and more). A small pool runs out, and forwards fail.
    host: Option<u8>,
}

#[derive(Clone, Debug)]
enum Op {
    /// A new request with this prompt length.
    Begin { prompt: usize },
    /// A forward over the live requests that `mask` picks (the first, if none), each taking
    /// a prefill chunk drawn from `chunk`, or one token. With `stop`, the engine fails in
    /// that layer (after its `attention_begin`) and abandons the forward.
    Forward {
        mask: u8,
        chunk: u8,
        stop: Option<usize>,
    },
    /// Ends the live request `pick` points at.
    End { pick: u8 },
    /// A malformed call of kind `kind`, about the live request `pick` points at.
    Bad { kind: u8, pick: u8 },
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        (
            0..5u8,
            prop::sample::select(vec![1usize, 2, 4, 8]),
            1..=176usize,
        ),
        (0..3u32, 0..6u32, any::<bool>(), any::<bool>()),
        (prop::option::of(1..4u8), 1..=100usize, 0..8u8, 0..3u8),
        prop::option::weighted(0.3, any::<u8>()),
    )
        .prop_map(
            |(
                (algo, page, budget),
                (sinks, recent, shared, e4m3),
                (hot, min_prompt, dense, prefetch),
                host,
            )| Setup {
                algo,
                page,
                budget: budget.max(page),
                sinks,
                recent,
                shared,
                e4m3,
                hot,
                min_prompt,
                dense,
                prefetch,
                host,
            },
        )
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (1..=PROMPT).prop_map(|prompt| Op::Begin { prompt }),
        10 => (any::<u8>(), any::<u8>(), prop::option::weighted(0.1, 0..MODEL.layers))
            .prop_map(|(mask, chunk, stop)| Op::Forward { mask, chunk, stop }),
        1 => any::<u8>().prop_map(|pick| Op::End { pick }),
        2 => (0..10u8, any::<u8>()).prop_map(|(kind, pick)| Op::Bad { kind, pick }),
    ]
}

impl Setup {
    /// Whether the engine prefetches: only for algorithms that select without the new keys.
    fn prefetch(&self) -> bool {
        self.prefetch > 0 && matches!(self.algo, 0 | 2)
    }

    /// The sparse configuration, and whether a sparse row must equal dense attention.
    fn config(&self) -> (SparseConfig, bool) {
        let always = AlwaysInclude {
            sink_tokens: self.sinks,
            recent_tokens: self.recent,
        };
        let covers = self.budget >= MAX;
        let (algo, dense) = match self.algo {
            0 => (
                AlgoConfig::Quest(QuestConfig {
                    page_size: self.page,
                    budget_tokens: self.budget,
                    always,
                    shared_heads: self.shared,
                    summary: if self.e4m3 {
                        Summary::E4m3
                    } else {
                        Summary::Exact
                    },
                }),
                covers,
            ),
            1 => (
                AlgoConfig::Oracle(sparse_algo::OracleConfig {
                    page_size: self.page,
                    budget_tokens: self.budget,
                    always,
                    scale: None,
                }),
                covers,
            ),
            2 => (
                AlgoConfig::StreamingLlm(StreamingConfig {
                    sink_tokens: self.sinks * 4,
                    window_tokens: self.budget as u32,
                    page_size: self.page,
                }),
                false,
            ),
            3 => (
                AlgoConfig::Dsa(sparse_algo::DsaConfig {
                    topk: self.budget,
                    always,
                }),
                false,
            ),
            _ => (
                AlgoConfig::RocketKv(sparse_algo::RocketConfig {
                    page_size: self.page,
                    always,
                    ..Default::default()
                })
                .with_budget(self.budget),
                false,
            ),
        };
        let config = SparseConfig {
            algo,
            hot_tokens: self.hot.map(|f| usize::from(f) * self.budget),
            min_prompt_tokens: Some(self.min_prompt),
            dense_layers: (0..MODEL.layers)
                .filter(|l| self.dense >> l & 1 == 1)
                .collect(),
            prefetch: self.prefetch(),
            ..Default::default()
        };
        (config, dense)
    }
}

/// What the test knows of a live request, apart from the coordinator.
#[derive(Clone, Copy, Debug)]
struct Live {
    id: RequestId,
    prompt: usize,
    mode: Mode,
}

/// The machine: the toy engine and what the test expects of it.
struct Machine {
    e: Engine,
    live: Vec<Live>,
    next: u64,
    /// Whether some layer is sparse.
    sparse: bool,
    host_pages: usize,
    /// Sparse rows the forwards must have checked.
    rows: usize,
}

impl Machine {
    fn new(s: &Setup) -> Option<Self> {
        let (mut config, dense) = s.config();
        if config.lower(MODEL, None).is_err() {
            // A hot buffer too small for what a step can select: the default must lower.
            config.hot_tokens = None;
        }
        let lowered = match config.lower(MODEL, None) {
            Ok(l) => l,
            // An algorithm that refuses its settings (a budget below its forced pages, say).
            Err(CoordError::Config(_) | CoordError::Algo(_)) => return None,
            Err(e) => panic!("{s:?} lowered to {e:?}"),
        };
        let page = lowered.page_size;
        let sparse = lowered.layers.iter().any(Option::is_some);
        // A host page holds a page of tokens for every layer: a request takes at most
        // `MAX / page` of them.
        let most = SLOTS * MAX.div_ceil(page);
        let host_pages = match s.host {
            None => most + 8,
            Some(f) => (most * usize::from(f) / 256).max(1),
        };
        let mut e = Engine::new(&config, HostAlloc::Own, host_pages);
        e.expect_dense = dense;
        e.prefetch = match s.prefetch {
            1 if s.prefetch() => Some(Estimate::Exact),
            2 if s.prefetch() => Some(Estimate::Other),
            _ => None,
        };
        Some(Machine {
            e,
            live: Vec::new(),
            next: 1,
            sparse,
            host_pages,
            rows: 0,
        })
    }

    fn sparse_layers(&self) -> usize {
        let l = self.e.coord.lowered();
        l.layers.iter().filter(|p| p.is_some()).count()
    }

    fn tracker(&self, id: RequestId) -> RequestTracker {
        *self.e.coord.tracker(id).expect("a live request is tracked")
    }

    fn pick(&self, pick: u8) -> Option<Live> {
        (!self.live.is_empty()).then(|| self.live[usize::from(pick) % self.live.len()])
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Begin { prompt } => self.begin(prompt),
            Op::Forward { mask, chunk, stop } => self.forward(mask, chunk, stop),
            Op::End { pick } => {
                if let Some(r) = self.pick(pick) {
                    self.end(r);
                }
            }
            Op::Bad { kind, pick } => self.bad(kind, pick),
        }
        self.check();
    }

    fn begin(&mut self, prompt: usize) {
        let id = RequestId(self.next);
        self.next += 1;
        let sparse = self.sparse && prompt >= self.e.coord.lowered().min_prompt_tokens;
        let taken = self.live.iter().filter(|r| r.mode == Mode::Sparse).count();
        let got = self.e.coord.on_request_begin(id, prompt);
        if sparse && taken == SLOTS {
            assert_eq!(got, Err(CoordError::Full(SLOTS)), "{id:?}, {prompt} tokens");
            return;
        }
        let mode = if sparse { Mode::Sparse } else { Mode::Dense };
        assert_eq!(got, Ok(mode), "{id:?}, {prompt} tokens");
        self.e.add(id);
        self.live.push(Live { id, prompt, mode });
    }

    fn forward(&mut self, mask: u8, chunk: u8, stop: Option<usize>) {
        // A request at the longest sequence ends instead.
        while let Some(i) = self.live.iter().position(|r| self.tracker(r.id).len == MAX) {
            self.end(self.live[i]);
        }
        let mut batch = Vec::new();
        for (i, r) in self.live.iter().enumerate() {
            if mask >> (i % 8) & 1 == 1 || (mask == 0 && i == 0) {
                let left = r.prompt.saturating_sub(self.tracker(r.id).len);
                let n = if left > 0 {
                    1 + usize::from(chunk) % left
                } else {
                    1
                };
                batch.push((r.id, n));
            }
        }
        if batch.is_empty() {
            return;
        }
        let decoding = batch
            .iter()
            .filter(|&&(id, _)| {
                let t = self.tracker(id);
                t.mode == Mode::Sparse && t.phase == Phase::Decode
            })
            .count();
        let before: Vec<RequestTracker> = self.live.iter().map(|r| self.tracker(r.id)).collect();
        match self.e.try_forward(&batch, stop) {
            Ok(()) if stop.is_none() => {
                self.rows += decoding * self.sparse_layers();
                return;
            }
            Ok(()) => {}
            Err(CoordError::Offload(offload::OffloadError::HostExhausted { .. })) => {
                assert!(self.host_pages < SLOTS * MAX.div_ceil(self.e.page));
            }
            Err(e) => panic!("{batch:?}: {e:?}"),
        }
        // The rows checked before the failure.
        assert!(self.e.checked >= self.rows);
        self.rows = self.e.checked;
        self.abort(&batch, &before);
    }

    /// Abandons the forward in progress over `batch`: the sparse-mode requests a sparse
    /// layer reached are ended, and the others are as they were before it (`before`).
    fn abort(&mut self, batch: &[(RequestId, usize)], before: &[RequestTracker]) {
        let lowered = self.e.coord.lowered();
        let sparse = |l: &usize| lowered.layers[*l].is_some();
        let stepped = self.e.began.iter().any(sparse);
        let stored = self.e.ended.iter().any(sparse);
        let reached: Vec<RequestId> = batch
            .iter()
            .map(|&(id, _)| id)
            .filter(|&id| {
                let t = self.tracker(id);
                t.mode == Mode::Sparse && (stored || stepped && t.phase == Phase::Decode)
            })
            .collect();
        let ended = self.e.coord.abort_forward().expect("a forward in progress");
        assert_eq!(ended, reached, "stepped {stepped}, stored {stored}");
        for (r, t) in self.live.clone().iter().zip(before) {
            if ended.contains(&r.id) {
                assert!(self.e.coord.tracker(r.id).is_none(), "{r:?} ended");
                self.e.own.remove(&r.id);
                self.live.retain(|l| l.id != r.id);
            } else {
                assert_eq!(self.tracker(r.id), *t, "{r:?} as it was");
            }
        }
    }

    fn end(&mut self, r: Live) {
        let t = self
            .e
            .coord
            .on_request_end(r.id)
            .expect("live, outside a forward");
        assert_eq!(t.len, self.e.own[&r.id].len, "{r:?}");
        self.e.own.remove(&r.id);
        self.live.retain(|l| l.id != r.id);
    }

    /// A malformed call: refused, and nothing changes.
    fn bad(&mut self, kind: u8, pick: u8) {
        let before = self.snapshot();
        let unknown = RequestId(u64::MAX - u64::from(pick));
        let c = &mut self.e.coord;
        let (qs, kvs) = (
            MODEL.q_heads * MODEL.head_dim,
            MODEL.kv_heads * MODEL.head_dim,
        );
        let r = self.live.first().map(|_| {
            let r = self.live[usize::from(pick) % self.live.len()];
            (r, *c.tracker(r.id).expect("live"))
        });
        let refused = match (kind, r) {
            (0, _) => c.forward_begin(&[(unknown, 1)]).is_err(),
            (1, Some((r, _))) => c.forward_begin(&[(r.id, 1), (r.id, 1)]).is_err(),
            // One token past the prompt, or two in a sparse decode step.
            (2, Some((r, t))) if t.mode == Mode::Sparse => {
                let n = if t.phase == Phase::Prefill {
                    t.prompt_len - t.len + 1
                } else {
                    2
                };
                c.forward_begin(&[(r.id, n)]).is_err()
            }
            (3, _) => c.forward_end().is_err(),
            (4, _) => {
                let (q, k) = (vec![0.5; qs], vec![0.25; kvs]);
                c.attention_begin(usize::from(pick) % MODEL.layers, &q, &k, &k)
                    .is_err()
                    && c.attention_end(0, &k, &k).is_err()
            }
            (5, _) => c.on_request_end(unknown) == Err(CoordError::UnknownRequest(unknown)),
            (6, Some((r, _))) => {
                c.on_request_begin(r.id, 10) == Err(CoordError::DuplicateRequest(r.id))
            }
            (7, _) => c.on_request_begin(unknown, 0).is_err(),
            (8, Some((r, _))) => c
                .on_prefix_cached(r.id, usize::MAX, |_| (Vec::new(), Vec::new()))
                .is_err(),
            (9, _) => c.abort_forward().is_err(),
            // The kind needs a live request, of sparse mode for 2.
            _ => true,
        };
        assert!(refused, "malformed call {kind} accepted");
        assert_eq!(
            self.snapshot(),
            before,
            "malformed call {kind} changed state"
        );
    }

    /// What a refused call must leave as it was.
    fn snapshot(&self) -> (Vec<RequestTracker>, Option<usize>) {
        let trackers = self.live.iter().map(|r| self.tracker(r.id)).collect();
        let free = self.e.coord.manager().map(|m| m.free_host_pages());
        (trackers, free)
    }

    /// Every live request is where the test expects it.
    fn check(&self) {
        for r in &self.live {
            let t = self.tracker(r.id);
            assert_eq!((t.prompt_len, t.mode), (r.prompt, r.mode), "{r:?}");
            assert_eq!(t.len, self.e.own[&r.id].len, "{r:?}");
            let phase = if t.len < r.prompt {
                Phase::Prefill
            } else {
                Phase::Decode
            };
            assert_eq!(t.phase, phase, "{r:?}: {t:?}");
            assert_eq!(t.slot.is_some(), r.mode == Mode::Sparse, "{r:?}: {t:?}");
            assert_eq!(
                t.represented,
                r.mode == Mode::Sparse && phase == Phase::Decode
            );
        }
        assert_eq!(self.e.checked, self.rows, "sparse rows checked");
    }

    /// Ends every request: every host page and slot comes back.
    fn finish(mut self) {
        for r in self.live.clone() {
            self.end(r);
        }
        if let Some(m) = self.e.coord.manager() {
            assert_eq!(
                m.free_host_pages(),
                self.host_pages,
                "every host page is back"
            );
        }
        if self.sparse {
            let min = self.e.coord.lowered().min_prompt_tokens.max(1);
            for i in 0..SLOTS as u64 {
                let got = self.e.coord.on_request_begin(RequestId(1 << 40 | i), min);
                assert_eq!(got, Ok(Mode::Sparse), "slot {i} came back");
            }
        }
    }
}

/// 64 cases by default; `PROPTEST_CASES` raises it for soak runs.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// See the module documentation.
    #[test]
    fn random_request_lifecycles_keep_every_row_exact(s in setup(), ops in prop::collection::vec(op(), 20..120)) {
        let Some(mut m) = Machine::new(&s) else {
            return Ok(());
        };
        for op in &ops {
            m.apply(op);
        }
        m.finish();
    }
}
