//! Tiled attention: team kernels ([`super::team`]) whose blocks stage tiles of the rows
//! all their lanes read in shared memory.
//!
//! A block of the forward (or of the backward's `dq` kernel) is a tile of up to
//! [`crate::kernel::ATTN_TILE`] query rows of one head, a lane per row. In a loop over
//! key tiles, a phase copies the tile's key rows into the shared array, the lanes reading
//! consecutive words (coalesced), and the next phase scores the lane's query against each
//! of them, reading the same shared word in every lane (a broadcast). Each lane keeps its
//! scores in its own memory, so the softmax's maximum, sum and weights read them instead
//! of scoring every key three times, and a second loop stages the value rows for the
//! weighted sum. The `dk`/`dv` kernel is the same with the roles turned: a lane per key
//! row, and the queries' `q`, `dO` and statistics staged a tile at a time.
//!
//! Past [`crate::kernel::ATTN_TILE_KEYS`] keys a lane's scores would not fit its
//! memory, and the forward and the `dq` kernel score each key again in each pass over
//! the key tiles instead (the maximum, the sum, then the weighted sum; the backward also
//! `sum P dP` before `dq`), as the row kernels do, but from staged tiles.
//!
//! Every sum is the row kernels' (`llvm.rs`, `Body::Attention` and the rest): the same
//! f32 operations on the same values in the same order, so the two forms give the same
//! bits (`codegen/tests/kernels.rs` checks it). An online softmax (one pass, rescaling
//! the running sum) would save the lanes' score memory but round differently; see
//! `docs/gpu.md` for why it was left out.

use super::team::{Lane, Shared, Team};
use super::{e, Gen, R};
use crate::kernel::Attn;
use inkwell::values::{FloatValue, IntValue, PointerValue};
use inkwell::IntPredicate;

/// Where a lane of a query-tile block is.
struct QueryLane<'ctx> {
    /// The lane has a query row (the last tile of a head may be short).
    valid: IntValue<'ctx>,
    /// The flat query row (batch, head, position).
    q_row: IntValue<'ctx>,
    /// Keys it sees: `0..lim`.
    lim: IntValue<'ctx>,
    /// The first key/value row of its key/value head.
    kv_base: IntValue<'ctx>,
    /// Keys some lane of the block sees: `0..need` (a causal block skips the tiles past
    /// its last query).
    need: IntValue<'ctx>,
}

impl<'ctx> Gen<'ctx> {
    fn min_i(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        let lt = e(self.b.build_int_compare(IntPredicate::ULT, a, b, ""))?;
        Ok(e(self.b.build_select(lt, a, b, ""))?.into_int_value())
    }

    fn ult(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        e(self.b.build_int_compare(IntPredicate::ULT, a, b, ""))
    }

    /// Word `w` of a lane's own memory.
    fn local_at(&self, l: &Lane<'ctx>, w: usize) -> R<PointerValue<'ctx>> {
        // SAFETY of the generated code: `w` is below the plan's words per lane.
        e(unsafe {
            self.b
                .build_in_bounds_gep(self.ctx.f32_type(), l.local, &[self.i64c(w)], "")
        })
    }

    /// `dst[c] = src[base + c]` for `c` in `0..len`.
    fn copy_words(
        &self,
        src: PointerValue<'ctx>,
        base: IntValue<'ctx>,
        dst: PointerValue<'ctx>,
        len: usize,
    ) -> R<()> {
        self.for_range(self.i64c(len), |g, c| {
            g.stf(dst, c, g.ldf(src, g.add_i(base, c)?)?)
        })
    }

    fn zero_words(&self, dst: PointerValue<'ctx>, len: usize) -> R<()> {
        self.for_range(self.i64c(len), |g, c| g.stf(dst, c, g.fconst(0.0)))
    }

    /// The team copies `rows` rows of `width` words of `x`, from row `first`, to the
    /// shared array at word `at`: lane `l` copies words `l, l + t, ...` (consecutive lanes,
    /// consecutive words).
    #[allow(clippy::too_many_arguments)]
    fn stage(
        &self,
        l: &Lane<'ctx>,
        t: usize,
        x: PointerValue<'ctx>,
        first: IntValue<'ctx>,
        rows: IntValue<'ctx>,
        width: usize,
        at: usize,
    ) -> R<()> {
        let n = self.mul_i(rows, self.i64c(width))?;
        let src = self.mul_i(first, self.i64c(width))?;
        self.for_step(l.lane, n, t, |g, w| {
            let v = g.ldf(x, g.add_i(src, w)?)?;
            g.stf(l.sh, g.add_i(g.i64c(at), w)?, v)
        })
    }

    /// A query-tile block's lane (`row` = head * tiles + tile).
    fn query_lane(
        &self,
        a: &Attn,
        lanes: usize,
        tiles: usize,
        l: &Lane<'ctx>,
    ) -> R<QueryLane<'ctx>> {
        let bh = self.div_i(l.row, tiles)?;
        let qt = self.rem_i(l.row, tiles)?;
        let bi = self.div_i(bh, a.h)?;
        let hi = self.rem_i(bh, a.h)?;
        let first = self.mul_i(qt, self.i64c(lanes))?;
        let qi = self.add_i(first, l.lane)?;
        let off = self.query_offset(a, &l.ins)?;
        let t = self.i64c(a.t);
        let (lim, need) = if a.causal {
            let pos = self.add_i(qi, off)?;
            let last = self.min_i(self.add_i(first, self.i64c(lanes))?, self.i64c(a.s))?;
            (
                self.min_i(self.add_i(pos, self.i64c(1))?, t)?,
                self.min_i(self.add_i(last, off)?, t)?,
            )
        } else {
            (t, t)
        };
        let kvh = self.add_i(self.mul_i(bi, self.i64c(a.g))?, self.div_i(hi, a.h / a.g)?)?;
        Ok(QueryLane {
            valid: self.ult(qi, self.i64c(a.s))?,
            q_row: self.add_i(self.mul_i(bh, self.i64c(a.s))?, qi)?,
            lim,
            kv_base: self.mul_i(kvh, self.i64c(a.t))?,
            need,
        })
    }

    /// Tile `l.iter` of `rows` key rows: its first key and its length (the last is short).
    fn key_tile(
        &self,
        a: &Attn,
        rows: usize,
        l: &Lane<'ctx>,
    ) -> R<(IntValue<'ctx>, IntValue<'ctx>)> {
        let ts = self.mul_i(l.iter, self.i64c(rows))?;
        let n = self.min_i(self.i64c(rows), self.e_sub(self.i64c(a.t), ts)?)?;
        Ok((ts, n))
    }

    /// `f(j, j - ts)` for the keys `j` of the tile at `ts` (`n` long) that the lane sees,
    /// where the lane has a query.
    fn tile_keys(
        &self,
        q: &QueryLane<'ctx>,
        ts: IntValue<'ctx>,
        n: IntValue<'ctx>,
        mut f: impl FnMut(&Self, IntValue<'ctx>, IntValue<'ctx>) -> R<()>,
    ) -> R<()> {
        self.when(q.valid, |g| {
            let end = g.min_i(g.add_i(ts, n)?, q.lim)?;
            g.for_step(ts, end, 1, |g, j| f(g, j, g.e_sub(j, ts)?))
        })
    }

    /// The row's softmax maximum and `1 / sum` from its scores `s[0..lim]`, as
    /// [`Gen::attn_softmax`] computes them (the same operations in the same order).
    fn scores_softmax(
        &self,
        s: PointerValue<'ctx>,
        lim: IntValue<'ctx>,
    ) -> R<(FloatValue<'ctx>, FloatValue<'ctx>)> {
        let f32t = self.ctx.f32_type();
        let mx = self.var(self.fconst(f32::NEG_INFINITY).into())?;
        self.for_range(lim, |g, j| {
            g.set(mx, g.maxf(g.getf(mx, f32t)?, g.ldf(s, j)?)?)
        })?;
        let m = self.getf(mx, f32t)?;
        let sum = self.var(self.fconst(0.0).into())?;
        self.for_range(lim, |g, j| {
            let y = g.call(g.exp_fn()?, &[g.fsub(g.ldf(s, j)?, m)?])?;
            g.set(sum, g.fadd(g.getf(sum, f32t)?, y)?)
        })?;
        Ok((m, self.fdiv(self.fconst(1.0), self.getf(sum, f32t)?)?))
    }

    /// The first phase of a query-tile kernel: each lane with a query row copies row
    /// `q_row` of each `(input, width, word)` of `rows` to that word of its memory, zeroes
    /// each `(word, len)` of `zeros`, and sets each `(word, value)` of `sets`.
    fn load_query_rows(
        tm: &mut Team<'_, 'ctx>,
        a: &Attn,
        (lanes, tiles): (usize, usize),
        rows: &[(usize, usize, usize)],
        zeros: &[(usize, usize)],
        sets: &[(usize, f32)],
    ) -> R<()> {
        let a = *a;
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            g.when(q.valid, |g| {
                for &(input, width, word) in rows {
                    let base = g.mul_i(q.q_row, g.i64c(width))?;
                    g.copy_words(l.ins[input], base, g.local_at(l, word)?, width)?;
                }
                for &(word, len) in zeros {
                    g.zero_words(g.local_at(l, word)?, len)?;
                }
                for &(word, v) in sets {
                    g.set(g.local_at(l, word)?, g.fconst(v))?;
                }
                Ok(())
            })
        })
    }

    /// The last phase of a query-tile kernel: each lane with a query row stores the
    /// `width` words at `word` of its memory to row `q_row` of output `out`.
    fn store_query_row(
        tm: &mut Team<'_, 'ctx>,
        a: &Attn,
        (lanes, tiles): (usize, usize),
        word: usize,
        out: usize,
        width: usize,
    ) -> R<()> {
        let a = *a;
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            g.when(q.valid, |g| {
                let ob = g.mul_i(q.q_row, g.i64c(width))?;
                g.store_array(g.local_at(l, word)?, l.outs[out], ob, width)
            })
        })
    }

    /// One pass over the key tiles of a query-tile block: a phase stages each tile's
    /// keys (input `k_in`, at word 0) and, with `values = Some(word)`, its values (input
    /// `k_in + 1`, at that word), and the next calls `f(g, lane, jt, score)` for each key
    /// the lane sees (`jt`: the key's row in the tile), the lane's query at word `lq` of
    /// its memory.
    #[allow(clippy::too_many_arguments)]
    fn score_pass(
        tm: &mut Team<'_, 'ctx>,
        a: &Attn,
        (lanes, tiles, rows): (usize, usize, usize),
        k_in: usize,
        values: Option<usize>,
        lq: usize,
        f: impl Fn(&Self, &Lane<'ctx>, IntValue<'ctx>, FloatValue<'ctx>) -> R<()>,
    ) -> R<()> {
        let a = *a;
        tm.repeat(a.t.div_ceil(rows), |tm| {
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                g.when(g.ult(ts, q.need)?, |g| {
                    let first = g.add_i(q.kv_base, ts)?;
                    g.stage(l, lanes, l.ins[k_in], first, n, a.d, 0)?;
                    match values {
                        Some(vt) => g.stage(l, lanes, l.ins[k_in + 1], first, n, a.e, vt),
                        None => Ok(()),
                    }
                })
            })?;
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                let qp = g.local_at(l, lq)?;
                g.tile_keys(&q, ts, n, |g, _, jt| {
                    let dot = g.dot(qp, g.i64c(0), l.sh, g.mul_i(jt, g.i64c(a.d))?, a.d)?;
                    f(g, l, jt, g.fmul(g.fconst(a.scale), dot)?)
                })
            })
        })
    }

    /// `max = maxf(max, s)` and `sum += exp(s - max)` passes of a lane whose maximum and
    /// sum are at words `lst` and `lst + 1` of its memory (set to -inf and 0 before);
    /// leaves `1 / sum` at `lst + 1`: [`Gen::attn_softmax`] from staged keys.
    fn softmax_passes(
        tm: &mut Team<'_, 'ctx>,
        a: &Attn,
        cut: (usize, usize, usize),
        k_in: usize,
        lq: usize,
        lst: usize,
    ) -> R<()> {
        let (lanes, tiles, _) = cut;
        let f32t = tm.g.ctx.f32_type();
        Self::score_pass(tm, a, cut, k_in, None, lq, |g, l, _, s| {
            let mx = g.local_at(l, lst)?;
            g.set(mx, g.maxf(g.getf(mx, f32t)?, s)?)
        })?;
        Self::score_pass(tm, a, cut, k_in, None, lq, |g, l, _, s| {
            let m = g.getf(g.local_at(l, lst)?, f32t)?;
            let sum = g.local_at(l, lst + 1)?;
            let y = g.call(g.exp_fn()?, &[g.fsub(s, m)?])?;
            g.set(sum, g.fadd(g.getf(sum, f32t)?, y)?)
        })?;
        let a = *a;
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            g.when(q.valid, |g| {
                let sum = g.local_at(l, lst + 1)?;
                g.set(sum, g.fdiv(g.fconst(1.0), g.getf(sum, f32t)?)?)
            })
        })
    }

    /// `exp(s - max) * inv` from a lane's statistics at words `lst` and `lst + 1`.
    fn prob(&self, l: &Lane<'ctx>, lst: usize, s: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        let f32t = self.ctx.f32_type();
        let m = self.getf(self.local_at(l, lst)?, f32t)?;
        let inv = self.getf(self.local_at(l, lst + 1)?, f32t)?;
        let y = self.call(self.exp_fn()?, &[self.fsub(s, m)?])?;
        self.fmul(y, inv)
    }

    /// The forward without kept scores ([`crate::kernel::Tiles::scores`] false): three
    /// passes over the key tiles.
    fn attn_tiles_rescore(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let ti = a.tiles().ok_or("this attention has no tiling")?;
        let (lanes, rows, tiles) = (ti.q_lanes, ti.fwd_rows, ti.q_tiles(a));
        let cut = (lanes, tiles, rows);
        let (d, ev) = (a.d, a.e);
        // A lane's memory: q [d], acc [e], max, sum (then 1/sum).
        let (lq, lacc, lst) = (0, d, d + ev);
        // Shared: key rows [rows, d], then (the last pass) value rows [rows, e].
        let vt = rows * d;
        tm.shared = Shared::Tile(rows * (d + ev));
        tm.local = lst + 2;
        let a = *a;
        Self::load_query_rows(
            tm,
            &a,
            (lanes, tiles),
            &[(0, d, lq)],
            &[(lacc, ev)],
            &[(lst, f32::NEG_INFINITY), (lst + 1, 0.0)],
        )?;
        Self::softmax_passes(tm, &a, cut, 1, lq, lst)?;
        Self::score_pass(tm, &a, cut, 1, Some(vt), lq, |g, l, jt, s| {
            let p = g.prob(l, lst, s)?;
            let vb = g.add_i(g.i64c(vt), g.mul_i(jt, g.i64c(ev))?)?;
            g.axpy(g.local_at(l, lacc)?, p, l.sh, vb, ev)
        })?;
        Self::store_query_row(tm, &a, (lanes, tiles), lacc, 0, ev)
    }

    /// The backward's statistics and `dq` without kept scores: four passes over the key
    /// tiles (the maximum, the sum, `sum P dP`, then `dq`).
    fn attn_tiles_back_rescore(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let ti = a.tiles().ok_or("this attention has no tiling")?;
        let (lanes, rows, tiles) = (ti.q_lanes, ti.back_rows, ti.q_tiles(a));
        let cut = (lanes, tiles, rows);
        let (d, ev) = (a.d, a.e);
        // A lane's memory: q [d], dO [e], acc [d], max, sum (then 1/sum), rowsum(P dP).
        let (lq, ldo, lacc, lst) = (0, d, d + ev, 2 * d + ev);
        let vt = rows * d;
        tm.shared = Shared::Tile(rows * (d + ev));
        tm.local = lst + 3;
        let a = *a;
        let f32t = self.ctx.f32_type();
        Self::load_query_rows(
            tm,
            &a,
            (lanes, tiles),
            &[(1, d, lq), (0, ev, ldo)],
            &[(lacc, d)],
            &[(lst, f32::NEG_INFINITY), (lst + 1, 0.0), (lst + 2, 0.0)],
        )?;
        Self::softmax_passes(tm, &a, cut, 2, lq, lst)?;
        // dP = dO . V_j of key row `jt` of the staged tile.
        let dp = move |g: &Self, l: &Lane<'ctx>, jt| {
            let vb = g.add_i(g.i64c(vt), g.mul_i(jt, g.i64c(ev))?)?;
            g.dot(g.local_at(l, ldo)?, g.i64c(0), l.sh, vb, ev)
        };
        Self::score_pass(tm, &a, cut, 2, Some(vt), lq, |g, l, jt, s| {
            let p = g.prob(l, lst, s)?;
            let dot = g.local_at(l, lst + 2)?;
            g.set(dot, g.fadd(g.getf(dot, f32t)?, g.fmul(p, dp(g, l, jt)?)?)?)
        })?;
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            g.when(q.valid, |g| {
                let s = g.mul_i(q.q_row, g.i64c(3))?;
                for k in 0..3 {
                    let v = g.getf(g.local_at(l, lst + k)?, f32t)?;
                    g.stf(l.outs[0], g.add_i(s, g.i64c(k))?, v)?;
                }
                Ok(())
            })
        })?;
        Self::score_pass(tm, &a, cut, 2, Some(vt), lq, |g, l, jt, s| {
            let p = g.prob(l, lst, s)?;
            let dsum = g.getf(g.local_at(l, lst + 2)?, f32t)?;
            let ds = g.fmul(g.fmul(p, g.fsub(dp(g, l, jt)?, dsum)?)?, g.fconst(a.scale))?;
            g.axpy(g.local_at(l, lacc)?, ds, l.sh, g.mul_i(jt, g.i64c(d))?, d)
        })?;
        Self::store_query_row(tm, &a, (lanes, tiles), lacc, 1, d)
    }

    /// The forward ([`crate::kernel::Body::AttnTiles`]): `q, k, v (, offset) -> out`.
    pub(super) fn attn_tiles(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let ti = a.tiles().ok_or("this attention has no tiling")?;
        if !ti.scores {
            return self.attn_tiles_rescore(tm, a);
        }
        let (lanes, rows, tiles) = (ti.q_lanes, ti.fwd_rows, ti.q_tiles(a));
        let (d, ev, t) = (a.d, a.e, a.t);
        // A lane's memory: q [d], acc [e], scores [t], max, 1/sum.
        let (lq, lacc, ls, lst) = (0, d, d + ev, d + ev + t);
        tm.shared = Shared::Tile(rows * d.max(ev));
        tm.local = lst + 2;
        let key_tiles = t.div_ceil(rows);
        let a = *a;
        Self::load_query_rows(tm, &a, (lanes, tiles), &[(0, d, lq)], &[(lacc, ev)], &[])?;
        // Scores, a key tile at a time.
        tm.repeat(key_tiles, |tm| {
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                g.when(g.ult(ts, q.need)?, |g| {
                    g.stage(l, lanes, l.ins[1], g.add_i(q.kv_base, ts)?, n, d, 0)
                })
            })?;
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                let (qp, sp) = (g.local_at(l, lq)?, g.local_at(l, ls)?);
                g.tile_keys(&q, ts, n, |g, j, jt| {
                    let dot = g.dot(qp, g.i64c(0), l.sh, g.mul_i(jt, g.i64c(d))?, d)?;
                    g.stf(sp, j, g.fmul(g.fconst(a.scale), dot)?)
                })
            })
        })?;
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            g.when(q.valid, |g| {
                let (m, inv) = g.scores_softmax(g.local_at(l, ls)?, q.lim)?;
                g.set(g.local_at(l, lst)?, m)?;
                g.set(g.local_at(l, lst + 1)?, inv)
            })
        })?;
        // The weighted sum of the values, a tile at a time.
        tm.repeat(key_tiles, |tm| {
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                g.when(g.ult(ts, q.need)?, |g| {
                    g.stage(l, lanes, l.ins[2], g.add_i(q.kv_base, ts)?, n, ev, 0)
                })
            })?;
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                let f32t = g.ctx.f32_type();
                let (sp, acc) = (g.local_at(l, ls)?, g.local_at(l, lacc)?);
                let (mx, inv) = (g.local_at(l, lst)?, g.local_at(l, lst + 1)?);
                g.tile_keys(&q, ts, n, |g, j, jt| {
                    let (m, inv) = (g.getf(mx, f32t)?, g.getf(inv, f32t)?);
                    let y = g.call(g.exp_fn()?, &[g.fsub(g.ldf(sp, j)?, m)?])?;
                    let p = g.fmul(y, inv)?;
                    g.axpy(acc, p, l.sh, g.mul_i(jt, g.i64c(ev))?, ev)
                })
            })
        })?;
        Self::store_query_row(tm, &a, (lanes, tiles), lacc, 0, ev)
    }

    /// The backward's statistics and `dq` ([`crate::kernel::Body::AttnTilesBack`]):
    /// `dout, q, k, v (, offset) -> stats, dq`.
    pub(super) fn attn_tiles_back(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let ti = a.tiles().ok_or("this attention has no tiling")?;
        if !ti.scores {
            return self.attn_tiles_back_rescore(tm, a);
        }
        let (lanes, rows, tiles) = (ti.q_lanes, ti.back_rows, ti.q_tiles(a));
        let (d, ev, t) = (a.d, a.e, a.t);
        // A lane's memory: q [d], dO [e], acc [d], P (scores, then weights) [t], dP [t],
        // max, 1/sum, rowsum(dP * P).
        let (lq, ldo, lacc) = (0, d, d + ev);
        let (lp, ldp, lst) = (2 * d + ev, 2 * d + ev + t, 2 * d + ev + 2 * t);
        tm.shared = Shared::Tile(rows * (d + ev));
        tm.local = lst + 3;
        let key_tiles = t.div_ceil(rows);
        let vt = rows * d;
        let a = *a;
        let f32t = self.ctx.f32_type();
        Self::load_query_rows(
            tm,
            &a,
            (lanes, tiles),
            &[(1, d, lq), (0, ev, ldo)],
            &[(lacc, d)],
            &[],
        )?;
        // Scores and dP = dO . V, a key tile (keys and values) at a time.
        tm.repeat(key_tiles, |tm| {
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                g.when(g.ult(ts, q.need)?, |g| {
                    let first = g.add_i(q.kv_base, ts)?;
                    g.stage(l, lanes, l.ins[2], first, n, d, 0)?;
                    g.stage(l, lanes, l.ins[3], first, n, ev, vt)
                })
            })?;
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                let (qp, dop) = (g.local_at(l, lq)?, g.local_at(l, ldo)?);
                let (pp, dpp) = (g.local_at(l, lp)?, g.local_at(l, ldp)?);
                g.tile_keys(&q, ts, n, |g, j, jt| {
                    let dot = g.dot(qp, g.i64c(0), l.sh, g.mul_i(jt, g.i64c(d))?, d)?;
                    g.stf(pp, j, g.fmul(g.fconst(a.scale), dot)?)?;
                    let vb = g.add_i(g.i64c(vt), g.mul_i(jt, g.i64c(ev))?)?;
                    g.stf(dpp, j, g.dot(dop, g.i64c(0), l.sh, vb, ev)?)
                })
            })
        })?;
        // The row's statistics ([`Gen::attn_softmax`], then `AttnStats`'s sum of P dP);
        // P replaces the scores.
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            g.when(q.valid, |g| {
                let (pp, dpp) = (g.local_at(l, lp)?, g.local_at(l, ldp)?);
                let (m, inv) = g.scores_softmax(pp, q.lim)?;
                let dot = g.var(g.fconst(0.0).into())?;
                g.for_range(q.lim, |g, j| {
                    let y = g.call(g.exp_fn()?, &[g.fsub(g.ldf(pp, j)?, m)?])?;
                    let p = g.fmul(y, inv)?;
                    g.stf(pp, j, p)?;
                    g.set(dot, g.fadd(g.getf(dot, f32t)?, g.fmul(p, g.ldf(dpp, j)?)?)?)
                })?;
                let dsum = g.getf(dot, f32t)?;
                let s = g.mul_i(q.q_row, g.i64c(3))?;
                for (k, v) in [m, inv, dsum].into_iter().enumerate() {
                    g.stf(l.outs[0], g.add_i(s, g.i64c(k))?, v)?;
                    g.set(g.local_at(l, lst + k)?, v)?;
                }
                Ok(())
            })
        })?;
        // dq = sum_j dS_j K_j, a key tile at a time.
        tm.repeat(key_tiles, |tm| {
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                g.when(g.ult(ts, q.need)?, |g| {
                    g.stage(l, lanes, l.ins[2], g.add_i(q.kv_base, ts)?, n, d, 0)
                })
            })?;
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                let (pp, dpp) = (g.local_at(l, lp)?, g.local_at(l, ldp)?);
                let (acc, sump) = (g.local_at(l, lacc)?, g.local_at(l, lst + 2)?);
                g.tile_keys(&q, ts, n, |g, j, jt| {
                    let dsum = g.getf(sump, f32t)?;
                    let (p, dp) = (g.ldf(pp, j)?, g.ldf(dpp, j)?);
                    let ds = g.fmul(g.fmul(p, g.fsub(dp, dsum)?)?, g.fconst(a.scale))?;
                    g.axpy(acc, ds, l.sh, g.mul_i(jt, g.i64c(d))?, d)
                })
            })
        })?;
        Self::store_query_row(tm, &a, (lanes, tiles), lacc, 1, d)
    }

    /// `dk` and `dv` by key tiles ([`crate::kernel::Body::AttnTilesKv`]):
    /// `dout, q, k, v, stats (, offset) -> dk, dv`.
    pub(super) fn attn_tiles_kv(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let ti = a.tiles().ok_or("this attention has no tiling")?;
        let (lanes, rows, tiles) = (ti.k_lanes, ti.kv_rows, ti.k_tiles(a));
        let (d, ev) = (a.d, a.e);
        // A lane's memory: k [d], v [e], dk [d], dv [e].
        let (lk, lv, ldk, ldv) = (0, d, d + ev, 2 * d + ev);
        // Shared: q rows [rows, d], dO rows [rows, e], statistics [rows, 3].
        let (sdo, sst) = (rows * d, rows * (d + ev));
        tm.shared = Shared::Tile(rows * (d + ev + 3));
        tm.local = 2 * (d + ev);
        let per = a.h / a.g;
        let q_tiles = a.s.div_ceil(rows);
        let a = *a;
        // Key row `i`, its position `j`, whether the lane has one, the batch and the
        // key/value head.
        let key = move |g: &Gen<'ctx>, l: &Lane<'ctx>| {
            let bg = g.div_i(l.row, tiles)?;
            let first = g.mul_i(g.rem_i(l.row, tiles)?, g.i64c(lanes))?;
            let j = g.add_i(first, l.lane)?;
            let i = g.add_i(g.mul_i(bg, g.i64c(a.t))?, j)?;
            let (bi, kvh) = (g.div_i(bg, a.g)?, g.rem_i(bg, a.g)?);
            Ok::<_, String>((i, j, g.ult(j, g.i64c(a.t))?, bi, kvh, first))
        };
        // Iteration `l.iter`'s query tile: its first flat query row, first position and
        // length.
        let queries = move |g: &Gen<'ctx>, l: &Lane<'ctx>, bi, kvh| {
            let hh = g.div_i(l.iter, q_tiles)?;
            let q0 = g.mul_i(g.rem_i(l.iter, q_tiles)?, g.i64c(rows))?;
            let hi = g.add_i(g.mul_i(kvh, g.i64c(per))?, hh)?;
            let qh = g.add_i(g.mul_i(bi, g.i64c(a.h))?, hi)?;
            let n = g.min_i(g.i64c(rows), g.e_sub(g.i64c(a.s), q0)?)?;
            Ok::<_, String>((g.add_i(g.mul_i(qh, g.i64c(a.s))?, q0)?, q0, n))
        };
        tm.phase(lanes, |g, l| {
            let (i, _, valid, _, _, _) = key(g, l)?;
            g.when(valid, |g| {
                g.copy_words(l.ins[2], g.mul_i(i, g.i64c(d))?, g.local_at(l, lk)?, d)?;
                g.copy_words(l.ins[3], g.mul_i(i, g.i64c(ev))?, g.local_at(l, lv)?, ev)?;
                g.zero_words(g.local_at(l, ldk)?, d)?;
                g.zero_words(g.local_at(l, ldv)?, ev)
            })
        })?;
        tm.repeat(per * q_tiles, |tm| {
            tm.phase(lanes, |g, l| {
                let (_, _, _, bi, kvh, first) = key(g, l)?;
                let (row0, q0, n) = queries(g, l, bi, kvh)?;
                // A causal tile matters if its last query sees the block's first key.
                let needed = if a.causal {
                    let off = g.query_offset(&a, &l.ins)?;
                    g.ult(first, g.add_i(g.add_i(q0, n)?, off)?)?
                } else {
                    g.ctx.bool_type().const_int(1, false)
                };
                g.when(needed, |g| {
                    g.stage(l, lanes, l.ins[1], row0, n, d, 0)?;
                    g.stage(l, lanes, l.ins[0], row0, n, ev, sdo)?;
                    g.stage(l, lanes, l.ins[4], row0, n, 3, sst)
                })
            })?;
            tm.phase(lanes, |g, l| {
                let (_, j, valid, bi, kvh, _) = key(g, l)?;
                let (_, q0, n) = queries(g, l, bi, kvh)?;
                let off = g.query_offset(&a, &l.ins)?;
                let (kp, vp) = (g.local_at(l, lk)?, g.local_at(l, lv)?);
                let (dk, dv) = (g.local_at(l, ldk)?, g.local_at(l, ldv)?);
                g.when(valid, |g| {
                    g.for_range(n, |g, r| {
                        // Causal: query q0 + r sees key j only when j <= its position.
                        let seen = if a.causal {
                            let pos = g.add_i(g.add_i(q0, r)?, off)?;
                            e(g.b.build_int_compare(IntPredicate::ULE, j, pos, ""))?
                        } else {
                            g.ctx.bool_type().const_int(1, false)
                        };
                        g.when(seen, |g| {
                            let st = g.add_i(g.i64c(sst), g.mul_i(r, g.i64c(3))?)?;
                            let mx = g.ldf(l.sh, st)?;
                            let inv = g.ldf(l.sh, g.add_i(st, g.i64c(1))?)?;
                            let dsum = g.ldf(l.sh, g.add_i(st, g.i64c(2))?)?;
                            let qb = g.mul_i(r, g.i64c(d))?;
                            let ob = g.add_i(g.i64c(sdo), g.mul_i(r, g.i64c(ev))?)?;
                            let s =
                                g.fmul(g.fconst(a.scale), g.dot(l.sh, qb, kp, g.i64c(0), d)?)?;
                            let y = g.call(g.exp_fn()?, &[g.fsub(s, mx)?])?;
                            let p = g.fmul(y, inv)?;
                            let dp = g.dot(l.sh, ob, vp, g.i64c(0), ev)?;
                            let ds = g.fmul(g.fmul(p, g.fsub(dp, dsum)?)?, g.fconst(a.scale))?;
                            g.axpy(dv, p, l.sh, ob, ev)?;
                            g.axpy(dk, ds, l.sh, qb, d)
                        })
                    })
                })
            })
        })?;
        tm.phase(lanes, |g, l| {
            let (i, _, valid, _, _, _) = key(g, l)?;
            g.when(valid, |g| {
                g.store_array(g.local_at(l, ldk)?, l.outs[0], g.mul_i(i, g.i64c(d))?, d)?;
                g.store_array(g.local_at(l, ldv)?, l.outs[1], g.mul_i(i, g.i64c(ev))?, ev)
            })
        })
    }
}
