//! The backward on tensor cores: the statistics and `dq` by query tile
//! ([`crate::kernel::Body::AttnMmaBack`]), `dk` and `dv` by key tile
//! ([`crate::kernel::Body::AttnMmaKv`]); `dS`, `P^T` and `dS^T` kept in registers as the
//! next products' `A` operands, as the forward keeps `P`.

use super::*;

/// A row's statistic `c` (0: m, 1: 1/l, 2: D) among the f32 words of a backward's shared
/// array.
fn stat_at<'ctx>(g: &Gen<'ctx>, mb: &MmaBack, r: IntValue<'ctx>, c: usize) -> R<IntValue<'ctx>> {
    g.add_i(g.i64c(mb.x_at / 2 + c), g.mul_i(r, g.i64c(4))?)
}

impl<'ctx> Gen<'ctx> {
    /// The backward's statistics and `dq` on tensor cores
    /// ([`crate::kernel::Body::AttnMmaBack`]): `dout, q, k, v, out, stats (, offset) ->
    /// stats3, dq`.
    pub(in crate::llvm) fn attn_mma_dq(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let mb = a
            .mma_dq()
            .ok_or("this attention's backward does not take tensor cores")?;
        let a = *a;
        let (d, ev, kb) = (a.d, a.e, mb.tile);
        let [q_at, do_at, k_at, v_at] = mb.at;
        let nk = kb / 8;
        // f32 operands: three TF32 products, k-steps of 8.
        let tf = a.tf32x3;
        // A lane's memory: its dq fragments, then dS as A fragments (of 4 words a k-step:
        // bf16 pairs, or f32s).
        let (lq, lds) = (0, 4 * (d / 8));
        let words = lds + 4 * kb / if tf { 8 } else { 16 };
        tm.local = words;
        tm.shared = Shared::Tile(mb.words);
        let all = MMA_LANES;
        tm.phase(all, |g, l| {
            let m = g.mma_lane(&a, l)?;
            let n = g.min_i(g.i64c(MMA_ROWS), g.e_sub(g.i64c(a.s), m.q0)?)?;
            g.stage16(l, l.ins[1], m.qrow0, (n, MMA_ROWS, d), (q_at, mb.qp))?;
            g.stage16(l, l.ins[0], m.qrow0, (n, MMA_ROWS, ev), (do_at, mb.ep))?;
            for w in 0..4 * (d / 8) {
                g.lput(l, lq + w, g.fconst(0.0))?;
            }
            // Lanes 0..64 each take a row's statistics: the kept [m, 1/l] and D = dO .
            // out (the output as stored), in order; rows past the end weigh nothing.
            let r = l.lane;
            g.when(g.ult(r, g.i64c(MMA_ROWS))?, |g| {
                let f32t = g.ctx.f32_type();
                let vals = [
                    g.var(g.fconst(0.0).into())?,
                    g.var(g.fconst(0.0).into())?,
                    g.var(g.fconst(0.0).into())?,
                ];
                g.when(g.ult(g.add_i(m.q0, r)?, g.i64c(a.s))?, |g| {
                    let qrow = g.add_i(m.qrow0, r)?;
                    let ob = g.mul_i(qrow, g.i64c(ev))?;
                    let mut dsum = g.fconst(0.0);
                    for c in 0..ev {
                        let at = g.add_i(ob, g.i64c(c))?;
                        dsum = g.fma(g.ldf(l.ins[0], at)?, g.ldf(l.ins[4], at)?, dsum)?;
                    }
                    let s2 = g.mul_i(qrow, g.i64c(2))?;
                    g.set(vals[0], g.ldf(l.ins[5], s2)?)?;
                    g.set(vals[1], g.ldf(l.ins[5], g.add_i(s2, g.i64c(1))?)?)?;
                    g.set(vals[2], dsum)?;
                    let s3 = g.mul_i(qrow, g.i64c(3))?;
                    for (c, v) in vals.iter().enumerate() {
                        g.stf(l.outs[0], g.add_i(s3, g.i64c(c))?, g.getf(*v, f32t)?)?;
                    }
                    Ok(())
                })?;
                for (c, v) in vals.iter().enumerate() {
                    g.stf(l.sh, stat_at(g, &mb, r, c)?, g.getf(*v, f32t)?)?;
                }
                Ok(())
            })
        })?;
        let tile =
            move |g: &Gen<'ctx>, l: &Lane<'ctx>, m: &MmaLane<'ctx>| g.mma_key_tile(&a, l, m, kb);
        tm.repeat(a.t.div_ceil(kb), |tm| {
            tm.phase(all, |g, l| {
                let m = g.mma_lane(&a, l)?;
                let (ts, n, needed) = tile(g, l, &m)?;
                g.when(needed, |g| {
                    let first = g.add_i(m.kv_base, ts)?;
                    g.stage16(l, l.ins[2], first, (n, kb, d), (k_at, mb.qp))?;
                    g.stage16(l, l.ins[3], first, (n, kb, ev), (v_at, mb.ep))
                })
            })?;
            // S = Q K^T and dP = dO V^T; dS = P (dP - D) in the lane's words (bf16 pairs,
            // or f32s).
            tm.phase(all, |g, l| {
                let m = g.mma_lane(&a, l)?;
                let (ts, _, needed) = tile(g, l, &m)?;
                g.when(needed, |g| {
                    let zero = [g.fconst(0.0); 4];
                    let qa = g.add_i(g.i64c(q_at), g.mul_i(m.w16, g.i64c(mb.qp))?)?;
                    let s = g.products(
                        l.sh,
                        (qa, mb.qp),
                        (g.i64c(k_at), mb.qp),
                        (nk, d, tf),
                        m.wl,
                        |_| Ok(zero),
                    )?;
                    let oa = g.add_i(g.i64c(do_at), g.mul_i(m.w16, g.i64c(mb.ep))?)?;
                    let dp = g.products(
                        l.sh,
                        (oa, mb.ep),
                        (g.i64c(v_at), mb.ep),
                        (nk, ev, tf),
                        m.wl,
                        |_| Ok(zero),
                    )?;
                    let exp = g.exp_fn()?;
                    for h in 0..2 {
                        let r = g.mma_row(&m, h)?;
                        let st = |c| g.ldf(l.sh, stat_at(g, &mb, r, c)?);
                        let (mx, inv, dsum) = (st(0)?, st(1)?, st(2)?);
                        let lim = g.mma_lim(&a, &m, r)?;
                        for j in 0..nk {
                            let mut pair = Vec::with_capacity(2);
                            for i in [2 * h, 2 * h + 1] {
                                let col = g.frag_col(m.t, i, 8 * j)?;
                                let seen = g.ult(g.add_i(ts, col)?, lim)?;
                                let sc = g.fmul(s[j][i], g.fconst(a.scale))?;
                                let p = g.fmul(g.call(exp, &[g.fsub(sc, mx)?])?, inv)?;
                                let p = g.select_f(seen, p, g.fconst(0.0))?;
                                pair.push(g.fmul(p, g.fsub(dp[j][i], dsum)?)?);
                            }
                            g.keep_a(l, lds, (j, h), (pair[0], pair[1]), tf)?;
                        }
                    }
                    Ok(())
                })
            })?;
            // dq += dS K, dS from the warp's registers.
            tm.warp_phase(|g, l| {
                let m = g.mma_lane(&a, l)?;
                let (_, _, needed) = tile(g, l, &m)?;
                g.when(needed, |g| {
                    let c = g.products_regs(
                        l,
                        (lds, words),
                        (g.i64c(k_at), mb.qp),
                        (d / 8, kb, tf),
                        m.wl,
                        |j| g.frag_of(l, lq + 4 * j),
                    )?;
                    for (j, cj) in c.iter().enumerate() {
                        for (i, ci) in cj.iter().enumerate() {
                            g.lput(l, lq + 4 * j + i, *ci)?;
                        }
                    }
                    Ok(())
                })
            })
        })?;
        tm.phase(all, |g, l| {
            let m = g.mma_lane(&a, l)?;
            for h in 0..2 {
                let r = g.mma_row(&m, h)?;
                g.when(g.ult(g.add_i(m.q0, r)?, g.i64c(a.s))?, |g| {
                    let ob = g.mul_i(g.add_i(m.qrow0, r)?, g.i64c(d))?;
                    for j in 0..d / 8 {
                        for i in [2 * h, 2 * h + 1] {
                            let v = g.fmul(g.lw(l, lq + 4 * j + i)?, g.fconst(a.scale))?;
                            g.stf(l.outs[1], g.add_i(ob, g.frag_col(m.t, i, 8 * j)?)?, v)?;
                        }
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
    }
}

impl<'ctx> Gen<'ctx> {
    /// `dk`, `dv` on tensor cores ([`crate::kernel::Body::AttnMmaKv`]): `dout, q, k, v,
    /// stats3 (, offset) -> dk, dv`.
    pub(in crate::llvm) fn attn_mma_kv(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let mb = a
            .mma_kv()
            .ok_or("this attention's backward does not take tensor cores")?;
        let a = *a;
        let (d, ev, qb) = (a.d, a.e, mb.tile);
        let [k_at, v_at, q_at, do_at] = mb.at;
        // f32 operands: three TF32 products, k-steps of 8.
        let tf = a.tf32x3;
        // A lane's memory: its dK and dV fragments, then P^T and dS^T as A fragments.
        let (ldk, ldv) = (0, 4 * (d / 8));
        let a_words = 4 * qb / if tf { 8 } else { 16 };
        let (lpt, ldst) = (ldv + 4 * (ev / 8), ldv + 4 * (ev / 8) + a_words);
        let words = ldst + a_words;
        tm.local = words;
        tm.shared = Shared::Tile(mb.words);
        let all = MMA_LANES;
        let k_tiles = a.t.div_ceil(MMA_ROWS);
        let q_tiles = a.s.div_ceil(qb);
        let per = a.h / a.g;
        // The block's key/value head (batch * g + head), first key, and the lane's fragment
        // coordinates.
        let block = move |g: &Gen<'ctx>, l: &Lane<'ctx>| {
            let bg = g.div_i(l.row, k_tiles)?;
            let first = g.mul_i(g.rem_i(l.row, k_tiles)?, g.i64c(MMA_ROWS))?;
            let wl = g.rem_i(l.lane, 32)?;
            let w16 = g.mul_i(g.div_i(l.lane, 32)?, g.i64c(16))?;
            Ok::<_, String>((bg, first, wl, w16, g.div_i(wl, 4)?, g.rem_i(wl, 4)?))
        };
        // Iteration `l.iter`'s query tile: its first flat row, first position, length, and
        // whether the block needs it (causal: its last query sees the block's first key).
        let queries = move |g: &Gen<'ctx>, l: &Lane<'ctx>, bg, first| {
            let (bi, kvh) = (g.div_i(bg, a.g)?, g.rem_i(bg, a.g)?);
            let hh = g.div_i(l.iter, q_tiles)?;
            let q0 = g.mul_i(g.rem_i(l.iter, q_tiles)?, g.i64c(qb))?;
            let hi = g.add_i(g.mul_i(kvh, g.i64c(per))?, hh)?;
            let qh = g.add_i(g.mul_i(bi, g.i64c(a.h))?, hi)?;
            let n = g.min_i(g.i64c(qb), g.e_sub(g.i64c(a.s), q0)?)?;
            let off = g.query_offset(&a, &l.ins)?;
            let needed = if a.causal {
                g.ult(first, g.add_i(g.add_i(q0, n)?, off)?)?
            } else {
                g.ctx.bool_type().const_int(1, false)
            };
            let row0 = g.add_i(g.mul_i(qh, g.i64c(a.s))?, q0)?;
            Ok::<_, String>((row0, q0, n, needed, off))
        };
        tm.phase(all, |g, l| {
            let (bg, first, ..) = block(g, l)?;
            let n = g.min_i(g.i64c(MMA_ROWS), g.e_sub(g.i64c(a.t), first)?)?;
            let row = g.add_i(g.mul_i(bg, g.i64c(a.t))?, first)?;
            g.stage16(l, l.ins[2], row, (n, MMA_ROWS, d), (k_at, mb.qp))?;
            g.stage16(l, l.ins[3], row, (n, MMA_ROWS, ev), (v_at, mb.ep))?;
            for w in 0..words {
                g.lput(l, w, g.fconst(0.0))?;
            }
            Ok(())
        })?;
        tm.repeat(per * q_tiles, |tm| {
            tm.phase(all, |g, l| {
                let (bg, first, ..) = block(g, l)?;
                let (row0, _, n, needed, _) = queries(g, l, bg, first)?;
                g.when(needed, |g| {
                    g.stage16(l, l.ins[1], row0, (n, qb, d), (q_at, mb.qp))?;
                    g.stage16(l, l.ins[0], row0, (n, qb, ev), (do_at, mb.ep))?;
                    let r = l.lane;
                    g.when(g.ult(r, g.i64c(qb))?, |g| {
                        let inside = g.ult(r, n)?;
                        let s3 = g.mul_i(g.add_i(row0, r)?, g.i64c(3))?;
                        for c in 0..3 {
                            let v = g.var(g.fconst(0.0).into())?;
                            g.when(inside, |g| {
                                g.set(v, g.ldf(l.ins[4], g.add_i(s3, g.i64c(c))?)?)
                            })?;
                            let v = g.getf(v, g.ctx.f32_type())?;
                            g.stf(l.sh, stat_at(g, &mb, r, c)?, v)?;
                        }
                        Ok(())
                    })
                })
            })?;
            // S^T = K Q^T and dP^T = V dO^T; P^T and dS^T in the lane's words.
            tm.phase(all, |g, l| {
                let (bg, first, wl, w16, gq, tq) = block(g, l)?;
                let (_, q0, n, needed, off) = queries(g, l, bg, first)?;
                g.when(needed, |g| {
                    let zero = [g.fconst(0.0); 4];
                    let ka = g.add_i(g.i64c(k_at), g.mul_i(w16, g.i64c(mb.qp))?)?;
                    let st = g.products(
                        l.sh,
                        (ka, mb.qp),
                        (g.i64c(q_at), mb.qp),
                        (qb / 8, d, tf),
                        wl,
                        |_| Ok(zero),
                    )?;
                    let va = g.add_i(g.i64c(v_at), g.mul_i(w16, g.i64c(mb.ep))?)?;
                    let dpt = g.products(
                        l.sh,
                        (va, mb.ep),
                        (g.i64c(do_at), mb.ep),
                        (qb / 8, ev, tf),
                        wl,
                        |_| Ok(zero),
                    )?;
                    let exp = g.exp_fn()?;
                    for h in 0..2 {
                        let kr = g.add_i(g.add_i(w16, gq)?, g.i64c(8 * h))?;
                        let j = g.add_i(first, kr)?;
                        for jq in 0..qb / 8 {
                            let (mut p2, mut d2) = (Vec::new(), Vec::new());
                            for i in [2 * h, 2 * h + 1] {
                                let c = g.frag_col(tq, i, 8 * jq)?;
                                let stv = |k| g.ldf(l.sh, stat_at(g, &mb, c, k)?);
                                let (mx, inv, dsum) = (stv(0)?, stv(1)?, stv(2)?);
                                let mut seen = g.ult(c, n)?;
                                if a.causal {
                                    let pos = g.add_i(g.add_i(q0, c)?, off)?;
                                    let ok =
                                        e(g.b.build_int_compare(IntPredicate::ULE, j, pos, ""))?;
                                    seen = e(g.b.build_and(seen, ok, ""))?;
                                }
                                let sc = g.fmul(st[jq][i], g.fconst(a.scale))?;
                                let p = g.fmul(g.call(exp, &[g.fsub(sc, mx)?])?, inv)?;
                                let p = g.select_f(seen, p, g.fconst(0.0))?;
                                d2.push(g.fmul(p, g.fsub(dpt[jq][i], dsum)?)?);
                                p2.push(p);
                            }
                            g.keep_a(l, lpt, (jq, h), (p2[0], p2[1]), tf)?;
                            g.keep_a(l, ldst, (jq, h), (d2[0], d2[1]), tf)?;
                        }
                    }
                    Ok(())
                })
            })?;
            // dV += P^T dO, dK += dS^T Q, P^T and dS^T from the warp's registers.
            tm.warp_phase(|g, l| {
                let (bg, first, wl, ..) = block(g, l)?;
                let (_, _, _, needed, _) = queries(g, l, bg, first)?;
                g.when(needed, |g| {
                    let dv = (lpt, (do_at, mb.ep), ldv, ev);
                    let dk = (ldst, (q_at, mb.qp), ldk, d);
                    for (a_word, (b_at, bp), lw, n) in [dv, dk] {
                        let c = g.products_regs(
                            l,
                            (a_word, words),
                            (g.i64c(b_at), bp),
                            (n / 8, qb, tf),
                            wl,
                            |j| g.frag_of(l, lw + 4 * j),
                        )?;
                        for (j, cj) in c.iter().enumerate() {
                            for (i, ci) in cj.iter().enumerate() {
                                g.lput(l, lw + 4 * j + i, *ci)?;
                            }
                        }
                    }
                    Ok(())
                })
            })
        })?;
        tm.phase(all, |g, l| {
            let (bg, first, _, w16, gq, tq) = block(g, l)?;
            for h in 0..2 {
                let j = g.add_i(g.add_i(first, g.add_i(w16, gq)?)?, g.i64c(8 * h))?;
                g.when(g.ult(j, g.i64c(a.t))?, |g| {
                    let kr = g.add_i(g.mul_i(bg, g.i64c(a.t))?, j)?;
                    for (out, lw, n, f) in [(0, ldk, d, a.scale), (1, ldv, ev, 1.0)] {
                        let ob = g.mul_i(kr, g.i64c(n))?;
                        for jn in 0..n / 8 {
                            for i in [2 * h, 2 * h + 1] {
                                let v = g.fmul(g.lw(l, lw + 4 * jn + i)?, g.fconst(f))?;
                                g.stf(l.outs[out], g.add_i(ob, g.frag_col(tq, i, 8 * jn)?)?, v)?;
                            }
                        }
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
    }
}
