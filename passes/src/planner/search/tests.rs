//! Tests of the plan search's scoring: stage costs, ZeRO-3 gathers, pipeline messages,
//! the loss's reduction and the search's bounds.

use super::*;

/// A plan on one device each of dp and tp, one sequence a micro-batch, no recompute, no
/// ZeRO, Megatron's splits: `pp` ranks running `schedule` on stages starting at `starts`,
/// `microbatches` micro-batches.
fn plan(pp: u64, microbatches: u64, schedule: Option<ScheduleKind>, starts: Vec<usize>) -> Config {
    Config {
        dp: 1,
        tp: 1,
        sp: 1,
        pp,
        micro: 1,
        microbatches,
        schedule,
        recompute: Recompute::None,
        zero: 0,
        stage_starts: starts,
        tensor: TpPolicy::Megatron,
    }
}

/// A profile of these items.
fn profile(items: Vec<Item>) -> Profile {
    Profile {
        items,
        ..Profile::default()
    }
}

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
    let p = profile(items);
    let c = plan(2, 2, Some(ScheduleKind::ZbH1), vec![0, 2]);
    let st = stages_of(&p, &c);
    assert_eq!((st[0].f, st[0].b, st[0].w), (2.0, 0.0, 3.0));
    assert_eq!((st[1].f, st[1].b, st[1].w), (2.0, 2.0, 1.0));
}

/// What a recompute policy runs again adds to `B` and `W` as the compiled step runs
/// it; what only the next item's backward reads, only where that item shares the stage.
#[test]
fn recompute_for_the_next_item_is_paid_on_its_stage() {
    let again = Again {
        b: 1.0,
        w: 0.5,
        next_b: 0.25,
        next_w: 0.125,
    };
    let items: Vec<Item> = (0..3)
        .map(|i| Item {
            name: format!("i{i}"),
            fwd: 1.0,
            bwd_input: 2.0,
            bwd_weight: 1.0,
            again: [Again::default(), again, Again::default()],
            ..Item::default()
        })
        .collect();
    let s = stage_cost(&items, Recompute::Selective);
    // Three items: each pays its own, the first two the next one's reads besides.
    assert_eq!((s.b, s.w), (3.0 * 3.0 + 0.5, 3.0 * 1.5 + 0.25));
    let one = stage_cost(&items[..1], Recompute::Selective);
    assert_eq!((one.b, one.w), (3.0, 1.5));
    let none = stage_cost(&items, Recompute::None);
    assert_eq!((none.b, none.w), (6.0, 3.0));
}

/// A gradient sent past the stage before (a tied weight's, from the head back to the
/// embeddings) is one message after `B` between the two stages' ranks, priced at the
/// network level their distance reaches, and nothing when the two items share a
/// stage or a rank; it lengthens the pipeline of a plan that cuts between them.
#[test]
fn tied_gradients_are_sent_between_stages() {
    let bytes = 64u64 << 20;
    let mut items: Vec<Item> = (0..4)
        .map(|i| Item {
            name: format!("i{i}"),
            fwd: 1e-3,
            bwd_input: 1e-3,
            bwd_weight: 1e-3,
            ..Item::default()
        })
        .collect();
    items[3].grad_sends = vec![(0, bytes)];
    let p = profile(items);
    let cluster = cost::preset("dgx-a100").unwrap();
    let config = |pp: u64, tp: u64, stage_starts: Vec<usize>, schedule| Config {
        tp,
        ..plan(pp, 2, schedule, stage_starts)
    };
    for (schedule, starts) in [
        (ScheduleKind::OneFOneB, vec![0, 1, 2, 3]),
        (ScheduleKind::Interleaved, vec![0, 1, 2, 3]),
    ] {
        let pp = if schedule == ScheduleKind::Interleaved {
            2
        } else {
            4
        };
        for tp in [1, 8] {
            let c = config(pp, tp, starts.clone(), Some(schedule));
            let rank = rank_of(&c);
            let t = grad_send_times(&p, &c, &cluster, &rank);
            // The last stage's rank is pp - 1 ranks from the first one's, tp devices each.
            let apart = (rank[3] - rank[0]) as u64 * tp;
            assert_eq!(t[..3], [0.0; 3]);
            assert_eq!(
                t[3],
                cluster.p2p_time(apart + 1, bytes),
                "{schedule:?} tp{tp}"
            );
        }
    }
    // Across nodes (8 devices a rank) the message is dearer than within one.
    let near = grad_send_times(
        &p,
        &config(4, 1, vec![0, 1, 2, 3], None),
        &cluster,
        &[0, 1, 2, 3],
    );
    let far = grad_send_times(
        &p,
        &config(4, 8, vec![0, 1, 2, 3], None),
        &cluster,
        &[0, 1, 2, 3],
    );
    assert!(far[3] > near[3] && near[3] > 0.0, "{near:?} {far:?}");
    // Head and embeddings on one stage, or on two chunks of one rank: no message.
    let one = config(1, 1, vec![0], None);
    assert_eq!(grad_send_times(&p, &one, &cluster, &[0]), [0.0]);
    let v = config(1, 1, vec![0, 2], Some(ScheduleKind::OneFOneB));
    assert_eq!(grad_send_times(&p, &v, &cluster, &[0, 0]), [0.0, 0.0]);
    let mut sim = HashMap::new();
    let with = score(
        &p,
        &config(4, 1, vec![0, 1, 2, 3], Some(ScheduleKind::OneFOneB)),
        &cluster,
        u64::MAX,
        &mut sim,
    )
    .unwrap();
    let mut bare = p.clone();
    bare.items[3].grad_sends.clear();
    let without = score(
        &bare,
        &config(4, 1, vec![0, 1, 2, 3], Some(ScheduleKind::OneFOneB)),
        &cluster,
        u64::MAX,
        &mut HashMap::new(),
    )
    .unwrap();
    assert!(
        with.pipeline > without.pipeline,
        "{} {}",
        with.pipeline,
        without.pipeline
    );
}

/// A cut between two stages of one rank (ZB-V's turn) sends nothing; a cut between two
/// ranks costs its message, at the level the ranks' devices span.
#[test]
fn the_v_turn_sends_nothing() {
    let cluster = cost::preset("dgx-a100").unwrap();
    let step = |cuts: [u64; 4]| {
        let items: Vec<Item> = cuts
            .iter()
            .enumerate()
            .map(|(i, &cut)| Item {
                name: format!("i{i}"),
                fwd: 1e-3,
                bwd_input: 1e-3,
                bwd_weight: 1e-3,
                cut,
                ..Item::default()
            })
            .collect();
        let c = Config {
            tp: 8,
            ..plan(2, 4, Some(ScheduleKind::ZbV), vec![0, 1, 2, 3])
        };
        score(&profile(items), &c, &cluster, u64::MAX, &mut HashMap::new())
            .unwrap()
            .pipeline
    };
    let small = 1 << 10;
    let big = 1 << 30;
    // Stage 1 and 2 are rank 1's: its cut is a hand-over, whatever its size.
    assert_eq!(step([small; 4]), step([small, big, small, small]));
    // Stage 0 sends to rank 1 across the nodes (8 devices a rank).
    assert!(step([big, small, small, small]) > step([small; 4]) + 0.01);
}

/// The loss's once-a-step work: the micro-batches' losses added up (one add fewer than
/// there are micro-batches) and one all_reduce over dp and the devices it is partial
/// over besides, on the rank that computes it.
#[test]
fn the_loss_is_reduced_once_a_step() {
    let cluster = cost::preset("dgx-h100").unwrap();
    let loss = (4u64, 1u64, 16.0);
    let config = |dp: u64, tp: u64, microbatches: u64| Config {
        dp,
        tp,
        ..plan(1, microbatches, None, vec![0])
    };
    let add = cost::accumulate_seconds(&cluster.device, 1.0, 12.0);
    assert_eq!(loss_time(&cluster, &config(1, 1, 1), loss, 1), 0.0);
    assert_eq!(loss_time(&cluster, &config(1, 1, 4), loss, 1), 3.0 * add);
    assert_eq!(loss_time(&cluster, &config(1, 4, 4), (0, 0, 0.0), 4), 0.0);
    let reduce = |members, span| {
        cost::collective_op_seconds(&cluster, "nns.all_reduce", (members, span), (4.0, 4.0), 4.0)
    };
    // dp 2 (ranks 4 devices apart: tp 4), and dp x tp when the loss is partial over tp.
    assert_eq!(loss_time(&cluster, &config(2, 4, 1), loss, 1), reduce(2, 5));
    assert_eq!(
        loss_time(&cluster, &config(2, 4, 3), loss, 4),
        reduce(8, 8) + 2.0 * add
    );
    assert!(reduce(2, 5) > 0.0);
}

/// ZeRO-3 gathers in each fragment the parameters it reads: every one in `F`, in the
/// backward only those its ops read (the stage's reads under the plan's recompute
/// policy), so a backward that reads none gathers none, and a split backward gathers
/// `B`'s and `W`'s reads in their own fragments.
#[test]
fn zero3_gathers_what_each_fragment_reads() {
    let one = (1u64 << 20, 1, (1u64 << 20) as f64 * (1u64 << 20) as f64);
    let two = (2 * one.0, 2, 2.0 * one.2);
    let reads = |b: [Tensors; 3], w: [Tensors; 3]| BackwardReads {
        b,
        w,
        bw: [0, 1, 2].map(|r| (b[r].0 + w[r].0, b[r].1 + w[r].1, b[r].2 + w[r].2)),
    };
    let none = (0, 0, 0.0);
    let item = |name: &str, backward_reads| Item {
        name: name.into(),
        fwd: 1e-3,
        bwd_input: 1e-3,
        bwd_weight: 1e-3,
        params: 4 * one.0,
        tensors: 4,
        params_sq: 4.0 * one.2,
        backward_reads,
        ..Item::default()
    };
    let cluster = cost::preset("dgx-h100").unwrap();
    // Two stages of one item each, dp2 pp2, 2 micro-batches, ZeRO-3: (pipeline, dp_comm).
    let estimate = |backward_reads: BackwardReads, schedule| {
        let p = profile(vec![item("i0", backward_reads), item("i1", backward_reads)]);
        let c = Config {
            dp: 2,
            zero: 3,
            ..plan(2, 2, Some(schedule), vec![0, 1])
        };
        let e = score(&p, &c, &cluster, u64::MAX, &mut HashMap::new()).unwrap();
        (e.pipeline, e.dp_comm)
    };
    let step = |b, w, schedule| estimate(reads(b, w), schedule);
    let gather = |t: Tensors| coll_time(&cluster, "nns.all_gather", 2, 1, t);
    for schedule in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
        let (bare, bare_comm) = step([none; 3], [none; 3], schedule);
        let (read, read_comm) = step([two; 3], [none; 3], schedule);
        // Each of the 2 micro-batches' backward gathers the two parameters it reads
        // (dp_comm: the busiest pipeline rank's).
        let more = read_comm - bare_comm;
        assert!((more - 2.0 * gather(two)).abs() < 1e-12, "{more}");
        assert!(read > bare, "{schedule:?}");
        // The plan's policy picks its reads: none under `none` here.
        let (full_only, _) = step([none, none, two], [none; 3], schedule);
        assert_eq!(full_only, bare);
    }
    // One parameter read on both sides: an unsplit backward gathers it once, a split
    // one in `B` and again in `W` (the first stage has no `B`: once, in `W`).
    let both = BackwardReads {
        b: [one; 3],
        w: [one; 3],
        bw: [one; 3],
    };
    let comm = |schedule, backward_reads| estimate(backward_reads, schedule).1;
    for (schedule, gathers) in [(ScheduleKind::OneFOneB, 2.0), (ScheduleKind::ZbH1, 4.0)] {
        let more = comm(schedule, both) - comm(schedule, BackwardReads::default());
        assert!(
            (more - gathers * gather(one)).abs() < 1e-12,
            "{schedule:?} {more}"
        );
    }
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
