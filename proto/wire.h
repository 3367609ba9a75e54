#pragma once
// Typed ZeroMQ messaging between lorapipe stages.
//
// Contract (DESIGN.md, "Messages"): every message is two frames, [type name, payload], where
// the type name is the protobuf full name ("lorapipe.wire.ImageSample") and the payload its
// binary serialization. Because the type name is the first frame it also serves as the
// PUB/SUB topic: a SUB socket subscribes to exactly the types it wants.
//
// A receiver never trusts its peer: an unknown type, a payload that does not parse, the wrong
// number of frames or a frame over the size limit is rejected with one clear log line and the
// receiver goes on with the next message. Every socket has send and receive timeouts, so no
// stage waits forever on a dead peer.

#include <google/protobuf/message.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <zmq.hpp>

#include "common/error.h"
#include "proto/lorapipe.pb.h"

namespace lorapipe::wire {

// Bumped whenever a change to lorapipe.proto is not backward compatible.
inline constexpr uint32_t kProtocolVersion = 1;

// Every lorapipe message type name starts with this (the proto package).
inline constexpr std::string_view kTypePrefix = "lorapipe.wire.";

// All socket options lorapipe sets, in one place. Defaults suit one machine and a LAN.
struct SocketOptions {
  std::chrono::milliseconds send_timeout{5000};     // ZMQ_SNDTIMEO
  std::chrono::milliseconds receive_timeout{5000};  // ZMQ_RCVTIMEO
  // Pending messages are kept this long after close, so a clean shutdown delivers them but a
  // dead peer cannot block exit.
  std::chrono::milliseconds linger{2000};
  int send_high_water_mark = 1000;  // messages queued per peer before send blocks
  int receive_high_water_mark = 1000;
  std::chrono::milliseconds reconnect_interval{100};
  std::chrono::milliseconds reconnect_interval_max{2000};
  // ZMQ_MAXMSGSIZE: a peer announcing a larger frame is disconnected before anything is
  // allocated for it. 512 MiB holds the largest batch of latent records we send.
  int64_t max_message_bytes = int64_t{512} << 20;
  // ZMTP heartbeats notice a silently dead TCP peer (cable pulled, host gone).
  std::chrono::milliseconds heartbeat_interval{2000};
  std::chrono::milliseconds heartbeat_timeout{10000};
};

// A socket of `type` with every option of `options` applied; connect or bind is the caller's.
zmq::socket_t make_socket(zmq::context_t& context, zmq::socket_type type,
                          const SocketOptions& options = {});

// The wire name of a message: its protobuf full name.
inline const std::string& type_name(const google::protobuf::Message& message) {
  return message.GetDescriptor()->full_name();
}

enum class SendStatus {
  kSent,
  kTimeout,  // the peer did not take it within the send timeout (dead, or its queue full)
};

// Sends `message` as [type name, payload]. Blocks at most the socket's send timeout.
SendStatus send(zmq::socket_t& socket, const google::protobuf::Message& message);

enum class ReceiveStatus {
  kOk,
  kTimeout,   // nothing arrived in time
  kRejected,  // something arrived and was not a valid lorapipe message; see `error`
};

struct Received {
  ReceiveStatus status = ReceiveStatus::kTimeout;
  std::unique_ptr<google::protobuf::Message> message;  // set when kOk
  std::string error;                                   // set when kRejected

  bool ok() const { return status == ReceiveStatus::kOk; }
  // The message as T, or nullptr when it is another type (or none).
  template <typename T>
  const T* as() const {
    return ok() ? dynamic_cast<const T*>(message.get()) : nullptr;
  }
};

// Waits up to `timeout` for one message and parses it into its lorapipe type. A malformed
// message is consumed whole (all its frames) and reported as kRejected with the reason, so the
// next call sees the next message. Never throws on anything a peer sends.
Received receive(zmq::socket_t& socket, std::chrono::milliseconds timeout);

// Decodes [type name, payload] into a new message of that type, or returns why not.
Received decode(std::string_view type, std::string_view payload);

// Serves one socket: routes each received message to the handler registered for its type and
// logs (once each) what it rejects. On a REP socket every request gets exactly one reply: the
// handler's, an ErrorReply when the handler throws InputError or the request is malformed, or
// the stage's own Hello when the peer says Hello (refusing another protocol version). Any other
// exception from a handler is the stage's own failure and propagates out of poll_once.
class Dispatcher {
 public:
  using Reply = std::unique_ptr<google::protobuf::Message>;

  // `stage` names this side in logs and in the Hello it answers with.
  explicit Dispatcher(std::string stage);

  // A handler for messages of type T on a socket without replies (PULL, SUB, PAIR).
  template <typename T>
  void on(std::function<void(const T&)> handler) {
    handlers_[T::descriptor()->full_name()] = [h = std::move(handler)](
                                                  const google::protobuf::Message& m) -> Reply {
      h(static_cast<const T&>(m));
      return nullptr;
    };
  }

  // A handler for requests of type T on a REP socket; it returns the reply.
  template <typename T>
  void on_request(std::function<Reply(const T&)> handler) {
    handlers_[T::descriptor()->full_name()] =
        [h = std::move(handler)](const google::protobuf::Message& m) -> Reply {
      return h(static_cast<const T&>(m));
    };
  }

  enum class Outcome { kHandled, kTimeout, kRejected };

  // Waits up to `timeout` for one message on `socket` and handles it. With `reply` the socket
  // is a REP socket and every request is answered. Peer connection events reported by a
  // monitor (see watch) are logged while waiting.
  Outcome poll_once(zmq::socket_t& socket, std::chrono::milliseconds timeout, bool reply = false);

  // Logs connection-level trouble on `socket` (a peer that sends bytes that are not ZMTP, a
  // frame over the size limit, a peer that disconnects) while poll_once waits. Call once, before
  // the socket binds or connects.
  void watch(zmq::context_t& context, zmq::socket_t& socket);

  // A peer said it is done (preprocess's DatasetReport): its disconnect, expected now, is logged
  // as news, not as a warning. Each call covers one disconnect.
  void peer_finished() { ++finished_peers_; }

  uint64_t handled() const { return handled_; }
  uint64_t rejected() const { return rejected_; }

 private:
  void drain_monitor();
  Reply handle(const google::protobuf::Message& message, bool reply);

  std::string stage_;
  std::map<std::string, std::function<Reply(const google::protobuf::Message&)>, std::less<>>
      handlers_;
  std::optional<zmq::socket_t> monitor_;
  uint64_t handled_ = 0;
  uint64_t rejected_ = 0;
  uint64_t finished_peers_ = 0;  // disconnects that peer_finished() announced
};

// Thrown when a peer does not answer in time; the message names the endpoint.
class PeerTimeoutError : public Error {
 public:
  using Error::Error;
};

// Thrown when a peer answers with an ErrorReply, or with a reply of the wrong type or version.
class PeerError : public Error {
 public:
  using Error::Error;
};

// The requesting side of a REQ/REP pair, with a timeout on every request. After a timeout the
// socket is rebuilt (a REQ socket cannot send again until it receives), so the client stays
// usable when the server comes back.
class Client {
 public:
  Client(zmq::context_t& context, std::string endpoint, std::string stage,
         SocketOptions options = {});

  // Sends `request` and waits for a reply of type T. Throws PeerTimeoutError when none comes
  // within the receive timeout, PeerError for an ErrorReply or a reply of another type.
  template <typename T>
  T request(const google::protobuf::Message& request) {
    Received received = round_trip(request);
    if (const auto* reply = received.as<T>()) return *reply;
    throw PeerError(unexpected_reply(received, T::descriptor()->full_name()));
  }

  // Exchanges Hello; throws PeerError when the peer speaks another protocol version.
  Hello hello();

  const std::string& endpoint() const { return endpoint_; }

 private:
  Received round_trip(const google::protobuf::Message& request);
  std::string unexpected_reply(const Received& received, std::string_view wanted) const;
  void reset_socket();

  zmq::context_t& context_;
  std::string endpoint_;
  std::string stage_;
  SocketOptions options_;
  zmq::socket_t socket_;
};

// This process's Hello for `stage`.
Hello make_hello(std::string_view stage);

// Empty when `peer` speaks our protocol version, else the reason to refuse it.
std::string check_hello(const Hello& peer);

}  // namespace lorapipe::wire
