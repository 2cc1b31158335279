//! Unit tests of `train`.

use super::*;

#[test]
fn the_schedule_warms_up_then_decays_to_the_floor() {
    let s = LrSchedule {
        lr: 1e-3,
        min_lr: 1e-4,
        warmup: 10,
        decay_steps: None,
    };
    assert!((s.at(100, 0) - 1e-3 / 11.0).abs() < 1e-12);
    assert!((s.at(100, 9) - 1e-3 * 10.0 / 11.0).abs() < 1e-12);
    assert!((s.at(100, 10) - 1e-3).abs() < 1e-12);
    assert!((s.at(100, 100) - 1e-4).abs() < 1e-12);
    assert!((s.at(100, 500) - 1e-4).abs() < 1e-12);
    let mid = s.at(100, 55);
    assert!((mid - 5.5e-4).abs() < 1e-12, "{mid}");
}

#[test]
fn a_bundle_refuses_changed_files() {
    let dir = crate::host::private_dir("bundle-test").unwrap();
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        source: "t.toml".into(),
        run: Loop {
            steps: 1,
            eval_every: 0,
            eval_batches: 1,
            seed: 0,
            batch: 1,
            block: 1,
            log: None,
            curve: None,
            schedule: LrSchedule {
                lr: 1.0,
                min_lr: 0.0,
                warmup: 0,
                decay_steps: None,
            },
            checkpoint: None,
        },
        state: vec![],
        step: "step.nnsx".into(),
        eval: "eval.nnsx".into(),
        data: "data".into(),
        vocab: 2,
        devices: 1,
        start: 0,
        files: vec![],
    };
    let files = BundleFiles {
        manifest,
        files: vec![
            ("step.nnsx".into(), b"step".to_vec()),
            ("eval.nnsx".into(), b"eval".to_vec()),
        ],
    }
    .finish()
    .unwrap();
    for (p, b) in &files {
        std::fs::write(dir.join(p), b).unwrap();
    }
    let d = dir.display().to_string();
    assert!(Bundle::open(&d).is_ok());
    std::fs::write(dir.join("eval.nnsx"), b"evil").unwrap();
    let e = Bundle::open(&d).unwrap_err();
    assert!(e.contains("eval.nnsx: checksum"), "{e}");
    std::fs::write(dir.join("eval.nnsx"), b"ev").unwrap();
    let e = Bundle::open(&d).unwrap_err();
    assert!(e.contains("2 bytes, the manifest says 4"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
