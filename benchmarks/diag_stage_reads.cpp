// Where a stage copy's source lines are, against the ways of copying them (session 51).
//
// The staging copy reads a pageable source and writes a pinned block (transfer/stage_copy.*).
// Session 50 measured, inside pinxfer's small road on one H100 host, rep movsb reading a source
// left cold by a loop's other work about twice as fast as the nontemporal loop, and made the
// small road stage with cached stores above a page. This probe asks the CPU alone: one thread
// (CPU 0) copies n bytes with each kind, the source in one of four places, the destination
// flushed to DRAM before each copy (a pool block that was DMA-read holds no dirty lines):
//   warm         just read by this thread (L1/L2)
//   dram         flushed (clflush) to DRAM
//   other_core   just written by a thread on CPU 1 (dirty in that core's cache)
//   after_sleep  just read, then 20 ms of sleep (a core's deep C-state may empty its caches)
// Kinds: nt (stage_copy's nontemporal AVX2 loop), nt_pf<N> (the same, prefetching the source
// N bytes ahead into L1), movsb (stage_copy's cached stores). Rounds rotate the kinds' order.
// Prints, per size and place, each kind's median/min in microseconds.
//
//   g++ -O2 -pthread -o /tmp/diag_stage_reads benchmarks/diag_stage_reads.cpp
//   /tmp/diag_stage_reads
//
// Results: benchmarks/results/<kind>/logs/stage_reads_probe_*.txt (csrc/README.md, "Session 51").
// Needs 2 CPUs and AVX2.
#include <immintrin.h>
#include <sched.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
template <int AHEAD>
__attribute__((target("avx2"))) void ntp(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 128) {
    if (AHEAD) {
      _mm_prefetch(src + i + AHEAD, _MM_HINT_T0);
      _mm_prefetch(src + i + AHEAD + 64, _MM_HINT_T0);
    }
    __m256i a = _mm256_loadu_si256((const __m256i*)(src + i));
    __m256i b = _mm256_loadu_si256((const __m256i*)(src + i + 32));
    __m256i c = _mm256_loadu_si256((const __m256i*)(src + i + 64));
    __m256i d = _mm256_loadu_si256((const __m256i*)(src + i + 96));
    _mm256_stream_si256((__m256i*)(dst + i), a);
    _mm256_stream_si256((__m256i*)(dst + i + 32), b);
    _mm256_stream_si256((__m256i*)(dst + i + 64), c);
    _mm256_stream_si256((__m256i*)(dst + i + 96), d);
  }
  _mm_sfence();
}
void movsb(char* dst, const char* src, size_t n) {
  asm volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
}
void flush(const char* p, size_t n) {
  for (size_t i = 0; i < n; i += 64) _mm_clflush(p + i);
  _mm_mfence();
}
void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  sched_setaffinity(0, sizeof s, &s);
}
int main(int argc, char** argv) {
  pin(0);
  const char* where_names[] = {"warm", "dram", "other_core", "after_sleep"};
  typedef void (*F)(char*, const char*, size_t);
  struct K {
    const char* name;
    F f;
  } ks[] = {{"nt", ntp<0>},
            {"nt_pf512", ntp<512>},
            {"nt_pf1k", ntp<1024>},
            {"nt_pf2k", ntp<2048>},
            {"movsb", movsb}};
  const int nk = sizeof(ks) / sizeof(ks[0]);
  for (size_t n : {size_t(64) << 10, size_t(256) << 10, size_t(1) << 20, size_t(4) << 20}) {
    char* src = (char*)aligned_alloc(4096, n + 4096);
    char* dst = (char*)aligned_alloc(4096, n);
    memset(src, 1, n + 4096);
    memset(dst, 2, n);
    for (int where = 0; where < 4; ++where) {
      std::vector<std::vector<double>> t(nk);
      const int rounds = where == 3 ? 15 : 41;
      for (int r = 0; r < rounds; ++r)
        for (int k0 = 0; k0 < nk; ++k0) {
          const int k = (k0 + r) % nk;
          if (where == 0) {
            volatile char s = 0;
            for (size_t i = 0; i < n; i += 64) s += src[i];
          }
          if (where == 1) flush(src, n);
          if (where == 2) {
            std::thread w([&] {
              pin(1);
              memset(src, r & 0xff, n);
            });
            w.join();
          }
          if (where == 3) {
            volatile char s = 0;
            for (size_t i = 0; i < n; i += 64) s += src[i];
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
          flush(dst, n);
          auto a = std::chrono::steady_clock::now();
          ks[k].f(dst, src, n);
          auto b = std::chrono::steady_clock::now();
          t[k].push_back(std::chrono::duration<double, std::micro>(b - a).count());
        }
      printf("%5zuK %-11s", n >> 10, where_names[where]);
      for (int k = 0; k < nk; ++k) {
        std::sort(t[k].begin(), t[k].end());
        printf(" %s %.1f/%.1f", ks[k].name, t[k][t[k].size() / 2], t[k][0]);
      }
      printf("\n");
    }
    free(src);
    free(dst);
  }
}
