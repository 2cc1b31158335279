//! Row teams of fewer lanes than elements (`NNSCALER_ROW_ELEMS`, the knob the next GPU
//! run sweeps): the row kernels (norms and their gradients, the softmax family,
//! cross-entropy, reductions along a line) with 8 elements a lane, JIT-compiled for this
//! CPU, against the CPU runtime's kernels. A test binary of its own: the knob is read once
//! per process.

use nnscaler_codegen::{lower, Buf, Data, HostKernels, Kernel};
use nnscaler_dialects::dnn;
use nnscaler_dialects::types::{AttrValue, Attrs, TensorType};
use nnscaler_runtime::kernels::{kernel, Ctx};
use nnscaler_runtime::rng;
use nnscaler_runtime::tensor::Tensor;

fn ty(shape: &[i64]) -> TensorType {
    TensorType::new(shape, nnscaler_dialects::types::Elem::F32)
}

fn operand(t: &TensorType, seed: u64, ids_below: Option<i64>) -> Tensor {
    let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
    let n: usize = shape.iter().product();
    match ids_below {
        Some(hi) => Tensor::i64(
            &shape,
            (0..n as u64)
                .map(|k| (rng::bits(seed, 1, k) % hi as u64) as i64)
                .collect(),
        ),
        None => Tensor::f32(
            &shape,
            (0..n as u64)
                .map(|k| rng::normal(seed, 1, k) as f32)
                .collect(),
        ),
    }
}

#[test]
fn row_kernels_with_eight_elements_a_lane_match_the_reference() {
    // SAFETY: set before any thread of this test binary reads the environment (one test).
    std::env::set_var("NNSCALER_ROW_ELEMS", "8");
    assert_eq!(nnscaler_codegen::kernel::row_elems(), 8);
    let attrs = |list: &[(&str, AttrValue)]| -> Attrs {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    };
    let ids = |shape: &[i64]| TensorType::new(shape, nnscaler_dialects::types::Elem::I64);
    let (x, h) = (ty(&[70, 384]), ty(&[384]));
    let cases: Vec<(&str, Attrs, Vec<TensorType>, Option<i64>)> = vec![
        (
            "dnn.layer_norm",
            Attrs::new(),
            vec![x.clone(), h.clone(), h.clone()],
            None,
        ),
        (
            "dnn.rms_norm",
            Attrs::new(),
            vec![x.clone(), h.clone()],
            None,
        ),
        (
            "dnn.layer_norm_grad",
            Attrs::new(),
            vec![x.clone(), x.clone(), h.clone()],
            None,
        ),
        (
            "dnn.softmax",
            attrs(&[("dim", AttrValue::Int(-1))]),
            vec![x.clone()],
            None,
        ),
        (
            "dnn.log_softmax",
            attrs(&[("dim", AttrValue::Int(-1))]),
            vec![x.clone()],
            None,
        ),
        (
            "dnn.sum",
            attrs(&[("dims", AttrValue::Ints(vec![-1]))]),
            vec![x.clone()],
            None,
        ),
        (
            "dnn.max",
            attrs(&[("dims", AttrValue::Ints(vec![1]))]),
            vec![ty(&[5, 300])],
            None,
        ),
        (
            "dnn.cross_entropy",
            Attrs::new(),
            vec![x.clone(), ids(&[70])],
            Some(384),
        ),
    ];
    for (c, (op, a, tys, bound)) in cases.iter().enumerate() {
        let spec = dnn::spec(op).unwrap();
        let opt: Vec<Option<TensorType>> = tys.iter().cloned().map(Some).collect();
        let ctx = nnscaler_dialects::spec::OpCtx {
            operands: &opt,
            attrs: a,
        };
        let (outs, _, _) = spec.check(&ctx).unwrap_or_else(|e| panic!("{op}: {e}"));
        let bufs: Vec<Buf> = tys.iter().map(Buf::of).collect();
        let out_bufs: Vec<Buf> = outs.iter().map(Buf::of).collect();
        let name = format!("r{c}_{}", op.trim_start_matches("dnn."));
        let l = lower(&name, op, a, &bufs, &out_bufs).unwrap_or_else(|e| panic!("{op}: {e}"));
        // Lines of 300 and 384 take 64 lanes (not 256).
        let teams: Vec<&Kernel> = l.kernels.iter().filter(|k| k.team() > 1).collect();
        assert!(
            teams.iter().any(|k| k.team() == 64),
            "{op}: no row team of 64 lanes ({:?})",
            teams.iter().map(|k| k.team()).collect::<Vec<_>>()
        );
        let ins: Vec<Tensor> = tys
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let b = if t.elem == nnscaler_dialects::types::Elem::I64 {
                    *bound
                } else {
                    None
                };
                operand(t, (c * 10 + i) as u64, b)
            })
            .collect();
        let f = kernel(op).unwrap();
        let rctx = Ctx {
            op,
            attrs: a,
            out: &outs,
            device: None,
        };
        let refs: Vec<&Tensor> = ins.iter().collect();
        let want = f(&rctx, &refs).unwrap();
        let host = HostKernels::new(&l.kernels).unwrap();
        let data: Vec<Data> = ins
            .iter()
            .map(|t| match t.f() {
                Ok(v) => Data::F32(v.to_vec()),
                Err(_) => Data::I64(t.ints().unwrap().to_vec()),
            })
            .collect();
        let data: Vec<&Data> = data.iter().collect();
        let got = host.run_lowered(&l, &data).unwrap();
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            let (g, w) = (g.f32().unwrap(), w.f().unwrap());
            assert_eq!(g.len(), w.len(), "{op} result {k}: length");
            let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
            for (i, (a, b)) in g.iter().zip(w).enumerate() {
                assert!(a.is_finite(), "{op} result {k} element {i}: {a}");
                let err = f64::from((a - b).abs()) / f64::from(b.abs().max(1e-3 * scale));
                assert!(
                    err <= 1e-5,
                    "{op} result {k} element {i}: {a} vs {b} ({err:.2e})"
                );
            }
        }
    }
}
