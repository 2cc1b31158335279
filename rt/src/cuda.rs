//! The CUDA backend (feature `cuda`): the artifact's PTX loaded through the driver API
//! (cudarc, which loads `libcuda.so` at run time), kernels launched with the artifact's
//! grids, one arena per virtual device on one GPU. Matrix products go to cuBLAS
//! (`cublasSgemmStridedBatched`, fp32 without TF32, row-major by swapping the operands)
//! when `libcublas.so` loads, else to their generated kernels; a product with a bias
//! (`dnn.linear`) to cuBLASLt with the bias in its epilogue ([`lt`]), else to cuBLAS and
//! the artifact's kernel for the bias. Collectives run on the GPU
//! as the moves the host backend runs too (`crate::collective`): device-to-device copies
//! between the virtual devices' arenas (`cuMemcpy2DAsync`, strided pieces in one call) and
//! the artifact's reducer kernels; NCCL across several GPUs is not built yet. A pipeline's
//! programs run under the host backend's scheduler ([`crate::host`]); a send copies its
//! buffer into a device parcel, which the receive copies into the other program's arena.

use crate::artifact::{Artifact, Buffer, Elt, Gemm, Step, BLOCK};
use crate::collective::{moves, scratch_bytes, At, Move, Places};
use crate::compare::{Comparison, Lockstep};
use crate::host::{load_inputs, results, schedule, Arenas, Engine, HostEngine};
use crate::tensor::Tensor;
use crate::HostProgram;
use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::sys as driver_sys;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

mod lt;

/// Whether a CUDA driver can be loaded here, and how many devices it sees; the reason
/// when not (tests that need a GPU print it and skip).
pub fn available() -> Result<usize, String> {
    // SAFETY: probing for the library has no preconditions (cudarc loads it on first use
    // and panics when absent, so ask first).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so cannot be loaded)".into());
    }
    let n = CudaContext::device_count().map_err(|e| format!("CUDA: {e}"))?;
    if n < 1 {
        return Err("the CUDA driver sees no device".into());
    }
    Ok(n as usize)
}

/// A loaded program on a GPU.
pub struct CudaProgram {
    art: Artifact,
    stream: Arc<CudaStream>,
    fns: Vec<CudaFunction>,
    blas: Option<CudaBlas>,
    /// cuBLASLt, for products with a bias (`Gemm::bias`), where it loaded.
    lt: Option<lt::Lt>,
    gemms: String,
}

impl std::fmt::Debug for CudaProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaProgram")
            .field("kernels", &self.fns.len())
            .finish()
    }
}

/// Whether cuBLAS computes a product on operands stored as `elts` (A, B, C): all f32, or
/// A and B bf16 (C either); other mixes run the artifact's generated kernel.
/// The batch count and rows of `g` as cuBLAS is called: products that share their `B`
/// with `A` stored untransposed (a linear layer over a batch of sequences) are one product
/// of `batch * m` rows (`A`'s and `C`'s rows follow each other in memory), which cuBLAS
/// tiles far better than `batch` products of `m` rows; others as they are.
fn folded(g: &Gemm) -> (u64, u64) {
    if g.batch > 1 && !g.b_batched && !g.ta {
        (1, g.batch * g.m)
    } else {
        (g.batch, g.m)
    }
}

fn gemm_by_blas(elts: [Elt; 3]) -> bool {
    match elts {
        [Elt::F32, Elt::F32, Elt::F32] => true,
        [Elt::Bf16, Elt::Bf16, c] => c != Elt::I64,
        _ => false,
    }
}

fn cuda<T>(r: Result<T, cudarc::driver::DriverError>, what: &str) -> Result<T, String> {
    r.map_err(|e| format!("CUDA: {what}: {e}"))
}

/// Makes the device's default memory pool keep what is freed instead of handing it back to
/// the driver. cudarc allocates and frees through that pool, stream-ordered
/// (`cuMemAllocAsync` / `cuMemFreeAsync`), and the pool's release threshold is 0 by
/// default: at every synchronization it unmaps all the memory freed since, and the next
/// allocation maps (and the driver clears) fresh pages. A run that allocated a fresh arena
/// and freed the last one paid for unmapping it inside its own step (2026-12-04, H200: the
/// 805 MB `add` benchmark took 2.07 ms where its kernel needs about 0.2 ms). PyTorch's
/// caching allocator keeps its memory the same way. Devices without memory pools (no
/// async allocation in cudarc either) are left as they are.
fn keep_freed_memory(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let dev = ctx.cu_device();
    let supported = cuda(
        ctx.attribute(driver_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED),
        "asking whether the device has memory pools",
    )?;
    if supported == 0 {
        return Ok(());
    }
    let mut pool: driver_sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold: u64 = u64::MAX;
    // SAFETY: `dev` is the context's device and `pool` a place for the handle; the
    // attribute's value is a u64, as the driver API documents for the release threshold.
    unsafe {
        driver_sys::cuDeviceGetDefaultMemPool(&mut pool, dev)
            .result()
            .map_err(|e| format!("CUDA: the device's memory pool: {e}"))?;
        driver_sys::cuMemPoolSetAttribute(
            pool,
            driver_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()
        .map_err(|e| format!("CUDA: keeping the memory pool's freed memory: {e}"))?;
    }
    Ok(())
}

impl CudaProgram {
    /// Loads the artifact's PTX on GPU `ordinal`.
    pub fn load(art: Artifact, ordinal: usize) -> Result<Self, String> {
        available()?;
        let ptx = art
            .section("ptx")
            .ok_or("the artifact has no ptx section")?;
        let text =
            String::from_utf8(ptx.to_vec()).map_err(|e| format!("the PTX is not text: {e}"))?;
        let ctx = cuda(CudaContext::new(ordinal), "opening the device")?;
        keep_freed_memory(&ctx)?;
        // The arenas against the GPU's free memory before anything is allocated.
        let free = cuda(ctx.mem_get_info(), "querying its memory")?.0;
        crate::memory::check(
            &art,
            None,
            Some((free as u64, format!("GPU {ordinal}'s free memory"))),
        )?;
        let module = cuda(
            ctx.load_module(cudarc::nvrtc::Ptx::from_src(text)),
            "loading the PTX (a driver older than the artifact's PTX version refuses it)",
        )?;
        let fns = art
            .header
            .kernels
            .iter()
            .map(|k| cuda(module.load_function(&k.name), &format!("kernel {}", k.name)))
            .collect::<Result<_, _>>()?;
        let stream = ctx.default_stream();
        let wants_blas = art.header.kernels.iter().any(|k| k.gemm.is_some());
        // SAFETY: probing for the library has no preconditions.
        let (blas, gemms) = if !wants_blas {
            (None, "no matrix products".to_string())
        } else if !unsafe { blas_sys::is_culib_present() } {
            (
                None,
                "matrix products by generated kernels (libcublas.so not found)".to_string(),
            )
        } else {
            match CudaBlas::new(stream.clone()) {
                Ok(b) => (
                    Some(b),
                    if crate::precision::tf32() {
                        "matrix products by cuBLAS, f32 ones on TF32 tensor cores (--matmul-precision high)"
                            .to_string()
                    } else if Self::plain_gemm() {
                        "matrix products by cuBLAS (single products through cublasSgemm: NNSCALER_CUBLAS=plain)"
                            .to_string()
                    } else {
                        "matrix products by cuBLAS".to_string()
                    },
                ),
                Err(e) => (
                    None,
                    format!("matrix products by generated kernels (cuBLAS: {e})"),
                ),
            }
        };
        let biased = art
            .header
            .kernels
            .iter()
            .any(|k| k.gemm.is_some_and(|g| g.bias.is_some()));
        let (lt, gemms) = match (&blas, biased) {
            (Some(_), true) => match lt::Lt::new(stream.clone()) {
                Ok(l) => (
                    Some(l),
                    format!("{gemms}; biases added by cuBLASLt's epilogue"),
                ),
                Err(e) => (
                    None,
                    format!("{gemms}; biases added by their kernels (cuBLASLt: {e})"),
                ),
            },
            _ => (None, gemms),
        };
        Ok(CudaProgram {
            stream,
            art,
            fns,
            blas,
            lt,
            gemms,
        })
    }

    /// Whether single f32 products go through `cublasSgemm` rather than
    /// `cublasSgemmStridedBatched` with one batch (`NNSCALER_CUBLAS=plain`): cuBLAS may pick
    /// other kernels for the two (run 2's profile had SIMT `cutlass_80` kernels beside `xmma`
    /// ones); a knob for the device check to time both, the default unchanged until it has.
    fn plain_gemm() -> bool {
        static PLAIN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *PLAIN.get_or_init(|| std::env::var("NNSCALER_CUBLAS").is_ok_and(|v| v == "plain"))
    }

    /// The same program on a stream of its own on the same GPU (the module is shared;
    /// cuBLAS gets a handle of its own on the new stream): a virtual device's when the
    /// devices run as ranks on one GPU (`crate::streams`). The stream does not wait for
    /// the legacy default stream, nor it for this one.
    pub fn fork(&self) -> Result<Self, String> {
        let stream = cuda(self.stream.context().new_stream(), "creating a stream")?;
        let (blas, gemms) = match &self.blas {
            None => (None, self.gemms.clone()),
            Some(_) => match CudaBlas::new(stream.clone()) {
                Ok(b) => (Some(b), self.gemms.clone()),
                Err(e) => (
                    None,
                    format!("matrix products by generated kernels (cuBLAS: {e})"),
                ),
            },
        };
        let (lt, gemms) = match &self.lt {
            Some(_) => match lt::Lt::new(stream.clone()) {
                Ok(l) => (Some(l), gemms),
                Err(e) => (None, format!("{gemms} (this stream's cuBLASLt: {e})")),
            },
            None => (None, gemms),
        };
        Ok(CudaProgram {
            art: self.art.clone(),
            stream,
            fns: self.fns.clone(),
            blas,
            lt,
            gemms,
        })
    }

    /// The artifact.
    pub fn artifact(&self) -> &Artifact {
        &self.art
    }

    /// The stream every step runs on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// How matrix products run (cuBLAS, or the generated kernels and why).
    pub fn gemms(&self) -> &str {
        &self.gemms
    }

    /// `out = A B` for row-major operands (a column-major BLAS computes `out^T = B^T A^T`:
    /// the operands swap, each transposed flag read against its stored layout), stored
    /// as `elts` (A, B, C): all f32 through
    /// `cublasSgemmStridedBatched`; A and B bf16 (C bf16 or f32) through
    /// `cublasGemmStridedBatchedEx` computing in f32 (tensor cores; C rounded to nearest
    /// on store, as the generated kernel rounds). Other mixes are not cuBLAS's
    /// ([`gemm_by_blas`]).
    fn gemm_of(
        &self,
        blas: &CudaBlas,
        g: &Gemm,
        [a, b, c]: [u64; 3],
        elts: [Elt; 3],
    ) -> Result<(), String> {
        let (batch, rows) = folded(g);
        let (m, n, k) = (rows as i32, g.n as i32, g.k as i32);
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let lda = if g.ta { m } else { k };
        let ldb = if g.tb { k } else { n };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let stride_b = if g.b_batched { g.k * g.n } else { 0 };
        if elts == [Elt::F32; 3] && crate::precision::tf32() {
            // SAFETY: as below; TF32 tensor cores for f32 operands, as asked.
            return unsafe {
                blas::gemm_strided_batched_ex(
                    *blas.handle(),
                    op(g.tb),
                    op(g.ta),
                    n,
                    m,
                    k,
                    (&alpha as *const f32).cast(),
                    b as *const std::ffi::c_void,
                    blas_sys::cudaDataType::CUDA_R_32F,
                    ldb,
                    stride_b as i64,
                    a as *const std::ffi::c_void,
                    blas_sys::cudaDataType::CUDA_R_32F,
                    lda,
                    (g.m * g.k) as i64,
                    (&beta as *const f32).cast(),
                    c as *mut std::ffi::c_void,
                    blas_sys::cudaDataType::CUDA_R_32F,
                    n,
                    (g.m * g.n) as i64,
                    batch as i32,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| format!("cuBLAS: {e}"));
        }
        if batch == 1 && elts == [Elt::F32; 3] && Self::plain_gemm() {
            // SAFETY: as below (one product).
            return unsafe {
                blas::sgemm(
                    *blas.handle(),
                    op(g.tb),
                    op(g.ta),
                    n,
                    m,
                    k,
                    &alpha,
                    b as *const f32,
                    ldb,
                    a as *const f32,
                    lda,
                    &beta,
                    c as *mut f32,
                    n,
                )
            }
            .map_err(|e| format!("cuBLAS: {e}"));
        }
        if elts != [Elt::F32; 3] {
            let ty = |e: Elt| match e {
                Elt::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
                _ => blas_sys::cudaDataType::CUDA_R_32F,
            };
            // SAFETY: as below; each operand's type is its storage's.
            return unsafe {
                blas::gemm_strided_batched_ex(
                    *blas.handle(),
                    op(g.tb),
                    op(g.ta),
                    n,
                    m,
                    k,
                    (&alpha as *const f32).cast(),
                    b as *const std::ffi::c_void,
                    ty(elts[1]),
                    ldb,
                    stride_b as i64,
                    a as *const std::ffi::c_void,
                    ty(elts[0]),
                    lda,
                    (g.m * g.k) as i64,
                    (&beta as *const f32).cast(),
                    c as *mut std::ffi::c_void,
                    ty(elts[2]),
                    n,
                    (g.m * g.n) as i64,
                    batch as i32,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| format!("cuBLAS: {e}"));
        }
        // SAFETY: a, b, c point into this device's arena at buffers of the product's
        // sizes (the compiler's memory plan); the scalars are host values cuBLAS reads
        // during the call.
        unsafe {
            blas::sgemm_strided_batched(
                *blas.handle(),
                op(g.tb),
                op(g.ta),
                n,
                m,
                k,
                &alpha,
                b as *const f32,
                ldb,
                stride_b as i64,
                a as *const f32,
                lda,
                (g.m * g.k) as i64,
                &beta,
                c as *mut f32,
                n,
                (g.m * g.n) as i64,
                batch as i32,
            )
        }
        .map_err(|e| format!("cuBLAS: {e}"))
    }

    /// Runs a collective's moves over program `p`'s arenas (in its devices' order) and the
    /// run's scratch space, on the stream.
    fn run_moves(
        &self,
        ms: &[Move],
        arenas: &[CudaSlice<u64>],
        scratch: &CudaSlice<u64>,
    ) -> Result<(), String> {
        let base = |s: &CudaSlice<u64>| s.device_ptr(&self.stream).0;
        let places = Places {
            devices: arenas
                .iter()
                .map(|a| (base(a), a.len() as u64 * 8))
                .collect(),
            scratch: (base(scratch), scratch.len() as u64 * 8),
        };
        for m in ms {
            let [(src, src_span), (dst, dst_span)] = m.spans();
            let at = |a: At, bytes: u64| -> Result<u64, String> {
                let (base, offset) = places.locate(a, bytes)?;
                Ok(base + offset)
            };
            let (s, d) = (at(src, src_span)?, at(dst, dst_span)?);
            match *m {
                Move::Copy {
                    width,
                    rows,
                    src_pitch,
                    dst_pitch,
                    ..
                } => {
                    if src_span == 0 {
                        continue;
                    }
                    // SAFETY: both regions lie in live device allocations of this context
                    // (checked above) and do not overlap.
                    unsafe { self.copy2d(s, d, width, rows, src_pitch, dst_pitch) }?;
                }
                // SAFETY: `n` f32s at each address, inside live allocations (checked).
                Move::Reduce { n, max, .. } => unsafe { self.reduce(d, s, n, max) }?,
            }
        }
        Ok(())
    }

    /// `acc = acc + x` (or the maximum) over `n` f32s at device addresses `acc` and `x`,
    /// element by element, on the stream (the artifact's reducer kernels).
    ///
    /// # Safety
    /// Both must hold `n` f32s in live device allocations of this context.
    pub(crate) unsafe fn reduce(&self, acc: u64, x: u64, n: u64, max: bool) -> Result<(), String> {
        let k = self.art.header.reducer(max)?;
        let n = n as i64;
        let mut launch = self.stream.launch_builder(&self.fns[k]);
        launch.arg(&acc).arg(&x).arg(&acc).arg(&n);
        let cfg = LaunchConfig {
            grid_dim: ((n as u64).div_ceil(u64::from(BLOCK)).max(1) as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the caller's contract; `acc` is read and written element by element,
        // which the kernel allows.
        cuda(unsafe { launch.launch(cfg) }, "launching a reducer").map(|_| ())
    }

    /// `rows` runs of `width` bytes from device address `s + r * src_pitch` to `d + r *
    /// dst_pitch`, on the stream (one `cuMemcpy2DAsync`).
    ///
    /// # Safety
    /// Both regions must lie in live device allocations of this context and not overlap.
    pub(crate) unsafe fn copy2d(
        &self,
        s: u64,
        d: u64,
        width: u64,
        rows: u64,
        src_pitch: u64,
        dst_pitch: u64,
    ) -> Result<(), String> {
        let copy = driver_sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: driver_sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: s,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: driver_sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: d,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch as usize,
            WidthInBytes: width as usize,
            Height: rows as usize,
        };
        // SAFETY: the caller's contract; the descriptor is read during the call.
        unsafe { driver_sys::cuMemcpy2DAsync_v2(&copy, self.stream.cu_stream()) }
            .result()
            .map_err(|e| format!("CUDA: a collective's copy: {e}"))
    }

    /// Launches kernel `kernel` of program `p` on its buffers `buffers` at device
    /// addresses `ptrs` (a matrix product through cuBLAS when it loaded and takes the
    /// operands' storage, [`gemm_by_blas`]).
    pub(crate) fn launch(
        &self,
        p: usize,
        kernel: usize,
        buffers: &[usize],
        ptrs: &[u64],
    ) -> Result<(), String> {
        let k = &self.art.header.kernels[kernel];
        if let (Some(g), Some(blas)) = (&k.gemm, &self.blas) {
            let bufs = &self.art.header.programs[p].buffers;
            // C is the last buffer: the fourth where a bias is the third.
            let c = k.buffers - 1;
            let elts = [0, 1, c].map(|j| bufs[buffers[j]].elt);
            if gemm_by_blas(elts) {
                let Some(add) = g.bias else {
                    return self.gemm_of(blas, g, [ptrs[0], ptrs[1], ptrs[2]], elts);
                };
                let (a, b, bias, out) = (ptrs[0], ptrs[1], ptrs[2], ptrs[3]);
                let bias_elt = bufs[buffers[2]].elt;
                if let Some(lt) = &self.lt {
                    if lt.product(g, [a, b, bias, out], elts, bias_elt).is_ok() {
                        return Ok(());
                    }
                }
                // The product by cuBLAS, then its bias by the artifact's kernel, in place.
                self.gemm_of(blas, g, [a, b, out], elts)?;
                return self.launch_kernel(add as usize, &[out, bias, out]);
            }
        }
        self.launch_kernel(kernel, ptrs)
    }

    /// Launches the artifact's kernel `kernel` on buffers at device addresses `ptrs`.
    fn launch_kernel(&self, kernel: usize, ptrs: &[u64]) -> Result<(), String> {
        let k = &self.art.header.kernels[kernel];
        let n = k.len as i64;
        let mut launch = self.stream.launch_builder(&self.fns[kernel]);
        for p in ptrs {
            launch.arg(p);
        }
        launch.arg(&n);
        let cfg = LaunchConfig {
            grid_dim: (k.grid.max(1) as u32, 1, 1),
            block_dim: (k.block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel takes these pointers (inside an arena, at the offsets the
        // memory plan gave) and the index count, and reads and writes within each
        // buffer's length (the compiler's contract).
        cuda(
            unsafe { launch.launch(cfg) },
            &format!("launching {}", k.name),
        )?;
        Ok(())
    }

    /// The arenas on the GPU (synchronized).
    fn upload(&self, host: &Arenas) -> Result<Vec<Vec<CudaSlice<u64>>>, String> {
        let dev = host
            .iter()
            .map(|arenas| {
                arenas
                    .iter()
                    .map(|a| cuda(self.stream.clone_htod(a), "copying the arguments"))
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<_, _>>()?;
        cuda(self.stream.synchronize(), "copying the arguments")?;
        Ok(dev)
    }

    /// The arguments in `host` copied again into the arenas `upload` made, waiting for it.
    fn refill(&self, host: &Arenas, dev: &mut [Vec<CudaSlice<u64>>]) -> Result<(), String> {
        for (h_arenas, d_arenas) in host.iter().zip(dev.iter_mut()) {
            for (h, d) in h_arenas.iter().zip(d_arenas.iter_mut()) {
                cuda(self.stream.memcpy_htod(h, d), "copying the arguments")?;
            }
        }
        cuda(self.stream.synchronize(), "copying the arguments")
    }

    /// Every device's arena copied back into `host` (the run's results), waiting for it.
    fn download(&self, dev: &[Vec<CudaSlice<u64>>], host: &mut Arenas) -> Result<(), String> {
        for (h_arenas, d_arenas) in host.iter_mut().zip(dev) {
            for (h_arena, d_arena) in h_arenas.iter_mut().zip(d_arenas) {
                cuda(
                    self.stream.memcpy_dtoh(d_arena, h_arena.as_mut_slice()),
                    "reading the results",
                )?;
            }
        }
        cuda(self.stream.synchronize(), "reading the results")
    }

    /// The collectives' scratch space.
    fn scratch(&self) -> Result<CudaSlice<u64>, String> {
        let words = scratch_bytes(&self.art.header.programs)?.div_ceil(8).max(1);
        cuda(
            self.stream.alloc_zeros::<u64>(words as usize),
            "allocating the collectives' scratch space",
        )
    }

    /// [`CudaProgram::run_timed`] with the step's launches captured once as a CUDA graph
    /// and replayed: one run launch by launch (warming up cuBLAS and the modules), then a
    /// capture of the schedule (nothing runs while it is recorded), then `repeat` runs of
    /// the graph, each after the arguments are copied into the same arena (a step may
    /// write over its inputs' space). Where the driver refuses the capture, the runs go
    /// launch by launch. Returns the results, each run's seconds and how it ran.
    pub fn run_timed_graph(
        &self,
        inputs: &[Tensor],
        repeat: usize,
    ) -> Result<(Vec<Tensor>, Vec<f64>, String), String> {
        let mut host = load_inputs(&self.art, inputs)?;
        let scratch = self.scratch()?;
        let mut dev = self.upload(&host)?;
        let step = |dev: &mut Vec<Vec<CudaSlice<u64>>>| {
            schedule(
                &self.art,
                &mut Gpu {
                    prog: self,
                    dev,
                    scratch: &scratch,
                },
            )
        };
        step(&mut dev)?;
        cuda(self.stream.synchronize(), "finishing the warm-up step")?;
        let captured = (|| -> Result<cudarc::driver::CudaGraph, String> {
            cuda(
                self.stream.begin_capture(
                    driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
                "starting the capture",
            )?;
            let recorded = step(&mut dev);
            let graph = cuda(
                self.stream
                    .end_capture(driver_sys::CUgraphInstantiate_flags(0)),
                "capturing the step as a graph",
            );
            recorded?;
            graph?.ok_or_else(|| "the capture recorded nothing".to_string())
        })();
        let (graph, how) = match captured {
            Ok(g) => {
                let nodes = self
                    .art
                    .header
                    .programs
                    .iter()
                    .map(|p| p.steps.len())
                    .sum::<usize>();
                (
                    Some(g),
                    format!("the step as a CUDA graph ({nodes} steps captured once, replayed)"),
                )
            }
            Err(e) => (
                None,
                format!("launch by launch: the step could not be captured as a CUDA graph ({e})"),
            ),
        };
        let mut times = Vec::new();
        for _ in 0..repeat.max(1) {
            self.refill(&host, &mut dev)?;
            let started = std::time::Instant::now();
            match &graph {
                Some(g) => cuda(g.launch(), "replaying the step's graph")?,
                None => step(&mut dev)?,
            }
            cuda(self.stream.synchronize(), "finishing the step")?;
            times.push(started.elapsed().as_secs_f64());
        }
        self.download(&dev, &mut host)?;
        Ok((results(&self.art, &host)?, times, how))
    }

    /// Runs the program once on the GPU and on the host (`host`: the same artifact
    /// loaded there) in lockstep, comparing what every step writes on each device
    /// (`crate::compare`); with `resync`, the GPU then takes the host's values of it,
    /// so each step's error is its own. Every step waits for the GPU, so this is for
    /// finding where the GPU disagrees, not for timing.
    pub fn compare(
        &self,
        host: &HostProgram,
        inputs: &[Tensor],
        resync: bool,
    ) -> Result<Comparison, String> {
        if host.artifact().header != self.art.header {
            return Err("the host program is another artifact".into());
        }
        let mut h_arenas = load_inputs(&self.art, inputs)?;
        let mut dev = self.upload(&h_arenas)?;
        let scratch = self.scratch()?;
        let gpu = Gpu {
            prog: self,
            dev: &mut dev,
            scratch: &scratch,
        };
        Lockstep::new(
            &self.art,
            gpu,
            HostEngine::new(host, &mut h_arenas)?,
            resync,
        )
        .run()
    }

    /// Runs the program `repeat` times (at least once) on its arguments (whole tensors),
    /// every virtual device's arena on the one GPU; returns the results made whole and the
    /// seconds of each run's steps (after the arguments are on the GPU, until its last
    /// kernel finished; collectives, sends and receives included).
    pub fn run_timed(
        &self,
        inputs: &[Tensor],
        repeat: usize,
    ) -> Result<(Vec<Tensor>, Vec<f64>), String> {
        let mut host = load_inputs(&self.art, inputs)?;
        let scratch = self.scratch()?;
        let mut times = Vec::new();
        let mut dev = self.upload(&host)?;
        for run in 0..repeat.max(1) {
            // Every run starts from the arguments (a step may write over its inputs'
            // space once they are dead), copied into the same arenas: nothing is allocated
            // or freed between runs.
            if run > 0 {
                self.refill(&host, &mut dev)?;
            }
            let started = std::time::Instant::now();
            schedule(
                &self.art,
                &mut Gpu {
                    prog: self,
                    dev: &mut dev,
                    scratch: &scratch,
                },
            )?;
            cuda(self.stream.synchronize(), "finishing the step")?;
            times.push(started.elapsed().as_secs_f64());
        }
        self.download(&dev, &mut host)?;
        Ok((results(&self.art, &host)?, times))
    }

    /// One run with every step timed by CUDA events on the stream (no synchronization
    /// between steps): the run's profile by kernel family ([`crate::profile`]).
    pub fn run_profiled(&self, inputs: &[Tensor]) -> Result<crate::profile::Profile, String> {
        let host = load_inputs(&self.art, inputs)?;
        let scratch = self.scratch()?;
        let mut dev = self.upload(&host)?;
        let mut clock = Events {
            stream: self.stream.clone(),
        };
        let mut timed = crate::profile::Profiled::new(
            Gpu {
                prog: self,
                dev: &mut dev,
                scratch: &scratch,
            },
            &mut clock,
            &self.art,
        );
        schedule(&self.art, &mut timed)?;
        cuda(self.stream.synchronize(), "finishing the step")?;
        timed.profile()
    }
}

/// A program's arenas kept on its GPU between runs, for a [`crate::session::Session`]:
/// a training step's parameters and moments stay there, and a run moves only its batch
/// in and the results asked for out.
pub struct CudaResident<'a> {
    prog: &'a CudaProgram,
    dev: Vec<Vec<CudaSlice<u64>>>,
    scratch: CudaSlice<u64>,
}

impl std::fmt::Debug for CudaResident<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaResident").finish_non_exhaustive()
    }
}

impl<'a> CudaResident<'a> {
    /// Every device's arena of `prog` allocated on its GPU.
    pub fn new(prog: &'a CudaProgram) -> Result<Self, String> {
        let dev = prog
            .art
            .header
            .programs
            .iter()
            .map(|p| {
                let words = p.arena_bytes.div_ceil(8).max(1) as usize;
                p.devices
                    .iter()
                    .map(|_| cuda(prog.stream.alloc_zeros::<u64>(words), "allocating an arena"))
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<_, _>>()?;
        Ok(CudaResident {
            scratch: prog.scratch()?,
            prog,
            dev,
        })
    }

    fn gpu(&mut self) -> Gpu<'_> {
        Gpu {
            prog: self.prog,
            dev: &mut self.dev,
            scratch: &self.scratch,
        }
    }
}

impl crate::session::Resident for CudaResident<'_> {
    type Kept = Vec<CudaSlice<u64>>;
    fn artifact(&self) -> &Artifact {
        &self.prog.art
    }
    fn zero(&mut self) -> Result<(), String> {
        for a in self.dev.iter_mut().flatten() {
            cuda(self.prog.stream.memset_zeros(a), "zeroing an arena")?;
        }
        Ok(())
    }
    fn put(&mut self, p: usize, b: usize, pieces: Vec<Vec<u8>>) -> Result<(), String> {
        self.gpu().put_bytes(p, b, pieces)
    }
    fn get(&mut self, p: usize, b: usize) -> Result<Vec<Vec<u8>>, String> {
        self.gpu().bytes(p, b)
    }
    fn save(&mut self, p: usize, b: usize, kept: &mut Option<Self::Kept>) -> Result<(), String> {
        let w = Gpu::words(&self.prog.art.header.programs[p].buffers[b]);
        let stream = &self.prog.stream;
        match kept {
            Some(k) => {
                for (arena, piece) in self.dev[p].iter().zip(k.iter_mut()) {
                    cuda(
                        stream.memcpy_dtod(&arena.slice(w.clone()), piece),
                        "keeping a value",
                    )?;
                }
            }
            None => {
                *kept = Some(
                    self.dev[p]
                        .iter()
                        .map(|arena| {
                            cuda(
                                stream.clone_dtod(&arena.slice(w.clone())),
                                "keeping a value",
                            )
                        })
                        .collect::<Result<_, _>>()?,
                );
            }
        }
        Ok(())
    }
    fn load(&mut self, p: usize, b: usize, kept: &Self::Kept) -> Result<(), String> {
        let w = Gpu::words(&self.prog.art.header.programs[p].buffers[b]);
        let stream = &self.prog.stream;
        for (arena, piece) in self.dev[p].iter_mut().zip(kept) {
            cuda(
                stream.memcpy_dtod(piece, &mut arena.slice_mut(w.clone())),
                "writing a kept value",
            )?;
        }
        Ok(())
    }
    fn execute(&mut self) -> Result<(), String> {
        let art = &self.prog.art;
        schedule(
            art,
            &mut Gpu {
                prog: self.prog,
                dev: &mut self.dev,
                scratch: &self.scratch,
            },
        )?;
        cuda(self.prog.stream.synchronize(), "finishing the step")
    }
}

/// Marks on a stream: CUDA events that record timing.
struct Events {
    stream: Arc<CudaStream>,
}

impl crate::profile::Clock for Events {
    type Mark = cudarc::driver::CudaEvent;
    fn mark(&mut self) -> Result<Self::Mark, String> {
        cuda(
            self.stream
                .record_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT)),
            "recording an event",
        )
    }
    fn between(&self, a: &Self::Mark, b: &Self::Mark) -> Result<f64, String> {
        Ok(f64::from(cuda(a.elapsed_ms(b), "timing a step")?) / 1e3)
    }
}

/// A rank's program and memory on its GPU (`crate::nccl`, `crate::streams`): its own
/// arena and scratch space; its launches and local copies go to the program's stream.
pub(crate) struct RankMemory<'a> {
    pub(crate) prog: &'a CudaProgram,
    /// The program of the artifact the rank runs.
    pub(crate) p: usize,
    pub(crate) arena: &'a CudaSlice<u64>,
    pub(crate) scratch: &'a CudaSlice<u64>,
}

impl RankMemory<'_> {
    /// The rank's places: its arena (`Device(0)`) and scratch, by device address.
    pub(crate) fn places(&self) -> Places<u64> {
        let stream = self.prog.stream();
        let base = |s: &CudaSlice<u64>| s.device_ptr(stream).0;
        Places {
            devices: vec![(base(self.arena), self.arena.len() as u64 * 8)],
            scratch: (base(self.scratch), self.scratch.len() as u64 * 8),
        }
    }

    /// The device address of `a`, checked to hold `bytes` bytes in its place.
    pub(crate) fn address(&self, a: At, bytes: u64) -> Result<u64, String> {
        let (base, off) = self.places().locate(a, bytes)?;
        Ok(base + off)
    }

    /// Launches kernel `kernel` on the program's buffers `buffers` in the arena.
    pub(crate) fn launch(&self, kernel: usize, buffers: &[usize]) -> Result<(), String> {
        let prog = &self.prog.artifact().header.programs[self.p];
        let base = self.places().devices[0].0;
        let ptrs: Vec<u64> = buffers
            .iter()
            .map(|&b| base + prog.buffers[b].offset)
            .collect();
        self.prog.launch(self.p, kernel, buffers, &ptrs)
    }

    /// A strided copy within the arena and scratch.
    pub(crate) fn copy(&self, m: &Move) -> Result<(), String> {
        let Some(c) = self.places().local_copy(m)? else {
            return Ok(());
        };
        // SAFETY: both spans lie in this rank's arena or scratch (checked by local_copy);
        // a rank's plan never copies a region onto itself.
        unsafe {
            self.prog.copy2d(
                c.src.0 + c.src.1,
                c.dst.0 + c.dst.1,
                c.width,
                c.rows,
                c.src_pitch,
                c.dst_pitch,
            )
        }
    }
}

/// The device arenas of a run and its collectives' scratch space.
struct Gpu<'a> {
    prog: &'a CudaProgram,
    dev: &'a mut Vec<Vec<CudaSlice<u64>>>,
    scratch: &'a CudaSlice<u64>,
}

impl Gpu<'_> {
    /// The words of an arena that hold `b` (its offset is a multiple of 256; its space in
    /// the plan is rounded up to 256 bytes, so the last word is its own).
    fn words(b: &Buffer) -> std::ops::Range<usize> {
        let lo = b.offset as usize / 8;
        lo..(b.offset + b.bytes()).div_ceil(8) as usize
    }
}

impl Engine for Gpu<'_> {
    /// Each device's copy of the sent buffer, on the GPU.
    type Parcel = Vec<CudaSlice<u64>>;

    fn step(&mut self, p: usize, s: &Step) -> Result<(), String> {
        let this = self.prog;
        let h = &this.art.header;
        let prog = &h.programs[p];
        let Step::Launch { kernel, buffers } = s else {
            let (ms, _) = moves(prog, s)?;
            return this.run_moves(&ms, &self.dev[p], self.scratch);
        };
        for arena in self.dev[p].iter() {
            let (base, _sync) = arena.device_ptr(&this.stream);
            let ptrs: Vec<u64> = buffers
                .iter()
                .map(|&b| base + prog.buffers[b].offset)
                .collect();
            this.launch(p, *kernel, buffers, &ptrs)?;
        }
        Ok(())
    }

    fn read(&mut self, p: usize, b: usize) -> Result<Self::Parcel, String> {
        let buf = &self.prog.art.header.programs[p].buffers[b];
        let w = Self::words(buf);
        let stream = &self.prog.stream;
        self.dev[p]
            .iter()
            .map(|arena| {
                cuda(
                    stream.clone_dtod(&arena.slice(w.clone())),
                    "sending a buffer",
                )
            })
            .collect()
    }

    fn bytes(&mut self, p: usize, b: usize) -> Result<Vec<Vec<u8>>, String> {
        let buf = &self.prog.art.header.programs[p].buffers[b];
        let w = Self::words(buf);
        let mut out = Vec::with_capacity(self.dev[p].len());
        for arena in &self.dev[p] {
            let mut words = vec![0u64; w.len()];
            cuda(
                self.prog
                    .stream
                    .memcpy_dtoh(&arena.slice(w.clone()), words.as_mut_slice()),
                "reading a buffer",
            )?;
            cuda(self.prog.stream.synchronize(), "reading a buffer")?;
            let mut bytes: Vec<u8> = words.iter().flat_map(|x| x.to_le_bytes()).collect();
            bytes.truncate(buf.bytes() as usize);
            out.push(bytes);
        }
        Ok(out)
    }

    fn put_bytes(&mut self, p: usize, b: usize, bytes: Vec<Vec<u8>>) -> Result<(), String> {
        let buf = &self.prog.art.header.programs[p].buffers[b];
        let w = Self::words(buf);
        for (arena, piece) in self.dev[p].iter_mut().zip(bytes) {
            // The buffer's last word is its own (its space is rounded up to 256 bytes),
            // so padding it with zeros writes over nothing else.
            let mut words = vec![0u64; w.len()];
            for (k, c) in piece.chunks(8).enumerate() {
                let mut word = [0u8; 8];
                word[..c.len()].copy_from_slice(c);
                words[k] = u64::from_le_bytes(word);
            }
            cuda(
                self.prog
                    .stream
                    .memcpy_htod(words.as_slice(), &mut arena.slice_mut(w.clone())),
                "writing a buffer",
            )?;
        }
        cuda(self.prog.stream.synchronize(), "writing a buffer")
    }

    fn write(&mut self, p: usize, b: usize, parcel: Self::Parcel) -> Result<(), String> {
        let buf = &self.prog.art.header.programs[p].buffers[b];
        let w = Self::words(buf);
        for (arena, piece) in self.dev[p].iter_mut().zip(&parcel) {
            cuda(
                self.prog
                    .stream
                    .memcpy_dtod(piece, &mut arena.slice_mut(w.clone())),
                "receiving a buffer",
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{folded, gemm_by_blas};
    use crate::artifact::Gemm;

    #[test]
    fn shared_weight_products_fold_into_one() {
        let g = |batch, ta, b_batched| Gemm {
            batch,
            m: 256,
            n: 1152,
            k: 384,
            ta,
            tb: false,
            b_batched,
            bias: None,
        };
        assert_eq!(folded(&g(64, false, false)), (1, 64 * 256));
        // A transposed: its rows are not the result's; B per product: not one product.
        assert_eq!(folded(&g(64, true, false)), (64, 256));
        assert_eq!(folded(&g(64, false, true)), (64, 256));
        assert_eq!(folded(&g(1, false, false)), (1, 256));
    }
    use crate::artifact::Elt::{Bf16, F32, I64};

    /// cuBLAS takes all-f32 products and bf16 x bf16 ones (tensor cores, f32 or bf16
    /// out); a product mixing an f32 and a bf16 operand runs the generated kernel.
    #[test]
    fn products_go_to_cublas_when_it_takes_their_storage() {
        assert!(gemm_by_blas([F32, F32, F32]));
        assert!(gemm_by_blas([Bf16, Bf16, Bf16]));
        assert!(gemm_by_blas([Bf16, Bf16, F32]));
        assert!(!gemm_by_blas([F32, Bf16, Bf16]));
        assert!(!gemm_by_blas([F32, F32, Bf16]));
        assert!(!gemm_by_blas([Bf16, Bf16, I64]));
    }

    #[test]
    fn without_a_driver_the_backend_says_so() {
        match super::available() {
            Ok(n) => println!("cuda: {n} device(s)"),
            Err(e) => {
                assert!(e.contains("CUDA"), "{e}");
                println!("skipped: {e}");
            }
        }
    }
}
