// The CPU linear kernels as one extension, in one translation unit: the GGUF and
// bfloat16-dot kernels inline the bfloat16 kernel's tiles and helpers.
#include "bf16_dot.h"

// The kernels run without the GIL, so the server's other Python threads (the event loop
// streaming and detokenizing answers) run on another core meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_linear", torch::wrap_pybind_function_no_gil(bf16_linear), "bf16_linear");
  m.def("int8_linear", torch::wrap_pybind_function_no_gil(int8_linear), "int8_linear");
  m.def("q4_1_linear", torch::wrap_pybind_function_no_gil(q4_1_linear), "q4_1_linear");
  m.def("q8_0_linear", torch::wrap_pybind_function_no_gil(q8_0_linear), "q8_0_linear");
  m.def("cpu_has_avx512_bf16", torch::wrap_pybind_function(cpu_has_avx512_bf16),
        "cpu_has_avx512_bf16");
  m.def("bf16_linear_bf16_activations",
        torch::wrap_pybind_function_no_gil(bf16_linear_bf16_activations),
        "bf16_linear_bf16_activations");
  m.def("q4_1_linear_bf16_activations",
        torch::wrap_pybind_function_no_gil(q4_1_linear_bf16_activations),
        "q4_1_linear_bf16_activations");
  m.def("q8_0_linear_bf16_activations",
        torch::wrap_pybind_function_no_gil(q8_0_linear_bf16_activations),
        "q8_0_linear_bf16_activations");
}
