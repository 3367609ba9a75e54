#include "preprocess/jpeg_huffman.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>  // jpeglib.h needs FILE and size_t declared first
#include <cstdlib>
#include <cstring>
#include <vector>

#include <jpeglib.h>
#include <jerror.h>
#include <jpegint.h>  // struct jpeg_entropy_decoder

// The decoder reaches into libjpeg-turbo's internals (jpegint.h: jpeg_entropy_decoder, the
// decompressor's inputctl and the MCU geometry), which are not a stable interface. It is built
// only against the releases whose layout it was written and tested for: libjpeg-turbo 2.0 and
// 2.1 with the libjpeg 6.2 API (Debian 12 ships 2.1.5). Against anything else it compiles to
// "never installed", and every JPEG keeps libjpeg-turbo's own decoder. jpeg.h's start-up
// self-test also checks, with the library actually loaded, that both decoders agree.
#if defined(LIBJPEG_TURBO_VERSION_NUMBER) && LIBJPEG_TURBO_VERSION_NUMBER >= 2000000 && \
    LIBJPEG_TURBO_VERSION_NUMBER < 2002000 && JPEG_LIB_VERSION == 62
#define LORAPIPE_FAST_HUFFMAN 1
#else
#define LORAPIPE_FAST_HUFFMAN 0
#endif

namespace lorapipe::preprocess {
namespace {

// A code of up to kFastBits bits is found with one lookup; with its value bits too, when they fit.
// 11 bits cover nearly every code of a photo's luma and chroma tables, and a table of 2^11
// four-byte entries is 8 KiB, so the two or four tables of a scan stay in L1.
constexpr int kFastBits = 11;
// Destuffed input is decoded from a window of this size, refilled as the reader nears its end.
constexpr size_t kWindowBytes = size_t{1} << 16;
// Bytes one MCU can take at most: 10 blocks, each a DC and up to 63 ACs of at most 16 code bits
// and 15 value bits, is 2500 bytes. Before each MCU the window holds at least this much ahead of
// the reader, or the segment has ended and at least this many zeros follow its last byte, so the
// reader stays inside the buffer on any data, corrupt included.
constexpr size_t kMcuBytes = 4096;
constexpr size_t kReadAhead = 8;  // a refill loads 8 bytes

// A fast-table entry (64 bits):
//   bits  0-5   bits consumed: the code, plus the value bits when the kind is kValue, plus the
//               second symbol's when there is one (low, so the shift takes the entry as it is)
//   bits  6-7   kind
//   bits  8-13  bits of the first symbol alone (kValue)
//   bits 16-31  the first coefficient (kValue)
//   bits 32-39  the first symbol: run in its high nibble, size in the low
//   bits 40-47  for kValue, the step from the first coefficient's position to the second's: 0 when
//               there is no second (the second write repeats the first), 1 + run for a second
//               coefficient or ZRL, 64 for an end of block (it ends the block's loop)
//   bits 48-63  the second coefficient (kValue)
// An AC entry holds two symbols when both fit in the lookup bits with their value bits, which at
// photo bit rates (under 5 bits a symbol) is most lookups. End of block and ZRL are kValue
// entries too, writing a zero where no coefficient has been written yet (a position still to
// come, or the guard past 63), so the common path has no branch on the symbol.
enum Kind : uint64_t {
  kValue = 0 << 6,      // complete symbol(s)
  kCodeOnly = 1 << 6,   // the value bits run past kFastBits: read them separately
  kLongCode = 3 << 6,   // the code is longer than kFastBits: canonical decode
};
constexpr uint64_t kKindMask = 3 << 6;
constexpr uint64_t kLengthMask = 63;
constexpr uint64_t kEndOfBlockStep = 64;

constexpr uint64_t value_entry(uint32_t length, uint32_t first_length, uint32_t symbol,
                               int32_t first, uint32_t step, int32_t second) {
  return kValue | length | uint64_t{first_length} << 8 |
         uint64_t{static_cast<uint16_t>(first)} << 16 |
         uint64_t{symbol} << 32 | uint64_t{step} << 40 |
         uint64_t{static_cast<uint16_t>(second)} << 48;
}

// Zigzag index to natural (row-major) position, with guard entries past 63 that land on 63 as
// libjpeg's jpeg_natural_order does: a corrupt run overflows there, and the two-symbol path's
// second write reaches k + 64 at most.
constexpr std::array<uint8_t, 128> natural_order() {
  std::array<uint8_t, 128> order{};
  int k = 0;
  for (int diagonal = 0; diagonal < 15; ++diagonal) {  // row + column, alternating direction
    for (int i = 0; i <= diagonal; ++i) {
      const int row = diagonal % 2 == 0 ? diagonal - i : i;
      const int column = diagonal - row;
      if (row < 8 && column < 8) order[k++] = static_cast<uint8_t>(row * 8 + column);
    }
  }
  for (; k < 128; ++k) order[k] = 63;
  return order;
}
constexpr std::array<uint8_t, 128> kNatural = natural_order();
static_assert(kNatural[2] == 8 && kNatural[3] == 16 && kNatural[63] == 63 && kNatural[62] == 62);

struct Table {
  uint64_t fast[1 << kFastBits];
  int32_t max_code[17];      // largest code of each length, or -1 when there is none
  int32_t value_offset[17];  // index in `symbols` of a code of that length, minus the code
  uint8_t symbols[256];
};

struct Decoder {
  jpeg_entropy_decoder pub;  // first, so libjpeg's cinfo->entropy points at the whole
  const Table* dc[D_MAX_BLOCKS_IN_MCU];
  const Table* ac[D_MAX_BLOCKS_IN_MCU];
  int component[D_MAX_BLOCKS_IN_MCU];  // index in cur_comp_info, for the DC predictor
  int32_t predictor[MAX_COMPS_IN_SCAN];
  unsigned restarts_to_go;
  int next_restart;      // RSTn expected next, 0-7
  unsigned long mcus_left;
  // Input not yet destuffed, up to the end of the file.
  const uint8_t* raw;
  const uint8_t* raw_end;
  // What ended the current entropy-coded segment once the destuffer reached it: a marker code,
  // kEndOfData when the file ended first, kBadStuffing at invalid stuffing; 0 while it goes on.
  int segment_end;
  // Destuffed bytes of the current segment; window[window_len...] is zeros once it has ended.
  uint8_t* window;
  size_t window_len;
  // Bit reader: `bits` holds `count` unconsumed bits at its top, the bits before `next`.
  const uint8_t* next;
  uint64_t bits;
  int count;
};

constexpr int kEndOfData = 0x100;
constexpr int kBadStuffing = 0x101;

[[noreturn]] void corrupt(j_decompress_ptr info) {
  info->err->msg_code = JWRN_HUFF_BAD_CODE;
  (*info->err->error_exit)(reinterpret_cast<j_common_ptr>(info));
  std::abort();  // error_exit does not return
}

// The value of `bits` value bits of size `size` (JPEG F.12: a leading 0 means negative).
inline int32_t extend(uint32_t bits, int size) {
  return bits < (1u << (size - 1)) ? static_cast<int32_t>(bits) - (1 << size) + 1
                                   : static_cast<int32_t>(bits);
}

// Canonical codes per JPEG annex C, checked as libjpeg checks them (jpeg_make_d_derived_tbl). For
// a DC table a symbol is the size of the difference that follows it, run 0.
bool build_table(const JHUFF_TBL& source, bool dc, Table* table) {
  int total = 0;
  for (int length = 1; length <= 16; ++length) total += source.bits[length];
  if (total > 256) return false;
  std::memcpy(table->symbols, source.huffval, sizeof(table->symbols));
  for (uint64_t& entry : table->fast) entry = kLongCode;
  uint32_t code = 0;
  int index = 0;
  for (uint32_t length = 1; length <= 16; ++length) {
    // Over-subscribed, or an all-ones code: checked before any slot of this length is filled.
    if (code + source.bits[length] >= (1u << length)) return false;
    table->value_offset[length] = index - static_cast<int32_t>(code);
    for (int i = 0; i < source.bits[length]; ++i, ++index, ++code) {
      const uint32_t symbol = source.huffval[index];
      if (dc && symbol > 15) return false;
      if (length > kFastBits) continue;
      const uint32_t size = symbol & 15;
      const uint32_t first = code << (kFastBits - length);
      for (uint32_t slot = first; slot < first + (1u << (kFastBits - length)); ++slot) {
        uint64_t& entry = table->fast[slot];
        if (!dc && size == 0 && symbol != 0xF0) {  // end of block (any run but 15)
          entry = value_entry(length, length, symbol, 0, kEndOfBlockStep, 0);
        } else if (size == 0) {  // a DC difference of 0, or ZRL: a run of 16 zeros
          entry = value_entry(length, length, symbol, 0, 0, 0);
        } else if (length + size <= kFastBits) {
          const uint32_t value_bits = (slot >> (kFastBits - length - size)) & ((1u << size) - 1);
          const int32_t value = extend(value_bits, static_cast<int>(size));
          entry = value_entry(length + size, length + size, symbol, value, 0, value);
        } else {
          entry = kCodeOnly | length | uint64_t{symbol} << 32;
        }
      }
    }
    table->max_code[length] = source.bits[length] ? static_cast<int32_t>(code) - 1 : -1;
    code <<= 1;
  }
  if (dc) return true;
  // Pair each complete AC symbol, other than an end of block, with a complete second one that
  // fits in the bits after it. The second is read from the single-symbol entry of those bits
  // (shifted up, zeros below), which is only valid when its length fits in what is left.
  const std::vector<uint64_t> single(std::begin(table->fast), std::end(table->fast));
  constexpr uint32_t kSlotMask = (1u << kFastBits) - 1;
  for (uint32_t slot = 0; slot <= kSlotMask; ++slot) {
    const uint64_t first = single[slot];
    const uint32_t first_length = first & kLengthMask;
    if ((first & kKindMask) != kValue || (first >> 40 & 0xFF) == kEndOfBlockStep ||
        first_length >= kFastBits) {
      continue;
    }
    const uint64_t second = single[(slot << first_length) & kSlotMask];
    const uint32_t second_length = second & kLengthMask;
    if ((second & kKindMask) != kValue || first_length + second_length > kFastBits) continue;
    const bool end = (second >> 40 & 0xFF) == kEndOfBlockStep;
    const uint32_t step = end ? kEndOfBlockStep : 1 + static_cast<uint32_t>(second >> 36 & 15);
    table->fast[slot] = value_entry(first_length + second_length, first_length,
                                    static_cast<uint32_t>(first >> 32 & 0xFF),
                                    static_cast<int16_t>(first >> 16), step,
                                    end ? 0 : static_cast<int16_t>(second >> 16));
  }
  return true;
}

// Copies the current segment's data into the window after what is there, removing byte stuffing
// (FF 00 is a data FF; fill FFs before a marker are dropped), until the window is full or the
// segment ends at a marker or at the end of the file.
void destuff(Decoder* d) {
  uint8_t* out = d->window + d->window_len;
  uint8_t* const out_end = d->window + kWindowBytes;
  const uint8_t* in = d->raw;
  while (out < out_end) {
    const size_t room = std::min<size_t>(out_end - out, d->raw_end - in);
    const auto* ff = static_cast<const uint8_t*>(std::memchr(in, 0xFF, room));
    const size_t plain = ff != nullptr ? static_cast<size_t>(ff - in) : room;
    std::memcpy(out, in, plain);
    out += plain;
    in += plain;
    if (ff == nullptr) {
      if (in == d->raw_end) d->segment_end = kEndOfData;
      if (in == d->raw_end) break;
      continue;
    }
    const uint8_t* after = ff + 1;
    while (after < d->raw_end && *after == 0xFF) ++after;
    if (after == d->raw_end) {
      in = after;
      d->segment_end = kEndOfData;
      break;
    }
    in = after + 1;
    if (*after == 0 && after == ff + 1) {
      *out++ = 0xFF;
      continue;
    }
    if (*after == 0) {
      // Fill FFs before a 00 is invalid (T.81 B.1.1.5). libjpeg-turbo reads it as one data FF,
      // but only after its fast path has stopped at it mid-MCU, leaving that attempt's
      // coefficients under the retry's: not something to reproduce, so the file is declined.
      d->segment_end = kBadStuffing;
      break;
    }
    d->segment_end = *after;  // `in` is past the marker code, as libjpeg's unread_marker wants
    break;
  }
  d->raw = in;
  d->window_len = static_cast<size_t>(out - d->window);
  if (d->segment_end != 0) std::memset(out, 0, kMcuBytes + kReadAhead);
}

// Keeps at least kMcuBytes destuffed bytes ahead of the reader while the segment goes on.
void ensure_input(Decoder* d) {
  if (d->segment_end != 0) return;
  const size_t ahead = static_cast<size_t>(d->window + d->window_len - d->next);
  if (ahead >= kMcuBytes) return;
  std::memmove(d->window, d->next, ahead);
  d->next = d->window;
  d->window_len = ahead;
  d->bits &= d->count == 0 ? 0 : ~uint64_t{0} << (64 - d->count);  // only the counted bits
  destuff(d);
}

// Whether the reader has consumed bits past the end of the segment's data (into the zeros).
// The counted bits can come from before the window's start (moved there by ensure_input), so
// the position is signed.
bool overran(const Decoder& d) {
  const ptrdiff_t consumed_bits = (d.next - d.window) * 8 - d.count;
  return d.segment_end != 0 && consumed_bits > static_cast<ptrdiff_t>(d.window_len) * 8;
}

// The marker that ends the current segment, which the last MCU must reach without overrunning
// and without leaving a whole byte before it: an encoder pads to the byte with 1 bits only, and
// libjpeg warns of extraneous bytes there, the usual sign of a bit error that ended a damaged
// scan early. (libjpeg checks that at a restart marker; at the end of the scan its bit buffer may
// have swallowed a few such bytes unseen, so this is stricter there.)
int end_segment(j_decompress_ptr info, Decoder* d) {
  if (d->segment_end == 0) corrupt(info);  // the window holds kilobytes past the last MCU
  const ptrdiff_t consumed_bits = (d->next - d->window) * 8 - d->count;
  const ptrdiff_t left_bits = static_cast<ptrdiff_t>(d->window_len) * 8 - consumed_bits;
  if (left_bits < 0 || left_bits >= 8 || d->segment_end == kEndOfData ||
      d->segment_end == kBadStuffing) {
    corrupt(info);
  }
  return d->segment_end;
}

void restart(j_decompress_ptr info, Decoder* d) {
  if (end_segment(info, d) != JPEG_RST0 + d->next_restart) corrupt(info);
  d->next_restart = (d->next_restart + 1) & 7;
  d->restarts_to_go = info->restart_interval;
  for (int32_t& p : d->predictor) p = 0;
  d->segment_end = 0;
  d->window_len = 0;
  d->next = d->window;
  d->bits = 0;
  d->count = 0;
}

// The symbol of a code longer than kFastBits (libjpeg's jpeg_huff_decode, on the top bits).
inline bool decode_long(const Table& table, uint64_t bits, uint32_t* symbol, uint32_t* length) {
  for (int l = kFastBits + 1; l <= 16; ++l) {
    const auto code = static_cast<int32_t>(bits >> (64 - l));
    if (code <= table.max_code[l]) {
      *symbol = table.symbols[(code + table.value_offset[l]) & 0xFF];
      *length = static_cast<uint32_t>(l);
      return true;
    }
  }
  return false;
}

boolean decode_mcu(j_decompress_ptr info, JBLOCKROW* blocks) {
  auto* d = reinterpret_cast<Decoder*>(info->entropy);
  if (info->restart_interval != 0) {
    if (d->restarts_to_go == 0) restart(info, d);
    --d->restarts_to_go;
  }
  ensure_input(d);
  if (overran(*d)) corrupt(info);

  const uint8_t* next = d->next;
  uint64_t bits = d->bits;
  int count = d->count;
  // After every symbol (or pair) the reader drops what it used and refills: one 8-byte load,
  // whole bytes kept, 56-63 bits counted. A lookup uses only the top kFastBits, which were valid
  // before the refill, so it reads `top` (the bits before the refill's OR): the next lookup then
  // waits only on this one's length, while the load and OR run alongside.
  uint64_t top = 0;
  const auto refill = [&] {
    uint64_t word;
    std::memcpy(&word, next, sizeof(word));
    bits |= __builtin_bswap64(word) >> count;
    next += (63 - count) >> 3;
    count |= 56;
  };
  const auto advance = [&](uint64_t n) {
    bits <<= n;
    count -= static_cast<int>(n);
    top = bits;  // 25 or more bits counted: a symbol takes at most 31 of the 56 there were
    refill();
  };
  refill();  // 56 or more bits from here on, enough for any symbol with its value bits
  top = bits;
  JBLOCK scratch;
  for (int b = 0; b < info->blocks_in_MCU; ++b) {
    JCOEF* block = blocks != nullptr ? blocks[b][0] : scratch;
    // DC: the difference from the previous block of the component.
    const Table& dc = *d->dc[b];
    uint64_t entry = dc.fast[top >> (64 - kFastBits)];
    int32_t diff = 0;
    if ((entry & kKindMask) == kValue) {
      diff = static_cast<int16_t>(entry >> 16);
      advance(entry & kLengthMask);
    } else {
      uint32_t symbol = entry >> 32 & 0xFF;
      uint32_t length = entry & kLengthMask;
      if ((entry & kKindMask) == kLongCode && !decode_long(dc, bits, &symbol, &length)) corrupt(info);
      if (symbol != 0) {
        diff = extend(static_cast<uint32_t>(bits << length >> (64 - symbol)), static_cast<int>(symbol));
      }
      advance(length + symbol);
    }
    int32_t& predictor = d->predictor[d->component[b]];
    // Wraps as libjpeg's does on hostile data, where a run of large differences overflows.
    predictor = static_cast<int32_t>(static_cast<uint32_t>(predictor) + static_cast<uint32_t>(diff));
    block[0] = static_cast<JCOEF>(predictor);

    // AC: (run, size) symbols to the end of the block. A run past position 63 (corrupt data)
    // lands on 63, as in libjpeg.
    const Table& ac = *d->ac[b];
    for (int k = 1; k < DCTSIZE2; ++k) {
      entry = ac.fast[top >> (64 - kFastBits)];
      if ((entry & kKindMask) == kValue) {
        k += static_cast<int>(entry >> 36 & 15);
        block[kNatural[k]] = static_cast<JCOEF>(static_cast<int16_t>(entry >> 16));
        if (k >= DCTSIZE2 - 1) {  // the block is full: a second symbol is the next block's
          advance(entry >> 8 & kLengthMask);
          break;
        }
        k += static_cast<int>(entry >> 40 & 0xFF);
        block[kNatural[k]] = static_cast<JCOEF>(static_cast<int16_t>(entry >> 48));
        advance(entry & kLengthMask);
        continue;
      }
      uint32_t symbol = entry >> 32 & 0xFF;
      uint32_t length = entry & kLengthMask;
      if ((entry & kKindMask) == kLongCode && !decode_long(ac, bits, &symbol, &length)) corrupt(info);
      const uint32_t run = symbol >> 4;
      const uint32_t size = symbol & 15;
      if (size != 0) {
        k += static_cast<int>(run);
        block[kNatural[k]] = static_cast<JCOEF>(
            extend(static_cast<uint32_t>(bits << length >> (64 - size)), static_cast<int>(size)));
        advance(length + size);
      } else if (run == 15) {
        k += 15;
        advance(length);
      } else {
        advance(length);
        break;
      }
    }
  }
  d->next = next;
  d->bits = bits;
  d->count = count;

  if (--d->mcus_left == 0) {
    // The scan is complete: hand libjpeg the marker after it, as its own decoder would.
    info->unread_marker = end_segment(info, d);
    info->src->next_input_byte = d->raw;
    info->src->bytes_in_buffer = static_cast<size_t>(d->raw_end - d->raw);
  }
  return TRUE;
}

// A single-scan image never starts a second pass of the entropy decoder.
void no_second_scan(j_decompress_ptr info) { corrupt(info); }

}  // namespace

bool install_fast_huffman(jpeg_decompress_struct* info) {
  if (!LORAPIPE_FAST_HUFFMAN) return false;
  if (info->progressive_mode || info->arith_code || info->data_precision != 8 ||
      info->buffered_image || info->inputctl == nullptr || info->inputctl->has_multiple_scans ||
      info->unread_marker != 0 || info->src == nullptr || info->output_scanline != 0 ||
      info->Ss != 0 || info->Se != DCTSIZE2 - 1 || info->Ah != 0 || info->Al != 0 ||
      info->blocks_in_MCU < 1 || info->blocks_in_MCU > D_MAX_BLOCKS_IN_MCU ||
      info->MCUs_per_row == 0 || info->MCU_rows_in_scan == 0) {
    return false;
  }
  const auto allocate = [info](size_t bytes) {
    return (*info->mem->alloc_large)(reinterpret_cast<j_common_ptr>(info), JPOOL_IMAGE, bytes);
  };
  auto* d = static_cast<Decoder*>(allocate(sizeof(Decoder)));
  std::memset(d, 0, sizeof(Decoder));
  Table* built[2][NUM_HUFF_TBLS] = {};
  for (int b = 0; b < info->blocks_in_MCU; ++b) {
    const int component = info->MCU_membership[b];
    if (component < 0 || component >= info->comps_in_scan) return false;
    const jpeg_component_info& c = *info->cur_comp_info[component];
    d->component[b] = component;
    for (const bool dc : {true, false}) {
      const int number = dc ? c.dc_tbl_no : c.ac_tbl_no;
      if (number < 0 || number >= NUM_HUFF_TBLS) return false;
      Table*& table = built[dc ? 0 : 1][number];
      if (table == nullptr) {
        const JHUFF_TBL* source = dc ? info->dc_huff_tbl_ptrs[number] : info->ac_huff_tbl_ptrs[number];
        if (source == nullptr) return false;
        table = static_cast<Table*>(allocate(sizeof(Table)));
        if (!build_table(*source, dc, table)) return false;
      }
      (dc ? d->dc : d->ac)[b] = table;
    }
  }
  d->window = static_cast<uint8_t*>(allocate(kWindowBytes + kMcuBytes + kReadAhead));
  d->next = d->window;
  d->raw = info->src->next_input_byte;
  d->raw_end = d->raw + info->src->bytes_in_buffer;
  d->restarts_to_go = info->restart_interval;
  d->mcus_left = static_cast<unsigned long>(info->MCUs_per_row) * info->MCU_rows_in_scan;
  d->pub.start_pass = no_second_scan;
  d->pub.decode_mcu = decode_mcu;
  d->pub.insufficient_data = FALSE;
  info->entropy = &d->pub;
  return true;
}

}  // namespace lorapipe::preprocess
