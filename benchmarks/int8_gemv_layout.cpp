// Weight layout vs DRAM streaming rate of the AVX2 int8 GEMV's inner loop (1 row, vpmaddubsw), outside tokenmill:
// 40 MB of int8 "weights" (K = 512), 8 sets rotated so every pass reads from DRAM (beyond a 32 MiB L3), 2 threads.
//   read-only            a plain sequential read (the bandwidth probe)
//   rows (plain [N, K])  the plain [N, K] layout, 8 rows per pass (what avx2_int8_gemv read before session 12)
//   rows + pf            the same with a software prefetch of the next block's rows
//   packed [pf D]        [N/8, K/32, 8, 32] (avx2_int8_pack8): one sequential stream, optional prefetch D bytes ahead
// Build and run (session 12):
//   g++ -O3 -mavx2 -mfma -fopenmp benchmarks/int8_gemv_layout.cpp -o /tmp/gemv_layout
//   flock /tmp/cpu.lock env OMP_NUM_THREADS=2 /tmp/gemv_layout
// The first repetition includes first-touch page faults; read the later ones.
#include <immintrin.h>
#include <omp.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <vector>
#include <cstdint>
// 40 MB "weights" per set, NSETS sets rotated (cold in L3). K=512 rows.
static const int64_t K = 512, N = 78*1024, BYTES = N*K;  // ~40 MB
static const int NSETS = 8;
static inline int32_t hsum(__m256i v){ alignas(32) int32_t t[8]; _mm256_store_si256((__m256i*)t,v); int32_t s=0; for(int i=0;i<8;i++) s+=t[i]; return s;}
// PACKED: [N/8][K/32][8][32], one sequential stream, PF = software prefetch distance in bytes (0 = none);
// else row-major [N][K], 8 rows in parallel (each stride K), PF > 0: prefetch the rows of the block PF blocks ahead
template<bool PACKED, int PF>
int64_t kern(const int8_t* w, const int8_t* q, int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  #pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < N/8; ++b) {
    const int8_t* wb = w + b*8*K;
    __m256i acc[8]; for (int i=0;i<8;i++) acc[i]=_mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 32) {
      if (PACKED && PF) for (int l=0;l<256;l+=64) _mm_prefetch((const char*)(wb + k*8 + PF + l), _MM_HINT_T0);
      if (!PACKED && PF && (k & 63) == 0) for (int i=0;i<8;i++) _mm_prefetch((const char*)(wb + PF*8*K + i*K + k), _MM_HINT_T0);
      __m256i xv = _mm256_loadu_si256((const __m256i*)(q+k));
      for (int i=0;i<8;i++){
        __m256i wv=_mm256_loadu_si256((const __m256i*)(PACKED ? wb + k*8 + i*32 : wb + i*K + k)); __m256i aw=_mm256_abs_epi8(wv);
        acc[i]=_mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw,_mm256_sign_epi8(xv,wv)),ones)); }
    }
    for (int i=0;i<8;i++) out[b*8+i]=hsum(acc[i]);
  }
  return 0;
}
int64_t kern_read(const int8_t* w, const int8_t*, int32_t* out) {
  #pragma omp parallel
  { __m256i a=_mm256_setzero_si256(); int t=omp_get_thread_num(), nt=omp_get_num_threads();
    int64_t per = BYTES/nt; const int8_t* p = w + t*per;
    for (int64_t i=0;i<per;i+=32) a=_mm256_add_epi8(a,_mm256_loadu_si256((const __m256i*)(p+i)));
    out[t]=hsum(a); }
  return 0;
}
typedef int64_t (*K_t)(const int8_t*, const int8_t*, int32_t*);
int main() {
  { FILE* f = fopen("/proc/cpuinfo", "r"); char line[4096]; bool avx2 = false, avx512 = false; char model[256] = "?";
    while (f && fgets(line, sizeof line, f)) {
      if (!strncmp(line, "model name", 10)) { const char* c = strchr(line, ':'); if (c) snprintf(model, sizeof model, "%s", c + 2); }
      if (!strncmp(line, "flags", 5)) { avx2 = strstr(line, " avx2") != nullptr; avx512 = strstr(line, " avx512f") != nullptr; }
    }
    if (f) fclose(f);
    model[strcspn(model, "\n")] = 0;
    printf("# CPU: %s: %s%s, %d threads\n", model, avx2 ? "avx2" : "no avx2", avx512 ? " avx512f" : "", omp_get_max_threads()); }
  std::vector<int8_t*> sets;
  for (int s=0;s<NSETS;s++){ int8_t* p=(int8_t*)aligned_alloc(4096, BYTES); for (int64_t i=0;i<BYTES;i++) p[i]=(int8_t)(i*7+s); sets.push_back(p);}
  alignas(32) int8_t q[K]; for (int i=0;i<K;i++) q[i]=(int8_t)(i%100-50);
  std::vector<int32_t> out(N);
  const char* names[] = {"read-only", "rows (plain [N, K])", "rows + pf next block", "packed", "packed pf 512", "packed pf 1024", "packed pf 2048", "packed pf 4096"};
  K_t ks[] = {kern_read, kern<false, 0>, kern<false, 1>, kern<true, 0>, kern<true, 512>, kern<true, 1024>, kern<true, 2048>, kern<true, 4096>};
  for (int rep=0; rep<3; rep++)
  for (int j=0;j<8;j++){
    double best=1e9; int si=0;
    for (int it=0; it<16; it++){ auto t0=std::chrono::steady_clock::now(); ks[j](sets[si], q, out.data()); auto t1=std::chrono::steady_clock::now();
      si=(si+1)%NSETS; double s=std::chrono::duration<double>(t1-t0).count(); if (it>=2 && s<best) best=s; }
    printf("rep %d %-22s best %.3f ms  %.1f GB/s\n", rep, names[j], best*1e3, BYTES/best/1e9);
  }
}
