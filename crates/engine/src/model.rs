//! The Llama-family transformer on the CPU: RMSNorm, RoPE on adjacent pairs, grouped-query
//! attention through an [`Attention`] backend, SwiGLU, and a (possibly tied) output head.

use rayon::prelude::*;

use crate::EngineError;
use crate::gguf::{DType, Gguf, Value};
use crate::linear::Linear;

/// The shape and constants of a Llama-family model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Width of the residual stream.
    pub embed: usize,
    /// Width of the feed-forward hidden layer.
    pub ffn: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads (a divisor of the query heads).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// The context length the model was trained for.
    pub context: usize,
    /// RoPE base frequency.
    pub rope_base: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
}

impl ModelConfig {
    /// Reads the `{arch}.*` metadata of a GGUF file (architecture `llama`).
    pub fn from_gguf(g: &Gguf) -> Result<ModelConfig, EngineError> {
        let arch = g
            .metadata
            .get("general.architecture")
            .and_then(Value::as_str)
            .unwrap_or("");
        if arch != "llama" {
            return Err(EngineError::Unsupported(format!(
                "architecture {arch:?} (only \"llama\")"
            )));
        }
        let get = |k: &str| g.metadata.get(&format!("{arch}.{k}"));
        let int = |k: &str| -> Result<usize, EngineError> {
            get(k)
                .and_then(Value::as_u64)
                .filter(|&v| v > 0 && v < 1 << 24)
                .map(|v| v as usize)
                .ok_or_else(|| EngineError::Malformed(format!("{arch}.{k} missing or invalid")))
        };
        let float = |k: &str, default: f64| -> Result<f32, EngineError> {
            match get(k) {
                None => Ok(default as f32),
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .map(|x| x as f32)
                    .ok_or_else(|| EngineError::Malformed(format!("{arch}.{k} = {v:?}"))),
            }
        };
        let (embed, q_heads) = (int("embedding_length")?, int("attention.head_count")?);
        let kv_heads = match get("attention.head_count_kv") {
            None => q_heads,
            Some(_) => int("attention.head_count_kv")?,
        };
        let head_dim = match get("attention.key_length") {
            None => embed / q_heads,
            Some(_) => int("attention.key_length")?,
        };
        let vocab = g
            .tensor("token_embd.weight")?
            .dims
            .get(1)
            .copied()
            .unwrap_or(0);
        ModelConfig {
            layers: int("block_count")?,
            embed,
            ffn: int("feed_forward_length")?,
            q_heads,
            kv_heads,
            head_dim,
            vocab,
            context: int("context_length")?,
            rope_base: float("rope.freq_base", 10_000.0)?,
            rms_eps: float("attention.layer_norm_rms_epsilon", 1e-5)?,
        }
        .checked()
    }

    /// The config itself if its shape is consistent: KV heads divide the query heads, the
    /// head dimension is even (RoPE rotates pairs), and no size is 0.
    /// Per pair `i` of a head, RoPE's frequency `rope_base^(-2i / head_dim)`.
    pub(crate) fn rope_freqs(&self) -> Vec<f32> {
        (0..self.head_dim / 2)
            .map(|i| {
                (f64::from(self.rope_base).powf(-2.0 * i as f64 / self.head_dim as f64)) as f32
            })
            .collect()
    }

    pub(crate) fn checked(self) -> Result<ModelConfig, EngineError> {
        let c = self;
        let sizes = [
            c.layers, c.embed, c.ffn, c.q_heads, c.kv_heads, c.head_dim, c.vocab,
        ];
        if sizes.contains(&0)
            || !c.q_heads.is_multiple_of(c.kv_heads)
            || !c.head_dim.is_multiple_of(2)
            || c.context == 0
        {
            return Err(EngineError::Malformed(format!("inconsistent shape {c:?}")));
        }
        Ok(c)
    }

    /// The shape the attention layers see.
    pub fn shape(&self) -> coordinator::ModelShape {
        coordinator::ModelShape {
            layers: self.layers,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Bytes of K and V per token over all layers, at `elem` bytes per element (saturating at
    /// `usize::MAX`).
    pub fn kv_bytes_per_token(&self, elem: usize) -> usize {
        [2, self.kv_heads, self.head_dim, elem]
            .into_iter()
            .fold(self.layers, usize::saturating_mul)
    }
}

/// Where a forward's attention runs: the engine's dense cache, the coordinator's sparse
/// path, or a test's.
pub trait Attention {
    /// Layer `layer`'s attention for the batch's new tokens: `q` is
    /// `[tokens, q_heads, head_dim]`, `k` and `v` are `[tokens, kv_heads, head_dim]` (RoPE
    /// applied); the result goes to `out`, `[tokens, q_heads, head_dim]`.
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError>;

    /// Called in every forward with layer `layer`'s input, the residual stream `x` (`[tokens,
    /// embed]`), before the layer runs: where a backend can look ahead, for instance estimate
    /// the next layer's queries from it ([`Model::query`]) to select and load that layer's
    /// pages while this one computes. Does nothing by default.
    fn layer_input(&mut self, layer: usize, x: &[f32]) -> Result<(), EngineError> {
        let _ = (layer, x);
        Ok(())
    }
}

/// A model file's tensors, named as GGUF names them (`blk.0.attn_q.weight`), whatever the
/// file's format: [`Model::assemble`] reads every weight through it.
pub(crate) trait Weights {
    /// The matrix `name` as `[rows, cols]` (`rows` output features), in its file encoding.
    /// Q and K rotate adjacent pairs (the GGUF convention).
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, EngineError>;
    /// The vector `name` of `len` elements, as f32.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, EngineError>;
    /// Whether the file has an output head of its own (else it is tied to the embedding).
    fn has_output(&self) -> bool;
}

impl Weights for Gguf {
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, EngineError> {
        Linear::from_gguf(self, name, rows, cols)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, EngineError> {
        if self.tensor(name)?.dims != [len] {
            return Err(EngineError::Malformed(format!("{name}: expected [{len}]")));
        }
        self.dequantize(name)
    }

    fn has_output(&self) -> bool {
        self.tensors.contains_key("output.weight")
    }
}

/// One transformer block's weights.
#[derive(Clone)]
pub(crate) struct Block {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) wq: Linear,
    pub(crate) wk: Linear,
    pub(crate) wv: Linear,
    pub(crate) wo: Linear,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// A loaded model.
#[derive(Clone)]
pub struct Model {
    /// Its shape.
    pub config: ModelConfig,
    pub(crate) embed: Linear,
    /// `None`: tied to the embedding.
    pub(crate) output: Option<Linear>,
    pub(crate) output_norm: Vec<f32>,
    pub(crate) blocks: Vec<Block>,
    /// Per pair `i` of a head, `rope_base^(-2i / head_dim)`.
    pub(crate) freqs: Vec<f32>,
    /// The type every input of a projection and of the attention is rounded to before use
    /// (`None`: kept in f32), as a GPU forward in that type rounds them.
    pub(crate) inputs: Option<DType>,
    /// Whether the forward rounds as llama.cpp's CPU backend does ([`Model::like_llama_cpp`]).
    pub(crate) like_ggml: bool,
}

impl Model {
    /// Loads every weight of a Llama-family GGUF file (quantized weights stay quantized).
    pub fn load(g: &Gguf) -> Result<Model, EngineError> {
        Model::assemble(ModelConfig::from_gguf(g)?, g)
    }

    /// The same model with every matrix stored as the float type `dtype` (F32, F16 or BF16),
    /// each weight rounded once from its exact value: the weights a GPU forward that
    /// dequantizes to `dtype` at load computes with, so the CPU forward of this model (with a
    /// KV store of the same type) is that forward's reference at its own precision.
    pub fn with_float_weights(&self, dtype: DType) -> Result<Model, EngineError> {
        let f = |l: &Linear| l.to_float(dtype);
        let blocks = self
            .blocks
            .iter()
            .map(|b| {
                Ok(Block {
                    attn_norm: b.attn_norm.clone(),
                    wq: f(&b.wq)?,
                    wk: f(&b.wk)?,
                    wv: f(&b.wv)?,
                    wo: f(&b.wo)?,
                    ffn_norm: b.ffn_norm.clone(),
                    gate: f(&b.gate)?,
                    up: f(&b.up)?,
                    down: f(&b.down)?,
                })
            })
            .collect::<Result<Vec<Block>, EngineError>>()?;
        Ok(Model {
            config: self.config,
            embed: f(&self.embed)?,
            output: self.output.as_ref().map(f).transpose()?,
            output_norm: self.output_norm.clone(),
            blocks,
            freqs: self.freqs.clone(),
            inputs: self.inputs,
            like_ggml: self.like_ggml,
        })
    }

    /// The same model computing as a GPU forward in `dtype` (F32, F16 or BF16) does: its
    /// weights rounded once ([`Model::with_float_weights`]) and every input of a projection and
    /// of the attention (the normed stream, the queries, keys and values, the attention's
    /// output, the SwiGLU product) rounded to `dtype` before use; products accumulate and the
    /// residual stream stays in f32. With a KV store of `dtype`, this is the CPU specification
    /// of that GPU forward: the two differ only by the order of f32 sums.
    pub fn computing_in(&self, dtype: DType) -> Result<Model, EngineError> {
        let mut m = self.with_float_weights(dtype)?;
        m.inputs = (dtype != DType::F32).then_some(dtype);
        Ok(m)
    }

    /// The same model computing as llama.cpp's CPU backend does (the build [`crate::ggml`]
    /// names), where its rounding differs from this forward's:
    /// - every input of a quantized matrix (Q8_0, Q4_0, Q4_1) is quantized to 8 bits in
    ///   blocks of 32 with ggml's rounding (to nearest even, the block's scale and sum in f16),
    ///   at every row count, not only in decode;
    /// - RMSNorm adds its squares in f64;
    /// - RoPE's angle is multiplied from one pair to the next in f32, and each rotation fuses
    ///   its first product with the sum, as GCC compiles ggml's;
    /// - SwiGLU takes ggml's polynomial `expf`.
    ///
    /// With attention through [`crate::ggml::GgmlAttention`], the logits of Q4_1 and Q8_0
    /// matrices equal that build's bit for bit (on x86-64 with AVX2, whose integer dot
    /// products this forward shares with ggml). The engine's own forward stays the default:
    /// this one exists to compare the two models beyond their rounding.
    pub fn like_llama_cpp(mut self) -> Model {
        self.like_ggml = true;
        self
    }

    /// Builds a model of shape `c` from the weights `w` holds.
    pub(crate) fn assemble(c: ModelConfig, w: &dyn Weights) -> Result<Model, EngineError> {
        let (qd, kvd) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let blocks = (0..c.layers)
            .map(|l| {
                let n = |s: &str| format!("blk.{l}.{s}.weight");
                Ok(Block {
                    attn_norm: w.vector(&n("attn_norm"), c.embed)?,
                    wq: w.linear(&n("attn_q"), qd, c.embed)?,
                    wk: w.linear(&n("attn_k"), kvd, c.embed)?,
                    wv: w.linear(&n("attn_v"), kvd, c.embed)?,
                    wo: w.linear(&n("attn_output"), c.embed, qd)?,
                    ffn_norm: w.vector(&n("ffn_norm"), c.embed)?,
                    gate: w.linear(&n("ffn_gate"), c.ffn, c.embed)?,
                    up: w.linear(&n("ffn_up"), c.ffn, c.embed)?,
                    down: w.linear(&n("ffn_down"), c.embed, c.ffn)?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let output = match w.has_output() {
            true => Some(w.linear("output.weight", c.vocab, c.embed)?),
            false => None,
        };
        let freqs = c.rope_freqs();
        Ok(Model {
            embed: w.linear("token_embd.weight", c.vocab, c.embed)?,
            output,
            output_norm: w.vector("output_norm.weight", c.embed)?,
            blocks,
            freqs,
            config: c,
            inputs: None,
            like_ggml: false,
        })
    }

    /// One forward over a batch's new tokens at their absolute `positions`, attention through
    /// `attn`. Returns the logits `[logits_for.len(), vocab]` of the token rows in
    /// `logits_for`.
    pub fn forward(
        &self,
        tokens: &[u32],
        positions: &[usize],
        attn: &mut dyn Attention,
        logits_for: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        let c = &self.config;
        check_forward(c, tokens, positions, logits_for)?;
        let n = tokens.len();
        let (qd, kvd) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut x = vec![0.0f32; n * c.embed];
        x.par_chunks_mut(c.embed)
            .zip(tokens)
            .for_each(|(row, &t)| self.embed.row(t as usize, row));
        let mut h = vec![0.0f32; n * c.embed];
        let (mut q, mut k, mut v) = (vec![0.0; n * qd], vec![0.0; n * kvd], vec![0.0; n * kvd]);
        let mut att = vec![0.0f32; n * qd];
        let mut o = vec![0.0f32; n * c.embed];
        let (mut g, mut u) = (vec![0.0f32; n * c.ffn], vec![0.0f32; n * c.ffn]);
        // Every layer and head rotates by the same angles: computed once per forward.
        let angles = self.angles(positions);
        for (l, b) in self.blocks.iter().enumerate() {
            attn.layer_input(l, &x)?;
            self.rms_norm(&x, &b.attn_norm, &mut h);
            self.round(&mut h);
            self.matmul(&b.wq, &h, n, &mut q);
            self.matmul(&b.wk, &h, n, &mut k);
            self.matmul(&b.wv, &h, n, &mut v);
            self.rope(&mut q, &angles);
            self.rope(&mut k, &angles);
            for t in [&mut q, &mut k, &mut v] {
                self.round(t);
            }
            attn.attend(l, &q, &k, &v, &mut att)?;
            self.round(&mut att);
            self.matmul(&b.wo, &att, n, &mut o);
            add(&mut x, &o);
            self.rms_norm(&x, &b.ffn_norm, &mut h);
            self.round(&mut h);
            self.matmul(&b.gate, &h, n, &mut g);
            self.matmul(&b.up, &h, n, &mut u);
            let silu: fn(f32) -> f32 = if self.like_ggml {
                crate::ggml::silu
            } else {
                |a| a / (1.0 + (-a).exp())
            };
            g.par_chunks_mut(c.ffn)
                .zip(u.par_chunks(c.ffn))
                .for_each(|(g, u)| {
                    for (a, &b) in g.iter_mut().zip(u) {
                        *a = silu(*a) * b;
                    }
                });
            self.round(&mut g);
            self.matmul(&b.down, &g, n, &mut o);
            add(&mut x, &o);
        }
        let mut last = Vec::with_capacity(logits_for.len() * c.embed);
        for &r in logits_for {
            last.extend_from_slice(&x[r * c.embed..(r + 1) * c.embed]);
        }
        let mut normed = vec![0.0f32; last.len()];
        self.rms_norm(&last, &self.output_norm, &mut normed);
        self.round(&mut normed);
        let mut logits = vec![0.0f32; logits_for.len() * c.vocab];
        let head = self.output.as_ref().unwrap_or(&self.embed);
        self.matmul(head, &normed, logits_for.len(), &mut logits);
        Ok(logits)
    }

    /// The queries layer `layer` would compute from the residual stream `x` (`[tokens,
    /// embed]`) of tokens at `positions`: its input norm, its query projection and RoPE,
    /// `[tokens, q_heads, head_dim]`: exactly the layer's queries given its own input
    /// ([`Attention::layer_input`]), an estimate of them given an earlier layer's (what a
    /// speculative selection reads).
    pub fn query(
        &self,
        layer: usize,
        x: &[f32],
        positions: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        let c = &self.config;
        let n = positions.len();
        let b = self
            .blocks
            .get(layer)
            .ok_or_else(|| EngineError::Invalid(format!("no layer {layer} of {}", c.layers)))?;
        if x.len() != n * c.embed {
            return Err(EngineError::Invalid(format!(
                "a stream of {} values for {n} positions of {}",
                x.len(),
                c.embed
            )));
        }
        let mut h = vec![0.0f32; x.len()];
        self.rms_norm(x, &b.attn_norm, &mut h);
        self.round(&mut h);
        let mut q = vec![0.0f32; n * c.q_heads * c.head_dim];
        self.matmul(&b.wq, &h, n, &mut q);
        self.rope(&mut q, &self.angles(positions));
        self.round(&mut q);
        Ok(q)
    }

    /// Rounds every value of `x` to the type of [`Model::computing_in`] (to nearest even),
    /// where the model has one.
    fn round(&self, x: &mut [f32]) {
        let rounded: fn(f32) -> f32 = match self.inputs {
            Some(DType::BF16) => |v| half::bf16::from_f32(v).to_f32(),
            Some(DType::F16) => |v| half::f16::from_f32(v).to_f32(),
            _ => return,
        };
        x.par_chunks_mut(4096)
            .for_each(|c| c.iter_mut().for_each(|v| *v = rounded(*v)));
    }

    /// `out [n, rows] = x [n, cols] · Wᵀ`, rounded as the model's forward rounds.
    fn matmul(&self, w: &Linear, x: &[f32], n: usize, out: &mut [f32]) {
        if self.like_ggml {
            w.forward_like_ggml(x, n, out);
        } else {
            w.forward(x, n, out);
        }
    }

    /// `out = x / rms(x) * w`, row by row: the squares added in f32, or in f64 as ggml adds
    /// them.
    fn rms_norm(&self, x: &[f32], w: &[f32], out: &mut [f32]) {
        let (d, eps) = (w.len(), self.config.rms_eps);
        let wide = self.like_ggml;
        out.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .for_each(|(o, x)| {
                let mean = if wide {
                    (x.iter().map(|v| f64::from(v * v)).sum::<f64>() / d as f64) as f32
                } else {
                    x.iter().map(|v| v * v).sum::<f32>() / d as f32
                };
                let r = 1.0 / (mean + eps).sqrt();
                for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                    *o = x * r * w;
                }
            });
    }

    /// Each position's `(sin, cos)` per rotated pair: the same for every layer and head.
    fn angles(&self, positions: &[usize]) -> Vec<(f32, f32)> {
        if self.like_ggml {
            let c = &self.config;
            return positions
                .iter()
                .flat_map(|&p| crate::ggml::rope_angles(p, c.head_dim / 2, c.rope_base, c.head_dim))
                .collect();
        }
        positions
            .iter()
            .flat_map(|&p| self.freqs.iter().map(move |&f| (p as f32 * f).sin_cos()))
            .collect()
    }

    /// Rotates adjacent pairs `(2i, 2i + 1)` of every head of every row by `pos · freq_i`
    /// (the GGUF convention: llama.cpp's converter permuted Q and K for it); `angles` holds
    /// each row's `(sin, cos)` per pair.
    fn rope(&self, x: &mut [f32], angles: &[(f32, f32)]) {
        let d = self.config.head_dim;
        let half = d / 2;
        let rows = angles.len() / half.max(1);
        let width = x.len() / rows.max(1);
        let rotate: fn(f32, f32, f32, f32) -> (f32, f32) = if self.like_ggml {
            crate::ggml::rotate
        } else {
            |a, b, s, c| (a * c - b * s, a * s + b * c)
        };
        x.par_chunks_mut(width)
            .zip(angles.par_chunks(half))
            .for_each(|(row, angles)| {
                for head in row.chunks_exact_mut(d) {
                    for (pair, &(s, c)) in head.chunks_exact_mut(2).zip(angles) {
                        (pair[0], pair[1]) = rotate(pair[0], pair[1], s, c);
                    }
                }
            });
    }
}

/// Checks a forward's inputs: a position per token, tokens inside the vocabulary, and logits
/// asked of existing rows.
pub(crate) fn check_forward(
    c: &ModelConfig,
    tokens: &[u32],
    positions: &[usize],
    logits_for: &[usize],
) -> Result<(), EngineError> {
    let n = tokens.len();
    if positions.len() != n {
        return Err(EngineError::Invalid(format!(
            "{n} tokens but {} positions",
            positions.len()
        )));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
        return Err(EngineError::Invalid(format!(
            "token {t} outside the vocabulary of {}",
            c.vocab
        )));
    }
    if let Some(&r) = logits_for.iter().find(|&&r| r >= n) {
        return Err(EngineError::Invalid(format!("logits of row {r} of {n}")));
    }
    Ok(())
}

/// `x += y`.
fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
