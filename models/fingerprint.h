#pragma once
// Fingerprints of the weights a model actually holds: what cache keys are made of, so swapping
// a VAE or a text encoder (even under the same file name) never serves records made by another.

#include <string>

namespace torch::nn {
class Module;
}

namespace lorapipe::models {

// 32 hex digits: XXH3-128 over every parameter and buffer, in name order: name, dtype, shape and
// bytes as held now (after any dtype conversion, so fp16 and fp32 copies differ), plus `extra`
// (settings that change outputs, e.g. clip skip).
std::string weights_fingerprint(const torch::nn::Module& module, const std::string& extra = "");

}  // namespace lorapipe::models
