//! Copy-plan reuse across layers that share a selection, and host pages given by the caller
//! (a prefix reused from kv-blocks' host tier).

use kv_blocks::RequestId;
use offload::{HostAlloc, HostLayout, OffloadConfig, OffloadError, SparseKvCacheManager, StepPlan};
use proptest::prelude::RngExt;
use proptest::test_runner::{RngAlgorithm, TestRng};

use crate::util::{config, token, tokens};

/// Appends `n` tokens of request `req` to every layer.
fn fill(m: &mut SparseKvCacheManager<f32>, req: u64, start: usize, n: usize) {
    let c = m.config();
    let stride = c.kv_heads * c.head_dim;
    for l in 0..c.layers {
        let (k, v) = (
            tokens(req, l, start, n, 0, stride),
            tokens(req, l, start, n, 1, stride),
        );
        m.append(RequestId(req), l, &k, &v).expect("host room");
    }
}

/// A random ascending selection of at most `max` pages out of `pages`.
fn select(rng: &mut TestRng, pages: usize, max: usize) -> Vec<i32> {
    let mut s: Vec<i32> = (0..rng.random_range(1..=max))
        .map(|_| rng.random_range(0..pages as i32))
        .collect();
    s.sort_unstable();
    s.dedup();
    s
}

/// A plan with the layer and the reuse count erased, for comparing layers.
fn erase(mut p: StepPlan) -> StepPlan {
    for l in &mut p.loads {
        l.layer = 0;
    }
    p.stats.reused_plans = 0;
    p
}

#[test]
fn layers_sharing_a_selection_share_one_plan() {
    let cfg = config(6, 40, HostLayout::PageFirst);
    let id = RequestId(1);
    let (mut one, mut shared) = (
        SparseKvCacheManager::<f32>::new(cfg).expect("valid"),
        SparseKvCacheManager::<f32>::new(cfg).expect("valid"),
    );
    for m in [&mut one, &mut shared] {
        m.begin_request(id).expect("free");
        fill(m, 1, 0, 37);
    }
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[5; 32]);
    let mut reused = 0;
    for step in 0..40 {
        let len = one.len(id, 0).expect("live");
        let sel = select(&mut rng, len.div_ceil(cfg.page_size), cfg.hot_pages);
        if step == 20 {
            // Layer 0 alone takes one extra step: the buffers differ from here on.
            let a = one.step(id, 0, &sel).expect("valid");
            let b = shared.step(id, 0, &sel).expect("valid");
            assert_eq!(a, b);
            continue;
        }
        let plans = shared.step_layers(id, &[0, 1], &sel, 0).expect("valid");
        for (l, plan) in plans.into_iter().enumerate() {
            reused += plan.stats.reused_plans;
            assert_eq!(
                erase(plan),
                erase(one.step(id, l, &sel).expect("valid")),
                "step {step} layer {l}"
            );
            assert_eq!(
                one.hot_buffer(id, l).expect("live"),
                shared.hot_buffer(id, l).expect("live")
            );
            assert_eq!(one.device(l).read().k(), shared.device(l).read().k());
            assert_eq!(one.device(l).read().v(), shared.device(l).read().v());
        }
        fill(&mut one, 1, len, 1);
        fill(&mut shared, 1, len, 1);
    }
    assert_eq!(
        reused, 20,
        "layer 1 reuses layer 0's plan until their buffers part"
    );
    assert_eq!(shared.totals().reused_plans, 20);
}

#[test]
fn a_prefix_in_caller_given_host_pages_is_used_where_it_lies() {
    let cfg = OffloadConfig {
        host_alloc: HostAlloc::External,
        ..config(4, 12, HostLayout::PageHead)
    };
    let stride = cfg.kv_heads * cfg.head_dim;
    let mut m = SparseKvCacheManager::<f32>::new(cfg).expect("valid");
    let (a, b) = (RequestId(1), RequestId(2));
    m.begin_request(a).expect("free");
    assert_eq!(
        m.append(
            a,
            0,
            &tokens(1, 0, 0, 1, 0, stride),
            &tokens(1, 0, 0, 1, 1, stride)
        ),
        Err(OffloadError::MissingHostPages { needed: 1 }),
        "the caller gives every page"
    );
    m.extend_host_pages(a, &[9, 2, 7]).expect("in the pool");
    fill(&mut m, 1, 0, 10);
    m.end_request(a).expect("live");
    assert_eq!(m.free_host_pages(), 0, "the caller owns the pages");

    // Request b reuses a's first two pages (8 tokens) where they lie: nothing moves until a
    // step selects them.
    m.begin_request_with_prefix(b, &[9, 2], 8)
        .expect("valid prefix");
    assert_eq!(m.len(b, 1), Ok(8));
    assert_eq!(m.totals().bytes, 0);
    m.extend_host_pages(b, &[4]).expect("in the pool");
    let (k, v) = (tokens(2, 1, 8, 3, 0, stride), tokens(2, 1, 8, 3, 1, stride));
    m.append(b, 1, &k, &v).expect("page 4 holds them");
    let plan = m.step(b, 1, &[0, 1, 2]).expect("valid");
    assert_eq!(plan.stats.misses, 2);
    let device = m.device(1);
    let device = device.read();
    for (i, &block) in plan.block_table.iter().enumerate() {
        for off in 0..if i == 2 { 3 } else { 4 } {
            let slot = block as usize * cfg.page_size + off;
            let pos = i * cfg.page_size + off;
            let want = if pos < 8 {
                token(1, 1, pos, 0, stride)
            } else {
                token(2, 1, pos, 0, stride)
            };
            assert_eq!(&device.k()[slot * stride..(slot + 1) * stride], &want[..]);
        }
    }

    // Bad input changes nothing.
    let c = RequestId(3);
    assert!(matches!(
        m.begin_request_with_prefix(c, &[12], 1),
        Err(OffloadError::Invalid(_))
    ));
    assert!(matches!(
        m.begin_request_with_prefix(c, &[1], 5),
        Err(OffloadError::Invalid(_))
    ));
    assert_eq!(m.num_requests(), 1);
    let mut own =
        SparseKvCacheManager::<f32>::new(config(4, 12, HostLayout::LayerFirst)).expect("valid");
    assert!(matches!(
        own.begin_request_with_prefix(c, &[1], 1),
        Err(OffloadError::Config(_))
    ));
    assert!(
        matches!(
            m.step_with_new(b, 1, &[2], 2),
            Err(OffloadError::Invalid(_))
        ),
        "new tokens past the current page"
    );
}
