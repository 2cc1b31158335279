//! A kernel's entries: its compiled facts (index count and buffer sizes, exported for the
//! runtime's checks), the PTX entry (`ptx_kernel`, global pointers) and the host entry
//! (`<name>.host(ptr args, i64 n)`).

use super::*;

impl<'ctx> Gen<'ctx> {
    pub(super) fn kernel_facts(&self, k: &Kernel) -> R<()> {
        if k.any_len() {
            return Ok(());
        }
        let len = k.len as u64;
        self.limits.borrow_mut().insert(k.name.clone(), len);
        let i64t = self.ctx.i64_type();
        let global = AddressSpace::from(1u16);
        let g = self
            .module
            .add_global(i64t, Some(global), &format!("nns_len_{}", k.name));
        g.set_initializer(&i64t.const_int(len, false));
        g.set_constant(true);
        let sizes: Vec<IntValue> = k
            .inputs
            .iter()
            .chain(&k.outputs)
            .map(|b| i64t.const_int(b.bytes() as u64, false))
            .collect();
        let ty = i64t.array_type(sizes.len() as u32);
        let g = self
            .module
            .add_global(ty, Some(global), &format!("nns_sizes_{}", k.name));
        g.set_initializer(&i64t.const_array(&sizes));
        g.set_constant(true);
        Ok(())
    }

    /// The count an entry of `name` runs: `n`, at most the kernel's compiled count.
    pub(crate) fn clamped(&self, name: &str, n: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        let Some(&limit) = self.limits.borrow().get(name) else {
            return Ok(n);
        };
        let l = self.i64c(limit as usize);
        let over = e(self.b.build_int_compare(IntPredicate::UGT, n, l, ""))?;
        Ok(e(self.b.build_select(over, l, n, ""))?.into_int_value())
    }

    /// A PTX special register (`tid.x`, `ctaid.x`, ...), read and widened to i64.
    pub(super) fn sreg(&self, r: &str) -> R<IntValue<'ctx>> {
        let name = format!("llvm.nvvm.read.ptx.sreg.{r}");
        let f = self.module.get_function(&name).unwrap_or_else(|| {
            self.module
                .add_function(&name, self.ctx.i32_type().fn_type(&[], false), None)
        });
        let v = e(self.b.build_call(f, &[], ""))?
            .try_as_basic_value()
            .basic()
            .ok_or("special register read returned nothing")?
            .into_int_value();
        e(self.b.build_int_z_extend(v, self.ctx.i64_type(), ""))
    }

    /// Adds the PTX entry of a kernel whose body takes `buffers` pointers.
    pub fn ptx_entry(&self, name: &str, buffers: usize) -> R<()> {
        if let Some(plan) = self.teams.borrow().get(name) {
            return self.team_ptx_entry(name, buffers, plan);
        }
        let body = self
            .module
            .get_function(&format!("{name}.body"))
            .ok_or_else(|| format!("no body for kernel {name}"))?;
        let i64t = self.ctx.i64_type();
        let global = self.ctx.ptr_type(AddressSpace::from(1u16));
        let generic = self.ctx.ptr_type(AddressSpace::default());
        let mut params: Vec<BasicMetadataTypeEnum> = vec![global.into(); buffers];
        params.push(i64t.into());
        let f = self
            .module
            .add_function(name, self.ctx.void_type().fn_type(&params, false), None);
        f.set_call_conventions(71); // ptx_kernel
        let entry = self.ctx.append_basic_block(f, "entry");
        let run = self.ctx.append_basic_block(f, "run");
        let done = self.ctx.append_basic_block(f, "done");
        self.b.position_at_end(entry);
        let (ctaid, ntid, tid) = (
            self.sreg("ctaid.x")?,
            self.sreg("ntid.x")?,
            self.sreg("tid.x")?,
        );
        let i = e(self
            .b
            .build_int_add(e(self.b.build_int_mul(ctaid, ntid, ""))?, tid, "i"))?;
        let n = f
            .get_nth_param(buffers as u32)
            .ok_or("no length")?
            .into_int_value();
        let n = self.clamped(name, n)?;
        let inside = e(self.b.build_int_compare(IntPredicate::ULT, i, n, ""))?;
        e(self.b.build_conditional_branch(inside, run, done))?;
        self.b.position_at_end(run);
        let mut args: Vec<BasicMetadataValueEnum> = vec![i.into()];
        for j in 0..buffers {
            let p = f
                .get_nth_param(j as u32)
                .ok_or("missing buffer")?
                .into_pointer_value();
            args.push(e(self.b.build_address_space_cast(p, generic, ""))?.into());
        }
        e(self.b.build_call(body, &args, ""))?;
        e(self.b.build_unconditional_branch(done))?;
        self.b.position_at_end(done);
        e(self.b.build_return(None))?;
        Ok(())
    }

    /// Adds the host entry `name.host(ptr args, i64 n)`: the body for every `i < n`.
    pub fn host_entry(&self, name: &str, buffers: usize) -> R<()> {
        if let Some(plan) = self.teams.borrow().get(name) {
            return self.team_host_entry(name, buffers, plan);
        }
        let body = self
            .module
            .get_function(&format!("{name}.body"))
            .ok_or_else(|| format!("no body for kernel {name}"))?;
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
        let lp = self.ctx.append_basic_block(f, "loop");
        let done = self.ctx.append_basic_block(f, "done");
        self.b.position_at_end(entry);
        let argv = f.get_nth_param(0).ok_or("no args")?.into_pointer_value();
        let n = f.get_nth_param(1).ok_or("no length")?.into_int_value();
        let n = self.clamped(name, n)?;
        let mut bufs: Vec<BasicMetadataValueEnum> = Vec::new();
        for j in 0..buffers {
            // SAFETY of the generated code: `args` holds `buffers` pointers.
            let slot = e(unsafe {
                self.b
                    .build_in_bounds_gep(ptr, argv, &[i64t.const_int(j as u64, false)], "")
            })?;
            bufs.push(e(self.b.build_load(ptr, slot, ""))?.into());
        }
        let any = e(self
            .b
            .build_int_compare(IntPredicate::UGT, n, i64t.const_zero(), ""))?;
        e(self.b.build_conditional_branch(any, lp, done))?;
        self.b.position_at_end(lp);
        let phi = e(self.b.build_phi(i64t, "i"))?;
        let i = phi.as_basic_value().into_int_value();
        let mut args: Vec<BasicMetadataValueEnum> = vec![i.into()];
        args.extend(bufs);
        e(self.b.build_call(body, &args, ""))?;
        let next = e(self.b.build_int_add(i, i64t.const_int(1, false), ""))?;
        let more = e(self.b.build_int_compare(IntPredicate::ULT, next, n, ""))?;
        phi.add_incoming(&[(&i64t.const_zero(), entry), (&next, lp)]);
        e(self.b.build_conditional_branch(more, lp, done))?;
        self.b.position_at_end(done);
        e(self.b.build_return(None))?;
        Ok(())
    }
}
