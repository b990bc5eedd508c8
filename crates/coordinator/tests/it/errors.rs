//! Hooks called out of order or with bad input give typed errors and change nothing; a forward
//! that fails in a layer is abandoned, ending only the requests it changed.

use coordinator::{CoordError, Mode, Phase, SparseConfig};
use kv_blocks::RequestId;
use offload::HostAlloc;
use sparse_algo::{AlgoConfig, QuestConfig};

use crate::util::{Engine, MODEL};

/// Quest over pages of 4 with a shared budget of 16 tokens; prompts of 20 go sparse.
fn config() -> SparseConfig {
    SparseConfig {
        algo: AlgoConfig::Quest(QuestConfig {
            page_size: 4,
            budget_tokens: 16,
            shared_heads: true,
            ..Default::default()
        }),
        min_prompt_tokens: Some(20),
        ..Default::default()
    }
}

fn engine() -> Engine {
    Engine::new(&config(), HostAlloc::Own, 40)
}

fn invalid<T: std::fmt::Debug>(r: Result<T, CoordError>) -> bool {
    matches!(r.err(), Some(CoordError::Invalid(_)))
}

#[test]
fn out_of_order_and_malformed_calls_change_nothing() {
    let mut e = engine();
    let (a, b, z) = (RequestId(1), RequestId(2), RequestId(9));
    e.add(a);
    assert_eq!(e.coord.on_request_begin(a, 24), Ok(Mode::Sparse));
    assert_eq!(
        e.coord.on_request_begin(a, 24),
        Err(CoordError::DuplicateRequest(a))
    );
    assert!(invalid(e.coord.on_request_begin(b, 0)));
    assert_eq!(
        e.coord.on_request_end(z),
        Err(CoordError::UnknownRequest(z))
    );
    let (kvs, qs) = (
        MODEL.kv_heads * MODEL.head_dim,
        MODEL.q_heads * MODEL.head_dim,
    );
    let (k, q) = (vec![0.5f32; 24 * kvs], vec![0.25f32; 24 * qs]);
    // Layer hooks need a forward.
    assert!(invalid(e.coord.attention_begin(0, &q, &k, &k)));
    assert!(invalid(e.coord.forward_end()));
    // Batches: unknown, twice, past the prompt.
    assert_eq!(
        e.coord.forward_begin(&[(z, 1)]),
        Err(CoordError::UnknownRequest(z))
    );
    assert!(invalid(e.coord.forward_begin(&[(a, 1), (a, 1)])));
    assert!(invalid(e.coord.forward_begin(&[(a, 25)])));
    // Counts near `usize::MAX` (their sums used to overflow): a sparse prefill's and a dense
    // batch's.
    assert!(invalid(e.coord.forward_begin(&[(a, usize::MAX)])));
    let (d1, d2) = (RequestId(5), RequestId(6));
    for d in [d1, d2] {
        e.add(d);
        assert_eq!(e.coord.on_request_begin(d, 3), Ok(Mode::Dense));
    }
    assert!(invalid(e.coord.forward_begin(&[(d1, usize::MAX), (d2, 2)])));
    assert!(invalid(
        e.coord
            .on_prefix_cached(d1, usize::MAX, |_| (Vec::new(), Vec::new()))
    ));
    for d in [d1, d2] {
        e.coord.on_request_end(d).expect("live, outside a forward");
    }
    e.coord.forward_begin(&[(a, 24)]).expect("the whole prompt");
    assert!(
        invalid(e.coord.forward_begin(&[(a, 1)])),
        "one forward at a time"
    );
    assert!(
        invalid(e.coord.attention_begin(0, &q[..qs], &k, &k)),
        "short q"
    );
    assert!(invalid(e.coord.attention_end(0, &k, &k[..kvs])), "short v");
    assert!(
        invalid(e.coord.attention_begin(3, &q, &k, &k)),
        "no layer 3"
    );
    assert!(invalid(e.coord.on_request_end(a)), "a is in the forward");
    assert!(invalid(e.coord.forward_end()), "no layer has ended");
    let t = *e.coord.tracker(a).expect("live");
    assert_eq!((t.len, t.phase), (0, Phase::Prefill), "nothing changed");
    for l in 0..MODEL.layers {
        e.coord.attention_begin(l, &q, &k, &k).expect("valid");
        e.coord.attention_end(l, &k, &k).expect("valid");
    }
    assert!(
        invalid(e.coord.attention_end(0, &k, &k)),
        "layer 0 has ended"
    );
    e.coord.forward_end().expect("every layer ended");
    let t = *e.coord.tracker(a).expect("live");
    assert_eq!((t.len, t.phase, t.represented), (24, Phase::Decode, true));
    // Decode takes one token per forward.
    assert!(invalid(e.coord.forward_begin(&[(a, 2)])));
    // Representation slots run out: the third sparse request is refused, nothing taken.
    for id in [RequestId(3), RequestId(4)] {
        e.coord.on_request_begin(id, 20).expect("a slot");
    }
    assert_eq!(e.coord.on_request_begin(b, 20), Err(CoordError::Full(3)));
    assert_eq!(
        e.coord.on_request_begin(b, 19),
        Ok(Mode::Dense),
        "short prompts stay dense"
    );
    // A prefix needs caller-given host pages (HostAlloc::External); nothing is left behind.
    assert!(matches!(
        e.coord.on_request_begin_with_prefix(z, 30, &[0], 4),
        Err(CoordError::Full(3))
    ));
    e.coord.on_request_end(RequestId(4)).expect("live");
    assert!(matches!(
        e.coord.on_request_begin_with_prefix(z, 30, &[0], 4),
        Err(CoordError::Offload(offload::OffloadError::Config(_)))
    ));
    assert!(invalid(e.coord.on_request_begin_with_prefix(
        z,
        30,
        &[0],
        30
    )));
    assert!(e.coord.tracker(z).is_none());
    e.coord.on_request_begin(z, 20).expect("the slot came back");
}

#[test]
fn a_full_host_pool_backs_up_no_request_of_the_batch() {
    // 13 host pages: two prompts of 24 tokens take 12; their 25th tokens need 2 more.
    let mut e = Engine::new(&config(), HostAlloc::Own, 13);
    let (a, c) = (RequestId(1), RequestId(3));
    for id in [a, c] {
        e.add(id);
        e.coord.on_request_begin(id, 24).expect("a slot");
    }
    e.forward(&[(a, 24), (c, 24)]);
    let (kvs, qs) = (
        MODEL.kv_heads * MODEL.head_dim,
        MODEL.q_heads * MODEL.head_dim,
    );
    let (k, q) = (vec![0.5f32; 2 * kvs], vec![0.25f32; 2 * qs]);
    e.coord.forward_begin(&[(a, 1), (c, 1)]).expect("valid");
    e.coord.attention_begin(0, &q, &k, &k).expect("valid");
    assert!(matches!(
        e.coord.attention_end(0, &k, &k),
        Err(CoordError::Offload(offload::OffloadError::HostExhausted {
            needed: 2,
            free: 1
        }))
    ));
    let m = e.coord.manager().expect("sparse");
    assert_eq!(
        (m.len(a, 0), m.len(c, 0)),
        (Ok(24), Ok(24)),
        "neither was backed up"
    );
    assert_eq!(m.free_host_pages(), 1);
    // The forward cannot end; abandoned, it ends the two requests whose hot buffers the
    // layer's step changed, and their pages come back. A dense request is kept.
    assert!(invalid(e.coord.forward_end()));
    assert_eq!(e.coord.abort_forward(), Ok(vec![a, c]));
    assert!(e.coord.tracker(a).is_none() && e.coord.tracker(c).is_none());
    let m = e.coord.manager().expect("sparse");
    assert_eq!(m.free_host_pages(), 13);
    let d = RequestId(4);
    e.add(d);
    e.coord.on_request_begin(d, 3).expect("dense");
    e.coord
        .forward_begin(&[(d, 3)])
        .expect("no forward in progress");
    let (k3, q3) = (vec![0.5f32; 3 * kvs], vec![0.25f32; 3 * qs]);
    e.coord.attention_begin(0, &q3, &k3, &k3).expect("valid");
    assert_eq!(
        e.coord.abort_forward(),
        Ok(vec![]),
        "a dense request is kept"
    );
    assert_eq!(e.coord.tracker(d).map(|t| t.len), Some(0));
    assert!(invalid(e.coord.abort_forward()), "no forward in progress");
}

#[test]
fn a_cached_prefix_is_checked_before_anything_is_taken() {
    let mut e = engine();
    let (a, z) = (RequestId(1), RequestId(9));
    e.add(a);
    e.coord.on_request_begin(a, 24).expect("a slot");
    let kvs = MODEL.kv_heads * MODEL.head_dim;
    let kv = |n: usize| move |_: usize| (vec![0.5f32; n * kvs], vec![0.25f32; n * kvs]);
    assert_eq!(
        e.coord.on_prefix_cached(z, 4, kv(4)),
        Err(CoordError::UnknownRequest(z))
    );
    assert!(
        invalid(e.coord.on_prefix_cached(a, 24, kv(24))),
        "the last prompt token is always computed"
    );
    assert!(invalid(e.coord.on_prefix_cached(a, 8, kv(7))), "short K");
    let host = |e: &Engine| e.coord.manager().expect("sparse layers").free_host_pages();
    let free = host(&e);
    assert_eq!(
        e.coord.tracker(a).map(|t| t.len),
        Some(0),
        "nothing changed"
    );
    assert_eq!(host(&e), free, "no host page taken");
    e.coord.on_prefix_cached(a, 8, kv(8)).expect("valid");
    assert_eq!(e.coord.tracker(a).map(|t| t.len), Some(8));
    assert_eq!(host(&e), free - 2, "two pages of 4 tokens");
    // A prefix larger than the host pool takes nothing.
    let b = RequestId(2);
    e.coord.on_request_begin(b, 400).expect("a slot");
    assert!(matches!(
        e.coord.on_prefix_cached(b, 390, kv(390)),
        Err(CoordError::Offload(
            offload::OffloadError::HostExhausted { .. }
        ))
    ));
    assert_eq!(e.coord.tracker(b).map(|t| t.len), Some(0));
    e.coord
        .forward_begin(&[(a, 16)])
        .expect("the rest of the prompt");
    assert!(
        invalid(e.coord.on_prefix_cached(a, 1, kv(1))),
        "not during a forward"
    );
}
