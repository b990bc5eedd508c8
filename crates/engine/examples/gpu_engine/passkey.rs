//! `gpu_engine passkey MODEL [--json FILE]`: the engine issue's passkey retrieval on the
//! GPU. For each context of [`CONTEXTS`], [`TRIALS`] prompts (`engine::eval::passkey_prompt`:
//! a five-digit key at evenly spread depths in filler text) are answered greedily
//! ([`PASSKEY_ANSWER`] tokens) by the real model on the GPU (f16 weights and KV,
//! `engine::gpu_request::generate_gpu`), dense and in the engine's two Quest variants (`engine::eval::default_variants`). A
//! trial is right where the answer contains the key. The check fails (exit 1) where the
//! per-head variant (the one that meets the engine issue's fidelity goals) answers fewer keys
//! than dense at a context.

use std::path::Path;
use std::time::Instant;

use coordinator::SparseConfig;
use engine::eval::{PASSKEY_ANSWER, default_variants, passkey_prompt};
use engine::gguf::Gguf;
use engine::gpu::GpuModel;
use engine::gpu_request::generate_gpu;
use engine::{Model, Sampling, Tokenizer};
use half::f16;

use crate::{Res, report};

/// Prompt lengths, in tokens (the model's context is 8192).
const CONTEXTS: [usize; 2] = [4096, 8000];
/// Prompts per context.
const TRIALS: usize = 10;
/// The variant whose keys must match dense's.
const CHECKED: &str = "quest-1024-p4-head-sr+2dense";

pub(crate) fn passkey(args: &[String]) -> Res<i32> {
    let model_path = args
        .first()
        .ok_or("usage: gpu_engine passkey MODEL [--json FILE]")?;
    let s = |e: engine::EngineError| e.to_string();
    let gpu = engine::gpu::open_gpu(0).map_err(|e| e.to_string())?;
    let device = gpu.name().map_err(|e| e.to_string())?;
    let file = Gguf::open(Path::new(model_path)).map_err(s)?;
    let model = Model::load(&file).map_err(s)?;
    let tok = Tokenizer::from_gguf(&file).map_err(s)?;
    let gm = GpuModel::<f16>::upload(&model, gpu).map_err(s)?;
    let mut variants: Vec<(String, Option<SparseConfig>)> = vec![("dense".to_owned(), None)];
    variants.extend(
        default_variants(CONTEXTS[1])
            .into_iter()
            .take(2)
            .map(|(name, c)| (name, Some(c))),
    );
    let t0 = Instant::now();
    let mut out = format!(
        "gpu_engine passkey on {device}: {model_path}, {TRIALS} depths per context, greedy \
         {PASSKEY_ANSWER} tokens, f16\n"
    );
    let (mut ok, mut json) = (true, Vec::new());
    for context in CONTEXTS {
        let mut right = vec![0usize; variants.len()];
        for t in 0..TRIALS {
            let (prompt, key) = passkey_prompt(&tok, context, t, TRIALS).map_err(s)?;
            for ((_, config), right) in variants.iter().zip(right.iter_mut()) {
                let answer = answer(&gm, &tok, &prompt, config.as_ref())?;
                if tok.decode(&answer).map_err(s)?.contains(&key) {
                    *right += 1;
                }
            }
        }
        for ((name, _), &r) in variants.iter().zip(&right) {
            let fail = name == CHECKED && r < right[0];
            ok &= !fail;
            out += &format!(
                "  passkey {context}: {name:<30} {r}/{TRIALS}{}\n",
                if fail {
                    "  FAILED (fewer than dense)"
                } else {
                    ""
                }
            );
            json.push(format!(
                "{{\"context\":{context},\"variant\":{name:?},\"trials\":{TRIALS},\"correct\":{r}}}"
            ));
        }
    }
    out += &format!(
        "gpu_engine passkey: {} ({CHECKED} answers as many keys as dense at each context; {:.1} s)\n",
        if ok { "0 failed" } else { "FAILED" },
        t0.elapsed().as_secs_f64()
    );
    print!("{out}");
    if let Some(path) = report::json_arg(args) {
        let json = format!("{{\"device\":{device:?},\"runs\":[{}]}}\n", json.join(","));
        std::fs::write(path, json).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(if ok { 0 } else { 1 })
}

/// The greedy answer to `prompt` (`engine::gpu_request::generate_gpu`): dense without
/// `sparse`, else with it.
fn answer(
    gm: &GpuModel<f16>,
    tok: &Tokenizer,
    prompt: &[u32],
    sparse: Option<&SparseConfig>,
) -> Res<Vec<u32>> {
    let greedy = Sampling {
        max_tokens: PASSKEY_ANSWER,
        temperature: 0.0,
        stop_at_eos: false,
        ..Sampling::default()
    };
    generate_gpu(gm, tok, prompt, &greedy, sparse, |_| {}, |_, _| {})
        .map(|(answer, _)| answer)
        .map_err(|e| e.to_string())
}
