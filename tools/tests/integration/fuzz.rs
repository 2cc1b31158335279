//! The fuzz test (see `nnscaler_tools::fuzz`): fixed seeds and a bounded number of cases,
//! so it takes about half a minute. Longer campaigns: `target/debug/nnscaler-fuzz`.

use nnscaler_tools::fuzz::{self, Config};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[test]
fn fuzz_the_tools() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let corpus = fuzz::mlir_files(&root.join("test"));
    // nnscaler-rt built in this build's profile (the shared helper of the test crates).
    let bin = crate::bins::bin_dir();
    let cfg = Config {
        opt: PathBuf::from(env!("CARGO_BIN_EXE_nnscaler-opt")),
        cli: PathBuf::from(env!("CARGO_BIN_EXE_nnscaler")),
        work: root.join("target/fuzz-test"),
        corpus,
        seed: 20261130,
        ir_cases: 600,
        run_cases: 200,
        diff_cases: 20,
        artifact_cases: 150,
        rt: bin.join("nnscaler-rt"),
        // A slow machine runs fewer cases rather than a longer test.
        deadline: Some(Duration::from_secs(60)),
        timeout: Duration::from_secs(60),
    };
    let report = fuzz::run(&cfg, &mut |_, _| {}).expect("the fuzzer starts");
    println!("{}", report.summary());
    let text: Vec<String> = report
        .failures
        .iter()
        .map(|f| format!("{}\n  {}", f.case, f.problem.replace('\n', "\n  ")))
        .collect();
    assert!(
        report.failures.is_empty(),
        "{} fuzz cases broke the rules:\n{}",
        report.failures.len(),
        text.join("\n\n")
    );
    assert!(
        report.ran[0] >= 50 && report.ran[1] >= 15 && report.ran[2] >= 2 && report.ran[3] >= 15,
        "{}",
        report.summary()
    );
    // Every part exercised both outcomes.
    assert!(
        report.succeeded[0] > 0
            && report.succeeded[1] > 0
            && report.succeeded[2] > 0
            && report.succeeded[3] > 0,
        "{}",
        report.summary()
    );
}
