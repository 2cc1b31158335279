//! The interpreter: executes a [`Graph`] op by op on the CPU kernels.

use crate::io::Stored;
use crate::kernels::{kernel, Ctx};
use crate::tensor::{matches, supported, Data, Tensor};
use crate::{init, tensor};
use nnscaler_dialects::diag::SrcLoc;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::types::{AttrValue, Elem, TensorType};
use nnscaler_dialects::userop::callee;
use std::borrow::Cow;
use std::collections::BTreeMap;

/// A failed execution: what went wrong and at which op.
#[derive(Clone, Debug)]
pub struct RunError {
    /// Location of the failing op (or of the function for argument errors).
    pub loc: SrcLoc,
    /// The message.
    pub message: String,
}

/// An error located at `loc`.
fn fail(loc: &SrcLoc, message: String) -> RunError {
    RunError {
        loc: loc.clone(),
        message,
    }
}

/// Execution options.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Stop at the first op whose results contain NaN or infinity, naming it.
    pub check_finite: bool,
    /// On simulated devices: time every device's ops ([`crate::spmd::device_profiles`]).
    pub profile_devices: bool,
    /// On simulated devices: run them one at a time and time them on a virtual clock by
    /// their threads' CPU time (serial timing, see [`crate::spmd`]). Use one thread for
    /// matrix products: other threads' time is not counted.
    pub serial_devices: bool,
}

/// Time spent per op name, accumulated over runs.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// `(op name, calls, seconds)`, in first-seen order.
    pub ops: Vec<(String, usize, f64)>,
}

impl Profile {
    fn add(&mut self, op: &str, secs: f64) {
        self.add_calls(op, 1, secs);
    }

    /// Adds `calls` calls of `op` taking `secs` in all.
    fn add_calls(&mut self, op: &str, calls: usize, secs: f64) {
        match self.ops.iter_mut().find(|(n, _, _)| n == op) {
            Some(e) => {
                e.1 += calls;
                e.2 += secs;
            }
            None => self.ops.push((op.to_string(), calls, secs)),
        }
    }

    /// Adds `other`'s calls and seconds, op by op.
    pub fn merge(&mut self, other: &Profile) {
        for (op, calls, secs) in &other.ops {
            self.add_calls(op, *calls, *secs);
        }
    }

    /// A table of ops by total time, largest first.
    pub fn report(&self) -> String {
        let mut v = self.ops.clone();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        let total: f64 = v.iter().map(|e| e.2).sum();
        let mut s = format!("{:<26} {:>7} {:>10} {:>6}\n", "op", "calls", "ms", "%");
        for (n, c, t) in v {
            s += &format!(
                "{n:<26} {c:>7} {:>10.3} {:>5.1}%\n",
                t * 1e3,
                100.0 * t / total.max(1e-12)
            );
        }
        s += &format!("{:<26} {:>7} {:>10.3}\n", "total", "", total * 1e3);
        s
    }
}

/// Runs `g` on `inputs` (one per argument, in order) and returns its results.
pub fn run(g: &Graph, inputs: Vec<Tensor>, opts: &Options) -> Result<Vec<Tensor>, RunError> {
    run_profiled(g, inputs, opts, None)
}

/// [`run`], adding each op's time to `profile` when given.
pub fn run_profiled(
    g: &Graph,
    inputs: Vec<Tensor>,
    opts: &Options,
    profile: Option<&mut Profile>,
) -> Result<Vec<Tensor>, RunError> {
    run_on(g, inputs, opts, profile, None)
}

/// [`run_profiled`] as simulated device `device` (which runs the `nns` collectives).
pub fn run_on(
    g: &Graph,
    inputs: Vec<Tensor>,
    opts: &Options,
    profile: Option<&mut Profile>,
    device: Option<&crate::spmd::Device<'_>>,
) -> Result<Vec<Tensor>, RunError> {
    let inputs = inputs.into_iter().map(Cow::Owned).collect();
    run_graph(g, &g.callees, inputs, opts, profile, device, 0)
}

/// How deep calls may nest (a user op calling itself would otherwise never end).
const MAX_CALL_DEPTH: usize = 64;

/// Runs `g` on `inputs`: owned at the top, borrowed from the caller's values in a call
/// (a callee reads its arguments where they are; it copies one only to reshape it in
/// place).
fn run_graph(
    g: &Graph,
    callees: &BTreeMap<String, Graph>,
    inputs: Vec<Cow<'_, Tensor>>,
    opts: &Options,
    mut profile: Option<&mut Profile>,
    device: Option<&crate::spmd::Device<'_>>,
    depth: usize,
) -> Result<Vec<Tensor>, RunError> {
    crate::alloc::keep_freed_memory();
    // The profile's clock: the wall clock, or under serial timing the device's serial
    // clock (its own CPU time, and at a collective or receive the wait for its partners
    // as the serial clock counts it) or, on one device, this thread's CPU time.
    let origin = std::time::Instant::now();
    let clock = || -> f64 {
        match (opts.serial_devices, device) {
            (true, Some(d)) => d.serial_now(),
            (true, None) => crate::spmd::thread_cpu_seconds(),
            (false, _) => origin.elapsed().as_secs_f64(),
        }
    };
    let device_info = device.map(|d| crate::kernels::DeviceInfo {
        names: d.mesh.axes.iter().map(|a| a.name.clone()).collect(),
        sizes: d.mesh.axes.iter().map(|a| a.size as usize).collect(),
        coords: d.current_coords(),
    });
    if inputs.len() != g.args.len() {
        return Err(fail(
            &g.loc,
            format!(
                "@{} takes {} arguments, got {}",
                g.name,
                g.args.len(),
                inputs.len()
            ),
        ));
    }
    let last_use = last_uses(g);
    let mut vals = bind_args(g, inputs)?;
    for (k, n) in g.nodes.iter().enumerate() {
        if n.op == "dnn.reshape" && last_use[n.inputs[0]] == k {
            // The input dies here: reuse its buffer instead of copying it.
            let t = vals[n.inputs[0]]
                .take()
                .expect("inputs are computed before use");
            vals[n.outputs[0]] = Some(Cow::Owned(
                t.into_owned()
                    .reshaped(&tensor::dims(&g.values[n.outputs[0]])),
            ));
            continue;
        }
        if n.op.starts_with("nns.") {
            let dev = device.ok_or_else(|| {
                fail(&n.loc, format!("'{}' needs simulated devices: localize the function and run it on its mesh", n.op))
            })?;
            let here = |e: String| fail(&n.loc, format!("'{}': {e}", n.op));
            // Communication is profiled too: its time includes waiting for the peers.
            let start = profile.as_ref().map(|_| clock());
            let timed = |p: &mut Option<&mut Profile>| {
                if let (Some(p), Some(t)) = (p.as_deref_mut(), start) {
                    p.add(&n.op, clock() - t);
                }
            };
            if n.op == "nns.recv" {
                let t = dev.recv(n).map_err(here)?;
                timed(&mut profile);
                if !matches(&t, &g.values[n.outputs[0]]) {
                    return Err(here(format!(
                        "received {} but the IR declares {}",
                        t.describe(),
                        g.values[n.outputs[0]]
                    )));
                }
                vals[n.outputs[0]] = Some(Cow::Owned(t));
                continue;
            }
            let x = vals[n.inputs[0]]
                .as_deref()
                .expect("inputs are computed before use");
            if n.op == "nns.send" {
                dev.send(n, x).map_err(here)?;
                timed(&mut profile);
                if last_use[n.inputs[0]] == k {
                    vals[n.inputs[0]] = None;
                }
                continue;
            }
            let t = dev.collective(n, x).map_err(here)?;
            timed(&mut profile);
            if !matches(&t, &g.values[n.outputs[0]]) {
                return Err(fail(
                    &n.loc,
                    format!(
                        "'{}' produced {} but the IR declares {}",
                        n.op,
                        t.describe(),
                        g.values[n.outputs[0]]
                    ),
                ));
            }
            if last_use[n.inputs[0]] == k {
                vals[n.inputs[0]] = None;
            }
            vals[n.outputs[0]] = Some(Cow::Owned(round_to(t, &g.values[n.outputs[0]])));
            continue;
        }
        let ins: Vec<&Tensor> = n
            .inputs
            .iter()
            .map(|&v| vals[v].as_deref().expect("inputs are computed before use"))
            .collect();
        let out_types: Vec<_> = n.outputs.iter().map(|&v| g.values[v].clone()).collect();
        // Who computes the op, for the profile and messages, and its results.
        let (what, outs) = if n.op == "func.call" {
            let name =
                callee(&n.attrs).ok_or_else(|| fail(&n.loc, "'func.call' has no callee".into()))?;
            let what = format!("@{name}");
            let start = profile.as_ref().map(|_| clock());
            let outs = if let Some(spec) = g.user_ops.1 .0.get(name) {
                // A user op implemented in C.
                let outs = crate::ckernel::call(spec, name, &ins, &out_types)
                    .map_err(|e| fail(&n.loc, e))?;
                if let (Some(p), Some(t)) = (profile.as_deref_mut(), start) {
                    p.add(&what, clock() - t);
                }
                outs
            } else {
                // A user op (or any function) whose body is IR: run the callee's graph
                // (its ops are profiled one by one).
                let f = callees.get(name).ok_or_else(|| {
                    fail(
                        &n.loc,
                        format!("@{name} is not a function the runtime can run (a declaration without 'nns.kernel', or not in the module)"),
                    )
                })?;
                if depth >= MAX_CALL_DEPTH {
                    return Err(fail(
                        &n.loc,
                        format!(
                            "calls nest more than {MAX_CALL_DEPTH} deep (does @{name} call itself?)"
                        ),
                    ));
                }
                let args: Vec<Cow<'_, Tensor>> = ins.iter().map(|&t| Cow::Borrowed(t)).collect();
                let at = CallAt {
                    fragment: n.attrs.get("nns.fragment"),
                    device,
                    depth: depth + 1,
                };
                run_at(f, callees, args, opts, profile.as_deref_mut(), at)?
            };
            (what, outs)
        } else {
            let f = kernel(&n.op).ok_or_else(|| {
                fail(
                    &n.loc,
                    format!("the CPU runtime has no kernel for '{}'", n.op),
                )
            })?;
            let ctx = Ctx {
                op: &n.op,
                attrs: &n.attrs,
                out: &out_types,
                device: device_info.as_ref(),
            };
            let start = profile.as_ref().map(|_| clock());
            let outs = f(&ctx, &ins).map_err(|e| fail(&n.loc, format!("'{}': {e}", n.op)))?;
            if let (Some(p), Some(t)) = (profile.as_deref_mut(), start) {
                p.add(&n.op, clock() - t);
            }
            (format!("'{}'", n.op), outs)
        };
        check_results(n, &what, &outs, &out_types, opts.check_finite)?;
        for &v in &n.inputs {
            if last_use[v] == k {
                vals[v] = None;
            }
        }
        for (&v, t) in n.outputs.iter().zip(outs) {
            vals[v] = Some(Cow::Owned(round_to(t, &g.values[v])));
        }
    }
    // Results are moved out (a value returned twice, or an argument, is copied).
    let mut results = Vec::with_capacity(g.outputs.len());
    for (j, o) in g.outputs.iter().enumerate() {
        let again = g.outputs[j + 1..].iter().any(|x| x.value == o.value);
        let t = if again {
            vals[o.value].as_deref().cloned()
        } else {
            vals[o.value].take().map(Cow::into_owned)
        };
        results.push(t.expect("results are computed"));
    }
    Ok(results)
}

/// Where a call runs: its pipeline fragment (`nns.fragment`), its device, its depth.
struct CallAt<'a, 'd> {
    fragment: Option<&'a AttrValue>,
    device: Option<&'a crate::spmd::Device<'d>>,
    depth: usize,
}

/// Runs callee `f` for a call at `at`: a pipeline fragment runs at its micro-batch's
/// coordinate on the micro-batch axis (`nns.fragment = "<stage><F|B|W><mb>"`), restored
/// after.
fn run_at(
    f: &Graph,
    callees: &BTreeMap<String, Graph>,
    args: Vec<Cow<'_, Tensor>>,
    opts: &Options,
    profile: Option<&mut Profile>,
    at: CallAt<'_, '_>,
) -> Result<Vec<Tensor>, RunError> {
    let device = at.device;
    let mb = match (at.fragment, device) {
        (Some(AttrValue::Str(f)), Some(_)) => f
            .rfind(['F', 'B', 'W'])
            .and_then(|k| f[k + 1..].parse::<usize>().ok()),
        _ => None,
    };
    let before = device.map(|d| d.microbatch.replace(mb.or(d.microbatch.get())));
    let r = run_graph(f, callees, args, opts, profile, device, at.depth);
    if let (Some(d), Some(b)) = (device, before) {
        d.microbatch.set(b);
    }
    r
}

/// That node `n`'s kernel or call (`what`) gave as many results as it declares, each of
/// its declared type, and (with `check_finite`) every f32 element finite.
fn check_results(
    n: &nnscaler_dialects::graph::Node,
    what: &str,
    outs: &[Tensor],
    out_types: &[TensorType],
    check_finite: bool,
) -> Result<(), RunError> {
    if outs.len() != n.outputs.len() {
        return Err(fail(
            &n.loc,
            format!(
                "{what} returned {} results for {} declared",
                outs.len(),
                n.outputs.len()
            ),
        ));
    }
    for (j, (t, ty)) in outs.iter().zip(out_types).enumerate() {
        if !matches(t, ty) {
            return Err(fail(
                &n.loc,
                format!(
                    "{what} result {j} is declared {ty} but it produced {}",
                    t.describe()
                ),
            ));
        }
        if check_finite {
            if let Data::F32(v) = &t.data {
                if let Some(p) = v.iter().position(|x| !x.is_finite()) {
                    return Err(fail(
                        &n.loc,
                        format!(
                            "{what} result {j} has a non-finite value ({}) at element {p}",
                            v[p]
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Per value, the index of the last node reading it (`usize::MAX` for results and values
/// never read).
fn last_uses(g: &Graph) -> Vec<usize> {
    let mut last_use = vec![usize::MAX; g.values.len()];
    for (k, n) in g.nodes.iter().enumerate() {
        for &v in &n.inputs {
            last_use[v] = k;
        }
    }
    for o in &g.outputs {
        last_use[o.value] = usize::MAX;
    }
    last_use
}

/// Graph `g`'s values with its arguments bound to `inputs` (checked against their types).
fn bind_args<'a>(
    g: &Graph,
    inputs: Vec<Cow<'a, Tensor>>,
) -> Result<Vec<Option<Cow<'a, Tensor>>>, RunError> {
    let mut vals: Vec<Option<Cow<'_, Tensor>>> = vec![None; g.values.len()];
    for (i, (a, t)) in g.args.iter().zip(inputs).enumerate() {
        let ty = &g.values[a.value];
        if !matches(&t, ty) {
            return Err(fail(
                &g.loc,
                format!(
                    "argument {i}{} is {ty} but got {}",
                    a.name().map(|n| format!(" '{n}'")).unwrap_or_default(),
                    t.describe()
                ),
            ));
        }
        vals[a.value] = Some(t);
    }
    Ok(vals)
}

/// `t` as a value of type `ty`: floats are computed in f32, so a bf16 result is rounded to
/// bf16 here, once, after the kernel (as a GPU kernel or GEMM accumulates in f32 and stores
/// bf16). Other types are held exactly.
fn round_to(mut t: Tensor, ty: &TensorType) -> Tensor {
    if ty.elem == Elem::BF16 {
        if let Data::F32(v) = &mut t.data {
            for x in v {
                *x = nnscaler_dialects::scalar::round_bf16(*x);
            }
        }
    }
    t
}

/// Where parameter values come from.
#[derive(Clone, Debug)]
pub enum ParamSource {
    /// Tensors read from a file (named by the file name in messages).
    File(String, Vec<Stored>),
    /// Drawn with the init rules under this seed.
    Seed(u64),
}

/// Matches named tensors to the arguments of `g`: inputs from `inputs` (file name
/// `inputs_file`), parameters from `params`. Every missing, extra or mis-typed tensor is an
/// error naming it and the file.
pub fn bind(
    g: &Graph,
    inputs_file: &str,
    inputs: Vec<Stored>,
    params: &ParamSource,
) -> Result<Vec<Tensor>, String> {
    let mut ins: BTreeMap<String, Stored> =
        inputs.into_iter().map(|s| (s.name.clone(), s)).collect();
    let mut ps: BTreeMap<String, Stored> = match params {
        ParamSource::File(_, v) => v.iter().cloned().map(|s| (s.name.clone(), s)).collect(),
        ParamSource::Seed(_) => BTreeMap::new(),
    };
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for (i, a) in g.args.iter().enumerate() {
        let ty = &g.values[a.value];
        if !supported(ty.elem) {
            problems.push(format!(
                "argument {i} has element type {}; the CPU runtime supports f32, i64 and i32",
                ty.elem
            ));
            continue;
        }
        let name = a
            .name()
            .map(str::to_string)
            .unwrap_or_else(|| format!("arg{i}"));
        let (pool, file) = match (a.is_state(), params) {
            (true, ParamSource::Seed(seed)) => {
                out.push(init::init_param(g, i, *seed)?);
                continue;
            }
            (true, ParamSource::File(f, _)) => (&mut ps, f.as_str()),
            (false, _) => (&mut ins, inputs_file),
        };
        let Some(s) = pool.remove(&name) else {
            problems.push(format!("{file}: missing tensor '{name}' ({ty})"));
            continue;
        };
        if s.elem != ty.elem || tensor::dims(ty) != s.tensor.shape {
            problems.push(format!(
                "{file}: tensor '{name}' is {} but argument {i} is {ty}",
                stored_type(&s)
            ));
            continue;
        }
        out.push(s.tensor);
    }
    for (pool, file) in [(&ins, inputs_file), (&ps, param_file(params))] {
        for (name, s) in pool {
            problems.push(format!(
                "{file}: unexpected tensor '{name}' ({}): @{} has no {} of that name",
                stored_type(s),
                g.name,
                if std::ptr::eq(pool, &ins) {
                    "input"
                } else {
                    "parameter"
                }
            ));
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems.join("\n"))
    }
}

fn param_file(p: &ParamSource) -> &str {
    match p {
        ParamSource::File(f, _) => f,
        ParamSource::Seed(_) => "",
    }
}

fn stored_type(s: &Stored) -> String {
    let dims: String = s.tensor.shape.iter().map(|d| format!("{d}x")).collect();
    format!("tensor<{dims}{}>", s.elem)
}
