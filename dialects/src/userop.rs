//! User-defined operators: a function with a dimension annotation.
//!
//! ```mlir
//! func.func private @my_gemm(%a: tensor<8x16xf32>, %b: tensor<16x4xf32>) -> tensor<8x4xf32>
//!     attributes {nns.annotation = "m k+, k+ n -> m n"} { ... }
//! %r = func.call @my_gemm(%x, %w) : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
//! ```
//!
//! A call to such a function is an op like a built-in one: its annotation (the same
//! language as the `dnn` ops', see [`crate::annotation`]) says how it may be split, and the
//! partitioning passes read it from the callee. Function attributes:
//! - `nns.annotation = "..."` (required): must parse and bind to the function's argument
//!   shapes, and the shapes it infers must be the function's result types;
//! - `nns.vjp = @f_vjp`: the function that computes the operands' gradients, taking the
//!   operands then the results' gradients and returning one gradient per operand;
//! - `nns.kernel = "libmyops.so:my_gemm"`: on a declaration (no body), the C symbol that
//!   computes it.
//!
//! A function with a body may hold `dnn` ops and upstream ops; a declaration needs a
//! kernel. Every problem is reported on the function.

use crate::annotation::{Annotation, DimKind};
use crate::diag::{Diagnostics, SrcLoc};
use crate::types::{AttrValue, Attrs, TensorType};
use crate::view::{top_level_ops, FuncView, OpView};
use melior::ir::OperationRef;
use std::collections::BTreeMap;
use std::sync::Arc;

/// One user-defined operator.
#[derive(Clone, Debug)]
pub struct UserOp {
    /// The function's symbol name (without `@`).
    pub name: String,
    /// The function's location.
    pub loc: SrcLoc,
    /// The annotation as written.
    pub text: String,
    /// The parsed annotation.
    pub annotation: Annotation,
    /// Argument types.
    pub args: Vec<TensorType>,
    /// Result types.
    pub results: Vec<TensorType>,
    /// `nns.vjp`: the gradient function's name.
    pub vjp: Option<String>,
    /// `nns.kernel`: `library:symbol`.
    pub kernel: Option<String>,
    /// Whether the function has a body (else it is a declaration with a kernel).
    pub has_body: bool,
}

/// The user-defined operators of a module, by function name.
#[derive(Clone, Debug, Default)]
pub struct UserOps(pub BTreeMap<String, Arc<UserOp>>, pub Kernels);

/// Every function of a module implemented by a C kernel (`nns.kernel`), by name: user ops'
/// declarations and their localized specializations.
#[derive(Clone, Debug, Default)]
pub struct Kernels(pub BTreeMap<String, String>);

/// The function name a `func.call`'s `callee` attribute names.
pub fn callee(attrs: &Attrs) -> Option<&str> {
    match attrs.get("callee")? {
        AttrValue::Other(s) => s.strip_prefix('@'),
        AttrValue::Str(s) => Some(s),
        _ => None,
    }
}

impl UserOps {
    /// The user ops of the module op `module` (its functions with `nns.annotation`);
    /// problems with them go to `diags`, located on the function.
    pub fn collect(module: &OperationRef<'_, '_>, diags: &mut Diagnostics) -> Self {
        let mut out = BTreeMap::new();
        let mut kernels = BTreeMap::new();
        let mut names = Vec::new();
        top_level_ops(module, &mut |op| {
            let Some(f) = FuncView::of(op) else { return };
            names.push(f.name.clone());
            let attrs = OpView::of(op).attrs;
            if let Some(AttrValue::Str(k)) = attrs.get("nns.kernel") {
                kernels.insert(f.name.clone(), k.clone());
            }
            let has_body = op
                .region(0)
                .map(|r| r.first_block().is_some())
                .unwrap_or(false);
            match read(&f, &attrs, has_body) {
                Ok(Some(u)) => {
                    out.insert(u.name.clone(), Arc::new(u));
                }
                Ok(None) => {}
                Err(e) => diags.error(&f.loc, format!("@{}: {e}", f.name)),
            }
        });
        for u in out.values() {
            if let Some(v) = &u.vjp {
                if !names.contains(v) {
                    diags.error(
                        &u.loc,
                        format!(
                            "@{}: 'nns.vjp' names @{v}, which is not a function of this module",
                            u.name
                        ),
                    );
                }
            }
        }
        UserOps(out, Kernels(kernels))
    }

    /// The user op called by a `func.call` with attributes `attrs`.
    pub fn of_call(&self, op: &str, attrs: &Attrs) -> Option<&Arc<UserOp>> {
        if op != "func.call" {
            return None;
        }
        self.0.get(callee(attrs)?)
    }

    /// Whether the module has none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

use melior::ir::RegionLike;

/// Reads one function's user-op attributes (`None` when it has no `nns.annotation`).
fn read(f: &FuncView, attrs: &Attrs, has_body: bool) -> Result<Option<UserOp>, String> {
    let text = match attrs.get("nns.annotation") {
        // A localized specialization of a kernel op: local types, the same kernel.
        None if attrs.contains_key("nns.localized") && attrs.contains_key("nns.kernel") => {
            return Ok(None)
        }
        None => {
            for k in ["nns.vjp", "nns.kernel"] {
                if attrs.contains_key(k) {
                    return Err(format!("'{k}' is set but 'nns.annotation' is not"));
                }
            }
            return Ok(None);
        }
        Some(AttrValue::Str(s)) => s.clone(),
        Some(_) => return Err("'nns.annotation' must be a string".into()),
    };
    let annotation =
        Annotation::parse(&text).map_err(|e| format!("'nns.annotation' \"{text}\": {e}"))?;
    let tensors = |types: &[Option<TensorType>], what: &str| {
        types
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.clone().ok_or(format!(
                    "{what} {i} must be a ranked tensor with a static shape (a user op takes and returns tensors)"
                ))
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let args = tensors(&f.args, "argument")?;
    let results = tensors(&f.results, "result")?;
    if annotation.inputs.len() != args.len() {
        return Err(format!(
            "'nns.annotation' \"{text}\" has {} operand(s) but the function takes {}",
            annotation.inputs.len(),
            args.len()
        ));
    }
    if annotation.outputs.len() != results.len() {
        return Err(format!(
            "'nns.annotation' \"{text}\" has {} result(s) but the function returns {}",
            annotation.outputs.len(),
            results.len()
        ));
    }
    let shapes: Vec<Option<&[i64]>> = args.iter().map(|t| Some(t.shape.as_slice())).collect();
    let binding = annotation
        .bind(&shapes)
        .map_err(|e| format!("'nns.annotation' \"{text}\" does not fit the arguments: {e}"))?;
    for (i, (want, have)) in binding.output_shapes().iter().zip(&results).enumerate() {
        if *want != have.shape {
            return Err(format!(
                "'nns.annotation' \"{text}\" gives result {i} the shape {want:?} but the function returns {have}"
            ));
        }
    }
    debug_assert!(annotation
        .kinds
        .values()
        .all(|k| matches!(k, DimKind::Spatial | DimKind::Summed | DimKind::Frozen)));
    let vjp = match attrs.get("nns.vjp") {
        None => None,
        Some(AttrValue::Other(s)) if s.starts_with('@') => Some(s[1..].to_string()),
        Some(_) => return Err("'nns.vjp' must name a function (@f_vjp)".into()),
    };
    let kernel = match attrs.get("nns.kernel") {
        None => None,
        Some(AttrValue::Str(s)) => match s.rsplit_once(':') {
            Some((lib, sym)) if !lib.is_empty() && !sym.is_empty() => Some(s.clone()),
            _ => {
                return Err(format!(
                    "'nns.kernel' \"{s}\" must be \"library:symbol\" (e.g. \"libmyops.so:my_gemm\")"
                ))
            }
        },
        Some(_) => return Err("'nns.kernel' must be a string".into()),
    };
    match (has_body, &kernel) {
        (false, None) => {
            return Err("a user op without a body needs 'nns.kernel = \"library:symbol\"'".into())
        }
        (true, Some(_)) => {
            return Err("'nns.kernel' is for declarations; this function has a body".into())
        }
        _ => {}
    }
    Ok(Some(UserOp {
        name: f.name.clone(),
        loc: f.loc.clone(),
        text,
        annotation,
        args,
        results,
        vjp,
        kernel,
        has_body,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::IrContext;

    fn collect(src: &str) -> (UserOps, Diagnostics) {
        let ir = IrContext::new();
        let m = ir.parse(src, "u.mlir").expect("parses");
        let mut d = Diagnostics::default();
        let u = UserOps::collect(&m.as_operation(), &mut d);
        (u, d)
    }

    const GEMM: &str = r#"func.func private @my_gemm(%a: tensor<8x16xf32>, %b: tensor<16x4xf32>) -> tensor<8x4xf32> attributes {nns.annotation = "ANNO"} {
  %0 = "dnn.matmul"(%a, %b) : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
  return %0 : tensor<8x4xf32>
}"#;

    #[test]
    fn an_annotated_function_is_a_user_op() {
        let (u, d) = collect(&GEMM.replace("ANNO", "m k+, k+ n -> m n"));
        assert!(!d.has_errors(), "{d:?}");
        let op = &u.0["my_gemm"];
        assert_eq!(op.args.len(), 2);
        assert!(op.has_body);
        let mut attrs = Attrs::new();
        attrs.insert("callee".into(), AttrValue::Other("@my_gemm".into()));
        assert!(u.of_call("func.call", &attrs).is_some());
    }

    #[test]
    fn annotation_errors_are_located_on_the_function() {
        for (anno, want) in [
            (
                "m k, k n -> m n",
                "reduced (it appears in no result) but is not marked",
            ),
            ("m k+, k+ n -> m n k", "marked '+' but every result has it"),
            ("m k+, m n -> m n", "does not fit"),
            ("m k+, k+ n -> n m", "gives result 0 the shape [4, 8]"),
            ("m k+ -> m", "has 1 operand(s) but the function takes 2"),
            (
                "m k+, k+ n -> m n, m",
                "has 2 result(s) but the function returns 1",
            ),
        ] {
            let (_, d) = collect(&GEMM.replace("ANNO", anno));
            let e = &d.0[0];
            assert!(e.message.contains(want), "{anno}: {}", e.message);
            assert!(e.message.starts_with("@my_gemm: "), "{}", e.message);
            assert_eq!((e.loc.line, e.loc.col), (1, 1), "{anno}");
        }
    }

    #[test]
    fn vjp_and_kernel_are_checked() {
        let src = GEMM
            .replace("ANNO", "m k+, k+ n -> m n")
            .replace("nns.annotation", "nns.vjp = @nope, nns.annotation");
        let (_, d) = collect(&src);
        assert!(d.0[0].message.contains("names @nope"), "{:?}", d.0);
        let decl = r#"func.func private @k(%a: tensor<4xf32>) -> tensor<4xf32> attributes {nns.annotation = "n -> n"}"#;
        let (_, d) = collect(decl);
        assert!(d.0[0].message.contains("needs 'nns.kernel"), "{:?}", d.0);
        let (u, d) = collect(&decl.replace("\"n -> n\"", "\"n -> n\", nns.kernel = \"libx.so:k\""));
        assert!(!d.has_errors(), "{d:?}");
        assert_eq!(u.0["k"].kernel.as_deref(), Some("libx.so:k"));
        let (_, d) = collect(&decl.replace("\"n -> n\"", "\"n -> n\", nns.kernel = \"k\""));
        assert!(
            d.0[0].message.contains("must be \"library:symbol\""),
            "{:?}",
            d.0
        );
    }
}
