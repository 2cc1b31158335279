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
//! A team kernel ([`Kernel::team`] > 1; `team.rs`) is phases instead of a body, one GPU
//! block per index: its PTX entry runs them with barriers between, its host entry runs
//! each phase for every lane in turn.
//!
//! Math functions are generated into the module (no libm on a GPU) with the CPU
//! runtime's algorithms: `exp` and `erf` exactly as `runtime/src/kernels/math.rs`; `log`
//! and `tanh` as Cephes' single-precision `logf` / `tanhf` (within 2 ulp of libm).

use crate::kernel::{classes, Attn, Body, Buf, Elt, Kernel, Line, Reduce};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::{Linkage, Module};
use inkwell::types::{BasicMetadataTypeEnum, BasicTypeEnum, FloatType};
use inkwell::values::{
    BasicMetadataValueEnum, BasicValue, BasicValueEnum, FloatValue, FunctionValue, IntValue,
    PointerValue,
};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};
use nnscaler_dialects::scalar::{Bin, Expr, Un};
use std::cell::RefCell;
use std::collections::HashMap;

mod entries;
mod math;
mod mma;
mod team;
mod tiles;

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
    /// The team kernels built ([`Kernel::team`] > 1): how their entries run them.
    teams: RefCell<HashMap<String, team::Plan>>,
    /// Each kernel's compiled index count, which its entries never exceed whatever count
    /// they are launched with (none: a reducer, launched over any count).
    limits: RefCell<HashMap<String, u64>>,
    /// The element type of each buffer parameter of the kernel being built (a pointer
    /// not listed, such as a lane's own array, holds f32s): [`Gen::ldf`] and
    /// [`Gen::stf`] widen and round for [`Elt::Bf16`] buffers.
    elts: RefCell<HashMap<PointerValue<'ctx>, Elt>>,
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
            teams: RefCell::new(HashMap::new()),
            limits: RefCell::new(HashMap::new()),
            elts: RefCell::new(HashMap::new()),
        }
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
                    Un::RoundBf16 => self.call(self.round_bf16_fn()?, &[a])?,
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

    // --- Helpers for kernel bodies. ---

    fn i64c(&self, v: usize) -> IntValue<'ctx> {
        self.ctx.i64_type().const_int(v as u64, false)
    }

    fn dconst(&self, v: f64) -> FloatValue<'ctx> {
        self.ctx.f64_type().const_float(v)
    }

    fn intrinsic_of(&self, name: &str, ty: BasicTypeEnum<'ctx>) -> R<FunctionValue<'ctx>> {
        Intrinsic::find(name)
            .and_then(|i| i.get_declaration(&self.module, &[ty]))
            .ok_or_else(|| format!("LLVM has no intrinsic {name}"))
    }

    /// A stack slot of `ty` at the start of the current function's entry block (where
    /// O3's promotion to registers looks for them).
    fn entry_alloca(&self, ty: BasicTypeEnum<'ctx>) -> R<PointerValue<'ctx>> {
        let f = self
            .b
            .get_insert_block()
            .and_then(|b| b.get_parent())
            .ok_or("no function")?;
        let entry = f.get_first_basic_block().ok_or("no entry block")?;
        let tmp = self.ctx.create_builder();
        match entry.get_first_instruction() {
            Some(i) => tmp.position_before(&i),
            None => tmp.position_at_end(entry),
        }
        e(tmp.build_alloca(ty, ""))
    }

    /// A stack slot in the current function's entry block (O3 promotes it to a register),
    /// set to `init` here.
    fn var(&self, init: BasicValueEnum<'ctx>) -> R<PointerValue<'ctx>> {
        let p = self.entry_alloca(init.get_type())?;
        e(self.b.build_store(p, init))?;
        Ok(p)
    }

    fn getf(&self, p: PointerValue<'ctx>, ty: FloatType<'ctx>) -> R<FloatValue<'ctx>> {
        Ok(e(self.b.build_load(ty, p, ""))?.into_float_value())
    }

    fn geti(&self, p: PointerValue<'ctx>) -> R<IntValue<'ctx>> {
        Ok(e(self.b.build_load(self.ctx.i64_type(), p, ""))?.into_int_value())
    }

    fn set(&self, p: PointerValue<'ctx>, v: impl BasicValue<'ctx>) -> R<()> {
        e(self.b.build_store(p, v)).map(|_| ())
    }

    /// `f(j)` for `j` in `0..n`.
    fn for_range(&self, n: IntValue<'ctx>, f: impl FnMut(&Self, IntValue<'ctx>) -> R<()>) -> R<()> {
        self.for_step(self.i64c(0), n, 1, f)
    }

    /// `j = f(j)` from `start` while `j` is below `end`: a counted loop ([`Self::for_step`])
    /// or a list's walk.
    fn walk(
        &self,
        start: IntValue<'ctx>,
        end: IntValue<'ctx>,
        mut f: impl FnMut(&Self, IntValue<'ctx>) -> R<IntValue<'ctx>>,
    ) -> R<()> {
        let func = self
            .b
            .get_insert_block()
            .and_then(|b| b.get_parent())
            .ok_or("no function")?;
        let at = self.var(start.into())?;
        let cond = self.ctx.append_basic_block(func, "loop.cond");
        let body = self.ctx.append_basic_block(func, "loop.body");
        let exit = self.ctx.append_basic_block(func, "loop.end");
        e(self.b.build_unconditional_branch(cond))?;
        self.b.position_at_end(cond);
        let j = self.geti(at)?;
        let more = e(self.b.build_int_compare(IntPredicate::ULT, j, end, ""))?;
        e(self.b.build_conditional_branch(more, body, exit))?;
        self.b.position_at_end(body);
        let next = f(self, j)?;
        self.set(at, next)?;
        e(self.b.build_unconditional_branch(cond))?;
        self.b.position_at_end(exit);
        Ok(())
    }

    /// `f(j)` for `j` in `start, start + step, ...` below `n`.
    fn for_step(
        &self,
        start: IntValue<'ctx>,
        n: IntValue<'ctx>,
        step: usize,
        mut f: impl FnMut(&Self, IntValue<'ctx>) -> R<()>,
    ) -> R<()> {
        self.walk(start, n, |g, j| {
            f(g, j)?;
            e(g.b.build_int_add(j, g.i64c(step), ""))
        })
    }

    /// The offset, in a reduction's input of `shape`, of output element `i`'s first
    /// element (the kept dims' coordinates of `i`, row-major).
    fn reduce_base(&self, shape: &[usize], dims: &[usize], i: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        let st = strides(shape);
        let mut rem = i;
        let mut base = self.i64c(0);
        for d in (0..shape.len()).rev().filter(|d| !dims.contains(d)) {
            let c = self.rem_i(rem, shape[d])?;
            rem = self.div_i(rem, shape[d])?;
            base = self.add_i(base, self.mul_i(c, self.i64c(st[d]))?)?;
        }
        Ok(base)
    }

    /// The offset of the `r`-th element (row-major over the reduced `dims`) reduced into
    /// the output element whose first is at `base`.
    fn reduce_off(
        &self,
        shape: &[usize],
        dims: &[usize],
        base: IntValue<'ctx>,
        r: IntValue<'ctx>,
    ) -> R<IntValue<'ctx>> {
        let st = strides(shape);
        let mut rem = r;
        let mut off = base;
        for &d in dims.iter().rev() {
            let c = self.rem_i(rem, shape[d])?;
            rem = self.div_i(rem, shape[d])?;
            off = self.add_i(off, self.mul_i(c, self.i64c(st[d]))?)?;
        }
        Ok(off)
    }

    /// Runs `f` only where `c` holds.
    fn when(&self, c: IntValue<'ctx>, f: impl FnOnce(&Self) -> R<()>) -> R<()> {
        let func = self
            .b
            .get_insert_block()
            .and_then(|b| b.get_parent())
            .ok_or("no function")?;
        let then = self.ctx.append_basic_block(func, "if.then");
        let done = self.ctx.append_basic_block(func, "if.end");
        e(self.b.build_conditional_branch(c, then, done))?;
        self.b.position_at_end(then);
        f(self)?;
        e(self.b.build_unconditional_branch(done))?;
        self.b.position_at_end(done);
        Ok(())
    }

    /// Records the element types of a kernel's buffer parameters (inputs, then outputs).
    pub(crate) fn buffer_elts(&self, ptrs: &[PointerValue<'ctx>], bufs: &[&Buf]) {
        let mut m = self.elts.borrow_mut();
        for (p, b) in ptrs.iter().zip(bufs) {
            m.insert(*p, b.elt);
        }
    }

    /// The element type `base` points to (f32 unless it is a bf16 buffer parameter).
    fn elt_of(&self, base: PointerValue<'ctx>) -> Elt {
        match self.elts.borrow().get(&base) {
            Some(Elt::Bf16) => Elt::Bf16,
            _ => Elt::F32,
        }
    }

    /// The address of element `off` of a buffer of `elt`s.
    fn at(&self, base: PointerValue<'ctx>, elt: Elt, off: IntValue<'ctx>) -> R<PointerValue<'ctx>> {
        let ty: BasicTypeEnum = match elt {
            Elt::F32 => self.ctx.f32_type().into(),
            Elt::I64 => self.ctx.i64_type().into(),
            Elt::Bf16 => self.ctx.i16_type().into(),
        };
        // SAFETY of the generated code: every offset is below its buffer's length by the
        // index arithmetic of the body that asks for it.
        e(unsafe { self.b.build_in_bounds_gep(ty, base, &[off], "") })
    }

    /// Element `off` of a float buffer as f32 (a bf16 buffer's widened: its 16 bits
    /// become an f32's high half, exactly).
    fn ldf(&self, base: PointerValue<'ctx>, off: IntValue<'ctx>) -> R<FloatValue<'ctx>> {
        if self.elt_of(base) != Elt::Bf16 {
            return self.getf(self.at(base, Elt::F32, off)?, self.ctx.f32_type());
        }
        let i16t = self.ctx.i16_type();
        let i32t = self.ctx.i32_type();
        let h = e(self.b.build_load(i16t, self.at(base, Elt::Bf16, off)?, ""))?.into_int_value();
        let w = e(self.b.build_int_z_extend(h, i32t, ""))?;
        let bits = e(self.b.build_left_shift(w, i32t.const_int(16, false), ""))?;
        Ok(e(self.b.build_bit_cast(bits, self.ctx.f32_type(), ""))?.into_float_value())
    }

    fn ldi(&self, base: PointerValue<'ctx>, off: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        let v = self.geti(self.at(base, Elt::I64, off)?)?;
        align8(v.as_instruction_value())?;
        Ok(v)
    }

    /// Stores `v` at element `off` of a float buffer (a bf16 buffer's rounded to nearest
    /// even, as `scalar::round_bf16`; a NaN stored as bf16's quiet NaN).
    fn stf(&self, base: PointerValue<'ctx>, off: IntValue<'ctx>, v: FloatValue<'ctx>) -> R<()> {
        if self.elt_of(base) != Elt::Bf16 {
            return self.set(self.at(base, Elt::F32, off)?, v);
        }
        let i32t = self.ctx.i32_type();
        let r = self.call(self.round_bf16_fn()?, &[v])?;
        let bits = e(self.b.build_bit_cast(r, i32t, ""))?.into_int_value();
        let high = e(self
            .b
            .build_right_shift(bits, i32t.const_int(16, false), false, ""))?;
        let nan = e(self.b.build_float_compare(FloatPredicate::UNO, v, v, ""))?;
        let high = e(self
            .b
            .build_select(nan, i32t.const_int(0x7fc0, false), high, ""))?
        .into_int_value();
        let h = e(self.b.build_int_truncate(high, self.ctx.i16_type(), ""))?;
        e(self.b.build_store(self.at(base, Elt::Bf16, off)?, h))?;
        Ok(())
    }

    fn add_i(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        e(self.b.build_int_add(a, b, ""))
    }
    fn mul_i(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        e(self.b.build_int_mul(a, b, ""))
    }
    fn e_sub(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        e(self.b.build_int_sub(a, b, ""))
    }
    fn div_i(&self, a: IntValue<'ctx>, b: usize) -> R<IntValue<'ctx>> {
        e(self.b.build_int_unsigned_div(a, self.i64c(b), ""))
    }
    fn rem_i(&self, a: IntValue<'ctx>, b: usize) -> R<IntValue<'ctx>> {
        e(self.b.build_int_unsigned_rem(a, self.i64c(b), ""))
    }
    fn ext(&self, v: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_ext(v, self.ctx.f64_type(), ""))
    }
    fn trunc(&self, v: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_trunc(v, self.ctx.f32_type(), ""))
    }
    fn maxf(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        self.call(self.intrinsic("llvm.maxnum")?, &[a, b])
    }
    fn sqrt_d(&self, v: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        self.call(
            self.intrinsic_of("llvm.sqrt", self.ctx.f64_type().into())?,
            &[v],
        )
    }

    /// `b^t` in f64 for a whole `t >= 0` (binary powering; within a few f64 ulps of libm's
    /// `pow`, far below f32 rounding).
    fn powi_d(&self, b: f64, t: IntValue<'ctx>) -> R<FloatValue<'ctx>> {
        let acc = self.var(self.dconst(1.0).into())?;
        let base = self.var(self.dconst(b).into())?;
        let n = self.var(t.into())?;
        // 64 rounds cover every i64 exponent; the loop does nothing once n is 0.
        self.for_range(self.i64c(64), |g, _| {
            let k = g.geti(n)?;
            let odd = e(g.b.build_and(k, g.i64c(1), ""))?;
            let is_odd = e(g.b.build_int_compare(IntPredicate::NE, odd, g.i64c(0), ""))?;
            let a = g.getf(acc, g.ctx.f64_type())?;
            let x = g.getf(base, g.ctx.f64_type())?;
            let ax = g.fmul(a, x)?;
            let a2 = e(g.b.build_select(is_odd, ax, a, ""))?;
            g.set(acc, a2)?;
            g.set(base, g.fmul(x, x)?)?;
            g.set(n, e(g.b.build_right_shift(k, g.i64c(1), false, ""))?)
        })?;
        self.getf(acc, self.ctx.f64_type())
    }

    /// SplitMix64's finalizer (the runtime's `rng::mix64`).
    fn mix64(&self, z: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        let i64t = self.ctx.i64_type();
        let c = |v: u64| i64t.const_int(v, false);
        let z = e(self.b.build_int_add(z, c(0x9E37_79B9_7F4A_7C15), ""))?;
        let z = e(self.b.build_int_mul(
            e(self
                .b
                .build_xor(z, e(self.b.build_right_shift(z, c(30), false, ""))?, ""))?,
            c(0xBF58_476D_1CE4_E5B9),
            "",
        ))?;
        let z = e(self.b.build_int_mul(
            e(self
                .b
                .build_xor(z, e(self.b.build_right_shift(z, c(27), false, ""))?, ""))?,
            c(0x94D0_49BB_1331_11EB),
            "",
        ))?;
        e(self
            .b
            .build_xor(z, e(self.b.build_right_shift(z, c(31), false, ""))?, ""))
    }

    /// The runtime's `rng::bits(seed, stream, index)`.
    fn rng_bits(
        &self,
        seed: IntValue<'ctx>,
        stream: u64,
        index: IntValue<'ctx>,
    ) -> R<IntValue<'ctx>> {
        let ms = self.ctx.i64_type().const_int(mix64_const(stream), false);
        let inner = self.mix64(e(self.b.build_xor(seed, ms, ""))?)?;
        self.mix64(e(self.b.build_xor(inner, index, ""))?)
    }

    /// Adds a kernel's code: `K.body(i64 i, ptr buffers...)` (inputs, then outputs), or a
    /// team kernel's phases (`team.rs`).
    pub fn kernel(&self, k: &Kernel) -> R<()> {
        self.kernel_facts(k)?;
        if k.team() > 1 {
            return self.team_kernel(k);
        }
        let i64t = self.ctx.i64_type();
        let ptr = self.ctx.ptr_type(AddressSpace::default());
        let nb = k.inputs.len() + k.outputs.len();
        let mut params: Vec<BasicMetadataTypeEnum> = vec![i64t.into()];
        params.extend(std::iter::repeat_n(BasicMetadataTypeEnum::from(ptr), nb));
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
        let bufs: Vec<PointerValue<'ctx>> = (0..nb)
            .map(|j| {
                f.get_nth_param(1 + j as u32)
                    .map(|p| p.into_pointer_value())
                    .ok_or_else(|| "missing buffer parameter".to_string())
            })
            .collect::<R<_>>()?;
        let all: Vec<&Buf> = k.inputs.iter().chain(&k.outputs).collect();
        self.buffer_elts(&bufs, &all);
        let (ins, outs) = bufs.split_at(k.inputs.len());
        self.body(k, i, ins, outs)?;
        e(self.b.build_return(None))?;
        Ok(())
    }

    fn body(
        &self,
        k: &Kernel,
        i: IntValue<'ctx>,
        ins: &[PointerValue<'ctx>],
        outs: &[PointerValue<'ctx>],
    ) -> R<()> {
        let f32t = self.ctx.f32_type();
        let f64t = self.ctx.f64_type();
        match &k.body {
            Body::Map(exprs) => {
                let out = &k.outputs[0].shape;
                let mut loaded: Vec<Option<FloatValue<'ctx>>> = vec![None; k.inputs.len()];
                let mut vals = Vec::new();
                for x in exprs {
                    vals.push(self.expr(x, &mut |g: &Self, j: usize| {
                        if let Some(v) = loaded[j] {
                            return Ok(v);
                        }
                        let off = g.broadcast_offset(i, &k.inputs[j].shape, out)?;
                        let v = g.ldf(ins[j], off)?;
                        loaded[j] = Some(v);
                        Ok(v)
                    })?);
                }
                for (o, v) in outs.iter().zip(vals) {
                    self.stf(*o, i, v)?;
                }
            }
            Body::Reduce { op, dims } => {
                let shape = &k.inputs[0].shape;
                let base = self.reduce_base(shape, dims, i)?;
                let count: usize = dims.iter().map(|&d| shape[d]).product();
                let off_of = |g: &Self, r: IntValue<'ctx>| g.reduce_off(shape, dims, base, r);
                let v = match op {
                    Reduce::Max => {
                        let acc = self.var(self.fconst(f32::NEG_INFINITY).into())?;
                        self.for_range(self.i64c(count), |g, r| {
                            let x = g.ldf(ins[0], off_of(g, r)?)?;
                            g.set(acc, g.maxf(g.getf(acc, f32t)?, x)?)
                        })?;
                        self.getf(acc, f32t)?
                    }
                    Reduce::Sum | Reduce::Mean(_) => {
                        let acc = self.var(self.dconst(0.0).into())?;
                        self.for_range(self.i64c(count), |g, r| {
                            let x = g.ext(g.ldf(ins[0], off_of(g, r)?)?)?;
                            g.set(acc, g.fadd(g.getf(acc, f64t)?, x)?)
                        })?;
                        let mut s = self.getf(acc, f64t)?;
                        if let Reduce::Mean(n) = op {
                            s = self.fdiv(s, self.dconst(*n as f64))?;
                        }
                        self.trunc(s)?
                    }
                };
                self.stf(outs[0], i, v)?;
            }
            Body::ReducePart { .. }
            | Body::ColReduce { .. }
            | Body::NormGradColTiles { .. }
            | Body::EmbeddingGradRows { .. }
            | Body::AttnTiles(_)
            | Body::AttnTilesBack(_)
            | Body::AttnTilesKv(_)
            | Body::AttnMma(_)
            | Body::AttnMmaBack(_)
            | Body::AttnMmaKv(_) => return Err(format!("{} is a team kernel", k.name)),
            Body::Lines { op, dim } => {
                let shape = &k.inputs[0].shape;
                let n: usize = shape[*dim];
                let inner: usize = shape[dim + 1..].iter().product();
                let o = self.div_i(i, inner)?;
                let ii = self.rem_i(i, inner)?;
                let base = self.add_i(self.mul_i(o, self.i64c(n * inner))?, ii)?;
                let off = |g: &Self, j: IntValue<'ctx>| -> R<IntValue<'ctx>> {
                    g.add_i(base, g.mul_i(j, g.i64c(inner))?)
                };
                let nn = self.i64c(n);
                let exp = self.exp_fn()?;
                match op {
                    Line::Softmax | Line::LogSoftmax => {
                        let mx = self.var(self.fconst(f32::NEG_INFINITY).into())?;
                        self.for_range(nn, |g, j| {
                            let x = g.ldf(ins[0], off(g, j)?)?;
                            g.set(mx, g.maxf(g.getf(mx, f32t)?, x)?)
                        })?;
                        let m = self.getf(mx, f32t)?;
                        let sum = self.var(self.fconst(0.0).into())?;
                        let soft = *op == Line::Softmax;
                        self.for_range(nn, |g, j| {
                            let at = off(g, j)?;
                            let y = g.call(exp, &[g.fsub(g.ldf(ins[0], at)?, m)?])?;
                            if soft {
                                g.stf(outs[0], at, y)?;
                            }
                            g.set(sum, g.fadd(g.getf(sum, f32t)?, y)?)
                        })?;
                        let s = self.getf(sum, f32t)?;
                        if soft {
                            let inv = self.fdiv(self.fconst(1.0), s)?;
                            self.for_range(nn, |g, j| {
                                let at = off(g, j)?;
                                g.stf(outs[0], at, g.fmul(g.ldf(outs[0], at)?, inv)?)
                            })?;
                        } else {
                            let lse = self.fadd(m, self.call(self.log_fn()?, &[s])?)?;
                            self.for_range(nn, |g, j| {
                                let at = off(g, j)?;
                                g.stf(outs[0], at, g.fsub(g.ldf(ins[0], at)?, lse)?)
                            })?;
                        }
                    }
                    Line::SoftmaxGrad | Line::LogSoftmaxGrad => {
                        let acc = self.var(self.fconst(0.0).into())?;
                        let dot = *op == Line::SoftmaxGrad;
                        self.for_range(nn, |g, j| {
                            let at = off(g, j)?;
                            let d = g.ldf(ins[0], at)?;
                            let t = if dot {
                                g.fmul(d, g.ldf(ins[1], at)?)?
                            } else {
                                d
                            };
                            g.set(acc, g.fadd(g.getf(acc, f32t)?, t)?)
                        })?;
                        let s = self.getf(acc, f32t)?;
                        self.for_range(nn, |g, j| {
                            let at = off(g, j)?;
                            let (d, y) = (g.ldf(ins[0], at)?, g.ldf(ins[1], at)?);
                            let v = if dot {
                                g.fmul(y, g.fsub(d, s)?)?
                            } else {
                                g.fsub(d, g.fmul(g.call(exp, &[y])?, s)?)?
                            };
                            g.stf(outs[0], at, v)
                        })?;
                    }
                }
            }
            Body::Transpose(perm) => {
                let out = &k.outputs[0].shape;
                let ist = strides(&k.inputs[0].shape);
                let mut rem = i;
                let mut src = self.i64c(0);
                for d in (0..out.len()).rev() {
                    let c = self.rem_i(rem, out[d])?;
                    rem = self.div_i(rem, out[d])?;
                    src = self.add_i(src, self.mul_i(c, self.i64c(ist[perm[d]]))?)?;
                }
                self.copy_elt(ins[0], src, outs[0], i, k.inputs[0].elt)?;
            }
            Body::Norm { rms, eps } => {
                let h = k.inputs[1].shape[0];
                let base = self.mul_i(i, self.i64c(h))?;
                let (mean, scale) = self.moments(ins[0], base, h, *rms, *eps)?;
                self.for_range(self.i64c(h), |g, j| {
                    let at = g.add_i(base, j)?;
                    let x = g.ldf(ins[0], at)?;
                    let w = g.ldf(ins[1], j)?;
                    let v = if *rms {
                        g.fmul(g.fmul(x, scale)?, w)?
                    } else {
                        let b = g.ldf(ins[2], j)?;
                        g.fadd(g.fmul(g.fmul(g.fsub(x, mean)?, scale)?, w)?, b)?
                    };
                    g.stf(outs[0], at, v)
                })?;
            }
            Body::NormGradRows { rms, eps } => {
                let h = k.inputs[2].shape[0];
                let hh = self.i64c(h);
                let base = self.mul_i(i, hh)?;
                let (mean, r) = self.moments(ins[1], base, h, *rms, *eps)?;
                let xhat = |g: &Self, x: FloatValue<'ctx>| g.fmul(g.fsub(x, mean)?, r);
                let a1 = self.var(self.dconst(0.0).into())?;
                let a2 = self.var(self.dconst(0.0).into())?;
                self.for_range(hh, |g, j| {
                    let at = g.add_i(base, j)?;
                    let (d, x, w) = (g.ldf(ins[0], at)?, g.ldf(ins[1], at)?, g.ldf(ins[2], j)?);
                    if *rms {
                        let t = g.ext(g.fmul(g.fmul(d, w)?, x)?)?;
                        g.set(a1, g.fadd(g.getf(a1, f64t)?, t)?)
                    } else {
                        let gw = g.fmul(d, w)?;
                        let xh = xhat(g, x)?;
                        g.set(a1, g.fadd(g.getf(a1, f64t)?, g.ext(gw)?)?)?;
                        let t = g.ext(g.fmul(gw, xh)?)?;
                        g.set(a2, g.fadd(g.getf(a2, f64t)?, t)?)
                    }
                })?;
                let hd = self.dconst(h as f64);
                let m1 = self.trunc(self.fdiv(self.getf(a1, f64t)?, hd)?)?;
                let m2 = self.trunc(self.fdiv(self.getf(a2, f64t)?, hd)?)?;
                let kk = if *rms {
                    self.fmul(self.fmul(m1, r)?, r)?
                } else {
                    m1
                };
                self.for_range(hh, |g, j| {
                    let at = g.add_i(base, j)?;
                    let (d, x, w) = (g.ldf(ins[0], at)?, g.ldf(ins[1], at)?, g.ldf(ins[2], j)?);
                    let gw = g.fmul(d, w)?;
                    let v = if *rms {
                        g.fmul(r, g.fsub(gw, g.fmul(x, kk)?)?)?
                    } else {
                        let xh = xhat(g, x)?;
                        g.fmul(r, g.fsub(g.fsub(gw, m1)?, g.fmul(xh, m2)?)?)?
                    };
                    g.stf(outs[0], at, v)
                })?;
                let s = self.mul_i(i, self.i64c(2))?;
                self.stf(outs[1], s, mean)?;
                self.stf(outs[1], self.add_i(s, self.i64c(1))?, r)?;
            }
            Body::NormGradCols { rms } => {
                let rows = k.inputs[2].shape[0];
                let h = k.inputs[0].len() / rows.max(1);
                let dw = self.var(self.dconst(0.0).into())?;
                let db = self.var(self.dconst(0.0).into())?;
                self.for_range(self.i64c(rows), |g, row| {
                    let at = g.add_i(g.mul_i(row, g.i64c(h))?, i)?;
                    let (d, x) = (g.ldf(ins[0], at)?, g.ldf(ins[1], at)?);
                    let s = g.mul_i(row, g.i64c(2))?;
                    let mean = g.ldf(ins[2], s)?;
                    let r = g.ldf(ins[2], g.add_i(s, g.i64c(1))?)?;
                    let t = if *rms {
                        g.fmul(g.fmul(d, x)?, r)?
                    } else {
                        g.fmul(d, g.fmul(g.fsub(x, mean)?, r)?)?
                    };
                    g.set(dw, g.fadd(g.getf(dw, f64t)?, g.ext(t)?)?)?;
                    g.set(db, g.fadd(g.getf(db, f64t)?, g.ext(d)?)?)
                })?;
                self.stf(outs[0], i, self.trunc(self.getf(dw, f64t)?)?)?;
                if !rms {
                    self.stf(outs[1], i, self.trunc(self.getf(db, f64t)?)?)?;
                }
            }
            Body::Embedding { sharded } => {
                let (v, w) = (k.inputs[1].shape[0], k.inputs[1].shape[1]);
                let t = self.div_i(i, w)?;
                let c = self.rem_i(i, w)?;
                let id = self.ldi(ins[0], t)?;
                let off = if *sharded {
                    self.ldi(ins[2], self.i64c(0))?
                } else {
                    self.i64c(0)
                };
                let row = self.e_sub(id, off)?;
                // Unsigned: a negative row wraps above v.
                let inside = e(self
                    .b
                    .build_int_compare(IntPredicate::ULT, row, self.i64c(v), ""))?;
                self.stf(outs[0], i, self.fconst(0.0))?;
                self.when(inside, |g| {
                    let at = g.add_i(g.mul_i(row, g.i64c(w))?, c)?;
                    g.stf(outs[0], i, g.ldf(ins[1], at)?)
                })?;
            }
            Body::Pick { sharded } => {
                let v = classes(&k.inputs[0]);
                let off = if *sharded {
                    self.ldi(ins[2], self.i64c(0))?
                } else {
                    self.i64c(0)
                };
                let col = self.e_sub(self.ldi(ins[1], i)?, off)?;
                let inside = e(self
                    .b
                    .build_int_compare(IntPredicate::ULT, col, self.i64c(v), ""))?;
                self.stf(outs[0], i, self.fconst(0.0))?;
                self.when(inside, |g| {
                    let at = g.add_i(g.mul_i(i, g.i64c(v))?, col)?;
                    g.stf(outs[0], i, g.ldf(ins[0], at)?)
                })?;
            }
            Body::XentGradLse { count, sharded } => {
                // ins: dloss, logits [rows, v], targets, lse [rows, 1] (, offset).
                let v = classes(&k.inputs[1]);
                let exp = self.exp_fn()?;
                let dl = self.ldf(ins[0], self.i64c(0))?;
                let scale = self.fdiv(dl, self.fconst(*count as f32))?;
                let lse = self.ldf(ins[3], i)?;
                let off = if *sharded {
                    self.ldi(ins[4], self.i64c(0))?
                } else {
                    self.i64c(0)
                };
                let col = self.e_sub(self.ldi(ins[2], i)?, off)?;
                let base = self.mul_i(i, self.i64c(v))?;
                self.for_range(self.i64c(v), |g, j| {
                    let at = g.add_i(base, j)?;
                    let y = g.call(exp, &[g.fsub(g.ldf(ins[1], at)?, lse)?])?;
                    let y = g.fmul(y, scale)?;
                    let hit = e(g.b.build_int_compare(IntPredicate::EQ, j, col, ""))?;
                    let y = e(g.b.build_select(hit, g.fsub(y, scale)?, y, ""))?.into_float_value();
                    g.stf(outs[0], at, y)
                })?;
            }
            Body::EmbeddingLinks { rows } => {
                let n = k.inputs[0].len();
                let id = self.ldi(ins[0], i)?;
                let inside =
                    e(self
                        .b
                        .build_int_compare(IntPredicate::ULT, id, self.i64c(*rows), ""))?;
                // The first later token with the id (n: none); whether an earlier has it.
                let next = self.var(self.i64c(n).into())?;
                let head = self.var(self.i64c(1).into())?;
                self.for_range(self.i64c(n), |g, u| {
                    let same =
                        e(g.b.build_int_compare(IntPredicate::EQ, g.ldi(ins[0], u)?, id, ""))?;
                    let before = e(g.b.build_int_compare(IntPredicate::ULT, u, i, ""))?;
                    let after = e(g.b.build_int_compare(IntPredicate::UGT, u, i, ""))?;
                    let first =
                        e(g.b.build_int_compare(IntPredicate::EQ, g.geti(next)?, g.i64c(n), ""))?;
                    let earlier = e(g.b.build_and(same, before, ""))?;
                    let later = e(g.b.build_and(same, e(g.b.build_and(after, first, ""))?, ""))?;
                    let h = e(g.b.build_select(earlier, g.i64c(0), g.geti(head)?, ""))?;
                    g.set(head, h)?;
                    let x = e(g.b.build_select(later, u, g.geti(next)?, ""))?;
                    g.set(next, x)
                })?;
                let nx = self.geti(next)?;
                let is_head = e(self.b.build_int_compare(
                    IntPredicate::NE,
                    self.geti(head)?,
                    self.i64c(0),
                    "",
                ))?;
                let link =
                    e(self
                        .b
                        .build_select(is_head, nx, self.add_i(nx, self.i64c(n + 1))?, ""))?
                    .into_int_value();
                let link = e(self
                    .b
                    .build_select(inside, link, self.i64c(-1i64 as usize), ""))?;
                let at = self.at(outs[0], Elt::I64, i)?;
                align8(e(self.b.build_store(at, link))?.into())?;
            }
            Body::EmbeddingGradLists => {
                // ins: dy [n, w], ids [n], links [n]; out: the table [rows, w].
                let w = k.outputs[0].shape[1];
                let n = k.inputs[2].len();
                let t = self.div_i(i, w)?;
                let c = self.rem_i(i, w)?;
                let link = self.ldi(ins[2], t)?;
                let heads = e(self
                    .b
                    .build_int_compare(IntPredicate::ULE, link, self.i64c(n), ""))?;
                self.when(heads, |g| {
                    let acc = g.var(g.fconst(0.0).into())?;
                    // Along the list: each token's dy, then on to its link (less the
                    // non-head mark, n + 1), until n.
                    g.walk(t, g.i64c(n), |g, u| {
                        let d = g.ldf(ins[0], g.add_i(g.mul_i(u, g.i64c(w))?, c)?)?;
                        g.set(acc, g.fadd(g.getf(acc, g.ctx.f32_type())?, d)?)?;
                        let l = g.ldi(ins[2], u)?;
                        let marked = e(g.b.build_int_compare(IntPredicate::UGT, l, g.i64c(n), ""))?;
                        let unmarked = g.e_sub(l, g.i64c(n + 1))?;
                        Ok(e(g.b.build_select(marked, unmarked, l, ""))?.into_int_value())
                    })?;
                    let row = g.ldi(ins[1], t)?;
                    let at = g.add_i(g.mul_i(row, g.i64c(w))?, c)?;
                    g.stf(outs[0], at, g.getf(acc, g.ctx.f32_type())?)
                })?;
            }
            Body::XentRows => {
                let v = classes(&k.inputs[0]);
                let base = self.mul_i(i, self.i64c(v))?;
                let exp = self.exp_fn()?;
                let mx = self.var(self.fconst(f32::NEG_INFINITY).into())?;
                self.for_range(self.i64c(v), |g, j| {
                    let z = g.ldf(ins[0], g.add_i(base, j)?)?;
                    g.set(mx, g.maxf(g.getf(mx, f32t)?, z)?)
                })?;
                let m = self.getf(mx, f32t)?;
                let sum = self.var(self.dconst(0.0).into())?;
                self.for_range(self.i64c(v), |g, j| {
                    let z = g.ldf(ins[0], g.add_i(base, j)?)?;
                    let y = g.ext(g.call(exp, &[g.fsub(z, m)?])?)?;
                    g.set(sum, g.fadd(g.getf(sum, f64t)?, y)?)
                })?;
                // ln of the f64 sum rounded to f32 (>= 1, so 6e-8 absolute at most).
                let ls = self.call(self.log_fn()?, &[self.trunc(self.getf(sum, f64t)?)?])?;
                let lse = self.fadd(self.ext(m)?, self.ext(ls)?)?;
                let target = self.ldi(ins[1], i)?;
                let inside =
                    e(self
                        .b
                        .build_int_compare(IntPredicate::ULT, target, self.i64c(v), ""))?;
                // A target outside the vocabulary gives NaN (the reference refuses it).
                self.stf(outs[0], i, self.fconst(f32::NAN))?;
                self.when(inside, |g| {
                    let z = g.ext(g.ldf(ins[0], g.add_i(base, target)?)?)?;
                    g.stf(outs[0], i, g.trunc(g.fsub(lse, z)?)?)
                })?;
            }
            Body::MeanOf { count } => {
                let n = k.inputs[0].len();
                let acc = self.var(self.dconst(0.0).into())?;
                self.for_range(self.i64c(n), |g, r| {
                    let x = g.ext(g.ldf(ins[0], r)?)?;
                    g.set(acc, g.fadd(g.getf(acc, f64t)?, x)?)
                })?;
                let m = self.fdiv(self.getf(acc, f64t)?, self.dconst(*count as f64))?;
                self.stf(outs[0], i, self.trunc(m)?)?;
            }
            Body::XentGrad { count } => {
                let v = classes(&k.inputs[1]);
                let base = self.mul_i(i, self.i64c(v))?;
                let exp = self.exp_fn()?;
                let dl = self.ldf(ins[0], self.i64c(0))?;
                let scale = self.fdiv(dl, self.fconst(*count as f32))?;
                let mx = self.var(self.fconst(f32::NEG_INFINITY).into())?;
                self.for_range(self.i64c(v), |g, j| {
                    let z = g.ldf(ins[1], g.add_i(base, j)?)?;
                    g.set(mx, g.maxf(g.getf(mx, f32t)?, z)?)
                })?;
                let m = self.getf(mx, f32t)?;
                let sum = self.var(self.fconst(0.0).into())?;
                self.for_range(self.i64c(v), |g, j| {
                    let at = g.add_i(base, j)?;
                    let y = g.call(exp, &[g.fsub(g.ldf(ins[1], at)?, m)?])?;
                    g.stf(outs[0], at, y)?;
                    g.set(sum, g.fadd(g.getf(sum, f32t)?, y)?)
                })?;
                let inv = self.fdiv(self.fconst(1.0), self.getf(sum, f32t)?)?;
                let target = self.ldi(ins[2], i)?;
                self.for_range(self.i64c(v), |g, j| {
                    let at = g.add_i(base, j)?;
                    let y = g.fmul(g.ldf(outs[0], at)?, inv)?;
                    let hit = e(g.b.build_int_compare(IntPredicate::EQ, j, target, ""))?;
                    let y = e(g.b.build_select(hit, g.fsub(y, g.fconst(1.0))?, y, ""))?
                        .into_float_value();
                    g.stf(outs[0], at, g.fmul(y, scale)?)
                })?;
            }
            Body::AdamW { b1, b2, eps, wd } => {
                let c = self.adamw_scalars((*b1, *b2, *eps), &[*wd], &ins[4..])?;
                self.adamw_elt(&c, 0, &ins[..4], outs, i)?;
            }
            Body::AdamWMulti {
                b1,
                b2,
                eps,
                wds,
                lens,
            } => {
                let n = lens.len();
                let c = self.adamw_scalars((*b1, *b2, *eps), wds, &ins[4 * n..])?;
                let mut starts = Vec::with_capacity(n + 1);
                let mut at = 0;
                for l in lens {
                    starts.push(at);
                    at += l;
                }
                starts.push(at);
                self.adamw_search(&c, ins, outs, i, &starts, 0..n)?;
            }
            Body::Copy => self.copy_elt(ins[0], i, outs[0], i, k.inputs[0].elt)?,
            Body::Rotary { s, d } => {
                // ins: x, cos, sin (tables [s, d/2]).
                let half = d / 2;
                let jj = self.rem_i(i, *d)?;
                let p = self.rem_i(self.div_i(i, *d)?, *s)?;
                let base = self.e_sub(i, jj)?;
                let first =
                    e(self
                        .b
                        .build_int_compare(IntPredicate::ULT, jj, self.i64c(half), ""))?;
                let j = e(self
                    .b
                    .build_select(first, jj, self.e_sub(jj, self.i64c(half))?, ""))?
                .into_int_value();
                let t = self.add_i(self.mul_i(p, self.i64c(half))?, j)?;
                let (c, sn) = (self.ldf(ins[1], t)?, self.ldf(ins[2], t)?);
                let a = self.ldf(ins[0], self.add_i(base, j)?)?;
                let b = self.ldf(ins[0], self.add_i(self.add_i(base, j)?, self.i64c(half))?)?;
                // out[j] = a cos - b sin; out[j + half] = b cos + a sin.
                let lo = self.fsub(self.fmul(a, c)?, self.fmul(b, sn)?)?;
                let hi = self.fadd(self.fmul(b, c)?, self.fmul(a, sn)?)?;
                let v = e(self.b.build_select(first, lo, hi, ""))?.into_float_value();
                self.stf(outs[0], i, v)?;
            }
            Body::Dropout {
                p,
                seed,
                global,
                step,
            } => {
                let i64t = self.ctx.i64_type();
                // The runtime's rng: bits(seed, stream, index) =
                // mix64(mix64(seed ^ mix64(stream)) ^ index); with a step, the seed is
                // bits(seed, 0x5eed, step) first.
                let mut sd = i64t.const_int(*seed, false);
                if *step {
                    let t = self.ldf(ins[1], self.i64c(0))?;
                    let t = e(self.b.build_float_to_unsigned_int(t, i64t, ""))?;
                    sd = self.rng_bits(sd, 0x5eed, t)?;
                }
                // The element's index in the whole tensor (on a shard: its coordinates
                // moved by the shard's offsets, the last input).
                let index = match global {
                    None => i,
                    Some(g) => {
                        let offsets = ins[k.inputs.len() - 1];
                        let local = &k.inputs[0].shape;
                        let gst = strides(g);
                        let mut rem = i;
                        let mut idx = self.i64c(0);
                        for d in (0..local.len()).rev() {
                            let c = self.rem_i(rem, local[d])?;
                            rem = self.div_i(rem, local[d])?;
                            let o = self.ldi(offsets, self.i64c(d))?;
                            idx =
                                self.add_i(idx, self.mul_i(self.add_i(c, o)?, self.i64c(gst[d]))?)?;
                        }
                        idx
                    }
                };
                let bits = self.rng_bits(sd, 0x0064_726f_706f_7574, index)?;
                let top = e(self
                    .b
                    .build_right_shift(bits, i64t.const_int(11, false), false, ""))?;
                let u = e(self
                    .b
                    .build_unsigned_int_to_float(top, self.ctx.f64_type(), ""))?;
                let u = self.fmul(u, self.dconst(1.0 / (1u64 << 53) as f64))?;
                let x = self.ldf(ins[0], i)?;
                let scale = self.fconst((1.0 / (1.0 - p)) as f32);
                let kept = self.fmul(x, scale)?;
                let v = self.select(
                    FloatPredicate::OGE,
                    u,
                    self.dconst(*p),
                    kept,
                    self.fconst(0.0),
                )?;
                self.stf(outs[0], i, v)?;
            }
            Body::Place { dim, starts } => {
                let out = &k.outputs[0].shape;
                let elt = k.outputs[0].elt;
                let (n, inner) = (out[*dim], out[dim + 1..].iter().product::<usize>());
                let c = self.rem_i(self.div_i(i, inner)?, n)?;
                let o = self.div_i(i, n * inner)?;
                let r = self.rem_i(i, inner)?;
                self.store_zero(outs[0], elt, i)?;
                for (k_in, &st) in starts.iter().enumerate() {
                    let len = k.inputs[k_in].shape[*dim];
                    let rel = self.e_sub(c, self.i64c(st))?;
                    // Unsigned: below the start wraps above len.
                    let inside =
                        e(self
                            .b
                            .build_int_compare(IntPredicate::ULT, rel, self.i64c(len), ""))?;
                    self.when(inside, |g| {
                        let src = g.add_i(
                            g.add_i(
                                g.mul_i(o, g.i64c(len * inner))?,
                                g.mul_i(rel, g.i64c(inner))?,
                            )?,
                            r,
                        )?;
                        g.copy_elt(ins[k_in], src, outs[0], i, elt)
                    })?;
                }
            }
            Body::Window { dim, start } => {
                let out = &k.outputs[0].shape;
                let elt = k.outputs[0].elt;
                let (n, inner) = (out[*dim], out[dim + 1..].iter().product::<usize>());
                let m = k.inputs[0].shape[*dim];
                let c = self.rem_i(self.div_i(i, inner)?, n)?;
                let o = self.div_i(i, n * inner)?;
                let r = self.rem_i(i, inner)?;
                let src = self.add_i(
                    self.add_i(
                        self.mul_i(o, self.i64c(m * inner))?,
                        self.mul_i(self.add_i(c, self.i64c(*start))?, self.i64c(inner))?,
                    )?,
                    r,
                )?;
                self.copy_elt(ins[0], src, outs[0], i, elt)?;
            }
            Body::PickGrad => {
                let v = classes(&k.outputs[0]);
                let r = self.div_i(i, v)?;
                let c = self.rem_i(i, v)?;
                let t = self.ldi(ins[1], r)?;
                let hit = e(self.b.build_int_compare(IntPredicate::EQ, c, t, ""))?;
                let d = self.ldf(ins[0], r)?;
                let val = e(self.b.build_select(hit, d, self.fconst(0.0), ""))?.into_float_value();
                self.stf(outs[0], i, val)?;
            }
            Body::MaxGrad { dims } => {
                // ins: dy (the reduced shape), x.
                let shape = &k.inputs[1].shape;
                let st = strides(shape);
                // The group's first element and its index in dy (kept dims, row-major).
                let mut rem = i;
                let mut base = self.i64c(0);
                let mut o = self.i64c(0);
                let mut ostride = 1usize;
                for d in (0..shape.len()).rev() {
                    let c = self.rem_i(rem, shape[d])?;
                    rem = self.div_i(rem, shape[d])?;
                    if !dims.contains(&d) {
                        base = self.add_i(base, self.mul_i(c, self.i64c(st[d]))?)?;
                        o = self.add_i(o, self.mul_i(c, self.i64c(ostride))?)?;
                        ostride *= shape[d];
                    }
                }
                let count: usize = dims.iter().map(|&d| shape[d]).product();
                let off_of = |g: &Self, r: IntValue<'ctx>| -> R<IntValue<'ctx>> {
                    let mut rem = r;
                    let mut off = base;
                    for &d in dims.iter().rev() {
                        let c = g.rem_i(rem, shape[d])?;
                        rem = g.div_i(rem, shape[d])?;
                        off = g.add_i(off, g.mul_i(c, g.i64c(st[d]))?)?;
                    }
                    Ok(off)
                };
                let acc = self.var(self.fconst(f32::NEG_INFINITY).into())?;
                self.for_range(self.i64c(count), |g, r| {
                    let x = g.ldf(ins[1], off_of(g, r)?)?;
                    g.set(acc, g.maxf(g.getf(acc, f32t)?, x)?)
                })?;
                let mx = self.getf(acc, f32t)?;
                let ties = self.var(self.fconst(0.0).into())?;
                self.for_range(self.i64c(count), |g, r| {
                    let x = g.ldf(ins[1], off_of(g, r)?)?;
                    let one = g.select(FloatPredicate::OEQ, x, mx, g.fconst(1.0), g.fconst(0.0))?;
                    g.set(ties, g.fadd(g.getf(ties, f32t)?, one)?)
                })?;
                let share = self.fdiv(self.ldf(ins[0], o)?, self.getf(ties, f32t)?)?;
                let x = self.ldf(ins[1], i)?;
                let v = self.select(FloatPredicate::OEQ, x, mx, share, self.fconst(0.0))?;
                self.stf(outs[0], i, v)?;
            }
            Body::Gemm(m) => {
                let (mm, n, kk) = (m.m, m.n, m.k);
                let bi = self.div_i(i, mm * n)?;
                let r = self.rem_i(self.div_i(i, n)?, mm)?;
                let c = self.rem_i(i, n)?;
                let a0 = self.mul_i(bi, self.i64c(mm * kk))?;
                let b0 = if m.b_batched {
                    self.mul_i(bi, self.i64c(kk * n))?
                } else {
                    self.i64c(0)
                };
                let acc = self.var(self.fconst(0.0).into())?;
                self.for_range(self.i64c(kk), |g, l| {
                    let ai = if m.ta {
                        g.add_i(g.add_i(a0, g.mul_i(l, g.i64c(mm))?)?, r)?
                    } else {
                        g.add_i(g.add_i(a0, g.mul_i(r, g.i64c(kk))?)?, l)?
                    };
                    let bi = if m.tb {
                        g.add_i(g.add_i(b0, g.mul_i(c, g.i64c(kk))?)?, l)?
                    } else {
                        g.add_i(g.add_i(b0, g.mul_i(l, g.i64c(n))?)?, c)?
                    };
                    let p = g.fmul(g.ldf(ins[0], ai)?, g.ldf(ins[1], bi)?)?;
                    g.set(acc, g.fadd(g.getf(acc, f32t)?, p)?)
                })?;
                self.stf(outs[0], i, self.getf(acc, f32t)?)?;
            }
            Body::Attention(a) => {
                let mut row = self.attn_row(a, i, ins)?;
                let qb = self.mul_i(i, self.i64c(a.d))?;
                row.mine.q = Some(self.private_row(ins[0], qb, a.d)?);
                let (mx, inv) = self.attn_softmax(a, &row, ins[0], ins[1])?;
                let acc = self.array(a.e)?;
                self.for_range(row.lim, |g, j| {
                    let p = g.attn_prob(a, &row, ins[0], ins[1], j, mx, inv)?;
                    let vb = g.mul_i(g.add_i(row.kv_base, j)?, g.i64c(a.e))?;
                    g.axpy(acc, p, ins[2], vb, a.e)
                })?;
                let ob = self.mul_i(row.q_row, self.i64c(a.e))?;
                self.store_array(acc, outs[0], ob, a.e)?;
            }
            Body::AttnStats(a) => {
                // ins: dout, q, k, v.
                let mut row = self.attn_row(a, i, ins)?;
                row.mine = self.query_rows(a, i, ins[1], ins[0])?;
                let (mx, inv) = self.attn_softmax(a, &row, ins[1], ins[2])?;
                let dot = self.var(self.fconst(0.0).into())?;
                self.for_range(row.lim, |g, j| {
                    let p = g.attn_prob(a, &row, ins[1], ins[2], j, mx, inv)?;
                    let dp = g.attn_dp(a, &row, ins[0], ins[3], j)?;
                    g.set(dot, g.fadd(g.getf(dot, f32t)?, g.fmul(p, dp)?)?)
                })?;
                let s = self.mul_i(i, self.i64c(3))?;
                self.stf(outs[0], s, mx)?;
                self.stf(outs[0], self.add_i(s, self.i64c(1))?, inv)?;
                self.stf(outs[0], self.add_i(s, self.i64c(2))?, self.getf(dot, f32t)?)?;
            }
            Body::AttnDq(a) => {
                // ins: dout, q, k, v, stats.
                let mut row = self.attn_row(a, i, ins)?;
                row.mine = self.query_rows(a, i, ins[1], ins[0])?;
                let (mx, inv, dsum) = self.attn_stats(ins[4], row.q_row)?;
                let acc = self.array(a.d)?;
                self.for_range(row.lim, |g, j| {
                    let p = g.attn_prob(a, &row, ins[1], ins[2], j, mx, inv)?;
                    let dp = g.attn_dp(a, &row, ins[0], ins[3], j)?;
                    let ds = g.fmul(g.fmul(p, g.fsub(dp, dsum)?)?, g.fconst(a.scale))?;
                    let kb = g.mul_i(g.add_i(row.kv_base, j)?, g.i64c(a.d))?;
                    g.axpy(acc, ds, ins[2], kb, a.d)
                })?;
                let ob = self.mul_i(row.q_row, self.i64c(a.d))?;
                self.store_array(acc, outs[0], ob, a.d)?;
            }
            Body::AttnDkDv(a) => {
                // Key row i = (bi, kv head, j); every query head of the group, rows in order.
                let bi = self.div_i(i, a.g * a.t)?;
                let kvh = self.rem_i(self.div_i(i, a.t)?, a.g)?;
                let j = self.rem_i(i, a.t)?;
                let per = a.h / a.g;
                // Local query qi is at global position qi + off.
                let off = self.query_offset(a, ins)?;
                let dk = self.array(a.d)?;
                let dv = self.array(a.e)?;
                let mine = Mine {
                    k: Some(self.private_row(ins[2], self.mul_i(i, self.i64c(a.d))?, a.d)?),
                    v: Some(self.private_row(ins[3], self.mul_i(i, self.i64c(a.e))?, a.e)?),
                    ..Mine::default()
                };
                self.for_range(self.i64c(per), |g, hh| {
                    let hi = g.add_i(g.mul_i(kvh, g.i64c(per))?, hh)?;
                    g.for_range(g.i64c(a.s), |g, qi| {
                        let q_row = g.add_i(
                            g.mul_i(g.add_i(g.mul_i(bi, g.i64c(a.h))?, hi)?, g.i64c(a.s))?,
                            qi,
                        )?;
                        let row = AttnRow {
                            q_row,
                            kv_base: g
                                .mul_i(g.add_i(g.mul_i(bi, g.i64c(a.g))?, kvh)?, g.i64c(a.t))?,
                            lim: g.i64c(a.t),
                            mine,
                        };
                        // Causal: query qi sees key j only when j <= qi.
                        let seen = if a.causal {
                            let pos = g.add_i(qi, off)?;
                            e(g.b.build_int_compare(IntPredicate::ULE, j, pos, ""))?
                        } else {
                            g.ctx.bool_type().const_int(1, false)
                        };
                        g.when(seen, |g| {
                            let (mx, inv, dsum) = g.attn_stats(ins[4], q_row)?;
                            let p = g.attn_prob(a, &row, ins[1], ins[2], j, mx, inv)?;
                            let dp = g.attn_dp(a, &row, ins[0], ins[3], j)?;
                            let ds = g.fmul(g.fmul(p, g.fsub(dp, dsum)?)?, g.fconst(a.scale))?;
                            let ob = g.mul_i(q_row, g.i64c(a.e))?;
                            g.axpy(dv, p, ins[0], ob, a.e)?;
                            let qb = g.mul_i(q_row, g.i64c(a.d))?;
                            g.axpy(dk, ds, ins[1], qb, a.d)
                        })
                    })
                })?;
                let kb = self.mul_i(i, self.i64c(a.d))?;
                self.store_array(dk, outs[0], kb, a.d)?;
                let vb = self.mul_i(i, self.i64c(a.e))?;
                self.store_array(dv, outs[1], vb, a.e)?;
            }
            Body::ClipScale { max_norm } => {
                let s = self.ldf(ins[0], self.i64c(0))?;
                let sq = self.call(self.intrinsic("llvm.sqrt")?, &[s])?;
                let q = self.fdiv(
                    self.fconst(*max_norm as f32),
                    self.fadd(sq, self.fconst(1e-6))?,
                )?;
                let k = self.call(self.intrinsic("llvm.minnum")?, &[q, self.fconst(1.0)])?;
                self.stf(outs[0], i, k)?;
            }
        }
        Ok(())
    }

    /// A zeroed `[n x f32]` array in the entry block (one per thread: local memory on a
    /// GPU, registers once loops over it are unrolled).
    fn array(&self, n: usize) -> R<PointerValue<'ctx>> {
        let p = self.entry_alloca(self.ctx.f32_type().array_type(n as u32).into())?;
        self.for_range(self.i64c(n), |g, c| g.stf(p, c, g.fconst(0.0)))?;
        Ok(p)
    }

    /// Private copies of query row `i`'s `q` and `dO` rows (a backward query-row kernel).
    fn query_rows(
        &self,
        a: &Attn,
        i: IntValue<'ctx>,
        q: PointerValue<'ctx>,
        dout: PointerValue<'ctx>,
    ) -> R<Mine<'ctx>> {
        Ok(Mine {
            q: Some(self.private_row(q, self.mul_i(i, self.i64c(a.d))?, a.d)?),
            dout: Some(self.private_row(dout, self.mul_i(i, self.i64c(a.e))?, a.e)?),
            ..Mine::default()
        })
    }

    /// Query row `i` (flat over batch, heads, positions) of an attention.
    fn attn_row(
        &self,
        a: &Attn,
        i: IntValue<'ctx>,
        ins: &[PointerValue<'ctx>],
    ) -> R<AttnRow<'ctx>> {
        let bi = self.div_i(i, a.h * a.s)?;
        let hi = self.rem_i(self.div_i(i, a.s)?, a.h)?;
        let qi = self.add_i(self.rem_i(i, a.s)?, self.query_offset(a, ins)?)?;
        let kvh = self.add_i(self.mul_i(bi, self.i64c(a.g))?, self.div_i(hi, a.h / a.g)?)?;
        let lim = if a.causal {
            let next = self.add_i(qi, self.i64c(1))?;
            let small = e(self
                .b
                .build_int_compare(IntPredicate::ULT, next, self.i64c(a.t), ""))?;
            e(self.b.build_select(small, next, self.i64c(a.t), ""))?.into_int_value()
        } else {
            self.i64c(a.t)
        };
        Ok(AttnRow {
            q_row: i,
            kv_base: self.mul_i(kvh, self.i64c(a.t))?,
            lim,
            mine: Mine::default(),
        })
    }

    /// The global position of an attention's first query: its last input on a shard of
    /// the positions (`Attn::q_offset`), else 0.
    fn query_offset(&self, a: &Attn, ins: &[PointerValue<'ctx>]) -> R<IntValue<'ctx>> {
        match (a.q_offset, ins.last()) {
            (true, Some(&p)) => self.ldi(p, self.i64c(0)),
            (true, None) => {
                Err("an attention on a shard of the positions has no offset input".into())
            }
            (false, _) => Ok(self.i64c(0)),
        }
    }

    /// `scale * (q_i . k_j)`.
    fn attn_score(
        &self,
        a: &Attn,
        row: &AttnRow<'ctx>,
        q: PointerValue<'ctx>,
        k: PointerValue<'ctx>,
        j: IntValue<'ctx>,
    ) -> R<FloatValue<'ctx>> {
        let zero = self.i64c(0);
        let (q, qb) = match row.mine.q {
            Some(p) => (p, zero),
            None => (q, self.mul_i(row.q_row, self.i64c(a.d))?),
        };
        let (k, kb) = match row.mine.k {
            Some(p) => (p, zero),
            None => (k, self.mul_i(self.add_i(row.kv_base, j)?, self.i64c(a.d))?),
        };
        let dot = self.dot(q, qb, k, kb, a.d)?;
        self.fmul(self.fconst(a.scale), dot)
    }

    /// A copy of `len` elements of `x` from `xb` in a thread's own array (local memory on
    /// a GPU, coalesced across a warp; registers where the loops over it unroll). An
    /// attention thread reads its own query (or key) row once per key (or query): from
    /// the buffer, a warp's 32 threads would read 32 rows a row's length apart, 32
    /// transactions a load, where the other operand is one row all of them read.
    fn private_row(
        &self,
        x: PointerValue<'ctx>,
        xb: IntValue<'ctx>,
        len: usize,
    ) -> R<PointerValue<'ctx>> {
        let p = self.entry_alloca(self.ctx.f32_type().array_type(len as u32).into())?;
        self.for_range(self.i64c(len), |g, c| {
            g.stf(p, c, g.ldf(x, g.add_i(xb, c)?)?)
        })?;
        Ok(p)
    }

    /// `out[o] = x[src]` for buffers of `elt`s.
    fn copy_elt(
        &self,
        x: PointerValue<'ctx>,
        src: IntValue<'ctx>,
        out: PointerValue<'ctx>,
        o: IntValue<'ctx>,
        elt: Elt,
    ) -> R<()> {
        if elt.is_float() {
            // Through f32: each side widens or rounds as its storage needs.
            return self.stf(out, o, self.ldf(x, src)?);
        }
        let ty: BasicTypeEnum = self.ctx.i64_type().into();
        let v = e(self.b.build_load(ty, self.at(x, elt, src)?, ""))?;
        let st = e(self.b.build_store(self.at(out, elt, o)?, v))?;
        if elt == Elt::I64 {
            align8(v.as_instruction_value())?;
            align8(Some(st))?;
        }
        Ok(())
    }

    /// `out[o] = 0` for a buffer of `elt`s.
    fn store_zero(&self, out: PointerValue<'ctx>, elt: Elt, o: IntValue<'ctx>) -> R<()> {
        match elt {
            Elt::F32 | Elt::Bf16 => self.stf(out, o, self.fconst(0.0)),
            Elt::I64 => {
                let st = e(self.b.build_store(self.at(out, elt, o)?, self.i64c(0)))?;
                align8(Some(st))
            }
        }
    }

    /// `acc[c] += s * x[xb + c]` for `c` in `0..len` (`acc`: an [`Gen::array`]).
    fn axpy(
        &self,
        acc: PointerValue<'ctx>,
        s: FloatValue<'ctx>,
        x: PointerValue<'ctx>,
        xb: IntValue<'ctx>,
        len: usize,
    ) -> R<()> {
        self.for_range(self.i64c(len), |g, c| {
            let at = g.at(acc, Elt::F32, c)?;
            let v = g.ldf(x, g.add_i(xb, c)?)?;
            g.set(at, g.fadd(g.getf(at, g.ctx.f32_type())?, g.fmul(s, v)?)?)
        })
    }

    /// `out[ob + c] = acc[c]` for `c` in `0..len`.
    fn store_array(
        &self,
        acc: PointerValue<'ctx>,
        out: PointerValue<'ctx>,
        ob: IntValue<'ctx>,
        len: usize,
    ) -> R<()> {
        self.for_range(self.i64c(len), |g, c| {
            let v = g.getf(g.at(acc, Elt::F32, c)?, g.ctx.f32_type())?;
            g.stf(out, g.add_i(ob, c)?, v)
        })
    }

    /// `sum_c x[xb + c] * y[yb + c]` over `c` in `0..len`, in order, in f32.
    fn dot(
        &self,
        x: PointerValue<'ctx>,
        xb: IntValue<'ctx>,
        y: PointerValue<'ctx>,
        yb: IntValue<'ctx>,
        len: usize,
    ) -> R<FloatValue<'ctx>> {
        let acc = self.var(self.fconst(0.0).into())?;
        self.for_range(self.i64c(len), |g, c| {
            let p = g.fmul(g.ldf(x, g.add_i(xb, c)?)?, g.ldf(y, g.add_i(yb, c)?)?)?;
            g.set(acc, g.fadd(g.getf(acc, g.ctx.f32_type())?, p)?)
        })?;
        self.getf(acc, self.ctx.f32_type())
    }

    /// The row's softmax maximum and `1 / sum`, as the reference's `probs`.
    fn attn_softmax(
        &self,
        a: &Attn,
        row: &AttnRow<'ctx>,
        q: PointerValue<'ctx>,
        k: PointerValue<'ctx>,
    ) -> R<(FloatValue<'ctx>, FloatValue<'ctx>)> {
        let f32t = self.ctx.f32_type();
        let exp = self.exp_fn()?;
        let mx = self.var(self.fconst(f32::NEG_INFINITY).into())?;
        self.for_range(row.lim, |g, j| {
            let s = g.attn_score(a, row, q, k, j)?;
            g.set(mx, g.maxf(g.getf(mx, f32t)?, s)?)
        })?;
        let m = self.getf(mx, f32t)?;
        let sum = self.var(self.fconst(0.0).into())?;
        self.for_range(row.lim, |g, j| {
            let s = g.attn_score(a, row, q, k, j)?;
            let y = g.call(exp, &[g.fsub(s, m)?])?;
            g.set(sum, g.fadd(g.getf(sum, f32t)?, y)?)
        })?;
        Ok((m, self.fdiv(self.fconst(1.0), self.getf(sum, f32t)?)?))
    }

    /// `P_ij = exp(score - max) * inv`.
    #[allow(clippy::too_many_arguments)]
    fn attn_prob(
        &self,
        a: &Attn,
        row: &AttnRow<'ctx>,
        q: PointerValue<'ctx>,
        k: PointerValue<'ctx>,
        j: IntValue<'ctx>,
        mx: FloatValue<'ctx>,
        inv: FloatValue<'ctx>,
    ) -> R<FloatValue<'ctx>> {
        let s = self.attn_score(a, row, q, k, j)?;
        let y = self.call(self.exp_fn()?, &[self.fsub(s, mx)?])?;
        self.fmul(y, inv)
    }

    /// `dP_ij = dO_i . V_j`.
    fn attn_dp(
        &self,
        a: &Attn,
        row: &AttnRow<'ctx>,
        dout: PointerValue<'ctx>,
        v: PointerValue<'ctx>,
        j: IntValue<'ctx>,
    ) -> R<FloatValue<'ctx>> {
        let zero = self.i64c(0);
        let (dout, ob) = match row.mine.dout {
            Some(p) => (p, zero),
            None => (dout, self.mul_i(row.q_row, self.i64c(a.e))?),
        };
        let (v, vb) = match row.mine.v {
            Some(p) => (p, zero),
            None => (v, self.mul_i(self.add_i(row.kv_base, j)?, self.i64c(a.e))?),
        };
        self.dot(dout, ob, v, vb, a.e)
    }

    /// Row `q_row`'s `(max, 1/sum, rowsum(dP * P))` from the statistics buffer.
    fn attn_stats(
        &self,
        stats: PointerValue<'ctx>,
        q_row: IntValue<'ctx>,
    ) -> R<(FloatValue<'ctx>, FloatValue<'ctx>, FloatValue<'ctx>)> {
        let s = self.mul_i(q_row, self.i64c(3))?;
        Ok((
            self.ldf(stats, s)?,
            self.ldf(stats, self.add_i(s, self.i64c(1))?)?,
            self.ldf(stats, self.add_i(s, self.i64c(2))?)?,
        ))
    }

    /// A row's `(mean, 1/sqrt(var + eps))` (layer norm) or `(0, 1/sqrt(mean(x^2) + eps))`
    /// (RMS norm), accumulated in f64 in two passes as the reference does.
    fn moments(
        &self,
        x: PointerValue<'ctx>,
        base: IntValue<'ctx>,
        h: usize,
        rms: bool,
        eps: f64,
    ) -> R<(FloatValue<'ctx>, FloatValue<'ctx>)> {
        let f64t = self.ctx.f64_type();
        let hd = self.dconst(h as f64);
        let hh = self.i64c(h);
        let acc = self.var(self.dconst(0.0).into())?;
        let mean = if rms {
            self.dconst(0.0)
        } else {
            self.for_range(hh, |g, j| {
                let v = g.ext(g.ldf(x, g.add_i(base, j)?)?)?;
                g.set(acc, g.fadd(g.getf(acc, f64t)?, v)?)
            })?;
            self.fdiv(self.getf(acc, f64t)?, hd)?
        };
        let sq = self.var(self.dconst(0.0).into())?;
        self.for_range(hh, |g, j| {
            let v = g.fsub(g.ext(g.ldf(x, g.add_i(base, j)?)?)?, mean)?;
            g.set(sq, g.fadd(g.getf(sq, f64t)?, g.fmul(v, v)?)?)
        })?;
        let var = self.fdiv(self.getf(sq, f64t)?, hd)?;
        let r = self.fdiv(
            self.dconst(1.0),
            self.sqrt_d(self.fadd(var, self.dconst(eps))?)?,
        )?;
        Ok((self.trunc(mean)?, self.trunc(r)?))
    }

    /// Records `k`'s index count for its entries ([`Gen::clamped`]) and adds the globals
    /// `nns_len_<name>` (its index count) and `nns_sizes_<name>` (the bytes of each
    /// buffer it takes), which the PTX and the host library export: `nnscaler-rt` checks
    /// an artifact's header against them, so a header whose counts or sizes were changed
    /// is refused instead of launching past its buffers. A reducer (launched over any
    /// count, [`Kernel::any_len`]) has neither.
    /// AdamW's per-step scalars from `lr, step [, scale]`: the bias corrections' `lr /
    /// (1 - b1^t)` and `sqrt(1 - b2^t)`, each tensor's decay `1 - lr wd` (in f64, rounded
    /// once), the betas and the gradient's scale.
    fn adamw_scalars(
        &self,
        (b1, b2, eps): (f64, f64, f64),
        wds: &[f64],
        scalars: &[PointerValue<'ctx>],
    ) -> R<AdamScalars<'ctx>> {
        let lr = self.ext(self.ldf(scalars[0], self.i64c(0))?)?;
        let t = self.ldf(scalars[1], self.i64c(0))?;
        let ti = e(self.b.build_float_to_signed_int(t, self.ctx.i64_type(), ""))?;
        let one = self.dconst(1.0);
        let bc1 = self.fsub(one, self.powi_d(b1, ti)?)?;
        let bc2 = self.fsub(one, self.powi_d(b2, ti)?)?;
        Ok(AdamScalars {
            bc2_sqrt: self.trunc(self.sqrt_d(bc2)?)?,
            step: self.trunc(self.fdiv(lr, bc1)?)?,
            decay: wds
                .iter()
                .map(|&wd| self.trunc(self.fsub(one, self.fmul(lr, self.dconst(wd))?)?))
                .collect::<R<_>>()?,
            b: (self.fconst(b1 as f32), self.fconst(b2 as f32)),
            a: (
                self.fconst((1.0 - b1) as f32),
                self.fconst((1.0 - b2) as f32),
            ),
            eps: self.fconst(eps as f32),
            scale: match scalars.get(2) {
                Some(&p) => Some(self.ldf(p, self.i64c(0))?),
                None => None,
            },
        })
    }

    /// Element `i` of one AdamW update of tensor `j` of `c`: `t = [p, g, m, v]` in, `outs
    /// = [p', m', v']`.
    fn adamw_elt(
        &self,
        c: &AdamScalars<'ctx>,
        j: usize,
        t: &[PointerValue<'ctx>],
        outs: &[PointerValue<'ctx>],
        i: IntValue<'ctx>,
    ) -> R<()> {
        let p = self.ldf(t[0], i)?;
        let mut gi = self.ldf(t[1], i)?;
        if let Some(s) = c.scale {
            gi = self.fmul(gi, s)?;
        }
        let m = self.fadd(self.fmul(c.b.0, self.ldf(t[2], i)?)?, self.fmul(c.a.0, gi)?)?;
        let v = self.fadd(
            self.fmul(c.b.1, self.ldf(t[3], i)?)?,
            self.fmul(c.a.1, self.fmul(gi, gi)?)?,
        )?;
        let sq = self.call(self.intrinsic("llvm.sqrt")?, &[v])?;
        let denom = self.fadd(self.fdiv(sq, c.bc2_sqrt)?, c.eps)?;
        let p2 = self.fsub(
            self.fmul(p, c.decay[j])?,
            self.fmul(c.step, self.fdiv(m, denom)?)?,
        )?;
        self.stf(outs[0], i, p2)?;
        self.stf(outs[1], i, m)?;
        self.stf(outs[2], i, v)
    }

    /// The multi-tensor AdamW's element `i`: a binary search over the tensors' starts
    /// (`starts[j]..starts[j + 1]` is tensor `j`, for `j` in `range`), then tensor `j`'s
    /// update at `i - starts[j]`.
    fn adamw_search(
        &self,
        c: &AdamScalars<'ctx>,
        ins: &[PointerValue<'ctx>],
        outs: &[PointerValue<'ctx>],
        i: IntValue<'ctx>,
        starts: &[usize],
        range: std::ops::Range<usize>,
    ) -> R<()> {
        if range.len() == 1 {
            let j = range.start;
            let at = self.e_sub(i, self.i64c(starts[j]))?;
            return self.adamw_elt(c, j, &ins[4 * j..4 * j + 4], &outs[3 * j..3 * j + 3], at);
        }
        let mid = range.start + range.len() / 2;
        let func = self
            .b
            .get_insert_block()
            .and_then(|b| b.get_parent())
            .ok_or("no function")?;
        let (lo, hi, done) = (
            self.ctx.append_basic_block(func, "adam.lo"),
            self.ctx.append_basic_block(func, "adam.hi"),
            self.ctx.append_basic_block(func, "adam.done"),
        );
        let below = e(self
            .b
            .build_int_compare(IntPredicate::ULT, i, self.i64c(starts[mid]), ""))?;
        e(self.b.build_conditional_branch(below, lo, hi))?;
        self.b.position_at_end(lo);
        self.adamw_search(c, ins, outs, i, starts, range.start..mid)?;
        e(self.b.build_unconditional_branch(done))?;
        self.b.position_at_end(hi);
        self.adamw_search(c, ins, outs, i, starts, mid..range.end)?;
        e(self.b.build_unconditional_branch(done))?;
        self.b.position_at_end(done);
        Ok(())
    }
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Marks an i64 load or store 8-byte aligned (the IR is built before the target's data
/// layout is set, where i64's default alignment is 4, which NVPTX would split in two).
fn align8(i: Option<inkwell::values::InstructionValue<'_>>) -> R<()> {
    i.ok_or("an i64 access is not an instruction")?
        .set_alignment(8)
        .map_err(|e| format!("LLVM builder: {e}"))
}

/// AdamW's per-step scalars ([`Gen::adamw_scalars`]).
struct AdamScalars<'ctx> {
    bc2_sqrt: FloatValue<'ctx>,
    step: FloatValue<'ctx>,
    /// Each tensor's `1 - lr wd`.
    decay: Vec<FloatValue<'ctx>>,
    b: (FloatValue<'ctx>, FloatValue<'ctx>),
    a: (FloatValue<'ctx>, FloatValue<'ctx>),
    eps: FloatValue<'ctx>,
    scale: Option<FloatValue<'ctx>>,
}

/// Where one attention query row's data lie.
struct AttnRow<'ctx> {
    /// The flat query row (batch, head, position).
    q_row: IntValue<'ctx>,
    /// The first key/value row of its key/value head.
    kv_base: IntValue<'ctx>,
    /// Keys it sees: `0..lim`.
    lim: IntValue<'ctx>,
    /// Copies of the rows only this thread reads, in its own (local) memory, read in the
    /// loops instead of the buffers: the query row and `dO` row of a query-row kernel,
    /// the key row and value row of a key-row kernel (see [`Gen::private_row`]).
    mine: Mine<'ctx>,
}

/// A thread's private copies of attention rows ([`AttnRow::mine`]).
#[derive(Clone, Copy, Default)]
struct Mine<'ctx> {
    q: Option<PointerValue<'ctx>>,
    dout: Option<PointerValue<'ctx>>,
    k: Option<PointerValue<'ctx>>,
    v: Option<PointerValue<'ctx>>,
}

/// `rng::mix64` at compile time (for constant streams).
fn mix64_const(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
