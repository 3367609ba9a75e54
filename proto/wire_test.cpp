// Wire protocol tests: every message type round-trips over inproc, ipc and tcp; a receiver
// survives malformed input; a dead peer is noticed within the timeout; Hello refuses another
// protocol version.

#include <google/protobuf/descriptor.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/log.h"
#include "proto/wire.h"

namespace lorapipe::wire {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
namespace pb = google::protobuf;

// Collects what components log, so a test can assert that a bad message gives exactly one
// clear error.
class LogCapture {
 public:
  LogCapture() {
    previous_ = set_log_sink([this](LogLevel level, std::string_view, std::string_view msg) {
      std::lock_guard<std::mutex> lock(mutex_);
      lines_.push_back({level, std::string(msg)});
    });
  }
  ~LogCapture() { set_log_sink(std::move(previous_)); }

  // Lines at `level` or above, and forgets them.
  std::vector<std::string> take(LogLevel level) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    for (auto& [l, msg] : lines_) {
      if (l >= level) out.push_back(msg);
    }
    lines_.clear();
    return out;
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<LogLevel, std::string>> lines_;
  LogSink previous_;
};

std::string unique_ipc_endpoint(const std::string& name) {
  static std::atomic<int> counter{0};
  const auto path = std::filesystem::temp_directory_path() /
                    ("lorapipe-wire-test-" + std::to_string(getpid()) + "-" + name + "-" +
                     std::to_string(counter.fetch_add(1)));
  return "ipc://" + path.string();
}

// Binds `socket` on a fresh endpoint of `transport` ("inproc", "ipc", "tcp") and returns the
// endpoint a peer connects to.
std::string bind_fresh(zmq::socket_t& socket, const std::string& transport) {
  static std::atomic<int> counter{0};
  if (transport == "inproc") {
    const std::string endpoint = "inproc://wire-test-" + std::to_string(counter.fetch_add(1));
    socket.bind(endpoint);
    return endpoint;
  }
  if (transport == "ipc") {
    const std::string endpoint = unique_ipc_endpoint("bind");
    socket.bind(endpoint);
    return endpoint;
  }
  socket.bind("tcp://127.0.0.1:*");
  return socket.get(zmq::sockopt::last_endpoint);
}

SocketOptions short_timeouts() {
  SocketOptions options;
  options.send_timeout = milliseconds(2000);
  options.receive_timeout = milliseconds(2000);
  options.linger = milliseconds(0);
  return options;
}

// Fills every field of `message` with values derived from `seed`, recursing into sub-messages,
// so a round trip that drops or mangles any field is caught.
void fill_message(pb::Message& message, uint32_t seed, int depth = 0) {
  const pb::Descriptor* descriptor = message.GetDescriptor();
  const pb::Reflection* reflection = message.GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const pb::FieldDescriptor* field = descriptor->field(i);
    const uint32_t v = seed * 131 + static_cast<uint32_t>(i) * 7 + 1;
    const int count = field->is_repeated() ? 3 : 1;
    for (int k = 0; k < count; ++k) {
      const uint32_t value = v + static_cast<uint32_t>(k);
      const bool rep = field->is_repeated();
      switch (field->cpp_type()) {
        case pb::FieldDescriptor::CPPTYPE_INT32:
          rep ? reflection->AddInt32(&message, field, -static_cast<int32_t>(value))
              : reflection->SetInt32(&message, field, -static_cast<int32_t>(value));
          break;
        case pb::FieldDescriptor::CPPTYPE_INT64:
          rep ? reflection->AddInt64(&message, field, -(int64_t{value} << 33))
              : reflection->SetInt64(&message, field, -(int64_t{value} << 33));
          break;
        case pb::FieldDescriptor::CPPTYPE_UINT32:
          rep ? reflection->AddUInt32(&message, field, value)
              : reflection->SetUInt32(&message, field, value);
          break;
        case pb::FieldDescriptor::CPPTYPE_UINT64:
          rep ? reflection->AddUInt64(&message, field, uint64_t{value} << 35)
              : reflection->SetUInt64(&message, field, uint64_t{value} << 35);
          break;
        case pb::FieldDescriptor::CPPTYPE_DOUBLE:
          rep ? reflection->AddDouble(&message, field, value * 0.125)
              : reflection->SetDouble(&message, field, value * 0.125);
          break;
        case pb::FieldDescriptor::CPPTYPE_FLOAT:
          rep ? reflection->AddFloat(&message, field, value * 0.5f)
              : reflection->SetFloat(&message, field, value * 0.5f);
          break;
        case pb::FieldDescriptor::CPPTYPE_BOOL:
          rep ? reflection->AddBool(&message, field, true)
              : reflection->SetBool(&message, field, true);
          break;
        case pb::FieldDescriptor::CPPTYPE_ENUM: {
          const pb::EnumDescriptor* e = field->enum_type();
          const pb::EnumValueDescriptor* ev = e->value(e->value_count() - 1);
          rep ? reflection->AddEnum(&message, field, ev) : reflection->SetEnum(&message, field, ev);
          break;
        }
        case pb::FieldDescriptor::CPPTYPE_STRING: {
          std::string text;
          if (field->type() == pb::FieldDescriptor::TYPE_BYTES) {
            // Binary with embedded zeros and high bytes.
            for (uint32_t b = 0; b < 64 + value % 64; ++b) text.push_back(static_cast<char>(b * value));
          } else {
            text = std::string(field->name()) + "-\xc3\xa9-" + std::to_string(value);
          }
          rep ? reflection->AddString(&message, field, text)
              : reflection->SetString(&message, field, text);
          break;
        }
        case pb::FieldDescriptor::CPPTYPE_MESSAGE:
          if (depth < 3) {
            pb::Message* child = rep ? reflection->AddMessage(&message, field)
                                     : reflection->MutableMessage(&message, field);
            fill_message(*child, value, depth + 1);
          }
          break;
      }
    }
  }
}

// Every message type declared in lorapipe.proto, nested ones included.
std::vector<const pb::Descriptor*> all_message_types() {
  const pb::FileDescriptor* file = Hello::descriptor()->file();
  std::vector<const pb::Descriptor*> out;
  std::vector<const pb::Descriptor*> stack;
  for (int i = 0; i < file->message_type_count(); ++i) stack.push_back(file->message_type(i));
  while (!stack.empty()) {
    const pb::Descriptor* d = stack.back();
    stack.pop_back();
    out.push_back(d);
    for (int i = 0; i < d->nested_type_count(); ++i) stack.push_back(d->nested_type(i));
  }
  return out;
}

std::unique_ptr<pb::Message> new_message(const pb::Descriptor* descriptor) {
  return std::unique_ptr<pb::Message>(
      pb::MessageFactory::generated_factory()->GetPrototype(descriptor)->New());
}

// Sends raw frames, bypassing the typed helpers, as a misbehaving peer would.
void send_raw(zmq::socket_t& socket, const std::vector<std::string>& frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    const auto flags = i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
    ASSERT_TRUE(socket.send(zmq::buffer(frames[i]), flags));
  }
}

// ---------------------------------------------------------------------------------------------

class WireRoundTrip : public ::testing::TestWithParam<std::string> {};

TEST_P(WireRoundTrip, EveryMessageTypeArrivesIntact) {
  zmq::context_t context;
  zmq::socket_t pull = make_socket(context, zmq::socket_type::pull, short_timeouts());
  const std::string endpoint = bind_fresh(pull, GetParam());
  zmq::socket_t push = make_socket(context, zmq::socket_type::push, short_timeouts());
  push.connect(endpoint);

  const auto types = all_message_types();
  ASSERT_GE(types.size(), 20u) << "lorapipe.proto lost message types";
  uint32_t seed = 1;
  for (const pb::Descriptor* descriptor : types) {
    auto sent = new_message(descriptor);
    fill_message(*sent, seed++);
    ASSERT_GT(sent->ByteSizeLong(), 0u) << descriptor->full_name();
    ASSERT_EQ(send(push, *sent), SendStatus::kSent) << descriptor->full_name();
    Received received = receive(pull, milliseconds(5000));
    ASSERT_TRUE(received.ok()) << descriptor->full_name() << ": " << received.error;
    EXPECT_EQ(received.message->GetDescriptor(), descriptor);
    EXPECT_TRUE(pb::util::MessageDifferencer::Equals(*sent, *received.message))
        << descriptor->full_name() << " changed in transit:\n"
        << received.message->DebugString();
  }
}

TEST_P(WireRoundTrip, RequestReplyThroughClientAndDispatcher) {
  zmq::context_t context;
  zmq::socket_t rep = make_socket(context, zmq::socket_type::rep, short_timeouts());
  const std::string endpoint = bind_fresh(rep, GetParam());

  Dispatcher dispatcher("cacher");
  dispatcher.on_request<HasKeysRequest>([](const HasKeysRequest& request) {
    auto reply = std::make_unique<HasKeysReply>();
    for (const std::string& key : request.keys()) reply->add_present(key.rfind("hit", 0) == 0);
    return reply;
  });
  std::atomic<bool> stop{false};
  std::thread server([&] {
    while (!stop) dispatcher.poll_once(rep, milliseconds(50), /*reply=*/true);
  });

  Client client(context, endpoint, "preprocess", short_timeouts());
  const Hello peer = client.hello();
  EXPECT_EQ(peer.stage(), "cacher");
  EXPECT_EQ(peer.protocol_version(), kProtocolVersion);

  HasKeysRequest request;
  request.add_keys("hit-a");
  request.add_keys("miss-b");
  request.add_keys("hit-c");
  const HasKeysReply reply = client.request<HasKeysReply>(request);
  ASSERT_EQ(reply.present_size(), 3);
  EXPECT_TRUE(reply.present(0));
  EXPECT_FALSE(reply.present(1));
  EXPECT_TRUE(reply.present(2));

  // A request type the server has no handler for comes back as a clear error, and the
  // connection stays usable.
  EXPECT_THROW(
      {
        try {
          client.request<HasKeysReply>(GetRecordsRequest());
        } catch (const PeerError& e) {
          EXPECT_NE(std::string(e.what()).find("does not take lorapipe.wire.GetRecordsRequest"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      PeerError);
  EXPECT_EQ(client.request<HasKeysReply>(request).present_size(), 3);

  stop = true;
  server.join();
  EXPECT_EQ(dispatcher.handled(), 3u);  // hello + two HasKeys
  EXPECT_EQ(dispatcher.rejected(), 1u);
}

TEST_P(WireRoundTrip, SubscriberFiltersByTypeName) {
  zmq::context_t context;
  zmq::socket_t pub = make_socket(context, zmq::socket_type::pub, short_timeouts());
  const std::string endpoint = bind_fresh(pub, GetParam());
  zmq::socket_t sub = make_socket(context, zmq::socket_type::sub, short_timeouts());
  sub.set(zmq::sockopt::subscribe, CheckpointReady::descriptor()->full_name());
  sub.connect(endpoint);

  // PUB drops messages until the subscription has arrived: publish until the first one lands.
  CheckpointReady checkpoint;
  checkpoint.set_path("/runs/a/step-100.safetensors");
  checkpoint.set_step(100);
  TrainProgress progress;
  progress.set_step(99);
  Received received;
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (!received.ok() && Clock::now() < give_up) {
    ASSERT_EQ(send(pub, progress), SendStatus::kSent);
    ASSERT_EQ(send(pub, checkpoint), SendStatus::kSent);
    received = receive(sub, milliseconds(50));
  }
  ASSERT_TRUE(received.ok());
  const auto* got = received.as<CheckpointReady>();
  ASSERT_NE(got, nullptr) << "a TrainProgress passed the CheckpointReady subscription";
  EXPECT_EQ(got->step(), 100u);
  // Nothing but CheckpointReady may ever arrive.
  for (int i = 0; i < 5; ++i) {
    Received more = receive(sub, milliseconds(20));
    if (more.ok()) {
      EXPECT_NE(more.as<CheckpointReady>(), nullptr);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, WireRoundTrip, ::testing::Values("inproc", "ipc", "tcp"),
                         [](const auto& info) { return info.param; });

// ---------------------------------------------------------------------------------------------

class WireMalformed : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    SocketOptions options = short_timeouts();
    options.max_message_bytes = kLimit;
    pull_.emplace(make_socket(context_, zmq::socket_type::pull, options));
    dispatcher_.watch(context_, *pull_);
    endpoint_ = bind_fresh(*pull_, GetParam());
    push_.emplace(make_socket(context_, zmq::socket_type::push, short_timeouts()));
    push_->connect(endpoint_);
    dispatcher_.on<ImageSample>([this](const ImageSample& sample) { paths_.push_back(sample.path()); });
  }

  // The next message is handled as a good ImageSample, with no error logged.
  void expect_good_message_served(const std::string& path) {
    ImageSample sample;
    sample.set_path(path);
    ASSERT_EQ(send(*push_, sample), SendStatus::kSent);
    ASSERT_EQ(dispatcher_.poll_once(*pull_, milliseconds(5000)), Dispatcher::Outcome::kHandled);
    ASSERT_FALSE(paths_.empty());
    EXPECT_EQ(paths_.back(), path);
  }

  // The next message is rejected with exactly one error line containing `expected`.
  void expect_one_error(const std::string& expected) {
    ASSERT_EQ(dispatcher_.poll_once(*pull_, milliseconds(5000)), Dispatcher::Outcome::kRejected);
    const auto errors = log_.take(LogLevel::kError);
    ASSERT_EQ(errors.size(), 1u);
    EXPECT_NE(errors[0].find(expected), std::string::npos) << errors[0];
  }

  static constexpr int64_t kLimit = 64 << 10;
  LogCapture log_;
  zmq::context_t context_;
  Dispatcher dispatcher_{"cacher"};
  std::optional<zmq::socket_t> pull_;
  std::optional<zmq::socket_t> push_;
  std::string endpoint_;
  std::vector<std::string> paths_;
};

TEST_P(WireMalformed, UnknownTypeIsRejectedAndServingGoesOn) {
  send_raw(*push_, {"lorapipe.wire.NoSuchMessage", "x"});
  expect_one_error("unknown message type 'lorapipe.wire.NoSuchMessage'");
  expect_good_message_served("a.png");
  send_raw(*push_, {"google.protobuf.Any", ""});  // a real protobuf type, but not ours
  expect_one_error("unknown message type 'google.protobuf.Any'");
  expect_good_message_served("b.png");
}

TEST_P(WireMalformed, TruncatedPayloadIsRejectedAndServingGoesOn) {
  ImageSample sample;
  sample.set_path("big.png");
  sample.set_pixels(std::string(4096, '\x7f'));
  const std::string payload = sample.SerializeAsString();
  send_raw(*push_, {type_name(sample), payload.substr(0, payload.size() / 2)});
  expect_one_error("does not parse");
  expect_good_message_served("c.png");
}

TEST_P(WireMalformed, WrongFrameCountIsRejectedAndServingGoesOn) {
  send_raw(*push_, {"lorapipe.wire.ImageSample"});
  expect_one_error("expected 2 frames [type name, payload], got 1");
  expect_good_message_served("d.png");
  send_raw(*push_, {"lorapipe.wire.ImageSample", "", "extra", "frames"});
  expect_one_error("got 4");
  expect_good_message_served("e.png");
}

TEST_P(WireMalformed, RandomBytesAreRejectedAndServingGoesOn) {
  std::mt19937 rng(1234);
  auto random_bytes = [&](size_t n) {
    std::string out(n, '\0');
    for (char& c : out) c = static_cast<char>(rng());
    return out;
  };
  send_raw(*push_, {random_bytes(40), random_bytes(300)});
  expect_one_error("bytes that are not a type name");
  expect_good_message_served("f.png");
  // A valid type with a payload of noise. Byte 0x0f is field 1 with wire type 7, which no
  // protobuf parser accepts, so this payload can never parse by chance.
  send_raw(*push_, {"lorapipe.wire.ImageSample", "\x0f" + random_bytes(200)});
  expect_one_error("does not parse");
  expect_good_message_served("g.png");
}

INSTANTIATE_TEST_SUITE_P(Transports, WireMalformed, ::testing::Values("inproc", "ipc", "tcp"),
                         [](const auto& info) { return info.param; });

// The size limit lives in libzmq's stream engine, so it applies to ipc and tcp; inproc passes
// messages by pointer between threads of one process and has no wire to guard.
class WireOversize : public WireMalformed {};

TEST_P(WireOversize, MessageIsDroppedBeforeAllocationAndServingGoesOn) {
  // The receiver's ZMQ_MAXMSGSIZE is 64 KiB: libzmq reads the frame header, sees 1 MiB and
  // drops the connection without allocating the frame. The sender reconnects by itself.
  send_raw(*push_, {"lorapipe.wire.ImageSample", std::string(1 << 20, 'x')});
  ASSERT_EQ(dispatcher_.poll_once(*pull_, milliseconds(1000)), Dispatcher::Outcome::kTimeout);
  const auto warnings = log_.take(LogLevel::kWarning);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("over the size limit"), std::string::npos) << warnings[0];
  EXPECT_TRUE(paths_.empty());
  expect_good_message_served("h.png");
}

INSTANTIATE_TEST_SUITE_P(Transports, WireOversize, ::testing::Values("ipc", "tcp"),
                         [](const auto& info) { return info.param; });

// ---------------------------------------------------------------------------------------------

// A REP server in a child process answering HasKeys until it is killed. The child builds its
// own ZeroMQ context: nothing of the parent's is used after fork.
pid_t start_server_process(const std::string& endpoint) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  {
    zmq::context_t context;
    zmq::socket_t rep = make_socket(context, zmq::socket_type::rep, short_timeouts());
    rep.bind(endpoint);
    Dispatcher dispatcher("cacher");
    dispatcher.on_request<HasKeysRequest>([](const HasKeysRequest& request) {
      auto reply = std::make_unique<HasKeysReply>();
      for (int i = 0; i < request.keys_size(); ++i) reply->add_present(true);
      return reply;
    });
    for (;;) dispatcher.poll_once(rep, milliseconds(100), /*reply=*/true);
  }
  _exit(0);
}

void kill_process(pid_t pid) {
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
}

TEST(WirePeerDeath, ClientNoticesDeadServerWithinTimeoutAndRecovers) {
  const std::string endpoint = unique_ipc_endpoint("peer-death");
  pid_t server = start_server_process(endpoint);
  ASSERT_GT(server, 0);

  zmq::context_t context;
  SocketOptions options = short_timeouts();
  options.receive_timeout = milliseconds(300);
  Client client(context, endpoint, "preprocess", options);
  HasKeysRequest request;
  request.add_keys("k");
  // The first request may race the child's bind: retry until it is up.
  std::optional<HasKeysReply> first;
  for (int i = 0; i < 50 && !first; ++i) {
    try {
      first = client.request<HasKeysReply>(request);
    } catch (const PeerTimeoutError&) {
    }
  }
  ASSERT_TRUE(first.has_value()) << "the server process never answered";
  EXPECT_EQ(first->present_size(), 1);

  kill_process(server);
  const auto started = Clock::now();
  try {
    client.request<HasKeysReply>(request);
    FAIL() << "a request to a dead server returned";
  } catch (const PeerTimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no reply from " + endpoint), std::string::npos) << what;
    EXPECT_NE(what.find("within 300 ms"), std::string::npos) << what;
  }
  // Hang guard, not a speed check: the call must return near its 300 ms timeout, far below the
  // 10 s that only a hang would reach.
  EXPECT_LT(Clock::now() - started, std::chrono::seconds(10));

  // A new server on the same endpoint: the same client works again.
  server = start_server_process(endpoint);
  std::optional<HasKeysReply> again;
  for (int i = 0; i < 50 && !again; ++i) {
    try {
      again = client.request<HasKeysReply>(request);
    } catch (const PeerTimeoutError&) {
    }
  }
  kill_process(server);
  EXPECT_TRUE(again.has_value()) << "the client did not recover after the server came back";
}

TEST(WirePeerDeath, ReceiverNoticesDeadSenderAndReportsIt) {
  LogCapture log;
  zmq::context_t context;
  zmq::socket_t pull = make_socket(context, zmq::socket_type::pull, short_timeouts());
  Dispatcher dispatcher("cacher");
  dispatcher.watch(context, pull);
  const std::string endpoint = unique_ipc_endpoint("sender-death");
  pull.bind(endpoint);
  int received = 0;
  dispatcher.on<ImageSample>([&](const ImageSample&) { ++received; });

  const pid_t sender = fork();
  if (sender == 0) {
    zmq::context_t child_context;
    zmq::socket_t push = make_socket(child_context, zmq::socket_type::push, short_timeouts());
    push.connect(endpoint);
    ImageSample sample;
    sample.set_path("only.png");
    (void)send(push, sample);
    pause();  // until killed
    _exit(0);
  }
  ASSERT_EQ(dispatcher.poll_once(pull, milliseconds(5000)), Dispatcher::Outcome::kHandled);
  EXPECT_EQ(received, 1);
  kill_process(sender);

  const auto started = Clock::now();
  EXPECT_EQ(dispatcher.poll_once(pull, milliseconds(500)), Dispatcher::Outcome::kTimeout);
  EXPECT_LT(Clock::now() - started, std::chrono::seconds(10));  // hang guard
  const auto warnings = log.take(LogLevel::kWarning);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("disconnected"), std::string::npos) << warnings[0];
}

// A peer that said it is done (the receiver calls peer_finished, as the cacher does on a stream's
// DatasetReport) and then exits is news, not a warning.
TEST(WirePeerDeath, FinishedSenderLeavesWithoutAWarning) {
  LogCapture log;
  zmq::context_t context;
  zmq::socket_t pull = make_socket(context, zmq::socket_type::pull, short_timeouts());
  Dispatcher dispatcher("cacher");
  dispatcher.watch(context, pull);
  const std::string endpoint = unique_ipc_endpoint("sender-done");
  pull.bind(endpoint);
  dispatcher.on<DatasetReport>([&](const DatasetReport&) { dispatcher.peer_finished(); });
  const pid_t sender = fork();
  if (sender == 0) {
    zmq::context_t child_context;
    zmq::socket_t push = make_socket(child_context, zmq::socket_type::push, short_timeouts());
    push.connect(endpoint);
    (void)send(push, DatasetReport());
    pause();  // until killed
    _exit(0);
  }
  ASSERT_EQ(dispatcher.poll_once(pull, milliseconds(5000)), Dispatcher::Outcome::kHandled);
  kill_process(sender);
  EXPECT_EQ(dispatcher.poll_once(pull, milliseconds(500)), Dispatcher::Outcome::kTimeout);
  bool left = false;
  for (const std::string& line : log.take(LogLevel::kInfo)) {
    left |= line.find("left after its end") != std::string::npos;
    EXPECT_EQ(line.find("disconnected ("), std::string::npos) << line;
  }
  EXPECT_TRUE(left) << "the disconnect was not seen";
}

TEST(WirePeerDeath, SendToMissingPeerTimesOut) {
  zmq::context_t context;
  SocketOptions options = short_timeouts();
  options.send_timeout = milliseconds(200);
  // A bound PUSH with no peer has nowhere to queue: send must give up at its timeout.
  zmq::socket_t push = make_socket(context, zmq::socket_type::push, options);
  push.bind(unique_ipc_endpoint("no-peer"));
  ImageSample sample;
  const auto started = Clock::now();
  EXPECT_EQ(send(push, sample), SendStatus::kTimeout);
  EXPECT_LT(Clock::now() - started, std::chrono::seconds(10));  // hang guard
}

// ---------------------------------------------------------------------------------------------

TEST(WireHello, ServerRefusesAnotherProtocolVersion) {
  LogCapture log;
  zmq::context_t context;
  zmq::socket_t rep = make_socket(context, zmq::socket_type::rep, short_timeouts());
  const std::string endpoint = bind_fresh(rep, "inproc");
  Dispatcher dispatcher("cacher");
  std::thread server([&] { dispatcher.poll_once(rep, milliseconds(5000), /*reply=*/true); });

  Client client(context, endpoint, "preprocess", short_timeouts());
  Hello future = make_hello("preprocess");
  future.set_protocol_version(kProtocolVersion + 1);
  try {
    client.request<Hello>(future);
    FAIL() << "a Hello with another protocol version was accepted";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("speaks lorapipe protocol " +
                                         std::to_string(kProtocolVersion + 1)),
              std::string::npos)
        << e.what();
  }
  server.join();
  EXPECT_EQ(dispatcher.rejected(), 1u);
  EXPECT_EQ(log.take(LogLevel::kError).size(), 1u);
}

TEST(WireHello, ClientRefusesServerWithAnotherProtocolVersion) {
  zmq::context_t context;
  zmq::socket_t rep = make_socket(context, zmq::socket_type::rep, short_timeouts());
  const std::string endpoint = bind_fresh(rep, "inproc");
  std::thread server([&] {
    Received request = receive(rep, milliseconds(5000));
    ASSERT_NE(request.as<Hello>(), nullptr);
    Hello old = make_hello("cacher");
    old.set_protocol_version(0);
    ASSERT_EQ(send(rep, old), SendStatus::kSent);
  });
  Client client(context, endpoint, "trainer", short_timeouts());
  try {
    client.hello();
    FAIL() << "a server with another protocol version was accepted";
  } catch (const PeerError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'cacher'"), std::string::npos) << what;
    EXPECT_NE(what.find("speaks lorapipe protocol 0"), std::string::npos) << what;
  }
  server.join();
}

TEST(WireHello, HandlerFailureBecomesErrorReply) {
  zmq::context_t context;
  zmq::socket_t rep = make_socket(context, zmq::socket_type::rep, short_timeouts());
  const std::string endpoint = bind_fresh(rep, "inproc");
  Dispatcher dispatcher("cacher");
  dispatcher.on_request<GetRecordsRequest>([](const GetRecordsRequest& r) -> Dispatcher::Reply {
    throw InputError("no record under key '" + r.keys(0) + "'");
  });
  LogCapture log;
  std::thread server([&] { dispatcher.poll_once(rep, milliseconds(5000), /*reply=*/true); });
  Client client(context, endpoint, "trainer", short_timeouts());
  GetRecordsRequest request;
  request.add_keys("abc123");
  try {
    client.request<GetRecordsReply>(request);
    FAIL() << "a failing handler produced a normal reply";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("no record under key 'abc123'"), std::string::npos)
        << e.what();
  }
  server.join();
  EXPECT_EQ(log.take(LogLevel::kError).size(), 1u);
}

}  // namespace
}  // namespace lorapipe::wire

namespace lorapipe::wire {
namespace {

// Something that is not a ZeroMQ peer at all (a port scanner, a browser, a stray script)
// connects to a stage's tcp port and writes bytes: the connection is dropped with one error and
// the stage goes on serving its real peers.
TEST(WireNotZmtp, GarbageConnectionIsDroppedAndServingGoesOn) {
  LogCapture log;
  zmq::context_t context;
  zmq::socket_t pull = make_socket(context, zmq::socket_type::pull, short_timeouts());
  Dispatcher dispatcher("cacher");
  dispatcher.watch(context, pull);
  const std::string endpoint = bind_fresh(pull, "tcp");
  std::vector<std::string> paths;
  dispatcher.on<ImageSample>([&](const ImageSample& s) { paths.push_back(s.path()); });

  const int port = std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  std::string garbage = "\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f";  // a ZMTP-like signature
  garbage += std::string("\x03\x00" "NOTAMECHANISM", 15);              // ... then nonsense
  garbage += std::string(64, '\xee');
  ASSERT_EQ(::write(fd, garbage.data(), garbage.size()), static_cast<ssize_t>(garbage.size()));

  EXPECT_EQ(dispatcher.poll_once(pull, milliseconds(1000)), Dispatcher::Outcome::kTimeout);
  ::close(fd);
  const auto errors = log.take(LogLevel::kError);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("does not speak ZeroMQ"), std::string::npos) << errors[0];
  EXPECT_TRUE(paths.empty());

  zmq::socket_t push = make_socket(context, zmq::socket_type::push, short_timeouts());
  push.connect(endpoint);
  ImageSample sample;
  sample.set_path("after-garbage.png");
  ASSERT_EQ(send(push, sample), SendStatus::kSent);
  ASSERT_EQ(dispatcher.poll_once(pull, milliseconds(5000)), Dispatcher::Outcome::kHandled);
  ASSERT_EQ(paths.size(), 1u);
  EXPECT_EQ(paths[0], "after-garbage.png");
}

}  // namespace
}  // namespace lorapipe::wire
