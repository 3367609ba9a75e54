#include "runtime/stage.h"

#include <unistd.h>

namespace lorapipe::runtime {

void SocketLoop::add(zmq::socket_t& socket, wire::Dispatcher& dispatcher, bool reply,
                     std::function<bool()> enabled) {
  entries_.push_back({&socket, &dispatcher, reply, std::move(enabled)});
}

int SocketLoop::poll(std::chrono::milliseconds timeout) {
  std::vector<zmq::pollitem_t> items;
  items.reserve(entries_.size());
  for (const Entry& e : entries_) {
    const bool on = !e.enabled || e.enabled();
    items.push_back({e.socket->handle(), 0, static_cast<short>(on ? ZMQ_POLLIN : 0), 0});
  }
  zmq::poll(items.data(), items.size(), timeout);
  int taken = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (!(items[i].revents & ZMQ_POLLIN)) continue;
    const Entry& e = entries_[i];
    if (e.dispatcher->poll_once(*e.socket, std::chrono::milliseconds(0), e.reply) !=
        wire::Dispatcher::Outcome::kTimeout) {
      ++taken;
    }
  }
  return taken;
}

StatusPublisher::StatusPublisher(zmq::socket_t* pub, std::string stage,
                                 std::chrono::milliseconds repeat_every)
    : pub_(pub), repeat_every_(repeat_every) {
  status_.set_stage(std::move(stage));
  status_.set_pid(static_cast<int32_t>(getpid()));
}

void StatusPublisher::send() {
  if (pub_ == nullptr) return;
  (void)wire::send(*pub_, status_);  // PUB drops what no subscriber takes; it never blocks
  last_sent_ = std::chrono::steady_clock::now();
}

void StatusPublisher::ready(std::string_view message) {
  status_.set_state(wire::StageStatus::READY);
  status_.set_message(std::string(message));
  send();
}

void StatusPublisher::progress(uint64_t done, uint64_t total, std::string_view unit) {
  const bool changed_kind = status_.state() != wire::StageStatus::PROGRESS || status_.unit() != unit;
  status_.set_state(wire::StageStatus::PROGRESS);
  status_.clear_message();
  status_.set_done(done);
  status_.set_total(total);
  status_.set_unit(std::string(unit));
  if (changed_kind || done >= total ||
      std::chrono::steady_clock::now() - last_sent_ >= std::chrono::milliseconds(250)) {
    send();
  }
}

void StatusPublisher::done(std::string_view message) {
  status_.set_state(wire::StageStatus::DONE);
  status_.set_message(std::string(message));
  send();
}

void StatusPublisher::error(std::string_view message) {
  status_.set_state(wire::StageStatus::ERROR);
  status_.set_message(std::string(message));
  send();
}

void StatusPublisher::tick() {
  if (status_.state() == wire::StageStatus::STATE_UNSPECIFIED) return;
  if (std::chrono::steady_clock::now() - last_sent_ >= repeat_every_) send();
}

}  // namespace lorapipe::runtime
