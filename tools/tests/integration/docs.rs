//! docs/dialects.md is generated from the op specs; this test keeps it true to the code.
//! Regenerate with `NNSCALER_BLESS=1 cargo test -p nnscaler-tools --test integration docs::`.

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
        "# Dialect reference\n\n<!-- Generated from dialects/src/dnn/ and nns.rs by tools/tests/integration/docs.rs; do not edit. -->\n\n\
         Ops are written in MLIR generic form. Annotations use nnScaler's language (see\n\
         `dialects/src/annotation.rs`): `x` spatial, `x+` summed, `x^` frozen, numbers fixed,\n\
         `n=8` a new result dim (in no operand; splitting it leaves the operands whole),\n\
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
         - split directive: `#nns.split<b = dp, n = (dp2, tp)>` — binds annotation ids to mesh axes; `R(tp)` names axes the op is replicated over.\n",
    );
    for (name, doc) in nns::OP_ATTRS {
        let _ = writeln!(s, "- `{name}`: {doc}");
    }
    s.push_str(
        "- function arguments/results: `nns.name` (string), `nns.param` (unit), `nns.layout`.\n",
    );
    s.push_str("- functions: `nns.schedule` (string): on a training step, the pipeline schedule its plan chose (`\"1f1b\"`, from `--plan ... schedule=` or `--plan=auto`), which `--schedule` runs; on a pipeline rank's program (with `nns.pipeline`, the step's name, and `nns.pipeline_rank`), the schedule and the rank's actions (`\"1f1b: 0F0 0F1 0B0 ...\"`); `nns.localized` (unit): a per-device program.\n- modules: `nns.cluster` (string): the cluster a plan was chosen for (a preset or a TOML file, as `--plan=\"tp-search cluster=...\"` or `--plan=\"auto cluster=...\"` gave it), on which `--lower-relayouts` without `cluster=` prices the relayouts.\n\n### Collectives\n\n");
    for c in nns::COLLECTIVES {
        let _ = writeln!(
            s,
            "#### `{}`\n\n{}.\n\n```mlir\n{}\n```\n",
            c.name, c.summary, c.example
        );
    }
    s.push_str(USER_OPS);
    let _ = write!(
        s,
        "{HAND_WRITTEN_HEAD}\n```mlir\n{HAND_WRITTEN}```\n\n{HAND_WRITTEN_TAIL}"
    );
    s
}

const USER_OPS: &str = "## User-defined ops\n\n\
A function with `nns.annotation` is an op: calls of it (`func.call`) are split, propagated and\n\
lowered by its annotation like `dnn` ops (see `docs/extending.md`).\n\n\
- `nns.annotation = \"m k^, n k^ -> m n\"` (function, required): one entry per argument and\n\
  result; it must bind to the argument shapes and give the result types.\n\
- `nns.vjp = @f_vjp` (function, optional): the gradient function, taking the operands then the\n\
  results' gradients, returning one gradient per operand; without it `--autodiff` derives\n\
  `@f.vjp` from the body.\n\
- `nns.kernel = \"libmyops.so:my_gemm\"` (on a declaration): the op is the C function\n\
  `my_gemm` of that library (ABI: `runtime/include/nnscaler_kernel.h`).\n\
- `nns.torch = \"aten::softplus(x, 1, 20)\"` (function, optional): the PyTorch call the op\n\
  implements, for `nnscaler import torch --user-ops` (docs/pytorch.md): names are its tensor\n\
  operands in order, literals the values its other arguments must have.\n\
- on a call: `nns.split` / `nns.pin` / `nns.forbid`, checked against the callee's annotation.\n\n";

const HAND_WRITTEN_HEAD: &str = "## A hand-written program\n\n\
A two-layer MLP written by hand, split Megatron-style over `tp` and by batch over `dp`:\n\
`nnscaler-opt --propagate-layouts --split-tensor --lower-relayouts --localize` partitions it\n\
(no `--plan`: the directives and layouts are written).\n";

/// Checked by `the_hand_written_example_compiles` below.
const HAND_WRITTEN: &str = r#""nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 2>} : () -> ()
func.func @train(%x: tensor<8x16xf32> {nns.name = "x", nns.layout = #nns.layout<@world, dp = D(0)>},
                 %labels: tensor<8xi64> {nns.name = "labels", nns.layout = #nns.layout<@world, dp = D(0)>},
                 %w1: tensor<32x16xf32> {nns.name = "fc1.weight", nns.param, nns.layout = #nns.layout<@world, tp = D(0)>},
                 %w2: tensor<4x32xf32> {nns.name = "fc2.weight", nns.param, nns.layout = #nns.layout<@world, tp = D(1)>})
    -> (tensor<f32> {nns.name = "loss"}) {
  %h = "dnn.linear"(%x, %w1) {nns.split = #nns.split<n = tp>} : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  %a = "dnn.relu"(%h) : (tensor<8x32xf32>) -> tensor<8x32xf32>
  %logits = "dnn.linear"(%a, %w2) {nns.split = #nns.split<k = tp>} : (tensor<8x32xf32>, tensor<4x32xf32>) -> tensor<8x4xf32>
  %loss = "dnn.cross_entropy"(%logits, %labels) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>
  return %loss : tensor<f32>
}
"#;

const HAND_WRITTEN_TAIL: &str =
    "Which argument layouts a hand-written split needs: a directive fixes how its op is cut (an\n\
id bound to an axis is `D` on that axis in every operand and result that has it; results\n\
lacking a summed id are `V(sum)`), and an argument whose `nns.layout` differs from what its\n\
first user needs gets a relayout, that is communication, from `--split-tensor`. So write\n\
each argument's layout as its first user needs it: here `x` and `labels` `D(0)` on `dp` (the\n\
batch, which the ops infer from their operands), the column-parallel weight (`n = tp`, `[out,\n\
in]` storage) `D(0)` on `tp`, the row-parallel one (`k = tp`) `D(1)`. Arguments without\n\
`nns.layout` are replicated; results are replicated unless they carry one (`--autodiff`'s\n\
`grad.<p>` results end in parameter `p`'s layout). The row-parallel linear leaves `V(sum)`\n\
partial logits, which are reduced (`all_reduce` over `tp`) before the cross-entropy, as it is\n\
not linear in them.\n";

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
        "docs/dialects.md is stale; run NNSCALER_BLESS=1 cargo test -p nnscaler-tools --test integration docs::"
    );
}

#[test]
fn the_hand_written_example_compiles() {
    use nnscaler_passes::pipeline;
    use nnscaler_passes::registry::parse_pipeline;
    let ir = IrContext::new();
    let mut m = ir
        .parse(HAND_WRITTEN, "example")
        .unwrap_or_else(|d| panic!("{d}"));
    let steps =
        parse_pipeline("autodiff,propagate-layouts,split-tensor,lower-relayouts,localize").unwrap();
    pipeline::run(&ir, &mut m, &steps, &mut |_, _| {}, "example").unwrap_or_else(|d| panic!("{d}"));
    let text = m.as_operation().to_string();
    assert!(text.contains("nns.localized"), "{text}");
}
