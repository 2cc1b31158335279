//! The directory of this build's binaries, with `nnscaler-rt` built in it: shared by the
//! test crates that run the binaries as a user would (lit, the documentation's commands).

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>`, holding `nnscaler`, `nnscaler-opt` and (built here, once per test
/// process) `nnscaler-rt`.
pub fn bin_dir() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(build).clone()
}

fn build() -> PathBuf {
    let bin = Path::new(env!("CARGO_BIN_EXE_nnscaler-opt"))
        .parent()
        .expect("binary directory")
        .to_path_buf();
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
    assert!(status.success(), "cannot build nnscaler-rt for the tests");
    bin
}

/// `PATH` with `dir` first.
pub fn path_with(dir: &Path) -> String {
    format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}
