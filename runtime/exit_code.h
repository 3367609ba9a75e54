#pragma once
// The exit codes of every lorapipe executable: the launcher and each lorapipe-* stage (README,
// "Exit codes"). The launcher reads a stage's code to say how it ended; scripts read ours.

namespace lorapipe::runtime {

inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;    // a check found a problem (verify, no usable image)
inline constexpr int kExitError = 2;          // bad flags or input, or a failure; the log says why
inline constexpr int kExitInterrupted = 130;  // SIGINT/SIGTERM: stopped cleanly, state saved
// A process killed by signal N reads as 128 + N, as the shell reports it.
inline constexpr int exit_code_of_signal(int signal) { return 128 + signal; }

// The exit code that waitpid's `status` stands for: the exit status, or 128 + the signal.
int exit_code_of_wait_status(int status);

}  // namespace lorapipe::runtime
