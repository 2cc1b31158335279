//! How `--schedule-*` writes a pipelined step (see the parent module for what it writes):
//! the step analysed ([`Step::analyse`]: each value's micro-batch kind, post ops, stages,
//! kinds, fragments), then written as fragment functions and one program per pipeline
//! rank, and the programs checked for deadlocks ([`check_deadlock`]).

use crate::layouts::{error, layout_attr, value_layouts};
use crate::planner::schedule::{Action, Kind, Schedule};
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::{Graph, Node, NodeId, Output, ValueId};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::sharding::Sharding;
use nnscaler_dialects::types::{AttrValue, Attrs};
use std::collections::{BTreeMap, HashMap};

/// How a value relates to the micro-batch axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mb {
    /// The same in every micro-batch (no batch dim, or no micro-batch axis).
    Whole,
    /// A micro-batch's piece (its batch dim is split over the axis).
    Piece,
    /// A micro-batch's contribution to a sum over the batch (partial over the axis).
    Partial,
}

fn mb_of(s: &Sharding, mbi: Option<usize>) -> Mb {
    let Some(a) = mbi else { return Mb::Whole };
    if s.partial.get(a).is_some_and(Option::is_some) {
        Mb::Partial
    } else if s.split.iter().any(|axes| axes.contains(&a)) {
        Mb::Piece
    } else {
        Mb::Whole
    }
}

/// `s` without the micro-batch axis.
fn drop_mb(s: &Sharding, mbi: Option<usize>) -> Sharding {
    let mut s = s.clone();
    if let Some(a) = mbi {
        for axes in &mut s.split {
            axes.retain(|&x| x != a);
        }
        if let Some(p) = s.partial.get_mut(a) {
            *p = None;
        }
    }
    s
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::F => "F",
        Kind::B => "B",
        Kind::W => "W",
    }
}

/// One fragment: its ops (node indices, in program order), inputs and outputs (values of
/// the original function).
#[derive(Debug, Default)]
struct Fragment {
    nodes: Vec<usize>,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
}

/// The stages `g`'s ops are placed in (`nns.stage`): the largest plus one (0: unplaced).
pub(super) fn stage_count(g: &Graph) -> usize {
    g.nodes
        .iter()
        .filter_map(stage_attr)
        .max()
        .map_or(0, |s| s + 1)
}

fn stage_attr(n: &Node) -> Option<usize> {
    match n.attrs.get("nns.stage") {
        Some(AttrValue::Int(s)) if *s >= 0 => Some(*s as usize),
        _ => None,
    }
}

/// Builds the fragments and per-rank programs replacing `g` (see the module docs).
pub(super) fn build(
    g: &Graph,
    mesh: &Mesh,
    sched: &Schedule,
    axis: &str,
    flag: &str,
) -> Result<Vec<Graph>, Diagnostics> {
    let step = Step::analyse(g, mesh, sched, axis, flag)?;
    let mut out = step.fragment_functions();
    let mut programs = Vec::new();
    for r in 0..sched.devices {
        programs.push(step.program(r)?);
    }
    check_deadlock(&programs).map_err(|m| step.fail(&g.loc, m))?;
    out.extend(programs);
    Ok(out)
}

/// An error of the pass `flag` at `loc`.
fn fail_at(flag: &str, loc: &SrcLoc, m: String) -> Diagnostics {
    error(loc, format!("{flag}: {m}"))
}

/// What the pass needs: a loss and its backward, layouts and stages.
fn check_ready(g: &Graph, sched: &Schedule, flag: &str) -> Result<(), Diagnostics> {
    let has_loss = g
        .outputs
        .iter()
        .any(|o| !o.name().is_some_and(|n| n.starts_with("grad.")));
    if !(has_loss && crate::transforms::recompute::has_backward(g)) {
        return Err(fail_at(
            flag,
            &g.loc,
            format!("@{} has no loss and backward to pipeline; run --autodiff first (before --plan and --split-tensor)", g.name),
        ));
    }
    if let Some(n) = g
        .nodes
        .iter()
        .find(|n| n.op.starts_with("dnn.") && !n.attrs.contains_key("nns.layouts"))
    {
        return Err(fail_at(
            flag,
            &n.loc,
            format!(
                "'{}' has no layout; run --propagate-layouts and --split-tensor first",
                n.op
            ),
        ));
    }
    if !g.nodes.iter().any(|n| stage_attr(n).is_some()) {
        return Err(fail_at(
            flag,
            &g.loc,
            format!(
                "@{} has no pipeline stages (nns.stage); run --place{{stages={}}} before --autodiff, which gives each backward op its forward op's stage",
                g.name, sched.stages
            ),
        ));
    }
    Ok(())
}

/// Which ops are post ops: from each accumulation (a relayout of a value partial over
/// micro-batches to one that is not) on, they run once per step, after every micro-batch;
/// so does an op that reads only arguments and post values and whose results only post
/// ops read (ZeRO's relayout of a parameter to the shard its sharded update reads), on
/// its readers' rank, instead of on whatever rank per micro-batch.
fn post_ops(
    g: &Graph,
    mbk: &[Mb],
    producer: &[Option<NodeId>],
    users: &[Vec<usize>],
    arg_index: &HashMap<ValueId, usize>,
    returned: &[bool],
    flag: &str,
) -> Result<Vec<bool>, Diagnostics> {
    let fail = |loc: &SrcLoc, m: String| fail_at(flag, loc, m);
    let n = g.nodes.len();
    let mut post = vec![false; n];
    for (k, node) in g.nodes.iter().enumerate() {
        let ins: Vec<Mb> = node.inputs.iter().map(|&v| mbk[v]).collect();
        let outs: Vec<Mb> = node.outputs.iter().map(|&v| mbk[v]).collect();
        let from_post = node
            .inputs
            .iter()
            .any(|&v| producer[v].is_some_and(|p| post[p]));
        if node.op == "nns.relayout" && !from_post {
            match (ins[0], outs[0]) {
                (Mb::Partial, Mb::Whole) => post[k] = true,
                (a, b) if a != b && !(a == Mb::Partial && b == Mb::Piece) => {
                    return Err(fail(
                        &node.loc,
                        if a == Mb::Piece {
                            "this relayout gathers the whole batch from its micro-batches; a pipelined program must run everything up to the loss on one micro-batch (an op reducing over the batch mid-model, like batch norm, cannot be micro-batched)".to_string()
                        } else {
                            "this relayout would cut a value that is the same in every micro-batch into micro-batches".to_string()
                        },
                    ))
                }
                (Mb::Partial, Mb::Piece) => {
                    return Err(fail(
                        &node.loc,
                        "this relayout reduces over the micro-batches into a batch-split value; only the loss and gradients may be reduced over the batch".into(),
                    ))
                }
                _ => {}
            }
            continue;
        }
        if from_post {
            post[k] = true;
            if let Some(&v) = node
                .inputs
                .iter()
                .find(|&&v| mbk[v] == Mb::Piece && !producer[v].is_some_and(|p| post[p]))
            {
                return Err(fail(
                    &node.loc,
                    format!(
                        "'{}' combines a value accumulated over the micro-batches with a micro-batch's piece ({}); only the loss and gradients may be reduced over the batch",
                        node.op, g.values[v]
                    ),
                ));
            }
        }
    }
    for k in (0..n).rev() {
        let node = &g.nodes[k];
        if post[k] || node.outputs.is_empty() {
            continue;
        }
        let whole_inputs = node.inputs.iter().all(|&v| match producer[v] {
            Some(p) => post[p],
            None => arg_index.contains_key(&v) && mbk[v] == Mb::Whole,
        });
        let post_users = node
            .outputs
            .iter()
            .all(|&o| !returned[o] && !users[o].is_empty() && users[o].iter().all(|&u| post[u]));
        if whole_inputs && post_users {
            post[k] = true;
        }
    }
    Ok(post)
}

/// Each op's stage: its own, else its earliest staged user's, else its latest staged
/// producer's (relayouts added by --split-tensor run where their result is used: a value
/// crossing stages is sent as it is and relayouted by the receiver); as many stages as
/// the schedule runs.
fn stages(
    g: &Graph,
    sched: &Schedule,
    post: &[bool],
    producer: &[Option<NodeId>],
    users: &[Vec<usize>],
    flag: &str,
) -> Result<Vec<usize>, Diagnostics> {
    let n = g.nodes.len();
    let mut stage: Vec<Option<usize>> = g.nodes.iter().map(stage_attr).collect();
    loop {
        let mut changed = false;
        for k in 0..n {
            if stage[k].is_some() {
                continue;
            }
            let from_users = g.nodes[k]
                .outputs
                .iter()
                .flat_map(|&o| users[o].iter())
                .filter(|&&u| post[k] || !post[u])
                .filter_map(|&u| stage[u])
                .min();
            let from_in = || {
                g.nodes[k]
                    .inputs
                    .iter()
                    .filter_map(|&v| producer[v].and_then(|p| stage[p]))
                    .max()
            };
            if let Some(s) = from_users.or_else(from_in) {
                stage[k] = Some(s);
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let stage: Vec<usize> = stage.into_iter().map(|s| s.unwrap_or(0)).collect();
    let stages = sched.stages;
    let placed = stage.iter().max().map_or(0, |s| s + 1);
    if placed != stages {
        let how = if sched.stages != sched.devices {
            format!(
                " ({} ranks x {} chunks per rank)",
                sched.devices,
                stages / sched.devices
            )
        } else {
            String::new()
        };
        return Err(fail_at(
            flag,
            &g.loc,
            format!(
                "@{} is placed in {placed} stages, but schedule '{}' runs {stages}{how}; place it with --place{{stages={stages}}} before --autodiff",
                g.name, sched.name
            ),
        ));
    }
    Ok(stage)
}

/// Each op's kind: forward (what the loss depends on) or backward; with a split
/// backward, W is what no other stage waits for. Every stage needs a forward op.
fn kinds(
    g: &Graph,
    sched: &Schedule,
    post: &[bool],
    stage: &[usize],
    users: &[Vec<usize>],
    flag: &str,
) -> Result<Vec<Kind>, Diagnostics> {
    let n = g.nodes.len();
    let stages = sched.stages;
    let fwd = crate::transforms::recompute::forward_ops(g);
    let mut kind: Vec<Kind> = (0..n)
        .map(|k| if fwd[k] { Kind::F } else { Kind::B })
        .collect();
    if sched.split_backward {
        let mut needed = vec![false; n];
        for k in (0..n).rev() {
            if post[k] || kind[k] != Kind::B {
                continue;
            }
            needed[k] = g.nodes[k].outputs.iter().any(|&o| {
                users[o]
                    .iter()
                    .any(|&u| !post[u] && (stage[u] != stage[k] || needed[u]))
            });
        }
        for k in 0..n {
            if kind[k] == Kind::B && !post[k] && !needed[k] {
                kind[k] = Kind::W;
            }
        }
    }
    for (s, used) in (0..stages).map(|s| (s, (0..n).any(|k| !post[k] && stage[k] == s && fwd[k]))) {
        if !used {
            return Err(fail_at(
                flag,
                &g.loc,
                format!(
                    "stage {s} of @{} has no forward op; place fewer stages",
                    g.name
                ),
            ));
        }
    }
    Ok(kind)
}

/// A fragment key: a stage and a kind.
type FragKey = (usize, Kind);

/// The fragments: the ops other than post ops by (stage, kind), each with the values it
/// reads from outside and those it gives outside (or returns); and each op's fragment.
fn fragments(
    g: &Graph,
    post: &[bool],
    stage: &[usize],
    kind: &[Kind],
    producer: &[Option<NodeId>],
    users: &[Vec<usize>],
    returned: &[bool],
) -> (BTreeMap<FragKey, Fragment>, Vec<Option<FragKey>>) {
    let n = g.nodes.len();
    let mut frags: BTreeMap<FragKey, Fragment> = BTreeMap::new();
    let mut frag_of: Vec<Option<FragKey>> = vec![None; n];
    for k in 0..n {
        if post[k] {
            continue;
        }
        let key = (stage[k], kind[k]);
        frags.entry(key).or_default().nodes.push(k);
        frag_of[k] = Some(key);
    }
    let def_frag = |v: ValueId| producer[v].and_then(|p| frag_of[p]);
    for (key, f) in frags.iter_mut() {
        for &k in &f.nodes {
            for &v in &g.nodes[k].inputs {
                if def_frag(v) != Some(*key) && !f.inputs.contains(&v) {
                    f.inputs.push(v);
                }
            }
            for &o in &g.nodes[k].outputs {
                let outside = returned[o] || users[o].iter().any(|&u| frag_of[u] != Some(*key));
                if outside {
                    f.outputs.push(o);
                }
            }
        }
    }
    (frags, frag_of)
}

/// A training step analysed for pipelining ([`Step::analyse`]): each value's layout and
/// micro-batch kind, each op's producer, users, stage and whether it is a post op, and
/// the fragments; then written as fragment functions and per-rank programs.
struct Step<'a> {
    g: &'a Graph,
    mesh: &'a Mesh,
    sched: &'a Schedule,
    /// The pipeline axis (sends' and receives' `axis`).
    axis: &'a str,
    /// The pass's flag, for errors.
    flag: &'a str,
    layouts: Vec<Sharding>,
    /// The micro-batch axis's index in the mesh, if it has one.
    mbi: Option<usize>,
    mbk: Vec<Mb>,
    producer: Vec<Option<NodeId>>,
    users: Vec<Vec<usize>>,
    arg_index: HashMap<ValueId, usize>,
    /// Whether each value is a result of the function.
    returned: Vec<bool>,
    post: Vec<bool>,
    stage: Vec<usize>,
    frags: BTreeMap<FragKey, Fragment>,
    frag_of: Vec<Option<FragKey>>,
    /// Which ranks read each value computed in a fragment (besides its own).
    readers: HashMap<ValueId, Vec<usize>>,
    /// Which other ranks' post ops read each post value.
    post_readers: HashMap<ValueId, Vec<usize>>,
}

/// What a rank's program holds after its micro-batches: the values accumulated over
/// them and the last micro-batch's value of the others, and its actions as text.
struct AfterMicroBatches {
    acc: HashMap<ValueId, ValueId>,
    last: HashMap<ValueId, ValueId>,
    text: Vec<String>,
}

impl<'a> Step<'a> {
    fn analyse(
        g: &'a Graph,
        mesh: &'a Mesh,
        sched: &'a Schedule,
        axis: &'a str,
        flag: &'a str,
    ) -> Result<Step<'a>, Diagnostics> {
        check_ready(g, sched, flag)?;
        let layouts: Vec<Sharding> = value_layouts(g, mesh)?
            .into_iter()
            .enumerate()
            .map(|(v, l)| {
                l.unwrap_or_else(|| Sharding::replicated(g.values[v].rank(), mesh.axes.len()))
            })
            .collect();
        let mbi = mesh.axes.iter().position(|a| a.microbatches);
        let mbk: Vec<Mb> = layouts.iter().map(|l| mb_of(l, mbi)).collect();
        let producer = g.producers();
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); g.values.len()];
        for (k, node) in g.nodes.iter().enumerate() {
            for &i in &node.inputs {
                users[i].push(k);
            }
        }
        let arg_index: HashMap<ValueId, usize> = g
            .args
            .iter()
            .enumerate()
            .map(|(i, a)| (a.value, i))
            .collect();
        let mut returned = vec![false; g.values.len()];
        for o in &g.outputs {
            returned[o.value] = true;
        }
        let post = post_ops(g, &mbk, &producer, &users, &arg_index, &returned, flag)?;
        let stage = stages(g, sched, &post, &producer, &users, flag)?;
        let kind = kinds(g, sched, &post, &stage, &users, flag)?;
        let (frags, frag_of) = fragments(g, &post, &stage, &kind, &producer, &users, &returned);
        let mut step = Step {
            g,
            mesh,
            sched,
            axis,
            flag,
            layouts,
            mbi,
            mbk,
            producer,
            users,
            arg_index,
            returned,
            post,
            stage,
            frags,
            frag_of,
            readers: HashMap::new(),
            post_readers: HashMap::new(),
        };
        step.find_readers();
        Ok(step)
    }

    fn fail(&self, loc: &SrcLoc, m: String) -> Diagnostics {
        fail_at(self.flag, loc, m)
    }

    /// The fragment computing `v`, if one does.
    fn def_frag(&self, v: ValueId) -> Option<FragKey> {
        self.producer[v].and_then(|p| self.frag_of[p])
    }

    fn rank_of(&self, s: usize) -> usize {
        self.sched.device_of[s]
    }

    /// The stage of the op computing `v`, if an op does.
    fn value_stage(&self, v: ValueId) -> Option<usize> {
        self.producer[v].map(|p| self.stage[p])
    }

    fn frag_name(&self, (s, k): FragKey) -> String {
        format!("{}.s{s}.{}", self.g.name, kind_name(k))
    }

    /// A send's or receive's attributes: the pipeline axis, the peer rank and the tag.
    fn transfer(&self, peer: usize, tag: String) -> Attrs {
        let mut attrs = Attrs::new();
        attrs.insert("axis".into(), AttrValue::Str(self.axis.to_string()));
        attrs.insert("peer".into(), AttrValue::Int(peer as i64));
        attrs.insert("tag".into(), AttrValue::Str(tag));
        attrs
    }

    fn layouts_attr(&self, ls: Vec<&Sharding>) -> AttrValue {
        let ls: Vec<Sharding> = ls.into_iter().cloned().collect();
        crate::layouts::layouts_attr(&ls, self.mesh)
    }

    /// The ranks reading each fragment's value besides its own, and each post value
    /// besides the post op's own.
    fn find_readers(&mut self) {
        let g = self.g;
        let mut readers: HashMap<ValueId, Vec<usize>> = HashMap::new();
        for (&(s, _), f) in &self.frags {
            for &v in &f.inputs {
                if let Some((ps, _)) = self.def_frag(v) {
                    let r = self.rank_of(s);
                    if self.rank_of(ps) != r {
                        let e = readers.entry(v).or_default();
                        if !e.contains(&r) {
                            e.push(r);
                        }
                    }
                }
            }
        }
        let mut post_readers: HashMap<ValueId, Vec<usize>> = HashMap::new();
        for k in (0..g.nodes.len()).filter(|&k| self.post[k]) {
            let reader = self.rank_of(self.stage[k]);
            for &v in &g.nodes[k].inputs {
                if self.producer[v]
                    .is_some_and(|p| self.post[p] && self.rank_of(self.stage[p]) != reader)
                {
                    let e = post_readers.entry(v).or_default();
                    if !e.contains(&reader) {
                        e.push(reader);
                    }
                }
            }
        }
        self.readers = readers;
        self.post_readers = post_readers;
    }

    /// The fragment functions `@f.s<stage>.<F|B|W>`.
    fn fragment_functions(&self) -> Vec<Graph> {
        let (g, mesh, layouts) = (self.g, self.mesh, &self.layouts);
        let mut out = Vec::new();
        for (&key, f) in &self.frags {
            let mut fg = Graph {
                name: self.frag_name(key),
                loc: g.loc.clone(),
                user_ops: g.user_ops.clone(),
                ..Graph::default()
            };
            let mut map: HashMap<ValueId, ValueId> = HashMap::new();
            for &v in &f.inputs {
                let mut attrs = Attrs::new();
                if let Some(i) = self.arg_index.get(&v) {
                    attrs = g.args[*i].attrs.clone();
                }
                attrs.insert("nns.layout".into(), layout_attr(&layouts[v], mesh));
                map.insert(v, fg.add_arg(g.values[v].clone(), attrs));
            }
            for &k in &f.nodes {
                let node = &g.nodes[k];
                let inputs: Vec<ValueId> = node.inputs.iter().map(|v| map[v]).collect();
                let types = node.outputs.iter().map(|&o| g.values[o].clone()).collect();
                let outs = fg.add_raw(&node.op, &inputs, types, node.attrs.clone(), &node.loc);
                for (&o, &n2) in node.outputs.iter().zip(&outs) {
                    map.insert(o, n2);
                }
            }
            for &v in &f.outputs {
                let mut attrs = Attrs::new();
                attrs.insert("nns.layout".into(), layout_attr(&layouts[v], mesh));
                fg.outputs.push(Output {
                    value: map[&v],
                    attrs,
                });
            }
            fg.func_attrs
                .insert("sym_visibility".into(), AttrValue::Str("private".into()));
            fg.func_attrs.insert(
                "nns.fragment".into(),
                AttrValue::Str(format!("{}{}", key.0, kind_name(key.1))),
            );
            out.push(fg);
        }
        out
    }

    /// The program `@f.pp<r>` of pipeline rank `r`.
    fn program(&self, r: usize) -> Result<Graph, Diagnostics> {
        let g = self.g;
        let mut pg = Graph {
            name: format!("{}.pp{r}", g.name),
            loc: g.loc.clone(),
            user_ops: g.user_ops.clone(),
            func_attrs: g.func_attrs.clone(),
            ..Graph::default()
        };
        let arg_val = self.program_args(r, &mut pg);
        let done = self.micro_batches(r, &mut pg, &arg_val)?;
        self.after_micro_batches(r, &mut pg, &arg_val, &done)?;
        pg.func_attrs
            .insert("nns.pipeline".into(), AttrValue::Str(g.name.clone()));
        pg.func_attrs
            .insert("nns.pipeline_rank".into(), AttrValue::Int(r as i64));
        pg.func_attrs.insert(
            "nns.schedule".into(),
            AttrValue::Str(format!("{}: {}", self.sched.name, done.text.join(" "))),
        );
        Ok(pg)
    }

    /// Rank `r`'s arguments: the original ones its fragments and post ops read (and
    /// rank 0 those returned as they are), whole over the micro-batch axis; the program's
    /// value of each.
    fn program_args(&self, r: usize, pg: &mut Graph) -> HashMap<ValueId, ValueId> {
        let g = self.g;
        let n = g.nodes.len();
        let mut used_args = vec![false; g.args.len()];
        for (&(s, _), f) in &self.frags {
            if self.rank_of(s) == r {
                for v in &f.inputs {
                    if let Some(&i) = self.arg_index.get(v) {
                        used_args[i] = true;
                    }
                }
            }
        }
        for k in (0..n).filter(|&k| self.post[k] && self.rank_of(self.stage[k]) == r) {
            for v in &g.nodes[k].inputs {
                if let Some(&i) = self.arg_index.get(v) {
                    used_args[i] = true;
                }
            }
        }
        for o in &g.outputs {
            if self.value_stage(o.value).is_none() && r == 0 {
                if let Some(&a) = self.arg_index.get(&o.value) {
                    used_args[a] = true;
                }
            }
        }
        let mut arg_val: HashMap<ValueId, ValueId> = HashMap::new();
        for (i, a) in g.args.iter().enumerate() {
            if !used_args[i] {
                continue;
            }
            let mut attrs = a.attrs.clone();
            attrs.insert(
                "nns.layout".into(),
                layout_attr(&drop_mb(&self.layouts[a.value], self.mbi), self.mesh),
            );
            attrs.insert("nns.arg".into(), AttrValue::Int(i as i64));
            arg_val.insert(a.value, pg.add_arg(g.values[a.value].clone(), attrs));
        }
        arg_val
    }

    /// Rank `r`'s actions in the schedule's order: each fragment called on its
    /// micro-batch (data inputs cut with `nns.microbatch`, values of other ranks received),
    /// its results sent to the ranks that read them, and what the post ops need
    /// accumulated over the micro-batches (or kept from the last).
    fn micro_batches(
        &self,
        r: usize,
        pg: &mut Graph,
        arg_val: &HashMap<ValueId, ValueId>,
    ) -> Result<AfterMicroBatches, Diagnostics> {
        let (g, mesh, layouts, mbi, mbk) = (self.g, self.mesh, &self.layouts, self.mbi, &self.mbk);
        let mut sliced: HashMap<(ValueId, usize), ValueId> = HashMap::new();
        let mut avail: HashMap<(ValueId, usize), ValueId> = HashMap::new();
        let mut acc: HashMap<ValueId, ValueId> = HashMap::new();
        let mut last: HashMap<ValueId, ValueId> = HashMap::new();
        let mut text = Vec::new();
        for a in &self.sched.actions[r] {
            text.push(a.to_string());
            let key = (a.stage, a.kind);
            let Some(f) = self.frags.get(&key) else {
                continue;
            };
            let j = a.mb;
            let mut ins = Vec::with_capacity(f.inputs.len());
            for &v in &f.inputs {
                let got = if let Some(&av) = arg_val.get(&v) {
                    if mbk[v] == Mb::Piece {
                        let axis_name =
                            mesh.axes[mbi.expect("a piece needs the axis")].name.clone();
                        *sliced.entry((v, j)).or_insert_with(|| {
                            let mut attrs = Attrs::new();
                            attrs.insert("axes".into(), AttrValue::Strs(vec![axis_name]));
                            let dim = layouts[v]
                                .split
                                .iter()
                                .position(|axes| mbi.is_some_and(|m| axes.contains(&m)))
                                .unwrap_or(0);
                            attrs.insert("dim".into(), AttrValue::Int(dim as i64));
                            attrs.insert("index".into(), AttrValue::Int(j as i64));
                            attrs
                                .insert("nns.layouts".into(), self.layouts_attr(vec![&layouts[v]]));
                            pg.add_raw(
                                "nns.microbatch",
                                &[av],
                                vec![g.values[v].clone()],
                                attrs,
                                &g.loc,
                            )[0]
                        })
                    } else {
                        av
                    }
                } else if let Some(&have) = avail.get(&(v, j)) {
                    have
                } else {
                    let (ps, pk) = self
                        .def_frag(v)
                        .expect("a fragment input is an argument or a fragment's result");
                    let from = self.rank_of(ps);
                    if from == r {
                        return Err(self.fail(
                            &g.loc,
                            format!(
                                "the schedule runs {a} on rank {r} before {}, whose result it needs",
                                Action { stage: ps, kind: pk, mb: j }
                            ),
                        ));
                    }
                    let mut attrs = self.transfer(from, format!("v{v}.mb{j}"));
                    attrs.insert("nns.layouts".into(), self.layouts_attr(vec![&layouts[v]]));
                    let loc = self.producer[v].map_or(g.loc.clone(), |p| g.nodes[p].loc.clone());
                    let got =
                        pg.add_raw("nns.recv", &[], vec![g.values[v].clone()], attrs, &loc)[0];
                    avail.insert((v, j), got);
                    got
                };
                ins.push(got);
            }
            let mut attrs = Attrs::new();
            attrs.insert(
                "callee".into(),
                AttrValue::Other(format!("@{}", self.frag_name(key))),
            );
            attrs.insert("nns.fragment".into(), AttrValue::Str(a.to_string()));
            // A result partial over the micro-batches is, in the program, this micro-batch's
            // contribution to the step's value: its layout there lacks the micro-batch axis.
            let result_layouts: Vec<Sharding> = f
                .outputs
                .iter()
                .map(|&v| match mbk[v] {
                    Mb::Partial => drop_mb(&layouts[v], mbi),
                    _ => layouts[v].clone(),
                })
                .collect();
            attrs.insert(
                "nns.layouts".into(),
                crate::layouts::layouts_attr(&result_layouts, mesh),
            );
            let types = f.outputs.iter().map(|&v| g.values[v].clone()).collect();
            let outs = pg.add_raw("func.call", &ins, types, attrs, &g.loc);
            // Sends first (the next rank waits for them), then the accumulations.
            for (&v, &o) in f.outputs.iter().zip(&outs) {
                avail.insert((v, j), o);
                for &to in self.readers.get(&v).map(Vec::as_slice).unwrap_or(&[]) {
                    let loc = self.producer[v].map_or(g.loc.clone(), |p| g.nodes[p].loc.clone());
                    pg.add_raw(
                        "nns.send",
                        &[o],
                        vec![],
                        self.transfer(to, format!("v{v}.mb{j}")),
                        &loc,
                    );
                }
            }
            for (&v, &o) in f.outputs.iter().zip(&outs) {
                let for_post = self.returned[v] || self.users[v].iter().any(|&u| self.post[u]);
                if !for_post {
                    continue;
                }
                match mbk[v] {
                    Mb::Partial => {
                        let sum = match acc.get(&v) {
                            None => o,
                            Some(&prev) => {
                                let mut attrs = Attrs::new();
                                attrs.insert(
                                    "nns.layouts".into(),
                                    self.layouts_attr(vec![&drop_mb(&layouts[v], mbi)]),
                                );
                                attrs.insert("nns.accumulate".into(), AttrValue::Unit);
                                pg.add_raw(
                                    "dnn.add",
                                    &[prev, o],
                                    vec![g.values[v].clone()],
                                    attrs,
                                    &g.loc,
                                )[0]
                            }
                        };
                        acc.insert(v, sum);
                    }
                    _ => {
                        last.insert(v, o);
                    }
                }
            }
        }
        Ok(AfterMicroBatches { acc, last, text })
    }

    /// After every micro-batch: the post ops of rank `r`'s stages, then its results. A
    /// value another rank's post op reads (a sum of squares for clipping, its factor) is
    /// sent as soon as it is computed and received right before its first use.
    fn after_micro_batches(
        &self,
        r: usize,
        pg: &mut Graph,
        arg_val: &HashMap<ValueId, ValueId>,
        done: &AfterMicroBatches,
    ) -> Result<(), Diagnostics> {
        let (g, layouts, mbi, mbk) = (self.g, &self.layouts, self.mbi, &self.mbk);
        let n = g.nodes.len();
        let mut map: HashMap<ValueId, ValueId> = HashMap::new();
        let resolve = |v: ValueId, map: &HashMap<ValueId, ValueId>| -> Option<ValueId> {
            map.get(&v)
                .or_else(|| arg_val.get(&v))
                .or_else(|| done.acc.get(&v))
                .or_else(|| done.last.get(&v))
                .copied()
        };
        for k in (0..n).filter(|&k| self.post[k] && self.rank_of(self.stage[k]) == r) {
            let node = &g.nodes[k];
            let mut inputs = Vec::new();
            for &v in &node.inputs {
                let x = match resolve(v, &map) {
                    Some(x) => x,
                    None => {
                        let from = self.producer[v]
                            .filter(|&p| self.post[p] && self.rank_of(self.stage[p]) != r)
                            .map(|p| self.rank_of(self.stage[p]))
                            .ok_or_else(|| {
                                self.fail(
                                    &node.loc,
                                    format!(
                                        "'{}' after the micro-batches reads a value computed per micro-batch on another pipeline rank; that is not supported yet",
                                        node.op
                                    ),
                                )
                            })?;
                        let mut attrs = self.transfer(from, format!("post.v{v}"));
                        attrs.insert("nns.layouts".into(), self.layouts_attr(vec![&layouts[v]]));
                        let got = pg.add_raw(
                            "nns.recv",
                            &[],
                            vec![g.values[v].clone()],
                            attrs,
                            &node.loc,
                        )[0];
                        map.insert(v, got);
                        got
                    }
                };
                inputs.push(x);
            }
            let accumulation = node.op == "nns.relayout"
                && mbk[node.inputs[0]] == Mb::Partial
                && drop_mb(&layouts[node.inputs[0]], mbi) == layouts[node.outputs[0]];
            let outs = if accumulation {
                vec![inputs[0]]
            } else {
                let types = node.outputs.iter().map(|&o| g.values[o].clone()).collect();
                pg.add_raw(&node.op, &inputs, types, node.attrs.clone(), &node.loc)
            };
            for (&o, &n2) in node.outputs.iter().zip(&outs) {
                map.insert(o, n2);
                for &to in self.post_readers.get(&o).map(Vec::as_slice).unwrap_or(&[]) {
                    pg.add_raw(
                        "nns.send",
                        &[n2],
                        vec![],
                        self.transfer(to, format!("post.v{o}")),
                        &node.loc,
                    );
                }
            }
        }
        for (i, o) in g.outputs.iter().enumerate() {
            let mine = match self.value_stage(o.value) {
                Some(s) => self.rank_of(s) == r,
                None => r == 0,
            };
            if !mine {
                continue;
            }
            let v = resolve(o.value, &map).ok_or_else(|| {
                self.fail(
                    &g.loc,
                    format!(
                        "result {i} of @{} is computed per micro-batch; a pipelined step returns only values reduced over the batch (the loss, gradients) or the same in every micro-batch",
                        g.name
                    ),
                )
            })?;
            let mut attrs = o.attrs.clone();
            attrs.insert("nns.result".into(), AttrValue::Int(i as i64));
            pg.outputs.push(Output { value: v, attrs });
        }
        Ok(())
    }
}

/// Checks that the programs' sends and receives cannot deadlock: every receive has one
/// matching send (same tag, from its peer), and the programs' orders plus send → receive
/// edges form no cycle. Sends do not wait.
fn check_deadlock(programs: &[Graph]) -> Result<(), String> {
    use petgraph::graph::DiGraph;
    let mut dg: DiGraph<(usize, usize), ()> = DiGraph::new();
    let mut sends: HashMap<(usize, usize, String), petgraph::graph::NodeIndex> = HashMap::new();
    let mut recvs = Vec::new();
    let describe = |r: usize, k: usize| -> String {
        let n = &programs[r].nodes[k];
        let what = match (n.attrs.get("nns.fragment"), n.attrs.get("tag")) {
            (Some(AttrValue::Str(f)), _) => f.clone(),
            (_, Some(AttrValue::Str(t))) => format!("{} {t}", n.op),
            _ => n.op.to_string(),
        };
        format!("rank {r}: {what}")
    };
    for (r, pg) in programs.iter().enumerate() {
        let mut prev = None;
        for (k, node) in pg.nodes.iter().enumerate() {
            if !matches!(node.op.as_str(), "nns.send" | "nns.recv" | "func.call") {
                continue;
            }
            let me = dg.add_node((r, k));
            if let Some(p) = prev {
                dg.add_edge(p, me, ());
            }
            prev = Some(me);
            let peer = match node.attrs.get("peer") {
                Some(AttrValue::Int(p)) => *p as usize,
                _ => continue,
            };
            let tag = match node.attrs.get("tag") {
                Some(AttrValue::Str(t)) => t.clone(),
                _ => continue,
            };
            if node.op == "nns.send" {
                if sends.insert((r, peer, tag.clone()), me).is_some() {
                    return Err(format!("{} is sent twice", describe(r, k)));
                }
            } else {
                recvs.push((me, peer, r, tag, k));
            }
        }
    }
    for (me, peer, r, tag, k) in recvs {
        let s = sends
            .remove(&(peer, r, tag))
            .ok_or_else(|| format!("{} has no matching send", describe(r, k)))?;
        dg.add_edge(s, me, ());
    }
    if let Some(((r, k), _)) = sends.into_iter().next().map(|(key, ix)| (dg[ix], key)) {
        return Err(format!("{} is never received", describe(r, k)));
    }
    petgraph::algo::toposort(&dg, None).map_err(|c| {
        let (r, k) = dg[c.node_id()];
        format!(
            "the schedule deadlocks: {} waits in a cycle of sends and receives",
            describe(r, k)
        )
    })?;
    Ok(())
}
