//! Pipelines (`--pass-pipeline=...`, a list of [`Step`]s) and the runner that verifies the IR
//! after every pass.

use crate::pass::{Anchor, Factory, Lookup, PassInfo, PassOptions};
use melior::ir::Module;
use melior::pass::PassManager;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::verify::{file_loc, verify_module};

/// One step of a pipeline: a registered pass with its options.
#[derive(Clone, Debug)]
pub struct Step {
    /// The pass.
    pub info: &'static PassInfo,
    /// Its options.
    pub options: PassOptions,
}

impl Step {
    /// A step for pass `name` of the table `lookup` reads (the registry's:
    /// [`crate::registry::step`]) with option text `opts` (`key=value ...`).
    pub fn named(lookup: Lookup, name: &str, opts: &str) -> Result<Self, String> {
        let info = lookup(name).ok_or(format!("unknown pass '{name}' (see --list-passes)"))?;
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
/// (`a,,b`) is an error. Pass names are looked up with `lookup` (the registry's:
/// [`crate::registry::parse_pipeline`]).
pub fn parse_pipeline(text: &str, lookup: Lookup) -> Result<Vec<Step>, String> {
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
    parse_list(t, text, false, lookup)
}

/// The steps of a comma-separated list `t` (inside `func.func(...)` when `in_func`).
fn parse_list(t: &str, text: &str, in_func: bool, lookup: Lookup) -> Result<Vec<Step>, String> {
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
            steps.extend(parse_list(inner, text, true, lookup)?);
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
        let step = Step::named(lookup, name, opts)?;
        if in_func && step.info.anchor == Anchor::Module {
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
