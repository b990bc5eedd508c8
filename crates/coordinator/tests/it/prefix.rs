//! A request whose prefix kv-blocks' host tier already holds starts in sparse mode: nothing
//! recomputed, nothing copied.

use coordinator::{Phase, SparseConfig};
use kv_blocks::{GroupId, KvCacheConfig, KvCacheManager, RequestId, RequestSpec, Tier};
use offload::HostAlloc;
use sparse_algo::{AlgoConfig, QuestConfig};

use crate::util::{Engine, MAX};

/// kv-blocks' host-tier block ids of a request, as host pages.
fn host_pages(kv: &KvCacheManager, id: RequestId) -> Vec<u32> {
    kv.block_table(id, GroupId(0))
        .expect("live")
        .iter()
        .map(|b| b.expect("no window").index() as u32)
        .collect()
}

/// Appends a sampled token in kv-blocks and hands any new host block to the coordinator.
fn sample(kv: &mut KvCacheManager, e: &mut Engine, id: RequestId, token: u32) {
    let before = host_pages(kv, id).len();
    kv.append_token(id, token).expect("room");
    let pages = host_pages(kv, id);
    e.coord
        .extend_host_pages(id, &pages[before..])
        .expect("in the pool");
}

#[test]
fn a_prefix_reused_from_the_host_tier_starts_in_sparse_mode() {
    const HOST: u32 = 100;
    let config = SparseConfig {
        algo: AlgoConfig::Quest(QuestConfig {
            page_size: 4,
            budget_tokens: MAX,
            ..Default::default()
        }),
        min_prompt_tokens: Some(60),
        dense_layers: vec![1],
        ..Default::default()
    };
    let mut e = Engine::new(&config, HostAlloc::External, HOST as usize);
    e.expect_dense = true;
    let mut kv_config = KvCacheConfig::new(4, 8, HOST);
    kv_config.enable_partial_reuse = false;
    let mut kv = KvCacheManager::new(kv_config).expect("valid");
    let (a, b) = (RequestId(1), RequestId(2));
    let prompt: Vec<u32> = (0..90).collect();

    // Request a: prefill into kv-blocks' host blocks, decode 6 tokens, finish.
    kv.add_request(RequestSpec {
        tier: Tier::Secondary,
        ..RequestSpec::new(a, prompt.clone())
    })
    .expect("room");
    e.add(a);
    e.coord.on_request_begin(a, 90).expect("room");
    e.coord
        .extend_host_pages(a, &host_pages(&kv, a))
        .expect("in the pool");
    e.forward(&[(a, 90)]);
    kv.commit_computed(a, 90).expect("live");
    for t in 0..6 {
        sample(&mut kv, &mut e, a, 1000 + t);
        e.forward(&[(a, 1)]);
    }
    let a_pages = host_pages(&kv, a);
    kv.release(a).expect("live");
    e.coord.on_request_end(a).expect("live");

    // Request b shares a's first 88 tokens (22 full blocks), cached in the host tier.
    let mut tokens = prompt[..90].to_vec();
    tokens.extend([7000, 7001, 7002]);
    let reused = kv
        .add_request(RequestSpec {
            tier: Tier::Secondary,
            ..RequestSpec::new(b, tokens)
        })
        .expect("room")
        .reused_tokens as usize;
    assert_eq!(reused, 88);
    let pages = host_pages(&kv, b);
    assert_eq!(pages[..22], a_pages[..22], "b's prefix is a's host blocks");
    let bytes = e.coord.manager().expect("sparse").totals().bytes;
    e.add(b);
    e.stream.insert(b, a.0);
    e.fill_own(b, reused);
    e.coord
        .on_request_begin_with_prefix(b, 93, &pages, reused)
        .expect("a valid prefix");
    let t = *e.coord.tracker(b).expect("live");
    assert_eq!((t.len, t.phase, t.reused_tokens), (88, Phase::Decode, 88));
    assert_eq!(
        e.coord.manager().expect("sparse").totals().bytes,
        bytes,
        "nothing copied at the start"
    );
    // The rest of the prompt and 8 more tokens, one per forward, each checked against dense
    // attention over the full KV.
    let checked = e.checked;
    for i in 0..13 {
        if i >= 5 {
            sample(&mut kv, &mut e, b, 2000 + i);
        }
        e.forward(&[(b, 1)]);
    }
    assert_eq!(e.checked - checked, 2 * 13);
    kv.release(b).expect("live");
    e.coord.on_request_end(b).expect("live");
}
