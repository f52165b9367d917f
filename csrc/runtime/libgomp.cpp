#include "runtime/libgomp.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>

namespace pinxfer {

namespace {

// The libgomp that torch's code calls. GOMP_parallel (the version libtorch_cpu asks for) is
// looked up in this library's scope: the process's global scope first (where torch's
// libtorch_global_deps, loaded RTLD_GLOBAL, put its libgomp; and a preloaded runtime), then
// this library's dependencies, libtorch_cpu's libgomp among them. That is the linker's answer
// for libtorch_cpu's own calls too, unless torch was loaded RTLD_DEEPBIND or another runtime
// was loaded RTLD_GLOBAL between torch's import and this lookup (at pinxfer's import). The
// first loaded library named "libgomp" (the lookup until session 51) is another runtime where a
// package that bundles its own copy under another soname (wheels' libgomp-<hash>.so.1,
// scikit-learn's among them) was imported before torch: the copies would then have run on a
// team torch does not use, and its binding been read from a runtime torch does not use. The
// other entry points come from the same library, so that every answer is one runtime's.
Libgomp find_libgomp() {
  Libgomp found;
  void* const parallel = ::dlvsym(RTLD_DEFAULT, "GOMP_parallel", "GOMP_4.0");
  Dl_info where{};
  if (parallel == nullptr || ::dladdr(parallel, &where) == 0 || where.dli_fname == nullptr) {
    return found;
  }
  void* const lib = ::dlopen(where.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (lib == nullptr) return found;
  // LLVM's libomp and Intel's libiomp5 export GOMP_parallel too (for code GCC built), under any
  // name (conda's libgomp.so.1 may be libomp); their teams and settings are not libgomp's
  // (runtime/torch_team.h). Only they export the kmpc entry points.
  const bool is_libgomp = ::dlsym(lib, "__kmpc_fork_call") == nullptr;
  if (is_libgomp) {
    found.path = where.dli_fname;  // the link map's name: kept while the library is loaded
    found.parallel = reinterpret_cast<decltype(found.parallel)>(parallel);
    found.thread_num =
        reinterpret_cast<decltype(found.thread_num)>(::dlsym(lib, "omp_get_thread_num"));
    found.proc_bind =
        reinterpret_cast<decltype(found.proc_bind)>(::dlsym(lib, "omp_get_proc_bind"));
    found.num_places =
        reinterpret_cast<decltype(found.num_places)>(::dlsym(lib, "omp_get_num_places"));
    found.place_num_procs =
        reinterpret_cast<decltype(found.place_num_procs)>(::dlsym(lib, "omp_get_place_num_procs"));
    found.place_proc_ids =
        reinterpret_cast<decltype(found.place_proc_ids)>(::dlsym(lib, "omp_get_place_proc_ids"));
  }
  ::dlclose(lib);  // NOLOAD took a reference to a library that stays loaded
  return found.found() ? found : Libgomp{};
}

}  // namespace

const Libgomp& libgomp() {
  static const Libgomp found = find_libgomp();
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
