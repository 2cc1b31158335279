//! `--autocast=bf16`: mixed precision, in one of two scopes.
//!
//! **Matrix products** (the default, as PyTorch's autocast chooses them): every matrix
//! product of the forward (`dnn.matmul`, `dnn.linear`, `dnn.attention`: the ops whose spec
//! says `matrix`) reads bf16 copies of its f32 operands and writes a bf16 result, which a
//! `dnn.cast` turns back into the f32 value the rest of the program read before;
//! everything else (norms, softmax, losses, elementwise ops, the optimizer) stays in f32.
//! Each use casts its own copy (a value three projections read is cast three times): the
//! gradients of the copies then meet in f32, where the backward sums them, instead of being
//! summed in bf16. Differences from PyTorch's autocast, which casts the same ops: its
//! elementwise ops on a bf16 result stay in bf16 (here they run in f32 after the cast back),
//! and it casts a weight once per autocast region (here once per use).
//!
//! **Activations** (`--autocast="bf16 activations=bf16"`, Megatron-LM's `--bf16`): every
//! `dnn` op of the forward that reads a float reads bf16 and writes bf16, so activations
//! are stored, saved for the backward, sent between stages and reduced across tensor
//! parallelism in 2 bytes. An op still computes in f32 inside (a norm's statistics, a
//! softmax's sums, a product's accumulation) and rounds each result once. What stays f32:
//! an op writing a function result or a scalar (the loss, as Megatron-LM casts the logits
//! to f32 for its cross-entropy), ops of other dialects and user ops (their kernels read
//! f32), and ops that read no float (a fill). An activation is cast once where its first
//! bf16 reader needs it, and back to f32 where an f32 reader does; parameters (and other
//! float arguments) are cast once per use, so each parameter's gradient is summed in f32.
//!
//! In both scopes the parameters stay f32 (the master weights) and the optimizer runs in
//! f32. Run before `--autodiff`: the backward it derives has the casts' VJPs, so gradients
//! of bf16 values are bf16 and every parameter's gradient arrives in f32. bf16 keeps f32's
//! exponent range, so no loss scaling is needed.
//!
//! What the runtimes do with it: floats are computed in f32 and every bf16 result is rounded
//! to bf16 once (ties to even), as a GPU GEMM accumulates in f32 and stores bf16; the CPU
//! runtime and the generated kernels round the same way.

use crate::layouts::error;
use crate::pass::{FunctionPass, PassOptions};
use crate::transforms::recompute::has_backward;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::{Graph, Node, ValueId};
use nnscaler_dialects::spec::OpCtx;
use nnscaler_dialects::types::{AttrValue, Attrs, Elem, TensorType};
use std::collections::{HashMap, HashSet};

/// What runs in bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The forward's matrix products (`activations=f32`, the default).
    Products,
    /// Every float op of the forward but the loss (`activations=bf16`).
    Activations,
}

/// The pass.
#[derive(Debug)]
pub struct Autocast {
    scope: Scope,
    remarks: Diagnostics,
}

impl Autocast {
    /// Options: `to` (bf16, the only one; also written alone: `--autocast=bf16`) and
    /// `activations` (f32: only the matrix products run in bf16; bf16: every activation).
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        match o.get("to").unwrap_or("bf16") {
            "bf16" => {}
            "f16" => {
                return Err(
                    "autocast: f16 needs loss scaling, which nnscaler does not do; use bf16".into(),
                )
            }
            other => return Err(format!("autocast: unknown type '{other}' (types: bf16)")),
        }
        let scope = match o.get("activations").unwrap_or("f32") {
            "f32" => Scope::Products,
            "bf16" => Scope::Activations,
            other => {
                return Err(format!(
                    "autocast: 'activations={other}' must be f32 (only the matrix products in bf16) or bf16 (every activation)"
                ))
            }
        };
        Ok(Autocast {
            scope,
            remarks: Diagnostics::default(),
        })
    }
}

impl FunctionPass for Autocast {
    fn run_on_function(&mut self, g: Graph) -> Result<Option<Graph>, Diagnostics> {
        if g.is_localized() {
            return Err(error(
                &g.loc,
                "autocast: the function is localized; cast before --localize (and before --autodiff)",
            ));
        }
        let derived = g
            .nodes
            .iter()
            .find(|n| n.op == "dnn.cast" || n.op.spec().is_some_and(|s| s.grad_of.is_some()));
        if let Some(n) = derived {
            let what = if n.op == "dnn.cast" {
                "already has casts (autocast runs once)"
            } else {
                "has a backward; run --autocast before --autodiff, so that the backward is derived from the casts"
            };
            return Err(error(&n.loc, format!("autocast: @{} {what}", g.name)));
        }
        if has_backward(&g) {
            return Err(error(
                &g.loc,
                format!(
                    "autocast: @{} is a training step already; run --autocast before --autodiff",
                    g.name
                ),
            ));
        }
        let (out, count) = autocast_in(&g, self.scope).map_err(|m| error(&g.loc, m))?;
        let what = match self.scope {
            Scope::Products => "matrix products",
            Scope::Activations => "ops (every activation)",
        };
        self.remarks.remark(
            &g.loc,
            format!("autocast @{}: {count} {what} in bf16", g.name),
        );
        Ok(Some(out))
    }
    fn take_remarks(&mut self) -> Diagnostics {
        std::mem::take(&mut self.remarks)
    }
}

/// Whether `n` is a forward matrix product on f32 operands: what autocast runs in bf16.
fn cast_here(g: &Graph, n: &Node) -> bool {
    n.op.spec()
        .is_some_and(|s| s.traits.matrix && s.grad_of.is_none())
        && n.inputs.iter().any(|&v| g.values[v].elem == Elem::F32)
        && n.outputs.iter().all(|&v| g.values[v].elem == Elem::F32)
}

/// A cast's attributes: the placement of the op it serves (`nns::placement_of`), so
/// placement, pipelines and recompute treat it as part of that op.
fn cast_attrs(n: &Node, to: Elem) -> Attrs {
    let mut a = nnscaler_dialects::nns::placement_of(&n.attrs);
    a.insert("to".into(), AttrValue::Str(to.to_string()));
    a
}

/// A cast of bf16 value `from` to f32 that writes value `to` (an existing f32 value, so its
/// readers are unchanged), placed with op `of`.
fn cast_back(from: ValueId, to: ValueId, of: &Node) -> Node {
    Node {
        op: "dnn.cast".into(),
        inputs: vec![from],
        outputs: vec![to],
        attrs: cast_attrs(of, Elem::F32),
        loc: of.loc.clone(),
        origin: None,
    }
}

/// `g` with its forward matrix products in bf16, and how many there were. The product
/// keeps its place and identity (its results are new bf16 values); the casts back write the
/// f32 values it wrote before, so every reader is unchanged.
pub fn autocast(g: &Graph) -> Result<(Graph, usize), String> {
    let mut out = g.clone();
    let old = std::mem::take(&mut out.nodes);
    let mut count = 0;
    for mut n in old {
        if !cast_here(g, &n) {
            out.nodes.push(n);
            continue;
        }
        let to_bf16 = cast_attrs(&n, Elem::BF16);
        for v in &mut n.inputs {
            if out.values[*v].elem == Elem::F32 {
                *v = out.add1("dnn.cast", &[*v], to_bf16.clone(), &n.loc)?;
            }
        }
        let finals = std::mem::take(&mut n.outputs);
        n.outputs = finals
            .iter()
            .map(|&v| {
                out.new_value(TensorType {
                    shape: g.values[v].shape.clone(),
                    elem: Elem::BF16,
                })
            })
            .collect();
        let back: Vec<Node> = n
            .outputs
            .iter()
            .zip(&finals)
            .map(|(&b, &f)| cast_back(b, f, &n))
            .collect();
        out.nodes.push(n);
        out.nodes.extend(back);
        count += 1;
    }
    Ok((out, count))
}

/// `g` cast in `scope`, and how many ops now run in bf16.
pub fn autocast_in(g: &Graph, scope: Scope) -> Result<(Graph, usize), String> {
    match scope {
        Scope::Products => autocast(g),
        Scope::Activations => autocast_activations(g),
    }
}

/// Whether op `n` keeps f32 in the activations scope although it reads floats: it is not a
/// forward `dnn` op (another dialect's, a user op's, a gradient's or the optimizer's), or it
/// writes a function result or a scalar (a loss).
fn keeps_f32(g: &Graph, n: &Node, returned: &HashSet<ValueId>) -> bool {
    let forward =
        n.op.spec()
            .is_some_and(|s| s.grad_of.is_none() && !s.traits.optimizer);
    !forward
        || n.outputs.iter().any(|v| {
            returned.contains(v) || (g.values[*v].elem.is_float() && g.values[*v].shape.is_empty())
        })
}

/// The activations scope (see the module's comment): `g` with every forward op that reads a
/// float in bf16 but those [`keeps_f32`] names, and how many ops were changed.
pub fn autocast_activations(g: &Graph) -> Result<(Graph, usize), String> {
    let mut out = g.clone();
    let old = std::mem::take(&mut out.nodes);
    let returned: HashSet<ValueId> = g.outputs.iter().map(|o| o.value).collect();
    let args: HashSet<ValueId> = g.args.iter().map(|a| a.value).collect();
    // A value the program wrote in f32 and now writes in bf16: its bf16 value. Its f32 value
    // (the original id) is written by a cast where an f32 reader first needs it.
    let mut narrowed: HashMap<ValueId, ValueId> = HashMap::new();
    let mut widened: HashSet<ValueId> = HashSet::new();
    // A value still written in f32 (not an argument): its bf16 copy, once one was made.
    let mut copies: HashMap<ValueId, ValueId> = HashMap::new();
    let mut count = 0;
    for mut n in old {
        let reads_float = n.inputs.iter().any(|&v| g.values[v].elem == Elem::F32);
        if !reads_float || keeps_f32(g, &n, &returned) {
            for &v in &n.inputs {
                if let Some(&b) = narrowed.get(&v) {
                    if widened.insert(v) {
                        out.nodes.push(cast_back(b, v, &n));
                    }
                }
            }
            out.nodes.push(n);
            continue;
        }
        let to_bf16 = cast_attrs(&n, Elem::BF16);
        for v in &mut n.inputs {
            if g.values[*v].elem != Elem::F32 {
                continue;
            }
            *v = if let Some(&b) = narrowed.get(v) {
                b
            } else if args.contains(v) {
                out.add1("dnn.cast", &[*v], to_bf16.clone(), &n.loc)?
            } else if let Some(&b) = copies.get(v) {
                b
            } else {
                let b = out.add1("dnn.cast", &[*v], to_bf16.clone(), &n.loc)?;
                copies.insert(*v, b);
                b
            };
        }
        let operands: Vec<Option<TensorType>> = n
            .inputs
            .iter()
            .map(|&v| Some(out.values[v].clone()))
            .collect();
        let spec =
            n.op.spec()
                .ok_or_else(|| format!("unknown op '{}'", n.op))?;
        let (types, _, _) = spec
            .check(&OpCtx {
                operands: &operands,
                attrs: &n.attrs,
            })
            .map_err(|e| format!("'{}' on bf16 operands {e} (at {})", n.op, n.loc))?;
        for (o, t) in n.outputs.iter_mut().zip(types) {
            if t.elem == Elem::BF16 && g.values[*o].elem == Elem::F32 {
                let b = out.new_value(t);
                narrowed.insert(*o, b);
                *o = b;
            }
        }
        out.nodes.push(n);
        count += 1;
    }
    Ok((out, count))
}
