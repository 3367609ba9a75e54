#include "sampler/sampler.h"

#include <torch/torch.h>

#include <malloc.h>
#include <zlib.h>

#if __has_include(<c10/cuda/CUDAGuard.h>) && __has_include(<c10/cuda/CUDAStream.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define LORAPIPE_SAMPLER_CUDA_STREAMS 1
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>
#include <vips/vips8>

#include "common/error.h"
#include "common/file.h"
#include "common/log.h"
#include "models/device.h"
#include "models/family.h"
#include "models/float8.h"
#include "models/mapped_weights.h"
#include "models/shared_weights.h"
#include "models/placement.h"
#include "models/registry.h"
#include "models/safetensors.h"
#include "proto/wire.h"
#include "runtime/stage.h"
#include "models/lora_merge.h"
#include "sampler/prompts.h"
#include "sampler/render.h"

namespace lorapipe::sampler {
namespace {

namespace fs = std::filesystem;
using models::MergedLoras;
using vips::VImage;
constexpr const char* kLog = "sampler";

void start_vips() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (VIPS_INIT("lorapipe-sampler") != 0) {
      throw Error("cannot start libvips: " + std::string(vips_error_buffer()));
    }
  });
}

// A1111's sampler names, so that its PNG Info and "send to txt2img" recognise ours; those A1111
// lacks (dpmsolver, dpmsingle, ddpm) keep kohya's name.
std::string a1111_sampler(const std::string& name) {
  static const std::map<std::string, std::string> names = {
      {"ddim", "DDIM"},           {"euler", "Euler"},
      {"k_euler", "Euler"},       {"euler_karras", "Euler Karras"},
      {"euler_a", "Euler a"},     {"k_euler_a", "Euler a"},
      {"dpmsolver++", "DPM++ 2M"}, {"dpmsolver++_karras", "DPM++ 2M Karras"},
      {"heun", "Heun"},           {"lms", "LMS"},
      {"k_lms", "LMS"},           {"dpm_2", "DPM2"},
      {"k_dpm_2", "DPM2"},        {"dpm_2_a", "DPM2 a"},
      {"k_dpm_2_a", "DPM2 a"},    {"pndm", "PLMS"}};
  const auto it = names.find(name);
  return it == names.end() ? name : it->second;
}

// A1111's "parameters" text: what UIs and image viewers show for a generated image. The model by
// its file name, as A1111 writes it (a path may hold the ", " that separates its fields).
std::string parameters_text(const RenderRequest& r, const models::ModelFamily& family,
                            const std::string& model, const std::string& lora) {
  fs::path model_path = fs::path(model);
  if (!model_path.has_filename()) model_path = model_path.parent_path();  // "folder/"
  std::ostringstream out;
  out << r.prompt << "\n";
  if (!r.negative_prompt.empty()) out << "Negative prompt: " << r.negative_prompt << "\n";
  // A flow-matching family renders with Euler steps along its flow, whatever --ss says, and at
  // the size its packing rounds to.
  const bool flow = family.objective == models::ObjectiveKind::kFlowMatching;
  const auto [width, height] = rendered_size(family, r);
  out << "Steps: " << sample_steps(family, r)
      << ", Sampler: " << (flow ? std::string("Euler") : a1111_sampler(r.sampler))
      << ", CFG scale: " << cfg_scale(family, r);
  if (flow && r.guidance) out << ", Distilled CFG Scale: " << *r.guidance;  // Forge's name
  out << ", Seed: " << r.seed << ", Size: " << width << "x" << height
      << ", Model: " << model_path.stem().string();
  if (!lora.empty()) out << ", Lora: " << lora;
  return out.str();
}

// The PNG `png` (whole file) with an iTXt chunk `key` = `text` (UTF-8, uncompressed) right after
// its IHDR: a tEXt chunk is Latin-1 by the PNG standard, so readers (PIL, A1111) would show a
// UTF-8 prompt as mojibake; PIL itself writes iTXt for such text.
std::string with_itxt(const std::string& png, const std::string& key, const std::string& text) {
  constexpr size_t kAfterIhdr = 8 + 8 + 13 + 4;  // signature, IHDR length + type, data, CRC
  if (png.size() < kAfterIhdr || png.compare(12, 4, "IHDR") != 0) {
    throw Error("not a PNG from libvips: no IHDR first");
  }
  std::string body = "iTXt" + key;
  body += std::string("\0\0\0", 3);  // end of keyword; not compressed; compression method
  body += std::string("\0\0", 2);     // empty language tag; empty translated keyword
  body += text;
  auto big_endian = [](uint32_t v) {
    std::string out;
    for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((v >> shift) & 0xFF);
    return out;
  };
  const auto crc = static_cast<uint32_t>(
      crc32(0, reinterpret_cast<const Bytef*>(body.data()), static_cast<uInt>(body.size())));
  const std::string chunk =
      big_endian(static_cast<uint32_t>(body.size() - 4)) + body + big_endian(crc);  // length: data only
  return png.substr(0, kAfterIhdr) + chunk + png.substr(kAfterIhdr);
}

// The image owns a copy of the pixels: libvips evaluates lazily (the contact sheet reads the
// tiles long after the tensor is gone), and copy_memory() on an image made by new_from_memory
// only takes a reference, which once let a worker thread read freed memory.
VImage to_vips(const at::Tensor& image) {
  const at::Tensor c = image.contiguous();
  VipsImage* copy = vips_image_new_from_memory_copy(
      c.data_ptr(), static_cast<size_t>(c.numel()), static_cast<int>(c.size(1)),
      static_cast<int>(c.size(0)), 3, VIPS_FORMAT_UCHAR);
  if (copy == nullptr) throw vips::VError();
  return VImage(copy);
}

// PNG with the parameters as A1111 and PIL write them: a tEXt chunk (libvips writes
// "png-comment-N-KEY" fields as such) when the text is ASCII, else an iTXt chunk (with_itxt).
// Written to a temporary name, then renamed.
void write_png(const fs::path& path, VImage image, const std::string& parameters) {
  const bool ascii = std::all_of(parameters.begin(), parameters.end(),
                                 [](char c) { return static_cast<unsigned char>(c) < 0x80; });
  const fs::path tmp = path.string() + ".tmp.png";
  if (ascii) {
    image.set("png-comment-0-parameters", parameters.c_str());
    image.pngsave(tmp.string().c_str());
  } else {
    VipsBlob* blob = image.pngsave_buffer();
    size_t size = 0;
    const char* data = static_cast<const char*>(vips_blob_get(blob, &size));
    const std::string png = with_itxt(std::string(data, size), "parameters", parameters);
    vips_area_unref(VIPS_AREA(blob));
    std::ofstream out(tmp, std::ios::binary);
    out.write(png.data(), static_cast<std::streamsize>(png.size()));
    if (!out.flush()) throw Error(tmp.string() + ": cannot write");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw Error("cannot write " + path.string() + ": " + ec.message());
  }
}

// Written whole to a temporary name (every write checked: a full disk is an Error naming the
// file), then renamed over `path`: a failure leaves the previous file, never a truncated one that
// a restarted sampler would read as an empty gallery.
void write_text(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  write_file(tmp, text, /*sync=*/false);
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw Error("cannot write " + path.string() + ": " + ec.message());
  }
}

// The gallery: a page that shows checkpoints (rows, newest first) by prompts (columns) and
// picks up new ones every two seconds without a reload. It must work opened straight from disk
// (file://), where a browser refuses fetch() and XHR: so the index also comes as samples.js, a
// script that calls lorapipeSamples(index), loaded again by a fresh <script> element each time.
// samples.json holds the same for tools. Each image marks itself loaded (data-loaded), and the
// status line counts them: what the headless-Chromium test reads. Above the grid, the run's
// curves (loss, average and validation loss; learning rate; peak memory) where the launcher
// writes samples/curves.js (deploy/curves.h), loaded the same way; a sampler run by hand has none.
constexpr const char* kGallery = R"html(<!doctype html>
<html><head><meta charset="utf-8"><title>lorapipe samples</title>
<style>
body{font-family:sans-serif;background:#111;color:#ddd;margin:1em}
table{border-collapse:collapse}td,th{padding:4px;vertical-align:top}
img{max-width:256px;display:block}.prompt{font-size:12px;max-width:256px}
.curve{background:#1b1b1b;margin:0 8px 8px 0}.curve text{fill:#aaa;font-size:11px}
</style></head><body>
<h1>lorapipe samples</h1><div id="curves"></div><p id="status">waiting for samples</p>
<table id="grid"></table>
<script>
let shown='',shownCurves='';
const NS='http://www.w3.org/2000/svg';
function chart(title,series,format){
  const W=380,H=160,L=58,R=10,T=22,B=24;
  const xs=[],ys=[];
  for(const s of series)s.x.forEach((x,i)=>{if(Number.isFinite(s.y[i])){xs.push(x);ys.push(s.y[i]);}});
  if(!xs.length)return null;
  let x0=Math.min(...xs),x1=Math.max(...xs),y0=Math.min(...ys),y1=Math.max(...ys);
  if(x1===x0)x1=x0+1;
  if(y1===y0)y1=y0+(Math.abs(y0)||1)*0.01;
  const sx=x=>L+(x-x0)/(x1-x0)*(W-L-R),sy=y=>T+(1-(y-y0)/(y1-y0))*(H-T-B);
  const svg=document.createElementNS(NS,'svg');
  svg.setAttribute('width',W);svg.setAttribute('height',H);svg.setAttribute('class','curve');
  svg.dataset.title=title;
  const text=(x,y,s,anchor,color)=>{const t=document.createElementNS(NS,'text');
    t.setAttribute('x',x);t.setAttribute('y',y);t.setAttribute('text-anchor',anchor);
    if(color)t.style.fill=color;t.textContent=s;svg.appendChild(t);};
  let at=L;
  for(const s of series){text(at,14,s.name,'start',s.color);at+=s.name.length*6+12;}
  text(L-4,T+8,format(y1),'end');text(L-4,H-B,format(y0),'end');
  text(L,H-6,'step '+x0,'start');text(W-R,H-6,'step '+x1,'end');
  const frame=document.createElementNS(NS,'rect');
  frame.setAttribute('x',L);frame.setAttribute('y',T);frame.setAttribute('width',W-L-R);
  frame.setAttribute('height',H-T-B);frame.setAttribute('fill','none');frame.setAttribute('stroke','#444');
  svg.appendChild(frame);
  for(const s of series){
    const points=s.x.map((x,i)=>[x,s.y[i]]).filter(p=>Number.isFinite(p[1]));
    if(!points.length)continue;
    const line=document.createElementNS(NS,'polyline');
    line.setAttribute('points',points.map(p=>sx(p[0]).toFixed(1)+','+sy(p[1]).toFixed(1)).join(' '));
    line.setAttribute('fill','none');line.setAttribute('stroke',s.color);
    line.setAttribute('stroke-width',s.width);line.dataset.series=s.name;svg.appendChild(line);
  }
  return svg;
}
function lorapipeCurves(d){
  const text=JSON.stringify(d);
  if(text===shownCurves)return;
  shownCurves=text;
  const box=document.getElementById('curves');box.innerHTML='';
  const v=d.validation||[],g=n=>Math.abs(n)>=0.01||n===0?n.toPrecision(3):n.toExponential(2);
  const loss=[{name:'loss',x:d.steps,y:d.loss,color:'#4a90d9',width:1},
    {name:'average loss',x:d.steps,y:d.average_loss,color:'#f5a623',width:2}];
  if(v.length)loss.push({name:'validation loss',x:v.map(p=>p[0]),y:v.map(p=>p[1]),color:'#7ed321',width:2});
  const charts=[chart('loss',loss,g),
    chart('learning rate',[{name:'learning rate',x:d.steps,y:d.learning_rate,color:'#bd10e0',width:2}],g),
    chart('peak memory',[{name:'peak memory, GiB',x:d.steps,y:d.peak_memory_bytes.map(b=>b/1073741824),
      color:'#50e3c2',width:2}],g)];
  for(const c of charts)if(c)box.appendChild(c);
}
function status(){
  const all=document.querySelectorAll('#grid img').length;
  const loaded=document.querySelectorAll('#grid img[data-loaded]').length;
  const rows=document.querySelectorAll('#grid tr[id^=step-]').length;
  document.getElementById('status').textContent=rows+' checkpoints, '+loaded+' of '+all+' images shown';
}
function lorapipeSamples(data){
  const text=JSON.stringify(data);
  if(text===shown)return;
  shown=text;
  const grid=document.getElementById('grid');grid.innerHTML='';
  const head=grid.insertRow();head.insertCell().textContent='step';
  for(const p of data.prompts){const c=head.insertCell();c.className='prompt';c.textContent=p;}
  for(const ck of [...data.checkpoints].reverse()){
    const row=grid.insertRow();row.id='step-'+ck.step;row.insertCell().textContent=ck.step;
    // A checkpoint rendered before the prompt file changed holds its own prompts: each image is
    // named by its own, and captioned where that is not the column's.
    const own=ck.prompts||data.prompts;
    ck.images.forEach((img,k)=>{const c=row.insertCell();const i=document.createElement('img');
      i.onload=()=>{i.dataset.loaded='1';status();};i.src=img;i.alt=img;i.title=own[k]||'';
      c.appendChild(i);
      if(own[k]!==data.prompts[k]){const d=document.createElement('div');d.className='prompt';
        d.textContent=own[k]||'';c.appendChild(d);}});
  }
  status();
}
function refresh(){
  for(const name of ['samples.js','curves.js']){
    const s=document.createElement('script');
    s.src=name+'?'+Date.now();
    s.onload=s.onerror=()=>s.remove();
    document.head.appendChild(s);
  }
}
refresh();setInterval(refresh,2000);
</script></body></html>
)html";

// An exception's message without LibTorch's backtrace (from the second line on).
std::string first_line(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string message = c10_error ? c10_error->what_without_backtrace() : e.what();
  return message.substr(0, message.find('\n'));
}

std::string run_name(const fs::path& lora) {
  // NAME-step00000100 / NAME-000002 / NAME: the run's output name.
  static const std::regex suffix("(-step[0-9]+|-[0-9]{6})$");
  return std::regex_replace(lora.stem().string(), suffix, "");
}


// The prompt file with --sample_sampler and --seed as its defaults; InputError for an unknown
// sampler or a file with no prompt that can be read.
// `family` the model's: a flow-matching one renders Euler steps whatever a line's sampler says.
PromptSet read_prompts(const SamplerOptions& o, const models::ModelFamily& family) {
  PromptDefaults defaults;
  defaults.check_sampler_steps = family.objective != models::ObjectiveKind::kFlowMatching;
  defaults.weighted_prompts = family.objective != models::ObjectiveKind::kFlowMatching;
  defaults.sampler.clear();  // --sampler in any case, as --ss and sample_sampler are read
  for (char c : o.sampler) {
    defaults.sampler += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  defaults.first_seed = o.first_seed;
  (void)scheduler_options(defaults.sampler, false);  // an unknown --sampler fails now
  PromptSet prompts = load_prompts(o.sample_prompts, defaults);
  if (prompts.prompts.empty()) {
    throw InputError(o.sample_prompts.string() + ": no prompt could be read");
  }
  return prompts;
}

class Sampler {
 public:
  explicit Sampler(const SamplerOptions& options) : o_(options) {
    if (!o_.sub_endpoint.empty()) {
      // Subscribed before the model loads: a checkpoint announced meanwhile (a short run's final
      // one, announced once) waits in the socket instead of being lost.
      sub_.emplace(wire::make_socket(context_, zmq::socket_type::sub));
      sub_->set(zmq::sockopt::subscribe, wire::type_name(wire::CheckpointReady()));
      sub_->connect(o_.sub_endpoint);
    }
    start_vips();
    const c10::Device device = models::resolve_device(o_.device);
    device_ = device;
    const c10::ScalarType dtype = models::parse_precision(o_.mixed_precision, "--mixed_precision");
    // Built on the CPU, then placed (models/placement.h). The trainer's --base_weights merge into
    // fp32 weights, as the trainer's do, so the renders see the base it trained on.
    models::LoadOptions load;
    load.family = o_.model_family;
    load.tokenizer = o_.tokenizer;
    load.vae = o_.vae;
    load.parts = o_.model_parts;
    load.dtype = o_.base_weights.empty() ? dtype : c10::kFloat;
    // fp16 keeps the VAE in fp32 (SD's VAE overflows in fp16), as loaded.
    load.vae_dtype = dtype == c10::kHalf || !o_.base_weights.empty() ? c10::kFloat : dtype;
    {
      std::optional<models::MappedWeights> mapped;
      // Shared weights replace the denoiser's as soon as it is placed: its load maps the file
      // rather than copy what it can.
      if (o_.map_weights || !o_.shared_weights.empty()) mapped.emplace();
      model_ = models::load_model(o_.model, load);
      if (mapped) models::log_mapped_weights(*mapped, "sampler");
    }
    models::check_declared_objective(model_->model_family(), o_.model.string(), o_.v_prediction,
                                     std::nullopt);
    models::merge_base_weights(*model_, o_.base_weights);
    models::Placement placement;
    placement.device = device;
    placement.dtype = dtype;
    placement.fp8_denoiser = o_.fp8_base || o_.fp8_base_unet;
    placement.fp8_text_encoders = o_.fp8_base && !o_.fp8_base_unet;
    placement.fp8_scaled = o_.fp8_scaled;
    placement.fp8_fast = o_.fp8_fast;
    if (o_.blocks_to_swap > 0) {
      // The card the training fitted with block swap holds the denoiser's other blocks; the
      // text encoders (FLUX.1's T5-XXL is as large as the rest) wait in host memory and encode
      // there, once per prompt set (render_checkpoint_or_throw keeps their conditionings).
      placement.blocks_to_swap = o_.blocks_to_swap;
      placement.text_encoders_on_device = false;
      placement.text_encoders_off_device_because = "--blocks_to_swap leaves the device to the "
                                                   "denoiser: prompts are encoded on the CPU";
    }
    if (!o_.shared_weights.empty()) {
      const std::string key = models::shared_weights_key(o_.model, placement);
      placement.attach_denoiser = [&](torch::nn::Module& denoiser) {
        // --idle_timeout_s bounds the wait too: a manifest no trainer writes (a wrong path) is
        // named and given up on, not waited for forever.
        const auto since = std::chrono::steady_clock::now();
        shared_ = models::attach_shared_weights(denoiser, device, o_.shared_weights, key, [&] {
          if (o_.idle_timeout_s > 0 &&
              std::chrono::steady_clock::now() - since >
                  std::chrono::duration<double>(o_.idle_timeout_s)) {
            throw InputError(o_.shared_weights.string() + " (--shared_weights): no trainer "
                             "published its weights there within --idle_timeout_s");
          }
        });
        if (!shared_) {
          LP_LOG(kInfo, kLog) << "the trainer's weights are not shared (any more): this sampler "
                                 "places its own copy";
        }
        return shared_ != nullptr;
      };
    }
    models::place(*model_, placement);
#ifdef __GLIBC__
    // The denoiser's own copy, converted on the CPU before the trainer's replaced it, goes back.
    if (shared_) malloc_trim(0);
#endif
    device_share_ = o_.device_share > 0 ? o_.device_share : (shared_ && device.is_cuda() ? 0.1 : 1);
    if (device_share_ < 1) {
      LP_LOG(kInfo, kLog) << "renders take " << device_share_ * 100 << "% of "
                          << models::describe_device(device) << "'s time (--device_share): the "
                          << "trainer beside it keeps the rest";
    }
    prompts_read_ = prompt_file_stamp();  // before the read: a write meanwhile is read again
    prompts_ = read_prompts(o_, model_->model_family());
    report_prompt_lines(prompts_);
    fs::create_directories(o_.output_dir / "samples");
    write_text(o_.output_dir / "samples" / "index.html", kGallery);
    // A restarted sampler adds to the gallery of the one before.
    const fs::path index = o_.output_dir / "samples" / "samples.json";
    if (fs::exists(index)) {
      try {
        std::ifstream in(index);
        const nlohmann::json old = nlohmann::json::parse(in);
        if (old.contains("checkpoints") && old["checkpoints"].is_array()) {
          checkpoints_ = old["checkpoints"];
        }
      } catch (const nlohmann::json::exception& e) {
        LP_LOG(kWarning, kLog) << index.string() << " unreadable, starting a new one: " << e.what();
      }
    }
    LP_LOG(kInfo, kLog) << "model " << model_->source() << " on "
                        << models::describe_device(device) << "; " << prompts_.prompts.size()
                        << " prompts from " << o_.sample_prompts.string();
  }

  // Renders every prompt with `loras` merged; false (reported) when it cannot. Whatever stops a
  // checkpoint's render (a bad file, the device's memory, a full or read-only disk under
  // samples/) skips that checkpoint: the sampler keeps serving, and the run it follows goes on.
  bool render_checkpoint(const std::vector<std::pair<fs::path, double>>& loras, uint64_t step,
                         const std::string& name) {
    reread_changed_prompts();
    bool rendered = false;
    try {
      rendered = render_checkpoint_or_throw(loras, step, name);
    } catch (const std::exception& e) {
      LP_LOG(kError, kLog) << "step " << step << " not rendered: " << e.what();
      skip_reason_ = first_line(e);  // for the screen: LibTorch's errors carry their backtrace
    }
#ifdef LORAPIPE_SAMPLER_CUDA_STREAMS
    // Beside the trainer on its GPU, what a render's allocator cached goes back to the device
    // for the trainer's steps; kept, it would sit idle until the next checkpoint.
    if (shared_ && device_.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
    return rendered;
  }

  bool render_checkpoint_or_throw(const std::vector<std::pair<fs::path, double>>& loras,
                                  uint64_t step, const std::string& name) {
#ifdef LORAPIPE_SAMPLER_CUDA_STREAMS
    // On CUDA a checkpoint's work (its LoRAs' merge, the renders, the restore as `merged` goes)
    // runs on one pool stream of the lowest priority. That is also the default streams'
    // priority, and priorities order kernels within a process only: beside a trainer in another
    // process it is --device_share that leaves the GPU's time to the training, not the stream.
    // One stream for all of it keeps the merge
    // ordered before the renders that read it (a pool stream does not wait on the default one),
    // and the same stream for every checkpoint lets the allocator, which caches blocks per
    // stream, reuse one render's memory for the next beside the trainer.
    std::optional<c10::cuda::CUDAStreamGuard> low_priority;
    if (device_.is_cuda()) {
      if (!render_stream_) {
        render_stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false,
                                                      device_.has_index() ? device_.index() : 0);
      }
      low_priority.emplace(*render_stream_);
    }
#endif
    MergedLoras merged;  // after the guard: restored on the render stream
    const std::string prefix = name.empty() ? "" : name + "_";  // NAME_<step>_<index>.png
    std::vector<std::string> images;
    std::vector<VImage> tiles;
    const auto start = std::chrono::steady_clock::now();
    std::chrono::steady_clock::duration yielded{};  // --device_share's waits
    try {
      std::string lora_names;
      for (const auto& [file, multiplier] : loras) {
        merged.add(*model_, file, multiplier,
                   o_.merge_lora ? models::MergedLora::Application::kMergedRestorable
                                 : models::MergedLora::Application::kInSlots);
        std::ostringstream weight;
        weight << multiplier;  // shortest form: 0.125 stays 0.125, 1 is 1
        lora_names += (lora_names.empty() ? "" : " ") + file.stem().string() + ":" + weight.str();
      }
      RenderOptions render_options;
      render_options.v_prediction = o_.v_prediction;
      render_options.clip_skip = o_.clip_skip;
      // --device_share: after each model call, the wait that leaves the device's time to the
      // trainer. A GPU runs two processes' kernels in time slices (without MPS), so a render
      // beside a training takes its share by launching less, not by a stream's priority.
      auto mark = std::chrono::steady_clock::now();
      if (device_share_ < 1 && !trainer_done_) {
        render_options.on_step = [&](int, const at::Tensor&) {
          if (device_.is_cuda()) torch::cuda::synchronize(device_.has_index() ? device_.index() : 0);
          const auto now = std::chrono::steady_clock::now();
          const auto wait = std::chrono::duration<double>(now - mark) * (1 / device_share_ - 1);
          std::this_thread::sleep_for(wait);
          mark = std::chrono::steady_clock::now();
          yielded += (mark - now);
        };
      }
      // Prompts are encoded once per prompt set: the base text encoder's conditionings are kept
      // for every checkpoint whose LoRA leaves the text encoder alone. A LoRA that trains it
      // (kohya's default for SD1.5) changes them: encoded once per prompt for that checkpoint.
      const bool own_text_encoder = merged.changes_text_encoder();
      std::vector<models::Conditioning> for_this_lora;
      for (size_t i = 0; i < prompts_.prompts.size(); ++i) {
        const RenderRequest& r = prompts_.prompts[i];
        std::vector<models::Conditioning>& kept = own_text_encoder ? for_this_lora : base_prompts_;
        if (kept.size() <= i) {
          kept.push_back(encode_request(*model_, r, o_.clip_skip));
          ++summary_.prompt_encodings;
        }
        render_options.conditioning = &kept[i];
        const RenderResult result = render(*model_, r, render_options);
        if (!result.not_finite.empty()) {
          LP_LOG(kWarning, kLog)
              << "step " << step << ", prompt " << r.index << " ('" << r.prompt
              << "'): NaN or infinity came out of the "
              << (result.not_finite == "denoising"
                      ? "denoiser, so the image is black (an overflow of --mixed_precision=fp16: "
                        "try bf16; or a weight of the model or LoRA that is not finite)"
                      : "VAE's decode of finite latents, so the image is black (a VAE that "
                        "overflows in this precision: try --mixed_precision=no)");
        }
        char file_name[64];
        std::snprintf(file_name, sizeof file_name, "%06llu_%02d.png",
                      static_cast<unsigned long long>(step), r.index);
        const fs::path path = o_.output_dir / "samples" / (prefix + file_name);
        VImage image = to_vips(result.image);
        write_png(path, image,
                  parameters_text(r, model_->model_family(), model_->source(), lora_names));
        images.push_back(path.filename().string());
        tiles.push_back(image);
        if (o_.delay_per_image_s > 0) {
          std::this_thread::sleep_for(std::chrono::duration<double>(o_.delay_per_image_s));
        }
        if (status_) {
          status_->progress(i + 1, prompts_.prompts.size(), "images of step " + std::to_string(step));
        }
      }
    } catch (const InputError& e) {
      LP_LOG(kError, kLog) << "step " << step << " not rendered: " << e.what();
      skip_reason_ = e.what();
      return false;
    } catch (const std::exception& e) {
      if (!models::is_out_of_memory(e)) throw;
      // Unwinding freed what the render held; `merged` restores the base as it goes, and a
      // merge that failed half-way put back what it had changed before throwing.
      skip_reason_ = "out of memory on " + models::describe_device(device_) + " (" +
                     first_line(e) + ")";
      LP_LOG(kError, kLog) << "step " << step << " not rendered: " << skip_reason_;
      return false;
    }
    merged.restore();  // the base back before anything else can fail
    char sheet_name[64];
    std::snprintf(sheet_name, sizeof sheet_name, "%06llu_sheet.png",
                  static_cast<unsigned long long>(step));
    const fs::path sheet = o_.output_dir / "samples" / (prefix + sheet_name);
    write_png(sheet,
              VImage::arrayjoin(
                  tiles, VImage::option()
                             ->set("across", static_cast<int>(std::min<size_t>(4, tiles.size())))
                             ->set("shim", 4)),
              "contact sheet, step " + std::to_string(step));
    // Each checkpoint keeps the prompts it rendered (the file may change between checkpoints);
    // the index's own are the newest, the gallery's columns.
    nlohmann::json prompts = nlohmann::json::array();
    for (const RenderRequest& r : prompts_.prompts) prompts.push_back(r.prompt);
    checkpoints_.push_back({{"step", step},
                            {"name", name},
                            {"images", images},
                            {"prompts", prompts},
                            {"sheet", sheet.filename().string()}});
    const nlohmann::json index{{"checkpoints", checkpoints_}, {"prompts", prompts}};
    try {
      write_text(o_.output_dir / "samples" / "samples.json", index.dump(1));
      write_text(o_.output_dir / "samples" / "samples.js",
                 "lorapipeSamples(" + index.dump() + ");\n");
    } catch (const Error& e) {
      // The images are written; the next checkpoint's index lists this one too.
      LP_LOG(kWarning, kLog) << "step " << step << ": the gallery's index is not updated: "
                             << e.what();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    last_seconds_per_image_ = seconds / static_cast<double>(images.size());
    LP_LOG(kInfo, kLog) << "step " << step << ": " << images.size() << " images in " << seconds
                        << " s (" << last_seconds_per_image_ << " s per image"
                        << (device_share_ < 1
                                ? ", of it " +
                                      std::to_string(std::chrono::duration<double>(yielded).count()) +
                                      " s left to the trainer (--device_share)"
                                : std::string())
                        << ")";
    summary_.images += static_cast<int>(images.size());
    summary_.steps_rendered.push_back(step);
    last_paths_.clear();
    for (const std::string& image : images) {
      last_paths_.push_back(fs::absolute(o_.output_dir / "samples" / image).string());
    }
    last_sheet_ = fs::absolute(sheet).string();
    return true;
  }

  SamplerSummary one_shot() {
    std::string name = o_.loras.empty() ? "base" : run_name(o_.loras.front().first);
    uint64_t step = 0;
    if (!o_.loras.empty()) {
      // kohya writes the step count into the file's metadata.
      try {
        const auto meta = models::SafetensorsFile::open(o_.loras.front().first).metadata();
        if (auto it = meta.find("ss_steps"); it != meta.end()) step = std::stoull(it->second);
      } catch (const std::exception&) {
      }
    }
    if (render_checkpoint(o_.loras, step, name)) {
      ++summary_.checkpoints_rendered;
    } else {
      throw InputError("nothing rendered: see the error above");
    }
    return summary_;
  }

  SamplerSummary follow() {
    return publishing([&](std::optional<zmq::socket_t>& pub) {
      LP_LOG(kInfo, kLog) << "following " << o_.sub_endpoint;
      follow_loop(*sub_, pub);
    });
  }

  // A run's previews after its training (the launcher's way when the sampler shares the
  // trainer's device and a second model would not fit beside it): every LoRA the run saved in
  // replay_dir, and the sample-only ones the trainer keeps in replay_dir/sample_only, rendered
  // in step order as if announced, each step once.
  SamplerSummary replay() {
    return publishing([&](std::optional<zmq::socket_t>& pub) {
      if (!fs::is_directory(o_.replay_dir)) {
        throw InputError(o_.replay_dir.string() + " (--replay_dir): no such folder");
      }
      std::map<uint64_t, fs::path> by_step;
      for (const fs::path& dir : {o_.replay_dir, o_.replay_dir / "sample_only"}) {
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(dir, ec)) {
          if (entry.path().extension() != ".safetensors") continue;
          // One unreadable file is named and left out; the others still render.
          std::map<std::string, std::string> meta;
          try {
            meta = models::SafetensorsFile::open(entry.path()).metadata();
          } catch (const std::exception& e) {
            LP_LOG(kWarning, kLog) << entry.path().string() << ": left out: " << e.what();
            continue;
          }
          const auto it = meta.find("ss_steps");
          if (it == meta.end()) {
            LP_LOG(kWarning, kLog) << entry.path().string() << ": no ss_steps: left out";
            continue;
          }
          by_step.emplace(std::stoull(it->second), entry.path());  // a save wins: listed first
        }
      }
      LP_LOG(kInfo, kLog) << "replaying " << by_step.size() << " checkpoints of "
                          << o_.replay_dir.string();
      for (const auto& [step, path] : by_step) {
        if (render_checkpoint({{path, 1.0}}, step, run_name(path))) {
          ++summary_.checkpoints_rendered;
          publish_ready(pub, "", step);
        } else {
          skipped(step);
        }
        status_->tick();
      }
    });
  }

  // A checkpoint not rendered: counted, and its reason published (the launcher shows a skip on
  // the screen, not only in the sampler's log).
  void skipped(uint64_t step) {
    ++summary_.checkpoints_skipped;
    if (status_) status_->ready("step " + std::to_string(step) + " skipped: " + skip_reason_);
  }

  // Runs `body` with the SampleReady socket bound (when --pub is given) and the stage's status
  // published on it.
  template <typename Body>
  SamplerSummary publishing(Body&& body) {
    std::optional<zmq::socket_t> pub;
    if (!o_.pub_endpoint.empty()) {
      pub.emplace(wire::make_socket(context_, zmq::socket_type::pub));
      pub->bind(o_.pub_endpoint);
    }
    // status_ points at `pub`, which goes at the end of this function: so does status_.
    status_.emplace(pub ? &*pub : nullptr, std::string(kLog));
    struct DropStatus {
      std::optional<runtime::StatusPublisher>& status;
      ~DropStatus() { status.reset(); }
    } drop_status{status_};
    // The launcher shows this line: prompt lines skipped or read leniently are worth the screen.
    std::string ready = std::to_string(prompts_.prompts.size()) + " prompts";
    if (!prompts_.problems.empty() || !prompts_.notes.empty()) {
      ready += "; in " + o_.sample_prompts.filename().string() + ", lines skipped: " +
               std::to_string(prompts_.problems.size()) +
               ", read leniently: " + std::to_string(prompts_.notes.size()) +
               " (the log says which)";
    }
    status_->ready(ready);
    try {
      body(pub);
    } catch (const std::exception& e) {
      status_->error(e.what());
      throw;
    }
    status_->done(std::to_string(summary_.checkpoints_rendered) + " checkpoints rendered" +
                  (summary_.checkpoints_skipped > 0
                       ? ", " + std::to_string(summary_.checkpoints_skipped) + " skipped"
                       : std::string()));
    return summary_;
  }

  // Renders the newest announced checkpoint, again and again, until the final one (or
  // --idle_timeout_s without any).
  void follow_loop(zmq::socket_t& sub, std::optional<zmq::socket_t>& pub) {
    auto last_event = std::chrono::steady_clock::now();
    while (true) {
      // The newest announced checkpoint: wait for one, then take everything queued.
      std::optional<wire::CheckpointReady> newest;
      auto take = [&](const wire::Received& received) {
        const auto* event = received.as<wire::CheckpointReady>();
        if (event == nullptr) return;
        if (newest) ++summary_.checkpoints_superseded;
        if (!newest || event->step() >= newest->step() || event->final()) newest = *event;
      };
      status_->tick();
      take(wire::receive(sub, std::chrono::milliseconds(500)));
      while (newest) {
        const wire::Received more = wire::receive(sub, std::chrono::milliseconds(0));
        if (more.status == wire::ReceiveStatus::kTimeout) break;
        take(more);
      }
      if (!newest) {
        const double idle =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - last_event).count();
        if (o_.idle_timeout_s > 0 && idle > o_.idle_timeout_s) {
          LP_LOG(kInfo, kLog) << "no checkpoint for " << idle << " s: stopping";
          return;
        }
        continue;
      }
      last_event = std::chrono::steady_clock::now();
      if (rendered_any_ && newest->step() <= last_step_ && !newest->final()) {
        continue;  // announced again, or older than what is already rendered
      }
      const fs::path path = newest->path();
      rendered_any_ = true;
      last_step_ = newest->step();
      // Named after the run's --output_name, as the trainer announces it; a run without one
      // (kohya's at-step..., epoch-..., last files) has its samples named by step alone, as
      // kohya names them.
      // The final checkpoint comes once the training is over: a trainer sharing its weights
      // only waits for this render to let them go, so it takes the whole device.
      trainer_done_ = newest->final();
      if (render_checkpoint({{path, 1.0}}, newest->step(), newest->output_name())) {
        ++summary_.checkpoints_rendered;
        publish_ready(pub, newest->run_id(), newest->step());
      } else {
        skipped(newest->step());
      }
      if (newest->final()) {
        LP_LOG(kInfo, kLog) << "rendered the run's final checkpoint: done";
        return;
      }
    }
  }

 private:
  // SampleReady for the checkpoint just rendered.
  void publish_ready(std::optional<zmq::socket_t>& pub, const std::string& run_id, uint64_t step) {
    if (!pub) return;
    wire::SampleReady ready;
    ready.set_seconds_per_image(last_seconds_per_image_);
    ready.set_run_id(run_id);
    ready.set_step(step);
    for (const std::string& p : last_paths_) ready.add_image_paths(p);
    ready.set_contact_sheet(last_sheet_);
    ready.set_gallery(fs::absolute(o_.output_dir / "samples" / "index.html").string());
    (void)wire::send(*pub, ready);
  }

  static void report_prompt_lines(const PromptSet& prompts) {
    for (const std::string& problem : prompts.problems) {
      LP_LOG(kWarning, kLog) << "skipped " << problem;
    }
    for (const std::string& note : prompts.notes) LP_LOG(kWarning, kLog) << note;
  }

  // The prompt file's modification time and size; nothing where it cannot be read.
  std::optional<std::pair<fs::file_time_type, uintmax_t>> prompt_file_stamp() const {
    std::error_code ec;
    const fs::file_time_type time = fs::last_write_time(o_.sample_prompts, ec);
    if (ec) return std::nullopt;
    const uintmax_t size = fs::file_size(o_.sample_prompts, ec);
    if (ec) return std::nullopt;
    return std::make_pair(time, size);
  }

  // kohya reads the prompt file at every sampling, so a user edits it during a long run and the
  // next previews follow: so here, before each checkpoint's renders, where its time or size
  // changed. A file that no longer reads (or holds no prompt) keeps the prompts read before, and
  // says so once per change.
  void reread_changed_prompts() {
    const auto stamp = prompt_file_stamp();
    if (!stamp || stamp == prompts_read_) return;
    prompts_read_ = stamp;
    try {
      PromptSet fresh = read_prompts(o_, model_->model_family());
      report_prompt_lines(fresh);
      prompts_ = std::move(fresh);
      base_prompts_.clear();  // encoded for the prompts before
      LP_LOG(kInfo, kLog) << o_.sample_prompts.string() << " changed: "
                          << prompts_.prompts.size() << " prompts from now on";
    } catch (const InputError& e) {
      LP_LOG(kWarning, kLog) << e.what() << ": rendering the " << prompts_.prompts.size()
                             << " prompts read before";
    }
  }

  SamplerOptions o_;
  zmq::context_t context_;
  std::optional<zmq::socket_t> sub_;  // following a run: CheckpointReady
  // The trainer's weights the denoiser is attached to: released after model_ (declared before
  // it), so the trainer frees nothing this process still maps.
  std::unique_ptr<models::SharedWeightsAttachment> shared_;
  std::unique_ptr<models::DiffusionModel> model_;
  PromptSet prompts_;
  std::optional<std::pair<fs::file_time_type, uintmax_t>> prompts_read_;  // the file's stamp then
  SamplerSummary summary_;
  std::string skip_reason_;  // why the last checkpoint not rendered was not
  std::optional<runtime::StatusPublisher> status_;  // while following a run
  nlohmann::json checkpoints_ = nlohmann::json::array();
  std::vector<std::string> last_paths_;
  std::string last_sheet_;
  double last_seconds_per_image_ = 0;
  // The base text encoder's conditioning of each prompt, encoded at its first render.
  std::vector<models::Conditioning> base_prompts_;
  c10::Device device_ = c10::kCPU;
#ifdef LORAPIPE_SAMPLER_CUDA_STREAMS
  std::optional<c10::cuda::CUDAStream> render_stream_;  // every checkpoint's, made once
#endif
  double device_share_ = 1;  // --device_share, resolved
  bool trainer_done_ = false;  // rendering the final checkpoint: --device_share no longer holds
  bool rendered_any_ = false;
  uint64_t last_step_ = 0;
};

}  // namespace

PromptSet check_sampler_options(const SamplerOptions& options) {
  if (options.model.empty()) throw InputError("--pretrained_model_name_or_path is required");
  if (options.sample_prompts.empty()) throw InputError("--sample_prompts is required");
  if (options.output_dir.empty()) throw InputError("--output_dir is required");
  if (options.fp8_scaled && !options.fp8_base && !options.fp8_base_unet) {
    throw InputError("--fp8_scaled scales the float8 weights of --fp8_base or --fp8_base_unet: "
                     "give one of them");
  }
  if (!options.shared_weights.empty() && options.merge_lora) {
    throw InputError("--merge_lora writes the base weights, which --shared_weights="
                     + options.shared_weights.string() + " shares read-only with the trainer: "
                     "leave --merge_lora out (LoRAs are then applied beside the weights)");
  }
  if (options.blocks_to_swap < 0) {
    throw InputError("--blocks_to_swap=" + std::to_string(options.blocks_to_swap) +
                     ": must be 0 or more");
  }
  if (options.blocks_to_swap > 0 && options.merge_lora) {
    throw InputError("--merge_lora writes the base weights, and --blocks_to_swap=" +
                     std::to_string(options.blocks_to_swap) + " keeps some of them in host "
                     "memory only: leave --merge_lora out (LoRAs are then applied beside the "
                     "weights)");
  }
  if (options.blocks_to_swap > 0 && !options.shared_weights.empty()) {
    throw InputError("--blocks_to_swap keeps weights in host memory, and --shared_weights=" +
                     options.shared_weights.string() + " renders over the trainer's on the "
                     "device: give one of them");
  }
  if (options.device_share != -1 && !(options.device_share > 0 && options.device_share <= 1)) {
    std::ostringstream value;
    value << options.device_share;
    throw InputError("--device_share=" + value.str() + ": a share of the device's time, above 0 "
                     "and at most 1 (or -1: the default)");
  }
  if (options.fp8_fast && !options.fp8_scaled) {
    throw InputError("--fp8_fast multiplies scaled float8 weights in float8: give --fp8_scaled "
                     "(and --fp8_base)");
  }
  if (!fs::exists(options.model)) {
    throw InputError("--pretrained_model_name_or_path=" + options.model.string() +
                     ": no such file or folder");
  }
  // A model that declares v-prediction is refused here, before the run starts, not at its load.
  models::check_declared_objective(options.model, options.v_prediction, std::nullopt);
  (void)models::resolve_device(options.device);
  (void)models::parse_precision(options.mixed_precision, "--mixed_precision");
  const models::FamilyDetection detected =
      models::detect_family(options.model, options.model_family);
  return read_prompts(options, models::model_family(detected.family));
}

SamplerSummary run_sampler(const SamplerOptions& options) {
  check_sampler_options(options);
  if (options.sub_endpoint.empty() && options.loras.empty()) {
    LP_LOG(kInfo, kLog) << "no --sub and no --lora: rendering the base model";
  }
  torch::NoGradGuard no_grad;
  if (options.threads > 0) torch::set_num_threads(options.threads);
  Sampler sampler(options);
  if (!options.replay_dir.empty()) return sampler.replay();
  return options.sub_endpoint.empty() ? sampler.one_shot() : sampler.follow();
}

}  // namespace lorapipe::sampler
