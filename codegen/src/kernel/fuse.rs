//! Fusion: a function's elementwise ops grouped into single kernels ([`fuse`]).

use super::*;

/// A fused group of a function's elementwise ops: one kernel.
#[derive(Clone, Debug)]
pub struct Group {
    /// The kernel (a [`Body::Map`] with one formula).
    pub kernel: Kernel,
    /// The graph's values it reads, in the kernel's input order.
    pub inputs: Vec<ValueId>,
    /// The value it writes.
    pub output: ValueId,
    /// The ops it computes, in program order (indices into the graph's nodes).
    pub nodes: Vec<usize>,
}

impl Group {
    fn expr(&self) -> &Expr {
        match &self.kernel.body {
            Body::Map(e) => &e[0],
            _ => unreachable!("groups are elementwise"),
        }
    }
}

/// Most formula nodes one fused kernel may hold (a bound on code size: fusion duplicates a
/// producer's formula into every place its consumer reads it).
pub(super) const MAX_EXPR: usize = 400;

pub(super) fn dims(g: &Graph, v: ValueId) -> Vec<usize> {
    g.values[v].shape.iter().map(|&d| d as usize).collect()
}

/// Groups the elementwise float ops of `g` into kernels (bf16 values are held in f32
/// buffers, each rounded to bf16 where its op stores it): an op is fused into its consumer
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
        let Some(rule) = n.op.spec().and_then(|s| s.traits.scalar) else {
            continue;
        };
        let float = |v: &ValueId| matches!(g.values[*v].elem, Elem::F32 | Elem::BF16);
        if n.outputs.len() != 1 || !float(&n.outputs[0]) || !n.inputs.iter().all(float) {
            continue;
        }
        let out = n.outputs[0];
        let shape = dims(g, out);
        let mut own = rule
            .expr(&n.attrs)
            .map_err(|e| format!("'{}': {e}", n.op))?;
        if g.values[out].elem == Elem::BF16 && !matches!(own, Expr::Un(Un::RoundBf16, _)) {
            // A bf16 result is computed in f32 and rounded once, as the CPU runtime does.
            own = own.round_bf16();
        }
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
                Some((p, gr)) if gr.expr().size() + own.size() <= MAX_EXPR => {
                    let map: Vec<usize> = gr.inputs.iter().map(|&w| slot(&mut inputs, w)).collect();
                    nodes.extend(&gr.nodes);
                    absorbed.push(p);
                    gr.expr().substitute(&mut |i| Expr::Input(map[i]))
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
        let len = shape.iter().product();
        let kernel = Kernel {
            name: String::new(),
            body: Body::Map(vec![expr]),
            inputs: inputs.iter().map(|&v| Buf::f32(&dims(g, v))).collect(),
            outputs: vec![Buf::f32(&shape)],
            len,
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
