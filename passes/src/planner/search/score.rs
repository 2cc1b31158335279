//! Scoring a plan: its stages' costs, the simulated schedule, the synchronisation,
//! accumulation and update times, memory, and the lower bounds the search orders plans by.

use super::*;

pub(super) fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|&d| n.is_multiple_of(d)).collect()
}

/// The seconds and bytes of a stage of items `lo..hi` under a recompute policy.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct StageCost {
    pub(super) f: f64,
    pub(super) b: f64,
    pub(super) w: f64,
    pub(super) params: u64,
    pub(super) tensors: u64,
    pub(super) params_sq: f64,
    /// The parameters the backward's fragments read ([`Item::backward_reads`]) under the
    /// stage's recompute policy: `B`, `W`, and an unsplit backward.
    pub(super) reads_b: Tensors,
    pub(super) reads_w: Tensors,
    pub(super) reads_bw: Tensors,
    /// The gradients the micro-batches' pieces are added up in ([`Item::accumulated`]).
    pub(super) accumulated: Tensors,
    /// The step's loss, when the stage computes it, and the devices besides dp it is
    /// reduced over ([`Item::loss`]).
    pub(super) loss: Tensors,
    pub(super) loss_group: u64,
    pub(super) saved: u64,
    /// The largest item's activations while it is recomputed.
    pub(super) transient: u64,
    pub(super) flops: f64,
    pub(super) cut: u64,
    pub(super) comm: f64,
    pub(super) grad_sync: f64,
}

pub(super) fn stage_cost(items: &[Item], r: Recompute) -> StageCost {
    let mut s = StageCost::default();
    for (i, it) in items.iter().enumerate() {
        s.f += it.fwd;
        // What the policy runs again; what only the next item reads, when it is here.
        let again = &it.again[r as usize];
        let next = i + 1 < items.len();
        s.b += it.bwd_input + again.b + if next { again.next_b } else { 0.0 };
        s.w += it.bwd_weight + again.w + if next { again.next_w } else { 0.0 };
        s.params += it.params;
        s.tensors += it.tensors;
        s.params_sq += it.params_sq;
        // `BackwardReads` is indexed in `Recompute`'s order: none, selective, full.
        let policy = r as usize;
        let reads = &it.backward_reads;
        for (sum, add) in [
            (&mut s.reads_b, reads.b[policy]),
            (&mut s.reads_w, reads.w[policy]),
            (&mut s.reads_bw, reads.bw[policy]),
        ] {
            add_tensors(sum, add);
        }
        add_tensors(&mut s.accumulated, it.accumulated);
        add_tensors(&mut s.loss, it.loss);
        s.loss_group = s.loss_group.max(it.loss_group);
        s.flops += it.flops;
        s.comm += it.comm;
        s.grad_sync += it.grad_sync;
        match r {
            Recompute::None => s.saved += it.saved,
            // (An item recomputed holds its activations again while its backward runs.)
            Recompute::Selective => {
                s.saved += it.saved_selective.min(it.saved);
                if it.again[Recompute::Full as usize].seconds() > 0.0 {
                    s.transient = s.transient.max(it.saved);
                }
            }
            Recompute::Full => {
                s.saved += it.saved_full.min(it.saved);
                if it.again[Recompute::Full as usize].seconds() > 0.0 {
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
pub(super) fn coll_time(
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
    // Each tensor's collective as `predict` prices one (its message the byte-weighted
    // mean tensor).
    n * cost::collective_op_seconds(
        cluster,
        op,
        (group, span),
        (operand / n, result / n),
        sq / b,
    )
}

/// Parameter tensors for their collectives: bytes in all, how many, and each one's bytes
/// squared, summed ([`Item::params_sq`]).
pub(super) type Tensors = (u64, u64, f64);

/// Adds tensors `b` to `a`.
pub(super) fn add_tensors(a: &mut Tensors, b: Tensors) {
    a.0 += b.0;
    a.1 += b.1;
    a.2 += b.2;
}

/// One tensor of `bytes`.
pub(super) fn one_tensor(bytes: u64) -> Tensors {
    (bytes, 1, (bytes as f64).powi(2))
}

/// Chunks (stages per pipeline rank) of plan `c`.
pub(super) fn chunks(c: &Config) -> usize {
    (c.stage_starts.len() / (c.pp as usize).max(1)).max(1)
}

/// A verified schedule, or why it cannot be made.
pub(super) type Made = Result<schedule::Schedule, String>;

thread_local! {
    /// Schedules made and verified, by (name, ranks, micro-batches, chunks): a search simulates
    /// each with many stage costs.
    static SCHEDULES: std::cell::RefCell<HashMap<(ScheduleKind, usize, usize, usize), Made>> =
        std::cell::RefCell::new(HashMap::new());
}

/// The stages of plan `c`: their items' costs under its recompute policy.
pub(super) fn stages_of(p: &Profile, c: &Config) -> Vec<StageCost> {
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
                st.reads_w = st.reads_bw;
                st.reads_b = (0, 0, 0.0);
            }
            st
        })
        .collect()
}

/// The pipeline rank of each of plan `c`'s stages (one per rank, interleaved chunks
/// `s % pp`, or ZB-V's V).
pub(super) fn rank_of(c: &Config) -> Vec<usize> {
    let pp = (c.pp as usize).max(1);
    c.schedule
        .unwrap_or(ScheduleKind::OneFOneB)
        .device_of(pp, c.stage_starts.len())
}

/// Bytes of parameters, gradients and the two Adam moments of `params` parameter bytes,
/// sharded over dp by plan `c`'s ZeRO stage.
pub(super) fn state_bytes(c: &Config, params: u64) -> u64 {
    let shard = |on: bool| if on { params.div_ceil(c.dp) } else { params };
    shard(c.zero >= 3) + shard(c.zero >= 2) + 2 * shard(c.zero >= 1)
}

/// Seconds of the gradient synchronisation of `params` ([`Tensors`]) over dp:
/// all_reduce; ZeRO-1/2: reduce_scatter + all_gather; ZeRO-3: reduce_scatter; one
/// collective per tensor. A split of the positions (sp) leaves weight gradients partial
/// over it as dp's batch does: without ZeRO one all_reduce over dp x sp; with ZeRO (which
/// shards over dp) an all_reduce over sp first, then dp's collectives, as the compiler
/// emits them.
pub(super) fn sync_time(cluster: &Cluster, c: &Config, params: Tensors) -> f64 {
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
pub(super) fn sync_skew(
    cluster: &Cluster,
    c: &Config,
    since: f64,
    (tensors, update): (u64, f64),
) -> f64 {
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

/// Seconds of adding up `microbatches` micro-batches' gradients (bytes and tensors as
/// accumulated, [`Item::accumulated`]): the compiled step adds each gradient tensor's
/// pieces one `dnn.add` at a time (`microbatches - 1` adds of each, f32, memory-bound,
/// out of the cache: [`cost::accumulate_seconds`]).
pub(super) fn accumulate_time(
    cluster: &Cluster,
    (bytes, tensors, _): Tensors,
    microbatches: u64,
) -> f64 {
    if microbatches <= 1 || tensors == 0 {
        return 0.0;
    }
    let d = &cluster.device;
    let n = tensors as f64;
    let (elems, moved) = (bytes as f64 / 4.0 / n, 3.0 * bytes as f64 / n);
    let one = cost::accumulate_seconds(d, elems, moved);
    (microbatches - 1) as f64 * n * one
}

/// Seconds of the optimizer update of `params` bytes in `tensors` tensors of the
/// profile's parameters: from ZeRO-1 on over dp shards, all but the ops' fixed costs (each
/// tensor's update is still one op a device); under ZeRO-1 and 2 each tensor's parameter
/// is first sliced to the shard (`nns.slice`: a launch and a copy of the shard).
pub(super) fn update_time(
    p: &Profile,
    c: &Config,
    cluster: &Cluster,
    (params, tensors): (u64, u64),
) -> f64 {
    let total: u64 = p.items.iter().map(|i| i.params).sum::<u64>().max(1);
    let total_tensors: u64 = p.items.iter().map(|i| i.tensors).sum::<u64>().max(1);
    let sharded = c.zero >= 1 && c.dp > 1;
    let fixed = p.optimizer_fixed * tensors as f64 / total_tensors as f64;
    let rest = (p.optimizer - p.optimizer_fixed).max(0.0) * params as f64
        / total as f64
        / if sharded { c.dp as f64 } else { 1.0 };
    let slices = if sharded && c.zero <= 2 {
        let d = &cluster.device;
        tensors as f64 * d.op_overhead + 2.0 * params as f64 / c.dp as f64 / d.memory_bandwidth
    } else {
        0.0
    };
    fixed + rest + slices
}

/// Seconds of the loss's once-a-step work on the rank that computes it: adding up the
/// `microbatches` losses, and their reduction over dp (by rank: sp x tp devices apart)
/// and the `group` devices besides (its partial sums over tp and sp: then one
/// collective over all of them).
pub(super) fn loss_time(
    cluster: &Cluster,
    c: &Config,
    (bytes, tensors, _): Tensors,
    group: u64,
) -> f64 {
    if tensors == 0 {
        return 0.0;
    }
    let members = c.dp * group.max(1);
    let span = if group > 1 {
        c.dp * c.sp * c.tp
    } else {
        (c.dp - 1) * c.sp * c.tp + 1
    };
    let b = bytes as f64;
    let reduce = if members > 1 {
        cost::collective_op_seconds(cluster, "nns.all_reduce", (members, span), (b, b), b)
    } else {
        0.0
    };
    let adds = c.microbatches.saturating_sub(1) as f64
        * cost::accumulate_seconds(&cluster.device, b / 4.0, 3.0 * b);
    reduce + adds
}

/// Per stage of plan `c`, the seconds of the gradients its backward sends past the stage
/// before it ([`Item::grad_sends`]: a tied weight's), one message each after `B`, at the
/// network level between the two stages' ranks (none between chunks of one rank).
pub(super) fn grad_send_times(
    p: &Profile,
    c: &Config,
    cluster: &Cluster,
    rank: &[usize],
) -> Vec<f64> {
    let starts = &c.stage_starts;
    let stage_of = |item: usize| starts.iter().rposition(|&lo| lo <= item).unwrap_or(0);
    (0..starts.len())
        .map(|s| {
            let lo = starts[s];
            let hi = starts.get(s + 1).copied().unwrap_or(p.items.len());
            p.items[lo..hi]
                .iter()
                .flat_map(|it| &it.grad_sends)
                .filter(|&&(to, _)| to < lo)
                .map(|&(to, bytes)| message_time(cluster, c, rank, (s, stage_of(to)), bytes))
                .sum()
        })
        .collect()
}

/// Seconds of a message of `bytes` from one stage's pipeline rank to another's (`rank`:
/// each stage's), at the network level their devices span (the next rank is dp x sp x tp
/// devices away; the interleaved schedule's last chunk sends back to the first rank);
/// none between two stages of one rank (ZB-V's turn). The compiled timeline's rule.
pub(super) fn message_time(
    cluster: &Cluster,
    c: &Config,
    rank: &[usize],
    (from, to): (usize, usize),
    bytes: u64,
) -> f64 {
    let ranks = rank[from].abs_diff(rank[to]) as u64;
    if ranks == 0 {
        0.0
    } else {
        cluster.p2p_time(ranks * c.dp * c.sp * c.tp + 1, bytes)
    }
}

/// Why [`score`] gives a plan no estimate.
#[derive(Debug, thiserror::Error)]
pub(super) enum Unscored {
    /// Its memory per device exceeds the cap: out of memory (the search then keeps the
    /// least memory it saw, to name it when no plan fits).
    #[error("needs {} per device, more than {}", bytes_text(*needs), bytes_text(*cap))]
    OutOfMemory { needs: u64, cap: u64 },
    /// Its schedule cannot be made or simulated.
    #[error("{0}")]
    Other(String),
}

/// Scores one plan. `Err` says why it is out.
pub(super) fn score(
    p: &Profile,
    c: &Config,
    cluster: &Cluster,
    cap: u64,
    sim: &mut HashMap<String, schedule::Timeline>,
) -> Result<Estimate, Unscored> {
    let ch = chunks(c);
    let st = stages_of(p, c);
    let stages = st.len();
    let (dp, tp, pp) = (c.dp, c.tp, c.pp as usize);
    // Per-fragment extras: the point-to-point sends ([`message_time`]), and ZeRO-3's
    // gathers of the parameters the fragment reads.
    let split = c.schedule.is_some_and(ScheduleKind::split_backward);
    let gather = |s: &StageCost, kind: Kind| {
        let reads = match kind {
            Kind::F => (s.params, s.tensors, s.params_sq),
            Kind::B if split => s.reads_b,
            Kind::B => s.reads_bw,
            Kind::W => s.reads_w,
        };
        if c.zero == 3 && reads.1 > 0 {
            // dp's ranks are sp x tp devices apart. The compiler gathers each parameter
            // right before its first use in the fragment, so every gather waits for the
            // dp group's slowest, which met at the gather before, a tensor's share of
            // the stage's compute earlier.
            let share = 0.5 * (s.f + s.b + s.w) / s.tensors.max(1) as f64;
            coll_time(cluster, "nns.all_gather", dp, c.sp * tp, reads)
                + reads.1 as f64 * cluster.device.skew(dp, share)
        } else {
            0.0
        }
    };
    let device_of = rank_of(c);
    let grad_sends = grad_send_times(p, c, cluster, &device_of);
    let hop = |from: usize, to: usize, bytes: u64| {
        message_time(cluster, c, &device_of, (from, to), bytes)
    };
    let frag = |a: Action| -> f64 {
        let s = &st[a.stage];
        let send = if a.kind == Kind::F && a.stage + 1 < stages {
            hop(a.stage, a.stage + 1, s.cut)
        } else if a.kind == Kind::B && a.stage > 0 {
            hop(a.stage, a.stage - 1, st[a.stage - 1].cut) + grad_sends[a.stage]
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
        let wait = crate::planner::timeline::receive_wait(&cluster.device, a, &device_of, work);
        match a.kind {
            Kind::W => work + gather(s, a.kind),
            _ => work + send + gather(s, a.kind) + wait,
        }
    };
    let m = c.microbatches as usize;
    let (makespan, in_flight, bubble, pp_comm) = if pp == 1 && c.schedule.is_none() {
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
                let kind = c
                    .schedule
                    .ok_or_else(|| Unscored::Other("a pipeline without a schedule".into()))?;
                let s = SCHEDULES
                    .with(|cache| {
                        cache
                            .borrow_mut()
                            .entry((kind, pp, m, ch))
                            .or_insert_with(|| {
                                let s = kind.make(pp, m, ch)?;
                                schedule::verify(&s)?;
                                Ok(s)
                            })
                            .clone()
                    })
                    .map_err(Unscored::Other)?;
                let t = schedule::simulate_verified(&s, &frag).map_err(Unscored::Other)?;
                sim.insert(key, t.clone());
                t
            }
        };
        let sends: f64 = (0..stages.saturating_sub(1))
            .map(|s| 2.0 * hop(s, s + 1, st[s].cut))
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
        let update = update_time(p, c, cluster, (params, tensors));
        let dp_sync = sync_time(cluster, c, (params, tensors, sq))
            + if tensors > 0 {
                sync_skew(cluster, c, makespan, (tensors, update))
            } else {
                0.0
            };
        let grad_sync: f64 = mine.iter().map(|s| s.grad_sync).sum();
        let loss = mine
            .iter()
            .map(|s| loss_time(cluster, c, s.loss, s.loss_group))
            .sum::<f64>();
        sync = sync.max(dp_sync + grad_sync + loss);
        let mut accumulated = (0, 0, 0.0);
        for s in &mine {
            add_tensors(&mut accumulated, s.accumulated);
        }
        opt = opt.max(update + accumulate_time(cluster, accumulated, c.microbatches));
        flops = flops.max(mine.iter().map(|s| s.flops).sum::<f64>() * m as f64);
        tp_comm = tp_comm.max(mine.iter().map(|s| s.comm).sum::<f64>() * m as f64 + grad_sync);
        let gathers: f64 = mine
            .iter()
            .map(|s| {
                let backward = if split {
                    gather(s, Kind::B) + gather(s, Kind::W)
                } else {
                    gather(s, Kind::B)
                };
                gather(s, Kind::F) + backward
            })
            .sum::<f64>()
            * m as f64;
        dp_comm = dp_comm.max(dp_sync + gathers);
    }
    if memory > cap {
        return Err(Unscored::OutOfMemory { needs: memory, cap });
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
pub(super) fn memory_lower_bound(p: &Profile, c: &Config) -> u64 {
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
pub(super) fn lower_bound(p: &Profile, c: &Config, cluster: &Cluster) -> f64 {
    let pp = (c.pp as usize).max(1);
    let rank = rank_of(c);
    let mut work = vec![0.0f64; pp];
    let mut params: Vec<Tensors> = vec![(0, 0, 0.0); pp];
    let mut accumulated: Vec<Tensors> = vec![(0, 0, 0.0); pp];
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
        add_tensors(&mut accumulated[rank[s]], sc.accumulated);
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
                + update_time(p, c, cluster, (params[d].0, params[d].1))
                + accumulate_time(cluster, accumulated[d], c.microbatches)
        })
        .fold(0.0, f64::max)
}
