//! Pipeline schedules as data: which device runs which fragment of which micro-batch, in
//! what order; the generators of the usual schedules; a verifier (completeness, order, and
//! a deadlock check on the dependency graph with petgraph); and a timeline simulator.
//!
//! A schedule places `stages` pipeline stages on `devices` devices (stage `s` on device
//! `s % devices`: one stage per device, or `stages / devices` chunks per device for the
//! interleaved schedule) and lists, per device, its actions: `F` (forward), `B` (backward:
//! the whole backward, or only the input gradient when the schedule splits it) and `W`
//! (the weight gradient of a split backward). Dependencies: `F(s, i)` after `F(s-1, i)`
//! (its input is sent by the stage before), `B(s, i)` after `B(s+1, i)` (its gradient is
//! sent back) and after `F(s, i)`, `W(s, i)` after `B(s, i)`.
//!
//! The closed forms these generators meet (unit costs tF = tB = tW per stage, no
//! communication time; see `../shared/design/REFERENCES.md`): GPipe and 1F1B idle
//! (p-1)(tF+tB+tW) per device, interleaved with v chunks that divided by v, ZB-H1
//! (p-1)(tF+tB-tW); 1F1B keeps at most min(p-r, m) micro-batches in flight on device r,
//! GPipe m.

use petgraph::algo::toposort;
use petgraph::graph::{DiGraph, NodeIndex};
use std::collections::HashMap;
use std::fmt;

/// What a fragment computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Forward.
    F,
    /// Backward: the whole backward, or (when the schedule splits it) the input gradient.
    B,
    /// Weight gradient (split backward only).
    W,
}

/// One fragment: a kind, a stage and a micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Action {
    /// The pipeline stage.
    pub stage: usize,
    /// What it computes.
    pub kind: Kind,
    /// The micro-batch.
    pub mb: usize,
}

impl Action {
    /// The action a tag such as `1B3` names (`<stage><F|B|W><micro-batch>`, as
    /// [`Action`]'s `Display` writes it and fragments' `nns.fragment` records it).
    pub fn parse(tag: &str) -> Option<Action> {
        let k = tag.find(['F', 'B', 'W'])?;
        let stage = tag[..k].parse().ok()?;
        let mb = tag[k + 1..].parse().ok()?;
        let kind = match &tag[k..k + 1] {
            "F" => Kind::F,
            "B" => Kind::B,
            _ => Kind::W,
        };
        Some(action(stage, kind, mb))
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:?}{}", self.stage, self.kind, self.mb)
    }
}

/// A pipeline schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Its name (`1f1b`, ...).
    pub name: String,
    /// Devices (pipeline ranks).
    pub devices: usize,
    /// Stages (a multiple of `devices`).
    pub stages: usize,
    /// The device of each stage: `s % devices` (one stage per device, or interleaved
    /// chunks), or the V placement of ZB-V (device r holds stages r and 2p - 1 - r).
    pub device_of: Vec<usize>,
    /// Micro-batches.
    pub microbatches: usize,
    /// Whether backward is split into `B` (input gradient) and `W` (weight gradient).
    pub split_backward: bool,
    /// Per device, its actions in order.
    pub actions: Vec<Vec<Action>>,
}

/// The schedules the generators make, and what planners need to know of each without
/// generating its table: the one place schedule names are matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScheduleKind {
    /// Every forward, then every backward.
    GPipe,
    /// One forward, one backward (PipeDream-flush).
    OneFOneB,
    /// 1F1B over `v` chunks (stages) per device, stage `s` on device `s % p`.
    Interleaved,
    /// Zero bubble at 1F1B's memory: the backward split into B and W.
    ZbH1,
    /// Zero bubble with the V placement: two chunks per device, the backward split.
    ZbV,
}

impl ScheduleKind {
    /// Every kind, in the order schedules are listed.
    pub const ALL: [ScheduleKind; 5] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbV,
    ];

    /// Its name (the `--schedule-*` flag's suffix, `schedule=` in plans).
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::ZbV => "zb-v",
        }
    }

    /// The kind named `name`, if there is one.
    pub fn from_name(name: &str) -> Option<ScheduleKind> {
        ScheduleKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The kind named `name`, or an error listing the schedules.
    pub fn parse(name: &str) -> Result<ScheduleKind, String> {
        ScheduleKind::from_name(name).ok_or_else(|| {
            format!(
                "unknown schedule '{name}' (schedules: {})",
                NAMES.join(", ")
            )
        })
    }

    /// Whether its backward is split into `B` (input gradient) and `W` (weight gradient).
    pub fn split_backward(self) -> bool {
        matches!(self, ScheduleKind::ZbH1 | ScheduleKind::ZbV)
    }

    /// The stages per device a planner may choose (the plan search tries each).
    pub fn chunk_options(self) -> &'static [usize] {
        match self {
            // As Megatron-LM's virtual pipeline stages: 2 a rank, or as many as a rank's
            // layers allow (one layer a chunk when a rank holds 3 or 4).
            ScheduleKind::Interleaved => &[2, 3, 4],
            ScheduleKind::ZbV => &[2],
            _ => &[1],
        }
    }

    /// Stages per device by default (interleaved: 2, `--schedule-interleaved`'s `chunks`;
    /// ZB-V: always 2).
    pub fn planned_chunks(self) -> usize {
        match self {
            ScheduleKind::Interleaved | ScheduleKind::ZbV => 2,
            _ => 1,
        }
    }

    /// The device of each of `stages` stages on `p` devices: `s % p`, or ZB-V's V.
    pub fn device_of(self, p: usize, stages: usize) -> Vec<usize> {
        match self {
            ScheduleKind::ZbV => v_placement(p),
            _ => (0..stages).map(|s| s % p.max(1)).collect(),
        }
    }

    /// Micro-batches stage `k` of `p` holds at once over `m`, where the table is not made:
    /// GPipe all of them, ZB-V `p` of each of a device's two stages, the others 1F1B's
    /// `p - k % p`.
    pub fn in_flight_bound(self, p: i64, m: i64, k: i64) -> i64 {
        match self {
            ScheduleKind::GPipe => m,
            ScheduleKind::ZbV => p.min(m),
            _ => (p - k % p).min(m),
        }
    }

    /// Its table for `p` devices, `m` micro-batches and (interleaved) `v` chunks.
    pub fn make(self, p: usize, m: usize, v: usize) -> Result<Schedule, String> {
        match self {
            ScheduleKind::GPipe => gpipe(p, m),
            ScheduleKind::OneFOneB => one_f_one_b(p, m),
            ScheduleKind::Interleaved => interleaved(p, v, m),
            ScheduleKind::ZbH1 => zb_h1(p, m),
            ScheduleKind::ZbV => zb_v(p, m),
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The schedules' names, in [`ScheduleKind::ALL`]'s order.
pub const NAMES: &[&str] = &["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"];

/// The most (stage, micro-batch) pairs a schedule may hold (tables are listed in full).
pub const MAX_FRAGMENTS: usize = 10_000_000;

fn check_sizes(p: usize, m: usize) -> Result<(), String> {
    if p == 0 {
        return Err("a pipeline needs at least one stage".into());
    }
    if m == 0 {
        return Err("a pipeline needs at least one micro-batch".into());
    }
    if p.saturating_mul(m) > MAX_FRAGMENTS {
        return Err(format!(
            "{p} stages x {m} micro-batches is more than the {MAX_FRAGMENTS} fragments a schedule may list"
        ));
    }
    Ok(())
}

fn action(stage: usize, kind: Kind, mb: usize) -> Action {
    Action { stage, kind, mb }
}

/// A schedule with one stage per device, device `r`'s actions from `order(r)`.
fn one_stage_per_device(
    name: &str,
    p: usize,
    m: usize,
    split_backward: bool,
    order: impl Fn(usize) -> Vec<Action>,
) -> Result<Schedule, String> {
    check_sizes(p, m)?;
    Ok(Schedule {
        name: name.into(),
        devices: p,
        stages: p,
        device_of: (0..p).collect(),
        microbatches: m,
        split_backward,
        actions: (0..p).map(order).collect(),
    })
}

/// `warmup` forwards, then one forward and one backward alternately until the forwards
/// are done, then the remaining backwards (`total` of each; `fwd(k)` / `bwd(k)` the k-th).
fn warmup_then_alternate(
    warmup: usize,
    total: usize,
    fwd: impl Fn(usize) -> Action,
    bwd: impl Fn(usize) -> Action,
) -> Vec<Action> {
    let mut a: Vec<Action> = (0..warmup).map(&fwd).collect();
    for k in warmup..total {
        a.push(fwd(k));
        a.push(bwd(k - warmup));
    }
    a.extend((total - warmup..total).map(bwd));
    a
}

/// GPipe: every forward, then every backward.
pub fn gpipe(p: usize, m: usize) -> Result<Schedule, String> {
    one_stage_per_device("gpipe", p, m, false, |r| {
        let f = (0..m).map(|i| action(r, Kind::F, i));
        f.chain((0..m).map(|i| action(r, Kind::B, i))).collect()
    })
}

/// Device r's 1F1B order: min(p-r-1, m) forwards, then one forward and one backward
/// alternately, then the remaining backwards.
fn one_f_one_b_order(p: usize, m: usize, r: usize) -> Vec<Action> {
    warmup_then_alternate(
        (p - r - 1).min(m),
        m,
        |i| action(r, Kind::F, i),
        |i| action(r, Kind::B, i),
    )
}

/// 1F1B (PipeDream-flush), see [`one_f_one_b_order`].
pub fn one_f_one_b(p: usize, m: usize) -> Result<Schedule, String> {
    one_stage_per_device("1f1b", p, m, false, |r| one_f_one_b_order(p, m, r))
}

/// Interleaved 1F1B (Megatron): `v` chunks per device (device r holds stages r, r+p, ...),
/// micro-batches in rounds of p. Needs m to be a multiple of p.
pub fn interleaved(p: usize, v: usize, m: usize) -> Result<Schedule, String> {
    check_sizes(p, m)?;
    if v < 2 {
        return Err("an interleaved schedule needs chunks >= 2 (chunks=1 is 1f1b)".into());
    }
    if !m.is_multiple_of(p) {
        return Err(format!(
            "the interleaved schedule needs the micro-batches ({m}) to be a multiple of the pipeline devices ({p})"
        ));
    }
    if p.saturating_mul(v).saturating_mul(m) > MAX_FRAGMENTS {
        return Err(format!(
            "{p} devices x {v} chunks x {m} micro-batches is more than the {MAX_FRAGMENTS} fragments a schedule may list"
        ));
    }
    let total = m * v;
    // The k-th forward (backward) of a device: micro-batches in groups of p per chunk,
    // backwards through the chunks in reverse.
    let place = |k: usize| (k / (p * v) * p + k % p, (k % (p * v)) / p);
    let actions = (0..p)
        .map(|r| {
            warmup_then_alternate(
                ((v - 1) * p + 2 * (p - 1 - r)).min(total),
                total,
                |k| {
                    let (mb, chunk) = place(k);
                    action(chunk * p + r, Kind::F, mb)
                },
                |k| {
                    let (mb, chunk) = place(k);
                    action((v - 1 - chunk) * p + r, Kind::B, mb)
                },
            )
        })
        .collect();
    Ok(Schedule {
        name: "interleaved".into(),
        devices: p,
        stages: p * v,
        device_of: (0..p * v).map(|k| k % p).collect(),
        microbatches: m,
        split_backward: false,
        actions,
    })
}

/// ZB-H1 (zero bubble, the memory of 1F1B): 1F1B with the backward split into B (input
/// gradient, on the critical path) and W (weight gradient); device r holds r Ws back, which
/// fill the bubbles of its cool-down, and runs the rest at the end.
pub fn zb_h1(p: usize, m: usize) -> Result<Schedule, String> {
    one_stage_per_device("zb-h1", p, m, true, |r| {
        let mut a = Vec::new();
        let (mut b, mut w) = (0, 0);
        for x in one_f_one_b_order(p, m, r) {
            a.push(x);
            if x.kind == Kind::B {
                b += 1;
                if b > r {
                    a.push(action(r, Kind::W, w));
                    w += 1;
                }
            }
        }
        a.extend((w..m).map(|i| action(r, Kind::W, i)));
        a
    })
}

/// The V placement: device `r` holds stages `r` and `2p - 1 - r`.
pub fn v_placement(p: usize) -> Vec<usize> {
    (0..2 * p)
        .map(|s| if s < p { s } else { 2 * p - 1 - s })
        .collect()
}

/// ZB-V (zero bubble with the V placement, the memory of 1F1B): 2p stages, device r holds
/// stages r (chunk 0) and 2p - 1 - r (chunk 1), the backward split into B and W. Per
/// device: 2(p - r) - 1 forwards of chunk 0, then r pairs of forwards (chunk 1, chunk 0),
/// p - r rounds of chunk 1's F, B, W, then steady rounds of chunk 0's F, B, W and chunk 1's
/// F, B, W, a cool-down of Bs (r pairs, then chunk 0's B and W), the remaining Ws. Planned
/// for max(2p - 1, m) micro-batches, those past m dropped.
pub fn zb_v(p: usize, m: usize) -> Result<Schedule, String> {
    check_sizes(p, m)?;
    if p.saturating_mul(2).saturating_mul(m) > MAX_FRAGMENTS {
        return Err(format!(
            "{p} devices x 2 chunks x {m} micro-batches is more than the {MAX_FRAGMENTS} fragments a schedule may list"
        ));
    }
    let n = (2 * p - 1).max(m);
    let actions = (0..p)
        .map(|r| {
            let (c0, c1) = (r, 2 * p - 1 - r);
            let mut a = Vec::new();
            let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
            for _ in 0..2 * (p - r) - 1 {
                a.push(action(c0, Kind::F, f0));
                f0 += 1;
            }
            for _ in 0..r {
                a.push(action(c1, Kind::F, f1));
                f1 += 1;
                a.push(action(c0, Kind::F, f0));
                f0 += 1;
            }
            for _ in 0..p - r {
                a.push(action(c1, Kind::F, f1));
                f1 += 1;
                a.push(action(c1, Kind::B, b1));
                a.push(action(c1, Kind::W, b1));
                b1 += 1;
            }
            while f1 < f0 || f0 < n {
                if f0 < n {
                    a.push(action(c0, Kind::F, f0));
                    f0 += 1;
                }
                a.push(action(c0, Kind::B, b0));
                a.push(action(c0, Kind::W, b0));
                b0 += 1;
                a.push(action(c1, Kind::F, f1));
                f1 += 1;
                a.push(action(c1, Kind::B, b1));
                a.push(action(c1, Kind::W, b1));
                b1 += 1;
            }
            let (mut w0, w1) = (b0, b1);
            for _ in 0..r {
                a.push(action(c0, Kind::B, b0));
                b0 += 1;
                a.push(action(c1, Kind::B, b1));
                b1 += 1;
            }
            for _ in 0..p - r {
                a.push(action(c0, Kind::B, b0));
                b0 += 1;
                a.push(action(c0, Kind::W, w0));
                w0 += 1;
            }
            a.extend((w1..b1).map(|i| action(c1, Kind::W, i)));
            a.extend((w0..b0).map(|i| action(c0, Kind::W, i)));
            a.retain(|x| x.mb < m);
            a
        })
        .collect();
    Ok(Schedule {
        name: "zb-v".into(),
        devices: p,
        stages: 2 * p,
        device_of: v_placement(p),
        microbatches: m,
        split_backward: true,
        actions,
    })
}

/// The schedule called `name` for `p` devices, `m` micro-batches and (interleaved) `v`
/// chunks.
pub fn by_name(name: &str, p: usize, m: usize, v: usize) -> Result<Schedule, String> {
    ScheduleKind::parse(name)?.make(p, m, v)
}

/// A schedule as a text table: one line per device, its actions separated by spaces,
/// `<stage><F|B|W><micro-batch>` (`0F0 0F1 0B0 ...`). Lines starting with `#` are
/// comments.
pub fn to_text(s: &Schedule) -> String {
    let mut out = format!(
        "# {}: {} devices, {} stages, {} micro-batches\n",
        s.name, s.devices, s.stages, s.microbatches
    );
    for a in &s.actions {
        let items: Vec<String> = a.iter().map(Action::to_string).collect();
        out.push_str(&items.join(" "));
        out.push('\n');
    }
    out
}

/// Reads a schedule table (see [`to_text`]): one line per device. Stages and
/// micro-batches are inferred (the largest seen, plus one); the backward is split when a
/// `W` appears. Errors name the line and the item.
pub fn parse_text(text: &str, file: &str) -> Result<Schedule, String> {
    let mut actions = Vec::new();
    let (mut stages, mut mbs, mut split) = (0, 0, false);
    for (ln, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut dev = Vec::new();
        for item in line.split_whitespace() {
            let bad = || {
                format!(
                    "{file}:{}: '{item}' is not an action (write <stage><F|B|W><micro-batch>, e.g. 0F1)",
                    ln + 1
                )
            };
            let a = Action::parse(item).ok_or_else(bad)?;
            split |= a.kind == Kind::W;
            stages = stages.max(a.stage + 1);
            mbs = mbs.max(a.mb + 1);
            dev.push(a);
        }
        actions.push(dev);
    }
    if actions.is_empty() {
        return Err(format!("{file}: the schedule lists no device"));
    }
    // Each stage's device is the line it appears on (the same for all its actions).
    let mut device_of: Vec<Option<usize>> = vec![None; stages];
    for (d, acts) in actions.iter().enumerate() {
        for a in acts {
            match device_of[a.stage] {
                None => device_of[a.stage] = Some(d),
                Some(e) if e != d => {
                    return Err(format!(
                    "{file}: stage {} appears on devices {e} and {d}; a stage runs on one device",
                    a.stage
                ))
                }
                _ => {}
            }
        }
    }
    let device_of: Vec<usize> = device_of
        .into_iter()
        .enumerate()
        .map(|(s, d)| d.ok_or(format!("{file}: stage {s} appears on no device")))
        .collect::<Result<_, _>>()?;
    Ok(Schedule {
        name: file.to_string(),
        devices: actions.len(),
        device_of,
        stages,
        microbatches: mbs,
        split_backward: split,
        actions,
    })
}

/// The actions a fragment waits for (on any device), without allocating.
fn deps_of(a: Action, stages: usize) -> [Option<Action>; 2] {
    match a.kind {
        Kind::F if a.stage > 0 => [Some(action(a.stage - 1, Kind::F, a.mb)), None],
        Kind::F => [None, None],
        Kind::B if a.stage + 1 < stages => [
            Some(action(a.stage + 1, Kind::B, a.mb)),
            Some(action(a.stage, Kind::F, a.mb)),
        ],
        Kind::B => [Some(action(a.stage, Kind::F, a.mb)), None],
        Kind::W => [Some(action(a.stage, Kind::B, a.mb)), None],
    }
}

/// The actions a fragment waits for (on any device).
fn deps(a: Action, stages: usize) -> Vec<Action> {
    deps_of(a, stages).into_iter().flatten().collect()
}

/// Checks `s`: every stage sits on its device (`device_of`), every (stage,
/// micro-batch) runs F, B and (split) W exactly once, and the order cannot deadlock (the
/// devices' orders plus the dependencies form no cycle). Errors name the problem.
pub fn verify(s: &Schedule) -> Result<(), String> {
    if s.devices == 0 || !s.stages.is_multiple_of(s.devices) {
        return Err(format!(
            "{}: {} stages do not spread evenly over {} devices",
            s.name, s.stages, s.devices
        ));
    }
    if s.device_of.len() != s.stages || s.device_of.iter().any(|&d| d >= s.devices) {
        return Err(format!(
            "{}: the stage placement does not map {} stages onto {} devices",
            s.name, s.stages, s.devices
        ));
    }
    let mut seen: HashMap<Action, usize> = HashMap::new();
    for (d, acts) in s.actions.iter().enumerate() {
        for a in acts {
            if s.device_of.get(a.stage) != Some(&d) {
                return Err(format!(
                    "{}: {a} is on device {d} but stage {} runs on device {}",
                    s.name,
                    a.stage,
                    s.device_of
                        .get(a.stage)
                        .map_or("none".to_string(), |d| d.to_string())
                ));
            }
            if a.kind == Kind::W && !s.split_backward {
                return Err(format!(
                    "{}: {a}: W in a schedule without split backward",
                    s.name
                ));
            }
            if seen.insert(*a, d).is_some() {
                return Err(format!("{}: {a} runs twice", s.name));
            }
        }
    }
    let kinds: &[Kind] = if s.split_backward {
        &[Kind::F, Kind::B, Kind::W]
    } else {
        &[Kind::F, Kind::B]
    };
    for stage in 0..s.stages {
        for mb in 0..s.microbatches {
            for &k in kinds {
                let a = action(stage, k, mb);
                if !seen.contains_key(&a) {
                    return Err(format!(
                        "{}: micro-batch {mb} skips {k:?} on stage {stage} ({a} is missing)",
                        s.name
                    ));
                }
            }
        }
    }
    // The dependency graph: each device's order, and each fragment's inputs.
    let mut g: DiGraph<Action, ()> = DiGraph::new();
    // Nodes in device order, so the fragment a deadlock is reported at does not depend on
    // hashing.
    let idx: HashMap<Action, NodeIndex> = s
        .actions
        .iter()
        .flatten()
        .map(|&a| (a, g.add_node(a)))
        .collect();
    for acts in &s.actions {
        for w in acts.windows(2) {
            g.add_edge(idx[&w[0]], idx[&w[1]], ());
        }
        for a in acts {
            for d in deps(*a, s.stages) {
                g.add_edge(idx[&d], idx[a], ());
            }
        }
    }
    toposort(&g, None).map(|_| ()).map_err(|cycle| {
        // The fragments caught in the cycle: the strongly connected component holding it.
        let scc = petgraph::algo::kosaraju_scc(&g)
            .into_iter()
            .find(|c| c.contains(&cycle.node_id()))
            .unwrap_or_else(|| vec![cycle.node_id()]);
        let mut members: Vec<Action> = scc.iter().map(|&i| g[i]).collect();
        members.sort_by_key(|a| (s.device_of[a.stage], a.mb, a.stage, a.kind));
        let list: Vec<String> = members
            .iter()
            .map(|a| format!("{a} (device {})", s.device_of[a.stage]))
            .collect();
        format!(
            "{}: the schedule deadlocks: {} wait for each other (each device's order plus what each fragment needs from another)",
            s.name,
            list.join(", ")
        )
    })
}

/// Per-stage costs of a fragment.
#[derive(Clone, Copy, Debug)]
pub struct Costs {
    /// Forward of one stage.
    pub f: f64,
    /// Input-gradient backward of one stage.
    pub b: f64,
    /// Weight-gradient backward of one stage.
    pub w: f64,
}

impl Default for Costs {
    fn default() -> Self {
        Costs {
            f: 1.0,
            b: 1.0,
            w: 1.0,
        }
    }
}

/// When each fragment ran.
#[derive(Clone, Debug)]
pub struct Timeline {
    /// Per device, its fragments with start and end times, in order.
    pub runs: Vec<Vec<(Action, f64, f64)>>,
    /// When the last fragment ends.
    pub makespan: f64,
    /// Per device, its busy time.
    pub busy: Vec<f64>,
    /// Per device, the most micro-batches it held forward activations of at once (a
    /// micro-batch's activations of a stage live from its F to its B), in stage units
    /// (one chunk of an interleaved device counts 1 / chunks).
    pub peak_in_flight: Vec<f64>,
}

impl Timeline {
    /// Per device, its idle time (makespan less busy).
    pub fn idle(&self) -> Vec<f64> {
        self.busy.iter().map(|b| self.makespan - b).collect()
    }

    /// Idle time over all devices' time.
    pub fn bubble_ratio(&self) -> f64 {
        let idle: f64 = self.idle().iter().sum();
        idle / (self.makespan * self.busy.len() as f64)
    }
}

/// Simulates `s` (verified first): each device runs its fragments in order, a fragment
/// starts when its device is free and its inputs are done; communication takes no time.
/// A stage's costs are `costs` divided by the chunks per device; an unsplit backward
/// costs `b + w`.
pub fn simulate(s: &Schedule, costs: Costs) -> Result<Timeline, String> {
    let chunks = (s.stages / s.devices.max(1)) as f64;
    let cost = |a: Action| {
        (match a.kind {
            Kind::F => costs.f,
            Kind::B if s.split_backward => costs.b,
            Kind::B => costs.b + costs.w,
            Kind::W => costs.w,
        }) / chunks
    };
    simulate_with(s, &cost)
}

/// [`simulate`] with each fragment's time given by `cost` (e.g. its FLOPs at a device's
/// speed: `nnscaler schedule-report --program`).
pub fn simulate_with(s: &Schedule, cost: &dyn Fn(Action) -> f64) -> Result<Timeline, String> {
    verify(s)?;
    simulate_verified(s, cost)
}

/// [`simulate_with`] for a schedule that has passed [`verify`] already (a search
/// simulates one schedule with many costs).
pub fn simulate_verified(s: &Schedule, cost: &dyn Fn(Action) -> f64) -> Result<Timeline, String> {
    let chunks = (s.stages / s.devices) as f64;
    // When each action ended, by (stage, micro-batch, kind) (a search simulates many
    // schedules: no hashing, no allocation per action).
    let slot = |a: Action| (a.stage * s.microbatches + a.mb) * 3 + a.kind as usize;
    let mut done: Vec<Option<f64>> = vec![None; s.stages * s.microbatches * 3];
    let mut finished = 0usize;
    let mut next = vec![0usize; s.devices];
    let mut free = vec![0.0f64; s.devices];
    let mut runs: Vec<Vec<(Action, f64, f64)>> = s
        .actions
        .iter()
        .map(|a| Vec::with_capacity(a.len()))
        .collect();
    let total: usize = s.actions.iter().map(Vec::len).sum();
    if s.actions
        .iter()
        .flatten()
        .any(|a| a.stage >= s.stages || a.mb >= s.microbatches)
    {
        return Err(format!(
            "{}: an action outside its stages or micro-batches",
            s.name
        ));
    }
    while finished < total {
        let mut progressed = false;
        for d in 0..s.devices {
            while let Some(&a) = s.actions[d].get(next[d]) {
                let mut start = free[d];
                let mut ready = true;
                for x in deps_of(a, s.stages).into_iter().flatten() {
                    match done[slot(x)] {
                        Some(t) => start = start.max(t),
                        None => {
                            ready = false;
                            break;
                        }
                    }
                }
                if !ready {
                    break;
                }
                let end = start + cost(a);
                if done[slot(a)].replace(end).is_none() {
                    finished += 1;
                }
                runs[d].push((a, start, end));
                free[d] = end;
                next[d] += 1;
                progressed = true;
            }
        }
        if !progressed {
            return Err(format!("{}: the simulation stalls (a deadlock)", s.name));
        }
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    let busy = runs
        .iter()
        .map(|r| r.iter().map(|(_, a, b)| b - a).sum())
        .collect();
    // In flight: F done, B not yet started, counted at each fragment boundary.
    let peak_in_flight = runs
        .iter()
        .map(|r| {
            let (mut cur, mut peak) = (0.0f64, 0.0f64);
            for (a, _, _) in r {
                match a.kind {
                    Kind::F => cur += 1.0 / chunks,
                    Kind::B => cur -= 1.0 / chunks,
                    Kind::W => {}
                }
                peak = peak.max(cur);
            }
            peak
        })
        .collect();
    Ok(Timeline {
        runs,
        makespan,
        busy,
        peak_in_flight,
    })
}

/// Per stage, the most micro-batches whose forward activations it holds at once (from a
/// micro-batch's `F` to its `B`, as [`Timeline::peak_in_flight`] counts them), in the
/// order its device runs its actions: what the stage's activation memory must hold.
pub fn peak_in_flight_by_stage(s: &Schedule) -> Vec<usize> {
    let mut peak = vec![0usize; s.stages];
    for actions in &s.actions {
        let mut held = vec![0usize; s.stages];
        for a in actions {
            match a.kind {
                Kind::F => {
                    held[a.stage] += 1;
                    peak[a.stage] = peak[a.stage].max(held[a.stage]);
                }
                Kind::B => held[a.stage] = held[a.stage].saturating_sub(1),
                Kind::W => {}
            }
        }
    }
    peak
}

pub use nnscaler_rt::plot::ticks;

/// A Gantt chart of `t` as SVG: devices as rows, F / B / W coloured (with a legend),
/// micro-batch numbers (and stages, when a device holds several) inside the boxes, the
/// time axis below in `unit` (times multiplied by `scale`; an empty unit: the schedule's
/// own time units, as `--tf`/`--tb`/`--tw` give them).
pub fn svg(s: &Schedule, t: &Timeline, scale: f64, unit: &str) -> String {
    // About 1200 pixels across for long schedules, at most 40 per mean fragment.
    let frags: usize = t.runs.iter().map(Vec::len).sum();
    let mean = t.runs.iter().flatten().map(|(_, a, b)| b - a).sum::<f64>() / frags.max(1) as f64;
    let span = t.makespan.max(30.0 * mean);
    let px = if span > 0.0 { 1200.0 / span } else { 40.0 };
    let (row, left, top) = (28.0, 70.0, 40.0);
    let width = (left + t.makespan * px + 20.0).max(560.0);
    let height = top + row * s.devices as f64 + 56.0;
    let (shown_unit, axis_label) = if unit.is_empty() {
        (
            "time units".to_string(),
            "time (units of --tf, --tb, --tw)".to_string(),
        )
    } else {
        (unit.to_string(), format!("time ({unit})"))
    };
    let makespan = format!("{:.4}", t.makespan * scale);
    let makespan = makespan.trim_end_matches('0').trim_end_matches('.');
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{height:.0}\" font-family=\"sans-serif\" font-size=\"11\">\n<text x=\"4\" y=\"15\">{} — {} devices, {} stages, {} micro-batches, makespan {makespan} {shown_unit}, bubble {:.1}%</text>\n",
        s.name,
        s.devices,
        s.stages,
        s.microbatches,
        100.0 * t.bubble_ratio()
    );
    // The legend: the three kinds of work.
    let kinds: &[(&str, &str)] = if s.split_backward {
        &[
            ("#8ecae6", "F forward"),
            ("#ffb703", "B backward (input gradients)"),
            ("#90be6d", "W weight gradients"),
        ]
    } else {
        &[("#8ecae6", "F forward"), ("#ffb703", "B backward")]
    };
    let mut lx = 4.0;
    for (color, what) in kinds {
        out.push_str(&format!(
            "<rect x=\"{lx:.1}\" y=\"22\" width=\"12\" height=\"10\" fill=\"{color}\" stroke=\"#333\"/><text x=\"{:.1}\" y=\"31\">{what}</text>\n",
            lx + 16.0
        ));
        lx += 16.0 + 7.0 * what.len() as f64 + 14.0;
    }
    let chunked = s.stages > s.devices;
    for (d, r) in t.runs.iter().enumerate() {
        let y = top + row * d as f64;
        out.push_str(&format!(
            "<text x=\"4\" y=\"{:.1}\">device {d}</text>\n",
            y + row * 0.65
        ));
        for (a, s0, s1) in r {
            let color = match a.kind {
                Kind::F => "#8ecae6",
                Kind::B => "#ffb703",
                Kind::W => "#90be6d",
            };
            let x = left + s0 * px;
            let w = (s1 - s0) * px;
            let label = if chunked {
                format!("{}{:?}{}", a.stage, a.kind, a.mb)
            } else {
                format!("{:?}{}", a.kind, a.mb)
            };
            out.push_str(&format!(
                "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"{:.1}\" fill=\"{color}\" stroke=\"#333\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{label}</text>\n",
                row - 4.0,
                x + w / 2.0,
                y + row * 0.6
            ));
        }
    }
    // The time axis: a line, ticks at round values (in `unit`), its label.
    let axis = top + row * s.devices as f64 + 2.0;
    out.push_str(&format!(
        "<line x1=\"{left:.1}\" y1=\"{axis:.1}\" x2=\"{:.1}\" y2=\"{axis:.1}\" stroke=\"#333\"/>\n",
        left + t.makespan * px
    ));
    if t.makespan > 0.0 {
        let (marks, decimals) = ticks(0.0, t.makespan * scale, 10.0);
        for m in marks {
            let x = left + m / scale * px;
            out.push_str(&format!(
                "<line x1=\"{x:.1}\" y1=\"{axis:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#333\"/><text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{m:.decimals$}</text>\n",
                axis + 4.0,
                axis + 16.0
            ));
        }
    }
    out.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{axis_label}</text>\n</svg>\n",
        left + t.makespan * px / 2.0,
        axis + 34.0
    ));
    out
}

/// A report of `t`: per device its busy and idle time and peak in-flight micro-batches,
/// then the makespan and the bubble ratio.
pub fn report(s: &Schedule, t: &Timeline) -> String {
    report_scaled(s, t, 1.0, "")
}

/// [`report`] with times multiplied by `scale` and followed by `unit` (e.g. 1e3, "ms").
pub fn report_scaled(s: &Schedule, t: &Timeline, scale: f64, unit: &str) -> String {
    let mut out = format!(
        "{}: {} devices, {} stages, {} micro-batches{}\n",
        s.name,
        s.devices,
        s.stages,
        s.microbatches,
        if s.split_backward {
            " (backward split into B and W)"
        } else {
            ""
        }
    );
    let head = if unit.is_empty() {
        "device     busy     idle   peak in flight\n".to_string()
    } else {
        format!("device  busy ({unit})  idle ({unit})   peak in flight\n")
    };
    out.push_str(&head);
    for (d, (b, i)) in t.busy.iter().zip(t.idle()).enumerate() {
        let (b, i) = (b * scale, i * scale);
        if unit.is_empty() {
            out.push_str(&format!(
                "{d:>6} {b:>8.2} {i:>8.2} {:>16.2}\n",
                t.peak_in_flight[d]
            ));
        } else {
            out.push_str(&format!(
                "{d:>6} {b:>10.3} {i:>10.3} {:>16.2}\n",
                t.peak_in_flight[d]
            ));
        }
    }
    out.push_str(&format!(
        "makespan {:.2}{}{unit}, bubble ratio {:.1}%\n",
        t.makespan * scale,
        if unit.is_empty() { "" } else { " " },
        100.0 * t.bubble_ratio()
    ));
    out
}

#[cfg(test)]
mod tests;
