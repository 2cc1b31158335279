//! Shared pieces of the nnscaler command-line tools.

pub mod expected;
pub mod run;

use std::io::Write;
use std::path::Path;

/// Writes `data` to `path` atomically (a temporary file in the same directory, then a
/// rename), so a failed run never leaves a half-written output; `-` writes to stdout.
pub fn write_output(path: &str, data: &str) -> Result<(), String> {
    write_output_bytes(path, data.as_bytes())
}

/// [`write_output`] for binary data.
pub fn write_output_bytes(path: &str, data: &[u8]) -> Result<(), String> {
    if path == "-" {
        let mut out = std::io::stdout().lock();
        return out
            .write_all(data)
            .map_err(|e| format!("cannot write to stdout: {e}"));
    }
    let p = Path::new(path);
    let dir = p
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        p.file_name().and_then(|n| n.to_str()).unwrap_or("out"),
        std::process::id()
    ));
    std::fs::write(&tmp, data).map_err(|e| format!("cannot write '{path}': {e}"))?;
    std::fs::rename(&tmp, p).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write '{path}': {e}")
    })
}

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
