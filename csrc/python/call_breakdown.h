// pinxfer._C._call_breakdown: nanoseconds per piece of a small call (see the .cpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace pinxfer::diag {
std::map<std::string, double> call_breakdown(int64_t iterations);
}  // namespace pinxfer::diag
