#include "models/t5_tokenizer.h"

#include <algorithm>
#include <cfloat>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <unordered_map>

#include "common/error.h"

namespace lorapipe::models {
namespace {

// ---- protobuf wire format: just enough to read a SentencePiece ModelProto ----------------------
// ModelProto: pieces = 1 (piece = 1, score = 2 (float), type = 3), trainer_spec = 2
// (model_type = 3, treat_whitespace_as_suffix = 24, byte_fallback = 35), normalizer_spec = 3
// (name = 1, precompiled_charsmap = 2, add_dummy_prefix = 3, remove_extra_whitespaces = 4,
// escape_whitespaces = 5).

struct Field {
  uint32_t number = 0;
  uint32_t wire = 0;
  uint64_t varint = 0;     // wire types 0, 1, 5 (fixed widths read little-endian)
  std::string_view bytes;  // wire type 2
};

uint64_t read_varint(std::string_view data, size_t& at) {
  uint64_t value = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (at >= data.size()) throw std::runtime_error("truncated varint");
    const auto byte = static_cast<uint8_t>(data[at++]);
    value |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if (!(byte & 0x80)) return value;
  }
  throw std::runtime_error("varint too long");
}

std::vector<Field> fields(std::string_view data) {
  std::vector<Field> out;
  size_t at = 0;
  while (at < data.size()) {
    const uint64_t tag = read_varint(data, at);
    Field f;
    f.number = static_cast<uint32_t>(tag >> 3);
    f.wire = static_cast<uint32_t>(tag & 7);
    auto fixed = [&](size_t width) {
      if (data.size() - at < width) throw std::runtime_error("truncated field");
      for (size_t i = 0; i < width; ++i) {
        f.varint |= static_cast<uint64_t>(static_cast<uint8_t>(data[at + i])) << (8 * i);
      }
      at += width;
    };
    switch (f.wire) {
      case 0:
        f.varint = read_varint(data, at);
        break;
      case 1:
        fixed(8);
        break;
      case 5:
        fixed(4);
        break;
      case 2: {
        const uint64_t n = read_varint(data, at);
        if (n > data.size() - at) throw std::runtime_error("truncated field");
        f.bytes = data.substr(at, n);
        at += n;
        break;
      }
      default:
        throw std::runtime_error("unsupported wire type " + std::to_string(f.wire));
    }
    out.push_back(f);
  }
  return out;
}

constexpr std::string_view kSpaceSymbol = "\xe2\x96\x81";  // "▁", U+2581
constexpr float kUnkPenalty = 10.0f;                       // unigram_model.h

// The byte length of the UTF-8 character at `s` (1 for an invalid lead byte).
size_t char_length(std::string_view s) {
  const auto c = static_cast<uint8_t>(s[0]);
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  return std::min(n, s.size());
}

// Whether `s` starts with a valid UTF-8 character (SentencePiece's IsValidDecodeUTF8 for one).
bool valid_utf8_char(std::string_view s, size_t* length) {
  const size_t n = char_length(s);
  *length = n;
  const auto c = static_cast<uint8_t>(s[0]);
  if (n == 1) return c < 0x80;
  for (size_t i = 1; i < n; ++i) {
    if ((static_cast<uint8_t>(s[i]) & 0xc0) != 0x80) return false;
  }
  if (s.size() < n) return false;
  uint32_t cp = c & (0xff >> (n + 1));
  for (size_t i = 1; i < n; ++i) cp = (cp << 6) | (static_cast<uint8_t>(s[i]) & 0x3f);
  const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
  return cp >= min[n] && cp <= 0x10ffff && !(cp >= 0xd800 && cp <= 0xdfff);
}

}  // namespace

// The model, as SentencePiece holds it for encoding.
struct T5Tokenizer::Model {
  // The precompiled character map: a Darts-clone double array over UTF-8 bytes whose values are
  // offsets of NUL-terminated replacements in `replacements`.
  std::vector<uint32_t> trie;
  std::string replacements;
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
  // The pieces the Viterbi path may take (NORMAL and USER_DEFINED), by their text.
  std::unordered_map<std::string, std::pair<int64_t, float>> pieces;
  std::vector<bool> user_defined;  // by id
  size_t longest_piece = 0;
  float min_score = FLT_MAX, max_score = FLT_MIN;

  // The longest replacement of `input`'s prefix, and the bytes it consumes (normalizer.cc
  // NormalizePrefix).
  std::pair<std::string_view, size_t> normalize_prefix(std::string_view input) const {
    size_t longest = 0;
    uint32_t value = 0;
    if (!trie.empty()) {
      // Darts-clone's commonPrefixSearch: unit fields as darts.h lays them out.
      auto offset = [](uint32_t u) { return (u >> 10) << ((u & (1u << 9)) >> 6); };
      auto label = [](uint32_t u) { return u & ((1u << 31) | 0xffu); };
      auto has_leaf = [](uint32_t u) { return ((u >> 8) & 1u) == 1u; };
      size_t node = offset(trie[0]);
      for (size_t i = 0; i < input.size(); ++i) {
        const auto c = static_cast<uint8_t>(input[i]);
        node ^= c;
        if (node >= trie.size()) break;
        const uint32_t unit = trie[node];
        if (label(unit) != c) break;
        node ^= offset(unit);
        if (node >= trie.size()) break;
        if (has_leaf(unit)) {
          longest = i + 1;
          value = trie[node] & ((1u << 31) - 1);
        }
      }
    }
    if (longest == 0) {
      size_t length = 0;
      if (!valid_utf8_char(input, &length)) return {"\xef\xbf\xbd", 1};  // U+FFFD
      return {input.substr(0, length), length};
    }
    if (value >= replacements.size()) throw InputError("T5 tokenizer: a broken character map");
    return {std::string_view(replacements.c_str() + value), longest};
  }
};

T5Tokenizer::T5Tokenizer() = default;
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
  t.model_ = std::make_unique<Model>();
  Model& m = *t.model_;
  auto fail = [&source](const std::string& why) {
    throw InputError(source + ": not a SentencePiece unigram model T5 uses (" + why + ")");
  };
  std::vector<std::tuple<std::string, float, int>> pieces;  // text, score, type
  try {
    for (const Field& f : fields(bytes)) {
      if (f.number == 1 && f.wire == 2) {
        std::tuple<std::string, float, int> piece{"", 0.0f, 1};
        for (const Field& g : fields(f.bytes)) {
          if (g.number == 1) std::get<0>(piece) = std::string(g.bytes);
          if (g.number == 2) {
            const auto raw = static_cast<uint32_t>(g.varint);
            float score;
            std::memcpy(&score, &raw, sizeof score);
            std::get<1>(piece) = score;
          }
          if (g.number == 3) std::get<2>(piece) = static_cast<int>(g.varint);
        }
        pieces.push_back(std::move(piece));
      } else if (f.number == 2 && f.wire == 2) {
        for (const Field& g : fields(f.bytes)) {
          if (g.number == 3 && g.varint != 1) fail("model_type " + std::to_string(g.varint));
          if (g.number == 24 && g.varint != 0) fail("treat_whitespace_as_suffix");
          if (g.number == 35 && g.varint != 0) fail("byte_fallback");
        }
      } else if (f.number == 3 && f.wire == 2) {
        for (const Field& g : fields(f.bytes)) {
          if (g.number == 2) {
            const std::string_view blob = g.bytes;
            if (blob.size() < 4) fail("a character map without its trie size");
            uint32_t trie_bytes = 0;
            for (int i = 0; i < 4; ++i) {
              trie_bytes |= static_cast<uint32_t>(static_cast<uint8_t>(blob[i])) << (8 * i);
            }
            if (trie_bytes % 4 != 0 || trie_bytes > blob.size() - 4) fail("a broken character map");
            m.trie.resize(trie_bytes / 4);
            for (size_t i = 0; i < m.trie.size(); ++i) {
              uint32_t u = 0;
              for (int b = 0; b < 4; ++b) {
                u |= static_cast<uint32_t>(static_cast<uint8_t>(blob[4 + 4 * i + b])) << (8 * b);
              }
              m.trie[i] = u;
            }
            m.replacements = std::string(blob.substr(4 + trie_bytes));
          }
          if (g.number == 3) m.add_dummy_prefix = g.varint != 0;
          if (g.number == 4) m.remove_extra_whitespaces = g.varint != 0;
          if (g.number == 5) m.escape_whitespaces = g.varint != 0;
        }
      }
    }
  } catch (const std::runtime_error& e) {
    fail(e.what());
  }
  if (pieces.empty()) fail("no pieces");
  // Piece types: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6.
  t.pieces_ = static_cast<int64_t>(pieces.size());
  t.unk_id_ = t.eos_id_ = t.pad_id_ = -1;
  m.user_defined.assign(pieces.size(), false);
  for (size_t id = 0; id < pieces.size(); ++id) {
    const auto& [text, score, type] = pieces[id];
    if (type == 2) t.unk_id_ = static_cast<int64_t>(id);
    if (type == 3 && text == "</s>") t.eos_id_ = static_cast<int64_t>(id);
    if (type == 3 && text == "<pad>") t.pad_id_ = static_cast<int64_t>(id);
    if (type == 1) {
      m.min_score = std::min(m.min_score, score);
      m.max_score = std::max(m.max_score, score);
    }
    if ((type == 1 || type == 4) && !text.empty()) {
      m.pieces.emplace(text, std::make_pair(static_cast<int64_t>(id), score));
      m.longest_piece = std::max(m.longest_piece, text.size());
      m.user_defined[id] = type == 4;
    }
  }
  if (t.eos_id_ < 0 || t.pad_id_ < 0 || t.unk_id_ < 0) {
    fail("T5's tokenizer needs </s>, <pad> and <unk> pieces");
  }
  t.specials_ = {
      {"</s>", t.eos_id_}, {"<pad>", t.pad_id_}, {std::get<0>(pieces[t.unk_id_]), t.unk_id_}};
  for (int i = 0; i < kExtraIds; ++i) {  // transformers numbers them from the end
    t.specials_.emplace_back("<extra_id_" + std::to_string(i) + ">", t.pieces_ + kExtraIds - 1 - i);
  }
  std::stable_sort(t.specials_.begin(), t.specials_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  return t;
}

// normalizer.cc Normalizer::Normalize, without offsets.
std::string T5Tokenizer::normalize(std::string_view input) const {
  const Model& m = *model_;
  std::string out;
  if (m.remove_extra_whitespaces) {  // leading whitespace
    while (!input.empty()) {
      const auto [piece, consumed] = m.normalize_prefix(input);
      if (piece != " ") break;
      input.remove_prefix(consumed);
    }
  }
  if (input.empty()) return out;
  const std::string_view space = m.escape_whitespaces ? kSpaceSymbol : " ";
  if (m.add_dummy_prefix) out.append(space);
  bool previous_space = m.remove_extra_whitespaces;
  while (!input.empty()) {
    auto [piece, consumed] = m.normalize_prefix(input);
    if (previous_space) {
      while (!piece.empty() && piece.front() == ' ') piece.remove_prefix(1);
    }
    if (!piece.empty()) {
      for (char c : piece) {
        if (c == ' ' && m.escape_whitespaces) {
          out.append(kSpaceSymbol);
        } else {
          out.push_back(c);
        }
      }
      previous_space = piece.back() == ' ';
    }
    input.remove_prefix(consumed);
    if (!m.remove_extra_whitespaces) previous_space = false;
  }
  if (m.remove_extra_whitespaces) {  // trailing whitespace
    while (out.size() >= space.size() &&
           out.compare(out.size() - space.size(), space.size(), space) == 0) {
      out.resize(out.size() - space.size());
    }
  }
  return out;
}

// unigram_model.cc Model::EncodeOptimized (the Viterbi path), then SentencePieceProcessor's merge
// of adjacent unknown pieces.
void T5Tokenizer::segment(const std::string& normalized, std::vector<int64_t>& ids) const {
  const Model& m = *model_;
  struct Node {
    int64_t id = -1;
    float score = 0;
    int64_t starts_at = -1;
  };
  const auto size = static_cast<int64_t>(normalized.size());
  const float unk_score = m.min_score - kUnkPenalty;
  std::vector<Node> best(static_cast<size_t>(size) + 1);
  for (int64_t start = 0; start < size;) {
    const float till_here = best[start].score;
    const auto one_char = static_cast<int64_t>(
        char_length(std::string_view(normalized).substr(static_cast<size_t>(start))));
    bool has_single = false;
    const int64_t longest = std::min<int64_t>(static_cast<int64_t>(m.longest_piece), size - start);
    for (int64_t length = 1; length <= longest; ++length) {
      const auto it = m.pieces.find(normalized.substr(static_cast<size_t>(start), length));
      if (it == m.pieces.end()) continue;
      const auto [id, piece_score] = it->second;
      const float score = m.user_defined[static_cast<size_t>(id)]
                              ? static_cast<float>(length) * m.max_score - 0.1f
                              : piece_score;
      Node& target = best[static_cast<size_t>(start + length)];
      const float candidate = score + till_here;
      if (target.starts_at == -1 || candidate > target.score) target = {id, candidate, start};
      if (length == one_char) has_single = true;
    }
    if (!has_single) {
      Node& target = best[static_cast<size_t>(start + one_char)];
      const float candidate = unk_score + till_here;
      if (target.starts_at == -1 || candidate > target.score) target = {unk_id_, candidate, start};
    }
    start += one_char;
  }
  std::vector<int64_t> path;
  for (int64_t end = size; end > 0; end = best[static_cast<size_t>(end)].starts_at) {
    path.push_back(best[static_cast<size_t>(end)].id);
  }
  bool previous_unknown = false;
  for (auto it = path.rbegin(); it != path.rend(); ++it) {
    const bool unknown = *it == unk_id_;
    if (!(unknown && previous_unknown)) ids.push_back(*it);
    previous_unknown = unknown;
  }
}

std::vector<int64_t> T5Tokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  auto encode_piece = [&](std::string_view piece) {
    if (!piece.empty()) segment(normalize(piece), ids);
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
