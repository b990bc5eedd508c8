//! The forward pass on synthetic models: matmul paths against an f64 reference, chunked
//! prefill against token-by-token decode, sparse with a full budget against dense, sampling,
//! typed errors on bad requests, and the passkey prompts.

use coordinator::SparseConfig;
use engine::eval::{EvalOptions, teacher_forced};
use engine::gguf::{DType, Gguf};
use engine::synthetic::synthetic_gguf;
use engine::{
    Batch, DenseAttention, EngineError, KvStore, Linear, Model, ModelConfig, RequestError, Sampler,
    Sampling, Tokenizer,
};
use sparse_algo::{AlgoConfig, QuestConfig};

pub(crate) const TINY: ModelConfig = ModelConfig {
    layers: 3,
    embed: 64,
    ffn: 160,
    q_heads: 4,
    kv_heads: 2,
    head_dim: 16,
    vocab: 300,
    context: 1024,
    rope_base: 10_000.0,
    rms_eps: 1e-5,
};

pub(crate) fn tiny(dtype: DType) -> Gguf {
    Gguf::from_bytes(synthetic_gguf(&TINY, dtype, 7)).expect("the writer writes valid files")
}

/// Token ids of a deterministic pseudo-text.
pub(crate) fn text(n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + i / 5 * 11 + 3) % 256)
        .collect()
}

#[test]
fn both_matmul_paths_match_an_f64_reference() {
    for dtype in [DType::F32, DType::F16, DType::Q8_0, DType::Q4_1] {
        let g = tiny(dtype);
        let l =
            Linear::from_gguf(&g, "blk.0.ffn_gate.weight", TINY.ffn, TINY.embed).expect("a tensor");
        let w = g.dequantize("blk.0.ffn_gate.weight").expect("a tensor");
        for n in [1, 3, 8, 19] {
            let x: Vec<f32> = (0..n * TINY.embed)
                .map(|i| ((i * 7919 % 97) as f32 - 48.0) / 40.0)
                .collect();
            // Fewer than 8 rows against quantized weights: the rows are quantized to 8 bits
            // in blocks of 32 first (ggml's Q8 activations), so the reference takes the same
            // values, and the result stays within the quantization's bound of the exact one.
            let quantized = n < 8 && matches!(dtype, DType::Q8_0 | DType::Q4_1);
            let (xq, step) = if quantized {
                q8(&x)
            } else {
                (
                    x.iter().map(|&v| f64::from(v)).collect(),
                    vec![0.0; x.len()],
                )
            };
            let mut out = vec![f32::NAN; n * TINY.ffn];
            l.forward(&x, n, &mut out);
            for t in 0..n {
                for r in 0..TINY.ffn {
                    let row = |k: usize| f64::from(w[r * TINY.embed + k]);
                    let at = |k: usize| t * TINY.embed + k;
                    let want: f64 = (0..TINY.embed).map(|k| xq[at(k)] * row(k)).sum();
                    let exact: f64 = (0..TINY.embed).map(|k| f64::from(x[at(k)]) * row(k)).sum();
                    let bound: f64 = (0..TINY.embed)
                        .map(|k| row(k).abs() * step[at(k)] / 2.0)
                        .sum();
                    let got = f64::from(out[t * TINY.ffn + r]);
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{dtype:?} n={n} ({t}, {r}): {got} vs {want}"
                    );
                    assert!(
                        (got - exact).abs() <= bound * 1.001 + 1e-4 * (1.0 + exact.abs()),
                        "{dtype:?} n={n} ({t}, {r}): {got} is {} from {exact}, over {bound}",
                        (got - exact).abs()
                    );
                }
            }
        }
    }
}

/// `x` quantized as the decode matmul does, in blocks of 32: `d = max|x| / 127`, `q` =
/// `x · 127 / max|x|` rounded. Returns the values `d · q` and each element's step `d`.
fn q8(x: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let (mut vals, mut steps) = (Vec::new(), Vec::new());
    for b in x.chunks(32) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let d = amax / 127.0;
        for &v in b {
            vals.push(f64::from(d) * f64::from((v * id).round().clamp(-127.0, 127.0)));
            steps.push(f64::from(d));
        }
    }
    (vals, steps)
}

/// Logits of every position of `tokens`, prefilled in chunks of `chunk` (1: decode).
pub(crate) fn logits(m: &Model, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let n = tokens.len();
    let mut store = KvStore::<f32>::new(&m.config, n.div_ceil(16), 16).expect("a valid layout");
    let mut all = Vec::new();
    for (i, c) in tokens.chunks(chunk).enumerate() {
        let pos = i * chunk;
        let e = pos + c.len();
        let batch = Batch::single(pos, e, n.div_ceil(16));
        let rows: Vec<usize> = (0..c.len()).collect();
        let positions: Vec<usize> = (pos..e).collect();
        let mut attn = DenseAttention {
            store: &mut store,
            batch: &batch,
        };
        all.extend(
            m.forward(c, &positions, &mut attn, &rows)
                .expect("a valid batch"),
        );
    }
    all
}

/// The largest difference of two logit rows, relative to `1 + |a|` (so that logits near zero
/// count absolutely).
pub(crate) fn worst_relative(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs() / (1.0 + a.abs()))
        .fold(0.0f32, f32::max)
}

#[test]
fn chunked_prefill_equals_decode() {
    // F32 weights: every path computes the same sums. Q8_0: decode rows (fewer than 8) are
    // quantized to 8 bits, so they differ from the prefill's f32 rows by that rounding.
    for (dtype, tolerance) in [(DType::F32, 1e-4), (DType::Q8_0, 5e-2)] {
        let m = Model::load(&tiny(dtype)).expect("a valid model");
        let tokens = text(70);
        let whole = logits(&m, &tokens, 70);
        for chunk in [1, 16, 33] {
            let other = logits(&m, &tokens, chunk);
            let worst = worst_relative(&whole, &other);
            assert!(
                worst < tolerance,
                "{dtype:?}, chunks of {chunk}: relative difference {worst}"
            );
        }
        assert!(whole.iter().all(|x| x.is_finite()) && whole.iter().any(|&x| x != 0.0));
    }
}

#[test]
fn float_copies_round_each_weight_once() {
    let g = tiny(DType::Q4_1);
    let name = "blk.0.ffn_gate.weight";
    let l = Linear::from_gguf(&g, name, TINY.ffn, TINY.embed).expect("a tensor");
    let w = g.dequantize(name).expect("a tensor");
    // One-hot rows pick the weights' columns out exactly: out[t, r] = W[r, t].
    let n = 8;
    let mut x = vec![0.0f32; n * TINY.embed];
    (0..n).for_each(|t| x[t * TINY.embed + t] = 1.0);
    for (dtype, round) in [
        (DType::F32, (|v| v) as fn(f32) -> f32),
        (DType::F16, |v| half::f16::from_f32(v).to_f32()),
        (DType::BF16, |v| half::bf16::from_f32(v).to_f32()),
    ] {
        let mut out = vec![f32::NAN; n * TINY.ffn];
        l.to_float(dtype)
            .expect("a float type")
            .forward(&x, n, &mut out);
        for t in 0..n {
            for r in 0..TINY.ffn {
                let want = round(w[r * TINY.embed + t]);
                assert_eq!(out[t * TINY.ffn + r], want, "{dtype:?} W[{r}, {t}]");
            }
        }
    }
    assert!(matches!(
        l.to_float(DType::Q8_0),
        Err(EngineError::Invalid(_))
    ));
    // A whole model: f32 copies leave prefill rows (which meet exact weights) bit for bit as
    // they were; bf16 moves the logits, by a bounded amount.
    let m = Model::load(&g).expect("a valid model");
    let tokens = text(40);
    let exact = logits(&m, &tokens, 40);
    let as_f32 = m.with_float_weights(DType::F32).expect("a float type");
    assert_eq!(logits(&as_f32, &tokens, 40), exact);
    // The largest change of a logit, relative to 1 + its size.
    let moved = |got: &[f32], from: &[f32]| {
        got.iter()
            .zip(from)
            .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
            .fold(0.0f32, f32::max)
    };
    let as_bf16 = m.with_float_weights(DType::BF16).expect("a float type");
    let weights_only = logits(&as_bf16, &tokens, 40);
    let by_weights = moved(&weights_only, &exact);
    assert!(
        by_weights > 0.0 && by_weights < 0.1,
        "bf16 weights moved the logits by {by_weights}"
    );
    // Computing in f32 is the exact forward; computing in bf16 also rounds every input of a
    // projection and of the attention, which moves the logits again, by a bounded amount.
    let computing = |dtype| m.computing_in(dtype).expect("a float type");
    assert_eq!(logits(&computing(DType::F32), &tokens, 40), exact);
    let by_inputs = moved(&logits(&computing(DType::BF16), &tokens, 40), &weights_only);
    assert!(
        by_inputs > 0.0 && by_inputs < 0.1,
        "rounded inputs moved the logits by {by_inputs}"
    );
}

fn quest(budget: usize, dense: Vec<usize>) -> SparseConfig {
    SparseConfig {
        dense_layers: dense,
        min_prompt_tokens: Some(1),
        ..SparseConfig::quest(budget)
    }
}

/// Quest with pages of `page_size` tokens, one selection per KV head or shared.
fn quest_pages(budget: usize, page_size: usize, shared_heads: bool) -> SparseConfig {
    SparseConfig {
        algo: AlgoConfig::Quest(QuestConfig {
            page_size,
            budget_tokens: budget,
            shared_heads,
            ..QuestConfig::default()
        }),
        ..quest(budget, Vec::new())
    }
}

/// A budget that covers the context equals dense bit for bit, whatever the page size against
/// the engine's blocks of 16 (a finer page only changes the physical layout, and attention
/// follows logical positions); decode runs on Q4_1 weights, whose 8-bit activation rounding
/// would turn any last-bit difference into a visible one.
#[test]
fn sparse_with_a_full_budget_equals_dense_and_a_small_one_differs() {
    let m = Model::load(&tiny(DType::Q4_1)).expect("a valid model");
    let tokens = text(300);
    let full = [
        ("full".to_owned(), quest(304, Vec::new())),
        ("full-p8-head".to_owned(), quest_pages(304, 8, false)),
        ("full-p4".to_owned(), quest_pages(304, 4, true)),
    ];
    let mut variants = full.to_vec();
    variants.push(("small".to_owned(), quest(64, vec![0])));
    let opts = EvalOptions {
        prefill: 200,
        chunk: 64,
        block_size: 16,
        recall: true,
    };
    let r = teacher_forced::<f32>(&m, &tokens, &variants, &opts, |_, _| {}).expect("a valid run");
    assert_eq!(r.len(), 5);
    assert_eq!((r[0].name.as_str(), r[0].sparse), ("dense", false));
    assert_eq!(r[0].positions, 99);
    for (run, (name, _)) in r[1..4].iter().zip(&full) {
        assert_eq!(&run.name, name);
        assert!(run.sparse);
        assert_eq!(
            run.max_logit_diff, 0.0,
            "{name}: a full budget is dense, bit for bit"
        );
        assert_eq!(run.top1_agreement, 1.0);
        assert!(run.recall.is_some_and(|x| (x - 1.0).abs() < 1e-9));
    }
    let small = &r[4];
    assert!(small.sparse);
    let recall = small.recall.expect("measured");
    assert!(
        recall > 0.0 && recall < 1.0,
        "a small budget loses some mass: {recall}"
    );
    assert!(small.max_logit_diff > 0.0);
    assert!(small.stats.steps > 0 && small.device_bytes < r[0].device_bytes);
}

#[test]
fn sampling_is_reproducible_and_checked() {
    let logits: Vec<f32> = (0..50).map(|i| ((i * 13 % 17) as f32) / 4.0).collect();
    let greedy = Sampler::new(&Sampling::default())
        .expect("valid")
        .sample(&logits);
    assert_eq!(greedy, engine::eval::argmax(&logits));
    let warm = Sampling {
        temperature: 0.8,
        top_p: 0.9,
        seed: 5,
        ..Sampling::default()
    };
    let draw = |s: &Sampling| {
        let mut x = Sampler::new(s).expect("valid");
        (0..40).map(|_| x.sample(&logits)).collect::<Vec<_>>()
    };
    assert_eq!(draw(&warm), draw(&warm));
    assert!(
        draw(&warm).iter().any(|&t| t != greedy),
        "temperature spreads the draws"
    );
    let narrow = Sampling {
        top_p: 1e-6,
        ..warm
    };
    assert!(
        draw(&narrow).iter().all(|&t| t == greedy),
        "a tiny top-p keeps the best token"
    );
    for (bad, want) in [
        (
            Sampling {
                temperature: -1.0,
                ..Sampling::default()
            },
            "temperature -1",
        ),
        (
            Sampling {
                temperature: f32::NAN,
                ..Sampling::default()
            },
            "temperature NaN",
        ),
        (
            Sampling {
                top_p: 0.0,
                ..Sampling::default()
            },
            "top_p 0",
        ),
        (
            Sampling {
                top_p: 1.5,
                ..Sampling::default()
            },
            "top_p 1.5",
        ),
        (
            Sampling {
                max_tokens: 0,
                ..Sampling::default()
            },
            "max_tokens 0",
        ),
        (
            Sampling {
                stop: vec![String::new()],
                ..Sampling::default()
            },
            "empty stop",
        ),
    ] {
        let e = Sampler::new(&bad).expect_err(want);
        assert!(
            matches!(e, EngineError::Request(RequestError::Sampling(_))),
            "{want}: {e}"
        );
    }
}

#[test]
fn bad_requests_get_typed_errors() {
    let g = tiny(DType::F16);
    let m = Model::load(&g).expect("a valid model");
    let tok = Tokenizer::from_gguf(&g).expect("a byte-level tokenizer");
    let ids = tok.encode("héllo, wörld").expect("any text encodes");
    assert_eq!(tok.decode(&ids).expect("valid ids"), "héllo, wörld");
    let s = Sampling {
        max_tokens: 4,
        ..Sampling::default()
    };
    let run = |prompt: &[u32], s: &Sampling| {
        engine::generate::<f32>(&m, &tok, prompt, s, None, |_| {}, |_, _| {})
    };
    let (out, stats) = run(&ids, &s).expect("a valid request");
    assert_eq!(
        (out.len(), stats.generated, stats.prompt_tokens),
        (4, 4, ids.len())
    );
    let too_long = |prompt, max_tokens| RequestError::TooLong {
        prompt,
        max_tokens,
        limit: 1024,
    };
    let bad_top_p = RequestError::Sampling("top_p 2 (must be in (0, 1])".into());
    for (prompt, s, want) in [
        (vec![], s.clone(), RequestError::EmptyPrompt),
        (vec![1; 1100], s.clone(), too_long(1100, 4)),
        (
            vec![1; 1000],
            Sampling {
                max_tokens: 100,
                ..s.clone()
            },
            too_long(1000, 100),
        ),
        (
            vec![300],
            s.clone(),
            RequestError::OutOfVocab {
                token: 300,
                vocab: 300,
            },
        ),
        (ids, Sampling { top_p: 2.0, ..s }, bad_top_p),
    ] {
        match run(&prompt, &s) {
            Err(EngineError::Request(e)) => assert_eq!(e, want),
            other => panic!("{want}: got {other:?}"),
        }
    }
    assert!(matches!(
        tok.decode(&[5000]),
        Err(EngineError::Tokenizer(_))
    ));
    // An evaluation whose prefill leaves no position to score (position p predicts p + 1).
    let tokens = text(40);
    for prefill in [39, 40, 41] {
        let opts = EvalOptions {
            prefill,
            chunk: 16,
            block_size: 16,
            recall: false,
        };
        let got = teacher_forced::<f32>(&m, &tokens, &[], &opts, |_, _| {});
        assert!(
            matches!(got, Err(EngineError::Invalid(_))),
            "prefill {prefill} of 40: {got:?}"
        );
    }
}

#[test]
fn passkey_prompts_fit_their_context_and_hide_the_key_deeper_each_trial() {
    let g = tiny(DType::F16);
    let tok = Tokenizer::from_gguf(&g).expect("a byte-level tokenizer");
    let (context, trials) = (1000, 4);
    let mut depths = Vec::new();
    for t in 0..trials {
        let (prompt, key) =
            engine::eval::passkey_prompt(&tok, context, t, trials).expect("room for a key");
        assert!(
            prompt.len() + engine::eval::PASSKEY_ANSWER <= context,
            "trial {t}: {} prompt tokens",
            prompt.len()
        );
        let text = tok.decode(&prompt).expect("valid ids");
        let at = text.find(&key).expect("the key is in the prompt");
        assert!(
            text.ends_with("The pass key is"),
            "trial {t} ends on the question"
        );
        depths.push(at);
    }
    assert!(
        depths.windows(2).all(|w| w[0] < w[1]),
        "deeper each trial: {depths:?}"
    );
    assert!(
        matches!(
            engine::eval::passkey_prompt(&tok, 50, 0, 1),
            Err(EngineError::Invalid(_))
        ),
        "a context too small for the key is a typed error"
    );
}

#[test]
fn a_layers_input_gives_its_queries_exactly() {
    /// Dense attention that also keeps each layer's input and queries.
    struct Probe<'a> {
        dense: DenseAttention<'a, f32>,
        inputs: Vec<Vec<f32>>,
        queries: Vec<Vec<f32>>,
    }
    impl engine::Attention for Probe<'_> {
        fn attend(
            &mut self,
            layer: usize,
            q: &[f32],
            k: &[f32],
            v: &[f32],
            out: &mut [f32],
        ) -> Result<(), EngineError> {
            self.queries.push(q.to_vec());
            self.dense.attend(layer, q, k, v, out)
        }

        fn layer_input(&mut self, layer: usize, x: &[f32]) -> Result<(), EngineError> {
            assert_eq!(layer, self.inputs.len(), "layers in order");
            self.inputs.push(x.to_vec());
            Ok(())
        }
    }
    let g = tiny(DType::F32);
    let exact = Model::load(&g).expect("a valid model");
    let ids = text(40);
    let positions: Vec<usize> = (0..40).collect();
    let blocks = 40usize.div_ceil(16);
    let bf16 = |v: f32| half::bf16::from_f32(v).to_f32();
    // A model computing in bf16 hands the attention bf16 queries, keys and values, and its
    // estimate rounds the queries the same way.
    let rounded = exact.computing_in(DType::BF16).expect("a float type");
    for (m, in_bf16) in [(&exact, false), (&rounded, true)] {
        let mut store = KvStore::<f32>::new(&TINY, blocks, 16).expect("a cache");
        let batch = Batch::single(0, 40, blocks);
        let mut probe = Probe {
            dense: DenseAttention {
                store: &mut store,
                batch: &batch,
            },
            inputs: Vec::new(),
            queries: Vec::new(),
        };
        m.forward(&ids, &positions, &mut probe, &[])
            .expect("a valid forward");
        assert_eq!(probe.inputs.len(), TINY.layers);
        for (l, (x, q)) in probe.inputs.iter().zip(&probe.queries).enumerate() {
            let got = m.query(l, x, &positions).expect("a valid layer and stream");
            assert_eq!(&got, q, "layer {l}");
            let representable = q.iter().all(|&v| bf16(v) == v);
            assert_eq!(representable, in_bf16, "layer {l}'s queries in bf16");
        }
    }
    let x = vec![0.5f32; 40 * TINY.embed];
    assert!(matches!(
        exact.query(TINY.layers, &x, &positions),
        Err(EngineError::Invalid(_))
    ));
    assert!(matches!(
        exact.query(0, &x[1..], &positions),
        Err(EngineError::Invalid(_))
    ));
}

/// A prefetch loads pages before the step that selects them: the logits stay the same bit
/// for bit, and fewer loads are left to the steps.
#[test]
fn a_prefetch_moves_loads_ahead_and_changes_no_logit() {
    let m = Model::load(&tiny(DType::Q4_1)).expect("a valid model");
    let tokens = text(300);
    let small = quest_pages(64, 4, true);
    let variants = [
        ("small".to_owned(), small.clone()),
        (
            "small-prefetch".to_owned(),
            SparseConfig {
                prefetch: true,
                ..small
            },
        ),
    ];
    let opts = EvalOptions {
        prefill: 200,
        chunk: 64,
        block_size: 16,
        recall: false,
    };
    let r = teacher_forced::<f32>(&m, &tokens, &variants, &opts, |_, _| {}).expect("a valid run");
    let (plain, early) = (&r[1], &r[2]);
    assert!(plain.sparse && early.sparse);
    assert_eq!(plain.nll, early.nll, "the same logits");
    assert_eq!(plain.max_logit_diff, early.max_logit_diff);
    assert_eq!(plain.top1_agreement, early.top1_agreement);
    assert_eq!(plain.prefetched.loaded_pages, 0);
    assert!(early.prefetched.loaded_pages > 0, "{:?}", early.prefetched);
    assert!(
        early.stats.misses < plain.stats.misses,
        "fewer loads in the steps: {} against {}",
        early.stats.misses,
        plain.stats.misses
    );
}
