// `lorapipe run`: the four stages as child processes, one display, events.jsonl, clean stops.
//
// Order: preprocess, the cacher and the sampler start together (the sampler loads its model
// while the cache fills); the trainer starts when the cacher has written the manifest and
// exited. The run is done when the trainer has saved its final LoRA and the sampler has
// rendered it. Each child runs in its own process group, so a terminal's Ctrl-C reaches only
// the launcher, which stops the children in order: SIGTERM to the trainer (it finishes the
// step and saves a state), SIGTERM to the rest; anything still alive after kStopGrace is
// killed, and so is everything at once on a second Ctrl-C (a user who will not wait for the
// save: the state being written is lost, the last complete one stays, as the trainer swaps a
// state in whole). Children get SIGTERM too if the launcher itself dies (PR_SET_PDEATHSIG).

#include <google/protobuf/util/json_util.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <ostream>
#include <set>
#include <sstream>
#include <thread>

#include "common/cuda_alloc_conf.h"
#include "common/error.h"
#include "common/numbers.h"
#include "deploy/curves.h"
#include "deploy/launcher.h"
#include "deploy/plan.h"
#include "models/family.h"
#include "models/safetensors.h"
#include "proto/lorapipe.pb.h"
#include "proto/wire.h"
#include "runtime/exit_code.h"
#include "runtime/process.h"

namespace lorapipe::launcher {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// The trainer stops at the end of its step in progress, then saves: the grace is this plus three
// of its reported steps (FLUX.1 with block swap and accumulation on a small card takes a minute
// a step).
constexpr auto kStopGrace = 120s;

volatile sig_atomic_t g_interrupted = 0;  // SIGINTs and SIGTERMs received, counted

std::string iso_now() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

// The demo prompts for the built-in run (kohya's prompt-file syntax).
constexpr const char* kDemoPrompts =
    "# kohya's prompt syntax: --n negative, --w/--h size, --d seed, --s steps, --ss sampler\n"
    "a photo of a red circle --w 128 --h 128 --d 1 --s 20\n"
    "a photo of a blue square --n blurry --w 128 --h 128 --d 2 --s 20 --ss euler_a\n";

struct Child {
  Stage stage;
  pid_t pid = -1;
  bool running = false;
  int exit_code = -1;  // exit status, or 128 + signal
  fs::path log;
};

// Starts `argv` in its own process group (so stopping a stage stops what it started) with
// stdout and stderr appended to `log`; it gets SIGTERM if the launcher dies.
pid_t start_process(const std::vector<std::string>& argv, const fs::path& log) {
  runtime::SpawnOptions options;
  options.argv = argv;
  options.stdout_path = log;
  options.stderr_path = log;
  options.append = true;
  options.own_process_group = true;
  options.die_with_parent = true;
  return runtime::spawn(options);
}

int run_to_end(const std::vector<std::string>& argv, const fs::path& log) {
  return runtime::wait_exit(start_process(argv, log));
}

// The cacher's closing line ("cache report: dataset NAME: E encoded, H cached (P% hits), R
// rejected; ...") as the CacheReport it also publishes: the published one can be missed when
// the cacher finishes before the launcher's subscription has connected (all hits take well
// under a second).
std::optional<wire::CacheReport> report_from_log(const fs::path& log) {
  std::ifstream in(log);
  static const std::regex line_re(
      R"(cache report: dataset (\S+): (\d+) encoded, (\d+) cached \([^)]*\), (\d+) rejected)");
  std::optional<wire::CacheReport> report;
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (!std::regex_search(line, m, line_re)) continue;
    report.emplace();
    report->set_dataset_id(m[1]);
    report->set_encoded(std::stoull(m[2]));
    report->set_hits(std::stoull(m[3]));
    report->set_rejected(std::stoull(m[4]));
    report->set_done(true);
  }
  return report;
}

std::vector<std::string> last_lines(const fs::path& path, size_t count) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
    if (lines.size() > count) lines.pop_front();
  }
  return {lines.begin(), lines.end()};
}

std::string duration_text(double seconds) {
  if (!(seconds >= 0)) return "?";
  const long s = static_cast<long>(seconds + 0.5);
  char text[32];
  if (s >= 3600) {
    std::snprintf(text, sizeof text, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  } else {
    std::snprintf(text, sizeof text, "%ld:%02ld", s / 60, s % 60);
  }
  return text;
}

// wire::receive, with a signal's EINTR read as "nothing yet" (the loop then sees the flag).
wire::Received receive(zmq::socket_t& socket, std::chrono::milliseconds timeout) {
  try {
    return wire::receive(socket, timeout);
  } catch (const zmq::error_t& e) {
    if (e.num() != EINTR) throw;
    return {};
  }
}

class Supervisor {
 public:
  Supervisor(Settings settings, RunOptions options, std::ostream& display)
      : s_(std::move(settings)), o_(std::move(options)), display_(display) {}
  ~Supervisor() {
    if (!dir_.empty()) curves_.write(dir_ / "samples", std::chrono::seconds(0));
    if (lock_fd_ >= 0) ::close(lock_fd_);  // the folder's lock goes with it
  }
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  int run();
  // Stops every stage; `interrupts` is how many SIGINT/SIGTERM this stop answers (1 after a
  // Ctrl-C, 0 after a failure): one more kills the stages at once. Also on the way out of a
  // launcher error.
  void stop_all(sig_atomic_t interrupts);

 private:
  void prepare_folder();
  void apply_demo_defaults();
  void apply_family_defaults();
  std::string endpoint(const std::string& name) const;
  void start(Stage stage, std::vector<std::string> args);
  int check_flags(Stage stage);  // kExitOk, or kExitError with the stage's reasons shown
  Child* child(Stage stage);
  void event(nlohmann::json e);
  void on_message(const google::protobuf::Message& m);
  void reap();
  int fail(const Child& c);
  void redraw(bool force);

  Settings s_;
  RunOptions o_;
  std::ostream& display_;
  fs::path dir_;
  int lock_fd_ = -1;  // DIR/.lock, held while this launcher runs the folder
  fs::path socket_dir_;
  std::ofstream events_;
  std::map<Stage, Child> children_;
  zmq::socket_t* sub_ = nullptr;  // the subscription to every stage's events, in run()
  bool tty_ = false;
  Clock::time_point last_draw_{};
  std::string last_line_;
  // What the display shows.
  wire::CacheReport cache_;
  wire::TrainProgress progress_;
  RunCurves curves_;  // samples/curves.js, for the gallery's plots
  std::string newest_sample_;
  std::set<std::string> announced_;
  std::string manifest_;  // the name the cacher gave this run's manifest
  // The family's rule for previews on the trainer's device (models/family.h), and its name.
  bool previews_beside_training_ = true;
  std::string family_name_;
  fs::path shared_weights_;  // the trainer's --share_weights manifest, when the sampler shares it
  std::map<std::string, std::string> errors_;  // stage -> the message of its StageStatus ERROR
  // The cacher waiting for another cacher's hold on the cache (up to --wait_for_writer_s) before
  // it can say anything on its socket: said once from its log, when last looked at.
  bool said_cacher_waits_ = false;
  Clock::time_point looked_at_cacher_log_{};
  std::map<std::string, wire::StageStatus> reported_;  // stage -> the newest StageStatus
  std::set<std::string> shown_;  // the stages' status lines already on the screen
};

void Supervisor::prepare_folder() {
  dir_ = fs::absolute(s_.output);
  fs::create_directories(dir_);
  // One launcher a folder: a second one (a resume while the run still runs) would remove the
  // first one's sockets and train a second trainer into the same state/ and lora/. The stages
  // inherit the descriptor (no O_CLOEXEC), so the lock holds until the last of them has exited:
  // a launcher killed outright leaves it held while its trainer still saves a state.
  lock_fd_ = ::open((dir_ / ".lock").c_str(), O_RDWR | O_CREAT, 0644);
  if (lock_fd_ < 0) {
    throw InputError("cannot open " + (dir_ / ".lock").string() + ": " + std::strerror(errno));
  }
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      std::ifstream holder(dir_ / ".lock");
      std::string pid;
      std::getline(holder, pid);
      throw InputError(dir_.string() + " is in use by another lorapipe" +
                       (pid.empty() ? std::string() : " (pid " + pid + ")") +
                       ": wait for it to finish, or stop it (Ctrl-C saves its state) and resume");
    }
    // A file system without locks (NFS without lockd): run unguarded rather than not at all.
    display_ << "lorapipe: cannot lock " << (dir_ / ".lock").string() << " ("
             << std::strerror(errno) << "): a second launcher on this folder would not be refused\n";
  }
  // The pid only names the holder in a second launcher's message: not written, it is left out.
  const std::string pid = std::to_string(getpid()) + "\n";
  if (::ftruncate(lock_fd_, 0) == 0 && ::write(lock_fd_, pid.data(), pid.size()) < 0) {
    (void)::ftruncate(lock_fd_, 0);
  }
  // A second run in the same folder would mix its LoRAs, states and samples with the first's
  // (the sampler skips steps it has rendered): the folder belongs to one run and its resumes.
  if (o_.resume.empty() && !o_.start_over && fs::exists(dir_ / "events.jsonl")) {
    throw InputError(dir_.string() + " already holds a run: `lorapipe resume " + dir_.string() +
                     "` continues it (flags after the folder change its settings, as for a run "
                     "that failed on one); a new run needs another --output");
  }
  for (const char* sub : {"lora", "samples", "state", "tensorboard", "logs"}) {
    fs::create_directories(dir_ / sub);
  }
  // ipc:// paths are limited to 107 bytes; a deep run folder puts its sockets in /tmp.
  socket_dir_ = dir_ / "sockets";
  if ((socket_dir_ / "sampler-pub.sock").string().size() > 100) {
    socket_dir_ = fs::temp_directory_path() / ("lorapipe-" + std::to_string(getpid()));
  }
  fs::create_directories(socket_dir_);
  // A socket file left by an earlier launcher of this folder would look like a bound cacher.
  for (const auto& entry : fs::directory_iterator(socket_dir_)) {
    if (entry.path().extension() == ".sock") fs::remove(entry.path());
  }
}

std::string Supervisor::endpoint(const std::string& name) const {
  return "ipc://" + (socket_dir_ / (name + ".sock")).string();
}

// No model given: the built-in tiny SD1.5 and the bundled demo dataset, made in DIR/demo by
// the stages' own generators, with settings that finish on a laptop CPU in about a minute.
void Supervisor::apply_demo_defaults() {
  const fs::path demo = dir_ / "demo";
  const fs::path model = demo / "model" / "tiny-sd15.safetensors";
  if (!fs::exists(model)) {
    display_ << "lorapipe: no --pretrained_model_name_or_path: the built-in tiny model and the "
                "demo dataset\n";
    if (run_to_end({(o_.bin_dir / "lorapipe-make-tiny-model").string(), (demo / "model").string()},
                   dir_ / "logs" / "demo.log") != 0) {
      throw Error("cannot write the tiny model; see " + (dir_ / "logs" / "demo.log").string());
    }
  }
  if (!s_.has("data_dir") && !s_.has("dataset_config") && !s_.has("in_json") &&
      !fs::exists(demo / "data")) {
    if (run_to_end({(o_.bin_dir / "lorapipe-demo-dataset").string(), (demo / "data").string()},
                   dir_ / "logs" / "demo.log") != 0) {
      throw Error("cannot write the demo dataset; see " + (dir_ / "logs" / "demo.log").string());
    }
  }
  if (!s_.has("sample_prompts") && !fs::exists(demo / "prompts.txt")) {
    std::ofstream(demo / "prompts.txt") << kDemoPrompts;
  }
  const std::vector<std::pair<std::string, std::string>> defaults = {
      {"pretrained_model_name_or_path", model.string()},
      {"tokenizer", (demo / "model" / "tiny-sd15-tokenizer").string()},
      {"data_dir", (demo / "data").string()},
      {"resolution", "128"},
      {"min_bucket_reso", "64"},
      {"max_bucket_reso", "256"},
      {"output_name", "demo"},
      {"max_train_steps", "100"},
      {"train_batch_size", "4"},
      {"network_dim", "8"},
      {"network_alpha", "8"},
      {"learning_rate", "1e-3"},
      {"lr_scheduler", "cosine"},
      {"save_every_n_steps", "50"},
      {"device", "cpu"},
      {"sampler_device", "cpu"},
      {"sample_prompts", (demo / "prompts.txt").string()},
  };
  // The demo's buckets (64-256) suit its 128 px images; a --resolution of the user's widens them
  // to take it in, so no bucket setting the user never made is refused.
  std::map<std::string, std::string> bucket_range = {{"min_bucket_reso", "64"},
                                                     {"max_bucket_reso", "256"}};
  if (s_.has("resolution")) {
    std::stringstream sides(s_.get("resolution"));
    int smallest = 64, largest = 256;
    for (std::string side; std::getline(sides, side, ',');) {
      try {
        smallest = std::min(smallest, std::stoi(side));
        largest = std::max(largest, std::stoi(side));
      } catch (const std::exception&) {
        // not a number: preprocess names it
      }
    }
    bucket_range = {{"min_bucket_reso", std::to_string(smallest)},
                    {"max_bucket_reso", std::to_string(largest)}};
  }
  const bool own_dataset = s_.has("dataset_config") || s_.has("in_json");
  for (auto [name, value] : defaults) {
    // A dataset of the user's keeps preprocess's (kohya's) bucket range and its own resolution.
    if (name == "data_dir" && own_dataset) continue;
    if ((bucket_range.count(name) || name == "resolution") && own_dataset) continue;
    if (bucket_range.count(name)) value = bucket_range.at(name);
    if (!s_.has(name)) s_.set(name, value);
  }
}

// The model's family (told by its keys or folder, no weights read) decides the defaults kohya
// users expect of it where the user set none: SDXL and FLUX.1 train at 1024 px, and then with
// buckets up to 2048 (the kohya_ss GUI's presets for them); a command that gives --resolution, as
// kohya's do, keeps kohya's own bucket default (1024), so it trains kohya's buckets. A bucket step the family cannot take is refused before any stage starts (SDXL and
// FLUX.1: a multiple of 32, as kohya's sdxl_train_util and flux_train_network check).
void Supervisor::apply_family_defaults() {
  const models::FamilyDetection detected = models::detect_family(
      s_.get("pretrained_model_name_or_path"), s_.has("model_family") ? s_.get("model_family") : "");
  const models::ModelFamily& family = models::model_family(detected.family);
  previews_beside_training_ = family.previews_beside_training;
  family_name_ = family.display_name;
  const bool own_dataset = s_.has("dataset_config") || s_.has("in_json");
  const bool chosen_resolution = !own_dataset && !s_.has("resolution");
  if (chosen_resolution) s_.set("resolution", std::to_string(family.default_resolution));
  // A dataset file's datasets without a resolution of their own take --resolution, and without
  // it the family's (kohya requires one; preprocess alone would take SD1.5's 512 for SDXL). Not
  // on a resume: a run.toml without it trained at preprocess's 512 (before this rule), and its
  // state goes on with the buckets it trained on.
  if (own_dataset && !s_.has("resolution") && o_.resume.empty()) {
    s_.set("resolution", std::to_string(family.default_resolution));
  }
  if (chosen_resolution && !s_.has("max_bucket_reso") && family.default_max_bucket_reso > 0) {
    s_.set("max_bucket_reso", std::to_string(family.default_max_bucket_reso));
  }
  const int steps = s_.has("bucket_reso_steps") ? std::atoi(s_.get("bucket_reso_steps").c_str()) : 64;
  if (steps > 0 && steps % family.bucket_reso_multiple != 0) {
    throw InputError("--bucket_reso_steps=" + std::to_string(steps) + ": " + family.display_name +
                     " needs bucket sides that are multiples of " +
                     std::to_string(family.bucket_reso_multiple) +
                     " (as kohya requires: every bucket's latents must divide evenly through "
                     "the denoiser, SDXL's U-Net downsamplers or FLUX.1's 2x2 latent patches); "
                     "use 32 or 64");
  }
}

void Supervisor::start(Stage stage, std::vector<std::string> args) {
  Child c;
  c.stage = stage;
  c.log = dir_ / "logs" / (std::string(stage_name(stage)) + ".log");
  args.insert(args.begin(), (o_.bin_dir / ("lorapipe-" + std::string(stage_name(stage)))).string());
  c.pid = start_process(args, c.log);  // throws, naming the program, when it cannot start
  c.running = true;
  nlohmann::json command = args;
  event({{"event", "Stage"}, {"stage", stage_name(stage)}, {"state", "started"}, {"pid", c.pid},
         {"command", command}});
  children_[stage] = c;
}

// The trainer starts only once the data is cached, which takes hours on a large dataset with a
// real VAE, and a sampler that renders after the training only then: their flags are checked
// first (--check_flags: everything that needs no model or data), so a flag either would refuse
// stops the run before any stage starts.
int Supervisor::check_flags(Stage stage) {
  const std::string name = stage_name(stage);
  std::vector<std::string> args = stage_args(s_, stage);
  args.insert(args.begin(), (o_.bin_dir / ("lorapipe-" + name)).string());
  if (stage == Stage::kTrainer && !s_.has("dataset_id")) {
    args.push_back("--dataset_id=the-cachers-manifest");
  }
  args.insert(args.end(), {"--output_dir=" + dir_.string(), "--check_flags"});
  const fs::path log = dir_ / "logs" / (name + ".log");
  // The log is appended to (a resumed run keeps its own): this pass's lines start here.
  std::error_code ignored;
  const uintmax_t before = fs::exists(log, ignored) ? fs::file_size(log, ignored) : 0;
  const int code = run_to_end(args, log);
  if (code == kExitOk) {
    // What the stage takes but warns about (a kohya flag it ignores, --log_with=wandb writing
    // TensorBoard alone) is said on the screen before the run starts, not only in its log.
    std::ifstream in(log);
    in.seekg(static_cast<std::streamoff>(before == static_cast<uintmax_t>(-1) ? 0 : before));
    for (std::string line; std::getline(in, line);) {
      const size_t end = line.find("] ");
      if (line.starts_with("[W ") && end != std::string::npos) {
        display_ << "lorapipe: the " << name << " warns: " << line.substr(end + 2) << "\n";
      }
    }
    display_ << std::flush;
    return kExitOk;
  }
  display_ << "lorapipe: the " << name << " refuses its flags (exit code " << code
           << "), so no stage was started; the last lines of " << log.string() << ":\n";
  for (const std::string& line : last_lines(log, 15)) display_ << "  | " << line << "\n";
  display_ << "lorapipe: `lorapipe resume " << dir_.string()
           << "` with the flag corrected runs it\n" << std::flush;
  event({{"event", "Run"}, {"result", "failed"}, {"stage", name}, {"exit_code", code}});
  return kExitError;
}

Child* Supervisor::child(Stage stage) {
  auto it = children_.find(stage);
  return it == children_.end() ? nullptr : &it->second;
}

void Supervisor::event(nlohmann::json e) {
  e["time"] = iso_now();
  events_ << e.dump() << "\n" << std::flush;
  curves_.add(e);
  curves_.write(dir_ / "samples");  // at most once a second; the last in the destructor
}

void Supervisor::on_message(const google::protobuf::Message& m) {
  // Stages repeat their status every few seconds for late subscribers; events.jsonl keeps
  // each change once.
  if (const auto* st = dynamic_cast<const wire::StageStatus*>(&m)) {
    const auto it = reported_.find(st->stage());
    if (it != reported_.end() && it->second.SerializeAsString() == st->SerializeAsString()) return;
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &json, options);
  nlohmann::json e = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (e.is_discarded()) e = nlohmann::json::object();
  e["event"] = m.GetDescriptor()->name();
  event(std::move(e));
  if (const auto* r = dynamic_cast<const wire::CacheReport*>(&m)) {
    cache_ = *r;
    if (r->done()) manifest_ = r->dataset_id();
  }
  if (const auto* p = dynamic_cast<const wire::TrainProgress*>(&m)) progress_ = *p;
  if (const auto* c = dynamic_cast<const wire::CheckpointReady*>(&m)) {
    // The trainer announces its newest checkpoint again every few seconds (for samplers
    // that start late); the display names each one once.
    if (announced_.insert(c->path()).second) {
      redraw(true);
      display_ << (tty_ ? "\r\x1b[K" : "") << "lorapipe: checkpoint " << c->path() << " (step "
               << c->step() << (c->final() ? ", final" : "") << ")\n";
    }
  }
  if (const auto* st = dynamic_cast<const wire::StageStatus*>(&m)) {
    if (st->state() == wire::StageStatus::ERROR) errors_[st->stage()] = st->message();
    // What preprocess used, and what it left out: a broken image or a folder that is not a
    // repeat folder is worth a line on the screen, not only in its log.
    // So is a prompt line the sampler skipped.
    const bool preprocess_done = st->state() == wire::StageStatus::DONE &&
                                 st->stage() == stage_name(Stage::kPreprocess);
    const bool sampler_ready = st->state() == wire::StageStatus::READY &&
                               st->stage() == stage_name(Stage::kSampler) &&
                               st->message().find("skipped") != std::string::npos;
    // Once each: a stage repeats its status, and the sampler is READY again after every render.
    if ((preprocess_done || sampler_ready) && !st->message().empty() &&
        shown_.insert(st->stage() + ": " + st->message()).second) {
      display_ << (tty_ ? "\r\x1b[K" : "") << "lorapipe: " << st->stage() << ": " << st->message();
      if (st->message().find("skipped") != std::string::npos) {
        display_ << ": see " << (dir_ / "logs" / (st->stage() + ".log")).string();
      }
      display_ << "\n";
    }
    reported_[st->stage()] = *st;
  }
  if (const auto* r = dynamic_cast<const wire::SampleReady*>(&m)) {
    newest_sample_ = r->contact_sheet().empty() && r->image_paths_size() > 0 ? r->image_paths(0)
                                                                            : r->contact_sheet();
    display_ << (tty_ ? "\r\x1b[K" : "") << "lorapipe: samples of step " << r->step() << ": "
             << newest_sample_ << "\n";
  }
  redraw(false);
}

// Collects every child that ended since the last call.
void Supervisor::reap() {
  for (;;) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    for (auto& [stage, c] : children_) {
      if (c.pid != pid || !c.running) continue;
      c.running = false;
      c.exit_code = runtime::exit_code_of_wait_status(status);
      event({{"event", "Stage"}, {"stage", stage_name(stage)}, {"state", "exited"},
             {"exit_code", c.exit_code}});
    }
  }
}

// The trainer first (it saves a state), then the rest; waits, and kills what outlives the grace
// or is still running when another interrupt arrives.
void Supervisor::stop_all(sig_atomic_t interrupts) {
  for (auto& [stage, c] : children_) {
    if (c.running) kill(c.pid, SIGTERM);
  }
  const auto grace = std::chrono::duration_cast<std::chrono::seconds>(
      kStopGrace + std::chrono::duration<double>(3 * std::max(0.0, progress_.seconds_per_step())));
  const auto deadline = Clock::now() + grace;
  bool killed = false;
  for (;;) {
    reap();
    bool any = false;
    for (auto& [stage, c] : children_) any = any || c.running;
    if (!any) return;
    const bool again = g_interrupted > interrupts;
    if (!killed && (again || Clock::now() > deadline)) {
      display_ << (tty_ ? "\r\x1b[K" : "") << "lorapipe: "
               << (again ? (interrupts > 0 ? "interrupted again" : "interrupted while stopping")
                         : "the stages did not stop within " +
                               std::to_string(grace.count()) + " s")
               << "; killing them now (a state being saved is lost; the last complete state "
                  "stays)\n"
               << std::flush;
      for (auto& [stage, c] : children_) {
        if (c.running) kill(c.pid, SIGKILL);
      }
      killed = true;
    }
    std::this_thread::sleep_for(50ms);
  }
}

int Supervisor::fail(const Child& c) {
  // What the stage said of its failure, when it said it before exiting.
  const auto deadline = Clock::now() + 300ms;
  while (!errors_.count(stage_name(c.stage)) && Clock::now() < deadline) {
    const wire::Received late = receive(*sub_, 50ms);
    if (late.ok()) on_message(*late.message);
  }
  redraw(true);
  if (const auto it = errors_.find(stage_name(c.stage)); it != errors_.end()) {
    display_ << (tty_ ? "\r\x1b[K" : "") << "lorapipe: the " << stage_name(c.stage)
             << " failed: " << it->second << "\n";
  }
  display_ << (tty_ ? "\r\x1b[K" : "") << "lorapipe: the " << stage_name(c.stage)
           << (c.exit_code > 128 ? " was killed by signal " + std::to_string(c.exit_code - 128)
                                 : " failed with exit code " + std::to_string(c.exit_code))
           << "; the last lines of " << c.log.string() << ":\n";
  for (const std::string& line : last_lines(c.log, 15)) display_ << "  | " << line << "\n";
  // The previews failed, not the training: where it finished, its LoRA is whole.
  if (const Child* trainer = child(Stage::kTrainer);
      c.stage == Stage::kSampler && trainer != nullptr && !trainer->running &&
      trainer->exit_code == kExitOk) {
    display_ << "lorapipe: the training itself finished: the final LoRA is in "
             << (dir_ / "lora").string() << "; its samples are what failed\n";
  }
  display_ << std::flush;
  stop_all(g_interrupted);
  event({{"event", "Run"}, {"result", "failed"}, {"stage", stage_name(c.stage)},
         {"exit_code", c.exit_code}});
  return kExitError;
}

void Supervisor::redraw(bool force) {
  const auto now = Clock::now();
  if (!force && now - last_draw_ < (tty_ ? 250ms : 10s)) return;
  last_draw_ = now;
  std::ostringstream line;
  auto state = [&](Stage stage) -> std::string {
    const Child* c = child(stage);
    if (c == nullptr) return "waiting";
    if (c->running) return "running";
    return c->exit_code == 0 ? "done" : "exit " + std::to_string(c->exit_code);
  };
  if (const Child* pre = child(Stage::kPreprocess); pre != nullptr && pre->running) {
    line << "preprocess";
    const auto it = reported_.find(stage_name(Stage::kPreprocess));
    if (it != reported_.end() && it->second.state() == wire::StageStatus::PROGRESS) {
      line << " " << it->second.done() << "/" << it->second.total() << " " << it->second.unit();
    } else {
      line << " running";
    }
    line << " | ";
  }
  line << "cache " << state(Stage::kCacher) << " (" << cache_.hits() << " hits, "
       << cache_.encoded() << " misses, " << cache_.rejected() << " rejected)";
  line << " | trainer " << state(Stage::kTrainer);
  if (progress_.total_steps() > 0) {
    char text[160];
    std::snprintf(text, sizeof text, " step %llu/%llu loss %.4f %.2f s/it ETA %s",
                  static_cast<unsigned long long>(progress_.step()),
                  static_cast<unsigned long long>(progress_.total_steps()), progress_.loss(),
                  progress_.seconds_per_step(), duration_text(progress_.eta_seconds()).c_str());
    line << text;
  }
  if (child(Stage::kSampler) != nullptr) {
    line << " | sampler " << state(Stage::kSampler);
    if (!newest_sample_.empty()) line << " " << fs::path(newest_sample_).filename().string();
  }
  const std::string text = line.str();
  if (tty_) {
    display_ << "\r\x1b[K" << text << std::flush;
  } else if (text != last_line_) {
    display_ << text << "\n" << std::flush;
  }
  last_line_ = text;
}

int Supervisor::run() {
  tty_ = &display_ == &std::cout && isatty(1);
  prepare_folder();
  if (!s_.has("pretrained_model_name_or_path")) apply_demo_defaults();
  apply_family_defaults();
  if (!s_.has("data_dir") && !s_.has("dataset_config") && !s_.has("in_json")) {
    throw InputError("--data_dir, --dataset_config or --in_json is needed with a model of your "
                     "own");
  }
  // After the family's defaults: the batches are sized at the resolution the run trains at. Sizes
  // the run already holds (a resumed run's, from its run.toml) stay: its state was trained in them.
  if (s_.has("auto_batch") && !s_.has("bucket_batch_sizes")) {
    display_ << apply_auto_batch(s_) << "\n";
  } else if (s_.has("auto_batch")) {
    display_ << "lorapipe: --auto_batch: the run's batch sizes per bucket, "
             << s_.get("bucket_batch_sizes") << "\n";
  }
  write_config(s_, dir_ / "run.toml");
  curves_.add_events_file(dir_ / "events.jsonl");  // a resumed run's earlier steps
  events_.open(dir_ / "events.jsonl", std::ios::app);
  event({{"event", "Run"}, {"result", "started"}, {"output", dir_.string()},
         {"resume", o_.resume.string()}});
  if (const int code = check_flags(Stage::kTrainer); code != kExitOk) return code;
  const bool previews_asked = s_.has("sample_prompts") &&
                              !(s_.has("debug_dataset") && s_.get("debug_dataset") == "true");
  if (previews_asked && !s_.has("sampler_device")) {
    // Decided on each start (not kept in run.toml): a resume may be on another machine.
    const std::string trainer_device = s_.has("device") ? s_.get("device") : "auto";
    const int gpus = visible_gpus();
    const std::string spare = spare_gpu_for_sampler(trainer_device, gpus);
    if (!spare.empty()) {
      s_.set("sampler_device", spare);
      display_ << "lorapipe: " << gpus << " GPUs: the sampler renders on " << spare
               << " with its own copy of the model, the trainer on " << trainer_device
               << " (--sampler_device picks another)\n";
    }
  }
  if (previews_asked) {
    if (const int code = check_flags(Stage::kSampler); code != kExitOk) return code;
  }

  zmq::context_t context(1);
  wire::SocketOptions sub_options;
  sub_options.receive_timeout = 200ms;
  // The stages bind after they have loaded their models: retry often, so events from their
  // first moments are not lost while a backed-off reconnect waits.
  sub_options.reconnect_interval_max = 100ms;
  zmq::socket_t sub = wire::make_socket(context, zmq::socket_type::sub, sub_options);
  sub_ = &sub;
  sub.set(zmq::sockopt::subscribe, "");
  for (const char* name : {"preprocess-pub", "cacher-pub", "trainer-pub", "sampler-pub"}) {
    sub.connect(endpoint(name));
  }

  std::vector<std::string> args = stage_args(s_, Stage::kCacher);
  // Another run's cacher writing the same cache: take turns (it binds once the cache is its).
  args.insert(args.end(), {"--pull=" + endpoint("cacher-pull"), "--rep=" + endpoint("cacher-rep"),
                           "--pub=" + endpoint("cacher-pub"), "--wait_for_writer_s=86400"});
  start(Stage::kCacher, args);
  // --debug_dataset: the trainer prints its batches and trains nothing; nothing to render.
  const bool debug_dataset = s_.has("debug_dataset") && s_.get("debug_dataset") == "true";
  // A sampler on the trainer's GPU renders over the trainer's own placed denoiser as it trains
  // (--share_weights / --shared_weights, models/shared_weights.h): no second copy of the model.
  // Where that cannot be (block swap keeps weights off the device; FLUX.1's sampler would add its
  // T5 XXL; --merge_lora writes the weights) it starts once the training is over and renders what
  // the run saved, in step order. --sample_after_training (true or false) decides otherwise.
  const std::string device = s_.has("device") ? s_.get("device") : "auto";
  const std::string sampler_device = s_.has("sampler_device") ? s_.get("sampler_device") : "auto";
  const std::string after = s_.has("sample_after_training") ? s_.get("sample_after_training")
                                                            : "auto";
  const bool previews_wanted = s_.has("sample_prompts") && !debug_dataset;
  const std::string why_not_shared =
      why_previews_not_shared(s_, previews_beside_training_, family_name_);
  const PreviewMode mode =
      preview_mode(device, sampler_device, after, previews_wanted, why_not_shared);
  const bool share_weights = mode.share_weights;
  const bool sample_after_training = mode.after_training;
  if (share_weights) {
    shared_weights_ = dir_ / "shared_weights.json";
    std::error_code ec;
    fs::remove(shared_weights_, ec);  // an earlier run's, released: not this trainer's
    display_ << "lorapipe: the sampler shares the trainer's device (" << device
             << "): it renders over the trainer's own weights as it trains, with no second copy "
                "of the model (--sample_after_training renders after the training instead)\n";
  }
  if (sample_after_training) {
    display_ << "lorapipe: the sampler "
             << (after == "true" ? std::string("waits (--sample_after_training)")
                                 : "shares the trainer's device (" + device + ") and " +
                                       why_not_shared)
             << ": previews render after the training, from the LoRAs it saved "
                "(--sampler_device=another device renders them as it trains)\n";
  }
  if (previews_wanted && !sample_after_training) {
    // Both on the CPU: the sampler takes no second copy of the model; both map the weights the
    // file holds as they use them (models/mapped_weights.h).
    if (mode.map_weights && !s_.has("map_weights")) {
      s_.set("map_weights", "true");
      display_ << "lorapipe: the sampler shares the trainer's CPU: both map the model file's "
                  "weights (--map_weights), so previews hold no second copy of the model\n";
    }
    if (mode.own_copy_beside) {
      display_ << "lorapipe: the sampler renders during the training (--sample_after_training="
                  "false) on the trainer's device (" << device << ") with its own copy of the "
                  "model, as " << why_not_shared << ": the card must hold both\n";
    }
    args = stage_args(s_, Stage::kSampler);
    args.insert(args.end(), {"--output_dir=" + dir_.string(), "--sub=" + endpoint("trainer-pub"),
                             "--pub=" + endpoint("sampler-pub")});
    if (share_weights) args.push_back("--shared_weights=" + shared_weights_.string());
    start(Stage::kSampler, args);
  }

  for (;;) {
    const wire::Received r = receive(sub, 200ms);
    if (r.ok()) on_message(*r.message);
    reap();
    if (g_interrupted) {
      redraw(true);
      display_ << (tty_ ? "\r\x1b[K" : "") << "lorapipe: interrupted; stopping the stages"
               << (child(Stage::kTrainer) != nullptr ? " (the trainer saves a state)" : "")
               << "; interrupt again to kill them at once\n" << std::flush;
      stop_all(1);  // a second interrupt, even one that came before this line, kills
      while (receive(sub, 0ms).ok()) {
      }
      event({{"event", "Run"}, {"result", "interrupted"}, {"exit_code", kExitInterrupted}});
      // The trainer exits 130 once it has saved its state; anything else saved none.
      const Child* trainer = child(Stage::kTrainer);
      const std::string resume = "`lorapipe resume " + dir_.string() + "`";
      if (trainer != nullptr && trainer->exit_code == kExitInterrupted) {
        display_ << "lorapipe: stopped; " << resume << " continues from the trainer's state\n";
      } else if (trainer == nullptr) {
        display_ << "lorapipe: stopped before the trainer started; " << resume << " runs it\n";
      } else if (trainer->exit_code == 0) {
        display_ << "lorapipe: stopped after training finished: the final LoRA is in "
                 << (dir_ / "lora").string() << "; samples of it may be missing\n";
      } else {
        display_ << "lorapipe: stopped, but the trainer "
                 << (trainer->exit_code > 128
                         ? "was killed by signal " + std::to_string(trainer->exit_code - 128)
                         : "exited with code " + std::to_string(trainer->exit_code))
                 << " without saving this state (see " << trainer->log.string() << "); " << resume
                 << " continues from an earlier state, if any\n";
      }
      return kExitInterrupted;
    }
    for (auto& [stage, c] : children_) {
      if (c.running || c.exit_code == 0) continue;
      return fail(c);
    }
    const Child* cacher = child(Stage::kCacher);
    // Once a second, and once more when it has bound (its wait may have been shorter).
    const bool cacher_bound = fs::exists(socket_dir_ / "cacher-rep.sock");
    if (!said_cacher_waits_ && child(Stage::kPreprocess) == nullptr && cacher->running &&
        (Clock::now() - looked_at_cacher_log_ > 1s || cacher_bound)) {
      looked_at_cacher_log_ = Clock::now();
      for (const std::string& line : last_lines(cacher->log, 5)) {
        const size_t end = line.find("] ");
        if (line.find("waiting for it to finish") == std::string::npos || end == std::string::npos) {
          continue;
        }
        display_ << (tty_ ? "\r\x1b[K" : "") << "lorapipe: the cacher: " << line.substr(end + 2)
                 << " (another cacher uses the cache)\n"
                 << std::flush;
        said_cacher_waits_ = true;
      }
    }
    // preprocess starts once the cacher has bound its sockets: it holds the cache then (another
    // run's cacher may have had it first), and answers at once.
    if (child(Stage::kPreprocess) == nullptr && cacher->running &&
        fs::exists(socket_dir_ / "cacher-rep.sock")) {
      args = stage_args(s_, Stage::kPreprocess);
      args.insert(args.end(),
                  {"--push=" + endpoint("cacher-pull"), "--request=" + endpoint("cacher-rep"),
                   "--pub=" + endpoint("preprocess-pub")});
      start(Stage::kPreprocess, args);
    }
    const Child* preprocess = child(Stage::kPreprocess);
    if (child(Stage::kTrainer) == nullptr && preprocess != nullptr && !cacher->running &&
        !preprocess->running) {
      // The trainer trains on the manifest this run's cacher wrote, by the name it gave it: its
      // last CacheReport says, or else its report line in the log.
      const auto wait_until = Clock::now() + 2s;
      while (manifest_.empty() && Clock::now() < wait_until) {
        const wire::Received late = receive(sub, 100ms);
        if (late.ok()) on_message(*late.message);
      }
      if (manifest_.empty()) {
        if (const auto report = report_from_log(cacher->log)) on_message(*report);
      }
      args.clear();
      // Without a sampler nobody renders kohya's sample schedule: the trainer would save
      // sample-only LoRAs for no one (kohya says "No prompt file" and renders nothing).
      const bool previews = child(Stage::kSampler) != nullptr || sample_after_training;
      std::string left_out;
      for (std::string& arg : stage_args(s_, Stage::kTrainer)) {
        if (!manifest_.empty() && arg.rfind("--dataset_id=", 0) == 0) continue;
        if (!previews && (arg.rfind("--sample_every_n_steps=", 0) == 0 ||
                          arg.rfind("--sample_every_n_epochs=", 0) == 0 ||
                          arg.rfind("--sample_at_first=", 0) == 0)) {
          left_out += (left_out.empty() ? "" : " ") + arg;
          continue;
        }
        args.push_back(arg);
      }
      if (!left_out.empty()) {
        display_ << (tty_ ? "\r\x1b[K" : "") << "lorapipe: no previews are rendered (no "
                 << "--sample_prompts, or --debug_dataset): " << left_out << " left out\n";
      }
      if (!manifest_.empty()) args.push_back("--dataset_id=" + manifest_);
      args.insert(args.end(), {"--output_dir=" + dir_.string(), "--pub=" + endpoint("trainer-pub"),
                               "--save_state"});
      if (!o_.resume.empty()) args.push_back("--resume=" + o_.resume.string());
      if (!shared_weights_.empty()) args.push_back("--share_weights=" + shared_weights_.string());
      start(Stage::kTrainer, args);
    }
    const Child* trainer = child(Stage::kTrainer);
    if (sample_after_training && trainer != nullptr && !trainer->running &&
        trainer->exit_code == 0 && child(Stage::kSampler) == nullptr) {
      args = stage_args(s_, Stage::kSampler);
      args.insert(args.end(), {"--output_dir=" + dir_.string(),
                               "--replay_dir=" + (dir_ / "lora").string(),
                               "--pub=" + endpoint("sampler-pub")});
      start(Stage::kSampler, args);
    }
    const Child* sampler = child(Stage::kSampler);
    if (trainer != nullptr && !trainer->running && (sampler == nullptr || !sampler->running)) {
      while (true) {  // what the stages published last
        const wire::Received rest = receive(sub, 100ms);
        if (!rest.ok()) break;
        on_message(*rest.message);
      }
      redraw(true);
      if (tty_) display_ << "\n";
      event({{"event", "Run"}, {"result", "done"}, {"exit_code", kExitOk}});
      if (debug_dataset) {
        display_ << "lorapipe: done. --debug_dataset: the batches are in "
                 << (dir_ / "logs" / "trainer.log").string() << "; nothing was trained\n"
                 << std::flush;
        return kExitOk;
      }
      display_ << "lorapipe: done. LoRA files in " << (dir_ / "lora").string();
      if (sampler != nullptr) display_ << "; samples in " << (dir_ / "samples" / "index.html").string();
      display_ << "\n" << std::flush;
      return kExitOk;
    }
    redraw(false);
  }
}

}  // namespace

bool same_gpu(const std::string& device, const std::string& sampler_device) {
  auto gpu = [](const std::string& d) { return d == "cuda" || d == "auto" ? "cuda:0" : d; };
  return gpu(device) == gpu(sampler_device) && gpu(device) != "cpu";
}

int count_visible(const char* visible, int present) {
  if (visible == nullptr) return present;
  // CUDA takes the list up to its first entry that names no device ("-1", an empty one).
  int count = 0;
  std::stringstream list(visible);
  std::string entry;
  while (std::getline(list, entry, ',')) {
    if (entry.empty() || entry[0] == '-') break;
    ++count;
  }
  return std::min(count, present);
}

int visible_gpus() {
  std::error_code ec;
  int present = 0;
  for (const auto& gpu : fs::directory_iterator("/proc/driver/nvidia/gpus", ec)) {
    (void)gpu;
    ++present;
  }
  return count_visible(std::getenv("CUDA_VISIBLE_DEVICES"), present);
}

std::string spare_gpu_for_sampler(const std::string& device, int gpus) {
  if (gpus < 2 || device == "cpu") return "";
  int trainer = 0;  // auto and cuda: the first GPU
  if (device.rfind("cuda:", 0) == 0) {
    try {
      trainer = std::stoi(device.substr(5));
    } catch (const std::exception&) {
      return "";  // the trainer refuses it by name
    }
  } else if (device != "auto" && device != "cuda") {
    return "";
  }
  if (trainer < 0 || trainer >= gpus) return "";
  return "cuda:" + std::to_string(trainer == 0 ? 1 : 0);
}

std::string why_previews_not_shared(const Settings& s, bool family_previews_beside_training,
                                    const std::string& family_name) {
  if (s.has("blocks_to_swap") && s.get("blocks_to_swap") != "0") {
    return "--blocks_to_swap keeps weights off the device";
  }
  if (!family_previews_beside_training) {
    return family_name + "'s sampler would load its own text encoders beside the training";
  }
  if (s.has("merge_lora") && s.get("merge_lora") != "false") return "--merge_lora writes the weights";
  // The stages inherit the launcher's CUDA allocator settings (common/cuda_alloc_conf.h).
  if (const std::string why = cuda_alloc_conf_blocks_ipc(); !why.empty()) return why;
  return "";
}

PreviewMode preview_mode(const std::string& device, const std::string& sampler_device,
                         const std::string& after, bool previews_wanted,
                         const std::string& why_not_shared) {
  PreviewMode mode;
  if (!previews_wanted) return mode;
  const bool one_gpu = same_gpu(device, sampler_device);
  // Sharing is the default on one GPU, and --sample_after_training=false keeps it: only where it
  // is ruled out does false mean a second copy of the model on the card.
  mode.share_weights = after != "true" && one_gpu && why_not_shared.empty();
  mode.after_training = after == "true" || (after == "auto" && one_gpu && !mode.share_weights);
  mode.own_copy_beside = after == "false" && one_gpu && !mode.share_weights;
  mode.map_weights = !mode.after_training && device == "cpu" && sampler_device == "cpu";
  return mode;
}

int run(Settings settings, const RunOptions& options, std::ostream& display) {
  if (settings.output.empty()) throw InputError("--output=DIR (the run folder) is needed");
  struct sigaction action {};
  action.sa_handler = [](int) { g_interrupted = g_interrupted + 1; };
  sigemptyset(&action.sa_mask);
  // The count is read-modify-write: neither signal may interrupt the handler of the other.
  sigaddset(&action.sa_mask, SIGINT);
  sigaddset(&action.sa_mask, SIGTERM);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  for (const std::string& note : settings.notes) display << "lorapipe: " << note << "\n";
  if (settings.has("plan_budget") && options.resume.empty()) {
    display << apply_plan_budget(settings) << "\n";
  } else if (settings.has("plan_budget")) {
    // The state was trained in the settings planned then (run.toml holds them); planned again,
    // with other flags or another card, they would differ and the trainer refuse the state.
    display << "lorapipe: --plan_budget: the run goes on in the settings planned when it started "
               "(run.toml)\n";
  }
  Supervisor supervisor(std::move(settings), options, display);
  try {
    return supervisor.run();
  } catch (...) {
    supervisor.stop_all(g_interrupted);
    throw;
  }
}

namespace {

// The LoRA a state holds fixes its rank and alpha (its lora.safetensors: the lora_down shapes and
// the alpha tensors) and the seed its data order came from (trainer.json): a resume that changes
// them cannot load or continue it. Refused here, before anything starts, rather than by the
// trainer once the model has loaded and the cache been read. Only what the resume changes from
// the run's own settings (`before`, its run.toml) is checked: those trained the state. Ranks
// that differ by layer, or taken from --network_weights (--dim_from_weights), are the
// trainer's to check.
void check_resume_keeps_the_lora(const Settings& settings, const Settings& before,
                                 const fs::path& state) {
  auto changed = [&](const std::string& flag) {
    if (!settings.has(flag)) return false;
    if (!before.has(flag)) return true;
    const std::optional<double> a = parse_double(settings.get(flag)),
                                b = parse_double(before.get(flag));
    return a && b ? *a != *b : settings.get(flag) != before.get(flag);
  };
  auto refuse = [&](const std::string& flag, const std::string& had, const std::string& where) {
    throw InputError("--" + flag + "=" + settings.get(flag) + ": the state " + state.string() +
                     " trained with " + had + " (" + where + "); a resume goes on with it. "
                     "Leave the flag out, or start a new run with --network_weights=" +
                     (state / "lora.safetensors").string());
  };
  const bool from_weights = settings.get("dim_from_weights", "false") != "false";
  const bool per_layer = settings.get("network_args").find("dims") != std::string::npos;
  std::set<int64_t> ranks;
  std::set<float> alphas;
  if (!from_weights && !per_layer && (changed("network_dim") || changed("network_alpha"))) {
    try {
      const models::SafetensorsFile lora =
          models::SafetensorsFile::open(state / "lora.safetensors");
      for (const models::TensorInfo& t : lora.tensors()) {
        if (t.name.ends_with(".lora_down.weight") && t.shape.size() == 2) {
          ranks.insert(t.shape[0]);
        }
        if (t.name.ends_with(".alpha") && t.dtype == models::Dtype::kF32) {
          const std::string_view bytes = lora.bytes(t);
          float alpha = 0;
          if (bytes.size() != sizeof alpha) continue;
          std::memcpy(&alpha, bytes.data(), sizeof alpha);
          alphas.insert(alpha);
        }
      }
    } catch (const std::exception&) {
      // The trainer names an unreadable state's LoRA itself.
    }
  }
  const std::optional<double> dim = parse_double(settings.get("network_dim"));
  if (changed("network_dim") && ranks.size() == 1 && dim &&
      *dim != static_cast<double>(*ranks.begin())) {
    refuse("network_dim", "rank " + std::to_string(*ranks.begin()), "its lora.safetensors");
  }
  // The alpha as the trainer stores it: a float, and 0 (or none) meaning the rank, as kohya.
  const std::optional<double> alpha = parse_double(settings.get("network_alpha"));
  if (changed("network_alpha") && alphas.size() == 1 && alpha) {
    const float expected = *alpha == 0 && ranks.size() == 1
                               ? static_cast<float>(*ranks.begin())
                               : static_cast<float>(*alpha);
    if (*alpha != 0 || ranks.size() == 1) {
      if (expected != *alphas.begin()) {
        std::ostringstream had;
        had << "alpha " << *alphas.begin();
        refuse("network_alpha", had.str(), "its lora.safetensors");
      }
    }
  }
  const nlohmann::json trainer = nlohmann::json::parse(std::ifstream(state / "trainer.json"),
                                                       nullptr, /*allow_exceptions=*/false);
  const std::optional<double> seed = parse_double(settings.get("seed"));
  if (changed("seed") && seed && trainer.is_object() && trainer.contains("seed") &&
      trainer["seed"].is_number_unsigned() &&
      *seed != static_cast<double>(trainer["seed"].get<uint64_t>())) {
    refuse("seed", "seed " + std::to_string(trainer["seed"].get<uint64_t>()), "its trainer.json");
  }
}

}  // namespace

std::pair<Settings, fs::path> resume_settings(const fs::path& dir,
                                              const std::vector<std::string>& overrides) {
  if (!fs::exists(dir / "run.toml")) {
    throw InputError(dir.string() + " has no run.toml: not a lorapipe run folder");
  }
  std::vector<std::string> args = {"--config=" + (dir / "run.toml").string()};
  args.insert(args.end(), overrides.begin(), overrides.end());
  Settings settings = parse_run_args(args);
  settings.output = dir;
  // The state folder with the most steps (each holds trainer.json once complete: the trainer
  // writes a state under a temporary name and renames it).
  fs::path newest;
  int64_t newest_step = -1;
  if (fs::is_directory(dir / "state")) {
    for (const auto& entry : fs::directory_iterator(dir / "state")) {
      // The trainer writes a state as ".NAME.tmp" and swaps it in; a crash in the middle of a
      // save can leave the previous one as ".NAME.old" with no NAME, and the trainer resumes from
      // it when asked for NAME. Other hidden folders are not states.
      fs::path state_dir = entry.path();
      const std::string name = state_dir.filename().string();
      if (name.starts_with(".")) {
        if (!name.ends_with(".old")) continue;
        state_dir = dir / "state" / name.substr(1, name.size() - 5);
        if (fs::exists(state_dir)) continue;
      }
      const fs::path file = entry.path() / "trainer.json";
      if (!fs::exists(file)) continue;
      const nlohmann::json state =
          nlohmann::json::parse(std::ifstream(file), nullptr, /*allow_exceptions=*/false);
      if (state.is_discarded() || !state.contains("global_step") ||
          !state["global_step"].is_number_integer()) {
        continue;  // not a state this launcher can read: the newest readable one is taken
      }
      const int64_t step = state["global_step"].get<int64_t>();
      if (step > newest_step) {
        newest = state_dir;
        newest_step = step;
      }
    }
  }
  if (newest.empty()) {
    // Nothing saved at all (the run failed or was stopped before its first save): start over.
    // LoRAs without a state (--save_state off) are a trained run that cannot continue here.
    if (fs::is_directory(dir / "lora")) {
      for (const auto& entry : fs::directory_iterator(dir / "lora")) {
        if (entry.path().extension() != ".safetensors") continue;
        throw InputError(dir.string() + "/state holds no saved state to resume from, but lora/ " +
                         "holds LoRAs of this run (saved without --save_state); start a new run "
                         "with another --output, with --network_weights=" +
                         entry.path().string() + " to go on from a LoRA");
      }
    }
  }
  // What the resume changes, said as it starts: a flag given after the folder replaces the run's.
  const Settings before = parse_run_args({"--config=" + (dir / "run.toml").string()});
  if (!newest.empty()) check_resume_keeps_the_lora(settings, before, newest);
  for (const auto& [name, value] : settings.flags) {
    if (before.has(name) && before.get(name) == value) continue;
    settings.notes.push_back("resuming with --" + name + "=" + value + " (the run had " +
                             (before.has(name) ? before.get(name) : "its default") + ")");
  }
  return {settings, newest};
}

}  // namespace lorapipe::launcher
