//! `hsa run`: a workload of many requests through the batching scheduler, then a report.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use coordinator::SparseConfig;
use engine::{EngineError, Event, Model, Report, Request, Sampling, Scheduler, Tokenizer};
use serde::Deserialize;

use crate::{FileConfig, bar, hit_rate, read, write_json};

#[derive(Args)]
pub(crate) struct RunArgs {
    /// A TOML workload: `[[request]]` tables (see `Workload`). Without one, a built-in
    /// workload is cut from `--text`.
    #[arg(long)]
    workload: Option<PathBuf>,
    /// The text the built-in workload's prompts are cut from.
    #[arg(long, default_value = "/usr/share/common-licenses/GPL-3")]
    text: PathBuf,
    /// Requests of the built-in workload (1 to 65536; every prompt is cut before the run, and a
    /// `--workload` file holds as many at most).
    #[arg(long, default_value_t = 8, value_parser = workload_size)]
    requests: usize,
    /// Longest prompt of the built-in workload in tokens, at least 1 (prompts spread from a
    /// quarter of it up).
    #[arg(long, default_value_t = 4096, value_parser = at_least_one)]
    max_prompt: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// The sparse variant of the built-in workload's sparse half: a `[variants.NAME]` of the
    /// config, or the default (Quest, 1024 tokens, every layer sparse).
    #[arg(long)]
    variant: Option<String>,
    /// The device budget in MiB (overrides the config's `[engine]`).
    #[arg(long)]
    device_mib: Option<u64>,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// A workload file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Workload {
    /// The requests, in submission order.
    request: Vec<WorkloadRequest>,
}

/// One `[[request]]` of a workload (repeated `count` times).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkloadRequest {
    /// The prompt text; or `file` with `offset` and `tokens`.
    prompt: Option<String>,
    /// A file whose tokens `offset..offset + tokens` are the prompt.
    file: Option<PathBuf>,
    #[serde(default)]
    offset: usize,
    tokens: Option<usize>,
    /// Sampling (default: the config's `[sampling]`).
    sampling: Option<Sampling>,
    /// A `[variants.NAME]` of the config; absent: dense.
    sparse: Option<String>,
    #[serde(default = "one")]
    count: usize,
}

fn one() -> usize {
    1
}

/// A count that must be positive (clap prints the error with the flag's name).
pub(crate) fn at_least_one(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// The most requests of a run, built-in or from a file: all of its prompts are held before
/// the run, so a mistyped count would otherwise fill the memory before the first step.
const MAX_REQUESTS: usize = 1 << 16;

/// A request count of the built-in workload, 1 to [`MAX_REQUESTS`].
fn workload_size(v: &str) -> Result<usize, String> {
    match at_least_one(v)? {
        n if n > MAX_REQUESTS => Err(format!(
            "the built-in workload holds at most {MAX_REQUESTS} requests"
        )),
        n => Ok(n),
    }
}

/// The default sparse variant of the built-in workload.
fn default_variant() -> SparseConfig {
    SparseConfig::quest(1024)
}

pub(crate) fn run(
    model: &Model,
    tok: &Tokenizer,
    file: &FileConfig,
    a: &RunArgs,
) -> Result<(), EngineError> {
    let variant = |name: &str| {
        file.variants
            .get(name)
            .cloned()
            .ok_or_else(|| EngineError::Invalid(format!("no [variants.{name}] in the config")))
    };
    let requests = match &a.workload {
        Some(p) => {
            let w: Workload = toml::from_str(&read(p)?)
                .map_err(|e| EngineError::Invalid(format!("{}: {e}", p.display())))?;
            let mut texts: BTreeMap<PathBuf, Vec<u32>> = BTreeMap::new();
            let mut out = Vec::new();
            for r in w.request {
                let prompt = match (&r.prompt, &r.file) {
                    (Some(p), None) => tok.encode(p)?,
                    (None, Some(f)) => {
                        if !texts.contains_key(f) {
                            texts.insert(f.clone(), tok.encode(&read(f)?)?);
                        }
                        let ids = &texts[f];
                        if r.offset >= ids.len() {
                            return Err(EngineError::Invalid(format!(
                                "{}: offset {} is past its {} tokens",
                                f.display(),
                                r.offset,
                                ids.len()
                            )));
                        }
                        let end = r
                            .tokens
                            .map_or(ids.len(), |n| r.offset.saturating_add(n))
                            .min(ids.len());
                        ids[r.offset..end].to_vec()
                    }
                    _ => {
                        return Err(EngineError::Invalid(
                            "a [[request]] needs `prompt` or `file`".into(),
                        ));
                    }
                };
                if r.count > MAX_REQUESTS - out.len() {
                    return Err(EngineError::Invalid(format!(
                        "{}: a workload holds at most {MAX_REQUESTS} requests",
                        p.display()
                    )));
                }
                let sparse = r.sparse.as_deref().map(variant).transpose()?;
                let sampling = r.sampling.clone().unwrap_or_else(|| file.sampling.clone());
                for _ in 0..r.count {
                    out.push(Request {
                        prompt: prompt.clone(),
                        sampling: sampling.clone(),
                        sparse: sparse.clone(),
                    });
                }
            }
            out
        }
        None => {
            let sparse = match &a.variant {
                Some(v) => variant(v)?,
                None => default_variant(),
            };
            builtin(tok, &read(&a.text)?, a, &sparse)?
        }
    };
    let mut config = file.engine.clone();
    if let Some(m) = a.device_mib {
        config.device_bytes = m.saturating_mul(1 << 20);
    }
    let mut s = Scheduler::<half::f16>::new(model, Some(tok), config.clone())?;
    let expected = requests
        .iter()
        .fold(0usize, |n, r| n.saturating_add(r.sampling.max_tokens));
    let t0 = Instant::now();
    for r in requests {
        s.submit(r)?;
    }
    let b = bar(expected, "run");
    let (mut reports, mut generated, mut peak_running, mut peak_reserved, mut steps) =
        (BTreeMap::new(), 0usize, 0, 0, 0usize);
    while !s.is_idle() {
        for e in s.step()? {
            match e {
                Event::Token { .. } => {
                    generated += 1;
                    b.set_position(generated as u64);
                }
                Event::Finished(r) => {
                    reports.insert(r.id, *r);
                }
                Event::Admitted { .. } => {}
            }
        }
        steps += 1;
        let u = s.usage();
        peak_running = peak_running.max(u.running);
        peak_reserved = peak_reserved.max(u.reserved_bytes);
    }
    b.finish_and_clear();
    let wall = t0.elapsed().as_secs_f64();
    let reports: Vec<Report> = reports.into_values().collect();
    print_reports(&reports);
    let totals = s.sparse_totals();
    let u = s.usage();
    let mib = |b: u64| b as f64 / 1_048_576.0;
    println!(
        "{} requests, {generated} tokens in {wall:.2}s ({:.1} tok/s over {steps} steps); peak \
         {peak_running} running, {:.1} of {:.1} device MiB reserved; sparse: hit rate {:.3}, \
         {:.1} MiB moved; cached blocks left: {} device, {} host",
        reports.len(),
        generated as f64 / wall.max(1e-9),
        mib(peak_reserved),
        mib(config.device_bytes),
        hit_rate(&totals),
        mib(totals.bytes),
        u.device_blocks_cached,
        u.host_blocks_cached,
    );
    if let Some(p) = &a.json {
        write_json(
            p,
            &serde_json::json!({
                "requests": reports, "generated": generated, "wall_s": wall, "steps": steps,
                "tokens_per_s": generated as f64 / wall.max(1e-9), "peak_running": peak_running,
                "peak_reserved_bytes": peak_reserved, "engine": config,
                "sparse_hit_rate": hit_rate(&totals), "sparse_bytes_moved": totals.bytes,
            }),
        )?;
    }
    Ok(())
}

/// The built-in workload: `a.requests` prompts cut from `text`, lengths spread from a quarter
/// of `a.max_prompt` up, every other one sharing the text's opening (a common prefix), and
/// every other pair in sparse mode.
fn builtin(
    tok: &Tokenizer,
    text: &str,
    a: &RunArgs,
    sparse: &SparseConfig,
) -> Result<Vec<Request>, EngineError> {
    let ids = tok.encode(text)?;
    if ids.is_empty() {
        return Err(EngineError::Invalid(format!(
            "{}: no tokens to cut the built-in workload's prompts from",
            a.text.display()
        )));
    }
    let n = a.requests;
    let max = a.max_prompt.min(ids.len());
    (0..n)
        .map(|i| {
            let len = (max / 4 + (max - max / 4) * i / n.max(2).saturating_sub(1)).clamp(1, max);
            let at = if i % 2 == 0 {
                0
            } else {
                (i * 997) % (ids.len() - len + 1)
            };
            Ok(Request {
                prompt: ids[at..at + len].to_vec(),
                sampling: Sampling {
                    max_tokens: a.max_tokens,
                    stop_at_eos: false,
                    ..Sampling::default()
                },
                sparse: (i / 2 % 2 == 1).then(|| sparse.clone()),
            })
        })
        .collect()
}

fn print_reports(reports: &[Report]) {
    println!(
        "{:>4} {:>6} {:>7} {:>7} {:>5} {:>7} {:>11} {:>11} {:>8} {:>8} {:>8}",
        "id",
        "mode",
        "prompt",
        "reused",
        "gen",
        "end",
        "prefill MiB",
        "decode MiB",
        "queue s",
        "ttft s",
        "total s"
    );
    for r in reports {
        println!(
            "{:>4} {:>6} {:>7} {:>7} {:>5} {:>7} {:>11.1} {:>11.1} {:>8.2} {:>8.2} {:>8.2}",
            r.id,
            if r.sparse { "sparse" } else { "dense" },
            r.prompt_tokens,
            r.reused_tokens,
            r.tokens.len(),
            format!("{:?}", r.reason).to_lowercase(),
            r.device_bytes as f64 / 1_048_576.0,
            r.decode_device_bytes as f64 / 1_048_576.0,
            r.queued_s,
            r.first_token_s.unwrap_or(f64::NAN),
            r.total_s,
        );
    }
}
