#pragma once
// The `lorapipe` launcher as a library: one command that runs the four stages on one machine.
// It links no LibTorch (it starts in milliseconds); the stages are the lorapipe-* executables
// beside it, started as child processes on ipc:// endpoints inside the run folder.
//
// Flags are the stages' own kohya-style names. The launcher knows which stage takes each one
// (kFlags in launcher.cpp; LauncherFlags tests it against every stage's --helpxml) and refuses
// a flag no stage takes, naming it.

#include <filesystem>
#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

#include "runtime/exit_code.h"

namespace lorapipe::launcher {

enum class Stage { kPreprocess, kCacher, kTrainer, kSampler };
const char* stage_name(Stage stage);

// Exit codes of `lorapipe` and of every lorapipe-* stage (README, "Exit codes").
using runtime::kExitCheckFailed;
using runtime::kExitError;
using runtime::kExitInterrupted;
using runtime::kExitOk;

// The settings of one run: flags in the order given (name without dashes, value; "true" for a
// bare boolean), and the run folder.
struct Settings {
  std::vector<std::pair<std::string, std::string>> flags;
  std::filesystem::path output;
  // What was taken and acts nowhere (kohya's flags lorapipe does not act on, keys only the
  // kohya_ss GUI writes), each said once as the run starts.
  std::vector<std::string> notes;

  bool has(const std::string& name) const;
  std::string get(const std::string& name, const std::string& fallback = "") const;
  void set(const std::string& name, const std::string& value);  // replaces or appends
};

// Parses `lorapipe run` arguments: --name=value, --name value, bare booleans, kohya's
// multi-value --optimizer_args/--network_args, --config=FILE.toml (flags win over it) and
// --output=DIR (alias --output_dir). Throws InputError naming an unknown flag or a bad file.
Settings parse_run_args(const std::vector<std::string>& args);

// Reads a flat TOML table of flag names (strings, numbers, booleans) into flags.
// Keys that act nowhere add a line to `notes` where given.
std::vector<std::pair<std::string, std::string>> read_config(
    const std::filesystem::path& file, std::vector<std::string>* notes = nullptr);

// Writes `settings` as the flat TOML that read_config reads (run.toml).
void write_config(const Settings& settings, const std::filesystem::path& file);

// The arguments `stage` gets from `settings` (the launcher adds endpoints and folders).
std::vector<std::string> stage_args(const Settings& settings, Stage stage);

// Whether two --device values (the trainer's --device, the sampler's --sampler_device) name one
// GPU: "cuda" is "cuda:0", and so is "auto" (a stage's auto is the first GPU where there is
// one; where there is none, both autos are the CPU, which is one device too). Never "cpu", where
// the trainer and the sampler have cores, not a card, to share.
bool same_gpu(const std::string& device, const std::string& sampler_device);

// The GPUs a stage on this machine sees, counted without CUDA (the launcher links none): the
// NVIDIA driver's /proc/driver/nvidia/gpus entries, narrowed by CUDA_VISIBLE_DEVICES as CUDA
// narrows them. visible_gpus reads this process's environment and /proc; count_visible is its
// rule: `visible` is CUDA_VISIBLE_DEVICES (null: unset), `present` the driver's count.
int visible_gpus();
int count_visible(const char* visible, int present);

// The sampler's device where the user named none: with two GPUs or more, one the trainer does
// not use (previews on a spare GPU, with their own copy of the model); empty where there is no
// such GPU (the sampler's "auto", the trainer's GPU).
std::string spare_gpu_for_sampler(const std::string& device, int gpus);

// Where and when a run's previews render. `after` is --sample_after_training (auto, true or
// false); `why_not_shared`, empty where the trainer's weights can be shared, names what rules it
// out (block swap, a family whose sampler loads its own large text encoders, --merge_lora).
struct PreviewMode {
  bool share_weights = false;  // the sampler renders over the trainer's placed denoiser
  bool after_training = false;  // the sampler starts once the trainer has exited
  bool own_copy_beside = false;  // it renders during training on the trainer's GPU, own model
  bool map_weights = false;      // both on the CPU: both map the model file's weights
};
PreviewMode preview_mode(const std::string& device, const std::string& sampler_device,
                         const std::string& after, bool previews_wanted,
                         const std::string& why_not_shared);
// What rules out previews over the trainer's weights for a run's settings and its family
// (models::ModelFamily::previews_beside_training), as `why_not_shared` above; empty: nothing.
std::string why_previews_not_shared(const Settings& settings, bool family_previews_beside_training,
                                    const std::string& family_name);

// Every flag the launcher routes, as (name, stages, takes a value); for the flag table's test.
struct FlagInfo {
  std::string name;
  std::vector<std::pair<Stage, std::string>> targets;  // stage, and the stage's flag name
  bool boolean;
};
std::vector<FlagInfo> flag_table();

struct RunOptions {
  std::filesystem::path bin_dir;  // where lorapipe-* live (the launcher's own folder)
  std::filesystem::path resume;   // a state folder to resume the trainer from
  // `lorapipe resume` of a run that stopped before its first save: the folder is this run's and
  // the run starts over in it.
  bool start_over = false;
};

// Runs the pipeline in settings.output and returns the exit code: 0 when training is done and
// the sampler has rendered the final checkpoint; 130 after SIGINT/SIGTERM (the trainer saves a
// state when it has started; the message says whether it did); 2 when a stage failed (named on `display` with its last log lines; the others are
// stopped). Progress goes to `display`, one line rewritten in place on a terminal.
int run(Settings settings, const RunOptions& options, std::ostream& display);

// `lorapipe resume DIR`: the settings of DIR/run.toml with `overrides` on top, and the newest
// state folder under DIR/state; an empty path when the run stopped before it saved anything (no
// state, no LoRA): it starts over. Throws InputError when DIR has no run.toml, or has LoRAs but
// no state (trained without --save_state: nothing to resume, and starting over would mix runs).
std::pair<Settings, std::filesystem::path> resume_settings(
    const std::filesystem::path& dir, const std::vector<std::string>& overrides);

// `lorapipe status DIR [--json]`: what DIR/events.jsonl and the run's files say.
std::string status(const std::filesystem::path& dir, bool json);

// A run folder belongs to one launcher at a time: the one running (or resuming) it holds an
// exclusive lock on DIR/.lock, shared with its stages, until the last of them exits, however it
// exits. Is one holding it now? (Also true where the file system cannot say.)
bool run_folder_in_use(const std::filesystem::path& dir);

}  // namespace lorapipe::launcher
