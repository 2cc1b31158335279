//! One Python statement per op: the `dnn` ops as torch calls (or `nns_runtime.ops` where
//! torch has no one-line spelling of the runtime's formula), the `nns` ops as the rank's
//! collectives, cuts and messages, with this rank's offsets as constants.

use super::Plan;
use nnscaler_dialects::graph::{Graph, Node, ValueId};
use nnscaler_dialects::scalar::{Bin, Expr, Un};
use nnscaler_dialects::sharding::Sharding;
use nnscaler_dialects::types::{AttrValue, Elem, TensorType};
use nnscaler_dialects::userop::callee;
use nnscaler_rt::{Collective, Param};
use nnscaler_runtime::spmd::collective_of;
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;

/// The rank whose code is being written.
pub(super) struct RankCtx<'p, 'g> {
    pub plan: &'p Plan<'g>,
    pub rank: usize,
    /// Writing a called function (a pipeline fragment): its micro-batch is the parameter
    /// `mb`, not a constant (the step itself runs at micro-batch 0, as nnscaler's runtime
    /// runs it).
    pub fragment: bool,
}

/// `c + k * mb`: an index that may depend on the running fragment's micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Lin {
    c: i64,
    k: i64,
}

impl Lin {
    fn scaled(self, by: i64) -> Lin {
        Lin {
            c: self.c * by,
            k: self.k * by,
        }
    }

    fn text(self) -> String {
        match (self.c, self.k) {
            (c, 0) => c.to_string(),
            (0, 1) => "mb".into(),
            (0, k) => format!("{k} * mb"),
            (c, 1) => format!("{c} + mb"),
            (c, k) => format!("{c} + {k} * mb"),
        }
    }
}

impl RankCtx<'_, '_> {
    /// Where this rank's block of a dim of local length `len` starts, when attribute `key`
    /// names the mesh axes splitting it (outer first); `None` when the op is unsplit.
    fn block(&self, n: &Node, key: &str, len: i64) -> Result<Option<String>, String> {
        let axes = match n.attrs.get(key) {
            None => return Ok(None),
            Some(AttrValue::Strs(v)) => v.clone(),
            Some(_) => return Err(format!("'{key}' must be an array of mesh axis names")),
        };
        self.offset(&axes, len).map(Some)
    }

    /// This rank's block start of a dim of local length `len` split over `axes`.
    fn offset(&self, axes: &[String], len: i64) -> Result<String, String> {
        let (me, _) = self.member(axes)?;
        Ok(me.scaled(len).text())
    }

    /// This rank's member index and the group size along `axes` (in their order); the
    /// micro-batch axis's coordinate is `mb` inside a fragment.
    fn member(&self, axes: &[String]) -> Result<(Lin, usize), String> {
        let mesh = &self.plan.mesh;
        let coords = &self.plan.ranks[self.rank].coords;
        let (mut me, mut size) = (Lin { c: 0, k: 0 }, 1usize);
        for a in axes {
            let i = mesh
                .axes
                .iter()
                .position(|x| &x.name == a)
                .ok_or_else(|| format!("mesh '@{}' has no axis '{a}'", mesh.name))?;
            let n = mesh.axes[i].size;
            me = me.scaled(n);
            if mesh.axes[i].microbatches && self.fragment {
                me.k += 1;
            } else {
                me.c += coords[i] as i64;
            }
            size *= n as usize;
        }
        Ok((me, size))
    }
}

/// The functions `g` calls (and they call), each once, in the order of their first call.
pub(super) fn callees_of<'g>(g: &'g Graph, out: &mut Vec<&'g Graph>) -> Result<(), String> {
    let mut seen = BTreeSet::new();
    let mut work = vec![g];
    while let Some(f) = work.pop() {
        for n in &f.nodes {
            if n.op != "func.call" {
                continue;
            }
            let name =
                callee(&n.attrs).ok_or_else(|| format!("{}: 'func.call' has no callee", n.loc))?;
            if !seen.insert(name.to_string()) {
                continue;
            }
            let c = g.callees.get(name).ok_or_else(|| {
                format!(
                    "{}: @{name} has no body to emit (a user op with a kernel runs only in nnscaler's runtimes)",
                    n.loc
                )
            })?;
            out.push(c);
            work.push(c);
        }
    }
    Ok(())
}

const KEYWORDS: &[&str] = &[
    "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class", "continue",
    "def", "del", "elif", "else", "except", "finally", "for", "from", "global", "if", "import",
    "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return", "try", "while",
    "with", "yield", "torch", "F", "ops", "comm", "step", "mb",
];

/// `name` as a Python identifier: other characters become `_`, a leading digit or a
/// keyword (or a name the file uses) gets a `_`.
pub(super) fn py_ident(name: &str) -> String {
    let mut s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, '_');
    }
    if KEYWORDS.contains(&s.as_str()) {
        s.push('_');
    }
    s
}

/// Python names of a function's values: arguments by their names, op results by the op
/// (`linear3`) or, for ops of several results, by the result (`dweight2`).
struct Names {
    of: HashMap<ValueId, String>,
    used: BTreeSet<String>,
    count: HashMap<String, usize>,
}

impl Names {
    fn new() -> Self {
        Names {
            of: HashMap::new(),
            used: KEYWORDS.iter().map(|k| k.to_string()).collect(),
            count: HashMap::new(),
        }
    }

    /// Reserves `base` itself, or `base_2`, `base_3`, ... when taken.
    fn exact(&mut self, base: &str) -> String {
        let base = py_ident(base);
        let mut name = base.clone();
        let mut k = 2;
        while self.used.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        self.used.insert(name.clone());
        name
    }

    /// A fresh `base0`, `base1`, ...
    fn fresh(&mut self, base: &str) -> String {
        let base = py_ident(base);
        loop {
            let k = self.count.entry(base.clone()).or_insert(0);
            let name = format!("{base}{k}");
            *k += 1;
            if self.used.insert(name.clone()) {
                return name;
            }
        }
    }

    fn get(&self, v: ValueId) -> Result<&str, String> {
        self.of
            .get(&v)
            .map(String::as_str)
            .ok_or_else(|| format!("value {v} is used before it is defined"))
    }
}

/// An elementwise formula as a PyTorch expression over the operands `a` (constant
/// subexpressions folded to their f32 value, every operation parenthesized).
pub fn torch_formula(e: &Expr, a: &[String]) -> String {
    if e.inputs().is_empty() {
        return pyf(f64::from(e.eval::<f32>(&[])));
    }
    let f = |e: &Expr| torch_formula(e, a);
    let is_const = |e: &Expr| e.inputs().is_empty();
    match e {
        Expr::Input(k) => a[*k].clone(),
        Expr::Const(v) => pyf(f64::from(*v)),
        Expr::Un(u, x) => match u {
            Un::Neg => format!("(-{})", f(x)),
            Un::Exp => format!("torch.exp({})", f(x)),
            Un::Log => format!("torch.log({})", f(x)),
            Un::Sqrt => format!("torch.sqrt({})", f(x)),
            Un::Tanh => format!("torch.tanh({})", f(x)),
            Un::Erf => format!("torch.erf({})", f(x)),
            Un::Abs => format!("torch.abs({})", f(x)),
            Un::RoundBf16 => format!("{}.to(torch.bfloat16).float()", f(x)),
        },
        Expr::Bin(b, l, r) => match b {
            Bin::Add => format!("({} + {})", f(l), f(r)),
            Bin::Sub => format!("({} - {})", f(l), f(r)),
            Bin::Mul => format!("({} * {})", f(l), f(r)),
            Bin::Div => format!("({} / {})", f(l), f(r)),
            Bin::Max if is_const(r) => format!("torch.clamp_min({}, {})", f(l), f(r)),
            Bin::Max if is_const(l) => format!("torch.clamp_min({}, {})", f(r), f(l)),
            Bin::Max => format!("torch.maximum({}, {})", f(l), f(r)),
        },
        Expr::IfGt {
            lhs,
            rhs,
            then,
            otherwise,
        } => format!(
            "torch.where({} > {}, {}, {})",
            f(lhs),
            f(rhs),
            f(then),
            f(otherwise)
        ),
    }
}

/// `x` as a Python float literal.
fn pyf(x: f64) -> String {
    if x.is_nan() {
        "float(\"nan\")".into()
    } else if x.is_infinite() {
        if x > 0.0 {
            "float(\"inf\")"
        } else {
            "-float(\"inf\")"
        }
        .into()
    } else {
        format!("{x:?}")
    }
}

fn ints(v: &[i64]) -> String {
    format!(
        "[{}]",
        v.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
    )
}

fn dims_tuple(v: &[i64]) -> String {
    match v {
        [d] => format!("{d}"),
        _ => format!(
            "({})",
            v.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
        ),
    }
}

fn torch_dtype(e: Elem) -> &'static str {
    match e {
        Elem::F32 => "torch.float32",
        Elem::F16 => "torch.float16",
        Elem::BF16 => "torch.bfloat16",
        Elem::F64 => "torch.float64",
        Elem::I64 => "torch.int64",
        Elem::I32 => "torch.int32",
        Elem::I1 => "torch.bool",
    }
}

/// `x[.., lo:hi]` along `dim` of a rank-`rank` tensor.
fn slice(x: &str, dim: usize, lo: i64, hi: i64) -> String {
    let mut parts = vec![":".to_string(); dim];
    parts.push(format!("{lo}:{hi}"));
    format!("{x}[{}]", parts.join(", "))
}

/// Joins `items` as call arguments, wrapping at about 96 columns with `indent`.
pub(super) fn wrap_call(head: &str, items: &[String], tail: &str, indent: &str) -> String {
    let one = format!("{head}{}{tail}", items.join(", "));
    if one.len() + indent.len() <= 96 {
        return one;
    }
    let mut s = String::from(head);
    let mut line = indent.len() + head.len();
    let cont = format!("{indent}        ");
    for (i, it) in items.iter().enumerate() {
        let piece = if i + 1 < items.len() {
            format!("{it}, ")
        } else {
            it.clone()
        };
        if line + piece.len() > 96 && i > 0 {
            s = s.trim_end().to_string();
            s.push('\n');
            s.push_str(&cont);
            line = cont.len();
        }
        s.push_str(&piece);
        line += piece.len();
    }
    s.push_str(tail);
    s
}

/// `    lhs rhs`, its outermost call's arguments wrapped when the line is long.
fn wrap_statement(lhs: &str, rhs: &str) -> String {
    let one = format!("    {lhs}{rhs}");
    if one.len() <= 96 {
        return one;
    }
    // The call whose parentheses close at the end of the statement.
    let (Some(open), true) = (rhs.find('('), rhs.ends_with(')') || rhs.ends_with(")[0]")) else {
        return one;
    };
    let close = if rhs.ends_with(")[0]") {
        rhs.len() - 4
    } else {
        rhs.len() - 1
    };
    let inner = &rhs[open + 1..close];
    let mut items = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in inner.char_indices() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(inner[start..i].trim().to_string());
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return one;
    }
    items.push(inner[start..].trim().to_string());
    let head = format!("{lhs}{}", &rhs[..=open]);
    format!("    {}", wrap_call(&head, &items, &rhs[close..], "    "))
}

/// The Python function `py_name(comm, ...)` computing `g` on this rank; `arg_names` names
/// the arguments (else their `nns.name`s).
pub(super) fn function(
    ctx: &RankCtx<'_, '_>,
    g: &Graph,
    py_name: &str,
    arg_names: Option<&[String]>,
) -> Result<String, String> {
    let mut names = Names::new();
    let mut params = vec!["comm".to_string()];
    for (i, a) in g.args.iter().enumerate() {
        let base = match arg_names {
            Some(n) => n[i].clone(),
            None => a
                .name()
                .map(str::to_string)
                .unwrap_or_else(|| format!("arg{i}")),
        };
        let n = names.exact(&base);
        names.of.insert(a.value, n.clone());
        params.push(n);
    }
    let layouts = if ctx.plan.mesh.axes.is_empty() {
        None
    } else {
        nnscaler_passes::layouts::value_layouts(g, &ctx.plan.mesh).ok()
    };
    if ctx.fragment && ctx.plan.mesh.microbatch_axis().is_some() {
        params.push("mb=0".into());
    }
    let mut s = wrap_call(&format!("def {py_name}("), &params, "):", "");
    s.push('\n');
    let doc = match g.func_attrs.get("nns.fragment") {
        Some(AttrValue::Str(f)) => format!("Fragment {f} of the pipeline (@{}).", g.name),
        _ if py_name == "step" => format!(
            "This rank's step: @{} on its pieces of the arguments.",
            g.name
        ),
        _ => format!("@{}.", g.name),
    };
    let _ = writeln!(s, "    \"\"\"{doc}\"\"\"");
    for n in &g.nodes {
        let args = n
            .inputs
            .iter()
            .map(|&v| names.get(v).map(str::to_string))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(why) = relayout_comment(ctx, n, layouts.as_deref()) {
            let _ = writeln!(s, "    # {why}");
        }
        let rhs = statement(ctx, g, n, &args).map_err(|e| format!("{}: '{}': {e}", n.loc, n.op))?;
        // Names for the results.
        let lhs = match n.outputs.len() {
            0 => String::new(),
            1 => {
                let base = if n.op == "func.call" {
                    "call".to_string()
                } else {
                    short(&n.op).to_string()
                };
                let v = names.fresh(&base);
                names.of.insert(n.outputs[0], v.clone());
                format!("{v} = ")
            }
            _ if n.op == "func.call" => {
                let t = match n.attrs.get("nns.fragment") {
                    Some(AttrValue::Str(f)) => names.exact(&format!("out_{f}")),
                    _ => names.fresh("out"),
                };
                for (i, &o) in n.outputs.iter().enumerate() {
                    names.of.insert(o, format!("{t}[{i}]"));
                }
                format!("{t} = ")
            }
            _ => {
                let spec = n.op.spec();
                let mut outs = Vec::new();
                for (i, &o) in n.outputs.iter().enumerate() {
                    // A variadic-result op (split) names its one result kind.
                    let base = spec
                        .and_then(|sp| match sp.results {
                            [one] => Some(*one),
                            r => r.get(i).copied(),
                        })
                        .unwrap_or("out");
                    let v = names.fresh(base);
                    names.of.insert(o, v.clone());
                    outs.push(v);
                }
                format!("{} = ", outs.join(", "))
            }
        };
        let mut line = wrap_statement(&lhs, &rhs);
        if n.loc.line > 0 {
            let file = std::path::Path::new(&n.loc.file)
                .file_name()
                .map(|f| f.to_string_lossy().to_string())
                .unwrap_or_default();
            let _ = write!(line, "  # {file}:{}", n.loc.line);
        }
        s.push_str(&line);
        s.push('\n');
    }
    let outs = g
        .outputs
        .iter()
        .map(|o| names.get(o.value).map(str::to_string))
        .collect::<Result<Vec<_>, _>>()?;
    let tail = if outs.len() == 1 { ",)" } else { ")" };
    s.push_str(&wrap_call("    return (", &outs, tail, "    "));
    s.push('\n');
    Ok(s)
}

/// The op's name without its dialect.
fn short(op: &str) -> &str {
    op.split_once('.').map_or(op, |(_, n)| n)
}

/// Why a collective is there: the layout it changes, and what it does to it.
fn relayout_comment(
    ctx: &RankCtx<'_, '_>,
    n: &Node,
    layouts: Option<&[Option<Sharding>]>,
) -> Option<String> {
    if !n.op.starts_with("nns.") || matches!(n.op.as_str(), "nns.send" | "nns.recv") {
        return None;
    }
    let axes = match n.attrs.get("axes") {
        Some(AttrValue::Strs(v)) => v.join(", "),
        _ => String::new(),
    };
    let dim = |k: &str| match n.attrs.get(k) {
        Some(AttrValue::Int(d)) => *d,
        _ => 0,
    };
    let what = match n.op.as_str() {
        "nns.all_reduce" => {
            format!("the partial values over {axes} summed: every member holds the whole")
        }
        "nns.all_gather" => format!("the pieces of dim {} over {axes} joined", dim("dim")),
        "nns.reduce_scatter" => format!(
            "the partial values over {axes} summed, each member keeping its piece of dim {}",
            dim("dim")
        ),
        "nns.all_to_all" => format!(
            "the split over {axes} moved from dim {} to dim {}",
            dim("concat_dim"),
            dim("split_dim")
        ),
        "nns.slice" => format!(
            "this rank's piece of dim {} over {axes} (no communication)",
            dim("dim")
        ),
        "nns.partition" => format!(
            "a replicated value made a partial sum over {axes} (each member holds 1/n of it)"
        ),
        "nns.broadcast" => format!("the root's value over {axes}"),
        "nns.microbatch" => format!("micro-batch {} of dim {}", dim("index"), dim("dim")),
        // A collective without words of its own here: its summary in the dialect.
        op if Collective::TABLE
            .iter()
            .any(|(name, _)| op.strip_prefix("nns.") == Some(*name)) =>
        {
            n.op.collective()?.summary.to_string()
        }
        _ => return None,
    };
    let show = |v: ValueId| -> Option<String> {
        let l = layouts?.get(v.index())?.as_ref()?;
        Some(super::layout_text(l, &ctx.plan.mesh))
    };
    match (
        n.inputs.first().and_then(|&v| show(v)),
        n.outputs.first().and_then(|&v| show(v)),
    ) {
        (Some(a), Some(b)) => Some(format!("{what} [{a} -> {b}]")),
        _ => Some(what),
    }
}

fn attr_int(n: &Node, k: &str) -> Option<i64> {
    match n.attrs.get(k) {
        Some(AttrValue::Int(v)) => Some(*v),
        _ => None,
    }
}

fn attr_float(n: &Node, k: &str) -> Option<f64> {
    match n.attrs.get(k) {
        Some(AttrValue::Float(v)) => Some(*v),
        Some(AttrValue::Int(v)) => Some(*v as f64),
        _ => None,
    }
}

fn attr_ints(n: &Node, k: &str) -> Vec<i64> {
    match n.attrs.get(k) {
        Some(AttrValue::Ints(v)) => v.clone(),
        _ => Vec::new(),
    }
}

fn attr_str<'n>(n: &'n Node, k: &str) -> Option<&'n str> {
    match n.attrs.get(k) {
        Some(AttrValue::Str(v)) => Some(v),
        _ => None,
    }
}

fn need_int(n: &Node, k: &str) -> Result<i64, String> {
    attr_int(n, k).ok_or_else(|| format!("requires integer attribute '{k}'"))
}

fn need_axes(n: &Node) -> Result<Vec<String>, String> {
    match n.attrs.get("axes") {
        Some(AttrValue::Strs(v)) => Ok(v.clone()),
        _ => Err("requires 'axes'".into()),
    }
}

/// A dim attribute normalized against rank `r`.
fn norm(d: i64, r: usize) -> usize {
    if d < 0 {
        (d + r as i64).max(0) as usize
    } else {
        d as usize
    }
}

/// The right-hand side (or the whole statement, for ops without results) of node `n`.
fn statement(ctx: &RankCtx<'_, '_>, g: &Graph, n: &Node, a: &[String]) -> Result<String, String> {
    let ty = |i: usize| -> &TensorType { &g.values[n.inputs[i]] };
    let out = |i: usize| -> &TensorType { &g.values[n.outputs[i]] };
    let flag = nnscaler_dialects::types::flag(&n.attrs, "causal");
    let opt = |items: &mut Vec<String>, k: &str, v: Option<String>| {
        if let Some(v) = v {
            items.push(format!("{k}={v}"));
        }
    };
    let count = attr_int(n, "count")
        .filter(|&c| c > 0)
        .map(|c| c.to_string());
    let op = n.op.as_str();
    Ok(match op {
        "dnn.add" => format!("{} + {}", a[0], a[1]),
        "dnn.sub" => format!("{} - {}", a[0], a[1]),
        "dnn.mul" => format!("{} * {}", a[0], a[1]),
        "dnn.div" => format!("{} / {}", a[0], a[1]),
        "dnn.neg" => format!("-{}", a[0]),
        "dnn.exp" | "dnn.log" | "dnn.sqrt" | "dnn.rsqrt" | "dnn.sigmoid" | "dnn.tanh"
        | "dnn.relu" => format!("torch.{}({})", short(op), a[0]),
        "dnn.silu" => format!("F.silu({})", a[0]),
        "dnn.gelu" => match attr_str(n, "approximate") {
            Some("tanh") => format!("F.gelu({}, approximate=\"tanh\")", a[0]),
            _ => format!("F.gelu({})", a[0]),
        },
        "dnn.gelu_grad" => match attr_str(n, "approximate") {
            Some("tanh") => format!("ops.gelu_grad({}, {}, \"tanh\")", a[0], a[1]),
            _ => format!("ops.gelu_grad({}, {})", a[0], a[1]),
        },
        "dnn.silu_grad" | "dnn.relu_grad" => format!("ops.{}({}, {})", short(op), a[0], a[1]),
        "dnn.tanh_grad" => format!("{} * (1.0 - {} * {})", a[0], a[1], a[1]),
        "dnn.cast" => match attr_str(n, "to") {
            Some("bf16") => format!("{}.to(torch.bfloat16)", a[0]),
            Some("f32") => format!("{}.to(torch.float32)", a[0]),
            other => {
                return Err(format!(
                    "attribute 'to' must be \"f32\" or \"bf16\", got {other:?}"
                ))
            }
        },
        "dnn.dropout" => dropout_statement(ctx, g, n, a)?,
        "dnn.fill" => {
            let v = attr_float(n, "value").unwrap_or(0.0);
            let e = out(0).elem;
            let value = if e.is_float() {
                pyf(v)
            } else {
                format!("{}", v as i64)
            };
            format!(
                "torch.full({}, {value}, dtype={}, device=comm.device)",
                ints(&out(0).shape),
                torch_dtype(e)
            )
        }
        "dnn.adamw" => {
            let mut items: Vec<String> = a.to_vec();
            for k in ["beta1", "beta2", "eps", "weight_decay"] {
                items.push(format!(
                    "{k}={}",
                    pyf(attr_float(n, k).ok_or(format!("requires '{k}'"))?)
                ));
            }
            format!("ops.adamw({})", items.join(", "))
        }
        "dnn.clip_scale" => format!(
            "ops.clip_scale({}, {})",
            a[0],
            pyf(attr_float(n, "max_norm").unwrap_or(1.0))
        ),
        "dnn.broadcast_to" => format!("torch.broadcast_to({}, {})", a[0], ints(&out(0).shape)),
        "dnn.softmax" | "dnn.log_softmax" => {
            format!(
                "torch.{}({}, {})",
                short(op),
                a[0],
                attr_int(n, "dim").unwrap_or(-1)
            )
        }
        "dnn.softmax_grad" | "dnn.log_softmax_grad" => format!(
            "ops.{}({}, {}, {})",
            short(op),
            a[0],
            a[1],
            attr_int(n, "dim").unwrap_or(-1)
        ),
        "dnn.layer_norm" => {
            let h = ty(1).shape.first().copied().unwrap_or(1);
            format!(
                "F.layer_norm({}, ({h},), {}, {}, eps={})",
                a[0],
                a[1],
                a[2],
                pyf(attr_float(n, "eps").unwrap_or(1e-5))
            )
        }
        "dnn.rms_norm" => format!(
            "ops.rms_norm({}, {}, {})",
            a[0],
            a[1],
            pyf(attr_float(n, "eps").unwrap_or(1e-5))
        ),
        "dnn.layer_norm_grad" | "dnn.rms_norm_grad" => format!(
            "ops.{}({}, {}, {}, {})",
            short(op),
            a[0],
            a[1],
            a[2],
            pyf(attr_float(n, "eps").unwrap_or(1e-5))
        ),
        "dnn.embedding" => match ctx.block(n, "row_axes", ty(1).shape[0])? {
            Some(off) => format!("ops.embedding({}, {}, offset={off})", a[0], a[1]),
            None => format!("F.embedding({}, {})", a[0], a[1]),
        },
        "dnn.embedding_grad" => format!(
            "ops.embedding_grad({}, {}, {})",
            a[0],
            a[1],
            out(0).shape[0]
        ),
        "dnn.rotary" | "dnn.rotary_grad" => {
            let mut items = vec![a[0].clone()];
            items.push(format!(
                "theta={}",
                pyf(attr_float(n, "theta").unwrap_or(10000.0))
            ));
            opt(&mut items, "p0", ctx.block(n, "seq_axes", ty(0).shape[2])?);
            if op == "dnn.rotary_grad" {
                items.push("sign=-1.0".into());
            }
            format!("ops.rotary({})", items.join(", "))
        }
        "dnn.cross_entropy" | "dnn.cross_entropy_grad" => {
            let mut items = a.to_vec();
            opt(&mut items, "count", count);
            format!("ops.{}({})", short(op), items.join(", "))
        }
        "dnn.pick" => {
            let mut items = a.to_vec();
            let v = *ty(0).shape.last().unwrap_or(&1);
            opt(&mut items, "offset", ctx.block(n, "offset_axes", v)?);
            format!("ops.pick({})", items.join(", "))
        }
        "dnn.pick_grad" => format!(
            "ops.pick_grad({}, {}, {})",
            a[0],
            a[1],
            out(0).shape.last().copied().unwrap_or(1)
        ),
        "dnn.softmax_xent_grad" => {
            let mut items = a.to_vec();
            opt(&mut items, "count", count);
            let v = *ty(1).shape.last().unwrap_or(&1);
            opt(&mut items, "offset", ctx.block(n, "offset_axes", v)?);
            format!("ops.softmax_xent_grad({})", items.join(", "))
        }
        "dnn.matmul" => {
            let t = |x: &str, on: bool| {
                if on {
                    format!("{x}.transpose(-1, -2)")
                } else {
                    x.to_string()
                }
            };
            let ta = nnscaler_dialects::types::flag(&n.attrs, "transpose_a");
            let tb = nnscaler_dialects::types::flag(&n.attrs, "transpose_b");
            format!("torch.matmul({}, {})", t(&a[0], ta), t(&a[1], tb))
        }
        "dnn.linear" => format!("F.linear({})", a.join(", ")),
        "dnn.linear_weight_grad" => format!("ops.linear_weight_grad({}, {})", a[0], a[1]),
        "dnn.attention" | "dnn.attention_grad" => {
            let q = if op == "dnn.attention" { 0 } else { 1 };
            let mut items = a.to_vec();
            if flag {
                items.push("causal=True".into());
            }
            opt(&mut items, "scale", attr_float(n, "scale").map(pyf));
            opt(&mut items, "q0", ctx.block(n, "seq_axes", ty(q).shape[2])?);
            format!("ops.{}({})", short(op), items.join(", "))
        }
        "dnn.reshape" | "dnn.transpose" | "dnn.slice" | "dnn.pad" | "dnn.concat" | "dnn.split"
        | "dnn.sum" | "dnn.mean" | "dnn.max" | "dnn.max_grad" => shape_statement(g, n, a)?,
        _ => comm_statement(ctx, g, n, a)?,
    })
}

/// [`statement`] of `dnn.dropout`: the runtime's counter-based mask at this rank's offsets
/// into the whole tensor (a localized dropout's `global_shape` and `dim_axes`).
fn dropout_statement(
    ctx: &RankCtx<'_, '_>,
    g: &Graph,
    n: &Node,
    a: &[String],
) -> Result<String, String> {
    let ty = |i: usize| -> &TensorType { &g.values[n.inputs[i]] };
    let p = attr_float(n, "p").unwrap_or(0.0);
    let seed = attr_int(n, "seed").unwrap_or(0);
    let mut items = vec![a[0].clone(), pyf(p), seed.to_string()];
    if let Some(step) = a.get(1) {
        items.push(format!("step={step}"));
    }
    if let (Some(AttrValue::Ints(global)), Some(AttrValue::Strs(dim_axes))) =
        (n.attrs.get("global_shape"), n.attrs.get("dim_axes"))
    {
        let local = &ty(0).shape;
        let mut offs = Vec::new();
        for (d, names) in dim_axes.iter().enumerate() {
            let axes: Vec<String> = names
                .split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect();
            offs.push(ctx.offset(&axes, local.get(d).copied().unwrap_or(1))?);
        }
        items.push(format!("offsets=[{}]", offs.join(", ")));
        items.push(format!("global_shape={}", ints(global)));
    }
    Ok(format!("ops.dropout({})", items.join(", ")))
}

/// [`statement`] of the shape ops and reductions.
fn shape_statement(g: &Graph, n: &Node, a: &[String]) -> Result<String, String> {
    let ty = |i: usize| -> &TensorType { &g.values[n.inputs[i]] };
    let out = |i: usize| -> &TensorType { &g.values[n.outputs[i]] };
    let count = attr_int(n, "count")
        .filter(|&c| c > 0)
        .map(|c| c.to_string());
    let op = n.op.as_str();
    Ok(match op {
        "dnn.reshape" => format!("{}.reshape({})", a[0], ints(&out(0).shape)),
        "dnn.transpose" => format!("{}.permute({})", a[0], ints(&attr_ints(n, "perm"))),
        "dnn.slice" => {
            let r = ty(0).rank();
            let d = norm(need_int(n, "dim")?, r);
            slice(&a[0], d, need_int(n, "start")?, need_int(n, "end")?)
        }
        "dnn.pad" => format!(
            "ops.pad({}, {}, {}, {})",
            a[0],
            norm(need_int(n, "dim")?, ty(0).rank()),
            attr_int(n, "before").unwrap_or(0),
            attr_int(n, "after").unwrap_or(0)
        ),
        "dnn.concat" => format!("torch.cat([{}], {})", a.join(", "), need_int(n, "dim")?),
        "dnn.split" => format!(
            "torch.split({}, {}, {})",
            a[0],
            ints(&attr_ints(n, "sizes")),
            need_int(n, "dim")?
        ),
        "dnn.sum" | "dnn.mean" | "dnn.max" => {
            let r = ty(0).rank();
            let dims: Vec<i64> = attr_ints(n, "dims")
                .into_iter()
                .map(|d| norm(d, r) as i64)
                .collect();
            let keep = nnscaler_dialects::types::flag(&n.attrs, "keepdim");
            if dims.is_empty() {
                format!("{}.clone()", a[0])
            } else {
                let kd = if keep { ", keepdim=True" } else { "" };
                let ds = dims_tuple(&dims);
                match (op, count) {
                    ("dnn.sum", _) => format!("{}.sum({ds}{kd})", a[0]),
                    ("dnn.mean", Some(c)) => format!("{}.sum({ds}{kd}) / {c}", a[0]),
                    ("dnn.mean", None) => format!("{}.mean({ds}{kd})", a[0]),
                    _ => format!("{}.amax({ds}{kd})", a[0]),
                }
            }
        }
        "dnn.max_grad" => {
            let r = ty(1).rank();
            let dims: Vec<i64> = attr_ints(n, "dims")
                .into_iter()
                .map(|d| norm(d, r) as i64)
                .collect();
            let keep = nnscaler_dialects::types::flag(&n.attrs, "keepdim");
            format!(
                "ops.max_grad({}, {}, {}, keepdim={})",
                a[0],
                a[1],
                ints(&dims),
                if keep { "True" } else { "False" }
            )
        }
        other => return Err(format!("'{other}' is not a shape op or a reduction")),
    })
}

/// Whether the PyTorch runtime (`frontends/torch/nnscaler_torch/runtime.py`, written
/// beside the ranks' files) has the method `Comm.<name>` that runs collective `name`.
fn runtime_has(name: &str) -> bool {
    super::RUNTIME.contains(&format!("    def {name}(self, x, axes"))
}

/// The runtime's call of collective `c` on `x` over the group `key` (its axes):
/// `comm.<name>(x, key, <parameter>=<value>, ...)`, a maximum as `op="max"`; an error when
/// the runtime has no such method.
fn comm_call(c: &Collective, x: &str, key: &str) -> Result<String, String> {
    if !runtime_has(c.name()) {
        return Err(format!(
            "emit-torch has no PyTorch for 'nns.{0}': the runtime (frontends/torch/nnscaler_torch/runtime.py) has no Comm.{0}",
            c.name()
        ));
    }
    let mut s = format!("comm.{}({x}, {key:?}", c.name());
    for (k, p) in c.params() {
        match p {
            Param::Index(v) => s.push_str(&format!(", {k}={v}")),
            Param::Flag(true) => s.push_str(", op=\"max\""),
            Param::Flag(false) => {}
        }
    }
    s.push(')');
    Ok(s)
}

/// [`statement`] of the collectives, pipeline messages and calls; an error for any other op.
fn comm_statement(
    ctx: &RankCtx<'_, '_>,
    g: &Graph,
    n: &Node,
    a: &[String],
) -> Result<String, String> {
    let ty = |i: usize| -> &TensorType { &g.values[n.inputs[i]] };
    let op = n.op.as_str();
    if let Some(c) = collective_of(n) {
        let c = c?;
        if c.communicates() {
            return comm_call(&c, &a[0], &need_axes(n)?.join(","));
        }
    }
    Ok(match op {
        "nns.slice" | "nns.microbatch" => {
            let axes = need_axes(n)?;
            let (me, size) = ctx.member(&axes)?;
            let (index, parts) = if op == "nns.microbatch" {
                let i = need_int(n, "index")? as usize;
                if i >= size {
                    return Err(format!("micro-batch {i} of {size}"));
                }
                (i, size)
            } else if me.k == 0 {
                (me.c as usize, size)
            } else {
                return Err("a cut along the micro-batch axis inside a fragment".into());
            };
            let r = ty(0).rank();
            let d = norm(need_int(n, "dim")?, r);
            let len = ty(0).shape[d];
            if len % parts as i64 != 0 {
                return Err(format!(
                    "dim {d} of length {len} cannot be cut {parts} ways"
                ));
            }
            let piece = len / parts as i64;
            slice(&a[0], d, index as i64 * piece, (index as i64 + 1) * piece)
        }
        "nns.partition" => {
            let (_, size) = ctx.member(&need_axes(n)?)?;
            format!("{} * {}", a[0], pyf(f64::from(1.0f32 / size as f32)))
        }
        "nns.send" => {
            let peer = need_int(n, "peer")? as usize;
            format!(
                "comm.send({}, tag={:?}, dst={})",
                a[0],
                attr_str(n, "tag").ok_or("requires 'tag'")?,
                ctx.plan.peer(ctx.rank, peer)?
            )
        }
        "nns.recv" => {
            let peer = need_int(n, "peer")? as usize;
            format!(
                "comm.recv(tag={:?}, src={})",
                attr_str(n, "tag").ok_or("requires 'tag'")?,
                ctx.plan.peer(ctx.rank, peer)?
            )
        }
        "func.call" => {
            let name = callee(&n.attrs).ok_or("has no callee")?;
            let mut items = vec!["comm".to_string()];
            items.extend(a.iter().cloned());
            if ctx.plan.mesh.microbatch_axis().is_some() {
                // A fragment runs at its micro-batch ("<stage><F|B|W><mb>"); any other call
                // at its caller's.
                let mb = match n.attrs.get("nns.fragment") {
                    Some(AttrValue::Str(f)) => f
                        .rfind(['F', 'B', 'W'])
                        .and_then(|k| f[k + 1..].parse::<usize>().ok())
                        .map(|m| m.to_string()),
                    _ => None,
                };
                items.push(format!(
                    "mb={}",
                    mb.unwrap_or_else(|| if ctx.fragment {
                        "mb".into()
                    } else {
                        "0".into()
                    })
                ));
            }
            let call = format!("{}({})", py_ident(name), items.join(", "));
            if n.outputs.len() == 1 {
                format!("{call}[0]")
            } else {
                call
            }
        }
        other => {
            if let Some(rule) = nnscaler_dialects::dnn::spec(other).and_then(|s| s.traits.scalar) {
                // An elementwise op without a line above: its formula, written in torch.
                return Ok(torch_formula(&rule.expr(&n.attrs)?, a));
            }
            let colls: Vec<&str> = Collective::TABLE.iter().map(|(name, _)| *name).collect();
            return Err(format!(
                "emit-torch has no PyTorch for '{other}' (it writes the dnn ops and nns.{}, partition, microbatch, send and recv)",
                colls.join(", ")
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_identifiers() {
        assert_eq!(py_ident("h.0.attn.c_attn.weight"), "h_0_attn_c_attn_weight");
        assert_eq!(py_ident("0x"), "_0x");
        assert_eq!(py_ident("lambda"), "lambda_");
        assert_eq!(py_ident("comm"), "comm_");
        let mut n = Names::new();
        assert_eq!(n.exact("x"), "x");
        assert_eq!(n.exact("x"), "x_2");
        assert_eq!(n.fresh("linear"), "linear0");
        assert_eq!(n.fresh("linear"), "linear1");
        // A fresh name never takes one an argument holds.
        n.exact("add0");
        assert_eq!(n.fresh("add"), "add1");
    }

    /// Every collective of the runtime's table that communicates has its method in the
    /// PyTorch runtime (a missing one is found here, not when torchrun runs the files).
    #[test]
    fn the_torch_runtime_runs_every_collective() {
        for &(name, _) in Collective::TABLE {
            let c = Collective::every(3, 2)
                .into_iter()
                .find(|c| c.name() == name)
                .expect("every collective has a form on rank 3 in groups of 2");
            assert!(
                !c.communicates() || runtime_has(name),
                "frontends/torch/nnscaler_torch/runtime.py has no Comm.{name}"
            );
        }
        assert!(!runtime_has("gather_all"));
    }

    #[test]
    fn microbatch_offsets_read_as_python() {
        let l = |c, k| Lin { c, k };
        assert_eq!(l(4, 0).text(), "4");
        assert_eq!(l(0, 1).text(), "mb");
        assert_eq!(l(0, 2).text(), "2 * mb");
        assert_eq!(l(4, 1).text(), "4 + mb");
        assert_eq!(l(4, 2).scaled(3).text(), "12 + 6 * mb");
    }

    #[test]
    fn long_calls_wrap_at_their_arguments() {
        let args: Vec<String> = (0..20).map(|i| format!("argument_{i}")).collect();
        let rhs = format!("f(comm, {})", args.join(", "));
        let s = wrap_statement("out = ", &rhs);
        assert!(s.lines().count() > 1, "{s}");
        assert!(s.lines().all(|l| l.len() <= 96), "{s}");
        // The same statement, whatever the line breaks.
        let joined: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(joined, format!("out = {rhs}"));
        assert_eq!(slice("x", 2, 4, 8), "x[:, :, 4:8]");
        assert_eq!(pyf(1e-5), "1e-5");
        assert_eq!(pyf(f64::NEG_INFINITY), "-float(\"inf\")");
    }
}
