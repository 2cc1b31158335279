//! What values a function's argument may hold, read from the ops that use it: integer ids
//! below the rows of the table an embedding looks them up in, or below the classes of the
//! logits they are the targets of; AdamW's step, which counts from 1.
//!
//! `nnscaler data random` draws inputs inside these domains, `nnscaler compile` records
//! them in the artifact, and `nnscaler-rt` refuses inputs outside them as the reference
//! runtime's kernels do. The search follows a value through reshapes, `nns` collectives
//! (they move values, never change them) and calls (into the callee's argument); on a
//! localized function a table or logits split over mesh axes (`row_axes`, `offset_axes`)
//! counts the whole dim, so the domain is the one-device program's.

use crate::graph::{Graph, ValueId};
use crate::types::AttrValue;

/// The values an argument may hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Domain {
    /// Integer ids in `[0, n)`.
    Below(i64),
    /// Numbers at least this (AdamW's step: at least 1).
    AtLeast(f64),
}

/// The domain of argument `arg` of `g`, or `None` when no op constrains it.
pub fn of_arg(g: &Graph, arg: usize) -> Option<Domain> {
    let v = g.args.get(arg)?.value;
    let mut found = Vec::new();
    uses(g, v, &axis_sizes(g, &[]), 0, &mut found);
    // Local views can only see less of a dim than the whole: the largest bound is the
    // one-device program's.
    let below = found
        .iter()
        .filter_map(|d| match d {
            Domain::Below(n) => Some(*n),
            Domain::AtLeast(_) => None,
        })
        .max();
    match below {
        Some(n) => Some(Domain::Below(n)),
        None => found.first().copied(),
    }
}

/// The mesh axes `g` was localized for (`nns.localized`), else `outer`'s.
fn axis_sizes(g: &Graph, outer: &[(String, i64)]) -> Vec<(String, i64)> {
    match g.func_attrs.get("nns.localized").and_then(AttrValue::axes) {
        Some(Ok(axes)) => axes.iter().map(|a| (a.name.clone(), a.size)).collect(),
        _ => outer.to_vec(),
    }
}

/// The product of the sizes of the axes op attribute `key` lists (1 without it).
fn split_by(attrs: &crate::types::Attrs, key: &str, sizes: &[(String, i64)]) -> i64 {
    match attrs.get(key) {
        Some(AttrValue::Strs(axes)) => axes
            .iter()
            .map(|a| {
                sizes
                    .iter()
                    .find(|(n, _)| n == a)
                    .map_or(1, |(_, s)| (*s).max(1))
            })
            .fold(1i64, i64::saturating_mul),
        _ => 1,
    }
}

/// Collects into `found` what the uses of `v` (and of the values it flows into
/// unchanged) say about it.
fn uses(g: &Graph, v: ValueId, sizes: &[(String, i64)], depth: usize, found: &mut Vec<Domain>) {
    let mut alias = vec![false; g.values.len()];
    alias[v] = true;
    for n in &g.nodes {
        for (i, &x) in n.inputs.iter().enumerate() {
            if !alias[x] {
                continue;
            }
            let last = |x: ValueId| g.values[x].shape.last().copied();
            let first = |x: ValueId| g.values[x].shape.first().copied();
            match (n.op.as_str(), i) {
                ("dnn.reshape", 0) => alias[n.outputs[0]] = true,
                (op, _) if op.starts_with("nns.") => {
                    for &o in &n.outputs {
                        alias[o] = true;
                    }
                }
                ("func.call", _) if depth < 64 => {
                    let callee = crate::userop::callee(&n.attrs).and_then(|c| g.callees.get(c));
                    if let Some(f) = callee {
                        if let Some(a) = f.args.get(i) {
                            uses(f, a.value, &axis_sizes(f, sizes), depth + 1, found);
                        }
                    }
                }
                ("dnn.embedding", 0) => {
                    if let Some(rows) = n.inputs.get(1).and_then(|&t| first(t)) {
                        let parts = split_by(&n.attrs, "row_axes", sizes);
                        found.push(Domain::Below(rows.saturating_mul(parts)));
                    }
                }
                ("dnn.cross_entropy" | "dnn.pick", 1)
                | ("dnn.cross_entropy_grad" | "dnn.softmax_xent_grad", 2) => {
                    let logits = n.inputs[if i == 1 { 0 } else { 1 }];
                    if let Some(classes) = last(logits) {
                        let parts = split_by(&n.attrs, "offset_axes", sizes);
                        found.push(Domain::Below(classes.saturating_mul(parts)));
                    }
                }
                ("dnn.adamw", 5) => found.push(Domain::AtLeast(1.0)),
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::IrContext;

    fn graphs(src: &str) -> Vec<Graph> {
        let ir = IrContext::new();
        let m = ir.parse(src, "t.mlir").expect("parses");
        let all: Vec<Graph> = Graph::all_in(&m).into_iter().map(|g| g.unwrap()).collect();
        all.iter()
            .map(|g| {
                let mut g = g.clone();
                g.link(&all);
                g
            })
            .collect()
    }

    #[test]
    fn ids_are_bounded_by_the_table_and_the_classes() {
        let g = &graphs(
            r#"func.func @f(%ids: tensor<2x4xi64>, %t: tensor<10x3xf32>, %y: tensor<8xi64>, %z: tensor<2x4xf32>) -> tensor<f32> {
  %e = "dnn.embedding"(%ids, %t) : (tensor<2x4xi64>, tensor<10x3xf32>) -> tensor<2x4x3xf32>
  %r = "dnn.reshape"(%e) {shape = array<i64: 8, 3>} : (tensor<2x4x3xf32>) -> tensor<8x3xf32>
  %l = "dnn.cross_entropy"(%r, %y) : (tensor<8x3xf32>, tensor<8xi64>) -> tensor<f32>
  return %l : tensor<f32>
}"#,
        )[0];
        assert_eq!(of_arg(g, 0), Some(Domain::Below(10)));
        assert_eq!(of_arg(g, 2), Some(Domain::Below(3)));
        assert_eq!(of_arg(g, 1), None);
        assert_eq!(of_arg(g, 3), None);
    }

    #[test]
    fn a_split_table_counts_its_whole_rows_and_calls_are_followed() {
        let all = graphs(
            r#"func.func private @frag(%ids: tensor<2x4xi64>, %t: tensor<5x3xf32>) -> tensor<2x4x3xf32>
    attributes {nns.localized = #nns.axes<dp = 2, tp = 2>} {
  %e = "dnn.embedding"(%ids, %t) {row_axes = ["tp"]} : (tensor<2x4xi64>, tensor<5x3xf32>) -> tensor<2x4x3xf32>
  return %e : tensor<2x4x3xf32>
}
func.func @f(%ids: tensor<2x4xi64>, %t: tensor<5x3xf32>) -> tensor<2x4x3xf32>
    attributes {nns.localized = #nns.axes<dp = 2, tp = 2>} {
  %e = func.call @frag(%ids, %t) : (tensor<2x4xi64>, tensor<5x3xf32>) -> tensor<2x4x3xf32>
  return %e : tensor<2x4x3xf32>
}"#,
        );
        assert_eq!(of_arg(&all[1], 0), Some(Domain::Below(10)));
    }
}
