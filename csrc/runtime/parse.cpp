#include "runtime/parse.h"

#include <algorithm>
#include <cctype>
#include <sstream>

#include <c10/util/Exception.h>

namespace pinxfer {

namespace {

bool is_space(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }
bool is_digit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }
bool is_alpha(char c) { return std::isalpha(static_cast<unsigned char>(c)) != 0; }

// Bytes per unit, by the unit's lower-case spelling; 0 for an unknown unit.
double bytes_per_unit(const std::string& unit) {
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1.0},           {"b", 1.0},
      {"k", 0x1p10},       {"kb", 0x1p10},  {"kib", 0x1p10},
      {"m", 0x1p20},       {"mb", 0x1p20},  {"mib", 0x1p20},
      {"g", 0x1p30},       {"gb", 0x1p30},  {"gib", 0x1p30},
      {"t", 0x1p40},       {"tb", 0x1p40},  {"tib", 0x1p40},
  };
  for (const auto& [name, scale] : kUnits) {
    if (unit == name) return scale;
  }
  return 0.0;
}

constexpr const char* kByteSizeForms =
    "expected a number with an optional unit (B, KiB, MiB, GiB, TiB; K, M, G, T and KB, MB, "
    "GB, TB mean the same, all binary), e.g. 1073741824, 512MiB, 8G";

}  // namespace

int64_t parse_byte_size(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && is_space(text[i])) ++i;
  // The number, read digit by digit rather than with strtod: strtod follows
  // the C locale's decimal point, which an embedding program may have changed.
  double number = 0;
  const size_t number_begin = i;
  for (; i < text.size() && is_digit(text[i]); ++i) number = number * 10 + (text[i] - '0');
  const bool has_digits = i > number_begin;
  if (has_digits && i < text.size() && text[i] == '.') {
    double fraction = 0, denominator = 1;
    for (++i; i < text.size() && is_digit(text[i]); ++i) {
      fraction = fraction * 10 + (text[i] - '0');
      denominator *= 10;
    }
    number += fraction / denominator;
  }
  while (i < text.size() && is_space(text[i])) ++i;
  std::string unit;
  while (i < text.size() && is_alpha(text[i])) {
    unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(text[i++]))));
  }
  while (i < text.size() && is_space(text[i])) ++i;
  TORCH_CHECK_VALUE(has_digits && i == text.size(), "pinxfer: cannot read a byte size from '",
                    text, "': ", kByteSizeForms);
  const double scale = bytes_per_unit(unit);
  TORCH_CHECK_VALUE(scale > 0, "pinxfer: cannot read a byte size from '", text,
                    "': unknown unit '", unit, "'; ", kByteSizeForms);
  const double bytes = number * scale;
  TORCH_CHECK_VALUE(bytes < 0x1p63, "pinxfer: the byte size '", text,
                    "' is too large: at most 2^63 - 1 bytes");
  return static_cast<int64_t>(bytes);
}

namespace {
// One CPU id of a cpulist item; `whole` is the list, for the message.
int parse_cpu_id(const std::string& digits, const std::string& whole) {
  const bool well_formed = !digits.empty() && digits.size() <= 9 &&
                           std::all_of(digits.begin(), digits.end(), is_digit);
  TORCH_CHECK_VALUE(well_formed, "pinxfer: malformed CPU list '", whole,
                    "': expected comma-separated CPU ids or ranges like 0-3,8");
  return std::stoi(digits);
}
}  // namespace

std::vector<int> parse_cpulist(const std::string& text) {
  std::string compact;
  for (char c : text) {
    if (!is_space(c)) compact.push_back(c);
  }
  std::vector<int> cpus;
  std::stringstream items(compact);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item.empty()) continue;
    const auto dash = item.find('-');
    if (dash == std::string::npos) {
      cpus.push_back(parse_cpu_id(item, text));
      continue;
    }
    const int lo = parse_cpu_id(item.substr(0, dash), text);
    const int hi = parse_cpu_id(item.substr(dash + 1), text);
    TORCH_CHECK_VALUE(hi >= lo, "pinxfer: malformed CPU list '", text,
                      "': range end below its start");
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

}  // namespace pinxfer
