#include "text_pack.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>

namespace tokenmill {
namespace {

// Length of the valid UTF-8 sequence at p (< end), or 0. Exactly the strict decoder of Python's
// bytes.decode("utf-8"): no overlong forms, no surrogates (U+D800-U+DFFF), nothing above
// U+10FFFF.
inline int utf8_sequence_length(const uint8_t* p, const uint8_t* end) {
  const uint8_t lead = p[0];
  if (lead < 0x80) return 1;
  const auto continuation = [&](int i) { return p + i < end && (p[i] & 0xC0) == 0x80; };
  if (lead >= 0xC2 && lead <= 0xDF) return continuation(1) ? 2 : 0;
  if (lead >= 0xE0 && lead <= 0xEF) {
    if (p + 1 >= end) return 0;
    const uint8_t second = p[1];
    if (lead == 0xE0 && second < 0xA0) return 0;  // overlong
    if (lead == 0xED && second > 0x9F) return 0;  // surrogate
    return continuation(1) && continuation(2) ? 3 : 0;
  }
  if (lead >= 0xF0 && lead <= 0xF4) {
    if (p + 1 >= end) return 0;
    const uint8_t second = p[1];
    if (lead == 0xF0 && second < 0x90) return 0;  // overlong
    if (lead == 0xF4 && second > 0x8F) return 0;  // above U+10FFFF
    return continuation(1) && continuation(2) && continuation(3) ? 4 : 0;
  }
  return 0;
}

inline bool valid_utf8(const uint8_t* p, const uint8_t* end) {
  while (p < end) {
    if (*p < 0x80) {
      ++p;
      continue;
    }
    const int length = utf8_sequence_length(p, end);
    if (length == 0) return false;
    p += length;
  }
  return true;
}

inline uint8_t* write_utf8(uint32_t code_point, uint8_t* out) {
  if (code_point < 0x80) {
    *out++ = static_cast<uint8_t>(code_point);
  } else if (code_point < 0x800) {
    *out++ = static_cast<uint8_t>(0xC0 | (code_point >> 6));
    *out++ = static_cast<uint8_t>(0x80 | (code_point & 0x3F));
  } else if (code_point < 0x10000) {
    *out++ = static_cast<uint8_t>(0xE0 | (code_point >> 12));
    *out++ = static_cast<uint8_t>(0x80 | ((code_point >> 6) & 0x3F));
    *out++ = static_cast<uint8_t>(0x80 | (code_point & 0x3F));
  } else {
    *out++ = static_cast<uint8_t>(0xF0 | (code_point >> 18));
    *out++ = static_cast<uint8_t>(0x80 | ((code_point >> 12) & 0x3F));
    *out++ = static_cast<uint8_t>(0x80 | ((code_point >> 6) & 0x3F));
    *out++ = static_cast<uint8_t>(0x80 | (code_point & 0x3F));
  }
  return out;
}

// Eight bytes at p as one little-endian word (memcpy: no alignment or aliasing assumptions).
inline uint64_t load_word(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

constexpr uint64_t kOnes = 0x0101010101010101ULL;
constexpr uint64_t kHighBits = 0x8080808080808080ULL;

// Bit 7 of each byte of `word` that is zero. Borrows can also flag a byte above a zero byte,
// never one below it, so the lowest flag is exact: all the callers use.
inline uint64_t zero_bytes(uint64_t word) { return (word - kOnes) & ~word & kHighBits; }

// Offset of the first byte of `word` that ends a plain run inside a JSON string ('"', '\\', a
// control character below 0x20 or a non-ASCII byte, validated one sequence at a time), or 8.
inline int first_special_string_byte(uint64_t word) {
  const uint64_t flags = (word & kHighBits) | ((word - kOnes * 0x20) & ~word & kHighBits) |
                         zero_bytes(word ^ (kOnes * '"')) | zero_bytes(word ^ (kOnes * '\\'));
  return flags == 0 ? 8 : std::countr_zero(flags) / 8;
}

inline int hex_value(uint8_t c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// A validating parser of one JSON text (one line), in the json module's grammar with
// strict=True: whitespace is space, tab, CR and LF; no control characters inside strings; no
// NaN/Infinity (the json module accepts them: such lines go to the Python reader).
class JsonLine {
 public:
  JsonLine(const uint8_t* begin, const uint8_t* end) : p_(begin), end_(end) {}

  // Parses the line as an object; the one top-level member named `key` must be a string,
  // whose decoded UTF-8 is written at `out` (its length in `length`). False: not accepted.
  bool extract(std::string_view key, uint8_t* out, int64_t& length) {
    skip_whitespace();
    if (!consume('{')) return false;
    bool found_string = false;
    bool found_other = false;
    skip_whitespace();
    if (!consume('}')) {
      std::string name;
      while (true) {
        skip_whitespace();
        name.clear();
        if (!parse_string(nullptr, &name)) return false;
        skip_whitespace();
        if (!consume(':')) return false;
        skip_whitespace();
        if (name == key) {
          // the key twice: which text is meant is ambiguous; the Python reader refuses it
          if (found_string || found_other) return false;
        }
        if (name == key && p_ < end_ && *p_ == '"') {
          uint8_t* written = out;
          if (!parse_string(&written, nullptr)) return false;
          length = written - out;
          found_string = true;
          found_other = false;
        } else {
          if (!parse_value(0)) return false;
          if (name == key) {
            found_string = false;
            found_other = true;
          }
        }
        skip_whitespace();
        if (consume(',')) continue;
        if (consume('}')) break;
        return false;
      }
    }
    skip_whitespace();
    return p_ == end_ && found_string && !found_other;
  }

 private:
  static constexpr int kMaxDepth = 200;  // deeper lines go to the Python reader

  void skip_whitespace() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\r' || *p_ == '\n')) ++p_;
  }

  bool consume(uint8_t c) {
    if (p_ < end_ && *p_ == c) {
      ++p_;
      return true;
    }
    return false;
  }

  bool literal(const char* word) {
    const size_t length = std::strlen(word);
    if (static_cast<size_t>(end_ - p_) < length || std::memcmp(p_, word, length) != 0) {
      return false;
    }
    p_ += length;
    return true;
  }

  bool digits() {
    const uint8_t* start = p_;
    while (p_ < end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    return p_ > start;
  }

  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?
  bool parse_number() {
    consume('-');
    if (p_ >= end_) return false;
    if (*p_ == '0') {
      ++p_;
    } else if (*p_ >= '1' && *p_ <= '9') {
      digits();
    } else {
      return false;
    }
    if (consume('.') && !digits()) return false;
    if (p_ < end_ && (*p_ == 'e' || *p_ == 'E')) {
      ++p_;
      if (!consume('+')) consume('-');
      if (!digits()) return false;
    }
    return true;
  }

  bool parse_value(int depth) {
    if (p_ >= end_ || depth > kMaxDepth) return false;
    switch (*p_) {
      case '"':
        return parse_string(nullptr, nullptr);
      case '{': {
        ++p_;
        skip_whitespace();
        if (consume('}')) return true;
        while (true) {
          skip_whitespace();
          if (!parse_string(nullptr, nullptr)) return false;
          skip_whitespace();
          if (!consume(':')) return false;
          skip_whitespace();
          if (!parse_value(depth + 1)) return false;
          skip_whitespace();
          if (consume(',')) continue;
          return consume('}');
        }
      }
      case '[': {
        ++p_;
        skip_whitespace();
        if (consume(']')) return true;
        while (true) {
          skip_whitespace();
          if (!parse_value(depth + 1)) return false;
          skip_whitespace();
          if (consume(',')) continue;
          return consume(']');
        }
      }
      case 't':
        return literal("true");
      case 'f':
        return literal("false");
      case 'n':
        return literal("null");
      default:
        return parse_number();
    }
  }

  // Advances over plain string bytes (printable ASCII but '"' and '\\'), eight at a time.
  void skip_plain() {
    while (end_ - p_ >= 8) {
      const int offset = first_special_string_byte(load_word(p_));
      p_ += offset;
      if (offset < 8) return;
    }
    while (p_ < end_ && *p_ != '"' && *p_ != '\\' && *p_ >= 0x20 && *p_ < 0x80) ++p_;
  }

  bool parse_hex4(uint32_t& value) {
    if (end_ - p_ < 4) return false;
    value = 0;
    for (int i = 0; i < 4; ++i) {
      const int digit = hex_value(p_[i]);
      if (digit < 0) return false;
      value = value * 16 + static_cast<uint32_t>(digit);
    }
    p_ += 4;
    return true;
  }

  // A string at p_ (which must be '"'); its decoded UTF-8 goes to *out (advanced) and/or
  // `name` when given. Lone surrogate escapes are refused (the json module keeps them, and
  // such text cannot be encoded as UTF-8).
  bool parse_string(uint8_t** out, std::string* name) {
    if (!consume('"')) return false;
    uint8_t* write = out ? *out : nullptr;
    while (true) {
      // a run of plain bytes: copied as they are once validated
      const uint8_t* run = p_;
      skip_plain();
      while (p_ < end_ && *p_ >= 0x80) {
        const int length = utf8_sequence_length(p_, end_);
        if (length == 0) return false;
        p_ += length;
        skip_plain();
      }
      if (p_ > run) {
        const size_t size = static_cast<size_t>(p_ - run);
        if (write) {
          std::memcpy(write, run, size);
          write += size;
        }
        if (name) name->append(reinterpret_cast<const char*>(run), size);
      }
      if (p_ >= end_) return false;
      const uint8_t c = *p_;
      if (c == '"') {
        ++p_;
        break;
      }
      if (c < 0x20) return false;  // a control character (strict=True)
      // an escape
      ++p_;
      if (p_ >= end_) return false;
      uint32_t code_point = 0;
      switch (*p_++) {
        case '"': code_point = '"'; break;
        case '\\': code_point = '\\'; break;
        case '/': code_point = '/'; break;
        case 'b': code_point = '\b'; break;
        case 'f': code_point = '\f'; break;
        case 'n': code_point = '\n'; break;
        case 'r': code_point = '\r'; break;
        case 't': code_point = '\t'; break;
        case 'u': {
          if (!parse_hex4(code_point)) return false;
          if (code_point >= 0xDC00 && code_point <= 0xDFFF) return false;  // lone low
          if (code_point >= 0xD800 && code_point <= 0xDBFF) {
            uint32_t low = 0;
            if (end_ - p_ < 6 || p_[0] != '\\' || p_[1] != 'u') return false;  // lone high
            p_ += 2;
            if (!parse_hex4(low) || low < 0xDC00 || low > 0xDFFF) return false;
            code_point = 0x10000 + ((code_point - 0xD800) << 10) + (low - 0xDC00);
          }
          break;
        }
        default:
          return false;
      }
      uint8_t encoded[4];
      uint8_t* encoded_end = write_utf8(code_point, encoded);
      const size_t size = static_cast<size_t>(encoded_end - encoded);
      if (write) {
        std::memcpy(write, encoded, size);
        write += size;
      }
      if (name) name->append(reinterpret_cast<const char*>(encoded), size);
    }
    if (out) *out = write;
    return true;
  }

  const uint8_t* p_;
  const uint8_t* end_;
};

inline bool is_blank(const uint8_t* begin, const uint8_t* end) {
  for (const uint8_t* p = begin; p < end; ++p) {
    const uint8_t c = *p;
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r' && c != '\x0b' && c != '\x0c') {
      return false;
    }
  }
  return true;
}

inline const uint8_t* line_end(const uint8_t* p, const uint8_t* end) {
  const void* found = std::memchr(p, '\n', static_cast<size_t>(end - p));
  return found ? static_cast<const uint8_t*>(found) : end;
}

}  // namespace

PackResult pack_jsonl_field(std::span<const uint8_t> data, std::string_view key,
                            std::span<uint8_t> out, std::vector<int64_t>& lengths) {
  PackResult result;
  const uint8_t* p = data.data();
  const uint8_t* const end = p + data.size();
  uint8_t* write = out.data();
  int64_t line = 0;
  while (p < end) {
    const uint8_t* stop = line_end(p, end);
    if (!is_blank(p, stop)) {
      int64_t length = 0;
      if (!JsonLine(p, stop).extract(key, write, length)) {
        result.failed = line;
        break;
      }
      lengths.push_back(length);
      if (length > 0) {
        write += length;
        *write++ = kDocumentSeparator;
      }
    }
    p = stop + 1;
    ++line;
  }
  result.written = write - out.data();
  return result;
}

PackResult pack_lines(std::span<const uint8_t> data, std::span<uint8_t> out,
                      std::vector<int64_t>& lengths) {
  PackResult result;
  const uint8_t* p = data.data();
  const uint8_t* const end = p + data.size();
  uint8_t* write = out.data();
  int64_t line = 0;
  while (p < end) {
    const uint8_t* stop = line_end(p, end);
    const uint8_t* text_end = (stop > p && stop[-1] == '\r') ? stop - 1 : stop;
    if (text_end > p) {
      if (!valid_utf8(p, text_end)) {
        result.failed = line;
        break;
      }
      const size_t size = static_cast<size_t>(text_end - p);
      std::memcpy(write, p, size);
      write += size;
      *write++ = kDocumentSeparator;
      lengths.push_back(static_cast<int64_t>(size));
    }
    p = stop + 1;
    ++line;
  }
  result.written = write - out.data();
  return result;
}

PackResult pack_documents(std::span<const uint8_t> data, std::span<const int64_t> offsets,
                          std::span<uint8_t> out, std::vector<int64_t>& lengths) {
  PackResult result;
  uint8_t* write = out.data();
  const int64_t count = offsets.empty() ? 0 : static_cast<int64_t>(offsets.size()) - 1;
  for (int64_t index = 0; index < count; ++index) {
    const uint8_t* begin = data.data() + offsets[index];
    const uint8_t* stop = data.data() + offsets[index + 1];
    if (!valid_utf8(begin, stop)) {
      result.failed = index;
      break;
    }
    const size_t size = static_cast<size_t>(stop - begin);
    lengths.push_back(static_cast<int64_t>(size));
    if (size > 0) {
      std::memcpy(write, begin, size);
      write += size;
      *write++ = kDocumentSeparator;
    }
  }
  result.written = write - out.data();
  return result;
}

std::vector<int64_t> find_code_points(std::span<const uint8_t> packed,
                                      std::span<const uint32_t> ranges) {
  std::vector<int64_t> positions;
  const uint8_t* const begin = packed.data();
  const uint8_t* const end = begin + packed.size();
  const size_t range_count = ranges.size() / 2;
  for (const uint8_t* p = begin; p < end; ++p) {
    while (end - p >= 8 && (load_word(p) & kHighBits) == 0) p += 8;  // ASCII: no code point here
    if (p >= end) break;
    const uint8_t lead = *p;
    if (lead < 0xE0 || lead == kDocumentSeparator) continue;
    uint32_t code_point;
    if (lead < 0xF0) {
      if (end - p < 3) break;
      code_point = (static_cast<uint32_t>(lead & 0x0F) << 12) |
                   (static_cast<uint32_t>(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    } else {
      if (end - p < 4) break;
      code_point = (static_cast<uint32_t>(lead & 0x07) << 18) |
                   (static_cast<uint32_t>(p[1] & 0x3F) << 12) |
                   (static_cast<uint32_t>(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
    }
    // the first range whose last code point is >= code_point
    size_t low = 0;
    size_t high = range_count;
    while (low < high) {
      const size_t middle = (low + high) / 2;
      if (ranges[2 * middle + 1] < code_point) {
        low = middle + 1;
      } else {
        high = middle;
      }
    }
    if (low < range_count && ranges[2 * low] <= code_point) {
      positions.push_back(p - begin);
    }
  }
  return positions;
}

}  // namespace tokenmill
