//! Hugging Face checkpoints: a directory with `config.json` (a `LlamaForCausalLM`), the
//! weights in safetensors (`model.safetensors`, or the shards `model.safetensors.index.json`
//! lists), and `tokenizer.json`.
//!
//! Hugging Face's Llama rotates the two halves of each head (pair `i` is elements `i` and
//! `i + d/2`); the engine, like GGUF, rotates adjacent pairs. [`Checkpoint::model`] moves the
//! rows of the Q and K projections into the adjacent order as it loads them (what llama.cpp's
//! converter does), which leaves every attention score unchanged. [`export`] writes a GGUF
//! model back in Hugging Face's layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, SafeTensors};
use serde::Deserialize;

use crate::gguf::{DType, Gguf, dequantize};
use crate::linear::{Linear, float_bytes};
use crate::model::{Model, ModelConfig, Weights};
use crate::{EngineError, Tokenizer};

/// An opened Hugging Face checkpoint: its config read and checked, its safetensors files
/// mapped and their headers validated. Weights are read when [`Checkpoint::model`] builds.
pub struct Checkpoint {
    /// The model's shape, from `config.json`.
    pub config: ModelConfig,
    tied: bool,
    bos: Option<u32>,
    eos: Option<u32>,
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name → the shard that holds it.
    names: BTreeMap<String, usize>,
}

/// One mapped safetensors file.
struct Shard {
    map: Mmap,
    /// Where the tensor data starts (after the 8-byte length and the JSON header).
    start: usize,
    meta: Metadata,
}

/// The fields of `config.json` the engine reads.
#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    num_hidden_layers: usize,
    vocab_size: usize,
    max_position_embeddings: usize,
    rope_theta: Option<f64>,
    rms_norm_eps: Option<f64>,
    head_dim: Option<usize>,
    tie_word_embeddings: Option<bool>,
    hidden_act: Option<String>,
    rope_scaling: Option<serde_json::Value>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
}

/// The largest size any config field may name: bounds allocations before a weight is read.
const MAX_SIZE: usize = 1 << 24;

impl Checkpoint {
    /// Opens the checkpoint in `dir`: reads and checks `config.json`, maps every safetensors
    /// file and validates its header (offsets, sizes, the file's length).
    pub fn open(dir: &Path) -> Result<Checkpoint, EngineError> {
        let text = read_text(&dir.join("config.json"))?;
        let hf: HfConfig = serde_json::from_str(&text)
            .map_err(|e| EngineError::Malformed(format!("config.json: {e}")))?;
        let (config, tied) = lower(&hf)?;
        let token =
            |v: &Option<serde_json::Value>, key: &str| -> Result<Option<u32>, EngineError> {
                let first = match v {
                    Some(serde_json::Value::Array(a)) => a.first(),
                    v => v.as_ref(),
                };
                match first {
                    None | Some(serde_json::Value::Null) => Ok(None),
                    Some(x) => x
                        .as_u64()
                        .filter(|&t| (t as usize) < config.vocab)
                        .map(|t| Some(t as u32))
                        .ok_or_else(|| EngineError::Malformed(format!("config.json: {key} = {x}"))),
                }
            };
        let (bos, eos) = (
            token(&hf.bos_token_id, "bos_token_id")?,
            token(&hf.eos_token_id, "eos_token_id")?,
        );
        let mut shards = Vec::new();
        let mut names = BTreeMap::new();
        for file in shard_files(dir)? {
            let shard = Shard::open(dir, &file)?;
            for name in shard.meta.tensors().into_keys() {
                if names.insert(name.clone(), shards.len()).is_some() {
                    return Err(EngineError::Malformed(format!(
                        "{name} is in more than one safetensors file"
                    )));
                }
            }
            shards.push(shard);
        }
        if !tied && !names.contains_key("lm_head.weight") {
            return Err(EngineError::Malformed(
                "tie_word_embeddings is false but lm_head.weight is missing".into(),
            ));
        }
        Ok(Checkpoint {
            config,
            tied,
            bos,
            eos,
            dir: dir.to_owned(),
            shards,
            names,
        })
    }

    /// Loads every weight (F32, F16 and BF16 stay in their encoding).
    pub fn model(&self) -> Result<Model, EngineError> {
        Model::assemble(self.config, self)
    }

    /// The checkpoint's `tokenizer.json`, with BOS and EOS from its config.
    pub fn tokenizer(&self) -> Result<Tokenizer, EngineError> {
        Tokenizer::from_hf_file(&self.dir.join("tokenizer.json"), self.bos, self.eos)
    }

    /// The tensor that GGUF calls `gguf_name`.
    fn tensor(&self, gguf_name: &str) -> Result<Found<'_>, EngineError> {
        let name = hf_name(gguf_name)
            .ok_or_else(|| EngineError::Invalid(format!("no Hugging Face name for {gguf_name}")))?;
        let missing = || EngineError::Malformed(format!("tensor {name} is missing"));
        let shard = &self.shards[*self.names.get(&name).ok_or_else(missing)?];
        let info = shard.meta.info(&name).ok_or_else(missing)?;
        let dtype = match info.dtype {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            other => {
                return Err(EngineError::Unsupported(format!(
                    "{name}: safetensors dtype {other:?} (F32, F16 and BF16 are)"
                )));
            }
        };
        let (s, e) = info.data_offsets;
        // read_metadata checked that the offsets tile the data and end at the file's end.
        let bytes = &shard.map[shard.start + s..shard.start + e];
        Ok(Found {
            name,
            dtype,
            shape: &info.shape,
            bytes,
        })
    }
}

/// A checkpoint's tensor: its Hugging Face name, encoding, shape and bytes.
struct Found<'a> {
    name: String,
    dtype: DType,
    shape: &'a [usize],
    bytes: &'a [u8],
}

impl Weights for Checkpoint {
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, EngineError> {
        let t = self.tensor(name)?;
        if t.shape != [rows, cols] {
            return Err(EngineError::Malformed(format!(
                "{}: shape {:?}, expected [{rows}, {cols}]",
                t.name, t.shape
            )));
        }
        let c = &self.config;
        let data = match rope_heads(name, c) {
            Some(heads) => permute_rope(t.bytes, heads, c.head_dim, false),
            None => t.bytes.to_vec(),
        };
        Linear::from_raw(t.dtype, rows, cols, data)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, EngineError> {
        let t = self.tensor(name)?;
        if t.shape != [len] {
            return Err(EngineError::Malformed(format!(
                "{}: shape {:?}, expected [{len}]",
                t.name, t.shape
            )));
        }
        let mut out = vec![0.0f32; len];
        dequantize(t.dtype, t.bytes, &mut out);
        Ok(out)
    }

    fn has_output(&self) -> bool {
        !self.tied
    }
}

impl Shard {
    fn open(dir: &Path, name: &str) -> Result<Shard, EngineError> {
        let path = dir.join(name);
        let io = |source| EngineError::Io {
            path: path.clone(),
            source,
        };
        let file = std::fs::File::open(&path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process; a file changed underneath
        // it by another process could change the bytes we read, which every reader of a mapped
        // model file accepts (the header is validated and every read is bounds-checked).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (n, meta) = SafeTensors::read_metadata(&map)
            .map_err(|e| EngineError::Malformed(format!("{name}: {e}")))?;
        Ok(Shard {
            map,
            start: 8 + n,
            meta,
        })
    }
}

/// The safetensors files of a checkpoint: those the index lists, else `model.safetensors`.
/// Names must be plain file names in the directory.
fn shard_files(dir: &Path) -> Result<Vec<String>, EngineError> {
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Ok(vec!["model.safetensors".to_owned()]);
    }
    #[derive(Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let idx: Index = serde_json::from_str(&read_text(&index)?)
        .map_err(|e| EngineError::Malformed(format!("model.safetensors.index.json: {e}")))?;
    let mut files: Vec<String> = idx.weight_map.into_values().collect();
    files.sort();
    files.dedup();
    if let Some(bad) = files.iter().find(|f| {
        f.is_empty()
            || f.contains(['/', '\\'])
            || f.starts_with('.')
            || !f.ends_with(".safetensors")
    }) {
        return Err(EngineError::Malformed(format!(
            "model.safetensors.index.json names the file {bad:?}"
        )));
    }
    Ok(files)
}

/// The engine's shape from a Hugging Face config, and whether the output head is tied.
fn lower(hf: &HfConfig) -> Result<(ModelConfig, bool), EngineError> {
    let unsupported = |what: String| Err(EngineError::Unsupported(format!("config.json: {what}")));
    if let Some(t) = hf.model_type.as_deref().filter(|&t| t != "llama") {
        return unsupported(format!("model_type {t:?} (only \"llama\")"));
    }
    if let Some(a) = hf.hidden_act.as_deref().filter(|&a| a != "silu") {
        return unsupported(format!("hidden_act {a:?} (only \"silu\")"));
    }
    if hf.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
        return unsupported("rope_scaling (plain RoPE only)".into());
    }
    if hf.attention_bias == Some(true) || hf.mlp_bias == Some(true) {
        return unsupported("projection biases".into());
    }
    let q_heads = hf.num_attention_heads.max(1);
    let c = ModelConfig {
        layers: hf.num_hidden_layers,
        embed: hf.hidden_size,
        ffn: hf.intermediate_size,
        q_heads: hf.num_attention_heads,
        kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
        head_dim: hf.head_dim.unwrap_or(hf.hidden_size / q_heads),
        vocab: hf.vocab_size,
        context: hf.max_position_embeddings,
        rope_base: positive(hf.rope_theta.unwrap_or(10_000.0), "rope_theta")?,
        rms_eps: positive(hf.rms_norm_eps.unwrap_or(1e-6), "rms_norm_eps")?,
    };
    let sizes = [
        c.layers, c.embed, c.ffn, c.q_heads, c.kv_heads, c.head_dim, c.vocab,
    ];
    if sizes.iter().any(|&s| s >= MAX_SIZE) {
        return Err(EngineError::Malformed(format!(
            "config.json: a size of {c:?} is over {MAX_SIZE}"
        )));
    }
    Ok((c.checked()?, hf.tie_word_embeddings.unwrap_or(false)))
}

fn positive(x: f64, key: &str) -> Result<f32, EngineError> {
    Some(x as f32)
        .filter(|v| v.is_finite() && *v > 0.0)
        .ok_or_else(|| EngineError::Malformed(format!("config.json: {key} = {x}")))
}

fn read_text(path: &Path) -> Result<String, EngineError> {
    std::fs::read_to_string(path).map_err(|source| EngineError::Io {
        path: path.to_owned(),
        source,
    })
}

/// The Hugging Face name of a GGUF tensor name, for the tensors a Llama model has.
fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_owned());
    }
    let rest = gguf.strip_prefix("blk.")?.strip_suffix(".weight")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let part = match part {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{part}.weight"))
}

/// The heads of a projection whose rows RoPE pairs (Q and K), `None` for other tensors.
fn rope_heads(gguf_name: &str, c: &ModelConfig) -> Option<usize> {
    if gguf_name.ends_with(".attn_q.weight") {
        Some(c.q_heads)
    } else if gguf_name.ends_with(".attn_k.weight") {
        Some(c.kv_heads)
    } else {
        None
    }
}

/// Reorders the rows of a Q or K projection (`heads × head_dim` rows of equal length).
/// Forward (`to_halves` false): from Hugging Face's order, where RoPE pairs rows `i` and
/// `i + d/2` of a head, to the adjacent order, where it pairs `2i` and `2i + 1`; backward
/// (`to_halves` true) the other way.
fn permute_rope<T: Copy>(data: &[T], heads: usize, head_dim: usize, to_halves: bool) -> Vec<T> {
    let row = data.len() / (heads * head_dim).max(1);
    let half = head_dim / 2;
    let mut out = data.to_vec();
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let adjacent = h * head_dim + 2 * i + j;
                let halves = h * head_dim + j * half + i;
                let (dst, src) = match to_halves {
                    false => (adjacent, halves),
                    true => (halves, adjacent),
                };
                out[dst * row..(dst + 1) * row].copy_from_slice(&data[src * row..(src + 1) * row]);
            }
        }
    }
    out
}

/// Writes a Llama-family GGUF model as a Hugging Face checkpoint in `dir` (created if
/// missing): `config.json`, `model.safetensors` with every weight dequantized to `dtype`
/// (F32, F16 or BF16; Q and K rows in Hugging Face's order) and `tokenizer.json`.
/// [`Checkpoint::open`] reads it back: with F32 the weights are bit for bit those the GGUF
/// file decodes to.
pub fn export(
    g: &Gguf,
    tokenizer: &Tokenizer,
    dir: &Path,
    dtype: DType,
) -> Result<(), EngineError> {
    let st_dtype = match dtype {
        DType::F32 => safetensors::Dtype::F32,
        DType::F16 => safetensors::Dtype::F16,
        DType::BF16 => safetensors::Dtype::BF16,
        other => {
            return Err(EngineError::Invalid(format!(
                "export to {other:?} (F32, F16 or BF16)"
            )));
        }
    };
    let c = ModelConfig::from_gguf(g)?;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| EngineError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut tensors = Vec::with_capacity(g.tensors.len());
    for (name, info) in &g.tensors {
        let hf = hf_name(name)
            .ok_or_else(|| EngineError::Unsupported(format!("tensor {name} in a Llama export")))?;
        let mut values = g.dequantize(name)?;
        if let Some(heads) = rope_heads(name, &c) {
            values = permute_rope(&values, heads, c.head_dim, true);
        }
        let data = float_bytes(&values, dtype)?;
        let shape = info.dims.iter().rev().copied().collect();
        tensors.push((
            hf,
            Owned {
                dtype: st_dtype,
                shape,
                data,
            },
        ));
    }
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(tensors, None, &path)
        .map_err(|e| EngineError::Invalid(format!("{}: {e}", path.display())))?;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.embed,
        "intermediate_size": c.ffn,
        "num_attention_heads": c.q_heads,
        "num_key_value_heads": c.kv_heads,
        "num_hidden_layers": c.layers,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab,
        "max_position_embeddings": c.context,
        "rope_theta": f64::from(c.rope_base),
        "rms_norm_eps": f64::from(c.rms_eps),
        "tie_word_embeddings": !g.tensors.contains_key("output.weight"),
        "hidden_act": "silu",
        "bos_token_id": tokenizer.bos(),
        "eos_token_id": tokenizer.eos(),
        "torch_dtype": match dtype { DType::F32 => "float32", DType::F16 => "float16", _ => "bfloat16" },
    });
    for (file, text) in [
        ("config.json", config.to_string()),
        ("tokenizer.json", tokenizer.to_hf_json()?),
    ] {
        let p = dir.join(file);
        std::fs::write(&p, text).map_err(io(&p))?;
    }
    Ok(())
}

/// A tensor `export` owns, in the form the safetensors writer takes.
struct Owned {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl safetensors::View for Owned {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }

    fn data_len(&self) -> usize {
        self.data.len()
    }
}
