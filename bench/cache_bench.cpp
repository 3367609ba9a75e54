// Cache store reads at SD1.5 512x512 size: N latent records (mean and std, 4x64x64 fp16) in a
// fresh LMDB store, then random batches of 16 read and parsed into their tensors. Prints
// records/s and bytes per image (record and on disk). bench/cache_bench.py runs this next to
// kohya-style per-image .npz files read with numpy.load, and prints the ratio. Not a test.
//   cache_bench DIR [records=512] [batches=400]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "cacher/keys.h"
#include "cacher/store.h"
#include "proto/lorapipe.pb.h"

int main(int argc, char** argv) {
  namespace c = lorapipe::cacher;
  if (argc < 2) {
    std::fprintf(stderr, "usage: cache_bench DIR [records] [batches]\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  const int records = argc > 2 ? std::atoi(argv[2]) : 512;
  const int batches = argc > 3 ? std::atoi(argv[3]) : 400;
  std::filesystem::remove_all(dir);
  c::StoreOptions options;
  options.dir = dir;
  std::vector<std::string> keys;
  uint64_t record_bytes = 0;
  {
    c::Store store = c::Store::open(options);
    std::mt19937 rng(0);
    std::vector<std::pair<std::string, std::string>> batch;
    for (int i = 0; i < records; ++i) {
      lorapipe::wire::LatentRecord r;
      r.set_format_version(c::kRecordFormatVersion);
      for (auto* t : {r.mutable_mean(), r.mutable_std()}) {
        t->set_dtype(lorapipe::wire::Tensor::F16);
        for (int64_t d : {4, 64, 64}) t->add_shape(d);
        std::string data(4 * 64 * 64 * 2, '\0');
        for (char& ch : data) ch = static_cast<char>(rng());
        t->set_data(std::move(data));
      }
      r.mutable_bucket()->set_width(512);
      r.mutable_bucket()->set_height(512);
      keys.push_back(c::latent_key(std::to_string(i) + ".transform", "fingerprint"));
      batch.emplace_back(keys.back(), r.SerializeAsString());
      record_bytes += batch.back().second.size();
    }
    store.put(c::Table::kLatents, batch);
  }
  c::StoreOptions read_options = options;
  read_options.read_only = true;
  const c::Store store = c::Store::open(read_options);
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> pick(0, records - 1);
  auto read_batches = [&](int n) {
    size_t checked = 0;
    for (int b = 0; b < n; ++b) {
      std::vector<std::string> batch;
      for (int k = 0; k < 16; ++k) batch.push_back(keys[pick(rng)]);
      for (const auto& value : store.get_many(c::Table::kLatents, batch)) {
        lorapipe::wire::LatentRecord r;
        if (!value || !r.ParseFromString(*value)) std::abort();
        checked += r.mean().data().size() + r.std().data().size();
      }
    }
    return checked;
  };
  read_batches(batches / 4);  // warm the page cache, as the npz side is warmed
  const auto start = std::chrono::steady_clock::now();
  read_batches(batches);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::error_code ec;
  const auto file_bytes = std::filesystem::file_size(dir / "data.mdb", ec);
  std::printf("lorapipe_store %.0f records/s, %.0f bytes/record, %.0f bytes on disk/record\n",
              batches * 16 / seconds, static_cast<double>(record_bytes) / records,
              static_cast<double>(file_bytes) / records);
  return 0;
}
