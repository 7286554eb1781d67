// The lm_head for decode steps: logits = x W^T for x [M, K] bf16 and the vocabulary-wide W [V, K] bf16, with W
// prepacked once into the pair layout AVX-512 BF16's vdpbf16ps multiplies (16 vocab entries x one pair of k per
// 64-byte vector), and, for an all-greedy step, fused with the argmax: each thread keeps a per-row running maximum
// and index over its own vocabulary tiles, and no [M, V] logits are written at all.
//
// Reduction order (why the fused token is exactly the unfused kernel's argmax): logit (m, v) is ONE fp32
// accumulator lane chained over k in increasing pairs (acc += w[v,2p] x[m,2p] + w[v,2p+1] x[m,2p+1], vdpbf16ps),
// then rounded to bf16 by vcvtneps2bf16. Neither the row tile, the vocabulary tile nor the thread split changes
// that chain, so `lm_head_bf16` (which stores those bf16 values) and `lm_head_argmax_bf16` (which compares them)
// see the same numbers, and each row's logits are the same bits whatever the number of rows in the call
// (batch-invariant). The argmax follows torch.argmax: the first index of the maximum, or the first NaN's index if
// the row has a NaN.
//
// Built where avx512_bf16 is native (cpu_kernels._isa_flags); elsewhere `has_lm_head_bf16()` is false and the
// Python side keeps the module path (oneDNN / linear_small + argmax_rows).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <limits>
#include <vector>

#include <type_traits>

#include "amx_tile.h"  // TM_AMX where AMX bf16 tiles are compiled in

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TM_LM_BF16 1
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TM_LM_I8 1
#endif
#endif

void quantize_rows(torch::Tensor q, torch::Tensor scale, torch::Tensor x);  // paged_decode.cpp

namespace {

constexpr int64_t VT = 64;  // vocabulary entries per packed tile (4 vectors of 16)
constexpr int MR = 6;       // rows per register tile: 4 x 6 accumulators + 4 weight vectors + 1 broadcast

#ifdef TM_LM_BF16
// acc[m][j] for rows m0 .. m0+R-1 and the tile's 4 vectors of 16 vocab entries; wt: the tile [K/2][64] pairs
template <int R>
inline void tile_acc(const uint32_t* xp, int64_t K2, int64_t m0, const uint32_t* wt, __m512 acc[MR][4]) {
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  const uint32_t* xr[R];
  for (int m = 0; m < R; ++m) xr[m] = xp + (m0 + m) * K2;
  for (int64_t p = 0; p < K2; ++p) {
    const uint32_t* w = wt + p * VT;
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + 16 * j);
    for (int m = 0; m < R; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[m][p]);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
    }
  }
}

// the bf16 logit as the unfused kernel stores it, widened back to fp32 (exact)
inline __m512 round_bf16(__m512 a) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(a);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int R>
inline void store_tile(const __m512 acc[MR][4], at::BFloat16* op, int64_t N, int64_t m0, int64_t v0) {
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < 4; ++j) {
      const int64_t v = v0 + 16 * j;
      if (v >= N) break;
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[m][j]);
      at::BFloat16* dst = op + (m0 + m) * N + v;
      if (v + 16 <= N) _mm256_storeu_si256((__m256i*)dst, h);
      else _mm256_mask_storeu_epi16(dst, (__mmask16)((1u << (N - v)) - 1), h);
    }
}

// fp32 logits (the int8 head of an fp32 model): stored as computed
template <int R>
inline void store_tile(const __m512 acc[MR][4], float* op, int64_t N, int64_t m0, int64_t v0) {
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < 4; ++j) {
      const int64_t v = v0 + 16 * j;
      if (v >= N) break;
      float* dst = op + (m0 + m) * N + v;
      if (v + 16 <= N) _mm512_storeu_ps(dst, acc[m][j]);
      else _mm512_mask_storeu_ps(dst, (__mmask16)((1u << (N - v)) - 1), acc[m][j]);
    }
}

// a thread's running argmax for one row: per lane the best value so far and its index (strictly greater wins, so
// each lane keeps its first maximum), plus the row's first NaN index in this thread's range
struct RowBest {
  __m512 best;
  __m512i idx;
  int64_t nan_idx;
};

template <int R, bool BF16 = true>
inline void argmax_tile(const __m512 acc[MR][4], RowBest* rb, int64_t N, int64_t m0, int64_t v0) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int m = 0; m < R; ++m) {
    RowBest& b = rb[m0 + m];
    for (int j = 0; j < 4; ++j) {
      const int64_t v = v0 + 16 * j;
      if (v >= N) break;
      const __mmask16 valid = v + 16 <= N ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - v)) - 1);
      __m512 x = _mm512_mask_mov_ps(ninf, valid, BF16 ? round_bf16(acc[m][j]) : acc[m][j]);
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      if (nan) {  // rare: record the first NaN (tiles run in increasing order), keep it out of the max
        if (b.nan_idx < 0) b.nan_idx = v + __builtin_ctz((unsigned)nan);
        x = _mm512_mask_mov_ps(x, nan, ninf);
      }
      const __mmask16 gt = _mm512_cmp_ps_mask(x, b.best, _CMP_GT_OQ);
      b.best = _mm512_mask_mov_ps(b.best, gt, x);
      b.idx = _mm512_mask_mov_epi32(b.idx, gt, _mm512_add_epi32(_mm512_set1_epi32((int)v), iota));
    }
  }
}

// the row's (value, index) from the lanes: the largest value, the smallest index holding it
inline void reduce_row(const RowBest& b, float& val, int64_t& idx) {
  alignas(64) float bv[16];
  alignas(64) int32_t bi[16];
  _mm512_store_ps(bv, b.best);
  _mm512_store_si512(bi, b.idx);
  val = bv[0];
  idx = bi[0];
  for (int l = 1; l < 16; ++l)
    if (bv[l] > val || (bv[l] == val && bi[l] < idx)) { val = bv[l]; idx = bi[l]; }
}

#ifdef TM_AMX
// run_rows on AMX tiles (csrc/amx_tile.h): 16 rows per TDPBF16PS pass, the fp32 sums through the same bf16 store /
// argmax epilogue (tiles in increasing order per row, as the argmax needs). Its own bits (not vdpbf16ps's), the
// same for logits and greedy, and per row whatever the row count.
template <bool ARGMAX>
void run_rows_amx(const uint32_t* xp, const uint32_t* wp, int64_t M, int64_t K2, int64_t N, int64_t t0, int64_t t1,
                  at::BFloat16* op, RowBest* rb) {
  alignas(64) float buf[16 * VT];
  __m512 acc[MR][4];
  const uint16_t* x16 = reinterpret_cast<const uint16_t*>(xp);
  for (int64_t c0 = 0; c0 < M; c0 += 16) {
    const int R = (int)std::min<int64_t>(16, M - c0);
    tm_amx::configure(R);
    for (int64_t t = t0; t < t1; ++t) {
      tm_amx::tile64(x16, 2 * K2, c0, wp + t * K2 * VT, buf);
      for (int r0 = 0; r0 < R; r0 += MR) {
        const int n = std::min(MR, R - r0);
        for (int m = 0; m < n; ++m)
          for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_load_ps(buf + (r0 + m) * VT + 16 * j);
        const int64_t m0 = c0 + r0, v0 = t * VT;
        switch (n) {
#define TM_AMX_EPI(Q) \
  case Q: if (ARGMAX) argmax_tile<Q>(acc, rb, N, m0, v0); else store_tile<Q>(acc, op, N, m0, v0); break;
          TM_AMX_EPI(1) TM_AMX_EPI(2) TM_AMX_EPI(3) TM_AMX_EPI(4) TM_AMX_EPI(5) TM_AMX_EPI(6)
#undef TM_AMX_EPI
          default: break;
        }
      }
    }
  }
  _tile_release();
}
#endif

template <bool ARGMAX>
void run_rows(const uint32_t* xp, const uint32_t* wp, int64_t M, int64_t K2, int64_t N, int64_t t0, int64_t t1,
              at::BFloat16* op, RowBest* rb) {
#ifdef TM_AMX
  if (K2 % 16 == 0 && tm_amx::available()) return run_rows_amx<ARGMAX>(xp, wp, M, K2, N, t0, t1, op, rb);
#endif
  __m512 acc[MR][4];
  for (int64_t t = t0; t < t1; ++t) {
    const uint32_t* wt = wp + t * K2 * VT;
    const int64_t v0 = t * VT;
    if (t + 1 < t1)  // the next tile's first lines: its stream starts while this tile computes
      for (int64_t o = 0; o < 4 * VT; o += 16) _mm_prefetch((const char*)(wt + K2 * VT + o), _MM_HINT_T0);
    int64_t m = 0;
    for (; m + MR <= M; m += MR) {
      tile_acc<MR>(xp, K2, m, wt, acc);
      if (ARGMAX) argmax_tile<MR>(acc, rb, N, m, v0); else store_tile<MR>(acc, op, N, m, v0);
    }
    switch (M - m) {
#define TM_REM(R)                                                                          \
  case R:                                                                                  \
    tile_acc<R>(xp, K2, m, wt, acc);                                                       \
    if (ARGMAX) argmax_tile<R>(acc, rb, N, m, v0); else store_tile<R>(acc, op, N, m, v0); \
    break;
      TM_REM(1) TM_REM(2) TM_REM(3) TM_REM(4) TM_REM(5)
#undef TM_REM
      default: break;
    }
  }
}

#ifdef TM_LM_I8
// ---- int8 W8A8 head (AVX-512 VNNI): the rows quantized per token by quantize_rows (shifted to unsigned for
// vpdpbusd), the head's int8 weights [V, K] prepacked as [ceil(V / 64), K / 4, 64] int32 (4 int8 of one vocab
// entry each), exact int32 sums, then (sum - 128 * wsum[v]) * sx[m] * sw[v] in fp32 (the same order as
// dequant_rows), rounded to the output dtype: the unfused and the fused kernel share this epilogue.
template <int R>
inline void tile_acc_i8(const uint32_t* xp, int64_t K4, int64_t m0, const uint32_t* wt, const int32_t* ws,
                        const float* sw, const float* sx, int64_t v0, __m512 out[MR][4]) {
  __m512i acc[MR][4];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_si512();
  const uint32_t* xr[R];
  for (int m = 0; m < R; ++m) xr[m] = xp + (m0 + m) * K4;
  for (int64_t p = 0; p < K4; ++p) {
    const uint32_t* w = wt + p * VT;
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512(w + 16 * j);
    for (int m = 0; m < R; ++m) {
      const __m512i xb = _mm512_set1_epi32((int)xr[m][p]);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], xb, wv[j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i c = _mm512_slli_epi32(_mm512_loadu_si512(ws + v0 + 16 * j), 7);  // 128 * wsum
    const __m512 s = _mm512_loadu_ps(sw + v0 + 16 * j);
    for (int m = 0; m < R; ++m)
      out[m][j] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][j], c)),
                                              _mm512_set1_ps(sx[m0 + m])), s);
  }
}

template <bool ARGMAX, typename OUT>
void run_rows_i8(const uint32_t* xp, const uint32_t* wp, const int32_t* ws, const float* sw, const float* sx,
                 int64_t M, int64_t K4, int64_t N, int64_t t0, int64_t t1, OUT* op, RowBest* rb) {
  constexpr bool BF = std::is_same<OUT, at::BFloat16>::value;
  __m512 acc[MR][4];
  for (int64_t t = t0; t < t1; ++t) {
    const uint32_t* wt = wp + t * K4 * VT;
    const int64_t v0 = t * VT;
    int64_t m = 0;
    for (; m + MR <= M; m += MR) {
      tile_acc_i8<MR>(xp, K4, m, wt, ws, sw, sx, v0, acc);
      if (ARGMAX) argmax_tile<MR, BF>(acc, rb, N, m, v0); else store_tile<MR>(acc, op, N, m, v0);
    }
    switch (M - m) {
#define TM_REM(R)                                                                              \
  case R:                                                                                      \
    tile_acc_i8<R>(xp, K4, m, wt, ws, sw, sx, v0, acc);                                        \
    if (ARGMAX) argmax_tile<R, BF>(acc, rb, N, m, v0); else store_tile<R>(acc, op, N, m, v0); \
    break;
      TM_REM(1) TM_REM(2) TM_REM(3) TM_REM(4) TM_REM(5)
#undef TM_REM
      default: break;
    }
  }
}
#endif  // TM_LM_I8

// the argmax over all tiles: contiguous tile ranges per thread (`run(t0, t1, rb)` fills that range's RowBest per
// row), merged in vocabulary order (first NaN first, then strictly greater values: the first maximum wins)
template <typename F>
void argmax_over_tiles(int64_t* tp, int64_t M, int64_t N, int64_t T, const F& run) {
  // one slot per (chunk, row); chunks are contiguous tile ranges, merged in vocabulary order below
  const int64_t nchunks = std::min<int64_t>(T, std::max<int64_t>(1, at::get_num_threads()));
  const int64_t per = (T + nchunks - 1) / nchunks;
  std::vector<float> cval(nchunks * M);
  std::vector<int64_t> cidx(nchunks * M), cnan(nchunks * M);
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<RowBest> rb(M);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t t0 = c * per, t1 = std::min(T, t0 + per);
      for (auto& b : rb) {
        b.best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        b.idx = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
        b.nan_idx = -1;
      }
      if (t0 < t1) run(t0, t1, rb.data());
      for (int64_t m = 0; m < M; ++m) {
        reduce_row(rb[m], cval[c * M + m], cidx[c * M + m]);
        // a range whose every value is -inf (or NaN) keeps no index from the strict compare: its first index
        if (cidx[c * M + m] == std::numeric_limits<int32_t>::max()) cidx[c * M + m] = std::min(t0 * VT, N - 1);
        cnan[c * M + m] = rb[m].nan_idx;
      }
    }
  });
  for (int64_t m = 0; m < M; ++m) {
    float val = cval[m];
    int64_t idx = cidx[m], nan = cnan[m];
    for (int64_t c = 1; c < nchunks; ++c) {
      if (nan < 0) nan = cnan[c * M + m];
      if (cval[c * M + m] > val) { val = cval[c * M + m]; idx = cidx[c * M + m]; }
    }
    tp[m] = nan >= 0 ? nan : idx;
  }
}
#endif

void check_x(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "lm_head: x [M, K] bf16 contiguous");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 2 == 0 && packed.scalar_type() == at::kInt && packed.is_contiguous() &&
              packed.numel() == ((N + VT - 1) / VT) * (K / 2) * VT, "lm_head: packed weight does not match x / N");
}

}  // namespace

bool has_lm_head_bf16() {
#ifdef TM_LM_BF16
  return true;
#else
  return false;
#endif
}

// W [V, K] bf16 -> int32 [ceil(V / 64), K / 2, 64]: tile t, pair p, lane l holds (W[64t + l, 2p], W[64t + l, 2p + 1]);
// rows past V are zero
torch::Tensor lm_head_pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0, "lm_head_pack_bf16: W [V, K] bf16, K even");
  const int64_t N = w.size(0), K = w.size(1), K2 = K / 2, T = (N + VT - 1) / VT;
  auto wc = w.contiguous();
  auto out = torch::zeros({T, K2, VT}, torch::dtype(torch::kInt32));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(wc.data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t l = 0; l < VT && t * VT + l < N; ++l)
        for (int64_t p = 0; p < K2; ++p) dst[(t * K2 + p) * VT + l] = src[(t * VT + l) * K2 + p];
  });
  return out;
}

// out [M, N] bf16 = x W^T (no bias), W packed by lm_head_pack_bf16
void lm_head_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor packed, int64_t N) {
  check_x(x, packed, N);
  TORCH_CHECK(has_lm_head_bf16(), "lm_head_bf16: not built with AVX-512 BF16");
  const int64_t M = x.size(0), K2 = x.size(1) / 2, T = (N + VT - 1) / VT;
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kBFloat16 && out.size(0) == M && out.size(1) == N,
              "lm_head_bf16: out [M, N] bf16 contiguous");
  if (M == 0) return;
#ifdef TM_LM_BF16
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) { run_rows<false>(xp, wp, M, K2, N, t0, t1, op, nullptr); });
#endif
}

// tokens [M] int64 = argmax over v of the bf16 logits lm_head_bf16 would write, torch.argmax's rules
void lm_head_argmax_bf16(torch::Tensor tokens, torch::Tensor x, torch::Tensor packed, int64_t N) {
  check_x(x, packed, N);
  TORCH_CHECK(has_lm_head_bf16(), "lm_head_argmax_bf16: not built with AVX-512 BF16");
  const int64_t M = x.size(0), K2 = x.size(1) / 2, T = (N + VT - 1) / VT;
  TORCH_CHECK(tokens.is_contiguous() && tokens.scalar_type() == at::kLong && tokens.numel() == M && N > 0,
              "lm_head_argmax_bf16: tokens [M] int64");
  if (M == 0) return;
#ifdef TM_LM_BF16
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  argmax_over_tiles(tokens.data_ptr<int64_t>(), M, N, T, [&](int64_t t0, int64_t t1, RowBest* rb) {
    run_rows<true>(xp, wp, M, K2, N, t0, t1, nullptr, rb);
  });
#endif
}

bool has_lm_head_int8() {
#ifdef TM_LM_I8
  return true;
#else
  return false;
#endif
}

// int8 W [V, K] -> int32 [ceil(V / 64), K / 4, 64]: tile t, quad p, lane l holds W[64t + l, 4p .. 4p + 3]
torch::Tensor lm_head_pack_int8(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.size(1) % 4 == 0, "lm_head_pack_int8: W [V, K] int8, K % 4 == 0");
  const int64_t N = w.size(0), K = w.size(1), K4 = K / 4, T = (N + VT - 1) / VT;
  auto wc = w.contiguous();
  auto out = torch::zeros({T, K4, VT}, torch::dtype(torch::kInt32));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(wc.data_ptr<int8_t>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t l = 0; l < VT && t * VT + l < N; ++l)
        for (int64_t p = 0; p < K4; ++p) dst[(t * K4 + p) * VT + l] = src[(t * VT + l) * K4 + p];
  });
  return out;
}

#ifdef TM_LM_I8
// the rows quantized as quantize_rows does, shifted to unsigned (u = q + 128) for vpdpbusd
static void quantize_shift(const torch::Tensor& x, std::vector<uint8_t>& xu, std::vector<float>& sx) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<int8_t> q(M * K);
  sx.resize(M);
  quantize_rows(torch::from_blob(q.data(), {M, K}, torch::kChar), torch::from_blob(sx.data(), {M}, torch::kFloat), x);
  xu.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) xu[i] = (uint8_t)((int)q[i] + 128);
}
#endif

static void check_i8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& wsum,
                     const torch::Tensor& sw, int64_t N) {
  TORCH_CHECK(has_lm_head_int8(), "lm_head int8: not built with AVX-512 VNNI and BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "lm_head int8: x [M, K] fp32/bf16 contiguous");
  const int64_t K = x.size(1), T = (N + VT - 1) / VT;
  TORCH_CHECK(K % 4 == 0 && packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.numel() == T * (K / 4) * VT,
              "lm_head int8: packed weight does not match x / N");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && sw.scalar_type() == at::kFloat && wsum.is_contiguous() &&
              sw.is_contiguous() && wsum.numel() == T * VT && sw.numel() == T * VT,
              "lm_head int8: wsum (int32) and sw (fp32) padded to a multiple of 64 entries");
}

// out [M, N] (x's dtype) = the W8A8 product of x and the packed int8 head (row sums wsum, per-channel scales sw)
void lm_head_int8(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor wsum, torch::Tensor sw,
                  int64_t N) {
  check_i8(x, packed, wsum, sw, N);
  const int64_t M = x.size(0), K4 = x.size(1) / 4, T = (N + VT - 1) / VT;
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.size(0) == M && out.size(1) == N,
              "lm_head_int8: out [M, N] contiguous in x's dtype");
  if (M == 0) return;
#ifdef TM_LM_I8
  std::vector<uint8_t> xu;
  std::vector<float> sx;
  quantize_shift(x, xu, sx);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xu.data());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  const int32_t* ws = wsum.data_ptr<int32_t>();
  const float* swp = sw.data_ptr<float>();
  if (out.scalar_type() == at::kBFloat16) {
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      run_rows_i8<false>(xp, wp, ws, swp, sx.data(), M, K4, N, t0, t1, op, nullptr);
    });
  } else {
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      run_rows_i8<false>(xp, wp, ws, swp, sx.data(), M, K4, N, t0, t1, op, nullptr);
    });
  }
#endif
}

// tokens [M] int64 = argmax of the logits lm_head_int8 would write (torch.argmax's rules), without writing them
void lm_head_argmax_int8(torch::Tensor tokens, torch::Tensor x, torch::Tensor packed, torch::Tensor wsum,
                         torch::Tensor sw, int64_t N) {
  check_i8(x, packed, wsum, sw, N);
  const int64_t M = x.size(0), K4 = x.size(1) / 4, T = (N + VT - 1) / VT;
  TORCH_CHECK(tokens.is_contiguous() && tokens.scalar_type() == at::kLong && tokens.numel() == M && N > 0,
              "lm_head_argmax_int8: tokens [M] int64");
  if (M == 0) return;
#ifdef TM_LM_I8
  std::vector<uint8_t> xu;
  std::vector<float> sx;
  quantize_shift(x, xu, sx);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xu.data());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  const int32_t* ws = wsum.data_ptr<int32_t>();
  const float* swp = sw.data_ptr<float>();
  const bool bf = x.scalar_type() == at::kBFloat16;
  argmax_over_tiles(tokens.data_ptr<int64_t>(), M, N, T, [&](int64_t t0, int64_t t1, RowBest* rb) {
    if (bf) run_rows_i8<true, at::BFloat16>(xp, wp, ws, swp, sx.data(), M, K4, N, t0, t1, nullptr, rb);
    else run_rows_i8<true, float>(xp, wp, ws, swp, sx.data(), M, K4, N, t0, t1, nullptr, rb);
  });
#endif
}

// called from the module definition in paged_decode.cpp (one extension module, several sources)
void register_lm_head(pybind11::module& m) {
  m.def("has_lm_head_bf16", &has_lm_head_bf16, "whether the AVX-512 BF16 lm_head kernels are compiled in");
  m.def("lm_head_pack_bf16", &lm_head_pack_bf16, "W [V, K] bf16 -> the lm_head kernels' vdpbf16ps pair layout");
  m.def("lm_head_bf16", &lm_head_bf16, "bf16 logits x W^T from the packed head (batch-invariant)");
  m.def("lm_head_argmax_bf16", &lm_head_argmax_bf16,
        "greedy tokens: argmax of lm_head_bf16's logits without writing them (torch.argmax's rules)");
  m.def("has_lm_head_int8", &has_lm_head_int8, "whether the AVX-512 VNNI int8 lm_head kernels are compiled in");
  m.def("lm_head_pack_int8", &lm_head_pack_int8, "int8 W [V, K] -> the int8 lm_head kernels' vpdpbusd layout");
  m.def("lm_head_int8", &lm_head_int8, "W8A8 logits from the packed int8 head (batch-invariant)");
  m.def("lm_head_argmax_int8", &lm_head_argmax_int8,
        "greedy tokens: argmax of lm_head_int8's logits without writing them (torch.argmax's rules)");
}
