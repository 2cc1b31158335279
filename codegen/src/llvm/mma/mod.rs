//! Attention's forward on tensor cores ([`crate::kernel::Body::AttnMma`]): bf16 operands,
//! FlashAttention-2 with its two products as warp-wide `mma.sync.m16n8k16` (bf16 in, f32
//! sums); and the backward's two kernels the same way.
//!
//! A block is a tile of [`MMA_ROWS`] query rows of one head, four warps of 16 rows. It
//! stages its queries in shared memory once; then, a key tile at a time (64 keys, else 32
//! or 16, the first whose tiles fit: [`crate::kernel::Attn::mma_keys`]), it stages the
//! keys and the values (rows as stored, 16 bytes a lane: [`COPY16`]), and each warp
//! 1. takes `S = Q K^T` for its 16 rows as `keys / 8` products of 16 x 8 (each `d / 16`
//!    steps of k), the scores scaled and masked (causal, past the keys) in the products'
//!    f32 fragments, and writes each of its rows' partial maxima (a row's 16 x 8 fragment
//!    elements lie with four lanes) to the exchange words;
//! 2. folds the tile into the online softmax: the row's new maximum from its four lanes'
//!    partials (in one order, so the four agree), `exp(m_old - m_new)` rescaling the
//!    lane's partial sum and its output fragments, `P = exp(S - m_new)` rounded to bf16
//!    (the lane's sum adds the rounded values) and kept as bf16 pairs in the lane's words:
//!    the scores' 16 x 8 result fragments, two side by side, are the next product's A
//!    fragment as they lie ([`a_reg_of`]);
//! 3. adds `P V` to its output fragments: `e / 8` products, `keys / 16` steps each, `A`
//!    from the registers ([`MMA_RA`]).
//!
//! f32 operands take the same kernels ([`crate::kernel::Attn::tf32x3`]) with f32 tiles
//! (twice the halves a row) and each product as three TF32 products
//! ([`MMA_TF32`], [`MMA_TF32_RA`]: `A_lo B_hi + A_hi B_lo + A_hi B_hi`, the parts rounded
//! by `cvt.rna.tf32.f32`), k-steps of 8; `P` (and the backward's `dS`, `P^T`, `dS^T`)
//! kept in f32, its TF32 fragment's columns standing for permuted keys
//! ([`tf32_reg_of`]).
//!
//! Steps 2 and 3 wait for their warp only ([`super::team::Sync::Warp`]): a key tile
//! costs two block barriers (its staging, and the scores that read what every lane
//! staged), not four. Where two buffers of key and value tiles fit
//! ([`crate::kernel::MmaTiles::buffers`], [`crate::kernel::Attn::double`]), a tile costs
//! one: the phase of tile `i`'s scores first issues tile `i + 1`'s copy into the other
//! buffer ([`COPY16_ASYNC`], `cp.async`), which lands while the warps take tile `i`'s
//! products; step 3 ends waiting for the lane's copies ([`ASYNC_WAIT`]), and the barrier
//! before the next scores makes every lane's copy visible to all and every warp done
//! with tile `i - 1`, whose buffer the copy of `i + 1` reuses. The host, whose copies
//! land before the call returns, gives the single buffer's bits (a copy into the buffer
//! being read, or products reading the other, would change them). The backward's
//! kernels keep `dS` (and `P^T`, `dS^T`) in registers the same way.
//!
//! At the end a row's four partial sums meet through the exchange words (in lane order)
//! and each lane stores its output elements times `1 / l`, and the statistics `[m, 1/l]`
//! where the backward takes them ([`crate::kernel::Attn::saved`]). A causal block skips
//! the key tiles past its last query, as [`super::tiles`] does.
//!
//! Every value passes between lanes through shared memory between phases, as in every
//! team kernel ([`super::team`]), except inside the product, which is the one warp-wide
//! operation (its register form reads `A` from the warp's lanes' words): `nns.mma.bf16(sh,
//! a_base, a_pitch, b_base, b_pitch, lane, c0..c3)` takes its operand tiles from shared
//! memory (`A[m][k]` at `a_base + m * a_pitch + k`; `B[k][n]` at `b_base + n * b_pitch +
//! k`, or at `b_base + k * b_pitch + n` for `nns.mma.bf16.kn`: [`BLay`]) and the lane's
//! accumulator fragment. Its body is the
//! target's ([`Gen::define_warp_ops`]): on the GPU each lane gives `ldmatrix` the address
//! of one row ([`ldm_a_row`], [`ldm_b_row`]), which loads the warp's A fragments (`.x4`)
//! and B fragments (`.x2`, `.trans` for `[k][n]` tiles) from the rows all the lanes gave,
//! and `mma.sync` multiplies them; on the host each of the four result elements is a sum
//! over k in 16 steps whose operands are read from the registers `ldmatrix` would give
//! *the lanes holding them* (the same row functions, called with the lanes whose rows
//! form that register's matrix) by the PTX ISA's fragment layouts. So the host tests the
//! rows each lane addresses, `ldmatrix`'s matrices and the fragment layouts the GPU
//! relies on, not a shortcut around them.

mod backward;
mod forward;
mod warp_ops;

use super::team::{Lane, Shared, Team};
use super::{e, Gen, R};
use crate::kernel::{Attn, Elt, MmaBack, MmaTiles, MMA_LANES, MMA_ROWS};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::module::Linkage;
use inkwell::types::{BasicMetadataTypeEnum, StructType};
use inkwell::values::{
    BasicMetadataValueEnum, BasicValue, FloatValue, FunctionValue, IntValue, PointerValue,
    StructValue,
};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};

/// The warp-wide product's symbol, `B` stored `[n][k]` ([`BLay::Nk`]).
const MMA: &str = "nns.mma.bf16";
/// The same product with `B` stored `[k][n]` ([`BLay::Kn`]).
const MMA_KN: &str = "nns.mma.bf16.kn";
/// The product with `A` in registers, `B` stored `[k][n]` in shared memory: each lane's
/// four A-fragment words in its own memory ([`Gen::mma_regs`]).
const MMA_RA: &str = "nns.mma.bf16.ra";
/// An f32 product on tensor cores as three TF32 products (`m16n8k8`: `a_lo b_hi + a_hi
/// b_lo + a_hi b_hi`), `A` and `B` (stored `[n][k]`) in shared memory as f32.
const MMA_TF32: &str = "nns.mma.tf32x3";
/// The same with `A` in the lanes' words (f32, [`tf32_reg_of`]) and `B` the value rows of
/// the keys `A`'s columns stand for ([`tf32_key_of`]), f32 in shared memory.
const MMA_TF32_RA: &str = "nns.mma.tf32x3.ra";
/// A lane's 16-byte copy of eight halves (bf16s, or four f32s) from a buffer to the shared
/// array (or zeros).
const COPY16: &str = "nns.copy16";
/// The same copy asynchronous on the GPU (`cp.async`, 16 bytes, zeros where it keeps
/// nothing): the shared array's words are the copy's only after [`ASYNC_WAIT`] and a
/// barrier. On the host a plain copy, done before the call returns.
const COPY16_ASYNC: &str = "nns.copy16.async";
/// Waits for the lane's asynchronous copies (`cp.async.wait_all`; nothing on the host).
const ASYNC_WAIT: &str = "nns.async.wait";

/// The A-fragment register (0..4) of a TF32 k-step (the 8 keys of tile `j`) that holds
/// element `i` of a lane's `C` fragment of that tile. A TF32 `A` fragment holds columns
/// `t` and `t + 4` (PTX ISA, `m16n8k8`, `.tf32`: `a0` row g column t, `a1` row g + 8,
/// `a2`, `a3` column t + 4), where `C` holds columns `2t`, `2t + 1`; a sum over k may take
/// its terms in any order, so column `t` stands for key `2t` and `t + 4` for `2t + 1`
/// ([`tf32_key_of`]), and `c0, c1, c2, c3` are `a0, a2, a1, a3` as they lie.
fn tf32_reg_of(i: usize) -> usize {
    (i >> 1) + 2 * (i & 1)
}

/// The key (0..8 in its tile) column `k` of a TF32 `P` fragment stands for
/// ([`tf32_reg_of`]): `2 (k % 4) + k / 4`.
fn tf32_key_of<'ctx>(gen: &Gen<'ctx>, k: IntValue<'ctx>) -> R<IntValue<'ctx>> {
    gen.add_i(gen.mul_i(gen.rem_i(k, 4)?, gen.i64c(2))?, gen.div_i(k, 4)?)
}

/// The A-fragment register (0..4) of k-step `j / 2` that holds the pair a lane's `C`
/// fragment of tile `j` (8 columns) has in half `h` (0: row `g`, 1: row `g + 8`): a
/// product's 16 x 8 results, two tiles side by side, are the next product's 16 x 16 `A`
/// fragment as they lie (PTX ISA: `c0, c1` row g, columns `2t, 2t + 1`; `a0, a1` row g,
/// columns `2t, 2t + 1`; `a2, a3` row g + 8; `a4..a7` the same 8 columns on).
fn a_reg_of(j: usize, h: usize) -> usize {
    4 * (j / 2) + 2 * (j % 2) + h
}

/// How a product's `B` tile lies in shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BLay {
    /// `B[k][n]` at `base + n * pitch + k`: rows of `n` (keys as the scores' `B`).
    Nk,
    /// `B[k][n]` at `base + k * pitch + n`: rows of `k` (values as `P V`'s `B`), read
    /// transposed by `ldmatrix.trans`.
    Kn,
}

impl BLay {
    /// The offset of the tile `j` columns of 8 on and `s` steps of 16 down from a tile's
    /// start.
    fn offset(self, pitch: usize, j: usize, s: usize) -> usize {
        match self {
            BLay::Nk => 8 * j * pitch + 16 * s,
            BLay::Kn => 8 * j + 16 * s * pitch,
        }
    }

    fn symbol(self) -> &'static str {
        match self {
            BLay::Nk => MMA,
            BLay::Kn => MMA_KN,
        }
    }
}

/// Where a lane of a tensor-core block is: its warp's first row in the block, its
/// fragment coordinates (`g` = lane in warp / 4, `t` = lane in warp % 4), and the block's
/// geometry.
struct MmaLane<'ctx> {
    /// Lane within its warp (0..32).
    wl: IntValue<'ctx>,
    /// The warp's first row in the block (warp * 16).
    w16: IntValue<'ctx>,
    g: IntValue<'ctx>,
    t: IntValue<'ctx>,
    /// The block's first query position (in its head).
    q0: IntValue<'ctx>,
    /// The flat query row of position `q0` (batch, head, position).
    qrow0: IntValue<'ctx>,
    /// The first key/value row of the block's key/value head.
    kv_base: IntValue<'ctx>,
    /// The query positions' offset (context parallelism; else 0).
    off: IntValue<'ctx>,
    /// Keys some row of the block sees: `0..need`.
    need: IntValue<'ctx>,
}

/// The row lane `i` (0..32) of a warp addresses for `ldmatrix.x4` of a row-major 16 x 16
/// `A` tile: lanes 0-7 rows 0-7 and lanes 8-15 rows 8-15 of columns 0-7, lanes 16-31 the
/// same rows of columns 8-15. The four 8 x 8 matrices so loaded are the A fragment's
/// registers in the PTX ISA's order (`mma.m16n8k16`, `.bf16`: register `r` of lane `(g,
/// t)` holds row `g + 8 (r & 1)`, columns `2 t + 8 (r >> 1)` and one on).
fn ldm_a_row<'ctx>(
    gen: &Gen<'ctx>,
    (base, pitch): (IntValue<'ctx>, IntValue<'ctx>),
    i: IntValue<'ctx>,
) -> R<IntValue<'ctx>> {
    let row = gen.rem_i(i, 16)?;
    let col = gen.mul_i(gen.div_i(i, 16)?, gen.i64c(8))?;
    gen.add_i(gen.add_i(base, gen.mul_i(row, pitch)?)?, col)
}

/// The row lane `i` (0..16 matter) addresses for `ldmatrix.x2` of a 16 x 8 `B` tile: as
/// [`BLay::Nk`], lanes 0-7 the rows `n` 0-7 at `k` 0-7 and lanes 8-15 the same rows at `k`
/// 8-15 (loaded plain); as [`BLay::Kn`], lane `i` row `k = i` (loaded `.trans`). Either
/// way register `r` of lane `(g, t)` holds `B[8 r + 2 t][g]` and `B[8 r + 2 t + 1][g]`,
/// the B fragment.
fn ldm_b_row<'ctx>(
    gen: &Gen<'ctx>,
    (base, pitch): (IntValue<'ctx>, IntValue<'ctx>),
    i: IntValue<'ctx>,
    lay: BLay,
) -> R<IntValue<'ctx>> {
    let i = gen.rem_i(i, 16)?;
    let (row, col) = match lay {
        BLay::Nk => (gen.rem_i(i, 8)?, gen.mul_i(gen.div_i(i, 8)?, gen.i64c(8))?),
        BLay::Kn => (i, gen.i64c(0)),
    };
    gen.add_i(gen.add_i(base, gen.mul_i(row, pitch)?)?, col)
}

impl<'ctx> Gen<'ctx> {
    /// The address of 2-byte half `i` of the shared array (or of a buffer).
    fn sh16(&self, sh: PointerValue<'ctx>, i: IntValue<'ctx>) -> R<PointerValue<'ctx>> {
        // SAFETY of the generated code: every index is inside the kernel's shared array
        // (the layout of `MmaTiles`), or inside the buffer a tile is staged from.
        e(unsafe {
            self.b
                .build_in_bounds_gep(self.ctx.i16_type(), sh, &[i], "")
        })
    }

    /// The 32-bit word (two bf16s, the first in the low half) at bf16 element `i` (even)
    /// of the shared array.
    fn sh_pair(&self, sh: PointerValue<'ctx>, i: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        let v = e(self
            .b
            .build_load(self.ctx.i32_type(), self.sh16(sh, i)?, ""))?;
        e(v.as_instruction_value()
            .ok_or("a load that is no instruction")?
            .set_alignment(4))?;
        Ok(v.into_int_value())
    }

    /// The bf16 at element `i` of the shared array, zero-extended to an i32.
    fn sh_half(&self, sh: PointerValue<'ctx>, i: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        let v = e(self
            .b
            .build_load(self.ctx.i16_type(), self.sh16(sh, i)?, ""))?
        .into_int_value();
        e(self.b.build_int_z_extend(v, self.ctx.i32_type(), ""))
    }

    /// Half `h` (0: low) of a bf16 pair, as f32 (exact).
    fn pair_half(&self, w: IntValue<'ctx>, h: usize) -> R<FloatValue<'ctx>> {
        let i32t = self.ctx.i32_type();
        let bits = if h == 0 {
            e(self.b.build_left_shift(w, i32t.const_int(16, false), ""))?
        } else {
            e(self.b.build_and(w, i32t.const_int(0xffff_0000, false), ""))?
        };
        Ok(e(self.b.build_bit_cast(bits, self.ctx.f32_type(), ""))?.into_float_value())
    }

    /// The bf16 bits of `x` (rounded to nearest even) in the low 16 bits of an i32.
    fn bf16_bits(&self, x: FloatValue<'ctx>) -> R<IntValue<'ctx>> {
        let i32t = self.ctx.i32_type();
        let r = self.call(self.round_bf16_fn()?, &[x])?;
        let bits = e(self.b.build_bit_cast(r, i32t, ""))?.into_int_value();
        e(self
            .b
            .build_right_shift(bits, i32t.const_int(16, false), false, ""))
    }

    fn mma_ret(&self) -> StructType<'ctx> {
        let f = self.ctx.f32_type();
        self.ctx
            .struct_type(&[f.into(), f.into(), f.into(), f.into()], false)
    }

    /// A warp-wide product's function, declared (its body is the target's:
    /// [`Gen::define_warp_ops`]): `sh, a_base, a_pitch, b_base, b_pitch, lane, c0..c3`, or
    /// with `regs` (`A` in the lanes' words) `local, a_word, words, sh, b_base, b_pitch,
    /// lane, c0..c3`.
    fn product_fn(&self, name: &str, regs: bool) -> FunctionValue<'ctx> {
        self.module.get_function(name).unwrap_or_else(|| {
            let i64t = self.ctx.i64_type();
            let f32t = self.ctx.f32_type();
            let ptr = self.ctx.ptr_type(AddressSpace::default());
            let mut params: Vec<BasicMetadataTypeEnum> = if regs {
                vec![ptr.into(), i64t.into(), i64t.into(), ptr.into()]
            } else {
                vec![ptr.into(), i64t.into(), i64t.into()]
            };
            params.extend([BasicMetadataTypeEnum::from(i64t); 3]);
            params.extend([BasicMetadataTypeEnum::from(f32t); 4]);
            self.module
                .add_function(name, self.mma_ret().fn_type(&params, false), None)
        })
    }

    /// Calls product `name` on `args` and the accumulator `c`: the four results.
    fn call_product(
        &self,
        (name, regs): (&str, bool),
        mut args: Vec<BasicMetadataValueEnum<'ctx>>,
        c: [FloatValue<'ctx>; 4],
    ) -> R<[FloatValue<'ctx>; 4]> {
        args.extend(c.iter().map(|&x| BasicMetadataValueEnum::from(x)));
        let r = e(self.b.build_call(self.product_fn(name, regs), &args, ""))?
            .try_as_basic_value()
            .basic()
            .ok_or("the product returned nothing")?
            .into_struct_value();
        self.unpack4(r)
    }

    /// `c + A B` with the lane's A fragment in words `a_word..a_word + 4` of its own
    /// memory (`words` the lane's words in all, which the host needs to find the other
    /// lanes') and `B` in shared memory at `b`: [`MMA_RA`] (bf16 pairs, [`a_reg_of`]; `B`
    /// stored `[k][n]`) or [`MMA_TF32_RA`] (f32 words, [`tf32_reg_of`]; `B` the value rows
    /// of the keys `A`'s columns stand for).
    fn mma_regs(
        &self,
        name: &str,
        l: &Lane<'ctx>,
        (a_word, words): (usize, usize),
        (b, bp): (IntValue<'ctx>, usize),
        wl: IntValue<'ctx>,
        c: [FloatValue<'ctx>; 4],
    ) -> R<[FloatValue<'ctx>; 4]> {
        let args: Vec<BasicMetadataValueEnum> = vec![
            l.local.into(),
            self.i64c(a_word).into(),
            self.i64c(words).into(),
            l.sh.into(),
            b.into(),
            self.i64c(bp).into(),
            wl.into(),
        ];
        self.call_product((name, true), args, c)
    }

    /// Word `w` of a lane's own memory set to the bits of `v` (an i32: a bf16 pair).
    fn lput_bits(&self, l: &Lane<'ctx>, w: usize, v: IntValue<'ctx>) -> R<()> {
        self.set(self.local_at(l, w)?, v)
    }

    /// The bf16 pair of `x` (low half) and `y`, each rounded to nearest even, as an i32.
    fn bf16_pair(&self, x: FloatValue<'ctx>, y: FloatValue<'ctx>) -> R<IntValue<'ctx>> {
        let hi = e(self.b.build_left_shift(
            self.bf16_bits(y)?,
            self.ctx.i32_type().const_int(16, false),
            "",
        ))?;
        e(self.b.build_or(self.bf16_bits(x)?, hi, ""))
    }

    /// The 16-byte copy's function ([`COPY16`]: `src`, `dst`, `keep`), declared.
    fn copy16_fn(&self) -> FunctionValue<'ctx> {
        self.copy_fn(COPY16)
    }

    /// The 16-byte copy `name` ([`COPY16`], [`COPY16_ASYNC`]: `src`, `dst`, `keep`),
    /// declared.
    fn copy_fn(&self, name: &str) -> FunctionValue<'ctx> {
        self.module.get_function(name).unwrap_or_else(|| {
            let ptr = self.ctx.ptr_type(AddressSpace::default());
            let ty = self.ctx.void_type().fn_type(
                &[ptr.into(), ptr.into(), self.ctx.bool_type().into()],
                false,
            );
            self.module.add_function(name, ty, None)
        })
    }

    /// Waits for the lane's asynchronous copies ([`ASYNC_WAIT`]).
    fn async_wait(&self) -> R<()> {
        let f = self.module.get_function(ASYNC_WAIT).unwrap_or_else(|| {
            let ty = self.ctx.void_type().fn_type(&[], false);
            self.module.add_function(ASYNC_WAIT, ty, None)
        });
        e(self.b.build_call(f, &[], "")).map(|_| ())
    }

    /// `c + A B` for one m16n8k16 tile pair in shared memory ([`MMA`], [`MMA_KN`]): the
    /// lane's four accumulator elements in, the four results out.
    fn mma(
        &self,
        sh: PointerValue<'ctx>,
        a: (IntValue<'ctx>, usize),
        (b, bp, lay): (IntValue<'ctx>, usize, BLay),
        wl: IntValue<'ctx>,
        c: [FloatValue<'ctx>; 4],
    ) -> R<[FloatValue<'ctx>; 4]> {
        self.shared_product(lay.symbol(), sh, a, (b, bp), wl, c)
    }

    /// `c + A B` by product `name` ([`MMA`], [`MMA_KN`], [`MMA_TF32`]) of tiles in shared
    /// memory.
    fn shared_product(
        &self,
        name: &str,
        sh: PointerValue<'ctx>,
        a: (IntValue<'ctx>, usize),
        (b, bp): (IntValue<'ctx>, usize),
        wl: IntValue<'ctx>,
        c: [FloatValue<'ctx>; 4],
    ) -> R<[FloatValue<'ctx>; 4]> {
        let args: Vec<BasicMetadataValueEnum> = vec![
            sh.into(),
            a.0.into(),
            self.i64c(a.1).into(),
            b.into(),
            self.i64c(bp).into(),
            wl.into(),
        ];
        self.call_product((name, false), args, c)
    }

    fn unpack4(&self, r: StructValue<'ctx>) -> R<[FloatValue<'ctx>; 4]> {
        let mut out = [self.fconst(0.0); 4];
        for (i, o) in out.iter_mut().enumerate() {
            *o = e(self.b.build_extract_value(r, i as u32, ""))?.into_float_value();
        }
        Ok(out)
    }

    /// `n` products of a warp's 16 rows over `k` (a multiple of the k-step: 16 for bf16
    /// tiles, 8 for f32 ones as three TF32 products, `tf`): `c_j` from `init(j)`, then
    /// `c_j = step(j, s, c_j)` for each k-step `s`.
    fn product_tiles(
        &self,
        (n, k, tf): (usize, usize, bool),
        mut init: impl FnMut(usize) -> R<[FloatValue<'ctx>; 4]>,
        mut step: impl FnMut(usize, usize, [FloatValue<'ctx>; 4]) -> R<[FloatValue<'ctx>; 4]>,
    ) -> R<Vec<[FloatValue<'ctx>; 4]>> {
        let steps = k / if tf { 8 } else { 16 };
        (0..n)
            .map(|j| (0..steps).try_fold(init(j)?, |c, s| step(j, s, c)))
            .collect()
    }

    /// `n` products of a warp's 16 rows: `c_j + A B_j` with `A` at `a` (its row 0, pitch)
    /// and `B_j` the tile `j` 8 columns on from `b` (pitch; stored `[n][k]`), over `k`
    /// ([`Gen::product_tiles`]); `c_j` from `init(j)`. Offsets count halves (a k-step is
    /// 16 either way).
    #[allow(clippy::too_many_arguments)]
    fn products(
        &self,
        sh: PointerValue<'ctx>,
        (a, ap): (IntValue<'ctx>, usize),
        (b, bp): (IntValue<'ctx>, usize),
        (n, k, tf): (usize, usize, bool),
        wl: IntValue<'ctx>,
        init: impl FnMut(usize) -> R<[FloatValue<'ctx>; 4]>,
    ) -> R<Vec<[FloatValue<'ctx>; 4]>> {
        self.product_tiles((n, k, tf), init, |j, s, c| {
            let ab = self.add_i(a, self.i64c(16 * s))?;
            let bb = self.add_i(b, self.i64c(BLay::Nk.offset(bp, j, s)))?;
            if tf {
                self.shared_product(MMA_TF32, sh, (ab, ap), (bb, bp), wl, c)
            } else {
                self.mma(sh, (ab, ap), (bb, bp, BLay::Nk), wl, c)
            }
        })
    }

    /// `n` products of a warp's 16 rows as [`Gen::products`], `A` from the lanes' words
    /// (k-step `s`'s fragment at `a_word + 4 s`, [`Gen::mma_regs`]) over `k` rows of `B`
    /// stored `[k][n]` at `b` (pitch): [`MMA_RA`], or [`MMA_TF32_RA`] where `tf`.
    fn products_regs(
        &self,
        l: &Lane<'ctx>,
        (a_word, words): (usize, usize),
        (b, bp): (IntValue<'ctx>, usize),
        (n, k, tf): (usize, usize, bool),
        wl: IntValue<'ctx>,
        init: impl FnMut(usize) -> R<[FloatValue<'ctx>; 4]>,
    ) -> R<Vec<[FloatValue<'ctx>; 4]>> {
        self.product_tiles((n, k, tf), init, |j, s, c| {
            let (prod, off) = if tf {
                // The 8 rows of k-step s, f32 columns 8 j on.
                (MMA_TF32_RA, 8 * s * bp + 16 * j)
            } else {
                (MMA_RA, BLay::Kn.offset(bp, j, s))
            };
            let bb = self.add_i(b, self.i64c(off))?;
            self.mma_regs(prod, l, (a_word + 4 * s, words), (bb, bp), wl, c)
        })
    }

    /// Keeps a lane's `C`-fragment pair `(x, y)` (elements `2h`, `2h + 1` of tile `j`) as
    /// the next product's `A` operand in its words from `at`: a bf16 pair in word
    /// [`a_reg_of`]`(j, h)`, or (`tf`) two f32s in words `4 j +` [`tf32_reg_of`].
    #[allow(clippy::too_many_arguments)]
    fn keep_a(
        &self,
        l: &Lane<'ctx>,
        at: usize,
        (j, h): (usize, usize),
        (x, y): (FloatValue<'ctx>, FloatValue<'ctx>),
        tf: bool,
    ) -> R<()> {
        if tf {
            self.lput(l, at + 4 * j + tf32_reg_of(2 * h), x)?;
            self.lput(l, at + 4 * j + tf32_reg_of(2 * h + 1), y)
        } else {
            self.lput_bits(l, at + a_reg_of(j, h), self.bf16_pair(x, y)?)
        }
    }

    /// The lane's four words `w..w + 4` of its own memory.
    fn frag_of(&self, l: &Lane<'ctx>, w: usize) -> R<[FloatValue<'ctx>; 4]> {
        Ok([
            self.lw(l, w)?,
            self.lw(l, w + 1)?,
            self.lw(l, w + 2)?,
            self.lw(l, w + 3)?,
        ])
    }

    /// Column `2t + (i & 1)` of a fragment's element `i`, plus `at`.
    fn frag_col(&self, t: IntValue<'ctx>, i: usize, at: usize) -> R<IntValue<'ctx>> {
        self.add_i(self.mul_i(t, self.i64c(2))?, self.i64c(at + (i & 1)))
    }

    /// A tensor-core block's lane ([`MmaLane`]).
    fn mma_lane(&self, a: &Attn, l: &Lane<'ctx>) -> R<MmaLane<'ctx>> {
        let tiles = a.s.div_ceil(MMA_ROWS);
        let bh = self.div_i(l.row, tiles)?;
        let qt = self.rem_i(l.row, tiles)?;
        let bi = self.div_i(bh, a.h)?;
        let hi = self.rem_i(bh, a.h)?;
        let q0 = self.mul_i(qt, self.i64c(MMA_ROWS))?;
        let off = self.query_offset(a, &l.ins)?;
        let tt = self.i64c(a.t);
        let need = if a.causal {
            let last = self.min_i(self.add_i(q0, self.i64c(MMA_ROWS))?, self.i64c(a.s))?;
            self.min_i(self.add_i(last, off)?, tt)?
        } else {
            tt
        };
        let kvh = self.add_i(self.mul_i(bi, self.i64c(a.g))?, self.div_i(hi, a.h / a.g)?)?;
        let wl = self.rem_i(l.lane, 32)?;
        Ok(MmaLane {
            wl,
            w16: self.mul_i(self.div_i(l.lane, 32)?, self.i64c(16))?,
            g: self.div_i(wl, 4)?,
            t: self.rem_i(wl, 4)?,
            q0,
            qrow0: self.add_i(self.mul_i(bh, self.i64c(a.s))?, q0)?,
            kv_base: self.mul_i(kvh, tt)?,
            off,
            need,
        })
    }

    /// The block row of the lane's fragment half `h` (0: row g, 1: row g + 8).
    fn mma_row(&self, m: &MmaLane<'ctx>, h: usize) -> R<IntValue<'ctx>> {
        self.add_i(self.add_i(m.w16, m.g)?, self.i64c(8 * h))
    }

    /// Keys block row `r` sees: `0..lim` (causal: up to its position, shifted by the
    /// queries' offset).
    fn mma_lim(&self, a: &Attn, m: &MmaLane<'ctx>, r: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        if !a.causal {
            return Ok(self.i64c(a.t));
        }
        let pos = self.add_i(self.add_i(m.q0, r)?, m.off)?;
        self.min_i(self.add_i(pos, self.i64c(1))?, self.i64c(a.t))
    }

    /// Key tile `l.iter` of `keys` keys: its first key, its length, and whether the block
    /// needs it (a causal block skips the tiles past its last query).
    fn mma_key_tile(
        &self,
        a: &Attn,
        l: &Lane<'ctx>,
        m: &MmaLane<'ctx>,
        keys: usize,
    ) -> R<(IntValue<'ctx>, IntValue<'ctx>, IntValue<'ctx>)> {
        self.mma_key_tile_at(a, m, keys, l.iter)
    }

    /// [`Gen::mma_key_tile`] of key tile `tile` (not needed past the last).
    fn mma_key_tile_at(
        &self,
        a: &Attn,
        m: &MmaLane<'ctx>,
        keys: usize,
        tile: IntValue<'ctx>,
    ) -> R<(IntValue<'ctx>, IntValue<'ctx>, IntValue<'ctx>)> {
        let ts = self.mul_i(tile, self.i64c(keys))?;
        let n = self.min_i(self.i64c(keys), self.e_sub(self.i64c(a.t), ts)?)?;
        Ok((ts, n, self.ult(ts, m.need)?))
    }

    /// The f32 exchange word of block row `r`, lane `t` of its four.
    fn xch(&self, mt: &MmaTiles, r: IntValue<'ctx>, t: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        self.add_i(
            self.add_i(self.i64c(mt.x_at / 2), self.mul_i(r, self.i64c(4))?)?,
            t,
        )
    }

    /// The team copies `rows x width` elements (bf16 or f32) of `x`, from row `first`
    /// (rows `n..` zeros), to the shared array's halves from `at`, a row every `pitch`
    /// halves, eight halves (16 bytes) a lane at a time ([`COPY16`]): a row's halves,
    /// `pitch` and `at` are multiples of 8.
    fn stage16(
        &self,
        l: &Lane<'ctx>,
        x: PointerValue<'ctx>,
        first: IntValue<'ctx>,
        (n, rows, width): (IntValue<'ctx>, usize, usize),
        (at, pitch): (usize, usize),
    ) -> R<()> {
        let to = (at, self.i64c(0), pitch);
        self.stage16_by(l, x, first, (n, rows, width), to, self.copy16_fn())
    }

    /// [`Gen::stage16`] to halves `at + shift` (`shift` a multiple of 8) by `copy`
    /// ([`COPY16`], or [`COPY16_ASYNC`] for a tile the team waits for later).
    fn stage16_by(
        &self,
        l: &Lane<'ctx>,
        x: PointerValue<'ctx>,
        first: IntValue<'ctx>,
        (n, rows, width): (IntValue<'ctx>, usize, usize),
        (at, shift, pitch): (usize, IntValue<'ctx>, usize),
        copy: FunctionValue<'ctx>,
    ) -> R<()> {
        let es = match self.elt_of(x) {
            Elt::Bf16 => 1,
            Elt::F32 => 2,
            Elt::I64 => return Err("the tensor-core attention reads float buffers".into()),
        };
        let wh = width * es;
        if !(wh.is_multiple_of(8) && pitch.is_multiple_of(8) && at.is_multiple_of(8)) {
            return Err(format!(
                "a tensor-core tile of {wh} halves a row, pitch {pitch} at {at}: not in 16-byte rows"
            ));
        }
        let per = wh / 8;
        let at = self.add_i(self.i64c(at), shift)?;
        self.for_step(l.lane, self.i64c(rows * per), MMA_LANES, |g, w| {
            let r = g.div_i(w, per)?;
            let c = g.mul_i(g.rem_i(w, per)?, g.i64c(8))?;
            let keep = g.ult(r, n)?;
            // A row past the end reads nothing (its address is the buffer's start).
            let off = g.add_i(g.mul_i(g.add_i(first, r)?, g.i64c(wh))?, c)?;
            let off = e(g.b.build_select(keep, off, g.i64c(0), ""))?.into_int_value();
            let from = g.sh16(x, off)?;
            let to = g.add_i(g.add_i(at, g.mul_i(r, g.i64c(pitch))?)?, c)?;
            let to = g.sh16(l.sh, to)?;
            e(g.b.build_call(copy, &[from.into(), to.into(), keep.into()], "")).map(|_| ())
        })
    }
}
