//! VJP rules: for each forward `dnn` op, the backward ops that turn the gradients of its
//! results into the gradients of its operands. `--autodiff` calls them in reverse program
//! order; everything they emit is ordinary `dnn` ops with their own annotations, so the
//! backward graph is partitioned like the forward one.

use crate::diag::SrcLoc;
use crate::graph::{Graph, Node, ValueId};
use crate::types::{AttrValue, Attrs, Elem};

/// What a VJP rule sees: the graph to emit into, the forward node, the gradients of its
/// results (`None`: the result does not reach the loss) and which operands need gradients.
#[derive(Debug)]
pub struct VjpCtx<'g> {
    /// The graph being extended.
    pub g: &'g mut Graph,
    /// The forward node.
    pub node: Node,
    /// Gradient of each result.
    pub dys: Vec<Option<ValueId>>,
    /// Whether each operand needs a gradient.
    pub needs: Vec<bool>,
}

/// A VJP rule: returns one gradient (or `None`) per operand.
pub type VjpRule = fn(&mut VjpCtx<'_>) -> Result<Vec<Option<ValueId>>, String>;

impl VjpCtx<'_> {
    /// Operand `i`.
    pub fn x(&self, i: usize) -> ValueId {
        self.node.inputs[i]
    }

    /// Result `i`.
    pub fn y(&self, i: usize) -> ValueId {
        self.node.outputs[i]
    }

    /// Shape of value `v`.
    pub fn shape(&self, v: ValueId) -> Vec<i64> {
        self.g.values[v].shape.clone()
    }

    /// Gradient of result `i` (zeros when the result does not reach the loss).
    pub fn dy(&mut self, i: usize) -> Result<ValueId, String> {
        match self.dys[i] {
            Some(d) => Ok(d),
            None => {
                let ty = self.g.values[self.y(i)].clone();
                let zeros = self.fill(&ty.shape, 0.0)?;
                if ty.elem == Elem::F32 {
                    return Ok(zeros);
                }
                self.emit(
                    "dnn.cast",
                    &[zeros],
                    &[("to", AttrValue::Str(ty.elem.to_string()))],
                )
            }
        }
    }

    fn loc(&self) -> SrcLoc {
        self.node.loc.clone()
    }

    /// Emits a single-result op.
    pub fn emit(
        &mut self,
        op: &str,
        ins: &[ValueId],
        attrs: &[(&str, AttrValue)],
    ) -> Result<ValueId, String> {
        let loc = self.loc();
        self.g.add1(op, ins, to_attrs(attrs), &loc)
    }

    /// Emits an op with several results.
    pub fn emit_n(
        &mut self,
        op: &str,
        ins: &[ValueId],
        attrs: &[(&str, AttrValue)],
    ) -> Result<Vec<ValueId>, String> {
        let loc = self.loc();
        self.g.add(op, ins, to_attrs(attrs), &loc)
    }

    /// The forward op's attributes named in `keys` (those present).
    pub fn keep(&self, keys: &[&str]) -> Vec<(&'static str, AttrValue)> {
        keys.iter()
            .filter_map(|k| self.node.attrs.get(*k).map(|v| (static_key(k), v.clone())))
            .collect()
    }

    /// A constant f32 tensor.
    pub fn fill(&mut self, shape: &[i64], value: f64) -> Result<ValueId, String> {
        self.emit(
            "dnn.fill",
            &[],
            &[
                ("shape", AttrValue::Ints(shape.to_vec())),
                ("value", AttrValue::Float(value)),
            ],
        )
    }

    /// `v` reshaped to `shape` (no op when the shape already matches).
    pub fn reshape(&mut self, v: ValueId, shape: &[i64]) -> Result<ValueId, String> {
        if self.g.values[v].shape == shape {
            return Ok(v);
        }
        self.emit(
            "dnn.reshape",
            &[v],
            &[("shape", AttrValue::Ints(shape.to_vec()))],
        )
    }

    /// `v * c` for a scalar constant `c`.
    pub fn scale(&mut self, v: ValueId, c: f64) -> Result<ValueId, String> {
        let k = self.fill(&[], c)?;
        self.emit("dnn.mul", &[v, k], &[])
    }

    /// Sums a broadcast gradient `v` back to `shape` (the inverse of numpy broadcasting).
    pub fn sum_to(&mut self, v: ValueId, shape: &[i64]) -> Result<ValueId, String> {
        let s = self.shape(v);
        if s == shape {
            return Ok(v);
        }
        let off = s.len() - shape.len();
        let dims: Vec<i64> = (0..s.len())
            .filter(|&i| i < off || (shape[i - off] == 1 && s[i] != 1))
            .map(|i| i as i64)
            .collect();
        let summed = if dims.is_empty() {
            v
        } else {
            self.emit("dnn.sum", &[v], &[("dims", AttrValue::Ints(dims))])?
        };
        self.reshape(summed, shape)
    }

    /// Swaps the last two dims of `v`.
    fn swap_last(&mut self, v: ValueId) -> Result<ValueId, String> {
        let r = self.shape(v).len() as i64;
        let mut perm: Vec<i64> = (0..r).collect();
        perm.swap((r - 1) as usize, (r - 2) as usize);
        self.emit("dnn.transpose", &[v], &[("perm", AttrValue::Ints(perm))])
    }
}

fn static_key(k: &str) -> &'static str {
    const KEYS: &[&str] = &[
        "eps",
        "dim",
        "dims",
        "keepdim",
        "approximate",
        "causal",
        "scale",
        "theta",
        "p",
        "seed",
    ];
    KEYS.iter().find(|x| **x == k).copied().unwrap_or("unknown")
}

fn to_attrs(a: &[(&str, AttrValue)]) -> Attrs {
    a.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

fn int(v: i64) -> AttrValue {
    AttrValue::Int(v)
}

/// The VJP rule of forward op `op` (each family of ops its own table).
pub fn rule(op: &str) -> Option<VjpRule> {
    linalg_rule(op)
        .or_else(|| elementwise_rule(op))
        .or_else(|| norms_rule(op))
        .or_else(|| shape_rule(op))
        .or_else(|| reduce_rule(op))
        .or_else(|| attention_rule(op))
        .or_else(|| tokens_rule(op))
}

/// The VJP rules of the matrix products.
fn linalg_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.matmul" => matmul,
        "dnn.linear" => linear,
        _ => return None,
    })
}

/// The VJP rules of the elementwise ops, dropout and fill.
fn elementwise_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.add" => |c| {
            let d = c.dy(0)?;
            let (a, b) = (c.shape(c.x(0)), c.shape(c.x(1)));
            Ok(vec![Some(c.sum_to(d, &a)?), Some(c.sum_to(d, &b)?)])
        },
        "dnn.sub" => |c| {
            let d = c.dy(0)?;
            let (a, b) = (c.shape(c.x(0)), c.shape(c.x(1)));
            let nd = c.emit("dnn.neg", &[d], &[])?;
            Ok(vec![Some(c.sum_to(d, &a)?), Some(c.sum_to(nd, &b)?)])
        },
        "dnn.mul" => |c| {
            let d = c.dy(0)?;
            let (x0, x1) = (c.x(0), c.x(1));
            let mut out = vec![None, None];
            if c.needs[0] {
                let g = c.emit("dnn.mul", &[d, x1], &[])?;
                out[0] = Some(c.sum_to(g, &c.shape(x0))?);
            }
            if c.needs[1] {
                let g = c.emit("dnn.mul", &[d, x0], &[])?;
                out[1] = Some(c.sum_to(g, &c.shape(x1))?);
            }
            Ok(out)
        },
        "dnn.div" => |c| {
            let d = c.dy(0)?;
            let (x0, x1, y) = (c.x(0), c.x(1), c.y(0));
            let mut out = vec![None, None];
            if c.needs[0] {
                let g = c.emit("dnn.div", &[d, x1], &[])?;
                out[0] = Some(c.sum_to(g, &c.shape(x0))?);
            }
            if c.needs[1] {
                // d(a/b)/db = -(a/b)/b = -y/b
                let dy_y = c.emit("dnn.mul", &[d, y], &[])?;
                let q = c.emit("dnn.div", &[dy_y, x1], &[])?;
                let g = c.emit("dnn.neg", &[q], &[])?;
                out[1] = Some(c.sum_to(g, &c.shape(x1))?);
            }
            Ok(out)
        },
        "dnn.neg" => |c| {
            let d = c.dy(0)?;
            Ok(vec![Some(c.emit("dnn.neg", &[d], &[])?)])
        },
        "dnn.exp" => |c| {
            let (d, y) = (c.dy(0)?, c.y(0));
            Ok(vec![Some(c.emit("dnn.mul", &[d, y], &[])?)])
        },
        "dnn.log" => |c| {
            let (d, x) = (c.dy(0)?, c.x(0));
            Ok(vec![Some(c.emit("dnn.div", &[d, x], &[])?)])
        },
        "dnn.sqrt" => |c| {
            // dy / (2 sqrt(x))
            let (d, y) = (c.dy(0)?, c.y(0));
            let q = c.emit("dnn.div", &[d, y], &[])?;
            Ok(vec![Some(c.scale(q, 0.5)?)])
        },
        "dnn.rsqrt" => |c| {
            // d x^(-1/2) = -1/2 x^(-3/2) = -1/2 y / x
            let (d, x, y) = (c.dy(0)?, c.x(0), c.y(0));
            let p = c.emit("dnn.mul", &[d, y], &[])?;
            let q = c.emit("dnn.div", &[p, x], &[])?;
            Ok(vec![Some(c.scale(q, -0.5)?)])
        },
        "dnn.sigmoid" => |c| {
            // dy * y * (1 - y) = dy * y - (dy * y) * y
            let (d, y) = (c.dy(0)?, c.y(0));
            let p = c.emit("dnn.mul", &[d, y], &[])?;
            let q = c.emit("dnn.mul", &[p, y], &[])?;
            Ok(vec![Some(c.emit("dnn.sub", &[p, q], &[])?)])
        },
        "dnn.tanh" => |c| {
            let (d, y) = (c.dy(0)?, c.y(0));
            Ok(vec![Some(c.emit("dnn.tanh_grad", &[d, y], &[])?)])
        },
        "dnn.cast" => |c| {
            // The gradient goes back to the operand's type (bf16 gradients of a bf16 value
            // become f32 at the f32 value it was cast from).
            let d = c.dy(0)?;
            let to = c.g.values[c.x(0)].elem.to_string();
            Ok(vec![Some(c.emit(
                "dnn.cast",
                &[d],
                &[("to", AttrValue::Str(to))],
            )?)])
        },
        "dnn.gelu" => |c| {
            let (d, x) = (c.dy(0)?, c.x(0));
            let a = c.keep(&["approximate"]);
            Ok(vec![Some(c.emit("dnn.gelu_grad", &[d, x], &a)?)])
        },
        "dnn.silu" => |c| {
            let (d, x) = (c.dy(0)?, c.x(0));
            Ok(vec![Some(c.emit("dnn.silu_grad", &[d, x], &[])?)])
        },
        "dnn.abs" => |c| {
            // dy * sign(x) (0 at 0, as torch): dy where x > 0, minus dy where -x > 0.
            let (d, x) = (c.dy(0)?, c.x(0));
            let pos = c.emit("dnn.relu_grad", &[d, x], &[])?;
            let nx = c.emit("dnn.neg", &[x], &[])?;
            let neg = c.emit("dnn.relu_grad", &[d, nx], &[])?;
            Ok(vec![Some(c.emit("dnn.sub", &[pos, neg], &[])?)])
        },
        "dnn.relu" => |c| {
            let (d, x) = (c.dy(0)?, c.x(0));
            Ok(vec![Some(c.emit("dnn.relu_grad", &[d, x], &[])?)])
        },
        "dnn.dropout" => |c| {
            // The mask is a function of (seed, index): dropout of dy with the same seed
            // applies exactly the forward mask and scale.
            // With the step operand, the backward reads the same step (no gradient to it).
            let d = c.dy(0)?;
            let a = c.keep(&["p", "seed"]);
            let mut ins = vec![d];
            if c.node.inputs.len() == 2 {
                ins.push(c.x(1));
                return Ok(vec![Some(c.emit("dnn.dropout", &ins, &a)?), None]);
            }
            Ok(vec![Some(c.emit("dnn.dropout", &ins, &a)?)])
        },
        "dnn.fill" => |_| Ok(vec![]),
        _ => return None,
    })
}

/// The VJP rules of the normalizations.
fn norms_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.softmax" => |c| {
            let (d, y) = (c.dy(0)?, c.y(0));
            let a = c.keep(&["dim"]);
            Ok(vec![Some(c.emit("dnn.softmax_grad", &[d, y], &a)?)])
        },
        "dnn.log_softmax" => |c| {
            let (d, y) = (c.dy(0)?, c.y(0));
            let a = c.keep(&["dim"]);
            Ok(vec![Some(c.emit("dnn.log_softmax_grad", &[d, y], &a)?)])
        },
        "dnn.layer_norm" => |c| {
            let (d, x, w) = (c.dy(0)?, c.x(0), c.x(1));
            let a = c.keep(&["eps"]);
            let g = c.emit_n("dnn.layer_norm_grad", &[d, x, w], &a)?;
            Ok(g.into_iter().map(Some).collect())
        },
        "dnn.rms_norm" => |c| {
            let (d, x, w) = (c.dy(0)?, c.x(0), c.x(1));
            let a = c.keep(&["eps"]);
            let g = c.emit_n("dnn.rms_norm_grad", &[d, x, w], &a)?;
            Ok(g.into_iter().map(Some).collect())
        },
        _ => return None,
    })
}

/// The VJP rules of the shape ops.
fn shape_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.reshape" => |c| {
            let d = c.dy(0)?;
            let s = c.shape(c.x(0));
            Ok(vec![Some(c.reshape(d, &s)?)])
        },
        "dnn.transpose" => |c| {
            let d = c.dy(0)?;
            let perm = match c.node.attrs.get("perm") {
                Some(AttrValue::Ints(p)) => p.clone(),
                _ => return Err("transpose without 'perm'".into()),
            };
            let mut inv = vec![0i64; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p as usize] = i as i64;
            }
            Ok(vec![Some(c.emit(
                "dnn.transpose",
                &[d],
                &[("perm", AttrValue::Ints(inv))],
            )?)])
        },
        "dnn.slice" => |c| {
            let d = c.dy(0)?;
            let s = c.shape(c.x(0));
            let geti = |k: &str| match c.node.attrs.get(k) {
                Some(AttrValue::Int(n)) => *n,
                _ => 0,
            };
            let (dim, start, end) = (geti("dim"), geti("start"), geti("end"));
            let nd = if dim < 0 { dim + s.len() as i64 } else { dim };
            let after = s[nd as usize] - end;
            Ok(vec![Some(c.emit(
                "dnn.pad",
                &[d],
                &[
                    ("dim", int(dim)),
                    ("before", int(start)),
                    ("after", int(after)),
                ],
            )?)])
        },
        "dnn.pad" => |c| {
            let d = c.dy(0)?;
            let s = c.shape(c.x(0));
            let geti = |k: &str| match c.node.attrs.get(k) {
                Some(AttrValue::Int(n)) => *n,
                _ => 0,
            };
            let (dim, before) = (geti("dim"), geti("before"));
            let nd = if dim < 0 { dim + s.len() as i64 } else { dim };
            let end = before + s[nd as usize];
            Ok(vec![Some(c.emit(
                "dnn.slice",
                &[d],
                &[("dim", int(dim)), ("start", int(before)), ("end", int(end))],
            )?)])
        },
        "dnn.concat" => |c| {
            let d = c.dy(0)?;
            let dim = match c.node.attrs.get("dim") {
                Some(AttrValue::Int(n)) => *n,
                _ => 0,
            };
            let r = c.shape(d).len() as i64;
            let nd = (if dim < 0 { dim + r } else { dim }) as usize;
            let sizes: Vec<i64> = c
                .node
                .inputs
                .iter()
                .map(|&v| c.g.values[v].shape[nd])
                .collect();
            if sizes.len() == 1 {
                return Ok(vec![Some(d)]);
            }
            let g = c.emit_n(
                "dnn.split",
                &[d],
                &[("dim", int(dim)), ("sizes", AttrValue::Ints(sizes))],
            )?;
            Ok(g.into_iter().map(Some).collect())
        },
        "dnn.split" => |c| {
            let mut ds = Vec::new();
            for i in 0..c.node.outputs.len() {
                ds.push(c.dy(i)?);
            }
            let a = c.keep(&["dim"]);
            Ok(vec![Some(c.emit("dnn.concat", &ds, &a)?)])
        },
        "dnn.broadcast_to" => |c| {
            let d = c.dy(0)?;
            let s = c.shape(c.x(0));
            Ok(vec![Some(c.sum_to(d, &s)?)])
        },
        _ => return None,
    })
}

/// The VJP rules of the reductions.
fn reduce_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.sum" => |c| {
            let d = c.dy(0)?;
            Ok(vec![Some(unreduce(c, d)?)])
        },
        "dnn.mean" => |c| {
            let d = c.dy(0)?;
            let b = unreduce(c, d)?;
            let (xs, ys) = (c.shape(c.x(0)), c.shape(c.y(0)));
            let n = xs.iter().product::<i64>() / ys.iter().product::<i64>().max(1);
            Ok(vec![Some(c.scale(b, 1.0 / n as f64)?)])
        },
        "dnn.max" => |c| {
            let (d, x) = (c.dy(0)?, c.x(0));
            let a = c.keep(&["dims", "keepdim"]);
            Ok(vec![Some(c.emit("dnn.max_grad", &[d, x], &a)?)])
        },
        _ => return None,
    })
}

/// The VJP rules of the attention and rotary embedding.
fn attention_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.attention" => |c| {
            let (d, q, k, v) = (c.dy(0)?, c.x(0), c.x(1), c.x(2));
            let a = c.keep(&["causal", "scale"]);
            let g = c.emit_n("dnn.attention_grad", &[d, q, k, v], &a)?;
            Ok(g.into_iter().map(Some).collect())
        },
        "dnn.rotary" => |c| {
            let d = c.dy(0)?;
            let a = c.keep(&["theta"]);
            Ok(vec![Some(c.emit("dnn.rotary_grad", &[d], &a)?)])
        },
        _ => return None,
    })
}

/// The VJP rules of the ops indexed by tokens and classes.
fn tokens_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.embedding" => |c| {
            let (d, ids) = (c.dy(0)?, c.x(0));
            let vocab = c.shape(c.x(1))[0];
            let g = c.emit("dnn.embedding_grad", &[d, ids], &[("vocab", int(vocab))])?;
            Ok(vec![None, Some(g)])
        },
        "dnn.cross_entropy" => |c| {
            let (d, l, t) = (c.dy(0)?, c.x(0), c.x(1));
            Ok(vec![
                Some(c.emit("dnn.cross_entropy_grad", &[d, l, t], &[])?),
                None,
            ])
        },
        "dnn.pick" => |c| {
            let (d, t) = (c.dy(0)?, c.x(1));
            let classes = *c.shape(c.x(0)).last().unwrap_or(&1);
            Ok(vec![
                Some(c.emit("dnn.pick_grad", &[d, t], &[("classes", int(classes))])?),
                None,
            ])
        },
        _ => return None,
    })
}

/// Broadcasts the gradient of a `keepdim`-less or `keepdim` reduction back to the input.
fn unreduce(c: &mut VjpCtx<'_>, d: ValueId) -> Result<ValueId, String> {
    let xs = c.shape(c.x(0));
    let r = xs.len() as i64;
    let dims: Vec<i64> = match c.node.attrs.get("dims") {
        Some(AttrValue::Ints(v)) => v.iter().map(|&k| if k < 0 { k + r } else { k }).collect(),
        _ => Vec::new(),
    };
    let kept: Vec<i64> = xs
        .iter()
        .enumerate()
        .map(|(i, &n)| if dims.contains(&(i as i64)) { 1 } else { n })
        .collect();
    let d = c.reshape(d, &kept)?;
    if kept == xs {
        return Ok(d);
    }
    c.emit("dnn.broadcast_to", &[d], &[("shape", AttrValue::Ints(xs))])
}

fn matmul(c: &mut VjpCtx<'_>) -> Result<Vec<Option<ValueId>>, String> {
    let d = c.dy(0)?;
    let (a, b) = (c.x(0), c.x(1));
    let flag = |k: &str| crate::types::flag(&c.node.attrs, k);
    let (ta, tb) = (flag("transpose_a"), flag("transpose_b"));
    let (sa, sb) = (c.shape(a), c.shape(b));
    let batch = sa.len() - 2;
    let mut out = vec![None, None];
    if c.needs[0] {
        // dA_eff = dY · B_eff^T
        let g = c.emit(
            "dnn.matmul",
            &[d, b],
            &[("transpose_b", AttrValue::Bool(!tb))],
        )?;
        out[0] = Some(if ta { c.swap_last(g)? } else { g });
    }
    if c.needs[1] {
        // dB_eff = A_eff^T · dY, summed over batch dims when B is shared
        let g = if sb.len() == 2 && batch > 0 {
            if ta {
                let full = c.emit("dnn.matmul", &[a, d], &[])?;
                let dims: Vec<i64> = (0..batch as i64).collect();
                c.emit("dnn.sum", &[full], &[("dims", AttrValue::Ints(dims))])?
            } else {
                let ds = c.shape(d);
                let rows: i64 = sa[..=batch].iter().product();
                let a2 = c.reshape(a, &[rows, sa[batch + 1]])?;
                let d2 = c.reshape(d, &[rows, ds[batch + 1]])?;
                c.emit(
                    "dnn.matmul",
                    &[a2, d2],
                    &[("transpose_a", AttrValue::Bool(true))],
                )?
            }
        } else {
            c.emit(
                "dnn.matmul",
                &[a, d],
                &[("transpose_a", AttrValue::Bool(!ta))],
            )?
        };
        out[1] = Some(if tb { c.swap_last(g)? } else { g });
    }
    Ok(out)
}

/// `dx = dy · W` (a matmul keeps `x`'s leading dims, so their splits carry over),
/// `dW = linear_weight_grad(dy, x)` (summed over the leading dims without flattening them:
/// a split of the positions alone leaves it partial rather than gathering both operands),
/// `db = sum(dy)` over the leading dims.
fn linear(c: &mut VjpCtx<'_>) -> Result<Vec<Option<ValueId>>, String> {
    let d = c.dy(0)?;
    let (x, w) = (c.x(0), c.x(1));
    let sx = c.shape(x);
    let lead: Vec<i64> = (0..sx.len().saturating_sub(1) as i64).collect();
    let mut out = vec![None; c.node.inputs.len()];
    if c.needs[0] {
        out[0] = Some(if sx.len() >= 2 {
            c.emit("dnn.matmul", &[d, w], &[])?
        } else {
            // A single row: matmul wants rank >= 2.
            let n = c.shape(w)[0];
            let d2 = c.reshape(d, &[1, n])?;
            let g = c.emit("dnn.matmul", &[d2, w], &[])?;
            c.reshape(g, &sx)?
        });
    }
    if c.needs[1] {
        out[1] = Some(c.emit("dnn.linear_weight_grad", &[d, x], &[])?);
    }
    if c.node.inputs.len() == 3 && c.needs[2] {
        out[2] = Some(if lead.is_empty() {
            d
        } else {
            c.emit("dnn.sum", &[d], &[("dims", AttrValue::Ints(lead))])?
        });
    }
    Ok(out)
}

/// Whether values of element type `e` carry gradients.
pub fn differentiable(e: Elem) -> bool {
    e.is_float()
}

#[cfg(test)]
mod tests {
    use crate::dnn::SPECS;

    #[test]
    fn every_forward_op_has_a_vjp_rule() {
        let missing: Vec<&str> = SPECS
            .iter()
            .filter(|s| s.grad_of.is_none() && !s.traits.optimizer)
            .map(|s| s.name)
            .filter(|n| super::rule(n).is_none())
            .collect();
        assert!(
            missing.is_empty(),
            "forward ops without a VJP rule: {missing:?}"
        );
    }
}
