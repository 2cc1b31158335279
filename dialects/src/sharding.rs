//! The layout algebra: R/V/D per named mesh axis in canonical form, which piece of a
//! tensor each device holds, and the cheapest sequence of collectives between two layouts.
//!
//! A [`Sharding`] is a [`Layout`] resolved against its mesh and the tensor's rank: for every
//! tensor dim, the mesh axes splitting it (outer first), and for every mesh axis whether its
//! devices hold partial values. Device `d` has mesh coordinates by row-major numbering; a dim
//! split by axes `a1 (outer), a2` is cut into `|a1|·|a2|` blocks and the device with
//! coordinates `(c1, c2)` holds block `c1·|a2| + c2`.
//!
//! [`TransitionSearch`] finds the cheapest way from one sharding to another over the same
//! mesh: a shortest path over sharding states whose edges are single-axis collectives
//! (all_reduce V→R, reduce_scatter V→D, all_gather D→R, all_to_all D(i)→D(j), local slice
//! R→D). Without a cluster an edge costs the bytes each device sends (ring algorithms) plus
//! a fixed per-hop penalty ([`HOP_BYTES`]), so that among equally cheap paths the shorter
//! wins; given a [`StepPrice`] (the cost model's seconds of each step on a cluster), it
//! costs that, and among equally cheap paths the one with fewer steps wins. Results are
//! cached.

use crate::annotation::{Annotation, Binding, DimKind, TensorAnno};
use crate::nns::{AxisLayout, Layout, Mesh, Reduce};
use crate::spec::Linearity;
use crate::types::{AttrValue, Attrs, Elem};
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// A layout in canonical form over one mesh, for a tensor of known rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sharding {
    /// Per tensor dim: the mesh axes (indices into the mesh) splitting it, outer first.
    pub split: Vec<Vec<usize>>,
    /// Per mesh axis: `Some(reduce)` when devices along it hold partial values.
    pub partial: Vec<Option<Reduce>>,
}

/// What one mesh axis does to a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AxisState {
    /// Replicated.
    R,
    /// Partial values with this reduction.
    V(Reduce),
    /// Split along this tensor dim.
    D(usize),
}

impl Sharding {
    /// Fully replicated over a mesh of `axes` axes, for a rank-`rank` tensor.
    pub fn replicated(rank: usize, axes: usize) -> Self {
        Sharding {
            split: vec![Vec::new(); rank],
            partial: vec![None; axes],
        }
    }

    /// Resolves a written layout against its mesh and the tensor rank.
    pub fn from_layout(layout: &Layout, mesh: &Mesh, rank: usize) -> Result<Self, String> {
        let mut s = Sharding::replicated(rank, mesh.axes.len());
        for (name, l) in &layout.axes {
            let a = mesh
                .axes
                .iter()
                .position(|x| &x.name == name)
                .ok_or_else(|| format!("mesh '@{}' has no axis '{name}'", mesh.name))?;
            match l {
                AxisLayout::R => {}
                AxisLayout::V(r) => s.partial[a] = Some(*r),
                AxisLayout::D(d) => {
                    if *d >= rank {
                        return Err(format!(
                            "axis '{name}' splits dim {d} but the tensor has rank {rank}"
                        ));
                    }
                    s.split[*d].push(a);
                }
            }
        }
        Ok(s)
    }

    /// The written form (axes splitting one dim appear outer first).
    pub fn to_layout(&self, mesh: &Mesh) -> Layout {
        // Mesh order, except that axes splitting the same dim are written together in
        // their nesting order (where the first of them falls).
        let mut axes: Vec<(String, AxisLayout)> = Vec::new();
        let mut written = vec![false; mesh.axes.len()];
        for a in 0..mesh.axes.len() {
            if written[a] {
                continue;
            }
            match self.axis_state(a) {
                AxisState::R => {}
                AxisState::V(r) => axes.push((mesh.axes[a].name.clone(), AxisLayout::V(r))),
                AxisState::D(d) => {
                    for &b in &self.split[d] {
                        written[b] = true;
                        axes.push((mesh.axes[b].name.clone(), AxisLayout::D(d)));
                    }
                }
            }
        }
        Layout {
            mesh: mesh.name.clone(),
            axes,
        }
    }

    /// Reads a layout attribute value (`#nns.layout<...>`) written for `mesh`.
    pub fn from_attr(v: &AttrValue, mesh: &Mesh, rank: usize) -> Result<Self, String> {
        match v.layout() {
            Some(l) => {
                let l = l?;
                if l.mesh != mesh.name {
                    return Err(format!(
                        "layout names mesh '@{}', not '@{}'",
                        l.mesh, mesh.name
                    ));
                }
                Sharding::from_layout(&l, mesh, rank)
            }
            _ => Err("expected a #nns.layout<...> attribute".into()),
        }
    }

    /// What mesh axis `a` does.
    pub fn axis_state(&self, a: usize) -> AxisState {
        if let Some(r) = self.partial[a] {
            return AxisState::V(r);
        }
        for (d, v) in self.split.iter().enumerate() {
            if v.contains(&a) {
                return AxisState::D(d);
            }
        }
        AxisState::R
    }

    /// Checks that every split dim divides evenly; `sizes` are the mesh axis sizes.
    pub fn check(&self, shape: &[i64], sizes: &[i64]) -> Result<(), String> {
        for (d, v) in self.split.iter().enumerate() {
            let parts: i64 = v.iter().map(|&a| sizes[a]).product();
            if shape[d] % parts != 0 {
                return Err(format!(
                    "dim {d} of length {} cannot be split {parts} ways",
                    shape[d]
                ));
            }
        }
        Ok(())
    }

    /// The local shape each device holds.
    pub fn local_shape(&self, shape: &[i64], sizes: &[i64]) -> Vec<i64> {
        shape
            .iter()
            .zip(&self.split)
            .map(|(&len, v)| len / v.iter().map(|&a| sizes[a]).product::<i64>())
            .collect()
    }

    /// The piece device `device` holds: an index range per dim, and for each partial axis
    /// its coordinate (which partial term the device holds).
    pub fn shard(&self, shape: &[i64], sizes: &[i64], device: usize) -> Shard {
        let coords = coords(sizes, device);
        let local = self.local_shape(shape, sizes);
        let ranges = self
            .split
            .iter()
            .zip(&local)
            .map(|(v, &len)| {
                let mut block = 0i64;
                for &a in v {
                    block = block * sizes[a] + coords[a] as i64;
                }
                (block * len) as usize..((block + 1) * len) as usize
            })
            .collect();
        let partial = self
            .partial
            .iter()
            .enumerate()
            .filter(|(_, p)| p.is_some())
            .map(|(a, _)| (a, coords[a]))
            .collect();
        Shard { ranges, partial }
    }
}

/// The piece of a tensor one device holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// Index range along each dim.
    pub ranges: Vec<Range<usize>>,
    /// For each partial axis: (axis, this device's coordinate along it).
    pub partial: Vec<(usize, usize)>,
}

/// Row-major mesh coordinates of device `device`.
pub fn coords(sizes: &[i64], device: usize) -> Vec<usize> {
    let mut c = vec![0; sizes.len()];
    let mut rest = device;
    for a in (0..sizes.len()).rev() {
        c[a] = rest % sizes[a] as usize;
        rest /= sizes[a] as usize;
    }
    c
}

/// The device at mesh coordinates `coords` (row-major: the last axis fastest); the
/// inverse of [`coords`].
pub fn device(sizes: &[i64], coords: &[usize]) -> usize {
    coords
        .iter()
        .zip(sizes)
        .fold(0, |id, (&x, &n)| id * n as usize + x)
}

/// Where a device meets the others of a collective over some mesh axes: the devices that
/// agree on every other axis are its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meeting {
    /// The group's number: row-major over the other axes, in mesh order.
    pub group: usize,
    /// The device's place in the group: row-major over the collective's axes, in their
    /// order (the order members' pieces are concatenated and summed in).
    pub member: usize,
    /// How many devices the group has.
    pub size: usize,
}

/// Where the device at `coords` on a mesh of `sizes` meets for a collective over `axes`.
/// The CPU runtime's simulated devices meet by it, and the artifact's numbered groups
/// ([`groups`]), which rt's ranks meet in, are made by it.
pub fn meeting(sizes: &[i64], coords: &[usize], axes: &[usize]) -> Meeting {
    let mut m = Meeting {
        group: 0,
        member: 0,
        size: 1,
    };
    for (a, &n) in sizes.iter().enumerate() {
        if !axes.contains(&a) {
            m.group = m.group * n as usize + coords[a];
        }
    }
    for &a in axes {
        m.member = m.member * sizes[a] as usize + coords[a];
        m.size *= sizes[a] as usize;
    }
    m
}

/// Every group of a collective over `axes` on a mesh of `sizes`, by group number ([`meeting`]):
/// its devices in member order.
pub fn groups(sizes: &[i64], axes: &[usize]) -> Vec<Vec<usize>> {
    let devices: usize = sizes.iter().map(|&s| s as usize).product();
    let size: usize = axes.iter().map(|&a| sizes[a] as usize).product();
    let mut out = vec![vec![usize::MAX; size]; devices / size.max(1)];
    for d in 0..devices {
        let m = meeting(sizes, &coords(sizes, d), axes);
        out[m.group][m.member] = d;
    }
    out
}

/// One step of a transition: a collective over one mesh axis (or several, once merged).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// V → R: reduce partial values.
    AllReduce {
        /// Mesh axes.
        axes: Vec<usize>,
        /// Reduction.
        reduce: Reduce,
    },
    /// V → D(dim): reduce and keep one shard.
    ReduceScatter {
        /// Mesh axis.
        axis: usize,
        /// The dim it then splits (innermost).
        dim: usize,
        /// Reduction.
        reduce: Reduce,
    },
    /// D(dim) → R: concatenate the shards.
    AllGather {
        /// Mesh axis (the innermost splitter of `dim`).
        axis: usize,
        /// The dim.
        dim: usize,
    },
    /// D(concat_dim) → D(split_dim).
    AllToAll {
        /// Mesh axis.
        axis: usize,
        /// The dim split afterwards.
        split_dim: usize,
        /// The dim joined (no longer split by `axis`).
        concat_dim: usize,
    },
    /// R → V(sum): every device keeps `value / n`, no communication. Lets a replicated
    /// value join partial sums (a bias added to a partial result) without reducing them.
    Partition {
        /// Mesh axis.
        axis: usize,
    },
    /// R → D(dim): keep the local shard, no communication.
    Slice {
        /// Mesh axis.
        axis: usize,
        /// The dim it then splits (innermost).
        dim: usize,
    },
}

impl Step {
    /// The sharding after this step.
    pub fn apply(&self, s: &Sharding) -> Sharding {
        let mut s = s.clone();
        match self {
            Step::AllReduce { axes, .. } => axes.iter().for_each(|&a| s.partial[a] = None),
            Step::ReduceScatter { axis, dim, .. } => {
                s.partial[*axis] = None;
                s.split[*dim].push(*axis);
            }
            Step::AllGather { dim, .. } => {
                s.split[*dim].pop();
            }
            Step::AllToAll {
                axis,
                split_dim,
                concat_dim,
            } => {
                s.split[*concat_dim].pop();
                s.split[*split_dim].push(*axis);
            }
            Step::Slice { axis, dim } => s.split[*dim].push(*axis),
            Step::Partition { axis } => s.partial[*axis] = Some(Reduce::Sum),
        }
        s
    }

    /// The mesh axes its group spans.
    pub fn axes(&self) -> &[usize] {
        match self {
            Step::AllReduce { axes, .. } => axes,
            Step::ReduceScatter { axis, .. }
            | Step::AllGather { axis, .. }
            | Step::AllToAll { axis, .. }
            | Step::Partition { axis }
            | Step::Slice { axis, .. } => std::slice::from_ref(axis),
        }
    }

    /// The `nns` op this step becomes.
    pub fn op_name(&self) -> &'static str {
        match self {
            Step::AllReduce { .. } => "nns.all_reduce",
            Step::ReduceScatter { .. } => "nns.reduce_scatter",
            Step::AllGather { .. } => "nns.all_gather",
            Step::AllToAll { .. } => "nns.all_to_all",
            Step::Slice { .. } => "nns.slice",
            Step::Partition { .. } => "nns.partition",
        }
    }

    /// The attributes of the `nns` op this step becomes ([`Step::op_name`]).
    pub fn op_attrs(&self, mesh: &Mesh) -> Attrs {
        let names =
            |v: &[usize]| AttrValue::Strs(v.iter().map(|&a| mesh.axes[a].name.clone()).collect());
        let mut a = Attrs::new();
        let int = |x: usize| AttrValue::Int(x as i64);
        match self {
            Step::AllReduce { axes, reduce } => {
                a.insert("axes".into(), names(axes));
                a.insert("reduce".into(), AttrValue::Str(reduce.to_string()));
            }
            Step::ReduceScatter { axis, dim, reduce } => {
                a.insert("axes".into(), names(&[*axis]));
                a.insert("dim".into(), int(*dim));
                a.insert("reduce".into(), AttrValue::Str(reduce.to_string()));
            }
            Step::Partition { axis } => {
                a.insert("axes".into(), names(&[*axis]));
            }
            Step::AllGather { axis, dim } | Step::Slice { axis, dim } => {
                a.insert("axes".into(), names(&[*axis]));
                a.insert("dim".into(), int(*dim));
            }
            Step::AllToAll {
                axis,
                split_dim,
                concat_dim,
            } => {
                a.insert("axes".into(), names(&[*axis]));
                a.insert("split_dim".into(), int(*split_dim));
                a.insert("concat_dim".into(), int(*concat_dim));
            }
        }
        a
    }

    /// A short description with axis names, for tests and messages.
    pub fn describe(&self, mesh: &Mesh) -> String {
        let n = |a: &usize| mesh.axes[*a].name.clone();
        match self {
            Step::AllReduce { axes, reduce } => {
                let v: Vec<String> = axes.iter().map(n).collect();
                format!("all_reduce({}, {reduce})", v.join(" "))
            }
            Step::ReduceScatter { axis, dim, reduce } => {
                format!("reduce_scatter({}, {dim}, {reduce})", n(axis))
            }
            Step::AllGather { axis, dim } => format!("all_gather({}, {dim})", n(axis)),
            Step::AllToAll {
                axis,
                split_dim,
                concat_dim,
            } => format!("all_to_all({}, {concat_dim}->{split_dim})", n(axis)),
            Step::Slice { axis, dim } => format!("slice({}, {dim})", n(axis)),
            Step::Partition { axis } => format!("partition({})", n(axis)),
        }
    }
}

/// The bytes-equivalent of one extra hop (collective launch and latency): 64 KiB.
pub const HOP_BYTES: f64 = 65536.0;

/// What one step of a transition costs on some cluster (seconds, say): given the step and
/// the local bytes of the tensor before and after it on each device. A search priced this
/// way ([`TransitionSearch::priced`]) minimises the sum over a path, then its steps.
pub type StepPrice = Arc<dyn Fn(&Step, f64, f64) -> f64 + Send + Sync>;

/// A planned transition: its steps and the bytes each device sends.
#[derive(Clone, Debug, PartialEq)]
pub struct Transition {
    /// Collectives in order (consecutive all_reduces merged into one).
    pub steps: Vec<Step>,
    /// Bytes each device sends over all steps.
    pub bytes: f64,
}

/// A path's cost: its price, then (when priced by a [`StepPrice`]) its steps.
///
/// Priced paths compare their seconds to nine significant digits, so that paths the cost
/// model prices alike (a joint all_reduce and the reduce_scatter, all_reduce and
/// all_gather it may be cut into can cost the same bytes and latency steps) tie whatever
/// their sums' last bits, and the one with fewer collectives wins.
#[derive(Clone, Copy, Debug)]
struct Cost {
    /// The path's price so far.
    sum: f64,
    /// Its steps (priced paths; 0 otherwise).
    hops: u32,
    /// What paths compare: `sum`, or `sum` to nine digits for priced paths.
    key: f64,
}

impl Cost {
    const ZERO: Cost = Cost {
        sum: 0.0,
        hops: 0,
        key: 0.0,
    };

    /// By bytes: compared exactly, no step count.
    fn bytes(sum: f64) -> Cost {
        Cost {
            sum,
            hops: 0,
            key: sum,
        }
    }

    /// By a price: compared to nine significant digits, then by steps.
    fn priced(sum: f64, hops: u32) -> Cost {
        let key = if sum > 0.0 && sum.is_finite() {
            let scale = 10f64.powi(8 - sum.log10().floor() as i32);
            (sum * scale).round() / scale
        } else {
            sum
        };
        Cost { sum, hops, key }
    }
}

impl PartialEq for Cost {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Cost {}

impl PartialOrd for Cost {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Cost {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key
            .total_cmp(&other.key)
            .then(self.hops.cmp(&other.hops))
    }
}

/// A transition query: (from, to, shape, element bytes, mesh axis sizes).
type Query = (Sharding, Sharding, Vec<i64>, Elem, Vec<i64>);

/// Shortest paths between shardings, cached by query.
#[derive(Default)]
pub struct TransitionSearch {
    cache: HashMap<Query, Option<Transition>>,
    /// Mesh axes no step may move (a micro-batch axis: its coordinates are steps in time).
    fixed: Vec<usize>,
    /// What a step costs; `None`: the bytes it sends plus [`HOP_BYTES`].
    price: Option<StepPrice>,
}

impl fmt::Debug for TransitionSearch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransitionSearch")
            .field("cached", &self.cache.len())
            .field("fixed", &self.fixed)
            .field("priced", &self.price.is_some())
            .finish()
    }
}

impl TransitionSearch {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty cache for a mesh whose axes `fixed` no collective may use.
    pub fn with_fixed_axes(fixed: Vec<usize>) -> Self {
        TransitionSearch {
            fixed,
            ..Self::default()
        }
    }

    /// An empty cache for a mesh whose axes `fixed` no collective may use, choosing paths
    /// by `price` (a cluster's seconds) rather than by bytes.
    pub fn priced(fixed: Vec<usize>, price: StepPrice) -> Self {
        TransitionSearch {
            fixed,
            price: Some(price),
            ..Self::default()
        }
    }

    /// The cheapest transition from `from` to `to` for a tensor of `shape` with `elem`
    /// elements on a mesh of axis `sizes`; `None` when there is none (e.g. the target is
    /// partial but the source is not). A tensor of integers is never made partial on the
    /// way (a partial sum of indices means nothing, and the runtimes refuse it).
    pub fn find(
        &mut self,
        from: &Sharding,
        to: &Sharding,
        shape: &[i64],
        elem: Elem,
        sizes: &[i64],
    ) -> Option<Transition> {
        let key = (
            from.clone(),
            to.clone(),
            shape.to_vec(),
            elem,
            sizes.to_vec(),
        );
        if let Some(t) = self.cache.get(&key) {
            return t.clone();
        }
        let t = search(
            (from, to),
            (shape, elem),
            sizes,
            &self.fixed,
            self.price.as_ref(),
        );
        self.cache.insert(key, t.clone());
        t
    }
}

fn local_bytes(s: &Sharding, shape: &[i64], elem_bytes: u64, sizes: &[i64]) -> f64 {
    s.local_shape(shape, sizes)
        .iter()
        .map(|&d| d as f64)
        .product::<f64>()
        * elem_bytes as f64
}

/// The moves out of `s`, whose local piece is `here` bytes: (step, next state, bytes sent
/// per device, local bytes after).
/// Each collective of the table offers its own (`CollectiveSpec::moves`) along each mesh
/// axis, in table order, and sends what its `sent_bytes` says. With `joint`, also one
/// all_reduce over each set of two or more axes partial with the same reduction (what a
/// run of single-axis all_reduces becomes when they are merged, priced as the one
/// collective it is).
fn moves(
    (s, here): (&Sharding, f64),
    (shape, elem_bytes): (&[i64], u64),
    sizes: &[i64],
    fixed: &[usize],
    joint: bool,
) -> Vec<(Step, Sharding, f64, f64)> {
    let mut out = Vec::new();
    for a in 0..sizes.len() {
        // An axis of size 1 moves nothing, but its layout still has to change (a partial
        // sum over one device all_reduced away): its moves cost only the per-hop penalty.
        if fixed.contains(&a) {
            continue;
        }
        let n = sizes[a] as f64;
        for c in crate::nns::COLLECTIVES {
            let Some(rule) = c.moves else { continue };
            for (step, next) in rule(s, a, shape, sizes) {
                let after = local_bytes(&next, shape, elem_bytes, sizes);
                let bytes = (c.sent_bytes)(n, here, after);
                out.push((step, next, bytes, after));
            }
        }
    }
    if joint {
        out.extend(joint_all_reduces(s, sizes, fixed, here));
    }
    out
}

/// How a collective changes layouts: the steps it offers from layout `s` along mesh axis
/// `a`, with the layout each leads to (for a tensor of `shape` on a mesh of axis `sizes`;
/// only splits that divide are offered).
pub type MovesRule =
    fn(s: &Sharding, a: usize, shape: &[i64], sizes: &[i64]) -> Vec<(Step, Sharding)>;

/// One all_reduce over each set of two or more axes (not `fixed`) along which `s` is
/// partial with the same reduction: (step, next state, bytes sent, local bytes after).
fn joint_all_reduces(
    s: &Sharding,
    sizes: &[i64],
    fixed: &[usize],
    here: f64,
) -> Vec<(Step, Sharding, f64, f64)> {
    let mut out = Vec::new();
    for reduce in [Reduce::Sum, Reduce::Max] {
        let partial: Vec<usize> = (0..sizes.len())
            .filter(|a| !fixed.contains(a) && s.partial[*a] == Some(reduce))
            .collect();
        // Every subset of two or more, in mesh order (a handful of axes).
        for bits in 1u32..(1 << partial.len()) {
            if bits.count_ones() < 2 {
                continue;
            }
            let axes: Vec<usize> = (0..partial.len())
                .filter(|i| bits & (1 << i) != 0)
                .map(|i| partial[i])
                .collect();
            let n: f64 = axes.iter().map(|&a| sizes[a] as f64).product();
            let step = Step::AllReduce { axes, reduce };
            let next = step.apply(s);
            out.push((
                step,
                next,
                crate::nns::sent_bytes("nns.all_reduce", n, here, here),
                here,
            ));
        }
    }
    out
}

/// `s` with its partial values along axis `a` reduced, and the reduction, when `s` is
/// partial along `a`.
fn reduced(s: &Sharding, a: usize) -> Option<(Sharding, Reduce)> {
    let AxisState::V(reduce) = s.axis_state(a) else {
        return None;
    };
    let mut r = s.clone();
    r.partial[a] = None;
    Some((r, reduce))
}

/// The dim axis `a` splits and `s` with that split undone, when `a` is the innermost
/// splitter of its dim (only that one can be undone).
fn unsplit(s: &Sharding, a: usize) -> Option<(usize, Sharding)> {
    let AxisState::D(dim) = s.axis_state(a) else {
        return None;
    };
    if s.split[dim].last() != Some(&a) {
        return None;
    }
    let mut r = s.clone();
    r.split[dim].pop();
    Some((dim, r))
}

/// `base` further split along axis `a` on each dim of `dims` where that divides, with the
/// step that does it.
fn split_on(
    base: &Sharding,
    a: usize,
    dims: impl Iterator<Item = usize>,
    shape: &[i64],
    sizes: &[i64],
    step: impl Fn(usize) -> Step,
) -> Vec<(Step, Sharding)> {
    dims.filter_map(|dim| {
        let mut d = base.clone();
        d.split[dim].push(a);
        d.check(shape, sizes).is_ok().then(|| (step(dim), d))
    })
    .collect()
}

/// V → R.
pub fn moves_all_reduce(s: &Sharding, a: usize, _: &[i64], _: &[i64]) -> Vec<(Step, Sharding)> {
    reduced(s, a)
        .map(|(r, reduce)| {
            let step = Step::AllReduce {
                axes: vec![a],
                reduce,
            };
            (step, r)
        })
        .into_iter()
        .collect()
}

/// V → D(dim), for each dim it divides.
pub fn moves_reduce_scatter(
    s: &Sharding,
    a: usize,
    shape: &[i64],
    sizes: &[i64],
) -> Vec<(Step, Sharding)> {
    let Some((r, reduce)) = reduced(s, a) else {
        return Vec::new();
    };
    split_on(&r, a, 0..shape.len(), shape, sizes, |dim| {
        Step::ReduceScatter {
            axis: a,
            dim,
            reduce,
        }
    })
}

/// D(dim) → R, when `a` is the innermost splitter of its dim.
pub fn moves_all_gather(s: &Sharding, a: usize, _: &[i64], _: &[i64]) -> Vec<(Step, Sharding)> {
    unsplit(s, a)
        .map(|(dim, r)| (Step::AllGather { axis: a, dim }, r))
        .into_iter()
        .collect()
}

/// D(concat_dim) → D(split_dim), for each other dim it divides.
pub fn moves_all_to_all(
    s: &Sharding,
    a: usize,
    shape: &[i64],
    sizes: &[i64],
) -> Vec<(Step, Sharding)> {
    let Some((dim, r)) = unsplit(s, a) else {
        return Vec::new();
    };
    let others = (0..shape.len()).filter(move |&t| t != dim);
    split_on(&r, a, others, shape, sizes, |to| Step::AllToAll {
        axis: a,
        split_dim: to,
        concat_dim: dim,
    })
}

/// R → V(sum), locally.
pub fn moves_partition(s: &Sharding, a: usize, _: &[i64], _: &[i64]) -> Vec<(Step, Sharding)> {
    if s.axis_state(a) != AxisState::R {
        return Vec::new();
    }
    let mut v = s.clone();
    v.partial[a] = Some(Reduce::Sum);
    vec![(Step::Partition { axis: a }, v)]
}

/// R → D(dim), locally, for each dim it divides.
pub fn moves_slice(s: &Sharding, a: usize, shape: &[i64], sizes: &[i64]) -> Vec<(Step, Sharding)> {
    if s.axis_state(a) != AxisState::R {
        return Vec::new();
    }
    split_on(s, a, 0..shape.len(), shape, sizes, |dim| Step::Slice {
        axis: a,
        dim,
    })
}

fn search(
    (from, to): (&Sharding, &Sharding),
    (shape, elem): (&[i64], Elem),
    sizes: &[i64],
    fixed: &[usize],
    price: Option<&StepPrice>,
) -> Option<Transition> {
    let elem_bytes = elem.bytes();
    if from == to {
        return Some(Transition {
            steps: Vec::new(),
            bytes: 0.0,
        });
    }
    // Dijkstra over sharding states (a handful of axes and dims: small).
    let mut best: BTreeMap<Sharding, Cost> = BTreeMap::new();
    let mut prev: BTreeMap<Sharding, (Sharding, Step, f64)> = BTreeMap::new();
    let mut heap = BinaryHeap::new();
    best.insert(from.clone(), Cost::ZERO);
    heap.push(std::cmp::Reverse((Cost::ZERO, from.clone())));
    while let Some(std::cmp::Reverse((c, s))) = heap.pop() {
        if best.get(&s).is_some_and(|&b| c > b) {
            continue;
        }
        if &s == to {
            break;
        }
        let here = local_bytes(&s, shape, elem_bytes, sizes);
        let joint = price.is_some();
        let out = moves((&s, here), (shape, elem_bytes), sizes, fixed, joint);
        for (step, next, bytes, after) in out {
            if !elem.is_float() && next.partial.iter().any(Option::is_some) {
                continue;
            }
            let nc = match price {
                None => Cost::bytes(c.sum + bytes + HOP_BYTES),
                Some(p) => Cost::priced(c.sum + p(&step, here, after), c.hops + 1),
            };
            if best.get(&next).is_none_or(|&b| nc < b) {
                best.insert(next.clone(), nc);
                prev.insert(next.clone(), (s.clone(), step, bytes));
                heap.push(std::cmp::Reverse((nc, next)));
            }
        }
    }
    best.get(to)?;
    let mut steps = Vec::new();
    let mut bytes = 0.0;
    let mut cur = to.clone();
    while &cur != from {
        let (p, step, b) = prev.get(&cur)?.clone();
        steps.push(step);
        bytes += b;
        cur = p;
    }
    steps.reverse();
    // Priced paths are emitted as priced (a joint all_reduce is already one step); the
    // others merge runs of all_reduces into one.
    Some(Transition {
        steps: if price.is_some() { steps } else { merge(steps) },
        bytes,
    })
}

/// Merges consecutive all_reduces with the same reduction into one over several axes.
fn merge(steps: Vec<Step>) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::new();
    for s in steps {
        if let (
            Some(Step::AllReduce { axes, reduce }),
            Step::AllReduce {
                axes: more,
                reduce: r2,
            },
        ) = (out.last_mut(), &s)
        {
            if reduce == r2 {
                axes.extend(more);
                continue;
            }
        }
        out.push(s);
    }
    out
}

/// How an op's summed (`+`) dims combine across devices: by maximum where its spec says
/// so (`dnn.max`), else by sum.
pub fn partial_kind(op: &str) -> Reduce {
    match crate::dnn::spec(op) {
        Some(s) if s.traits.partial_max => Reduce::Max,
        _ => Reduce::Sum,
    }
}

/// The layouts an op needs for its operands and produces for its results, under a split
/// directive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpLayouts {
    /// Per operand (`None` for a `?` operand, always replicated).
    pub inputs: Vec<Option<Sharding>>,
    /// Per result.
    pub outputs: Vec<Sharding>,
}

/// A split directive resolved against a mesh: (annotation identifier, mesh axes, outer
/// first).
pub type Binds = Vec<(String, Vec<usize>)>;

/// What an op with annotation `anno` (bound as `binding`) reads and writes when the
/// identifiers in `binds` are split over their mesh axes: a dim carrying a split id is
/// D on those axes in every tensor that has it; a summed id leaves each result that lacks
/// it partial (V(sum)) on its axes; everything else is replicated.
pub fn op_layouts(
    anno: &Annotation,
    binding: &Binding,
    reduce: Reduce,
    binds: &[(String, Vec<usize>)],
    mesh_axes: usize,
    in_ranks: &[usize],
    out_ranks: &[usize],
) -> Result<OpLayouts, String> {
    let mut inputs: Vec<Option<Sharding>> = anno
        .inputs
        .iter()
        .zip(in_ranks)
        .map(|(t, &r)| match t {
            TensorAnno::NonTensor => None,
            TensorAnno::Tensor { .. } => Some(Sharding::replicated(r, mesh_axes)),
        })
        .collect();
    let mut outputs: Vec<Sharding> = out_ranks
        .iter()
        .map(|&r| Sharding::replicated(r, mesh_axes))
        .collect();
    let choices = anno.split_choices(binding);
    for (id, axes) in binds {
        let c = choices
            .iter()
            .find(|c| &c.id == id)
            .ok_or_else(|| format!("dimension '{id}' cannot be split in '{anno}'"))?;
        let mut in_outputs = vec![false; outputs.len()];
        for p in &c.positions {
            let t = if p.output {
                in_outputs[p.tensor] = true;
                Some(&mut outputs[p.tensor])
            } else {
                inputs[p.tensor].as_mut()
            };
            if let Some(t) = t {
                t.split[p.dim].extend(axes.iter().copied());
            }
        }
        if c.kind == DimKind::Summed {
            for (j, o) in outputs.iter_mut().enumerate() {
                if !in_outputs[j] {
                    for &a in axes {
                        o.partial[a] = Some(reduce);
                    }
                }
            }
        }
    }
    Ok(OpLayouts { inputs, outputs })
}

/// Split binds that make an op without a directive follow its operands: for each operand
/// (in order) and each of its split dims, the identifier annotating that dim is bound to
/// the same axes, unless the identifier or the axes are already taken; an identifier
/// already bound to the outer axes of a dim split over more (`tp`, then `(tp, dp)`)
/// takes the inner ones too when nothing else holds them. Partial operands propose
/// nothing (they are reduced before the op).
pub fn infer_binds(anno: &Annotation, binding: &Binding, operands: &[Option<&Sharding>]) -> Binds {
    let order: Vec<usize> = (0..operands.len()).collect();
    infer_binds_in(anno, binding, operands, &order)
}

/// [`infer_binds`] consulting the operands in `order` (indices into `operands`): an
/// earlier operand's split wins an identifier or axis a later one also proposes.
pub fn infer_binds_in(
    anno: &Annotation,
    binding: &Binding,
    operands: &[Option<&Sharding>],
    order: &[usize],
) -> Binds {
    let choices = anno.split_choices(binding);
    let mut binds: Binds = Vec::new();
    for &i in order {
        let Some(s) = operands.get(i).copied().flatten() else {
            continue;
        };
        for (d, axes) in s.split.iter().enumerate() {
            if axes.is_empty() {
                continue;
            }
            let Some(c) = choices.iter().find(|c| {
                c.positions
                    .iter()
                    .any(|p| !p.output && p.tensor == i && p.dim == d)
            }) else {
                continue;
            };
            let taken = binds
                .iter()
                .any(|(id, v)| id == &c.id || v.iter().any(|a| axes.contains(a)));
            if !taken {
                binds.push((c.id.clone(), axes.clone()));
                continue;
            }
            // An identifier bound to outer axes of this dim's split (a ZeRO shard's `tp`,
            // then `dp` inside each tp block) takes its inner axes too, when no other
            // identifier has them: the op runs on the finer blocks, as the operand is.
            let Some(at) = binds.iter().position(|(id, _)| id == &c.id) else {
                continue;
            };
            let outer = binds[at].1.len();
            let inner_free = binds.iter().all(|(id, v)| {
                id == &c.id || !v.iter().any(|a| axes[outer.min(axes.len())..].contains(a))
            });
            if axes.len() > outer && axes.starts_with(&binds[at].1) && inner_free {
                binds[at].1 = axes.clone();
            }
        }
    }
    binds
}

/// In which operands op `op` (with `operands` operands) is linear: its spec's traits.
fn linearity(op: &str, operands: usize) -> Linearity {
    crate::dnn::spec(op).map_or(Linearity::No, |s| s.traits.linear.with_operands(operands))
}

/// The operands that must all be partial together for a partial sum to flow through op
/// `op` (replicated ones among them are partitioned to join): the ops jointly linear in
/// more than one operand (add, sub, concat).
pub fn partial_joint(op: &str) -> &'static [usize] {
    match linearity(op, 2) {
        Linearity::Joint(set) if set.len() > 1 => set,
        _ => &[],
    }
}

/// The mesh axes (not split by the op's directive, `bound`) along which partial operands
/// may flow through op `op` unreduced: the op is linear in them and every other operand is
/// replicated along the axis. Returns (axis, reduction) pairs; only sums flow.
pub fn partial_passthrough(
    op: &str,
    operands: &[Option<&Sharding>],
    bound: &[usize],
) -> Vec<(usize, Reduce)> {
    let Some(first) = operands.iter().flatten().next() else {
        return Vec::new();
    };
    let lin = linearity(op, operands.len());
    let mut out = Vec::new();
    for a in 0..first.partial.len() {
        if bound.contains(&a) {
            continue;
        }
        let state = |s: &Option<&Sharding>| s.map(|s| s.axis_state(a));
        let is_v = |s: &Option<&Sharding>| state(s) == Some(AxisState::V(Reduce::Sum));
        let is_r = |s: &Option<&Sharding>| matches!(state(s), Some(AxisState::R) | None);
        let ok = match lin {
            // `linearity` resolved `EachUpTo` for this operand count.
            Linearity::No | Linearity::EachUpTo(..) => false,
            Linearity::Joint(set) => {
                // Replicated operands in the set join the partial ones through a local
                // partition (value / n), so the sum stays partial.
                let mut any = false;
                let mut fine = true;
                for (i, s) in operands.iter().enumerate() {
                    if set.contains(&i) {
                        any |= is_v(s);
                        fine &= is_v(s) || is_r(s);
                    } else {
                        fine &= is_r(s);
                    }
                }
                any && fine
            }
            Linearity::Each(set) => {
                let vs = operands
                    .iter()
                    .enumerate()
                    .filter(|(i, s)| set.contains(i) && is_v(s))
                    .count();
                vs == 1 && operands.iter().all(|s| is_v(s) || is_r(s))
            }
        };
        if ok {
            out.push((a, Reduce::Sum));
        }
    }
    out
}

/// The indices of mesh axes named `names` in `mesh`.
pub fn resolve_axes(names: &[String], mesh: &Mesh) -> Result<Vec<usize>, String> {
    names
        .iter()
        .map(|a| {
            mesh.axes
                .iter()
                .position(|x| &x.name == a)
                .ok_or_else(|| format!("mesh '@{}' has no axis '{a}'", mesh.name))
        })
        .collect()
}

/// Resolves the axis names of a directive against a mesh.
pub fn resolve_binds(split: &crate::nns::Split, mesh: &Mesh) -> Result<Binds, String> {
    split
        .binds
        .iter()
        .map(|(id, axes)| Ok((id.clone(), resolve_axes(axes, mesh)?)))
        .collect()
}

/// The directive text of resolved binds: `id = axis` / `id = (a, b)`.
pub fn binds_to_split(binds: &[(String, Vec<usize>)], mesh: &Mesh) -> crate::nns::Split {
    crate::nns::Split {
        mesh: None,
        binds: binds
            .iter()
            .map(|(id, v)| {
                (
                    id.clone(),
                    v.iter().map(|&a| mesh.axes[a].name.clone()).collect(),
                )
            })
            .collect(),
        replicated: Vec::new(),
    }
}

impl fmt::Display for Sharding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items = Vec::new();
        for (a, p) in self.partial.iter().enumerate() {
            if let Some(r) = p {
                items.push(format!("#{a}=V({r})"));
            }
        }
        for (d, v) in self.split.iter().enumerate() {
            for a in v {
                items.push(format!("#{a}=D({d})"));
            }
        }
        write!(f, "{{{}}}", items.join(", "))
    }
}

#[cfg(test)]
mod tests;
