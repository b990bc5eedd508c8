//! How far the real model's logits move with the precision of its forward, and how far two
//! forwards of the same precision lie apart when only the order of their f32 sums differs: the
//! noise floor any GPU forward of that precision is compared against (issue 9).
//!
//! `cargo run --release -p engine --example precision [MODEL] [TEXT]` runs the CPU forward over
//! the text's first [`TOKENS`] tokens at once, every row's logits, in these precisions:
//! - exact: f32 activations against exactly dequantized weights, an f32 KV cache;
//! - weights of T: the weights rounded once to T ([`Model::with_float_weights`]) and a KV cache
//!   of T;
//! - computing in T: also every input of a projection and of the attention rounded to T
//!   ([`Model::computing_in`]), as the GPU forward in T rounds them.
//!
//! Each runs twice: with the attention's widest CPU build, and with its portable build, whose
//! f32 sums run in another order. Per row the largest absolute logit difference over the
//! largest absolute logit; the table shows the worst row and the median row.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

#[path = "shared/real.rs"]
mod real;

use attn_op::{Element, Simd};
use engine::gguf::DType;
use engine::{Batch, DenseAttention, EngineError, KvStore, Model};
use half::{bf16, f16};

/// Tokens of the text run at once (the GPU check's prefill and decode rows).
const TOKENS: usize = 320;

fn main() {
    real::main_with("precision", run);
}

fn run(model_path: &str, text_path: &str) -> Result<(), EngineError> {
    let (model, ids) = real::load(model_path, text_path, TOKENS)?;
    let vocab = model.config.vocab;
    let exact = logits::<f32>(&model, &ids, Simd::Auto)?;
    println!(
        "{TOKENS} tokens of {text_path}; max rel of the worst row / the median row\n\n\
         | forward | against exact | widest against portable attention build |\n\
         | --- | --- | --- |"
    );
    let line = |what: &str, auto: &[f32], portable: &[f32]| {
        println!(
            "| {what} | {} | {} |",
            apart(auto, &exact, vocab),
            apart(auto, portable, vocab)
        );
    };
    line(
        "exact",
        &exact,
        &logits::<f32>(&model, &ids, Simd::Portable)?,
    );
    for dtype in [DType::F16, DType::BF16] {
        for (what, m) in [
            ("weights", model.with_float_weights(dtype)?),
            ("computing", model.computing_in(dtype)?),
        ] {
            let run = |simd| match dtype {
                DType::F16 => logits::<f16>(&m, &ids, simd),
                _ => logits::<bf16>(&m, &ids, simd),
            };
            line(
                &format!("{what} in {dtype:?}"),
                &run(Simd::Auto)?,
                &run(Simd::Portable)?,
            );
        }
    }
    Ok(())
}

/// Every row's logits of `ids` run at once through `m`, with a KV cache of `T` and the
/// attention's CPU build `simd`.
fn logits<T: Element>(m: &Model, ids: &[u32], simd: Simd) -> Result<Vec<f32>, EngineError> {
    let n = ids.len();
    let blocks = (n + 1).div_ceil(16);
    let mut store = KvStore::<T>::new(&m.config, blocks, 16)?;
    store.set_simd(simd);
    let rows: Vec<usize> = (0..n).collect();
    let batch = Batch::single(0, n, blocks);
    m.forward(
        ids,
        &rows,
        &mut DenseAttention {
            store: &mut store,
            batch: &batch,
        },
        &rows,
    )
}

/// The worst and the median row's largest absolute difference over its largest absolute
/// logit, `got` against `want`.
fn apart(got: &[f32], want: &[f32], vocab: usize) -> String {
    let mut rows: Vec<f64> = got
        .chunks_exact(vocab)
        .zip(want.chunks_exact(vocab))
        .map(|(g, w)| {
            let diff = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let top = w.iter().map(|b| b.abs()).fold(0.0, f32::max);
            f64::from(diff) / f64::from(top).max(1e-30)
        })
        .collect();
    rows.sort_by(f64::total_cmp);
    let (worst, median) = (rows.last().copied().unwrap_or(0.0), rows[rows.len() / 2]);
    format!("{worst:.2e} / {median:.2e}")
}
