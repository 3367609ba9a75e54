// The stage runtime (runtime/): starting and reaping processes, the worker pool, the socket loop
// and StageStatus. Real processes, real threads, real ZeroMQ sockets.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "common/error.h"
#include "proto/wire.h"
#include "runtime/exit_code.h"
#include "runtime/process.h"
#include "runtime/stage.h"
#include "runtime/workers.h"

namespace lorapipe::runtime {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

class LauncherRuntime : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("lorapipe-runtime-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  static std::string read(const fs::path& p) {
    std::ifstream in(p);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  // True when `pid` no longer runs (gone, or a zombie waiting for whoever adopted it).
  static bool ended(pid_t pid) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    if (!stat) return true;
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t close = text.rfind(')');
    return close != std::string::npos && close + 2 < text.size() && text[close + 2] == 'Z';
  }
  fs::path dir_;
};

TEST_F(LauncherRuntime, SpawnNamesAProgramThatCannotStart) {
  try {
    spawn({(dir_ / "no-such-stage").string()}, dir_ / "out", dir_ / "err");
    FAIL() << "spawn started a program that does not exist";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-stage"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  try {
    spawn({"/bin/true"}, dir_ / "missing-folder" / "out", "");
    FAIL() << "spawn started a program whose log cannot be opened";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing-folder/out"), std::string::npos) << e.what();
  }
}

// One log for both streams, appended to, an environment on top of ours, and the exit code.
TEST_F(LauncherRuntime, SpawnWritesOneLogWithTheEnvironmentAndReportsTheExitCode) {
  const fs::path log = dir_ / "stage.log";
  std::ofstream(log) << "earlier line\n";
  SpawnOptions o;
  o.argv = {"/bin/sh", "-c", "echo out; echo err >&2; echo \"rank=$RANK\"; exit 3"};
  o.stdout_path = log;
  o.stderr_path = log;
  o.append = true;
  o.environment = {{"RANK", "1"}};
  EXPECT_EQ(wait_exit(spawn(o)), 3);
  EXPECT_EQ(read(log), "earlier line\nout\nerr\nrank=1\n");
  EXPECT_EQ(std::getenv("RANK"), nullptr) << "the child's environment leaked into ours";
}

TEST_F(LauncherRuntime, ASignalReadsAs128PlusItsNumber) {
  SpawnOptions o;
  o.argv = {"/bin/sleep", "30"};
  Process p(o);
  EXPECT_FALSE(p.poll().has_value());
  p.signal(SIGTERM);
  EXPECT_EQ(p.wait(), exit_code_of_signal(SIGTERM));
  EXPECT_EQ(p.wait(), 128 + SIGTERM);  // asked again: the same code
  EXPECT_FALSE(p.running());
}

// A Process that goes out of scope takes its whole group along: a failed test leaves no stage
// (nor anything the stage started) running.
TEST_F(LauncherRuntime, AProcessDroppedWhileRunningIsKilledWithItsGroup) {
  const fs::path pid_file = dir_ / "grandchild.pid";
  pid_t child = -1;
  {
    SpawnOptions o;
    o.argv = {"/bin/sh", "-c", "sleep 60 & echo $! > " + pid_file.string() + "; wait"};
    o.own_process_group = true;
    Process p(o);
    child = p.pid();
    for (int i = 0; i < 500 && read(pid_file).empty(); ++i) std::this_thread::sleep_for(10ms);
  }
  const pid_t grandchild = std::stoi(read(pid_file));
  EXPECT_TRUE(ended(child));
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    gone = ended(grandchild);
    if (!gone) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(gone) << "the stage's own child " << grandchild << " outlived it";
}

// The tests' spawn(argv, out, err): a test binary that dies half-way, however it dies, takes
// the stages it started along instead of leaving them to run out their own timeouts.
TEST_F(LauncherRuntime, AStageStartedByATestEndsWhenTheTestProcessDies) {
  const fs::path pid_file = dir_ / "stage.pid";
  const pid_t test_process = fork();
  ASSERT_GE(test_process, 0);
  if (test_process == 0) {  // stands for a test binary that crashes after starting a stage
    try {
      const pid_t stage = spawn({"/bin/sleep", "60"}, dir_ / "out", dir_ / "err");
      std::ofstream(pid_file) << stage << "\n";
    } catch (...) {
      _exit(2);  // never back into gtest in the child
    }
    _exit(1);
  }
  ASSERT_EQ(wait_exit(test_process), 1);
  const pid_t stage = std::stoi(read(pid_file));
  bool gone = false;
  for (int i = 0; i < 500 && !gone; ++i) {
    gone = ended(stage);
    if (!gone) std::this_thread::sleep_for(10ms);
  }
  if (!gone) kill(stage, SIGKILL);
  EXPECT_TRUE(gone) << "the stage " << stage << " outlived the process that started it";
}

TEST_F(LauncherRuntime, WorkerPoolRethrowsTheFirstFailureAndDropsTheRest) {
  WorkerPool pool(/*threads=*/1, /*max_queued=*/4);
  std::atomic<int> ran{0};
  // The failing job waits until the second is queued: without the gate it could fail first, and
  // the second submit would then (rightly) rethrow, which made this test race.
  std::promise<void> second_queued;
  std::shared_future<void> gate = second_queued.get_future().share();
  pool.submit([&ran, gate] {
    gate.wait();
    ++ran;
    throw InputError("batch 1: bad latent");
  });
  pool.submit([&] { ++ran; });
  second_queued.set_value();
  try {
    pool.wait_idle();
    FAIL() << "the job's failure was lost";
  } catch (const InputError& e) {
    EXPECT_STREQ(e.what(), "batch 1: bad latent");
  }
  // Once failed, the pool refuses more work with the same failure.
  EXPECT_THROW(pool.submit([&] { ++ran; }), InputError);
  EXPECT_THROW(pool.rethrow_failure(), InputError);
  EXPECT_EQ(ran.load(), 1) << "the job queued behind the failure ran";
}

// At most max_queued jobs wait: try_submit says no beyond that, which is what lets a stage stop
// reading its stream (ZeroMQ then pushes back on the sender) while it still answers requests.
TEST_F(LauncherRuntime, WorkerPoolBoundsItsQueue) {
  WorkerPool pool(/*threads=*/1, /*max_queued=*/2);
  std::mutex mutex;
  std::condition_variable cv;
  bool release = false, started = false;
  std::atomic<int> ran{0};
  pool.submit([&] {
    std::unique_lock<std::mutex> lock(mutex);
    started = true;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
    ++ran;
  });
  {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return started; });  // the first job runs, so the queue is empty
  }
  EXPECT_TRUE(pool.try_submit([&] { ++ran; }));
  EXPECT_TRUE(pool.try_submit([&] { ++ran; }));
  EXPECT_TRUE(pool.full());
  EXPECT_FALSE(pool.try_submit([&] { ++ran; }));
  EXPECT_EQ(pool.pending(), 3u);
  {
    std::lock_guard<std::mutex> lock(mutex);
    release = true;
  }
  cv.notify_all();
  pool.wait_idle();
  EXPECT_EQ(ran.load(), 3);
  EXPECT_EQ(pool.pending(), 0u);
}

TEST_F(LauncherRuntime, ParallelForCoversEveryIndexOnceAndRethrows) {
  std::vector<std::atomic<int>> seen(1000);
  std::mutex mutex;
  std::set<std::thread::id> threads;
  parallel_for(seen.size(), 4, [&](size_t i) {
    ++seen[i];
    std::lock_guard<std::mutex> lock(mutex);
    threads.insert(std::this_thread::get_id());
  });
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i].load(), 1) << "index " << i;
  EXPECT_LE(threads.size(), 4u);
  std::atomic<int> after{0};
  EXPECT_THROW(parallel_for(100, 2,
                            [&](size_t i) {
                              if (i == 3) throw Error("image 3 failed");
                              ++after;
                            }),
               Error);
  EXPECT_LT(after.load(), 100);
}

// One thread serves a REP and a PULL socket; a disabled socket's messages wait in ZeroMQ and
// requests are still answered.
TEST_F(LauncherRuntime, SocketLoopAnswersRequestsWhileTheStreamIsHeld) {
  zmq::context_t context;
  const std::string rep_ep = "inproc://rep", pull_ep = "inproc://pull";
  zmq::socket_t rep = wire::make_socket(context, zmq::socket_type::rep);
  zmq::socket_t pull = wire::make_socket(context, zmq::socket_type::pull);
  rep.bind(rep_ep);
  pull.bind(pull_ep);
  wire::Dispatcher requests("test"), stream("test");
  int samples = 0;
  requests.on_request<wire::HasKeysRequest>([](const wire::HasKeysRequest& r) {
    auto reply = std::make_unique<wire::HasKeysReply>();
    for (int i = 0; i < r.keys_size(); ++i) reply->add_present(true);
    return reply;
  });
  stream.on<wire::ImageSample>([&](const wire::ImageSample&) { ++samples; });
  bool take_stream = false;
  SocketLoop loop;
  loop.add(rep, requests, /*reply=*/true);
  loop.add(pull, stream, /*reply=*/false, [&] { return take_stream; });

  zmq::socket_t push = wire::make_socket(context, zmq::socket_type::push);
  push.connect(pull_ep);
  wire::ImageSample sample;
  sample.set_path("a.png");
  ASSERT_EQ(wire::send(push, sample), wire::SendStatus::kSent);

  std::atomic<bool> answered{false};
  std::thread client([&] {
    wire::Client c(context, rep_ep, "test-client");
    wire::HasKeysRequest r;
    r.add_keys("k1");
    r.add_keys("k2");
    answered = c.request<wire::HasKeysReply>(r).present_size() == 2;
  });
  for (int i = 0; i < 200 && !answered; ++i) loop.poll(10ms);
  client.join();
  EXPECT_TRUE(answered);
  EXPECT_EQ(samples, 0) << "a disabled socket was read";
  take_stream = true;
  for (int i = 0; i < 200 && samples == 0; ++i) loop.poll(10ms);
  EXPECT_EQ(samples, 1);
  EXPECT_EQ(loop.poll(1ms), 0);
}

// PUB keeps no history: a subscriber that connects after READY still learns it, and progress
// arrives with its counts.
TEST_F(LauncherRuntime, StatusIsRepeatedForALateSubscriber) {
  zmq::context_t context;
  zmq::socket_t pub = wire::make_socket(context, zmq::socket_type::pub);
  pub.bind("inproc://status");
  StatusPublisher status(&pub, "cacher", /*repeat_every=*/50ms);
  status.ready("loaded");  // nobody listens yet: this one is lost

  zmq::socket_t sub = wire::make_socket(context, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, std::string(wire::StageStatus::descriptor()->full_name()));
  sub.connect("inproc://status");
  auto next = [&]() -> std::optional<wire::StageStatus> {
    for (int i = 0; i < 100; ++i) {
      status.tick();
      wire::Received r = wire::receive(sub, 20ms);
      if (const auto* s = r.as<wire::StageStatus>()) return *s;
    }
    return std::nullopt;
  };
  const auto first = next();
  ASSERT_TRUE(first.has_value()) << "READY was not repeated";
  EXPECT_EQ(first->state(), wire::StageStatus::READY);
  EXPECT_EQ(first->stage(), "cacher");
  EXPECT_EQ(first->message(), "loaded");
  EXPECT_EQ(first->pid(), getpid());

  status.progress(7, 12, "images");
  std::optional<wire::StageStatus> got;
  do {
    got = next();
  } while (got && got->state() != wire::StageStatus::PROGRESS);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->done(), 7u);
  EXPECT_EQ(got->total(), 12u);
  EXPECT_EQ(got->unit(), "images");

  status.error("cache.mdb: disk full");
  do {
    got = next();
  } while (got && got->state() != wire::StageStatus::ERROR);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->message(), "cache.mdb: disk full");
}

}  // namespace
}  // namespace lorapipe::runtime
