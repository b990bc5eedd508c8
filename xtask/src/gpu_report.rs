//! The GPU half of the bench report, written on the GPU machine by the device bundle's
//! `run.sh` (`xtask gpu-report OUTDIR`) from the JSON its checks and benches left in OUTDIR:
//! `report.md` with the sparse/dense speedup against context (ours and torch SDPA's dense, in
//! the same run), the hierarchical step's stage shares, the synthetic 8B-class model's
//! capacity, throughput and stages, the bundle's table, and `gpu_speedup.png`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use plotters::chart::SeriesLabelPosition;
use serde_json::Value;

use crate::plot::{Chart, Series, line_chart};

/// The batch-1 contexts of `gpu bench` and the torch peer, in KiB tokens.
const CONTEXTS_K: [u64; 6] = [4, 8, 16, 32, 64, 128];

/// Writes `report.md` and `gpu_speedup.png` into `dir` from the bundle's outputs there, and
/// returns the report's text.
pub(crate) fn write(dir: &Path) -> Result<String, String> {
    let read = |name: &str| -> Option<Value> {
        serde_json::from_str(&std::fs::read_to_string(dir.join(name)).ok()?).ok()
    };
    let Some(bench) = read("bench.json") else {
        return Err(format!("no readable {}", dir.join("bench.json").display()));
    };
    let ours = rows(&bench);
    let peers = read("peers.json").map_or_else(BTreeMap::new, |p| rows(&p));
    let device = bench["device"].as_str().unwrap_or("unknown GPU");
    let mut md = format!(
        "# GPU bench report\n\n{device}, {}; written by the device bundle's run.sh \
         (`cargo xtask bench --gpu`).\n\n",
        crate::report::today()
    );
    speedup(dir, &ours, &peers, &mut md)?;
    if let Some(step) = read("step.json") {
        stages(&step, &mut md);
    } else {
        md.push_str("## The hierarchical step\n\nNot measured: no step.json.\n\n");
    }
    match read("fidelity.json") {
        Some(f) => fidelity(&f, &mut md),
        None => md.push_str(
            "## Sparse fidelity on the GPU\n\nNot measured: no fidelity.json (the real model \
             travels in two parts; see run.sh).\n\n",
        ),
    }
    match read("passkey.json") {
        Some(p) => passkey(&p, &mut md),
        None => md.push_str(
            "## Passkey retrieval on the GPU\n\nNot measured: no passkey.json (the real model \
             travels in two parts; see run.sh).\n\n",
        ),
    }
    match read("synth.json") {
        Some(synth) => synthetic(&synth, &mut md),
        None => md.push_str("## The synthetic 8B-class model\n\nNot measured: no synth.json.\n\n"),
    }
    if let Ok(table) = std::fs::read_to_string(dir.join("table.txt")) {
        let _ = write!(
            md,
            "## Every GPU bench against its goal\n\nThe bundle's table (run.sh).\n\n```text\n{table}```\n"
        );
    }
    let path = dir.join("report.md");
    std::fs::write(&path, &md).map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(md)
}

/// A bench JSON's rows by name: (synced ms, queued ms).
fn rows(json: &Value) -> BTreeMap<String, (f64, f64)> {
    json["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            let ms = r["ms"].as_f64()?;
            Some((
                r["name"].as_str()?.to_owned(),
                (ms, r["queued_ms"].as_f64().unwrap_or(ms)),
            ))
        })
        .collect()
}

/// The batch-1 sweep: our dense and sparse decode and torch SDPA dense, synced medians.
fn speedup(
    dir: &Path,
    ours: &BTreeMap<String, (f64, f64)>,
    peers: &BTreeMap<String, (f64, f64)>,
    md: &mut String,
) -> Result<(), String> {
    md.push_str(
        "## Sparse decode attention against context (GPU)\n\n\
         One decode step, batch 1, bf16, 32 query / 8 KV heads of 128, pages of 16; sparse reads \
         a 2048-token budget. CUDA-event medians of synced runs; torch SDPA dense on contiguous \
         K/V in the same run.\n\n\
         | context | ours dense | ours sparse | torch SDPA dense | over our dense | over SDPA dense |\n\
         | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let (mut over_ours, mut over_torch) = (Vec::new(), Vec::new());
    for k in CONTEXTS_K {
        let tag = format!("B1 L{k}K");
        let (Some(dense), Some(sparse)) = (
            ours.get(&format!("dense decode {tag}")),
            ours.get(&format!("sparse decode 2K {tag}")),
        ) else {
            continue;
        };
        let torch = peers.get(&format!("torch SDPA dense {tag}"));
        let ctx = (k * 1024) as f64;
        over_ours.push((ctx, dense.0 / sparse.0));
        let (torch_ms, torch_x) = match torch {
            Some(t) => {
                over_torch.push((ctx, t.0 / sparse.0));
                (format!("{:.4} ms", t.0), format!("{:.1}×", t.0 / sparse.0))
            }
            None => ("-".to_owned(), "-".to_owned()),
        };
        let _ = writeln!(
            md,
            "| {}K | {:.4} ms | {:.4} ms | {torch_ms} | {:.1}× | {torch_x} |",
            k,
            dense.0,
            sparse.0,
            dense.0 / sparse.0
        );
    }
    if over_ours.is_empty() {
        md.push_str("\n(no batch-1 sweep in bench.json)\n\n");
        return Ok(());
    }
    line_chart(
        &dir.join("gpu_speedup.png"),
        &Chart {
            title: "Sparse decode attention over dense, GPU (B1, bf16, 2K budget)",
            x_label: "context (tokens)",
            y_label: "speedup (dense time / sparse time)",
            log_y: true,
            y_from_zero: false,
            legend: SeriesLabelPosition::UpperLeft,
        },
        &[
            Series {
                name: "over our dense kernel".to_owned(),
                points: over_ours,
            },
            Series {
                name: "over torch SDPA dense".to_owned(),
                points: over_torch,
            },
        ],
    )?;
    md.push_str("\n![gpu speedup](gpu_speedup.png)\n\n");
    Ok(())
}

/// The hierarchical step's stages from `gpu_step bench --json`.
fn stages(step: &Value, md: &mut String) {
    let _ = write!(
        md,
        "## The hierarchical step, one layer ({})\n\n\
         | stage | ms per step | share |\n| --- | ---: | ---: |\n",
        step["shape"].as_str().unwrap_or("?")
    );
    for s in step["stages"].as_array().into_iter().flatten() {
        let _ = writeln!(
            md,
            "| {} | {:.4} | {:.1} % |",
            s["stage"].as_str().unwrap_or("?"),
            s["ms"].as_f64().unwrap_or(f64::NAN),
            100.0 * s["share"].as_f64().unwrap_or(f64::NAN)
        );
    }
    let f = |k: &str| step[k].as_f64().unwrap_or(f64::NAN);
    let _ = writeln!(
        md,
        "\nWhole step (median) {:.4} ms at a miss rate of {:.1} %; with loads on a copy stream \
         under the other micro-batch's compute, {:.4} ms per layer against {:.4} ms serial.\n",
        f("whole_ms"),
        100.0 * f("miss_rate"),
        f("pipelined_ms_per_layer"),
        f("serial_ms_per_layer")
    );
}

/// The real model's sparse fidelity on the CPU and the GPU, from `gpu_engine fidelity --json`.
fn fidelity(f: &Value, md: &mut String) {
    let _ = write!(
        md,
        "## Sparse fidelity on the GPU\n\nThe real model, {} prefill + {} teacher-forced tokens, \
         each sparse variant against dense; each side against its own dense.\n\n\
         | variant | side | ppl dense | ppl sparse | ratio | top-1 agreement | miss rate |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: |\n",
        f["prefill"].as_u64().unwrap_or(0),
        f["decode"].as_u64().unwrap_or(0),
    );
    for v in f["variants"].as_array().into_iter().flatten() {
        let name = v["name"].as_str().unwrap_or("?");
        for side in ["cpu", "gpu"] {
            let g = |k: &str| v[side][k].as_f64().unwrap_or(f64::NAN);
            let misses = if side == "gpu" {
                format!("{:.3}", v["gpu_miss_rate"].as_f64().unwrap_or(f64::NAN))
            } else {
                "-".to_owned()
            };
            let _ = writeln!(
                md,
                "| {name} | {side} | {:.4} | {:.4} | {:.4} | {:.4} | {misses} |",
                g("ppl_dense"),
                g("ppl_sparse"),
                g("ppl_ratio"),
                g("top1")
            );
        }
    }
    let with: Vec<&Value> = f["variants"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["prefetch"].is_object())
        .collect();
    if !with.is_empty() {
        md.push_str(
            "\nThe GPU's sparse decode without and with prefetch (each layer's start loads the \
             next layer's estimated selection on a copy stream):\n\n\
             | variant | same logits | miss rate | with prefetch | pages loaded early a token | \
             ms a token | with prefetch |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |\n",
        );
        for v in with {
            let p = &v["prefetch"];
            let g = |x: &Value, k: &str| x[k].as_f64().unwrap_or(f64::NAN);
            let _ = writeln!(
                md,
                "| {} | {} | {:.3} | {:.3} | {:.1} | {:.2} | {:.2} |",
                v["name"].as_str().unwrap_or("?"),
                if p["same_logits"].as_bool() == Some(true) {
                    "yes"
                } else {
                    "NO"
                },
                g(v, "gpu_miss_rate"),
                g(p, "miss_rate"),
                g(p, "early_pages"),
                g(v, "gpu_ms"),
                g(p, "ms")
            );
        }
    }
    md.push('\n');
}

/// Passkey retrieval on the GPU, from `gpu_engine passkey --json`: keys found per context and
/// variant.
fn passkey(p: &Value, md: &mut String) {
    md.push_str(
        "## Passkey retrieval on the GPU\n\nThe real model answers greedily; a key hidden at \
         evenly spread depths.\n\n| context | variant | keys found |\n| ---: | --- | ---: |\n",
    );
    for r in p["runs"].as_array().into_iter().flatten() {
        let _ = writeln!(
            md,
            "| {} | {} | {}/{} |",
            r["context"].as_u64().unwrap_or(0),
            r["variant"].as_str().unwrap_or("?"),
            r["correct"].as_u64().unwrap_or(0),
            r["trials"].as_u64().unwrap_or(0)
        );
    }
    md.push('\n');
}

/// The synthetic 8B-class model from `gpu_engine bench --json`: one row per run, then the
/// sparse runs' device time by stage.
fn synthetic(synth: &Value, md: &mut String) {
    md.push_str(
        "## The synthetic 8B-class model, dense against sparse\n\n\
         Whole-model decode steps (`gpu_engine bench`); keys: the synthetic prompts' (random, or \
         heavy-hitter pages every query selects); lanes: the batch split over that many forks \
         of the model, each decoded by its own thread and stream; early: with prefetch, the \
         pages a step loaded ahead of its layers (on a copy stream, under the layer before), \
         its miss rate counting the misses left in the steps.\n\n\
         | context | mode | keys | batch | lanes | device MiB/request | host GiB/request | \
         device max | ms/step | tokens/s | miss rate | early pages/step |\n| ---: | --- | --- | \
         ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let rows = synth["rows"].as_array().cloned().unwrap_or_default();
    let num = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    for r in &rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {:.1} | {:.2} | {} | {:.2} | {:.1} | {} | {} |",
            r["context"].as_u64().unwrap_or(0),
            r["mode"].as_str().unwrap_or("?"),
            r["keys"].as_str().unwrap_or("-"),
            r["batch"].as_u64().unwrap_or(0),
            r["lanes"].as_u64().unwrap_or(1),
            num(r, "device_bytes") / f64::from(1u32 << 20),
            num(r, "host_bytes") / f64::from(1u32 << 30),
            r["device_max"].as_u64().unwrap_or(0),
            num(r, "step_ms"),
            num(r, "tokens_per_s"),
            r["miss_rate"]
                .as_f64()
                .map_or("-".to_owned(), |m| format!("{m:.3}")),
            r["early_pages"]
                .as_f64()
                .map_or("-".to_owned(), |p| format!("{p:.0}"))
        );
    }
    md.push_str("\nSparse step, device ms by stage (share):\n\n");
    for r in &rows {
        let stages: Vec<(&str, f64)> = r["stages"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                (
                    s["stage"].as_str().unwrap_or("?"),
                    s["ms"].as_f64().unwrap_or(f64::NAN),
                )
            })
            .collect();
        if stages.is_empty() {
            continue;
        }
        let sum: f64 = stages.iter().map(|s| s.1).sum();
        let parts: Vec<String> = stages
            .iter()
            .map(|(l, t)| format!("{l} {t:.2} ({:.0} %)", 100.0 * t / sum))
            .collect();
        let _ = writeln!(
            md,
            "- {} {} B{}{}: {sum:.2} ms = {}",
            r["context"].as_u64().unwrap_or(0),
            r["keys"].as_str().unwrap_or("-"),
            r["batch"].as_u64().unwrap_or(0),
            if r["early_pages"].is_f64() {
                ", prefetch"
            } else {
                ""
            },
            parts.join(", ")
        );
    }
    md.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_report_reads_the_bundles_json() {
        let dir = std::env::temp_dir().join(format!("xtask-gpu-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the temporary directory is writable");
        let row = |name: &str, ms: f64| serde_json::json!({ "name": name, "ms": ms, "queued_ms": ms * 0.9 });
        let bench = serde_json::json!({ "device": "NVIDIA H200", "rows": [
            row("dense decode B1 L4K", 0.02), row("sparse decode 2K B1 L4K", 0.01),
            row("dense decode B1 L128K", 0.2), row("sparse decode 2K B1 L128K", 0.02),
        ]});
        let peers = serde_json::json!({ "device": "NVIDIA H200", "rows": [row("torch SDPA dense B1 L128K", 0.3)] });
        let step = serde_json::json!({ "shape": "B8 L32K", "miss_rate": 0.05, "whole_ms": 0.1,
            "serial_ms_per_layer": 0.2, "pipelined_ms_per_layer": 0.15,
            "stages": [{ "stage": "hot-buffer diff", "ms": 0.01, "share": 0.1 }] });
        let synth = serde_json::json!({ "device": "NVIDIA H200", "rows": [
            { "context": 32768, "mode": "sparse", "keys": "heavy", "batch": 16, "lanes": 2,
              "device_bytes": 807_600_000u64, "host_bytes": 5_379_000_000u64, "device_max": 159,
              "step_ms": 20.0, "tokens_per_s": 800.0, "miss_rate": 0.1,
              "stages": [{ "stage": "model", "ms": 5.0 }, { "stage": "loads", "ms": 15.0 }] }] });
        let side = |d: f64, sp: f64, t: f64| serde_json::json!({ "ppl_dense": d, "ppl_sparse": sp, "ppl_ratio": sp / d, "top1": t });
        let fidelity = serde_json::json!({ "prefill": 6144, "decode": 511, "variants": [
            { "name": "quest-1024+2dense", "cpu": side(17.0, 18.0, 0.85), "gpu": side(16.0, 17.0, 0.8),
              "gpu_miss_rate": 0.043 }] });
        let passkey = serde_json::json!({ "device": "NVIDIA H200", "runs": [
            { "context": 4096, "variant": "dense", "trials": 10, "correct": 9 }] });
        for (name, v) in [
            ("bench.json", bench),
            ("peers.json", peers),
            ("step.json", step),
            ("synth.json", synth),
            ("fidelity.json", fidelity),
            ("passkey.json", passkey),
        ] {
            std::fs::write(dir.join(name), v.to_string()).expect("writable");
        }
        std::fs::write(dir.join("table.txt"), "device: NVIDIA H200\n").expect("writable");
        let md = write(&dir).expect("a report from valid outputs");
        for want in [
            "NVIDIA H200, ",
            "| 4K | 0.0200 ms | 0.0100 ms | - | 2.0× | - |",
            "| 128K | 0.2000 ms | 0.0200 ms | 0.3000 ms | 10.0× | 15.0× |",
            "| hot-buffer diff | 0.0100 | 10.0 % |",
            "miss rate of 5.0 %",
            "| quest-1024+2dense | gpu | 16.0000 | 17.0000 | 1.0625 | 0.8000 | 0.043 |",
            "| 4096 | dense | 9/10 |",
            "| 32768 | sparse | heavy | 16 | 2 | 770.2 | 5.01 | 159 | 20.00 | 800.0 | 0.100 |",
            "- 32768 heavy B16: 20.00 ms = model 5.00 (25 %), loads 15.00 (75 %)",
            "```text\ndevice: NVIDIA H200\n```",
        ] {
            assert!(md.contains(want), "{want:?} missing from\n{md}");
        }
        let png = std::fs::read(dir.join("gpu_speedup.png")).expect("the plot was written");
        assert_eq!(&png[..4], b"\x89PNG");
        std::fs::remove_file(dir.join("bench.json")).expect("it exists");
        assert!(write(&dir).is_err(), "no bench.json, no report");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
