//! `--lower-relayouts`: turns each `nns.relayout` into the cheapest sequence of collectives
//! from its operand's layout to its target (`sharding::TransitionSearch`: all_reduce,
//! reduce_scatter, all_gather, all_to_all, local slice). Without options the cheapest is
//! the fewest bytes sent plus a fixed charge per collective (`sharding::HOP_BYTES`); with
//! `cluster=` (or, without it, the module's `nns.cluster`, which `--plan=tp-search`
//! records) it is the fewest seconds the cost model predicts on that cluster
//! (`cost::relayout_price`, each step as `cost::predict` prices the op it becomes), which
//! is what the split search assumes when it plans for the same cluster. Every collective
//! records the layout it produces in `nns.layouts`. A relayout with no route (e.g. to a
//! partial layout) is an error at its location.

use crate::layouts::{error, layouts_attr, the_mesh, value_layouts};
use crate::pass::{FunctionPass, PassOptions};
use crate::planner::cost::{self, Cluster, CLUSTER_ATTR};
use melior::ir::OperationRef;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::sharding::TransitionSearch;
use nnscaler_dialects::types::AttrValue;
use nnscaler_dialects::verify::file_loc;
use nnscaler_dialects::view::OpView;

/// The pass.
#[derive(Debug, Default)]
pub struct LowerRelayouts {
    mesh: Option<Mesh>,
    search: TransitionSearch,
    /// The cluster whose predicted seconds choose the collectives (`cluster=`).
    cluster: Option<Cluster>,
}

impl LowerRelayouts {
    /// Option `cluster=PRESET|FILE`.
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        let cluster = o
            .get("cluster")
            .map(|c| cost::load(c).map_err(|e| format!("lower-relayouts: {e}")))
            .transpose()?;
        Ok(LowerRelayouts {
            cluster,
            ..LowerRelayouts::default()
        })
    }
}

impl FunctionPass for LowerRelayouts {
    fn prepare(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        let mesh = the_mesh(module, "lower-relayouts")?;
        // Without cluster=, the cluster a plan recorded (`--plan=tp-search`'s
        // `nns.cluster`), so that relayouts become the collectives the plan priced; read
        // for each module, not kept.
        let recorded = match (&self.cluster, OpView::of(module).attrs.get(CLUSTER_ATTR)) {
            (None, Some(AttrValue::Str(spec))) => Some(cost::load(spec).map_err(|e| {
                error(
                    &file_loc(""),
                    format!("lower-relayouts: the cluster the plan was made for ('{CLUSTER_ATTR}' = \"{spec}\"): {e}; give --lower-relayouts=cluster=PRESET|FILE"),
                )
            })?),
            (None, Some(v)) => {
                return Err(error(
                    &file_loc(""),
                    format!("lower-relayouts: the module's '{CLUSTER_ATTR}' must name a cluster (a preset or a TOML file), got {}", v.to_mlir_text()),
                ))
            }
            _ => None,
        };
        // Micro-batches are steps in time: no collective runs over them (a --schedule-*
        // pass turns the reductions over them into accumulation first).
        let fixed = (0..mesh.axes.len())
            .filter(|&a| mesh.axes[a].microbatches)
            .collect();
        self.search = match self.cluster.as_ref().or(recorded.as_ref()) {
            Some(c) => TransitionSearch::priced(fixed, cost::relayout_price(c, &mesh)),
            None => TransitionSearch::with_fixed_axes(fixed),
        };
        self.mesh = Some(mesh);
        Ok(())
    }
    fn run_on_function(&mut self, g: Graph) -> Result<Option<Graph>, Diagnostics> {
        let mesh = self.mesh.as_ref().expect("prepare runs first");
        lower(g, mesh, &mut self.search).map(Some)
    }
}

/// Lowers every relayout of `g`.
pub fn lower(
    mut g: Graph,
    mesh: &Mesh,
    search: &mut TransitionSearch,
) -> Result<Graph, Diagnostics> {
    let mut layouts = value_layouts(&g, mesh)?;
    let sizes: Vec<i64> = mesh.axes.iter().map(|a| a.size).collect();
    let old = std::mem::take(&mut g.nodes);
    let mut replace: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let subst = |replace: &[Option<ValueId>], v: ValueId| {
        replace.get(v.index()).copied().flatten().unwrap_or(v)
    };
    for mut n in old {
        for v in &mut n.inputs {
            *v = subst(&replace, *v);
        }
        if n.op != "nns.relayout" {
            g.nodes.push(n);
            continue;
        }
        let src = n.inputs[0];
        let (Some(from), Some(to)) = (layouts[src].clone(), layouts[n.outputs[0]].clone()) else {
            return Err(error(&n.loc, "lower-relayouts: the relayout's operand has no layout; run --propagate-layouts first"));
        };
        let ty = g.values[src].clone();
        let t = search
            .find(&from, &to, &ty.shape, ty.elem, &sizes)
            .ok_or_else(|| {
                error(
                    &n.loc,
                    format!(
                        "lower-relayouts: no collective sequence turns {} into {}",
                        from.to_layout(mesh),
                        to.to_layout(mesh)
                    ),
                )
            })?;
        let mut cur = src;
        let mut state = from;
        for step in &t.steps {
            state = step.apply(&state);
            let mut attrs = step.op_attrs(mesh);
            // A collective among one device (its axes all of size 1: `dp=1` in a pipeline,
            // say) is the identity; it is not emitted.
            let alone = match attrs.get("axes") {
                Some(AttrValue::Strs(names)) => names
                    .iter()
                    .all(|a| mesh.axis(a).is_some_and(|size| size == 1)),
                _ => false,
            };
            if alone {
                continue;
            }
            attrs.insert(
                "nns.layouts".into(),
                layouts_attr(std::slice::from_ref(&state), mesh),
            );
            cur = g.add_raw(step.op_name(), &[cur], vec![ty.clone()], attrs, &n.loc)[0];
            layouts.resize(g.values.len(), None);
            layouts[cur] = Some(state.clone());
        }
        replace.resize(g.values.len(), None);
        replace[n.outputs[0]] = Some(cur);
    }
    for o in &mut g.outputs {
        o.value = subst(&replace, o.value);
    }
    Ok(g)
}
