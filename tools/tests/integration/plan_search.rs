//! The plan search (`nnscaler plan`, `nnscaler_passes::planner::search`): its profiles add up to
//! the compiled program, it equals brute force over the same space on small instances,
//! it is never worse than Megatron-LM's grid scored by the same model, and it keeps to a
//! memory cap.

use nnscaler_frontends::{build_module, preset};
use nnscaler_passes::planner::cost;
use nnscaler_passes::planner::schedule::ScheduleKind;
use nnscaler_passes::planner::search::{self, Profiles, Recompute, Space};
use nnscaler_tools::plan::training_step;

fn step(name: &str, sizes: &[(&str, &str)]) -> nnscaler_dialects::graph::Graph {
    let mut c = preset(name).unwrap();
    for (k, v) in sizes {
        c.set(k, v).unwrap();
    }
    let text = build_module(&c).unwrap();
    training_step(&text, name, nnscaler_tools::plan::Precision::F32)
        .unwrap()
        .0
}

fn gpt() -> nnscaler_dialects::graph::Graph {
    step(
        "gpt-tiny",
        &[("batch", "4"), ("heads", "4"), ("layers", "3")],
    )
}

#[test]
fn profiles_cover_the_step() {
    let g = gpt();
    let c = cost::preset("dgx-h100").unwrap();
    let total: u64 = g
        .args
        .iter()
        .filter(|a| a.is_param())
        .map(|a| g.values[a.value].bytes())
        .sum();
    let p1 = search::profile(&g, 1, 4, &c).unwrap();
    let names: Vec<&str> = p1.items.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["(before)", "h.0", "h.1", "h.2", "(after)"]);
    // Every parameter is charged to one item.
    assert_eq!(p1.items.iter().map(|i| i.params).sum::<u64>(), total);
    // Identical layers cost the same, the first one too: a backward op is charged to the
    // layer of the forward op it differentiates, as `--place` stages it (the first
    // norm's gradient to its layer, not to the embeddings whose output it reads).
    for it in &p1.items[2..4] {
        assert_eq!(
            *it,
            search::Item {
                name: it.name.clone(),
                ..p1.items[1].clone()
            }
        );
    }
    for it in &p1.items[1..4] {
        assert!(
            it.fwd > 0.0 && it.bwd_input > 0.0 && it.bwd_weight > 0.0,
            "{it:?}"
        );
        assert!(it.saved_full < it.saved_selective && it.saved_selective < it.saved);
        assert!(it.cut > 0);
    }
    assert!(p1.optimizer > 0.0);
    // `--recompute` recomputes layers only: the ops before and after them keep everything
    // they save, and repeat nothing, under every policy.
    for it in [&p1.items[0], &p1.items[4]] {
        assert_eq!(it.again, [search::Again::default(); 3], "{it:?}");
        assert_eq!(
            (it.saved_selective, it.saved_full),
            (it.saved, it.saved),
            "{it:?}"
        );
    }
    // What each policy runs again, from the step compiled with it (index: none,
    // selective, full): nothing without recompute; selective repeats less than full and
    // less than the forward; some of it only weight gradients need (a norm's output for
    // the next product's weight gradient: in `W`), some the input gradient (the heads'
    // reshapes for the attention's gradient: in `B`); full recompute repeats the
    // products too, through which the input gradient needs the rest. A layer's output
    // runs again only for the next layer's backward (its last residual add): apart, paid
    // where the two share a stage.
    for it in &p1.items[1..4] {
        let [none, selective, full] = it.again;
        assert_eq!(none, search::Again::default());
        assert!(
            0.0 < selective.seconds() && selective.seconds() < full.seconds(),
            "{it:?}"
        );
        assert!(full.seconds() <= it.fwd * 1.0001, "{it:?}");
        assert!(selective.b > 0.0 && selective.w > 0.0, "{selective:?}");
        assert!(full.b > full.w, "{full:?}");
        assert!(selective.next_b > 0.0 && full.next_b > 0.0, "{it:?}");
    }
    // ZeRO-3 gathers in each fragment the parameters its ops read (index: none,
    // selective, full). Without recompute the backward reads the products' weights and
    // the norms' (input gradients), not the biases; the weight gradients read none.
    // Selective recompute's norms, which only weight gradients need, read theirs in `W`;
    // full recompute reads every parameter again.
    for it in &p1.items[1..4] {
        let r = &it.backward_reads;
        assert!(0 < r.bw[0].1 && r.bw[0].1 < it.tensors, "{r:?}");
        assert_eq!(r.w[0].1, 0, "{r:?}");
        assert_eq!(r.b[0].1 + r.w[0].1, r.bw[0].1, "{r:?}");
        assert!(r.w[1].1 > 0, "{r:?}");
        assert_eq!(r.bw[2], (it.params, it.tensors, it.params_sq), "{r:?}");
    }
    // Tensor parallelism shards the layers' parameters and adds their collectives.
    let p2 = search::profile(&g, 2, 4, &c).unwrap();
    // (norms and row-parallel biases stay whole)
    let (a, b) = (p2.items[1].params as f64, p1.items[1].params as f64);
    assert!(a < 0.6 * b, "{a} {b}");
    assert!(p2.items[1].fwd > 0.0);
    // Megatron's weight gradients are whole on each device; Megatron-SP's norm weights
    // and row-parallel weights get partial gradients, reduced over tp once a step (after
    // the micro-batches are added up): `grad_sync`, not in `bwd_weight`.
    assert!(p2.items[1..4].iter().all(|it| it.grad_sync == 0.0));
    // A cut after a layer sends its output once, whole on each device: Megatron's
    // residual stream runs as a partial sum all-reduced for the next norm, and both
    // reach the next layer, but a pipeline stage boundary passes one of them.
    for (a, b) in p2.items[1..3].iter().zip(&p1.items[1..3]) {
        assert_eq!(a.cut, b.cut, "{} {}", a.name, b.name);
    }
    let sp = search::profile_with(&g, 2, 4, &c, search::TpPolicy::Sp).unwrap();
    for it in &sp.items[1..4] {
        assert!(it.grad_sync > 0.0 && it.bwd_weight > 0.0, "{it:?}");
    }
    // The micro-batches' gradients are added up as the compiler adds them: before the
    // once-a-step reductions, so Megatron-SP's row-parallel weights' partial gradients
    // whole (more bytes than their shards), the others as their parameters.
    for it in p1.items.iter().chain(&p2.items[1..4]) {
        assert_eq!(
            it.accumulated,
            (it.params, it.tensors, it.params_sq),
            "{it:?}"
        );
    }
    for it in &sp.items[1..4] {
        assert!(it.accumulated.0 > it.params, "{it:?}");
    }
    // The head's gradient of the tied embedding table goes back to the embeddings: a
    // message past the stages between them.
    let wte: u64 = g
        .args
        .iter()
        .find(|a| a.name() == Some("wte"))
        .map(|a| g.values[a.value].bytes())
        .unwrap();
    for q in [&p1, &p2, &sp] {
        let sends: Vec<&[(usize, u64)]> = q.items.iter().map(|i| &i.grad_sends[..]).collect();
        assert_eq!(sends, [&[][..], &[], &[], &[], &[(0, wte)]], "{}", q.tp);
    }
    // The loss is reduced once a step, by the last item: over the plan's dp (here the
    // profile's batch over two micro-batches makes one) and, where tp leaves it partial
    // (Megatron-SP's head), over tp too; one device's micro-batch has nothing to reduce.
    let half = search::profile(&g, 1, 2, &c).unwrap();
    for (q, group) in [(&half, 1), (&sp, 2)] {
        let losses: Vec<u64> = q.items.iter().map(|i| i.loss.1).collect();
        assert_eq!(losses, [0, 0, 0, 0, 1]);
        assert_eq!((q.items[4].loss.0, q.items[4].loss_group), (4, group));
    }
    assert!(p1.items.iter().all(|i| i.loss.1 == 0));
    // A smaller micro-batch keeps fewer activations.
    assert_eq!(half.items[1].saved * 2, p1.items[1].saved);
    // Degrees the compiler refuses are errors naming why.
    let e = search::profile(&g, 3, 4, &c).unwrap_err();
    assert!(!e.is_empty());
}

/// The search's best equals brute force: every stage cut, every plan simulated.
fn equals_brute_force(g: &nnscaler_dialects::graph::Graph, cluster: &str, devices: u64) {
    let c = cost::preset(cluster).unwrap();
    let mut profiles = Profiles::new();
    // Context parallelism too (the tiny models' sequences are below the default's
    // positions per device).
    let mut space = Space::new(devices);
    space.max_sp = Some(devices);
    let fast = search::search(g, &c, &space, &mut profiles, &mut |_| {}).unwrap();
    let mut brute = space.clone();
    brute.exhaustive = true;
    let slow = search::search(g, &c, &brute, &mut profiles, &mut |_| {}).unwrap();
    assert!(
        slow.simulated > fast.simulated,
        "{} {}",
        slow.simulated,
        fast.simulated
    );
    let (a, b) = (&fast.ranked[0], &slow.ranked[0]);
    assert!(
        (a.seconds - b.seconds).abs() <= 1e-12 * b.seconds,
        "{cluster} x {devices}: search {:?} {} s, brute force {:?} {} s",
        a.config,
        a.seconds,
        b.config,
        b.seconds
    );
}

#[test]
fn search_equals_brute_force_on_small_instances() {
    let g = gpt();
    equals_brute_force(&g, "dgx-h100", 4);
    equals_brute_force(&g, "cpu", 4);
    let l = step(
        "llama-tiny",
        &[("batch", "4"), ("heads", "4"), ("kv-heads", "2")],
    );
    equals_brute_force(&l, "dgx-a100", 2);
    equals_brute_force(&l, "h200", 4);
}

#[test]
fn search_is_no_worse_than_megatron_grid_and_keeps_the_cap() {
    let g = step(
        "gpt-tiny",
        &[("batch", "8"), ("heads", "4"), ("layers", "4")],
    );
    let c = cost::preset("dgx-h100").unwrap();
    let mut profiles = Profiles::new();
    let found = search::search(&g, &c, &Space::new(8), &mut profiles, &mut |_| {}).unwrap();
    let grid = search::search(&g, &c, &Space::megatron(8), &mut profiles, &mut |_| {}).unwrap();
    assert!(found.ranked[0].seconds <= grid.ranked[0].seconds);
    // Ranked best first.
    assert!(found
        .ranked
        .windows(2)
        .all(|w| w[0].seconds <= w[1].seconds));
    // A cap between the smallest and the largest plan's memory is kept.
    let mems: Vec<u64> = found.ranked.iter().map(|e| e.memory).collect();
    let cap = (mems.iter().min().unwrap() + mems.iter().max().unwrap()) / 2;
    let mut capped = Space::new(8);
    capped.memory_cap = Some(cap);
    let under = search::search(&g, &c, &capped, &mut profiles, &mut |_| {}).unwrap();
    assert!(!under.ranked.is_empty());
    assert!(under.ranked.iter().all(|e| e.memory <= cap));
    assert!(under.out.iter().any(|(r, _)| r == "out of memory"));
    // A cap no plan meets leaves nothing, each plan out for memory.
    capped.memory_cap = Some(1000);
    let none = search::search(&g, &c, &capped, &mut profiles, &mut |_| {}).unwrap();
    assert!(none.ranked.is_empty());
    // Recompute trades time for memory: a plan's full recompute keeps less than none.
    let best = &found.ranked[0].config;
    let mut one = Space::new(8);
    one.recompute = vec![Recompute::Full];
    let full = search::search(&g, &c, &one, &mut profiles, &mut |_| {}).unwrap();
    assert!(full
        .ranked
        .iter()
        .all(|e| e.config.recompute == Recompute::Full));
    let _ = best;
}

/// Where there are too many cuts to try them all (ten items on 4 stages: 84 ways), the
/// dynamic program's cut refined against the simulator comes within 1% of brute force.
#[test]
fn refined_cuts_come_close_to_brute_force() {
    let g = step(
        "gpt-tiny",
        &[("batch", "8"), ("heads", "4"), ("layers", "8")],
    );
    for cluster in ["dgx-h100", "cpu"] {
        let c = cost::preset(cluster).unwrap();
        let mut profiles = Profiles::new();
        let mut space = Space::new(8);
        space.max_pp = Some(4);
        space.schedules = vec![ScheduleKind::OneFOneB, ScheduleKind::ZbH1];
        let fast = search::search(&g, &c, &space, &mut profiles, &mut |_| {}).unwrap();
        let mut brute = space.clone();
        brute.exhaustive = true;
        let slow = search::search(&g, &c, &brute, &mut profiles, &mut |_| {}).unwrap();
        let gap = fast.ranked[0].seconds / slow.ranked[0].seconds - 1.0;
        println!(
            "{cluster}: search {:?} {:.6e} s, brute force {:?} {:.6e} s, gap {gap:.2e}",
            fast.ranked[0].config,
            fast.ranked[0].seconds,
            slow.ranked[0].config,
            slow.ranked[0].seconds
        );
        assert!((0.0..=0.01).contains(&gap), "{cluster}: gap {gap}");
    }
}

/// Profiles of the forward with its runs of identical layers cut to two, expanded, equal
/// the whole step's (every field of every item, the optimizer), for Megatron's splits and
/// the searched ones, with and without tensor parallelism; and so do those of the cut a
/// training step gives (`layer_runs::cut_step`: its forward recovered from the step, what
/// `--plan=auto` and `nnscaler plan` profile for a step).
#[test]
fn cut_profiles_equal_whole_ones() {
    for (name, sizes) in [
        (
            "gpt-tiny",
            vec![("batch", "4"), ("heads", "4"), ("layers", "6")],
        ),
        ("llama-tiny", vec![("batch", "4"), ("layers", "5")]),
    ] {
        let mut c = preset(name).unwrap();
        for (k, v) in &sizes {
            c.set(k, v).unwrap();
        }
        let text = build_module(&c).unwrap();
        let whole = training_step(&text, name, nnscaler_tools::plan::Precision::F32)
            .unwrap()
            .0;
        let from_forward =
            nnscaler_tools::plan::cut_step(&text, name, nnscaler_tools::plan::Precision::F32)
                .unwrap()
                .expect("the layers are cut");
        let from_step = nnscaler_passes::planner::layer_runs::cut_step(
            &whole,
            nnscaler_passes::registry::lookup,
        )
        .expect("the step is cut");
        assert_eq!(from_step.runs, from_forward.runs, "{name}");
        let cluster = cost::preset("dgx-h100").unwrap();
        for (cut, (tp, sp, micro, t)) in [&from_forward, &from_step].into_iter().flat_map(|c| {
            [
                (1, 1, 1, search::TpPolicy::Megatron),
                (2, 1, 2, search::TpPolicy::Megatron),
                (2, 1, 1, search::TpPolicy::Search),
                (1, 2, 2, search::TpPolicy::Megatron),
                (2, 2, 1, search::TpPolicy::Sp),
            ]
            .map(|k| (c, k))
        }) {
            let want = search::profile_sp(&whole, tp, sp, micro, &cluster, t).unwrap();
            let mut profiles = Profiles::new();
            let mut space = Space::new(tp * sp);
            space.max_sp = Some(sp);
            space.tensor = vec![t];
            space.max_micro = micro;
            space.pipelines = true;
            search::search_with(
                &whole,
                Some(cut),
                &cluster,
                &space,
                &mut profiles,
                &mut |_| {},
            )
            .unwrap();
            let got = profiles[&(search::Degrees { tp, sp, micro }, t)]
                .as_ref()
                .unwrap();
            let what = format!("{name} tp={tp} sp={sp} micro={micro} {t:?}");
            assert_eq!(got.items.len(), want.items.len(), "{what}");
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12);
            for (g, w) in got.items.iter().zip(&want.items) {
                assert_eq!(
                    (
                        &g.name,
                        g.params,
                        g.saved,
                        g.saved_selective,
                        g.saved_full,
                        g.cut
                    ),
                    (
                        &w.name,
                        w.params,
                        w.saved,
                        w.saved_selective,
                        w.saved_full,
                        w.cut
                    ),
                    "{what}"
                );
                for (a, b, f) in [
                    (g.fwd, w.fwd, "fwd"),
                    (g.bwd_input, w.bwd_input, "bwd_input"),
                    (g.bwd_weight, w.bwd_weight, "bwd_weight"),
                    (g.flops, w.flops, "flops"),
                    (g.comm, w.comm, "comm"),
                    (g.update, w.update, "update"),
                ] {
                    assert!(close(a, b), "{what} {}: {f} {a} against {b}", g.name);
                }
            }
            assert!(
                close(got.optimizer, want.optimizer),
                "{what}: optimizer {} against {}",
                got.optimizer,
                want.optimizer
            );
        }
    }
}
