//! A `func.func` of tensor ops as an SSA graph in plain Rust data.
//!
//! The interpreter executes a [`Graph`]; analysis-heavy passes (autodiff, and later the
//! partitioner) read one, extend it with new ops whose result types come from the ops'
//! [`crate::spec::OpSpec`]s, and write it back as MLIR text that replaces the function.
//! Every op keeps its source location through the round trip (`loc(...)` is printed).

use crate::diag::SrcLoc;
use crate::dnn;
use crate::rewriter::{self, Builder};
use crate::spec::OpCtx;
use crate::types::{AttrValue, Attrs, TensorType};
use crate::view::{FuncView, OpView};
use melior::ir::{Module, OperationRef};
use mlir_sys::{
    mlirArrayAttrGet, mlirBlockAddArgument, mlirBlockGetArgument, mlirBlockGetFirstOperation,
    mlirBlockGetNumArguments, mlirBlockGetTerminator, mlirDictionaryAttrGet, mlirFunctionTypeGet,
    mlirIdentifierStr, mlirOperationGetContext, mlirOperationGetLocation, mlirOperationGetName,
    mlirOperationGetNextInBlock, mlirOperationGetNumOperands, mlirOperationGetNumRegions,
    mlirOperationGetNumResults, mlirOperationGetOperand, mlirOperationGetRegion,
    mlirOperationGetResult, mlirOperationSetOperands, mlirRegionGetFirstBlock, mlirTypeAttrGet,
    mlirValueSetType, MlirAttribute, MlirOperation, MlirValue,
};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

mod handles;
pub use crate::types::{NodeId, ValueId};
pub use handles::Op;

fn nns_name(attrs: &Attrs) -> Option<&str> {
    match attrs.get("nns.name") {
        Some(AttrValue::Str(s)) => Some(s),
        _ => None,
    }
}

/// A function argument.
#[derive(Clone, Debug)]
pub struct Arg {
    /// The value it defines.
    pub value: ValueId,
    /// Its attributes (`nns.name`, `nns.param`, ...).
    pub attrs: Attrs,
}

impl Arg {
    /// The `nns.name` of the argument, if any.
    pub fn name(&self) -> Option<&str> {
        nns_name(&self.attrs)
    }

    /// Whether the argument is a trainable parameter (`nns.param`).
    pub fn is_param(&self) -> bool {
        matches!(
            self.attrs.get("nns.param"),
            Some(AttrValue::Unit | AttrValue::Bool(true))
        )
    }

    /// Whether the argument is trained state: a parameter, or optimizer state
    /// (`nns.state_of`). Both come from parameter files or are drawn by their init rule.
    pub fn is_state(&self) -> bool {
        self.is_param() || self.attrs.contains_key("nns.state_of")
    }
}

/// One operation: its name, operands, results, attributes and location.
#[derive(Clone, Debug)]
pub struct Node {
    /// Full op name (`dnn.matmul`).
    pub op: Op,
    /// Operand values.
    pub inputs: Vec<ValueId>,
    /// Result values.
    pub outputs: Vec<ValueId>,
    /// Attributes.
    pub attrs: Attrs,
    /// Source location.
    pub loc: SrcLoc,
    /// The op of the IR this node was read from (an index into the graph's source), kept
    /// by clones: writing the graph back updates that op in place instead of making one.
    pub origin: Option<usize>,
}

/// A function result.
#[derive(Clone, Debug)]
pub struct Output {
    /// The returned value.
    pub value: ValueId,
    /// Its attributes (`nns.name`).
    pub attrs: Attrs,
}

impl Output {
    /// The `nns.name` of the result, if any.
    pub fn name(&self) -> Option<&str> {
        nns_name(&self.attrs)
    }
}

/// A function as an SSA graph. Nodes are in program order: every input of a node is an
/// argument or the output of an earlier node.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    /// Symbol name (without `@`).
    pub name: String,
    /// Location of the `func.func`.
    pub loc: SrcLoc,
    /// The type of every value.
    pub values: Vec<TensorType>,
    /// Arguments in order.
    pub args: Vec<Arg>,
    /// Operations in program order.
    pub nodes: Vec<Node>,
    /// Results in order.
    pub outputs: Vec<Output>,
    /// Attributes of the function itself (other than its name, type and argument/result
    /// attributes), e.g. `nns.localized`.
    pub func_attrs: Attrs,
    /// The IR the graph was read from, for writing it back in place ([`Graph::write_back`]).
    pub source: Option<std::sync::Arc<Source>>,
    /// The user-defined operators of the module the function is in (calls of them are ops
    /// with an annotation, like `dnn` ops).
    pub user_ops: std::sync::Arc<crate::userop::UserOps>,
    /// The functions this one may call, by name, for running it (`func.call` runs the
    /// callee's graph); filled by whoever runs the graph ([`Graph::link`]).
    pub callees: std::sync::Arc<BTreeMap<String, Graph>>,
}

/// The `func.func` a [`Graph`] was read from, and what it held then: writing the graph back
/// compares against this to change only what a pass changed.
///
/// Holds handles into the module's MLIR context; they are only used by the thread that
/// writes the graph back (the graph itself may be shared with interpreter threads, which
/// never look at its source).
#[derive(Debug)]
pub struct Source {
    func: MlirOperation,
    arg_types: Vec<TensorType>,
    arg_attrs: Vec<Attrs>,
    result_attrs: Vec<Attrs>,
    result_types: Vec<TensorType>,
    func_attrs: Attrs,
    /// The body's ops (not the return) with their attributes and result types.
    ops: Vec<(MlirOperation, Attrs, Vec<TensorType>)>,
}

// SAFETY: see the type's docs: the handles are only dereferenced by `Graph::write_back`, on
// the thread that owns the context.
unsafe impl Send for Source {}
// SAFETY: as above.
unsafe impl Sync for Source {}

/// The name of `op` (`dnn.matmul`).
///
/// # Safety
/// `op` must be live.
unsafe fn op_name(op: MlirOperation) -> String {
    // SAFETY: guaranteed by the caller; the identifier's string is owned by the context.
    unsafe { rewriter::string_of(mlirIdentifierStr(mlirOperationGetName(op))) }
}

/// Why a function cannot be read as a graph: a message and where.
#[derive(Clone, Debug)]
pub struct GraphError {
    /// Where the problem is.
    pub loc: SrcLoc,
    /// What it is.
    pub message: String,
}

impl Graph {
    /// Reads a `func.func` whose body is one block of ops on static tensors.
    pub fn from_func(op: &OperationRef<'_, '_>) -> Result<Graph, GraphError> {
        let fv = FuncView::of(op).ok_or_else(|| GraphError {
            loc: SrcLoc::from_location(op.location()),
            message: "expected a func.func".into(),
        })?;
        let err = |loc: &SrcLoc, message: String| GraphError {
            loc: loc.clone(),
            message,
        };
        let own = OpView::of(op).attrs;
        let mut g = Graph {
            name: fv.name.clone(),
            loc: fv.loc.clone(),
            func_attrs: own
                .into_iter()
                .filter(|(k, _)| {
                    !matches!(
                        k.as_str(),
                        "sym_name" | "function_type" | "arg_attrs" | "res_attrs" | "sym_visibility"
                    )
                })
                .collect(),
            ..Graph::default()
        };
        let mut ids: HashMap<usize, ValueId> = HashMap::new();
        let mut ops = Vec::new();
        let mut returned = false;
        let raw = op.to_raw();
        // SAFETY: `op` is a live func.func; we only read its region, block, args and ops.
        unsafe {
            if mlirOperationGetNumRegions(raw) != 1 {
                return Err(err(&fv.loc, "function must have one region".into()));
            }
            let block = mlirRegionGetFirstBlock(mlirOperationGetRegion(raw, 0));
            if block.ptr.is_null() {
                return Err(err(&fv.loc, "function has no body".into()));
            }
            let nargs = mlirBlockGetNumArguments(block) as usize;
            for i in 0..nargs {
                let ty = fv.args.get(i).cloned().flatten().ok_or_else(|| {
                    err(
                        &fv.loc,
                        format!("argument {i} must be a ranked tensor with a static shape"),
                    )
                })?;
                let v = mlirBlockGetArgument(block, i as isize);
                let id = g.new_value(ty);
                ids.insert(v.ptr as usize, id);
                g.args.push(Arg {
                    value: id,
                    attrs: fv.arg_attrs.get(i).cloned().unwrap_or_default(),
                });
            }
            let mut cur = mlirBlockGetFirstOperation(block);
            while !cur.ptr.is_null() {
                let opref = OperationRef::from_raw(cur);
                let view = OpView::of(&opref);
                let mut inputs = Vec::new();
                for k in 0..mlirOperationGetNumOperands(cur) {
                    let v = mlirOperationGetOperand(cur, k);
                    let id = ids.get(&(v.ptr as usize)).copied().ok_or_else(|| {
                        err(
                            view.loc(),
                            format!(
                                "operand {k} of '{}' is not defined in this function",
                                view.name
                            ),
                        )
                    })?;
                    inputs.push(id);
                }
                if view.name == "func.return" {
                    for (k, &value) in inputs.iter().enumerate() {
                        g.outputs.push(Output {
                            value,
                            attrs: fv.result_attrs.get(k).cloned().unwrap_or_default(),
                        });
                    }
                    returned = true;
                    break;
                }
                if mlirOperationGetNumRegions(cur) != 0 {
                    return Err(err(
                        view.loc(),
                        format!(
                            "'{}' has regions; only straight-line functions run",
                            view.name
                        ),
                    ));
                }
                let mut outputs = Vec::new();
                let mut result_types = Vec::new();
                for k in 0..mlirOperationGetNumResults(cur) {
                    let ty = view.results[k as usize].clone().ok_or_else(|| {
                        err(
                            view.loc(),
                            format!(
                                "result {k} of '{}' must be a ranked tensor with a static shape, not {}",
                                view.name, view.result_text(k as usize)
                            ),
                        )
                    })?;
                    let v = mlirOperationGetResult(cur, k);
                    result_types.push(ty.clone());
                    let id = g.new_value(ty);
                    ids.insert(v.ptr as usize, id);
                    outputs.push(id);
                }
                ops.push((cur, view.attrs.clone(), result_types));
                let loc = view.loc().clone();
                g.nodes.push(Node {
                    op: Op::new(&view.name),
                    inputs,
                    outputs,
                    attrs: view.attrs,
                    loc,
                    origin: Some(ops.len() - 1),
                });
                cur = mlirOperationGetNextInBlock(cur);
            }
            if !returned {
                return Err(err(
                    &fv.loc,
                    "the function does not end with a return".into(),
                ));
            }
        }
        // SAFETY: `op` is live; so is its parent module, which is only read.
        let parent = unsafe { mlir_sys::mlirOperationGetParentOperation(raw) };
        if !parent.ptr.is_null() {
            // Problems with user ops are the verifier's to report.
            let module = unsafe { OperationRef::from_raw(parent) };
            let ops =
                crate::userop::UserOps::collect(&module, &mut crate::diag::Diagnostics::default());
            g.user_ops = std::sync::Arc::new(ops);
        }
        g.source = Some(std::sync::Arc::new(Source {
            func: raw,
            arg_types: g.args.iter().map(|a| g.values[a.value].clone()).collect(),
            arg_attrs: g.args.iter().map(|a| a.attrs.clone()).collect(),
            result_attrs: g.outputs.iter().map(|o| o.attrs.clone()).collect(),
            result_types: g
                .outputs
                .iter()
                .map(|o| g.values[o.value].clone())
                .collect(),
            func_attrs: g.func_attrs.clone(),
            ops,
        }));
        Ok(g)
    }

    /// Writes the graph back into the `func.func` it was read from, in place: ops it kept
    /// are updated (operands, result types, only the attributes that changed) and moved into
    /// the graph's order, new ops are created with the location of what they came from, ops
    /// it dropped are erased, and the signature (argument and result types and attributes,
    /// function attributes) is brought up to date. Attributes, locations and ops the pass did
    /// not change stay the very same MLIR objects.
    pub fn write_back(&self) -> Result<(), String> {
        let src = self
            .source
            .as_ref()
            .ok_or("internal error: the graph was not read from IR")?;
        // SAFETY: `src.func` is the live func.func this graph was read from (the caller runs
        // the pass that read it and has not changed the function since); every handle used
        // below belongs to it and to its context.
        unsafe { self.write_into(src) }
    }

    unsafe fn write_into(&self, src: &Source) -> Result<(), String> {
        let func = src.func;
        // SAFETY (whole function): see `write_back`.
        unsafe {
            let mut b = Builder::for_op(func);
            let func_loc = mlirOperationGetLocation(func);
            let block = mlirRegionGetFirstBlock(mlirOperationGetRegion(func, 0));
            let ret = mlirBlockGetTerminator(block);
            if ret.ptr.is_null() {
                return Err(format!("@{}: the function has no terminator", self.name));
            }
            let nargs = mlirBlockGetNumArguments(block) as usize;
            if self.args.len() < nargs {
                return Err(format!(
                    "@{}: a pass removed arguments, which writing back does not support",
                    self.name
                ));
            }
            let mut vals: Vec<Option<MlirValue>> = vec![None; self.values.len()];
            for (i, a) in self.args.iter().enumerate() {
                let ty = &self.values[a.value];
                let v = if i < nargs {
                    let v = mlirBlockGetArgument(block, i as isize);
                    if src.arg_types.get(i) != Some(ty) {
                        mlirValueSetType(v, b.tensor_type(ty)?);
                    }
                    v
                } else {
                    mlirBlockAddArgument(block, b.tensor_type(ty)?, func_loc)
                };
                vals[a.value] = Some(v);
            }
            let value = |vals: &[Option<MlirValue>], v: ValueId| {
                vals[v].ok_or_else(|| {
                    format!(
                        "internal error: @{}: a value is used before it is defined",
                        self.name
                    )
                })
            };
            let mut reused = vec![false; src.ops.len()];
            let mut prev = MlirOperation {
                ptr: std::ptr::null_mut(),
            };
            for n in &self.nodes {
                let operands: Vec<MlirValue> = n
                    .inputs
                    .iter()
                    .map(|&v| value(&vals, v))
                    .collect::<Result<_, _>>()?;
                let keep = n.origin.filter(|&k| {
                    let (op, _, results) = &src.ops[k];
                    !reused[k] && results.len() == n.outputs.len() && n.op == op_name(*op)
                });
                let op = match keep {
                    Some(k) => {
                        reused[k] = true;
                        let (op, old_attrs, old_types) = &src.ops[k];
                        let op = *op;
                        mlirOperationSetOperands(op, operands.len() as isize, operands.as_ptr());
                        for (j, &o) in n.outputs.iter().enumerate() {
                            if old_types[j] != self.values[o] {
                                let r = mlirOperationGetResult(op, j as isize);
                                mlirValueSetType(r, b.tensor_type(&self.values[o])?);
                            }
                        }
                        for (key, v) in &n.attrs {
                            if old_attrs.get(key) != Some(v) {
                                rewriter::set_attr(op, key, b.attribute(v)?);
                            }
                        }
                        for key in old_attrs.keys().filter(|k| !n.attrs.contains_key(*k)) {
                            rewriter::remove_attr(op, key);
                        }
                        rewriter::place_after(block, op, prev);
                        op
                    }
                    None => {
                        let types = n
                            .outputs
                            .iter()
                            .map(|&o| b.tensor_type(&self.values[o]))
                            .collect::<Result<Vec<_>, _>>()?;
                        let attrs = n
                            .attrs
                            .iter()
                            .map(|(k, v)| Ok(b.named(k, b.attribute(v)?)))
                            .collect::<Result<Vec<_>, String>>()?;
                        let loc = b.location(&n.loc, func_loc);
                        let op = b.create_op(&n.op, &operands, &types, &attrs, loc);
                        rewriter::insert_after(block, op, prev);
                        op
                    }
                };
                for (j, &o) in n.outputs.iter().enumerate() {
                    vals[o] = Some(mlirOperationGetResult(op, j as isize));
                }
                prev = op;
            }
            let rets: Vec<MlirValue> = self
                .outputs
                .iter()
                .map(|o| value(&vals, o.value))
                .collect::<Result<_, _>>()?;
            mlirOperationSetOperands(ret, rets.len() as isize, rets.as_ptr());
            for (k, (op, _, _)) in src.ops.iter().enumerate().rev() {
                if !reused[k] {
                    rewriter::erase(*op)?;
                }
            }
            self.write_signature(src, &mut b)
        }
    }

    /// Writes the graph as a new `func.func` named `self.name`, inserted into the module
    /// right after `after` (a top-level op): a copy of function `template` emptied of its
    /// body and signature, then written like [`Graph::write_back`] (every op made new, with
    /// its node's location; the function's attributes become `self.func_attrs`). Returns
    /// the new op.
    ///
    /// # Safety
    /// `template` must be a live `func.func` and `after` a live op in the body of the same
    /// module; the caller must not hold handles into the new function's body.
    pub unsafe fn write_as_new_function(
        &self,
        template: MlirOperation,
        after: MlirOperation,
    ) -> Result<MlirOperation, String> {
        // SAFETY: see the function's contract; the copy is made in the template's context
        // and handed to the module's body before anything else reads it.
        unsafe {
            let copy = mlir_sys::mlirOperationClone(template);
            let block = mlirRegionGetFirstBlock(mlirOperationGetRegion(copy, 0));
            if block.ptr.is_null() {
                mlir_sys::mlirOperationDestroy(copy);
                return Err(format!("@{}: the template function has no body", self.name));
            }
            let ret = mlirBlockGetTerminator(block);
            mlirOperationSetOperands(ret, 0, std::ptr::null());
            let mut ops = Vec::new();
            let mut op = mlirBlockGetFirstOperation(block);
            while !op.ptr.is_null() && op.ptr != ret.ptr {
                ops.push(op);
                op = mlirOperationGetNextInBlock(op);
            }
            for op in ops.into_iter().rev() {
                mlir_sys::mlirOperationDestroy(op);
            }
            while mlirBlockGetNumArguments(block) > 0 {
                let n = mlirBlockGetNumArguments(block);
                mlir_sys::mlirBlockEraseArgument(block, (n - 1) as u32);
            }
            let ctx = mlirOperationGetContext(copy);
            let b = Builder::for_op(copy);
            let fty = mlirFunctionTypeGet(ctx, 0, std::ptr::null(), 0, std::ptr::null());
            rewriter::set_attr(copy, "function_type", mlirTypeAttrGet(fty));
            rewriter::remove_attr(copy, "arg_attrs");
            rewriter::remove_attr(copy, "res_attrs");
            rewriter::set_attr(
                copy,
                "sym_name",
                b.attribute(&AttrValue::Str(self.name.clone()))?,
            );
            let module_block = mlir_sys::mlirOperationGetBlock(after);
            mlir_sys::mlirBlockInsertOwnedOperationAfter(module_block, after, copy);
            let shell = Graph::from_func(&OperationRef::from_raw(copy))
                .map_err(|e| format!("@{}: {}", self.name, e.message))?;
            let src = shell
                .source
                .ok_or("internal error: a function read from IR has no source")?;
            let mut g = self.clone();
            for n in &mut g.nodes {
                n.origin = None;
            }
            g.write_into(&src)?;
            Ok(copy)
        }
    }

    /// The signature part of [`Graph::write_back`].
    unsafe fn write_signature(&self, src: &Source, b: &mut Builder) -> Result<(), String> {
        let func = src.func;
        // SAFETY (whole function): see `write_back`.
        unsafe {
            let ctx = mlirOperationGetContext(func);
            let arg_types: Vec<TensorType> = self
                .args
                .iter()
                .map(|a| self.values[a.value].clone())
                .collect();
            let res_types: Vec<TensorType> = self
                .outputs
                .iter()
                .map(|o| self.values[o.value].clone())
                .collect();
            if arg_types != src.arg_types || res_types != src.result_types {
                let ins = arg_types
                    .iter()
                    .map(|t| b.tensor_type(t))
                    .collect::<Result<Vec<_>, _>>()?;
                let outs = res_types
                    .iter()
                    .map(|t| b.tensor_type(t))
                    .collect::<Result<Vec<_>, _>>()?;
                let fty = mlirFunctionTypeGet(
                    ctx,
                    ins.len() as isize,
                    ins.as_ptr(),
                    outs.len() as isize,
                    outs.as_ptr(),
                );
                rewriter::set_attr(func, "function_type", mlirTypeAttrGet(fty));
            }
            let args: Vec<&Attrs> = self.args.iter().map(|a| &a.attrs).collect();
            let results: Vec<&Attrs> = self.outputs.iter().map(|o| &o.attrs).collect();
            for (key, new, old) in [
                ("arg_attrs", args, &src.arg_attrs),
                ("res_attrs", results, &src.result_attrs),
            ] {
                let same = new.len() == old.len() && new.iter().zip(old).all(|(a, b)| *a == b);
                if same {
                    continue;
                }
                if new.iter().all(|a| a.is_empty()) {
                    rewriter::remove_attr(func, key);
                    continue;
                }
                let dicts = new
                    .iter()
                    .map(|attrs| {
                        let named = attrs
                            .iter()
                            .map(|(k, v)| Ok(b.named(k, b.attribute(v)?)))
                            .collect::<Result<Vec<_>, String>>()?;
                        Ok(mlirDictionaryAttrGet(
                            ctx,
                            named.len() as isize,
                            named.as_ptr(),
                        ))
                    })
                    .collect::<Result<Vec<MlirAttribute>, String>>()?;
                let array = mlirArrayAttrGet(ctx, dicts.len() as isize, dicts.as_ptr());
                rewriter::set_attr(func, key, array);
            }
            for (key, v) in &self.func_attrs {
                if src.func_attrs.get(key) != Some(v) {
                    rewriter::set_attr(func, key, b.attribute(v)?);
                }
            }
            for key in src
                .func_attrs
                .keys()
                .filter(|k| !self.func_attrs.contains_key(*k))
            {
                rewriter::remove_attr(func, key);
            }
        }
        Ok(())
    }

    /// Appends an argument of type `ty` with `attrs`.
    pub fn add_arg(&mut self, ty: TensorType, attrs: Attrs) -> ValueId {
        let value = self.new_value(ty);
        self.args.push(Arg { value, attrs });
        value
    }

    /// Gives `self` the functions of `all` (the module's other functions, read as graphs)
    /// to call when it runs.
    pub fn link(&mut self, all: &[Graph]) {
        let map: BTreeMap<String, Graph> = all
            .iter()
            .filter(|f| f.name != self.name)
            .map(|f| (f.name.clone(), f.clone()))
            .collect();
        self.callees = std::sync::Arc::new(map);
    }

    /// Every `func.func` of `module`, in order, each read as a graph (or why it cannot be).
    pub fn all_in(module: &Module<'_>) -> Vec<Result<Graph, GraphError>> {
        Graph::all_in_op(&module.as_operation())
    }

    /// [`Graph::all_in`] of a module given as its operation (what a module pass is given).
    pub fn all_in_op(module: &OperationRef<'_, '_>) -> Vec<Result<Graph, GraphError>> {
        let mut out = Vec::new();
        crate::view::top_level_ops(module, &mut |op| {
            if op.name().as_string_ref().as_str() == Ok("func.func") {
                out.push(Graph::from_func(op));
            }
        });
        out
    }

    /// Adds a value of type `ty`.
    pub fn new_value(&mut self, ty: TensorType) -> ValueId {
        self.values.push(ty);
        ValueId::new(self.values.len() - 1)
    }

    /// Appends op `op` on `inputs` with `attrs`; its result types come from the op's spec
    /// (which also checks the operands and attributes).
    pub fn add(
        &mut self,
        op: &str,
        inputs: &[ValueId],
        attrs: Attrs,
        loc: &SrcLoc,
    ) -> Result<Vec<ValueId>, String> {
        let spec = dnn::spec(op).ok_or_else(|| format!("unknown op '{op}'"))?;
        let operands: Vec<Option<TensorType>> = inputs
            .iter()
            .map(|&v| Some(self.values[v].clone()))
            .collect();
        let ctx = OpCtx {
            operands: &operands,
            attrs: &attrs,
        };
        let (types, _, _) = spec.check(&ctx).map_err(|e| format!("'{op}' {e}"))?;
        Ok(self.add_raw(op, inputs, types, attrs, loc))
    }

    /// Appends op `op` with the given result types, unchecked: an op that has no spec (an
    /// `nns` op), or one [`Graph::add`] has checked.
    pub fn add_raw(
        &mut self,
        op: &str,
        inputs: &[ValueId],
        types: Vec<TensorType>,
        attrs: Attrs,
        loc: &SrcLoc,
    ) -> Vec<ValueId> {
        let outputs: Vec<ValueId> = types.into_iter().map(|t| self.new_value(t)).collect();
        self.nodes.push(Node {
            op: Op::new(op),
            inputs: inputs.to_vec(),
            outputs: outputs.clone(),
            attrs,
            loc: loc.clone(),
            origin: None,
        });
        outputs
    }

    /// [`Graph::add`] for a single-result op.
    pub fn add1(
        &mut self,
        op: &str,
        inputs: &[ValueId],
        attrs: Attrs,
        loc: &SrcLoc,
    ) -> Result<ValueId, String> {
        let out = self.add(op, inputs, attrs, loc)?;
        match out.as_slice() {
            [v] => Ok(*v),
            _ => Err(format!("'{op}' has {} results, expected one", out.len())),
        }
    }

    /// How parameter argument `arg` is initialized: its `nns.init`, or the default from how
    /// it is used — ones for the weight of `layer_norm`/`rms_norm`, zeros for the bias of
    /// `linear`/`layer_norm`, normal(0, 0.02) otherwise (GPT-2 and Llama conventions).
    /// Uses are followed through `nns` ops (relayouts and collectives move a value, they do
    /// not change what it is) and casts (autocast's bf16 copies), so a partitioned or
    /// mixed-precision program draws the single-device values. A
    /// parameter whose uses ask for different rules (a norm weight that is also a bias) is
    /// an error asking for an `nns.init`: no plan may decide which use wins.
    pub fn init_rule(&self, arg: usize) -> Result<crate::types::Init, String> {
        use crate::types::Init;
        let a = &self.args[arg];
        if let Some(v) = a.attrs.get("nns.init") {
            return match v {
                AttrValue::Str(s) => Init::parse(s),
                other => Err(format!(
                    "'nns.init' must be a string, not {}",
                    other.kind_name()
                )),
            };
        }
        let mut found: Vec<(Init, String)> = Vec::new();
        self.init_uses(a.value, 0, &mut found);
        match found.as_slice() {
            [] => Ok(Init::Normal {
                mean: 0.0,
                std: 0.02,
            }),
            [(rule, _)] => Ok(*rule),
            [(r0, w0), (r1, w1), ..] => Err(format!(
                "parameter '{}' is used as {w0}, initialized to {r0}, and as {w1}, initialized \
                 to {r1}; give it an explicit nns.init",
                a.name().unwrap_or("?")
            )),
        }
    }

    /// The init rules the uses of `value` imply (first use of each rule, with what the use
    /// is), following `nns` ops and calls into the functions `callees` holds (a pipeline's
    /// fragments, a user op's body).
    fn init_uses(
        &self,
        value: ValueId,
        depth: usize,
        found: &mut Vec<(crate::types::Init, String)>,
    ) {
        let mut aliases = vec![false; self.values.len()];
        aliases[value] = true;
        for n in &self.nodes {
            for (i, &v) in n.inputs.iter().enumerate() {
                if !aliases[v] {
                    continue;
                }
                // Relayouts and collectives move a value and a cast (`--autocast`'s bf16
                // copy) rounds it: none changes what it is.
                if n.op.starts_with("nns.") || n.op == "dnn.cast" {
                    for &o in &n.outputs {
                        aliases[o] = true;
                    }
                    continue;
                }
                if n.op == "func.call" {
                    let callee = crate::userop::callee(&n.attrs).and_then(|c| self.callees.get(c));
                    if let Some(f) = callee.filter(|_| depth < 64) {
                        if let Some(arg) = f.args.get(i) {
                            f.init_uses(arg.value, depth + 1, found);
                        }
                    }
                    continue;
                }
                let rule = n.op.spec().and_then(|s| {
                    s.traits
                        .param_init
                        .iter()
                        .find(|(k, _, _)| *k == i)
                        .copied()
                });
                let Some((_, rule, what)) = rule else {
                    continue;
                };
                if !found.iter().any(|(r, _)| *r == rule) {
                    let op = n.op.trim_start_matches("dnn.");
                    found.push((rule, format!("a {op} {what} (at {})", n.loc)));
                }
            }
        }
    }

    /// Whether `--localize` produced this function (its shapes are per-device).
    pub fn is_localized(&self) -> bool {
        self.func_attrs.contains_key("nns.localized")
    }

    /// The node that makes each value, by value (`None` for the arguments).
    pub fn producers(&self) -> Vec<Option<NodeId>> {
        let mut producer = vec![None; self.values.len()];
        for (k, n) in self.nodes.iter().enumerate() {
            for &o in &n.outputs {
                producer[o] = Some(NodeId::new(k));
            }
        }
        producer
    }

    /// How many times each value is used (by nodes and by the return).
    pub fn use_counts(&self) -> Vec<usize> {
        let mut n = vec![0; self.values.len()];
        for node in &self.nodes {
            for &v in &node.inputs {
                n[v] += 1;
            }
        }
        for o in &self.outputs {
            n[o.value] += 1;
        }
        n
    }

    /// The function as MLIR text (generic op form, locations kept).
    pub fn to_mlir(&self) -> String {
        let mut names: Vec<String> = vec![String::new(); self.values.len()];
        for (i, a) in self.args.iter().enumerate() {
            names[a.value] = format!("%arg{i}");
        }
        for (k, n) in self.nodes.iter().enumerate() {
            if n.outputs.len() == 1 {
                names[n.outputs[0]] = format!("%{k}");
            } else {
                for (j, &o) in n.outputs.iter().enumerate() {
                    names[o] = format!("%{k}#{j}");
                }
            }
        }
        let mut s = String::new();
        let args: Vec<String> = self
            .args
            .iter()
            .enumerate()
            .map(|(i, a)| format!("%arg{i}: {}{}", self.values[a.value], dict(&a.attrs)))
            .collect();
        let results: Vec<String> = self
            .outputs
            .iter()
            .map(|o| format!("{}{}", self.values[o.value], dict(&o.attrs)))
            .collect();
        let fattrs = if self.func_attrs.is_empty() {
            String::new()
        } else {
            format!(" attributes{}", dict(&self.func_attrs))
        };
        let _ = writeln!(
            s,
            "func.func @{}({}) -> ({}){fattrs} {{",
            self.name,
            args.join(", "),
            results.join(", ")
        );
        for (k, n) in self.nodes.iter().enumerate() {
            let lhs = match n.outputs.len() {
                0 => String::new(),
                1 => format!("%{k} = "),
                m => format!("%{k}:{m} = "),
            };
            let ins: Vec<&str> = n.inputs.iter().map(|&v| names[v].as_str()).collect();
            let in_tys: Vec<String> = n
                .inputs
                .iter()
                .map(|&v| self.values[v].to_string())
                .collect();
            let out_tys: Vec<String> = n
                .outputs
                .iter()
                .map(|&v| self.values[v].to_string())
                .collect();
            let attrs = if n.attrs.is_empty() {
                String::new()
            } else {
                let items: Vec<String> = n
                    .attrs
                    .iter()
                    .map(|(k, v)| format!("{} = {}", attr_key(k), v.to_mlir_text()))
                    .collect();
                format!(" {{{}}}", items.join(", "))
            };
            let outs = if out_tys.len() == 1 {
                out_tys[0].clone()
            } else {
                format!("({})", out_tys.join(", "))
            };
            let _ = writeln!(
                s,
                "  {lhs}\"{}\"({}){attrs} : ({}) -> {outs}{}",
                n.op,
                ins.join(", "),
                in_tys.join(", "),
                loc_suffix(&n.loc)
            );
        }
        let rets: Vec<&str> = self
            .outputs
            .iter()
            .map(|o| names[o.value].as_str())
            .collect();
        let ret_tys: Vec<String> = self
            .outputs
            .iter()
            .map(|o| self.values[o.value].to_string())
            .collect();
        if rets.is_empty() {
            let _ = writeln!(s, "  return");
        } else {
            let _ = writeln!(s, "  return {} : {}", rets.join(", "), ret_tys.join(", "));
        }
        let _ = writeln!(s, "}}{}", loc_suffix(&self.loc));
        s
    }
}

fn attr_key(k: &str) -> String {
    if k.chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '$')
    {
        k.to_string()
    } else {
        format!("\"{k}\"")
    }
}

fn dict(attrs: &Attrs) -> String {
    if attrs.is_empty() {
        return String::new();
    }
    let items: Vec<String> = attrs
        .iter()
        .map(|(k, v)| match v {
            AttrValue::Unit => attr_key(k),
            v => format!("{} = {}", attr_key(k), v.to_mlir_text()),
        })
        .collect();
    format!(" {{{}}}", items.join(", "))
}

fn loc_suffix(loc: &SrcLoc) -> String {
    if loc.line == 0 {
        String::new()
    } else {
        format!(
            " loc(\"{}\":{}:{})",
            loc.file.replace('\\', "\\\\").replace('"', "\\\""),
            loc.line,
            loc.col
        )
    }
}

/// VJP rules emit into a graph.
impl crate::vjp::Emit for Graph {
    fn value(&self, v: ValueId) -> &TensorType {
        &self.values[v]
    }

    fn emit(
        &mut self,
        op: &str,
        ins: &[ValueId],
        attrs: Attrs,
        loc: &SrcLoc,
    ) -> Result<Vec<ValueId>, String> {
        self.add(op, ins, attrs, loc)
    }
}

/// The forward op a VJP rule differentiates: the node's operands, results, attributes
/// and location.
impl From<&Node> for crate::vjp::Forward {
    fn from(n: &Node) -> Self {
        crate::vjp::Forward {
            inputs: n.inputs.clone(),
            outputs: n.outputs.clone(),
            attrs: n.attrs.clone(),
            loc: n.loc.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::IrContext;
    use crate::view::top_level_ops;

    const SRC: &str = r#"func.func @f(%arg0: tensor<2x3xf32> {nns.name = "x"}, %arg1: tensor<4x3xf32> {nns.name = "w", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %0 = "dnn.linear"(%arg0, %arg1) : (tensor<2x3xf32>, tensor<4x3xf32>) -> tensor<2x4xf32>
  %1:2 = "dnn.split"(%0) {dim = 1 : i64, sizes = array<i64: 1, 3>} : (tensor<2x4xf32>) -> (tensor<2x1xf32>, tensor<2x3xf32>)
  %2 = "dnn.sum"(%1#1) {dims = array<i64: 0, 1>} : (tensor<2x3xf32>) -> tensor<f32>
  return %2 : tensor<f32>
}
"#;

    fn graph_of(ir: &IrContext, src: &str) -> Graph {
        let m = ir.parse(src, "g.mlir").expect("parses");
        let mut g = None;
        top_level_ops(&m.as_operation(), &mut |op| {
            if g.is_none() {
                g = Some(Graph::from_func(op).expect("reads"));
            }
        });
        g.expect("has a func")
    }

    #[test]
    fn reads_and_round_trips() {
        let ir = IrContext::new();
        let g = graph_of(&ir, SRC);
        assert_eq!(g.args.len(), 2);
        assert_eq!(g.args[0].name(), Some("x"));
        assert!(g.args[1].is_param() && !g.args[0].is_param());
        assert_eq!(g.nodes.len(), 3);
        assert_eq!(g.nodes[1].outputs.len(), 2);
        assert_eq!(g.nodes[2].inputs, vec![g.nodes[1].outputs[1]]);
        assert_eq!(g.outputs[0].name(), Some("loss"));
        assert_eq!(g.nodes[0].loc.line, 2);
        let text = g.to_mlir();
        let g2 = graph_of(&ir, &text);
        assert_eq!(g2.to_mlir(), text);
        assert_eq!(g2.nodes[2].loc, g.nodes[2].loc, "locations survive");
    }

    /// A bf16 copy of a parameter (`dnn.cast`, what `--autocast` reads) is the parameter:
    /// a linear's bias read through one still starts at zeros, a norm's weight at ones.
    #[test]
    fn init_rules_follow_casts() {
        let ir = IrContext::new();
        let src = r#"func.func @f(%arg0: tensor<2x3xf32> {nns.name = "x"}, %arg1: tensor<4x3xf32> {nns.name = "w", nns.param}, %arg2: tensor<4xf32> {nns.name = "b", nns.param}, %arg3: tensor<4xf32> {nns.name = "g", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %0 = "dnn.cast"(%arg0) {to = "bf16"} : (tensor<2x3xf32>) -> tensor<2x3xbf16>
  %1 = "dnn.cast"(%arg1) {to = "bf16"} : (tensor<4x3xf32>) -> tensor<4x3xbf16>
  %2 = "dnn.cast"(%arg2) {to = "bf16"} : (tensor<4xf32>) -> tensor<4xbf16>
  %3 = "dnn.linear"(%0, %1, %2) : (tensor<2x3xbf16>, tensor<4x3xbf16>, tensor<4xbf16>) -> tensor<2x4xbf16>
  %4 = "dnn.cast"(%arg3) {to = "bf16"} : (tensor<4xf32>) -> tensor<4xbf16>
  %5 = "dnn.cast"(%2) {to = "f32"} : (tensor<4xbf16>) -> tensor<4xf32>
  %6 = "dnn.layer_norm"(%3, %4) {eps = 1.0e-5 : f64} : (tensor<2x4xbf16>, tensor<4xbf16>) -> tensor<2x4xbf16>
  %7 = "dnn.cast"(%6) {to = "f32"} : (tensor<2x4xbf16>) -> tensor<2x4xf32>
  %8 = "dnn.sum"(%7) {dims = array<i64: 0, 1>} : (tensor<2x4xf32>) -> tensor<f32>
  return %8 : tensor<f32>
}
"#;
        let g = graph_of(&ir, src);
        use crate::types::Init;
        let normal = Init::Normal {
            mean: 0.0,
            std: 0.02,
        };
        assert_eq!(g.init_rule(1).unwrap(), normal, "a linear's weight");
        assert_eq!(g.init_rule(2).unwrap(), Init::Const(0.0), "a linear's bias");
        assert_eq!(g.init_rule(3).unwrap(), Init::Const(1.0), "a norm's weight");
    }

    #[test]
    fn add_infers_types_and_checks() {
        let ir = IrContext::new();
        let mut g = graph_of(&ir, SRC);
        let x = g.args[0].value;
        let y = g
            .add1("dnn.relu", &[x], Attrs::new(), &SrcLoc::default())
            .unwrap();
        assert_eq!(g.values[y].shape, vec![2, 3]);
        let w = g.args[1].value;
        let e = g.add("dnn.matmul", &[x, w], Attrs::new(), &SrcLoc::default());
        assert!(e.unwrap_err().contains("dnn.matmul"));
    }
}
