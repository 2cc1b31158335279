//! Tests of `host`: `rank_tests`.

use super::{run_ranks, Arenas};
use crate::artifact::{Artifact, Buffer, Elt, Header, MeshAxis, Program, Step, Target};
use crate::collective::{moves, tests::run, Collective};
use crate::ranks::{lanes, rank_scratch, Groups};

fn art(programs: Vec<Program>, devices: u64, pipeline: bool) -> Artifact {
    Artifact {
        header: Header {
            target: Target { sm: 90, ptx: 80 },
            source: String::new(),
            mesh: vec![MeshAxis {
                name: "x".into(),
                size: devices,
            }],
            pipeline_axis: pipeline.then(|| "x".into()),
            inputs: Vec::new(),
            outputs: Vec::new(),
            kernels: Vec::new(),
            reducers: None,
            programs,
            sections: Vec::new(),
        },
        sections: Vec::new(),
    }
}

fn prog(name: &str, devices: Vec<usize>, buffers: Vec<Buffer>, steps: Vec<Step>) -> Program {
    let arena_bytes = buffers
        .iter()
        .map(|b| (b.offset + b.bytes()).div_ceil(256) * 256)
        .max()
        .unwrap_or(256);
    Program {
        name: name.into(),
        devices,
        inputs: Vec::new(),
        outputs: Vec::new(),
        buffers,
        arena_bytes,
        constants: Vec::new(),
        steps,
    }
}

fn buf(shape: &[u64], offset: u64) -> Buffer {
    Buffer {
        shape: shape.to_vec(),
        elt: Elt::F32,
        offset,
    }
}

/// Arenas of f32s, device `d`'s word `i` a value of its own (not a sum of others).
fn values(devices: usize, words: usize) -> Vec<Vec<f32>> {
    (0..devices)
        .map(|d| {
            (0..words)
                .map(|i| ((d * 7919 + i * 104_729) % 1013) as f32 * 0.37 - 150.0)
                .collect()
        })
        .collect()
}

fn to_words(a: &[f32]) -> Vec<u64> {
    a.chunks(2)
        .map(|c| {
            let lo = c[0].to_bits() as u64;
            let hi = c.get(1).map_or(0, |x| x.to_bits() as u64);
            lo | (hi << 32)
        })
        .collect()
}

fn from_words(a: &[u64]) -> Vec<f32> {
    a.iter()
        .flat_map(|w| [f32::from_bits(*w as u32), f32::from_bits((*w >> 32) as u32)])
        .collect()
}

/// Every collective with every value of its parameters, run as ranks (a thread per
/// device, each its share and the in-process communicator), gives the same bits as the
/// lockstep's moves: along outer and inner dims of rank-2 and rank-3 tensors, on groups of
/// 2 and 3 and two groups of 2; and a sum and a maximum in place.
#[test]
fn ranks_equal_the_lockstep_moves() {
    let (a, o) = (0u64, 1024u64);
    let layouts: [Vec<Vec<usize>>; 3] = [
        vec![vec![0, 1]],
        vec![vec![0, 1, 2]],
        vec![vec![0, 2], vec![3, 1]],
    ];
    let mut cases: Vec<(Vec<Buffer>, Step)> = Vec::new();
    for groups in &layouts {
        let n = groups[0].len();
        for shape in [vec![6u64, 4], vec![3, 2, 6], vec![2, 6, 3]] {
            let shape: Vec<u64> = shape
                .iter()
                .map(|&d| if d == 6 { 2 * n as u64 } else { d })
                .collect();
            for op in Collective::every(shape.len(), n) {
                let Ok(out) = op.out_shape(&shape, n as u64) else {
                    continue;
                };
                let step = Step::Collective {
                    op,
                    input: 0,
                    output: 1,
                    groups: groups.clone(),
                };
                cases.push((vec![buf(&shape, a), buf(&out, o)], step));
            }
        }
        for max in [false, true] {
            let step = Step::Collective {
                op: Collective::AllReduce { max },
                input: 0,
                output: 0,
                groups: groups.clone(),
            };
            cases.push((vec![buf(&[6, 4], a)], step));
        }
    }
    let mut checked = 0;
    for (bufs, s) in &cases {
        let Step::Collective { groups, .. } = s else {
            unreachable!()
        };
        let devices: usize = groups.iter().map(Vec::len).sum();
        let p = prog("f", (0..devices).collect(), bufs.clone(), vec![s.clone()]);
        let words = p.arena_bytes as usize / 4;
        let init = values(devices, words);
        // Lockstep.
        let (ms, scratch) = moves(&p, s).unwrap();
        let mut want = init.clone();
        let mut sc = vec![0f32; scratch as usize / 4 + 1];
        run(&ms, &mut want, &mut sc);
        // Ranks.
        let a = art(vec![p], devices as u64, false);
        let g = Groups::of(&a);
        let scratch = rank_scratch(&a, &g).unwrap().div_ceil(8) as usize;
        let mut arenas: Arenas = vec![init.iter().map(|v| to_words(v)).collect()];
        let lanes = lanes(&a).unwrap();
        run_ranks(&a, &lanes, &[], &g, scratch, &mut arenas).unwrap();
        for d in 0..devices {
            let got = from_words(&arenas[0][d]);
            let same = got
                .iter()
                .zip(&want[d])
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{s:?} on {groups:?}: device {d} differs from the lockstep"
            );
        }
        checked += 1;
    }
    assert!(checked > 100, "{checked} cases");
}

fn send(to: usize, tag: &str) -> Step {
    send_from(to, tag, 0)
}
fn send_from(to: usize, tag: &str, buffer: usize) -> Step {
    Step::Send {
        buffer,
        to,
        tag: tag.into(),
    }
}
fn recv(from: usize, tag: &str) -> Step {
    recv_into(from, tag, 1)
}
fn recv_into(from: usize, tag: &str, buffer: usize) -> Step {
    Step::Recv {
        buffer,
        from,
        tag: tag.into(),
    }
}
/// A step between two sends or receives that splits them into separate groups: a
/// device's own slice of its buffer 0 into buffer 2.
fn local(d: usize) -> Step {
    Step::Collective {
        op: Collective::Slice { dim: 0 },
        input: 0,
        output: 2,
        groups: vec![vec![d]],
    }
}

fn pipeline(steps: [Vec<Step>; 2]) -> Artifact {
    let [s0, s1] = steps;
    let bufs = || vec![buf(&[4], 0), buf(&[4], 256), buf(&[4], 512)];
    art(
        vec![
            prog("f.pp0", vec![0], bufs(), s0),
            prog("f.pp1", vec![1], bufs(), s1),
        ],
        2,
        true,
    )
}

fn ranks(a: &Artifact) -> Result<Arenas, String> {
    let lanes = lanes(a)?;
    let g = Groups::of(a);
    let scratch = rank_scratch(a, &g)?.div_ceil(8) as usize;
    let mut arenas: Arenas = (0..2)
        .map(|d| vec![to_words(&[d as f32 + 1.0; 192])])
        .collect();
    run_ranks(a, &lanes, &[], &g, scratch, &mut arenas)?;
    Ok(arenas)
}

/// Sends do not wait (as in the lockstep; a backend buffers them): each device sends,
/// then receives, and the data arrives.
#[test]
fn sends_do_not_wait() {
    let a = pipeline([
        vec![send(1, "x"), local(0), recv(1, "y")],
        vec![send(0, "y"), local(1), recv(0, "x")],
    ]);
    let arenas = ranks(&a).unwrap();
    assert_eq!(from_words(&arenas[0][0])[64..68], [2.0; 4]);
    assert_eq!(from_words(&arenas[1][0])[64..68], [1.0; 4]);
}

/// Devices that each wait to receive what the other sends only later are a deadlock,
/// reported with what each waits for (never a hang).
#[test]
fn receives_waiting_for_each_other_are_a_deadlock() {
    let a = pipeline([
        vec![recv(1, "y"), send(1, "x")],
        vec![recv(0, "x"), send(0, "y")],
    ]);
    let e = ranks(&a).unwrap_err();
    assert!(e.starts_with("deadlock: device "), "{e}");
    assert!(e.contains("device 0 waits for 'y' from device 1"), "{e}");
    assert!(e.contains("device 1 waits for 'x' from device 0"), "{e}");
}

/// Messages received in another order than sent (NCCL matches in order) go on lanes
/// of their own and land where their tags say; a send nobody receives is refused
/// before the run.
#[test]
fn crossing_messages_take_lanes() {
    // Device 0 sends buffer 0 (1.0s) as 'x', then buffer 2 (5.0s) as 'z'; device 1
    // receives 'z' into buffer 1, then 'x' into buffer 2.
    let a = pipeline([
        vec![send(1, "x"), send_from(1, "z", 2)],
        vec![recv_into(0, "z", 1), local(1), recv_into(0, "x", 2)],
    ]);
    assert_eq!(lanes(&a).unwrap(), [vec![0, 1], vec![1, 0, 0]]);
    let mut d0 = [1.0f32; 192];
    d0[128..132].fill(5.0);
    let mut arenas = vec![vec![to_words(&d0)], vec![to_words(&[3.0; 192])]];
    let g = Groups::of(&a);
    run_ranks(&a, &lanes(&a).unwrap(), &[], &g, 1, &mut arenas).unwrap();
    let d1 = from_words(&arenas[1][0]);
    assert_eq!(
        d1[64..68],
        [5.0; 4],
        "'z' (device 0's buffer 2) in buffer 1"
    );
    assert_eq!(
        d1[128..132],
        [1.0; 4],
        "'x' (device 0's buffer 0) in buffer 2"
    );
    let a = pipeline([vec![send(1, "x"), send(1, "w")], vec![recv(0, "x")]]);
    assert_eq!(
        ranks(&a).unwrap_err(),
        "'f.pp0' sends 'w' to 'f.pp1', which does not receive it"
    );
}
