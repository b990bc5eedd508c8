//! The table and JSON of a GPU bench, its random inputs and its command line, shared by
//! attn-op's `gpu`, offload's `gpu_io`, sparse-algo's `gpu_select` and coordinator's
//! `gpu_step` (which include this file with `#[path]`).
#![allow(dead_code, reason = "each example uses a part")]

use std::fmt::Write as _;

use attn_op::cuda::Timing;
use half::bf16;
use rayon::prelude::*;

use crate::rng::Rng;

/// A GPU tool's `main`: runs `run(command, the rest of the arguments)` (command `check` by
/// default) and exits with its code. Where no CUDA driver exists, a command that needs the
/// device (all but those in `device_free`) prints "skipped: no CUDA device" and exits 0; any
/// other error is printed and exits 1.
pub(crate) fn tool_main<E: std::fmt::Display>(
    tool: &str,
    device_free: &[&str],
    run: impl FnOnce(&str, &[String]) -> Result<i32, E>,
) -> ! {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = args.first().map_or("check", String::as_str);
    let code = match run(cmd, &args[1.min(args.len())..]) {
        Ok(code) => code,
        Err(e) => {
            let why = e.to_string();
            if why.contains("no CUDA") && !device_free.contains(&cmd) {
                println!("skipped: no CUDA device ({why})");
                0
            } else {
                eprintln!("{tool} {cmd}: {why}");
                1
            }
        }
    };
    std::process::exit(code);
}

/// The file after `--json` in a command line, if any.
pub(crate) fn json_arg(args: &[String]) -> Option<&str> {
    flag_value(args, "--json")
}

/// The value after `flag` in `args`, if any.
pub(crate) fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

/// One timed row of the table.
pub(crate) struct Row {
    pub(crate) name: String,
    pub(crate) t: Timing,
    pub(crate) bytes: f64,
    pub(crate) note: String,
}

/// The rows as a text table: name, synced and queued ms, GB/s at the synced time, note.
pub(crate) fn table(rows: &[Row]) -> String {
    let width = rows.iter().map(|r| r.name.len()).max().unwrap_or(0).max(5);
    let mut text = String::new();
    let _ = writeln!(
        text,
        "{:<width$} {:>10} {:>10} {:>10}  note (synced / queued)",
        "bench", "ms", "queued ms", "GB/s"
    );
    for r in rows {
        let gbs = if r.bytes > 0.0 {
            r.bytes / r.t.synced / 1e6
        } else {
            0.0
        };
        let _ = writeln!(
            text,
            "{:<width$} {:>10.4} {:>10.4} {:>10.1}  {}",
            r.name, r.t.synced, r.t.queued, gbs, r.note
        );
    }
    text
}

/// The rows as the JSON `bench/gpu_table.py` reads.
pub(crate) fn json(device: &str, rows: &[Row]) -> String {
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"name\":\"{}\",\"ms\":{},\"queued_ms\":{},\"bytes\":{},\"note\":\"{}\"}}",
                r.name, r.t.synced, r.t.queued, r.bytes, r.note
            )
        })
        .collect();
    format!(
        "{{\"device\":\"{device}\",\"rows\":[{}]}}\n",
        items.join(",")
    )
}

/// `n` random bf16 values in [-1, 1), generated in parallel chunks with fixed seeds.
pub(crate) fn random_bf16(n: usize, seed: u64) -> Vec<bf16> {
    let mut v = vec![bf16::ZERO; n];
    v.par_chunks_mut(1 << 20).enumerate().for_each(|(i, c)| {
        let mut rng = Rng::new(seed * 1_000_003 + i as u64);
        for x in c {
            *x = bf16::from_f32(rng.unit());
        }
    });
    v
}
