// W8A8 GEMV for decode steps (at most 8 rows) with AVX-512 VNNI: one parallel region per linear, the weights
// streamed in address order.
//
// The product is the one quantize_rows + torch._int_mm + dequant_rows computes (and linear_small_vnni before it):
// each x row quantized per token (s = max|x| / 127, x * (1/s) rounded to nearest even, the same instructions as
// quantize_rows), exact int32 sums (any order gives the same integers), then out = (float(acc) * s) * sw (+ b),
// the same fp32 operations as dequant_rows, rounded to bf16 by the same integer round-to-nearest-even. So the
// results are the same bits as both of those paths (tests/model/test_decode_gemv.py checks it against
// _int_mm + dequant_rows).
//
// What differs from linear_small_vnni (csrc/paged_decode.cpp): (1) each weight row is read start to end before
// the next (linear_small_vnni read 8 rows in k-interleaved order, 8 streams 512 bytes apart); (2) 16 rows' sums
// are reduced together by one transpose-add instead of a horizontal reduce per row; (3) quantize, the int8 sums
// and the epilogue run in one parallel region, with no heap buffers and no tensors made per call.
// `linear_small_vnni` calls `vnni_gemv` first; TOKENMILL_DECODE_GEMV=0 keeps its own loop (the reference).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <atomic>

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TM_GEMV_VNNI 1
#endif

namespace {

#ifdef TM_GEMV_VNNI
constexpr int64_t MAXK = 8192;  // the x rows (u8) live on the stack: M * K bytes

// x[m, :] (fp32 or bf16) -> u[m, :] = q + 128 and s[m], as quantize_rows_impl computes q and s
template <typename T>
inline __m512 load16f(const T* p);
template <>
inline __m512 load16f<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16f<at::BFloat16>(const at::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

template <typename T>
inline void quantize_u8(const T* xr, int64_t K, uint8_t* u, float* s_out) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16f<T>(xr + k)));
  // quantize_rows takes the max of |x| lane by lane then over the lanes: max is exact in any order, but NaN is not
  // ordered: a NaN row gives a NaN result either way, which the int8 path then cannot represent (undefined there too)
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, mx);
  float amax = 0.f;
  for (float v : lanes) amax = std::max(amax, v);
  const float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
  *s_out = s;
  const __m512 iv = _mm512_set1_ps(inv);
  const __m512i bias = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < K; k += 16) {  // |x * inv| <= 127: no saturation; +128 maps [-127, 127] to [1, 255]
    const __m512i i32 = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load16f<T>(xr + k), iv)), bias);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u + k), _mm512_cvtepi32_epi8(i32));
  }
}

// out[i] = sum of the 16 int32 lanes of v[i], i < 16
inline __m512i transpose_sum16i(const __m512i* v) {
  __m512i s2[8];
  for (int i = 0; i < 8; ++i)
    s2[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  __m512i s4[4];
  for (int i = 0; i < 4; ++i)
    s4[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(s2[2 * i], s2[2 * i + 1]), _mm512_unpackhi_epi64(s2[2 * i], s2[2 * i + 1]));
  const __m512i x01 = _mm512_add_epi32(_mm512_shuffle_i32x4(s4[0], s4[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(s4[0], s4[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i x23 = _mm512_add_epi32(_mm512_shuffle_i32x4(s4[2], s4[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(s4[2], s4[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// fp32 -> bf16, round to nearest even by integer arithmetic: store8(bf16)'s formula in paged_decode.cpp, 16 wide
inline void store16(at::BFloat16* p, __m512 v) {
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(b));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// 16 weight rows n0 .. n0+15 against M activation rows: each row read in address order, then reduced together
template <int M, typename T>
inline void block16(const uint8_t* xu, const int8_t* wp, const int32_t* wsum, const float* sx, const float* sw,
                    const T* bp, T* op, int64_t K, int64_t N, int64_t n0) {
  __m512i acc[M][16];
  for (int r = 0; r < 16; ++r) {
    const int8_t* w = wp + (n0 + r) * K;
    if (r + 2 < 16) {  // the row after next: its first lines, ahead of the hardware prefetcher's ramp-up
      _mm_prefetch(reinterpret_cast<const char*>(w + 2 * K), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + 2 * K + 64), _MM_HINT_T0);
    }
    if constexpr (M == 1) {  // two chains per row: the vpdpbusd latency is not the limit
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      int64_t k = 0;
      for (; k + 128 <= K; k += 128) {
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(xu + k), _mm512_loadu_si512(w + k));
        a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(xu + k + 64), _mm512_loadu_si512(w + k + 64));
      }
      if (k < K) a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(xu + k), _mm512_loadu_si512(w + k));
      acc[0][r] = _mm512_add_epi32(a0, a1);
    } else {
      __m512i a[M];
      for (int m = 0; m < M; ++m) a[m] = _mm512_setzero_si512();
      for (int64_t k = 0; k < K; k += 64) {
        const __m512i wv = _mm512_loadu_si512(w + k);
        for (int m = 0; m < M; ++m) a[m] = _mm512_dpbusd_epi32(a[m], _mm512_loadu_si512(xu + m * K + k), wv);
      }
      for (int m = 0; m < M; ++m) acc[m][r] = a[m];
    }
  }
  // sum(q w) = sum(u w) - 128 sum(w); then dequant_rows' epilogue: (float(acc) * sx[m]) * sw[n] (+ b[n])
  const __m512i ws128 = _mm512_slli_epi32(_mm512_loadu_si512(wsum + n0), 7);
  const __m512 swv = _mm512_loadu_ps(sw + n0);
  __m512 bv = _mm512_setzero_ps();
  if (bp) bv = load16f<T>(bp + n0);
  for (int m = 0; m < M; ++m) {
    const __m512i s = _mm512_sub_epi32(transpose_sum16i(acc[m]), ws128);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(sx[m])), swv);
    if (bp) v = _mm512_add_ps(v, bv);
    store16(op + m * N + n0, v);
  }
}

template <int M, typename T>
void gemv_m(const T* xp, const int8_t* wp, const int32_t* wsum, const float* sw, const T* bp, T* op, int64_t K,
            int64_t N) {
  const int64_t nb = N / 16;
  // each thread quantizes the (few, short) x rows itself: no second parallel region, no shared buffer
  at::parallel_for(0, nb, 8, [&](int64_t b0, int64_t b1) {
    alignas(64) uint8_t xu[M * MAXK];
    float sx[M];
    for (int m = 0; m < M; ++m) quantize_u8<T>(xp + m * K, K, xu + m * K, &sx[m]);
    for (int64_t b = b0; b < b1; ++b) block16<M, T>(xu, wp, wsum, sx, sw, bp, op, K, N, b * 16);
  });
}

template <typename T>
bool gemv(const T* xp, const int8_t* wp, const int32_t* wsum, const float* sw, const T* bp, T* op, int64_t M,
          int64_t K, int64_t N) {
  switch (M) {
    case 1: gemv_m<1, T>(xp, wp, wsum, sw, bp, op, K, N); return true;
    case 2: gemv_m<2, T>(xp, wp, wsum, sw, bp, op, K, N); return true;
    case 3: gemv_m<3, T>(xp, wp, wsum, sw, bp, op, K, N); return true;
    case 4: gemv_m<4, T>(xp, wp, wsum, sw, bp, op, K, N); return true;
    case 5: gemv_m<5, T>(xp, wp, wsum, sw, bp, op, K, N); return true;
    case 6: gemv_m<6, T>(xp, wp, wsum, sw, bp, op, K, N); return true;
    case 7: gemv_m<7, T>(xp, wp, wsum, sw, bp, op, K, N); return true;
    case 8: gemv_m<8, T>(xp, wp, wsum, sw, bp, op, K, N); return true;
    default: return false;
  }
}
#endif

bool env_default() {
  const char* v = std::getenv("TOKENMILL_DECODE_GEMV");
  return v == nullptr || std::strcmp(v, "0") != 0;  // cpu_kernels.get_kernels refuses values other than 0 / 1
}
std::atomic<bool> g_enabled{env_default()};

}  // namespace

// The W8A8 product of x [M <= 8, K] (fp32 or bf16) and int8 W [N, K] into out [M, N] (x's dtype), as described
// above. Returns false (nothing written) where it does not apply: no VNNI in this build, N % 16 or K % 64 not 0,
// K > 8192, M > 8, a layout it does not take, or TOKENMILL_DECODE_GEMV=0.
bool vnni_gemv(torch::Tensor out, torch::Tensor x, torch::Tensor w8, torch::Tensor wsum, torch::Tensor sw,
               c10::optional<torch::Tensor> bias) {
#ifdef TM_GEMV_VNNI
  if (!g_enabled.load(std::memory_order_relaxed)) return false;
  const int64_t M = x.size(0), K = x.size(1), N = w8.size(0);
  // 5-8 rows on one thread: measured slower than linear_small_vnni's loop (its 8-row k-interleave reuses each x
  // load across rows; here the M x 16 accumulators spill), faster at 2 threads (one parallel region instead of two)
  if (M > 4 && at::get_num_threads() == 1) return false;
  if (M < 1 || M > 8 || K % 64 != 0 || K > MAXK || N % 16 != 0 || !x.is_contiguous() || !w8.is_contiguous() ||
      !out.is_contiguous() || !wsum.is_contiguous() || !sw.is_contiguous() || w8.scalar_type() != at::kChar ||
      wsum.scalar_type() != at::kInt || sw.scalar_type() != at::kFloat || out.scalar_type() != x.scalar_type() ||
      w8.size(1) != K || out.size(0) != M || out.size(1) != N || wsum.numel() != N || sw.numel() != N)
    return false;
  if (bias.has_value() && (bias->scalar_type() != x.scalar_type() || !bias->is_contiguous() || bias->numel() != N))
    return false;
  const int8_t* wp = w8.data_ptr<int8_t>();
  const int32_t* wsp = wsum.data_ptr<int32_t>();
  const float* swp = sw.data_ptr<float>();
  if (x.scalar_type() == at::kFloat)
    return gemv<float>(x.data_ptr<float>(), wp, wsp, swp, bias ? bias->data_ptr<float>() : nullptr,
                       out.data_ptr<float>(), M, K, N);
  if (x.scalar_type() == at::kBFloat16)
    return gemv<at::BFloat16>(x.data_ptr<at::BFloat16>(), wp, wsp, swp,
                              bias ? bias->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(), M, K, N);
  return false;
#else
  return false;
#endif
}

// turn vnni_gemv on or off at run time (A/B runs in one process); returns the previous setting
bool set_decode_gemv(bool on) { return g_enabled.exchange(on); }

void register_decode_gemv(pybind11::module& m) {
  m.def("set_decode_gemv", &set_decode_gemv, "turn vnni_gemv on/off (linear_small_vnni then runs its own loop); "
        "returns the previous setting");
  m.def("vnni_gemv", &vnni_gemv, "W8A8 GEMV for <= 8 rows, one parallel region, weights read in address order "
        "(AVX-512 VNNI; False where it does not apply)", py::arg("out"), py::arg("x"), py::arg("w8"), py::arg("wsum"),
        py::arg("sw"), py::arg("bias") = py::none());
}
