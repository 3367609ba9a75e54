#include "models/t5_tokenizer.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <fstream>
#include <iterator>

#include "common/error.h"

namespace lorapipe::models {
T5Tokenizer::~T5Tokenizer() = default;
T5Tokenizer::T5Tokenizer(T5Tokenizer&&) noexcept = default;
T5Tokenizer& T5Tokenizer::operator=(T5Tokenizer&&) noexcept = default;

T5Tokenizer T5Tokenizer::from_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path.string() + ": cannot read the T5 tokenizer (spiece.model)");
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return from_serialized(bytes, path.string());
}

T5Tokenizer T5Tokenizer::from_serialized(std::string_view bytes, const std::string& source) {
  T5Tokenizer t;
  t.source_ = source;
  t.processor_ = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const auto status = t.processor_->LoadFromSerializedProto(bytes);
  if (!status.ok()) {
    throw InputError(source + ": not a SentencePiece model: " + status.ToString());
  }
  const auto& sp = *t.processor_;
  t.pieces_ = sp.GetPieceSize();
  t.eos_id_ = sp.eos_id();
  t.pad_id_ = sp.pad_id();
  t.unk_id_ = sp.unk_id();
  if (t.eos_id_ < 0 || t.pad_id_ < 0 || t.unk_id_ < 0) {
    throw InputError(source + ": a T5 tokenizer needs </s>, <pad> and <unk> pieces");
  }
  for (int64_t id : {t.eos_id_, t.pad_id_, t.unk_id_}) {
    t.specials_.emplace_back(sp.IdToPiece(static_cast<int>(id)), id);
  }
  for (int i = 0; i < kExtraIds; ++i) {  // transformers numbers them from the end
    t.specials_.emplace_back("<extra_id_" + std::to_string(i) + ">", t.pieces_ + kExtraIds - 1 - i);
  }
  std::stable_sort(t.specials_.begin(), t.specials_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  return t;
}

std::vector<int64_t> T5Tokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  auto encode_piece = [&](std::string_view piece) {
    if (piece.empty()) return;
    for (int id : processor_->EncodeAsIds(piece)) ids.push_back(id);
  };
  size_t start = 0;
  for (size_t at = 0; at < text.size();) {
    const std::pair<std::string, int64_t>* match = nullptr;
    if (text[at] == '<') {
      for (const auto& special : specials_) {
        if (text.compare(at, special.first.size(), special.first) == 0) {
          match = &special;
          break;
        }
      }
    }
    if (match == nullptr) {
      ++at;
      continue;
    }
    encode_piece(text.substr(start, at - start));
    ids.push_back(match->second);
    at += match->first.size();
    start = at;
  }
  encode_piece(text.substr(start));
  return ids;
}

std::vector<int64_t> T5Tokenizer::encode_padded(std::string_view text, int max_length,
                                                int* length) const {
  if (max_length < 1) throw InputError("a T5 token length must be at least 1");
  std::vector<int64_t> ids = encode(text);
  if (static_cast<int>(ids.size()) > max_length - 1) ids.resize(max_length - 1);
  ids.push_back(eos_id_);
  if (length != nullptr) *length = static_cast<int>(ids.size());
  ids.resize(static_cast<size_t>(max_length), pad_id_);
  return ids;
}

}  // namespace lorapipe::models
