//! `hsa capacity`: what one request reserves of the device and the host at each context length,
//! dense against the sparse variants, and how many requests fit the device budget. The figures
//! come from the accounting the scheduler admits by ([`engine::capacity::footprint`]). Only
//! the shape is needed: a GGUF file's metadata, or none at all for `--shape llama3-8b` (a
//! Hugging Face checkpoint is loaded whole to learn it).

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use coordinator::SparseConfig;
use engine::capacity::{BlockGeometry, footprint};
use engine::{EngineError, ModelConfig};

use crate::{FileConfig, write_json};

#[derive(Args)]
pub(crate) struct CapacityArgs {
    /// Context lengths (prompt and generated tokens together).
    #[arg(
        long,
        value_delimiter = ',',
        default_values_t = [4096, 8192, 16384, 32768, 65536, 131_072]
    )]
    contexts: Vec<usize>,
    /// Whose shape: the model's, or a Llama-3-8B-class one (32 layers, 32 query / 8 KV heads
    /// of 128).
    #[arg(long, value_enum, default_value_t = Shape::Model)]
    shape: Shape,
    /// Bytes per KV element (2: f16 or bf16, what the engine keeps).
    #[arg(long, default_value_t = 2)]
    kv_bytes: usize,
    /// Tokens each request generates (the rest of a context is its prompt).
    #[arg(long, default_value_t = 256)]
    generate: usize,
    /// The device budget in GiB (default: the config's `[engine] device_bytes`).
    #[arg(long, allow_negative_numbers = true)]
    device_gib: Option<f64>,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The model shapes `hsa capacity` reports on.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Shape {
    /// The model given (or the synthetic one).
    Model,
    /// A Llama-3-8B-class shape.
    Llama3_8b,
}

impl CapacityArgs {
    /// Whether the report needs the model file's shape.
    pub(crate) fn needs_model(&self) -> bool {
        matches!(self.shape, Shape::Model)
    }
}

/// The variants `capacity` reports without a config: every layer sparse at two budgets, and
/// the engine issue's Quest variant with two dense layers.
fn default_variants() -> Vec<(String, SparseConfig)> {
    let all = |budget: usize| SparseConfig {
        min_prompt_tokens: Some(1),
        ..SparseConfig::quest(budget)
    };
    vec![
        ("quest-2048".to_owned(), all(2048)),
        ("quest-1024".to_owned(), all(1024)),
        (
            "quest-1024+2dense".to_owned(),
            SparseConfig {
                dense_layers: vec![0, 1],
                ..all(1024)
            },
        ),
    ]
}

/// Prints the table (and writes the JSON) for `model` (`None`: the Llama-3-8B-class shape).
pub(crate) fn capacity(
    model: Option<&ModelConfig>,
    file: &FileConfig,
    a: &CapacityArgs,
) -> Result<(), EngineError> {
    let c = model.unwrap_or(&engine::synthetic::LLAMA3_8B);
    let budget = match a.device_gib {
        None => file.engine.device_bytes,
        // A cast would turn a negative or NaN budget into 0 bytes, and the table into zeros.
        Some(g) if !(g.is_finite() && g >= 0.0) => {
            return Err(EngineError::Invalid(format!(
                "--device-gib {g}: a budget is a finite number of GiB, 0 or more"
            )));
        }
        Some(g) => (g * f64::from(1u32 << 30)) as u64,
    };
    file.engine.validate()?;
    if !(1..=8).contains(&a.kv_bytes) {
        return Err(EngineError::Invalid(format!(
            "--kv-bytes {}: an element takes 1 to 8 bytes",
            a.kv_bytes
        )));
    }
    if a.contexts.contains(&0) {
        return Err(EngineError::Invalid(
            "--contexts 0: a context holds at least one token".to_owned(),
        ));
    }
    let variants = if file.variants.is_empty() {
        default_variants()
    } else {
        file.variants.clone().into_iter().collect()
    };
    let shape = c.shape();
    let lowered = variants
        .iter()
        .map(|(name, v)| {
            v.lower(shape, None)
                .map_err(|e| EngineError::Invalid(format!("variant {name}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bs = file.engine.block_size;
    let geometry = BlockGeometry {
        tokens: bs,
        bytes: c.kv_bytes_per_token(a.kv_bytes).saturating_mul(bs) as u64,
    };
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    eprintln!(
        "{} layers, {} query / {} KV heads of {}, {}-byte KV, blocks of {bs}; device budget {:.1} GiB; {} generated tokens per request",
        c.layers,
        c.q_heads,
        c.kv_heads,
        c.head_dim,
        a.kv_bytes,
        mib(budget) / 1024.0,
        a.generate
    );
    print!("{:>8} {:>12} {:>6}", "context", "dense MiB", "max");
    for (name, _) in &variants {
        print!(" {:>24} {:>6} {:>6}", format!("{name} MiB"), "×", "max");
    }
    println!();
    let mut rows = Vec::new();
    for &ctx in &a.contexts {
        let prompt = ctx.saturating_sub(a.generate).max(1);
        let dense = footprint(None, shape, a.kv_bytes, geometry, prompt, ctx);
        print!(
            "{ctx:>8} {:>12.1} {:>6}",
            mib(dense.decode_reserve),
            dense.max_concurrent(budget)
        );
        let mut vs = Vec::new();
        for ((name, _), l) in variants.iter().zip(&lowered) {
            let f = footprint(Some(l), shape, a.kv_bytes, geometry, prompt, ctx);
            let ratio = dense.decode_reserve as f64 / f.decode_reserve.max(1) as f64;
            let host = (f.host_pages as u64).saturating_mul(geometry.token_bytes(l.page_size));
            print!(
                " {:>24.1} {ratio:>6.1} {:>6}",
                mib(f.decode_reserve),
                f.max_concurrent(budget)
            );
            vs.push(serde_json::json!({
                "name": name, "sparse": f.sparse, "device_bytes": f.decode_reserve,
                "prefill_device_bytes": f.reserve, "host_bytes": host, "ratio": ratio,
                "max_requests": f.max_concurrent(budget),
            }));
        }
        println!();
        rows.push(serde_json::json!({
            "context": ctx,
            "dense": { "device_bytes": dense.decode_reserve, "max_requests": dense.max_concurrent(budget) },
            "variants": vs,
        }));
    }
    if let Some(p) = &a.json {
        write_json(
            p,
            &serde_json::json!({
                "shape": { "layers": c.layers, "q_heads": c.q_heads, "kv_heads": c.kv_heads, "head_dim": c.head_dim },
                "kv_bytes": a.kv_bytes, "block_size": bs, "device_budget": budget,
                "generate": a.generate, "rows": rows,
            }),
        )?;
    }
    Ok(())
}
