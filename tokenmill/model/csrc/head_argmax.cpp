// The greedy token of each row of an int8 W8A8 lm_head at more than 8 rows, without writing the logits: the int32
// result of the int8 GEMM (torch._int_mm) goes through dequant_rows' fp32 epilogue, (float(acc) * sx[m]) * sw[n]
// (no bias: the int8 head has none), is rounded to the logits' dtype (bf16: round to nearest even, store8's integer rounding; fp32: as is),
// and compared as argmax_rows compares the stored logits (the first index of the row's maximum, or of its first
// NaN). So the token is exactly argmax_rows(dequant_rows(acc)) (tests/model/test_head_argmax.py), with the
// [rows, vocab] logits neither written nor read back (at 64 rows x 32000: 4 MB written, then scanned).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TM_HA_AVX512 1
#endif

namespace {

// v rounded to bf16 and back to fp32: the bits store8 / c10::BFloat16 keep (round to nearest even)
inline float round_bf16(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  if (std::isnan(v)) return v;  // c10 keeps a NaN a NaN
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &b, 4);
  return r;
}

template <bool BF16>
void head_argmax_impl(int64_t* out, const int32_t* acc, const float* sx, const float* sw, int64_t M, int64_t N) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t* a = acc + m * N;
      const float s = sx[m];
      float best = -std::numeric_limits<float>::infinity();
      int64_t bi = 0;
      bool nan = false;
      int64_t n = 0;
#ifdef TM_HA_AVX512
      const __m512 sv = _mm512_set1_ps(s);
      __m512 vb = _mm512_set1_ps(best);
      __m512i vi = _mm512_setzero_si512();
      __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i sixteen = _mm512_set1_epi32(16);
      __mmask16 anynan = 0;
      if (N < (int64_t(1) << 31) - 16) {
        for (; n + 16 <= N; n += 16) {
          __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + n)), sv),
                                   _mm512_loadu_ps(sw + n));
          if (BF16) {  // store8's rounding: (b + 0x7fff + lsb) with the low half cleared
            __m512i b = _mm512_castps_si512(v);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
            b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
            v = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
          }
          anynan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          const __mmask16 gt = _mm512_cmp_ps_mask(v, vb, _CMP_GT_OQ);  // strictly greater: a lane keeps its first
          vb = _mm512_mask_blend_ps(gt, vb, v);
          vi = _mm512_mask_blend_epi32(gt, vi, idx);
          idx = _mm512_add_epi32(idx, sixteen);
        }
        if (anynan) {
          nan = true;
        } else {
          alignas(64) float lv[16];
          alignas(64) int32_t li[16];
          _mm512_store_ps(lv, vb);
          _mm512_store_si512(li, vi);
          for (int j = 0; j < 16; ++j)  // the largest value; among equal ones the first index
            if (lv[j] > best || (lv[j] == best && li[j] < bi)) {
              best = lv[j];
              bi = li[j];
            }
          if (best == -std::numeric_limits<float>::infinity()) bi = 0;  // all -inf so far: index 0 (argmax_rows)
        }
      }
#endif
      if (!nan) {
        for (; n < N; ++n) {
          float v = (float)a[n] * s * sw[n];
          if (BF16) v = round_bf16(v);
          if (v != v) {
            nan = true;
            break;
          }
          if (v > best) {
            best = v;
            bi = n;
          }
        }
      }
      if (nan) {  // argmax_rows: the first NaN
        for (n = 0; n < N; ++n) {
          float v = (float)a[n] * s * sw[n];
          if (BF16) v = round_bf16(v);
          if (v != v) {
            bi = n;
            break;
          }
        }
      }
      out[m] = bi;
    }
  });
}

// out [M] int64 = argmax over n of round_to(dtype, (float(acc[m, n]) * sx[m]) * sw[n])
void head_argmax_int8(torch::Tensor out, torch::Tensor acc, torch::Tensor sx, torch::Tensor sw, bool bf16) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kInt, "head_argmax_int8: acc [M, N] int32");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(out.scalar_type() == at::kLong && out.numel() == M && out.is_contiguous(), "head_argmax_int8: out [M] int64");
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sx.numel() == M && sx.is_contiguous() && sw.scalar_type() == at::kFloat &&
              sw.numel() >= N && sw.is_contiguous(), "head_argmax_int8: sx [M], sw [N] fp32");
  if (bf16)
    head_argmax_impl<true>(out.data_ptr<int64_t>(), acc.data_ptr<int32_t>(), sx.data_ptr<float>(), sw.data_ptr<float>(),
                           M, N);
  else
    head_argmax_impl<false>(out.data_ptr<int64_t>(), acc.data_ptr<int32_t>(), sx.data_ptr<float>(),
                            sw.data_ptr<float>(), M, N);
}

}  // namespace

void register_head_argmax(pybind11::module& m) {
  m.def("head_argmax_int8", &head_argmax_int8, "the greedy token per row of an int8 GEMM's int32 result through "
        "dequant_rows' epilogue, rounded to the logits' dtype, without writing the logits (CPU)",
        py::arg("out"), py::arg("acc"), py::arg("sx"), py::arg("sw"), py::arg("bf16"));
}
