//! What a generated kernel computes, independent of LLVM: elementwise kernels (a fused
//! chain of ops with scalar formulas, [`nnscaler_dialects::scalar`]), and how a function's
//! ops group into them ([`fuse`]).

use nnscaler_dialects::dnn;
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::scalar::Expr;
use nnscaler_dialects::types::Elem;
use std::collections::HashMap;

/// An elementwise kernel: `out[i] = expr(inputs[0][b0(i)], inputs[1][b1(i)], ...)` for
/// every flat index `i` of `out`, where `bk` maps `i` to input `k`'s element by numpy
/// broadcasting (its shape right-aligned against `out`, size-1 dims repeated).
#[derive(Clone, Debug, PartialEq)]
pub struct Elementwise {
    /// The kernel's symbol (a valid PTX and C identifier).
    pub name: String,
    /// The formula over the inputs.
    pub expr: Expr,
    /// The inputs' shapes.
    pub inputs: Vec<Vec<usize>>,
    /// The result's shape.
    pub out: Vec<usize>,
}

impl Elementwise {
    /// Elements of the result: the number of index values a launch covers.
    pub fn len(&self) -> usize {
        self.out.iter().product()
    }

    /// Whether the result is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A single op's kernel (`op` must have a scalar formula).
    pub fn of_op(
        name: &str,
        op: &str,
        attrs: &nnscaler_dialects::types::Attrs,
        inputs: Vec<Vec<usize>>,
        out: Vec<usize>,
    ) -> Result<Self, String> {
        let rule = dnn::spec(op)
            .and_then(|s| s.traits.scalar)
            .ok_or_else(|| format!("'{op}' is not an elementwise op with a scalar formula"))?;
        Ok(Elementwise {
            name: name.into(),
            expr: rule(attrs)?,
            inputs,
            out,
        })
    }
}

/// A fused group of a function's elementwise ops: one kernel.
#[derive(Clone, Debug)]
pub struct Group {
    /// The kernel.
    pub kernel: Elementwise,
    /// The graph's values it reads, in the kernel's input order.
    pub inputs: Vec<ValueId>,
    /// The value it writes.
    pub output: ValueId,
    /// The ops it computes, in program order (indices into the graph's nodes).
    pub nodes: Vec<usize>,
}

/// Most formula nodes one fused kernel may hold (a bound on code size: fusion duplicates a
/// producer's formula into every place its consumer reads it).
const MAX_EXPR: usize = 400;

fn dims(g: &Graph, v: ValueId) -> Vec<usize> {
    g.values[v].shape.iter().map(|&d| d as usize).collect()
}

/// Groups the elementwise f32 ops of `g` into kernels: an op is fused into its consumer
/// when its result has that one use, the consumer is elementwise too, and both have the
/// same shape (so no element is computed twice). Ops without a scalar formula are not in
/// any group.
pub fn fuse(g: &Graph) -> Result<Vec<Group>, String> {
    let mut uses: HashMap<ValueId, usize> = HashMap::new();
    for n in &g.nodes {
        for &v in &n.inputs {
            *uses.entry(v).or_default() += 1;
        }
    }
    for o in &g.outputs {
        *uses.entry(o.value).or_default() += 1;
    }
    let mut groups: Vec<Option<Group>> = Vec::new();
    // Values computed by a group that a consumer may still absorb.
    let mut open: HashMap<ValueId, usize> = HashMap::new();
    for (k, n) in g.nodes.iter().enumerate() {
        let Some(rule) = dnn::spec(&n.op).and_then(|s| s.traits.scalar) else {
            continue;
        };
        if n.outputs.len() != 1
            || g.values[n.outputs[0]].elem != Elem::F32
            || n.inputs.iter().any(|&v| g.values[v].elem != Elem::F32)
        {
            continue;
        }
        let out = n.outputs[0];
        let shape = dims(g, out);
        let own = rule(&n.attrs).map_err(|e| format!("'{}': {e}", n.op))?;
        let mut inputs: Vec<ValueId> = Vec::new();
        let mut nodes: Vec<usize> = Vec::new();
        let slot = |inputs: &mut Vec<ValueId>, v: ValueId| -> usize {
            inputs.iter().position(|&w| w == v).unwrap_or_else(|| {
                inputs.push(v);
                inputs.len() - 1
            })
        };
        let mut absorbed: Vec<usize> = Vec::new();
        let mut parts: Vec<Expr> = Vec::new();
        for &v in &n.inputs {
            let producer = open
                .get(&v)
                .copied()
                .filter(|_| uses.get(&v) == Some(&1) && dims(g, v) == shape);
            let part = match producer.and_then(|p| groups[p].as_ref().map(|gr| (p, gr))) {
                Some((p, gr)) if gr.kernel.expr.size() + own.size() <= MAX_EXPR => {
                    let map: Vec<usize> = gr.inputs.iter().map(|&w| slot(&mut inputs, w)).collect();
                    nodes.extend(&gr.nodes);
                    absorbed.push(p);
                    gr.kernel.expr.substitute(&mut |i| Expr::Input(map[i]))
                }
                _ => Expr::Input(slot(&mut inputs, v)),
            };
            parts.push(part);
        }
        for p in absorbed {
            groups[p] = None;
        }
        nodes.push(k);
        let expr = own.substitute(&mut |i| parts[i].clone());
        let kernel = Elementwise {
            name: String::new(),
            expr,
            inputs: inputs.iter().map(|&v| dims(g, v)).collect(),
            out: shape,
        };
        open.insert(out, groups.len());
        groups.push(Some(Group {
            kernel,
            inputs,
            output: out,
            nodes,
        }));
    }
    let mut out: Vec<Group> = groups.into_iter().flatten().collect();
    for (i, gr) in out.iter_mut().enumerate() {
        let ops: Vec<&str> = gr
            .nodes
            .iter()
            .map(|&k| g.nodes[k].op.trim_start_matches("dnn."))
            .collect();
        let mut name = format!("k{i}_{}", ops.join("_"));
        name.truncate(60);
        gr.kernel.name = name;
    }
    Ok(out)
}
