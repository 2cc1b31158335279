//! Elementwise ops as scalar formulas: what one element of the result is, in terms of the
//! same element of each operand (broadcast as numpy does). An op's formula is written once,
//! generic over [`Scalar`] ([`Elementwise`], declared with the op in
//! [`crate::spec::Traits::scalar`]), and has two instantiations: over [`Expr`] it is a tree
//! that code generators fuse into kernels without knowing op names; over `f32` it is the
//! CPU runtime's kernel for the op (monomorphized into a vectorized loop, [`cpu`]). The math
//! functions mean the same in both (`exp`, `erf` by the same algorithms), so generated
//! kernels match the runtime's results.

pub mod cpu;

use crate::types::Attrs;
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

/// What an op's formula is written over: [`Expr`] (the formula as a tree) and `f32` (its
/// value, as the CPU runtime computes it).
pub trait Scalar:
    Clone
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
{
    /// A constant.
    fn c(v: f32) -> Self;
    /// e^self.
    fn exp(self) -> Self;
    /// ln(self).
    fn ln(self) -> Self;
    /// sqrt(self).
    fn sqrt(self) -> Self;
    /// tanh(self).
    fn tanh(self) -> Self;
    /// erf(self).
    fn erf(self) -> Self;
    /// |self|.
    fn abs(self) -> Self;
    /// self rounded to bfloat16 precision.
    fn round_bf16(self) -> Self;
    /// The larger (self when other is NaN).
    fn max(self, other: Self) -> Self;
    /// `then` where self > rhs, else `otherwise` (false when either is NaN).
    fn if_gt(self, rhs: Self, then: Self, otherwise: Self) -> Self;
}

/// An elementwise op's formula, written once for every [`Scalar`]: a unit type per op,
/// named by its spec (`scalar: Some(&Gelu)`), is the op's formula for code generators and
/// its CPU kernel ([`Formula`]).
pub trait Elementwise: Sync {
    /// Its operands (1 or 2).
    const ARITY: usize;
    /// The form the op's attributes choose (gelu's erf or tanh form), numbered from 0 (at
    /// most 4 forms); the CPU loop is compiled once per form, the choice outside the loop.
    #[inline(always)]
    fn form(a: &Attrs) -> Result<usize, String> {
        let _ = a;
        Ok(0)
    }
    /// One element of the result, in form `form`, from element `k` of operand `k`, `x[k]`.
    fn formula<T: Scalar>(form: usize, x: &[T]) -> T;
}

/// An op's formula as the specs hold it (every [`Elementwise`] is one).
pub trait Formula: Sync {
    /// Its operands.
    fn arity(&self) -> usize;
    /// The formula as a tree, for an op with attributes `a`.
    fn expr(&self, a: &Attrs) -> Result<Expr, String>;
    /// Its values in f32: `out[i]` from element `i` of each of `ins` (one slice per
    /// operand, each of `out`'s length), in a loop the compiler vectorizes.
    fn eval(&self, a: &Attrs, ins: &[&[f32]], out: &mut [f32]) -> Result<(), String>;
}

impl<E: Elementwise> Formula for E {
    fn arity(&self) -> usize {
        E::ARITY
    }

    fn expr(&self, a: &Attrs) -> Result<Expr, String> {
        let xs: Vec<Expr> = (0..E::ARITY).map(x).collect();
        Ok(E::formula(E::form(a)?, &xs))
    }

    fn eval(&self, a: &Attrs, ins: &[&[f32]], out: &mut [f32]) -> Result<(), String> {
        let form = E::form(a)?;
        if ins.len() != E::ARITY || ins.iter().any(|s| s.len() != out.len()) {
            return Err(format!(
                "a formula of {} operand(s) given {} (of {:?} elements for {})",
                E::ARITY,
                ins.len(),
                ins.iter().map(|s| s.len()).collect::<Vec<_>>(),
                out.len()
            ));
        }
        // One loop per (arity, form): the form a constant in each, so that its branches
        // fold away and the loop vectorizes.
        macro_rules! run {
            ($form:literal) => {
                match E::ARITY {
                    1 => cpu::map1_into(ins[0], out, |u| E::formula($form, &[u])),
                    2 => cpu::map2_into(ins[0], ins[1], out, |u, v| E::formula($form, &[u, v])),
                    n => {
                        return Err(format!(
                            "formulas of {n} operands are not supported (1 or 2)"
                        ))
                    }
                }
            };
        }
        match form {
            0 => run!(0),
            1 => run!(1),
            2 => run!(2),
            3 => run!(3),
            n => {
                return Err(format!(
                    "form {n} of a formula: at most 4 forms are supported"
                ))
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for dyn Formula {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Formula({} operands)", self.arity())
    }
}

/// How the specs name an op's formula.
pub type ScalarRule = &'static dyn Formula;

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

    /// The formula's value at `x` (operand `k`'s element is `x[k]`): over `f32`, what the CPU
    /// computes; over `Expr`, the tree with its operands substituted.
    pub fn eval<T: Scalar>(&self, x: &[T]) -> T {
        match self {
            Expr::Input(k) => x[*k].clone(),
            Expr::Const(v) => T::c(*v),
            Expr::Un(u, a) => {
                let a = a.eval(x);
                match u {
                    Un::Neg => -a,
                    Un::Exp => a.exp(),
                    Un::Log => a.ln(),
                    Un::Sqrt => a.sqrt(),
                    Un::Tanh => a.tanh(),
                    Un::Erf => a.erf(),
                    Un::Abs => a.abs(),
                    Un::RoundBf16 => a.round_bf16(),
                }
            }
            Expr::Bin(b, l, r) => {
                let (l, r) = (l.eval(x), r.eval(x));
                match b {
                    Bin::Add => l + r,
                    Bin::Sub => l - r,
                    Bin::Mul => l * r,
                    Bin::Div => l / r,
                    Bin::Max => l.max(r),
                }
            }
            Expr::IfGt {
                lhs,
                rhs,
                then,
                otherwise,
            } => lhs
                .eval(x)
                .if_gt(rhs.eval(x), then.eval(x), otherwise.eval(x)),
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

/// The formula as a tree.
impl Scalar for Expr {
    fn c(v: f32) -> Expr {
        Expr::Const(v)
    }
    fn exp(self) -> Expr {
        self.un(Un::Exp)
    }
    fn ln(self) -> Expr {
        self.un(Un::Log)
    }
    fn sqrt(self) -> Expr {
        self.un(Un::Sqrt)
    }
    fn tanh(self) -> Expr {
        self.un(Un::Tanh)
    }
    fn erf(self) -> Expr {
        self.un(Un::Erf)
    }
    fn abs(self) -> Expr {
        self.un(Un::Abs)
    }
    fn round_bf16(self) -> Expr {
        self.un(Un::RoundBf16)
    }
    fn max(self, other: Expr) -> Expr {
        Expr::Bin(Bin::Max, Box::new(self), Box::new(other))
    }
    fn if_gt(self, rhs: Expr, then: Expr, otherwise: Expr) -> Expr {
        Expr::IfGt {
            lhs: Box::new(self),
            rhs: Box::new(rhs),
            then: Box::new(then),
            otherwise: Box::new(otherwise),
        }
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
        // exp(a + b) * 2: the add's formula in place of the operand.
        let g = x(0).exp() * c(2.0);
        let fused = g.substitute(&mut |_| x(0) + x(1));
        assert_eq!(fused.inputs(), vec![0, 1]);
        assert!(fused.size() > g.size());
    }
}
