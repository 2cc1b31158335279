#!/usr/bin/env bash
# Links nnscaler's mlir-opt-19 pass plugin.
#   plugin/build-so.sh STATICLIB OUT.so
# STATICLIB is target/<profile>/libnnscaler_plugin.a (cargo build -p nnscaler-plugin). Only
# its Rust objects go in, with MLIR's C API archives: the staticlib also bundles MLIR's
# archives (mlir-sys links them statically), and a second copy of MLIR in the process that
# loads the plugin would break MLIR's TypeIDs and registries. The C API's calls into MLIR are
# left undefined and resolve to the symbols that mlir-opt-19 exports when it loads the
# plugin.
set -euo pipefail
lib=$(realpath "${1:?usage: plugin/build-so.sh STATICLIB OUT.so}")
out=${2:?usage: plugin/build-so.sh STATICLIB OUT.so}
here=$(cd "$(dirname "$0")" && pwd)
llvm_config=${LLVM_CONFIG:-llvm-config-19}
include=$("$llvm_config" --includedir)
libdir=$("$llvm_config" --libdir)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ar=${LLVM_AR:-llvm-ar-19} # reads the Rust objects' embedded bitcode without complaint
"$ar" t "$lib" | grep '\.rcgu\.o$' > "$work/members"
(cd "$work" && xargs "$ar" x "$lib" < members && xargs "$ar" rcs librust.a < members)
# Rust's objects embed LLVM bitcode that the system ld's LLVM plugin misreads: link with
# the lld that ships with rustc, as rustc does.
gcc_ld="$(rustc --print sysroot)/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin/gcc-ld"
c++ -std=c++17 -fPIC -fno-rtti -O2 -shared -I"$include" "$here/plugin.cpp" \
  -B"$gcc_ld" -fuse-ld=lld \
  -Wl,--start-group "$work/librust.a" "$libdir"/libMLIRCAPI*.a -Wl,--end-group \
  -o "$work/plugin.so"
mv "$work/plugin.so" "$out"
