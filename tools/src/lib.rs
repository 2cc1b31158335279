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
