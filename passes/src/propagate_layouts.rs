//! `--propagate-layouts`: gives every value a layout.
//!
//! Arguments keep their `nns.layout` (replicated when absent). In program order, each `dnn`
//! op takes the split of its directive (`nns.split`); an op without one follows its
//! operands: the identifier annotating each split operand dim is split over the same mesh
//! axes (see `sharding::infer_binds`), and the inferred directive is written. The op's
//! result layouts follow from its annotation (`nns.layouts`). Each function result gets the
//! layout it must end with (`nns.layout`): a `grad.<p>` result that of parameter `p`,
//! anything else replicated, unless one is written.

use crate::layouts::{
    annotation, directive, error, layout_attr, layouts_attr, node_layouts, the_mesh, value_layouts,
};
use crate::pipeline::{Pass, PassOptions};
use crate::rewrite::rewrite_funcs;
use melior::ir::Module;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::sharding::{binds_to_split, infer_binds, Sharding};
use nnscaler_dialects::types::AttrValue;

/// The pass.
#[derive(Debug)]
pub struct PropagateLayouts;

impl PropagateLayouts {
    /// No options.
    pub fn new(_: &PassOptions) -> Result<Self, String> {
        Ok(PropagateLayouts)
    }
}

impl Pass for PropagateLayouts {
    fn run<'c>(&mut self, ir: &'c IrContext, module: &mut Module<'c>) -> Result<(), Diagnostics> {
        let mesh = the_mesh(module, "propagate-layouts")?;
        rewrite_funcs(ir, module, &mut |g| propagate(g, &mesh).map(Some))
    }
}

/// Propagates layouts through `g` (see the module docs).
pub fn propagate(mut g: Graph, mesh: &Mesh) -> Result<Graph, Diagnostics> {
    let mut layouts = value_layouts(&g, mesh)?;
    for k in 0..g.nodes.len() {
        let n = g.nodes[k].clone();
        let ranks: Vec<usize> = n.outputs.iter().map(|&v| g.values[v].rank()).collect();
        if !n.op.starts_with("dnn.") {
            // nns ops: their layouts are written (relayouts) or replicated.
            for (j, &v) in n.outputs.iter().enumerate() {
                if layouts[v].is_none() {
                    layouts[v] = Some(Sharding::replicated(ranks[j], mesh.axes.len()));
                }
            }
            continue;
        }
        let fail = |e: String| error(&n.loc, format!("propagate-layouts: '{}': {e}", n.op));
        let binds = match directive(&n, mesh).map_err(fail)? {
            Some(b) => b,
            None => {
                let (anno, binding) = annotation(&g, &n).map_err(fail)?;
                let ops: Vec<Option<&Sharding>> =
                    n.inputs.iter().map(|&v| layouts[v].as_ref()).collect();
                let b = infer_binds(&anno, &binding, &ops);
                if !b.is_empty() {
                    g.nodes[k].attrs.insert(
                        "nns.split".into(),
                        AttrValue::Nns {
                            kind: "split".into(),
                            body: binds_to_split(&b, mesh).to_string(),
                        },
                    );
                }
                b
            }
        };
        let ops: Vec<Option<&Sharding>> = n.inputs.iter().map(|&v| layouts[v].as_ref()).collect();
        let l = node_layouts(&g, &n, mesh, &binds, &ops).map_err(fail)?;
        g.nodes[k]
            .attrs
            .insert("nns.layouts".into(), layouts_attr(&l.outputs, mesh));
        for (&v, s) in n.outputs.iter().zip(l.outputs) {
            layouts[v] = Some(s);
        }
    }
    let params: Vec<(String, Option<Sharding>)> = g
        .args
        .iter()
        .filter(|a| a.is_param())
        .map(|a| (a.name().unwrap_or("").to_string(), layouts[a.value].clone()))
        .collect();
    for o in &mut g.outputs {
        if o.attrs.contains_key("nns.layout") {
            continue;
        }
        let rank = g.values[o.value].rank();
        let grad_of = o
            .name()
            .and_then(|n| n.strip_prefix("grad."))
            .map(str::to_string);
        let want = grad_of
            .and_then(|p| {
                params
                    .iter()
                    .find(|(n, _)| *n == p)
                    .and_then(|(_, s)| s.clone())
            })
            .unwrap_or_else(|| Sharding::replicated(rank, mesh.axes.len()));
        o.attrs
            .insert("nns.layout".into(), layout_attr(&want, mesh));
    }
    Ok(g)
}
