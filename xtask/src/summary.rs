//! The bench summary: every criterion result under `target/criterion`, plus the figures the
//! issues ask for (decode as a fraction of read bandwidth, sparse/dense speedup, reuse on/off
//! ratio), as a Markdown table.
//!
//! Criterion's JSON is read with plain string search to keep xtask free of dependencies; the
//! fields used (`full_id`, `throughput`, `mean.point_estimate`) are flat and stable.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// One benchmark's mean time and declared throughput.
struct Bench {
    mean_ns: f64,
    bytes: Option<f64>,
    elements: Option<f64>,
}

/// Renders the summary of every result found under `root`, with the peers' results from
/// `peers` (JSON lines of `id`, `mean_ns`, `bytes`) when that file exists.
pub(crate) fn render(root: &Path, peers: &Path) -> Result<String, String> {
    let mut benches = BTreeMap::new();
    collect(root, &mut benches)?;
    if let Ok(lines) = std::fs::read_to_string(peers) {
        for line in lines.lines() {
            if let (Some(id), Some(mean_ns)) =
                (string_field(line, "id"), number_after(line, "\"mean_ns\":"))
            {
                let bytes = number_after(line, "\"bytes\":");
                benches.insert(
                    id,
                    Bench {
                        mean_ns,
                        bytes,
                        elements: None,
                    },
                );
            }
        }
    }
    let mut md =
        String::from("## Benchmarks\n\n| bench | mean | throughput |\n| --- | ---: | ---: |\n");
    for (id, b) in &benches {
        let thrpt = match (b.bytes, b.elements) {
            (Some(bytes), _) => {
                format!("{:.2} GiB/s", bytes / b.mean_ns * 1e9 / (1u64 << 30) as f64)
            }
            (_, Some(n)) => format!("{:.2} Melem/s", n / b.mean_ns * 1e3),
            _ => String::new(),
        };
        let _ = writeln!(md, "| {id} | {} | {thrpt} |", fmt_time(b.mean_ns));
    }
    let mut derived = String::new();
    let gibs = |b: &Bench| b.bytes.map(|x| x / b.mean_ns * 1e9 / (1u64 << 30) as f64);
    // The better of the reads before and after the decode benches: the box's bandwidth drifts.
    let stream = ["stream_read/sum_1GiB", "stream_read/sum_1GiB_after"]
        .iter()
        .filter_map(|id| benches.get(*id).and_then(gibs))
        .reduce(f64::max);
    if let Some(stream) = stream {
        // The decode rows against the goal; the decode over KV the caches hold, where a figure
        // well below the goal says the CPU's arithmetic bounds the decode, whatever its memory
        // does; and a plain parallel read of each decode's own bytes, call by call, where a
        // figure well below the goal says the read alone of that size misses it here.
        let read =
            format!("fraction of read bandwidth ({stream:.1} GiB/s, the better of two reads)");
        let kinds = [
            ("decode/", read.as_str(), " (goal 0.80)"),
            (
                "decode_cached/",
                "rate from cache over the read bandwidth (well under 0.80 where the arithmetic bounds the decode)",
                "",
            ),
            (
                "pool_read/",
                "its bytes read alone, call by call, over the read bandwidth (the read a decode of that size meets)",
                "",
            ),
        ];
        for (prefix, what, goal) in kinds {
            for (id, b) in benches.iter().filter(|(id, _)| id.starts_with(prefix)) {
                if let Some(g) = gibs(b) {
                    let _ = writeln!(derived, "| {id}: {what} | {:.2}{goal} |", g / stream);
                }
            }
        }
    }
    // Both sparse groups: per-head selections, and one selection a sequence's heads share.
    for (id, sparse) in benches.iter().filter(|(id, _)| {
        id.starts_with("sparse_decode/") || id.starts_with("sparse_decode_shared/")
    }) {
        let (_, shape) = id.split_once('/').unwrap_or_default();
        if let Some(dense) = benches.get(&format!("decode/{shape}")) {
            let _ = writeln!(
                derived,
                "| {id}: speedup over dense | {:.1}x |",
                dense.mean_ns / sparse.mean_ns
            );
        }
    }
    for (id, sel) in benches.iter().filter(|(id, _)| id.starts_with("topk/")) {
        let ctx = id.rsplit('/').next().unwrap_or("");
        if let Some(dense) = benches.get(&format!("topk_dense/bf16/{ctx}")) {
            let _ = writeln!(
                derived,
                "| {id}: time / dense attention time | {:.3} (goal < 0.15) |",
                sel.mean_ns / dense.mean_ns
            );
        }
    }
    for (id, peer) in benches.iter().filter(|(id, _)| id.starts_with("torch_")) {
        let ours_id = format!("decode/{}", id.split_once('/').map_or("", |(_, rest)| rest));
        if let Some(ours) = benches.get(&ours_id) {
            let _ = writeln!(
                derived,
                "| {ours_id} vs {id}: speed ratio (peer time / ours) | {:.2} (goal 1.00) |",
                peer.mean_ns / ours.mean_ns
            );
        }
    }
    if let (Some(off), Some(on)) = (
        benches.get("add_release_128k/reuse_off"),
        benches.get("add_release_128k/reuse_on_0pct_hit"),
    ) {
        let _ = writeln!(
            derived,
            "| kv-blocks reuse on / off throughput at 0 % hit | {:.3} (goal 0.97) |",
            off.mean_ns / on.mean_ns
        );
    }
    if !derived.is_empty() {
        md.push_str("\n## Derived\n\n| figure | value |\n| --- | ---: |\n");
        md.push_str(&derived);
    }
    Ok(md)
}

/// Criterion's mean time (ns) of every result under `root`, by benchmark id.
pub(crate) fn means(root: &Path) -> Result<BTreeMap<String, f64>, String> {
    let mut benches = BTreeMap::new();
    collect(root, &mut benches)?;
    Ok(benches.into_iter().map(|(id, b)| (id, b.mean_ns)).collect())
}

fn fmt_time(ns: f64) -> String {
    match ns {
        n if n >= 1e9 => format!("{:.3} s", n / 1e9),
        n if n >= 1e6 => format!("{:.3} ms", n / 1e6),
        n if n >= 1e3 => format!("{:.3} µs", n / 1e3),
        n => format!("{n:.1} ns"),
    }
}

/// Walks `dir` for `new/benchmark.json` + `new/estimates.json` pairs.
fn collect(dir: &Path, out: &mut BTreeMap<String, Bench>) -> Result<(), String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.is_dir() {
            continue;
        }
        if path.file_name().is_some_and(|n| n == "new") {
            let read = |f: &str| std::fs::read_to_string(path.join(f)).ok();
            if let (Some(meta), Some(est)) = (read("benchmark.json"), read("estimates.json"))
                && let (Some(id), Some(mean_ns)) = (string_field(&meta, "full_id"), mean(&est))
            {
                out.insert(
                    id,
                    Bench {
                        mean_ns,
                        bytes: number_after(&meta, "\"Bytes\":"),
                        elements: number_after(&meta, "\"Elements\":"),
                    },
                );
            }
        } else {
            collect(&path, out)?;
        }
    }
    Ok(())
}

fn string_field(json: &str, key: &str) -> Option<String> {
    let after = value_after(json, &format!("\"{key}\":"))?.strip_prefix('"')?;
    Some(after[..after.find('"')?].to_owned())
}

/// The text after `marker` and any spaces (JSON from Python puts a space after colons).
fn value_after<'a>(json: &'a str, marker: &str) -> Option<&'a str> {
    Some(json[json.find(marker)? + marker.len()..].trim_start())
}

fn number_after(json: &str, marker: &str) -> Option<f64> {
    let rest = value_after(json, marker)?;
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '-' | '+')))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

fn mean(estimates: &str) -> Option<f64> {
    let at = estimates.find("\"mean\":")?;
    number_after(&estimates[at..], "\"point_estimate\":")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes one criterion result (`new/benchmark.json` and `new/estimates.json`) under `root`.
    fn result(root: &Path, id: &str, bytes: u64, mean_ns: f64) {
        let dir = root.join(id.replace('/', "_")).join("new");
        std::fs::create_dir_all(&dir).expect("the temporary directory is writable");
        let meta = format!("{{\"full_id\":\"{id}\",\"throughput\":{{\"Bytes\":{bytes}}}}}");
        let est =
            format!("{{\"mean\":{{\"confidence_interval\":{{}},\"point_estimate\":{mean_ns}}}}}");
        std::fs::write(dir.join("benchmark.json"), meta).expect("writable");
        std::fs::write(dir.join("estimates.json"), est).expect("writable");
    }

    #[test]
    fn derived_rows_divide_by_the_better_read() {
        let root = std::env::temp_dir().join(format!("xtask-summary-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let gib = 1u64 << 30;
        // Reads of 10 and 8 GiB/s: fractions are of the better one.
        result(&root, "stream_read/sum_1GiB", gib, 1e8);
        result(&root, "stream_read/sum_1GiB_after", gib, 1.25e8);
        result(&root, "decode/bf16/B8/L32768", gib, 2e8);
        result(&root, "sparse_decode/bf16/B8/L32768", gib, 2e7);
        // 8 MiB in 1 ms: 7.81 GiB/s, 0.78 of the better read.
        result(&root, "decode_cached/bf16/B8/L256", 8 << 20, 1e6);
        // 16 MiB in 2 ms: 7.81 GiB/s, 0.78 of the better read.
        result(&root, "pool_read/bf16/B1/L4096", 16 << 20, 2e6);
        let md = render(&root, &root.join("no-peers.json")).expect("a summary of valid results");
        let _ = std::fs::remove_dir_all(&root);
        for row in [
            "| decode/bf16/B8/L32768: fraction of read bandwidth (10.0 GiB/s, the better of two \
             reads) | 0.50 (goal 0.80) |",
            "| decode_cached/bf16/B8/L256: rate from cache over the read bandwidth (well under \
             0.80 where the arithmetic bounds the decode) | 0.78 |",
            "| sparse_decode/bf16/B8/L32768: speedup over dense | 10.0x |",
            "| pool_read/bf16/B1/L4096: its bytes read alone, call by call, over the read \
             bandwidth (the read a decode of that size meets) | 0.78 |",
        ] {
            assert!(md.contains(row), "{row:?} missing from\n{md}");
        }
        for id in ["decode_cached/bf16/B8/L256", "pool_read/bf16/B1/L4096"] {
            assert!(
                !md.contains(&format!("{id}: fraction")),
                "{id} is not a decode row:\n{md}"
            );
        }
    }
}
