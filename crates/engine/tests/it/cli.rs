//! The `hsa` binary as a user meets it: bad numbers on the command line or in a config or
//! workload file end in one clear error line and a failing status, and a reader that closes
//! the pipe early ends it quietly.

use std::process::Command;

/// One run of `hsa` with `args`: whether it should succeed, and text its output (stdout and
/// stderr) must hold.
struct Case<'a> {
    args: &'a [&'a str],
    ok: bool,
    says: &'static str,
}

fn check(c: &Case<'_>) {
    let out = Command::new(env!("CARGO_BIN_EXE_hsa"))
        .args(c.args)
        .output()
        .expect("the test binary's sibling `hsa` runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() == c.ok
            && (stdout.contains(c.says) || stderr.contains(c.says))
            && !stderr.contains("panicked"),
        "hsa {:?}: status {}, expected ok = {} and {:?}\nstdout: {stdout}\nstderr: {stderr}",
        c.args,
        out.status,
        c.ok,
        c.says
    );
}

#[test]
fn numbers_on_the_command_line() {
    let cases = [
        Case {
            args: &["capacity", "--shape", "llama3-8b", "--device-gib", "2"],
            ok: true,
            says: "device budget 2.0 GiB",
        },
        // A negative or NaN budget used to become 0 bytes and a table of zeros.
        Case {
            args: &["capacity", "--shape", "llama3-8b", "--device-gib", "-3"],
            ok: false,
            says: "--device-gib -3: a budget is a finite number of GiB",
        },
        Case {
            args: &["capacity", "--shape", "llama3-8b", "--device-gib", "nan"],
            ok: false,
            says: "--device-gib NaN",
        },
        // A negative temperature reaches the sampler's check instead of clap's "unexpected
        // argument '-1'".
        Case {
            args: &[
                "--synthetic",
                "generate",
                "--prompt",
                "hi",
                "--temperature",
                "-1",
            ],
            ok: false,
            says: "temperature -1 (must be finite and ≥ 0)",
        },
        // Counts near `usize::MAX` used to overflow a sum and panic (debug builds) or wrap.
        Case {
            args: &[
                "--synthetic",
                "generate",
                "--prompt",
                "hi",
                "--max-tokens",
                "18446744073709551615",
            ],
            ok: false,
            says: "to generate exceed the limit",
        },
        Case {
            args: &[
                "capacity",
                "--shape",
                "llama3-8b",
                "--contexts",
                "18446744073709551615",
            ],
            ok: true,
            says: "18446744073709551615",
        },
        Case {
            args: &[
                "--synthetic",
                "eval",
                "--tokens",
                "64",
                "--prefill",
                "18446744073709551615",
            ],
            ok: false,
            says: "leaves nothing to decode",
        },
        // Values that gave tables of nonsense, or a run that filled the memory.
        Case {
            args: &["capacity", "--shape", "llama3-8b", "--contexts", "0"],
            ok: false,
            says: "a context holds at least one token",
        },
        Case {
            args: &["capacity", "--shape", "llama3-8b", "--kv-bytes", "0"],
            ok: false,
            says: "an element takes 1 to 8 bytes",
        },
        Case {
            args: &["--synthetic", "run", "--requests", "18446744073709551615"],
            ok: false,
            says: "at most 65536 requests",
        },
        Case {
            args: &[
                "--synthetic",
                "eval",
                "--passkey",
                "100",
                "--passkey-trials",
                "0",
            ],
            ok: false,
            says: "must be at least 1",
        },
    ];
    cases.iter().for_each(check);
}

#[test]
fn a_bad_engine_table_is_refused_by_every_command_that_sizes_blocks() {
    // `capacity` used to divide by the block size of 0 and panic.
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-block-size-0.toml");
    std::fs::write(&path, "[engine]\nblock_size = 0\n").expect("the target dir is writable");
    let config = path.to_str().expect("a UTF-8 target dir");
    for command in [
        &["capacity"][..],
        &["run", "--requests", "1", "--max-tokens", "1"],
    ] {
        let args: Vec<&str> = ["--synthetic", "--config", config]
            .into_iter()
            .chain(command.iter().copied())
            .collect();
        check(&Case {
            args: &args,
            ok: false,
            says: "block_size 0 (a power of two ≥ 2)",
        });
    }
}

/// Unix only: elsewhere `hsa` keeps Rust's default, and a closed pipe is an error.
#[cfg(unix)]
#[test]
fn a_closed_pipe_ends_it_quietly() {
    use std::os::unix::process::ExitStatusExt;
    // The pipe's read end is closed before `hsa` starts, so its first write finds no reader.
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_hsa"))
        .args(["capacity", "--shape", "llama3-8b"])
        .stdout(writer)
        .output()
        .expect("the test binary's sibling `hsa` runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // SIGPIPE is 13 on Linux and macOS.
    assert!(
        out.status.signal() == Some(13) && !stderr.contains("panicked"),
        "status {}, stderr: {stderr}",
        out.status
    );
}

#[test]
fn a_workload_past_the_request_limit_is_refused_before_its_prompts_are_cut() {
    // A count of 2^63 used to build requests until the memory ran out.
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-huge-count.toml");
    let workload = "[[request]]\nprompt = \"hello\"\ncount = 9223372036854775807\n";
    std::fs::write(&path, workload).expect("the target dir is writable");
    let file = path.to_str().expect("a UTF-8 target dir");
    check(&Case {
        args: &["--synthetic", "run", "--workload", file],
        ok: false,
        says: "a workload holds at most 65536 requests",
    });
}
