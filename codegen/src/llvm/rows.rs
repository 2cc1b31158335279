//! The attention kernels' rows in scalar form (one thread a query or key row): private
//! copies of a thread's rows, scores, the softmax and its statistics, row products.

use super::*;

impl<'ctx> Gen<'ctx> {
    /// A zeroed `[n x f32]` array in the entry block (one per thread: local memory on a
    /// GPU, registers once loops over it are unrolled).
    pub(super) fn array(&self, n: usize) -> R<PointerValue<'ctx>> {
        let p = self.entry_alloca(self.ctx.f32_type().array_type(n as u32).into())?;
        self.for_range(self.i64c(n), |g, c| g.stf(p, c, g.fconst(0.0)))?;
        Ok(p)
    }

    /// Private copies of query row `i`'s `q` and `dO` rows (a backward query-row kernel).
    pub(super) fn query_rows(
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
    pub(super) fn attn_row(
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
    pub(super) fn query_offset(&self, a: &Attn, ins: &[PointerValue<'ctx>]) -> R<IntValue<'ctx>> {
        match (a.q_offset, ins.last()) {
            (true, Some(&p)) => self.ldi(p, self.i64c(0)),
            (true, None) => {
                Err("an attention on a shard of the positions has no offset input".into())
            }
            (false, _) => Ok(self.i64c(0)),
        }
    }

    /// `scale * (q_i . k_j)`.
    pub(super) fn attn_score(
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
    pub(super) fn private_row(
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
    pub(super) fn copy_elt(
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
    pub(super) fn store_zero(&self, out: PointerValue<'ctx>, elt: Elt, o: IntValue<'ctx>) -> R<()> {
        match elt {
            Elt::F32 | Elt::Bf16 => self.stf(out, o, self.fconst(0.0)),
            Elt::I64 => {
                let st = e(self.b.build_store(self.at(out, elt, o)?, self.i64c(0)))?;
                align8(Some(st))
            }
        }
    }

    /// `acc[c] += s * x[xb + c]` for `c` in `0..len` (`acc`: an [`Gen::array`]).
    pub(super) fn axpy(
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
    pub(super) fn store_array(
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
    pub(super) fn dot(
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
    pub(super) fn attn_softmax(
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
    pub(super) fn attn_prob(
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
    pub(super) fn attn_dp(
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
    pub(super) fn attn_stats(
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
}

/// Where one attention query row's data lie.
pub(super) struct AttnRow<'ctx> {
    /// The flat query row (batch, head, position).
    pub(super) q_row: IntValue<'ctx>,
    /// The first key/value row of its key/value head.
    pub(super) kv_base: IntValue<'ctx>,
    /// Keys it sees: `0..lim`.
    pub(super) lim: IntValue<'ctx>,
    /// Copies of the rows only this thread reads, in its own (local) memory, read in the
    /// loops instead of the buffers: the query row and `dO` row of a query-row kernel,
    /// the key row and value row of a key-row kernel (see [`Gen::private_row`]).
    pub(super) mine: Mine<'ctx>,
}

/// A thread's private copies of attention rows ([`AttnRow::mine`]).
#[derive(Clone, Copy, Default)]
pub(super) struct Mine<'ctx> {
    pub(super) q: Option<PointerValue<'ctx>>,
    pub(super) dout: Option<PointerValue<'ctx>>,
    pub(super) k: Option<PointerValue<'ctx>>,
    pub(super) v: Option<PointerValue<'ctx>>,
}
