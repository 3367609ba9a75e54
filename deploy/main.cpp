// lorapipe: the launcher. `lorapipe run [flags]`, `lorapipe resume DIR [flags]`,
// `lorapipe status DIR [--json]`. Links no LibTorch: the stages are the lorapipe-* beside it.

#include <unistd.h>

#include <cstdio>
#include <exception>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "common/error.h"
#include "deploy/launcher.h"
#include "deploy/plan.h"

namespace {

constexpr const char* kUsage =
    "usage:\n"
    "  lorapipe run --output=DIR [--config=FILE.toml] [flags]\n"
    "      Runs preprocess, cacher, trainer and sampler on this machine in the run folder DIR.\n"
    "      Flags are kohya's names (--pretrained_model_name_or_path or --model, --data_dir,\n"
    "      --dataset_config, --resolution, --network_dim, --max_train_steps, --sample_prompts,\n"
    "      --sample_every_n_steps, ...). With no model: the built-in tiny model and demo data.\n"
    "  lorapipe resume DIR [flags]   continues a stopped run from its newest state (or starts\n"
    "                                it over when it stopped before its first save)\n"
    "  lorapipe status DIR [--json]  the run's stages, cache, training, checkpoints, samples\n"
    "  lorapipe plan --model=M [--vram_budget=12GB] [--gpu=\"RTX 3060\"] [--output=DIR]\n"
    "      [--resolutions=256,512,...] [--batch_sizes=1,2,4,8] [flags of a run]\n"
    "      Predicts each setting's peak device memory and time per step before training, and\n"
    "      recommends the fastest that fits; writes DIR/plan.json and a plot (plan.png).\n"
    "      With --sample_prompts: previews rendered on the training card beside the training\n"
    "      (one GPU) take their predicted share of the budget first.\n"
    "      --probe [--probe_device=cuda|cpu] [--probe_size=full|sdxl|flux|tiny] [--probe_steps=3]:\n"
    "      runs each shown setting as real steps on the device within the budget, and prints\n"
    "      measured peak, s/it, samples/s and MFU next to the prediction (out of memory: said).\n"
    "      With --auto_batch and a dataset: the batch each bucket gets in a run with --auto_batch\n"
    "      (the largest that fits --vram_budget, the samples per step kept).\n";

std::filesystem::path own_folder() {
  return std::filesystem::read_symlink("/proc/self/exe").parent_path();
}

}  // namespace

int main(int argc, char** argv) {
  namespace l = lorapipe::launcher;
  // `lorapipe run ... | tee log` and Ctrl-C: tee is gone before the launcher's last lines, and
  // a write to its pipe must not kill the launcher while the stages save (runtime/process.cpp
  // gives them SIGPIPE back).
  std::signal(SIGPIPE, SIG_IGN);
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    std::cout << kUsage;
    return args.empty() ? l::kExitError : l::kExitOk;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  // `lorapipe run --help` and the like: the usage, not "unknown flag --help".
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return l::kExitOk;
    }
  }
  try {
    if (command == "run") {
      l::Settings settings = l::parse_run_args(args);
      if (settings.output.empty()) settings.output = "lorapipe-run";
      return l::run(settings, {own_folder(), {}}, std::cout);
    }
    if (command == "resume") {
      if (args.empty()) throw lorapipe::InputError("lorapipe resume DIR: the run folder is needed");
      const std::filesystem::path dir = args[0];
      auto [settings, state] = l::resume_settings(dir, {args.begin() + 1, args.end()});
      if (state.empty()) {
        std::cout << "lorapipe: " << dir.string()
                  << " stopped before its first save; starting it over\n";
      } else {
        std::cout << "lorapipe: resuming " << dir.string() << " from " << state.string() << "\n";
      }
      return l::run(settings, {own_folder(), state, /*start_over=*/state.empty()}, std::cout);
    }
    if (command == "plan") return l::plan_command(args, std::cout);
    if (command == "status") {
      // `lorapipe status DIR [--json]`, the flag before or after the folder.
      bool json = false;
      std::vector<std::string> dirs;
      for (const std::string& arg : args) {
        if (arg == "--json") {
          json = true;
        } else if (arg.starts_with("--")) {
          throw lorapipe::InputError("lorapipe status: unknown flag " + arg + " (it takes --json)");
        } else {
          dirs.push_back(arg);
        }
      }
      if (dirs.size() != 1) {
        throw lorapipe::InputError("lorapipe status DIR [--json]: one run folder is needed, not " +
                                   std::to_string(dirs.size()));
      }
      std::cout << l::status(dirs[0], json);
      return l::kExitOk;
    }
    std::cerr << "lorapipe: unknown command '" << command << "'\n" << kUsage;
    return l::kExitError;
  } catch (const std::exception& e) {
    std::cerr << "lorapipe: " << e.what() << "\n";
    return l::kExitError;
  }
}
