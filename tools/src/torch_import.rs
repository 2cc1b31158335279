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

/// User ops that aten ops map to (`--user-ops FILE`): the functions of FILE with an
/// `nns.torch` attribute, the aten call each implements (`"aten::softplus(x, 1, 20)"`:
/// names are the tensor operands, in order, literals the values the call's other arguments
/// must have). The importer calls them where the traced model makes that call; the
/// imported module holds FILE's functions.
#[derive(Clone, Debug, Default)]
pub struct UserOps {
    /// FILE's top-level operations, as text (inserted into the imported module).
    text: String,
    /// One JSON object per mapped function: name, pattern, operand and result types.
    specs: Vec<String>,
}

impl UserOps {
    /// Reads and verifies `path`.
    pub fn load(path: &str) -> Result<UserOps, String> {
        use nnscaler_dialects::context::IrContext;
        use nnscaler_dialects::graph::Graph;
        use nnscaler_dialects::types::AttrValue;
        let ir = IrContext::new();
        let (_, module) = crate::load_module(&ir, path, 20)?;
        let mut specs = Vec::new();
        for g in Graph::all_in(&module) {
            let g = g.map_err(|e| format!("{path}: {}: {}", e.loc, e.message))?;
            let Some(attr) = g.func_attrs.get("nns.torch") else {
                continue;
            };
            let AttrValue::Str(pattern) = attr else {
                return Err(format!(
                    "{path}: @{}: 'nns.torch' must be a string like \"aten::softplus(x, 1, 20)\"",
                    g.name
                ));
            };
            if g.name == "train" {
                return Err(format!(
                    "{path}: @train is the imported step's name; rename the user op"
                ));
            }
            let types = |vs: Vec<nnscaler_dialects::graph::ValueId>| -> Vec<String> {
                vs.into_iter().map(|v| g.values[v].to_string()).collect()
            };
            let spec = serde_json::json!({
                "name": g.name,
                "torch": pattern,
                "operands": types(g.args.iter().map(|a| a.value).collect()),
                "results": types(g.outputs.iter().map(|o| o.value).collect()),
            });
            specs.push(spec.to_string());
        }
        if specs.is_empty() {
            return Err(format!(
                "{path}: no function maps an aten op (give one an attribute nns.torch = \"aten::NAME(x, ...)\")"
            ));
        }
        // The module's body: between its opening line (`module {`, or `module attributes
        // {..} {`) and its closing brace.
        let printed = module.as_operation().to_string();
        let trimmed = printed.trim_end();
        let body = match (trimmed.find("{\n"), trimmed.strip_suffix('}')) {
            (Some(open), Some(head)) if trimmed.starts_with("module") && open + 2 <= head.len() => {
                head[open + 2..].trim_matches('\n').to_string()
            }
            _ => {
                return Err(format!(
                    "{path}: its functions could not be read back as a module's body"
                ))
            }
        };
        Ok(UserOps { text: body, specs })
    }

    /// `module` (the importer's output) with the user ops' functions inside it.
    fn merged(&self, module: String) -> String {
        match module.trim_end().strip_suffix('}') {
            Some(head) => format!("{head}{}\n}}\n", self.text),
            None => module,
        }
    }
}

/// The MLIR of `spec` traced on `inputs` with `python`, in training mode or, with `eval`,
/// evaluation mode (dropout off): what `nnscaler train` compiles for `[model] torch`.
pub fn import_text(
    spec: &str,
    inputs: &[String],
    python: &str,
    eval: bool,
    user_ops: Option<&UserOps>,
) -> Result<String, String> {
    let out = run(
        spec,
        inputs,
        python,
        eval.then_some("--eval").into_iter().collect(),
        user_ops,
    )?;
    String::from_utf8(out).map_err(|e| format!("the importer printed no UTF-8 text: {e}"))
}

/// Runs the importer with `args` after the model's, returning its standard output (with
/// the user ops' functions).
fn run(
    spec: &str,
    inputs: &[String],
    python: &str,
    args: Vec<&str>,
    user_ops: Option<&UserOps>,
) -> Result<Vec<u8>, String> {
    let mut cmd = std::process::Command::new(python);
    cmd.arg("-c").arg(IMPORTER).arg(spec);
    for i in inputs {
        cmd.arg("--input").arg(i);
    }
    for u in user_ops.map(|u| u.specs.as_slice()).unwrap_or_default() {
        cmd.arg("--user-op").arg(u);
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
    match user_ops {
        Some(u) => {
            let text = String::from_utf8(out.stdout)
                .map_err(|e| format!("the importer printed no UTF-8 text: {e}"))?;
            Ok(u.merged(text).into_bytes())
        }
        None => Ok(out.stdout),
    }
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
    user_ops: Option<&str>,
) -> Result<(), String> {
    if inputs.is_empty() {
        return Err(
            "import torch needs the forward's inputs: --input NAME=SHAPE:DTYPE for each (e.g. --input x=8x16:f32 --input labels=8:i64)"
                .into(),
        );
    }
    let user = user_ops.map(UserOps::load).transpose()?;
    let dir = nnscaler_rt::host::private_dir("nnscaler-torch")?;
    let result = (|| {
        let tmp = dir.join("params.safetensors");
        let tmp_text = tmp.to_string_lossy().to_string();
        let args = match params {
            Some(_) => vec!["--params", tmp_text.as_str()],
            None => Vec::new(),
        };
        let text = run(spec, inputs, python, args, user.as_ref())?;
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
