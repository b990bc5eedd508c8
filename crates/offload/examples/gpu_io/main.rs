//! The GPU half of offload's checks and benchmarks, for the device bundle (`cargo xtask gpu`).
//!
//! - `gpu_io check`: the device diff against [`HotBuffer::diff`] over several steps (slots,
//!   misses, counts, LRU order and slot pages), the zero-copy loads of its misses against the
//!   host pages, and row copies both ways; exits 1 on any mismatch.
//! - `gpu_io bench [--json FILE]`: contiguous pinned host-to-device bandwidth, 2048 scattered
//!   pages through the zero-copy kernel and through one `cuMemcpyHtoDAsync` each, scattered
//!   656-byte rows, and the diff at B64, top-k 2048, HOT 4096.
//!
//! Without a CUDA driver or device it prints "skipped: no CUDA device" and exits 0.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

use attn_op::cuda::{DevicePagedKv, DeviceSelection, Gpu, Timing};
use attn_op::{AttnError, KvLayout, Selection};
use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use offload::cuda::{DeviceDiff, DeviceHotBuffers, IoKernels, PinnedHostPool};
use offload::{HostLayout, HostPool, HostShape, HostStore, HotBuffer, OffloadError};

#[path = "../../../attn-op/examples/gpu/report.rs"]
mod report;
#[path = "../../../attn-op/examples/gpu/rng.rs"]
mod rng;

use report::{Row, table};
use rng::Rng;

fn main() {
    report::tool_main("gpu_io", &[], run);
}

fn run(cmd: &str, args: &[String]) -> Result<i32, OffloadError> {
    let gpu = Gpu::new(0)?;
    println!("device: {}", gpu.name()?);
    let io = IoKernels::new(&gpu)?;
    match cmd {
        "check" => check(&gpu, &io),
        "bench" => {
            bench(&gpu, &io, report::json_arg(args))?;
            Ok(0)
        }
        other => {
            eprintln!("unknown command {other}; use check or bench");
            Ok(2)
        }
    }
}

/// Per-row selections of the next step: a random ascending subset of each row's pages, the
/// current (last) page always, most pages kept from the previous step so that hits occur.
fn next_selections(
    rng: &mut Rng,
    prev: &[Vec<i32>],
    pages: usize,
    k: usize,
    churn: usize,
) -> Vec<Vec<i32>> {
    prev.iter()
        .map(|p| {
            let mut s: Vec<i32> = p
                .iter()
                .copied()
                .filter(|_| rng.range(0, 100) >= churn)
                .collect();
            s.retain(|&x| x != pages as i32 - 1);
            for x in rng.subset(k, pages - 1) {
                if s.len() + 1 >= k {
                    break;
                }
                if s.binary_search(&x).is_err() {
                    s.push(x);
                    s.sort_unstable();
                }
            }
            s.push(pages as i32 - 1);
            s
        })
        .collect()
}

/// Flattened, -1 padded rows for upload.
fn pad(rows: &[Vec<i32>], width: usize) -> (Vec<i32>, Vec<i32>) {
    let mut ids = vec![-1; rows.len() * width];
    for (r, row) in rows.iter().enumerate() {
        ids[r * width..r * width + row.len()].copy_from_slice(row);
    }
    (ids, rows.iter().map(|r| r.len() as i32).collect())
}

/// Rows of selections, padded to `width` and uploaded.
fn upload_selections(
    gpu: &Gpu,
    sels: &[Vec<i32>],
    width: usize,
) -> Result<DeviceSelection, OffloadError> {
    let (ids, lens) = pad(sels, width);
    let sel = Selection {
        ids: &ids,
        lens: &lens,
        max_len: width,
    };
    Ok(DeviceSelection::upload(gpu, &sel, sels.len())?)
}

/// Prints one check's line; 1 if it failed.
fn report(what: &str, ok: bool) -> usize {
    println!("{} {what}", if ok { "ok  " } else { "FAIL" });
    usize::from(!ok)
}

fn check(gpu: &Gpu, io: &IoKernels) -> Result<i32, OffloadError> {
    let mut failed = 0;
    // (rows, hot, pages per row, top-k, steps)
    for (rows, hot, pages, k, steps) in [(16, 64, 300, 48, 6), (64, 4096, 8192, 2048, 3)] {
        let mut rng = Rng::new(hot as u64);
        let mut cpu: Vec<HotBuffer> = (0..rows).map(|_| HotBuffer::new(hot)).collect();
        let mut dev = DeviceHotBuffers::upload(gpu, &cpu)?;
        let current = gpu.upload(&vec![pages as i32 - 1; rows])?;
        // Slots map to distinct, shuffled device blocks (7 is prime to nb).
        let nb = rows * (hot + 1) + 1;
        let blocks: Vec<i32> = (0..nb - 1).map(|i| (i * 7 % nb) as i32).collect();
        let dblocks = gpu.upload(&blocks)?;
        let mut sels: Vec<Vec<i32>> = vec![Vec::new(); rows];
        let mut d = DeviceDiff::new(gpu, rows, k)?;
        // Running totals on the device (`tally`), against the CPU's summed counts.
        let mut totals = gpu.zeros::<u64>(3)?;
        let mut want_totals = [0u64; 3];
        for step in 0..steps {
            sels = next_selections(&mut rng, &sels, pages, k, 30);
            let dsel = upload_selections(gpu, &sels, k)?;
            io.diff(&mut dev, &dsel, &current, &dblocks, &mut d)?;
            io.tally(&d, &mut totals, 0)?;
            let (slots, table) = (gpu.download(&d.slots)?, gpu.download(&d.table)?);
            let (mp, ms) = (gpu.download(&d.miss_pages)?, gpu.download(&d.miss_slots)?);
            let (mc, hc) = (gpu.download(&d.miss_counts)?, gpu.download(&d.hit_counts)?);
            let errors = gpu.download(&d.errors)?;
            let (lru, sp) = dev.download(gpu)?;
            let mut same = errors.iter().all(|&e| e == 0);
            let (mut misses, mut hits) = (0, 0);
            for r in 0..rows {
                let want = cpu[r].diff(&sels[r], pages as i32 - 1);
                misses += want.misses.len();
                hits += want.hits as usize;
                let n = sels[r].len();
                let row = |v: &[i32], n: usize| v[r * k..r * k + n].to_vec();
                let want_slots: Vec<i32> = want.slots.iter().map(|&s| s as i32).collect();
                let want_table: Vec<i32> = want
                    .slots
                    .iter()
                    .map(|&s| blocks[r * (hot + 1) + s as usize])
                    .collect();
                let want_mp: Vec<i32> = want.misses.iter().map(|m| m.0 as i32).collect();
                let want_ms: Vec<i32> = want.misses.iter().map(|m| m.1 as i32).collect();
                same &= row(&slots, n) == want_slots
                    && row(&table, n) == want_table
                    && mc[r] as usize == want.misses.len()
                    && hc[r] == want.hits as i32
                    && row(&mp, want.misses.len()) == want_mp
                    && row(&ms, want.misses.len()) == want_ms
                    && lru[r * hot..(r + 1) * hot] == *cpu[r].lru()
                    && sp[r * hot..(r + 1) * hot] == *cpu[r].slot_pages();
            }
            want_totals[0] += hits as u64;
            want_totals[1] += misses as u64;
            failed += report(
                &format!(
                    "diff {rows} rows HOT {hot} top-{k} step {step}: {misses} misses, {hits} hits \
                     (slots, table, misses, counts, LRU, slot pages equal the CPU)"
                ),
                same,
            );
            // The loads of the last step's misses (the small case: its host pool is small).
            if step + 1 == steps && hot == 64 {
                failed += usize::from(!check_loads(gpu, io, &d, (rows, hot, pages, nb), &blocks)?);
            }
        }
        let got = gpu.download(&totals)?;
        failed += report(
            &format!(
                "tally {rows} rows over {steps} diffs: hits {} / {}, misses {} / {}, rows that did \
                 not fit {} / 0",
                got[0], want_totals[0], got[1], want_totals[1], got[2]
            ),
            got == want_totals,
        );
    }
    failed += usize::from(!check_rows(gpu, io)?);
    println!("check: {failed} failed");
    Ok(i32::from(failed > 0))
}

/// Loads the last diff's misses (layer 1 of 2) and compares every loaded block with its host
/// page; every other block must keep its poison.
fn check_loads(
    gpu: &Gpu,
    io: &IoKernels,
    d: &DeviceDiff,
    (rows, hot, pages, num_blocks): (usize, usize, usize, usize),
    blocks: &[i32],
) -> Result<bool, OffloadError> {
    let (ps, heads, dim) = (16, 2, 64);
    let shape = HostShape {
        layers: 2,
        pages: rows * pages,
        page_size: ps,
        kv_heads: heads,
        head_dim: dim,
    };
    let mut host = HostPool::<bf16>::new(shape, HostLayout::LayerFirst)
        .ok_or_else(|| OffloadError::Invalid("host pool size".to_owned()))?;
    let mut rng = Rng::new(5);
    let tok = heads * dim;
    for l in 0..2 {
        for p in 0..shape.pages {
            for t in 0..ps {
                let mut val = || bf16::from_f32(rng.range(0, 1 << 16) as f32 / 65536.0 - 0.5);
                let k: Vec<bf16> = (0..tok).map(|_| val()).collect();
                let v: Vec<bf16> = (0..tok).map(|_| val()).collect();
                host.write_token(l, p, t, &k, &v);
            }
        }
    }
    let pinned = PinnedHostPool::from_host(gpu, &host)?;
    // Row r's logical page p lives in host page r * pages + (p * 31 + r) % pages.
    let host_table: Vec<i32> = (0..rows * pages)
        .map(|i| {
            let (r, p) = (i / pages, i % pages);
            (r * pages + (p * 31 + r) % pages) as i32
        })
        .collect();
    let layout = KvLayout {
        num_blocks,
        block_size: ps,
        kv_heads: heads,
        head_dim: dim,
    };
    let poison = vec![bf16::NAN; layout.len()];
    let mut dev = DevicePagedKv::from_host(gpu, layout, &poison, &poison)?;
    let (dt, db) = (gpu.upload(&host_table)?, gpu.upload(blocks)?);
    io.load_misses(&pinned, 1, &dt, pages, &db, hot, d, &mut dev)?;
    let (k, v) = (gpu.download(dev.k())?, gpu.download(dev.v())?);
    let (mc, mp, ms) = (
        gpu.download(&d.miss_counts)?,
        gpu.download(&d.miss_pages)?,
        gpu.download(&d.miss_slots)?,
    );
    let page = ps * tok;
    let (hk, hv) = host.tensors();
    let mut loaded = vec![false; num_blocks];
    let mut ok = true;
    let mut n = 0;
    for r in 0..rows {
        for m in 0..mc[r] as usize {
            let (p, s) = (
                mp[r * d.sel_max + m] as usize,
                ms[r * d.sel_max + m] as usize,
            );
            let hp = host_table[r * pages + p] as usize;
            let b = blocks[r * (hot + 1) + s] as usize;
            let src = (shape.pages + hp) * page;
            ok &= k[b * page..(b + 1) * page] == hk[src..src + page]
                && v[b * page..(b + 1) * page] == hv[src..src + page];
            loaded[b] = true;
            n += 1;
        }
    }
    let untouched = (0..num_blocks)
        .filter(|&b| !loaded[b])
        .all(|b| k[b * page..(b + 1) * page].iter().all(|x| x.is_nan()));
    println!(
        "{} load_misses: {n} pages equal their host pages bit for bit, other blocks untouched",
        if ok && untouched { "ok  " } else { "FAIL" }
    );
    Ok(ok && untouched)
}

/// Rows of 656 bytes host -> device and device -> host by random indices, bit for bit.
fn check_rows(gpu: &Gpu, io: &IoKernels) -> Result<bool, OffloadError> {
    let (rows, n, width) = (4096, 1000, 656 / 2);
    let mut rng = Rng::new(11);
    let data: Vec<bf16> = (0..rows * width)
        .map(|_| bf16::from_f32(rng.range(0, 1000) as f32))
        .collect();
    let shape = HostShape {
        layers: 1,
        pages: rows,
        page_size: 1,
        kv_heads: 1,
        head_dim: width,
    };
    let mut host = HostPool::<bf16>::new(shape, HostLayout::LayerFirst)
        .ok_or_else(|| OffloadError::Invalid("host pool size".to_owned()))?;
    for r in 0..rows {
        let row = &data[r * width..(r + 1) * width];
        host.write_token(0, r, 0, row, row);
    }
    let pinned = PinnedHostPool::from_host(gpu, &host)?;
    let src_idx: Vec<i32> = (0..n).map(|_| rng.range(0, rows) as i32).collect();
    let dst_idx: Vec<i32> = rng.subset(n, n).into_iter().rev().collect();
    let dev: CudaSlice<bf16> = gpu.upload(&vec![bf16::NAN; n * width])?;
    let (ds, dd) = (gpu.upload(&src_idx)?, gpu.upload(&dst_idx)?);
    let (hk, _) = pinned.tensors()?;
    let hptr = hk.as_ptr() as u64;
    let dptr = raw(gpu, &dev);
    // SAFETY: the source is the pinned pool (`rows` rows of 656 bytes) and the destination the
    // device buffer of `n` rows; both outlive the copy, which is waited for below.
    unsafe { io.copy_rows(hptr, rows, dptr, n, &ds, &dd, 656)? };
    let got = gpu.download(&dev)?;
    let mut ok = (0..n).all(|i| {
        let (s, d) = (src_idx[i] as usize, dst_idx[i] as usize);
        got[d * width..(d + 1) * width] == data[s * width..(s + 1) * width]
    });
    // And back: device row i to host row dst_idx[i] of a fresh pinned buffer.
    let empty = HostPool::<bf16>::new(shape, HostLayout::LayerFirst)
        .ok_or_else(|| OffloadError::Invalid("host pool size".to_owned()))?;
    let back = PinnedHostPool::from_host(gpu, &empty)?;
    let (bk, _) = back.tensors()?;
    let bptr = bk.as_ptr() as u64;
    let idx: Vec<i32> = (0..n as i32).collect();
    let di = gpu.upload(&idx)?;
    // SAFETY: the source is the device buffer (`n` rows), the destination the pinned buffer of
    // `rows` rows; the stream is synchronized before the host reads it.
    unsafe { io.copy_rows(dptr, n, bptr, rows, &di, &dd, 656)? };
    gpu.synchronize()?;
    let (bk, _) = back.tensors()?;
    ok &= (0..n).all(|i| {
        let d = dst_idx[i] as usize;
        bk[d * width..(d + 1) * width] == got[i * width..(i + 1) * width]
    });
    println!(
        "{} copy_rows: {n} rows of 656 bytes host -> device and device -> host, bit for bit",
        if ok { "ok  " } else { "FAIL" }
    );
    Ok(ok)
}

/// The raw device address of a buffer.
fn raw<T>(gpu: &Gpu, s: &CudaSlice<T>) -> u64 {
    let (p, _sync) = s.device_ptr(gpu.stream());
    p
}

/// Median milliseconds of 30 runs, each alone between CUDA events ([`Gpu::time`]'s synced).
fn time(gpu: &Gpu, f: impl FnMut() -> Result<(), OffloadError>) -> Result<Timing, OffloadError> {
    gpu.time(30, f)
}

fn bench(gpu: &Gpu, io: &IoKernels, json: Option<&str>) -> Result<(), OffloadError> {
    let mut rows: Vec<Row> = Vec::new();
    // Host pool: 8192 pages of 16 tokens x 8 heads x 128 (bf16): 32 KiB per page, K and V.
    let (ps, heads, dim, pages) = (16, 8, 128, 8192);
    let shape = HostShape {
        layers: 1,
        pages,
        page_size: ps,
        kv_heads: heads,
        head_dim: dim,
    };
    let mut host = HostPool::<bf16>::new(shape, HostLayout::LayerFirst)
        .ok_or_else(|| OffloadError::Invalid("host pool size".to_owned()))?;
    let mut rng = Rng::new(3);
    let tok = heads * dim;
    let kv: Vec<bf16> = (0..tok)
        .map(|i| bf16::from_f32(i as f32 / 1024.0))
        .collect();
    for p in (0..pages).step_by(97) {
        host.write_token(0, p, 0, &kv, &kv);
    }
    let pinned = PinnedHostPool::from_host(gpu, &host)?;
    drop(host);
    let page_bytes = ps * tok * 2;

    // Contiguous pinned -> device: 256 MiB of the pool.
    let (hk, _) = pinned.tensors()?;
    let n = (256 << 20) / 2;
    let dst: CudaSlice<bf16> = gpu.zeros(n)?;
    let contiguous = {
        let src = &hk[..n];
        let stream = gpu.stream().clone();
        time(gpu, || {
            // SAFETY: `src` is pinned host memory that outlives the copy (waited for by the
            // timing), `dst` holds n elements.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(raw(gpu, &dst), src, stream.cu_stream())
            }
            .map_err(|e| OffloadError::Attn(AttnError::from(e)))
        })?
    };
    let cbw = (n * 2) as f64 / contiguous.synced / 1e6;
    rows.push(Row {
        name: "pinned H2D contiguous 256 MiB".into(),
        t: contiguous,
        bytes: (n * 2) as f64,
        note: "ceiling".into(),
    });

    // 2048 scattered pages (K and V) through the zero-copy kernel: one row of 2048 misses.
    let miss = 2048;
    let picks = rng.subset(miss, pages);
    let layout = KvLayout {
        num_blocks: miss,
        block_size: ps,
        kv_heads: heads,
        head_dim: dim,
    };
    let zeros = vec![bf16::ZERO; layout.len()];
    let mut dev = DevicePagedKv::from_host(gpu, layout, &zeros, &zeros)?;
    let slots: Vec<i32> = (0..miss as i32).collect();
    let diff = DeviceDiff {
        sel_max: miss,
        slots: gpu.upload(&slots)?,
        table: gpu.upload(&slots)?,
        miss_pages: gpu.upload(&picks)?,
        miss_slots: gpu.upload(&slots)?,
        miss_counts: gpu.upload(&[miss as i32])?,
        hit_counts: gpu.upload(&[0])?,
        errors: gpu.upload(&[0])?,
    };
    let identity: Vec<i32> = (0..pages as i32).collect();
    let mut blocks = slots;
    blocks.push(0);
    let (dt, db) = (gpu.upload(&identity)?, gpu.upload(&blocks)?);
    let t = time(gpu, || {
        io.load_misses(&pinned, 0, &dt, pages, &db, miss, &diff, &mut dev)
    })?;
    let bytes = (miss * page_bytes * 2) as f64;
    rows.push(Row {
        name: "zero-copy 2048 pages (K+V)".into(),
        t,
        bytes,
        note: format!("{:.2} of contiguous", bytes / t.synced / 1e6 / cbw),
    });
    // Peer: one cuMemcpyHtoDAsync per page (K and V).
    let (hk, hv) = pinned.tensors()?;
    let stream = gpu.stream().clone();
    let (dk, dv) = (raw(gpu, dev.k()), raw(gpu, dev.v()));
    let t = time(gpu, || {
        for (i, &p) in picks.iter().enumerate() {
            let e = page_bytes / 2;
            let (s, o) = (p as usize * e, (i * page_bytes) as u64);
            // SAFETY: pinned sources of one page each; destinations inside the device pool of
            // `miss` blocks; the timing waits for the copies.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dk + o, &hk[s..s + e], stream.cu_stream())
                    .and_then(|()| {
                        cudarc::driver::result::memcpy_htod_async(
                            dv + o,
                            &hv[s..s + e],
                            stream.cu_stream(),
                        )
                    })
            }
            .map_err(|e| OffloadError::Attn(AttnError::from(e)))?;
        }
        Ok(())
    })?;
    rows.push(Row {
        name: "cudaMemcpyAsync per page".into(),
        t,
        bytes,
        note: format!("{:.2} of contiguous (peer)", bytes / t.synced / 1e6 / cbw),
    });

    // 656-byte rows: 65536 scattered rows of a 262144-row pinned pool.
    let (nrows, pool_rows, width) = (65536, 262_144, 656 / 2);
    let rshape = HostShape {
        layers: 1,
        pages: pool_rows,
        page_size: 1,
        kv_heads: 1,
        head_dim: width,
    };
    let rpool = PinnedHostPool::from_host(
        gpu,
        &HostPool::<bf16>::new(rshape, HostLayout::LayerFirst)
            .ok_or_else(|| OffloadError::Invalid("host pool size".to_owned()))?,
    )?;
    let src_idx: Vec<i32> = (0..nrows).map(|_| rng.range(0, pool_rows) as i32).collect();
    let dst_idx: Vec<i32> = (0..nrows as i32).collect();
    let (ds, dd) = (gpu.upload(&src_idx)?, gpu.upload(&dst_idx)?);
    let rdst: CudaSlice<bf16> = gpu.zeros(nrows * width)?;
    let (rk, _) = rpool.tensors()?;
    let (sp, dp) = (rk.as_ptr() as u64, raw(gpu, &rdst));
    // SAFETY: pinned pool of pool_rows rows and a device buffer of nrows rows of 656 bytes,
    // both alive until the timing has waited for every copy.
    let t = time(gpu, || unsafe {
        io.copy_rows(sp, pool_rows, dp, nrows, &ds, &dd, 656)
    })?;
    let bytes = (nrows * 656) as f64;
    rows.push(Row {
        name: "zero-copy 65536 rows of 656 B".into(),
        t,
        bytes,
        note: format!("{:.2} of contiguous", bytes / t.synced / 1e6 / cbw),
    });

    // The diff at B64, top-k 2048, HOT 4096, in steady state (30 % of each selection changes
    // per step), rotating 8 precomputed steps.
    let (b, hot, k, lpages) = (64, 4096, 2048, 32 * 1024 / 16);
    let bufs: Vec<HotBuffer> = (0..b).map(|_| HotBuffer::new(hot)).collect();
    let mut dh = DeviceHotBuffers::upload(gpu, &bufs)?;
    let current = gpu.upload(&vec![lpages as i32 - 1; b])?;
    let dblocks = gpu.upload(&(0..b * (hot + 1)).map(|i| i as i32).collect::<Vec<_>>())?;
    let mut sels: Vec<Vec<i32>> = vec![Vec::new(); b];
    let mut steps = Vec::new();
    for _ in 0..8 {
        sels = next_selections(&mut rng, &sels, lpages, k, 30);
        steps.push(upload_selections(gpu, &sels, k)?);
    }
    let mut out = DeviceDiff::new(gpu, b, k)?;
    for s in &steps {
        io.diff(&mut dh, s, &current, &dblocks, &mut out)?;
    }
    let mut i = 0;
    let t = time(gpu, || {
        i += 1;
        io.diff(
            &mut dh,
            &steps[i % steps.len()],
            &current,
            &dblocks,
            &mut out,
        )
    })?;
    rows.push(Row {
        name: "diff B64 top-2048 HOT 4096".into(),
        t,
        bytes: 0.0,
        note: "per layer (goal <= 0.015 ms)".into(),
    });

    print!("{}", table(&rows));
    if let Some(path) = json {
        let body = report::json(&gpu.name()?, &rows);
        std::fs::write(path, body).map_err(|e| OffloadError::Invalid(format!("{path}: {e}")))?;
    }
    Ok(())
}
