//! What the real-model examples (`prefetch`, `precision`, `overlap`) share: the command line
//! `[MODEL] [TEXT]`, the model with the first tokens of the text, and how a run over them is
//! cut into forwards.

use std::path::Path;

use engine::gguf::Gguf;
use engine::{EngineError, Model, Tokenizer};

/// The defaults: the model `cargo xtask fetch-model` fetches and a text Debian ships.
const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const TEXT: &str = "/usr/share/common-licenses/GPL-3";

/// Runs `run(model, text)` on the command line's `[MODEL] [TEXT]` (the defaults above where
/// absent); an error is printed after the tool's name and exits with status 1.
pub(crate) fn main_with(tool: &str, run: impl FnOnce(&str, &str) -> Result<(), EngineError>) {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args.first().map_or(MODEL, String::as_str);
    let text = args.get(1).map_or(TEXT, String::as_str);
    if let Err(e) = run(model, text) {
        eprintln!("{tool}: {e}");
        std::process::exit(1);
    }
}

/// The GGUF model at `model_path` and the first `n` tokens of the text at `text_path` (an
/// error where it has fewer).
pub(crate) fn load(
    model_path: &str,
    text_path: &str,
    n: usize,
) -> Result<(Model, Vec<u32>), EngineError> {
    let file = Gguf::open(Path::new(model_path))?;
    let model = Model::load(&file)?;
    let text = std::fs::read_to_string(text_path).map_err(|source| EngineError::Io {
        path: text_path.into(),
        source,
    })?;
    let mut ids = Tokenizer::from_gguf(&file)?.encode(&text)?;
    if ids.len() < n {
        return Err(EngineError::Invalid(format!(
            "{text_path} has {} tokens; {n} needed",
            ids.len()
        )));
    }
    ids.truncate(n);
    Ok((model, ids))
}

/// The forwards of a run over `n` tokens: the first `prefill` in chunks of 512 tokens, then one
/// token a forward, as `(start, end)` token ranges.
#[allow(dead_code, reason = "not every example decodes")]
pub(crate) fn spans(prefill: usize, n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..prefill)
        .step_by(512)
        .map(move |s| (s, (s + 512).min(prefill)))
        .chain((prefill..n).map(|p| (p, p + 1)))
}
