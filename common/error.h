#pragma once
// Errors thrown inside a stage. Each names the file, key or value at fault in its message;
// `main`, thread entries and message handlers catch and turn them into an exit code, a
// skipped-and-counted item, or an error reply.

#include <stdexcept>
#include <string>

namespace lorapipe {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad input from outside the process: a file, a flag, a peer's message.
class InputError : public Error {
 public:
  using Error::Error;
};

}  // namespace lorapipe
