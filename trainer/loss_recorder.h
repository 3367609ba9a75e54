#pragma once
// kohya's LossRecorder (library/train_util.py): the "average" loss its progress bar shows as
// avr_loss and TensorBoard as loss/average and loss/epoch. Through the first epoch, the mean of
// every loss so far; after it, the mean of one epoch's worth, each batch position's loss
// replacing the one of the epoch before (a moving window, never reset at an epoch's start).

#include <cstdint>
#include <vector>

namespace lorapipe::trainer {

struct LossRecorder {
  std::vector<double> losses;  // by batch position within an epoch
  double total = 0;            // kept as kohya keeps it: added and taken away, never summed again

  // `epoch` counts from 1 and `index` from 0 (the micro-batch's place in its epoch).
  void add(int64_t epoch, int64_t index, double loss) {
    if (epoch <= 1) {
      losses.push_back(loss);
    } else {
      if (losses.size() <= static_cast<size_t>(index)) losses.resize(index + 1, 0.0);
      total -= losses[static_cast<size_t>(index)];
      losses[static_cast<size_t>(index)] = loss;
    }
    total += loss;
  }
  bool empty() const { return losses.empty(); }
  double moving_average() const {
    return losses.empty() ? 0.0 : total / static_cast<double>(losses.size());
  }
};

}  // namespace lorapipe::trainer
