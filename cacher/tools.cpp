#include "cacher/tools.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>
#include <unistd.h>

#include "cacher/records.h"
#include "cacher/store.h"
#include "common/error.h"
#include "common/file.h"
#include "common/hash.h"
#include "proto/lorapipe.pb.h"

namespace lorapipe::cacher {
namespace {

constexpr std::string_view kExportMagic = "lorapipe-cache-export 1\n";

Store open_store(const ToolOptions& options, bool read_only) {
  StoreOptions o;
  o.dir = options.cache_dir.empty() ? default_cache_dir() : options.cache_dir;
  o.read_only = read_only;
  o.max_map_bytes = options.max_map_bytes;
  return Store::open(o);
}

std::vector<wire::Manifest> manifests(const Store& store) {
  std::vector<wire::Manifest> out;
  store.for_each(Table::kManifests, [&](std::string_view key, std::string_view value) {
    wire::Manifest m;
    if (!m.ParseFromArray(value.data(), static_cast<int>(value.size()))) {
      throw InputError("cache " + store.dir().string() + ": manifest '" + std::string(key) +
                       "' is corrupt");
    }
    out.push_back(std::move(m));
    return true;
  });
  return out;
}

// Fingerprint part of a key: latent "c.t.FP.vN" / text "c.FP.vN".
std::string fingerprint_of(std::string_view key, bool latent) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  for (size_t dot = key.find('.'); dot != std::string_view::npos; dot = key.find('.', start)) {
    parts.push_back(key.substr(start, dot - start));
    start = dot + 1;
  }
  parts.push_back(key.substr(start));
  const size_t index = latent ? 2 : 1;
  return parts.size() > index ? std::string(parts[index]) : "?";
}

void write_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

uint64_t read_u64(std::string_view in, size_t& pos, const std::string& file) {
  if (pos + 8 > in.size()) throw InputError(file + ": truncated export file");
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(in[pos + i]);
  pos += 8;
  return v;
}

constexpr std::pair<Table, const char*> kTables[] = {{Table::kLatents, "latents"},
                                                     {Table::kTexts, "texts"},
                                                     {Table::kManifests, "manifests"},
                                                     {Table::kMeta, "meta"}};

// What --inspect shows, gathered once for both of its formats.
struct CacheSummary {
  std::vector<std::pair<const char*, Store::TableStats>> tables;
  std::map<std::string, uint64_t> vae;   // fingerprint -> latents
  std::map<std::string, uint64_t> text;  // fingerprint -> texts
  std::vector<wire::Manifest> manifests;
};

CacheSummary summarize(const Store& store) {
  CacheSummary s;
  for (const auto& [table, name] : kTables) s.tables.emplace_back(name, store.stats(table));
  store.for_each(Table::kLatents, [&](std::string_view key, std::string_view) {
    ++s.vae[fingerprint_of(key, true)];
    return true;
  });
  store.for_each(Table::kTexts, [&](std::string_view key, std::string_view) {
    ++s.text[fingerprint_of(key, false)];
    return true;
  });
  s.manifests = manifests(store);
  return s;
}

}  // namespace

std::string inspect_text(const ToolOptions& options) {
  const Store store = open_store(options, /*read_only=*/true);
  const CacheSummary s = summarize(store);
  std::ostringstream out;
  out << "cache " << store.dir().string() << "\n";
  for (const auto& [name, stats] : s.tables) {
    char line[128];
    std::snprintf(line, sizeof(line), "  %-10s %10llu records %12.2f MiB\n", name,
                  static_cast<unsigned long long>(stats.entries), stats.bytes / 1048576.0);
    out << line;
  }
  for (const auto& [fp, n] : s.vae) out << "  VAE fingerprint " << fp << ": " << n << " latents\n";
  for (const auto& [fp, n] : s.text) out << "  text fingerprint " << fp << ": " << n << " texts\n";
  for (const auto& m : s.manifests) {
    out << "  manifest " << m.dataset_id() << ": " << m.entries_size() << " entries, text "
        << (m.text_cached() ? "cached" : "encoded online") << "\n";
  }
  return out.str();
}

std::string inspect_json(const ToolOptions& options) {
  const Store store = open_store(options, /*read_only=*/true);
  const CacheSummary s = summarize(store);
  nlohmann::json j;
  j["cache_dir"] = store.dir().string();
  for (const auto& [name, stats] : s.tables) {
    j["tables"][name] = {{"records", stats.entries}, {"bytes", stats.bytes}};
  }
  j["vae_fingerprints"] = s.vae;
  j["text_fingerprints"] = s.text;
  j["manifests"] = nlohmann::json::array();
  for (const auto& m : s.manifests) {
    j["manifests"].push_back({{"dataset_id", m.dataset_id()},
                              {"entries", m.entries_size()},
                              {"text_cached", m.text_cached()},
                              {"vae_fingerprint", m.vae_fingerprint()},
                              {"text_encoder_fingerprint", m.text_encoder_fingerprint()}});
  }
  return j.dump(2) + "\n";
}

bool verify(const ToolOptions& options, std::ostream& out) {
  const Store store = open_store(options, /*read_only=*/true);
  const auto corrupt = verify_store(store);
  for (const auto& [key, reason] : corrupt) out << "corrupt " << key << ": " << reason << "\n";
  bool ok = corrupt.empty();
  for (const auto& m : manifests(store)) {
    const ManifestCheck check = check_manifest(store, m);
    for (const auto& key : check.missing) {
      out << "manifest " << m.dataset_id() << ": missing " << key << "\n";
      ok = false;
    }
    for (const auto& [what, reason] : check.corrupt) {
      out << "manifest " << m.dataset_id() << ": " << what << ": " << reason << "\n";
      ok = false;
    }
  }
  out << (ok ? "cache verified: no corrupt record, every manifest complete\n"
             : "cache has problems (listed above)\n");
  return ok;
}

void gc(const ToolOptions& options, std::ostream& out) {
  Store store = open_store(options, /*read_only=*/false);
  std::set<std::string> latents, texts;
  for (const auto& m : manifests(store)) {
    for (const auto& e : m.entries()) {
      latents.insert(e.latent_key());
      if (!e.text_key().empty()) texts.insert(e.text_key());
    }
  }
  for (const auto& [table, keep] : {std::pair{Table::kLatents, &latents},
                                    std::pair{Table::kTexts, &texts}}) {
    std::vector<std::string> drop;
    store.for_each(table, [&](std::string_view key, std::string_view) {
      if (!keep->count(std::string(key))) drop.emplace_back(key);
      return true;
    });
    store.erase(table, drop);
    out << "dropped " << drop.size() << (table == Table::kLatents ? " latents" : " texts")
        << " no manifest references\n";
  }
}

void drop_superseded(const ToolOptions& options, std::ostream& out) {
  Store store = open_store(options, /*read_only=*/false);
  struct Written {
    int64_t unix_ms;
    std::string id;
  };
  std::map<std::string, std::vector<Written>> series;
  store.for_each(Table::kMeta, [&](std::string_view key, std::string_view value) {
    if (!key.starts_with(kMetaManifestWritten)) return true;
    const nlohmann::json j = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.value("series", nlohmann::json()).is_string() ||
        !j.value("unix_ms", nlohmann::json()).is_number_integer()) {
      return true;  // unreadable: its manifest is kept
    }
    series[j["series"].get<std::string>()].push_back(
        {j["unix_ms"].get<int64_t>(), std::string(key.substr(kMetaManifestWritten.size()))});
    return true;
  });
  std::vector<std::string> manifests_dropped, meta_dropped;
  for (auto& [key, written] : series) {
    std::sort(written.begin(), written.end(), [](const Written& a, const Written& b) {
      return std::tie(a.unix_ms, a.id) < std::tie(b.unix_ms, b.id);
    });
    const Written& newest = written.back();
    for (size_t i = 0; i + 1 < written.size(); ++i) {
      meta_dropped.push_back(std::string(kMetaManifestWritten) + written[i].id);
      if (!store.get(Table::kManifests, written[i].id)) continue;
      manifests_dropped.push_back(written[i].id);
      out << "dropped manifest " << written[i].id << ": superseded by " << newest.id
          << " (the same dataset, model and settings, cached later)\n";
    }
  }
  // The manifests first: a crash in between leaves a time without its manifest, which is
  // passed over, never a manifest that lost its time.
  store.erase(Table::kManifests, manifests_dropped);
  store.erase(Table::kMeta, meta_dropped);
  out << "dropped " << manifests_dropped.size() << " superseded manifests\n";
}

void export_dataset(const ToolOptions& options, const std::string& dataset_id,
                    const std::filesystem::path& file, std::ostream& out) {
  if (dataset_id.empty()) throw InputError("--export_file needs --dataset=ID (see --inspect)");
  const Store store = open_store(options, /*read_only=*/true);
  const auto manifest_bytes = store.get(Table::kManifests, dataset_id);
  if (!manifest_bytes) {
    throw InputError("cache " + store.dir().string() + " has no manifest '" + dataset_id + "'");
  }
  wire::Manifest manifest;
  if (!manifest.ParseFromString(*manifest_bytes)) {
    throw InputError("cache " + store.dir().string() + ": manifest '" + dataset_id +
                     "' is corrupt; nothing exported");
  }
  std::vector<std::string> latent_keys, text_keys;
  for (const auto& e : manifest.entries()) {
    latent_keys.push_back(e.latent_key());
    if (!e.text_key().empty()) text_keys.push_back(e.text_key());
  }
  std::string body;
  auto add = [&](char table, const std::string& key, const std::string& value) {
    body.push_back(table);
    write_u64(body, key.size());
    body += key;
    write_u64(body, value.size());
    body += value;
  };
  add('m', dataset_id, *manifest_bytes);
  uint64_t count = 1;
  for (const auto& [table, tag, keys] : {std::tuple{Table::kLatents, 'l', &latent_keys},
                                         std::tuple{Table::kTexts, 't', &text_keys}}) {
    std::set<std::string> unique(keys->begin(), keys->end());
    const std::vector<std::string> ordered(unique.begin(), unique.end());
    const auto values = store.get_many(table, ordered);
    for (size_t i = 0; i < ordered.size(); ++i) {
      if (!values[i]) throw InputError("cannot export: record " + ordered[i] + " is missing");
      add(tag, ordered[i], *values[i]);
      ++count;
    }
  }
  std::string file_bytes(kExportMagic);
  write_u64(file_bytes, count);
  file_bytes += body;
  const Hash128 checksum = hash_bytes(file_bytes);
  write_u64(file_bytes, checksum.high);
  write_u64(file_bytes, checksum.low);
  // To a temporary name, flushed to the disk, then renamed: a crash or a full disk never leaves
  // a half-written export under the real name (import would refuse it, but later).
  const auto temp = file.string() + ".tmp-" + std::to_string(getpid());
  write_file(temp, file_bytes, /*sync=*/true);
  std::filesystem::rename(temp, file);
  out << "exported dataset " << dataset_id << ": " << count << " records, " << file_bytes.size()
      << " bytes to " << file.string() << "\n";
}

void import_dataset(const ToolOptions& options, const std::filesystem::path& file,
                    std::ostream& out) {
  std::ifstream f(file, std::ios::binary);
  if (!f) throw InputError("cannot read " + file.string());
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::string name = file.string();
  if (bytes.size() < kExportMagic.size() + 24 || bytes.compare(0, kExportMagic.size(), kExportMagic) != 0) {
    throw InputError(name + ": not a lorapipe cache export");
  }
  size_t end = bytes.size() - 16;
  size_t pos = end;
  const uint64_t high = read_u64(bytes, pos, name);
  const uint64_t low = read_u64(bytes, pos, name);
  if (!(hash_bytes(std::string_view(bytes).substr(0, end)) == Hash128{high, low})) {
    throw InputError(name + ": checksum mismatch (damaged in transit?)");
  }
  pos = kExportMagic.size();
  const uint64_t count = read_u64(bytes, pos, name);
  std::map<char, std::vector<std::pair<std::string, std::string>>> records;
  for (uint64_t i = 0; i < count; ++i) {
    if (pos >= end) throw InputError(name + ": truncated export file");
    const char tag = bytes[pos++];
    const uint64_t key_size = read_u64(bytes, pos, name);
    if (key_size > end - pos) throw InputError(name + ": truncated export file");
    std::string key = bytes.substr(pos, key_size);
    pos += key_size;
    const uint64_t value_size = read_u64(bytes, pos, name);
    if (value_size > end - pos) throw InputError(name + ": truncated export file");
    std::string value = bytes.substr(pos, value_size);
    pos += value_size;
    std::string problem;
    if (tag == 'l') {
      problem = check_latent_record(value);
    } else if (tag == 't') {
      problem = check_text_record(value);
    } else if (tag == 'm') {
      wire::Manifest manifest;
      if (!manifest.ParseFromString(value)) problem = "not a manifest";
    } else {
      throw InputError(name + ": record " + std::to_string(i) + " has the unknown tag '" +
                       std::string(1, tag) + "' (an export of a newer lorapipe?)");
    }
    if (!problem.empty()) throw InputError(name + ": record " + key + " is corrupt: " + problem);
    records[tag].emplace_back(std::move(key), std::move(value));
  }
  Store store = open_store(options, /*read_only=*/false);
  store.put(Table::kLatents, records['l']);
  store.put(Table::kTexts, records['t']);
  store.put(Table::kManifests, records['m']);  // last: a manifest never points at nothing
  out << "imported " << records['l'].size() << " latents, " << records['t'].size()
      << " texts and " << records['m'].size() << " manifest from " << name << "\n";
}

}  // namespace lorapipe::cacher
