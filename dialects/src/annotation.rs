//! nnScaler's dimension-annotation language.
//!
//! An annotation describes how an op's operands and results relate dimension by dimension:
//! `m k+, k+ n -> m n` says that `m` and `n` are spatial (splitting them splits every tensor
//! that has them) and that `k` is summed (splitting it leaves every output that lacks it as a
//! partial sum). The grammar, per tensor (tensors separated by `,`, inputs and outputs by
//! `->`):
//!
//! * an identifier (`[A-Za-z_][A-Za-z0-9_]*`) optionally followed by `+` (summed) or `^`
//!   (frozen: never split); the same identifier always has the same length;
//! * a number: a dimension of exactly that length, never split;
//! * `n=8` in a result: a **new** dimension of length 8, named by an identifier that appears
//!   in no operand (a broadcast into new leading dims: `a b -> n=8 a b`). Splitting it splits
//!   the results that have it and leaves every operand whole (replicated); it may be frozen
//!   (`n=8^`), never summed, and stands alone (not inside a compound);
//! * `(a b c)`: a compound dimension whose length is the product of its parts; only the first
//!   part whose length is not 1 may be split;
//! * `*` as the first entry: any number of leading dimensions, the same in every tensor
//!   that has it (each of them spatial);
//! * `?` as the whole entry: a non-tensor operand, always replicated;
//! * an empty result entry: a rank-0 tensor (a scalar), as in `n+ v^, n+ -> `.
//!
//! An empty operand list means the op has no operands; the result list always has at least
//! one entry.
//!
//! [`Annotation::parse`] checks the text, [`Annotation::bind`] binds it to operand shapes
//! (checking consistent lengths and inferring compound factors), [`Binding::output_shapes`]
//! infers result shapes, and [`Annotation::split_choices`] lists the legal ways to split.

use std::collections::BTreeMap;
use std::fmt;

/// How splitting an identifier affects the tensors that carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DimKind {
    /// Splitting splits every tensor that has the identifier.
    Spatial,
    /// Splitting leaves outputs that lack the identifier as partial sums (`+`).
    Summed,
    /// Never split (`^`).
    Frozen,
}

impl DimKind {
    fn suffix(self) -> &'static str {
        match self {
            DimKind::Spatial => "",
            DimKind::Summed => "+",
            DimKind::Frozen => "^",
        }
    }
}

/// One part of a dimension: an identifier or a fixed length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Atom {
    /// A named dimension.
    Id(String),
    /// A dimension of a fixed length.
    Num(i64),
}

/// One dimension of a tensor: a single atom or a compound `(a b ...)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    /// A plain dimension.
    Atom(Atom),
    /// A dimension made of sub-dimensions, outermost first.
    Compound(Vec<Atom>),
}

/// The annotation of one operand or result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorAnno {
    /// A tensor: optional leading `*`, then its dimensions.
    Tensor {
        /// Whether the tensor starts with `*`.
        star: bool,
        /// The named dimensions after the `*`.
        dims: Vec<Dim>,
    },
    /// `?`: a non-tensor operand.
    NonTensor,
}

/// A parsed and checked annotation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Annotation {
    /// One entry per operand.
    pub inputs: Vec<TensorAnno>,
    /// One entry per result.
    pub outputs: Vec<TensorAnno>,
    /// The kind of every identifier (markers are a property of the identifier).
    pub kinds: BTreeMap<String, DimKind>,
    /// The lengths written on new dimensions (`n=8`: identifiers of results only).
    pub sizes: BTreeMap<String, i64>,
}

/// An error in an annotation or in binding it to shapes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct AnnotationError(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, AnnotationError> {
    Err(AnnotationError(msg.into()))
}

/// Where a dimension sits: which tensor (input or output, index) and which dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DimPos {
    /// True for a result, false for an operand.
    pub output: bool,
    /// Operand or result index.
    pub tensor: usize,
    /// Dimension index in that tensor (counting the `*` dims).
    pub dim: usize,
}

impl fmt::Display for DimPos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = if self.output { "result" } else { "operand" };
        write!(f, "{what} {} dim {}", self.tensor, self.dim)
    }
}

/// A legal way to split an op: split identifier `id`, which sits at `positions`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitChoice {
    /// The identifier (`*0`, `*1`, ... for the dims under `*`).
    pub id: String,
    /// Spatial split, or partial-sum split (for a summed identifier).
    pub kind: DimKind,
    /// Every operand/result dimension that is split along with it.
    pub positions: Vec<DimPos>,
}

/// An atom, its marker, and the length written on it (`n=8`).
type Parsed = (Atom, Option<DimKind>, Option<i64>);

fn parse_atom(tok: &str) -> Result<Parsed, AnnotationError> {
    let (atom, kind) = match tok.split_once('=') {
        None => parse_plain(tok)?,
        Some((name, len)) => {
            let (len, kind) = match len.strip_suffix('^') {
                Some(l) => (l, Some(DimKind::Frozen)),
                None if len.ends_with('+') => {
                    return err(format!(
                        "'{tok}': a new dimension cannot be summed (it is in no operand)"
                    ))
                }
                None => (len, None),
            };
            let (atom, marked) = parse_plain(name)?;
            let n = match (&atom, marked, len.parse::<i64>()) {
                (Atom::Id(_), None, Ok(n)) if n > 0 => n,
                _ => {
                    return err(format!(
                        "'{tok}' is not a new dimension: write an identifier, '=', and a positive length (n=8)"
                    ))
                }
            };
            return Ok((atom, kind, Some(n)));
        }
    };
    Ok((atom, kind, None))
}

fn parse_plain(tok: &str) -> Result<(Atom, Option<DimKind>), AnnotationError> {
    if tok.chars().all(|c| c.is_ascii_digit()) {
        return tok
            .parse::<i64>()
            .map(|n| (Atom::Num(n), None))
            .or_else(|_| err(format!("number '{tok}' is too large")));
    }
    let (name, kind) = if let Some(n) = tok.strip_suffix('+') {
        (n, Some(DimKind::Summed))
    } else if let Some(n) = tok.strip_suffix('^') {
        (n, Some(DimKind::Frozen))
    } else {
        (tok, None)
    };
    let mut chars = name.chars();
    let ok = matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !ok {
        return err(format!("'{tok}' is not a dimension identifier or number"));
    }
    Ok((Atom::Id(name.to_string()), kind))
}

/// Splits `text` into tokens: `(`, `)`, `*`, `?` and words.
fn tokenize(text: &str) -> Vec<String> {
    let mut toks = Vec::new();
    let mut cur = String::new();
    for c in text.chars() {
        if c.is_whitespace() || matches!(c, '(' | ')' | '*' | '?') {
            if !cur.is_empty() {
                toks.push(std::mem::take(&mut cur));
            }
            if !c.is_whitespace() {
                toks.push(c.to_string());
            }
        } else {
            cur.push(c);
        }
    }
    if !cur.is_empty() {
        toks.push(cur);
    }
    toks
}

type Marks = Vec<(String, DimKind, String)>;
/// New dimensions as written: identifier, length, where.
type Sizes = Vec<(String, i64, String)>;

fn parse_tensor(
    text: &str,
    where_: &str,
    marks: &mut Marks,
    sizes: &mut Sizes,
) -> Result<TensorAnno, AnnotationError> {
    let toks = tokenize(text);
    if toks.len() == 1 && toks[0] == "?" {
        return Ok(TensorAnno::NonTensor);
    }
    let mut star = false;
    let mut dims = Vec::new();
    let mut i = 0;
    let mut note = |atom: &Atom, kind: Option<DimKind>| {
        if let (Atom::Id(name), Some(k)) = (atom, kind) {
            marks.push((name.clone(), k, where_.to_string()));
        }
    };
    while i < toks.len() {
        match toks[i].as_str() {
            "*" => {
                if i != 0 {
                    return err(format!("'*' must be the first dimension ({where_})"));
                }
                star = true;
            }
            "?" => {
                return err(format!(
                    "'?' must stand alone as a whole operand ({where_})"
                ))
            }
            ")" => return err(format!("unbalanced ')' ({where_})")),
            "(" => {
                let mut parts = Vec::new();
                i += 1;
                while i < toks.len() && toks[i] != ")" {
                    if matches!(toks[i].as_str(), "(" | "*" | "?") {
                        return err(format!(
                            "'{}' is not allowed inside a compound dimension ({where_})",
                            toks[i]
                        ));
                    }
                    let (atom, kind, size) = parse_atom(&toks[i])?;
                    if size.is_some() {
                        return err(format!(
                            "new dimension '{}' cannot be part of a compound dimension ({where_})",
                            toks[i]
                        ));
                    }
                    note(&atom, kind);
                    parts.push(atom);
                    i += 1;
                }
                if i == toks.len() {
                    return err(format!("unbalanced '(' ({where_})"));
                }
                if parts.is_empty() {
                    return err(format!("empty compound dimension '()' ({where_})"));
                }
                dims.push(Dim::Compound(parts));
            }
            tok => {
                let (atom, kind, size) = parse_atom(tok)?;
                note(&atom, kind);
                if let (Atom::Id(name), Some(n)) = (&atom, size) {
                    sizes.push((name.clone(), n, where_.to_string()));
                }
                dims.push(Dim::Atom(atom));
            }
        }
        i += 1;
    }
    Ok(TensorAnno::Tensor { star, dims })
}

fn ids_of(t: &TensorAnno) -> Vec<&str> {
    let mut out = Vec::new();
    if let TensorAnno::Tensor { dims, .. } = t {
        for d in dims {
            let atoms: &[Atom] = match d {
                Dim::Atom(a) => std::slice::from_ref(a),
                Dim::Compound(v) => v,
            };
            for a in atoms {
                if let Atom::Id(n) = a {
                    out.push(n.as_str());
                }
            }
        }
    }
    out
}

fn has_star(t: &TensorAnno) -> bool {
    matches!(t, TensorAnno::Tensor { star: true, .. })
}

impl Annotation {
    /// Parses and checks an annotation such as `m k+, k+ n -> m n`.
    /// [`Annotation::parse`] through a per-thread cache keyed by the text: op specs build
    /// the same few annotations for thousands of ops, and parsing them was a tenth of a
    /// pipeline's time.
    pub fn parse_cached(text: &str) -> Result<Self, AnnotationError> {
        thread_local! {
            static CACHE: std::cell::RefCell<std::collections::HashMap<String, Annotation>> =
                std::cell::RefCell::default();
        }
        if let Some(a) = CACHE.with(|c| c.borrow().get(text).cloned()) {
            return Ok(a);
        }
        let a = Self::parse(text)?;
        CACHE.with(|c| {
            let mut c = c.borrow_mut();
            if c.len() >= 4096 {
                c.clear(); // bounded: shapes of unusual models may make many distinct texts
            }
            c.insert(text.to_string(), a.clone());
        });
        Ok(a)
    }

    pub fn parse(text: &str) -> Result<Self, AnnotationError> {
        let Some((lhs, rhs)) = text.split_once("->") else {
            return err(format!("annotation '{text}' has no '->'"));
        };
        if rhs.contains("->") {
            return err(format!("annotation '{text}' has more than one '->'"));
        }
        let mut marks = Vec::new();
        let mut written = Sizes::new();
        let split = |s: &str| -> Vec<String> {
            if s.trim().is_empty() {
                Vec::new()
            } else {
                s.split(',').map(|p| p.trim().to_string()).collect()
            }
        };
        let mut inputs = Vec::new();
        for (i, t) in split(lhs).iter().enumerate() {
            inputs.push(parse_tensor(
                t,
                &format!("operand {i}"),
                &mut marks,
                &mut written,
            )?);
        }
        if let Some((name, n, where_)) = written.first() {
            return err(format!(
                "'{name}={n}' in {where_}: only a result can have a new dimension; an operand's lengths come from its shape"
            ));
        }
        let mut outputs = Vec::new();
        // Every result entry is a tensor; an empty one is a rank-0 tensor (a scalar).
        for (i, t) in rhs.split(',').map(str::trim).enumerate() {
            let anno = parse_tensor(t, &format!("result {i}"), &mut marks, &mut written)?;
            if anno == TensorAnno::NonTensor {
                return err(format!("result {i} cannot be '?'"));
            }
            outputs.push(anno);
        }
        // Markers belong to the identifier: they must agree wherever they are written.
        let mut kinds: BTreeMap<String, DimKind> = BTreeMap::new();
        let mut first_mark: BTreeMap<String, String> = BTreeMap::new();
        for (name, kind, where_) in &marks {
            match kinds.get(name) {
                Some(k) if k != kind => {
                    return err(format!(
                        "identifier '{name}' is marked '{}' in {} but '{}' in {where_}",
                        k.suffix(),
                        first_mark[name],
                        kind.suffix()
                    ));
                }
                Some(_) => {}
                None => {
                    kinds.insert(name.clone(), *kind);
                    first_mark.insert(name.clone(), where_.clone());
                }
            }
        }
        let input_ids: Vec<&str> = inputs.iter().flat_map(ids_of).collect();
        let output_ids: Vec<&str> = outputs.iter().flat_map(ids_of).collect();
        let mut sizes: BTreeMap<String, i64> = BTreeMap::new();
        for (name, n, where_) in &written {
            if input_ids.contains(&name.as_str()) {
                return err(format!(
                    "'{name}={n}' in {where_}: '{name}' appears in an operand, so it is not a new dimension (write '{name}' alone)"
                ));
            }
            match sizes.insert(name.clone(), *n) {
                Some(m) if m != *n => {
                    return err(format!(
                    "new dimension '{name}' is written {m} and {n}; one identifier has one length"
                ))
                }
                _ => {}
            }
        }
        for (i, t) in outputs.iter().enumerate() {
            for id in ids_of(t) {
                if !input_ids.contains(&id) && !sizes.contains_key(id) {
                    return err(format!(
                        "identifier '{id}' of result {i} does not appear in any operand (a new dimension is written with its length: {id}=8)"
                    ));
                }
            }
            if has_star(t) && !inputs.iter().any(has_star) {
                return err(format!("result {i} uses '*' but no operand does"));
            }
        }
        for id in &input_ids {
            kinds.entry(id.to_string()).or_insert(DimKind::Spatial);
            if !output_ids.contains(id) && kinds[*id] == DimKind::Spatial {
                return err(format!(
                    "identifier '{id}' is reduced (it appears in no result) but is not marked '+' or '^'"
                ));
            }
        }
        for (name, kind) in &kinds {
            if *kind == DimKind::Summed
                && outputs.iter().all(|o| ids_of(o).contains(&name.as_str()))
            {
                return err(format!(
                    "identifier '{name}' is marked '+' but every result has it; nothing is summed"
                ));
            }
        }
        for id in &output_ids {
            kinds.entry(id.to_string()).or_insert(DimKind::Spatial);
        }
        if let Some(name) = sizes.keys().find(|n| kinds[*n] == DimKind::Summed) {
            return err(format!(
                "new dimension '{name}' is marked '+', but it is in no operand: nothing is summed"
            ));
        }
        Ok(Annotation {
            inputs,
            outputs,
            kinds,
            sizes,
        })
    }

    /// The annotation of this op's vector-Jacobian product: operands, then the results'
    /// gradients (shaped like the results) -> one gradient per operand (shaped like it).
    /// A frozen identifier stays frozen; any other is summed where some operand gradient
    /// lacks it (splitting it leaves that gradient a partial sum: `m k+, k+ n -> m n` gives
    /// `m+ k, k n+, m+ n+ -> m k, k n`) and spatial otherwise. This holds whenever the
    /// op's own annotation does. A `*` that some operand lacks cannot be expressed, and
    /// neither can a `?` operand (it has no gradient): both are errors.
    pub fn vjp(&self) -> Result<Annotation, AnnotationError> {
        if self.inputs.contains(&TensorAnno::NonTensor) {
            return err("an operand is not a tensor ('?'), so it has no gradient");
        }
        let stars = self.inputs.iter().filter(|t| has_star(t)).count();
        if stars != 0 && stars != self.inputs.len() {
            return err("'*' is on some operands only: their gradients' partial sums over '*' cannot be written");
        }
        let outputs = self.inputs.clone();
        let mut kinds = BTreeMap::new();
        for (id, k) in &self.kinds {
            let kind = match k {
                DimKind::Frozen => DimKind::Frozen,
                _ if outputs.iter().all(|t| ids_of(t).contains(&id.as_str())) => DimKind::Spatial,
                _ => DimKind::Summed,
            };
            kinds.insert(id.clone(), kind);
        }
        let mut inputs = self.inputs.clone();
        inputs.extend(self.outputs.iter().cloned());
        // A new dimension of a result is an operand dim of the VJP (its gradient's), where
        // its length comes from the shape.
        let vjp = Annotation {
            inputs,
            outputs,
            kinds,
            sizes: BTreeMap::new(),
        };
        // The checks of the language apply to it as to any annotation.
        Annotation::parse(&vjp.to_string())
    }

    /// The kind of identifier `id` (`*N` ids are spatial).
    pub fn kind(&self, id: &str) -> DimKind {
        self.kinds.get(id).copied().unwrap_or(DimKind::Spatial)
    }

    fn atom_text(&self, a: &Atom, marked: bool) -> String {
        match a {
            Atom::Num(n) => n.to_string(),
            Atom::Id(n) if marked => format!("{n}{}", self.kind(n).suffix()),
            Atom::Id(n) => match self.sizes.get(n) {
                Some(l) => format!("{n}={l}{}", self.kind(n).suffix()),
                None => n.clone(),
            },
        }
    }

    fn tensor_text(&self, t: &TensorAnno, marked: bool) -> String {
        match t {
            TensorAnno::NonTensor => "?".into(),
            TensorAnno::Tensor { star, dims } => {
                let mut parts = Vec::new();
                if *star {
                    parts.push("*".to_string());
                }
                for d in dims {
                    parts.push(match d {
                        Dim::Atom(a) => self.atom_text(a, marked),
                        Dim::Compound(v) => {
                            let inner: Vec<String> =
                                v.iter().map(|a| self.atom_text(a, marked)).collect();
                            format!("({})", inner.join(" "))
                        }
                    });
                }
                parts.join(" ")
            }
        }
    }

    /// Binds the annotation to operand shapes (`None` for a `?` operand).
    pub fn bind(&self, shapes: &[Option<&[i64]>]) -> Result<Binding, AnnotationError> {
        if shapes.len() != self.inputs.len() {
            return err(format!(
                "annotation has {} operands but the op has {}",
                self.inputs.len(),
                shapes.len()
            ));
        }
        // New dimensions have the lengths written on them.
        let mut lens: BTreeMap<String, (i64, DimPos)> = BTreeMap::new();
        for (name, &n) in &self.sizes {
            let pos = self
                .outputs
                .iter()
                .enumerate()
                .find_map(|(tensor, t)| {
                    let TensorAnno::Tensor { dims, .. } = t else {
                        return None;
                    };
                    let dim = dims
                        .iter()
                        .position(|d| *d == Dim::Atom(Atom::Id(name.clone())))?;
                    Some(DimPos {
                        output: true,
                        tensor,
                        dim,
                    })
                })
                .expect("a new dimension is in a result");
            lens.insert(name.clone(), (n, pos));
        }
        let mut star: Option<(Vec<i64>, usize)> = None;
        // Deferred compounds: (known product target, atoms, position).
        let mut pending: Vec<(i64, Vec<Atom>, DimPos)> = Vec::new();
        for (i, (anno, shape)) in self.inputs.iter().zip(shapes).enumerate() {
            let (has_star, dims) = match (anno, shape) {
                (TensorAnno::NonTensor, _) => continue,
                (TensorAnno::Tensor { .. }, None) => {
                    return err(format!(
                        "operand {i} is annotated as a tensor but is not one"
                    ))
                }
                (TensorAnno::Tensor { star, dims }, Some(_)) => (*star, dims),
            };
            let shape = shape.unwrap_or(&[]);
            let lead = if has_star {
                if shape.len() < dims.len() {
                    return err(format!(
                        "operand {i} has rank {} but its annotation '{}' needs at least {}",
                        shape.len(),
                        self.tensor_text(anno, true),
                        dims.len()
                    ));
                }
                let lead = shape.len() - dims.len();
                match &star {
                    Some((s, j)) if s.as_slice() != &shape[..lead] => {
                        return err(format!(
                            "'*' is {:?} in operand {j} but {:?} in operand {i}",
                            s,
                            &shape[..lead]
                        ));
                    }
                    Some(_) => {}
                    None => star = Some((shape[..lead].to_vec(), i)),
                }
                lead
            } else {
                if shape.len() != dims.len() {
                    return err(format!(
                        "operand {i} has rank {} but its annotation '{}' has {} dimensions",
                        shape.len(),
                        self.tensor_text(anno, true),
                        dims.len()
                    ));
                }
                0
            };
            for (k, d) in dims.iter().enumerate() {
                let pos = DimPos {
                    output: false,
                    tensor: i,
                    dim: lead + k,
                };
                let len = shape[lead + k];
                match d {
                    Dim::Atom(a) => bind_atom(&mut lens, a, len, pos)?,
                    Dim::Compound(atoms) => pending.push((len, atoms.clone(), pos)),
                }
            }
        }
        // Resolve compounds: each pass infers the one unknown factor of some compound.
        while !pending.is_empty() {
            let mut progressed = false;
            let mut rest = Vec::new();
            for (len, atoms, pos) in pending {
                let mut known = 1i64;
                let mut unknown = Vec::new();
                for a in &atoms {
                    match a {
                        Atom::Num(n) => known *= n,
                        Atom::Id(id) => match lens.get(id) {
                            Some((l, _)) => known *= l,
                            None => {
                                if !unknown.contains(id) {
                                    unknown.push(id.clone())
                                }
                            }
                        },
                    }
                }
                let text = compound_text(&atoms);
                match unknown.len() {
                    0 => {
                        if known != len {
                            return err(format!(
                                "compound dimension {text} at {pos} has length {len} but its parts multiply to {known}"
                            ));
                        }
                        progressed = true;
                    }
                    1 => {
                        if known == 0 || len % known != 0 {
                            return err(format!(
                                "compound dimension {text} at {pos} has length {len}, which the known parts ({known}) do not divide"
                            ));
                        }
                        lens.insert(unknown[0].clone(), (len / known, pos));
                        progressed = true;
                    }
                    _ => rest.push((len, atoms, pos)),
                }
            }
            if !progressed {
                let (_, atoms, pos) = &rest[0];
                return err(format!(
                    "cannot infer the parts of compound dimension {} at {pos}: more than one unknown length",
                    compound_text(atoms)
                ));
            }
            pending = rest;
        }
        Ok(Binding {
            lens: lens.into_iter().map(|(k, (l, _))| (k, l)).collect(),
            star: star.map(|(s, _)| s).unwrap_or_default(),
            outputs: self.outputs.clone(),
        })
    }

    /// Where identifier `id` sits, for messages: ` (result 0 dim 2)` — a result dim when it
    /// has one (the value users know), else its first operand dim; empty when it is not
    /// splittable.
    pub fn where_is(&self, binding: &Binding, id: &str) -> String {
        self.split_choices(binding)
            .iter()
            .find(|c| c.id == id)
            .and_then(|c| {
                c.positions
                    .iter()
                    .find(|p| p.output)
                    .or(c.positions.first())
            })
            .map(|p| format!(" ({p})"))
            .unwrap_or_default()
    }

    /// Every legal split of the op: one entry per splittable identifier, listing all
    /// operand and result dimensions it splits. Frozen identifiers, numbers and non-first
    /// parts of compounds are never splittable. `binding` tells which compound parts have
    /// length 1 (and so are skipped when finding the first splittable part).
    pub fn split_choices(&self, binding: &Binding) -> Vec<SplitChoice> {
        let mut choices: Vec<SplitChoice> = Vec::new();
        let mut blocked: Vec<String> = Vec::new();
        let tensors = self
            .inputs
            .iter()
            .enumerate()
            .map(|(i, t)| (false, i, t))
            .chain(self.outputs.iter().enumerate().map(|(i, t)| (true, i, t)));
        for (output, i, t) in tensors {
            let TensorAnno::Tensor { star, dims } = t else {
                continue;
            };
            let lead = if *star { binding.star.len() } else { 0 };
            let mut add = |id: String, kind: DimKind, dim: usize| {
                let pos = DimPos {
                    output,
                    tensor: i,
                    dim,
                };
                match choices.iter_mut().find(|c| c.id == id) {
                    Some(c) => c.positions.push(pos),
                    None => choices.push(SplitChoice {
                        id,
                        kind,
                        positions: vec![pos],
                    }),
                }
            };
            for s in 0..lead {
                add(format!("*{s}"), DimKind::Spatial, s);
            }
            for (k, d) in dims.iter().enumerate() {
                match d {
                    Dim::Atom(Atom::Id(id)) => {
                        if self.kind(id) != DimKind::Frozen {
                            add(id.clone(), self.kind(id), lead + k);
                        }
                    }
                    Dim::Atom(Atom::Num(_)) => {}
                    Dim::Compound(atoms) => {
                        let mut first = true;
                        for a in atoms {
                            let Atom::Id(id) = a else {
                                if !matches!(a, Atom::Num(1)) {
                                    first = false;
                                }
                                continue;
                            };
                            if binding.len(id) == Some(1) {
                                continue;
                            }
                            if first && self.kind(id) != DimKind::Frozen {
                                add(id.clone(), self.kind(id), lead + k);
                            } else {
                                blocked.push(id.clone());
                            }
                            first = false;
                        }
                    }
                }
            }
        }
        // An identifier that is an inner part of a compound anywhere cannot be split anywhere.
        // Nor can a dimension of length 1.
        choices.retain(|c| !blocked.contains(&c.id) && binding.len(&c.id) != Some(1));
        choices
    }
}

fn compound_text(atoms: &[Atom]) -> String {
    let parts: Vec<String> = atoms
        .iter()
        .map(|a| match a {
            Atom::Id(n) => n.clone(),
            Atom::Num(n) => n.to_string(),
        })
        .collect();
    format!("({})", parts.join(" "))
}

fn bind_atom(
    lens: &mut BTreeMap<String, (i64, DimPos)>,
    atom: &Atom,
    len: i64,
    pos: DimPos,
) -> Result<(), AnnotationError> {
    match atom {
        Atom::Num(n) if *n != len => err(format!("{pos} is annotated as {n} but has length {len}")),
        Atom::Num(_) => Ok(()),
        Atom::Id(id) => match lens.get(id) {
            Some((l, first)) if *l != len => err(format!(
                "dimension '{id}' is {l} in {first} but {len} in {pos}"
            )),
            Some(_) => Ok(()),
            None => {
                lens.insert(id.clone(), (len, pos));
                Ok(())
            }
        },
    }
}

impl fmt::Display for Annotation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ins: Vec<String> = self
            .inputs
            .iter()
            .map(|t| self.tensor_text(t, true))
            .collect();
        let outs: Vec<String> = self
            .outputs
            .iter()
            .map(|t| self.tensor_text(t, false))
            .collect();
        write!(f, "{} -> {}", ins.join(", "), outs.join(", "))
    }
}

/// An annotation bound to concrete operand shapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    lens: BTreeMap<String, i64>,
    star: Vec<i64>,
    outputs: Vec<TensorAnno>,
}

impl Binding {
    /// The length bound to identifier `id`; `*N` names the N-th `*` dimension.
    pub fn len(&self, id: &str) -> Option<i64> {
        if let Some(n) = id.strip_prefix('*') {
            return n
                .parse::<usize>()
                .ok()
                .and_then(|i| self.star.get(i).copied());
        }
        self.lens.get(id).copied()
    }

    /// The leading dimensions bound to `*`.
    pub fn star(&self) -> &[i64] {
        &self.star
    }

    /// The result shapes the annotation implies.
    pub fn output_shapes(&self) -> Vec<Vec<i64>> {
        self.outputs
            .iter()
            .map(|t| {
                let TensorAnno::Tensor { star, dims } = t else {
                    return Vec::new();
                };
                let mut shape = if *star { self.star.clone() } else { Vec::new() };
                for d in dims {
                    let atoms: &[Atom] = match d {
                        Dim::Atom(a) => std::slice::from_ref(a),
                        Dim::Compound(v) => v,
                    };
                    shape.push(
                        atoms
                            .iter()
                            .map(|a| match a {
                                Atom::Num(n) => *n,
                                Atom::Id(id) => self.lens[id],
                            })
                            // Saturating: an absurd length then fails the type check.
                            .fold(1i64, i64::saturating_mul),
                    );
                }
                shape
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bind(text: &str, shapes: &[&[i64]]) -> Result<Binding, AnnotationError> {
        let a = Annotation::parse(text)?;
        let s: Vec<Option<&[i64]>> = shapes.iter().map(|s| Some(*s)).collect();
        a.bind(&s)
    }

    #[test]
    fn parses_and_prints_matmul() {
        let a = Annotation::parse("m k+, k+ n -> m n").unwrap();
        assert_eq!(a.kind("k"), DimKind::Summed);
        assert_eq!(a.kind("m"), DimKind::Spatial);
        assert_eq!(a.to_string(), "m k+, k+ n -> m n");
    }

    #[test]
    fn markers_normalize_onto_every_occurrence() {
        let a = Annotation::parse("m k+, k n -> m n").unwrap();
        assert_eq!(a.to_string(), "m k+, k+ n -> m n");
    }

    #[test]
    fn conflicting_markers_name_both_places() {
        let e = Annotation::parse("m k+, k^ n -> m n").unwrap_err();
        assert_eq!(
            e.0,
            "identifier 'k' is marked '+' in operand 0 but '^' in operand 1"
        );
    }

    #[test]
    fn reduced_id_must_be_marked() {
        let e = Annotation::parse("m k, k n -> m n").unwrap_err();
        assert!(e.0.contains("'k' is reduced"), "{e}");
    }

    #[test]
    fn output_ids_must_come_from_inputs() {
        let e = Annotation::parse("a b -> a c").unwrap_err();
        assert_eq!(
            e.0,
            "identifier 'c' of result 0 does not appear in any operand (a new dimension is written with its length: c=8)"
        );
    }

    #[test]
    fn new_dimensions() {
        let a = Annotation::parse("a b -> n=4 a b").unwrap();
        assert_eq!(a.to_string(), "a b -> n=4 a b");
        assert_eq!(a.kind("n"), DimKind::Spatial);
        let b = a.bind(&[Some(&[2, 3])]).unwrap();
        assert_eq!(b.output_shapes(), vec![vec![4, 2, 3]]);
        assert_eq!(b.len("n"), Some(4));
        let c = a.split_choices(&b);
        assert_eq!(c[2].id, "n");
        assert_eq!(
            c[2].positions,
            vec![DimPos {
                output: true,
                tensor: 0,
                dim: 0
            }]
        );
        // Its gradient sums over it: the VJP reads it from the result's gradient.
        let v = a.vjp().unwrap();
        assert_eq!(v.to_string(), "a b, n+ a b -> a b");
        let f = Annotation::parse("a -> n=2^ a, n a").unwrap();
        assert_eq!(f.kind("n"), DimKind::Frozen);
        assert_eq!(f.to_string(), "a -> n=2^ a, n=2^ a");
        let b = f.bind(&[Some(&[3])]).unwrap();
        assert_eq!(b.output_shapes(), vec![vec![2, 3], vec![2, 3]]);
        assert!(f.split_choices(&b).iter().all(|c| c.id != "n"));
        for (text, msg) in [
            ("n=4 a -> a", "only a result can have a new dimension"),
            ("a -> a=4", "appears in an operand"),
            ("a -> (n=2 a)", "cannot be part of a compound"),
            ("a -> n=2 a, n=3 a", "written 2 and 3"),
            ("a -> n=2+ a", "cannot be summed"),
            ("a -> n=2 a, n+ a", "nothing is summed"),
            ("a -> n=0 a", "positive length"),
            ("a -> n=x a", "positive length"),
            ("a -> n a", "n=8"),
        ] {
            let e = Annotation::parse(text).unwrap_err();
            assert!(e.0.contains(msg), "{text}: {e}");
        }
    }

    #[test]
    fn syntax_errors() {
        assert!(Annotation::parse("a b").unwrap_err().0.contains("no '->'"));
        assert!(Annotation::parse("a (b c -> a")
            .unwrap_err()
            .0
            .contains("unbalanced"));
        assert!(Annotation::parse("a * -> a")
            .unwrap_err()
            .0
            .contains("first"));
        assert!(Annotation::parse("a-b -> a")
            .unwrap_err()
            .0
            .contains("not a dimension"));
        assert!(Annotation::parse("a -> ?")
            .unwrap_err()
            .0
            .contains("cannot be '?'"));
        assert!(Annotation::parse("a+ -> a")
            .unwrap_err()
            .0
            .contains("nothing is summed"));
    }

    #[test]
    fn binds_and_infers_matmul() {
        let b = bind("m k+, k+ n -> m n", &[&[4, 8], &[8, 16]]).unwrap();
        assert_eq!(b.output_shapes(), vec![vec![4, 16]]);
    }

    #[test]
    fn mismatch_names_id_and_both_operands() {
        let e = bind("m k+, k+ n -> m n", &[&[4, 8], &[7, 16]]).unwrap_err();
        assert_eq!(
            e.0,
            "dimension 'k' is 8 in operand 0 dim 1 but 7 in operand 1 dim 0"
        );
    }

    #[test]
    fn star_binds_leading_dims() {
        let b = bind("* k+, n k+ -> * n", &[&[2, 3, 8], &[5, 8]]).unwrap();
        assert_eq!(b.star(), &[2, 3]);
        assert_eq!(b.output_shapes(), vec![vec![2, 3, 5]]);
        let e = bind("* d, * d -> * d", &[&[2, 3, 8], &[2, 4, 8]]).unwrap_err();
        assert!(
            e.0.contains("'*' is [2, 3] in operand 0 but [2, 4] in operand 1"),
            "{e}"
        );
    }

    #[test]
    fn rank_mismatch() {
        let e = bind("m k+, k+ n -> m n", &[&[4, 8, 1], &[8, 16]]).unwrap_err();
        assert!(e.0.contains("operand 0 has rank 3"), "{e}");
    }

    #[test]
    fn compound_factor_is_inferred() {
        // GQA: 8 query heads over 2 kv groups => r = 4.
        let a = "b (g r) s^ d^, b g t^ d^ -> b (g r) s^ d^";
        let b = bind(a, &[&[1, 8, 16, 4], &[1, 2, 16, 4]]).unwrap();
        assert_eq!(b.len("r"), Some(4));
        assert_eq!(b.output_shapes(), vec![vec![1, 8, 16, 4]]);
        let e = bind(a, &[&[1, 6, 16, 4], &[1, 4, 16, 4]]).unwrap_err();
        assert!(e.0.contains("do not divide"), "{e}");
    }

    #[test]
    fn compound_with_two_unknowns_is_an_error() {
        let e = bind("(a b) -> a b", &[&[12]]).unwrap_err();
        assert!(e.0.contains("more than one unknown"), "{e}");
    }

    #[test]
    fn numbers_are_checked() {
        assert!(bind("a 1 -> a", &[&[3, 1]]).is_ok());
        let e = bind("a 1 -> a", &[&[3, 2]]).unwrap_err();
        assert_eq!(e.0, "operand 0 dim 1 is annotated as 1 but has length 2");
    }

    #[test]
    fn split_choices_of_matmul() {
        let a = Annotation::parse("m k+, k+ n -> m n").unwrap();
        let b = a.bind(&[Some(&[4, 8]), Some(&[8, 16])]).unwrap();
        let c = a.split_choices(&b);
        let ids: Vec<(&str, DimKind)> = c.iter().map(|c| (c.id.as_str(), c.kind)).collect();
        assert_eq!(
            ids,
            vec![
                ("m", DimKind::Spatial),
                ("k", DimKind::Summed),
                ("n", DimKind::Spatial)
            ]
        );
        assert_eq!(c[1].positions.len(), 2);
        assert_eq!(c[0].positions.len(), 2); // operand 0 dim 0 and result 0 dim 0
    }

    #[test]
    fn compound_only_first_part_splits() {
        let v = Annotation::parse("m k+, k+ n -> m n")
            .unwrap()
            .vjp()
            .unwrap();
        assert_eq!(v.to_string(), "m+ k, k n+, m+ n+ -> m k, k n");
        let v = Annotation::parse("m k^, n k^ -> m n")
            .unwrap()
            .vjp()
            .unwrap();
        assert_eq!(v.to_string(), "m+ k^, n+ k^, m+ n+ -> m k, n k");
        let v = Annotation::parse("* d^ -> * d^").unwrap().vjp().unwrap();
        assert_eq!(v.to_string(), "* d^, * d^ -> * d");
        assert!(Annotation::parse("n+ v^, n+, ? -> ")
            .unwrap()
            .vjp()
            .is_err());
        let a = Annotation::parse("(h d) -> h d").unwrap();
        let b = a.bind(&[Some(&[12])]).unwrap_err();
        assert!(b.0.contains("unknown"));
        let a = Annotation::parse("b (h d), h -> b h d").unwrap();
        let b = a.bind(&[Some(&[2, 12]), Some(&[3])]).unwrap();
        let ids: Vec<String> = a.split_choices(&b).into_iter().map(|c| c.id).collect();
        assert_eq!(ids, vec!["b", "h"]);
        // A leading part of length 1 passes splittability to the next part.
        let b = a.bind(&[Some(&[2, 12]), Some(&[1])]).unwrap();
        let ids: Vec<String> = a.split_choices(&b).into_iter().map(|c| c.id).collect();
        assert_eq!(ids, vec!["b", "d"]);
    }

    #[test]
    fn frozen_and_star_choices() {
        let a = Annotation::parse("* d^ -> * d^").unwrap();
        let b = a.bind(&[Some(&[2, 3, 8])]).unwrap();
        let ids: Vec<String> = a.split_choices(&b).into_iter().map(|c| c.id).collect();
        assert_eq!(ids, vec!["*0", "*1"]);
    }

    #[test]
    fn non_tensor_and_scalar_entries() {
        let a = Annotation::parse("n+ v^, n+, ? -> ").unwrap();
        assert_eq!(a.outputs.len(), 1);
        let b = a.bind(&[Some(&[6, 5]), Some(&[6]), None]).unwrap();
        assert_eq!(b.output_shapes(), vec![Vec::<i64>::new()]);
        let a = Annotation::parse(" -> 4 8").unwrap();
        assert_eq!(a.bind(&[]).unwrap().output_shapes(), vec![vec![4, 8]]);
        let a = Annotation::parse("a+, ? -> 1").unwrap();
        let b = a.bind(&[Some(&[5]), None]).unwrap();
        assert_eq!(b.output_shapes(), vec![vec![1]]);
    }
}
