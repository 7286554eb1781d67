// Exact W8A8 int8 products on AVX2 without int8 dot-product instructions (no VNNI, no AMX): the path
// Int8LinearMethod takes where oneDNN's int8 GEMM is not safe (linear.py: `int8_gemm` False; oneDNN's AVX2 int8
// kernel sums pairs of u8*s8 products in saturating int16, vpmaddubsw, so its results are wrong, not just slow).
//
// The product is the one quantize_rows + an exact int32 GEMM + dequant_rows computes (csrc/paged_decode.cpp):
// each x row quantized per token (s = max|x| / 127, q = x * (1/s) rounded to nearest even: quantize_rows'
// instructions), sum_k q[m, k] W[n, k] in int32, then out = (float(acc) * s[m]) * sw[n] (+ b[n]) in fp32 with
// dequant_rows' vector instructions, rounded to bf16 by the same integer round-to-nearest-even. The sums are exact
// here: q and W are widened to int16 and multiplied by vpmaddwd (two s16*s16 products summed into s32: at most
// 2 * 127 * 127, no saturation), accumulated in int32 (|sum| <= 127 * 127 * K < 2^31 for K < 133000). So the
// results are the same bits as quantize_rows + (q.int() @ W.int().t()) + dequant_rows for any K
// (tests/model/test_int8_avx2.py checks it).
//
// avx2_int8_gemm (any rows; Int8LinearMethod calls it for > 8): weights pre-packed once at load time
// (avx2_int8_pack) as int16 panels of 16 output channels, k-pair interleaved ([N/16][K/2][16][2]: each 32-byte
// load is one k pair of 8 channels, the operand layout of vpmaddwd), a 6 x 16 register-blocked micro-kernel
// (12 int32 accumulators), at::parallel_for over (row chunk, panel) tasks, the activation quantize fused in front
// and the dequantize epilogue (scales, bias) fused into the micro-kernel's stores.
// avx2_int8_gemv (at most 8 rows, decode): streams the plain int8 weight [N, K] once (a quarter of fp32's bytes).
// K % 32 == 0 (session 11): int8 x int8 through vpmaddubsw, |w| (u8) times x * sign(w) (s8), 32 products per
// instruction (gemv_u8 below: why its saturating int16 pair sums are exact); else (or set_avx2_int8_u8(false)) the
// weight sign-extended to int16 on the fly (vpmovsxbw) against the int16-quantized x rows, 16 per instruction.
// Both give the same int32 sums, so the same bits. avx2_int8_head_argmax: the int8 lm_head's greedy token through
// gemv_u8 without writing the logits (model/lm_head.py, Avx2Int8Head).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_INT8_AVX2 1
#endif

namespace {

bool g_u8 = true;  // set_avx2_int8_u8

#ifdef TM_INT8_AVX2
constexpr int64_t NR = 16;  // output channels per packed panel (two ymm of int32 accumulators)
constexpr int MR = 6;       // activation rows per micro-kernel call
constexpr int64_t MC = 96;  // rows per task (a multiple of MR): one task's int16 x rows stay in L2

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {  // paged_decode.cpp's store8: round to nearest even
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// x row (K values) -> q (int16, Kp >= K entries, zero-padded) and its scale: quantize_rows_impl's arithmetic
template <typename T>
inline void quantize_row_i16(const T* xr, int64_t K, int64_t Kp, int16_t* q, float* s_out) {
  float amax = 0.f;
  int64_t k = 0;
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(xr + k)));
  float lanes[8];
  _mm256_storeu_ps(lanes, mx);
  for (float v : lanes) amax = std::max(amax, v);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(to_f(xr[k])));
  const float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
  *s_out = s;
  const __m256 iv = _mm256_set1_ps(inv);
  k = 0;
  for (; k + 8 <= K; k += 8) {  // |x * inv| <= 127 by construction
    const __m256i i32 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xr + k), iv));  // round to nearest even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k),
                     _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1)));
  }
  for (; k < K; ++k) q[k] = (int16_t)std::nearbyint(std::min(127.f, std::max(-127.f, to_f(xr[k]) * inv)));
  for (; k < Kp; ++k) q[k] = 0;
}

// out[n .. n+8) = (float(acc) * s) * sw[n ..] (+ b[n ..]): dequant_rows' vector instructions; `cnt` < 8 at the edge
// (the empty asm keeps the compiler from contracting the multiply and the bias add into one FMA, whose single
// rounding would differ from dequant_rows' two in the last bit)
inline __m256 no_contract(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

template <typename T>
inline void epilogue8(T* o, __m256i acc, float s, const float* sw, const T* b, int64_t cnt) {
  if (cnt == 8) {
    __m256 v = no_contract(_mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(s)), _mm256_loadu_ps(sw)));
    if (b) v = _mm256_add_ps(v, load8(b));
    store8(o, v);
    return;
  }
  alignas(32) float swt[8] = {0};
  alignas(32) T bt[8], ot[8];
  for (int64_t i = 0; i < 8; ++i) bt[i] = T(0.f);
  for (int64_t i = 0; i < cnt; ++i) {
    swt[i] = sw[i];
    if (b) bt[i] = b[i];
  }
  __m256 v = no_contract(_mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(s)), _mm256_load_ps(swt)));
  if (b) v = _mm256_add_ps(v, load8(bt));
  store8(ot, v);
  for (int64_t i = 0; i < cnt; ++i) o[i] = ot[i];
}

inline __m256i bcast_pair(const int16_t* p) {  // q[k], q[k+1] as one int32, in all 8 lanes
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// rows m0 .. m0+R-1 against panel j (channels n0 .. n0+15), full K, epilogue fused
template <int R, typename T>
inline void micro(const int16_t* a, int64_t Kp, const int16_t* panel, const float* sx, const float* sw,
                  const T* bias, T* out, int64_t N, int64_t n0) {
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const int64_t KP2 = Kp / 2;
  for (int64_t kk = 0; kk < KP2; ++kk) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + kk * 32));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + kk * 32 + 16));
    for (int r = 0; r < R; ++r) {
      const __m256i av = bcast_pair(a + r * Kp + 2 * kk);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(av, b0));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(av, b1));
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + 8 * h;
      if (n >= N) break;
      epilogue8<T>(out + r * N + n, acc[r][h], sx[r], sw + n, bias ? bias + n : nullptr, std::min<int64_t>(8, N - n));
    }
  }
}

template <typename T>
void rows_block(int R, const int16_t* a, int64_t Kp, const int16_t* panel, const float* sx, const float* sw,
                const T* bias, T* out, int64_t N, int64_t n0) {
  switch (R) {
    case 1: return micro<1, T>(a, Kp, panel, sx, sw, bias, out, N, n0);
    case 2: return micro<2, T>(a, Kp, panel, sx, sw, bias, out, N, n0);
    case 3: return micro<3, T>(a, Kp, panel, sx, sw, bias, out, N, n0);
    case 4: return micro<4, T>(a, Kp, panel, sx, sw, bias, out, N, n0);
    case 5: return micro<5, T>(a, Kp, panel, sx, sw, bias, out, N, n0);
    default: return micro<6, T>(a, Kp, panel, sx, sw, bias, out, N, n0);
  }
}

template <typename T>
void gemm(const T* xp, const int16_t* pk, const float* sw, const T* bp, T* op, int64_t M, int64_t K, int64_t N) {
  const int64_t Kp = (K + 1) & ~int64_t(1), NP = (N + NR - 1) / NR, MB = (M + MC - 1) / MC;
  std::vector<int16_t> q(M * Kp);
  std::vector<float> sx(M);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) quantize_row_i16<T>(xp + m * K, K, Kp, q.data() + m * Kp, sx.data() + m);
  });
  // tasks in (row chunk, panel) order: a thread's contiguous range shares its row chunks' int16 x rows
  at::parallel_for(0, MB * NP, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t mb = t / NP, j = t % NP, m1 = std::min(M, (mb + 1) * MC);
      const int16_t* panel = pk + j * Kp * NR;
      for (int64_t m = mb * MC; m < m1; m += MR) {
        const int R = (int)std::min<int64_t>(MR, m1 - m);
        rows_block<T>(R, q.data() + m * Kp, Kp, panel, sx.data() + m, sw, bp, op + m * N, N, j * NR);
      }
    }
  });
}

// ---- at most 8 rows: the plain int8 weight [N, K] streamed once ----
inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// sums[r][i] = sum_k q[r, k] W[n0 + i, k] for R rows and NB weight rows (K % 16 == 0)
template <int R, int NB>
inline void gemv_block(const int16_t* q, int64_t K, const int8_t* w, int32_t (*sums)[8], int64_t ld_sum_unused) {
  (void)ld_sum_unused;
  __m256i acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NB; ++i) acc[r][i] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 16) {
    __m256i wv[NB];
    for (int i = 0; i < NB; ++i)
      wv[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * K + k)));
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + k));
      for (int i = 0; i < NB; ++i) acc[r][i] = _mm256_add_epi32(acc[r][i], _mm256_madd_epi16(xv, wv[i]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NB; ++i) sums[r][i] = hsum8i(acc[r][i]);
}

// R rows (<= 4) x 8 weight rows n0 .. n0+7, as NB-row blocks
template <int R>
inline void gemv8(const int16_t* q, int64_t K, const int8_t* w, int32_t (*sums)[8]) {
  if constexpr (R == 1) {
    gemv_block<1, 8>(q, K, w, sums, 0);
  } else if constexpr (R == 2) {
    int32_t s[2][8];
    for (int h = 0; h < 2; ++h) {
      gemv_block<2, 4>(q, K, w + h * 4 * K, s, 0);
      for (int r = 0; r < 2; ++r)
        for (int i = 0; i < 4; ++i) sums[r][h * 4 + i] = s[r][i];
    }
  } else {
    int32_t s[R][8];
    for (int h = 0; h < 4; ++h) {
      gemv_block<R, 2>(q, K, w + h * 2 * K, s, 0);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 2; ++i) sums[r][h * 2 + i] = s[r][i];
    }
  }
}

inline void gemv8_rows(int R, const int16_t* q, int64_t K, const int8_t* w, int32_t (*sums)[8]) {
  switch (R) {
    case 1: return gemv8<1>(q, K, w, sums);
    case 2: return gemv8<2>(q, K, w, sums);
    case 3: return gemv8<3>(q, K, w, sums);
    default: return gemv8<4>(q, K, w, sums);
  }
}

template <typename T>
void gemv(const T* xp, const int8_t* wp, const float* sw, const T* bp, T* op, int64_t M, int64_t K, int64_t N) {
  alignas(32) int16_t q[8 * 8192];
  float sx[8];
  for (int64_t m = 0; m < M; ++m) quantize_row_i16<T>(xp + m * K, K, K, q + m * K, sx + m);
  at::parallel_for(0, N / 8, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 8;
      if (b + 1 < b1)  // the next block's first lines, ahead of the prefetcher's ramp-up
        for (int i = 0; i < 8; ++i) _mm_prefetch(reinterpret_cast<const char*>(wp + (n0 + 8 + i) * K), _MM_HINT_T0);
      int32_t sums[8][8];
      for (int64_t m = 0; m < M; m += 4) {
        const int R = (int)std::min<int64_t>(4, M - m);
        gemv8_rows(R, q + m * K, K, wp + n0 * K, sums + m);
      }
      for (int64_t m = 0; m < M; ++m)
        epilogue8<T>(op + m * N + n0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums[m])), sx[m],
                     sw + n0, bp ? bp + n0 : nullptr, 8);
    }
  });
}

// ---- at most 8 rows, int8 x int8 with vpmaddubsw (32 multiply-adds per instruction), still exact ----
// vpmaddubsw multiplies u8 by s8 and adds pairs into *saturating* int16. With |w| as the u8 operand
// (vpabsb: 0..128, -128 included) and x * sign(w) as the s8 one (vpsignb; the quantized x lies in [-127, 127], so
// its negation never overflows), each product is w*x and a pair sum is at most 2 * 128 * 127 = 32512 < 32767: no
// saturation, the sum is exact. vpmaddwd with ones widens the pairs into int32 (exact), accumulated in int32 as
// the vpmaddwd kernels do. So the sums, and through the same epilogue the outputs, are the same bits as gemv().

// x row -> int8 q (K entries, K % 8 == 0) and its scale: quantize_row_i16's arithmetic, narrowed (|q| <= 127)
template <typename T>
inline void quantize_row_i8(const T* xr, int64_t K, int8_t* q, float* s_out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(xr + k)));
  float lanes[8], amax = 0.f;
  _mm256_storeu_ps(lanes, mx);
  for (float v : lanes) amax = std::max(amax, v);
  const float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
  *s_out = s;
  const __m256 iv = _mm256_set1_ps(inv);
  for (int64_t k = 0; k < K; k += 8) {
    const __m256i i32 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xr + k), iv));  // round to nearest even
    const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(i16, i16));
  }
}

// the 8 int32 lane sums of a[0..7], in order, as one vector
inline __m256i reduce8(const __m256i* a) {
  const __m256i h01 = _mm256_hadd_epi32(a[0], a[1]), h23 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i h45 = _mm256_hadd_epi32(a[4], a[5]), h67 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i h0123 = _mm256_hadd_epi32(h01, h23), h4567 = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                          _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

// R x rows (int8, row stride K) against NB weight rows of w, K % 32 == 0: per-lane int32 sums. w points at row
// i0 of a block of 8 rows: plain, row stride K; PACKED (avx2_int8_pack8's layout: per block of 8 rows, each
// 32-byte k-chunk of rows 0..7 in turn), row i's chunk k at w + 8 k + 32 i: the block is read front to back, one
// sequential stream (the plain layout's 8 streams of K bytes each start a new 4 KB page per block, where the
// hardware prefetchers ramp up again: ~11-14 GB/s at 2 threads vs ~21-24 GB/s packed on the AVX2 machine)
template <int R, int NB, bool PACKED = false>
inline void dot_u8(const int8_t* q, int64_t K, const int8_t* w, __m256i (*acc_out)[8], int i0) {
  __m256i acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NB; ++i) acc[r][i] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < K; k += 32) {
    __m256i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + k));
    if (PACKED && i0 == 0)  // ~1 KB ahead in the stream (past the block's end: the next block's bytes)
      for (int l = 0; l < 256; l += 64) _mm_prefetch(reinterpret_cast<const char*>(w + 8 * k + 1024 + l), _MM_HINT_T0);
    for (int i = 0; i < NB; ++i) {
      const __m256i wv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(PACKED ? w + 8 * k + 32 * i : w + i * K + k));
      const __m256i aw = _mm256_abs_epi8(wv);
      for (int r = 0; r < R; ++r)
        acc[r][i] = _mm256_add_epi32(
            acc[r][i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[r], wv)), ones));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NB; ++i) acc_out[r][i0 + i] = acc[r][i];
}

// sums[r] = the 8 int32 dot products of x row r with weight rows n0 .. n0+7 (w points at row n0), R <= 4
template <int R, bool PACKED>
inline void dot8_u8(const int8_t* q, int64_t K, const int8_t* w, __m256i* sums) {
  __m256i acc[R][8];
  constexpr int NB = R == 1 ? 8 : R == 2 ? 4 : 2;  // R * NB accumulators: at most 8 of the 16 ymm registers
  for (int i0 = 0; i0 < 8; i0 += NB) dot_u8<R, NB, PACKED>(q, K, w + i0 * (PACKED ? 32 : K), acc, i0);
  for (int r = 0; r < R; ++r) sums[r] = reduce8(acc[r]);
}

template <bool PACKED>
inline void dot8_u8_rows(int R, const int8_t* q, int64_t K, const int8_t* w, __m256i* sums) {
  switch (R) {
    case 1: return dot8_u8<1, PACKED>(q, K, w, sums);
    case 2: return dot8_u8<2, PACKED>(q, K, w, sums);
    case 3: return dot8_u8<3, PACKED>(q, K, w, sums);
    default: return dot8_u8<4, PACKED>(q, K, w, sums);
  }
}

// the epilogue's fp32 values for 8 outputs, as epilogue8 computes them before the store (no bias)
inline __m256 logits8(__m256i acc, float s, const float* sw) {
  return no_contract(_mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(s)), _mm256_loadu_ps(sw)));
}

inline __m256 round_bf16_8(__m256 v) {  // store8's rounding, kept in fp32 (the low half cleared)
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// one thread's running argmax of one row over its blocks (lanes: the largest value, the first index holding it)
struct ArgmaxLanes {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i idx = _mm256_setzero_si256();
  int64_t first_nan = -1;
  void add(__m256 v, int64_t n0) {
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    if (first_nan < 0 && _mm256_movemask_ps(nan)) first_nan = n0 + __builtin_ctz(_mm256_movemask_ps(nan));
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strictly greater: a lane keeps its first maximum
    best = _mm256_blendv_ps(best, v, gt);
    idx = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(idx),
        _mm256_castsi256_ps(_mm256_add_epi32(_mm256_set1_epi32((int32_t)n0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
        gt));
  }
  void result(float* b, int64_t* i) const {  // the largest lane; among equal ones the first index
    alignas(32) float lv[8];
    alignas(32) int32_t li[8];
    _mm256_store_ps(lv, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(li), idx);
    float bb = -std::numeric_limits<float>::infinity();
    int64_t bi = -1;
    for (int j = 0; j < 8; ++j)
      if (lv[j] > bb || (lv[j] == bb && (bi < 0 || li[j] < bi))) {
        bb = lv[j];
        bi = li[j];
      }
    *b = bb;
    *i = bi;
  }
};

// out rows [M, N] (or, greedy, tokens [M]) = W8A8(x) through the vpmaddubsw kernel, one parallel region
// greedy: each row's argmax of the values `out` would hold (torch.argmax's rules: the first index of the maximum,
// or of the first NaN), without writing them
template <typename T, bool PACKED = false>
void gemv_u8(const T* xp, const int8_t* wp, const float* sw, const T* bp, T* op, int64_t* tokens, int64_t M,
             int64_t K, int64_t N) {
  alignas(32) int8_t q[8 * 8192];
  float sx[8];
  for (int64_t m = 0; m < M; ++m) quantize_row_i8<T>(xp + m * K, K, q + m * K, sx + m);
  const int64_t NB8 = N / 8;
  struct Part { int64_t b0; float best[8]; int64_t idx[8]; int64_t nan[8]; };
  std::vector<Part> parts;
  std::mutex mu;
  at::parallel_for(0, NB8, 16, [&](int64_t b0, int64_t b1) {
    ArgmaxLanes am[8];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 8;
      if (!PACKED && b + 1 < b1)  // the next block's first lines, ahead of the prefetcher's ramp-up
        for (int i = 0; i < 8; ++i) _mm_prefetch(reinterpret_cast<const char*>(wp + (n0 + 8 + i) * K), _MM_HINT_T0);
      __m256i sums[8];
      for (int64_t m = 0; m < M; m += 4) {
        const int R = (int)std::min<int64_t>(4, M - m);
        dot8_u8_rows<PACKED>(R, q + m * K, K, wp + n0 * K, sums + m);  // a block: 8 K bytes in either layout
      }
      if (tokens) {
        for (int64_t m = 0; m < M; ++m) {
          __m256 v = logits8(sums[m], sx[m], sw + n0);
          if (std::is_same<T, at::BFloat16>::value) v = round_bf16_8(v);
          am[m].add(v, n0);
        }
      } else {
        for (int64_t m = 0; m < M; ++m) epilogue8<T>(op + m * N + n0, sums[m], sx[m], sw + n0, bp ? bp + n0 : nullptr, 8);
      }
    }
    if (tokens && b1 > b0) {
      Part p;
      p.b0 = b0;
      for (int64_t m = 0; m < M; ++m) {
        am[m].result(&p.best[m], &p.idx[m]);
        p.nan[m] = am[m].first_nan;
      }
      std::lock_guard<std::mutex> g(mu);
      parts.push_back(p);
    }
  });
  if (!tokens) return;
  std::sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) { return a.b0 < b.b0; });
  for (int64_t m = 0; m < M; ++m) {
    float best = -std::numeric_limits<float>::infinity();
    int64_t bi = 0, nan = -1;
    for (const Part& p : parts) {
      if (nan < 0 && p.nan[m] >= 0) nan = p.nan[m];
      if (p.best[m] > best) {  // strictly greater: an earlier part keeps a tie
        best = p.best[m];
        bi = p.idx[m];
      }
    }
    tokens[m] = nan >= 0 ? nan : bi;
  }
}
#endif

void check_common(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& sw,
                  const c10::optional<torch::Tensor>& bias, int64_t N, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && out.dim() == 2 && sw.is_contiguous(),
              what, ": x and out must be contiguous 2-d tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": x must be fp32 or bf16");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), what, ": out must have x's dtype");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == N, what, ": out must be [M, N]");
  TORCH_CHECK(sw.scalar_type() == at::kFloat && sw.numel() == N, what, ": weight scales must be fp32 [N]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                                    bias->numel() == N), what, ": bias must be [N] in x's dtype");
}

}  // namespace

// whether this build has the AVX2 int8 kernels
bool has_avx2_int8() {
#ifdef TM_INT8_AVX2
  return true;
#else
  return false;
#endif
}

// int8 W [N, K] -> int16 panels [ceil(N/16)][ceil(K/2)][16][2] (zero-padded), the layout avx2_int8_gemm reads
torch::Tensor avx2_int8_pack(torch::Tensor w8) {
  TORCH_CHECK(w8.dim() == 2 && w8.scalar_type() == at::kChar && w8.device().is_cpu(),
              "avx2_int8_pack: w8 must be an int8 [N, K] CPU tensor");
  auto w = w8.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Kp = (K + 1) & ~int64_t(1), NP = (N + 15) / 16;
  auto out = torch::zeros({NP, Kp / 2, 16, 2}, w.options().dtype(at::kShort));
  const int8_t* wp = w.data_ptr<int8_t>();
  int16_t* op = out.data_ptr<int16_t>();
  at::parallel_for(0, NP, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t i = 0; i < 16 && j * 16 + i < N; ++i) {
        const int8_t* wr = wp + (j * 16 + i) * K;
        int16_t* base = op + j * Kp * 16 + i * 2;
        for (int64_t k = 0; k < K; ++k) base[(k / 2) * 32 + (k & 1)] = wr[k];
      }
  });
  return out;
}

// out [M, N] = W8A8(x [M, K], W) as described above, W given as avx2_int8_pack's panels; any M >= 1
void avx2_int8_gemm(torch::Tensor out, torch::Tensor x, torch::Tensor panels, torch::Tensor sw,
                    c10::optional<torch::Tensor> bias) {
  const int64_t N = sw.numel();
  check_common(out, x, sw, bias, N, "avx2_int8_gemm");
  const int64_t M = x.size(0), K = x.size(1), Kp = (K + 1) & ~int64_t(1);
  TORCH_CHECK(panels.scalar_type() == at::kShort && panels.is_contiguous() && panels.dim() == 4 &&
              panels.size(0) == (N + 15) / 16 && panels.size(1) == Kp / 2 && panels.size(2) == 16 &&
              panels.size(3) == 2, "avx2_int8_gemm: panels must be avx2_int8_pack's layout for [N, K]");
  TORCH_CHECK(K < 133000, "avx2_int8_gemm: K too large for exact int32 sums");
  if (M == 0) return;
#ifdef TM_INT8_AVX2
  const float* swp = sw.data_ptr<float>();
  const int16_t* pk = panels.data_ptr<int16_t>();
  if (x.scalar_type() == at::kFloat)
    gemm<float>(x.data_ptr<float>(), pk, swp, bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), M, K, N);
  else
    gemm<at::BFloat16>(x.data_ptr<at::BFloat16>(), pk, swp, bias ? bias->data_ptr<at::BFloat16>() : nullptr,
                       out.data_ptr<at::BFloat16>(), M, K, N);
#else
  TORCH_CHECK(false, "avx2_int8_gemm: this build has no AVX2");
#endif
}

// int8 W [N, K] (N % 8 == 0, K % 32 == 0) -> [N / 8, K / 32, 8, 32]: per block of 8 rows, the 32-byte k-chunks of
// rows 0..7 in turn (w.view(N / 8, 8, K / 32, 32).permute(0, 2, 1, 3)), the order the vpmaddubsw GEMV reads them
torch::Tensor avx2_int8_pack8(torch::Tensor w8) {
  TORCH_CHECK(w8.dim() == 2 && w8.scalar_type() == at::kChar && w8.device().is_cpu() && w8.size(0) % 8 == 0 &&
              w8.size(1) % 32 == 0, "avx2_int8_pack8: w8 must be an int8 [N, K] CPU tensor, N % 8 == 0, K % 32 == 0");
  const int64_t N = w8.size(0), K = w8.size(1);
  return w8.view({N / 8, 8, K / 32, 32}).permute({0, 2, 1, 3}).contiguous();
}

namespace {
// w8 as the GEMV kernels take it: plain [N, K] or avx2_int8_pack8's [N / 8, K / 32, 8, 32]; its N (-1: neither)
int64_t gemv_weight_rows(const torch::Tensor& w8, int64_t K, bool* packed) {
  if (w8.scalar_type() != at::kChar || !w8.is_contiguous()) return -1;
  *packed = w8.dim() == 4;
  if (w8.dim() == 2 && w8.size(1) == K) return w8.size(0);
  if (w8.dim() == 4 && w8.size(1) * 32 == K && w8.size(2) == 8 && w8.size(3) == 32) return w8.size(0) * 8;
  return -1;
}
}  // namespace

// The same W8A8 product for 1 <= M <= 8 rows from the int8 weight, plain [N, K] (N % 8 == 0, K % 16 == 0,
// K <= 8192) or avx2_int8_pack8's layout (K % 32 == 0: the vpmaddubsw kernel reading one sequential stream);
// returns false (nothing written) where it does not apply
bool avx2_int8_gemv(torch::Tensor out, torch::Tensor x, torch::Tensor w8, torch::Tensor sw,
                    c10::optional<torch::Tensor> bias) {
#ifdef TM_INT8_AVX2
  TORCH_CHECK(x.dim() == 2, "avx2_int8_gemv: x must be a 2-d tensor");
  bool packed = false;
  const int64_t N = gemv_weight_rows(w8, x.size(1), &packed);
  TORCH_CHECK(N >= 0, "avx2_int8_gemv: w8 must be a contiguous int8 [N, K] or avx2_int8_pack8's [N/8, K/32, 8, 32]");
  check_common(out, x, sw, bias, N, "avx2_int8_gemv");
  const int64_t M = x.size(0), K = x.size(1);
  if (M < 1 || M > 8 || N % 8 != 0 || K % 16 != 0 || K > 8192) return false;
  const float* swp = sw.data_ptr<float>();
  const int8_t* wp = w8.data_ptr<int8_t>();
  if (packed) {  // always the vpmaddubsw kernel (the i16 one reads the plain layout: callers fall back to the GEMM)
    if (!g_u8) return false;
    if (x.scalar_type() == at::kFloat)
      gemv_u8<float, true>(x.data_ptr<float>(), wp, swp, bias ? bias->data_ptr<float>() : nullptr,
                           out.data_ptr<float>(), nullptr, M, K, N);
    else
      gemv_u8<at::BFloat16, true>(x.data_ptr<at::BFloat16>(), wp, swp, bias ? bias->data_ptr<at::BFloat16>() : nullptr,
                                  out.data_ptr<at::BFloat16>(), nullptr, M, K, N);
    return true;
  }
  if (K % 32 == 0 && g_u8) {  // the vpmaddubsw kernel: the same bits
    if (x.scalar_type() == at::kFloat)
      gemv_u8<float>(x.data_ptr<float>(), wp, swp, bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(),
                     nullptr, M, K, N);
    else
      gemv_u8<at::BFloat16>(x.data_ptr<at::BFloat16>(), wp, swp, bias ? bias->data_ptr<at::BFloat16>() : nullptr,
                            out.data_ptr<at::BFloat16>(), nullptr, M, K, N);
    return true;
  }
  if (x.scalar_type() == at::kFloat)
    gemv<float>(x.data_ptr<float>(), wp, swp, bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), M, K, N);
  else
    gemv<at::BFloat16>(x.data_ptr<at::BFloat16>(), wp, swp, bias ? bias->data_ptr<at::BFloat16>() : nullptr,
                       out.data_ptr<at::BFloat16>(), M, K, N);
  return true;
#else
  (void)out; (void)x; (void)w8; (void)sw; (void)bias;
  return false;
#endif
}

// The greedy token of each of 1 <= M <= 8 rows of the int8 head W8A8(x) (no bias; N % 8 == 0, K % 32 == 0,
// K <= 8192): torch.argmax over the values avx2_int8_gemv would store in x's dtype (the same epilogue, bf16 rounded
// as store8 rounds), without writing them; returns false (nothing written) where it does not apply
bool avx2_int8_head_argmax(torch::Tensor tokens, torch::Tensor x, torch::Tensor w8, torch::Tensor sw) {
#ifdef TM_INT8_AVX2
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "avx2_int8_head_argmax: x must be a contiguous fp32 or bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  bool packed = false;
  const int64_t N = gemv_weight_rows(w8, K, &packed);
  TORCH_CHECK(N >= 0, "avx2_int8_head_argmax: w8 must be a contiguous int8 [N, K] or avx2_int8_pack8's layout");
  TORCH_CHECK(sw.scalar_type() == at::kFloat && sw.is_contiguous() && sw.numel() == N,
              "avx2_int8_head_argmax: weight scales must be fp32 [N]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.numel() == M,
              "avx2_int8_head_argmax: tokens must be int64 [M]");
  if (M < 1 || M > 8 || N % 8 != 0 || N < 8 || K % 32 != 0 || K > 8192) return false;
  auto run = [&](auto packed_tag) {
    constexpr bool P = decltype(packed_tag)::value;
    if (x.scalar_type() == at::kFloat)
      gemv_u8<float, P>(x.data_ptr<float>(), w8.data_ptr<int8_t>(), sw.data_ptr<float>(), nullptr, nullptr,
                        tokens.data_ptr<int64_t>(), M, K, N);
    else
      gemv_u8<at::BFloat16, P>(x.data_ptr<at::BFloat16>(), w8.data_ptr<int8_t>(), sw.data_ptr<float>(), nullptr,
                               nullptr, tokens.data_ptr<int64_t>(), M, K, N);
  };
  if (packed) run(std::true_type{});
  else run(std::false_type{});
  return true;
#else
  (void)tokens; (void)x; (void)w8; (void)sw;
  return false;
#endif
}

// benchmarks: avx2_int8_gemv through the vpmaddubsw kernel (true, the default) or the vpmovsxbw + vpmaddwd one
// (false; the same bits); returns the previous setting
bool set_avx2_int8_u8(bool on) {
  const bool prev = g_u8;
  g_u8 = on;
  return prev;
}

void register_int8_gemm(pybind11::module& m) {
  m.def("has_avx2_int8", &has_avx2_int8, "whether the AVX2 exact int8 kernels are compiled in");
  m.def("avx2_int8_pack", &avx2_int8_pack, "int8 W [N, K] -> the int16 k-pair panels avx2_int8_gemm reads");
  m.def("avx2_int8_pack8", &avx2_int8_pack8, "int8 W [N, K] -> [N/8, K/32, 8, 32], the layout the vpmaddubsw GEMV "
        "reads as one sequential stream (avx2_int8_gemv / avx2_int8_head_argmax take either)");
  m.def("avx2_int8_gemm", &avx2_int8_gemm, "exact W8A8 y = q(x) W^T * sx * sw (+ b), any rows (AVX2 vpmaddwd)",
        py::arg("out"), py::arg("x"), py::arg("panels"), py::arg("sw"), py::arg("bias") = py::none());
  m.def("avx2_int8_gemv", &avx2_int8_gemv, "exact W8A8 for <= 8 rows, int8 weight streamed once (AVX2; False "
        "where it does not apply)", py::arg("out"), py::arg("x"), py::arg("w8"), py::arg("sw"),
        py::arg("bias") = py::none());
  m.def("avx2_int8_head_argmax", &avx2_int8_head_argmax, "the greedy token per row (<= 8 rows) of the int8 head "
        "W8A8(x) without writing the logits (AVX2; False where it does not apply)", py::arg("tokens"), py::arg("x"),
        py::arg("w8"), py::arg("sw"));
  m.def("set_avx2_int8_u8", &set_avx2_int8_u8, "avx2_int8_gemv's vpmaddubsw kernel on/off (same bits; for "
        "benchmarks); returns the previous setting");
}
