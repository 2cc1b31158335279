//! `--split-tensor`: makes every op's operands arrive in the layout its split needs.
//!
//! With every value's layout known (`--propagate-layouts`), each operand whose layout
//! differs from what the consuming op's directive requires gets an
//! `nns.relayout {to = ...}` in front of the consumer (one per value and target layout);
//! so does each function result whose layout differs from its `nns.layout` — which is how
//! the gradients of replicated parameters get reduced across the axes they are replicated
//! on while sharded parameters' gradients stay sharded. Shapes stay global.
//!
//! A function without any layout (split directives only) is first given them by
//! `--propagate-layouts`, with a remark, as an MLIR pipeline runs a pass's prerequisite.

use crate::layouts::{
    directive, error, layout_attr, node_layouts, result_layouts, the_mesh, value_layouts,
};
use crate::pass::{FunctionPass, PassOptions};
use crate::transforms::propagate_layouts::{is_foreign, propagate};
use crate::transforms::recompute::{forward_ops, has_backward};
use melior::ir::OperationRef;
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::sharding::Sharding;
use nnscaler_dialects::types::Attrs;
use std::collections::HashMap;

/// The pass.
#[derive(Debug, Default)]
pub struct SplitTensor {
    mesh: Option<Mesh>,
    remarks: Diagnostics,
}

impl SplitTensor {
    /// No options.
    pub fn new(_: &PassOptions) -> Result<Self, String> {
        Ok(SplitTensor::default())
    }
}

impl FunctionPass for SplitTensor {
    fn prepare(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        self.mesh = Some(the_mesh(module, "split-tensor")?);
        Ok(())
    }
    fn run_on_function(&mut self, g: Graph) -> Result<Option<Graph>, Diagnostics> {
        let mesh = self.mesh.as_ref().expect("prepare runs first");
        // Its prerequisite, as MLIR pass pipelines add theirs: a function with no layout
        // at all gets them from --propagate-layouts first.
        let unlaid = g.nodes.iter().any(|n| n.op.starts_with("dnn."))
            && !g.nodes.iter().any(|n| n.attrs.contains_key("nns.layouts"));
        let g = if unlaid {
            self.remarks.remark(
                &g.loc,
                format!(
                    "split-tensor: @{} has no layouts; running --propagate-layouts first",
                    g.name
                ),
            );
            propagate(g, mesh, &mut self.remarks)?
        } else {
            g
        };
        split(g, mesh).map(Some)
    }
    fn take_remarks(&mut self) -> Diagnostics {
        std::mem::take(&mut self.remarks)
    }
}

/// Inserts the relayouts `g` needs (see the module docs).
pub fn split(mut g: Graph, mesh: &Mesh) -> Result<Graph, Diagnostics> {
    let mut layouts = value_layouts(&g, mesh)?;
    // A parameter is relayouted (gathered, under ZeRO-3) once for the forward and again
    // for the backward rather than kept whole in between: the phase is part of the key.
    let forward = if has_backward(&g) {
        forward_ops(&g)
    } else {
        vec![true; g.nodes.len()]
    };
    let params: Vec<ValueId> = g
        .args
        .iter()
        .filter(|a| a.is_param())
        .map(|a| a.value)
        .collect();
    let old = std::mem::take(&mut g.nodes);
    let mut made: HashMap<(ValueId, Sharding, bool), ValueId> = HashMap::new();
    let mut relayout = |g: &mut Graph,
                        layouts: &mut Vec<Option<Sharding>>,
                        v: ValueId,
                        want: &Sharding,
                        phase: bool,
                        loc: &SrcLoc|
     -> ValueId {
        if layouts[v].as_ref() == Some(want) {
            return v;
        }
        let key = (v, want.clone(), phase || !params.contains(&v));
        if let Some(&r) = made.get(&key) {
            return r;
        }
        let mut attrs = Attrs::new();
        attrs.insert("to".into(), layout_attr(want, mesh));
        let ty = g.values[v].clone();
        let r = g.add_raw("nns.relayout", &[v], vec![ty], attrs, loc)[0];
        layouts.resize(g.values.len(), None);
        layouts[r] = Some(want.clone());
        made.insert(key, r);
        r
    };
    for (k, mut n) in old.into_iter().enumerate() {
        let phase = forward[k];
        if n.op.starts_with("dnn.") || g.user_ops.of_call(&n.op, &n.attrs).is_some() {
            let fail = |e: String| error(&n.loc, format!("split-tensor: '{}': {e}", n.op));
            if !n.attrs.contains_key("nns.layouts") {
                return Err(fail("has no layouts; run --propagate-layouts first".into()));
            }
            let binds = directive(&n, mesh).map_err(fail)?.unwrap_or_default();
            let have: Vec<Option<Sharding>> =
                n.inputs.iter().map(|&v| layouts[v].clone()).collect();
            let refs: Vec<Option<&Sharding>> = have.iter().map(Option::as_ref).collect();
            let l = node_layouts(&g, &n, mesh, &binds, &refs).map_err(fail)?;
            let inputs = n.inputs.clone();
            for (i, &v) in inputs.iter().enumerate() {
                if let Some(want) = &l.inputs[i] {
                    n.inputs[i] = relayout(&mut g, &mut layouts, v, want, phase, &n.loc);
                }
            }
        } else if is_foreign(&n.op) {
            // Replicated (see propagate-layouts): every operand gathered, results R.
            let inputs = n.inputs.clone();
            for (i, &v) in inputs.iter().enumerate() {
                let want = Sharding::replicated(g.values[v].rank(), mesh.axes.len());
                n.inputs[i] = relayout(&mut g, &mut layouts, v, &want, phase, &n.loc);
            }
            for &v in &n.outputs {
                if layouts[v].is_none() {
                    layouts[v] = Some(Sharding::replicated(g.values[v].rank(), mesh.axes.len()));
                }
            }
        }
        g.nodes.push(n);
    }
    let want = result_layouts(&g, mesh)?;
    let ret_loc = g.loc.clone();
    for (i, w) in want.iter().enumerate() {
        let v = g.outputs[i].value;
        g.outputs[i].value = relayout(&mut g, &mut layouts, v, w, false, &ret_loc);
    }
    Ok(g)
}
