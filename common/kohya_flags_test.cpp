// kohya flags lorapipe does not act on: taken at kohya's default, refused by name otherwise.
#include "common/kohya_flags.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "common/error.h"

namespace lorapipe::kohya {
namespace {

std::string refusal(const std::string& name, const std::string& value) {
  try {
    check_foreign_flag(*find_foreign_flag(name), value);
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
                                                        {"vae", ""},
                                                        {"lr_scheduler_args", ""},
                                                        {"lr_scheduler_args", "[]"},
                                                        {"lr_decay_steps", "0.0"},
                                                        {"token_warmup_min", "1"},
                                                        {"caption_separator", ","},
                                                        {"huggingface_repo_id", "None"}}) {
    EXPECT_EQ(check_foreign_flag(*find_foreign_flag(name), value), "") << name << "=" << value;
  }
  EXPECT_EQ(refusal("v2", "true"), "--v2=true: " + std::string(find_foreign_flag("v2")->why));
  EXPECT_NE(refusal("vae", "/m/vae.safetensors").find("--vae=/m/vae.safetensors: another VAE"),
            std::string::npos);
  EXPECT_NE(refusal("lr_scheduler_args", "T_max=100").find("--lr_scheduler_args=T_max=100"),
            std::string::npos);
  EXPECT_NE(refusal("token_warmup_min", "3").find("--token_warmup_min=3"), std::string::npos);
  EXPECT_NE(refusal("caption_separator", ";").find("--caption_separator=;"), std::string::npos);
}

TEST(KohyaFlags, FlagsThatChangeNothingAreTakenAtAnyValueWithANote) {
  EXPECT_EQ(refusal("ddp_timeout", "30"), "");
  EXPECT_EQ(refusal("dynamo_backend", "no"), "");
  const std::string note = check_foreign_flag(*find_foreign_flag("full_bf16"), "true");
  EXPECT_NE(note.find("--full_bf16=true has no effect in lorapipe"), std::string::npos) << note;
  EXPECT_EQ(check_foreign_flag(*find_foreign_flag("full_bf16"), "false"), "");
}

TEST(KohyaFlags, TableHoldsEachFlagOnceAndNoneLorapipeImplements) {
  std::set<std::string_view> seen;
  for (const ForeignFlag& f : foreign_flags()) {
    EXPECT_TRUE(seen.insert(f.name).second) << f.name << " twice";
    EXPECT_FALSE(f.why.empty()) << f.name;
  }
  // Flags lorapipe acts on must never be swallowed here.
  for (const char* own : {"network_dim", "optimizer_args", "save_state", "resume", "vae_batch_size",
                          "mixed_precision", "metadata_title", "no_metadata"}) {
    EXPECT_EQ(find_foreign_flag(own), nullptr) << own;
  }
}

}  // namespace
}  // namespace lorapipe::kohya
