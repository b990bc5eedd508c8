//! The batching scheduler on a synthetic model: batched runs equal one-at-a-time runs, many
//! random requests with cancellations leak nothing in either tier, prefixes are reused, and
//! bad requests get typed errors.

use std::collections::BTreeMap;

use coordinator::SparseConfig;
use engine::capacity::{BlockGeometry, footprint};
use engine::gguf::DType;
use engine::{
    EngineError, Event, FinishReason, Model, Report, Request, RequestError, Sampling, Scheduler,
    SchedulerConfig, Tokenizer,
};

use crate::model::{TINY, text, tiny};

/// A sparse configuration that runs prompts of 64 tokens or more in sparse mode.
fn quest(budget: usize, dense: Vec<usize>) -> SparseConfig {
    SparseConfig {
        dense_layers: dense,
        min_prompt_tokens: Some(64),
        ..SparseConfig::quest(budget)
    }
}

fn greedy(max_tokens: usize) -> Sampling {
    Sampling {
        max_tokens,
        stop_at_eos: false,
        ..Sampling::default()
    }
}

fn config(device_bytes: u64) -> SchedulerConfig {
    SchedulerConfig {
        device_bytes,
        host_bytes: 1 << 20,
        sparse_host_bytes: 4 << 20,
        max_batch_tokens: 48,
        max_running: 6,
        ..SchedulerConfig::default()
    }
}

/// KV bytes of one block of 16 tokens of the tiny model in f32.
const BLOCK: u64 = (TINY.layers * 2 * TINY.kv_heads * TINY.head_dim * 4 * 16) as u64;

/// Runs every request to its end; returns the reports by id and every admission.
fn drain(s: &mut Scheduler<'_, f32>) -> (BTreeMap<u64, Report>, Vec<Event>) {
    let mut done = BTreeMap::new();
    let mut admitted = Vec::new();
    let mut streamed: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for _ in 0..10_000 {
        if s.is_idle() {
            break;
        }
        for e in s.step().expect("a valid step") {
            match e {
                Event::Token { id, token } => streamed.entry(id).or_default().push(token),
                Event::Finished(r) => {
                    assert_eq!(streamed.remove(&r.id).unwrap_or_default(), r.tokens);
                    done.insert(r.id, *r);
                }
                a @ Event::Admitted { .. } => admitted.push(a),
            }
        }
    }
    assert!(s.is_idle(), "the scheduler finishes its work");
    (done, admitted)
}

/// The tokens `generate` gives for one request alone.
/// `requests` through one scheduler, each compared with its generation alone; answers the
/// reports by request (in submission order) and the admissions.
fn batched_against_alone(
    m: &Model,
    tok: &Tokenizer,
    requests: &[Request],
) -> (Vec<Report>, Vec<Event>) {
    let mut s = Scheduler::<f32>::new(m, Some(tok), config(64 << 20)).expect("valid");
    let ids: Vec<u64> = requests
        .iter()
        .map(|r| s.submit(r.clone()).expect("a valid request"))
        .collect();
    let (mut done, admitted) = drain(&mut s);
    let reports: Vec<Report> = ids
        .iter()
        .map(|id| done.remove(id).expect("every request finishes"))
        .collect();
    for (got, r) in reports.iter().zip(requests) {
        assert_eq!(got.tokens, alone(m, tok, r), "request {}", got.id);
    }
    (reports, admitted)
}

fn alone(m: &Model, tok: &Tokenizer, r: &Request) -> Vec<u32> {
    engine::generate::<f32>(
        m,
        tok,
        &r.prompt,
        &r.sampling,
        r.sparse.as_ref(),
        |_| {},
        |_, _| {},
    )
    .expect("a valid request")
    .0
}

#[test]
fn batched_requests_generate_what_they_generate_alone() {
    let g = tiny(DType::Q8_0);
    let m = Model::load(&g).expect("a valid model");
    let tok = Tokenizer::from_gguf(&g).expect("a byte-level tokenizer");
    let base = text(400);
    let requests: Vec<Request> = [
        (5, 0, None),
        (130, 7, None),
        (90, 30, Some(quest(1024, Vec::new()))),
        (200, 50, Some(quest(1024, vec![0]))),
        (17, 3, Some(quest(1024, Vec::new()))),
        (300, 11, None),
    ]
    .into_iter()
    .map(|(len, at, sparse)| Request {
        prompt: base[at..at + len].to_vec(),
        sampling: greedy(6),
        sparse,
    })
    .collect();
    let (reports, admitted) = batched_against_alone(&m, &tok, &requests);
    let sparse: Vec<bool> = admitted
        .iter()
        .map(|a| matches!(a, Event::Admitted { sparse: true, .. }))
        .collect();
    assert_eq!(sparse, [false, false, true, true, false, false]);
    assert!(reports.iter().all(|r| r.reason == FinishReason::Length));
}

#[test]
fn reservations_are_the_capacity_accounting() {
    let g = tiny(DType::Q8_0);
    let m = Model::load(&g).expect("a valid model");
    let base = text(400);
    let cases = [
        (130, None),
        (200, Some(quest(1024, Vec::new()))),
        (90, Some(quest(256, vec![0]))),
        (40, Some(quest(256, Vec::new()))),
    ];
    let mut s = Scheduler::<f32>::new(&m, None, config(64 << 20)).expect("valid");
    let ids: Vec<u64> = cases
        .iter()
        .map(|(len, sparse)| {
            let r = Request {
                prompt: base[..*len].to_vec(),
                sampling: greedy(6),
                sparse: sparse.clone(),
            };
            s.submit(r).expect("a valid request")
        })
        .collect();
    let (done, _) = drain(&mut s);
    let bs = SchedulerConfig::default().block_size;
    let blocks = BlockGeometry {
        tokens: bs,
        bytes: BLOCK / 16 * bs as u64,
    };
    for (id, (len, sparse)) in ids.iter().zip(&cases) {
        let lowered = sparse
            .as_ref()
            .map(|c| c.lower(TINY.shape(), None).expect("a valid configuration"));
        let f = footprint(lowered.as_ref(), TINY.shape(), 4, blocks, *len, len + 6);
        let r = &done[id];
        assert_eq!(
            (r.sparse, r.device_bytes, r.decode_device_bytes),
            (f.sparse, f.reserve, f.decode_reserve),
            "request of {len} tokens"
        );
    }
}

/// A small deterministic generator for the workload.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n as u64) as usize
    }
}

#[test]
fn random_requests_with_cancellations_leak_nothing() {
    let g = tiny(DType::Q4_1);
    let m = Model::load(&g).expect("a valid model");
    let tok = Tokenizer::from_gguf(&g).expect("a byte-level tokenizer");
    let base = text(1000);
    let mut rng = Rng(42);
    // Room for about 40 blocks: admission queues, and cached blocks are pushed to the host.
    let budget = 40 * BLOCK;
    let mut s = Scheduler::<f32>::new(&m, Some(&tok), config(budget)).expect("valid");
    let mut live = Vec::new();
    let mut ended = BTreeMap::new();
    let mut reused = 0;
    for round in 0..120 {
        if round < 60 && rng.below(2) == 0 {
            // Prompts start at one of a few offsets, so prefixes are shared.
            let at = [0, 0, 100, 250, 500][rng.below(5)];
            let len = 1 + rng.below(300);
            let sparse = match rng.below(3) {
                0 => None,
                1 => Some(quest(64, Vec::new())),
                _ => Some(quest(96, vec![1])),
            };
            let r = Request {
                prompt: base[at..at + len].to_vec(),
                sampling: Sampling {
                    temperature: 0.7,
                    seed: round,
                    stop: if rng.below(4) == 0 {
                        vec!["a".into()]
                    } else {
                        Vec::new()
                    },
                    ..greedy(1 + rng.below(20))
                },
                sparse,
            };
            live.push(s.submit(r).expect("a valid request"));
        }
        if !live.is_empty() && rng.below(6) == 0 {
            let id = live.swap_remove(rng.below(live.len()));
            let r = s.cancel(id).expect("a live request");
            assert_eq!(r.reason, FinishReason::Cancelled);
            ended.insert(id, r);
        }
        for e in s.step().expect("a valid step") {
            match e {
                Event::Finished(r) => {
                    live.retain(|&id| id != r.id);
                    assert!(r.reason != FinishReason::Cancelled);
                    assert!(ended.insert(r.id, *r).is_none(), "one report per request");
                }
                Event::Admitted { reused_tokens, .. } => reused += reused_tokens,
                Event::Token { .. } => {}
            }
        }
        let u = s.usage();
        assert!(u.reserved_bytes <= budget && u.running <= 6, "{u:?}");
        s.audit().expect("kv-blocks' invariants hold");
    }
    let (rest, _) = drain(&mut s);
    ended.extend(rest);
    assert_eq!(
        ended.len() as u64,
        ended.keys().max().copied().unwrap_or(0),
        "every request ended once"
    );
    let u = s.usage();
    let reasons: Vec<FinishReason> = ended.values().map(|r| r.reason).collect();
    for want in [
        FinishReason::Cancelled,
        FinishReason::Length,
        FinishReason::Stop,
    ] {
        assert!(reasons.contains(&want), "some request ends by {want:?}");
    }
    assert!(ended.values().any(|r| r.sparse && !r.tokens.is_empty()));
    assert!(reused > 0, "shared prefixes are reused");
    assert_eq!(
        (
            u.running,
            u.waiting,
            u.reserved_bytes,
            u.device_blocks_used,
            u.host_blocks_used,
            u.sparse_host_pages_used,
            u.sparse_requests
        ),
        (0, 0, 0, 0, 0, 0, 0),
        "nothing leaks: {u:?}"
    );
    assert!(
        u.host_blocks_cached > 0,
        "cached blocks went to the host tier: {u:?}"
    );
    s.audit().expect("kv-blocks' invariants hold");
}

#[test]
fn a_shared_prompt_is_reused_and_gives_the_same_tokens() {
    let g = tiny(DType::F16);
    let m = Model::load(&g).expect("a valid model");
    let tok = Tokenizer::from_gguf(&g).expect("a byte-level tokenizer");
    let prompt = text(150);
    for sparse in [None, Some(quest(64, Vec::new()))] {
        let r = Request {
            prompt: prompt.clone(),
            sampling: greedy(8),
            sparse,
        };
        let mut s = Scheduler::<f32>::new(&m, Some(&tok), config(64 << 20)).expect("valid");
        let first = s.submit(r.clone()).expect("valid");
        let (a, adm_a) = drain(&mut s);
        let second = s.submit(r.clone()).expect("valid");
        let (b, adm_b) = drain(&mut s);
        let reused = |adm: &[Event]| match adm {
            [Event::Admitted { reused_tokens, .. }] => *reused_tokens,
            other => panic!("one admission, got {other:?}"),
        };
        assert_eq!(reused(&adm_a), 0);
        // The full blocks of the prompt: the last one (144..158) never filled.
        assert_eq!(reused(&adm_b), 144);
        assert_eq!(b[&second].reused_tokens, 144);
        assert_eq!(a[&first].tokens, b[&second].tokens, "{:?}", r.sparse);
        assert_eq!(a[&first].tokens, alone(&m, &tok, &r));
    }
}

#[test]
fn bad_requests_get_typed_errors_and_leave_nothing() {
    let g = tiny(DType::F16);
    let m = Model::load(&g).expect("a valid model");
    let tok = Tokenizer::from_gguf(&g).expect("a byte-level tokenizer");
    let ok = Request {
        prompt: text(20),
        sampling: greedy(4),
        sparse: None,
    };
    let with = |f: &dyn Fn(&mut Request)| {
        let mut r = ok.clone();
        f(&mut r);
        r
    };
    let check = |s: &mut Scheduler<'_, f32>, r: Request, want: RequestError| {
        let before = s.usage();
        match s.submit(r) {
            Err(EngineError::Request(e)) => assert_eq!(e, want),
            other => panic!("{want}: got {other:?}"),
        }
        assert_eq!(s.usage(), before, "nothing kept of a rejected request");
    };
    let mut s = Scheduler::<f32>::new(&m, Some(&tok), config(16 * BLOCK)).expect("valid");
    check(
        &mut s,
        with(&|r| r.prompt.clear()),
        RequestError::EmptyPrompt,
    );
    check(
        &mut s,
        with(&|r| r.prompt = vec![1; 1021]),
        RequestError::TooLong {
            prompt: 1021,
            max_tokens: 4,
            limit: 1024,
        },
    );
    check(
        &mut s,
        with(&|r| r.prompt[3] = 999),
        RequestError::OutOfVocab {
            token: 999,
            vocab: 300,
        },
    );
    check(
        &mut s,
        with(&|r| r.sampling.temperature = -0.5),
        RequestError::Sampling("temperature -0.5 (must be finite and ≥ 0)".into()),
    );
    check(
        &mut s,
        with(&|r| r.prompt = text(300)),
        RequestError::TooBig {
            what: "device memory",
            need: 19 * BLOCK,
            budget: 16 * BLOCK,
        },
    );
    let e = s
        .submit(with(&|r| r.sparse = Some(quest(64, vec![7]))))
        .expect_err("layer 7 of 3");
    assert!(
        matches!(e, EngineError::Request(RequestError::Sparse(_))),
        "{e}"
    );
    assert!(matches!(
        s.cancel(77),
        Err(EngineError::Request(RequestError::Unknown(77)))
    ));
    let mut no_tok = Scheduler::<f32>::new(&m, None, config(16 * BLOCK)).expect("valid");
    check(
        &mut no_tok,
        with(&|r| r.sampling.stop = vec!["x".into()]),
        RequestError::NoTokenizer,
    );
    // The good request still runs.
    let id = s.submit(ok.clone()).expect("valid");
    let (done, _) = drain(&mut s);
    assert_eq!(done[&id].tokens.len(), 4);
}

/// Requests whose configuration prefetches (the next layer's estimated selection loaded
/// before its step) generate what they generate alone, and what the same request without the
/// prefetch generates.
#[test]
fn prefetching_requests_generate_what_they_generate_without() {
    let g = tiny(DType::Q8_0);
    let m = Model::load(&g).expect("a valid model");
    let tok = Tokenizer::from_gguf(&g).expect("a byte-level tokenizer");
    let base = text(400);
    let small = quest(64, Vec::new());
    let early = SparseConfig {
        prefetch: true,
        ..small.clone()
    };
    let requests: Vec<Request> = [(200, 0, small), (200, 0, early.clone()), (150, 40, early)]
        .into_iter()
        .map(|(len, at, sparse)| Request {
            prompt: base[at..at + len].to_vec(),
            sampling: greedy(12),
            sparse: Some(sparse),
        })
        .collect();
    let (reports, admitted) = batched_against_alone(&m, &tok, &requests);
    assert!(
        admitted
            .iter()
            .all(|a| matches!(a, Event::Admitted { sparse: true, .. })),
        "{admitted:?}"
    );
    assert_eq!(reports[0].tokens, reports[1].tokens);
}
