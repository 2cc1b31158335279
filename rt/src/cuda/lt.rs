//! Matrix products with a bias through cuBLASLt (`dnn.linear`'s `x W^T + b`): the bias
//! added by the product's epilogue (`CUBLASLT_EPILOGUE_BIAS`), so the result is written
//! once instead of stored and read again by an element-wise kernel. Each shape's plan
//! (descriptors and the algorithm cuBLASLt's heuristic chooses) is made on its first
//! product and kept; a shape cuBLASLt cannot take is remembered too, and its products take
//! cuBLAS and the artifact's bias kernel instead (the caller's fallback).
//!
//! Row-major `C[rows, n] = A B + bias` is column-major `C^T = B^T A^T + bias` with the
//! bias along `C^T`'s rows, which is the epilogue's: cuBLASLt's `A` is our `B` and its
//! `B` our `A`, as the cuBLAS calls swap them ([`super::CudaProgram::gemm_of`]).

use crate::artifact::{Elt, Gemm};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// The workspace cuBLASLt may use (NVIDIA's recommendation for Hopper: 32 MiB).
const WORKSPACE: usize = 32 << 20;

/// What decides a plan: the product's shape and layouts, each operand's storage, the
/// bias's, and whether f32 products may use TF32.
type Key = (u64, u64, u64, bool, bool, [Elt; 3], Elt, bool);

/// A product's descriptor and its matrices' layouts (ours `B`, `A`, `C` in cuBLASLt's
/// order), destroyed with it.
struct Descs {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: made by `Lt::plan`, owned here only, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for &l in &self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

/// One shape's descriptors and algorithm.
struct Plan {
    d: Descs,
    algo: sys::cublasLtMatmulAlgo_t,
}

/// cuBLASLt on one stream: its handle, workspace and plans.
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    /// The workspace, kept alive for `ws`, its device address.
    _workspace: CudaSlice<u8>,
    ws: u64,
    stream: Arc<CudaStream>,
    /// Per shape its plan, or why cuBLASLt cannot take it.
    plans: Mutex<HashMap<Key, Result<Plan, String>>>,
}

// SAFETY: the handle and the plans' descriptors are used under `plans`' lock or on the
// one stream the program's launches are ordered on; cuBLASLt's handle may be used from
// any thread.
unsafe impl Send for Lt {}
// SAFETY: as above.
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        if let Ok(p) = self.plans.get_mut() {
            p.clear();
        }
        // SAFETY: made by `Lt::new`, destroyed once, here, after its plans.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

impl std::fmt::Debug for Lt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lt").finish_non_exhaustive()
    }
}

fn cublas<T>(r: Result<T, cudarc::cublaslt::result::CublasError>, what: &str) -> Result<T, String> {
    r.map_err(|e| format!("cuBLASLt: {what}: {e:?}"))
}

fn data_type(e: Elt) -> sys::cudaDataType {
    match e {
        Elt::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        _ => sys::cudaDataType::CUDA_R_32F,
    }
}

impl Lt {
    /// cuBLASLt on `stream`, or why not (`libcublasLt.so` missing, or `NNSCALER_CUBLASLT=0`
    /// asks for cuBLAS and the bias kernels instead).
    pub(super) fn new(stream: Arc<CudaStream>) -> Result<Lt, String> {
        if std::env::var("NNSCALER_CUBLASLT").is_ok_and(|v| v.trim() == "0") {
            return Err("NNSCALER_CUBLASLT=0".into());
        }
        // SAFETY: probing for the library has no preconditions.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcublasLt.so not found".into());
        }
        let handle = cublas(lt::create_handle(), "a handle")?;
        // SAFETY: the workspace is only cuBLASLt's, written by its kernels on this stream.
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE) }
            .map_err(|e| format!("CUDA: cuBLASLt's workspace: {e}"))?;
        let ws = workspace.device_ptr(&stream).0;
        Ok(Lt {
            handle,
            _workspace: workspace,
            ws,
            stream,
            plans: Mutex::new(HashMap::new()),
        })
    }

    /// `c = a b + bias` on the stream (`g` one product with a bias, operands stored as
    /// `elts` (A, B, C), the bias as `bias_elt`), or why cuBLASLt did not take it (nothing
    /// was launched then).
    pub(super) fn product(
        &self,
        g: &Gemm,
        [a, b, bias, c]: [u64; 4],
        elts: [Elt; 3],
        bias_elt: Elt,
    ) -> Result<(), String> {
        if g.batch != 1 {
            return Err("a batch of products".into());
        }
        let tf32 = crate::precision::tf32() && elts == [Elt::F32; 3];
        let key = (g.m, g.n, g.k, g.ta, g.tb, elts, bias_elt, tf32);
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let plan = plans
            .entry(key)
            .or_insert_with(|| self.plan(g, elts, bias_elt, tf32))
            .as_ref()
            .map_err(String::clone)?;
        let bias_ptr: u64 = bias;
        // SAFETY: the descriptor is this plan's; the attribute is a device pointer, read
        // during the call.
        cublas(
            unsafe {
                lt::set_matmul_desc_attribute(
                    plan.d.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&bias_ptr as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            },
            "the bias",
        )?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: a, b, bias and c point into the device's arena at buffers of the
        // product's sizes (the compiler's memory plan, checked when the artifact was
        // read); the plan's layouts describe them; the scalars are read during the call.
        cublas(
            unsafe {
                lt::matmul(
                    self.handle,
                    plan.d.desc,
                    (&alpha as *const f32).cast(),
                    (&beta as *const f32).cast(),
                    b as *const c_void,
                    plan.d.layouts[0],
                    a as *const c_void,
                    plan.d.layouts[1],
                    c as *const c_void,
                    plan.d.layouts[2],
                    c as *mut c_void,
                    plan.d.layouts[2],
                    &plan.algo,
                    self.ws as *mut c_void,
                    WORKSPACE,
                    self.stream.cu_stream() as *mut _,
                )
            },
            "a product",
        )
    }

    /// The descriptors and the heuristic's algorithm for `g`'s shape.
    fn plan(&self, g: &Gemm, elts: [Elt; 3], bias_elt: Elt, tf32: bool) -> Result<Plan, String> {
        let compute = if tf32 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let desc = cublas(
            lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F),
            "a product's descriptor",
        )?;
        // From here the descriptors are destroyed when `d` is, on any error too.
        let mut d = Descs {
            desc,
            layouts: Vec::with_capacity(3),
        };
        // cuBLASLt's A is our B (op T, 1, where B is stored [n, k]; else N, 0), its B
        // our A.
        let (ta, tb) = (i32::from(g.tb), i32::from(g.ta));
        let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
        let bias_type = data_type(bias_elt);
        use sys::cublasLtMatmulDescAttributes_t as A;
        let attrs: [(A, *const c_void); 4] = [
            (A::CUBLASLT_MATMUL_DESC_TRANSA, (&raw const ta).cast()),
            (A::CUBLASLT_MATMUL_DESC_TRANSB, (&raw const tb).cast()),
            (
                A::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&raw const epilogue).cast(),
            ),
            (
                A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                (&raw const bias_type).cast(),
            ),
        ];
        for (attr, value) in attrs {
            // SAFETY: `desc` is live; each value is a 4-byte enum, read during the call.
            cublas(
                unsafe { lt::set_matmul_desc_attribute(desc, attr, value, 4) },
                "a product's attribute",
            )?;
        }
        // As stored, column-major: our B ([n, k] if tb, else [k, n]) is k x n (or n x k);
        // our A ([rows, k], or [k, rows] if ta) is k x rows (or rows x k); C^T is n x rows.
        let shapes = [
            (elts[1], if g.tb { (g.k, g.n) } else { (g.n, g.k) }),
            (elts[0], if g.ta { (g.m, g.k) } else { (g.k, g.m) }),
            (elts[2], (g.n, g.m)),
        ];
        for (e, (rows, cols)) in shapes {
            d.layouts.push(cublas(
                lt::create_matrix_layout(data_type(e), rows, cols, rows as i64),
                "a matrix layout",
            )?);
        }
        let algo = self.algorithm(desc, &d.layouts)?;
        Ok(Plan { d, algo })
    }

    /// The fastest algorithm cuBLASLt's heuristic gives for `desc` on `layouts` within
    /// the workspace.
    fn algorithm(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        layouts: &[sys::cublasLtMatrixLayout_t],
    ) -> Result<sys::cublasLtMatmulAlgo_t, String> {
        let &[lb, la, lc] = layouts else {
            return Err("a product needs three layouts".into());
        };
        let pref = cublas(lt::create_matmul_pref(), "a preference")?;
        let bytes = WORKSPACE as u64;
        // SAFETY: `pref` was made above; the value is read during the calls; the
        // descriptors are live.
        let found = unsafe {
            cublas(
                lt::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&bytes as *const u64).cast(),
                    8,
                ),
                "the workspace",
            )
            .and_then(|()| {
                cublas(
                    lt::get_matmul_algo_heuristic(self.handle, desc, lb, la, lc, lc, pref),
                    "no algorithm for this product",
                )
            })
        };
        // SAFETY: made above, not used again.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
        }
        Ok(found?.algo)
    }
}
