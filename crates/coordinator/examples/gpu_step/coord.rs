//! `gpu_step check`, coordinator part: two [`SparseCoordinator`]s fed the same forwards, one
//! through the CPU hooks and one through the device hooks ([`DeviceSparse`]). Requests of
//! different lengths prefill, decode across page boundaries, end, and a new request takes a
//! freed slot in a mixed prefill + decode batch, and two forwards are abandoned
//! (`abort_forward`: the requests each side ended must be the ones its hooks reached). Per
//! sparse layer and step: the routes, the
//! selections, the hits and misses, and the attention outputs (relative error 1e-2 in bf16)
//! must agree. The scenario runs six times: Quest with one selection shared by the KV heads,
//! and with one per KV head (whose hot buffer holds their union), each without and with
//! prefetch, and both again over E4M3 summaries (sparse_algo::summary). With prefetch, each layer's start prefetches the next layer from an estimate of
//! its queries (`prefetch` on the CPU, `prefetch_device` on the copy stream, left running
//! while the layer's own step is enqueued), and the pages each loaded early must agree too.

use attn_op::cuda::Gpu;
use attn_op::{AttnOut, AttnParams};
use coordinator::cuda::DeviceSparse;
use coordinator::{Capacity, ModelShape, Route, SparseConfig, SparseCoordinator};
use half::bf16;
use kv_blocks::RequestId;
use offload::{HostAlloc, HostLayout, StepStats};
use sparse_algo::{AlgoConfig, AlwaysInclude, QuestConfig, Summary};

use crate::rng::Rng;
use crate::{Res, err};

const MODEL: ModelShape = ModelShape {
    layers: 3,
    q_heads: 8,
    kv_heads: 2,
    head_dim: 64,
};

/// Both coordinators and what the check counts.
struct Pair {
    cpu: SparseCoordinator<bf16>,
    gco: SparseCoordinator<bf16>,
    dev: DeviceSparse<bf16>,
    rng: Rng,
    /// Per layer, the query direction the steps drift around (selections stay similar, so
    /// the hot buffers see hits as well as misses).
    base_q: Vec<Vec<f32>>,
    failed: usize,
    compared: usize,
    hits: u64,
    misses: u64,
    /// Pages loaded early on the device, over the prefetches compared.
    early: u64,
}

/// Runs the scenario with one selection shared by the KV heads (pages of 16) and with one
/// per KV head (pages of 4), each without and with prefetch, then both without prefetch over
/// E4M3 summaries (scored on tensor cores on the device, so the two sides' scores differ in
/// their last bits; the scenario's random queries leave no near ties at its selections'
/// edges); answers the number of failed comparisons.
pub(crate) fn check(gpu: &Gpu) -> Res<usize> {
    let mut failed = 0;
    for (prefetch, summary) in [
        (false, Summary::Exact),
        (true, Summary::Exact),
        (false, Summary::E4m3),
    ] {
        for (page_size, shared_heads) in [(16, true), (4, false)] {
            failed += scenario(gpu, page_size, shared_heads, prefetch, summary)?;
        }
    }
    Ok(failed)
}

/// The scenario with Quest over pages of `page_size`, its selections shared by the KV heads
/// or not, with or without prefetch.
fn scenario(
    gpu: &Gpu,
    page_size: usize,
    shared_heads: bool,
    prefetch: bool,
    summary: Summary,
) -> Res<usize> {
    let config = SparseConfig {
        algo: AlgoConfig::Quest(QuestConfig {
            page_size,
            budget_tokens: 128,
            always: AlwaysInclude {
                sink_tokens: 16,
                recent_tokens: 32,
            },
            shared_heads,
            summary,
        }),
        hot_tokens: None,
        min_prompt_tokens: Some(1),
        dense_layers: vec![0],
        layer: Vec::new(),
        host_layout: HostLayout::LayerFirst,
        prefetch,
    };
    let cap = Capacity {
        max_requests: 4,
        max_tokens: 2048,
        host_pages: 4 * 128,
        host_alloc: HostAlloc::Own,
    };
    let cpu = SparseCoordinator::from_config(MODEL, &config, cap).map_err(err)?;
    let gco = SparseCoordinator::from_config(MODEL, &config, cap).map_err(err)?;
    let dev = DeviceSparse::new(gpu, &gco).map_err(err)?;
    let mut rng = Rng::new(17);
    let qs = MODEL.q_heads * MODEL.head_dim;
    let base_q = (0..MODEL.layers)
        .map(|_| (0..qs).map(|_| rng.unit()).collect())
        .collect();
    let mut p = Pair {
        cpu,
        gco,
        dev,
        rng,
        base_q,
        failed: 0,
        compared: 0,
        hits: 0,
        misses: 0,
        early: 0,
    };
    let (a, b, c, d) = (RequestId(1), RequestId(2), RequestId(3), RequestId(4));
    for (id, len) in [(a, 300), (b, 517), (c, 1000)] {
        p.begin(id, len)?;
    }
    p.forward(gpu, &[(a, 300), (b, 517)])?;
    p.forward(gpu, &[(c, 1000)])?;
    for _ in 0..8 {
        p.forward(gpu, &[(a, 1), (b, 1), (c, 1)])?;
    }
    for co in [&mut p.cpu, &mut p.gco] {
        co.on_request_end(b).map_err(err)?;
    }
    p.begin(d, 200)?;
    // A mixed batch: decode rows around a prefill, so the device gathers their queries.
    p.forward(gpu, &[(a, 1), (d, 200), (c, 1)])?;
    for _ in 0..8 {
        p.forward(gpu, &[(c, 1), (a, 1), (d, 1)])?;
    }
    // Two forwards abandoned: in the dense layer 0 (nothing ended), then in the sparse layer
    // 1 (its decode rows ended, and on the device the prefilling request too); `d` decodes on.
    let e = RequestId(5);
    for co in [&mut p.cpu, &mut p.gco] {
        co.on_request_end(c).map_err(err)?;
    }
    p.begin(e, 64)?;
    p.forward_until(gpu, &[(a, 1), (e, 64)], Some(0))?;
    p.forward_until(gpu, &[(a, 1), (e, 64)], Some(1))?;
    for _ in 0..4 {
        p.forward(gpu, &[(d, 1)])?;
    }
    // The device's running totals (added up by `tally` after every diff) against the
    // per-step counts read above.
    let (totals, early) = (
        p.dev.totals(gpu).map_err(err)?,
        p.dev.prefetch_totals().map_err(err)?,
    );
    if (totals.hits, totals.misses, early.loaded_pages) != (p.hits, p.misses, p.early) {
        p.failed += 1;
        println!(
            "FAIL coordinator totals: hits {} / {}, misses {} / {}, loaded early {} / {}",
            totals.hits, p.hits, totals.misses, p.misses, early.loaded_pages, p.early
        );
    }
    p.compared += 1;
    println!(
        "{} coordinator, CPU hooks against device hooks ({}, pages of {page_size}{}{}): {} \
         layer steps compared, {} failed; device {} hits, {} misses{}",
        if p.failed == 0 { "ok  " } else { "FAIL" },
        if shared_heads {
            "one selection shared by the KV heads"
        } else {
            "a selection per KV head"
        },
        if prefetch { ", prefetch" } else { "" },
        if summary == Summary::E4m3 {
            ", E4M3 summaries"
        } else {
            ""
        },
        p.compared,
        p.failed,
        p.hits,
        p.misses,
        if prefetch {
            format!(", {} pages loaded early", p.early)
        } else {
            String::new()
        }
    );
    Ok(p.failed)
}

impl Pair {
    fn begin(&mut self, id: RequestId, len: usize) -> Res<()> {
        for co in [&mut self.cpu, &mut self.gco] {
            co.on_request_begin(id, len).map_err(err)?;
        }
        Ok(())
    }

    /// One forward through both coordinators, comparing every sparse layer's step.
    fn forward(&mut self, gpu: &Gpu, batch: &[(RequestId, usize)]) -> Res<()> {
        self.forward_until(gpu, batch, None)
    }

    /// [`forward`](Self::forward), abandoned on both sides after layer `stop`'s
    /// `attention_begin` when `stop` is set, as an engine whose model failed there would.
    /// Both must end the sparse-mode requests a sparse layer reached: on the CPU the decode
    /// rows a begun sparse layer stepped; on the device those and the batch's prefilling
    /// requests too, whose new tokens its `attention_begin_device` backs up. The CPU then ends
    /// the prefilling ones as well, so the two stay in step.
    fn forward_until(
        &mut self,
        gpu: &Gpu,
        batch: &[(RequestId, usize)],
        stop: Option<usize>,
    ) -> Res<()> {
        let tokens: usize = batch.iter().map(|b| b.1).sum();
        let (qs, kvs) = (
            MODEL.q_heads * MODEL.head_dim,
            MODEL.kv_heads * MODEL.head_dim,
        );
        self.cpu.forward_begin(batch).map_err(err)?;
        self.gco.forward_begin(batch).map_err(err)?;
        let params = AttnParams::new(MODEL.q_heads, MODEL.head_dim);
        // The CPU's prefetches of the layers ahead, each compared once the device's has run
        // under the layer before.
        let mut early: Vec<(usize, StepStats)> = Vec::new();
        for layer in 0..MODEL.layers {
            let next = layer + 1;
            if self.gco.wants_prefetch(next) != self.cpu.wants_prefetch(next) {
                self.failed += 1;
                println!("FAIL coordinator layer {next}: the two want prefetch differently");
            }
            // No prefetch for a layer an abandoned forward never reaches.
            if self.gco.wants_prefetch(next) && stop.is_none_or(|s| next <= s) {
                // An estimate of the next layer's queries: its query direction, other noise.
                let qb: Vec<bf16> = (0..tokens * qs)
                    .map(|i| bf16::from_f32(self.base_q[next][i % qs] + 0.3 * self.rng.unit()))
                    .collect();
                let qf: Vec<f32> = qb.iter().map(|x| x.to_f32()).collect();
                let want = self.cpu.prefetch(next, &qf).map_err(err)?;
                let q_dev = gpu.upload(&qb).map_err(err)?;
                self.gco
                    .prefetch_device(gpu, &mut self.dev, next, q_dev)
                    .map_err(err)?;
                early.push((next, want));
            }
            // Queries exact in bf16, so the CPU's f32 scores see what the device's bf16 do.
            let qb: Vec<bf16> = (0..tokens * qs)
                .map(|i| bf16::from_f32(self.base_q[layer][i % qs] + 0.3 * self.rng.unit()))
                .collect();
            let qf: Vec<f32> = qb.iter().map(|x| x.to_f32()).collect();
            let k: Vec<bf16> = (0..tokens * kvs)
                .map(|_| bf16::from_f32(self.rng.unit()))
                .collect();
            let v: Vec<bf16> = (0..tokens * kvs)
                .map(|_| bf16::from_f32(self.rng.unit()))
                .collect();
            let want = self.cpu.attention_begin(layer, &qf, &k, &v).map_err(err)?;
            let q_dev = gpu.upload(&qb).map_err(err)?;
            let (k_dev, v_dev) = (gpu.upload(&k).map_err(err)?, gpu.upload(&v).map_err(err)?);
            let got = self
                .gco
                .attention_begin_device(gpu, &mut self.dev, layer, &q_dev, &k_dev, &v_dev)
                .map_err(err)?;
            if let Some(at) = early.iter().position(|(l, _)| *l == layer) {
                let (_, want) = early.swap_remove(at);
                let st = self.dev.prefetch_stats(&self.gco, layer).map_err(err)?;
                self.early += st.loaded_pages;
                self.compared += 1;
                if (st.hits, st.misses, st.loaded_pages, st.bytes)
                    != (want.hits, want.misses, want.loaded_pages, want.bytes)
                {
                    self.failed += 1;
                    println!(
                        "FAIL coordinator layer {layer} prefetch: hits {} / {}, loaded {} / {}",
                        st.hits, want.hits, st.loaded_pages, want.loaded_pages
                    );
                }
            }
            if let Some(meta) = &want.meta {
                let n = meta.num_seqs();
                let mut ok = got.routes == want.routes && got.rows == n;
                // The CPU attends over its device pool with the sparse rows' queries.
                let mut q_rows = vec![bf16::ZERO; n * qs];
                let mut offsets = Vec::with_capacity(batch.len());
                let mut at = 0;
                for b in batch {
                    offsets.push(at);
                    at += b.1;
                }
                for (i, r) in want.routes.iter().enumerate() {
                    if let Route::Sparse(j) = *r {
                        let src = offsets[i] * qs;
                        q_rows[j * qs..(j + 1) * qs].copy_from_slice(&qb[src..src + qs]);
                    }
                }
                let mut out = vec![0f32; n * qs];
                let pool = self.cpu.device(layer).ok_or("a sparse layer has a pool")?;
                meta.attend(
                    &q_rows,
                    &pool.read(),
                    &params,
                    AttnOut {
                        out: &mut out,
                        lse: None,
                    },
                )
                .map_err(err)?;
                let mut out_dev = gpu.zeros::<f32>(n * qs).map_err(err)?;
                self.dev
                    .attend(gpu, &self.gco, layer, &q_dev, &params, &mut out_dev)
                    .map_err(err)?;
                let got_out = gpu.download(&out_dev).map_err(err)?;
                let scale = out.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
                let worst = got_out
                    .iter()
                    .zip(&out)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs() / scale));
                let sel = self.dev.selection(gpu, &self.gco, layer).map_err(err)?;
                let top = want
                    .selection
                    .as_ref()
                    .ok_or("a sparse plan has a selection")?;
                // Rows per sparse row: 1 (head-shared) or one per KV head.
                let per = sel.len() / n.max(1);
                let same_sel = per * n == sel.len()
                    && (0..n * per).all(|i| sel[i].as_slice() == top.row(i / per, i % per));
                let stats = self.dev.stats(gpu, &self.gco, layer).map_err(err)?;
                let same_stats = stats.hits == want.stats.hits && stats.misses == want.stats.misses;
                self.hits += stats.hits;
                self.misses += stats.misses;
                ok &= same_sel && same_stats && worst <= 1e-2;
                self.compared += 1;
                if !ok {
                    self.failed += 1;
                    println!(
                        "FAIL coordinator layer {layer}, {n} sparse rows: routes {:?} / {:?}, \
                         selections equal {same_sel}, hits {} / {}, misses {} / {}, attention \
                         max rel err {worst:.2e}",
                        got.routes,
                        want.routes,
                        stats.hits,
                        want.stats.hits,
                        stats.misses,
                        want.stats.misses
                    );
                }
            } else if got.rows != 0 || got.routes != want.routes {
                self.failed += 1;
                self.compared += 1;
                println!("FAIL coordinator layer {layer}: the device planned sparse rows");
            }
            if stop == Some(layer) {
                return self.abort(batch, layer);
            }
            self.cpu.attention_end(layer, &k, &v).map_err(err)?;
            self.gco
                .attention_end_device(gpu, &mut self.dev, layer)
                .map_err(err)?;
        }
        self.cpu.forward_end().map_err(err)?;
        self.gco.forward_end().map_err(err)?;
        Ok(())
    }

    /// Abandons the forward over `batch` on both sides, in layer `layer` after its
    /// `attention_begin`, and compares the requests each ended (see
    /// [`forward_until`](Self::forward_until)).
    fn abort(&mut self, batch: &[(RequestId, usize)], layer: usize) -> Res<()> {
        let sparse = self.cpu.lowered().layers[layer].is_some();
        let phase = |co: &SparseCoordinator<bf16>, id| co.tracker(id).map(|t| t.phase);
        let prefilling: Vec<RequestId> = batch
            .iter()
            .map(|&(id, _)| id)
            .filter(|&id| phase(&self.cpu, id) == Some(coordinator::Phase::Prefill))
            .collect();
        let decoding: Vec<RequestId> = batch
            .iter()
            .map(|&(id, _)| id)
            .filter(|id| !prefilling.contains(id))
            .collect();
        let cpu = self.cpu.abort_forward().map_err(err)?;
        let dev = self.gco.abort_forward().map_err(err)?;
        let (want_cpu, want_dev): (Vec<RequestId>, Vec<RequestId>) = if sparse {
            let all = batch.iter().map(|&(id, _)| id).collect();
            (decoding, all)
        } else {
            (Vec::new(), Vec::new())
        };
        self.compared += 1;
        if cpu != want_cpu || dev != want_dev {
            self.failed += 1;
            println!(
                "FAIL coordinator abandoned in layer {layer}: the CPU ended {cpu:?} (want \
                 {want_cpu:?}), the device {dev:?} (want {want_dev:?})"
            );
        }
        for id in dev.iter().filter(|id| !cpu.contains(id)) {
            self.cpu.on_request_end(*id).map_err(err)?;
        }
        Ok(())
    }
}
