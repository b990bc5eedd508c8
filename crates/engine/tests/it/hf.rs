//! Hugging Face checkpoints: a synthetic GGUF model exported to safetensors and read back
//! gives the same logits and token ids; broken checkpoints get typed errors, and edited ones
//! load or get one, never a panic.

use std::path::{Path, PathBuf};

use engine::gguf::{DType, Gguf, Value};
use engine::hf::{Checkpoint, export};
use engine::{Batch, DenseAttention, EngineError, KvStore, Model, Tokenizer};

use crate::model::{TINY, text, tiny};

/// A fresh, empty directory for one test case.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hsa-hf-{}-{name}", std::process::id()));
    // A leftover of an earlier run with the same pid is stale; a missing one is fine.
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("the temp directory is writable");
    d
}

/// The logits of every position of `tokens`: a prefill of all but the last 3 tokens, then
/// one decode step per token (both matmul paths).
fn logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let n = tokens.len();
    let blocks = n.div_ceil(16);
    let mut store = KvStore::<f32>::new(&model.config, blocks, 16).expect("a small cache");
    let mut out = Vec::new();
    let mut pos = 0;
    for chunk in [n - 3, 1, 1, 1] {
        let e = pos + chunk;
        let batch = Batch::single(pos, e, blocks);
        let rows: Vec<usize> = (0..chunk).collect();
        let positions: Vec<usize> = (pos..e).collect();
        let mut attn = DenseAttention {
            store: &mut store,
            batch: &batch,
        };
        out.extend(
            model
                .forward(&tokens[pos..e], &positions, &mut attn, &rows)
                .expect("a valid forward"),
        );
        pos = e;
    }
    out
}

#[test]
fn an_exported_checkpoint_reads_back_to_the_same_model() {
    let mut g = tiny(DType::F32);
    // A tokenizer that prepends BOS: the export turns that into tokenizer.json's template.
    for (k, v) in [
        ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
        ("tokenizer.ggml.bos_token_id", Value::U64(299)),
        ("tokenizer.ggml.eos_token_id", Value::U64(298)),
    ] {
        g.metadata.insert(k.to_owned(), v);
    }
    let want = logits(&Model::load(&g).expect("a valid model"), &text(40));
    let tok = Tokenizer::from_gguf(&g).expect("a byte-level tokenizer");
    let sentence = "Hello, world: 12345 tokens <|extra_299|>!";
    for (dtype, tolerance) in [(DType::F32, 0.0), (DType::F16, 2e-3), (DType::BF16, 2e-2)] {
        let dir = scratch(&format!("{dtype:?}"));
        export(&g, &tok, &dir, dtype).expect("an export of a valid model");
        let ck = Checkpoint::open(&dir).expect("the export opens");
        assert_eq!(ck.config, TINY);
        let got = logits(&ck.model().expect("the export loads"), &text(40));
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= tolerance * scale,
            "{dtype:?}: max |Δlogit| {worst} of {scale}"
        );
        let hf_tok = ck.tokenizer().expect("the exported tokenizer.json reads");
        assert_eq!(
            hf_tok.encode(sentence).expect("text encodes"),
            tok.encode(sentence).expect("text encodes")
        );
        assert_eq!(hf_tok.encode(sentence).expect("text encodes")[0], 299);
        assert_eq!((hf_tok.bos(), hf_tok.eos()), (Some(299), Some(298)));
        assert_eq!(hf_tok.vocab_size(), tok.vocab_size());
        std::fs::remove_dir_all(&dir).expect("the scratch directory is ours");
    }
}

/// Exports the tiny model, breaks the checkpoint with `break_it`, and checks that opening and
/// loading it fails with the error `want` accepts.
fn check(name: &str, break_it: impl Fn(&Path), want: fn(&EngineError) -> bool) {
    let g: Gguf = tiny(DType::F16);
    let tok = Tokenizer::from_gguf(&g).expect("a byte-level tokenizer");
    let dir = scratch(name);
    export(&g, &tok, &dir, DType::F16).expect("an export of a valid model");
    break_it(&dir);
    let r = Checkpoint::open(&dir).and_then(|c| c.model().map(|_| ()));
    match r {
        Err(e) => assert!(want(&e), "{name}: unexpected error {e}"),
        Ok(()) => panic!("{name}: the broken checkpoint loaded"),
    }
    std::fs::remove_dir_all(&dir).expect("the scratch directory is ours");
}

/// Rewrites one key of `config.json`.
fn set_config(dir: &Path, key: &str, value: serde_json::Value) {
    let p = dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).expect("exported")).expect("JSON");
    c[key] = value;
    std::fs::write(&p, c.to_string()).expect("writable");
}

/// Rewrites `model.safetensors` through `f`.
fn edit_weights(dir: &Path, f: impl Fn(&mut Vec<u8>)) {
    let p = dir.join("model.safetensors");
    let mut b = std::fs::read(&p).expect("exported");
    f(&mut b);
    std::fs::write(&p, b).expect("writable");
}

#[test]
fn broken_checkpoints_get_typed_errors() {
    use serde_json::json;
    let io = |e: &EngineError| matches!(e, EngineError::Io { .. });
    let malformed = |e: &EngineError| matches!(e, EngineError::Malformed(_));
    let unsupported = |e: &EngineError| matches!(e, EngineError::Unsupported(_));
    check(
        "no-config",
        |d| std::fs::remove_file(d.join("config.json")).expect("exported"),
        io,
    );
    check(
        "not-json",
        |d| std::fs::write(d.join("config.json"), "{ hidden_size: ").expect("writable"),
        malformed,
    );
    check(
        "mistral",
        |d| set_config(d, "model_type", json!("mistral")),
        unsupported,
    );
    check(
        "rope-scaling",
        |d| set_config(d, "rope_scaling", json!({"type": "linear", "factor": 2.0})),
        unsupported,
    );
    check(
        "biases",
        |d| set_config(d, "attention_bias", json!(true)),
        unsupported,
    );
    check(
        "kv-heads",
        |d| set_config(d, "num_key_value_heads", json!(3)),
        malformed,
    );
    check(
        "huge",
        |d| set_config(d, "intermediate_size", json!(1u64 << 40)),
        malformed,
    );
    check(
        "negative-eps",
        |d| set_config(d, "rms_norm_eps", json!(-1.0)),
        malformed,
    );
    check(
        "bos",
        |d| set_config(d, "eos_token_id", json!([1_000_000])),
        malformed,
    );
    check(
        "wrong-shape",
        |d| set_config(d, "intermediate_size", json!(TINY.ffn + 32)),
        malformed,
    );
    check(
        "untied",
        |d| set_config(d, "tie_word_embeddings", json!(false)),
        malformed,
    );
    check(
        "no-weights",
        |d| std::fs::remove_file(d.join("model.safetensors")).expect("exported"),
        io,
    );
    check(
        "header-length",
        |d| edit_weights(d, |b| b[..8].copy_from_slice(&u64::MAX.to_le_bytes())),
        malformed,
    );
    check(
        "truncated",
        |d| edit_weights(d, |b| b.truncate(b.len() - 100)),
        malformed,
    );
    check("empty", |d| edit_weights(d, Vec::clear), malformed);
    check(
        "index-escape",
        |d| {
            let idx = json!({"weight_map": {"model.norm.weight": "../model.safetensors"}});
            std::fs::write(d.join("model.safetensors.index.json"), idx.to_string())
                .expect("writable");
        },
        malformed,
    );
}

/// Splits an exported `model.safetensors` into two shards listed by an index: the layer-0
/// tensors (plus `extra`, which is then in both) and the rest.
fn shard(dir: &Path, extra: &str) {
    let whole = std::fs::read(dir.join("model.safetensors")).expect("exported");
    let st = safetensors::SafeTensors::deserialize(&whole).expect("a valid export");
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut map = serde_json::Map::new();
    for (name, view) in st.tensors() {
        let first = name.starts_with("model.layers.0.") || name == extra;
        let file = if first {
            "a.safetensors"
        } else {
            "b.safetensors"
        };
        map.insert(name.clone(), file.into());
        if name == extra {
            b.push((name.clone(), view.clone()));
        }
        if first { &mut a } else { &mut b }.push((name, view));
    }
    for (file, tensors) in [("a.safetensors", a), ("b.safetensors", b)] {
        safetensors::serialize_to_file(tensors, None, &dir.join(file)).expect("writable");
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("writable");
    std::fs::remove_file(dir.join("model.safetensors")).expect("exported");
}

#[test]
fn a_sharded_checkpoint_loads() {
    let g = tiny(DType::F32);
    let want = logits(&Model::load(&g).expect("a valid model"), &text(24));
    let tok = Tokenizer::from_gguf(&g).expect("a byte-level tokenizer");
    let dir = scratch("sharded");
    export(&g, &tok, &dir, DType::F32).expect("an export of a valid model");
    shard(&dir, "");
    let ck = Checkpoint::open(&dir).expect("the shards open");
    assert_eq!(
        logits(&ck.model().expect("the shards load"), &text(24)),
        want
    );
    std::fs::remove_dir_all(&dir).expect("the scratch directory is ours");
    check(
        "shard-twice",
        |d| shard(d, "model.norm.weight"),
        |e| matches!(e, EngineError::Malformed(m) if m.contains("more than one")),
    );
}

/// The keys of `config.json` the reader looks at, and values a broken file can hold.
const KEYS: [&str; 16] = [
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "head_dim",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "model_type",
    "hidden_act",
    "torch_dtype",
];

fn value(i: usize) -> serde_json::Value {
    use serde_json::json;
    [
        json!(0),
        json!(1),
        json!(-1),
        json!(2),
        json!(3),
        json!(1u64 << 31),
        json!(1u64 << 40),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(0.5),
        json!(f64::MAX),
        json!(1e-300),
        json!("llama"),
        json!(null),
        json!([]),
        json!([0, 1_000_000]),
        json!({}),
        json!(true),
    ][i % 18]
        .clone()
}

/// 64 cases by default; `PROPTEST_CASES` raises it for soak runs.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: cases(), ..Default::default() })]

    /// Any value in any key of `config.json`, and bytes edited anywhere in the safetensors
    /// header or in `tokenizer.json`: the checkpoint and its tokenizer load or get a typed
    /// error, never a panic or an abort.
    #[test]
    fn edited_checkpoints_load_or_fail_cleanly(
        keys in proptest::collection::vec((0..KEYS.len(), 0..18usize), 0..3),
        edits in proptest::collection::vec((proptest::prelude::any::<proptest::sample::Index>(), proptest::prelude::any::<u8>()), 0..4),
        tok_edits in proptest::collection::vec((proptest::prelude::any::<proptest::sample::Index>(), proptest::prelude::any::<u8>()), 0..4),
    ) {
        let g: Gguf = tiny(DType::F16);
        let tok = Tokenizer::from_gguf(&g).expect("a byte-level tokenizer");
        let dir = scratch("edited");
        export(&g, &tok, &dir, DType::F16).expect("an export of a valid model");
        for &(k, v) in &keys {
            set_config(&dir, KEYS[k], value(v));
        }
        edit_weights(&dir, |b| {
            let header = 8 + u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as usize;
            for (at, byte) in &edits {
                b[at.index(header)] = *byte;
            }
        });
        let tj = dir.join("tokenizer.json");
        let mut t = std::fs::read(&tj).expect("exported");
        for (at, byte) in &tok_edits {
            let i = at.index(t.len());
            t[i] = *byte;
        }
        std::fs::write(&tj, t).expect("writable");
        let r = Checkpoint::open(&dir).and_then(|c| c.model().map(|_| ()));
        let words = Checkpoint::open(&dir)
            .and_then(|c| c.tokenizer())
            .and_then(|t| t.encode("Hello, world: 12345 <|extra_299|>!"));
        std::fs::remove_dir_all(&dir).expect("the scratch directory is ours");
        if keys.is_empty() && edits.is_empty() {
            proptest::prop_assert!(r.is_ok(), "{r:?}");
            if tok_edits.is_empty() {
                proptest::prop_assert!(words.is_ok(), "{words:?}");
            }
        }
    }
}
