//! Part 3 of the fuzzer: a random plan against one device.

use super::*;

/// Whether the results agree: `|a - b| <= tol * max|a| + 1e-6` per tensor (the absolute
/// floor covers gradients that are sums of cancelling terms, such as a classifier bias's).
pub(super) fn allclose(a: &[io::Stored], b: &[io::Stored], tol: f64) -> Result<(), String> {
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

pub(super) fn diff_case(cfg: &Config, rng: &mut Rng, case: usize) -> Result<bool, Failure> {
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
