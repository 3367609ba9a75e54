#pragma once
// Starting, signalling and reaping stage processes: the one way the launcher starts its stages
// and the tests start theirs, so both see the same behaviour (process groups, logs, the exit
// code convention of runtime/exit_code.h).

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lorapipe::runtime {

struct SpawnOptions {
  std::vector<std::string> argv;  // argv[0] is the program's path (no PATH search)
  // Where stdout and stderr go; empty inherits ours. The same path for both gives one log.
  std::filesystem::path stdout_path;
  std::filesystem::path stderr_path;
  bool append = false;  // append to the files instead of truncating them
  // The child leads its own process group, so a signal to the group (Process::signal) reaches
  // what it starts too, and a Ctrl-C at our terminal reaches only us.
  bool own_process_group = false;
  // The child gets SIGTERM when the thread that started it ends, however it ends: with a
  // process's main thread, when the process dies (PR_SET_PDEATHSIG).
  bool die_with_parent = false;
  // Set in the child's environment on top of ours (name, value).
  std::vector<std::pair<std::string, std::string>> environment;
  // Run the child as this user and group (uid, gid), which only root may ask: tests that need a
  // stage to see file permissions as an ordinary user does (root reads any file).
  std::optional<std::pair<uid_t, gid_t>> run_as;
};

// Starts the program. Throws Error naming the program and the reason when it cannot be
// started (missing, not executable, an output file that cannot be opened): the child reports
// a failed exec back through a close-on-exec pipe before this returns.
pid_t spawn(const SpawnOptions& options);

// The tests' case: argv with stdout and stderr to the given files, and die_with_parent: when the
// calling thread's process ends, however it ends, the child gets SIGTERM (a stage then stops as
// it stops for a kill), so a test binary that fails or crashes half-way leaves no stage running
// behind it. PR_SET_PDEATHSIG follows the thread that forked: call it from a thread that
// outlives the child (a test's own).
pid_t spawn(const std::vector<std::string>& argv, const std::filesystem::path& stdout_path,
            const std::filesystem::path& stderr_path);

// Waits for `pid` and returns its exit code (the exit status, or 128 + signal). Retries on
// EINTR; -1 when `pid` is not our child.
int wait_exit(pid_t pid);

// The exit code when `pid` has ended (reaping it), nothing while it runs.
std::optional<int> try_wait(pid_t pid);

// A started process that is killed (SIGKILL, to its group when it leads one) and reaped when
// the object goes before the process does: a test that fails half-way leaves no stage behind.
class Process {
 public:
  explicit Process(const SpawnOptions& options);
  Process(Process&& other) noexcept;
  Process& operator=(Process&& other) noexcept;
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process();

  pid_t pid() const { return pid_; }
  bool running() const { return !exit_code_.has_value(); }
  // Sends `sig` (to the whole group with own_process_group). No-op once it has ended.
  void signal(int sig) const;
  // Waits for the end; returns the exit code. Again after the end: the same code.
  int wait();
  // Waits at most `timeout`; the exit code, or nothing while it still runs.
  std::optional<int> wait_for(std::chrono::milliseconds timeout);
  std::optional<int> poll();

 private:
  void finish_now();
  pid_t pid_ = -1;
  bool group_ = false;
  std::optional<int> exit_code_;
};

}  // namespace lorapipe::runtime
