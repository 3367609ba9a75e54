#pragma once
// The shape every stage shares around its sockets: one loop that serves several sockets from
// the stage's own thread (ZeroMQ sockets are not thread-safe; work that takes long goes to a
// runtime::WorkerPool), and the stage's StageStatus on its PUB socket.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>
#include <zmq.hpp>

#include "proto/wire.h"

namespace lorapipe::runtime {

// Serves several sockets, each with its Dispatcher, from one thread.
class SocketLoop {
 public:
  // Serves `socket` with `dispatcher`; `reply` for a REP socket (every request answered).
  // `enabled`, when given, is asked before each wait: while it is false the socket's messages
  // stay queued in ZeroMQ, which pushes back on the sender (a full encoder queue pauses the
  // stream, never the requests). Both must outlive the loop.
  void add(zmq::socket_t& socket, wire::Dispatcher& dispatcher, bool reply = false,
           std::function<bool()> enabled = {});

  // Waits up to `timeout` for a message on any enabled socket, then handles at most one
  // message from each socket that has one. Returns how many it took (handled or rejected);
  // 0 after a timeout. A handler's own failure (not InputError) propagates.
  int poll(std::chrono::milliseconds timeout);

 private:
  struct Entry {
    zmq::socket_t* socket;
    wire::Dispatcher* dispatcher;
    bool reply;
    std::function<bool()> enabled;
  };
  std::vector<Entry> entries_;
};

// A stage's lifecycle and progress on its PUB socket (lorapipe.proto, StageStatus): READY once
// it is bound and loaded, PROGRESS while it works (done of total units), DONE when its work is
// finished, ERROR with what failed. PUB keeps no history, so the last status is sent again every
// `repeat_every` from tick(): a subscriber that connects late (the launcher, a dashboard) still
// learns where the stage is. Exit codes stay the truth; these are the words. Never blocks.
class StatusPublisher {
 public:
  // `pub` may be null (the stage was started without --pub): then every call does nothing.
  StatusPublisher(zmq::socket_t* pub, std::string stage,
                  std::chrono::milliseconds repeat_every = std::chrono::seconds(2));

  void ready(std::string_view message = {});
  // Sent at most every 250 ms, and always for the last unit (done == total).
  void progress(uint64_t done, uint64_t total, std::string_view unit);
  void done(std::string_view message = {});
  void error(std::string_view message);
  // Sends the last status again once `repeat_every` has passed since anything was sent. Cheap:
  // loops call it on every turn.
  void tick();

  const wire::StageStatus& last() const { return status_; }

 private:
  void send();
  zmq::socket_t* pub_;
  wire::StageStatus status_;
  std::chrono::milliseconds repeat_every_;
  std::chrono::steady_clock::time_point last_sent_{};
};

}  // namespace lorapipe::runtime
