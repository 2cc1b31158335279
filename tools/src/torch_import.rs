//! `nnscaler import torch FILE.py:FACTORY --input NAME=SHAPE:DTYPE ...`: a PyTorch
//! `nn.Module` traced into `dnn` MLIR by the importer in `frontends/torch/nnscaler_torch`
//! (built into this binary and run with a Python that has torch: Debian's torch 1.13 here,
//! torch 2.x on GPU machines). The module and the parameters' file are written together,
//! or neither.

use crate::output::Outputs;

/// The importer's source (run as `python -c SOURCE ARGS`).
const IMPORTER: &str = include_str!("../../frontends/torch/nnscaler_torch/importer.py");

/// The Python to run: `--python`, else `$NNSCALER_PYTHON`, else `python3`.
pub fn python(flag: Option<&str>) -> String {
    flag.map(str::to_string)
        .or_else(|| std::env::var("NNSCALER_PYTHON").ok())
        .unwrap_or_else(|| "python3".into())
}

/// The MLIR of `spec` traced on `inputs` with `python`, in training mode or, with `eval`,
/// evaluation mode (dropout off): what `nnscaler train` compiles for `[model] torch`.
pub fn import_text(
    spec: &str,
    inputs: &[String],
    python: &str,
    eval: bool,
) -> Result<String, String> {
    let out = run(
        spec,
        inputs,
        python,
        eval.then_some("--eval").into_iter().collect(),
    )?;
    String::from_utf8(out).map_err(|e| format!("the importer printed no UTF-8 text: {e}"))
}

/// Runs the importer with `args` after the model's, returning its standard output.
fn run(spec: &str, inputs: &[String], python: &str, args: Vec<&str>) -> Result<Vec<u8>, String> {
    let mut cmd = std::process::Command::new(python);
    cmd.arg("-c").arg(IMPORTER).arg(spec);
    for i in inputs {
        cmd.arg("--input").arg(i);
    }
    cmd.args(args);
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run the Python '{python}' (give --python PATH): {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("No module named 'torch'") {
            return Err(format!(
                "the Python '{python}' has no torch (install python3-torch, or give --python PATH)"
            ));
        }
        let msg = err.trim_end();
        return Err(msg.strip_prefix("error: ").unwrap_or(msg).to_string());
    }
    Ok(out.stdout)
}

/// Imports `spec` (`FILE.py:FACTORY`) traced on `inputs` (`NAME=SHAPE:DTYPE` each, in
/// `forward`'s order) with `python`; writes the MLIR to `output` and, with `params`, the
/// parameters' values (safetensors by `state_dict` key) there.
pub fn import(
    spec: &str,
    inputs: &[String],
    params: Option<&str>,
    python: &str,
    output: &str,
) -> Result<(), String> {
    if inputs.is_empty() {
        return Err(
            "import torch needs the forward's inputs: --input NAME=SHAPE:DTYPE for each (e.g. --input x=8x16:f32 --input labels=8:i64)"
                .into(),
        );
    }
    let dir = nnscaler_rt::host::private_dir("nnscaler-torch")?;
    let result = (|| {
        let tmp = dir.join("params.safetensors");
        let tmp_text = tmp.to_string_lossy().to_string();
        let args = match params {
            Some(_) => vec!["--params", tmp_text.as_str()],
            None => Vec::new(),
        };
        let text = run(spec, inputs, python, args)?;
        let mut o = Outputs::new();
        o.stage(output, text)?;
        if let Some(p) = params {
            let bytes = std::fs::read(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
            o.stage(p, bytes)?;
        }
        o.commit()
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}
