//! Lowering a kernel module: to PTX through LLVM's NVPTX back end, or JIT-compiled for the
//! host CPU (the same bodies), where tests compare the kernels with the reference ones.

use crate::kernel::Elementwise;
use crate::llvm::{Gen, R};
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
fn bodies<'ctx>(ctx: &'ctx Context, kernels: &[Elementwise]) -> R<Gen<'ctx>> {
    let g = Gen::new(ctx, "nnscaler_kernels");
    for k in kernels {
        g.elementwise(k)?;
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
pub fn llvm_ir(kernels: &[Elementwise]) -> R<String> {
    let ctx = Context::create();
    let g = bodies(&ctx, kernels)?;
    Ok(g.module.print_to_string().to_string())
}

/// `kernels` as one PTX module for `gpu`.
pub fn ptx(kernels: &[Elementwise], gpu: Gpu) -> R<String> {
    Target::initialize_nvptx(&InitializationConfig::default());
    let ctx = Context::create();
    let g = bodies(&ctx, kernels)?;
    for k in kernels {
        g.ptx_entry(&k.name, k.inputs.len() + 1)?;
    }
    let triple = TargetTriple::create("nvptx64-nvidia-cuda");
    let target = Target::from_triple(&triple).map_err(|e| format!("NVPTX target: {e}"))?;
    let tm = target
        .create_target_machine(
            &triple,
            &format!("sm_{}", gpu.sm),
            &format!("+ptx{}", gpu.ptx),
            OptimizationLevel::Aggressive,
            RelocMode::Default,
            CodeModel::Default,
        )
        .ok_or("LLVM cannot make an NVPTX target machine")?;
    g.module.set_triple(&triple);
    g.module
        .set_data_layout(&tm.get_target_data().get_data_layout());
    optimize(&g.module, &tm)?;
    let buf = tm
        .write_to_memory_buffer(&g.module, FileType::Assembly)
        .map_err(|e| format!("PTX emission failed: {e}"))?;
    String::from_utf8(buf.as_slice().to_vec()).map_err(|e| format!("PTX is not UTF-8: {e}"))
}

/// Kernels JIT-compiled for the host CPU: each launch runs the body for every index in turn.
pub struct HostKernels {
    // The engine owns the module; both borrow the context, which lives as long (leaked
    // once per `HostKernels`: contexts are small, and tests make a handful).
    engine: ExecutionEngine<'static>,
    kernels: Vec<Elementwise>,
}

impl std::fmt::Debug for HostKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostKernels")
            .field("kernels", &self.kernels.len())
            .finish()
    }
}

type HostFn = unsafe extern "C" fn(*const *mut f32, u64);

impl HostKernels {
    /// Compiles `kernels` for this CPU.
    pub fn new(kernels: &[Elementwise]) -> R<Self> {
        Target::initialize_native(&InitializationConfig::default())
            .map_err(|e| format!("LLVM host target: {e}"))?;
        let ctx: &'static Context = Box::leak(Box::new(Context::create()));
        let g = bodies(ctx, kernels)?;
        for k in kernels {
            g.host_entry(&k.name, k.inputs.len() + 1)?;
        }
        let triple = TargetMachine::get_default_triple();
        let target = Target::from_triple(&triple).map_err(|e| format!("host target: {e}"))?;
        let tm = target
            .create_target_machine(
                &triple,
                &TargetMachine::get_host_cpu_name().to_string(),
                &TargetMachine::get_host_cpu_features().to_string(),
                OptimizationLevel::Aggressive,
                RelocMode::Default,
                CodeModel::JITDefault,
            )
            .ok_or("LLVM cannot make a host target machine")?;
        g.module.set_triple(&triple);
        g.module
            .set_data_layout(&tm.get_target_data().get_data_layout());
        optimize(&g.module, &tm)?;
        let engine = g
            .module
            .create_jit_execution_engine(OptimizationLevel::Aggressive)
            .map_err(|e| format!("LLVM JIT: {e}"))?;
        Ok(HostKernels {
            engine,
            kernels: kernels.to_vec(),
        })
    }

    /// Runs kernel `name` on `inputs` (each of its input's length) and returns the result.
    pub fn run(&self, name: &str, inputs: &[&[f32]]) -> R<Vec<f32>> {
        let k = self
            .kernels
            .iter()
            .find(|k| k.name == name)
            .ok_or_else(|| format!("no kernel {name}"))?;
        if inputs.len() != k.inputs.len() {
            return Err(format!(
                "{name} takes {} inputs, given {}",
                k.inputs.len(),
                inputs.len()
            ));
        }
        for (j, (x, s)) in inputs.iter().zip(&k.inputs).enumerate() {
            let want: usize = s.iter().product();
            if x.len() != want {
                return Err(format!(
                    "{name}: input {j} has {} elements, its shape {s:?} {want}",
                    x.len()
                ));
            }
        }
        let mut out = vec![0.0f32; k.len()];
        let mut args: Vec<*mut f32> = inputs.iter().map(|x| x.as_ptr().cast_mut()).collect();
        args.push(out.as_mut_ptr());
        // SAFETY: the function was generated with this signature (`host_entry`); it reads
        // each input within its length (offsets come from the shapes checked above) and
        // writes `out`'s `k.len()` elements; inputs are only read.
        unsafe {
            let f = self
                .engine
                .get_function::<HostFn>(&format!("{name}.host"))
                .map_err(|e| format!("{name}: {e}"))?;
            f.call(args.as_ptr(), k.len() as u64);
        }
        Ok(out)
    }
}
