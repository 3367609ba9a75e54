#include "trainer/records.h"

#include <thread>

#include "cacher/store.h"
#include "common/error.h"
#include "common/log.h"
#include "common/text.h"
#include "proto/wire.h"

namespace lorapipe::trainer {
namespace {

constexpr std::string_view kLog = "trainer";

class LocalRecords final : public RecordSource {
 public:
  explicit LocalRecords(cacher::Store store) : store_(std::move(store)) {}
  std::vector<std::optional<std::string>> get(RecordKind kind,
                                              const std::vector<std::string>& keys) override {
    return store_.get_many(table(kind), keys);
  }
  std::string describe() const override { return "cache " + store_.dir().string(); }
  std::vector<std::string> manifest_names() override {
    std::vector<std::string> names;
    store_.for_each(cacher::Table::kManifests, [&](std::string_view key, std::string_view) {
      names.emplace_back(key);
      return true;
    });
    return names;
  }

 private:
  static cacher::Table table(RecordKind kind) {
    switch (kind) {
      case RecordKind::kLatent: return cacher::Table::kLatents;
      case RecordKind::kText: return cacher::Table::kTexts;
      case RecordKind::kManifest: return cacher::Table::kManifests;
    }
    return cacher::Table::kLatents;
  }
  cacher::Store store_;
};

class RemoteRecords final : public RecordSource {
 public:
  RemoteRecords(const std::string& endpoint, std::chrono::milliseconds give_up_after)
      : client_(context_, endpoint, "trainer"), give_up_after_(give_up_after) {}

  std::vector<std::string> manifest_names() override {
    const auto reply = with_retries([&] {
      return client_.request<wire::ListManifestsReply>(wire::ListManifestsRequest());
    });
    return {reply.names().begin(), reply.names().end()};
  }

  std::vector<std::optional<std::string>> get(RecordKind kind,
                                              const std::vector<std::string>& keys) override {
    wire::GetRecordsRequest request;
    request.set_kind(kind == RecordKind::kLatent ? wire::GetRecordsRequest::LATENT
                     : kind == RecordKind::kText ? wire::GetRecordsRequest::TEXT
                                                 : wire::GetRecordsRequest::MANIFEST);
    for (const std::string& key : keys) request.add_keys(key);
    const auto reply =
        with_retries([&] { return client_.request<wire::GetRecordsReply>(request); });
    if (reply.items_size() != static_cast<int>(keys.size())) {
      throw wire::PeerError("cacher " + client_.endpoint() + " answered " +
                            std::to_string(reply.items_size()) + " records for " +
                            std::to_string(keys.size()) + " keys");
    }
    std::vector<std::optional<std::string>> out;
    for (const auto& item : reply.items()) {
      out.push_back(item.found() ? std::optional<std::string>(item.record()) : std::nullopt);
    }
    return out;
  }
  std::string describe() const override { return "cacher " + client_.endpoint(); }
  void cancel_waiting_when(std::function<bool()> cancelled) override {
    cancelled_ = std::move(cancelled);
  }

 private:
  // Runs `request` until it is answered; a timeout is retried, with one log line saying so each
  // time, until give_up_after_ has passed without an answer.
  template <typename Request>
  auto with_retries(Request request) -> decltype(request()) {
    const auto started = std::chrono::steady_clock::now();
    while (true) {
      try {
        auto reply = request();
        if (waiting_) {
          LP_LOG(kInfo, kLog) << "cacher " << client_.endpoint() << " is back";
        }
        waiting_ = false;
        return reply;
      } catch (const wire::PeerTimeoutError&) {
        const auto waited = std::chrono::steady_clock::now() - started;
        if (cancelled_ && cancelled_()) {
          throw wire::PeerTimeoutError("cacher " + client_.endpoint() +
                                       " did not answer, and the run was stopped while waiting");
        }
        if (waited > give_up_after_) {
          throw wire::PeerTimeoutError(
              "cacher " + client_.endpoint() + " has not answered for " +
              std::to_string(std::chrono::duration_cast<std::chrono::seconds>(waited).count()) +
              " s (--timeout_s): giving up");
        }
        LP_LOG(kWarning, kLog) << "cacher " << client_.endpoint()
                               << " does not answer; waiting for it to come back";
        waiting_ = true;
      }
    }
  }

  zmq::context_t context_;
  wire::Client client_;
  std::chrono::milliseconds give_up_after_;
  bool waiting_ = false;
  std::function<bool()> cancelled_;
};

}  // namespace

wire::Manifest RecordSource::manifest(const std::string& dataset_id, std::string* resolved) {
  std::string name = dataset_id;
  auto found = get(RecordKind::kManifest, {name});
  std::vector<std::string> names;
  if (!found[0]) {
    names = manifest_names();
    std::vector<std::string> named_by_content;
    for (const std::string& candidate : names) {
      const std::string prefix = dataset_id + "-";
      if (candidate.size() == prefix.size() + 12 && candidate.rfind(prefix, 0) == 0 &&
          candidate.find_first_not_of("0123456789abcdef", prefix.size()) == std::string::npos) {
        named_by_content.push_back(candidate);
      }
    }
    if (named_by_content.size() > 1) {
      std::string list;
      for (const std::string& n : named_by_content) list += (list.empty() ? "" : ", ") + n;
      throw InputError("--dataset_id=" + dataset_id + ": " + describe() + " holds " +
                       std::to_string(named_by_content.size()) +
                       " manifests of that dataset, cached with other settings (" + list +
                       "); pass the full name (the cacher prints the name it wrote)");
    }
    if (named_by_content.size() == 1) {
      name = named_by_content[0];
      found = get(RecordKind::kManifest, {name});
    }
  }
  if (!found[0]) {
    // The names it holds, without their content hashes, for the hint.
    std::vector<std::string> datasets;
    for (const std::string& n : names) {
      const size_t dash = n.size() > 13 ? n.size() - 13 : std::string::npos;
      const bool hashed = dash != std::string::npos && n[dash] == '-' &&
                          n.find_first_not_of("0123456789abcdef", dash + 1) == std::string::npos;
      datasets.push_back(hashed ? n.substr(0, dash) : n);
    }
    throw InputError("no manifest '" + dataset_id + "' in " + describe() +
                     did_you_mean(dataset_id, datasets) + " (it holds " +
                     std::to_string(names.size()) + "): run preprocess and the cacher on the "
                     "dataset first (--dataset_id names the manifest they wrote)");
  }
  wire::Manifest manifest;
  if (!manifest.ParseFromString(*found[0])) {
    throw InputError("manifest '" + name + "' in " + describe() + " does not parse");
  }
  if (resolved != nullptr) *resolved = name;
  return manifest;
}

std::unique_ptr<RecordSource> open_local_records(const std::filesystem::path& dir) {
  cacher::StoreOptions options;
  options.dir = dir.empty() ? cacher::default_cache_dir() : dir;
  options.read_only = true;
  return std::make_unique<LocalRecords>(cacher::Store::open(options));
}

std::unique_ptr<RecordSource> open_remote_records(const std::string& endpoint,
                                                  std::chrono::milliseconds give_up_after) {
  return std::make_unique<RemoteRecords>(endpoint, give_up_after);
}

}  // namespace lorapipe::trainer
