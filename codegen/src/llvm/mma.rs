//! Attention's forward on tensor cores ([`crate::kernel::Body::AttnMma`]): bf16 operands,
//! FlashAttention-2 with its two products as warp-wide `mma.sync.m16n8k16` (bf16 in, f32
//! sums); and the backward's two kernels the same way.
//!
//! A block is a tile of [`MMA_ROWS`] query rows of one head, four warps of 16 rows. It
//! stages its queries in shared memory once; then, a key tile at a time (64 keys, or 32
//! where the rows are wide: [`crate::kernel::Attn::mma_keys`]), it stages the keys and the
//! values (rows as stored, 16 bytes a lane: [`COPY16`]), and each warp
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
//! staged), not four. The backward's kernels keep `dS` (and `P^T`, `dS^T`) in registers
//! the same way.
//!
//! At the end a row's four partial sums meet through the exchange words (in lane order)
//! and each lane stores its output elements times `1 / l`, and the statistics `[m, 1/l]`
//! where the backward takes them ([`crate::kernel::Attn::saved`]). A causal block skips
//! the key tiles past its last query, as [`super::tiles`] does.
//!
//! Every value passes between lanes through shared memory between phases, as in every
//! team kernel ([`super::team`]), except inside the product, which is the one warp-wide
//! operation (its register form reads `A` from the warp's lanes' words, below): `nns.mma.bf16(sh, a_base, a_pitch, b_base, b_pitch, lane, c0..c3)` takes
//! its operand tiles from shared memory (`A[m][k]` at `a_base + m * a_pitch + k`; `B[k][n]`
//! at `b_base + n * b_pitch + k`, or at `b_base + k * b_pitch + n` for
//! `nns.mma.bf16.kn`: [`BLay`]) and the lane's accumulator fragment. Its body is the
//! target's ([`Gen::define_warp_ops`]): on the GPU each lane gives `ldmatrix` the address
//! of one row ([`ldm_a_row`], [`ldm_b_row`]), which loads the warp's A fragments (`.x4`)
//! and B fragments (`.x2`, `.trans` for `[k][n]` tiles) from the rows all the lanes gave,
//! and `mma.sync` multiplies them; on the host each of the four result elements is a sum
//! over k in 16 steps whose operands are read from the registers `ldmatrix` would give
//! *the lanes holding them* (the same row functions, called with the lanes whose rows
//! form that register's matrix) by the PTX ISA's fragment layouts. So the host tests the
//! rows each lane addresses, `ldmatrix`'s matrices and the fragment layouts the GPU
//! relies on, not a shortcut around them.

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
        self.module.get_function(COPY16).unwrap_or_else(|| {
            let ptr = self.ctx.ptr_type(AddressSpace::default());
            let ty = self.ctx.void_type().fn_type(
                &[ptr.into(), ptr.into(), self.ctx.bool_type().into()],
                false,
            );
            self.module.add_function(COPY16, ty, None)
        })
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

    /// Gives the warp-wide operations and copies declared by the kernels their target's
    /// bodies: on the GPU `ldmatrix`, `mma.sync` and 16-byte moves; on the host the
    /// product's elements from the registers `ldmatrix` would give the lanes that hold
    /// their operands, and the same moves unaligned.
    pub(crate) fn define_warp_ops(&self, gpu: bool) -> R<()> {
        for lay in [BLay::Nk, BLay::Kn] {
            self.define_mma(lay, gpu)?;
        }
        self.define_mma_ra(gpu)?;
        self.define_tf32x3(false, gpu)?;
        self.define_tf32x3(true, gpu)?;
        self.define_copy16(gpu)
    }

    /// Makes the declared function `name` internal, always inlined where `inline` (else
    /// never: the host's emulation of a product is hundreds of instructions, called from
    /// every product of every kernel), and puts the builder at its new entry block;
    /// `None` where it is not declared or has a body.
    fn begin_warp_op(&self, name: &str, inline: bool) -> Option<FunctionValue<'ctx>> {
        let f = self.module.get_function(name)?;
        if f.count_basic_blocks() > 0 {
            return None;
        }
        f.set_linkage(Linkage::Internal);
        let kind = if inline { "alwaysinline" } else { "noinline" };
        let attr = self
            .ctx
            .create_enum_attribute(Attribute::get_named_enum_kind_id(kind), 0);
        f.add_attribute(AttributeLoc::Function, attr);
        let entry = self.ctx.append_basic_block(f, "entry");
        self.b.position_at_end(entry);
        Some(f)
    }

    /// `ldmatrix` of the shared array: `x` 8 x 8 matrices whose rows lane `i` addresses
    /// at `row` (bf16 elements), `.trans` where `trans`; the lane's `x` registers.
    fn ldmatrix(
        &self,
        sh: PointerValue<'ctx>,
        row: IntValue<'ctx>,
        x: usize,
        trans: bool,
    ) -> R<Vec<IntValue<'ctx>>> {
        let sh3 = e(self.b.build_address_space_cast(
            sh,
            self.ctx.ptr_type(AddressSpace::from(3u16)),
            "",
        ))?;
        // SAFETY of the generated code: the row lies inside the shared array.
        let p = e(unsafe {
            self.b
                .build_in_bounds_gep(self.ctx.i16_type(), sh3, &[row], "")
        })?;
        let name = format!(
            "llvm.nvvm.ldmatrix.sync.aligned.m8n8.x{x}{}.b16",
            if trans { ".trans" } else { "" }
        );
        let f = inkwell::intrinsics::Intrinsic::find(&name)
            .and_then(|i| i.get_declaration(&self.module, &[sh3.get_type().into()]))
            .ok_or_else(|| format!("LLVM has no {name}"))?;
        let r = e(self.b.build_call(f, &[p.into()], ""))?
            .try_as_basic_value()
            .basic()
            .ok_or("ldmatrix returned nothing")?;
        if x == 1 {
            return Ok(vec![r.into_int_value()]);
        }
        let r = r.into_struct_value();
        (0..x as u32)
            .map(|k| Ok(e(self.b.build_extract_value(r, k, ""))?.into_int_value()))
            .collect()
    }

    /// Register `r` of lane `(g, t)` after an `ldmatrix` whose lanes address rows by
    /// `row` (lane `i`'s row address), as the host computes it: matrix `r`'s rows are
    /// those lanes `8 r ..` address; plain, the lane holds row `g`, elements `2 t, 2 t +
    /// 1`; `.trans`, element `g` of rows `2 t` and `2 t + 1`.
    fn ldm_word(
        &self,
        sh: PointerValue<'ctx>,
        row: &dyn Fn(IntValue<'ctx>) -> R<IntValue<'ctx>>,
        (g, t): (IntValue<'ctx>, IntValue<'ctx>),
        r: usize,
        trans: bool,
    ) -> R<IntValue<'ctx>> {
        let t2 = self.mul_i(t, self.i64c(2))?;
        if !trans {
            let at = row(self.add_i(g, self.i64c(8 * r))?)?;
            return self.sh_pair(sh, self.add_i(at, t2)?);
        }
        let first = self.add_i(t2, self.i64c(8 * r))?;
        let lo = self.sh_half(sh, self.add_i(row(first)?, g)?)?;
        let second = self.add_i(first, self.i64c(1))?;
        let hi = self.sh_half(sh, self.add_i(row(second)?, g)?)?;
        let hi = e(self
            .b
            .build_left_shift(hi, self.ctx.i32_type().const_int(16, false), ""))?;
        e(self.b.build_or(lo, hi, ""))
    }

    /// The product's body for `B` laid out as `lay` ([`Gen::define_warp_ops`]).
    fn define_mma(&self, lay: BLay, gpu: bool) -> R<()> {
        let saved = self.b.get_insert_block();
        let Some(f) = self.begin_warp_op(lay.symbol(), gpu) else {
            return Ok(());
        };
        let p = |j: u32| f.get_nth_param(j).ok_or("missing product parameter");
        let sh = p(0)?.into_pointer_value();
        let a = (p(1)?.into_int_value(), p(2)?.into_int_value());
        let b = (p(3)?.into_int_value(), p(4)?.into_int_value());
        let wl = p(5)?.into_int_value();
        let c: Vec<FloatValue> = (6..10)
            .map(|j| p(j).map(|v| v.into_float_value()))
            .collect::<Result<_, _>>()?;
        let g = self.div_i(wl, 4)?;
        let t = self.rem_i(wl, 4)?;
        let kn = lay == BLay::Kn;
        let d = if gpu {
            let mut args: Vec<BasicMetadataValueEnum> = Vec::new();
            for w in self.ldmatrix(sh, ldm_a_row(self, a, wl)?, 4, false)? {
                args.push(w.into());
            }
            for w in self.ldmatrix(sh, ldm_b_row(self, b, wl, lay)?, 2, kn)? {
                args.push(w.into());
            }
            args.extend(c.iter().map(|&x| BasicMetadataValueEnum::from(x)));
            let mma = inkwell::intrinsics::Intrinsic::find("llvm.nvvm.mma.m16n8k16.row.col.bf16")
                .and_then(|i| i.get_declaration(&self.module, &[]))
                .ok_or("LLVM has no llvm.nvvm.mma.m16n8k16.row.col.bf16")?;
            e(self.b.build_call(mma, &args, ""))?
                .try_as_basic_value()
                .basic()
                .ok_or("mma returned nothing")?
                .into_struct_value()
        } else {
            // Result element i: row g + 8 (i >> 1), column 2t + (i & 1). A[row][k] lies in
            // lane (row % 8, (k % 8) / 2), register (row / 8) + 2 (k / 8), half k % 2;
            // B[k][col] in lane (col, (k % 8) / 2), register k / 8, half k % 2: each read
            // from the registers `ldmatrix` gives that lane.
            let a_row = |i| ldm_a_row(self, a, i);
            let b_row = |i| ldm_b_row(self, b, i, lay);
            let mut r = self.mma_ret().get_undef();
            for (i, &ci) in c.iter().enumerate() {
                let col = self.add_i(self.mul_i(t, self.i64c(2))?, self.i64c(i & 1))?;
                let mut acc = ci;
                for k in 0..16 {
                    let tk = self.i64c((k % 8) / 2);
                    let wa = self.ldm_word(sh, &a_row, (g, tk), (i >> 1) + 2 * (k / 8), false)?;
                    let wb = self.ldm_word(sh, &b_row, (col, tk), k / 8, kn)?;
                    let x = self.pair_half(wa, k % 2)?;
                    let y = self.pair_half(wb, k % 2)?;
                    acc = self.fma(x, y, acc)?;
                }
                r = e(self.b.build_insert_value(r, acc, i as u32, ""))?.into_struct_value();
            }
            r
        };
        e(self.b.build_return(Some(&d)))?;
        if let Some(bb) = saved {
            self.b.position_at_end(bb);
        }
        Ok(())
    }

    /// The register-A product's body ([`MMA_RA`]): on the GPU the lane's four words and
    /// its B fragment by `ldmatrix.trans`; on the host each result element's `A` operands
    /// from the words of the lanes that hold them (lane `w` of the warp keeps its words
    /// `(w - lane) * words` f32s from this lane's, the host's lanes' memories lying in
    /// order in one block).
    fn define_mma_ra(&self, gpu: bool) -> R<()> {
        let saved = self.b.get_insert_block();
        let Some(f) = self.begin_warp_op(MMA_RA, gpu) else {
            return Ok(());
        };
        let p = |j: u32| f.get_nth_param(j).ok_or("missing product parameter");
        let local = p(0)?.into_pointer_value();
        let (a_word, words) = (p(1)?.into_int_value(), p(2)?.into_int_value());
        let sh = p(3)?.into_pointer_value();
        let b = (p(4)?.into_int_value(), p(5)?.into_int_value());
        let wl = p(6)?.into_int_value();
        let c: Vec<FloatValue> = (7..11)
            .map(|j| p(j).map(|v| v.into_float_value()))
            .collect::<Result<_, _>>()?;
        let i32t = self.ctx.i32_type();
        // Word `a_word + r` of warp lane `w`'s memory.
        let word = |w: IntValue<'ctx>, r: usize| -> R<IntValue<'ctx>> {
            let delta = self.mul_i(e(self.b.build_int_sub(w, wl, ""))?, words)?;
            let at = self.add_i(self.add_i(delta, a_word)?, self.i64c(r))?;
            // SAFETY of the generated code: lane `w` is in this lane's warp, whose lanes'
            // memories are `words` f32s each, in order.
            let ptr = e(unsafe {
                self.b
                    .build_in_bounds_gep(self.ctx.f32_type(), local, &[at], "")
            })?;
            Ok(e(self.b.build_load(i32t, ptr, ""))?.into_int_value())
        };
        let g = self.div_i(wl, 4)?;
        let t = self.rem_i(wl, 4)?;
        let d = if gpu {
            let mut args: Vec<BasicMetadataValueEnum> = Vec::new();
            for r in 0..4 {
                args.push(word(wl, r)?.into());
            }
            for w in self.ldmatrix(sh, ldm_b_row(self, b, wl, BLay::Kn)?, 2, true)? {
                args.push(w.into());
            }
            args.extend(c.iter().map(|&x| BasicMetadataValueEnum::from(x)));
            let mma = inkwell::intrinsics::Intrinsic::find("llvm.nvvm.mma.m16n8k16.row.col.bf16")
                .and_then(|i| i.get_declaration(&self.module, &[]))
                .ok_or("LLVM has no llvm.nvvm.mma.m16n8k16.row.col.bf16")?;
            e(self.b.build_call(mma, &args, ""))?
                .try_as_basic_value()
                .basic()
                .ok_or("mma returned nothing")?
                .into_struct_value()
        } else {
            // As `define_mma`'s host body, A[row][k] from lane (row % 8, (k % 8) / 2)'s
            // word (row / 8) + 2 (k / 8).
            let b_row = |i| ldm_b_row(self, b, i, BLay::Kn);
            let mut r = self.mma_ret().get_undef();
            for (i, &ci) in c.iter().enumerate() {
                let col = self.add_i(self.mul_i(t, self.i64c(2))?, self.i64c(i & 1))?;
                let mut acc = ci;
                for k in 0..16 {
                    let tk = self.i64c((k % 8) / 2);
                    let wa = self.add_i(self.mul_i(g, self.i64c(4))?, tk)?;
                    let wa = word(wa, (i >> 1) + 2 * (k / 8))?;
                    let wb = self.ldm_word(sh, &b_row, (col, tk), k / 8, true)?;
                    let x = self.pair_half(wa, k % 2)?;
                    let y = self.pair_half(wb, k % 2)?;
                    acc = self.fma(x, y, acc)?;
                }
                r = e(self.b.build_insert_value(r, acc, i as u32, ""))?.into_struct_value();
            }
            r
        };
        e(self.b.build_return(Some(&d)))?;
        if let Some(bb) = saved {
            self.b.position_at_end(bb);
        }
        Ok(())
    }

    /// The TF32 parts of the f32 whose bits are `x`: `hi` (rounded to TF32, nearest, ties
    /// away: `cvt.rna.tf32.f32`) and `lo` (`x - hi`, rounded the same), as f32 bits. On
    /// the host the rounding is the same arithmetic on the bits (infinities and NaN kept).
    fn tf32_parts(&self, x: IntValue<'ctx>, gpu: bool) -> R<(IntValue<'ctx>, IntValue<'ctx>)> {
        let f32t = self.ctx.f32_type();
        let round = |bits: IntValue<'ctx>| -> R<IntValue<'ctx>> {
            if gpu {
                let cvt = inkwell::intrinsics::Intrinsic::find("llvm.nvvm.f2tf32.rna")
                    .and_then(|i| i.get_declaration(&self.module, &[]))
                    .ok_or("LLVM has no llvm.nvvm.f2tf32.rna")?;
                let f = e(self.b.build_bit_cast(bits, f32t, ""))?;
                return Ok(e(self.b.build_call(cvt, &[f.into()], ""))?
                    .try_as_basic_value()
                    .basic()
                    .ok_or("cvt returned nothing")?
                    .into_int_value());
            }
            let i32t = self.ctx.i32_type();
            let exp = e(self
                .b
                .build_and(bits, i32t.const_int(0x7f80_0000, false), ""))?;
            let special = e(self.b.build_int_compare(
                IntPredicate::EQ,
                exp,
                i32t.const_int(0x7f80_0000, false),
                "",
            ))?;
            let up = e(self
                .b
                .build_int_add(bits, i32t.const_int(0x1000, false), ""))?;
            let r = e(self.b.build_and(up, i32t.const_int(0xffff_e000, false), ""))?;
            Ok(e(self.b.build_select(special, bits, r, ""))?.into_int_value())
        };
        let hi = round(x)?;
        let xf = e(self.b.build_bit_cast(x, f32t, ""))?.into_float_value();
        let hf = e(self.b.build_bit_cast(hi, f32t, ""))?.into_float_value();
        let lo = round(
            e(self
                .b
                .build_bit_cast(self.fsub(xf, hf)?, self.ctx.i32_type(), ""))?
            .into_int_value(),
        )?;
        Ok((hi, lo))
    }

    /// The body of [`MMA_TF32`] (`regs`: [`MMA_TF32_RA`]): on the GPU the lane's A
    /// fragment (by `ldmatrix.x4`, or its words) and B fragment (by `ldmatrix.x2` of rows
    /// `[n][k]`, or two 32-bit loads of the value rows its columns stand for), each split
    /// into TF32 parts, and three `mma.sync.m16n8k8.tf32`, the small terms first; on the
    /// host each result element as the three 8-step sums, in that order, of the parts of
    /// the operands the lanes holding them have.
    fn define_tf32x3(&self, regs: bool, gpu: bool) -> R<()> {
        let saved = self.b.get_insert_block();
        let Some(f) = self.begin_warp_op(if regs { MMA_TF32_RA } else { MMA_TF32 }, gpu) else {
            return Ok(());
        };
        let p = |j: u32| f.get_nth_param(j).ok_or("missing product parameter");
        // [local, a_word, words, sh, ...] or [sh, a_base, a_pitch, ...], then b_base,
        // b_pitch, lane, c0..c3.
        let (shi, bi) = if regs { (3, 4) } else { (0, 3) };
        let sh = p(shi)?.into_pointer_value();
        let a = (p(1)?.into_int_value(), p(2)?.into_int_value());
        let b = (p(bi)?.into_int_value(), p(bi + 1)?.into_int_value());
        let wl = p(bi + 2)?.into_int_value();
        let c: Vec<FloatValue> = (bi + 3..bi + 7)
            .map(|j| p(j).map(|v| v.into_float_value()))
            .collect::<Result<_, _>>()?;
        let i32t = self.ctx.i32_type();
        // `regs`: word `a + r` of warp lane `w`'s memory (`a.0` the word, `a.1` the
        // lane's words; the lanes' memories lie in order on the host).
        let word = |w: IntValue<'ctx>, r: usize| -> R<IntValue<'ctx>> {
            let local = p(0)?.into_pointer_value();
            let delta = self.mul_i(e(self.b.build_int_sub(w, wl, ""))?, a.1)?;
            let at = self.add_i(self.add_i(delta, a.0)?, self.i64c(r))?;
            // SAFETY of the generated code: lane `w` is in this lane's warp, whose lanes'
            // memories are `words` f32s each, in order.
            let ptr = e(unsafe {
                self.b
                    .build_in_bounds_gep(self.ctx.f32_type(), local, &[at], "")
            })?;
            Ok(e(self.b.build_load(i32t, ptr, ""))?.into_int_value())
        };
        // `regs`: B[k][n], the value row of the key column k stands for, f32 column n.
        let b_at = |k: IntValue<'ctx>, n: IntValue<'ctx>| -> R<IntValue<'ctx>> {
            let row = self.mul_i(tf32_key_of(self, k)?, b.1)?;
            let col = self.mul_i(n, self.i64c(2))?;
            self.add_i(self.add_i(b.0, row)?, col)
        };
        let a_row = |i| ldm_a_row(self, a, i);
        let b_row = |i| ldm_b_row(self, b, i, BLay::Nk);
        let g = self.div_i(wl, 4)?;
        let t = self.rem_i(wl, 4)?;
        let d = if gpu {
            let av = if regs {
                (0..4).map(|r| word(wl, r)).collect::<R<Vec<_>>>()?
            } else {
                self.ldmatrix(sh, a_row(wl)?, 4, false)?
            };
            let bv = if regs {
                let mut v = Vec::with_capacity(2);
                for r in 0..2 {
                    v.push(self.sh_pair(sh, b_at(self.add_i(t, self.i64c(4 * r))?, g)?)?);
                }
                v
            } else {
                self.ldmatrix(sh, b_row(wl)?, 2, false)?
            };
            let ap = av
                .iter()
                .map(|&x| self.tf32_parts(x, true))
                .collect::<R<Vec<_>>>()?;
            let bp = bv
                .iter()
                .map(|&x| self.tf32_parts(x, true))
                .collect::<R<Vec<_>>>()?;
            let mma = inkwell::intrinsics::Intrinsic::find("llvm.nvvm.mma.m16n8k8.row.col.tf32")
                .and_then(|i| i.get_declaration(&self.module, &[]))
                .ok_or("LLVM has no llvm.nvvm.mma.m16n8k8.row.col.tf32")?;
            let mut acc: Vec<BasicMetadataValueEnum> =
                c.iter().map(|&x| BasicMetadataValueEnum::from(x)).collect();
            let mut r = None;
            for (ahi, bhi) in [(false, true), (true, false), (true, true)] {
                let mut args: Vec<BasicMetadataValueEnum> = Vec::new();
                for &(h, l) in &ap {
                    args.push(if ahi { h } else { l }.into());
                }
                for &(h, l) in &bp {
                    args.push(if bhi { h } else { l }.into());
                }
                args.extend(acc.iter().copied());
                let d = e(self.b.build_call(mma, &args, ""))?
                    .try_as_basic_value()
                    .basic()
                    .ok_or("mma returned nothing")?
                    .into_struct_value();
                acc = self
                    .unpack4(d)?
                    .iter()
                    .map(|&x| BasicMetadataValueEnum::from(x))
                    .collect();
                r = Some(d);
            }
            r.ok_or("no product")?
        } else {
            // Result element i: row g + 8 (i >> 1), column 2t + (i & 1). A[row][k] lies
            // in lane (row % 8, k % 4), register (row / 8) + 2 (k / 4); B[k][col] in lane
            // (col, k % 4), register k / 4.
            let part = |bits: IntValue<'ctx>, hi: bool| -> R<FloatValue<'ctx>> {
                let (h, l) = self.tf32_parts(bits, false)?;
                let v = if hi { h } else { l };
                Ok(e(self.b.build_bit_cast(v, self.ctx.f32_type(), ""))?.into_float_value())
            };
            let mut r = self.mma_ret().get_undef();
            for (i, &ci) in c.iter().enumerate() {
                let col = self.add_i(self.mul_i(t, self.i64c(2))?, self.i64c(i & 1))?;
                let mut acc = ci;
                for (ahi, bhi) in [(false, true), (true, false), (true, true)] {
                    for k in 0..8 {
                        let tk = self.i64c(k % 4);
                        let reg = (i >> 1) + 2 * (k / 4);
                        let wa = if regs {
                            word(self.add_i(self.mul_i(g, self.i64c(4))?, tk)?, reg)?
                        } else {
                            self.ldm_word(sh, &a_row, (g, tk), reg, false)?
                        };
                        let wb = if regs {
                            self.sh_pair(sh, b_at(self.i64c(k), col)?)?
                        } else {
                            self.ldm_word(sh, &b_row, (col, tk), k / 4, false)?
                        };
                        acc = self.fma(part(wa, ahi)?, part(wb, bhi)?, acc)?;
                    }
                }
                r = e(self.b.build_insert_value(r, acc, i as u32, ""))?.into_struct_value();
            }
            r
        };
        e(self.b.build_return(Some(&d)))?;
        if let Some(bb) = saved {
            self.b.position_at_end(bb);
        }
        Ok(())
    }

    /// The 16-byte copy's body: eight bf16s from `src` to `dst` where `keep`, else eight
    /// zeros to `dst`; 16-byte aligned accesses on the GPU (every row a stage copies
    /// starts at a multiple of eight elements of a 256-byte aligned buffer, and of the
    /// shared array's tiles), any alignment on the host.
    fn define_copy16(&self, gpu: bool) -> R<()> {
        let saved = self.b.get_insert_block();
        let Some(f) = self.begin_warp_op(COPY16, true) else {
            return Ok(());
        };
        let p = |j: u32| f.get_nth_param(j).ok_or("missing copy parameter");
        let (src, dst) = (p(0)?.into_pointer_value(), p(1)?.into_pointer_value());
        let keep = p(2)?.into_int_value();
        let align = if gpu { 16 } else { 1 };
        let v4 = self.ctx.i32_type().vec_type(4);
        let entry = self.b.get_insert_block().ok_or("no entry block")?;
        let load = self.ctx.append_basic_block(f, "load");
        let join = self.ctx.append_basic_block(f, "store");
        e(self.b.build_conditional_branch(keep, load, join))?;
        self.b.position_at_end(load);
        let v = e(self.b.build_load(v4, src, ""))?;
        e(v.as_instruction_value()
            .ok_or("a load that is no instruction")?
            .set_alignment(align))?;
        e(self.b.build_unconditional_branch(join))?;
        self.b.position_at_end(join);
        let phi = e(self.b.build_phi(v4, ""))?;
        phi.add_incoming(&[(&v, load), (&v4.const_zero(), entry)]);
        let st = e(self.b.build_store(dst, phi.as_basic_value()))?;
        e(st.set_alignment(align))?;
        e(self.b.build_return(None))?;
        if let Some(bb) = saved {
            self.b.position_at_end(bb);
        }
        Ok(())
    }

    /// `n` products of a warp's 16 rows: `c_j + A B_j` with `A` at `a` (its row 0, pitch)
    /// and `B_j` the tile `j` 8 columns on from `b` (pitch; stored `[n][k]`), over `k`
    /// (a multiple of the k-step: 16 for bf16 tiles, 8 for f32 ones as three TF32
    /// products, `tf`); `c_j` from `init(j)`. Offsets count halves (a k-step is 16 either
    /// way).
    #[allow(clippy::too_many_arguments)]
    fn products(
        &self,
        sh: PointerValue<'ctx>,
        (a, ap): (IntValue<'ctx>, usize),
        (b, bp): (IntValue<'ctx>, usize),
        (n, k, tf): (usize, usize, bool),
        wl: IntValue<'ctx>,
        mut init: impl FnMut(usize) -> R<[FloatValue<'ctx>; 4]>,
    ) -> R<Vec<[FloatValue<'ctx>; 4]>> {
        let steps = k / if tf { 8 } else { 16 };
        let mut out = Vec::with_capacity(n);
        for j in 0..n {
            let mut c = init(j)?;
            for s in 0..steps {
                let ab = self.add_i(a, self.i64c(16 * s))?;
                let bb = self.add_i(b, self.i64c(BLay::Nk.offset(bp, j, s)))?;
                c = if tf {
                    self.shared_product(MMA_TF32, sh, (ab, ap), (bb, bp), wl, c)?
                } else {
                    self.mma(sh, (ab, ap), (bb, bp, BLay::Nk), wl, c)?
                };
            }
            out.push(c);
        }
        Ok(out)
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
        mut init: impl FnMut(usize) -> R<[FloatValue<'ctx>; 4]>,
    ) -> R<Vec<[FloatValue<'ctx>; 4]>> {
        let steps = k / if tf { 8 } else { 16 };
        let mut out = Vec::with_capacity(n);
        for j in 0..n {
            let mut c = init(j)?;
            for s in 0..steps {
                let (prod, off) = if tf {
                    // The 8 rows of k-step s, f32 columns 8 j on.
                    (MMA_TF32_RA, 8 * s * bp + 16 * j)
                } else {
                    (MMA_RA, BLay::Kn.offset(bp, j, s))
                };
                let bb = self.add_i(b, self.i64c(off))?;
                c = self.mma_regs(prod, l, (a_word + 4 * s, words), (bb, bp), wl, c)?;
            }
            out.push(c);
        }
        Ok(out)
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
        let ts = self.mul_i(l.iter, self.i64c(keys))?;
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
        let copy = self.copy16_fn();
        self.for_step(l.lane, self.i64c(rows * per), MMA_LANES, |g, w| {
            let r = g.div_i(w, per)?;
            let c = g.mul_i(g.rem_i(w, per)?, g.i64c(8))?;
            let keep = g.ult(r, n)?;
            // A row past the end reads nothing (its address is the buffer's start).
            let off = g.add_i(g.mul_i(g.add_i(first, r)?, g.i64c(wh))?, c)?;
            let off = e(g.b.build_select(keep, off, g.i64c(0), ""))?.into_int_value();
            let from = g.sh16(x, off)?;
            let to = g.add_i(g.add_i(g.i64c(at), g.mul_i(r, g.i64c(pitch))?)?, c)?;
            let to = g.sh16(l.sh, to)?;
            e(g.b.build_call(copy, &[from.into(), to.into(), keep.into()], "")).map(|_| ())
        })
    }

    /// The forward on tensor cores ([`crate::kernel::Body::AttnMma`]): `q, k, v (,
    /// offset) -> out (, stats)`.
    pub(super) fn attn_mma(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
        let mt = a
            .mma_keys()
            .ok_or("this attention does not take tensor cores")?;
        let a = *a;
        let (d, ev, kt) = (a.d, a.e, mt.keys);
        let (nk, ne) = (kt / 8, ev / 8);
        // f32 operands: three TF32 products, k-steps of 8 (16 halves, as bf16's 16).
        let tf = a.tf32x3;
        let k_step = if tf { 8 } else { 16 };
        // A lane's memory: S [nk fragments of 4], O [ne of 4], m [2 halves], l [2], P
        // [kt / k_step A fragments of 4 words: bf16 pairs, or f32s].
        let (ls, lo) = (0, 4 * nk);
        let lm = lo + 4 * ne;
        let ll = lm + 2;
        let lp = ll + 2;
        let words = lp + 4 * kt / k_step;
        tm.shared = Shared::Tile(mt.words);
        tm.local = words;
        let all = MMA_LANES;
        let neg = f32::NEG_INFINITY;
        // Stage the queries; start the online softmax.
        tm.phase(all, |g, l| {
            let m = g.mma_lane(&a, l)?;
            let n = g.min_i(g.i64c(MMA_ROWS), g.e_sub(g.i64c(a.s), m.q0)?)?;
            g.stage16(l, l.ins[0], m.qrow0, (n, MMA_ROWS, d), (0, mt.qp))?;
            for w in lo..lm {
                g.lput(l, w, g.fconst(0.0))?;
            }
            for h in 0..2 {
                g.lput(l, lm + h, g.fconst(neg))?;
                g.lput(l, ll + h, g.fconst(0.0))?;
            }
            Ok(())
        })?;
        let tile =
            move |g: &Gen<'ctx>, l: &Lane<'ctx>, m: &MmaLane<'ctx>| g.mma_key_tile(&a, l, m, kt);
        tm.repeat(a.t.div_ceil(kt), |tm| {
            tm.phase(all, |g, l| {
                let m = g.mma_lane(&a, l)?;
                let (ts, n, needed) = tile(g, l, &m)?;
                g.when(needed, |g| {
                    let first = g.add_i(m.kv_base, ts)?;
                    g.stage16(l, l.ins[1], first, (n, kt, d), (mt.k_at, mt.qp))?;
                    g.stage16(l, l.ins[2], first, (n, kt, ev), (mt.v_at, mt.ep))
                })
            })?;
            // S = scale Q K^T, masked; the rows' partial maxima.
            tm.phase(all, |g, l| {
                let m = g.mma_lane(&a, l)?;
                let (ts, _, needed) = tile(g, l, &m)?;
                g.when(needed, |g| {
                    let mut mx = [g.fconst(neg); 2];
                    let lims = (0..2)
                        .map(|h| g.mma_lim(&a, &m, g.mma_row(&m, h)?))
                        .collect::<R<Vec<_>>>()?;
                    let a_row = g.mul_i(m.w16, g.i64c(mt.qp))?;
                    for j in 0..nk {
                        let mut c = [g.fconst(0.0); 4];
                        for s in 0..d / k_step {
                            let ab = g.add_i(a_row, g.i64c(16 * s))?;
                            let bb = g.i64c(mt.k_at + BLay::Nk.offset(mt.qp, j, s));
                            c = if tf {
                                g.shared_product(MMA_TF32, l.sh, (ab, mt.qp), (bb, mt.qp), m.wl, c)?
                            } else {
                                g.mma(l.sh, (ab, mt.qp), (bb, mt.qp, BLay::Nk), m.wl, c)?
                            };
                        }
                        for (i, ci) in c.iter().enumerate() {
                            let h = i >> 1;
                            let col = g.add_i(g.mul_i(m.t, g.i64c(2))?, g.i64c(8 * j + (i & 1)))?;
                            let seen = g.ult(g.add_i(ts, col)?, lims[h])?;
                            let s = g.fmul(*ci, g.fconst(a.scale))?;
                            let s = g.select_f(seen, s, g.fconst(neg))?;
                            g.lput(l, ls + 4 * j + i, s)?;
                            mx[h] = g.maxf(mx[h], s)?;
                        }
                    }
                    for (h, v) in mx.iter().enumerate() {
                        let r = g.mma_row(&m, h)?;
                        g.stf(l.sh, g.xch(&mt, r, m.t)?, *v)?;
                    }
                    Ok(())
                })
            })?;
            // The online softmax's step: new maxima, rescaling, P as bf16 pairs in the
            // lane's words (its own rows' maxima exchanged in the warp's words).
            tm.warp_phase(|g, l| {
                let m = g.mma_lane(&a, l)?;
                let (_, _, needed) = tile(g, l, &m)?;
                g.when(needed, |g| {
                    let exp = g.exp_fn()?;
                    for h in 0..2 {
                        let r = g.mma_row(&m, h)?;
                        let old = g.lw(l, lm + h)?;
                        let mut mx = old;
                        for q in 0..4 {
                            let x = g.ldf(l.sh, g.xch(&mt, r, g.i64c(q))?)?;
                            mx = g.maxf(mx, x)?;
                        }
                        // Nothing seen yet: subtract 0, not -inf (as the f32 tiles).
                        let none =
                            g.select(FloatPredicate::OEQ, mx, g.fconst(neg), g.fconst(0.0), mx)?;
                        let corr = g.call(exp, &[g.fsub(old, none)?])?;
                        let mut sum = g.fmul(g.lw(l, ll + h)?, corr)?;
                        for jn in 0..ne {
                            for i in [2 * h, 2 * h + 1] {
                                let w = lo + 4 * jn + i;
                                g.lput(l, w, g.fmul(g.lw(l, w)?, corr)?)?;
                            }
                        }
                        for j in 0..nk {
                            let mut ps = Vec::with_capacity(2);
                            for i in [2 * h, 2 * h + 1] {
                                let s = g.lw(l, ls + 4 * j + i)?;
                                let p = g.call(exp, &[g.fsub(s, none)?])?;
                                let p = if tf {
                                    // Kept in f32: the product splits it in TF32 parts.
                                    g.lput(l, lp + 4 * j + tf32_reg_of(i), p)?;
                                    p
                                } else {
                                    g.call(g.round_bf16_fn()?, &[p])?
                                };
                                sum = g.fadd(sum, p)?;
                                ps.push(p);
                            }
                            if !tf {
                                let w = g.bf16_pair(ps[0], ps[1])?;
                                g.lput_bits(l, lp + a_reg_of(j, h), w)?;
                            }
                        }
                        g.lput(l, ll + h, sum)?;
                        g.lput(l, lm + h, mx)?;
                    }
                    Ok(())
                })
            })?;
            // O += P V, P from the warp's registers.
            tm.warp_phase(|g, l| {
                let m = g.mma_lane(&a, l)?;
                let (_, _, needed) = tile(g, l, &m)?;
                g.when(needed, |g| {
                    for jn in 0..ne {
                        let mut c = [g.fconst(0.0); 4];
                        for (i, ci) in c.iter_mut().enumerate() {
                            *ci = g.lw(l, lo + 4 * jn + i)?;
                        }
                        for s in 0..kt / k_step {
                            let (prod, bb) = if tf {
                                // The 8 value rows of key tile s, f32 columns 8 jn on.
                                (MMA_TF32_RA, mt.v_at + 8 * s * mt.ep + 16 * jn)
                            } else {
                                (MMA_RA, mt.v_at + BLay::Kn.offset(mt.ep, jn, s))
                            };
                            let aw = (lp + 4 * s, words);
                            c = g.mma_regs(prod, l, aw, (g.i64c(bb), mt.ep), m.wl, c)?;
                        }
                        for (i, ci) in c.iter().enumerate() {
                            g.lput(l, lo + 4 * jn + i, *ci)?;
                        }
                    }
                    Ok(())
                })
            })
        })?;
        // Each row's four partial sums, then the output and the statistics.
        tm.phase(all, |g, l| {
            let m = g.mma_lane(&a, l)?;
            for h in 0..2 {
                let r = g.mma_row(&m, h)?;
                g.stf(l.sh, g.xch(&mt, r, m.t)?, g.lw(l, ll + h)?)?;
            }
            Ok(())
        })?;
        tm.phase(all, |g, l| {
            let m = g.mma_lane(&a, l)?;
            for h in 0..2 {
                let r = g.mma_row(&m, h)?;
                let mut sum = g.ldf(l.sh, g.xch(&mt, r, g.i64c(0))?)?;
                for q in 1..4 {
                    sum = g.fadd(sum, g.ldf(l.sh, g.xch(&mt, r, g.i64c(q))?)?)?;
                }
                let inv = g.fdiv(g.fconst(1.0), sum)?;
                let valid = g.ult(g.add_i(m.q0, r)?, g.i64c(a.s))?;
                g.when(valid, |g| {
                    let qrow = g.add_i(m.qrow0, r)?;
                    let ob = g.mul_i(qrow, g.i64c(ev))?;
                    for jn in 0..ne {
                        for i in [2 * h, 2 * h + 1] {
                            let col =
                                g.add_i(g.mul_i(m.t, g.i64c(2))?, g.i64c(8 * jn + (i & 1)))?;
                            let v = g.fmul(g.lw(l, lo + 4 * jn + i)?, inv)?;
                            g.stf(l.outs[0], g.add_i(ob, col)?, v)?;
                        }
                    }
                    if a.saved {
                        let first = e(g.b.build_int_compare(IntPredicate::EQ, m.t, g.i64c(0), ""))?;
                        g.when(first, |g| {
                            let s = g.mul_i(qrow, g.i64c(2))?;
                            g.stf(l.outs[1], s, g.lw(l, lm + h)?)?;
                            g.stf(l.outs[1], g.add_i(s, g.i64c(1))?, inv)
                        })?;
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
    }
}

/// A row's statistic `c` (0: m, 1: 1/l, 2: D) among the f32 words of a backward's shared
/// array.
fn stat_at<'ctx>(g: &Gen<'ctx>, mb: &MmaBack, r: IntValue<'ctx>, c: usize) -> R<IntValue<'ctx>> {
    g.add_i(g.i64c(mb.x_at / 2 + c), g.mul_i(r, g.i64c(4))?)
}

impl<'ctx> Gen<'ctx> {
    /// The backward's statistics and `dq` on tensor cores
    /// ([`crate::kernel::Body::AttnMmaBack`]): `dout, q, k, v, out, stats (, offset) ->
    /// stats3, dq`.
    pub(super) fn attn_mma_dq(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
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
            // S = Q K^T and dP = dO V^T; dS = P (dP - D) as bf16 pairs in the lane's words.
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
    pub(super) fn attn_mma_kv(&self, tm: &mut Team<'_, 'ctx>, a: &Attn) -> R<()> {
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
