//! The collectives, each described once: its name and parameters (the `collectives!` table:
//! what the artifact's JSON, the compiler's `nns` ops and the generated PyTorch call it),
//! and, in one `match` per subject, what its buffers must be ([`Collective::out_shape`]),
//! what it means ([`Collective::reference`]: member `k`'s output from the members'
//! inputs), its copies and reductions on one GPU or the host's lockstep
//! ([`Collective::group_moves`]) and a rank's share of it around NCCL's calls
//! ([`Collective::share`]). The matches are exhaustive, so a new collective that lacks one
//! of them does not compile; the tests run every collective with every parameter through
//! both implementations against its meaning.
//!
//! The compiler's `nns` op of a collective is `nns.<name>` with the same parameters as
//! integer attributes, except [`ParamKind::Max`], which is `reduce = "max"` there.

use super::{at, copy, exchange, piece, At, Flat, Move, Place, RankOp};
use crate::artifact::{Buffer, Elt};
use crate::tensor::narrow_elems;

/// What a parameter of a collective is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// A dim of the input (an index below its rank).
    Dim,
    /// A member of the group (a position in it).
    Member,
    /// Whether it reduces by maximum instead of sum.
    Max,
}

/// A parameter's value: an index ([`ParamKind::Dim`], [`ParamKind::Member`]) or a flag
/// ([`ParamKind::Max`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// A dim or a member.
    Index(usize),
    /// A flag.
    Flag(bool),
}

impl Param {
    fn index(self) -> usize {
        match self {
            Param::Index(i) => i,
            Param::Flag(b) => usize::from(b),
        }
    }
    fn flag(self) -> bool {
        match self {
            Param::Flag(b) => b,
            Param::Index(i) => i != 0,
        }
    }
}

macro_rules! param_type {
    (Dim) => {
        usize
    };
    (Member) => {
        usize
    };
    (Max) => {
        bool
    };
}

macro_rules! param_value {
    (Max, $v:expr) => {
        Param::Flag($v)
    };
    ($other:ident, $v:expr) => {
        Param::Index($v)
    };
}

macro_rules! param_from {
    (Max, $p:expr) => {
        $p.flag()
    };
    ($other:ident, $p:expr) => {
        $p.index()
    };
}

/// Declares the collectives: per collective its variant, its name and its parameters in
/// order (each with its kind), which become the enum, [`Collective::name`],
/// [`Collective::params`] and [`Collective::parse`].
macro_rules! collectives {
    ($(
        $(#[$doc:meta])*
        $variant:ident $name:literal { $( $(#[$fdoc:meta])* $field:ident : $kind:ident ),* }
    )*) => {
        /// A collective step's operation and its parameters (its buffers and groups are
        /// the step's).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Collective {
            $(
                $(#[$doc])*
                $variant { $( $(#[$fdoc])* $field: param_type!($kind) ),* },
            )*
        }

        impl Collective {
            /// Every collective's name and its parameters (name, kind), in order.
            pub const TABLE: &'static [(&'static str, &'static [(&'static str, ParamKind)])] = &[
                $( ($name, &[ $( (stringify!($field), ParamKind::$kind) ),* ]) ),*
            ];

            /// Its name (`all_gather`; the `nns` op is `nns.all_gather`).
            pub fn name(&self) -> &'static str {
                match self {
                    $( Collective::$variant { .. } => $name, )*
                }
            }

            /// Its parameters (name, value), in order.
            pub fn params(&self) -> Vec<(&'static str, Param)> {
                match *self {
                    $( Collective::$variant { $($field),* } => {
                        vec![ $( (stringify!($field), param_value!($kind, $field)) ),* ]
                    } )*
                }
            }

            /// The collective called `name`, its parameters read by `get(name, kind)`
            /// (which answers a [`Param::Flag`] for [`ParamKind::Max`], an index
            /// otherwise); `None` for a name that is not a collective's.
            pub fn parse<E>(
                name: &str,
                mut get: impl FnMut(&'static str, ParamKind) -> Result<Param, E>,
            ) -> Option<Result<Collective, E>> {
                #[allow(unused_mut, unused_variables)]
                let mut read = |f: &'static str, k: ParamKind| get(f, k);
                match name {
                    $( $name => Some((|| -> Result<Collective, E> {
                        Ok(Collective::$variant {
                            $( $field: param_from!($kind, read(stringify!($field), ParamKind::$kind)?) ),*
                        })
                    })()), )*
                    _ => None,
                }
            }
        }
    };
}

collectives! {
    /// Within each group, every member's output becomes the sum (or maximum) of the
    /// members' inputs, summed in member order.
    AllReduce "all_reduce" {
        /// Maximum instead of sum.
        max: Max
    }
    /// Every member's output becomes the members' inputs concatenated along `dim`.
    AllGather "all_gather" {
        /// The concatenated dim.
        dim: Dim
    }
    /// Member `k`'s output becomes piece `k` along `dim` of its own input (a device's
    /// shard of a replicated value; no communication).
    Slice "slice" {
        /// The cut dim.
        dim: Dim
    }
    /// Member `k`'s output becomes piece `k` along `dim` of the members' reduced inputs.
    ReduceScatter "reduce_scatter" {
        /// The cut dim.
        dim: Dim,
        /// Maximum instead of sum.
        max: Max
    }
    /// Member `k`'s output becomes piece `k` along `split_dim` of every member's input,
    /// concatenated along `concat_dim` in member order (a dim's shards turned into
    /// another dim's).
    AllToAll "all_to_all" {
        /// The dim cut into the members' pieces.
        split_dim: Dim,
        /// The dim the received pieces are concatenated along.
        concat_dim: Dim
    }
    /// Every member's output becomes member `root`'s input.
    Broadcast "broadcast" {
        /// The member whose input is copied (a position in each group).
        root: Member
    }
}

/// An element type a collective's meaning is computed on: f32 (which reduces) and i64
/// (which only moves).
pub trait Elem: Copy {
    /// `acc[i] = acc[i] + x[i]` (or their maximum).
    fn reduce_into(acc: &mut [Self], x: &[Self], max: bool) -> Result<(), String>;
}

impl Elem for f32 {
    fn reduce_into(acc: &mut [f32], x: &[f32], max: bool) -> Result<(), String> {
        for (a, &b) in acc.iter_mut().zip(x) {
            *a = if max { a.max(b) } else { *a + b };
        }
        Ok(())
    }
}

impl Elem for i64 {
    fn reduce_into(_: &mut [i64], _: &[i64], _: bool) -> Result<(), String> {
        Err("a reduction of integers".into())
    }
}

impl Collective {
    /// Whether it reduces (its buffers then hold f32s; bf16 results are rounded after it).
    pub fn reduces(&self) -> bool {
        match self {
            Collective::AllReduce { .. } | Collective::ReduceScatter { .. } => true,
            Collective::AllGather { .. }
            | Collective::Slice { .. }
            | Collective::AllToAll { .. }
            | Collective::Broadcast { .. } => false,
        }
    }

    /// Whether a member's output depends on the other members' inputs (a slice's does
    /// not).
    pub fn communicates(&self) -> bool {
        !matches!(self, Collective::Slice { .. })
    }

    /// The shape of a member's output for an input of `shape` in groups of `n`, or why
    /// the input does not fit it.
    pub fn out_shape(&self, shape: &[u64], n: u64) -> Result<Vec<u64>, String> {
        let mut want = shape.to_vec();
        let rank = shape.len();
        let cut = |want: &mut Vec<u64>, d: usize| -> Result<(), String> {
            let Some(len) = want.get_mut(d) else {
                return Err(format!("dim {d} is beyond its buffers' rank"));
            };
            if *len % n != 0 {
                return Err(format!("dim {d} ({len}) does not divide into {n} pieces"));
            }
            *len /= n;
            Ok(())
        };
        match *self {
            Collective::AllReduce { .. } => {}
            Collective::Broadcast { root } => {
                if root as u64 >= n {
                    return Err(format!("its root {root} is not a member of a group of {n}"));
                }
            }
            Collective::AllGather { dim } => {
                let Some(len) = want.get_mut(dim) else {
                    return Err(format!("dim {dim} is beyond its buffers' rank"));
                };
                *len = len.saturating_mul(n);
            }
            Collective::Slice { dim } | Collective::ReduceScatter { dim, .. } => {
                cut(&mut want, dim)?
            }
            Collective::AllToAll {
                split_dim,
                concat_dim,
            } => {
                if split_dim == concat_dim || split_dim >= rank || concat_dim >= rank {
                    return Err(format!(
                        "an all_to_all splits dim {split_dim} and concatenates dim {concat_dim} of a rank-{rank} buffer"
                    ));
                }
                cut(&mut want, split_dim)?;
                want[concat_dim] = want[concat_dim].saturating_mul(n);
            }
        }
        Ok(want)
    }

    /// Whether buffers `i` (read) and `o` (written) fit it in groups of `n`: the element
    /// types (one, and f32 where it reduces) and the output's shape.
    pub fn check(&self, i: &Buffer, o: &Buffer, n: u64) -> Result<(), String> {
        // Its dims and root first: they say more than the element types.
        let want = self.out_shape(&i.shape, n)?;
        if i.elt != o.elt || (self.reduces() && i.elt != Elt::F32) {
            return Err("its buffers' element types do not fit it".into());
        }
        if want != o.shape {
            return Err(format!(
                "an input of shape {:?} gives {want:?}, not {:?}",
                i.shape, o.shape
            ));
        }
        Ok(())
    }

    /// Member `me`'s output (its shape and elements) from every member's input `parts`
    /// (each of `shape`, in member order): what the collective means, which the moves,
    /// the rank shares, the simulated devices and the generated PyTorch all compute.
    /// Sums run in member order.
    pub fn reference<T: Elem>(
        &self,
        parts: &[&[T]],
        shape: &[usize],
        me: usize,
    ) -> Result<(Vec<usize>, Vec<T>), String> {
        let n = parts.len();
        let len: usize = shape.iter().product();
        if me >= n {
            return Err(format!("member {me} of a group of {n}"));
        }
        if let Some(p) = parts.iter().find(|p| p.len() != len) {
            return Err(format!(
                "a member's piece has {} elements, not the {len} of {shape:?}",
                p.len()
            ));
        }
        let reduced = |parts: &[&[T]], max: bool| -> Result<Vec<T>, String> {
            let mut acc = parts[0].to_vec();
            for p in &parts[1..] {
                T::reduce_into(&mut acc, p, max)?;
            }
            Ok(acc)
        };
        Ok(match *self {
            Collective::AllReduce { max } => (shape.to_vec(), reduced(parts, max)?),
            Collective::AllGather { dim } => {
                if dim >= shape.len() {
                    return Err(format!("dim {dim} is beyond a rank-{} tensor", shape.len()));
                }
                concat(parts, shape, dim)
            }
            Collective::Slice { dim } => narrow(parts[me], shape, dim, n, me)?,
            Collective::ReduceScatter { dim, max } => {
                // Only this member's piece of each part is summed (element by element as
                // the whole would be).
                let mine = parts
                    .iter()
                    .map(|p| narrow(p, shape, dim, n, me))
                    .collect::<Result<Vec<_>, _>>()?;
                let views: Vec<&[T]> = mine.iter().map(|(_, v)| v.as_slice()).collect();
                (mine[0].0.clone(), reduced(&views, max)?)
            }
            Collective::AllToAll {
                split_dim,
                concat_dim,
            } => {
                let mine = parts
                    .iter()
                    .map(|p| narrow(p, shape, split_dim, n, me))
                    .collect::<Result<Vec<_>, _>>()?;
                let views: Vec<&[T]> = mine.iter().map(|(_, v)| v.as_slice()).collect();
                concat(&views, &mine[0].0, concat_dim)
            }
            Collective::Broadcast { root } => {
                if root >= n {
                    return Err(format!("root {root} of a group of {n}"));
                }
                (shape.to_vec(), parts[root].to_vec())
            }
        })
    }

    /// The moves of the collective within group `g` (positions in the program's device
    /// list, in member order) from buffer `ib` to `ob` (`in_place`: one buffer), appended
    /// to `out`; the scratch bytes they use.
    pub(crate) fn group_moves(
        &self,
        ib: &Buffer,
        ob: &Buffer,
        in_place: bool,
        g: &[usize],
        out: &mut Vec<Move>,
    ) -> u64 {
        let dev = Place::Device;
        let n = g.len() as u64;
        match *self {
            Collective::AllReduce { max } => {
                let first = at(dev(g[0]), ob.offset);
                if !in_place {
                    out.push(copy(at(dev(g[0]), ib.offset), first, ib.bytes()));
                }
                for &d in &g[1..] {
                    out.push(Move::Reduce {
                        src: at(dev(d), ib.offset),
                        dst: first,
                        n: ib.len(),
                        max,
                    });
                }
                for &d in &g[1..] {
                    out.push(copy(first, at(dev(d), ob.offset), ob.bytes()));
                }
                0
            }
            Collective::ReduceScatter { dim, max } => {
                let sum = at(Place::Scratch, 0);
                out.push(copy(at(dev(g[0]), ib.offset), sum, ib.bytes()));
                for &d in &g[1..] {
                    out.push(Move::Reduce {
                        src: at(dev(d), ib.offset),
                        dst: sum,
                        n: ib.len(),
                        max,
                    });
                }
                for (k, &d) in g.iter().enumerate() {
                    let p = piece(ib, dim, k as u64, n);
                    out.push(p.gather(at(Place::Scratch, 0), at(dev(d), ob.offset)));
                }
                ib.bytes()
            }
            Collective::AllGather { dim } => {
                for (k, &from) in g.iter().enumerate() {
                    let p = piece(ob, dim, k as u64, n);
                    for &to in g {
                        out.push(p.scatter(at(dev(from), ib.offset), at(dev(to), ob.offset)));
                    }
                }
                0
            }
            Collective::Slice { dim } => {
                for (k, &d) in g.iter().enumerate() {
                    let p = piece(ib, dim, k as u64, n);
                    out.push(p.gather(at(dev(d), ib.offset), at(dev(d), ob.offset)));
                }
                0
            }
            Collective::Broadcast { root } => {
                let from = at(dev(g[root]), ib.offset);
                for &to in g {
                    if to != g[root] || !in_place {
                        out.push(copy(from, at(dev(to), ob.offset), ib.bytes()));
                    }
                }
                0
            }
            Collective::AllToAll {
                split_dim,
                concat_dim,
            } => {
                for (p, &from) in g.iter().enumerate() {
                    for (k, &to) in g.iter().enumerate() {
                        let (src, dst) = (at(dev(from), ib.offset), at(dev(to), ob.offset));
                        let pk = (p as u64, k as u64, n);
                        exchange(out, ib, split_dim, concat_dim, pk, src, dst);
                    }
                }
                0
            }
        }
    }

    /// Member `member`'s share of the collective in a group of `n`, from buffer `ib` to
    /// `ob` in its own arena (`Device(0)`): local copies around NCCL's calls (`flat` makes
    /// a call this member's), and the scratch bytes it needs.
    pub(crate) fn share(
        &self,
        ib: &Buffer,
        ob: &Buffer,
        n: u64,
        member: usize,
        flat: &dyn Fn(Flat<At>) -> RankOp,
    ) -> (Vec<RankOp>, u64) {
        let own = |o: u64| at(Place::Device(0), o);
        let scratch = |o: u64| at(Place::Scratch, o);
        // Where the dims before `dim` have one index, a piece along `dim` is contiguous
        // (the members' pieces lie one after another, as NCCL's calls want them).
        let outer = |b: &Buffer, dim: usize| -> u64 { b.shape[..dim].iter().product() };
        let mut ops = Vec::new();
        let mut need = 0;
        match *self {
            Collective::AllReduce { max } => {
                ops.push(flat(Flat::AllReduce {
                    send: own(ib.offset),
                    recv: own(ob.offset),
                    n: ib.len(),
                    max,
                }));
            }
            Collective::AllGather { dim } => {
                if outer(ob, dim) == 1 {
                    ops.push(flat(Flat::AllGather {
                        send: own(ib.offset),
                        recv: own(ob.offset),
                        bytes: ib.bytes(),
                    }));
                } else {
                    need = n * ib.bytes();
                    ops.push(flat(Flat::AllGather {
                        send: own(ib.offset),
                        recv: scratch(0),
                        bytes: ib.bytes(),
                    }));
                    for k in 0..n {
                        let p = piece(ob, dim, k, n);
                        ops.push(RankOp::Copy(
                            p.scatter(scratch(k * ib.bytes()), own(ob.offset)),
                        ));
                    }
                }
            }
            Collective::ReduceScatter { dim, max } => {
                let send = if outer(ib, dim) == 1 {
                    own(ib.offset)
                } else {
                    need = ib.bytes();
                    for k in 0..n {
                        let p = piece(ib, dim, k, n);
                        ops.push(RankOp::Copy(
                            p.gather(own(ib.offset), scratch(k * ob.bytes())),
                        ));
                    }
                    scratch(0)
                };
                ops.push(flat(Flat::ReduceScatter {
                    send,
                    recv: own(ob.offset),
                    n: ob.len(),
                    max,
                }));
            }
            Collective::Slice { dim } => {
                let p = piece(ib, dim, member as u64, n);
                ops.push(RankOp::Copy(p.gather(own(ib.offset), own(ob.offset))));
            }
            Collective::Broadcast { root } => {
                ops.push(flat(Flat::Broadcast {
                    send: own(ib.offset),
                    recv: own(ob.offset),
                    bytes: ib.bytes(),
                    root,
                }));
            }
            Collective::AllToAll {
                split_dim,
                concat_dim,
            } => {
                // Pack piece k along the split dim into slot k, exchange slot k with
                // member k (whose piece lands in slot `me` of the second half), unpack
                // slot k into place k along the concatenated dim.
                let w = ib.bytes() / n;
                need = 2 * ib.bytes();
                for k in 0..n {
                    let p = piece(ib, split_dim, k, n);
                    ops.push(RankOp::Copy(p.gather(own(ib.offset), scratch(k * w))));
                }
                ops.push(flat(Flat::Exchange {
                    sends: (0..n).map(|k| scratch(k * w)).collect(),
                    recvs: (0..n).map(|k| scratch(ib.bytes() + k * w)).collect(),
                    bytes: w,
                }));
                for k in 0..n {
                    let p = piece(ob, concat_dim, k, n);
                    ops.push(RankOp::Copy(
                        p.scatter(scratch(ib.bytes() + k * w), own(ob.offset)),
                    ));
                }
            }
        }
        (ops, need)
    }

    /// Every collective with every value of its parameters for inputs of rank `rank` in
    /// groups of `n` (the tests' cases).
    pub fn every(rank: usize, n: usize) -> Vec<Collective> {
        let mut out = Vec::new();
        for &(name, params) in Collective::TABLE {
            let values = |k: ParamKind| -> Vec<Param> {
                match k {
                    ParamKind::Dim => (0..rank).map(Param::Index).collect(),
                    ParamKind::Member => (0..n).map(Param::Index).collect(),
                    ParamKind::Max => vec![Param::Flag(false), Param::Flag(true)],
                }
            };
            let mut combos: Vec<Vec<Param>> = vec![Vec::new()];
            for &(_, k) in params {
                combos = combos
                    .into_iter()
                    .flat_map(|c| {
                        values(k).into_iter().map(move |v| {
                            let mut c = c.clone();
                            c.push(v);
                            c
                        })
                    })
                    .collect();
            }
            for c in combos {
                let mut it = c.into_iter();
                let parsed = Collective::parse(name, |_, _| it.next().ok_or(()));
                if let Some(Ok(coll)) = parsed {
                    out.push(coll);
                }
            }
        }
        out
    }
}

/// Piece `k` of `n` equal ones along `dim` of a tensor of `shape`.
fn narrow<T: Copy>(
    x: &[T],
    shape: &[usize],
    dim: usize,
    n: usize,
    k: usize,
) -> Result<(Vec<usize>, Vec<T>), String> {
    let len = *shape
        .get(dim)
        .ok_or_else(|| format!("dim {dim} is beyond a rank-{} tensor", shape.len()))?;
    if !len.is_multiple_of(n) {
        return Err(format!("dim {dim} of length {len} does not split {n} ways"));
    }
    let w = len / n;
    let mut s = shape.to_vec();
    s[dim] = w;
    Ok((s, narrow_elems(x, shape, dim, k * w..(k + 1) * w)))
}

/// Tensors of `shape` concatenated along `dim` in order.
fn concat<T: Copy>(parts: &[&[T]], shape: &[usize], dim: usize) -> (Vec<usize>, Vec<T>) {
    let len = shape[dim];
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let mut out = Vec::with_capacity(outer * len * inner * parts.len());
    for o in 0..outer {
        for p in parts {
            out.extend_from_slice(&p[o * len * inner..(o + 1) * len * inner]);
        }
    }
    let mut s = shape.to_vec();
    s[dim] = len * parts.len();
    (s, out)
}

#[cfg(test)]
mod tests;
