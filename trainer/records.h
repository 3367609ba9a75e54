#pragma once
// Where the trainer's records come from: the local LMDB cache (read-only, shared with the
// cacher writing it) or a remote `lorapipe-cacher --serve` answering GetRecords. One interface,
// so the trainer (and later the sampler) never asks which.

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "proto/lorapipe.pb.h"

namespace lorapipe::trainer {

enum class RecordKind { kLatent, kText, kManifest };

class RecordSource {
 public:
  virtual ~RecordSource() = default;
  // One serialized record per key, in order; nullopt for a key the cache does not hold.
  virtual std::vector<std::optional<std::string>> get(RecordKind kind,
                                                      const std::vector<std::string>& keys) = 0;
  // "cache /path" or "cacher tcp://host:port", for messages.
  virtual std::string describe() const = 0;

  // A source that waits (a remote cacher that does not answer) stops waiting once `cancelled`
  // says so: get() then throws wire::PeerTimeoutError saying it was stopped. A local cache never
  // waits.
  virtual void cancel_waiting_when(std::function<bool()> cancelled) { (void)cancelled; }

  // The names of every manifest the source holds (a remote cacher lists its own).
  virtual std::vector<std::string> manifest_names() = 0;

  // The manifest named `dataset_id`, or, when none has that name, the one manifest the cacher
  // named `<dataset_id>-<12 hex digits>` after its content (a dataset preprocess named from its
  // path). Throws InputError naming the source when there is none, or several to choose from
  // (listing them), or it is unreadable. Sets `*resolved` to the name it found.
  wire::Manifest manifest(const std::string& dataset_id, std::string* resolved = nullptr);
};

// The local cache folder (`dir` empty: the default shared cache, as the cacher uses). Throws
// InputError when it holds no lorapipe store.
std::unique_ptr<RecordSource> open_local_records(const std::filesystem::path& dir);

// A remote cacher. A request that times out is retried, with one log line saying so each time,
// until `give_up_after` has passed without an answer; then PeerTimeoutError.
std::unique_ptr<RecordSource> open_remote_records(const std::string& endpoint,
                                                  std::chrono::milliseconds give_up_after);

}  // namespace lorapipe::trainer
