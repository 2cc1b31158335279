//! Read-only views of MLIR operations as plain Rust data: name, location, operand and
//! result types, typed attributes. The verifier and the analyses read IR through these.

use crate::diag::SrcLoc;
use crate::types::{AttrValue, Attrs, TensorType};
use melior::ir::{Module, OperationRef, Value, ValueLike};
use mlir_sys::{
    mlirBlockGetFirstOperation, mlirBlockGetNextInRegion, mlirOperationGetNextInBlock,
    mlirOperationGetNumRegions, mlirOperationGetRegion, mlirRegionGetFirstBlock, MlirOperation,
};

/// One operation, as data.
#[derive(Clone, Debug)]
pub struct OpView {
    /// Full op name (`dnn.matmul`).
    pub name: String,
    /// Source location.
    pub loc: SrcLoc,
    /// Operand types (`None` if not a static ranked tensor), with their printed type.
    pub operands: Vec<Option<TensorType>>,
    /// Printed operand types.
    pub operand_text: Vec<String>,
    /// Result types (`None` if not a static ranked tensor).
    pub results: Vec<Option<TensorType>>,
    /// Printed result types.
    pub result_text: Vec<String>,
    /// Attributes by name.
    pub attrs: Attrs,
}

fn value_type(v: Value<'_, '_>) -> (Option<TensorType>, String) {
    let text = v.r#type().to_string();
    (TensorType::parse(&text), text)
}

impl OpView {
    /// Reads `op`.
    pub fn of(op: &OperationRef<'_, '_>) -> Self {
        let name = op
            .name()
            .as_string_ref()
            .as_str()
            .unwrap_or("<invalid utf-8>")
            .to_string();
        let (operands, operand_text) = op.operands().map(value_type).unzip();
        let (results, result_text) = op.results().map(|r| value_type(r.into())).unzip();
        let attrs = op
            .attributes()
            .map(|(k, v)| {
                (
                    k.as_string_ref().as_str().unwrap_or("").to_string(),
                    AttrValue::from_mlir_text(&v.to_string()),
                )
            })
            .collect();
        OpView {
            name,
            loc: SrcLoc::from_location(op.location()),
            operands,
            operand_text,
            results,
            result_text,
            attrs,
        }
    }
}

/// Calls `f` on every operation nested in `op` (not `op` itself), in pre-order.
pub fn walk_nested(op: &OperationRef<'_, '_>, f: &mut dyn FnMut(&OperationRef<'_, '_>)) {
    walk_raw(op.to_raw(), f)
}

// The walk uses raw handles: melior's borrowed `OperationRef`s cannot outlive the step
// that produced them, while a walk needs to hold one while visiting its children.
fn walk_raw(op: MlirOperation, f: &mut dyn FnMut(&OperationRef<'_, '_>)) {
    unsafe {
        for r in 0..mlirOperationGetNumRegions(op) {
            let region = mlirOperationGetRegion(op, r);
            let mut block = mlirRegionGetFirstBlock(region);
            while !block.ptr.is_null() {
                let mut cur = mlirBlockGetFirstOperation(block);
                while !cur.ptr.is_null() {
                    f(&OperationRef::from_raw(cur));
                    walk_raw(cur, f);
                    cur = mlirOperationGetNextInBlock(cur);
                }
                block = mlirBlockGetNextInRegion(block);
            }
        }
    }
}

/// Calls `f` on every operation directly in the module body.
pub fn top_level_ops(module: &Module<'_>, f: &mut dyn FnMut(&OperationRef<'_, '_>)) {
    unsafe {
        let mut cur = mlirBlockGetFirstOperation(module.body().to_raw());
        while !cur.ptr.is_null() {
            f(&OperationRef::from_raw(cur));
            cur = mlirOperationGetNextInBlock(cur);
        }
    }
}

/// A `func.func` with its signature and argument/result attributes.
#[derive(Clone, Debug)]
pub struct FuncView {
    /// Symbol name.
    pub name: String,
    /// Source location.
    pub loc: SrcLoc,
    /// Argument types.
    pub args: Vec<Option<TensorType>>,
    /// Attributes of each argument (`nns.name`, `nns.param`, `nns.layout`).
    pub arg_attrs: Vec<Attrs>,
    /// Result types.
    pub results: Vec<Option<TensorType>>,
    /// Attributes of each result.
    pub result_attrs: Vec<Attrs>,
}

impl FuncView {
    /// Reads a `func.func` (`None` for any other op).
    pub fn of(op: &OperationRef<'_, '_>) -> Option<Self> {
        let view = OpView::of(op);
        if view.name != "func.func" {
            return None;
        }
        let name = match view.attrs.get("sym_name") {
            Some(AttrValue::Str(s)) => s.clone(),
            _ => String::new(),
        };
        let fty = match view.attrs.get("function_type") {
            Some(AttrValue::Other(t)) => t.clone(),
            _ => String::new(),
        };
        let (ins, outs) = split_function_type(&fty);
        let dicts = |key: &str, n: usize| -> Vec<Attrs> {
            let mut v = match view.attrs.get(key) {
                Some(AttrValue::Other(t)) => parse_dict_array(t),
                _ => Vec::new(),
            };
            v.resize(n, Attrs::new());
            v
        };
        Some(FuncView {
            name,
            loc: view.loc,
            arg_attrs: dicts("arg_attrs", ins.len()),
            result_attrs: dicts("res_attrs", outs.len()),
            args: ins.iter().map(|t| TensorType::parse(t)).collect(),
            results: outs.iter().map(|t| TensorType::parse(t)).collect(),
        })
    }
}

/// Splits `(t1, t2) -> (t3)` / `(t1) -> t3` into input and output type texts.
fn split_function_type(text: &str) -> (Vec<String>, Vec<String>) {
    let Some((ins, outs)) = split_top(text, "->") else {
        return (Vec::new(), Vec::new());
    };
    let list = |s: &str| -> Vec<String> {
        let s = s.trim();
        let s = s
            .strip_prefix('(')
            .and_then(|x| x.strip_suffix(')'))
            .unwrap_or(s);
        split_commas(s)
            .into_iter()
            .filter(|x| !x.is_empty())
            .collect()
    };
    (list(ins), list(outs))
}

fn split_top<'a>(text: &'a str, sep: &str) -> Option<(&'a str, &'a str)> {
    let mut depth = 0i32;
    let bytes = text.as_bytes();
    for i in 0..bytes.len() {
        match bytes[i] {
            b'(' | b'<' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth -= 1,
            b'>' if i == 0 || bytes[i - 1] != b'-' => depth -= 1,
            _ => {}
        }
        if depth == 0 && text[i..].starts_with(sep) {
            return Some((&text[..i], &text[i + sep.len()..]));
        }
    }
    None
}

/// Splits at top-level commas, respecting brackets and quoted strings.
pub fn split_commas(text: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth, mut quoted, mut prev) =
        (Vec::new(), String::new(), 0i32, false, ' ');
    for c in text.chars() {
        if quoted {
            if c == '"' && prev != '\\' {
                quoted = false;
            }
        } else {
            match c {
                '"' => quoted = true,
                '(' | '<' | '[' | '{' => depth += 1,
                ')' | ']' | '}' => depth -= 1,
                '>' if prev != '-' => depth -= 1,
                ',' if depth == 0 => {
                    out.push(cur.trim().to_string());
                    cur.clear();
                    prev = c;
                    continue;
                }
                _ => {}
            }
        }
        cur.push(c);
        prev = c;
    }
    if !cur.trim().is_empty() {
        out.push(cur.trim().to_string());
    }
    out
}

/// Parses a printed dictionary `{a = 1 : i64, b}` into attributes.
pub fn parse_dict(text: &str) -> Attrs {
    let body = text
        .trim()
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'))
        .unwrap_or(text);
    split_commas(body)
        .into_iter()
        .filter(|e| !e.is_empty())
        .map(|entry| match split_top(&entry, "=") {
            Some((k, v)) => (
                k.trim().trim_matches('"').to_string(),
                AttrValue::from_mlir_text(v),
            ),
            None => (entry.trim().trim_matches('"').to_string(), AttrValue::Unit),
        })
        .collect()
}

/// Parses `[{...}, {...}]` into one attribute map per entry.
fn parse_dict_array(text: &str) -> Vec<Attrs> {
    let body = text
        .trim()
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .unwrap_or("");
    split_commas(body).iter().map(|d| parse_dict(d)).collect()
}

/// `op` printed with its source locations (`loc(...)`), so that text re-parsed after a
/// rewrite keeps pointing at the user's file.
pub fn op_text_with_locs(op: &OperationRef<'_, '_>) -> String {
    let flags = melior::ir::operation::OperationPrintingFlags::new().enable_debug_info(true, false);
    op.to_string_with_flags(flags)
        .unwrap_or_else(|_| op.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dicts_and_function_types() {
        let d = parse_dict(r#"{nns.name = "a, b", nns.param, k = array<i64: 1, 2>}"#);
        assert_eq!(d["nns.name"], AttrValue::Str("a, b".into()));
        assert_eq!(d["nns.param"], AttrValue::Unit);
        assert_eq!(d["k"], AttrValue::Ints(vec![1, 2]));
        let (i, o) = split_function_type("(tensor<2x3xf32>, tensor<3xi64>) -> tensor<f32>");
        assert_eq!(i, vec!["tensor<2x3xf32>", "tensor<3xi64>"]);
        assert_eq!(o, vec!["tensor<f32>"]);
        let (i, o) = split_function_type("() -> ()");
        assert!(i.is_empty() && o.is_empty());
    }
}
