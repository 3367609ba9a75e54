#pragma once
// kohya sd-scripts' train_network.py flags that lorapipe does not act on. kohya commands, and
// the configs kohya_ss's GUI writes for `--config_file`, carry many of them at kohya's defaults;
// such a setting asks for nothing lorapipe lacks, so the trainer and the launcher take it. A
// setting that asks for something lorapipe does not do is refused, naming the flag, the value
// and why, rather than silently training something else.

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lorapipe::kohya {

enum class Takes {
  kDefaultOnly,  // kohya's default only: any other value asks for what lorapipe lacks
  kAnyValue,     // every value: the flag changes nothing lorapipe trains or writes
};

enum class Kind {
  kBoolean,  // store_true: given alone it means true
  kValue,    // one value
};

struct ForeignFlag {
  std::string_view name;           // without the dashes
  Kind kind;
  std::string_view kohya_default;  // as kohya's argparse has it; "" for None
  Takes takes;
  std::string_view why;            // what lorapipe does instead, for the message
  // A value kohya treats as not given (--initial_step=0 is no initial step); "" when none.
  std::string_view also_default = {};
  bool secret = false;  // a token or key: never echoed in a message or the log
};

// The entry for `name` (no dashes), or nullptr when it is not one of these.
const ForeignFlag* find_foreign_flag(std::string_view name);

// Whether `value` is kohya's default for `flag` (or a value kohya treats as not given):
// booleans false / 0; None and empty lists "" or "None"; numbers by value; words
// case-insensitively.
bool is_kohya_default(const ForeignFlag& flag, std::string_view value);

// Throws InputError "--name=value: why" when `flag` takes only kohya's default and `value` is
// another. Returns a note for the log when a value other than the default is taken, else "".
// A secret's value shows as "***".
std::string check_foreign_flag(const ForeignFlag& flag, std::string_view value);

// Takes a foreign flag's value off a command line as kohya's argparse would: `args[i]` is
// "--name" or "--name=value"; a boolean alone means true, a value takes the next word (an
// InputError when there is none). Advances `i` past the word it takes.
std::string foreign_flag_value(const ForeignFlag& flag, const std::vector<std::string>& args,
                               size_t& i);

// kohya's --base_weights FILE... with --base_weights_multiplier M... (space-separated words, as
// every stage that takes them reads them): each file with its multiplier, 1 for those not given.
// Throws InputError for more multipliers than files, or a multiplier that is not a number.
std::vector<std::pair<std::string, double>> parse_base_weights(std::string_view files,
                                                               std::string_view multipliers);

// Every entry, for help texts and tests.
const std::vector<ForeignFlag>& foreign_flags();

}  // namespace lorapipe::kohya
