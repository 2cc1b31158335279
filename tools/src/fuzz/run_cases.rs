//! Part 2 of the fuzzer: `nnscaler run` with mutated tensor files and flags.

use super::*;

/// Random inputs for `model` made by `nnscaler import`: floats N(0, 1), integers in
/// `0..classes` (but for one, `classes + 40`, when `bad` is set), written as safetensors.
pub(super) fn random_inputs(
    model: &Path,
    classes: i64,
    bad: bool,
    rng: &mut Rng,
) -> Result<Vec<u8>, String> {
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
pub(super) fn mutate_tensors(rng: &mut Rng, bytes: &[u8]) -> Vec<u8> {
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

pub(super) fn run_case(
    cfg: &Config,
    rng: &mut Rng,
    base: &RunBase,
    case: usize,
) -> Result<bool, Failure> {
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
pub(super) struct RunBase {
    model: PathBuf,
    local: PathBuf,
    inputs: Vec<u8>,
    params: Vec<u8>,
}

pub(super) fn run_base(cfg: &Config, rng: &mut Rng) -> Result<RunBase, String> {
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
