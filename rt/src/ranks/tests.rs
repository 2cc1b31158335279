//! Unit tests of `ranks`.

use super::{runs, shared_plan, Flat, Gate, Groups, HostComm, Shared};

/// `shared_plan`'s steps run one after another compute each collective: sums in
/// member order (the same bits as `((a + b) + c)`), in place where a member's `recv`
/// is its `send`; a `recv` overlapping what is read is refused.
#[test]
fn shared_plans_compute_the_collectives_in_member_order() {
    let n = 5usize;
    // Three members' memory in one space: send at k * 4n, recv at 12n + k * 4n
    // (f32 indices k * n and 3n + k * n).
    let mut mem: Vec<f32> = (0..6 * n).map(|i| 0.1 + (i as f32) * 0.37).collect();
    let base = mem.as_mut_ptr() as usize;
    let at = |i: usize| base + 4 * i;
    let run = |ops: &[Flat<usize>]| {
        let steps = shared_plan(ops).unwrap();
        // SAFETY: every span lies in `mem`, which nothing else touches meanwhile.
        unsafe { HostComm::execute(&steps) };
        steps
    };
    let before = mem.clone();
    let sum: Vec<f32> = (0..n)
        .map(|i| (before[i] + before[n + i]) + before[2 * n + i])
        .collect();
    // Out of place: every member's recv gets the sum.
    let ops: Vec<Flat<usize>> = (0..3)
        .map(|k| Flat::AllReduce {
            send: at(k * n),
            recv: at(3 * n + k * n),
            n: n as u64,
            max: false,
        })
        .collect();
    let steps = run(&ops);
    for k in 0..3 {
        assert_eq!(mem[3 * n + k * n..4 * n + k * n], sum[..], "member {k}");
    }
    assert_eq!(steps.len(), 1 + 2 + 2, "{steps:?}");
    // In place (recv = send): the same bits.
    mem.copy_from_slice(&before);
    let ops: Vec<Flat<usize>> = (0..3)
        .map(|k| Flat::AllReduce {
            send: at(k * n),
            recv: at(k * n),
            n: n as u64,
            max: false,
        })
        .collect();
    run(&ops);
    for k in 0..3 {
        assert_eq!(mem[k * n..(k + 1) * n], sum[..], "member {k} in place");
    }
    // A reduce-scatter (maximum) over 2 members: pieces of n f32s, send 2n each.
    let m = 2usize;
    mem.copy_from_slice(&before);
    let ops: Vec<Flat<usize>> = (0..m)
        .map(|k| Flat::ReduceScatter {
            send: at(k * 2 * n),
            recv: at(4 * n + k * n),
            n: n as u64,
            max: true,
        })
        .collect();
    run(&ops);
    for k in 0..m {
        for i in 0..n {
            let want = before[k * n + i].max(before[2 * n + k * n + i]);
            assert_eq!(mem[4 * n + k * n + i], want, "piece {k}");
        }
    }
    // Member 1's recv over member 0's send: refused, naming the overlap.
    let ops = vec![
        Flat::AllGather {
            send: at(0),
            recv: at(2 * n),
            bytes: 4 * n as u64,
        },
        Flat::AllGather {
            send: at(n),
            recv: at(0),
            bytes: 4 * n as u64,
        },
    ];
    let e = shared_plan(&ops).unwrap_err();
    assert!(e.contains("over") && e.contains("it reads"), "{e}");
    // A broadcast from member 1 copies its send to every other recv, itself in place.
    let ops: Vec<Flat<usize>> = (0..3)
        .map(|k| Flat::Broadcast {
            send: at(k * n),
            recv: at(k * n),
            bytes: 4 * n as u64,
            root: 1,
        })
        .collect();
    assert_eq!(
        shared_plan(&ops).unwrap(),
        [
            Shared::Copy {
                src: at(n),
                dst: at(0),
                bytes: 4 * n as u64
            },
            Shared::Copy {
                src: at(n),
                dst: at(2 * n),
                bytes: 4 * n as u64
            }
        ]
    );
}

/// Repeated runs on threads: while every device joins the same collectives, all
/// runs complete; when a device joins one more collective in its second run than
/// the other, it is reported as a deadlock (the other is done with that run and waits
/// at the next run's gate), and the other stops at its gate, instead of both hanging.
#[test]
fn repeated_runs_report_a_deadlock_instead_of_hanging() {
    let groups = Groups {
        list: vec![vec![0, 1]],
        index: [(vec![0, 1], 0)].into(),
    };
    type Runs = Result<(Vec<f64>, Option<()>), String>;
    let go = |extra_in_run: Option<usize>| -> Vec<Runs> {
        let comm = HostComm::new(2, &groups);
        let gate = Gate::new(2);
        let (comm, gate) = (&comm, &gate);
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..2usize)
                .map(|d| {
                    sc.spawn(move || {
                        let mut mem = vec![d as f32 + 1.0; 4];
                        let at = mem.as_mut_ptr() as usize;
                        let mut run = 0;
                        let all_reduce = || Flat::AllReduce {
                            send: at,
                            recv: at,
                            n: 4,
                            max: false,
                        };
                        let r = runs(
                            comm,
                            gate,
                            d,
                            3,
                            || Ok(()),
                            |_| {
                                run += 1;
                                let times = if d == 1 && extra_in_run == Some(run) {
                                    2
                                } else {
                                    1
                                };
                                for _ in 0..times {
                                    // SAFETY: `mem` is this thread's, untouched until
                                    // the collective returns.
                                    unsafe { comm.collective(d, 0, d, all_reduce()) }?;
                                }
                                Ok(())
                            },
                            |_| Ok(()),
                        );
                        comm.finish(d, &r.as_ref().map(|_| ()).map_err(Clone::clone));
                        if r.is_err() {
                            gate.fail();
                        }
                        r
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let fine = go(None);
    assert!(
        fine.iter()
            .all(|r| r.as_ref().is_ok_and(|t| t.0.len() == 3)),
        "{fine:?}"
    );
    let stuck = go(Some(2));
    let e = stuck[1].as_ref().unwrap_err();
    assert!(
        e.contains("deadlock") && e.contains("device 1 waits for all_reduce"),
        "{e}"
    );
    assert_eq!(
        stuck[0].as_ref().unwrap_err(),
        "stopped: another device failed"
    );
}

/// Devices pass the gate together run after run; one that fails lets the others go
/// with an error instead of leaving them waiting for it.
#[test]
fn the_gate_opens_together_and_on_failure() {
    let gate = Gate::new(3);
    let passed: Vec<usize> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..3)
            .map(|_| sc.spawn(|| (0..5).filter(|_| gate.wait().is_ok()).count()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(passed, [5, 5, 5]);
    let gate = Gate::new(3);
    let got: Vec<Result<(), String>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2).map(|_| sc.spawn(|| gate.wait())).collect();
        gate.fail();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(got
        .iter()
        .all(|r| r == &Err("stopped: another device failed".to_string())));
}
