//! The documentation's commands, run as written: every ```sh block of README.md and of
//! each docs/*.md, in order, in a fresh directory per document that sees the repository's
//! tracked files (and `../shared/data`'s corpus), with this build's binaries first on
//! PATH. A block the test must not run says why on the line before its fence:
//!
//! ```text
//! <!-- docs-test: skip: installs system packages (scripts/setup does) -->
//! ```
//!
//! So a documented command that fails, or names a file no earlier step of its document
//! made, fails here; a command documented as failing, written `! command`, fails the
//! test when it succeeds. `cargo test --test docs_commands -- --nocapture` lists what ran and
//! what was skipped, with the reasons.

#[path = "support/bins.rs"]
mod bins;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The marker of a block not to run; the reason follows it.
const SKIP: &str = "<!-- docs-test: skip:";

/// A fenced shell block of a document.
#[derive(Debug)]
struct Block {
    /// 1-based line of its opening fence.
    line: usize,
    /// Its text.
    text: String,
    /// Why it is not run, if it is not.
    skip: Option<String>,
}

/// The shell blocks of markdown `text` (fences opened by ```sh, ```bash or ```shell).
fn blocks(text: &str, file: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i].trim_start();
        if let Some(lang) = l.strip_prefix("```") {
            let shell = matches!(lang.trim(), "sh" | "bash" | "shell");
            let start = i;
            i += 1;
            let mut body = Vec::new();
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                body.push(lines[i]);
                i += 1;
            }
            assert!(i < lines.len(), "{file}:{}: unclosed code fence", start + 1);
            if shell {
                let skip = start
                    .checked_sub(1)
                    .map(|p| lines[p].trim())
                    .and_then(|p| p.strip_prefix(SKIP))
                    .map(|r| {
                        let r = r.trim_end_matches("-->").trim();
                        assert!(
                            !r.is_empty(),
                            "{file}:{}: a skipped block must say why",
                            start + 1
                        );
                        r.to_string()
                    });
                out.push(Block {
                    line: start + 1,
                    text: body.join("\n"),
                    skip,
                });
            }
        }
        i += 1;
    }
    out
}

/// A documented `! command` (the shell's "this fails") made to stop the block when the
/// command succeeds: `set -e` lets a negated command through either way.
fn expect_failures(text: &str) -> String {
    text.lines()
        .map(|l| {
            let t = l.trim_start();
            if t.starts_with("! ") && !t.trim_end().ends_with('\\') {
                format!("{l} || exit 1")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

/// A fresh directory laid out as a checkout beside `../shared`: `main/` holds a link to
/// every tracked top-level entry of the repository (never its untracked outputs, which
/// the commands would write through), `shared/data/tinyshakespeare/input.txt` the corpus
/// (a generated stand-in where `../shared` has none).
fn scratch(name: &str) -> PathBuf {
    let root = root();
    let dir = std::env::temp_dir().join(format!("nnscaler-docs-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let main = dir.join("main");
    std::fs::create_dir_all(&main).expect("scratch directory");
    let out = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(&root)
        .output()
        .expect("run git ls-files");
    assert!(out.status.success(), "git ls-files failed in {root:?}");
    let mut top: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .split('\0')
        .filter(|p| !p.is_empty())
        .map(|p| p.split('/').next().unwrap_or(p).to_string())
        .collect();
    top.sort();
    top.dedup();
    for t in top {
        std::os::unix::fs::symlink(root.join(&t), main.join(&t)).expect("link");
    }
    let corpus = dir.join("shared/data/tinyshakespeare");
    std::fs::create_dir_all(&corpus).expect("corpus directory");
    let real = root.join("../shared/data/tinyshakespeare/input.txt");
    if real.exists() {
        std::os::unix::fs::symlink(real, corpus.join("input.txt")).expect("link corpus");
    } else {
        // A stand-in of the same kind (English text, 65 symbols at most), so the
        // commands run where the shared data is absent; said in the test's output.
        let words = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\nYou are all resolved rather to die than to famish?\n";
        std::fs::write(corpus.join("input.txt"), words.repeat(2000)).expect("stand-in");
        println!("(no ../shared/data/tinyshakespeare: a generated stand-in corpus)");
    }
    dir
}

/// Runs the shell blocks of `doc` (relative to the repository root) in order.
fn run_document(doc: &str) {
    let file = root().join(doc);
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{doc}: {e}"));
    let blocks = blocks(&text, doc);
    let bin = bins::bin_dir();
    let name = doc.replace(['/', '.'], "-");
    let dir = scratch(&name);
    let main = dir.join("main");
    for b in &blocks {
        if let Some(why) = &b.skip {
            println!("skipped {doc}:{}: {why}", b.line);
            continue;
        }
        let script = format!("set -euo pipefail\n{}\n", expect_failures(&b.text));
        let out = Command::new("bash")
            .arg("-c")
            .arg(&script)
            .current_dir(&main)
            .env("PATH", bins::path_with(&bin))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .expect("run bash");
        let commands = b
            .text
            .lines()
            .filter(|l| {
                let l = l.trim();
                !l.is_empty() && !l.starts_with('#')
            })
            .filter(|l| !l.trim_end().ends_with('\\'))
            .count();
        assert!(
            out.status.success(),
            "{doc}:{}: the block failed ({}):\n{}\n--- stdout\n{}--- stderr\n{}",
            b.line,
            out.status,
            b.text,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!("ran {doc}:{}: {commands} command(s)", b.line);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_document_is_checked() {
    // README.md and every docs/*.md have a test below (a new document needs one).
    let mut docs: Vec<String> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .filter_map(Result::ok)
        .map(|e| format!("docs/{}", e.file_name().to_string_lossy()))
        .filter(|n| n.ends_with(".md"))
        .collect();
    docs.sort();
    assert_eq!(
        docs,
        [
            "docs/architecture.md",
            "docs/cost-validation.md",
            "docs/dialects.md",
            "docs/extending.md",
            "docs/gpu.md",
            "docs/history.md",
            "docs/pytorch.md",
            "docs/testing.md"
        ]
    );
}

#[test]
fn documented_failures_must_fail() {
    assert_eq!(
        expect_failures("a\n! nnscaler check-op x @y\nb"),
        "a\n! nnscaler check-op x @y || exit 1\nb"
    );
    let run = |t: &str| {
        Command::new("bash")
            .arg("-c")
            .arg(format!("set -euo pipefail\n{}\n", expect_failures(t)))
            .status()
            .unwrap()
            .success()
    };
    assert!(run("! false"));
    assert!(!run("! true"));
}

#[test]
fn skipped_blocks_say_why() {
    let b = blocks(
        "a\n<!-- docs-test: skip: needs a GPU -->\n```sh\nnvidia-smi\n```\n```sh\necho hi\n```\n```mlir\nx\n```\n",
        "t.md",
    );
    assert_eq!(b.len(), 2);
    assert_eq!(b[0].skip.as_deref(), Some("needs a GPU"));
    assert_eq!(
        (b[1].line, b[1].text.as_str(), b[1].skip.is_none()),
        (6, "echo hi", true)
    );
}

#[test]
fn readme() {
    run_document("README.md");
}

#[test]
fn docs_architecture() {
    run_document("docs/architecture.md");
}

#[test]
fn docs_dialects() {
    run_document("docs/dialects.md");
}

#[test]
fn docs_extending() {
    run_document("docs/extending.md");
}

#[test]
fn docs_gpu() {
    run_document("docs/gpu.md");
}

#[test]
fn docs_cost_validation() {
    run_document("docs/cost-validation.md");
}

#[test]
fn docs_history() {
    run_document("docs/history.md");
}

#[test]
fn docs_pytorch() {
    run_document("docs/pytorch.md");
}

#[test]
fn docs_testing() {
    run_document("docs/testing.md");
}
