//! Fidelity evaluation: one text, dense and sparse variants side by side.
//!
//! The text's first `prefill` tokens are prefilled once (densely: every variant's prefill is
//! dense attention), then every variant decodes the rest teacher-forced, in lockstep: at each
//! position each variant predicts the next token of the text, and its logits are compared with
//! the dense variant's at the same position.

use std::time::Instant;

use attn_op::Element;
use coordinator::{Mode, SparseConfig, SparseCoordinator};
use kv_blocks::RequestId;
use offload::StepStats;
use sparse_algo::{AlgoConfig, AlwaysInclude, QuestConfig, Summary};

use crate::EngineError;
use crate::ggml::GgmlAttention;
use crate::kv::{Batch, DenseAttention, KvStore};
use crate::model::{Attention, Model};
use crate::sparse::{forward_one, single_request};

/// How the evaluation runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvalOptions {
    /// Tokens prefilled before the teacher-forced decode starts.
    pub prefill: usize,
    /// Tokens per prefill forward (chunked prefill).
    pub chunk: usize,
    /// Tokens per block of the engine's own cache.
    pub block_size: usize,
    /// Measure the attention-mass recall of every sparse selection (costs a dense pass over
    /// the keys per sparse row).
    pub recall: bool,
}

/// What one variant did over the decoded positions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VariantReport {
    /// The variant's name.
    pub name: String,
    /// Whether the request ran in sparse mode (a prompt shorter than the sparse threshold
    /// stays dense).
    pub sparse: bool,
    /// Positions decoded (each predicts the next token of the text).
    pub positions: usize,
    /// Mean negative log-likelihood of the text's next token (nats).
    pub nll: f64,
    /// Share of positions whose arg-max equals the dense variant's.
    pub top1_agreement: f64,
    /// Largest `|logit - dense logit|` over every position and token.
    pub max_logit_diff: f32,
    /// Mean attention-mass recall of the selections (sparse rows, every query head).
    pub recall: Option<f64>,
    /// Hot-buffer hits, misses and bytes moved over the decode (the misses: loads in the
    /// steps themselves).
    pub stats: StepStats,
    /// Pages loaded early by the configuration's prefetch (`misses`, `bytes`), off the
    /// steps' own loads.
    pub prefetched: StepStats,
    /// Device bytes the request holds at its full length: KV of dense layers, hot buffers
    /// and representations of sparse ones.
    pub device_bytes: usize,
    /// Host bytes the request holds (the sparse layers' full KV).
    pub host_bytes: usize,
    /// Decode tokens per second (one request, teacher-forced). The time measuring `recall`
    /// takes is not counted: it is the evaluation's work, not the decode's.
    pub tokens_per_s: f64,
}

impl VariantReport {
    /// Perplexity over the decoded positions.
    pub fn perplexity(&self) -> f64 {
        self.nll.exp()
    }
}

/// A variant in progress.
struct Run<T: Element> {
    report: VariantReport,
    store: KvStore<T>,
    coord: Option<SparseCoordinator<T>>,
    /// Tokens in its cache.
    len: usize,
    argmax: Vec<u32>,
    nll: f64,
    recall: (f64, usize),
    seconds: f64,
}

const ID: RequestId = RequestId(1);

/// Evaluates dense (always first in the result) and every `(name, config)` sparse variant
/// on `tokens`; `progress(done, total)` is called after every decode position. The prefill
/// must leave at least one position to score: `opts.prefill + 1 < tokens.len()`.
pub fn teacher_forced<T: Element>(
    model: &Model,
    tokens: &[u32],
    variants: &[(String, SparseConfig)],
    opts: &EvalOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<VariantReport>, EngineError> {
    let n = tokens.len();
    // Position p predicts token p + 1, so positions prefill .. n - 1 are scored.
    if opts.prefill.saturating_add(1) >= n {
        return Err(EngineError::Invalid(format!(
            "a prefill of {} leaves nothing to decode in {n} tokens",
            opts.prefill
        )));
    }
    let mut lock = Lockstep::<T>::prefill(model, &tokens[..opts.prefill], n, variants, opts)?;
    let total = n - 1 - opts.prefill;
    for p in opts.prefill..n - 1 {
        let mut dense_logits = Vec::new();
        for i in 0..lock.runs.len() {
            let logits = lock.step(model, i, tokens[p], opts.recall)?;
            let run = &mut lock.runs[i];
            run.nll += nll(&logits, tokens[p + 1] as usize);
            run.argmax.push(argmax(&logits));
            if i == 0 {
                dense_logits = logits;
            } else {
                let d = logits
                    .iter()
                    .zip(&dense_logits)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                run.report.max_logit_diff = run.report.max_logit_diff.max(d);
            }
        }
        progress(p + 1 - opts.prefill, total);
    }
    let reference = lock.runs[0].argmax.clone();
    Ok(lock
        .runs
        .into_iter()
        .map(|r| {
            let mut rep = r.report;
            rep.positions = total;
            rep.nll = r.nll / total.max(1) as f64;
            let same = r
                .argmax
                .iter()
                .zip(&reference)
                .filter(|(a, b)| a == b)
                .count();
            rep.top1_agreement = same as f64 / total.max(1) as f64;
            rep.recall = (r.recall.1 > 0).then(|| r.recall.0 / r.recall.1 as f64);
            rep.tokens_per_s = total as f64 / r.seconds.max(1e-9);
            rep
        })
        .collect())
}

/// Greedy continuation of one prompt by dense (first) and every sparse variant, sharing the
/// prefill: `new_tokens` tokens each.
pub fn greedy<T: Element>(
    model: &Model,
    prompt: &[u32],
    new_tokens: usize,
    variants: &[(String, SparseConfig)],
    opts: &EvalOptions,
) -> Result<Vec<Vec<u32>>, EngineError> {
    let n = prompt.len() + new_tokens;
    let mut lock = Lockstep::<T>::prefill(model, prompt, n, variants, opts)?;
    let mut out = vec![Vec::with_capacity(new_tokens); lock.runs.len()];
    for (i, o) in out.iter_mut().enumerate() {
        let mut tok = argmax(&lock.last);
        o.push(tok);
        while o.len() < new_tokens {
            tok = argmax(&lock.step(model, i, tok, false)?);
            o.push(tok);
        }
    }
    Ok(out)
}

/// Variants that share one dense prefill, then decode separately.
struct Lockstep<T: Element> {
    runs: Vec<Run<T>>,
    /// The prefill's last logits.
    last: Vec<f32>,
    /// Blocks of each run's cache, block `i` holding the `i`-th `block_size` positions.
    blocks: usize,
}

impl<T: Element> Lockstep<T> {
    /// Prefills `prompt` once for dense and every variant, with room for `n` tokens.
    fn prefill(
        model: &Model,
        prompt: &[u32],
        n: usize,
        variants: &[(String, SparseConfig)],
        opts: &EvalOptions,
    ) -> Result<Self, EngineError> {
        if prompt.is_empty() || opts.chunk == 0 || opts.block_size == 0 {
            return Err(EngineError::Invalid(format!(
                "an evaluation with a prefill of {} in chunks of {}, blocks of {}",
                prompt.len(),
                opts.chunk,
                opts.block_size
            )));
        }
        let c = &model.config;
        let blocks = n.div_ceil(opts.block_size);
        let mut store = KvStore::<T>::new(c, blocks, opts.block_size)?;
        let mut coords = Vec::with_capacity(variants.len());
        for (_, cfg) in variants {
            coords.push(single_request::<T>(c, cfg, ID, n, prompt.len())?);
        }
        let mut last = Vec::new();
        let mut pos = 0;
        while pos < prompt.len() {
            let e = (pos + opts.chunk).min(prompt.len());
            let batch = Batch::single(pos, e, blocks);
            for coord in &mut coords {
                coord.forward_begin(&[(ID, e - pos)])?;
            }
            let positions: Vec<usize> = (pos..e).collect();
            let mut fan = Fanout {
                dense: DenseAttention {
                    store: &mut store,
                    batch: &batch,
                },
                coords: &mut coords,
            };
            last = model.forward(&prompt[pos..e], &positions, &mut fan, &[e - pos - 1])?;
            for coord in &mut coords {
                coord.forward_end()?;
            }
            pos = e;
        }
        let kv_token = c.kv_bytes_per_token(size_of::<T>());
        let layer_token = kv_token / c.layers;
        let mut runs = Vec::with_capacity(variants.len() + 1);
        // Each sparse variant decodes on a copy of the prefilled cache; dense takes the original.
        let mut stores: Vec<KvStore<T>> = coords.iter().map(|_| store.clone()).collect();
        stores.insert(0, store);
        for (i, (coord, store)) in std::iter::once(None)
            .chain(coords.into_iter().map(Some))
            .zip(stores)
            .enumerate()
        {
            let (sparse, device_bytes, host_bytes) = match &coord {
                Some(co) if co.tracker(ID).is_some_and(|t| t.mode == Mode::Sparse) => {
                    let sparse_layers = co.lowered().layers.iter().flatten().count();
                    (
                        true,
                        co.sparse_device_bytes(n) + (c.layers - sparse_layers) * layer_token * n,
                        sparse_layers * layer_token * n,
                    )
                }
                _ => (false, kv_token * n, 0),
            };
            runs.push(Run {
                report: VariantReport {
                    name: match i {
                        0 => "dense".to_owned(),
                        _ => variants[i - 1].0.clone(),
                    },
                    sparse,
                    device_bytes,
                    host_bytes,
                    ..VariantReport::default()
                },
                store,
                coord,
                len: prompt.len(),
                argmax: Vec::new(),
                nll: 0.0,
                recall: (0.0, 0),
                seconds: 0.0,
            });
        }
        Ok(Lockstep { runs, last, blocks })
    }

    /// Run `i` decodes `token` at its next position; returns its logits.
    fn step(
        &mut self,
        model: &Model,
        i: usize,
        token: u32,
        recall: bool,
    ) -> Result<Vec<f32>, EngineError> {
        let run = &mut self.runs[i];
        let p = run.len;
        let batch = Batch::single(p, p + 1, self.blocks);
        let t0 = Instant::now();
        // Seconds of the step spent measuring recall, left out of the decode's time.
        let mut measuring = 0.0;
        let logits = match &mut run.coord {
            None => model.forward(
                &[token],
                &[p],
                &mut DenseAttention {
                    store: &mut run.store,
                    batch: &batch,
                },
                &[0],
            )?,
            Some(coord) => {
                let one = forward_one(
                    model,
                    coord,
                    &mut run.store,
                    &batch,
                    ID,
                    &[token],
                    &[p],
                    &[0],
                    recall,
                )?;
                run.report.stats.add(&one.stats);
                run.report.prefetched.add(&one.prefetched);
                if let Some(r) = one.recall {
                    run.recall.0 += r.iter().sum::<f64>();
                    run.recall.1 += r.len();
                }
                measuring = one.recall_seconds;
                one.logits
            }
        };
        run.seconds += t0.elapsed().as_secs_f64() - measuring;
        run.len += 1;
        Ok(logits)
    }
}

/// Dense attention that also walks every coordinator through the layer (a shared prefill).
struct Fanout<'a, 'b, T: Element> {
    dense: DenseAttention<'a, T>,
    coords: &'b mut [SparseCoordinator<T>],
}

impl<T: Element> Attention for Fanout<'_, '_, T> {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let (kt, vt) = (crate::kv::narrow::<T>(k), crate::kv::narrow::<T>(v));
        for coord in self.coords.iter_mut() {
            coord.attention_begin(layer, q, &kt, &vt)?;
        }
        self.dense.attend_narrowed(layer, q, &kt, &vt, out)?;
        for coord in self.coords.iter_mut() {
            coord.attention_end(layer, &kt, &vt)?;
        }
        Ok(())
    }
}

/// `-log softmax(logits)[target]`, in f64.
pub fn nll(logits: &[f32], target: usize) -> f64 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: f64 = logits.iter().map(|&x| f64::from(x - m).exp()).sum();
    f64::from(m) + s.ln() - f64::from(logits[target])
}

/// The index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The variants `eval` runs without a config: the acceptance figures of the engine issue.
/// Quest at a 1024-token budget with layers 0 and 1 dense, as pages of 16 with one selection
/// shared by the KV heads (the cheapest), and as pages of 4 selected per KV head with the first
/// 16 and last 256 tokens always kept (the most faithful); then a budget covering the context,
/// which must equal dense.
pub fn default_variants(context: usize) -> Vec<(String, SparseConfig)> {
    let quest = |budget: usize, dense: Vec<usize>, min_prompt: Option<usize>| SparseConfig {
        dense_layers: dense,
        min_prompt_tokens: min_prompt,
        ..SparseConfig::quest(budget)
    };
    let faithful = SparseConfig {
        algo: AlgoConfig::Quest(QuestConfig {
            page_size: 4,
            budget_tokens: 1024,
            shared_heads: false,
            always: AlwaysInclude {
                sink_tokens: 16,
                recent_tokens: 256,
            },
            summary: Summary::Exact,
        }),
        ..quest(1024, vec![0, 1], Some(1))
    };
    let full = context.div_ceil(16) * 16;
    vec![
        (
            "quest-1024+2dense".to_owned(),
            quest(1024, vec![0, 1], Some(1)),
        ),
        ("quest-1024-p4-head-sr+2dense".to_owned(), faithful),
        (
            format!("quest-full-{full}"),
            quest(full, Vec::new(), Some(1)),
        ),
    ]
}

/// Tokens a passkey answer is given (greedy).
pub const PASSKEY_ANSWER: usize = 8;

/// Passkey retrieval: how many of `trials` prompts of about `context` tokens, a five-digit
/// key hidden at evenly spread depths in filler text, each variant (dense first) answers
/// with the key (greedy, [`PASSKEY_ANSWER`] tokens).
pub fn passkey<T: Element>(
    model: &Model,
    tokenizer: &crate::Tokenizer,
    context: usize,
    trials: usize,
    variants: &[(String, SparseConfig)],
    opts: &EvalOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<(String, usize)>, EngineError> {
    let mut correct = vec![0usize; variants.len() + 1];
    for t in 0..trials {
        let (prompt, key) = passkey_prompt(tokenizer, context, t, trials)?;
        let outs = greedy::<T>(model, &prompt, PASSKEY_ANSWER, variants, opts)?;
        for (c, out) in correct.iter_mut().zip(&outs) {
            if tokenizer.decode(out)?.contains(&key) {
                *c += 1;
            }
        }
        progress(t + 1, trials);
    }
    Ok(std::iter::once("dense".to_owned())
        .chain(variants.iter().map(|v| v.0.clone()))
        .zip(correct)
        .collect())
}

/// Trial `t` of `trials` of [`passkey`]: a prompt of at most `context` tokens (the answer's
/// [`PASSKEY_ANSWER`] included), its key hidden at depth `t / trials`, and the key as text.
pub fn passkey_prompt(
    tokenizer: &crate::Tokenizer,
    context: usize,
    t: usize,
    trials: usize,
) -> Result<(Vec<u32>, String), EngineError> {
    let intro = tokenizer.encode(
        "There is an important piece of information hidden inside a lot of irrelevant text. \
         Find it and memorize it. I will quiz you about it.\n",
    )?;
    let filler = tokenizer
        .encode("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")?;
    let question = tokenizer.encode("\nWhat is the pass key? The pass key is")?;
    let key = 10_000 + (t as u64 * 7919 + 4243) % 90_000;
    let needle = tokenizer.encode(&format!(
        "The pass key is {key}. Remember it. {key} is the pass key. "
    ))?;
    let room = context
        .checked_sub(intro.len() + needle.len() + question.len() + PASSKEY_ANSWER)
        .ok_or_else(|| EngineError::Invalid(format!("a passkey context of {context}")))?;
    let reps = room / filler.len();
    let at = reps * t / trials.max(1);
    let mut prompt = intro;
    for r in 0..reps {
        if r == at {
            prompt.extend_from_slice(&needle);
        }
        prompt.extend_from_slice(&filler);
    }
    if at >= reps {
        prompt.extend_from_slice(&needle);
    }
    prompt.extend_from_slice(&question);
    Ok((prompt, key.to_string()))
}

/// The dense model's prediction after every position of a text ([`greedy_trace`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    /// After each position `i`, the arg-max of the logits: the prediction for `i + 1`.
    pub argmax: Vec<u32>,
    /// After each position, the largest logit, as computed (to compare bit for bit).
    pub top_logit: Vec<f32>,
}

/// The dense model's [`Trace`] over `tokens`: one prefill with every row's logits, in chunks
/// of `opts.chunk`, through the engine's attention over a cache of `T`. `progress` gets the
/// tokens done after each chunk.
pub fn greedy_trace<T: Element>(
    model: &Model,
    tokens: &[u32],
    opts: &EvalOptions,
    progress: impl FnMut(usize),
) -> Result<Trace, EngineError> {
    let blocks = tokens.len().div_ceil(opts.block_size.max(1));
    let mut store = KvStore::<T>::new(&model.config, blocks, opts.block_size.max(1))?;
    trace(
        tokens,
        opts.chunk,
        model.config.vocab,
        progress,
        |chunk, pos| {
            let batch = Batch::single(pos, pos + chunk.len(), blocks);
            let mut attn = DenseAttention {
                store: &mut store,
                batch: &batch,
            };
            forward_all(model, chunk, pos, &mut attn)
        },
    )
}

/// [`greedy_trace`] computed as llama.cpp's CPU backend computes it: the model
/// [`Model::like_llama_cpp`], attention through [`GgmlAttention`]. In chunks of 512 (its
/// default batch), on the build [`crate::ggml`] names, its logits are llama.cpp's bit for bit.
pub fn greedy_trace_like_llama_cpp(
    model: &Model,
    tokens: &[u32],
    opts: &EvalOptions,
    progress: impl FnMut(usize),
) -> Result<Trace, EngineError> {
    let model = model.clone().like_llama_cpp();
    let mut attn = GgmlAttention::new(&model.config);
    trace(
        tokens,
        opts.chunk,
        model.config.vocab,
        progress,
        |chunk, pos| forward_all(&model, chunk, pos, &mut attn),
    )
}

/// Runs `forward(chunk, first position)` over `tokens` in chunks of `chunk` and keeps each
/// row's arg-max and largest logit (rows of `vocab` logits).
fn trace(
    tokens: &[u32],
    chunk: usize,
    vocab: usize,
    mut progress: impl FnMut(usize),
    mut forward: impl FnMut(&[u32], usize) -> Result<Vec<f32>, EngineError>,
) -> Result<Trace, EngineError> {
    let mut out = Trace::default();
    for (i, c) in tokens.chunks(chunk.max(1)).enumerate() {
        let pos = i * chunk.max(1);
        let logits = forward(c, pos)?;
        for row in logits.chunks(vocab) {
            let best = argmax(row);
            out.argmax.push(best);
            out.top_logit.push(row[best as usize]);
        }
        progress(pos + c.len());
    }
    Ok(out)
}

/// One forward of `chunk` at positions `pos..`, with every row's logits.
fn forward_all(
    model: &Model,
    chunk: &[u32],
    pos: usize,
    attn: &mut dyn Attention,
) -> Result<Vec<f32>, EngineError> {
    let rows: Vec<usize> = (0..chunk.len()).collect();
    let positions: Vec<usize> = (pos..pos + chunk.len()).collect();
    model.forward(chunk, &positions, attn, &rows)
}
