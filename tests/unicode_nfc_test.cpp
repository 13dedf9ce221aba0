// SPDX-License-Identifier: Apache-2.0
// NFC/NFD of the tokenizer's normaliser against a subset of Unicode's NormalizationTest.txt
// (tests/data/nfc_cases.txt) plus UTF-8 helpers.
#include "model/unicode.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace kvcache::unicode {
namespace {

std::string from_hex(const std::string& field) {
  std::istringstream is(field);
  std::string out;
  for (std::string h; is >> h;) append_utf8(out, static_cast<char32_t>(std::stoul(h, nullptr, 16)));
  return out;
}

TEST(UnicodeNfc, NormalizationTestSubset) {
  std::ifstream in(std::string(KVCACHE_SOURCE_DIR) + "/tests/data/nfc_cases.txt");
  ASSERT_TRUE(in.good()) << "tests/data/nfc_cases.txt missing";
  size_t cases = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> c;
    std::istringstream ls(line);
    for (std::string f; std::getline(ls, f, ';');) c.push_back(from_hex(f));
    ASSERT_EQ(c.size(), 5u) << line;
    ++cases;
    for (int k : {0, 1, 2}) EXPECT_EQ(nfc(c[k]), c[1]) << "NFC(c" << k + 1 << ") of " << line;
    for (int k : {3, 4}) EXPECT_EQ(nfc(c[k]), c[3]) << "NFC(c" << k + 1 << ") of " << line;
    for (int k : {0, 1, 2}) EXPECT_EQ(nfd(c[k]), c[2]) << "NFD(c" << k + 1 << ") of " << line;
    for (int k : {3, 4}) EXPECT_EQ(nfd(c[k]), c[4]) << "NFD(c" << k + 1 << ") of " << line;
  }
  EXPECT_GT(cases, 400u);
}

TEST(UnicodeNfc, HandCheckedCompositions) {
  EXPECT_EQ(nfc("e\xCC\x81"), "\xC3\xA9");                             // é
  EXPECT_EQ(nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // ᄀ ᅡ ᆨ -> 각
  EXPECT_EQ(nfc("\xEA\xB0\x80\xE1\x86\xA8"), "\xEA\xB0\x81");           // 가 + ᆨ -> 각 (LV + T)
  EXPECT_EQ(nfc("\xCF\x89\xCD\x82\xCD\x85"), "\xE1\xBF\xB7");           // ω + perispomeni + ypogegrammeni -> ῷ
  EXPECT_EQ(nfc("\xD0\x95\xCC\x88"), "\xD0\x81");                       // Е + diaeresis -> Ё
  EXPECT_EQ(nfc("plain ASCII"), "plain ASCII");
  EXPECT_EQ(nfc(""), "");
  // Composition exclusion: U+0958 (DEVANAGARI QA) stays decomposed in NFC.
  EXPECT_EQ(nfc("\xE0\xA5\x98"), "\xE0\xA4\x95\xE0\xA4\xBC");
}

TEST(UnicodeUtf8, ValidationAndLossyDecoding) {
  EXPECT_EQ(find_invalid_utf8("h\xC3\xA9llo"), std::string::npos);
  EXPECT_EQ(find_invalid_utf8("ab\xC3"), 2u);              // truncated
  EXPECT_EQ(find_invalid_utf8("\xC0\xAF"), 0u);            // overlong
  EXPECT_EQ(find_invalid_utf8("x\xED\xA0\x80"), 1u);       // surrogate
  EXPECT_EQ(find_invalid_utf8("\xF4\x90\x80\x80"), 0u);    // above U+10FFFF
  EXPECT_EQ(utf8_lossy("a\xFF" "b"), "a\xEF\xBF\xBD" "b");
  EXPECT_EQ(utf8_lossy("\xE2\x9C"), "\xEF\xBF\xBD");       // one U+FFFD per maximal prefix
  EXPECT_EQ(utf8_lossy("ok"), "ok");
}

}  // namespace
}  // namespace kvcache::unicode
