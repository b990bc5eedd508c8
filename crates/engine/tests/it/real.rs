//! The real model end to end, where `cargo xtask fetch-model` has fetched it: tokenizer
//! against llama.cpp's ids and through its `tokenizer.json` form, any text round-tripping
//! through it, perplexity of a real text, a greedy answer, and sparse with a full
//! budget against dense. CI fetches the model and sets `HSA_REQUIRE_MODEL=1`, which turns a
//! missing model into a failure; elsewhere the test says it skipped.

use std::path::PathBuf;

use engine::eval::{EvalOptions, teacher_forced};
use engine::gguf::Gguf;
use engine::{Model, Sampling, Tokenizer};

fn model_path() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        return Some(p);
    }
    assert!(
        std::env::var_os("HSA_REQUIRE_MODEL").is_none(),
        "HSA_REQUIRE_MODEL is set but {} is missing (cargo xtask fetch-model)",
        p.display()
    );
    None
}

#[test]
#[allow(clippy::print_stderr, reason = "a skipped test says so")]
fn real_model_end_to_end() {
    let Some(path) = model_path() else {
        eprintln!("skipped: the real model is not fetched (cargo xtask fetch-model)");
        return;
    };
    let g = Gguf::open(&path).expect("the fetched model parses");
    let tok = Tokenizer::from_gguf(&g).expect("its tokenizer builds");
    let model = Model::load(&g).expect("its weights load");
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3")
        .expect("Debian ships the GPL-3 text");
    let ids = tok.encode(&text).expect("text encodes");
    // llama.cpp's tokenization of the same text (llama-cpp-python 0.3.16), first 20 ids.
    assert_eq!(
        ids[..20],
        [
            42185, 28807, 35185, 49126, 35696, 45581, 41026, 16997, 13867, 216, 35, 28, 216, 34,
            41, 4019, 216, 34, 32, 32
        ]
    );
    // The tokenizer written as a Hugging Face tokenizer.json (what `hsa export` writes) reads
    // back to the same ids for the whole text.
    let json = std::env::temp_dir().join(format!("hsa-real-{}-tokenizer.json", std::process::id()));
    std::fs::write(&json, tok.to_hf_json().expect("the tokenizer serializes"))
        .expect("the temp directory is writable");
    let hf = Tokenizer::from_hf_file(&json, tok.bos(), tok.eos()).expect("it reads back");
    std::fs::remove_file(&json).expect("the file is ours");
    assert_eq!(hf.encode(&text).expect("text encodes"), ids);
    // Perplexity over positions 256..384 after a dense prefill, and a full-budget sparse
    // variant that must be bit-identical.
    let full = coordinator::SparseConfig {
        min_prompt_tokens: Some(1),
        ..coordinator::SparseConfig::quest(400)
    };
    let opts = EvalOptions {
        prefill: 256,
        chunk: 128,
        block_size: 16,
        recall: false,
    };
    let r = teacher_forced::<half::f16>(
        &model,
        &ids[..385],
        &[("full".to_owned(), full)],
        &opts,
        |_, _| {},
    )
    .expect("a valid run");
    let ppl = r[0].perplexity();
    assert!((3.0..30.0).contains(&ppl), "dense perplexity {ppl}");
    assert!(r[1].sparse);
    assert_eq!(r[1].max_logit_diff, 0.0);
    assert_eq!(r[1].perplexity(), ppl);
    // A greedy chat answer.
    let prompt = tok
        .encode(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        )
        .expect("text encodes");
    let s = Sampling {
        max_tokens: 12,
        ..Sampling::default()
    };
    let (out, _) =
        engine::generate::<half::f16>(&model, &tok, &prompt, &s, None, |_| {}, |_, _| {})
            .expect("a valid request");
    let answer = tok.decode(&out).expect("valid ids");
    assert!(answer.contains("Paris"), "answer: {answer:?}");
}

/// Any text, ASCII or not, decodes back from the real tokenizer's encoding to itself.
#[test]
#[allow(clippy::print_stderr, reason = "a skipped test says so")]
fn any_text_round_trips_through_the_real_tokenizer() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRng, TestRunner};
    let Some(path) = model_path() else {
        eprintln!("skipped: the real model is not fetched (cargo xtask fetch-model)");
        return;
    };
    let g = Gguf::open(&path).expect("the fetched model parses");
    let tok = Tokenizer::from_gguf(&g).expect("its tokenizer builds");
    let text = proptest::collection::vec(
        prop_oneof![
            4 => any::<String>(),
            1 => Just("<|im_start|>user\n".to_owned()),
            1 => Just(" \n\t  ".to_owned()),
            1 => "[a-zA-Z0-9 ,.]{0,24}",
        ],
        0..6,
    )
    .prop_map(|parts| parts.concat());
    // A fixed seed: the model loads once, outside proptest's own per-test runner.
    let config = Config::with_cases(512);
    let rng = TestRng::deterministic_rng(config.rng_algorithm);
    TestRunner::new_with_rng(config, rng)
        .run(&text, |text| {
            let ids = tok.encode(&text).expect("every text encodes");
            prop_assert_eq!(tok.decode(&ids).expect("its ids decode"), text);
            Ok(())
        })
        .expect("every text round-trips");
}
