// pinxfer._C's transfer functions (csrc/python/bindings.h): the chunk plan (pure
// arithmetic of csrc/transfer/chunk_plan.h, so that CPU tests can check every
// plan's invariants without a GPU), a staging copy timed alone (diagnostics), and in CUDA builds
// the copy stream and the release of finished pinned sources (kernels in
// csrc/ops/cuda/to_device_cuda.cpp).
#include <tuple>
#include <vector>

#include "ops/kernels.h"
#include "python/bindings.h"
#include "runtime/settings.h"
#include "runtime/steady_time.h"
#include "transfer/chunk_plan.h"
#include "transfer/piece_claims.h"
#include "transfer/stage_copy.h"
#if PINXFER_WITH_CUDA
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/device_lazy_init.h>

#include "ops/cuda/batch_sender.h"
#include "python/plain_batch.h"
#include "runtime/step_stamps.h"
#include "transfer/cuda/pipeline.h"
#endif

namespace pinxfer::python {

namespace {

// The diagnostics below read and write a tensor's bytes on the calling thread: only a
// contiguous CPU tensor has them in one range.
void check_plain_cpu_bytes(const at::Tensor& t, const char* what, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), what, ": expected ", name, " on the CPU, got ",
                    t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), what, ": expected ", name,
                    " contiguous (one range of bytes); call .contiguous() first");
}

std::tuple<std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t, int64_t> chunk_plan(
    int64_t nbytes, int64_t chunk_bytes, int64_t num_buffers, int64_t num_threads) {
  TORCH_CHECK_VALUE(nbytes >= 0 && chunk_bytes >= 4096 && num_buffers >= 1 && num_threads >= 1,
                    "pinxfer._chunk_plan: expected nbytes >= 0, chunk_bytes >= 4096, "
                    "num_buffers >= 1, num_threads >= 1; got ",
                    nbytes, ", ", chunk_bytes, ", ", num_buffers, ", ", num_threads);
  const transfer::ChunkPlan plan =
      transfer::plan_chunks(static_cast<size_t>(nbytes), static_cast<size_t>(chunk_bytes),
                            static_cast<size_t>(num_buffers), static_cast<size_t>(num_threads));
  std::vector<int64_t> bounds(plan.bounds.begin(), plan.bounds.end());
  // Pieces flattened as (chunk, begin, end) triples.
  std::vector<int64_t> pieces;
  for (const auto& p : plan.pieces) {
    pieces.insert(pieces.end(), {static_cast<int64_t>(p.chunk), static_cast<int64_t>(p.begin),
                                 static_cast<int64_t>(p.end)});
  }
  return {bounds, pieces, static_cast<int64_t>(plan.ring), static_cast<int64_t>(plan.slot_bytes),
          static_cast<int64_t>(plan.threads)};
}

#if PINXFER_WITH_CUDA
// A job of a BatchSender as Python holds it (the job's type is the sender's own).
struct SendTicket {
  std::shared_ptr<ops::BatchSender::Job> job;
  // submit_batch_if_plain's: the batch's layout, to rebuild it at take_batch (destroyed with
  // the ticket, a Python object, so under the GIL); null for submit()'s tickets.
  std::shared_ptr<PlainBatch> batch;
};

// A SingleBlockTrace as a dict (_last_single_block_trace, BatchSender._job_traces).
pybind11::dict single_block_trace_dict(const transfer::SingleBlockTrace& t) {
  pybind11::dict d;
  d["on_torch_team"] = t.on_torch_team;
  d["nbytes"] = t.nbytes;
  d["pieces"] = t.pieces;
  d["helpers_offered"] = t.helpers_offered;
  d["own_pieces"] = t.own_pieces;
  d["helper_pieces"] = t.helper_pieces;
  d["stolen"] = t.stolen;
  d["dma_spans"] = t.dma_spans;
  d["kernel_reads"] = t.kernel_reads;
  d["setup_us"] = t.setup_us;
  d["alloc_us"] = t.alloc_us;
  d["own_done_us"] = t.own_done_us;
  d["total_us"] = t.total_us;
  d["offered_us"] = t.offered_us;
  d["first_queued_us"] = t.first_queued_us;
  d["last_queued_us"] = t.last_queued_us;
  d["first_helper_us"] = t.first_helper_us;
  d["mustered_ns"] = t.mustered_ns;
  d["entry_us"] = t.entry_us;
  d["probed_us"] = t.probed_us;
  d["checked_us"] = t.checked_us;
  d["streams_us"] = t.streams_us;
  d["output_us"] = t.output_us;
  d["first_own_done_us"] = t.first_own_done_us;
  d["own_stage_us"] = t.own_stage_us;
  d["gate_us"] = t.gate_us;
  d["gate_queries"] = t.gate_queries;
  d["queue_us"] = t.queue_us;
  d["reader_wait_us"] = t.reader_wait_us;
  return d;
}

// A PackTrace as a dict (_last_pack_trace, BatchSender._job_traces).
pybind11::dict pack_trace_dict(const transfer::PackTrace& t) {
  pybind11::dict d;
  d["nbytes"] = t.nbytes;
  d["tensors"] = t.tensors;
  d["entered_ns"] = t.entered_ns;
  d["checked_us"] = t.checked_us;
  d["output_us"] = t.output_us;
  d["block_us"] = t.block_us;
  d["staged_us"] = t.staged_us;
  d["queued_us"] = t.queued_us;
  d["returned_us"] = t.returned_us;
  d["total_us"] = t.total_us;
  return d;
}

// BatchSender.submit_batch_if_plain and take_batch: prefetch's two calls of every steady step on
// the sender road, as METH_FASTCALL method descriptors of the pybind11 class rather than pybind11
// methods, whose dispatcher and argument casters cost each call 100-170 ns more on the 2-core
// machine (a stand-in class built both ways, session 39) and several times that on the GPU hosts,
// where the step's Python and calls run slower (csrc/README.md, "The sender road").
const char* const kSubmitBatch = "BatchSender.submit_batch_if_plain";
const char* const kTakeBatch = "BatchSender.take_batch";

// submit_batch_if_plain(batch, chunk_bytes, num_buffers) -> ticket | None. As
// to_device_batch_if_plain (plain_calls.cpp): prefetch's step takes the batch apart here and
// rebuilds it in take_batch, not in Python (plain_batch, rebuilt_batch and the list conversions of
// submit / take).
PyObject* submit_batch_if_plain(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  int64_t chunk_bytes = 0;
  int64_t num_buffers = 0;
  if (!check_arity(kSubmitBatch, nargs, 3) ||
      !parse_int(kSubmitBatch, "chunk_bytes", args[1], chunk_bytes) ||
      !parse_int(kSubmitBatch, "num_buffers", args[2], num_buffers)) {
    return nullptr;
  }
  if (!send_may_skip_dispatch()) Py_RETURN_NONE;
  const int64_t entered = ops::sender_tracing() ? steady_now_ns() : 0;
  auto plain = std::make_shared<PlainBatch>();
  if (!plain->take(args[0])) Py_RETURN_NONE;
  // `self` is a BatchSender: the method descriptor checked its type.
  auto& sender = pybind11::cast<ops::BatchSender&>(pybind11::handle(self));
  return pybind11::cast(
             SendTicket{sender.submit(plain->leaves(), chunk_bytes, num_buffers, entered), plain})
      .release()
      .ptr();
  END_HANDLE_TH_ERRORS
}

// take_batch(ticket) -> batch.
PyObject* take_batch(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_arity(kTakeBatch, nargs, 1)) return nullptr;
  const pybind11::handle ticket_obj(args[0]);
  if (!pybind11::isinstance<SendTicket>(ticket_obj)) {
    PyErr_Format(PyExc_TypeError,
                 "pinxfer._C.%s: expected a ticket of submit_batch_if_plain, got %s", kTakeBatch,
                 Py_TYPE(args[0])->tp_name);
    return nullptr;
  }
  auto& ticket = pybind11::cast<SendTicket&>(ticket_obj);
  TORCH_CHECK(
      ticket.batch != nullptr,
      "pinxfer: take_batch() is for submit_batch_if_plain's tickets; take() takes submit()'s");
  auto& sender = pybind11::cast<ops::BatchSender&>(pybind11::handle(self));
  std::vector<at::Tensor> results;
  {
    pybind11::gil_scoped_release no_gil;  // the wait, as take()
    results = sender.take(ticket.job);
  }
  return ticket.batch->rebuilt(std::move(results));  // nullptr with a Python error set
  END_HANDLE_TH_ERRORS
}

// Method descriptors hold their PyMethodDef: static.
PyMethodDef g_sender_fast_methods[] = {
    {"submit_batch_if_plain",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&submit_batch_if_plain)), METH_FASTCALL,
     "submit_batch_if_plain(batch, chunk_bytes, num_buffers) -> ticket | None: submit() of a batch "
     "to_device_batch_if_plain would take (a dict, list or tuple of plain dense CPU tensors or of "
     "exact lists / tuples of them, two tensors at least), taken with take_batch(); None for any "
     "other batch, or while a mode is active or torch's profiler runs"},
    {"take_batch", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&take_batch)),
     METH_FASTCALL,
     "take_batch(ticket) -> batch: take() of a submit_batch_if_plain ticket, the batch rebuilt "
     "(same type, keys and lists) around its tensors on the device"},
};

void bind_batch_sender(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<SendTicket>(m, "_SendTicket",
                         "A batch submitted to a BatchSender; BatchSender.take(ticket) once");
  // Only the process's senders reach Python (batch_sender below), and they are never
  // destroyed: Python holds them without owning them.
  py::class_<ops::BatchSender, std::unique_ptr<ops::BatchSender, py::nodelete>>(
      m, "BatchSender",
      "The process's sender of plain CPU tensors to one GPU, by threads of its own "
      "(PINXFER_SENDER_WORKERS; pinxfer.prefetch's sender road; csrc/ops/cuda/batch_sender.h): "
      "batch_sender(device)")
      .def("submit",
           torch::wrap_pybind_function([](ops::BatchSender& sender, std::vector<at::Tensor> leaves,
                                          int64_t chunk_bytes, int64_t num_buffers) {
             return SendTicket{sender.submit(std::move(leaves), chunk_bytes, num_buffers)};
           }),
           "submit(leaves: list[Tensor], chunk_bytes, num_buffers) -> ticket: queues plain "
           "dense CPU tensors (the caller checked them) to be sent with to_device's staging "
           "settings; returns at once")
      .def("take",
           torch::wrap_pybind_function_no_gil([](ops::BatchSender& sender, SendTicket& ticket) {
             return sender.take(ticket.job);
           }),
           "take(ticket) -> list[Tensor]: the sent tensors, usable on the current stream "
           "(waits for the send; raises what it raised)")
      .def("settle",
           torch::wrap_pybind_function_no_gil(
               [](ops::BatchSender& sender, SendTicket& ticket) { sender.settle(ticket.job); }),
           "settle(ticket): a batch that will not be taken: dropped if not started, else "
           "waited for until its copies are queued")
      .def_property_readonly("submitted", &ops::BatchSender::submitted, "batches submitted so far")
      .def_property_readonly("workers", &ops::BatchSender::workers,
                             "its worker threads (PINXFER_SENDER_WORKERS when it was made)")
      .def_property_readonly("warmed_workers", &ops::BatchSender::warmed_workers,
                             "workers that made their first CUDA calls before batch_sender() "
                             "returned (all of them)")
      .def_property_readonly("taken", &ops::BatchSender::taken, "batches taken so far")
      .def_property_readonly("taken_landed", &ops::BatchSender::taken_landed,
                             "batches whose copies had landed when taken (no stream wait)")
      .def_property_readonly("sent_flagged", &ops::BatchSender::sent_flagged,
                             "batches sent with a landing host function "
                             "(PINXFER_SENDER_LANDING)")
      .def_property_readonly(
          "outputs",
          [](const ops::BatchSender& sender) {
            return std::string(kSenderOutputsNames[static_cast<int>(sender.outputs_mode())]);
          },
          "PINXFER_SENDER_OUTPUTS when it was made, or as _set_outputs set it: worker, consumer "
          "or auto")
      .def(
          "_set_outputs",
          [](ops::BatchSender& sender, const std::string& name) {
            const int index = name_index(kSenderOutputsNames, name);
            TORCH_CHECK_VALUE(index >= 0,
                              "pinxfer: _set_outputs expects worker, consumer or auto, got ", name);
            sender.set_outputs_mode(static_cast<ops::BatchSender::OutputsMode>(index));
          },
          "DIAGNOSTIC: _set_outputs(name): the outputs setting (PINXFER_SENDER_OUTPUTS) for "
          "batches submitted from now on, each keeping its own; for timing settings in one "
          "process (benchmarks/diag_sender.py's 'owned' way)")
      .def_property_readonly("taken_owned", &ops::BatchSender::taken_owned,
                             "batches taken on the stream their outputs were made on (no stream "
                             "use recorded)")
      .def(
          "_job_traces",
          [](const ops::BatchSender& sender) {
            pybind11::list out;
            for (const ops::BatchSender::JobTrace& j : sender.job_traces()) {
              pybind11::dict d;
              d["entered_ns"] = j.entered_ns;
              d["outputs_ns"] = j.outputs_ns;
              d["submitted_ns"] = j.submitted_ns;
              d["queued_ns"] = j.queued_ns;
              d["started_ns"] = j.started_ns;
              d["sent_ns"] = j.sent_ns;
              d["take_entered_ns"] = j.take_entered_ns;
              d["waited_ns"] = j.waited_ns;
              d["taken_ns"] = j.taken_ns;
              d["recorded_ns"] = j.recorded_ns;
              d["bytes"] = j.bytes;
              d["flagged"] = j.flagged;
              d["landed"] = j.landed;
              d["block"] = j.has_block ? pybind11::object(single_block_trace_dict(j.block))
                                       : pybind11::object(pybind11::none());
              d["pack"] = j.has_pack ? pybind11::object(pack_trace_dict(j.pack))
                                     : pybind11::object(pybind11::none());
              out.append(d);
            }
            return out;
          },
          "DIAGNOSTIC: _job_traces() -> list[dict]: the last taken jobs traced while "
          "_set_sender_tracing(True) was on, oldest first: entered_ns, outputs_ns (a duration), "
          "submitted_ns, queued_ns, "
          "started_ns, sent_ns, take_entered_ns, waited_ns, taken_ns, recorded_ns "
          "(time.perf_counter_ns's clock; BatchSender::JobTrace says what each marks), bytes, "
          "flagged, landed, block (the "
          "_last_single_block_trace of its pipelined leaf on the sender's thread, or None) and "
          "pack (the _last_pack_trace of its packed small leaves there, or None)");
  // The two fast methods (above) join the class as method descriptors: called on a BatchSender
  // with the sender as `self`, as pybind11's methods are, with no dispatcher in between.
  PyObject* sender_type = m.attr("BatchSender").ptr();
  for (PyMethodDef& def : g_sender_fast_methods) {
    PyObject* descr = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(sender_type), &def);
    const bool added =
        descr != nullptr && PyObject_SetAttrString(sender_type, def.ml_name, descr) == 0;
    Py_XDECREF(descr);
    if (!added) throw py::error_already_set();
  }
  m.def("_set_sender_tracing", &ops::set_sender_tracing,
        "DIAGNOSTIC: _set_sender_tracing(on): batch senders record each taken job's times "
        "(BatchSender._job_traces)");
  m.def("batch_sender", torch::wrap_pybind_function([](c10::Device device) {
          TORCH_CHECK_VALUE(device.is_cuda() && device.has_index(),
                            "pinxfer: batch_sender needs a CUDA device with an index, got ",
                            device);
          // torch's own lazy CUDA init (torch.cuda._lazy_init, run here with the GIL held)
          // before the sender's threads make CUDA calls of their own. Left to happen later,
          // it ran on the caller's thread while the workers made their first CUDA calls:
          // its dlopen of NVML and the workers' first calls into the driver deadlocked in
          // the dynamic loader's locks, every thread asleep (H200: 6 of 66 fresh processes
          // of test_sender_workers_hand_every_batch_over_whole's child with three workers,
          // session 35). A forked child gets torch's clear error here.
          torch::utils::device_lazy_init(at::kCUDA);
          // A new sender waits for its workers' first CUDA calls (BatchSender::warm_workers),
          // which need no Python.
          py::gil_scoped_release no_gil;
          return &ops::batch_sender_for(device.index());
        }),
        py::return_value_policy::reference,
        "batch_sender(device) -> BatchSender: the process's sender for a CUDA device with an "
        "index (made at the first call, never destroyed)");
}
#endif

}  // namespace

void bind_transfer(pybind11::module_& m) {
  using torch::wrap_pybind_function_no_gil;
  m.def("_chunk_plan", wrap_pybind_function_no_gil(&chunk_plan),
        "TEST-ONLY: _chunk_plan(nbytes, chunk_bytes, num_buffers, num_threads) -> (chunk "
        "bounds, pieces as (chunk, begin, end) triples, ring slots (0: one block), slot bytes, "
        "threads): how to_device would cut a transfer");
  m.def(
      "_small_copy_kind",
      [](const std::string& staging, int64_t cached_tail, int64_t nbytes) {
        TORCH_CHECK_VALUE(nbytes >= 0, "pinxfer._small_copy_kind: expected nbytes >= 0, got ",
                          nbytes);
        const transfer::StageCopy kind =
            transfer::small_copy_kind(parse_staging_mode(staging,
                                                         "pinxfer._small_copy_kind: staging"),
                                      cached_tail, static_cast<size_t>(nbytes));
        return std::string(kind == transfer::StageCopy::kCached ? "movsb" : "nt");
      },
      "TEST-ONLY: _small_copy_kind(staging, cached_tail, nbytes) -> 'nt' or 'movsb': the stores "
      "the caller's copy of a small to_device uses (cached_tail < 0: auto)");
  m.def(
      "_stage_copy_ns",
      [](const at::Tensor& dst, const at::Tensor& src, const std::string& kind) {
        const char* const what = "pinxfer._stage_copy_ns";
        check_plain_cpu_bytes(dst, what, "dst");
        check_plain_cpu_bytes(src, what, "src");
        TORCH_CHECK_VALUE(dst.nbytes() == src.nbytes(), what,
                          ": expected dst and src of the same bytes, got ", dst.nbytes(), " and ",
                          src.nbytes());
        char* const to = static_cast<char*>(dst.data_ptr());
        const char* const from = static_cast<const char*>(src.data_ptr());
        const size_t n = dst.nbytes();
        TORCH_CHECK_VALUE(n == 0 || to + n <= from || from + n <= to, what,
                          ": expected dst and src not to overlap (a staging copy's source and "
                          "its pinned block never do)");
        const int mode = name_index(kStagingModeNames, kind);
        TORCH_CHECK_VALUE(mode == static_cast<int>(StagingMode::kNontemporal) ||
                              mode == static_cast<int>(StagingMode::kCached),
                          what, ": expected kind 'nt' or 'movsb', got '", kind, "'");
        const transfer::StageCopy stores = mode == static_cast<int>(StagingMode::kCached)
                                               ? transfer::StageCopy::kCached
                                               : transfer::StageCopy::kNontemporal;
        pybind11::gil_scoped_release no_gil;
        const int64_t start = steady_now_ns();
        transfer::stage_copy(to, from, n, stores);
        return steady_now_ns() - start;
      },
      pybind11::arg("dst"), pybind11::arg("src"), pybind11::arg("kind"),
      "DIAGNOSTIC: _stage_copy_ns(dst, src, kind) -> int: nanoseconds of one staging copy of "
      "src's bytes into dst with 'nt' or 'movsb' stores (transfer/stage_copy.h), on the calling "
      "thread (benchmarks/diag_stage_dest.py). Bytes, as the staging copy: no autograd, no "
      "version counter; the caller keeps both tensors alive and unresized meanwhile");
  m.def(
      "_place_cache_lines",
      [](const at::Tensor& t, const std::string& where) {
        check_plain_cpu_bytes(t, "pinxfer._place_cache_lines", "tensor");
        TORCH_CHECK_VALUE(where == "dram" || where == "cache",
                          "pinxfer._place_cache_lines: expected where 'dram' (flushed from every "
                          "cache) or 'cache' (read by this thread), got '",
                          where, "'");
        const char* const bytes = static_cast<const char*>(t.data_ptr());
        pybind11::gil_scoped_release no_gil;
        if (where == "dram") {
          transfer::flush_cache_lines(bytes, t.nbytes());
        } else {
          transfer::read_cache_lines(bytes, t.nbytes());
        }
      },
      pybind11::arg("tensor"), pybind11::arg("where"),
      "DIAGNOSTIC: _place_cache_lines(tensor, where): puts a contiguous CPU tensor's bytes in "
      "DRAM ('dram': written back and dropped from every cache) or in the calling thread's "
      "caches ('cache': one read per line), before a timed copy (benchmarks/diag_stage_dest.py)");
  m.def(
      "_leaf_sent_apart",
      [](const std::vector<int64_t>& sizes) {
        std::vector<size_t> bytes;
        for (int64_t n : sizes) {
          TORCH_CHECK_VALUE(n >= 0 && static_cast<size_t>(n) <= transfer::kSerialBytes,
                            "pinxfer._leaf_sent_apart: expected sizes from 0 to ",
                            transfer::kSerialBytes, " (a small leaf), got ", n);
          bytes.push_back(static_cast<size_t>(n));
        }
        return static_cast<int64_t>(transfer::leaf_sent_apart(bytes, ops::kPackAlign));
      },
      "TEST-ONLY: _leaf_sent_apart(sizes) -> int: which of a batch's small leaves (bytes, in "
      "order) to_device sends apart from the others' pack (-1: none)");
  m.def("_piece_claims_self_test", wrap_pybind_function_no_gil(&transfer::piece_claims_self_test),
        pybind11::arg("seed"), pybind11::arg("helpers"), pybind11::arg("rounds"),
        pybind11::arg("stall_us"), pybind11::arg("fail_every") = 0,
        "TEST-ONLY: _piece_claims_self_test(seed, helpers, rounds, stall_us, fail_every=0) -> "
        "[pieces staged by helpers, pieces stolen, rounds whose close waited]: single-block "
        "transfers through the claim/steal/close protocol of to_device (transfer/piece_claims.h) "
        "with real copy threads, some parked `stall_us` after a claim, the DMAs replaced by host "
        "copies; raises on a byte sent wrong, a piece not final or a helper reading a source "
        "after close_source");
#if PINXFER_WITH_CUDA
  bind_batch_sender(m);
  m.def("copy_stream", wrap_pybind_function_no_gil(&ops::copy_stream_of),
        "copy_stream(device) -> (stream_id, device_index, device_type): the stream pinxfer's "
        "H2D copies to the device run on");
  m.def("release_finished_sources", wrap_pybind_function_no_gil(&ops::release_finished_sources_of),
        "release_finished_sources(device): drops pinxfer's references to pinned sources whose "
        "copies to the device have finished (an owner about to free pinned memory calls it "
        "after waiting for its copies)");
  m.def("stolen_pieces", &transfer::stolen_pieces,
        "stolen_pieces() -> int: pieces a to_device caller staged again because the copy "
        "thread that had claimed them had not finished in time (process total)");
  m.def(
      "_last_single_block_trace",
      [] { return single_block_trace_dict(transfer::last_single_block_trace()); },
      "DIAGNOSTIC: _last_single_block_trace() -> dict: what this thread's last single-block "
      "to_device did (pieces by the caller, by helpers, stolen; microseconds from its start, "
      "and setup_us from the op's muster of its copy threads to that start; mustered_ns: that "
      "muster on the monotonic clock of time.perf_counter_ns; probed_us, checked_us, "
      "streams_us, output_us, entry_us: the op's steps from the muster; own_stage_us, gate_us, "
      "queue_us: the caller's time staging, asking the span gate, queueing spans)");
  m.def(
      "_last_pack_trace", [] { return pack_trace_dict(transfer::last_pack_trace()); },
      "DIAGNOSTIC: _last_pack_trace() -> dict: what this thread's last packed copy (a batch's "
      "small leaves, or to_device_packed) did, in microseconds from the op's entry "
      "(entered_ns: on time.perf_counter_ns's clock): checked_us (device, capture check, "
      "sources, streams), output_us (device output), block_us (pinned block from the pool), "
      "staged_us (bytes copied in; -1 when copy threads packed them), queued_us (DMAs), "
      "returned_us (block back to the pool), total_us (views made)");
  m.def("_set_step_stamps", &set_step_stamps,
        "DIAGNOSTIC: _set_step_stamps(on): this process's to_device calls of one tensor stamp "
        "their host steps and publish them (_last_step_stamps): the small road's (<= 256 "
        "KiB) and, since session 49, the copy-stream roads' (pipelined or one DMA)");
  m.def(
      "_last_step_stamps",
      [] {
        const StepStampsRecord record = last_step_stamps();
        pybind11::dict d;
        d["entered_ns"] = record.entered_ns;
        d["steps"] = record.steps;
        return d;
      },
      "DIAGNOSTIC: _last_step_stamps() -> dict: this thread's last stamped call: entered_ns "
      "(its entry on time.perf_counter_ns's clock) and steps, a list of (name, microseconds "
      "from the entry to the step's end) in order; steps is empty if none was stamped");
  m.def("_set_chunk_timeline", &transfer::set_chunk_timeline,
        "DIAGNOSTIC: _set_chunk_timeline(on): this process's single-block to_device "
        "transfers record a timing event per DMA span (read by _last_chunk_timeline)");
  m.def(
      "_last_chunk_timeline",
      [] {
        std::vector<transfer::ChunkTimelineEntry> entries;
        {
          pybind11::gil_scoped_release no_gil;
          entries = transfer::last_chunk_timeline();
        }
        pybind11::list out;
        for (const auto& e : entries) {
          pybind11::dict d;
          d["begin"] = e.begin;
          d["end"] = e.end;
          d["queued_us"] = e.queued_us;
          d["dma_done_us"] = e.dma_done_us;
          out.append(d);
        }
        return out;
      },
      "DIAGNOSTIC: _last_chunk_timeline() -> list of dicts: this thread's last recorded "
      "single-block to_device, per DMA span (consecutive chunks sent together): its bytes "
      "[begin, end), when the host queued its DMA and when the GPU had finished it (microseconds "
      "from the call's start; waits for the DMAs)");
  m.def("_set_helper_stall_us", &transfer::set_helper_stall_us,
        "TEST-ONLY: _set_helper_stall_us(us): each copy helper of to_device's single-block "
        "path sleeps us microseconds after claiming a piece, as a parked thread would (0: off)");
#endif
}

}  // namespace pinxfer::python
