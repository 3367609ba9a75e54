// The cacher's encoders on a device that runs out of memory: the CPU with its tensors counted and
// capped (models/tensor_memory.h), which throws the c10::OutOfMemoryError CUDA's allocator throws
// on a full card. The caps sit between what the real tiny model's encode of one item and of two
// items take, measured first, so the halving must go down to single items, whose records equal
// those of encoding each alone, byte for byte (the same work on the same CPU); under what one item
// takes, every item is rejected by name and nothing throws.
#include "cacher/encode.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "cacher/keys.h"
#include "models/parity_util.h"
#include "models/registry.h"
#include "models/tensor_memory.h"
#include "models/tiny.h"

namespace lorapipe::cacher {
namespace {

namespace fs = std::filesystem;

class CacheEncode : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    counter_ = &models::TensorMemoryCounter::install();
    dir_ = new fs::path(models::testing::make_temp_dir("cache-encode"));
    model_ = models::load_model(models::write_tiny_checkpoint(*dir_ / "model").diffusers, {})
                 .release();
  }
  static void TearDownTestSuite() {
    delete model_;
    fs::remove_all(*dir_);
    delete dir_;
  }
  void TearDown() override { counter_->set_limit(0); }

  // What `encode` takes at most beyond what is alive before it, in counted bytes.
  static size_t peak_of(const std::function<void()>& encode) {
    const size_t before = counter_->alive_bytes();
    counter_->reset_peak();
    encode();
    return counter_->peak_bytes() - before;
  }
  // Caps the counted bytes at what is alive now plus `extra`.
  static void cap(size_t extra) { counter_->set_limit(counter_->alive_bytes() + extra); }

  static inline models::TensorMemoryCounter* counter_ = nullptr;
  static inline fs::path* dir_ = nullptr;
  static inline models::DiffusionModel* model_ = nullptr;
};

std::vector<wire::ImageSample> samples(int count) {
  std::vector<wire::ImageSample> out(static_cast<size_t>(count));
  torch::manual_seed(5);
  for (int i = 0; i < count; ++i) {
    wire::ImageSample& s = out[static_cast<size_t>(i)];
    s.set_path("image" + std::to_string(i) + ".png");
    s.set_image_key("key" + std::to_string(i));
    s.mutable_bucket()->set_width(64);
    s.mutable_bucket()->set_height(64);
    *s.mutable_original_size() = s.bucket();
    s.set_channels(3);
    const torch::Tensor pixels = torch::randint(0, 256, {64, 64, 3}, torch::kUInt8);
    s.set_pixels(std::string(static_cast<const char*>(pixels.data_ptr()), pixels.nbytes()));
  }
  return out;
}

// The test of either encoder over four items: the caps sit between what one and two of them
// take, then under what one takes. `key` is the key of a rejected item.
using PeakOf = std::function<size_t(const std::function<void()>&)>;
template <typename Encoder, typename Item>
void expect_halving_then_rejection(Encoder& encoder, const std::vector<Item>& items,
                                   const std::function<std::string(const Item&)>& key,
                                   const PeakOf& peak_of, const std::function<void(size_t)>& cap) {
  (void)encoder.encode({items[0]});  // what a first call sets up once stays out of the peaks
  std::vector<EncodedRecord> alone;
  const size_t one = peak_of([&] { alone.push_back(encoder.encode({items[0]}).front()); });
  for (size_t i = 1; i < items.size(); ++i) alone.push_back(encoder.encode({items[i]}).front());
  const size_t two = peak_of([&] { (void)encoder.encode({items[0], items[1]}); });
  ASSERT_GT(two, one) << "two items take no more than one: no cap between them";

  cap((one + two) / 2);
  EXPECT_THROW((void)encoder.encode(items), c10::OutOfMemoryError) << "the cap let four through";
  const std::vector<EncodedRecord> fitted = encode_fitting(encoder, items);
  ASSERT_EQ(fitted.size(), items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    EXPECT_TRUE(fitted[i].rejected.empty()) << i << ": " << fitted[i].rejected;
    EXPECT_EQ(fitted[i].key, alone[i].key) << i;
    EXPECT_EQ(fitted[i].record, alone[i].record) << i;
  }

  cap(one / 2);
  const std::vector<EncodedRecord> none = encode_fitting(encoder, items);
  ASSERT_EQ(none.size(), items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    EXPECT_EQ(none[i].key, key(items[i])) << i;
    EXPECT_NE(none[i].rejected.find("out of memory"), std::string::npos) << none[i].rejected;
    EXPECT_TRUE(none[i].record.empty());
  }
}

TEST_F(CacheEncode, LatentBatchThatDoesNotFitIsEncodedInHalvesAndAnImageThatCannotIsRejected) {
  LatentEncoder encoder(*model_, "test-vae");
  const std::vector<wire::ImageSample> four = samples(4);
  std::vector<const wire::ImageSample*> batch;
  for (const auto& s : four) batch.push_back(&s);
  expect_halving_then_rejection<LatentEncoder, const wire::ImageSample*>(
      encoder, batch,
      [](const wire::ImageSample* const& s) { return latent_key(s->image_key(), "test-vae"); },
      peak_of, cap);
}

TEST_F(CacheEncode, CaptionBatchThatDoesNotFitIsEncodedInHalvesAndACaptionThatCannotIsRejected) {
  TextEncoder encoder(*model_, "test-text", /*clip_skip=*/1);
  const std::vector<std::string> captions = {"a red circle", "a blue square on grass",
                                             "two cats", "a photo of a dog at night"};
  expect_halving_then_rejection<TextEncoder, std::string>(
      encoder, captions, [](const std::string& c) { return text_key(c, "test-text"); }, peak_of,
      cap);
}

}  // namespace
}  // namespace lorapipe::cacher
