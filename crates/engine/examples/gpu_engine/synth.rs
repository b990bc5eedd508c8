//! `gpu_engine bench`: capacity and decode throughput of a synthetic Llama-3-8B-class model
//! (32 layers, 32 query / 8 KV heads of 128, random bf16 weights made on the device), dense
//! against hierarchical sparse, at 32K and 128K tokens of context per request.
//!
//! The context is synthetic too: dense requests' KV cache is filled with random values on the
//! device, sparse requests' prompts (random keys and values) go through the coordinator's CPU
//! prefill hooks into its host pool, which builds their Quest pages. Every decode step is then
//! a real forward of the whole model (greedy, the next token the model's own) with attention
//! dense over the device cache or through the coordinator's device hooks (Quest scores and
//! top-k, hot-buffer diff, zero-copy loads of the misses, attention over the hot buffer).
//! Sparse: every layer sparse, head-shared Quest, pages of 16, a 2048-token budget (16 sink
//! and 64 recent tokens always in), a hot buffer of 4096 tokens.
//!
//! Device bytes per request are measured (dense: its blocks of every layer; sparse: the
//! device mirror's representations and hot buffers over its requests); the largest batch each
//! fits is the device's free memory after the weights, less a reserve, over those bytes.
//! Sparse requests also hold their whole KV cache in host memory, which bounds their batch on
//! the lent machine: the sparse runs use the batch stated in the table.

use std::time::Instant;

use attn_op::cuda::Gpu;
use attn_op::{AttnParams, BatchMeta};
use coordinator::cuda::DeviceSparse;
use coordinator::{Capacity, SparseConfig, SparseCoordinator};
use engine::gpu::{GpuDenseAttention, GpuModel};
use engine::gpu_sparse::GpuSparseAttention;
use engine::synthetic::LLAMA3_8B;
use half::bf16;
use kv_blocks::RequestId;
use offload::{HostAlloc, HostLayout, HostStore};
use sparse_algo::{AlgoConfig, AlwaysInclude, QuestConfig};

use crate::Res;
use crate::report;

/// Decode steps timed, after the warm-up steps.
const STEPS: usize = 8;
const WARM: usize = 2;
/// Tokens per block (dense) and per Quest page (sparse).
const PAGE: usize = 16;
/// Device memory kept free of KV for the forward's buffers, cuBLAS and the allocator.
const RESERVE: usize = 4 << 30;
const GIB: f64 = (1u64 << 30) as f64;

/// One measured configuration.
struct Row {
    context: usize,
    mode: &'static str,
    batch: usize,
    /// Device bytes per request (KV, or representations and hot buffers).
    device: usize,
    /// Host bytes per request (the sparse requests' host KV).
    host: usize,
    /// Largest batch the device memory left after the weights holds.
    device_max: usize,
    step_ms: f64,
    /// Fraction of the selected pages that missed the hot buffer (sparse).
    miss: Option<f64>,
}

pub(crate) fn bench(args: &[String]) -> Res<i32> {
    let gpu = Gpu::new(0).map_err(|e| e.to_string())?;
    let name = gpu.name().map_err(|e| e.to_string())?;
    let s = |e: engine::EngineError| e.to_string();
    let t0 = Instant::now();
    let gm = GpuModel::<bf16>::synthetic(LLAMA3_8B, gpu, 8).map_err(s)?;
    gm.gpu().synchronize().map_err(|e| e.to_string())?;
    println!(
        "synthetic Llama-3-8B-class model on {name}: {:.2} GiB of bf16 weights made in {:.1} s",
        gm.weight_bytes() as f64 / GIB,
        t0.elapsed().as_secs_f64()
    );
    let plans: &[(usize, usize, usize)] = &[(32 * 1024, 16, 16), (128 * 1024, 4, 4)];
    let mut rows = Vec::new();
    for &(context, equal, sparse_batch) in plans {
        let (free, _) = gm
            .gpu()
            .context()
            .mem_get_info()
            .map_err(|e| format!("{e:?}"))?;
        let room = free.saturating_sub(RESERVE);
        let per = dense_bytes(&gm, context);
        let device_max = room / per;
        let mut batches = vec![equal.min(device_max)];
        if device_max > equal {
            batches.push(device_max);
        }
        for batch in batches.into_iter().filter(|&b| b > 0) {
            let ms = dense(&gm, context, batch).map_err(s)?;
            println!("dense  {context:>6} tokens, batch {batch:>3}: {ms:.2} ms per step");
            rows.push(Row {
                context,
                mode: "dense",
                batch,
                device: per,
                host: 0,
                device_max,
                step_ms: ms,
                miss: None,
            });
        }
        let r = sparse(&gm, context, sparse_batch, room)?;
        println!(
            "sparse {context:>6} tokens, batch {:>3}: {:.2} ms per step, miss rate {:.3}",
            r.batch,
            r.step_ms,
            r.miss.unwrap_or(0.0)
        );
        rows.push(r);
    }
    let table = table(&name, &rows);
    print!("{table}");
    if let Some(path) = report::json_arg(args) {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"context\":{},\"mode\":{:?},\"batch\":{},\"device_bytes\":{},\"host_bytes\":{},\"device_max\":{},\"step_ms\":{},\"tokens_per_s\":{},\"miss_rate\":{}}}",
                    r.context,
                    r.mode,
                    r.batch,
                    r.device,
                    r.host,
                    r.device_max,
                    r.step_ms,
                    r.batch as f64 / r.step_ms * 1e3,
                    r.miss.map_or("null".to_owned(), |m| m.to_string())
                )
            })
            .collect();
        let json = format!(
            "{{\"device\":{name:?},\"weight_bytes\":{},\"rows\":[{}]}}\n",
            gm.weight_bytes(),
            items.join(",")
        );
        std::fs::write(path, json).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(0)
}

/// The table of the runs: per context, dense and sparse side by side.
fn table(device: &str, rows: &[Row]) -> String {
    let mut out = format!(
        "synthetic 8B-class decode on {device} (weights and KV bf16; {STEPS} steps after {WARM})\n\
         {:>7} {:>6} {:>5} {:>14} {:>12} {:>10} {:>9} {:>10} {:>6}\n",
        "context",
        "mode",
        "batch",
        "device/req MiB",
        "host/req GiB",
        "device max",
        "ms/step",
        "tokens/s",
        "miss"
    );
    for r in rows {
        out += &format!(
            "{:>7} {:>6} {:>5} {:>14.1} {:>12.2} {:>10} {:>9.2} {:>10.1} {:>6}\n",
            r.context,
            r.mode,
            r.batch,
            r.device as f64 / f64::from(1u32 << 20),
            r.host as f64 / GIB,
            r.device_max,
            r.step_ms,
            r.batch as f64 / r.step_ms * 1e3,
            r.miss.map_or("-".to_owned(), |m| format!("{m:.3}"))
        );
    }
    for &context in &[32 * 1024, 128 * 1024] {
        let d = rows
            .iter()
            .find(|r| r.context == context && r.mode == "dense");
        let sp = rows
            .iter()
            .find(|r| r.context == context && r.mode == "sparse");
        if let (Some(d), Some(sp)) = (d, sp) {
            out += &format!(
                "{context}: device bytes per request dense/sparse {:.1}x\n",
                d.device as f64 / sp.device.max(1) as f64
            );
        }
    }
    out
}

/// Device bytes of one dense request's KV at `context` tokens (and the steps decoded).
fn dense_bytes(gm: &GpuModel<bf16>, context: usize) -> usize {
    let c = gm.config;
    (context + WARM + STEPS).div_ceil(PAGE) * PAGE * c.kv_bytes_per_token(size_of::<bf16>())
}

/// The median step of `batch` requests decoding at `context` tokens over a random dense cache.
fn dense(gm: &GpuModel<bf16>, context: usize, batch: usize) -> Result<f64, engine::EngineError> {
    let c = gm.config;
    let per = (context + WARM + STEPS).div_ceil(PAGE);
    let mut kv = GpuDenseAttention::<bf16>::cache(gm.gpu(), &c, batch * per, PAGE)?;
    for (l, layer) in kv.iter_mut().enumerate() {
        let (k, v) = layer.tensors_mut();
        gm.fill_uniform(k, 2 * l as u64 + 100, 1.0)?;
        gm.fill_uniform(v, 2 * l as u64 + 101, 1.0)?;
    }
    let table: Vec<i32> = (0..batch * per).map(|b| b as i32).collect();
    let cu: Vec<i32> = (0..=batch).map(|i| i as i32).collect();
    let all: Vec<usize> = (0..batch).collect();
    let mut tokens: Vec<u32> = (0..batch).map(|i| (i * 7919 % c.vocab) as u32).collect();
    let mut times = Vec::new();
    for step in 0..WARM + STEPS {
        let pos = context + step;
        let lens = vec![(pos + 1) as i32; batch];
        let slots: Vec<i32> = (0..batch).map(|r| (r * per * PAGE + pos) as i32).collect();
        let meta = BatchMeta {
            cu_seqlens_q: &cu,
            seq_lens_kv: &lens,
            block_table: &table,
            max_blocks: per,
        };
        let t = Instant::now();
        let mut att = GpuDenseAttention::new(gm.gpu(), &c, kv, &meta, &slots)?;
        tokens = gm.forward_greedy(&tokens, &vec![pos; batch], &mut att, &all)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        kv = att.kv;
    }
    Ok(median(&mut times[WARM..]))
}

/// Prefills `batch` sparse requests of `context` random tokens through the coordinator's CPU
/// hooks, then times decode steps through its device hooks.
fn sparse(gm: &GpuModel<bf16>, context: usize, batch: usize, room: usize) -> Res<Row> {
    let e = |e: coordinator::CoordError| e.to_string();
    let s = |e: engine::EngineError| e.to_string();
    let c = gm.config;
    let config = SparseConfig {
        algo: AlgoConfig::Quest(QuestConfig {
            page_size: PAGE,
            budget_tokens: 2048,
            always: AlwaysInclude {
                sink_tokens: 16,
                recent_tokens: 64,
            },
            shared_heads: true,
        }),
        hot_tokens: Some(4096),
        min_prompt_tokens: Some(1),
        dense_layers: Vec::new(),
        layer: Vec::new(),
        host_layout: HostLayout::LayerFirst,
    };
    let pages = (context + WARM + STEPS).div_ceil(PAGE);
    let cap = Capacity {
        max_requests: batch,
        max_tokens: pages * PAGE,
        host_pages: batch * pages,
        host_alloc: HostAlloc::Own,
    };
    let mut coord = SparseCoordinator::<bf16>::from_config(c.shape(), &config, cap).map_err(e)?;
    let kvs = c.kv_heads * c.head_dim;
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut random = |n: usize| -> Vec<bf16> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                bf16::from_f32((state >> 40) as f32 / 8_388_608.0 - 1.0)
            })
            .collect()
    };
    let (k, v) = (random(context * kvs), random(context * kvs));
    // Prefill rows are only counted by the coordinator (Quest scores no prompt), so the
    // queries are zeros the allocator need not touch.
    let q = vec![0f32; context * c.q_heads * c.head_dim];
    let t0 = Instant::now();
    let ids: Vec<RequestId> = (0..batch).map(|r| RequestId(r as u64 + 1)).collect();
    for &id in &ids {
        coord.on_request_begin(id, context).map_err(e)?;
        coord.forward_begin(&[(id, context)]).map_err(e)?;
        for l in 0..c.layers {
            coord.attention_begin(l, &q, &k, &v).map_err(e)?;
            coord.attention_end(l, &k, &v).map_err(e)?;
        }
        coord.forward_end().map_err(e)?;
    }
    drop(q);
    println!(
        "sparse {context:>6} tokens: {batch} prompts into the host pool in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let mut dev = DeviceSparse::new(gm.gpu(), &coord).map_err(e)?;
    let device = dev.device_bytes() / batch;
    let host = coord.manager().map_or(0, |m| {
        m.host().read().shape().pages * PAGE * c.layers * kvs * 2 * 2
    }) / batch;
    let all: Vec<usize> = (0..batch).collect();
    let mut tokens: Vec<u32> = (0..batch).map(|i| (i * 7919 % c.vocab) as u32).collect();
    let params = AttnParams::new(c.q_heads, c.head_dim);
    let mut times = Vec::new();
    let (mut hits, mut misses) = (0u64, 0u64);
    for step in 0..WARM + STEPS {
        let pos = context + step;
        let reqs: Vec<(RequestId, usize)> = ids.iter().map(|&id| (id, 1)).collect();
        let t = Instant::now();
        coord.forward_begin(&reqs).map_err(e)?;
        let mut att = GpuSparseAttention {
            coord: &mut coord,
            dev: &mut dev,
            params: params.clone(),
        };
        tokens = gm
            .forward_greedy(&tokens, &vec![pos; batch], &mut att, &all)
            .map_err(s)?;
        coord.forward_end().map_err(e)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        if step >= WARM {
            for l in 0..c.layers {
                let st = dev.stats(gm.gpu(), &coord, l).map_err(e)?;
                hits += st.hits;
                misses += st.misses;
            }
        }
    }
    Ok(Row {
        context,
        mode: "sparse",
        batch,
        device,
        host,
        device_max: room / device.max(1),
        step_ms: median(&mut times[WARM..]),
        miss: Some(misses as f64 / (hits + misses).max(1) as f64),
    })
}

fn median(x: &mut [f64]) -> f64 {
    x.sort_by(f64::total_cmp);
    x.get(x.len() / 2).copied().unwrap_or(f64::NAN)
}
