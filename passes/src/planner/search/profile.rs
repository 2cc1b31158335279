//! Profiles: each item of a training step (the ops before the layers, each layer, the ops
//! after) compiled for a tensor- and context-parallel degree and a micro-batch, and priced
//! by the cost model (see the module docs of [`super`]).

use super::*;
use nnscaler_dialects::graph::{Node, NodeId, ValueId};

/// One item (a layer, or the ops before or after the layers) of a profile: one device's
/// share at `tp = t` for one micro-batch.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Item {
    /// The layer (`h.3`), or `(before)` / `(after)`.
    pub name: String,
    /// Forward seconds (tensor-parallel collectives included).
    pub fwd: f64,
    /// What each recompute policy runs again in this item's backward, as the step compiled
    /// with it runs it ([`Again`]; indexed in [`Recompute`]'s order: none, selective,
    /// full; none runs nothing again, nor does any policy outside the layers).
    pub again: [Again; 3],
    /// Backward seconds on the path to the input gradient (`B`).
    pub bwd_input: f64,
    /// Backward seconds that only feed weight gradients (`W`).
    pub bwd_weight: f64,
    /// FLOPs of forward and backward.
    pub flops: f64,
    /// Parameter bytes per device.
    pub params: u64,
    /// Parameter tensors: the compiler synchronises (and ZeRO-3 gathers) each one by its
    /// own collective, so each pays the network's latency.
    pub tensors: u64,
    /// The sum of each parameter tensor's bytes squared: `params_sq / params` is the
    /// byte-weighted mean tensor, the message size at which a collective's rate by size
    /// (`cost::Level::rates`) prices their bytes (most of which are in the large ones).
    pub params_sq: f64,
    /// The parameters the backward's fragments read, which ZeRO-3 gathers again there.
    pub backward_reads: BackwardReads,
    /// The gradients as the compiler adds up the micro-batches' pieces ([`score::Tensors`]):
    /// each before its once-a-step reductions, so a gradient that is a partial sum over
    /// `tp` (a row-parallel weight's under sequence parallelism) is added up whole, not
    /// as the shard its parameter is.
    pub accumulated: score::Tensors,
    /// The step's loss when this item computes it ([`score::Tensors`]; none elsewhere):
    /// the compiler adds up the micro-batches' losses and reduces them once a step, over
    /// the plan's `dp` and `loss_group` devices.
    pub loss: score::Tensors,
    /// The devices besides `dp` the loss is reduced over (its partial sums over `tp`).
    pub loss_group: u64,
    /// Gradients this item's backward sends to an item further back than the one before
    /// it (a tied weight's: the language-model head's gradient of the embedding table):
    /// `(item, bytes)`, a message after `B` when that item is on another stage (the one
    /// before is the cut's).
    pub grad_sends: Vec<(usize, u64)>,
    /// Activation bytes kept for backward: no recompute.
    pub saved: u64,
    /// ... selective recompute (outside the layers: `saved`).
    pub saved_selective: u64,
    /// ... full recompute (outside the layers: `saved`).
    pub saved_full: u64,
    /// Bytes a pipeline cut after this item sends forward (and its gradient back).
    pub cut: u64,
    /// Seconds of tensor-parallel collectives (forward and backward; in the times above,
    /// `grad_sync` aside).
    pub comm: f64,
    /// Seconds of the tensor-parallel reductions of its weight gradients (a row-parallel
    /// weight's reduce_scatter, a norm's all_reduce): once a step, after the
    /// micro-batches' partial gradients are added up, as the compiler emits them (not
    /// in `bwd_weight`).
    pub grad_sync: f64,
    /// Seconds of the optimizer update of its parameters (not sharded; in the profile's
    /// `optimizer`).
    pub update: f64,
    /// Of `update`: the ops' fixed costs (a launch each, its kernel entry's fixed part),
    /// which sharding the update over dp (ZeRO) does not shrink.
    pub update_fixed: f64,
}

/// Seconds a recompute policy runs again in an item's backward: the clones `--recompute`
/// makes and the relayouts `--split-tensor` adds for them, in the step compiled with the
/// policy ([`profile_reusing`]), by the fragment they run in. Apart: what runs again only
/// because the next item's backward reads it (a layer's output, which the next layer's
/// backward reads from the clones when the two share a stage, and as the value sent to
/// it when they do not).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Again {
    /// On the input gradient's side (`B`).
    pub b: f64,
    /// What only weight gradients need (`W`).
    pub w: f64,
    /// What only the next item's backward needs, on the `B` side...
    pub next_b: f64,
    /// ... and on the `W` side.
    pub next_w: f64,
}

impl Again {
    /// All of it.
    pub fn seconds(&self) -> f64 {
        self.b + self.w + self.next_b + self.next_w
    }
}

/// The parameters (bytes, tensors, bytes squared: [`score::Tensors`]) that an item's
/// backward fragments read, by recompute policy (`[none, selective, full]`): the compiler
/// gathers a ZeRO-3 parameter right before its first use in every fragment that uses it,
/// so a fragment's gathers are the parameters its ops read. The forward reads every
/// parameter ([`Item::params`]); the backward only some (a linear's input gradient reads
/// its weight, its bias nothing) and the forward ops recompute clones besides.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct BackwardReads {
    /// Read on the input gradient's side (`B` of a split backward).
    pub b: [score::Tensors; 3],
    /// Read by what only weight gradients need (`W` of a split backward).
    pub w: [score::Tensors; 3],
    /// Read by either (an unsplit backward, one fragment).
    pub bw: [score::Tensors; 3],
}

/// A training step's costs at one tensor-parallel degree and micro-batch size.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Profile {
    /// Tensor-parallel degree.
    pub tp: u64,
    /// Sequences per micro-batch.
    pub micro: u64,
    /// The items in program order.
    pub items: Vec<Item>,
    /// Seconds of the optimizer update of every parameter on one device (not sharded).
    pub optimizer: f64,
    /// Of `optimizer`: the ops' fixed costs ([`Item::update_fixed`]).
    pub optimizer_fixed: f64,
    /// Whether the matrix products run in bf16 (the step was cast by `--autocast=bf16`):
    /// they are predicted at the bf16 rate, and MFU is relative to the bf16 peak.
    pub bf16: bool,
    /// How the layers are split over `tp`.
    pub tensor: TpPolicy,
}

/// The module's batch: the leading dim data arguments share (their gcd).
pub fn batch_of(g: &Graph) -> Option<u64> {
    let mut b = 0u64;
    for a in &g.args {
        let ty = &g.values[a.value];
        if a.is_state() || ty.shape.is_empty() || a.attrs.contains_key("nns.layout") {
            continue;
        }
        b = gcd(b, ty.shape[0].max(0) as u64);
    }
    (b > 0).then_some(b)
}

/// The positions of step `g`'s sequences (dim 1 of its `[batch, positions]` token
/// arguments, their gcd), what context parallelism splits; `None` without token
/// arguments (an MLP's `[batch, features]` inputs have no positions).
pub fn positions_of(g: &Graph) -> Option<u64> {
    let mut s = 0u64;
    for a in &g.args {
        let ty = &g.values[a.value];
        if a.is_state()
            || ty.shape.len() < 2
            || ty.elem.is_float()
            || a.attrs.contains_key("nns.layout")
        {
            continue;
        }
        s = gcd(s, ty.shape[1].max(0) as u64);
    }
    (s > 0).then_some(s)
}

/// Positions per device below which the default space does not try a context-parallel
/// degree: the keys' and values' gathers grow against the attention a device keeps.
pub const MIN_POSITIONS_PER_SP: u64 = 1024;

pub(super) fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The first error, located when it has a place (a user's constraint on an op).
pub(super) fn diag_text(d: &Diagnostics) -> String {
    d.0.first().map_or("the passes refused it".into(), |e| {
        if e.loc.line == 0 {
            e.message.clone()
        } else {
            format!("{}: {}", e.loc, e.message)
        }
    })
}

/// How a profile splits the layers over `tp`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TpPolicy {
    /// Megatron-LM's rule (`--plan=dp-megatron`).
    #[default]
    Megatron,
    /// Each op's split searched by Z3 (`--plan=tp-search`, [`crate::planner::split_search`]).
    Search,
    /// Megatron's rule with sequence parallelism over the same `tp` devices
    /// (`--plan=dp-megatron-sp`): norms, residual adds and the embedding on a sequence
    /// shard, all_gather before column-parallel linears and reduce_scatter after
    /// row-parallel ones.
    Sp,
}

impl TpPolicy {
    /// Its `--plan` policy with both axes.
    pub fn policy(self) -> &'static str {
        match self {
            TpPolicy::Megatron => "dp-megatron",
            TpPolicy::Search => "tp-search",
            TpPolicy::Sp => "dp-megatron-sp",
        }
    }
}

impl Profile {
    /// The `--place` layout of a plan's stages: `E` before the layers, `t` a layer, `L`
    /// after them (`None` when the items are not of that form).
    pub fn place_layout(&self, starts: &[usize]) -> Option<String> {
        let code = |name: &str| match name {
            "(before)" => "E",
            "(after)" => "L",
            _ => "t",
        };
        let mut stages = Vec::new();
        for (s, &lo) in starts.iter().enumerate() {
            let hi = starts.get(s + 1).copied().unwrap_or(self.items.len());
            let mut parts: Vec<(String, usize)> = Vec::new();
            for it in &self.items[lo..hi] {
                let c = code(&it.name);
                match parts.last_mut() {
                    Some((last, k)) if last == c => *k += 1,
                    _ => parts.push((c.to_string(), 1)),
                }
            }
            if parts.iter().any(|(c, k)| c != "t" && *k > 1) {
                return None;
            }
            stages.push(
                parts
                    .iter()
                    .map(|(c, k)| {
                        if *k > 1 {
                            format!("{c}*{k}")
                        } else {
                            c.clone()
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(","),
            );
        }
        Some(stages.join("|"))
    }

    /// Seconds of one micro-batch's forward and backward on one device, and the update.
    pub fn seconds(&self) -> f64 {
        self.items
            .iter()
            .map(|i| i.fwd + i.bwd_input + i.bwd_weight)
            .sum::<f64>()
            + self.optimizer
    }
}

/// Compiles training step `g` (single device) for one micro-batch of `micro` sequences at
/// `tp = tp` with Megatron's splits and profiles its per-device program on `cluster`.
pub fn profile(g: &Graph, tp: u64, micro: u64, cluster: &Cluster) -> Result<Profile, String> {
    profile_with(g, tp, micro, cluster, TpPolicy::Megatron)
}

/// [`profile`] with the layers split over `tp` as `tensor` says.
pub fn profile_with(
    g: &Graph,
    tp: u64,
    micro: u64,
    cluster: &Cluster,
    tensor: TpPolicy,
) -> Result<Profile, String> {
    profile_sp(g, tp, 1, micro, cluster, tensor)
}

/// [`profile_with`] with the positions split over `sp` devices (context parallelism).
pub fn profile_sp(
    g: &Graph,
    tp: u64,
    sp: u64,
    micro: u64,
    cluster: &Cluster,
    tensor: TpPolicy,
) -> Result<Profile, String> {
    profile_reusing(g, Degrees { tp, sp, micro }, cluster, tensor, None).map(|(p, _)| p)
}

/// The degrees a profile is compiled at: tensor and context parallelism, sequences per
/// micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Degrees {
    /// Tensor-parallel degree.
    pub tp: u64,
    /// Context-parallel degree (`sp`: the positions over devices of their own).
    pub sp: u64,
    /// Sequences per micro-batch.
    pub micro: u64,
}

/// The mesh a profile of one micro-batch of `micro` sequences at `tp` (and `sp`) compiles
/// on: the batch over `dp = batch / micro`, then `sp` when above 1, then `tp`.
pub(super) fn profile_mesh(g: &Graph, tp: u64, sp: u64, micro: u64) -> Result<Mesh, String> {
    let batch = batch_of(g).ok_or("the step has no batched data argument")?;
    if micro == 0 || !batch.is_multiple_of(micro) {
        return Err(format!(
            "micro-batch {micro} does not divide the batch {batch}"
        ));
    }
    let axis = |name: &str, size: u64| Axis {
        name: name.into(),
        size: size as i64,
        microbatches: false,
    };
    let mut axes = vec![axis("dp", batch / micro)];
    if sp > 1 {
        axes.push(axis("sp", sp));
    }
    axes.push(axis("tp", tp));
    Ok(Mesh {
        name: "world".into(),
        axes,
        memory_cap: None,
    })
}

/// [`profile_with`]; the searched splits take the choices `reuse` names (another micro-batch
/// size's, of the same `tp`) instead of solving again. Returns the searched splits'
/// choices too.
pub(super) fn profile_reusing(
    g: &Graph,
    Degrees { tp, sp, micro }: Degrees,
    cluster: &Cluster,
    tensor: TpPolicy,
    reuse: Option<&[String]>,
) -> Result<(Profile, Option<Vec<String>>), String> {
    let mut labels = None;
    let mesh = profile_mesh(g, tp, sp, micro)?;
    let mut remarks = Diagnostics::default();
    let programs = (|| {
        // The policy the plan's flags apply: no Megatron splits without tensor parallelism;
        // the searched splits as `reuse` names them, else solved (and named in `labels`).
        let mut planned = |g: Graph,
                           reuse: Option<&[String]>|
         -> Result<(Graph, Option<Vec<String>>), Diagnostics> {
            let policy = match (tp, tensor) {
                (1, _) => Policy::Dp,
                (_, TpPolicy::Megatron) => Policy::DpMegatron,
                (_, TpPolicy::Sp) => Policy::DpMegatronSp,
                (_, TpPolicy::Search) => {
                    // The search propagated its plan already (what --propagate-layouts
                    // makes of the directives it writes).
                    let s = crate::planner::split_search::tp_search_reusing(
                        g, &mesh, cluster, "tp", reuse,
                    )?;
                    let labels = Some(s.labels());
                    let g = match s.propagated {
                        Some(p) => p,
                        None => propagate(s.planned, &mesh, &mut remarks)?,
                    };
                    return Ok((g, labels));
                }
            };
            Ok((
                propagate(plan(g, policy, &mesh)?, &mesh, &mut remarks)?,
                None,
            ))
        };
        let compile = |g: Graph| {
            let g = split(g, &mesh)?;
            // Relayouts as `--lower-relayouts cluster=...` makes them for the plan's flags.
            let mut ts = TransitionSearch::priced(Vec::new(), cost::relayout_price(cluster, &mesh));
            let g = lower(g, &mesh, &mut ts)?;
            localize(compact(g), &mesh)
        };
        let (base, chosen) = planned(g.clone(), reuse)?;
        // And with each recompute policy, as the plan's flags run it: `--recompute` before
        // the plan, whose splits the clones share (the searched ones as solved above).
        let mut again = |policy| {
            let (g, _) = planned(recompute(g, policy).0, chosen.as_deref())?;
            compile(g)
        };
        let selective = again(RecomputePolicy::Selective)?;
        let full = again(RecomputePolicy::Full)?;
        labels = chosen;
        Ok::<_, Diagnostics>((compile(base)?, [selective, full]))
    })()
    .map_err(|d| diag_text(&d))?;
    let (local, [selective, full]) = programs;
    let mut p = profile_local(&local, &mesh, tp, micro, cluster);
    for (r, g) in [(1, &selective), (2, &full)] {
        let runs = again_of(g, &mesh, cluster);
        for it in &mut p.items {
            if let Some((again, reads)) = runs.get(&it.name) {
                it.again[r] = *again;
                it.backward_reads.b[r] = reads[0];
                it.backward_reads.w[r] = reads[1];
                it.backward_reads.bw[r] = reads[2];
            }
        }
    }
    p.tensor = if tp == 1 { TpPolicy::Megatron } else { tensor };
    Ok((p, labels))
}

/// What the profile knows of each op of a step: forward or optimizer, its item, and the
/// graph's producers and consumers.
struct OpFacts<'a> {
    g: &'a Graph,
    fwd: &'a [bool],
    opt: &'a [bool],
    item: &'a [usize],
    producer: &'a [Option<NodeId>],
    consumers: &'a [Vec<usize>],
}

/// What [`OpFacts`] borrows, made once for a program: each op forward or optimizer, the
/// producers and consumers, the items ([`assign_items`]).
struct Analysis {
    fwd: Vec<bool>,
    opt: Vec<bool>,
    producer: Vec<Option<NodeId>>,
    consumers: Vec<Vec<usize>>,
    items: Items,
}

impl Analysis {
    fn of(g: &Graph) -> Analysis {
        let fwd = forward_ops(g);
        let layer = layers(g, &fwd);
        let producer = g.producers();
        let opt = optimizer_ops(g, &fwd);
        let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); g.values.len()];
        for (k, node) in g.nodes.iter().enumerate() {
            for &v in &node.inputs {
                consumers[v].push(k);
            }
        }
        let items = assign_items(g, &fwd, &opt, &layer, &producer, &consumers);
        Analysis {
            fwd,
            opt,
            producer,
            consumers,
            items,
        }
    }

    fn facts<'a>(&'a self, g: &'a Graph) -> OpFacts<'a> {
        OpFacts {
            g,
            fwd: &self.fwd,
            opt: &self.opt,
            item: &self.items.item,
            producer: &self.producer,
            consumers: &self.consumers,
        }
    }
}

/// The optimizer ops of `g`: those that depend on optimizer state.
fn optimizer_ops(g: &Graph, fwd: &[bool]) -> Vec<bool> {
    let mut state_dep = vec![false; g.values.len()];
    for a in &g.args {
        if a.attrs.contains_key("nns.state_of") {
            state_dep[a.value] = true;
        }
    }
    let mut opt = vec![false; g.nodes.len()];
    for (k, node) in g.nodes.iter().enumerate() {
        if !fwd[k] && node.inputs.iter().any(|&v| state_dep[v]) {
            opt[k] = true;
            for &o in &node.outputs {
                state_dep[o] = true;
            }
        }
    }
    opt
}

/// B: the backward ops on the path to an earlier item's backward (the input gradient), or
/// that a later item's input gradient needs (a recomputed layer output the next layer's
/// backward reads): as the schedule passes split a stage's backward, what another stage
/// or such an op reads, each item taken for a stage of its own.
fn input_gradient_ops(f: &OpFacts<'_>) -> Vec<bool> {
    let (fwd, opt, item) = (f.fwd, f.opt, f.item);
    let n = f.g.nodes.len();
    let mut is_b = vec![false; n];
    for k in (0..n).rev() {
        if fwd[k] || opt[k] {
            continue;
        }
        is_b[k] = f.g.nodes[k].outputs.iter().any(|&o| {
            f.consumers[o]
                .iter()
                .any(|&c| !fwd[c] && !opt[c] && (item[c] < item[k] || is_b[c]))
        });
    }
    is_b
}

/// Reductions the compiler runs once a step, after adding up the micro-batches' pieces:
/// of weight gradients (backward collectives whose results only the optimizer reads,
/// directly or through other such collectives), and of the loss (a forward collective
/// whose result is only returned).
fn per_step_reductions(f: &OpFacts<'_>) -> Vec<bool> {
    let (fwd, opt) = (f.fwd, f.opt);
    let n = f.g.nodes.len();
    let mut per_step = vec![false; n];
    for k in (0..n).rev() {
        let node = &f.g.nodes[k];
        if opt[k] || !matches!(node.op.as_str(), "nns.all_reduce" | "nns.reduce_scatter") {
            continue;
        }
        per_step[k] = if fwd[k] {
            node.outputs.iter().all(|&o| f.consumers[o].is_empty())
        } else {
            node.outputs.iter().all(|&o| {
                !f.consumers[o].is_empty() && f.consumers[o].iter().all(|&c| opt[c] || per_step[c])
            })
        };
    }
    per_step
}

/// Each item's gradients sent further back than the item before it ([`Item::grad_sends`]):
/// backward values read by a backward op of an item two or more before the one making them.
fn add_grad_sends(f: &OpFacts<'_>, items: &mut [Item]) {
    for (k, node) in f.g.nodes.iter().enumerate() {
        if f.fwd[k] || f.opt[k] {
            continue;
        }
        let from = f.item[k];
        for &o in &node.outputs {
            let mut to: Vec<usize> = f.consumers[o]
                .iter()
                .filter(|&&c| !f.fwd[c] && !f.opt[c] && f.item[c] + 1 < from)
                .map(|&c| f.item[c])
                .collect();
            to.sort_unstable();
            to.dedup();
            for t in to {
                items[from].grad_sends.push((t, f.g.values[o].bytes()));
            }
        }
    }
}

/// Each item's cut (the bytes a cut after it sends: `cut_diff` summed in order); the
/// items before and after the layers (0 and `after`) recompute nothing.
fn set_cuts(items: &mut [Item], cut_diff: &[i128], after: usize) {
    let mut run = 0i128;
    for (i, it) in items.iter_mut().enumerate() {
        run += cut_diff[i];
        it.cut = run.max(0) as u64;
        // `--recompute` recomputes layers only: the ops before and after them keep
        // everything they saved (a language model's logits among them).
        if i == 0 || i == after {
            it.saved_selective = it.saved;
            it.saved_full = it.saved;
        }
    }
}

/// Each parameter's item: `param_item`'s, else (a parameter outside the layers) the item
/// of its first user, at most `after`.
fn params_by_item(
    f: &OpFacts<'_>,
    param_item: &HashMap<ValueId, usize>,
    after: usize,
) -> Vec<(ValueId, usize)> {
    f.g.args
        .iter()
        .filter(|a| a.is_param())
        .map(|a| {
            let it = param_item.get(&a.value).copied().unwrap_or_else(|| {
                f.g.nodes
                    .iter()
                    .position(|x| x.inputs.contains(&a.value))
                    .map_or(0, |k| f.item[k].min(after))
            });
            (a.value, it)
        })
        .collect()
}

/// Each parameter's bytes to its item ([`params_by_item`]).
fn add_params(params: &[(ValueId, usize)], g: &Graph, items: &mut [Item]) {
    for &(v, it) in params {
        let bytes = g.values[v].bytes();
        items[it].params += bytes;
        items[it].tensors += 1;
        items[it].params_sq += (bytes as f64).powi(2);
    }
}

/// The parameters each item's backward fragments read (`[B, W, either]`, as
/// [`BackwardReads`] holds them for one policy), charged to the parameter's item
/// ([`params_by_item`]: the stage whose forward uses it runs the backward of those uses):
/// a parameter read by a backward op on the input gradient's side (`is_b`) or not.
fn reads_by_item(
    f: &OpFacts<'_>,
    params: &[(ValueId, usize)],
    is_b: &[bool],
    items: usize,
) -> Vec<[score::Tensors; 3]> {
    let mut reads: HashMap<ValueId, (bool, bool)> =
        params.iter().map(|&(v, _)| (v, (false, false))).collect();
    for (k, node) in f.g.nodes.iter().enumerate() {
        if f.fwd[k] || f.opt[k] {
            continue;
        }
        for v in &node.inputs {
            if let Some((b, w)) = reads.get_mut(v) {
                if is_b[k] {
                    *b = true;
                } else {
                    *w = true;
                }
            }
        }
    }
    let mut out = vec![[(0, 0, 0.0); 3]; items];
    for &(v, it) in params {
        let (b, w) = reads[&v];
        let bytes = f.g.values[v].bytes();
        for (read, t) in [b, w, b || w].into_iter().zip(out[it].iter_mut()) {
            if read {
                score::add_tensors(t, score::one_tensor(bytes));
            }
        }
    }
    out
}

/// Each item's gradients as the compiler adds up the micro-batches' pieces
/// ([`Item::accumulated`]): the backward values that an optimizer op or a once-a-step
/// reduction ([`per_step_reductions`]) reads, by the item of the op making them.
fn add_accumulated(f: &OpFacts<'_>, per_step: &[bool], items: &mut [Item]) {
    for (k, node) in f.g.nodes.iter().enumerate() {
        if f.fwd[k] || f.opt[k] || per_step[k] {
            continue;
        }
        for &o in &node.outputs {
            if f.consumers[o].iter().any(|&c| f.opt[c] || per_step[c]) {
                let t = &mut items[f.item[k]].accumulated;
                score::add_tensors(t, score::one_tensor(f.g.values[o].bytes()));
            }
        }
    }
}

/// The activations each item saves (per recompute policy), and per item the change of the
/// bytes a cut after it sends (`cut_diff`, summed in order to the cut's bytes).
fn add_saved(f: &OpFacts<'_>, items: &mut [Item]) -> Vec<i128> {
    let mut cut_diff = vec![0i128; items.len() + 1];
    for (k, node) in f.g.nodes.iter().enumerate() {
        if !f.fwd[k] {
            continue;
        }
        let p = f.item[k];
        for &o in &node.outputs {
            let bytes = f.g.values[o].bytes();
            let users = &f.consumers[o];
            let kept = users.iter().any(|&c| !f.fwd[c] && !f.opt[c]);
            if kept {
                items[p].saved += bytes;
                if matches!(node.op.as_str(), "dnn.linear" | "dnn.matmul") {
                    items[p].saved_selective += bytes;
                }
            }
            // Forward users in later items: a cut after p .. before the last sends it;
            // each later item with full recompute keeps it as an input.
            let last = users
                .iter()
                .filter(|&&c| f.fwd[c] && f.item[c] > p)
                .map(|&c| f.item[c])
                .max();
            if let Some(last) = last {
                // Megatron's residual stream runs as a partial sum whose all_reduce feeds
                // the next layer's norm: both reach the next layer, but a pipeline cut
                // there sends one of them (the stage boundary is placed before the
                // partitioning, on the one value the layers pass), so the all_reduce's
                // result adds nothing to a cut its operand crosses.
                let partner_crosses = node.op == "nns.all_reduce"
                    && node.inputs.first().is_some_and(|&i| {
                        f.producer[i].is_some_and(|q| f.fwd[q] && f.item[q] == p)
                            && f.consumers[i].iter().any(|&c| f.fwd[c] && f.item[c] > p)
                    });
                if !partner_crosses {
                    cut_diff[p] += bytes as i128;
                    cut_diff[last] -= bytes as i128;
                }
                let mut seen = Vec::new();
                for &c in users.iter().filter(|&&c| f.fwd[c] && f.item[c] > p) {
                    if !seen.contains(&f.item[c]) {
                        seen.push(f.item[c]);
                        items[f.item[c]].saved_full += bytes;
                        items[f.item[c]].saved_selective += bytes;
                    }
                }
            }
        }
    }
    cut_diff
}

/// Which item each op of a profiled program belongs to ([`assign_items`]).
struct Items {
    /// The items' names: `(before)`, the layers in order, `(after)`.
    names: Vec<String>,
    /// Each op's item (`usize::MAX` for the optimizer's ops).
    item: Vec<usize>,
    /// Each parameter's item, by its value.
    param_item: HashMap<ValueId, usize>,
    /// The index of `(after)`.
    after: usize,
}

/// Whether op `k` of a profiled program is a relayout the compiler added (`--split-tensor`,
/// `--lower-relayouts`), which a pipeline runs on the stage of its earliest user.
fn added_relayout(g: &Graph, k: usize) -> bool {
    g.nodes[k].op.starts_with("nns.")
}

/// Assigns each op to an item as a pipeline stages it (`--place`, then the schedule
/// passes), so that a stage of items costs what the compiled stage does: every forward op
/// to its layer's item (`(before)` ahead of the first layer, `(after)` behind the last);
/// every backward op to the item of the forward op it differentiates (by location, as
/// `--place` stages it), else of a forward operand (a saved activation), else of a
/// parameter operand's layer, else of any operand's op, the loss's seed last; and the
/// relayouts the compiler added, which `--place` never saw, to the item of their earliest
/// user, else their latest producer's (as the schedule passes stage them).
fn assign_items(
    g: &Graph,
    fwd: &[bool],
    opt: &[bool],
    layer: &[Option<String>],
    producer: &[Option<NodeId>],
    consumers: &[Vec<usize>],
) -> Items {
    let n = g.nodes.len();
    // Items: (before), the layers in order, (after).
    let mut names: Vec<String> = vec!["(before)".into()];
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut item = vec![usize::MAX; n];
    let relayout: Vec<bool> = (0..n).map(|k| added_relayout(g, k)).collect();
    for k in 0..n {
        if !fwd[k] || relayout[k] {
            continue;
        }
        item[k] = match &layer[k] {
            Some(l) => *index.entry(l.clone()).or_insert_with(|| {
                names.push(l.clone());
                names.len() - 1
            }),
            None if names.len() == 1 => 0,
            None => usize::MAX - 1,
        };
    }
    let after = names.len();
    names.push("(after)".into());
    for it in item.iter_mut() {
        if *it == usize::MAX - 1 {
            *it = after;
        }
    }
    // Backward ops: the item of a forward operand (a saved activation), else of a
    // parameter operand's layer, else of any operand's op; the loss's seed goes last.
    let param_item: HashMap<ValueId, usize> = g
        .args
        .iter()
        .filter(|a| a.is_param())
        .filter_map(|a| {
            let layer = layer_of_param(a.name()?)?;
            index.get(&layer).map(|&it| (a.value, it))
        })
        .collect();
    let of = differentiated_ops(g, fwd, |k| !relayout[k]);
    for k in 0..n {
        if fwd[k] || opt[k] || relayout[k] {
            continue;
        }
        if let Some(f) = of[k] {
            item[k] = item[f];
            continue;
        }
        let ins = &g.nodes[k].inputs;
        // The latest item among forward operands: an op's saved inputs come from its own
        // layer or earlier ones (a layer's first op reads the previous layer's output).
        let from_fwd = ins
            .iter()
            .filter_map(|&v| producer[v].filter(|&p| fwd[p]).map(|p| item[p]))
            .filter(|&i| i != usize::MAX)
            .max();
        let from_any = ins
            .iter()
            .filter_map(|&v| producer[v].map(|p| item[p]))
            .filter(|&i| i != usize::MAX)
            .min();
        let from_param = ins.iter().filter_map(|v| param_item.get(v).copied()).min();
        item[k] = from_fwd.or(from_param).or(from_any).unwrap_or(after);
    }
    // The relayouts: their earliest user's item, else their latest producer's.
    let pending = |item: &[usize], k: usize| relayout[k] && !opt[k] && item[k] == usize::MAX;
    loop {
        let mut changed = false;
        for k in 0..n {
            if !pending(&item, k) {
                continue;
            }
            let node = &g.nodes[k];
            let from_users = node
                .outputs
                .iter()
                .flat_map(|&o| consumers[o].iter())
                .filter(|&&u| !opt[u] && item[u] != usize::MAX)
                .map(|&u| item[u])
                .min();
            let from_inputs = || {
                node.inputs
                    .iter()
                    .filter_map(|&v| producer[v].map(|p| item[p]))
                    .filter(|&i| i != usize::MAX)
                    .max()
            };
            if let Some(i) = from_users.or_else(from_inputs) {
                item[k] = i;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    for k in 0..n {
        if pending(&item, k) {
            item[k] = after;
        }
    }
    Items {
        names,
        item,
        param_item,
        after,
    }
}

/// A collective over dp and other axes (a replicated weight's gradient, partial over tp
/// under sequence parallelism, reduced over both at once) is the plan's for its dp part
/// and the profile's for the rest: a reduction over the other axes alone. `None` for a
/// collective that is wholly the plan's (or moves nothing without dp); other costs pass
/// through.
fn without_dp_part(
    g: &Graph,
    node: &Node,
    c: cost::NodeCost,
    cluster: &Cluster,
    mesh: &Mesh,
) -> Option<cost::NodeCost> {
    Some(match &c.axes {
        Some(axes) if axes.iter().any(|x| x == "dp") => {
            if !cost::sends_data(&node.op) {
                return None;
            }
            let rest: Vec<String> = axes.iter().filter(|x| *x != "dp").cloned().collect();
            let bytes = |v: Option<&ValueId>| v.map_or(0, |&v| g.values[v].bytes()) as f64;
            let (input, output) = (bytes(node.inputs.first()), bytes(node.outputs.first()));
            let seconds = cost::collective_seconds(cluster, mesh, &node.op, &rest, input, output)?;
            cost::NodeCost {
                seconds,
                group: cost::group_of(mesh, &rest).0,
                axes: Some(rest),
                ..cost::NodeCost::default()
            }
        }
        _ => c,
    })
}

/// What the per-device program `g`, compiled with a recompute policy, runs again in each
/// item's backward (by the item's name): the seconds of its clones (`nns.recompute`) and
/// the relayouts next to them (made from a clone's result, or read only by clones), by
/// fragment and by whether the item's own backward reads them ([`Again`]); and the
/// parameters each item's backward fragments read (`[B, W, either]`), clones included.
fn again_of(
    g: &Graph,
    mesh: &Mesh,
    cluster: &Cluster,
) -> HashMap<String, (Again, [score::Tensors; 3])> {
    let cluster = &cluster.for_program(g);
    let n = g.nodes.len();
    let analysis = Analysis::of(g);
    let facts = analysis.facts(g);
    let OpFacts {
        fwd,
        opt,
        item,
        producer,
        consumers,
        ..
    } = facts;
    let Items {
        names,
        param_item,
        after,
        ..
    } = &analysis.items;
    let is_b = input_gradient_ops(&facts);
    // What recompute added: its clones, and the relayouts made from their results or read
    // by clones alone.
    let mut added: Vec<bool> = g
        .nodes
        .iter()
        .map(|node| node.attrs.contains_key("nns.recompute"))
        .collect();
    loop {
        let mut changed = false;
        for k in 0..n {
            if added[k] || fwd[k] || opt[k] || !added_relayout(g, k) {
                continue;
            }
            let node = &g.nodes[k];
            let from_clone = node
                .inputs
                .iter()
                .any(|&v| producer[v].is_some_and(|p| added[p.index()]));
            let users: Vec<usize> = node
                .outputs
                .iter()
                .flat_map(|&o| consumers[o].iter().copied())
                .collect();
            let for_clones = !users.is_empty() && users.iter().all(|&u| added[u]);
            if from_clone || for_clones {
                added[k] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    // The item an added relayout runs again for: its clone's (a relayout of a layer's
    // recomputed output that the next layer reads is that layer's, not the next one's),
    // else the clones' it feeds.
    let mut item_of = item.to_vec();
    for k in 0..n {
        if added[k] && !g.nodes[k].attrs.contains_key("nns.recompute") {
            if let Some(i) = g.nodes[k]
                .inputs
                .iter()
                .filter_map(|&v| producer[v].filter(|p| added[p.index()]))
                .map(|p| item_of[p.index()])
                .max()
            {
                item_of[k] = i;
            }
        }
    }
    // What the item's own backward reads: an op of the item that recompute did not add,
    // or one it did that the item reads (the rest only the next item's backward reads).
    let mut own = vec![false; n];
    for k in (0..n).rev() {
        if added[k] {
            own[k] = g.nodes[k].outputs.iter().any(|&o| {
                consumers[o]
                    .iter()
                    .any(|&c| !opt[c] && item_of[c] == item_of[k] && (!added[c] || own[c]))
            });
        }
    }
    let mut again = vec![Again::default(); names.len()];
    let mut drift = cost::Drift::default();
    for (k, node) in g.nodes.iter().enumerate() {
        if opt[k] {
            continue;
        }
        let Some(c) = cost::node_cost(g, node, cluster, Some(mesh)) else {
            continue;
        };
        let Some(c) = without_dp_part(g, node, c, cluster, mesh) else {
            continue;
        };
        // (Every collective meets its group: the drift as `predict` charges it.)
        let seconds = drift.charge(&cluster.device, &c);
        if !added[k] {
            continue;
        }
        let a = &mut again[item_of[k]];
        *match (own[k], is_b[k]) {
            (true, true) => &mut a.b,
            (true, false) => &mut a.w,
            (false, true) => &mut a.next_b,
            (false, false) => &mut a.next_w,
        } += seconds;
    }
    let params = params_by_item(&facts, param_item, *after);
    let reads = reads_by_item(&facts, &params, &is_b, names.len());
    names
        .iter()
        .cloned()
        .zip(again.into_iter().zip(reads))
        .collect()
}

/// The profile of a localized per-device program (see the module docs).
pub(super) fn profile_local(
    g: &Graph,
    mesh: &Mesh,
    tp: u64,
    micro: u64,
    cluster: &Cluster,
) -> Profile {
    let cluster = &cluster.for_program(g);
    let analysis = Analysis::of(g);
    let facts = analysis.facts(g);
    let OpFacts { fwd, opt, item, .. } = facts;
    let Items {
        names,
        param_item,
        after,
        ..
    } = &analysis.items;
    let is_b = input_gradient_ops(&facts);
    let per_step = per_step_reductions(&facts);
    let mut items: Vec<Item> = names
        .iter()
        .map(|name| Item {
            name: name.clone(),
            ..Item::default()
        })
        .collect();
    let mut optimizer = 0.0;
    let mut optimizer_fixed = 0.0;
    let mut bf16 = false;
    let mut drift = cost::Drift::default();
    // An optimizer op updates the parameter it reads (or what an update of it made).
    let mut update_of: Vec<Option<usize>> = vec![None; g.values.len()];
    for (&v, &it) in param_item {
        update_of[v] = Some(it);
    }
    for (k, node) in g.nodes.iter().enumerate() {
        if opt[k] {
            let it = node.inputs.iter().find_map(|&v| update_of[v]);
            for &o in &node.outputs {
                update_of[o] = it;
            }
        }
        let Some(c) = cost::node_cost(g, node, cluster, Some(mesh)) else {
            continue;
        };
        bf16 |= c.bf16;
        if fwd[k] && per_step[k] {
            // The loss's reduction: the plan's, once a step, over its dp and these.
            let rest: Vec<String> = c
                .axes
                .iter()
                .flatten()
                .filter(|x| *x != "dp")
                .cloned()
                .collect();
            let it = &mut items[item[k]];
            let bytes = node
                .outputs
                .iter()
                .map(|&o| g.values[o].bytes())
                .sum::<u64>();
            score::add_tensors(&mut it.loss, score::one_tensor(bytes));
            it.loss_group = it.loss_group.max(cost::group_of(mesh, &rest).0);
            continue;
        }
        // Data-parallel collectives are the plan's, not the profile's.
        let Some(c) = without_dp_part(g, node, c, cluster, mesh) else {
            continue;
        };
        if opt[k] {
            // A dnn op's launch (or its kernel entry's fixed part) is paid whatever share
            // of the tensor it updates.
            let fixed = if node.op.starts_with("dnn.") {
                let d = &cluster.device;
                d.kernels
                    .get(node.op.as_str())
                    .map_or(d.op_overhead, |k| k[0])
                    .min(c.seconds)
            } else {
                0.0
            };
            optimizer += c.seconds;
            optimizer_fixed += fixed;
            if let Some(it) = node.inputs.iter().find_map(|&v| update_of[v]) {
                items[it].update += c.seconds;
                items[it].update_fixed += fixed;
            }
            continue;
        }
        // A collective waits for its group's slowest member besides.
        let seconds = drift.charge(&cluster.device, &c);
        let it = &mut items[item[k]];
        if per_step[k] {
            it.grad_sync += seconds;
            continue;
        }
        if c.axes.is_some() {
            it.comm += seconds;
        }
        it.flops += c.flops;
        if fwd[k] {
            it.fwd += seconds;
        } else if is_b[k] {
            it.bwd_input += seconds;
        } else {
            it.bwd_weight += seconds;
        }
    }
    let params = params_by_item(&facts, param_item, *after);
    add_params(&params, g, &mut items);
    for (it, [b, w, bw]) in items
        .iter_mut()
        .zip(reads_by_item(&facts, &params, &is_b, names.len()))
    {
        it.backward_reads = BackwardReads {
            b: [b; 3],
            w: [w; 3],
            bw: [bw; 3],
        };
    }
    add_accumulated(&facts, &per_step, &mut items);
    add_grad_sends(&facts, &mut items);
    let cut_diff = add_saved(&facts, &mut items);
    set_cuts(&mut items, &cut_diff, *after);
    // Items with nothing in them go; the sends' targets are renumbered.
    let kept: Vec<bool> = items
        .iter()
        .map(|it| it.fwd > 0.0 || it.params > 0 || it.bwd_input + it.bwd_weight > 0.0)
        .collect();
    let number: Vec<usize> = kept
        .iter()
        .scan(0, |n, &k| {
            let i = *n;
            *n += usize::from(k);
            Some(i)
        })
        .collect();
    let mut items: Vec<Item> = items
        .into_iter()
        .zip(&kept)
        .filter_map(|(it, &k)| k.then_some(it))
        .collect();
    for it in &mut items {
        for s in &mut it.grad_sends {
            s.0 = number[s.0];
        }
    }
    Profile {
        tp,
        micro,
        items,
        optimizer,
        optimizer_fixed,
        bf16,
        tensor: TpPolicy::Megatron,
    }
}
