//! A synthetic Llama-family model: random weights of any shape, written as a GGUF file with a
//! byte-level tokenizer (256 byte tokens, no merges). For tests, and for the demo where the
//! real model cannot be fetched; its text is noise, its shapes and costs are real.

use crate::gguf::DType;
use crate::model::ModelConfig;

/// The shape of SmolLM2-135M (the real model `cargo xtask fetch-model` fetches).
pub const SMOLLM2_135M: ModelConfig = ModelConfig {
    layers: 30,
    embed: 576,
    ffn: 1536,
    q_heads: 9,
    kv_heads: 3,
    head_dim: 64,
    vocab: 49152,
    context: 8192,
    rope_base: 100_000.0,
    rms_eps: 1e-5,
};

/// The shape of a Llama-3-8B-class model (32 layers, 32 query / 8 KV heads of 128, a
/// 128K-token context), for capacity and throughput figures where the real model is small.
pub const LLAMA3_8B: ModelConfig = ModelConfig {
    layers: 32,
    embed: 4096,
    ffn: 14336,
    q_heads: 32,
    kv_heads: 8,
    head_dim: 128,
    vocab: 128_256,
    context: 131_072,
    rope_base: 500_000.0,
    rms_eps: 1e-5,
};

/// The bytes of a GGUF v3 file holding a model of `config` (its `vocab` is raised to at
/// least 256 for the byte tokens) with weights of `dtype` (F32, F16, Q8_0 or Q4_1; norms stay
/// F32), drawn from `seed`.
pub fn synthetic_gguf(config: &ModelConfig, dtype: DType, seed: u64) -> Vec<u8> {
    let c = ModelConfig {
        vocab: config.vocab.max(256),
        ..*config
    };
    let mut rng = seed ^ 0x2545_f491_4f6c_dd1d;
    let mut w = Writer::default();
    w.str("general.architecture", "llama");
    for (k, v) in [
        ("block_count", c.layers),
        ("embedding_length", c.embed),
        ("feed_forward_length", c.ffn),
        ("attention.head_count", c.q_heads),
        ("attention.head_count_kv", c.kv_heads),
        ("attention.key_length", c.head_dim),
        ("context_length", c.context),
    ] {
        w.u32(&format!("llama.{k}"), v as u32);
    }
    w.f32("llama.rope.freq_base", c.rope_base);
    w.f32("llama.attention.layer_norm_rms_epsilon", c.rms_eps);
    w.str("tokenizer.ggml.model", "gpt2");
    let tokens: Vec<String> = (0..c.vocab)
        .map(|i| match i {
            0..256 => byte_char(i as u8).to_string(),
            _ => format!("<|extra_{i}|>"),
        })
        .collect();
    w.strs("tokenizer.ggml.tokens", &tokens);
    w.strs("tokenizer.ggml.merges", &[]);
    let (qd, kvd) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
    // Weights scaled like a trained model's: rows of unit-ish norm.
    let mut matrix = |w: &mut Writer, name: &str, rows: usize, cols: usize| {
        let s = 1.0 / (cols as f32).sqrt();
        let x: Vec<f32> = (0..rows * cols)
            .map(|_| uniform(&mut rng) * 2.0 * s)
            .collect();
        w.tensor(name, &[cols, rows], dtype, &x);
    };
    matrix(&mut w, "token_embd.weight", c.vocab, c.embed);
    for l in 0..c.layers {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        w.tensor(&n("attn_norm"), &[c.embed], DType::F32, &vec![1.0; c.embed]);
        matrix(&mut w, &n("attn_q"), qd, c.embed);
        matrix(&mut w, &n("attn_k"), kvd, c.embed);
        matrix(&mut w, &n("attn_v"), kvd, c.embed);
        matrix(&mut w, &n("attn_output"), c.embed, qd);
        w.tensor(&n("ffn_norm"), &[c.embed], DType::F32, &vec![1.0; c.embed]);
        matrix(&mut w, &n("ffn_gate"), c.ffn, c.embed);
        matrix(&mut w, &n("ffn_up"), c.ffn, c.embed);
        matrix(&mut w, &n("ffn_down"), c.embed, c.ffn);
    }
    w.tensor(
        "output_norm.weight",
        &[c.embed],
        DType::F32,
        &vec![1.0; c.embed],
    );
    w.finish()
}

/// GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are moved
/// to code points from 256 up, in byte order.
fn byte_char(b: u8) -> char {
    let printable = |x: u8| matches!(x, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("256 + at most 255 is a valid scalar value")
}

/// A uniform value in [-0.5, 0.5).
fn uniform(state: &mut u64) -> f32 {
    crate::sample::unit(state) - 0.5
}

/// A GGUF v3 writer: metadata, then tensors aligned to 32 bytes.
#[derive(Default)]
struct Writer {
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    data: Vec<u8>,
    n_tensors: u64,
}

impl Writer {
    fn key(&mut self, key: &str, t: u32) {
        put_str(&mut self.kv, key);
        self.kv.extend(t.to_le_bytes());
        self.n_kv += 1;
    }

    fn u32(&mut self, key: &str, v: u32) {
        self.key(key, 4);
        self.kv.extend(v.to_le_bytes());
    }

    fn f32(&mut self, key: &str, v: f32) {
        self.key(key, 6);
        self.kv.extend(v.to_le_bytes());
    }

    fn str(&mut self, key: &str, v: &str) {
        self.key(key, 8);
        put_str(&mut self.kv, v);
    }

    fn strs(&mut self, key: &str, v: &[String]) {
        self.key(key, 9);
        self.kv.extend(8u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        for s in v {
            put_str(&mut self.kv, s);
        }
    }

    /// A tensor of GGUF dims `dims` (innermost first) from f32 values, encoded as `dtype`.
    fn tensor(&mut self, name: &str, dims: &[usize], dtype: DType, x: &[f32]) {
        put_str(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for &d in dims {
            self.infos.extend((d as u64).to_le_bytes());
        }
        let t: u32 = match dtype {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q8_0 => 8,
            DType::BF16 => 30,
        };
        self.infos.extend(t.to_le_bytes());
        self.data.resize(self.data.len().div_ceil(32) * 32, 0);
        self.infos.extend((self.data.len() as u64).to_le_bytes());
        encode(dtype, x, &mut self.data);
        self.n_tensors += 1;
    }

    fn finish(self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        out.extend(&self.infos);
        out.resize(out.len().div_ceil(32) * 32, 0);
        out.extend(&self.data);
        out
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Encodes f32 values (whole blocks) as `dtype`, as llama.cpp's reference quantizers do.
fn encode(dtype: DType, x: &[f32], out: &mut Vec<u8>) {
    use half::{bf16, f16};
    let h = |v: f32| f16::from_f32(v).to_le_bytes();
    match dtype {
        DType::F32 => x.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DType::F16 => x.iter().for_each(|&v| out.extend(h(v))),
        DType::BF16 => x
            .iter()
            .for_each(|&v| out.extend(bf16::from_f32(v).to_le_bytes())),
        DType::Q8_0 => {
            for b in x.chunks(32) {
                let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                out.extend(h(d));
                out.extend(b.iter().map(|v| (v * inv).round() as i8 as u8));
            }
        }
        DType::Q4_0 => {
            for b in x.chunks(32) {
                let m = b
                    .iter()
                    .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = m / -8.0;
                let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(h(d));
                let q = |v: f32| ((v * inv + 8.5) as u8).min(15);
                out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
            }
        }
        DType::Q4_1 => {
            for b in x.chunks(32) {
                let lo = b.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (hi - lo) / 15.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                out.extend(h(d));
                out.extend(h(lo));
                let q = |v: f32| (((v - lo) * inv + 0.5) as u8).min(15);
                out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
            }
        }
    }
}
