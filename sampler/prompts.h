#pragma once
// kohya's sample prompt files (train_util.load_prompts / line_to_prompt_dict):
//   .txt   one prompt per line, options after " --": --n negative prompt, --w / --h size (rounded
//          down to a multiple of 8, at least 64), --d seed, --s steps (1-1000), --l CFG scale
//          (FLUX.1: true CFG with a negative prompt; 1 by default), --g FLUX.1 [dev]'s guidance,
//          --ss sampler (and lorapipe's --karras: euler and dpmsolver++ on Karras sigmas, as
//          --ss euler_karras / dpmsolver++_karras); lines that are empty or start with '#' are
//          skipped;
//   .toml  [prompt] defaults and [[prompt.subset]] entries (prompt, negative_prompt, width,
//          height, seed, sample_steps, scale, guidance_scale, sample_sampler);
//   .json  a list of such objects (or of plain prompt strings).
// A line or entry that cannot be rendered (no prompt, text that cannot be conditioned: invalid
// UTF-8, an attention weight that is not a number; a step count its sampler cannot take; a
// TOML/JSON value of the wrong type, named by its key) is reported with its line or entry number
// and skipped; the others are kept. Where kohya reads a line leniently, so does lorapipe, and
// notes it by line: an option's value is read from its start as kohya's regular expressions read
// it ("--s 28steps" is 28 steps; "--w abc" is left out), an unknown option is ignored, a sampler
// kohya does not know renders with ddim, as do kohya's samplers that lorapipe lacks, and the
// options of other models and networks (--cn, --am, --f, --fs, --ctr, --rcfg) are ignored.
// Sampler names are read in any case (kohya's must be lower case). A JSON null is an absent key,
// as kohya's dict.get reads it. Prompts are numbered by their place in the file, as kohya's
// "enum" (RenderRequest::index, in the image names and default seeds), skipped ones included.

#include <filesystem>
#include <string>
#include <vector>

#include "sampler/render.h"

namespace lorapipe::sampler {

struct PromptSet {
  std::vector<RenderRequest> prompts;
  std::vector<std::string> problems;  // "FILE:LINE: what" for each skipped line or entry
  std::vector<std::string> notes;     // "FILE:LINE: what" for each kept one read otherwise
};

// Defaults where a prompt sets nothing: kohya's (the family's steps, render.h's sample_steps;
// 512x512, CFG 7.5, `sampler`), and a
// fixed seed per prompt (`first_seed` + its place in the file), so every checkpoint of a run
// renders from the same noise and the images compare (kohya draws a random seed instead).
struct PromptDefaults {
  std::string sampler = "ddim";
  int64_t first_seed = 1234;
  // The model renders with the Stable Diffusion samplers, whose step counts a line's sampler must
  // take (pndm under 4 is skipped). A flow-matching family's Euler steps take any count, and it
  // reads no sampler name (kohya's FLUX.1 sampling ignores them): false there.
  bool check_sampler_steps = true;
  // The model reads A1111's attention syntax in prompts (the Stable Diffusion families), so a
  // weight that is not a number skips the line. FLUX.1's prompts are plain text, as kohya's
  // FLUX.1 sampling reads them: "(x:1.2.3)" renders as written there.
  bool weighted_prompts = true;
};

// Throws InputError when the file cannot be read at all (missing, not TOML/JSON where the name
// says so, an unknown extension).
PromptSet load_prompts(const std::filesystem::path& file, const PromptDefaults& defaults = {});

// One .txt line (already known not to be empty or a comment). Throws InputError when it has no
// prompt; what it leaves out or reads leniently, as kohya does, goes to `notes` when given.
RenderRequest parse_prompt_line(const std::string& line, const RenderRequest& defaults,
                                std::vector<std::string>* notes = nullptr);

}  // namespace lorapipe::sampler
