//! Pass options, pipelines (`--pass-pipeline=...`) and the runner that verifies the IR
//! after every pass.

use crate::registry::{self, Factory, PassInfo};
use melior::ir::{Module, OperationRef};
use melior::pass::PassManager;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::verify::{file_loc, verify_module};
use std::collections::BTreeMap;

/// A pass that works on the whole module (it adds or reads module-level ops), like an MLIR
/// pass anchored on `builtin.module`.
pub trait ModulePass {
    /// Runs the pass on `module` (a `builtin.module` op), editing it in place.
    fn run(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics>;
    /// Takes the remarks made by the last run (decisions the user may want to know about).
    fn take_remarks(&mut self) -> Diagnostics {
        Diagnostics::default()
    }
}

/// A pass that transforms one function at a time, like an MLIR pass anchored on
/// `func.func`: it reads a function as a [`Graph`] and returns the graph to write back in
/// place (see [`crate::rewrite`]). It may read, never change, the module around the
/// function ([`FunctionPass::prepare`]).
pub trait FunctionPass {
    /// Reads what the pass needs from the module holding the functions (its mesh). Called
    /// before the first function of a module.
    fn prepare(&mut self, _module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        Ok(())
    }
    /// Transforms one function; `None` leaves it untouched.
    fn run_on_function(&mut self, g: Graph) -> Result<Option<Graph>, Diagnostics>;
    /// Takes the remarks made so far (decisions the user may want to know about, such as
    /// an op without a spec run replicated).
    fn take_remarks(&mut self) -> Diagnostics {
        Diagnostics::default()
    }
    /// Called after every function of a module was seen (e.g. to report that `func=NAME`
    /// matched none). Not called when the pass is run on one function alone.
    fn finish(&mut self) -> Result<(), Diagnostics> {
        Ok(())
    }
}

/// One of our passes, by its anchor.
pub enum Native {
    /// A module pass.
    Module(Box<dyn ModulePass>),
    /// A function pass.
    Function(Box<dyn FunctionPass>),
}

impl std::fmt::Debug for Native {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Native::Module(_) => "Native::Module",
            Native::Function(_) => "Native::Function",
        })
    }
}

impl Native {
    /// Runs the pass on the module op `module`, in place. Returns its remarks.
    pub fn run(&mut self, module: &OperationRef<'_, '_>) -> Result<Diagnostics, Diagnostics> {
        match self {
            Native::Module(p) => p.run(module).map(|()| p.take_remarks()),
            Native::Function(p) => crate::rewrite::run_on_module(p.as_mut(), module),
        }
    }
}

/// Options of one pass instance: `key=value` pairs, checked against the pass's declared
/// options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassOptions(pub BTreeMap<String, String>);

impl PassOptions {
    /// Parses MLIR-style options `key=value key2=value2` for pass `info`.
    pub fn parse(info: &PassInfo, text: &str) -> Result<Self, String> {
        let mut map = BTreeMap::new();
        // A pass with a `policy`, `file` or `to` option takes it unnamed: `--plan=dp`,
        // `--schedule-from=s.txt`, `--autocast=bf16`.
        let positional = info
            .options
            .iter()
            .find(|o| matches!(o.name, "policy" | "file" | "to"))
            .map(|o| o.name);
        for item in text.split_whitespace() {
            let (k, v) = match item.split_once('=') {
                Some(kv) => kv,
                None if positional.is_some() => (positional.unwrap_or_default(), item),
                None if info.options.iter().any(|o| o.name == item) => {
                    return Err(format!(
                        "option '{item}' of pass '{}' needs a value ({item}=...)",
                        info.name
                    ))
                }
                None => (item, ""),
            };
            if !info.options.iter().any(|o| o.name == k) {
                let known: Vec<&str> = info.options.iter().map(|o| o.name).collect();
                return Err(format!(
                    "pass '{}' has no option '{k}' (options: {})",
                    info.name,
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ));
            }
            if v.is_empty() {
                return Err(format!(
                    "option '{k}' of pass '{}' has an empty value",
                    info.name
                ));
            }
            if map.insert(k.to_string(), v.to_string()).is_some() {
                return Err(format!(
                    "option '{k}' of pass '{}' is given twice",
                    info.name
                ));
            }
        }
        Ok(PassOptions(map))
    }

    /// The value of option `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// Option `key` as a positive integer (`None` when absent); the error names `pass`, the
    /// key and the value.
    pub fn positive(&self, key: &str, pass: &str) -> Result<Option<u64>, String> {
        self.get(key)
            .map(|v| {
                v.parse::<u64>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or(format!("{pass}: '{key}={v}' must be a positive integer"))
            })
            .transpose()
    }
}

/// One step of a pipeline: a registered pass with its options.
#[derive(Clone, Debug)]
pub struct Step {
    /// The pass.
    pub info: &'static PassInfo,
    /// Its options.
    pub options: PassOptions,
}

impl Step {
    /// A step for pass `name` with option text `opts` (`key=value ...`).
    pub fn new(name: &str, opts: &str) -> Result<Self, String> {
        let info =
            registry::lookup(name).ok_or(format!("unknown pass '{name}' (see --list-passes)"))?;
        Ok(Step {
            info,
            options: PassOptions::parse(info, opts)?,
        })
    }
}

/// Parses `builtin.module(a, b{k=v})` or `a,b{k=v}` into steps. Passes that work function
/// by function may also be nested as MLIR anchors them, `builtin.module(func.func(a, b))`
/// (each function is then transformed by `a`, then `b`); a module-level pass (`plan`, which
/// adds a mesh) inside `func.func(...)` is an error. An empty pipeline or an empty element
/// (`a,,b`) is an error.
pub fn parse_pipeline(text: &str) -> Result<Vec<Step>, String> {
    let mut t = text.trim();
    if let Some(inner) = t
        .strip_prefix("builtin.module(")
        .and_then(|s| s.strip_suffix(')'))
    {
        t = inner;
    }
    if t.trim().is_empty() {
        return Err(format!(
            "the pass pipeline '{text}' names no pass (write e.g. 'builtin.module(autodiff,cse)')"
        ));
    }
    parse_list(t, text, false)
}

/// The steps of a comma-separated list `t` (inside `func.func(...)` when `in_func`).
fn parse_list(t: &str, text: &str, in_func: bool) -> Result<Vec<Step>, String> {
    let mut items: Vec<String> = Vec::new();
    let (mut cur, mut depth) = (String::new(), 0i32);
    for c in t.chars() {
        match c {
            '{' | '(' => depth += 1,
            '}' | ')' if depth == 0 => {
                return Err(format!("unbalanced '{c}' in pass pipeline '{text}'"))
            }
            '}' | ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if depth != 0 {
        return Err(format!("unbalanced brackets in pass pipeline '{text}'"));
    }
    items.push(cur);
    let mut steps = Vec::new();
    for item in &items {
        let item = item.trim();
        if item.is_empty() {
            return Err(format!("the pass pipeline '{text}' has an empty element"));
        }
        if let Some(inner) = item
            .strip_prefix("func.func(")
            .and_then(|s| s.strip_suffix(')'))
        {
            if in_func {
                return Err(format!("'func.func(...)' is nested in itself in '{text}'"));
            }
            if inner.trim().is_empty() {
                return Err(format!(
                    "the pass pipeline '{text}' has an empty func.func()"
                ));
            }
            steps.extend(parse_list(inner, text, true)?);
            continue;
        }
        let (name, opts) = match item.split_once('{') {
            Some((n, o)) => (
                n.trim(),
                o.strip_suffix('}')
                    .ok_or(format!("unbalanced '{{' in pipeline element '{item}'"))?,
            ),
            None => (item, ""),
        };
        let step = Step::new(name, opts)?;
        if in_func && step.info.anchor == registry::Anchor::Module {
            return Err(format!(
                "pass '{name}' works on the whole module; put it outside func.func(...)"
            ));
        }
        steps.push(step);
    }
    Ok(steps)
}

/// What one step of a pipeline did, for `--mlir-print-ir-after-all` and `--mlir-timing`.
#[derive(Clone, Debug)]
pub struct StepDone {
    /// The pass's name.
    pub name: &'static str,
    /// Time the pass took.
    pub pass: std::time::Duration,
    /// Time the verifier took after it.
    pub verify: std::time::Duration,
}

/// Runs `steps` in order on `module`, verifying after each; `after` is called after each
/// pass (for `--mlir-print-ir-after-all` and `--mlir-timing`). Returns the passes' remarks.
pub fn run<'c>(
    ir: &'c IrContext,
    module: &mut Module<'c>,
    steps: &[Step],
    after: &mut dyn FnMut(&StepDone, &Module<'_>),
    file: &str,
) -> Result<Diagnostics, Diagnostics> {
    let mut remarks = Diagnostics::default();
    for step in steps {
        let start = std::time::Instant::now();
        match step.info.factory {
            Factory::Native(make) => {
                let mut pass = make(&step.options).map_err(|e| {
                    let mut d = Diagnostics::default();
                    d.error(&file_loc(file), e);
                    d
                })?;
                remarks.extend(pass.run(&module.as_operation())?);
            }
            Factory::Upstream(make) => {
                ir.take_diagnostics();
                let pm = PassManager::new(ir.context());
                pm.add_pass(make());
                if pm.run(module).is_err() {
                    let mut d = ir.take_diagnostics();
                    if !d.has_errors() {
                        d.error(&file_loc(file), format!("pass '{}' failed", step.info.name));
                    }
                    return Err(d);
                }
            }
        }
        let pass = start.elapsed();
        ir.verify_structure(module)?;
        let d = verify_module(module);
        if d.has_errors() {
            return Err(d);
        }
        let done = StepDone {
            name: step.info.name,
            pass,
            verify: start.elapsed() - pass,
        };
        after(&done, module);
    }
    Ok(remarks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipelines_parse() {
        let s = parse_pipeline("builtin.module(print-stats{func=train}, cse)").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].options.get("func"), Some("train"));
        assert!(parse_pipeline("nope")
            .unwrap_err()
            .contains("unknown pass 'nope'"));
        assert!(parse_pipeline("cse{x=1}")
            .unwrap_err()
            .contains("has no option 'x'"));
        let nested = parse_pipeline(
            "builtin.module(plan{dp dp=2},func.func(propagate-layouts,cse{}),localize)",
        )
        .unwrap();
        let names: Vec<&str> = nested.iter().map(|s| s.info.name).collect();
        assert_eq!(names, ["plan", "propagate-layouts", "cse", "localize"]);
        assert!(parse_pipeline("builtin.module(func.func(plan{dp dp=2}))")
            .unwrap_err()
            .contains("works on the whole module"));
        for bad in [
            "",
            "builtin.module()",
            "builtin.module(,,)",
            "cse,,cse",
            "cse,",
            "func.func()",
            "func.func(cse",
            "func.func(func.func(cse))",
        ] {
            assert!(parse_pipeline(bad).is_err(), "{bad:?} is accepted");
        }
        assert!(parse_pipeline("plan{dp dp=2 dp=4}")
            .unwrap_err()
            .contains("option 'dp' of pass 'plan' is given twice"));
        assert!(parse_pipeline("autodiff{func}")
            .unwrap_err()
            .contains("needs a value"));
        assert!(parse_pipeline("autodiff{func=}")
            .unwrap_err()
            .contains("empty value"));
    }
}
