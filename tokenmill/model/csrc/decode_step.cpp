// The fused decoder stack's per-step call without its per-step argument conversion: `DecodeStackHandle` holds the
// stack's weight list (224 tensors on the 8-layer demo model), its kinds, the KV cache list, the rope tables and the
// shape constants as C++ objects, converted from Python once (fused_decode.py builds it after loading and again when
// the runner's caches change). A step passes only its five per-step tensors; the call is decoder_stack's
// (csrc/paged_decode.cpp) with the same arguments, so the same kernels in the same order and the same bits.
// (Measured on the 40M demo model: converting the lists costs ~11 us per call, 1-2% of a batch-1 int8 step.)
#include <torch/extension.h>

#include <vector>

// csrc/paged_decode.cpp
torch::Tensor decoder_stack(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                            std::vector<torch::Tensor> w, std::vector<int64_t> kinds,
                            std::vector<torch::Tensor> caches, torch::Tensor slot_mapping,
                            torch::Tensor block_tables, torch::Tensor ctx_lens, torch::Tensor final_norm,
                            double eps, double scale, int64_t window, int64_t nh, int64_t nkv, int64_t hd,
                            int64_t inter);

namespace {

struct DecodeStackHandle {
  std::vector<torch::Tensor> weights;
  std::vector<int64_t> kinds;
  std::vector<torch::Tensor> caches;
  torch::Tensor cos, sin, final_norm;
  double eps, scale;
  int64_t window, nh, nkv, hd, inter;

  DecodeStackHandle(std::vector<torch::Tensor> w, std::vector<int64_t> k, torch::Tensor c, torch::Tensor s,
                    torch::Tensor fn, double eps_, double scale_, int64_t window_, int64_t nh_, int64_t nkv_,
                    int64_t hd_, int64_t inter_)
      : weights(std::move(w)), kinds(std::move(k)), cos(std::move(c)), sin(std::move(s)), final_norm(std::move(fn)),
        eps(eps_), scale(scale_), window(window_), nh(nh_), nkv(nkv_), hd(hd_), inter(inter_) {
    TORCH_CHECK(kinds.size() % 4 == 0 && !kinds.empty(), "DecodeStackHandle: 4 linear kinds per layer");
  }

  void set_caches(std::vector<torch::Tensor> c) {
    TORCH_CHECK(c.size() == kinds.size(), "DecodeStackHandle: 4 cache tensors per layer (K, V, K scales, V scales)");
    caches = std::move(c);
  }

  torch::Tensor run(torch::Tensor x, torch::Tensor positions, torch::Tensor slot_mapping, torch::Tensor block_tables,
                    torch::Tensor ctx_lens, int64_t window_override) {
    TORCH_CHECK(!caches.empty(), "DecodeStackHandle: set_caches first");
    return decoder_stack(x, positions, cos, sin, weights, kinds, caches, slot_mapping, block_tables, ctx_lens,
                         final_norm, eps, scale, window_override >= 0 ? window_override : window, nh, nkv, hd, inter);
  }
};

}  // namespace

void register_decode_step(pybind11::module& m) {
  pybind11::class_<DecodeStackHandle>(m, "DecodeStackHandle",
                                      "decoder_stack's per-model arguments held in C++ (csrc/decode_step.cpp)")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<int64_t>, torch::Tensor, torch::Tensor,
                          torch::Tensor, double, double, int64_t, int64_t, int64_t, int64_t, int64_t>())
      .def("set_caches", &DecodeStackHandle::set_caches)
      .def("run", &DecodeStackHandle::run,
           "decoder_stack(x, positions, <held>, slot_mapping, block_tables, ctx_lens, <held>); window < 0: the held one",
           pybind11::arg("x"), pybind11::arg("positions"), pybind11::arg("slot_mapping"), pybind11::arg("block_tables"),
           pybind11::arg("ctx_lens"), pybind11::arg("window") = -1);
}
