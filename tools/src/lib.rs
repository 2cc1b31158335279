//! Shared pieces of the nnscaler command-line tools.

pub mod calibrate;
pub mod check_op;
pub mod cli;
pub mod compile;
pub mod data;
pub mod emit_torch;
pub mod expected;
pub mod fuzz;
pub mod output;
pub mod parse_guard;
pub mod plan;
pub mod run;
pub mod schedule_report;
pub mod torch_import;
pub mod train;

pub use output::{write_one, Outputs};

/// Reads `path` (`-` for stdin), naming the path in the error.
pub fn read_input(path: &str) -> Result<String, String> {
    if path == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .map_err(|e| format!("cannot read stdin: {e}"))?;
        return Ok(s);
    }
    std::fs::read_to_string(path).map_err(|e| format!("cannot read '{path}': {e}"))
}

/// The front of every command that takes a module: reads `path` ([`read_input`]), checks
/// that MLIR can parse it without crashing ([`parse_guard`]), parses it into `ir` and
/// verifies it. Returns the source (to render later diagnostics with) and the module;
/// errors are rendered with the source, at most `error_limit` of them.
pub fn load_module<'c>(
    ir: &'c nnscaler_dialects::context::IrContext,
    path: &str,
    error_limit: usize,
) -> Result<(String, melior::ir::Module<'c>), String> {
    let source = read_input(path)?;
    let render = |d: nnscaler_dialects::diag::Diagnostics| {
        d.in_file(path).render_limited(Some(&source), error_limit)
    };
    parse_guard::check_parses(&source, path).map_err(render)?;
    let module = ir.parse(&source, path).map_err(render)?;
    let d = nnscaler_dialects::verify::verify_module(&module);
    if d.has_errors() {
        return Err(render(d));
    }
    Ok((source, module))
}
