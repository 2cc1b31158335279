//! Module import cycles in every crate of the workspace, found with petgraph's strongly
//! connected components over the `crate::` paths each module's code names (comments left
//! out; a module directory's files count as the module, except a directory that only
//! groups modules, such as passes' `transforms/` and `planner/`, whose modules count one
//! by one, `transforms::plan`). The architecture issue asks for
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

/// The `.rs` files of a module (`a` or, inside a grouping directory, `a::b`): `src/a.rs`
/// (`src/a/b.rs`) and everything under `src/a/` (`src/a/b/`).
fn files_of(src: &Path, name: &str) -> Vec<PathBuf> {
    let rel: PathBuf = name.split("::").collect();
    let mut out = Vec::new();
    let file = src.join(&rel).with_extension("rs");
    if file.exists() {
        out.push(file);
    }
    let mut dirs = vec![src.join(&rel)];
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

/// Whether module directory `dir` only groups modules: its `mod.rs` declares modules and
/// nothing else.
fn grouping(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join("mod.rs")) else {
        return false;
    };
    let code = code(&text);
    let lines: Vec<&str> = code
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("#"))
        .collect();
    !lines.is_empty()
        && lines
            .iter()
            .all(|l| l.starts_with("pub mod ") || l.starts_with("mod "))
}

/// The modules of directory `dir` (`src` or a grouping directory): its `.rs` files and
/// directories, named with `prefix`.
fn modules_in(dir: &Path, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("src").flatten() {
        let p = e.path();
        let stem = p
            .file_stem()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default();
        let is_mod = (p.is_dir() && stem != "bin")
            || (p.extension().is_some_and(|x| x == "rs")
                && !["lib", "main", "mod"].contains(&stem.as_str()));
        if !is_mod || (p.is_file() && dir.join(&stem).is_dir()) {
            continue;
        }
        let name = format!("{prefix}{stem}");
        if p.is_dir() && prefix.is_empty() && grouping(&p) {
            out.extend(modules_in(&p, &format!("{name}::")));
        } else {
            out.push(name);
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

/// The modules named by `crate::NAME` paths and `use crate::{NAME::...}` groups (inside a
/// grouping directory `crate::GROUP::NAME` and `crate::GROUP::{NAME, ...}`), and by
/// `super::NAME` in a module `GROUP::M`'s own file (`super` is the group there).
fn named(text: &str, modules: &BTreeSet<String>, own: Option<&str>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let groups: BTreeSet<String> = modules
        .iter()
        .filter_map(|m| m.split_once("::").map(|(g, _)| g.to_string()))
        .collect();
    // The module a path names, from its first segment on: `a`, or `g::b` in a group.
    let resolve = |path: &str, out: &mut BTreeSet<String>| {
        let first = ident(path);
        if groups.contains(&first) {
            let rest = path[first.len()..].trim_start();
            let Some(rest) = rest.strip_prefix("::") else {
                return;
            };
            let rest = rest.trim_start();
            let items: Vec<&str> = match rest.strip_prefix('{') {
                Some(group) => group[..group.find('}').unwrap_or(group.len())]
                    .split(',')
                    .collect(),
                None => vec![rest],
            };
            for item in items {
                let m = format!("{first}::{}", ident(item.trim()));
                if modules.contains(&m) {
                    out.insert(m);
                }
            }
        } else if modules.contains(&first) {
            out.insert(first);
        }
    };
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let body = &group[..group.find('}').unwrap_or(group.len())];
            for item in body.split(',') {
                resolve(item.trim(), &mut out);
            }
        } else {
            resolve(rest, &mut out);
        }
    }
    if let Some((group, _)) = own.and_then(|m| m.split_once("::")) {
        for (i, _) in text.match_indices("super::") {
            let rest = &text[i + "super::".len()..];
            let at = format!("{group}::{rest}");
            resolve(&at, &mut out);
        }
    }
    out
}

/// The import graph of crate `dir`'s modules and its cycles (largest first).
fn cycles(dir: &Path) -> Vec<Vec<String>> {
    let src = dir.join("src");
    let modules: BTreeSet<String> = modules_in(&src, "").into_iter().collect();
    let mut g = DiGraph::<String, ()>::new();
    let nodes: BTreeMap<String, _> = modules
        .iter()
        .map(|m| (m.clone(), g.add_node(m.clone())))
        .collect();
    for m in &modules {
        let mut text = String::new();
        let mut own = String::new();
        let rel: PathBuf = m.split("::").collect();
        for f in files_of(&src, m) {
            let c = code(&std::fs::read_to_string(&f).expect("source"));
            // `super` is the group in the module's own file (`g/m.rs`, `g/m/mod.rs`).
            if f == src.join(&rel).with_extension("rs") || f == src.join(&rel).join("mod.rs") {
                own.push_str(&c);
                own.push('\n');
            }
            text.push_str(&c);
            text.push('\n');
        }
        let mut to_all = named(&text, &modules, None);
        to_all.extend(named(&own, &modules, Some(m)));
        for to in to_all {
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
        named(&text, &modules, None),
        ["a", "b", "c"].iter().map(|s| s.to_string()).collect()
    );
    let text = code("/// see [`crate::c`]\nuse other::crate_x;");
    assert!(named(&text, &modules, None).is_empty());
    // Inside a grouping directory: the group's modules one by one.
    let modules: BTreeSet<String> = ["g::a", "g::b", "g::c", "h"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let text = code("use crate::g::{a, b::X};\nuse crate::h;\nuse super::c::Y;");
    assert_eq!(
        named(&text, &modules, None),
        ["g::a", "g::b", "h"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );
    assert!(named(&text, &modules, Some("g::a")).contains("g::c"));
}
