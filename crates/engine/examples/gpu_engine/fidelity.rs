//! `gpu_engine fidelity MODEL TEXT [--json FILE]`: the CPU engine's fidelity figures on the
//! GPU. The real model prefills [`PREFILL`] tokens of the text and teacher-forces the next
//! [`DECODE`], dense and with hierarchical sparse attention (Quest, a 1024-token budget, pages
//! of 16 shared by the KV heads, layers 0 and 1 dense: the engine issue's main variant), on
//! the CPU (`engine::eval::teacher_forced`, f16 KV) and on the GPU (f16 weights and KV; the
//! prefill dense over the engine's device cache while the coordinator's device hooks back the
//! prompt up to the host pool, then every decode step through them). Each side's sparse run
//! is compared with its own dense run: perplexity ratio and top-1 agreement.

use std::time::Instant;

use attn_op::AttnParams;
use attn_op::cuda::Gpu;
use coordinator::cuda::DeviceSparse;
use coordinator::{Capacity, SparseConfig, SparseCoordinator};
use engine::eval::{EvalOptions, argmax, nll, teacher_forced};
use engine::gpu::{GpuDenseAttention, GpuModel};
use engine::gpu_sparse::GpuSparseAttention;
use engine::{Batch, Model};
use half::f16;
use kv_blocks::RequestId;
use offload::{HostAlloc, HostLayout};

use crate::{BLOCK, Inputs, Res, inputs, report};

/// Tokens prefilled, then positions teacher-forced.
const PREFILL: usize = 3584;
const DECODE: usize = 256;
/// How much worse than the CPU's the GPU's sparse-over-dense figures may be: perplexity ratio
/// (relative, above) and top-1 agreement (absolute, below). Figures better than the CPU's lose
/// no fidelity and pass.
const PPL_DRIFT: f64 = 0.01;
const TOP1_DRIFT: f64 = 0.03;

/// One side's figures: the dense and sparse runs' perplexities and their top-1 agreement.
struct Figures {
    ppl_dense: f64,
    ppl_sparse: f64,
    top1: f64,
}

impl Figures {
    fn ratio(&self) -> f64 {
        self.ppl_sparse / self.ppl_dense
    }
}

pub(crate) fn fidelity(args: &[String]) -> Res<i32> {
    let s = |e: engine::EngineError| e.to_string();
    let gpu = Gpu::new(0).map_err(|e| e.to_string())?;
    let device = gpu.name().map_err(|e| e.to_string())?;
    let Inputs {
        model,
        ids,
        model_path,
        text_path,
    } = inputs("fidelity", args, PREFILL + DECODE + 1)?;
    let ids = &ids[..];
    let config = SparseConfig {
        dense_layers: vec![0, 1],
        min_prompt_tokens: Some(1),
        host_layout: HostLayout::LayerFirst,
        ..SparseConfig::quest(1024)
    };
    let t0 = Instant::now();
    let opts = EvalOptions {
        prefill: PREFILL,
        chunk: 512,
        block_size: BLOCK,
        recall: false,
    };
    let reports = teacher_forced::<f16>(
        &model,
        ids,
        &[("quest-1024+2dense".to_owned(), config.clone())],
        &opts,
        |_, _| {},
    )
    .map_err(s)?;
    let cpu_s = t0.elapsed().as_secs_f64();
    let cpu = Figures {
        ppl_dense: reports[0].perplexity(),
        ppl_sparse: reports[1].perplexity(),
        top1: reports[1].top1_agreement,
    };
    let t0 = Instant::now();
    let (gpu_fig, misses) = gpu_figures(&model, ids, gpu, &config)?;
    let gpu_s = t0.elapsed().as_secs_f64();
    let ok =
        gpu_fig.ratio() / cpu.ratio() - 1.0 <= PPL_DRIFT && cpu.top1 - gpu_fig.top1 <= TOP1_DRIFT;
    let line = |what: &str, f: &Figures| {
        format!(
            "  {what}: perplexity dense {:.4}, sparse {:.4} ({:.4}x), top-1 agreement {:.4}\n",
            f.ppl_dense,
            f.ppl_sparse,
            f.ratio(),
            f.top1
        )
    };
    let mut out = format!(
        "gpu_engine fidelity on {device}: {model_path}, {PREFILL} prefill + {DECODE} \
         teacher-forced tokens of {text_path}; quest-1024+2dense against dense, each side \
         against its own dense\n"
    );
    out += &line(&format!("cpu (f16 KV, {cpu_s:.1} s)"), &cpu);
    out += &line(&format!("gpu (f16, {gpu_s:.1} s)"), &gpu_fig);
    out += &format!("  gpu sparse decode: hot-buffer miss rate {misses:.3}\n");
    out += &format!(
        "gpu_engine fidelity: {} (the GPU's perplexity ratio at most {:.0} % above the CPU's, \
         its top-1 agreement at most {TOP1_DRIFT} below)\n",
        if ok { "0 failed" } else { "FAILED" },
        PPL_DRIFT * 100.0
    );
    print!("{out}");
    if let Some(path) = report::json_arg(args) {
        let fig = |f: &Figures| {
            format!(
                "{{\"ppl_dense\":{},\"ppl_sparse\":{},\"ppl_ratio\":{},\"top1\":{}}}",
                f.ppl_dense,
                f.ppl_sparse,
                f.ratio(),
                f.top1
            )
        };
        let json = format!(
            "{{\"device\":{device:?},\"prefill\":{PREFILL},\"decode\":{DECODE},\"variant\":\"quest-1024+2dense\",\"cpu\":{},\"gpu\":{},\"gpu_miss_rate\":{misses}}}\n",
            fig(&cpu),
            fig(&gpu_fig)
        );
        std::fs::write(path, json).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(if ok { 0 } else { 1 })
}

/// The GPU's dense and sparse runs over `ids` and their figures, with the sparse decode's
/// miss rate.
fn gpu_figures(model: &Model, ids: &[u32], gpu: Gpu, config: &SparseConfig) -> Res<(Figures, f64)> {
    let s = |e: engine::EngineError| e.to_string();
    let e = |e: coordinator::CoordError| e.to_string();
    let c = model.config;
    let gm = GpuModel::<f16>::upload(model, gpu).map_err(s)?;
    let n = ids.len();
    let blocks = n.div_ceil(BLOCK);
    let prefix: Vec<usize> = (0..PREFILL).collect();
    let dense_attention = |kv, pos: usize, end: usize| {
        let batch = Batch::single(pos, end, blocks);
        GpuDenseAttention::new(gm.gpu(), &c, kv, &batch.meta(), &batch.slots)
    };
    // Dense: a prefill, then one token per forward.
    let mut att = dense_attention(
        GpuDenseAttention::<f16>::cache(gm.gpu(), &c, blocks, BLOCK).map_err(s)?,
        0,
        PREFILL,
    )
    .map_err(s)?;
    gm.forward(&ids[..PREFILL], &prefix, &mut att, &[])
        .map_err(s)?;
    let mut kv = att.kv;
    let (mut dense_nll, mut dense_top) = (0.0, Vec::with_capacity(DECODE));
    for p in PREFILL..n - 1 {
        let mut att = dense_attention(kv, p, p + 1).map_err(s)?;
        let logits = gm.forward(&ids[p..=p], &[p], &mut att, &[0]).map_err(s)?;
        dense_nll += nll(&logits, ids[p + 1] as usize);
        dense_top.push(argmax(&logits));
        kv = att.kv;
    }
    // Sparse: the same, through the coordinator's device hooks.
    let id = RequestId(1);
    let cap = Capacity {
        max_requests: 1,
        max_tokens: blocks * BLOCK,
        host_pages: blocks + 1,
        host_alloc: HostAlloc::Own,
    };
    let mut coord = SparseCoordinator::<f16>::from_config(c.shape(), config, cap).map_err(e)?;
    let mut dev = DeviceSparse::new(gm.gpu(), &coord).map_err(e)?;
    let params = AttnParams::new(c.q_heads, c.head_dim);
    coord.on_request_begin(id, PREFILL).map_err(e)?;
    coord.forward_begin(&[(id, PREFILL)]).map_err(e)?;
    let dense = dense_attention(
        GpuDenseAttention::<f16>::cache(gm.gpu(), &c, blocks, BLOCK).map_err(s)?,
        0,
        PREFILL,
    )
    .map_err(s)?;
    let mut att = GpuSparseAttention {
        coord: &mut coord,
        dev: &mut dev,
        params: params.clone(),
        dense: Some(dense),
    };
    gm.forward(&ids[..PREFILL], &prefix, &mut att, &[])
        .map_err(s)?;
    let mut kv = att
        .dense
        .take()
        .ok_or("the dense attention is still there")?
        .kv;
    coord.forward_end().map_err(e)?;
    let (mut sparse_nll, mut agree) = (0.0, 0usize);
    let (mut hits, mut misses) = (0u64, 0u64);
    for (i, p) in (PREFILL..n - 1).enumerate() {
        coord.forward_begin(&[(id, 1)]).map_err(e)?;
        let mut att = GpuSparseAttention {
            coord: &mut coord,
            dev: &mut dev,
            params: params.clone(),
            dense: Some(dense_attention(kv, p, p + 1).map_err(s)?),
        };
        let logits = gm.forward(&ids[p..=p], &[p], &mut att, &[0]).map_err(s)?;
        kv = att
            .dense
            .take()
            .ok_or("the dense attention is still there")?
            .kv;
        coord.forward_end().map_err(e)?;
        sparse_nll += nll(&logits, ids[p + 1] as usize);
        agree += usize::from(argmax(&logits) == dense_top[i]);
        for l in (0..c.layers).filter(|l| !config.dense_layers.contains(l)) {
            let st = dev.stats(gm.gpu(), &coord, l).map_err(e)?;
            hits += st.hits;
            misses += st.misses;
        }
    }
    let steps = (n - 1 - PREFILL) as f64;
    Ok((
        Figures {
            ppl_dense: (dense_nll / steps).exp(),
            ppl_sparse: (sparse_nll / steps).exp(),
            top1: agree as f64 / steps,
        },
        misses as f64 / (hits + misses).max(1) as f64,
    ))
}
