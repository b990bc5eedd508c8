//! Compiles every CUDA module of the workspace with NVRTC, as the crates do at run time: a
//! check that needs the NVRTC library and the CUDA headers, not a device. `cargo xtask ci`
//! takes both from PyPI's `nvidia-cuda-nvrtc` and `nvidia-cuda-runtime` wheels and runs it, so
//! that a kernel that does not compile fails CI instead of the next device run.
//!
//! `cargo run -p engine --features cuda --example kernels [ARCH] [--ptx DIR]` (default
//! `sm_90`), with the library on `LD_LIBRARY_PATH` and the headers in `HSA_CUDA_INCLUDE` (or
//! `/usr/local/cuda/include`). Prints each module's PTX size; exits 1 on the first module that
//! does not compile, with NVRTC's log. With `--ptx DIR` it also writes each module's PTX there
//! (`attn.ptx`, …): two trees' PTX compared show whether a change of the sources changed the
//! code, where no device is at hand to run it.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line check"
)]

use std::process::ExitCode;
use std::time::Instant;

use attn_op::cuda::compile_source;

/// The prototype of `gpu_select spec` (sparse-algo's example), built as that example builds it.
const SPEC_SOURCE: &str = concat!(
    include_str!("../../../kernels/pdl.cuh"),
    include_str!("../../../kernels/walk.cu"),
    include_str!("../../../kernels/spec.cu")
);

fn main() -> ExitCode {
    let (mut arch, mut ptx_dir) = ("sm_90", None);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg != "--ptx" {
            arch = Box::leak(arg.into_boxed_str());
        } else if let Some(dir) = args.next() {
            ptx_dir = Some(std::path::PathBuf::from(dir));
        } else {
            eprintln!("--ptx takes a directory");
            return ExitCode::from(2);
        }
    }
    let modules = [
        ("kernels/attn.cu", attn_op::cuda::KERNEL_SOURCE),
        ("kernels/select.cu", sparse_algo::cuda::KERNEL_SOURCE),
        ("kernels/offload.cu", offload::cuda::KERNEL_SOURCE),
        ("kernels/model.cu", engine::gpu::MODEL_KERNELS),
        ("kernels/spec.cu", SPEC_SOURCE),
    ];
    for (name, source) in modules {
        let start = Instant::now();
        match compile_source(name, source, arch) {
            Ok(ptx) => {
                let src = ptx.to_src();
                println!(
                    "{name}: {} bytes of PTX for {arch} in {:.1} s",
                    src.len(),
                    start.elapsed().as_secs_f64()
                );
                if let Some(dir) = &ptx_dir {
                    let stem = name.trim_start_matches("kernels/").trim_end_matches(".cu");
                    let path = dir.join(format!("{stem}.ptx"));
                    let written =
                        std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, src));
                    if let Err(e) = written {
                        eprintln!("{}: {e}", path.display());
                        return ExitCode::FAILURE;
                    }
                }
            }
            Err(e) => {
                eprintln!("{name}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
