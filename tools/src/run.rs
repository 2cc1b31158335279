//! `nnscaler run`: executes a function of a model on the CPU runtime, with tensors from and
//! to safetensors files.

use crate::{read_input, write_output_bytes};
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::types::Elem;
use nnscaler_dialects::verify::{verify_module, Meshes};
use nnscaler_passes::autodiff::differentiate;
use nnscaler_runtime::interp::{bind, ParamSource};
use nnscaler_runtime::spmd::{global_view, run_spmd};
use nnscaler_runtime::{io, kernels, Options};
use std::path::Path;

/// Help text of `nnscaler run`.
pub const HELP: &str = "\
\x20 nnscaler run MODEL.mlir [--inputs IN.safetensors] [--params P.safetensors | --init-seed S]\n\
\x20              -o OUT.safetensors [--func NAME] [--autodiff] [--save-params FILE]\n\
\x20              [--check-finite] [--threads N]\n\
\x20     Execute a function on the CPU reference runtime. Arguments are read by their\n\
\x20     nns.name: inputs from --inputs, nns.param arguments from --params or drawn with\n\
\x20     --init-seed (normal(0, 0.02); norm weights 1, biases 0; nns.init overrides).\n\
\x20     Results are written under their nns.name (or out0, out1, ...).\n\
\x20       --func NAME        the function to run (default: the only one, or @train)\n\
\x20       --autodiff         differentiate first (as nnscaler-opt --autodiff): the results\n\
\x20                          then include grad.<param> for every parameter\n\
\x20       --save-params FILE write the parameters used (e.g. drawn with --init-seed)\n\
\x20       --check-finite     stop at the first op producing NaN or Inf, naming it\n\
\x20       --threads N        threads for matrix products (default 1)\n\
\x20       --devices N        expect N simulated devices. A function made by --localize runs\n\
\x20                          on every device of its mesh (a thread each, in-process\n\
\x20                          collectives): inputs are cut and results assembled by their\n\
\x20                          nns.layout, so the tensor files are the same as on one device\n";

#[derive(Debug, Default)]
struct Args {
    model: Option<String>,
    inputs: Option<String>,
    params: Option<String>,
    seed: Option<u64>,
    output: Option<String>,
    func: Option<String>,
    save_params: Option<String>,
    autodiff: bool,
    check_finite: bool,
    devices: Option<i64>,
}

fn parse_args(argv: &[String]) -> Result<Args, String> {
    let mut a = Args::default();
    let mut i = 0;
    while i < argv.len() {
        let flag = argv[i].clone();
        i += 1;
        let mut value = || -> Result<String, String> {
            let v = argv
                .get(i)
                .cloned()
                .ok_or(format!("{flag} needs a value"))?;
            i += 1;
            Ok(v)
        };
        match flag.as_str() {
            "--inputs" => a.inputs = Some(value()?),
            "--params" => a.params = Some(value()?),
            "--init-seed" => {
                let v = value()?;
                a.seed =
                    Some(v.parse().map_err(|_| {
                        format!("--init-seed takes a non-negative integer, not '{v}'")
                    })?);
            }
            "-o" | "--output" => a.output = Some(value()?),
            "--func" => a.func = Some(value()?),
            "--save-params" => a.save_params = Some(value()?),
            "--autodiff" => a.autodiff = true,
            "--devices" => {
                let v = value()?;
                a.devices = Some(
                    v.parse()
                        .ok()
                        .filter(|&n: &i64| n > 0)
                        .ok_or(format!("--devices takes a positive integer, not '{v}'"))?,
                );
            }
            "--check-finite" => a.check_finite = true,
            "--threads" => {
                let v = value()?;
                let n: usize = v
                    .parse()
                    .map_err(|_| format!("--threads takes a positive integer, not '{v}'"))?;
                kernels::set_threads(n);
            }
            s if s.starts_with('-') && s != "-" => {
                return Err(format!("unknown option '{s}' (see nnscaler --help)"))
            }
            s if a.model.is_none() => a.model = Some(s.to_string()),
            s => return Err(format!("unexpected argument '{s}'")),
        }
    }
    if a.params.is_some() && a.seed.is_some() {
        return Err("give either --params or --init-seed, not both".into());
    }
    Ok(a)
}

/// Runs `nnscaler run` with `argv` (after the subcommand). Errors are complete messages.
pub fn main(argv: &[String]) -> Result<(), String> {
    let a = parse_args(argv)?;
    let model = a
        .model
        .clone()
        .ok_or("run needs a model file (see nnscaler --help)")?;
    let output = a.output.clone().ok_or("run needs -o OUT.safetensors")?;
    let source = read_input(&model)?;
    let ir = IrContext::new();
    let render = |d: Diagnostics| -> String {
        d.0.iter()
            .map(|x| x.render(Some(&source)))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let module = ir.parse(&source, &model).map_err(render)?;
    let d = verify_module(&module);
    if d.has_errors() {
        return Err(render(d));
    }
    let mut funcs: Vec<Result<Graph, (SrcLoc, String)>> = Graph::all_in(&module)
        .into_iter()
        .map(|f| f.map_err(|e| (e.loc, e.message)))
        .collect();
    let name_of = |f: &Result<Graph, (SrcLoc, String)>| match f {
        Ok(g) => g.name.clone(),
        Err(_) => String::new(),
    };
    let names: Vec<String> = funcs.iter().map(name_of).collect();
    let pick = match &a.func {
        Some(f) => names.iter().position(|n| n == f).ok_or_else(|| {
            format!(
                "{model}: no function @{f} (functions: {})",
                names.join(", ")
            )
        })?,
        None if funcs.len() == 1 => 0,
        None => names.iter().position(|n| n == "train").ok_or_else(|| {
            format!(
                "{model}: several functions ({}); choose one with --func",
                names.join(", ")
            )
        })?,
    };
    let mut g = funcs.swap_remove(pick).map_err(|(loc, m)| {
        let mut d = Diagnostics::default();
        d.error(&loc, m);
        render(d)
    })?;
    if a.autodiff {
        g = differentiate(&g).map_err(|(loc, m)| {
            let mut d = Diagnostics::default();
            d.error(&loc, m);
            render(d)
        })?;
    }
    let has_params = g.args.iter().any(|x| x.is_param());
    let params = match (&a.params, a.seed) {
        (Some(p), _) => ParamSource::File(p.clone(), io::load(Path::new(p))?),
        (None, Some(s)) => ParamSource::Seed(s),
        (None, None) if has_params => {
            return Err(format!(
                "@{} has parameters: give --params FILE or --init-seed S",
                g.name
            ))
        }
        (None, None) => ParamSource::Seed(0),
    };
    let (inputs_file, stored) = match &a.inputs {
        Some(f) => (f.clone(), io::load(Path::new(f))?),
        None => ("(no --inputs)".to_string(), Vec::new()),
    };
    // A localized function takes whole tensors: bind against its global view.
    let mut d = Diagnostics::default();
    let meshes = Meshes::collect(&module, &mut d);
    let view = if g.is_localized() {
        if a.autodiff {
            return Err(format!(
                "--autodiff: @{} is localized; differentiate before partitioning",
                g.name
            ));
        }
        let mesh = meshes.resolve(None).map_err(|e| format!("{model}: {e}"))?;
        global_view(&g, mesh).map_err(|e| format!("{model}: @{}: {e}", g.name))?
    } else {
        g.clone()
    };
    let values = bind(&view, &inputs_file, stored, &params)?;
    // Serialized now (run consumes the values), written only once the run succeeded.
    let saved_params = match &a.save_params {
        Some(path) => {
            let named: Vec<(String, Elem, &nnscaler_runtime::Tensor)> = g
                .args
                .iter()
                .zip(&values)
                .filter(|(x, _)| x.is_param())
                .map(|(x, t)| {
                    (
                        x.name().unwrap_or("").to_string(),
                        g.values[x.value].elem,
                        t,
                    )
                })
                .collect();
            Some((path.clone(), io::to_bytes(&named)?))
        }
        None => None,
    };
    let opts = Options {
        check_finite: a.check_finite,
    };
    let outs = if g.is_localized() {
        let mesh = meshes.resolve(None).map_err(|e| format!("{model}: {e}"))?;
        if let Some(n) = a.devices {
            if n != mesh.devices() {
                return Err(format!(
                    "--devices {n}, but @{} runs on mesh '@{}' of {} devices",
                    g.name,
                    mesh.name,
                    mesh.devices()
                ));
            }
        }
        run_spmd(&g, mesh, values, &opts)
    } else {
        if let Some(n) = a.devices.filter(|&n| n > 1) {
            return Err(format!(
                "--devices {n}: @{} is a single-device function; partition it first (nnscaler-opt --plan=... --propagate-layouts --split-tensor --lower-relayouts --localize)",
                g.name
            ));
        }
        nnscaler_runtime::run(&g, values, &opts)
    }
    .map_err(|e| {
        let mut d = Diagnostics::default();
        d.error(&e.loc, e.message);
        render(d)
    })?;
    let named: Vec<(String, Elem, &nnscaler_runtime::Tensor)> = g
        .outputs
        .iter()
        .zip(&outs)
        .enumerate()
        .map(|(i, (o, t))| {
            (
                o.name()
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("out{i}")),
                g.values[o.value].elem,
                t,
            )
        })
        .collect();
    let results = io::to_bytes(&named)?;
    if let Some((path, bytes)) = saved_params {
        write_output_bytes(&path, &bytes)?;
    }
    write_output_bytes(&output, &results)?;
    Ok(())
}
