// Paged decode attention for CPU (fp32): one new query token per sequence, K/V read in place from the
// block-structured cache (no gather copy). Two passes per (sequence, kv head): scores for the whole context,
// then the softmax-weighted sum of V. Parallel over (sequence, kv head) with ATen's thread pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <limits>
#include <algorithm>

void paged_decode_attention(
    torch::Tensor out,           // [D, nh, hd] float
    torch::Tensor q,             // [D, nh, hd] float (any row stride, contiguous last dim)
    torch::Tensor k_cache,       // [NB, kvh, bs, hd] float, contiguous
    torch::Tensor v_cache,       // [NB, kvh, bs, hd] float, contiguous
    torch::Tensor block_tables,  // [D, MB] int64
    torch::Tensor ctx_lens,      // [D] int64
    double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat, "fp32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(), "contiguous");
  const int64_t D = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t kvh = k_cache.size(1), bs = k_cache.size(2), MB = block_tables.size(1);
  const int64_t G = nh / kvh;
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const float fscale = (float)scale;
  at::parallel_for(0, D * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t d = task / kvh, h = task % kvh;
      const int64_t ctx = lens[d];
      const int64_t start = (window > 0 && ctx > window) ? ctx - window : 0;
      const int64_t n = ctx - start;
      scores.assign(G * n, 0.f);
      acc.assign(G * hd, 0.f);
      const int64_t* row = bt + d * MB;
      // pass 1: scores[g][t] = q_g . k_t * scale; block by block, each head's rows contiguous
      for (int64_t b = start / bs; b * bs < ctx; ++b) {
        const int64_t t0 = std::max(start, b * bs), t1 = std::min(ctx, (b + 1) * bs);
        const float* kb = kp + (row[b] * kvh + h) * bs * hd;
        for (int64_t t = t0; t < t1; ++t) {
          const float* kt = kb + (t - b * bs) * hd;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qp + d * qs0 + (h * G + g) * qs1;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t e = 0; e < hd; ++e) s += qg[e] * kt[e];
            scores[g * n + (t - start)] = s * fscale;
          }
        }
      }
      // softmax per g
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) m = sg[i] > m ? sg[i] : m;
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) { sg[i] = std::exp(sg[i] - m); sum += sg[i]; }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
      }
      // pass 2: acc[g] = sum_t p[g][t] v_t
      for (int64_t b = start / bs; b * bs < ctx; ++b) {
        const int64_t t0 = std::max(start, b * bs), t1 = std::min(ctx, (b + 1) * bs);
        const float* vb = vp + (row[b] * kvh + h) * bs * hd;
        for (int64_t t = t0; t < t1; ++t) {
          const float* vt = vb + (t - b * bs) * hd;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * n + (t - start)];
            float* ag = acc.data() + g * hd;
#pragma omp simd
            for (int64_t e = 0; e < hd; ++e) ag[e] += p * vt[e];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + d * os0 + (h * G + g) * os1;
        for (int64_t e = 0; e < hd; ++e) o[e] = acc[g * hd + e];
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, fp32)");
}
