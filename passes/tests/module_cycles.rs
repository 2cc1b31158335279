//! Module import cycles in every crate of the workspace, found with petgraph's strongly
//! connected components over the `crate::` paths each module's code names (comments left
//! out; a module directory's files count as the module). The architecture issue asks for
//! none in `passes` and none over 3 modules elsewhere; until then this is a ratchet: no
//! crate's largest cycle may grow past what it is (`LIMITS`), and the cycles are printed
//! (`cargo test -p nnscaler-passes --test module_cycles -- --nocapture`).

use petgraph::algo::tarjan_scc;
use petgraph::graph::DiGraph;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each crate's largest import cycle allowed (modules), today's sizes: lower them as cycles
/// are broken, never raise them.
const LIMITS: &[(&str, usize)] = &[
    ("dialects", 2),
    ("passes", 1),
    ("runtime", 2),
    ("codegen", 1),
    ("rt", 3),
    ("tools", 1),
    ("frontends", 1),
    ("plugin", 1),
];

/// The `.rs` files of a module: `src/NAME.rs` and everything under `src/NAME/`.
fn files_of(src: &Path, name: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let file = src.join(format!("{name}.rs"));
    if file.exists() {
        out.push(file);
    }
    let mut dirs = vec![src.join(name)];
    while let Some(d) = dirs.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out
}

/// Code without its comments (line comments; doc links name modules without importing
/// them).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules named by `crate::NAME` paths and `use crate::{NAME::...}` groups.
fn named(text: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let body = &group[..group.find('}').unwrap_or(group.len())];
            for item in body.split(',') {
                let m = ident(item.trim());
                if modules.contains(&m) {
                    out.insert(m);
                }
            }
        } else {
            let m = ident(rest);
            if modules.contains(&m) {
                out.insert(m);
            }
        }
    }
    out
}

/// The import graph of crate `dir`'s modules and its cycles (largest first).
fn cycles(dir: &Path) -> Vec<Vec<String>> {
    let src = dir.join("src");
    let mut modules = BTreeSet::new();
    for e in std::fs::read_dir(&src).expect("src").flatten() {
        let p = e.path();
        let stem = p
            .file_stem()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default();
        let is_mod = (p.is_dir() && stem != "bin")
            || (p.extension().is_some_and(|x| x == "rs") && stem != "lib" && stem != "main");
        if is_mod {
            modules.insert(stem);
        }
    }
    let mut g = DiGraph::<String, ()>::new();
    let nodes: BTreeMap<String, _> = modules
        .iter()
        .map(|m| (m.clone(), g.add_node(m.clone())))
        .collect();
    for m in &modules {
        let mut text = String::new();
        for f in files_of(&src, m) {
            text.push_str(&code(&std::fs::read_to_string(f).expect("source")));
            text.push('\n');
        }
        for to in named(&text, &modules) {
            if &to != m {
                g.add_edge(nodes[m], nodes[&to], ());
            }
        }
    }
    let mut out: Vec<Vec<String>> = tarjan_scc(&g)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut v: Vec<String> = c.iter().map(|&n| g[n].clone()).collect();
            v.sort();
            v
        })
        .collect();
    out.sort_by_key(|c| std::cmp::Reverse(c.len()));
    out
}

#[test]
fn no_crate_grows_its_import_cycles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut report = Vec::new();
    for &(name, limit) in LIMITS {
        let c = cycles(&root.join(name));
        let largest = c.first().map_or(1, Vec::len);
        report.push(format!("{name}: largest {largest} (limit {limit}): {c:?}"));
        assert!(
            largest <= limit,
            "{name}: an import cycle of {largest} modules, more than the {limit} allowed: {c:?}"
        );
    }
    for line in &report {
        println!("module cycles: {line}");
    }
}

/// The scanner finds a cycle it is shown, and ignores comments and other crates' paths.
#[test]
fn the_scanner_reads_paths_not_comments() {
    let modules: BTreeSet<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    let text = code(
        "use crate::{a::X, b};\n// crate::c is only mentioned\nlet y = crate::c::f(); // crate::a",
    );
    assert_eq!(
        named(&text, &modules),
        ["a", "b", "c"].iter().map(|s| s.to_string()).collect()
    );
    let text = code("/// see [`crate::c`]\nuse other::crate_x;");
    assert!(named(&text, &modules).is_empty());
}
