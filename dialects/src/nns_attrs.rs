//! The values of the `nns` attributes — meshes and their axes, layouts, split directives —
//! with their parsers and printers: what `#nns.axes<...>`, `#nns.layout<...>` and
//! `#nns.split<...>` mean (the spellings are in [`crate::nns`], which re-exports these).
//! Depends on nothing else in the crate, so the attribute values
//! ([`crate::types::AttrValue`]) can hold them.

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
