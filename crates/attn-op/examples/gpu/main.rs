//! The GPU half of attn-op's checks and benchmarks, for the device bundle (`cargo xtask gpu`).
//!
//! - `gpu compile`: compiles the kernels with NVRTC only (no device needed).
//! - `gpu check [--small]`: every device kernel against the CPU implementation on fresh random inputs,
//!   outputs poisoned with NaN first; exits 1 on any mismatch.
//! - `gpu bench [--json FILE]`: device copy bandwidth, dense paged decode and sparse page-list
//!   decode (bf16, 32 q / 8 KV heads, D 128, pages of 16), CUDA events, median of many runs.
//!
//!   It ends with per-CTA timelines of one dense and one sparse launch of each acceptance
//!   shape through the traced kernel (`tct`).
//! - `gpu profile`: the bench's main rows only, for `ncu`.
//!
//! Without a CUDA driver or device every command prints "skipped: no CUDA device" and exits 0:
//! these are not tests and never count as passed where no GPU exists.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

mod bench;
mod check;
mod report;
mod rng;
mod trace;

pub(crate) use rng::Rng;

use attn_op::AttnError;
use attn_op::cuda::Gpu;

fn main() {
    report::tool_main("gpu", &["compile"], run);
}

fn run(cmd: &str, rest: &[String]) -> Result<i32, AttnError> {
    match cmd {
        "compile" => {
            let ptx = attn_op::cuda::compile_kernels("sm_90")?;
            println!(
                "kernels compile for sm_90 ({} bytes of PTX)",
                ptx.to_src().len()
            );
            Ok(0)
        }
        "check" => {
            let mut gpu = Gpu::new(0)?;
            println!("device: {}", gpu.name()?);
            check::all(&mut gpu, rest.iter().any(|a| a == "--small"))
        }
        "bench" | "profile" => {
            let mut gpu = Gpu::new(0)?;
            println!("device: {}", gpu.name()?);
            bench::all(&mut gpu, report::json_arg(rest), cmd == "profile")?;
            Ok(0)
        }
        other => {
            eprintln!("unknown command {other}; use compile, check or bench");
            Ok(2)
        }
    }
}
