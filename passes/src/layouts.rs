//! What the layout passes share: finding the mesh, reading and writing layouts on values,
//! and the layouts an op needs under its split directive.

use melior::ir::OperationRef;
use nnscaler_dialects::annotation::{Annotation, Binding};
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::{Graph, Node};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::sharding::{
    binds_to_split, op_layouts, partial_joint, partial_kind, partial_passthrough, resolve_axes,
    resolve_binds, Binds, OpLayouts, Sharding,
};
use nnscaler_dialects::spec::OpCtx;
use nnscaler_dialects::types::{AttrValue, Attrs};
use nnscaler_dialects::verify::{file_loc, Meshes};
use nnscaler_dialects::view;

/// The module's one mesh (the layout passes support a single mesh today).
pub fn the_mesh(module: &OperationRef<'_, '_>, pass: &str) -> Result<Mesh, Diagnostics> {
    let mut d = Diagnostics::default();
    let meshes = Meshes::collect(module, &mut d);
    if d.has_errors() {
        return Err(d);
    }
    match meshes.0.as_slice() {
        [m] => Ok(m.clone()),
        [] => {
            d.error(
                &file_loc(""),
                format!(
                    "{pass}: the module has no nns.mesh (add one, or run --plan with mesh sizes)"
                ),
            );
            Err(d)
        }
        _ => {
            d.error(
                &file_loc(""),
                format!("{pass}: the module has several meshes; only one is supported"),
            );
            Err(d)
        }
    }
}

/// A located error as diagnostics.
pub fn error(loc: &SrcLoc, msg: impl Into<String>) -> Diagnostics {
    let mut d = Diagnostics::default();
    d.error(loc, msg);
    d
}

/// The annotation of a `dnn` node or of a call of a user op, bound to its operand shapes.
pub fn annotation(g: &Graph, n: &Node) -> Result<(Annotation, Binding), String> {
    if let Some(u) = g.user_ops.of_call(&n.op, &n.attrs) {
        let shapes: Vec<Option<&[i64]>> = n
            .inputs
            .iter()
            .map(|&v| Some(g.values[v].shape.as_slice()))
            .collect();
        let b = u
            .annotation
            .bind(&shapes)
            .map_err(|e| format!("@{}: operands do not match its annotation: {e}", u.name))?;
        return Ok((u.annotation.clone(), b));
    }
    let spec =
        n.op.spec()
            .ok_or_else(|| format!("'{}' is not a dnn op", n.op))?;
    let operands: Vec<_> = n
        .inputs
        .iter()
        .map(|&v| Some(g.values[v].clone()))
        .collect();
    let ctx = OpCtx {
        operands: &operands,
        attrs: &n.attrs,
    };
    let (_, a, b) = spec.check(&ctx).map_err(|e| format!("'{}' {e}", n.op))?;
    Ok((a, b))
}

/// The node's split directive resolved against `mesh` (`None` when it has none).
pub fn directive(n: &Node, mesh: &Mesh) -> Result<Option<Binds>, String> {
    constraint(n, "nns.split", mesh)
}

/// The `nns.split` attribute of resolved binds, naming the `closed` axes in `R(...)`;
/// `None` when it would say nothing.
pub fn split_directive(binds: &Binds, closed: &[usize], mesh: &Mesh) -> Option<AttrValue> {
    let mut s = binds_to_split(binds, mesh);
    s.replicated = closed.iter().map(|&a| mesh.axes[a].name.clone()).collect();
    (!s.binds.is_empty() || !s.replicated.is_empty())
        .then(|| AttrValue::Split(std::sync::Arc::new(s)))
}

/// The mesh axes the node's split directive names in `R(...)`: the op is replicated over
/// them, and nothing is inferred over them.
pub fn replicated_axes(n: &Node, mesh: &Mesh) -> Result<Vec<usize>, String> {
    match n.attrs.get("nns.split").and_then(AttrValue::split) {
        Some(s) => resolve_axes(&s?.replicated, mesh),
        None => Ok(Vec::new()),
    }
}

/// The binds of split-valued attribute `key` of `n` (`nns.split`, `nns.pin`,
/// `nns.forbid`), if it has one.
pub fn constraint(n: &Node, key: &str, mesh: &Mesh) -> Result<Option<Binds>, String> {
    let Some(v) = n.attrs.get(key) else {
        return Ok(None);
    };
    match v.split() {
        Some(s) => resolve_binds(&*s?, mesh).map(Some),
        None => Err(format!("'{key}' must be a #nns.split<...> attribute")),
    }
}

/// The layouts a `dnn` node needs and produces under `binds`, given its operands' current
/// layouts: partial sums flow through ops linear in them instead of being reduced first.
pub fn node_layouts(
    g: &Graph,
    n: &Node,
    mesh: &Mesh,
    binds: &Binds,
    operands: &[Option<&Sharding>],
) -> Result<OpLayouts, String> {
    let (anno, binding) = annotation(g, n)?;
    let in_ranks: Vec<usize> = n.inputs.iter().map(|&v| g.values[v].rank()).collect();
    let out_ranks: Vec<usize> = n.outputs.iter().map(|&v| g.values[v].rank()).collect();
    let mut l = op_layouts(
        &anno,
        &binding,
        partial_kind(&n.op),
        binds,
        mesh.axes.len(),
        &in_ranks,
        &out_ranks,
    )?;
    let bound: Vec<usize> = binds.iter().flat_map(|(_, v)| v.iter().copied()).collect();
    let joint = partial_joint(&n.op);
    for (a, r) in partial_passthrough(&n.op, operands, &bound) {
        for (i, (want, have)) in l.inputs.iter_mut().zip(operands).enumerate() {
            if let (Some(w), Some(h)) = (want, have) {
                // Partial operands stay partial; replicated ones of a jointly linear op
                // (add, sub, concat) are partitioned to join them.
                if h.partial[a].is_some() || joint.contains(&i) {
                    w.partial[a] = Some(r);
                }
            }
        }
        for o in &mut l.outputs {
            o.partial[a] = Some(r);
        }
    }
    Ok(l)
}

/// The attribute value of a layout.
pub fn layout_attr(s: &Sharding, mesh: &Mesh) -> AttrValue {
    AttrValue::Layout(std::sync::Arc::new(s.to_layout(mesh)))
}

/// The `nns.layouts` attribute value of several results.
pub fn layouts_attr(v: &[Sharding], mesh: &Mesh) -> AttrValue {
    AttrValue::Layouts(
        v.iter()
            .map(|s| std::sync::Arc::new(s.to_layout(mesh)))
            .collect(),
    )
}

/// Reads `nns.layouts` of a node.
pub fn read_layouts(
    attrs: &Attrs,
    mesh: &Mesh,
    ranks: &[usize],
) -> Result<Option<Vec<Sharding>>, String> {
    let Some(v) = attrs.get("nns.layouts") else {
        return Ok(None);
    };
    let items: Vec<AttrValue> = match v {
        AttrValue::Layouts(ls) => ls.iter().cloned().map(AttrValue::Layout).collect(),
        // An entry that does not parse: its error.
        AttrValue::Other(text) => view::split_commas(
            text.strip_prefix('[')
                .and_then(|t| t.strip_suffix(']'))
                .ok_or("'nns.layouts' must be an array")?,
        )
        .iter()
        .map(|t| AttrValue::from_mlir_text(t))
        .collect(),
        _ => return Err("'nns.layouts' must be an array of #nns.layout".into()),
    };
    if items.len() != ranks.len() {
        return Err(format!(
            "'nns.layouts' has {} entries for {} results",
            items.len(),
            ranks.len()
        ));
    }
    items
        .iter()
        .zip(ranks)
        .map(|(v, &r)| Sharding::from_attr(v, mesh, r))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// The layout of every value as written: arguments' `nns.layout` (replicated when absent),
/// nodes' `nns.layouts`, relayouts' `to`. `None` for values with no layout written.
pub fn value_layouts(g: &Graph, mesh: &Mesh) -> Result<Vec<Option<Sharding>>, Diagnostics> {
    let mut out: Vec<Option<Sharding>> = vec![None; g.values.len()];
    for (i, a) in g.args.iter().enumerate() {
        let r = g.values[a.value].rank();
        out[a.value] = Some(match a.attrs.get("nns.layout") {
            Some(v) => Sharding::from_attr(v, mesh, r)
                .map_err(|e| error(&g.loc, format!("@{} argument {i}: {e}", g.name)))?,
            None => Sharding::replicated(r, mesh.axes.len()),
        });
    }
    for n in &g.nodes {
        let ranks: Vec<usize> = n.outputs.iter().map(|&v| g.values[v].rank()).collect();
        let ls = if n.op == "nns.relayout" {
            n.attrs
                .get("to")
                .map(|v| Sharding::from_attr(v, mesh, ranks[0]).map(|s| vec![s]))
                .transpose()
        } else {
            read_layouts(&n.attrs, mesh, &ranks)
        };
        if let Some(ls) = ls.map_err(|e| error(&n.loc, format!("'{}': {e}", n.op)))? {
            for (&v, s) in n.outputs.iter().zip(ls) {
                out[v] = Some(s);
            }
        }
    }
    Ok(out)
}

/// The layout each function result must have: its `nns.layout`, or replicated.
pub fn result_layouts(g: &Graph, mesh: &Mesh) -> Result<Vec<Sharding>, Diagnostics> {
    g.outputs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let r = g.values[o.value].rank();
            match o.attrs.get("nns.layout") {
                Some(v) => Sharding::from_attr(v, mesh, r)
                    .map_err(|e| error(&g.loc, format!("@{} result {i}: {e}", g.name))),
                None => Ok(Sharding::replicated(r, mesh.axes.len())),
            }
        })
        .collect()
}
