#include "runtime/libgomp.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <cstring>

namespace pinxfer {

namespace {

int find_libgomp(struct dl_phdr_info* info, size_t, void* out) {
  if (info->dlpi_name == nullptr || std::strstr(info->dlpi_name, "libgomp") == nullptr) return 0;
  void* lib = ::dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
  if (lib == nullptr) return 0;
  Libgomp found;
  found.parallel = reinterpret_cast<decltype(found.parallel)>(::dlsym(lib, "GOMP_parallel"));
  found.thread_num =
      reinterpret_cast<decltype(found.thread_num)>(::dlsym(lib, "omp_get_thread_num"));
  found.proc_bind = reinterpret_cast<decltype(found.proc_bind)>(::dlsym(lib, "omp_get_proc_bind"));
  found.num_places =
      reinterpret_cast<decltype(found.num_places)>(::dlsym(lib, "omp_get_num_places"));
  found.place_num_procs =
      reinterpret_cast<decltype(found.place_num_procs)>(::dlsym(lib, "omp_get_place_num_procs"));
  found.place_proc_ids =
      reinterpret_cast<decltype(found.place_proc_ids)>(::dlsym(lib, "omp_get_place_proc_ids"));
  ::dlclose(lib);  // NOLOAD took a reference to a library that stays loaded
  if (!found.found()) return 0;
  *static_cast<Libgomp*>(out) = found;
  return 1;
}

}  // namespace

const Libgomp& libgomp() {
  static const Libgomp found = [] {
    Libgomp g;
    ::dl_iterate_phdr(&find_libgomp, &g);
    return g;
  }();
  return found;
}

OpenmpBinding libgomp_binding() {
  const Libgomp& gomp = libgomp();
  OpenmpBinding answer;
  if (gomp.proc_bind == nullptr || gomp.num_places == nullptr) return answer;
  answer.known = true;
  // libgomp binds where it has a policy other than false and places to bind to: under
  // OMP_PROC_BIND=false it makes no places, and where it cannot make places (an unparsable
  // OMP_PLACES) it keeps a policy with nothing to apply it to.
  const int places = gomp.num_places();
  answer.binds = gomp.proc_bind() != 0 && places > 0;
  if (!answer.binds || gomp.place_num_procs == nullptr || gomp.place_proc_ids == nullptr) {
    return answer;
  }
  for (int place = 0; place < places; ++place) {
    const int procs = gomp.place_num_procs(place);
    if (procs <= 0) continue;
    std::vector<int> ids(static_cast<size_t>(procs));
    gomp.place_proc_ids(place, ids.data());
    answer.place_cpus.insert(answer.place_cpus.end(), ids.begin(), ids.end());
  }
  std::sort(answer.place_cpus.begin(), answer.place_cpus.end());
  answer.place_cpus.erase(std::unique(answer.place_cpus.begin(), answer.place_cpus.end()),
                          answer.place_cpus.end());
  return answer;
}

}  // namespace pinxfer
