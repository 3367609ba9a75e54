// lorapipe-cacher: flags in, cacher::run (or one of the cache tools) out.
#include <gflags/gflags.h>

#include <cstdio>
#include <iostream>

#include "cacher/cacher.h"
#include "cacher/tools.h"
#include "common/error.h"
#include "common/log.h"
#include "runtime/exit_code.h"
#include "runtime/flags.h"

DEFINE_string(cache_dir, "", "Cache folder (default: $LORAPIPE_CACHE_DIR or ~/.cache/lorapipe/cache)");
DEFINE_string(pretrained_model_name_or_path, "",
              "Base model: single .safetensors (original layout) or diffusers folder");
DEFINE_string(model, "", "Alias of --pretrained_model_name_or_path");
DEFINE_string(model_family, "",
              "Load the model as this family (sd15) instead of detecting it from its keys, its "
              "model_index.json or its metadata");
DEFINE_string(tokenizer, "",
              "Another CLIP vocabulary (folder, merges.txt or .gz); CLIP's own is built in");
DEFINE_string(vae, "",
              "Another VAE than the checkpoint's (kohya's --vae): a .safetensors VAE or a diffusers "
              "VAE folder; give the trainer and the sampler the same");
DEFINE_string(device, "auto", "auto, cpu, cuda or cuda:N");
DEFINE_string(dtype, "fp32", "Compute dtype: fp32, fp16 or bf16 (records are stored in fp16)");
DEFINE_int32(vae_batch_size, 4, "Images per VAE batch (one bucket at a time)");
DEFINE_bool(no_half_vae, false,
            "kohya's: the VAE in fp32 whatever --dtype says (SDXL's is, unless --vae is given)");
DEFINE_bool(fp8_base, false,
            "kohya's: the text encoders' Linear weights in float8 (T5 XXL's 9.5 GB in bf16 "
            "become 4.8 GB)");
DEFINE_bool(fp8_base_unet, false, "kohya's: float8 for the denoiser alone, so none here");
DEFINE_bool(fp8_scaled, false, "With --fp8_base: float8 with a scale per 64 input features");
DEFINE_int32(clip_skip, 1, "Text-encoder layer from the end, as kohya/A1111 (1: last)");
DEFINE_int32(max_token_length, 75,
             "kohya's caption length: 75, or 150 / 225 tokens encoded in chunks of 75");
DEFINE_uint64(max_map_mb, 1048576, "Largest the cache may grow, in MiB");
DEFINE_string(pull, "ipc:///tmp/lorapipe-cacher-pull", "ImageSample endpoint to bind (PULL)");
DEFINE_string(rep, "ipc:///tmp/lorapipe-cacher-rep", "HasKeys/GetRecords endpoint to bind (REP)");
DEFINE_string(pub, "", "CacheReport endpoint to bind (PUB); empty: none");
DEFINE_double(wait_for_writer_s, 0,
              "Another cacher writing this cache: wait this long for it (0: fail at once)");
DEFINE_bool(serve, false, "Stay up after the stream and serve records to trainers and samplers");
DEFINE_int32(idle_timeout_s, 600, "Give up when preprocess sends nothing for this long");
DEFINE_double(delay_per_batch_s, 0, "Testing: each latent batch takes at least this long");
DEFINE_int32(test_oom_latent_batches, 0,
             "Testing: the first this many latent encodes run out of memory, as on a full card");
DEFINE_bool(inspect, false, "Tool: record counts and bytes per table, fingerprints, manifests");
DEFINE_bool(json, false, "With --inspect: print JSON");
DEFINE_bool(verify, false, "Tool: read and check every record; exit 1 if any is corrupt");
DEFINE_bool(gc, false, "Tool: drop records that no manifest references");
DEFINE_bool(drop_superseded, false,
            "Tool, with --gc: first drop each manifest a later caching of the same dataset (its "
            "images or captions edited since) with the same model and settings replaced");
DEFINE_string(export_file, "", "Tool: write --dataset's manifest and records to this file");
DEFINE_string(dataset, "", "Dataset id for --export_file");
DEFINE_string(import_file, "", "Tool: add a file written by --export_file to this cache");

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "lorapipe-cacher --model=MODEL [flags]        encode what preprocess streams\n"
      "lorapipe-cacher --inspect|--verify|--gc      look after a cache\n"
      "lorapipe-cacher --export_file=F --dataset=ID / --import_file=F   move a dataset");
  lorapipe::runtime::parse_flags(&argc, &argv);
  namespace c = lorapipe::cacher;
  try {
    c::ToolOptions tool;
    tool.cache_dir = FLAGS_cache_dir;
    tool.max_map_bytes = FLAGS_max_map_mb << 20;
    if (FLAGS_inspect) {
      std::cout << (FLAGS_json ? c::inspect_json(tool) : c::inspect_text(tool)) << std::flush;
      return lorapipe::runtime::kExitOk;
    }
    if (FLAGS_verify) {
      return c::verify(tool, std::cout) ? lorapipe::runtime::kExitOk
                                        : lorapipe::runtime::kExitCheckFailed;
    }
    if (FLAGS_drop_superseded && !FLAGS_gc) {
      throw lorapipe::InputError("--drop_superseded is a part of --gc: give both");
    }
    if (FLAGS_gc) {
      if (FLAGS_drop_superseded) c::drop_superseded(tool, std::cout);
      c::gc(tool, std::cout);
      return lorapipe::runtime::kExitOk;
    }
    if (!FLAGS_export_file.empty()) {
      c::export_dataset(tool, FLAGS_dataset, FLAGS_export_file, std::cout);
      return lorapipe::runtime::kExitOk;
    }
    if (!FLAGS_import_file.empty()) {
      c::import_dataset(tool, FLAGS_import_file, std::cout);
      return lorapipe::runtime::kExitOk;
    }
    c::Options options;
    options.cache_dir = FLAGS_cache_dir;
    options.model = FLAGS_pretrained_model_name_or_path.empty() ? FLAGS_model
                                                                : FLAGS_pretrained_model_name_or_path;
    options.model_family = FLAGS_model_family;
    options.tokenizer = FLAGS_tokenizer;
    options.vae = FLAGS_vae;
    options.model_parts = lorapipe::models::model_parts_from_flags();
    options.device = FLAGS_device;
    options.dtype = FLAGS_dtype;
    options.vae_batch_size = FLAGS_vae_batch_size;
    options.no_half_vae = FLAGS_no_half_vae;
    options.fp8_base = FLAGS_fp8_base;
    options.fp8_base_unet = FLAGS_fp8_base_unet;
    options.fp8_scaled = FLAGS_fp8_scaled;
    options.clip_skip = FLAGS_clip_skip;
    options.max_token_length = FLAGS_max_token_length;
    options.max_map_bytes = FLAGS_max_map_mb << 20;
    options.wait_for_writer_s = FLAGS_wait_for_writer_s;
    options.pull_endpoint = FLAGS_pull;
    options.rep_endpoint = FLAGS_rep;
    options.pub_endpoint = FLAGS_pub;
    options.serve = FLAGS_serve;
    options.idle_timeout_ms = FLAGS_idle_timeout_s * 1000;
    options.delay_per_batch_s = FLAGS_delay_per_batch_s;
    options.test_oom_latent_batches = FLAGS_test_oom_latent_batches;
    const c::Summary s = c::run(options);
    std::printf("cache report: dataset %s: %llu encoded, %llu cached (%.0f%% hits), %llu "
                "rejected; texts %llu encoded, %llu cached; manifest %llu entries; %.1f images/s; "
                "%llu bytes per caption\n",
                s.dataset_id.c_str(), static_cast<unsigned long long>(s.encoded),
                static_cast<unsigned long long>(s.hits),
                s.encoded + s.hits > 0 ? 100.0 * s.hits / (s.encoded + s.hits) : 0.0,
                static_cast<unsigned long long>(s.rejected),
                static_cast<unsigned long long>(s.texts_encoded),
                static_cast<unsigned long long>(s.texts_cached),
                static_cast<unsigned long long>(s.manifest_entries), s.images_per_second,
                static_cast<unsigned long long>(s.texts_encoded > 0 ? s.text_bytes / s.texts_encoded
                                                                    : 0));
    return lorapipe::runtime::kExitOk;
  } catch (const std::exception& e) {
    LP_LOG(kError, "cacher") << e.what();
    return lorapipe::runtime::kExitError;
  }
}
