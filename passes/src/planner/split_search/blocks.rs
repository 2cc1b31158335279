//! The split search's classes: a model's repeated layers found as blocks with the same
//! signature, whose ops and parameters share variables.

use super::*;

/// A layer of a step: its name, its forward ops in program order, its signature (ops,
/// attributes, shapes and how they connect) and its own parameters (used by no other
/// layer or op outside the layers), in order of first use.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    pub(crate) name: String,
    pub(crate) ops: Vec<usize>,
    sig: Vec<OpSig>,
    pub(crate) params: Vec<usize>,
}

impl Block {
    /// Whether two layers are the same computation on their own parameters.
    pub(crate) fn same(&self, other: &Block) -> bool {
        self.sig == other.sig && self.params.len() == other.params.len()
    }
}

/// The layers of `g` (`layer`: each forward op's, `recompute::layers`), in program order.
pub(crate) fn blocks(g: &Graph, fwd: &[bool], layer: &[Option<String>]) -> Vec<Block> {
    let producer = g.producers();
    let arg_of: HashMap<ValueId, usize> = g
        .args
        .iter()
        .enumerate()
        .map(|(i, a)| (a.value, i))
        .collect();
    let mut layer_ops: Vec<(String, Vec<usize>)> = Vec::new();
    for k in (0..g.nodes.len()).filter(|&k| fwd[k]) {
        if let Some(l) = &layer[k] {
            match layer_ops.iter_mut().find(|(n, _)| n == l) {
                Some((_, ops)) => ops.push(k),
                None => layer_ops.push((l.clone(), vec![k])),
            }
        }
    }
    // A parameter used by one layer only is that layer's.
    let mut param_layers: HashMap<usize, Vec<&str>> = HashMap::new();
    for (name, ops) in &layer_ops {
        for &k in ops {
            for &v in &g.nodes[k].inputs {
                if let Some(&a) = arg_of.get(&v) {
                    if g.args[a].is_param() {
                        let e = param_layers.entry(a).or_default();
                        if !e.contains(&name.as_str()) {
                            e.push(name);
                        }
                    }
                }
            }
        }
    }
    for (k, n) in g.nodes.iter().enumerate() {
        if fwd[k] && layer[k].is_none() {
            for &v in &n.inputs {
                if let Some(&a) = arg_of.get(&v) {
                    param_layers.entry(a).or_default().push("");
                }
            }
        }
    }
    let own_param = |a: usize, l: &str| param_layers.get(&a).is_some_and(|v| v == &[l]);
    layer_ops
        .iter()
        .map(|(name, ops)| {
            let mut params: Vec<usize> = Vec::new();
            let pos: HashMap<usize, usize> = ops.iter().enumerate().map(|(i, &k)| (k, i)).collect();
            let sig = ops
                .iter()
                .map(|&k| {
                    let n = &g.nodes[k];
                    let inputs = n
                        .inputs
                        .iter()
                        .map(|&v| {
                            if let Some(p) = producer[v] {
                                if let Some(&i) = pos.get(&p.index()) {
                                    let r = g.nodes[p].outputs.iter().position(|&x| x == v);
                                    return Ref::Local(i, r.unwrap_or(0));
                                }
                            }
                            match arg_of.get(&v) {
                                Some(&a) if own_param(a, name) => {
                                    let j =
                                        params.iter().position(|&p| p == a).unwrap_or_else(|| {
                                            params.push(a);
                                            params.len() - 1
                                        });
                                    Ref::Param(j, g.values[v].clone())
                                }
                                Some(&a) => Ref::Outside(g.values[v].clone(), Some(a)),
                                None => Ref::Outside(g.values[v].clone(), None),
                            }
                        })
                        .collect();
                    let attrs: BTreeMap<&String, String> = n
                        .attrs
                        .iter()
                        // Where a layer runs (its pipeline stage) is not what it computes:
                        // the same layer on every stage shares its classes.
                        .filter(|(k, _)| *k != "nns.layouts" && *k != "nns.stage")
                        .map(|(k, v)| (k, v.to_mlir_text()))
                        .collect();
                    OpSig {
                        op: n.op.to_string(),
                        attrs: format!("{attrs:?}"),
                        inputs,
                        outputs: n.outputs.iter().map(|&v| g.values[v].clone()).collect(),
                    }
                })
                .collect();
            Block {
                name: name.clone(),
                ops: ops.clone(),
                sig,
                params,
            }
        })
        .collect()
}

/// The classes: layers with equal signatures share them (op `i` of each, and its `j`-th
/// own parameter); every other forward op and every argument a forward op reads (but
/// optimizer state) is a class alone. Returns them and each member's class.
pub(super) fn classes(f: &Facts<'_>) -> (Vec<Class>, HashMap<Member, usize>) {
    let g = f.g;
    let mut classes: Vec<Class> = Vec::new();
    let mut class_of: HashMap<Member, usize> = HashMap::new();
    // (the first layer of a signature, its op classes, its parameter classes)
    let mut sigs: Vec<(Block, Vec<usize>, Vec<usize>)> = Vec::new();
    let new_class = |classes: &mut Vec<Class>, m: Member, name: String, loc: SrcLoc| {
        classes.push(Class {
            members: vec![m],
            choices: Vec::new(),
            constraint: None,
            name,
            loc,
        });
        classes.len() - 1
    };
    for block in blocks(g, &f.fwd, &f.layer) {
        let (ops, params) = (&block.ops, &block.params);
        if let Some((_, op_classes, param_classes)) = sigs.iter().find(|(b, _, _)| b.same(&block)) {
            for (&k, &c) in ops.iter().zip(op_classes) {
                classes[c].members.push(Member::Op(k));
                class_of.insert(Member::Op(k), c);
            }
            for (&a, &c) in params.iter().zip(param_classes) {
                classes[c].members.push(Member::Arg(a));
                class_of.insert(Member::Arg(a), c);
            }
            continue;
        }
        let op_classes: Vec<usize> = ops
            .iter()
            .map(|&k| {
                let c = new_class(
                    &mut classes,
                    Member::Op(k),
                    f.op_name(k),
                    g.nodes[k].loc.clone(),
                );
                class_of.insert(Member::Op(k), c);
                c
            })
            .collect();
        let param_classes: Vec<usize> = params
            .iter()
            .map(|&a| {
                let c = new_class(&mut classes, Member::Arg(a), f.arg_name(a), g.loc.clone());
                class_of.insert(Member::Arg(a), c);
                c
            })
            .collect();
        sigs.push((block, op_classes, param_classes));
    }
    for k in (0..g.nodes.len()).filter(|&k| f.fwd[k]) {
        class_of.entry(Member::Op(k)).or_insert_with(|| {
            new_class(
                &mut classes,
                Member::Op(k),
                f.op_name(k),
                g.nodes[k].loc.clone(),
            )
        });
    }
    for (a, arg) in g.args.iter().enumerate() {
        let used = f.users[arg.value].iter().any(|&(k, _)| f.fwd[k]);
        if used && !arg.attrs.contains_key("nns.state_of") {
            class_of.entry(Member::Arg(a)).or_insert_with(|| {
                new_class(&mut classes, Member::Arg(a), f.arg_name(a), g.loc.clone())
            });
        }
    }
    (classes, class_of)
}
