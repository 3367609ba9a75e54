#pragma once
// Fingerprints of the weights a model actually holds: what cache keys are made of, so swapping
// a VAE or a text encoder (even under the same file name) never serves records made by another.

#include <filesystem>
#include <string>
#include <string_view>

namespace torch::nn {
class Module;
}

namespace lorapipe::models {

// 32 hex digits: XXH3-128 over every parameter and buffer, in name order: name, dtype, shape and
// bytes as held now (after any dtype conversion, so fp16 and fp32 copies differ), plus `extra`
// (settings that change outputs, e.g. clip skip).
std::string weights_fingerprint(const torch::nn::Module& module, const std::string& extra = "");

// The same over the part of an AutoencoderKL (models/vae.h) that encodes: its encoder and quant
// conv, never the decoder. The latents' fingerprint: a VAE whose decoder alone was fine-tuned
// (sd-vae-ft-mse, baked into many SD1.5 checkpoints) encodes the same latents, so checkpoints
// that differ only there share one cache.
std::string vae_encoder_fingerprint(const torch::nn::Module& vae);

// What identifies a tokenizer in text keys: the bytes it was loaded from (vocab.json and
// merges.txt of a folder, or the one vocabulary file).
std::string tokenizer_fingerprint(const std::filesystem::path& path);
// The same for one vocabulary file given by its name and bytes (the built-in vocabulary has the
// fingerprint of the file it was built from).
std::string tokenizer_fingerprint(std::string_view file_name, std::string_view bytes);

// The settings that shape a text encoder's output, as the cacher folds them into its
// fingerprint: clip skip, max length (kohya's max_token_length: 75, one chunk, or 150 / 225 in
// chunks) and the tokenizer. The trainer recomputes them to check that cached text was made by
// the text encoder it trains with.
std::string text_encoder_settings(int clip_skip, const std::string& tokenizer_fingerprint,
                                  int max_token_length = 75);

}  // namespace lorapipe::models
