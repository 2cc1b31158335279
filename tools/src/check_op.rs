//! `nnscaler check-op MODULE.mlir @op`: checks a user op's annotation by running it.
//!
//! For every split its annotation allows (each splittable identifier, spatial or summed),
//! over each device count that divides it (2 and 4 by default), the op is partitioned by
//! the real pipeline (a call of it with that split directive on a one-axis mesh,
//! `--propagate-layouts --split-tensor --lower-relayouts --localize`) and run on simulated
//! devices, and the results are compared with the whole op run on one device on the same
//! random inputs. A split the annotation allows but the op does not compute shows up as a
//! pipeline error (the body needs communication) or as different numbers; each is reported
//! with the split, and the command fails.

use nnscaler_dialects::annotation::DimKind;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::types::TensorType;
use nnscaler_dialects::userop::{UserOp, UserOps};
use nnscaler_dialects::verify::{verify_module, Meshes};
use nnscaler_dialects::view::{top_level_ops, walk_nested, FuncView, OpView};
use nnscaler_passes::pipeline;
use nnscaler_passes::registry::parse_pipeline;
use nnscaler_runtime::spmd::run_spmd;
use nnscaler_runtime::tensor::{dims, Tensor};
use nnscaler_runtime::{rng, Options};

/// `nnscaler check-op`'s command line.
#[derive(clap::Args, Debug)]
#[command(
    about = "Check a user op's annotation: run it under every split the annotation allows",
    long_about = "Check a user op's annotation: run it under every split the annotation allows.\n\n\
        For each identifier the annotation lets split (spatial, or summed '+'), over each \
        device count in --devices that divides its length, the op is partitioned with that \
        split by the same passes as a program (propagate-layouts, split-tensor, \
        lower-relayouts, localize) and run on simulated devices; its results must equal the \
        whole op's on one device (random inputs, relative error <= --tolerance). Each split is \
        reported; the command exits 1 if any fails."
)]
pub struct CheckOpArgs {
    /// The module holding the op (MLIR file).
    #[arg(value_name = "MODULE.mlir")]
    pub module: String,
    /// The op: a function with nns.annotation (`@my_gemm` or `my_gemm`).
    #[arg(value_name = "@OP")]
    pub op: String,
    /// Device counts to split over.
    #[arg(long, value_name = "N,...", value_delimiter = ',', default_values_t = [2u64, 4])]
    pub devices: Vec<u64>,
    /// Seed of the random inputs.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Largest relative error accepted (max |a - b| / max |b|).
    #[arg(long, value_name = "E", default_value_t = 1e-5)]
    pub tolerance: f64,
}

/// The outcome of one split.
#[derive(Debug)]
pub struct SplitOutcome {
    /// `split m over 2 devices`.
    pub what: String,
    /// The worst relative error, or why it failed.
    pub result: Result<f64, String>,
}

/// Runs `nnscaler check-op`; returns the report (one line per split) and whether all
/// passed, or an error that stopped it.
pub fn check_op(a: &CheckOpArgs, error_limit: usize) -> Result<(String, bool), String> {
    let ir = IrContext::new();
    let (_, module) = crate::load_module(&ir, &a.module, error_limit)?;
    let name = a.op.trim_start_matches('@').to_string();
    let mut d = Diagnostics::default();
    let ops = UserOps::collect(&module.as_operation(), &mut d);
    let u = ops.0.get(&name).cloned().ok_or_else(|| {
        let names: Vec<&str> = ops.0.keys().map(String::as_str).collect();
        format!(
            "{}: @{name} is not a user op (a function with nns.annotation){}",
            a.module,
            if names.is_empty() {
                String::new()
            } else {
                format!("; user ops: @{}", names.join(", @"))
            }
        )
    })?;
    // The user ops' definitions, printed, are the base of every check module.
    // The op and every function it calls or names as its VJP (transitively), printed with
    // their locations so
    // that a problem in a body points into the user's file.
    let mut calls: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    top_level_ops(&module.as_operation(), &mut |op| {
        if let Some(f) = FuncView::of(op) {
            let mut callees = Vec::new();
            walk_nested(op, &mut |inner| {
                let v = OpView::of(inner);
                if v.name == "func.call" {
                    if let Some(c) = nnscaler_dialects::userop::callee(&v.attrs) {
                        callees.push(c.to_string());
                    }
                }
            });
            // Its VJP function too, which the verifier looks for.
            if let Some(nnscaler_dialects::types::AttrValue::Other(v)) =
                OpView::of(op).attrs.get("nns.vjp")
            {
                callees.push(v.trim_start_matches('@').to_string());
            }
            calls.insert(f.name, callees);
        }
    });
    let mut needed = vec![name.clone()];
    let mut i = 0;
    while i < needed.len() {
        for c in calls.get(&needed[i]).cloned().unwrap_or_default() {
            if !needed.contains(&c) {
                needed.push(c);
            }
        }
        i += 1;
    }
    let mut defs = String::new();
    top_level_ops(&module.as_operation(), &mut |op| {
        if FuncView::of(op).is_some_and(|f| needed.contains(&f.name)) {
            let flags =
                melior::ir::operation::OperationPrintingFlags::new().enable_debug_info(true, false);
            defs.push_str(
                &op.to_string_with_flags(flags)
                    .unwrap_or_else(|_| op.to_string()),
            );
            defs.push('\n');
        }
    });
    let shapes: Vec<Option<&[i64]>> = u.args.iter().map(|t| Some(t.shape.as_slice())).collect();
    let binding = u
        .annotation
        .bind(&shapes)
        .map_err(|e| format!("@{name}: {e}"))?;
    let inputs = random_inputs(&u.args, a.seed);
    let whole = run_whole(&ir, &defs, &u, &inputs)?;
    let mut report = String::new();
    let mut ok = true;
    let mut any = false;
    for choice in u.annotation.split_choices(&binding) {
        let len = binding.len(&choice.id).unwrap_or(1);
        for &n in &a.devices {
            if n < 2 || len % n as i64 != 0 {
                continue;
            }
            any = true;
            let kind = if choice.kind == DimKind::Summed {
                " (summed)"
            } else {
                ""
            };
            let what = format!("split {}{kind} over {n} devices", choice.id);
            let result = run_split(&ir, &defs, &u, &choice.id, n, &inputs, &whole, a.tolerance);
            match &result {
                Ok(e) => report.push_str(&format!("ok    {what}: max relative error {e:.1e}\n")),
                Err(e) => {
                    ok = false;
                    report.push_str(&format!("FAIL  {what}: {e}\n"));
                }
            }
        }
    }
    if !any {
        report.push_str(&format!(
            "no split to check: '{}' allows none that {} divide\n",
            u.text,
            a.devices
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok((report, ok))
}

fn random_inputs(args: &[TensorType], seed: u64) -> Vec<Tensor> {
    args.iter()
        .enumerate()
        .map(|(i, t)| {
            let shape = dims(t);
            let n: usize = shape.iter().product();
            if t.elem.is_float() {
                Tensor::f32(
                    &shape,
                    (0..n as u64)
                        .map(|k| rng::normal(seed, i as u64, k) as f32)
                        .collect(),
                )
            } else {
                Tensor::i64(
                    &shape,
                    (0..n as u64)
                        .map(|k| (rng::bits(seed, i as u64, k) % 2) as i64)
                        .collect(),
                )
            }
        })
        .collect()
}

/// A module: the user ops' definitions, a one-axis mesh of `devices` (when given) and
/// `@check`, which calls `u` (with `directive`) and returns its results.
fn check_module(defs: &str, u: &UserOp, mesh: Option<u64>, directive: &str) -> String {
    let args: Vec<String> = u
        .args
        .iter()
        .enumerate()
        .map(|(i, t)| format!("%a{i}: {t} {{nns.name = \"a{i}\"}}"))
        .collect();
    let results: Vec<String> = u
        .results
        .iter()
        .enumerate()
        .map(|(i, t)| format!("{t} {{nns.name = \"r{i}\"}}"))
        .collect();
    let arg_names: Vec<String> = (0..u.args.len()).map(|i| format!("%a{i}")).collect();
    let arg_types: Vec<String> = u.args.iter().map(|t| t.to_string()).collect();
    let res_types: Vec<String> = u.results.iter().map(|t| t.to_string()).collect();
    let n = u.results.len();
    let lhs = if n == 1 {
        "%r".to_string()
    } else {
        format!("%r:{n}")
    };
    let rets: Vec<String> = if n == 1 {
        vec!["%r".into()]
    } else {
        (0..n).map(|i| format!("%r#{i}")).collect()
    };
    let mesh = match mesh {
        Some(d) => format!(
            "\"nns.mesh\"() {{sym_name = \"world\", axes = #nns.axes<x = {d}>}} : () -> ()\n"
        ),
        None => String::new(),
    };
    format!(
        "{mesh}{defs}func.func @check({}) -> ({}) {{\n  {lhs} = func.call @{}({}){directive} : ({}) -> ({})\n  return {} : {}\n}}\n",
        args.join(", "),
        results.join(", "),
        u.name,
        arg_names.join(", "),
        arg_types.join(", "),
        res_types.join(", "),
        rets.join(", "),
        res_types.join(", "),
    )
}

/// `@check` of `text`, read and linked to the functions it calls.
fn read_check(
    ir: &IrContext,
    text: &str,
    steps: &str,
) -> Result<(Graph, Option<nnscaler_dialects::nns::Mesh>), String> {
    let mut m = ir.parse(text, "<check-op>").map_err(|d| d.to_string())?;
    let d = verify_module(&m);
    if d.has_errors() {
        return Err(d.to_string());
    }
    if !steps.is_empty() {
        let steps = parse_pipeline(steps)?;
        pipeline::run(ir, &mut m, &steps, &mut |_, _| {}, "<check-op>").map_err(summary)?;
    }
    let mut d = Diagnostics::default();
    let mesh = Meshes::collect(&m.as_operation(), &mut d)
        .0
        .first()
        .cloned();
    // Declarations (kernel ops) are not graphs; calls of them run their kernels.
    let all: Vec<Graph> = Graph::all_in(&m)
        .into_iter()
        .filter_map(Result::ok)
        .collect();
    let mut g = all
        .iter()
        .find(|g| g.name == "check")
        .cloned()
        .ok_or("internal error: no @check")?;
    g.link(&all);
    Ok((g, mesh))
}

/// The first error and its notes, with the notes' places (the error's own place is in the
/// generated check module).
fn summary(d: Diagnostics) -> String {
    use nnscaler_dialects::diag::Severity;
    let mut out = String::new();
    for x in &d.0 {
        match x.severity {
            Severity::Error if out.is_empty() => out = x.message.clone(),
            Severity::Error => break,
            Severity::Note if !out.is_empty() => {
                out.push_str(&format!(
                    " (note: {}:{}:{}: {})",
                    x.loc.file, x.loc.line, x.loc.col, x.message
                ));
            }
            _ => {}
        }
    }
    out
}

fn run_whole(
    ir: &IrContext,
    defs: &str,
    u: &UserOp,
    inputs: &[Tensor],
) -> Result<Vec<Tensor>, String> {
    let (g, _) = read_check(ir, &check_module(defs, u, None, ""), "")?;
    nnscaler_runtime::run(&g, inputs.to_vec(), &Options::default())
        .map_err(|e| format!("@{}: the whole op fails: {}", u.name, e.message))
}

#[allow(clippy::too_many_arguments)]
fn run_split(
    ir: &IrContext,
    defs: &str,
    u: &UserOp,
    id: &str,
    devices: u64,
    inputs: &[Tensor],
    whole: &[Tensor],
    tolerance: f64,
) -> Result<f64, String> {
    let directive = format!(" {{nns.split = #nns.split<{id} = x>}}");
    let text = check_module(defs, u, Some(devices), &directive);
    let (g, mesh) = read_check(
        ir,
        &text,
        "propagate-layouts,split-tensor,lower-relayouts,localize",
    )?;
    let mesh = mesh.ok_or("internal error: no mesh")?;
    let got = run_spmd(&g, &mesh, inputs.to_vec(), &Options::default())
        .map_err(|e| format!("running it fails: {}", e.message))?;
    let mut worst = 0.0f64;
    for (i, (g, w)) in got.iter().zip(whole).enumerate() {
        let err = g.rel_err(w).ok_or_else(|| {
            format!(
                "result {i} is {} but the whole op gives {}",
                g.describe(),
                w.describe()
            )
        })?;
        if err > tolerance {
            return Err(format!(
                "result {i} differs from the whole op by {err:.2e} (relative): the op does not compute this split as its annotation '{}' says",
                u.text
            ));
        }
        worst = worst.max(err);
    }
    Ok(worst)
}
