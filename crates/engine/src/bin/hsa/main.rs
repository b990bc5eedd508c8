//! `hsa`: generate text with a GGUF model, run workloads of many requests through the batching
//! scheduler, and evaluate dense against hierarchical sparse attention on it.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod capacity;
mod run;

use clap::{Args, Parser, Subcommand};
use coordinator::SparseConfig;
use engine::eval::{EvalOptions, VariantReport};
use engine::gguf::Gguf;
use engine::{EngineError, Model, ModelConfig, Sampling, SchedulerConfig, Tokenizer};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;

/// Where `cargo xtask fetch-model` puts the model.
const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser)]
#[command(
    name = "hsa",
    version,
    about = "Hierarchical sparse attention engine (CPU; CUDA GPUs in a build with the `cuda` feature)"
)]
struct Cli {
    /// A TOML file: `model`, `[sampling]`, `[sparse]` and `[variants.NAME]` tables.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// The model: a GGUF file, or a Hugging Face checkpoint directory (`config.json`,
    /// safetensors, `tokenizer.json`). Default: the config's `model`, else the GGUF file
    /// `cargo xtask fetch-model` fetches.
    #[arg(long, global = true)]
    model: Option<PathBuf>,
    /// Run a synthetic model of the real model's shape with random weights and a byte-level
    /// tokenizer instead of a file (its text and perplexity are noise; bytes and speed are
    /// real).
    #[arg(long, global = true, conflicts_with = "model")]
    synthetic: bool,
    /// How long, in microseconds, the CPU attention's helper threads wait (spinning, while
    /// running the pool's other work) for the next call before they sleep; 0 turns it off
    /// (attn-op's default, 250, unless given).
    #[arg(long, global = true)]
    linger_us: Option<u64>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generates text from a prompt, streamed, then prints stats.
    Generate(GenerateArgs),
    /// A workload of many requests through the batching scheduler: a table per request
    /// (mode, prefix reuse, device bytes, latencies) and the throughput.
    Run(run::RunArgs),
    /// Dense against sparse variants on a text: perplexity, top-1 agreement, logit drift,
    /// mass recall, bytes and speed; optionally passkey retrieval.
    Eval(EvalArgs),
    /// Device and host bytes per request against context length, dense against sparse, and
    /// how many requests fit the device budget.
    Capacity(capacity::CapacityArgs),
    /// Writes a GGUF model as a Hugging Face checkpoint (safetensors, weights dequantized).
    Export(ExportArgs),
}

#[derive(Args)]
struct ExportArgs {
    /// The directory to write `config.json`, `model.safetensors` and `tokenizer.json` into.
    #[arg(long)]
    out: PathBuf,
    /// The weights' encoding.
    #[arg(long, value_enum, default_value_t = ExportDtype::Bf16)]
    dtype: ExportDtype,
}

/// The encodings `hsa export` writes.
#[derive(Clone, Copy, clap::ValueEnum)]
enum ExportDtype {
    F32,
    F16,
    Bf16,
}

#[derive(Args)]
struct GenerateArgs {
    /// The prompt.
    #[arg(long, conflicts_with = "file")]
    prompt: Option<String>,
    /// A file holding the prompt.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Wrap the prompt in the model's chat template (ChatML).
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// 0: greedy.
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Nucleus sampling threshold.
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Sampling seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop strings (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Attend through the sparse coordinator with the config's `[sparse]` table (its
    /// defaults without one).
    #[arg(long)]
    sparse: bool,
    /// Run on the first CUDA GPU (weights and KV in f16; sparse layers through the
    /// coordinator's device hooks). Needs a build with the `cuda` feature.
    #[arg(long)]
    gpu: bool,
}

#[derive(Args)]
struct EvalArgs {
    /// The text (default: the GPL-3 text Debian ships in /usr/share/common-licenses); given
    /// several times, the files are joined by blank lines.
    #[arg(long, default_value = "/usr/share/common-licenses/GPL-3")]
    text: Vec<PathBuf>,
    /// Use the first N tokens of the text.
    #[arg(long)]
    tokens: Option<usize>,
    /// Tokens prefilled before the teacher-forced decode (default: all but the last 512).
    #[arg(long)]
    prefill: Option<usize>,
    /// Skip the attention-mass recall measurement.
    #[arg(long)]
    no_recall: bool,
    /// Passkey retrieval at these contexts (e.g. 4096,8000), 10 depths each.
    #[arg(long, value_delimiter = ',')]
    passkey: Vec<usize>,
    /// Depths per passkey context (at least 1).
    #[arg(long, default_value_t = 10, value_parser = run::at_least_one)]
    passkey_trials: usize,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the evaluated token ids here (JSON), for the llama.cpp peer.
    #[arg(long)]
    tokens_out: Option<PathBuf>,
    /// Write the dense model's per-position arg-max and largest logit here (JSON), for the
    /// llama.cpp peer: the engine's forward, and the same model rounding as llama.cpp does
    /// (`like_llama_cpp`, see `engine::ggml`).
    #[arg(long)]
    argmax_out: Option<PathBuf>,
}

/// The TOML configuration file.
#[derive(Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct FileConfig {
    model: Option<PathBuf>,
    sampling: Sampling,
    sparse: SparseConfig,
    /// The batching scheduler of `run` (`[engine]`).
    engine: SchedulerConfig,
    /// Sparse variants of `eval` and `run`, by name (default: see `engine::eval::default_variants`).
    variants: BTreeMap<String, SparseConfig>,
}

fn main() -> ExitCode {
    quiet_broken_pipe();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Lets a write to a closed pipe end the process quietly, as it ends `cat`, instead of
/// panicking: `hsa capacity | head` closes the pipe after ten lines. Rust starts programs with
/// SIGPIPE ignored, which turns such a write into an error that `println!` panics on.
fn quiet_broken_pipe() {
    #[cfg(unix)]
    // SAFETY: called first in `main`, before any other thread exists; restoring a signal's
    // default action touches no memory of this program.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn run(cli: Cli) -> Result<(), EngineError> {
    if let Some(us) = cli.linger_us {
        attn_op::set_linger(std::time::Duration::from_micros(us));
    }
    let file = match &cli.config {
        None => FileConfig::default(),
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|source| EngineError::Io {
                path: p.clone(),
                source,
            })?;
            toml::from_str(&text)
                .map_err(|e| EngineError::Invalid(format!("{}: {e}", p.display())))?
        }
    };
    if let Command::Capacity(a) = &cli.command
        && !a.needs_model()
    {
        return capacity::capacity(None, &file, a);
    }
    let path = cli
        .model
        .clone()
        .or_else(|| file.model.clone())
        .unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL));
    // `None`: a Hugging Face checkpoint directory.
    let gguf = if cli.synthetic {
        eprintln!("synthetic model: SmolLM2-135M's shape, random Q4_1 weights, byte tokens");
        Some(Gguf::from_bytes(engine::synthetic::synthetic_gguf(
            &engine::synthetic::SMOLLM2_135M,
            engine::gguf::DType::Q4_1,
            1,
        ))?)
    } else if path.is_dir() {
        None
    } else if path.exists() {
        Some(Gguf::open(&path)?)
    } else {
        return Err(EngineError::Invalid(format!(
            "no model at {} (run `cargo xtask fetch-model`, pass --model, or --synthetic)",
            path.display()
        )));
    };
    let load = || -> Result<(Tokenizer, Model), EngineError> {
        match &gguf {
            Some(g) => Ok((Tokenizer::from_gguf(g)?, Model::load(g)?)),
            None => {
                let ck = engine::hf::Checkpoint::open(&path)?;
                Ok((ck.tokenizer()?, ck.model()?))
            }
        }
    };
    match cli.command {
        Command::Generate(a) => {
            let (tokenizer, model) = load()?;
            generate(&model, &tokenizer, &file, a)
        }
        Command::Eval(a) => {
            let (tokenizer, model) = load()?;
            eval(&model, &tokenizer, &file, &a)
        }
        Command::Run(a) => {
            let (tokenizer, model) = load()?;
            run::run(&model, &tokenizer, &file, &a)
        }
        Command::Export(a) => export(gguf.as_ref(), &path, &a),
        Command::Capacity(a) => {
            let config = match &gguf {
                Some(g) => ModelConfig::from_gguf(g)?,
                None => load()?.1.config,
            };
            capacity::capacity(Some(&config), &file, &a)
        }
    }
}

/// `hsa export`: the GGUF model written as a Hugging Face checkpoint.
fn export(gguf: Option<&Gguf>, path: &Path, a: &ExportArgs) -> Result<(), EngineError> {
    let g = gguf.ok_or_else(|| {
        EngineError::Invalid(format!(
            "{} is already a Hugging Face checkpoint",
            path.display()
        ))
    })?;
    let dtype = match a.dtype {
        ExportDtype::F32 => engine::gguf::DType::F32,
        ExportDtype::F16 => engine::gguf::DType::F16,
        ExportDtype::Bf16 => engine::gguf::DType::BF16,
    };
    engine::hf::export(g, &Tokenizer::from_gguf(g)?, &a.out, dtype)?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

fn bar(len: usize, what: &str) -> ProgressBar {
    let b = ProgressBar::new(len as u64);
    b.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} {elapsed} (eta {eta})")
            .expect("a constant, valid template")
            .progress_chars("=> "),
    );
    b.set_message(what.to_owned());
    b
}

fn generate(
    model: &Model,
    tok: &Tokenizer,
    file: &FileConfig,
    a: GenerateArgs,
) -> Result<(), EngineError> {
    let mut text = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read(f)?,
        (None, None) => return Err(EngineError::Invalid("give --prompt or --file".into())),
    };
    if a.chat {
        text = format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n");
    }
    let mut s = file.sampling.clone();
    s.max_tokens = a.max_tokens.unwrap_or(s.max_tokens);
    s.temperature = a.temperature.unwrap_or(s.temperature);
    s.top_p = a.top_p.unwrap_or(s.top_p);
    s.seed = a.seed.unwrap_or(s.seed);
    s.stop.extend(a.stop);
    if a.chat {
        s.stop.push("<|im_end|>".to_owned());
    }
    let prompt = tok.encode(&text)?;
    let b = bar(prompt.len(), "prefill");
    let sparse = a.sparse.then_some(&file.sparse);
    let mut out = std::io::stdout();
    let on_text = |t: &str| {
        if !b.is_finished() {
            b.finish_and_clear();
        }
        let _ = write!(out, "{t}");
        let _ = out.flush();
    };
    let progress = |d: usize, _| b.set_position(d as u64);
    let (_, st) = if a.gpu {
        generate_gpu(model, tok, &prompt, &s, sparse, on_text, progress)?
    } else {
        engine::generate::<half::f16>(model, tok, &prompt, &s, sparse, on_text, progress)?
    };
    println!();
    eprintln!(
        "prompt {} tokens in {:.2}s ({:.1} tok/s); generated {} in {:.2}s ({:.1} tok/s); {}",
        st.prompt_tokens,
        st.prefill_s,
        st.prompt_tokens as f64 / st.prefill_s.max(1e-9),
        st.generated,
        st.decode_s,
        st.generated as f64 / st.decode_s.max(1e-9),
        if st.sparse {
            format!(
                "sparse: hit rate {:.3}, {:.0} KiB moved per step",
                hit_rate(&st.stats),
                st.stats.bytes as f64 / 1024.0 / st.generated.max(1) as f64
            )
        } else {
            dense_because(model, sparse)?
        }
    );
    Ok(())
}

/// How `generate`'s summary names a dense run: plainly, or, where sparse attention was asked
/// for, with why the request ran dense.
fn dense_because(model: &Model, sparse: Option<&SparseConfig>) -> Result<String, EngineError> {
    let Some(config) = sparse else {
        return Ok("dense".to_owned());
    };
    Ok(
        match config.lower(model.config.shape(), None)?.sparse_from() {
            Some(n) => {
                format!("dense: sparse mode starts at {n} prompt tokens (min_prompt_tokens)")
            }
            None => "dense: the sparse config makes no layer sparse".to_owned(),
        },
    )
}

/// `engine::gpu_request::generate_gpu` with the model's weights uploaded to the first CUDA
/// device in f16; refused without the `cuda` feature.
fn generate_gpu(
    model: &Model,
    tok: &Tokenizer,
    prompt: &[u32],
    sampling: &Sampling,
    sparse: Option<&SparseConfig>,
    on_text: impl FnMut(&str),
    progress: impl FnMut(usize, usize),
) -> Result<(Vec<u32>, engine::GenerateStats), EngineError> {
    #[cfg(feature = "cuda")]
    {
        let gpu = engine::gpu::open_gpu(0)?;
        let gm = engine::gpu::GpuModel::<half::f16>::upload(model, gpu)?;
        engine::gpu_request::generate_gpu(&gm, tok, prompt, sampling, sparse, on_text, progress)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (model, tok, prompt, sampling, sparse, on_text, progress);
        Err(EngineError::Invalid(
            "--gpu needs hsa built with the cuda feature (cargo build --release -p engine \
             --features cuda)"
                .into(),
        ))
    }
}

fn read(p: &Path) -> Result<String, EngineError> {
    std::fs::read_to_string(p).map_err(|source| EngineError::Io {
        path: p.to_owned(),
        source,
    })
}

fn hit_rate(s: &offload::StepStats) -> f64 {
    s.hits as f64 / (s.hits + s.misses).max(1) as f64
}

fn eval(
    model: &Model,
    tok: &Tokenizer,
    file: &FileConfig,
    a: &EvalArgs,
) -> Result<(), EngineError> {
    let text = a
        .text
        .iter()
        .map(|p| read(p))
        .collect::<Result<Vec<_>, _>>()?
        .join("\n\n");
    let mut ids = tok.encode(&text)?;
    ids.truncate(a.tokens.unwrap_or(usize::MAX).min(model.config.context));
    let n = ids.len();
    let prefill = a.prefill.unwrap_or(n.saturating_sub(512).max(1));
    let variants: Vec<(String, SparseConfig)> = if file.variants.is_empty() {
        engine::eval::default_variants(n)
    } else {
        file.variants.clone().into_iter().collect()
    };
    let opts = EvalOptions {
        prefill,
        chunk: engine::PREFILL_CHUNK,
        block_size: 16,
        recall: !a.no_recall,
    };
    eprintln!(
        "{}: {n} tokens; prefill {prefill}, then {} teacher-forced decode positions; variants: dense, {}",
        a.text
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" + "),
        n.saturating_sub(prefill.saturating_add(1)),
        variants
            .iter()
            .map(|v| v.0.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let b = bar(n.saturating_sub(prefill.saturating_add(1)), "decode");
    let reports =
        engine::eval::teacher_forced::<half::f16>(model, &ids, &variants, &opts, |d, _| {
            b.set_position(d as u64);
        })?;
    b.finish_and_clear();
    print_table(&reports);
    let mut passkeys = Vec::new();
    for &ctx in &a.passkey {
        let b = bar(a.passkey_trials, &format!("passkey {ctx}"));
        let r = engine::eval::passkey::<half::f16>(
            model,
            tok,
            ctx,
            a.passkey_trials,
            &variants,
            &opts,
            |d, _| b.set_position(d as u64),
        )?;
        b.finish_and_clear();
        for (name, ok) in &r {
            println!("passkey {ctx}: {name:<24} {ok}/{}", a.passkey_trials);
        }
        passkeys.push((ctx, r));
    }
    if let Some(p) = &a.tokens_out {
        write_json(p, &serde_json::json!(ids))?;
    }
    if let Some(p) = &a.argmax_out {
        // Both traces in llama.cpp's default batch, so that the second rounds as it does.
        let opts = EvalOptions { chunk: 512, ..opts };
        let b = bar(n, "arg-max");
        let ours = engine::eval::greedy_trace::<half::f16>(model, &ids, &opts, |d| {
            b.set_position(d as u64);
        })?;
        b.finish_and_clear();
        let b = bar(n, "llama.cpp's");
        let like = engine::eval::greedy_trace_like_llama_cpp(model, &ids, &opts, |d| {
            b.set_position(d as u64);
        })?;
        b.finish_and_clear();
        write_json(
            p,
            &serde_json::json!({
                "start": 0,
                "argmax": ours.argmax,
                "top_logit": ours.top_logit,
                "like_llama_cpp": { "argmax": like.argmax, "top_logit": like.top_logit },
            }),
        )?;
    }
    if let Some(p) = &a.json {
        let mut v = Vec::with_capacity(reports.len());
        for r in &reports {
            let mut j = report_json(r);
            // The variant's configuration and its hot buffer as lowered for this model.
            if let Some((_, c)) = variants.iter().find(|(name, _)| *name == r.name) {
                let l = c
                    .lower(model.config.shape(), None)
                    .map_err(|e| EngineError::Invalid(format!("variant {}: {e}", r.name)))?;
                j["config"] = serde_json::json!(c);
                j["hot_tokens"] = serde_json::json!(l.hot_pages * l.page_size);
            }
            v.push(j);
        }
        let pk: Vec<_> = passkeys
            .iter()
            .map(|(ctx, r)| serde_json::json!({ "context": ctx, "trials": a.passkey_trials, "correct": r }))
            .collect();
        write_json(
            p,
            &serde_json::json!({ "text": a.text, "tokens": n, "prefill": prefill, "variants": v, "passkey": pk }),
        )?;
    }
    Ok(())
}

fn write_json(p: &Path, v: &serde_json::Value) -> Result<(), EngineError> {
    std::fs::write(p, v.to_string()).map_err(|source| EngineError::Io {
        path: p.to_owned(),
        source,
    })
}

fn report_json(r: &VariantReport) -> serde_json::Value {
    serde_json::json!({
        "name": r.name, "sparse": r.sparse, "positions": r.positions,
        "perplexity": r.perplexity(), "top1_agreement": r.top1_agreement,
        "max_logit_diff": r.max_logit_diff, "mass_recall": r.recall,
        "device_bytes": r.device_bytes, "host_bytes": r.host_bytes,
        "bytes_per_step": r.stats.bytes as f64 / r.positions.max(1) as f64,
        "prefetched_bytes_per_step": r.prefetched.bytes as f64 / r.positions.max(1) as f64,
        "hit_rate": hit_rate(&r.stats), "tokens_per_s": r.tokens_per_s,
    })
}

fn print_table(reports: &[VariantReport]) {
    // The name column fits the longest name (a config's variants may be long).
    let w = reports
        .iter()
        .map(|r| r.name.len())
        .max()
        .unwrap_or(0)
        .max(7);
    println!(
        "{:<w$} {:>6} {:>9} {:>7} {:>9} {:>7} {:>10} {:>10} {:>11} {:>11} {:>6} {:>7}",
        "variant",
        "mode",
        "ppl",
        "top-1",
        "max|Δlogit|",
        "recall",
        "device MiB",
        "host MiB",
        "KiB/step",
        "early KiB",
        "hit",
        "tok/s"
    );
    let mib = |b: usize| b as f64 / 1_048_576.0;
    for r in reports {
        println!(
            "{:<w$} {:>6} {:>9.4} {:>7.4} {:>9.4} {:>7} {:>10.1} {:>10.1} {:>11.1} {:>11.1} {:>6} {:>7.1}",
            r.name,
            if r.sparse { "sparse" } else { "dense" },
            r.perplexity(),
            r.top1_agreement,
            r.max_logit_diff,
            r.recall.map_or("-".to_owned(), |x| format!("{x:.4}")),
            mib(r.device_bytes),
            mib(r.host_bytes),
            r.stats.bytes as f64 / 1024.0 / r.positions.max(1) as f64,
            r.prefetched.bytes as f64 / 1024.0 / r.positions.max(1) as f64,
            if r.sparse {
                format!("{:.3}", hit_rate(&r.stats))
            } else {
                "-".to_owned()
            },
            r.tokens_per_s,
        );
    }
}
