//! `nnscaler-fuzz`: longer fuzzing campaigns than the test suite's (see `nnscaler_tools::fuzz`).
//!
//! `cargo build -p nnscaler-tools && target/debug/nnscaler-fuzz --seconds 600 --seed 7`
//! (debug binaries: overflow checks on). Failing cases are printed with a command that
//! reproduces them; their files stay under `--work`.

use clap::Parser;
use nnscaler_tools::cli::{clap_exit, default_sigpipe};
use nnscaler_tools::fuzz::{self, Config};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "nnscaler-fuzz",
    version,
    about = "Fuzz nnscaler-opt, nnscaler run and nnscaler-rt run: mutated IR, tensor files, flags and artifacts, and random plans against one device"
)]
struct Cli {
    /// The campaign's seed (cases are deterministic for a seed).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Stop after this many seconds.
    #[arg(long, default_value_t = 300)]
    seconds: u64,
    /// Most mutated-IR cases.
    #[arg(long, default_value_t = 1_000_000)]
    ir: usize,
    /// Most `nnscaler run` cases.
    #[arg(long, default_value_t = 300_000)]
    run: usize,
    /// Most differential cases.
    #[arg(long, default_value_t = 50_000)]
    diff: usize,
    /// Most mutated-artifact cases (nnscaler-rt run; 0: none).
    #[arg(long, default_value_t = 300_000)]
    artifact: usize,
    /// Directory for the cases' files (emptied first).
    #[arg(long, default_value = "target/fuzz")]
    work: PathBuf,
    /// Directory of extra seed .mlir files (searched recursively), e.g. test/.
    #[arg(long)]
    corpus: Option<PathBuf>,
}

fn main() -> ExitCode {
    default_sigpipe();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => return clap_exit(e),
    };
    let bin = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from))
        .unwrap_or_default();
    let corpus = cli
        .corpus
        .as_deref()
        .map(fuzz::mlir_files)
        .unwrap_or_default();
    let cfg = Config {
        opt: bin.join("nnscaler-opt"),
        cli: bin.join("nnscaler"),
        work: cli.work.clone(),
        corpus,
        seed: cli.seed,
        ir_cases: cli.ir,
        run_cases: cli.run,
        diff_cases: cli.diff,
        artifact_cases: cli.artifact,
        rt: bin.join("nnscaler-rt"),
        deadline: Some(Duration::from_secs(cli.seconds)),
        timeout: Duration::from_secs(60),
    };
    let mut last = std::time::Instant::now();
    let report = fuzz::run(&cfg, &mut |_, r| {
        if last.elapsed() > Duration::from_secs(10) {
            eprintln!("nnscaler-fuzz: {}", r.summary());
            last = std::time::Instant::now();
        }
    });
    match report {
        Ok(r) => {
            for f in &r.failures {
                println!("FAIL {}\n  {}\n", f.case, f.problem.replace('\n', "\n  "));
            }
            println!("{}", r.summary());
            if r.failures.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("nnscaler-fuzz: error: {e}");
            ExitCode::FAILURE
        }
    }
}
