//! Elementwise ops as scalar formulas: what one element of the result is, in terms of the
//! same element of each operand (broadcast as numpy does). Declared with the op
//! ([`crate::spec::Traits::scalar`]) so that a code generator can fuse chains of them into
//! one kernel without knowing op names; the math functions are the CPU runtime's
//! (`exp`, `erf` by the same algorithms), so generated kernels match its results.

use crate::types::{AttrValue, Attrs};
use std::ops::{Add, Div, Mul, Neg, Sub};

/// A scalar expression over the operands of an elementwise op (f32).
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// The element of operand `k`.
    Input(usize),
    /// A constant.
    Const(f32),
    /// A function of one value.
    Un(Un, Box<Expr>),
    /// A function of two values.
    Bin(Bin, Box<Expr>, Box<Expr>),
    /// `then` where `lhs > rhs`, else `otherwise` (false when either is NaN).
    IfGt {
        /// Compared value.
        lhs: Box<Expr>,
        /// Compared with.
        rhs: Box<Expr>,
        /// The value where `lhs > rhs`.
        then: Box<Expr>,
        /// The value elsewhere.
        otherwise: Box<Expr>,
    },
}

/// Functions of one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Un {
    /// `-x`.
    Neg,
    /// e^x (the runtime's branch-free exp: relative error below 3e-7).
    Exp,
    /// Natural logarithm.
    Log,
    /// Square root (IEEE).
    Sqrt,
    /// Hyperbolic tangent.
    Tanh,
    /// erf(x) (Abramowitz & Stegun 7.1.26, as the runtime's).
    Erf,
    /// |x|.
    Abs,
    /// x rounded to the nearest bfloat16 (ties to even; NaN stays NaN), still held as an
    /// f32: [`round_bf16`].
    RoundBf16,
}

/// Functions of two values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bin {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b` (IEEE).
    Div,
    /// The larger (`a` when `b` is NaN, as `f32::max`).
    Max,
}

/// Builds an op's formula from its attributes (for example gelu's `approximate`).
pub type ScalarRule = fn(&Attrs) -> Result<Expr, String>;

/// Operand `k`.
pub fn x(k: usize) -> Expr {
    Expr::Input(k)
}

/// A constant.
pub fn c(v: f32) -> Expr {
    Expr::Const(v)
}

impl Expr {
    fn un(self, f: Un) -> Expr {
        Expr::Un(f, Box::new(self))
    }
    /// e^self.
    pub fn exp(self) -> Expr {
        self.un(Un::Exp)
    }
    /// ln(self).
    pub fn ln(self) -> Expr {
        self.un(Un::Log)
    }
    /// sqrt(self).
    pub fn sqrt(self) -> Expr {
        self.un(Un::Sqrt)
    }
    /// tanh(self).
    pub fn tanh(self) -> Expr {
        self.un(Un::Tanh)
    }
    /// erf(self).
    pub fn erf(self) -> Expr {
        self.un(Un::Erf)
    }
    /// |self|.
    pub fn abs(self) -> Expr {
        self.un(Un::Abs)
    }
    /// self rounded to bfloat16 precision.
    pub fn round_bf16(self) -> Expr {
        self.un(Un::RoundBf16)
    }
    /// max(self, other).
    pub fn max(self, other: Expr) -> Expr {
        Expr::Bin(Bin::Max, Box::new(self), Box::new(other))
    }
    /// `then` where self > rhs, else `otherwise`.
    pub fn if_gt(self, rhs: Expr, then: Expr, otherwise: Expr) -> Expr {
        Expr::IfGt {
            lhs: Box::new(self),
            rhs: Box::new(rhs),
            then: Box::new(then),
            otherwise: Box::new(otherwise),
        }
    }

    /// The operands it reads, ascending.
    pub fn inputs(&self) -> Vec<usize> {
        let mut v = Vec::new();
        self.visit(&mut |e| {
            if let Expr::Input(k) = e {
                v.push(*k);
            }
        });
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Replaces every `Input(k)` by `f(k)` (fusion substitutes a producer's formula).
    pub fn substitute(&self, f: &mut impl FnMut(usize) -> Expr) -> Expr {
        match self {
            Expr::Input(k) => f(*k),
            Expr::Const(v) => Expr::Const(*v),
            Expr::Un(u, a) => Expr::Un(*u, Box::new(a.substitute(f))),
            Expr::Bin(b, l, r) => {
                Expr::Bin(*b, Box::new(l.substitute(f)), Box::new(r.substitute(f)))
            }
            Expr::IfGt {
                lhs,
                rhs,
                then,
                otherwise,
            } => Expr::IfGt {
                lhs: Box::new(lhs.substitute(f)),
                rhs: Box::new(rhs.substitute(f)),
                then: Box::new(then.substitute(f)),
                otherwise: Box::new(otherwise.substitute(f)),
            },
        }
    }

    /// Nodes in the tree (a size bound for fusion).
    pub fn size(&self) -> usize {
        let mut n = 0;
        self.visit(&mut |_| n += 1);
        n
    }

    fn visit(&self, f: &mut impl FnMut(&Expr)) {
        f(self);
        match self {
            Expr::Input(_) | Expr::Const(_) => {}
            Expr::Un(_, a) => a.visit(f),
            Expr::Bin(_, l, r) => {
                l.visit(f);
                r.visit(f);
            }
            Expr::IfGt {
                lhs,
                rhs,
                then,
                otherwise,
            } => {
                lhs.visit(f);
                rhs.visit(f);
                then.visit(f);
                otherwise.visit(f);
            }
        }
    }
}

macro_rules! bin_ops {
    ($($t:ident $m:ident $b:ident),*) => {$(
        impl $t for Expr {
            type Output = Expr;
            fn $m(self, o: Expr) -> Expr {
                Expr::Bin(Bin::$b, Box::new(self), Box::new(o))
            }
        }
    )*};
}
bin_ops!(Add add Add, Sub sub Sub, Mul mul Mul, Div div Div);

impl Neg for Expr {
    type Output = Expr;
    fn neg(self) -> Expr {
        self.un(Un::Neg)
    }
}

/// `x` rounded to the nearest bfloat16 value, ties to even, as an f32 (bfloat16 is the
/// upper half of an f32: 8 exponent bits, 7 mantissa bits). NaN stays NaN; values past the
/// largest bfloat16 (about 3.39e38) become infinities, as a hardware conversion does. The one
/// definition: the CPU runtime rounds every bf16 result with it and the kernel generator
/// emits the same bit operations.
pub fn round_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let b = x.to_bits();
    f32::from_bits(b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
}

// --- The formulas of the dnn ops (referenced from their specs). ---

/// `dnn.cast`: to bf16 rounds; to f32 is exact (every bf16 is an f32).
pub fn cast(a: &Attrs) -> Result<Expr, String> {
    match a.get("to") {
        Some(AttrValue::Str(t)) if t == "bf16" => Ok(x(0).round_bf16()),
        Some(AttrValue::Str(t)) if t == "f32" => Ok(x(0)),
        other => Err(format!(
            "attribute 'to' must be \"f32\" or \"bf16\", got {other:?}"
        )),
    }
}

fn sigmoid(v: Expr) -> Expr {
    c(1.0) / (c(1.0) + (-v).exp())
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;
const INV_SQRT_2PI: f32 = 0.398_942_3;

fn tanh_form(a: &Attrs) -> bool {
    matches!(a.get("approximate"), Some(AttrValue::Str(s)) if s == "tanh")
}

/// `dnn.add`.
pub fn add(_: &Attrs) -> Result<Expr, String> {
    Ok(x(0) + x(1))
}
/// `dnn.sub`.
pub fn sub(_: &Attrs) -> Result<Expr, String> {
    Ok(x(0) - x(1))
}
/// `dnn.mul`.
pub fn mul(_: &Attrs) -> Result<Expr, String> {
    Ok(x(0) * x(1))
}
/// `dnn.div`.
pub fn div(_: &Attrs) -> Result<Expr, String> {
    Ok(x(0) / x(1))
}
/// `dnn.neg`.
pub fn neg(_: &Attrs) -> Result<Expr, String> {
    Ok(-x(0))
}
/// `dnn.exp`.
pub fn exp(_: &Attrs) -> Result<Expr, String> {
    Ok(x(0).exp())
}
/// `dnn.log`.
pub fn log(_: &Attrs) -> Result<Expr, String> {
    Ok(x(0).ln())
}
/// `dnn.sqrt`.
pub fn sqrt(_: &Attrs) -> Result<Expr, String> {
    Ok(x(0).sqrt())
}
/// `dnn.rsqrt`.
pub fn rsqrt(_: &Attrs) -> Result<Expr, String> {
    Ok(c(1.0) / x(0).sqrt())
}
/// `dnn.sigmoid`.
pub fn sigmoid_op(_: &Attrs) -> Result<Expr, String> {
    Ok(sigmoid(x(0)))
}
/// `dnn.tanh`.
pub fn tanh(_: &Attrs) -> Result<Expr, String> {
    Ok(x(0).tanh())
}
/// `dnn.relu`.
pub fn relu(_: &Attrs) -> Result<Expr, String> {
    Ok(x(0).max(c(0.0)))
}
/// `dnn.silu`.
pub fn silu(_: &Attrs) -> Result<Expr, String> {
    Ok(x(0) * sigmoid(x(0)))
}
/// `dnn.gelu` (erf form, or `approximate = "tanh"`).
pub fn gelu(a: &Attrs) -> Result<Expr, String> {
    let p = x(0);
    Ok(if tanh_form(a) {
        c(0.5)
            * p.clone()
            * (c(1.0)
                + (c(SQRT_2_OVER_PI) * (p.clone() + c(GELU_C) * p.clone() * p.clone() * p)).tanh())
    } else {
        c(0.5) * p.clone() * (c(1.0) + (p * c(std::f32::consts::FRAC_1_SQRT_2)).erf())
    })
}
/// `dnn.gelu_grad` (operands dy, x).
pub fn gelu_grad(a: &Attrs) -> Result<Expr, String> {
    let (d, p) = (x(0), x(1));
    Ok(if tanh_form(a) {
        let t = (c(SQRT_2_OVER_PI) * (p.clone() + c(GELU_C) * p.clone() * p.clone() * p.clone()))
            .tanh();
        let du = c(SQRT_2_OVER_PI) * (c(1.0) + c(3.0 * GELU_C) * p.clone() * p.clone());
        d * (c(0.5) * (c(1.0) + t.clone()) + c(0.5) * p * (c(1.0) - t.clone() * t) * du)
    } else {
        let u = p.clone() * c(std::f32::consts::FRAC_1_SQRT_2);
        let g = (-(u.clone().abs() * u.clone().abs())).exp();
        d * (c(0.5) * (c(1.0) + u.erf()) + p * c(INV_SQRT_2PI) * g)
    })
}
/// `dnn.silu_grad` (operands dy, x).
pub fn silu_grad(_: &Attrs) -> Result<Expr, String> {
    let (d, p) = (x(0), x(1));
    let s = sigmoid(p.clone());
    Ok(d * s.clone() * (c(1.0) + p * (c(1.0) - s)))
}
/// `dnn.relu_grad` (operands dy, x).
pub fn relu_grad(_: &Attrs) -> Result<Expr, String> {
    Ok(x(1).if_gt(c(0.0), x(0), c(0.0)))
}
/// `dnn.tanh_grad` (operands dy, y).
pub fn tanh_grad(_: &Attrs) -> Result<Expr, String> {
    Ok(x(0) * (c(1.0) - x(1) * x(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        let tie = 2f32.powi(-8);
        // bf16 keeps 8 significant bits: 1 + k 2^-7 are the neighbours of 1.
        assert_eq!(round_bf16(1.0 + tie), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 * tie), 1.0 + 4.0 * tie);
        assert_eq!(round_bf16(1.0 + 1.01 * tie), 1.0 + 2.0 * tie);
        assert_eq!(round_bf16(-(1.0 + 0.99 * tie)), -1.0);
        assert_eq!(round_bf16(0.1), 0.100_097_656);
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert_eq!(round_bf16(-0.0).to_bits(), (-0.0f32).to_bits());
        assert!(round_bf16(f32::NAN).is_nan());
        // Every bf16 is its own rounding.
        for bits in [0x3f80u32, 0x4049, 0x7f7f, 0x0001, 0x8080] {
            let v = f32::from_bits(bits << 16);
            assert_eq!(round_bf16(v).to_bits(), v.to_bits());
        }
    }

    #[test]
    fn substitution_fuses_producers() {
        // gelu(a + b): the add's formula in place of gelu's operand.
        let g = gelu(&Attrs::new()).unwrap();
        let fused = g.substitute(&mut |_| x(0) + x(1));
        assert_eq!(fused.inputs(), vec![0, 1]);
        assert!(fused.size() > g.size());
    }
}
