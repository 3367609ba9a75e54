// ProdigyParity, LionParity, AdafactorParity, DAdaptAdamParity, CameParity, ScheduleFreeParity:
// lorapipe's ports against the PyPI packages kohya loads for them (prodigyopt, lion-pytorch,
// transformers, dadaptation, came-pytorch, schedulefree) (trainer/reference/optimizer_reference.py), on the same
// parameters, gradients and learning-rate schedule. Tolerance: none. The ports run the same
// LibTorch kernels on the same fp32 tensors in the same order, and keep the packages' Python
// floats as doubles, so every parameter (and Prodigy's every step-size estimate) must be equal
// bit for bit; a reordered sum or a scalar rounded to fp32 shows up as a difference.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>

#include "common/error.h"
#include "kernels/cuda_device.h"
#include "models/parity_util.h"
#include "models/safetensors.h"
#include "models/weights.h"
#include "tests/paths.h"
#include "trainer/device_scalars.h"
#include "trainer/lora_file.h"
#include "trainer/optimizer.h"

namespace lorapipe::trainer {
namespace {

namespace fs = std::filesystem;

struct OptimizerCase {
  std::string type;               // --optimizer_type, and the reference's class
  std::string reference;          // the reference's class where its name differs
  std::vector<std::string> args;  // --optimizer_args
  nlohmann::json kwargs;          // the same, as the package's constructor takes them
  bool second_group_frozen = false;  // the text-encoder group at lr 0 throughout
  double lr = 1.0;                   // the peak learning rate (Prodigy's usual 1)
};

// Parameters shaped as a LoRA's (a down, an all-zero up as kohya initialises it, a 3x3 conv's
// down) in two groups; gradients drawn for each step, one parameter left without a gradient at
// step 3; a warm-up then a cosine-like decay of the rate, as kohya's schedule sets it.
void run_case(const OptimizerCase& c, const std::string& tag) {
  SCOPED_TRACE(tag);
  constexpr int kSteps = 12;
  torch::manual_seed(5);
  std::vector<torch::Tensor> initial{torch::randn({4, 32}) * 0.1, torch::zeros({48, 4}),
                                     torch::randn({2, 8, 3, 3}) * 0.1, torch::randn({16}) * 0.1};
  const std::vector<std::vector<int>> groups{{0, 1}, {2, 3}};
  std::map<std::string, torch::Tensor> inputs;
  for (size_t i = 0; i < initial.size(); ++i) inputs["param." + std::to_string(i)] = initial[i];
  std::vector<torch::Tensor> directions;
  for (const torch::Tensor& t : initial) directions.push_back(torch::randn_like(t));
  std::vector<std::vector<torch::Tensor>> grads(kSteps);
  std::vector<double> lrs;
  for (int s = 0; s < kSteps; ++s) {
    lrs.push_back(c.lr * (s < 2 ? 0.5 * (s + 1) : 0.5 * (1 + std::cos(M_PI * (s - 2) / kSteps))));
    for (size_t i = 0; i < initial.size(); ++i) {
      // A steady direction with noise on it, as a loss gives: the distance travelled along the
      // gradients is what makes Prodigy's d grow.
      torch::Tensor g = (directions[i] + 0.5 * torch::randn_like(initial[i])) * (0.01 * (i + 1));
      if (s == 3 && i == 2) g = torch::Tensor();
      if (g.defined()) inputs["grad." + std::to_string(s) + "." + std::to_string(i)] = g;
      grads[s].push_back(g);
    }
  }
  std::vector<double> frozen(kSteps, 0.0);
  inputs["lr.0"] = torch::tensor(lrs, torch::kFloat64);
  inputs["lr.1"] = torch::tensor(c.second_group_frozen ? frozen : lrs, torch::kFloat64);

  const fs::path dir = models::testing::make_temp_dir("optimizer-" + tag);
  write_lora_file(dir / "inputs.safetensors", inputs, {});
  nlohmann::json config;
  config["optimizer"] = c.reference.empty() ? c.type : c.reference;
  config["kwargs"] = c.kwargs;
  config["groups"] = groups;
  config["steps"] = kSteps;
  std::ofstream(dir / "config.json") << config.dump(2);
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
  const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                              "/trainer/reference/optimizer_reference.py --inputs " +
                              (dir / "inputs.safetensors").string() + " --config " +
                              (dir / "config.json").string() + " --out " +
                              (dir / "out.safetensors").string();
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const auto reference =
      models::read_tensors(models::SafetensorsFile::open(dir / "out.safetensors"));

  OptimizerOptions options;
  options.type = c.type;
  apply_optimizer_args(options, c.args);
  std::vector<torch::Tensor> params;
  for (const torch::Tensor& t : initial) params.push_back(t.clone().requires_grad_(true));
  std::vector<ParamGroup> param_groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    ParamGroup group;
    for (int i : groups[g]) group.params.push_back(params[i]);
    group.lr = g == 1 && c.second_group_frozen ? 0.0 : lrs[0];
    group.name = g == 0 ? "unet" : "text_encoder";
    param_groups.push_back(std::move(group));
  }
  const std::unique_ptr<Optimizer> optimizer = make_optimizer(options, std::move(param_groups));
  std::vector<double> ds;
  for (int s = 0; s < kSteps; ++s) {
    optimizer->set_lr(0, lrs[s]);
    optimizer->set_lr(1, c.second_group_frozen ? 0.0 : lrs[s]);
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = grads[s][i].defined() ? grads[s][i].clone() : torch::Tensor();
    }
    optimizer->step();
    if (const auto adapted = optimizer->adapted_lr(0)) ds.push_back(*adapted);  // d * lr
  }
  EXPECT_EQ(ds.empty(), !reference.count("d")) << "only Prodigy and DAdaptAdam adapt their step";
  if (reference.count("d")) {
    const torch::Tensor d = reference.at("d");
    for (size_t s = 0; s < ds.size(); ++s) {
      EXPECT_EQ(ds[s], d[s].item<double>() * lrs[s]) << "d * lr after step " << s + 1;
    }
    EXPECT_GT(d[kSteps - 1].item<double>(), 2 * d[0].item<double>())
        << "d never grew: the test shows little of the estimate";
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& expected = reference.at("param." + std::to_string(i));
    EXPECT_TRUE(torch::equal(params[i].detach(), expected))
        << "param " << i << ": max |difference| "
        << (params[i].detach() - expected).abs().max().item<double>();
    // (A group at lr 0 adds nothing to Prodigy's d and its moments stay zero, but prodigyopt
    // still applies weight decay, and with beta1 0 the raw gradient, to it; matched as it is.)
    if (!(c.second_group_frozen && i >= 2)) {
      EXPECT_FALSE(torch::equal(params[i].detach(), initial[i])) << "param " << i << " never moved";
    }
  }
  // A schedule-free optimizer's average (eval()), and its training point again (train()).
  for (const std::string mode : {"eval", "train"}) {
    if (!reference.count(mode + ".0")) continue;
    mode == "eval" ? optimizer->eval() : optimizer->train();
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& expected = reference.at(mode + "." + std::to_string(i));
      EXPECT_TRUE(torch::equal(params[i].detach(), expected))
          << "param " << i << " after " << mode << "(): max |difference| "
          << (params[i].detach() - expected).abs().max().item<double>();
    }
  }
  EXPECT_EQ(reference.count("eval.0") > 0, c.type == "AdamWScheduleFree")
      << "only the schedule-free optimizer switches its weights";
  if (!::testing::Test::HasFailure()) {
    std::printf("[%s] %s: %d steps, every parameter bit-identical\n", c.type.c_str(),
                tag.c_str(), kSteps);
  }
  if (!std::getenv("LORAPIPE_KEEP")) fs::remove_all(dir);
}

// kohya's common Prodigy arguments: decoupled weight decay, bias correction, warm-up safeguard,
// d_coef 2.
TEST(ProdigyParity, KohyasUsualArgumentsMatchProdigyoptBitForBit) {
  OptimizerCase c;
  c.type = "Prodigy";
  c.args = {"decouple=True", "weight_decay=0.01", "use_bias_correction=True",
            "safeguard_warmup=True", "d_coef=2", "betas=0.9,0.99"};
  c.kwargs = {{"decouple", true},          {"weight_decay", 0.01},
              {"use_bias_correction", true}, {"safeguard_warmup", true},
              {"d_coef", 2.0},             {"betas", {0.9, 0.99}}};
  run_case(c, "usual");
}

// The other branches: L2 weight decay in the gradient, no first moment (beta1 0), a growth
// limit, beta3 and d0 given, every third element for the estimate, and a group held at lr 0.
TEST(ProdigyParity, OtherBranchesMatchProdigyoptBitForBit) {
  OptimizerCase c;
  c.type = "Prodigy";
  c.args = {"decouple=False", "weight_decay=0.1", "betas=0,0.999", "growth_rate=1.5",
            "beta3=0.95", "d0=1e-5", "slice_p=3", "eps=1e-6"};
  c.kwargs = {{"decouple", false}, {"weight_decay", 0.1}, {"betas", {0.0, 0.999}},
              {"growth_rate", 1.5}, {"beta3", 0.95},      {"d0", 1e-5},
              {"slice_p", 3},      {"eps", 1e-6}};
  c.second_group_frozen = true;
  run_case(c, "branches");
}

// lion-pytorch's Lion as kohya builds it: sign of the interpolated momentum, decoupled weight
// decay scaled by the rate, at a Lion-sized rate (kohya users give it a tenth of AdamW's).
TEST(LionParity, MatchesLionPytorchBitForBit) {
  OptimizerCase c;
  c.type = "Lion";
  c.args = {"weight_decay=0.1", "betas=0.95,0.98"};
  c.kwargs = {{"weight_decay", 0.1}, {"betas", {0.95, 0.98}}};
  c.lr = 1e-4;
  run_case(c, "lion");
  c.args = {};
  c.kwargs = nlohmann::json::object();
  c.second_group_frozen = true;
  run_case(c, "lion_defaults");
}

// transformers' Adafactor as kohya's SDXL presets run it: a fixed, scheduled rate, no parameter
// scaling, factored moments for the matrices and the conv kernel, a full one for the vector.
TEST(AdafactorParity, KohyasPresetMatchesTransformersBitForBit) {
  OptimizerCase c;
  c.type = "Adafactor";
  c.args = {"scale_parameter=False", "relative_step=False", "warmup_init=False"};
  c.kwargs = {{"scale_parameter", false}, {"relative_step", false}, {"warmup_init", false}};
  c.lr = 1e-3;
  run_case(c, "adafactor_preset");
}

// Adafactor's own step size (kohya's default: relative_step, the rates unused), scaled by each
// parameter's RMS (a 0-d fp32 tensor in transformers, multiplied as one), with a first moment,
// weight decay and a tighter update clip; and the relative step with warm-up.
TEST(AdafactorParity, RelativeStepMatchesTransformersBitForBit) {
  OptimizerCase c;
  c.type = "Adafactor";
  c.args = {"beta1=0.9", "weight_decay=0.01", "clip_threshold=0.5", "eps=1e-30,1e-3"};
  c.kwargs = {{"beta1", 0.9}, {"weight_decay", 0.01}, {"clip_threshold", 0.5},
              {"eps", {1e-30, 1e-3}}};
  run_case(c, "adafactor_relative");
  c.args = {"warmup_init=True", "decay_rate=-0.5"};
  c.kwargs = {{"warmup_init", true}, {"relative_step", true}, {"decay_rate", -0.5}};
  run_case(c, "adafactor_warmup");
}

// came-pytorch's CAME as kohya loads it (--optimizer_type=came_pytorch.CAME) with the arguments
// its users give it (weight decay 0.04, came-pytorch's betas and eps spelled out), factored
// moments for the matrices and the conv kernel, a whole one for the vector; then its defaults
// with a group at lr 0 and a tighter clip.
TEST(CameParity, MatchesCamePytorchBitForBit) {
  OptimizerCase c;
  c.type = "came_pytorch.CAME";
  c.reference = "CAME";
  c.args = {"weight_decay=0.04", "betas=0.9,0.999,0.9999", "eps=1e-30,1e-16"};
  c.kwargs = {{"weight_decay", 0.04}, {"betas", {0.9, 0.999, 0.9999}}, {"eps", {1e-30, 1e-16}}};
  c.lr = 1e-4;
  run_case(c, "came");
  c.args = {"clip_threshold=0.5"};
  c.kwargs = {{"clip_threshold", 0.5}};
  c.second_group_frozen = true;
  run_case(c, "came_defaults");

  // kohya's ss_optimizer: the class's module path and the arguments as given.
  auto make = [](const std::string& type, std::vector<std::string> args) {
    OptimizerOptions o;
    o.type = type;
    apply_optimizer_args(o, args);
    return make_optimizer(o, {ParamGroup{{torch::zeros({2}).requires_grad_()}, 1e-4, "unet"}});
  };
  EXPECT_EQ(make("came_pytorch.CAME", {"weight_decay=0.04", "eps=1e-30,1e-16"})->describe(),
            "came_pytorch.CAME.CAME(weight_decay=0.04,eps=(1e-30, 1e-16))");
  // What came-pytorch cannot take is refused by name before a step: two betas (it indexes
  // three), one eps (it indexes two); and a third beta to an optimizer of two.
  for (const auto& [type, args, says] :
       std::vector<std::tuple<std::string, std::vector<std::string>, std::string>>{
           {"CAME", {"betas=0.9,0.999"}, "CAME's are three, b1,b2,b3"},
           {"CAME", {"eps=1e-30"}, "CAME's is a pair, eps=1e-30,1e-16"},
           {"CAME", {"betas=0.9,0.999,1.5"}, "CAME's must lie in [0, 1]"},
           {"AdamW", {"betas=0.9,0.999,0.9999"}, "AdamW takes two, b1,b2"}}) {
    try {
      make(type, args);
      ADD_FAILURE() << type << " took " << args[0];
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  }
}

// schedulefree's AdamWScheduleFree as kohya builds it (put in train mode at once): its own
// warm-up and weight decay taken at y, as kohya's users give it; then its defaults with another
// average weighting (r, weight_lr_power), other betas and a group at lr 0. The parameters after
// the steps (y), after eval() (x, the model kohya saves) and after train() again.
TEST(ScheduleFreeParity, MatchesSchedulefreeBitForBit) {
  OptimizerCase c;
  c.type = "AdamWScheduleFree";
  c.args = {"weight_decay=0.01", "warmup_steps=4"};
  c.kwargs = {{"weight_decay", 0.01}, {"warmup_steps", 4}};
  c.lr = 1e-3;
  run_case(c, "schedulefree");
  c.args = {"r=1", "weight_lr_power=1", "betas=0.95,0.99", "eps=1e-6"};
  c.kwargs = {{"r", 1.0}, {"weight_lr_power", 1.0}, {"betas", {0.95, 0.99}}, {"eps", 1e-6}};
  c.second_group_frozen = true;
  run_case(c, "schedulefree_weighting");
}

// A state saved with the average in the weights (as every save leaves them) resumes exactly:
// the resumed optimizer's train() and steps give what the run that saved it gives, bit for bit.
// A step in eval mode is refused rather than taken at the average.
TEST(ScheduleFreeParity, StateSavedAtTheAverageResumesExactly) {
  auto make = [](std::vector<at::Tensor> params) {
    OptimizerOptions options;
    options.type = "AdamWScheduleFree";
    apply_optimizer_args(options, {"warmup_steps=2", "weight_decay=0.1"});
    return make_optimizer(options, {ParamGroup{std::move(params), 1e-2, "unet"}});
  };
  torch::manual_seed(8);
  std::vector<at::Tensor> grads;
  for (int s = 0; s < 6; ++s) grads.push_back(torch::randn({4, 16}));
  at::Tensor p = (torch::randn({4, 16}) * 0.1).requires_grad_(true);
  const std::unique_ptr<Optimizer> run = make({p});
  auto step = [&](Optimizer& o, at::Tensor& param, int s) {
    o.train();
    param.mutable_grad() = grads[s].clone();
    o.step();
    o.zero_grad();
  };
  for (int s = 0; s < 3; ++s) step(*run, p, s);
  run->eval();
  const fs::path dir = models::testing::make_temp_dir("optimizer-schedulefree");
  run->save(dir / "optimizer.pt");
  at::Tensor saved = p.detach().clone().requires_grad_(true);
  EXPECT_THROW({
    p.mutable_grad() = grads[3].clone();
    run->step();
  }, Error);
  p.mutable_grad() = at::Tensor();
  for (int s = 3; s < 6; ++s) step(*run, p, s);

  const std::unique_ptr<Optimizer> resumed = make({saved});
  resumed->load(dir / "optimizer.pt");
  for (int s = 3; s < 6; ++s) step(*resumed, saved, s);
  EXPECT_TRUE(torch::equal(saved.detach(), p.detach()))
      << "max |difference| " << (saved.detach() - p.detach()).abs().max().item<double>();
  fs::remove_all(dir);
}

// dadaptation's DAdaptAdam: decoupled decay with bias correction; then decay in the gradient
// (its default form), a growth limit, d0 given and a group at lr 0.
TEST(DAdaptAdamParity, MatchesDadaptationBitForBit) {
  OptimizerCase c;
  c.type = "DAdaptAdam";
  c.args = {"decouple=True", "weight_decay=0.01", "use_bias_correction=True"};
  c.kwargs = {{"decouple", true}, {"weight_decay", 0.01}, {"use_bias_correction", true}};
  c.reference = "DAdaptAdam";
  run_case(c, "dadapt");
  c.args = {"weight_decay=0.1", "growth_rate=1.5", "d0=1e-5", "betas=0.8,0.99"};
  c.kwargs = {{"weight_decay", 0.1}, {"growth_rate", 1.5}, {"d0", 1e-5}, {"betas", {0.8, 0.99}}};
  c.second_group_frozen = true;
  run_case(c, "dadapt_branches");
}

// ss_optimizer's arguments as kohya's get_optimizer writes them: each value through Python's
// ast.literal_eval into a dict (a key given twice keeps its first place, its last value), then
// ",".join(f"{k}={v}") — computed here by Python itself. Adafactor gets kohya's relative_step
// default, and warmup_init turns it on.
TEST(OptimizerName, ArgumentsArePrintedAsKohyasLiteralEvalPrintsThem) {
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
  OptimizerOptions o;
  o.given_args = {"weight_decay=1e-2", "betas=0.9,0.99", "decouple=True", "d_coef=2",
                  "eps=1e-08",         "d0=0.000001",    "growth_rate=10.", "betas=[0.8, 0.95]",
                  "use_bias_correction=False", "slice_p=11", "beta3=(0.5)"};
  const fs::path dir = models::testing::make_temp_dir("optimizer-name");
  std::ofstream(dir / "args.json") << nlohmann::json(o.given_args).dump();
  std::ofstream(dir / "kohya.py") << R"(import ast, json, sys
kwargs = {}
for arg in json.load(open(sys.argv[1])):
    key, value = arg.split("=")
    kwargs[key] = ast.literal_eval(value)
print(",".join(f"{k}={v}" for k, v in kwargs.items()))
)";
  const std::string command = std::string(python) + " " + (dir / "kohya.py").string() + " " +
                              (dir / "args.json").string();
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr) << command;
  char line[1024] = {};
  ASSERT_NE(std::fgets(line, sizeof line, pipe), nullptr) << command;
  ASSERT_EQ(::pclose(pipe), 0) << command;
  std::string kohya = line;
  kohya.erase(kohya.find_last_not_of('\n') + 1);
  EXPECT_EQ(kohya_optimizer_name("prodigyopt.prodigy.Prodigy", o),
            "prodigyopt.prodigy.Prodigy(" + kohya + ")");
  OptimizerOptions none;
  EXPECT_EQ(kohya_optimizer_name("torch.optim.adamw.AdamW", none), "torch.optim.adamw.AdamW");

  auto adafactor = [](std::vector<std::string> args) {
    OptimizerOptions a;
    a.type = "Adafactor";
    apply_optimizer_args(a, args);
    return make_optimizer(a, {ParamGroup{{torch::zeros({2}).requires_grad_()}, 1e-3, "unet"}})
        ->describe();
  };
  EXPECT_EQ(adafactor({}), "transformers.optimization.Adafactor(relative_step=True)");
  EXPECT_EQ(adafactor({"scale_parameter=False", "relative_step=False", "warmup_init=False"}),
            "transformers.optimization.Adafactor(scale_parameter=False,relative_step=False,"
            "warmup_init=False)");
  EXPECT_EQ(adafactor({"relative_step=False", "warmup_init=True"}),
            "transformers.optimization.Adafactor(relative_step=True,warmup_init=True)");
}

// A saved state resumed under another optimizer or other arguments is refused naming the file,
// not half-loaded: Prodigy's state under Lion, and under Prodigy with another slice_p.
TEST(OptimizerState, StateOfAnotherOptimizerOrSettingIsRefusedNamingTheFile) {
  auto make = [](const std::string& type, std::vector<std::string> args) {
    OptimizerOptions options;
    options.type = type;
    apply_optimizer_args(options, args);
    torch::manual_seed(3);
    std::vector<ParamGroup> groups{{{torch::randn({4, 9}).requires_grad_(true)}, 1.0, "unet"}};
    std::unique_ptr<Optimizer> o = make_optimizer(options, groups);
    groups[0].params[0].mutable_grad() = torch::randn({4, 9});
    o->step();
    return o;
  };
  const fs::path dir = models::testing::make_temp_dir("optimizer-state");
  const fs::path file = dir / "prodigy.pt";
  make("Prodigy", {})->save(file);
  EXPECT_NO_THROW(make("Prodigy", {})->load(file));
  for (const auto& [type, args] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"Lion", {}}, {"Prodigy", {"slice_p=3"}}, {"DAdaptAdam", {}}, {"Adafactor", {}},
           {"CAME", {}}, {"AdamWScheduleFree", {}}}) {
    try {
      make(type, args)->load(file);
      ADD_FAILURE() << type << " took Prodigy's state";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(file.string()), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

// zero_grad frees the gradients, whichever optimizer: a gradient kept from one step to the next
// would sit beside the next forward's activations at the step's peak (on SDXL's rank-16 LoRA, 163
// MiB; AdamW8bit kept them until 2026-12). The next step's gradients, at new addresses, are
// used: a second step after zero_grad moves the weights again.
TEST(OptimizerState, ZeroGradFreesTheGradientsOfEveryOptimizer) {
  for (const std::string type : {"AdamW", "AdamW8bit", "PagedAdamW8bit", "Prodigy", "DAdaptAdam",
                                 "Lion", "Adafactor", "CAME", "AdamWScheduleFree"}) {
    OptimizerOptions options;
    options.type = type;
    torch::manual_seed(5);
    // 8192 elements: past AdamW8bit's min_8bit_size, so its quantised state is the one stepped.
    std::vector<ParamGroup> groups{{{torch::randn({64, 128}).requires_grad_(true)}, 1e-2, "unet"}};
    at::Tensor& p = groups[0].params[0];
    std::unique_ptr<Optimizer> o = make_optimizer(options, groups);
    for (int step = 0; step < 2; ++step) {
      const at::Tensor before = p.detach().clone();
      p.mutable_grad() = torch::randn({64, 128});
      o->step();
      EXPECT_FALSE(torch::equal(p.detach(), before)) << type << ", step " << step + 1;
      o->zero_grad();
      EXPECT_FALSE(p.grad().defined()) << type << " kept the gradient after zero_grad";
    }
  }
}

// Prodigy's, DAdaptAdam's and the max-norm pass's sums read their per-tensor scalars together
// (trainer/device_scalars.h): each value must be exactly what .item<double>() reads of it, in
// order, from fp32, fp16 and bf16 scalars side by side (joined in the widest, which is exact).
TEST(OptimizerState, ScalarsReadTogetherEqualEachItem) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  if (torch::cuda::is_available()) devices.emplace_back(c10::kCUDA, 0);  // tests/gpu/run.sh
  for (const c10::Device& device : devices) {
    torch::manual_seed(9);
    std::vector<at::Tensor> scalars;
    for (int i = 0; i < 300; ++i) {
      const c10::ScalarType dtype = i % 3 == 0 ? torch::kFloat : i % 3 == 1 ? torch::kHalf
                                                                             : torch::kBFloat16;
      scalars.push_back(
          (torch::dot(torch::randn({7}), torch::randn({7})) * 1e3).to(device, dtype));
    }
    const std::vector<double> values = read_scalars(scalars);
    ASSERT_EQ(values.size(), scalars.size()) << device;
    for (size_t i = 0; i < scalars.size(); ++i) {
      EXPECT_EQ(values[i], scalars[i].item<double>()) << "scalar " << i << " on " << device;
    }
  }
  EXPECT_TRUE(read_scalars({}).empty());
}

// A LoRA module that module_dropout drops for a step leaves its tensors without gradients: every
// optimizer leaves them alone that step, as torch's do, and steps them again after. On CUDA too
// (tests/gpu/run.sh): AdamW8bit's kernel plan keeps its table through it (it once refused the
// step, a table of another size).
TEST(OptimizerState, AParameterWithoutAGradientForAStepIsLeftAlone) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  if (torch::cuda::is_available()) devices.emplace_back(c10::kCUDA, 0);
  for (const c10::Device& device : devices) {
    for (const std::string type : {"AdamW", "AdamW8bit", "PagedAdamW8bit", "Prodigy",
                                   "DAdaptAdam", "Lion", "Adafactor", "CAME",
                                   "AdamWScheduleFree"}) {
      const std::string what = type + " on " + device.str();
      OptimizerOptions options;
      options.type = type;
      torch::manual_seed(6);
      std::vector<ParamGroup> groups{{{torch::randn({64, 128}).to(device).requires_grad_(true),
                                       torch::randn({16, 8}).to(device).requires_grad_(true)},
                                      1e-2, "unet"}};
      at::Tensor& a = groups[0].params[0];
      at::Tensor& b = groups[0].params[1];
      std::unique_ptr<Optimizer> o = make_optimizer(options, groups);
      for (int step = 0; step < 3; ++step) {
        const at::Tensor a_before = a.detach().clone(), b_before = b.detach().clone();
        a.mutable_grad() = torch::randn({64, 128}).to(device);
        if (step != 1) b.mutable_grad() = torch::randn({16, 8}).to(device);
        ASSERT_NO_THROW(o->step()) << what << ", step " << step + 1;
        EXPECT_FALSE(torch::equal(a.detach(), a_before)) << what << ", step " << step + 1;
        EXPECT_EQ(torch::equal(b.detach(), b_before), step == 1) << what << ", step " << step + 1;
        o->zero_grad();
      }
    }
  }
}

TEST(ProdigyParity, RefusesWhatProdigyoptRefuses) {
  auto make = [](std::vector<std::string> args, double lr0, double lr1) {
    OptimizerOptions options;
    options.type = "prodigy";
    apply_optimizer_args(options, args);
    std::vector<ParamGroup> groups(2);
    groups[0] = {{torch::zeros({2}, torch::requires_grad())}, lr0, "unet"};
    groups[1] = {{torch::zeros({2}, torch::requires_grad())}, lr1, "text_encoder"};
    return make_optimizer(options, std::move(groups));
  };
  EXPECT_NO_THROW(make({}, 1.0, 0.0));
  EXPECT_THROW(make({}, 1.0, 0.5), InputError);  // one step size for every group
  EXPECT_THROW(make({"d0=0"}, 1.0, 1.0), InputError);
  EXPECT_THROW(make({"slice_p=0"}, 1.0, 1.0), InputError);
  EXPECT_THROW(make({"decouple=maybe"}, 1.0, 1.0), InputError);
  OptimizerOptions adamw;
  apply_optimizer_args(adamw, {"d_coef=2"});
  std::vector<ParamGroup> groups{{{torch::zeros({2}, torch::requires_grad())}, 1e-4, "unet"}};
  try {
    make_optimizer(adamw, std::move(groups));
    ADD_FAILURE() << "AdamW took Prodigy's d_coef";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("d_coef"), std::string::npos) << e.what();
  }
}

// A build configured without nvcc has no 8-bit kernels for CUDA: the 8-bit AdamWs on a CUDA
// device are refused by name before the run, the CPU keeps its reference, AdamW runs anywhere.
// (This machine's build has the kernels, so the refusal branch runs where nvcc was absent.)
TEST(AdamW8bitDevice, OnCudaOnlyWhereThisBuildHasTheKernels) {
  const c10::Device cuda("cuda:0"), cpu("cpu");
  for (const char* type : {"AdamW8bit", "pagedadamw8bit", "bitsandbytes.optim.AdamW8bit"}) {
    OptimizerOptions options;
    options.type = type;
    EXPECT_NO_THROW(check_optimizer_device(options, cpu)) << type;
    if (kernels::built_with_cuda()) {
      EXPECT_NO_THROW(check_optimizer_device(options, cuda)) << type;
    } else {
      try {
        check_optimizer_device(options, cuda);
        ADD_FAILURE() << type << " on CUDA without the kernels was not refused";
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find("nvcc"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(type), std::string::npos) << e.what();
      }
    }
  }
  OptimizerOptions adamw;
  EXPECT_NO_THROW(check_optimizer_device(adamw, cuda));
  // kohya's 32-bit paged AdamWs are AdamW (their state paged, their update AdamW's).
  for (const char* type : {"PagedAdamW", "PagedAdamW32bit"}) {
    OptimizerOptions paged;
    paged.type = type;
    EXPECT_NO_THROW(check_optimizer_device(paged, cuda));
    const auto optimizer =
        make_optimizer(paged, {ParamGroup{{torch::zeros({2}).requires_grad_()}, 1e-3, "unet"}});
    EXPECT_EQ(optimizer->describe(), "torch.optim.adamw.AdamW") << type;
  }
}

}  // namespace
}  // namespace lorapipe::trainer
