// torch's libgomp, the one its calls resolve to (runtime/libgomp.cpp): the entry points pinxfer
// calls.
// pinxfer is not built with -fopenmp, so at::parallel_for compiled here would run serially and
// `omp_*` calls would bind to no runtime; the team torch uses, and the binding it was given,
// are reached through the libgomp torch loaded (runtime/torch_team.*, runtime/cpu_resources.*).
#pragma once

#include <vector>

namespace pinxfer {

struct Libgomp {
  // The library's file as the loader named it ("" where none was found). Not a std::string:
  // the found object lives to the process's end, with no destructor to run at exit while
  // leaked copy threads may still call into it.
  const char* path = "";
  // GOMP_parallel: `#pragma omp parallel` (GCC's ABI since 4.9): runs fn(data) on the calling
  // thread's team of num_threads (the caller included) and returns when all have.
  void (*parallel)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) = nullptr;
  // omp_get_thread_num: the calling member's place in its team (the caller 0).
  int (*thread_num)() = nullptr;
  // omp_get_proc_bind (the bind-var ICV: 0 is omp_proc_bind_false) and omp_get_num_places:
  // libgomp's own reading of OMP_PROC_BIND, OMP_PLACES and GOMP_CPU_AFFINITY at its load.
  int (*proc_bind)() = nullptr;
  int (*num_places)() = nullptr;
  // omp_get_place_num_procs and omp_get_place_proc_ids: a place's CPUs (reads of libgomp's
  // place list; unlike omp_get_place_num, they bind nothing).
  int (*place_num_procs)(int place) = nullptr;
  void (*place_proc_ids)(int place, int* ids) = nullptr;

  bool found() const { return parallel != nullptr && thread_num != nullptr; }
};

// The libgomp torch calls (looked up once, at pinxfer's import); every pointer null, and the
// path empty, where torch's OpenMP runtime is not libgomp or none is loaded.
const Libgomp& libgomp();

// Whether libgomp bound this process's threads (it then bound the initial thread, the one that
// loaded it, to its first place): asked of libgomp itself, which read the variables at its
// load and rejected the values it could not parse (an OMP_PLACES of blanks or of words it does
// not know, an OMP_PROC_BIND it does not know: each then binds nothing). `known` is false
// where there is no libgomp to ask.
struct OpenmpBinding {
  bool known = false;  // libgomp answered
  bool binds = false;  // meaningful when known
  // When it binds: the CPUs of its places, sorted. libgomp made them within the mask the
  // process had when it loaded (a taskset, a launcher's binding): all of it where the places
  // are one per CPU, core, socket... of that mask, part of it where OMP_PLACES listed or
  // counted them (runtime/cpu_resources.cpp). Empty when unknown.
  std::vector<int> place_cpus;
};
OpenmpBinding libgomp_binding();

}  // namespace pinxfer
