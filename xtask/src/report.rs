//! The bench report, `target/bench-report/report.md`: what this machine measured, as tables
//! and PNG plots, then the criterion summary.
//!
//! - speedup of sparse over dense decode attention against context length (criterion's
//!   `decode/bf16/B1/L*` and `sparse_decode/bf16/B1/L*`);
//! - fidelity against budget, and hit rate against hot-buffer size, on the real model
//!   (`hsa eval` with `bench/report.toml`, JSON);
//! - device memory per request against context for a Llama-3-8B-class shape (`hsa capacity`,
//!   JSON).
//!
//! A part whose input is missing (the model could not be fetched, `--skip-engine`) says so in
//! the report instead of a table.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use plotters::chart::SeriesLabelPosition;

use crate::plot::{Chart, Series, line_chart};

/// The inputs of one report.
pub(crate) struct Inputs<'a> {
    /// Criterion's mean times by benchmark id, in nanoseconds.
    pub(crate) means: &'a BTreeMap<String, f64>,
    /// `hsa eval --json` of `bench/report.toml`, or why it is missing.
    pub(crate) eval: Result<Value, String>,
    /// `hsa capacity --json` of the Llama-3-8B-class shape, or why it is missing.
    pub(crate) capacity: Result<Value, String>,
    /// The criterion summary (Markdown), appended at the end.
    pub(crate) summary: &'a str,
}

/// Writes `report.md` and its plots into `dir` and returns the report's text.
pub(crate) fn write(dir: &Path, inputs: &Inputs<'_>) -> Result<String, String> {
    let mut md = format!(
        "# Bench report\n\n{}, {} ({} threads); written by `cargo xtask bench`.\n\n",
        today(),
        cpu_name(),
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    speedup(dir, inputs.means, &mut md)?;
    match &inputs.eval {
        Ok(eval) => fidelity(dir, eval, &mut md)?,
        Err(why) => {
            let _ = writeln!(
                md,
                "## Fidelity and hit rate (real model)\n\nNot measured: {why}\n"
            );
        }
    }
    match &inputs.capacity {
        Ok(cap) => capacity(dir, cap, &mut md)?,
        Err(why) => {
            let _ = writeln!(md, "## Device memory per request\n\nNot measured: {why}\n");
        }
    }
    md.push_str(inputs.summary);
    let path = dir.join("report.md");
    std::fs::write(&path, &md).map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(md)
}

/// The sparse/dense attention speedup at batch 1 against context (bf16, 2048-token budget).
fn speedup(dir: &Path, means: &BTreeMap<String, f64>, md: &mut String) -> Result<(), String> {
    md.push_str(
        "## Sparse decode attention against context (CPU)\n\n\
         One decode step, batch 1, bf16, 32 query / 8 KV heads of 128, pages of 32; sparse reads \
         a 2048-token budget (64 random pages per KV head). Criterion means.\n\n\
         | context | dense | sparse | speedup |\n| ---: | ---: | ---: | ---: |\n",
    );
    // (context, dense ns, sparse ns), in context order.
    let mut rows: Vec<(u64, f64, f64)> = means
        .iter()
        .filter_map(|(id, dense)| {
            let ctx = id.strip_prefix("decode/bf16/B1/L")?;
            let sparse = means.get(&format!("sparse_decode/bf16/B1/L{ctx}"))?;
            Some((ctx.parse().ok()?, *dense, *sparse))
        })
        .collect();
    rows.sort_by_key(|r| r.0);
    for (ctx, dense, sparse) in &rows {
        let _ = writeln!(
            md,
            "| {ctx} | {:.3} ms | {:.3} ms | {:.1}× |",
            dense / 1e6,
            sparse / 1e6,
            dense / sparse
        );
    }
    if rows.is_empty() {
        md.push_str("\n(no sweep results under target/criterion: run without a bench filter)\n\n");
        return Ok(());
    }
    let points = rows.iter().map(|r| (r.0 as f64, r.1 / r.2)).collect();
    line_chart(
        &dir.join("speedup.png"),
        &Chart {
            title: "Sparse over dense decode attention, CPU (B1, bf16, 2K budget)",
            x_label: "context (tokens)",
            y_label: "speedup (dense time / sparse time)",
            log_y: false,
            y_from_zero: true,
            legend: SeriesLabelPosition::UpperLeft,
        },
        &[Series {
            name: "sparse page-list decode".to_owned(),
            points,
        }],
    )?;
    md.push_str("\n![speedup](speedup.png)\n\n");
    Ok(())
}

/// The eval sweep: fidelity against budget, hit rate against hot-buffer size.
fn fidelity(dir: &Path, eval: &Value, md: &mut String) -> Result<(), String> {
    let variants = eval["variants"].as_array().cloned().unwrap_or_default();
    let dense = variants.iter().find(|v| v["sparse"] == false);
    let dense_ppl = dense
        .and_then(|d| d["perplexity"].as_f64())
        .unwrap_or(f64::NAN);
    let _ = writeln!(
        md,
        "## Fidelity and hit rate (real model, CPU)\n\n\
         SmolLM2-135M-Instruct on {} tokens of {} ({} prefilled, then teacher-forced decode), \
         Quest variants of `bench/report.toml` against dense (perplexity {dense_ppl:.4}).\n\n\
         | variant | budget | hot | ppl / dense | top-1 | recall | hit rate | device MiB | KiB/step | tok/s |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        eval["tokens"],
        eval["text"][0].as_str().unwrap_or("the text"),
        eval["prefill"],
    );
    let mut by_budget = BTreeMap::new();
    let mut by_hot = BTreeMap::new();
    let key = |v: &Value| {
        let n = |x: &Value| x.as_u64().unwrap_or(u64::MAX);
        (
            n(&v["config"]["algo"]["budget_tokens"]),
            n(&v["hot_tokens"]),
        )
    };
    let mut sparse: Vec<&Value> = variants.iter().filter(|v| v["sparse"] == true).collect();
    sparse.sort_by_key(|v| key(v));
    for v in sparse {
        let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        let budget = v["config"]["algo"]["budget_tokens"]
            .as_f64()
            .unwrap_or(f64::NAN);
        let hot = f("hot_tokens");
        let recall = v["mass_recall"]
            .as_f64()
            .map_or_else(|| "-".to_owned(), |r| format!("{r:.4}"));
        let ratio = f("perplexity") / dense_ppl;
        let _ = writeln!(
            md,
            "| {} | {budget} | {hot} | {ratio:.4} | {:.4} | {recall} | {:.3} | {:.1} | {:.1} | {:.1} |",
            v["name"].as_str().unwrap_or("?"),
            f("top1_agreement"),
            f("hit_rate"),
            f("device_bytes") / 1_048_576.0,
            f("bytes_per_step") / 1024.0,
            f("tokens_per_s"),
        );
        if v["config"]["hot_tokens"].is_null() {
            by_budget.insert(
                budget as u64,
                (ratio, f("top1_agreement"), f("mass_recall")),
            );
        }
        // Every variant at the sweep's budget, its default hot buffer included.
        if budget == 512.0 {
            by_hot.insert(hot as u64, f("hit_rate"));
        }
    }
    let pts = |pick: fn(&(f64, f64, f64)) -> f64| {
        by_budget
            .iter()
            .map(|(b, t)| (*b as f64, pick(t)))
            .filter(|p| p.1.is_finite())
            .collect::<Vec<_>>()
    };
    line_chart(
        &dir.join("fidelity.png"),
        &Chart {
            title: "Fidelity against budget (SmolLM2-135M, Quest)",
            x_label: "budget (tokens per step)",
            y_label: "fraction",
            log_y: false,
            y_from_zero: false,
            legend: SeriesLabelPosition::LowerRight,
        },
        &[
            Series {
                name: "dense perplexity / sparse perplexity".to_owned(),
                points: pts(|t| 1.0 / t.0),
            },
            Series {
                name: "top-1 agreement with dense".to_owned(),
                points: pts(|t| t.1),
            },
            Series {
                name: "attention-mass recall".to_owned(),
                points: pts(|t| t.2),
            },
        ],
    )?;
    line_chart(
        &dir.join("hit_rate.png"),
        &Chart {
            title: "Hot-buffer hit rate against its size (Quest, 512-token budget)",
            x_label: "hot buffer (tokens per request and layer)",
            y_label: "hit rate",
            log_y: false,
            y_from_zero: false,
            legend: SeriesLabelPosition::LowerRight,
        },
        &[Series {
            name: "hit rate".to_owned(),
            points: by_hot.iter().map(|(h, r)| (*h as f64, *r)).collect(),
        }],
    )?;
    md.push_str("\n![fidelity](fidelity.png) ![hit rate](hit_rate.png)\n\n");
    Ok(())
}

/// Device bytes per request against context, dense against each sparse variant.
fn capacity(dir: &Path, cap: &Value, md: &mut String) -> Result<(), String> {
    let rows = cap["rows"].as_array().cloned().unwrap_or_default();
    let names: Vec<String> = rows.first().map_or_else(Vec::new, |r| {
        r["variants"]
            .as_array()
            .map(|vs| {
                vs.iter()
                    .filter_map(|v| v["name"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    });
    let s = &cap["shape"];
    let budget_gib = cap["device_budget"].as_f64().unwrap_or(0.0) / f64::from(1u32 << 30);
    let _ = write!(
        md,
        "## Device memory per request (Llama-3-8B-class shape)\n\n\
         {} layers, {} query / {} KV heads of {}, {}-byte KV; each request generates {} tokens \
         of its context. Bytes from the accounting the scheduler admits by (`hsa capacity`); \
         \"max\" is how many requests fit a {budget_gib:.0} GiB device budget (KV only, host \
         memory permitting).\n\n| context | dense MiB | max |",
        s["layers"], s["q_heads"], s["kv_heads"], s["head_dim"], cap["kv_bytes"], cap["generate"]
    );
    for n in &names {
        let _ = write!(md, " {n} MiB | × dense | max |");
    }
    md.push_str("\n| ---: | ---: | ---: |");
    md.push_str(&" ---: | ---: | ---: |".repeat(names.len()));
    md.push('\n');
    let mib = |v: &Value| v.as_f64().unwrap_or(f64::NAN) / 1_048_576.0;
    let mut series: Vec<Series> = std::iter::once("dense".to_owned())
        .chain(names.iter().cloned())
        .map(|name| Series {
            name,
            points: Vec::new(),
        })
        .collect();
    for r in &rows {
        let ctx = r["context"].as_f64().unwrap_or(f64::NAN);
        let dense = mib(&r["dense"]["device_bytes"]);
        series[0].points.push((ctx, dense));
        let _ = write!(
            md,
            "| {ctx} | {dense:.0} | {} |",
            r["dense"]["max_requests"]
        );
        for (i, v) in r["variants"].as_array().into_iter().flatten().enumerate() {
            let m = mib(&v["device_bytes"]);
            if let Some(s) = series.get_mut(i + 1) {
                s.points.push((ctx, m));
            }
            let ratio = v["ratio"].as_f64().unwrap_or(f64::NAN);
            let _ = write!(md, " {m:.0} | {ratio:.1} | {} |", v["max_requests"]);
        }
        md.push('\n');
    }
    line_chart(
        &dir.join("memory.png"),
        &Chart {
            title: "Device memory per request (Llama-3-8B-class shape, bf16 KV)",
            x_label: "context (tokens)",
            y_label: "MiB per request",
            log_y: true,
            y_from_zero: false,
            legend: SeriesLabelPosition::UpperLeft,
        },
        &series,
    )?;
    md.push_str("\n![memory](memory.png)\n\n");
    Ok(())
}

/// Today's date from `date -u +%F`, or "date unknown".
pub(crate) fn today() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%F"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "date unknown".to_owned())
}

/// The CPU's model name from `/proc/cpuinfo`, or "CPU unknown".
fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.trim().to_owned())
        })
        .unwrap_or_else(|| "CPU unknown".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh, empty directory under the system's temporary one.
    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the temporary directory is writable");
        dir
    }

    fn eval() -> Value {
        let variant =
            |name: &str, budget: u64, hot: u64, explicit_hot: bool, ppl: f64, top1: f64| {
                serde_json::json!({
                    "name": name, "sparse": true, "perplexity": ppl, "top1_agreement": top1,
                    "mass_recall": top1 - 0.01, "hit_rate": hot as f64 / 4000.0,
                    "device_bytes": 3 << 20, "bytes_per_step": 2048.0, "tokens_per_s": 40.0,
                    "hot_tokens": hot,
                    "config": { "hot_tokens": if explicit_hot { Some(hot) } else { None },
                                "algo": { "budget_tokens": budget } },
                })
            };
        serde_json::json!({
            "text": ["GPL-3"], "tokens": 4096, "prefill": 3584,
            "variants": [
                { "name": "dense", "sparse": false, "perplexity": 10.0 },
                variant("budget-1024", 1024, 2624, false, 10.05, 0.97),
                variant("budget-512", 512, 1600, false, 10.2, 0.93),
                variant("budget-512-hot-800", 512, 800, true, 10.2, 0.93),
            ],
        })
    }

    fn capacity() -> Value {
        let row = |ctx: u64| {
            serde_json::json!({
                "context": ctx,
                "dense": { "device_bytes": ctx << 17, "max_requests": (64u64 << 30) / (ctx << 17) },
                "variants": [{ "name": "quest-2048", "device_bytes": (ctx << 14) + (512 << 20),
                               "ratio": 2.0, "max_requests": 7 }],
            })
        };
        serde_json::json!({
            "shape": { "layers": 32, "q_heads": 32, "kv_heads": 8, "head_dim": 128 },
            "kv_bytes": 2, "device_budget": 64u64 << 30, "generate": 256,
            "rows": [row(4096), row(32768), row(131_072)],
        })
    }

    #[test]
    fn a_full_report_has_every_table_and_plot() {
        let dir = scratch("full");
        let means: BTreeMap<String, f64> = [
            ("decode/bf16/B1/L32768", 8e6),
            ("sparse_decode/bf16/B1/L32768", 1e6),
            ("decode/bf16/B1/L4096", 1e6),
            ("sparse_decode/bf16/B1/L4096", 5e5),
            ("decode/bf16/B8/L4096", 9e6),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        let md = write(
            &dir,
            &Inputs {
                means: &means,
                eval: Ok(eval()),
                capacity: Ok(capacity()),
                summary: "## Benchmarks\n",
            },
        )
        .expect("a report from valid inputs");
        // Contexts in numeric order, each with its speedup.
        let at = |s: &str| {
            md.find(s)
                .unwrap_or_else(|| panic!("{s:?} missing from\n{md}"))
        };
        assert!(
            at("| 4096 | 1.000 ms | 0.500 ms | 2.0× |")
                < at("| 32768 | 8.000 ms | 1.000 ms | 8.0× |")
        );
        // Variants by budget, then hot-buffer size; the dense perplexity is the reference.
        assert!(
            at("| budget-512-hot-800 | 512 | 800 | 1.0200 | 0.9300 | 0.9200 | 0.200 |")
                < at("| budget-512 | 512 | 1600 |")
        );
        at("| budget-1024 | 1024 | 2624 | 1.0050 |");
        at("| 32768 | 4096 | 16 | 1024 | 2.0 | 7 |");
        at("## Benchmarks");
        for png in ["speedup.png", "fidelity.png", "hit_rate.png", "memory.png"] {
            let bytes = std::fs::read(dir.join(png)).expect("the plot was written");
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{png}");
            at(&format!("({png})"));
        }
        assert_eq!(
            std::fs::read_to_string(dir.join("report.md")).ok(),
            Some(md)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn missing_inputs_are_named_not_filled() {
        let dir = scratch("missing");
        let md = write(
            &dir,
            &Inputs {
                means: &BTreeMap::new(),
                eval: Err("the model could not be fetched".to_owned()),
                capacity: Err("no capacity.json".to_owned()),
                summary: "",
            },
        )
        .expect("a report without inputs");
        assert!(
            md.contains("Not measured: the model could not be fetched"),
            "{md}"
        );
        assert!(md.contains("Not measured: no capacity.json"), "{md}");
        assert!(
            md.contains("no sweep results under target/criterion"),
            "{md}"
        );
        let pngs = std::fs::read_dir(&dir)
            .expect("the directory exists")
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "png"))
            })
            .count();
        assert_eq!(pngs, 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
