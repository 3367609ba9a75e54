// Wire throughput: 100 KB messages over ipc:// and tcp:// loopback, PUSH -> PULL, sender and
// receiver on their own threads.
//
//   lorapipe : ImageSample with a 100 KB pixel payload, through wire::send / wire::receive
//              (protobuf serialize, two frames, receive, type lookup, parse).
//   reference: the same 100 KB as one raw cppzmq frame, no framing or parsing.
//
// The ratio lorapipe/reference is the cost of the typed protocol on top of libzmq itself.
// Usage: wire_bench [messages=5000] [rounds=3]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <unistd.h>

#include "proto/wire.h"

namespace {

using Clock = std::chrono::steady_clock;
using lorapipe::wire::SocketOptions;
constexpr size_t kPayloadBytes = 100 * 1000;

struct Endpoints {
  std::string bind;
  std::string connect;
};

double run_lorapipe(zmq::context_t& context, const Endpoints& ep, int messages) {
  namespace wire = lorapipe::wire;
  SocketOptions options;
  options.send_timeout = std::chrono::milliseconds(30000);
  options.receive_timeout = std::chrono::milliseconds(30000);
  zmq::socket_t pull = wire::make_socket(context, zmq::socket_type::pull, options);
  pull.bind(ep.bind);
  const std::string endpoint = pull.get(zmq::sockopt::last_endpoint);
  std::thread sender([&] {
    zmq::socket_t push = wire::make_socket(context, zmq::socket_type::push, options);
    push.connect(endpoint);
    wire::ImageSample sample;
    sample.set_path("bench.png");
    sample.set_pixels(std::string(kPayloadBytes, '\x5a'));
    for (int i = 0; i < messages; ++i) {
      if (wire::send(push, sample) != wire::SendStatus::kSent) std::abort();
    }
  });
  const auto start = Clock::now();
  size_t bytes = 0;
  for (int i = 0; i < messages; ++i) {
    wire::Received received = wire::receive(pull, std::chrono::milliseconds(30000));
    const auto* sample = received.as<wire::ImageSample>();
    if (sample == nullptr) std::abort();
    bytes += sample->pixels().size();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  sender.join();
  if (bytes != kPayloadBytes * messages) std::abort();
  return seconds;
}

double run_reference(zmq::context_t& context, const Endpoints& ep, int messages) {
  zmq::socket_t pull(context, zmq::socket_type::pull);
  pull.bind(ep.bind);
  const std::string endpoint = pull.get(zmq::sockopt::last_endpoint);
  std::thread sender([&] {
    zmq::socket_t push(context, zmq::socket_type::push);
    push.connect(endpoint);
    const std::string payload(kPayloadBytes, '\x5a');
    for (int i = 0; i < messages; ++i) {
      if (!push.send(zmq::buffer(payload), zmq::send_flags::none)) std::abort();
    }
  });
  const auto start = Clock::now();
  size_t bytes = 0;
  for (int i = 0; i < messages; ++i) {
    zmq::message_t frame;
    if (!pull.recv(frame)) std::abort();
    bytes += frame.size();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  sender.join();
  if (bytes != kPayloadBytes * messages) std::abort();
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  const int messages = argc > 1 ? std::atoi(argv[1]) : 5000;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  zmq::context_t context;
  const std::string ipc = "ipc:///tmp/lorapipe-wire-bench-" + std::to_string(getpid());
  const Endpoints transports[] = {{ipc, ipc}, {"tcp://127.0.0.1:*", ""}};
  std::printf("wire_bench: %d messages of %zu bytes, best of %d rounds\n", messages,
              kPayloadBytes, rounds);
  std::printf("%-5s %-10s %12s %10s\n", "", "", "messages/s", "GiB/s");
  for (const Endpoints& ep : transports) {
    double best_ours = 1e30;
    double best_ref = 1e30;
    for (int r = 0; r < rounds; ++r) {  // interleaved so both see the same machine load
      best_ref = std::min(best_ref, run_reference(context, ep, messages));
      best_ours = std::min(best_ours, run_lorapipe(context, ep, messages));
    }
    const std::string name = ep.bind.substr(0, 3);
    const double gib = static_cast<double>(kPayloadBytes) * messages / (1024.0 * 1024 * 1024);
    std::printf("%-5s %-10s %12.0f %10.2f\n", name.c_str(), "lorapipe", messages / best_ours,
                gib / best_ours);
    std::printf("%-5s %-10s %12.0f %10.2f\n", name.c_str(), "raw zmq", messages / best_ref,
                gib / best_ref);
    std::printf("%-5s lorapipe/raw throughput ratio: %.2f\n", name.c_str(), best_ref / best_ours);
  }
  return 0;
}
