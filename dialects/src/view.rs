//! Read-only views of MLIR operations as plain Rust data: name, location, operand and
//! result types, typed attributes. The verifier and the analyses read IR through these.

use crate::diag::SrcLoc;
use crate::types::{AttrValue, Attrs, TensorType};
use melior::ir::{attribute::AttributeLike, r#type::TypeLike, OperationRef, Value, ValueLike};
use mlir_sys::{
    mlirArrayAttrGetElement, mlirArrayAttrGetNumElements, mlirAttributeIsAArray,
    mlirAttributeIsADictionary, mlirBlockGetFirstOperation, mlirBlockGetNextInRegion,
    mlirDictionaryAttrGetElement, mlirDictionaryAttrGetNumElements, mlirFunctionTypeGetInput,
    mlirFunctionTypeGetNumInputs, mlirFunctionTypeGetNumResults, mlirFunctionTypeGetResult,
    mlirIdentifierStr, mlirOperationGetAttributeByName, mlirOperationGetNextInBlock,
    mlirOperationGetNumRegions, mlirOperationGetRegion, mlirRegionGetFirstBlock,
    mlirTypeAttrGetValue, mlirTypeIsAFunction, MlirOperation,
};

/// One operation, as data.
#[derive(Clone, Debug)]
pub struct OpView {
    /// Full op name (`dnn.matmul`).
    pub name: String,
    /// The op's location, resolved into [`OpView::loc`] on first use (printing locations
    /// is a large part of reading IR, and most views never report anything).
    raw_loc: crate::diag::RawLoc,
    loc_cell: std::cell::OnceCell<SrcLoc>,
    /// Operand types (`None` if not a static ranked tensor).
    pub operands: Vec<Option<TensorType>>,
    /// The printed type of each operand that is not a tensor nnscaler reads.
    operand_other: Vec<Option<String>>,
    /// Result types (`None` if not a static ranked tensor).
    pub results: Vec<Option<TensorType>>,
    /// The printed type of each result that is not a tensor nnscaler reads.
    result_other: Vec<Option<String>>,
    /// Attributes by name (for a `func.func`, not its `function_type`, `arg_attrs` and
    /// `res_attrs`: see [`FuncView`]).
    pub attrs: Attrs,
}

/// A value's type through the C API; its text is printed only when it is not a tensor
/// type nnscaler reads (the text is for messages).
fn value_type(v: Value<'_, '_>) -> (Option<TensorType>, Option<String>) {
    let t = v.r#type();
    match TensorType::from_type(t.to_raw()) {
        Some(tt) => (Some(tt), None),
        None => (None, Some(t.to_string())),
    }
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
        let (operands, operand_other) = op.operands().map(value_type).unzip();
        let (results, result_other) = op.results().map(|r| value_type(r.into())).unzip();
        // A function's type and argument/result attributes are read by `FuncView` (through
        // the C API); printing them here would cost as much as printing the signature.
        let is_func = name == "func.func";
        let attrs = op
            .attributes()
            .filter_map(|(k, v)| {
                let k = k.as_string_ref().as_str().unwrap_or("").to_string();
                if is_func && matches!(k.as_str(), "function_type" | "arg_attrs" | "res_attrs") {
                    return None;
                }
                Some((k, AttrValue::from_attribute(v.to_raw())))
            })
            .collect();
        OpView {
            name,
            raw_loc: crate::diag::RawLoc(op.location().to_raw()),
            loc_cell: std::cell::OnceCell::new(),
            operands,
            operand_other,
            results,
            result_other,
            attrs,
        }
    }

    /// Operand `i`'s type as printed (for messages).
    pub fn operand_text(&self, i: usize) -> String {
        type_text(&self.operands, &self.operand_other, i)
    }

    /// Result `i`'s type as printed (for messages).
    pub fn result_text(&self, i: usize) -> String {
        type_text(&self.results, &self.result_other, i)
    }
}

fn type_text(tensors: &[Option<TensorType>], other: &[Option<String>], i: usize) -> String {
    match (tensors.get(i), other.get(i)) {
        (Some(Some(t)), _) => t.to_string(),
        (_, Some(Some(s))) => s.clone(),
        _ => String::new(),
    }
}

impl OpView {
    /// The op's source location. Valid while the IR the view was read from lives (views are
    /// read and used within one walk).
    pub fn loc(&self) -> &SrcLoc {
        self.loc_cell.get_or_init(|| {
            // SAFETY: the location belongs to the live context of the op this view was read
            // from (see the method's docs).
            SrcLoc::from_location(unsafe { melior::ir::Location::from_raw(self.raw_loc.0) })
        })
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

/// Calls `f` on every operation directly in the body of the module op `module`.
pub fn top_level_ops(module: &OperationRef<'_, '_>, f: &mut dyn FnMut(&OperationRef<'_, '_>)) {
    unsafe {
        let region = mlirOperationGetRegion(module.to_raw(), 0);
        let block = mlirRegionGetFirstBlock(region);
        if block.ptr.is_null() {
            return;
        }
        let mut cur = mlirBlockGetFirstOperation(block);
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
        if op.name().as_string_ref().as_str() != Ok("func.func") {
            return None;
        }
        let view = OpView::of(op);
        let name = match view.attrs.get("sym_name") {
            Some(AttrValue::Str(s)) => s.clone(),
            _ => String::new(),
        };
        let raw = op.to_raw();
        // SAFETY: `op` is a live func.func; its attributes are only read.
        let (args, results, arg_attrs, result_attrs) = unsafe {
            let fty = mlirTypeAttrGetValue(mlirOperationGetAttributeByName(
                raw,
                crate::rewriter::sref("function_type"),
            ));
            let (nin, nout) = if !fty.ptr.is_null() && mlirTypeIsAFunction(fty) {
                (
                    mlirFunctionTypeGetNumInputs(fty),
                    mlirFunctionTypeGetNumResults(fty),
                )
            } else {
                (0, 0)
            };
            let args: Vec<Option<TensorType>> = (0..nin)
                .map(|i| TensorType::from_type(mlirFunctionTypeGetInput(fty, i)))
                .collect();
            let results: Vec<Option<TensorType>> = (0..nout)
                .map(|i| TensorType::from_type(mlirFunctionTypeGetResult(fty, i)))
                .collect();
            let dicts = |key: &str, n: isize| -> Vec<Attrs> {
                let arr = mlirOperationGetAttributeByName(raw, crate::rewriter::sref(key));
                let mut v: Vec<Attrs> = Vec::new();
                if !arr.ptr.is_null() && mlirAttributeIsAArray(arr) {
                    for i in 0..mlirArrayAttrGetNumElements(arr) {
                        let d = mlirArrayAttrGetElement(arr, i);
                        let mut attrs = Attrs::new();
                        if mlirAttributeIsADictionary(d) {
                            for j in 0..mlirDictionaryAttrGetNumElements(d) {
                                let na = mlirDictionaryAttrGetElement(d, j);
                                let k = crate::rewriter::string_of(mlirIdentifierStr(na.name));
                                attrs.insert(k, AttrValue::from_attribute(na.attribute));
                            }
                        }
                        v.push(attrs);
                    }
                }
                v.resize(n as usize, Attrs::new());
                v
            };
            (
                args,
                results,
                dicts("arg_attrs", nin),
                dicts("res_attrs", nout),
            )
        };
        Some(FuncView {
            name,
            loc: view.loc().clone(),
            arg_attrs,
            result_attrs,
            args,
            results,
        })
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::IrContext;

    #[test]
    fn functions_and_attributes_are_read_through_the_c_api() {
        let ir = IrContext::new();
        let m = ir
            .parse(
                r#"func.func @f(%a: tensor<2x3xf32> {nns.name = "a, b", nns.param, nns.k = array<i64: 1, 2>}, %i: index) -> (tensor<f32>, tensor<3xi64> {nns.layout = #nns.layout<@world, tp = D(0)>}) {
  %0 = "x.y"() {s = ["p", "q"], n = 7 : i32, f = 2.5 : f32, u, l = [1, 2], e = "a\nb"} : () -> tensor<f32>
  %1 = "x.z"() : () -> tensor<3xi64>
  return %0, %1 : tensor<f32>, tensor<3xi64>
}"#,
                "t.mlir",
            )
            .unwrap();
        let mut funcs = Vec::new();
        let mut ops = Vec::new();
        walk_nested(&m.as_operation(), &mut |op| match FuncView::of(op) {
            Some(f) => funcs.push(f),
            None => ops.push(OpView::of(op)),
        });
        let f = &funcs[0];
        assert_eq!(f.name, "f");
        assert_eq!(
            f.args[0],
            Some(TensorType::new(&[2, 3], crate::types::Elem::F32))
        );
        assert_eq!(f.args[1], None, "index is not a tensor");
        assert_eq!(
            f.results[1],
            Some(TensorType::new(&[3], crate::types::Elem::I64))
        );
        assert_eq!(f.arg_attrs[0]["nns.name"], AttrValue::Str("a, b".into()));
        assert_eq!(f.arg_attrs[0]["nns.param"], AttrValue::Unit);
        assert_eq!(f.arg_attrs[0]["nns.k"], AttrValue::Ints(vec![1, 2]));
        assert!(f.arg_attrs[1].is_empty() && f.result_attrs[0].is_empty());
        assert_eq!(
            f.result_attrs[1]["nns.layout"],
            AttrValue::Layout(std::sync::Arc::new(
                crate::nns::Layout::parse("@world, tp = D(0)").unwrap()
            ))
        );
        let y = &ops[0];
        assert_eq!(y.attrs["s"], AttrValue::Strs(vec!["p".into(), "q".into()]));
        assert_eq!(y.attrs["n"], AttrValue::Int(7));
        assert_eq!(y.attrs["f"], AttrValue::Float(2.5));
        assert_eq!(y.attrs["u"], AttrValue::Unit);
        assert_eq!(y.attrs["l"], AttrValue::Ints(vec![1, 2]));
        assert_eq!(y.attrs["e"], AttrValue::Str("a\nb".into()));
        assert_eq!(y.result_text(0), "tensor<f32>");
    }
}
