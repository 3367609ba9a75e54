#pragma once
// The run's curves for the gallery: loss, average loss, validation loss, learning rate and peak
// memory against the step, gathered from the events the launcher logs (events.jsonl: the
// trainer's TrainProgress and ValidationLoss, as JSON) and written beside the samples as
// samples/curves.js — `lorapipeCurves({...});`, which the gallery page (samples/index.html)
// loads and plots. A script, not JSON, because the page must work opened from disk (file://),
// where a browser fetches nothing; curves.json holds the same object for tools.
//
// Each step keeps its newest values: a resumed run repeats the steps after its state, and those
// are the run's now.

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json_fwd.hpp>

namespace lorapipe::launcher {

class RunCurves {
 public:
  // Takes the event when it is a TrainProgress or a ValidationLoss; ignores the others.
  void add(const nlohmann::json& event);
  // Every event of an events.jsonl (a resumed run's earlier steps); lines that are not JSON are
  // skipped (a crash may cut the last one short).
  void add_events_file(const std::filesystem::path& events);
  bool empty() const { return steps_.empty() && validation_.empty(); }

  // The object curves.js passes: {"steps": [...], "loss": [...], "average_loss": [...],
  // "learning_rate": [...], "peak_memory_bytes": [...], "validation": [[step, loss], ...]}.
  nlohmann::json to_json() const;
  // Writes `samples`/curves.js and curves.json, each to a temporary name and renamed, when
  // anything changed since the last write and `every` has passed since it (zero: now).
  void write(const std::filesystem::path& samples,
             std::chrono::steady_clock::duration every = std::chrono::seconds(1));

 private:
  struct Point {
    double loss = 0, average_loss = 0, learning_rate = 0;
    uint64_t peak_memory_bytes = 0;
  };
  std::map<uint64_t, Point> steps_;
  std::map<uint64_t, double> validation_;
  bool changed_ = false;
  std::chrono::steady_clock::time_point written_{};
};

}  // namespace lorapipe::launcher
