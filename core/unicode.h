// The little of Unicode the tokenizers need: UTF-8 decoding, the major
// general category of a code point (the classes \p{L}, \p{N}, \p{P}, ... of
// the pre-tokenizer regexes) and the White_Space property (regex \s).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ellm {

// Major general category (the first letter of the Unicode category).
// Unassigned, private-use and surrogate code points are kOther (C*).
enum class UnicodeCategory : uint8_t {
  kOther = 0,        // C: Cc Cf Cs Co Cn
  kLetter = 1,       // L: Lu Ll Lt Lm Lo
  kMark = 2,         // M: Mn Mc Me
  kNumber = 3,       // N: Nd Nl No
  kPunctuation = 4,  // P: Pc Pd Ps Pe Pi Pf Po
  kSymbol = 5,       // S: Sm Sc Sk So
  kSeparator = 6,    // Z: Zs Zl Zp
};

// The category of `cp` (kOther for anything past U+10FFFF).
UnicodeCategory UnicodeCategoryOf(char32_t cp);

// Unicode White_Space: U+0009..000D, 0020, 0085, 00A0, 1680, 2000..200A,
// 2028, 2029, 202F, 205F, 3000.
bool IsUnicodeWhitespace(char32_t cp);

// U+FFFD REPLACEMENT CHARACTER.
inline constexpr char32_t kReplacementCodePoint = 0xFFFD;

// Length of the UTF-8 sequence at the start of `s` (not empty):
//   > 0: a whole well-formed sequence of that many bytes;
//   < 0: -k, the first k bytes are ill-formed (a maximal ill-formed subpart:
//        stray continuation, overlong form, surrogate, past U+10FFFF);
//   0:   a well-formed but incomplete prefix that more bytes could complete.
// The one place ellm knows UTF-8's byte ranges.
int ScanUtf8(std::string_view s);

// True when all of `s` is well-formed UTF-8.
bool IsValidUtf8(std::string_view s);

// Decodes the UTF-8 sequence at the start of `s` (not empty) into `*cp` and
// returns its length in bytes. A byte that does not start a complete, valid
// sequence (stray continuation, overlong form, surrogate, past U+10FFFF,
// truncated) decodes alone: length 1, *cp = U+FFFD.
int DecodeUtf8(std::string_view s, char32_t* cp);

// Appends the UTF-8 encoding of `cp` (at most U+10FFFF) to `out`.
void AppendUtf8(char32_t cp, std::string& out);

}  // namespace ellm
