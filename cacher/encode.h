#pragma once
// The cacher's model work: VAE latents of decoded images, bucket by bucket, and text-encoder
// outputs of captions. Records leave as serialized protobuf (wire::LatentRecord /
// wire::TextRecord), ready for the store.

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <vector>

#include "models/clip_text.h"
#include "models/clip_tokenizer.h"
#include "models/vae.h"
#include "proto/lorapipe.pb.h"

namespace lorapipe::cacher {

struct EncodedRecord {
  std::string key;
  std::string record;    // serialized; empty when rejected
  std::string rejected;  // why, e.g. "latent has NaN or Inf"
};

// Encodes images with the VAE. Stores the latent distribution (mean and std, fp16) so the
// trainer can draw a fresh sample every epoch, and the flipped image's distribution when the
// sample asks for flip_aug.
class LatentEncoder {
 public:
  LatentEncoder(models::AutoencoderKL vae, std::string fingerprint);

  // `batch`: samples of one bucket, with pixels. One record per sample, in order.
  std::vector<EncodedRecord> encode(const std::vector<const wire::ImageSample*>& batch);

  const std::string& fingerprint() const { return fingerprint_; }

 private:
  models::AutoencoderKL vae_;
  std::string fingerprint_;
};

// Encodes captions with the CLIP text encoder: the hidden states the UNet attends to (clip skip
// applied, fp16) and the pooled output (fp16).
class TextEncoder {
 public:
  TextEncoder(models::ClipTextModel model, const models::ClipTokenizer* tokenizer,
              std::string fingerprint, int clip_skip);

  std::vector<EncodedRecord> encode(const std::vector<std::string>& captions);

  const std::string& fingerprint() const { return fingerprint_; }

 private:
  models::ClipTextModel model_;
  const models::ClipTokenizer* tokenizer_;
  std::string fingerprint_;
  int clip_skip_;
};

}  // namespace lorapipe::cacher
