//! A fuzzer for the command-line tools: bad input must give a located error, never a panic,
//! a hang, output on stdout or an output file.
//!
//! Three parts, all deterministic for a seed:
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

// ---------------------------------------------------------------------------------------
// Part 1: mutated IR through nnscaler-opt.

const NUMBERS: &[&str] = &[
    "0",
    "1",
    "-1",
    "3",
    "7",
    "64",
    "2147483648",
    "1099511627776",
    "9223372036854775807",
    "99999999999999999999",
];

const WORDS: &[&str] = &[
    "dnn.matmul",
    "dnn.linear",
    "dnn.add",
    "dnn.reshape",
    "dnn.softmax",
    "dnn.cross_entropy",
    "dnn.embedding",
    "dnn.attention",
    "dnn.bogus",
    "nns.all_reduce",
    "nns.partition",
    "nns.relayout",
    "nns.mesh",
    "nns.name",
    "nns.param",
    "nns.layout",
    "nns.split",
    "nns.localized",
    "nns.init",
    "f32",
    "i64",
    "i32",
    "f16",
    "index",
    "tensor<?xf32>",
    "tensor<f32>",
    "#nns.layout<@world, dp = D(7)>",
    "#nns.split<zz = tp>",
    "\"normal(0, -1)\"",
    "unit",
    "@world",
    "@nowhere",
];

const PIPELINES: &[&[&str]] = &[
    &[],
    &["--autodiff"],
    &["--print-stats"],
    &["--canonicalize", "--cse"],
    &[
        "--autodiff",
        "--plan=dp dp=2",
        "--propagate-layouts",
        "--split-tensor",
        "--lower-relayouts",
        "--localize",
    ],
    &[
        "--autodiff",
        "--plan=dp-megatron dp=2 tp=2",
        "--propagate-layouts",
        "--split-tensor",
        "--lower-relayouts",
        "--localize",
        "--print-stats",
    ],
    &[
        "--plan=megatron tp=2",
        "--propagate-layouts",
        "--split-tensor",
    ],
    &[
        "--propagate-layouts",
        "--split-tensor",
        "--lower-relayouts",
        "--localize",
    ],
    &["--localize"],
    &[
        "--place=stages=2",
        "--autodiff",
        "--plan=dp dp=2 pp=2 microbatches=2",
        "--split-tensor",
        "--schedule-1f1b",
        "--lower-relayouts",
        "--localize",
    ],
    &[
        "--place=stages=2",
        "--autodiff",
        "--recompute=full",
        "--plan=megatron tp=2 pp=2 microbatches=2",
        "--propagate-layouts",
        "--split-tensor",
        "--schedule-zb-h1",
    ],
];

/// Positions and lengths of the decimal numbers in `s`.
fn numbers(s: &str) -> Vec<(usize, usize)> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() {
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            out.push((start, i - start));
        } else {
            i += 1;
        }
    }
    out
}

/// One random mutation of `text`; `other` is another corpus text for splicing.
pub fn mutate_text(rng: &mut Rng, text: &str, other: &str) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    if lines.is_empty() {
        lines.push(String::new());
    }
    let n = lines.len();
    match rng.below(10) {
        0 => {
            lines.remove(rng.below(n));
        }
        1 => {
            let i = rng.below(n);
            let l = lines[i].clone();
            lines.insert(rng.below(n + 1), l);
        }
        2 => {
            let (i, j) = (rng.below(n), rng.below(n));
            lines.swap(i, j);
        }
        3 => {
            let others: Vec<&str> = other.lines().collect();
            if !others.is_empty() {
                let l = others[rng.below(others.len())].to_string();
                lines.insert(rng.below(n + 1), l);
            }
        }
        4 | 5 => {
            let joined = lines.join("\n");
            let nums = numbers(&joined);
            if nums.is_empty() {
                return joined;
            }
            let (at, len) = nums[rng.below(nums.len())];
            return format!(
                "{}{}{}",
                &joined[..at],
                rng.pick(NUMBERS),
                &joined[at + len..]
            );
        }
        6 => {
            // Replace a word-like token with another from the vocabulary.
            let i = rng.below(n);
            let words: Vec<&str> = lines[i]
                .split(|c: char| !(c.is_alphanumeric() || c == '.' || c == '_'))
                .filter(|w| w.len() > 2)
                .collect();
            if !words.is_empty() {
                let w = words[rng.below(words.len())].to_string();
                lines[i] = lines[i].replacen(&w, rng.pick::<&str>(WORDS), 1);
            }
        }
        7 => {
            let joined = lines.join("\n");
            let mut at = rng.below(joined.len() + 1);
            while !joined.is_char_boundary(at) {
                at -= 1;
            }
            return joined[..at].to_string();
        }
        8 => {
            let joined = lines.join("\n");
            let mut at = rng.below(joined.len() + 1);
            while !joined.is_char_boundary(at) {
                at -= 1;
            }
            let c = *rng.pick(&[
                "{", "}", "(", ")", "<", ">", "[", "]", ",", ":", "%", "\"", "=", "@", "#", "x",
                " ", "\n", "\0", "é",
            ]);
            return format!("{}{c}{}", &joined[..at], &joined[at..]);
        }
        _ => {
            // Element types and splits: where partitioning and the runtime get interesting.
            let joined = lines.join("\n");
            let (from, to) = *rng.pick(&[
                ("f32", "i64"),
                ("i64", "f32"),
                ("dp = D(0)", "dp = D(1)"),
                ("tp = D(0)", "tp = V(sum)"),
                ("nns.param", "nns.name = \"dup\""),
                ("\"loss\"", "\"x\""),
                ("dp = 2", "dp = 3"),
                ("causal = true", "causal = 7"),
            ]);
            return joined.replacen(from, to, 1);
        }
    }
    lines.join("\n")
}

/// Differentiates `from` and partitions it over a dp x tp mesh of 2 x 2 into `to`.
fn localize(cfg: &Config, from: &Path, to: &Path) -> Result<(), String> {
    let o = spawn(
        Command::new(&cfg.opt)
            .args(PIPELINES[5])
            .arg(from)
            .arg("-o")
            .arg(to),
        cfg.timeout,
    );
    match o.code {
        Some(0) => Ok(()),
        _ => Err(format!("cannot partition {}: {}", from.display(), o.stderr)),
    }
}

/// The `.mlir` files under `dir`, recursively, sorted (lit's `Output` folders skipped).
pub fn mlir_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for p in entries.flatten().map(|e| e.path()) {
            if p.is_dir() && p.file_name().is_some_and(|n| n != "Output") {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "mlir") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The seed corpus: zoo models, single-device and partitioned, and the given files.
fn corpus(cfg: &Config) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let work = cfg.work.join("corpus");
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    for (name, args) in [
        ("mlp", vec!["import", "--preset", "mlp-tiny"]),
        (
            "gpt",
            vec!["import", "--preset", "gpt-tiny", "--batch", "4"],
        ),
        ("llama", vec!["import", "--preset", "llama-tiny"]),
    ] {
        let path = work.join(format!("{name}.mlir"));
        let o = spawn(
            Command::new(&cfg.cli).args(&args).arg("-o").arg(&path),
            cfg.timeout,
        );
        if o.code != Some(0) {
            return Err(format!("cannot build the corpus: {}", o.stderr));
        }
        let local = work.join(format!("{name}-local.mlir"));
        localize(cfg, &path, &local)?;
        for p in [path, local] {
            if let Ok(t) = std::fs::read_to_string(&p) {
                out.push((p.display().to_string(), t));
            }
        }
    }
    for p in &cfg.corpus {
        if let Ok(t) = std::fs::read_to_string(p) {
            out.push((p.display().to_string(), t));
        }
    }
    Ok(out)
}

fn ir_case(
    cfg: &Config,
    rng: &mut Rng,
    corpus: &[(String, String)],
    case: usize,
) -> Result<bool, Failure> {
    let (name, text) = rng.pick(corpus);
    let (_, other) = rng.pick(corpus);
    let mut mutated = mutate_text(rng, text, other);
    if rng.chance(0.5) {
        mutated = mutate_text(rng, &mutated, other);
    }
    let pipeline = *rng.pick(PIPELINES);
    let input = cfg.work.join(format!("ir-{case}.mlir"));
    let output = cfg.work.join(format!("ir-{case}.out.mlir"));
    let fail = |problem: String| Failure {
        case: format!(
            "ir case {case} (from {name}): nnscaler-opt {} {} -o {}",
            pipeline
                .iter()
                .map(|a| format!("'{a}'"))
                .collect::<Vec<_>>()
                .join(" "),
            input.display(),
            output.display()
        ),
        problem,
    };
    std::fs::write(&input, &mutated).map_err(|e| fail(e.to_string()))?;
    let o = spawn(
        Command::new(&cfg.opt)
            .args(pipeline)
            .arg(&input)
            .arg("-o")
            .arg(&output),
        cfg.timeout,
    );
    let ok = check_process(&o, &output).map_err(&fail)?;
    if !ok && !located(&o.stderr) {
        return Err(fail(format!(
            "the error is not located in a file:\n{}",
            tail(&o.stderr)
        )));
    }
    let _ = std::fs::remove_file(&output);
    let _ = std::fs::remove_file(&input);
    Ok(ok)
}

// ---------------------------------------------------------------------------------------
// Part 2: nnscaler run with mutated tensor files and flags.

/// Random inputs for `model` made by `nnscaler import`: floats N(0, 1), integers in
/// `0..classes` (but for one, `classes + 40`, when `bad` is set), written as safetensors.
fn random_inputs(model: &Path, classes: i64, bad: bool, rng: &mut Rng) -> Result<Vec<u8>, String> {
    use nnscaler_dialects::context::IrContext;
    use nnscaler_dialects::graph::Graph;
    let text = std::fs::read_to_string(model).map_err(|e| e.to_string())?;
    let ir = IrContext::new();
    let m = ir.parse(&text, "model").map_err(|d| d.to_string())?;
    let g = Graph::all_in(&m)
        .into_iter()
        .next()
        .ok_or("no function")?
        .map_err(|e| e.message)?;
    let mut tensors: Vec<(String, Elem, Tensor)> = Vec::new();
    for a in g.args.iter().filter(|a| !a.is_param()) {
        let ty = &g.values[a.value];
        let shape: Vec<usize> = ty.shape.iter().map(|&d| d as usize).collect();
        let n: usize = shape.iter().product();
        let t = if ty.elem == Elem::F32 {
            let seed = rng.bits();
            Tensor::f32(
                &shape,
                (0..n)
                    .map(|i| nnscaler_runtime::rng::normal(seed, 0, i as u64) as f32)
                    .collect(),
            )
        } else {
            let mut v: Vec<i64> = (0..n).map(|_| rng.below(classes as usize) as i64).collect();
            if bad && a.name().is_some_and(|n| n == "labels" || n == "targets") {
                let i = rng.below(n);
                v[i] = classes + 40;
            }
            Tensor::i64(&shape, v)
        };
        tensors.push((a.name().unwrap_or("").to_string(), ty.elem, t));
    }
    let named: Vec<(String, Elem, &Tensor)> =
        tensors.iter().map(|(n, e, t)| (n.clone(), *e, t)).collect();
    io::to_bytes(&named)
}

/// One random mutation of a safetensors file.
fn mutate_tensors(rng: &mut Rng, bytes: &[u8]) -> Vec<u8> {
    let header_len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize)
        .unwrap_or(0)
        .min(bytes.len().saturating_sub(8));
    let header = String::from_utf8_lossy(&bytes[8..8 + header_len]).into_owned();
    let data = &bytes[8 + header_len..];
    let rebuild = |h: &str| {
        let mut v = (h.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(h.as_bytes());
        v.extend_from_slice(data);
        v
    };
    match rng.below(8) {
        0 => bytes[..rng.below(bytes.len() + 1)].to_vec(),
        1 => {
            let mut v = bytes.to_vec();
            let i = rng.below(v.len().max(1));
            if let Some(b) = v.get_mut(i) {
                *b ^= 1 << rng.below(8);
            }
            v
        }
        2 => rebuild(&header.replacen(
            "\"F32\"",
            rng.pick::<&str>(&["\"F64\"", "\"I8\"", "\"BOGUS\"", "\"I64\""]),
            1,
        )),
        3 => {
            let nums = numbers(&header);
            if nums.is_empty() {
                return bytes.to_vec();
            }
            let (at, len) = nums[rng.below(nums.len())];
            rebuild(&format!(
                "{}{}{}",
                &header[..at],
                rng.pick(NUMBERS),
                &header[at + len..]
            ))
        }
        4 => {
            // Name the first tensor twice.
            match (header.find(":{"), header.find("},")) {
                (Some(a), Some(b)) if a < b && header.starts_with('{') => {
                    let entry = &header[1..=b];
                    rebuild(&format!("{{{entry},{}", &header[1..]))
                }
                _ => bytes.to_vec(),
            }
        }
        5 => rebuild(
            &header
                .replacen("\"x\"", "\"y\"", 1)
                .replacen("\"tokens\"", "\"t\"", 1),
        ),
        6 => Vec::new(),
        _ => {
            let mut v = bytes.to_vec();
            v.truncate(v.len().saturating_sub(1 + rng.below(16)));
            v
        }
    }
}

fn run_case(cfg: &Config, rng: &mut Rng, base: &RunBase, case: usize) -> Result<bool, Failure> {
    let dir = cfg.work.join(format!("run-{case}"));
    let _ = std::fs::create_dir_all(&dir);
    let local = rng.chance(0.4);
    let model = if local { &base.local } else { &base.model };
    let mut inputs = base.inputs.clone();
    let mut params = base.params.clone();
    let what = rng.below(4);
    match what {
        0 => inputs = mutate_tensors(rng, &inputs),
        1 => params = mutate_tensors(rng, &params),
        _ => {}
    }
    let in_path = dir.join("in.safetensors");
    let p_path = dir.join("params.safetensors");
    let out = dir.join("out.safetensors");
    let saved = dir.join("saved.safetensors");
    let write = |p: &Path, b: &[u8]| std::fs::write(p, b);
    let _ = write(&in_path, &inputs);
    let _ = write(&p_path, &params);
    let mut args: Vec<String> = vec![
        "run".into(),
        model.display().to_string(),
        "--inputs".into(),
        in_path.display().to_string(),
    ];
    if rng.chance(0.5) {
        args.extend(["--params".into(), p_path.display().to_string()]);
    } else {
        args.extend(["--init-seed".into(), rng.below(5).to_string()]);
    }
    args.extend(["-o".into(), out.display().to_string()]);
    if what >= 2 {
        // Flag mutations.
        let extra: &[&[&str]] = &[
            &["--devices", "4"],
            &["--devices", "3"],
            &["--devices", "0"],
            &["--threads", "0"],
            &["--threads", "2"],
            &["--func", "bogus"],
            &["--autodiff"],
            &["--check-finite"],
            &["--init-seed", "-1"],
            &["--memory-limit", "1K"],
            &["--memory-limit", "0"],
            &["--save-params"],
            &["--error-limit", "x"],
            &["--inputs"],
        ];
        let e = rng.pick(extra);
        args.extend(e.iter().map(|s| s.to_string()));
        if e == &["--save-params"] || rng.chance(0.2) {
            args.extend(["--save-params".into(), saved.display().to_string()]);
        }
        if rng.chance(0.3) && args.len() > 4 {
            let i = 2 + rng.below(args.len() - 2);
            args.remove(i);
        }
    }
    let fail = |problem: String| Failure {
        case: format!("run case {case}: nnscaler {}", args.join(" ")),
        problem,
    };
    let o = spawn(Command::new(&cfg.cli).args(&args), cfg.timeout);
    let ok = check_process(&o, &out).map_err(&fail)?;
    if !ok {
        if saved.exists() {
            return Err(fail("failed but wrote --save-params".into()));
        }
        let first = o.stderr.lines().next().unwrap_or("");
        let names_something = first.starts_with("error: ") // a usage error, from clap
            || [&in_path, &p_path, model, &out, &saved].iter().any(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| first.contains(n))
            })
            || first.contains("--")
            || first.contains('@');
        if !first.starts_with("nnscaler: error: ") && !first.starts_with("error: ")
            || !names_something
        {
            return Err(fail(format!(
                "the error names no file, flag or function:\n{}",
                tail(&o.stderr)
            )));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ok)
}

/// The files `run` cases start from.
struct RunBase {
    model: PathBuf,
    local: PathBuf,
    inputs: Vec<u8>,
    params: Vec<u8>,
}

fn run_base(cfg: &Config, rng: &mut Rng) -> Result<RunBase, String> {
    let dir = cfg.work.join("run-base");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let model = dir.join("mlp.mlir");
    let local = dir.join("mlp-local.mlir");
    let params = dir.join("params.safetensors");
    let o = spawn(
        Command::new(&cfg.cli)
            .args(["import", "--preset", "mlp-tiny", "-o"])
            .arg(&model),
        cfg.timeout,
    );
    if o.code != Some(0) {
        return Err(o.stderr);
    }
    localize(cfg, &model, &local)?;
    let inputs = random_inputs(&model, 10, false, rng)?;
    let in_path = dir.join("in.safetensors");
    std::fs::write(&in_path, &inputs).map_err(|e| e.to_string())?;
    let o = spawn(
        Command::new(&cfg.cli)
            .arg("run")
            .arg(&model)
            .arg("--inputs")
            .arg(&in_path)
            .args(["--init-seed", "3", "--save-params"])
            .arg(&params)
            .arg("-o")
            .arg(dir.join("out.safetensors")),
        cfg.timeout,
    );
    if o.code != Some(0) {
        return Err(o.stderr);
    }
    Ok(RunBase {
        model,
        local,
        inputs,
        params: std::fs::read(&params).map_err(|e| e.to_string())?,
    })
}

// ---------------------------------------------------------------------------------------
// Part 3: random plan against one device.

/// Whether the results agree: `|a - b| <= tol * max|a| + 1e-6` per tensor (the absolute
/// floor covers gradients that are sums of cancelling terms, such as a classifier bias's).
fn allclose(a: &[io::Stored], b: &[io::Stored], tol: f64) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("{} results against {}", a.len(), b.len()));
    }
    for (x, y) in a.iter().zip(b) {
        if x.name != y.name || x.tensor.shape != y.tensor.shape {
            return Err(format!("result '{}' against '{}'", x.name, y.name));
        }
        let (Ok(u), Ok(v)) = (x.tensor.f(), y.tensor.f()) else {
            if x.tensor != y.tensor {
                return Err(format!("'{}' differs", x.name));
            }
            continue;
        };
        let scale = u.iter().fold(0f32, |m, z| m.max(z.abs())).max(1e-6) as f64;
        for (i, (p, q)) in u.iter().zip(v).enumerate() {
            let d = (f64::from(*p) - f64::from(*q)).abs();
            if d.is_nan() || d > tol * scale + 1e-6 {
                return Err(format!(
                    "'{}' element {i}: {p} on one device, {q} partitioned",
                    x.name
                ));
            }
        }
    }
    Ok(())
}

fn diff_case(cfg: &Config, rng: &mut Rng, case: usize) -> Result<bool, Failure> {
    let dir = cfg.work.join(format!("diff-{case}"));
    let _ = std::fs::create_dir_all(&dir);
    let (import, classes): (Vec<String>, i64) = match rng.below(3) {
        0 => {
            let classes = *rng.pick(&[4i64, 6, 8, 10]);
            (
                format!(
                    "import mlp --batch {} --hidden {} --layers {} --classes {classes} --inputs 8",
                    rng.pick(&[4, 8]),
                    rng.pick(&[8, 16]),
                    1 + rng.below(2)
                )
                .split(' ')
                .map(str::to_string)
                .collect(),
                classes,
            )
        }
        1 => {
            let vocab = *rng.pick(&[8i64, 12]);
            (
                format!(
                    "import gpt --preset gpt-tiny --batch 4 --heads {} --vocab {vocab}",
                    rng.pick(&[2, 4])
                )
                .split(' ')
                .map(str::to_string)
                .collect(),
                vocab,
            )
        }
        _ => (
            "import llama --preset llama-tiny --batch 4 --heads 4 --kv-heads 2 --vocab 12"
                .split(' ')
                .map(str::to_string)
                .collect(),
            12,
        ),
    };
    let plan = *rng.pick(&[
        "dp dp=2",
        "dp dp=4",
        "megatron tp=2",
        "megatron tp=4",
        "dp-megatron dp=2 tp=2",
        "megatron-sp tp=2",
        "megatron tp=3",
    ]);
    // Half the cases pipeline the plan too: 2 stages, 2 micro-batches, a random schedule
    // and recompute policy.
    let pipelined = rng.chance(0.5);
    let schedule = *rng.pick(&["gpipe", "1f1b", "zb-h1"]);
    let recompute = *rng.pick(&["", "full", "selective"]);
    let plan = if pipelined {
        format!("{plan} pp=2 microbatches=2")
    } else {
        plan.to_string()
    };
    let plan = plan.as_str();
    let mut steps: Vec<String> = Vec::new();
    if pipelined {
        steps.push("--place=stages=2".into());
    }
    steps.push("--autodiff".into());
    if pipelined && !recompute.is_empty() {
        steps.push(format!("--recompute={recompute}"));
    }
    steps.push(format!("--plan={plan}"));
    steps.push("--propagate-layouts".into());
    steps.push("--split-tensor".into());
    if pipelined {
        steps.push(format!("--schedule-{schedule}"));
    }
    steps.push("--lower-relayouts".into());
    steps.push("--localize".into());
    let model = dir.join("model.mlir");
    let single = dir.join("single.mlir");
    let part = dir.join("part.mlir");
    let inputs = dir.join("in.safetensors");
    let (one, many) = (dir.join("one.safetensors"), dir.join("many.safetensors"));
    let seed = rng.below(100).to_string();
    let fail = |problem: String| {
        Failure {
        case: format!(
            "differential case {case}: nnscaler {} -o {}; nnscaler-opt {}; nnscaler run --init-seed {seed} (files in {})",
            import.join(" "),
            model.display(),
            steps.join(" "),
            dir.display()
        ),
        problem,
    }
    };
    let o = spawn(
        Command::new(&cfg.cli).args(&import).arg("-o").arg(&model),
        cfg.timeout,
    );
    check_process(&o, &model).map_err(&fail)?;
    let o = spawn(
        Command::new(&cfg.opt)
            .arg("--autodiff")
            .arg(&model)
            .arg("-o")
            .arg(&single),
        cfg.timeout,
    );
    check_process(&o, &single).map_err(&fail)?;
    let o = spawn(
        Command::new(&cfg.opt)
            .args(&steps)
            .arg(&model)
            .arg("-o")
            .arg(&part),
        cfg.timeout,
    );
    let planned = check_process(&o, &part).map_err(&fail)?;
    if !planned {
        // A plan the model cannot take is refused with a located error.
        if !located(&o.stderr) {
            return Err(fail(format!(
                "the plan's error is not located:\n{}",
                tail(&o.stderr)
            )));
        }
        let _ = std::fs::remove_dir_all(&dir);
        return Ok(false);
    }
    let bad_label = rng.chance(0.2);
    let bytes = random_inputs(&model, classes, bad_label, rng).map_err(&fail)?;
    std::fs::write(&inputs, &bytes).map_err(|e| fail(e.to_string()))?;
    let run = |prog: &Path, out: &Path| {
        spawn(
            Command::new(&cfg.cli)
                .arg("run")
                .arg(prog)
                .arg("--inputs")
                .arg(&inputs)
                .args(["--init-seed", &seed])
                .arg("-o")
                .arg(out),
            cfg.timeout,
        )
    };
    let (a, b) = (run(&single, &one), run(&part, &many));
    let ok_a = check_process(&a, &one).map_err(&fail)?;
    let ok_b = check_process(&b, &many).map_err(&fail)?;
    let result = match (ok_a, ok_b) {
        (true, true) => {
            let x = io::load(&one).map_err(&fail)?;
            let y = io::load(&many).map_err(&fail)?;
            allclose(&x, &y, 1e-4).map_err(&fail)?;
            if bad_label {
                return Err(fail(
                    "an out-of-range label gave results on one device and partitioned".into(),
                ));
            }
            Ok(true)
        }
        (false, false) => {
            let same = a.stderr.contains("is outside") && b.stderr.contains("is outside");
            if !same {
                return Err(fail(format!(
                    "both failed, differently:\none device: {}\npartitioned: {}",
                    tail(&a.stderr),
                    tail(&b.stderr)
                )));
            }
            Ok(false)
        }
        (true, false) => Err(fail(format!(
            "one device succeeded, partitioned failed:\n{}",
            tail(&b.stderr)
        ))),
        (false, true) => Err(fail(format!(
            "partitioned succeeded, one device failed:\n{}",
            tail(&a.stderr)
        ))),
    };
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// Part 4: mutated artifacts through nnscaler-rt.

/// A compiled artifact and the tensor files it runs on.
struct ArtBase {
    name: String,
    bytes: Vec<u8>,
    inputs: Vec<PathBuf>,
}

/// Runs `args` of binary `bin` in `dir`, or says why it failed.
fn step(bin: &Path, dir: &Path, args: &[&str], timeout: Duration) -> Result<(), String> {
    let o = spawn(Command::new(bin).current_dir(dir).args(args), timeout);
    if o.code == Some(0) {
        Ok(())
    } else {
        Err(format!(
            "{} {}: {}",
            bin.display(),
            args.join(" "),
            tail(&o.stderr)
        ))
    }
}

/// The artifacts the artifact cases mutate: gpt-tiny's training step, in f32 and in mixed
/// precision, and a pp2 x dp2 x tp2 1F1B pipeline, with their batches and parameters.
fn artifact_base(cfg: &Config) -> Result<Vec<ArtBase>, String> {
    let dir = cfg.work.join("artifact-base");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let t = cfg.timeout;
    let (cli, opt) = (&cfg.cli, &cfg.opt);
    step(
        cli,
        &dir,
        &[
            "import", "gpt", "--preset", "gpt-tiny", "--batch", "4", "--heads", "2", "-o",
            "gpt.mlir",
        ],
        t,
    )?;
    step(opt, &dir, &["--autodiff", "gpt.mlir", "-o", "step.mlir"], t)?;
    step(
        opt,
        &dir,
        &[
            "--autocast=bf16",
            "--autodiff",
            "gpt.mlir",
            "-o",
            "bf16.mlir",
        ],
        t,
    )?;
    step(
        cli,
        &dir,
        &[
            "import",
            "gpt",
            "--preset",
            "gpt-tiny",
            "--batch",
            "8",
            "--heads",
            "4",
            "-o",
            "gpt8.mlir",
        ],
        t,
    )?;
    step(
        opt,
        &dir,
        &["--autodiff", "gpt8.mlir", "-o", "gpt8-step.mlir"],
        t,
    )?;
    step(
        opt,
        &dir,
        &[
            "--place=stages=2",
            "--autodiff",
            "--plan=dp-megatron dp=2 tp=2 pp=2 microbatches=4",
            "--split-tensor",
            "--schedule-1f1b",
            "--lower-relayouts",
            "--localize",
            "gpt8.mlir",
            "-o",
            "pp.mlir",
        ],
        t,
    )?;
    let mut out = Vec::new();
    for (name, model, whole) in [
        ("step", "step.mlir", "step.mlir"),
        ("bf16", "bf16.mlir", "step.mlir"),
        ("pp", "pp.mlir", "gpt8-step.mlir"),
    ] {
        let art = format!("{name}.nnsx");
        let (ins, params) = (
            format!("{name}.in.safetensors"),
            format!("{name}.p.safetensors"),
        );
        step(cli, &dir, &["compile", model, "-o", &art], t)?;
        step(cli, &dir, &["data", "random", whole, "-o", &ins], t)?;
        let want = format!("{name}.want.safetensors");
        step(
            cli,
            &dir,
            &[
                "run",
                whole,
                "--inputs",
                &ins,
                "--init-seed",
                "1",
                "--save-params",
                &params,
                "-o",
                &want,
            ],
            t,
        )?;
        out.push(ArtBase {
            name: name.into(),
            bytes: std::fs::read(dir.join(&art)).map_err(|e| e.to_string())?,
            inputs: vec![dir.join(ins), dir.join(params)],
        });
    }
    Ok(out)
}

/// The JSON pointers of `v`'s numbers, arrays, booleans and strings.
fn leaves(v: &serde_json::Value, at: String, out: &mut Vec<(String, u8)>) {
    use serde_json::Value;
    match v {
        Value::Number(_) => out.push((at, b'n')),
        Value::Bool(_) => out.push((at, b'b')),
        Value::String(_) => out.push((at, b's')),
        Value::Array(a) => {
            out.push((at.clone(), b'a'));
            for (i, x) in a.iter().enumerate() {
                leaves(x, format!("{at}/{i}"), out);
            }
        }
        Value::Object(o) => {
            for (k, x) in o {
                leaves(
                    x,
                    format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        Value::Null => {}
    }
}

/// An artifact's bytes with its header replaced by `header` (its length and checksum made
/// right; the sections as they were).
fn with_header(bytes: &[u8], header: &[u8]) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[8..16].try_into().unwrap_or([0; 8])) as usize;
    let rest = bytes.get(24 + n..).unwrap_or(&[]);
    let mut v = bytes[..8].to_vec();
    v.extend_from_slice(&(header.len() as u64).to_le_bytes());
    v.extend_from_slice(&nnscaler_rt::artifact::fnv1a64(header).to_le_bytes());
    v.extend_from_slice(header);
    v.extend_from_slice(rest);
    v
}

/// A mutation of a (well-formed) artifact, and what it was.
pub fn mutate_artifact(rng: &mut Rng, bytes: &[u8]) -> (Vec<u8>, String) {
    use serde_json::Value;
    let n = u64::from_le_bytes(bytes[8..16].try_into().unwrap_or([0; 8])) as usize;
    match rng.below(10) {
        0 => {
            let mut v = bytes.to_vec();
            let k = 1 + rng.below(8);
            for _ in 0..k {
                let i = 4 + rng.below(v.len() - 4);
                v[i] ^= 1 << rng.below(8);
            }
            (v, format!("{k} bits flipped"))
        }
        1 => {
            let cut = rng.below(bytes.len());
            (bytes[..cut].to_vec(), format!("cut at byte {cut}"))
        }
        _ => {
            let Ok(mut h) = serde_json::from_slice::<Value>(&bytes[24..24 + n]) else {
                return (bytes.to_vec(), "unchanged".into());
            };
            let mut what = Vec::new();
            for _ in 0..1 + rng.below(3) {
                let mut ls = Vec::new();
                leaves(&h, String::new(), &mut ls);
                if ls.is_empty() {
                    break;
                }
                let (at, kind) = rng.pick(&ls).clone();
                let Some(x) = h.pointer_mut(&at) else {
                    continue;
                };
                match kind {
                    b'n' => {
                        let old = x.as_u64().unwrap_or(0);
                        let new = *rng.pick(&[
                            0,
                            1,
                            old.wrapping_add(1),
                            old.saturating_sub(1),
                            old.saturating_mul(64),
                            old.saturating_mul(1 << 20),
                            1 << 32,
                            1 << 52,
                            u64::MAX,
                        ]);
                        *x = Value::from(new);
                        what.push(format!("{at} = {new}"));
                    }
                    b'b' => {
                        let b = x.as_bool().unwrap_or(false);
                        *x = Value::Bool(!b);
                        what.push(format!("{at} = {}", !b));
                    }
                    b's' => {
                        let s = x.as_str().unwrap_or("").to_string();
                        *x = Value::String(format!("{s}x"));
                        what.push(format!("{at} += 'x'"));
                    }
                    _ => {
                        if let Value::Array(a) = x {
                            if a.is_empty() {
                                continue;
                            }
                            let i = rng.below(a.len());
                            match rng.below(3) {
                                0 => {
                                    a.remove(i);
                                    what.push(format!("{at}/{i} removed"));
                                }
                                1 => {
                                    let e = a[i].clone();
                                    a.insert(i, e);
                                    what.push(format!("{at}/{i} repeated"));
                                }
                                _ => {
                                    let j = rng.below(a.len());
                                    a.swap(i, j);
                                    what.push(format!("{at}/{i} and /{j} swapped"));
                                }
                            }
                        }
                    }
                }
            }
            let header = serde_json::to_vec(&h).unwrap_or_default();
            (with_header(bytes, &header), what.join(", "))
        }
    }
}

fn artifact_case(
    cfg: &Config,
    rng: &mut Rng,
    arts: &[ArtBase],
    case: usize,
) -> Result<bool, Failure> {
    let base = rng.pick(arts);
    let (bytes, what) = mutate_artifact(rng, &base.bytes);
    let dir = cfg.work.join(format!("artifact-{case}"));
    let _ = std::fs::create_dir_all(&dir);
    let art = dir.join(format!("{}.nnsx", base.name));
    let out = dir.join("out.safetensors");
    let _ = std::fs::write(&art, &bytes);
    let mut args: Vec<String> = vec!["run".into(), art.display().to_string()];
    for f in &base.inputs {
        args.extend(["--inputs".into(), f.display().to_string()]);
    }
    if rng.chance(0.3) {
        args.push("--ranks".into());
    }
    args.extend(["-o".into(), out.display().to_string()]);
    let fail = |problem: String| Failure {
        case: format!(
            "artifact case {case} ({} mutated: {what}): nnscaler-rt {}",
            base.name,
            args.join(" ")
        ),
        problem,
    };
    let mut o = spawn(Command::new(&cfg.rt).args(&args), cfg.timeout);
    // nnscaler-rt reports a run on stdout (what it ran, in how long): not a rule here.
    o.stdout.clear();
    let ok = check_process(&o, &out).map_err(&fail)?;
    if !ok && !o.stderr.starts_with("nnscaler-rt: error: ") {
        return Err(fail(format!(
            "the error is not nnscaler-rt's:
{}",
            tail(&o.stderr)
        )));
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ok)
}

// ---------------------------------------------------------------------------------------

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
