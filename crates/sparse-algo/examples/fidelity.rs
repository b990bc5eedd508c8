//! What each algorithm loses on a synthetic long-context trace: attention-mass recall and
//! relative output error against dense attention, at budgets of 256, 1024 and 2048 tokens.
//!
//! `cargo run --release -p sparse-algo --example fidelity` prints a Markdown table.
//!
//! The trace (one sequence of 32K tokens, 32 query / 8 KV heads, head dim 128, bf16 KV) is built
//! to have the structure real attention has, with a fixed seed:
//! - attention sinks: the first 4 keys lie along a direction every query shares;
//! - topics: the context is cut into segments of 64–512 tokens, each about one of 64 topics
//!   per KV head; a key is its segment's topic plus noise;
//! - a question: each decode query mixes 3 topics, so the segments about them matter;
//! - needles: 8 tokens aligned with the question's first topic, scattered through the context;
//! - locality: the last 256 tokens are about the question's topics too.
//!
//! Four decode steps ask different questions; the figures are means over steps and query heads.
//! SnapKV keeps `budget` tokens chosen at prefill by the last 32 prompt queries (which ask the
//! first question), so later questions show what one-shot eviction loses. RocketKV runs both
//! stages: its prefill keeps `4 * budget` tokens, then each step selects `budget` tokens of
//! pages of 4 among them. The DSA row is the generic fallback (ReLU of the true logits), not a
//! trained indexer.
#![allow(clippy::print_stdout, reason = "an example that prints its table")]

use attn_op::{AttnParams, BatchMeta, KvLayout, PagedKv, compact_kv};
use half::bf16;
use proptest::prelude::RngExt;
use proptest::test_runner::{RngAlgorithm, TestRng};
use sparse_algo::metrics::{mass_recall, mean, output_error};
use sparse_algo::{
    AlgoConfig, AlgoError, Decode, DsaConfig, FullConfig, OracleConfig, PagedKeys, Prompt,
    QuestConfig, RepPool, RocketConfig, SnapKvConfig, SparseAlgorithm, StreamingConfig, Summary,
    TopK,
};

const LEN: usize = 32 * 1024;
const KVH: usize = 8;
const GROUP: usize = 4;
const QH: usize = KVH * GROUP;
const D: usize = 128;
const BS: usize = 16;
const TOPICS: usize = 64;
const STEPS: usize = 4;
const WINDOW: usize = 32;

fn main() -> Result<(), AlgoError> {
    let trace = Trace::new(0x5eed);
    let lens = [LEN as i32];
    let table: Vec<i32> = (0..(LEN / BS) as i32).collect();
    let keys = PagedKeys::new(&trace.kv, &lens, &table, table.len())?;
    let scale = 1.0 / (D as f32).sqrt();
    let params = AttnParams::new(QH, D);
    let meta = BatchMeta {
        cu_seqlens_q: &[0, 1],
        seq_lens_kv: &lens,
        block_table: &table,
        max_blocks: table.len(),
    };
    println!(
        "Synthetic trace: {LEN} tokens, {QH} q / {KVH} kv heads, D {D}, bf16; means over \
         {STEPS} decode steps x {QH} query heads.\n"
    );
    println!("| algorithm | budget | mass recall | output error |");
    println!("| --- | ---: | ---: | ---: |");
    for budget in [256usize, 1024, 2048] {
        let configs = [
            ("full", AlgoConfig::Full(FullConfig::default())),
            (
                "streaming_llm",
                AlgoConfig::StreamingLlm(StreamingConfig::default()),
            ),
            ("quest", AlgoConfig::Quest(QuestConfig::default())),
            (
                "quest (e4m3 summaries)",
                AlgoConfig::Quest(QuestConfig {
                    summary: Summary::E4m3,
                    ..Default::default()
                }),
            ),
            (
                "quest (shared heads)",
                AlgoConfig::Quest(QuestConfig {
                    shared_heads: true,
                    ..Default::default()
                }),
            ),
            ("dsa (fallback)", AlgoConfig::Dsa(DsaConfig::default())),
            (
                "oracle (pages of 16)",
                AlgoConfig::Oracle(OracleConfig::default()),
            ),
            (
                "oracle (tokens)",
                AlgoConfig::Oracle(OracleConfig {
                    page_size: 1,
                    ..Default::default()
                }),
            ),
        ];
        let prompt = Prompt {
            layer: 0,
            q: &trace.window_q,
            cu_q: &[0, WINDOW as i32],
            q_heads: QH,
            keys: &keys,
        };
        let snap = AlgoConfig::SnapKv(SnapKvConfig::default())
            .with_budget(budget)
            .build(None)?
            .predict_keep(&prompt)?;
        let rocket_cfg = RocketConfig {
            prompt_budget: 4 * budget,
            topk: budget,
            ..Default::default()
        };
        let rocket = AlgoConfig::RocketKv(rocket_cfg).build(None)?;
        let rocket_keep = rocket.predict_keep(&prompt)?;
        let compacted = Compacted::new(&trace.kv, &table, &rocket_keep)?;
        let mut rows: Vec<(String, Vec<f64>, Vec<f64>)> = Vec::new();
        let mut record = |name: &str, step: &Decode<'_>, sel: &TopK| -> Result<(), AlgoError> {
            let m = mass_recall(step, sel, scale)?;
            let q: Vec<bf16> = step.q.iter().map(|&x| bf16::from_f32(x)).collect();
            let e = output_error(&q, &trace.kv, &meta, sel, &params)?;
            match rows.iter_mut().find(|r| r.0 == name) {
                Some(r) => {
                    r.1.extend(m);
                    r.2.extend(e);
                }
                None => rows.push((name.to_owned(), m, e)),
            }
            Ok(())
        };
        for s in 0..STEPS {
            let step = Decode {
                layer: 0,
                q: &trace.q[s * QH * D..(s + 1) * QH * D],
                q_heads: QH,
                kv_heads: KVH,
                head_dim: D,
                seq_lens: &[LEN],
                slots: &[0],
                keys: Some(&keys),
            };
            for (name, config) in &configs {
                let algo = config.clone().with_budget(budget).build(None)?;
                let sel = select(algo.as_ref(), &step, &keys)?;
                record(name, &step, &sel)?;
            }
            record("snapkv", &step, &snap)?;
            let sel = compacted.select(rocket.as_ref(), &step, &rocket_keep)?;
            record("rocketkv (both stages)", &step, &sel)?;
        }
        for (name, m, e) in rows {
            println!("| {name} | {budget} | {:.3} | {:.3} |", mean(&m), mean(&e));
        }
    }
    Ok(())
}

/// Builds representations and selects for one decode step.
fn select(
    algo: &dyn SparseAlgorithm,
    step: &Decode<'_>,
    keys: &PagedKeys<'_, bf16>,
) -> Result<TopK, AlgoError> {
    let mut pool = RepPool::new(algo.rep_shape(KVH, D), 1, 1, LEN)?;
    algo.construct_representations(0, keys, &[0], &mut pool)?;
    algo.retrieve_topk(step, &pool)
}

/// The KV cache after RocketKV's first stage, for its second.
struct Compacted {
    kv: PagedKv<bf16>,
    len: [i32; 1],
    table: Vec<i32>,
}

impl Compacted {
    fn new(kv: &PagedKv<bf16>, table: &[i32], keep: &TopK) -> Result<Self, AlgoError> {
        let mut kv = kv.clone();
        let lens = compact_kv(
            &mut kv,
            &[LEN as i32],
            table,
            table.len(),
            &keep.as_selection(),
        )?;
        Ok(Compacted {
            kv,
            len: [lens[0]],
            table: table.to_vec(),
        })
    }

    /// Stage 2 on the compacted cache, mapped back to the original positions.
    fn select(
        &self,
        algo: &dyn SparseAlgorithm,
        step: &Decode<'_>,
        keep: &TopK,
    ) -> Result<TopK, AlgoError> {
        let n = self.len[0] as usize;
        let keys = PagedKeys::new(&self.kv, &self.len, &self.table, self.table.len())?;
        let inner = Decode {
            seq_lens: &[n],
            keys: Some(&keys),
            ..*step
        };
        let sel = select(algo, &inner, &keys)?.to_tokens(&[n]);
        let rows: Vec<Vec<i32>> = (0..KVH)
            .map(|h| {
                let map = keep.row(0, h);
                sel.row(0, h).iter().map(|&t| map[t as usize]).collect()
            })
            .collect();
        Ok(TopK::from_rows(&rows, KVH, 1))
    }
}

/// The synthetic trace: KV cache, decode queries `[STEPS, QH, D]`, and the prompt's last
/// `WINDOW` queries `[WINDOW, QH, D]`.
struct Trace {
    kv: PagedKv<bf16>,
    q: Vec<f32>,
    window_q: Vec<f32>,
}

impl Trace {
    fn new(seed: u64) -> Self {
        let mut rng = Gen::new(seed);
        let topics: Vec<Vec<f32>> = (0..KVH * TOPICS).map(|_| rng.gauss_vec(D, 1.0)).collect();
        let sink: Vec<Vec<f32>> = (0..KVH).map(|_| rng.gauss_vec(D, 1.0)).collect();
        let questions: Vec<[usize; 3]> = (0..STEPS)
            .map(|_| [0, 1, 2].map(|_| rng.below(TOPICS)))
            .collect();
        let mut seg_topic = vec![0usize; LEN];
        let mut t = 0;
        while t < LEN {
            let n = 64 + rng.below(449);
            let topic = rng.below(TOPICS);
            for x in seg_topic.iter_mut().skip(t).take(n) {
                *x = topic;
            }
            t += n;
        }
        let needles: Vec<usize> = (0..8).map(|_| 64 + rng.below(LEN - 600)).collect();
        let stride = KVH * D;
        let mut k = vec![0.0f32; LEN * stride];
        for (pos, key) in k.chunks_exact_mut(stride).enumerate() {
            for h in 0..KVH {
                let dst = &mut key[h * D..(h + 1) * D];
                let topic = if pos >= LEN - 256 {
                    questions[0][pos % 3]
                } else {
                    seg_topic[pos]
                };
                let base = if pos < 4 {
                    sink[h].iter().map(|x| 3.0 * x).collect()
                } else if needles.contains(&pos) {
                    topics[h * TOPICS + questions[0][0]]
                        .iter()
                        .map(|x| 2.5 * x)
                        .collect()
                } else {
                    topics[h * TOPICS + topic]
                        .iter()
                        .map(|x| 0.8 * x)
                        .collect::<Vec<_>>()
                };
                for (d, b) in dst.iter_mut().zip(base) {
                    *d = b + rng.gauss();
                }
            }
        }
        let query = |rng: &mut Gen, qs: &[usize; 3]| -> Vec<f32> {
            (0..QH)
                .flat_map(|j| {
                    let h = j / GROUP;
                    (0..D)
                        .map(|d| {
                            0.5 * sink[h][d]
                                + qs.iter()
                                    .map(|&t| 0.6 * topics[h * TOPICS + t][d])
                                    .sum::<f32>()
                                + 0.5 * rng.gauss()
                        })
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        let q: Vec<f32> = questions
            .iter()
            .flat_map(|qs| query(&mut rng, qs))
            .collect();
        let window_q: Vec<f32> = (0..WINDOW)
            .flat_map(|_| query(&mut rng, &questions[0]))
            .collect();
        let layout = KvLayout {
            num_blocks: LEN / BS,
            block_size: BS,
            kv_heads: KVH,
            head_dim: D,
        };
        let kb: Vec<bf16> = k.iter().map(|&x| bf16::from_f32(x)).collect();
        let v: Vec<bf16> = (0..layout.len())
            .map(|_| bf16::from_f32(rng.gauss()))
            .collect();
        Trace {
            kv: PagedKv::from_tensors(layout, kb, v).expect("the trace is built to the layout"),
            q,
            window_q,
        }
    }
}

/// Proptest's seeded ChaCha generator with a Box-Muller normal.
struct Gen(TestRng);

impl Gen {
    fn new(seed: u64) -> Self {
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        Gen(TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
    }

    fn below(&mut self, n: usize) -> usize {
        self.0.random_range(0..n)
    }

    fn gauss(&mut self) -> f32 {
        let a: f32 = self.0.random_range(f32::EPSILON..1.0);
        let b: f32 = self.0.random_range(0.0..1.0);
        (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
    }

    fn gauss_vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| scale * self.gauss()).collect()
    }
}
