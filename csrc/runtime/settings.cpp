#include "runtime/settings.h"

#include <c10/util/Exception.h>

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>

#include "runtime/parse.h"
#include "runtime/thread_budget.h"
#include "runtime/topology.h"

namespace pinxfer {

namespace {

[[noreturn]] void bad_env(const char* name, const std::string& value, const std::string& expected) {
  TORCH_CHECK_VALUE(false, name, ": expected ", expected, ", got '", value,
                    "'. Fix or unset it (pinxfer reads its environment once, at first use).");
}

// An integer in [min, max], or bad_env saying so. Digits only: no sign, no
// spaces, no "1e3", so what doctor shows is exactly the number in force.
int64_t env_int(const char* name, const std::string& value, int64_t min, int64_t max) {
  const bool digits =
      !value.empty() && value.size() <= 18 &&
      std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
  const int64_t n = digits ? std::stoll(value) : -1;
  if (!digits || n < min || n > max) {
    bad_env(name, value, "an integer from " + std::to_string(min) + " to " + std::to_string(max));
  }
  return n;
}

// A byte size (runtime/parse.h forms), or bad_env naming `examples`.
int64_t env_bytes(const char* name, const std::string& value, const char* examples) {
  try {
    return parse_byte_size(value);
  } catch (const std::exception&) {
    bad_env(name, value, std::string("a byte size such as ") + examples);
  }
}

// A switch: 'auto' (true) or 'off' (false), or bad_env quoting what each means.
bool env_auto_or_off(const char* name, const std::string& value, const char* what_auto,
                     const char* what_off) {
  if (value != "auto" && value != "off") {
    bad_env(name, value, std::string("'auto' (") + what_auto + ") or 'off' (" + what_off + ")");
  }
  return value == "auto";
}

// One of `names` (a settings.h list), or bad_env with `expected` (what each name means).
template <size_t N>
const std::string& env_one_of(const char* name, const std::string& value,
                              const char* const (&names)[N], const char* expected) {
  if (name_index(names, value) < 0) bad_env(name, value, expected);
  return value;
}

// One variable. `parse` reads its text into the settings and returns the value
// doctor shows; `unset` fills in what applies without it and returns the same.
// Rows run in table order, so a row may use what an earlier row set (the sysfs
// root, LOCAL_WORLD_SIZE in the CPU resources).
struct Row {
  const char* name;
  const char* doc;
  std::string (*parse)(const char* name, const std::string& text, Settings& s);
  std::string (*unset)(Settings& s);
  const char* unset_source;  // "default" or "derived"
};

const Row kRows[] = {
    {"PINXFER_SYSFS_ROOT", "where sysfs is read (tests point it at a built tree)",
     [](const char* name, const std::string& text, Settings& s) {
       // A mistyped root read as "no NUMA nodes": every pool unbound, without a word.
       struct stat st{};
       const std::string system = text + "/devices/system";
       if (stat(system.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
         bad_env(name, text, "a sysfs tree (a directory holding devices/system)");
       }
       return s.sysfs_root = text;
     },
     [](Settings& s) { return s.sysfs_root; }, "default"},

    {"PINXFER_DISABLE_CUDA", "1: never touch CUDA (the pool mlocks)",
     [](const char* name, const std::string& text, Settings& s) {
       if (text != "0" && text != "1") bad_env(name, text, "1 (never touch CUDA) or 0");
       s.disable_cuda = text == "1";
       return text;
     },
     [](Settings&) { return std::string("0"); }, "default"},

    {"PINXFER_NUMA_NODE", "-1 or 'none' (no binding), or the node every pool uses",
     [](const char* name, const std::string& text, Settings& s) {
       if (text == "none" || text == "-1") {
         s.numa_node = -1;
       } else {
         // The same rule as the numa_node argument (memory/placement.h): -1 or a
         // node this machine has.
         std::vector<int> nodes = online_nodes(s.sysfs_root);
         if (nodes.empty()) nodes.push_back(0);
         const int64_t node = env_int(name, text, 0, nodes.back());
         if (std::find(nodes.begin(), nodes.end(), node) == nodes.end()) {
           bad_env(name, text, "-1, 'none' or a NUMA node of this machine");
         }
         s.numa_node = static_cast<int>(node);
       }
       return std::to_string(s.numa_node);
     },
     [](Settings&) { return std::string("the GPU's node (sysfs)"); }, "default"},

    {"PINXFER_MAX_PINNED_BYTES", "cap on the bytes all pools pin (0: none)",
     [](const char* name, const std::string& text, Settings& s) {
       s.max_pinned_bytes = env_bytes(name, text, "8GiB, 512MiB or 1073741824");
       return std::to_string(s.max_pinned_bytes);
     },
     [](Settings&) { return std::string("0 (no cap)"); }, "default"},

    {"LOCAL_WORLD_SIZE", "torchrun's ranks on this host: they share its CPUs",
     [](const char*, const std::string& text, Settings& s) {
       // torchrun's variable: not ours to reject; a value we cannot read means 1.
       char* end = nullptr;
       errno = 0;
       const long ranks = std::strtol(text.c_str(), &end, 10);  // atoi's overflow is undefined
       // The whole text, as the other variables are read ("4x" and "0x8" read as 4 and 0, and
       // doctor showed a value no one wrote: review, session 44); a trailing newline is fine.
       while (end != nullptr && (*end == ' ' || *end == '\t' || *end == '\n')) ++end;
       const bool read =
           errno == 0 && end != text.c_str() && *end == '\0' && ranks >= 1 && ranks <= INT32_MAX;
       s.cpus.local_world_size = read ? static_cast<int>(ranks) : 1;
       return std::to_string(s.cpus.local_world_size);
     },
     [](Settings&) { return std::string("1"); }, "default"},

    {"PINXFER_NUM_THREADS", "copy threads of the process, split among NUMA nodes",
     [](const char* name, const std::string& text, Settings& s) {
       s.copy_threads = static_cast<int>(env_int(name, text, 1, max_copy_threads(s.cpus)));
       s.copy_threads_from_env = true;
       return std::to_string(s.copy_threads);
     },
     [](Settings& s) {
       std::string why;
       s.copy_threads = copy_threads_for(s.cpus, &why);
       return std::to_string(s.copy_threads) + " (" + why + ")";
     },
     "derived"},

    {"PINXFER_SPIN_US", "microseconds an idle copy thread spins before it sleeps",
     [](const char* name, const std::string& text, Settings& s) {
       s.spin_us = static_cast<int>(env_int(name, text, 0, kMaxSpinUs));
       s.spin_adaptive = false;
       return std::to_string(s.spin_us);
     },
     [](Settings& s) {
       return std::to_string(s.spin_us) +
              ", or an eighth of the pool's last job if longer (at most " +
              std::to_string(kMaxAdaptiveSpinUs) + ")";
     },
     "default"},

    {"PINXFER_STAGE_COPY", "staging stores when a transfer says 'auto': auto, nt or movsb",
     [](const char* name, const std::string& text, Settings& s) {
       return s.stage_copy =
                  env_one_of(name, text, kStagingModeNames,
                             "'auto', 'nt' (nontemporal stores) or 'movsb' (cached stores)");
     },
     [](Settings& s) { return s.stage_copy; }, "default"},

    {"PINXFER_CACHED_TAIL", "bytes at a transfer's end staged nontemporal under 'auto'",
     [](const char* name, const std::string& text, Settings& s) {
       s.cached_tail = env_bytes(name, text, "16MiB or 0");
       return std::to_string(s.cached_tail);
     },
     [](Settings&) {
       return std::string(
           "16MiB (0 while the copy stream is busy; the small road: cached above 4KiB)");
     },
     "default"},

    {"PINXFER_TORCH_TEAM", "host copies run on torch's intra-op team while it spins: auto or off",
     [](const char* name, const std::string& text, Settings& s) {
       s.torch_team = env_auto_or_off(name, text, "on torch's team while it is awake", "never");
       return text;
     },
     [](Settings&) { return std::string("auto"); }, "default"},

    {"PINXFER_TEAM_PROBE",
     "how a host copy asks whether torch's team is awake: proc (a member's /proc state) or "
     "clock (whether a member's CPU clock runs)",
     [](const char* name, const std::string& text, Settings& s) {
       const std::string& mode =
           env_one_of(name, text, kTeamProbeNames,
                      "'proc' (the default: read one member's state from /proc) or 'clock' "
                      "(read one member's thread CPU clock twice)");
       s.team_probe_clock = mode == "clock";
       return mode;
     },
     [](Settings&) { return std::string("proc"); }, "default"},

    {"PINXFER_IDLE_RECLAIM",
     "pin_memory takes back a small block in its stream's fence batch when the stream is "
     "idle: auto or off",
     [](const char* name, const std::string& text, Settings& s) {
       s.idle_reclaim =
           env_auto_or_off(name, text,
                           "one stream query when the batch holds a block of the size asked for",
                           "wait for the batch's marker");
       return text;
     },
     [](Settings&) { return std::string("auto"); }, "default"},

    {"PINXFER_SENDER_LANDING",
     "how prefetch's batch sender knows a batch has landed: auto, flag or event",
     [](const char* name, const std::string& text, Settings& s) {
       return s.sender_landing = env_one_of(
                  name, text, kSenderLandingNames,
                  "'auto' (the default: a host function only after long consumer steps), 'flag' "
                  "(a host function after each batch) or 'event' (take() asks the batch's event)");
     },
     [](Settings& s) { return s.sender_landing; }, "default"},

    {"PINXFER_SENDER_WORKERS",
     "threads of prefetch's batch sender per GPU: batches sent at once (1: one at a time)",
     [](const char* name, const std::string& text, Settings& s) {
       s.sender_workers = static_cast<int>(env_int(name, text, 1, kMaxSenderWorkers));
       return std::to_string(s.sender_workers);
     },
     [](Settings& s) { return std::to_string(s.sender_workers); }, "default"},

    {"PINXFER_SENDER_OUTPUTS",
     "whose stream prefetch's batch sender makes a batch's device memory on: worker, consumer or "
     "auto",
     [](const char* name, const std::string& text, Settings& s) {
       return s.sender_outputs = env_one_of(
                  name, text, kSenderOutputsNames,
                  "'worker' (the sender's worker allocates on its own stream, the consumer "
                  "records its use at each take), 'consumer' (allocated at submit on the "
                  "consumer's current stream, which owns it from then on) or 'auto' (the "
                  "default: consumer after short consumer steps, worker after long ones)");
     },
     [](Settings& s) { return s.sender_outputs; }, "default"},

    {"PINXFER_H2D_READ",
     "who reads to_device's bytes staged with cached stores: auto, engine or kernel",
     [](const char* name, const std::string& text, Settings& s) {
       return s.h2d_read = env_one_of(
                  name, text, kStagedReaderNames,
                  "'auto' (the default: a kernel reads them when the caller works on the "
                  "device's default stream and it is idle, the copy engine otherwise), 'engine' "
                  "(always the copy engine) or 'kernel' (always a kernel)");
     },
     [](Settings& s) { return s.h2d_read; }, "default"},

    // libgomp's, read and never set: after a region torch's team spins (libgomp: 300000 spins
    // by default) unless these say otherwise; pinxfer then asks /proc at every copy.
    {"OMP_WAIT_POLICY",
     "libgomp's: 'passive' stops torch's team spinning after a region (then the torch-team "
     "probe reads /proc at every copy)",
     [](const char*, const std::string& text, Settings& s) {
       return s.omp_wait_policy = gomp_word(text);
     },
     [](Settings&) { return std::string("(unset: torch's team spins after each region)"); },
     "default"},

    {"GOMP_SPINCOUNT",
     "libgomp's: how long torch's team spins after a region; where set (not blank), the "
     "torch-team probe reads /proc at every copy",
     [](const char*, const std::string& text, Settings& s) {
       return s.gomp_spincount = gomp_word(text);
     },
     [](Settings&) { return std::string("(unset: libgomp's 300000 spins)"); }, "default"},
};

Settings read_settings() {
  Settings s;
  s.cpus = current_cpu_resources();  // the kernel's answers; the rows add LOCAL_WORLD_SIZE
  for (const Row& row : kRows) {
    const char* raw = std::getenv(row.name);  // each variable read once, here
    const bool set = raw != nullptr && *raw != '\0';
    std::string value = set ? row.parse(row.name, raw, s) : row.unset(s);
    s.items.push_back({row.name, std::move(value), set ? "env" : row.unset_source, row.doc});
  }
  return s;
}

}  // namespace

const Settings& settings() {
  // Built once; a malformed variable is reported at every call, never replaced
  // by a default.
  static const auto* result = [] {
    auto* r = new std::pair<Settings, std::string>();  // leaked: used at exit
    try {
      r->first = read_settings();
    } catch (const c10::Error& e) {
      r->second = e.what_without_backtrace();
    }
    return r;
  }();
  TORCH_CHECK_VALUE(result->second.empty(), result->second);
  return result->first;
}

}  // namespace pinxfer
