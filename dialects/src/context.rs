//! The owner of the MLIR context, and parsing with real file names in every location.

use crate::diag::{Diagnostic, Diagnostics, Severity, SrcLoc};
use melior::{
    diagnostic::DiagnosticSeverity,
    dialect::DialectRegistry,
    ir::{Location, Module, Operation},
    utility::register_all_dialects,
    Context, StringRef,
};
use std::{cell::RefCell, ffi::CString, rc::Rc};

/// Owns the [`Context`] every nnscaler IR handle borrows. Unregistered dialects are allowed
/// (our `dnn` and `nns` ops are written in generic form), the upstream dialects are
/// registered so that `func`, `arith`, `canonicalize` and `cse` work, and every MLIR
/// diagnostic is captured as a [`Diagnostic`] instead of being printed.
#[derive(Debug)]
pub struct IrContext {
    context: Context,
    captured: Rc<RefCell<Vec<Diagnostic>>>,
}

impl Default for IrContext {
    fn default() -> Self {
        Self::new()
    }
}

impl IrContext {
    /// Creates a context with the upstream dialects registered.
    pub fn new() -> Self {
        Self::with_observer(|_| {})
    }

    /// [`IrContext::new`], also calling `observe` on every diagnostic as MLIR reports it
    /// (before any later step can fail): how a process that may not survive the parse
    /// passes its diagnostics on.
    pub fn with_observer(mut observe: impl FnMut(&Diagnostic) + 'static) -> Self {
        let context = Context::new();
        let registry = DialectRegistry::new();
        register_all_dialects(&registry);
        context.append_dialect_registry(&registry);
        context.set_allow_unregistered_dialects(true);
        context.get_or_load_dialect("func");
        context.get_or_load_dialect("arith");
        let captured: Rc<RefCell<Vec<Diagnostic>>> = Rc::default();
        let sink = captured.clone();
        context.attach_diagnostic_handler(move |d| {
            let severity = match d.severity() {
                DiagnosticSeverity::Error => Severity::Error,
                DiagnosticSeverity::Warning => Severity::Warning,
                _ => Severity::Note,
            };
            let mut sink = sink.borrow_mut();
            let mut push = |x: Diagnostic| {
                observe(&x);
                sink.push(x);
            };
            push(Diagnostic {
                loc: SrcLoc::from_location(d.location()),
                severity,
                message: d.to_string(),
                facts: Default::default(),
            });
            for i in 0..d.note_count() {
                if let Ok(n) = d.note(i) {
                    push(Diagnostic {
                        loc: SrcLoc::from_location(n.location()),
                        severity: Severity::Note,
                        message: n.to_string(),
                        facts: Default::default(),
                    });
                }
            }
            true
        });
        Self { context, captured }
    }

    /// The MLIR context.
    pub fn context(&self) -> &Context {
        &self.context
    }

    /// Takes the diagnostics MLIR reported since the last call.
    pub fn take_diagnostics(&self) -> Diagnostics {
        Diagnostics(std::mem::take(&mut *self.captured.borrow_mut()))
    }

    /// A location in file `file` at `line`:`col`.
    pub fn location(&self, file: &str, line: usize, col: usize) -> Location<'_> {
        Location::new(&self.context, file, line, col)
    }

    /// Parses `source` as a module; locations name `buffer_name` (a path, or `-`). A source
    /// whose top level is not a single `builtin.module` is wrapped in one. Parse errors come
    /// back with their locations.
    pub fn parse(&self, source: &str, buffer_name: &str) -> Result<Module<'_>, Diagnostics> {
        self.take_diagnostics();
        match self.parse_single(source, buffer_name) {
            Ok(m) => Ok(m),
            Err(d)
                if d.0
                    .iter()
                    .any(|d| d.message.contains("single top-level operation")) =>
            {
                // Several top-level ops: wrap them in a module as mlir-opt does. The wrapper
                // opens on line 1 so line numbers stay true; columns of line 1 move right by
                // the wrapper's width, which diagnostics undo.
                const OPEN: &str = "module {";
                let wrapped = format!("{OPEN}{source}\n}}");
                self.parse_single(&wrapped, buffer_name).map_err(|mut d| {
                    for x in &mut d.0 {
                        if x.loc.line == 1 && x.loc.col > OPEN.len() {
                            x.loc.col -= OPEN.len();
                        }
                    }
                    d
                })
            }
            Err(d) => Err(d),
        }
    }

    fn parse_single(&self, source: &str, buffer_name: &str) -> Result<Module<'_>, Diagnostics> {
        // MLIR's lexer reads up to a NUL terminator, so both strings are passed as C strings
        // (an interior NUL simply ends the buffer early, as it would for mlir-opt).
        let source = CString::new(source.replace('\0', " ")).unwrap_or_default();
        let name = CString::new(buffer_name.replace('\0', " ")).unwrap_or_default();
        let raw = unsafe {
            mlir_sys::mlirOperationCreateParse(
                self.context.to_raw(),
                StringRef::from_c_str(&source).to_raw(),
                StringRef::from_c_str(&name).to_raw(),
            )
        };
        if raw.ptr.is_null() {
            let mut diags = self.take_diagnostics();
            if !diags.has_errors() {
                diags.error(
                    &SrcLoc {
                        file: buffer_name.to_string(),
                        ..SrcLoc::default()
                    },
                    "could not parse the input",
                );
            }
            return Err(diags);
        }
        let op = unsafe { Operation::from_raw(raw) };
        let module = if op.name().as_string_ref().as_str() == Ok("builtin.module") {
            Module::from_operation(op).ok_or_else(|| self.take_diagnostics())?
        } else {
            let module = Module::new(op.location());
            module.body().append_operation(op);
            module
        };
        self.verify_structure(&module)?;
        Ok(module)
    }

    /// Runs MLIR's own verifier (terminators, dominance, the upstream ops' invariants), as
    /// mlir-opt does after parsing; our dialect checks are `verify::verify_module`.
    pub fn verify_structure(&self, module: &Module<'_>) -> Result<(), Diagnostics> {
        self.take_diagnostics();
        if module.as_operation().verify() {
            return Ok(());
        }
        let mut d = self.take_diagnostics();
        if !d.has_errors() {
            d.error(&SrcLoc::default(), "the module does not verify");
        }
        Err(d)
    }
}

use melior::ir::BlockLike;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_error_is_located_in_the_named_file() {
        let ctx = IrContext::new();
        let err = ctx
            .parse("func.func @f() {\n  %0 = \n}\n", "model.mlir")
            .unwrap_err();
        let d = &err.0[0];
        assert_eq!(d.loc.file, "model.mlir");
        assert_eq!((d.loc.line, d.loc.col), (2, 7)); // as mlir-opt-19 reports it
        assert_eq!(d.severity, Severity::Error);
    }

    #[test]
    fn parses_generic_dnn_ops() {
        let ctx = IrContext::new();
        let src = r#"func.func @f(%a: tensor<2x3xf32>) -> tensor<2x3xf32> {
  %0 = "dnn.relu"(%a) : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return %0 : tensor<2x3xf32>
}"#;
        let m = ctx.parse(src, "x.mlir").unwrap();
        assert!(m.as_operation().verify());
        assert!(m.as_operation().to_string().contains("\"dnn.relu\""));
    }
}
