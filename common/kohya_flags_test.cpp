// kohya flags lorapipe does not act on: taken at kohya's default, refused by name otherwise.
#include "common/kohya_flags.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "common/error.h"

namespace lorapipe::kohya {
namespace {

std::string refusal(const std::string& name, const std::string& value) {
  const ForeignFlag* flag = find_foreign_flag(name);
  if (flag == nullptr) return "not in the table: " + name;
  try {
    check_foreign_flag(*flag, value);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(KohyaFlags, DefaultsAreTakenAndOtherValuesRefusedNamingFlagValueAndWhy) {
  // kohya_ss's GUI writes these at their defaults into every config.
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, std::string>>{{"deepspeed", "false"},
                                                        {"v2", "False"},
                                                        {"torch_compile", "0"},
                                                        {"deepspeed", "False"},
                                                        {"huggingface_repo_id", ""},
                                                        {"initial_step", "0"},
                                                        {"initial_epoch", "1"},
                                                        {"model_type", "flux"},
                                                        {"huggingface_repo_id", "None"}}) {
    const ForeignFlag* flag = find_foreign_flag(name);
    ASSERT_NE(flag, nullptr) << name;
    EXPECT_EQ(check_foreign_flag(*flag, value), "") << name << "=" << value;
  }
  EXPECT_EQ(refusal("v2", "true"), "--v2=true: " + std::string(find_foreign_flag("v2")->why));
  EXPECT_NE(refusal("log_tracker_config", "t.toml").find("--log_tracker_config=t.toml"),
            std::string::npos);
  EXPECT_NE(refusal("initial_step", "3").find("--initial_step=3"), std::string::npos);
  EXPECT_NE(refusal("model_type", "chroma").find("--model_type=chroma: Chroma"), std::string::npos);
  EXPECT_NE(refusal("face_crop_aug_range", "2,4").find("--face_crop_aug_range=2,4"),
            std::string::npos);
}

TEST(KohyaFlags, FlagsThatChangeNothingAreTakenAtAnyValueWithANote) {
  EXPECT_EQ(refusal("ddp_timeout", "30"), "");
  EXPECT_EQ(refusal("dynamo_backend", "no"), "");
  const std::string note = check_foreign_flag(*find_foreign_flag("full_bf16"), "true");
  EXPECT_NE(note.find("--full_bf16=true has no effect in lorapipe"), std::string::npos) << note;
  EXPECT_EQ(check_foreign_flag(*find_foreign_flag("full_bf16"), "false"), "");
}

// Each entry once, each with its reason. That no stage's own flag is here is checked against
// the stages' real flags in LauncherFlags.TableMatchesEveryStagesOwnFlags.
TEST(KohyaFlags, TableHoldsEachFlagOnceWithItsReason) {
  std::set<std::string_view> seen;
  for (const ForeignFlag& f : foreign_flags()) {
    EXPECT_TRUE(seen.insert(f.name).second) << f.name << " twice";
    EXPECT_FALSE(f.why.empty()) << f.name;
  }
}

// kohya treats --initial_step=0 and --initial_epoch=1 as not given; secrets are never echoed.
TEST(KohyaFlags, ValuesKohyaTreatsAsUnsetAreTakenAndSecretsAreMasked) {
  EXPECT_EQ(refusal("initial_step", "0"), "");
  EXPECT_EQ(refusal("initial_epoch", "1"), "");
  EXPECT_NE(refusal("initial_step", "100").find("--initial_step=100"), std::string::npos);
  const std::string note = check_foreign_flag(*find_foreign_flag("wandb_api_key"), "sk-123");
  EXPECT_NE(note.find("--wandb_api_key=***"), std::string::npos) << note;
  EXPECT_EQ(note.find("sk-123"), std::string::npos) << note;
}

// Off a command line as kohya's argparse takes them: a value one word, a boolean nothing.
TEST(KohyaFlags, ValuesAreTakenOffACommandLineAsArgparseTakesThem) {
  const std::vector<std::string> args{"--ddp_timeout", "30", "-max_train_steps=10", "--v2",
                                      "--log_tracker_config"};
  size_t i = 0;
  EXPECT_EQ(foreign_flag_value(*find_foreign_flag("ddp_timeout"), args, i), "30");
  EXPECT_EQ(i, 1u) << "the single dash flag after it is the next flag's";
  i = 3;
  EXPECT_EQ(foreign_flag_value(*find_foreign_flag("v2"), args, i), "true");
  EXPECT_EQ(i, 3u);
  i = 4;
  EXPECT_THROW(foreign_flag_value(*find_foreign_flag("log_tracker_config"), args, i), InputError)
      << "a value flag needs its value";
  const std::vector<std::string> eq{"--log_tracker_config=/m/t.toml"};
  i = 0;
  EXPECT_EQ(foreign_flag_value(*find_foreign_flag("log_tracker_config"), eq, i), "/m/t.toml");
}

}  // namespace
}  // namespace lorapipe::kohya
