//! llama.cpp's rounding (`engine::ggml`): its attention against an f64 reference in both of
//! llama.cpp's paths (batches of one token and of many), and a model rounding like llama.cpp
//! within rounding of the engine's own forward. That its logits equal llama.cpp's bit for bit
//! is measured by the peer (`bench/peers/llamacpp_peer.py top1`), which needs llama.cpp.

use engine::ggml::GgmlAttention;
use engine::gguf::DType;
use engine::{Attention, Model};

use crate::model::{TINY, logits, text, tiny, worst_relative};

/// `n` values in [-2, 2) from a fixed seed, none zero.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0;
            if v == 0.0 { 0.5 } else { v }
        })
        .collect()
}

/// Causal attention of `q` over `k` and `v` (keys and values rounded to f16, as the cache
/// holds them) in f64.
fn reference(q: &[f32], k: &[f32], v: &[f32], n: usize) -> Vec<f64> {
    let (qh, kvh, d) = (TINY.q_heads, TINY.kv_heads, TINY.head_dim);
    let r = |x: f32| f64::from(half::f16::from_f32(x).to_f32());
    let mut out = vec![0.0f64; n * qh * d];
    for i in 0..n {
        for h in 0..qh {
            let g = h / (qh / kvh);
            let qi = &q[(i * qh + h) * d..][..d];
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    let kj = &k[(j * kvh + g) * d..][..d];
                    qi.iter()
                        .zip(kj)
                        .map(|(&a, &b)| f64::from(a) * r(b))
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for c in 0..d {
                out[(i * qh + h) * d + c] = (0..=i)
                    .map(|j| e[j] / z * r(v[(j * kvh + g) * d + c]))
                    .sum();
            }
        }
    }
    out
}

#[test]
fn llama_cpp_attention_matches_an_f64_reference_in_both_paths() {
    let (qh, kvh, d) = (TINY.q_heads, TINY.kv_heads, TINY.head_dim);
    let n = 40;
    let q = values(n * qh * d, 1);
    let k = values(n * kvh * d, 2);
    let v = values(n * kvh * d, 3);
    let want = reference(&q, &k, &v, n);
    let mut runs = Vec::new();
    // Chunks of 1 take ggml_vec_dot_f16's order, larger ones tinyBLAS's; 40 tokens cross a
    // padded row of 32.
    for chunk in [1, 7, 40] {
        let mut attn = GgmlAttention::new(&TINY);
        let mut out = vec![0.0f32; q.len()];
        for s in (0..n).step_by(chunk) {
            let e = (s + chunk).min(n);
            attn.attend(
                1,
                &q[s * qh * d..e * qh * d],
                &k[s * kvh * d..e * kvh * d],
                &v[s * kvh * d..e * kvh * d],
                &mut out[s * qh * d..e * qh * d],
            )
            .expect("shapes of the model");
        }
        assert_eq!((attn.len(1), attn.len(0)), (n, 0));
        let worst = out
            .iter()
            .zip(&want)
            .map(|(&a, &b)| (f64::from(a) - b).abs())
            .fold(0.0f64, f64::max);
        // Queries and probabilities rounded to f16 (2^-11 relative), values up to 2.
        assert!(worst < 1.5e-3, "chunks of {chunk}: {worst}");
        runs.push(out);
    }
    assert_ne!(runs[0], runs[2], "the two paths add in different orders");
    let mut attn = GgmlAttention::new(&TINY);
    let mut out = vec![0.0f32; 3];
    let bad = attn.attend(0, &q[..3], &k[..3], &v[..3], &mut out);
    assert!(bad.is_err(), "a partial row is refused");
}

/// Logits of every position of `tokens`, in chunks of `chunk`, through [`GgmlAttention`].
fn ggml_logits(m: &Model, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut attn = GgmlAttention::new(&m.config);
    let mut all = Vec::new();
    for (i, c) in tokens.chunks(chunk).enumerate() {
        let positions: Vec<usize> = (i * chunk..i * chunk + c.len()).collect();
        let rows: Vec<usize> = (0..c.len()).collect();
        all.extend(
            m.forward(c, &positions, &mut attn, &rows)
                .expect("a valid batch"),
        );
    }
    all
}

#[test]
fn a_model_rounding_like_llama_cpp_stays_within_rounding_of_the_engine() {
    for dtype in [DType::Q4_1, DType::Q8_0] {
        let m = Model::load(&tiny(dtype)).expect("a valid model");
        let tokens = text(50);
        let ours = logits(&m, &tokens, 50);
        let like = m.clone().like_llama_cpp();
        for chunk in [50, 1] {
            let theirs = ggml_logits(&like, &tokens, chunk);
            let worst = worst_relative(&ours, &theirs);
            // 8-bit inputs in prefill, f16 probabilities: the tolerance of the decode path.
            assert!(worst < 5e-2, "{dtype:?}, chunks of {chunk}: {worst}");
            assert_ne!(ours, theirs, "{dtype:?}: the rounding differs somewhere");
        }
    }
}
