#pragma once
// The stages' command lines, read by gflags. gflags ends the process itself on a flag it cannot
// read (an unknown name, a value of the wrong type) and after --help, with exit(1), which in
// lorapipe's exit codes (runtime/exit_code.h) means "a check found a problem". parse_flags maps
// those ends onto ours: 2 (kExitError) for a bad flag, 0 for --help and its kin. Header-only:
// only the stages' mains, which link gflags, include it.

#include <gflags/gflags.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "common/text.h"
#include "runtime/exit_code.h"

namespace lorapipe::runtime {

namespace detail {
// While gflags reads: the code its own exit() is to end with; -1 otherwise (every later exit
// keeps its own code).
inline int g_gflags_exit = -1;
}  // namespace detail

// An unknown flag is named with the stage's flags nearest it ("did you mean --network_dim?"),
// which gflags' own message does not do; then the stage ends with kExitError.
inline void refuse_unknown_flags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--") return;  // gflags reads no flag after it
    if (!arg.starts_with("-")) continue;
    while (arg.starts_with("-")) arg.remove_prefix(1);
    const bool has_value = arg.find('=') != std::string_view::npos;
    const std::string name(arg.substr(0, arg.find('=')));
    gflags::CommandLineFlagInfo info;
    if (gflags::GetCommandLineFlagInfo(name.c_str(), &info)) {
      if (!has_value && info.type != "bool") ++i;  // "--flag value": the next word is its value
      continue;
    }
    if (name.starts_with("no") && gflags::GetCommandLineFlagInfo(name.c_str() + 2, &info) &&
        info.type == "bool") {
      continue;  // --noflag
    }
    std::vector<gflags::CommandLineFlagInfo> all;
    gflags::GetAllFlags(&all);
    std::vector<std::string> names;
    for (const auto& flag : all) names.push_back(flag.name);
    std::fprintf(stderr, "ERROR: unknown command line flag '%s'%s\n", name.c_str(),
                 did_you_mean(name, names, "--").c_str());
    std::exit(kExitError);
  }
}

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
  if (!help) refuse_unknown_flags(*argc, *argv);
  gflags::ParseCommandLineFlags(argc, argv, /*remove_flags=*/true);
  detail::g_gflags_exit = -1;
}

}  // namespace lorapipe::runtime
