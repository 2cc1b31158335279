//! Writing a transformed [`Graph`] back into a module.
//!
//! Graph-level passes read each function into a [`Graph`], transform it, and the module is
//! re-created from the printed functions (every op keeps its `loc(...)`), with all other
//! top-level ops (meshes, ...) printed as they were.

use melior::ir::Module;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::view::top_level_ops;

/// Calls `f` on every `func.func` of `module` as a graph (in order); where it returns a new
/// graph, that function is replaced. Other top-level ops are kept.
pub fn rewrite_funcs<'c>(
    ir: &'c IrContext,
    module: &mut Module<'c>,
    f: &mut dyn FnMut(Graph) -> Result<Option<Graph>, Diagnostics>,
) -> Result<(), Diagnostics> {
    let mut pieces: Vec<String> = Vec::new();
    let mut diags = Diagnostics::default();
    let mut changed = false;
    top_level_ops(module, &mut |op| {
        let is_func = op.name().as_string_ref().as_str() == Ok("func.func");
        if !is_func {
            pieces.push(nnscaler_dialects::view::op_text_with_locs(op));
            return;
        }
        match Graph::from_func(op) {
            Err(e) => diags.error(&e.loc, e.message),
            Ok(g) => match f(g) {
                Ok(Some(new)) => {
                    changed = true;
                    pieces.push(new.to_mlir());
                }
                Ok(None) => pieces.push(op.to_string()),
                Err(d) => diags.extend(d),
            },
        }
    });
    if diags.has_errors() {
        return Err(diags);
    }
    if !changed {
        return Ok(());
    }
    let text = format!("module {{\n{}\n}}\n", pieces.join("\n"));
    *module = ir.parse(&text, "<rewritten>")?;
    Ok(())
}
