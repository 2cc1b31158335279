//! `nnscaler-rt` is what is copied to a GPU machine alone: its dependency tree holds no
//! MLIR or LLVM (with the CUDA backend too), so the binary needs neither.

#[test]
fn the_runtime_depends_on_no_mlir_or_llvm() {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "tree",
            "--offline",
            "-p",
            "nnscaler-rt",
            "--features",
            "cuda",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        tree.contains("cudarc"),
        "the tree is not nnscaler-rt's: {tree}"
    );
    for heavy in [
        "melior",
        "mlir-sys",
        "inkwell",
        "llvm-sys",
        "nnscaler-dialects",
    ] {
        assert!(
            !tree.lines().any(|l| l.starts_with(&format!("{heavy} "))),
            "nnscaler-rt depends on {heavy}:\n{tree}"
        );
    }
}
