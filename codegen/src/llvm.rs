//! Kernels as LLVM IR (inkwell), generated once and lowered two ways.
//!
//! Each kernel `K` is an internal function `K.body(i64 i, ptr in0, ..., ptr out)` over
//! generic pointers computing element `i`. The targets add entry points to a copy of the
//! module:
//! - PTX: `K(ptr addrspace(1) in0, ..., ptr addrspace(1) out, i64 n)` with the
//!   `ptx_kernel` calling convention (71); `i = ctaid.x * ntid.x + tid.x`, nothing when
//!   `i >= n`; the global pointers are cast to generic ones for the body (the optimizer's
//!   address-space inference turns its accesses back into `ld.global` / `st.global`);
//! - host: `K.host(ptr args, i64 n)`, a loop over `i` in `0..n` with the buffers read from
//!   the `args` array: the thread index becomes a loop index.
//!
//! A team kernel ([`Kernel::team`] > 1; `team/`) is phases instead of a body, one GPU
//! block per index: its PTX entry runs them with barriers between, its host entry runs
//! each phase for every lane in turn.
//!
//! Math functions are generated into the module (no libm on a GPU) with the CPU
//! runtime's algorithms: `exp` and `erf` exactly as `runtime/src/kernels/math.rs`; `log`
//! and `tanh` as Cephes' single-precision `logf` / `tanhf` (within 2 ulp of libm).

use crate::kernel::{classes, Attn, Body, Buf, Elt, Kernel, Line, Reduce};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::{Linkage, Module};
use inkwell::types::{BasicMetadataTypeEnum, BasicTypeEnum, FloatType};
use inkwell::values::{
    BasicMetadataValueEnum, BasicValue, BasicValueEnum, FloatValue, FunctionValue, IntValue,
    PointerValue,
};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};
use nnscaler_dialects::scalar::{Bin, Expr, Un};
use std::cell::RefCell;
use std::collections::HashMap;

mod adamw;
mod entries;
mod math;
mod mma;
mod prims;
mod rows;
mod team;
mod tiles;

use rows::*;

/// Errors of the LLVM builder, as messages.
pub type R<T> = Result<T, String>;

fn e<T, E: std::fmt::Display>(r: Result<T, E>) -> R<T> {
    r.map_err(|e| format!("LLVM builder: {e}"))
}

/// What a kernel body of one thread an index is generated over ([`Gen::body`] and its
/// `body_*` methods): the kernel, the index `i` (an element or a row), and the pointers
/// to its input and output buffers.
#[derive(Clone, Copy)]
struct At<'a, 'ctx> {
    k: &'a Kernel,
    i: IntValue<'ctx>,
    ins: &'a [PointerValue<'ctx>],
    outs: &'a [PointerValue<'ctx>],
}

/// Builds kernels into one module.
pub struct Gen<'ctx> {
    /// The LLVM context.
    pub ctx: &'ctx Context,
    /// The module the kernels go into.
    pub module: Module<'ctx>,
    b: Builder<'ctx>,
    /// The team kernels built ([`Kernel::team`] > 1): how their entries run them.
    teams: RefCell<HashMap<String, team::Plan>>,
    /// Each kernel's compiled index count, which its entries never exceed whatever count
    /// they are launched with (none: a reducer, launched over any count).
    limits: RefCell<HashMap<String, u64>>,
    /// The element type of each buffer parameter of the kernel being built (a pointer
    /// not listed, such as a lane's own array, holds f32s): [`Gen::ldf`] and
    /// [`Gen::stf`] widen and round for [`Elt::Bf16`] buffers.
    elts: RefCell<HashMap<PointerValue<'ctx>, Elt>>,
}

impl std::fmt::Debug for Gen<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gen")
            .field("module", &self.module.get_name())
            .finish()
    }
}

impl<'ctx> Gen<'ctx> {
    /// An empty module named `name`.
    pub fn new(ctx: &'ctx Context, name: &str) -> Self {
        Gen {
            ctx,
            module: ctx.create_module(name),
            b: ctx.create_builder(),
            teams: RefCell::new(HashMap::new()),
            limits: RefCell::new(HashMap::new()),
            elts: RefCell::new(HashMap::new()),
        }
    }

    /// Adds a kernel's code: `K.body(i64 i, ptr buffers...)` (inputs, then outputs), or a
    /// team kernel's phases (`team/`).
    pub fn kernel(&self, k: &Kernel) -> R<()> {
        self.kernel_facts(k)?;
        if k.team() > 1 {
            return self.team_kernel(k);
        }
        let i64t = self.ctx.i64_type();
        let ptr = self.ctx.ptr_type(AddressSpace::default());
        let nb = k.inputs.len() + k.outputs.len();
        let mut params: Vec<BasicMetadataTypeEnum> = vec![i64t.into()];
        params.extend(std::iter::repeat_n(BasicMetadataTypeEnum::from(ptr), nb));
        let f = self.module.add_function(
            &format!("{}.body", k.name),
            self.ctx.void_type().fn_type(&params, false),
            Some(Linkage::Internal),
        );
        let inline = self
            .ctx
            .create_enum_attribute(Attribute::get_named_enum_kind_id("alwaysinline"), 0);
        f.add_attribute(AttributeLoc::Function, inline);
        let entry = self.ctx.append_basic_block(f, "entry");
        self.b.position_at_end(entry);
        let i = f.get_nth_param(0).ok_or("no index")?.into_int_value();
        let bufs: Vec<PointerValue<'ctx>> = (0..nb)
            .map(|j| {
                f.get_nth_param(1 + j as u32)
                    .map(|p| p.into_pointer_value())
                    .ok_or_else(|| "missing buffer parameter".to_string())
            })
            .collect::<R<_>>()?;
        let all: Vec<&Buf> = k.inputs.iter().chain(&k.outputs).collect();
        self.buffer_elts(&bufs, &all);
        let (ins, outs) = bufs.split_at(k.inputs.len());
        self.body(k, i, ins, outs)?;
        e(self.b.build_return(None))?;
        Ok(())
    }

    fn body(
        &self,
        k: &Kernel,
        i: IntValue<'ctx>,
        ins: &[PointerValue<'ctx>],
        outs: &[PointerValue<'ctx>],
    ) -> R<()> {
        let at = &At { k, i, ins, outs };
        match &k.body {
            Body::Map(exprs) => self.body_map(at, exprs)?,
            Body::Reduce { op, dims } => self.body_reduce(at, op, dims)?,
            Body::ReducePart { .. }
            | Body::ColReduce { .. }
            | Body::NormGradColTiles { .. }
            | Body::EmbeddingGradRows { .. }
            | Body::AttnTiles(_)
            | Body::AttnTilesBack(_)
            | Body::AttnTilesKv(_)
            | Body::AttnMma(_)
            | Body::AttnMmaBack(_)
            | Body::AttnMmaKv(_) => return Err(format!("{} is a team kernel", k.name)),
            Body::Lines { op, dim } => self.body_lines(at, op, dim)?,
            Body::Transpose(perm) => self.body_transpose(at, perm)?,
            Body::Norm { rms, eps } => self.body_norm(at, rms, eps)?,
            Body::NormGradRows { rms, eps } => self.body_norm_grad_rows(at, rms, eps)?,
            Body::NormGradCols { rms } => self.body_norm_grad_cols(at, rms)?,
            Body::Embedding { sharded } => self.body_embedding(at, sharded)?,
            Body::Pick { sharded } => self.body_pick(at, sharded)?,
            Body::XentGradLse { count, sharded } => self.body_xent_grad_lse(at, count, sharded)?,
            Body::EmbeddingLinks { rows } => self.body_embedding_links(at, rows)?,
            Body::EmbeddingGradLists => self.body_embedding_grad_lists(at)?,
            Body::XentRows => self.body_xent_rows(at)?,
            Body::MeanOf { count } => self.body_mean_of(at, count)?,
            Body::XentGrad { count } => self.body_xent_grad(at, count)?,
            Body::AdamW { b1, b2, eps, wd } => {
                let c = self.adamw_scalars((*b1, *b2, *eps), &[*wd], &ins[4..])?;
                self.adamw_elt(&c, 0, &ins[..4], outs, i)?;
            }
            Body::AdamWMulti {
                b1,
                b2,
                eps,
                wds,
                lens,
            } => {
                let n = lens.len();
                let c = self.adamw_scalars((*b1, *b2, *eps), wds, &ins[4 * n..])?;
                let mut starts = Vec::with_capacity(n + 1);
                let mut next = 0;
                for l in lens {
                    starts.push(next);
                    next += l;
                }
                starts.push(next);
                self.adamw_search(&c, ins, outs, i, &starts, 0..n)?;
            }
            Body::Copy => self.copy_elt(ins[0], i, outs[0], i, k.inputs[0].elt)?,
            Body::Rotary { s, d } => self.body_rotary(at, s, d)?,
            Body::Dropout {
                p,
                seed,
                global,
                step,
            } => self.body_dropout(at, p, seed, global, step)?,
            Body::Place { dim, starts } => self.body_place(at, dim, starts)?,
            Body::Window { dim, start } => self.body_window(at, dim, start)?,
            Body::PickGrad => self.body_pick_grad(at)?,
            Body::MaxGrad { dims } => self.body_max_grad(at, dims)?,
            Body::Gemm(m) => self.body_gemm(at, m)?,
            Body::Attention(a) => self.body_attention(at, a)?,
            Body::AttnStats(a) => self.body_attn_stats(at, a)?,
            Body::AttnDq(a) => self.body_attn_dq(at, a)?,
            Body::AttnDkDv(a) => self.body_attn_dk_dv(at, a)?,
            Body::ClipScale { max_norm } => self.body_clip_scale(at, max_norm)?,
        }
        Ok(())
    }

    /// [`Body::Map`].
    fn body_map(&self, at: &At<'_, 'ctx>, exprs: &[Expr]) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let out = &k.outputs[0].shape;
        let mut loaded: Vec<Option<FloatValue<'ctx>>> = vec![None; k.inputs.len()];
        let mut vals = Vec::new();
        for x in exprs {
            vals.push(self.expr(x, &mut |g: &Self, j: usize| {
                if let Some(v) = loaded[j] {
                    return Ok(v);
                }
                let off = g.broadcast_offset(i, &k.inputs[j].shape, out)?;
                let v = g.ldf(ins[j], off)?;
                loaded[j] = Some(v);
                Ok(v)
            })?);
        }
        for (o, v) in outs.iter().zip(vals) {
            self.stf(*o, i, v)?;
        }
        Ok(())
    }

    /// [`Body::Reduce`].
    fn body_reduce(&self, at: &At<'_, 'ctx>, op: &Reduce, dims: &[usize]) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let f32t = self.ctx.f32_type();
        let f64t = self.ctx.f64_type();
        let shape = &k.inputs[0].shape;
        let base = self.reduce_base(shape, dims, i)?;
        let count: usize = dims.iter().map(|&d| shape[d]).product();
        let off_of = |g: &Self, r: IntValue<'ctx>| g.reduce_off(shape, dims, base, r);
        let v = match op {
            Reduce::Max => {
                let acc = self.var(self.fconst(f32::NEG_INFINITY).into())?;
                self.for_range(self.i64c(count), |g, r| {
                    let x = g.ldf(ins[0], off_of(g, r)?)?;
                    g.set(acc, g.maxf(g.getf(acc, f32t)?, x)?)
                })?;
                self.getf(acc, f32t)?
            }
            Reduce::Sum | Reduce::Mean(_) => {
                let acc = self.var(self.dconst(0.0).into())?;
                self.for_range(self.i64c(count), |g, r| {
                    let x = g.ext(g.ldf(ins[0], off_of(g, r)?)?)?;
                    g.set(acc, g.fadd(g.getf(acc, f64t)?, x)?)
                })?;
                let mut s = self.getf(acc, f64t)?;
                if let Reduce::Mean(n) = op {
                    s = self.fdiv(s, self.dconst(*n as f64))?;
                }
                self.trunc(s)?
            }
        };
        self.stf(outs[0], i, v)?;
        Ok(())
    }

    /// [`Body::Lines`].
    fn body_lines(&self, at: &At<'_, 'ctx>, op: &Line, dim: &usize) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let f32t = self.ctx.f32_type();
        let shape = &k.inputs[0].shape;
        let n: usize = shape[*dim];
        let inner: usize = shape[dim + 1..].iter().product();
        let o = self.div_i(i, inner)?;
        let ii = self.rem_i(i, inner)?;
        let base = self.add_i(self.mul_i(o, self.i64c(n * inner))?, ii)?;
        let off = |g: &Self, j: IntValue<'ctx>| -> R<IntValue<'ctx>> {
            g.add_i(base, g.mul_i(j, g.i64c(inner))?)
        };
        let nn = self.i64c(n);
        let exp = self.exp_fn()?;
        match op {
            Line::Softmax | Line::LogSoftmax => {
                let mx = self.var(self.fconst(f32::NEG_INFINITY).into())?;
                self.for_range(nn, |g, j| {
                    let x = g.ldf(ins[0], off(g, j)?)?;
                    g.set(mx, g.maxf(g.getf(mx, f32t)?, x)?)
                })?;
                let m = self.getf(mx, f32t)?;
                let sum = self.var(self.fconst(0.0).into())?;
                let soft = *op == Line::Softmax;
                self.for_range(nn, |g, j| {
                    let at = off(g, j)?;
                    let y = g.call(exp, &[g.fsub(g.ldf(ins[0], at)?, m)?])?;
                    if soft {
                        g.stf(outs[0], at, y)?;
                    }
                    g.set(sum, g.fadd(g.getf(sum, f32t)?, y)?)
                })?;
                let s = self.getf(sum, f32t)?;
                if soft {
                    let inv = self.fdiv(self.fconst(1.0), s)?;
                    self.for_range(nn, |g, j| {
                        let at = off(g, j)?;
                        g.stf(outs[0], at, g.fmul(g.ldf(outs[0], at)?, inv)?)
                    })?;
                } else {
                    let lse = self.fadd(m, self.call(self.log_fn()?, &[s])?)?;
                    self.for_range(nn, |g, j| {
                        let at = off(g, j)?;
                        g.stf(outs[0], at, g.fsub(g.ldf(ins[0], at)?, lse)?)
                    })?;
                }
            }
            Line::SoftmaxGrad | Line::LogSoftmaxGrad => {
                let acc = self.var(self.fconst(0.0).into())?;
                let dot = *op == Line::SoftmaxGrad;
                self.for_range(nn, |g, j| {
                    let at = off(g, j)?;
                    let d = g.ldf(ins[0], at)?;
                    let t = if dot {
                        g.fmul(d, g.ldf(ins[1], at)?)?
                    } else {
                        d
                    };
                    g.set(acc, g.fadd(g.getf(acc, f32t)?, t)?)
                })?;
                let s = self.getf(acc, f32t)?;
                self.for_range(nn, |g, j| {
                    let at = off(g, j)?;
                    let (d, y) = (g.ldf(ins[0], at)?, g.ldf(ins[1], at)?);
                    let v = if dot {
                        g.fmul(y, g.fsub(d, s)?)?
                    } else {
                        g.fsub(d, g.fmul(g.call(exp, &[y])?, s)?)?
                    };
                    g.stf(outs[0], at, v)
                })?;
            }
        }
        Ok(())
    }

    /// [`Body::Transpose`].
    fn body_transpose(&self, at: &At<'_, 'ctx>, perm: &[usize]) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let out = &k.outputs[0].shape;
        let ist = strides(&k.inputs[0].shape);
        let mut rem = i;
        let mut src = self.i64c(0);
        for d in (0..out.len()).rev() {
            let c = self.rem_i(rem, out[d])?;
            rem = self.div_i(rem, out[d])?;
            src = self.add_i(src, self.mul_i(c, self.i64c(ist[perm[d]]))?)?;
        }
        self.copy_elt(ins[0], src, outs[0], i, k.inputs[0].elt)?;
        Ok(())
    }

    /// [`Body::Norm`].
    fn body_norm(&self, at: &At<'_, 'ctx>, rms: &bool, eps: &f64) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let h = k.inputs[1].shape[0];
        let base = self.mul_i(i, self.i64c(h))?;
        let (mean, scale) = self.moments(ins[0], base, h, *rms, *eps)?;
        self.for_range(self.i64c(h), |g, j| {
            let at = g.add_i(base, j)?;
            let x = g.ldf(ins[0], at)?;
            let w = g.ldf(ins[1], j)?;
            let v = if *rms {
                g.fmul(g.fmul(x, scale)?, w)?
            } else {
                let b = g.ldf(ins[2], j)?;
                g.fadd(g.fmul(g.fmul(g.fsub(x, mean)?, scale)?, w)?, b)?
            };
            g.stf(outs[0], at, v)
        })?;
        Ok(())
    }

    /// [`Body::NormGradRows`].
    fn body_norm_grad_rows(&self, at: &At<'_, 'ctx>, rms: &bool, eps: &f64) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let f64t = self.ctx.f64_type();
        let h = k.inputs[2].shape[0];
        let hh = self.i64c(h);
        let base = self.mul_i(i, hh)?;
        let (mean, r) = self.moments(ins[1], base, h, *rms, *eps)?;
        let xhat = |g: &Self, x: FloatValue<'ctx>| g.fmul(g.fsub(x, mean)?, r);
        let a1 = self.var(self.dconst(0.0).into())?;
        let a2 = self.var(self.dconst(0.0).into())?;
        self.for_range(hh, |g, j| {
            let at = g.add_i(base, j)?;
            let (d, x, w) = (g.ldf(ins[0], at)?, g.ldf(ins[1], at)?, g.ldf(ins[2], j)?);
            if *rms {
                let t = g.ext(g.fmul(g.fmul(d, w)?, x)?)?;
                g.set(a1, g.fadd(g.getf(a1, f64t)?, t)?)
            } else {
                let gw = g.fmul(d, w)?;
                let xh = xhat(g, x)?;
                g.set(a1, g.fadd(g.getf(a1, f64t)?, g.ext(gw)?)?)?;
                let t = g.ext(g.fmul(gw, xh)?)?;
                g.set(a2, g.fadd(g.getf(a2, f64t)?, t)?)
            }
        })?;
        let hd = self.dconst(h as f64);
        let m1 = self.trunc(self.fdiv(self.getf(a1, f64t)?, hd)?)?;
        let m2 = self.trunc(self.fdiv(self.getf(a2, f64t)?, hd)?)?;
        let kk = if *rms {
            self.fmul(self.fmul(m1, r)?, r)?
        } else {
            m1
        };
        self.for_range(hh, |g, j| {
            let at = g.add_i(base, j)?;
            let (d, x, w) = (g.ldf(ins[0], at)?, g.ldf(ins[1], at)?, g.ldf(ins[2], j)?);
            let gw = g.fmul(d, w)?;
            let v = if *rms {
                g.fmul(r, g.fsub(gw, g.fmul(x, kk)?)?)?
            } else {
                let xh = xhat(g, x)?;
                g.fmul(r, g.fsub(g.fsub(gw, m1)?, g.fmul(xh, m2)?)?)?
            };
            g.stf(outs[0], at, v)
        })?;
        let s = self.mul_i(i, self.i64c(2))?;
        self.stf(outs[1], s, mean)?;
        self.stf(outs[1], self.add_i(s, self.i64c(1))?, r)?;
        Ok(())
    }

    /// [`Body::NormGradCols`].
    fn body_norm_grad_cols(&self, at: &At<'_, 'ctx>, rms: &bool) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let f64t = self.ctx.f64_type();
        let rows = k.inputs[2].shape[0];
        let h = k.inputs[0].len() / rows.max(1);
        let dw = self.var(self.dconst(0.0).into())?;
        let db = self.var(self.dconst(0.0).into())?;
        self.for_range(self.i64c(rows), |g, row| {
            let at = g.add_i(g.mul_i(row, g.i64c(h))?, i)?;
            let (d, x) = (g.ldf(ins[0], at)?, g.ldf(ins[1], at)?);
            let s = g.mul_i(row, g.i64c(2))?;
            let mean = g.ldf(ins[2], s)?;
            let r = g.ldf(ins[2], g.add_i(s, g.i64c(1))?)?;
            let t = if *rms {
                g.fmul(g.fmul(d, x)?, r)?
            } else {
                g.fmul(d, g.fmul(g.fsub(x, mean)?, r)?)?
            };
            g.set(dw, g.fadd(g.getf(dw, f64t)?, g.ext(t)?)?)?;
            g.set(db, g.fadd(g.getf(db, f64t)?, g.ext(d)?)?)
        })?;
        self.stf(outs[0], i, self.trunc(self.getf(dw, f64t)?)?)?;
        if !rms {
            self.stf(outs[1], i, self.trunc(self.getf(db, f64t)?)?)?;
        }
        Ok(())
    }

    /// [`Body::Embedding`].
    fn body_embedding(&self, at: &At<'_, 'ctx>, sharded: &bool) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let (v, w) = (k.inputs[1].shape[0], k.inputs[1].shape[1]);
        let t = self.div_i(i, w)?;
        let c = self.rem_i(i, w)?;
        let id = self.ldi(ins[0], t)?;
        let off = if *sharded {
            self.ldi(ins[2], self.i64c(0))?
        } else {
            self.i64c(0)
        };
        let row = self.e_sub(id, off)?;
        // Unsigned: a negative row wraps above v.
        let inside = e(self
            .b
            .build_int_compare(IntPredicate::ULT, row, self.i64c(v), ""))?;
        self.stf(outs[0], i, self.fconst(0.0))?;
        self.when(inside, |g| {
            let at = g.add_i(g.mul_i(row, g.i64c(w))?, c)?;
            g.stf(outs[0], i, g.ldf(ins[1], at)?)
        })?;
        Ok(())
    }

    /// [`Body::Pick`].
    fn body_pick(&self, at: &At<'_, 'ctx>, sharded: &bool) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let v = classes(&k.inputs[0]);
        let off = if *sharded {
            self.ldi(ins[2], self.i64c(0))?
        } else {
            self.i64c(0)
        };
        let col = self.e_sub(self.ldi(ins[1], i)?, off)?;
        let inside = e(self
            .b
            .build_int_compare(IntPredicate::ULT, col, self.i64c(v), ""))?;
        self.stf(outs[0], i, self.fconst(0.0))?;
        self.when(inside, |g| {
            let at = g.add_i(g.mul_i(i, g.i64c(v))?, col)?;
            g.stf(outs[0], i, g.ldf(ins[0], at)?)
        })?;
        Ok(())
    }

    /// [`Body::XentGradLse`].
    fn body_xent_grad_lse(&self, at: &At<'_, 'ctx>, count: &usize, sharded: &bool) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        // ins: dloss, logits [rows, v], targets, lse [rows, 1] (, offset).
        let v = classes(&k.inputs[1]);
        let exp = self.exp_fn()?;
        let dl = self.ldf(ins[0], self.i64c(0))?;
        let scale = self.fdiv(dl, self.fconst(*count as f32))?;
        let lse = self.ldf(ins[3], i)?;
        let off = if *sharded {
            self.ldi(ins[4], self.i64c(0))?
        } else {
            self.i64c(0)
        };
        let col = self.e_sub(self.ldi(ins[2], i)?, off)?;
        let base = self.mul_i(i, self.i64c(v))?;
        self.for_range(self.i64c(v), |g, j| {
            let at = g.add_i(base, j)?;
            let y = g.call(exp, &[g.fsub(g.ldf(ins[1], at)?, lse)?])?;
            let y = g.fmul(y, scale)?;
            let hit = e(g.b.build_int_compare(IntPredicate::EQ, j, col, ""))?;
            let y = e(g.b.build_select(hit, g.fsub(y, scale)?, y, ""))?.into_float_value();
            g.stf(outs[0], at, y)
        })?;
        Ok(())
    }

    /// [`Body::EmbeddingLinks`].
    fn body_embedding_links(&self, at: &At<'_, 'ctx>, rows: &usize) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let n = k.inputs[0].len();
        let id = self.ldi(ins[0], i)?;
        let inside = e(self
            .b
            .build_int_compare(IntPredicate::ULT, id, self.i64c(*rows), ""))?;
        // The first later token with the id (n: none); whether an earlier has it.
        let next = self.var(self.i64c(n).into())?;
        let head = self.var(self.i64c(1).into())?;
        self.for_range(self.i64c(n), |g, u| {
            let same =
                e(g.b.build_int_compare(IntPredicate::EQ, g.ldi(ins[0], u)?, id, ""))?;
            let before = e(g.b.build_int_compare(IntPredicate::ULT, u, i, ""))?;
            let after = e(g.b.build_int_compare(IntPredicate::UGT, u, i, ""))?;
            let first =
                e(g.b.build_int_compare(IntPredicate::EQ, g.geti(next)?, g.i64c(n), ""))?;
            let earlier = e(g.b.build_and(same, before, ""))?;
            let later = e(g.b.build_and(same, e(g.b.build_and(after, first, ""))?, ""))?;
            let h = e(g.b.build_select(earlier, g.i64c(0), g.geti(head)?, ""))?;
            g.set(head, h)?;
            let x = e(g.b.build_select(later, u, g.geti(next)?, ""))?;
            g.set(next, x)
        })?;
        let nx = self.geti(next)?;
        let is_head =
            e(self
                .b
                .build_int_compare(IntPredicate::NE, self.geti(head)?, self.i64c(0), ""))?;
        let link = e(self
            .b
            .build_select(is_head, nx, self.add_i(nx, self.i64c(n + 1))?, ""))?
        .into_int_value();
        let link = e(self
            .b
            .build_select(inside, link, self.i64c(-1i64 as usize), ""))?;
        let at = self.at(outs[0], Elt::I64, i)?;
        align8(e(self.b.build_store(at, link))?.into())?;
        Ok(())
    }

    /// [`Body::EmbeddingGradLists`].
    fn body_embedding_grad_lists(&self, at: &At<'_, 'ctx>) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        // ins: dy [n, w], ids [n], links [n]; out: the table [rows, w].
        let w = k.outputs[0].shape[1];
        let n = k.inputs[2].len();
        let t = self.div_i(i, w)?;
        let c = self.rem_i(i, w)?;
        let link = self.ldi(ins[2], t)?;
        let heads = e(self
            .b
            .build_int_compare(IntPredicate::ULE, link, self.i64c(n), ""))?;
        self.when(heads, |g| {
            let acc = g.var(g.fconst(0.0).into())?;
            // Along the list: each token's dy, then on to its link (less the
            // non-head mark, n + 1), until n.
            g.walk(t, g.i64c(n), |g, u| {
                let d = g.ldf(ins[0], g.add_i(g.mul_i(u, g.i64c(w))?, c)?)?;
                g.set(acc, g.fadd(g.getf(acc, g.ctx.f32_type())?, d)?)?;
                let l = g.ldi(ins[2], u)?;
                let marked = e(g.b.build_int_compare(IntPredicate::UGT, l, g.i64c(n), ""))?;
                let unmarked = g.e_sub(l, g.i64c(n + 1))?;
                Ok(e(g.b.build_select(marked, unmarked, l, ""))?.into_int_value())
            })?;
            let row = g.ldi(ins[1], t)?;
            let at = g.add_i(g.mul_i(row, g.i64c(w))?, c)?;
            g.stf(outs[0], at, g.getf(acc, g.ctx.f32_type())?)
        })?;
        Ok(())
    }

    /// [`Body::XentRows`].
    fn body_xent_rows(&self, at: &At<'_, 'ctx>) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let f32t = self.ctx.f32_type();
        let f64t = self.ctx.f64_type();
        let v = classes(&k.inputs[0]);
        let base = self.mul_i(i, self.i64c(v))?;
        let exp = self.exp_fn()?;
        let mx = self.var(self.fconst(f32::NEG_INFINITY).into())?;
        self.for_range(self.i64c(v), |g, j| {
            let z = g.ldf(ins[0], g.add_i(base, j)?)?;
            g.set(mx, g.maxf(g.getf(mx, f32t)?, z)?)
        })?;
        let m = self.getf(mx, f32t)?;
        let sum = self.var(self.dconst(0.0).into())?;
        self.for_range(self.i64c(v), |g, j| {
            let z = g.ldf(ins[0], g.add_i(base, j)?)?;
            let y = g.ext(g.call(exp, &[g.fsub(z, m)?])?)?;
            g.set(sum, g.fadd(g.getf(sum, f64t)?, y)?)
        })?;
        // ln of the f64 sum rounded to f32 (>= 1, so 6e-8 absolute at most).
        let ls = self.call(self.log_fn()?, &[self.trunc(self.getf(sum, f64t)?)?])?;
        let lse = self.fadd(self.ext(m)?, self.ext(ls)?)?;
        let target = self.ldi(ins[1], i)?;
        let inside = e(self
            .b
            .build_int_compare(IntPredicate::ULT, target, self.i64c(v), ""))?;
        // A target outside the vocabulary gives NaN (the reference refuses it).
        self.stf(outs[0], i, self.fconst(f32::NAN))?;
        self.when(inside, |g| {
            let z = g.ext(g.ldf(ins[0], g.add_i(base, target)?)?)?;
            g.stf(outs[0], i, g.trunc(g.fsub(lse, z)?)?)
        })?;
        Ok(())
    }

    /// [`Body::MeanOf`].
    fn body_mean_of(&self, at: &At<'_, 'ctx>, count: &usize) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let f64t = self.ctx.f64_type();
        let n = k.inputs[0].len();
        let acc = self.var(self.dconst(0.0).into())?;
        self.for_range(self.i64c(n), |g, r| {
            let x = g.ext(g.ldf(ins[0], r)?)?;
            g.set(acc, g.fadd(g.getf(acc, f64t)?, x)?)
        })?;
        let m = self.fdiv(self.getf(acc, f64t)?, self.dconst(*count as f64))?;
        self.stf(outs[0], i, self.trunc(m)?)?;
        Ok(())
    }

    /// [`Body::XentGrad`].
    fn body_xent_grad(&self, at: &At<'_, 'ctx>, count: &usize) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let f32t = self.ctx.f32_type();
        let v = classes(&k.inputs[1]);
        let base = self.mul_i(i, self.i64c(v))?;
        let exp = self.exp_fn()?;
        let dl = self.ldf(ins[0], self.i64c(0))?;
        let scale = self.fdiv(dl, self.fconst(*count as f32))?;
        let mx = self.var(self.fconst(f32::NEG_INFINITY).into())?;
        self.for_range(self.i64c(v), |g, j| {
            let z = g.ldf(ins[1], g.add_i(base, j)?)?;
            g.set(mx, g.maxf(g.getf(mx, f32t)?, z)?)
        })?;
        let m = self.getf(mx, f32t)?;
        let sum = self.var(self.fconst(0.0).into())?;
        self.for_range(self.i64c(v), |g, j| {
            let at = g.add_i(base, j)?;
            let y = g.call(exp, &[g.fsub(g.ldf(ins[1], at)?, m)?])?;
            g.stf(outs[0], at, y)?;
            g.set(sum, g.fadd(g.getf(sum, f32t)?, y)?)
        })?;
        let inv = self.fdiv(self.fconst(1.0), self.getf(sum, f32t)?)?;
        let target = self.ldi(ins[2], i)?;
        self.for_range(self.i64c(v), |g, j| {
            let at = g.add_i(base, j)?;
            let y = g.fmul(g.ldf(outs[0], at)?, inv)?;
            let hit = e(g.b.build_int_compare(IntPredicate::EQ, j, target, ""))?;
            let y = e(g.b.build_select(hit, g.fsub(y, g.fconst(1.0))?, y, ""))?.into_float_value();
            g.stf(outs[0], at, g.fmul(y, scale)?)
        })?;
        Ok(())
    }

    /// [`Body::Rotary`].
    fn body_rotary(&self, at: &At<'_, 'ctx>, s: &usize, d: &usize) -> R<()> {
        let At { i, ins, outs, .. } = *at;
        // ins: x, cos, sin (tables [s, d/2]).
        let half = d / 2;
        let jj = self.rem_i(i, *d)?;
        let p = self.rem_i(self.div_i(i, *d)?, *s)?;
        let base = self.e_sub(i, jj)?;
        let first = e(self
            .b
            .build_int_compare(IntPredicate::ULT, jj, self.i64c(half), ""))?;
        let j = e(self
            .b
            .build_select(first, jj, self.e_sub(jj, self.i64c(half))?, ""))?
        .into_int_value();
        let t = self.add_i(self.mul_i(p, self.i64c(half))?, j)?;
        let (c, sn) = (self.ldf(ins[1], t)?, self.ldf(ins[2], t)?);
        let a = self.ldf(ins[0], self.add_i(base, j)?)?;
        let b = self.ldf(ins[0], self.add_i(self.add_i(base, j)?, self.i64c(half))?)?;
        // out[j] = a cos - b sin; out[j + half] = b cos + a sin.
        let lo = self.fsub(self.fmul(a, c)?, self.fmul(b, sn)?)?;
        let hi = self.fadd(self.fmul(b, c)?, self.fmul(a, sn)?)?;
        let v = e(self.b.build_select(first, lo, hi, ""))?.into_float_value();
        self.stf(outs[0], i, v)?;
        Ok(())
    }

    /// [`Body::Dropout`].
    fn body_dropout(
        &self,
        at: &At<'_, 'ctx>,
        p: &f64,
        seed: &u64,
        global: &Option<Vec<usize>>,
        step: &bool,
    ) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let i64t = self.ctx.i64_type();
        // The runtime's rng: bits(seed, stream, index) =
        // mix64(mix64(seed ^ mix64(stream)) ^ index); with a step, the seed is
        // bits(seed, 0x5eed, step) first.
        let mut sd = i64t.const_int(*seed, false);
        if *step {
            let t = self.ldf(ins[1], self.i64c(0))?;
            let t = e(self.b.build_float_to_unsigned_int(t, i64t, ""))?;
            sd = self.rng_bits(sd, 0x5eed, t)?;
        }
        // The element's index in the whole tensor (on a shard: its coordinates
        // moved by the shard's offsets, the last input).
        let index = match global {
            None => i,
            Some(g) => {
                let offsets = ins[k.inputs.len() - 1];
                let local = &k.inputs[0].shape;
                let gst = strides(g);
                let mut rem = i;
                let mut idx = self.i64c(0);
                for d in (0..local.len()).rev() {
                    let c = self.rem_i(rem, local[d])?;
                    rem = self.div_i(rem, local[d])?;
                    let o = self.ldi(offsets, self.i64c(d))?;
                    idx = self.add_i(idx, self.mul_i(self.add_i(c, o)?, self.i64c(gst[d]))?)?;
                }
                idx
            }
        };
        let bits = self.rng_bits(sd, 0x0064_726f_706f_7574, index)?;
        let top = e(self
            .b
            .build_right_shift(bits, i64t.const_int(11, false), false, ""))?;
        let u = e(self
            .b
            .build_unsigned_int_to_float(top, self.ctx.f64_type(), ""))?;
        let u = self.fmul(u, self.dconst(1.0 / (1u64 << 53) as f64))?;
        let x = self.ldf(ins[0], i)?;
        let scale = self.fconst((1.0 / (1.0 - p)) as f32);
        let kept = self.fmul(x, scale)?;
        let v = self.select(
            FloatPredicate::OGE,
            u,
            self.dconst(*p),
            kept,
            self.fconst(0.0),
        )?;
        self.stf(outs[0], i, v)?;
        Ok(())
    }

    /// [`Body::Place`].
    fn body_place(&self, at: &At<'_, 'ctx>, dim: &usize, starts: &[usize]) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let out = &k.outputs[0].shape;
        let elt = k.outputs[0].elt;
        let (n, inner) = (out[*dim], out[dim + 1..].iter().product::<usize>());
        let c = self.rem_i(self.div_i(i, inner)?, n)?;
        let o = self.div_i(i, n * inner)?;
        let r = self.rem_i(i, inner)?;
        self.store_zero(outs[0], elt, i)?;
        for (k_in, &st) in starts.iter().enumerate() {
            let len = k.inputs[k_in].shape[*dim];
            let rel = self.e_sub(c, self.i64c(st))?;
            // Unsigned: below the start wraps above len.
            let inside = e(self
                .b
                .build_int_compare(IntPredicate::ULT, rel, self.i64c(len), ""))?;
            self.when(inside, |g| {
                let src = g.add_i(
                    g.add_i(
                        g.mul_i(o, g.i64c(len * inner))?,
                        g.mul_i(rel, g.i64c(inner))?,
                    )?,
                    r,
                )?;
                g.copy_elt(ins[k_in], src, outs[0], i, elt)
            })?;
        }
        Ok(())
    }

    /// [`Body::Window`].
    fn body_window(&self, at: &At<'_, 'ctx>, dim: &usize, start: &usize) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let out = &k.outputs[0].shape;
        let elt = k.outputs[0].elt;
        let (n, inner) = (out[*dim], out[dim + 1..].iter().product::<usize>());
        let m = k.inputs[0].shape[*dim];
        let c = self.rem_i(self.div_i(i, inner)?, n)?;
        let o = self.div_i(i, n * inner)?;
        let r = self.rem_i(i, inner)?;
        let src = self.add_i(
            self.add_i(
                self.mul_i(o, self.i64c(m * inner))?,
                self.mul_i(self.add_i(c, self.i64c(*start))?, self.i64c(inner))?,
            )?,
            r,
        )?;
        self.copy_elt(ins[0], src, outs[0], i, elt)?;
        Ok(())
    }

    /// [`Body::PickGrad`].
    fn body_pick_grad(&self, at: &At<'_, 'ctx>) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let v = classes(&k.outputs[0]);
        let r = self.div_i(i, v)?;
        let c = self.rem_i(i, v)?;
        let t = self.ldi(ins[1], r)?;
        let hit = e(self.b.build_int_compare(IntPredicate::EQ, c, t, ""))?;
        let d = self.ldf(ins[0], r)?;
        let val = e(self.b.build_select(hit, d, self.fconst(0.0), ""))?.into_float_value();
        self.stf(outs[0], i, val)?;
        Ok(())
    }

    /// [`Body::MaxGrad`].
    fn body_max_grad(&self, at: &At<'_, 'ctx>, dims: &[usize]) -> R<()> {
        let At {
            k, i, ins, outs, ..
        } = *at;
        let f32t = self.ctx.f32_type();
        // ins: dy (the reduced shape), x.
        let shape = &k.inputs[1].shape;
        let st = strides(shape);
        // The group's first element and its index in dy (kept dims, row-major).
        let mut rem = i;
        let mut base = self.i64c(0);
        let mut o = self.i64c(0);
        let mut ostride = 1usize;
        for d in (0..shape.len()).rev() {
            let c = self.rem_i(rem, shape[d])?;
            rem = self.div_i(rem, shape[d])?;
            if !dims.contains(&d) {
                base = self.add_i(base, self.mul_i(c, self.i64c(st[d]))?)?;
                o = self.add_i(o, self.mul_i(c, self.i64c(ostride))?)?;
                ostride *= shape[d];
            }
        }
        let count: usize = dims.iter().map(|&d| shape[d]).product();
        let off_of = |g: &Self, r: IntValue<'ctx>| -> R<IntValue<'ctx>> {
            let mut rem = r;
            let mut off = base;
            for &d in dims.iter().rev() {
                let c = g.rem_i(rem, shape[d])?;
                rem = g.div_i(rem, shape[d])?;
                off = g.add_i(off, g.mul_i(c, g.i64c(st[d]))?)?;
            }
            Ok(off)
        };
        let acc = self.var(self.fconst(f32::NEG_INFINITY).into())?;
        self.for_range(self.i64c(count), |g, r| {
            let x = g.ldf(ins[1], off_of(g, r)?)?;
            g.set(acc, g.maxf(g.getf(acc, f32t)?, x)?)
        })?;
        let mx = self.getf(acc, f32t)?;
        let ties = self.var(self.fconst(0.0).into())?;
        self.for_range(self.i64c(count), |g, r| {
            let x = g.ldf(ins[1], off_of(g, r)?)?;
            let one = g.select(FloatPredicate::OEQ, x, mx, g.fconst(1.0), g.fconst(0.0))?;
            g.set(ties, g.fadd(g.getf(ties, f32t)?, one)?)
        })?;
        let share = self.fdiv(self.ldf(ins[0], o)?, self.getf(ties, f32t)?)?;
        let x = self.ldf(ins[1], i)?;
        let v = self.select(FloatPredicate::OEQ, x, mx, share, self.fconst(0.0))?;
        self.stf(outs[0], i, v)?;
        Ok(())
    }

    /// [`Body::Gemm`].
    fn body_gemm(&self, at: &At<'_, 'ctx>, m: &crate::kernel::Gemm) -> R<()> {
        let At { i, ins, outs, .. } = *at;
        let f32t = self.ctx.f32_type();
        let (mm, n, kk) = (m.m, m.n, m.k);
        let bi = self.div_i(i, mm * n)?;
        let r = self.rem_i(self.div_i(i, n)?, mm)?;
        let c = self.rem_i(i, n)?;
        let a0 = self.mul_i(bi, self.i64c(mm * kk))?;
        let b0 = if m.b_batched {
            self.mul_i(bi, self.i64c(kk * n))?
        } else {
            self.i64c(0)
        };
        let acc = self.var(self.fconst(0.0).into())?;
        self.for_range(self.i64c(kk), |g, l| {
            let ai = if m.ta {
                g.add_i(g.add_i(a0, g.mul_i(l, g.i64c(mm))?)?, r)?
            } else {
                g.add_i(g.add_i(a0, g.mul_i(r, g.i64c(kk))?)?, l)?
            };
            let bi = if m.tb {
                g.add_i(g.add_i(b0, g.mul_i(c, g.i64c(kk))?)?, l)?
            } else {
                g.add_i(g.add_i(b0, g.mul_i(l, g.i64c(n))?)?, c)?
            };
            let p = g.fmul(g.ldf(ins[0], ai)?, g.ldf(ins[1], bi)?)?;
            g.set(acc, g.fadd(g.getf(acc, f32t)?, p)?)
        })?;
        let mut v = self.getf(acc, f32t)?;
        if m.bias {
            v = self.fadd(v, self.ldf(ins[2], c)?)?;
        }
        self.stf(outs[0], i, v)?;
        Ok(())
    }

    /// [`Body::Attention`].
    fn body_attention(&self, at: &At<'_, 'ctx>, a: &Attn) -> R<()> {
        let At { i, ins, outs, .. } = *at;
        let mut row = self.attn_row(a, i, ins)?;
        let qb = self.mul_i(i, self.i64c(a.d))?;
        row.mine.q = Some(self.private_row(ins[0], qb, a.d)?);
        let (mx, inv) = self.attn_softmax(a, &row, ins[0], ins[1])?;
        let acc = self.array(a.e)?;
        self.for_range(row.lim, |g, j| {
            let p = g.attn_prob(a, &row, ins[0], ins[1], j, mx, inv)?;
            let vb = g.mul_i(g.add_i(row.kv_base, j)?, g.i64c(a.e))?;
            g.axpy(acc, p, ins[2], vb, a.e)
        })?;
        let ob = self.mul_i(row.q_row, self.i64c(a.e))?;
        self.store_array(acc, outs[0], ob, a.e)?;
        Ok(())
    }

    /// [`Body::AttnStats`].
    fn body_attn_stats(&self, at: &At<'_, 'ctx>, a: &Attn) -> R<()> {
        let At { i, ins, outs, .. } = *at;
        let f32t = self.ctx.f32_type();
        // ins: dout, q, k, v.
        let mut row = self.attn_row(a, i, ins)?;
        row.mine = self.query_rows(a, i, ins[1], ins[0])?;
        let (mx, inv) = self.attn_softmax(a, &row, ins[1], ins[2])?;
        let dot = self.var(self.fconst(0.0).into())?;
        self.for_range(row.lim, |g, j| {
            let p = g.attn_prob(a, &row, ins[1], ins[2], j, mx, inv)?;
            let dp = g.attn_dp(a, &row, ins[0], ins[3], j)?;
            g.set(dot, g.fadd(g.getf(dot, f32t)?, g.fmul(p, dp)?)?)
        })?;
        let s = self.mul_i(i, self.i64c(3))?;
        self.stf(outs[0], s, mx)?;
        self.stf(outs[0], self.add_i(s, self.i64c(1))?, inv)?;
        self.stf(outs[0], self.add_i(s, self.i64c(2))?, self.getf(dot, f32t)?)?;
        Ok(())
    }

    /// [`Body::AttnDq`].
    fn body_attn_dq(&self, at: &At<'_, 'ctx>, a: &Attn) -> R<()> {
        let At { i, ins, outs, .. } = *at;
        // ins: dout, q, k, v, stats.
        let mut row = self.attn_row(a, i, ins)?;
        row.mine = self.query_rows(a, i, ins[1], ins[0])?;
        let (mx, inv, dsum) = self.attn_stats(ins[4], row.q_row)?;
        let acc = self.array(a.d)?;
        self.for_range(row.lim, |g, j| {
            let p = g.attn_prob(a, &row, ins[1], ins[2], j, mx, inv)?;
            let dp = g.attn_dp(a, &row, ins[0], ins[3], j)?;
            let ds = g.fmul(g.fmul(p, g.fsub(dp, dsum)?)?, g.fconst(a.scale))?;
            let kb = g.mul_i(g.add_i(row.kv_base, j)?, g.i64c(a.d))?;
            g.axpy(acc, ds, ins[2], kb, a.d)
        })?;
        let ob = self.mul_i(row.q_row, self.i64c(a.d))?;
        self.store_array(acc, outs[0], ob, a.d)?;
        Ok(())
    }

    /// [`Body::AttnDkDv`].
    fn body_attn_dk_dv(&self, at: &At<'_, 'ctx>, a: &Attn) -> R<()> {
        let At { i, ins, outs, .. } = *at;
        // Key row i = (bi, kv head, j); every query head of the group, rows in order.
        let bi = self.div_i(i, a.g * a.t)?;
        let kvh = self.rem_i(self.div_i(i, a.t)?, a.g)?;
        let j = self.rem_i(i, a.t)?;
        let per = a.h / a.g;
        // Local query qi is at global position qi + off.
        let off = self.query_offset(a, ins)?;
        let dk = self.array(a.d)?;
        let dv = self.array(a.e)?;
        let mine = Mine {
            k: Some(self.private_row(ins[2], self.mul_i(i, self.i64c(a.d))?, a.d)?),
            v: Some(self.private_row(ins[3], self.mul_i(i, self.i64c(a.e))?, a.e)?),
            ..Mine::default()
        };
        self.for_range(self.i64c(per), |g, hh| {
            let hi = g.add_i(g.mul_i(kvh, g.i64c(per))?, hh)?;
            g.for_range(g.i64c(a.s), |g, qi| {
                let q_row = g.add_i(
                    g.mul_i(g.add_i(g.mul_i(bi, g.i64c(a.h))?, hi)?, g.i64c(a.s))?,
                    qi,
                )?;
                let row = AttnRow {
                    q_row,
                    kv_base: g.mul_i(g.add_i(g.mul_i(bi, g.i64c(a.g))?, kvh)?, g.i64c(a.t))?,
                    lim: g.i64c(a.t),
                    mine,
                };
                // Causal: query qi sees key j only when j <= qi.
                let seen = if a.causal {
                    let pos = g.add_i(qi, off)?;
                    e(g.b.build_int_compare(IntPredicate::ULE, j, pos, ""))?
                } else {
                    g.ctx.bool_type().const_int(1, false)
                };
                g.when(seen, |g| {
                    let (mx, inv, dsum) = g.attn_stats(ins[4], q_row)?;
                    let p = g.attn_prob(a, &row, ins[1], ins[2], j, mx, inv)?;
                    let dp = g.attn_dp(a, &row, ins[0], ins[3], j)?;
                    let ds = g.fmul(g.fmul(p, g.fsub(dp, dsum)?)?, g.fconst(a.scale))?;
                    let ob = g.mul_i(q_row, g.i64c(a.e))?;
                    g.axpy(dv, p, ins[0], ob, a.e)?;
                    let qb = g.mul_i(q_row, g.i64c(a.d))?;
                    g.axpy(dk, ds, ins[1], qb, a.d)
                })
            })
        })?;
        let kb = self.mul_i(i, self.i64c(a.d))?;
        self.store_array(dk, outs[0], kb, a.d)?;
        let vb = self.mul_i(i, self.i64c(a.e))?;
        self.store_array(dv, outs[1], vb, a.e)?;
        Ok(())
    }

    /// [`Body::ClipScale`].
    fn body_clip_scale(&self, at: &At<'_, 'ctx>, max_norm: &f64) -> R<()> {
        let At { i, ins, outs, .. } = *at;
        let s = self.ldf(ins[0], self.i64c(0))?;
        let sq = self.call(self.intrinsic("llvm.sqrt")?, &[s])?;
        let q = self.fdiv(
            self.fconst(*max_norm as f32),
            self.fadd(sq, self.fconst(1e-6))?,
        )?;
        let k = self.call(self.intrinsic("llvm.minnum")?, &[q, self.fconst(1.0)])?;
        self.stf(outs[0], i, k)?;
        Ok(())
    }

    /// A row's `(mean, 1/sqrt(var + eps))` (layer norm) or `(0, 1/sqrt(mean(x^2) + eps))`
    /// (RMS norm), accumulated in f64 in two passes as the reference does.
    fn moments(
        &self,
        x: PointerValue<'ctx>,
        base: IntValue<'ctx>,
        h: usize,
        rms: bool,
        eps: f64,
    ) -> R<(FloatValue<'ctx>, FloatValue<'ctx>)> {
        let f64t = self.ctx.f64_type();
        let hd = self.dconst(h as f64);
        let hh = self.i64c(h);
        let acc = self.var(self.dconst(0.0).into())?;
        let mean = if rms {
            self.dconst(0.0)
        } else {
            self.for_range(hh, |g, j| {
                let v = g.ext(g.ldf(x, g.add_i(base, j)?)?)?;
                g.set(acc, g.fadd(g.getf(acc, f64t)?, v)?)
            })?;
            self.fdiv(self.getf(acc, f64t)?, hd)?
        };
        let sq = self.var(self.dconst(0.0).into())?;
        self.for_range(hh, |g, j| {
            let v = g.fsub(g.ext(g.ldf(x, g.add_i(base, j)?)?)?, mean)?;
            g.set(sq, g.fadd(g.getf(sq, f64t)?, g.fmul(v, v)?)?)
        })?;
        let var = self.fdiv(self.getf(sq, f64t)?, hd)?;
        let r = self.fdiv(
            self.dconst(1.0),
            self.sqrt_d(self.fadd(var, self.dconst(eps))?)?,
        )?;
        Ok((self.trunc(mean)?, self.trunc(r)?))
    }
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Marks an i64 load or store 8-byte aligned (the IR is built before the target's data
/// layout is set, where i64's default alignment is 4, which NVPTX would split in two).
fn align8(i: Option<inkwell::values::InstructionValue<'_>>) -> R<()> {
    i.ok_or("an i64 access is not an instruction")?
        .set_alignment(8)
        .map_err(|e| format!("LLVM builder: {e}"))
}

/// `rng::mix64` at compile time (for constant streams).
fn mix64_const(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
