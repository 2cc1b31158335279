//! Compiles the C host of nnscaler's C API (`c-host/host.c`, the `nnscaler-c-host` binary)
//! against MLIR 19's C headers and `passes/include/nnscaler.h`.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=c-host/host.c");
    println!("cargo:rerun-if-changed=../passes/include/nnscaler.h");
    let llvm_config = std::env::var("MLIR_SYS_190_PREFIX")
        .map(|p| format!("{p}/bin/llvm-config"))
        .unwrap_or_else(|_| "llvm-config-19".to_string());
    let include = Command::new(&llvm_config)
        .arg("--includedir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "/usr/lib/llvm-19/include".to_string());
    cc::Build::new()
        .file("c-host/host.c")
        .include(include)
        .include("../passes/include")
        .warnings(true)
        .extra_warnings(true)
        .flag_if_supported("-std=c11")
        .compile("nnscaler_c_host");
}
