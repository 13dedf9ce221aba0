// SPDX-License-Identifier: Apache-2.0
// Spec-string parser: fields, defaults, canonical form, errors, budgets.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>

#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/spec.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

ParamTable demo_table() {
  ParamTable t;
  t.head = "demo";
  t.help = "a demo method";
  ParamDef k;
  k.key = "k";
  k.help = "key bits";
  k.kind = ParamDef::Kind::kInt;
  k.default_value = 2;
  k.min_value = 1;
  k.max_value = 8;
  ParamDef seed;
  seed.key = "seed";
  seed.help = "random seed";
  seed.kind = ParamDef::Kind::kInt;
  seed.default_value = 0;
  seed.min_value = 0;
  seed.max_value = 1000;
  ParamDef s;
  s.key = "s";
  s.help = "sink tokens";
  s.kind = ParamDef::Kind::kInt;
  s.default_value = 4;
  s.min_value = 0;
  s.max_value = 64;
  ParamDef r;
  r.key = "r";
  r.help = "ratio";
  r.kind = ParamDef::Kind::kFloat;
  r.default_value = 0.5;
  r.min_value = 0;
  r.max_value = 1;
  ParamDef mode;
  mode.key = "mode";
  mode.help = "layout";
  mode.kind = ParamDef::Kind::kChoice;
  mode.choices = {"tok", "chan"};
  t.params = {k, seed, s, r, mode};
  return t;
}

// A text field (`key=text`, KVQuant's `cal=<file>`): parsed before numeric keys, printed only
// when set, after the fields before it in table order; its characters are checked.
TEST(SpecParse, TextFields) {
  ParamTable t = demo_table();
  ParamDef f;
  f.key = "file";
  f.help = "a path";
  f.kind = ParamDef::Kind::kText;
  t.params.push_back(f);
  ParsedSpec p = ParsedSpec::parse("demo", t);
  EXPECT_EQ(p.str("file"), "");
  EXPECT_FALSE(p.is_set("file"));
  EXPECT_EQ(p.canonical(), "demo");
  p = ParsedSpec::parse("demo:file=runs/a-b_c.kvqcal:k3", t);
  EXPECT_EQ(p.str("file"), "runs/a-b_c.kvqcal");
  EXPECT_TRUE(p.is_set("file"));
  EXPECT_EQ(p.canonical(), "demo:k3:file=runs/a-b_c.kvqcal");
  EXPECT_EQ(ParsedSpec::parse(p.canonical(), t).canonical(), p.canonical());
  auto err = [&](const std::string& text) {
    try {
      (void)ParsedSpec::parse(text, t);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(err("demo:file="), HasSubstr("field 'file=': empty file (a path)"));
  EXPECT_THAT(err("demo:file=a+b"), HasSubstr("file must not hold any of ': ( ) @ + ,' or blanks"));
  EXPECT_THAT(err("demo:file=a b"), HasSubstr("must not hold any of"));
  EXPECT_THAT(err("demo:file=a:file=b"), HasSubstr("'file' given twice"));
  EXPECT_THAT(err("demo:k=3"), HasSubstr("unknown field 'k=3'"));
  EXPECT_THAT(describe(t), HasSubstr("file=<text>  a path"));
  EXPECT_EQ(canonical_spec(t, {}, {{"file", "x"}}), "demo:file=x");
}

TEST(SpecParse, DefaultsAndExplicitValues) {
  const ParamTable t = demo_table();
  ParsedSpec p = ParsedSpec::parse("demo", t);
  EXPECT_EQ(p.head(), "demo");
  EXPECT_EQ(p.integer("k"), 2);
  EXPECT_EQ(p.num("r"), 0.5);
  EXPECT_EQ(p.choice("mode"), "tok");
  EXPECT_FALSE(p.is_set("k"));
  p = ParsedSpec::parse("demo:chan:k4:seed7:r0.25", t);
  EXPECT_EQ(p.integer("k"), 4);
  EXPECT_EQ(p.integer("seed"), 7);  // longest key wins over "s"
  EXPECT_EQ(p.integer("s"), 4);
  EXPECT_EQ(p.num("r"), 0.25);
  EXPECT_EQ(p.choice("mode"), "chan");
  EXPECT_TRUE(p.is_set("mode"));
  EXPECT_THROW(p.num("nope"), InternalError);
}

TEST(SpecParse, CanonicalFormIsTableOrderWithoutDefaults) {
  const ParamTable t = demo_table();
  EXPECT_EQ(ParsedSpec::parse("demo:chan:r0.25:s8:k2", t).canonical(), "demo:s8:r0.25:chan");
  EXPECT_EQ(ParsedSpec::parse("demo:tok:k2", t).canonical(), "demo");
  // Round trip: canonical text parses to the same canonical text.
  const std::string c = ParsedSpec::parse("demo:r0.3333333333333333:k3", t).canonical();
  EXPECT_EQ(c, "demo:k3:r0.3333333333333333");
  EXPECT_EQ(ParsedSpec::parse(c, t).canonical(), c);
  EXPECT_EQ(ParsedSpec::parse(c, t).num("r"), 0.3333333333333333);
}

TEST(SpecParse, UnknownFieldListsAllowedKeys) {
  const ParamTable t = demo_table();
  try {
    ParsedSpec::parse("demo:x5", t);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("unknown field 'x5'"));
    EXPECT_THAT(e.what(), HasSubstr("allowed fields of 'demo': k<int in [1, 8]>"));
    EXPECT_THAT(e.what(), HasSubstr("seed<int in [0, 1000]>"));
    EXPECT_THAT(e.what(), HasSubstr("r<number in [0, 1]>"));
    EXPECT_THAT(e.what(), HasSubstr("tok|chan"));
  }
  // Real quantizer tables too.
  try {
    make_quantizer("int4:q32");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("allowed fields of 'int4': g<int in [0, 65536]>"));
    EXPECT_THAT(e.what(), HasSubstr("tok|chan"));
  }
  try {
    make_quantizer("fp16:g32");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("'fp16' takes no fields"));
  }
}

TEST(SpecParse, OutOfRangeAndMalformedValues) {
  const ParamTable t = demo_table();
  try {
    ParsedSpec::parse("demo:k9", t);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("k=9 out of range [1, 8]"));
  }
  try {
    make_quantizer("int4:g70000");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("g=70000 out of range [0, 65536]"));
  }
  EXPECT_THROW(ParsedSpec::parse("demo:r1.5", t), InvalidArgument);
  EXPECT_THROW(ParsedSpec::parse("demo:k2.5", t), InvalidArgument);   // not an integer
  EXPECT_THROW(ParsedSpec::parse("demo:k0x4", t), InvalidArgument);   // no hex
  EXPECT_THROW(ParsedSpec::parse("demo:rnan", t), InvalidArgument);
  EXPECT_THROW(ParsedSpec::parse("demo:k2:k3", t), InvalidArgument);  // given twice
  EXPECT_THROW(ParsedSpec::parse("demo:tok:chan", t), InvalidArgument);
  EXPECT_THROW(ParsedSpec::parse("demo::k2", t), InvalidArgument);    // empty field
  EXPECT_THROW(ParsedSpec::parse("demo:", t), InvalidArgument);
  EXPECT_THROW(ParsedSpec::parse("", t), InvalidArgument);
  EXPECT_THROW(ParsedSpec::parse("other:k2", t), InvalidArgument);    // wrong head
}

TEST(SpecSplit, HeadAndFields) {
  EXPECT_EQ(split_spec("kivi:k2:v2:g32"), (std::vector<std::string>{"kivi", "k2", "v2", "g32"}));
  EXPECT_EQ(split_spec("fp16"), (std::vector<std::string>{"fp16"}));
  try {
    split_spec(":g32");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("empty head"));
  }
}

TEST(SpecBudget, TokensAndFractions) {
  auto [spec, b] = split_budget("sink:s4@50%");
  EXPECT_EQ(spec, "sink:s4");
  EXPECT_EQ(b.kind, Budget::Kind::kFraction);
  EXPECT_DOUBLE_EQ(b.value, 0.5);
  EXPECT_EQ(b.to_string(), "@50%");
  EXPECT_EQ(b.resolve(10), 5);
  EXPECT_EQ(b.resolve(11), 5);
  auto [spec2, b2] = split_budget("h2o@256");
  EXPECT_EQ(spec2, "h2o");
  EXPECT_EQ(b2.kind, Budget::Kind::kTokens);
  EXPECT_EQ(b2.resolve(4096), 256);
  EXPECT_EQ(b2.to_string(), "@256");
  auto [spec3, b3] = split_budget("full");
  EXPECT_EQ(spec3, "full");
  EXPECT_EQ(b3.kind, Budget::Kind::kNone);
  EXPECT_EQ(b3.to_string(), "");
  EXPECT_EQ(b3.resolve(77), 77);
  EXPECT_EQ(Budget::parse("12.5%").to_string(), "@12.5%");
  EXPECT_EQ(Budget::parse("100%").resolve(9), 9);
}

TEST(SpecBudget, Errors) {
  try {
    split_budget("window@0");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("token budget must be an integer in [1, 1000000000], got 0"));
  }
  EXPECT_THROW(split_budget("window@"), InvalidArgument);
  EXPECT_THROW(split_budget("window@0%"), InvalidArgument);
  EXPECT_THROW(split_budget("window@150%"), InvalidArgument);
  EXPECT_THROW(split_budget("window@12.5"), InvalidArgument);
  EXPECT_THROW(split_budget("window@-3"), InvalidArgument);
  EXPECT_THROW(split_budget("window@abc"), InvalidArgument);
  EXPECT_THROW(split_budget("window@5@6"), InvalidArgument);
  // A fraction that rounds to zero tokens.
  EXPECT_THROW(Budget::parse("1%").resolve(50), CapacityError);
  EXPECT_THROW(Budget::parse("50%").resolve(0), InvalidArgument);
}

// Budgets beyond any context (and beyond int64) are rejected where they are parsed, naming
// the text the user wrote; the largest accepted one resolves exactly.
TEST(SpecBudget, HugeAndNegativeTokenBudgets) {
  auto message = [](const std::string& spec) {
    try {
      (void)split_budget(spec);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message("random@1e300"), "budget '@1e300': token budget must be an integer in [1, 1000000000], got 1e300");
  EXPECT_EQ(message("h2o@99999999999999999999"),
            "budget '@99999999999999999999': token budget must be an integer in [1, 1000000000], got "
            "99999999999999999999");
  EXPECT_EQ(message("window@-5"), "budget '@-5': token budget must be an integer in [1, 1000000000], got -5");
  EXPECT_EQ(message("window@1000000001"),
            "budget '@1000000001': token budget must be an integer in [1, 1000000000], got 1000000001");
  EXPECT_EQ(message("window@1e400"), "budget '@1e400': token budget must be an integer in [1, 1000000000], got 1e400");
  EXPECT_EQ(message("window@1e400%"), "budget '@1e400%': percentage must be in (0, 100], got 1e400%");
  EXPECT_EQ(message("window@1e-400%"), "budget '@1e-400%': percentage must be in (0, 100], got 1e-400%");
  // A percentage that keeps under one token of the largest context (or underflows to 0 once
  // divided by 100, which used to print back as '@0%') is refused; the smallest allowed one
  // keeps exactly one token of a kMaxTokens context and prints back as it was typed.
  EXPECT_EQ(message("window@7e-324%"),
            "budget '@7e-324%': percentage must be at least 1e-07% (less keeps under one token of any context up "
            "to 1000000000 tokens), got 7e-324%");
  EXPECT_EQ(message("window@9e-8%"),
            "budget '@9e-8%': percentage must be at least 1e-07% (less keeps under one token of any context up "
            "to 1000000000 tokens), got 9e-8%");
  const Budget smallest = split_budget("window@1e-7%").second;
  EXPECT_EQ(smallest.resolve(1000000000), 1);
  EXPECT_EQ(Budget::parse(smallest.to_string().substr(1)).value, smallest.value);
  EXPECT_EQ(split_budget("window@1000000000").second.resolve(5), 1000000000);
  EXPECT_EQ(split_budget("window@1e3").second.resolve(5), 1000);
  // A Budget built by hand is checked when it resolves.
  Budget b;
  b.kind = Budget::Kind::kTokens;
  b.value = 1e300;
  EXPECT_THROW(b.resolve(10), InvalidArgument);
}

// A number too large for a double is out of range (not "not a number"), in every spec table.
TEST(SpecParse, NumbersBeyondDoubleAreOutOfRange) {
  const ParamTable t = demo_table();
  try {
    ParsedSpec::parse("demo:k" + std::string(400, '9'), t);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("k=" + std::string(400, '9') + " out of range [1, 8]"));
  }
  try {
    make_quantizer("int4:g99999999999999999999");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("g=99999999999999999999 out of range [0, 65536]"));
  }
  EXPECT_THROW(ParsedSpec::parse("demo:r1e-400", t), InvalidArgument);
}

TEST(SpecParseInteger, RangesAndMessages) {
  EXPECT_EQ(parse_integer("42", "--context", 0, 100), 42);
  EXPECT_EQ(parse_integer("-7", "x", -10, 10), -7);
  EXPECT_EQ(parse_integer("9223372036854775807", "x", 0, INT64_MAX), INT64_MAX);
  auto message = [](const std::string& text, int64_t lo, int64_t hi) {
    try {
      (void)parse_integer(text, "--context", lo, hi);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message("101", 0, 100), "--context = 101 is out of range [0, 100]");
  EXPECT_EQ(message("-1", 0, 100), "--context = -1 is out of range [0, 100]");
  EXPECT_EQ(message("9223372036854775808", 0, 100), "--context = 9223372036854775808 is out of range [0, 100]");
  EXPECT_EQ(message("-99999999999999999999", 0, 100), "--context = -99999999999999999999 is out of range [0, 100]");
  try {
    (void)parse_integer("7", "", 1, 5);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "7 is out of range [1, 5]");  // a CLI option validator: CLI11 prefixes the option
  }
  for (const char* bad : {"", " 1", "1 ", "+1", "1e3", "0x10", "1.0", "one", "-"}) {
    EXPECT_EQ(message(bad, 0, 100), "--context = '" + std::string(bad) + "' is not an integer (expected one in [0, 100])")
        << bad;
  }
}

TEST(SpecDescribe, ListsEveryParam) {
  const std::string d = describe(demo_table());
  EXPECT_THAT(d, HasSubstr("demo — a demo method"));
  EXPECT_THAT(d, HasSubstr("k<int>  key bits (default 2, range [1, 8])"));
  EXPECT_THAT(d, HasSubstr("tok|chan  layout (default tok)"));
  for (const auto& t : registered_quantizers()) EXPECT_THAT(describe(t), HasSubstr(t.head));
}

}  // namespace
}  // namespace kvcache
