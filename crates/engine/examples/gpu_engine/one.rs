//! One request of the real model on the GPU, dense or with hierarchical sparse attention
//! through the coordinator's device hooks: the runs behind `fidelity` and `passkey`. The
//! prompt is prefilled densely over the engine's device cache (a sparse request's
//! coordinator backs it up to its host pool meanwhile), then every token is one decode
//! forward, sparse in the sparse layers.

use attn_op::AttnParams;
use attn_op::cuda::DevicePagedKv;
use coordinator::SparseConfig;
use coordinator::SparseCoordinator;
use coordinator::cuda::DeviceSparse;
use engine::gpu::{GpuDenseAttention, GpuModel};
use engine::gpu_sparse::GpuSparseAttention;
use engine::{Batch, ModelConfig};
use half::f16;
use kv_blocks::RequestId;

use crate::{BLOCK, Res};

/// The request's id in its coordinator.
const ID: RequestId = RequestId(1);

/// One request: its dense cache and, when sparse, its coordinator and device mirror.
pub(crate) struct OneRequest<'m> {
    gm: &'m GpuModel<f16>,
    config: ModelConfig,
    blocks: usize,
    /// The engine's device cache (`None` only while a forward holds it).
    kv: Option<Vec<DevicePagedKv<f16>>>,
    sparse: Option<Sparse>,
    /// Tokens in the cache.
    pos: usize,
}

/// A sparse request's coordinator, its device mirror, and the hot-buffer counts of its
/// decode steps.
struct Sparse {
    coord: SparseCoordinator<f16>,
    dev: DeviceSparse<f16>,
    layers: Vec<usize>,
    hits: u64,
    misses: u64,
}

impl<'m> OneRequest<'m> {
    /// A request of up to `max_tokens` tokens whose prompt has `prompt_len`: dense without
    /// `sparse`, else through a coordinator of that configuration (its host layout set to
    /// layer-first, as the device path takes).
    pub(crate) fn new(
        gm: &'m GpuModel<f16>,
        config: ModelConfig,
        max_tokens: usize,
        prompt_len: usize,
        sparse: Option<&SparseConfig>,
    ) -> Res<Self> {
        let blocks = max_tokens.div_ceil(BLOCK);
        let kv = GpuDenseAttention::<f16>::cache(gm.gpu(), &config, blocks, BLOCK)
            .map_err(|e| e.to_string())?;
        let sparse = match sparse {
            Some(s) => {
                let s = SparseConfig {
                    host_layout: offload::HostLayout::LayerFirst,
                    ..s.clone()
                };
                let coord = engine::single_request::<f16>(&config, &s, ID, max_tokens, prompt_len)
                    .map_err(|e| e.to_string())?;
                let dev = DeviceSparse::new(gm.gpu(), &coord).map_err(|e| e.to_string())?;
                let layers = (0..config.layers)
                    .filter(|l| !s.dense_layers.contains(l))
                    .collect();
                Some(Sparse {
                    coord,
                    dev,
                    layers,
                    hits: 0,
                    misses: 0,
                })
            }
            None => None,
        };
        Ok(OneRequest {
            gm,
            config,
            blocks,
            kv: Some(kv),
            sparse,
            pos: 0,
        })
    }

    /// Prefills `prompt` (it must be the whole prompt, first), answering its last token's
    /// logits.
    pub(crate) fn prefill(&mut self, prompt: &[u32]) -> Res<Vec<f32>> {
        if self.pos != 0 || prompt.is_empty() {
            return Err("a prefill comes first, with at least one token".to_owned());
        }
        self.forward(prompt, false)
    }

    /// One decode forward of `token` at the next position, answering its logits.
    pub(crate) fn step(&mut self, token: u32) -> Res<Vec<f32>> {
        self.forward(&[token], true)
    }

    /// The share of the sparse decode steps' selected pages that missed the hot buffer
    /// (`None` for a dense request).
    pub(crate) fn miss_rate(&self) -> Option<f64> {
        self.sparse
            .as_ref()
            .map(|s| s.misses as f64 / (s.hits + s.misses).max(1) as f64)
    }

    /// A forward of `tokens` at the next positions, the last one's logits; `decode` counts
    /// the sparse layers' hits and misses after it.
    fn forward(&mut self, tokens: &[u32], decode: bool) -> Res<Vec<f32>> {
        let s = |e: engine::EngineError| e.to_string();
        let e = |e: coordinator::CoordError| e.to_string();
        let (start, end) = (self.pos, self.pos + tokens.len());
        let positions: Vec<usize> = (start..end).collect();
        let batch = Batch::single(start, end, self.blocks);
        let kv = self.kv.take().ok_or("the cache is held by a forward")?;
        let dense =
            GpuDenseAttention::new(self.gm.gpu(), &self.config, kv, &batch.meta(), &batch.slots)
                .map_err(s)?;
        let last = [tokens.len() - 1];
        let logits = match self.sparse.as_mut() {
            None => {
                let mut att = dense;
                let logits = self
                    .gm
                    .forward(tokens, &positions, &mut att, &last)
                    .map_err(s)?;
                self.kv = Some(att.kv);
                logits
            }
            Some(sp) => {
                sp.coord.forward_begin(&[(ID, tokens.len())]).map_err(e)?;
                let mut att = GpuSparseAttention {
                    coord: &mut sp.coord,
                    dev: &mut sp.dev,
                    params: AttnParams::new(self.config.q_heads, self.config.head_dim),
                    dense: Some(dense),
                };
                let logits = self
                    .gm
                    .forward(tokens, &positions, &mut att, &last)
                    .map_err(s)?;
                self.kv = Some(
                    att.dense
                        .take()
                        .ok_or("the dense attention is still there")?
                        .kv,
                );
                sp.coord.forward_end().map_err(e)?;
                if decode {
                    for &l in &sp.layers {
                        let st = sp.dev.stats(self.gm.gpu(), &sp.coord, l).map_err(e)?;
                        sp.hits += st.hits;
                        sp.misses += st.misses;
                    }
                }
                logits
            }
        };
        self.pos = end;
        Ok(logits)
    }
}
