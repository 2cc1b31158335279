//! `--place{stages=N}`: assigns every op of a forward program a pipeline stage
//! (`nns.stage`), contiguous in program order, so that the slowest stage is as fast as it
//! can be.
//!
//! An op's cost is its FLOPs (the op specs' rule; a call of a user op counts its body's
//! FLOPs, other ops nothing). Stages are contiguous runs of ops in program order, each
//! non-empty. Constraints written by the user are kept: an op's `nns.stage` pins it, its
//! `nns.stage_bounds = array<i64: lo, hi>` bounds it. The optimum is exact: a dynamic
//! program over (stage, prefix) — [`balanced_partition`]. Run it before `--autodiff`,
//! which gives each backward op the stage of the forward op it differentiates.
//!
//! A remark reports each stage's ops and FLOPs and the balance (slowest / mean).
//!
//! Not yet: solving with Z3 under memory caps and schedule-dependent activation memory,
//! layers sharing variables, explicit layer layouts; stages as a mesh axis (`pp`).

use crate::layouts::error;
use crate::pipeline::{FunctionPass, PassOptions};
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::dnn;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::spec::OpCtx;
use nnscaler_dialects::types::AttrValue;

/// The pass.
#[derive(Debug)]
pub struct Place {
    stages: usize,
    remarks: Diagnostics,
}

impl Place {
    /// Reads the options (`stages`).
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        let stages = o
            .get("stages")
            .ok_or("place: give the number of stages, e.g. --place=\"stages=4\"")?;
        let stages: usize = stages.parse().ok().filter(|&s| s >= 1).ok_or(format!(
            "place: 'stages' must be a positive integer, not '{stages}'"
        ))?;
        Ok(Place {
            stages,
            remarks: Diagnostics::default(),
        })
    }
}

impl FunctionPass for Place {
    fn run_on_function(&mut self, mut g: Graph) -> Result<Option<Graph>, Diagnostics> {
        if g.is_localized() {
            return Err(error(
                &g.loc,
                "place: the function is localized; place stages before --localize",
            ));
        }
        if g.outputs
            .iter()
            .any(|o| o.name().is_some_and(|n| n.starts_with("grad.")))
        {
            return Err(error(
                &g.loc,
                format!("place: @{} already has its backward; run --place before --autodiff (backward ops follow their forward op's stage)", g.name),
            ));
        }
        let n = g.nodes.len();
        if n < self.stages {
            return Err(error(
                &g.loc,
                format!(
                    "place: @{} has {n} ops, fewer than the {} stages (every stage needs one)",
                    g.name, self.stages
                ),
            ));
        }
        let costs: Vec<f64> = g.nodes.iter().map(|node| op_flops(&g, node)).collect();
        let mut allowed = Vec::with_capacity(n);
        for node in &g.nodes {
            let fail = |m: String| error(&node.loc, format!("place: '{}': {m}", node.op));
            let (mut lo, mut hi) = (0usize, self.stages - 1);
            if let Some(AttrValue::Ints(b)) = node.attrs.get("nns.stage_bounds") {
                if let [l, h] = b.as_slice() {
                    lo = lo.max(*l as usize);
                    hi = hi.min(*h as usize);
                }
            }
            if let Some(AttrValue::Int(s)) = node.attrs.get("nns.stage") {
                let s = *s as usize;
                if s >= self.stages {
                    return Err(fail(format!(
                        "is pinned to stage {s}, but there are {} stages",
                        self.stages
                    )));
                }
                lo = lo.max(s);
                hi = hi.min(s);
            }
            if lo > hi {
                return Err(fail(format!(
                    "its pin and bounds leave no stage among 0..{}",
                    self.stages
                )));
            }
            allowed.push((lo, hi));
        }
        let stages = balanced_partition(&costs, self.stages, &allowed).map_err(|(k, why)| {
            error(
                &g.nodes[k].loc,
                format!("place: '{}': {why}", g.nodes[k].op),
            )
        })?;
        let mut per = vec![(0usize, 0.0f64); self.stages];
        for (k, node) in g.nodes.iter_mut().enumerate() {
            node.attrs
                .insert("nns.stage".into(), AttrValue::Int(stages[k] as i64));
            per[stages[k]].0 += 1;
            per[stages[k]].1 += costs[k];
        }
        let max = per.iter().map(|p| p.1).fold(0.0, f64::max);
        let mean = per.iter().map(|p| p.1).sum::<f64>() / self.stages as f64;
        let list: Vec<String> = per
            .iter()
            .enumerate()
            .map(|(s, (ops, f))| format!("{s}: {ops} ops, {f:.3e} FLOPs"))
            .collect();
        self.remarks.remark(
            &g.loc,
            format!(
                "place @{}: {} stages; {}; slowest / mean = {:.3}",
                g.name,
                self.stages,
                list.join("; "),
                if mean > 0.0 { max / mean } else { 1.0 }
            ),
        );
        Ok(Some(g))
    }

    fn take_remarks(&mut self) -> Diagnostics {
        std::mem::take(&mut self.remarks)
    }
}

/// The FLOPs of one op of `g` (0 for ops without a spec).
fn op_flops(g: &Graph, n: &nnscaler_dialects::graph::Node) -> f64 {
    let Some(spec) = dnn::spec(&n.op) else {
        return 0.0;
    };
    let operands: Vec<_> = n
        .inputs
        .iter()
        .map(|&v| Some(g.values[v].clone()))
        .collect();
    let results: Vec<_> = n.outputs.iter().map(|&v| g.values[v].clone()).collect();
    (spec.flops)(
        &OpCtx {
            operands: &operands,
            attrs: &n.attrs,
        },
        &results,
    )
}

/// Splits `costs` (in order) into `stages` contiguous non-empty runs minimising the
/// largest run's sum, with item `k` allowed only in stages `allowed[k].0..=allowed[k].1`.
/// Returns the stage of each item (non-decreasing), or the item where it is impossible and
/// why. Exact: a dynamic program over (stage, prefix), O(stages · n²).
pub fn balanced_partition(
    costs: &[f64],
    stages: usize,
    allowed: &[(usize, usize)],
) -> Result<Vec<usize>, (usize, String)> {
    let n = costs.len();
    let mut prefix = vec![0.0; n + 1];
    for i in 0..n {
        prefix[i + 1] = prefix[i] + costs[i];
    }
    // Stage `s` may hold items j..i when every one of them allows `s`.
    let ok = |s: usize, j: usize, i: usize| (j..i).all(|k| allowed[k].0 <= s && s <= allowed[k].1);
    const INF: f64 = f64::INFINITY;
    // best[s][i]: the least max cost of placing items 0..i on stages 0..=s (each non-empty).
    let mut best = vec![vec![INF; n + 1]; stages];
    let mut from = vec![vec![0usize; n + 1]; stages];
    for i in 1..=n {
        if ok(0, 0, i) {
            best[0][i] = prefix[i];
        }
    }
    for s in 1..stages {
        for i in (s + 1)..=n {
            // The last stage holds j..i; scan j downwards while stage s allows item j.
            let mut j = i;
            while j > s {
                j -= 1;
                if !(allowed[j].0 <= s && s <= allowed[j].1) {
                    break;
                }
                let c = best[s - 1][j].max(prefix[i] - prefix[j]);
                if c < best[s][i] {
                    best[s][i] = c;
                    from[s][i] = j;
                }
            }
        }
    }
    if best[stages - 1][n] == INF {
        // Name the first item whose constraints cannot be met in order.
        let mut lo_seen = 0;
        for (k, &(lo, hi)) in allowed.iter().enumerate() {
            if hi < lo_seen {
                return Err((
                    k,
                    format!(
                        "must be on a stage <= {hi}, but an earlier op is on stage {lo_seen} or later (stages are contiguous in program order)"
                    ),
                ));
            }
            lo_seen = lo_seen.max(lo);
        }
        return Err((
            0,
            format!("{n} ops cannot fill {stages} non-empty stages under their pins and bounds"),
        ));
    }
    let mut out = vec![0; n];
    let mut i = n;
    for s in (0..stages).rev() {
        let j = if s == 0 { 0 } else { from[s][i] };
        for slot in &mut out[j..i] {
            *slot = s;
        }
        i = j;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every split of `costs` into `stages` non-empty runs, for the brute-force optimum.
    fn brute(costs: &[f64], stages: usize, allowed: &[(usize, usize)]) -> Option<f64> {
        fn go(
            costs: &[f64],
            allowed: &[(usize, usize)],
            start: usize,
            stage: usize,
            stages: usize,
            worst: f64,
            best: &mut Option<f64>,
        ) {
            let n = costs.len();
            if stage == stages {
                if start == n && best.is_none_or(|b| worst < b) {
                    *best = Some(worst);
                }
                return;
            }
            for end in start + 1..=n {
                if (start..end).any(|k| allowed[k].0 > stage || stage > allowed[k].1) {
                    break;
                }
                let c: f64 = costs[start..end].iter().sum();
                go(costs, allowed, end, stage + 1, stages, worst.max(c), best);
            }
        }
        let mut best = None;
        go(costs, allowed, 0, 0, stages, 0.0, &mut best);
        best
    }

    #[test]
    fn the_partition_is_the_brute_force_optimum() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        for _ in 0..300 {
            let n = 1 + next() % 9;
            let stages = 1 + next() % n.min(4);
            let costs: Vec<f64> = (0..n).map(|_| (next() % 10) as f64).collect();
            let mut allowed = vec![(0, stages - 1); n];
            if next() % 2 == 0 {
                let k = next() % n;
                let s = next() % stages;
                allowed[k] = (s, s);
            }
            let want = brute(&costs, stages, &allowed);
            match balanced_partition(&costs, stages, &allowed) {
                Ok(st) => {
                    let mut sums = vec![0.0; stages];
                    for (k, &s) in st.iter().enumerate() {
                        sums[s] += costs[k];
                        assert!(allowed[k].0 <= s && s <= allowed[k].1);
                    }
                    assert!(st.windows(2).all(|w| w[0] <= w[1]));
                    assert!((0..stages).all(|s| st.contains(&s)), "a stage is empty");
                    let got = sums.iter().copied().fold(0.0, f64::max);
                    assert_eq!(Some(got), want, "{costs:?} {stages} {allowed:?}");
                }
                Err(_) => assert_eq!(want, None, "{costs:?} {stages} {allowed:?}"),
            }
        }
    }

    #[test]
    fn pins_out_of_order_are_named() {
        let e = balanced_partition(&[1.0, 1.0, 1.0], 2, &[(1, 1), (0, 1), (0, 0)]).unwrap_err();
        assert_eq!(e.0, 2);
        assert!(e.1.contains("an earlier op is on stage 1"), "{}", e.1);
    }
}
