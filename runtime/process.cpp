#include "runtime/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "common/error.h"
#include "runtime/exit_code.h"

namespace lorapipe::runtime {

int exit_code_of_wait_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return exit_code_of_signal(WTERMSIG(status));
  return -1;
}

namespace {

// What a child that could not exec writes into the pipe before it exits: which step failed
// and errno.
struct ChildFailure {
  int step;  // 0 stdout, 1 stderr, 2 exec, 3 the user to run as
  int error;
};

[[noreturn]] void fail_in_child(int pipe_fd, int step) {
  const ChildFailure failure{step, errno};
  [[maybe_unused]] ssize_t n = write(pipe_fd, &failure, sizeof(failure));
  _exit(127);
}

// Opens `path` onto `fd` in the child (async-signal-safe calls only).
bool redirect(int fd, const char* path, bool append) {
  const int flags = O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC);
  const int opened = open(path, flags, 0644);
  if (opened < 0) return false;
  if (opened != fd) {
    if (dup2(opened, fd) < 0) return false;
    close(opened);
  }
  return true;
}

}  // namespace

pid_t spawn(const SpawnOptions& options) {
  if (options.argv.empty()) throw Error("spawn: no program given");
  // Everything the child needs is built before fork: after it, only async-signal-safe calls.
  std::vector<char*> args;
  for (const std::string& a : options.argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_strings;
  std::vector<char*> env;
  if (!options.environment.empty()) {
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const std::string name = entry.substr(0, entry.find('='));
      bool replaced = false;
      for (const auto& [n, v] : options.environment) replaced = replaced || n == name;
      if (!replaced) env_strings.push_back(entry);
    }
    for (const auto& [n, v] : options.environment) env_strings.push_back(n + "=" + v);
    for (std::string& s : env_strings) env.push_back(s.data());
    env.push_back(nullptr);
  }
  const std::string out = options.stdout_path.string();
  const std::string err = options.stderr_path.string();
  const bool one_log = !out.empty() && out == err;

  int report[2];
  if (pipe2(report, O_CLOEXEC) != 0) {
    throw Error(std::string("spawn: pipe: ") + std::strerror(errno));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int error = errno;
    close(report[0]);
    close(report[1]);
    throw Error("cannot start " + options.argv[0] + ": fork: " + std::strerror(error));
  }
  if (pid == 0) {
    close(report[0]);
    if (options.own_process_group) setpgid(0, 0);
    if (options.die_with_parent) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(127);  // the parent died before prctl took effect
    }
    // A launcher that ignores or handles these must not pass that on to its stages.
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    if (!out.empty() && !redirect(1, out.c_str(), options.append)) fail_in_child(report[1], 0);
    if (one_log) {
      if (dup2(1, 2) < 0) fail_in_child(report[1], 1);
    } else if (!err.empty() && !redirect(2, err.c_str(), options.append)) {
      fail_in_child(report[1], 1);
    }
    if (options.run_as &&
        (setgid(options.run_as->second) != 0 || setuid(options.run_as->first) != 0)) {
      fail_in_child(report[1], 3);
    }
    if (env.empty()) {
      execv(args[0], args.data());
    } else {
      execve(args[0], args.data(), env.data());
    }
    fail_in_child(report[1], 2);
  }
  close(report[1]);
  ChildFailure failure{};
  ssize_t n = 0;
  do {
    n = read(report[0], &failure, sizeof(failure));
  } while (n < 0 && errno == EINTR);
  close(report[0]);
  if (n == static_cast<ssize_t>(sizeof(failure))) {  // exec never happened
    wait_exit(pid);
    static const char* const kSteps[] = {"cannot open its stdout file ",
                                         "cannot open its stderr file ", ""};
    const std::string what = failure.step == 0   ? kSteps[0] + out
                             : failure.step == 1 ? kSteps[1] + err
                             : failure.step == 3 ? std::string("cannot run as uid ") +
                                                       std::to_string(options.run_as->first)
                                                 : std::string("exec");
    throw Error("cannot start " + options.argv[0] + ": " + what + ": " +
                std::strerror(failure.error));
  }
  return pid;
}

pid_t spawn(const std::vector<std::string>& argv, const std::filesystem::path& stdout_path,
            const std::filesystem::path& stderr_path) {
  SpawnOptions options;
  options.argv = argv;
  options.stdout_path = stdout_path;
  options.stderr_path = stderr_path;
  options.die_with_parent = true;
  return spawn(options);
}

int wait_exit(pid_t pid) {
  int status = 0;
  pid_t got = 0;
  do {
    got = waitpid(pid, &status, 0);
  } while (got < 0 && errno == EINTR);
  return got == pid ? exit_code_of_wait_status(status) : -1;
}

std::optional<int> try_wait(pid_t pid) {
  int status = 0;
  const pid_t got = waitpid(pid, &status, WNOHANG);
  if (got == pid) return exit_code_of_wait_status(status);
  if (got < 0 && errno == ECHILD) return -1;  // not ours, or already reaped
  return std::nullopt;
}

Process::Process(const SpawnOptions& options)
    : pid_(spawn(options)), group_(options.own_process_group) {}

Process::Process(Process&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      group_(other.group_),
      exit_code_(std::exchange(other.exit_code_, 0)) {}

Process& Process::operator=(Process&& other) noexcept {
  if (this != &other) {
    finish_now();
    pid_ = std::exchange(other.pid_, -1);
    group_ = other.group_;
    exit_code_ = std::exchange(other.exit_code_, 0);
  }
  return *this;
}

Process::~Process() { finish_now(); }

void Process::finish_now() {
  if (pid_ <= 0 || exit_code_) return;
  signal(SIGKILL);
  exit_code_ = wait_exit(pid_);
}

void Process::signal(int sig) const {
  if (pid_ <= 0 || exit_code_) return;
  if (group_) {
    ::kill(-pid_, sig);
  } else {
    ::kill(pid_, sig);
  }
}

int Process::wait() {
  if (!exit_code_) exit_code_ = wait_exit(pid_);
  return *exit_code_;
}

std::optional<int> Process::poll() {
  if (!exit_code_) exit_code_ = try_wait(pid_);
  return exit_code_;
}

std::optional<int> Process::wait_for(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!poll() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return exit_code_;
}

}  // namespace lorapipe::runtime
