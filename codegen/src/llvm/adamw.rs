//! AdamW's kernel bodies: the per-step scalars, one element's update, and the tensor of
//! an element in a multi-tensor launch.

use super::*;

impl<'ctx> Gen<'ctx> {
    /// Records `k`'s index count for its entries ([`Gen::clamped`]) and adds the globals
    /// `nns_len_<name>` (its index count) and `nns_sizes_<name>` (the bytes of each
    /// buffer it takes), which the PTX and the host library export: `nnscaler-rt` checks
    /// an artifact's header against them, so a header whose counts or sizes were changed
    /// is refused instead of launching past its buffers. A reducer (launched over any
    /// count, [`Kernel::any_len`]) has neither.
    /// AdamW's per-step scalars from `lr, step [, scale]`: the bias corrections' `lr /
    /// (1 - b1^t)` and `sqrt(1 - b2^t)`, each tensor's decay `1 - lr wd` (in f64, rounded
    /// once), the betas and the gradient's scale.
    pub(super) fn adamw_scalars(
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
    pub(super) fn adamw_elt(
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
    pub(super) fn adamw_search(
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

/// AdamW's per-step scalars ([`Gen::adamw_scalars`]).
pub(super) struct AdamScalars<'ctx> {
    pub(super) bc2_sqrt: FloatValue<'ctx>,
    pub(super) step: FloatValue<'ctx>,
    /// Each tensor's `1 - lr wd`.
    pub(super) decay: Vec<FloatValue<'ctx>>,
    pub(super) b: (FloatValue<'ctx>, FloatValue<'ctx>),
    pub(super) a: (FloatValue<'ctx>, FloatValue<'ctx>),
    pub(super) eps: FloatValue<'ctx>,
    pub(super) scale: Option<FloatValue<'ctx>>,
}
