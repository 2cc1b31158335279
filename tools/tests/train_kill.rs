//! Kill a training run mid-way (SIGKILL, after it has written a checkpoint), resume it from
//! that checkpoint: the rest of the loss curve equals an uninterrupted run's bit for bit,
//! and the checkpoint the kill interrupted is whole (written atomically).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_nnscaler"))
}

fn losses(path: &Path) -> std::collections::BTreeMap<u64, f64> {
    // The last line of each step wins (a killed run may have logged steps past its
    // checkpoint, which the resumed run logs again).
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|j| j["kind"] == "step")
        .map(|j| (j["step"].as_u64().unwrap(), j["loss"].as_f64().unwrap()))
        .collect()
}

#[test]
fn a_killed_run_resumes_exactly() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("train_kill");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let words = [
        "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
    ];
    let text: Vec<&str> = (0..3000u64)
        .map(|i| words[((i * 7919) % 10) as usize])
        .collect();
    std::fs::write(dir.join("text.txt"), text.join(" ")).unwrap();
    let ok = Command::new(bin())
        .args(["data", "prepare-char", "text.txt", "-o", "data"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(ok.status.success());
    let config = "[model]\npreset = \"gpt-tiny\"\nsizes = { batch = 4, heads = 4 }\n\
        [data]\ndir = \"data\"\n[optimizer]\nlr = 1e-2\nmin_lr = 1e-3\nwarmup = 2\n\
        weight_decay = 0.1\nclip = 1.0\n[train]\nsteps = 400\neval_every = 0\n\
        eval_batches = 1\nseed = 3\n";
    std::fs::write(dir.join("t.toml"), config).unwrap();
    let train = |log: &str, ckpt: &str, extra: &[&str]| {
        let mut c = Command::new(bin());
        c.args(["train", "--config", "t.toml"])
            .args(["--set", &format!("train.log=\"{log}\"")])
            .args(["--set", &format!("checkpoint.dir=\"{ckpt}\"")])
            .args(["--set", "checkpoint.every=20"])
            .args(extra)
            .current_dir(&dir);
        c
    };
    let whole = train("whole.jsonl", "ck-whole", &[]).output().unwrap();
    assert!(whole.status.success());
    // The run to kill: once its first checkpoints exist, SIGKILL it.
    let mut child = train("killed.jsonl", "ck", &[])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let ckpt = dir.join("ck/checkpoint.safetensors");
    let started = Instant::now();
    loop {
        let logged = std::fs::read_to_string(dir.join("killed.jsonl"))
            .map(|s| s.lines().count())
            .unwrap_or(0);
        if ckpt.exists() && logged >= 45 {
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the run ended ({status}) before it could be killed");
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no checkpoint after 120 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let before = losses(&dir.join("killed.jsonl"));
    assert!(
        before.len() < 400,
        "the run was killed before its end ({} steps logged)",
        before.len()
    );
    // Resume from whatever checkpoint the kill left: it must be whole.
    let resumed = train("killed.jsonl", "ck", &["--resume"]).output().unwrap();
    assert!(
        resumed.status.success(),
        "resume failed: {}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let summary = String::from_utf8_lossy(&resumed.stdout);
    assert!(summary.contains("trained steps"), "{summary}");
    let a = losses(&dir.join("whole.jsonl"));
    let b = losses(&dir.join("killed.jsonl"));
    assert_eq!(a.len(), 400);
    assert_eq!(a, b, "the resumed curve differs from the uninterrupted one");
}
