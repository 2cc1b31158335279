//! `--localize`: turns the global-shape program (every value with a layout, every
//! relayout lowered) into the program each device runs.
//!
//! The result is one SPMD function marked `nns.localized`: every type becomes the shape of
//! the piece one device holds; attributes that spell shapes follow (`reshape`,
//! `broadcast_to`, `fill` shapes; `embedding_grad`'s vocabulary); means whose reduced dim is
//! split divide by the global count (`count` on `mean`, `cross_entropy` and its gradient);
//! ops reading a shard of a dim that indexes (an embedding table's rows, the classes of
//! `pick` and `softmax_xent_grad`) learn which axes split it (`row_axes`, `offset_axes`),
//! from which each device computes where its block starts; `dropout` on a shard learns the
//! whole shape and the axes splitting each dim (`global_shape`, `dim_axes`), so its mask
//! is the single-device mask.
//! Collectives keep their mesh axes: the device group of a device along axes A is the set of
//! devices that share its coordinates on every other axis. Arguments and results keep their
//! `nns.layout`, which says how whole tensors are cut into, and assembled from, the pieces.

use crate::layouts::{error, the_mesh, value_layouts};
use crate::pipeline::{FunctionPass, PassOptions};
use melior::ir::OperationRef;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::types::AttrValue;

/// The pass.
#[derive(Debug, Default)]
pub struct Localize {
    mesh: Option<Mesh>,
}

impl Localize {
    /// No options.
    pub fn new(_: &PassOptions) -> Result<Self, String> {
        Ok(Localize::default())
    }
}

impl FunctionPass for Localize {
    fn prepare(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        self.mesh = Some(the_mesh(module, "localize")?);
        Ok(())
    }
    fn run_on_function(&mut self, g: Graph) -> Result<Option<Graph>, Diagnostics> {
        if g.is_localized() {
            return Ok(None);
        }
        localize(g, self.mesh.as_ref().expect("prepare runs first")).map(Some)
    }
}

/// The names of the mesh axes splitting dim `dim` (outer first), as an attribute.
fn axis_names(
    l: Option<&nnscaler_dialects::sharding::Sharding>,
    dim: usize,
    mesh: &Mesh,
) -> AttrValue {
    AttrValue::Strs(
        l.map(|l| {
            l.split[dim]
                .iter()
                .map(|&a| mesh.axes[a].name.clone())
                .collect()
        })
        .unwrap_or_default(),
    )
}

/// Localizes `g` (see the module docs).
pub fn localize(mut g: Graph, mesh: &Mesh) -> Result<Graph, Diagnostics> {
    let layouts = value_layouts(&g, mesh)?;
    let sizes: Vec<i64> = mesh.axes.iter().map(|a| a.size).collect();
    // Where each value is defined, for messages.
    let mut def_loc = vec![g.loc.clone(); g.values.len()];
    for n in &g.nodes {
        if n.op == "nns.relayout" {
            return Err(error(
                &n.loc,
                "localize: relayouts remain; run --lower-relayouts first",
            ));
        }
        for &o in &n.outputs {
            def_loc[o] = n.loc.clone();
        }
    }
    let mut local = Vec::with_capacity(g.values.len());
    for (v, ty) in g.values.iter().enumerate() {
        let Some(l) = &layouts[v] else {
            return Err(error(
                &def_loc[v],
                "localize: a value has no layout; run --propagate-layouts first",
            ));
        };
        l.check(&ty.shape, &sizes)
            .map_err(|e| error(&def_loc[v], format!("localize: {e}")))?;
        let mut t = ty.clone();
        t.shape = l.local_shape(&ty.shape, &sizes);
        local.push(t);
    }
    let split = |v: usize, dim: usize| {
        layouts[v]
            .as_ref()
            .is_some_and(|l| !l.split[dim].is_empty())
    };
    for n in &mut g.nodes {
        let fail = |m: String| error(&n.loc, format!("localize: '{}': {m}", n.op));
        let out = |i: usize| AttrValue::Ints(local[n.outputs[i]].shape.clone());
        match n.op.as_str() {
            "dnn.reshape" | "dnn.broadcast_to" | "dnn.fill" => {
                let v = out(0);
                n.attrs.insert("shape".into(), v);
            }
            "dnn.embedding_grad" => {
                let v = local[n.outputs[0]].shape[0];
                n.attrs.insert("vocab".into(), AttrValue::Int(v));
            }
            "dnn.embedding" if split(n.inputs[1], 0) => {
                // Each device holds a block of rows: it looks up the ids in its block.
                let axes = axis_names(layouts[n.inputs[1]].as_ref(), 0, mesh);
                n.attrs.insert("row_axes".into(), axes);
            }
            "dnn.pick" | "dnn.softmax_xent_grad" => {
                let l = if n.op == "dnn.pick" {
                    n.inputs[0]
                } else {
                    n.inputs[1]
                };
                if split(l, 1) {
                    let axes = axis_names(layouts[l].as_ref(), 1, mesh);
                    n.attrs.insert("offset_axes".into(), axes);
                }
                if n.op == "dnn.softmax_xent_grad" && split(l, 0) && !n.attrs.contains_key("count")
                {
                    n.attrs
                        .insert("count".into(), AttrValue::Int(g.values[l].shape[0]));
                }
            }
            "dnn.cross_entropy" | "dnn.cross_entropy_grad" => {
                let logits = if n.op == "dnn.cross_entropy" {
                    n.inputs[0]
                } else {
                    n.inputs[1]
                };
                if split(logits, 0) && !n.attrs.contains_key("count") {
                    n.attrs
                        .insert("count".into(), AttrValue::Int(g.values[logits].shape[0]));
                }
                if split(logits, 1) {
                    return Err(fail(
                        "a vocabulary-parallel cross-entropy is not supported yet".into(),
                    ));
                }
            }
            "dnn.mean" => {
                let x = n.inputs[0];
                let rank = g.values[x].rank() as i64;
                let dims: Vec<usize> = match n.attrs.get("dims") {
                    Some(AttrValue::Ints(d)) => d
                        .iter()
                        .map(|&d| (if d < 0 { d + rank } else { d }) as usize)
                        .collect(),
                    _ => Vec::new(),
                };
                if dims.iter().any(|&d| split(x, d)) && !n.attrs.contains_key("count") {
                    let count: i64 = dims.iter().map(|&d| g.values[x].shape[d]).product();
                    n.attrs.insert("count".into(), AttrValue::Int(count));
                }
            }
            "dnn.dropout" => {
                // The mask is indexed by the element's place in the whole tensor.
                let x = n.inputs[0];
                let rank = g.values[x].rank();
                if (0..rank).any(|d| split(x, d)) {
                    let l = layouts[x].as_ref();
                    let axes: Vec<String> = (0..rank)
                        .map(|d| match axis_names(l, d, mesh) {
                            AttrValue::Strs(v) => v.join(","),
                            _ => String::new(),
                        })
                        .collect();
                    n.attrs.insert(
                        "global_shape".into(),
                        AttrValue::Ints(g.values[x].shape.clone()),
                    );
                    n.attrs.insert("dim_axes".into(), AttrValue::Strs(axes));
                }
            }
            _ => {}
        }
    }
    g.values = local;
    // The mesh it was localized for: the verifier refuses the program if the mesh changes.
    let axes: Vec<String> = mesh
        .axes
        .iter()
        .map(|a| format!("{} = {}", a.name, a.size))
        .collect();
    g.func_attrs.insert(
        "nns.localized".into(),
        AttrValue::Nns {
            kind: "axes".into(),
            body: axes.join(", "),
        },
    );
    Ok(g)
}
