//! How much of a sparse decode's loads could leave the critical path: a measurement on the real
//! model (CPU), for the per-layer overlap of loads and compute (issue 9).
//!
//! `cargo run --release -p engine --example prefetch [MODEL] [TEXT]` runs the model densely
//! over the text (a prefill of [`PREFILL`] tokens, then [`STEPS`] teacher-forced decode
//! steps), and beside it simulates what head-shared Quest over pages of 16 would select in
//! every layer but the first two: a budget of [`BUDGET`] pages (the first and the current page
//! always kept; scores by `sparse_algo::quest_bound`), diffed against an offload
//! `HotBuffer` of [`HOT`] pages per layer, as the offload manager does. A miss is a load on the
//! step's critical path. Two ways to load pages early, off that path, each a row of the
//! table, each loaded as `SparseKvCacheManager::prefetch` does (the buffer's diff of the
//! pages, which become its newest):
//! - the runners-up: after a layer's selection, the next `extra` pages of its ranking, for the
//!   same layer's next step;
//! - speculation: while layer l computes, the selection that layer l + 1's queries estimated
//!   from layer l's input ([`Model::query`]) would make, for layer l + 1 in the same step.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

#[path = "shared/real.rs"]
mod real;

use engine::{Attention, Batch, DenseAttention, EngineError, KvStore, Model};
use offload::HotBuffer;
use sparse_algo::quest_bound;

/// Tokens prefilled, then decode steps measured.
const PREFILL: usize = 4096;
const STEPS: usize = 256;
/// Tokens per page, pages selected per step, hot-buffer pages per layer (twice the budget).
const PAGE: usize = 16;
const BUDGET: usize = 64;
const HOT: usize = 2 * BUDGET;
/// Layers attended densely (as in the engine's Quest variants).
const DENSE_LAYERS: usize = 2;
/// The settings: runners-up prefetched per step and layer, and whether the next layer's
/// speculative selection is prefetched.
const SETTINGS: [(usize, bool); 7] = [
    (0, false),
    (8, false),
    (16, false),
    (32, false),
    (64, false),
    (0, true),
    (16, true),
];

fn main() {
    real::main_with("prefetch", run);
}

fn run(model_path: &str, text_path: &str) -> Result<(), EngineError> {
    let n = PREFILL + STEPS;
    let (model, ids) = real::load(model_path, text_path, n)?;
    let c = model.config;
    let blocks = n.div_ceil(PAGE);
    let mut store = KvStore::<half::f16>::new(&c, blocks, PAGE)?;
    let mut sim = Sim::new(c.layers, c.kv_heads, c.q_heads, c.head_dim);
    for (start, end) in real::spans(PREFILL, n) {
        let decode = start >= PREFILL;
        let batch = Batch::single(start, end, blocks);
        let positions: Vec<usize> = (start..end).collect();
        let mut att = Probe {
            dense: DenseAttention {
                store: &mut store,
                batch: &batch,
            },
            sim: &mut sim,
            model: &model,
            decode: decode.then_some(start),
        };
        let logits_for: &[usize] = if decode { &[0] } else { &[] };
        model.forward(&ids[start..end], &positions, &mut att, logits_for)?;
    }
    println!(
        "{model_path}, {PREFILL} prefill + {STEPS} decode steps of {text_path}; head-shared \
         Quest, pages of {PAGE}, {BUDGET} pages a step, hot buffer {HOT} pages, layers \
         {DENSE_LAYERS}.. sparse"
    );
    println!(
        "runners-up | speculative | misses per step and layer | miss rate | prefetched per \
         step and layer | used"
    );
    let layer_steps = ((STEPS - 1) * (c.layers - DENSE_LAYERS)) as f64;
    for (i, (extra, spec)) in SETTINGS.iter().enumerate() {
        let t = &sim.tally[i];
        println!(
            "{extra:>10} | {:>11} | {:>25.2} | {:>9.4} | {:>28.2} | {:>6.3}",
            if *spec { "yes" } else { "no" },
            t.misses as f64 / layer_steps,
            t.misses as f64 / t.selected.max(1) as f64,
            t.prefetched as f64 / layer_steps,
            t.used as f64 / t.prefetched.max(1) as f64
        );
    }
    Ok(())
}

/// Dense attention that also feeds the simulation its keys, decode queries and speculative
/// queries; `decode` is the decode step's position.
struct Probe<'a, 'b> {
    dense: DenseAttention<'a, half::f16>,
    sim: &'b mut Sim,
    model: &'b Model,
    decode: Option<usize>,
}

impl Attention for Probe<'_, '_> {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        self.sim.keys(layer, k);
        if self.decode.is_some() && layer >= DENSE_LAYERS {
            self.sim.step(layer, q);
        }
        self.dense.attend(layer, q, k, v, out)
    }

    fn layer_input(&mut self, layer: usize, x: &[f32]) -> Result<(), EngineError> {
        let next = layer + 1;
        if let Some(pos) = self.decode
            && next >= DENSE_LAYERS
            && next < self.model.config.layers
        {
            let q = self.model.query(next, x, &[pos])?;
            self.sim.spec[next] = self.sim.select(next, &q).0;
        }
        Ok(())
    }
}

/// Per layer, the pages' key min/max, and one hot buffer per setting.
struct Sim {
    kv_heads: usize,
    q_heads: usize,
    d: usize,
    /// Per layer: tokens seen, and per page `[kv_heads, 2, d]` (max then min).
    tokens: Vec<usize>,
    reps: Vec<Vec<f32>>,
    /// Per (setting, layer): the hot buffer, and the pages it loaded early for the coming
    /// step.
    hot: Vec<Vec<HotBuffer>>,
    pending: Vec<Vec<Vec<i32>>>,
    /// Per layer, the speculative selection of its coming step.
    spec: Vec<Vec<i32>>,
    /// Per layer, whether its first decode step is done.
    warm: Vec<bool>,
    tally: Vec<Tally>,
}

#[derive(Default)]
struct Tally {
    selected: u64,
    misses: u64,
    prefetched: u64,
    used: u64,
}

impl Sim {
    fn new(layers: usize, kv_heads: usize, q_heads: usize, d: usize) -> Self {
        Sim {
            kv_heads,
            q_heads,
            d,
            tokens: vec![0; layers],
            reps: vec![Vec::new(); layers],
            hot: vec![vec![HotBuffer::new(HOT); layers]; SETTINGS.len()],
            pending: vec![vec![Vec::new(); layers]; SETTINGS.len()],
            spec: vec![Vec::new(); layers],
            warm: vec![false; layers],
            tally: (0..SETTINGS.len()).map(|_| Tally::default()).collect(),
        }
    }

    /// Folds new keys (`[tokens, kv_heads, d]`) into their pages' min/max.
    fn keys(&mut self, layer: usize, k: &[f32]) {
        let (h, d) = (self.kv_heads, self.d);
        let page_len = h * 2 * d;
        for row in k.chunks_exact(h * d) {
            let p = self.tokens[layer] / PAGE;
            let reps = &mut self.reps[layer];
            if reps.len() < (p + 1) * page_len {
                reps.extend((0..h).flat_map(|_| {
                    std::iter::repeat_n(f32::NEG_INFINITY, d)
                        .chain(std::iter::repeat_n(f32::INFINITY, d))
                }));
            }
            let page = &mut reps[p * page_len..(p + 1) * page_len];
            for (hh, key) in row.chunks_exact(d).enumerate() {
                let (hi, lo) = page[hh * 2 * d..(hh + 1) * 2 * d].split_at_mut(d);
                for ((a, b), &x) in hi.iter_mut().zip(lo.iter_mut()).zip(key) {
                    *a = a.max(x);
                    *b = b.min(x);
                }
            }
            self.tokens[layer] += 1;
        }
    }

    /// Quest's selection for `layer` with query `q` (`[q_heads, d]`) over the keys seen so
    /// far, ascending: the best middle pages and the first (the current page, in its
    /// reserved slot, is never a miss); then the other middle pages, best first.
    fn select(&self, layer: usize, q: &[f32]) -> (Vec<i32>, Vec<i32>) {
        let (h, d) = (self.kv_heads, self.d);
        let g = self.q_heads / h;
        let page_len = h * 2 * d;
        let current = self.tokens[layer] / PAGE;
        let mut ranked: Vec<(f32, i32)> = (1..current)
            .filter(|&p| (p + 1) * page_len <= self.reps[layer].len())
            .map(|p| {
                let page = &self.reps[layer][p * page_len..(p + 1) * page_len];
                let best = q
                    .chunks_exact(d)
                    .enumerate()
                    .map(|(j, qh)| {
                        let r = &page[(j / g) * 2 * d..(j / g + 1) * 2 * d];
                        quest_bound(qh, &r[..d], &r[d..])
                    })
                    .fold(f32::NEG_INFINITY, f32::max);
                (best, p as i32)
            })
            .collect();
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let pick = BUDGET.saturating_sub(2).min(ranked.len());
        let mut sel: Vec<i32> = ranked[..pick].iter().map(|r| r.1).collect();
        sel.push(0);
        sel.sort_unstable();
        (sel, ranked[pick..].iter().map(|r| r.1).collect())
    }

    /// One decode step of `layer` with query `q` (`[q_heads, d]`), in every setting: its
    /// early loads (the speculative selection), the diff against its hot buffer, and its
    /// runners-up for the next step. The first step fills an empty buffer in every setting
    /// alike and is not counted.
    fn step(&mut self, layer: usize, q: &[f32]) {
        let (sel, runners) = self.select(layer, q);
        let spec = std::mem::take(&mut self.spec[layer]);
        let current = (self.tokens[layer] / PAGE) as i32;
        let counted = std::mem::replace(&mut self.warm[layer], true);
        for (i, &(extra, speculate)) in SETTINGS.iter().enumerate() {
            let hot = &mut self.hot[i][layer];
            let mut early = std::mem::take(&mut self.pending[i][layer]);
            let mut t = Tally::default();
            if speculate {
                // Loaded while the layer before computed.
                let loaded = prefetch(hot, &spec, current);
                t.prefetched += loaded.len() as u64;
                early.extend(loaded);
            }
            let diff = hot.diff(&sel, current);
            t.selected = sel.len() as u64;
            t.misses = diff.misses.len() as u64;
            t.used = sel
                .iter()
                .filter(|p| early.contains(p) && !diff.misses.iter().any(|m| m.0 as i32 == **p))
                .count() as u64;
            // Off the critical path: the step's runners-up, for its next step.
            let mut next: Vec<i32> = runners.iter().take(extra).copied().collect();
            next.sort_unstable();
            let loaded = prefetch(hot, &next, current);
            t.prefetched += loaded.len() as u64;
            self.pending[i][layer] = loaded;
            if counted {
                let all = &mut self.tally[i];
                all.selected += t.selected;
                all.misses += t.misses;
                all.prefetched += t.prefetched;
                all.used += t.used;
            }
        }
    }
}

/// A prefetch of `pages` (ascending) into `hot`, as the offload manager's: the buffer's diff
/// of them. Answers the pages it loaded.
fn prefetch(hot: &mut HotBuffer, pages: &[i32], current: i32) -> Vec<i32> {
    if pages.is_empty() {
        return Vec::new();
    }
    hot.diff(pages, current)
        .misses
        .iter()
        .map(|m| m.0 as i32)
        .collect()
}
