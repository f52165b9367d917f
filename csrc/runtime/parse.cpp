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

// log2 of the bytes per unit, by the unit's lower-case spelling; -1 for an
// unknown unit.
int bytes_shift_of_unit(const std::string& unit) {
  static const std::pair<const char*, int> kUnits[] = {
      {"", 0},     {"b", 0},  {"k", 10},  {"kb", 10},  {"kib", 10}, {"m", 20},  {"mb", 20},
      {"mib", 20}, {"g", 30}, {"gb", 30}, {"gib", 30}, {"t", 40},   {"tb", 40}, {"tib", 40},
  };
  for (const auto& [name, shift] : kUnits) {
    if (unit == name) return shift;
  }
  return -1;
}

// The text as an error message shows it: control characters (an invisible \x1f, a \n) as
// \xNN escapes, so that the message shows why a text that looks right was refused.
std::string shown(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte != 0x7f) {
      out.push_back(c);
      continue;
    }
    constexpr const char* kHex = "0123456789abcdef";
    out += "\\x";
    out.push_back(kHex[byte >> 4]);
    out.push_back(kHex[byte & 0xf]);
  }
  return out;
}

constexpr const char* kByteSizeForms =
    "expected a number with an optional unit (B, KiB, MiB, GiB, TiB; K, M, G, T and KB, MB, "
    "GB, TB mean the same, all binary), e.g. 1073741824, 512MiB, 8G";

}  // namespace

int64_t parse_byte_size(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && is_space(text[i])) ++i;
  // The number, read digit by digit rather than with strtod (which follows the
  // C locale's decimal point, which an embedding program may have changed):
  // the integer part exactly, in 128 bits, so 2^63 - 1 is 2^63 - 1; a
  // fraction as a numerator over a power of ten.
  unsigned __int128 whole = 0, fraction = 0, denominator = 1;
  bool too_long = false;
  const size_t number_begin = i;
  for (; i < text.size() && is_digit(text[i]); ++i) {
    whole = whole * 10 + (text[i] - '0');
    too_long = too_long || whole > (unsigned __int128)1 << 64;
  }
  const bool has_digits = i > number_begin;
  if (has_digits && i < text.size() && text[i] == '.') {
    for (++i; i < text.size() && is_digit(text[i]); ++i) {
      if (denominator < (unsigned __int128)1 << 64) {  // past 19 digits: ignored, and
        fraction = fraction * 10 + (text[i] - '0');    // rejected below if not 0
        denominator *= 10;
      } else if (text[i] != '0') {
        too_long = true;
      }
    }
  }
  while (i < text.size() && is_space(text[i])) ++i;
  std::string unit;
  while (i < text.size() && is_alpha(text[i])) {
    unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(text[i++]))));
  }
  while (i < text.size() && is_space(text[i])) ++i;
  TORCH_CHECK_VALUE(has_digits && i == text.size(), "pinxfer: cannot read a byte size from '",
                    shown(text), "': ", kByteSizeForms);
  const int shift = bytes_shift_of_unit(unit);
  TORCH_CHECK_VALUE(shift >= 0, "pinxfer: cannot read a byte size from '", shown(text),
                    "': unknown unit '", unit, "'; ", kByteSizeForms);
  constexpr unsigned __int128 kLimit = (unsigned __int128)1 << 63;  // exclusive
  TORCH_CHECK_VALUE(!too_long && whole < kLimit && (whole << shift) < kLimit,
                    "pinxfer: the byte size '", shown(text),
                    "' is too large: at most 2^63 - 1 bytes");
  // A fraction is allowed where it names whole bytes (1.5GiB), never a part
  // of one: "0.5" must not quietly become 0, which means "no cap".
  const unsigned __int128 fraction_bytes = (fraction << shift) / denominator;
  TORCH_CHECK_VALUE((fraction << shift) % denominator == 0, "pinxfer: the byte size '", shown(text),
                    "' is not a whole number of bytes; write it in bytes or a smaller unit "
                    "(e.g. 1536MiB rather than 1.5001GiB)");
  const unsigned __int128 bytes = (whole << shift) + fraction_bytes;
  TORCH_CHECK_VALUE(bytes < kLimit, "pinxfer: the byte size '", shown(text),
                    "' is too large: at most 2^63 - 1 bytes");
  return static_cast<int64_t>(bytes);
}

namespace {
// Above any kernel's CPU count (NR_CPUS is at most 8192 today): an id past it is a mistake,
// and "0-999999999" would otherwise build a 4 GB vector.
constexpr int kMaxCpuId = (1 << 20) - 1;

// One CPU id of a cpulist item; `whole` is the list, for the message.
int parse_cpu_id(const std::string& digits, const std::string& whole) {
  const bool well_formed =
      !digits.empty() && digits.size() <= 9 && std::all_of(digits.begin(), digits.end(), is_digit);
  TORCH_CHECK_VALUE(well_formed, "pinxfer: malformed CPU list '", shown(whole),
                    "': expected comma-separated CPU ids or ranges like 0-3,8");
  const int id = std::stoi(digits);
  TORCH_CHECK_VALUE(id <= kMaxCpuId, "pinxfer: malformed CPU list '", shown(whole), "': CPU id ",
                    id, " is above ", kMaxCpuId, ", more than any kernel has");
  return id;
}
}  // namespace

namespace {
std::string trimmed(const std::string& text) {
  size_t begin = 0, end = text.size();
  while (begin < end && is_space(text[begin])) ++begin;
  while (end > begin && is_space(text[end - 1])) --end;
  return text.substr(begin, end - begin);
}
}  // namespace

std::vector<int> parse_cpulist(const std::string& text) {
  std::vector<int> cpus;
  // Blanks around items and ids are allowed (the kernel's trailing newline, "0-3, 8"); inside
  // an id they are a mistake: "0 1" read as CPU 1 when every blank was dropped (found by
  // review, session 44).
  const std::string list = trimmed(text);
  if (list.empty()) return cpus;  // an empty list is no CPUs
  std::stringstream items(list);
  std::string item;
  while (std::getline(items, item, ',')) {
    item = trimmed(item);
    // An empty item inside a list ("0,,3", "0,") is a mistake.
    TORCH_CHECK_VALUE(!item.empty(), "pinxfer: malformed CPU list '", shown(text),
                      "': an empty item between commas");
    const auto dash = item.find('-');
    if (dash == std::string::npos) {
      cpus.push_back(parse_cpu_id(item, text));
      continue;
    }
    const int lo = parse_cpu_id(trimmed(item.substr(0, dash)), text);
    const int hi = parse_cpu_id(trimmed(item.substr(dash + 1)), text);
    TORCH_CHECK_VALUE(hi >= lo, "pinxfer: malformed CPU list '", shown(text),
                      "': range end below its start");
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string lower_case(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

std::string gomp_word(const std::string& text) {
  const auto blank = [](unsigned char c) { return std::isspace(c) != 0; };
  auto first = std::find_if_not(text.begin(), text.end(), blank);
  auto last = std::find_if_not(text.rbegin(), text.rend(), blank).base();
  return first < last ? lower_case(std::string(first, last)) : std::string();
}

}  // namespace pinxfer
