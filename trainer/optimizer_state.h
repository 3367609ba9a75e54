#pragma once
// What the optimizers ported from Python packages (Prodigy, DAdaptAdam, Lion, Adafactor, CAME,
// AdamWScheduleFree) share:
// their parameter groups, the checks of the D-Adaptation family, and per-parameter state in one
// LibTorch archive per save, parameter `index` of group `group` keeping each tensor under
// "g<group>_<index>_<name>". For .cpp files that already include LibTorch.

#include <torch/serialize.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "trainer/optimizer.h"

namespace lorapipe::trainer {

std::string state_key(size_t group, size_t index, const std::string& name);

// Writes `archive` to `file`, every write checked: a full disk or a file-size limit is an Error
// naming the file. (LibTorch's own file writer finds a failed write only in a destructor, and
// ends the process there with std::terminate; so the archive is serialised in memory first.)
void save_archive(torch::serialize::OutputArchive& archive, const std::filesystem::path& file);

// Parameter groups, each with its rate and one State per parameter; zero_grad is torch's
// set_to_none=True, which these packages' optimizers get from kohya. A State has
// `bool initialised`, `int64_t step` and `tensors()`, its tensors by name (undefined: unused).
template <typename State>
class GroupedOptimizer : public Optimizer {
 public:
  struct Group {
    std::vector<at::Tensor> params;
    double lr;
    std::vector<State> state;
  };
  explicit GroupedOptimizer(std::vector<ParamGroup> groups) {
    for (ParamGroup& g : groups) {
      const size_t n = g.params.size();
      groups_.push_back(Group{std::move(g.params), g.lr, std::vector<State>(n)});
    }
  }
  void zero_grad() override {
    for (Group& g : groups_) {
      for (at::Tensor& p : g.params) p.mutable_grad() = at::Tensor();
    }
  }
  size_t group_count() const override { return groups_.size(); }
  void set_lr(size_t group, double lr) override { groups_.at(group).lr = lr; }
  double lr(size_t group) const override { return groups_.at(group).lr; }

  // The state: the optimizer's scalars(), then every parameter's step (-1: no state yet) and
  // defined tensors. Loading reads each tensor onto its parameter's device and lets
  // check_loaded() verify it; any mismatch is an InputError naming the file.
  void save(const std::filesystem::path& file) const override {
    torch::serialize::OutputArchive archive;
    std::vector<double> values;
    for (double* v : const_cast<GroupedOptimizer*>(this)->scalars()) values.push_back(*v);
    archive.write("scalars", torch::tensor(values, torch::kFloat64));
    save_states(archive);
    save_archive(archive, file);
  }
  void load(const std::filesystem::path& file) override {
    load_state_archive(file, name(), [&](torch::serialize::InputArchive& archive) {
      at::Tensor values;
      archive.read("scalars", values);
      const std::vector<double*> targets = scalars();
      TORCH_CHECK(values.numel() == static_cast<int64_t>(targets.size()), "scalars");
      for (size_t k = 0; k < targets.size(); ++k) {
        *targets[k] = values[static_cast<int64_t>(k)].item<double>();
      }
      loaded_scalars();
      load_states(archive, [&](const at::Tensor& p, const State& s) { check_loaded(p, s); });
    });
  }

 protected:
  // For errors: "Prodigy", ...
  virtual std::string name() const = 0;
  // The optimizer's own numbers that are state (a step-size estimate, a step count), as doubles;
  // loaded_scalars() then turns those it keeps otherwise back into their own form.
  virtual std::vector<double*> scalars() { return {}; }
  virtual void loaded_scalars() {}
  // Throws c10::Error when a loaded state does not fit its parameter.
  virtual void check_loaded(const at::Tensor& /*param*/, const State& /*state*/) const {}

  // Every parameter's step (-1: no state yet) and defined tensors.
  void save_states(torch::serialize::OutputArchive& archive) const {
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (size_t i = 0; i < groups_[g].state.size(); ++i) {
        State s = groups_[g].state[i];  // tensors() hands out pointers; a copy shares the data
        archive.write(state_key(g, i, "step"), torch::tensor(s.initialised ? s.step : -1));
        if (!s.initialised) continue;
        for (const auto& [name, t] : s.tensors()) {
          if (t->defined()) archive.write(state_key(g, i, name), t->cpu());
        }
      }
    }
  }
  // Reads them back, each tensor onto its parameter's device; `check` then verifies a loaded
  // state against its parameter (throwing c10::Error, which load_state_archive names the file
  // for).
  void load_states(torch::serialize::InputArchive& archive,
                   const std::function<void(const at::Tensor& param, const State&)>& check) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (size_t i = 0; i < groups_[g].state.size(); ++i) {
        State& s = groups_[g].state[i];
        const at::Tensor& p = groups_[g].params[i];
        at::Tensor step;
        archive.read(state_key(g, i, "step"), step);
        s = State{};
        if (step.item<int64_t>() < 0) continue;
        s.initialised = true;
        s.step = step.item<int64_t>();
        for (const auto& [name, t] : s.tensors()) {
          if (archive.try_read(state_key(g, i, name), *t)) *t = t->to(p.device());
        }
        check(p, s);
      }
    }
  }

  double top_lr() const {
    double top = 0;
    for (const Group& g : groups_) top = std::max(top, g.lr);
    return top;
  }
  std::vector<Group> groups_;
};

// The checks prodigyopt and dadaptation make (d0 > 0, eps > 0, betas in [0, 1), a rate > 0),
// and their rule that one step size serves every group: the groups' rates must be equal, or 0.
// Throws InputError naming the value or the group.
void check_d_adaptation(const OptimizerOptions& options, const std::vector<ParamGroup>& groups,
                        const std::string& optimizer);

// Opens `file` and hands it to `read`; any failure, in the file or in `read`, becomes an
// InputError naming the file and `optimizer`.
void load_state_archive(const std::filesystem::path& file, const std::string& optimizer,
                        const std::function<void(torch::serialize::InputArchive&)>& read);

}  // namespace lorapipe::trainer
