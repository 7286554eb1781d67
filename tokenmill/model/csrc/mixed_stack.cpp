// The decoder stack as one C++ call for steps with prefill chunks (a fresh prefill, a chunk over cached context, and
// any number of decode tokens beside them): the per-layer Python and dispatch of the module path (llama.py) gone,
// the same kernels called in the same order, so the same bits (tests/model/test_fused_mixed.py).
//
// Per layer, as the modules do it: RMSNorm; qkv (any_linear, decoder_stack's: small-row kernel for <= 8 rows, oneDNN's
// prepacked GEMM or the int8 GEMM above); q/k norm (qwen3); rope; KV write (fp32/bf16 or int8 cache); attention = prefill_attention over every
// span in one call + paged_decode_attention for the decode tokens (gathered by index, scattered back, as
// attention.py does); o_proj; residual + RMSNorm; gate_up; silu*mul; down; residual. Then the final norm.
// The weight and cache lists are decoder_stack's (csrc/paged_decode.cpp, fused_decode.py builds them).
#include <torch/extension.h>

#include <vector>

// csrc/paged_decode.cpp
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor ctx_lens, double scale, int64_t window,
                            c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales);
void rms_norm(torch::Tensor out, torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor w, double eps);
void silu_mul(torch::Tensor out, torch::Tensor gu);
void qk_norm_rope(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& q_norm, const torch::Tensor& k_norm,
                  double eps, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin);  // paged_decode.cpp
void rope_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slot_mapping);
void write_kv_int8(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scales, torch::Tensor v_scales,
                   torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping);
// csrc/paged_decode.cpp: the Linear modules' kernel choice per row count (one implementation for both fused stacks)
torch::Tensor any_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& w, int64_t base, int64_t kind,
                         int64_t n_out);
// csrc/prefill_attention.cpp
bool prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                       torch::Tensor v_cache, torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor ctx_lens,
                       torch::Tensor block_tables, double scale, int64_t window, c10::optional<torch::Tensor> k_scales,
                       c10::optional<torch::Tensor> v_scales);

namespace {

constexpr int64_t LIN_SLOTS = 6;  // decoder_stack's layout (fused_decode.py LIN_SLOTS_PY, LAYER_SLOTS_PY)
constexpr int64_t LAYER_SLOTS = 4 + 4 * LIN_SLOTS;


}  // namespace

bool has_prefill_attention() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// x [T, hidden] contiguous (the embeddings; the residual stream, updated in place) -> final normed hidden [T, hidden].
// Spans (q_len > 1, as prefill_attention takes them): q_starts, q_lens, ctx_lens [S], block_tables [S, MB] int64.
// Decode tokens: dec_idx [D] (flat indices; D may be 0), dec_block_tables [D, MB'], dec_ctx_lens [D].
// rows [R] (optional): the last layer computes only these rows past its attention; the result is [R, hidden]
// (llama.py's `meta.logits_rows`).
torch::Tensor decoder_stack_mixed(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                                  std::vector<torch::Tensor> w, std::vector<int64_t> kinds,
                                  std::vector<torch::Tensor> caches, torch::Tensor slot_mapping,
                                  torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor ctx_lens,
                                  torch::Tensor block_tables, torch::Tensor dec_idx, torch::Tensor dec_block_tables,
                                  torch::Tensor dec_ctx_lens, c10::optional<torch::Tensor> rows,
                                  torch::Tensor final_norm, double eps, double scale,
                                  int64_t window, int64_t nh, int64_t nkv, int64_t hd, int64_t inter) {
  TORCH_CHECK(has_prefill_attention(), "decoder_stack_mixed: prefill attention not compiled in (no AVX2+FMA)");
  const int64_t T = x.size(0), H = x.size(1), L = (int64_t)kinds.size() / 4, D = dec_idx.numel();
  TORCH_CHECK(x.is_contiguous() && T >= 1, "decoder_stack_mixed: x [T >= 1, hidden] contiguous");
  TORCH_CHECK((int64_t)w.size() == L * LAYER_SLOTS && (int64_t)caches.size() == L * 4, "decoder_stack_mixed: lists");
  TORCH_CHECK(q_starts.numel() >= 1, "decoder_stack_mixed: at least one span (decode-only steps: decoder_stack)");
  const auto opts = x.options();
  auto h = at::empty({T, H}, opts);
  auto act = at::empty({T, inter}, opts);
  const int64_t qkv_n = (nh + 2 * nkv) * hd;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t b = l * LAYER_SLOTS;
    const int64_t* kd = kinds.data() + l * 4;
    rms_norm(h, x, c10::nullopt, w[b], eps);
    auto qkv = any_linear(h, w, b + 4, kd[0], qkv_n);
    auto q = qkv.narrow(1, 0, nh * hd).view({T, nh, hd});
    auto k = qkv.narrow(1, nh * hd, nkv * hd).view({T, nkv, hd});
    auto v = qkv.narrow(1, (nh + nkv) * hd, nkv * hd).view({T, nkv, hd});
    qk_norm_rope(q, k, w[b + 2], w[b + 3], eps, positions, cos, sin);
    const auto& kc = caches[l * 4];
    const auto& vc = caches[l * 4 + 1];
    const bool i8 = kc.scalar_type() == at::kChar;
    c10::optional<torch::Tensor> ksc = i8 ? c10::optional<torch::Tensor>(caches[l * 4 + 2]) : c10::nullopt;
    c10::optional<torch::Tensor> vsc = i8 ? c10::optional<torch::Tensor>(caches[l * 4 + 3]) : c10::nullopt;
    if (i8) write_kv_int8(kc, vc, *ksc, *vsc, k, v, slot_mapping);
    else write_kv(kc, vc, k.to(kc.scalar_type()), v.to(kc.scalar_type()), slot_mapping);
    auto attn = at::empty({T, nh, hd}, opts);
    TORCH_CHECK(prefill_attention(attn, q, k, v, kc, vc, q_starts, q_lens, ctx_lens, block_tables, scale, window, ksc,
                                  vsc),
                "decoder_stack_mixed: prefill attention did not run");
    if (D > 0) {
      auto qd = q.index_select(0, dec_idx);
      auto od = at::empty_like(qd);
      paged_decode_attention(od, qd, kc, vc, dec_block_tables, dec_ctx_lens, scale, window, ksc, vsc);
      attn.index_copy_(0, dec_idx, od);
    }
    auto a_in = attn.view({T, nh * hd});
    if (l == L - 1 && rows.has_value()) {  // the last layer past its attention: the wanted rows only
      const int64_t R = rows->numel();
      x = x.index_select(0, *rows);
      if (R == 0) break;  // nothing wanted (the K/V writes were the point)
      a_in = a_in.index_select(0, *rows);
      h = at::empty({R, H}, opts);
      act = at::empty({R, inter}, opts);
    }
    auto a_out = any_linear(a_in, w, b + 4 + LIN_SLOTS, kd[1], H);
    rms_norm(h, x, a_out, w[b + 1], eps);  // x += attention output, h = norm(x)
    auto gu = any_linear(h, w, b + 4 + 2 * LIN_SLOTS, kd[2], 2 * inter);
    silu_mul(act, gu);
    x.add_(any_linear(act, w, b + 4 + 3 * LIN_SLOTS, kd[3], H));
  }
  auto out = at::empty({x.size(0), H}, opts);
  rms_norm(out, x, c10::nullopt, final_norm, eps);
  return out;
}

void register_mixed_stack(pybind11::module& m) {
  m.def("has_prefill_attention", &has_prefill_attention, "whether prefill_attention is compiled in (AVX2+FMA)");
  m.def("decoder_stack_mixed", &decoder_stack_mixed,
        "all decoder layers + final norm for a step with prefill chunks (and decodes beside them) (CPU)");
}
