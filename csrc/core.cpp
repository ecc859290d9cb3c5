// The native core of poseidon-torch: the per-parameter and per-bucket hot path of a pass.
//
// Job: count every parameter's gradient down from a hook on its gradient accumulator (no GIL while a
// pass is open), stage a bucket's gradients into its flat buffer on the thread that makes it ready
// (C++ for PS buckets, the engine's ``stage`` with the GIL for the others), submit it to its channel
// the moment it is ready, run the channels on C++
// threads in the engine's channel plan (a split bucket's second slot is submitted when its first
// ends; the bucket is done when its last slot is), run PS jobs (gather, staggered push, aggregate,
// pull) on the c10d backends, call back into Python (with the GIL) for every other job, and be the
// BSP barrier with a timeout.
// Semantics are those of poseidon_torch.core.PythonCore, the reference (its docstring lists them).
//
// Invariants:
// - mu_ guards all readiness and barrier state; no thread holds mu_ while it takes the GIL, and every
//   entry point that may block (wait, close) releases the GIL first;
// - a Python object is touched only with the GIL held;
// - a bucket is submitted at most once per pass; a gradient after its bucket's submission marks it late;
// - every backend wait is bounded by the backend's timeout (PoseidonDDP's); a failure names the bucket,
//   the peer and the cause, and the barrier stays failed.
#include <torch/extension.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <ctime>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
constexpr int64_t kFactors = -1;  // the readiness event of an FC layer's factors
constexpr int kOk = 0, kFailed = 1, kTimedOut = 2;

int64_t monotonic_ns() {  // the clock of Python's time.monotonic_ns()
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct Message {
  bool send;
  at::Tensor tensor;
  int peer;
  int tag;
};

struct Aggregate {
  at::Tensor own;
  std::vector<at::Tensor> parts;  // every rank's part in rank order (own at this rank's place)
};

struct Channel {
  BackendPtr up, down;  // gloo: one backend per direction; NCCL: the same, coalesced rounds
  bool coalesced;
};

struct Bucket {
  std::string name;
  std::string profile_name;  // the range a user's torch.profiler shows for its PS job
  std::vector<int64_t> params;  // indices into Core::params_
  std::vector<int64_t> offsets;
  int64_t grad_numel = 0;
  at::Tensor flat, seen, dirty, used_anywhere;  // shared with Python (the uint8 flags)
  std::vector<std::vector<Message>> push, pull;
  std::vector<Aggregate> aggregate;
  int64_t bytes_per_sync = 0;
  // readiness in the current pass (mu_)
  std::vector<uint8_t> pending;
  int64_t pending_count = 0;
  bool pending_factors = false;
  bool submitted = false, late = false, aborted = false, native = false, queued = false, done = false;
  bool split = false, second_queued = false;  // two slots (schedule.py); the second may run
  int64_t submit_ns = 0;
  // the last native job
  int64_t bytes_sent = 0;
  double sync_seconds = 0.0;
};

struct Span {
  int64_t bucket;
  std::string kind;
  int64_t start, end;
};

class Core {
 public:
  Core(std::vector<at::Tensor> params, std::vector<std::tuple<BackendPtr, BackendPtr, bool>> channels,
       int rank, int world_size, py::function run_job, py::function on_idle, py::function stage,
       bool record_order)
      : params_(std::move(params)), rank_(rank), world_size_(world_size), run_job_(std::move(run_job)),
        on_idle_(std::move(on_idle)), stage_(std::move(stage)), record_order_(record_order) {
    for (auto& [up, down, coalesced] : channels) {
      channels_.push_back(Channel{up, down, coalesced});
    }
    schedules_.resize(channels_.size());
    slot_.assign(params_.size(), {-1, -1});
    for (size_t i = 0; i < params_.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
      auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            accumulated(static_cast<int64_t>(i));
            return outputs;
          }));
      hooks_.emplace_back(acc, key);
    }
    for (size_t c = 0; c < channels_.size(); ++c) {
      threads_.emplace_back([this, c] { channel_loop(c); });
    }
  }

  ~Core() { stop(); }

  // ---- configuration (between passes; GIL held by the caller) -------------------------------------

  void reset_buckets() {
    std::lock_guard<std::mutex> lock(mu_);
    buckets_.clear();
    for (auto& s : schedules_) s.clear();
    ++generation_;  // channels waiting on the old schedule start over
    cv_.notify_all();
  }

  void add_bucket(const std::string& name, std::vector<int64_t> params, std::vector<int64_t> offsets,
                  int64_t grad_numel, at::Tensor flat, at::Tensor seen, at::Tensor dirty,
                  at::Tensor used_anywhere, const py::list& push, const py::list& pull,
                  const py::list& aggregate, int64_t bytes_per_sync) {
    Bucket b;
    b.name = name;
    b.profile_name = "poseidon.sync.PS." + name;
    b.params = std::move(params);
    b.offsets = std::move(offsets);
    b.grad_numel = grad_numel;
    b.flat = std::move(flat);
    b.seen = std::move(seen);
    b.dirty = std::move(dirty);
    b.used_anywhere = std::move(used_anywhere);
    b.push = rounds(push);
    b.pull = rounds(pull);
    for (const auto& item : aggregate) {
      auto pair = item.cast<py::tuple>();
      b.aggregate.push_back(Aggregate{pair[0].cast<at::Tensor>(), pair[1].cast<std::vector<at::Tensor>>()});
    }
    b.bytes_per_sync = bytes_per_sync;
    b.pending.assign(b.params.size(), 0);
    std::lock_guard<std::mutex> lock(mu_);
    buckets_.push_back(std::move(b));
  }

  // Parameter slots and the channel plan: per channel, slot keys (i: bucket i's job or first slot,
  // n + i: its second slot), every bucket's first key exactly once.
  void commit(const std::vector<std::vector<int64_t>>& schedules) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto n = static_cast<int64_t>(buckets_.size());
    TORCH_CHECK(schedules.size() == schedules_.size(), "commit needs one schedule per channel");
    std::vector<int> firsts(n, 0);
    for (const auto& keys : schedules) {
      for (int64_t key : keys) {
        TORCH_CHECK(key >= 0 && key < 2 * n, "slot key ", key, " outside 0..", 2 * n - 1);
        if (key < n) ++firsts[key]; else buckets_[key - n].split = true;
      }
    }
    for (int64_t b = 0; b < n; ++b) TORCH_CHECK(firsts[b] == 1, "bucket ", b, " has ", firsts[b], " first slots");
    slot_.assign(params_.size(), {-1, -1});
    for (size_t b = 0; b < buckets_.size(); ++b) {
      for (size_t j = 0; j < buckets_[b].params.size(); ++j) {
        slot_[buckets_[b].params[j]] = {static_cast<int64_t>(b), static_cast<int64_t>(j)};
      }
    }
    schedules_ = schedules;
    ++generation_;
    cv_.notify_all();
  }

  void set_ask(bool ask) {
    std::lock_guard<std::mutex> lock(mu_);
    ask_ = ask;
  }

  // ---- a pass -------------------------------------------------------------------------------------

  void begin_pass(const std::vector<bool>& wait_factors, const std::vector<bool>& native, bool trace) {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(wait_factors.size() == buckets_.size() && native.size() == buckets_.size(),
                "begin_pass needs one flag per bucket");
    for (size_t i = 0; i < buckets_.size(); ++i) {
      Bucket& b = buckets_[i];
      b.pending_factors = wait_factors[i];
      std::fill(b.pending.begin(), b.pending.end(), wait_factors[i] ? 0 : 1);
      b.pending_count = wait_factors[i] ? 0 : static_cast<int64_t>(b.params.size());
      b.submitted = b.late = b.aborted = b.queued = b.done = b.second_queued = false;
      b.native = native[i];
      b.seen.zero_();
    }
    order_.clear();
    order_ns_.clear();
    spans_.clear();
    trace_ = trace;
    began_ns_ = monotonic_ns();
    remaining_ = static_cast<int64_t>(buckets_.size());
    pass_open_ = true;
  }

  void arrive_param(int64_t param) {
    int64_t ready = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready = arrive_locked(param);
    }
    if (ready >= 0) submit(ready);
  }

  void arrive_factors(int64_t bucket, const std::vector<int64_t>& also_wait_for) {
    bool ready = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Bucket& b = buckets_.at(bucket);
      auto* seen = b.seen.data_ptr<uint8_t>();
      if (!b.submitted) {
        for (int64_t j : also_wait_for) {
          if (!seen[j] && !b.pending[j]) {
            b.pending[j] = 1;
            ++b.pending_count;
          }
        }
      }
      if (record_order_) {
        for (int64_t p : b.params) record(p);
      }
      if (!b.submitted && b.pending_factors) {
        b.pending_factors = false;
        ready = b.pending_count == 0;
        b.submitted = ready;
      }
    }
    if (ready) submit(bucket);
  }

  void set_dirty(int64_t param) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [b, j] = slot_.at(param);
    buckets_[b].dirty.data_ptr<uint8_t>()[j] = 1;
  }

  // The backward is over: nothing that accumulates from now on is this pass's (a deferred pass's jobs
  // run on; the next backward asks the engine, which settles it first).
  void finish(bool aborted) {
    std::vector<int64_t> rest;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pass_open_ = false;
      for (size_t i = 0; i < buckets_.size(); ++i) {
        if (!buckets_[i].submitted) {
          buckets_[i].submitted = true;
          buckets_[i].aborted = aborted;
          rest.push_back(static_cast<int64_t>(i));
        }
      }
    }
    for (int64_t i : rest) submit(i);
  }

  std::tuple<int, std::string> wait(double timeout_s) {  // called without the GIL
    std::unique_lock<std::mutex> lock(mu_);
    wait_until(lock, timeout_s, [this] { return remaining_ == 0; });
    if (failed_) return {timed_out_ ? kTimedOut : kFailed, failure_};
    return {kOk, ""};
  }

  // One bucket's job of the pass done (or the pass failed); the pass stays open. Without the GIL.
  std::tuple<int, std::string> wait_bucket(int64_t index, double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(buckets_.size()), "no bucket ", index);
    wait_until(lock, timeout_s, [this, index] { return buckets_[index].done; });
    if (failed_) return {timed_out_ ? kTimedOut : kFailed, failure_};
    return {kOk, ""};
  }

  template <typename Done>
  void wait_until(std::unique_lock<std::mutex>& lock, double timeout_s, Done done) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    done_cv_.wait_until(lock, deadline, [&] { return failed_ || done(); });
    if (!failed_ && !done()) {
      failed_ = true;
      timed_out_ = true;
      std::ostringstream message;
      message << "BSP barrier timed out after " << timeout_s << "s waiting for " << remaining_ << " sync job(s): ";
      int listed = 0;
      for (const Bucket& b : buckets_) {
        if (!b.done && listed++ < 8) message << (listed > 1 ? ", " : "") << "bucket '" << b.name << "'";
      }
      message << (remaining_ > 8 ? " ..." : "") << " (a peer died, hung, or skipped this backward)";
      failure_ = message.str();
      cv_.notify_all();
    }
  }

  // As Bucket.scatter: the averages into .grad of every parameter some rank used (training thread, GIL
  // held, every job of the pass done), then those parameters hold nothing unsynced.
  void scatter(int64_t index) {
    Bucket& b = buckets_.at(index);
    const auto* used = b.used_anywhere.data_ptr<uint8_t>();
    auto* dirty = b.dirty.data_ptr<uint8_t>();
    for (size_t j = 0; j < b.params.size(); ++j) {
      if (!used[j]) continue;
      at::Tensor param = params_[b.params[j]];
      at::Tensor average = b.flat.narrow(0, b.offsets[j], param.numel()).view(param.sizes());
      at::Tensor& grad = param.mutable_grad();
      if (!grad.defined()) grad = at::empty_like(param);
      grad.copy_(average);
      dirty[j] = 0;
    }
  }

  bool late(int64_t b) { std::lock_guard<std::mutex> lock(mu_); return buckets_.at(b).late; }
  bool done(int64_t b) { std::lock_guard<std::mutex> lock(mu_); return buckets_.at(b).done; }
  bool aborted(int64_t b) { std::lock_guard<std::mutex> lock(mu_); return buckets_.at(b).aborted; }
  int64_t submit_ns(int64_t b) { std::lock_guard<std::mutex> lock(mu_); return buckets_.at(b).submit_ns; }
  int64_t bytes_sent(int64_t b) { std::lock_guard<std::mutex> lock(mu_); return buckets_.at(b).bytes_sent; }
  double sync_seconds(int64_t b) { std::lock_guard<std::mutex> lock(mu_); return buckets_.at(b).sync_seconds; }
  std::vector<int64_t> order() { std::lock_guard<std::mutex> lock(mu_); return order_; }
  std::vector<int64_t> order_ns() { std::lock_guard<std::mutex> lock(mu_); return order_ns_; }

  std::vector<std::tuple<int64_t, std::string, int64_t, int64_t>> spans() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::tuple<int64_t, std::string, int64_t, int64_t>> out;
    for (const Span& s : spans_) out.emplace_back(s.bucket, s.kind, s.start, s.end);
    spans_.clear();
    return out;
  }

  void stop() {  // called with the GIL: a channel thread may be waiting for it, so join without it
    {
      py::gil_scoped_release release;
      {
        std::lock_guard<std::mutex> lock(mu_);
        stopped_ = true;
        for (auto& [acc, key] : hooks_) acc->del_post_hook(key);
        hooks_.clear();
        cv_.notify_all();
        done_cv_.notify_all();
      }
      for (auto& t : threads_) {
        if (t.joinable()) t.join();
      }
    }
    run_job_ = py::function();  // break the cycle engine -> core -> engine's bound methods
    on_idle_ = py::function();
    stage_ = py::function();
  }

 private:
  static std::vector<std::vector<Message>> rounds(const py::list& rounds) {
    std::vector<std::vector<Message>> out;
    for (const auto& r : rounds) {
      std::vector<Message> messages;
      for (const auto& m : r.cast<py::list>()) {
        auto t = m.cast<py::tuple>();
        messages.push_back(Message{t[0].cast<bool>(), t[1].cast<at::Tensor>(), t[2].cast<int>(), t[3].cast<int>()});
      }
      out.push_back(std::move(messages));
    }
    return out;
  }

  void record(int64_t param) {  // mu_ held
    if (record_order_) {
      order_.push_back(param);
      order_ns_.push_back(monotonic_ns() - began_ns_);
    }
  }

  // The hook on parameter ``param``'s gradient accumulator (autograd thread, no GIL).
  void accumulated(int64_t param) {
    int64_t ready = -1;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stopped_) return;
      if (!pass_open_) {
        if (!ask_) {
          auto [b, j] = slot_[param];
          buckets_[b].dirty.data_ptr<uint8_t>()[j] = 1;
          return;
        }
        lock.unlock();
        py::gil_scoped_acquire gil;
        on_idle_(param);  // the engine decides: a pass opens (and counts this), or it is local
        return;
      }
      ready = arrive_locked(param);
    }
    if (ready >= 0) submit(ready);
  }

  int64_t arrive_locked(int64_t param) {  // mu_ held; the bucket to submit, or -1
    auto [index, j] = slot_.at(param);
    Bucket& b = buckets_[index];
    record(param);
    b.seen.data_ptr<uint8_t>()[j] = 1;
    if (b.submitted) {
      b.late = true;
      return -1;
    }
    if (!b.pending[j]) return -1;
    b.pending[j] = 0;
    if (--b.pending_count > 0 || b.pending_factors) return -1;
    b.submitted = true;
    return index;
  }

  // On the thread that made the bucket ready: its gradients into the flat buffer first (a job never
  // reads .grad), then into its channel's queue.
  void submit(int64_t index) {
    Bucket& b = buckets_[index];  // the bucket's staging is this thread's until it is queued
    if (b.native && !b.split) {
      gather(b);
    } else {
      py::gil_scoped_acquire gil;
      stage_(index);
    }
    std::lock_guard<std::mutex> lock(mu_);
    b.submit_ns = monotonic_ns();
    b.queued = true;
    cv_.notify_all();
  }

  void channel_loop(size_t c) {
    while (true) {
      std::vector<int64_t> schedule;
      uint64_t generation;
      int64_t n = 0;  // buckets, fixed within a generation
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopped_ || !schedules_[c].empty(); });
        if (stopped_) return;
        schedule = schedules_[c];
        generation = generation_;
        n = static_cast<int64_t>(buckets_.size());
      }
      for (int64_t key : schedule) {
        const bool second = key >= n;
        const int64_t index = second ? key - n : key;
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] {
            return stopped_ || generation_ != generation ||
                   (second ? buckets_[index].second_queued : buckets_[index].queued);
          });
          if (stopped_) return;
          if (generation_ != generation) break;
          (second ? buckets_[index].second_queued : buckets_[index].queued) = false;
        }
        std::string error = run(key, index, channels_[c]);
        std::lock_guard<std::mutex> lock(mu_);
        if (!error.empty()) {
          if (!failed_) {
            failed_ = true;
            failure_ = "sync of bucket '" + buckets_[index].name + "' failed: " + error;
          }
          done_cv_.notify_all();
          return;  // later collectives on this channel would be out of step with the peers
        }
        if (!second && buckets_[index].split) {
          buckets_[index].second_queued = true;  // its second slot, on whichever channel holds it
          cv_.notify_all();
          continue;
        }
        buckets_[index].done = true;
        --remaining_;
        done_cv_.notify_all();  // the barrier, or a wait for this one bucket
      }
    }
  }

  // Slot ``key`` of bucket ``index``; an error message or "".
  std::string run(int64_t key, int64_t index, Channel& channel) {
    Bucket& b = buckets_[index];  // its fields are this thread's until the job ends
    try {
      if (b.native && !b.split) {
        sync_ps(b, channel);
      } else {
        py::gil_scoped_acquire gil;
        run_job_(key);
      }
    } catch (py::error_already_set& e) {
      return e.what();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }

  // ---- the PS job, as kvstore.PSPath.sync ---------------------------------------------------------

  void sync_ps(Bucket& b, Channel& channel) {
    RECORD_USER_SCOPE(b.profile_name);
    const int64_t start = monotonic_ns();
    trace(b, "queue", b.submit_ns, start);
    for (auto& messages : b.push) exchange(messages, channel);
    for (auto& a : b.aggregate) aggregate(a);
    for (auto& messages : b.pull) exchange(messages, channel);
    read_flags(b);  // the engine scatters the averages into .grad when the backward ends
    const int64_t end = monotonic_ns();
    trace(b, "network", start, end);  // no gather span: staged at submission (see submit)
    trace(b, "sync", start, end);
    std::lock_guard<std::mutex> lock(mu_);
    b.bytes_sent = b.bytes_per_sync;
    b.sync_seconds = static_cast<double>(end - start) * 1e-9;
  }

  void trace(const Bucket& b, const char* kind, int64_t start, int64_t end) {
    if (!trace_) return;
    std::lock_guard<std::mutex> lock(mu_);
    spans_.push_back(Span{static_cast<int64_t>(&b - buckets_.data()), kind, start, end});
  }

  void gather(Bucket& b) {
    const auto n = static_cast<int64_t>(b.params.size());
    for (int64_t j = 0; j < n; ++j) {
      const at::Tensor& param = params_[b.params[j]];
      at::Tensor piece = b.flat.narrow(0, b.offsets[j], param.numel());
      const at::Tensor& grad = param.grad();
      if (grad.defined()) {
        piece.copy_(grad.reshape(-1));
      } else {
        piece.zero_();
      }
    }
    at::Tensor flags = b.flat.narrow(0, b.grad_numel, n + 1);
    flags.narrow(0, 0, n).copy_(b.seen.bitwise_or(b.dirty));
    flags.narrow(0, n, 1).fill_(b.aborted ? 1 : 0);
  }

  void exchange(std::vector<Message>& messages, Channel& channel) {
    if (messages.empty()) return;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    if (channel.coalesced) channel.up->startCoalescing();
    for (auto& m : messages) {
      std::vector<at::Tensor> tensors{m.tensor};
      bool up = m.send ? rank_ < m.peer : m.peer < rank_;
      auto& backend = up ? channel.up : channel.down;
      works.push_back(m.send ? backend->send(tensors, m.peer, m.tag) : backend->recv(tensors, m.peer, m.tag));
    }
    if (channel.coalesced) works = {channel.up->endCoalescing()};
    for (size_t i = 0; i < works.size(); ++i) {
      try {
        works[i]->wait();  // bounded by the backend's timeout, PoseidonDDP's ``timeout``
      } catch (const std::exception& e) {
        const Message& m = messages[std::min(i, messages.size() - 1)];
        std::ostringstream message;
        message << (m.send ? "sending to" : "receiving from") << " rank " << m.peer << ": " << e.what();
        throw std::runtime_error(message.str());
      }
    }
  }

  void aggregate(Aggregate& a) {  // in rank order, whoever owns the chunk: the same bits everywhere
    if (a.own.element_size() < 4) {  // half precision: sum in fp32, it cannot overflow
      at::Tensor total = a.parts[0].to(at::kFloat);
      for (size_t r = 1; r < a.parts.size(); ++r) total.add_(a.parts[r].to(at::kFloat));
      a.own.copy_(total.div_(world_size_));
      return;
    }
    // the sum starts with rank 0's part: own, or a receive buffer this job may overwrite; when own is
    // rank 1's part, rank 0's + own goes straight into own (the same operands in the same order, one pass
    // over the chunk fewer than summing into the buffer and copying back)
    size_t next = 1;
    at::Tensor total = a.parts[0];
    if (a.parts.size() > 1 && a.parts[1].is_same(a.own)) {
      at::add_out(a.own, a.parts[0], a.own);
      total = a.own;
      next = 2;
    }
    for (size_t r = next; r < a.parts.size(); ++r) total.add_(a.parts[r]);
    if (!total.is_same(a.own)) a.own.copy_(total);
    a.own.div_(world_size_);
  }

  void read_flags(Bucket& b) {  // as Bucket.read_flags
    const auto n = static_cast<int64_t>(b.params.size());
    at::Tensor flags = b.flat.narrow(0, b.grad_numel, n + 1).gt(0).to(at::kByte);
    b.used_anywhere.copy_(flags.narrow(0, 0, n));
    if (flags[n].item<uint8_t>()) b.dirty.bitwise_or_(b.seen);  // some rank aborted: keep them, unsynced
  }

  std::vector<at::Tensor> params_;
  const int rank_, world_size_;
  py::function run_job_, on_idle_, stage_;
  const bool record_order_;
  std::vector<Channel> channels_;
  std::vector<std::thread> threads_;
  // the accumulator's pointer type: c10::intrusive_ptr<Node> from torch 2.12 on, std::shared_ptr<Node> before
  using AccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<std::pair<AccumulatorPtr, uintptr_t>> hooks_;

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<int64_t, int64_t>> slot_;  // parameter -> (bucket, position)
  std::vector<std::vector<int64_t>> schedules_;
  uint64_t generation_ = 0;
  bool ask_ = false, pass_open_ = false, trace_ = false, stopped_ = false;
  bool failed_ = false, timed_out_ = false;
  std::string failure_;
  int64_t remaining_ = 0, began_ns_ = 0;
  std::vector<int64_t> order_, order_ns_;
  std::vector<Span> spans_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "poseidon-torch native core: readiness, channels, PS jobs and the BSP barrier in C++";
  auto released = py::call_guard<py::gil_scoped_release>();
  py::class_<Core>(m, "Core")
      .def(py::init<std::vector<at::Tensor>, std::vector<std::tuple<BackendPtr, BackendPtr, bool>>, int, int,
                    py::function, py::function, py::function, bool>())
      .def("reset_buckets", &Core::reset_buckets)
      .def("add_bucket", &Core::add_bucket)
      .def("commit", &Core::commit)
      .def("set_ask", &Core::set_ask)
      .def("begin_pass", &Core::begin_pass)
      .def("arrive_param", &Core::arrive_param, released)
      .def("arrive_factors", &Core::arrive_factors, released)
      .def("set_dirty", &Core::set_dirty)
      .def("finish", &Core::finish, released)
      .def("wait", &Core::wait, released)
      .def("wait_bucket", &Core::wait_bucket, released)
      .def("scatter", &Core::scatter)
      .def("late", &Core::late)
      .def("aborted", &Core::aborted)
      .def("submit_ns", &Core::submit_ns)
      .def("done", &Core::done)
      .def("bytes_sent", &Core::bytes_sent)
      .def("sync_seconds", &Core::sync_seconds)
      .def("order", &Core::order)
      .def("order_ns", &Core::order_ns)
      .def("spans", &Core::spans)
      .def("stop", &Core::stop);
}
