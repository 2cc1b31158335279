//! Running a graph transformation over the functions of a module, in place.
//!
//! Each `func.func` with a body is read into a [`Graph`] (an analysis snapshot that remembers
//! the ops it was read from); where the transformation returns a new graph, the graph is
//! written back into that function ([`Graph::write_back`]): kept ops are updated, new ones
//! created, dropped ones erased. Nothing is printed or re-parsed, and other functions and
//! top-level ops are not touched. Declarations (functions without a body) and functions
//! that are not ours (no `dnn`/`nns` op, no `nns` attribute on their signature) are
//! skipped.

use melior::ir::{Module, RegionLike};
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::view::{top_level_ops, walk_nested, FuncView};

/// Calls `f` on every `func.func` of `module` that has a body, as a graph (in order); where
/// it returns a new graph, that function is rewritten in place.
pub fn rewrite_funcs(
    module: &mut Module<'_>,
    f: &mut dyn FnMut(Graph) -> Result<Option<Graph>, Diagnostics>,
) -> Result<(), Diagnostics> {
    let mut diags = Diagnostics::default();
    let mut changed: Vec<Graph> = Vec::new();
    top_level_ops(module, &mut |op| {
        if op.name().as_string_ref().as_str() != Ok("func.func")
            || is_declaration(op)
            || !has_our_ops(op)
        {
            return;
        }
        match Graph::from_func(op) {
            Err(e) => diags.error(&e.loc, e.message),
            Ok(g) => match f(g) {
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
        g.write_back().map_err(|e| {
            let mut d = Diagnostics::default();
            d.error(&g.loc, e);
            d
        })?;
    }
    Ok(())
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
