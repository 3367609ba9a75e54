#pragma once
// The stages' command lines, read by gflags. gflags ends the process itself on a flag it cannot
// read (an unknown name, a value of the wrong type) and after --help, with exit(1), which in
// lorapipe's exit codes (runtime/exit_code.h) means "a check found a problem". parse_flags maps
// those ends onto ours: 2 (kExitError) for a bad flag, 0 for --help and its kin. Header-only:
// only the stages' mains, which link gflags, include it.

#include <gflags/gflags.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "runtime/exit_code.h"

namespace lorapipe::runtime {

namespace detail {
// While gflags reads: the code its own exit() is to end with; -1 otherwise (every later exit
// keeps its own code).
inline int g_gflags_exit = -1;
}  // namespace detail

// gflags::ParseCommandLineFlags(argc, argv, /*remove_flags=*/true), with lorapipe's exit codes.
inline void parse_flags(int* argc, char*** argv) {
  bool help = false;
  for (int i = 1; i < *argc; ++i) {
    std::string_view arg = (*argv)[i];
    while (arg.starts_with("-")) arg.remove_prefix(1);
    arg = arg.substr(0, arg.find('='));
    for (std::string_view name : {"help", "helpfull", "helpshort", "helpxml", "helppackage",
                                  "helpon", "helpmatch", "version"}) {
      help = help || arg == name;
    }
  }
  detail::g_gflags_exit = help ? kExitOk : kExitError;
  static const bool registered = std::atexit([] {
    if (detail::g_gflags_exit < 0) return;
    std::fflush(nullptr);  // gflags' help went to stdout
    std::_Exit(detail::g_gflags_exit);
  }) == 0;
  (void)registered;
  gflags::ParseCommandLineFlags(argc, argv, /*remove_flags=*/true);
  detail::g_gflags_exit = -1;
}

}  // namespace lorapipe::runtime
