//! Links the mlir-opt-19 plugin (plugin/build-so.sh) from this build's staticlib, checks that
//! it carries no second copy of MLIR, and runs the lit tests of test/plugin/ with it.
//!
//! The lit tests also use `nnscaler` and `nnscaler-opt` from the same target directory: run
//! them as part of the workspace (`cargo test --workspace --tests --benches`, as CI does).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The newest `libnnscaler_plugin*.a` next to this test or one directory up.
fn staticlib(deps: &Path) -> PathBuf {
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
    for dir in [deps, deps.parent().unwrap_or(deps)] {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.starts_with("libnnscaler_plugin") && name.ends_with(".a") {
                if let Ok(t) = e.metadata().and_then(|m| m.modified()) {
                    found.push((t, p));
                }
            }
        }
    }
    found.sort();
    found
        .pop()
        .map(|(_, p)| p)
        .expect("libnnscaler_plugin.a was not built")
}

#[test]
fn the_plugin_runs_our_passes_inside_mlir_opt() {
    let exe = std::env::current_exe().expect("test path");
    let deps = exe.parent().expect("deps dir");
    let bin = deps.parent().expect("target dir");
    for tool in ["nnscaler", "nnscaler-opt"] {
        assert!(
            bin.join(tool).exists(),
            "{tool} is not built in {}: run the workspace's tests (cargo test --workspace --tests --benches)",
            bin.display()
        );
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let so = Path::new(env!("CARGO_TARGET_TMPDIR")).join("libnnscaler_mlir_opt_plugin.so");
    let out = Command::new(root.join("plugin/build-so.sh"))
        .arg(staticlib(deps))
        .arg(&so)
        .output()
        .expect("run plugin/build-so.sh");
    assert!(
        out.status.success(),
        "linking the plugin failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // No second copy of MLIR: the plugin defines no MLIR library code (only inline
    // functions of MLIR's headers, as weak symbols); its references to MLIR resolve to the
    // mlir-opt that loads it.
    let nm = Command::new("nm")
        .args(["-D", "--defined-only", "--demangle"])
        .arg(&so)
        .output()
        .expect("run nm");
    let own: Vec<String> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter(|l| l.contains(" T mlir::"))
        .map(str::to_string)
        .collect();
    assert!(own.is_empty(), "the plugin defines MLIR code: {own:?}");

    let lit = "/usr/lib/llvm-19/build/utils/lit/lit.py";
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("python3")
        .args([lit, "-v", "--no-progress-bar"])
        .arg(root.join("test/plugin"))
        .env("PATH", path)
        .env("NNSCALER_PLUGIN", &so)
        .output()
        .expect("run lit");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "plugin lit tests failed:\n{text}");
    assert!(
        text.contains("Passed: 1"),
        "the plugin test did not run:\n{text}"
    );
}
