// lorapipe-preprocess as a real process streaming to a receiving endpoint over ipc://: this test
// plays the cacher (REP for Hello/HasKeys, PULL for ImageSample/DatasetReport) and checks every
// message that arrives, down to the pixels of the demo dataset.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "preprocess/bucket.h"
#include "preprocess/demo_dataset.h"
#include "proto/wire.h"
#include "tests/paths.h"
#include "tests/process_util.h"

namespace lorapipe {
namespace {
namespace fs = std::filesystem;
using std::chrono::milliseconds;

using testing::read_text;
using testing::wait_exit;

pid_t spawn(const std::vector<std::string>& argv, const fs::path& stderr_path) {
  return testing::spawn(argv, "/dev/null", stderr_path);
}

class PreprocessStream : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("lorapipe-stream-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    demo_ = preprocess::write_demo_dataset(dir_ / "data");
    push_ = "ipc://" + (dir_ / "pull.sock").string();
    rep_ = "ipc://" + (dir_ / "rep.sock").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::vector<std::string> preprocess_args(int timeout_ms) const {
    return {LORAPIPE_PREPROCESS_BIN,
            "--data_dir=" + (dir_ / "data").string(),
            "--push=" + push_,
            "--request=" + rep_,
            "--threads=2",
            "--timeout_ms=" + std::to_string(timeout_ms)};
  }

  // A run of preprocess with `extra` flags against a stand-in cacher (real sockets) that answers
  // HasKeys with `present(key)`: every sample and the report it sent, and its exit code. A
  // --dataset_config among `extra` takes the place of --data_dir.
  struct Stream {
    std::vector<wire::ImageSample> samples;
    std::optional<wire::DatasetReport> report;
    int exit_code = -1;
    uint64_t rejected = 0;
  };
  Stream stream(const std::vector<std::string>& extra,
                const std::function<bool(const std::string&)>& present) const {
    zmq::context_t context;
    wire::SocketOptions options;
    zmq::socket_t rep = wire::make_socket(context, zmq::socket_type::rep, options);
    rep.bind(rep_);
    zmq::socket_t pull = wire::make_socket(context, zmq::socket_type::pull, options);
    pull.bind(push_);
    wire::Dispatcher cacher("cacher");
    cacher.on_request<wire::HasKeysRequest>([&](const wire::HasKeysRequest& request) {
      auto reply = std::make_unique<wire::HasKeysReply>();
      for (const std::string& key : request.keys()) reply->add_present(present(key));
      return reply;
    });
    std::vector<std::string> args = preprocess_args(10000);
    for (const std::string& flag : extra) {  // a dataset TOML replaces --data_dir
      if (flag.rfind("--dataset_config=", 0) == 0) args.erase(args.begin() + 1);
    }
    args.insert(args.end(), extra.begin(), extra.end());
    const pid_t pid = spawn(args, dir_ / "stderr.txt");
    Stream out;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!out.report && std::chrono::steady_clock::now() < give_up) {
      cacher.poll_once(rep, milliseconds(10), /*reply=*/true);
      wire::Received received = wire::receive(pull, milliseconds(10));
      if (const auto* sample = received.as<wire::ImageSample>()) out.samples.push_back(*sample);
      if (const auto* r = received.as<wire::DatasetReport>()) out.report = *r;
      if (received.status == wire::ReceiveStatus::kRejected) ++out.rejected;
    }
    out.exit_code = wait_exit(pid);
    out.rejected += cacher.rejected();
    return out;
  }

  fs::path dir_;
  std::vector<preprocess::DemoImage> demo_;
  std::string push_;
  std::string rep_;
};

TEST_F(PreprocessStream, EveryMessageArrivesCheckedDownToThePixels) {
  // The "cacher" holds every third key it is asked about.
  std::set<std::string> held;
  int asked = 0;
  const Stream run = stream({}, [&](const std::string& key) {
    const bool present = asked++ % 3 == 0;
    if (present) held.insert(key);
    return present;
  });
  ASSERT_EQ(run.exit_code, 0) << read_text(dir_ / "stderr.txt");
  ASSERT_TRUE(run.report.has_value()) << "no DatasetReport arrived";
  EXPECT_EQ(run.rejected, 0u);
  const std::vector<wire::ImageSample>& samples = run.samples;
  const std::optional<wire::DatasetReport>& report = run.report;

  ASSERT_EQ(samples.size(), demo_.size());
  EXPECT_EQ(report->images_found(), demo_.size());
  EXPECT_EQ(report->images_used(), demo_.size());
  EXPECT_EQ(report->images_cached(), held.size());
  EXPECT_EQ(report->images_sent() + report->images_cached(), demo_.size());
  EXPECT_EQ(report->skipped_size(), 0);
  uint64_t bucket_total = 0;
  for (const auto& b : report->buckets()) bucket_total += b.count();
  EXPECT_EQ(bucket_total, demo_.size() * preprocess::kDemoRepeats);

  const auto kohya = preprocess::make_bucket_resolutions({512, 512}, 256, 1024, 64);
  std::map<std::string, const preprocess::DemoImage*> by_path;
  for (const auto& d : demo_) by_path[d.path.string()] = &d;
  std::set<std::string> seen;
  for (const wire::ImageSample& s : samples) {
    SCOPED_TRACE(s.path());
    ASSERT_EQ(by_path.count(s.path()), 1u);
    EXPECT_TRUE(seen.insert(s.path()).second) << "sent twice";
    const preprocess::DemoImage& demo = *by_path[s.path()];
    EXPECT_EQ(s.caption(), demo.caption);
    EXPECT_EQ(s.caption_source(), "file");
    EXPECT_EQ(s.repeats(), static_cast<uint32_t>(preprocess::kDemoRepeats));
    EXPECT_EQ(s.original_size().width(), static_cast<uint32_t>(demo.width));
    EXPECT_EQ(s.original_size().height(), static_cast<uint32_t>(demo.height));
    const preprocess::Reso bucket{static_cast<int>(s.bucket().width()),
                                  static_cast<int>(s.bucket().height())};
    EXPECT_NE(std::find(kohya.begin(), kohya.end(), bucket), kohya.end());
    EXPECT_GE(s.resized().width(), s.bucket().width());
    EXPECT_GE(s.resized().height(), s.bucket().height());
    EXPECT_EQ(s.crop_ltrb_size(), 4);
    EXPECT_EQ(s.image_key().size(), 65u);  // 32 hex . 32 hex
    if (held.count(s.image_key())) {
      EXPECT_TRUE(s.key_only());
      EXPECT_TRUE(s.pixels().empty()) << "a cached sample must not carry pixels";
      continue;
    }
    EXPECT_FALSE(s.key_only());
    ASSERT_EQ(s.pixels().size(), size_t{s.bucket().width()} * s.bucket().height() * 3);
    // The centre of the crop shows the drawn shape's colour; JPEG and resampling move a
    // flat colour by a few levels, 40 is far below the distance between any two demo colours.
    const size_t centre = (size_t{s.bucket().height() / 2} * s.bucket().width() +
                           s.bucket().width() / 2) * 3;
    for (int c = 0; c < 3; ++c) {
      EXPECT_NEAR(static_cast<unsigned char>(s.pixels()[centre + c]), demo.shape_rgb[c], 40)
          << "channel " << c;
    }
    const size_t corner = 2 * 3;  // (2, 0): background
    for (int c = 0; c < 3; ++c) {
      EXPECT_NEAR(static_cast<unsigned char>(s.pixels()[corner + c]), demo.background_rgb[c], 40)
          << "channel " << c;
    }
  }
}

// kohya's caption flags on the command line reach every sample: the prefix and suffix joined
// with a space, and the dropout settings carried for the trainer.
TEST_F(PreprocessStream, KohyaCaptionFlagsReachEverySample) {
  const Stream run = stream({"--caption_prefix=masterpiece", "--caption_suffix=high detail",
                             "--caption_tag_dropout_rate=0.25",
                             "--caption_dropout_every_n_epochs=3"},
                            [](const std::string&) { return false; });
  ASSERT_EQ(run.exit_code, 0) << read_text(dir_ / "stderr.txt");
  const std::vector<wire::ImageSample>& samples = run.samples;
  ASSERT_EQ(samples.size(), demo_.size());
  std::map<std::string, std::string> caption_of;
  for (const auto& d : demo_) caption_of[d.path.string()] = d.caption;
  for (const wire::ImageSample& s : samples) {
    EXPECT_EQ(s.caption(), "masterpiece " + caption_of.at(s.path()) + " high detail");
    EXPECT_DOUBLE_EQ(s.caption_settings().caption_tag_dropout_rate(), 0.25);
    EXPECT_EQ(s.caption_settings().caption_dropout_every_n_epochs(), 3);
  }
}

// Buckets are on by default, where kohya's are off unless --enable_bucket is given: the log says so
// to a kohya user, and not to one who gave the flag either way.
TEST_F(PreprocessStream, DefaultBucketsAreSaidToDifferFromKohyas) {
  const std::string note = "aspect-ratio buckets are on by default here";
  const Stream defaulted = stream({}, [](const std::string&) { return false; });
  ASSERT_EQ(defaulted.exit_code, 0) << read_text(dir_ / "stderr.txt");
  EXPECT_NE(read_text(dir_ / "stderr.txt").find(note), std::string::npos)
      << read_text(dir_ / "stderr.txt");
  std::set<std::pair<uint32_t, uint32_t>> buckets;
  for (const auto& s : defaulted.samples) buckets.insert({s.bucket().width(), s.bucket().height()});
  EXPECT_GT(buckets.size(), 1u) << "the demo's shapes fell into one bucket";
  // Each run's samples and report carry one stream id of its own (a serving cacher keeps
  // concurrent runs apart by it).
  std::set<std::string> streams;
  const auto expect_one_stream = [&](const Stream& run) {
    ASSERT_TRUE(run.report.has_value());
    EXPECT_FALSE(run.report->stream_id().empty());
    for (const auto& s : run.samples) ASSERT_EQ(s.stream_id(), run.report->stream_id());
    streams.insert(run.report->stream_id());
  };
  expect_one_stream(defaulted);
  for (const char* flag : {"--enable_bucket", "--enable_bucket=false"}) {
    const Stream given = stream({flag}, [](const std::string&) { return false; });
    ASSERT_EQ(given.exit_code, 0) << read_text(dir_ / "stderr.txt");
    EXPECT_EQ(read_text(dir_ / "stderr.txt").find(note), std::string::npos) << flag;
    expect_one_stream(given);
  }
  EXPECT_EQ(streams.size(), 3u) << "two runs shared a stream id";
}

// --alpha_mask: every sample carries its alpha at bucket size (the demo images have none: fully
// opaque), and another image key than without it, so the cache keeps both kinds of record.
TEST_F(PreprocessStream, AlphaMaskTravelsWithEverySample) {
  const Stream masked = stream({"--alpha_mask"}, [](const std::string&) { return false; });
  ASSERT_EQ(masked.exit_code, 0) << read_text(dir_ / "stderr.txt");
  const Stream plain = stream({}, [](const std::string&) { return false; });
  ASSERT_EQ(plain.exit_code, 0) << read_text(dir_ / "stderr.txt");
  std::map<std::string, std::string> plain_key;
  for (const wire::ImageSample& s : plain.samples) {
    plain_key[s.path()] = s.image_key();
    EXPECT_TRUE(s.alpha_mask().empty());
  }
  ASSERT_EQ(masked.samples.size(), demo_.size());
  for (const wire::ImageSample& s : masked.samples) {
    EXPECT_EQ(s.alpha_mask(), std::string(size_t{s.bucket().width()} * s.bucket().height(), '\xff'))
        << s.path();
    EXPECT_NE(s.image_key(), plain_key.at(s.path()));
  }
}

// kohya's --resize_interpolation names the filter: "nearest" is --resize_filter=nearest, pixels
// and cache keys alike; "area", which libvips has no kernel for, is refused by name.
TEST_F(PreprocessStream, KohyaResizeInterpolationIsTheResizeFilter) {
  const Stream kohya =
      stream({"--resize_interpolation=nearest"}, [](const std::string&) { return false; });
  ASSERT_EQ(kohya.exit_code, 0) << read_text(dir_ / "stderr.txt");
  const Stream ours = stream({"--resize_filter=nearest"}, [](const std::string&) { return false; });
  ASSERT_EQ(ours.exit_code, 0) << read_text(dir_ / "stderr.txt");
  const Stream lanczos = stream({}, [](const std::string&) { return false; });
  ASSERT_EQ(lanczos.exit_code, 0) << read_text(dir_ / "stderr.txt");
  std::map<std::string, const wire::ImageSample*> by_path, default_by_path;
  for (const wire::ImageSample& s : ours.samples) by_path[s.path()] = &s;
  for (const wire::ImageSample& s : lanczos.samples) default_by_path[s.path()] = &s;
  ASSERT_EQ(kohya.samples.size(), demo_.size());
  size_t other_pixels = 0;
  for (const wire::ImageSample& s : kohya.samples) {
    EXPECT_EQ(s.image_key(), by_path.at(s.path())->image_key());
    EXPECT_EQ(s.pixels(), by_path.at(s.path())->pixels());
    EXPECT_NE(s.image_key(), default_by_path.at(s.path())->image_key());
    other_pixels += s.pixels() != default_by_path.at(s.path())->pixels();
  }
  EXPECT_GT(other_pixels, 0u) << "nearest resizes otherwise than lanczos3";
  std::vector<std::string> area = preprocess_args(10000);
  area.push_back("--resize_interpolation=area");
  EXPECT_NE(wait_exit(spawn(area, dir_ / "stderr.txt")), 0) << "refused before any image";
  EXPECT_NE(read_text(dir_ / "stderr.txt").find("--resize_interpolation 'area'"),
            std::string::npos)
      << read_text(dir_ / "stderr.txt");
}

// kohya's caption separators, wildcards and token warm-up on the command line reach every
// sample. A caption that draws nothing is final (its secondary separator replaced) and cached;
// one that draws is left for the trainer's process_caption.
TEST_F(PreprocessStream, KohyaCaptionSeparatorsReachEverySample) {
  const std::vector<std::string> separators{"--secondary_separator= on ", "--caption_separator=;",
                                            "--keep_tokens_separator=|||", "--enable_wildcard"};
  const Stream fixed = stream(separators, [](const std::string&) { return false; });
  ASSERT_EQ(fixed.exit_code, 0) << read_text(dir_ / "stderr.txt");
  std::vector<std::string> warmup = separators;
  warmup.insert(warmup.end(), {"--token_warmup_step=0.5", "--token_warmup_min=2"});
  const Stream drawn = stream(warmup, [](const std::string&) { return false; });
  ASSERT_EQ(drawn.exit_code, 0) << read_text(dir_ / "stderr.txt");
  std::map<std::string, std::string> caption_of;
  for (const auto& d : demo_) caption_of[d.path.string()] = d.caption;
  ASSERT_EQ(fixed.samples.size(), demo_.size());
  ASSERT_EQ(drawn.samples.size(), demo_.size());
  for (const wire::ImageSample& s : fixed.samples) {
    const std::string& caption = caption_of.at(s.path());  // "a red circle on a blue background"
    const size_t on = caption.find(" on ");
    ASSERT_NE(on, std::string::npos) << caption;
    EXPECT_EQ(s.caption(), caption.substr(0, on) + ";" + caption.substr(on + 4));
    EXPECT_FALSE(s.augment_caption()) << "no braces, one line: nothing to draw";
    EXPECT_EQ(s.caption_settings().caption_separator(), ";");
    EXPECT_EQ(s.caption_settings().keep_tokens_separator(), "|||");
    EXPECT_EQ(s.caption_settings().secondary_separator(), " on ");
    EXPECT_TRUE(s.caption_settings().enable_wildcard());
    // What the LoRA's ss_tag_frequency counts: the caption as read, in its folder's name.
    EXPECT_EQ(s.caption_read(), caption);
    EXPECT_EQ(s.subset_name(), preprocess::kDemoFolder);
  }
  for (const wire::ImageSample& s : drawn.samples) {
    EXPECT_EQ(s.caption(), caption_of.at(s.path())) << "left for the trainer";
    EXPECT_TRUE(s.augment_caption());
    EXPECT_DOUBLE_EQ(s.caption_settings().token_warmup_step(), 0.5);
    EXPECT_EQ(s.caption_settings().token_warmup_min(), 2);
  }
}

// kohya's skip_image_resolution leaves out an image whose area is at most the given size (the
// small copies of a multi-resolution dataset): by flag, and per dataset in a TOML (which wins).
TEST_F(PreprocessStream, SkipImageResolutionLeavesOutTheSmallImagesByArea) {
  int64_t smallest = -1;
  for (const auto& image : demo_) {
    const int64_t area = int64_t{image.width} * image.height;
    if (smallest < 0 || area < smallest) smallest = area;
  }
  size_t at_most = 0;
  std::string skip;
  // A width,height whose area is the smallest image's: that one (and any of its area) goes.
  for (const auto& image : demo_) {
    if (int64_t{image.width} * image.height == smallest) {
      skip = std::to_string(image.height) + "," + std::to_string(image.width);  // turned: by area
    }
  }
  for (const auto& image : demo_) at_most += int64_t{image.width} * image.height <= smallest;
  ASSERT_GT(at_most, 0u);
  ASSERT_LT(at_most, demo_.size());
  const Stream run = stream({"--skip_image_resolution=" + skip}, [](const std::string&) { return false; });
  ASSERT_EQ(run.exit_code, 0) << read_text(dir_ / "stderr.txt");
  EXPECT_EQ(run.samples.size(), demo_.size() - at_most);
  for (const wire::ImageSample& s : run.samples) {
    EXPECT_GT(int64_t{s.original_size().width()} * s.original_size().height(), smallest) << s.path();
  }
  EXPECT_NE(read_text(dir_ / "stderr.txt").find("no larger than skip_image_resolution"),
            std::string::npos);
  // A dataset TOML's own value wins over the flag: 1 leaves every image in.
  const fs::path config = dir_ / "skip.toml";
  std::ofstream(config) << "[[datasets]]\nskip_image_resolution = 1\n[[datasets.subsets]]\n"
                        << "image_dir = 'data/" << preprocess::kDemoFolder << "'\n";
  const Stream toml = stream({"--dataset_config=" + config.string(), "--skip_image_resolution=" + skip},
                             [](const std::string&) { return false; });
  ASSERT_EQ(toml.exit_code, 0) << read_text(dir_ / "stderr.txt");
  EXPECT_EQ(toml.samples.size(), demo_.size());
}

// kohya's old spelling, --caption_extention, still in many scripts, is taken as kohya takes it;
// with the new spelling beside it, they must agree.
TEST_F(PreprocessStream, KohyasOldCaptionExtentionSpellingIsTaken) {
  // The demo's captions are .txt files: another extension leaves the folder's class token.
  const Stream run = stream({"--caption_extention=.nothing"}, [](const std::string&) { return false; });
  ASSERT_EQ(run.exit_code, 0) << read_text(dir_ / "stderr.txt");
  ASSERT_EQ(run.samples.size(), demo_.size());
  for (const wire::ImageSample& s : run.samples) {
    EXPECT_EQ(s.caption_source(), "class_tokens") << s.path();
    EXPECT_EQ(s.caption(), "shapes") << s.path();
  }
  std::vector<std::string> both = preprocess_args(10000);
  both.insert(both.end(), {"--caption_extention=.txt", "--caption_extension=.cap"});
  EXPECT_EQ(wait_exit(spawn(both, dir_ / "stderr.txt")), 2);  // bad input (README's exit codes)
  EXPECT_NE(read_text(dir_ / "stderr.txt")
                .find("--caption_extension=.cap and --caption_extention=.txt differ"),
            std::string::npos)
      << read_text(dir_ / "stderr.txt");
}

// kohya's --in_json over --train_data_dir: the metadata's images (keys naming them below the
// folder, without extension) with its captions and tags, each --dataset_repeats times, in a
// subset named after the metadata file.
TEST_F(PreprocessStream, FineTuningMetadataFromInJson) {
  nlohmann::json metadata = nlohmann::json::object();
  std::map<std::string, std::string> caption_of;
  for (size_t i = 0; i < demo_.size(); ++i) {
    const fs::path& path = demo_[i].path;
    const std::string key = (path.parent_path().filename() / path.stem()).string();
    metadata[key] = i % 2 ? nlohmann::json{{"caption", "shape " + std::to_string(i)}}
                          : nlohmann::json{{"caption", "shape " + std::to_string(i)},
                                           {"tags", "t" + std::to_string(i) + ", x"}};
    caption_of[path.string()] =
        "shape " + std::to_string(i) + (i % 2 ? "" : ",t" + std::to_string(i) + ", x");
  }
  std::ofstream(dir_ / "meta.json") << metadata.dump();
  const Stream run =
      stream({"--in_json=" + (dir_ / "meta.json").string(), "--dataset_repeats=3"},
             [](const std::string&) { return false; });
  ASSERT_EQ(run.exit_code, 0) << read_text(dir_ / "stderr.txt");
  ASSERT_EQ(run.samples.size(), demo_.size()) << read_text(dir_ / "stderr.txt");
  for (const wire::ImageSample& s : run.samples) {
    ASSERT_TRUE(caption_of.count(s.path())) << s.path();
    EXPECT_EQ(s.caption(), caption_of.at(s.path()));
    EXPECT_EQ(s.caption_source(), "metadata");
    EXPECT_EQ(s.repeats(), 3u);
    EXPECT_EQ(s.subset_name(), "meta.json");
    const size_t comma = s.caption().find(',');
    EXPECT_EQ(s.caption_read(), comma == std::string::npos ? "" : s.caption().substr(comma + 1));
  }
}

// Each [[datasets]] of a dataset TOML travels with its index, its batch_size and its validation
// split and seed, so that the trainer batches and holds out each apart as kohya does; the same
// folder in two datasets is two datasets' worth of samples, each bucketed at its own resolution.
TEST_F(PreprocessStream, EachTomlDatasetTravelsWithItsIndexAndBatchSize) {
  const fs::path config = dir_ / "two.toml";
  std::ofstream(config) << "[general]\nmin_bucket_reso = 32\nbucket_reso_steps = 32\n"
                        << "[[datasets]]\nresolution = 64\nbatch_size = 2\n"
                        << "validation_split = 0.5\nvalidation_seed = 3\n"
                        << "  [[datasets.subsets]]\n  image_dir = 'data/" << preprocess::kDemoFolder
                        << "'\n"
                        << "[[datasets]]\nresolution = 128\n"
                        << "  [[datasets.subsets]]\n  image_dir = 'data/" << preprocess::kDemoFolder
                        << "'\n";
  std::vector<std::string> args = {"--dataset_config=" + config.string()};
  const Stream run = stream(args, [](const std::string&) { return false; });
  ASSERT_EQ(run.exit_code, 0) << read_text(dir_ / "stderr.txt");
  ASSERT_EQ(run.samples.size(), 2 * demo_.size());
  std::map<uint32_t, int> per_dataset;
  for (const wire::ImageSample& s : run.samples) {
    ++per_dataset[s.dataset_index()];
    EXPECT_EQ(s.batch_size(), s.dataset_index() == 0 ? 2u : 0u) << s.path();
    // kohya's dataset-level validation keys: the first dataset's; the second leaves the trainer's.
    EXPECT_EQ(s.has_validation_split(), s.dataset_index() == 0) << s.path();
    EXPECT_EQ(s.has_validation_seed(), s.dataset_index() == 0) << s.path();
    if (s.dataset_index() == 0) {
      EXPECT_EQ(s.validation_split(), 0.5);
      EXPECT_EQ(s.validation_seed(), 3u);
    }
    const uint32_t area = s.bucket().width() * s.bucket().height();
    EXPECT_EQ(area > 64 * 64, s.dataset_index() == 1)
        << s.path() << " in dataset " << s.dataset_index() << ": bucket " << s.bucket().width()
        << "x" << s.bucket().height();
  }
  EXPECT_EQ(per_dataset[0], static_cast<int>(demo_.size()));
  EXPECT_EQ(per_dataset[1], static_cast<int>(demo_.size()));

  // The report describes each dataset for the LoRA's metadata (kohya's ss_datasets): its
  // settings, max_bucket_reso as kohya rounds it to the steps, and kohya's mean aspect-ratio
  // error, |bucket's - image's|, over the images it bucketed.
  ASSERT_TRUE(run.report.has_value());
  const wire::DatasetSource& source = run.report->source();
  EXPECT_EQ(source.kind(), wire::DatasetSource::DATASET_CONFIG);
  ASSERT_EQ(source.datasets_size(), 2);
  std::map<uint32_t, double> error_sum;
  for (const wire::ImageSample& s : run.samples) {
    error_sum[s.dataset_index()] +=
        std::abs(double(s.bucket().width()) / s.bucket().height() -
                 double(s.original_size().width()) / s.original_size().height());
  }
  for (uint32_t d = 0; d < 2; ++d) {
    const wire::DatasetSettings& settings = source.datasets(static_cast<int>(d));
    EXPECT_EQ(settings.resolution().width(), d == 0 ? 64u : 128u);
    EXPECT_TRUE(settings.enable_bucket());
    EXPECT_EQ(settings.min_bucket_reso(), 32u);
    EXPECT_EQ(settings.max_bucket_reso(), 1024u);
    EXPECT_EQ(settings.batch_size(), d == 0 ? 2u : 0u);
    EXPECT_TRUE(settings.is_dreambooth());
    ASSERT_EQ(settings.subsets_size(), 1);
    EXPECT_EQ(settings.subsets(0).image_dir(), preprocess::kDemoFolder);
    EXPECT_EQ(settings.subsets(0).num_repeats(), 1u);
    // 1e-12: the same doubles summed in another order.
    EXPECT_NEAR(settings.mean_img_ar_error(), error_sum[d] / demo_.size(), 1e-12) << d;
  }
}

// A kohya command with a dataset config: --dataset_repeats fills num_repeats where a subset sets
// none (kohya's fallback), and --train_data_dir / --reg_data_dir beside the config are ignored
// with a warning, as kohya's train_network ignores them.
TEST_F(PreprocessStream, DatasetRepeatsFillATomlAndFolderFlagsBesideItAreIgnored) {
  const fs::path config = dir_ / "repeats.toml";
  std::ofstream(config) << "[[datasets]]\n  [[datasets.subsets]]\n  image_dir = 'data/"
                        << preprocess::kDemoFolder << "'\n";
  const Stream run = stream({"--dataset_config=" + config.string(), "--dataset_repeats=3",
                             "--train_data_dir=" + (dir_ / "elsewhere").string(),
                             "--reg_data_dir=" + (dir_ / "reg").string()},
                            [](const std::string&) { return false; });
  const std::string err = read_text(dir_ / "stderr.txt");
  ASSERT_EQ(run.exit_code, 0) << err;
  ASSERT_EQ(run.samples.size(), demo_.size());
  for (const wire::ImageSample& s : run.samples) EXPECT_EQ(s.repeats(), 3u) << s.path();
  EXPECT_NE(err.find("ignoring --train_data_dir=" + (dir_ / "elsewhere").string() +
                     ", --reg_data_dir=" + (dir_ / "reg").string()),
            std::string::npos)
      << err;
  // lorapipe's own --data_dir beside the config names two datasets: refused; and a repeat count
  // below 1 would leave every subset out.
  for (const auto& [flag, says] :
       std::vector<std::pair<std::string, std::string>>{
           {"--data_dir=" + (dir_ / "data").string(), "give exactly one of --data_dir"},
           {"--dataset_repeats=0", "--dataset_repeats=0: must be at least 1"}}) {
    const pid_t pid = spawn({LORAPIPE_PREPROCESS_BIN, "--dataset_config=" + config.string(), flag,
                             "--report_only"},
                            dir_ / "refused.txt");
    EXPECT_NE(wait_exit(pid), 0) << flag;
    const std::string refused = read_text(dir_ / "refused.txt");
    EXPECT_NE(refused.find(says), std::string::npos) << refused;
  }
}

// File and folder names the file system holds in another encoding than UTF-8 (Latin-1 here, as
// an archive made on Windows unpacks): each is skipped or not used, named with its odd byte
// written \xE9, and every other image still arrives, with a report that parses (its strings are
// UTF-8 protobuf fields, which refuse other bytes) and a --report_json that is written.
TEST_F(PreprocessStream, NamesNotInUtf8AreSkippedByNameAndTheRestArrives) {
  const fs::path folder = dir_ / "data" / preprocess::kDemoFolder;
  const fs::path latin1_image = folder / "caf\xe9.png";
  fs::copy_file(demo_[0].path, latin1_image);
  std::ofstream(folder / "caf\xe9.txt") << "a caption";
  const fs::path latin1_folder = dir_ / "data" / "2_caf\xe9";
  fs::create_directories(latin1_folder);
  fs::copy_file(demo_[1].path, latin1_folder / "b.png");
  const fs::path report_json = dir_ / "report.json";
  const Stream run =
      stream({"--report_json=" + report_json.string()}, [](const std::string&) { return false; });
  ASSERT_EQ(run.exit_code, 0) << read_text(dir_ / "stderr.txt");
  ASSERT_TRUE(run.report.has_value()) << "no DatasetReport arrived";
  EXPECT_EQ(run.rejected, 0u);
  EXPECT_EQ(run.samples.size(), demo_.size());
  const std::string escaped_image = (folder / "caf\\xE9.png").string();
  ASSERT_EQ(run.report->skipped_size(), 1);
  EXPECT_EQ(run.report->skipped(0).path(), escaped_image);
  EXPECT_NE(run.report->skipped(0).reason().find("not valid UTF-8"), std::string::npos);
  const nlohmann::json json = nlohmann::json::parse(read_text(report_json));
  ASSERT_EQ(json.at("skipped").size(), 1u);
  EXPECT_EQ(json.at("skipped")[0].at("path"), escaped_image);
  bool folder_named = false;
  for (const auto& i : json.at("ignored")) {
    folder_named |= i.at("path") == (dir_ / "data" / "2_caf\\xE9").string() &&
                    i.at("reason").get<std::string>().find("not valid UTF-8") != std::string::npos;
  }
  EXPECT_TRUE(folder_named) << json.at("ignored").dump();
}

TEST_F(PreprocessStream, NoCacherIsAClearErrorNamingTheEndpoint) {
  const pid_t pid = spawn(preprocess_args(500), dir_ / "stderr.txt");
  ASSERT_GT(pid, 0);
  EXPECT_EQ(wait_exit(pid), 2);
  const std::string err = read_text(dir_ / "stderr.txt");
  EXPECT_NE(err.find("no reply from " + rep_), std::string::npos) << err;
}

TEST_F(PreprocessStream, NoUsableImageIsAClearError) {
  const fs::path empty = dir_ / "empty";
  fs::create_directories(empty / "1_x");
  std::ofstream(empty / "1_x" / "broken.png") << "not a png";
  const pid_t pid = spawn({LORAPIPE_PREPROCESS_BIN, "--data_dir=" + empty.string(), "--report_only"},
                          dir_ / "stderr.txt");
  EXPECT_EQ(wait_exit(pid), 1);
  const std::string err = read_text(dir_ / "stderr.txt");
  EXPECT_NE(err.find("no usable image found in " + empty.string()), std::string::npos) << err;
}

}  // namespace
}  // namespace lorapipe
