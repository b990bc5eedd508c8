//! One request end to end: chunked prefill, then sampled decode with streamed text, dense or
//! through the sparse coordinator.

use std::time::Instant;

use attn_op::Element;
use coordinator::{Mode, SparseConfig};
use kv_blocks::RequestId;
use offload::StepStats;

use crate::kv::{Batch, DenseAttention, KvStore};
use crate::model::Model;
use crate::sample::{Sampler, Sampling};
use crate::sched::check_request;
use crate::sparse::{forward_one, single_request};
use crate::{EngineError, Tokenizer};

/// What a generation did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerateStats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub generated: usize,
    /// Seconds of prefill.
    pub prefill_s: f64,
    /// Seconds of decode.
    pub decode_s: f64,
    /// Whether the request ran in sparse mode.
    pub sparse: bool,
    /// Hot-buffer hits, misses and bytes moved over the decode.
    pub stats: StepStats,
}

/// The engine's request id for single-request runs.
const ID: RequestId = RequestId(1);

/// Tokens per prefill forward.
pub const PREFILL_CHUNK: usize = 512;

/// Generates from `prompt` with `sampling`; `sparse` routes attention through a sparse
/// coordinator. `on_text` receives the decoded text as it grows (whole characters only);
/// `progress(done, total)` follows the prefill.
pub fn generate<T: Element>(
    model: &Model,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    sampling: &Sampling,
    sparse: Option<&SparseConfig>,
    on_text: impl FnMut(&str),
    mut progress: impl FnMut(usize, usize),
) -> Result<(Vec<u32>, GenerateStats), EngineError> {
    let c = &model.config;
    let mut sampler = start(c, prompt, sampling)?;
    let n = prompt.len() + sampling.max_tokens;
    let bs = 16;
    let blocks = n.div_ceil(bs);
    let mut store = KvStore::<T>::new(c, blocks, bs)?;
    let mut coord = sparse
        .map(|cfg| single_request::<T>(c, cfg, ID, n, prompt.len()))
        .transpose()?;
    let sparse_mode = coord
        .as_ref()
        .and_then(|co| co.tracker(ID))
        .is_some_and(|t| t.mode == Mode::Sparse);
    let mut stats = GenerateStats {
        prompt_tokens: prompt.len(),
        sparse: sparse_mode,
        ..GenerateStats::default()
    };
    // One forward of `tokens` at `pos..`, the logits of its last row.
    let mut forward = |tokens: &[u32], pos: usize, store: &mut KvStore<T>| {
        let e = pos + tokens.len();
        // Every token is written to `store` too: dense layers of a sparse-mode request read
        // it there.
        let batch = Batch::single(pos, e, blocks);
        let positions: Vec<usize> = (pos..e).collect();
        let last = [tokens.len() - 1];
        match coord.as_mut() {
            None => model.forward(
                tokens,
                &positions,
                &mut DenseAttention {
                    store,
                    batch: &batch,
                },
                &last,
            ),
            Some(co) => {
                let one = forward_one(
                    model, co, store, &batch, ID, tokens, &positions, &last, false,
                )?;
                stats.stats.add(&one.stats);
                Ok(one.logits)
            }
        }
    };
    let t0 = Instant::now();
    let mut logits = Vec::new();
    for (i, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
        logits = forward(chunk, i * PREFILL_CHUNK, &mut store)?;
        progress(i * PREFILL_CHUNK + chunk.len(), prompt.len());
    }
    // The next token's position.
    let mut store_len = prompt.len();
    stats.prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let out = sample_loop(tokenizer, sampling, &mut sampler, logits, on_text, |tok| {
        let pos = store_len;
        store_len += 1;
        forward(&[tok], pos, &mut store)
    })?;
    stats.generated = out.len();
    stats.decode_s = t1.elapsed().as_secs_f64();
    Ok((out, stats))
}

/// The sampler of a request of `prompt` with `sampling` on a model of `config`, after the
/// request's checks (what the engine takes: a prompt, its tokens in the vocabulary, room in
/// the context, valid sampling).
pub(crate) fn start(
    config: &crate::ModelConfig,
    prompt: &[u32],
    sampling: &Sampling,
) -> Result<Sampler, EngineError> {
    let sampler = Sampler::new(sampling)?;
    check_request(config, prompt, sampling, config.context)?;
    Ok(sampler)
}

/// The sampled decode after a prefill whose last logits are `logits`: sample a token, stream
/// the text grown by it to `on_text` (whole characters only), stop at EOS (where asked), a
/// stop string or `max_tokens`, else run the token through `step` for the next logits.
/// Answers the tokens generated.
pub(crate) fn sample_loop(
    tokenizer: &Tokenizer,
    sampling: &Sampling,
    sampler: &mut Sampler,
    mut logits: Vec<f32>,
    mut on_text: impl FnMut(&str),
    mut step: impl FnMut(u32) -> Result<Vec<f32>, EngineError>,
) -> Result<Vec<u32>, EngineError> {
    let mut out: Vec<u32> = Vec::with_capacity(sampling.max_tokens);
    let mut shown = 0;
    loop {
        let tok = sampler.sample(&logits);
        if sampling.stop_at_eos && Some(tok) == tokenizer.eos() {
            return Ok(out);
        }
        out.push(tok);
        let text = tokenizer.decode(&out)?;
        // Hold back a trailing partial character (a multi-token UTF-8 sequence).
        let ready = text.trim_end_matches('\u{fffd}');
        if ready.len() > shown {
            on_text(&ready[shown..]);
            shown = ready.len();
        }
        let stop = sampling.stop.iter().any(|s| text.contains(s.as_str()));
        if stop || out.len() == sampling.max_tokens {
            return Ok(out);
        }
        logits = step(tok)?;
    }
}
