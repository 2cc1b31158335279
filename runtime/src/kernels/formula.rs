//! The CPU kernel of every elementwise op that declares a scalar formula
//! ([`nnscaler_dialects::spec::Traits::scalar`]): the op's formula, written once generic over
//! [`nnscaler_dialects::scalar::Scalar`], in its f32 instantiation (the code generator reads
//! the same function as a tree). An op with a formula needs no kernel of its own.
//!
//! What this module adds is broadcasting: the output is walked in runs along its innermost
//! dims (those that every operand walks contiguously, or not at all, merged into one), in
//! blocks of [`BLOCK`] elements; an operand that stays on one element through a run is
//! repeated into a block, and the formula's loop runs over the block's slices.

use super::Ctx;
use crate::tensor::{numel, strides, Tensor};
use nnscaler_dialects::dnn;
use nnscaler_dialects::scalar::Formula;

/// Elements evaluated together (the repeated operands' blocks are this long).
const BLOCK: usize = 4096;

/// The kernel of every op with a scalar formula: the formula of `c.op` (for its attributes),
/// over its operands broadcast against each other as numpy does.
pub(super) fn formula(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let f = dnn::spec(c.op)
        .and_then(|s| s.traits.scalar)
        .ok_or_else(|| format!("'{}' has no scalar formula", c.op))?;
    if x.len() != f.arity() {
        return Err(format!(
            "the formula reads {} operand(s), the op has {}",
            f.arity(),
            x.len()
        ));
    }
    let data = x.iter().map(|t| t.f()).collect::<Result<Vec<_>, _>>()?;
    let shapes: Vec<&[usize]> = x.iter().map(|t| t.shape.as_slice()).collect();
    let out = broadcast_shape(&shapes)?;
    let v = evaluate(f, c.attrs, &data, &shapes, &out)?;
    Ok(vec![Tensor::f32(&out, v)])
}

/// The shape operands of `shapes` broadcast to (numpy's rule: right-aligned, each dim equal
/// or 1).
pub(super) fn broadcast_shape(shapes: &[&[usize]]) -> Result<Vec<usize>, String> {
    let rank = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = vec![1usize; rank];
    for s in shapes {
        for (i, &d) in s.iter().enumerate() {
            let o = &mut out[rank - s.len() + i];
            if *o == 1 {
                *o = d;
            } else if d != 1 && d != *o {
                return Err(format!("operand shapes {shapes:?} do not broadcast"));
            }
        }
    }
    Ok(out)
}

/// Strides of `shape` (right-aligned in `out`'s rank) with 0 on broadcast dims.
pub(super) fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let s = strides(shape);
    let off = out.len() - shape.len();
    (0..out.len())
        .map(|i| {
            if i < off || shape[i - off] == 1 {
                0
            } else {
                s[i - off]
            }
        })
        .collect()
}

/// `out` with each operand's strides in it (0 on broadcast dims), unit dims dropped and
/// each run of dims that every operand walks as one (each stride the next one's times that
/// dim, or 0) merged into one dim: `[3, 12, 24] + [12, 24]` becomes 3 rows of 288
/// contiguous elements in the first and the same 288 in the second.
pub(super) fn coalesce(out: &[usize], st: &[Vec<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut o: Vec<usize> = Vec::new();
    let mut s: Vec<Vec<usize>> = vec![Vec::new(); st.len()];
    for d in (0..out.len()).rev() {
        if out[d] == 1 {
            continue;
        }
        let merge = o.last().is_some_and(|&n| {
            st.iter()
                .zip(&s)
                .all(|(sk, merged)| sk[d] == merged.last().copied().unwrap_or(0) * n)
        });
        if merge {
            *o.last_mut().expect("a dim to merge with") *= out[d];
        } else {
            o.push(out[d]);
            for (merged, sk) in s.iter_mut().zip(st) {
                merged.push(sk[d]);
            }
        }
    }
    o.reverse();
    for merged in &mut s {
        merged.reverse();
    }
    (o, s)
}

/// Calls `f(out_index, offsets, n, inner_strides)` for each run of `n` elements of `out`
/// along its (coalesced) last dim, in order: `offsets[k]` is where operand `k`'s run starts,
/// `inner_strides[k]` its step along the run.
pub(super) fn for_each_run(
    out: &[usize],
    st: &[Vec<usize>],
    mut f: impl FnMut(usize, &[usize], usize, &[usize]),
) {
    let (out, st) = coalesce(out, st);
    let r = out.len();
    if r == 0 {
        f(0, &vec![0; st.len()], 1, &vec![0; st.len()]);
        return;
    }
    let inner = out[r - 1];
    let steps: Vec<usize> = st.iter().map(|s| s[r - 1]).collect();
    let rows = numel(&out[..r - 1]);
    let mut idx = vec![0usize; r - 1];
    let mut off = vec![0usize; st.len()];
    for row in 0..rows {
        f(row * inner, &off, inner, &steps);
        // Advance the odometer over the leading dims.
        for d in (0..r - 1).rev() {
            idx[d] += 1;
            for (o, s) in off.iter_mut().zip(&st) {
                *o += s[d];
            }
            if idx[d] < out[d] {
                break;
            }
            for (o, s) in off.iter_mut().zip(&st) {
                *o -= s[d] * out[d];
            }
            idx[d] = 0;
        }
    }
}

/// Formula `f` (of an op with attributes `a`) over the elements of `out`, a shape the
/// operands `data` of shapes `shapes` broadcast to.
pub(super) fn evaluate(
    f: &dyn Formula,
    a: &nnscaler_dialects::types::Attrs,
    data: &[&[f32]],
    shapes: &[&[usize]],
    out: &[usize],
) -> Result<Vec<f32>, String> {
    let mut v = vec![0.0f32; numel(out)];
    if v.is_empty() {
        return Ok(v);
    }
    let st: Vec<Vec<usize>> = shapes.iter().map(|s| broadcast_strides(s, out)).collect();
    // An operand's block where it does not step through the run one element at a time:
    // one value repeated (a broadcast dim), or gathered (none today: a run's innermost dim
    // is contiguous in every operand that has it).
    let mut blocks: Vec<Vec<f32>> = vec![Vec::new(); data.len()];
    let mut result = Ok(());
    for_each_run(out, &st, |o, off, n, steps| {
        let mut j = 0;
        while j < n && result.is_ok() {
            let m = BLOCK.min(n - j);
            for (k, b) in blocks.iter_mut().enumerate() {
                match steps[k] {
                    1 => {}
                    0 => {
                        b.clear();
                        b.resize(m, data[k][off[k]]);
                    }
                    s => {
                        b.clear();
                        b.extend((0..m).map(|i| data[k][off[k] + (j + i) * s]));
                    }
                }
            }
            let ins: Vec<&[f32]> = (0..data.len())
                .map(|k| match steps[k] {
                    1 => &data[k][off[k] + j..off[k] + j + m],
                    _ => blocks[k].as_slice(),
                })
                .collect();
            result = f.eval(a, &ins, &mut v[o + j..o + j + m]);
            j += m;
        }
    });
    result.map(|()| v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnscaler_dialects::types::{AttrValue, Attrs};

    /// Element `i` of `out` read from `shape` by the broadcasting rules, index by index.
    fn naive_offset(i: usize, shape: &[usize], out: &[usize]) -> usize {
        let (so, s) = (strides(out), strides(shape));
        let off = out.len() - shape.len();
        (0..out.len())
            .filter(|&d| d >= off && shape[d - off] != 1)
            .map(|d| (i / so[d] % out[d]) * s[d - off])
            .sum()
    }

    /// Values from -4 to 4 in steps of 1/250, exact zeros among them.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(2_654_435_761) >> 8;
                (h % 2001) as f32 / 250.0 - 4.0
            })
            .collect()
    }

    /// Every op with a formula, in each of its forms, over every broadcasting path
    /// (suffixes, per-row scalars, broadcasts on both sides, inner broadcast dims, unit dims,
    /// scalars, empty tensors, runs longer than a block) equals its formula's tree evaluated
    /// element by element in f32 with the index-by-index broadcasting rule, bit for bit: the
    /// kernel is the formula, and the broadcasting is numpy's.
    #[test]
    fn every_formula_op_equals_its_tree_element_by_element() {
        let binary: &[&[&[usize]]] = &[
            &[&[2, 3, 4], &[3, 4]],
            &[&[2, 3, 4], &[2, 3, 1]],
            &[&[2, 1, 4], &[2, 3, 4]],
            &[&[4, 1], &[4, 5]],
            &[&[2, 1, 4], &[3, 1]],
            &[&[1, 4], &[3, 1]],
            &[&[3, 1, 5, 1], &[1, 2, 5, 6]],
            &[&[2, 3, 4], &[]],
            &[&[], &[2, 3]],
            &[&[1, 1], &[1]],
            &[&[2, 3], &[2, 3]],
            &[&[2, 1, 3], &[1, 3]],
            &[&[0, 3], &[3]],
            &[&[3, 5000], &[5000]],
            &[&[9000], &[1]],
        ];
        let unary: &[&[&[usize]]] = &[&[&[2, 3, 4]], &[&[]], &[&[0]], &[&[9000]]];
        let mut forms = Vec::new();
        for s in nnscaler_dialects::dnn::SPECS {
            let Some(f) = s.traits.scalar else { continue };
            let attrs: Vec<Attrs> = match s.name {
                "dnn.gelu" | "dnn.gelu_grad" => ["none", "tanh"]
                    .iter()
                    .map(|v| [("approximate".to_string(), AttrValue::Str(v.to_string()))].into())
                    .collect(),
                "dnn.cast" => ["f32", "bf16"]
                    .iter()
                    .map(|v| [("to".to_string(), AttrValue::Str(v.to_string()))].into())
                    .collect(),
                _ => vec![Attrs::new()],
            };
            for a in attrs {
                forms.push((s.name, f, a));
            }
        }
        assert!(forms.len() >= 19, "{} forms", forms.len());
        for (name, f, a) in &forms {
            let tree = f.expr(a).unwrap();
            let cases = if f.arity() == 1 { unary } else { binary };
            for shapes in cases {
                let out = broadcast_shape(shapes).unwrap();
                let data: Vec<Vec<f32>> = shapes
                    .iter()
                    .enumerate()
                    .map(|(k, s)| values(numel(s), k as u32 * 977 + 13))
                    .collect();
                let refs: Vec<&[f32]> = data.iter().map(Vec::as_slice).collect();
                let got = evaluate(*f, a, &refs, shapes, &out).unwrap();
                let want: Vec<f32> = (0..numel(&out))
                    .map(|i| {
                        let ins: Vec<f32> = shapes
                            .iter()
                            .enumerate()
                            .map(|(k, s)| data[k][naive_offset(i, s, &out)])
                            .collect();
                        tree.eval(&ins)
                    })
                    .collect();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{name} {a:?} over {shapes:?}");
            }
        }
    }

    #[test]
    fn coalescing_merges_the_runs_every_operand_walks() {
        let out = [2, 3, 4];
        let st = |shapes: &[&[usize]]| -> Vec<Vec<usize>> {
            shapes.iter().map(|s| broadcast_strides(s, &out)).collect()
        };
        assert_eq!(
            coalesce(&out, &st(&[&[2, 3, 4], &[3, 4]])),
            (vec![2, 12], vec![vec![12, 1], vec![0, 1]])
        );
        assert_eq!(
            coalesce(&out, &st(&[&[2, 3, 4], &[2, 3, 1]])),
            (vec![6, 4], vec![vec![4, 1], vec![1, 0]])
        );
        assert_eq!(
            coalesce(&out, &st(&[&[2, 3, 4], &[]])),
            (vec![24], vec![vec![1], vec![0]])
        );
    }

    #[test]
    fn shapes_that_do_not_broadcast_and_wrong_attributes_are_refused() {
        let e = broadcast_shape(&[&[2, 3], &[4, 3]]).unwrap_err();
        assert!(e.contains("do not broadcast"), "{e}");
        assert_eq!(broadcast_shape(&[&[2, 1], &[3]]).unwrap(), vec![2, 3]);
        let cast = nnscaler_dialects::dnn::spec("dnn.cast")
            .and_then(|s| s.traits.scalar)
            .unwrap();
        let a: Attrs = [("to".to_string(), AttrValue::Str("f16".into()))].into();
        let e = evaluate(cast, &a, &[&[1.0]], &[&[1]], &[1]).unwrap_err();
        assert!(e.contains("'to'"), "{e}");
    }
}
