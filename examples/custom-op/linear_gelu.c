/*
 * The fused "linear + gelu" of linear-gelu.mlir as a C kernel (nnscaler's kernel ABI,
 * runtime/include/nnscaler_kernel.h), with its VJP:
 *
 *   linear_gelu(x [m, k], w [n, k]) -> z [m, n],   z = gelu(x w^T)   (erf form)
 *   linear_gelu_vjp(x, w, dz) -> (dx [m, k], dw [n, k])
 *
 * Shapes are read from the tensors: after partitioning each device calls these with its
 * pieces (rows of x, rows of w). No global state, so threads may call them at once.
 *
 *   cc -shared -fPIC -O2 -I runtime/include -o liblinear_gelu.so examples/custom-op/linear_gelu.c -lm
 */
#include "nnscaler_kernel.h"

#include <math.h>
#include <stdio.h>

static int check(const nns_tensor *t, int32_t n_in, nns_tensor *o, int32_t n_out, int32_t want_in,
                 int32_t want_out, char *error, size_t cap) {
  (void)t;
  (void)o;
  if (n_in != want_in || n_out != want_out) {
    snprintf(error, cap, "expected %d operands and %d results, got %d and %d", want_in, want_out,
             n_in, n_out);
    return 1;
  }
  return 0;
}

static int f32_matrix(const nns_tensor *t, const char *what, char *error, size_t cap) {
  if (t->dtype != NNS_F32 || t->rank != 2) {
    snprintf(error, cap, "%s must be a 2-d f32 tensor", what);
    return 1;
  }
  return 0;
}

/* y[i][j] = sum_p x[i][p] w[j][p] */
static double dot(const float *x, const float *w, int64_t i, int64_t j, int64_t k) {
  double s = 0.0;
  for (int64_t p = 0; p < k; ++p) s += (double)x[i * k + p] * (double)w[j * k + p];
  return s;
}

int linear_gelu(const nns_tensor *in, int32_t n_in, nns_tensor *out, int32_t n_out, char *error,
                size_t cap) {
  if (check(in, n_in, out, n_out, 2, 1, error, cap) || f32_matrix(&in[0], "x", error, cap) ||
      f32_matrix(&in[1], "w", error, cap) || f32_matrix(&out[0], "z", error, cap))
    return 1;
  int64_t m = in[0].shape[0], k = in[0].shape[1], n = in[1].shape[0];
  if (in[1].shape[1] != k || out[0].shape[0] != m || out[0].shape[1] != n) {
    snprintf(error, cap, "shapes do not agree: x %ldx%ld, w %ldx%ld, z %ldx%ld", (long)m, (long)k,
             (long)in[1].shape[0], (long)in[1].shape[1], (long)out[0].shape[0],
             (long)out[0].shape[1]);
    return 2;
  }
  const float *x = in[0].data, *w = in[1].data;
  float *z = out[0].data;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double y = dot(x, w, i, j, k);
      z[i * n + j] = (float)(0.5 * y * (1.0 + erf(y / sqrt(2.0))));
    }
  return 0;
}

int linear_gelu_vjp(const nns_tensor *in, int32_t n_in, nns_tensor *out, int32_t n_out,
                    char *error, size_t cap) {
  if (check(in, n_in, out, n_out, 3, 2, error, cap) || f32_matrix(&in[0], "x", error, cap) ||
      f32_matrix(&in[1], "w", error, cap) || f32_matrix(&in[2], "dz", error, cap))
    return 1;
  int64_t m = in[0].shape[0], k = in[0].shape[1], n = in[1].shape[0];
  const float *x = in[0].data, *w = in[1].data, *dz = in[2].data;
  float *dx = out[0].data, *dw = out[1].data;
  for (int64_t i = 0; i < m * k; ++i) dx[i] = 0.0f;
  for (int64_t i = 0; i < n * k; ++i) dw[i] = 0.0f;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double y = dot(x, w, i, j, k);
      double cdf = 0.5 * (1.0 + erf(y / sqrt(2.0)));
      double pdf = exp(-0.5 * y * y) / sqrt(2.0 * M_PI);
      double g = dz[i * n + j] * (cdf + y * pdf);
      for (int64_t p = 0; p < k; ++p) {
        dx[i * k + p] += (float)(g * w[j * k + p]);
        dw[j * k + p] += (float)(g * x[i * k + p]);
      }
    }
  return 0;
}
