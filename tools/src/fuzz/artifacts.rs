//! Part 4 of the fuzzer: mutated artifacts through `nnscaler-rt`.

use super::*;

/// A compiled artifact and the tensor files it runs on.
pub(super) struct ArtBase {
    name: String,
    bytes: Vec<u8>,
    inputs: Vec<PathBuf>,
}

/// Runs `args` of binary `bin` in `dir`, or says why it failed.
pub(super) fn step(bin: &Path, dir: &Path, args: &[&str], timeout: Duration) -> Result<(), String> {
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
pub(super) fn artifact_base(cfg: &Config) -> Result<Vec<ArtBase>, String> {
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
pub(super) fn leaves(v: &serde_json::Value, at: String, out: &mut Vec<(String, u8)>) {
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
pub(super) fn with_header(bytes: &[u8], header: &[u8]) -> Vec<u8> {
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

pub(super) fn artifact_case(
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
