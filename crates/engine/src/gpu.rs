//! The Llama forward on the GPU (feature `cuda`): the CPU [`Model`]'s weights dequantized to
//! bf16 on the device, every projection a cuBLAS GEMM (bf16 inputs, f32 accumulation and
//! output), the small kernels of `kernels/model.cu` (embedding, RMSNorm, RoPE, SwiGLU), and
//! attention behind [`GpuAttention`] (attn-op's device kernels).
//!
//! The residual stream stays f32 on the device; the output and down projections add into it
//! through the GEMM's `beta`, so no separate residual kernel runs. Q, K and V come out of one
//! fused GEMM, gate and up out of another. Every launch is enqueued on the [`Gpu`]'s stream;
//! only the logits come back.

use std::ffi::c_void;
use std::sync::Mutex;

use attn_op::cuda::{DeviceBatch, DevicePagedKv, Gpu, compile_source};
use attn_op::{AttnParams, BatchMeta, KvCache, KvLayout};
use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use half::bf16;

use crate::linear::Linear;
use crate::{EngineError, Model, ModelConfig};

/// The CUDA C source of the forward's small kernels, embedded at build time.
pub const MODEL_KERNELS: &str = include_str!("../../../kernels/model.cu");

/// Where a GPU forward's attention runs: dense over the engine's device cache, or a test's.
pub trait GpuAttention {
    /// Layer `layer`'s attention for the batch's new tokens: `q` is `[tokens, q_heads,
    /// head_dim]`, `k` and `v` `[tokens, kv_heads, head_dim]` (RoPE applied), the result goes
    /// to `out`, `[tokens, q_heads, head_dim]`; all on `gpu`'s stream.
    fn attend(
        &mut self,
        gpu: &Gpu,
        layer: usize,
        q: &CudaSlice<bf16>,
        k: &CudaSlice<bf16>,
        v: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), EngineError>;
}

/// A model's weights on the device and the means to run its forward there.
pub struct GpuModel {
    /// Its shape.
    pub config: ModelConfig,
    gpu: Gpu,
    blas: CudaBlas,
    kernels: Kernels,
    embed: CudaSlice<bf16>,
    /// `None`: tied to the embedding.
    output: Option<CudaSlice<bf16>>,
    output_norm: CudaSlice<f32>,
    blocks: Vec<DeviceBlock>,
    freqs: CudaSlice<f32>,
    /// The intermediate buffers of the last forward's batch size, reused while it repeats
    /// (every decode step of a fixed batch).
    buffers: Mutex<Option<Buffers>>,
}

/// A forward's intermediate buffers for `n` token rows: the residual stream, the normalized
/// rows, the fused projections' outputs, the rotated Q/K/V, attention's output and SwiGLU's.
/// Every launch writes its buffer whole before it is read, so reuse needs no clearing.
struct Buffers {
    n: usize,
    x: CudaSlice<f32>,
    h: CudaSlice<bf16>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    att: CudaSlice<f32>,
    att16: CudaSlice<bf16>,
    gu: CudaSlice<f32>,
    act: CudaSlice<bf16>,
}

impl Buffers {
    fn new(g: &Gpu, c: &ModelConfig, n: usize) -> Result<Self, EngineError> {
        let (qd, kvd) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        Ok(Buffers {
            n,
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

/// One transformer block's weights on the device.
struct DeviceBlock {
    attn_norm: CudaSlice<f32>,
    /// Q, K and V stacked: `[(q_heads + 2 kv_heads) head_dim, embed]`.
    qkv: CudaSlice<bf16>,
    wo: CudaSlice<bf16>,
    ffn_norm: CudaSlice<f32>,
    /// Gate and up stacked: `[2 ffn, embed]`.
    gate_up: CudaSlice<bf16>,
    down: CudaSlice<bf16>,
}

/// The kernels of [`MODEL_KERNELS`].
struct Kernels {
    embed_rows: CudaFunction,
    rms_norm_rows: CudaFunction,
    rope_split: CudaFunction,
    swiglu: CudaFunction,
    to_bf16: CudaFunction,
}

/// Threads of a row-wise kernel's block (`ROW_THREADS` in kernels/model.cu).
const ROW_THREADS: u32 = 256;

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

impl GpuModel {
    /// Uploads `model`'s weights to `gpu` as bf16 (norms and RoPE frequencies stay f32) and
    /// compiles the forward's kernels.
    pub fn upload(model: &Model, gpu: Gpu) -> Result<GpuModel, EngineError> {
        let ptx = compile_source("kernels/model.cu", MODEL_KERNELS, gpu.arch())?;
        let module = gpu.context().load_module(ptx).map_err(device)?;
        let f = |name: &str| module.load_function(name).map_err(device);
        let kernels = Kernels {
            embed_rows: f("embed_rows")?,
            rms_norm_rows: f("rms_norm_rows")?,
            rope_split: f("rope_split")?,
            swiglu: f("swiglu")?,
            to_bf16: f("to_bf16")?,
        };
        let blas = CudaBlas::new(gpu.stream().clone()).map_err(device)?;
        let up = |parts: &[&Linear]| -> Result<CudaSlice<bf16>, EngineError> {
            let host: Vec<bf16> = parts
                .iter()
                .flat_map(|l| l.to_f32())
                .map(bf16::from_f32)
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
            embed: up(&[&model.embed])?,
            output: model.output.as_ref().map(|o| up(&[o])).transpose()?,
            output_norm: gpu.upload(&model.output_norm)?,
            freqs: gpu.upload(&model.freqs)?,
            blocks,
            kernels,
            blas,
            gpu,
            buffers: Mutex::new(None),
        })
    }

    /// The device the model lives on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Device bytes of the weights.
    pub fn weight_bytes(&self) -> usize {
        let b = |s: &CudaSlice<bf16>| s.len() * 2;
        let f = |s: &CudaSlice<f32>| s.len() * 4;
        let blocks: usize = self
            .blocks
            .iter()
            .map(|d| {
                f(&d.attn_norm) + b(&d.qkv) + b(&d.wo) + f(&d.ffn_norm) + b(&d.gate_up) + b(&d.down)
            })
            .sum();
        blocks + b(&self.embed) + self.output.as_ref().map_or(0, b) + f(&self.output_norm)
    }

    /// [`Model::forward`] on the device: one forward over a batch's new tokens at their
    /// absolute `positions`, attention through `attn`; returns the logits `[logits_for.len(),
    /// vocab]` of the token rows in `logits_for`.
    pub fn forward(
        &self,
        tokens: &[u32],
        positions: &[usize],
        attn: &mut dyn GpuAttention,
        logits_for: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        let c = &self.config;
        crate::model::check_forward(c, tokens, positions, logits_for)?;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let g = &self.gpu;
        let (qd, kvd) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let pos = positions
            .iter()
            .map(|&p| int(p))
            .collect::<Result<Vec<i32>, _>>()?;
        let all: Vec<i32> = (0..int(n)?).collect();
        let picked = logits_for
            .iter()
            .map(|&r| int(r))
            .collect::<Result<Vec<i32>, _>>()?;
        let (ids, pos, all) = (g.upload(&ids)?, g.upload(&pos)?, g.upload(&all)?);
        let mut held = self.buffers.lock().map_err(|_| {
            EngineError::Invalid("a forward panicked while holding its buffers".into())
        })?;
        if held.as_ref().is_none_or(|b| b.n != n) {
            *held = Some(Buffers::new(g, c, n)?);
        }
        let Buffers {
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
        b.arg(&self.embed).arg(&ids).arg(&mut *x).arg(&embed);
        // SAFETY: embed_rows(table bf16 [vocab, embed], tokens [n], x f32 [n, embed], embed):
        // one block per row of `ids`, whose ids check_forward bounded by the vocabulary.
        unsafe { b.launch(per_row(n)?) }.map_err(device)?;
        for (l, w) in self.blocks.iter().enumerate() {
            self.norm(x, &all, &w.attn_norm, h)?;
            self.gemm(&w.qkv, qd + 2 * kvd, c.embed, h, n, qkv, false)?;
            let (nn, qh, kvh, d) = (int(n)?, int(c.q_heads)?, int(c.kv_heads)?, int(c.head_dim)?);
            let mut b = s.launch_builder(&self.kernels.rope_split);
            b.arg(&*qkv)
                .arg(&pos)
                .arg(&self.freqs)
                .arg(&mut *q)
                .arg(&mut *k)
                .arg(&mut *v)
                .arg(&nn)
                .arg(&qh)
                .arg(&kvh)
                .arg(&d);
            // SAFETY: rope_split(qkv [n, qd + 2 kvd], pos [n], freqs [d / 2], q [n, qd],
            // k and v [n, kvd], n, qh, kvh, d): one thread per pair, bounded by n.
            unsafe { b.launch(flat(n * (qd + 2 * kvd) / 2)?) }.map_err(device)?;
            attn.attend(g, l, q, k, v, att)?;
            self.convert(att, att16)?;
            self.gemm(&w.wo, c.embed, qd, att16, n, x, true)?;
            self.norm(x, &all, &w.ffn_norm, h)?;
            self.gemm(&w.gate_up, 2 * c.ffn, c.embed, h, n, gu, false)?;
            let ffn = int(c.ffn)?;
            let mut b = s.launch_builder(&self.kernels.swiglu);
            b.arg(&*gu).arg(&mut *act).arg(&nn).arg(&ffn);
            // SAFETY: swiglu(gu [n, 2 ffn], out [n, ffn], n, ffn): one thread per output.
            unsafe { b.launch(flat(n * c.ffn)?) }.map_err(device)?;
            self.gemm(&w.down, c.embed, c.ffn, act, n, x, true)?;
        }
        let m = logits_for.len();
        if m == 0 {
            return Ok(Vec::new());
        }
        let picked = g.upload(&picked)?;
        let mut normed = g.zeros::<bf16>(m * c.embed)?;
        self.norm(x, &picked, &self.output_norm, &mut normed)?;
        let mut logits = g.zeros::<f32>(m * c.vocab)?;
        let head = self.output.as_ref().unwrap_or(&self.embed);
        self.gemm(head, c.vocab, c.embed, &normed, m, &mut logits, false)?;
        Ok(g.download(&logits)?)
    }

    /// `out[i] = rms_norm(x[rows[i]]) * w` as bf16.
    fn norm(
        &self,
        x: &CudaSlice<f32>,
        rows: &CudaSlice<i32>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<bf16>,
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

    /// `out = bf16(x)`, element by element.
    fn convert(&self, x: &CudaSlice<f32>, out: &mut CudaSlice<bf16>) -> Result<(), EngineError> {
        let len = int(x.len())?;
        let mut b = self.gpu.stream().launch_builder(&self.kernels.to_bf16);
        b.arg(x).arg(out).arg(&len);
        // SAFETY: to_bf16(x [len], out [len], len): one thread per element; out has x's length.
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
        w: &CudaSlice<bf16>,
        rows: usize,
        cols: usize,
        x: &CudaSlice<bf16>,
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
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                int(cols)?,
                xp as *const c_void,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
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

/// Dense attention over the engine's device cache: every layer's block tensor, one batch's
/// metadata and the slots its new tokens take.
pub struct GpuDenseAttention {
    /// Per layer, the KV block tensor (bf16).
    pub kv: Vec<DevicePagedKv<bf16>>,
    /// The batch's metadata over `kv`'s blocks.
    pub meta: DeviceBatch,
    /// The slot of each new token, `[tokens]`.
    pub slots: CudaSlice<i32>,
    /// Heads and softmax scale.
    pub params: AttnParams,
}

impl GpuDenseAttention {
    /// A cache of `num_blocks` blocks of `block_size` tokens per layer for `config`.
    pub fn cache(
        gpu: &Gpu,
        config: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Vec<DevicePagedKv<bf16>>, EngineError> {
        let layout = KvLayout {
            num_blocks,
            block_size,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
        };
        (0..config.layers)
            .map(|_| Ok(DevicePagedKv::new(gpu, layout)?))
            .collect()
    }

    /// Dense attention of the batch `meta` (over `kv`), its new tokens at `slots`.
    pub fn new(
        gpu: &Gpu,
        config: &ModelConfig,
        kv: Vec<DevicePagedKv<bf16>>,
        meta: &BatchMeta<'_>,
        slots: &[i32],
    ) -> Result<Self, EngineError> {
        let layout = kv
            .first()
            .map(KvCache::layout)
            .ok_or_else(|| EngineError::Invalid("a cache of no layers".into()))?;
        Ok(GpuDenseAttention {
            meta: DeviceBatch::upload(gpu, meta, &layout)?,
            slots: gpu.upload(slots)?,
            params: AttnParams::new(config.q_heads, config.head_dim),
            kv,
        })
    }
}

impl GpuAttention for GpuDenseAttention {
    fn attend(
        &mut self,
        gpu: &Gpu,
        layer: usize,
        q: &CudaSlice<bf16>,
        k: &CudaSlice<bf16>,
        v: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        let kv = self
            .kv
            .get_mut(layer)
            .ok_or_else(|| EngineError::Invalid(format!("no cache for layer {layer}")))?;
        kv.set_kv(&self.slots, k, v)?;
        gpu.paged_attention(q, kv, &self.meta, &self.params, out, None)?;
        Ok(())
    }
}
