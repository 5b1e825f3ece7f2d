// Text packing for the tokenize pipeline's fast path: documents out of JSON Lines, text lines or
// (data, offsets) string arrays, validated and written one after another, each followed by one
// 0xFF byte (a byte no valid UTF-8 text contains), the layout a tokenizer can split at once.
// Plain C++ over spans; bindings.cpp allocates the output and does the argument checks.
//
// Every function accepts exactly what the Python readers (tokenmill/tokenize/readers.py) accept
// and extracts the same text, or reports the first line or document it did not accept; the
// caller then re-reads the chunk with the Python reader, which raises the reader's error (or, for
// the few inputs Python accepts and these do not, such as NaN literals, UTF-8 BOMs or lone
// surrogates, produces the documents). So a document is never read differently on this path.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace tokenmill {

constexpr uint8_t kDocumentSeparator = 0xFF;

// What a packing function did. `lengths` holds the UTF-8 byte length of each document (an empty
// document has length 0 and no separator); `written` is the bytes written to `out`.
struct PackResult {
  int64_t written = 0;
  int64_t failed = -1;  // index of the first line (JSONL, lines) or document not accepted, or -1
};

// JSON Lines (readers.parse_chunk, kind "jsonl"): lines split at '\n'; a line holding only
// ASCII whitespace (bytes.strip()) is skipped; every other line must be one JSON object (the
// json module's grammar, UTF-8, no NaN/Infinity) whose top-level member `key` (the last one if
// repeated, as the json module keeps) is a string; its decoded UTF-8 value is the document.
// `out` needs data.size() bytes. Line indices count every line, skipped ones included.
PackResult pack_jsonl_field(std::span<const uint8_t> data, std::string_view key,
                            std::span<uint8_t> out, std::vector<int64_t>& lengths);

// Text lines (txt_mode "line"): lines split at '\n', one trailing '\r' removed, empty lines
// skipped, each valid UTF-8. `out` needs data.size() + 1 bytes.
PackResult pack_lines(std::span<const uint8_t> data, std::span<uint8_t> out,
                      std::vector<int64_t>& lengths);

// Documents data[offsets[i], offsets[i + 1]) (arrow strings, a whole .txt file), each valid
// UTF-8. `out` needs data.size() + (offsets.size() - 1) bytes.
PackResult pack_documents(std::span<const uint8_t> data, std::span<const int64_t> offsets,
                          std::span<uint8_t> out, std::vector<int64_t>& lengths);

// Byte positions in `packed` (valid UTF-8 documents and 0xFF separators) where a code point
// inside one of the inclusive [ranges[2k], ranges[2k + 1]] ranges (sorted, disjoint, all
// >= U+0800) starts. Only lead bytes >= 0xE0 are decoded, so ASCII text costs one compare per
// byte.
std::vector<int64_t> find_code_points(std::span<const uint8_t> packed,
                                      std::span<const uint32_t> ranges);

}  // namespace tokenmill
