//! How much of a decode step's selection the step before selected: a measurement on the real
//! model (CPU), for attention over the previous step's pages while the top-k runs (issue 7,
//! kernels/NOTES.md session 74).
//!
//! `cargo run --release -p engine --example overlap [MODEL] [TEXT]` runs the model densely over
//! the text (a prefill of [`PREFILL`] tokens, then [`STEPS`] teacher-forced decode steps) and, in
//! every layer but the first two, selects as per-KV-head Quest over pages of [`PAGE`] does
//! (`sparse_algo::Quest` over the engine's own cache) at each budget of [`BUDGETS`]. Per
//! (layer, KV head) row and step it counts the share of the step's pages that the step before
//! selected, that either of the two steps before selected, and that an offload `HotBuffer` of
//! twice the budget held (its hit rate, as the offload manager diffs a selection).

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

#[path = "shared/real.rs"]
mod real;

use engine::{Attention, Batch, DenseAttention, EngineError, KvStore};
use offload::HotBuffer;
use sparse_algo::{AlgoError, Decode, PagedKeys, Quest, QuestConfig, RepPool, SparseAlgorithm};

/// Tokens prefilled, then decode steps measured.
const PREFILL: usize = 6144;
const STEPS: usize = 256;
/// Tokens per page, and the decode budgets in tokens.
const PAGE: usize = 16;
const BUDGETS: [usize; 5] = [128, 256, 512, 1024, 2048];
/// Layers attended densely (as in the engine's Quest variants).
const DENSE_LAYERS: usize = 2;

fn main() {
    real::main_with("overlap", run);
}

fn run(model_path: &str, text_path: &str) -> Result<(), EngineError> {
    let n = PREFILL + STEPS;
    let (model, ids) = real::load(model_path, text_path, n)?;
    let c = model.config;
    let blocks = n.div_ceil(PAGE);
    let mut store = KvStore::<half::f16>::new(&c, blocks, PAGE)?;
    let algo = |budget| {
        Quest::new(QuestConfig {
            page_size: PAGE,
            budget_tokens: budget,
            ..Default::default()
        })
    };
    let quests = BUDGETS
        .map(algo)
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(&e))?;
    let shape = quests[0].rep_shape(c.kv_heads, c.head_dim);
    let mut probe = Probe {
        quests,
        pools: (0..c.layers)
            .map(|_| RepPool::new(shape, 1, 1, n))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| err(&e))?,
        history: vec![vec![Vec::new(); c.layers]; BUDGETS.len()],
        hot: BUDGETS
            .iter()
            .map(|b| vec![vec![HotBuffer::new(2 * b / PAGE); c.kv_heads]; c.layers])
            .collect(),
        tally: vec![Tally::default(); BUDGETS.len()],
        q_heads: c.q_heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        table: (0..blocks as i32).collect(),
    };
    for (start, end) in real::spans(PREFILL, n) {
        let decode = start >= PREFILL;
        let batch = Batch::single(start, end, blocks);
        let positions: Vec<usize> = (start..end).collect();
        let mut att = Step {
            dense: DenseAttention {
                store: &mut store,
                batch: &batch,
            },
            probe: &mut probe,
            len: decode.then_some(end),
        };
        let logits_for: &[usize] = if decode { &[0] } else { &[] };
        model.forward(&ids[start..end], &positions, &mut att, logits_for)?;
    }
    println!(
        "{model_path}, {PREFILL} prefill + {STEPS} decode steps of {text_path}; per-KV-head \
         Quest, pages of {PAGE}, layers {DENSE_LAYERS}.. ({} pages at the end)",
        n.div_ceil(PAGE)
    );
    println!(
        "budget (tokens) | pages a row | share of the context | held by the step before: mean \
         | rows at 95 % or more | held by either of the two steps before: mean | held by a \
         hot buffer of twice the budget"
    );
    for (budget, t) in BUDGETS.iter().zip(&probe.tally) {
        println!(
            "{budget:>15} | {:>11.1} | {:>20.4} | {:>29.4} | {:>20.4} | {:>44.4} | {:>38.4}",
            t.pages as f64 / t.rows.max(1) as f64,
            (budget / PAGE) as f64 / n.div_ceil(PAGE) as f64,
            t.held / t.rows.max(1) as f64,
            t.high as f64 / t.rows.max(1) as f64,
            t.held2 / t.rows2.max(1) as f64,
            1.0 - t.hot_misses as f64 / t.pages.max(1) as f64,
        );
    }
    Ok(())
}

fn err(e: &AlgoError) -> EngineError {
    EngineError::Invalid(e.to_string())
}

/// Per budget, the counts over rows (one per layer, KV head and step).
#[derive(Clone, Default)]
struct Tally {
    rows: usize,
    pages: usize,
    /// Sum over rows of the share the step before held, and rows where that was 95 % or more.
    held: f64,
    high: usize,
    /// The same against either of the two steps before, over the rows that have two.
    held2: f64,
    rows2: usize,
    /// Pages the hot buffers lacked, over the rows `pages` counts.
    hot_misses: usize,
}

/// The selections: a Quest per budget over one representation pool per layer.
struct Probe {
    quests: Vec<Quest>,
    pools: Vec<RepPool>,
    /// Per (budget, layer), the last two steps' rows (newest last), per KV head.
    history: Vec<Vec<Vec<Vec<Vec<i32>>>>>,
    /// Per (budget, layer, KV head), a hot buffer of twice the budget.
    hot: Vec<Vec<Vec<HotBuffer>>>,
    tally: Vec<Tally>,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    table: Vec<i32>,
}

/// Dense attention that, in a decode step, then selects over the layer's cache.
struct Step<'a, 'b> {
    dense: DenseAttention<'a, half::f16>,
    probe: &'b mut Probe,
    /// The sequence's length after this decode step's token.
    len: Option<usize>,
}

impl Attention for Step<'_, '_> {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        self.dense.attend(layer, q, k, v, out)?;
        if let Some(len) = self.len
            && layer >= DENSE_LAYERS
        {
            self.probe
                .select(self.dense.store.layer(layer), layer, q, len)
                .map_err(|e| err(&e))?;
        }
        Ok(())
    }
}

impl Probe {
    /// Brings `layer`'s pool up to `len` tokens of `kv` and tallies each budget's selection
    /// for the query `q` (`[q_heads, head_dim]`) against the steps before.
    fn select(
        &mut self,
        kv: &attn_op::PagedKv<half::f16>,
        layer: usize,
        q: &[f32],
        len: usize,
    ) -> Result<(), AlgoError> {
        let lens = [len as i32];
        let keys = PagedKeys::new(kv, &lens, &self.table, self.table.len())?;
        let pool = &mut self.pools[layer];
        self.quests[0].update_representations(0, &keys, &[0], pool)?;
        let step = Decode {
            layer: 0,
            q,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            seq_lens: &[len],
            slots: &[0],
            keys: Some(&keys),
        };
        for (b, quest) in self.quests.iter().enumerate() {
            let top = quest.retrieve_topk(&step, pool)?;
            let rows: Vec<Vec<i32>> = (0..self.kv_heads).map(|h| top.row(0, h).to_vec()).collect();
            let history = &mut self.history[b][layer];
            let t = &mut self.tally[b];
            let current = ((len - 1) / PAGE) as i32;
            for (h, row) in rows.iter().enumerate() {
                let misses = self.hot[b][layer][h].diff(row, current).misses.len();
                let share = |before: &[&Vec<Vec<i32>>]| {
                    let held = row
                        .iter()
                        .filter(|p| before.iter().any(|s| s[h].binary_search(p).is_ok()))
                        .count();
                    held as f64 / row.len().max(1) as f64
                };
                if let Some(last) = history.last() {
                    let s = share(&[last]);
                    t.rows += 1;
                    t.pages += row.len();
                    t.held += s;
                    t.high += usize::from(s >= 0.95);
                    t.hot_misses += misses;
                }
                if history.len() == 2 {
                    t.held2 += share(&[&history[0], &history[1]]);
                    t.rows2 += 1;
                }
            }
            history.push(rows);
            if history.len() > 2 {
                history.remove(0);
            }
        }
        Ok(())
    }
}
