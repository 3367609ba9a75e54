#include "proto/wire.h"

#include <google/protobuf/descriptor.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <sstream>
#include <vector>

#include "common/log.h"

namespace lorapipe::wire {
namespace {

constexpr std::string_view kLog = "wire";
constexpr size_t kMaxTypeNameBytes = 128;

int to_int_ms(std::chrono::milliseconds ms) { return static_cast<int>(ms.count()); }

// A type frame as it can be shown in a log line: quoted when it is a plausible name, else only
// its size (a peer's binary garbage never reaches the terminal).
std::string describe_type(std::string_view type) {
  bool printable = !type.empty() && type.size() <= kMaxTypeNameBytes;
  for (char c : type) printable = printable && c >= 0x20 && c < 0x7f;
  if (printable) return "'" + std::string(type) + "'";
  return "<" + std::to_string(type.size()) + " bytes that are not a type name>";
}

Received rejected(std::string reason) {
  Received received;
  received.status = ReceiveStatus::kRejected;
  received.error = std::move(reason);
  return received;
}

std::string host_name() {
  std::array<char, 256> buffer{};
  if (gethostname(buffer.data(), buffer.size() - 1) != 0) return "unknown-host";
  return buffer.data();
}

}  // namespace

zmq::socket_t make_socket(zmq::context_t& context, zmq::socket_type type,
                          const SocketOptions& options) {
  zmq::socket_t socket(context, type);
  socket.set(zmq::sockopt::linger, to_int_ms(options.linger));
  socket.set(zmq::sockopt::sndtimeo, to_int_ms(options.send_timeout));
  socket.set(zmq::sockopt::rcvtimeo, to_int_ms(options.receive_timeout));
  socket.set(zmq::sockopt::sndhwm, options.send_high_water_mark);
  socket.set(zmq::sockopt::rcvhwm, options.receive_high_water_mark);
  socket.set(zmq::sockopt::reconnect_ivl, to_int_ms(options.reconnect_interval));
  socket.set(zmq::sockopt::reconnect_ivl_max, to_int_ms(options.reconnect_interval_max));
  socket.set(zmq::sockopt::maxmsgsize, options.max_message_bytes);
  socket.set(zmq::sockopt::heartbeat_ivl, to_int_ms(options.heartbeat_interval));
  socket.set(zmq::sockopt::heartbeat_timeout, to_int_ms(options.heartbeat_timeout));
  socket.set(zmq::sockopt::heartbeat_ttl, to_int_ms(options.heartbeat_timeout));
  return socket;
}

SendStatus send(zmq::socket_t& socket, const google::protobuf::Message& message) {
  const std::string& type = type_name(message);
  zmq::message_t payload(message.ByteSizeLong());
  if (!message.SerializeToArray(payload.data(), static_cast<int>(payload.size()))) {
    throw Error("cannot serialize " + type + " (" + std::to_string(payload.size()) + " bytes)");
  }
  // ZeroMQ delivers a multipart message atomically: once the first frame is queued the second
  // is too, so a timeout can only happen on the first.
  if (!socket.send(zmq::buffer(type), zmq::send_flags::sndmore)) return SendStatus::kTimeout;
  if (!socket.send(payload, zmq::send_flags::none)) return SendStatus::kTimeout;
  return SendStatus::kSent;
}

Received decode(std::string_view type, std::string_view payload) {
  if (type.substr(0, kTypePrefix.size()) != kTypePrefix) {
    return rejected("unknown message type " + describe_type(type));
  }
  const google::protobuf::Descriptor* descriptor =
      google::protobuf::DescriptorPool::generated_pool()->FindMessageTypeByName(std::string(type));
  if (descriptor == nullptr) return rejected("unknown message type " + describe_type(type));
  const google::protobuf::Message* prototype =
      google::protobuf::MessageFactory::generated_factory()->GetPrototype(descriptor);
  std::unique_ptr<google::protobuf::Message> message(prototype->New());
  if (payload.size() > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      !message->ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return rejected("payload of " + describe_type(type) + " (" + std::to_string(payload.size()) +
                    " bytes) does not parse: truncated or not that message");
  }
  Received received;
  received.status = ReceiveStatus::kOk;
  received.message = std::move(message);
  return received;
}

Received receive(zmq::socket_t& socket, std::chrono::milliseconds timeout) {
  zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
  if (zmq::poll(&item, 1, timeout) == 0) return {};
  // Read every frame of the message, keeping only the first two, so a malformed message is
  // consumed whole and the next call starts at the next message.
  std::vector<zmq::message_t> frames;
  size_t count = 0;
  do {
    zmq::message_t frame;
    if (!socket.recv(frame, zmq::recv_flags::dontwait)) break;
    ++count;
    if (frames.size() < 2) frames.push_back(std::move(frame));
  } while (socket.get(zmq::sockopt::rcvmore));
  if (count == 0) return {};
  if (count != 2) {
    return rejected("expected 2 frames [type name, payload], got " + std::to_string(count) +
                    " (first frame " + describe_type(frames[0].to_string_view()) + ")");
  }
  return decode(frames[0].to_string_view(), frames[1].to_string_view());
}

Hello make_hello(std::string_view stage) {
  Hello hello;
  hello.set_protocol_version(kProtocolVersion);
  hello.set_stage(std::string(stage));
  hello.set_instance_id(host_name() + ":" + std::to_string(getpid()));
  return hello;
}

std::string check_hello(const Hello& peer) {
  if (peer.protocol_version() == kProtocolVersion) return {};
  std::ostringstream why;
  why << "peer '" << peer.stage() << "' (" << peer.instance_id() << ") speaks lorapipe protocol "
      << peer.protocol_version() << ", this build speaks " << kProtocolVersion
      << ": run the same lorapipe version on both sides";
  return why.str();
}

// ---------------------------------------------------------------------------------------------
// Dispatcher

Dispatcher::Dispatcher(std::string stage) : stage_(std::move(stage)) {}

void Dispatcher::watch(zmq::context_t& context, zmq::socket_t& socket) {
  static std::atomic<uint64_t> counter{0};
  const std::string address = "inproc://lorapipe-monitor-" + std::to_string(getpid()) + "-" +
                              std::to_string(counter.fetch_add(1));
  const int events = ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                     ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                     ZMQ_EVENT_ACCEPT_FAILED;
  if (zmq_socket_monitor(socket.handle(), address.c_str(), events) != 0) {
    throw Error("cannot monitor the " + stage_ + " socket: " + zmq_strerror(zmq_errno()));
  }
  monitor_.emplace(context, zmq::socket_type::pair);
  monitor_->set(zmq::sockopt::linger, 0);
  monitor_->connect(address);
}

void Dispatcher::drain_monitor() {
  while (monitor_) {
    zmq::message_t event_frame;
    if (!monitor_->recv(event_frame, zmq::recv_flags::dontwait)) return;
    zmq::message_t address_frame;
    if (monitor_->get(zmq::sockopt::rcvmore)) {
      (void)monitor_->recv(address_frame, zmq::recv_flags::dontwait);
    }
    if (event_frame.size() < sizeof(uint16_t)) continue;
    uint16_t event = 0;
    std::memcpy(&event, event_frame.data(), sizeof(event));
    const std::string where = address_frame.to_string();
    switch (event) {
      case ZMQ_EVENT_DISCONNECTED:
        if (finished_peers_ > 0) {
          --finished_peers_;
          LP_LOG(kInfo, kLog) << stage_ << ": a peer on " << where << " left after its end";
          break;
        }
        LP_LOG(kWarning, kLog) << stage_ << ": a peer on " << where
                               << " disconnected (it exited, or broke the protocol, for example "
                                  "with a frame over the size limit)";
        break;
      case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
      case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
      case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
        ++rejected_;
        LP_LOG(kError, kLog) << stage_ << ": dropped a connection on " << where
                             << " that does not speak ZeroMQ (handshake failed)";
        break;
      case ZMQ_EVENT_ACCEPT_FAILED:
        LP_LOG(kError, kLog) << stage_ << ": could not accept a connection on " << where;
        break;
      default:
        break;
    }
  }
}

Dispatcher::Reply Dispatcher::handle(const google::protobuf::Message& message, bool reply) {
  const std::string& type = type_name(message);
  if (const auto* hello = dynamic_cast<const Hello*>(&message); hello != nullptr && reply) {
    if (std::string why = check_hello(*hello); !why.empty()) {
      ++rejected_;
      LP_LOG(kError, kLog) << stage_ << ": refused " << why;
      auto error = std::make_unique<ErrorReply>();
      error->set_message(stage_ + " refused: " + why);
      return error;
    }
    ++handled_;
    return std::make_unique<Hello>(make_hello(stage_));
  }
  auto it = handlers_.find(type);
  if (it == handlers_.end()) {
    ++rejected_;
    LP_LOG(kError, kLog) << stage_ << ": rejected a " << type << ": this stage does not take it";
    auto error = std::make_unique<ErrorReply>();
    error->set_message(stage_ + " does not take " + type);
    return error;
  }
  try {
    Reply answer = it->second(message);
    ++handled_;
    if (reply && answer == nullptr) {
      auto error = std::make_unique<ErrorReply>();
      error->set_message(stage_ + " has no reply to " + type);
      return error;
    }
    return answer;
  } catch (const InputError& e) {
    // Bad input costs only itself; anything else (a full disk, a broken model) is the stage's
    // failure and propagates out of poll_once.
    ++rejected_;
    LP_LOG(kError, kLog) << stage_ << ": handling a " << type << " failed: " << e.what();
    auto error = std::make_unique<ErrorReply>();
    error->set_message(stage_ + " could not handle " + type + ": " + e.what());
    return error;
  }
}

Dispatcher::Outcome Dispatcher::poll_once(zmq::socket_t& socket, std::chrono::milliseconds timeout,
                                          bool reply) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    std::array<zmq::pollitem_t, 2> items{};
    items[0] = {socket.handle(), 0, ZMQ_POLLIN, 0};
    size_t count = 1;
    if (monitor_) items[count++] = {monitor_->handle(), 0, ZMQ_POLLIN, 0};
    const auto left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   deadline - Clock::now()),
                               std::chrono::milliseconds(0));
    zmq::poll(items.data(), count, left);
    // Messages before connection events: a peer's last messages (preprocess's DatasetReport,
    // which announces its end with peer_finished) are read before its disconnect is judged, so
    // a peer that said goodbye and left is not taken for one that died.
    if (items[0].revents & ZMQ_POLLIN) break;
    if (count > 1 && (items[1].revents & ZMQ_POLLIN)) drain_monitor();
    if (Clock::now() >= deadline) return Outcome::kTimeout;
  }

  Received received = receive(socket, std::chrono::milliseconds(0));
  if (received.status == ReceiveStatus::kTimeout) return Outcome::kTimeout;
  Reply answer;
  Outcome outcome = Outcome::kHandled;
  if (!received.ok()) {
    ++rejected_;
    LP_LOG(kError, kLog) << stage_ << ": rejected a message: " << received.error;
    outcome = Outcome::kRejected;
    if (reply) {
      auto error = std::make_unique<ErrorReply>();
      error->set_message(stage_ + " rejected the request: " + received.error);
      answer = std::move(error);
    }
  } else {
    const uint64_t rejected_before = rejected_;
    answer = handle(*received.message, reply);
    if (rejected_ != rejected_before) outcome = Outcome::kRejected;
  }
  if (reply && answer != nullptr && send(socket, *answer) != SendStatus::kSent) {
    LP_LOG(kWarning, kLog) << stage_ << ": the requester went away before taking its reply";
  }
  return outcome;
}

// ---------------------------------------------------------------------------------------------
// Client

Client::Client(zmq::context_t& context, std::string endpoint, std::string stage,
               SocketOptions options)
    : context_(context),
      endpoint_(std::move(endpoint)),
      stage_(std::move(stage)),
      options_(options),
      socket_(make_socket(context_, zmq::socket_type::req, options_)) {
  socket_.connect(endpoint_);
}

void Client::reset_socket() {
  socket_.set(zmq::sockopt::linger, 0);
  socket_.close();
  socket_ = make_socket(context_, zmq::socket_type::req, options_);
  socket_.connect(endpoint_);
}

Received Client::round_trip(const google::protobuf::Message& request) {
  const std::string& type = type_name(request);
  if (send(socket_, request) != SendStatus::kSent) {
    reset_socket();
    throw PeerTimeoutError(stage_ + ": nobody on " + endpoint_ + " took a " + type + " within " +
                           std::to_string(options_.send_timeout.count()) + " ms");
  }
  Received received = receive(socket_, options_.receive_timeout);
  if (received.status == ReceiveStatus::kTimeout) {
    reset_socket();
    throw PeerTimeoutError(stage_ + ": no reply from " + endpoint_ + " to " + type + " within " +
                           std::to_string(options_.receive_timeout.count()) +
                           " ms: is the peer running and listening there?");
  }
  if (received.status == ReceiveStatus::kRejected) {
    reset_socket();
    throw PeerError(stage_ + ": malformed reply from " + endpoint_ + ": " + received.error);
  }
  if (const auto* error = received.as<ErrorReply>()) {
    throw PeerError(stage_ + ": " + endpoint_ + " answered " + type + " with an error: " +
                    error->message());
  }
  return received;
}

std::string Client::unexpected_reply(const Received& received, std::string_view wanted) const {
  return stage_ + ": " + endpoint_ + " answered with " + type_name(*received.message) +
         " where " + std::string(wanted) + " was expected";
}

Hello Client::hello() {
  Hello peer = request<Hello>(make_hello(stage_));
  if (std::string why = check_hello(peer); !why.empty()) {
    throw PeerError(stage_ + ": " + endpoint_ + ": " + why);
  }
  return peer;
}

}  // namespace lorapipe::wire
