//! The `nns` dialect: meshes, layouts, split directives, placement, collectives and
//! planner constraints.
//!
//! Attribute spellings (all MLIR opaque dialect attributes, so upstream tools parse them):
//!
//! * mesh axes: `#nns.axes<dp = 2, tp = 4>` on `"nns.mesh"() {sym_name = "world", axes = ...}`;
//! * layout: `#nns.layout<@world, dp = D(0), tp = V(sum)>`, per named mesh axis one of
//!   `R` (replicated), `V(sum)` / `V(max)` (partial values with that reduction), `D(n)`
//!   (split along tensor dim n); axes left out are `R`;
//! * split directive: `#nns.split<b = dp, n = tp>`, binding annotation identifiers of the op
//!   to mesh axes; several axes split one id as `n = (dp, tp)` (outer first); an optional
//!   leading `@mesh,` names the mesh when the module has more than one; `R(tp)` (or
//!   `R(a, b)`) names axes the op splits nothing over (nothing is inferred over them);
//! * planner constraints: `nns.pin` / `nns.forbid` (splits), `nns.colocate`,
//!   `nns.stage_bounds = array<i64: lo, hi>` on ops, and `memory_cap = <bytes> : i64` on
//!   `nns.mesh` (the memory each device may use).

pub use crate::nns_attrs::{
    parse_axes, Axis, AxisLayout, Layout, Mesh, Reduce, Split, MAX_DEVICES,
};

/// The collective and data-movement ops of the `nns` dialect, with what each needs.
#[derive(Clone, Copy, Debug)]
pub struct CollectiveSpec {
    /// Full op name.
    pub name: &'static str,
    /// One line for the docs.
    pub summary: &'static str,
    /// Integer attributes naming tensor dims that the op requires.
    pub dim_attrs: &'static [&'static str],
    /// Its effect on a device's local shape, by those attributes: the dims each device
    /// cuts into `n` pieces (reduce_scatter, slice, all_to_all's `split_dim`) and the dims it
    /// gathers `n` pieces of (all_gather, all_to_all's `concat_dim`), `n` the group size.
    pub cuts: &'static [&'static str],
    /// See `cuts`.
    pub grows: &'static [&'static str],
    /// The layout changes it makes, as steps of the transition search that `--split-tensor`'s
    /// relayouts are lowered through (`None`: the search does not use it).
    pub moves: Option<crate::sharding::MovesRule>,
    /// Whether it takes a `reduce` attribute ("sum" by default).
    pub reduces: bool,
    /// The communication cost model: bytes each device sends for one call over a group of
    /// `n` devices, given the bytes of its (local) operand and result. Ring algorithms:
    /// all_reduce sends `2 (n-1)/n` of its buffer, all_gather `(n-1)/n` of its result,
    /// reduce_scatter and all_to_all `(n-1)/n` of their operand, broadcast (a pipelined
    /// ring) `(n-1)/n` of its buffer on average; local ops nothing. The
    /// transition search and `--print-stats` both use it.
    pub sent_bytes: fn(n: f64, operand: f64, result: f64) -> f64,
    /// Operands and results (1 and 1, except `send` (1, 0) and `recv` (0, 1)).
    pub arity: (usize, usize),
    /// A generic-form example.
    pub example: &'static str,
}

/// Every collective (they keep global shapes until `--localize`).
pub static COLLECTIVES: &[CollectiveSpec] = &[
    CollectiveSpec {
        name: "nns.all_reduce",
        summary: "V -> R: reduces partial values across the axes",
        dim_attrs: &[],
        sent_bytes: |n, x, _| 2.0 * (n - 1.0) / n * x,
        cuts: &[],
        grows: &[],
        moves: Some(crate::sharding::moves_all_reduce),
        reduces: true,
        arity: (1, 1),
        example: r#"%1 = "nns.all_reduce"(%0) {axes = ["tp"], reduce = "sum"} : (tensor<4x8xf32>) -> tensor<4x8xf32>"#,
    },
    CollectiveSpec {
        name: "nns.all_gather",
        summary: "D(dim) -> R: concatenates the shards along dim",
        dim_attrs: &["dim"],
        sent_bytes: |n, _, y| (n - 1.0) / n * y,
        cuts: &[],
        grows: &["dim"],
        moves: Some(crate::sharding::moves_all_gather),
        reduces: false,
        arity: (1, 1),
        example: r#"%1 = "nns.all_gather"(%0) {axes = ["tp"], dim = 1 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>"#,
    },
    CollectiveSpec {
        name: "nns.reduce_scatter",
        summary: "V -> D(dim): reduces and leaves each device one shard",
        dim_attrs: &["dim"],
        sent_bytes: |n, x, _| (n - 1.0) / n * x,
        cuts: &["dim"],
        grows: &[],
        moves: Some(crate::sharding::moves_reduce_scatter),
        reduces: true,
        arity: (1, 1),
        example: r#"%1 = "nns.reduce_scatter"(%0) {axes = ["dp", "tp"], dim = 1 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>"#,
    },
    CollectiveSpec {
        name: "nns.all_to_all",
        summary: "D(concat_dim) -> D(split_dim): re-splits a value along another dim",
        dim_attrs: &["split_dim", "concat_dim"],
        sent_bytes: |n, x, _| (n - 1.0) / n * x,
        cuts: &["split_dim"],
        grows: &["concat_dim"],
        moves: Some(crate::sharding::moves_all_to_all),
        reduces: false,
        arity: (1, 1),
        example: r#"%1 = "nns.all_to_all"(%0) {axes = ["tp"], split_dim = 0 : i64, concat_dim = 1 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>"#,
    },
    CollectiveSpec {
        name: "nns.broadcast",
        summary: "Copies the value of device `root` (index along the axes) to all",
        dim_attrs: &[],
        // A pipelined ring: every device but the last forwards the whole buffer.
        sent_bytes: |n, x, _| (n - 1.0) / n * x,
        cuts: &[],
        grows: &[],
        moves: None,
        reduces: false,
        arity: (1, 1),
        example: r#"%1 = "nns.broadcast"(%0) {axes = ["dp"], root = 0 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>"#,
    },
    CollectiveSpec {
        name: "nns.partition",
        summary:
            "R -> V(sum): each device keeps value / n (n devices along the axes), no communication",
        dim_attrs: &[],
        sent_bytes: |_, _, _| 0.0,
        cuts: &[],
        grows: &[],
        moves: Some(crate::sharding::moves_partition),
        reduces: false,
        arity: (1, 1),
        example: r#"%1 = "nns.partition"(%0) {axes = ["tp"]} : (tensor<4x8xf32>) -> tensor<4x8xf32>"#,
    },
    CollectiveSpec {
        name: "nns.slice",
        summary: "R -> D(dim): each device keeps its shard, no communication",
        dim_attrs: &["dim"],
        sent_bytes: |_, _, _| 0.0,
        cuts: &["dim"],
        grows: &[],
        moves: Some(crate::sharding::moves_slice),
        reduces: false,
        arity: (1, 1),
        example: r#"%1 = "nns.slice"(%0) {axes = ["tp"], dim = 1 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>"#,
    },
    CollectiveSpec {
        name: "nns.transfer",
        summary: "Moves a value from pipeline stage `from` to stage `to` (send/recv pair)",
        dim_attrs: &[],
        sent_bytes: |_, _, _| 0.0,
        cuts: &[],
        grows: &[],
        moves: None,
        reduces: false,
        arity: (1, 1),
        example: r#"%1 = "nns.transfer"(%0) {from = 0 : i64, to = 1 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>"#,
    },
    CollectiveSpec {
        name: "nns.microbatch",
        summary: "R -> D(dim) over the micro-batch axis: micro-batch `index` of the value (a pipelined program's step), no communication",
        dim_attrs: &["dim"],
        sent_bytes: |_, _, _| 0.0,
        cuts: &["dim"],
        grows: &[],
        moves: None,
        reduces: false,
        arity: (1, 1),
        example: r#"%1 = "nns.microbatch"(%0) {axes = ["mb"], dim = 0 : i64, index = 1 : i64} : (tensor<8x16xf32>) -> tensor<8x16xf32>"#,
    },
    CollectiveSpec {
        name: "nns.send",
        summary: "Sends the device's piece of a value to the device at pipeline rank `peer` with the same other coordinates (does not wait); `tag` names the transfer",
        dim_attrs: &[],
        sent_bytes: |_, x, _| x,
        cuts: &[],
        grows: &[],
        moves: None,
        reduces: false,
        arity: (1, 0),
        example: r#""nns.send"(%0) {axis = "pp", peer = 1 : i64, tag = "v12.mb0"} : (tensor<4x8xf32>) -> ()"#,
    },
    CollectiveSpec {
        name: "nns.recv",
        summary: "Receives the piece of a value sent by the device at pipeline rank `peer` with the same other coordinates (waits for it); `tag` must match the send's",
        dim_attrs: &[],
        sent_bytes: |_, _, _| 0.0,
        cuts: &[],
        grows: &[],
        moves: None,
        reduces: false,
        arity: (0, 1),
        example: r#"%0 = "nns.recv"() {axis = "pp", peer = 0 : i64, tag = "v12.mb0"} : () -> tensor<4x8xf32>"#,
    },
    CollectiveSpec {
        name: "nns.relayout",
        summary: "Changes a value's layout to `to`; --lower-relayouts turns it into collectives",
        dim_attrs: &[],
        sent_bytes: |_, _, _| 0.0,
        cuts: &[],
        grows: &[],
        moves: None,
        reduces: false,
        arity: (1, 1),
        example: r#"%1 = "nns.relayout"(%0) {to = #nns.layout<@world, tp = D(1)>} : (tensor<4x8xf32>) -> tensor<4x8xf32>"#,
    },
];

/// Looks up a collective by full name.
pub fn collective(name: &str) -> Option<&'static CollectiveSpec> {
    static BY_NAME: std::sync::OnceLock<
        std::collections::HashMap<&'static str, &'static CollectiveSpec>,
    > = std::sync::OnceLock::new();
    BY_NAME
        .get_or_init(|| COLLECTIVES.iter().rev().map(|c| (c.name, c)).collect())
        .get(name)
        .copied()
}

/// Attributes in the `nns.` namespace that any op may carry.
pub static OP_ATTRS: &[(&str, &str)] = &[
    (
        "nns.split",
        "split directive: #nns.split<id = axis, ...> (op-trans); R(axis) in it: the op splits nothing over that axis (nothing is inferred over it)",
    ),
    (
        "nns.stage",
        "pipeline stage of the op, an integer >= 0 (op-assign)",
    ),
    (
        "nns.layouts",
        "layouts of the op's results: [#nns.layout<...>, ...]",
    ),
    (
        "nns.pin",
        "constraint: the planner must use this split: #nns.split<...>",
    ),
    (
        "nns.forbid",
        "constraint: the planner must not split these ids on these axes",
    ),
    (
        "nns.colocate",
        "constraint: ops with the same string run on the same devices",
    ),
    (
        "nns.stage_bounds",
        "constraint: the op may only be placed in stages lo..=hi: array<i64: lo, hi>",
    ),
    (
        "nns.fragment",
        "on a call of a pipelined program: the fragment and micro-batch it runs, \"<stage><F|B|W><mb>\"",
    ),
    (
        "nns.layer",
        "the layer the op belongs to (--recompute's unit; by default from parameter names)",
    ),
    (
        "nns.recompute",
        "on a forward op's clone in the backward: made by --recompute (unit)",
    ),
    (
        "nns.accumulate",
        "on a dnn.add of a pipelined program: sums a micro-batch's partial into the step's (the all_reduce over the micro-batch axis, in time)",
    ),
];

/// The attributes that say where an op runs and what it belongs to (its stage, layer,
/// recompute mark): an op that a pass makes to stand for or serve another (a cast, the
/// pieces of a vocabulary-parallel cross-entropy) takes them from it, so placement,
/// pipelines and recompute treat it as part of that op. Split constraints (`nns.pin`,
/// `nns.forbid`) name the op's own annotation ids and are not carried over.
pub const PLACEMENT_ATTRS: &[&str] = &["nns.stage", "nns.layer", "nns.recompute"];

/// Op attributes `attrs`' placement attributes ([`PLACEMENT_ATTRS`]).
pub fn placement_of(attrs: &crate::types::Attrs) -> crate::types::Attrs {
    PLACEMENT_ATTRS
        .iter()
        .filter_map(|&k| attrs.get(k).map(|v| (k.to_string(), v.clone())))
        .collect()
}

/// Bytes each device sends for collective `op` over a group of `n` devices (see
/// [`CollectiveSpec::sent_bytes`]); 0 for ops that are not collectives.
pub fn sent_bytes(op: &str, n: f64, operand: f64, result: f64) -> f64 {
    collective(op).map_or(0.0, |c| (c.sent_bytes)(n, operand, result))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh() -> Mesh {
        Mesh {
            name: "world".into(),
            axes: parse_axes("dp = 2, tp = 4").unwrap(),
            memory_cap: None,
        }
    }

    #[test]
    fn axes() {
        assert_eq!(mesh().devices(), 8);
        assert!(parse_axes("dp = 0").unwrap_err().contains("positive"));
        assert!(parse_axes("dp = 2, dp = 2").unwrap_err().contains("twice"));
        assert!(parse_axes("").unwrap_err().contains("at least one"));
    }

    #[test]
    fn layouts_round_trip_and_check() {
        let l = Layout::parse("@world, dp = D(0), tp = V(sum)").unwrap();
        assert_eq!(l.to_string(), "@world, dp = D(0), tp = V(sum)");
        assert!(l.check(&mesh(), &[4, 8]).is_ok());
        assert!(l
            .check(&mesh(), &[3, 8])
            .unwrap_err()
            .contains("cannot be split 2 ways"));
        let l = Layout::parse("@world, pp = R").unwrap();
        assert!(l.check(&mesh(), &[4]).unwrap_err().contains("no axis 'pp'"));
        let l = Layout::parse("@world, tp = D(2)").unwrap();
        assert!(l.check(&mesh(), &[4, 8]).unwrap_err().contains("rank 2"));
        assert!(Layout::parse("dp = R").is_err());
        assert!(Layout::parse("@w, dp = X").unwrap_err().contains("not R"));
    }

    #[test]
    fn splits() {
        let s = Split::parse("b = dp, n = (dp2, tp)").unwrap();
        assert_eq!(s.to_string(), "b = dp, n = (dp2, tp)");
        assert!(Split::parse("b = dp, b = tp")
            .unwrap_err()
            .contains("two split directives"));
        assert!(Split::parse("b = dp, n = dp")
            .unwrap_err()
            .contains("splits both"));
        assert_eq!(
            Split::parse("@m, *0 = dp").unwrap().mesh.as_deref(),
            Some("m")
        );
        // Axes the op is replicated over.
        let s = Split::parse("b = dp, R(tp, sp)").unwrap();
        assert_eq!(s.replicated, ["tp", "sp"]);
        assert_eq!(s.to_string(), "b = dp, R(tp, sp)");
        assert_eq!(Split::parse("R(tp)").unwrap().binds, []);
        assert!(Split::parse("b = tp, R(tp)")
            .unwrap_err()
            .contains("both splits"));
        assert!(Split::parse("R(tp), R(tp)").unwrap_err().contains("twice"));
        assert!(Split::parse("R(t-p)")
            .unwrap_err()
            .contains("not a mesh axis"));
    }
}
