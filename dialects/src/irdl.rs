//! The `dnn` and `nns` dialects as IRDL, generated from the op tables ([`crate::dnn::SPECS`],
//! [`crate::nns::COLLECTIVES`]), so that upstream `mlir-opt-19 --irdl-file=...` checks op
//! names, operand and result counts and required attributes without
//! `--allow-unregistered-dialect`.
//!
//! The generated files are committed under `dialects/irdl/` (a test checks that
//! regenerating them changes nothing; `nnscaler-opt --print-irdl=dnn` prints one).
//!
//! What IRDL in MLIR 19 cannot say, and so these files do not: optional attributes (only
//! required ones are listed; MLIR 19's `irdl.attributes` makes every listed one required),
//! shape rules (the annotation), and the `#nns.*` attributes, whose custom syntax
//! (`#nns.layout<@world, dp = D(0)>`) is not a list of attributes or types. IR that carries
//! them (after `--plan`) is checked with the `dnn` file only and
//! `--allow-unregistered-dialect` for `nns`. And a constraint variable binds the first type
//! it matches, a variadic group sharing one variable: `dnn.concat` operands and `dnn.split`
//! results of different shapes (valid IR) are refused by the IRDL check
//! (`test/dnn/irdl.mlir` shows it); nnscaler's verifier accepts them.

use crate::dnn::SPECS;
use crate::nns::COLLECTIVES;
use crate::spec::{AttrKind, OpSpec};
use std::fmt::Write;

/// The IRDL constraint for an attribute kind, as ops (the last defines `%name`).
fn attr_constraint(kind: AttrKind, name: &str) -> String {
    let base = |b: &str| format!("%{name} = irdl.base \"{b}\"");
    match kind {
        AttrKind::Int | AttrKind::Bool => base("#builtin.integer"),
        AttrKind::Str => base("#builtin.string"),
        AttrKind::Strs => base("#builtin.array"),
        AttrKind::Float => format!(
            "%{name}_f = irdl.base \"#builtin.float\"\n    %{name}_i = irdl.base \"#builtin.integer\"\n    %{name} = irdl.any_of(%{name}_f, %{name}_i)"
        ),
        // `array<i64: 1, 2>`, or an array of integers as older IR writes it.
        AttrKind::Ints => format!(
            "%{name}_d = irdl.base \"#builtin.dense_array\"\n    %{name}_a = irdl.base \"#builtin.array\"\n    %{name} = irdl.any_of(%{name}_d, %{name}_a)"
        ),
    }
}

/// How many results the op's example has (`%1:2 = ...` has two).
fn example_results(example: &str) -> usize {
    let lhs = example.split('=').next().unwrap_or("").trim();
    match lhs.split_once(':') {
        Some((_, n)) => n.trim().parse().unwrap_or(1),
        None => usize::from(lhs.starts_with('%')),
    }
}

/// Whether the op's results vary in number (one name, more results in the example).
fn variadic_results(s: &OpSpec) -> bool {
    s.results.len() == 1 && example_results(s.example) > 1
}

/// Writes one operation: tensors for operands and results (each its own constraint
/// variable, so they need not be the same type), and the required attributes.
struct Op<'a> {
    short: &'a str,
    summary: &'a str,
    operands: &'a [&'a str],
    /// Trailing operands that may be left out.
    optional: usize,
    /// The last operand repeats.
    variadic: bool,
    results: &'a [&'a str],
    variadic_result: bool,
    /// Required attributes.
    attrs: &'a [(&'a str, AttrKind)],
}

fn operation(out: &mut String, op: &Op<'_>) {
    let Op {
        short,
        summary,
        operands,
        optional,
        variadic,
        results,
        variadic_result,
        attrs,
    } = *op;
    let _ = writeln!(out, "  // {summary}");
    let _ = writeln!(out, "  irdl.operation @{short} {{");
    let mut ops = Vec::new();
    for (i, name) in operands.iter().enumerate() {
        let _ = writeln!(out, "    %{name} = irdl.base \"!builtin.tensor\"");
        let last = i + 1 == operands.len();
        let prefix = if variadic && last {
            "variadic "
        } else if i >= operands.len() - optional {
            "optional "
        } else {
            ""
        };
        ops.push(format!("{prefix}%{name}"));
    }
    let _ = writeln!(out, "    irdl.operands({})", ops.join(", "));
    let mut res = Vec::new();
    for name in results {
        let _ = writeln!(out, "    %r_{name} = irdl.base \"!builtin.tensor\"");
        let prefix = if variadic_result { "variadic " } else { "" };
        res.push(format!("{prefix}%r_{name}"));
    }
    let _ = writeln!(out, "    irdl.results({})", res.join(", "));
    if !attrs.is_empty() {
        let mut entries = Vec::new();
        for (name, kind) in attrs {
            let var = format!("a_{name}");
            let _ = writeln!(out, "    {}", attr_constraint(*kind, &var));
            entries.push(format!("\"{name}\" = %{var}"));
        }
        let _ = writeln!(out, "    irdl.attributes {{{}}}", entries.join(", "));
    }
    let _ = writeln!(out, "  }}");
}

const HEADER: &str = "// Generated from nnscaler's op tables by `nnscaler-opt --print-irdl`; do not edit.\n// Check IR with: mlir-opt-19 --irdl-file=THIS_FILE input.mlir\n";

/// The `dnn` dialect in IRDL (for IR that also holds `#nns` attributes, which then needs
/// `--allow-unregistered-dialect`).
pub fn dnn() -> String {
    format!("{HEADER}{}", dnn_dialect())
}

/// Both dialects in one file (`mlir-opt-19` reads a single `--irdl-file`).
pub fn all() -> String {
    format!("{HEADER}{}{}", dnn_dialect(), nns_dialect())
}

fn dnn_dialect() -> String {
    let mut out = String::new();
    out.push_str("irdl.dialect @dnn {\n");
    for s in SPECS {
        let short = s.name.strip_prefix("dnn.").unwrap_or(s.name);
        let attrs: Vec<(&str, AttrKind)> = s
            .attrs
            .iter()
            .filter(|a| a.required)
            .map(|a| (a.name, a.kind))
            .collect();
        operation(
            &mut out,
            &Op {
                short,
                summary: s.summary,
                operands: s.operands,
                optional: s.optional,
                variadic: s.variadic,
                results: s.results,
                variadic_result: variadic_results(s),
                attrs: &attrs,
            },
        );
    }
    out.push_str("}\n");
    out
}

/// The `nns` dialect's ops in IRDL (the mesh, the collectives and relayout). Their
/// attributes of `#nns` syntax (`to`, `axes` of the mesh) are not listed (see the module
/// docs).
fn nns_dialect() -> String {
    let mut out = String::new();
    out.push_str("irdl.dialect @nns {\n");
    out.push_str("  // declares a device mesh\n  irdl.operation @mesh {\n    irdl.operands()\n    irdl.results()\n    %a_sym_name = irdl.base \"#builtin.string\"\n    irdl.attributes {\"sym_name\" = %a_sym_name}\n  }\n");
    for c in COLLECTIVES {
        let short = c.name.strip_prefix("nns.").unwrap_or(c.name);
        let mut attrs: Vec<(&str, AttrKind)> = Vec::new();
        match short {
            "transfer" => {
                attrs.push(("from", AttrKind::Int));
                attrs.push(("to", AttrKind::Int));
            }
            "relayout" => {}
            "send" | "recv" => {
                attrs.push(("axis", AttrKind::Str));
                attrs.push(("peer", AttrKind::Int));
                attrs.push(("tag", AttrKind::Str));
            }
            "microbatch" => {
                attrs.push(("axes", AttrKind::Strs));
                attrs.push(("index", AttrKind::Int));
            }
            _ => attrs.push(("axes", AttrKind::Strs)),
        }
        attrs.extend(c.dim_attrs.iter().map(|d| (*d, AttrKind::Int)));
        operation(
            &mut out,
            &Op {
                short,
                summary: c.summary,
                operands: &["x"][..c.arity.0],
                optional: 0,
                variadic: false,
                results: &["y"][..c.arity.1],
                variadic_result: false,
                attrs: &attrs,
            },
        );
    }
    out.push_str("}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed(name: &str) -> String {
        let path = format!("{}/irdl/{name}.irdl.mlir", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// The committed IRDL files are what the tables generate; `NNSCALER_BLESS=1` writes
    /// them (as `nnscaler-opt --print-irdl=dnn|all` would).
    #[test]
    fn the_committed_files_are_what_the_tables_generate() {
        for (name, text, flag) in [("dnn", dnn(), "dnn"), ("nnscaler", all(), "all")] {
            let path = format!("{}/irdl/{name}.irdl.mlir", env!("CARGO_MANIFEST_DIR"));
            if std::env::var_os("NNSCALER_BLESS").is_some() {
                std::fs::write(&path, &text).unwrap_or_else(|e| panic!("{path}: {e}"));
                continue;
            }
            assert!(
                committed(name) == text,
                "dialects/irdl/{name}.irdl.mlir is stale: nnscaler-opt --print-irdl={flag} > dialects/irdl/{name}.irdl.mlir (or NNSCALER_BLESS=1 cargo test -p nnscaler-dialects --lib irdl)"
            );
        }
    }

    #[test]
    fn example_result_counts() {
        assert_eq!(example_results(r#"%1:2 = "dnn.split"(%0)"#), 2);
        assert_eq!(example_results(r#"%1 = "dnn.relu"(%0)"#), 1);
        assert_eq!(example_results(r#""nns.mesh"() {}"#), 0);
    }
}
