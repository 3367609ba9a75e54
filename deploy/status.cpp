// `lorapipe status DIR [--json]`: the run as its events.jsonl and files tell it.

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"
#include "deploy/launcher.h"

namespace lorapipe::launcher {

namespace fs = std::filesystem;
using nlohmann::json;

std::string status(const fs::path& dir, bool as_json) {
  std::ifstream in(dir / "events.jsonl");
  if (!in) throw InputError(dir.string() + " has no events.jsonl: not a lorapipe run folder");
  json stages = json::object();
  json cache = {{"hits", 0}, {"misses", 0}, {"rejected", 0}};
  json training = {{"step", 0}, {"total_steps", 0}, {"loss", nullptr}, {"s_per_it", nullptr},
                   {"eta_s", nullptr}};
  json checkpoints = json::array();
  json samples = json::array();
  std::string state = "unknown";
  std::string failed_stage;  // the Run event's, where it failed in one
  int line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    const json e = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (e.is_discarded() || !e.is_object()) continue;  // a line cut by a crash
    const std::string kind = e.value("event", "");
    // protobuf's JSON leaves out zeros and writes 64-bit integers as strings.
    auto number = [&](const char* key) -> json {
      if (!e.contains(key)) return 0;
      const json& v = e[key];
      if (v.is_number()) return v;
      if (v.is_string()) {
        const std::string text = v.get<std::string>();
        try {
          size_t used = 0;
          const long long n = std::stoll(text, &used);
          if (used == text.size()) return n;
          return std::stod(text);
        } catch (const std::exception&) {
          return nullptr;
        }
      }
      return 0;
    };
    if (kind == "Run") {
      const std::string result = e.value("result", "");
      state = result == "started" ? "running" : result;
      failed_stage = result == "failed" ? e.value("stage", "") : "";
      // A resume starts a new session: stages of the last one left without an exit ended with
      // their launcher.
      if (result == "started") {
        for (auto& [name, s] : stages.items()) {
          if (s.value("state", "") == "started") s["state"] = "ended (no exit recorded)";
        }
      }
    } else if (kind == "Stage") {
      json& s = stages[e.value("stage", "?")];
      s["state"] = e.value("state", "");
      if (e.contains("exit_code")) s["exit_code"] = e["exit_code"];
      if (e.contains("pid")) s["pid"] = e["pid"];
    } else if (kind == "StageStatus") {  // what the stage itself said
      json& s = stages[e.value("stage", "?")];
      s["reported"] = e.value("state", "");
      if (e.contains("message")) s["message"] = e["message"];
      if (e.value("state", "") == "PROGRESS") {
        s["progress"] = {{"done", number("done")}, {"total", number("total")},
                         {"unit", e.value("unit", "")}};
      }
    } else if (kind == "CacheReport") {
      cache = {{"hits", number("hits")},         {"misses", number("encoded")},
               {"rejected", number("rejected")}, {"done", e.value("done", false)},
               {"manifest", e.value("dataset_id", "")}};
    } else if (kind == "TrainProgress") {
      training = {{"step", number("step")},
                  {"total_steps", number("total_steps")},
                  {"loss", number("loss")},
                  {"average_loss", number("average_loss")},
                  {"s_per_it", number("seconds_per_step")},
                  {"eta_s", number("eta_seconds")}};
    } else if (kind == "CheckpointReady") {
      json c = {{"path", e.value("path", "")}, {"step", number("step")},
                {"final", e.value("final", false)}};
      if (checkpoints.empty() || checkpoints.back() != c) checkpoints.push_back(c);
    } else if (kind == "SampleReady") {
      samples.push_back({{"step", number("step")},
                         {"contact_sheet", e.value("contact_sheet", "")},
                         {"images", e.contains("image_paths") ? e["image_paths"].size() : 0}});
    }
  }
  // A launcher that was killed (SIGKILL, a machine that went down) wrote no end: its lock on
  // the folder went with it.
  const bool in_use = run_folder_in_use(dir);
  if (state == "running" && !in_use) state = "stopped";
  // Stages of a launcher that is gone, with no exit written: they ended with it (it stops them,
  // or they die with it), whatever their last event says.
  if (!in_use) {
    for (auto& [name, s] : stages.items()) {
      if (s.value("state", "") == "started") s["state"] = "ended (no exit recorded)";
    }
  }
  const json out = {{"run", dir.string()},    {"state", state},
                    {"stages", stages},       {"cache", cache},
                    {"training", training},   {"checkpoints", checkpoints},
                    {"samples", samples}};
  if (as_json) return out.dump(2) + "\n";
  std::ostringstream text;
  text << "run " << dir.string() << ": " << state;
  if (!failed_stage.empty()) {
    text << " in the " << failed_stage << " (see "
         << (dir / "logs" / (failed_stage + ".log")).string() << ")";
  }
  text << "\n";
  for (const auto& [name, s] : stages.items()) {
    text << "  " << name << ": " << s.value("state", "");
    if (s.contains("exit_code")) text << " (exit " << s["exit_code"].get<int>() << ")";
    if (s.value("reported", "") == "ERROR") text << ": " << s.value("message", "");
    if (s.value("reported", "") == "PROGRESS" && s.value("state", "") != "exited") {
      const json& p = s["progress"];
      text << ", " << p["done"].dump() << (p["total"] == 0 ? "" : " of " + p["total"].dump())
           << " " << p.value("unit", "");
    }
    text << "\n";
  }
  text << "  cache: " << cache["hits"].get<double>() << " hits, "
       << cache["misses"].get<double>() << " misses, " << cache["rejected"].get<double>()
       << " rejected\n";
  char line[200];
  std::snprintf(line, sizeof line, "  training: step %.0f of %.0f", training["step"].get<double>(),
                training["total_steps"].get<double>());
  text << line;
  if (training["loss"].is_number()) {
    std::snprintf(line, sizeof line, ", loss %.4f, %.3f s/it", training["loss"].get<double>(),
                  training["s_per_it"].get<double>());
    text << line;
  }
  text << "\n  checkpoints: " << checkpoints.size();
  if (!checkpoints.empty()) text << ", newest " << checkpoints.back()["path"].get<std::string>();
  text << "\n  samples: " << samples.size() << " renders";
  if (!samples.empty()) text << ", newest " << samples.back()["contact_sheet"].get<std::string>();
  text << "\n";
  if (!in_use && state != "done") {
    text << "  `lorapipe resume " << dir.string() << "` continues it from its newest state"
         << (state == "failed" ? ", if any, once what failed is corrected" : "") << "\n";
  }
  return text.str();
}

bool run_folder_in_use(const std::filesystem::path& dir) {
  const int fd = ::open((dir / ".lock").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;  // no launcher ever locked it
  // Held, or a file system that cannot tell (no locks): taken as in use.
  const bool free = ::flock(fd, LOCK_SH | LOCK_NB) == 0;
  ::close(fd);
  return !free;
}

}  // namespace lorapipe::launcher
