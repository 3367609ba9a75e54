#include "deploy/curves.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace lorapipe::launcher {
namespace fs = std::filesystem;
namespace {

// protobuf's JSON prints 64-bit integers as strings, and leaves zero fields out.
uint64_t as_u64(const nlohmann::json& e, const char* key) {
  const auto it = e.find(key);
  if (it == e.end()) return 0;
  if (it->is_string()) return std::stoull(it->get<std::string>());
  return it->is_number() ? it->get<uint64_t>() : 0;
}

double as_double(const nlohmann::json& e, const char* key) {
  const auto it = e.find(key);
  return it != e.end() && it->is_number() ? it->get<double>() : 0.0;
}

void write_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) return;  // a full disk loses a redraw of the curves, never the run
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
}

}  // namespace

void RunCurves::add(const nlohmann::json& event) {
  if (!event.is_object()) return;
  const std::string type = event.value("event", "");
  if (type == "TrainProgress") {
    // A trainer rank other than 0 reports the same steps: rank 0's are the run's.
    if (event.value("rank", 0) != 0) return;
    Point& p = steps_[as_u64(event, "step")];
    p.loss = as_double(event, "loss");
    p.average_loss = as_double(event, "average_loss");
    p.learning_rate = as_double(event, "learning_rate");
    p.peak_memory_bytes = as_u64(event, "peak_memory_bytes");
    changed_ = true;
  } else if (type == "ValidationLoss") {
    validation_[as_u64(event, "step")] = as_double(event, "loss");
    changed_ = true;
  }
}

void RunCurves::add_events_file(const fs::path& events) {
  std::ifstream in(events);
  std::string line;
  while (std::getline(in, line)) {
    add(nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false));
  }
}

nlohmann::json RunCurves::to_json() const {
  nlohmann::json out = {{"steps", nlohmann::json::array()},
                        {"loss", nlohmann::json::array()},
                        {"average_loss", nlohmann::json::array()},
                        {"learning_rate", nlohmann::json::array()},
                        {"peak_memory_bytes", nlohmann::json::array()},
                        {"validation", nlohmann::json::array()}};
  for (const auto& [step, p] : steps_) {
    out["steps"].push_back(step);
    out["loss"].push_back(p.loss);
    out["average_loss"].push_back(p.average_loss);
    out["learning_rate"].push_back(p.learning_rate);
    out["peak_memory_bytes"].push_back(p.peak_memory_bytes);
  }
  for (const auto& [step, loss] : validation_) out["validation"].push_back({step, loss});
  return out;
}

void RunCurves::write(const fs::path& samples, std::chrono::steady_clock::duration every) {
  const auto now = std::chrono::steady_clock::now();
  if (!changed_ || (every.count() > 0 && now - written_ < every)) return;
  std::error_code ec;
  fs::create_directories(samples, ec);
  const std::string json = to_json().dump();
  write_atomically(samples / "curves.json", json + "\n");
  write_atomically(samples / "curves.js", "lorapipeCurves(" + json + ");\n");
  changed_ = false;
  written_ = now;
}

}  // namespace lorapipe::launcher
