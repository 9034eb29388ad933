/* libcuda.so.1 for `maxtext-moe compile` on a machine without a GPU (./setup.sh --gpu-compile-te).
 *
 * Transformer Engine's JAX extension links cuDNN and TE's core library, and those link the CUDA driver:
 * they cannot be loaded without a libcuda.so.1. A compile needs none of the driver's work, only the
 * library to load, so every entry point they link answers CUDA_ERROR_NO_DEVICE. The setup builds it
 * into .venv-te/lib/maxtext-moe-cuda-stub/, which is on no loader path: only `compile` loads it
 * (maxtext_moe/gpu_compile/te_libraries.py), never `train`. The list is what those libraries import
 * (`nm -D --undefined-only`), plus the version and lookup queries a loader may make first.
 */
#define NO_DEVICE 100 /* CUDA_ERROR_NO_DEVICE */
#define STUB(name) \
  int name(void) { return NO_DEVICE; }

STUB(cuInit)
STUB(cuDriverGetVersion)
STUB(cuGetProcAddress)
STUB(cuGetErrorName)
STUB(cuGetErrorString)
STUB(cuCtxGetCurrent)
STUB(cuFuncSetAttribute)
STUB(cuLaunchKernel)
STUB(cuLaunchKernelEx)
STUB(cuModuleGetFunction)
STUB(cuModuleLoadData)
STUB(cuModuleLoadDataEx)
STUB(cuModuleUnload)
STUB(cuTensorMapEncodeIm2col)
STUB(cuTensorMapEncodeTiled)
