//! The builder's primitives every kernel body uses: formulas, index arithmetic, loops and
//! conditions, typed loads and stores, f64 helpers and the counter-based random bits.

use super::*;

impl<'ctx> Gen<'ctx> {
    /// Emits `expr` at the current position; `load(k)` gives input `k`'s element.
    pub(super) fn expr(
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
    pub(super) fn broadcast_offset(
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

    pub(super) fn i64c(&self, v: usize) -> IntValue<'ctx> {
        self.ctx.i64_type().const_int(v as u64, false)
    }

    pub(super) fn dconst(&self, v: f64) -> FloatValue<'ctx> {
        self.ctx.f64_type().const_float(v)
    }

    pub(super) fn intrinsic_of(
        &self,
        name: &str,
        ty: BasicTypeEnum<'ctx>,
    ) -> R<FunctionValue<'ctx>> {
        Intrinsic::find(name)
            .and_then(|i| i.get_declaration(&self.module, &[ty]))
            .ok_or_else(|| format!("LLVM has no intrinsic {name}"))
    }

    /// The declaration of intrinsic `name`, one that is not overloaded on types.
    pub(super) fn intrinsic_fixed(&self, name: &str) -> R<FunctionValue<'ctx>> {
        Intrinsic::find(name)
            .and_then(|i| i.get_declaration(&self.module, &[]))
            .ok_or_else(|| format!("LLVM has no intrinsic {name}"))
    }

    /// A stack slot of `ty` at the start of the current function's entry block (where
    /// O3's promotion to registers looks for them).
    pub(super) fn entry_alloca(&self, ty: BasicTypeEnum<'ctx>) -> R<PointerValue<'ctx>> {
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
    pub(super) fn var(&self, init: BasicValueEnum<'ctx>) -> R<PointerValue<'ctx>> {
        let p = self.entry_alloca(init.get_type())?;
        e(self.b.build_store(p, init))?;
        Ok(p)
    }

    pub(super) fn getf(&self, p: PointerValue<'ctx>, ty: FloatType<'ctx>) -> R<FloatValue<'ctx>> {
        Ok(e(self.b.build_load(ty, p, ""))?.into_float_value())
    }

    pub(super) fn geti(&self, p: PointerValue<'ctx>) -> R<IntValue<'ctx>> {
        Ok(e(self.b.build_load(self.ctx.i64_type(), p, ""))?.into_int_value())
    }

    pub(super) fn set(&self, p: PointerValue<'ctx>, v: impl BasicValue<'ctx>) -> R<()> {
        e(self.b.build_store(p, v)).map(|_| ())
    }

    /// `f(j)` for `j` in `0..n`.
    pub(super) fn for_range(
        &self,
        n: IntValue<'ctx>,
        f: impl FnMut(&Self, IntValue<'ctx>) -> R<()>,
    ) -> R<()> {
        self.for_step(self.i64c(0), n, 1, f)
    }

    /// `j = f(j)` from `start` while `j` is below `end`: a counted loop ([`Self::for_step`])
    /// or a list's walk.
    pub(super) fn walk(
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
    pub(super) fn for_step(
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
    pub(super) fn reduce_base(
        &self,
        shape: &[usize],
        dims: &[usize],
        i: IntValue<'ctx>,
    ) -> R<IntValue<'ctx>> {
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
    pub(super) fn reduce_off(
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
    pub(super) fn when(&self, c: IntValue<'ctx>, f: impl FnOnce(&Self) -> R<()>) -> R<()> {
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
    pub(super) fn elt_of(&self, base: PointerValue<'ctx>) -> Elt {
        match self.elts.borrow().get(&base) {
            Some(Elt::Bf16) => Elt::Bf16,
            _ => Elt::F32,
        }
    }

    /// The address of element `off` of a buffer of `elt`s.
    pub(super) fn at(
        &self,
        base: PointerValue<'ctx>,
        elt: Elt,
        off: IntValue<'ctx>,
    ) -> R<PointerValue<'ctx>> {
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
    pub(super) fn ldf(&self, base: PointerValue<'ctx>, off: IntValue<'ctx>) -> R<FloatValue<'ctx>> {
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

    pub(super) fn ldi(&self, base: PointerValue<'ctx>, off: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        let v = self.geti(self.at(base, Elt::I64, off)?)?;
        align8(v.as_instruction_value())?;
        Ok(v)
    }

    /// Stores `v` at element `off` of a float buffer (a bf16 buffer's rounded to nearest
    /// even, as `scalar::round_bf16`; a NaN stored as bf16's quiet NaN).
    pub(super) fn stf(
        &self,
        base: PointerValue<'ctx>,
        off: IntValue<'ctx>,
        v: FloatValue<'ctx>,
    ) -> R<()> {
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

    pub(super) fn add_i(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        e(self.b.build_int_add(a, b, ""))
    }
    pub(super) fn mul_i(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        e(self.b.build_int_mul(a, b, ""))
    }
    pub(super) fn e_sub(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        e(self.b.build_int_sub(a, b, ""))
    }
    pub(super) fn div_i(&self, a: IntValue<'ctx>, b: usize) -> R<IntValue<'ctx>> {
        e(self.b.build_int_unsigned_div(a, self.i64c(b), ""))
    }
    pub(super) fn rem_i(&self, a: IntValue<'ctx>, b: usize) -> R<IntValue<'ctx>> {
        e(self.b.build_int_unsigned_rem(a, self.i64c(b), ""))
    }
    pub(super) fn ext(&self, v: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_ext(v, self.ctx.f64_type(), ""))
    }
    pub(super) fn trunc(&self, v: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        e(self.b.build_float_trunc(v, self.ctx.f32_type(), ""))
    }
    pub(super) fn maxf(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        self.call(self.intrinsic("llvm.maxnum")?, &[a, b])
    }
    pub(super) fn sqrt_d(&self, v: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        self.call(
            self.intrinsic_of("llvm.sqrt", self.ctx.f64_type().into())?,
            &[v],
        )
    }

    /// `b^t` in f64 for a whole `t >= 0` (binary powering; within a few f64 ulps of libm's
    /// `pow`, far below f32 rounding).
    pub(super) fn powi_d(&self, b: f64, t: IntValue<'ctx>) -> R<FloatValue<'ctx>> {
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
    pub(super) fn mix64(&self, z: IntValue<'ctx>) -> R<IntValue<'ctx>> {
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
    pub(super) fn rng_bits(
        &self,
        seed: IntValue<'ctx>,
        stream: u64,
        index: IntValue<'ctx>,
    ) -> R<IntValue<'ctx>> {
        let ms = self.ctx.i64_type().const_int(mix64_const(stream), false);
        let inner = self.mix64(e(self.b.build_xor(seed, ms, ""))?)?;
        self.mix64(e(self.b.build_xor(inner, index, ""))?)
    }
}
