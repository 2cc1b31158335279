//! User ops implemented in C (`nns.kernel = "library:symbol"`), called through the ABI of
//! `runtime/include/nnscaler_kernel.h`.
//!
//! Libraries are loaded once per process (`dlopen`, kept open) and symbols looked up once;
//! a kernel gets the operands and the preallocated results as dense row-major tensors.

use crate::tensor::{Data, Tensor};
use nnscaler_dialects::types::TensorType;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

/// One tensor as the kernel sees it (`nns_tensor`).
#[repr(C)]
struct CTensor {
    data: *mut c_void,
    dtype: i32,
    rank: i32,
    shape: *const i64,
}

type KernelFn =
    unsafe extern "C" fn(*const CTensor, i32, *mut CTensor, i32, *mut c_char, usize) -> c_int;

/// A looked-up symbol (the library stays loaded for the process's life).
#[derive(Clone, Copy)]
struct Symbol(KernelFn);

fn cache() -> &'static Mutex<HashMap<String, Symbol>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Symbol>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

fn dlerror() -> String {
    // SAFETY: dlerror returns a thread-local C string or null.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// The kernel `spec` (`library:symbol`) of user op `op`, loading it on first use.
fn lookup(spec: &str, op: &str) -> Result<Symbol, String> {
    let mut c = cache()
        .lock()
        .map_err(|_| "the kernel cache is poisoned".to_string())?;
    if let Some(s) = c.get(spec) {
        return Ok(*s);
    }
    let (lib, sym) = spec
        .rsplit_once(':')
        .ok_or_else(|| format!("@{op}: 'nns.kernel' \"{spec}\" is not \"library:symbol\""))?;
    let clib = CString::new(lib).map_err(|_| format!("@{op}: the library name has a NUL"))?;
    let csym = CString::new(sym).map_err(|_| format!("@{op}: the symbol name has a NUL"))?;
    // SAFETY: plain dlopen/dlsym with C strings; the handle is never closed, so the symbol
    // stays valid for the process.
    unsafe {
        let h = libc::dlopen(clib.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if h.is_null() {
            return Err(format!(
                "@{op}: cannot load kernel library '{lib}': {}",
                dlerror()
            ));
        }
        let f = libc::dlsym(h, csym.as_ptr());
        if f.is_null() {
            return Err(format!(
                "@{op}: kernel library '{lib}' has no symbol '{sym}'"
            ));
        }
        let s = Symbol(std::mem::transmute::<*mut c_void, KernelFn>(f));
        c.insert(spec.to_string(), s);
        Ok(s)
    }
}

/// Checks that `spec` loads (library and symbol), for errors before a run starts.
pub fn check(spec: &str, op: &str) -> Result<(), String> {
    lookup(spec, op).map(|_| ())
}

/// Runs kernel `spec` of op `op` on `inputs`, producing results of types `outs`.
pub fn call(
    spec: &str,
    op: &str,
    inputs: &[&Tensor],
    outs: &[TensorType],
) -> Result<Vec<Tensor>, String> {
    let f = lookup(spec, op)?;
    let in_shapes: Vec<Vec<i64>> = inputs
        .iter()
        .map(|t| t.shape.iter().map(|&d| d as i64).collect())
        .collect();
    let c_in: Vec<CTensor> = inputs
        .iter()
        .zip(&in_shapes)
        .map(|(t, s)| CTensor {
            data: match &t.data {
                Data::F32(v) => v.as_ptr() as *mut c_void,
                Data::I64(v) => v.as_ptr() as *mut c_void,
            },
            dtype: match t.data {
                Data::F32(_) => 0,
                Data::I64(_) => 1,
            },
            rank: s.len() as i32,
            shape: s.as_ptr(),
        })
        .collect();
    let mut results: Vec<Tensor> = outs
        .iter()
        .map(|t| {
            let shape = crate::tensor::dims(t);
            let n: usize = shape.iter().product();
            if t.elem.is_float() {
                Tensor::f32(&shape, vec![0.0; n])
            } else {
                Tensor::i64(&shape, vec![0; n])
            }
        })
        .collect();
    let out_shapes: Vec<Vec<i64>> = outs.iter().map(|t| t.shape.clone()).collect();
    let mut c_out: Vec<CTensor> = results
        .iter_mut()
        .zip(&out_shapes)
        .map(|(t, s)| {
            let (data, dtype) = match &mut t.data {
                Data::F32(v) => (v.as_mut_ptr() as *mut c_void, 0),
                Data::I64(v) => (v.as_mut_ptr() as *mut c_void, 1),
            };
            CTensor {
                data,
                dtype,
                rank: s.len() as i32,
                shape: s.as_ptr(),
            }
        })
        .collect();
    let mut err = vec![0 as c_char; 1024];
    // SAFETY: the kernel gets pointers to live buffers of the stated shapes (inputs only
    // read, outputs preallocated), per the ABI in nnscaler_kernel.h.
    let rc = unsafe {
        (f.0)(
            c_in.as_ptr(),
            c_in.len() as i32,
            c_out.as_mut_ptr(),
            c_out.len() as i32,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc != 0 {
        let last = err.len() - 1;
        err[last] = 0;
        // SAFETY: NUL-terminated above.
        let msg = unsafe { CStr::from_ptr(err.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        return Err(format!(
            "@{op}: kernel '{spec}' failed ({rc}): {}",
            if msg.is_empty() { "no message" } else { &msg }
        ));
    }
    Ok(results)
}
