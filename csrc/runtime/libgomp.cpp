#include "runtime/libgomp.h"

#include <dlfcn.h>
#include <link.h>

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
  // Binding needs both a bind policy and places to bind to: libgomp drops the policy when it
  // cannot make places, and keeps places it was given under OMP_PROC_BIND=false unused.
  answer.binds = gomp.proc_bind() != 0 && gomp.num_places() > 0;
  return answer;
}

}  // namespace pinxfer
