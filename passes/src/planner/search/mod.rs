//! The layer-wise plan search: data x context x tensor x pipeline
//! parallelism, micro-batch size and count, pipeline schedule, recompute policy and ZeRO
//! stage, scored
//! by the cost model ([`crate::planner::cost`]) and the schedule simulator ([`crate::planner::schedule`]).
//!
//! **Profiles.** For each tensor-parallel degree `t`, context-parallel degree `s`,
//! micro-batch size `b` ([`Degrees`]) and way of splitting the layers over `tp`
//! ([`TpPolicy`]: Megatron's, Megatron's with sequence parallelism, searched), the
//! training step is compiled for real, graph to graph in memory (`--plan "dp-megatron
//! dp=B/b tp=t"`, `dp-megatron-sp` or `tp-search`, with `sp=s` when `s > 1`;
//! propagation, splitting, relayout lowering, localization),
//! so its per-device program is one micro-batch of `b` sequences at `tp = t`, its
//! positions split `s` ways; and again with each recompute policy (`--recompute` on the
//! planned step, its clones taking their originals' directives). Each op of
//! that program is predicted ([`crate::planner::cost::node_cost`]) and charged to an *item*: the
//! ops before the first layer, each layer (`h.3`, `layers.3`: as `--place` and
//! `--recompute` find them), the ops after the last, as a pipeline stages them (a
//! backward op with the forward op it differentiates, an added relayout with its earliest
//! user). Per item the profile keeps its
//! forward seconds (tensor-parallel collectives included; the tp reductions of weight
//! gradients, which the compiler runs once a step after adding up the micro-batches'
//! partial gradients, apart as `grad_sync`), its backward split as
//! zero-bubble schedules split it (`B`: the ops on the path to the item's input gradient;
//! `W`: the rest, which only feed weight gradients), its parameter bytes per device, the
//! activation bytes it keeps for backward per micro-batch with no, selective (matrix
//! products' results kept, reduced, the rest recomputed) and full recompute (its inputs
//! only; the ops before and after the layers, which `--recompute` leaves alone, keep
//! everything under both), what each recompute policy runs again in its backward (the
//! compiled clones and their relayouts, by fragment, and apart what only the next item's
//! backward reads), and the bytes a pipeline cut after it sends. The optimizer update's seconds are kept whole;
//! data-parallel collectives are left out and costed per plan below. So the profile is
//! exact for the ops and collectives the compiler emits; a few compilations serve the
//! whole space.
//!
//! **Plans.** Devices are numbered `pp` outermost, `dp`, `sp`, then `tp` innermost (tensor
//! parallelism stays inside the innermost network level unless allowed otherwise; `sp`
//! goes up to that level's size by default, across levels beside `tp`). For a
//! plan, the items are cut into contiguous stages (`pp`, or `2 pp` chunks for the
//! interleaved and V schedules): every cut when there are at most [`FEW_CUTS`] ways, else
//! the cut minimising the slowest stage ([`crate::transforms::place`]'s exact dynamic program), the
//! best plans' cuts then moved an item at a time while the simulated step improves.
//! The schedule is simulated with each fragment's predicted time (a
//! stage's items, plus the point-to-point send of the cut at the bandwidth of the level
//! the two devices span, plus under ZeRO-3 the all_gather of its parameters; recompute
//! adds what its clones run to `B` and `W` as the compiled step does, and what only the
//! next item reads where that item shares the stage). The step is the simulated makespan, then the
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

use crate::planner::cost::{self, Cluster};
use crate::planner::layer_runs::Cut;
use crate::planner::policies::{plan, Policy};
use crate::planner::schedule::{self, Action, Kind, ScheduleKind};
use crate::rewrite::compact;
use crate::transforms::localize::localize;
use crate::transforms::lower_relayouts::lower;
use crate::transforms::place::{balanced_partition, differentiated_ops};
use crate::transforms::propagate_layouts::propagate;
use crate::transforms::recompute::{
    forward_ops, layer_of_param, layers, recompute, Policy as RecomputePolicy,
};
use crate::transforms::split_tensor::split;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::{Axis, Mesh};
use nnscaler_dialects::sharding::TransitionSearch;
use nnscaler_dialects::types::AttrValue;
use serde::Serialize;
use std::collections::HashMap;

mod cuts;
mod profile;
mod score;

pub use cuts::*;
pub use profile::*;
pub use score::*;

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
    /// The pipeline schedule (`None` without a pipeline: printed `none`).
    #[serde(serialize_with = "schedule_text")]
    pub schedule: Option<ScheduleKind>,
    /// Recompute policy.
    pub recompute: Recompute,
    /// ZeRO stage.
    pub zero: u8,
    /// The items (of the profile) each stage starts at, `pp x chunks` of them.
    pub stage_starts: Vec<usize>,
    /// How the layers are split over `tp`.
    pub tensor: TpPolicy,
}

/// A plan's schedule as its name, `none` without one (`--json`).
fn schedule_text<S: serde::Serializer>(k: &Option<ScheduleKind>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(k.map_or("none", ScheduleKind::name))
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
    pub fn schedule_name(&self) -> &'static str {
        self.schedule.unwrap_or(ScheduleKind::OneFOneB).name()
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
            s += &format!(
                " schedule={}",
                self.schedule.map_or("none", ScheduleKind::name)
            );
            let ch = chunks(self);
            if self.schedule.is_some_and(|k| ch != k.planned_chunks()) {
                s += &format!(" chunks={ch}");
            }
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
    pub schedules: Vec<ScheduleKind>,
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
    /// step that `--place` cannot stage, [`crate::transforms::place::placeable`]).
    pub pipelines: bool,
    /// Brute force (tests): every contiguous stage cut instead of the dynamic program's,
    /// every plan simulated (no bounds).
    pub exhaustive: bool,
    /// How layers may be split over `tp`: Megatron's rule, with sequence parallelism, and
    /// each op's split searched by Z3 ([`crate::planner::split_search`]).
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
            schedules: vec![
                ScheduleKind::OneFOneB,
                ScheduleKind::Interleaved,
                ScheduleKind::ZbH1,
                ScheduleKind::ZbV,
            ],
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
            schedules: vec![ScheduleKind::OneFOneB, ScheduleKind::Interleaved],
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
                        // A panic compiling one profile is that profile's error (named as
                        // the compiler's fault), not the loss of this worker's others.
                        let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match cut {
                            None => profile_reusing(g, d, cluster, t, reuse.as_deref()),
                            Some(cut) => {
                                if t == TpPolicy::Search && d.tp > 1 && reuse.is_none() {
                                    reuse = profile_mesh(g, d.tp, d.sp, d.micro).ok().and_then(
                                        |mesh| {
                                            crate::planner::split_search::solve_labels(
                                                g, &mesh, cluster, "tp",
                                            )
                                            .ok()
                                        },
                                    );
                                }
                                profile_reusing(&cut.step, d, cluster, t, reuse.as_deref())
                                    .map(|(p, _)| (expand(p, &cut.runs), reuse.clone()))
                            }
                        }))
                        .unwrap_or_else(|e| {
                            let why = e
                                .downcast_ref::<String>()
                                .map(String::as_str)
                                .or_else(|| e.downcast_ref::<&str>().copied())
                                .unwrap_or("a panic");
                            Err(format!(
                                "internal error compiling the profile of micro-batch {}: {why} (a bug in nnscaler; please report it)",
                                d.micro
                            ))
                        });
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
    let cap = cluster.device.memory_limit(space.memory_cap);
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
    let mut found = candidates(
        space,
        cluster,
        profiles,
        batch,
        (max_tp, inner, positions),
        cap,
        &bounds,
    );
    found.list.sort_by(|a, b| a.0.total_cmp(&b.0));
    progress(&format!(
        "{} plans; simulating them in the order of their lower bounds",
        found.list.len()
    ));
    let mut sim = HashMap::new();
    let (mut ranked, simulated) = rank(&mut found, space, cluster, profiles, cap, &mut sim);
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
    let mut out: Vec<(String, usize)> = found.out.into_iter().collect();
    out.sort();
    Ok(Outcome {
        ranked,
        considered: found.considered,
        simulated,
        out,
        least_memory: found.least_memory,
    })
}

/// The simulated schedules' timelines, shared by the plans that have the same.
type Sim = HashMap<String, schedule::Timeline>;

/// What [`search_with`] enumerates before simulating: each plan with its lower bound,
/// how many were considered, the least memory of those out of memory, and why plans
/// were left out (a count by reason).
struct Candidates {
    list: Vec<(f64, Config)>,
    considered: usize,
    least_memory: Option<u64>,
    out: HashMap<String, usize>,
}

/// Every plan of `space` over `batch` whose profile compiled: factorizations (within
/// `max_tp` and the innermost level's `inner` devices, sequences of `positions`),
/// micro-batch sizes, splits, schedules, recompute, stage cuts and ZeRO stages, those
/// whose memory's lower bound exceeds `cap` counted out.
fn candidates(
    space: &Space,
    cluster: &Cluster,
    profiles: &Profiles,
    batch: u64,
    (max_tp, inner, positions): (u64, u64, u64),
    cap: u64,
    bounds: &[StageBound],
) -> Candidates {
    let n = space.devices;
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
            *out.entry("the degrees are fixed (by the module's mesh, or --fix)".into())
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
                    *out.entry("the micro-batches are fixed (by the module's mesh)".into())
                        .or_default() += 1;
                    continue;
                }
                if !space.pipelines && (pp > 1 || m > 1) {
                    *out.entry("pipelines and micro-batches: not in this space".into())
                        .or_default() += 1;
                    continue;
                }
                let schedules: Vec<Option<ScheduleKind>> = if pp == 1 {
                    vec![None]
                } else {
                    space.schedules.iter().copied().map(Some).collect()
                };
                let held = item_bounds(bounds, &prof.items);
                let staged = schedules.iter().flat_map(|&s| {
                    let options = s.map_or(&[1][..], ScheduleKind::chunk_options);
                    options.iter().map(move |&ch| (s, ch))
                });
                for (sched, ch) in staged {
                    let stages = pp as usize * ch;
                    // More chunks than the default only where the items fill them.
                    if sched.is_some_and(|k| ch > k.planned_chunks()) && stages > prof.items.len() {
                        continue;
                    }
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
                                    schedule: sched,
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
    Candidates {
        list: candidates,
        considered,
        least_memory,
        out,
    }
}

/// The plans of `candidates` simulated in the order of their lower bounds, the best
/// `space.keep` kept (each plan once, with its best stage cut; ties to less memory);
/// stops once a bound passes the kept worst. Returns them and how many were simulated;
/// adds the plans that fell out to `found`'s counts.
fn rank(
    found: &mut Candidates,
    space: &Space,
    cluster: &Cluster,
    profiles: &Profiles,
    cap: u64,
    sim: &mut Sim,
) -> (Vec<Estimate>, usize) {
    let candidates = std::mem::take(&mut found.list);
    let mut ranked: Vec<Estimate> = Vec::new();
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
        match score(p, &c, cluster, cap, sim) {
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
            Err(Unscored::OutOfMemory { .. }) => {
                let m = memory_lower_bound(p, &c);
                found.least_memory = Some(found.least_memory.map_or(m, |x| x.min(m)));
                *found.out.entry("out of memory".into()).or_default() += 1;
            }
            Err(Unscored::Other(e)) => {
                *found.out.entry(e).or_default() += 1;
            }
        }
    }
    (ranked, simulated)
}

/// A profile of the cut model as the whole model's: each run's kept second layer repeated
/// for every middle layer it stands for (its optimizer update too).
fn expand(mut p: Profile, runs: &[crate::planner::layer_runs::Run]) -> Profile {
    let mut items = Vec::with_capacity(p.items.len());
    // Each item's index in the whole model (a run's second: its first copy's).
    let mut number = Vec::with_capacity(p.items.len());
    let mut next = 0;
    for it in &p.items {
        number.push(next);
        next += runs
            .iter()
            .find(|r| r.second == it.name)
            .map_or(1, |r| r.names.len());
    }
    for it in &mut p.items {
        for s in &mut it.grad_sends {
            s.0 = number[s.0];
        }
    }
    for it in std::mem::take(&mut p.items) {
        match runs.iter().find(|r| r.second == it.name) {
            Some(r) => {
                p.optimizer += it.update * r.names.len().saturating_sub(1) as f64;
                p.optimizer_fixed += it.update_fixed * r.names.len().saturating_sub(1) as f64;
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
mod tests;
