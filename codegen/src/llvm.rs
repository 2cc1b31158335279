//! Kernels as LLVM IR (inkwell), generated once and lowered two ways.
//!
//! Each kernel `K` is an internal function `K.body(i64 i, ptr in0, ..., ptr out)` over
//! generic pointers computing element `i`. The targets add entry points to a copy of the
//! module:
//! - PTX: `K(ptr addrspace(1) in0, ..., ptr addrspace(1) out, i64 n)` with the
//!   `ptx_kernel` calling convention (71); `i = ctaid.x * ntid.x + tid.x`, nothing when
//!   `i >= n`; the global pointers are cast to generic ones for the body (the optimizer's
//!   address-space inference turns its accesses back into `ld.global` / `st.global`);
//! - host: `K.host(ptr args, i64 n)`, a loop over `i` in `0..n` with the buffers read from
//!   the `args` array: the thread index becomes a loop index.
//!
//! Math functions are generated into the module (no libm on a GPU) with the CPU
//! runtime's algorithms: `exp` and `erf` exactly as `runtime/src/kernels/math.rs`; `log`
//! and `tanh` as Cephes' single-precision `logf` / `tanhf` (within 2 ulp of libm).

use crate::kernel::Elementwise;
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::{Linkage, Module};
use inkwell::types::BasicMetadataTypeEnum;
use inkwell::values::{BasicMetadataValueEnum, FloatValue, FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};
use nnscaler_dialects::scalar::{Bin, Expr, Un};

/// Errors of the LLVM builder, as messages.
pub type R<T> = Result<T, String>;

fn e<T, E: std::fmt::Display>(r: Result<T, E>) -> R<T> {
    r.map_err(|e| format!("LLVM builder: {e}"))
}

/// Builds kernels into one module.
pub struct Gen<'ctx> {
    /// The LLVM context.
    pub ctx: &'ctx Context,
    /// The module the kernels go into.
    pub module: Module<'ctx>,
    b: Builder<'ctx>,
}

impl std::fmt::Debug for Gen<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gen")
            .field("module", &self.module.get_name())
            .finish()
    }
}

impl<'ctx> Gen<'ctx> {
    /// An empty module named `name`.
    pub fn new(ctx: &'ctx Context, name: &str) -> Self {
        Gen {
            ctx,
            module: ctx.create_module(name),
            b: ctx.create_builder(),
        }
    }

    fn intrinsic(&self, name: &str) -> R<FunctionValue<'ctx>> {
        let f32t = self.ctx.f32_type();
        Intrinsic::find(name)
            .and_then(|i| i.get_declaration(&self.module, &[f32t.into()]))
            .ok_or_else(|| format!("LLVM has no intrinsic {name}"))
    }

    fn call(&self, f: FunctionValue<'ctx>, args: &[FloatValue<'ctx>]) -> R<FloatValue<'ctx>> {
        let a: Vec<BasicMetadataValueEnum> = args.iter().map(|&v| v.into()).collect();
        let r = e(self.b.build_call(f, &a, ""))?;
        r.try_as_basic_value()
            .basic()
            .map(|v| v.into_float_value())
            .ok_or_else(|| "a math call returned nothing".to_string())
    }

    fn fconst(&self, v: f32) -> FloatValue<'ctx> {
        self.ctx.f32_type().const_float(f64::from(v))
    }

    fn iconst(&self, v: i64) -> IntValue<'ctx> {
        self.ctx.i32_type().const_int(v as u64, true)
    }

    /// A math helper `nns.<name>(f32) -> f32`, built once per module, always inlined.
    fn helper(
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

    fn fadd(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_add(a, b, ""))
    }
    fn fsub(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_sub(a, b, ""))
    }
    fn fmul(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_mul(a, b, ""))
    }
    fn fdiv(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_div(a, b, ""))
    }
    fn select(
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
    fn poly(&self, x: FloatValue<'ctx>, c: &[f32]) -> R<FloatValue<'ctx>> {
        let mut acc = self.fconst(c[c.len() - 1]);
        for &k in c[..c.len() - 1].iter().rev() {
            acc = self.fadd(self.fconst(k), self.fmul(x, acc)?)?;
        }
        Ok(acc)
    }

    /// e^x: the CPU runtime's `math::exp` step for step.
    fn exp_fn(&self) -> R<FunctionValue<'ctx>> {
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
    fn erf_fn(&self) -> R<FunctionValue<'ctx>> {
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
    fn log_fn(&self) -> R<FunctionValue<'ctx>> {
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

    /// tanh(x): Cephes `tanhf` (an odd polynomial below |x| = 0.625, else from exp).
    fn tanh_fn(&self) -> R<FunctionValue<'ctx>> {
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

    /// Emits `expr` at the current position; `load(k)` gives input `k`'s element.
    fn expr(
        &self,
        x: &Expr,
        load: &mut impl FnMut(&Self, usize) -> R<FloatValue<'ctx>>,
    ) -> R<FloatValue<'ctx>> {
        Ok(match x {
            Expr::Input(k) => load(self, *k)?,
            Expr::Const(v) => self.fconst(*v),
            Expr::Un(u, a) => {
                let a = self.expr(a, load)?;
                match u {
                    Un::Neg => e(self.b.build_float_neg(a, ""))?,
                    Un::Exp => self.call(self.exp_fn()?, &[a])?,
                    Un::Log => self.call(self.log_fn()?, &[a])?,
                    Un::Sqrt => self.call(self.intrinsic("llvm.sqrt")?, &[a])?,
                    Un::Tanh => self.call(self.tanh_fn()?, &[a])?,
                    Un::Erf => self.call(self.erf_fn()?, &[a])?,
                    Un::Abs => self.call(self.intrinsic("llvm.fabs")?, &[a])?,
                }
            }
            Expr::Bin(op, l, r) => {
                let (l, r) = (self.expr(l, load)?, self.expr(r, load)?);
                match op {
                    Bin::Add => self.fadd(l, r)?,
                    Bin::Sub => self.fsub(l, r)?,
                    Bin::Mul => self.fmul(l, r)?,
                    Bin::Div => self.fdiv(l, r)?,
                    Bin::Max => self.call(self.intrinsic("llvm.maxnum")?, &[l, r])?,
                }
            }
            Expr::IfGt {
                lhs,
                rhs,
                then,
                otherwise,
            } => {
                let (l, r) = (self.expr(lhs, load)?, self.expr(rhs, load)?);
                let (t, o) = (self.expr(then, load)?, self.expr(otherwise, load)?);
                self.select(FloatPredicate::OGT, l, r, t, o)?
            }
        })
    }

    /// The flat offset into an input of shape `shape` (broadcast against `out`) of the
    /// result's element `i`.
    fn broadcast_offset(
        &self,
        i: IntValue<'ctx>,
        shape: &[usize],
        out: &[usize],
    ) -> R<IntValue<'ctx>> {
        let i64t = self.ctx.i64_type();
        let n: usize = shape.iter().product();
        if shape == out || n == out.iter().product::<usize>() {
            return Ok(i);
        }
        if n == 1 {
            return Ok(i64t.const_zero());
        }
        let off = out.len() - shape.len();
        let mut ostride = 1usize;
        let mut istride = 1usize;
        let mut acc = i64t.const_zero();
        for d in (0..out.len()).rev() {
            let od = out[d];
            let id = if d >= off { shape[d - off] } else { 1 };
            if id != 1 {
                // ((i / ostride) % od) * istride
                let q =
                    e(self
                        .b
                        .build_int_unsigned_div(i, i64t.const_int(ostride as u64, false), ""))?;
                let r = e(self
                    .b
                    .build_int_unsigned_rem(q, i64t.const_int(od as u64, false), ""))?;
                let t = e(self
                    .b
                    .build_int_mul(r, i64t.const_int(istride as u64, false), ""))?;
                acc = e(self.b.build_int_add(acc, t, ""))?;
                istride *= id;
            }
            ostride *= od;
        }
        Ok(acc)
    }

    /// Adds `K.body(i64 i, ptr in..., ptr out)` for an elementwise kernel.
    pub fn elementwise(&self, k: &Elementwise) -> R<FunctionValue<'ctx>> {
        let i64t = self.ctx.i64_type();
        let f32t = self.ctx.f32_type();
        let ptr = self.ctx.ptr_type(AddressSpace::default());
        let mut params: Vec<BasicMetadataTypeEnum> = vec![i64t.into()];
        params.extend(std::iter::repeat_n(
            BasicMetadataTypeEnum::from(ptr),
            k.inputs.len() + 1,
        ));
        let f = self.module.add_function(
            &format!("{}.body", k.name),
            self.ctx.void_type().fn_type(&params, false),
            Some(Linkage::Internal),
        );
        let inline = self
            .ctx
            .create_enum_attribute(Attribute::get_named_enum_kind_id("alwaysinline"), 0);
        f.add_attribute(AttributeLoc::Function, inline);
        let entry = self.ctx.append_basic_block(f, "entry");
        self.b.position_at_end(entry);
        let i = f.get_nth_param(0).ok_or("no index")?.into_int_value();
        let buf = |j: usize| -> R<PointerValue<'ctx>> {
            Ok(f.get_nth_param(1 + j as u32)
                .ok_or("missing buffer parameter")?
                .into_pointer_value())
        };
        // Each input read once, where the formula first needs it.
        let mut loaded: Vec<Option<FloatValue<'ctx>>> = vec![None; k.inputs.len()];
        let v = self.expr(&k.expr, &mut |g: &Self, j: usize| {
            if let Some(v) = loaded[j] {
                return Ok(v);
            }
            let off = g.broadcast_offset(i, &k.inputs[j], &k.out)?;
            // SAFETY of the generated code: `off` < the input's length by construction.
            let p = e(unsafe { g.b.build_in_bounds_gep(f32t, buf(j)?, &[off], "") })?;
            let v = e(g.b.build_load(f32t, p, ""))?.into_float_value();
            loaded[j] = Some(v);
            Ok(v)
        })?;
        // SAFETY of the generated code: `i` < the result's length (the entries check).
        let p = e(unsafe {
            self.b
                .build_in_bounds_gep(f32t, buf(k.inputs.len())?, &[i], "")
        })?;
        e(self.b.build_store(p, v))?;
        e(self.b.build_return(None))?;
        Ok(f)
    }

    /// Adds the PTX entry of a kernel whose body takes `buffers` pointers.
    pub fn ptx_entry(&self, name: &str, buffers: usize) -> R<()> {
        let body = self
            .module
            .get_function(&format!("{name}.body"))
            .ok_or_else(|| format!("no body for kernel {name}"))?;
        let i32t = self.ctx.i32_type();
        let i64t = self.ctx.i64_type();
        let global = self.ctx.ptr_type(AddressSpace::from(1u16));
        let generic = self.ctx.ptr_type(AddressSpace::default());
        let mut params: Vec<BasicMetadataTypeEnum> = vec![global.into(); buffers];
        params.push(i64t.into());
        let f = self
            .module
            .add_function(name, self.ctx.void_type().fn_type(&params, false), None);
        f.set_call_conventions(71); // ptx_kernel
        let entry = self.ctx.append_basic_block(f, "entry");
        let run = self.ctx.append_basic_block(f, "run");
        let done = self.ctx.append_basic_block(f, "done");
        self.b.position_at_end(entry);
        let sreg = |r: &str| -> R<IntValue<'ctx>> {
            let name = format!("llvm.nvvm.read.ptx.sreg.{r}");
            let f = self.module.get_function(&name).unwrap_or_else(|| {
                self.module
                    .add_function(&name, i32t.fn_type(&[], false), None)
            });
            let v = e(self.b.build_call(f, &[], ""))?
                .try_as_basic_value()
                .basic()
                .ok_or("special register read returned nothing")?
                .into_int_value();
            e(self.b.build_int_z_extend(v, i64t, ""))
        };
        let (ctaid, ntid, tid) = (sreg("ctaid.x")?, sreg("ntid.x")?, sreg("tid.x")?);
        let i = e(self
            .b
            .build_int_add(e(self.b.build_int_mul(ctaid, ntid, ""))?, tid, "i"))?;
        let n = f
            .get_nth_param(buffers as u32)
            .ok_or("no length")?
            .into_int_value();
        let inside = e(self.b.build_int_compare(IntPredicate::ULT, i, n, ""))?;
        e(self.b.build_conditional_branch(inside, run, done))?;
        self.b.position_at_end(run);
        let mut args: Vec<BasicMetadataValueEnum> = vec![i.into()];
        for j in 0..buffers {
            let p = f
                .get_nth_param(j as u32)
                .ok_or("missing buffer")?
                .into_pointer_value();
            args.push(e(self.b.build_address_space_cast(p, generic, ""))?.into());
        }
        e(self.b.build_call(body, &args, ""))?;
        e(self.b.build_unconditional_branch(done))?;
        self.b.position_at_end(done);
        e(self.b.build_return(None))?;
        Ok(())
    }

    /// Adds the host entry `name.host(ptr args, i64 n)`: the body for every `i < n`.
    pub fn host_entry(&self, name: &str, buffers: usize) -> R<()> {
        let body = self
            .module
            .get_function(&format!("{name}.body"))
            .ok_or_else(|| format!("no body for kernel {name}"))?;
        let i64t = self.ctx.i64_type();
        let ptr = self.ctx.ptr_type(AddressSpace::default());
        let f = self.module.add_function(
            &format!("{name}.host"),
            self.ctx
                .void_type()
                .fn_type(&[ptr.into(), i64t.into()], false),
            None,
        );
        let entry = self.ctx.append_basic_block(f, "entry");
        let lp = self.ctx.append_basic_block(f, "loop");
        let done = self.ctx.append_basic_block(f, "done");
        self.b.position_at_end(entry);
        let argv = f.get_nth_param(0).ok_or("no args")?.into_pointer_value();
        let n = f.get_nth_param(1).ok_or("no length")?.into_int_value();
        let mut bufs: Vec<BasicMetadataValueEnum> = Vec::new();
        for j in 0..buffers {
            // SAFETY of the generated code: `args` holds `buffers` pointers.
            let slot = e(unsafe {
                self.b
                    .build_in_bounds_gep(ptr, argv, &[i64t.const_int(j as u64, false)], "")
            })?;
            bufs.push(e(self.b.build_load(ptr, slot, ""))?.into());
        }
        let any = e(self
            .b
            .build_int_compare(IntPredicate::UGT, n, i64t.const_zero(), ""))?;
        e(self.b.build_conditional_branch(any, lp, done))?;
        self.b.position_at_end(lp);
        let phi = e(self.b.build_phi(i64t, "i"))?;
        let i = phi.as_basic_value().into_int_value();
        let mut args: Vec<BasicMetadataValueEnum> = vec![i.into()];
        args.extend(bufs);
        e(self.b.build_call(body, &args, ""))?;
        let next = e(self.b.build_int_add(i, i64t.const_int(1, false), ""))?;
        let more = e(self.b.build_int_compare(IntPredicate::ULT, next, n, ""))?;
        phi.add_incoming(&[(&i64t.const_zero(), entry), (&next, lp)]);
        e(self.b.build_conditional_branch(more, lp, done))?;
        self.b.position_at_end(done);
        e(self.b.build_return(None))?;
        Ok(())
    }
}
