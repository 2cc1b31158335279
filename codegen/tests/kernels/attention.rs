//! Attention kernels against float64: tiled, kept statistics, tensor cores (forward and backward).

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

/// The tensor-core forward (`Body::AttnMma`: `mma.sync` products, emulated on the host
/// from the lanes' fragments by the PTX layouts) on 2-byte bf16 operands, against
/// attention in float64 of the same bf16 values, beside the f32-register tiles on the same
/// buffers: causal or not, grouped heads, short last query and key tiles, more keys than
/// queries, widths 16 to 128 (32-key tiles where 64 do not fit), a scale, and the kept
/// statistics `[max, 1/sum]`. The outputs are bf16, so both are a rounding of bf16 (2^-8
/// relative) from float64; the tensor cores also round `P` to bf16 before its product:
/// held to two roundings, 2^-7 (the issue's "a few bf16 rounding steps").
#[test]
pub(super) fn mma_attention_matches_float64() {
    use nnscaler_codegen::kernel::{lower_attention_kept, AttnForm};
    let causal = attrs(&[("causal", AttrValue::Bool(true))]);
    let shapes: Vec<(Vec<i64>, Vec<i64>, Attrs)> = vec![
        (vec![2, 4, 9, 16], vec![2, 2, 9, 16], causal.clone()),
        (vec![1, 3, 130, 64], vec![1, 3, 130, 64], causal.clone()),
        (vec![1, 2, 65, 32], vec![1, 1, 140, 32], Attrs::new()),
        (vec![1, 2, 140, 16], vec![1, 2, 33, 16], causal.clone()),
        (vec![1, 1, 70, 128], vec![1, 1, 70, 128], causal.clone()),
        (
            vec![1, 2, 40, 16],
            vec![1, 2, 40, 16],
            attrs(&[
                ("causal", AttrValue::Bool(true)),
                ("scale", AttrValue::Float(0.3)),
            ]),
        ),
    ];
    let bf = |s: &[i64]| Buf {
        shape: s.iter().map(|&x| x as usize).collect(),
        elt: Elt::Bf16,
    };
    let mut kernels = Vec::new();
    let mut runs = Vec::new();
    for (c, (qs, ks, a)) in shapes.iter().enumerate() {
        let ins = vec![bf(qs), bf(ks), bf(ks)];
        let outs = vec![bf(qs)];
        let mut pair = Vec::new();
        for form in [AttnForm::Tiles, AttnForm::Mma] {
            let name = format!("m{c}_{form:?}");
            let l = lower_attention_kept(&name, "dnn.attention", a, &ins, &outs, Some(form), true)
                .unwrap();
            let body = &l.kernels[0].body;
            match form {
                AttnForm::Mma => assert!(matches!(body, Body::AttnMma(x) if x.saved)),
                _ => assert!(matches!(body, Body::AttnTiles(_))),
            }
            kernels.extend(l.kernels.clone());
            pair.push(l);
        }
        // The default for bf16 operands of these widths is the tensor cores.
        let dflt = nnscaler_codegen::kernel::lower_attention(
            &format!("m{c}_default"),
            "dnn.attention",
            a,
            &ins,
            &outs,
            None,
        )
        .unwrap();
        assert!(matches!(dflt.kernels[0].body, Body::AttnMma(_)));
        let ops: Vec<Vec<u16>> = [qs, ks, ks]
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n = s.iter().product::<i64>() as usize;
                values(n, (c * 10 + i) as u64, -3.0, 3.0)
                    .into_iter()
                    .map(to_bf16)
                    .collect()
            })
            .collect();
        runs.push((qs.clone(), ks.clone(), a.clone(), pair, ops));
    }
    let host = HostKernels::new(&kernels).unwrap();
    let (mut worst_tiles, mut worst_mma) = (0.0f64, 0.0f64);
    for (qs, ks, a, pair, ops) in &runs {
        let what = format!("{qs:?} {ks:?} {a:?}");
        let ins: Vec<Data> = ops.iter().map(|v| Data::Bf16(v.clone())).collect();
        let ins: Vec<&Data> = ins.iter().collect();
        let us = |v: &[i64]| v.iter().map(|&x| x as usize).collect::<Vec<_>>();
        let scale = match a.get("scale") {
            Some(AttrValue::Float(f)) => f64::from(*f as f32),
            _ => f64::from(1.0 / (qs[3] as f32).sqrt()),
        };
        let causal = a.contains_key("causal");
        let f: Vec<Vec<f32>> = ops
            .iter()
            .map(|v| v.iter().map(|&h| from_bf16(h)).collect())
            .collect();
        let fr: Vec<&[f32]> = f.iter().map(|v| v.as_slice()).collect();
        let (qd, kd) = (us(qs), us(ks));
        let want = attention_f64((&qd, &kd, kd[3]), scale, causal, &fr, false).remove(0);
        // The row statistics in float64: [max of the scaled scores, 1 / sum of exp].
        let (b, h, s, d) = (qd[0], qd[1], qd[2], qd[3]);
        let (g, t) = (kd[1], kd[2]);
        let mut stats = Vec::new();
        for bi in 0..b {
            for hi in 0..h {
                let kh = bi * g + hi / (h / g);
                for i in 0..s {
                    let lim = if causal { (i + 1).min(t) } else { t };
                    let qr = ((bi * h + hi) * s + i) * d;
                    let sc: Vec<f64> = (0..lim)
                        .map(|j| {
                            let kr = (kh * t + j) * d;
                            scale
                                * (0..d)
                                    .map(|c| f64::from(fr[0][qr + c]) * f64::from(fr[1][kr + c]))
                                    .sum::<f64>()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|y| (y - m).exp()).sum();
                    stats.extend([m, 1.0 / z]);
                }
            }
        }
        let mut errs = Vec::new();
        for (form, l) in ["tiles", "tensor cores"].iter().zip(pair) {
            // The kernel itself: its statistics are a temporary of the lowered op.
            let got = host.run(&l.kernels[0].name, &ins).unwrap();
            assert_eq!(got.len(), 2, "{what} {form}: the output and the statistics");
            let out: Vec<f32> = match &got[0] {
                Data::Bf16(v) => v.iter().map(|&x| from_bf16(x)).collect(),
                other => panic!("{what} {form}: a bf16 output, not {other:?}"),
            };
            let e = error_f64(&out, &want);
            // The maximum exactly as the f32 scores (a rounding of the float64 one); the
            // sums to a few f32 roundings of each other term.
            let st = got[1].f32().unwrap();
            assert_eq!(st.len(), stats.len(), "{what} {form}: statistics");
            for (i, (&x, &w)) in st.iter().zip(&stats).enumerate() {
                let tol = 1e-5 * w.abs().max(1.0);
                assert!(
                    x.is_finite()
                        && (f64::from(x) - w).abs()
                            <= tol.max(w.abs() * 4e-3 * f64::from(u8::from(i % 2 == 1))),
                    "{what} {form}: statistic {i}: {x} against {w}"
                );
            }
            errs.push(e);
        }
        let (et, em) = (errs[0], errs[1]);
        assert!(et <= 2f64.powi(-8), "{what}: tiles {et:.2e} from float64");
        assert!(
            em <= 2f64.powi(-7),
            "{what}: tensor cores {em:.2e} from float64"
        );
        worst_tiles = worst_tiles.max(et);
        worst_mma = worst_mma.max(em);
    }
    println!(
        "codegen: bf16 attention forward on {} cases, from float64 at most: tiles {worst_tiles:.2e}, tensor cores (mma.sync, emulated lane by lane) {worst_mma:.2e}",
        runs.len()
    );
}

/// The f32 forward on tensor cores, each product as three TF32 products (`Attn::tf32x3`:
/// `Body::AttnMma` asked for on f32 operands; emulated on the host from the lanes'
/// fragments, the TF32 parts rounded as `cvt.rna.tf32.f32` rounds them), against attention
/// in float64, beside the f32 register tiles on the same operands: causal or not, grouped
/// heads, short last tiles, more keys than queries, widths 8 to 96 (query/key widths a
/// multiple of 8; at 128 a 64-row f32 query tile leaves no room in 48 KiB), a scale, and
/// the kept statistics. The issue's fp32 tolerance, 1e-5 of
/// the tensor's scale, and no further from float64 than twice the tiles (or 1e-6): the
/// dropped `a_lo b_lo` terms cost about 2^-22 a product, below f32's own rounding of the
/// sums. Not the default (`NNSCALER_ATTN_F32=tf32x3` makes it one).
#[test]
pub(super) fn tf32x3_attention_matches_float64() {
    use nnscaler_codegen::kernel::{lower_attention_kept, AttnForm};
    let causal = attrs(&[("causal", AttrValue::Bool(true))]);
    let shapes: Vec<(Vec<i64>, Vec<i64>, Attrs)> = vec![
        (vec![2, 4, 9, 8], vec![2, 2, 9, 8], causal.clone()),
        (vec![1, 3, 130, 64], vec![1, 3, 130, 64], causal.clone()),
        (vec![1, 2, 65, 32], vec![1, 1, 140, 32], Attrs::new()),
        (vec![1, 2, 140, 24], vec![1, 2, 33, 24], causal.clone()),
        (vec![1, 1, 70, 96], vec![1, 1, 70, 96], causal.clone()),
        (
            vec![1, 2, 40, 16],
            vec![1, 2, 40, 16],
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
        let ins = vec![Buf::of(&q), Buf::of(&kv), Buf::of(&kv)];
        let outs = vec![Buf::of(&q)];
        let mut pair = Vec::new();
        for form in [AttnForm::Tiles, AttnForm::Mma] {
            let name = format!("x{c}_{form:?}");
            let l = lower_attention_kept(&name, "dnn.attention", a, &ins, &outs, Some(form), true)
                .unwrap();
            let body = &l.kernels[0].body;
            match form {
                AttnForm::Mma => {
                    assert!(matches!(body, Body::AttnMma(x) if x.saved && x.tf32x3 && !x.bf16))
                }
                _ => assert!(matches!(body, Body::AttnTiles(x) if !x.tf32x3)),
            }
            kernels.extend(l.kernels.clone());
            pair.push(l);
        }
        let operands: Vec<Tensor> = [&q, &kv, &kv]
            .iter()
            .enumerate()
            .map(|(i, t)| operand(t, (c * 10 + i) as u64 + 500, -3.0, 3.0, 11))
            .collect();
        runs.push((qs.clone(), ks.clone(), a.clone(), pair, operands));
    }
    let host = HostKernels::new(&kernels).unwrap();
    let (mut worst_tiles, mut worst_tc) = (0.0f64, 0.0f64);
    for (qs, ks, a, pair, operands) in &runs {
        let what = format!("{qs:?} {ks:?} {a:?}");
        let ins: Vec<Data> = operands.iter().map(data).collect();
        let ins: Vec<&Data> = ins.iter().collect();
        let us = |v: &[i64]| v.iter().map(|&x| x as usize).collect::<Vec<_>>();
        let scale = match a.get("scale") {
            Some(AttrValue::Float(f)) => f64::from(*f as f32),
            _ => f64::from(1.0 / (qs[3] as f32).sqrt()),
        };
        let opsv: Vec<&[f32]> = operands.iter().map(|t| t.f().unwrap()).collect();
        let want = attention_f64(
            (&us(qs), &us(ks), ks[3] as usize),
            scale,
            a.contains_key("causal"),
            &opsv,
            false,
        )
        .remove(0);
        let mut outs = Vec::new();
        for (form, l) in ["tiles", "tensor cores"].iter().zip(pair) {
            let got = host.run(&l.kernels[0].name, &ins).unwrap();
            assert_eq!(got.len(), 2, "{what} {form}: the output and the statistics");
            let out = got[0].f32().unwrap().to_vec();
            let st = got[1].f32().unwrap().to_vec();
            outs.push((error_f64(&out, &want), st));
        }
        let (et, st_tiles) = (outs[0].0, &outs[0].1);
        let (ec, st_tc) = (outs[1].0, &outs[1].1);
        assert!(et <= 1e-5, "{what}: tiles {et:.2e} from float64");
        assert!(ec <= 1e-5, "{what}: tensor cores {ec:.2e} from float64");
        assert!(
            ec <= 2.0 * et.max(5e-7),
            "{what}: tensor cores {ec:.2e}, tiles {et:.2e} from float64"
        );
        // The statistics as the tiles keep them, within f32 roundings of each other.
        assert_eq!(st_tiles.len(), st_tc.len(), "{what}: statistics");
        for (i, (&x, &y)) in st_tc.iter().zip(st_tiles).enumerate() {
            let tol = 1e-5 * f64::from(y.abs()).max(1.0);
            assert!(
                x.is_finite() && (f64::from(x) - f64::from(y)).abs() <= tol,
                "{what}: statistic {i}: tensor cores {x}, tiles {y}"
            );
        }
        worst_tiles = worst_tiles.max(et);
        worst_tc = worst_tc.max(ec);
    }
    println!(
        "codegen: f32 attention forward on {} cases, from float64 at most: tiles {worst_tiles:.2e}, tensor cores as three TF32 products (emulated lane by lane) {worst_tc:.2e}",
        runs.len()
    );
}

/// The backward on tensor cores (`Body::AttnMmaBack`: statistics and `dq`;
/// `Body::AttnMmaKv`: `dk`, `dv`) on 2-byte bf16 operands, against the gradients in
/// float64 of the same bf16 values, beside the f32-register tiles on the same buffers and
/// the same kept forward (its bf16 output and statistics): causal or not, grouped heads,
/// short last tiles, more keys than queries and the reverse, widths 16 to 64, a scale.
/// Both read `D = dO . out` from the bf16 output, as FlashAttention does; the tensor cores
/// also round `P` and `dS` to bf16 for their products.
#[test]
pub(super) fn mma_attention_backward_matches_float64() {
    use nnscaler_codegen::kernel::{lower_attention_kept, AttnForm};
    let causal = attrs(&[("causal", AttrValue::Bool(true))]);
    let shapes: Vec<(Vec<i64>, Vec<i64>, Attrs)> = vec![
        (vec![2, 4, 9, 16], vec![2, 2, 9, 16], causal.clone()),
        (vec![1, 3, 130, 64], vec![1, 3, 130, 64], causal.clone()),
        (vec![1, 2, 65, 32], vec![1, 1, 140, 32], Attrs::new()),
        (vec![1, 2, 140, 16], vec![1, 2, 33, 16], causal.clone()),
        (
            vec![1, 2, 40, 16],
            vec![1, 2, 40, 16],
            attrs(&[
                ("causal", AttrValue::Bool(true)),
                ("scale", AttrValue::Float(0.3)),
            ]),
        ),
    ];
    let buf = |s: &[i64], elt| Buf {
        shape: s.iter().map(|&x| x as usize).collect(),
        elt,
    };
    let mut kernels = Vec::new();
    let mut runs = Vec::new();
    for (c, (qs, ks, a)) in shapes.iter().enumerate() {
        let bf = |s: &[i64]| buf(s, Elt::Bf16);
        let fwd = lower_attention_kept(
            &format!("b{c}_fwd"),
            "dnn.attention",
            a,
            &[bf(qs), bf(ks), bf(ks)],
            &[bf(qs)],
            Some(AttnForm::Mma),
            true,
        )
        .unwrap();
        kernels.extend(fwd.kernels.clone());
        let rows = (qs[0] * qs[1] * qs[2]) as usize;
        let stats = Buf {
            shape: vec![rows, 2],
            elt: Elt::F32,
        };
        let ins = vec![bf(qs), bf(qs), bf(ks), bf(ks), bf(qs), stats];
        let outs = vec![buf(qs, Elt::F32), buf(ks, Elt::F32), buf(ks, Elt::F32)];
        let mut pair = Vec::new();
        for form in [AttnForm::Tiles, AttnForm::Mma] {
            let l = lower_attention_kept(
                &format!("b{c}_{form:?}"),
                "dnn.attention_grad",
                a,
                &ins,
                &outs,
                Some(form),
                true,
            )
            .unwrap();
            let mma = l
                .kernels
                .iter()
                .filter(|k| matches!(k.body, Body::AttnMmaBack(_) | Body::AttnMmaKv(_)))
                .count();
            assert_eq!(mma, if form == AttnForm::Mma { 2 } else { 0 }, "case {c}");
            kernels.extend(l.kernels.clone());
            pair.push(l);
        }
        let ops: Vec<Vec<u16>> = [qs, qs, ks, ks]
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n = s.iter().product::<i64>() as usize;
                values(n, (c * 10 + i + 50) as u64, -3.0, 3.0)
                    .into_iter()
                    .map(to_bf16)
                    .collect()
            })
            .collect();
        runs.push((qs.clone(), ks.clone(), a.clone(), fwd, pair, ops));
    }
    let host = HostKernels::new(&kernels).unwrap();
    let (mut worst_tiles, mut worst_mma) = (0.0f64, 0.0f64);
    for (qs, ks, a, fwd, pair, ops) in &runs {
        let what = format!("{qs:?} {ks:?} {a:?}");
        let data: Vec<Data> = ops.iter().map(|v| Data::Bf16(v.clone())).collect();
        // The kept forward: its bf16 output and its statistics.
        let kept = host
            .run(&fwd.kernels[0].name, &[&data[1], &data[2], &data[3]])
            .unwrap();
        let ins: Vec<&Data> = data.iter().chain(&kept).collect();
        let us = |v: &[i64]| v.iter().map(|&x| x as usize).collect::<Vec<_>>();
        let scale = match a.get("scale") {
            Some(AttrValue::Float(f)) => f64::from(*f as f32),
            _ => f64::from(1.0 / (qs[3] as f32).sqrt()),
        };
        let f: Vec<Vec<f32>> = ops
            .iter()
            .map(|v| v.iter().map(|&h| from_bf16(h)).collect())
            .collect();
        let fr: Vec<&[f32]> = f.iter().map(|v| v.as_slice()).collect();
        let (qd, kd) = (us(qs), us(ks));
        let want = attention_f64(
            (&qd, &kd, kd[3]),
            scale,
            a.contains_key("causal"),
            &fr,
            true,
        );
        let mut errs = Vec::new();
        for (form, l) in ["tiles", "tensor cores"].iter().zip(pair) {
            let got = host.run_lowered(l, &ins).unwrap();
            assert_eq!(got.len(), 3, "{what} {form}: dq, dk, dv");
            let e = got
                .iter()
                .zip(&want)
                .map(|(g, w)| error_f64(g.f32().unwrap(), w))
                .fold(0.0, f64::max);
            errs.push(e);
        }
        let (et, em) = (errs[0], errs[1]);
        println!("codegen: backward {what}: tiles {et:.2e}, tensor cores {em:.2e}");
        assert!(et <= 2f64.powi(-7), "{what}: tiles {et:.2e} from float64");
        assert!(
            em <= 2f64.powi(-7),
            "{what}: tensor cores {em:.2e} from float64"
        );
        assert!(
            em <= 2.0 * et,
            "{what}: tensor cores {em:.2e}, tiles {et:.2e}"
        );
        worst_tiles = worst_tiles.max(et);
        worst_mma = worst_mma.max(em);
    }
    println!(
        "codegen: bf16 attention backward on {} cases, from float64 at most: tiles {worst_tiles:.2e}, tensor cores {worst_mma:.2e}",
        runs.len()
    );
}

/// The f32 backward on tensor cores as three TF32 products (`Body::AttnMmaBack` and
/// `Body::AttnMmaKv` with `Attn::tf32x3`), against the gradients in float64, beside the
/// register tiles on the same operands and the same kept forward (the tensor cores' f32
/// output and statistics): causal or not, grouped heads, short last tiles, more keys than
/// queries and the reverse, widths 8 to 64, a scale. Held to the issue's fp32 tolerance
/// (1e-5 of each tensor's scale) and to twice the tiles' distance (or 1e-6).
#[test]
pub(super) fn tf32x3_attention_backward_matches_float64() {
    use nnscaler_codegen::kernel::{lower_attention_kept, AttnForm};
    let causal = attrs(&[("causal", AttrValue::Bool(true))]);
    let shapes: Vec<(Vec<i64>, Vec<i64>, Attrs)> = vec![
        (vec![2, 4, 9, 8], vec![2, 2, 9, 8], causal.clone()),
        (vec![1, 3, 130, 64], vec![1, 3, 130, 64], causal.clone()),
        (vec![1, 2, 65, 32], vec![1, 1, 140, 32], Attrs::new()),
        (vec![1, 2, 140, 24], vec![1, 2, 33, 24], causal.clone()),
        (
            vec![1, 2, 40, 16],
            vec![1, 2, 40, 16],
            attrs(&[
                ("causal", AttrValue::Bool(true)),
                ("scale", AttrValue::Float(0.3)),
            ]),
        ),
    ];
    let f = |s: &[i64]| Buf {
        shape: s.iter().map(|&x| x as usize).collect(),
        elt: Elt::F32,
    };
    let mut kernels = Vec::new();
    let mut runs = Vec::new();
    for (c, (qs, ks, a)) in shapes.iter().enumerate() {
        let fwd = lower_attention_kept(
            &format!("y{c}_fwd"),
            "dnn.attention",
            a,
            &[f(qs), f(ks), f(ks)],
            &[f(qs)],
            Some(AttnForm::Mma),
            true,
        )
        .unwrap();
        assert!(matches!(fwd.kernels[0].body, Body::AttnMma(x) if x.tf32x3));
        kernels.extend(fwd.kernels.clone());
        let rows = (qs[0] * qs[1] * qs[2]) as usize;
        let stats = Buf {
            shape: vec![rows, 2],
            elt: Elt::F32,
        };
        let ins = vec![f(qs), f(qs), f(ks), f(ks), f(qs), stats];
        let outs = vec![f(qs), f(ks), f(ks)];
        let mut pair = Vec::new();
        for form in [AttnForm::Tiles, AttnForm::Mma] {
            let l = lower_attention_kept(
                &format!("y{c}_{form:?}"),
                "dnn.attention_grad",
                a,
                &ins,
                &outs,
                Some(form),
                true,
            )
            .unwrap();
            let tc = l
                .kernels
                .iter()
                .filter(|k| matches!(k.body, Body::AttnMmaBack(x) | Body::AttnMmaKv(x) if x.tf32x3))
                .count();
            assert_eq!(tc, if form == AttnForm::Mma { 2 } else { 0 }, "case {c}");
            kernels.extend(l.kernels.clone());
            pair.push(l);
        }
        let ops: Vec<Vec<f32>> = [qs, qs, ks, ks]
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n = s.iter().product::<i64>() as usize;
                values(n, (c * 10 + i + 700) as u64, -3.0, 3.0)
            })
            .collect();
        runs.push((qs.clone(), ks.clone(), a.clone(), fwd, pair, ops));
    }
    let host = HostKernels::new(&kernels).unwrap();
    let (mut worst_tiles, mut worst_tc) = (0.0f64, 0.0f64);
    for (qs, ks, a, fwd, pair, ops) in &runs {
        let what = format!("{qs:?} {ks:?} {a:?}");
        let data: Vec<Data> = ops.iter().map(|v| Data::F32(v.clone())).collect();
        // The kept forward (tensor cores): its output and its statistics.
        let kept = host
            .run(&fwd.kernels[0].name, &[&data[1], &data[2], &data[3]])
            .unwrap();
        let ins: Vec<&Data> = data.iter().chain(&kept).collect();
        let us = |v: &[i64]| v.iter().map(|&x| x as usize).collect::<Vec<_>>();
        let scale = match a.get("scale") {
            Some(AttrValue::Float(f)) => f64::from(*f as f32),
            _ => f64::from(1.0 / (qs[3] as f32).sqrt()),
        };
        let fr: Vec<&[f32]> = ops.iter().map(|v| v.as_slice()).collect();
        let (qd, kd) = (us(qs), us(ks));
        let want = attention_f64(
            (&qd, &kd, kd[3]),
            scale,
            a.contains_key("causal"),
            &fr,
            true,
        );
        let mut errs = Vec::new();
        for (form, l) in ["tiles", "tensor cores"].iter().zip(pair) {
            let got = host.run_lowered(l, &ins).unwrap();
            assert_eq!(got.len(), 3, "{what} {form}: dq, dk, dv");
            let e = got
                .iter()
                .zip(&want)
                .map(|(g, w)| error_f64(g.f32().unwrap(), w))
                .fold(0.0, f64::max);
            errs.push(e);
        }
        let (et, ec) = (errs[0], errs[1]);
        println!("codegen: f32 backward {what}: tiles {et:.2e}, tensor cores {ec:.2e}");
        assert!(et <= 1e-5, "{what}: tiles {et:.2e} from float64");
        assert!(ec <= 1e-5, "{what}: tensor cores {ec:.2e} from float64");
        assert!(
            ec <= 2.0 * et.max(5e-7),
            "{what}: tensor cores {ec:.2e}, tiles {et:.2e}"
        );
        worst_tiles = worst_tiles.max(et);
        worst_tc = worst_tc.max(ec);
    }
    println!(
        "codegen: f32 attention backward on {} cases, from float64 at most: tiles {worst_tiles:.2e}, tensor cores as three TF32 products {worst_tc:.2e}",
        runs.len()
    );
}
