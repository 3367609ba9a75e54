#include "models/tiny.h"

#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/pipeline.h"
#include "models/sdxl.h"

namespace lorapipe::models {
namespace fs = std::filesystem;

namespace {

// A few merges so the tiny tokenizer does real BPE on the demo captions' words.
constexpr const char* kTinyMerges[] = {"c i", "ci r", "cir c", "circ l", "circl e</w>", "s q",
                                       "sq u", "squ a", "squa r", "squar e</w>", "r i", "ri n",
                                       "rin g</w>", "o n</w>", "a </w>", "r e", "re d</w>"};
constexpr int kMergeCount = sizeof(kTinyMerges) / sizeof(kTinyMerges[0]);

// GPT-2 / CLIP bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to
// U+0100 onwards, so every byte has a visible symbol.
std::vector<std::string> byte_symbols() {
  std::vector<int> direct;
  for (int b = '!'; b <= '~'; ++b) direct.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) direct.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) direct.push_back(b);
  std::vector<int> code(256, -1);
  for (int b : direct) code[b] = b;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    if (code[b] < 0) code[b] = next++;
  }
  std::vector<std::string> symbols(256);
  for (int b = 0; b < 256; ++b) {
    const int c = code[b];
    std::string utf8;
    if (c < 0x80) {
      utf8.push_back(static_cast<char>(c));
    } else {
      utf8.push_back(static_cast<char>(0xC0 | (c >> 6)));
      utf8.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
    symbols[b] = utf8;
  }
  return symbols;
}

// vocab.json and merges.txt in open_clip's layout: bytes, bytes with </w>, merges, specials.
// The bytes in CLIP's order (bytes_to_unicode's: the printable ones first), so "!" is id 0 as
// in CLIP, the padding id of SDXL's second tokenizer.
void write_tiny_tokenizer(const fs::path& folder) {
  fs::create_directories(folder);
  nlohmann::ordered_json vocab;
  const auto by_byte = byte_symbols();
  std::vector<std::string> symbols;
  auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; };
  for (int b = 0; b < 256; ++b) {
    if (printable(b)) symbols.push_back(by_byte[b]);
  }
  for (int b = 0; b < 256; ++b) {
    if (!printable(b)) symbols.push_back(by_byte[b]);
  }
  int id = 0;
  for (const std::string& s : symbols) vocab[s] = id++;
  for (const std::string& s : symbols) vocab[s + "</w>"] = id++;
  std::ofstream merges(folder / "merges.txt");
  merges << "#version: 0.2\n";
  for (const char* merge : kTinyMerges) {
    std::string m = merge;
    merges << m << "\n";
    m.erase(m.find(' '), 1);
    vocab[m] = id++;
  }
  vocab["<|startoftext|>"] = id++;
  vocab["<|endoftext|>"] = id++;
  std::ofstream(folder / "vocab.json") << vocab.dump();
  nlohmann::json config{{"tokenizer_class", "CLIPTokenizer"},
                        {"model_max_length", 77},
                        {"bos_token", "<|startoftext|>"},
                        {"eos_token", "<|endoftext|>"},
                        {"unk_token", "<|endoftext|>"},
                        {"pad_token", "<|endoftext|>"},
                        {"do_lower_case", true}};
  std::ofstream(folder / "tokenizer_config.json") << config.dump(2);
  if (!merges) throw Error("cannot write the tiny tokenizer in " + folder.string());
}

}  // namespace

UNetConfig tiny_unet_config() {
  UNetConfig c;
  c.block_out_channels = {32, 64};
  c.layers_per_block = {2, 2};
  c.down_block_types = {"CrossAttnDownBlock2D", "DownBlock2D"};
  c.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D"};
  c.cross_attention_dim = 32;
  c.attention_head_dim = {4, 4};
  c.transformer_layers_per_block = {1, 1};
  // Fewer groups than channels, as in SD1.5 (320 channels in 32 groups): with one channel per
  // group, GroupNorm would cancel the per-channel time-embedding shift and leave every resnet's
  // time_emb_proj without effect or gradient.
  c.norm_num_groups = 8;
  c.sample_size = 8;
  return c;
}

VaeConfig tiny_vae_config() {
  VaeConfig c;
  c.block_out_channels = {32, 32, 32, 32};
  c.layers_per_block = 1;
  c.latent_channels = 4;
  c.norm_num_groups = 32;
  return c;
}

ClipTextConfig tiny_text_config() {
  ClipTextConfig c;
  c.vocab_size = 512 + kMergeCount + 2;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.max_position_embeddings = 77;
  return c;
}

// LibTorch initialises conv_out and norms to fixed values; draw every weight so that no part
// of a tiny model is trivially zero or one (a test would not see it miswired).
static void draw_weights(std::initializer_list<torch::nn::Module*> modules) {
  torch::NoGradGuard no_grad;
  for (torch::nn::Module* m : modules) {
    for (auto& p : m->parameters()) {
      const double fan_in = p.dim() > 1 ? static_cast<double>(p[0].numel()) : 1.0;
      p.normal_(p.dim() > 1 ? 0.0 : 0.5, 1.0 / std::sqrt(fan_in));
    }
  }
}

UNetConfig tiny_sdxl_unet_config() {
  UNetConfig c;
  c.block_out_channels = {32, 64};
  c.layers_per_block = {2, 2};
  c.down_block_types = {"DownBlock2D", "CrossAttnDownBlock2D"};
  c.up_block_types = {"CrossAttnUpBlock2D", "UpBlock2D"};
  c.cross_attention_dim = 64;
  c.attention_head_dim = {2, 4};
  c.transformer_layers_per_block = {1, 2};
  c.use_linear_projection = true;
  c.norm_num_groups = 8;
  c.sample_size = 8;
  c.addition_embed_type = "text_time";
  c.addition_time_embed_dim = 8;
  c.projection_class_embeddings_input_dim = 32 + 6 * 8;  // bigG's projection + six time ids
  return c;
}

ClipTextConfig tiny_sdxl_text_2_config() {
  ClipTextConfig c = tiny_text_config();
  c.hidden_act = "gelu";
  c.with_projection = true;
  c.projection_dim = 32;
  return c;
}

TinyCheckpoint write_tiny_sdxl_checkpoint(const fs::path& dir, uint64_t seed) {
  fs::create_directories(dir);
  TinyCheckpoint out{dir / "tiny-sdxl-diffusers", dir / "tiny-sdxl.safetensors",
                     dir / "tiny-sdxl-tokenizer"};
  write_tiny_tokenizer(out.tokenizer);
  torch::manual_seed(seed);
  StableDiffusionXL model;
  model.family = model_family("sdxl");
  model.unet = UNet(tiny_sdxl_unet_config());
  VaeConfig vae = tiny_vae_config();
  vae.scaling_factor = model.family.vae_scaling_factor;
  model.vae = AutoencoderKL(vae);
  model.text_encoder = ClipTextModel(tiny_text_config());
  model.text_encoder_2 = ClipTextModel(tiny_sdxl_text_2_config());
  draw_weights({model.unet.ptr().get(), model.vae.ptr().get(), model.text_encoder.ptr().get(),
                model.text_encoder_2.ptr().get()});
  save_sdxl_diffusers(model, out.diffusers, out.tokenizer);
  save_sdxl_single_file(model, out.single_file);
  return out;
}

TinyCheckpoint write_tiny_checkpoint(const fs::path& dir, uint64_t seed, int unet_width) {
  fs::create_directories(dir);
  TinyCheckpoint out{dir / "tiny-sd15-diffusers", dir / "tiny-sd15.safetensors",
                     dir / "tiny-sd15-tokenizer"};
  write_tiny_tokenizer(out.tokenizer);
  torch::manual_seed(seed);
  StableDiffusion model;
  model.family = model_family("sd15");
  model.unet = UNet(tiny_unet_config());
  model.vae = AutoencoderKL(tiny_vae_config());
  model.text_encoder = ClipTextModel(tiny_text_config());
  draw_weights({model.unet.ptr().get(), model.vae.ptr().get(), model.text_encoder.ptr().get()});
  if (unet_width > 0) {
    UNetConfig wide = tiny_unet_config();
    wide.block_out_channels = {unet_width, 2 * unet_width};
    model.unet = UNet(wide);
    draw_weights({model.unet.ptr().get()});
  }
  save_diffusers(model, out.diffusers, out.tokenizer);
  save_single_file(model, out.single_file);
  return out;
}

}  // namespace lorapipe::models
