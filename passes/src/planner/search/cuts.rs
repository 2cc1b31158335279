//! Stage cuts: the items cut into contiguous pipeline stages (the balanced cut, every cut
//! of few items, the refinement of the best plans' cuts) under the users' stage bounds.

use super::*;

/// Stage starts of `n` items in `stages` runs for Megatron: uniform layers, the ops
/// before and after the layers with the first and last stage (`None` when the layers do
/// not divide).
pub(super) fn megatron_cut(items: &[Item], stages: usize) -> Option<Vec<usize>> {
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
pub(super) fn every_cut(n: usize, stages: usize) -> Vec<Vec<usize>> {
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
pub(super) fn item_bounds<'b>(
    bounds: &'b [StageBound],
    items: &[Item],
) -> Vec<(usize, &'b StageBound)> {
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
pub(super) fn bound_conflict(
    bounds: &[(usize, &StageBound)],
    n: usize,
    stages: usize,
) -> Option<String> {
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
pub(super) fn cut_keeps(starts: &[usize], bounds: &[(usize, &StageBound)]) -> bool {
    bounds.iter().all(|&(i, b)| {
        let stage = starts.partition_point(|&s| s <= i) - 1;
        (b.lo..=b.hi).contains(&stage)
    })
}

/// How many of the best plans have their cuts refined.
pub(super) const REFINED: usize = 3;

/// Below this many ways to cut the items into stages, the search tries them all.
pub const FEW_CUTS: u64 = 64;

/// How many ways there are to cut `n` items into `stages` contiguous non-empty runs:
/// C(n - 1, stages - 1), saturating.
pub(super) fn cut_count(n: usize, stages: usize) -> u64 {
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
pub(super) fn refine(
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
pub(super) fn balanced_cut(
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
