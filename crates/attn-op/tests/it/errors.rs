//! Bad inputs get typed errors, never panics, and outputs stay untouched.

use attn_op::{
    AttnError, AttnOut, AttnParams, BatchMeta, KvCache, KvLayout, PagedKv, Selection, Simd,
    compact_kv, gather_page_offsets, merge_attention, paged_attention, sparse_page_attention,
};

use crate::oracle::Rng;

const LAYOUT: KvLayout = KvLayout {
    num_blocks: 4,
    block_size: 4,
    kv_heads: 2,
    head_dim: 4,
};

fn kv() -> PagedKv<f32> {
    let n = LAYOUT.len();
    let k = (0..n).map(|i| (i % 7) as f32 * 0.1 + 0.05).collect();
    let v = (0..n).map(|i| (i % 5) as f32 * 0.2 - 0.3).collect();
    PagedKv::from_tensors(LAYOUT, k, v).expect("consistent")
}

/// A valid dense call, to be broken one field at a time.
struct Call {
    cu: Vec<i32>,
    lens: Vec<i32>,
    table: Vec<i32>,
    params: AttnParams,
    max_blocks: usize,
}

/// Runs dense attention on a mutated valid call and returns its error; checks the output buffer
/// was not written.
fn dense_err(edit: &dyn Fn(&mut Call)) -> AttnError {
    let mut c = Call {
        cu: vec![0, 1, 3],
        lens: vec![5, 2],
        table: vec![0, 1, 2, -1],
        params: AttnParams::new(4, 4),
        max_blocks: 2,
    };
    edit(&mut c);
    let total = 3;
    let q = vec![0.5f32; total * c.params.q_heads * 4];
    let mut out = vec![7.0f32; total * c.params.q_heads * 4];
    let meta = BatchMeta {
        cu_seqlens_q: &c.cu,
        seq_lens_kv: &c.lens,
        block_table: &c.table,
        max_blocks: c.max_blocks,
    };
    let err = paged_attention(
        &q,
        &kv(),
        &meta,
        &c.params,
        AttnOut {
            out: &mut out,
            lse: None,
        },
    )
    .expect_err("the edit makes the call invalid");
    assert!(out.iter().all(|&x| x == 7.0), "output written on error");
    err
}

#[test]
fn bad_batch_metadata_is_rejected() {
    let check = |edit: &dyn Fn(&mut Call), want: &dyn Fn(&AttnError) -> bool| {
        let err = dense_err(edit);
        assert!(want(&err), "unexpected error: {err}");
    };
    check(&|c| c.params.q_heads = 3, &|e| {
        matches!(
            e,
            AttnError::Heads {
                q_heads: 3,
                kv_heads: 2
            }
        )
    });
    check(&|c| c.params.q_heads = 0, &|e| {
        matches!(e, AttnError::Heads { .. })
    });
    check(&|c| c.cu.truncate(2), &|e| {
        matches!(e, AttnError::Metadata(_))
    });
    check(&|c| c.cu[0] = 1, &|e| matches!(e, AttnError::Metadata(_)));
    check(&|c| c.cu[1] = 4, &|e| matches!(e, AttnError::Metadata(_)));
    check(
        &|c| c.lens[1] = 1,
        &|e| matches!(e, AttnError::Metadata(m) if m.contains("shorter")),
    );
    check(&|c| c.lens[0] = -5, &|e| {
        matches!(e, AttnError::Metadata(_))
    });
    check(
        &|c| c.lens[0] = 9,
        &|e| matches!(e, AttnError::Metadata(m) if m.contains("blocks")),
    );
    check(&|c| c.table[1] = 9, &|e| {
        matches!(
            e,
            AttnError::BlockOutOfRange {
                seq: 0,
                block: 9,
                ..
            }
        )
    });
    check(&|c| c.table[2] = -1, &|e| {
        matches!(
            e,
            AttnError::BlockOutOfRange {
                seq: 1,
                block: -1,
                ..
            }
        )
    });
    check(&|c| c.table.push(0), &|e| {
        matches!(
            e,
            AttnError::Length {
                what: "block_table",
                ..
            }
        )
    });
    check(&|c| c.max_blocks = usize::MAX, &|e| {
        matches!(e, AttnError::Metadata(_))
    });
    check(&|c| c.params.window = Some(0), &|e| {
        matches!(e, AttnError::Invalid(_))
    });
    check(&|c| c.params.scale = f32::NAN, &|e| {
        matches!(e, AttnError::Invalid(_))
    });
    check(&|c| c.params.sink_logits = Some(vec![0.0; 3]), &|e| {
        matches!(
            e,
            AttnError::Length {
                what: "sink_logits",
                ..
            }
        )
    });
}

#[test]
fn buffers_of_the_wrong_size_are_rejected() {
    let meta = BatchMeta {
        cu_seqlens_q: &[0, 1],
        seq_lens_kv: &[3],
        block_table: &[0],
        max_blocks: 1,
    };
    let params = AttnParams::new(2, 4);
    let mut out = vec![0.0f32; 8];
    let err = paged_attention(
        &[0.1f32; 7],
        &kv(),
        &meta,
        &params,
        AttnOut {
            out: &mut out,
            lse: None,
        },
    );
    assert_eq!(
        err,
        Err(AttnError::Length {
            what: "q",
            expected: 8,
            got: 7
        })
    );
    let mut lse = vec![0.0f32; 3];
    let err = paged_attention(
        &[0.1f32; 8],
        &kv(),
        &meta,
        &params,
        AttnOut {
            out: &mut out,
            lse: Some(&mut lse),
        },
    );
    assert_eq!(
        err,
        Err(AttnError::Length {
            what: "lse",
            expected: 2,
            got: 3
        })
    );
    assert_eq!(
        PagedKv::from_tensors(LAYOUT, vec![0.0f32; 3], vec![0.0; LAYOUT.len()]),
        Err(AttnError::Length {
            what: "k",
            expected: LAYOUT.len(),
            got: 3
        })
    );
    assert!(matches!(
        PagedKv::<f32>::new(KvLayout {
            block_size: 0,
            ..LAYOUT
        }),
        Err(AttnError::Invalid(_))
    ));
}

#[test]
fn selections_out_of_range_or_malformed_are_rejected() {
    let meta = BatchMeta {
        cu_seqlens_q: &[0, 1],
        seq_lens_kv: &[6],
        block_table: &[0, 1],
        max_blocks: 2,
    };
    let params = AttnParams::new(2, 4);
    let run = |ids: &[i32], lens: &[i32], max_len: usize| {
        let mut out = vec![0.0f32; 8];
        sparse_page_attention(
            &[0.1f32; 8],
            &kv(),
            &meta,
            &Selection { ids, lens, max_len },
            &params,
            AttnOut {
                out: &mut out,
                lse: None,
            },
        )
    };
    assert!(matches!(
        run(&[0, 2, 0, 1], &[2, 2], 2),
        Err(AttnError::IndexOutOfRange {
            what: "page",
            index: 2,
            limit: 2
        })
    ));
    assert!(
        matches!(run(&[1, 0, 0, 1], &[2, 2], 2), Err(AttnError::Invalid(_))),
        "unsorted pages"
    );
    assert!(
        matches!(run(&[0, 1, 0, 1], &[3, 2], 2), Err(AttnError::Metadata(_))),
        "length past the row"
    );
    assert!(matches!(
        run(&[0, 1, 0], &[1, 1], 2),
        Err(AttnError::Length { .. })
    ));
    let sel = Selection {
        ids: &[0, 1],
        lens: &[1, 1],
        max_len: 1,
    };
    assert!(
        matches!(
            gather_page_offsets(&sel, 3, &[6], 4, 2),
            Err(AttnError::Invalid(_))
        ),
        "3 does not tile 4"
    );
    assert!(matches!(
        gather_page_offsets(&sel, 4, &[-1], 4, 2),
        Err(AttnError::Metadata(_))
    ));
}

#[test]
fn compaction_rejects_unsorted_or_uneven_keep_lists_without_touching_the_cache() {
    let mut cache = kv();
    let before = cache.clone();
    let try_keep = |cache: &mut PagedKv<f32>, ids: &[i32], lens: &[i32]| {
        compact_kv(
            cache,
            &[6],
            &[0, 1],
            2,
            &Selection {
                ids,
                lens,
                max_len: 3,
            },
        )
    };
    assert!(matches!(
        try_keep(&mut cache, &[2, 1, 0, 0, 1, 2], &[3, 3]),
        Err(AttnError::Invalid(_))
    ));
    assert!(matches!(
        try_keep(&mut cache, &[0, 1, -1, 0, 1, 2], &[2, 3]),
        Err(AttnError::Invalid(_))
    ));
    assert!(matches!(
        try_keep(&mut cache, &[0, 1, 6, 0, 1, 2], &[3, 3]),
        Err(AttnError::IndexOutOfRange { .. })
    ));
    assert_eq!(cache, before);
    assert_eq!(
        try_keep(&mut cache, &[1, 4, 5, 0, 2, 5], &[3, 3]),
        Ok(vec![3])
    );
}

#[test]
fn a_new_cache_holds_positive_zeros_in_every_type() {
    fn check<T: attn_op::Element>() {
        let cache = PagedKv::<T>::new(LAYOUT).expect("valid");
        for t in [cache.k(), cache.v()] {
            assert_eq!(t.len(), LAYOUT.len());
            assert!(
                t.iter().all(|x| x.to_f32().to_bits() == 0),
                "{:?}: every element +0.0",
                T::DTYPE
            );
        }
    }
    check::<f32>();
    check::<half::f16>();
    check::<half::bf16>();
}

#[test]
fn caches_too_large_to_address_or_allocate_are_refused() {
    let check = |num_blocks: usize, want: &dyn Fn(&AttnError) -> bool| {
        let layout = KvLayout {
            num_blocks,
            block_size: 16,
            kv_heads: 8,
            head_dim: 128,
        };
        match PagedKv::<f32>::new(layout) {
            Err(e) => assert!(want(&e), "{num_blocks} blocks: {e}"),
            Ok(_) => panic!("{num_blocks} blocks: a cache was made"),
        }
    };
    // 2^56 bytes a tensor: within `isize`, but past any machine (and x86-64's 2^47-byte user
    // address space), so the allocator refuses it.
    check(
        1 << 40,
        &|e| matches!(e, AttnError::OutOfMemory { bytes } if *bytes == 1 << 56),
    );
    // Elements that overflow `usize`, and bytes that overflow `isize`.
    check(
        1 << 60,
        &|e| matches!(e, AttnError::Invalid(m) if m.contains("too large")),
    );
    check(
        1 << 50,
        &|e| matches!(e, AttnError::Invalid(m) if m.contains("too large")),
    );
}

#[test]
fn tensors_start_on_a_cache_line_and_keep_their_elements() {
    // Vectors of several sizes (small ones from the heap, large ones mapped), whatever their
    // own alignment: the cache, a clone and a new cache all start on 64-byte boundaries.
    fn check<T: attn_op::Element>(blocks: usize) {
        let layout = KvLayout {
            num_blocks: blocks,
            ..LAYOUT
        };
        let mut rng = Rng::new(0x9e37_79b9 ^ blocks as u64);
        let mut tensor =
            || -> Vec<T> { (0..layout.len()).map(|_| T::from_f32(rng.unit())).collect() };
        let (k, v) = (tensor(), tensor());
        let cache = PagedKv::from_tensors(layout, k.clone(), v.clone()).expect("consistent");
        let copy = cache.clone();
        let fresh = PagedKv::<T>::new(layout).expect("valid");
        assert_eq!(
            (cache.k(), cache.v()),
            (&k[..], &v[..]),
            "elements kept in order"
        );
        assert_eq!(copy, cache);
        for t in [
            cache.k(),
            cache.v(),
            copy.k(),
            copy.v(),
            fresh.k(),
            fresh.v(),
        ] {
            assert_eq!(
                t.as_ptr() as usize % 64,
                0,
                "{:?}, {blocks} blocks",
                T::DTYPE
            );
        }
    }
    for blocks in [1, 3, 4, 3000] {
        check::<f32>(blocks);
        check::<half::f16>(blocks);
        check::<half::bf16>(blocks);
    }
}

#[test]
fn set_kv_writes_through_the_flat_slot_view_and_checks_slots() {
    let mut cache = PagedKv::<f32>::new(LAYOUT).expect("valid");
    let stride = LAYOUT.token_stride();
    let k: Vec<f32> = (0..2 * stride).map(|i| i as f32 + 1.0).collect();
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    cache
        .set_kv(&[13, -1], &k, &v)
        .expect("slot 13 exists, -1 skips");
    assert_eq!(&cache.k()[13 * stride..14 * stride], &k[..stride]);
    assert_eq!(&cache.v()[13 * stride..14 * stride], &v[..stride]);
    assert_eq!(
        cache.k().iter().filter(|&&x| x != 0.0).count(),
        stride,
        "the -1 token was skipped"
    );
    assert!(matches!(
        cache.set_kv(&[16], &k[..stride], &v[..stride]),
        Err(AttnError::IndexOutOfRange { what: "slot", .. })
    ));
    assert!(matches!(
        cache.set_kv(&[0], &k, &v),
        Err(AttnError::Length { .. })
    ));
}

#[test]
fn merge_rejects_mismatched_parts_and_handles_empty_ones() {
    let mut out = vec![0.0f32; 4];
    let mut lse = vec![0.0f32; 1];
    let a = [1.0f32, 2.0, 3.0, 4.0];
    let err = merge_attention(
        &[attn_op::AttnPart {
            out: &a[..3],
            lse: &[0.0],
        }],
        4,
        &mut out,
        &mut lse,
    );
    assert!(matches!(err, Err(AttnError::Length { .. })));
    let empty = [f32::NEG_INFINITY];
    merge_attention(
        &[
            attn_op::AttnPart {
                out: &[0.0; 4],
                lse: &empty,
            },
            attn_op::AttnPart {
                out: &a,
                lse: &[0.5],
            },
        ],
        4,
        &mut out,
        &mut lse,
    )
    .expect("same shapes");
    assert_eq!(out, a.to_vec());
    assert_eq!(lse, vec![0.5]);
    merge_attention(
        &[attn_op::AttnPart {
            out: &a,
            lse: &empty,
        }],
        4,
        &mut out,
        &mut lse,
    )
    .expect("same shapes");
    assert_eq!((out, lse), (vec![0.0; 4], vec![f32::NEG_INFINITY]));
}

#[test]
fn scores_that_overflow_to_minus_infinity_give_empty_rows_in_every_build() {
    // Every key is visible, but each query's dot products overflow to -inf, so no key weighs
    // anything: the rows come out empty (zeros, log-sum-exp -inf), as for a row that sees no
    // key, and no build panics on a chunk without a live token.
    fn check<T: attn_op::Element>() {
        let layout = KvLayout {
            num_blocks: 2,
            block_size: 16,
            kv_heads: 2,
            head_dim: 32,
        };
        let n = layout.len();
        let k = (0..n)
            .map(|i| T::from_f32(3e38 - (i % 3) as f32 * 1e37))
            .collect();
        let v = (0..n).map(|i| T::from_f32((i % 5) as f32 - 2.0)).collect();
        let kv = PagedKv::from_tensors(layout, k, v).expect("consistent");
        let meta = BatchMeta {
            cu_seqlens_q: &[0, 1],
            seq_lens_kv: &[20],
            block_table: &[1, 0],
            max_blocks: 2,
        };
        let q: Vec<T> = (0..8 * 32)
            .map(|i| T::from_f32(-3e38 + (i % 7) as f32 * 1e37))
            .collect();
        for simd in [Simd::Portable, Simd::Avx2, Simd::Avx512, Simd::Avx512Bf16] {
            let mut params = AttnParams::new(8, 32);
            params.simd = simd;
            let (mut out, mut lse) = (vec![7.0f32; 8 * 32], vec![7.0f32; 8]);
            paged_attention(
                &q,
                &kv,
                &meta,
                &params,
                AttnOut {
                    out: &mut out,
                    lse: Some(&mut lse),
                },
            )
            .expect("valid call");
            let what = format!("{:?} {simd:?}", T::DTYPE);
            assert!(out.iter().all(|&x| x == 0.0), "{what}: zeros");
            assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY), "{what}: lse");
        }
    }
    check::<f32>();
    check::<half::bf16>();
}
