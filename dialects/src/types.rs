//! Tensor types and attribute values as plain Rust data, read from and written to MLIR text.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit float.
    F64,
    /// 64-bit signless integer (token ids, targets).
    I64,
    /// 32-bit signless integer.
    I32,
    /// Boolean.
    I1,
}

impl Elem {
    /// Parses `f32`, `i64`, ...
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "f32" => Elem::F32,
            "f16" => Elem::F16,
            "bf16" => Elem::BF16,
            "f64" => Elem::F64,
            "i64" => Elem::I64,
            "i32" => Elem::I32,
            "i1" => Elem::I1,
            _ => return None,
        })
    }

    /// Size in bytes of one element.
    pub fn bytes(self) -> u64 {
        match self {
            Elem::F64 | Elem::I64 => 8,
            Elem::F32 | Elem::I32 => 4,
            Elem::F16 | Elem::BF16 => 2,
            Elem::I1 => 1,
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, Elem::F32 | Elem::F16 | Elem::BF16 | Elem::F64)
    }
}

impl fmt::Display for Elem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Elem::F32 => "f32",
            Elem::F16 => "f16",
            Elem::BF16 => "bf16",
            Elem::F64 => "f64",
            Elem::I64 => "i64",
            Elem::I32 => "i32",
            Elem::I1 => "i1",
        })
    }
}

/// A ranked tensor type with static shape: `tensor<2x3xf32>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Dimension lengths, outermost first.
    pub shape: Vec<i64>,
    /// Element type.
    pub elem: Elem,
}

impl TensorType {
    /// A tensor type.
    pub fn new(shape: &[i64], elem: Elem) -> Self {
        Self {
            shape: shape.to_vec(),
            elem,
        }
    }

    /// Reads an MLIR type through the C API (no printing): `None` for anything but a ranked
    /// tensor of static shape, without encoding, of one of the [`Elem`] types.
    pub fn from_type(t: mlir_sys::MlirType) -> Option<Self> {
        use mlir_sys::*;
        // SAFETY: `t` is a live type (callers read it from live IR); only queries are made.
        unsafe {
            if t.ptr.is_null()
                || !mlirTypeIsARankedTensor(t)
                || !mlirShapedTypeHasStaticShape(t)
                || !mlirRankedTensorTypeGetEncoding(t).ptr.is_null()
            {
                return None;
            }
            let e = mlirShapedTypeGetElementType(t);
            let elem = if mlirTypeIsAF32(e) {
                Elem::F32
            } else if mlirTypeIsAF16(e) {
                Elem::F16
            } else if mlirTypeIsABF16(e) {
                Elem::BF16
            } else if mlirTypeIsAF64(e) {
                Elem::F64
            } else if mlirTypeIsAInteger(e) && mlirIntegerTypeIsSignless(e) {
                match mlirIntegerTypeGetWidth(e) {
                    64 => Elem::I64,
                    32 => Elem::I32,
                    1 => Elem::I1,
                    _ => return None,
                }
            } else {
                return None;
            };
            let shape = (0..mlirShapedTypeGetRank(t))
                .map(|d| mlirShapedTypeGetDimSize(t, d as isize))
                .collect();
            Some(TensorType { shape, elem })
        }
    }

    /// Parses the printed form `tensor<2x3xf32>`; `None` for anything else (dynamic or
    /// unranked tensors, other types).
    pub fn parse(text: &str) -> Option<Self> {
        let body = text.strip_prefix("tensor<")?.strip_suffix('>')?;
        let mut parts: Vec<&str> = body.split('x').collect();
        let elem = Elem::parse(parts.pop()?)?;
        let shape = parts
            .iter()
            .map(|p| p.parse::<i64>().ok())
            .collect::<Option<Vec<_>>>()?;
        Some(Self { shape, elem })
    }

    /// Number of elements (saturating at `u64::MAX`; the verifier rejects types larger than
    /// [`MAX_TENSOR_BYTES`]).
    pub fn numel(&self) -> u64 {
        self.shape
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(d.max(0) as u64))
    }

    /// Size in bytes (saturating).
    pub fn bytes(&self) -> u64 {
        self.numel().saturating_mul(self.elem.bytes())
    }

    /// Checks the size limit: at most [`MAX_TENSOR_BYTES`].
    pub fn check_size(&self) -> Result<(), String> {
        if self.bytes() > MAX_TENSOR_BYTES {
            return Err(format!(
                "{self} is larger than 2^50 bytes (1 PiB), the largest tensor nnscaler handles"
            ));
        }
        Ok(())
    }

    /// Rank.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tensor<")?;
        for d in &self.shape {
            write!(f, "{d}x")?;
        }
        write!(f, "{}>", self.elem)
    }
}

/// The largest tensor type the verifier accepts, in bytes (2^50, 1 PiB): far above any
/// real model's tensors, and small enough that sizes, products with mesh sizes and byte
/// counts never overflow an `i64`.
pub const MAX_TENSOR_BYTES: u64 = 1 << 50;

/// An attribute value as plain data. Read from MLIR's printed attribute text, so that
/// every pass sees typed values and nobody parses attribute strings by hand.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    /// `unit`.
    Unit,
    /// `true` / `false`.
    Bool(bool),
    /// `3 : i64`.
    Int(i64),
    /// `1.0e-05 : f32`.
    Float(f64),
    /// `"text"`.
    Str(String),
    /// `array<i64: 1, 2>` (or an array of integers `[1, 2]`).
    Ints(Vec<i64>),
    /// `["a", "b"]`: an array of strings.
    Strs(Vec<String>),
    /// `#nns.layout<@world, dp = D(0)>`, parsed where it is read ([`AttrValue::nns`]).
    /// Shared: an attribute read again (each pass reads the IR it is given) is parsed once
    /// per thread and its value shared, not copied.
    Layout(Arc<crate::nns_attrs::Layout>),
    /// `[#nns.layout<...>, ...]`: a layout per result (`nns.layouts`), parsed.
    Layouts(Vec<Arc<crate::nns_attrs::Layout>>),
    /// `#nns.split<b = dp, n = tp>` (also the values of `nns.pin` and `nns.forbid`), parsed.
    Split(Arc<crate::nns_attrs::Split>),
    /// `#nns.axes<dp = 2, tp = 4>` (a mesh's axes, `nns.localized`), parsed.
    Axes(Arc<Vec<crate::nns_attrs::Axis>>),
    /// `#nns.kind<body>` of any other kind, or one whose body does not parse (the verifier
    /// says why): as written.
    Nns {
        /// The kind (`layout`, `split`, ...).
        kind: String,
        /// The text between the angle brackets.
        body: String,
    },
    /// Anything else, as printed.
    Other(String),
}

impl AttrValue {
    /// The value of `#nns.kind<body>`: layouts, splits and mesh axes parsed once, here,
    /// where the IR is read; other kinds, and bodies that do not parse (the verifier
    /// reports them with their location), as written.
    pub fn nns(kind: &str, body: &str) -> Self {
        use crate::nns_attrs as nns;
        /// Values already parsed on this thread, by `kind<body>`: the same attributes are
        /// read by every pass (and the verifier after each). Bounded: cleared when full.
        const CACHED: usize = 1 << 14;
        thread_local! {
            static PARSED: std::cell::RefCell<std::collections::HashMap<String, AttrValue>> =
                Default::default();
        }
        let key = format!("{kind}<{body}>");
        if let Some(v) = PARSED.with(|p| p.borrow().get(&key).cloned()) {
            return v;
        }
        let parsed = match kind {
            "layout" => nns::Layout::parse(body)
                .ok()
                .map(|l| AttrValue::Layout(Arc::new(l))),
            "split" => nns::Split::parse(body)
                .ok()
                .map(|s| AttrValue::Split(Arc::new(s))),
            "axes" => nns::parse_axes(body)
                .ok()
                .map(|a| AttrValue::Axes(Arc::new(a))),
            _ => None,
        };
        let v = parsed.unwrap_or_else(|| AttrValue::Nns {
            kind: kind.to_string(),
            body: body.to_string(),
        });
        PARSED.with(|p| {
            let mut p = p.borrow_mut();
            if p.len() >= CACHED {
                p.clear();
            }
            p.insert(key, v.clone());
        });
        v
    }

    /// The kind and body of an `#nns` attribute (`("layout", "@world, dp = D(0)")`),
    /// printed from its parsed value; `None` for other attributes.
    pub fn nns_parts(&self) -> Option<(&str, String)> {
        Some(match self {
            AttrValue::Layout(l) => ("layout", l.to_string()),
            AttrValue::Split(s) => ("split", s.to_string()),
            AttrValue::Axes(axes) => {
                let items: Vec<String> = axes.iter().map(ToString::to_string).collect();
                ("axes", items.join(", "))
            }
            AttrValue::Nns { kind, body } => (kind.as_str(), body.clone()),
            _ => return None,
        })
    }

    /// The layout of a `#nns.layout<...>` value: `Some(Err)` with the reason where its body
    /// does not parse, `None` for a value of another kind.
    pub fn layout(&self) -> Option<Result<Arc<crate::nns_attrs::Layout>, String>> {
        match self {
            AttrValue::Layout(l) => Some(Ok(l.clone())),
            AttrValue::Nns { kind, body } if kind == "layout" => {
                Some(crate::nns_attrs::Layout::parse(body).map(Arc::new))
            }
            _ => None,
        }
    }

    /// The split directive of a `#nns.split<...>` value, as [`AttrValue::layout`].
    pub fn split(&self) -> Option<Result<Arc<crate::nns_attrs::Split>, String>> {
        match self {
            AttrValue::Split(s) => Some(Ok(s.clone())),
            AttrValue::Nns { kind, body } if kind == "split" => {
                Some(crate::nns_attrs::Split::parse(body).map(Arc::new))
            }
            _ => None,
        }
    }

    /// The mesh axes of a `#nns.axes<...>` value, as [`AttrValue::layout`].
    pub fn axes(&self) -> Option<Result<Arc<Vec<crate::nns_attrs::Axis>>, String>> {
        match self {
            AttrValue::Axes(a) => Some(Ok(a.clone())),
            AttrValue::Nns { kind, body } if kind == "axes" => {
                Some(crate::nns_attrs::parse_axes(body).map(Arc::new))
            }
            _ => None,
        }
    }

    /// Reads an MLIR attribute through the C API: the kinds nnscaler uses are read
    /// directly (no printing); anything else is printed into [`AttrValue::Other`]. A bool
    /// array (`array<i1: ...>`) is never printed: MLIR 19 accepts spellings of it that its
    /// printer crashes on.
    pub fn from_attribute(a: mlir_sys::MlirAttribute) -> Self {
        use mlir_sys::*;
        // SAFETY: the strings are owned by the attribute's context, alive during the call.
        let text = |r: MlirStringRef| unsafe { crate::rewriter::string_of(r) };
        // SAFETY: `a` is a live attribute (read from live IR); only queries are made.
        unsafe {
            if mlirAttributeIsAUnit(a) {
                return AttrValue::Unit;
            }
            if mlirAttributeIsABool(a) {
                return AttrValue::Bool(mlirBoolAttrGetValue(a));
            }
            if mlirAttributeIsAInteger(a) {
                let t = mlirAttributeGetType(a);
                if mlirTypeIsAInteger(t) && mlirIntegerTypeIsUnsigned(t) {
                    return AttrValue::Int(mlirIntegerAttrGetValueUInt(a) as i64);
                }
                return AttrValue::Int(mlirIntegerAttrGetValueInt(a));
            }
            if mlirAttributeIsAFloat(a) {
                return AttrValue::Float(mlirFloatAttrGetValueDouble(a));
            }
            if mlirAttributeIsAString(a) {
                return AttrValue::Str(text(mlirStringAttrGetValue(a)));
            }
            if mlirAttributeIsADenseI64Array(a) {
                let n = mlirDenseArrayGetNumElements(a);
                return AttrValue::Ints(
                    (0..n).map(|i| mlirDenseI64ArrayGetElement(a, i)).collect(),
                );
            }
            if mlirAttributeIsADenseBoolArray(a) {
                return AttrValue::Other("array<i1: ...>".into());
            }
            if mlirAttributeIsAArray(a) {
                let items: Vec<MlirAttribute> = (0..mlirArrayAttrGetNumElements(a))
                    .map(|i| mlirArrayAttrGetElement(a, i))
                    .collect();
                if items
                    .iter()
                    .all(|&x| mlirAttributeIsAInteger(x) && !mlirAttributeIsABool(x))
                {
                    return AttrValue::Ints(
                        items
                            .iter()
                            .map(|&x| mlirIntegerAttrGetValueInt(x))
                            .collect(),
                    );
                }
                if items.iter().all(|&x| mlirAttributeIsAString(x)) {
                    return AttrValue::Strs(
                        items
                            .iter()
                            .map(|&x| text(mlirStringAttrGetValue(x)))
                            .collect(),
                    );
                }
                let layouts: Option<Vec<Arc<crate::nns_attrs::Layout>>> = items
                    .iter()
                    .map(|&x| match AttrValue::from_attribute(x) {
                        AttrValue::Layout(l) => Some(l),
                        _ => None,
                    })
                    .collect();
                if let Some(layouts) = layouts {
                    return AttrValue::Layouts(layouts);
                }
            }
            if mlirAttributeIsAOpaque(a) && text(mlirOpaqueAttrGetDialectNamespace(a)) == "nns" {
                let data = text(mlirOpaqueAttrGetData(a));
                if let Some((kind, body)) = data.split_once('<') {
                    if let Some(body) = body.strip_suffix('>') {
                        return AttrValue::nns(kind, body);
                    }
                }
            }
            AttrValue::from_mlir_text(&crate::rewriter::print_with(|cb, ud| {
                mlirAttributePrint(a, cb, ud)
            }))
        }
    }

    /// Interprets MLIR's printed form of an attribute.
    pub fn from_mlir_text(text: &str) -> Self {
        let t = text.trim();
        match t {
            "unit" => return AttrValue::Unit,
            "true" => return AttrValue::Bool(true),
            "false" => return AttrValue::Bool(false),
            _ => {}
        }
        if let Some(s) = t.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
            return AttrValue::Str(unescape(s));
        }
        if let Some(rest) = t.strip_prefix("#nns.") {
            if let Some((kind, body)) = rest.split_once('<') {
                if let Some(body) = body.strip_suffix('>') {
                    return AttrValue::nns(kind, body);
                }
            }
        }
        if let Some(body) = t
            .strip_prefix("array<i64")
            .and_then(|s| s.strip_suffix('>'))
        {
            let body = body.trim_start_matches(':').trim();
            if body.is_empty() {
                return AttrValue::Ints(Vec::new());
            }
            if let Some(v) = parse_int_list(body) {
                return AttrValue::Ints(v);
            }
        }
        if let Some(body) = t.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            if body.trim().is_empty() {
                return AttrValue::Ints(Vec::new());
            }
            if let Some(v) = parse_int_list(body) {
                return AttrValue::Ints(v);
            }
            if let Some(v) = parse_str_list(body) {
                return AttrValue::Strs(v);
            }
            let layouts: Option<Vec<Arc<crate::nns_attrs::Layout>>> = top_level(body)
                .iter()
                .map(|item| match AttrValue::from_mlir_text(item) {
                    AttrValue::Layout(l) => Some(l),
                    _ => None,
                })
                .collect();
            if let Some(layouts) = layouts {
                return AttrValue::Layouts(layouts);
            }
        }
        let (num, ty) = match t.split_once(':') {
            Some((n, ty)) => (n.trim(), ty.trim()),
            None => (t, "i64"),
        };
        if ty.starts_with('i') || ty == "index" {
            if let Ok(n) = num.parse::<i64>() {
                return AttrValue::Int(n);
            }
        }
        if ty.starts_with('f') || ty.starts_with("bf") {
            if let Ok(x) = num.parse::<f64>() {
                return AttrValue::Float(x);
            }
        }
        AttrValue::Other(t.to_string())
    }

    /// MLIR text for this value (parsed back with `Attribute::parse`).
    pub fn to_mlir_text(&self) -> String {
        match self {
            AttrValue::Unit => "unit".into(),
            AttrValue::Bool(b) => b.to_string(),
            AttrValue::Int(n) => format!("{n} : i64"),
            AttrValue::Float(x) => format!("{} : f64", float_text(*x)),
            AttrValue::Str(s) => format!("\"{}\"", escape(s)),
            AttrValue::Ints(v) => {
                let items: Vec<String> = v.iter().map(i64::to_string).collect();
                if items.is_empty() {
                    "array<i64>".into()
                } else {
                    format!("array<i64: {}>", items.join(", "))
                }
            }
            AttrValue::Strs(v) => {
                let items: Vec<String> = v.iter().map(|s| format!("\"{}\"", escape(s))).collect();
                format!("[{}]", items.join(", "))
            }
            AttrValue::Layout(_)
            | AttrValue::Split(_)
            | AttrValue::Axes(_)
            | AttrValue::Nns { .. } => {
                let (kind, body) = self.nns_parts().expect("an nns attribute");
                format!("#nns.{kind}<{body}>")
            }
            AttrValue::Layouts(v) => {
                let items: Vec<String> = v.iter().map(|l| format!("#nns.layout<{l}>")).collect();
                format!("[{}]", items.join(", "))
            }
            AttrValue::Other(t) => t.clone(),
        }
    }

    /// A short name of the value's kind, for error messages.
    pub fn kind_name(&self) -> &'static str {
        match self {
            AttrValue::Unit => "unit",
            AttrValue::Bool(_) => "bool",
            AttrValue::Int(_) => "integer",
            AttrValue::Float(_) => "float",
            AttrValue::Str(_) => "string",
            AttrValue::Ints(_) => "integer array",
            AttrValue::Strs(_) => "string array",
            AttrValue::Layout(_)
            | AttrValue::Split(_)
            | AttrValue::Axes(_)
            | AttrValue::Nns { .. } => "nns attribute",
            AttrValue::Layouts(_) => "array of nns layouts",
            AttrValue::Other(_) => "attribute",
        }
    }
}

/// `body` split at its commas outside brackets (`<>`, `()`, `[]`) and quotes, trimmed.
fn top_level(body: &str) -> Vec<&str> {
    let (mut out, mut start, mut depth, mut quoted) = (Vec::new(), 0, 0i32, false);
    for (i, c) in body.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '<' | '(' | '[' if !quoted => depth += 1,
            '>' | ')' | ']' if !quoted => depth -= 1,
            ',' if depth == 0 && !quoted => {
                out.push(body[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(body[start..].trim());
    out
}

/// Prints a float so that it reads back exactly and always looks like a float.
fn float_text(x: f64) -> String {
    let s = format!("{x:e}");
    // `1e-5` is not MLIR float syntax; MLIR wants a mantissa with a dot: `1.0e-5`.
    match s.split_once('e') {
        Some((m, e)) if !m.contains('.') => format!("{m}.0e{e}"),
        _ => s,
    }
}

fn parse_int_list(body: &str) -> Option<Vec<i64>> {
    body.split(',')
        .map(|p| {
            let p = p.trim();
            let p = p.split_once(':').map(|(n, _)| n.trim()).unwrap_or(p);
            p.parse::<i64>().ok()
        })
        .collect()
}

fn parse_str_list(body: &str) -> Option<Vec<String>> {
    body.split(',')
        .map(|p| {
            let p = p.trim();
            p.strip_prefix('"')
                .and_then(|p| p.strip_suffix('"'))
                .filter(|p| !p.contains('"'))
                .map(str::to_string)
        })
        .collect()
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn unescape(s: &str) -> String {
    s.replace("\\\"", "\"").replace("\\\\", "\\")
}

/// Named attributes of one op.
pub type Attrs = BTreeMap<String, AttrValue>;

/// Whether boolean attribute `name` is set: `true`, or present as a unit attribute.
pub fn flag(attrs: &Attrs, name: &str) -> bool {
    matches!(
        attrs.get(name),
        Some(AttrValue::Bool(true) | AttrValue::Unit)
    )
}

/// How a parameter is initialized (`nns.init` on a parameter argument).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Every element equals the value (`"zeros"`, `"ones"`, `"const(v)"`).
    Const(f64),
    /// Normal distribution (`"normal(mean, std)"`).
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// Uniform distribution on [lo, hi) (`"uniform(lo, hi)"`).
    Uniform {
        /// Lower bound.
        lo: f64,
        /// Upper bound.
        hi: f64,
    },
}

impl fmt::Display for Init {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Init::Const(v) if *v == 0.0 => f.write_str("zeros"),
            Init::Const(v) if *v == 1.0 => f.write_str("ones"),
            Init::Const(v) => write!(f, "const({v})"),
            Init::Normal { mean, std } => write!(f, "normal({mean}, {std})"),
            Init::Uniform { lo, hi } => write!(f, "uniform({lo}, {hi})"),
        }
    }
}

impl Init {
    /// Parses `zeros`, `ones`, `const(v)`, `normal(mean, std)` or `uniform(lo, hi)`.
    pub fn parse(text: &str) -> Result<Init, String> {
        let t = text.trim();
        match t {
            "zeros" => return Ok(Init::Const(0.0)),
            "ones" => return Ok(Init::Const(1.0)),
            _ => {}
        }
        let bad = || {
            format!(
                "bad init \"{text}\": expected zeros, ones, const(v), normal(mean, std) or uniform(lo, hi)"
            )
        };
        let (head, rest) = t.split_once('(').ok_or_else(bad)?;
        let args: Vec<f64> = rest
            .strip_suffix(')')
            .ok_or_else(bad)?
            .split(',')
            .map(|x| x.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|_| bad())?;
        match (head.trim(), args.as_slice()) {
            ("const", [v]) => Ok(Init::Const(*v)),
            ("normal", [mean, std]) if *std >= 0.0 => Ok(Init::Normal {
                mean: *mean,
                std: *std,
            }),
            ("uniform", [lo, hi]) if lo <= hi => Ok(Init::Uniform { lo: *lo, hi: *hi }),
            _ => Err(bad()),
        }
    }
}

/// Defines an index into one of a [`Graph`](crate::graph::Graph)'s tables as a type of its
/// own: a number becomes one only through `new`, it indexes `Vec`s and slices (tables by
/// it), and it prints as its index (Display and Debug alike, so messages and dumps read
/// as numbers).
macro_rules! graph_index {
    ($(#[$doc:meta])* $name:ident, $table:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(usize);

        impl $name {
            #[doc = concat!("The one with index `i` in `Graph::", $table, "`.")]
            pub const fn new(i: usize) -> Self {
                $name(i)
            }

            #[doc = concat!("Its index in `Graph::", $table, "` (and in any table by it).")]
            pub const fn index(self) -> usize {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl<T> std::ops::Index<$name> for Vec<T> {
            type Output = T;
            fn index(&self, i: $name) -> &T {
                &self[i.0]
            }
        }

        impl<T> std::ops::IndexMut<$name> for Vec<T> {
            fn index_mut(&mut self, i: $name) -> &mut T {
                &mut self[i.0]
            }
        }

        impl<T> std::ops::Index<$name> for [T] {
            type Output = T;
            fn index(&self, i: $name) -> &T {
                &self[i.0]
            }
        }

        impl<T> std::ops::IndexMut<$name> for [T] {
            fn index_mut(&mut self, i: $name) -> &mut T {
                &mut self[i.0]
            }
        }
    };
}

graph_index!(
    /// A value of a [`Graph`](crate::graph::Graph): its index in
    /// [`Graph::values`](crate::graph::Graph::values). A value cannot be taken for a
    /// node's index (or any other number): tables by value are `Vec`s indexed by it
    /// (`types[v]`, for `types: Vec<T>`).
    ValueId,
    "values"
);

impl ValueId {
    /// The values `0..n`, in order.
    pub fn all(n: usize) -> impl DoubleEndedIterator<Item = ValueId> + ExactSizeIterator {
        (0..n).map(ValueId)
    }
}

graph_index!(
    /// A node (an op) of a [`Graph`](crate::graph::Graph): its index in
    /// [`Graph::nodes`](crate::graph::Graph::nodes). A table by node is a `Vec` indexed by
    /// it (`stage[k]`); a value's producer is a node, not a number.
    NodeId,
    "nodes"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_types_round_trip() {
        let t = TensorType::parse("tensor<2x3xf32>").unwrap();
        assert_eq!(t.shape, vec![2, 3]);
        assert_eq!(t.to_string(), "tensor<2x3xf32>");
        assert_eq!(TensorType::parse("tensor<f32>").unwrap().rank(), 0);
        assert!(TensorType::parse("tensor<?x3xf32>").is_none());
        assert_eq!(TensorType::parse("tensor<4xi64>").unwrap().bytes(), 32);
    }

    #[test]
    fn attribute_text() {
        use AttrValue::*;
        assert_eq!(AttrValue::from_mlir_text("3 : i64"), Int(3));
        assert_eq!(AttrValue::from_mlir_text("-3"), Int(-3));
        assert_eq!(AttrValue::from_mlir_text("1.000000e-05 : f32"), Float(1e-5));
        assert_eq!(
            AttrValue::from_mlir_text("array<i64: 1, 2>"),
            Ints(vec![1, 2])
        );
        assert_eq!(AttrValue::from_mlir_text("array<i64>"), Ints(vec![]));
        assert_eq!(AttrValue::from_mlir_text("[1 : i64, 2]"), Ints(vec![1, 2]));
        assert_eq!(AttrValue::from_mlir_text("\"a\\\"b\""), Str("a\"b".into()));
        assert_eq!(
            AttrValue::from_mlir_text("#nns.split<b = dp>"),
            Split(Arc::new(crate::nns_attrs::Split::parse("b = dp").unwrap()))
        );
        // A body that does not parse stays as written, for the verifier to report.
        assert_eq!(
            AttrValue::from_mlir_text("#nns.layout<dp = D(0)>"),
            Nns {
                kind: "layout".into(),
                body: "dp = D(0)".into()
            }
        );
        for text in [
            "#nns.layout<@world, dp = D(0), tp = V(sum)>",
            "#nns.split<@m, b = dp, n = (tp, sp), R(pp)>",
            "#nns.axes<dp = 2, mb = 4 (microbatches)>",
            "#nns.other<x>",
            "[#nns.layout<@world, dp = D(0)>, #nns.layout<@world>]",
        ] {
            assert_eq!(AttrValue::from_mlir_text(text).to_mlir_text(), text);
        }
        assert_eq!(
            AttrValue::from_mlir_text(r#"["dp", "tp"]"#),
            Strs(vec!["dp".into(), "tp".into()])
        );
        assert_eq!(Float(1e-5).to_mlir_text(), "1.0e-5 : f64");
        assert_eq!(Float(0.5).to_mlir_text(), "5.0e-1 : f64");
    }

    #[test]
    fn parses_init_rules() {
        assert_eq!(Init::parse("zeros"), Ok(Init::Const(0.0)));
        assert_eq!(
            Init::parse("normal(0, 0.02)"),
            Ok(Init::Normal {
                mean: 0.0,
                std: 0.02
            })
        );
        assert_eq!(
            Init::parse("uniform(-1,1)"),
            Ok(Init::Uniform { lo: -1.0, hi: 1.0 })
        );
        assert!(Init::parse("normal(0)").unwrap_err().contains("bad init"));
        assert!(Init::parse("uniform(1, 0)").is_err());
    }
}
