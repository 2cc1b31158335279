//! docs/dialects.md is generated from the op specs; this test keeps it true to the code.
//! Regenerate with `NNSCALER_BLESS=1 cargo test -p nnscaler-tools --test docs`.

use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::spec::OpCtx;
use nnscaler_dialects::view::{walk_nested, OpView};
use nnscaler_dialects::{dnn, nns};
use std::fmt::Write as _;

/// The op of `example`, parsed inside a function whose arguments feed its operands.
fn example_view(ir: &IrContext, example: &str) -> OpView {
    let (lhs, tys) = example.rsplit_once(" : ").unwrap();
    let ins = tys
        .split_once(" -> ")
        .unwrap()
        .0
        .trim_matches(|c| c == '(' || c == ')');
    let types: Vec<&str> = ins.split(", ").filter(|t| !t.is_empty()).collect();
    let args: Vec<String> = types
        .iter()
        .enumerate()
        .map(|(i, t)| format!("%a{i}: {t}"))
        .collect();
    let mut line = lhs.to_string();
    for i in (0..types.len()).rev() {
        line = line
            .replace(&format!("%{i})"), &format!("%a{i})"))
            .replace(&format!("%{i},"), &format!("%a{i},"));
    }
    let src = format!(
        "func.func @f({}) {{\n  {line} : {tys}\n  return\n}}\n",
        args.join(", ")
    );
    let m = ir.parse(&src, "example").unwrap();
    let mut found = None;
    walk_nested(&m.as_operation(), &mut |op| {
        let v = OpView::of(op);
        if v.name.starts_with("dnn.") || v.name.starts_with("nns.") {
            found = Some(v);
        }
    });
    found.unwrap()
}

fn generate() -> String {
    let ir = IrContext::new();
    let mut s = String::from(
        "# Dialect reference\n\n<!-- Generated from dialects/src/dnn.rs and nns.rs by tools/tests/docs.rs; do not edit. -->\n\n\
         Ops are written in MLIR generic form. Annotations use nnScaler's language (see\n\
         `dialects/src/annotation.rs`): `x` spatial, `x+` summed, `x^` frozen, numbers fixed,\n\
         `(a b)` compound (only the first part splits), `*` leading dims, `?` non-tensor, an\n\
         empty result entry a scalar. Annotations depend on ranks and attributes; the one shown\n\
         is the example's.\n\n## dnn\n\n",
    );
    for spec in dnn::SPECS {
        let v = example_view(&ir, spec.example);
        let ctx = OpCtx {
            operands: &v.operands,
            attrs: &v.attrs,
        };
        let anno = (spec.annotation)(&ctx).unwrap();
        let _ = writeln!(s, "### `{}`\n\n{}.", spec.name, spec.summary);
        if let Some(g) = spec.grad_of {
            let _ = writeln!(s, "Backward of `{g}`.");
        }
        let _ = writeln!(s, "\n- operands: {}", spec.operands.join(", "));
        let _ = writeln!(s, "- results: {}", spec.results.join(", "));
        for a in spec.attrs {
            let req = if a.required { "required" } else { "optional" };
            let _ = writeln!(
                s,
                "- attribute `{}` ({}, {req}): {}",
                a.name,
                a.kind.name(),
                a.doc
            );
        }
        let _ = writeln!(
            s,
            "- annotation: `{anno}`\n\n```mlir\n{}\n```\n",
            spec.example
        );
    }
    s.push_str(
        "## nns\n\n### `nns.mesh`\n\nDeclares a device mesh with named axes (devices row-major).\n\n\
         ```mlir\n\"nns.mesh\"() {sym_name = \"world\", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()\n```\n\n\
         ### Attributes\n\n\
         - layout: `#nns.layout<@world, dp = D(0), tp = V(sum)>` — per mesh axis R, V(sum|max) or D(dim); omitted axes are R.\n\
         - split directive: `#nns.split<b = dp, n = (dp2, tp)>` — binds annotation ids to mesh axes.\n",
    );
    for (name, doc) in nns::OP_ATTRS {
        let _ = writeln!(s, "- `{name}`: {doc}");
    }
    s.push_str("- function arguments/results: `nns.name` (string), `nns.param` (unit), `nns.layout`.\n\n### Collectives\n\n");
    for c in nns::COLLECTIVES {
        let _ = writeln!(
            s,
            "#### `{}`\n\n{}.\n\n```mlir\n{}\n```\n",
            c.name, c.summary, c.example
        );
    }
    s
}

#[test]
fn dialect_reference_is_current() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/dialects.md");
    let want = generate();
    if std::env::var_os("NNSCALER_BLESS").is_some() {
        std::fs::write(path, &want).unwrap();
        return;
    }
    let have = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        have == want,
        "docs/dialects.md is stale; run NNSCALER_BLESS=1 cargo test -p nnscaler-tools --test docs"
    );
}
