//! Part 1 of the fuzzer: mutated IR through `nnscaler-opt`.

use super::*;

pub(super) const NUMBERS: &[&str] = &[
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

pub(super) const WORDS: &[&str] = &[
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

pub(super) const PIPELINES: &[&[&str]] = &[
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
pub(super) fn numbers(s: &str) -> Vec<(usize, usize)> {
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
pub(super) fn localize(cfg: &Config, from: &Path, to: &Path) -> Result<(), String> {
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
pub(super) fn corpus(cfg: &Config) -> Result<Vec<(String, String)>, String> {
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

pub(super) fn ir_case(
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
