// regather._wgrad_ext: main_grad[M, N] += grad_output[K, M]^T @ input[K, N] in fp32.
//
// One cuBLAS GemmEx call with an fp32 C matrix and beta = 1, so the product is
// accumulated straight into main_grad (no fp32 copy of the inputs, no temporary
// for the product). This is the operation apex's fused_weight_gradient_mlp_cuda
// (wgrad_gemm_accum_fp32) performs for Megatron's gradient-accumulation fusion.
//
//   tensor       shape    dtype               layout required
//   input        [K, N]   bf16 / fp16 / fp32  stride(1) == 1
//   grad_output  [K, M]   same as input       stride(1) == 1
//   main_grad    [M, N]   fp32                stride(1) == 1
//
// Row-major <-> column-major: cuBLAS is column-major. A row-major [R, C]
// matrix with row stride ld is a column-major [C, R] matrix with leading
// dimension ld. So, column-major:
//   C' = main_grad^T  [N, M], ldc = main_grad.stride(0)
//   X' = input^T      [N, K], lda = input.stride(0)
//   G' = grad_out^T   [M, K], ldb = grad_output.stride(0)
// and main_grad += grad_output^T @ input  <=>  C' += X' @ G'^T, i.e.
//   gemm(opA = N, opB = T, m = N, n = M, k = K, A = X', B = G', C = C').
//
// Compute type CUBLAS_COMPUTE_32F: fp32 accumulation. For fp32 inputs the
// handle's math mode (set by PyTorch from torch.backends.cuda.matmul.allow_tf32)
// decides whether TF32 tensor cores may be used, exactly as for torch.mm.

// Only what the file uses: the Tensor class and pybind11 with torch's Tensor caster, not
// <torch/extension.h> (which adds torch's whole C++ front end: nn, optim, data, autograd API) --
// half the compile time (52 s -> 25 s of CPU on this machine's g++ 12, torch 2.14.1).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

namespace {

const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_<unknown>";
  }
}

cudaDataType_t cuda_type_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default:
      TORCH_CHECK(false, "wgrad_gemm_accum_fp32: unsupported input dtype ", t.scalar_type(),
                  " (expected bfloat16, float16 or float32)");
  }
  return CUDA_R_32F;  // unreachable
}

// Leading dimension of a row-major 2-D tensor: its row stride, except that a
// single-row tensor may carry any stride and cuBLAS wants ld >= number of columns.
int64_t leading_dim(const at::Tensor& t) {
  return t.size(0) > 1 ? t.stride(0) : std::max<int64_t>(t.size(1), 1);
}

void check_operand(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "wgrad_gemm_accum_fp32: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2, "wgrad_gemm_accum_fp32: ", name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "wgrad_gemm_accum_fp32: ", name,
              " must have unit stride in its last dim, got strides ", t.strides());
  TORCH_CHECK(t.size(0) <= 1 || t.stride(0) >= t.size(1), "wgrad_gemm_accum_fp32: ", name,
              " rows overlap: strides ", t.strides(), " for sizes ", t.sizes());
  TORCH_CHECK(leading_dim(t) <= INT_MAX && t.size(0) <= INT_MAX && t.size(1) <= INT_MAX,
              "wgrad_gemm_accum_fp32: ", name, " is too large for 32-bit cuBLAS sizes: ", t.sizes());
}

}  // namespace

// main_grad += grad_output^T @ input. Argument order follows apex's
// wgrad_gemm_accum_fp32(input, d_output, d_weight).
void wgrad_gemm_accum_fp32(const at::Tensor& input, const at::Tensor& grad_output, at::Tensor& main_grad) {
  check_operand(input, "input");
  check_operand(grad_output, "grad_output");
  check_operand(main_grad, "main_grad");
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat, "wgrad_gemm_accum_fp32: main_grad must be float32, got ",
              main_grad.scalar_type());
  TORCH_CHECK(input.scalar_type() == grad_output.scalar_type(),
              "wgrad_gemm_accum_fp32: input and grad_output dtypes differ: ", input.scalar_type(), " vs ",
              grad_output.scalar_type());
  TORCH_CHECK(input.device() == grad_output.device() && input.device() == main_grad.device(),
              "wgrad_gemm_accum_fp32: tensors on different devices: ", input.device(), ", ",
              grad_output.device(), ", ", main_grad.device());
  const int64_t K = input.size(0), N = input.size(1), M = grad_output.size(1);
  TORCH_CHECK(grad_output.size(0) == K, "wgrad_gemm_accum_fp32: K mismatch: input ", input.sizes(),
              ", grad_output ", grad_output.sizes());
  TORCH_CHECK(main_grad.size(0) == M && main_grad.size(1) == N, "wgrad_gemm_accum_fp32: main_grad ",
              main_grad.sizes(), " must be [", M, ", ", N, "]");
  if (K == 0 || M == 0 || N == 0) return;

  const c10::cuda::CUDAGuard guard(main_grad.device());
  // PyTorch's handle for this device, already bound to the current stream and
  // given PyTorch's cuBLAS workspace and math mode.
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const float alpha = 1.0f;
  const float beta = 1.0f;  // accumulate into main_grad
  const cudaDataType_t ab_type = cuda_type_of(input);

  cublasStatus_t status = cublasGemmEx(
      handle, CUBLAS_OP_N, CUBLAS_OP_T,
      static_cast<int>(N), static_cast<int>(M), static_cast<int>(K),
      &alpha,
      input.data_ptr(), ab_type, static_cast<int>(leading_dim(input)),
      grad_output.data_ptr(), ab_type, static_cast<int>(leading_dim(grad_output)),
      &beta,
      main_grad.data_ptr(), CUDA_R_32F, static_cast<int>(leading_dim(main_grad)),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "wgrad_gemm_accum_fp32: cublasGemmEx failed with ",
              cublas_status_name(status), " (K=", K, ", M=", M, ", N=", N, ", dtype=", input.scalar_type(), ")");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "regather fused weight-gradient accumulation (cuBLAS GemmEx, fp32 C, beta=1)";
  m.def("wgrad_gemm_accum_fp32", &wgrad_gemm_accum_fp32,
        "main_grad[M, N] += grad_output[K, M]^T @ input[K, N] (fp32 accumulate, in place)",
        pybind11::arg("input"), pybind11::arg("grad_output"), pybind11::arg("main_grad"));
}
