//! The IO pipeline and kv-blocks' transfers move the same bytes as direct copies, and the
//! manager runs every load through its executor.

use std::sync::Arc;

use attn_op::{KvLayout, PagedKv};
use kv_blocks::{BlockId, BlockLoc, GroupId, RequestId, Tier, Transfer, TransferKind};
use offload::{
    CpuExecutor, HostLayout, HostPool, HostShape, HostStore, Job, Load, OffloadError, Pipeline,
    SparseKvCacheManager, TransferExecutor, execute_block_transfers, execute_loads,
};
use parking_lot::RwLock;

use crate::util::token;

const SHAPE: HostShape = HostShape {
    layers: 2,
    pages: 6,
    page_size: 4,
    kv_heads: 2,
    head_dim: 4,
};

fn host() -> HostPool<f32> {
    let mut h = HostPool::new(SHAPE, HostLayout::PageHead).expect("small");
    for l in 0..2 {
        for p in 0..6 {
            for t in 0..4 {
                let pos = p * 4 + t;
                h.write_token(l, p, t, &token(3, l, pos, 0, 8), &token(3, l, pos, 1, 8));
            }
        }
    }
    h
}

fn layout(blocks: usize) -> KvLayout {
    KvLayout {
        num_blocks: blocks,
        block_size: 4,
        kv_heads: 2,
        head_dim: 4,
    }
}

#[test]
fn the_pipeline_completes_each_layer_with_the_same_bytes() {
    let loads = |layer| {
        vec![
            Load {
                layer,
                host_page: 5,
                first: 0,
                tokens: 4,
                device_block: 0,
            },
            Load {
                layer,
                host_page: 2,
                first: 1,
                tokens: 2,
                device_block: 2,
            },
        ]
    };
    let h = host();
    let mut expected = Vec::new();
    for l in 0..2 {
        let mut d = PagedKv::<f32>::new(layout(3)).expect("valid");
        execute_loads(&h, &loads(l), &mut d).expect("in range");
        expected.push(d);
    }
    let shared: Arc<RwLock<dyn HostStore<f32>>> = Arc::new(RwLock::new(h));
    let pipe = Pipeline::new();
    let devices: Vec<_> = (0..2)
        .map(|_| Arc::new(RwLock::new(PagedKv::<f32>::new(layout(3)).expect("valid"))))
        .collect();
    let tickets: Vec<_> = (0..2)
        .map(|l| {
            pipe.submit(Job {
                host: Arc::clone(&shared),
                device: Arc::clone(&devices[l]),
                loads: loads(l),
            })
        })
        .collect();
    for (l, t) in tickets.into_iter().enumerate() {
        t.wait().expect("loads in range");
        assert_eq!(*devices[l].read(), expected[l]);
    }
    let bad = pipe.submit(Job {
        host: shared,
        device: Arc::clone(&devices[0]),
        loads: vec![Load {
            layer: 0,
            host_page: 9,
            first: 0,
            tokens: 4,
            device_block: 0,
        }],
    });
    assert!(
        bad.wait().is_err(),
        "a bad load is reported through its ticket"
    );
    assert_eq!(*devices[0].read(), expected[0], "and writes nothing");
}

#[test]
fn kv_blocks_transfers_move_blocks_between_tiers() {
    let fill = |seed: u64| -> PagedKv<f32> {
        let n = layout(4).len();
        let k: Vec<f32> = (0..n).map(|i| token(seed, 0, i, 0, 1)[0]).collect();
        let v: Vec<f32> = (0..n).map(|i| token(seed, 0, i, 1, 1)[0]).collect();
        PagedKv::from_tensors(layout(4), k, v).expect("valid")
    };
    let mut primary = vec![fill(1), fill(2)];
    let mut secondary = vec![fill(3), fill(4)];
    let before_p = primary.clone();
    let loc = |tier, b| BlockLoc {
        tier,
        block: BlockId::new(b),
    };
    let transfers = [
        Transfer {
            group: GroupId(0),
            src: loc(Tier::Primary, 1),
            dst: loc(Tier::Secondary, 2),
            num_tokens: None,
            kind: TransferKind::Offload,
        },
        Transfer {
            group: GroupId(0),
            src: loc(Tier::Secondary, 2),
            dst: loc(Tier::Primary, 3),
            num_tokens: Some(2),
            kind: TransferKind::Onboard,
        },
    ];
    execute_block_transfers(&transfers, &mut primary, &mut secondary).expect("in range");
    let page = 4 * 8;
    for l in 0..2 {
        assert_eq!(
            secondary[l].k()[2 * page..3 * page],
            before_p[l].k()[page..2 * page]
        );
        assert_eq!(
            primary[l].v()[3 * page..3 * page + 16],
            before_p[l].v()[page..page + 16]
        );
        assert_eq!(
            primary[l].k()[3 * page + 16..4 * page],
            before_p[l].k()[3 * page + 16..4 * page]
        );
    }
    let out = [Transfer {
        group: GroupId(0),
        src: loc(Tier::Primary, 9),
        dst: loc(Tier::Secondary, 0),
        num_tokens: None,
        kind: TransferKind::Offload,
    }];
    assert!(execute_block_transfers(&out, &mut primary, &mut secondary).is_err());
}

/// An executor that records what it runs, then copies like the CPU one.
#[derive(Debug, Default)]
struct Recording(Arc<parking_lot::Mutex<Vec<Load>>>);

impl TransferExecutor<f32> for Recording {
    fn loads(
        &self,
        host: &dyn HostStore<f32>,
        loads: &[Load],
        device: &mut PagedKv<f32>,
    ) -> Result<(), OffloadError> {
        self.0.lock().extend_from_slice(loads);
        CpuExecutor.loads(host, loads, device)
    }

    fn block_transfers(
        &self,
        transfers: &[Transfer],
        primary: &mut [PagedKv<f32>],
        secondary: &mut [PagedKv<f32>],
    ) -> Result<(), OffloadError> {
        CpuExecutor.block_transfers(transfers, primary, secondary)
    }
}

#[test]
fn every_step_runs_its_loads_through_the_executor() {
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let cfg = crate::util::config(4, 8, HostLayout::PageFirst);
    let stride = cfg.kv_heads * cfg.head_dim;
    let mut m = SparseKvCacheManager::<f32>::new(cfg)
        .expect("valid")
        .with_executor(Box::new(Recording(Arc::clone(&seen))));
    let id = RequestId(1);
    m.begin_request(id).expect("free");
    for l in 0..cfg.layers {
        let (k, v) = (
            crate::util::tokens(1, l, 0, 14, 0, stride),
            crate::util::tokens(1, l, 0, 14, 1, stride),
        );
        m.append(id, l, &k, &v).expect("room");
    }
    let mut expected = Vec::new();
    for (l, sel) in [(0, vec![0, 2, 3]), (1, vec![1, 3]), (0, vec![1, 2, 3])] {
        expected.extend(m.step(id, l, &sel).expect("valid").loads);
    }
    assert_eq!(*seen.lock(), expected);
    // Per step: a reserved refresh (first step of each layer), then the misses.
    assert_eq!(expected.len(), (1 + 2) + (1 + 1) + 1);
}
