//! A fuzzer for the command-line tools: bad input must give a located error, never a panic,
//! a hang, output on stdout or an output file.
//!
//! Four parts, all deterministic for a seed, a module each (`ir`, `run_cases`, `diff`,
//! `artifacts`):
//! - **IR**: zoo models (single-device and localized) and the test suite's `.mlir` files,
//!   mutated (lines dropped, duplicated, swapped or spliced from another file; numbers,
//!   names and element types replaced; bytes inserted; the text cut short), go through
//!   `nnscaler-opt` with a pass pipeline (none, `--autodiff`, a full partitioning, ...).
//! - **run**: `nnscaler run` with mutated tensor files (cut, bytes flipped, dtypes, shapes,
//!   names and offsets changed, a tensor named twice) and mutated flags.
//! - **differential**: a random zoo model and plan; the partitioned program on simulated
//!   devices must give the single-device results, or both must fail on the same bad data
//!   (an out-of-range label), or the plan must be refused with a located error.
//! - **artifact**: compiled `.nnsx` artifacts (gpt-tiny's training step, the same in
//!   mixed precision on 2-byte buffers, and a pp2 x dp2 x tp2 1F1B pipeline), mutated (bytes
//!   flipped, the file cut short; and, the header's checksum made right, a header's
//!   numbers set to 0, 1, one off, times 64, 2^32, 2^52 or the largest u64, array entries
//!   dropped, repeated or swapped, flags flipped, names changed), run by `nnscaler-rt run`
//!   on the host backend: it must refuse what is wrong with a message, never corrupt
//!   memory, panic, abort or hang.
//!
//! Each process runs under a timeout. Every case checks: exit code 0 or 1 (no panic, no
//! signal), nothing on stdout when an output file is given, an output file exactly when the
//! command succeeded, and on failure a first line that locates the problem (`file:line:col`
//! or `file:` for the IR; a file, flag or function named for `run`).
//!
//! `cargo test` runs a bounded number of cases (`tools/tests/integration/fuzz.rs`); `nnscaler-fuzz`
//! runs longer campaigns.

use nnscaler_dialects::types::Elem;
use nnscaler_runtime::io;
use nnscaler_runtime::tensor::Tensor;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod artifacts;
mod diff;
mod ir;
mod run_cases;

use artifacts::*;
use diff::*;
use ir::*;
use run_cases::*;

pub use artifacts::mutate_artifact;
pub use ir::{mlir_files, mutate_text};

/// SplitMix64: small, fast and good enough to pick mutations.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn bits(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.bits() % n.max(1) as u64) as usize
    }

    /// One of `items`.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.bits() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Config {
    /// The `nnscaler-opt` binary.
    pub opt: PathBuf,
    /// The `nnscaler` binary.
    pub cli: PathBuf,
    /// Where cases write their files (emptied first).
    pub work: PathBuf,
    /// Extra seed corpus: `.mlir` files (the test suite's).
    pub corpus: Vec<PathBuf>,
    /// The campaign's seed.
    pub seed: u64,
    /// Cases of each part.
    pub ir_cases: usize,
    /// See [`Config::ir_cases`].
    pub run_cases: usize,
    /// See [`Config::ir_cases`].
    pub diff_cases: usize,
    /// See [`Config::ir_cases`].
    pub artifact_cases: usize,
    /// The `nnscaler-rt` binary (for the artifact cases).
    pub rt: PathBuf,
    /// Stop starting new cases after this long (the counts are then upper bounds).
    pub deadline: Option<Duration>,
    /// A process that runs longer than this is a hang.
    pub timeout: Duration,
}

/// A case that broke a rule.
#[derive(Clone, Debug)]
pub struct Failure {
    /// Which part and case (`ir 17`), and how to reproduce it.
    pub case: String,
    /// What was wrong.
    pub problem: String,
}

/// The outcome of a campaign.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Cases run, by part.
    pub ran: [usize; 4],
    /// Cases whose command succeeded, by part.
    pub succeeded: [usize; 4],
    /// Rule violations.
    pub failures: Vec<Failure>,
}

impl Report {
    /// One line: cases and outcomes per part.
    pub fn summary(&self) -> String {
        format!(
            "ir: {} cases ({} accepted); run: {} cases ({} succeeded); differential: {} cases ({} compared equal); artifact: {} cases ({} ran); {} failures",
            self.ran[0],
            self.succeeded[0],
            self.ran[1],
            self.succeeded[1],
            self.ran[2],
            self.succeeded[2],
            self.ran[3],
            self.succeeded[3],
            self.failures.len()
        )
    }
}

/// What a process did.
#[derive(Debug)]
struct Outcome {
    code: Option<i32>,
    stdout: Vec<u8>,
    stderr: String,
    timed_out: bool,
}

fn spawn(cmd: &mut Command, timeout: Duration) -> Outcome {
    let mut child = match cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("RUST_BACKTRACE", "0")
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            return Outcome {
                code: None,
                stdout: Vec::new(),
                stderr: format!("cannot start {cmd:?}: {e}"),
                timed_out: false,
            }
        }
    };
    let mut out = child.stdout.take();
    let mut err = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut o = Vec::new();
        if let Some(s) = out.as_mut() {
            let _ = s.read_to_end(&mut o);
        }
        o
    });
    let err_reader = std::thread::spawn(move || {
        let mut e = Vec::new();
        if let Some(s) = err.as_mut() {
            let _ = s.read_to_end(&mut e);
        }
        e
    });
    let start = Instant::now();
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if start.elapsed() > timeout => {
                timed_out = true;
                let _ = child.kill();
                break child.wait().ok();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(2)),
            Err(_) => break None,
        }
    };
    Outcome {
        code: status.and_then(|s| s.code()),
        stdout: reader.join().unwrap_or_default(),
        stderr: String::from_utf8_lossy(&err_reader.join().unwrap_or_default()).into_owned(),
        timed_out,
    }
}

/// The rules every command obeys; `output` is the file it was asked to write.
fn check_process(out: &Outcome, output: &Path) -> Result<bool, String> {
    if out.timed_out {
        return Err("hang: killed after the timeout".into());
    }
    if out.stderr.contains("panicked at") {
        return Err(format!("panic:\n{}", tail(&out.stderr)));
    }
    let code = out.code.ok_or_else(|| {
        if out.stderr.starts_with("cannot start") {
            out.stderr.clone() // the binary is missing (rebuilt during a campaign?)
        } else {
            format!("killed by a signal:\n{}", tail(&out.stderr))
        }
    })?;
    // With -o given, stdout holds nothing but, on success, one line saying what was done
    // and naming the output (nnscaler run's summary).
    let said = String::from_utf8_lossy(&out.stdout);
    let summary = code == 0
        && said.ends_with('\n')
        && said.lines().count() == 1
        && said.contains(&output.display().to_string());
    if !out.stdout.is_empty() && !summary {
        return Err(format!(
            "wrote {} bytes on stdout with -o given: {}",
            out.stdout.len(),
            tail(&said)
        ));
    }
    match code {
        0 => {
            if !output.exists() {
                return Err("succeeded without writing its output file".into());
            }
            Ok(true)
        }
        1 => {
            if output.exists() {
                return Err("failed but left an output file".into());
            }
            if out.stderr.trim().is_empty() {
                return Err("failed without a message".into());
            }
            Ok(false)
        }
        c => Err(format!("exit code {c}:\n{}", tail(&out.stderr))),
    }
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(12)..].join("\n")
}

/// Whether the first line of `stderr` is a diagnostic located in a file:
/// `path:line:col: error: ...` or `path: error: ...`.
fn located(stderr: &str) -> bool {
    let first = stderr.lines().next().unwrap_or("");
    let Some(pos) = first.find(": error: ") else {
        return false;
    };
    let loc = &first[..pos];
    if loc.is_empty() || loc.starts_with("nnscaler") {
        return false;
    }
    // `path` or `path:line:col` with numeric line and column.
    let parts: Vec<&str> = loc.rsplitn(3, ':').collect();
    match parts.as_slice() {
        [col, line, path] if !path.is_empty() => {
            (col.parse::<usize>().is_ok() && line.parse::<usize>().is_ok()) || !loc.contains(' ')
        }
        _ => !loc.contains(' '),
    }
}

/// Runs a campaign; `progress` is called after every case with the part (0..4) and the
/// report so far.
pub fn run(cfg: &Config, progress: &mut dyn FnMut(usize, &Report)) -> Result<Report, String> {
    let _ = std::fs::remove_dir_all(&cfg.work);
    std::fs::create_dir_all(&cfg.work)
        .map_err(|e| format!("cannot create {}: {e}", cfg.work.display()))?;
    let start = Instant::now();
    let out_of_time = || cfg.deadline.is_some_and(|d| start.elapsed() > d);
    let mut report = Report::default();
    let corpus = corpus(cfg)?;
    let mut rng = Rng::new(cfg.seed);
    let base = run_base(cfg, &mut rng)?;
    let arts = if cfg.artifact_cases > 0 {
        artifact_base(cfg)?
    } else {
        Vec::new()
    };
    // The parts interleave, so that a deadline leaves a share of each.
    let counts = [
        cfg.ir_cases,
        cfg.run_cases,
        cfg.diff_cases,
        cfg.artifact_cases,
    ];
    let total = counts.iter().copied().max().unwrap_or(0);
    for i in 0..total {
        for (part, &n) in counts.iter().enumerate() {
            // Spread each part's cases evenly over the campaign.
            if n == 0 || (i * n) / total == ((i + 1) * n) / total {
                continue;
            }
            if out_of_time() {
                return Ok(report);
            }
            let case = report.ran[part];
            let mut case_rng = Rng::new(cfg.seed ^ ((part as u64 + 1) << 56) ^ case as u64);
            let r = match part {
                0 => ir_case(cfg, &mut case_rng, &corpus, case),
                1 => run_case(cfg, &mut case_rng, &base, case),
                2 => diff_case(cfg, &mut case_rng, case),
                _ => artifact_case(cfg, &mut case_rng, &arts, case),
            };
            report.ran[part] += 1;
            match r {
                Ok(true) => report.succeeded[part] += 1,
                Ok(false) => {}
                Err(f) => report.failures.push(f),
            }
            progress(part, &report);
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_are_recognised() {
        assert!(located("a.mlir:3:7: error: bad\n"));
        assert!(located("/x/y.mlir: error: plan: no mesh"));
        assert!(!located("nnscaler-opt: error: bad"));
        assert!(!located("error: unexpected argument"));
        assert!(!located(""));
    }

    #[test]
    fn mutations_are_deterministic() {
        let text = "func.func @f(%a: tensor<2x3xf32>) {\n  return\n}\n";
        let a: Vec<String> = (0..20)
            .map(|i| mutate_text(&mut Rng::new(i), text, text))
            .collect();
        let b: Vec<String> = (0..20)
            .map(|i| mutate_text(&mut Rng::new(i), text, text))
            .collect();
        assert_eq!(a, b);
        assert!(a.iter().any(|m| m != text));
    }
}
