#pragma once
// The LoRA network the trainer trains: kohya sd-scripts' LoRANetwork (networks/lora.py) over a
// Stable Diffusion model, one adapter per target layer (models/sd15_lora.h) placed in that
// layer's LoRA slot, and its file format (kohya's keys, an .alpha per module, 1x1 convs 4-D).

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "models/diffusion_model.h"

namespace lorapipe::trainer {

struct NetworkOptions {
  int64_t dim = 4;        // --network_dim
  double alpha = 1.0;     // --network_alpha; 0 means dim (no scaling), as kohya
  int64_t conv_dim = 0;   // network_args conv_dim (LoCon); 0: 3x3 convs not adapted
  double conv_alpha = 1.0;
  double dropout = 0.0;         // --network_dropout
  double rank_dropout = 0.0;    // network_args rank_dropout
  double module_dropout = 0.0;  // network_args module_dropout
  double multiplier = 1.0;
  bool train_unet = true;          // false with --network_train_text_encoder_only: no U-Net modules
  bool train_text_encoder = true;  // false with --network_train_unet_only
  // network_args train_blocks (kohya's networks.lora_flux): all, single or double.
  std::string train_blocks = "all";
  // network_args split_qkv (kohya's networks.lora_flux): a fused q/k/v layer (the double
  // blocks' img_attn.qkv and txt_attn.qkv, the single blocks' linear1 with its MLP part) gets a
  // LoRA of its own per part, each of rank `dim` at alpha / dim, saved merged as kohya saves it:
  // the downs stacked, the ups block-diagonal, alpha unchanged.
  bool split_qkv = false;
  // network_args in_dims (kohya's networks.lora_flux, "[4,0,0,0,4]"): a rank for each group of
  // the family's input layers (KohyaFamilyNames::in_dims: img_in, time_in, vector_in,
  // guidance_in, txt_in), 0 for none, each at --network_alpha as kohya builds them. Empty: none.
  std::vector<int64_t> in_dims;
  // network_args of kohya's networks.lora_flux for the double and single blocks' modules: ranks
  // by kind of module (img_attn_dim, txt_attn_dim, img_mlp_dim, txt_mlp_dim, img_mod_dim,
  // txt_mod_dim, single_dim, single_mod_dim: the first given whose words the module's name holds
  // sets its rank, 0 for no module; alpha stays --network_alpha), as given; and the blocks that
  // train (train_double_block_indices / train_single_block_indices: one flag per block, empty
  // for every block), a block left out having no modules.
  std::vector<std::pair<std::string, int64_t>> type_dims;
  std::vector<bool> double_blocks, single_blocks;
  // kohya's --dim_from_weights (create_network_from_weights): each module's rank as the LoRA file
  // to continue from has it, by kohya name. When set, exactly these modules are built (3x3 convs
  // included where the file has them), and dim, alpha and conv_dim above are not used: the
  // file's alphas come with load().
  std::map<std::string, int64_t> ranks_from_weights;
  // kohya's block-wise network_args (resolve_block_args): a rank and alpha per U-Net block for
  // the Linear and 1x1 modules (block_dims/block_alphas) and for the kxk convs
  // (conv_block_dims/conv_block_alphas), and a learning-rate weight per block
  // (down/mid/up_lr_weight). Each has one item per block of the family's table
  // (KohyaFamilyNames::blocks, which gives each target its block, LoraTarget::block), or none
  // (not in use). A block of rank 0 builds no module. The text encoder's modules keep dim and alpha.
  std::vector<int64_t> block_dims, conv_block_dims;
  std::vector<double> block_alphas, conv_block_alphas;
  std::vector<double> block_lr_weight;
};


// The raw block-wise network_args, by key, as kohya's create_network takes them.
struct BlockArgs {
  std::map<std::string, std::string> values;  // block_dims, block_alphas, conv_block_dims,
                                              // conv_block_alphas, down/mid/up_lr_weight
  double zero_threshold = 0;                  // block_lr_zero_threshold
};

// kohya's create_network for the block-wise arguments: when block_dims or a *_lr_weight is
// given, every block gets dim/alpha (network_dim/network_alpha where block_dims/block_alphas are
// not given), kxk convs conv_block_dims/alphas (or conv_dim/conv_alpha, or none), and blocks
// whose weight is 0 (or at most block_lr_zero_threshold) no module. Lists must have one item per
// block of the family's `table` (SD1.x: 25); a *_lr_weight is one weight per input or output
// block (1 for mid), comma-separated, padded with 1 or cut as kohya does, or a curve: cosine,
// sine, linear, reverse_linear, zeros (each with an optional +base). Fills `options`' block
// fields; throws InputError naming the argument. Returns warnings to log.
std::vector<std::string> resolve_block_args(const BlockArgs& args, const models::KohyaBlocks& table,
                                            NetworkOptions& options);

// The rank of each module of a LoRA file (NAME -> rows of NAME.lora_down.weight), for
// NetworkOptions::ranks_from_weights. Throws InputError naming the file when it holds none.
std::map<std::string, int64_t> lora_file_ranks(const std::filesystem::path& file);

// What one max-norm pass did (kohya's apply_max_norm_regularization returns the same three).
struct MaxNormResult {
  int64_t keys_scaled = 0;  // modules scaled down
  double mean_norm = 0;     // mean over the modules of their update's norm after the pass
  double max_norm = 0;      // the largest of those norms
};

class LoraNetwork {
 public:
  struct Module {
    models::LoraTarget target;
    std::shared_ptr<models::LoraAdapter> adapter;
    double alpha = 1.0;
    // split_qkv: the output rows of each part (empty: one LoRA); the adapter then holds every
    // part's down stacked and their ups block-diagonal, its rank the parts' rank times their
    // count, its scale alpha over one part's rank.
    std::vector<int64_t> split_dims;
    int64_t scale_rank() const {
      return split_dims.empty() ? adapter->rank()
                                : adapter->rank() / static_cast<int64_t>(split_dims.size());
    }
  };

  // Builds an adapter for every layer `model` names as a LoRA target (the text encoder's too with
  // options.train_text_encoder, the kxk convolutions with conv_dim), fp32 on the layer's device,
  // initialised as kohya does: down kaiming-uniform (a = sqrt(5)), up zero, from `generator`.
  // Fills the layers' LoRA slots; the destructor empties them. Throws InputError for dim < 1 or
  // a negative alpha or dropout.
  LoraNetwork(const models::DiffusionModel& model, const NetworkOptions& options,
              at::Generator generator);
  // The constructor's checks of `options` alone, without a model: InputError for what it would
  // refuse.
  static void check(const NetworkOptions& options);
  ~LoraNetwork();
  LoraNetwork(const LoraNetwork&) = delete;
  LoraNetwork& operator=(const LoraNetwork&) = delete;

  const std::vector<Module>& modules() const { return modules_; }
  const NetworkOptions& options() const { return options_; }
  size_t unet_module_count() const;
  size_t text_encoder_module_count() const;

  // The trainable tensors (down, up of each module, in module order).
  std::vector<at::Tensor> unet_parameters() const;
  // `encoder`: only that text encoder's modules (SDXL's 0 and 1); -1: every encoder's.
  std::vector<at::Tensor> text_encoder_parameters(int encoder = -1) const;
  // Every module's down and up, keyed by kohya's tensor names ("NAME.lora_down.weight").
  std::map<std::string, at::Tensor> named_parameters() const;

  // kohya's max-norm regularization (--scale_weight_norms, networks/lora.py
  // apply_max_norm_regularization): each module's update W = up @ down * alpha / rank (for a kxk
  // conv, down convolved by up) whose Frobenius norm exceeds `max_norm` has down and up each
  // multiplied by sqrt(max_norm / |W|), so |W| becomes max_norm. In fp32 as kohya computes it.
  MaxNormResult apply_max_norm(double max_norm);

  // Dropouts act only in training.
  void set_training(bool training);
  void set_multiplier(double multiplier);

  // The file's tensors: NAME.lora_down.weight, NAME.lora_up.weight, NAME.alpha (0-d), in
  // `dtype`, on the CPU.
  std::map<std::string, at::Tensor> state_dict(c10::ScalarType dtype = c10::kFloat) const;

  // Continues from an existing LoRA (--network_weights): every module of this network is
  // loaded from `file` (ours or kohya's); a file without NAME.alpha takes alpha = its rank, as
  // kohya's old files mean. The file's modules for a side this network does not train are
  // skipped. Throws InputError naming the file and the modules that are missing, left over
  // (keys that fit no module of this model) or of another shape.
  void load(const std::filesystem::path& file);
  void load(const std::map<std::string, at::Tensor>& tensors, const std::string& source);

 private:
  NetworkOptions options_;
  std::vector<Module> modules_;
  // The model's LoRA targets this network has no module for: a side that does not train, a block
  // of rank or weight 0.
  std::set<std::string> untrained_;
};

}  // namespace lorapipe::trainer
