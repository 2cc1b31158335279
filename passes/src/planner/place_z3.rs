//! The placement problem for Z3: items in program order (layers, or runs of ops) placed
//! on contiguous, non-empty pipeline stages, minimising the slowest stage's cost, under
//! the user's pins and bounds and each stage's memory cap.
//!
//! Encoding: the stage boundaries are the variables (see [`solve`]); items repeated in a
//! run (a model's identical layers) share them, so a stage's cost and memory are a few
//! linear terms however many layers there are. The objective is found by bisection over the
//! candidate values (every contiguous run's cost, sorted), each probe a `push` / assert
//! every stage's cost `<= T` / `check` / `pop` on one `Solver` (faster than `Optimize` on
//! such problems), starting at a known lower bound (the dynamic program's optimum, which
//! ignores memory): when the caps do not bind, one probe settles it. User constraints and memory caps are asserted with tracking literals:
//! when no placement satisfies them together, the unsat core names the conflicting ones.

use z3::ast::{Bool, Int};
use z3::{SatResult, Solver};

/// One item to place.
#[derive(Clone, Debug, Default)]
pub struct Item {
    /// Its cost (FLOPs).
    pub cost: u64,
    /// The stages it may go to (inclusive).
    pub lo: usize,
    /// See `lo`.
    pub hi: usize,
    /// The user constraint behind `lo..=hi`, described for messages (`None`: no
    /// constraint).
    pub constraint: Option<String>,
    /// The bytes it adds to each stage's device if placed there (activations times the
    /// micro-batches in flight on that stage differ per stage).
    pub mem: Vec<u64>,
}

/// A placement problem.
#[derive(Clone, Debug, Default)]
pub struct Problem {
    /// The items, in program order.
    pub items: Vec<Item>,
    /// Pipeline stages.
    pub stages: usize,
    /// Bytes each stage's device may hold (`None`: no cap).
    pub cap: Option<u64>,
    /// A known lower bound on the optimum (the dynamic program's optimum without memory
    /// caps): probed first, which settles most problems in one check.
    pub lower_bound: Option<u64>,
}

/// Why there is no placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Infeasible {
    /// Fewer items than stages.
    TooFew,
    /// These constraints (from the unsat core) cannot hold together.
    Conflict(Vec<String>),
}

/// Maximal runs of consecutive items with the same cost and memory and no constraint
/// (repeated layers): their items share variables. Returns each run's item range.
fn runs(items: &[Item]) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for (u, it) in items.iter().enumerate() {
        let joins = out.last().is_some_and(|r| {
            let prev = &items[r.end - 1];
            r.end == u
                && it.constraint.is_none()
                && prev.constraint.is_none()
                && prev.cost == it.cost
                && prev.mem == it.mem
                && (prev.lo, prev.hi) == (it.lo, it.hi)
        });
        if joins {
            out.last_mut().expect("checked").end = u + 1;
        } else {
            out.push(u..u + 1);
        }
    }
    out
}

/// The stage of each item in an optimal placement (see the module docs), or why there is
/// none.
///
/// Variables: the stage boundaries `b_1 < ... < b_(S-1)` (the first item of each stage
/// after the first; `b_0 = 0`, `b_S = n`). Items repeated in a run (equal cost and memory:
/// the layers of a model) share them: stage `k` holds `max(0, min(b_(k+1), e) - max(b_k,
/// s))` items of the run `s..e`, so an 80-layer model is a handful of terms per stage.
pub fn solve(p: &Problem) -> Result<Vec<usize>, Infeasible> {
    let (n, stages) = (p.items.len(), p.stages);
    if n < stages || stages == 0 {
        return Err(Infeasible::TooFew);
    }
    let solver = Solver::new();
    let int = |v: u64| Int::from_u64(v);
    let mut b: Vec<Int> = vec![int(0)];
    for k in 1..stages {
        b.push(Int::new_const(format!("b{k}")));
    }
    b.push(int(n as u64));
    for k in 0..stages {
        // Every stage holds at least one item.
        solver.assert(b[k + 1].ge(&b[k] + int(1)));
    }
    let mut tracked: Vec<String> = Vec::new();
    let mut track = |what: String, c: Bool| {
        let lit = Bool::new_const(format!("c{}", tracked.len()));
        solver.assert_and_track(c, &lit);
        tracked.push(what);
    };
    let runs = runs(&p.items);
    for r in &runs {
        // Item u may be on stages lo..=hi: b_lo <= u < b_(hi+1) (for the whole run).
        let it = &p.items[r.start];
        if (it.lo, it.hi) == (0, stages - 1) {
            continue;
        }
        let c = Bool::and(&[
            b[it.lo].le(int(r.start as u64)),
            b[it.hi + 1].ge(int(r.end as u64)),
        ]);
        match &it.constraint {
            Some(what) => track(what.clone(), c),
            None => solver.assert(c),
        }
    }
    let min = |x: &Int, c: u64| x.lt(int(c)).ite(x, &int(c));
    let max = |x: &Int, c: u64| x.gt(int(c)).ite(x, &int(c));
    // Items of run r on stage k.
    let overlap = |k: usize, r: &std::ops::Range<usize>| -> Int {
        let d = min(&b[k + 1], r.end as u64) - max(&b[k], r.start as u64);
        d.gt(int(0)).ite(&d, &int(0))
    };
    let sum = |k: usize, value: &dyn Fn(usize) -> u64| -> Int {
        let terms: Vec<Int> = runs
            .iter()
            .filter(|r| value(r.start) > 0)
            .map(|r| overlap(k, r) * int(value(r.start)))
            .collect();
        if terms.is_empty() {
            int(0)
        } else {
            Int::add(&terms)
        }
    };
    if let Some(cap) = p.cap {
        for k in 0..stages {
            let m = sum(k, &|u| p.items[u].mem.get(k).copied().unwrap_or(0));
            track(
                format!("the memory cap of {cap} bytes per device on stage {k}"),
                m.le(int(cap)),
            );
        }
    }
    if solver.check() != SatResult::Sat {
        // In the order the constraints were made (program order, then memory by stage).
        let mut core: Vec<usize> = solver
            .get_unsat_core()
            .iter()
            .filter_map(|c| c.to_string().trim_start_matches('c').parse().ok())
            .collect();
        core.sort_unstable();
        let core = core
            .into_iter()
            .filter_map(|i| tracked.get(i).cloned())
            .collect();
        return Err(Infeasible::Conflict(core));
    }
    let costs: Vec<Int> = (0..stages).map(|k| sum(k, &|u| p.items[u].cost)).collect();
    // Candidate objectives: the cost of every contiguous run of items.
    let mut cand: Vec<u64> = Vec::new();
    for a in 0..n {
        let mut c = 0u64;
        for it in &p.items[a..] {
            c = c.saturating_add(it.cost);
            cand.push(c);
        }
    }
    cand.sort_unstable();
    cand.dedup();
    let model_of = |solver: &Solver| -> Option<Vec<usize>> {
        let m = solver.get_model()?;
        let bounds: Vec<usize> = b[1..stages]
            .iter()
            .map(|x| m.eval(x, true).and_then(|v| v.as_u64()).map(|v| v as usize))
            .collect::<Option<_>>()?;
        Some(
            (0..n)
                .map(|u| bounds.iter().filter(|&&x| x <= u).count())
                .collect(),
        )
    };
    // With no limit on time it is feasible (just checked).
    let mut best = model_of(&solver).ok_or_else(|| Infeasible::Conflict(Vec::new()))?;
    let (mut lo, mut hi) = (0usize, cand.len() - 1);
    if let Some(lb) = p.lower_bound {
        lo = cand.partition_point(|&c| c < lb).min(hi);
    }
    let mut first = true;
    while lo < hi {
        // The lower bound first: when the caps do not bind, it is the optimum.
        let mid = if std::mem::take(&mut first) && p.lower_bound.is_some() {
            lo
        } else {
            (lo + hi) / 2
        };
        solver.push();
        for c in &costs {
            solver.assert(c.le(int(cand[mid])));
        }
        let ok = solver.check() == SatResult::Sat;
        if ok {
            if let Some(m) = model_of(&solver) {
                best = m;
            }
            hi = mid;
        } else {
            lo = mid + 1;
        }
        solver.pop(1);
    }
    Ok(best)
}

/// Unconstrained items of these costs over `stages` stages (tests' problems).
#[cfg(test)]
pub(crate) fn unconstrained(costs: &[u64], stages: usize) -> Vec<Item> {
    costs
        .iter()
        .map(|&c| Item {
            cost: c,
            lo: 0,
            hi: stages - 1,
            constraint: None,
            mem: vec![0; stages],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicting_pins_are_the_core() {
        // Each pin holds alone; together they put a later item on an earlier stage.
        let mut its = unconstrained(&[1, 1, 1, 1], 2);
        its[1].lo = 1;
        its[1].hi = 1;
        its[1].constraint = Some("pin B".into());
        its[2].lo = 0;
        its[2].hi = 0;
        its[2].constraint = Some("pin C".into());
        let e = solve(&Problem {
            items: its,
            stages: 2,
            cap: None,
            lower_bound: None,
        })
        .unwrap_err();
        assert_eq!(
            e,
            Infeasible::Conflict(vec!["pin B".into(), "pin C".into()])
        );
    }

    #[test]
    fn memory_caps_move_items() {
        // Balanced by cost, stage 0 would hold items 0 and 1; item 1's memory does not fit.
        let mut its = unconstrained(&[5, 5, 5, 5], 2);
        for it in &mut its {
            it.mem = vec![10, 10];
        }
        its[0].mem = vec![25, 25];
        let p = Problem {
            items: its,
            stages: 2,
            cap: Some(30),
            lower_bound: None,
        };
        let st = solve(&p).unwrap();
        assert_eq!(st, vec![0, 1, 1, 1]);
        let mut tight = p.clone();
        tight.cap = Some(20);
        match solve(&tight).unwrap_err() {
            Infeasible::Conflict(c) => {
                assert!(c.iter().any(|x| x.contains("stage 0")), "{c:?}")
            }
            e => panic!("{e:?}"),
        }
    }
}
