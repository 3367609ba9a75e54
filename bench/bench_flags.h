#pragma once
// Numbers given to a bench's flags: the whole text must be the number, and a bad one is refused
// naming the flag and the text (std::stoll alone answers "stoll").

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/numbers.h"

namespace lorapipe::bench {

inline double flag_number(const std::string& flag, const std::string& text) {
  if (const auto value = parse_double(text)) return *value;
  throw std::invalid_argument(flag + " " + text + ": not a number");
}

inline int64_t flag_whole(const std::string& flag, const std::string& text) {
  const double value = flag_number(flag, text);
  if (value != std::floor(value) || std::abs(value) > 9.0e15) {
    throw std::invalid_argument(flag + " " + text + ": not a whole number");
  }
  return static_cast<int64_t>(value);
}

}  // namespace lorapipe::bench
