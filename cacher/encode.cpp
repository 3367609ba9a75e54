#include "cacher/encode.h"

#include <torch/torch.h>

#include <bit>

#include "cacher/keys.h"
#include "common/error.h"
#include "common/log.h"
#include "models/device.h"

namespace lorapipe::cacher {
namespace {

// Records hold tensors' bytes as memory holds them, and the format says little-endian: a cache is
// shared between machines, so a big-endian build must byte-swap here first.
static_assert(std::endian::native == std::endian::little,
              "records are written from host memory: add a byte swap for big-endian hosts");

// A tensor as a record: fp16, row-major, little-endian.
void to_record_tensor(const torch::Tensor& tensor, wire::Tensor* out) {
  const torch::Tensor half = tensor.detach().to(torch::kCPU, torch::kHalf).contiguous();
  out->set_dtype(wire::Tensor::F16);
  for (int64_t d : half.sizes()) out->add_shape(d);
  out->set_data(static_cast<const char*>(half.data_ptr()), half.nbytes());
}

// A float32 tensor as a record (the masks, kept exact).
void to_record_tensor_f32(const torch::Tensor& tensor, wire::Tensor* out) {
  const torch::Tensor full = tensor.detach().to(torch::kCPU, torch::kFloat).contiguous();
  out->set_dtype(wire::Tensor::F32);
  for (int64_t d : full.sizes()) out->add_shape(d);
  out->set_data(static_cast<const char*>(full.data_ptr()), full.nbytes());
}

bool finite(const torch::Tensor& t) {
  return torch::isfinite(t.to(torch::kHalf).to(torch::kFloat)).all().item<bool>();
}

// encode_fitting's halving, for either encoder: `encode` a span of items, `key` of one item, and
// `what` names one in the log.
template <typename Item, typename Encode, typename Key, typename What>
std::vector<EncodedRecord> encode_in_halves(const std::vector<Item>& items, const Encode& encode,
                                            const Key& key, const What& what) {
  try {
    return encode(items);
  } catch (const std::exception& e) {
    if (!models::is_out_of_memory(e)) throw;
    const std::string first_line = std::string(e.what()).substr(0, std::string(e.what()).find('\n'));
    if (items.size() == 1) {
      LP_LOG(kWarning, "cacher") << what(items.front()) << ": out of memory alone ("
                                 << first_line << ")";
      EncodedRecord rejected;
      rejected.key = key(items.front());
      rejected.rejected = "out of memory: it does not fit the device alone (" + first_line + ")";
      return {std::move(rejected)};
    }
    LP_LOG(kWarning, "cacher") << "a batch of " << items.size() << " from " << what(items.front())
                               << " ran out of memory; encoding it in halves (a smaller batch "
                                  "size avoids the retry)";
  }
  const auto middle = items.begin() + static_cast<std::ptrdiff_t>(items.size() / 2);
  std::vector<EncodedRecord> out =
      encode_in_halves(std::vector<Item>(items.begin(), middle), encode, key, what);
  std::vector<EncodedRecord> second =
      encode_in_halves(std::vector<Item>(middle, items.end()), encode, key, what);
  for (EncodedRecord& r : second) out.push_back(std::move(r));
  return out;
}

}  // namespace

std::vector<EncodedRecord> encode_fitting(LatentEncoder& encoder,
                                          const std::vector<const wire::ImageSample*>& batch) {
  return encode_in_halves(
      batch, [&](const std::vector<const wire::ImageSample*>& b) { return encoder.encode(b); },
      [&](const wire::ImageSample* s) { return latent_key(s->image_key(), encoder.fingerprint()); },
      [](const wire::ImageSample* s) { return s->path(); });
}

std::vector<EncodedRecord> encode_fitting(TextEncoder& encoder,
                                          const std::vector<std::string>& captions) {
  return encode_in_halves(
      captions, [&](const std::vector<std::string>& c) { return encoder.encode(c); },
      [&](const std::string& c) { return text_key(c, encoder.fingerprint()); },
      [](const std::string& c) { return "the caption \"" + c + "\""; });
}

at::Tensor latent_mask(const at::Tensor& alpha, int64_t height, int64_t width) {
  // kohya: alpha.astype(float32) / 255, then F.interpolate(mode="area") to the loss's size,
  // which is adaptive average pooling.
  const torch::Tensor mask = alpha.to(torch::kFloat).div(255.0f).unsqueeze(0).unsqueeze(0);
  return torch::adaptive_avg_pool2d(mask, {height, width}).squeeze(0).squeeze(0);
}

LatentEncoder::LatentEncoder(models::DiffusionModel& model, std::string fingerprint)
    : model_(model), fingerprint_(std::move(fingerprint)) {}

std::vector<EncodedRecord> LatentEncoder::encode(
    const std::vector<const wire::ImageSample*>& batch) {
  std::vector<EncodedRecord> out;
  if (batch.empty()) return out;
  if (out_of_memory_for_testing.load() > 0) {
    --out_of_memory_for_testing;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "testing: out of memory (--test_oom_latent_batches)");
  }
  const int64_t width = batch[0]->bucket().width();
  const int64_t height = batch[0]->bucket().height();
  const size_t bytes = static_cast<size_t>(width * height * 3);
  torch::Tensor pixels =
      torch::empty({static_cast<int64_t>(batch.size()), height, width, 3}, torch::kUInt8);
  for (size_t i = 0; i < batch.size(); ++i) {
    const wire::ImageSample& s = *batch[i];
    if (s.bucket().width() != width || s.bucket().height() != height ||
        s.pixels().size() != bytes) {
      throw InputError("cacher: " + s.path() + ": " + std::to_string(s.pixels().size()) +
                       " pixel bytes for a " + std::to_string(s.bucket().width()) + "x" +
                       std::to_string(s.bucket().height()) + " sample in a " +
                       std::to_string(width) + "x" + std::to_string(height) + " batch");
    }
    std::memcpy(pixels[static_cast<int64_t>(i)].data_ptr(), s.pixels().data(), bytes);
  }
  // uint8 HWC in [0, 255] -> float NCHW in [-1, 1], as diffusers' VaeImageProcessor does: in
  // fp32, then rounded once to the VAE's dtype (in bf16 the division and subtraction would round
  // twice more, up to twice the input error kohya's and diffusers' caches have).
  const auto parameter = model_.vae_module().parameters().front();
  torch::Tensor images = pixels.permute({0, 3, 1, 2})
                             .to(parameter.device(), torch::kFloat)
                             .div(127.5)
                             .sub(1.0)
                             .to(parameter.scalar_type());
  bool any_flip = false;
  for (const auto* s : batch) any_flip |= s->flip();
  torch::NoGradGuard no_grad;
  const models::ImageLatents dist = model_.encode_images(images);
  std::optional<models::ImageLatents> flipped;
  if (any_flip) flipped = model_.encode_images(torch::flip(images, {3}));

  for (size_t i = 0; i < batch.size(); ++i) {
    const wire::ImageSample& s = *batch[i];
    const int64_t k = static_cast<int64_t>(i);
    EncodedRecord record;
    record.key = latent_key(s.image_key(), fingerprint_);
    const torch::Tensor mean = dist.mean[k].to(torch::kFloat);
    const torch::Tensor std = dist.std[k].to(torch::kFloat);
    if (!finite(mean) || !finite(std) ||
        (s.flip() && (!finite(flipped->mean[k]) || !finite(flipped->std[k])))) {
      record.rejected = "latent has NaN or Inf values (the VAE overflowed on this image)";
      out.push_back(std::move(record));
      continue;
    }
    wire::LatentRecord latent;
    latent.set_format_version(kRecordFormatVersion);
    to_record_tensor(mean, latent.mutable_mean());
    to_record_tensor(std, latent.mutable_std());
    if (s.flip()) {
      to_record_tensor(flipped->mean[k], latent.mutable_flipped_mean());
      to_record_tensor(flipped->std[k], latent.mutable_flipped_std());
    }
    if (!s.alpha_mask().empty()) {
      char* bytes = const_cast<char*>(s.alpha_mask().data());
      const torch::Tensor alpha = torch::from_blob(bytes, {height, width}, torch::kUInt8);
      to_record_tensor_f32(latent_mask(alpha, mean.size(1), mean.size(2)), latent.mutable_mask());
      if (s.flip()) {
        to_record_tensor_f32(latent_mask(torch::flip(alpha, {1}), mean.size(1), mean.size(2)),
                             latent.mutable_flipped_mask());
      }
    }
    *latent.mutable_bucket() = s.bucket();
    *latent.mutable_original_size() = s.original_size();
    *latent.mutable_crop_ltrb() = s.crop_ltrb();
    latent.set_vae_fingerprint(fingerprint_);
    record.record = latent.SerializeAsString();
    out.push_back(std::move(record));
  }
  return out;
}

TextEncoder::TextEncoder(models::DiffusionModel& model, std::string fingerprint, int clip_skip,
                         int max_token_length)
    : model_(model),
      fingerprint_(std::move(fingerprint)),
      clip_skip_(clip_skip),
      max_token_length_(max_token_length) {
  if (!model_.has_tokenizer()) {
    throw InputError(
        "cacher: the model has no tokenizer: pass --tokenizer (a diffusers "
        "tokenizer/ folder, a merges.txt or bpe_simple_vocab_16e6.txt.gz)");
  }
}

std::vector<EncodedRecord> TextEncoder::encode(const std::vector<std::string>& captions) {
  std::vector<EncodedRecord> out;
  if (captions.empty()) return out;
  torch::NoGradGuard no_grad;
  const models::Conditioning result =
      model_.encode_text(model_.tokenize(captions, max_token_length_), clip_skip_);
  const torch::Tensor& hidden = result.hidden_states;
  const bool pooled = result.pooled.defined();  // SD1.x's CLIP has one; not every family will
  for (size_t i = 0; i < captions.size(); ++i) {
    const int64_t k = static_cast<int64_t>(i);
    EncodedRecord record;
    record.key = text_key(captions[i], fingerprint_);
    if (!finite(hidden[k]) || (pooled && !finite(result.pooled[k]))) {
      record.rejected = "text encoding has NaN or Inf values";
      out.push_back(std::move(record));
      continue;
    }
    wire::TextRecord text;
    text.set_format_version(kRecordFormatVersion);
    // Where the denoiser never attends to the masked-out states (FLUX.1 with
    // --apply_t5_attn_mask), only those up to the mask's last 1 are kept: the trainer pads the
    // rest with zeros, which the mask hides.
    int64_t kept = hidden.size(1);
    if (result.mask.defined() && model_.padding_is_masked()) {
      const torch::Tensor on = result.mask[k].nonzero();
      kept = on.numel() == 0 ? 1 : on.max().item<int64_t>() + 1;
    }
    to_record_tensor(hidden[k].narrow(0, 0, kept), text.mutable_hidden_states());
    if (pooled) to_record_tensor(result.pooled[k], text.mutable_pooled());
    if (result.mask.defined()) to_record_tensor(result.mask[k], text.mutable_mask());
    text.set_clip_skip(clip_skip_);
    text.set_text_encoder_fingerprint(fingerprint_);
    record.record = text.SerializeAsString();
    out.push_back(std::move(record));
  }
  return out;
}

}  // namespace lorapipe::cacher
