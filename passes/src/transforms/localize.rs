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
//!
//! A call of a user op (a function with `nns.annotation`) calls a specialization of the
//! callee made for the call's layouts: a private copy, `@<callee>.local<N>`, placed after
//! the callee, whose arguments and results take the call's operand and result layouts, its
//! body propagated from them and localized like any function. Its body must compute the
//! split without communication (that is what the annotation promises): if it needs a
//! relayout, the annotation allows a split the body does not compute, and that is an error
//! at the call. Calls with the same callee and layouts share a specialization. Because it
//! adds functions, `--localize` works on the whole module.

use crate::layouts::{error, layout_attr, the_mesh, value_layouts};
use crate::pass::{ModulePass, PassOptions};
use crate::rewrite::rewrite_funcs;
use crate::transforms::propagate_layouts::propagate;
use crate::transforms::split_tensor::split;
use melior::ir::{OperationRef, RegionLike};
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::types::AttrValue;
use nnscaler_dialects::view::{top_level_ops, FuncView};

/// The pass.
#[derive(Debug, Default)]
pub struct Localize;

/// A specialization of a user op for one set of layouts.
#[derive(Debug)]
struct Specialization {
    callee: String,
    name: String,
    /// `nns.layout` of each argument, then of each result.
    args: Vec<AttrValue>,
    results: Vec<AttrValue>,
    /// The first call that needs it (for messages).
    loc: SrcLoc,
}

impl Localize {
    /// No options.
    pub fn new(_: &PassOptions) -> Result<Self, String> {
        Ok(Localize)
    }
}

impl ModulePass for Localize {
    fn run(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        let mesh = the_mesh(module, "localize")?;
        let mut taken: Vec<String> = Vec::new();
        top_level_ops(module, &mut |op| {
            if let Some(f) = FuncView::of(op) {
                taken.push(f.name);
            }
        });
        let mut specs: Vec<Specialization> = Vec::new();
        rewrite_funcs(module, &mut |mut g| {
            if g.is_localized() {
                return Ok(None);
            }
            retarget_calls(&mut g, &mesh, &mut specs, &mut taken)?;
            localize(g, &mesh).map(Some)
        })?;
        // Specializations may call user ops in turn, which adds specializations.
        let mut i = 0;
        while i < specs.len() {
            specialize(module, &mesh, i, &mut specs, &mut taken)?;
            i += 1;
        }
        Ok(())
    }
}

/// Points every call of a user op in `g` at the specialization for its layouts, recording
/// the specializations to make.
fn retarget_calls(
    g: &mut Graph,
    mesh: &Mesh,
    specs: &mut Vec<Specialization>,
    taken: &mut Vec<String>,
) -> Result<(), Diagnostics> {
    if g.user_ops.is_empty() {
        return Ok(());
    }
    let layouts = value_layouts(g, mesh)?;
    for k in 0..g.nodes.len() {
        let n = &g.nodes[k];
        let Some(u) = g.user_ops.of_call(&n.op, &n.attrs) else {
            continue;
        };
        let attr = |v: ValueId| -> Result<AttrValue, Diagnostics> {
            layouts[v]
                .as_ref()
                .map(|l| layout_attr(l, mesh))
                .ok_or_else(|| {
                    error(
                        &n.loc,
                        "localize: a value has no layout; run --propagate-layouts first",
                    )
                })
        };
        let args = n
            .inputs
            .iter()
            .map(|&v| attr(v))
            .collect::<Result<Vec<_>, _>>()?;
        let results = n
            .outputs
            .iter()
            .map(|&v| attr(v))
            .collect::<Result<Vec<_>, _>>()?;
        let existing = specs
            .iter()
            .find(|s| s.callee == u.name && s.args == args && s.results == results);
        let name = match existing {
            Some(s) => s.name.clone(),
            None => {
                let mut i = specs.iter().filter(|s| s.callee == u.name).count();
                let mut name = format!("{}.local{i}", u.name);
                while taken.contains(&name) {
                    i += 1;
                    name = format!("{}.local{i}", u.name);
                }
                taken.push(name.clone());
                specs.push(Specialization {
                    callee: u.name.clone(),
                    name: name.clone(),
                    args,
                    results,
                    loc: n.loc.clone(),
                });
                name
            }
        };
        g.nodes[k]
            .attrs
            .insert("callee".into(), AttrValue::Other(format!("@{name}")));
    }
    Ok(())
}

/// Makes specialization `s`: a copy of the callee after it, with the call's layouts on its
/// arguments and results, propagated and localized.
fn specialize(
    module: &OperationRef<'_, '_>,
    mesh: &Mesh,
    index: usize,
    specs: &mut Vec<Specialization>,
    taken: &mut Vec<String>,
) -> Result<(), Diagnostics> {
    let s = &specs[index];
    let s = Specialization {
        callee: s.callee.clone(),
        name: s.name.clone(),
        args: s.args.clone(),
        results: s.results.clone(),
        loc: s.loc.clone(),
    };
    let s = &s;
    let mut callee_op = None;
    top_level_ops(module, &mut |op| {
        if FuncView::of(op).is_some_and(|f| f.name == s.callee) {
            callee_op = Some(op.to_raw());
        }
    });
    let callee_op = callee_op.ok_or_else(|| {
        error(
            &s.loc,
            format!("localize: no function @{} to specialize", s.callee),
        )
    })?;
    // SAFETY: `callee_op` is a live top-level op of `module`; the copy is made in the same
    // context and handed to the module's body right after it.
    let copy = unsafe {
        use nnscaler_dialects::rewriter::{remove_attr, set_attr, Builder};
        let copy = mlir_sys::mlirOperationClone(callee_op);
        let b = Builder::for_op(copy);
        let name = b
            .attribute(&AttrValue::Str(s.name.clone()))
            .map_err(|e| error(&s.loc, e))?;
        set_attr(copy, "sym_name", name);
        for a in ["nns.annotation", "nns.vjp"] {
            remove_attr(copy, a);
        }
        let block = mlir_sys::mlirOperationGetBlock(callee_op);
        mlir_sys::mlirBlockInsertOwnedOperationAfter(block, callee_op, copy);
        OperationRef::from_raw(copy)
    };
    let f = FuncView::of(&copy).ok_or_else(|| error(&s.loc, "localize: not a function"))?;
    let has_body = copy
        .region(0)
        .map(|r| r.first_block().is_some())
        .unwrap_or(false);
    if !has_body {
        // A kernel: the copy is a declaration of the local types, with the same kernel
        // (kernels take whatever shapes they are given).
        return declare_local(&copy, &f, mesh, s);
    }
    // SAFETY: as above: the copy is live in the module.
    unsafe { nnscaler_dialects::rewriter::remove_attr(copy.to_raw(), "nns.kernel") };
    let mut g = Graph::from_func(&copy).map_err(|e| error(&e.loc, e.message))?;
    for (a, l) in g.args.iter_mut().zip(&s.args) {
        a.attrs.insert("nns.layout".into(), l.clone());
    }
    for (o, l) in g.outputs.iter_mut().zip(&s.results) {
        o.attrs.insert("nns.layout".into(), l.clone());
    }
    let g = propagate(g, mesh, &mut Diagnostics::default())?;
    let g = split(g, mesh)?;
    if let Some(r) = g.nodes.iter().find(|n| n.op == "nns.relayout") {
        let mut d = Diagnostics::default();
        d.error(
            &s.loc,
            format!(
                "localize: the body of @{} cannot compute this call's split without communication: its annotation allows a split its body does not compute (check it with 'nnscaler check-op')",
                s.callee
            ),
        );
        d.note(&r.loc, "this op of the body needs its operand relayouted");
        return Err(d);
    }
    let mut g = g;
    retarget_calls(&mut g, mesh, specs, taken)?;
    let g = localize(g, mesh)?;
    g.write_back().map_err(|e| error(&s.loc, e))
}

/// Gives the declaration `copy` (a kernel op's specialization) the local types of the call's
/// layouts, and marks it localized.
fn declare_local(
    copy: &OperationRef<'_, '_>,
    f: &FuncView,
    mesh: &Mesh,
    s: &Specialization,
) -> Result<(), Diagnostics> {
    let sizes: Vec<i64> = mesh.axes.iter().map(|a| a.size).collect();
    let local = |types: &[Option<nnscaler_dialects::types::TensorType>],
                 layouts: &[AttrValue]|
     -> Result<Vec<String>, Diagnostics> {
        types
            .iter()
            .zip(layouts)
            .map(|(t, l)| {
                let mut t = t
                    .clone()
                    .ok_or_else(|| error(&s.loc, "localize: a kernel op takes tensors"))?;
                let sh = nnscaler_dialects::sharding::Sharding::from_attr(l, mesh, t.rank())
                    .map_err(|e| error(&s.loc, format!("localize: {e}")))?;
                t.shape = sh.local_shape(&t.shape, &sizes);
                Ok(t.to_string())
            })
            .collect()
    };
    let args = local(&f.args, &s.args)?;
    let results = local(&f.results, &s.results)?;
    let ty = format!("({}) -> ({})", args.join(", "), results.join(", "));
    // SAFETY: `copy` is a live op of the module; attributes are made in its context.
    unsafe {
        use nnscaler_dialects::rewriter::{set_attr, Builder};
        let b = Builder::for_op(copy.to_raw());
        let t = b
            .attribute(&AttrValue::Other(ty))
            .map_err(|e| error(&s.loc, e))?;
        set_attr(copy.to_raw(), "function_type", t);
        let m = b
            .attribute(&AttrValue::Axes(std::sync::Arc::new(mesh.axes.clone())))
            .map_err(|e| error(&s.loc, e))?;
        set_attr(copy.to_raw(), "nns.localized", m);
    }
    Ok(())
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
    // What each op's spec says to change besides types (`Traits::localize`).
    for n in &mut g.nodes {
        let Some(rule) = n.op.spec().and_then(|s| s.traits.localize) else {
            continue;
        };
        let operands: Vec<_> = n.inputs.iter().map(|&v| g.values[v].clone()).collect();
        let results: Vec<_> = n.outputs.iter().map(|&v| local[v].clone()).collect();
        let split_axes: Vec<Vec<Vec<String>>> = n
            .inputs
            .iter()
            .map(|&v| {
                (0..g.values[v].rank())
                    .map(|d| match axis_names(layouts[v].as_ref(), d, mesh) {
                        AttrValue::Strs(a) => a,
                        _ => Vec::new(),
                    })
                    .collect()
            })
            .collect();
        let mut ctx = nnscaler_dialects::spec::LocalCtx {
            attrs: &mut n.attrs,
            operands: &operands,
            results: &results,
            split_axes: &split_axes,
        };
        rule(&mut ctx).map_err(|m| error(&n.loc, format!("localize: '{}': {m}", n.op)))?;
    }
    g.values = local;
    // The mesh it was localized for: the verifier refuses the program if the mesh changes.
    g.func_attrs.insert(
        "nns.localized".into(),
        AttrValue::Axes(std::sync::Arc::new(mesh.axes.clone())),
    );
    Ok(g)
}
