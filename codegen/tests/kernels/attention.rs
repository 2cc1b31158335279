//! Attention kernels against float64: tiled, kept statistics (the tensor cores' in
//! `tensor_cores.rs`).

use super::*;

/// Attention in float64, the exact function both kernel forms approximate: `q [b, h, s,
/// d]`, `k [b, g, t, d]`, `v [b, g, t, e]`; with `dout`, the gradients `dq, dk, dv`, else
/// the output.
pub(super) fn attention_f64(
    shapes: (&[usize], &[usize], usize),
    scale: f64,
    causal: bool,
    ops: &[&[f32]],
    grad: bool,
) -> Vec<Vec<f64>> {
    let ((qs, ks, e), x) = (shapes, |v: &[f32]| -> Vec<f64> {
        v.iter().map(|&a| f64::from(a)).collect()
    });
    let [b, h, s, d] = [qs[0], qs[1], qs[2], qs[3]];
    let (g, t) = (ks[1], ks[2]);
    let (dout, q, k, v) = if grad {
        (x(ops[0]), x(ops[1]), x(ops[2]), x(ops[3]))
    } else {
        (Vec::new(), x(ops[0]), x(ops[1]), x(ops[2]))
    };
    let mut out = vec![0.0; b * h * s * e];
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    for bi in 0..b {
        for hi in 0..h {
            let kh = bi * g + hi / (h / g);
            for i in 0..s {
                let qr = ((bi * h + hi) * s + i) * d;
                let lim = if causal { (i + 1).min(t) } else { t };
                let sc: Vec<f64> = (0..lim)
                    .map(|j| {
                        let kr = (kh * t + j) * d;
                        scale * (0..d).map(|c| q[qr + c] * k[kr + c]).sum::<f64>()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|y| (y - m).exp()).sum();
                let p: Vec<f64> = sc.iter().map(|y| (y - m).exp() / z).collect();
                let or = ((bi * h + hi) * s + i) * e;
                if !grad {
                    for (j, pj) in p.iter().enumerate() {
                        for c in 0..e {
                            out[or + c] += pj * v[(kh * t + j) * e + c];
                        }
                    }
                    continue;
                }
                let dp: Vec<f64> = (0..lim)
                    .map(|j| (0..e).map(|c| dout[or + c] * v[(kh * t + j) * e + c]).sum())
                    .collect();
                let dsum: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for j in 0..lim {
                    let ds = p[j] * (dp[j] - dsum) * scale;
                    let (kr, vr) = ((kh * t + j) * d, (kh * t + j) * e);
                    for c in 0..d {
                        dq[qr + c] += ds * k[kr + c];
                        dk[kr + c] += ds * q[qr + c];
                    }
                    for c in 0..e {
                        dv[vr + c] += p[j] * dout[or + c];
                    }
                }
            }
        }
    }
    if grad {
        vec![dq, dk, dv]
    } else {
        vec![out]
    }
}

/// The largest difference between `got` and the float64 `want`, relative to `want`'s
/// largest magnitude; a non-finite value fails.
pub(super) fn error_f64(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .enumerate()
        .map(|(i, (&g, &w))| {
            assert!(g.is_finite(), "element {i}: {g}");
            (f64::from(g) - w).abs() / scale
        })
        .fold(0.0, f64::max)
}

/// The tiled attention kernels (FlashAttention-2: an online softmax) and the row kernels
/// (the CPU reference's two-pass softmax, op for op) against attention in float64:
/// forward and backward, causal or not, grouped heads, queries and keys in several tiles
/// with short last ones, more queries than keys, long key sequences, rows up to the
/// widest tiled ones. Both within 1e-5 of the tensor's scale, and the tiles no further
/// from float64 than a few times the row kernels: the tolerance is the algorithm's
/// rounding, not a bug's.
#[test]
pub(super) fn tiled_attention_matches_float64() {
    use nnscaler_codegen::kernel::{lower_attention, AttnForm};
    let causal = attrs(&[("causal", AttrValue::Bool(true))]);
    let shapes: Vec<(Vec<i64>, Vec<i64>, Attrs)> = vec![
        (vec![2, 4, 9, 8], vec![2, 2, 9, 8], causal.clone()),
        (vec![1, 3, 130, 16], vec![1, 3, 130, 16], causal.clone()),
        (vec![1, 2, 65, 4], vec![1, 1, 140, 4], Attrs::new()),
        (vec![1, 2, 140, 4], vec![1, 2, 33, 4], causal.clone()),
        (vec![1, 2, 100, 64], vec![1, 2, 100, 64], causal.clone()),
        (vec![1, 1, 70, 128], vec![1, 1, 70, 128], causal.clone()),
        (vec![1, 4, 20, 8], vec![1, 2, 1100, 8], Attrs::new()),
        (vec![1, 1, 1040, 4], vec![1, 1, 1040, 4], causal.clone()),
        (
            vec![1, 2, 40, 8],
            vec![1, 2, 40, 8],
            attrs(&[
                ("causal", AttrValue::Bool(true)),
                ("scale", AttrValue::Float(0.3)),
            ]),
        ),
    ];
    let mut kernels = Vec::new();
    let mut runs = Vec::new();
    for (c, (qs, ks, a)) in shapes.iter().enumerate() {
        let (q, kv) = (ty(qs), ty(ks));
        for (grad, tys) in [
            (false, vec![q.clone(), kv.clone(), kv.clone()]),
            (true, vec![q.clone(), q.clone(), kv.clone(), kv.clone()]),
        ] {
            let op = if grad {
                "dnn.attention_grad"
            } else {
                "dnn.attention"
            };
            let outs: Vec<Buf> = if grad {
                vec![Buf::of(&q), Buf::of(&kv), Buf::of(&kv)]
            } else {
                let mut o = qs.clone();
                o[3] = ks[3];
                vec![Buf::of(&ty(&o))]
            };
            let ins: Vec<Buf> = tys.iter().map(Buf::of).collect();
            let operands: Vec<Tensor> = tys
                .iter()
                .enumerate()
                .map(|(i, t)| operand(t, (c * 10 + i) as u64, -3.0, 3.0, 11))
                .collect();
            let mut pair = Vec::new();
            for form in [AttnForm::Rows, AttnForm::Tiles] {
                let name = format!("t{c}_{}_{form:?}", u8::from(grad));
                let l = lower_attention(&name, op, a, &ins, &outs, Some(form)).unwrap();
                kernels.extend(l.kernels.clone());
                pair.push(l);
            }
            runs.push((qs.clone(), ks.clone(), a.clone(), grad, pair, operands));
        }
    }
    let host = HostKernels::new(&kernels).unwrap();
    let (mut worst_rows, mut worst_tiles) = (0.0f64, 0.0f64);
    for (qs, ks, a, grad, pair, operands) in &runs {
        let what = format!("{} {qs:?} {ks:?}", if *grad { "grad" } else { "forward" });
        let ins: Vec<Data> = operands.iter().map(data).collect();
        let ins: Vec<&Data> = ins.iter().collect();
        let rows = host.run_lowered(&pair[0], &ins).unwrap();
        let tiles = host.run_lowered(&pair[1], &ins).unwrap();
        let us = |v: &[i64]| v.iter().map(|&x| x as usize).collect::<Vec<_>>();
        let scale = match a.get("scale") {
            Some(AttrValue::Float(f)) => *f as f32,
            _ => 1.0 / (qs[3] as f32).sqrt(),
        };
        let opsv: Vec<&[f32]> = operands.iter().map(|t| t.f().unwrap()).collect();
        let want = attention_f64(
            (&us(qs), &us(ks), ks[3] as usize),
            f64::from(scale),
            a.contains_key("causal"),
            &opsv,
            *grad,
        );
        assert_eq!(rows.len(), want.len(), "{what}: result count");
        assert_eq!(tiles.len(), want.len(), "{what}: result count");
        for (k, w) in want.iter().enumerate() {
            let er = error_f64(rows[k].f32().unwrap(), w);
            let et = error_f64(tiles[k].f32().unwrap(), w);
            assert!(
                er <= 1e-5,
                "{what}: result {k}: row kernels {er:.2e} from float64"
            );
            assert!(
                et <= 1e-5,
                "{what}: result {k}: tiles {et:.2e} from float64"
            );
            assert!(
                et <= 4.0 * er.max(1e-7),
                "{what}: result {k}: tiles {et:.2e}, rows {er:.2e} from float64"
            );
            worst_rows = worst_rows.max(er);
            worst_tiles = worst_tiles.max(et);
        }
    }
    println!(
        "codegen: attention on {} cases, from float64 at most: row kernels {worst_rows:.2e}, tiles (online softmax) {worst_tiles:.2e}",
        runs.len()
    );
}

/// An attention's forward and its backward in one program: the forward keeps its row
/// statistics and output for the backward (`Attn::saved`), which then skips the forward's
/// pass. Against attention in float64 (forward and gradients) on the shapes of
/// `tiled_attention_matches_float64` that pair (causal or not, grouped heads, short last
/// tiles, long keys, a scale), and the kept form is what the program holds.
#[test]
pub(super) fn kept_attention_statistics_match_float64() {
    let shapes: Vec<(Vec<i64>, Vec<i64>, &str)> = vec![
        (vec![2, 4, 9, 8], vec![2, 2, 9, 8], "{causal = true}"),
        (vec![1, 3, 130, 16], vec![1, 3, 130, 16], "{causal = true}"),
        (vec![1, 2, 65, 4], vec![1, 1, 140, 4], "{}"),
        (vec![1, 2, 100, 64], vec![1, 2, 100, 64], "{causal = true}"),
        (vec![1, 4, 20, 8], vec![1, 2, 1100, 8], "{}"),
        (
            vec![1, 2, 40, 8],
            vec![1, 2, 40, 8],
            "{causal = true, scale = 3.000000e-01 : f64}",
        ),
    ];
    let t = |s: &[i64]| {
        format!(
            "tensor<{}xf32>",
            s.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join("x")
        )
    };
    let mut worst = 0.0f64;
    for (c, (qs, ks, a)) in shapes.iter().enumerate() {
        let (q, kv) = (t(qs), t(ks));
        let src = format!(
            r#"func.func @f(%q: {q} {{nns.name = "q"}}, %k: {kv} {{nns.name = "k"}}, %v: {kv} {{nns.name = "v"}}, %g: {q} {{nns.name = "g"}}) -> ({q}, {q}, {kv}, {kv}) {{
  %o = "dnn.attention"(%q, %k, %v) {a} : ({q}, {kv}, {kv}) -> {q}
  %dq, %dk, %dv = "dnn.attention_grad"(%g, %q, %k, %v) {a} : ({q}, {q}, {kv}, {kv}) -> ({q}, {kv}, {kv})
  return %o, %dq, %dk, %dv : {q}, {q}, {kv}, {kv}
}}"#
        );
        let ir = IrContext::new();
        let m = ir
            .parse(&src, "kept.mlir")
            .unwrap_or_else(|d| panic!("{d:?}"));
        let g = Graph::all_in(&m).remove(0).unwrap();
        let p = nnscaler_codegen::compile(&g, None).unwrap();
        let kept = p
            .kernels
            .iter()
            .filter(|k| matches!(&k.body, Body::AttnTiles(x) | Body::AttnTilesBack(x) if x.saved))
            .count();
        assert_eq!(
            kept, 2,
            "case {c}: the forward and the backward keep statistics"
        );
        let tys = [ty(qs), ty(ks), ty(ks), ty(qs)];
        let ops: Vec<Tensor> = tys
            .iter()
            .enumerate()
            .map(|(i, tt)| operand(tt, (c * 10 + i) as u64, -3.0, 3.0, 11))
            .collect();
        let host = HostKernels::new(&p.kernels).unwrap();
        let got = host
            .run_program(&p, ops.iter().map(data).collect())
            .unwrap();
        let us = |v: &[i64]| v.iter().map(|&x| x as usize).collect::<Vec<_>>();
        let scale = if a.contains("scale") {
            0.3
        } else {
            1.0 / (qs[3] as f64).sqrt()
        };
        let causal = a.contains("causal");
        let f: Vec<&[f32]> = ops.iter().map(|x| x.f().unwrap()).collect();
        let dims = (&us(qs)[..], &us(ks)[..], ks[3] as usize);
        let fwd = attention_f64(dims, scale, causal, &f[..3], false);
        let back = attention_f64(dims, scale, causal, &[f[3], f[0], f[1], f[2]], true);
        for (k, w) in fwd.iter().chain(&back).enumerate() {
            let e = error_f64(got[k].f32().unwrap(), w);
            assert!(e <= 1e-5, "case {c}: result {k}: {e:.2e} from float64");
            worst = worst.max(e);
        }
    }
    println!(
        "codegen: kept attention statistics on {} cases, from float64 at most {worst:.2e}",
        shapes.len()
    );
}

/// bf16 bits of `x` (ties to even), and back.
pub(super) fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}
pub(super) fn from_bf16(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}
