//! The Llama forward on the GPU (feature `cuda`): the CPU [`Model`]'s weights dequantized to
//! f16 or bf16 on the device ([`GpuFloat`]), or a synthetic model's random weights made there,
//! every projection a cuBLAS GEMM (inputs of the weights' type, f32 accumulation and output),
//! the small kernels of `kernels/model.cu` (embedding, RMSNorm, RoPE, SwiGLU), and attention
//! behind [`GpuAttention`] (attn-op's device kernels).
//!
//! f16 is the type for a real model: a Q4_1 weight (an f16 scale times a 4-bit integer plus an
//! f16 offset) keeps 11 significant bits in f16 and 8 in bf16, and on SmolLM2-135M the CPU
//! forward with its weights rounded to bf16 alone differs from the exact one by 1.9e-2 (largest
//! logit difference over the largest logit), against 2.1e-3 for f16. [`Model::computing_in`]
//! is this forward's CPU specification (the same roundings); two such CPU forwards in bf16 that
//! differ only in the order of the attention's f32 sums already lie about 2.5e-2 apart on this
//! model (the `precision` example), against 3e-3 in f16: the noise floor a GPU forward of the
//! type meets.
//!
//! The residual stream stays f32 on the device; the output and down projections add into it
//! through the GEMM's `beta`, so no separate residual kernel runs. Q, K and V come out of one
//! fused GEMM, gate and up out of another. Every launch is enqueued on the [`Gpu`]'s stream;
//! only the logits come back.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use attn_op::cuda::CudaElement;
use attn_op::cuda::{Gpu, compile_source};
use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use half::{bf16, f16};

use crate::linear::Linear;
use crate::{EngineError, Model, ModelConfig};

mod dense;

pub use dense::GpuDenseAttention;

/// The CUDA C source of the forward's small kernels, embedded at build time.
pub const MODEL_KERNELS: &str = include_str!("../../../../kernels/model.cu");

/// Opens CUDA device `ordinal` the way the engine runs on it: attn-op's [`Gpu`] with cudarc's
/// per-buffer event tracking turned off for its context. The engine orders its streams itself:
/// the coordinator's prefetch lane starts after an event recorded on the compute stream, and
/// the compute stream waits for the lane's event before it touches that layer's buffers or
/// frees the prefetch's; [`GpuModel::fork`] waits for the weights before another stream reads
/// them. With tracking on, once a second stream exists, cudarc records and waits on an event
/// for every buffer argument of every launch: driver calls that the host, which bounds a small
/// model's decode step, pays on every layer.
pub fn open_gpu(ordinal: usize) -> Result<Gpu, EngineError> {
    let gpu = Gpu::new(ordinal)?;
    // SAFETY: every buffer the engine shares between streams is ordered by explicit events
    // (above); nothing was allocated on this context before, so no buffer keeps tracking.
    unsafe { gpu.context().disable_event_tracking() };
    Ok(gpu)
}

/// The element type of a GPU forward: its weights', GEMM inputs' and KV cache's.
pub trait GpuFloat: CudaElement {
    /// cuBLAS's name of the type.
    const BLAS: blas_sys::cudaDataType_t;
}

impl GpuFloat for f16 {
    const BLAS: blas_sys::cudaDataType_t = blas_sys::cudaDataType_t::CUDA_R_16F;
}

impl GpuFloat for bf16 {
    const BLAS: blas_sys::cudaDataType_t = blas_sys::cudaDataType_t::CUDA_R_16BF;
}

/// Where a GPU forward's attention runs: dense over the engine's device cache
/// ([`GpuDenseAttention`]), through the sparse coordinator
/// ([`GpuSparseAttention`](crate::gpu_sparse::GpuSparseAttention)), or a test's.
pub trait GpuAttention<T: GpuFloat> {
    /// Layer `layer`'s attention for the batch's new tokens: `q` is `[tokens, q_heads,
    /// head_dim]`, `k` and `v` `[tokens, kv_heads, head_dim]` (RoPE applied), the result goes
    /// to `out`, `[tokens, q_heads, head_dim]`; all on `gpu`'s stream.
    fn attend(
        &mut self,
        gpu: &Gpu,
        layer: usize,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), EngineError>;

    /// At the start of layer `layer`, before it computes: the later layer whose queries this
    /// attention would like estimated from `layer`'s input (for a prefetch of its pages),
    /// if any. None by default.
    fn early_query(&self, layer: usize) -> Option<usize> {
        let _ = layer;
        None
    }

    /// Takes the estimate [`early_query`](Self::early_query) asked for: layer `target`'s
    /// queries `[tokens, q_heads, head_dim]` from an earlier layer's input
    /// (its RMSNorm, query projection and RoPE, as [`Model::query`] computes them),
    /// enqueued on `gpu`'s stream. Dropped by default.
    fn early(&mut self, gpu: &Gpu, target: usize, q: CudaSlice<T>) -> Result<(), EngineError> {
        let _ = (gpu, target, q);
        Ok(())
    }
}

/// A model's weights on the device, as `T`, and the means to run its forward there.
pub struct GpuModel<T: GpuFloat> {
    /// Its shape.
    pub config: ModelConfig,
    gpu: Gpu,
    blas: CudaBlas,
    kernels: Kernels,
    /// Shared by the model's forks ([`GpuModel::fork`]), never written after they are made.
    w: Arc<Weights<T>>,
    /// The intermediate buffers of the last forward's batch size, reused while it repeats
    /// (every decode step of a fixed batch).
    buffers: Mutex<Option<Buffers<T>>>,
}

/// A forward's intermediate buffers for `n` token rows: the residual stream, the normalized
/// rows, the fused projections' outputs, the rotated Q/K/V, attention's output and SwiGLU's.
/// Every launch writes its buffer whole before it is read, so reuse needs no clearing.
struct Buffers<T> {
    n: usize,
    /// The row indices `0..n` (RMSNorm over every row).
    all: CudaSlice<i32>,
    x: CudaSlice<f32>,
    h: CudaSlice<T>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    att: CudaSlice<f32>,
    att16: CudaSlice<T>,
    gu: CudaSlice<f32>,
    act: CudaSlice<T>,
}

impl<T: GpuFloat> Buffers<T> {
    fn new(g: &Gpu, c: &ModelConfig, n: usize) -> Result<Self, EngineError> {
        let (qd, kvd) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let all = (0..n)
            .map(|r| i32::try_from(r).map_err(device))
            .collect::<Result<Vec<i32>, _>>()?;
        Ok(Buffers {
            n,
            all: g.upload(&all)?,
            x: g.zeros(n * c.embed)?,
            h: g.zeros(n * c.embed)?,
            qkv: g.zeros(n * (qd + 2 * kvd))?,
            q: g.zeros(n * qd)?,
            k: g.zeros(n * kvd)?,
            v: g.zeros(n * kvd)?,
            att: g.zeros(n * qd)?,
            att16: g.zeros(n * qd)?,
            gu: g.zeros(n * 2 * c.ffn)?,
            act: g.zeros(n * c.ffn)?,
        })
    }
}

/// A model's weights on the device.
struct Weights<T> {
    embed: CudaSlice<T>,
    /// `None`: tied to the embedding.
    output: Option<CudaSlice<T>>,
    output_norm: CudaSlice<f32>,
    blocks: Vec<DeviceBlock<T>>,
    freqs: CudaSlice<f32>,
}

/// One transformer block's weights on the device.
struct DeviceBlock<T> {
    attn_norm: CudaSlice<f32>,
    /// Q, K and V stacked: `[(q_heads + 2 kv_heads) head_dim, embed]`.
    qkv: CudaSlice<T>,
    wo: CudaSlice<T>,
    ffn_norm: CudaSlice<f32>,
    /// Gate and up stacked: `[2 ffn, embed]`.
    gate_up: CudaSlice<T>,
    down: CudaSlice<T>,
}

/// The kernels of [`MODEL_KERNELS`] for one element type.
#[derive(Clone)]
struct Kernels {
    embed_rows: CudaFunction,
    rms_norm_rows: CudaFunction,
    rope_split: CudaFunction,
    swiglu: CudaFunction,
    narrow: CudaFunction,
    fill_uniform: CudaFunction,
    /// `argmax_rows`, the same for both types.
    argmax: CudaFunction,
}

impl Kernels {
    /// Compiles [`MODEL_KERNELS`] for `gpu` and loads the instances of `T`.
    fn load<T: GpuFloat>(gpu: &Gpu) -> Result<Kernels, EngineError> {
        let ptx = compile_source("kernels/model.cu", MODEL_KERNELS, gpu.arch())?;
        let module = gpu.context().load_module(ptx).map_err(device)?;
        let f = |name: &str| {
            module
                .load_function(&format!("{name}_{}", T::KERNEL))
                .map_err(device)
        };
        Ok(Kernels {
            embed_rows: f("embed_rows")?,
            rms_norm_rows: f("rms_norm_rows")?,
            rope_split: f("rope_split")?,
            swiglu: f("swiglu")?,
            narrow: f("narrow")?,
            fill_uniform: f("fill_uniform")?,
            argmax: module.load_function("argmax_rows").map_err(device)?,
        })
    }
}

/// Threads of a row-wise kernel's block (`ROW_THREADS` in kernels/model.cu).
const ROW_THREADS: u32 = 256;

/// A buffer of `len` elements on `gpu`'s stream, allocated without the memset that
/// `Gpu::zeros` enqueues: for a forward's per-call outputs, which its next launch writes whole.
///
/// # Safety
///
/// The caller writes every element before anything reads it.
unsafe fn unwritten<U: DeviceRepr>(gpu: &Gpu, len: usize) -> Result<CudaSlice<U>, EngineError> {
    // SAFETY: the contents are unspecified until written, which the caller does first.
    unsafe { gpu.stream().alloc::<U>(len) }.map_err(device)
}

fn device(e: impl std::fmt::Debug) -> EngineError {
    EngineError::Attn(attn_op::AttnError::Device(format!("{e:?}")))
}

/// A launch of one thread per element of `n`, in blocks of 256.
fn flat(n: usize) -> Result<LaunchConfig, EngineError> {
    Ok(LaunchConfig {
        grid_dim: (u32::try_from(n.div_ceil(256)).map_err(device)?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `out = T(uniform in [-scale, scale))` from `seed` (kernel `fill_uniform`).
fn fill<T: GpuFloat>(
    gpu: &Gpu,
    k: &Kernels,
    out: &mut CudaSlice<T>,
    seed: u64,
    scale: f32,
) -> Result<(), EngineError> {
    let len = out.len() as u64;
    let blocks = u32::try_from(out.len().div_ceil(256).min(1 << 16)).map_err(device)?;
    let mut b = gpu.stream().launch_builder(&k.fill_uniform);
    b.arg(out).arg(&len).arg(&seed).arg(&scale);
    // SAFETY: fill_uniform(out [len], len, seed, scale): a grid-stride loop over len elements.
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (blocks.max(1), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .map_err(device)?;
    Ok(())
}

/// A launch of one block of [`ROW_THREADS`] per row of `rows`.
fn per_row(rows: usize) -> Result<LaunchConfig, EngineError> {
    Ok(LaunchConfig {
        grid_dim: (u32::try_from(rows).map_err(device)?, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn int(x: usize) -> Result<i32, EngineError> {
    i32::try_from(x).map_err(device)
}

impl<T: GpuFloat> GpuModel<T> {
    /// Uploads `model`'s weights to `gpu` as `T` (norms and RoPE frequencies stay f32) and
    /// compiles the forward's kernels.
    pub fn upload(model: &Model, gpu: Gpu) -> Result<GpuModel<T>, EngineError> {
        let kernels = Kernels::load::<T>(&gpu)?;
        let blas = CudaBlas::new(gpu.stream().clone()).map_err(device)?;
        let up = |parts: &[&Linear]| -> Result<CudaSlice<T>, EngineError> {
            let host: Vec<T> = parts
                .iter()
                .flat_map(|l| l.to_f32())
                .map(T::from_f32)
                .collect();
            Ok(gpu.upload(&host)?)
        };
        let mut blocks = Vec::with_capacity(model.blocks.len());
        for b in &model.blocks {
            blocks.push(DeviceBlock {
                attn_norm: gpu.upload(&b.attn_norm)?,
                qkv: up(&[&b.wq, &b.wk, &b.wv])?,
                wo: up(&[&b.wo])?,
                ffn_norm: gpu.upload(&b.ffn_norm)?,
                gate_up: up(&[&b.gate, &b.up])?,
                down: up(&[&b.down])?,
            });
        }
        Ok(GpuModel {
            config: model.config,
            w: Arc::new(Weights {
                embed: up(&[&model.embed])?,
                output: model.output.as_ref().map(|o| up(&[o])).transpose()?,
                output_norm: gpu.upload(&model.output_norm)?,
                freqs: gpu.upload(&model.freqs)?,
                blocks,
            }),
            kernels,
            blas,
            gpu,
            buffers: Mutex::new(None),
        })
    }

    /// A model of shape `config` with random weights made on `gpu` from `seed`: every block's
    /// matrix uniform with the variance `1 / cols` (activations keep their scale through the
    /// layers), the embedding and a separate output head uniform in `[-1, 1)`, norms 1. For
    /// capacity and throughput runs at shapes no real model here has; its text is noise.
    pub fn synthetic(config: ModelConfig, gpu: Gpu, seed: u64) -> Result<GpuModel<T>, EngineError> {
        let c = config.checked()?;
        let kernels = Kernels::load::<T>(&gpu)?;
        let blas = CudaBlas::new(gpu.stream().clone()).map_err(device)?;
        let mut next = seed;
        // Uniform in [-a, a) has the variance a² / 3: a = sqrt(3 / cols) gives 1 / cols.
        let mut matrix = |rows: usize, cols: usize, a: f32| -> Result<CudaSlice<T>, EngineError> {
            let mut m = gpu.zeros::<T>(rows * cols)?;
            next = next.wrapping_add(0x9E37_79B9_7F4A_7C15);
            fill(&gpu, &kernels, &mut m, next, a)?;
            Ok(m)
        };
        let unit = |cols: usize| (3.0 / cols as f32).sqrt();
        let (qd, kvd) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let ones = vec![1.0f32; c.embed];
        let mut blocks = Vec::with_capacity(c.layers);
        for _ in 0..c.layers {
            blocks.push(DeviceBlock {
                attn_norm: gpu.upload(&ones)?,
                qkv: matrix(qd + 2 * kvd, c.embed, unit(c.embed))?,
                wo: matrix(c.embed, qd, unit(qd))?,
                ffn_norm: gpu.upload(&ones)?,
                gate_up: matrix(2 * c.ffn, c.embed, unit(c.embed))?,
                down: matrix(c.embed, c.ffn, unit(c.ffn))?,
            });
        }
        Ok(GpuModel {
            w: Arc::new(Weights {
                embed: matrix(c.vocab, c.embed, 1.0)?,
                output: Some(matrix(c.vocab, c.embed, 1.0)?),
                output_norm: gpu.upload(&ones)?,
                freqs: gpu.upload(&c.rope_freqs())?,
                blocks,
            }),
            config: c,
            kernels,
            blas,
            gpu,
            buffers: Mutex::new(None),
        })
    }

    /// Another handle on the same weights whose forwards run on `gpu`, a
    /// [`fork`](Gpu::fork) of this model's device: two threads can run forwards on the two
    /// at once (each with its own buffers and cuBLAS handle), and the device overlaps them,
    /// for example one's host loads with the other's GEMMs. Waits for this model's stream
    /// first, so the weights are complete before another stream reads them.
    pub fn fork(&self, gpu: Gpu) -> Result<GpuModel<T>, EngineError> {
        if !Arc::ptr_eq(gpu.context(), self.gpu.context()) {
            return Err(EngineError::Invalid(
                "a model forked onto another device context".into(),
            ));
        }
        self.gpu.synchronize()?;
        Ok(GpuModel {
            config: self.config,
            blas: CudaBlas::new(gpu.stream().clone()).map_err(device)?,
            kernels: self.kernels.clone(),
            w: Arc::clone(&self.w),
            buffers: Mutex::new(None),
            gpu,
        })
    }

    /// The device the model lives on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Device bytes of the weights.
    pub fn weight_bytes(&self) -> usize {
        let b = |s: &CudaSlice<T>| s.len() * size_of::<T>();
        let f = |s: &CudaSlice<f32>| s.len() * 4;
        let blocks: usize = self
            .w
            .blocks
            .iter()
            .map(|d| {
                f(&d.attn_norm) + b(&d.qkv) + b(&d.wo) + f(&d.ffn_norm) + b(&d.gate_up) + b(&d.down)
            })
            .sum();
        blocks + b(&self.w.embed) + self.w.output.as_ref().map_or(0, b) + f(&self.w.output_norm)
    }

    /// [`Model::forward`] on the device: one forward over a batch's new tokens at their
    /// absolute `positions`, attention through `attn`; returns the logits `[logits_for.len(),
    /// vocab]` of the token rows in `logits_for`.
    pub fn forward(
        &self,
        tokens: &[u32],
        positions: &[usize],
        attn: &mut dyn GpuAttention<T>,
        logits_for: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        match self.logits(tokens, positions, attn, logits_for)? {
            Some(logits) => Ok(self.gpu.download(&logits)?),
            None => Ok(Vec::new()),
        }
    }

    /// [`forward`](Self::forward) with greedy sampling on the device: the arg-max token of each
    /// row of `logits_for` (the first of equal logits), without moving the logits to the host.
    pub fn forward_greedy(
        &self,
        tokens: &[u32],
        positions: &[usize],
        attn: &mut dyn GpuAttention<T>,
        logits_for: &[usize],
    ) -> Result<Vec<u32>, EngineError> {
        let Some(logits) = self.logits(tokens, positions, attn, logits_for)? else {
            return Ok(Vec::new());
        };
        let mut ids = self.gpu.zeros::<i32>(logits_for.len())?;
        let vocab = int(self.config.vocab)?;
        let mut b = self.gpu.stream().launch_builder(&self.kernels.argmax);
        b.arg(&logits).arg(&mut ids).arg(&vocab);
        // SAFETY: argmax_rows(logits f32 [m, vocab], out [m], vocab): one block per row of
        // `logits`, which holds logits_for.len() rows of vocab.
        unsafe { b.launch(per_row(logits_for.len())?) }.map_err(device)?;
        let ids = self.gpu.download(&ids)?;
        Ok(ids.into_iter().map(|t| t.unsigned_abs()).collect())
    }

    /// Makes `out` uniform random in `[-scale, scale)` from `seed`, on the device (a hash of
    /// the seed and the index: the same seed gives the same values on any device).
    pub fn fill_uniform(
        &self,
        out: &mut CudaSlice<T>,
        seed: u64,
        scale: f32,
    ) -> Result<(), EngineError> {
        fill(&self.gpu, &self.kernels, out, seed, scale)
    }

    /// The forward up to the logits of the rows in `logits_for`, left on the device (`None`
    /// when no logits were asked for or the batch is empty).
    fn logits(
        &self,
        tokens: &[u32],
        positions: &[usize],
        attn: &mut dyn GpuAttention<T>,
        logits_for: &[usize],
    ) -> Result<Option<CudaSlice<f32>>, EngineError> {
        let c = &self.config;
        crate::model::check_forward(c, tokens, positions, logits_for)?;
        let n = tokens.len();
        if n == 0 {
            return Ok(None);
        }
        let g = &self.gpu;
        let (qd, kvd) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let pos = positions
            .iter()
            .map(|&p| int(p))
            .collect::<Result<Vec<i32>, _>>()?;
        let picked = logits_for
            .iter()
            .map(|&r| int(r))
            .collect::<Result<Vec<i32>, _>>()?;
        let (ids, pos) = (g.upload(&ids)?, g.upload(&pos)?);
        let mut held = self.buffers.lock().map_err(|_| {
            EngineError::Invalid("a forward panicked while holding its buffers".into())
        })?;
        if held.as_ref().is_none_or(|b| b.n != n) {
            *held = Some(Buffers::new(g, c, n)?);
        }
        let Buffers {
            all,
            x,
            h,
            qkv,
            q,
            k,
            v,
            att,
            att16,
            gu,
            act,
            ..
        } = held.as_mut().expect("invariant: filled just above");
        let embed = int(c.embed)?;
        let s = g.stream();
        let mut b = s.launch_builder(&self.kernels.embed_rows);
        b.arg(&self.w.embed).arg(&ids).arg(&mut *x).arg(&embed);
        // SAFETY: embed_rows(table bf16 [vocab, embed], tokens [n], x f32 [n, embed], embed):
        // one block per row of `ids`, whose ids check_forward bounded by the vocabulary.
        unsafe { b.launch(per_row(n)?) }.map_err(device)?;
        for (l, w) in self.w.blocks.iter().enumerate() {
            if let Some(target) = attn.early_query(l) {
                // Layer `target`'s queries from this layer's input: its RMSNorm, query
                // projection (the fused projection's first rows) and RoPE, as its own forward
                // computes them from its input (InfiniGen's speculation; `Model::query` on
                // the CPU). h, qkv, k and v are free until this layer writes them below.
                let tw = self.w.blocks.get(target).ok_or_else(|| {
                    EngineError::Invalid(format!("no layer {target} of {}", c.layers))
                })?;
                self.norm(x, all, &tw.attn_norm, h)?;
                self.gemm(&tw.qkv.slice(..qd * c.embed), qd, c.embed, h, n, qkv, false)?;
                // SAFETY: rope_split writes every query of the n rows below.
                let mut early = unsafe { unwritten::<T>(g, n * qd) }?;
                self.rope(qkv, &pos, 0, &mut early, k, v)?;
                attn.early(g, target, early)?;
            }
            self.norm(x, all, &w.attn_norm, h)?;
            self.gemm(&w.qkv.as_view(), qd + 2 * kvd, c.embed, h, n, qkv, false)?;
            self.rope(qkv, &pos, c.kv_heads, q, k, v)?;
            attn.attend(g, l, q, k, v, att)?;
            self.convert(att, att16)?;
            self.gemm(&w.wo.as_view(), c.embed, qd, att16, n, x, true)?;
            self.norm(x, all, &w.ffn_norm, h)?;
            self.gemm(&w.gate_up.as_view(), 2 * c.ffn, c.embed, h, n, gu, false)?;
            let (nn, ffn) = (int(n)?, int(c.ffn)?);
            let mut b = s.launch_builder(&self.kernels.swiglu);
            b.arg(&*gu).arg(&mut *act).arg(&nn).arg(&ffn);
            // SAFETY: swiglu(gu [n, 2 ffn], out [n, ffn], n, ffn): one thread per output.
            unsafe { b.launch(flat(n * c.ffn)?) }.map_err(device)?;
            self.gemm(&w.down.as_view(), c.embed, c.ffn, act, n, x, true)?;
        }
        let m = logits_for.len();
        if m == 0 {
            return Ok(None);
        }
        let picked = g.upload(&picked)?;
        // SAFETY: the norm writes all m rows, and the GEMM (beta 0) every logit.
        let mut normed = unsafe { unwritten::<T>(g, m * c.embed) }?;
        self.norm(x, &picked, &self.w.output_norm, &mut normed)?;
        // SAFETY: as above.
        let mut logits = unsafe { unwritten::<f32>(g, m * c.vocab) }?;
        let head = self.w.output.as_ref().unwrap_or(&self.w.embed);
        self.gemm(
            &head.as_view(),
            c.vocab,
            c.embed,
            &normed,
            m,
            &mut logits,
            false,
        )?;
        Ok(Some(logits))
    }

    /// Splits `qkv` (`[n, q_heads + 2 kv_heads, head_dim]`, f32) into `q`, `k` and `v` as `T`,
    /// RoPE applied to q and k at positions `pos` (`[n]`); with `kv_heads` 0, `qkv` holds
    /// queries only and `k` and `v` are not touched.
    fn rope(
        &self,
        qkv: &CudaSlice<f32>,
        pos: &CudaSlice<i32>,
        kv_heads: usize,
        q: &mut CudaSlice<T>,
        k: &mut CudaSlice<T>,
        v: &mut CudaSlice<T>,
    ) -> Result<(), EngineError> {
        let c = &self.config;
        let n = pos.len();
        let width = (c.q_heads + 2 * kv_heads) * c.head_dim;
        if qkv.len() < n * width
            || q.len() < n * c.q_heads * c.head_dim
            || k.len() < n * kv_heads * c.head_dim
            || v.len() < n * kv_heads * c.head_dim
        {
            return Err(EngineError::Invalid(format!(
                "RoPE over {n} rows of {width} values with buffers of {}, {}, {} and {}",
                qkv.len(),
                q.len(),
                k.len(),
                v.len()
            )));
        }
        let (nn, qh, kvh, d) = (int(n)?, int(c.q_heads)?, int(kv_heads)?, int(c.head_dim)?);
        let mut b = self.gpu.stream().launch_builder(&self.kernels.rope_split);
        b.arg(qkv)
            .arg(pos)
            .arg(&self.w.freqs)
            .arg(q)
            .arg(k)
            .arg(v)
            .arg(&nn)
            .arg(&qh)
            .arg(&kvh)
            .arg(&d);
        // SAFETY: rope_split(qkv [n, width], pos [n], freqs [d / 2], q [n, qd], k and v [n,
        // kvd], n, qh, kvh, d) with the sizes checked above: one thread per pair of a row of
        // qkv, bounded by n; with kvh 0 no thread reaches k or v.
        unsafe { b.launch(flat(n * width / 2)?) }.map_err(device)?;
        Ok(())
    }

    /// `out[i] = rms_norm(x[rows[i]]) * w` as `T`.
    fn norm(
        &self,
        x: &CudaSlice<f32>,
        rows: &CudaSlice<i32>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<T>,
    ) -> Result<(), EngineError> {
        let (embed, eps) = (int(self.config.embed)?, self.config.rms_eps);
        let mut b = self
            .gpu
            .stream()
            .launch_builder(&self.kernels.rms_norm_rows);
        b.arg(x).arg(rows).arg(w).arg(out).arg(&embed).arg(&eps);
        // SAFETY: rms_norm_rows(x [?, embed], rows [r], w [embed], out [r, embed], embed, eps):
        // one block per entry of `rows`, each a row of x (the caller's indices are < n).
        unsafe { b.launch(per_row(rows.len())?) }.map_err(device)?;
        Ok(())
    }

    /// `out = T(x)`, element by element.
    fn convert(&self, x: &CudaSlice<f32>, out: &mut CudaSlice<T>) -> Result<(), EngineError> {
        let len = int(x.len())?;
        let mut b = self.gpu.stream().launch_builder(&self.kernels.narrow);
        b.arg(x).arg(out).arg(&len);
        // SAFETY: narrow(x [len], out [len], len): one thread per element; out has x's length.
        unsafe { b.launch(flat(x.len())?) }.map_err(device)?;
        Ok(())
    }

    /// `out [n, rows] (+)= x [n, cols] · Wᵀ` with `w` `[rows, cols]` row-major: in cuBLAS's
    /// column-major terms, `out` (rows × n) = op(W) (rows × cols, W stored cols × rows so
    /// transposed) · x (cols × n).
    #[allow(
        clippy::too_many_arguments,
        reason = "a GEMM's shape, operands and mode"
    )]
    fn gemm(
        &self,
        w: &CudaView<'_, T>,
        rows: usize,
        cols: usize,
        x: &CudaSlice<T>,
        n: usize,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<(), EngineError> {
        if w.len() != rows * cols || x.len() < n * cols || out.len() < n * rows {
            return Err(EngineError::Invalid(format!(
                "a GEMM of [{rows}, {cols}] over {n} rows with buffers of {}, {} and {}",
                w.len(),
                x.len(),
                out.len()
            )));
        }
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let s = self.gpu.stream();
        let (wp, _rw) = w.device_ptr(s);
        let (xp, _rx) = x.device_ptr(s);
        let (op, _ro) = out.device_ptr_mut(s);
        // SAFETY: the three buffers hold at least the elements the shapes address (checked
        // above); the handle runs on the model's stream, which the pointers' guards record.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                int(rows)?,
                int(n)?,
                int(cols)?,
                (&raw const alpha).cast::<c_void>(),
                wp as *const c_void,
                T::BLAS,
                int(cols)?,
                xp as *const c_void,
                T::BLAS,
                int(cols)?,
                (&raw const beta).cast::<c_void>(),
                op as *mut c_void,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                int(rows)?,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(device)
    }
}
