//! Team kernels: one index (a row) computed by a team of threads, one GPU block.
//!
//! A team kernel `K` ([`Kernel::team`] > 1) is a sequence of *phases*, internal functions
//! `K.p0, K.p1, ...(i64 row, i64 lane, i64 iter, ptr shared, ptr local, ptr in0, ...,
//! ptr out)`, run in the order of its [`Plan`]'s segments: once each, or repeated in a
//! loop ([`Seg::Loop`], `iter` counting the repetitions; tiled attention's loops over
//! tiles). Every lane of the team runs a phase before any lane starts the next one: on
//! the GPU a barrier (`bar.sync 0`) separates them, or, before a phase that only needs
//! what its own warp did ([`Sync::Warp`]), a warp's (`bar.warp.sync`); on the host each
//! phase is a loop over the lanes, so the host runs the same phases in the order a GPU
//! may interleave them at worst. Lanes pass values between phases only through the shared
//! array, and within one phase no lane reads a word another lane writes: that discipline,
//! kept by construction here, is what makes the host's order and the GPU's agree. A lane
//! may also keep values in its own memory (`local`, [`Plan::local`] f32 words: an array
//! in the PTX entry, registers once promoted; a slice of one `malloc`ed block on the
//! host, the lanes' slices in order), which no other lane touches, except through a
//! warp-wide product whose `A` fragment is in its warp's registers (`super::mma`'s
//! `nns.mma.bf16.ra`): on the GPU `mma.sync` exchanges them; the host reads the words of
//! the lanes that hold each operand, written in an earlier phase.
//!
//! The reductions' shared array ([`Shared::Stats`]) holds two arrays of `t` f64 partials (one per lane) and
//! [`STATS`] f64 statistics. A reduction ([`Team::reduce`]) is one phase in which lane
//! `l` accumulates elements `l, l + t, l + 2t, ...` of the line into its partials, then
//! `log2 t` phases of a tree (`lane < s` adds partial `lane + s` into its own), the last
//! of which writes the team's result to a statistic slot that later phases read.
//! Sums are kept in f64 (the reference's accumulators are f64, or f32 where this is
//! more accurate than the reference); maxima in f64 too (exact for f32 values).

mod bodies;

use super::{e, Gen, R};
use crate::kernel::{classes, Body, Kernel, Line, Reduce, COL_GROUPS, COL_TILE};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::module::Linkage;
use inkwell::types::BasicMetadataTypeEnum;
use inkwell::values::{FloatValue, IntValue, PointerValue};
use inkwell::{AddressSpace, IntPredicate};

/// Statistic slots after the partials.
pub(super) const STATS: usize = 8;

/// The f64 words of a team of `t`'s shared array.
pub(super) fn shared_words(t: usize) -> usize {
    2 * t + STATS
}

/// What a phase sees: its row and lane, the iteration of the loop it is in (0 outside
/// loops), the shared array, the lane's own memory, the kernel's buffers.
pub(super) struct Lane<'ctx> {
    pub(super) row: IntValue<'ctx>,
    pub(super) lane: IntValue<'ctx>,
    pub(super) iter: IntValue<'ctx>,
    pub(super) sh: PointerValue<'ctx>,
    pub(super) local: PointerValue<'ctx>,
    pub(super) ins: Vec<PointerValue<'ctx>>,
    pub(super) outs: Vec<PointerValue<'ctx>>,
}

/// A piece of a team kernel's schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Seg {
    /// Phase `p`, once.
    One(usize),
    /// These phases in order, `n` times (iterations `0..n`).
    Loop { n: usize, phases: Vec<usize> },
}

/// A team kernel's shared array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shared {
    /// The reductions' partials and statistics ([`shared_words`] f64, `nns_team_sh`).
    Stats,
    /// This many f32 words of the kernel's own (`<name>_tile_sh`): tiles of operands.
    Tile(usize),
}

/// What the GPU waits for before a phase (the host runs every lane of the previous phase
/// first either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sync {
    /// Every lane of the block (`bar.sync 0`).
    Block,
    /// The lanes of the lane's warp (`bar.warp.sync`): for a phase that reads, of what
    /// earlier phases wrote, only what its own warp wrote since the last block barrier,
    /// and whose writes nobody outside its warp reads before the next one.
    Warp,
}

/// A team kernel as its entries run it.
#[derive(Clone, Debug)]
pub(super) struct Plan {
    /// Lanes.
    pub(super) t: usize,
    /// Lanes each phase runs on (`lane < active`).
    pub(super) active: Vec<usize>,
    /// What each phase waits for on the GPU.
    pub(super) syncs: Vec<Sync>,
    /// The phases' order.
    pub(super) segs: Vec<Seg>,
    pub(super) shared: Shared,
    /// f32 words of each lane's own memory (0: none).
    pub(super) local: usize,
}

/// How partials combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Comb {
    Sum,
    Max,
}

/// The phases of one team kernel as they are built.
pub(super) struct Team<'g, 'ctx> {
    pub(super) g: &'g Gen<'ctx>,
    pub(super) k: &'g Kernel,
    pub(super) t: usize,
    /// Lanes each phase runs on (`lane < active`).
    active: Vec<usize>,
    /// What each phase waits for on the GPU.
    syncs: Vec<Sync>,
    stats: usize,
    segs: Vec<Seg>,
    /// The phases of the loop being built.
    looping: Option<Vec<usize>>,
    pub(super) shared: Shared,
    pub(super) local: usize,
}

impl<'g, 'ctx> Team<'g, 'ctx> {
    /// Phases added by `body`, run `n` times in order (a barrier between each two on the
    /// GPU, as everywhere); they see the iteration as [`Lane::iter`].
    pub(super) fn repeat(&mut self, n: usize, body: impl FnOnce(&mut Self) -> R<()>) -> R<()> {
        if self.looping.is_some() {
            return Err(format!("{}: nested team loops", self.k.name));
        }
        self.looping = Some(Vec::new());
        body(self)?;
        let phases = self.looping.take().unwrap_or_default();
        self.segs.push(Seg::Loop { n, phases });
        Ok(())
    }

    /// Adds a phase run by every lane that waits on the GPU only for its own warp
    /// ([`Sync::Warp`]: the caller's promise, which the host cannot check).
    pub(super) fn warp_phase(
        &mut self,
        body: impl FnOnce(&Gen<'ctx>, &Lane<'ctx>) -> R<()>,
    ) -> R<()> {
        self.phase(self.t, body)?;
        if let Some(s) = self.syncs.last_mut() {
            *s = Sync::Warp;
        }
        Ok(())
    }

    /// Adds a phase run by lanes `0..active`.
    pub(super) fn phase(
        &mut self,
        active: usize,
        body: impl FnOnce(&Gen<'ctx>, &Lane<'ctx>) -> R<()>,
    ) -> R<()> {
        let g = self.g;
        let i64t = g.ctx.i64_type();
        let ptr = g.ctx.ptr_type(AddressSpace::default());
        let nb = self.k.inputs.len() + self.k.outputs.len();
        let mut params: Vec<BasicMetadataTypeEnum> = vec![
            i64t.into(),
            i64t.into(),
            i64t.into(),
            ptr.into(),
            ptr.into(),
        ];
        params.extend(std::iter::repeat_n(BasicMetadataTypeEnum::from(ptr), nb));
        let f = g.module.add_function(
            &format!("{}.p{}", self.k.name, self.active.len()),
            g.ctx.void_type().fn_type(&params, false),
            Some(Linkage::Internal),
        );
        let inline = g
            .ctx
            .create_enum_attribute(Attribute::get_named_enum_kind_id("alwaysinline"), 0);
        f.add_attribute(AttributeLoc::Function, inline);
        let entry = g.ctx.append_basic_block(f, "entry");
        g.b.position_at_end(entry);
        let p = |j: usize| f.get_nth_param(j as u32).ok_or("missing phase parameter");
        let bufs: Vec<PointerValue<'ctx>> = (0..nb)
            .map(|j| p(5 + j).map(|v| v.into_pointer_value()))
            .collect::<Result<_, _>>()?;
        let all: Vec<&crate::kernel::Buf> = self.k.inputs.iter().chain(&self.k.outputs).collect();
        g.buffer_elts(&bufs, &all);
        let (ins, outs) = bufs.split_at(self.k.inputs.len());
        let l = Lane {
            row: p(0)?.into_int_value(),
            lane: p(1)?.into_int_value(),
            iter: p(2)?.into_int_value(),
            sh: p(3)?.into_pointer_value(),
            local: p(4)?.into_pointer_value(),
            ins: ins.to_vec(),
            outs: outs.to_vec(),
        };
        if active < self.t {
            let c =
                e(g.b.build_int_compare(IntPredicate::ULT, l.lane, g.i64c(active), ""))?;
            g.when(c, |g| body(g, &l))?;
        } else {
            body(g, &l)?;
        }
        e(g.b.build_return(None))?;
        let idx = self.active.len();
        self.active.push(active);
        self.syncs.push(Sync::Block);
        match &mut self.looping {
            Some(l) => l.push(idx),
            None => self.segs.push(Seg::One(idx)),
        }
        Ok(())
    }

    /// Combines `f(j)` over `j` in `0..n` (each value with its combiner) across the team:
    /// one phase of per-lane partials, then the tree; returns the statistic slots the
    /// results are in. `f` may read earlier statistics.
    fn reduce(
        &mut self,
        n: usize,
        combs: &[Comb],
        f: impl Fn(&Gen<'ctx>, &Lane<'ctx>, IntValue<'ctx>) -> R<Vec<FloatValue<'ctx>>>,
    ) -> R<Vec<usize>> {
        let t = self.t;
        if combs.len() > 2 || self.stats + combs.len() > STATS {
            return Err(format!("{}: too many team statistics", self.k.name));
        }
        self.phase(t, |g, l| {
            let accs = accumulators(g, combs)?;
            g.for_step(l.lane, g.i64c(n), t, |g, j| {
                fold(g, &accs, combs, f(g, l, j)?)
            })?;
            store_partials(g, l, &accs, t)
        })?;
        let slots: Vec<usize> = (self.stats..self.stats + combs.len()).collect();
        self.stats += combs.len();
        let mut s = t / 2;
        while s >= 1 {
            let slots = &slots;
            self.phase(s, |g, l| {
                for (a, c) in combs.iter().enumerate() {
                    let mine = g.add_i(g.i64c(a * t), l.lane)?;
                    let x = g.sh_ld(l, mine)?;
                    let y = g.sh_ld(l, g.add_i(mine, g.i64c(s))?)?;
                    let v = combine(g, *c, x, y)?;
                    let to = if s == 1 {
                        g.i64c(2 * t + slots[a])
                    } else {
                        mine
                    };
                    g.sh_st(l, to, v)?;
                }
                Ok(())
            })?;
            s /= 2;
        }
        Ok(slots)
    }

    /// `f(j)` for the elements `j` in `0..n` a lane owns (`lane, lane + t, ...`), in a
    /// phase of all lanes.
    fn each(
        &mut self,
        n: usize,
        f: impl Fn(&Gen<'ctx>, &Lane<'ctx>, IntValue<'ctx>) -> R<()>,
    ) -> R<()> {
        let t = self.t;
        self.phase(t, |g, l| {
            g.for_step(l.lane, g.i64c(n), t, |g, j| f(g, l, j))
        })
    }
}

/// Where a lane of a column-tile team works ([`Body::ColReduce`]'s mapping).
struct ColLane<'ctx> {
    /// The team's part of the rows.
    part: IntValue<'ctx>,
    /// The lane's column of the whole `[rows, cols]`.
    col: IntValue<'ctx>,
    /// Whether the column exists (the last tile may be short).
    inside: IntValue<'ctx>,
}

impl<'g, 'ctx> Team<'g, 'ctx> {
    /// A column-tile team's place: team `row` is part `row / tiles`, tile `row % tiles`;
    /// lane `l` owns column `l % COL_TILE` of the tile.
    fn col_lane(g: &Gen<'ctx>, l: &Lane<'ctx>, tiles: usize, cols: usize) -> R<ColLane<'ctx>> {
        let part = g.div_i(l.row, tiles)?;
        let tile = g.rem_i(l.row, tiles)?;
        let c = g.rem_i(l.lane, COL_TILE)?;
        let col = g.add_i(g.mul_i(tile, g.i64c(COL_TILE))?, c)?;
        let inside =
            e(g.b.build_int_compare(IntPredicate::ULT, col, g.i64c(cols), ""))?;
        Ok(ColLane { part, col, inside })
    }

    /// Column tiles' reductions over rows: in one phase of all lanes, lane `(c, grp)`
    /// combines `f(row, col)` (a value per combiner) over rows `grp, grp + COL_GROUPS, ...`
    /// of its team's part (`run` rows, the last part short) into per-lane f64 partials;
    /// then, in a phase of `COL_TILE` lanes, lane `c` combines its column's group
    /// partials in group order and calls `fin(col, totals)` where the column exists.
    #[allow(clippy::too_many_arguments)]
    fn col_reduce(
        &mut self,
        combs: &[Comb],
        tiles: usize,
        run: usize,
        rows: usize,
        cols: usize,
        f: impl Fn(&Gen<'ctx>, &Lane<'ctx>, IntValue<'ctx>, IntValue<'ctx>) -> R<Vec<FloatValue<'ctx>>>,
        fin: impl Fn(&Gen<'ctx>, &Lane<'ctx>, &ColLane<'ctx>, &[FloatValue<'ctx>]) -> R<()>,
    ) -> R<()> {
        let t = self.t;
        if t != COL_TILE * COL_GROUPS || combs.len() * t > 2 * t {
            return Err(format!("{}: not a column-tile team", self.k.name));
        }
        self.phase(t, |g, l| {
            let cl = Self::col_lane(g, l, tiles, cols)?;
            let accs = accumulators(g, combs)?;
            g.when(cl.inside, |g| {
                let grp = g.div_i(l.lane, COL_TILE)?;
                let first = g.mul_i(cl.part, g.i64c(run))?;
                let start = g.add_i(first, grp)?;
                let end = g.min_i(g.add_i(first, g.i64c(run))?, g.i64c(rows))?;
                g.for_step(start, end, COL_GROUPS, |g, r| {
                    fold(g, &accs, combs, f(g, l, r, cl.col)?)
                })
            })?;
            store_partials(g, l, &accs, t)?;
            Ok(())
        })?;
        self.phase(COL_TILE, |g, l| {
            let cl = Self::col_lane(g, l, tiles, cols)?;
            let mut totals = Vec::new();
            for (a, c) in combs.iter().enumerate() {
                let mut v = identity(g, *c);
                for grp in 0..COL_GROUPS {
                    let w = g.add_i(g.i64c(a * t + grp * COL_TILE), l.lane)?;
                    v = combine(g, *c, v, g.sh_ld(l, w)?)?;
                }
                totals.push(v);
            }
            g.when(cl.inside, |g| fin(g, l, &cl, &totals))
        })
    }
}

/// A lane's f64 accumulators, one per combiner, at its identity.
fn accumulators<'ctx>(g: &Gen<'ctx>, combs: &[Comb]) -> R<Vec<PointerValue<'ctx>>> {
    combs
        .iter()
        .map(|c| g.var(identity(g, *c).into()))
        .collect()
}

/// Combines `vals` into the accumulators, each by its combiner.
fn fold<'ctx>(
    g: &Gen<'ctx>,
    accs: &[PointerValue<'ctx>],
    combs: &[Comb],
    vals: Vec<FloatValue<'ctx>>,
) -> R<()> {
    for ((acc, c), v) in accs.iter().zip(combs).zip(vals) {
        let a = g.getf(*acc, g.ctx.f64_type())?;
        g.set(*acc, combine(g, *c, a, v)?)?;
    }
    Ok(())
}

/// Stores a lane's accumulators as its partials: accumulator `a` at shared word
/// `a * t + lane`.
fn store_partials<'ctx>(
    g: &Gen<'ctx>,
    l: &Lane<'ctx>,
    accs: &[PointerValue<'ctx>],
    t: usize,
) -> R<()> {
    for (a, acc) in accs.iter().enumerate() {
        let v = g.getf(*acc, g.ctx.f64_type())?;
        g.sh_st(l, g.add_i(g.i64c(a * t), l.lane)?, v)?;
    }
    Ok(())
}

fn identity<'ctx>(g: &Gen<'ctx>, c: Comb) -> FloatValue<'ctx> {
    match c {
        Comb::Sum => g.dconst(0.0),
        Comb::Max => g.dconst(f64::NEG_INFINITY),
    }
}

fn combine<'ctx>(
    g: &Gen<'ctx>,
    c: Comb,
    a: FloatValue<'ctx>,
    b: FloatValue<'ctx>,
) -> R<FloatValue<'ctx>> {
    match c {
        Comb::Sum => g.fadd(a, b),
        // NaN ignored, as `f32::max` (the reference's fold).
        Comb::Max => g.call(
            g.intrinsic_of("llvm.maxnum", g.ctx.f64_type().into())?,
            &[a, b],
        ),
    }
}

impl<'ctx> Gen<'ctx> {
    /// Stores f64 `v` as an f32 pair: the rounded value at `at`, what rounding left at
    /// `at + stride` (their sum within about 2^-48 of `v`).
    fn st_pair(
        &self,
        out: PointerValue<'ctx>,
        at: IntValue<'ctx>,
        stride: usize,
        v: FloatValue<'ctx>,
    ) -> R<()> {
        let hi = self.trunc(v)?;
        let lo = self.trunc(self.fsub(v, self.ext(hi)?)?)?;
        // An infinite value leaves inf - inf: its remainder is 0.
        let nan = e(self
            .b
            .build_float_compare(inkwell::FloatPredicate::UNO, lo, lo, ""))?;
        let lo = e(self.b.build_select(nan, self.fconst(0.0), lo, ""))?.into_float_value();
        self.stf(out, at, hi)?;
        self.stf(out, self.add_i(at, self.i64c(stride))?, lo)
    }

    /// A column-tile team's result for its column: the value (one part) or the part's
    /// pair in `[parts, 2, cols]`.
    fn st_part(
        &self,
        out: PointerValue<'ctx>,
        cl: &ColLane<'ctx>,
        cols: usize,
        parts: usize,
        v: FloatValue<'ctx>,
    ) -> R<()> {
        if parts == 1 {
            return self.stf(out, cl.col, self.trunc(v)?);
        }
        let at = self.add_i(self.mul_i(cl.part, self.i64c(2 * cols))?, cl.col)?;
        self.st_pair(out, at, cols, v)
    }

    fn sh_at(&self, l: &Lane<'ctx>, w: IntValue<'ctx>) -> R<PointerValue<'ctx>> {
        // SAFETY of the generated code: every word index is below `shared_words(t)`.
        e(unsafe {
            self.b
                .build_in_bounds_gep(self.ctx.f64_type(), l.sh, &[w], "")
        })
    }
    fn sh_ld(&self, l: &Lane<'ctx>, w: IntValue<'ctx>) -> R<FloatValue<'ctx>> {
        self.getf(self.sh_at(l, w)?, self.ctx.f64_type())
    }
    fn sh_st(&self, l: &Lane<'ctx>, w: IntValue<'ctx>, v: FloatValue<'ctx>) -> R<()> {
        self.set(self.sh_at(l, w)?, v)
    }
    /// Statistic `s` of a team of `t`.
    fn stat(&self, l: &Lane<'ctx>, t: usize, s: usize) -> R<FloatValue<'ctx>> {
        self.sh_ld(l, self.i64c(2 * t + s))
    }
    /// Statistic `s` rounded to f32.
    fn stat32(&self, l: &Lane<'ctx>, t: usize, s: usize) -> R<FloatValue<'ctx>> {
        self.trunc(self.stat(l, t, s)?)
    }

    /// A row's layer-norm (`mean`, `1/sqrt(var + eps)`) or RMS-norm (`0`,
    /// `1/sqrt(mean(x^2) + eps)`) statistics from the slots [`Team::reduce`] left.
    fn team_moments(
        &self,
        l: &Lane<'ctx>,
        t: usize,
        slots: &[usize],
        h: usize,
        eps: f64,
    ) -> R<(FloatValue<'ctx>, FloatValue<'ctx>)> {
        let hd = self.dconst(h as f64);
        let (mean, sq) = match slots {
            [sq] => (self.dconst(0.0), *sq),
            [m, sq] => (self.fdiv(self.stat(l, t, *m)?, hd)?, *sq),
            _ => return Err("norm statistics without their slots".into()),
        };
        let var = self.fdiv(self.stat(l, t, sq)?, hd)?;
        let r = self.fdiv(
            self.dconst(1.0),
            self.sqrt_d(self.fadd(var, self.dconst(eps))?)?,
        )?;
        Ok((self.trunc(mean)?, self.trunc(r)?))
    }

    /// The reductions of a norm's row (`x` input `xi`, at `base(row)`): the mean (layer
    /// norm), then the squared deviations, as the reference's two passes.
    fn norm_reductions(
        &self,
        tm: &mut Team<'_, 'ctx>,
        xi: usize,
        h: usize,
        rms: bool,
    ) -> R<Vec<usize>> {
        let x_at = move |g: &Gen<'ctx>, l: &Lane<'ctx>, j: IntValue<'ctx>| {
            g.ext(g.ldf(l.ins[xi], g.add_i(g.mul_i(l.row, g.i64c(h))?, j)?)?)
        };
        let t = tm.t;
        let mut slots = Vec::new();
        if !rms {
            slots.extend(tm.reduce(h, &[Comb::Sum], |g, l, j| Ok(vec![x_at(g, l, j)?]))?);
        }
        let m = slots.first().copied();
        slots.extend(tm.reduce(h, &[Comb::Sum], |g, l, j| {
            let mean = match m {
                Some(m) => g.fdiv(g.stat(l, t, m)?, g.dconst(h as f64))?,
                None => g.dconst(0.0),
            };
            let v = g.fsub(x_at(g, l, j)?, mean)?;
            Ok(vec![g.fmul(v, v)?])
        })?);
        Ok(slots)
    }

    /// The phases of a team kernel; records them for the entries.
    pub(super) fn team_kernel(&self, k: &Kernel) -> R<()> {
        let t = k.team();
        let mut tm = Team {
            g: self,
            k,
            t,
            active: Vec::new(),
            syncs: Vec::new(),
            stats: 0,
            segs: Vec::new(),
            looping: None,
            shared: Shared::Stats,
            local: 0,
        };
        match &k.body {
            Body::AttnTiles(a) => self.attn_tiles(&mut tm, a)?,
            Body::AttnTilesBack(a) => self.attn_tiles_back(&mut tm, a)?,
            Body::AttnTilesKv(a) => self.attn_tiles_kv(&mut tm, a)?,
            Body::AttnMma(a) => self.attn_mma(&mut tm, a)?,
            Body::AttnMmaBack(a) => self.attn_mma_dq(&mut tm, a)?,
            Body::AttnMmaKv(a) => self.attn_mma_kv(&mut tm, a)?,
            Body::Reduce { op, dims } => self.team_reduce(&mut tm, op, dims)?,
            Body::ReducePart { op, dims, parts } => {
                self.team_reduce_part(&mut tm, op, dims, parts)?
            }
            Body::ColReduce {
                op,
                rows,
                cols,
                parts,
                pairs,
            } => self.team_col_reduce(&mut tm, op, rows, cols, parts, pairs)?,
            Body::NormGradColTiles { rms, parts } => {
                self.team_norm_grad_col_tiles(&mut tm, rms, parts)?
            }
            Body::Lines { op, dim } => self.team_lines(&mut tm, op, dim)?,
            Body::Norm { rms, eps } => self.team_norm(&mut tm, rms, eps)?,
            Body::NormGradRows { rms, eps } => self.team_norm_grad_rows(&mut tm, rms, eps)?,
            Body::XentRows => self.team_xent_rows(&mut tm)?,
            Body::EmbeddingGradRows { parts } => self.team_embedding_grad_rows(&mut tm, parts)?,
            Body::MeanOf { count } => self.team_mean_of(&mut tm, count)?,
            Body::XentGrad { count } => self.team_xent_grad(&mut tm, count)?,
            Body::XentGradLse { count, sharded } => {
                self.team_xent_grad_lse(&mut tm, count, sharded)?
            }
            _ => return Err(format!("kernel {} has no team form", k.name)),
        }
        let plan = Plan {
            t,
            active: tm.active,
            syncs: tm.syncs,
            segs: tm.segs,
            shared: tm.shared,
            local: tm.local,
        };
        self.teams.borrow_mut().insert(k.name.clone(), plan);
        Ok(())
    }

    /// A row's maximum and its sum of `exp(z - max)` (f32 exponentials summed in f64),
    /// the log-sum-exp's reductions.
    fn lse_reductions(
        &self,
        tm: &mut Team<'_, 'ctx>,
        v: usize,
        z: impl Fn(&Gen<'ctx>, &Lane<'ctx>, IntValue<'ctx>) -> R<FloatValue<'ctx>> + Copy,
    ) -> R<(usize, usize)> {
        let t = tm.t;
        let mx = tm.reduce(v, &[Comb::Max], |g, l, j| Ok(vec![g.ext(z(g, l, j)?)?]))?[0];
        let sum = tm.reduce(v, &[Comb::Sum], |g, l, j| {
            let m = g.stat32(l, t, mx)?;
            Ok(vec![
                g.ext(g.call(g.exp_fn()?, &[g.fsub(z(g, l, j)?, m)?])?)?
            ])
        })?[0];
        Ok((mx, sum))
    }
}

impl<'ctx> Gen<'ctx> {
    /// A phase of team kernel `name`.
    fn phase_fn(&self, name: &str, p: usize) -> R<inkwell::values::FunctionValue<'ctx>> {
        self.module
            .get_function(&format!("{name}.p{p}"))
            .ok_or_else(|| format!("no phase {p} for kernel {name}"))
    }

    /// A shared (address space 3) array of `n` elements of `ty`, created once by name.
    fn shared_array(
        &self,
        name: &str,
        ty: inkwell::types::FloatType<'ctx>,
        n: usize,
    ) -> inkwell::values::GlobalValue<'ctx> {
        self.module.get_global(name).unwrap_or_else(|| {
            let ty = ty.array_type(n as u32);
            let g = self
                .module
                .add_global(ty, Some(AddressSpace::from(3u16)), name);
            g.set_linkage(Linkage::Internal);
            g.set_initializer(&ty.get_undef());
            g.set_alignment(16);
            g
        })
    }

    /// Calls the phases of `plan` in its order for one lane (`call(p, iter)`), with
    /// `between(p)` before every call but the first (the GPU's barrier; nothing on the
    /// host, where `call` runs the phase for every lane in turn).
    fn run_segs(
        &self,
        plan: &Plan,
        mut between: impl FnMut(&Self, usize) -> R<()>,
        mut call: impl FnMut(&Self, usize, IntValue<'ctx>) -> R<()>,
    ) -> R<()> {
        let mut first = true;
        for seg in &plan.segs {
            match seg {
                Seg::One(p) => {
                    if !first {
                        between(self, *p)?;
                    }
                    first = false;
                    call(self, *p, self.i64c(0))?;
                }
                Seg::Loop { n, phases } => {
                    // A barrier before every call in a loop (one too many before the first
                    // phase of a kernel that starts with a loop: harmless).
                    self.for_range(self.i64c(*n), |g, it| {
                        for &p in phases {
                            between(g, p)?;
                            call(g, p, it)?;
                        }
                        Ok(())
                    })?;
                    first = false;
                }
            }
        }
        Ok(())
    }

    /// The PTX entry of a team kernel: block `ctaid.x` computes row `ctaid.x` (blocks at
    /// or past `n` do nothing, every thread of them alike), thread `tid.x` is its lane;
    /// the phases in order, a barrier between each two. A lane's own memory is an array in
    /// the entry (local memory).
    pub(super) fn team_ptx_entry(&self, name: &str, buffers: usize, plan: &Plan) -> R<()> {
        let i64t = self.ctx.i64_type();
        let global = self.ctx.ptr_type(AddressSpace::from(1u16));
        let generic = self.ctx.ptr_type(AddressSpace::default());
        let mut params: Vec<BasicMetadataTypeEnum> = vec![global.into(); buffers];
        params.push(i64t.into());
        let f = self
            .module
            .add_function(name, self.ctx.void_type().fn_type(&params, false), None);
        f.set_call_conventions(71); // ptx_kernel
        let sh = match plan.shared {
            Shared::Stats => self.shared_array(
                "nns_team_sh",
                self.ctx.f64_type(),
                shared_words(crate::kernel::TEAM_MAX),
            ),
            Shared::Tile(w) => {
                self.shared_array(&format!("{name}_tile_sh"), self.ctx.f32_type(), w)
            }
        };
        let entry = self.ctx.append_basic_block(f, "entry");
        let run = self.ctx.append_basic_block(f, "run");
        let done = self.ctx.append_basic_block(f, "done");
        self.b.position_at_end(entry);
        let (row, lane) = (self.sreg("ctaid.x")?, self.sreg("tid.x")?);
        let n = f
            .get_nth_param(buffers as u32)
            .ok_or("no length")?
            .into_int_value();
        let n = self.clamped(name, n)?;
        let inside = e(self.b.build_int_compare(IntPredicate::ULT, row, n, ""))?;
        e(self.b.build_conditional_branch(inside, run, done))?;
        self.b.position_at_end(run);
        let shp = e(self
            .b
            .build_address_space_cast(sh.as_pointer_value(), generic, ""))?;
        let local = match plan.local {
            0 => generic.const_null(),
            w => self.entry_alloca(self.ctx.f32_type().array_type(w as u32).into())?,
        };
        let mut bufs: Vec<inkwell::values::BasicMetadataValueEnum> = Vec::new();
        for j in 0..buffers {
            let p = f
                .get_nth_param(j as u32)
                .ok_or("missing buffer")?
                .into_pointer_value();
            bufs.push(e(self.b.build_address_space_cast(p, generic, ""))?.into());
        }
        let barrier = self.intrinsic_fixed("llvm.nvvm.barrier0")?;
        let warp = self.intrinsic_fixed("llvm.nvvm.bar.warp.sync")?;
        let all = self.ctx.i32_type().const_all_ones();
        self.run_segs(
            plan,
            |g, p| {
                let call = match plan.syncs[p] {
                    Sync::Block => g.b.build_call(barrier, &[], ""),
                    Sync::Warp => g.b.build_call(warp, &[all.into()], ""),
                };
                e(call).map(|_| ())
            },
            |g, p, it| {
                let mut args: Vec<inkwell::values::BasicMetadataValueEnum> =
                    vec![row.into(), lane.into(), it.into(), shp.into(), local.into()];
                args.extend(bufs.iter().copied());
                e(g.b.build_call(g.phase_fn(name, p)?, &args, "")).map(|_| ())
            },
        )?;
        e(self.b.build_unconditional_branch(done))?;
        self.b.position_at_end(done);
        e(self.b.build_return(None))?;
        Ok(())
    }

    /// The host entry of a team kernel `name.host(ptr args, i64 n)`: for every row below
    /// `n`, each phase run by its lanes in turn (a loop where the GPU has a barrier). The
    /// lanes' own memories are one `malloc`ed block, freed at the end.
    pub(super) fn team_host_entry(&self, name: &str, buffers: usize, plan: &Plan) -> R<()> {
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
        self.b.position_at_end(entry);
        let argv = f.get_nth_param(0).ok_or("no args")?.into_pointer_value();
        let n = f.get_nth_param(1).ok_or("no length")?.into_int_value();
        let n = self.clamped(name, n)?;
        let sh = match plan.shared {
            Shared::Stats => self.entry_alloca(
                self.ctx
                    .f64_type()
                    .array_type(shared_words(plan.t) as u32)
                    .into(),
            )?,
            Shared::Tile(w) => {
                // 16-byte aligned, as the GPU's shared array: tiles read rows 4 words at a
                // time.
                let a = self.entry_alloca(self.ctx.f32_type().array_type(w as u32).into())?;
                e(a.as_instruction()
                    .ok_or("an alloca that is no instruction")?
                    .set_alignment(16))?;
                a
            }
        };
        let heap = |g: &Self, sym: &str, ty: inkwell::types::FunctionType<'ctx>| {
            g.module
                .get_function(sym)
                .unwrap_or_else(|| g.module.add_function(sym, ty, None))
        };
        let local = match plan.local {
            0 => None,
            w => {
                let malloc = heap(self, "malloc", ptr.fn_type(&[i64t.into()], false));
                let bytes = self.i64c(plan.t * w * 4);
                let m = e(self.b.build_call(malloc, &[bytes.into()], ""))?
                    .try_as_basic_value()
                    .basic()
                    .ok_or("malloc returned nothing")?
                    .into_pointer_value();
                Some(m)
            }
        };
        let mut bufs = Vec::new();
        for j in 0..buffers {
            // SAFETY of the generated code: `args` holds `buffers` pointers.
            let slot = e(unsafe { self.b.build_in_bounds_gep(ptr, argv, &[self.i64c(j)], "") })?;
            bufs.push(e(self.b.build_load(ptr, slot, ""))?);
        }
        self.for_range(n, |g, row| {
            g.run_segs(
                plan,
                |_, _| Ok(()),
                |g, p, it| {
                    let phase = g.phase_fn(name, p)?;
                    g.for_range(g.i64c(plan.active[p]), |g, lane| {
                        let mine = match local {
                            None => ptr.const_null(),
                            Some(m) => {
                                let at = g.mul_i(lane, g.i64c(plan.local))?;
                                // SAFETY of the generated code: lane < t, and the block
                                // holds t lanes' words.
                                e(unsafe {
                                    g.b.build_in_bounds_gep(g.ctx.f32_type(), m, &[at], "")
                                })?
                            }
                        };
                        let mut args: Vec<inkwell::values::BasicMetadataValueEnum> =
                            vec![row.into(), lane.into(), it.into(), sh.into(), mine.into()];
                        args.extend(
                            bufs.iter()
                                .map(|&b| inkwell::values::BasicMetadataValueEnum::from(b)),
                        );
                        e(g.b.build_call(phase, &args, "")).map(|_| ())
                    })
                },
            )
        })?;
        if let Some(m) = local {
            let free = heap(
                self,
                "free",
                self.ctx.void_type().fn_type(&[ptr.into()], false),
            );
            e(self.b.build_call(free, &[m.into()], ""))?;
        }
        e(self.b.build_return(None))?;
        Ok(())
    }
}
