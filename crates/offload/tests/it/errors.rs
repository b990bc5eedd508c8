//! Bad input gives typed errors and loses nothing.

use kv_blocks::RequestId;
use offload::{HostLayout, OffloadConfig, OffloadError, SparseKvCacheManager};

use crate::util::{config, tokens};

#[test]
fn bad_input_is_rejected_and_nothing_is_lost() {
    let bad = OffloadConfig {
        hot_pages: 0,
        ..config(2, 4, HostLayout::LayerFirst)
    };
    assert!(matches!(
        SparseKvCacheManager::<f32>::new(bad),
        Err(OffloadError::Config(_))
    ));
    // Too many pages for u32 ids (a free list of 5 pages, before); pools whose sizes overflow
    // or that no machine's memory holds (refused by the allocator, not an abort).
    for (edit, needle) in [
        (
            &(|c: &mut OffloadConfig| c.host_pages = (1 << 32) + 5) as &dyn Fn(&mut OffloadConfig),
            "u32",
        ),
        (&|c| c.hot_pages = usize::MAX, "overflow"),
        (&|c| c.max_requests = usize::MAX / 2, "overflow"),
        (&|c| c.head_dim = 1 << 40, "overflow"),
        (&|c| c.host_pages = u32::MAX as usize, "overflow"),
        (
            &|c| {
                c.head_dim = 1 << 40;
                c.host_pages = 0;
            },
            "cannot allocate",
        ),
    ] {
        let mut c = config(2, 4, HostLayout::LayerFirst);
        edit(&mut c);
        match SparseKvCacheManager::<f32>::new(c) {
            Err(e) => assert!(e.to_string().contains(needle), "{c:?}: {e}"),
            Ok(_) => panic!("{c:?}: a manager was made"),
        }
    }

    let cfg = config(2, 4, HostLayout::PageHead);
    let stride = cfg.kv_heads * cfg.head_dim;
    let mut m = SparseKvCacheManager::<f32>::new(cfg).expect("valid");
    let (a, b) = (RequestId(1), RequestId(2));
    m.begin_request(a).expect("free");
    assert_eq!(m.begin_request(a), Err(OffloadError::DuplicateRequest(a)));
    assert_eq!(m.end_request(b), Err(OffloadError::UnknownRequest(b)));
    assert!(
        matches!(m.step(a, 0, &[0]), Err(OffloadError::Invalid(_))),
        "no tokens yet"
    );
    let (k, v) = (
        tokens(1, 0, 0, 10, 0, stride),
        tokens(1, 0, 0, 10, 1, stride),
    );
    m.append(a, 0, &k, &v).expect("3 of 4 pages");
    assert!(
        matches!(
            m.append(a, 0, &k[..5], &v[..5]),
            Err(OffloadError::Invalid(_))
        ),
        "partial token"
    );
    assert!(
        matches!(m.append(a, 5, &k, &v), Err(OffloadError::Invalid(_))),
        "layer out of range"
    );
    // Host pool exhausted: 10 more tokens need 3 more pages, 1 is free; nothing changes.
    m.begin_request(b).expect("free");
    let (k2, v2) = (
        tokens(2, 0, 0, 10, 0, stride),
        tokens(2, 0, 0, 10, 1, stride),
    );
    assert_eq!(
        m.append(b, 0, &k2, &v2),
        Err(OffloadError::HostExhausted { needed: 3, free: 1 })
    );
    assert_eq!((m.free_host_pages(), m.len(b, 0).expect("live")), (1, 0));
    // A count past `usize` (the length plus it used to overflow) needs more pages than exist.
    assert_eq!(
        m.host_pages_needed(a, 0, usize::MAX),
        Ok(usize::MAX.div_ceil(4) - 3)
    );
    assert!(matches!(
        m.reserve_tokens(b, 0, usize::MAX),
        Err(OffloadError::HostExhausted { free: 1, .. })
    ));
    assert_eq!((m.free_host_pages(), m.len(b, 0).expect("live")), (1, 0));
    // New tokens past `usize` (the length plus them used to overflow), or past a page.
    for n in [usize::MAX, 5] {
        assert!(matches!(
            m.step_with_new(a, 0, &[0], n),
            Err(OffloadError::Invalid(_))
        ));
    }
    // Selections: out of range, unsorted, duplicated, larger than the hot buffer.
    let hot_before = m.hot_buffer(a, 0).expect("live").clone();
    assert!(matches!(m.step(a, 0, &[3]), Err(OffloadError::Invalid(_))));
    assert!(matches!(
        m.step(a, 0, &[-1, 2]),
        Err(OffloadError::Invalid(_))
    ));
    assert!(matches!(
        m.step(a, 0, &[1, 0]),
        Err(OffloadError::Invalid(_))
    ));
    assert!(matches!(
        m.step(a, 0, &[1, 1]),
        Err(OffloadError::Invalid(_))
    ));
    let mut cfg3 = config(1, 8, HostLayout::LayerFirst);
    cfg3.max_requests = 1;
    let mut small = SparseKvCacheManager::<f32>::new(cfg3).expect("valid");
    small.begin_request(a).expect("free");
    assert_eq!(small.begin_request(b), Err(OffloadError::NoDeviceBuffer(1)));
    small.append(a, 0, &k, &v).expect("room");
    assert_eq!(
        small.step(a, 0, &[0, 1, 2]),
        Err(OffloadError::HotTooSmall {
            selected: 2,
            hot: 1
        })
    );
    assert_eq!(
        m.hot_buffer(a, 0).expect("live"),
        &hot_before,
        "failed steps change nothing"
    );
    // The good path still works after every refusal.
    assert_eq!(m.step(a, 0, &[0, 2]).expect("valid").stats.misses, 1);
    m.end_request(a).expect("live");
    m.end_request(b).expect("live");
    assert_eq!(m.free_host_pages(), 4);
}

#[test]
fn reserving_tokens_takes_the_positions_appending_writes() {
    let cfg = config(2, 6, HostLayout::LayerFirst);
    let stride = cfg.kv_heads * cfg.head_dim;
    let mut appended = SparseKvCacheManager::<f32>::new(cfg).expect("valid");
    let mut reserved = SparseKvCacheManager::<f32>::new(cfg).expect("valid");
    let (a, b) = (RequestId(1), RequestId(2));
    for m in [&mut appended, &mut reserved] {
        m.begin_request(a).expect("free");
        m.begin_request(b).expect("free");
    }
    // Interleaved requests, so their pages are not consecutive.
    for (id, layer, start, n) in [(a, 0, 0, 6), (b, 0, 0, 3), (a, 0, 6, 5), (a, 1, 0, 2)] {
        let (k, v) = (
            tokens(id.0, layer, start, n, 0, stride),
            tokens(id.0, layer, start, n, 1, stride),
        );
        appended.append(id, layer, &k, &v).expect("host room");
        let rows = reserved.reserve_tokens(id, layer, n).expect("host room");
        assert_eq!(rows.len(), n);
        let host = appended.host();
        let host = host.read();
        let layer_rows = cfg.host_pages * cfg.page_size;
        for (i, row) in rows.into_iter().enumerate() {
            let at = (layer * layer_rows + row) * stride;
            assert_eq!(
                host.tensors().0[at..at + stride],
                k[i * stride..(i + 1) * stride]
            );
        }
    }
    for id in [a, b] {
        assert_eq!(reserved.host_pages(id), appended.host_pages(id));
        for layer in 0..2 {
            assert_eq!(reserved.len(id, layer), appended.len(id, layer));
        }
    }
    // 14 more tokens of b need 4 more pages; 2 are free: nothing changes.
    assert_eq!(
        reserved.reserve_tokens(b, 0, 14),
        Err(OffloadError::HostExhausted { needed: 4, free: 2 })
    );
    assert_eq!((reserved.len(b, 0), reserved.free_host_pages()), (Ok(3), 2));
}
