//! The GPU half of sparse-algo's checks and benchmarks, for the device bundle (`cargo xtask gpu`).
//!
//! - `gpu_select check`: Quest's device min/max pages (built after a prefill, then maintained
//!   over decode steps) against [`RepPool`] bit for bit, and the device estimate + top-k against
//!   [`Quest::retrieve_topk`](sparse_algo::SparseAlgorithm::retrieve_topk) row for row (per-head
//!   and head-shared, f32/f16/bf16, GQA 1/4/8, sinks and recent tokens, tied scores, a chunked
//!   prefill's last query row), outputs poisoned first; StreamingLLM's device rows against
//!   [`StreamingLlm`]'s, and the DSA indexer's device scores + token top-k against [`Dsa`]'s
//!   with a trained indexer (f32/f16/bf16 keys, tied scores, rows longer than shared memory);
//!   attention right after a top-k that publishes its rows against attention after the whole
//!   top-k, bit for bit; the same with Quest's bounds in FP8 E4M3 (`Summary::E4m3`: the device
//!   pool's codes and scales against the CPU pool bit for bit, the tensor-core selection up to
//!   near ties); exits 1 on any mismatch.
//! - `gpu_select bench [--json FILE] [--only B1|B8] [--min-chunk KEYS] [--waves N] [--variant
//!   NAME]`: bf16, 32 query / 8 KV heads, D 128, pages of 16, a 2K budget: min/max construction,
//!   the fused estimate + top-k, and the estimate, top-k and sparse attention together at B8 L32K
//!   and B1 L128K (with and without programmatic dependent launches, captured in a CUDA graph, and
//!   with the rows published to an attention that starts early), the same over E4M3 bounds (with
//!   how many ids it shares with the bf16 bounds' selection), and that step published from
//!   graphs rotating over 8 layers' pools and pages, as a decode runs it (none of its bytes left
//!   in L2 by the run before; a graph a layer, and all 8 in one graph), with our dense decode in
//!   the same run; StreamingLLM's rows, and the DSA indexer (64 heads of 128, DeepSeek V3.2's
//!   shape) + top-2048 + token attention. Then the attention kernel's registers, and a trace of
//!   one step per shape (per-CTA timestamps of the scoring, `pick_rows` and the attention on
//!   one time axis; plain and published, alone, behind another step and behind the other
//!   layers' steps). `--only` keeps the shapes whose tag starts with its value (for profiling
//!   one shape); `--min-chunk` and `--waves` set the attention's split planner (a split's
//!   fewest keys, the waves of CTAs it aims for) and `--variant` its kernel
//!   (`Gpu::set_variant`) for sweeps.
//! - `gpu_select spec [--json FILE] [--only B1|B8] [--check] [--late]`: a prototype, attention
//!   over the pages a step is likely to select (the previous step's, or a hot buffer's) while
//!   its top-k runs (kernels/spec.cu), against the plain step of 8 layers in one graph, at
//!   several shares of the selection those pages hold; `--check` only compares its outputs
//!   with the CPU; `--late` times only the walks after the top-k, twice each.
//!
//! Without a CUDA driver or device it prints "skipped: no CUDA device" and exits 0.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

#[path = "../../../attn-op/examples/gpu/report.rs"]
mod report;
#[path = "../../../attn-op/examples/gpu/rng.rs"]
mod rng;

mod bench;
mod check;
mod cold;
mod spec;
mod steptrace;
mod streaming_dsa;

use attn_op::cuda::Gpu;
use sparse_algo::AlgoError;
use sparse_algo::cuda::SelectKernels;

fn main() {
    report::tool_main("gpu_select", &[], run);
}

fn run(cmd: &str, args: &[String]) -> Result<i32, AlgoError> {
    let mut gpu = Gpu::new(0)?;
    println!("device: {}", gpu.name()?);
    let mut sk = SelectKernels::new(&gpu)?;
    match cmd {
        "check" => check::check(&gpu, &mut sk),
        "bench" => {
            let only = report::flag_value(args, "--only");
            // The split planner's knobs, for sweeps (attn_op::cuda::Gpu::set_min_chunk and
            // set_waves): every attention launch of the bench takes them.
            for (flag, set) in [
                ("--min-chunk", Gpu::set_min_chunk as fn(&mut Gpu, usize)),
                ("--waves", Gpu::set_waves),
            ] {
                if let Some(v) = report::flag_value(args, flag) {
                    match v.parse() {
                        Ok(n) => set(&mut gpu, n),
                        Err(_) => {
                            eprintln!("{flag} takes a count, not {v}");
                            return Ok(2);
                        }
                    }
                }
            }
            if let Some(v) = report::flag_value(args, "--variant") {
                gpu.set_variant(Some(v))?;
            }
            bench::bench(&mut gpu, &mut sk, report::json_arg(args), only)?;
            Ok(0)
        }
        "spec" => {
            spec::run(
                &mut gpu,
                &mut sk,
                report::json_arg(args),
                report::flag_value(args, "--only"),
                args.iter().any(|a| a == "--check"),
                args.iter().any(|a| a == "--late"),
            )?;
            Ok(0)
        }
        other => {
            eprintln!("unknown command {other}; use check, bench or spec");
            Ok(2)
        }
    }
}
