//! The flat collectives of members that share an address space (virtual devices: the
//! host's threads, or streams on one GPU), as steps one thread runs over every member's
//! memory: copies and element-wise reductions in member order.

use super::*;

/// A step of a flat collective that one thread runs over every member's memory, where
/// the members share an address space (virtual devices: the host's threads, or streams
/// on one GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shared {
    /// `bytes` bytes from `src` to `dst`.
    Copy {
        /// Read.
        src: usize,
        /// Written.
        dst: usize,
        /// Bytes.
        bytes: u64,
    },
    /// `acc = acc + x` (or the maximum) over `n` f32s, element by element.
    Reduce {
        /// Read and written.
        acc: usize,
        /// Read.
        x: usize,
        /// f32s.
        n: u64,
        /// Maximum instead of sum.
        max: bool,
    },
}

/// The steps, run in order, that perform the flat collective `ops` (every member's
/// addresses, in member order; they agree, [`agree`]): sums in member order (the
/// lockstep's order and arithmetic, so the results are the same bits), an all-reduce
/// into the first member's `recv` and copied from there. A member's `recv` may be its
/// `send` (an all-reduce or a broadcast in place); any other overlap of what is written
/// with what is read is an error, so the steps can run one after another on one stream.
pub fn shared_plan(ops: &[Flat<usize>]) -> Result<Vec<Shared>, String> {
    // Copies first, then reductions (an all-reduce's copies to the others last).
    let mut steps = Vec::new();
    let mut reduces = Vec::new();
    let mut after = Vec::new();
    let copy = |steps: &mut Vec<Shared>, src: usize, dst: usize, bytes: u64| {
        if src != dst && bytes > 0 {
            steps.push(Shared::Copy { src, dst, bytes });
        }
    };
    let m = ops.len();
    // What the steps read and write: (address, bytes), checked for overlaps.
    let mut reads: Vec<Span> = Vec::new();
    let mut writes: Vec<Span> = Vec::new();
    let unagreed = || -> ! { unreachable!("the members agree") };
    match &ops[0] {
        Flat::AllReduce { n, max, .. } => {
            let (s, r): (Vec<usize>, Vec<usize>) = ops
                .iter()
                .map(|o| match o {
                    Flat::AllReduce { send, recv, .. } => (*send, *recv),
                    _ => unagreed(),
                })
                .unzip();
            let b = n * 4;
            copy(&mut steps, s[0], r[0], b);
            for &x in &s[1..] {
                reduces.push(Shared::Reduce {
                    acc: r[0],
                    x,
                    n: *n,
                    max: *max,
                });
            }
            // Copied to the others once complete (a member whose `recv` is its `send`
            // has been read by then).
            for &d in &r[1..] {
                copy(&mut after, r[0], d, b);
            }
            reads.extend(
                s.iter()
                    .zip(&r)
                    .filter(|(s, r)| s != r)
                    .map(|(&s, _)| (s, b)),
            );
            writes.extend(r.iter().map(|&r| (r, b)));
        }
        Flat::ReduceScatter { n, max, .. } => {
            let w = n * 4;
            let sends: Vec<usize> = ops
                .iter()
                .map(|o| match o {
                    Flat::ReduceScatter { send, .. } => *send,
                    _ => unagreed(),
                })
                .collect();
            for (k, o) in ops.iter().enumerate() {
                let Flat::ReduceScatter { recv, .. } = o else {
                    unagreed()
                };
                let piece = |s: usize| s + k * w as usize;
                copy(&mut steps, piece(sends[0]), *recv, w);
                for &s in &sends[1..] {
                    reduces.push(Shared::Reduce {
                        acc: *recv,
                        x: piece(s),
                        n: *n,
                        max: *max,
                    });
                }
                writes.push((*recv, w));
            }
            reads.extend(sends.iter().map(|&s| (s, w * m as u64)));
        }
        Flat::AllGather { bytes, .. } => {
            let sends: Vec<usize> = ops
                .iter()
                .map(|o| match o {
                    Flat::AllGather { send, .. } => *send,
                    _ => unagreed(),
                })
                .collect();
            for o in ops {
                let Flat::AllGather { recv, .. } = o else {
                    unagreed()
                };
                for (k, &s) in sends.iter().enumerate() {
                    copy(&mut steps, s, recv + k * *bytes as usize, *bytes);
                }
                writes.push((*recv, bytes * m as u64));
            }
            reads.extend(sends.iter().map(|&s| (s, *bytes)));
        }
        Flat::Broadcast { bytes, root, .. } => {
            let Some(Flat::Broadcast { send, .. }) = ops.get(*root) else {
                return Err(format!("root {root} is not a member"));
            };
            for o in ops {
                let Flat::Broadcast { recv, .. } = o else {
                    unagreed()
                };
                copy(&mut steps, *send, *recv, *bytes);
                if recv != send {
                    writes.push((*recv, *bytes));
                }
            }
            reads.push((*send, *bytes));
        }
        Flat::Exchange { bytes, .. } => {
            for (p, o) in ops.iter().enumerate() {
                let Flat::Exchange { sends, .. } = o else {
                    unagreed()
                };
                for (k, &a) in sends.iter().enumerate() {
                    let Flat::Exchange { recvs, .. } = &ops[k] else {
                        unagreed()
                    };
                    copy(&mut steps, a, recvs[p], *bytes);
                    reads.push((a, *bytes));
                    writes.push((recvs[p], *bytes));
                }
            }
        }
    }
    check_overlaps(&reads, &writes)?;
    steps.append(&mut reduces);
    steps.append(&mut after);
    Ok(steps)
}

/// Memory at an address: (address, bytes).
type Span = (usize, u64);

/// That no written span overlaps a read one or another written one.
fn check_overlaps(reads: &[Span], writes: &[Span]) -> Result<(), String> {
    let meet = |(a, x): Span, (b, y): Span| a < b + y as usize && b < a + x as usize;
    for (i, &w) in writes.iter().enumerate() {
        if let Some(r) = reads.iter().find(|&&r| meet(w, r)) {
            return Err(format!(
                "it writes {} bytes at {:#x} over {} bytes it reads at {:#x}",
                w.1, w.0, r.1, r.0
            ));
        }
        if writes[..i].iter().any(|&v| meet(w, v)) {
            return Err(format!("it writes {} bytes at {:#x} twice", w.1, w.0));
        }
    }
    Ok(())
}
