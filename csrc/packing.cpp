#include "packing.hpp"

#include "fault_guard.hpp"
#include "thread_pool.hpp"

#include <algorithm>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace tokenmill {
namespace {

struct Piece {
  int64_t document;
  int64_t offset;
  int64_t length;
  int64_t masked;
  int64_t flags;
};

void add_entry(PackingPlan& plan, const Piece& piece) {
  plan.entries.insert(plan.entries.end(),
                      {piece.document, piece.offset, piece.length, piece.masked, piece.flags});
}

void close_row(PackingPlan& plan, const std::vector<Piece>& row, int64_t padding) {
  for (const Piece& piece : row) add_entry(plan, piece);
  plan.row_offsets.push_back(static_cast<int64_t>(plan.entries.size() / 5));
  plan.padding += padding;
}

// Whole documents, long ones cut into windows; with `windows` false (BOS-aligned mode) long
// documents stay whole and are cropped by the planner, each remainder behind an inserted BOS.
std::vector<Piece> make_pieces(UnalignedSpan<int32_t> lengths, int64_t first_document,
                               int64_t row_length, int64_t overlap, bool windows) {
  std::vector<Piece> pieces;
  pieces.reserve(lengths.size());
  const int64_t stride = row_length - overlap;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t document = first_document + static_cast<int64_t>(i);
    const int64_t length = lengths[i];
    if (length == 0) continue;
    if (length <= row_length || !windows) {
      pieces.push_back({document, 0, length, 0, 0});
      continue;
    }
    for (int64_t start = 0;; start += stride) {
      const int64_t size = std::min(row_length, length - start);
      pieces.push_back({document, start, size, start > 0 ? overlap : 0, 0});
      if (start + row_length >= length) break;
    }
  }
  return pieces;
}

// Best-fit decreasing over blocks of `window` pieces, with open rows carried across blocks.
PackingPlan plan_best_fit(const std::vector<Piece>& pieces, const PackingOptions& options) {
  PackingPlan plan;
  struct Row {
    int64_t room;
    std::vector<Piece> pieces;
  };
  std::vector<Row> rows;                          // every row opened in this segment
  std::set<std::pair<int64_t, int64_t>> open;     // (room, row id): best fit = lower_bound
  auto finish = [&](int64_t id) {
    close_row(plan, rows[static_cast<size_t>(id)].pieces, rows[static_cast<size_t>(id)].room);
    rows[static_cast<size_t>(id)].pieces = {};
  };
  std::vector<size_t> order;
  for (size_t begin = 0; begin < pieces.size(); begin += static_cast<size_t>(options.window)) {
    const size_t end = std::min(pieces.size(), begin + static_cast<size_t>(options.window));
    order.resize(end - begin);
    std::iota(order.begin(), order.end(), begin);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return pieces[a].length > pieces[b].length;
    });
    for (const size_t index : order) {
      const Piece& piece = pieces[index];
      auto fit = open.lower_bound({piece.length, -1});
      int64_t id = 0;
      if (fit == open.end()) {
        id = static_cast<int64_t>(rows.size());
        rows.push_back({options.row_length, {}});
      } else {
        id = fit->second;
        open.erase(fit);
      }
      Row& row = rows[static_cast<size_t>(id)];
      row.pieces.push_back(piece);
      row.room -= piece.length;
      if (row.room == 0 || static_cast<int64_t>(row.pieces.size()) >= options.max_pieces_per_row) {
        finish(id);
      } else {
        open.insert({row.room, id});
        if (static_cast<int64_t>(open.size()) > options.max_open_rows) {
          const auto fullest = open.begin();
          finish(fullest->second);
          open.erase(fullest);
        }
      }
    }
  }
  std::vector<int64_t> remaining;
  for (const auto& [room, id] : open) remaining.push_back(id);
  std::sort(remaining.begin(), remaining.end());
  for (const int64_t id : remaining) finish(id);
  return plan;
}

// Every row full: longest fitting piece first, else crop the shortest and requeue the rest.
PackingPlan plan_bos_aligned(const std::vector<Piece>& pieces, const PackingOptions& options) {
  PackingPlan plan;
  std::vector<Piece> store(pieces);                   // buffer entries refer to this storage
  std::set<std::tuple<int64_t, int64_t>> buffer;      // (effective length, storage index)
  size_t next = 0;
  auto effective = [&](const Piece& piece) { return piece.length + (piece.flags & kInsertedBos); };
  auto refill = [&] {
    while (static_cast<int64_t>(buffer.size()) < options.window && next < pieces.size()) {
      buffer.insert({effective(store[next]), static_cast<int64_t>(next)});
      ++next;
    }
  };
  refill();
  while (!buffer.empty()) {
    std::vector<Piece> row;
    int64_t room = options.row_length;
    while (room > 0 && !buffer.empty()) {
      const bool last_slot = static_cast<int64_t>(row.size()) + 1 >= options.max_pieces_per_row;
      // The longest piece that fits (the latest of equal lengths).
      auto fit = buffer.upper_bound({room, INT64_MAX});
      if (fit != buffer.begin() && !last_slot) {
        --fit;
        const Piece piece = store[static_cast<size_t>(std::get<1>(*fit))];
        buffer.erase(fit);
        row.push_back(piece);
        room -= effective(piece);
        refill();
        continue;
      }
      // Nothing fits (or one slot left): crop the shortest piece that is too long.
      auto crop = buffer.upper_bound({room, INT64_MAX});
      if (crop == buffer.end()) {  // one slot left and everything fits: take the longest
        --crop;
        const Piece piece = store[static_cast<size_t>(std::get<1>(*crop))];
        buffer.erase(crop);
        row.push_back(piece);
        room -= effective(piece);
        refill();
        break;
      }
      const int64_t index = std::get<1>(*crop);
      Piece piece = store[static_cast<size_t>(index)];
      const int64_t cost = piece.flags & kInsertedBos;
      const int64_t take = room - cost;
      if (take <= 0) break;  // a single free token cannot hold an inserted BOS and data
      buffer.erase(crop);
      row.push_back({piece.document, piece.offset, take, std::min(piece.masked, take),
                     piece.flags});
      Piece rest{piece.document, piece.offset + take, piece.length - take,
                 std::max<int64_t>(0, piece.masked - take), kInsertedBos};
      store.push_back(rest);
      buffer.insert({effective(rest), static_cast<int64_t>(store.size() - 1)});
      room = 0;
    }
    for (const Piece& piece : row) plan.inserted_bos += piece.flags & kInsertedBos;
    close_row(plan, row, room);
  }
  return plan;
}

}  // namespace

PackingPlan plan_packing(UnalignedSpan<int32_t> lengths, const PackingOptions& options) {
  const size_t documents = lengths.size();
  const size_t segment = static_cast<size_t>(std::max<int64_t>(options.segment, 1));
  const size_t segments = documents == 0 ? 0 : (documents + segment - 1) / segment;
  std::vector<PackingPlan> parts(segments);
  auto plan_segment = [&](size_t s) {
    const size_t begin = s * segment;
    const size_t end = std::min(documents, begin + segment);
    const auto pieces = make_pieces(lengths.subspan(begin, end - begin),
                                    static_cast<int64_t>(begin), options.row_length,
                                    options.overlap, !options.bos_aligned);
    parts[s] = options.bos_aligned ? plan_bos_aligned(pieces, options)
                                   : plan_best_fit(pieces, options);
  };
  // Segments are independent: one part each, on up to num_threads threads of the pool.
  parallel_for(segments, std::max(options.num_threads, 1), plan_segment);
  PackingPlan plan;
  for (PackingPlan& part : parts) {
    const int64_t base = static_cast<int64_t>(plan.entries.size() / 5);
    plan.entries.insert(plan.entries.end(), part.entries.begin(), part.entries.end());
    for (size_t r = 1; r < part.row_offsets.size(); ++r) {
      plan.row_offsets.push_back(base + part.row_offsets[r]);
    }
    plan.padding += part.padding;
    plan.inserted_bos += part.inserted_bos;
  }
  return plan;
}

namespace {

// A packing plan comes from a cache file: every value read from it (and from the .idx behind it)
// is checked before it is used, with arithmetic that cannot overflow, and a bad one raises
// std::out_of_range naming the field (IndexError in Python), never reads out of bounds.
[[noreturn]] void corrupt_plan(const std::string& message) {
  throw std::out_of_range("corrupt packing plan: " + message);
}

std::string field(const char* array, int64_t index, int column, const char* name) {
  return std::string(array) + "[" + std::to_string(index) + ", " + std::to_string(column) +
         "] (" + name + ")";
}

// Entries [begin, end) of row r, checked: the row's entries are a range of the plan and fit
// max_pieces_per_row.
void check_row(UnalignedSpan<int64_t> row_offsets, int64_t row, int64_t entry_count,
               int64_t max_pieces, int64_t& begin, int64_t& end) {
  const auto r = static_cast<size_t>(row);
  begin = row_offsets[r];
  end = row_offsets[r + 1];
  if (begin < 0 || end < begin || end > entry_count) {
    corrupt_plan("row_offsets[" + std::to_string(row) + ":" + std::to_string(row + 2) + "] = [" +
                 std::to_string(begin) + ", " + std::to_string(end) +
                 "] is not a range of the plan's " + std::to_string(entry_count) + " entries");
  }
  if (end - begin > max_pieces) {
    corrupt_plan("row " + std::to_string(row) + " holds " + std::to_string(end - begin) +
                 " entries, more than max_pieces_per_row = " + std::to_string(max_pieces));
  }
}

// One entry of the plan, checked against its document, the token buffer and the room left in
// the row (`room` tokens).
struct PackedPiece {
  int64_t first;            // the document's first token in the buffer
  int64_t document_length;  // tokens in the document
  int64_t offset;           // the piece's first token in the document
  int64_t size;             // tokens of the piece
  int64_t masked;           // leading tokens whose labels are ignored
  bool inserted;            // a BOS token precedes the piece
};

template <typename TokenT>
PackedPiece check_entry(UnalignedSpan<int64_t> entries, int64_t e, UnalignedSpan<int64_t> pointers,
                        UnalignedSpan<int32_t> lengths, int64_t token_count, int64_t room) {
  const auto at = static_cast<size_t>(e) * 5;
  const int64_t document = entries[at];
  const auto documents = static_cast<int64_t>(lengths.size());
  if (document < 0 || document >= documents) {
    corrupt_plan(field("entries", e, 0, "document") + " = " + std::to_string(document) +
                 " is not a document id in [0, " + std::to_string(documents) + ")");
  }
  const auto d = static_cast<size_t>(document);
  PackedPiece piece{};
  piece.document_length = lengths[d];
  piece.offset = entries[at + 1];
  piece.size = entries[at + 2];
  piece.masked = entries[at + 3];
  piece.inserted = (entries[at + 4] & kInsertedBos) != 0;
  if (piece.document_length < 0) {
    corrupt_plan("sequence_lengths[" + std::to_string(document) + "] = " +
                 std::to_string(piece.document_length) + " is negative");
  }
  // offset <= length and size <= length - offset: no sum that could overflow.
  if (piece.offset < 0 || piece.size < 0 || piece.offset > piece.document_length ||
      piece.size > piece.document_length - piece.offset) {
    throw std::out_of_range(
        "packing plan entry " + std::to_string(e) + " points outside its document: " +
        field("entries", e, 1, "offset") + " = " + std::to_string(piece.offset) + ", " +
        field("entries", e, 2, "length") + " = " + std::to_string(piece.size) + ", document " +
        std::to_string(document) + " has " + std::to_string(piece.document_length) + " tokens");
  }
  if (piece.size > room - (piece.inserted ? 1 : 0)) {  // room >= 0, so no overflow
    throw std::out_of_range("packing plan entry " + std::to_string(e) +
                            " points outside its row: " + field("entries", e, 2, "length") +
                            " = " + std::to_string(piece.size) +
                            (piece.inserted ? " plus an inserted BOS" : "") + " with " +
                            std::to_string(room) + " tokens of the row left");
  }
  const int64_t pointer = pointers[d];
  constexpr auto itemsize = static_cast<int64_t>(sizeof(TokenT));
  if (pointer < 0 || pointer % itemsize != 0) {
    corrupt_plan("sequence_pointers[" + std::to_string(document) + "] = " +
                 std::to_string(pointer) + " is negative or not a multiple of the token size " +
                 std::to_string(itemsize));
  }
  piece.first = pointer / itemsize;
  // token_count - first >= -2^63 / 1 + 1: no overflow either way.
  if (piece.document_length > token_count - piece.first) {
    corrupt_plan("document " + std::to_string(document) + " (sequence_pointers = " +
                 std::to_string(pointer) + ", " + std::to_string(piece.document_length) +
                 " tokens) lies outside the token buffer of " + std::to_string(token_count) +
                 " tokens");
  }
  return piece;
}

}  // namespace

template <typename TokenT>
void gather_packed_rows(UnalignedSpan<int64_t> entries, UnalignedSpan<int64_t> row_offsets,
                        std::span<const int64_t> rows, UnalignedSpan<int64_t> pointers,
                        UnalignedSpan<int32_t> lengths, std::span<const TokenT> tokens,
                        const PackedRowOptions& options, std::span<int64_t> input_ids,
                        std::span<int64_t> labels, std::span<int64_t> position_ids,
                        std::span<int32_t> doc_ids, std::span<int32_t> cu_seqlens) {
  const int64_t length = options.row_length;
  const int64_t slots = options.max_pieces_per_row + 1;
  const auto num_rows = static_cast<int64_t>(row_offsets.size()) - 1;
  const auto entry_count = static_cast<int64_t>(entries.size() / 5);
  const auto token_count = static_cast<int64_t>(tokens.size());
  for (size_t b = 0; b < rows.size(); ++b) {
    const int64_t row = rows[b];
    if (row < 0 || row >= num_rows) {
      throw std::out_of_range("packing plan row " + std::to_string(row) + " is out of range");
    }
    // The outputs are [rows.size(), length] (checked by the caller): these offsets fit.
    const auto base = static_cast<size_t>(b) * static_cast<size_t>(length);
    int64_t* ids = input_ids.data() + base;
    int64_t* targets = labels.data() + base;
    int64_t* positions = position_ids.data() + base;
    int32_t* pieces_of = doc_ids.data() + base;
    int32_t* bounds = cu_seqlens.data() + static_cast<size_t>(b) * static_cast<size_t>(slots);
    int64_t begin = 0;
    int64_t end = 0;
    check_row(row_offsets, row, entry_count, options.max_pieces_per_row, begin, end);
    int64_t position = 0;
    int64_t last_start = 0;
    for (int64_t e = begin; e < end; ++e) {
      const PackedPiece piece =
          check_entry<TokenT>(entries, e, pointers, lengths, token_count, length - position);
      const int64_t number = e - begin;
      const int64_t start = position;
      bounds[number] = static_cast<int32_t>(start);
      last_start = start;
      if (piece.inserted) {
        ids[position] = options.bos;
        targets[position] = options.ignore;
        ++position;
      }
      const TokenT* source = tokens.data() + piece.first + piece.offset;
      for (int64_t j = 0; j < piece.size; ++j) {
        ids[position + j] = static_cast<int64_t>(source[j]);
        targets[position + j] = (j < piece.masked || piece.offset + j + 1 >= piece.document_length)
                                    ? options.ignore
                                    : static_cast<int64_t>(source[j + 1]);
      }
      // a shrunk .bin whose new end lies in this read's last page read zeros there: touching
      // the next page faults instead (the caller runs this under guard_mapped_reads)
      if (piece.size > 0) probe_next_page(source + piece.size, tokens.data() + tokens.size());
      position += piece.size;
      for (int64_t p = start; p < position; ++p) {
        pieces_of[p] = static_cast<int32_t>(number);
        positions[p] = options.reset_positions ? p - start : p;
      }
    }
    const int64_t pieces = end - begin;
    for (int64_t p = position; p < length; ++p) {
      ids[p] = options.pad;
      targets[p] = options.ignore;
      pieces_of[p] = static_cast<int32_t>(pieces > 0 ? pieces - 1 : 0);
      positions[p] = (options.reset_positions && pieces > 0) ? p - last_start : p;
    }
    for (int64_t slot = pieces; slot < slots; ++slot) bounds[slot] = static_cast<int32_t>(length);
    bounds[0] = 0;
  }
}

#define TOKENMILL_PACKED_GATHER(T)                                                          \
  template void gather_packed_rows<T>(                                                      \
      UnalignedSpan<int64_t>, UnalignedSpan<int64_t>, std::span<const int64_t>,             \
      UnalignedSpan<int64_t>, UnalignedSpan<int32_t>, std::span<const T>,                   \
      const PackedRowOptions&, std::span<int64_t>, std::span<int64_t>, std::span<int64_t>,  \
      std::span<int32_t>, std::span<int32_t>);
TOKENMILL_PACKED_GATHER(uint8_t)
TOKENMILL_PACKED_GATHER(int8_t)
TOKENMILL_PACKED_GATHER(int16_t)
TOKENMILL_PACKED_GATHER(uint16_t)
TOKENMILL_PACKED_GATHER(int32_t)
TOKENMILL_PACKED_GATHER(uint32_t)
TOKENMILL_PACKED_GATHER(int64_t)
#undef TOKENMILL_PACKED_GATHER

}  // namespace tokenmill
