//! `nnscaler-c-host FILE.mlir PIPELINE`: the C host of nnscaler's C API (`tools/c-host/host.c`,
//! see its header). This is only its process entry: it passes the arguments on to the C
//! `main`, which uses nothing but MLIR's C API and `nnscaler.h`.

use std::ffi::{c_char, c_int, CString};
// The C code is compiled into a static library attached to this package's library (see
// tools/build.rs); using the library links it.
use nnscaler_tools as _;

extern "C" {
    fn nnscaler_c_host_main(argc: c_int, argv: *const *const c_char) -> c_int;
}

fn main() {
    // The C code calls these; naming them here keeps the linker from dropping them before
    // it reads the C library.
    std::hint::black_box([
        nnscaler_passes::capi::nnscalerPrepareContext as *const (),
        nnscaler_passes::capi::nnscalerAddPasses as *const (),
        nnscaler_passes::capi::nnscalerVerify as *const (),
        nnscaler_passes::capi::nnscalerListPasses as *const (),
    ]);
    let args: Vec<CString> = std::env::args_os()
        .map(|a| CString::new(a.into_encoded_bytes()).unwrap_or_default())
        .collect();
    let argv: Vec<*const c_char> = args.iter().map(|a| a.as_ptr()).collect();
    // SAFETY: argv holds argc valid C strings that outlive the call.
    let status = unsafe { nnscaler_c_host_main(argv.len() as c_int, argv.as_ptr()) };
    std::process::exit(status);
}
