#include "transfer/stage_copy.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <iterator>

#include "runtime/settings.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pinxfer {

static_assert(std::size(kStagingModeNames) == 3, "one name per StagingMode, in its order");

StagingMode parse_staging_mode(const std::string& text, const char* what) {
  const int index = name_index(kStagingModeNames, text);
  if (index >= 0) return static_cast<StagingMode>(index);
  TORCH_CHECK_VALUE(false, what,
                    ": expected 'auto', 'nt' (nontemporal stores) or 'movsb' "
                    "(cached stores), got '",
                    text, "'. Leave it 'auto' to let pinxfer choose per chunk.");
}

const char* staging_mode_name(StagingMode mode) {
  return kStagingModeNames[static_cast<size_t>(mode)];
}

}  // namespace pinxfer

namespace pinxfer::transfer {

namespace {
constexpr size_t kStreamingCachedMinBytes = size_t{32} << 20;

// The mode after the environment override: the argument wins unless it is
// "auto", in which case PINXFER_STAGE_COPY (checked by the settings) decides.
StagingMode effective_mode(StagingMode mode) {
  if (mode != StagingMode::kAuto) return mode;
  static const StagingMode from_env =
      parse_staging_mode(settings().stage_copy, "PINXFER_STAGE_COPY");
  return from_env;
}

// The cached tail a transfer was given: the argument unless "auto" (< 0), else
// PINXFER_CACHED_TAIL; < 0 when neither gives one.
int64_t given_cached_tail(int64_t cached_tail) {
  return cached_tail >= 0 ? cached_tail : settings().cached_tail;
}
}  // namespace

StagePolicy stage_policy(StagingMode mode, int64_t cached_tail, size_t nbytes,
                         const std::function<bool()>& copy_stream_busy) {
  StagePolicy policy;
  switch (effective_mode(mode)) {
    case StagingMode::kNontemporal:
      policy.cached_tail = SIZE_MAX;
      return policy;
    case StagingMode::kCached:
      policy.cached_tail = 0;
      return policy;
    case StagingMode::kAuto:
      break;
  }
  cached_tail = given_cached_tail(cached_tail);
  if (cached_tail >= 0) {
    policy.cached_tail = static_cast<size_t>(cached_tail);
  } else if (nbytes >= kStreamingCachedMinBytes && copy_stream_busy()) {
    policy.cached_tail = 0;
  }
  return policy;
}

StageCopy small_copy_kind(StagingMode mode, int64_t cached_tail, size_t nbytes) {
  constexpr size_t kPage = 4096;
  if (effective_mode(mode) == StagingMode::kAuto && given_cached_tail(cached_tail) < 0) {
    return nbytes > kPage ? StageCopy::kCached : StageCopy::kNontemporal;
  }
  return stage_policy(mode, cached_tail, nbytes, [] { return false; }).kind_for(nbytes, nbytes);
}

#if defined(__x86_64__)
namespace {
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

// n a multiple of 128, dst 32-byte aligned.
__attribute__((target("avx2"))) void stream_avx2(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
}

// n a multiple of 64, dst 16-byte aligned.
void stream_sse2(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
}
}  // namespace
#endif

void flush_cache_lines(const void* p, size_t n) {
#if defined(__x86_64__)
  const auto* bytes = static_cast<const char*>(p);
  for (size_t i = 0; i < n; i += 64) _mm_clflush(bytes + i);
  if (n > 0) _mm_clflush(bytes + n - 1);  // the last line where p is not line-aligned
  _mm_mfence();
#else
  (void)p;
  (void)n;
#endif
}

void read_cache_lines(const void* p, size_t n) {
  const auto* bytes = static_cast<const volatile char*>(p);
  for (size_t i = 0; i < n; i += 64) (void)bytes[i];
  if (n > 0) (void)bytes[n - 1];  // the last line where p is not line-aligned
}

void stage_copy(char* dst, const char* src, size_t n, StageCopy kind) {
#if defined(__x86_64__)
  if (kind == StageCopy::kCached) {
    // Fast-strings microcode picks the widest stores and skips the read for
    // ownership of whole destination lines.
    asm volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
    return;
  }
  if (n >= 4096) {
    // Align the destination to 32 bytes with a short memcpy head.
    const size_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const size_t body = n & ~size_t{127};
    if (has_avx2()) {
      stream_avx2(dst, src, body);
    } else {
      stream_sse2(dst, src, body);
    }
    std::memcpy(dst + body, src + body, n - body);
    _mm_sfence();
    return;
  }
#endif
  (void)kind;
  std::memcpy(dst, src, n);
}

}  // namespace pinxfer::transfer
