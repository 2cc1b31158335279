//! Lowering a kernel module: to PTX through LLVM's NVPTX back end, or JIT-compiled for the
//! host CPU (the same bodies), where tests compare the kernels with the reference ones.

use crate::kernel::{Elt, Kernel, Lowered, Slot};
use crate::llvm::{Gen, R};
use crate::program::{BufId, Program, Work};
use inkwell::context::Context;
use inkwell::execution_engine::ExecutionEngine;
use inkwell::module::Module;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{
    CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetMachine, TargetTriple,
};
use inkwell::OptimizationLevel;

/// Which GPU and PTX version to generate for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// Compute capability times ten (90: Hopper, `sm_90`).
    pub sm: u32,
    /// PTX ISA version times ten (80: PTX 8.0, CUDA 12.0 drivers and later).
    pub ptx: u32,
}

impl Default for Gpu {
    /// H100/H200 (`sm_90`) and PTX 8.0, which every CUDA 12 and 13 driver loads.
    fn default() -> Self {
        Gpu { sm: 90, ptx: 80 }
    }
}

/// Adds the bodies of `kernels` to a fresh module: the IR both targets start from.
fn bodies<'ctx>(ctx: &'ctx Context, kernels: &[Kernel]) -> R<Gen<'ctx>> {
    let g = Gen::new(ctx, "nnscaler_kernels");
    for (j, k) in kernels.iter().enumerate() {
        if kernels[..j].iter().any(|o| o.name == k.name) {
            return Err(format!("two kernels are named {}", k.name));
        }
        g.kernel(k)?;
    }
    Ok(g)
}

fn optimize(module: &Module<'_>, tm: &TargetMachine) -> R<()> {
    module
        .verify()
        .map_err(|e| format!("generated LLVM IR does not verify: {e}"))?;
    module
        .run_passes("default<O3>", tm, PassBuilderOptions::create())
        .map_err(|e| format!("LLVM optimization failed: {e}"))
}

/// The LLVM IR of `kernels` before any target's entries (for reading and tests).
pub fn llvm_ir(kernels: &[Kernel]) -> R<String> {
    let ctx = Context::create();
    let g = bodies(&ctx, kernels)?;
    Ok(g.module.print_to_string().to_string())
}

/// A target machine (`what` names it in errors) at O3, with `g`'s module set up for it
/// and optimized.
fn lower_for(
    g: &Gen<'_>,
    what: &str,
    triple: &TargetTriple,
    cpu: &str,
    features: &str,
    reloc: RelocMode,
    code: CodeModel,
) -> R<TargetMachine> {
    let target = Target::from_triple(triple).map_err(|e| format!("LLVM {what} target: {e}"))?;
    let tm = target
        .create_target_machine(
            triple,
            cpu,
            features,
            OptimizationLevel::Aggressive,
            reloc,
            code,
        )
        .ok_or_else(|| format!("LLVM cannot make a {what} target machine"))?;
    g.module.set_triple(triple);
    g.module
        .set_data_layout(&tm.get_target_data().get_data_layout());
    optimize(&g.module, &tm)?;
    Ok(tm)
}

/// `kernels` as one PTX module for `gpu`.
pub fn ptx(kernels: &[Kernel], gpu: Gpu) -> R<String> {
    Target::initialize_nvptx(&InitializationConfig::default());
    let ctx = Context::create();
    let g = bodies(&ctx, kernels)?;
    for k in kernels {
        g.ptx_entry(&k.name, k.inputs.len() + k.outputs.len())?;
    }
    g.define_warp_ops(true)?;
    let tm = lower_for(
        &g,
        "NVPTX",
        &TargetTriple::create("nvptx64-nvidia-cuda"),
        &format!("sm_{}", gpu.sm),
        &format!("+ptx{}", gpu.ptx),
        RelocMode::Default,
        CodeModel::Default,
    )?;
    let buf = tm
        .write_to_memory_buffer(&g.module, FileType::Assembly)
        .map_err(|e| format!("PTX emission failed: {e}"))?;
    String::from_utf8(buf.as_slice().to_vec()).map_err(|e| format!("PTX is not UTF-8: {e}"))
}

/// `kernels` compiled for this CPU as a shared object (position-independent code, linked
/// by the system C compiler, `$CC` or `cc`): entry points `<name>.host(ptr args, i64 n)`.
pub fn host_shared_object(kernels: &[Kernel]) -> R<Vec<u8>> {
    Target::initialize_native(&InitializationConfig::default())
        .map_err(|e| format!("LLVM host target: {e}"))?;
    let ctx = Context::create();
    let g = bodies(&ctx, kernels)?;
    for k in kernels {
        g.host_entry(&k.name, k.inputs.len() + k.outputs.len())?;
    }
    g.define_warp_ops(false)?;
    // Generic x86-64 (not this CPU's features): the artifact may run on another machine.
    let tm = lower_for(
        &g,
        "host",
        &TargetMachine::get_default_triple(),
        "x86-64",
        "",
        RelocMode::PIC,
        CodeModel::Default,
    )?;
    let obj = tm
        .write_to_memory_buffer(&g.module, FileType::Object)
        .map_err(|e| format!("host code emission failed: {e}"))?;
    // A fresh directory of our own (mode 0700): the object and the library are written
    // and read where no other user can swap them.
    let dir = nnscaler_rt::host::private_dir("nnscaler-so")?;
    let (o, so) = (dir.join("kernels.o"), dir.join("kernels.so"));
    let result = (|| {
        std::fs::write(&o, obj.as_slice()).map_err(|e| format!("{}: {e}", o.display()))?;
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let out = std::process::Command::new(&cc)
            .arg("-shared")
            .arg("-o")
            .arg(&so)
            .arg(&o)
            .output()
            .map_err(|e| format!("cannot run the C compiler '{cc}' to link host kernels: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "linking the host kernels failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        std::fs::read(&so).map_err(|e| format!("{}: {e}", so.display()))
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Kernels JIT-compiled for the host CPU: each launch runs the body for every index in turn.
pub struct HostKernels {
    // The engine owns the module; both borrow the context, which lives as long (leaked
    // once per `HostKernels`: contexts are small, and tests make a handful).
    engine: ExecutionEngine<'static>,
    kernels: Vec<Kernel>,
}

/// A host buffer's contents.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    /// f32 elements.
    F32(Vec<f32>),
    /// i64 elements.
    I64(Vec<i64>),
    /// bf16 elements (2-byte storage: an f32's high half).
    Bf16(Vec<u16>),
}

impl Data {
    fn zeros(elt: Elt, n: usize) -> Self {
        match elt {
            Elt::F32 => Data::F32(vec![0.0; n]),
            Elt::I64 => Data::I64(vec![0; n]),
            Elt::Bf16 => Data::Bf16(vec![0; n]),
        }
    }
    fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::Bf16(v) => v.len(),
        }
    }
    fn elt(&self) -> Elt {
        match self {
            Data::F32(_) => Elt::F32,
            Data::I64(_) => Elt::I64,
            Data::Bf16(_) => Elt::Bf16,
        }
    }
    /// A pointer for a kernel to write through.
    fn ptr_mut(&mut self) -> *mut u8 {
        match self {
            Data::F32(v) => v.as_mut_ptr().cast(),
            Data::I64(v) => v.as_mut_ptr().cast(),
            Data::Bf16(v) => v.as_mut_ptr().cast(),
        }
    }
    /// A pointer for a kernel to read through (never written: kernels write outputs and
    /// temporaries only).
    fn ptr(&self) -> *mut u8 {
        match self {
            Data::F32(v) => v.as_ptr().cast_mut().cast(),
            Data::I64(v) => v.as_ptr().cast_mut().cast(),
            Data::Bf16(v) => v.as_ptr().cast_mut().cast(),
        }
    }
    fn from_bytes(elt: Elt, b: &[u8]) -> Self {
        match elt {
            Elt::F32 => Data::F32(
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
            ),
            Elt::I64 => Data::I64(
                b.chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            ),
            Elt::Bf16 => Data::Bf16(
                b.chunks_exact(2)
                    .map(|c| u16::from_le_bytes(c.try_into().expect("2 bytes")))
                    .collect(),
            ),
        }
    }
    /// The f32 elements (an error for i64 data).
    pub fn f32(&self) -> R<&[f32]> {
        match self {
            Data::F32(v) => Ok(v),
            Data::I64(_) => Err("i64 data where f32 was expected".into()),
            Data::Bf16(_) => Err("2-byte bf16 data where f32 was expected".into()),
        }
    }
}

impl std::fmt::Debug for HostKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostKernels")
            .field("kernels", &self.kernels.len())
            .finish()
    }
}

type HostFn = unsafe extern "C" fn(*const *mut u8, u64);

impl HostKernels {
    /// Compiles `kernels` for this CPU.
    pub fn new(kernels: &[Kernel]) -> R<Self> {
        Target::initialize_native(&InitializationConfig::default())
            .map_err(|e| format!("LLVM host target: {e}"))?;
        let ctx: &'static Context = Box::leak(Box::new(Context::create()));
        let g = bodies(ctx, kernels)?;
        for k in kernels {
            g.host_entry(&k.name, k.inputs.len() + k.outputs.len())?;
        }
        g.define_warp_ops(false)?;
        lower_for(
            &g,
            "host",
            &TargetMachine::get_default_triple(),
            &TargetMachine::get_host_cpu_name().to_string(),
            &TargetMachine::get_host_cpu_features().to_string(),
            RelocMode::Default,
            CodeModel::JITDefault,
        )?;
        let engine = g
            .module
            .create_jit_execution_engine(OptimizationLevel::Aggressive)
            .map_err(|e| format!("LLVM JIT: {e}"))?;
        Ok(HostKernels {
            engine,
            kernels: kernels.to_vec(),
        })
    }

    /// Runs kernel `name` on `inputs` and returns its outputs.
    pub fn run(&self, name: &str, inputs: &[&Data]) -> R<Vec<Data>> {
        let k = self.find(name)?;
        let mut outs: Vec<Data> = k
            .outputs
            .iter()
            .map(|b| Data::zeros(b.elt, b.len()))
            .collect();
        let mut args: Vec<(*mut u8, usize, Elt)> =
            inputs.iter().map(|d| (d.ptr(), d.len(), d.elt())).collect();
        for o in &mut outs {
            args.push((o.ptr_mut(), o.len(), o.elt()));
        }
        self.launch(k, &args)?;
        Ok(outs)
    }

    /// Runs an op's launches ([`Lowered`]; its kernels compiled here) on its operands.
    pub fn run_lowered(&self, l: &Lowered, inputs: &[&Data]) -> R<Vec<Data>> {
        let mut outs: Vec<Option<Data>> = Vec::new();
        let mut consts: Vec<Data> = l
            .consts
            .iter()
            .map(|(b, v)| match v {
                crate::kernel::ConstValues::F32(x) => Ok(Data::F32(x.clone())),
                crate::kernel::ConstValues::Offset { .. }
                | crate::kernel::ConstValues::Offsets(_)
                | crate::kernel::ConstValues::Rotary { .. } => Err(format!(
                    "a shard's offset (a {:?} constant) needs a mesh: compile the program",
                    b.shape
                )),
            })
            .collect::<R<_>>()?;
        let mut temps: Vec<Data> = l
            .temps
            .iter()
            .map(|b| Data::zeros(b.elt, b.len()))
            .collect();
        for (kernel, slots) in &l.launches {
            let k = self.find(&l.kernels[*kernel].name)?;
            let mut args = Vec::new();
            for (s, b) in slots.iter().zip(k.inputs.iter().chain(&k.outputs)) {
                let d: &mut Data = match *s {
                    Slot::In(j) => {
                        let d = inputs.get(j).ok_or("missing operand")?;
                        args.push((d.ptr(), d.len(), d.elt()));
                        continue;
                    }
                    Slot::Out(j) => {
                        if outs.len() <= j {
                            outs.resize(j + 1, None);
                        }
                        outs[j].get_or_insert_with(|| Data::zeros(b.elt, b.len()))
                    }
                    Slot::Temp(j) => temps.get_mut(j).ok_or("missing temporary")?,
                    Slot::Const(j) => consts.get_mut(j).ok_or("missing constant")?,
                };
                args.push((d.ptr_mut(), d.len(), d.elt()));
            }
            self.launch(k, &args)?;
        }
        outs.into_iter()
            .map(|o| o.ok_or_else(|| "an output no launch writes".to_string()))
            .collect()
    }

    /// Runs a whole function's launches ([`Program`]; its kernels compiled here) on its
    /// arguments; returns its results.
    pub fn run_program(&self, p: &Program, inputs: Vec<Data>) -> R<Vec<Data>> {
        if inputs.len() != p.inputs.len() {
            return Err(format!(
                "the function takes {} arguments, given {}",
                p.inputs.len(),
                inputs.len()
            ));
        }
        let mut values: Vec<Option<Data>> = p
            .values
            .iter()
            .map(|b| b.as_ref().map(|b| Data::zeros(b.elt, b.len())))
            .collect();
        for (j, (&v, d)) in p.inputs.iter().zip(inputs).enumerate() {
            let slot = values[v].as_mut().ok_or("an argument without a buffer")?;
            if slot.len() != d.len() || slot.elt() != d.elt() {
                return Err(format!(
                    "argument {j}: {} {:?} elements where {} {:?} are needed",
                    d.len(),
                    d.elt(),
                    slot.len(),
                    slot.elt()
                ));
            }
            *slot = d;
        }
        // One device: every constant's first (or only) value.
        let mut consts: Vec<Data> = p
            .consts
            .iter()
            .map(|(b, v)| Data::from_bytes(b.elt, &v[0]))
            .collect();
        let mut temps: Vec<Data> = p
            .temps
            .iter()
            .map(|b| Data::zeros(b.elt, b.len()))
            .collect();
        for l in &p.launches {
            let Work::Kernel(kernel) = l.work else {
                return Err(
                    "a collective needs several devices: run the artifact with nnscaler-rt".into(),
                );
            };
            let k = self.find(&p.kernels[kernel].name)?;
            let mut args = Vec::new();
            for b in &l.bufs {
                let d = match *b {
                    BufId::Value(v) => values[v].as_mut().ok_or("a value without a buffer")?,
                    BufId::Temp(t) => temps.get_mut(t).ok_or("missing temporary")?,
                    BufId::Const(c) => consts.get_mut(c).ok_or("missing constant")?,
                };
                args.push((d.ptr_mut(), d.len(), d.elt()));
            }
            self.launch(k, &args)?;
        }
        p.outputs
            .iter()
            .map(|&v| {
                values[v]
                    .clone()
                    .ok_or_else(|| "a result without a buffer".to_string())
            })
            .collect()
    }

    fn find(&self, name: &str) -> R<&Kernel> {
        self.kernels
            .iter()
            .find(|k| k.name == name)
            .ok_or_else(|| format!("no kernel {name}"))
    }

    /// Launches `k` over its buffers (inputs, then outputs: pointer, length, element
    /// type), checking their sizes.
    fn launch(&self, k: &Kernel, bufs: &[(*mut u8, usize, Elt)]) -> R<()> {
        let want: Vec<&crate::kernel::Buf> = k.inputs.iter().chain(&k.outputs).collect();
        if bufs.len() != want.len() {
            return Err(format!(
                "{} takes {} buffers, given {}",
                k.name,
                want.len(),
                bufs.len()
            ));
        }
        for (j, ((_, len, elt), b)) in bufs.iter().zip(&want).enumerate() {
            if *len != b.len() || *elt != b.elt {
                return Err(format!(
                    "{}: buffer {j} holds {len} {elt:?} elements, its shape {:?} needs {} {:?}",
                    k.name,
                    b.shape,
                    b.len(),
                    b.elt
                ));
            }
        }
        let args: Vec<*mut u8> = bufs.iter().map(|(p, _, _)| *p).collect();
        // SAFETY: the function was generated with this signature (`host_entry`); its body
        // reads and writes each buffer within the length its shape gives (checked above)
        // and writes only the output and temporary buffers, whose pointers come from
        // exclusive borrows; no reference to any buffer is used during the call.
        unsafe {
            let f = self
                .engine
                .get_function::<HostFn>(&format!("{}.host", k.name))
                .map_err(|e| format!("{}: {e}", k.name))?;
            f.call(args.as_ptr(), k.len as u64);
        }
        Ok(())
    }
}
