#include "preprocess/bucket.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <set>

#include "common/error.h"
#include "common/log.h"

namespace lorapipe::preprocess {

std::vector<Reso> make_bucket_resolutions(Reso max_reso, int min_size, int max_size,
                                          int divisible) {
  // Transcribed from kohya model_util.make_bucket_resolutions: the square bucket, then for each
  // width from min to max in steps the tallest height within the pixel budget, both ways round.
  const int64_t max_area = int64_t{max_reso.width} * max_reso.height;
  std::set<Reso> resos;
  const int square =
      static_cast<int>(std::floor(std::sqrt(static_cast<double>(max_area)) / divisible)) *
      divisible;
  resos.insert({square, square});
  for (int width = min_size; width <= max_size; width += divisible) {
    const int height = static_cast<int>(
        std::min<int64_t>(max_size, ((max_area / width) / divisible) * divisible));
    if (height >= min_size) {
      resos.insert({width, height});
      resos.insert({height, width});
    }
  }
  return {resos.begin(), resos.end()};  // sorted by (width, height), as Python sorts tuples
}

void validate(const BucketOptions& o) {
  auto fail = [](const std::string& what) { throw InputError("bucket settings: " + what); };
  if (o.resolution.width <= 0 || o.resolution.height <= 0) {
    fail("resolution must be positive, got " + std::to_string(o.resolution.width) + "," +
         std::to_string(o.resolution.height));
  }
  if (o.bucket_reso_steps <= 0) {
    fail("bucket_reso_steps must be positive, got " + std::to_string(o.bucket_reso_steps));
  }
  if (!o.enable_bucket) return;
  if (o.min_bucket_reso <= 0) {
    fail("min_bucket_reso must be positive, got " + std::to_string(o.min_bucket_reso));
  }
  if (o.max_bucket_reso < o.min_bucket_reso) {
    fail("max_bucket_reso (" + std::to_string(o.max_bucket_reso) +
         ") must be at least min_bucket_reso (" + std::to_string(o.min_bucket_reso) + ")");
  }
  if (o.max_bucket_reso < o.resolution.width || o.max_bucket_reso < o.resolution.height) {
    fail("max_bucket_reso (" + std::to_string(o.max_bucket_reso) +
         ") must be at least the resolution's width and height");
  }
  if (o.min_bucket_reso > o.resolution.width || o.min_bucket_reso > o.resolution.height) {
    fail("min_bucket_reso (" + std::to_string(o.min_bucket_reso) +
         ") must not exceed the resolution's width or height");
  }
}

BucketOptions adjusted_to_steps(BucketOptions o) {
  const int steps = o.bucket_reso_steps;
  if (!o.enable_bucket || steps <= 0) return o;
  if (o.min_bucket_reso > 0 && o.min_bucket_reso % steps != 0) {
    const int adjusted = o.min_bucket_reso - o.min_bucket_reso % steps;
    LP_LOG(kWarning, "preprocess") << "min_bucket_reso " << o.min_bucket_reso << " -> " << adjusted
                                   << ": a multiple of bucket_reso_steps " << steps << ", as kohya";
    o.min_bucket_reso = adjusted;
  }
  if (o.max_bucket_reso > 0 && o.max_bucket_reso % steps != 0) {
    const int adjusted = o.max_bucket_reso + steps - o.max_bucket_reso % steps;
    LP_LOG(kWarning, "preprocess") << "max_bucket_reso " << o.max_bucket_reso << " -> " << adjusted
                                   << ": a multiple of bucket_reso_steps " << steps << ", as kohya";
    o.max_bucket_reso = adjusted;
  }
  return o;
}

BucketSelector::BucketSelector(const BucketOptions& options)
    : options_(adjusted_to_steps(options)) {
  validate(options_);
  if (!options_.enable_bucket) {
    // kohya without buckets: one predefined size, the resolution itself.
    options_.bucket_no_upscale = false;
    resos_ = {options_.resolution};
  } else if (!options_.bucket_no_upscale) {
    resos_ = make_bucket_resolutions(options_.resolution, options_.min_bucket_reso,
                                     options_.max_bucket_reso, options_.bucket_reso_steps);
  }
  for (const Reso& r : resos_) {
    aspect_ratios_.push_back(static_cast<double>(r.width) / r.height);
  }
}

int BucketSelector::round_to_steps(double x) const {
  const int v = static_cast<int>(x + 0.5);
  return v - v % options_.bucket_reso_steps;
}

std::optional<BucketChoice> BucketSelector::select(int width, int height, std::string* why) const {
  const double aspect_ratio = static_cast<double>(width) / height;
  BucketChoice choice;
  if (!options_.bucket_no_upscale) {
    // Upscale and downscale to the predefined bucket of nearest aspect ratio; an image already
    // at a bucket's exact size keeps it. argmin takes the first of equals, in sorted order.
    const Reso exact{width, height};
    if (std::find(resos_.begin(), resos_.end(), exact) != resos_.end()) {
      choice.bucket = exact;
    } else {
      size_t best = 0;
      double best_error = std::abs(aspect_ratios_[0] - aspect_ratio);
      for (size_t i = 1; i < resos_.size(); ++i) {
        const double error = std::abs(aspect_ratios_[i] - aspect_ratio);
        if (error < best_error) {
          best = i;
          best_error = error;
        }
      }
      choice.bucket = resos_[best];
    }
    const double ar_reso = static_cast<double>(choice.bucket.width) / choice.bucket.height;
    const double scale = aspect_ratio > ar_reso
                             ? static_cast<double>(choice.bucket.height) / height
                             : static_cast<double>(choice.bucket.width) / width;
    choice.resized = {static_cast<int>(width * scale + 0.5), static_cast<int>(height * scale + 0.5)};
  } else {
    // Downscale only: images over the pixel budget shrink to it keeping their aspect ratio,
    // rounding the side whose rounding distorts the aspect ratio least; the bucket is the
    // resized size floored to the step (crop, never pad).
    const double max_area =
        static_cast<double>(options_.resolution.width) * options_.resolution.height;
    if (static_cast<double>(width) * height > max_area) {
      const double resized_width = std::sqrt(max_area * aspect_ratio);
      const double resized_height = max_area / resized_width;
      const int b_width_rounded = round_to_steps(resized_width);
      const int b_height_in_wr = round_to_steps(b_width_rounded / aspect_ratio);
      const int b_height_rounded = round_to_steps(resized_height);
      const int b_width_in_hr = round_to_steps(b_height_rounded * aspect_ratio);
      if (b_height_in_wr == 0 || b_height_rounded == 0) {
        // kohya divides by zero here.
        if (why != nullptr) {
          *why = "aspect ratio " + std::to_string(aspect_ratio) +
                 " is too extreme for bucket_no_upscale at this resolution and step: a side "
                 "would round to 0";
        }
        return std::nullopt;
      }
      const double ar_width_rounded = static_cast<double>(b_width_rounded) / b_height_in_wr;
      const double ar_height_rounded = static_cast<double>(b_width_in_hr) / b_height_rounded;
      if (std::abs(ar_width_rounded - aspect_ratio) < std::abs(ar_height_rounded - aspect_ratio)) {
        choice.resized = {b_width_rounded, static_cast<int>(b_width_rounded / aspect_ratio + 0.5)};
      } else {
        choice.resized = {static_cast<int>(b_height_rounded * aspect_ratio + 0.5),
                          b_height_rounded};
      }
    } else {
      choice.resized = {width, height};
    }
    const int steps = options_.bucket_reso_steps;
    choice.bucket = {choice.resized.width - choice.resized.width % steps,
                     choice.resized.height - choice.resized.height % steps};
    if (choice.bucket.width == 0 || choice.bucket.height == 0) {
      if (why != nullptr) {
        *why = "image resizes to " + std::to_string(choice.resized.width) + "x" +
               std::to_string(choice.resized.height) + ", under one bucket step (" +
               std::to_string(steps) + ") on a side, so its bucket would be empty";
      }
      return std::nullopt;
    }
  }
  choice.ar_error =
      static_cast<double>(choice.bucket.width) / choice.bucket.height - aspect_ratio;
  return choice;
}

CropLtrb get_crop_ltrb(Reso bucket, Reso image_size) {
  const double bucket_ar = static_cast<double>(bucket.width) / bucket.height;
  const double image_ar = static_cast<double>(image_size.width) / image_size.height;
  double resized_width = 0;
  double resized_height = 0;
  if (bucket_ar > image_ar) {
    resized_width = bucket.height * image_ar;
    resized_height = bucket.height;
  } else {
    resized_width = bucket.width;
    resized_height = bucket.width / image_ar;
  }
  CropLtrb crop;
  crop.left = std::floor((bucket.width - resized_width) / 2);  // Python float // 2
  crop.top = std::floor((bucket.height - resized_height) / 2);
  crop.right = crop.left + resized_width;
  crop.bottom = crop.top + resized_height;
  return crop;
}

CropOffset crop_offset(Reso resized, Reso bucket, std::optional<double> random_x,
                       std::optional<double> random_y) {
  // kohya: trim_size // 2, or random.randint(0, trim_size) (inclusive) when random cropping.
  auto offset = [](int slack, std::optional<double> fraction) {
    if (slack <= 0) return 0;
    if (!fraction) return slack / 2;
    return std::min(slack, static_cast<int>(*fraction * (slack + 1)));
  };
  return {offset(resized.width - bucket.width, random_x),
          offset(resized.height - bucket.height, random_y)};
}

Reso parse_resolution(const std::string& text) {
  auto parse_int = [&](std::string_view part) {
    int value = 0;
    auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), value);
    if (part.empty() || ec != std::errc() || end != part.data() + part.size() || value <= 0) {
      throw InputError("--resolution='" + text + "' is not a resolution: use 512 or 768,512");
    }
    return value;
  };
  const size_t comma = text.find(',');
  if (comma == std::string::npos) {
    const int side = parse_int(text);
    return {side, side};
  }
  return {parse_int(std::string_view(text).substr(0, comma)),
          parse_int(std::string_view(text).substr(comma + 1))};
}

}  // namespace lorapipe::preprocess
