/*
 * nnscaler's C kernel ABI: how the CPU runtime calls a user op implemented in C.
 *
 * A user op declared as
 *
 *   func.func private @my_gemm(%a: tensor<8x16xf32>, %b: tensor<16x4xf32>) -> tensor<8x4xf32>
 *       attributes {nns.annotation = "m k+, k+ n -> m n",
 *                   nns.kernel = "libmyops.so:my_gemm", nns.vjp = @my_gemm_vjp}
 *
 * runs by calling the symbol `my_gemm` of `libmyops.so` (loaded with dlopen: a name with a
 * '/' is a path, relative to the working directory; otherwise the dynamic loader's search
 * path, LD_LIBRARY_PATH included, is used). A missing library or symbol is an error naming
 * both; the run then writes nothing.
 *
 * The kernel gets the operands and preallocated results, each a dense row-major tensor with
 * its element type and shape. The CPU runtime computes every float type of the IR in f32
 * (NNS_F32) and integers in i64 (NNS_I64); operands must not be written. After partitioning it is called with each device's local
 * shapes (the pieces its annotation's split gives), so it must work for any shapes its
 * annotation allows. On simulated devices several threads call it at once: it must be
 * thread-safe (no global mutable state). It returns 0 on success; otherwise it writes a
 * message (NUL-terminated, at most `error_capacity` bytes) into `error` and returns nonzero,
 * and the run fails with that message.
 *
 * To differentiate such an op, give it `nns.vjp = @my_gemm_vjp`: a function (a kernel
 * declaration or IR) taking the operands then the results' gradients and returning one
 * gradient per operand, with its own annotation.
 */
#ifndef NNSCALER_KERNEL_H
#define NNSCALER_KERNEL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types. */
enum { NNS_F32 = 0, NNS_I64 = 1 };

typedef struct {
  void *data;           /* rank-many dims, row-major, contiguous */
  int32_t dtype;        /* NNS_F32 or NNS_I64 */
  int32_t rank;
  const int64_t *shape; /* rank entries */
} nns_tensor;

typedef int (*nns_kernel)(const nns_tensor *inputs, int32_t num_inputs, nns_tensor *outputs,
                          int32_t num_outputs, char *error, size_t error_capacity);

#ifdef __cplusplus
}
#endif

#endif /* NNSCALER_KERNEL_H */
