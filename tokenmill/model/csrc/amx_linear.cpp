// y = x W^T (+ b) in bf16 on AMX for any number of rows, W packed by lm_head_pack_bf16 (csrc/amx_tile.h has the
// layout, the reason and the bit rules). The small-row path of bf16 linears on AMX CPUs (linear.PackedWeight, the
// fused decoder stacks' any_linear): steps of up to amx_rows() rows and, under linear.small_row_bits, verify steps of
// any row count, so a decode token gets the same bits alone, in a batch, or beside its speculative tokens.
// Epilogue as linear_small's: fp32 sum + bias, rounded to bf16 (nearest even).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "amx_tile.h"

bool has_amx_bf16() {
#ifdef TM_AMX
  return tm_amx::available();
#else
  return false;
#endif
}

// The most rows a bf16 linear runs on AMX (PackedWeight.small_limit, decoder_stack's any_linear); above, oneDNN. Measured
// on the demo's 24 linears in rotation (weights streamed from beyond L2, Sapphire-Rapids-class VM, 2 threads): AMX vs
// oneDNN 240 vs 662 us at 1 row, 255 vs 647 at 9, 527 vs 766 at 64, 1559 vs 1727 at 256; oneDNN wins on long
// prefills (1,024 rows of a 256 x 704 weight held in cache: 148 vs 372 us).
constexpr int64_t AMX_ROWS = 256;

int64_t amx_rows() { return AMX_ROWS; }

// Returns false (nothing written) where AMX does not apply: not compiled in / not granted, K % 32, dtypes.
bool linear_amx_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
#ifdef TM_AMX
  if (!tm_amx::available() || x.scalar_type() != at::kBFloat16 || out.scalar_type() != at::kBFloat16 ||
      (bias.has_value() && bias->scalar_type() != at::kBFloat16))
    return false;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && packed.is_contiguous() &&
              packed.scalar_type() == at::kInt && packed.dim() == 3 && packed.size(2) == tm_amx::VT,
              "linear_amx_bf16: contiguous x [M, K] bf16, packed [T, K / 2, 64] int32");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), T = packed.size(0);
  TORCH_CHECK(out.size(0) == M && packed.size(1) * 2 == K && T == (N + tm_amx::VT - 1) / tm_amx::VT &&
              (!bias.has_value() || bias->numel() == N), "linear_amx_bf16: shapes");
  if (K % 32) return false;
  if (M == 0) return true;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  const int64_t K2 = K / 2;
  // every thread takes a share of the tiles, however few (grain 1): the weights stream from beyond L2 (a model's
  // linears do not stay cached between steps), and one thread alone does not reach the memory bandwidth
  // (measured on 24 demo-shaped linears in rotation: grain 4 left the 256-column ones on one thread, +15%). Below
  // 64 KiB of weight (a draft model's linears) the call runs on this thread: waking the pool costs more (~1.5 us)
  const int64_t grain = N * K * 2 <= (64 << 10) ? T : 1;
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) float buf[16 * tm_amx::VT];
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int R = (int)std::min<int64_t>(16, M - m0);
      tm_amx::configure(R);
      for (int64_t t = t0; t < t1; ++t) {
        tm_amx::tile64(xp, K, m0, wp + t * K2 * tm_amx::VT, buf);
        const int64_t n0 = t * tm_amx::VT, nn = std::min<int64_t>(tm_amx::VT, N - n0);
        for (int r = 0; r < R; ++r) {
          at::BFloat16* o = op + (m0 + r) * N + n0;
          const float* s = buf + r * tm_amx::VT;
          for (int64_t j = 0; j < nn; ++j) o[j] = at::BFloat16(s[j] + (bp ? static_cast<float>(bp[n0 + j]) : 0.f));
        }
      }
    }
    _tile_release();
  });
  return true;
#else
  (void)out; (void)x; (void)packed; (void)bias;
  return false;
#endif
}

void register_amx_linear(pybind11::module& m) {
  m.def("amx_rows", &amx_rows, "the most rows a bf16 linear runs on AMX (above: oneDNN)");
  m.def("has_amx_bf16", &has_amx_bf16, "whether the AMX bf16 kernels are compiled in and this process may use AMX");
  m.def("linear_amx_bf16", &linear_amx_bf16, "bf16 y = x W^T (+ b) on AMX tiles, any rows, W packed by "
        "lm_head_pack_bf16; False (nothing written) where it does not apply", pybind11::arg("out"),
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none());
}
