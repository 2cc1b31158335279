//! How one `dnn` op becomes kernels, temporaries and launches ([`lower`]), and which ops
//! can ([`covered`]).

use super::*;

/// A reduction of `input`'s `rows` leading rows (`[rows, cols]`) into `out`
/// ([`Body::ColReduce`]): one kernel, or its parts then their total.
pub(super) fn col_reduce(
    name: &str,
    op: Reduce,
    input: &Buf,
    rows: usize,
    cols: usize,
    out: &Buf,
) -> Lowered {
    let parts = col_parts(rows, cols);
    if parts == 1 {
        return Lowered::one(col_kernel(
            name.to_string(),
            op,
            (rows, cols, 1, false),
            input,
            out,
        ));
    }
    let partial = Buf::f32(&[parts, 2, cols]);
    let first = match op {
        Reduce::Max => Reduce::Max,
        _ => Reduce::Sum,
    };
    Lowered {
        kernels: vec![
            col_kernel(
                format!("{name}_parts"),
                first,
                (rows, cols, parts, false),
                input,
                &partial,
            ),
            col_total(name, op, &partial, out),
        ],
        temps: vec![partial],
        consts: Vec::new(),
        launches: vec![
            (0, vec![Slot::In(0), Slot::Temp(0)]),
            (1, vec![Slot::Temp(0), Slot::Out(0)]),
        ],
    }
}

/// The kernel that reduces column partials `partial` (pairs `[parts, 2, cols]`) into
/// `out` by `op`.
pub(super) fn col_total(name: &str, op: Reduce, partial: &Buf, out: &Buf) -> Kernel {
    let (parts, cols) = (partial.shape[0], partial.shape[2]);
    col_kernel(
        format!("{name}_total"),
        op,
        (parts, cols, 1, true),
        partial,
        out,
    )
}

/// A [`Body::ColReduce`] kernel of `(rows, cols, parts, pairs)`, a team per part and
/// column tile.
pub(super) fn col_kernel(
    name: String,
    op: Reduce,
    (rows, cols, parts, pairs): (usize, usize, usize, bool),
    input: &Buf,
    out: &Buf,
) -> Kernel {
    Kernel {
        name,
        body: Body::ColReduce {
            op,
            rows,
            cols,
            parts,
            pairs,
        },
        inputs: vec![input.clone()],
        outputs: vec![out.clone()],
        len: parts * cols.div_ceil(COL_TILE),
    }
}

/// The class count of logits `[tokens.., classes]`.
pub(crate) fn classes(logits: &Buf) -> usize {
    *logits.shape.last().unwrap_or(&1)
}

/// The token count of logits `[tokens.., classes]`: every leading dim.
pub(super) fn tokens(logits: &Buf) -> usize {
    logits.len() / classes(logits).max(1)
}

pub(super) fn float(a: &Attrs, name: &str, default: f64) -> f64 {
    match a.get(name) {
        Some(AttrValue::Float(v)) => *v,
        Some(AttrValue::Int(v)) => *v as f64,
        _ => default,
    }
}

pub(super) fn int(a: &Attrs, name: &str, default: i64) -> i64 {
    match a.get(name) {
        Some(AttrValue::Int(v)) => *v,
        _ => default,
    }
}

pub(super) fn norm_dim(d: i64, rank: usize) -> usize {
    if d < 0 {
        (d + rank as i64) as usize
    } else {
        d as usize
    }
}

/// Whether [`lower`] has kernels for `op`.
pub fn covered(op: &str) -> bool {
    if dnn::spec(op).is_some_and(|s| s.traits.scalar.is_some()) {
        return true;
    }
    matches!(
        op,
        "dnn.sum"
            | "dnn.mean"
            | "dnn.max"
            | "dnn.softmax"
            | "dnn.log_softmax"
            | "dnn.softmax_grad"
            | "dnn.log_softmax_grad"
            | "dnn.transpose"
            | "dnn.layer_norm"
            | "dnn.rms_norm"
            | "dnn.layer_norm_grad"
            | "dnn.rms_norm_grad"
            | "dnn.embedding"
            | "dnn.embedding_grad"
            | "dnn.pick"
            | "dnn.pick_grad"
            | "dnn.max_grad"
            | "dnn.softmax_xent_grad"
            | "dnn.cross_entropy"
            | "dnn.cross_entropy_grad"
            | "dnn.adamw"
            | "dnn.clip_scale"
            | "dnn.fill"
            | "dnn.reshape"
            | "dnn.slice"
            | "dnn.pad"
            | "dnn.concat"
            | "dnn.split"
            | "dnn.broadcast_to"
            | "dnn.matmul"
            | "dnn.linear"
            | "dnn.linear_weight_grad"
            | "dnn.attention"
            | "dnn.attention_grad"
            | "dnn.rotary"
            | "dnn.rotary_grad"
            | "dnn.dropout"
    )
}

/// One op being lowered: the kernels' name, the op, its attributes, and its operand and
/// result buffers.
#[derive(Clone, Copy)]
struct Op<'a> {
    name: &'a str,
    op: &'a str,
    attrs: &'a Attrs,
    ins: &'a [Buf],
    outs: &'a [Buf],
}

impl Op<'_> {
    /// A kernel named as the op over all its operands and results.
    fn kernel(&self, body: Body, len: usize) -> Kernel {
        Kernel {
            name: self.name.to_string(),
            body,
            inputs: self.ins.to_vec(),
            outputs: self.outs.to_vec(),
            len,
        }
    }
}

/// The kernels of one op with operand buffers `ins` and result buffers `outs`.
pub fn lower(
    name: &str,
    op: &str,
    attrs: &Attrs,
    ins: &[Buf],
    outs: &[Buf],
) -> Result<Lowered, String> {
    let o = Op {
        name,
        op,
        attrs,
        ins,
        outs,
    };
    let kernel = |body, len| o.kernel(body, len);
    let out0 = outs
        .first()
        .ok_or_else(|| format!("'{op}' has no result"))?;
    if let Some(rule) = dnn::spec(op).and_then(|s| s.traits.scalar) {
        if ins.iter().chain(outs).any(|b| b.elt != Elt::F32) {
            return Err(format!("'{op}': kernels cover f32 only"));
        }
        return Ok(Lowered::one(kernel(
            Body::Map(vec![rule.expr(attrs)?]),
            out0.len(),
        )));
    }
    let rank = ins.first().map_or(0, |b| b.shape.len());
    let k = match op {
        "dnn.fill" => {
            if out0.elt != Elt::F32 {
                return Err("'dnn.fill': kernels cover f32 only".into());
            }
            kernel(
                Body::Map(vec![Expr::Const(float(attrs, "value", 0.0) as f32)]),
                out0.len(),
            )
        }
        "dnn.sum" | "dnn.mean" | "dnn.max" => return reduction(&o, rank),
        "dnn.softmax" | "dnn.log_softmax" | "dnn.softmax_grad" | "dnn.log_softmax_grad" => {
            let dim = norm_dim(int(attrs, "dim", -1), rank);
            let line = match op {
                "dnn.softmax" => Line::Softmax,
                "dnn.log_softmax" => Line::LogSoftmax,
                "dnn.softmax_grad" => Line::SoftmaxGrad,
                _ => Line::LogSoftmaxGrad,
            };
            kernel(
                Body::Lines { op: line, dim },
                out0.len() / ins[0].shape[dim].max(1),
            )
        }
        "dnn.transpose" => {
            let perm = match attrs.get("perm") {
                Some(AttrValue::Ints(p)) => p.iter().map(|&p| p as usize).collect(),
                _ => return Err("'dnn.transpose' needs 'perm'".into()),
            };
            kernel(Body::Transpose(perm), out0.len())
        }
        "dnn.layer_norm" | "dnn.rms_norm" => {
            let h = *ins[1].shape.first().unwrap_or(&1);
            kernel(
                Body::Norm {
                    rms: op == "dnn.rms_norm",
                    eps: float(attrs, "eps", 1e-5),
                },
                ins[0].len() / h.max(1),
            )
        }
        "dnn.layer_norm_grad" | "dnn.rms_norm_grad" => return norm_grad(&o),
        "dnn.embedding" | "dnn.pick" | "dnn.softmax_xent_grad" => return indexed(&o),
        "dnn.embedding_grad" if out0.len() <= EMBED_ROWS_MAX => return embedding_grad_rows(&o),
        "dnn.embedding_grad" => return embedding_grad_lists(&o),
        "dnn.cross_entropy" => return cross_entropy(&o),
        "dnn.cross_entropy_grad" => {
            let rows = tokens(&ins[1]);
            let count = match int(attrs, "count", 0) {
                0 => rows,
                c => c as usize,
            };
            kernel(Body::XentGrad { count }, rows)
        }
        "dnn.adamw" => kernel(
            Body::AdamW {
                b1: float(attrs, "beta1", 0.9),
                b2: float(attrs, "beta2", 0.999),
                eps: float(attrs, "eps", 1e-8),
                wd: float(attrs, "weight_decay", 0.0),
            },
            out0.len(),
        ),
        "dnn.clip_scale" => kernel(
            Body::ClipScale {
                max_norm: float(attrs, "max_norm", 1.0),
            },
            1,
        ),
        "dnn.reshape" => kernel(Body::Copy, out0.len()),
        "dnn.pick_grad" => kernel(Body::PickGrad, out0.len()),
        "dnn.max_grad" => {
            let rank = ins[1].shape.len();
            let mut dims: Vec<usize> = match attrs.get("dims") {
                Some(AttrValue::Ints(d)) => d.iter().map(|&d| norm_dim(d, rank)).collect(),
                _ => Vec::new(),
            };
            dims.sort_unstable();
            kernel(Body::MaxGrad { dims }, out0.len())
        }
        "dnn.slice" => kernel(
            Body::Window {
                dim: norm_dim(int(attrs, "dim", 0), rank),
                start: int(attrs, "start", 0) as usize,
            },
            out0.len(),
        ),
        "dnn.pad" => kernel(
            Body::Place {
                dim: norm_dim(int(attrs, "dim", 0), rank),
                starts: vec![int(attrs, "before", 0) as usize],
            },
            out0.len(),
        ),
        "dnn.concat" => {
            let dim = norm_dim(int(attrs, "dim", 0), out0.shape.len());
            let mut at = 0;
            let starts = ins
                .iter()
                .map(|b| {
                    let s = at;
                    at += b.shape[dim];
                    s
                })
                .collect();
            kernel(Body::Place { dim, starts }, out0.len())
        }
        "dnn.split" => return split(&o, rank),
        "dnn.broadcast_to" => {
            if ins[0].elt != Elt::F32 {
                return Err("'dnn.broadcast_to' of integers has no GPU kernel yet".into());
            }
            kernel(Body::Map(vec![Expr::Input(0)]), out0.len())
        }
        "dnn.dropout" => return dropout(&o),
        "dnn.rotary" | "dnn.rotary_grad" => return rotary(&o),
        "dnn.linear" => return linear(&o),
        "dnn.linear_weight_grad" => {
            // dy^T x with every leading dim as the summed rows: dy read transposed.
            let n = *ins[0].shape.last().unwrap_or(&1);
            kernel(
                Body::Gemm(Gemm {
                    batch: 1,
                    m: n,
                    n: *ins[1].shape.last().unwrap_or(&1),
                    k: ins[0].len() / n.max(1),
                    ta: true,
                    tb: false,
                    b_batched: false,
                    bias: false,
                }),
                out0.len(),
            )
        }
        "dnn.matmul" => {
            let (ta, tb) = (flag(attrs, "transpose_a"), flag(attrs, "transpose_b"));
            let (sa, sb) = (&ins[0].shape, &ins[1].shape);
            let (r, rb) = (sa.len(), sb.len());
            if r < 2 || rb < 2 {
                return Err("'dnn.matmul' operands must have rank 2 or more".into());
            }
            let (m, k) = if ta {
                (sa[r - 1], sa[r - 2])
            } else {
                (sa[r - 2], sa[r - 1])
            };
            let n = if tb { sb[rb - 2] } else { sb[rb - 1] };
            kernel(
                Body::Gemm(Gemm {
                    batch: sa[..r - 2].iter().product(),
                    m,
                    n,
                    k,
                    ta,
                    tb,
                    b_batched: rb > 2,
                    bias: false,
                }),
                out0.len(),
            )
        }
        "dnn.attention" | "dnn.attention_grad" => {
            return lower_attention(name, op, attrs, ins, outs, None);
        }
        _ => return Err(format!("no GPU kernel for '{op}' yet")),
    };
    Ok(Lowered::one(k))
}

/// Sums, means and maxima over dims: one output a thread, by column tiles over leading dims, or in parts for few long lines.
fn reduction(o: &Op, rank: usize) -> Result<Lowered, String> {
    let Op {
        name,
        op,
        attrs,
        ins,
        outs,
        ..
    } = *o;
    let out0 = &o.outs[0];
    let kernel = |body, len| o.kernel(body, len);
    // As the reference: `dims` normalized and sorted (none given: none reduced).
    let mut dims: Vec<usize> = match attrs.get("dims") {
        Some(AttrValue::Ints(d)) => d.iter().map(|&d| norm_dim(d, rank)).collect(),
        _ => Vec::new(),
    };
    dims.sort_unstable();
    let reduce = match op {
        "dnn.sum" => Reduce::Sum,
        "dnn.max" => Reduce::Max,
        _ => {
            let local: usize = dims.iter().map(|&d| ins[0].shape[d]).product();
            Reduce::Mean(match int(attrs, "count", 0) {
                0 => local,
                c => c as usize,
            })
        }
    };
    let count: usize = dims.iter().map(|&d| ins[0].shape[d]).product();
    // Over leading dims (a bias's gradient: the rows of `[rows, cols]`): by column
    // tiles, coalesced.
    let lead = dims.len();
    if lead > 0 && lead < rank && dims.iter().enumerate().all(|(i, &d)| i == d) {
        let cols = ins[0].len() / count.max(1);
        if count >= TEAM_MIN && cols >= 2 {
            let name = format!("{name}_cols");
            return Ok(col_reduce(&name, reduce, &ins[0], count, cols, out0));
        }
    }
    if out0.len() >= SPLIT_BELOW || count < SPLIT_FROM {
        return Ok(Lowered::one(kernel(
            Body::Reduce { op: reduce, dims },
            out0.len(),
        )));
    }
    // Few outputs over long lines: partial results on many blocks, then their
    // reduction (f32 partials summed in f64: within 6e-8 of one f64 sum).
    let parts = (count / SPLIT_PART).min(SPLIT_PARTS);
    let partial = Buf::f32(&[out0.len(), parts]);
    let op = match reduce {
        Reduce::Max => Reduce::Max,
        _ => Reduce::Sum,
    };
    Ok(Lowered {
        kernels: vec![
            Kernel {
                name: format!("{name}_parts"),
                body: Body::ReducePart { op, dims, parts },
                inputs: ins.to_vec(),
                outputs: vec![partial.clone()],
                len: out0.len() * parts,
            },
            Kernel {
                name: format!("{name}_total"),
                body: Body::Reduce {
                    op: reduce,
                    dims: vec![1],
                },
                inputs: vec![partial.clone()],
                outputs: outs.to_vec(),
                len: out0.len(),
            },
        ],
        temps: vec![partial],
        consts: Vec::new(),
        launches: vec![
            (0, vec![Slot::In(0), Slot::Temp(0)]),
            (1, vec![Slot::Temp(0), Slot::Out(0)]),
        ],
    })
}

/// LayerNorm's and RMSNorm's gradients: statistics and `dx` by row, then `dw` (`db`) by column.
fn norm_grad(o: &Op) -> Result<Lowered, String> {
    let Op {
        name,
        op,
        attrs,
        ins,
        outs,
        ..
    } = *o;
    // dy, x, w -> dx, dw [, db]: statistics and dx by row, then dw (db) by column.
    let rms = op == "dnn.rms_norm_grad";
    let eps = float(attrs, "eps", 1e-5);
    let h = *ins[2].shape.first().unwrap_or(&1);
    let rows = ins[1].len() / h.max(1);
    let stats = Buf::f32(&[rows, 2]);
    let k_rows = Kernel {
        name: format!("{name}_rows"),
        body: Body::NormGradRows { rms, eps },
        inputs: ins.to_vec(),
        outputs: vec![outs[0].clone(), stats.clone()],
        len: rows,
    };
    let row_slots = vec![
        Slot::In(0),
        Slot::In(1),
        Slot::In(2),
        Slot::Out(0),
        Slot::Temp(0),
    ];
    let cols_in = vec![ins[0].clone(), ins[1].clone(), stats.clone()];
    let mut col_slots = vec![Slot::In(0), Slot::In(1), Slot::Temp(0)];
    if rows < TEAM_MIN {
        // Short columns: a thread each.
        col_slots.extend((1..outs.len()).map(Slot::Out));
        return Ok(Lowered {
            kernels: vec![
                k_rows,
                Kernel {
                    name: format!("{name}_cols"),
                    body: Body::NormGradCols { rms },
                    inputs: cols_in,
                    outputs: outs[1..].to_vec(),
                    len: h,
                },
            ],
            temps: vec![stats],
            consts: Vec::new(),
            launches: vec![(0, row_slots), (1, col_slots)],
        });
    }
    // By column tiles (coalesced), the rows cut into parts; the parts' partial
    // gradients summed by a column reduction each.
    let parts = col_parts(rows, h);
    let tiles = h.div_ceil(COL_TILE);
    let grads = outs.len() - 1;
    let mut temps = vec![stats];
    let mut kernels = vec![k_rows];
    let mut launches = vec![(0, row_slots)];
    if parts == 1 {
        col_slots.extend((1..outs.len()).map(Slot::Out));
        kernels.push(Kernel {
            name: format!("{name}_cols"),
            body: Body::NormGradColTiles { rms, parts },
            inputs: cols_in,
            outputs: outs[1..].to_vec(),
            len: tiles,
        });
        launches.push((1, col_slots));
    } else {
        let partial = Buf::f32(&[parts, 2, h]);
        col_slots.extend((0..grads).map(|g| Slot::Temp(1 + g)));
        kernels.push(Kernel {
            name: format!("{name}_cols"),
            body: Body::NormGradColTiles { rms, parts },
            inputs: cols_in,
            outputs: vec![partial.clone(); grads],
            len: parts * tiles,
        });
        launches.push((1, col_slots));
        for g in 0..grads {
            temps.push(partial.clone());
            kernels.push(col_total(
                &format!("{name}_cols{g}"),
                Reduce::Sum,
                &partial,
                &outs[1 + g],
            ));
            launches.push((2 + g, vec![Slot::Temp(1 + g), Slot::Out(1 + g)]));
        }
    }
    Ok(Lowered {
        kernels,
        temps,
        consts: Vec::new(),
        launches,
    })
}

/// Embedding, `pick` and the cross-entropy gradient over log-sum-exp: on a shard, its offset a per-device constant.
fn indexed(o: &Op) -> Result<Lowered, String> {
    let Op {
        name,
        op,
        attrs,
        ins,
        outs,
        ..
    } = *o;
    let out0 = &o.outs[0];
    let kernel = |body, len| o.kernel(body, len);
    // On a shard (row_axes / offset_axes), the shard's offset is a per-device
    // constant input.
    let key = if op == "dnn.embedding" {
        "row_axes"
    } else {
        "offset_axes"
    };
    let sharded = match attrs.get(key) {
        Some(AttrValue::Strs(a)) => Some(a.clone()),
        Some(_) => return Err(format!("'{op}': '{key}' must list mesh axes")),
        None => None,
    };
    let (body, len, shard_len) = match op {
        "dnn.embedding" => (
            Body::Embedding {
                sharded: sharded.is_some(),
            },
            out0.len(),
            ins[1].shape[0],
        ),
        "dnn.pick" => (
            Body::Pick {
                sharded: sharded.is_some(),
            },
            tokens(&ins[0]),
            classes(&ins[0]),
        ),
        _ => (
            Body::XentGradLse {
                count: match int(attrs, "count", 0) {
                    0 => tokens(&ins[1]),
                    c => c as usize,
                },
                sharded: sharded.is_some(),
            },
            tokens(&ins[1]),
            classes(&ins[1]),
        ),
    };
    let Some(axes) = sharded else {
        return Ok(Lowered::one(kernel(body, len)));
    };
    let offset = Buf {
        shape: Vec::new(),
        elt: Elt::I64,
    };
    let mut inputs = ins.to_vec();
    inputs.push(offset.clone());
    let mut slots: Vec<Slot> = (0..ins.len()).map(Slot::In).collect();
    slots.push(Slot::Const(0));
    slots.push(Slot::Out(0));
    Ok(Lowered {
        kernels: vec![Kernel {
            name: name.to_string(),
            body,
            inputs,
            outputs: outs.to_vec(),
            len,
        }],
        temps: Vec::new(),
        consts: vec![(
            offset,
            ConstValues::Offset {
                axes,
                len: shard_len,
            },
        )],
        launches: vec![(0, slots)],
    })
}

/// An embedding table's gradient up to `EMBED_ROWS_MAX` elements: teams of (row, part of the tokens).
fn embedding_grad_rows(o: &Op) -> Result<Lowered, String> {
    let Op { name, ins, .. } = *o;
    let out0 = &o.outs[0];
    let kernel = |body, len| o.kernel(body, len);
    // Teams of (row, part of the tokens): enough of them for a large GPU, each
    // part at least EMBED_PART_TOKENS tokens; the parts' tables then summed.
    let rows = out0.shape[0];
    let tokens = ins[1].len();
    let parts = COL_TEAMS
        .div_ceil(rows.max(1))
        .min(tokens / EMBED_PART_TOKENS)
        .clamp(1, SPLIT_PARTS);
    if parts == 1 {
        return Ok(Lowered::one(kernel(
            Body::EmbeddingGradRows { parts },
            rows,
        )));
    }
    let partial = Buf::f32(&[parts, 2, out0.len()]);
    Ok(Lowered {
        kernels: vec![
            Kernel {
                name: format!("{name}_parts"),
                body: Body::EmbeddingGradRows { parts },
                inputs: ins.to_vec(),
                outputs: vec![partial.clone()],
                len: parts * rows,
            },
            col_total(name, Reduce::Sum, &partial, out0),
        ],
        temps: vec![partial],
        consts: Vec::new(),
        launches: vec![
            (0, vec![Slot::In(0), Slot::In(1), Slot::Temp(0)]),
            (1, vec![Slot::Temp(0), Slot::Out(0)]),
        ],
    })
}

/// A larger embedding table's gradient: the table zeroed, each id's tokens linked, each list summed.
fn embedding_grad_lists(o: &Op) -> Result<Lowered, String> {
    let Op { name, ins, .. } = *o;
    let out0 = &o.outs[0];
    // Zero the table; link each id's tokens; sum each list by its head's threads.
    let (rows, width) = (out0.shape[0], out0.shape[1]);
    let n = ins[1].len();
    let links = Buf {
        elt: Elt::I64,
        ..Buf::f32(&[n])
    };
    let part = |suffix: &str, body: Body, inputs: Vec<Buf>, outputs: Vec<Buf>, len| Kernel {
        name: format!("{name}_{suffix}"),
        body,
        inputs,
        outputs,
        len,
    };
    Ok(Lowered {
        kernels: vec![
            part(
                "zero",
                Body::Map(vec![Expr::Const(0.0)]),
                Vec::new(),
                vec![out0.clone()],
                out0.len(),
            ),
            part(
                "links",
                Body::EmbeddingLinks { rows },
                vec![ins[1].clone()],
                vec![links.clone()],
                n,
            ),
            part(
                "lists",
                Body::EmbeddingGradLists,
                vec![ins[0].clone(), ins[1].clone(), links.clone()],
                vec![out0.clone()],
                n * width,
            ),
        ],
        temps: vec![links],
        consts: Vec::new(),
        launches: vec![
            (0, vec![Slot::Out(0)]),
            (1, vec![Slot::In(1), Slot::Temp(0)]),
            (
                2,
                vec![Slot::In(0), Slot::In(1), Slot::Temp(0), Slot::Out(0)],
            ),
        ],
    })
}

/// Cross-entropy: per-row losses, then their mean.
fn cross_entropy(o: &Op) -> Result<Lowered, String> {
    let Op {
        name,
        attrs,
        ins,
        outs,
        ..
    } = *o;
    let rows = tokens(&ins[0]);
    let count = match int(attrs, "count", 0) {
        0 => rows,
        c => c as usize,
    };
    let loss = Buf::f32(&[rows]);
    Ok(Lowered {
        kernels: vec![
            Kernel {
                name: format!("{name}_rows"),
                body: Body::XentRows,
                inputs: ins.to_vec(),
                outputs: vec![loss.clone()],
                len: rows,
            },
            Kernel {
                name: format!("{name}_mean"),
                body: Body::MeanOf { count },
                inputs: vec![loss.clone()],
                outputs: outs.to_vec(),
                len: 1,
            },
        ],
        temps: vec![loss],
        consts: Vec::new(),
        launches: vec![
            (0, vec![Slot::In(0), Slot::In(1), Slot::Temp(0)]),
            (1, vec![Slot::Temp(0), Slot::Out(0)]),
        ],
    })
}

/// `dnn.split`: one window per result, back to back along the dim.
fn split(o: &Op, rank: usize) -> Result<Lowered, String> {
    let Op {
        name,
        attrs,
        ins,
        outs,
        ..
    } = *o;
    // One window per result, back to back along dim.
    let dim = norm_dim(int(attrs, "dim", 0), rank);
    let mut at = 0;
    let mut kernels = Vec::new();
    let mut launches = Vec::new();
    for (k, out) in outs.iter().enumerate() {
        kernels.push(Kernel {
            name: format!("{name}_{k}"),
            body: Body::Window { dim, start: at },
            inputs: ins[..1].to_vec(),
            outputs: vec![out.clone()],
            len: out.len(),
        });
        launches.push((k, vec![Slot::In(0), Slot::Out(k)]));
        at += out.shape[dim];
    }
    Ok(Lowered {
        kernels,
        temps: Vec::new(),
        consts: Vec::new(),
        launches,
    })
}

/// Dropout: on a shard, the mask indexed in the whole tensor.
fn dropout(o: &Op) -> Result<Lowered, String> {
    let Op {
        name,
        attrs,
        ins,
        outs,
        ..
    } = *o;
    let out0 = &o.outs[0];
    let kernel = |body, len| o.kernel(body, len);
    let body = |global| Body::Dropout {
        p: float(attrs, "p", 0.0),
        seed: int(attrs, "seed", 0) as u64,
        global,
        step: ins.len() > 1,
    };
    let (Some(AttrValue::Ints(global)), Some(AttrValue::Strs(dim_axes))) =
        (attrs.get("global_shape"), attrs.get("dim_axes"))
    else {
        return Ok(Lowered::one(kernel(body(None), out0.len())));
    };
    // A shard: its mask is indexed in the whole tensor; where the shard starts in
    // each dim is a per-device constant.
    let local = &ins[0].shape;
    if global.len() != local.len() || dim_axes.len() != local.len() {
        return Err("'dnn.dropout': 'global_shape' and 'dim_axes' need one entry per dim".into());
    }
    let per_dim: Vec<(Vec<String>, usize)> = dim_axes
        .iter()
        .zip(local)
        .map(|(a, &n)| {
            let axes = a
                .split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect();
            (axes, n)
        })
        .collect();
    let offsets = Buf {
        shape: vec![local.len()],
        elt: Elt::I64,
    };
    let mut inputs = ins.to_vec();
    inputs.push(offsets.clone());
    let mut slots: Vec<Slot> = (0..ins.len()).map(Slot::In).collect();
    slots.extend([Slot::Const(0), Slot::Out(0)]);
    Ok(Lowered {
        kernels: vec![Kernel {
            name: name.to_string(),
            body: body(Some(global.iter().map(|&g| g as usize).collect())),
            inputs,
            outputs: outs.to_vec(),
            len: out0.len(),
        }],
        temps: Vec::new(),
        consts: vec![(offsets, ConstValues::Offsets(per_dim))],
        launches: vec![(0, slots)],
    })
}

/// Rotary embedding and its gradient, with the cos/sin tables as constants.
fn rotary(o: &Op) -> Result<Lowered, String> {
    let Op {
        name,
        op,
        attrs,
        ins,
        outs,
        ..
    } = *o;
    let out0 = &o.outs[0];
    let x = &ins[0];
    if x.shape.len() != 4 || !x.shape[3].is_multiple_of(2) {
        return Err(format!("'{op}' needs [b, h, s, d] with an even d"));
    }
    let (s, d) = (x.shape[2], x.shape[3]);
    let half = d / 2;
    let theta = float(attrs, "theta", 10000.0);
    let sign = if op == "dnn.rotary" { 1.0f32 } else { -1.0 };
    let table = Buf::f32(&[s, half]);
    // On a shard of the positions, each device's tables are of its block's.
    let consts = match attrs.get("seq_axes") {
        None => {
            let (cos, sin) = rotary_table(0, s, d, theta, sign);
            vec![
                (table.clone(), ConstValues::F32(cos)),
                (table.clone(), ConstValues::F32(sin)),
            ]
        }
        Some(AttrValue::Strs(axes)) => [false, true]
            .map(|sin| {
                let v = ConstValues::Rotary {
                    axes: axes.clone(),
                    s,
                    d,
                    theta,
                    sign,
                    sin,
                };
                (table.clone(), v)
            })
            .to_vec(),
        Some(_) => return Err(format!("'{op}': 'seq_axes' must list mesh axes")),
    };
    let mut inputs = ins.to_vec();
    inputs.extend([table.clone(), table.clone()]);
    Ok(Lowered {
        kernels: vec![Kernel {
            name: name.to_string(),
            body: Body::Rotary { s, d },
            inputs,
            outputs: outs.to_vec(),
            len: out0.len(),
        }],
        temps: Vec::new(),
        consts,
        launches: vec![(
            0,
            vec![Slot::In(0), Slot::Const(0), Slot::Const(1), Slot::Out(0)],
        )],
    })
}

/// `dnn.linear`: `x W^T` as a product (a BLAS call on a GPU), its bias (if any) added to
/// every row after the sum in the same kernel (a BLAS epilogue on a GPU, or the product
/// and an elementwise kernel: `nns.gemm`'s `bias`), as the reference adds it.
fn linear(o: &Op) -> Result<Lowered, String> {
    let ins = o.ins;
    let k = *ins[0].shape.last().unwrap_or(&1);
    let gemm = Body::Gemm(Gemm {
        batch: 1,
        m: ins[0].len() / k.max(1),
        n: ins[1].shape[0],
        k,
        ta: false,
        tb: true,
        b_batched: false,
        bias: ins.len() > 2,
    });
    Ok(Lowered::one(o.kernel(gemm, o.outs[0].len())))
}
