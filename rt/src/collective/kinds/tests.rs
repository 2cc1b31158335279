//! Every collective, with every value of its parameters, on inputs of several shapes in
//! groups of 2 and 3: its moves (one GPU, the host's lockstep) and its rank shares (around
//! NCCL's calls, run here by a small model of them) give each member exactly what
//! [`Collective::reference`] says; its JSON reads back the same.

use super::*;
use crate::artifact::{Program, Step};
use crate::collective::tests::run;

const SHAPES: &[&[u64]] = &[&[6], &[4, 6], &[2, 6, 3], &[3, 2, 6, 2]];

fn buf(shape: &[u64], offset: u64) -> Buffer {
    Buffer {
        shape: shape.to_vec(),
        elt: Elt::F32,
        offset,
    }
}

/// Member `d`'s input: distinct values, some negative, so that sums and maxima differ.
fn input(d: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((1000 * d + 7 * i) % 23) as f32 - 11.0 + d as f32 * 0.25)
        .collect()
}

/// The f32s of `ms` run with one arena per place.
fn run_moves(ms: &[Move], arenas: &mut [Vec<f32>], scratch: u64) {
    let mut sc = vec![0f32; scratch as usize / 4];
    run(ms, arenas, &mut sc);
}

/// Runs every member's share in lockstep: local copies on its own arena and scratch, the
/// flat calls as NCCL defines them.
fn run_shares(shares: &[Vec<RankOp>], arenas: &mut [Vec<f32>], scratch: u64) {
    let n = shares.len();
    let mut scratches = vec![vec![0f32; scratch as usize / 4]; n];
    let steps = shares[0].len();
    assert!(
        shares.iter().all(|s| s.len() == steps),
        "members' shares differ"
    );
    let f = |a: At| a.offset as usize / 4;
    for i in 0..steps {
        if let RankOp::Copy(m) = &shares[0][i] {
            for (k, s) in shares.iter().enumerate() {
                let RankOp::Copy(mk) = &s[i] else {
                    panic!("member {k}'s step {i} is not a copy")
                };
                let _ = m;
                run(
                    std::slice::from_ref(mk),
                    std::slice::from_mut(&mut arenas[k]),
                    &mut scratches[k],
                );
            }
            continue;
        }
        let ops: Vec<&Flat<At>> = shares
            .iter()
            .map(|s| match &s[i] {
                RankOp::Flat { op, .. } => op,
                RankOp::Copy(_) => panic!("members disagree at step {i}"),
            })
            .collect();
        // Reads every member's bytes first (a call reads before it writes).
        let read = |arenas: &[Vec<f32>], sc: &[Vec<f32>], k: usize, a: At, len: usize| {
            let src = match a.place {
                Place::Device(_) => &arenas[k],
                Place::Scratch => &sc[k],
            };
            src[f(a)..f(a) + len].to_vec()
        };
        let mut writes: Vec<(usize, At, Vec<f32>)> = Vec::new();
        // Each member's send and receive (the calls with one of each; none for an exchange).
        let ends: Vec<(At, At)> = ops
            .iter()
            .filter_map(|o| match o {
                Flat::AllReduce { send, recv, .. }
                | Flat::AllGather { send, recv, .. }
                | Flat::ReduceScatter { send, recv, .. }
                | Flat::Broadcast { send, recv, .. } => Some((*send, *recv)),
                Flat::Exchange { .. } => None,
            })
            .collect();
        // The members' sends of `len` f32s, summed (or their maximum) in member order.
        let reduced = |len: usize, max: bool| -> Vec<f32> {
            let mut acc = read(arenas, &scratches, 0, ends[0].0, len);
            for (k, e) in ends.iter().enumerate().skip(1) {
                f32::reduce_into(&mut acc, &read(arenas, &scratches, k, e.0, len), max).unwrap();
            }
            acc
        };
        match ops[0] {
            Flat::AllReduce { n: len, max, .. } => {
                let acc = reduced(*len as usize, *max);
                for (k, e) in ends.iter().enumerate() {
                    writes.push((k, e.1, acc.clone()));
                }
            }
            Flat::AllGather { bytes, .. } => {
                let mut all = Vec::new();
                for (k, e) in ends.iter().enumerate() {
                    all.extend(read(arenas, &scratches, k, e.0, *bytes as usize / 4));
                }
                for (k, e) in ends.iter().enumerate() {
                    writes.push((k, e.1, all.clone()));
                }
            }
            Flat::ReduceScatter { n: len, max, .. } => {
                let l = *len as usize;
                let acc = reduced(l * n, *max);
                for (k, e) in ends.iter().enumerate() {
                    writes.push((k, e.1, acc[k * l..(k + 1) * l].to_vec()));
                }
            }
            Flat::Broadcast { bytes, root, .. } => {
                let v = read(
                    arenas,
                    &scratches,
                    *root,
                    ends[*root].0,
                    *bytes as usize / 4,
                );
                for (k, e) in ends.iter().enumerate() {
                    writes.push((k, e.1, v.clone()));
                }
            }
            Flat::Exchange { bytes, .. } => {
                let w = *bytes as usize / 4;
                for (p, o) in ops.iter().enumerate() {
                    let Flat::Exchange { sends, .. } = o else {
                        unreachable!()
                    };
                    for (k, to) in ops.iter().enumerate() {
                        let Flat::Exchange { recvs, .. } = to else {
                            unreachable!()
                        };
                        writes.push((k, recvs[p], read(arenas, &scratches, p, sends[k], w)));
                    }
                }
            }
        }
        for (k, a, v) in writes {
            let dst = match a.place {
                Place::Device(_) => &mut arenas[k],
                Place::Scratch => &mut scratches[k],
            };
            dst[f(a)..f(a) + v.len()].copy_from_slice(&v);
        }
    }
}

#[test]
fn every_collective_computes_its_meaning() {
    let mut seen = std::collections::BTreeSet::new();
    let mut cases = 0;
    for &shape in SHAPES {
        for n in [2usize, 3] {
            for op in Collective::every(shape.len(), n) {
                let Ok(oshape) = op.out_shape(shape, n as u64) else {
                    continue;
                };
                let len: u64 = shape.iter().product();
                let olen: u64 = oshape.iter().product();
                let (ib, ob) = (buf(shape, 0), buf(&oshape, 4 * len));
                let arena = (len + olen) as usize;
                let parts: Vec<Vec<f32>> = (0..n).map(|d| input(d, len as usize)).collect();
                let views: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
                let ushape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
                let want: Vec<Vec<f32>> = (0..n)
                    .map(|m| {
                        let (s, v) = op.reference(&views, &ushape, m).unwrap();
                        assert_eq!(s, oshape.iter().map(|&d| d as usize).collect::<Vec<_>>());
                        v
                    })
                    .collect();
                let fresh = || -> Vec<Vec<f32>> {
                    parts
                        .iter()
                        .map(|p| {
                            let mut a = vec![f32::NAN; arena];
                            a[..p.len()].copy_from_slice(p);
                            a
                        })
                        .collect()
                };
                // One GPU or the host's lockstep.
                let mut out = Vec::new();
                let g: Vec<usize> = (0..n).collect();
                let scratch = op.group_moves(&ib, &ob, false, &g, &mut out);
                let mut arenas = fresh();
                run_moves(&out, &mut arenas, scratch);
                for m in 0..n {
                    assert_eq!(
                        arenas[m][len as usize..],
                        want[m][..],
                        "{op:?} on {shape:?} over {n}: member {m}'s moves"
                    );
                }
                // Ranks around NCCL's calls.
                let mut shares = Vec::new();
                let mut need = 0;
                for m in 0..n {
                    let flat = |f: Flat<At>| RankOp::Flat {
                        group: 0,
                        member: m,
                        op: f,
                    };
                    let (ops, s) = op.share(&ib, &ob, n as u64, m, &flat);
                    need = need.max(s);
                    shares.push(ops);
                }
                let mut arenas = fresh();
                run_shares(&shares, &mut arenas, need);
                for m in 0..n {
                    assert_eq!(
                        arenas[m][len as usize..],
                        want[m][..],
                        "{op:?} on {shape:?} over {n}: member {m}'s share"
                    );
                }
                seen.insert(op.name());
                cases += 1;
            }
        }
    }
    let all: std::collections::BTreeSet<&str> =
        Collective::TABLE.iter().map(|(name, _)| *name).collect();
    assert_eq!(seen, all, "a collective no case could run");
    assert!(cases > 100, "{cases} cases");
}

/// The meaning refuses pieces that are not of the shape given, and a member outside the
/// group, instead of reading past them.
#[test]
fn the_reference_refuses_pieces_of_another_shape() {
    let op = Collective::AllGather { dim: 0 };
    let (a, b) = ([1f32, 2., 3., 4.], [5f32, 6.]);
    let e = op.reference(&[&a, &b], &[2, 2], 0).unwrap_err();
    assert!(
        e.contains("a member's piece has 2 elements, not the 4 of [2, 2]"),
        "{e}"
    );
    let e = op.reference(&[&a, &a], &[2, 2], 2).unwrap_err();
    assert!(e.contains("member 2 of a group of 2"), "{e}");
    let (shape, v) = op.reference(&[&a, &a], &[2, 2], 1).unwrap();
    assert_eq!((shape, v.len()), (vec![4, 2], 8));
}

/// A step's JSON is the collective's name around its buffers, groups and parameters in
/// order, and reads back the same; a step with an unknown or missing field is refused.
#[test]
fn steps_read_back_from_json() {
    for op in Collective::every(3, 2) {
        let s = Step::Collective {
            op,
            input: 1,
            output: 2,
            groups: vec![vec![0, 1]],
        };
        let json = serde_json::to_string(&s).unwrap();
        let params: String = op
            .params()
            .iter()
            .map(|(k, p)| match p {
                Param::Index(i) => format!(",\"{k}\":{i}"),
                Param::Flag(b) => format!(",\"{k}\":{b}"),
            })
            .collect();
        assert_eq!(
            json,
            format!(
                "{{\"{}\":{{\"input\":1,\"output\":2,\"groups\":[[0,1]]{params}}}}}",
                op.name()
            )
        );
        assert_eq!(serde_json::from_str::<Step>(&json).unwrap(), s);
    }
    let bad = |j: &str| serde_json::from_str::<Step>(j).unwrap_err().to_string();
    let e = bad(r#"{"all_gather":{"input":1,"output":2,"groups":[[0]],"dim":0,"root":1}}"#);
    assert!(
        e.contains("unknown field `root` in a all_gather step"),
        "{e}"
    );
    let e = bad(r#"{"all_gather":{"input":1,"output":2,"groups":[[0]]}}"#);
    assert!(
        e.contains("missing field `dim` in a all_gather step"),
        "{e}"
    );
    let e = bad(r#"{"all_reduce":{"input":1,"output":2,"groups":[[0]],"max":3}}"#);
    assert!(
        e.contains("all_reduce step's `max` is not a boolean"),
        "{e}"
    );
    let e = bad(r#"{"gather_all":{"input":1}}"#);
    assert!(e.contains("unknown step 'gather_all'"), "{e}");
    let e = bad(r#"{"send":{"buffer":1,"to":0,"tag":"t"},"recv":{}}"#);
    assert!(e.contains("a step has 2 keys, not one"), "{e}");
    let s: Step = serde_json::from_str(r#"{"send":{"buffer":1,"to":0,"tag":"t"}}"#).unwrap();
    assert_eq!(
        s,
        Step::Send {
            buffer: 1,
            to: 0,
            tag: "t".into()
        }
    );
}

/// The compiler's program type stays out of these tests' way: a collective's moves are
/// the same through [`crate::collective::moves`] on a program.
#[test]
fn program_moves_are_the_groups_moves() {
    let op = Collective::AllGather { dim: 1 };
    let prog = Program {
        name: "f".into(),
        devices: vec![3, 5, 8, 9],
        inputs: Vec::new(),
        outputs: Vec::new(),
        buffers: vec![buf(&[2, 3], 0), buf(&[2, 6], 256)],
        arena_bytes: 512,
        constants: Vec::new(),
        steps: Vec::new(),
    };
    let s = Step::Collective {
        op,
        input: 0,
        output: 1,
        groups: vec![vec![3, 8], vec![5, 9]],
    };
    let (ms, scratch) = crate::collective::moves(&prog, &s).unwrap();
    let mut want = Vec::new();
    op.group_moves(
        &prog.buffers[0],
        &prog.buffers[1],
        false,
        &[0, 2],
        &mut want,
    );
    op.group_moves(
        &prog.buffers[0],
        &prog.buffers[1],
        false,
        &[1, 3],
        &mut want,
    );
    assert_eq!((ms, scratch), (want, 0));
}
