//! The engine's Llama forward on the GPU against the CPU's, for the device bundle
//! (`cargo xtask gpu`).
//!
//! `gpu_engine check MODEL TEXT [--json FILE]`: loads the GGUF model `MODEL` for both paths
//! (the GPU's weights dequantized to bf16) and tokenizes `TEXT`. The reference is the CPU
//! forward over its first 320 tokens at once, every row's logits (f32 activations against
//! exactly dequantized weights). The GPU prefills the first 256 tokens (every row's logits) and
//! decodes the next 64 teacher-forced; the CPU decodes the same 64 as the engine does (8-bit
//! activation rows against quantized weights). Each is compared with the reference: per row the
//! largest absolute logit difference over the largest absolute logit (max rel) and the L2 norms'
//! ratio (L2 rel), the worst row reported, with top-1 agreement and perplexity over the decoded
//! positions. The check fails (exit 1) where the GPU's max rel exceeds 1e-2 or a logit is not
//! finite. It also reports the weights' device bytes and the GPU's decode step time.
//!
//! Without a CUDA driver or device it prints "skipped: no CUDA device" and exits 0.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

#[path = "../../../attn-op/examples/gpu/report.rs"]
mod report;
#[path = "../../../attn-op/examples/gpu/rng.rs"]
mod rng;

use std::path::Path;
use std::time::Instant;

use attn_op::cuda::Gpu;
use engine::eval::{argmax, nll};
use engine::gguf::Gguf;
use engine::gpu::{GpuDenseAttention, GpuModel};
use engine::{Batch, DenseAttention, KvStore, Model, Tokenizer};

/// Errors of this tool, as text.
type Res<T> = Result<T, String>;

/// Prompt tokens prefilled, then tokens decoded one at a time.
const PREFILL: usize = 256;
const DECODE: usize = 64;
/// The largest relative logit difference the check accepts (bf16 weights against the CPU's).
const TOLERANCE: f64 = 1e-2;
/// The engine's block size.
const BLOCK: usize = 16;

fn main() {
    report::tool_main("gpu_engine", &[], run);
}

fn run(cmd: &str, args: &[String]) -> Res<i32> {
    match cmd {
        "check" => check(args),
        other => Err(format!("unknown command {other:?} (check)")),
    }
}

/// Sums of a comparison of logit rows against the reference: the worst row's largest
/// absolute difference over its largest absolute logit (`max_rel`), the worst row's L2 norm of
/// the difference over its L2 norm (`l2_rel`), and the rows agreeing on the arg-max.
#[derive(Default)]
struct Tally {
    max_rel: f64,
    l2_rel: f64,
    agree: usize,
    rows: usize,
}

impl Tally {
    fn add(&mut self, got: &[f32], want: &[f32], vocab: usize) {
        for (g, w) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)) {
            let (mut top, mut worst, mut dd, mut ww) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
            for (&a, &b) in g.iter().zip(w) {
                let (a, b) = (f64::from(a), f64::from(b));
                let d = if a.is_finite() {
                    (a - b).abs()
                } else {
                    f64::INFINITY
                };
                top = top.max(b.abs());
                worst = worst.max(d);
                dd += d * d;
                ww += b * b;
            }
            self.max_rel = self.max_rel.max(worst / top.max(1e-30));
            self.l2_rel = self.l2_rel.max(dd.sqrt() / ww.sqrt().max(1e-30));
            self.agree += usize::from(argmax(g) == argmax(w));
            self.rows += 1;
        }
    }

    fn line(&self, what: &str) -> String {
        format!(
            "  {what:<34} max rel {:.2e}  L2 rel {:.2e}  top-1 {:.4} ({} rows)\n",
            self.max_rel,
            self.l2_rel,
            self.agree as f64 / self.rows.max(1) as f64,
            self.rows
        )
    }

    fn json(&self) -> String {
        format!(
            "{{\"max_rel\":{},\"l2_rel\":{},\"top1\":{},\"rows\":{}}}",
            self.max_rel,
            self.l2_rel,
            self.agree as f64 / self.rows.max(1) as f64,
            self.rows
        )
    }
}

fn check(args: &[String]) -> Res<i32> {
    let gpu = Gpu::new(0).map_err(|e| e.to_string())?;
    let device = gpu.name().map_err(|e| e.to_string())?;
    let model_path = args.first().ok_or("usage: gpu_engine check MODEL TEXT")?;
    let text_path = args.get(1).ok_or("usage: gpu_engine check MODEL TEXT")?;
    let s = |e: engine::EngineError| e.to_string();
    let file = Gguf::open(Path::new(model_path)).map_err(s)?;
    let model = Model::load(&file).map_err(s)?;
    let tok = Tokenizer::from_gguf(&file).map_err(s)?;
    let text = std::fs::read_to_string(text_path).map_err(|e| format!("{text_path}: {e}"))?;
    let ids = tok.encode(&text).map_err(s)?;
    let total = PREFILL + DECODE + 1;
    if ids.len() < total {
        return Err(format!(
            "{text_path} has {} tokens; {total} needed",
            ids.len()
        ));
    }
    let c = model.config;
    let t0 = Instant::now();
    let gm = GpuModel::upload(&model, gpu).map_err(s)?;
    gm.gpu().synchronize().map_err(|e| e.to_string())?;
    let upload_s = t0.elapsed().as_secs_f64();
    let blocks = total.div_ceil(BLOCK);
    let n = PREFILL + DECODE;
    let cpu_kv = || KvStore::<f32>::new(&c, blocks, BLOCK).map_err(s);
    // The reference: the CPU forward over all of it at once, every row's logits (prefill rows
    // run f32 activations against exactly dequantized weights).
    let rows: Vec<usize> = (0..n).collect();
    let batch = Batch::single(0, n, blocks);
    let want = model
        .forward(
            &ids[..n],
            &rows,
            &mut DenseAttention {
                store: &mut cpu_kv()?,
                batch: &batch,
            },
            &rows,
        )
        .map_err(s)?;
    let vocab = c.vocab;
    let nll_of = |logits: &[f32]| -> f64 {
        logits
            .chunks_exact(vocab)
            .enumerate()
            .map(|(i, row)| nll(row, ids[PREFILL + i + 1] as usize))
            .sum::<f64>()
    };
    let decoded = |all: &[f32]| all[PREFILL * vocab..].to_vec();
    // The CPU path as the engine runs it: a prefill, then one token per forward (decode rows
    // meet quantized weights as 8-bit blocks).
    let mut store = cpu_kv()?;
    let prefix: Vec<usize> = (0..PREFILL).collect();
    let batch = Batch::single(0, PREFILL, blocks);
    model
        .forward(
            &ids[..PREFILL],
            &prefix,
            &mut DenseAttention {
                store: &mut store,
                batch: &batch,
            },
            &[PREFILL - 1],
        )
        .map_err(s)?;
    let mut cpu_decode = Vec::with_capacity(DECODE * vocab);
    for p in PREFILL..n {
        let batch = Batch::single(p, p + 1, blocks);
        cpu_decode.extend(
            model
                .forward(
                    &ids[p..=p],
                    &[p],
                    &mut DenseAttention {
                        store: &mut store,
                        batch: &batch,
                    },
                    &[0],
                )
                .map_err(s)?,
        );
    }
    // The GPU: the same prefill (every row's logits), then the same decode.
    let mut kv = GpuDenseAttention::cache(gm.gpu(), &c, blocks, BLOCK).map_err(s)?;
    let batch = Batch::single(0, PREFILL, blocks);
    let mut att =
        GpuDenseAttention::new(gm.gpu(), &c, kv, &batch.meta(), &batch.slots).map_err(s)?;
    let gpu_prefill = gm
        .forward(&ids[..PREFILL], &prefix, &mut att, &prefix)
        .map_err(s)?;
    kv = att.kv;
    let mut gpu_decode = Vec::with_capacity(DECODE * vocab);
    let mut gpu_s = 0.0;
    for p in PREFILL..n {
        let batch = Batch::single(p, p + 1, blocks);
        let t = Instant::now();
        let mut att =
            GpuDenseAttention::new(gm.gpu(), &c, kv, &batch.meta(), &batch.slots).map_err(s)?;
        gpu_decode.extend(gm.forward(&ids[p..=p], &[p], &mut att, &[0]).map_err(s)?);
        gpu_s += t.elapsed().as_secs_f64();
        kv = att.kv;
    }
    let reference = decoded(&want);
    let mut tallies = [
        Tally::default(),
        Tally::default(),
        Tally::default(),
        Tally::default(),
    ];
    tallies[0].add(&gpu_prefill, &want[..PREFILL * vocab], vocab);
    tallies[1].add(&gpu_decode, &reference, vocab);
    tallies[2].add(&cpu_decode, &reference, vocab);
    tallies[3].add(&gpu_decode, &cpu_decode, vocab);
    let ppl = |x: f64| (x / DECODE as f64).exp();
    let ok = tallies[0].max_rel <= TOLERANCE && tallies[1].max_rel <= TOLERANCE;
    let mut out = String::new();
    out += &format!(
        "gpu_engine check on {device}: {model_path}, {PREFILL} prefill + {DECODE} decode tokens \
         of {text_path}; reference: the CPU forward of all {n} tokens at once (f32 activations)\n"
    );
    out += &format!(
        "  weights on the device: {:.1} MiB bf16, uploaded in {upload_s:.2} s\n",
        gm.weight_bytes() as f64 / f64::from(1u32 << 20)
    );
    out += &tallies[0].line("gpu prefill vs reference");
    out += &tallies[1].line("gpu decode vs reference");
    out += &tallies[2].line("cpu decode (8-bit rows) vs reference");
    out += &tallies[3].line("gpu decode vs cpu decode");
    out += &format!(
        "  perplexity over the decoded positions: reference {:.4}, cpu decode {:.4}, gpu decode {:.4}\n",
        ppl(nll_of(&reference)),
        ppl(nll_of(&cpu_decode)),
        ppl(nll_of(&gpu_decode))
    );
    out += &format!(
        "  gpu decode step (upload of the batch to logits on the host): {:.3} ms\n",
        gpu_s / DECODE as f64 * 1e3
    );
    out += &format!(
        "gpu_engine check: {} (gpu max rel within {TOLERANCE:.0e} of the reference)\n",
        if ok { "0 failed" } else { "FAILED" }
    );
    print!("{out}");
    if let Some(path) = report::json_arg(args) {
        let json = format!(
            "{{\"device\":{device:?},\"gpu_prefill\":{},\"gpu_decode\":{},\"cpu_decode\":{},\"gpu_vs_cpu_decode\":{},\"ppl_reference\":{},\"ppl_cpu_decode\":{},\"ppl_gpu_decode\":{},\"decode_ms\":{},\"weight_bytes\":{}}}\n",
            tallies[0].json(),
            tallies[1].json(),
            tallies[2].json(),
            tallies[3].json(),
            ppl(nll_of(&reference)),
            ppl(nll_of(&cpu_decode)),
            ppl(nll_of(&gpu_decode)),
            gpu_s / DECODE as f64 * 1e3,
            gm.weight_bytes()
        );
        std::fs::write(path, json).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(if ok { 0 } else { 1 })
}
