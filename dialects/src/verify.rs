//! The `dnn`/`nns` verifier: checks every op against its spec and every `nns` attribute
//! against the module's meshes, and reports all problems with their locations.

use crate::annotation::DimKind;
use crate::diag::{Diagnostics, SrcLoc};
use crate::nns::{self, Layout, Mesh};
use crate::spec::OpCtx;
use crate::types::{AttrValue, TensorType};
use crate::userop::{UserOp, UserOps};
use crate::view::{walk_nested, FuncView, OpView};
use crate::{dnn, view};
use melior::ir::{Module, OperationRef};

/// The meshes declared in a module.
#[derive(Clone, Debug, Default)]
pub struct Meshes(pub Vec<Mesh>);

impl Meshes {
    /// Collects the `nns.mesh` ops of the module op `module` (they are symbols in its body;
    /// the verifier rejects one anywhere else), reporting malformed ones.
    pub fn collect(module: &OperationRef<'_, '_>, diags: &mut Diagnostics) -> Self {
        let mut meshes = Vec::new();
        view::top_level_ops(module, &mut |op: &OperationRef<'_, '_>| {
            if op.name().as_string_ref().as_str() != Ok("nns.mesh") {
                return;
            }
            let v = OpView::of(op);
            let name = match v.attrs.get("sym_name") {
                Some(AttrValue::Str(s)) => s.clone(),
                _ => {
                    diags.error(v.loc(), "'nns.mesh' requires a string 'sym_name'");
                    return;
                }
            };
            let axes = match v.attrs.get("axes").and_then(AttrValue::axes) {
                Some(axes) => axes,
                None => Err("requires 'axes = #nns.axes<name = size, ...>'".to_string()),
            };
            let memory_cap = match v.attrs.get("memory_cap") {
                None => None,
                Some(AttrValue::Int(n)) if *n > 0 => Some(*n),
                Some(_) => {
                    diags.error(
                        v.loc(),
                        format!("'nns.mesh' @{name}: 'memory_cap' must be a positive integer (bytes per device)"),
                    );
                    None
                }
            };
            for k in v.attrs.keys() {
                if !matches!(k.as_str(), "sym_name" | "axes" | "memory_cap") {
                    diags.error(
                        v.loc(),
                        format!("'nns.mesh' @{name}: unknown attribute '{k}'"),
                    );
                }
            }
            match axes {
                Ok(axes) => {
                    if meshes.iter().any(|m: &Mesh| m.name == name) {
                        diags.error(v.loc(), format!("mesh '@{name}' is declared twice"));
                    }
                    meshes.push(Mesh {
                        name,
                        axes: axes.to_vec(),
                        memory_cap,
                    })
                }
                Err(e) => diags.error(v.loc(), format!("'nns.mesh' @{name}: {e}")),
            }
            if !v.operands.is_empty() || !v.results.is_empty() {
                diags.error(v.loc(), "'nns.mesh' takes no operands and has no results");
            }
        });
        Meshes(meshes)
    }

    /// The mesh named `name`, or the only mesh when `name` is `None`.
    pub fn resolve(&self, name: Option<&str>) -> Result<&Mesh, String> {
        match name {
            Some(n) => self
                .0
                .iter()
                .find(|m| m.name == n)
                .ok_or(format!("no mesh named '@{n}' in the module")),
            None => match self.0.as_slice() {
                [m] => Ok(m),
                [] => Err("the module declares no 'nns.mesh'".into()),
                _ => Err("the module declares several meshes; name one with '@mesh'".into()),
            },
        }
    }
}

/// Verifies every op of `module`. Returns all problems found (empty when valid).
pub fn verify_module(module: &Module<'_>) -> Diagnostics {
    verify_module_op(&module.as_operation())
}

/// [`verify_module`] on a module op (a host's module, given to a pass as an op).
pub fn verify_module_op(module: &OperationRef<'_, '_>) -> Diagnostics {
    let mut diags = Diagnostics::default();
    let meshes = Meshes::collect(module, &mut diags);
    if diags.has_errors() {
        // Everything else refers to the meshes: report their problems alone, not the
        // cascade of "no mesh named ..." that would follow.
        return diags;
    }
    let user_ops = UserOps::collect(module, &mut diags);
    let mut v = TreeVerifier {
        meshes: &meshes,
        user_ops: &user_ops,
        localized: false,
        diags: &mut diags,
    };
    walk_nested(module, &mut |op| v.visit(op));
    diags
}

/// Verifies one `func.func` (what a function pass changed), against the meshes of the
/// module holding it.
pub fn verify_function(func: &OperationRef<'_, '_>) -> Diagnostics {
    let mut diags = Diagnostics::default();
    // SAFETY: `func` is live; so is its parent, if any.
    let parent = unsafe { mlir_sys::mlirOperationGetParentOperation(func.to_raw()) };
    let (meshes, user_ops) = if parent.ptr.is_null() {
        (Meshes::default(), UserOps::default())
    } else {
        // SAFETY: as above.
        let module = unsafe { OperationRef::from_raw(parent) };
        let meshes = Meshes::collect(&module, &mut diags);
        // Problems of user ops are the module's (reported when it is verified).
        (
            meshes,
            UserOps::collect(&module, &mut Diagnostics::default()),
        )
    };
    if diags.has_errors() {
        return diags;
    }
    let mut v = TreeVerifier {
        meshes: &meshes,
        user_ops: &user_ops,
        localized: false,
        diags: &mut diags,
    };
    v.visit(func);
    walk_nested(func, &mut |op| v.visit(op));
    diags
}

/// The per-op checks, visiting ops in pre-order. Inside a localized function shapes are per
/// device: layouts and collectives are checked against the local shapes, split directives
/// not at all.
struct TreeVerifier<'a> {
    meshes: &'a Meshes,
    user_ops: &'a UserOps,
    localized: bool,
    diags: &'a mut Diagnostics,
}

impl TreeVerifier<'_> {
    fn visit(&mut self, op: &OperationRef<'_, '_>) {
        let (meshes, diags) = (self.meshes, &mut *self.diags);
        if let Some(f) = FuncView::of(op) {
            let attrs = OpView::of(op).attrs;
            self.localized = attrs.contains_key("nns.localized");
            if self.localized {
                if let Err(e) = check_localized_mark(&attrs, meshes) {
                    diags.error(&f.loc, format!("@{}: {e}", f.name));
                }
            }
            verify_func_signature(&f, meshes, self.localized, diags);
            for k in attrs.keys().filter(|k| k.starts_with("nns.")) {
                let ok = match (k.as_str(), &attrs[k]) {
                    ("nns.localized" | "nns.annotation" | "nns.vjp" | "nns.kernel", _) => true,
                    (
                        "nns.pipeline" | "nns.schedule" | "nns.fragment" | "nns.torch",
                        AttrValue::Str(_),
                    ) => true,
                    ("nns.pipeline_rank", AttrValue::Int(r)) => *r >= 0,
                    _ => false,
                };
                if !ok {
                    diags.error(
                        &f.loc,
                        format!("@{}: unknown function attribute '{k}'", f.name),
                    );
                }
            }
            return;
        }
        if op.name().as_string_ref().as_str() == Ok("nns.mesh") && !at_top_level(op) {
            diags.error(
                OpView::of(op).loc(),
                "'nns.mesh' must be directly in the module (a mesh is a module-level symbol)",
            );
            return;
        }
        let v = OpView::of(op);
        // Sizes first: the checks below multiply dims. (Operands are results of ops checked
        // already, or arguments; an oversized one was reported there, and this op is
        // skipped quietly.)
        if v.operands.iter().flatten().any(|t| t.check_size().is_err()) {
            return;
        }
        for (i, t) in v.results.iter().enumerate() {
            if let Some(Err(e)) = t.as_ref().map(TensorType::check_size) {
                diags.error(v.loc(), format!("'{}' result {i}: {e}", v.name));
                return;
            }
        }
        let r = if let Some(u) = self.user_ops.of_call(&v.name, &v.attrs) {
            verify_user_call(&v, u, meshes, self.localized, diags)
        } else if self.localized {
            verify_local_op(&v, meshes)
        } else {
            verify_op(&v, meshes, diags)
        };
        if let Err(msg) = r {
            diags.error(v.loc(), format!("'{}' {msg}", v.name));
        }
    }
}

/// Whether `op`'s parent is a `builtin.module`.
fn at_top_level(op: &OperationRef<'_, '_>) -> bool {
    // SAFETY: `op` is live; so is its parent, if any.
    unsafe {
        let parent = mlir_sys::mlirOperationGetParentOperation(op.to_raw());
        !parent.ptr.is_null()
            && OperationRef::from_raw(parent)
                .name()
                .as_string_ref()
                .as_str()
                == Ok("builtin.module")
    }
}

/// The axes of the mesh the function was localized for (`nns.localized = #nns.axes<...>`,
/// written by `--localize`) must be the mesh's: local shapes, mean denominators and shard
/// offsets were computed from them, and an edited mesh would silently change what the
/// program computes.
fn check_localized_mark(attrs: &crate::types::Attrs, meshes: &Meshes) -> Result<(), String> {
    let recorded = match attrs.get("nns.localized").and_then(AttrValue::axes) {
        Some(axes) => axes.map_err(|e| format!("'nns.localized': {e}"))?,
        None => {
            return Err(
                "'nns.localized' must record the mesh the function was localized for \
                 (#nns.axes<...>, as --localize writes it)"
                    .into(),
            )
        }
    };
    let mesh = meshes.resolve(None)?;
    if *recorded != mesh.axes {
        let show = |axes: &[nns::Axis]| {
            axes.iter()
                .map(nns::Axis::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(format!(
            "was localized for a mesh <{}>, but mesh '@{}' is <{}>; localize the global \
             program again for this mesh",
            show(&recorded),
            mesh.name,
            show(&mesh.axes)
        ));
    }
    Ok(())
}

fn verify_func_signature(f: &FuncView, meshes: &Meshes, local: bool, diags: &mut Diagnostics) {
    let entries = f
        .arg_attrs
        .iter()
        .zip(&f.args)
        .enumerate()
        .map(|(i, (a, t))| (format!("argument {i}"), a, t))
        .chain(
            f.result_attrs
                .iter()
                .zip(&f.results)
                .enumerate()
                .map(|(i, (a, t))| (format!("result {i}"), a, t)),
        );
    let mut names: Vec<&str> = Vec::new();
    for (what, attrs, ty) in entries {
        if let Some(Err(e)) = ty.as_ref().map(TensorType::check_size) {
            diags.error(&f.loc, format!("@{} {what}: {e}", f.name));
        }
        for (k, v) in attrs.iter().filter(|(k, _)| k.starts_with("nns.")) {
            let r = match (k.as_str(), v) {
                ("nns.name", AttrValue::Str(s)) => {
                    if names.contains(&s.as_str()) {
                        Err(format!("name \"{s}\" is used twice"))
                    } else {
                        names.push(s);
                        Ok(())
                    }
                }
                ("nns.param", AttrValue::Unit) => Ok(()),
                ("nns.state_of", AttrValue::Str(_)) => Ok(()),
                ("nns.state_of", _) => Err(
                    "'nns.state_of' must name the parameter (its nns.name) this optimizer state belongs to".into(),
                ),
                ("nns.arg" | "nns.result", AttrValue::Int(i)) if *i >= 0 => Ok(()),
                ("nns.arg" | "nns.result", _) => Err(format!(
                    "'{k}' must be the index (>= 0) of an argument or result of the function pipelined"
                )),
                ("nns.init", AttrValue::Str(s)) => crate::types::Init::parse(s).map(|_| ()),
                ("nns.layout", v) if v.layout().is_some() => {
                    let l = v.layout().expect("a layout");
                    if local {
                        l.and_then(|l| check_local_layout(&l, ty.as_ref(), meshes))
                    } else {
                        l.and_then(|l| check_layout(&l, ty.as_ref(), meshes))
                    }
                }
                ("nns.name" | "nns.param" | "nns.layout" | "nns.init", _) => Err(format!(
                    "'{k}' has the wrong kind of value ({})",
                    v.kind_name()
                )),
                _ => Err(format!("unknown attribute '{k}'")),
            };
            if let Err(e) = r {
                diags.error(&f.loc, format!("@{} {what}: {e}", f.name));
            }
        }
    }
}

fn check_layout(l: &Layout, ty: Option<&TensorType>, meshes: &Meshes) -> Result<(), String> {
    let mesh = meshes.resolve(Some(&l.mesh))?;
    let shape = ty.map(|t| t.shape.as_slice()).unwrap_or(&[]);
    l.check(mesh, shape)
        .map_err(|e| format!("layout <{l}> does not fit the value: {e}"))
}

/// A layout on a per-device (local) type: its mesh and axes exist and its split dims are
/// inside the rank; any local length fits (the whole length is the local one times the
/// parts).
fn check_local_layout(l: &Layout, ty: Option<&TensorType>, meshes: &Meshes) -> Result<(), String> {
    let mesh = meshes.resolve(Some(&l.mesh))?;
    let rank = ty.map(TensorType::rank).unwrap_or(0);
    for (axis, a) in &l.axes {
        if mesh.axis(axis).is_none() {
            return Err(format!("mesh '@{}' has no axis '{axis}'", mesh.name));
        }
        if let nns::AxisLayout::D(d) = a {
            if *d >= rank {
                return Err(format!(
                    "layout <{l}>: axis '{axis}' splits dim {d} but the value has rank {rank}"
                ));
            }
        }
    }
    Ok(())
}

/// An op of a localized function: `dnn` ops must still type-check (on local shapes), and
/// collectives must turn their operand's local shape into their result's.
fn verify_local_op(v: &OpView, meshes: &Meshes) -> Result<(), String> {
    if v.name.starts_with("nns.") && v.name != "nns.mesh" {
        let spec = nns::collective(&v.name).ok_or("is not an nns op")?;
        return verify_collective(v, spec, meshes, true);
    }
    let Some(spec) = v.name.strip_prefix("dnn.").map(|_| dnn::spec(&v.name)) else {
        return Ok(());
    };
    let spec = spec.ok_or("is not a dnn op (see `nnscaler-opt --list-ops`)")?;
    let ctx = OpCtx {
        operands: &v.operands,
        attrs: &v.attrs,
    };
    let (expected, _, _) = spec.check(&ctx)?;
    if expected.len() != v.results.len() {
        return Err(format!(
            "must have {} result(s) but has {}",
            expected.len(),
            v.results.len()
        ));
    }
    for (i, (want, got)) in expected.iter().zip(&v.results).enumerate() {
        if got.as_ref() != Some(want) {
            return Err(format!(
                "result {i} has type {} but its (local) operands give {want}",
                v.result_text(i)
            ));
        }
    }
    Ok(())
}

fn verify_op(v: &OpView, meshes: &Meshes, diags: &mut Diagnostics) -> Result<(), String> {
    let ctx = OpCtx {
        operands: &v.operands,
        attrs: &v.attrs,
    };
    if let Some(spec) = v.name.strip_prefix("dnn.").map(|_| dnn::spec(&v.name)) {
        let spec = spec.ok_or("is not a dnn op (see `nnscaler-opt --list-ops`)")?;
        let (expected, anno, binding) = spec.check(&ctx)?;
        if expected.len() != v.results.len() {
            return Err(format!(
                "must have {} result(s) but has {}",
                expected.len(),
                v.results.len()
            ));
        }
        for (i, (want, got)) in expected.iter().zip(&v.results).enumerate() {
            if got.as_ref() != Some(want) {
                return Err(format!(
                    "result {i} has type {} but its operands give {want}",
                    v.result_text(i)
                ));
            }
        }
        check_directives(v, &anno, &binding, meshes)?;
        check_common_attrs(v, meshes, false, diags);
        return Ok(());
    }
    if let Some(rest) = v.name.strip_prefix("nns.") {
        if rest == "mesh" {
            return Ok(()); // checked by Meshes::collect
        }
        let spec = nns::collective(&v.name).ok_or("is not an nns op")?;
        verify_collective(v, spec, meshes, false)?;
        check_common_attrs(v, meshes, false, diags);
        return Ok(());
    }
    check_common_attrs(v, meshes, false, diags);
    Ok(())
}

/// A call of a user op: its directives against the callee's annotation bound to the
/// call's operands (operand and result types are MLIR's `func.call` verifier's business).
fn verify_user_call(
    v: &OpView,
    u: &UserOp,
    meshes: &Meshes,
    localized: bool,
    diags: &mut Diagnostics,
) -> Result<(), String> {
    if !localized {
        let shapes: Vec<Option<&[i64]>> = v
            .operands
            .iter()
            .map(|t| t.as_ref().map(|t| t.shape.as_slice()))
            .collect();
        let binding = u
            .annotation
            .bind(&shapes)
            .map_err(|e| format!("@{}: operands do not match its annotation: {e}", u.name))?;
        check_directives(v, &u.annotation, &binding, meshes)?;
    }
    check_common_attrs(v, meshes, true, diags);
    Ok(())
}

/// Checks an op's split directives (`nns.split`, `nns.pin`, `nns.forbid`) against its
/// annotation bound to its operands: known, splittable ids, mesh axes that exist and divide.
fn check_directives(
    v: &OpView,
    anno: &crate::annotation::Annotation,
    binding: &crate::annotation::Binding,
    meshes: &Meshes,
) -> Result<(), String> {
    for key in ["nns.split", "nns.pin", "nns.forbid"] {
        let Some(attr) = v.attrs.get(key) else {
            continue;
        };
        let split = match (attr.split(), attr.nns_parts()) {
            (Some(split), _) => split.map_err(|e| format!("{key}: {e}"))?,
            (None, Some((kind, _))) => {
                return Err(format!(
                    "'{key}' must be a #nns.split<...> attribute, not #nns.{kind}"
                ))
            }
            (None, None) => return Err(format!("'{key}' must be a #nns.split<...> attribute")),
        };
        let mesh = meshes
            .resolve(split.mesh.as_deref())
            .map_err(|e| format!("{key}: {e}"))?;
        let choices = anno.split_choices(binding);
        for (id, axes) in &split.binds {
            let known = anno.kinds.contains_key(id) || binding.len(id).is_some();
            if !known {
                return Err(format!(
                    "{key}: the op has no dimension '{id}' (its annotation is '{anno}')"
                ));
            }
            if anno.kind(id) == DimKind::Frozen {
                return Err(format!(
                    "{key}: dimension '{id}' is frozen ('{id}^' in '{anno}') and cannot be split"
                ));
            }
            if !choices.iter().any(|c| &c.id == id) {
                return Err(format!(
                    "{key}: dimension '{id}' cannot be split (an inner part of a compound dimension, or of length 1) in '{anno}'"
                ));
            }
            let mut parts = 1;
            for a in axes {
                parts *= mesh
                    .axis(a)
                    .ok_or(format!("{key}: mesh '@{}' has no axis '{a}'", mesh.name))?;
            }
            let len = binding.len(id).unwrap_or(1);
            if len % parts != 0 {
                let at = anno.where_is(binding, id);
                return Err(format!(
                    "{key}: dimension '{id}'{at} has length {len}, which {} (size {parts}) does not divide",
                    axes.join("*")
                ));
            }
        }
        for a in &split.replicated {
            if key != "nns.split" {
                return Err(format!(
                    "{key}: R({a}) is for split directives (nns.split) only"
                ));
            }
            if mesh.axis(a).is_none() {
                return Err(format!("{key}: mesh '@{}' has no axis '{a}'", mesh.name));
            }
        }
    }
    Ok(())
}

/// Checks the `nns.*` attributes any op may carry (other than the split directives).
fn check_common_attrs(v: &OpView, meshes: &Meshes, user_op: bool, diags: &mut Diagnostics) {
    for (k, val) in v.attrs.iter().filter(|(k, _)| k.starts_with("nns.")) {
        let r = match (k.as_str(), val) {
            ("nns.split" | "nns.pin" | "nns.forbid", _)
                if v.name.starts_with("dnn.") || user_op =>
            {
                Ok(())
            }
            ("nns.split" | "nns.pin" | "nns.forbid", _) => Err(format!(
                "'{k}' applies to dnn ops and calls of user ops (functions with 'nns.annotation') only"
            )),
            ("nns.stage", AttrValue::Int(s)) if *s >= 0 => Ok(()),
            ("nns.stage", _) => Err("'nns.stage' must be an integer >= 0".to_string()),
            ("nns.colocate", AttrValue::Str(_)) => Ok(()),
            ("nns.stage_bounds", AttrValue::Ints(b)) => match b.as_slice() {
                [lo, hi] if 0 <= *lo && lo <= hi => match v.attrs.get("nns.stage") {
                    Some(AttrValue::Int(s)) if s < lo || s > hi => Err(format!(
                        "'nns.stage' {s} is outside its 'nns.stage_bounds' [{lo}, {hi}]"
                    )),
                    _ => Ok(()),
                },
                _ => Err(format!(
                    "'nns.stage_bounds' must be array<i64: lo, hi> with 0 <= lo <= hi, got {b:?}"
                )),
            },
            ("nns.stage_bounds", _) => {
                Err("'nns.stage_bounds' must be array<i64: lo, hi>".to_string())
            }
            ("nns.colocate", _) => Err("'nns.colocate' must be a string".to_string()),
            ("nns.layouts", AttrValue::Layouts(ls)) => {
                check_layouts(ls.iter().map(|l| Some(Ok(l.clone()))).collect(), v, meshes)
            }
            ("nns.layouts", AttrValue::Other(text)) => text
                .strip_prefix('[')
                .and_then(|t| t.strip_suffix(']'))
                .ok_or_else(|| "'nns.layouts' must be an array".to_string())
                .and_then(|body| {
                    let items = view::split_commas(body)
                        .iter()
                        .map(|t| AttrValue::from_mlir_text(t).layout())
                        .collect();
                    check_layouts(items, v, meshes)
                }),
            ("nns.layouts", _) => Err("'nns.layouts' must be an array of #nns.layout".into()),
            ("nns.fragment", AttrValue::Str(_)) if v.name == "func.call" => Ok(()),
            ("nns.fragment", _) => {
                Err("'nns.fragment' is a string on the calls of a pipelined program".into())
            }
            ("nns.recompute", AttrValue::Unit) => Ok(()),
            ("nns.recompute", _) => Err("'nns.recompute' is a unit attribute".into()),
            ("nns.layer", AttrValue::Str(_)) => Ok(()),
            ("nns.layer", _) => Err("'nns.layer' must be a string naming the op's layer".into()),
            ("nns.accumulate", AttrValue::Unit) if v.name == "dnn.add" => Ok(()),
            ("nns.accumulate", _) => Err("'nns.accumulate' marks a dnn.add (unit)".into()),
            _ => Err(format!("unknown attribute '{k}'")),
        };
        if let Err(e) = r {
            diags.error(v.loc(), format!("'{}' {e}", v.name));
        }
    }
}

/// Checks `nns.layouts`: an entry per result (`None` for one that is not a layout, an
/// error for one that does not parse).
fn check_layouts(
    items: Vec<Option<Result<std::sync::Arc<Layout>, String>>>,
    v: &OpView,
    meshes: &Meshes,
) -> Result<(), String> {
    if items.len() != v.results.len() {
        return Err(format!(
            "'nns.layouts' has {} entries for {} results",
            items.len(),
            v.results.len()
        ));
    }
    for (i, item) in items.into_iter().enumerate() {
        match item {
            Some(l) => l
                .and_then(|l| check_layout(&l, v.results[i].as_ref(), meshes))
                .map_err(|e| format!("result {i}: {e}"))?,
            None => return Err(format!("'nns.layouts' entry {i} is not a #nns.layout")),
        }
    }
    Ok(())
}

/// Checks a collective. Before `--localize` (`local` false) it keeps its operand's global
/// type; in a localized function its result is the operand's local shape changed as the
/// collective changes it (an all_gather multiplies its dim by the group size, ...).
fn verify_collective(
    v: &OpView,
    spec: &nns::CollectiveSpec,
    meshes: &Meshes,
    local: bool,
) -> Result<(), String> {
    if (v.operands.len(), v.results.len()) != spec.arity {
        let count = |n: usize, what: &str| match n {
            0 => format!("no {what}"),
            1 => format!("one {what}"),
            n => format!("{n} {what}s"),
        };
        return Err(format!(
            "takes {} and {}, has {} and {}",
            count(spec.arity.0, "operand"),
            count(spec.arity.1, "result"),
            v.operands.len(),
            v.results.len()
        ));
    }
    if spec.name == "nns.send" || spec.name == "nns.recv" {
        // Point to point between pipeline ranks: which rank, along which axis, and a tag.
        let mesh = meshes.resolve(None)?;
        let axis = match v.attrs.get("axis") {
            Some(AttrValue::Str(a)) => a.clone(),
            _ => return Err("requires 'axis', the pipeline axis of the mesh".into()),
        };
        let n = mesh
            .axis(&axis)
            .ok_or(format!("mesh '@{}' has no axis '{axis}'", mesh.name))?;
        match v.attrs.get("peer") {
            Some(AttrValue::Int(p)) if (0..n).contains(p) => {}
            _ => return Err(format!("requires 'peer', a rank along '{axis}' (0..{n})")),
        }
        if !matches!(v.attrs.get("tag"), Some(AttrValue::Str(_))) {
            return Err("requires 'tag', a string naming the transfer".into());
        }
        let t = v.operands.first().or(v.results.first());
        if !matches!(t, Some(Some(_))) {
            return Err("the value must be a ranked tensor with a static shape".into());
        }
        return Ok(());
    }
    let Some(t) = &v.operands[0] else {
        return Err("operand must be a ranked tensor with a static shape".into());
    };
    let Some(r) = &v.results[0] else {
        return Err("result must be a ranked tensor with a static shape".into());
    };
    let same_type = || {
        if r != t {
            let why = if local {
                "this collective keeps the local shape"
            } else {
                "collectives keep global shapes until --localize"
            };
            return Err(format!(
                "result type {} differs from operand type {t}; {why}",
                v.result_text(0)
            ));
        }
        Ok(())
    };
    if spec.name == "nns.transfer" {
        for k in ["from", "to"] {
            match v.attrs.get(k) {
                Some(AttrValue::Int(s)) if *s >= 0 => {}
                _ => return Err(format!("requires a stage '{k}' (integer >= 0)")),
            }
        }
        return same_type();
    }
    if spec.name == "nns.relayout" {
        if local {
            return Err(
                "cannot appear in a localized function (run --lower-relayouts before --localize)"
                    .into(),
            );
        }
        same_type()?;
        return match v.attrs.get("to").and_then(AttrValue::layout) {
            Some(l) => l
                .and_then(|l| check_layout(&l, Some(t), meshes))
                .map_err(|e| format!("'to': {e}")),
            None => Err("requires 'to = #nns.layout<...>'".into()),
        };
    }
    let mesh_name = match v.attrs.get("mesh") {
        Some(AttrValue::Other(s)) => Some(s.trim_start_matches('@').to_string()),
        _ => None,
    };
    let mesh = meshes.resolve(mesh_name.as_deref())?;
    let axes = match v.attrs.get("axes") {
        Some(AttrValue::Strs(a)) if !a.is_empty() => a.clone(),
        _ => return Err("requires 'axes', a non-empty array of mesh axis names".into()),
    };
    let mut parts = 1;
    for (i, a) in axes.iter().enumerate() {
        if axes[..i].contains(a) {
            return Err(format!("names axis '{a}' twice"));
        }
        parts *= mesh
            .axis(a)
            .ok_or(format!("mesh '@{}' has no axis '{a}'", mesh.name))?;
    }
    if spec.name == "nns.microbatch" {
        match v.attrs.get("index") {
            Some(AttrValue::Int(i)) if (0..parts).contains(i) => {}
            _ => return Err(format!("requires 'index', a micro-batch in 0..{parts}")),
        }
    }
    if spec.name == "nns.broadcast" {
        match v.attrs.get("root") {
            Some(AttrValue::Int(r)) if (0..parts).contains(r) => {}
            _ => {
                return Err(format!(
                    "requires 'root', the member whose value is copied, in 0..{parts}"
                ))
            }
        }
    }
    let mut dim = std::collections::BTreeMap::new();
    for k in spec.dim_attrs {
        let d = match v.attrs.get(*k) {
            Some(AttrValue::Int(d)) => *d,
            _ => return Err(format!("requires integer attribute '{k}'")),
        };
        if d < 0 || d as usize >= t.rank() {
            return Err(format!("'{k}' = {d} is out of range for rank {}", t.rank()));
        }
        dim.insert(*k, d as usize);
    }
    if spec.reduces {
        if let Some(red) = v.attrs.get("reduce") {
            match red {
                AttrValue::Str(s) if nns::Reduce::parse(s).is_some() => {}
                _ => return Err("'reduce' must be \"sum\" or \"max\"".into()),
            }
        }
    }
    // The dims each device cuts and the dims it gathers: the collective's table entry.
    let split: Vec<usize> = spec
        .cuts
        .iter()
        .filter_map(|k| dim.get(k).copied())
        .collect();
    let grow: Vec<usize> = spec
        .grows
        .iter()
        .filter_map(|k| dim.get(k).copied())
        .collect();
    if !local {
        for &d in split.iter().chain(&grow) {
            if t.shape[d] % parts != 0 {
                return Err(format!(
                    "dim {d} of length {} cannot be split {parts} ways over {}",
                    t.shape[d],
                    axes.join(", ")
                ));
            }
        }
        return same_type();
    }
    let mut want = t.clone();
    for &d in &split {
        if want.shape[d] % parts != 0 {
            return Err(format!(
                "dim {d} of local length {} cannot be split {parts} ways over {}",
                want.shape[d],
                axes.join(", ")
            ));
        }
        want.shape[d] /= parts;
    }
    for &d in &grow {
        want.shape[d] *= parts;
    }
    if r != &want {
        return Err(format!(
            "result type {} does not follow from the local operand {t}: over {} ({parts} \
             devices) it is {want}",
            v.result_text(0),
            axes.join(", ")
        ));
    }
    Ok(())
}

/// Parameters: (name, type) of every `nns.param` argument of `f`.
pub fn params(f: &FuncView) -> Vec<(String, Option<TensorType>)> {
    f.arg_attrs
        .iter()
        .zip(&f.args)
        .enumerate()
        .filter(|(_, (a, _))| a.contains_key("nns.param"))
        .map(|(i, (a, t))| {
            let name = match a.get("nns.name") {
                Some(AttrValue::Str(s)) => s.clone(),
                _ => format!("arg{i}"),
            };
            (name, t.clone())
        })
        .collect()
}

/// Location helper for callers without an op.
pub fn file_loc(file: &str) -> SrcLoc {
    SrcLoc::at(file, 0, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::IrContext;

    fn verify(src: &str) -> Vec<String> {
        let ctx = IrContext::new();
        let m = ctx.parse(src, "t.mlir").unwrap_or_else(|d| panic!("{d}"));
        verify_module(&m).0.iter().map(|d| d.to_string()).collect()
    }

    fn func(body: &str, args: &str) -> String {
        format!("func.func @f({args}) {{\n{body}\n  return\n}}\n")
    }

    #[test]
    fn every_example_verifies() {
        let mesh = r#""nns.mesh"() {sym_name = "world", axes = #nns.axes<pp = 2, dp = 2, tp = 4, mb = 4 (microbatches)>} : () -> ()"#;
        let examples = dnn::SPECS
            .iter()
            .map(|s| s.example)
            .chain(nns::COLLECTIVES.iter().map(|c| c.example));
        for ex in examples {
            // Give every %N operand a function argument of the right type.
            let (lhs, tys) = ex.rsplit_once(" : ").unwrap();
            let ins = tys.split_once(" -> ").unwrap().0;
            let ins = ins.trim_matches(|c| c == '(' || c == ')');
            let types: Vec<&str> = if ins.is_empty() {
                vec![]
            } else {
                view_split(ins)
            };
            let args: Vec<String> = types
                .iter()
                .enumerate()
                .map(|(i, t)| format!("%a{i}: {t}"))
                .collect();
            let mut line = lhs.to_string();
            for i in (0..types.len()).rev() {
                line = line
                    .replace(&format!("%{i})"), &format!("%a{i})"))
                    .replace(&format!("%{i},"), &format!("%a{i},"));
            }
            let src = format!(
                "{mesh}\n{}",
                func(&format!("  {line} : {tys}"), &args.join(", "))
            );
            assert_eq!(verify(&src), Vec::<String>::new(), "{ex}\n{src}");
        }
    }

    fn view_split(s: &str) -> Vec<&str> {
        s.split(", ").collect()
    }

    #[test]
    fn reports_every_error_with_location() {
        let src = func(
            r#"  %0 = "dnn.matmul"(%a, %b) : (tensor<4x8xf32>, tensor<7x16xf32>) -> tensor<4x16xf32>
  %1 = "dnn.bogus"(%a) : (tensor<4x8xf32>) -> tensor<4x8xf32>
  %2 = "dnn.relu"(%a) : (tensor<4x8xf32>) -> tensor<4x9xf32>"#,
            "%a: tensor<4x8xf32>, %b: tensor<7x16xf32>",
        );
        let errs = verify(&src);
        assert_eq!(errs.len(), 3, "{errs:?}");
        assert!(
            errs[0].starts_with("t.mlir:2:8: error: 'dnn.matmul' operands do not match"),
            "{}",
            errs[0]
        );
        assert!(errs[0].contains("dimension 'k' is 8 in operand 0 dim 1 but 7 in operand 1 dim 0"));
        assert!(errs[1].contains("t.mlir:3:8: error: 'dnn.bogus' is not a dnn op"));
        assert!(errs[2]
            .contains("result 0 has type tensor<4x9xf32> but its operands give tensor<4x8xf32>"));
    }

    #[test]
    fn split_directives() {
        let mesh =
            r#""nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()"#;
        let op = |split: &str| {
            format!(
                "{mesh}\n{}",
                func(
                    &format!(
                        r#"  %0 = "dnn.softmax"(%a) {{nns.split = #nns.split<{split}>}} : (tensor<6x8xf32>) -> tensor<6x8xf32>"#
                    ),
                    "%a: tensor<6x8xf32>"
                )
            )
        };
        assert!(verify(&op("a = dp")).is_empty());
        assert!(verify(&op("b = tp"))[0].contains("dimension 'b' is frozen"));
        assert!(verify(&op("a = tp"))[0].contains("length 6, which tp (size 4) does not divide"));
        assert!(verify(&op("a = pp"))[0].contains("no axis 'pp'"));
        assert!(verify(&op("z = dp"))[0].contains("has no dimension 'z'"));
        assert!(verify(&op("a = dp, a = tp"))[0].contains("two split directives"));
    }
}
