//! The team kernels' bodies other than attention's (`tiles.rs`, `mma/`): reductions
//! (whole lines, in parts, by column tiles), the softmax family's lines, layer and RMS
//! norm and their gradients, cross-entropy's rows and gradients, the embedding gradient by
//! table row, the mean of row losses; one method per [`Body`] form, which
//! [`Gen::team_kernel`] dispatches to.

use super::*;

impl<'ctx> Gen<'ctx> {
    /// [`Body::Reduce`] as a team kernel.
    pub(super) fn team_reduce(
        &self,
        tm: &mut Team<'_, 'ctx>,
        op: &Reduce,
        dims: &[usize],
    ) -> R<()> {
        let k = tm.k;
        let t = tm.t;
        let shape = &k.inputs[0].shape;
        let count: usize = dims.iter().map(|&d| shape[d]).product();
        let comb = if *op == Reduce::Max {
            Comb::Max
        } else {
            Comb::Sum
        };
        let s = tm.reduce(count, &[comb], |g, l, r| {
            let base = g.reduce_base(shape, dims, l.row)?;
            let x = g.ldf(l.ins[0], g.reduce_off(shape, dims, base, r)?)?;
            Ok(vec![g.ext(x)?])
        })?[0];
        tm.phase(1, |g, l| {
            let mut v = g.stat(l, t, s)?;
            if let Reduce::Mean(n) = op {
                v = g.fdiv(v, g.dconst(*n as f64))?;
            }
            g.stf(l.outs[0], l.row, g.trunc(v)?)
        })?;
        Ok(())
    }

    /// [`Body::ReducePart`] as a team kernel.
    pub(super) fn team_reduce_part(
        &self,
        tm: &mut Team<'_, 'ctx>,
        op: &Reduce,
        dims: &[usize],
        parts: &usize,
    ) -> R<()> {
        let k = tm.k;
        let t = tm.t;
        let shape = &k.inputs[0].shape;
        let count: usize = dims.iter().map(|&d| shape[d]).product();
        let run = count.div_ceil(*parts);
        let comb = if *op == Reduce::Max {
            Comb::Max
        } else {
            Comb::Sum
        };
        let s = tm.reduce(run, &[comb], |g, l, j| {
            let o = g.div_i(l.row, *parts)?;
            let r = g.add_i(g.mul_i(g.rem_i(l.row, *parts)?, g.i64c(run))?, j)?;
            // The last run may be short: its lanes past the end read the last
            // element and contribute the identity.
            let inside =
                e(g.b.build_int_compare(IntPredicate::ULT, r, g.i64c(count), ""))?;
            let rr = e(g.b.build_select(inside, r, g.i64c(count - 1), ""))?.into_int_value();
            let base = g.reduce_base(shape, dims, o)?;
            let x = g.ext(g.ldf(l.ins[0], g.reduce_off(shape, dims, base, rr)?)?)?;
            let v = e(g.b.build_select(inside, x, identity(g, comb), ""))?;
            Ok(vec![v.into_float_value()])
        })?[0];
        tm.phase(1, |g, l| g.stf(l.outs[0], l.row, g.stat32(l, t, s)?))?;
        Ok(())
    }

    /// [`Body::ColReduce`] as a team kernel.
    pub(super) fn team_col_reduce(
        &self,
        tm: &mut Team<'_, 'ctx>,
        op: &Reduce,
        rows: &usize,
        cols: &usize,
        parts: &usize,
        pairs: &bool,
    ) -> R<()> {
        let (rows, cols, parts, pairs) = (*rows, *cols, *parts, *pairs);
        let tiles = cols.div_ceil(COL_TILE);
        let comb = if *op == Reduce::Max {
            Comb::Max
        } else {
            Comb::Sum
        };
        let op = *op;
        tm.col_reduce(
            &[comb],
            tiles,
            rows.div_ceil(parts),
            rows,
            cols,
            |g, l, r, col| {
                if pairs {
                    let at = g.add_i(g.mul_i(r, g.i64c(2 * cols))?, col)?;
                    let hi = g.ext(g.ldf(l.ins[0], at)?)?;
                    let lo = g.ext(g.ldf(l.ins[0], g.add_i(at, g.i64c(cols))?)?)?;
                    return Ok(vec![g.fadd(hi, lo)?]);
                }
                let x = g.ldf(l.ins[0], g.add_i(g.mul_i(r, g.i64c(cols))?, col)?)?;
                Ok(vec![g.ext(x)?])
            },
            |g, l, cl, v| {
                let mut v = v[0];
                if let Reduce::Mean(n) = op {
                    v = g.fdiv(v, g.dconst(n as f64))?;
                }
                g.st_part(l.outs[0], cl, cols, parts, v)
            },
        )?;
        Ok(())
    }

    /// [`Body::NormGradColTiles`] as a team kernel.
    pub(super) fn team_norm_grad_col_tiles(
        &self,
        tm: &mut Team<'_, 'ctx>,
        rms: &bool,
        parts: &usize,
    ) -> R<()> {
        let k = tm.k;
        let rows = k.inputs[2].shape[0];
        let h = k.inputs[0].len() / rows.max(1);
        let (rms, parts) = (*rms, *parts);
        let tiles = h.div_ceil(COL_TILE);
        tm.col_reduce(
            &[Comb::Sum, Comb::Sum],
            tiles,
            rows.div_ceil(parts),
            rows,
            h,
            |g, l, row, col| {
                let at = g.add_i(g.mul_i(row, g.i64c(h))?, col)?;
                let (d, x) = (g.ldf(l.ins[0], at)?, g.ldf(l.ins[1], at)?);
                let s = g.mul_i(row, g.i64c(2))?;
                let mean = g.ldf(l.ins[2], s)?;
                let r = g.ldf(l.ins[2], g.add_i(s, g.i64c(1))?)?;
                let v = if rms {
                    g.fmul(g.fmul(d, x)?, r)?
                } else {
                    g.fmul(d, g.fmul(g.fsub(x, mean)?, r)?)?
                };
                Ok(vec![g.ext(v)?, g.ext(d)?])
            },
            |g, l, cl, v| {
                g.st_part(l.outs[0], cl, h, parts, v[0])?;
                if !rms {
                    g.st_part(l.outs[1], cl, h, parts, v[1])?;
                }
                Ok(())
            },
        )?;
        Ok(())
    }

    /// [`Body::Lines`] as a team kernel.
    pub(super) fn team_lines(&self, tm: &mut Team<'_, 'ctx>, op: &Line, dim: &usize) -> R<()> {
        let k = tm.k;
        let t = tm.t;
        let shape = &k.inputs[0].shape;
        let n = shape[*dim];
        let inner: usize = shape[dim + 1..].iter().product();
        let at = move |g: &Gen<'ctx>, l: &Lane<'ctx>, j: IntValue<'ctx>| {
            let o = g.div_i(l.row, inner)?;
            let ii = g.rem_i(l.row, inner)?;
            let base = g.add_i(g.mul_i(o, g.i64c(n * inner))?, ii)?;
            g.add_i(base, g.mul_i(j, g.i64c(inner))?)
        };
        match op {
            Line::Softmax | Line::LogSoftmax => {
                let mx = tm.reduce(n, &[Comb::Max], |g, l, j| {
                    Ok(vec![g.ext(g.ldf(l.ins[0], at(g, l, j)?)?)?])
                })?[0];
                let sum = tm.reduce(n, &[Comb::Sum], |g, l, j| {
                    let m = g.stat32(l, t, mx)?;
                    let y = g.call(g.exp_fn()?, &[g.fsub(g.ldf(l.ins[0], at(g, l, j)?)?, m)?])?;
                    Ok(vec![g.ext(y)?])
                })?[0];
                let soft = *op == Line::Softmax;
                tm.each(n, |g, l, j| {
                    let (m, s) = (g.stat32(l, t, mx)?, g.stat32(l, t, sum)?);
                    let a = at(g, l, j)?;
                    let x = g.ldf(l.ins[0], a)?;
                    let v = if soft {
                        let y = g.call(g.exp_fn()?, &[g.fsub(x, m)?])?;
                        g.fmul(y, g.fdiv(g.fconst(1.0), s)?)?
                    } else {
                        g.fsub(x, g.fadd(m, g.call(g.log_fn()?, &[s])?)?)?
                    };
                    g.stf(l.outs[0], a, v)
                })?;
            }
            Line::SoftmaxGrad | Line::LogSoftmaxGrad => {
                let dot = *op == Line::SoftmaxGrad;
                let s = tm.reduce(n, &[Comb::Sum], |g, l, j| {
                    let a = at(g, l, j)?;
                    let d = g.ldf(l.ins[0], a)?;
                    let v = if dot {
                        g.fmul(d, g.ldf(l.ins[1], a)?)?
                    } else {
                        d
                    };
                    Ok(vec![g.ext(v)?])
                })?[0];
                tm.each(n, |g, l, j| {
                    let a = at(g, l, j)?;
                    let s = g.stat32(l, t, s)?;
                    let (d, y) = (g.ldf(l.ins[0], a)?, g.ldf(l.ins[1], a)?);
                    let v = if dot {
                        g.fmul(y, g.fsub(d, s)?)?
                    } else {
                        g.fsub(d, g.fmul(g.call(g.exp_fn()?, &[y])?, s)?)?
                    };
                    g.stf(l.outs[0], a, v)
                })?;
            }
        }
        Ok(())
    }

    /// [`Body::Norm`] as a team kernel.
    pub(super) fn team_norm(&self, tm: &mut Team<'_, 'ctx>, rms: &bool, eps: &f64) -> R<()> {
        let k = tm.k;
        let t = tm.t;
        let h = k.inputs[1].shape[0];
        let (rms, eps) = (*rms, *eps);
        let slots = self.norm_reductions(tm, 0, h, rms)?;
        tm.each(h, |g, l, j| {
            let (mean, scale) = g.team_moments(l, t, &slots, h, eps)?;
            let at = g.add_i(g.mul_i(l.row, g.i64c(h))?, j)?;
            let x = g.ldf(l.ins[0], at)?;
            let w = g.ldf(l.ins[1], j)?;
            let v = if rms {
                g.fmul(g.fmul(x, scale)?, w)?
            } else {
                let b = g.ldf(l.ins[2], j)?;
                g.fadd(g.fmul(g.fmul(g.fsub(x, mean)?, scale)?, w)?, b)?
            };
            g.stf(l.outs[0], at, v)
        })?;
        Ok(())
    }

    /// [`Body::NormGradRows`] as a team kernel.
    pub(super) fn team_norm_grad_rows(
        &self,
        tm: &mut Team<'_, 'ctx>,
        rms: &bool,
        eps: &f64,
    ) -> R<()> {
        let k = tm.k;
        let t = tm.t;
        let h = k.inputs[2].shape[0];
        let (rms, eps) = (*rms, *eps);
        let mo = self.norm_reductions(tm, 1, h, rms)?;
        let load = move |g: &Gen<'ctx>, l: &Lane<'ctx>, j: IntValue<'ctx>| {
            let at = g.add_i(g.mul_i(l.row, g.i64c(h))?, j)?;
            let (d, x) = (g.ldf(l.ins[0], at)?, g.ldf(l.ins[1], at)?);
            Ok::<_, String>((at, d, x, g.ldf(l.ins[2], j)?))
        };
        let combs: &[Comb] = if rms {
            &[Comb::Sum]
        } else {
            &[Comb::Sum, Comb::Sum]
        };
        let acc = tm.reduce(h, combs, |g, l, j| {
            let (mean, r) = g.team_moments(l, t, &mo, h, eps)?;
            let (_, d, x, w) = load(g, l, j)?;
            if rms {
                Ok(vec![g.ext(g.fmul(g.fmul(d, w)?, x)?)?])
            } else {
                let gw = g.fmul(d, w)?;
                let xh = g.fmul(g.fsub(x, mean)?, r)?;
                Ok(vec![g.ext(gw)?, g.ext(g.fmul(gw, xh)?)?])
            }
        })?;
        let ms = |g: &Gen<'ctx>, l: &Lane<'ctx>| {
            let hd = g.dconst(h as f64);
            let m1 = g.trunc(g.fdiv(g.stat(l, t, acc[0])?, hd)?)?;
            let m2 = match acc.get(1) {
                Some(&s) => g.trunc(g.fdiv(g.stat(l, t, s)?, hd)?)?,
                None => g.fconst(0.0),
            };
            Ok::<_, String>((m1, m2))
        };
        tm.each(h, |g, l, j| {
            let (mean, r) = g.team_moments(l, t, &mo, h, eps)?;
            let (m1, m2) = ms(g, l)?;
            let (at, d, x, w) = load(g, l, j)?;
            let gw = g.fmul(d, w)?;
            let v = if rms {
                let kk = g.fmul(g.fmul(m1, r)?, r)?;
                g.fmul(r, g.fsub(gw, g.fmul(x, kk)?)?)?
            } else {
                let xh = g.fmul(g.fsub(x, mean)?, r)?;
                g.fmul(r, g.fsub(g.fsub(gw, m1)?, g.fmul(xh, m2)?)?)?
            };
            g.stf(l.outs[0], at, v)
        })?;
        tm.phase(1, |g, l| {
            let (mean, r) = g.team_moments(l, t, &mo, h, eps)?;
            let s = g.mul_i(l.row, g.i64c(2))?;
            g.stf(l.outs[1], s, mean)?;
            g.stf(l.outs[1], g.add_i(s, g.i64c(1))?, r)
        })?;
        Ok(())
    }

    /// [`Body::XentRows`] as a team kernel.
    pub(super) fn team_xent_rows(&self, tm: &mut Team<'_, 'ctx>) -> R<()> {
        let k = tm.k;
        let t = tm.t;
        let v = classes(&k.inputs[0]);
        let z = move |g: &Gen<'ctx>, l: &Lane<'ctx>, j: IntValue<'ctx>| {
            g.ldf(l.ins[0], g.add_i(g.mul_i(l.row, g.i64c(v))?, j)?)
        };
        let (mx, sum) = self.lse_reductions(tm, v, z)?;
        tm.phase(1, |g, l| {
            // ln of the f64 sum rounded to f32, as the one-thread kernel.
            let ls = g.call(g.log_fn()?, &[g.stat32(l, t, sum)?])?;
            let lse = g.fadd(g.stat(l, t, mx)?, g.ext(ls)?)?;
            let target = g.ldi(l.ins[1], l.row)?;
            let inside =
                e(g.b.build_int_compare(IntPredicate::ULT, target, g.i64c(v), ""))?;
            g.stf(l.outs[0], l.row, g.fconst(f32::NAN))?;
            g.when(inside, |g| {
                let zt = g.ext(z(g, l, target)?)?;
                g.stf(l.outs[0], l.row, g.trunc(g.fsub(lse, zt)?)?)
            })
        })?;
        Ok(())
    }

    /// [`Body::EmbeddingGradRows`] as a team kernel.
    pub(super) fn team_embedding_grad_rows(&self, tm: &mut Team<'_, 'ctx>, parts: &usize) -> R<()> {
        let k = tm.k;
        // dy [tokens, w], ids -> out: the table [rows, w], or `parts` of them.
        let w = k.inputs[0].len() / k.inputs[1].len().max(1);
        let tokens = k.inputs[1].len();
        // The table's rows (the output holds `parts` pairs of tables when cut).
        let copies = if *parts > 1 { 2 * parts } else { 1 };
        let rows = k.outputs[0].len() / (w * copies).max(1);
        let run = tokens.div_ceil(*parts);
        // One part sums in f32 in token order, the reference's bits; parts in f64
        // (each rounded once, then summed by the total).
        let wide = *parts > 1;
        tm.each(w, |g, l, c| {
            let acc_t = if wide {
                g.ctx.f64_type()
            } else {
                g.ctx.f32_type()
            };
            let id = g.rem_i(l.row, rows)?;
            let part = g.div_i(l.row, rows)?;
            let first = g.mul_i(part, g.i64c(run))?;
            let end = g.min_i(g.add_i(first, g.i64c(run))?, g.i64c(tokens))?;
            let zero = if wide { g.dconst(0.0) } else { g.fconst(0.0) };
            let acc = g.var(zero.into())?;
            g.for_step(first, end, 1, |g, tk| {
                let hit =
                    e(g.b.build_int_compare(IntPredicate::EQ, g.ldi(l.ins[1], tk)?, id, ""))?;
                g.when(hit, |g| {
                    let d = g.ldf(l.ins[0], g.add_i(g.mul_i(tk, g.i64c(w))?, c)?)?;
                    let d = if wide { g.ext(d)? } else { d };
                    g.set(acc, g.fadd(g.getf(acc, acc_t)?, d)?)
                })
            })?;
            let v = g.getf(acc, acc_t)?;
            if !wide {
                let at = g.add_i(g.mul_i(id, g.i64c(w))?, c)?;
                return g.stf(l.outs[0], at, v);
            }
            // Part p's pair of tables at p * 2 * rows * w.
            let table = rows * w;
            let at = g.add_i(
                g.mul_i(part, g.i64c(2 * table))?,
                g.add_i(g.mul_i(id, g.i64c(w))?, c)?,
            )?;
            g.st_pair(l.outs[0], at, table, v)
        })?;
        Ok(())
    }

    /// [`Body::MeanOf`] as a team kernel.
    pub(super) fn team_mean_of(&self, tm: &mut Team<'_, 'ctx>, count: &usize) -> R<()> {
        let k = tm.k;
        let t = tm.t;
        let n = k.inputs[0].len();
        let s = tm.reduce(n, &[Comb::Sum], |g, l, r| {
            Ok(vec![g.ext(g.ldf(l.ins[0], r)?)?])
        })?[0];
        tm.phase(1, |g, l| {
            let m = g.fdiv(g.stat(l, t, s)?, g.dconst(*count as f64))?;
            g.stf(l.outs[0], l.row, g.trunc(m)?)
        })?;
        Ok(())
    }

    /// [`Body::XentGrad`] as a team kernel.
    pub(super) fn team_xent_grad(&self, tm: &mut Team<'_, 'ctx>, count: &usize) -> R<()> {
        let k = tm.k;
        let t = tm.t;
        let v = classes(&k.inputs[1]);
        let at = move |g: &Gen<'ctx>, l: &Lane<'ctx>, j: IntValue<'ctx>| {
            g.add_i(g.mul_i(l.row, g.i64c(v))?, j)
        };
        let z =
            move |g: &Gen<'ctx>, l: &Lane<'ctx>, j: IntValue<'ctx>| g.ldf(l.ins[1], at(g, l, j)?);
        let (mx, sum) = self.lse_reductions(tm, v, z)?;
        tm.each(v, |g, l, j| {
            let dl = g.ldf(l.ins[0], g.i64c(0))?;
            let scale = g.fdiv(dl, g.fconst(*count as f32))?;
            let inv = g.fdiv(g.fconst(1.0), g.stat32(l, t, sum)?)?;
            let m = g.stat32(l, t, mx)?;
            let y = g.call(g.exp_fn()?, &[g.fsub(z(g, l, j)?, m)?])?;
            let y = g.fmul(y, inv)?;
            let target = g.ldi(l.ins[2], l.row)?;
            let hit = e(g.b.build_int_compare(IntPredicate::EQ, j, target, ""))?;
            let y = e(g.b.build_select(hit, g.fsub(y, g.fconst(1.0))?, y, ""))?.into_float_value();
            g.stf(l.outs[0], at(g, l, j)?, g.fmul(y, scale)?)
        })?;
        Ok(())
    }

    /// [`Body::XentGradLse`] as a team kernel.
    pub(super) fn team_xent_grad_lse(
        &self,
        tm: &mut Team<'_, 'ctx>,
        count: &usize,
        sharded: &bool,
    ) -> R<()> {
        let k = tm.k;
        // ins: dloss, logits [rows, v], targets, lse [rows, 1] (, offset).
        let v = classes(&k.inputs[1]);
        let sharded = *sharded;
        tm.each(v, |g, l, j| {
            let dl = g.ldf(l.ins[0], g.i64c(0))?;
            let scale = g.fdiv(dl, g.fconst(*count as f32))?;
            let lse = g.ldf(l.ins[3], l.row)?;
            let off = if sharded {
                g.ldi(l.ins[4], g.i64c(0))?
            } else {
                g.i64c(0)
            };
            let col = g.e_sub(g.ldi(l.ins[2], l.row)?, off)?;
            let at = g.add_i(g.mul_i(l.row, g.i64c(v))?, j)?;
            let y = g.call(g.exp_fn()?, &[g.fsub(g.ldf(l.ins[1], at)?, lse)?])?;
            let y = g.fmul(y, scale)?;
            let hit = e(g.b.build_int_compare(IntPredicate::EQ, j, col, ""))?;
            let y = e(g.b.build_select(hit, g.fsub(y, scale)?, y, ""))?.into_float_value();
            g.stf(l.outs[0], at, y)
        })?;
        Ok(())
    }
}
