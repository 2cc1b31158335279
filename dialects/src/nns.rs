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

use std::fmt;

/// A named mesh axis and its size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Axis {
    /// Axis name.
    pub name: String,
    /// Number of devices along it (of micro-batches, for a micro-batch axis).
    pub size: i64,
    /// A micro-batch axis (`mb = 4 (microbatches)`): its coordinates are steps in time on
    /// the same device, not devices. Splitting the batch dim over it cuts the batch into
    /// micro-batches; a pipeline schedule runs them one after another and accumulates
    /// what is partial over it. It must be the mesh's last axis.
    pub microbatches: bool,
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = {}", self.name, self.size)?;
        if self.microbatches {
            f.write_str(" (microbatches)")?;
        }
        Ok(())
    }
}

/// A device mesh: named axes, devices numbered row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mesh {
    /// Symbol name.
    pub name: String,
    /// Axes, outermost first.
    pub axes: Vec<Axis>,
    /// Constraint for the planner: bytes of memory each device may use (`memory_cap`).
    pub memory_cap: Option<i64>,
}

impl Mesh {
    /// Size of axis `name`.
    pub fn axis(&self, name: &str) -> Option<i64> {
        self.axes.iter().find(|a| a.name == name).map(|a| a.size)
    }

    /// Total number of devices (micro-batch axes are not devices).
    pub fn devices(&self) -> i64 {
        self.axes
            .iter()
            .filter(|a| !a.microbatches)
            .map(|a| a.size)
            .product()
    }

    /// The micro-batch axis, if any.
    pub fn microbatch_axis(&self) -> Option<&Axis> {
        self.axes.iter().find(|a| a.microbatches)
    }

    /// The mesh of devices: `self` without its micro-batch axis (the one a pipelined
    /// program's devices are numbered in).
    pub fn device_mesh(&self) -> Mesh {
        Mesh {
            axes: self
                .axes
                .iter()
                .filter(|a| !a.microbatches)
                .cloned()
                .collect(),
            ..self.clone()
        }
    }

    /// The body of the `#nns.axes<...>` attribute spelling the axes.
    pub fn axes_text(&self) -> String {
        let items: Vec<String> = self.axes.iter().map(Axis::to_string).collect();
        items.join(", ")
    }
}

fn is_ident(s: &str) -> bool {
    let mut c = s.chars();
    matches!(c.next(), Some(x) if x.is_ascii_alphabetic() || x == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
}

/// Splits `body` at top-level commas (not inside parentheses).
fn top_level_items(body: &str) -> Vec<String> {
    let (mut items, mut cur, mut depth) = (Vec::new(), String::new(), 0i32);
    for c in body.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if !cur.trim().is_empty() || !items.is_empty() {
        items.push(cur.trim().to_string());
    }
    items
}

/// The most devices a mesh may have (2^20): beyond any cluster, and small enough that a
/// device count times a tensor size never overflows.
pub const MAX_DEVICES: i64 = 1 << 20;

/// Parses the body of `#nns.axes<dp = 2, tp = 4>`.
pub fn parse_axes(body: &str) -> Result<Vec<Axis>, String> {
    let mut axes: Vec<Axis> = Vec::new();
    for item in top_level_items(body) {
        let Some((name, size)) = item.split_once('=') else {
            return Err(format!("mesh axis '{item}' must be written 'name = size'"));
        };
        let (name, mut size) = (name.trim(), size.trim());
        let mut microbatches = false;
        if let Some(rest) = size.strip_suffix(')') {
            let Some((n, kind)) = rest.split_once('(') else {
                return Err(format!("mesh axis '{item}': unbalanced parentheses"));
            };
            if kind.trim() != "microbatches" {
                return Err(format!(
                    "mesh axis '{item}': the only axis kind is '(microbatches)'"
                ));
            }
            microbatches = true;
            size = n.trim();
        }
        if !is_ident(name) {
            return Err(format!("'{name}' is not a valid axis name"));
        }
        let size: i64 = size.parse().ok().filter(|&s| s > 0).ok_or(format!(
            "axis '{name}' has size '{size}'; sizes are positive integers"
        ))?;
        if axes.iter().any(|a| a.name == name) {
            return Err(format!("axis '{name}' is declared twice"));
        }
        if axes.last().is_some_and(|a| a.microbatches) {
            return Err(format!(
                "axis '{name}' follows the micro-batch axis; the micro-batch axis must be the last"
            ));
        }
        axes.push(Axis {
            name: name.to_string(),
            size,
            microbatches,
        });
    }
    if axes.is_empty() {
        return Err("a mesh needs at least one axis".into());
    }
    let devices = axes
        .iter()
        .try_fold(1i64, |n, a| n.checked_mul(a.size))
        .filter(|&n| n <= MAX_DEVICES);
    if devices.is_none() {
        return Err(format!(
            "the mesh has more than {MAX_DEVICES} devices (2^20), the most nnscaler handles"
        ));
    }
    Ok(axes)
}

/// How a value is laid out along one mesh axis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AxisLayout {
    /// Every device along the axis holds the whole value.
    R,
    /// Every device holds a partial value; the whole is their reduction.
    V(Reduce),
    /// The value is split along tensor dimension `n`.
    D(usize),
}

/// A reduction kind for partial values and collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reduce {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
}

impl Reduce {
    /// Parses `sum` / `max`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "sum" => Some(Reduce::Sum),
            "max" => Some(Reduce::Max),
            _ => None,
        }
    }
}

impl fmt::Display for Reduce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Reduce::Sum => "sum",
            Reduce::Max => "max",
        })
    }
}

/// A layout: per mesh axis, R, V or D.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The mesh symbol.
    pub mesh: String,
    /// Non-replicated axes with their layout, in written order.
    pub axes: Vec<(String, AxisLayout)>,
}

impl Layout {
    /// Parses the body of `#nns.layout<@world, dp = D(0), tp = V(sum)>`.
    pub fn parse(body: &str) -> Result<Self, String> {
        let items = top_level_items(body);
        let Some(mesh) = items.first().and_then(|m| m.strip_prefix('@')) else {
            return Err(format!(
                "layout '{body}' must start with the mesh symbol, e.g. '@world, dp = D(0)'"
            ));
        };
        let mut axes: Vec<(String, AxisLayout)> = Vec::new();
        for item in &items[1..] {
            let Some((axis, l)) = item.split_once('=') else {
                return Err(format!(
                    "layout entry '{item}' must be written 'axis = R|V(sum)|D(n)'"
                ));
            };
            let (axis, l) = (axis.trim(), l.trim().replace(' ', ""));
            let parsed = if l == "R" {
                AxisLayout::R
            } else if let Some(r) = l.strip_prefix("V(").and_then(|r| r.strip_suffix(')')) {
                AxisLayout::V(Reduce::parse(r).ok_or(format!(
                    "unknown reduction '{r}' for axis '{axis}' (expected sum or max)"
                ))?)
            } else if let Some(d) = l.strip_prefix("D(").and_then(|d| d.strip_suffix(')')) {
                AxisLayout::D(d.parse().map_err(|_| {
                    format!("'D({d})' for axis '{axis}' must name a tensor dimension")
                })?)
            } else {
                return Err(format!(
                    "'{l}' for axis '{axis}' is not R, V(sum), V(max) or D(n)"
                ));
            };
            if axes.iter().any(|(a, _)| a == axis) {
                return Err(format!("axis '{axis}' appears twice in the layout"));
            }
            axes.push((axis.to_string(), parsed));
        }
        Ok(Layout {
            mesh: mesh.trim().to_string(),
            axes,
        })
    }

    /// Checks the layout against its mesh and a tensor shape: axes exist, D dims are in
    /// range, and each split dim is divisible by the product of the axes splitting it.
    pub fn check(&self, mesh: &Mesh, shape: &[i64]) -> Result<(), String> {
        for (axis, l) in &self.axes {
            if mesh.axis(axis).is_none() {
                return Err(format!("mesh '@{}' has no axis '{axis}'", mesh.name));
            }
            if let AxisLayout::D(d) = l {
                if *d >= shape.len() {
                    return Err(format!(
                        "axis '{axis}' splits dim {d} but the tensor has rank {}",
                        shape.len()
                    ));
                }
            }
        }
        for (d, &len) in shape.iter().enumerate() {
            let parts: i64 = self
                .axes
                .iter()
                .filter(|(_, l)| *l == AxisLayout::D(d))
                .map(|(a, _)| mesh.axis(a).unwrap_or(1))
                .product();
            if len % parts != 0 {
                return Err(format!(
                    "dim {d} of length {len} cannot be split {parts} ways"
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "@{}", self.mesh)?;
        for (a, l) in &self.axes {
            match l {
                AxisLayout::R => write!(f, ", {a} = R")?,
                AxisLayout::V(r) => write!(f, ", {a} = V({r})")?,
                AxisLayout::D(d) => write!(f, ", {a} = D({d})")?,
            }
        }
        Ok(())
    }
}

/// A split directive: annotation identifiers bound to mesh axes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    /// The mesh, when written.
    pub mesh: Option<String>,
    /// (identifier, axes splitting it, outer first).
    pub binds: Vec<(String, Vec<String>)>,
    /// Axes over which the op splits nothing (`R(tp)`): it runs replicated over them, and
    /// `--propagate-layouts` infers no split over them from its operands (which are
    /// gathered instead). Planners write it where they decided against a split.
    pub replicated: Vec<String>,
}

impl Split {
    /// Parses the body of `#nns.split<b = dp, n = (dp, tp)>`, with `R(tp)` (or `R(a, b)`)
    /// naming axes the op is replicated over.
    pub fn parse(body: &str) -> Result<Self, String> {
        let mut items = top_level_items(body);
        let mut mesh = None;
        if let Some(m) = items.first().and_then(|m| m.strip_prefix('@')) {
            mesh = Some(m.trim().to_string());
            items.remove(0);
        }
        let mut binds: Vec<(String, Vec<String>)> = Vec::new();
        let mut replicated: Vec<String> = Vec::new();
        for item in items {
            let closed = item
                .trim()
                .strip_prefix("R(")
                .and_then(|r| r.strip_suffix(')'));
            if let (Some(inner), false) = (closed, item.contains('=')) {
                for a in inner.split(',').map(str::trim) {
                    if !is_ident(a) {
                        return Err(format!("'{a}' in '{item}' is not a mesh axis name"));
                    }
                    if replicated.iter().any(|r| r == a) {
                        return Err(format!("mesh axis '{a}' is named twice in R(...)"));
                    }
                    replicated.push(a.to_string());
                }
                continue;
            }
            let Some((id, axes)) = item.split_once('=') else {
                return Err(format!(
                    "split entry '{item}' must be written 'id = axis' (or 'R(axis)': replicated over it)"
                ));
            };
            let id = id.trim();
            let axes = axes.trim();
            let axes: Vec<String> = match axes.strip_prefix('(').and_then(|a| a.strip_suffix(')')) {
                Some(inner) => inner.split(',').map(|a| a.trim().to_string()).collect(),
                None => vec![axes.to_string()],
            };
            let star_id = id.starts_with('*') && id[1..].parse::<usize>().is_ok();
            if !(is_ident(id) || star_id) {
                return Err(format!("'{id}' is not an annotation identifier"));
            }
            if let Some(a) = axes.iter().find(|a| !is_ident(a)) {
                return Err(format!("'{a}' is not a mesh axis name"));
            }
            if binds.iter().any(|(i, _)| i == id) {
                return Err(format!("identifier '{id}' has two split directives"));
            }
            for a in &axes {
                if let Some((other, _)) = binds.iter().find(|(_, v)| v.contains(a)) {
                    return Err(format!("mesh axis '{a}' splits both '{other}' and '{id}'"));
                }
            }
            binds.push((id.to_string(), axes));
        }
        if let Some(a) = replicated
            .iter()
            .find(|a| binds.iter().any(|(_, v)| v.contains(a)))
        {
            return Err(format!(
                "mesh axis '{a}' both splits a dimension and is named in R({a})"
            ));
        }
        Ok(Split {
            mesh,
            binds,
            replicated,
        })
    }
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items = Vec::new();
        if let Some(m) = &self.mesh {
            items.push(format!("@{m}"));
        }
        for (id, axes) in &self.binds {
            if axes.len() == 1 {
                items.push(format!("{id} = {}", axes[0]));
            } else {
                items.push(format!("{id} = ({})", axes.join(", ")));
            }
        }
        if !self.replicated.is_empty() {
            items.push(format!("R({})", self.replicated.join(", ")));
        }
        f.write_str(&items.join(", "))
    }
}

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
    COLLECTIVES.iter().find(|c| c.name == name)
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
