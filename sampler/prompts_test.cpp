// kohya's prompt-file syntax (sampler/prompts.h): every option, the three file forms, and bad
// lines reported by number and skipped while the rest is kept.
#include "sampler/prompts.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "models/family.h"
#include "sampler/render.h"

namespace lorapipe::sampler {
namespace {

namespace fs = std::filesystem;

fs::path write(const std::string& name, const std::string& text) {
  const fs::path dir = fs::temp_directory_path() / ("lorapipe-prompts-" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / name) << text;
  return dir / name;
}

TEST(SamplerPrompts, TextLinesWithEveryKohyaOption) {
  const fs::path file = write("p.txt",
                              "# a comment\n"
                              "\n"
                              "a cat, masterpiece --n lowres, blurry --w 770 --h 512 --d 42 --s 25 "
                              "--l 6.5 --ss euler_a\n"
                              "a dog\n"
                              "a bird --W 100 --S 5000\n");
  const PromptSet set = load_prompts(file);
  ASSERT_TRUE(set.problems.empty()) << set.problems[0];
  ASSERT_EQ(set.prompts.size(), 3u);
  const RenderRequest& a = set.prompts[0];
  EXPECT_EQ(a.prompt, "a cat, masterpiece");
  EXPECT_EQ(a.negative_prompt, "lowres, blurry");
  EXPECT_EQ(a.width, 768) << "rounded down to a multiple of 8";
  EXPECT_EQ(a.height, 512);
  EXPECT_EQ(a.seed, 42);
  EXPECT_EQ(a.steps, 25);
  EXPECT_DOUBLE_EQ(a.cfg_scale, 6.5);
  EXPECT_EQ(a.sampler, "euler_a");
  const RenderRequest& b = set.prompts[1];  // kohya's defaults, a fixed seed per prompt
  EXPECT_EQ(b.prompt, "a dog");
  EXPECT_EQ(b.width, 512);
  EXPECT_EQ(b.steps, 0) << "left to the family: kohya's 30, 20 for FLUX.1 [dev], 4 for schnell";
  EXPECT_EQ(sample_steps(models::model_family("sd15"), b), 30);
  EXPECT_EQ(sample_steps(models::model_family("sdxl"), b), 30);
  EXPECT_EQ(sample_steps(models::model_family("flux-dev"), b), 20);
  EXPECT_EQ(sample_steps(models::model_family("flux-schnell"), b), 4);
  EXPECT_EQ(sample_steps(models::model_family("flux-dev"), a), 25) << "--s wins";
  EXPECT_DOUBLE_EQ(b.cfg_scale, 7.5);
  EXPECT_EQ(b.sampler, "ddim");
  EXPECT_EQ(b.seed, 1234 + 1);
  const RenderRequest& c = set.prompts[2];  // options in any case; kohya's clamps
  EXPECT_EQ(c.width, 96);
  EXPECT_EQ(c.steps, 1000);
}

// lorapipe's --karras puts euler and dpmsolver++ (DPM++ 2M) on Karras sigmas, wherever it stands
// on the line; with a sampler that has no Karras form it is noted and the line kept.
TEST(SamplerPrompts, KarrasOptionSelectsTheKarrasSigmas) {
  const fs::path file = write("karras.txt",
                              "a cat --karras --ss dpmsolver++\n"
                              "a dog --ss k_euler --karras\n"
                              "a bird --ss euler_a --karras\n"
                              "a fish --ss euler --karras false\n");
  const PromptSet set = load_prompts(file);
  ASSERT_TRUE(set.problems.empty()) << set.problems[0];
  ASSERT_EQ(set.prompts.size(), 4u);
  EXPECT_EQ(set.prompts[0].sampler, "dpmsolver++_karras");
  EXPECT_EQ(set.prompts[1].sampler, "euler_karras");
  EXPECT_EQ(set.prompts[2].sampler, "euler_a");
  EXPECT_EQ(set.prompts[3].sampler, "euler");
  ASSERT_EQ(set.notes.size(), 1u);
  EXPECT_NE(set.notes[0].find("karras.txt:3: --karras applies to euler and dpmsolver++ only"),
            std::string::npos)
      << set.notes[0];
  EXPECT_TRUE(scheduler_options(set.prompts[0].sampler, false).karras);
}

// kohya reads an option's value from its start and ignores what it cannot read: the line is
// rendered, and the reading noted by line. Only a line without a prompt is skipped; it keeps its
// number, so the prompts after it keep theirs (their image names and default seeds).
TEST(SamplerPrompts, LinesAreReadLenientlyAsKohyaAndNumberedByTheirPlace) {
  const fs::path file = write("bad.txt",
                              "good one\n"
                              "--w 512\n"
                              "x --w abc --s 28steps\n"
                              "y --cfg 7 --l 1.2.3\n"
                              "z --ss lms9000\n"
                              "last good --d 7 --s 0\n");
  const PromptSet set = load_prompts(file);
  ASSERT_EQ(set.problems.size(), 1u);
  EXPECT_NE(set.problems[0].find("bad.txt:2: no prompt"), std::string::npos) << set.problems[0];
  ASSERT_EQ(set.prompts.size(), 5u);
  const RenderRequest& x = set.prompts[1];
  EXPECT_EQ(x.prompt, "x");
  EXPECT_EQ(x.width, 512) << "--w abc left out";
  EXPECT_EQ(x.steps, 28) << "--s 28steps read as 28";
  EXPECT_EQ(x.index, 2) << "the third line: the skipped second one keeps its number";
  EXPECT_EQ(x.seed, 1234 + 2);
  EXPECT_DOUBLE_EQ(set.prompts[2].cfg_scale, 7.5) << "'1.2.3' is no number: left out";
  EXPECT_EQ(set.prompts[3].sampler, "ddim") << "kohya renders a sampler it does not know so";
  EXPECT_EQ(set.prompts[4].prompt, "last good");
  EXPECT_EQ(set.prompts[4].index, 5);
  EXPECT_EQ(set.prompts[4].seed, 7);
  EXPECT_EQ(set.prompts[4].steps, 1) << "--s 0 renders one step";
  const std::string notes = [&] {
    std::string all;
    for (const std::string& n : set.notes) all += n + "\n";
    return all;
  }();
  for (const char* expected :
       {":3: --w 'abc' is not a number: left out", ":3: --s '28steps' read as 28",
        ":4: unknown option --cfg: ignored", ":4: --l wants a number, got '1.2.3'",
        ":5: unknown sampler 'lms9000'", ":6: --s 0 read as 1 (1 to 1000 steps)"}) {
    EXPECT_NE(notes.find(expected), std::string::npos) << expected << " in\n" << notes;
  }
}

TEST(SamplerPrompts, TomlAndJsonFormsAsKohyaReadsThem) {
  const fs::path toml = write("p.toml",
                              "[prompt]\n"
                              "negative_prompt = \"lowres\"\n"
                              "width = 640\n"
                              "sample_steps = 20\n"
                              "[[prompt.subset]]\n"
                              "prompt = \"a cat\"\n"
                              "seed = 3\n"
                              "[[prompt.subset]]\n"
                              "prompt = \"a dog\"\n"
                              "width = 512\n"
                              "scale = 5.0123456789\n"
                              "sample_sampler = \"dpmsolver++\"\n"
                              "[[prompt.subset]]\n"
                              "width = 512\n"
                              "[[prompt.subset]]\n"
                              "prompt = \"\"\n"
                              "seed = -1\n");
  const PromptSet t = load_prompts(toml);
  ASSERT_EQ(t.prompts.size(), 3u);
  // An empty prompt renders, as kohya renders it; a negative seed is torch.manual_seed's.
  EXPECT_EQ(t.prompts[2].prompt, "");
  EXPECT_EQ(t.prompts[2].seed, -1);
  EXPECT_EQ(t.prompts[2].index, 3) << "its place, the subset without a prompt counted";
  EXPECT_EQ(t.prompts[0].negative_prompt, "lowres");
  EXPECT_EQ(t.prompts[0].width, 640);
  EXPECT_EQ(t.prompts[0].steps, 20);
  EXPECT_EQ(t.prompts[0].seed, 3);
  EXPECT_EQ(t.prompts[1].width, 512);
  EXPECT_DOUBLE_EQ(t.prompts[1].cfg_scale, 5.0123456789) << "every digit of the file's number";
  EXPECT_EQ(t.prompts[1].sampler, "dpmsolver++");
  ASSERT_EQ(t.problems.size(), 1u);
  EXPECT_NE(t.problems[0].find("prompt.subset 3: no 'prompt'"), std::string::npos)
      << t.problems[0];

  const fs::path json = write("p.json",
                              R"([{"prompt": "a cat", "height": 768, "seed": 9},
                                  "a plain prompt", 42, {"prompt": "x", "width": "wide"},
                                  {"prompt": "y", "seed": null, "negative_prompt": null},
                                  {"prompt": "z", "scale": [1]}])");
  const PromptSet j = load_prompts(json);
  ASSERT_EQ(j.prompts.size(), 3u);
  EXPECT_EQ(j.prompts[0].height, 768);
  EXPECT_EQ(j.prompts[0].seed, 9);
  EXPECT_EQ(j.prompts[1].prompt, "a plain prompt");
  EXPECT_EQ(j.prompts[2].prompt, "y") << "null is an absent key, as kohya's dict.get reads it";
  EXPECT_EQ(j.prompts[2].seed, 1234 + 4);
  EXPECT_EQ(j.prompts[2].index, 4);
  ASSERT_EQ(j.problems.size(), 3u);
  EXPECT_NE(j.problems[0].find("entry 3"), std::string::npos) << j.problems[0];
  EXPECT_NE(j.problems[1].find("entry 4: --width wants a whole number"), std::string::npos)
      << j.problems[1];
  EXPECT_NE(j.problems[2].find("entry 6: scale: a value that is not text or a number"),
            std::string::npos)
      << j.problems[2];
}

// kohya's comment is a line whose first character is '#' (blank lines are not prompts either):
// an indented '#' line is a prompt to kohya. lorapipe does not render it, but it keeps its
// number, so the prompts after it are named and seeded as kohya's.
TEST(SamplerPrompts, IndentedCommentKeepsItsNumberAsKohyasPrompt) {
  const fs::path file = write("comments.txt", "# a comment\n\na cat\n  # a note\na dog\n");
  const PromptSet set = load_prompts(file);
  ASSERT_EQ(set.prompts.size(), 2u);
  EXPECT_EQ(set.prompts[0].index, 0);
  EXPECT_EQ(set.prompts[1].prompt, "a dog");
  EXPECT_EQ(set.prompts[1].index, 2) << "kohya's prompts: 'a cat', '# a note', 'a dog'";
  EXPECT_EQ(set.prompts[1].seed, 1234 + 2);
  ASSERT_EQ(set.problems.size(), 1u);
  EXPECT_NE(set.problems[0].find("comments.txt:4: an indented '#' line"), std::string::npos)
      << set.problems[0];
}

// What kohya reads but SD1.x previews do not use keeps the prompt, with a note by line: options
// of other models (--am, --cn) are ignored; FLUX.1's --g and --l are read (the guidance and the
// given CFG scale), not dropped. Every sampler kohya names is taken, in any case;
// a step count the sampler cannot take (pndm under 4) skips the line. A JSON string is a whole
// prompt line, options included.
TEST(SamplerPrompts, KohyaOptionsOfOtherModelsAreNotedAndEveryKohyaSamplerIsTaken) {
  const fs::path file = write("other.txt",
                              "a cat --am 0.5 --ss k_dpm_2_a --d 3\n"
                              "a dog --cn control.png --g 2.5 --l 4 --ss Euler_A\n"
                              "a bird --ss PNDM --s 3\n");
  const PromptSet set = load_prompts(file);
  ASSERT_EQ(set.prompts.size(), 2u);
  EXPECT_EQ(set.prompts[0].sampler, "k_dpm_2_a");
  EXPECT_EQ(set.prompts[0].seed, 3);
  EXPECT_EQ(set.prompts[1].sampler, "euler_a") << "sampler names in any case";
  EXPECT_FALSE(set.prompts[0].guidance.has_value());
  EXPECT_FALSE(set.prompts[0].cfg_scale_given);
  ASSERT_TRUE(set.prompts[1].guidance.has_value());
  EXPECT_EQ(*set.prompts[1].guidance, 2.5);
  EXPECT_TRUE(set.prompts[1].cfg_scale_given);
  EXPECT_EQ(set.prompts[1].cfg_scale, 4.0);
  ASSERT_EQ(set.problems.size(), 1u);
  EXPECT_NE(set.problems[0].find("other.txt:3: the pndm sampler needs at least 4 steps, got 3"),
            std::string::npos)
      << set.problems[0];
  ASSERT_EQ(set.notes.size(), 2u);
  EXPECT_NE(set.notes[0].find("other.txt:1: --am is for other models"), std::string::npos)
      << set.notes[0];
  EXPECT_NE(set.notes[1].find(":2: --cn"), std::string::npos) << set.notes[1];
  // A FLUX.1 model renders Euler steps whatever the line's sampler (kohya's FLUX.1 sampling
  // reads no sampler name): its three steps are kept.
  PromptDefaults flow;
  flow.sampler = "pndm";
  flow.check_sampler_steps = false;
  const PromptSet flux = load_prompts(file, flow);
  EXPECT_TRUE(flux.problems.empty()) << flux.problems[0];
  ASSERT_EQ(flux.prompts.size(), 3u);
  EXPECT_EQ(flux.prompts[2].steps, 3);
  // Its prompts are plain text (no attention syntax, as kohya's FLUX.1 sampling): a weight that
  // is not a number renders as written, where the Stable Diffusion families skip the line. A
  // line of ideographic spaces is blank, as Python's strip() leaves it to kohya.
  flow.weighted_prompts = false;
  const fs::path odd = write("odd.txt", "a (cat:1.2.3) sleeping\n\u3000\u3000\n");
  EXPECT_EQ(load_prompts(odd, flow).prompts.size(), 1u);
  EXPECT_EQ(load_prompts(odd).prompts.size(), 0u);
  EXPECT_EQ(load_prompts(odd).problems.size(), 1u);

  for (const char* name : {"ddpm", "pndm", "lms", "k_lms", "heun", "dpm_2", "k_dpm_2",
                                  "dpm_2_a", "dpmsolver", "dpmsolver++", "dpmsingle"}) {
    const PromptSet one = load_prompts(write("one.txt", std::string("a cat --ss ") + name + "\n"));
    ASSERT_EQ(one.prompts.size(), 1u) << name;
    EXPECT_EQ(one.prompts[0].sampler, name);
    EXPECT_TRUE(one.notes.empty()) << name << ": " << one.notes[0];
  }

  const PromptSet j = load_prompts(write("lines.json", R"(["a cat --w 768 --d 5 --ss lms"])"));
  ASSERT_EQ(j.prompts.size(), 1u);
  EXPECT_EQ(j.prompts[0].prompt, "a cat");
  EXPECT_EQ(j.prompts[0].width, 768);
  EXPECT_EQ(j.prompts[0].seed, 5);
  EXPECT_EQ(j.prompts[0].sampler, "lms");
  EXPECT_TRUE(j.notes.empty());
}

// Text that cannot be conditioned is found when the file is read, not at every render: invalid
// UTF-8, or an attention weight that is not a number.
TEST(SamplerPrompts, TextThatCannotBeConditionedIsSkippedByLine) {
  const fs::path file = write("text.txt",
                              "fine (weighted:1.2)\n"
                              "bad (weight:1.2.3)\n"
                              "bad \xff byte\n"
                              "fine --n also \xc3\n");
  const PromptSet set = load_prompts(file);
  ASSERT_EQ(set.prompts.size(), 1u);
  EXPECT_EQ(set.prompts[0].prompt, "fine (weighted:1.2)");
  ASSERT_EQ(set.problems.size(), 3u);
  EXPECT_NE(set.problems[0].find("text.txt:2: prompt weight '1.2.3'"), std::string::npos)
      << set.problems[0];
  EXPECT_NE(set.problems[1].find("text.txt:3:"), std::string::npos) << set.problems[1];
  EXPECT_NE(set.problems[2].find("text.txt:4:"), std::string::npos) << set.problems[2];
}

// A size past what a preview can be (a typo's 3000000000) refuses its line by value, where it
// once wrapped around as an int and failed every prompt of every checkpoint; seeds take 18 digits
// in every form; scales that are not finite numbers are refused, not rendered black.
TEST(SamplerPrompts, SizesPastAPreviewAndNumbersThatAreNotFiniteAreRefusedByLine) {
  const fs::path file = write("sizes.txt",
                              "huge --w 3000000000 --h 64\n"
                              "largest --w 16384 --h 64\n"
                              "seeded --d 123456789012345678\n");
  const PromptSet set = load_prompts(file);
  ASSERT_EQ(set.problems.size(), 1u);
  EXPECT_NE(set.problems[0].find("sizes.txt:1: --w 3000000000 is larger than a preview can be"),
            std::string::npos)
      << set.problems[0];
  ASSERT_EQ(set.prompts.size(), 2u);
  EXPECT_EQ(set.prompts[0].width, 16384);
  EXPECT_EQ(set.prompts[0].height, 64);
  EXPECT_EQ(set.prompts[1].seed, 123456789012345678);

  const fs::path toml = write("finite.toml",
                              "[[prompt.subset]]\n"
                              "prompt = \"a\"\n"
                              "scale = nan\n"
                              "[[prompt.subset]]\n"
                              "prompt = \"b\"\n"
                              "guidance_scale = inf\n"
                              "[[prompt.subset]]\n"
                              "prompt = \"c\"\n"
                              "height = 20000\n"
                              "seed = 123456789012345678\n"
                              "[[prompt.subset]]\n"
                              "prompt = \"d\"\n");
  const PromptSet t = load_prompts(toml);
  ASSERT_EQ(t.prompts.size(), 1u);
  EXPECT_EQ(t.prompts[0].prompt, "d");
  ASSERT_EQ(t.problems.size(), 3u);
  EXPECT_NE(t.problems[0].find("prompt.subset 1: --scale wants a number, got 'nan'"), std::string::npos)
      << t.problems[0];
  EXPECT_NE(t.problems[1].find("prompt.subset 2: --guidance_scale wants a number, got 'inf'"),
            std::string::npos)
      << t.problems[1];
  EXPECT_NE(t.problems[2].find("prompt.subset 3: --height 20000 is larger"), std::string::npos)
      << t.problems[2];
}

TEST(SamplerPrompts, UnreadableFilesAreAClearError) {
  EXPECT_THROW(load_prompts("/nonexistent/prompts.txt"), InputError);
  EXPECT_THROW(load_prompts(write("p.yaml", "a: b\n")), InputError);
  EXPECT_THROW(load_prompts(write("broken.json", "[{")), InputError);
  EXPECT_THROW(load_prompts(write("broken.toml", "[prompt\n")), InputError);
}

}  // namespace
}  // namespace lorapipe::sampler
