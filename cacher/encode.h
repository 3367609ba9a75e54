#pragma once
// The cacher's model work: VAE latents of decoded images, bucket by bucket, and text-encoder
// outputs of captions. Records leave as serialized protobuf (wire::LatentRecord /
// wire::TextRecord), ready for the store.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "models/diffusion_model.h"
#include "proto/lorapipe.pb.h"

namespace lorapipe::cacher {

// kohya's alpha mask at latent size: `alpha` [H, W] uint8 as float32 / 255, averaged over each
// cell of the [height, width] grid (F.interpolate(mode="area")). Returns [height, width] float32.
at::Tensor latent_mask(const at::Tensor& alpha, int64_t height, int64_t width);

struct EncodedRecord {
  std::string key;
  std::string record;    // serialized; empty when rejected
  std::string rejected;  // why, e.g. "latent has NaN or Inf"
};

// Encodes images with the model family's VAE. Stores the latent distribution (mean and std, fp16)
// so the trainer can draw a fresh sample every epoch, and the flipped image's distribution when
// the sample asks for flip_aug. `model` must outlive the encoder.
class LatentEncoder {
 public:
  LatentEncoder(models::DiffusionModel& model, std::string fingerprint);

  // `batch`: samples of one bucket, with pixels. One record per sample, in order.
  std::vector<EncodedRecord> encode(const std::vector<const wire::ImageSample*>& batch);

  const std::string& fingerprint() const { return fingerprint_; }

  // Testing: the next this many encode() calls run out of memory as CUDA's allocator does (a
  // transient failure: another process held the card), through the same c10 error.
  std::atomic<int> out_of_memory_for_testing{0};

 private:
  models::DiffusionModel& model_;
  std::string fingerprint_;
};

// Encodes captions through the model family's text encoding: the hidden states the denoiser
// attends to (clip skip applied; kohya's chunks of 75 tokens up to `max_token_length`) and the
// pooled output, fp16. Throws InputError when the model has no tokenizer. `model` must outlive
// the encoder.
class TextEncoder {
 public:
  TextEncoder(models::DiffusionModel& model, std::string fingerprint, int clip_skip,
              int max_token_length = 75);

  std::vector<EncodedRecord> encode(const std::vector<std::string>& captions);

  const std::string& fingerprint() const { return fingerprint_; }

 private:
  models::DiffusionModel& model_;
  std::string fingerprint_;
  int clip_skip_;
  int max_token_length_;
};

// `encoder.encode`, and where the device runs out of memory (models::is_out_of_memory) the
// batch's halves instead, down to single items: an item that alone does not fit is rejected
// ("out of memory"), every other one is encoded, and the run goes on (kohya stops it). A batch
// too large for a small card costs a slower encode, not the run. Other errors propagate.
std::vector<EncodedRecord> encode_fitting(LatentEncoder& encoder,
                                          const std::vector<const wire::ImageSample*>& batch);
std::vector<EncodedRecord> encode_fitting(TextEncoder& encoder,
                                          const std::vector<std::string>& captions);

}  // namespace lorapipe::cacher
