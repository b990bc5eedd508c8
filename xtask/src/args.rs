//! `cargo xtask`'s arguments: each command's checked into a [`Task`] before anything runs.

use std::path::PathBuf;

use crate::USAGE;

/// One command of `cargo xtask`, with its arguments checked.
#[derive(Debug, PartialEq)]
pub(crate) enum Task {
    /// The usage text (`help`, or `-h` / `--help` after any command but `demo`).
    Help,
    /// What CI runs.
    Ci,
    /// The README's test command.
    Test,
    /// The criterion benches, the peers and the engine's scenarios.
    Bench(BenchArgs),
    /// The report again from the results already measured.
    Report,
    /// The GPU report from the bundle's outputs in this folder.
    GpuReport(PathBuf),
    /// The real model's download.
    FetchModel,
    /// The main job, with these arguments for `hsa eval` (its `--help` among them).
    Demo(Vec<String>),
    /// The device bundle.
    Gpu,
}

/// `cargo xtask bench`'s options.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct BenchArgs {
    /// `--peers`: the peers under bench/peers/ too.
    pub(crate) peers: bool,
    /// `--skip-engine`: the criterion benches only.
    pub(crate) skip_engine: bool,
    /// What follows `--`: arguments for the bench binaries.
    pub(crate) criterion: Vec<String>,
}

/// The task `args` (the arguments after `cargo xtask`) ask for. An option a command does not
/// take is an error rather than something passed on: `bench --help` once ran cargo's help and
/// then every engine scenario, minutes of work that rewrote the report.
pub(crate) fn parse(args: &[String]) -> Result<Task, String> {
    let Some((command, rest)) = args.split_first() else {
        return Ok(Task::Help);
    };
    if command != "demo" && rest.iter().take_while(|a| *a != "--").any(|a| asks_help(a)) {
        return Ok(Task::Help);
    }
    let none = |task: Task| match rest.first() {
        None => Ok(task),
        Some(extra) => Err(format!(
            "`{command}` takes no arguments (got `{extra}`)\n\n{USAGE}"
        )),
    };
    match command.as_str() {
        "help" | "-h" | "--help" => Ok(Task::Help),
        "ci" => none(Task::Ci),
        "test" => none(Task::Test),
        "report" => none(Task::Report),
        "fetch-model" => none(Task::FetchModel),
        "gpu" => none(Task::Gpu),
        "demo" => Ok(Task::Demo(rest.to_vec())),
        "gpu-report" => match rest {
            [dir] => Ok(Task::GpuReport(PathBuf::from(dir))),
            _ => Err(format!(
                "gpu-report needs the bundle's output folder, and only it\n\n{USAGE}"
            )),
        },
        "bench" => {
            let split = rest.iter().position(|a| a == "--").unwrap_or(rest.len());
            let (options, criterion) = (&rest[..split], rest.get(split + 1..).unwrap_or(&[]));
            let mut bench = BenchArgs {
                criterion: criterion.to_vec(),
                ..BenchArgs::default()
            };
            let mut gpu = false;
            for option in options {
                match option.as_str() {
                    "--peers" => bench.peers = true,
                    "--skip-engine" => bench.skip_engine = true,
                    "--gpu" => gpu = true,
                    other => {
                        return Err(format!(
                            "`bench` takes --peers, --skip-engine and --gpu, and the bench binaries' arguments after `--` (got `{other}`)\n\n{USAGE}"
                        ));
                    }
                }
            }
            match (gpu, bench == BenchArgs::default()) {
                (false, _) => Ok(Task::Bench(bench)),
                (true, true) => Ok(Task::Gpu),
                (true, false) => Err(format!(
                    "`bench --gpu` builds the device bundle and takes no other option\n\n{USAGE}"
                )),
            }
        }
        other => Err(format!("unknown command `{other}`\n\n{USAGE}")),
    }
}

/// Whether an argument asks for help (`-h` or `--help`).
pub(crate) fn asks_help(arg: &str) -> bool {
    matches!(arg, "-h" | "--help")
}

#[cfg(test)]
mod tests {
    use super::{BenchArgs, Task, parse};

    /// Parses `line` (the words after `cargo xtask`) and checks the task or the error's start.
    fn check(line: &str, want: Result<Task, &str>) {
        let args: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
        match (parse(&args), want) {
            (Ok(got), Ok(want)) => assert_eq!(got, want, "`{line}`"),
            (Err(got), Err(want)) => assert!(got.starts_with(want), "`{line}`: {got}"),
            (got, want) => panic!("`{line}`: {got:?}, expected {want:?}"),
        }
    }

    fn bench(peers: bool, skip_engine: bool, criterion: &[&str]) -> Task {
        let criterion = criterion.iter().map(|&a| a.to_owned()).collect();
        Task::Bench(BenchArgs {
            peers,
            skip_engine,
            criterion,
        })
    }

    #[test]
    fn arguments_name_one_task_or_an_error() {
        check("", Ok(Task::Help));
        check("--help", Ok(Task::Help));
        check("ci", Ok(Task::Ci));
        check("ci --help", Ok(Task::Help));
        check("ci now", Err("`ci` takes no arguments (got `now`)"));
        check("gpu -h", Ok(Task::Help));
        check("gpu --fast", Err("`gpu` takes no arguments"));
        check("bench", Ok(bench(false, false, &[])));
        check("bench --help", Ok(Task::Help));
        check("bench --peers --skip-engine", Ok(bench(true, true, &[])));
        check(
            "bench -- --quick decode",
            Ok(bench(false, false, &["--quick", "decode"])),
        );
        check("bench -- --help", Ok(bench(false, false, &["--help"])));
        check("bench --peer", Err("`bench` takes --peers"));
        check("bench -p attn-op", Err("`bench` takes --peers"));
        check("bench --gpu", Ok(Task::Gpu));
        check(
            "bench --gpu --peers",
            Err("`bench --gpu` builds the device bundle"),
        );
        check("gpu-report out", Ok(Task::GpuReport("out".into())));
        check("gpu-report", Err("gpu-report needs"));
        check("gpu-report a b", Err("gpu-report needs"));
        check("demo --help", Ok(Task::Demo(vec!["--help".into()])));
        check(
            "demo --tokens 512",
            Ok(Task::Demo(vec!["--tokens".into(), "512".into()])),
        );
        check("benchmark", Err("unknown command `benchmark`"));
    }
}
