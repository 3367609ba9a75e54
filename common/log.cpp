#include "common/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <string>

namespace lorapipe {
namespace {

LogLevel level_from_env() {
  const char* env = std::getenv("LORAPIPE_LOG_LEVEL");
  if (env == nullptr) return LogLevel::kInfo;
  const std::string value(env);
  if (value == "debug") return LogLevel::kDebug;
  if (value == "warning") return LogLevel::kWarning;
  if (value == "error") return LogLevel::kError;
  return LogLevel::kInfo;
}

std::atomic<LogLevel>& level_ref() {
  static std::atomic<LogLevel> level{level_from_env()};
  return level;
}

std::mutex& sink_mutex() {
  static std::mutex mutex;
  return mutex;
}

LogSink& sink_ref() {
  static LogSink sink;
  return sink;
}

char level_letter(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return 'D';
    case LogLevel::kInfo: return 'I';
    case LogLevel::kWarning: return 'W';
    case LogLevel::kError: return 'E';
  }
  return '?';
}

}  // namespace

void set_log_level(LogLevel level) { level_ref().store(level); }
LogLevel log_level() { return level_ref().load(); }

LogSink set_log_sink(LogSink sink) {
  std::lock_guard<std::mutex> lock(sink_mutex());
  LogSink previous = std::move(sink_ref());
  sink_ref() = std::move(sink);
  return previous;
}

void log_message(LogLevel level, std::string_view component, std::string_view msg) {
  if (level < log_level()) return;
  std::lock_guard<std::mutex> lock(sink_mutex());
  if (sink_ref()) {
    sink_ref()(level, component, msg);
    return;
  }
  const auto now = std::chrono::system_clock::now();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  const auto millis =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm local{};
  localtime_r(&seconds, &local);
  std::fprintf(stderr, "[%c %02d:%02d:%02d.%03d %.*s] %.*s\n", level_letter(level), local.tm_hour,
               local.tm_min, local.tm_sec, static_cast<int>(millis),
               static_cast<int>(component.size()), component.data(), static_cast<int>(msg.size()),
               msg.data());
}

}  // namespace lorapipe
