//! The warp-wide operations' bodies, one per target ([`Gen::define_warp_ops`]): on the GPU
//! `ldmatrix`, `mma.sync` (bf16, and f32 as three TF32 products) and 16-byte moves; on
//! the host each product's result elements from what the lanes holding its operands have
//! (the registers `ldmatrix` would give them, or their words), so the host tests the
//! addressing and the fragment layouts the GPU relies on.

use super::*;

/// A product function's parameters ([`Gen::product_fn`]): the shared array, `A` (its base
/// and pitch, or with `regs` its first word and the lane's words), `B`'s base and pitch,
/// the lane in its warp, the accumulators.
struct Product<'ctx> {
    sh: PointerValue<'ctx>,
    a: (IntValue<'ctx>, IntValue<'ctx>),
    b: (IntValue<'ctx>, IntValue<'ctx>),
    wl: IntValue<'ctx>,
    c: Vec<FloatValue<'ctx>>,
}

impl<'ctx> Product<'ctx> {
    fn of(f: FunctionValue<'ctx>, regs: bool) -> R<Self> {
        let p = |j: u32| f.get_nth_param(j).ok_or("missing product parameter");
        // [local, a_word, words, sh, ...] or [sh, a_base, a_pitch, ...], then b_base,
        // b_pitch, lane, c0..c3.
        let (shi, bi) = if regs { (3, 4) } else { (0, 3) };
        Ok(Product {
            sh: p(shi)?.into_pointer_value(),
            a: (p(1)?.into_int_value(), p(2)?.into_int_value()),
            b: (p(bi)?.into_int_value(), p(bi + 1)?.into_int_value()),
            wl: p(bi + 2)?.into_int_value(),
            c: (bi + 3..bi + 7)
                .map(|j| p(j).map(|v| v.into_float_value()))
                .collect::<Result<_, _>>()?,
        })
    }
}

impl<'ctx> Gen<'ctx> {
    /// Gives the warp-wide operations and copies declared by the kernels their target's
    /// bodies: on the GPU `ldmatrix`, `mma.sync` and 16-byte moves; on the host the
    /// product's elements from the registers `ldmatrix` would give the lanes that hold
    /// their operands, and the same moves unaligned.
    pub(crate) fn define_warp_ops(&self, gpu: bool) -> R<()> {
        for lay in [Some(BLay::Nk), Some(BLay::Kn), None] {
            self.define_mma(lay, gpu)?;
        }
        self.define_tf32x3(false, gpu)?;
        self.define_tf32x3(true, gpu)?;
        // The host's asynchronous copy is the plain one: declare it before its body.
        self.define_async(gpu)?;
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

    /// Returns `ret` from the warp operation being defined and puts the builder back where
    /// it was before ([`Gen::begin_warp_op`]'s caller kept it as `saved`).
    fn end_warp_op(
        &self,
        ret: Option<&dyn BasicValue<'ctx>>,
        saved: Option<inkwell::basic_block::BasicBlock<'ctx>>,
    ) -> R<()> {
        e(self.b.build_return(ret))?;
        if let Some(bb) = saved {
            self.b.position_at_end(bb);
        }
        Ok(())
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
        let f = self.intrinsic_of(&name, sh3.get_type().into())?;
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

    /// The bf16 product's body: `A` and `B` (laid out as `lay`) in shared memory ([`MMA`],
    /// [`MMA_KN`]), or (`lay` `None`: [`MMA_RA`]) `A` in the lanes' words and `B` stored
    /// `[k][n]`. On the GPU the lane's fragments (`ldmatrix`, or its words, and
    /// `ldmatrix.trans` for `[k][n]`) and `mma.sync`; on the host each result element as a
    /// 16-step sum of the operands the lanes holding them have (the registers `ldmatrix`
    /// would give them, or their words: lane `w` of the warp keeps its words `(w - lane) *
    /// words` f32s from this lane's, the host's lanes' memories lying in order in one
    /// block).
    fn define_mma(&self, lay: Option<BLay>, gpu: bool) -> R<()> {
        let saved = self.b.get_insert_block();
        let Some(f) = self.begin_warp_op(lay.map_or(MMA_RA, BLay::symbol), gpu) else {
            return Ok(());
        };
        let regs = lay.is_none();
        let lay = lay.unwrap_or(BLay::Kn);
        let Product { sh, a, b, wl, c } = Product::of(f, regs)?;
        let word = |w: IntValue<'ctx>, r: usize| {
            let local = f.get_nth_param(0).ok_or("missing product parameter")?;
            self.lane_word(local.into_pointer_value(), a, (wl, w), r)
        };
        let g = self.div_i(wl, 4)?;
        let t = self.rem_i(wl, 4)?;
        let kn = lay == BLay::Kn;
        let a_row = |i| ldm_a_row(self, a, i);
        let b_row = |i| ldm_b_row(self, b, i, lay);
        let d = if gpu {
            let mut args: Vec<BasicMetadataValueEnum> = Vec::new();
            let av = if regs {
                (0..4).map(|r| word(wl, r)).collect::<R<Vec<_>>>()?
            } else {
                self.ldmatrix(sh, a_row(wl)?, 4, false)?
            };
            for w in av.into_iter().chain(self.ldmatrix(sh, b_row(wl)?, 2, kn)?) {
                args.push(w.into());
            }
            args.extend(c.iter().map(|&x| BasicMetadataValueEnum::from(x)));
            self.nvvm_mma("llvm.nvvm.mma.m16n8k16.row.col.bf16", &args)?
        } else {
            // Result element i: row g + 8 (i >> 1), column 2t + (i & 1). A[row][k] lies in
            // lane (row % 8, (k % 8) / 2), register (row / 8) + 2 (k / 8), half k % 2;
            // B[k][col] in lane (col, (k % 8) / 2), register k / 8, half k % 2.
            self.host_product(&c, t, |i, col, mut acc| {
                for k in 0..16 {
                    let tk = self.i64c((k % 8) / 2);
                    let reg = (i >> 1) + 2 * (k / 8);
                    let wa = if regs {
                        word(self.add_i(self.mul_i(g, self.i64c(4))?, tk)?, reg)?
                    } else {
                        self.ldm_word(sh, &a_row, (g, tk), reg, false)?
                    };
                    let wb = self.ldm_word(sh, &b_row, (col, tk), k / 8, kn)?;
                    let x = self.pair_half(wa, k % 2)?;
                    let y = self.pair_half(wb, k % 2)?;
                    acc = self.fma(x, y, acc)?;
                }
                Ok(acc)
            })?
        };
        self.end_warp_op(Some(&d), saved)
    }

    /// A call of the NVVM product `name` on `args` (A, B fragments, accumulators).
    fn nvvm_mma(&self, name: &str, args: &[BasicMetadataValueEnum<'ctx>]) -> R<StructValue<'ctx>> {
        let mma = self.intrinsic_fixed(name)?;
        Ok(e(self.b.build_call(mma, args, ""))?
            .try_as_basic_value()
            .basic()
            .ok_or("mma returned nothing")?
            .into_struct_value())
    }

    /// The TF32 parts of the f32 whose bits are `x`: `hi` (rounded to TF32, nearest, ties
    /// away: `cvt.rna.tf32.f32`) and `lo` (`x - hi`, rounded the same), as f32 bits. On
    /// the host the rounding is the same arithmetic on the bits (infinities and NaN kept).
    fn tf32_parts(&self, x: IntValue<'ctx>, gpu: bool) -> R<(IntValue<'ctx>, IntValue<'ctx>)> {
        let f32t = self.ctx.f32_type();
        let round = |bits: IntValue<'ctx>| -> R<IntValue<'ctx>> {
            if gpu {
                let cvt = self.intrinsic_fixed("llvm.nvvm.f2tf32.rna")?;
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
        let Product { sh, a, b, wl, c } = Product::of(f, regs)?;
        // `regs`: word `a + r` of warp lane `w`'s memory (`a.0` the word, `a.1` the
        // lane's words; the lanes' memories lie in order on the host).
        let word = |w: IntValue<'ctx>, r: usize| {
            let local = f.get_nth_param(0).ok_or("missing product parameter")?;
            self.lane_word(local.into_pointer_value(), a, (wl, w), r)
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
                let d = self.nvvm_mma("llvm.nvvm.mma.m16n8k8.row.col.tf32", &args)?;
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
            self.host_product(&c, t, |i, col, mut acc| {
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
                Ok(acc)
            })?
        };
        self.end_warp_op(Some(&d), saved)
    }

    /// Word `a_word + r` of warp lane `w`'s memory, from lane `wl`'s (`local`): on the
    /// host the lanes' memories lie in order, `words` f32s each; on the GPU only `w = wl`
    /// is asked for (the lane's own registers).
    fn lane_word(
        &self,
        local: PointerValue<'ctx>,
        (a_word, words): (IntValue<'ctx>, IntValue<'ctx>),
        (wl, w): (IntValue<'ctx>, IntValue<'ctx>),
        r: usize,
    ) -> R<IntValue<'ctx>> {
        let delta = self.mul_i(e(self.b.build_int_sub(w, wl, ""))?, words)?;
        let at = self.add_i(self.add_i(delta, a_word)?, self.i64c(r))?;
        // SAFETY of the generated code: lane `w` is in this lane's warp, whose lanes'
        // memories are `words` f32s each, in order.
        let ptr = e(unsafe {
            self.b
                .build_in_bounds_gep(self.ctx.f32_type(), local, &[at], "")
        })?;
        Ok(e(self.b.build_load(self.ctx.i32_type(), ptr, ""))?.into_int_value())
    }

    /// A host product's four results: element `i` (row `g + 8 (i >> 1)`, column `col =
    /// 2t + (i & 1)`) as `elem(i, col, c_i)`.
    fn host_product(
        &self,
        c: &[FloatValue<'ctx>],
        t: IntValue<'ctx>,
        mut elem: impl FnMut(usize, IntValue<'ctx>, FloatValue<'ctx>) -> R<FloatValue<'ctx>>,
    ) -> R<StructValue<'ctx>> {
        let mut r = self.mma_ret().get_undef();
        for (i, &ci) in c.iter().enumerate() {
            let col = self.add_i(self.mul_i(t, self.i64c(2))?, self.i64c(i & 1))?;
            let acc = elem(i, col, ci)?;
            r = e(self.b.build_insert_value(r, acc, i as u32, ""))?.into_struct_value();
        }
        Ok(r)
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
        self.end_warp_op(None, saved)
    }

    /// The asynchronous copy's body ([`COPY16_ASYNC`]) and its wait's ([`ASYNC_WAIT`]):
    /// on the GPU `cp.async.cg.shared.global` of 16 bytes, of which it reads `16` where
    /// `keep`, else none (zeros to `dst`, and `src` is never read), and
    /// `cp.async.wait_all`; on the host [`COPY16`]'s body and nothing.
    fn define_async(&self, gpu: bool) -> R<()> {
        let saved = self.b.get_insert_block();
        if let Some(f) = self.begin_warp_op(COPY16_ASYNC, true) {
            let p = |j: u32| f.get_nth_param(j).ok_or("missing copy parameter");
            let (src, dst) = (p(0)?.into_pointer_value(), p(1)?.into_pointer_value());
            let keep = p(2)?.into_int_value();
            if gpu {
                let (g1, s3) = (AddressSpace::from(1u16), AddressSpace::from(3u16));
                let src = e(self
                    .b
                    .build_address_space_cast(src, self.ctx.ptr_type(g1), ""))?;
                let dst = e(self
                    .b
                    .build_address_space_cast(dst, self.ctx.ptr_type(s3), ""))?;
                let i32t = self.ctx.i32_type();
                let bytes =
                    e(self
                        .b
                        .build_select(keep, i32t.const_int(16, false), i32t.const_zero(), ""))?;
                let cp = self.intrinsic_fixed("llvm.nvvm.cp.async.cg.shared.global.16.s")?;
                e(self
                    .b
                    .build_call(cp, &[dst.into(), src.into(), bytes.into()], ""))?;
            } else {
                let copy = self.copy16_fn();
                e(self
                    .b
                    .build_call(copy, &[src.into(), dst.into(), keep.into()], ""))?;
            }
            self.end_warp_op(None, saved)?;
        }
        if let Some(_f) = self.begin_warp_op(ASYNC_WAIT, true) {
            if gpu {
                let wait = self.intrinsic_fixed("llvm.nvvm.cp.async.wait.all")?;
                e(self.b.build_call(wait, &[], ""))?;
            }
            self.end_warp_op(None, saved)?;
        }
        Ok(())
    }
}
