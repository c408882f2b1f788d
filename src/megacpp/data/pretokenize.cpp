// Native pre-tokenizer + piece index for megacpp's encoder (see native.py; loaded with ctypes).
//
// Splits UTF-8 text into exactly the pieces of tokenizer.py's PRETOKENIZE_PATTERN (Python `re`
// semantics, leftmost alternative first) and maps each piece to a row of a growing index:
// known pieces get their row, new ones the next rows in order of first appearance (the Python
// side keeps the BPE tokens of every row). The pattern, alternative by alternative:
//
//   A  ` ?(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]|[PUNCT]+|[^\x00-\x7F]+)`
//   B  `(?:\r?\n)+[ \t]*`
//   C  `[ \t]+(?= [^ \t\r\n\x00-\x1f\x7f])`   (spaces, leaving one for the next piece)
//   D  `[ \t]+`
//   E  `[\s\S]`                                (one character; only ASCII reaches it)
//
// PUNCT is ASCII punctuation except '_'. A non-ASCII code point is a run of bytes >= 0x80 in
// UTF-8, so alternative A's last branch is a byte run; the lookahead of C accepts them.

#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <unordered_map>

namespace {

struct Index {
  std::deque<std::string> keys;  // stable storage for the map's views
  std::unordered_map<std::string_view, int64_t> rows;
};

inline bool ident_start(uint8_t c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_'; }
inline bool ident(uint8_t c) { return ident_start(c) || (c >= '0' && c <= '9'); }
inline bool digit(uint8_t c) { return c >= '0' && c <= '9'; }
inline bool punct(uint8_t c) {
  return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x5E) ||
         c == 0x60 || (c >= 0x7B && c <= 0x7E);
}
inline bool blank(uint8_t c) { return c == ' ' || c == '\t'; }
inline bool lookahead_ok(uint8_t c) { return !(c <= 0x20 || c == 0x7F); }  // ' ', \t, \r, \n, controls

// End of A's group (identifier, digit, punctuation run, non-ASCII run) starting at i, or i.
inline int64_t group_end(const uint8_t* s, int64_t n, int64_t i) {
  const uint8_t c = s[i];
  int64_t j = i + 1;
  if (ident_start(c)) {
    while (j < n && ident(s[j])) ++j;
  } else if (digit(c)) {
  } else if (punct(c)) {
    while (j < n && punct(s[j])) ++j;
  } else if (c >= 0x80) {
    while (j < n && s[j] >= 0x80) ++j;
  } else {
    return i;
  }
  return j;
}

// End of the piece that starts at i (i < n).
inline int64_t piece_end(const uint8_t* s, int64_t n, int64_t i) {
  if (s[i] == ' ' && i + 1 < n) {  // A with its leading space
    const int64_t e = group_end(s, n, i + 1);
    if (e > i + 1) return e;
  }
  if (const int64_t e = group_end(s, n, i); e > i) return e;  // A without it
  int64_t j = i;  // B
  for (;;) {
    if (j < n && s[j] == '\n') {
      ++j;
    } else if (j + 1 < n && s[j] == '\r' && s[j + 1] == '\n') {
      j += 2;
    } else {
      break;
    }
  }
  if (j > i) {
    while (j < n && blank(s[j])) ++j;
    return j;
  }
  if (blank(s[i])) {  // C, else D
    int64_t k = i + 1;
    while (k < n && blank(s[k])) ++k;
    // greedy [ \t]+ backtracks to the one end where the lookahead can hold: before the run's
    // last character, when that is a space followed by an allowed character
    if (k - i >= 2 && s[k - 1] == ' ' && k < n && lookahead_ok(s[k])) return k - 1;
    return k;
  }
  return i + 1;  // E
}

}  // namespace

extern "C" {

void* megacpp_index_new() { return new Index(); }
void megacpp_index_free(void* index) { delete static_cast<Index*>(index); }
int64_t megacpp_index_size(void* index) { return static_cast<Index*>(index)->rows.size(); }
void megacpp_index_clear(void* index) {
  auto* ix = static_cast<Index*>(index);
  ix->rows.clear();
  ix->keys.clear();
}

// Texts are buf[offsets[t], offsets[t + 1]) for t < n_texts. Writes the row of every piece to
// rows (capacity: offsets[n_texts] - offsets[0], one piece per byte at most), the number of
// pieces of each text to counts[t], and the byte span (start, end) in buf of each piece new to
// the index to new_spans (capacity twice that of rows), in row order. Returns the number of
// new pieces.
int64_t megacpp_pretokenize(void* index, const uint8_t* buf, const int64_t* offsets,
                            int64_t n_texts, int64_t* rows, int64_t* counts, int64_t* new_spans) {
  auto* ix = static_cast<Index*>(index);
  int64_t out = 0, n_new = 0;
  for (int64_t t = 0; t < n_texts; ++t) {
    const uint8_t* s = buf + offsets[t];
    const int64_t n = offsets[t + 1] - offsets[t];
    const int64_t first = out;
    for (int64_t i = 0; i < n;) {
      const int64_t e = piece_end(s, n, i);
      const std::string_view piece(reinterpret_cast<const char*>(s + i), e - i);
      auto found = ix->rows.find(piece);
      if (found == ix->rows.end()) {
        const int64_t row = static_cast<int64_t>(ix->rows.size());
        ix->keys.emplace_back(piece);
        ix->rows.emplace(std::string_view(ix->keys.back()), row);
        new_spans[2 * n_new] = offsets[t] + i;
        new_spans[2 * n_new + 1] = offsets[t] + e;
        ++n_new;
        rows[out++] = row;
      } else {
        rows[out++] = found->second;
      }
      i = e;
    }
    counts[t] = out - first;
  }
  return n_new;
}

}  // extern "C"
