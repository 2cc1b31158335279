//! The host backend: an artifact's `host.so` section (its kernels compiled for this CPU)
//! loaded with `dlopen`, its steps run in order over one arena.

use crate::artifact::{Artifact, Elt, Step};
use crate::tensor::{Tensor, Values};
use std::ffi::{c_void, CString};

type HostFn = unsafe extern "C" fn(*const *mut u8, u64);

/// A loaded program on the host.
#[derive(Debug)]
pub struct HostProgram {
    art: Artifact,
    lib: *mut c_void,
    fns: Vec<HostFn>,
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown dlopen error".into()
        } else {
            std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

impl HostProgram {
    /// Loads the artifact's host kernels.
    pub fn load(art: Artifact) -> Result<Self, String> {
        let so = art
            .section("host.so")
            .ok_or("the artifact has no host.so section (compiled without host kernels)")?;
        // dlopen needs a file: a private temporary, removed once loaded.
        let path = std::env::temp_dir().join(format!(
            "nnscaler-rt-{}-{:016x}.so",
            std::process::id(),
            crate::artifact::fnv1a64(so)
        ));
        std::fs::write(&path, so).map_err(|e| format!("{}: {e}", path.display()))?;
        let c = CString::new(path.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: `c` is a NUL-terminated path; the library is our kernels (no
        // constructors besides the C runtime's).
        let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        let _ = std::fs::remove_file(&path);
        if lib.is_null() {
            return Err(format!("cannot load the host kernels: {}", dl_error()));
        }
        let mut fns = Vec::new();
        for k in &art.header.kernels {
            let sym = CString::new(format!("{}.host", k.name)).map_err(|e| e.to_string())?;
            // SAFETY: `lib` is a live handle and `sym` NUL-terminated.
            let f = unsafe { libc::dlsym(lib, sym.as_ptr()) };
            if f.is_null() {
                // SAFETY: `lib` came from dlopen and is not used again.
                unsafe { libc::dlclose(lib) };
                return Err(format!("host.so has no kernel {}.host", k.name));
            }
            // SAFETY: the symbol is a kernel entry with this signature (the artifact
            // format's contract for host.so).
            fns.push(unsafe { std::mem::transmute::<*mut c_void, HostFn>(f) });
        }
        Ok(HostProgram { art, lib, fns })
    }

    /// The artifact.
    pub fn artifact(&self) -> &Artifact {
        &self.art
    }

    /// Runs the program once on its arguments (in order); returns its results.
    pub fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>, String> {
        let h = &self.art.header;
        if inputs.len() != h.inputs.len() {
            return Err(format!(
                "the program takes {} arguments, given {}",
                h.inputs.len(),
                inputs.len()
            ));
        }
        // 8-byte aligned arena (offsets are multiples of 256).
        let mut arena = vec![0u64; h.arena_bytes.div_ceil(8) as usize];
        let base = arena.as_mut_ptr().cast::<u8>();
        for (p, t) in h.inputs.iter().zip(inputs) {
            let b = &h.buffers[p.buffer];
            if t.shape != b.shape || t.elt() != b.elt {
                return Err(format!(
                    "'{}' must be {:?} {:?}, given {:?} {:?}",
                    p.name,
                    b.elt,
                    b.shape,
                    t.elt(),
                    t.shape
                ));
            }
            let bytes = t.bytes();
            // SAFETY: the buffer lies inside the arena (checked when the artifact was
            // read) and holds exactly `bytes.len()` bytes (its shape and type match).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    base.add(b.offset as usize),
                    bytes.len(),
                )
            };
        }
        for s in &h.steps {
            let Step::Launch { kernel, buffers } = s;
            // SAFETY: every buffer lies inside the arena (checked on reading).
            let args: Vec<*mut u8> = buffers
                .iter()
                .map(|&b| unsafe { base.add(h.buffers[b].offset as usize) })
                .collect();
            // SAFETY: the kernel reads and writes its buffers within their lengths (the
            // compiler's contract), all inside the arena, which nothing else uses now.
            unsafe { (self.fns[*kernel])(args.as_ptr(), h.kernels[*kernel].len) };
        }
        h.outputs
            .iter()
            .map(|p| {
                let b = &h.buffers[p.buffer];
                let n = b.len() as usize;
                // SAFETY: as above; the buffer holds `n` elements of its type, aligned
                // (offsets are multiples of 256 in an 8-byte aligned arena).
                let data = unsafe {
                    let at = base.add(b.offset as usize);
                    match b.elt {
                        Elt::F32 => {
                            Values::F32(std::slice::from_raw_parts(at.cast::<f32>(), n).to_vec())
                        }
                        Elt::I64 => {
                            Values::I64(std::slice::from_raw_parts(at.cast::<i64>(), n).to_vec())
                        }
                    }
                };
                Ok(Tensor {
                    shape: b.shape.clone(),
                    data,
                })
            })
            .collect()
    }
}

impl Drop for HostProgram {
    fn drop(&mut self) {
        // SAFETY: `lib` came from dlopen; no kernel pointer outlives `self`.
        unsafe { libc::dlclose(self.lib) };
    }
}
