//! `gpu_engine fidelity MODEL TEXT [--json FILE]`: the CPU engine's fidelity figures on the
//! GPU. The real model prefills [`PREFILL`] tokens of the text and teacher-forces the next
//! [`DECODE`] (the engine issue's fidelity run), dense and with hierarchical sparse attention
//! in the engine issue's two Quest variants (a 1024-token budget, layers 0 and 1 dense; pages
//! of 16 shared by the KV heads, and pages of 4 selected per KV head with the first 16 and
//! last 256 tokens kept), on the CPU (`engine::eval::teacher_forced`, f16 KV) and on the GPU
//! (f16 weights and KV, `engine::gpu_request::GpuRequest`). Each side's sparse runs are
//! compared with its own dense run: perplexity ratio and top-1 agreement. The GPU's sparse
//! runs are repeated with prefetch (each layer's start loads the next layer's estimated
//! selection on a copy stream): their logits must be the same bits, and the miss rate left in
//! the steps, the pages loaded early and the time per token are reported.

use std::time::Instant;

use attn_op::cuda::Gpu;
use coordinator::SparseConfig;
use engine::eval::{EvalOptions, argmax, default_variants, nll, teacher_forced};
use engine::gpu::GpuModel;
use engine::gpu_request::GpuRequest;
use engine::{EngineError, Model};
use half::f16;

use crate::{BLOCK, Inputs, Res, inputs, report};

/// Tokens prefilled, then positions teacher-forced.
const PREFILL: usize = 6144;
const DECODE: usize = 511;
/// How much worse than the CPU's the GPU's sparse-over-dense figures may be: perplexity ratio
/// (relative, above) and top-1 agreement (absolute, below). Figures better than the CPU's lose
/// no fidelity and pass. The two sides differ in their dense runs already (the CPU decodes
/// with 8-bit activation rows, the GPU in f16: 11.145 against 11.072 on GPL-3), and a sparse
/// variant's selections amplify that: at this length the head-shared page-16 variant measured
/// 1.5 % apart (session 25), so the bound is 2 % (it was 1 % at 3584 + 256 tokens).
const PPL_DRIFT: f64 = 0.02;
const TOP1_DRIFT: f64 = 0.03;
/// The engine issue's goal, perplexity at most this times dense's: a variant that meets it on
/// the CPU must meet it on the GPU.
const PPL_GOAL: f64 = 1.02;

/// One side's figures for one variant: the dense and sparse runs' perplexities and their
/// top-1 agreement.
struct Figures {
    ppl_dense: f64,
    ppl_sparse: f64,
    top1: f64,
}

impl Figures {
    fn ratio(&self) -> f64 {
        self.ppl_sparse / self.ppl_dense
    }

    fn json(&self) -> String {
        format!(
            "{{\"ppl_dense\":{},\"ppl_sparse\":{},\"ppl_ratio\":{},\"top1\":{}}}",
            self.ppl_dense,
            self.ppl_sparse,
            self.ratio(),
            self.top1
        )
    }
}

pub(crate) fn fidelity(args: &[String]) -> Res<i32> {
    let s = |e: EngineError| e.to_string();
    let gpu = engine::gpu::open_gpu(0).map_err(|e| e.to_string())?;
    let device = gpu.name().map_err(|e| e.to_string())?;
    let Inputs {
        model,
        ids,
        model_path,
        text_path,
    } = inputs("fidelity", args, PREFILL + DECODE + 1)?;
    let ids = &ids[..];
    // The engine's Quest variants (the last, a budget over the whole context, is checked
    // equal to dense elsewhere).
    let mut variants = default_variants(ids.len());
    variants.truncate(2);
    let t0 = Instant::now();
    let opts = EvalOptions {
        prefill: PREFILL,
        chunk: 512,
        block_size: BLOCK,
        recall: false,
    };
    let reports = teacher_forced::<f16>(&model, ids, &variants, &opts, |_, _| {}).map_err(s)?;
    let cpu_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let gpu_runs = gpu_figures(&model, ids, gpu, &variants)?;
    let gpu_s = t0.elapsed().as_secs_f64();
    let mut out = format!(
        "gpu_engine fidelity on {device}: {model_path}, {PREFILL} prefill + {DECODE} \
         teacher-forced tokens of {text_path}; each side's sparse variants against its own \
         dense (cpu f16 KV {cpu_s:.1} s, gpu f16 {gpu_s:.1} s)\n"
    );
    let mut ok = true;
    let mut json = Vec::new();
    for (i, ((name, _), v)) in variants.iter().zip(gpu_runs).enumerate() {
        let gpu_fig = v.figures;
        let cpu = Figures {
            ppl_dense: reports[0].perplexity(),
            ppl_sparse: reports[i + 1].perplexity(),
            top1: reports[i + 1].top1_agreement,
        };
        let pass = gpu_fig.ratio() / cpu.ratio() - 1.0 <= PPL_DRIFT
            && cpu.top1 - gpu_fig.top1 <= TOP1_DRIFT
            && (cpu.ratio() > PPL_GOAL || gpu_fig.ratio() <= PPL_GOAL);
        ok &= pass;
        out += &format!("  {name}{}:\n", if pass { "" } else { " FAILED" });
        for (side, f) in [("cpu", &cpu), ("gpu", &gpu_fig)] {
            out += &format!(
                "    {side}: perplexity dense {:.4}, sparse {:.4} ({:.4}x), top-1 agreement {:.4}\n",
                f.ppl_dense,
                f.ppl_sparse,
                f.ratio(),
                f.top1
            );
        }
        // Prefetch changes where pages are loaded, never what attention reads: the logits
        // must be the same bits.
        let same =
            v.prefetch.nll.to_bits() == v.plain.nll.to_bits() && v.prefetch.top == v.plain.top;
        ok &= same;
        let (plain, pf) = (&v.plain, &v.prefetch);
        out += &format!(
            "    gpu sparse decode: hot-buffer miss rate {:.3}, {:.2} ms a token\n    with \
             prefetch: {}, miss rate left in the steps {:.3}, {:.1} pages a token loaded \
             early, {:.2} ms a token\n",
            plain.misses,
            plain.ms,
            if same {
                "the same logits"
            } else {
                "OTHER LOGITS (FAILED)"
            },
            pf.misses,
            pf.early,
            pf.ms
        );
        json.push(format!(
            "{{\"name\":{name:?},\"cpu\":{},\"gpu\":{},\"gpu_miss_rate\":{},\"gpu_ms\":{},\"prefetch\":{{\"same_logits\":{same},\"miss_rate\":{},\"early_pages\":{},\"ms\":{}}}}}",
            cpu.json(),
            gpu_fig.json(),
            plain.misses,
            plain.ms,
            pf.misses,
            pf.early,
            pf.ms
        ));
    }
    out += &format!(
        "gpu_engine fidelity: {} (per variant, the GPU's perplexity ratio at most {:.0} % above \
         the CPU's and within {PPL_GOAL}x dense where the CPU's is, its top-1 agreement at most \
         {TOP1_DRIFT} below, and the same logits with prefetch)\n",
        if ok { "0 failed" } else { "FAILED" },
        PPL_DRIFT * 100.0
    );
    print!("{out}");
    if let Some(path) = report::json_arg(args) {
        let json = format!(
            "{{\"device\":{device:?},\"prefill\":{PREFILL},\"decode\":{DECODE},\"variants\":[{}]}}\n",
            json.join(",")
        );
        std::fs::write(path, json).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(if ok { 0 } else { 1 })
}

/// One GPU run's figures: the mean negative log-likelihood of the text's next tokens, the
/// arg-maxes, the hot-buffer miss rate of the decode steps, the pages prefetches loaded per
/// decoded token, and the decode's milliseconds per token.
struct GpuRun {
    nll: f64,
    top: Vec<u32>,
    misses: f64,
    early: f64,
    ms: f64,
}

/// What the GPU measured for one variant: its figures against dense, and its sparse runs
/// without and with prefetch.
struct GpuVariant {
    figures: Figures,
    plain: GpuRun,
    prefetch: GpuRun,
}

/// The GPU's dense run over `ids`, then each variant's sparse run, without and with
/// prefetch.
fn gpu_figures(
    model: &Model,
    ids: &[u32],
    gpu: Gpu,
    variants: &[(String, SparseConfig)],
) -> Res<Vec<GpuVariant>> {
    let gm = GpuModel::<f16>::upload(model, gpu).map_err(|e| e.to_string())?;
    let n = ids.len();
    let run = |sparse: Option<&SparseConfig>| -> Result<GpuRun, EngineError> {
        let mut r = GpuRequest::new(&gm, n, PREFILL, sparse)?;
        r.forward(&ids[..PREFILL])?;
        let (mut sum, mut top) = (0.0, Vec::with_capacity(DECODE));
        let t0 = Instant::now();
        for p in PREFILL..n - 1 {
            let logits = r.forward(&ids[p..=p])?;
            sum += nll(&logits, ids[p + 1] as usize);
            top.push(argmax(&logits));
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3 / top.len() as f64;
        let st = r.stats();
        Ok(GpuRun {
            nll: sum / top.len() as f64,
            misses: st.misses as f64 / (st.hits + st.misses).max(1) as f64,
            early: r.prefetched().loaded_pages as f64 / top.len() as f64,
            top,
            ms,
        })
    };
    let s = |e: EngineError| e.to_string();
    let dense = run(None).map_err(s)?;
    variants
        .iter()
        .map(|(_, config)| {
            let plain = run(Some(config)).map_err(s)?;
            let with = SparseConfig {
                prefetch: true,
                ..config.clone()
            };
            let prefetch = run(Some(&with)).map_err(s)?;
            let agree = plain
                .top
                .iter()
                .zip(&dense.top)
                .filter(|(a, b)| a == b)
                .count();
            Ok(GpuVariant {
                figures: Figures {
                    ppl_dense: dense.nll.exp(),
                    ppl_sparse: plain.nll.exp(),
                    top1: agree as f64 / plain.top.len() as f64,
                },
                plain,
                prefetch,
            })
        })
        .collect()
}
