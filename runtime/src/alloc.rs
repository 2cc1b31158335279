//! Allocator tuning. Kernels return fresh buffers; with glibc's defaults every buffer above
//! 128 KiB is a new `mmap`, and its first touch page-faults page by page — on the nanoGPT
//! step that cost more than the arithmetic of the elementwise ops. Raising the mmap
//! threshold (to glibc's maximum, 32 MiB) and never trimming keeps freed buffers in the heap
//! for the next op. Process-wide; done once, on the first interpreter run.

use std::sync::Once;

static TUNE: Once = Once::new();

/// Makes freed tensor buffers reusable without page faults (glibc only; a no-op elsewhere).
pub fn keep_freed_memory() {
    TUNE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            const M_TRIM_THRESHOLD: i32 = -1;
            const M_MMAP_THRESHOLD: i32 = -3;
            extern "C" {
                fn mallopt(param: i32, value: i32) -> i32;
            }
            // SAFETY: mallopt only changes allocator parameters; both values are in range.
            unsafe {
                mallopt(M_MMAP_THRESHOLD, 32 << 20);
                mallopt(M_TRIM_THRESHOLD, i32::MAX);
            }
        }
    });
}
