// lorapipe-preprocess: flags in, preprocess::run out. See README "Preprocess".
#include <gflags/gflags.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>

#include "common/error.h"
#include "common/log.h"
#include "preprocess/image.h"
#include "preprocess/preprocess.h"
#include "proto/wire.h"
#include "runtime/exit_code.h"
#include "runtime/flags.h"
#include "runtime/stage.h"

DEFINE_string(data_dir, "", "Folder of images, or of kohya repeat folders <N>_<class tokens>");
DEFINE_string(train_data_dir, "", "kohya's name for --data_dir");
DEFINE_string(reg_data_dir, "", "Folder of kohya repeat folders of regularization images");
DEFINE_string(dataset_config, "", "kohya dataset TOML, or JSON (instead of --data_dir)");
DEFINE_string(in_json, "",
              "kohya's fine-tuning metadata JSON (captions and tags per image); its images are "
              "paths or names in --train_data_dir");
DEFINE_int32(dataset_repeats, 1,
             "Repeats of every image of --in_json, and of a --dataset_config subset that sets "
             "no num_repeats (kohya's fallback)");
DEFINE_string(dataset_id, "", "Name of the dataset's manifest (default: from the dataset path)");
DEFINE_string(resolution, "512", "Training resolution: 512, or width,height such as 768,512");
DEFINE_bool(enable_bucket, true, "Aspect-ratio buckets; false: every image to --resolution");
DEFINE_int32(min_bucket_reso, 256, "Smallest bucket side");
DEFINE_int32(max_bucket_reso, 1024, "Largest bucket side");
DEFINE_int32(bucket_reso_steps, 64, "Bucket sides are multiples of this");
DEFINE_bool(bucket_no_upscale, false, "Never upscale: buckets follow each image's size");
DEFINE_string(caption_extension, "", "Caption file extension (default .caption, then .txt)");
DEFINE_string(caption_extention, "", "kohya's old spelling of --caption_extension");
DEFINE_string(skip_image_resolution, "",
              "kohya's: leave out images whose area is at most SIZE or W,H (a dataset's small "
              "copies); a dataset TOML's own wins");
DEFINE_string(class_tokens, "", "Caption for images directly in --data_dir without caption file");
DEFINE_bool(flip_aug, false, "Also cache horizontally flipped latents");
DEFINE_bool(random_crop, false, "Random instead of centre crop (fixed per image and --seed)");
DEFINE_bool(alpha_mask, false,
            "The image's transparency masks the loss (kohya's); colour kept, not put on white");
DEFINE_bool(shuffle_caption, false, "Shuffle comma-separated tags (text then encoded online)");
DEFINE_int32(keep_tokens, 0, "Tags kept in front when shuffling");
DEFINE_double(caption_dropout_rate, 0.0, "Probability of an empty caption (text encoded online)");
DEFINE_int32(caption_dropout_every_n_epochs, 0, "Empty captions every N epochs (text online)");
DEFINE_double(caption_tag_dropout_rate, 0.0, "Probability of dropping each tag (text online)");
DEFINE_string(caption_prefix, "", "Text put before every caption, with a space");
DEFINE_string(caption_suffix, "", "Text put after every caption, with a space");
DEFINE_string(caption_separator, ",", "What splits a caption into tags (kohya's)");
DEFINE_string(keep_tokens_separator, "",
              "Tags before it stay in front, after a second one at the end; the rest shuffled");
DEFINE_string(secondary_separator, "",
              "Joins tags shuffled and dropped as one; becomes --caption_separator after");
DEFINE_bool(enable_wildcard, false,
            "Draw one of {a|b|c} and one line of a many-line caption file (text online)");
DEFINE_int32(token_warmup_min, 1, "Tags at step 0 while --token_warmup_step is on");
DEFINE_double(token_warmup_step, 0,
              "All tags from this step; below 1, that share of the run (text online)");
DEFINE_int32(threads, 0, "Decode workers (0: one per core)");
DEFINE_int32(min_image_side, 64, "Reject images whose shorter side is smaller");
DEFINE_double(max_aspect_ratio, 8.0, "Reject images with a longer/shorter side ratio above this");
DEFINE_int64(max_image_pixels, 100000000, "Reject images over this many pixels, from the header");
DEFINE_bool(jpeg_fast_path, true, "Decode plain JPEGs with lorapipe's fast path (false: libvips)");
DEFINE_string(resize_filter, "lanczos3", "lanczos3, lanczos2, cubic, mitchell, linear, nearest");
DEFINE_string(resize_interpolation, "",
              "kohya's name for the filter: lanczos, nearest, bilinear, linear, bicubic, cubic");
DEFINE_uint64(seed, 0, "Seed of random_crop offsets");
DEFINE_bool(report_only, false, "Only report buckets and problems; needs no cacher");
DEFINE_string(report_json, "", "Also write the report as JSON to this file");
DEFINE_string(pub, "", "Bind a PUB endpoint for this stage's StageStatus (READY, DONE, ERROR)");
DEFINE_string(push, "ipc:///tmp/lorapipe-cacher-pull", "The cacher's ImageSample endpoint (PULL)");
DEFINE_string(request, "ipc:///tmp/lorapipe-cacher-rep", "The cacher's HasKeys endpoint (REP)");
DEFINE_int32(timeout_ms, 30000, "How long to wait for the cacher before failing");

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "lorapipe-preprocess --data_dir=DIR | --dataset_config=FILE.toml [flags]\n"
      "Finds images and captions, picks kohya's aspect buckets, decodes what the cacher lacks.");
  lorapipe::runtime::parse_flags(&argc, &argv);
  namespace pp = lorapipe::preprocess;
  namespace wire = lorapipe::wire;
  namespace rt = lorapipe::runtime;
  // The stage's lifecycle for the launcher (runtime::StatusPublisher); opened before anything
  // can fail, closed (delivering what is queued) when main returns.
  zmq::context_t context;
  std::optional<zmq::socket_t> pub;
  std::optional<rt::StatusPublisher> status;
  try {
    if (!FLAGS_pub.empty()) {
      pub.emplace(wire::make_socket(context, zmq::socket_type::pub));
      pub->bind(FLAGS_pub);
    }
    status.emplace(pub ? &*pub : nullptr, "preprocess");
    status->ready();
    pp::Options options;
    if (FLAGS_dataset_repeats < 1) {
      throw lorapipe::InputError("--dataset_repeats=" + std::to_string(FLAGS_dataset_repeats) +
                                 ": must be at least 1");
    }
    if (!FLAGS_dataset_config.empty()) {
      // kohya's train_network: a dataset config wins, and kohya's folder flags are ignored with a
      // warning (a kohya command or config file often still carries them). lorapipe's own
      // --data_dir beside it stays refused (preprocess::run: give one).
      std::string ignored;
      for (auto [name, value] : {std::pair{"--train_data_dir", &FLAGS_train_data_dir},
                                 std::pair{"--reg_data_dir", &FLAGS_reg_data_dir},
                                 std::pair{"--in_json", &FLAGS_in_json}}) {
        if (value->empty()) continue;
        ignored += (ignored.empty() ? "" : ", ") + std::string(name) + "=" + *value;
        value->clear();
      }
      if (!ignored.empty()) {
        LP_LOG(kWarning, "preprocess") << "ignoring " << ignored << ": --dataset_config="
                                       << FLAGS_dataset_config
                                       << " names the images, as kohya ignores them there";
      }
    }
    if (!FLAGS_data_dir.empty() && !FLAGS_train_data_dir.empty() &&
        FLAGS_data_dir != FLAGS_train_data_dir) {
      throw lorapipe::InputError("--data_dir=" + FLAGS_data_dir + " and --train_data_dir=" +
                                 FLAGS_train_data_dir +
                                 " name two folders (--train_data_dir is kohya's name for "
                                 "--data_dir): give one");
    }
    options.data_dir = FLAGS_data_dir.empty() ? FLAGS_train_data_dir : FLAGS_data_dir;
    std::error_code no_folder;
    if (!options.data_dir.empty() && !std::filesystem::is_directory(options.data_dir, no_folder)) {
      // Named as the user gave it (discover_folder names --data_dir).
      throw lorapipe::InputError((FLAGS_data_dir.empty() ? "--train_data_dir=" : "--data_dir=") +
                                 options.data_dir + " is not a folder");
    }
    options.reg_data_dir = FLAGS_reg_data_dir;
    options.dataset_config = FLAGS_dataset_config;
    options.in_json = FLAGS_in_json;
    options.dataset_repeats = FLAGS_dataset_repeats;
    options.dataset_id = FLAGS_dataset_id;
    pp::BucketOptions& b = options.defaults.dataset.buckets;
    b.resolution = pp::parse_resolution(FLAGS_resolution);
    b.enable_bucket = FLAGS_enable_bucket;
    b.min_bucket_reso = FLAGS_min_bucket_reso;
    b.max_bucket_reso = FLAGS_max_bucket_reso;
    b.bucket_reso_steps = FLAGS_bucket_reso_steps;
    b.bucket_no_upscale = FLAGS_bucket_no_upscale;
    if (!FLAGS_skip_image_resolution.empty()) {
      options.defaults.dataset.skip_image_resolution =
          pp::parse_resolution(FLAGS_skip_image_resolution);
    }
    pp::SubsetOptions& s = options.defaults.subset;
    // kohya's fallback for a subset without num_repeats (ConfigSanitizer's dataset_repeats ->
    // num_repeats); kohya repeat folders and --data_dir set their own.
    s.num_repeats = FLAGS_dataset_repeats;
    if (!FLAGS_caption_extension.empty() && !FLAGS_caption_extention.empty() &&
        FLAGS_caption_extension != FLAGS_caption_extention) {
      throw lorapipe::InputError("--caption_extension=" + FLAGS_caption_extension +
                                 " and --caption_extention=" + FLAGS_caption_extention +
                                 " differ (--caption_extention is kohya's old spelling): give one");
    }
    if (!FLAGS_caption_extension.empty() || !FLAGS_caption_extention.empty()) {
      s.caption_extension =
          FLAGS_caption_extension.empty() ? FLAGS_caption_extention : FLAGS_caption_extension;
      s.caption_extension_set = true;
    }
    s.class_tokens = FLAGS_class_tokens;
    s.flip_aug = FLAGS_flip_aug;
    s.random_crop = FLAGS_random_crop;
    s.alpha_mask = FLAGS_alpha_mask;
    if (!FLAGS_resize_interpolation.empty()) {
      try {
        s.resize_filter = pp::resize_filter_from_kohya(FLAGS_resize_interpolation);
        s.resize_interpolation = FLAGS_resize_interpolation;
        options.defaults.dataset.resize_interpolation = FLAGS_resize_interpolation;
      } catch (const lorapipe::InputError& e) {
        throw lorapipe::InputError(std::string("--") + e.what());
      }
    }
    s.shuffle_caption = FLAGS_shuffle_caption;
    s.keep_tokens = FLAGS_keep_tokens;
    s.caption_dropout_rate = FLAGS_caption_dropout_rate;
    s.caption_dropout_every_n_epochs = FLAGS_caption_dropout_every_n_epochs;
    s.caption_tag_dropout_rate = FLAGS_caption_tag_dropout_rate;
    s.caption_prefix = FLAGS_caption_prefix;
    s.caption_suffix = FLAGS_caption_suffix;
    if (FLAGS_caption_separator.empty()) {
      throw lorapipe::InputError("--caption_separator must not be empty");
    }
    if (FLAGS_token_warmup_step < 0) {
      throw lorapipe::InputError("--token_warmup_step=" + std::to_string(FLAGS_token_warmup_step) +
                                 " must not be negative");
    }
    s.caption_separator = FLAGS_caption_separator;
    s.keep_tokens_separator = FLAGS_keep_tokens_separator;
    s.secondary_separator = FLAGS_secondary_separator;
    s.enable_wildcard = FLAGS_enable_wildcard;
    s.token_warmup_min = FLAGS_token_warmup_min;
    s.token_warmup_step = FLAGS_token_warmup_step;
    options.threads = FLAGS_threads;
    options.min_image_side = FLAGS_min_image_side;
    options.max_aspect_ratio = FLAGS_max_aspect_ratio;
    options.max_image_pixels = FLAGS_max_image_pixels;
    options.resize_filter = FLAGS_resize_filter;
    options.jpeg_fast_path = FLAGS_jpeg_fast_path;
    options.seed = FLAGS_seed;
    options.report_only = FLAGS_report_only;
    options.report_json = FLAGS_report_json;
    options.push_endpoint = FLAGS_push;
    options.request_endpoint = FLAGS_request;
    options.timeout_ms = FLAGS_timeout_ms;
    options.on_progress = [&](size_t done, size_t total) {
      status->progress(done, total, "images");
      status->tick();
    };

    if (gflags::GetCommandLineFlagInfoOrDie("enable_bucket").is_default) {
      // Our default differs from kohya's, whose command lines without the flag crop every image
      // to one size: said once, where a kohya user reads the run's log.
      LP_LOG(kInfo, "preprocess")
          << "aspect-ratio buckets are on by default here (kohya's are off unless --enable_bucket "
             "is given); --enable_bucket=false resizes and crops every image to --resolution, "
             "as kohya does without it";
    }
    const pp::Report report = pp::run(options);
    std::cout << pp::format_report(report) << std::flush;
    if (!options.report_json.empty()) {
      std::ofstream out(options.report_json);
      out << pp::report_to_json(report);
      if (!out) throw lorapipe::InputError("cannot write --report_json=" + options.report_json);
    }
    if (report.images.empty()) {
      LP_LOG(kError, "preprocess") << "no usable image found in "
                                   << (!options.in_json.empty()      ? options.in_json
                                       : options.data_dir.empty() ? options.dataset_config
                                                                  : options.data_dir)
                                   << " (" << report.skipped.size() << " skipped, "
                                   << report.ignored.size() << " ignored; reasons above)";
      status->error("no usable image found (" + std::to_string(report.skipped.size()) +
                    " skipped, " + std::to_string(report.ignored.size()) + " ignored)");
      return rt::kExitCheckFailed;
    }
    // The launcher shows this line: what was left out is said here, the reasons are in the log.
    std::string done = std::to_string(report.images.size()) + " images used of " +
                       std::to_string(report.images_found) + " found";
    if (!report.skipped.empty() || !report.ignored.empty()) {
      done += "; " + std::to_string(report.skipped.size()) + " skipped, " +
              std::to_string(report.ignored.size()) + " ignored (the log says why)";
    }
    status->done(done);
    return rt::kExitOk;
  } catch (const std::exception& e) {
    LP_LOG(kError, "preprocess") << e.what();
    if (status) status->error(e.what());
    return rt::kExitError;
  }
}
