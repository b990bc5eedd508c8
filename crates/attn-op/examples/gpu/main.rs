//! The GPU half of attn-op's checks and benchmarks, for the device bundle (`cargo xtask gpu`).
//!
//! - `gpu compile`: compiles the kernels with NVRTC only (no device needed).
//! - `gpu check [--small]`: every device kernel against the CPU implementation on fresh random inputs,
//!   outputs poisoned with NaN first; exits 1 on any mismatch.
//! - `gpu bench [--json FILE]`: device copy bandwidth, dense paged decode and sparse page-list
//!   decode (bf16, 32 q / 8 KV heads, D 128, pages of 16), CUDA events, median of many runs.
//!
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

use attn_op::AttnError;
use attn_op::cuda::Gpu;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = args.first().map_or("check", String::as_str);
    let code = match run(cmd, &args[1.min(args.len())..]) {
        Ok(code) => code,
        Err(AttnError::Device(why)) if cmd != "compile" && why.starts_with("no CUDA") => {
            println!("skipped: no CUDA device ({why})");
            0
        }
        Err(e) => {
            eprintln!("gpu {cmd}: {e}");
            1
        }
    };
    std::process::exit(code);
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
            let json = rest
                .iter()
                .position(|a| a == "--json")
                .and_then(|i| rest.get(i + 1));
            bench::all(&mut gpu, json.map(String::as_str), cmd == "profile")?;
            Ok(0)
        }
        other => {
            eprintln!("unknown command {other}; use compile, check or bench");
            Ok(2)
        }
    }
}

/// A small deterministic generator (xorshift64*), so every run draws the same inputs per seed.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..hi`.
    pub(crate) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo) as u64) as usize
    }

    /// Uniform in `[-1, 1)`.
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// A random permutation of `0..n`.
    pub(crate) fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            v.swap(i, self.range(0, i + 1));
        }
        v
    }
}
