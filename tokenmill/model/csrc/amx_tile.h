// AMX bf16 tiles (Intel Sapphire Rapids and later: amx_tile + amx_bf16) over the pair-packed weight layout of
// lm_head_pack_bf16 (csrc/lm_head.cpp): int32 [ceil(N / 64), K / 2, 64], tile t, pair p, lane l holding
// (W[64t + l, 2p], W[64t + l, 2p + 1]). That layout is already what TDPBF16PS reads as its B operand: 16 pair rows
// of one 16-column block are 16 rows of 64 bytes, 256 bytes apart.
//
// Why: a speculative verify step runs k + 1 rows per sequence, and the AVX-512 kernels' cost grows ~linearly with
// the rows (each row is a full pass of vdpbf16ps over the weights). One TDPBF16PS multiplies up to 16 rows by a
// 32 x 16 block, so 1-16 rows cost about what 1 row costs (the weight bytes loaded are the same).
//
// Bits: element (m, n) is one fp32 accumulator carried through TDPBF16PS over k in increasing chunks of 32; the
// hardware's own order inside an instruction is fixed, and no instruction mixes rows, so a row's result does not
// depend on how many other rows share the tile (batch-invariant). The bits differ from the vdpbf16ps kernels'
// (measured: ~half the fp32 sums differ in the last bits), so every small-row path of a model uses AMX or none does.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#define TM_AMX 1

namespace tm_amx {

constexpr int64_t VT = 64;  // columns per packed tile (4 TDPBF16PS blocks of 16)

// the kernel (Linux >= 5.16) must grant this process the AMX tile state once; TOKENMILL_AMX=0 turns AMX off
inline bool available() {
  static const bool ok = [] {
    const char* v = std::getenv("TOKENMILL_AMX");
    if (v && std::strcmp(v, "0") == 0) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: C (R rows x 16 fp32), 4: A (R rows x 32 bf16), 5-7: B (16 pair rows x 16 columns); per thread
inline void configure(int R) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) { c.rows[t] = (uint8_t)R; c.colsb[t] = 64; }
  for (int t = 5; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

// buf [R][64] fp32 = rows m0 .. m0 + R - 1 of x [*, K] bf16 times the 64 columns of packed tile `wt` ([K / 2][64]
// pairs); K % 32 == 0; configure(R) first
inline void tile64(const uint16_t* x, int64_t K, int64_t m0, const uint32_t* wt, float* buf) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t K2 = K / 2;
  for (int64_t p = 0; p < K2; p += 16) {
    _tile_loadd(4, x + m0 * K + 2 * p, K * 2);
    const uint32_t* w = wt + p * VT;
    _tile_loadd(5, w, VT * 4);
    _tile_loadd(6, w + 16, VT * 4);
    _tile_loadd(7, w + 32, VT * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, w + 48, VT * 4);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, buf, VT * 4);
  _tile_stored(1, buf + 16, VT * 4);
  _tile_stored(2, buf + 32, VT * 4);
  _tile_stored(3, buf + 48, VT * 4);
}

}  // namespace tm_amx
#endif
