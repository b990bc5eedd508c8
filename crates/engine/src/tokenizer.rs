//! The tokenizer, built with the `tokenizers` crate from a GGUF file's `tokenizer.ggml.*`
//! metadata (byte-level BPE, the GPT-2 family, `tokenizer.ggml.model = "gpt2"`: its
//! vocabulary, merges and control tokens), or read from a Hugging Face `tokenizer.json`.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper};

use crate::EngineError;
use crate::gguf::{Gguf, Value};

/// A text ↔ token-id codec.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    /// Whether encoding runs the tokenizer's own post-processor (a `tokenizer.json`'s
    /// template adds BOS itself).
    post_process: bool,
    vocab: usize,
}

/// GGUF token types (`tokenizer.ggml.token_type`): 3 marks control tokens such as
/// `<|im_start|>`, matched whole in text and never split by BPE.
const CONTROL: u64 = 3;
/// 4 marks user-defined tokens, also matched whole.
const USER_DEFINED: u64 = 4;

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes.
    ///
    /// Supported: `tokenizer.ggml.model = "gpt2"` with the pre-tokenizers `smollm`, `gpt2`,
    /// `default` or none (the GPT-2 split; `smollm` first splits every digit on its own).
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, EngineError> {
        let meta = |k: &str| g.metadata.get(k);
        let model = meta("tokenizer.ggml.model").and_then(Value::as_str);
        if model != Some("gpt2") {
            return Err(EngineError::Unsupported(format!(
                "tokenizer model {model:?} (only byte-level BPE, \"gpt2\")"
            )));
        }
        let tokens = strings(meta("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens")?;
        let merges = strings(meta("tokenizer.ggml.merges"), "tokenizer.ggml.merges")?;
        let types = match meta("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) if a.len() == tokens.len() => {
                a.iter().map(|v| v.as_u64().unwrap_or(1)).collect()
            }
            None => vec![1; tokens.len()],
            Some(_) => {
                return Err(EngineError::Malformed(
                    "tokenizer.ggml.token_type does not match the tokens".into(),
                ));
            }
        };
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| (t.to_owned(), i as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| EngineError::Malformed(format!("merge {m:?} has no space")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| EngineError::Malformed(format!("BPE: {e}")))?;
        let pre = meta("tokenizer.ggml.pre").and_then(Value::as_str);
        let split = ByteLevel::new(false, true, true);
        let pre: PreTokenizerWrapper = match pre {
            Some("smollm") => Sequence::new(vec![Digits::new(true).into(), split.into()]).into(),
            None | Some("gpt2" | "default") => split.into(),
            Some(other) => {
                return Err(EngineError::Unsupported(format!(
                    "pre-tokenizer {other:?} (supported: smollm, gpt2, default)"
                )));
            }
        };
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner
            .with_pre_tokenizer(Some(pre))
            .with_decoder(Some(ByteLevelDecoder::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|&(_, &t)| t == CONTROL || t == USER_DEFINED)
            .map(|(&s, &t)| AddedToken::from(s.to_owned(), t == CONTROL))
            .collect();
        inner.add_special_tokens(&special);
        let id = |k: &str| -> Result<Option<u32>, EngineError> {
            match meta(k).map(Value::as_u64) {
                None => Ok(None),
                Some(Some(i)) if (i as usize) < tokens.len() => Ok(Some(i as u32)),
                Some(v) => Err(EngineError::Malformed(format!("{k} = {v:?}"))),
            }
        };
        Ok(Tokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            add_bos: matches!(
                meta("tokenizer.ggml.add_bos_token"),
                Some(Value::Bool(true))
            ),
            post_process: false,
            vocab: tokens.len(),
        })
    }

    /// Reads a Hugging Face `tokenizer.json`; its post-processor adds BOS where the model
    /// wants one. `bos` and `eos` come from the checkpoint's config.
    pub fn from_hf_file(
        path: &std::path::Path,
        bos: Option<u32>,
        eos: Option<u32>,
    ) -> Result<Tokenizer, EngineError> {
        let err =
            |e: &dyn std::fmt::Display| EngineError::Tokenizer(format!("{}: {e}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| err(&e))?;
        // The text must be JSON before the tokenizers crate reads it: its decoder section's
        // parse panics on a syntax error there (`expect("Helper")` in tokenizers 0.22), where
        // it accepts any JSON value.
        serde_json::from_str::<serde_json::Value>(&text).map_err(|e| err(&e))?;
        // Any other panic of the crate on a malformed file becomes an error too.
        let parsed = std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>())
            .map_err(|_| err(&"the tokenizers crate panicked reading it"))?;
        let inner = parsed.map_err(|e| err(&e))?;
        let vocab = inner.get_vocab_size(true);
        if let Some(bad) = [bos, eos]
            .into_iter()
            .flatten()
            .find(|&t| t as usize >= vocab)
        {
            return Err(EngineError::Malformed(format!(
                "special token {bad} outside the vocabulary of {vocab}"
            )));
        }
        Ok(Tokenizer {
            inner,
            bos,
            eos,
            add_bos: false,
            post_process: true,
            vocab,
        })
    }

    /// The tokenizer as a Hugging Face `tokenizer.json`. A BOS the GGUF file asks for
    /// becomes a template post-processor, so [`Tokenizer::from_hf_file`] encodes the same ids.
    pub fn to_hf_json(&self) -> Result<String, EngineError> {
        let err = |e: tokenizers::Error| EngineError::Tokenizer(e.to_string());
        let mut t = self.inner.clone();
        if let (true, Some(b)) = (self.add_bos, self.bos) {
            let text = self
                .inner
                .id_to_token(b)
                .ok_or_else(|| EngineError::Tokenizer(format!("BOS id {b} has no token")))?;
            let template = TemplateProcessing::builder()
                .try_single(format!("{text} $A"))
                .map_err(EngineError::Tokenizer)?
                .special_tokens(vec![(text, b)])
                .build()
                .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
            t.with_post_processor(Some(template));
        }
        t.to_string(false).map_err(err)
    }

    /// Encodes text. Control tokens written in the text (`<|im_start|>`) become their ids; a
    /// BOS token is prepended where the file asks for one.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let enc = self
            .inner
            .encode_fast(text, self.post_process)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if let (true, Some(b)) = (self.add_bos, self.bos) {
            ids.push(b);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text; control tokens are written out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, EngineError> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(EngineError::Tokenizer(format!(
                "token id {bad} outside the vocabulary of {}",
                self.vocab
            )));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// The end-of-sequence token, if the file names one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// The beginning-of-sequence token, if the file names one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The id of a token given by its text (`<|im_end|>`), if it is one token.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }
}

/// A metadata array of strings.
fn strings<'a>(v: Option<&'a Value>, key: &str) -> Result<Vec<&'a str>, EngineError> {
    match v {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .ok_or_else(|| EngineError::Malformed(format!("{key} holds a non-string")))
            })
            .collect(),
        _ => Err(EngineError::Malformed(format!(
            "{key} is missing or not an array"
        ))),
    }
}
