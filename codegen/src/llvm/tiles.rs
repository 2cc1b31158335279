//! Attention as FlashAttention-2 on team kernels ([`super::team`]): blocks stage tiles
//! of the rows all their lanes read in shared memory, and each lane keeps its running
//! results in registers.
//!
//! A block of the forward (or of the backward's statistics-and-`dq` kernel) is a tile of
//! up to [`crate::kernel::ATTN_TILE`] query rows of one head, a lane per row. In a loop
//! over key tiles, one phase copies the tile's key and value rows into the shared array
//! (consecutive lanes, consecutive words: coalesced; rows past the tile's end are zeros),
//! and the next one takes the tile [`crate::kernel::FWD_STEP`] keys at a time: the lane
//! scores its query against each (every lane reads the same shared row: a broadcast,
//! 16 bytes a load), and an *online
//! softmax* folds them into the row's running maximum `m`, sum `l` and weighted sum of
//! values `o` (each rescaled by `exp(m_old - m_new)` once per step). Nothing per key is
//! kept, so the key sequence has no length limit and no lane has a score array; `o` is
//! `out * l` at the end. A causal block skips the key tiles past its last query.
//!
//! The backward recomputes: its query-tile kernel runs the same pass for the row's `m`,
//! `1/l` and `D = dO . out` (which equals `sum_j P dP`), stores them as the row's
//! statistics, then runs a second pass over the key tiles for `dq = scale sum_j dS_j k_j`,
//! `dS = P (dP - D)` (the lane's `dO` row in a padded shared row of its own). The
//! `dk`/`dv` kernel turns the roles: a lane per key row (its key, pre-scaled, and its
//! value in padded shared rows of its own, the two gradients in registers), the
//! queries' `q`, `dO` and statistics staged a query tile at a time (every query head of
//! the key/value head's group), [`crate::kernel::KV_STEP`] queries a step. No two lanes add into one
//! element (no atomics), and every sum runs in a fixed order: the same bits every run.
//!
//! Every word of a lane's own memory is addressed by a constant and every loop over a
//! row's width is unrolled, so on the GPU the lane's memory (an array in the entry) is
//! promoted to registers: no local memory (`codegen/tests/kernels/ptx.rs` checks the PTX
//! with `ptxas -v`). The host runs the same IR, phase by phase, lane by lane, and is
//! tested against the CPU runtime's attention (a two-pass softmax) within the tolerance
//! of a reordered sum, as PyTorch holds its flash kernels to its math path.

use super::team::{Lane, Shared, Team};
use super::{e, Gen, R};
use crate::kernel::{Attn, ATTN_PAD};
use inkwell::values::{BasicValue, FloatValue, IntValue, PointerValue};
use inkwell::{FloatPredicate, IntPredicate};

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
    pub(super) fn min_i(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        let lt = e(self.b.build_int_compare(IntPredicate::ULT, a, b, ""))?;
        Ok(e(self.b.build_select(lt, a, b, ""))?.into_int_value())
    }

    pub(super) fn ult(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        e(self.b.build_int_compare(IntPredicate::ULT, a, b, ""))
    }

    /// Word `w` of a lane's own memory.
    pub(super) fn local_at(&self, l: &Lane<'ctx>, w: usize) -> R<PointerValue<'ctx>> {
        // SAFETY of the generated code: `w` is below the plan's words per lane.
        e(unsafe {
            self.b
                .build_in_bounds_gep(self.ctx.f32_type(), l.local, &[self.i64c(w)], "")
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

    /// Word `w` of a lane's own memory.
    pub(super) fn lw(&self, l: &Lane<'ctx>, w: usize) -> R<FloatValue<'ctx>> {
        self.getf(self.local_at(l, w)?, self.ctx.f32_type())
    }

    /// Sets word `w` of a lane's own memory.
    pub(super) fn lput(&self, l: &Lane<'ctx>, w: usize, v: FloatValue<'ctx>) -> R<()> {
        self.set(self.local_at(l, w)?, v)
    }

    /// Shared word `base + c`.
    fn shw(&self, l: &Lane<'ctx>, base: IntValue<'ctx>, c: usize) -> R<FloatValue<'ctx>> {
        self.ldf(l.sh, self.add_i(base, self.i64c(c))?)
    }

    /// The team stages `rows` rows of `width` words of `x`, from row `first`, into the
    /// shared array at word `at`, a row every `pitch` words: rows `n..rows` are zeros (a
    /// short tile's masked keys then weigh `0 * 0`, never `0 * NaN` from stale memory).
    /// Lane `l` copies words `l, l + t, ...` of the tile (consecutive lanes, consecutive
    /// words).
    #[allow(clippy::too_many_arguments)]
    fn stage_rows(
        &self,
        l: &Lane<'ctx>,
        t: usize,
        x: PointerValue<'ctx>,
        first: IntValue<'ctx>,
        (n, rows): (IntValue<'ctx>, usize),
        width: usize,
        (at, pitch): (usize, usize),
    ) -> R<()> {
        let src = self.mul_i(first, self.i64c(width))?;
        let have = self.mul_i(n, self.i64c(width))?;
        self.for_step(l.lane, self.i64c(rows * width), t, |g, w| {
            let inside = g.ult(w, have)?;
            let v = g.var(g.fconst(0.0).into())?;
            g.when(inside, |g| g.set(v, g.ldf(x, g.add_i(src, w)?)?))?;
            let v = g.getf(v, g.ctx.f32_type())?;
            let to = if pitch == width {
                w
            } else {
                let (r, c) = (g.div_i(w, width)?, g.rem_i(w, width)?);
                g.add_i(g.mul_i(r, g.i64c(pitch))?, c)?
            };
            g.stf(l.sh, g.add_i(g.i64c(at), to)?, v)
        })
    }

    /// `a * b + c` (one FMA on the GPU, where `mul` and `add` would each round).
    pub(super) fn fma(
        &self,
        a: FloatValue<'ctx>,
        b: FloatValue<'ctx>,
        c: FloatValue<'ctx>,
    ) -> R<FloatValue<'ctx>> {
        let f = self.intrinsic("llvm.fmuladd")?;
        let r = e(self.b.build_call(f, &[a.into(), b.into(), c.into()], ""))?;
        r.try_as_basic_value()
            .basic()
            .map(|v| v.into_float_value())
            .ok_or_else(|| "fmuladd returned nothing".to_string())
    }

    /// The address of shared words `base + c ..`, and whether it starts a 16-byte word
    /// group: `base` a multiple of 4 (every row the tiles read as vectors starts at one:
    /// [`crate::kernel::Attn::vector_rows`]) and `c` too.
    fn sh_ptr(&self, l: &Lane<'ctx>, base: IntValue<'ctx>, c: usize) -> R<PointerValue<'ctx>> {
        let at = self.add_i(base, self.i64c(c))?;
        // SAFETY of the generated code: every word read is inside the kernel's shared
        // array (the tiles' layout).
        e(unsafe {
            self.b
                .build_in_bounds_gep(self.ctx.f32_type(), l.sh, &[at], "")
        })
    }

    /// Shared words `base..base + len`: four at a time (one 16-byte load) where `vec`
    /// (the row starts 16-byte aligned and `len` is a multiple of 4), else one by one.
    fn sh_row(
        &self,
        l: &Lane<'ctx>,
        base: IntValue<'ctx>,
        len: usize,
        vec: bool,
    ) -> R<Vec<FloatValue<'ctx>>> {
        if !vec || !len.is_multiple_of(4) {
            return (0..len).map(|c| self.shw(l, base, c)).collect();
        }
        let v4 = self.ctx.f32_type().vec_type(4);
        let mut out = Vec::with_capacity(len);
        for c in (0..len).step_by(4) {
            let v = e(self.b.build_load(v4, self.sh_ptr(l, base, c)?, ""))?.into_vector_value();
            let ins = v
                .as_instruction_value()
                .ok_or("a load that is no instruction")?;
            e(ins.set_alignment(16))?;
            for k in 0..4u64 {
                let x = e(self.b.build_extract_element(
                    v,
                    self.ctx.i32_type().const_int(k, false),
                    "",
                ))?;
                out.push(x.into_float_value());
            }
        }
        Ok(out)
    }

    /// Stores `vals` to shared words `base..`, as [`Self::sh_row`] reads them.
    fn sh_put_row(
        &self,
        l: &Lane<'ctx>,
        base: IntValue<'ctx>,
        vals: &[FloatValue<'ctx>],
        vec: bool,
    ) -> R<()> {
        if !vec || !vals.len().is_multiple_of(4) {
            for (c, v) in vals.iter().enumerate() {
                self.stf(l.sh, self.add_i(base, self.i64c(c))?, *v)?;
            }
            return Ok(());
        }
        let v4 = self.ctx.f32_type().vec_type(4);
        for (c, chunk) in vals.chunks(4).enumerate() {
            let mut v = v4.get_undef();
            for (k, x) in chunk.iter().enumerate() {
                let i = self.ctx.i32_type().const_int(k as u64, false);
                v = e(self.b.build_insert_element(v, *x, i, ""))?;
            }
            let st = e(self.b.build_store(self.sh_ptr(l, base, 4 * c)?, v))?;
            e(st.set_alignment(16))?;
        }
        Ok(())
    }

    /// `sum_c local[lw + c] * shared[sb + c]` over `c` in `0..len`, unrolled.
    fn dot_ls(
        &self,
        l: &Lane<'ctx>,
        lw: usize,
        sb: IntValue<'ctx>,
        len: usize,
        vec: bool,
    ) -> R<FloatValue<'ctx>> {
        let row = self.sh_row(l, sb, len, vec)?;
        let mut acc = self.fmul(self.lw(l, lw)?, row[0])?;
        for (c, x) in row.iter().enumerate().skip(1) {
            acc = self.fma(self.lw(l, lw + c)?, *x, acc)?;
        }
        Ok(acc)
    }

    /// `local[lw + c] = local[lw + c] * keep + sum_b w[b] * shared[rows[b] + c]` for `c`
    /// in `0..len` (`keep` none: 1), unrolled.
    #[allow(clippy::too_many_arguments)]
    fn gather_rows(
        &self,
        l: &Lane<'ctx>,
        lw: usize,
        keep: Option<FloatValue<'ctx>>,
        w: &[FloatValue<'ctx>],
        rows: &[IntValue<'ctx>],
        len: usize,
        vec: bool,
    ) -> R<()> {
        // Four words at a time (one 16-byte load of each row), every row's weight applied
        // before the next four: few values live at once.
        let chunk = if vec && len.is_multiple_of(4) { 4 } else { 1 };
        for c0 in (0..len).step_by(chunk) {
            let mut acc = Vec::with_capacity(chunk);
            for c in c0..c0 + chunk {
                let a = self.lw(l, lw + c)?;
                acc.push(match keep {
                    Some(k) => self.fmul(a, k)?,
                    None => a,
                });
            }
            for (wb, rb) in w.iter().zip(rows) {
                let part = self.sh_row(l, self.add_i(*rb, self.i64c(c0))?, chunk, vec)?;
                for (a, x) in acc.iter_mut().zip(part) {
                    *a = self.fma(*wb, x, *a)?;
                }
            }
            for (k, a) in acc.into_iter().enumerate() {
                self.lput(l, lw + c0 + k, a)?;
            }
        }
        Ok(())
    }

    /// `shared[acc + c] += sum_b w[b] * shared[rows[b] + c]` for `c` in `0..len` (a
    /// lane's own row of shared words), unrolled.
    fn gather_shared(
        &self,
        l: &Lane<'ctx>,
        acc: IntValue<'ctx>,
        w: &[FloatValue<'ctx>],
        rows: &[IntValue<'ctx>],
        len: usize,
        vec: bool,
    ) -> R<()> {
        let chunk = if vec && len.is_multiple_of(4) { 4 } else { 1 };
        for c0 in (0..len).step_by(chunk) {
            let at = self.add_i(acc, self.i64c(c0))?;
            let mut a = self.sh_row(l, at, chunk, vec)?;
            for (wb, rb) in w.iter().zip(rows) {
                let part = self.sh_row(l, self.add_i(*rb, self.i64c(c0))?, chunk, vec)?;
                for (x, y) in a.iter_mut().zip(part) {
                    *x = self.fma(*wb, y, *x)?;
                }
            }
            self.sh_put_row(l, at, &a, vec)?;
        }
        Ok(())
    }

    /// Sets words `lw..lw + len` of a lane's memory to `v`.
    fn fill_local(&self, l: &Lane<'ctx>, lw: usize, len: usize, v: f32) -> R<()> {
        for c in 0..len {
            self.lput(l, lw + c, self.fconst(v))?;
        }
        Ok(())
    }

    /// Copies row `row` (`len` words) of `x`, times `scale`, to words `lw..` of a lane's
    /// memory.
    fn load_row(
        &self,
        l: &Lane<'ctx>,
        x: PointerValue<'ctx>,
        row: IntValue<'ctx>,
        len: usize,
        lw: usize,
        scale: f32,
    ) -> R<()> {
        let base = self.mul_i(row, self.i64c(len))?;
        for c in 0..len {
            let v = self.ldf(x, self.add_i(base, self.i64c(c))?)?;
            let v = if scale == 1.0 {
                v
            } else {
                self.fmul(v, self.fconst(scale))?
            };
            self.lput(l, lw + c, v)?;
        }
        Ok(())
    }

    /// Stores words `lw..lw + len` of a lane's memory, times `f`, to row `row` of `out`.
    fn store_row(
        &self,
        l: &Lane<'ctx>,
        out: PointerValue<'ctx>,
        row: IntValue<'ctx>,
        len: usize,
        lw: usize,
        f: FloatValue<'ctx>,
    ) -> R<()> {
        let base = self.mul_i(row, self.i64c(len))?;
        for c in 0..len {
            let v = self.fmul(self.lw(l, lw + c)?, f)?;
            self.stf(out, self.add_i(base, self.i64c(c))?, v)?;
        }
        Ok(())
    }

    pub(super) fn select_f(
        &self,
        c: IntValue<'ctx>,
        a: FloatValue<'ctx>,
        b: FloatValue<'ctx>,
    ) -> R<FloatValue<'ctx>> {
        Ok(e(self.b.build_select(c, a, b, ""))?.into_float_value())
    }

    /// Keys (or queries) of a staged tile of `n` that the block takes, in steps of
    /// `step`: `ceil(n' / step)`, `n'` = `n` where the block needs the tile, else 0.
    fn steps_of(
        &self,
        n: IntValue<'ctx>,
        needed: IntValue<'ctx>,
        step: usize,
    ) -> R<IntValue<'ctx>> {
        let s = self.div_i(self.add_i(n, self.i64c(step - 1))?, step)?;
        Ok(e(self.b.build_select(needed, s, self.i64c(0), ""))?.into_int_value())
    }

    /// One online-softmax step of a query lane: `s` the step's scores (-inf where masked),
    /// `vrows` the shared words of their value rows; the lane's `m`, `l` at words `lm`,
    /// `lm + 1`, its weighted sum at `lo` (`ev` words).
    fn online_step(
        &self,
        l: &Lane<'ctx>,
        s: &[FloatValue<'ctx>],
        vrows: &[IntValue<'ctx>],
        (lo, ev, lm): (usize, usize, usize),
        vec: bool,
    ) -> R<()> {
        let m = self.lw(l, lm)?;
        let mut mx = m;
        for &sb in s {
            mx = self.maxf(mx, sb)?;
        }
        // Nothing seen yet (every score so far masked): subtract 0, not -inf (-inf - -inf
        // is NaN); every weight is then exp(-inf) = 0.
        let none = self.select(
            FloatPredicate::OEQ,
            mx,
            self.fconst(f32::NEG_INFINITY),
            self.fconst(0.0),
            mx,
        )?;
        let exp = self.exp_fn()?;
        let corr = self.call(exp, &[self.fsub(m, none)?])?;
        let mut p = Vec::with_capacity(s.len());
        let mut sum = self.fmul(self.lw(l, lm + 1)?, corr)?;
        for &sb in s {
            let pb = self.call(exp, &[self.fsub(sb, none)?])?;
            sum = self.fadd(sum, pb)?;
            p.push(pb);
        }
        self.lput(l, lm + 1, sum)?;
        self.lput(l, lm, mx)?;
        self.gather_rows(l, lo, Some(corr), &p, vrows, ev, vec)
    }

    /// A pass over the key tiles of a query-tile block folding every key the lane sees
    /// into its online softmax: the lane's query (pre-scaled) at word `lq`, `o` at `lo`,
    /// `m`, `l` at `lm`, `lm + 1`. Keys are input `k_in`, values `k_in + 1`.
    fn online_pass(
        tm: &mut Team<'_, 'ctx>,
        a: &Attn,
        (lanes, tiles, rows, step): (usize, usize, usize, usize),
        k_in: usize,
        (lq, lo, lm): (usize, usize, usize),
    ) -> R<()> {
        let a = *a;
        let (d, ev) = (a.d, a.e);
        let vt = rows * d;
        let step = step.min(rows);
        tm.repeat(a.t.div_ceil(rows), |tm| {
            Self::stage_keys(tm, &a, (lanes, tiles, rows), k_in)?;
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                let steps = g.steps_of(n, g.ult(ts, q.need)?, step)?;
                g.when(q.valid, |g| {
                    g.for_range(steps, |g, sb| {
                        let jt0 = g.mul_i(sb, g.i64c(step))?;
                        let mut s = Vec::with_capacity(step);
                        let mut vrows = Vec::with_capacity(step);
                        for b in 0..step {
                            let jt = g.add_i(jt0, g.i64c(b))?;
                            let dot =
                                g.dot_ls(l, lq, g.mul_i(jt, g.i64c(d))?, d, a.vector_rows())?;
                            let seen = g.ult(g.add_i(ts, jt)?, q.lim)?;
                            s.push(g.select_f(seen, dot, g.fconst(f32::NEG_INFINITY))?);
                            vrows.push(g.add_i(g.i64c(vt), g.mul_i(jt, g.i64c(ev))?)?);
                        }
                        g.online_step(l, &s, &vrows, (lo, ev, lm), a.vector_rows())
                    })
                })
            })
        })
    }

    /// The phase staging key tile `l.iter` (keys of input `k_in` at word 0, values of
    /// `k_in + 1` after them) where some lane of the block sees it.
    fn stage_keys(
        tm: &mut Team<'_, 'ctx>,
        a: &Attn,
        (lanes, tiles, rows): (usize, usize, usize),
        k_in: usize,
    ) -> R<()> {
        let a = *a;
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            let (ts, n) = g.key_tile(&a, rows, l)?;
            g.when(g.ult(ts, q.need)?, |g| {
                let first = g.add_i(q.kv_base, ts)?;
                g.stage_rows(l, lanes, l.ins[k_in], first, (n, rows), a.d, (0, a.d))?;
                let vt = rows * a.d;
                g.stage_rows(l, lanes, l.ins[k_in + 1], first, (n, rows), a.e, (vt, a.e))
            })
        })
    }

    /// The forward ([`crate::kernel::Body::AttnTiles`]): `q, k, v (, offset) -> out`.
    pub(super) fn attn_tiles(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let ti = a.tiles().ok_or("this attention has no tiling")?;
        let (lanes, rows, tiles) = (ti.q_lanes, ti.fwd_rows, ti.q_tiles(a));
        let (d, ev) = (a.d, a.e);
        // A lane's memory: q * scale [d], o [e], m, l.
        let (lq, lo, lm) = (0, d, d + ev);
        tm.shared = Shared::Tile(rows * (d + ev));
        tm.local = lm + 2;
        let a = *a;
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            g.when(q.valid, |g| {
                g.load_row(l, l.ins[0], q.q_row, d, lq, a.scale)?;
                g.fill_local(l, lo, ev, 0.0)?;
                g.fill_local(l, lm, 1, f32::NEG_INFINITY)?;
                g.fill_local(l, lm + 1, 1, 0.0)
            })
        })?;
        Self::online_pass(tm, &a, (lanes, tiles, rows, ti.steps.0), 1, (lq, lo, lm))?;
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            g.when(q.valid, |g| {
                let inv = g.fdiv(g.fconst(1.0), g.lw(l, lm + 1)?)?;
                g.store_row(l, l.outs[0], q.q_row, ev, lo, inv)?;
                if a.saved {
                    // The row's statistics for the backward: [max, 1/sum].
                    let s = g.mul_i(q.q_row, g.i64c(2))?;
                    g.stf(l.outs[1], s, g.lw(l, lm)?)?;
                    g.stf(l.outs[1], g.add_i(s, g.i64c(1))?, inv)?;
                }
                Ok(())
            })
        })
    }

    /// The backward's statistics and `dq` ([`crate::kernel::Body::AttnTilesBack`]):
    /// `dout, q, k, v (, offset) -> stats, dq`; the statistics `[m, 1/l, D]` per query
    /// row (`D = dO . out`).
    pub(super) fn attn_tiles_back(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let ti = a.tiles().ok_or("this attention has no tiling")?;
        let (lanes, rows, tiles) = (ti.q_lanes, ti.back_rows, ti.q_tiles(a));
        let (d, ev) = (a.d, a.e);
        // A lane's memory: q * scale [d], o [e] (the first pass), then dO [e] (the
        // second), m, l (then 1/l), D.
        let (lq, lo, lm) = (0, d, d + ev);
        // Shared: key rows [rows, d], value rows [rows, e], then each lane's `dq`
        // accumulator [lanes, d + ATTN_PAD]: registers hold two rows of 64 and the step's
        // work, not three.
        let (vt, sdq) = (rows * d, rows * (d + ev));
        let qp = d + ATTN_PAD;
        tm.shared = Shared::Tile(sdq + lanes * qp);
        tm.local = lm + 3;
        let step = ti.steps.1.min(rows);
        let vec = a.vector_rows();
        let a = *a;
        let mine =
            move |g: &Gen<'ctx>, l: &Lane<'ctx>| g.add_i(g.i64c(sdq), g.mul_i(l.lane, g.i64c(qp))?);
        if a.saved {
            // The forward kept its statistics: [max, 1/sum] (input 5) and its output
            // (input 4) give D = dO . out; no pass over the keys.
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                g.when(q.valid, |g| {
                    g.load_row(l, l.ins[1], q.q_row, d, lq, a.scale)?;
                    let ob = g.mul_i(q.q_row, g.i64c(ev))?;
                    let mut dsum = g.fconst(0.0);
                    for c in 0..ev {
                        let at = g.add_i(ob, g.i64c(c))?;
                        let dov = g.ldf(l.ins[0], at)?;
                        dsum = g.fma(dov, g.ldf(l.ins[4], at)?, dsum)?;
                        g.lput(l, lo + c, dov)?;
                    }
                    let s2 = g.mul_i(q.q_row, g.i64c(2))?;
                    g.lput(l, lm, g.ldf(l.ins[5], s2)?)?;
                    g.lput(l, lm + 1, g.ldf(l.ins[5], g.add_i(s2, g.i64c(1))?)?)?;
                    g.lput(l, lm + 2, dsum)?;
                    g.stats_and_zero_dq(l, q.q_row, lm, mine(g, l)?, d)
                })
            })?;
        } else {
            Self::back_stats(tm, &a, (lanes, tiles, rows), (lq, lo, lm), mine)?;
        }
        Self::back_dq(
            tm,
            &a,
            (lanes, tiles, rows, step, vt, vec),
            (lq, lo, lm),
            mine,
        )
    }

    /// The backward's first pass (the forward's, again) and the row's statistics
    /// `[m, 1/l, D]`, then `dO` in `o`'s place and a zero `dq`.
    fn back_stats(
        tm: &mut Team<'_, 'ctx>,
        a: &Attn,
        (lanes, tiles, rows): (usize, usize, usize),
        (lq, lo, lm): (usize, usize, usize),
        mine: impl Fn(&Gen<'ctx>, &Lane<'ctx>) -> R<IntValue<'ctx>> + Copy,
    ) -> R<()> {
        let (d, ev) = (a.d, a.e);
        let ti = a.tiles().ok_or("this attention has no tiling")?;
        let a = *a;
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            g.when(q.valid, |g| {
                g.load_row(l, l.ins[1], q.q_row, d, lq, a.scale)?;
                g.fill_local(l, lo, ev, 0.0)?;
                g.fill_local(l, lm, 1, f32::NEG_INFINITY)?;
                g.fill_local(l, lm + 1, 1, 0.0)
            })
        })?;
        Self::online_pass(tm, &a, (lanes, tiles, rows, ti.steps.0), 2, (lq, lo, lm))?;
        // The row's statistics, then dO in o's place and a zero `dq`.
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            g.when(q.valid, |g| {
                let inv = g.fdiv(g.fconst(1.0), g.lw(l, lm + 1)?)?;
                let ob = g.mul_i(q.q_row, g.i64c(ev))?;
                let mut dsum = g.fconst(0.0);
                for c in 0..ev {
                    let dov = g.ldf(l.ins[0], g.add_i(ob, g.i64c(c))?)?;
                    dsum = g.fadd(dsum, g.fmul(dov, g.lw(l, lo + c)?)?)?;
                    g.lput(l, lo + c, dov)?;
                }
                let dsum = g.fmul(dsum, inv)?;
                g.lput(l, lm + 1, inv)?;
                g.lput(l, lm + 2, dsum)?;
                g.stats_and_zero_dq(l, q.q_row, lm, mine(g, l)?, d)
            })
        })
    }

    /// Stores a query row's statistics `[m, 1/l, D]` (words `lm..lm + 3` of the lane's
    /// memory) to output 0, and zeroes the lane's `dq` accumulator (`d` shared words from
    /// `my`).
    fn stats_and_zero_dq(
        &self,
        l: &Lane<'ctx>,
        q_row: IntValue<'ctx>,
        lm: usize,
        my: IntValue<'ctx>,
        d: usize,
    ) -> R<()> {
        let s = self.mul_i(q_row, self.i64c(3))?;
        for k in 0..3 {
            self.stf(l.outs[0], self.add_i(s, self.i64c(k))?, self.lw(l, lm + k)?)?;
        }
        for c in 0..d {
            self.stf(l.sh, self.add_i(my, self.i64c(c))?, self.fconst(0.0))?;
        }
        Ok(())
    }

    /// `dq = scale sum_j P (dP - D) k_j` over the key tiles, `step` keys a step, from the
    /// statistics in a lane's memory; then `dq` stored.
    fn back_dq(
        tm: &mut Team<'_, 'ctx>,
        a: &Attn,
        (lanes, tiles, rows, step, vt, vec): (usize, usize, usize, usize, usize, bool),
        (lq, lo, lm): (usize, usize, usize),
        mine: impl Fn(&Gen<'ctx>, &Lane<'ctx>) -> R<IntValue<'ctx>> + Copy,
    ) -> R<()> {
        let (d, ev) = (a.d, a.e);
        let a = *a;
        tm.repeat(a.t.div_ceil(rows), |tm| {
            Self::stage_keys(tm, &a, (lanes, tiles, rows), 2)?;
            tm.phase(lanes, |g, l| {
                let q = g.query_lane(&a, lanes, tiles, l)?;
                let (ts, n) = g.key_tile(&a, rows, l)?;
                let steps = g.steps_of(n, g.ult(ts, q.need)?, step)?;
                let my = mine(g, l)?;
                g.when(q.valid, |g| {
                    let (m, inv, dsum) = (g.lw(l, lm)?, g.lw(l, lm + 1)?, g.lw(l, lm + 2)?);
                    let exp = g.exp_fn()?;
                    g.for_range(steps, |g, sb| {
                        let jt0 = g.mul_i(sb, g.i64c(step))?;
                        let mut ds = Vec::with_capacity(step);
                        let mut krows = Vec::with_capacity(step);
                        for b in 0..step {
                            let jt = g.add_i(jt0, g.i64c(b))?;
                            let kb = g.mul_i(jt, g.i64c(d))?;
                            let s = g.dot_ls(l, lq, kb, d, vec)?;
                            let p = g.fmul(g.call(exp, &[g.fsub(s, m)?])?, inv)?;
                            let seen = g.ult(g.add_i(ts, jt)?, q.lim)?;
                            let p = g.select_f(seen, p, g.fconst(0.0))?;
                            let vb = g.add_i(g.i64c(vt), g.mul_i(jt, g.i64c(ev))?)?;
                            let dp = g.dot_ls(l, lo, vb, ev, vec)?;
                            ds.push(g.fmul(p, g.fsub(dp, dsum)?)?);
                            krows.push(kb);
                        }
                        g.gather_shared(l, my, &ds, &krows, d, vec)
                    })
                })
            })
        })?;
        tm.phase(lanes, |g, l| {
            let q = g.query_lane(&a, lanes, tiles, l)?;
            g.when(q.valid, |g| {
                let (my, ob) = (mine(g, l)?, g.mul_i(q.q_row, g.i64c(d))?);
                for c in 0..d {
                    let v = g.fmul(g.shw(l, my, c)?, g.fconst(a.scale))?;
                    g.stf(l.outs[1], g.add_i(ob, g.i64c(c))?, v)?;
                }
                Ok(())
            })
        })
    }

    /// `dk` and `dv` by key tiles ([`crate::kernel::Body::AttnTilesKv`]):
    /// `dout, q, k, v, stats (, offset) -> dk, dv`.
    pub(super) fn attn_tiles_kv(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let ti = a.tiles().ok_or("this attention has no tiling")?;
        let (lanes, rows, tiles) = (ti.k_lanes, ti.kv_rows, ti.k_tiles(a));
        let (d, ev) = (a.d, a.e);
        // A lane's memory: k * scale [d], v [e].
        let (lk, lv) = (0, d);
        // Shared: q rows [rows, d], dO rows [rows, e], statistics [rows, 3], then each
        // lane's accumulators dk [lanes, d + ATTN_PAD] and dv [lanes, e + ATTN_PAD].
        // (dk starts on a 16-byte boundary: its rows are read 4 words at a time.)
        let (sdo, sst) = (rows * d, rows * (d + ev));
        let sdk = (rows * (d + ev + 3)).next_multiple_of(4);
        let (kp, vp) = (d + ATTN_PAD, ev + ATTN_PAD);
        let sdv = sdk + lanes * kp;
        tm.shared = Shared::Tile(sdv + lanes * vp);
        tm.local = d + ev;
        let per = a.h / a.g;
        let q_tiles = a.s.div_ceil(rows);
        let step = ti.steps.2.min(rows);
        let vec = a.vector_rows();
        let a = *a;
        // Key row `i`, its position `j`, whether the lane has one, the batch and the
        // key/value head, the block's first key position.
        let key = move |g: &Gen<'ctx>, l: &Lane<'ctx>| {
            let bg = g.div_i(l.row, tiles)?;
            let first = g.mul_i(g.rem_i(l.row, tiles)?, g.i64c(lanes))?;
            let j = g.add_i(first, l.lane)?;
            let i = g.add_i(g.mul_i(bg, g.i64c(a.t))?, j)?;
            let (bi, kvh) = (g.div_i(bg, a.g)?, g.rem_i(bg, a.g)?);
            Ok::<_, String>((i, j, g.ult(j, g.i64c(a.t))?, bi, kvh, first))
        };
        // Iteration `l.iter`'s query tile: its first flat query row, first position,
        // length, and whether the block needs it (causal: its last query sees the block's
        // first key).
        let queries = move |g: &Gen<'ctx>, l: &Lane<'ctx>, bi, kvh, first| {
            let hh = g.div_i(l.iter, q_tiles)?;
            let q0 = g.mul_i(g.rem_i(l.iter, q_tiles)?, g.i64c(rows))?;
            let hi = g.add_i(g.mul_i(kvh, g.i64c(per))?, hh)?;
            let qh = g.add_i(g.mul_i(bi, g.i64c(a.h))?, hi)?;
            let n = g.min_i(g.i64c(rows), g.e_sub(g.i64c(a.s), q0)?)?;
            let needed = if a.causal {
                let off = g.query_offset(&a, &l.ins)?;
                g.ult(first, g.add_i(g.add_i(q0, n)?, off)?)?
            } else {
                g.ctx.bool_type().const_int(1, false)
            };
            Ok::<_, String>((g.add_i(g.mul_i(qh, g.i64c(a.s))?, q0)?, q0, n, needed))
        };
        let own = move |g: &Gen<'ctx>, l: &Lane<'ctx>| {
            let k = g.add_i(g.i64c(sdk), g.mul_i(l.lane, g.i64c(kp))?)?;
            let v = g.add_i(g.i64c(sdv), g.mul_i(l.lane, g.i64c(vp))?)?;
            Ok::<_, String>((k, v))
        };
        tm.phase(lanes, |g, l| {
            let (i, _, valid, _, _, _) = key(g, l)?;
            let (mk, mv) = own(g, l)?;
            g.when(valid, |g| {
                g.load_row(l, l.ins[2], i, d, lk, a.scale)?;
                g.load_row(l, l.ins[3], i, ev, lv, 1.0)?;
                for (at, len) in [(mk, d), (mv, ev)] {
                    for c in 0..len {
                        g.stf(l.sh, g.add_i(at, g.i64c(c))?, g.fconst(0.0))?;
                    }
                }
                Ok(())
            })
        })?;
        tm.repeat(per * q_tiles, |tm| {
            tm.phase(lanes, |g, l| {
                let (_, _, _, bi, kvh, first) = key(g, l)?;
                let (row0, _, n, needed) = queries(g, l, bi, kvh, first)?;
                g.when(needed, |g| {
                    let nr = (n, rows);
                    g.stage_rows(l, lanes, l.ins[1], row0, nr, d, (0, d))?;
                    g.stage_rows(l, lanes, l.ins[0], row0, nr, ev, (sdo, ev))?;
                    g.stage_rows(l, lanes, l.ins[4], row0, nr, 3, (sst, 3))
                })
            })?;
            tm.phase(lanes, |g, l| {
                let (_, j, valid, bi, kvh, first) = key(g, l)?;
                let (_, q0, n, needed) = queries(g, l, bi, kvh, first)?;
                let steps = g.steps_of(n, needed, step)?;
                let off = g.query_offset(&a, &l.ins)?;
                let (mk, mv) = own(g, l)?;
                g.when(valid, |g| {
                    let exp = g.exp_fn()?;
                    g.for_range(steps, |g, sb| {
                        let r0 = g.mul_i(sb, g.i64c(step))?;
                        let (mut p, mut ds) = (Vec::new(), Vec::new());
                        let (mut qrows, mut orows) = (Vec::new(), Vec::new());
                        for b in 0..step {
                            let r = g.add_i(r0, g.i64c(b))?;
                            let qb = g.mul_i(r, g.i64c(d))?;
                            let ob = g.add_i(g.i64c(sdo), g.mul_i(r, g.i64c(ev))?)?;
                            let st = g.add_i(g.i64c(sst), g.mul_i(r, g.i64c(3))?)?;
                            let (m, inv, dsum) =
                                (g.shw(l, st, 0)?, g.shw(l, st, 1)?, g.shw(l, st, 2)?);
                            // s = (scale k) . q
                            let s = g.dot_ls(l, lk, qb, d, vec)?;
                            let pb = g.fmul(g.call(exp, &[g.fsub(s, m)?])?, inv)?;
                            let mut seen = g.ult(r, n)?;
                            if a.causal {
                                let pos = g.add_i(g.add_i(q0, r)?, off)?;
                                let ok = e(g.b.build_int_compare(IntPredicate::ULE, j, pos, ""))?;
                                seen = e(g.b.build_and(seen, ok, ""))?;
                            }
                            let pb = g.select_f(seen, pb, g.fconst(0.0))?;
                            let dp = g.dot_ls(l, lv, ob, ev, vec)?;
                            ds.push(g.fmul(pb, g.fsub(dp, dsum)?)?);
                            p.push(pb);
                            qrows.push(qb);
                            orows.push(ob);
                        }
                        g.gather_shared(l, mv, &p, &orows, ev, vec)?;
                        g.gather_shared(l, mk, &ds, &qrows, d, vec)
                    })
                })
            })
        })?;
        tm.phase(lanes, |g, l| {
            let (i, _, valid, _, _, _) = key(g, l)?;
            let (mk, mv) = own(g, l)?;
            g.when(valid, |g| {
                for (at, out, len, f) in [(mk, 0, d, a.scale), (mv, 1, ev, 1.0)] {
                    let ob = g.mul_i(i, g.i64c(len))?;
                    for c in 0..len {
                        let v = g.fmul(g.shw(l, at, c)?, g.fconst(f))?;
                        g.stf(l.outs[out], g.add_i(ob, g.i64c(c))?, v)?;
                    }
                }
                Ok(())
            })
        })
    }
}
