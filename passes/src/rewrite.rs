//! Running a function pass over the functions of a module, or over one function, in place.
//!
//! Each `func.func` with a body is read into a [`Graph`] (an analysis snapshot that remembers
//! the ops it was read from); where the transformation returns a new graph, the graph is
//! written back into that function ([`Graph::write_back`]): kept ops are updated, new ones
//! created, dropped ones erased. Nothing is printed or re-parsed, and other functions and
//! top-level ops are not touched. Declarations (functions without a body) and functions
//! that are not ours (no `dnn`/`nns` op, no `nns` attribute on their signature) are
//! skipped.

use crate::pass::{FunctionPass, Native};
use melior::ir::{OperationRef, RegionLike};
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::view::{top_level_ops, walk_nested, FuncView};

/// Runs the function pass `pass` on every function of the module op `module` that is ours
/// (in order), writing back in place the functions it changes; then calls its `finish`.
pub fn run_on_module(
    pass: &mut dyn FunctionPass,
    module: &OperationRef<'_, '_>,
) -> Result<Diagnostics, Diagnostics> {
    pass.prepare(module)?;
    let mut diags = Diagnostics::default();
    let mut changed: Vec<Graph> = Vec::new();
    top_level_ops(module, &mut |op| {
        if !is_ours(op) {
            return;
        }
        match Graph::from_func(op) {
            Err(e) => diags.error(&e.loc, e.message),
            Ok(g) => match pass.run_on_function(g) {
                Ok(Some(new)) => changed.push(new),
                Ok(None) => {}
                Err(d) => diags.extend(d),
            },
        }
    });
    if diags.has_errors() {
        return Err(diags);
    }
    // Written after the walk: the walk holds borrowed handles into the module.
    for g in &changed {
        write_back(g)?;
    }
    pass.finish()?;
    Ok(pass.take_remarks())
}

/// Runs the function pass `pass` on the one `func.func` op `func` (as an MLIR pass anchored
/// on `func.func` does): the module around it is read by `prepare`, and the function is
/// rewritten in place. A function that is not ours is left alone.
pub fn run_on_function(
    pass: &mut dyn FunctionPass,
    func: &OperationRef<'_, '_>,
) -> Result<Diagnostics, Diagnostics> {
    if !is_ours(func) {
        return Ok(Diagnostics::default());
    }
    // SAFETY: `func` is live; its parent (the module holding it) outlives this call.
    let parent = unsafe { mlir_sys::mlirOperationGetParentOperation(func.to_raw()) };
    if !parent.ptr.is_null() {
        pass.prepare(&unsafe { OperationRef::from_raw(parent) })?;
    }
    let g = Graph::from_func(func).map_err(|e| {
        let mut d = Diagnostics::default();
        d.error(&e.loc, e.message);
        d
    })?;
    if let Some(new) = pass.run_on_function(g)? {
        write_back(&new)?;
    }
    Ok(pass.take_remarks())
}

fn write_back(g: &Graph) -> Result<(), Diagnostics> {
    g.write_back().map_err(|e| {
        let mut d = Diagnostics::default();
        d.error(&g.loc, e);
        d
    })
}

/// Whether `op` is a function a graph pass works on: a `func.func` with a body that is a
/// program of ours. The definition of a user op (a function with `nns.annotation`) is not
/// a program: passes transform its calls, not its body.
pub(crate) fn is_ours(op: &OperationRef<'_, '_>) -> bool {
    op.name().as_string_ref().as_str() == Ok("func.func")
        && !is_declaration(op)
        && op.attribute("nns.annotation").is_err()
        && has_our_ops(op)
}

/// Whether `func` is a program of ours: it holds a `dnn` or `nns` op, or its arguments or
/// results carry `nns` attributes. Other functions (helpers in upstream dialects, with
/// `index` arguments or regions) are left alone instead of failing on what a graph cannot
/// hold.
fn has_our_ops(func: &melior::ir::OperationRef<'_, '_>) -> bool {
    let marked = FuncView::of(func).is_some_and(|f| {
        f.arg_attrs
            .iter()
            .chain(&f.result_attrs)
            .any(|a| a.keys().any(|k| k.starts_with("nns.")))
    });
    if marked {
        return true;
    }
    let mut found = false;
    walk_nested(func, &mut |op| {
        let name = op.name();
        let name = name.as_string_ref().as_str().unwrap_or("");
        found |= name.starts_with("dnn.") || name.starts_with("nns.");
    });
    found
}

/// Whether `func` is a declaration (`func.func private @f(...)` without a body).
fn is_declaration(func: &melior::ir::OperationRef<'_, '_>) -> bool {
    func.region(0)
        .map(|r| r.first_block().is_none())
        .unwrap_or(true)
}

/// Calls `f` on every function of the module op `module` that is ours, as a graph (in
/// order); where it returns a new graph, that function is rewritten in place.
pub fn rewrite_funcs(
    module: &OperationRef<'_, '_>,
    f: &mut dyn FnMut(Graph) -> Result<Option<Graph>, Diagnostics>,
) -> Result<(), Diagnostics> {
    struct Closure<'a>(&'a mut dyn FnMut(Graph) -> Result<Option<Graph>, Diagnostics>);
    impl FunctionPass for Closure<'_> {
        fn run_on_function(&mut self, g: Graph) -> Result<Option<Graph>, Diagnostics> {
            (self.0)(g)
        }
    }
    run_on_module(&mut Closure(f), module).map(|_| ())
}

/// Running a pass of either anchor (function passes through [`run_on_module`]).
impl Native {
    /// Runs the pass on the module op `module`, in place. Returns its remarks.
    pub fn run(&mut self, module: &OperationRef<'_, '_>) -> Result<Diagnostics, Diagnostics> {
        match self {
            Native::Module(p) => p.run(module).map(|()| p.take_remarks()),
            Native::Function(p) => run_on_module(p.as_mut(), module),
        }
    }
}

/// `g` without the values no argument or op defines (what passes replaced), as writing
/// the graph to MLIR and reading it back would leave it.
pub(crate) fn compact(mut g: Graph) -> Graph {
    let mut new: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let mut values = Vec::new();
    let defined = g
        .args
        .iter()
        .map(|a| a.value)
        .chain(g.nodes.iter().flat_map(|n| n.outputs.iter().copied()))
        .collect::<Vec<_>>();
    for v in defined {
        if new[v].is_none() {
            new[v] = Some(ValueId::new(values.len()));
            values.push(g.values[v].clone());
        }
    }
    let map = |v: ValueId| new[v].expect("every used value is defined");
    for a in &mut g.args {
        a.value = map(a.value);
    }
    for n in &mut g.nodes {
        for v in n.inputs.iter_mut().chain(n.outputs.iter_mut()) {
            *v = map(*v);
        }
    }
    for o in &mut g.outputs {
        o.value = map(o.value);
    }
    g.values = values;
    g
}
