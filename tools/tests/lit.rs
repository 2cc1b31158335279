//! Runs the lit/FileCheck tests under `test/` against the binaries of this build.

#[path = "support/bins.rs"]
mod bins;

use std::path::Path;
use std::process::Command;

#[test]
fn lit_tests() {
    let bin = bins::bin_dir();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../test");
    let path = bins::path_with(&bin);
    let lit = "/usr/lib/llvm-19/build/utils/lit/lit.py";
    assert!(
        Path::new(lit).exists(),
        "lit not found at {lit}: install llvm-19-tools (see README)"
    );
    let out = Command::new("python3")
        .args([lit, "-v", "--no-progress-bar"])
        .arg(&root)
        .env("PATH", path)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("run lit");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "lit tests failed:\n{text}");
}
