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

// The flags of a command line as gflags reads them: "--name", "-name", "--name=value", and a
// value-taking flag's value as the next word; nothing after "--"; "-" alone is no flag.
struct FlagWord {
  std::string name;
  bool known = false;
};
inline std::vector<FlagWord> flag_words(int argc, char** argv) {
  std::vector<FlagWord> out;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--") break;
    if (!arg.starts_with("-") || arg == "-") continue;
    while (arg.starts_with("-")) arg.remove_prefix(1);
    const bool has_value = arg.find('=') != std::string_view::npos;
    FlagWord word{std::string(arg.substr(0, arg.find('='))), false};
    gflags::CommandLineFlagInfo info;
    if (gflags::GetCommandLineFlagInfo(word.name.c_str(), &info)) {
      word.known = true;
      if (!has_value && info.type != "bool") ++i;  // "--flag value": the next word is its value
    } else if (word.name.starts_with("no") &&
               gflags::GetCommandLineFlagInfo(word.name.c_str() + 2, &info) &&
               info.type == "bool") {
      word.known = true;  // --noflag
    }
    out.push_back(std::move(word));
  }
  return out;
}

// gflags::ParseCommandLineFlags(argc, argv, /*remove_flags=*/true), with lorapipe's exit codes.
// An unknown flag is named with the stage's flags nearest it ("did you mean --network_dim?"),
// which gflags' own message does not do, and `hint` after it (where the flag may belong).
inline void parse_flags(int* argc, char*** argv, const char* hint = "") {
  const std::vector<FlagWord> words = flag_words(*argc, *argv);
  bool help = false;
  for (const FlagWord& word : words) {
    for (std::string_view name : {"help", "helpfull", "helpshort", "helpxml", "helppackage",
                                  "helpon", "helpmatch", "version"}) {
      help = help || word.name == name;
    }
  }
  detail::g_gflags_exit = help ? kExitOk : kExitError;
  static const bool registered = std::atexit([] {
    if (detail::g_gflags_exit < 0) return;
    std::fflush(nullptr);  // gflags' help went to stdout
    std::_Exit(detail::g_gflags_exit);
  }) == 0;
  (void)registered;
  for (const FlagWord& word : words) {
    if (help || word.known) continue;
    std::vector<gflags::CommandLineFlagInfo> all;
    gflags::GetAllFlags(&all);
    std::vector<std::string> names;
    for (const auto& flag : all) names.push_back(flag.name);
    std::fprintf(stderr, "ERROR: unknown command line flag '%s'%s%s\n", word.name.c_str(),
                 did_you_mean(word.name, names, "--").c_str(), hint);
    std::exit(kExitError);
  }
  gflags::ParseCommandLineFlags(argc, argv, /*remove_flags=*/true);
  detail::g_gflags_exit = -1;
}

}  // namespace lorapipe::runtime
