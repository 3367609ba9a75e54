#pragma once
// What a checkpoint is: the family guessed from its key names, tensor count, dtypes, parameter
// count per component, metadata, and rank/alpha when it is a LoRA. No LibTorch.

#include <filesystem>
#include <string>

namespace lorapipe::models {

// A multi-line human-readable description of a .safetensors file or a diffusers folder.
// Throws lorapipe::InputError with a one-line reason for anything malformed, and for pickle
// checkpoints (.ckpt, .pt, .pth, .bin), which are never loaded: they can run code.
std::string inspect_checkpoint(const std::filesystem::path& path);

}  // namespace lorapipe::models
