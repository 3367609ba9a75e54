#pragma once
// Numbers given as text (flags, key=value arguments): the whole text must be the number.

#include <charconv>
#include <cmath>
#include <cstdlib>
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

// Python's repr of a float, as kohya's str(value) writes a float into a LoRA's metadata: the
// shortest digits that read back to the same double, in positional notation for exponents from
// -4 to 15 (always with a fractional part: "1.0") and otherwise as "1e-05" / "1.5e+16".
inline std::string python_float_repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buffer[64];
  const auto written =
      std::to_chars(buffer, buffer + sizeof buffer, value, std::chars_format::scientific);
  std::string text(buffer, written.ptr);  // "-d.ddde+XX", shortest round-trip digits
  std::string sign;
  if (text[0] == '-') {
    sign = "-";
    text.erase(0, 1);
  }
  const size_t e = text.find('e');
  const int exponent = std::atoi(text.c_str() + e + 1);
  std::string digits = text.substr(0, e);
  if (digits.size() > 1) digits.erase(1, 1);  // the point
  std::string out;
  if (exponent < -4 || exponent >= 16) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    const std::string magnitude = std::to_string(std::abs(exponent));
    out += std::string(exponent < 0 ? "e-" : "e+") + (magnitude.size() < 2 ? "0" : "") + magnitude;
  } else if (exponent < 0) {
    out = "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
  } else if (digits.size() <= static_cast<size_t>(exponent) + 1) {
    out = digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
  } else {
    out = digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
  }
  return sign + out;
}

}  // namespace lorapipe
