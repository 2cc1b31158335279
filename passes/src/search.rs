//! The layer-wise plan search (issue 14, second part): data x context x tensor x pipeline
//! parallelism, micro-batch size and count, pipeline schedule, recompute policy and ZeRO
//! stage, scored
//! by the cost model ([`crate::cost`]) and the schedule simulator ([`crate::schedule`]).
//!
//! **Profiles.** For each tensor-parallel degree `t`, context-parallel degree `s`,
//! micro-batch size `b` ([`Degrees`]) and way of splitting the layers over `tp`
//! ([`TpPolicy`]: Megatron's, Megatron's with sequence parallelism, searched), the
//! training step is compiled for real, graph to graph in memory (`--plan "dp-megatron
//! dp=B/b tp=t"`, `dp-megatron-sp` or `tp-search`, with `sp=s` when `s > 1`;
//! propagation, splitting, relayout lowering, localization),
//! so its per-device program is one micro-batch of `b` sequences at `tp = t`, its
//! positions split `s` ways. Each op of
//! that program is predicted ([`crate::cost::node_cost`]) and charged to an *item*: the
//! ops before the first layer, each layer (`h.3`, `layers.3`: as `--place` and
//! `--recompute` find them), the ops after the last. Per item the profile keeps its
//! forward seconds (tensor-parallel collectives included; the tp reductions of weight
//! gradients, which the compiler runs once a step after adding up the micro-batches'
//! partial gradients, apart as `grad_sync`), its backward split as
//! zero-bubble schedules split it (`B`: the ops on the path to the item's input gradient;
//! `W`: the rest, which only feed weight gradients), its parameter bytes per device, the
//! activation bytes it keeps for backward per micro-batch with no, selective (matrix
//! products' results kept, reduced, the rest recomputed) and full recompute (its inputs
//! only; the ops before and after the layers, which `--recompute` leaves alone, keep
//! everything under both), and the bytes a pipeline cut after it sends. The optimizer update's seconds are kept whole;
//! data-parallel collectives are left out and costed per plan below. So the profile is
//! exact for the ops and collectives the compiler emits; a few compilations serve the
//! whole space.
//!
//! **Plans.** Devices are numbered `pp` outermost, `dp`, `sp`, then `tp` innermost (tensor
//! parallelism stays inside the innermost network level unless allowed otherwise; `sp`
//! goes up to that level's size by default, across levels beside `tp`). For a
//! plan, the items are cut into contiguous stages (`pp`, or `2 pp` chunks for the
//! interleaved and V schedules): every cut when there are at most [`FEW_CUTS`] ways, else
//! the cut minimising the slowest stage ([`crate::place`]'s exact dynamic program), the
//! best plans' cuts then moved an item at a time while the simulated step improves.
//! The schedule is simulated with each fragment's predicted time (a
//! stage's items, plus the point-to-point send of the cut at the bandwidth of the level
//! the two devices span, plus under ZeRO-3 the all_gather of its parameters; recompute
//! adds the recomputed forward to `B`, but for what only weight gradients need, which
//! the compiled clones run in `W`). The step is the simulated makespan, then the
//! weight gradients' tp reductions (once) and the gradient synchronisation over `dp` (over `dp x sp`, one group, under context
//! parallelism; all_reduce; ZeRO-1/2: reduce_scatter + all_gather;
//! ZeRO-3: reduce_scatter; one collective per parameter tensor, as the compiler emits
//! them, each paying the network's latency), the adding up of the micro-batches'
//! gradients (one `dnn.add` per tensor per micro-batch after the first) and the optimizer
//! update (over `dp` shards from ZeRO-1 on), of the slowest stage, not overlapped with
//! compute. Memory per device: parameters,
//! gradients and two Adam moments (4 bytes each, sharded over `dp` by the ZeRO stage),
//! plus the stage's saved activations times the micro-batches the simulated schedule
//! keeps in flight on it, plus one item's activations while it is recomputed.
//!
//! **Search.** A plan whose memory lower bound (one micro-batch in flight) exceeds the
//! cap is out unsimulated. Every other plan is given a lower bound on its step (per rank:
//! when its first fragment can start, its work, its synchronisation and update) and plans
//! are simulated in the order of their bounds until the bound passes the `keep`-th best
//! simulated step: exact for the model, in a fraction of the space. Plans whose
//! memory exceeds the device (or `memory_cap`) are out, with their reason.

use crate::cost::{self, Cluster};
use crate::layer_runs::Cut;
use crate::localize::localize;
use crate::lower_relayouts::lower;
use crate::place::balanced_partition;
use crate::policies::{plan, Policy};
use crate::propagate_layouts::propagate;
use crate::recompute::{forward_ops, layer_of_param, layers};
use crate::rewrite::compact;
use crate::schedule::{self, Action, Kind};
use crate::split_tensor::split;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::{self, Axis, Mesh};
use nnscaler_dialects::sharding::TransitionSearch;
use nnscaler_dialects::types::AttrValue;
use serde::Serialize;
use std::collections::HashMap;

/// A recompute policy (see `--recompute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation.
    None,
    /// Recompute all but the matrix products.
    Selective,
    /// Recompute each layer from its inputs.
    Full,
}

impl Recompute {
    /// Its `--recompute` name.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }
}

/// One item (a layer, or the ops before or after the layers) of a profile: one device's
/// share at `tp = t` for one micro-batch.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Item {
    /// The layer (`h.3`), or `(before)` / `(after)`.
    pub name: String,
    /// Forward seconds (tensor-parallel collectives included).
    pub fwd: f64,
    /// Forward seconds of what selective recompute repeats: a layer's ops but its matrix
    /// products and the reduce_scatters of their partial sums, whose results are kept (0
    /// outside the layers, which no policy recomputes).
    pub fwd_selective: f64,
    /// Forward seconds of what full recompute repeats: a layer's whole forward (0 outside
    /// the layers).
    pub fwd_full: f64,
    /// Of `fwd_selective`, what only weight-gradient ops need: the compiled clones run
    /// where the first op needing them does, so these run in `W`, the rest in `B`.
    pub fwd_selective_w: f64,
    /// Of `fwd_full`, what only weight-gradient ops need (in `W`).
    pub fwd_full_w: f64,
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

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The first error, located when it has a place (a user's constraint on an op).
fn diag_text(d: &Diagnostics) -> String {
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
    /// Each op's split searched by Z3 (`--plan=tp-search`, [`crate::split_search`]).
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
fn profile_mesh(g: &Graph, tp: u64, sp: u64, micro: u64) -> Result<Mesh, String> {
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
fn profile_reusing(
    g: &Graph,
    Degrees { tp, sp, micro }: Degrees,
    cluster: &Cluster,
    tensor: TpPolicy,
    reuse: Option<&[String]>,
) -> Result<(Profile, Option<Vec<String>>), String> {
    let mut labels = None;
    let mesh = profile_mesh(g, tp, sp, micro)?;
    let mut remarks = Diagnostics::default();
    let local = (|| {
        // The policy the plan's flags apply: no Megatron splits without tensor parallelism.
        let g = match (tp, tensor) {
            (1, _) => propagate(plan(g.clone(), Policy::Dp, &mesh)?, &mesh, &mut remarks)?,
            (_, TpPolicy::Megatron) => propagate(
                plan(g.clone(), Policy::DpMegatron, &mesh)?,
                &mesh,
                &mut remarks,
            )?,
            (_, TpPolicy::Sp) => propagate(
                plan(g.clone(), Policy::DpMegatronSp, &mesh)?,
                &mesh,
                &mut remarks,
            )?,
            (_, TpPolicy::Search) => {
                // The search propagated its plan already (what --propagate-layouts makes
                // of the directives it writes).
                let s =
                    crate::split_search::tp_search_reusing(g.clone(), &mesh, cluster, "tp", reuse)?;
                labels = Some(s.labels());
                match s.propagated {
                    Some(p) => p,
                    None => propagate(s.planned, &mesh, &mut remarks)?,
                }
            }
        };
        let g = split(g, &mesh)?;
        let g = lower(g, &mesh, &mut TransitionSearch::new())?;
        localize(compact(g), &mesh)
    })()
    .map_err(|d| diag_text(&d))?;
    let mut p = profile_local(&local, &mesh, tp, micro, cluster);
    p.tensor = if tp == 1 { TpPolicy::Megatron } else { tensor };
    Ok((p, labels))
}

/// The profile of a localized per-device program (see the module docs).
fn profile_local(g: &Graph, mesh: &Mesh, tp: u64, micro: u64, cluster: &Cluster) -> Profile {
    let cluster = &cluster.for_program(g);
    let n = g.nodes.len();
    let fwd = forward_ops(g);
    let layer = layers(g, &fwd);
    let mut producer: Vec<Option<usize>> = vec![None; g.values.len()];
    for (k, node) in g.nodes.iter().enumerate() {
        for &o in &node.outputs {
            producer[o] = Some(k);
        }
    }
    // Optimizer ops: those that depend on optimizer state.
    let mut state_dep = vec![false; g.values.len()];
    for a in &g.args {
        if a.attrs.contains_key("nns.state_of") {
            state_dep[a.value] = true;
        }
    }
    let mut opt = vec![false; n];
    for (k, node) in g.nodes.iter().enumerate() {
        if !fwd[k] && node.inputs.iter().any(|&v| state_dep[v]) {
            opt[k] = true;
            for &o in &node.outputs {
                state_dep[o] = true;
            }
        }
    }
    // Items: (before), the layers in order, (after).
    let mut names: Vec<String> = vec!["(before)".into()];
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut item = vec![usize::MAX; n];
    for k in 0..n {
        if !fwd[k] {
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
    let param_item: HashMap<usize, usize> = g
        .args
        .iter()
        .filter(|a| a.is_param())
        .filter_map(|a| {
            let layer = layer_of_param(a.name()?)?;
            index.get(&layer).map(|&it| (a.value, it))
        })
        .collect();
    for k in 0..n {
        if fwd[k] || opt[k] {
            continue;
        }
        let ins = &g.nodes[k].inputs;
        // The latest item among forward operands: an op's saved inputs come from its own
        // layer or earlier ones (a layer's first op reads the previous layer's output).
        let from_fwd = ins
            .iter()
            .filter_map(|&v| producer[v].filter(|&p| fwd[p]).map(|p| item[p]))
            .max();
        let from_any = ins
            .iter()
            .filter_map(|&v| producer[v].map(|p| item[p]))
            .filter(|&i| i != usize::MAX)
            .min();
        let from_param = ins.iter().filter_map(|v| param_item.get(v).copied()).min();
        item[k] = from_fwd.or(from_param).or(from_any).unwrap_or(after);
    }
    // B: backward ops on the path to an earlier item's backward (the input gradient).
    let mut is_b = vec![false; n];
    let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); g.values.len()];
    for (k, node) in g.nodes.iter().enumerate() {
        for &v in &node.inputs {
            consumers[v].push(k);
        }
    }
    for k in (0..n).rev() {
        if fwd[k] || opt[k] {
            continue;
        }
        is_b[k] = g.nodes[k].outputs.iter().any(|&o| {
            consumers[o].iter().any(|&c| {
                !fwd[c] && !opt[c] && (item[c] < item[k] || (item[c] == item[k] && is_b[c]))
            })
        });
    }
    // Reductions of weight gradients: backward collectives whose results only the
    // optimizer reads (directly or through other such collectives). The compiler adds up
    // the micro-batches' partial gradients first and reduces them once a step.
    let mut per_step = vec![false; n];
    for k in (0..n).rev() {
        let node = &g.nodes[k];
        if fwd[k] || opt[k] || !matches!(node.op.as_str(), "nns.all_reduce" | "nns.reduce_scatter")
        {
            continue;
        }
        per_step[k] = node.outputs.iter().all(|&o| {
            !consumers[o].is_empty() && consumers[o].iter().all(|&c| opt[c] || per_step[c])
        });
    }
    // The recomputed forward ops the input gradient's side (`B`) needs: read by a `B`
    // op, or by another such op recomputed in the same item (a clone runs in the
    // fragment of the first op that needs it; one only weight gradients need runs in
    // `W`). Per policy: selective keeps the products and their reduce_scatters.
    let kept_by_selective =
        |op: &str| matches!(op, "dnn.linear" | "dnn.matmul" | "nns.reduce_scatter");
    let b_side = |selective: bool| -> Vec<bool> {
        let mut side = vec![false; n];
        for k in (0..n).rev() {
            if !fwd[k] || (selective && kept_by_selective(&g.nodes[k].op)) {
                continue;
            }
            side[k] = g.nodes[k].outputs.iter().any(|&o| {
                consumers[o].iter().any(|&c| {
                    (!fwd[c] && !opt[c] && is_b[c]) || (fwd[c] && item[c] == item[k] && side[c])
                })
            });
        }
        side
    };
    let (b_selective, b_full) = (b_side(true), b_side(false));
    let mut items: Vec<Item> = names
        .iter()
        .map(|name| Item {
            name: name.clone(),
            ..Item::default()
        })
        .collect();
    let mut optimizer = 0.0;
    let mut bf16 = false;
    let mut drift = cost::Drift::default();
    // An optimizer op updates the parameter it reads (or what an update of it made).
    let mut update_of: Vec<Option<usize>> = vec![None; g.values.len()];
    for (&v, &it) in &param_item {
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
        // Data-parallel collectives are the plan's, not the profile's.
        if c.axes.as_ref().is_some_and(|a| a.iter().any(|x| x == "dp")) {
            continue;
        }
        if opt[k] {
            optimizer += c.seconds;
            if let Some(it) = node.inputs.iter().find_map(|&v| update_of[v]) {
                items[it].update += c.seconds;
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
            it.fwd_full += seconds;
            if !b_full[k] {
                it.fwd_full_w += seconds;
            }
            // What the compiled selective recompute runs again: not the matrix products
            // (their results are kept) nor the reduce_scatters of their partial sums (the
            // recomputed ops start from the scattered values: Megatron-SP's and the
            // searched splits'); Megatron's all_reduces run again with the adds the
            // partial sums flowed through (nanogpt-cpu, counted in the compiled programs).
            if !kept_by_selective(&node.op) {
                it.fwd_selective += seconds;
                if !b_selective[k] {
                    it.fwd_selective_w += seconds;
                }
            }
        } else if is_b[k] {
            it.bwd_input += seconds;
        } else {
            it.bwd_weight += seconds;
        }
    }
    // Parameters.
    for a in g.args.iter().filter(|a| a.is_param()) {
        let it = param_item.get(&a.value).copied().unwrap_or_else(|| {
            // A parameter outside the layers: the item of its first forward user.
            g.nodes
                .iter()
                .position(|x| x.inputs.contains(&a.value))
                .map_or(0, |k| item[k].min(after))
        });
        let bytes = g.values[a.value].bytes();
        items[it].params += bytes;
        items[it].tensors += 1;
        items[it].params_sq += (bytes as f64).powi(2);
    }
    // Saved activations and cuts, from each forward value's producer and users.
    let mut cut_diff = vec![0i128; names.len() + 1];
    for (k, node) in g.nodes.iter().enumerate() {
        if !fwd[k] {
            continue;
        }
        let p = item[k];
        for &o in &node.outputs {
            let bytes = g.values[o].bytes();
            let users = &consumers[o];
            let kept = users.iter().any(|&c| !fwd[c] && !opt[c]);
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
                .filter(|&&c| fwd[c] && item[c] > p)
                .map(|&c| item[c])
                .max();
            if let Some(last) = last {
                // Megatron's residual stream runs as a partial sum whose all_reduce feeds
                // the next layer's norm: both reach the next layer, but a pipeline cut
                // there sends one of them (the stage boundary is placed before the
                // partitioning, on the one value the layers pass), so the all_reduce's
                // result adds nothing to a cut its operand crosses.
                let partner_crosses = node.op == "nns.all_reduce"
                    && node.inputs.first().is_some_and(|&i| {
                        producer[i].is_some_and(|q| fwd[q] && item[q] == p)
                            && consumers[i].iter().any(|&c| fwd[c] && item[c] > p)
                    });
                if !partner_crosses {
                    cut_diff[p] += bytes as i128;
                    cut_diff[last] -= bytes as i128;
                }
                let mut seen = Vec::new();
                for &c in users.iter().filter(|&&c| fwd[c] && item[c] > p) {
                    if !seen.contains(&item[c]) {
                        seen.push(item[c]);
                        items[item[c]].saved_full += bytes;
                        items[item[c]].saved_selective += bytes;
                    }
                }
            }
        }
    }
    let mut run = 0i128;
    for (i, it) in items.iter_mut().enumerate() {
        run += cut_diff[i];
        it.cut = run.max(0) as u64;
        // `--recompute` recomputes layers only: the ops before and after them keep
        // everything they saved (a language model's logits among them).
        if i == 0 || i == after {
            it.fwd_selective = 0.0;
            it.fwd_full = 0.0;
            it.fwd_selective_w = 0.0;
            it.fwd_full_w = 0.0;
            it.saved_selective = it.saved;
            it.saved_full = it.saved;
        }
    }
    items.retain(|it| it.fwd > 0.0 || it.params > 0 || it.bwd_input + it.bwd_weight > 0.0);
    Profile {
        tp,
        micro,
        items,
        optimizer,
        bf16,
        tensor: TpPolicy::Megatron,
    }
}

/// A point in the plan space.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Config {
    /// Data-parallel degree.
    pub dp: u64,
    /// Tensor-parallel degree.
    pub tp: u64,
    /// Context-parallel degree: the positions over `sp` devices (between `dp` and `tp`).
    pub sp: u64,
    /// Pipeline ranks.
    pub pp: u64,
    /// Sequences per micro-batch.
    pub micro: u64,
    /// Micro-batches per step (per data-parallel rank).
    pub microbatches: u64,
    /// The pipeline schedule (`none` without a pipeline).
    pub schedule: String,
    /// Recompute policy.
    pub recompute: Recompute,
    /// ZeRO stage.
    pub zero: u8,
    /// The items (of the profile) each stage starts at, `pp x chunks` of them.
    pub stage_starts: Vec<usize>,
    /// How the layers are split over `tp`.
    pub tensor: TpPolicy,
}

impl Config {
    /// Whether it runs a pipeline schedule (stages or micro-batches).
    pub fn pipelined(&self) -> bool {
        self.pp > 1 || self.microbatches > 1
    }

    /// The `--plan` options that apply it on `cluster` (a preset's name or a TOML file,
    /// for `tp-search`): the policy and its sizes, the pipeline, ZeRO.
    pub fn plan_options(&self, cluster: &str) -> String {
        let mut plan = match (self.dp, self.tp, self.tensor) {
            (_, 1, _) => format!("dp dp={}", self.dp),
            (1, t, TpPolicy::Megatron) => format!("megatron tp={t}"),
            (d, t, TpPolicy::Megatron) => format!("dp-megatron dp={d} tp={t}"),
            (d, t, TpPolicy::Search) => format!("tp-search dp={d} tp={t} cluster={cluster}"),
            (1, t, TpPolicy::Sp) => format!("megatron-sp tp={t}"),
            (d, t, TpPolicy::Sp) => format!("dp-megatron-sp dp={d} tp={t}"),
        };
        if self.sp > 1 {
            plan += &format!(" sp={}", self.sp);
        }
        if self.pipelined() {
            plan += &format!(" pp={} microbatches={}", self.pp, self.microbatches);
        }
        if self.zero > 0 {
            plan += &format!(" zero={}", self.zero);
        }
        plan
    }

    /// The schedule a pipelined plan runs (`1f1b` where the search chose none).
    pub fn schedule_name(&self) -> &str {
        if self.schedule == "none" {
            "1f1b"
        } else {
            &self.schedule
        }
    }

    /// The plan as `nnscaler-opt` options: `--plan` and, for pipelines, `--place`,
    /// `--recompute` and the schedule.
    pub fn describe(&self) -> String {
        let mut s = format!("dp={} ", self.dp);
        if self.sp > 1 {
            s += &format!("sp={} ", self.sp);
        }
        s += &format!(
            "tp={} pp={} micro-batch={}x{}",
            self.tp, self.pp, self.micro, self.microbatches
        );
        if self.pp > 1 {
            s += &format!(" schedule={}", self.schedule);
        }
        s += &format!(" recompute={} zero={}", self.recompute.name(), self.zero);
        if self.tp > 1 && self.tensor == TpPolicy::Search {
            s += " splits=searched";
        }
        if self.tp > 1 && self.tensor == TpPolicy::Sp {
            s += " splits=megatron-sp";
        }
        s
    }
}

/// A scored plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// The plan.
    pub config: Config,
    /// Predicted seconds per step.
    pub seconds: f64,
    /// Of which: the pipeline (or the micro-batches on one stage).
    pub pipeline: f64,
    /// The gradient synchronisation over `dp` (and `sp`), with the tensor-parallel
    /// reductions of weight gradients that run once a step beside it.
    pub dp_sync: f64,
    /// The optimizer update, and the adding up of the micro-batches' gradients before it.
    pub optimizer: f64,
    /// Idle share of the pipeline (bubbles).
    pub bubble: f64,
    /// Peak bytes per device (the fullest device).
    pub memory: u64,
    /// Model FLOPs utilisation of the busiest device.
    pub mfu: f64,
    /// Seconds of the collectives inside the layers per step (the busiest rank's):
    /// tensor parallelism's, and context parallelism's (the keys' and values' gathers,
    /// their gradients' reduce_scatters).
    pub tp_comm: f64,
    /// Seconds of pipeline sends per step (the busiest cut's, both directions).
    pub pp_comm: f64,
    /// Seconds of data-parallel collectives per step: the gradient sync and, under
    /// ZeRO-3, the parameter all_gathers of every forward and backward.
    pub dp_comm: f64,
}

/// What to search.
#[derive(Clone, Debug)]
pub struct Space {
    /// Devices.
    pub devices: u64,
    /// Bytes a device may use (`None`: the device's memory).
    pub memory_cap: Option<u64>,
    /// Degrees the user fixed (a mesh the module declares: its `dp`, `sp`, `tp`, `pp`
    /// axes).
    pub fixed: Vec<(String, u64)>,
    /// Micro-batches per step the user fixed (a mesh the module declares: its micro-batch
    /// axis's size, 1 without one).
    pub microbatches: Option<u64>,
    /// Largest tensor-parallel degree (default: the innermost network level's size).
    pub max_tp: Option<u64>,
    /// Largest context-parallel degree (default: the innermost network level's size, and
    /// at most what leaves [`MIN_POSITIONS_PER_SP`] positions per device; 1: no context
    /// parallelism).
    pub max_sp: Option<u64>,
    /// Largest pipeline degree.
    pub max_pp: Option<u64>,
    /// Largest micro-batch size.
    pub max_micro: u64,
    /// Schedules for pipelines.
    pub schedules: Vec<String>,
    /// Recompute policies.
    pub recompute: Vec<Recompute>,
    /// ZeRO stages.
    pub zero: Vec<u8>,
    /// Megatron's grid instead: uniform layers per stage (the ops before the layers on
    /// the first stage, after them on the last), 1F1B or interleaved, ZeRO 0 or 1.
    pub megatron: bool,
    /// Plans to rank (the search is exact for these).
    pub keep: usize,
    /// Pipelines and micro-batches (`false`: one stage, one micro-batch; for a training
    /// step that `--place` cannot stage, [`crate::place::placeable`]).
    pub pipelines: bool,
    /// Brute force (tests): every contiguous stage cut instead of the dynamic program's,
    /// every plan simulated (no bounds).
    pub exhaustive: bool,
    /// How layers may be split over `tp`: Megatron's rule, with sequence parallelism, and
    /// each op's split searched by Z3 ([`crate::split_search`]).
    pub tensor: Vec<TpPolicy>,
}

impl Space {
    /// Whether the user's fixed degrees allow `dp x sp x tp x pp` (an axis the mesh does
    /// not declare is 1 there: a mesh without `sp` fixes it to 1 when it fixes anything).
    pub fn allows(&self, dp: u64, sp: u64, tp: u64, pp: u64) -> bool {
        let fixed_sp = self
            .fixed
            .iter()
            .find(|(a, _)| a == "sp")
            .map(|(_, n)| *n)
            .unwrap_or(if self.fixed.is_empty() { sp } else { 1 });
        sp == fixed_sp
            && self.fixed.iter().all(|(axis, n)| match axis.as_str() {
                "dp" => dp == *n,
                "tp" => tp == *n,
                "pp" => pp == *n,
                _ => true,
            })
    }

    /// The context-parallel degrees to try beside tensor-parallel degree `tp`, with
    /// `inner` devices in the innermost network level and `positions` per sequence: those
    /// dividing `devices / tp`, at most `max_sp` (default `inner` and `positions /`
    /// [`MIN_POSITIONS_PER_SP`]; `sp x tp` may span levels, the keys' and values' gathers
    /// then costed over the slower links).
    fn sp_degrees(&self, tp: u64, inner: u64, positions: u64) -> Vec<u64> {
        let most = self
            .max_sp
            .unwrap_or_else(|| inner.min(positions / MIN_POSITIONS_PER_SP))
            .max(1);
        divisors(self.devices / tp.max(1))
            .into_iter()
            .filter(|&s| s <= most)
            .collect()
    }

    /// The full space for `devices`.
    pub fn new(devices: u64) -> Self {
        Space {
            devices,
            memory_cap: None,
            fixed: Vec::new(),
            microbatches: None,
            max_tp: None,
            max_sp: None,
            max_pp: None,
            max_micro: 8,
            schedules: ["1f1b", "interleaved", "zb-h1", "zb-v"]
                .map(String::from)
                .to_vec(),
            recompute: vec![Recompute::None, Recompute::Selective, Recompute::Full],
            zero: vec![0, 1, 2, 3],
            megatron: false,
            keep: 20,
            pipelines: true,
            exhaustive: false,
            tensor: vec![TpPolicy::Megatron, TpPolicy::Sp, TpPolicy::Search],
        }
    }

    /// Megatron-LM's grid over the same devices.
    pub fn megatron(devices: u64) -> Self {
        Space {
            schedules: vec!["1f1b".into(), "interleaved".into()],
            recompute: vec![Recompute::None, Recompute::Selective, Recompute::Full],
            zero: vec![0, 1],
            megatron: true,
            tensor: vec![TpPolicy::Megatron, TpPolicy::Sp],
            // Megatron's grid is tp x pp x dp.
            max_sp: Some(1),
            ..Space::new(devices)
        }
    }
}

/// The search's answer.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Outcome {
    /// Plans simulated, best first.
    pub ranked: Vec<Estimate>,
    /// Plans considered.
    pub considered: usize,
    /// Plans simulated (the rest were bounded out).
    pub simulated: usize,
    /// Plans out, with why (one line per reason, with a count).
    pub out: Vec<(String, usize)>,
    /// The fewest bytes per device a plan out of memory needed (at least).
    pub least_memory: Option<u64>,
}

fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|&d| n.is_multiple_of(d)).collect()
}

/// The seconds and bytes of a stage of items `lo..hi` under a recompute policy.
#[derive(Clone, Copy, Debug, Default)]
struct StageCost {
    f: f64,
    b: f64,
    w: f64,
    params: u64,
    tensors: u64,
    params_sq: f64,
    saved: u64,
    /// The largest item's activations while it is recomputed.
    transient: u64,
    flops: f64,
    cut: u64,
    comm: f64,
    grad_sync: f64,
}

fn stage_cost(items: &[Item], r: Recompute) -> StageCost {
    let mut s = StageCost::default();
    for it in items {
        s.f += it.fwd;
        let (again, again_w) = match r {
            Recompute::None => (0.0, 0.0),
            Recompute::Selective => (it.fwd_selective, it.fwd_selective_w),
            Recompute::Full => (it.fwd_full, it.fwd_full_w),
        };
        s.b += it.bwd_input + again - again_w;
        s.w += it.bwd_weight + again_w;
        s.params += it.params;
        s.tensors += it.tensors;
        s.params_sq += it.params_sq;
        s.flops += it.flops;
        s.comm += it.comm;
        s.grad_sync += it.grad_sync;
        match r {
            Recompute::None => s.saved += it.saved,
            // (An item recomputed holds its activations again while its backward runs.)
            Recompute::Selective => {
                s.saved += it.saved_selective.min(it.saved);
                if it.fwd_full > 0.0 {
                    s.transient = s.transient.max(it.saved);
                }
            }
            Recompute::Full => {
                s.saved += it.saved_full.min(it.saved);
                if it.fwd_full > 0.0 {
                    s.transient = s.transient.max(it.saved);
                }
            }
        }
    }
    s.cut = items.last().map_or(0, |it| it.cut);
    s
}

/// Time of `tensors` collectives over a group of `group` devices `stride` apart, `bytes`
/// each in all (one per tensor: each pays the latency, the bytes are paid once, at the
/// rate of the byte-weighted mean tensor, `sq / bytes`, `sq` their bytes squared summed).
fn coll_time(
    cluster: &Cluster,
    op: &str,
    group: u64,
    stride: u64,
    (bytes, tensors, sq): Tensors,
) -> f64 {
    if group < 2 || bytes == 0 {
        return 0.0;
    }
    let n = tensors.max(1) as f64;
    let span = (group - 1) * stride + 1;
    let b = bytes as f64;
    let (operand, result) = match op {
        "nns.all_gather" => (b / group as f64, b),
        "nns.reduce_scatter" => (b, b / group as f64),
        _ => (b, b),
    };
    let sent = nns::sent_bytes(op, group as f64, operand / n, result / n);
    // Each tensor's message is its whole size (an all_gather's result, the others'
    // operand).
    n * cluster.collective_time(op, group, span, sent, sq / b)
}

/// Parameter tensors for their collectives: bytes in all, how many, and each one's bytes
/// squared, summed ([`Item::params_sq`]).
type Tensors = (u64, u64, f64);

/// Chunks (stages per pipeline rank) of a schedule.
fn chunks(schedule: &str) -> u64 {
    if matches!(schedule, "interleaved" | "zb-v") {
        2
    } else {
        1
    }
}

/// Stage starts of `n` items in `stages` runs for Megatron: uniform layers, the ops
/// before and after the layers with the first and last stage (`None` when the layers do
/// not divide).
fn megatron_cut(items: &[Item], stages: usize) -> Option<Vec<usize>> {
    let before = usize::from(items.first().is_some_and(|i| i.name == "(before)"));
    let after = usize::from(items.last().is_some_and(|i| i.name == "(after)"));
    let layers = items.len() - before - after;
    if stages == 0 || layers == 0 || !layers.is_multiple_of(stages) {
        return None;
    }
    let per = layers / stages;
    Some(
        (0..stages)
            .map(|s| if s == 0 { 0 } else { before + s * per })
            .collect(),
    )
}

/// Every way to cut `n` items into `stages` contiguous non-empty runs (their starts).
fn every_cut(n: usize, stages: usize) -> Vec<Vec<usize>> {
    fn go(start: usize, n: usize, left: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if left == 0 {
            if start == n {
                out.push(cur.clone());
            }
            return;
        }
        cur.push(start);
        for next in start + 1..=n - (left - 1) {
            go(next, n, left - 1, cur, out);
        }
        cur.pop();
    }
    let mut out = Vec::new();
    if stages >= 1 && stages <= n {
        go(0, n, stages, &mut Vec::new(), &mut out);
    }
    out
}

/// A user's bound on the pipeline stage of a forward op (`nns.stage_bounds = array<i64:
/// lo, hi>`, or `nns.stage = s` pinning it), by the item the op falls in.
#[derive(Clone, Debug)]
pub struct StageBound {
    /// The item (`h.3`, `(before)`, `(after)`).
    pub item: String,
    /// The stages the op may take, `lo..=hi`.
    pub lo: usize,
    pub hi: usize,
    /// The constraint, located: `'dnn.linear' (m.mlir:12:5) on stages 1..=2`.
    pub what: String,
}

/// The stage bounds and pins on `g`'s forward ops.
pub fn stage_bounds(g: &Graph) -> Vec<StageBound> {
    let fwd = forward_ops(g);
    let layer = layers(g, &fwd);
    let mut seen_layer = false;
    let mut out = Vec::new();
    for (k, n) in g.nodes.iter().enumerate() {
        if !fwd[k] {
            continue;
        }
        let item = match &layer[k] {
            Some(l) => {
                seen_layer = true;
                l.clone()
            }
            None if seen_layer => "(after)".to_string(),
            None => "(before)".to_string(),
        };
        if let Some(AttrValue::Ints(b)) = n.attrs.get("nns.stage_bounds") {
            if let [lo, hi] = b.as_slice() {
                out.push(StageBound {
                    item: item.clone(),
                    lo: (*lo).max(0) as usize,
                    hi: (*hi).max(0) as usize,
                    what: format!("'{}' ({}) on stages {lo}..={hi}", n.op, n.loc),
                });
            }
        }
        if let Some(AttrValue::Int(st)) = n.attrs.get("nns.stage") {
            out.push(StageBound {
                item,
                lo: (*st).max(0) as usize,
                hi: (*st).max(0) as usize,
                what: format!("'{}' ({}) pinned to stage {st}", n.op, n.loc),
            });
        }
    }
    out
}

/// `bounds` by the index of their item in `items` (a bound on an item the profile left
/// out, one with no cost, parameters or backward, binds nothing).
fn item_bounds<'b>(bounds: &'b [StageBound], items: &[Item]) -> Vec<(usize, &'b StageBound)> {
    bounds
        .iter()
        .filter_map(|b| {
            items
                .iter()
                .position(|it| it.name == b.item)
                .map(|i| (i, b))
        })
        .collect()
}

/// Why no cut of `n` items into `stages` contiguous non-empty stages keeps `bounds`: the
/// conflicting constraints (one, or two: stages are non-decreasing over the items and
/// grow by at most one from an item to the next, so a conflict is a cycle through at most
/// two bounds), or `None` when some cut keeps them all.
fn bound_conflict(bounds: &[(usize, &StageBound)], n: usize, stages: usize) -> Option<String> {
    let plural = |k: usize, one: &str| {
        if k == 1 {
            format!("1 {one}")
        } else {
            format!("{k} {one}s")
        }
    };
    for &(i, b) in bounds {
        if b.lo >= stages {
            return Some(format!(
                "stage bounds: {} needs stage {} or later, there {} {}",
                b.what,
                b.lo,
                if stages == 1 { "is" } else { "are" },
                plural(stages, "stage")
            ));
        }
        if b.lo > i {
            return Some(format!(
                "stage bounds: {}, in {}: cannot reach stage {} of {stages}: the stages before it need an item each, and {} before it",
                b.what,
                b.item,
                b.lo,
                match i {
                    0 => "none comes".to_string(),
                    1 => "1 comes".to_string(),
                    _ => format!("{i} come"),
                }
            ));
        }
        if b.hi + (n - 1 - i) < stages - 1 {
            return Some(format!(
                "stage bounds: {}, in {}: cannot stay in stage {} of {stages}: the {} after it {} an item each, and {} after it",
                b.what,
                b.item,
                b.hi,
                plural(stages - 1 - b.hi, "stage"),
                if stages - 1 - b.hi == 1 { "needs" } else { "need" },
                match n - 1 - i {
                    0 => "none comes".to_string(),
                    1 => "1 comes".to_string(),
                    k => format!("{k} come"),
                }
            ));
        }
    }
    for &(i, a) in bounds {
        for &(j, b) in bounds.iter().filter(|(j, _)| *j >= i) {
            if a.lo > b.hi || b.lo > a.hi && i == j {
                return Some(if i == j {
                    format!(
                        "stage bounds: {} and {} conflict: both are in {}, which takes one stage",
                        a.what, b.what, a.item
                    )
                } else {
                    format!(
                        "stage bounds: {} and {} conflict: the second op comes later, in an earlier stage",
                        a.what, b.what
                    )
                });
            }
            if b.lo > a.hi + (j - i) {
                return Some(format!(
                    "stage bounds: {} and {} conflict: {} items apart, they cannot be {} stages apart (stages are contiguous and non-empty)",
                    a.what,
                    b.what,
                    j - i,
                    b.lo - a.hi
                ));
            }
        }
    }
    None
}

/// Whether the cut with stage `starts` puts every bounded item within its bounds.
fn cut_keeps(starts: &[usize], bounds: &[(usize, &StageBound)]) -> bool {
    bounds.iter().all(|&(i, b)| {
        let stage = starts.partition_point(|&s| s <= i) - 1;
        (b.lo..=b.hi).contains(&stage)
    })
}

/// How many of the best plans have their cuts refined.
const REFINED: usize = 3;

/// Below this many ways to cut the items into stages, the search tries them all.
pub const FEW_CUTS: u64 = 64;

/// How many ways there are to cut `n` items into `stages` contiguous non-empty runs:
/// C(n - 1, stages - 1), saturating.
fn cut_count(n: usize, stages: usize) -> u64 {
    if stages == 0 || stages > n {
        return 0;
    }
    let (n, k) = ((n - 1) as u64, (stages - 1) as u64);
    let k = k.min(n - k);
    let mut c: u64 = 1;
    for i in 0..k {
        c = c.saturating_mul(n - i) / (i + 1);
        if c > 1 << 40 {
            return u64::MAX;
        }
    }
    c
}

/// Moves `e`'s stage boundaries one item at a time while the step gets faster (the
/// dynamic program balances the stages' work; the simulated step also counts what
/// crosses each cut and how the schedule orders the fragments). At most `budget` plans
/// are scored.
fn refine(
    p: &Profile,
    mut e: Estimate,
    cluster: &Cluster,
    cap: u64,
    sim: &mut HashMap<String, schedule::Timeline>,
    (budget, bounds): (usize, &[StageBound]),
) -> Estimate {
    let n = p.items.len();
    let bounds = item_bounds(bounds, &p.items);
    let mut tries = 0;
    'improve: loop {
        let starts = e.config.stage_starts.clone();
        for i in 1..starts.len() {
            for delta in [-1i64, 1] {
                let at = starts[i] as i64 + delta;
                let lo = starts[i - 1] as i64;
                let hi = starts.get(i + 1).map_or(n as i64, |&x| x as i64);
                if at <= lo || at >= hi {
                    continue;
                }
                if tries >= budget {
                    break 'improve;
                }
                tries += 1;
                let mut c = e.config.clone();
                c.stage_starts[i] = at as usize;
                if !cut_keeps(&c.stage_starts, &bounds) {
                    continue;
                }
                if let Ok(better) = score(p, &c, cluster, cap, sim) {
                    if better.seconds < e.seconds * (1.0 - 1e-12) {
                        e = better;
                        continue 'improve;
                    }
                }
            }
        }
        break;
    }
    e
}

/// Stage starts minimising the slowest stage (`stages` runs).
fn balanced_cut(
    items: &[Item],
    stages: usize,
    r: Recompute,
    bounds: &[(usize, &StageBound)],
) -> Option<Vec<usize>> {
    if stages > items.len() {
        return None;
    }
    let costs: Vec<f64> = items
        .iter()
        .map(|it| {
            let s = stage_cost(std::slice::from_ref(it), r);
            s.f + s.b + s.w
        })
        .collect();
    let mut allowed = vec![(0, stages - 1); items.len()];
    for &(i, b) in bounds {
        allowed[i] = (allowed[i].0.max(b.lo), allowed[i].1.min(b.hi));
    }
    let of = balanced_partition(&costs, stages, &allowed).ok()?;
    let mut starts = vec![0];
    for k in 1..of.len() {
        if of[k] != of[k - 1] {
            starts.push(k);
        }
    }
    (starts.len() == stages).then_some(starts)
}

/// A verified schedule, or why it cannot be made.
type Made = Result<schedule::Schedule, String>;

thread_local! {
    /// Schedules made and verified, by (name, ranks, micro-batches): a search simulates
    /// each with many stage costs.
    static SCHEDULES: std::cell::RefCell<HashMap<(String, usize, usize), Made>> =
        std::cell::RefCell::new(HashMap::new());
}

/// The stages of plan `c`: their items' costs under its recompute policy.
fn stages_of(p: &Profile, c: &Config) -> Vec<StageCost> {
    let n = c.stage_starts.len();
    (0..n)
        .map(|s| {
            let lo = c.stage_starts[s];
            let hi = c.stage_starts.get(s + 1).copied().unwrap_or(p.items.len());
            let mut st = stage_cost(&p.items[lo..hi], c.recompute);
            // No stage waits for the first stage's input gradient (the model's inputs
            // take none): its whole backward is weight gradients, `W`, as the compiler
            // splits it, none of it `B` on the pipeline's critical path.
            if s == 0 {
                st.w += st.b;
                st.b = 0.0;
            }
            st
        })
        .collect()
}

/// The pipeline rank of each of plan `c`'s stages (one per rank, interleaved chunks
/// `s % pp`, or ZB-V's V).
fn rank_of(c: &Config) -> Vec<usize> {
    let pp = (c.pp as usize).max(1);
    if c.schedule == "zb-v" {
        schedule::v_placement(pp)
    } else {
        (0..c.stage_starts.len()).map(|s| s % pp).collect()
    }
}

/// Bytes of parameters, gradients and the two Adam moments of `params` parameter bytes,
/// sharded over dp by plan `c`'s ZeRO stage.
fn state_bytes(c: &Config, params: u64) -> u64 {
    let shard = |on: bool| if on { params.div_ceil(c.dp) } else { params };
    shard(c.zero >= 3) + shard(c.zero >= 2) + 2 * shard(c.zero >= 1)
}

/// Seconds of the gradient synchronisation of `params` ([`Tensors`]) over dp:
/// all_reduce; ZeRO-1/2: reduce_scatter + all_gather; ZeRO-3: reduce_scatter; one
/// collective per tensor. A split of the positions (sp) leaves weight gradients partial
/// over it as dp's batch does: without ZeRO one all_reduce over dp x sp; with ZeRO (which
/// shards over dp) an all_reduce over sp first, then dp's collectives, as the compiler
/// emits them.
fn sync_time(cluster: &Cluster, c: &Config, params: Tensors) -> f64 {
    let sp = c.sp;
    if c.zero == 0 {
        return coll_time(cluster, "nns.all_reduce", c.dp * sp, c.tp, params);
    }
    let over_sp = coll_time(cluster, "nns.all_reduce", sp, c.tp, params);
    let coll = |op| coll_time(cluster, op, c.dp, sp * c.tp, params);
    over_sp
        + match c.zero {
            1 | 2 => coll("nns.reduce_scatter") + coll("nns.all_gather"),
            _ => coll("nns.reduce_scatter"),
        }
}

/// The gradient sync's expected wait for its slowest member ([`cost::Drift`]): its
/// groups (dp x sp; under ZeRO sp, then dp) have not met since the step began, `since`
/// seconds of compute before (tp's collectives and the pipeline's messages meet other
/// groups). The compiler syncs each of the `tensors` gradients right before its update
/// (and under ZeRO-1/2 gathers it right after), so every later tensor's collectives wait
/// again, for the drift over one tensor's share of the `update` seconds.
fn sync_skew(cluster: &Cluster, c: &Config, since: f64, (tensors, update): (u64, f64)) -> f64 {
    let d = &cluster.device;
    let group = if c.zero == 0 { c.dp * c.sp } else { c.dp };
    let later = tensors.saturating_sub(1) as f64 * d.skew(group, update / tensors.max(1) as f64);
    later
        + if c.zero == 0 {
            d.skew(c.dp * c.sp, since)
        } else {
            d.skew(c.sp, since) + d.skew(c.dp, since)
        }
}

/// Seconds of adding up `microbatches` micro-batches' gradients of `params` (bytes and
/// tensors, [`Tensors`]): the compiled step adds each gradient tensor's pieces one
/// `dnn.add` at a time (`microbatches - 1` adds of each, f32, memory-bound, out of the
/// cache: [`cost::accumulate_seconds`]).
fn accumulate_time(cluster: &Cluster, (bytes, tensors, _): Tensors, microbatches: u64) -> f64 {
    if microbatches <= 1 || tensors == 0 {
        return 0.0;
    }
    let d = &cluster.device;
    let n = tensors as f64;
    let (elems, moved) = (bytes as f64 / 4.0 / n, 3.0 * bytes as f64 / n);
    let one = cost::accumulate_seconds(d, elems, moved);
    (microbatches - 1) as f64 * n * one
}

/// Seconds of the optimizer update of `params` of the profile's parameter bytes (over dp
/// shards from ZeRO-1 on).
fn update_time(p: &Profile, c: &Config, params: u64) -> f64 {
    let total: u64 = p.items.iter().map(|i| i.params).sum::<u64>().max(1);
    p.optimizer * params as f64 / total as f64 / if c.zero >= 1 { c.dp as f64 } else { 1.0 }
}

/// Scores one plan. `Err` says why it is out.
fn score(
    p: &Profile,
    c: &Config,
    cluster: &Cluster,
    cap: u64,
    sim: &mut HashMap<String, schedule::Timeline>,
) -> Result<Estimate, String> {
    let ch = chunks(&c.schedule) as usize;
    let st = stages_of(p, c);
    let stages = st.len();
    let (dp, tp, pp) = (c.dp, c.tp, c.pp as usize);
    // Per-fragment extras: the point-to-point sends (the next pipeline rank is dp x sp x
    // tp devices away), and ZeRO-3's gathers of the stage's parameters.
    let p2p_span = dp * c.sp * tp + 1;
    let gather = |s: &StageCost| {
        if c.zero == 3 && s.tensors > 0 {
            // dp's ranks are sp x tp devices apart. The compiler gathers each parameter
            // right before its first use, so every gather waits for the dp group's
            // slowest, which met at the gather before, a tensor's share of the
            // fragment's compute earlier.
            let n = s.tensors as f64;
            coll_time(
                cluster,
                "nns.all_gather",
                dp,
                c.sp * tp,
                (s.params, s.tensors, s.params_sq),
            ) + n * cluster.device.skew(dp, 0.5 * (s.f + s.b + s.w) / n)
        } else {
            0.0
        }
    };
    let split = matches!(c.schedule.as_str(), "zb-h1" | "zb-v");
    let device_of = rank_of(c);
    let frag = |a: Action| -> f64 {
        let s = &st[a.stage];
        let send = if a.kind == Kind::F && a.stage + 1 < stages {
            cluster.p2p_time(p2p_span, s.cut)
        } else if a.kind == Kind::B && a.stage > 0 {
            cluster.p2p_time(p2p_span, st[a.stage - 1].cut)
        } else {
            0.0
        };
        let work = match a.kind {
            Kind::F => s.f,
            // An unsplit backward does the weight gradients too.
            Kind::B if split => s.b,
            Kind::B => s.b + s.w,
            Kind::W => s.w,
        };
        let wait = crate::timeline::receive_wait(&cluster.device, a, &device_of, work);
        match a.kind {
            Kind::W => work,
            _ => work + send + gather(s) + wait,
        }
    };
    let m = c.microbatches as usize;
    let (makespan, in_flight, bubble, pp_comm) = if pp == 1 && c.schedule == "none" {
        let t = m as f64
            * (frag(Action {
                stage: 0,
                kind: Kind::F,
                mb: 0,
            }) + frag(Action {
                stage: 0,
                kind: Kind::B,
                mb: 0,
            }));
        (t, vec![1.0], 0.0, 0.0)
    } else {
        let key = format!("{c:?}");
        let t = match sim.get(&key) {
            Some(t) => t.clone(),
            None => {
                let s = SCHEDULES.with(|cache| {
                    cache
                        .borrow_mut()
                        .entry((c.schedule.clone(), pp, m))
                        .or_insert_with(|| {
                            let s = schedule::by_name(&c.schedule, pp, m, ch)?;
                            schedule::verify(&s)?;
                            Ok(s)
                        })
                        .clone()
                })?;
                let t = schedule::simulate_verified(&s, &frag)?;
                sim.insert(key, t.clone());
                t
            }
        };
        let sends: f64 = (0..stages.saturating_sub(1))
            .map(|s| 2.0 * cluster.p2p_time(p2p_span, st[s].cut))
            .fold(0.0, f64::max)
            * m as f64;
        (
            t.makespan,
            t.peak_in_flight.clone(),
            t.bubble_ratio(),
            sends,
        )
    };
    let mut sync = 0.0f64;
    let mut opt = 0.0f64;
    let mut memory = 0u64;
    let mut flops = 0.0f64;
    let mut tp_comm = 0.0f64;
    let mut dp_comm = 0.0f64;
    for d in 0..pp.max(1) {
        let mine: Vec<&StageCost> = (0..stages)
            .filter(|&s| device_of[s] == d)
            .map(|s| &st[s])
            .collect();
        let params: u64 = mine.iter().map(|s| s.params).sum();
        let tensors: u64 = mine.iter().map(|s| s.tensors).sum();
        let sq: f64 = mine.iter().map(|s| s.params_sq).sum();
        let saved: u64 = mine.iter().map(|s| s.saved).sum();
        let transient = mine.iter().map(|s| s.transient).max().unwrap_or(0);
        let mem = state_bytes(c, params)
            + (in_flight.get(d).copied().unwrap_or(1.0) * saved as f64).ceil() as u64
            + transient;
        memory = memory.max(mem);
        let update = update_time(p, c, params);
        let dp_sync = sync_time(cluster, c, (params, tensors, sq))
            + if tensors > 0 {
                sync_skew(cluster, c, makespan, (tensors, update))
            } else {
                0.0
            };
        let grad_sync: f64 = mine.iter().map(|s| s.grad_sync).sum();
        sync = sync.max(dp_sync + grad_sync);
        opt = opt.max(update + accumulate_time(cluster, (params, tensors, sq), c.microbatches));
        flops = flops.max(mine.iter().map(|s| s.flops).sum::<f64>() * m as f64);
        tp_comm = tp_comm.max(mine.iter().map(|s| s.comm).sum::<f64>() * m as f64 + grad_sync);
        let gathers: f64 = mine.iter().map(|s| 2.0 * gather(s)).sum::<f64>() * m as f64;
        dp_comm = dp_comm.max(dp_sync + gathers);
    }
    if memory > cap {
        return Err(format!(
            "needs {} per device, more than {}",
            bytes_text(memory),
            bytes_text(cap)
        ));
    }
    let seconds = makespan + sync + opt;
    Ok(Estimate {
        config: c.clone(),
        seconds,
        pipeline: makespan,
        dp_sync: sync,
        optimizer: opt,
        bubble,
        memory,
        mfu: flops / (seconds * cluster.device.matrix_rate(p.bf16)),
        tp_comm,
        pp_comm,
        dp_comm,
    })
}

/// Bytes as `12.3 GiB`.
pub fn bytes_text(b: u64) -> String {
    let b = b as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.1} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", b / (1024.0 * 1024.0))
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b} B")
    }
}

/// A lower bound on a plan's bytes per device: [`score`]'s memory with one micro-batch
/// in flight on each rank (every rank holds at least one between its forward and
/// backward).
fn memory_lower_bound(p: &Profile, c: &Config) -> u64 {
    let rank = rank_of(c);
    let mut per = vec![(0u64, 0u64, 0u64); (c.pp as usize).max(1)];
    for (s, sc) in stages_of(p, c).iter().enumerate() {
        let d = &mut per[rank[s]];
        d.0 += sc.params;
        d.1 = d.1.max(sc.saved);
        d.2 = d.2.max(sc.transient);
    }
    per.iter()
        .map(|&(params, saved, transient)| state_bytes(c, params) + saved + transient)
        .max()
        .unwrap_or(0)
}

/// A lower bound on a plan's step: per rank, the time before its first fragment can
/// start, its work, its synchronisation and update (the makespan is at least any rank's
/// start plus its busy time).
fn lower_bound(p: &Profile, c: &Config, cluster: &Cluster) -> f64 {
    let pp = (c.pp as usize).max(1);
    let rank = rank_of(c);
    let mut work = vec![0.0f64; pp];
    let mut params: Vec<Tensors> = vec![(0, 0, 0.0); pp];
    let mut grad_sync = vec![0.0f64; pp];
    // Rank d holds stages d and later only (one per rank, interleaved d + k pp, V 2 pp -
    // 1 - d), so it starts no earlier than the first micro-batch's forward through
    // stages 0 .. d.
    let mut head = vec![0.0f64; pp];
    let mut before = 0.0;
    for (s, sc) in stages_of(p, c).iter().enumerate() {
        work[rank[s]] += sc.f + sc.b + sc.w;
        grad_sync[rank[s]] += sc.grad_sync;
        params[rank[s]].0 += sc.params;
        params[rank[s]].1 += sc.tensors;
        params[rank[s]].2 += sc.params_sq;
        if s < pp {
            head[s] = before;
            before += sc.f;
        }
    }
    (0..pp)
        .map(|d| {
            head[d]
                + work[d] * c.microbatches as f64
                + grad_sync[d]
                + sync_time(cluster, c, params[d])
                + update_time(p, c, params[d].0)
                + accumulate_time(cluster, params[d], c.microbatches)
        })
        .fold(0.0, f64::max)
}

/// Profiles by (degrees, how the layers are split over `tp`), or why the compiler
/// refused those degrees.
pub type Profiles = HashMap<(Degrees, TpPolicy), Result<Profile, String>>;

/// The key of plan `c`'s profile.
pub fn profile_key(c: &Config) -> (Degrees, TpPolicy) {
    (
        Degrees {
            tp: c.tp,
            sp: c.sp,
            micro: c.micro,
        },
        c.tensor,
    )
}

/// The factorizations `(tp, sp, pp)` of the space's devices to consider (`dp` the rest):
/// `tp` up to `max_tp`, `sp` as [`Space::sp_degrees`] allows.
fn factorizations(
    space: &Space,
    max_tp: u64,
    (inner, positions): (u64, u64),
) -> Vec<(u64, u64, u64)> {
    let n = space.devices;
    let mut out = Vec::new();
    for tp in divisors(n).into_iter().filter(|&t| t <= max_tp) {
        for sp in space.sp_degrees(tp, inner, positions) {
            for pp in divisors(n / tp / sp) {
                out.push((tp, sp, pp));
            }
        }
    }
    out
}

/// The (degrees, splits) profiles a space needs.
fn pairs(space: &Space, batch: u64, max_tp: u64, level: (u64, u64)) -> Vec<(Degrees, TpPolicy)> {
    let mut out = Vec::new();
    for (tp, sp, pp) in factorizations(space, max_tp, level) {
        let dp = space.devices / tp / sp / pp;
        if space.max_pp.is_some_and(|m| pp > m)
            || !batch.is_multiple_of(dp)
            || !space.allows(dp, sp, tp, pp)
        {
            continue;
        }
        for micro in divisors(batch / dp) {
            let single = pp == 1 && micro == batch / dp;
            let wanted = if space.pipelines {
                micro <= space.max_micro
            } else {
                single
            };
            for &t in space.tensor.iter().filter(|&&t| allowed(t, tp)) {
                let key = (Degrees { tp, sp, micro }, t);
                if wanted && !out.contains(&key) {
                    out.push(key);
                }
            }
        }
    }
    out
}

/// Whether splits `t` apply at `tp`: without tensor parallelism there is one way (Megatron's
/// names it).
fn allowed(t: TpPolicy, tp: u64) -> bool {
    tp > 1 || t == TpPolicy::Megatron
}

/// Fills `profiles` with the pairs `space` needs, compiling them on the machine's
/// threads (the cut step's, expanded, when there is one).
fn fill_profiles(
    g: &Graph,
    cut: Option<&Cut>,
    cluster: &Cluster,
    want: &[(Degrees, TpPolicy)],
    profiles: &mut Profiles,
    progress: &mut dyn FnMut(&str),
) {
    let missing: Vec<(Degrees, TpPolicy)> = want
        .iter()
        .copied()
        .filter(|k| !profiles.contains_key(k))
        .collect();
    if missing.is_empty() {
        return;
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(missing.len());
    progress(&format!(
        "compiling {} profiles (tp x sp x micro-batch x splits) on {threads} threads",
        missing.len()
    ));
    // The searched splits are solved once per degree, at its smallest micro-batch; the
    // other sizes of that degree take the same choices (first phase, then the second).
    let mut first: Vec<(Degrees, TpPolicy)> = Vec::new();
    let mut later: Vec<(Degrees, TpPolicy)> = Vec::new();
    let mut sorted = missing.clone();
    sorted.sort_by_key(|&(d, _)| (d.tp, d.sp, d.micro));
    for k in sorted {
        let solved = first
            .iter()
            .any(|f| f.0.tp == k.0.tp && f.0.sp == k.0.sp && f.1 == k.1);
        if k.1 == TpPolicy::Search && solved {
            later.push(k);
        } else {
            first.push(k);
        }
    }
    // The searched splits' solves first (the longest tasks), so that the threads do not
    // wait on one at the end of the phase.
    first.sort_by_key(|&(d, t)| !(t == TpPolicy::Search && d.tp > 1));
    let mut choices: HashMap<(u64, u64), Vec<String>> = HashMap::new();
    for phase in [first, later] {
        let done = compile_profiles(g, cut, cluster, &phase, &choices, threads);
        for ((key, p), labels) in done {
            if let Some(l) = labels {
                choices.entry((key.0.tp, key.0.sp)).or_insert(l);
            }
            profiles.insert(key, p);
        }
    }
}

/// A profile, with the searched splits' choices it took.
type Compiled = (
    ((Degrees, TpPolicy), Result<Profile, String>),
    Option<Vec<String>>,
);

/// Compiles `keys` on `threads` threads, the searched splits reusing `choices` by degrees
/// (tp, sp).
/// With a cut step, it is compiled instead and its profiles expanded; its searched splits
/// are those solved on the whole step (layer positions share choices, so the cut step's
/// classes are the whole step's; their costs count every layer).
fn compile_profiles(
    g: &Graph,
    cut: Option<&Cut>,
    cluster: &Cluster,
    keys: &[(Degrees, TpPolicy)],
    choices: &HashMap<(u64, u64), Vec<String>>,
    threads: usize,
) -> Vec<Compiled> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.min(keys.len()).max(1))
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(d, t)) = keys.get(k) else {
                            break;
                        };
                        let mut reuse = choices.get(&(d.tp, d.sp)).cloned();
                        let done = match cut {
                            None => profile_reusing(g, d, cluster, t, reuse.as_deref()),
                            Some(cut) => {
                                if t == TpPolicy::Search && d.tp > 1 && reuse.is_none() {
                                    reuse = profile_mesh(g, d.tp, d.sp, d.micro).ok().and_then(
                                        |mesh| {
                                            crate::split_search::solve_labels(
                                                g, &mesh, cluster, "tp",
                                            )
                                            .ok()
                                        },
                                    );
                                }
                                profile_reusing(&cut.step, d, cluster, t, reuse.as_deref())
                                    .map(|(p, _)| (expand(p, &cut.runs), reuse))
                            }
                        };
                        mine.push(match done {
                            Ok((p, labels)) => (((d, t), Ok(p)), labels),
                            Err(e) => (((d, t), Err(e)), None),
                        });
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect()
    })
}

/// Searches `space` for training step `g` (single device, with its optimizer) on
/// `cluster`, compiling the profiles it needs into `profiles` (a later search reuses
/// them). `progress` hears what takes time.
pub fn search(
    g: &Graph,
    cluster: &Cluster,
    space: &Space,
    profiles: &mut Profiles,
    progress: &mut dyn FnMut(&str),
) -> Result<Outcome, String> {
    search_with(g, None, cluster, space, profiles, progress)
}

/// [`search`], profiling `cut` (the step with its runs of identical layers cut) in `g`'s
/// stead when given.
pub fn search_with(
    g: &Graph,
    cut: Option<&Cut>,
    cluster: &Cluster,
    space: &Space,
    profiles: &mut Profiles,
    progress: &mut dyn FnMut(&str),
) -> Result<Outcome, String> {
    let batch = batch_of(g).ok_or("the step has no batched data argument to split")?;
    let n = space.devices;
    if n == 0 {
        return Err("devices must be at least 1".into());
    }
    let cap = space
        .memory_cap
        .unwrap_or(cluster.device.memory)
        .min(cluster.device.memory);
    let inner = cluster.network.first().map_or(n, |l| l.devices);
    let max_tp = space.max_tp.unwrap_or(inner);
    let positions = positions_of(g).unwrap_or(1);
    fill_profiles(
        g,
        cut,
        cluster,
        &pairs(space, batch, max_tp, (inner, positions)),
        profiles,
        progress,
    );
    let bounds = stage_bounds(g);
    let mut out: HashMap<String, usize> = HashMap::new();
    let mut candidates: Vec<(f64, Config)> = Vec::new();
    let mut considered = 0usize;
    let mut least_memory: Option<u64> = None;
    // Balanced cuts by profile, stages and recompute: plans of other data-parallel
    // degrees, schedules of as many chunks and ZeRO stages share them.
    type CutKey = (Degrees, TpPolicy, usize, Recompute);
    let mut balanced: HashMap<CutKey, Option<Vec<usize>>> = HashMap::new();
    for (tp, sp, pp) in factorizations(space, max_tp, (inner, positions)) {
        if space.max_pp.is_some_and(|m| pp > m) {
            continue;
        }
        if !space.pipelines && pp > 1 {
            *out.entry("pipelines and micro-batches: not in this space".into())
                .or_default() += 1;
            continue;
        }
        if !space.allows(n / tp / sp / pp, sp, tp, pp) {
            *out.entry("the module's mesh fixes the degrees".into())
                .or_default() += 1;
            continue;
        }
        let dp = n / tp / sp / pp;
        if !batch.is_multiple_of(dp) {
            *out.entry(format!("dp={dp} does not divide the batch {batch}"))
                .or_default() += 1;
            continue;
        }
        for micro in divisors(batch / dp).into_iter().filter(|&b| {
            if space.pipelines {
                b <= space.max_micro
            } else {
                b == batch / dp
            }
        }) {
            for &tensor in space.tensor.iter().filter(|&&t| allowed(t, tp)) {
                let prof = match profiles.get(&(Degrees { tp, sp, micro }, tensor)) {
                    Some(Ok(p)) => p,
                    None => continue,
                    Some(Err(e)) => {
                        let at = if sp > 1 {
                            format!("tp={tp} sp={sp}")
                        } else {
                            format!("tp={tp}")
                        };
                        *out.entry(format!("{at}: {e}")).or_default() += 1;
                        continue;
                    }
                };
                let m = batch / dp / micro;
                if space.microbatches.is_some_and(|f| f != m) {
                    *out.entry("the module's mesh fixes the micro-batches".into())
                        .or_default() += 1;
                    continue;
                }
                if !space.pipelines && (pp > 1 || m > 1) {
                    *out.entry("pipelines and micro-batches: not in this space".into())
                        .or_default() += 1;
                    continue;
                }
                let schedules: Vec<String> = if pp == 1 {
                    vec!["none".into()]
                } else {
                    space.schedules.clone()
                };
                let held = item_bounds(&bounds, &prof.items);
                for sched in &schedules {
                    let stages = (pp * chunks(sched)) as usize;
                    if let Some(why) = bound_conflict(&held, prof.items.len(), stages) {
                        *out.entry(why).or_default() += space.recompute.len();
                        continue;
                    }
                    for &r in &space.recompute {
                        let cuts: Vec<Vec<usize>> = if stages == 1 {
                            vec![vec![0]]
                        } else if space.megatron {
                            megatron_cut(&prof.items, stages).into_iter().collect()
                        } else if space.exhaustive
                            || cut_count(prof.items.len(), stages) <= FEW_CUTS
                        {
                            every_cut(prof.items.len(), stages)
                        } else {
                            balanced
                                .entry((Degrees { tp, sp, micro }, tensor, stages, r))
                                .or_insert_with(|| balanced_cut(&prof.items, stages, r, &held))
                                .clone()
                                .into_iter()
                                .collect()
                        };
                        let all = cuts.len();
                        let cuts: Vec<Vec<usize>> =
                            cuts.into_iter().filter(|c| cut_keeps(c, &held)).collect();
                        if all > 0 && cuts.is_empty() {
                            *out.entry(format!(
                                "{stages} stages{}: no cut keeps the stage bounds",
                                if space.megatron { " cut evenly" } else { "" }
                            ))
                            .or_default() += 1;
                        } else if cuts.is_empty() {
                            *out.entry(format!(
                                "{stages} stages do not cut {} items{}",
                                prof.items.len(),
                                if space.megatron { " evenly" } else { "" }
                            ))
                            .or_default() += 1;
                        }
                        for cut in cuts {
                            for &zero in space.zero.iter().filter(|&&z| dp > 1 || z == 0) {
                                let c = Config {
                                    dp,
                                    tp,
                                    sp,
                                    pp,
                                    micro,
                                    microbatches: m,
                                    schedule: sched.clone(),
                                    recompute: r,
                                    zero,
                                    stage_starts: cut.clone(),
                                    tensor,
                                };
                                considered += 1;
                                let least = memory_lower_bound(prof, &c);
                                if least > cap {
                                    *out.entry("out of memory".into()).or_default() += 1;
                                    least_memory =
                                        Some(least_memory.map_or(least, |m: u64| m.min(least)));
                                    continue;
                                }
                                candidates.push((lower_bound(prof, &c, cluster), c));
                            }
                        }
                    }
                }
            }
        }
    }
    candidates.sort_by(|a, b| a.0.total_cmp(&b.0));
    progress(&format!(
        "{} plans; simulating them in the order of their lower bounds",
        candidates.len()
    ));
    let mut ranked: Vec<Estimate> = Vec::new();
    let mut sim = HashMap::new();
    let mut simulated = 0;
    let keep = space.keep.max(1);
    for (bound, c) in candidates {
        // Exact: nothing whose bound passes the `keep`-th best can enter the ranking.
        let kth = if ranked.len() >= keep {
            ranked[keep - 1].seconds
        } else {
            f64::INFINITY
        };
        if bound > kth && !space.exhaustive {
            break;
        }
        let Some(Ok(p)) = profiles.get(&profile_key(&c)) else {
            continue;
        };
        simulated += 1;
        match score(p, &c, cluster, cap, &mut sim) {
            Ok(e) => {
                // One entry per plan: its best stage cut.
                let same = |x: &Estimate| {
                    Config {
                        stage_starts: Vec::new(),
                        ..x.config.clone()
                    } == Config {
                        stage_starts: Vec::new(),
                        ..e.config.clone()
                    }
                };
                if let Some(k) = ranked.iter().position(same) {
                    if (ranked[k].seconds, ranked[k].memory) <= (e.seconds, e.memory) {
                        continue;
                    }
                    ranked.remove(k);
                }
                // Ties go to the plan with less memory.
                let at = ranked.partition_point(|x| (x.seconds, x.memory) <= (e.seconds, e.memory));
                ranked.insert(at, e);
                ranked.truncate(keep);
            }
            Err(e) => {
                if e.starts_with("needs ") {
                    let m = memory_lower_bound(p, &c);
                    least_memory = Some(least_memory.map_or(m, |x| x.min(m)));
                }
                let reason = if e.starts_with("needs ") {
                    "out of memory".to_string()
                } else {
                    e
                };
                *out.entry(reason).or_default() += 1;
            }
        }
    }
    progress(&format!(
        "{simulated} plans simulated; refining the best plans' stage cuts"
    ));
    // The dynamic program's cuts, refined against the simulator.
    if !space.megatron && !space.exhaustive {
        for e in ranked.iter_mut().take(REFINED) {
            let items = profiles
                .get(&profile_key(&e.config))
                .and_then(|p| p.as_ref().ok());
            let Some(p) = items else { continue };
            let stages = e.config.stage_starts.len();
            if stages > 1 && cut_count(p.items.len(), stages) > FEW_CUTS {
                *e = refine(
                    p,
                    e.clone(),
                    cluster,
                    cap,
                    &mut sim,
                    (2 * stages + 4, &bounds),
                );
            }
        }
        ranked.sort_by(|a, b| {
            (a.seconds, a.memory)
                .partial_cmp(&(b.seconds, b.memory))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
    }
    let mut out: Vec<(String, usize)> = out.into_iter().collect();
    out.sort();
    Ok(Outcome {
        ranked,
        considered,
        simulated,
        out,
        least_memory,
    })
}

/// A profile of the cut model as the whole model's: each run's kept second layer repeated
/// for every middle layer it stands for (its optimizer update too).
fn expand(mut p: Profile, runs: &[crate::layer_runs::Run]) -> Profile {
    let mut items = Vec::with_capacity(p.items.len());
    for it in std::mem::take(&mut p.items) {
        match runs.iter().find(|r| r.second == it.name) {
            Some(r) => {
                p.optimizer += it.update * r.names.len().saturating_sub(1) as f64;
                for name in &r.names {
                    let mut copy = it.clone();
                    copy.name = name.clone();
                    items.push(copy);
                }
            }
            None => items.push(it),
        }
    }
    p.items = items;
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first stage's backward is all weight gradients (`W`): no stage waits for the
    /// model inputs' gradient. The later stages keep their `B`.
    #[test]
    fn the_first_stage_has_no_input_gradient() {
        let items: Vec<Item> = (0..4)
            .map(|i| Item {
                name: format!("i{i}"),
                fwd: 1.0,
                bwd_input: 1.0,
                bwd_weight: 0.5,
                ..Item::default()
            })
            .collect();
        let p = Profile {
            items,
            ..Profile::default()
        };
        let c = Config {
            dp: 1,
            tp: 1,
            sp: 1,
            pp: 2,
            micro: 1,
            microbatches: 2,
            schedule: "zb-h1".into(),
            recompute: Recompute::None,
            zero: 0,
            stage_starts: vec![0, 2],
            tensor: TpPolicy::Megatron,
        };
        let st = stages_of(&p, &c);
        assert_eq!((st[0].f, st[0].b, st[0].w), (2.0, 0.0, 3.0));
        assert_eq!((st[1].f, st[1].b, st[1].w), (2.0, 2.0, 1.0));
    }

    /// Many tensors' collectives pay the rate of the tensors that hold the bytes: one
    /// large tensor and 99 tiny ones at the large one's rate (the byte-weighted mean
    /// size), not at the rate of their average size.
    #[test]
    fn collectives_price_bytes_at_the_weighted_tensor_size() {
        let mut c = cost::preset("cpu").unwrap();
        let l = &mut c.network[0];
        l.latency = 1e-6;
        l.rates
            .insert("nns.all_reduce".into(), vec![[1e3, 1e9], [1e6, 4e9]]);
        let sizes: Vec<f64> = std::iter::once(1e6).chain([10.0; 99]).collect();
        let bytes: f64 = sizes.iter().sum();
        let sq: f64 = sizes.iter().map(|b| b * b).sum();
        let t = coll_time(&c, "nns.all_reduce", 2, 1, (bytes as u64, 100, sq));
        // Two devices: 2 latency steps a tensor, each sends its operand once.
        let want = 100.0 * 2.0 * 1e-6 + bytes / c.network[0].rate("nns.all_reduce", sq / bytes);
        assert!((t - want).abs() < 1e-12, "{t} {want}");
        assert!(c.network[0].rate("nns.all_reduce", sq / bytes) > 3.99e9);
        // The average tensor (10 KB) would have moved at about 2.0 GB/s.
        let average = bytes / 100.0;
        assert!(c.network[0].rate("nns.all_reduce", average) < 2.1e9);
    }

    /// `bound_conflict` says "no conflict" exactly when some cut keeps every bound (brute
    /// force over every cut), on random bounds of up to three ops over up to seven items.
    #[test]
    fn bound_conflicts_equal_brute_force() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % m as u64) as usize
        };
        let mut conflicts = 0;
        for _ in 0..3000 {
            let n = 1 + next(7);
            let stages = 1 + next(n);
            let bounds: Vec<StageBound> = (0..next(4))
                .map(|k| {
                    let lo = next(stages + 1);
                    let hi = lo + next(2);
                    StageBound {
                        item: format!("i{}", next(n)),
                        lo,
                        hi,
                        what: format!("bound {k}"),
                    }
                })
                .collect();
            let items: Vec<Item> = (0..n)
                .map(|i| Item {
                    name: format!("i{i}"),
                    ..Item::default()
                })
                .collect();
            let held = item_bounds(&bounds, &items);
            let some_cut = every_cut(n, stages).iter().any(|c| cut_keeps(c, &held));
            let conflict = bound_conflict(&held, n, stages);
            assert_eq!(
                conflict.is_none(),
                some_cut,
                "n={n} stages={stages} bounds={held:?}: {conflict:?}"
            );
            conflicts += usize::from(conflict.is_some());
            // The dynamic program keeps them too.
            if some_cut {
                let cut = balanced_cut(&items, stages, Recompute::None, &held);
                assert!(cut.is_some_and(|c| cut_keeps(&c, &held)), "{held:?}");
            }
        }
        assert!(conflicts > 300, "too few conflicts drawn: {conflicts}");
        // Two ops of one item with disjoint bounds, and a later op bounded earlier.
        let b = |item: &str, lo, hi, what: &str| StageBound {
            item: item.into(),
            lo,
            hi,
            what: what.into(),
        };
        let items: Vec<Item> = ["i0", "i1", "i2", "i3"]
            .iter()
            .map(|n| Item {
                name: n.to_string(),
                ..Item::default()
            })
            .collect();
        let same = [b("i1", 0, 0, "A"), b("i1", 1, 1, "B")];
        let e = bound_conflict(&item_bounds(&same, &items), 4, 2).unwrap();
        assert!(e.contains("A and B conflict: both are in i1"), "{e}");
        let order = [b("i1", 1, 1, "A"), b("i2", 0, 0, "B")];
        let e = bound_conflict(&item_bounds(&order, &items), 4, 2).unwrap();
        assert!(
            e.contains("the second op comes later, in an earlier stage"),
            "{e}"
        );
    }
}
