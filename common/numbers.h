#pragma once
// Numbers given as text (flags, key=value arguments): the whole text must be the number.

#include <exception>
#include <optional>
#include <string>

namespace lorapipe {

// The number `text` spells, or nothing when it is empty, has anything after the number, or is
// not one.
inline std::optional<double> parse_double(const std::string& text) {
  try {
    size_t used = 0;
    const double value = std::stod(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

}  // namespace lorapipe
