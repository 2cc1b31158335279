//! The forward on tensor cores ([`crate::kernel::Body::AttnMma`]): the phases the module
//! documentation lists, for bf16 operands and for f32 ones as three TF32 products.

use super::*;

/// A forward kernel's shape and its lanes' memory: `S` (`nk` fragments of 4 words from
/// `ls`), `O` (`ne` from `lo`), the rows' maxima (`lm`, 2) and sums (`ll`, 2), `P` (from
/// `lp`: one A fragment of 4 words a k-step of the key tile, bf16 pairs or f32s); `words`
/// in all.
#[derive(Clone, Copy)]
struct Fwd {
    a: Attn,
    mt: MmaTiles,
    /// f32 operands as three TF32 products (k-steps of 8 elements: 16 halves, as bf16's
    /// 16).
    tf: bool,
    nk: usize,
    ne: usize,
    ls: usize,
    lo: usize,
    lm: usize,
    ll: usize,
    lp: usize,
    words: usize,
}

impl Fwd {
    fn of(a: &Attn) -> R<Self> {
        let mt = a
            .mma_keys()
            .ok_or("this attention does not take tensor cores")?;
        let tf = a.tf32x3;
        let k_step = if tf { 8 } else { 16 };
        let (nk, ne) = (mt.keys / 8, a.e / 8);
        let (ls, lo) = (0, 4 * nk);
        let lm = lo + 4 * ne;
        let ll = lm + 2;
        let lp = ll + 2;
        Ok(Fwd {
            a: *a,
            mt,
            tf,
            nk,
            ne,
            ls,
            lo,
            lm,
            ll,
            lp,
            words: lp + 4 * mt.keys / k_step,
        })
    }
}

const NEG: f32 = f32::NEG_INFINITY;

impl<'ctx> Gen<'ctx> {
    /// The forward on tensor cores ([`crate::kernel::Body::AttnMma`]): `q, k, v (,
    /// offset) -> out (, stats)`.
    pub(in crate::llvm) fn attn_mma(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let f = Fwd::of(a)?;
        let (a, mt) = (f.a, f.mt);
        let double = mt.buffers == 2;
        tm.shared = Shared::Tile(mt.words);
        tm.local = f.words;
        let all = MMA_LANES;
        // Stage the queries; start the online softmax.
        tm.phase(all, |g, l| {
            let m = g.mma_lane(&a, l)?;
            let n = g.min_i(g.i64c(MMA_ROWS), g.e_sub(g.i64c(a.s), m.q0)?)?;
            g.stage16(l, l.ins[0], m.qrow0, (n, MMA_ROWS, a.d), (0, mt.qp))?;
            for w in f.lo..f.lm {
                g.lput(l, w, g.fconst(0.0))?;
            }
            for h in 0..2 {
                g.lput(l, f.lm + h, g.fconst(NEG))?;
                g.lput(l, f.ll + h, g.fconst(0.0))?;
            }
            if double {
                // The first key tile, into the first buffer.
                g.fwd_stage(&f, l, g.i64c(0), true)?;
                g.async_wait()?;
            }
            Ok(())
        })?;
        tm.repeat(a.t.div_ceil(mt.keys), |tm| {
            if double {
                // Past the barrier every lane's copy of this tile has landed, and every
                // warp is done with the tile before, whose buffer the next tile takes:
                // its copy runs while this tile's products do.
                tm.phase(all, |g, l| {
                    g.fwd_stage(&f, l, g.add_i(l.iter, g.i64c(1))?, true)?;
                    g.fwd_scores(&f, l)
                })?;
                tm.warp_phase(|g, l| g.fwd_softmax(&f, l))?;
                return tm.warp_phase(|g, l| {
                    g.fwd_values(&f, l)?;
                    g.async_wait()
                });
            }
            // The key tile's keys and values.
            tm.phase(all, |g, l| g.fwd_stage(&f, l, l.iter, false))?;
            tm.phase(all, |g, l| g.fwd_scores(&f, l))?;
            tm.warp_phase(|g, l| g.fwd_softmax(&f, l))?;
            tm.warp_phase(|g, l| g.fwd_values(&f, l))
        })?;
        // Each row's four partial sums, then the output and the statistics.
        tm.phase(all, |g, l| {
            let m = g.mma_lane(&a, l)?;
            for h in 0..2 {
                let r = g.mma_row(&m, h)?;
                g.stf(l.sh, g.xch(&mt, r, m.t)?, g.lw(l, f.ll + h)?)?;
            }
            Ok(())
        })?;
        tm.phase(all, |g, l| g.fwd_finish(&f, l))
    }

    /// Key tile `tile`'s keys and values (where the block needs it) into its buffer
    /// ([`Gen::fwd_buffer`]), by asynchronous copies where `asynchronous`.
    fn fwd_stage(
        &self,
        f: &Fwd,
        l: &Lane<'ctx>,
        tile: IntValue<'ctx>,
        asynchronous: bool,
    ) -> R<()> {
        let (a, mt) = (&f.a, &f.mt);
        let m = self.mma_lane(a, l)?;
        let (ts, n, needed) = self.mma_key_tile_at(a, &m, mt.keys, tile)?;
        let copy = self.copy_fn(if asynchronous { COPY16_ASYNC } else { COPY16 });
        self.when(needed, |g| {
            let first = g.add_i(m.kv_base, ts)?;
            let shift = g.fwd_buffer(f, tile)?;
            let (k, v) = ((mt.k_at, shift, mt.qp), (mt.v_at, shift, mt.ep));
            g.stage16_by(l, l.ins[1], first, (n, mt.keys, a.d), k, copy)?;
            g.stage16_by(l, l.ins[2], first, (n, mt.keys, a.e), v, copy)
        })
    }

    /// Halves from the first buffer's key and value tiles to those of key tile `tile`:
    /// with two buffers, even tiles in the first, odd ones in the second.
    fn fwd_buffer(&self, f: &Fwd, tile: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        match f.mt.buffers {
            1 => Ok(self.i64c(0)),
            _ => self.mul_i(self.rem_i(tile, 2)?, self.i64c(f.mt.kv)),
        }
    }

    /// `S = scale Q K^T` for the key tile, masked (causal, past the keys), into the
    /// lane's words; each of its rows' partial maxima to the exchange words.
    fn fwd_scores(&self, f: &Fwd, l: &Lane<'ctx>) -> R<()> {
        let (a, mt) = (&f.a, &f.mt);
        let m = self.mma_lane(a, l)?;
        let (ts, _, needed) = self.mma_key_tile(a, l, &m, mt.keys)?;
        self.when(needed, |g| {
            let mut mx = [g.fconst(NEG); 2];
            let lims = (0..2)
                .map(|h| g.mma_lim(a, &m, g.mma_row(&m, h)?))
                .collect::<R<Vec<_>>>()?;
            let q = (g.mul_i(m.w16, g.i64c(mt.qp))?, mt.qp);
            let k = (g.add_i(g.i64c(mt.k_at), g.fwd_buffer(f, l.iter)?)?, mt.qp);
            let zero = |_| Ok([g.fconst(0.0); 4]);
            let scores = g.products(l.sh, q, k, (f.nk, a.d, f.tf), m.wl, zero)?;
            for (j, c) in scores.iter().enumerate() {
                for (i, ci) in c.iter().enumerate() {
                    let h = i >> 1;
                    let col = g.add_i(g.mul_i(m.t, g.i64c(2))?, g.i64c(8 * j + (i & 1)))?;
                    let seen = g.ult(g.add_i(ts, col)?, lims[h])?;
                    let s = g.fmul(*ci, g.fconst(a.scale))?;
                    let s = g.select_f(seen, s, g.fconst(NEG))?;
                    g.lput(l, f.ls + 4 * j + i, s)?;
                    mx[h] = g.maxf(mx[h], s)?;
                }
            }
            for (h, v) in mx.iter().enumerate() {
                let r = g.mma_row(&m, h)?;
                g.stf(l.sh, g.xch(mt, r, m.t)?, *v)?;
            }
            Ok(())
        })
    }

    /// The online softmax's step: each row's new maximum (from its four lanes' partials,
    /// in the warp's exchange words), the running sum and output rescaled, and `P` in the
    /// lane's words as the next product's A fragment (bf16 pairs, rounded before the sum
    /// adds them; or f32s, which the product splits).
    fn fwd_softmax(&self, f: &Fwd, l: &Lane<'ctx>) -> R<()> {
        let (a, mt) = (&f.a, &f.mt);
        let m = self.mma_lane(a, l)?;
        let (_, _, needed) = self.mma_key_tile(a, l, &m, mt.keys)?;
        self.when(needed, |g| {
            let exp = g.exp_fn()?;
            for h in 0..2 {
                let r = g.mma_row(&m, h)?;
                let old = g.lw(l, f.lm + h)?;
                let mut mx = old;
                for q in 0..4 {
                    let x = g.ldf(l.sh, g.xch(mt, r, g.i64c(q))?)?;
                    mx = g.maxf(mx, x)?;
                }
                // Nothing seen yet: subtract 0, not -inf (as the f32 tiles).
                let none = g.select(FloatPredicate::OEQ, mx, g.fconst(NEG), g.fconst(0.0), mx)?;
                let corr = g.call(exp, &[g.fsub(old, none)?])?;
                let mut sum = g.fmul(g.lw(l, f.ll + h)?, corr)?;
                for jn in 0..f.ne {
                    for i in [2 * h, 2 * h + 1] {
                        let w = f.lo + 4 * jn + i;
                        g.lput(l, w, g.fmul(g.lw(l, w)?, corr)?)?;
                    }
                }
                for j in 0..f.nk {
                    let mut ps = Vec::with_capacity(2);
                    for i in [2 * h, 2 * h + 1] {
                        let s = g.lw(l, f.ls + 4 * j + i)?;
                        let p = g.call(exp, &[g.fsub(s, none)?])?;
                        let p = if f.tf {
                            p
                        } else {
                            g.call(g.round_bf16_fn()?, &[p])?
                        };
                        sum = g.fadd(sum, p)?;
                        ps.push(p);
                    }
                    g.keep_a(l, f.lp, (j, h), (ps[0], ps[1]), f.tf)?;
                }
                g.lput(l, f.ll + h, sum)?;
                g.lput(l, f.lm + h, mx)?;
            }
            Ok(())
        })
    }

    /// `O += P V`, `P` from the warp's words.
    fn fwd_values(&self, f: &Fwd, l: &Lane<'ctx>) -> R<()> {
        let (a, mt) = (&f.a, &f.mt);
        let m = self.mma_lane(a, l)?;
        let (_, _, needed) = self.mma_key_tile(a, l, &m, mt.keys)?;
        self.when(needed, |g| {
            let init = |j: usize| g.frag_of(l, f.lo + 4 * j);
            let v = (g.add_i(g.i64c(mt.v_at), g.fwd_buffer(f, l.iter)?)?, mt.ep);
            let c = g.products_regs(l, (f.lp, f.words), v, (f.ne, mt.keys, f.tf), m.wl, init)?;
            for (j, cj) in c.iter().enumerate() {
                for (i, ci) in cj.iter().enumerate() {
                    g.lput(l, f.lo + 4 * j + i, *ci)?;
                }
            }
            Ok(())
        })
    }

    /// Each row's sum from its four lanes' (in lane order), the output elements times `1 /
    /// l`, and the statistics `[m, 1/l]` where the backward takes them.
    fn fwd_finish(&self, f: &Fwd, l: &Lane<'ctx>) -> R<()> {
        let (a, mt) = (&f.a, &f.mt);
        let m = self.mma_lane(a, l)?;
        for h in 0..2 {
            let r = self.mma_row(&m, h)?;
            let mut sum = self.ldf(l.sh, self.xch(mt, r, self.i64c(0))?)?;
            for q in 1..4 {
                sum = self.fadd(sum, self.ldf(l.sh, self.xch(mt, r, self.i64c(q))?)?)?;
            }
            let inv = self.fdiv(self.fconst(1.0), sum)?;
            let valid = self.ult(self.add_i(m.q0, r)?, self.i64c(a.s))?;
            self.when(valid, |g| {
                let qrow = g.add_i(m.qrow0, r)?;
                let ob = g.mul_i(qrow, g.i64c(a.e))?;
                for jn in 0..f.ne {
                    for i in [2 * h, 2 * h + 1] {
                        let col = g.add_i(g.mul_i(m.t, g.i64c(2))?, g.i64c(8 * jn + (i & 1)))?;
                        let v = g.fmul(g.lw(l, f.lo + 4 * jn + i)?, inv)?;
                        g.stf(l.outs[0], g.add_i(ob, col)?, v)?;
                    }
                }
                if a.saved {
                    let first = e(g.b.build_int_compare(IntPredicate::EQ, m.t, g.i64c(0), ""))?;
                    g.when(first, |g| {
                        let s = g.mul_i(qrow, g.i64c(2))?;
                        g.stf(l.outs[1], s, g.lw(l, f.lm + h)?)?;
                        g.stf(l.outs[1], g.add_i(s, g.i64c(1))?, inv)
                    })?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }
}
