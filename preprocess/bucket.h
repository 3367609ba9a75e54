#pragma once
// Aspect-ratio bucketing, identical to kohya sd-scripts: make_bucket_resolutions
// (library/model_util.py) and BucketManager.select_bucket / get_crop_ltrb and the crop of
// trim_and_resize_if_required (library/train_util.py). The same inputs give the same buckets,
// resized sizes and crop values as kohya, bit for bit (its float arithmetic is double here too).

#include <optional>
#include <string>
#include <vector>

namespace lorapipe::preprocess {

struct Reso {
  int width = 0;
  int height = 0;
  auto operator<=>(const Reso&) const = default;
};

struct BucketOptions {
  Reso resolution{512, 512};  // the pixel budget, width x height
  bool enable_bucket = true;  // false: every image goes to `resolution` (kohya without buckets)
  int min_bucket_reso = 256;
  int max_bucket_reso = 1024;
  int bucket_reso_steps = 64;
  bool bucket_no_upscale = false;
};

// kohya make_bucket_resolutions: the sorted bucket set for a pixel budget, min/max side and step.
std::vector<Reso> make_bucket_resolutions(Reso max_reso, int min_size, int max_size,
                                          int divisible);

// Throws lorapipe::InputError naming the flag when the options are inconsistent (kohya asserts
// the same conditions).
void validate(const BucketOptions& options);

// kohya adjust_min_max_bucket_reso_by_steps: with buckets on, min_bucket_reso rounded down and
// max_bucket_reso rounded up to multiples of bucket_reso_steps (each change logged, as kohya
// warns). BucketSelector applies it before validating.
BucketOptions adjusted_to_steps(BucketOptions options);

struct BucketChoice {
  Reso bucket;             // the training size
  Reso resized;            // the cover size the image is resized to before the crop
  double ar_error = 0.0;   // bucket aspect ratio minus image aspect ratio
};

// Picks buckets for images of one dataset.
class BucketSelector {
 public:
  explicit BucketSelector(const BucketOptions& options);

  // kohya BucketManager.select_bucket for an image of `width` x `height` as displayed. Empty
  // with `why` set where kohya would divide by zero or make an empty bucket (extreme aspect
  // ratios, or images smaller than one step, in no-upscale mode).
  std::optional<BucketChoice> select(int width, int height, std::string* why) const;

  // The predefined buckets (empty in no-upscale mode, where buckets follow the images).
  const std::vector<Reso>& predefined() const { return resos_; }
  // The options it selects with: min and max bucket sizes adjusted to the steps.
  const BucketOptions& options() const { return options_; }

 private:
  int round_to_steps(double x) const;

  BucketOptions options_;
  std::vector<Reso> resos_;
  std::vector<double> aspect_ratios_;
};

// kohya get_crop_ltrb: crop left, top, right, bottom as SDXL conditions on them (the image fitted
// inside the bucket, Stability AI's convention). Doubles, as in kohya.
struct CropLtrb {
  double left = 0, top = 0, right = 0, bottom = 0;
};
CropLtrb get_crop_ltrb(Reso bucket, Reso image_size);

// The real crop offset into the resized image (kohya trim_and_resize_if_required): centred, or
// at `random_fraction` in [0, 1) of the slack when random cropping.
struct CropOffset {
  int left = 0;
  int top = 0;
};
CropOffset crop_offset(Reso resized, Reso bucket, std::optional<double> random_x = std::nullopt,
                       std::optional<double> random_y = std::nullopt);

// "512" -> 512x512, "768,512" -> 768x512 (width, height). Throws InputError naming the value.
Reso parse_resolution(const std::string& text);

}  // namespace lorapipe::preprocess
