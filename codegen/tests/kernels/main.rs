//! The generated kernels, JIT-compiled for this CPU, against the CPU runtime's reference
//! kernels: every covered op (elementwise formulas with broadcasting, reductions, the
//! softmax family, transpose, norms and their gradients, embedding, cross-entropy, AdamW,
//! clipping), the math functions' edge values, and every fused kernel of GPT and Llama
//! training steps (forward + backward + AdamW). And every generated PTX module passes
//! `ptxas` for sm_90.

use nnscaler_codegen::{
    covered, fuse, lower, ptx, Body, Buf, Data, Elt, Gpu, Group, HostKernels, Kernel,
};
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::dnn;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::types::{AttrValue, Attrs, Elem, TensorType};
use nnscaler_frontends::{build_module, preset};
use nnscaler_passes::pipeline;
use nnscaler_runtime::kernels::{kernel, Ctx};
use nnscaler_runtime::rng;
use nnscaler_runtime::tensor::Tensor;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

/// Relative error of `got` against `want`: per element, against the element's magnitude
/// (at least 1e-3 of the tensor's largest, so a value that cancels to near zero is judged
/// against the scale of its tensor); NaN and infinities must agree exactly.
fn error(got: &[f32], want: &[f32]) -> f64 {
    error_floor(got, want, 1e-3)
}

/// [`error`] with the floor at `floor` times the tensor's largest magnitude: 1 gives the
/// oracle tests' `max|got - want| / max|want|`, the measure for dot products, whose
/// near-zero results carry the rounding of their large terms in any summation order.
fn error_floor(got: &[f32], want: &[f32], floor: f64) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want
        .iter()
        .filter(|w| w.is_finite())
        .fold(0.0f64, |m, &w| m.max(f64::from(w).abs()));
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !w.is_finite() || !g.is_finite() {
            assert!(
                (w.is_nan() && g.is_nan()) || g == w,
                "element {i}: got {g}, want {w}"
            );
            continue;
        }
        let (g, w) = (f64::from(g), f64::from(w));
        worst = worst.max((g - w).abs() / w.abs().max(floor * scale).max(1e-30));
    }
    worst
}

fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| lo + (hi - lo) * rng::uniform(seed, 7, i) as f32)
        .collect()
}

fn reference(op: &str, attrs: &Attrs, ins: &[Tensor], out: &[usize]) -> Vec<f32> {
    let f = kernel(op).unwrap();
    let shape: Vec<i64> = out.iter().map(|&d| d as i64).collect();
    let ty = [TensorType::new(&shape, Elem::F32)];
    let ctx = Ctx {
        op,
        attrs,
        out: &ty,
        device: None,
    };
    let refs: Vec<&Tensor> = ins.iter().collect();
    f(&ctx, &refs).unwrap()[0].f().unwrap().to_vec()
}

/// Inputs where an op is defined: positive for log, sqrt and rsqrt.
fn domain(op: &str) -> (f32, f32) {
    match op {
        "dnn.log" | "dnn.sqrt" | "dnn.rsqrt" => (1e-3, 30.0),
        "dnn.exp" => (-90.0, 88.0),
        _ => (-6.0, 6.0),
    }
}

/// Random operands for an op: floats in `lo..hi`, integer operands (ids, targets) below
/// `bound`.
fn operand(t: &TensorType, seed: u64, lo: f32, hi: f32, bound: i64) -> Tensor {
    let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
    let n: usize = shape.iter().product();
    if t.elem.is_float() {
        Tensor::f32(&shape, values(n, seed, lo, hi))
    } else {
        Tensor::i64(
            &shape,
            (0..n as u64)
                .map(|i| (rng::uniform(seed, 9, i) * bound as f64) as i64)
                .collect(),
        )
    }
}

fn data(t: &Tensor) -> Data {
    match t.f() {
        Ok(v) => Data::F32(v.to_vec()),
        Err(_) => Data::I64(t.ints().unwrap().to_vec()),
    }
}

fn ty(shape: &[i64]) -> TensorType {
    TensorType::new(shape, Elem::F32)
}

fn ids(shape: &[i64]) -> TensorType {
    TensorType::new(shape, Elem::I64)
}

fn attrs(list: &[(&str, AttrValue)]) -> Attrs {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// One case per covered op and form: (op, attributes, operand types).
type Case = (&'static str, Attrs, Vec<TensorType>);

mod adamw;
mod attention;
mod ops;
mod ptx;
mod steps;
mod tensor_cores;

use attention::*;
use ops::*;
use ptx::*;
use steps::*;
