//! Scalar math in the generated IR: constants, arithmetic, and the math functions with the
//! CPU runtime's algorithms (`exp`, `erf`, `log`, `tanh`, rounding to bf16), each built once
//! per module as an always-inlined helper.

use super::*;

impl<'ctx> Gen<'ctx> {
    pub(super) fn intrinsic(&self, name: &str) -> R<FunctionValue<'ctx>> {
        let f32t = self.ctx.f32_type();
        Intrinsic::find(name)
            .and_then(|i| i.get_declaration(&self.module, &[f32t.into()]))
            .ok_or_else(|| format!("LLVM has no intrinsic {name}"))
    }

    pub(super) fn call(
        &self,
        f: FunctionValue<'ctx>,
        args: &[FloatValue<'ctx>],
    ) -> R<FloatValue<'ctx>> {
        let a: Vec<BasicMetadataValueEnum> = args.iter().map(|&v| v.into()).collect();
        let r = e(self.b.build_call(f, &a, ""))?;
        r.try_as_basic_value()
            .basic()
            .map(|v| v.into_float_value())
            .ok_or_else(|| "a math call returned nothing".to_string())
    }

    pub(super) fn fconst(&self, v: f32) -> FloatValue<'ctx> {
        self.ctx.f32_type().const_float(f64::from(v))
    }

    pub(super) fn iconst(&self, v: i64) -> IntValue<'ctx> {
        self.ctx.i32_type().const_int(v as u64, true)
    }

    /// A math helper `nns.<name>(f32) -> f32`, built once per module, always inlined.
    pub(super) fn helper(
        &self,
        name: &str,
        body: impl FnOnce(&Self, FloatValue<'ctx>) -> R<FloatValue<'ctx>>,
    ) -> R<FunctionValue<'ctx>> {
        let sym = format!("nns.{name}");
        if let Some(f) = self.module.get_function(&sym) {
            return Ok(f);
        }
        let f32t = self.ctx.f32_type();
        let f = self.module.add_function(
            &sym,
            f32t.fn_type(&[f32t.into()], false),
            Some(Linkage::Internal),
        );
        let inline = self
            .ctx
            .create_enum_attribute(Attribute::get_named_enum_kind_id("alwaysinline"), 0);
        f.add_attribute(AttributeLoc::Function, inline);
        let saved = self.b.get_insert_block();
        let entry = self.ctx.append_basic_block(f, "entry");
        self.b.position_at_end(entry);
        let x = f
            .get_nth_param(0)
            .ok_or("helper without parameter")?
            .into_float_value();
        let r = body(self, x)?;
        e(self.b.build_return(Some(&r)))?;
        if let Some(bb) = saved {
            self.b.position_at_end(bb);
        }
        Ok(f)
    }

    pub(super) fn fadd(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_add(a, b, ""))
    }
    pub(super) fn fsub(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_sub(a, b, ""))
    }
    pub(super) fn fmul(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_mul(a, b, ""))
    }
    pub(super) fn fdiv(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_div(a, b, ""))
    }
    pub(super) fn select(
        &self,
        pred: FloatPredicate,
        a: FloatValue<'ctx>,
        b: FloatValue<'ctx>,
        then: FloatValue<'ctx>,
        otherwise: FloatValue<'ctx>,
    ) -> R<FloatValue<'ctx>> {
        let c = e(self.b.build_float_compare(pred, a, b, ""))?;
        Ok(e(self.b.build_select(c, then, otherwise, ""))?.into_float_value())
    }
    /// Horner's rule: `c[0] + x * (c[1] + x * (...))`.
    pub(super) fn poly(&self, x: FloatValue<'ctx>, c: &[f32]) -> R<FloatValue<'ctx>> {
        let mut acc = self.fconst(c[c.len() - 1]);
        for &k in c[..c.len() - 1].iter().rev() {
            acc = self.fadd(self.fconst(k), self.fmul(x, acc)?)?;
        }
        Ok(acc)
    }

    /// e^x: the CPU runtime's `math::exp` step for step.
    pub(super) fn exp_fn(&self) -> R<FunctionValue<'ctx>> {
        self.helper("exp", |g, x| {
            let i32t = g.ctx.i32_type();
            let f32t = g.ctx.f32_type();
            let lo = g.fconst(-104.0);
            let hi = g.fconst(88.72);
            let c = g.select(FloatPredicate::OLT, x, lo, lo, x)?;
            let c = g.select(FloatPredicate::OGT, c, hi, hi, c)?;
            let round = g.fconst(12_582_912.0);
            let n = g.fsub(
                g.fadd(g.fmul(c, g.fconst(std::f32::consts::LOG2_E))?, round)?,
                round,
            )?;
            let r = g.fsub(
                g.fsub(c, g.fmul(n, g.fconst(0.693_145_75))?)?,
                g.fmul(n, g.fconst(1.428_606_8e-6))?,
            )?;
            let p = g.poly(
                r,
                &[
                    1.0,
                    1.0,
                    0.5,
                    1.0 / 6.0,
                    1.0 / 24.0,
                    1.0 / 120.0,
                    1.0 / 720.0,
                    1.0 / 5040.0,
                ],
            )?;
            let ni = e(g.b.build_float_to_signed_int(n, i32t, ""))?;
            let n1 = e(g.b.build_right_shift(ni, g.iconst(1), true, ""))?;
            let bits = |k: IntValue<'ctx>| -> R<FloatValue<'ctx>> {
                let s = e(g.b.build_int_add(k, g.iconst(127), ""))?;
                let s = e(g.b.build_left_shift(s, g.iconst(23), ""))?;
                Ok(e(g.b.build_bit_cast(s, f32t, ""))?.into_float_value())
            };
            let s1 = bits(n1)?;
            let s2 = bits(e(g.b.build_int_sub(ni, n1, ""))?)?;
            let v = g.fmul(g.fmul(p, s1)?, s2)?;
            let v = g.select(FloatPredicate::OGT, x, hi, g.fconst(f32::INFINITY), v)?;
            let v = g.select(FloatPredicate::OLT, x, lo, g.fconst(0.0), v)?;
            // NaN in, NaN out.
            g.select(FloatPredicate::UNO, x, x, x, v)
        })
    }

    /// erf(x): Abramowitz & Stegun 7.1.26 as the runtime's `erf_and_gauss`.
    pub(super) fn erf_fn(&self) -> R<FunctionValue<'ctx>> {
        let exp = self.exp_fn()?;
        self.helper("erf", |g, x| {
            let a = g.call(g.intrinsic("llvm.fabs")?, &[x])?;
            let t = g.fdiv(
                g.fconst(1.0),
                g.fadd(g.fconst(1.0), g.fmul(g.fconst(0.327_591_1), a)?)?,
            )?;
            let poly = g.fmul(
                t,
                g.poly(
                    t,
                    &[
                        0.254_829_6,
                        -0.284_496_74,
                        1.421_413_7,
                        -1.453_152_1,
                        1.061_405_4,
                    ],
                )?,
            )?;
            let na2 = e(g.b.build_float_neg(g.fmul(a, a)?, ""))?;
            let gauss = g.call(exp, &[na2])?;
            let v = g.fsub(g.fconst(1.0), g.fmul(poly, gauss)?)?;
            g.call(g.intrinsic("llvm.copysign")?, &[v, x])
        })
    }

    /// ln(x): Cephes `logf` (frexp, a degree-9 polynomial on [sqrt(1/2) - 1, sqrt(2) - 1]);
    /// 0 gives -inf, negatives NaN, +inf and NaN themselves.
    pub(super) fn log_fn(&self) -> R<FunctionValue<'ctx>> {
        self.helper("log", |g, x0| {
            let i32t = g.ctx.i32_type();
            let f32t = g.ctx.f32_type();
            // Subnormals: scale by 2^23 first.
            let tiny = g.fconst(f32::MIN_POSITIVE);
            let x = g.select(
                FloatPredicate::OLT,
                x0,
                tiny,
                g.fmul(x0, g.fconst(8_388_608.0))?,
                x0,
            )?;
            let bias = g.select(FloatPredicate::OLT, x0, tiny, g.fconst(23.0), g.fconst(0.0))?;
            let bits = e(g.b.build_bit_cast(x, i32t, ""))?.into_int_value();
            let ex = e(g.b.build_right_shift(bits, g.iconst(23), false, ""))?;
            let ex = e(g.b.build_and(ex, g.iconst(0xff), ""))?;
            let ex = e(g.b.build_int_sub(ex, g.iconst(126), ""))?;
            let mb = e(g.b.build_and(bits, g.iconst(0x807f_ffff), ""))?;
            let mb = e(g.b.build_or(mb, g.iconst(0x3f00_0000), ""))?;
            let m = e(g.b.build_bit_cast(mb, f32t, ""))?.into_float_value();
            let ef = e(g.b.build_signed_int_to_float(ex, f32t, ""))?;
            let ef = g.fsub(ef, bias)?;
            let small = e(g.b.build_float_compare(
                FloatPredicate::OLT,
                m,
                g.fconst(std::f32::consts::FRAC_1_SQRT_2),
                "",
            ))?;
            let ef =
                e(g.b.build_select(small, g.fsub(ef, g.fconst(1.0))?, ef, ""))?.into_float_value();
            let m = e(g.b.build_select(
                small,
                g.fsub(g.fadd(m, m)?, g.fconst(1.0))?,
                g.fsub(m, g.fconst(1.0))?,
                "",
            ))?
            .into_float_value();
            let z = g.fmul(m, m)?;
            let p = g.poly(
                m,
                &[
                    3.333_333e-1,
                    -2.499_999_4e-1,
                    2.000_071_5e-1,
                    -1.666_805_7e-1,
                    1.424_932_3e-1,
                    -1.242_014_1e-1,
                    1.167_699_9e-1,
                    -1.151_461e-1,
                    7.037_683_6e-2,
                ],
            )?;
            let mut y = g.fmul(g.fmul(p, m)?, z)?;
            y = g.fadd(y, g.fmul(ef, g.fconst(-2.121_944_4e-4))?)?;
            y = g.fsub(y, g.fmul(z, g.fconst(0.5))?)?;
            let r = g.fadd(g.fadd(m, y)?, g.fmul(ef, g.fconst(0.693_359_4))?)?;
            // Edge cases, as libm.
            let r = g.select(FloatPredicate::OEQ, x0, g.fconst(f32::INFINITY), x0, r)?;
            let r = g.select(
                FloatPredicate::OEQ,
                x0,
                g.fconst(0.0),
                g.fconst(f32::NEG_INFINITY),
                r,
            )?;
            let r = g.select(
                FloatPredicate::OLT,
                x0,
                g.fconst(0.0),
                g.fconst(f32::NAN),
                r,
            )?;
            g.select(FloatPredicate::UNO, x0, x0, x0, r)
        })
    }

    /// x rounded to bfloat16 (ties to even), as `scalar::round_bf16`: the bits plus
    /// 0x7fff plus the lowest kept bit, the low 16 bits cleared; NaN passes unchanged.
    pub(super) fn round_bf16_fn(&self) -> R<FunctionValue<'ctx>> {
        self.helper("round_bf16", |g, x| {
            let i32t = g.ctx.i32_type();
            let bits = e(g.b.build_bit_cast(x, i32t, ""))?.into_int_value();
            let shifted =
                e(g.b.build_right_shift(bits, i32t.const_int(16, false), false, ""))?;
            let lsb = e(g.b.build_and(shifted, i32t.const_int(1, false), ""))?;
            let bias = e(g.b.build_int_add(lsb, i32t.const_int(0x7fff, false), ""))?;
            let sum = e(g.b.build_int_add(bits, bias, ""))?;
            let kept = e(g.b.build_and(sum, i32t.const_int(0xffff_0000, false), ""))?;
            let r = e(g.b.build_bit_cast(kept, g.ctx.f32_type(), ""))?.into_float_value();
            g.select(FloatPredicate::UNO, x, x, x, r)
        })
    }

    /// tanh(x): Cephes `tanhf` (an odd polynomial below |x| = 0.625, else from exp).
    pub(super) fn tanh_fn(&self) -> R<FunctionValue<'ctx>> {
        let exp = self.exp_fn()?;
        self.helper("tanh", |g, x| {
            let a = g.call(g.intrinsic("llvm.fabs")?, &[x])?;
            let z = g.fmul(x, x)?;
            let p = g.poly(
                z,
                &[
                    -3.333_328e-1,
                    1.333_144_2e-1,
                    -5.373_971_6e-2,
                    2.063_909e-2,
                    -5.704_988_7e-3,
                ],
            )?;
            let small = g.fadd(g.fmul(g.fmul(p, z)?, x)?, x)?;
            let e2 = g.call(exp, &[g.fadd(a, a)?])?;
            let big = g.fsub(
                g.fconst(1.0),
                g.fdiv(g.fconst(2.0), g.fadd(e2, g.fconst(1.0))?)?,
            )?;
            let big = g.call(g.intrinsic("llvm.copysign")?, &[big, x])?;
            g.select(FloatPredicate::OLT, a, g.fconst(0.625), small, big)
        })
    }
}
