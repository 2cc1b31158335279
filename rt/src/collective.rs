//! Collectives as moves: every collective step of a program becomes a list of [`Move`]s,
//! strided copies between the arenas of the program's devices and element-wise
//! reductions by the artifact's reducer kernels ([`crate::artifact::Reducers`]), which
//! both backends run the same way: the host backend with memory copies and the
//! reducers' host code, the CUDA backend with device copies (`cuMemcpy2DAsync`) and the
//! reducers' PTX, every virtual device's arena on the one GPU. So the host backend's
//! tests check the very plan of copies and reductions a GPU runs.
//!
//! Within a group (members in order): an all-reduce sums into the first member's output
//! (its input copied there first, then each other member's input added, in member order,
//! as the reference sums) and copies the result to the others; a reduce-scatter sums the
//! same way into the run's scratch space and copies each member its piece; an all-gather
//! copies every member's input into its place in every member's output; a slice copies
//! each member its piece of its own input; a broadcast copies the root's input to every
//! member's output; an all-to-all copies piece `k` of member `p`'s input (along the split
//! dim) to place `p` (along the concatenated dim) of member `k`'s output, one strided
//! copy per index of the dims before both. A piece along `dim` of a row-major tensor is
//! one strided copy: `outer` rows (the dims before `dim`) of `len * inner` elements
//! (`inner`: the dims after it), at a pitch of the whole dim.

use crate::artifact::{Buffer, Program, Step};

mod kinds;
pub use kinds::{Collective, Elem, Param, ParamKind};

/// Where a move reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// The arena of the program's device at this position in its device list.
    Device(usize),
    /// The run's scratch space (one, shared by the program's devices).
    Scratch,
}

/// A byte offset in a [`Place`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct At {
    /// The place.
    pub place: Place,
    /// Bytes from its start.
    pub offset: u64,
}

/// One move of a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Move {
    /// `rows` runs of `width` bytes, run `r` from `src + r * src_pitch` to
    /// `dst + r * dst_pitch` (source and destination never overlap).
    Copy {
        /// Read from.
        src: At,
        /// Written to.
        dst: At,
        /// Bytes per run.
        width: u64,
        /// Runs.
        rows: u64,
        /// Bytes between the runs' starts in the source.
        src_pitch: u64,
        /// Bytes between the runs' starts in the destination.
        dst_pitch: u64,
    },
    /// `dst[i] = dst[i] + src[i]` (or `max(dst[i], src[i])`) for `n` f32s: the reducer
    /// kernel launched on (dst, src, dst).
    Reduce {
        /// Added.
        src: At,
        /// Accumulated into.
        dst: At,
        /// Elements.
        n: u64,
        /// Maximum instead of sum.
        max: bool,
    },
}

impl Move {
    /// Where it reads and where it writes, each with the bytes it spans from there (zero
    /// for an empty copy).
    pub(crate) fn spans(&self) -> [(At, u64); 2] {
        match *self {
            Move::Copy {
                src,
                dst,
                width,
                rows,
                src_pitch,
                dst_pitch,
            } => {
                let span = |pitch: u64| {
                    if rows == 0 || width == 0 {
                        0
                    } else {
                        (rows - 1) * pitch + width
                    }
                };
                [(src, span(src_pitch)), (dst, span(dst_pitch))]
            }
            Move::Reduce { src, dst, n, .. } => [(src, n * 4), (dst, n * 4)],
        }
    }
}

/// A run's places as a backend addresses them (`B`: a host pointer or a device
/// address), each with its length in bytes.
pub(crate) struct Places<B> {
    /// The program's devices' arenas, in its devices' order.
    pub devices: Vec<(B, u64)>,
    /// The scratch space.
    pub scratch: (B, u64),
}

/// A copy [`Move`] located in its places: (base, offset) of its source and destination,
/// and its runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Located<B> {
    pub src: (B, u64),
    pub dst: (B, u64),
    pub width: u64,
    pub rows: u64,
    pub src_pitch: u64,
    pub dst_pitch: u64,
}

impl<B: Copy> Places<B> {
    /// A copy move's source and destination located (checked to lie in their places);
    /// `None` for an empty copy; an error for a reduction (a rank's local moves are
    /// copies).
    pub(crate) fn local_copy(&self, m: &Move) -> Result<Option<Located<B>>, String> {
        let Move::Copy {
            width,
            rows,
            src_pitch,
            dst_pitch,
            ..
        } = *m
        else {
            return Err("a rank's local move is a reduction".into());
        };
        let [(src, src_span), (dst, dst_span)] = m.spans();
        if src_span == 0 {
            return Ok(None);
        }
        Ok(Some(Located {
            src: self.locate(src, src_span)?,
            dst: self.locate(dst, dst_span)?,
            width,
            rows,
            src_pitch,
            dst_pitch,
        }))
    }

    /// The base of `a`'s place and `a`'s offset in it, checked so that `bytes` from
    /// there lie inside the place.
    pub(crate) fn locate(&self, a: At, bytes: u64) -> Result<(B, u64), String> {
        let (base, len) = match a.place {
            Place::Device(d) => *self.devices.get(d).ok_or("a move names a missing device")?,
            Place::Scratch => self.scratch,
        };
        if a.offset.saturating_add(bytes) > len {
            return Err("a collective's move lies outside its arena".into());
        }
        Ok((base, a.offset))
    }
}

/// A flat collective: NCCL's calls, on contiguous memory, addressed by `A` (a place in
/// the rank's arena or scratch while planned, a pointer or device address when run).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Flat<A> {
    /// `recv` = the members' `send`s (`n` f32s each) summed (or their maximum) in
    /// member order.
    AllReduce {
        /// Read.
        send: A,
        /// Written (may be `send`).
        recv: A,
        /// f32s.
        n: u64,
        /// Maximum instead of sum.
        max: bool,
    },
    /// `recv` = the members' `send`s (`bytes` each) one after another in member order.
    AllGather {
        /// Read.
        send: A,
        /// Written.
        recv: A,
        /// Bytes per member.
        bytes: u64,
    },
    /// Member `k`'s `recv` = piece `k` (`n` f32s) of the members' `send`s reduced.
    ReduceScatter {
        /// Read: one piece per member, in member order.
        send: A,
        /// Written.
        recv: A,
        /// f32s per member.
        n: u64,
        /// Maximum instead of sum.
        max: bool,
    },
    /// `recv` = the `send` of member `root`.
    Broadcast {
        /// Read (on the root).
        send: A,
        /// Written.
        recv: A,
        /// Bytes.
        bytes: u64,
        /// The member whose `send` every member gets.
        root: usize,
    },
    /// Grouped point-to-point within the group: `sends[k]` goes to member `k`, whose
    /// `recvs[me]` receives it (each `bytes` long; a member's own piece included).
    Exchange {
        /// Per member, what this member sends it.
        sends: Vec<A>,
        /// Per member, where what it sends lands.
        recvs: Vec<A>,
        /// Bytes of every piece.
        bytes: u64,
    },
}

impl<A: Copy> Flat<A> {
    /// The same collective at other addresses: `f(address, bytes there)` for a group of
    /// `members`.
    pub fn map<B>(
        &self,
        members: u64,
        f: &mut impl FnMut(A, u64) -> Result<B, String>,
    ) -> Result<Flat<B>, String> {
        Ok(match self {
            Flat::AllReduce { send, recv, n, max } => Flat::AllReduce {
                send: f(*send, n * 4)?,
                recv: f(*recv, n * 4)?,
                n: *n,
                max: *max,
            },
            Flat::AllGather { send, recv, bytes } => Flat::AllGather {
                send: f(*send, *bytes)?,
                recv: f(*recv, bytes * members)?,
                bytes: *bytes,
            },
            Flat::ReduceScatter { send, recv, n, max } => Flat::ReduceScatter {
                send: f(*send, n * 4 * members)?,
                recv: f(*recv, n * 4)?,
                n: *n,
                max: *max,
            },
            Flat::Broadcast {
                send,
                recv,
                bytes,
                root,
            } => Flat::Broadcast {
                send: f(*send, *bytes)?,
                recv: f(*recv, *bytes)?,
                bytes: *bytes,
                root: *root,
            },
            Flat::Exchange {
                sends,
                recvs,
                bytes,
            } => Flat::Exchange {
                sends: sends
                    .iter()
                    .map(|&a| f(a, *bytes))
                    .collect::<Result<_, _>>()?,
                recvs: recvs
                    .iter()
                    .map(|&a| f(a, *bytes))
                    .collect::<Result<_, _>>()?,
                bytes: *bytes,
            },
        })
    }

    /// The collective without its addresses: what every member must agree on.
    pub(crate) fn shape(&self) -> Flat<()> {
        self.map(0, &mut |_, _| Ok(()))
            .expect("an address-free map does not fail")
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Flat::AllReduce { .. } => "all_reduce",
            Flat::AllGather { .. } => "all_gather",
            Flat::ReduceScatter { .. } => "reduce_scatter",
            Flat::Broadcast { .. } => "broadcast",
            Flat::Exchange { .. } => "all_to_all",
        }
    }
}

/// What a rank does for its share of a collective step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankOp {
    /// A strided copy within the rank's arena and scratch (places `Device(0)`, its own
    /// arena, and `Scratch`).
    Copy(Move),
    /// A flat collective over group `group` ([`Groups::list`]), this rank being member
    /// `member`.
    Flat {
        /// The group's number.
        group: usize,
        /// This rank's position in it.
        member: usize,
        /// The collective, on places of this rank.
        op: Flat<At>,
    },
}

/// A piece along one dim of a row-major tensor as a strided region: `rows` runs of
/// `width` bytes, `pitch` apart, the first at `start`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece {
    start: u64,
    width: u64,
    rows: u64,
    pitch: u64,
}

/// Piece `k` of `pieces` equal ones along `dim` of `b`.
pub(crate) fn piece(b: &Buffer, dim: usize, k: u64, pieces: u64) -> Piece {
    let es = b.elt.size();
    let outer: u64 = b.shape[..dim].iter().product();
    let inner: u64 = b.shape[dim + 1..].iter().product();
    let len = b.shape[dim] / pieces;
    Piece {
        start: k * len * inner * es,
        width: len * inner * es,
        rows: outer,
        pitch: b.shape[dim] * inner * es,
    }
}

impl Piece {
    /// The piece of the whole tensor at `whole` copied out to a contiguous one at `dst`.
    pub(crate) fn gather(&self, whole: At, dst: At) -> Move {
        Move::Copy {
            src: At {
                offset: whole.offset + self.start,
                ..whole
            },
            dst,
            width: self.width,
            rows: self.rows,
            src_pitch: self.pitch,
            dst_pitch: self.width,
        }
    }

    /// A contiguous piece at `src` copied into its place in the whole tensor at `whole`.
    pub(crate) fn scatter(&self, src: At, whole: At) -> Move {
        Move::Copy {
            src,
            dst: At {
                offset: whole.offset + self.start,
                ..whole
            },
            width: self.width,
            rows: self.rows,
            src_pitch: self.width,
            dst_pitch: self.pitch,
        }
    }
}

pub(crate) fn at(place: Place, offset: u64) -> At {
    At { place, offset }
}

/// A contiguous copy of `bytes`.
pub(crate) fn copy(src: At, dst: At, bytes: u64) -> Move {
    Move::Copy {
        src,
        dst,
        width: bytes,
        rows: 1,
        src_pitch: bytes,
        dst_pitch: bytes,
    }
}

/// The moves of collective step `s` of `prog`, and the scratch bytes they use. The step
/// is one the artifact's reader accepted (groups partition the devices, shapes fit).
pub(crate) fn moves(prog: &Program, s: &Step) -> Result<(Vec<Move>, u64), String> {
    let Step::Collective {
        op,
        input,
        output,
        groups,
    } = s
    else {
        return Err("not a collective".into());
    };
    let local = |g: &[usize]| -> Result<Vec<usize>, String> {
        g.iter()
            .map(|d| {
                prog.devices
                    .binary_search(d)
                    .map_err(|_| format!("device {d} does not run '{}'", prog.name))
            })
            .collect()
    };
    let (ib, ob) = (&prog.buffers[*input], &prog.buffers[*output]);
    let mut out = Vec::new();
    let mut scratch = 0u64;
    for g in groups {
        let g = local(g)?;
        scratch = scratch.max(op.group_moves(ib, ob, input == output, &g, &mut out));
    }
    Ok((out, scratch))
}

/// An all-to-all's copies of piece `k` (of `n`) along `split` of member `p`'s input `ib`
/// (at `src`) into place `p` along `concat` of member `k`'s output (at `dst`). The piece
/// is the input with `split` cut to `S / n`. Its rows over the dims before the later of
/// the two dims are runs contiguous in both buffers, and for each index of the dims
/// before the earlier one those rows are evenly spaced: one strided copy each. For
/// `split < concat` a row is a whole input row (the input's `concat` is complete) placed
/// at member `p`'s offset in the output's longer row; for `split > concat` it is the
/// piece's window of an input row, and the output's rows are contiguous.
pub(crate) fn exchange(
    out: &mut Vec<Move>,
    ib: &Buffer,
    split: usize,
    concat: usize,
    (p, k, n): (u64, u64, u64),
    src: At,
    dst: At,
) {
    let es = ib.elt.size();
    let sh = &ib.shape;
    let prod = |r: std::ops::Range<usize>| -> u64 { sh[r].iter().product() };
    let (s, c) = (sh[split], sh[concat]);
    let shift = |a: At, by: u64| At {
        offset: a.offset + by,
        ..a
    };
    if split < concat {
        let mid = prod(split + 1..concat);
        let run = c * prod(concat + 1..sh.len()) * es;
        let rows = s / n * mid;
        for o in 0..prod(0..split) {
            out.push(Move::Copy {
                src: shift(src, (o * s + k * (s / n)) * mid * run),
                dst: shift(dst, o * rows * n * run + p * run),
                width: run,
                rows,
                src_pitch: run,
                dst_pitch: n * run,
            });
        }
    } else {
        let mid = prod(concat + 1..split);
        let inner = prod(split + 1..sh.len()) * es;
        let w = s / n * inner;
        let rows = c * mid;
        for o in 0..prod(0..concat) {
            out.push(Move::Copy {
                src: shift(src, o * rows * s * inner + k * w),
                dst: shift(dst, (o * n + p) * rows * w),
                width: w,
                rows,
                src_pitch: s * inner,
                dst_pitch: w,
            });
        }
    }
}

/// The scratch bytes the collectives of every program of `programs` need (the largest).
pub(crate) fn scratch_bytes(programs: &[Program]) -> Result<u64, String> {
    let mut most = 0;
    for p in programs {
        for s in &p.steps {
            if let Step::Collective { .. } = s {
                most = most.max(moves(p, s)?.1);
            }
        }
    }
    Ok(most)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::artifact::Elt;

    /// The f32 at `a` (offsets in bytes; the places hold f32s).
    fn slot<'a>(a: At, arenas: &'a mut [Vec<f32>], scratch: &'a mut [f32]) -> &'a mut f32 {
        let o = a.offset as usize / 4;
        match a.place {
            Place::Device(d) => &mut arenas[d][o],
            Place::Scratch => &mut scratch[o],
        }
    }

    /// Runs moves as they are specified, one f32 at a time.
    pub(crate) fn run(ms: &[Move], arenas: &mut [Vec<f32>], scratch: &mut [f32]) {
        let shift = |a: At, by: u64| At {
            offset: a.offset + by,
            ..a
        };
        for m in ms {
            match *m {
                Move::Copy {
                    src,
                    dst,
                    width,
                    rows,
                    src_pitch,
                    dst_pitch,
                } => {
                    for r in 0..rows {
                        for b in (0..width).step_by(4) {
                            let v = *slot(shift(src, r * src_pitch + b), arenas, scratch);
                            *slot(shift(dst, r * dst_pitch + b), arenas, scratch) = v;
                        }
                    }
                }
                Move::Reduce { src, dst, n, max } => {
                    for i in 0..n {
                        let x = *slot(shift(src, 4 * i), arenas, scratch);
                        let acc = slot(shift(dst, 4 * i), arenas, scratch);
                        *acc = if max { acc.max(x) } else { *acc + x };
                    }
                }
            }
        }
    }

    fn buf(shape: &[u64], offset: u64) -> Buffer {
        Buffer {
            shape: shape.to_vec(),
            elt: Elt::F32,
            offset,
        }
    }

    /// Two devices, buffers 0 (at 0) and 1 (at 256 bytes) of 128 f32 arenas starting with
    /// `init`, after step `s`.
    fn on_two(b0: Buffer, b1: Buffer, s: &Step, init: [&[f32]; 2]) -> [Vec<f32>; 2] {
        let prog = Program {
            name: "f".into(),
            devices: vec![0, 1],
            inputs: Vec::new(),
            outputs: Vec::new(),
            buffers: vec![b0, b1],
            arena_bytes: 512,
            constants: Vec::new(),
            steps: Vec::new(),
        };
        let (ms, scratch) = moves(&prog, s).unwrap();
        let mut arenas: Vec<Vec<f32>> = init
            .iter()
            .map(|x| {
                let mut a = vec![0f32; 128];
                a[..x.len()].copy_from_slice(x);
                a
            })
            .collect();
        let mut sc = vec![0f32; scratch as usize / 4];
        run(&ms, &mut arenas, &mut sc);
        [arenas[0].clone(), arenas[1].clone()]
    }

    /// An all-to-all's moves against its definition (member `k` gets piece `k` along the
    /// split dim of every member's input, concatenated along the other dim in member
    /// order): groups of 2 and 3, ranks 2 to 4, the split dim before and after the
    /// concatenated one, outer dims before both.
    #[test]
    fn all_to_all_moves_match_the_definition() {
        let cases: &[(&[u64], usize, usize, usize)] = &[
            (&[4, 6], 0, 1, 2),
            (&[4, 6], 1, 0, 2),
            (&[2, 6, 3], 1, 2, 3),
            (&[2, 6, 3], 2, 0, 3),
            (&[2, 6, 3], 1, 0, 2),
            (&[3, 2, 4, 2], 2, 3, 2),
            (&[3, 2, 4, 2], 3, 1, 2),
            (&[3, 4, 2, 5], 1, 3, 2),
        ];
        for &(shape, split, concat, n) in cases {
            let len: u64 = shape.iter().product();
            let mut oshape = shape.to_vec();
            oshape[split] /= n as u64;
            oshape[concat] *= n as u64;
            let prog = Program {
                name: "f".into(),
                devices: (0..n).collect(),
                inputs: Vec::new(),
                outputs: Vec::new(),
                buffers: vec![buf(shape, 0), buf(&oshape, 4 * len)],
                arena_bytes: 8 * len,
                constants: Vec::new(),
                steps: Vec::new(),
            };
            let s = Step::Collective {
                op: Collective::AllToAll {
                    split_dim: split,
                    concat_dim: concat,
                },
                input: 0,
                output: 1,
                groups: vec![(0..n).collect()],
            };
            let (ms, scratch) = moves(&prog, &s).unwrap();
            assert_eq!(scratch, 0);
            let mut arenas: Vec<Vec<f32>> = (0..n)
                .map(|d| {
                    let mut a = vec![-1f32; 2 * len as usize];
                    for (i, v) in a[..len as usize].iter_mut().enumerate() {
                        *v = (1000 * d + i) as f32;
                    }
                    a
                })
                .collect();
            run(&ms, &mut arenas, &mut []);
            let strides = |sh: &[u64]| {
                let mut st = vec![1u64; sh.len()];
                for d in (0..sh.len() - 1).rev() {
                    st[d] = st[d + 1] * sh[d + 1];
                }
                st
            };
            let (ist, ost) = (strides(shape), strides(&oshape));
            let (c, piece) = (shape[concat], shape[split] / n as u64);
            for (k, arena) in arenas.iter().enumerate() {
                for e in 0..len {
                    let mut idx: Vec<u64> =
                        ost.iter().zip(&oshape).map(|(st, d)| e / st % d).collect();
                    let p = idx[concat] / c;
                    idx[concat] %= c;
                    idx[split] += k as u64 * piece;
                    let at: u64 = idx.iter().zip(&ist).map(|(i, st)| i * st).sum();
                    let want = (1000 * p + at) as f32;
                    assert_eq!(
                        arena[(len + e) as usize],
                        want,
                        "{shape:?} split {split} concat {concat} over {n}: member {k}, element {e}"
                    );
                }
            }
        }
    }

    const X0: [f32; 8] = [0., 1., 2., 3., 4., 5., 6., 7.];
    const X1: [f32; 8] = [10., 11., 12., 13., 14., 15., 16., 17.];

    /// Each collective along dim 1 of a [2, 4] tensor on two devices, against what it
    /// means.
    #[test]
    fn moves_compute_the_collectives() {
        let g = vec![vec![0, 1]];
        let sum: Vec<f32> = X0.iter().zip(&X1).map(|(a, b)| a + b).collect();
        let s = Step::Collective {
            op: Collective::AllReduce { max: false },
            input: 0,
            output: 1,
            groups: g.clone(),
        };
        let [a, b] = on_two(buf(&[2, 4], 0), buf(&[2, 4], 256), &s, [&X0, &X1]);
        assert_eq!((&a[64..72], &b[64..72]), (&sum[..], &sum[..]));
        let s = Step::Collective {
            op: Collective::ReduceScatter { dim: 1, max: false },
            input: 0,
            output: 1,
            groups: g.clone(),
        };
        let [a, b] = on_two(buf(&[2, 4], 0), buf(&[2, 2], 256), &s, [&X0, &X1]);
        assert_eq!(&a[64..68], &[10., 12., 18., 20.]);
        assert_eq!(&b[64..68], &[14., 16., 22., 24.]);
        let s = Step::Collective {
            op: Collective::AllGather { dim: 1 },
            input: 0,
            output: 1,
            groups: g.clone(),
        };
        let [a, b] = on_two(buf(&[2, 2], 0), buf(&[2, 4], 256), &s, [&X0[..4], &X1[..4]]);
        let want = [0., 1., 10., 11., 2., 3., 12., 13.];
        assert_eq!((&a[64..72], &b[64..72]), (&want[..], &want[..]));
        let s = Step::Collective {
            op: Collective::Slice { dim: 1 },
            input: 0,
            output: 1,
            groups: g.clone(),
        };
        let [a, b] = on_two(buf(&[2, 4], 0), buf(&[2, 2], 256), &s, [&X0, &X1]);
        assert_eq!(
            (&a[64..68], &b[64..68]),
            (&[0., 1., 4., 5.][..], &[12., 13., 16., 17.][..])
        );
        let s = Step::Collective {
            op: Collective::Broadcast { root: 1 },
            input: 0,
            output: 1,
            groups: g.clone(),
        };
        let [a, b] = on_two(buf(&[2, 4], 0), buf(&[2, 4], 256), &s, [&X0, &X1]);
        assert_eq!((&a[64..72], &b[64..72]), (&X1[..], &X1[..]));
        // The maximum, in place (input and output one buffer).
        let x1: Vec<f32> = X1.iter().map(|v| 20. - v).collect();
        let s = Step::Collective {
            op: Collective::AllReduce { max: true },
            input: 0,
            output: 0,
            groups: g,
        };
        let [a, b] = on_two(buf(&[2, 4], 0), buf(&[1], 256), &s, [&X0, &x1]);
        let want = [10., 9., 8., 7., 6., 5., 6., 7.];
        assert_eq!((&a[..8], &b[..8]), (&want[..], &want[..]));
    }
}
