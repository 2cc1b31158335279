//! Tests of `sharding`.

use super::*;
use crate::nns::{parse_axes, Layout};

fn mesh(axes: &str) -> Mesh {
    Mesh {
        name: "world".into(),
        axes: parse_axes(axes).unwrap(),
        memory_cap: None,
    }
}

fn sh(m: &Mesh, layout: &str, rank: usize) -> Sharding {
    let body = if layout.is_empty() {
        "@world".to_string()
    } else {
        format!("@world, {layout}")
    };
    Sharding::from_layout(&Layout::parse(&body).unwrap(), m, rank).unwrap()
}

fn sizes(m: &Mesh) -> Vec<i64> {
    m.axes.iter().map(|a| a.size).collect()
}

/// The steps from `a` to `b` for a 64x64 f32 tensor, as text.
fn path(m: &Mesh, a: &str, b: &str) -> String {
    let mut ts = TransitionSearch::new();
    let t = ts
        .find(&sh(m, a, 2), &sh(m, b, 2), &[64, 64], Elem::F32, &sizes(m))
        .expect("a transition exists");
    let v: Vec<String> = t.steps.iter().map(|s| s.describe(m)).collect();
    v.join("; ")
}

/// The collectives' table and the transition search agree: every step the search
/// makes is a collective of the table, every collective (but `relayout`, which the
/// search lowers, `transfer`, between pipeline stages, and `broadcast`, which no layout
/// transition needs) is a step, each entry's
/// shape effect names its own dim attributes, and local steps cost nothing.
#[test]
fn the_collectives_table_matches_the_steps() {
    use crate::nns::{collective, COLLECTIVES};
    let steps = [
        Step::AllReduce {
            axes: vec![0],
            reduce: Reduce::Sum,
        },
        Step::ReduceScatter {
            axis: 0,
            dim: 0,
            reduce: Reduce::Sum,
        },
        Step::AllGather { axis: 0, dim: 0 },
        Step::AllToAll {
            axis: 0,
            split_dim: 0,
            concat_dim: 1,
        },
        Step::Partition { axis: 0 },
        Step::Slice { axis: 0, dim: 0 },
    ];
    let names: Vec<&str> = steps.iter().map(Step::op_name).collect();
    for n in &names {
        let c = collective(n).unwrap_or_else(|| panic!("step {n} is not in the table"));
        assert!(
            c.moves.is_some(),
            "{n} is a step of the search but has no moves"
        );
    }
    for c in COLLECTIVES {
        if c.moves.is_some() {
            assert!(
                names.contains(&c.name),
                "{} has moves but is no step of the search",
                c.name
            );
        }
        for k in c.cuts.iter().chain(c.grows) {
            assert!(
                c.dim_attrs.contains(k),
                "{}: '{k}' is not a dim attribute",
                c.name
            );
        }
    }
    for local in ["nns.slice", "nns.partition"] {
        assert_eq!(crate::nns::sent_bytes(local, 4.0, 100.0, 25.0), 0.0);
    }
    assert_eq!(
        crate::nns::sent_bytes("nns.all_reduce", 4.0, 100.0, 100.0),
        150.0
    );
}

#[test]
fn transition_table() {
    let m = mesh("dp = 2, tp = 4");
    let table: &[(&str, &str, &str)] = &[
        ("", "", ""),
        ("tp = V(sum)", "", "all_reduce(tp, sum)"),
        ("tp = D(0)", "", "all_gather(tp, 0)"),
        ("tp = V(sum)", "tp = D(0)", "reduce_scatter(tp, 0, sum)"),
        ("", "tp = D(1)", "slice(tp, 1)"),
        ("tp = D(0)", "tp = D(1)", "all_to_all(tp, 0->1)"),
        ("dp = V(sum), tp = V(sum)", "", "all_reduce(dp tp, sum)"),
        (
            "dp = D(0), tp = D(0)",
            "",
            "all_gather(tp, 0); all_gather(dp, 0)",
        ),
        ("dp = D(0), tp = D(1)", "dp = D(0)", "all_gather(tp, 1)"),
        (
            "dp = V(sum)",
            "dp = D(0), tp = D(0)",
            "reduce_scatter(dp, 0, sum); slice(tp, 0)",
        ),
        ("tp = V(max)", "", "all_reduce(tp, max)"),
        (
            "dp = D(0), tp = V(sum)",
            "dp = D(0), tp = D(1)",
            "reduce_scatter(tp, 1, sum)",
        ),
    ];
    for (a, b, want) in table {
        assert_eq!(path(&m, a, b), *want, "{a:?} -> {b:?}");
        // Applying the steps reaches the target.
        let mut ts = TransitionSearch::new();
        let t = ts
            .find(
                &sh(&m, a, 2),
                &sh(&m, b, 2),
                &[64, 64],
                Elem::F32,
                &sizes(&m),
            )
            .unwrap();
        let end = t.steps.iter().fold(sh(&m, a, 2), |s, step| step.apply(&s));
        assert_eq!(end, sh(&m, b, 2), "{a:?} -> {b:?}");
    }
}

#[test]
fn replicated_becomes_partial_locally_but_max_partials_are_unreachable() {
    let m = mesh("tp = 2");
    let mut ts = TransitionSearch::new();
    let t = ts
        .find(
            &sh(&m, "", 2),
            &sh(&m, "tp = V(sum)", 2),
            &[4, 4],
            Elem::F32,
            &[2],
        )
        .unwrap();
    assert_eq!(t.steps, vec![Step::Partition { axis: 0 }]);
    assert_eq!(t.bytes, 0.0);
    let t = ts.find(
        &sh(&m, "", 2),
        &sh(&m, "tp = V(max)", 2),
        &[4, 4],
        Elem::F32,
        &[2],
    );
    assert!(t.is_none());
}

#[test]
fn indivisible_splits_are_avoided() {
    // dim 0 has length 6: splitting it 4 ways is impossible, so D(1) -> R -> no D(0).
    let m = mesh("tp = 4");
    let mut ts = TransitionSearch::new();
    let t = ts.find(
        &sh(&m, "tp = D(1)", 2),
        &sh(&m, "tp = D(0)", 2),
        &[6, 8],
        Elem::F32,
        &[4],
    );
    assert!(t.is_none());
    let t = ts
        .find(
            &sh(&m, "tp = D(1)", 2),
            &sh(&m, "", 2),
            &[6, 8],
            Elem::F32,
            &[4],
        )
        .unwrap();
    assert_eq!(t.steps, vec![Step::AllGather { axis: 0, dim: 1 }]);
    assert_eq!(t.bytes, 0.75 * 6.0 * 8.0 * 4.0);
}

#[test]
fn shards_follow_row_major_coordinates_and_nesting() {
    let m = mesh("dp = 2, tp = 2");
    let s = sh(&m, "tp = D(0), dp = D(0)", 2); // tp outer, dp inner on dim 0
    let sz = sizes(&m);
    // device 1 = (dp 0, tp 1): block tp*2 + dp = 2 of 4 -> rows 4..6
    assert_eq!(s.shard(&[8, 3], &sz, 1).ranges, vec![4..6, 0..3]);
    // device 2 = (dp 1, tp 0): block 1 -> rows 2..4
    assert_eq!(s.shard(&[8, 3], &sz, 2).ranges, vec![2..4, 0..3]);
    let v = sh(&m, "dp = V(sum), tp = D(1)", 2);
    let piece = v.shard(&[8, 4], &sz, 3);
    assert_eq!(piece.ranges, vec![0..8, 2..4]);
    assert_eq!(piece.partial, vec![(0, 1)]);
}

#[test]
fn op_layouts_from_directives() {
    let m = mesh("dp = 2, tp = 4");
    let anno = Annotation::parse("m k+, k+ n -> m n").unwrap();
    let binding = anno.bind(&[Some(&[8, 16]), Some(&[16, 4])]).unwrap();
    // Row-parallel: k over tp -> inputs split on k, result partial on tp.
    let l = op_layouts(
        &anno,
        &binding,
        Reduce::Sum,
        &[("k".into(), vec![1]), ("m".into(), vec![0])],
        2,
        &[2, 2],
        &[2],
    )
    .unwrap();
    assert_eq!(
        l.inputs[0].as_ref().unwrap().to_layout(&m).to_string(),
        "@world, dp = D(0), tp = D(1)"
    );
    assert_eq!(
        l.inputs[1].as_ref().unwrap().to_layout(&m).to_string(),
        "@world, tp = D(0)"
    );
    assert_eq!(
        l.outputs[0].to_layout(&m).to_string(),
        "@world, dp = D(0), tp = V(sum)"
    );
    // Inference follows the first operand's split.
    let x = l.inputs[0].clone().unwrap();
    let binds = infer_binds(&anno, &binding, &[Some(&x), None]);
    assert_eq!(
        binds,
        vec![("m".to_string(), vec![0]), ("k".to_string(), vec![1])]
    );
}

#[test]
fn inference_extends_a_bind_to_a_nested_split() {
    // An elementwise op on a tensor-parallel block (tp = D(0)) and its ZeRO shard
    // (tp = D(0), dp = D(0): dp inside each tp block) runs on the finer blocks.
    let m = mesh("dp = 2, tp = 2");
    let anno = Annotation::parse("a, a -> a").unwrap();
    let binding = anno.bind(&[Some(&[8]), Some(&[8])]).unwrap();
    let block = sh(&m, "tp = D(0)", 1);
    let shard = sh(&m, "tp = D(0), dp = D(0)", 1);
    let binds = infer_binds(&anno, &binding, &[Some(&block), Some(&shard)]);
    assert_eq!(binds, vec![("a".to_string(), vec![1, 0])]);
    // Not the other way round (dp outside tp's blocks is another split), nor when
    // the inner axis is another identifier's.
    let outer = sh(&m, "dp = D(0), tp = D(0)", 1);
    let binds = infer_binds(&anno, &binding, &[Some(&block), Some(&outer)]);
    assert_eq!(binds, vec![("a".to_string(), vec![1])]);
    let anno2 = Annotation::parse("a b, a b -> a b").unwrap();
    let binding2 = anno2.bind(&[Some(&[8, 4]), Some(&[8, 4])]).unwrap();
    let first = sh(&m, "tp = D(0), dp = D(1)", 2);
    let second = sh(&m, "tp = D(0), dp = D(0)", 2);
    let binds = infer_binds(&anno2, &binding2, &[Some(&first), Some(&second)]);
    assert_eq!(
        binds,
        vec![("a".to_string(), vec![1]), ("b".to_string(), vec![0])]
    );
}

#[test]
fn layouts_round_trip() {
    let m = mesh("dp = 2, tp = 4, pp = 2");
    for text in [
        "@world",
        "@world, dp = V(sum), tp = D(1)",
        "@world, tp = D(0), dp = D(0)",
        "@world, pp = V(max)",
    ] {
        let l = Layout::parse(text).unwrap();
        let s = Sharding::from_layout(&l, &m, 2).unwrap();
        let back = s.to_layout(&m);
        assert_eq!(
            Sharding::from_layout(&back, &m, 2).unwrap(),
            s,
            "{text} -> {back}"
        );
    }
}

/// The steps from `a` to `b` for a 1024x1024 f32 tensor (4 MiB: bytes outweigh
/// [`HOP_BYTES`]), searched by bytes (`None`) or by `price`.
fn big_path(m: &Mesh, a: &str, b: &str, price: Option<StepPrice>) -> Vec<Step> {
    let mut ts = match price {
        Some(p) => TransitionSearch::priced(Vec::new(), p),
        None => TransitionSearch::new(),
    };
    ts.find(
        &sh(m, a, 2),
        &sh(m, b, 2),
        &[1024, 1024],
        Elem::F32,
        &sizes(m),
    )
    .expect("a transition exists")
    .steps
}

fn describe(m: &Mesh, steps: &[Step]) -> String {
    let v: Vec<String> = steps.iter().map(|s| s.describe(m)).collect();
    v.join("; ")
}

/// A price: each step costs what `f` says of it.
fn price(f: impl Fn(&Step) -> f64 + Send + Sync + 'static) -> StepPrice {
    Arc::new(move |s: &Step, _: f64, _: f64| f(s))
}

#[test]
fn a_priced_search_takes_the_cheapest_path_by_its_price() {
    let m = mesh("dp = 2, tp = 4");
    // By bytes, D(0) over tp to D(0) over dp goes through an all_to_all (it sends a
    // quarter of what an all_gather does).
    let (a, b) = ("tp = D(0)", "dp = D(0)");
    assert_eq!(
        describe(&m, &big_path(&m, a, b, None)),
        "all_to_all(tp, 0->1); slice(dp, 0); all_gather(tp, 1)"
    );
    // Priced so that an all_to_all is dear, the all_gather and a slice.
    let dear = price(|s| match s {
        Step::AllToAll { .. } => 10.0,
        _ => 1.0,
    });
    assert_eq!(
        describe(&m, &big_path(&m, a, b, Some(dear))),
        "all_gather(tp, 0); slice(dp, 0)"
    );
}

#[test]
fn a_priced_search_offers_one_all_reduce_over_several_axes_and_keeps_runs_apart() {
    let m = mesh("dp = 2, tp = 4");
    let (v, r) = ("dp = V(sum), tp = V(sum)", "");
    let joint = Step::AllReduce {
        axes: vec![0, 1],
        reduce: Reduce::Sum,
    };
    // Unpriced, a small tensor's two single-axis all_reduces are merged into one.
    assert_eq!(path(&m, v, r), "all_reduce(dp tp, sum)");
    // Every step alike: the joint all_reduce is one step.
    assert_eq!(big_path(&m, v, r, Some(price(|_| 1.0))), vec![joint]);
    // The joint one dear: two all_reduces, priced and emitted apart (not merged).
    let dear = price(|s| match s {
        Step::AllReduce { axes, .. } if axes.len() > 1 => 5.0,
        Step::AllReduce { .. } => 1.0,
        _ => 3.0,
    });
    let steps = big_path(&m, v, r, Some(dear));
    assert_eq!(steps.len(), 2, "{steps:?}");
    assert!(steps
        .iter()
        .all(|s| matches!(s, Step::AllReduce { axes, .. } if axes.len() == 1)));
}

#[test]
fn priced_paths_that_tie_to_nine_digits_take_the_fewest_steps() {
    let m = mesh("dp = 2, tp = 4");
    // One joint all_reduce at 3e-5 s against a reduce_scatter, an all_reduce of its
    // piece and an all_gather at 1e-5 + 1.1e-5 + 0.9e-5 s, less by 1e-19 s: the joint one.
    // (A whole tensor's single-axis all_reduce costs 2e-5 s, so two cost more.)
    let whole = 1024.0 * 1024.0 * 4.0;
    let tie: StepPrice = Arc::new(move |s: &Step, here: f64, _: f64| match s {
        Step::AllReduce { axes, .. } if axes.len() > 1 => 3e-5,
        Step::AllReduce { .. } if here < whole => 1.1e-5,
        Step::AllReduce { .. } => 2e-5,
        Step::ReduceScatter { .. } => 1e-5,
        Step::AllGather { .. } => 0.9e-5 - 1e-19,
        _ => 1.0,
    });
    let steps = big_path(&m, "dp = V(sum), tp = V(sum)", "", Some(tie));
    assert_eq!(steps.len(), 1, "{steps:?}");
}

#[test]
fn devices_meet_in_groups_by_the_other_axes() {
    // dp = 2, tp = 3, pp = 2: devices row-major over (dp, tp, pp).
    let sizes = [2i64, 3, 2];
    for d in 0..12 {
        assert_eq!(device(&sizes, &coords(&sizes, d)), d);
    }
    // Device 9 = (1, 1, 1): over tp it is the middle member of the group (dp 1, pp 1).
    assert_eq!(
        meeting(&sizes, &[1, 1, 1], &[1]),
        Meeting {
            group: 3,
            member: 1,
            size: 3
        }
    );
    // Over (tp, dp), in that order: member = tp * 2 + dp.
    assert_eq!(
        meeting(&sizes, &[1, 2, 0], &[1, 0]),
        Meeting {
            group: 0,
            member: 5,
            size: 6
        }
    );
    assert_eq!(groups(&[2, 2], &[1]), vec![vec![0, 1], vec![2, 3]]);
    assert_eq!(groups(&[2, 2], &[0]), vec![vec![0, 2], vec![1, 3]]);
    assert_eq!(groups(&[2, 2], &[0, 1]), vec![vec![0, 1, 2, 3]]);
    assert_eq!(groups(&[2, 2], &[1, 0]), vec![vec![0, 2, 1, 3]]);
    // Every device in exactly one group, at the place its meeting says.
    for axes in [vec![0], vec![2], vec![0, 2], vec![2, 1], vec![0, 1, 2]] {
        let gs = groups(&sizes, &axes);
        let mut seen = [false; 12];
        for (g, members) in gs.iter().enumerate() {
            for (m, &d) in members.iter().enumerate() {
                assert!(!seen[d]);
                seen[d] = true;
                let at = meeting(&sizes, &coords(&sizes, d), &axes);
                assert_eq!((at.group, at.member, at.size), (g, m, members.len()));
            }
        }
        assert!(seen.iter().all(|&s| s));
    }
}

/// A tensor of integers (indices, targets) is never made partial on the way: where a
/// price makes `partition` + `reduce_scatter` cheaper than a local slice (a cluster whose
/// network is cheaper than its memory), floats take it and integers slice.
#[test]
fn integers_are_never_partial_on_the_way() {
    let m = mesh("tp = 4");
    let dear_slice = || {
        price(|s| match s {
            Step::Slice { .. } => 1.0,
            _ => 1e-3,
        })
    };
    let path = |elem| {
        let mut ts = TransitionSearch::priced(Vec::new(), dear_slice());
        ts.find(&sh(&m, "", 2), &sh(&m, "tp = D(1)", 2), &[4, 8], elem, &[4])
            .expect("a transition exists")
            .steps
    };
    assert_eq!(
        describe(&m, &path(Elem::F32)),
        "partition(tp); reduce_scatter(tp, 1, sum)"
    );
    assert_eq!(describe(&m, &path(Elem::I64)), "slice(tp, 1)");
}
