//! Unit tests of `schedule`.

use super::*;

#[test]
fn kinds_and_names_agree() {
    let names: Vec<&str> = ScheduleKind::ALL.iter().map(|k| k.name()).collect();
    assert_eq!(names, NAMES);
    for k in ScheduleKind::ALL {
        let s = k.make(4, 8, 2).unwrap();
        assert_eq!(s.name, k.name());
        assert_eq!(s.split_backward, k.split_backward());
        assert_eq!(s.device_of, k.device_of(4, s.stages));
    }
    assert!(ScheduleKind::parse("2f2b")
        .unwrap_err()
        .contains("schedules: gpipe, 1f1b"));
}

#[test]
fn ticks_are_round_and_inside_the_range() {
    assert_eq!(
        ticks(0.0, 1.9684, 10.0),
        ((0..=9).map(|k| k as f64 * 0.2).collect(), 1)
    );
    let (t, d) = ticks(2.67, 3.34, 6.0);
    assert_eq!(d, 1);
    assert!(t.iter().all(|&v| (2.67..=3.34).contains(&v)));
    assert_eq!(t.len(), 3);
    assert_eq!(
        ticks(1.0, 60.0, 8.0).0,
        vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    );
    assert_eq!(ticks(5.0, 5.0, 8.0).0, vec![5.0]);
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// The closed forms, unit costs, for p in {2, 4, 8} and m in {p, 2p, 4p}.
#[test]
fn closed_forms() {
    let c = Costs::default();
    for p in [2usize, 4, 8] {
        for m in [p, 2 * p, 4 * p] {
            let work = 3.0 * m as f64;
            for (name, idle) in [
                ("gpipe", 3.0 * (p - 1) as f64),
                ("1f1b", 3.0 * (p - 1) as f64),
                ("zb-h1", (p - 1) as f64),
            ] {
                let s = by_name(name, p, m, 1).unwrap();
                let t = simulate(&s, c).unwrap();
                assert!(
                    close(t.makespan, work + idle),
                    "{name} p={p} m={m}: makespan {} != {}",
                    t.makespan,
                    work + idle
                );
                for (r, i) in t.idle().iter().enumerate() {
                    assert!(close(*i, idle), "{name} p={p} m={m} device {r}: idle {i}");
                }
            }
            for v in [2usize, 4] {
                let s = interleaved(p, v, m).unwrap();
                let t = simulate(&s, c).unwrap();
                let idle = 3.0 * (p - 1) as f64 / v as f64;
                assert!(
                    close(t.makespan, work + idle),
                    "interleaved v={v} p={p} m={m}: makespan {} != {}",
                    t.makespan,
                    work + idle
                );
            }
        }
    }
}

#[test]
fn the_reference_numbers() {
    let c = Costs::default();
    let t = |s: Schedule| simulate(&s, c).unwrap().makespan;
    assert!(close(t(gpipe(4, 8).unwrap()), 33.0));
    assert!(close(t(one_f_one_b(4, 8).unwrap()), 33.0));
    assert!(close(t(zb_h1(4, 8).unwrap()), 27.0));
    assert!(close(t(interleaved(4, 2, 8).unwrap()), 28.5));
    // tW = 0.5: 1F1B 27.5, ZB-H1 24.5 = 3 m (tF+tB+tW) ... + (p-1)(tF+tB-tW).
    let half = Costs {
        w: 0.5,
        ..Costs::default()
    };
    assert!(close(
        simulate(&one_f_one_b(4, 8).unwrap(), half)
            .unwrap()
            .makespan,
        27.5
    ));
    assert!(close(
        simulate(&zb_h1(4, 8).unwrap(), half).unwrap().makespan,
        24.5
    ));
}

/// ZB-V against the reference simulation numbers (tF = tB = tW = 1 per stage, chunks
/// cost 1/2): p=4 m=8 makespan 25.5, idle 1.5 per device; p=4 m=16 49.5; p=8 m=32
/// 99.5, idle 3.5; p micro-batches in flight on every device; and m < 2p - 1 works.
#[test]
fn zb_v_reference_numbers() {
    let c = Costs::default();
    for (p, m, makespan, idle) in [(4, 8, 25.5, 1.5), (4, 16, 49.5, 1.5), (8, 32, 99.5, 3.5)] {
        let s = zb_v(p, m).unwrap();
        assert_eq!(s.device_of, v_placement(p));
        let t = simulate(&s, c).unwrap();
        assert!(
            close(t.makespan, makespan),
            "zb-v p={p} m={m}: {}",
            t.makespan
        );
        for (r, i) in t.idle().iter().enumerate() {
            assert!(close(*i, idle), "zb-v p={p} m={m} device {r}: idle {i}");
        }
        for (r, x) in t.peak_in_flight.iter().enumerate() {
            assert!(close(*x, p as f64), "zb-v p={p} m={m} device {r}: peak {x}");
        }
    }
    for m in 1..8 {
        simulate(&zb_v(4, m).unwrap(), c).unwrap();
    }
    assert_eq!(v_placement(3), vec![0, 1, 2, 2, 1, 0]);
}

#[test]
fn peaks_in_flight_by_stage() {
    for (p, m) in [(2, 4), (4, 8), (4, 2), (3, 7)] {
        // One stage per rank: 1F1B and ZB-H1 hold min(p - s, m), GPipe all m.
        for name in ["1f1b", "zb-h1"] {
            let s = by_name(name, p, m, 1).unwrap();
            let want: Vec<usize> = (0..p).map(|r| (p - r).min(m)).collect();
            assert_eq!(peak_in_flight_by_stage(&s), want, "{name} p={p} m={m}");
        }
        let s = by_name("gpipe", p, m, 1).unwrap();
        assert_eq!(peak_in_flight_by_stage(&s), vec![m; p], "gpipe p={p} m={m}");
    }
    // Two stages per rank: never more than m, never fewer than one, and a rank's
    // stages together hold at least what its timeline holds at its peak.
    for (name, p, m) in [
        ("interleaved", 2, 4),
        ("interleaved", 4, 8),
        ("zb-v", 2, 4),
        ("zb-v", 4, 8),
    ] {
        let s = by_name(name, p, m, 2).unwrap();
        let peaks = peak_in_flight_by_stage(&s);
        assert!(
            peaks.iter().all(|&x| (1..=m).contains(&x)),
            "{name} {peaks:?}"
        );
        let t = simulate(
            &s,
            Costs {
                f: 1.0,
                b: 1.0,
                w: 1.0,
            },
        )
        .unwrap();
        for d in 0..p {
            let sum: usize = (0..s.stages)
                .filter(|&st| s.device_of[st] == d)
                .map(|st| peaks[st])
                .sum();
            assert!(
                sum as f64 >= t.peak_in_flight[d] * 2.0 - 1e-9,
                "{name} {peaks:?} {d}"
            );
        }
    }
    // Interleaved 1F1B on 2 ranks, 4 micro-batches. Rank 0 runs 0F0 0F1 2F0 2F1 0F2
    // 2B0 0F3 2B1 2F2 0B0 ...: stage 0 holds all 4 before 0B0, stage 2 two; rank 1
    // runs 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 ...: stage 1 holds 3, stage 3 one. The
    // 1F1B estimate (p - s mod p) said 2, 1, 2, 1.
    let s = by_name("interleaved", 2, 4, 2).unwrap();
    assert_eq!(peak_in_flight_by_stage(&s), vec![4, 3, 2, 1]);
}

#[test]
fn peaks_in_flight() {
    let c = Costs::default();
    for p in [2usize, 4, 8] {
        for m in [1, p - 1, p, 2 * p] {
            if m == 0 {
                continue;
            }
            let t = simulate(&one_f_one_b(p, m).unwrap(), c).unwrap();
            for r in 0..p {
                assert!(
                    close(t.peak_in_flight[r], (p - r).min(m) as f64),
                    "1f1b p={p} m={m} device {r}: {}",
                    t.peak_in_flight[r]
                );
            }
            let t = simulate(&gpipe(p, m).unwrap(), c).unwrap();
            assert!(t.peak_in_flight.iter().all(|&x| close(x, m as f64)));
        }
    }
}

#[test]
fn fewer_micro_batches_than_stages_still_work() {
    for name in ["gpipe", "1f1b", "zb-h1"] {
        let s = by_name(name, 4, 2, 1).unwrap();
        simulate(&s, Costs::default()).unwrap();
    }
}

#[test]
fn text_tables_round_trip_and_bad_ones_are_refused() {
    let s = one_f_one_b(2, 4).unwrap();
    let text = to_text(&s);
    assert_eq!(
        text.lines().nth(1).unwrap(),
        "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    );
    assert_eq!(
        text.lines().nth(2).unwrap(),
        "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"
    );
    let back = parse_text(&text, "t.txt").unwrap();
    assert_eq!(back.actions, s.actions);
    verify(&back).unwrap();
    // Device 0 runs B of micro-batch 0 before its F, which B waits for: deadlock.
    let e = verify(&parse_text("0B0 0F0\n1F0 1B0\n", "d.txt").unwrap()).unwrap_err();
    assert!(e.contains("deadlocks"), "{e}");
    let e = verify(&parse_text("0F0 0B0\n1F0\n", "s.txt").unwrap()).unwrap_err();
    assert!(e.contains("micro-batch 0 skips B on stage 1"), "{e}");
    let e = parse_text("0F0 0X1\n", "x.txt").unwrap_err();
    assert!(e.contains("x.txt:1: '0X1' is not an action"), "{e}");
    // One device holding both stages, running stage 1's F first: deadlock too.
    let e = verify(&parse_text("1F0 0F0 0B0 1B0\n", "o.txt").unwrap()).unwrap_err();
    assert!(e.contains("deadlocks"), "{e}");
    // A table places each stage on the device whose line lists it (any placement,
    // the V one of ZB-V included), but one stage on one device only.
    let s = parse_text("1F0 1B0\n0F0 0B0\n", "w.txt").unwrap();
    assert_eq!(s.device_of, vec![1, 0]);
    verify(&s).unwrap();
    let e = parse_text("0F0 1B0\n1F0 0B0\n", "w.txt").unwrap_err();
    assert!(e.contains("stage 1 appears on devices 0 and 1"), "{e}");
    let v = zb_v(2, 4).unwrap();
    assert_eq!(
        parse_text(&to_text(&v), "v.txt").unwrap().device_of,
        v.device_of
    );
    let e = verify(&parse_text("0F0 0B0 0F0\n1F0 1B0\n", "t.txt").unwrap()).unwrap_err();
    assert!(e.contains("0F0 runs twice"), "{e}");
}
