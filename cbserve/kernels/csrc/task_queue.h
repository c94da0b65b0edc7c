// Tasks 0..count-1 over ATen's threads, balanced as they run: each thread owns a contiguous
// range (what a static split would give it) and takes its tasks from the front, in order; a
// thread whose range is done takes the others' remaining tasks from their backs. On a machine
// whose cores also run the server (a proxy, an event loop, Ray's own threads), a thread that
// starts late or is descheduled for a while then does fewer tasks, instead of the others waiting
// for it at the end of the region (measured through the served app on a 2-core Zen 4: a lone
// 256-token prompt's first token p50 108 -> 103 ms), while an undisturbed thread still reads its
// weights as one sequential stream (handing out single tasks from one shared counter interleaved
// the threads' panels: 1-row decode steps 8.5 -> 10 ms). A task writes only its own outputs, so
// results never depend on which thread ran it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace cbserve_tasks {

// The tasks [front, back) a thread has not started, packed in one word for compare-and-swap.
struct alignas(64) Range {
  std::atomic<uint64_t> bounds;

  static uint64_t pack(uint64_t front, uint64_t back) { return front | back << 32; }
  // The next task from the front (owner) or the back (another thread); -1 when none is left.
  int64_t take(bool from_front) {
    uint64_t now = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = now & 0xffffffffu, back = now >> 32;
      if (front >= back) return -1;
      const uint64_t next = from_front ? pack(front + 1, back) : pack(front, back - 1);
      if (bounds.compare_exchange_weak(now, next, std::memory_order_relaxed)) {
        return static_cast<int64_t>(from_front ? front : back - 1);
      }
    }
  }
};

template <typename F>
void for_each_task(int64_t count, const F& run) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t t = 0; t < count; ++t) run(t);
    return;
  }
  TORCH_CHECK(count < (int64_t{1} << 32), "cbserve_cpu: too many tasks");
  std::unique_ptr<Range[]> ranges(new Range[threads]);
  for (int64_t i = 0; i < threads; ++i) {
    ranges[i].bounds.store(Range::pack(count * i / threads, count * (i + 1) / threads), std::memory_order_relaxed);
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t self = begin; self < end; ++self) {
      for (int64_t t = ranges[self].take(true); t >= 0; t = ranges[self].take(true)) run(t);
      for (int64_t j = 1; j < threads; ++j) {
        Range& other = ranges[(self + j) % threads];
        for (int64_t t = other.take(false); t >= 0; t = other.take(false)) run(t);
      }
    }
  });
}

// Rows [0, rows) in chunks, `run(begin, end)` each: inline when there are fewer than `grain` rows
// (a parallel region costs more than it saves), else about four chunks per thread.
template <typename F>
void for_each_row_chunk(int64_t rows, int64_t grain, const F& run) {
  if (rows < grain || at::get_num_threads() <= 1) {
    if (rows > 0) run(0, rows);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, (rows + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads()));
  for_each_task((rows + chunk - 1) / chunk, [&](int64_t t) { run(t * chunk, std::min(rows, (t + 1) * chunk)); });
}

}  // namespace cbserve_tasks
