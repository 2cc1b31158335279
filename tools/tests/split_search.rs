//! The per-op split search (`--plan="tp-search ..."`, `nnscaler_passes::split_search`).

use nnscaler_dialects::nns::{Axis, Mesh};
use nnscaler_frontends::{build_module, preset};
use nnscaler_passes::cost;
use nnscaler_passes::plan::{plan, Policy};
use nnscaler_passes::split_search::{compiled_seconds, tp_search};
use nnscaler_tools::plan::training_step;

fn step(name: &str, sizes: &[(&str, &str)]) -> nnscaler_dialects::graph::Graph {
    let mut c = preset(name).unwrap();
    for (k, v) in sizes {
        c.set(k, v).unwrap();
    }
    let text = build_module(&c).unwrap();
    training_step(&text, name, false).unwrap().0
}

fn mesh(dp: i64, tp: i64) -> Mesh {
    let ax = |n: &str, s| Axis {
        name: n.into(),
        size: s,
        microbatches: false,
    };
    Mesh {
        name: "world".into(),
        axes: vec![ax("dp", dp), ax("tp", tp)],
        memory_cap: None,
    }
}

#[test]
fn explore() {
    for (model, sizes, cl, dp, tp) in [
        ("gpt-tiny", vec![], "dgx-h100", 1, 2),
        ("nanogpt-cpu", vec![], "cpu", 1, 2),
        ("nanogpt-cpu", vec![], "dgx-h100", 1, 4),
        (
            "gpt2-124m",
            vec![("batch", "8"), ("layers", "2")],
            "dgx-h100",
            1,
            8,
        ),
        (
            "gpt2-124m",
            vec![("batch", "8"), ("layers", "2")],
            "dgx-h100",
            1,
            4,
        ),
        (
            "gpt2-124m",
            vec![("batch", "8"), ("layers", "2")],
            "dgx-h100",
            2,
            4,
        ),
        ("llama-tiny", vec![], "cpu", 1, 2),
        (
            "gpt3-175b",
            vec![("batch", "1"), ("layers", "2"), ("block", "2048")],
            "dgx-h100",
            1,
            8,
        ),
    ] {
        let g = step(model, &sizes);
        let c = cost::preset(cl).unwrap();
        let m = mesh(dp, tp);
        let t = std::time::Instant::now();
        let (planned, prep, sol) = tp_search(g.clone(), &m, &c, "tp").unwrap();
        let secs = t.elapsed().as_secs_f64();
        let searched = compiled_seconds(planned, &m, &c).unwrap();
        let mega = plan(g.clone(), Policy::DpMegatron, &m)
            .and_then(|p| compiled_seconds(p, &m, &c))
            .map_or(f64::NAN, |s| s);
        let dp_only = compiled_seconds(plan(g.clone(), Policy::Dp, &m).unwrap(), &m, &c).unwrap();
        eprintln!(
            "{model} {cl} dp{dp} tp{tp}: z3 {:.4e} compiled {:.4e} megatron {:.4e} replicated {:.4e} ({} classes, {:.2} s)\n  {}",
            sol.seconds, searched, mega, dp_only, prep.problem.classes.len(), secs, prep.describe(&sol).join("; ")
        );
    }
}

#[test]
fn breakdown() {
    let g = step(
        "gpt3-175b",
        &[("batch", "1"), ("layers", "2"), ("block", "2048")],
    );
    let c = cost::preset("dgx-h100").unwrap();
    let m = mesh(1, 8);
    let (planned, prep, sol) = tp_search(g.clone(), &m, &c, "tp").unwrap();
    let unary: f64 = prep
        .problem
        .classes
        .iter()
        .zip(&sol.choice)
        .map(|(cl, &k)| cl.choices[k].seconds * cl.members.len() as f64)
        .sum();
    eprintln!("model: unary {unary:.4e} terms {:.4e}", sol.seconds - unary);
    let local = nnscaler_passes::split_search::compile(planned, &m).unwrap();
    let mut by: std::collections::BTreeMap<String, (f64, usize)> = Default::default();
    for n in &local.nodes {
        if let Some(k) = cost::node_cost(&local, n, &c, Some(&m)) {
            let e = by.entry(n.op.clone()).or_default();
            e.0 += k.seconds;
            e.1 += 1;
        }
    }
    let fwd = nnscaler_passes::recompute::forward_ops(&local);
    for (k, n) in local.nodes.iter().enumerate() {
        if n.op == "nns.all_gather" || n.op == "nns.reduce_scatter" {
            let secs = cost::node_cost(&local, n, &c, Some(&m)).map_or(0.0, |k| k.seconds);
            let user = local
                .nodes
                .iter()
                .find(|u| u.inputs.contains(&n.outputs[0]))
                .map_or("-".to_string(), |u| u.op.clone());
            let prod = local
                .nodes
                .iter()
                .find(|u| u.outputs.contains(&n.inputs[0]))
                .map_or("arg".to_string(), |u| u.op.clone());
            eprintln!(
                "  {} fwd={} {:?} -> {:?} {secs:.2e} {prod} -> {user}",
                n.op, fwd[k], local.values[n.inputs[0]].shape, local.values[n.outputs[0]].shape
            );
        }
    }
    let mut v: Vec<_> = by.into_iter().collect();
    v.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    for (op, (s, n)) in v.iter().take(25) {
        eprintln!("  {op:30} {n:4} {s:.4e}");
    }
    for (cl, &k) in prep.problem.classes.iter().zip(&sol.choice) {
        eprintln!(
            "  class {} -> {} {:.3e} x{}",
            cl.name,
            cl.choices[k].label,
            cl.choices[k].seconds,
            cl.members.len()
        );
    }
}
