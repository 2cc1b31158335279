//! Helpers shared by the oracle tests: finding a Python with PyTorch, random tensors.
#![allow(dead_code)]

use nnscaler_runtime::rng;
use nnscaler_runtime::tensor::Tensor;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A Python interpreter that can `import torch`: `$NNSCALER_PYTHON`, else `/usr/bin/python3`
/// (Debian's python3-torch), else `python3`. Panics with instructions when none can: the
/// oracle tests are part of the suite, and `.ci/run` installs python3-torch.
pub fn python() -> PathBuf {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(p) = std::env::var("NNSCALER_PYTHON") {
        candidates.push(p.into());
    }
    candidates.push("/usr/bin/python3".into());
    candidates.push("python3".into());
    for c in &candidates {
        let ok = Command::new(c)
            .args(["-c", "import torch, numpy"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return c.clone();
        }
    }
    panic!(
        "no Python with PyTorch found (tried {candidates:?}); install Debian's python3-torch \
         (apt-get install --no-install-recommends python3-torch) or set NNSCALER_PYTHON"
    );
}

/// Runs `script` (under test/oracle/) with `args`, panicking with its output on failure.
pub fn run_oracle(script: &str, args: &[&Path]) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let path = root.join("test/oracle").join(script);
    let out = Command::new(python())
        .arg(&path)
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        // Running the tests must not dirty the tree with __pycache__.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "{script} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A scratch directory under the target dir, emptied first.
pub fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// Standard-normal f32 tensor from `(seed, stream)`.
pub fn normal(shape: &[usize], seed: u64, stream: u64) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(
        shape,
        (0..n as u64)
            .map(|i| rng::normal(seed, stream, i) as f32)
            .collect(),
    )
}
