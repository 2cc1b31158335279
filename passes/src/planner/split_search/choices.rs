//! The split search's choices: each argument's layouts and each op's splits over the
//! searched axis, and the constraints the user wrote on them.

use super::*;

/// What argument `a` may be over the axis: replicated, or split on one dim the axis
/// divides that no other axis splits (`here`: its layout over the other axes; one that
/// uses the axis already is kept as written). A parameter's choice costs its optimizer
/// update on its shard and keeps it with its gradient and optimizer state.
pub(super) fn arg_choices(
    f: &Facts<'_>,
    arg: &nnscaler_dialects::graph::Arg,
    here: Sharding,
) -> Vec<Choice> {
    let (g, axis, tp) = (f.g, f.axis, f.tp);
    let ty = &g.values[arg.value];
    let fixed = here.split.iter().any(|v| v.contains(&axis)) || here.partial[axis].is_some();
    let mut layouts = vec![(
        if fixed { "as written" } else { "R" }.to_string(),
        here.clone(),
    )];
    for d in (0..ty.rank()).filter(|_| !fixed) {
        if here.split[d].is_empty() && ty.shape[d] % tp == 0 && ty.shape[d] >= tp {
            let mut s = here.clone();
            s.split[d].push(axis);
            layouts.push((format!("D({d})"), s));
        }
    }
    let param = arg.is_param();
    let states = match arg.name() {
        Some(p) if param => g
            .args
            .iter()
            .filter(|a| matches!(a.attrs.get("nns.state_of"), Some(AttrValue::Str(s)) if s == p))
            .count() as u64,
        _ => 0,
    };
    let update = g
        .nodes
        .iter()
        .find(|n| n.op == "dnn.adamw" && n.inputs.first() == Some(&arg.value));
    layouts
        .into_iter()
        .map(|(label, s)| {
            let bytes = f.local_bytes(ty, &s);
            // The update on the shard: operands of the parameter's shape are cut like it.
            let seconds = update.map_or(0.0, |n| {
                let local = s.local_shape(&ty.shape, &f.sizes);
                let shard = |v: ValueId| {
                    if g.values[v].shape == ty.shape {
                        TensorType::new(&local, g.values[v].elem)
                    } else {
                        g.values[v].clone()
                    }
                };
                local_node_cost(g, n, &shard, f.cluster)
            }) + f.grad_sums(arg.value, &s);
            Choice {
                label,
                outputs: vec![s],
                seconds,
                memory: if param {
                    bytes * (1 + u64::from(f.backward) + states)
                } else {
                    0
                },
                ..Choice::default()
            }
        })
        .collect()
}

/// What forward op `k` may do over the axis (`pn`: the op as the other axes' propagation
/// left it, its binds over them kept): split nothing (`R(tp)`), split one identifier its
/// annotation lets split whose length the axis divides, or for a cross-entropy take its
/// logits split on the classes (`vocab`). Each choice is costed by compiling the op and
/// its VJP alone ([`scratch_costs`]); user ops, which the scratch compilation cannot take,
/// by the mirror rule ([`mirror_grads`], backward twice the forward).
pub(super) fn op_choices(
    f: &Facts<'_>,
    k: usize,
    pn: &Node,
    only: Option<&str>,
) -> Result<Vec<Choice>, Diagnostics> {
    let (g, mesh, axis, tp) = (f.g, f.mesh, f.axis, f.tp);
    let n = &g.nodes[k];
    let at = |e: String| f.error(n, e);
    let replicated = |v: ValueId| Sharding::replicated(g.values[v].rank(), mesh.axes.len());
    let Ok((anno, binding)) = annotation(g, n) else {
        // No annotation (an op of another dialect): replicated.
        return Ok(vec![Choice {
            label: "R".into(),
            inputs: n.inputs.iter().map(|&v| Some(replicated(v))).collect(),
            grads: vec![None; n.inputs.len()],
            reread: vec![false; n.inputs.len()],
            outputs: n.outputs.iter().map(|&v| replicated(v)).collect(),
            seconds: cost::node_cost(g, n, f.cluster, None).map_or(0.0, |c| c.seconds * 3.0),
            ..Choice::default()
        }]);
    };
    let base_binds: Binds = directive(pn, mesh)
        .map_err(at)?
        .unwrap_or_default()
        .into_iter()
        .filter(|(_, axes)| !axes.contains(&axis))
        .collect();
    let bound: Vec<usize> = base_binds.iter().flat_map(|(_, a)| a.clone()).collect();
    // (label, binds, replicated over the axis, vocabulary-parallel)
    let mut options: Vec<(String, Binds, bool, bool)> =
        vec![("R".into(), base_binds.clone(), true, false)];
    if !bound.contains(&axis) {
        for c in anno.split_choices(&binding) {
            if base_binds.iter().any(|(id, _)| *id == c.id) {
                continue;
            }
            let len = binding.len(&c.id).unwrap_or(1);
            if len % tp != 0 || len < tp {
                continue;
            }
            let mut b = base_binds.clone();
            b.push((c.id.clone(), vec![axis]));
            options.push((c.id.clone(), b, false, false));
        }
        let classes = g.values[n.inputs[0]].shape.last().copied().unwrap_or(1);
        if n.op == "dnn.cross_entropy" && classes % tp == 0 {
            options.push(("vocab".into(), base_binds.clone(), false, true));
        }
    }
    if let Some(label) = only {
        options.retain(|(l, ..)| l == label);
    }
    let in_ranks: Vec<usize> = n.inputs.iter().map(|&v| g.values[v].rank()).collect();
    let out_ranks: Vec<usize> = n.outputs.iter().map(|&v| g.values[v].rank()).collect();
    let needs: Vec<bool> = n.inputs.iter().map(|&v| f.backward && f.grad[v]).collect();
    let user = g.user_ops.of_call(&n.op, &n.attrs).is_some();
    let mut out = Vec::new();
    for (label, binds, closed, vocab) in options {
        let mut l = op_layouts(
            &anno,
            &binding,
            partial_kind(&n.op),
            &binds,
            mesh.axes.len(),
            &in_ranks,
            &out_ranks,
        )
        .map_err(at)?;
        if vocab {
            if let Some(Some(logits)) = l.inputs.get_mut(0) {
                if let Some(c) = logits.split.last_mut() {
                    c.push(axis);
                }
            }
        }
        let only: Vec<usize> = if closed { vec![axis] } else { Vec::new() };
        let attr = split_directive(&binds, &only, mesh);
        let scratch = if user {
            None
        } else {
            scratch_costs(
                g,
                n,
                &needs,
                &l.inputs,
                &l.outputs,
                attr.as_ref(),
                mesh,
                f.cluster,
                f.backward,
            )
            .ok()
        };
        let sc = match scratch {
            Some(sc) => sc,
            None => {
                let mut layout_of: HashMap<ValueId, &Sharding> = HashMap::new();
                for (&v, sh) in n.inputs.iter().zip(&l.inputs) {
                    if let Some(sh) = sh {
                        layout_of.insert(v, sh);
                    }
                }
                for (&v, sh) in n.outputs.iter().zip(&l.outputs) {
                    layout_of.insert(v, sh);
                }
                let local = |v: ValueId| {
                    let ty = &g.values[v];
                    let shape = layout_of
                        .get(&v)
                        .map_or(ty.shape.clone(), |sh| sh.local_shape(&ty.shape, &f.sizes));
                    TensorType::new(&shape, ty.elem)
                };
                let fwd = local_node_cost(g, n, &local, f.cluster);
                Scratch {
                    seconds: fwd * if f.backward { 3.0 } else { 1.0 },
                    grads: if f.backward {
                        mirror_grads(&anno, &binding, &binds, &l.inputs)
                            .into_iter()
                            .zip(&needs)
                            .map(|(gl, &nd)| gl.filter(|_| nd))
                            .collect()
                    } else {
                        vec![None; n.inputs.len()]
                    },
                    reread: vec![f.backward; n.inputs.len()],
                    backward: Vec::new(),
                }
            }
        };
        let memory = n
            .outputs
            .iter()
            .zip(&l.outputs)
            .filter(|(&v, _)| f.saved(v))
            .map(|(&v, s)| f.local_bytes(&g.values[v], s))
            .sum();
        let sums: f64 = n
            .outputs
            .iter()
            .zip(&l.outputs)
            .map(|(&v, s)| f.grad_sums(v, s))
            .sum();
        out.push(Choice {
            label,
            binds,
            closed,
            inputs: l.inputs,
            outputs: l.outputs,
            grads: sc.grads,
            reread: sc.reread,
            seconds: sc.seconds + sums,
            memory,
            backward: sc.backward,
        });
    }
    Ok(out)
}

/// The user's constraint on an op class over the axis, from its first op: a directive or
/// pin binding the axis (that choice only), `R(tp)` in its directive (replicated only), an
/// `nns.forbid` over it (not that choice). An op none of whose choices is left is an
/// error at the op.
pub(super) fn user_constraint(
    f: &Facts<'_>,
    class: &Class,
) -> Result<Option<(Vec<bool>, String, SrcLoc)>, Diagnostics> {
    let Member::Op(k) = class.members[0] else {
        return Ok(None);
    };
    let (mesh, axis) = (f.mesh, f.axis);
    let name = &mesh.axes[axis].name;
    let n = &f.g.nodes[k];
    let at = |e: String| f.error(n, e);
    let mut allowed = vec![true; class.choices.len()];
    let mut what: Vec<String> = Vec::new();
    let keep = |allowed: &mut Vec<bool>, ok: &dyn Fn(&Choice) -> bool| {
        for (a, ch) in allowed.iter_mut().zip(&class.choices) {
            *a &= ok(ch);
        }
    };
    for key in ["nns.split", "nns.pin"] {
        let Some(b) = constraint(n, key, mesh).map_err(at)? else {
            continue;
        };
        if let Some((id, _)) = b.iter().find(|(_, axes)| axes.contains(&axis)) {
            keep(&mut allowed, &|ch| ch.label == *id);
            what.push(format!("{key} ({id} = {name})"));
        }
    }
    if replicated_axes(n, mesh).map_err(at)?.contains(&axis) {
        keep(&mut allowed, &|ch| ch.label == "R");
        what.push(format!("nns.split (R({name}))"));
    }
    if let Some(b) = constraint(n, "nns.forbid", mesh).map_err(at)? {
        for (id, _) in b.iter().filter(|(_, axes)| axes.contains(&axis)) {
            keep(&mut allowed, &|ch| ch.label != *id);
            what.push(format!("nns.forbid ({id} over {name})"));
        }
    }
    if what.is_empty() {
        return Ok(None);
    }
    if !allowed.iter().any(|&a| a) {
        return Err(at(format!(
            "{} cannot be met: no split over {name} = {} of it is possible",
            what.join(" and "),
            f.tp
        )));
    }
    let what = format!("the {} of {}", what.join(" and "), class.name);
    Ok(Some((allowed, what, n.loc.clone())))
}
