//! `--autocast=bf16`: mixed precision as PyTorch's autocast chooses it for matrix products.
//! Every matrix product of the forward (`dnn.matmul`, `dnn.linear`, `dnn.attention`: the ops
//! whose spec says `matrix`) reads bf16 copies of its f32 operands and writes a bf16 result,
//! which a `dnn.cast` turns back into the f32 value the rest of the program read before;
//! everything else (norms, softmax, losses, elementwise ops, the optimizer) stays in f32, and
//! the parameters stay f32 (the master weights). Run before `--autodiff`: the backward it
//! derives has the casts' VJPs, so the matrix products' gradients are bf16 too and every
//! parameter's gradient arrives in f32. bf16 keeps f32's exponent range, so no loss
//! scaling is needed.
//!
//! Each use casts its own copy (a value three projections read is cast three times): the
//! gradients of the copies then meet in f32, where the backward sums them, instead of being
//! summed in bf16. Differences from PyTorch's autocast, which casts the same ops: its
//! elementwise ops on a bf16 result stay in bf16 (here they run in f32 after the cast back),
//! and it casts a weight once per autocast region (here once per use).
//!
//! What the runtimes do with it: floats are computed in f32 and every bf16 result is rounded
//! to bf16 once (ties to even), as a GPU GEMM accumulates in f32 and stores bf16; the CPU
//! runtime and the generated kernels round the same way.

use crate::layouts::error;
use crate::pass::{FunctionPass, PassOptions};
use crate::transforms::recompute::has_backward;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::dnn;
use nnscaler_dialects::graph::{Graph, Node};
use nnscaler_dialects::types::{AttrValue, Attrs, Elem, TensorType};

/// The pass.
#[derive(Debug)]
pub struct Autocast {
    remarks: Diagnostics,
}

impl Autocast {
    /// Options: `to` (bf16, the only one; also written alone: `--autocast=bf16`).
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        match o.get("to").unwrap_or("bf16") {
            "bf16" => Ok(Autocast {
                remarks: Diagnostics::default(),
            }),
            "f16" => {
                Err("autocast: f16 needs loss scaling, which nnscaler does not do; use bf16".into())
            }
            other => Err(format!("autocast: unknown type '{other}' (types: bf16)")),
        }
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
            .find(|n| n.op == "dnn.cast" || dnn::spec(&n.op).is_some_and(|s| s.grad_of.is_some()));
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
        let (out, count) = autocast(&g).map_err(|m| error(&g.loc, m))?;
        self.remarks.remark(
            &g.loc,
            format!("autocast @{}: {count} matrix products in bf16", g.name),
        );
        Ok(Some(out))
    }
    fn take_remarks(&mut self) -> Diagnostics {
        std::mem::take(&mut self.remarks)
    }
}

/// Whether `n` is a forward matrix product on f32 operands: what autocast runs in bf16.
fn cast_here(g: &Graph, n: &Node) -> bool {
    dnn::spec(&n.op).is_some_and(|s| s.traits.matrix && s.grad_of.is_none())
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
            .map(|(&b, &f)| Node {
                op: "dnn.cast".into(),
                inputs: vec![b],
                outputs: vec![f],
                attrs: cast_attrs(&n, Elem::F32),
                loc: n.loc.clone(),
                origin: None,
            })
            .collect();
        out.nodes.push(n);
        out.nodes.extend(back);
        count += 1;
    }
    Ok((out, count))
}
