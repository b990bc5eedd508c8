//! One request on the GPU end to end (feature `cuda`). [`GpuRequest`] prefills its prompt
//! densely over the engine's device cache; a sparse request's coordinator backs the prompt
//! up to its pinned host pool meanwhile. After that, every token is one forward, sparse in the
//! sparse layers through the coordinator's device hooks ([`GpuSparseAttention`]).
//! [`generate_gpu`] is the CPU's [`generate`](fn@crate::generate) on it.

use std::time::Instant;

use attn_op::AttnParams;
use attn_op::cuda::DevicePagedKv;
use coordinator::cuda::DeviceSparse;
use coordinator::{Mode, SparseConfig, SparseCoordinator};
use kv_blocks::RequestId;
use offload::{HostLayout, StepStats};

use crate::generate::{GenerateStats, sample_loop, start};
use crate::gpu::{GpuDenseAttention, GpuFloat, GpuModel};
use crate::gpu_sparse::GpuSparseAttention;
use crate::sample::Sampling;
use crate::{Batch, EngineError, Tokenizer, single_request};

/// The request's id in its coordinator.
const ID: RequestId = RequestId(1);
/// Tokens per block of the engine's device cache.
const BLOCK: usize = 16;

/// One request of a [`GpuModel`]: its device KV cache and, when sparse, its coordinator and
/// device mirror.
pub struct GpuRequest<'m, T: GpuFloat> {
    model: &'m GpuModel<T>,
    blocks: usize,
    /// The engine's device cache (`None` only while a forward holds it).
    kv: Option<Vec<DevicePagedKv<T>>>,
    sparse: Option<Sparse<T>>,
    /// Tokens in the cache.
    len: usize,
    max_tokens: usize,
}

/// A sparse request's coordinator, its device mirror, and what its decode steps moved.
struct Sparse<T: GpuFloat> {
    coord: SparseCoordinator<T>,
    dev: DeviceSparse<T>,
    stats: StepStats,
    /// What prefetches loaded ahead of the steps.
    prefetched: StepStats,
}

impl<'m, T: GpuFloat> GpuRequest<'m, T> {
    /// A request of up to `max_tokens` tokens whose prompt has `prompt_len`: dense without
    /// `sparse`, else through a coordinator of that configuration (its host layout set to
    /// layer-first, the one the device path takes). A prompt shorter than the
    /// configuration's sparse threshold stays dense ([`is_sparse`](Self::is_sparse)).
    pub fn new(
        model: &'m GpuModel<T>,
        max_tokens: usize,
        prompt_len: usize,
        sparse: Option<&SparseConfig>,
    ) -> Result<Self, EngineError> {
        let c = model.config;
        if prompt_len == 0 || prompt_len > max_tokens {
            return Err(EngineError::Invalid(format!(
                "a prompt of {prompt_len} tokens in a request of {max_tokens}"
            )));
        }
        let blocks = max_tokens.div_ceil(BLOCK);
        let kv = GpuDenseAttention::<T>::cache(model.gpu(), &c, blocks, BLOCK)?;
        let sparse = match sparse {
            Some(s) => {
                let s = SparseConfig {
                    host_layout: HostLayout::LayerFirst,
                    ..s.clone()
                };
                let coord = single_request::<T>(&c, &s, ID, max_tokens, prompt_len)?;
                let dev = DeviceSparse::new(model.gpu(), &coord)?;
                Some(Sparse {
                    coord,
                    dev,
                    stats: StepStats::default(),
                    prefetched: StepStats::default(),
                })
            }
            None => None,
        };
        Ok(GpuRequest {
            model,
            blocks,
            kv: Some(kv),
            sparse,
            len: 0,
            max_tokens,
        })
    }

    /// Whether the request runs in sparse mode (a sparse configuration, and a prompt long
    /// enough for it).
    pub fn is_sparse(&self) -> bool {
        self.sparse
            .as_ref()
            .and_then(|s| s.coord.tracker(ID))
            .is_some_and(|t| t.mode == Mode::Sparse)
    }

    /// What prefetches loaded ahead of the decode steps (zero unless the sparse
    /// configuration prefetches): these loads are not in [`stats`](Self::stats), whose steps
    /// found them as hits.
    pub fn prefetched(&self) -> StepStats {
        self.sparse
            .as_ref()
            .map(|s| s.prefetched)
            .unwrap_or_default()
    }

    /// Tokens in the request's cache.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing has been run yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Hot-buffer hits, misses and bytes of the sparse decode steps so far (zero for a
    /// dense request).
    pub fn stats(&self) -> StepStats {
        self.sparse.as_ref().map(|s| s.stats).unwrap_or_default()
    }

    /// A forward of `tokens` at the next positions, answering the last one's logits: first
    /// the whole prompt, then one token at a time.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        let (start, end) = (self.len, self.len + tokens.len());
        if tokens.is_empty() || end > self.max_tokens {
            return Err(EngineError::Invalid(format!(
                "a forward of {} tokens after {start} in a request of {}",
                tokens.len(),
                self.max_tokens
            )));
        }
        let c = self.model.config;
        let positions: Vec<usize> = (start..end).collect();
        let batch = Batch::single(start, end, self.blocks);
        let kv = self
            .kv
            .take()
            .ok_or_else(|| EngineError::Invalid("the cache is held by a forward".into()))?;
        let dense = GpuDenseAttention::new(self.model.gpu(), &c, kv, &batch.meta(), &batch.slots)?;
        let last = [tokens.len() - 1];
        let sparse_mode = self.is_sparse();
        let logits = match self.sparse.as_mut() {
            None => {
                let mut att = dense;
                let logits = self.model.forward(tokens, &positions, &mut att, &last);
                self.kv = Some(att.kv);
                logits?
            }
            Some(sp) => {
                sp.coord.forward_begin(&[(ID, tokens.len())])?;
                let mut att = GpuSparseAttention::new(
                    &mut sp.coord,
                    &mut sp.dev,
                    AttnParams::new(c.q_heads, c.head_dim),
                    Some(dense),
                );
                let logits = self.model.forward(tokens, &positions, &mut att, &last);
                self.kv = att.dense.take().map(|d| d.kv);
                let logits = logits?;
                sp.coord.forward_end()?;
                // A decode step of a sparse-mode request ran the hooks in every sparse layer:
                // the device's running totals, read once (a selection that did not fit its
                // hot buffer is an error here).
                if sparse_mode && start > 0 {
                    sp.stats = sp.dev.totals(self.model.gpu())?;
                    sp.prefetched = sp.dev.prefetch_totals()?;
                }
                logits
            }
        };
        if self.kv.is_none() {
            return Err(EngineError::Invalid(
                "the forward did not give the cache back".into(),
            ));
        }
        self.len = end;
        Ok(logits)
    }
}

/// [`generate`](fn@crate::generate) on the GPU: `prompt` prefilled in one forward (`progress`
/// told when it is done), then sampled with `sampling`, the text streamed to `on_text`;
/// `sparse` routes attention through a sparse coordinator's device hooks.
pub fn generate_gpu<T: GpuFloat>(
    model: &GpuModel<T>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    sampling: &Sampling,
    sparse: Option<&SparseConfig>,
    on_text: impl FnMut(&str),
    mut progress: impl FnMut(usize, usize),
) -> Result<(Vec<u32>, GenerateStats), EngineError> {
    let mut sampler = start(&model.config, prompt, sampling)?;
    let mut req = GpuRequest::new(
        model,
        prompt.len() + sampling.max_tokens,
        prompt.len(),
        sparse,
    )?;
    let t0 = Instant::now();
    let logits = req.forward(prompt)?;
    progress(prompt.len(), prompt.len());
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let out = sample_loop(tokenizer, sampling, &mut sampler, logits, on_text, |tok| {
        req.forward(&[tok])
    })?;
    let stats = GenerateStats {
        prompt_tokens: prompt.len(),
        generated: out.len(),
        prefill_s,
        decode_s: t1.elapsed().as_secs_f64(),
        sparse: req.is_sparse(),
        stats: req.stats(),
    };
    Ok((out, stats))
}
