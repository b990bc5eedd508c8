//! The engine's Llama forward on the GPU against the CPU's, for the device bundle
//! (`cargo xtask gpu`).
//!
//! `gpu_engine check MODEL TEXT [--json FILE]`: loads the GGUF model `MODEL` for both paths
//! and tokenizes `TEXT`. The reference is the CPU forward over its first 320 tokens at once,
//! every row's logits (f32 activations against exactly dequantized weights). The GPU runs
//! twice, with weights, GEMM inputs and KV cache in f16 and then in bf16: it prefills the first
//! 256 tokens (every row's logits) and decodes the next 64 teacher-forced; the CPU decodes the
//! same 64 as the engine does (8-bit activation rows against quantized weights). Each is
//! compared with the reference: per row the largest absolute logit difference over the largest
//! absolute logit (max rel) and the L2 norms' ratio (L2 rel), the worst row reported, with
//! top-1 agreement and perplexity over the decoded positions. Each GPU run is also compared
//! with the CPU forward at its own precision ("vs cpu f16", "vs cpu bf16":
//! `Model::computing_in`, which rounds the weights once, as the upload does, and every input
//! of a projection and of the attention, as the GPU's kernels do, with a KV cache of the
//! type), which separates the GPU path's own error from the type's; and that CPU forward with
//! the attention's portable build, whose f32 sums run in another order, is compared with
//! itself: the type's noise floor on this model, below which no forward of the type can match
//! another. The check fails (exit 1) where the f16 run's max rel exceeds 1e-2 or a logit is
//! not finite; bf16's is reported (its weights alone keep 8 significant bits of the Q4_1
//! values, which moves this model's logits by about 2e-2, and its noise floor lies above
//! 1e-2). It also reports the weights' device bytes and the decode step time, and checks
//! prefetch's query estimate: over a few decode steps, the estimate of each layer's queries
//! from that layer's own input must equal the queries the layer computes (within 1e-2).
//!
//! `gpu_engine fidelity MODEL TEXT [--json FILE]`: dense against hierarchical sparse decode
//! of the real model on the CPU and on the GPU, each side's perplexity ratio and top-1
//! agreement (module `fidelity`).
//!
//! `gpu_engine passkey MODEL [--json FILE]`: passkey retrieval at 4K and 8K on the GPU, dense
//! against hierarchical sparse (module `passkey`).
//!
//! `gpu_engine bench [--lanes] [--json FILE]`: the synthetic 8B-class model's capacity and
//! decode throughput, dense against hierarchical sparse (module `synth`). `--lanes` adds runs
//! of each batch split over two forks of the model on two streams (module `lanes`).
//!
//! Without a CUDA driver or device it prints "skipped: no CUDA device" and exits 0.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

mod fidelity;
mod lanes;
mod passkey;
#[path = "../../../attn-op/examples/gpu/report.rs"]
mod report;
#[path = "../../../attn-op/examples/gpu/rng.rs"]
mod rng;
mod sparse;
mod synth;

use std::path::Path;
use std::time::Instant;

use attn_op::Simd;
use attn_op::cuda::Gpu;
use engine::eval::{argmax, nll};
use engine::gguf::{DType, Gguf};
use engine::gpu::{GpuAttention, GpuDenseAttention, GpuFloat, GpuModel};
use engine::{Batch, DenseAttention, KvStore, Model, Tokenizer};
use half::{bf16, f16};

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
        "bench" => synth::bench(args),
        "fidelity" => fidelity::fidelity(args),
        "passkey" => passkey::passkey(args),
        other => Err(format!(
            "unknown command {other:?} (check, fidelity, passkey or bench)"
        )),
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

/// What one element type's GPU forward gave: every prefill row's logits, the decoded rows'
/// logits, the decode step's mean time, and the weights' bytes and upload time.
struct GpuRun {
    name: &'static str,
    /// The CPU forward of all the tokens at once at the run's own precision
    /// ([`Model::computing_in`]: weights rounded to `T` once, as the upload does, every input
    /// of a projection and of the attention rounded to `T`, a KV cache of `T`).
    same: Vec<f32>,
    /// The same CPU forward with the attention's portable build: it differs from `same` only
    /// by the order of the attention's f32 sums (the type's noise floor on this model).
    reordered: Vec<f32>,
    prefill: Vec<f32>,
    decode: Vec<f32>,
    step_ms: f64,
    weight_bytes: usize,
    upload_s: f64,
    /// The query estimate from a layer's own input against the layer's queries: the largest
    /// absolute difference over the largest absolute query, and the layer steps compared.
    query_rel: f64,
    query_layers: usize,
}

/// Decode steps whose query estimates are compared.
const PROBED: usize = 8;

/// Dense attention that asks, at each layer's start, for the estimate of that same layer's
/// queries from its input ([`GpuModel`]'s prefetch estimate), and compares it with the
/// queries the layer then attends with.
struct QueryProbe<T: GpuFloat> {
    inner: Option<GpuDenseAttention<T>>,
    early: Option<cudarc::driver::CudaSlice<T>>,
    worst: f64,
    layers: usize,
}

impl<T: GpuFloat> GpuAttention<T> for QueryProbe<T> {
    fn attend(
        &mut self,
        gpu: &Gpu,
        layer: usize,
        q: &cudarc::driver::CudaSlice<T>,
        k: &cudarc::driver::CudaSlice<T>,
        v: &cudarc::driver::CudaSlice<T>,
        out: &mut cudarc::driver::CudaSlice<f32>,
    ) -> Result<(), engine::EngineError> {
        let early = self.early.take().ok_or_else(|| {
            engine::EngineError::Invalid(format!("layer {layer} got no query estimate"))
        })?;
        let (got, want) = (gpu.download(&early)?, gpu.download(q)?);
        let top = want
            .iter()
            .fold(0f64, |m, x| m.max(f64::from(x.to_f32().abs())));
        let worst = got.iter().zip(&want).fold(0f64, |m, (a, b)| {
            m.max(f64::from((a.to_f32() - b.to_f32()).abs()))
        });
        self.worst = self.worst.max(worst / top.max(1e-30));
        self.layers += 1;
        let inner = self.inner.as_mut().ok_or_else(|| {
            engine::EngineError::Invalid("the probe has no dense attention".into())
        })?;
        inner.attend(gpu, layer, q, k, v, out)
    }

    fn early_query(&self, layer: usize) -> Option<usize> {
        Some(layer)
    }

    fn early(
        &mut self,
        _gpu: &Gpu,
        _target: usize,
        q: cudarc::driver::CudaSlice<T>,
    ) -> Result<(), engine::EngineError> {
        self.early = Some(q);
        Ok(())
    }
}

/// The GPU forward with weights, activations and KV cache of `T`: a prefill of the first
/// [`PREFILL`] tokens of `ids` (every row's logits), then the rest decoded one at a time.
fn gpu_run<T: GpuFloat>(model: &Model, ids: &[u32], gpu: Gpu) -> Res<GpuRun> {
    let s = |e: engine::EngineError| e.to_string();
    let c = model.config;
    let dtype = match T::DTYPE {
        attn_op::DType::F32 => DType::F32,
        attn_op::DType::F16 => DType::F16,
        attn_op::DType::BF16 => DType::BF16,
    };
    let rows: Vec<usize> = (0..ids.len()).collect();
    let blocks = (ids.len() + 1).div_ceil(BLOCK);
    let spec = model.computing_in(dtype).map_err(s)?;
    let cpu = |simd| -> Res<Vec<f32>> {
        let mut store = KvStore::<T>::new(&c, blocks, BLOCK).map_err(s)?;
        store.set_simd(simd);
        let batch = Batch::single(0, ids.len(), blocks);
        let attn = &mut DenseAttention {
            store: &mut store,
            batch: &batch,
        };
        spec.forward(ids, &rows, attn, &rows).map_err(s)
    };
    let (same, reordered) = (cpu(Simd::Auto)?, cpu(Simd::Portable)?);
    let t0 = Instant::now();
    let gm = GpuModel::<T>::upload(model, gpu).map_err(s)?;
    gm.gpu().synchronize().map_err(|e| e.to_string())?;
    let upload_s = t0.elapsed().as_secs_f64();
    let prefix: Vec<usize> = (0..PREFILL).collect();
    let mut kv = GpuDenseAttention::<T>::cache(gm.gpu(), &c, blocks, BLOCK).map_err(s)?;
    let batch = Batch::single(0, PREFILL, blocks);
    let mut att =
        GpuDenseAttention::new(gm.gpu(), &c, kv, &batch.meta(), &batch.slots).map_err(s)?;
    let prefill = gm
        .forward(&ids[..PREFILL], &prefix, &mut att, &prefix)
        .map_err(s)?;
    kv = att.kv;
    let mut decode = Vec::with_capacity((ids.len() - PREFILL) * c.vocab);
    let t = Instant::now();
    for p in PREFILL..ids.len() {
        let batch = Batch::single(p, p + 1, blocks);
        let mut att =
            GpuDenseAttention::new(gm.gpu(), &c, kv, &batch.meta(), &batch.slots).map_err(s)?;
        decode.extend(gm.forward(&ids[p..=p], &[p], &mut att, &[0]).map_err(s)?);
        kv = att.kv;
    }
    let step_ms = t.elapsed().as_secs_f64() * 1e3 / (ids.len() - PREFILL) as f64;
    // The query estimate (prefetch's) from each layer's own input against the layer's own
    // queries, over the first decode steps again (the cache rewritten with the same values).
    let mut probe = QueryProbe {
        early: None,
        worst: 0.0,
        layers: 0,
        inner: None,
    };
    for p in PREFILL..PREFILL + PROBED {
        let batch = Batch::single(p, p + 1, blocks);
        probe.inner =
            Some(GpuDenseAttention::new(gm.gpu(), &c, kv, &batch.meta(), &batch.slots).map_err(s)?);
        gm.forward(&ids[p..=p], &[p], &mut probe, &[0]).map_err(s)?;
        kv = probe.inner.take().ok_or("the probe kept its cache")?.kv;
    }
    Ok(GpuRun {
        name: T::KERNEL,
        query_rel: probe.worst,
        query_layers: probe.layers,
        same,
        reordered,
        prefill,
        decode,
        step_ms,
        weight_bytes: gm.weight_bytes(),
        upload_s,
    })
}

/// What `check` and `fidelity` run on: the real model and the first tokens of a text.
struct Inputs<'a> {
    model: Model,
    ids: Vec<u32>,
    model_path: &'a str,
    text_path: &'a str,
}

/// Loads `MODEL TEXT` (the first two of `args`) for command `cmd`: the GGUF model and the
/// text's first `tokens` tokens (an error where it has fewer).
fn inputs<'a>(cmd: &str, args: &'a [String], tokens: usize) -> Res<Inputs<'a>> {
    let usage = || format!("usage: gpu_engine {cmd} MODEL TEXT [--json FILE]");
    let model_path = args.first().ok_or_else(usage)?;
    let text_path = args.get(1).ok_or_else(usage)?;
    let s = |e: engine::EngineError| e.to_string();
    let file = Gguf::open(Path::new(model_path)).map_err(s)?;
    let model = Model::load(&file).map_err(s)?;
    let tok = Tokenizer::from_gguf(&file).map_err(s)?;
    let text = std::fs::read_to_string(text_path).map_err(|e| format!("{text_path}: {e}"))?;
    let mut ids = tok.encode(&text).map_err(s)?;
    if ids.len() < tokens {
        return Err(format!(
            "{text_path} has {} tokens; {tokens} needed",
            ids.len()
        ));
    }
    ids.truncate(tokens);
    Ok(Inputs {
        model,
        ids,
        model_path,
        text_path,
    })
}

fn check(args: &[String]) -> Res<i32> {
    let gpu = engine::gpu::open_gpu(0).map_err(|e| e.to_string())?;
    let device = gpu.name().map_err(|e| e.to_string())?;
    let s = |e: engine::EngineError| e.to_string();
    let total = PREFILL + DECODE + 1;
    let Inputs {
        model,
        ids,
        model_path,
        text_path,
    } = inputs("check", args, total)?;
    let c = model.config;
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
    let runs = [
        gpu_run::<f16>(&model, &ids[..n], gpu)?,
        gpu_run::<bf16>(
            &model,
            &ids[..n],
            engine::gpu::open_gpu(0).map_err(|e| e.to_string())?,
        )?,
    ];
    let reference = decoded(&want);
    let mut cpu = Tally::default();
    cpu.add(&cpu_decode, &reference, vocab);
    let tallies: Vec<[Tally; 6]> = runs
        .iter()
        .map(|r| {
            let mut t: [Tally; 6] = Default::default();
            t[0].add(&r.prefill, &want[..PREFILL * vocab], vocab);
            t[1].add(&r.decode, &reference, vocab);
            t[2].add(&r.decode, &cpu_decode, vocab);
            t[3].add(&r.prefill, &r.same[..PREFILL * vocab], vocab);
            t[4].add(&r.decode, &decoded(&r.same), vocab);
            t[5].add(&r.reordered, &r.same, vocab);
            t
        })
        .collect();
    let ppl = |x: f64| (x / DECODE as f64).exp();
    // The tolerance applies to f16, the type for a real model's weights; bf16 is reported.
    let ok = tallies[0][0].max_rel <= TOLERANCE
        && tallies[0][1].max_rel <= TOLERANCE
        && runs
            .iter()
            .all(|r| r.query_layers > 0 && r.query_rel <= TOLERANCE);
    let mut out = String::new();
    out += &format!(
        "gpu_engine check on {device}: {model_path}, {PREFILL} prefill + {DECODE} decode tokens \
         of {text_path}; reference: the CPU forward of all {n} tokens at once (f32 activations)\n"
    );
    out += &cpu.line("cpu decode (8-bit rows) vs reference");
    for (r, t) in runs.iter().zip(&tallies) {
        out += &format!(
            "  {}: weights on the device {:.1} MiB, uploaded in {:.2} s\n",
            r.name,
            r.weight_bytes as f64 / f64::from(1u32 << 20),
            r.upload_s
        );
        out += &t[0].line(&format!("gpu {} prefill vs reference", r.name));
        out += &t[1].line(&format!("gpu {} decode vs reference", r.name));
        out += &t[2].line(&format!("gpu {} decode vs cpu decode", r.name));
        out += &t[3].line(&format!("gpu {} prefill vs cpu {0}", r.name));
        out += &t[4].line(&format!("gpu {} decode vs cpu {0}", r.name));
        out += &t[5].line(&format!(
            "cpu {} vs itself, attention sums reordered (all rows)",
            r.name
        ));
        out += &format!(
            "    gpu {} query estimate from a layer's own input vs its queries: max rel {:.2e} \
             over {} layer steps\n",
            r.name, r.query_rel, r.query_layers
        );
    }
    out += &format!(
        "  perplexity over the decoded positions: reference {:.4}, cpu decode {:.4}, gpu f16 decode {:.4}, gpu bf16 decode {:.4}\n",
        ppl(nll_of(&reference)),
        ppl(nll_of(&cpu_decode)),
        ppl(nll_of(&runs[0].decode)),
        ppl(nll_of(&runs[1].decode))
    );
    out += &format!(
        "  gpu decode step (upload of the batch to logits on the host): f16 {:.3} ms, bf16 {:.3} ms\n",
        runs[0].step_ms, runs[1].step_ms
    );
    out += &format!(
        "gpu_engine check: {} (gpu f16 max rel within {TOLERANCE:.0e} of the reference, and \
         each type's query estimates within {TOLERANCE:.0e} of the queries)\n",
        if ok { "0 failed" } else { "FAILED" }
    );
    print!("{out}");
    if let Some(path) = report::json_arg(args) {
        let per_type: Vec<String> = runs
            .iter()
            .zip(&tallies)
            .map(|(r, t)| {
                format!(
                    "{:?}:{{\"prefill\":{},\"decode\":{},\"vs_cpu_decode\":{},\"prefill_vs_cpu_same\":{},\"decode_vs_cpu_same\":{},\"cpu_vs_reordered\":{},\"ppl_decode\":{},\"decode_ms\":{},\"weight_bytes\":{},\"query_estimate_max_rel\":{}}}",
                    r.name,
                    t[0].json(),
                    t[1].json(),
                    t[2].json(),
                    t[3].json(),
                    t[4].json(),
                    t[5].json(),
                    ppl(nll_of(&r.decode)),
                    r.step_ms,
                    r.weight_bytes,
                    r.query_rel
                )
            })
            .collect();
        let json = format!(
            "{{\"device\":{device:?},\"cpu_decode\":{},\"ppl_reference\":{},\"ppl_cpu_decode\":{},{}}}\n",
            cpu.json(),
            ppl(nll_of(&reference)),
            ppl(nll_of(&cpu_decode)),
            per_type.join(",")
        );
        std::fs::write(path, json).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(if ok { 0 } else { 1 })
}
