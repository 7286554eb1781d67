// Prefill attention for CPU, one call per layer for every sequence of the step that brings more than one new token
// (varlen, causal, GQA, optional sliding window). Each new token attends to the sequence's earlier KV and its own
// chunk up to itself. Where it comes from mirrors the PyTorch path (the reference): a fresh prefill (no cached
// context, all inside the window) reads this step's K/V tensors; a chunk over cached context (a prefix-cache hit or
// an earlier prefill chunk) reads every key from the paged cache (fp32, bf16 or int8 storage with per-(block,
// kv head) scales), its own chunk included, as written there just before.
//
// Flash-style: per (sequence, query head, tile of QT query tokens) the scores of a tile of KT keys, an online
// softmax (running max and sum per row), and O += P V, in fp32 accumulators. K and V of each (sequence, kv head)
// are first converted once into a packed copy laid out for the dot products (shared by the query heads of the
// kv head and every query tile):
//  - bf16 query on a CPU with AVX-512 BF16: vdpbf16ps. K packed [key group of 16][d pair][16 keys][2] so one
//    instruction adds a d pair's product for 16 keys of one query row (lanes = keys); V packed
//    [key pair][d][2] with P rounded to bf16 (as flash attention does on GPUs), lanes = d.
//  - otherwise (fp32 query, or no AVX-512 BF16): fp32 FMA, 8 lanes (AVX2): K packed [group of 8][d][8], V [key][d].
// Parallel over (sequence, query head, query tile) with OpenMP, dynamic schedule (causal tiles differ in cost).
// Without AVX2+FMA the function returns false and the caller uses the PyTorch path.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TMP_AVX2 1
#endif
#if defined(TMP_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TMP_BF16 1
#endif

namespace {

constexpr int QT = 32;  // query tokens per work item
constexpr int KT = 32;  // keys per tile

inline uint16_t f2bf(float f) {  // round to nearest even (no NaN inputs reach here from finite K/V/P)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// one row of hd values of any storage type, times `s`, as fp32
inline void row_to_f(const void* p, at::ScalarType t, int64_t hd, float s, float* dst) {
  if (t == at::kFloat) {
    const float* x = static_cast<const float*>(p);
    for (int64_t d = 0; d < hd; ++d) dst[d] = x[d] * s;
  } else if (t == at::kBFloat16) {
    const uint16_t* x = static_cast<const uint16_t*>(p);
    for (int64_t d = 0; d < hd; ++d) {
      uint32_t u = uint32_t(x[d]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      dst[d] = f * s;
    }
  } else {
    const int8_t* x = static_cast<const int8_t*>(p);
    for (int64_t d = 0; d < hd; ++d) dst[d] = float(x[d]) * s;
  }
}

#include "simd_exp.h"  // exp256

struct Geometry {
  int64_t nh, kvh, hd, bs;
  int64_t hd2, hdp;  // bf16: hd rounded to a pair / to 16; fp32: hdp = hd rounded to 8
  bool bf16;
};

// Where key/value j of sequence i, kv head h comes from: the step's K/V for the sequence's own chunk, else the cache.
struct Source {
  const char* kc;
  const char* vc;
  at::ScalarType ct;
  int64_t c_es, c_sb, c_sh, c_st;  // cache element size and strides [NB, kvh, bs, hd] (elements)
  const float* ksc;
  const float* vsc;  // [NB, kvh] contiguous, or null
  const char* ks;
  const char* vs;
  at::ScalarType st;
  int64_t s_es, s_st, s_sh, v_st, v_sh;  // step K and V [T, kvh, hd] strides (elements)
};

// fp32 rows of K and V for keys [0, ctx) of (sequence, kv head) into kf / vf [ctx][hd]
void gather_f(const Source& S, const Geometry& G, const int64_t* bt, int64_t q_start, int64_t q_len, int64_t ctx,
              int64_t h, bool from_step, float* kf, float* vf) {
  const int64_t p0 = ctx - q_len;
  for (int64_t j = 0; j < ctx; ++j) {
    if (from_step && j >= p0) {
      const int64_t t = q_start + j - p0;
      row_to_f(S.ks + (t * S.s_st + h * S.s_sh) * S.s_es, S.st, G.hd, 1.f, kf + j * G.hd);
      row_to_f(S.vs + (t * S.v_st + h * S.v_sh) * S.s_es, S.st, G.hd, 1.f, vf + j * G.hd);
    } else {
      const int64_t blk = bt[j / G.bs];
      const int64_t off = (blk * S.c_sb + h * S.c_sh + (j % G.bs) * S.c_st) * S.c_es;
      const float ks = S.ksc ? S.ksc[blk * G.kvh + h] : 1.f, vs = S.vsc ? S.vsc[blk * G.kvh + h] : 1.f;
      row_to_f(S.kc + off, S.ct, G.hd, ks, kf + j * G.hd);
      row_to_f(S.vc + off, S.ct, G.hd, vs, vf + j * G.hd);
    }
  }
}

// packed sizes (elements) for nkp keys (a multiple of KT)
inline int64_t kpack_elems(const Geometry& G, int64_t nkp) { return G.bf16 ? nkp * G.hd2 : nkp * G.hd; }
inline int64_t vpack_elems(const Geometry& G, int64_t nkp) { return nkp * G.hdp; }

// bf16 rows straight from a bf16 source (no fp32 round trip): kr/vr [ctx] pointers to hd bf16 each
void pack_bf16_raw(const Geometry& G, const uint16_t* const* kr, const uint16_t* const* vr, int64_t ctx, int64_t nkp,
                   uint16_t* kp, uint16_t* vp) {
  const int64_t npair = G.hd2 / 2;
  std::memset(kp, 0, sizeof(uint16_t) * kpack_elems(G, nkp));
  std::memset(vp, 0, sizeof(uint16_t) * vpack_elems(G, nkp));
  for (int64_t j = 0; j < ctx; ++j) {
    const int64_t g = j / 16, l = j % 16;
    uint16_t* kd = kp + (g * npair * 16 + l) * 2;
    const uint16_t* ks = kr[j];
    for (int64_t p = 0; p < G.hd / 2; ++p) std::memcpy(kd + p * 32, ks + 2 * p, 4);
    if (G.hd & 1) kd[(G.hd / 2) * 32] = ks[G.hd - 1];
    uint16_t* vd = vp + ((j / 2) * G.hdp) * 2 + (j & 1);
    const uint16_t* vs = vr[j];
    for (int64_t d = 0; d < G.hd; ++d) vd[2 * d] = vs[d];
  }
}

void pack(const Geometry& G, const float* kf, const float* vf, int64_t ctx, int64_t nkp, void* kp_, void* vp_) {
  if (G.bf16) {
    uint16_t* kp = static_cast<uint16_t*>(kp_);
    uint16_t* vp = static_cast<uint16_t*>(vp_);
    const int64_t npair = G.hd2 / 2;
    std::memset(kp, 0, sizeof(uint16_t) * kpack_elems(G, nkp));
    std::memset(vp, 0, sizeof(uint16_t) * vpack_elems(G, nkp));
    for (int64_t j = 0; j < ctx; ++j) {
      const int64_t g = j / 16, l = j % 16;
      for (int64_t d = 0; d < G.hd; ++d) {
        kp[((g * npair + d / 2) * 16 + l) * 2 + (d & 1)] = f2bf(kf[j * G.hd + d]);
        vp[((j / 2) * G.hdp + d) * 2 + (j & 1)] = f2bf(vf[j * G.hd + d]);
      }
    }
  } else {
    float* kp = static_cast<float*>(kp_);
    float* vp = static_cast<float*>(vp_);
    std::memset(kp, 0, sizeof(float) * kpack_elems(G, nkp));
    std::memset(vp, 0, sizeof(float) * vpack_elems(G, nkp));
    for (int64_t j = 0; j < ctx; ++j) {
      const int64_t g = j / 8, l = j % 8;
      for (int64_t d = 0; d < G.hd; ++d) {
        kp[(g * G.hd + d) * 8 + l] = kf[j * G.hd + d];
        vp[j * G.hdp + d] = vf[j * G.hd + d];
      }
    }
  }
}

#ifdef TMP_AVX2
// S[r][0:KT] = scale * q_r . k_j for the KT keys of tile kt, rows [0, nrows) (a multiple of 8; rows past the tile's
// real ones are zero queries)
void scores_f32(const float* qb, const float* kp, int64_t hd, int64_t kt, float scale, float* Sc, int nrows) {
  for (int r0 = 0; r0 < nrows; r0 += 8) {
    for (int g = 0; g < KT / 8; ++g) {
      const float* kg = kp + ((kt * (KT / 8) + g) * hd) * 8;
      __m256 a[8];
      for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; ++d) {
        const __m256 k8 = _mm256_loadu_ps(kg + d * 8);
        for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(qb + (r0 + r) * hd + d), k8, a[r]);
      }
      const __m256 sc = _mm256_set1_ps(scale);
      for (int r = 0; r < 8; ++r) _mm256_storeu_ps(Sc + (r0 + r) * KT + g * 8, _mm256_mul_ps(a[r], sc));
    }
  }
}

// O[r][:] += sum_j P[r][j] V[j][:] over the tile's KT keys
void pv_f32(const float* P, const float* vp, int64_t hdp, int64_t kt, int nrows, float* O) {
  for (int r0 = 0; r0 < nrows; r0 += 4) {
    for (int64_t e = 0; e < hdp; e += 8) {
      __m256 a[4];
      for (int i = 0; i < 4; ++i) a[i] = _mm256_loadu_ps(O + (r0 + i) * hdp + e);
      const float* vb = vp + (kt * KT) * hdp + e;
      for (int j = 0; j < KT; ++j) {
        const __m256 v8 = _mm256_loadu_ps(vb + j * hdp);
        for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(P + (r0 + i) * KT + j), v8, a[i]);
      }
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(O + (r0 + i) * hdp + e, a[i]);
    }
  }
}
#endif

#ifdef TMP_BF16
inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

void scores_bf16(const uint16_t* qb, const uint16_t* kp, int64_t hd2, int64_t kt, float scale, float* Sc,
                 int nrows) {
  const int64_t npair = hd2 / 2;
  static_assert(KT == 32, "two 16-key groups per tile");
  // 8 rows x both key groups: 16 independent accumulators (vdpbf16ps latency hidden), each query pair broadcast
  // once for both groups
  for (int r0 = 0; r0 < nrows; r0 += 8) {
    const uint16_t* kg0 = kp + (kt * 2 * npair) * 32;
    const uint16_t* kg1 = kg0 + npair * 32;
    __m512 a0[8], a1[8];
    for (int r = 0; r < 8; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < npair; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kg0 + p * 32), k1 = (__m512bh)_mm512_loadu_si512(kg1 + p * 32);
      for (int r = 0; r < 8; ++r) {
        const __m512bh qv = bcast_pair(qb + (r0 + r) * hd2 + 2 * p);
        a0[r] = _mm512_dpbf16_ps(a0[r], qv, k0);
        a1[r] = _mm512_dpbf16_ps(a1[r], qv, k1);
      }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < 8; ++r) {
      _mm512_storeu_ps(Sc + (r0 + r) * KT, _mm512_mul_ps(a0[r], sc));
      _mm512_storeu_ps(Sc + (r0 + r) * KT + 16, _mm512_mul_ps(a1[r], sc));
    }
  }
}

// nrows a multiple of 4; rows past the tile's real ones have P = 0
void pv_bf16(const uint16_t* P, const uint16_t* vp, int64_t hdp, int64_t kt, int nrows, float* O) {
  int r0 = 0;
  // 8 rows x 32 d: 16 independent accumulators; per accumulator the same sum in the same order as below
  for (; r0 + 8 <= nrows && hdp % 32 == 0; r0 += 8) {
    for (int64_t e = 0; e < hdp; e += 32) {
      __m512 a0[8], a1[8];
      for (int i = 0; i < 8; ++i) {
        a0[i] = _mm512_loadu_ps(O + (r0 + i) * hdp + e);
        a1[i] = _mm512_loadu_ps(O + (r0 + i) * hdp + e + 16);
      }
      const uint16_t* vb = vp + ((kt * KT / 2) * hdp + e) * 2;
      for (int jp = 0; jp < KT / 2; ++jp) {
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vb + jp * hdp * 2);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vb + jp * hdp * 2 + 32);
        for (int i = 0; i < 8; ++i) {
          const __m512bh pv = bcast_pair(P + (r0 + i) * KT + 2 * jp);
          a0[i] = _mm512_dpbf16_ps(a0[i], pv, v0);
          a1[i] = _mm512_dpbf16_ps(a1[i], pv, v1);
        }
      }
      for (int i = 0; i < 8; ++i) {
        _mm512_storeu_ps(O + (r0 + i) * hdp + e, a0[i]);
        _mm512_storeu_ps(O + (r0 + i) * hdp + e + 16, a1[i]);
      }
    }
  }
  for (; r0 < nrows; r0 += 4) {
    for (int64_t e = 0; e < hdp; e += 16) {
      __m512 a[4];
      for (int i = 0; i < 4; ++i) a[i] = _mm512_loadu_ps(O + (r0 + i) * hdp + e);
      const uint16_t* vb = vp + ((kt * KT / 2) * hdp + e) * 2;
      for (int jp = 0; jp < KT / 2; ++jp) {
        const __m512bh v16 = (__m512bh)_mm512_loadu_si512(vb + jp * hdp * 2);
        for (int i = 0; i < 4; ++i) a[i] = _mm512_dpbf16_ps(a[i], bcast_pair(P + (r0 + i) * KT + 2 * jp), v16);
      }
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(O + (r0 + i) * hdp + e, a[i]);
    }
  }
}
#endif

}  // namespace

// out [T, nh, hd] (contiguous, q's dtype); q [T, nh, hd], k/v [T, kvh, hd] this step's (stride 1 in the last dim);
// k_cache/v_cache [NB, kvh, bs, hd] (fp32, bf16, or int8 with k_scales/v_scales [NB, kvh] fp32); per sequence:
// q_starts, q_lens, ctx_lens [S] int64, block_tables [S, max_blocks] int64. Returns false where not compiled in.
bool prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                       torch::Tensor v_cache, torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor ctx_lens,
                       torch::Tensor block_tables, double scale, int64_t window, c10::optional<torch::Tensor> k_scales,
                       c10::optional<torch::Tensor> v_scales) {
#ifndef TMP_AVX2
  return false;
#else
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "prefill_attention: q/k/v/out must be 3-D");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == q.scalar_type(), "prefill_attention: out contiguous, q's dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "prefill_attention: q/k/v need stride 1 in the last dim");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "prefill_attention: k and v dtypes differ");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1,
              "prefill_attention: caches [NB, kvh, bs, hd] with stride 1 in the last dim");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type(), st = k.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16, "prefill_attention: q float32 or bfloat16");
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16, "prefill_attention: k/v float32 or bfloat16");
  TORCH_CHECK(ct == at::kFloat || ct == at::kBFloat16 || ct == at::kChar, "prefill_attention: cache fp32/bf16/int8");
  TORCH_CHECK((ct == at::kChar) == (k_scales.has_value() && v_scales.has_value()),
              "prefill_attention: an int8 cache needs k_scales and v_scales (and only it)");
  for (auto* t : {&q_starts, &q_lens, &ctx_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "prefill_attention: metadata int64 contiguous");

  Geometry G;
  G.nh = q.size(1);
  G.kvh = k.size(1);
  G.hd = q.size(2);
  G.bs = k_cache.size(2);
  TORCH_CHECK(G.nh % G.kvh == 0 && k_cache.size(1) == G.kvh && k_cache.size(3) == G.hd && k.size(2) == G.hd,
              "prefill_attention: head shapes disagree");
#ifdef TMP_BF16
  G.bf16 = qt == at::kBFloat16;
#else
  G.bf16 = false;
#endif
  G.hd2 = (G.hd + 1) / 2 * 2;
  G.hdp = G.bf16 ? (G.hd + 15) / 16 * 16 : (G.hd + 7) / 8 * 8;
  const int64_t S = q_starts.size(0), group = G.nh / G.kvh, mb = block_tables.size(1);
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* cl = ctx_lens.data_ptr<int64_t>();
  const int64_t* btab = block_tables.data_ptr<int64_t>();
  torch::Tensor ksc, vsc;
  if (ct == at::kChar) {
    ksc = k_scales->contiguous();
    vsc = v_scales->contiguous();
    TORCH_CHECK(ksc.scalar_type() == at::kFloat && vsc.scalar_type() == at::kFloat, "prefill_attention: fp32 scales");
  }
  Source src{static_cast<const char*>(k_cache.data_ptr()), static_cast<const char*>(v_cache.data_ptr()), ct,
             k_cache.element_size(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
             ct == at::kChar ? ksc.data_ptr<float>() : nullptr, ct == at::kChar ? vsc.data_ptr<float>() : nullptr,
             static_cast<const char*>(k.data_ptr()), static_cast<const char*>(v.data_ptr()), st, k.element_size(),
             k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
  for (int64_t i = 0; i < S; ++i)
    TORCH_CHECK(ql[i] >= 1 && ql[i] <= cl[i] && qs[i] >= 0 && qs[i] + ql[i] <= q.size(0) &&
                    (cl[i] + G.bs - 1) / G.bs <= mb,
                "prefill_attention: sequence ", i, " has inconsistent q_start/q_len/ctx_len/block table");

  // 1) packed K/V per (sequence, kv head)
  std::vector<int64_t> koff(S * G.kvh + 1, 0), voff(S * G.kvh + 1, 0);
  for (int64_t i = 0; i < S; ++i) {
    const int64_t nkp = (cl[i] + KT - 1) / KT * KT;
    for (int64_t h = 0; h < G.kvh; ++h) {
      koff[i * G.kvh + h + 1] = koff[i * G.kvh + h] + kpack_elems(G, nkp);
      voff[i * G.kvh + h + 1] = voff[i * G.kvh + h] + vpack_elems(G, nkp);
    }
  }
  const int64_t es = G.bf16 ? 2 : 4;
  std::vector<char> kbuf(koff.back() * es), vbuf(voff.back() * es);
  const int nthreads = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t w = 0; w < S * G.kvh; ++w) {
    const int64_t i = w / G.kvh, h = w % G.kvh, ctx = cl[i], nkp = (ctx + KT - 1) / KT * KT;
    // a fresh prefill (no cached context, the whole sequence inside the window) reads its own K/V from the step's
    // tensors, as the PyTorch path does; a chunk over cached context reads everything back from the cache (for an
    // int8 or other-dtype cache: the stored, quantized values), also as the PyTorch path does
    const bool from_step = cl[i] == ql[i] && (window <= 0 || window >= cl[i]);
    if (G.bf16 && st == at::kBFloat16 && (ct == at::kBFloat16 || from_step)) {  // no conversion at all
      std::vector<const uint16_t*> kr(ctx), vr(ctx);
      const int64_t p0 = ctx - ql[i];
      const int64_t* bt = btab + i * mb;
      for (int64_t j = 0; j < ctx; ++j) {
        if (from_step) {
          const int64_t t = qs[i] + j - p0;
          kr[j] = reinterpret_cast<const uint16_t*>(src.ks) + t * src.s_st + h * src.s_sh;
          vr[j] = reinterpret_cast<const uint16_t*>(src.vs) + t * src.v_st + h * src.v_sh;
        } else {
          const int64_t off = bt[j / G.bs] * src.c_sb + h * src.c_sh + (j % G.bs) * src.c_st;
          kr[j] = reinterpret_cast<const uint16_t*>(src.kc) + off;
          vr[j] = reinterpret_cast<const uint16_t*>(src.vc) + off;
        }
      }
      pack_bf16_raw(G, kr.data(), vr.data(), ctx, nkp, reinterpret_cast<uint16_t*>(kbuf.data() + koff[w] * es),
                    reinterpret_cast<uint16_t*>(vbuf.data() + voff[w] * es));
      continue;
    }
    std::vector<float> kf(ctx * G.hd), vf(ctx * G.hd);
    gather_f(src, G, btab + i * mb, qs[i], ql[i], ctx, h, from_step, kf.data(), vf.data());
    pack(G, kf.data(), vf.data(), ctx, nkp, kbuf.data() + koff[w] * es, vbuf.data() + voff[w] * es);
  }

  // 2) work items (sequence, query head, query tile), the most expensive (latest tiles of the longest contexts) first
  struct Item { int64_t i, h, t0; };
  std::vector<Item> items;
  for (int64_t i = 0; i < S; ++i)
    for (int64_t t0 = 0; t0 < ql[i]; t0 += QT)
      for (int64_t h = 0; h < G.nh; ++h) items.push_back({i, h, t0});
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return cl[a.i] - ql[a.i] + a.t0 > cl[b.i] - ql[b.i] + b.t0;
  });
  const bool qbf = qt == at::kBFloat16;
  const char* qptr = static_cast<const char*>(q.data_ptr());
  char* optr = static_cast<char*>(out.data_ptr());
  const int64_t q_es = q.element_size(), q_st = q.stride(0), q_sh = q.stride(1);
  const float fscale = static_cast<float>(scale);
  const int64_t n_items = static_cast<int64_t>(items.size());

#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> qf(QT * G.hd), Sc(QT * KT), O(QT * G.hdp), m(QT), l(QT), Pf(QT * KT);
    std::vector<uint16_t> qb(QT * G.hd2), Pb(QT * KT);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& I = items[it];
      const int64_t i = I.i, h = I.h, kvh_i = h / group, ctx = cl[i], p0 = ctx - ql[i];
      const int nq = static_cast<int>(std::min<int64_t>(QT, ql[i] - I.t0));
      const int64_t w = i * G.kvh + kvh_i;
      // this tile's queries (rows past nq stay zero)
      if (G.bf16) {  // a bf16 query (G.bf16 implies it): copied as it is
        std::fill(qb.begin(), qb.end(), 0);
        for (int r = 0; r < nq; ++r)
          std::memcpy(qb.data() + r * G.hd2, qptr + ((qs[i] + I.t0 + r) * q_st + h * q_sh) * q_es, 2 * G.hd);
      } else {
        std::fill(qf.begin(), qf.end(), 0.f);
        for (int r = 0; r < nq; ++r)
          row_to_f(qptr + ((qs[i] + I.t0 + r) * q_st + h * q_sh) * q_es, qt, G.hd, 1.f, qf.data() + r * G.hd);
      }
      std::fill(O.begin(), O.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t pos_first = p0 + I.t0, pos_last = p0 + I.t0 + nq - 1;
      const int rows8 = (nq + 7) / 8 * 8;  // score rows computed (zero queries past nq; their rows are not read)
      const int64_t kmin = window > 0 ? std::max<int64_t>(0, pos_first - window + 1) : 0;
      for (int64_t kt = kmin / KT; kt * KT <= pos_last; ++kt) {
#ifdef TMP_BF16
        if (G.bf16)
          scores_bf16(qb.data(), reinterpret_cast<const uint16_t*>(kbuf.data()) + koff[w], G.hd2, kt, fscale, Sc.data(),
                      rows8);
        else
#endif
          scores_f32(qf.data(), reinterpret_cast<const float*>(kbuf.data()) + koff[w], G.hd, kt, fscale, Sc.data(),
                     rows8);
        // online softmax per row; masked keys (after the row's position, before its window, past ctx) get p = 0
        for (int r = 0; r < nq; ++r) {
          const int64_t pos = p0 + I.t0 + r;
          int64_t jlo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0, jhi = pos;  // valid keys, inclusive
          jlo = std::max<int64_t>(jlo - kt * KT, 0);
          jhi = std::min<int64_t>(jhi - kt * KT, KT - 1);
          float* s = Sc.data() + r * KT;
          float* pf = Pf.data() + r * KT;
          if (jlo > jhi) {
            std::fill(pf, pf + KT, 0.f);
            std::fill(Pb.begin() + r * KT, Pb.begin() + (r + 1) * KT, 0);
            continue;
          }
#ifdef TMP_BF16
          static_assert(KT == 32, "the AVX-512 row below holds a tile's 32 keys in two registers");
          {  // AVX-512: the row's 32 keys in two registers, masked by the valid range
            const uint32_t nv = static_cast<uint32_t>(jhi - jlo + 1);
            const uint32_t bits = (nv == 32 ? 0xffffffffu : ((1u << nv) - 1u)) << jlo;
            const __mmask16 k0 = static_cast<__mmask16>(bits & 0xffffu), k1 = static_cast<__mmask16>(bits >> 16);
            const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
            const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
            const float mx = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_mask_mov_ps(ninf, k0, s0), _mm512_mask_mov_ps(ninf, k1, s1)));
            const float mnew = std::max(m[r], mx);
            const float alpha = std::exp(m[r] - mnew);  // m = -inf at first: alpha = 0
            m[r] = mnew;
            const __m512 mn = _mm512_set1_ps(mnew);
            const __m512 e0 = _mm512_maskz_mov_ps(k0, exp512(_mm512_sub_ps(s0, mn)));
            const __m512 e1 = _mm512_maskz_mov_ps(k1, exp512(_mm512_sub_ps(s1, mn)));
            if (G.bf16)
              _mm512_storeu_si512(Pb.data() + r * KT, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            else {
              _mm512_storeu_ps(pf, e0);
              _mm512_storeu_ps(pf + 16, e1);
            }
            l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
            if (alpha != 1.f) {
              float* o = O.data() + r * G.hdp;
              for (int64_t d = 0; d < G.hdp; ++d) o[d] *= alpha;
            }
            continue;
          }
#endif
          float mx = -std::numeric_limits<float>::infinity();
          if (jlo == 0 && jhi == KT - 1) {
            __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8)),
                                      _mm256_max_ps(_mm256_loadu_ps(s + 16), _mm256_loadu_ps(s + 24)));
            float tmp[8];
            _mm256_storeu_ps(tmp, m8);
            for (int u = 0; u < 8; ++u) mx = std::max(mx, tmp[u]);
          } else {
            for (int64_t j = jlo; j <= jhi; ++j) mx = std::max(mx, s[j]);
          }
          const float mnew = std::max(m[r], mx);
          const float alpha = std::exp(m[r] - mnew);  // m = -inf at first: alpha = 0
          m[r] = mnew;
          __m256 sum8 = _mm256_setzero_ps();
          const __m256 mn = _mm256_set1_ps(mnew);
          for (int j0 = 0; j0 < KT; j0 += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j0), mn));
            const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(j0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            const __m256i ok = _mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(int(jlo) - 1)),
                                                _mm256_cmpgt_epi32(_mm256_set1_epi32(int(jhi) + 1), idx));
            e = _mm256_and_ps(e, _mm256_castsi256_ps(ok));
#ifdef TMP_BF16
            if (G.bf16)
              _mm_storeu_si128(reinterpret_cast<__m128i*>(Pb.data() + r * KT + j0), (__m128i)_mm256_cvtneps_pbh(e));
            else
#endif
              _mm256_storeu_ps(pf + j0, e);
            sum8 = _mm256_add_ps(sum8, e);
          }
          float tmp[8];
          _mm256_storeu_ps(tmp, sum8);
          float sum = 0.f;
          for (int u = 0; u < 8; ++u) sum += tmp[u];
          l[r] = l[r] * alpha + sum;
          if (alpha != 1.f) {
            float* o = O.data() + r * G.hdp;
            for (int64_t d = 0; d < G.hdp; ++d) o[d] *= alpha;
          }
        }
        const int rows4 = (nq + 3) / 4 * 4;
        for (int r = nq; r < rows4; ++r) std::fill(Pf.begin() + r * KT, Pf.begin() + (r + 1) * KT, 0.f);
        for (int r = nq; r < rows4; ++r) std::fill(Pb.begin() + r * KT, Pb.begin() + (r + 1) * KT, 0);
#ifdef TMP_BF16
        if (G.bf16) {
          pv_bf16(Pb.data(), reinterpret_cast<const uint16_t*>(vbuf.data()) + voff[w], G.hdp, kt, rows4, O.data());
        } else
#endif
          pv_f32(Pf.data(), reinterpret_cast<const float*>(vbuf.data()) + voff[w], G.hdp, kt, rows4, O.data());
      }
      for (int r = 0; r < nq; ++r) {
        const float inv = 1.f / l[r];
        char* dst = optr + ((qs[i] + I.t0 + r) * G.nh + h) * G.hd * q_es;
        const float* o = O.data() + r * G.hdp;
        if (qbf) {
          uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);
          for (int64_t d = 0; d < G.hd; ++d) d16[d] = f2bf(o[d] * inv);
        } else {
          float* d32 = reinterpret_cast<float*>(dst);
          for (int64_t d = 0; d < G.hd; ++d) d32[d] = o[d] * inv;
        }
      }
    }
  }
  return true;
#endif
}
