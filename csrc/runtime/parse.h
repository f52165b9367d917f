// The two small text formats pinxfer reads (and the lower-casing of names read
// case-insensitively), parsed in one place so that C++
// (the pinned cap from PINXFER_MAX_PINNED_BYTES, sysfs cpulist files) and
// Python (through the ops parse_byte_size and parse_cpulist) accept exactly
// the same text.
//
// Both throw c10::ValueError (Python: ValueError) on malformed text; the
// message quotes the text and says which forms are accepted. Stateless and
// thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pinxfer {

// A byte size: a number (digits, optionally a fraction) and an optional unit,
// with optional blanks around both: "1073741824", "512MiB", "8G", "1.5 GiB".
// Units are binary and case-insensitive: B; K, KB, KiB; M, MB, MiB; G, GB, GiB;
// T, TB, TiB (KB means KiB, as in memlock limits). A fraction of a byte is
// dropped. Sizes of 2^63 bytes and more are rejected.
int64_t parse_byte_size(const std::string& text);

// A kernel CPU list such as "0-3,8,10-11" (sysfs cpulist): sorted, without
// duplicates. Blanks and a trailing newline are ignored; "" is no CPUs.
std::vector<int> parse_cpulist(const std::string& text);

// `text` with its ASCII letters lower-cased: for names read case-insensitively (a PCI bus id
// against sysfs, libgomp's variables).
std::string lower_case(std::string text);

// A word of a libgomp variable as libgomp reads it (env.c skips blanks before and after the
// word, and compares case-insensitively): `text` without its leading and trailing ASCII
// blanks, lower-cased. "  PASSIVE\n" is "passive"; blanks only are "".
std::string gomp_word(const std::string& text);

}  // namespace pinxfer
