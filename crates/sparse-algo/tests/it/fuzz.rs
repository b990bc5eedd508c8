//! Arbitrary inputs, valid or not: every algorithm answers each phase (construction, update,
//! decode selection, prefill keep prediction) with a result or a typed error, never a panic.
//!
//! Each case is a valid batch, drawn from a seed, run through every algorithm, with up to three
//! edits a caller's bug could make: a head count or dim of 0 or near `usize::MAX`, a sequence
//! length of 0 or past what the keys hold, a slot or layer outside the pool, a repeated slot, a
//! query buffer one off, prompt query rows that are negative or past their prompt, no keys. An
//! unedited batch must succeed in every phase an algorithm supports, and every selection must
//! be well formed: ascending ids inside their sequence, as many rows as (sequence, KV head).

use proptest::prelude::*;
use sparse_algo::metrics::{mass_recall, topk_recall};
use sparse_algo::{AlgoConfig, Decode, KeySource, Prompt, RepPool, TopK};

use crate::util::{Case, Rng};

proptest! {
    /// Every algorithm's phases on a valid batch with up to three edits.
    #[test]
    fn every_algorithm_answers_every_call(
        seed in any::<u64>(),
        edits in prop::collection::vec((0..EDITS, any::<usize>()), 0..4),
    ) {
        let batch = Batch::new(seed);
        for config in configs() {
            let algo = config.build(None).expect("the configs are valid");
            let name = algo.caps().name;
            let mut call = batch.call();
            for &(edit, at) in &edits {
                call.apply(edit, at);
            }
            let keys = batch.case.keys();
            let valid = edits.is_empty();
            let shape = algo.rep_shape(batch.kv_heads, batch.head_dim);
            let Ok(mut pool) = RepPool::new(shape, 1, batch.seqs, MAX_LEN) else {
                panic!("{name}: a small pool was refused");
            };
            let built = algo.construct_representations(call.layer, &keys, &call.slots, &mut pool);
            prop_assert!(built.is_ok() || !valid, "{name}: construction: {built:?}");
            let updated = algo.update_representations(call.layer, &keys, &call.slots, &mut pool);
            prop_assert!(updated.is_ok() || !valid, "{name}: update: {updated:?}");
            let caps = algo.caps();
            if caps.decode {
                let step = call.step(call.keys.then_some(&keys as &dyn KeySource));
                let top = algo.retrieve_topk(&step, &pool);
                match &top {
                    Ok(t) => {
                        well_formed(t, &batch.lens, caps.page_size, batch.kv_heads, valid);
                        metrics_answer(t, &step, &batch.lens, &edits);
                    }
                    Err(e) => prop_assert!(!valid, "{name}: decode: {e}"),
                }
            }
            if caps.prefill_keep {
                let prompt = Prompt {
                    layer: call.layer,
                    q: &call.prompt_q,
                    cu_q: &call.cu_q,
                    q_heads: call.q_heads,
                    keys: &keys,
                };
                match algo.predict_keep(&prompt) {
                    Ok(t) => well_formed(&t, &batch.lens, 1, batch.kv_heads, valid),
                    Err(e) => prop_assert!(!valid, "{name}: keep: {e}"),
                }
            }
        }
    }
}

/// Kinds of edit (see [`Call::apply`]).
const EDITS: usize = 12;

/// The longest sequence of a batch, and the pool's capacity.
const MAX_LEN: usize = 80;

/// Every algorithm, with budgets that fit the short sequences (pages of 16 by default).
fn configs() -> Vec<AlgoConfig> {
    let defaults: [fn() -> AlgoConfig; 7] = [
        || AlgoConfig::Full(Default::default()),
        || AlgoConfig::StreamingLlm(Default::default()),
        || AlgoConfig::Quest(Default::default()),
        || AlgoConfig::SnapKv(Default::default()),
        || AlgoConfig::RocketKv(Default::default()),
        || AlgoConfig::Dsa(Default::default()),
        || AlgoConfig::Oracle(Default::default()),
    ];
    defaults.iter().map(|make| make().with_budget(48)).collect()
}

/// A valid batch of sequences, with queries for decode and prompt queries for keep
/// prediction.
struct Batch {
    case: Case<f32>,
    seqs: usize,
    lens: Vec<usize>,
    kv_heads: usize,
    head_dim: usize,
    q_heads: usize,
}

impl Batch {
    fn new(seed: u64) -> Batch {
        let mut rng = Rng::new(seed);
        let (kv_heads, head_dim) = (rng.range(1, 3), [4, 8, 16][rng.range(0, 3)]);
        let q_heads = kv_heads * rng.range(1, 4);
        let seqs = rng.range(1, 4);
        let lens: Vec<usize> = (0..seqs).map(|_| rng.range(1, MAX_LEN + 1)).collect();
        let keys: Vec<Vec<f32>> = lens
            .iter()
            .map(|&l| rng.vec(l * kv_heads * head_dim, 1.0))
            .collect();
        let q = rng.vec(seqs * q_heads * head_dim, 1.0);
        let bs = [4, 16][rng.range(0, 2)];
        Batch {
            case: Case::new(&keys, q, q_heads, kv_heads, head_dim, bs, &mut rng),
            seqs,
            lens,
            kv_heads,
            head_dim,
            q_heads,
        }
    }

    /// The batch's calls, unedited: every prompt's queries are its whole prompt.
    fn call(&self) -> Call {
        let mut cu_q = vec![0i32];
        for &l in &self.lens {
            cu_q.push(cu_q[cu_q.len() - 1] + l as i32);
        }
        let rows = self.lens.iter().sum::<usize>();
        let prompt_q = (0..rows * self.q_heads * self.head_dim)
            .map(|i| (i % 11) as f32 * 0.1 - 0.5)
            .collect();
        Call {
            layer: 0,
            q: self.case.q.clone(),
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            seq_lens: self.lens.clone(),
            slots: (0..self.seqs).collect(),
            keys: true,
            prompt_q,
            cu_q,
        }
    }
}

/// The fields of a decode step and a prompt that an edit can change.
#[derive(Debug)]
struct Call {
    layer: usize,
    q: Vec<f32>,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    seq_lens: Vec<usize>,
    slots: Vec<usize>,
    keys: bool,
    prompt_q: Vec<f32>,
    cu_q: Vec<i32>,
}

impl Call {
    /// Edit `edit`, at entry `at` (modulo the array's length) where it touches an array.
    fn apply(&mut self, edit: usize, at: usize) {
        let huge = [0, 1, usize::MAX, usize::MAX / 2 + 1][at % 4];
        let pick = |n: usize| at % n.max(1);
        match edit {
            0 => self.q_heads = huge,
            1 => self.kv_heads = huge,
            2 => self.head_dim = huge,
            3 => {
                let i = pick(self.seq_lens.len());
                self.seq_lens[i] = [0, MAX_LEN + 1, usize::MAX][at % 3];
            }
            4 if !self.slots.is_empty() => {
                let i = pick(self.slots.len());
                self.slots[i] = [usize::MAX, self.slots.len()][at % 2];
            }
            5 if !self.slots.is_empty() => {
                let n = self.slots.len();
                self.slots[pick(n)] = self.slots[(at + 1) % n];
                if n == 1 {
                    self.slots.push(self.slots[0]);
                }
            }
            6 => self.layer = [1, usize::MAX][at % 2],
            7 => {
                if at.is_multiple_of(2) {
                    self.q.pop();
                } else {
                    self.q.push(0.5);
                }
            }
            8 => self.keys = false,
            9 if !self.cu_q.is_empty() => {
                let i = pick(self.cu_q.len());
                self.cu_q[i] = [-1, i32::MAX, i32::MIN, 0][at % 4];
            }
            10 => {
                if at.is_multiple_of(2) {
                    self.prompt_q.pop();
                } else {
                    self.cu_q.pop();
                }
            }
            11 => self.slots.clear(),
            // Edits of an array that an earlier edit emptied.
            _ => {}
        }
    }

    fn step<'a>(&'a self, keys: Option<&'a dyn KeySource>) -> Decode<'a> {
        Decode {
            layer: self.layer,
            q: &self.q,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            seq_lens: &self.seq_lens,
            slots: &self.slots,
            keys,
        }
    }
}

/// Checks a selection's format: one row per (sequence, KV head) of the batch, lengths within
/// the width, -1 padding; where the call was valid, ascending ids inside their sequence.
fn well_formed(t: &TopK, lens: &[usize], page_size: usize, kv_heads: usize, valid: bool) {
    let rows = t.lens.len();
    assert_eq!(t.ids.len(), rows * t.max_len, "ids are [rows, max_len]");
    for (r, &n) in t.lens.iter().enumerate() {
        assert!(n >= 0 && n as usize <= t.max_len, "row {r}: length {n}");
        let row = &t.ids[r * t.max_len..(r + 1) * t.max_len];
        assert!(
            row[n as usize..].iter().all(|&x| x == -1),
            "row {r}: -1 padding"
        );
    }
    if valid {
        assert_eq!(rows, lens.len() * kv_heads, "a row per (sequence, KV head)");
        for (r, &n) in t.lens.iter().enumerate() {
            let row = &t.ids[r * t.max_len..r * t.max_len + n as usize];
            let pages = lens[r / kv_heads].div_ceil(page_size) as i32;
            assert!(
                row.windows(2).all(|w| w[0] < w[1]),
                "row {r}: ascending {row:?}"
            );
            assert!(
                row.iter().all(|&p| (0..pages).contains(&p)),
                "row {r}: {row:?} in 0..{pages}"
            );
        }
    }
}

/// The recall metrics on `t` and on copies of it broken as the edits say (a width near
/// `usize::MAX`, KV heads of 0 or near `usize::MAX`, a row length or id out of range): an
/// answer or a typed error, never a panic; `t` against itself recalls everything.
fn metrics_answer(t: &TopK, step: &Decode<'_>, lens: &[usize], edits: &[(usize, usize)]) {
    if let Ok(r) = topk_recall(t, t, lens) {
        assert!(
            r.iter().all(|&x| x == 1.0),
            "a selection recalls itself: {r:?}"
        );
    }
    let _ = mass_recall(step, t, 0.125);
    for &(edit, at) in edits {
        let mut b = t.clone();
        match edit % 4 {
            0 => b.max_len = [usize::MAX, usize::MAX / 2 + 1][at % 2],
            1 => b.kv_heads = [0, usize::MAX][at % 2],
            2 if !b.lens.is_empty() => {
                let i = at % b.lens.len();
                b.lens[i] = [-1, i32::MAX][at % 2];
            }
            _ if !b.ids.is_empty() => {
                let i = at % b.ids.len();
                b.ids[i] = [i32::MAX, i32::MIN][at % 2];
            }
            _ => {}
        }
        let _ = topk_recall(&b, t, lens);
        let _ = mass_recall(step, &b, 0.125);
    }
}
