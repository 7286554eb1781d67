// Paged decode attention for CPU (fp32, bf16 or int8 KV storage, fp32 math): one new query token per sequence,
// K/V read in place from the block-structured cache (no gather copy). Two passes per (sequence, kv head): scores
// for the whole context, then the softmax-weighted sum of V. Parallel over (sequence, kv head) with ATen's thread pool. With AVX2+FMA the
// dot products, the V accumulation and exp are 8-wide; the next block is prefetched (blocks are scattered).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <cstring>
#include <limits>
#include <algorithm>
#include <type_traits>
#include <atomic>
#include <cstdlib>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_AVX2 1
#include "simd_exp.h"  // exp256
static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 8 values of the storage type <-> 8 floats (bf16: the high half of an fp32; stores round to nearest even)
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// int8 (the quantized KV cache): 8 bytes sign-extended and converted; the caller applies the block's scale
static inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8(at::BFloat16* p, __m256 v) {
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
// 8 floats rounded to bf16 (as store8 rounds) and back to fp32
static inline __m256 round_bf16_8(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
#endif

static inline float to_f(float v) { return v; }
static inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }
static inline float to_f(int8_t v) { return static_cast<float>(v); }
template <typename T> static inline T from_f(float v) { return static_cast<T>(v); }

// run F<float> or F<bf16> for the tensor's dtype
#define TM_DISPATCH(tensor, NAME, ...)                                                        \
  [&] {                                                                                      \
    if ((tensor).scalar_type() == at::kFloat) { using scalar_t = float; return __VA_ARGS__(); } \
    TORCH_CHECK((tensor).scalar_type() == at::kBFloat16, NAME ": float32 or bfloat16 only");  \
    using scalar_t = at::BFloat16;                                                           \
    return __VA_ARGS__();                                                                    \
  }()

// The next (sequence, kv head) task's K blocks, prefetched into L2 a few cache lines at a time while the current
// task's softmax and pass 2 run (they read only what pass 1 brought into L1/L2, so without this the memory would
// idle through them); pass 1 of the next task then finds its K in L2 and the memory streams that task's V.
// With `vbase` set it then takes the next task's V blocks too (spread over this task's pass 1 and pass 2).
struct NextK {
  const char* base = nullptr;
  const char* vbase = nullptr;
  const int64_t* row = nullptr;
  int64_t kvh = 0, h = 0, chunk = 0, b0 = 0, b = 0, b1 = 0, off = 0;
  int64_t lines_left() const {
    const int64_t k = b < b1 ? ((b1 - b) * chunk - off) / 64 : 0;
    return k + (vbase ? (b1 - b0) * chunk / 64 : 0);
  }
  inline void step(int64_t lines) {
    for (; lines > 0 && b < b1; --lines) {
      __builtin_prefetch(base + (row[b] * kvh + h) * chunk + off, 0, 2);
      off += 64;
      if (off >= chunk) {
        off = 0;
        if (++b == b1 && vbase) {  // K done: now the V blocks
          base = vbase;
          vbase = nullptr;
          b = b0;
        }
      }
    }
  }
};

#ifdef TM_AVX2
// pass 2 of decode attention, register-tiled: acc[g][e0 : e0 + 8*CH] for the TG query heads of one kv head stay
// in registers across the whole context (no load/store of the accumulators per token); V rows are read once per
// tile of 8*CH columns (they stay in L1/L2 between tiles). Needs hd % (8*CH) == 0.
template <int TG, int CH, typename T>
static void attend_v_tiled(const T* vp, const int64_t* row, const float* vsc, int64_t kvh, int64_t h, int64_t bs,
                           int64_t hd, int64_t start, int64_t ctx, const float* scores, int64_t n, float* acc) {
  for (int64_t e0 = 0; e0 < hd; e0 += 8 * CH) {
    __m256 a[TG][CH];
    for (int g = 0; g < TG; ++g)
      for (int c = 0; c < CH; ++c) a[g][c] = _mm256_setzero_ps();
    for (int64_t b = start / bs; b * bs < ctx; ++b) {
      const int64_t t0 = std::max(start, b * bs), t1 = std::min(ctx, (b + 1) * bs);
      const T* vb = vp + (row[b] * kvh + h) * bs * hd + e0;
      const float vs = vsc ? vsc[row[b] * kvh + h] : 1.f;  // int8: the block's V scale, folded into p
      for (int64_t t = t0; t < t1; ++t) {
        const T* vt = vb + (t - b * bs) * hd;
        __m256 p[TG];
        for (int g = 0; g < TG; ++g) p[g] = _mm256_set1_ps(scores[g * n + (t - start)] * vs);
        for (int c = 0; c < CH; ++c) {
          const __m256 v8 = load8(vt + 8 * c);
          for (int g = 0; g < TG; ++g) a[g][c] = _mm256_fmadd_ps(p[g], v8, a[g][c]);
        }
      }
    }
    for (int g = 0; g < TG; ++g)
      for (int c = 0; c < CH; ++c) _mm256_storeu_ps(acc + g * hd + e0 + 8 * c, a[g][c]);
  }
}

template <typename T>
static bool attend_v_dispatch(int64_t G, const T* vp, const int64_t* row, const float* vsc, int64_t kvh, int64_t h,
                              int64_t bs, int64_t hd, int64_t start, int64_t ctx, const float* scores, int64_t n,
                              float* acc) {
  if (hd % 8) return false;
  const int64_t nch = hd / 8;
#define TM_TRY(TG, CH)                                                                                      \
  if (G == TG && nch % CH == 0) {                                                                           \
    attend_v_tiled<TG, CH, T>(vp, row, vsc, kvh, h, bs, hd, start, ctx, scores, n, acc);                    \
    return true;                                                                                            \
  }
  TM_TRY(1, 8) TM_TRY(1, 4) TM_TRY(1, 2) TM_TRY(1, 1)
  TM_TRY(2, 4) TM_TRY(2, 2) TM_TRY(2, 1)
  TM_TRY(4, 2) TM_TRY(4, 1)
  TM_TRY(8, 1)
#undef TM_TRY
  return false;
}

// pass 1 for TG query heads sharing one kv head: each K chunk is loaded (and converted) once for all of them
template <int TG, typename T>
static inline void scores_shared_k(const float* qf, const T* kt, int64_t hd, float* s) {
  __m256 a[TG];
  for (int g = 0; g < TG; ++g) a[g] = _mm256_setzero_ps();
  for (int64_t e = 0; e < hd; e += 8) {
    const __m256 k8 = load8(kt + e);
    for (int g = 0; g < TG; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * hd + e), k8, a[g]);
  }
  for (int g = 0; g < TG; ++g) s[g] = hsum256(a[g]);
}
#endif

#if defined(TM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TM_AVX512 1
// ---- AVX-512 decode attention (built where avx512_bf16 is native): 16 lanes, bf16 dot products (vdpbf16ps) for
// a bf16 query against a bf16 cache, and 16 tokens' scores reduced together (one transpose-sum per 16 tokens
// instead of a horizontal sum per token) ----
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
static inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 floats stored as float, or as bf16 rounded to nearest even (store8's rounding)
static inline void store16_rne(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16_rne(at::BFloat16* p, __m512 v) {
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(b));
}
// out[i] = sum of the 16 lanes of v[i], i < 16
static inline __m512 transpose_sum16(const __m512* v) {
  __m512 s2[8];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane k: [a(4k)+a(4k+2), b(4k)+b(4k+2), a(4k+1)+a(4k+3), b(..)]
    s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 s4[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane k: [a, b, c, d] summed over lane k
    const __m512d x = _mm512_castps_pd(s2[2 * i]), y = _mm512_castps_pd(s2[2 * i + 1]);
    s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // 128-bit lanes: combine lanes (0,1) and (2,3) of two vectors, then once more
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// r[e] lane j := r[j] lane e for a 16 x 16 matrix of 32-bit elements (here: 16 tokens' bf16 pairs)
static inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], 128-bit block k: rows 4i .. 4i+3 at column 4k + c
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  __m512i o[16];
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    o[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    o[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    o[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    o[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
  for (int e = 0; e < 16; ++e) r[e] = o[e];
}

// The reference kernel prefetches K one block (16 tokens) ahead and V as pass 1 reads K; the session-9 kernel
// (g_attn_v2) does that, pf_ahead tokens ahead, only for a thread's first task: later tasks' K and V were
// prefetched during the task before (NextK).
// pass 1, 16 tokens at a time: scores[g * n + i] = (q_g . k_(start+i)) * scale * (int8: the block's K scale).
// DP: the query is bf16 and so is the cache (hd % 32 == 0, hd <= 128): pairs of bf16 products summed by vdpbf16ps
// (exact products, fp32 sums), 16 tokens in the lanes; otherwise the query in fp32 (qf) against K converted to fp32.
template <bool DP, typename T>
static void scores16(const float* qf, const at::BFloat16* qb, const T* kp, const T* vp, const int64_t* row,
                     const float* ksc,
                     int64_t kvh, int64_t h, int64_t bs, int64_t hd, int64_t start, int64_t ctx, int64_t G,
                     float fscale, float* scores, int64_t n, int64_t pf_ahead, NextK* nk, bool pf_cur) {
  const int64_t sh = __builtin_ctzll(bs), mask = bs - 1;  // bs is a power of two (EngineConfig)
  // half of the next task's lines during this pass, the rest during pass 2
  const int64_t per = nk ? (nk->lines_left() / 2 + (n + 15) / 16 - 1) / ((n + 15) / 16) : 0;
  alignas(64) uint32_t kT[DP ? 64 * 16 : 1];  // DP: hd <= 128
  (void)kT;
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    if (per) nk->step(per);
    const int64_t cnt = std::min<int64_t>(16, n - i0);
    const T* kt[16];
    float bsc[16];
    for (int j = 0; j < 16; ++j) {
      const int64_t t = start + i0 + (j < cnt ? j : cnt - 1);
      const int64_t blk = row[t >> sh];
      kt[j] = kp + ((blk * kvh + h) * bs + (t & mask)) * hd;
      bsc[j] = ksc ? fscale * ksc[blk * kvh + h] : fscale;
    }
    if (pf_cur && i0 + pf_ahead < n) {  // rows pf_ahead ahead (scattered blocks): fetch them while this group computes
      for (int j = 0; j < 16; j += 4) {
        const int64_t t = start + std::min<int64_t>(i0 + pf_ahead + j, n - 1);
        const T* p = kp + ((row[t >> sh] * kvh + h) * bs + (t & mask)) * hd;
        for (int64_t off = 0; off < 4 * hd; off += 64 / (int64_t)sizeof(T)) __builtin_prefetch(p + off, 0, 3);
      }
    }
    for (int j = 0; pf_cur && j < cnt; j += 4) {  // this group's V rows, for pass 2 (a (sequence, head)'s V fits in L2)
      const T* p = vp + (kt[j] - kp);
      for (int64_t off = 0; off < std::min<int64_t>(4, cnt - j) * hd; off += 64 / (int64_t)sizeof(T))
        __builtin_prefetch(p + off, 0, 2);
    }
    const __m512 sc = _mm512_loadu_ps(bsc);
    if constexpr (DP) {
      // tokens in the lanes: the 16 K rows transposed once into pair-major order (kT[e] lane j = token j's bf16
      // pair e), then each query row's 16 scores are hd / 2 vdpbf16ps against its pair e broadcast, in two chains
      // (even and odd pairs, each in order) added at the end: a row's bits do not depend on how many rows share
      // the call (a verify step's rows of one sequence run as one task: the grouped path below)
      for (int64_t c = 0; c < hd / 32; ++c) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(kt[j] + 32 * c);
        transpose16x16_epi32(r);
        for (int e = 0; e < 16; ++e) _mm512_store_si512(kT + (16 * c + e) * 16, r[e]);
      }
      const int64_t P = hd / 2;
      const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qb);
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t m = std::min<int64_t>(4, G - g0);
        __m512 a0[4], a1[4];
        for (int r = 0; r < 4; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
        for (int64_t e = 0; e < P; e += 2) {
          const __m512bh k0 = (__m512bh)_mm512_load_si512(kT + e * 16), k1 = (__m512bh)_mm512_load_si512(kT + (e + 1) * 16);
          for (int r = 0; r < 4; ++r) {
            if (r >= m) break;
            const uint32_t* qr = q32 + (g0 + r) * P;
            a0[r] = _mm512_dpbf16_ps(a0[r], k0, (__m512bh)_mm512_set1_epi32((int)qr[e]));
            a1[r] = _mm512_dpbf16_ps(a1[r], k1, (__m512bh)_mm512_set1_epi32((int)qr[e + 1]));
          }
        }
        for (int r = 0; r < m; ++r)
          _mm512_mask_storeu_ps(scores + (g0 + r) * n + i0, (__mmask16)((1u << cnt) - 1),
                                _mm512_mul_ps(_mm512_add_ps(a0[r], a1[r]), sc));
      }
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      __m512 v[16];
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_setzero_ps();
        const float* qg = qf + g * hd;
        for (int64_t e = 0; e < hd; e += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + e), load16(kt[j] + e), a);
        v[j] = a;
      }
      const __m512 s = _mm512_mul_ps(transpose_sum16(v), sc);
      _mm512_mask_storeu_ps(scores + g * n + i0, (__mmask16)((1u << cnt) - 1), s);
    }
  }
}

// pass 2, register-tiled as attend_v_tiled: TG query heads x CH chunks of 16 columns stay in registers
template <int TG, int CH, typename T>
static void attend_v16(const T* vp, const int64_t* row, const float* vsc, int64_t kvh, int64_t h, int64_t bs,
                       int64_t hd, int64_t start, int64_t ctx, const float* scores, int64_t n, float* acc,
                       NextK* nk) {
  const int64_t per = nk ? (nk->lines_left() + n * (hd / (16 * CH)) - 1) / std::max<int64_t>(1, n * (hd / (16 * CH))) : 0;
  for (int64_t e0 = 0; e0 < hd; e0 += 16 * CH) {
    __m512 a[TG][CH];
    for (int g = 0; g < TG; ++g)
      for (int c = 0; c < CH; ++c) a[g][c] = _mm512_setzero_ps();
    for (int64_t b = start / bs; b * bs < ctx; ++b) {
      const int64_t t0 = std::max(start, b * bs), t1 = std::min(ctx, (b + 1) * bs);
      const T* vb = vp + (row[b] * kvh + h) * bs * hd + e0;
      const float vs = vsc ? vsc[row[b] * kvh + h] : 1.f;
      for (int64_t t = t0; t < t1; ++t) {
        const T* vt = vb + (t - b * bs) * hd;
        __m512 p[TG];
        for (int g = 0; g < TG; ++g) p[g] = _mm512_set1_ps(scores[g * n + (t - start)] * vs);
        if (per) nk->step(per);
        for (int c = 0; c < CH; ++c) {
          const __m512 v16 = load16(vt + 16 * c);
          for (int g = 0; g < TG; ++g) a[g][c] = _mm512_fmadd_ps(p[g], v16, a[g][c]);
        }
      }
    }
    for (int g = 0; g < TG; ++g)
      for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + g * hd + e0 + 16 * c, a[g][c]);
  }
}

// pass 2 for a bf16 query over a bf16 cache: two tokens per vdpbf16ps, the softmax weights rounded to bf16 first
// (as transformers' bf16 attention rounds them before its matmul with V). pb: [TG][2*np] bf16 weights (zero
// padded to an even count); V rows t and t+1 are interleaved 16-bit-wise, so each fp32 lane sums two tokens.
// The interleave permutes columns within 128-bit lanes: lo holds columns 8k..8k+3, hi 8k+4..8k+7 of lane k.
template <int TG, int CH>
static void attend_v_dp(const at::BFloat16* vp, const int64_t* row, int64_t kvh, int64_t h, int64_t bs, int64_t hd,
                        int64_t start, int64_t n, const uint32_t* pb, int64_t np, float* acc, NextK* nk) {
  const int64_t sh = __builtin_ctzll(bs), mask = bs - 1;
  const int64_t iters = std::max<int64_t>(1, np * (hd / (32 * CH)));
  const int64_t per = nk ? (nk->lines_left() + iters - 1) / iters : 0;
  for (int64_t e0 = 0; e0 < hd; e0 += 32 * CH) {
    __m512 lo[TG][CH], hi[TG][CH];
    for (int g = 0; g < TG; ++g)
      for (int c = 0; c < CH; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < np; ++i) {
      const int64_t ta = start + 2 * i, tb = 2 * i + 1 < n ? ta + 1 : ta;  // an odd tail pairs with itself, weight 0
      const at::BFloat16* va = vp + ((row[ta >> sh] * kvh + h) * bs + (ta & mask)) * hd + e0;
      const at::BFloat16* vb = vp + ((row[tb >> sh] * kvh + h) * bs + (tb & mask)) * hd + e0;
      __m512bh p[TG];
      for (int g = 0; g < TG; ++g) p[g] = (__m512bh)_mm512_set1_epi32((int)pb[g * np + i]);
      if (per) nk->step(per);
      for (int c = 0; c < CH; ++c) {
        const __m512i a = _mm512_loadu_si512(va + 32 * c), b = _mm512_loadu_si512(vb + 32 * c);
        const __m512bh l = (__m512bh)_mm512_unpacklo_epi16(a, b), u = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < TG; ++g) {
          lo[g][c] = _mm512_dpbf16_ps(lo[g][c], l, p[g]);
          hi[g][c] = _mm512_dpbf16_ps(hi[g][c], u, p[g]);
        }
      }
    }
    alignas(64) float tl[16], th[16];
    for (int g = 0; g < TG; ++g)
      for (int c = 0; c < CH; ++c) {
        _mm512_store_ps(tl, lo[g][c]);
        _mm512_store_ps(th, hi[g][c]);
        float* o = acc + g * hd + e0 + 32 * c;
        for (int k = 0; k < 4; ++k)
          for (int j = 0; j < 4; ++j) {
            o[8 * k + j] = tl[4 * k + j];
            o[8 * k + 4 + j] = th[4 * k + j];
          }
      }
  }
}

// the softmax weights [G][n] fp32 -> bf16 pairs [G][np] (np = ceil(n / 2)), rounded to nearest even
// one row's n weights -> bf16 at d[0 : n] (the caller zero-pads to the pair count)
static inline void row_to_bf16(const float* s, int64_t n, uint16_t* d) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = (__mmask16)(n - i >= 16 ? 0xffff : (1u << (n - i)) - 1);
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, s + i));
    _mm256_mask_storeu_epi16(d + i, m, (__m256i)b);
  }
}

static void weights_to_bf16_pairs(const float* scores, int64_t G, int64_t n, std::vector<uint32_t>& pb, int64_t& np) {
  np = (n + 1) / 2;
  pb.assign(G * np, 0u);
  for (int64_t g = 0; g < G; ++g) row_to_bf16(scores + g * n, n, reinterpret_cast<uint16_t*>(pb.data() + g * np));
}

// pass 2 of attend_v_dp for query rows of different lengths over one block table (the rows of one sequence in a
// verify step: row r sees nr[r] tokens): each V pair is loaded and interleaved once for up to TG rows, and each
// row's accumulators take exactly the vdpbf16ps sequence attend_v_dp gives that row alone (its own pairs, its own
// odd tail paired with itself), so the same bits. pb: [TG][np] pairs (np >= every row's pair count); rows with
// nr = 0 are idle. hd % 32 == 0.
template <int TG>
static void attend_v_dp_rows(const at::BFloat16* vp, const int64_t* row, int64_t kvh, int64_t h, int64_t bs,
                             int64_t hd, const int64_t* nr, const uint32_t* pb, int64_t np, float* acc) {
  const int64_t sh = __builtin_ctzll(bs), mask = bs - 1;
  int64_t npr[TG], nmax = 0;
  for (int g = 0; g < TG; ++g) {
    npr[g] = (nr[g] + 1) / 2;
    nmax = std::max(nmax, nr[g]);
  }
  const int64_t npmax = (nmax + 1) / 2;
  for (int64_t e0 = 0; e0 < hd; e0 += 32) {
    __m512 lo[TG], hi[TG];
    for (int g = 0; g < TG; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < npmax; ++i) {
      const int64_t ta = 2 * i, tb = 2 * i + 1 < nmax ? ta + 1 : ta;
      const at::BFloat16* va = vp + ((row[ta >> sh] * kvh + h) * bs + (ta & mask)) * hd + e0;
      const at::BFloat16* vb = vp + ((row[tb >> sh] * kvh + h) * bs + (tb & mask)) * hd + e0;
      const __m512i a = _mm512_loadu_si512(va), b = _mm512_loadu_si512(vb);
      const __m512bh l = (__m512bh)_mm512_unpacklo_epi16(a, b), u = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < TG; ++g) {
        if (i >= npr[g]) continue;
        const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pb[g * np + i]);
        if (2 * i + 1 < nr[g]) {
          lo[g] = _mm512_dpbf16_ps(lo[g], l, p);
          hi[g] = _mm512_dpbf16_ps(hi[g], u, p);
        } else {  // this row's odd tail: token ta with itself, as attend_v_dp pairs it
          lo[g] = _mm512_dpbf16_ps(lo[g], (__m512bh)_mm512_unpacklo_epi16(a, a), p);
          hi[g] = _mm512_dpbf16_ps(hi[g], (__m512bh)_mm512_unpackhi_epi16(a, a), p);
        }
      }
    }
    alignas(64) float tl[16], th[16];
    for (int g = 0; g < TG; ++g) {
      if (!nr[g]) continue;
      _mm512_store_ps(tl, lo[g]);
      _mm512_store_ps(th, hi[g]);
      float* o = acc + g * hd + e0;
      for (int k = 0; k < 4; ++k)
        for (int j = 0; j < 4; ++j) {
          o[8 * k + j] = tl[4 * k + j];
          o[8 * k + 4 + j] = th[4 * k + j];
        }
    }
  }
}

static bool attend_v_dp_dispatch(int64_t G, const at::BFloat16* vp, const int64_t* row, int64_t kvh, int64_t h,
                                 int64_t bs, int64_t hd, int64_t start, int64_t n, const uint32_t* pb, int64_t np,
                                 float* acc, NextK* nk) {
  if (hd % 32) return false;
  const int64_t nch = hd / 32;
#define TM_TRYDP(TG, CH)                                                                                    \
  if (G == TG && nch % CH == 0) {                                                                           \
    attend_v_dp<TG, CH>(vp, row, kvh, h, bs, hd, start, n, pb, np, acc, nk);                                \
    return true;                                                                                            \
  }
  TM_TRYDP(1, 4) TM_TRYDP(1, 2) TM_TRYDP(1, 1)
  TM_TRYDP(2, 4) TM_TRYDP(2, 2) TM_TRYDP(2, 1)
  TM_TRYDP(4, 2) TM_TRYDP(4, 1)
  TM_TRYDP(8, 1)
#undef TM_TRYDP
  return false;
}

template <typename T>
static bool attend_v16_dispatch(int64_t G, const T* vp, const int64_t* row, const float* vsc, int64_t kvh,
                                int64_t h, int64_t bs, int64_t hd, int64_t start, int64_t ctx, const float* scores,
                                int64_t n, float* acc, NextK* nk) {
  if (hd % 16) return false;
  const int64_t nch = hd / 16;
#define TM_TRY16(TG, CH)                                                                                    \
  if (G == TG && nch % CH == 0) {                                                                           \
    attend_v16<TG, CH, T>(vp, row, vsc, kvh, h, bs, hd, start, ctx, scores, n, acc, nk);                    \
    return true;                                                                                            \
  }
  TM_TRY16(1, 8) TM_TRY16(1, 4) TM_TRY16(1, 2) TM_TRY16(1, 1)
  TM_TRY16(2, 8) TM_TRY16(2, 4) TM_TRY16(2, 2) TM_TRY16(2, 1)
  TM_TRY16(4, 4) TM_TRY16(4, 2) TM_TRY16(4, 1)
  TM_TRY16(8, 2) TM_TRY16(8, 1)
#undef TM_TRY16
  return false;
}
#endif

// The session-9 decode attention (TOKENMILL_DECODE_ATTN=1, the default; 0 or set_decode_attention(false) keeps the
// reference kernel): the same per-(sequence, kv head) math in the same order, so the same bits, with (1) the
// (sequence, kv head) tasks split between threads by their token counts instead of by task count (contexts differ
// by up to 8x in a step: an even split by count can leave one thread idle for much of the call); (2) the next
// task's K and V prefetched into L2 a few lines at a time across the current task's pass 1 and pass 2 (NextK), so
// the memory streams through the softmax and pass 2 too, where the reference kernel's memory idled (its
// prefetches ran only in pass 1, one block ahead); (3) the softmax maximum taken 16 lanes at a time.
static bool attn_env_default() {
  const char* v = std::getenv("TOKENMILL_DECODE_ATTN");
  return v == nullptr || std::strcmp(v, "0") != 0;
}
static std::atomic<bool> g_attn_v2{attn_env_default()};
static std::atomic<int64_t> g_pf_ahead{64};
static bool attn_group_env_default() {
  const char* v = std::getenv("TOKENMILL_DECODE_ATTN_GROUP");
  return v == nullptr || std::strcmp(v, "0") != 0;
}
static std::atomic<bool> g_attn_group{attn_group_env_default()};
bool set_decode_attention_group(bool on) { return g_attn_group.exchange(on); }

bool set_decode_attention(bool on) { return g_attn_v2.exchange(on); }
int64_t set_decode_attention_prefetch(int64_t tokens) {
  TORCH_CHECK(tokens >= 16 && tokens % 16 == 0, "decode attention prefetch distance: a multiple of 16 tokens");
  return g_pf_ahead.exchange(tokens);
}

// softmax in place over one query row's n scores; the per-row and the grouped decode paths both call it, so a
// row's weights are the same bits either way
static inline void softmax_row(float* sg, int64_t n, bool v2) {
  (void)v2;
  float m = -std::numeric_limits<float>::infinity();
  int64_t i0 = 0;
#ifdef TM_AVX512
  if (v2) {  // the same maximum (NaNs skipped as the scalar loop skips them), 16 lanes at a time
    __m512 mv = _mm512_set1_ps(m);
    for (; i0 + 16 <= n; i0 += 16) {
      const __m512 x = _mm512_loadu_ps(sg + i0);
      mv = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, mv, _CMP_GT_OQ), mv, x);
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, mv);
    for (int j = 0; j < 16; ++j) m = lanes[j] > m ? lanes[j] : m;
  }
#endif
  for (int64_t i = i0; i < n; ++i) m = sg[i] > m ? sg[i] : m;
  float sum = 0.f;
  int64_t i = 0;
#ifdef TM_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 ev = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + i), mv));
    _mm256_storeu_ps(sg + i, ev);
    sv = _mm256_add_ps(sv, ev);
  }
  sum = hsum256(sv);
#endif
  for (; i < n; ++i) { sg[i] = std::exp(sg[i] - m); sum += sg[i]; }
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
}

template <typename TQ, typename T>
static void paged_decode_attention_impl(
    torch::Tensor out,           // [D, nh, hd] TQ
    torch::Tensor q,             // [D, nh, hd] TQ (any row stride, contiguous last dim)
    torch::Tensor k_cache,       // [NB, kvh, bs, hd] T, contiguous
    torch::Tensor v_cache,       // [NB, kvh, bs, hd] T, contiguous
    torch::Tensor block_tables,  // [D, MB] int64
    torch::Tensor ctx_lens,      // [D] int64
    double scale, int64_t window,
    const float* ksc, const float* vsc) {  // int8 caches: [NB, kvh] fp32 scales of K and V; else nullptr
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and out, K and V caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(), "contiguous");
  const int64_t D = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t kvh = k_cache.size(1), bs = k_cache.size(2), MB = block_tables.size(1);
  const int64_t G = nh / kvh;
  const TQ* qp = q.data_ptr<TQ>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  TQ* op = out.data_ptr<TQ>();
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const float fscale = (float)scale;
  const int64_t line = 64 / sizeof(T);  // elements per cache line, for prefetching
  const bool v2 = g_attn_v2.load(std::memory_order_relaxed);
  const int64_t pf_ahead = v2 ? g_pf_ahead.load(std::memory_order_relaxed) : 16;
  (void)pf_ahead;
  auto body = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc;
    std::vector<float> qf;  // this (sequence, kv head)'s G query rows in fp32, converted once
    std::vector<at::BFloat16> qb;  // the same rows in bf16 (AVX-512 bf16 dot products)
    std::vector<uint32_t> pb;  // the softmax weights as bf16 pairs (AVX-512, bf16 query and cache)
    bool prefetched_next = false;  // v2: this task's K and V were prefetched during the previous one
    for (int64_t task = begin; task < end; ++task) {
      const int64_t d = task / kvh, h = task % kvh;
      const int64_t ctx = lens[d];
      const int64_t start = (window > 0 && ctx > window) ? ctx - window : 0;
      const int64_t n = ctx - start;
      scores.resize(G * n);
      acc.assign(G * hd, 0.f);
      const int64_t* row = bt + d * MB;
      // v2: the next task's K and V, prefetched into L2 during this task (AVX-512 path), so that its pass 1
      // skips its own in-pass prefetches (`prefetched`)
      NextK nk;
      NextK* nkp = nullptr;
      const bool prefetched = v2 && prefetched_next;
      prefetched_next = false;
#ifdef TM_AVX512
      if (v2 && task + 1 < end && hd % 16 == 0 && (bs & (bs - 1)) == 0) {
        const int64_t d2 = (task + 1) / kvh, ctx2 = lens[d2];
        const int64_t s2 = (window > 0 && ctx2 > window) ? ctx2 - window : 0;
        nk.base = reinterpret_cast<const char*>(kp);
        nk.vbase = reinterpret_cast<const char*>(vp);
        nk.row = bt + d2 * MB;
        nk.kvh = kvh;
        nk.h = (task + 1) % kvh;
        nk.chunk = bs * hd * (int64_t)sizeof(T);
        nk.b0 = nk.b = s2 / bs;
        nk.b1 = (ctx2 + bs - 1) / bs;
        nkp = &nk;
        prefetched_next = true;
      }
#endif
      (void)nkp;
      (void)prefetched;
      qf.resize(G * hd);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t e = 0; e < hd; ++e) qf[g * hd + e] = to_f(qp[d * qs0 + (h * G + g) * qs1 + e]);
#ifdef TM_AVX2
      const bool vec = hd % 8 == 0;
#else
      const bool vec = false;
#endif
      bool fast = false;  // AVX-512: 16 tokens' scores at a time
#ifdef TM_AVX512
      if (hd % 16 == 0 && (bs & (bs - 1)) == 0) {
        fast = true;

        if constexpr (std::is_same<TQ, at::BFloat16>::value && std::is_same<T, at::BFloat16>::value) {
          if (hd % 32 == 0 && hd <= 128) {
            qb.resize(G * hd);
            for (int64_t g = 0; g < G; ++g)
              std::memcpy(qb.data() + g * hd, qp + d * qs0 + (h * G + g) * qs1, hd * sizeof(at::BFloat16));
            scores16<true, T>(nullptr, qb.data(), kp, vp, row, ksc, kvh, h, bs, hd, start, ctx, G, fscale,
                              scores.data(), n, pf_ahead, nkp, !prefetched);
          } else {
            scores16<false, T>(qf.data(), nullptr, kp, vp, row, ksc, kvh, h, bs, hd, start, ctx, G, fscale,
                               scores.data(), n, pf_ahead, nkp, !prefetched);
          }
        } else {
          scores16<false, T>(qf.data(), nullptr, kp, vp, row, ksc, kvh, h, bs, hd, start, ctx, G, fscale,
                             scores.data(), n, pf_ahead, nkp, !prefetched);
        }
      }
#endif
      // pass 1: scores[g][t] = q_g . k_t * scale; block by block, each head's rows contiguous
      for (int64_t b = start / bs; !fast && b * bs < ctx; ++b) {
        const int64_t t0 = std::max(start, b * bs), t1 = std::min(ctx, (b + 1) * bs);
        const T* kb = kp + (row[b] * kvh + h) * bs * hd;
        const float bscale = ksc ? fscale * ksc[row[b] * kvh + h] : fscale;  // int8: the block's K scale
        if ((b + 1) * bs < ctx) {  // the next block lives elsewhere in memory: fetch it while we compute
          const T* nk = kp + (row[b + 1] * kvh + h) * bs * hd;
          for (int64_t off = 0; off < bs * hd; off += line) __builtin_prefetch(nk + off, 0, 3);
        }
        {  // this block's V rows, for pass 2 (a (sequence, head)'s V fits in L2)
          const T* vb = vp + (row[b] * kvh + h) * bs * hd;
          for (int64_t off = 0; off < bs * hd; off += line) __builtin_prefetch(vb + off, 0, 2);
        }
        for (int64_t t = t0; t < t1; ++t) {
          const T* kt = kb + (t - b * bs) * hd;
#ifdef TM_AVX2
          if (vec && (G == 2 || G == 4 || G == 8)) {
            float sg[8];
            if (G == 2) scores_shared_k<2>(qf.data(), kt, hd, sg);
            else if (G == 4) scores_shared_k<4>(qf.data(), kt, hd, sg);
            else scores_shared_k<8>(qf.data(), kt, hd, sg);
            for (int64_t g = 0; g < G; ++g) scores[g * n + (t - start)] = sg[g] * bscale;
            continue;
          }
#endif
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * hd;
            float s = 0.f;
#ifdef TM_AVX2
            if (vec) {
              __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
              int64_t e = 0;
              for (; e + 16 <= hd; e += 16) {
                a0 = _mm256_fmadd_ps(load8(qg + e), load8(kt + e), a0);
                a1 = _mm256_fmadd_ps(load8(qg + e + 8), load8(kt + e + 8), a1);
              }
              for (; e < hd; e += 8) a0 = _mm256_fmadd_ps(load8(qg + e), load8(kt + e), a0);
              s = hsum256(_mm256_add_ps(a0, a1));
            } else
#endif
            {
              for (int64_t e = 0; e < hd; ++e) s += to_f(qg[e]) * to_f(kt[e]);
            }
            scores[g * n + (t - start)] = s * bscale;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax_row(scores.data() + g * n, n, v2);
      // pass 2: acc[g] = sum_t p[g][t] v_t
#ifdef TM_AVX512
      bool dp = false;
      if constexpr (std::is_same<TQ, at::BFloat16>::value && std::is_same<T, at::BFloat16>::value) {
        if (fast && hd % 32 == 0) {
          int64_t np;
          weights_to_bf16_pairs(scores.data(), G, n, pb, np);
          dp = attend_v_dp_dispatch(G, vp, row, kvh, h, bs, hd, start, n, pb.data(), np, acc.data(), nkp);
        }
      }
      const bool tiled = dp || attend_v16_dispatch<T>(G, vp, row, vsc, kvh, h, bs, hd, start, ctx, scores.data(), n,
                                                acc.data(), nkp) ||
                         (vec && attend_v_dispatch<T>(G, vp, row, vsc, kvh, h, bs, hd, start, ctx, scores.data(), n,
                                                      acc.data()));
#elif defined(TM_AVX2)
      const bool tiled = vec && attend_v_dispatch<T>(G, vp, row, vsc, kvh, h, bs, hd, start, ctx, scores.data(), n,
                                                     acc.data());
#else
      const bool tiled = false;
#endif
      for (int64_t b = start / bs; !tiled && b * bs < ctx; ++b) {
        const int64_t t0 = std::max(start, b * bs), t1 = std::min(ctx, (b + 1) * bs);
        const T* vb = vp + (row[b] * kvh + h) * bs * hd;
        const float vs = vsc ? vsc[row[b] * kvh + h] : 1.f;  // int8: the block's V scale, folded into p
        for (int64_t t = t0; t < t1; ++t) {
          const T* vt = vb + (t - b * bs) * hd;
#ifdef TM_AVX2
          if (vec && G <= 8) {  // each V chunk is loaded (and converted) once for all G query heads
            __m256 pv[8];
            for (int64_t g = 0; g < G; ++g) pv[g] = _mm256_set1_ps(scores[g * n + (t - start)] * vs);
            for (int64_t e = 0; e < hd; e += 8) {
              const __m256 v8 = load8(vt + e);
              for (int64_t g = 0; g < G; ++g) {
                float* ag = acc.data() + g * hd + e;
                _mm256_storeu_ps(ag, _mm256_fmadd_ps(pv[g], v8, _mm256_loadu_ps(ag)));
              }
            }
            continue;
          }
#endif
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * n + (t - start)] * vs;
            float* ag = acc.data() + g * hd;
            for (int64_t e = 0; e < hd; ++e) ag[e] += p * to_f(vt[e]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        TQ* o = op + d * os0 + (h * G + g) * os1;
        for (int64_t e = 0; e < hd; ++e) o[e] = from_f<TQ>(acc[g * hd + e]);
      }
    }
  };
  // run tasks [0, ntask) of fn: with v2 and several threads, split into contiguous ranges of about equal cost
  // (task_cost(t): tokens read + a fixed cost per task)
  auto run_tasks = [&](int64_t ntask, auto task_cost, auto fn) {
    const int64_t nthr = std::min<int64_t>(at::get_num_threads(), ntask);
    if (!v2 || nthr <= 1) {
      at::parallel_for(0, ntask, 1, fn);
      return;
    }
    std::vector<int64_t> cost(ntask + 1, 0);
    for (int64_t t = 0; t < ntask; ++t) cost[t + 1] = cost[t] + task_cost(t);
    std::vector<int64_t> cut(nthr + 1, ntask);
    cut[0] = 0;
    for (int64_t c = 1, t = 0; c < nthr; ++c) {
      const int64_t goal = cost[ntask] * c / nthr;
      while (t < ntask && cost[t + 1] <= goal) ++t;
      cut[c] = std::max(cut[c - 1], t);
    }
    at::parallel_for(0, nthr, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c)
        if (cut[c] < cut[c + 1]) fn(cut[c], cut[c + 1]);
    });
  };
#ifdef TM_AVX512
  // Grouped rows (bf16 query and cache): consecutive rows that read the same blocks with non-decreasing contexts
  // (a verify step's k + 1 rows of one sequence) run as one task per kv head, so each K and V vector is loaded
  // once for all their query heads instead of once per row; every row's scores, softmax, weights and pass-2
  // accumulation are the per-row path's operations in the same order (scores16 and softmax_row per row,
  // attend_v_dp_rows), so each row gets the same bits as alone. Off: TOKENMILL_DECODE_ATTN_GROUP=0.
  if constexpr (std::is_same<TQ, at::BFloat16>::value && std::is_same<T, at::BFloat16>::value) {
    const bool can = g_attn_group.load(std::memory_order_relaxed) && ksc == nullptr && hd % 32 == 0 &&
                     (bs & (bs - 1)) == 0 && hd <= 128 &&
                     (G == 1 || G == 2 || G == 4 || G == 8);  // attend_v_dp's row counts (others: attend_v16)
    std::vector<int64_t> gs;  // group starts, then D
    bool any = false;
    if (can && D > 1) {
      const int64_t rmax = std::max<int64_t>(1, 32 / G);  // at most 32 query rows per task
      for (int64_t d = 0; d < D;) {
        int64_t r = 1;
        while (d + r < D && r < rmax && lens[d + r] >= lens[d + r - 1] && (window <= 0 || lens[d + r] <= window) &&
               (window <= 0 || lens[d] <= window) &&
               std::memcmp(bt + (d + r) * MB, bt + (d + r - 1) * MB,
                           sizeof(int64_t) * std::min<int64_t>(MB, (lens[d + r - 1] + bs - 1) / bs)) == 0)
          ++r;
        gs.push_back(d);
        any = any || r > 1;
        d += r;
      }
      gs.push_back(D);
    }
    if (any) {
      const int64_t ng = (int64_t)gs.size() - 1;
      auto gbody = [&](int64_t begin, int64_t end) {
        std::vector<float> scores, acc;
        std::vector<at::BFloat16> qb;
        std::vector<uint32_t> pb;
        for (int64_t gt = begin; gt < end; ++gt) {
          const int64_t gi = gt / kvh, h = gt % kvh, d0 = gs[gi], R = gs[gi + 1] - d0;
          if (R == 1) {
            body(d0 * kvh + h, d0 * kvh + h + 1);
            continue;
          }
          const int64_t RG = R * G, n = lens[d0 + R - 1];  // the last row reads the most tokens
          const int64_t* row = bt + (d0 + R - 1) * MB;
          qb.resize(RG * hd);
          for (int64_t r = 0; r < R; ++r)
            for (int64_t g = 0; g < G; ++g)
              std::memcpy(qb.data() + (r * G + g) * hd, qp + (d0 + r) * qs0 + (h * G + g) * qs1,
                          hd * sizeof(at::BFloat16));
          scores.resize(RG * n);
          scores16<true, T>(nullptr, qb.data(), kp, vp, row, nullptr, kvh, h, bs, hd, 0, n, RG, fscale,
                            scores.data(), n, pf_ahead, nullptr, true);
          const int64_t np = (n + 1) / 2;
          pb.assign(RG * np, 0u);
          for (int64_t r = 0; r < R; ++r)
            for (int64_t g = 0; g < G; ++g) {
              float* sg = scores.data() + (r * G + g) * n;
              softmax_row(sg, lens[d0 + r], v2);
              row_to_bf16(sg, lens[d0 + r], reinterpret_cast<uint16_t*>(pb.data() + (r * G + g) * np));
            }
          acc.resize(RG * hd);
          for (int64_t j0 = 0; j0 < RG; j0 += 8) {  // 8 query rows per pass over V
            int64_t nr[8];
            for (int j = 0; j < 8; ++j) nr[j] = j0 + j < RG ? lens[d0 + (j0 + j) / G] : 0;
            attend_v_dp_rows<8>(vp, row, kvh, h, bs, hd, nr, pb.data() + j0 * np, np, acc.data() + j0 * hd);
          }
          for (int64_t r = 0; r < R; ++r)
            for (int64_t g = 0; g < G; ++g) {
              at::BFloat16* o = op + (d0 + r) * os0 + (h * G + g) * os1;
              const float* a = acc.data() + (r * G + g) * hd;
              for (int64_t e = 0; e < hd; ++e) o[e] = from_f<at::BFloat16>(a[e]);
            }
        }
      };
      run_tasks(ng * kvh, [&](int64_t t) {
        const int64_t gi = t / kvh, R = gs[gi + 1] - gs[gi];
        return lens[gs[gi + 1] - 1] * (R + 3) / 4 + 32;
      }, gbody);
      return;
    }
  }
#endif
  run_tasks(D * kvh, [&](int64_t t) {
    const int64_t c = lens[t / kvh];
    return std::min<int64_t>(c, window > 0 ? window : c) + 32;
  }, body);
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor ctx_lens, double scale, int64_t window,
                            c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales) {
  // the KV cache may be stored in another dtype than the activations (--kv-cache-dtype)
  if (k_cache.scalar_type() == at::kChar) {  // int8 KV: one fp32 scale per (block, kv head), for K and for V
    TORCH_CHECK(k_scales.has_value() && v_scales.has_value(), "paged_decode_attention: an int8 cache needs its scales");
    TORCH_CHECK(k_scales->scalar_type() == at::kFloat && v_scales->scalar_type() == at::kFloat &&
                k_scales->is_contiguous() && v_scales->is_contiguous() &&
                k_scales->numel() == k_cache.size(0) * k_cache.size(1) &&
                v_scales->numel() == v_cache.size(0) * v_cache.size(1), "int8 KV scales: [NB, kvh] fp32, contiguous");
    const float* ks = k_scales->data_ptr<float>();
    const float* vs = v_scales->data_ptr<float>();
    TM_DISPATCH(q, "paged_decode_attention", [&] {
      paged_decode_attention_impl<scalar_t, int8_t>(out, q, k_cache, v_cache, block_tables, ctx_lens, scale, window,
                                                    ks, vs);
    });
    return;
  }
  TM_DISPATCH(q, "paged_decode_attention", [&] {
    using q_t = scalar_t;
    TM_DISPATCH(k_cache, "paged_decode_attention (cache)", [&] {
      paged_decode_attention_impl<q_t, scalar_t>(out, q, k_cache, v_cache, block_tables, ctx_lens, scale, window,
                                                 nullptr, nullptr);
    });
  });
}


// ---- fused elementwise ops of the decoder layer (rows of a [T, dim] activation; fp32 or bf16 storage,
// fp32 math; bf16 results are rounded where transformers' bf16 modules round) ----

template <typename T>
static inline float sumsq(const T* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef TM_AVX2
  __m256 a = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) { __m256 v = load8(x + i); a = _mm256_fmadd_ps(v, v, a); }
  s = hsum256(a);
#endif
  for (; i < n; ++i) s += to_f(x[i]) * to_f(x[i]);
  return s;
}

// out = w * T(x * rsqrt(mean(x^2) + eps)); with `residual` given, first x += residual (in place, in T)
template <typename T>
static void rms_norm_impl(torch::Tensor out, torch::Tensor x, c10::optional<torch::Tensor> residual,
                          torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && w.is_contiguous(), "contiguous");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && w.scalar_type() == x.scalar_type(), "dtypes differ");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const T* rp = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->scalar_type() == x.scalar_type(), "residual layout");
    rp = residual->data_ptr<T>();
  }
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * dim;
      if (rp) {
        const T* rr = rp + r * dim;
        int64_t i = 0;
#ifdef TM_AVX2
        for (; i + 8 <= dim; i += 8) store8(xr + i, _mm256_add_ps(load8(xr + i), load8(rr + i)));
#endif
        for (; i < dim; ++i) xr[i] = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
      }
      const float inv = 1.f / std::sqrt(sumsq(xr, dim) / (float)dim + (float)eps);
      T* o = op + r * dim;
      int64_t i = 0;
#ifdef TM_AVX2
      const __m256 iv = _mm256_set1_ps(inv);
      for (; i + 8 <= dim; i += 8) {  // the scalar loop's math: the normed x rounded to T, then times w
        const __m256 xn = std::is_same<T, float>::value ? _mm256_mul_ps(load8(xr + i), iv)
                                                        : round_bf16_8(_mm256_mul_ps(load8(xr + i), iv));
        store8(o + i, _mm256_mul_ps(load8(wp + i), xn));
      }
#endif
      for (; i < dim; ++i) o[i] = from_f<T>(to_f(wp[i]) * to_f(from_f<T>(to_f(xr[i]) * inv)));
    }
  });
}

void rms_norm(torch::Tensor out, torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor w,
              double eps) {
  TM_DISPATCH(x, "rms_norm", [&] { rms_norm_impl<scalar_t>(out, x, residual, w, eps); });
}

// out[t, i] = silu(gu[t, i]) * gu[t, I + i]   (gu: [T, 2I], the fused gate_up projection)
template <typename T>
static void silu_mul_impl(torch::Tensor out, torch::Tensor gu) {
  TORCH_CHECK(gu.is_contiguous() && out.is_contiguous() && out.scalar_type() == gu.scalar_type(), "layout");
  const int64_t I = out.size(-1), rows = out.numel() / I;
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * 2 * I;
      const T* u = g + I;
      T* o = op + r * I;
      int64_t i = 0;
#ifdef TM_AVX512
      {  // 16 lanes, lane for lane the 8-lane loop's operations (exp512 = exp256's): the same bits
        const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
        for (; i + 16 <= I; i += 16) {
          __m512 gv = load16(g + i);
          __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(zero, gv))));
          store16_rne(o + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), load16(u + i)));
        }
      }
#endif
#ifdef TM_AVX2
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; i + 8 <= I; i += 8) {
        __m256 gv = load8(g + i);
        __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
        store8(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), load8(u + i)));
      }
#endif
      for (; i < I; ++i) {
        const float gf = to_f(g[i]);
        o[i] = from_f<T>(gf / (1.f + std::exp(-gf)) * to_f(u[i]));
      }
    }
  });
}

void silu_mul(torch::Tensor out, torch::Tensor gu) {
  TM_DISPATCH(gu, "silu_mul", [&] { silu_mul_impl<scalar_t>(out, gu); });
}

// neox rotary embedding in place on x [T, heads, hd] (any row/head stride, contiguous last dim):
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, halves of hd; cos/sin: [max_pos, hd/2] fp32
template <typename T>
static void rope_inplace_impl(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous(), "layout");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "fp32 rotary table");
  const int64_t T_ = x.size(0), H = x.size(1), half = x.size(2) / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* xp = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the rotary table");
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      for (int64_t h = 0; h < H; ++h) {
        T* x1 = xp + t * s0 + h * s1;
        T* x2 = x1 + half;
        int64_t i = 0;
#ifdef TM_AVX2
        for (; i + 8 <= half; i += 8) {
          const __m256 a = load8(x1 + i), b = load8(x2 + i), cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
          store8(x1 + i, _mm256_fmsub_ps(a, cv, _mm256_mul_ps(b, sv)));
          store8(x2 + i, _mm256_fmadd_ps(b, cv, _mm256_mul_ps(a, sv)));
        }
#endif
        for (; i < half; ++i) {
          const float a = to_f(x1[i]), b = to_f(x2[i]);
          x1[i] = from_f<T>(a * c[i] - b * s[i]);
          x2[i] = from_f<T>(b * c[i] + a * s[i]);
        }
      }
    }
  });
}

void rope_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TM_DISPATCH(x, "rope_inplace", [&] { rope_inplace_impl<scalar_t>(x, positions, cos, sin); });
}


// cache[blk, h, off, :] = kv[t, h, :] for K and V, with slot = blk * bs + off per new token
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1,
              "layout");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
              k.scalar_type() == v.scalar_type(), "K/V and the cache must share a dtype");
  const int64_t T = k.size(0), kvh = k.size(1), hd = k.size(2);
  const int64_t NB = k_cache.size(0), bs = k_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < NB * bs, "slot out of range");
  const int64_t es = k.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t blk = slots[t] / bs, off = slots[t] % bs;
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t dst = ((blk * kvh + h) * bs + off) * hd;
      std::memcpy(kc + dst * es, kp + (t * k.stride(0) + h * k.stride(1)) * es, hd * es);
      std::memcpy(vc + dst * es, vp + (t * v.stride(0) + h * v.stride(1)) * es, hd * es);
    }
  }
}


// ---- int8 KV cache writes: one fp32 scale per (block, kv head) for K and for V (scheme: attention.Int8KVCache) ----
// Tokens of a block are written in position order, so when new tokens land at offsets >= o0 of a block, the
// block's valid content is its rows [0, o0) (o0 == 0: a fresh block, any old scale is stale). The block's scale
// becomes max(old scale, absmax(new rows) / 127); if it grew, the valid rows are requantized to the new scale
// first (|q| only shrinks: no saturation ever), then the new rows are quantized with it.
template <typename T>
static void write_kv_int8_impl(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scales,
                               torch::Tensor v_scales, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping) {
  const int64_t T_ = k.size(0), kvh = k.size(1), hd = k.size(2);
  const int64_t NB = k_cache.size(0), bs = k_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < NB * bs, "slot out of range");
  // group the new tokens by block (a stable sort keeps their order: a slot written twice keeps the last value)
  std::vector<int64_t> order(T_);
  for (int64_t t = 0; t < T_; ++t) order[t] = t;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return slots[a] / bs < slots[b] / bs; });
  std::vector<int64_t> gstart;
  for (int64_t i = 0; i < T_; ++i)
    if (i == 0 || slots[order[i]] / bs != slots[order[i - 1]] / bs) gstart.push_back(i);
  gstart.push_back(T_);
  const int64_t ngroups = (int64_t)gstart.size() - 1;
  int8_t* caches[2] = {k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>()};
  float* scales[2] = {k_scales.data_ptr<float>(), v_scales.data_ptr<float>()};
  const T* src[2] = {k.data_ptr<T>(), v.data_ptr<T>()};
  const int64_t st0[2] = {k.stride(0), v.stride(0)}, st1[2] = {k.stride(1), v.stride(1)};
  at::parallel_for(0, ngroups * kvh * 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t which = task % 2, h = (task / 2) % kvh, grp = task / (2 * kvh);
      const int64_t i0 = gstart[grp], i1 = gstart[grp + 1];
      const int64_t blk = slots[order[i0]] / bs;
      int64_t o0 = bs;
      float amax = 0.f;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = order[i];
        o0 = std::min(o0, slots[t] % bs);
        const T* x = src[which] + t * st0[which] + h * st1[which];
        for (int64_t e = 0; e < hd; ++e) amax = std::max(amax, std::fabs(to_f(x[e])));
      }
      float* sp = scales[which] + blk * kvh + h;
      int8_t* base = caches[which] + (blk * kvh + h) * bs * hd;
      float s = amax / 127.f;
      if (o0 > 0) {
        const float old = *sp;
        if (s > old) {  // the scale grows: requantize the valid rows [0, o0)
          const float ratio = old / s;
          for (int64_t e = 0; e < o0 * hd; ++e) base[e] = (int8_t)std::nearbyint((float)base[e] * ratio);
        } else {
          s = old;
        }
      }
      *sp = s;
      const float inv = s > 0.f ? 1.f / s : 0.f;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = order[i];
        const T* x = src[which] + t * st0[which] + h * st1[which];
        int8_t* qr = base + (slots[t] % bs) * hd;
        int64_t e = 0;
#ifdef TM_AVX2
        const __m256 iv = _mm256_set1_ps(inv);
        const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
        for (; e + 8 <= hd; e += 8) {  // round to nearest even, clamp to +-127, pack to 8 bytes
          __m256i i32 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + e), iv));
          i32 = _mm256_min_epi32(_mm256_max_epi32(i32, lo), hi);
          const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(qr + e), _mm_packs_epi16(i16, i16));
        }
#endif
        for (; e < hd; ++e) qr[e] = (int8_t)std::nearbyint(std::min(127.f, std::max(-127.f, to_f(x[e]) * inv)));
      }
    }
  });
}

void write_kv_int8(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scales, torch::Tensor v_scales,
                   torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k_scales.is_contiguous() && v_scales.is_contiguous(), "write_kv_int8: layout");
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar &&
              k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat &&
              k.scalar_type() == v.scalar_type(), "write_kv_int8: int8 caches, fp32 scales, K and V of one dtype");
  TORCH_CHECK(k_scales.numel() == k_cache.size(0) * k_cache.size(1) &&
              v_scales.numel() == v_cache.size(0) * v_cache.size(1), "write_kv_int8: scales are [NB, kvh]");
  TM_DISPATCH(k, "write_kv_int8", [&] { write_kv_int8_impl<scalar_t>(k_cache, v_cache, k_scales, v_scales, k, v,
                                                                      slot_mapping); });
}


// y[m, :] = W x[m, :] (+ b) for a few rows m (decode at small batch): streams W [N, K] once, row by row,
// with every x row held in L1, so the weight read runs near the memory bandwidth (memory-bound regime,
// where blocked GEMMs leave bandwidth unused). Parallel over output rows. bf16 weights halve the bytes read.
#ifdef TM_AVX2
// R weight rows x M input rows per pass: R*M = 8 independent accumulator chains (FMA latency hidden)
template <int M, int R, typename T>
static void linear_small_rows(const T* xp, const T* wp, T* op, const T* bp, int64_t K, int64_t N,
                              int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m256 a[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) a[r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      __m256 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = load8(xp + m * K + k);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = load8(wp + (n + r) * K + k);
        for (int m = 0; m < M; ++m) a[r][m] = _mm256_fmadd_ps(wv, xv[m], a[r][m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) op[m * N + n + r] = from_f<T>(hsum256(a[r][m]) + (bp ? to_f(bp[n + r]) : 0.f));
  }
  for (; n < n1; ++n)  // leftover rows
    for (int m = 0; m < M; ++m) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 8) a = _mm256_fmadd_ps(load8(wp + n * K + k), load8(xp + m * K + k), a);
      op[m * N + n] = from_f<T>(hsum256(a) + (bp ? to_f(bp[n]) : 0.f));
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bf16 weights and inputs on CPUs with bf16 dot products: vdpbf16ps multiplies 32 bf16 pairs per instruction
// into 16 fp32 sums (no conversion step), so the weight stream stays at memory speed
template <int M, int R>
static void linear_small_rows_dpbf16(const at::BFloat16* xp, const at::BFloat16* wp, at::BFloat16* op,
                                     const at::BFloat16* bp, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 a[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) a[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(xp + m * K + k);
      for (int r = 0; r < R; ++r) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wp + (n + r) * K + k);
        for (int m = 0; m < M; ++m) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv, xv[m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        op[m * N + n + r] = at::BFloat16(_mm512_reduce_add_ps(a[r][m]) + (bp ? to_f(bp[n + r]) : 0.f));
  }
  for (; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(wp + n * K + k), (__m512bh)_mm512_loadu_si512(xp + m * K + k));
      op[m * N + n] = at::BFloat16(_mm512_reduce_add_ps(a) + (bp ? to_f(bp[n]) : 0.f));
    }
}

static bool linear_small_dpbf16(const at::BFloat16* xp, const at::BFloat16* wp, at::BFloat16* op,
                                const at::BFloat16* bp, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  if (K % 32) return false;
  switch (M) {
    case 1: linear_small_rows_dpbf16<1, 8>(xp, wp, op, bp, K, N, n0, n1); break;
    case 2: linear_small_rows_dpbf16<2, 4>(xp, wp, op, bp, K, N, n0, n1); break;
    case 3: linear_small_rows_dpbf16<3, 2>(xp, wp, op, bp, K, N, n0, n1); break;
    case 4: linear_small_rows_dpbf16<4, 2>(xp, wp, op, bp, K, N, n0, n1); break;
    case 5: linear_small_rows_dpbf16<5, 1>(xp, wp, op, bp, K, N, n0, n1); break;
    case 6: linear_small_rows_dpbf16<6, 1>(xp, wp, op, bp, K, N, n0, n1); break;
    case 7: linear_small_rows_dpbf16<7, 1>(xp, wp, op, bp, K, N, n0, n1); break;
    default: linear_small_rows_dpbf16<8, 1>(xp, wp, op, bp, K, N, n0, n1); break;
  }
  return true;
}
#endif

template <typename T>
static void linear_small_impl(torch::Tensor out, torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "contiguous");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type() &&
              (!bias.has_value() || bias->scalar_type() == x.scalar_type()), "x, W, b and out must share a dtype");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && out.size(0) == M && out.size(1) == N && M >= 1 && M <= 8, "shapes");
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if constexpr (std::is_same<T, at::BFloat16>::value) {
      if (linear_small_dpbf16(xp, wp, op, bp, M, K, N, n0, n1)) return;
    }
#endif
#ifdef TM_AVX2
    if (K % 8 == 0) {
      switch (M) {
        case 1: return linear_small_rows<1, 8>(xp, wp, op, bp, K, N, n0, n1);
        case 2: return linear_small_rows<2, 4>(xp, wp, op, bp, K, N, n0, n1);
        case 3: return linear_small_rows<3, 2>(xp, wp, op, bp, K, N, n0, n1);
        case 4: return linear_small_rows<4, 2>(xp, wp, op, bp, K, N, n0, n1);
        case 5: return linear_small_rows<5, 1>(xp, wp, op, bp, K, N, n0, n1);
        case 6: return linear_small_rows<6, 1>(xp, wp, op, bp, K, N, n0, n1);
        case 7: return linear_small_rows<7, 1>(xp, wp, op, bp, K, N, n0, n1);
        default: return linear_small_rows<8, 1>(xp, wp, op, bp, K, N, n0, n1);
      }
    }
#endif
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += to_f(xp[m * K + k]) * to_f(wp[n * K + k]);
        op[m * N + n] = from_f<T>(s + (bp ? to_f(bp[n]) : 0.f));
      }
  });
}

// y[m, :] = W x[m, :] (+ b) for a few rows m (decode at small batch): streams W [N, K] once, in order,
// with the x rows held in L1, so the weight read runs near the memory bandwidth (the memory-bound regime,
// where blocked GEMMs leave bandwidth unused). Parallel over output rows.
void linear_small(torch::Tensor out, torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TM_DISPATCH(x, "linear_small", [&] { linear_small_impl<scalar_t>(out, x, w, bias); });
}

// ---- batch-invariant bf16 linear (any number of rows) ----
// y[m, n] computed exactly as linear_small computes it for a bf16 row on an AVX-512 BF16 CPU: one 16-lane fp32
// accumulator over K in steps of 32 (vdpbf16ps, weight operand first), _mm512_reduce_add_ps, + bias, rounded to
// bf16. So each output row is the same bits whatever the number of rows in the call: a decode token computed in
// a batch of 1, 8 or 64 rows, or beside k speculative tokens, or inside a prefill chunk, gets one answer (oneDNN
// picks its blocking, and with it the reduction order, by the row count). The register tile (MT rows x RT weight
// rows) only decides which accumulators live together, never the order of any one sum.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
template <int MT, int RT>
static inline void linear_rows_tile(const at::BFloat16* xp, const at::BFloat16* wp, at::BFloat16* op,
                                    const at::BFloat16* bp, int64_t K, int64_t N, int64_t m0, int64_t n) {
  __m512 a[RT][MT];
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) a[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(xp + (m0 + m) * K + k);
    for (int r = 0; r < RT; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wp + (n + r) * K + k);
      for (int m = 0; m < MT; ++m) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv, xv[m]);
    }
  }
  if constexpr (MT == 4 && RT == 4) {
    // the 16 horizontal sums at once, in _mm512_reduce_add_ps's own tree (halves 256 + 256, then 128 + 128,
    // then lanes (0+2, 1+3), then 0 + 1; float addition commutes, so only the pairing matters)
    __m512 tv[4];
    for (int r = 0; r < 4; ++r) {
      __m512 s2[2];
      for (int p = 0; p < 2; ++p) {  // [a_m.lo256 + a_m.hi256, a_m+1.lo256 + a_m+1.hi256]
        const __m512 u = a[r][2 * p], v = a[r][2 * p + 1];
        s2[p] = _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x44), _mm512_shuffle_f32x4(u, v, 0xEE));
      }
      // [q0 + q1 of each of the 4 accumulators' 256-bit sums]
      __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x88), _mm512_shuffle_f32x4(s2[0], s2[1], 0xDD));
      t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));  // lanes (0 + 2, 1 + 3) of each 128-bit block
      t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));  // lane 0 + lane 1
      tv[r] = t;
    }
    // lane 4m + r <- weight row r's sum for x row m (lane 4m of tv[r]); + bias (0.f without: as the scalar
    // epilogue, so -0 sums become +0), rounded to bf16 in one instruction, each x row's 4 outputs one 8-byte store
    const __m512i base4 = _mm512_set_epi32(12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0);
    __m512 u = tv[0];
    u = _mm512_mask_permutexvar_ps(u, 0x2222, base4, tv[1]);
    u = _mm512_mask_permutexvar_ps(u, 0x4444, base4, tv[2]);
    u = _mm512_mask_permutexvar_ps(u, 0x8888, base4, tv[3]);
    const __m128 b4 = bp ? _mm_set_ps(to_f(bp[n + 3]), to_f(bp[n + 2]), to_f(bp[n + 1]), to_f(bp[n])) : _mm_setzero_ps();
    u = _mm512_add_ps(u, _mm512_broadcast_f32x4(b4));
    // vcvtneps2bf16 flushes denormal inputs to zero where at::BFloat16 keeps them: such a tile (never seen in a
    // model; |y| < 1.2e-38) takes the scalar conversion, so the bits stay linear_small's
    const __m512 mag = _mm512_abs_ps(u);
    if (_mm512_cmp_ps_mask(mag, _mm512_set1_ps(std::numeric_limits<float>::min()), _CMP_LT_OQ) &
        _mm512_cmp_ps_mask(mag, _mm512_setzero_ps(), _CMP_GT_OQ)) {
      float sums[16];
      _mm512_storeu_ps(sums, u);
      for (int m = 0; m < 4; ++m)
        for (int r = 0; r < 4; ++r) op[(m0 + m) * N + n + r] = at::BFloat16(sums[4 * m + r]);
      return;
    }
    alignas(32) uint64_t packed[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(packed), (__m256i)_mm512_cvtneps_pbh(u));
    for (int m = 0; m < 4; ++m) std::memcpy(op + (m0 + m) * N + n, &packed[m], 8);
    return;
  }
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m)
      op[(m0 + m) * N + n + r] = at::BFloat16(_mm512_reduce_add_ps(a[r][m]) + (bp ? to_f(bp[n + r]) : 0.f));
}

template <int RT>
static inline void linear_rows_strip(const at::BFloat16* xp, const at::BFloat16* wp, at::BFloat16* op,
                                     const at::BFloat16* bp, int64_t m, int64_t M, int64_t K, int64_t N, int64_t n) {
  for (; m + 4 <= M; m += 4) linear_rows_tile<4, RT>(xp, wp, op, bp, K, N, m, n);
  switch (M - m) {
    case 3: linear_rows_tile<3, RT>(xp, wp, op, bp, K, N, m, n); break;
    case 2: linear_rows_tile<2, RT>(xp, wp, op, bp, K, N, m, n); break;
    case 1: linear_rows_tile<1, RT>(xp, wp, op, bp, K, N, m, n); break;
    default: break;
  }
}
#endif

// Returns false (nothing written) where the kernel does not apply: not bf16, K % 32 != 0, or no AVX-512 BF16.
bool linear_rows_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (x.scalar_type() != at::kBFloat16 || w.scalar_type() != at::kBFloat16 || out.scalar_type() != at::kBFloat16 ||
      (bias.has_value() && bias->scalar_type() != at::kBFloat16))
    return false;
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous() && x.dim() == 2 && w.dim() == 2,
              "linear_rows_bf16: contiguous 2-D x, W, out");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && out.size(0) == M && out.size(1) == N, "linear_rows_bf16: shapes");
  if (K % 32 || M == 0) return M == 0 && K % 32 == 0;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  // rows of W in strips of 4 (kept in L1 while every x row passes), the x rows in tiles of 4; parallel over W
  const int64_t strips = (N + 3) / 4;
  // grain: ~4096 rows x strips of work per task, but at least two tasks per thread (a 256-wide output at 64 rows
  // was one task: one thread)
  const int64_t grain = std::max<int64_t>(
      1, std::min<int64_t>(4096 / std::max<int64_t>(M, 1), strips / (2 * std::max<int64_t>(1, at::get_num_threads()))));
  // x rows in blocks of ~16 KB (kept in L1 while the task's strips pass; a multiple of the 4-row tile), so x is
  // read from L2 once per block instead of once per strip; only which sums run together changes, not any order
  const int64_t mb = std::max<int64_t>(4, (16384 / (2 * K)) / 4 * 4);
  // and the task's strips in groups of ~256 KB of W (kept in L2 while every x block passes)
  const int64_t nb = std::max<int64_t>(1, 32768 / K);
  at::parallel_for(0, strips, grain, [&](int64_t s0, int64_t s1) {
    for (int64_t sb = s0; sb < s1; sb += nb)
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
      const int64_t m1 = std::min<int64_t>(M, m0 + mb);
      for (int64_t s = sb; s < std::min<int64_t>(s1, sb + nb); ++s) {
        const int64_t n = s * 4;
        switch (std::min<int64_t>(4, N - n)) {
          case 4: linear_rows_strip<4>(xp, wp, op, bp, m0, m1, K, N, n); break;
          case 3: linear_rows_strip<3>(xp, wp, op, bp, m0, m1, K, N, n); break;
          case 2: linear_rows_strip<2>(xp, wp, op, bp, m0, m1, K, N, n); break;
          default: linear_rows_strip<1>(xp, wp, op, bp, m0, m1, K, N, n); break;
        }
      }
    }
  });
  return true;
#else
  (void)out; (void)x; (void)w; (void)bias;
  return false;
#endif
}

// ---- int8 W8A8 (dynamic per-token activation scales, per-output-channel weight scales) ----

// q[m, :] = round(x[m, :] / s[m]) with s[m] = max|x[m, :]| / 127 (1 for an all-zero row); one pass per row
template <typename T>
static void quantize_rows_impl(torch::Tensor q, torch::Tensor scale, torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && q.scalar_type() == at::kChar &&
              scale.scalar_type() == at::kFloat, "quantize_rows: layout");
  const int64_t K = x.size(-1), M = x.numel() / K;
  const T* xp = x.data_ptr<T>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* xr = xp + m * K;
      float amax = 0.f;
      int64_t k = 0;
#ifdef TM_AVX2
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 mx = _mm256_setzero_ps();
      for (; k + 8 <= K; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(xr + k)));
      float lanes[8];
      _mm256_storeu_ps(lanes, mx);
      for (float v : lanes) amax = std::max(amax, v);
#endif
      for (; k < K; ++k) amax = std::max(amax, std::fabs(to_f(xr[k])));
      const float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
      sp[m] = s;
      int8_t* qr = qp + m * K;
      k = 0;
#ifdef TM_AVX2
      const __m256 iv = _mm256_set1_ps(inv);
      for (; k + 8 <= K; k += 8) {  // |x * inv| <= 127 by construction: no clamp needed before the packs
        const __m256i i32 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xr + k), iv));  // round to nearest even
        const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(qr + k), _mm_packs_epi16(i16, i16));
      }
#endif
      for (; k < K; ++k) qr[k] = (int8_t)std::nearbyint(std::min(127.f, std::max(-127.f, to_f(xr[k]) * inv)));
    }
  });
}

void quantize_rows(torch::Tensor q, torch::Tensor scale, torch::Tensor x) {
  TM_DISPATCH(x, "quantize_rows", [&] { quantize_rows_impl<scalar_t>(q, scale, x); });
}

// out[m, n] = acc[m, n] * sx[m] * sw[n] (+ b[n]); acc: the int32 result of the int8 GEMM
template <typename T>
static void dequant_rows_impl(torch::Tensor out, torch::Tensor acc, torch::Tensor sx, torch::Tensor sw,
                              c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(out.is_contiguous() && acc.is_contiguous() && acc.scalar_type() == at::kInt &&
              sx.scalar_type() == at::kFloat && sw.scalar_type() == at::kFloat, "dequant_rows: layout");
  const int64_t M = acc.size(0), N = acc.size(1);
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* sxp = sx.data_ptr<float>();
  const float* swp = sw.data_ptr<float>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float s = sxp[m];
      const int32_t* ar = ap + m * N;
      T* o = op + m * N;
      int64_t n = 0;
#ifdef TM_AVX2
      const __m256 sv = _mm256_set1_ps(s);
      for (; n + 8 <= N; n += 8) {
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(ar + n))), sv),
                                 _mm256_loadu_ps(swp + n));
        if (bp) v = _mm256_add_ps(v, load8(bp + n));
        store8(o + n, v);
      }
#endif
      for (; n < N; ++n) o[n] = from_f<T>((float)ar[n] * s * swp[n] + (bp ? to_f(bp[n]) : 0.f));
    }
  });
}

void dequant_rows(torch::Tensor out, torch::Tensor acc, torch::Tensor sx, torch::Tensor sw,
                  c10::optional<torch::Tensor> bias) {
  TM_DISPATCH(out, "dequant_rows", [&] { dequant_rows_impl<scalar_t>(out, acc, sx, sw, bias); });
}

// y[m, n] = sw[n] * sum_k W8[n, k] x[m, k] (+ b[n]) for at most 8 rows: int8 weights [N, K] streamed once
// (a quarter of fp32's bytes), x kept in fp32 (no activation quantization: decode is memory-bound)
template <typename T>
static void linear_small_int8_impl(torch::Tensor out, torch::Tensor x, torch::Tensor w8, torch::Tensor sw,
                                   c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.is_contiguous() && w8.is_contiguous() && out.is_contiguous() && w8.scalar_type() == at::kChar,
              "linear_small_int8: layout");
  const int64_t M = x.size(0), K = x.size(1), N = w8.size(0);
  TORCH_CHECK(w8.size(1) == K && out.size(0) == M && out.size(1) == N && M >= 1 && M <= 8, "shapes");
  std::vector<float> xf(M * K);
  const T* xp = x.data_ptr<T>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = to_f(xp[i]);
  const int8_t* wp = w8.data_ptr<int8_t>();
  const float* swp = sw.data_ptr<float>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = wp + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xf.data() + m * K;
        float acc = 0.f;
        int64_t k = 0;
#ifdef TM_AVX2
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (; k + 16 <= K; k += 16) {
          const __m128i w16 = _mm_loadu_si128((const __m128i*)(wr + k));
          a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w16)), _mm256_loadu_ps(xr + k), a0);
          a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(w16, 8))),
                               _mm256_loadu_ps(xr + k + 8), a1);
        }
        acc = hsum256(_mm256_add_ps(a0, a1));
#endif
        for (; k < K; ++k) acc += (float)wr[k] * xr[k];
        op[m * N + n] = from_f<T>(acc * swp[n] + (bp ? to_f(bp[n]) : 0.f));
      }
    }
  });
}

void linear_small_int8(torch::Tensor out, torch::Tensor x, torch::Tensor w8, torch::Tensor sw,
                       c10::optional<torch::Tensor> bias) {
  TM_DISPATCH(x, "linear_small_int8", [&] { linear_small_int8_impl<scalar_t>(out, x, w8, sw, bias); });
}

// ---- int8 W8A8 at small batch with int8 dot products (AVX-512 VNNI) ----
// The same product as quantize_rows + torch._int_mm + dequant_rows (bit-identical int32 sums, the same fp32
// epilogue), for at most 8 rows, streaming the int8 weights once: each x row is quantized per token (s = max|x| / 127,
// round to nearest even), shifted to unsigned (u = q + 128) for vpdpbusd (u8 x s8 -> s32, 64 products per
// instruction), and the shift is taken back out with the weight row sums: sum(q w) = sum(u w) - 128 sum(w).
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define TM_VNNI 1
template <int M, int R>
static void linear_small_vnni_rows(const uint8_t* xu, const int8_t* wp, const int32_t* wsum, int32_t* acc_out,
                                   int64_t K, int64_t N, int64_t n0, int64_t n1) {
  // acc_out[m * N + n] receives sum_k q[m, k] W[n, k] (exact int32); the caller dequantizes with dequant_rows
  int64_t n = n0;
  auto finish = [&](int64_t nn, int m, int32_t acc) { acc_out[m * N + nn] = acc - 128 * wsum[nn]; };
  for (; n + R <= n1; n += R) {
    __m512i a[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) a[r][m] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
      __m512i xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(xu + m * K + k);
      for (int r = 0; r < R; ++r) {
        const __m512i wv = _mm512_loadu_si512(wp + (n + r) * K + k);
        for (int m = 0; m < M; ++m) a[r][m] = _mm512_dpbusd_epi32(a[r][m], xv[m], wv);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) finish(n + r, m, _mm512_reduce_add_epi32(a[r][m]));
  }
  for (; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      __m512i a = _mm512_setzero_si512();
      for (int64_t k = 0; k < K; k += 64)
        a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(xu + m * K + k), _mm512_loadu_si512(wp + n * K + k));
      finish(n, m, _mm512_reduce_add_epi32(a));
    }
}
#endif

bool has_vnni_small() {
#ifdef TM_VNNI
  return true;
#else
  return false;
#endif
}

// csrc/decode_gemv.cpp: the same product, weights in address order, one parallel region (false: not applicable)
bool vnni_gemv(torch::Tensor out, torch::Tensor x, torch::Tensor w8, torch::Tensor wsum, torch::Tensor sw,
               c10::optional<torch::Tensor> bias);

template <typename T>
static void linear_small_vnni_impl(torch::Tensor out, torch::Tensor x, torch::Tensor w8, torch::Tensor wsum,
                                   torch::Tensor sw, c10::optional<torch::Tensor> bias) {
#ifdef TM_VNNI
  TORCH_CHECK(x.is_contiguous() && w8.is_contiguous() && out.is_contiguous() && w8.scalar_type() == at::kChar &&
              wsum.scalar_type() == at::kInt && sw.scalar_type() == at::kFloat, "linear_small_vnni: layout");
  const int64_t M = x.size(0), K = x.size(1), N = w8.size(0);
  TORCH_CHECK(w8.size(1) == K && out.size(0) == M && out.size(1) == N && M >= 1 && M <= 8 && K % 64 == 0,
              "linear_small_vnni: shapes (K a multiple of 64, at most 8 rows)");
  if (vnni_gemv(out, x, w8, wsum, sw, bias)) return;
  // quantize the rows exactly as quantize_rows does (same scale, same rounding), then shift to unsigned
  std::vector<int8_t> q(M * K);
  std::vector<float> sx(M);
  std::vector<uint8_t> xu(M * K);
  {
    auto qt = torch::from_blob(q.data(), {M, K}, torch::kChar);
    auto st = torch::from_blob(sx.data(), {M}, torch::kFloat);
    quantize_rows_impl<T>(qt, st, x);
  }
  for (int64_t i = 0; i < M * K; ++i) xu[i] = (uint8_t)((int)q[i] + 128);
  std::vector<int32_t> acc(M * N);
  const int8_t* wp = w8.data_ptr<int8_t>();
  const int32_t* wsp = wsum.data_ptr<int32_t>();
  const uint8_t* xp = xu.data();
  int32_t* ap = acc.data();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: return linear_small_vnni_rows<1, 8>(xp, wp, wsp, ap, K, N, n0, n1);
      case 2: return linear_small_vnni_rows<2, 4>(xp, wp, wsp, ap, K, N, n0, n1);
      case 3: return linear_small_vnni_rows<3, 2>(xp, wp, wsp, ap, K, N, n0, n1);
      case 4: return linear_small_vnni_rows<4, 2>(xp, wp, wsp, ap, K, N, n0, n1);
      case 5: return linear_small_vnni_rows<5, 1>(xp, wp, wsp, ap, K, N, n0, n1);
      case 6: return linear_small_vnni_rows<6, 1>(xp, wp, wsp, ap, K, N, n0, n1);
      case 7: return linear_small_vnni_rows<7, 1>(xp, wp, wsp, ap, K, N, n0, n1);
      default: return linear_small_vnni_rows<8, 1>(xp, wp, wsp, ap, K, N, n0, n1);
    }
  });
  // the int8 GEMM path's own epilogue, so both paths round the same way
  dequant_rows_impl<T>(out, torch::from_blob(ap, {M, N}, torch::kInt), torch::from_blob(sx.data(), {M}, torch::kFloat),
                       sw, bias);
#else
  TORCH_CHECK(false, "linear_small_vnni: this build has no AVX-512 VNNI");
#endif
}

// y = W8A8 product of x [M <= 8, K] and int8 W [N, K] (per-token activation scales, per-channel weight scales
// `sw`, weight row sums `wsum`), as the int8 GEMM path computes it, with the weights streamed once
void linear_small_vnni(torch::Tensor out, torch::Tensor x, torch::Tensor w8, torch::Tensor wsum, torch::Tensor sw,
                       c10::optional<torch::Tensor> bias) {
  TM_DISPATCH(x, "linear_small_vnni", [&] { linear_small_vnni_impl<scalar_t>(out, x, w8, wsum, sw, bias); });
}

// csrc/int8_gemm.cpp
bool avx2_int8_gemv(torch::Tensor out, torch::Tensor x, torch::Tensor w8, torch::Tensor sw,
                    c10::optional<torch::Tensor> bias);
void avx2_int8_gemm(torch::Tensor out, torch::Tensor x, torch::Tensor panels, torch::Tensor sw,
                    c10::optional<torch::Tensor> bias);

// The decoder stack in one call for a step whose tokens all attend like decodes (one new token per sequence, or
// k speculative tokens each with its own context length), any number of them: every layer's RMSNorm, qkv,
// optional qk-norm, rope, KV write, paged attention, o_proj, residual + RMSNorm, gate_up, silu*mul, down,
// residual, then the final norm. It calls the kernels the Python modules pick for such a step, in the same order,
// so its results are the same bits (tests/model/test_fused_decode.py); what it removes is the Python and dispatch
// between them (~12 calls per layer). Linears with at most 8 rows take the small-row kernels (linear_small,
// linear_small_vnni, linear_small_int8); with more, oneDNN's prepacked GEMM (mkldnn::_linear_pointwise, what
// PackedWeight calls) or, int8, quantize_rows + at::_int_mm + dequant_rows (what Int8LinearMethod calls).
// Per layer `w` holds LAYER_SLOTS tensors (an absent one is an empty tensor):
//   0 input norm, 1 post-attention norm, 2 q norm, 3 k norm (qk-norm models),
//   then for qkv, o, gate_up, down (LIN_SLOTS each, from 4): weight (float [N, K] or int8), int8 row sums,
//   int8 per-channel scales, bias, oneDNN-packed float weight (> 8 rows), int8 weight transposed [K, N] for
//   _int_mm (> 8 rows);
// `kinds` per layer and linear: 0 float (linear_small), 1 int8 VNNI (linear_small_vnni), 2 int8 weights with
// float activations (linear_small_int8), 3 AVX2 exact int8 (avx2_int8_gemv <= 8 rows, else avx2_int8_gemm; slot 5
// holds its int16 panels instead of the transposed weight); `caches` per layer: K cache, V cache, K scales, V scales (int8 KV).
static constexpr int64_t LIN_SLOTS = 6;
static constexpr int64_t LAYER_SLOTS = 4 + 4 * LIN_SLOTS;

static inline c10::optional<torch::Tensor> opt(const torch::Tensor& t) {
  return t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// oneDNN sets up each (weight shape, row count) once, ~1.5-3.5 ms per linear shape on first use (docs/benchmarks.md,
// session 18), and a server meets a new prefill row count on most large steps: calls of more than 256 rows run at
// the row count rounded up to a multiple of 64 (zero rows appended, dropped after), ~28 row counts up to 2,048
// instead of one per size. model/row_buckets.py onednn_rows is the same rule (tests/model/test_linear.py checks).
int64_t onednn_rows(int64_t m) { return m <= 256 ? m : (m + 63) / 64 * 64; }

// oneDNN's linear with a weight prepacked by torch.ops.mkldnn._reorder_linear_weight (the op PackedWeight calls)
static torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t m = x.size(0), mp = onednn_rows(m);
  torch::Tensor xin = x;
  if (mp != m) {
    xin = at::zeros({mp, x.size(1)}, x.options());
    xin.narrow(0, 0, m).copy_(x);
  }
  torch::jit::Stack st;
  st.reserve(6);
  st.emplace_back(xin);
  st.emplace_back(packed);
  st.emplace_back(bias.numel() > 0 ? c10::IValue(bias) : c10::IValue());
  st.emplace_back(std::string("none"));
  st.emplace_back(c10::List<c10::optional<at::Scalar>>());
  st.emplace_back(std::string(""));
  op.callBoxed(&st);
  auto y = st[0].toTensor();
  return mp != m ? y.narrow(0, 0, m) : y;  // the first m rows of a row-major [mp, N]: contiguous
}

// csrc/amx_linear.cpp
bool linear_amx_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
int64_t amx_rows();

// linear.small_row_bits(True) mirrored here (set_small_row_bits): the fused stacks' plain (kind 0) linears give
// every row of a step of any size the small-row kernel's bits, as PackedWeight does under that context
static std::atomic<bool> g_small_row_bits{false};
void set_small_row_bits(bool on) { g_small_row_bits.store(on, std::memory_order_relaxed); }

// the Linear modules' kernel choice per row count; shared by both fused stacks (mixed_stack.cpp declares it)
torch::Tensor any_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& w, int64_t base, int64_t kind,
                         int64_t n_out) {
  const int64_t T = x.size(0);
  const auto& bias = w[base + 3];
  if (kind == 0 && T > 8 && g_small_row_bits.load(std::memory_order_relaxed)) {  // PackedWeight.small_bits's order
    auto out = at::empty({T, n_out}, x.options());
    if (w[base + 1].numel() > 0 && linear_amx_bf16(out, x, w[base + 1], opt(bias))) return out;
    if (linear_rows_bf16(out, x, w[base], opt(bias))) return out;
    for (int64_t i = 0; i < T; i += 8) {
      const int64_t n = std::min<int64_t>(8, T - i);
      linear_small(out.narrow(0, i, n), x.narrow(0, i, n).contiguous(), w[base], opt(bias));
    }
    return out;
  }
  if (kind == 0 && w[base + 1].numel() > 0 && T <= amx_rows()) {  // bf16 on AMX where PackedWeight packed it (slot 1)
    auto out = at::empty({T, n_out}, x.options());
    if (linear_amx_bf16(out, x, w[base + 1], opt(bias))) return out;
  }
  if (T <= 8) {
    auto out = at::empty({T, n_out}, x.options());
    if (kind == 0) linear_small(out, x, w[base], opt(bias));
    else if (kind == 1) linear_small_vnni(out, x, w[base], w[base + 1], w[base + 2], opt(bias));
    else if (kind == 3) {
      if (!avx2_int8_gemv(out, x, w[base], w[base + 2], opt(bias)))
        avx2_int8_gemm(out, x, w[base + 5], w[base + 2], opt(bias));
    } else linear_small_int8(out, x, w[base], w[base + 2], opt(bias));
    return out;
  }
  if (kind == 3) {  // AVX2 exact int8 (csrc/int8_gemm.cpp), what Int8LinearMethod calls without an int8 GEMM
    auto out = at::empty({T, n_out}, x.options());
    avx2_int8_gemm(out, x, w[base + 5], w[base + 2], opt(bias));
    return out;
  }
  if (kind == 0) {
    TORCH_CHECK(w[base + 4].defined() && w[base + 4].numel() > 0, "decoder_stack: no packed weight for > 8 rows");
    return onednn_linear(x, w[base + 4], bias);
  }
  TORCH_CHECK(w[base + 5].numel() > 0, "decoder_stack: no int8 GEMM weight for > 8 rows");
  auto q = at::empty({T, x.size(1)}, x.options().dtype(at::kChar));
  auto sx = at::empty({T}, x.options().dtype(at::kFloat));
  quantize_rows(q, sx, x);
  auto out = at::empty({T, n_out}, x.options());
  dequant_rows(out, at::_int_mm(q, w[base + 5]), sx, w[base + 2], opt(bias));
  return out;
}

// q [T, nh, hd], k [T, nkv, hd] (views into the qkv projection): the optional per-head qk-norm (qwen3; replaces
// q and k by normed copies when q_norm is non-empty), then rope in place. Shared by both fused stacks.
void qk_norm_rope(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& q_norm, const torch::Tensor& k_norm,
                  double eps, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin) {
  if (q_norm.numel() > 0) {
    const int64_t T = q.size(0), nh = q.size(1), nkv = k.size(1), hd = q.size(2);
    auto qc = q.contiguous(), kc = k.contiguous();
    q = at::empty_like(qc);
    k = at::empty_like(kc);
    rms_norm(q.view({T * nh, hd}), qc.view({T * nh, hd}), c10::nullopt, q_norm, eps);
    rms_norm(k.view({T * nkv, hd}), kc.view({T * nkv, hd}), c10::nullopt, k_norm, eps);
  }
  rope_inplace(q, positions, cos, sin);
  rope_inplace(k, positions, cos, sin);
}

torch::Tensor decoder_stack(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                            std::vector<torch::Tensor> w, std::vector<int64_t> kinds,
                            std::vector<torch::Tensor> caches, torch::Tensor slot_mapping,
                            torch::Tensor block_tables, torch::Tensor ctx_lens, torch::Tensor final_norm,
                            double eps, double scale, int64_t window, int64_t nh, int64_t nkv, int64_t hd,
                            int64_t inter) {
  const int64_t T = x.size(0), H = x.size(1), L = (int64_t)kinds.size() / 4;
  TORCH_CHECK(x.is_contiguous() && T >= 1, "decoder_stack: x [T >= 1, hidden] contiguous");
  TORCH_CHECK((int64_t)w.size() == L * LAYER_SLOTS && (int64_t)caches.size() == L * 4, "decoder_stack: lists");
  const auto opts = x.options();
  auto h = at::empty({T, H}, opts);
  auto attn = at::empty({T, nh, hd}, opts);
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
    if (kc.scalar_type() == at::kChar) {
      write_kv_int8(kc, vc, caches[l * 4 + 2], caches[l * 4 + 3], k, v, slot_mapping);
      paged_decode_attention(attn, q, kc, vc, block_tables, ctx_lens, scale, window, caches[l * 4 + 2],
                             caches[l * 4 + 3]);
    } else {
      write_kv(kc, vc, k.to(kc.scalar_type()), v.to(kc.scalar_type()), slot_mapping);
      paged_decode_attention(attn, q, kc, vc, block_tables, ctx_lens, scale, window, c10::nullopt, c10::nullopt);
    }
    auto a_out = any_linear(attn.view({T, nh * hd}), w, b + 4 + LIN_SLOTS, kd[1], H);
    rms_norm(h, x, a_out, w[b + 1], eps);  // x += attention output, h = norm(x)
    auto gu = any_linear(h, w, b + 4 + 2 * LIN_SLOTS, kd[2], 2 * inter);
    silu_mul(act, gu);
    x.add_(any_linear(act, w, b + 4 + 3 * LIN_SLOTS, kd[3], H));
  }
  auto out = at::empty({T, H}, opts);
  rms_norm(out, x, c10::nullopt, final_norm, eps);
  return out;
}

torch::Tensor decoder_stack_small(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                                  std::vector<torch::Tensor> w, std::vector<int64_t> kinds,
                                  std::vector<torch::Tensor> caches, torch::Tensor slot_mapping,
                                  torch::Tensor block_tables, torch::Tensor ctx_lens, torch::Tensor final_norm,
                                  double eps, double scale, int64_t window, int64_t nh, int64_t nkv, int64_t hd,
                                  int64_t inter) {
  TORCH_CHECK(x.size(0) <= 8, "decoder_stack_small: at most 8 tokens (decoder_stack takes any number)");
  return decoder_stack(x, positions, cos, sin, w, kinds, caches, slot_mapping, block_tables, ctx_lens, final_norm,
                       eps, scale, window, nh, nkv, hd, inter);
}

// The greedy token of each row as torch.argmax picks it: the first index of the row's maximum, or of its first NaN
// if it has one. Read in the logits' own dtype (bf16 -> fp32 is exact, so the same token as argmax over an fp32
// copy, without making one): a vectorized max (and NaN check) pass, then a scan for the first index holding it.
template <typename T>
static void argmax_rows_impl(torch::Tensor out, torch::Tensor x) {
  const int64_t M = x.size(0), N = x.size(1), ld = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* r = xp + m * ld;
      float best = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t n = 0;
#ifdef TM_AVX2
      __m256 vb = _mm256_set1_ps(best), vnan = _mm256_setzero_ps();
      for (; n + 8 <= N; n += 8) {
        const __m256 v = load8(r + n);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vb = _mm256_max_ps(vb, v);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vb);
      for (int j = 0; j < 8; ++j) best = std::max(best, lanes[j]);
      nan = _mm256_movemask_ps(vnan) != 0;
#endif
      for (; n < N; ++n) {
        const float v = to_f(r[n]);
        if (v != v) nan = true;
        else best = std::max(best, v);
      }
      int64_t bi = 0;
      for (n = 0; n < N; ++n) {
        const float v = to_f(r[n]);
        if (nan ? (v != v) : (v == best)) { bi = n; break; }
      }
      op[m] = bi;
    }
  });
}

void argmax_rows(torch::Tensor out, torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.scalar_type() == at::kLong && out.numel() == x.size(0),
              "argmax_rows: x [M, N] with unit column stride, out [M] int64");
  TM_DISPATCH(x, "argmax_rows", [&] { argmax_rows_impl<scalar_t>(out, x); });
}

// defined in prefill_attention.cpp (the varlen causal prefill attention, one call per layer)
bool prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                       torch::Tensor v_cache, torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor ctx_lens,
                       torch::Tensor block_tables, double scale, int64_t window, c10::optional<torch::Tensor> k_scales,
                       c10::optional<torch::Tensor> v_scales);
void register_lm_head(pybind11::module& m);  // csrc/lm_head.cpp
void register_decode_gemv(pybind11::module& m);  // csrc/decode_gemv.cpp
void register_mixed_stack(pybind11::module& m);  // csrc/mixed_stack.cpp
void register_decode_step(pybind11::module& m);  // csrc/decode_step.cpp
void register_head_argmax(pybind11::module& m);  // csrc/head_argmax.cpp
void register_int8_gemm(pybind11::module& m);  // csrc/int8_gemm.cpp
void register_amx_linear(pybind11::module& m);  // csrc/amx_linear.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU; fp32/bf16 q, any KV dtype)",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("ctx_lens"), py::arg("scale"), py::arg("window"), py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none());
  m.def("set_decode_attention", &set_decode_attention, "turn the session-9 decode attention (balanced split, "
        "prefetch ahead, shared K conversion; same bits) on/off; returns the previous setting");
  m.def("set_decode_attention_group", &set_decode_attention_group, "decode attention: rows that read the same "
        "blocks (a verify step's rows of one sequence) as one task per kv head (bf16; the same bits); returns the old "
        "setting");
  m.def("set_decode_attention_prefetch", &set_decode_attention_prefetch, "the session-9 decode attention's K "
        "prefetch distance in tokens (a multiple of 16; default 64); returns the previous value (for benchmarks)");
  m.def("write_kv_int8", &write_kv_int8, "quantize this step's K/V into an int8 cache (per-(block, head) scales)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally adding a residual in place first (CPU, fp32/bf16)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from the fused gate_up projection (CPU, fp32/bf16)");
  m.def("set_small_row_bits", &set_small_row_bits, "the fused stacks' plain linears: small-row bits for any rows "
        "(linear.small_row_bits mirrors its state here)");
  m.def("linear_rows_bf16", &linear_rows_bf16, "batch-invariant bf16 y = x W^T (+ b), any rows: each row's bits as "
        "linear_small's (AVX-512 BF16; False where it does not apply)");
  m.def("onednn_rows", &onednn_rows, "the row count a oneDNN linear of m rows runs at (row_buckets.onednn_rows)");
  m.def("linear_small", &linear_small, "y = x W^T (+ b) for at most 8 rows, W streamed once (CPU, fp32/bf16)");
  m.def("write_kv", &write_kv, "write this step's K/V into their cache slots (CPU, fp32/bf16)");
  m.def("rope_inplace", &rope_inplace, "neox rotary embedding in place (CPU, fp32/bf16)");
  m.def("quantize_rows", &quantize_rows, "int8 per-row dynamic quantization (CPU, fp32/bf16 in)");
  m.def("dequant_rows", &dequant_rows, "int32 GEMM result -> scaled fp32/bf16 (+ bias)");
  m.def("linear_small_vnni", &linear_small_vnni, "W8A8 y = q(x) W8^T * sx * sw (+ b) for at most 8 rows (AVX-512 VNNI)");
  m.def("decoder_stack_small", &decoder_stack_small, "all decoder layers + final norm for <= 8 decode tokens (CPU)");
  m.def("decoder_stack", &decoder_stack, "all decoder layers + final norm for any number of decode tokens (CPU)");
  m.def("argmax_rows", &argmax_rows, "the first index of each row's maximum (CPU, fp32/bf16)");
  m.def("has_vnni_small", &has_vnni_small, "whether linear_small_vnni is compiled in");
  m.def("prefill_attention", &prefill_attention, "varlen causal prefill attention over the paged cache, one call "
        "for all sequences of a step (CPU; False where not compiled in)", py::arg("out"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("q_starts"), py::arg("q_lens"),
        py::arg("ctx_lens"), py::arg("block_tables"), py::arg("scale"), py::arg("window"),
        py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none());
  m.def("linear_small_int8", &linear_small_int8, "y = x W8^T * sw (+ b) for at most 8 rows (CPU)");
  register_lm_head(m);
  register_decode_gemv(m);
  register_mixed_stack(m);
  register_decode_step(m);
  register_head_argmax(m);
  register_int8_gemm(m);
  register_amx_linear(m);
}
