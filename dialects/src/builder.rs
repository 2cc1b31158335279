//! Typed builders for `dnn` functions.
//!
//! A [`FuncBuilder`] creates ops through their [`OpSpec`](crate::spec::OpSpec): it checks
//! operands, infers result types and writes attributes from typed values, so frontends and
//! passes never spell attribute text by hand. It emits generic-form MLIR, which
//! [`crate::context::IrContext::parse`] turns into a real module (and the verifier checks
//! again).

use crate::dnn;
use crate::spec::OpCtx;
use crate::types::{AttrValue, Attrs, Elem, TensorType};
use std::fmt::Write as _;

/// An SSA value being built: its number and type.
#[derive(Clone, Debug, PartialEq)]
pub struct Val {
    name: String,
    /// The value's type.
    pub ty: TensorType,
}

impl Val {
    /// Shape of the value.
    pub fn shape(&self) -> &[i64] {
        &self.ty.shape
    }
}

/// An error building an op: which op and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("building '{op}': {message}")]
pub struct BuildError {
    /// The op being built.
    pub op: String,
    /// What was wrong.
    pub message: String,
}

/// Builds one `func.func` of `dnn` ops.
#[derive(Debug)]
pub struct FuncBuilder {
    name: String,
    args: Vec<(Val, Attrs)>,
    body: String,
    next: usize,
    ops: usize,
}

impl FuncBuilder {
    /// A function named `name`.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            args: Vec::new(),
            body: String::new(),
            next: 0,
            ops: 0,
        }
    }

    fn arg(&mut self, name: &str, ty: TensorType, param: bool) -> Val {
        let v = Val {
            name: format!("%arg{}", self.args.len()),
            ty,
        };
        let mut attrs = Attrs::new();
        attrs.insert("nns.name".into(), AttrValue::Str(name.to_string()));
        if param {
            attrs.insert("nns.param".into(), AttrValue::Unit);
        }
        self.args.push((v.clone(), attrs));
        v
    }

    /// A data input named `name` (`nns.name`).
    pub fn input(&mut self, name: &str, shape: &[i64], elem: Elem) -> Val {
        self.arg(name, TensorType::new(shape, elem), false)
    }

    /// A trainable f32 parameter named `name` (`nns.name`, `nns.param`).
    pub fn param(&mut self, name: &str, shape: &[i64]) -> Val {
        self.arg(name, TensorType::new(shape, Elem::F32), true)
    }

    /// Number of ops built so far.
    pub fn op_count(&self) -> usize {
        self.ops
    }

    /// Builds op `name` on `operands` with `attrs`; returns its results.
    pub fn op(
        &mut self,
        name: &str,
        operands: &[&Val],
        attrs: &[(&str, AttrValue)],
    ) -> Result<Vec<Val>, BuildError> {
        let fail = |message: String| BuildError {
            op: name.to_string(),
            message,
        };
        let spec = dnn::spec(name).ok_or_else(|| fail("no such dnn op".into()))?;
        let types: Vec<Option<TensorType>> = operands.iter().map(|v| Some(v.ty.clone())).collect();
        let attr_map: Attrs = attrs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let ctx = OpCtx {
            operands: &types,
            attrs: &attr_map,
        };
        let (results, _, _) = spec.check(&ctx).map_err(fail)?;
        let base = self.next;
        self.next += 1;
        let outs: Vec<Val> = results
            .iter()
            .enumerate()
            .map(|(i, t)| Val {
                name: if results.len() == 1 {
                    format!("%{base}")
                } else {
                    format!("%{base}#{i}")
                },
                ty: t.clone(),
            })
            .collect();
        let lhs = if results.len() == 1 {
            format!("%{base}")
        } else {
            format!("%{base}:{}", results.len())
        };
        let names: Vec<&str> = operands.iter().map(|v| v.name.as_str()).collect();
        let _ = write!(self.body, "    {lhs} = \"{name}\"({})", names.join(", "));
        if !attr_map.is_empty() {
            let items: Vec<String> = attr_map
                .iter()
                .map(|(k, v)| format!("{k} = {}", v.to_mlir_text()))
                .collect();
            let _ = write!(self.body, " {{{}}}", items.join(", "));
        }
        let ins: Vec<String> = operands.iter().map(|v| v.ty.to_string()).collect();
        let outs_t: Vec<String> = results.iter().map(TensorType::to_string).collect();
        let outs_text = if outs_t.len() == 1 {
            outs_t[0].clone()
        } else {
            format!("({})", outs_t.join(", "))
        };
        let _ = writeln!(self.body, " : ({}) -> {outs_text}", ins.join(", "));
        self.ops += 1;
        Ok(outs)
    }

    fn one(
        &mut self,
        name: &str,
        operands: &[&Val],
        attrs: &[(&str, AttrValue)],
    ) -> Result<Val, BuildError> {
        Ok(self.op(name, operands, attrs)?.remove(0))
    }

    /// `x @ w^T (+ b)`.
    pub fn linear(&mut self, x: &Val, w: &Val, b: Option<&Val>) -> Result<Val, BuildError> {
        match b {
            Some(b) => self.one("dnn.linear", &[x, w, b], &[]),
            None => self.one("dnn.linear", &[x, w], &[]),
        }
    }

    /// Matrix product.
    pub fn matmul(&mut self, a: &Val, b: &Val, ta: bool, tb: bool) -> Result<Val, BuildError> {
        let mut attrs = Vec::new();
        if ta {
            attrs.push(("transpose_a", AttrValue::Bool(true)));
        }
        if tb {
            attrs.push(("transpose_b", AttrValue::Bool(true)));
        }
        self.one("dnn.matmul", &[a, b], &attrs)
    }

    /// Elementwise binary op `dnn.add|sub|mul|div`.
    pub fn binary(&mut self, op: &str, a: &Val, b: &Val) -> Result<Val, BuildError> {
        self.one(&format!("dnn.{op}"), &[a, b], &[])
    }

    /// Elementwise unary op (`relu`, `silu`, `exp`, ...).
    pub fn unary(&mut self, op: &str, x: &Val) -> Result<Val, BuildError> {
        self.one(&format!("dnn.{op}"), &[x], &[])
    }

    /// GELU, exact or tanh-approximated.
    pub fn gelu(&mut self, x: &Val, tanh: bool) -> Result<Val, BuildError> {
        let a = if tanh { "tanh" } else { "none" };
        self.one(
            "dnn.gelu",
            &[x],
            &[("approximate", AttrValue::Str(a.into()))],
        )
    }

    /// Layer norm over the last dim.
    pub fn layer_norm(&mut self, x: &Val, w: &Val, b: &Val, eps: f64) -> Result<Val, BuildError> {
        self.one(
            "dnn.layer_norm",
            &[x, w, b],
            &[("eps", AttrValue::Float(eps))],
        )
    }

    /// RMS norm over the last dim.
    pub fn rms_norm(&mut self, x: &Val, w: &Val, eps: f64) -> Result<Val, BuildError> {
        self.one("dnn.rms_norm", &[x, w], &[("eps", AttrValue::Float(eps))])
    }

    /// Table lookup.
    pub fn embedding(&mut self, ids: &Val, table: &Val) -> Result<Val, BuildError> {
        self.one("dnn.embedding", &[ids, table], &[])
    }

    /// Reshape.
    pub fn reshape(&mut self, x: &Val, shape: &[i64]) -> Result<Val, BuildError> {
        self.one(
            "dnn.reshape",
            &[x],
            &[("shape", AttrValue::Ints(shape.to_vec()))],
        )
    }

    /// Transpose by `perm`.
    pub fn transpose(&mut self, x: &Val, perm: &[i64]) -> Result<Val, BuildError> {
        self.one(
            "dnn.transpose",
            &[x],
            &[("perm", AttrValue::Ints(perm.to_vec()))],
        )
    }

    /// Scaled dot-product attention.
    pub fn attention(
        &mut self,
        q: &Val,
        k: &Val,
        v: &Val,
        causal: bool,
    ) -> Result<Val, BuildError> {
        self.one(
            "dnn.attention",
            &[q, k, v],
            &[("causal", AttrValue::Bool(causal))],
        )
    }

    /// Rotary position embedding.
    pub fn rotary(&mut self, x: &Val, theta: f64) -> Result<Val, BuildError> {
        self.one("dnn.rotary", &[x], &[("theta", AttrValue::Float(theta))])
    }

    /// Mean cross-entropy.
    pub fn cross_entropy(&mut self, logits: &Val, targets: &Val) -> Result<Val, BuildError> {
        self.one("dnn.cross_entropy", &[logits, targets], &[])
    }

    /// Dropout with probability `p` and mask seed `seed`.
    pub fn dropout(&mut self, x: &Val, p: f64, seed: i64) -> Result<Val, BuildError> {
        self.one(
            "dnn.dropout",
            &[x],
            &[("p", AttrValue::Float(p)), ("seed", AttrValue::Int(seed))],
        )
    }

    /// Mean over `dims`.
    pub fn mean(&mut self, x: &Val, dims: &[i64]) -> Result<Val, BuildError> {
        self.one(
            "dnn.mean",
            &[x],
            &[("dims", AttrValue::Ints(dims.to_vec()))],
        )
    }

    /// The finished function returning `results`, each with an `nns.name`.
    pub fn finish(self, results: &[(&Val, &str)]) -> String {
        let args: Vec<String> = self
            .args
            .iter()
            .map(|(v, attrs)| {
                let items: Vec<String> = attrs
                    .iter()
                    .map(|(k, a)| match a {
                        AttrValue::Unit => k.clone(),
                        a => format!("{k} = {}", a.to_mlir_text()),
                    })
                    .collect();
                format!("{}: {} {{{}}}", v.name, v.ty, items.join(", "))
            })
            .collect();
        let rets: Vec<String> = results
            .iter()
            .map(|(v, n)| {
                format!(
                    "{} {{nns.name = {}}}",
                    v.ty,
                    AttrValue::Str(n.to_string()).to_mlir_text()
                )
            })
            .collect();
        let names: Vec<&str> = results.iter().map(|(v, _)| v.name.as_str()).collect();
        let types: Vec<String> = results.iter().map(|(v, _)| v.ty.to_string()).collect();
        format!(
            "  func.func @{}({}) -> ({}) {{\n{}    return {} : {}\n  }}\n",
            self.name,
            args.join(", "),
            rets.join(", "),
            self.body,
            names.join(", "),
            types.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::IrContext;
    use crate::verify::verify_module;

    #[test]
    fn builds_a_verified_function() {
        let mut b = FuncBuilder::new("f");
        let x = b.input("x", &[2, 8], Elem::F32);
        let w = b.param("w", &[4, 8]);
        let y = b.linear(&x, &w, None).unwrap();
        let y = b.unary("relu", &y).unwrap();
        let l = b.mean(&y, &[0, 1]).unwrap();
        assert_eq!(l.shape(), &[] as &[i64]);
        let text = format!("module {{\n{}}}\n", b.finish(&[(&l, "loss")]));
        let ctx = IrContext::new();
        let m = ctx
            .parse(&text, "b.mlir")
            .unwrap_or_else(|d| panic!("{d}\n{text}"));
        assert!(verify_module(&m).is_empty());
    }

    #[test]
    fn rejects_bad_shapes() {
        let mut b = FuncBuilder::new("f");
        let x = b.input("x", &[2, 8], Elem::F32);
        let w = b.param("w", &[4, 7]);
        let e = b.linear(&x, &w, None).unwrap_err();
        assert_eq!(e.op, "dnn.linear");
        assert!(e.message.contains("dimension 'k' is 8"), "{e}");
    }
}
