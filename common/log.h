#pragma once
// Minimal leveled logging shared by every stage. One line per event on stderr:
//   "[E 12:03:04.123 wire] message"
// Tests can install a sink to capture what a component reports.

#include <functional>
#include <sstream>
#include <string>
#include <string_view>

namespace lorapipe {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

using LogSink = std::function<void(LogLevel, std::string_view component, std::string_view msg)>;

// Writes one event; thread-safe.
void log_message(LogLevel level, std::string_view component, std::string_view msg);

// Events below this level are dropped (default kInfo; LORAPIPE_LOG_LEVEL=debug|info|warning|error).
void set_log_level(LogLevel level);
LogLevel log_level();

// Replaces the stderr writer (nullptr restores it). Returns the previous sink.
LogSink set_log_sink(LogSink sink);

// Streams into one event: LP_LOG(kError, "wire") << "bad frame from " << endpoint;
class LogLine {
 public:
  LogLine(LogLevel level, std::string_view component) : level_(level), component_(component) {}
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  ~LogLine() { log_message(level_, component_, stream_.str()); }
  template <typename T>
  LogLine& operator<<(const T& value) {
    stream_ << value;
    return *this;
  }

 private:
  LogLevel level_;
  std::string_view component_;
  std::ostringstream stream_;
};

}  // namespace lorapipe

#define LP_LOG(level, component)                                  \
  if (::lorapipe::LogLevel::level < ::lorapipe::log_level()) {    \
  } else                                                          \
    ::lorapipe::LogLine(::lorapipe::LogLevel::level, (component))
