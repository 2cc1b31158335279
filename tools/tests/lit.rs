//! Runs the lit/FileCheck tests under `test/` against the binaries of this build.

use std::path::Path;
use std::process::Command;

#[test]
fn lit_tests() {
    let bin = Path::new(env!("CARGO_BIN_EXE_nnscaler-opt"))
        .parent()
        .expect("binary directory")
        .to_path_buf();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../test");
    // nnscaler-rt is another package's binary, which `cargo test` does not rebuild for
    // this package's tests: built here, in this build's profile (quick when up to date;
    // a stale one from before a change would fail tests of new flags).
    let mut args = vec!["build", "-p", "nnscaler-rt", "--bin", "nnscaler-rt"];
    if bin.ends_with("release") {
        args.push("--release");
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(&args)
        .status()
        .expect("run cargo build");
    assert!(
        status.success(),
        "cannot build nnscaler-rt for the lit tests"
    );
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
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
