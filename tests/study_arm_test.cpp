// SPDX-License-Identifier: Apache-2.0
// Arm specs: "quant+policy" parsing, the default list, --configs lists/files, --budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>

#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/study/arm.h"

using namespace kvcache;
using namespace kvcache::study;

TEST(StudyArm, ParseForms) {
  EXPECT_EQ(parse_arm("int4+h2o@50%"), (Arm{"int4", "h2o@50%"}));
  EXPECT_EQ(parse_arm(" kivi:k2:v2:g32:r128 + full "), (Arm{"kivi:k2:v2:g32:r128", "full"}));
  EXPECT_EQ(parse_arm("int8"), (Arm{"int8", "full"}));
  EXPECT_EQ(parse_arm("snapkv@50%"), (Arm{"fp32", "snapkv@50%"}));
  EXPECT_EQ(parse_arm("window:w256"), (Arm{"fp32", "window:w256"}));
  EXPECT_EQ(parse_arm("full"), control_arm());
  EXPECT_EQ(parse_arm("fp8:e5m2+sink:s4@25%").spec(), "fp8:e5m2+sink:s4@25%");
  EXPECT_THROW(parse_arm(""), InvalidArgument);
  EXPECT_THROW(parse_arm("int4+"), InvalidArgument);
  EXPECT_THROW(parse_arm("+full"), InvalidArgument);
  EXPECT_THROW(parse_arm("a+b+c"), InvalidArgument);
}

TEST(StudyArm, DefaultListIsTheSeedsTwelveThenSixThenTheNewerMethods) {
  const auto arms = default_arms();
  ASSERT_EQ(arms.size(), 26u);
  const std::vector<std::string> want = {
      "fp32+full", "fp16+full", "fp8:e4m3+full", "int8+full", "int4+full", "int2+full",
      "fp32+window@50%", "fp32+sink@50%", "fp32+h2o@50%", "fp32+random@50%", "int8+sink@50%", "int4+h2o@50%",
      "bf16+full", "fp8:e5m2+full", "kivi:k2:v2:g32:r128+full", "kivi:k4:v4:g32:r128+full",
      "fp32+snapkv@50%", "fp32+tova@50%",
      "fp32+keydiff@50%", "fp32+knorm@50%", "fp32+expected@50%", "fp32+adakv:expected@50%",
      "fp32+adakv:snapkv@50%", "fp32+duo:s16:r48@50%", "fp32+decode:i8:b4:expected@50%", "fp32+kvzip@50%"};
  ASSERT_EQ(want.size(), arms.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(arms[i].spec(), want[i]);
  EXPECT_EQ(arms[0], control_arm());
}

TEST(StudyArm, ConfigsCommaListAndFile) {
  auto a = parse_arm_list("fp32+full, int4+h2o@50%,,snapkv@25%");
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a[2].spec(), "fp32+snapkv@25%");
  const std::string path = ::testing::TempDir() + "/study_arms.txt";
  {
    std::ofstream out(path);
    out << "# arms\nfp32+full\n\n  int4+h2o@50%   # heavy hitter\nkivi:k2:v2:g32:r128\n";
  }
  auto f = parse_arm_list(path);
  ASSERT_EQ(f.size(), 3u);
  EXPECT_EQ(f[1].spec(), "int4+h2o@50%");
  EXPECT_EQ(f[2].spec(), "kivi:k2:v2:g32:r128+full");
  {
    std::ofstream out(path);
    out << "fp32+full\nint4++h2o\n";
  }
  try {
    parse_arm_list(path);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(":2:"), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
  EXPECT_THROW(parse_arm_list(" , "), InvalidArgument);
  // A bare word that is no arm set nor scheme names the sets (a mistyped --configs evict2026).
  try {
    parse_arm_list("evict2025");
    FAIL() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--configs 'evict2025' is not an arm set (default, evict2026, deepdive, long, rotation2025), a file, nor"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(parse_arm_list("int4").size(), 1u);  // a bare scheme is still an arm
}

TEST(StudyArm, BudgetOverrideAndDedupe) {
  auto arms = with_budget(default_arms(), "25%");
  EXPECT_EQ(arms[0].spec(), "fp32+full");
  EXPECT_EQ(arms[6].spec(), "fp32+window@25%");
  EXPECT_EQ(arms[11].spec(), "int4+h2o@25%");
  auto t = with_budget({parse_arm("fp32+window:w64"), parse_arm("int4+h2o@50%")}, "@128");
  EXPECT_EQ(t[0].spec(), "fp32+window:w64@128");
  EXPECT_EQ(t[1].spec(), "int4+h2o@128");
  EXPECT_THROW(with_budget(default_arms(), "150%"), InvalidArgument);
  EXPECT_THROW(with_budget(default_arms(), "abc"), InvalidArgument);
  auto d = dedupe({parse_arm("int4"), parse_arm("fp32+full"), parse_arm("int4+full")});
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0].spec(), "int4+full");
}

TEST(StudyArm, ArmSetsAndEveryRegisteredPolicyHead) {
  // Any registered policy head is a policy (pyramid was read as a quantizer when the list was
  // kept by hand), wrappers included.
  EXPECT_EQ(parse_arm("pyramid:b2"), (Arm{"fp32", "pyramid:b2"}));
  EXPECT_EQ(parse_arm("knorm:stream"), (Arm{"fp32", "knorm:stream"}));
  EXPECT_EQ(parse_arm("adakv:snapkv@50%"), (Arm{"fp32", "adakv:snapkv@50%"}));
  EXPECT_EQ(parse_arm("int4+decode:i8:b4:expected@50%"), (Arm{"int4", "decode:i8:b4:expected@50%"}));
  // Named sets: "default" is the default list; "evict2026" is documented, starts with the
  // control, and every arm is a canonical, buildable spec at its own budget and at another.
  const auto sets = arm_sets();
  ASSERT_EQ(sets.size(), 5u);
  EXPECT_EQ(sets[0].name, "default");
  EXPECT_EQ(parse_arm_list("default").size(), default_arms().size());
  EXPECT_EQ(sets[1].name, "evict2026");
  const auto arms = parse_arm_list(" evict2026 ");
  ASSERT_EQ(arms.size(), 18u);
  EXPECT_EQ(arms[0], control_arm());
  for (const auto& a : arms) {
    EXPECT_EQ(make_eviction_policy(a.policy)->spec(), a.policy) << a.spec();
  }
  for (const auto& a : with_budget(arms, "25%")) EXPECT_NO_THROW(make_eviction_policy(a.policy)) << a.spec();
  for (const std::string head : {"knorm", "keydiff", "expected", "adakv", "duo", "decode", "kvzip"}) {
    bool found = false;
    for (const auto& a : arms) found = found || a.policy.rfind(head, 0) == 0;
    EXPECT_TRUE(found) << head << " is in no arm of evict2026";
  }
  // "long": the long suite's default arms, the control first, each canonical and buildable, with
  // token budgets of 2048 and one percentage.
  EXPECT_EQ(sets[3].name, "long");
  const auto lng = parse_arm_list("long");
  ASSERT_EQ(lng.size(), 15u);
  EXPECT_EQ(lng[0], control_arm());
  int fixed = 0;
  for (const auto& a : lng) {
    EXPECT_EQ(make_cache_scheme(a.scheme)->spec(), a.scheme) << a.spec();
    EXPECT_EQ(make_eviction_policy(a.policy)->spec(), a.policy) << a.spec();
    fixed += a.policy.find("@2048") != std::string::npos;
  }
  EXPECT_EQ(fixed, 6);
  // "deepdive": the quantization schemes with full, each canonical and buildable, the control first.
  EXPECT_EQ(sets[2].name, "deepdive");
  const auto deep = parse_arm_list("deepdive");
  ASSERT_EQ(deep.size(), 17u);
  EXPECT_EQ(deep[0], control_arm());
  std::vector<std::string> schemes;
  int auto_calibrated = 0;
  for (const auto& a : deep) {
    EXPECT_EQ(a.policy, "full") << a.spec();
    schemes.push_back(a.scheme);
    if (a.scheme.find(":cal=auto") != std::string::npos) {
      // Resolved by kv_study run; anywhere else the scheme says so.
      ++auto_calibrated;
      EXPECT_EQ(spec_head(a.scheme), "kvquant") << a.spec();
      try {
        (void)make_cache_scheme(a.scheme);
        ADD_FAILURE() << a.spec() << " built without a calibration";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("cal=auto is resolved by 'kv_study run'"), std::string::npos) << e.what();
      }
      continue;
    }
    EXPECT_EQ(make_cache_scheme(a.scheme)->spec(), a.scheme) << a.spec();
  }
  EXPECT_EQ(auto_calibrated, 6);
  for (const std::string s : {"int8", "fp8:e4m3", "kivi:k2:v2:g32:r128", "kivi:k4:v4:g32:r128",
                              "gear:b2:g32:s0.02:r2:loop3:nb64", "had(int4)", "had(int2)", "int3"}) {
    EXPECT_NE(std::find(schemes.begin(), schemes.end(), s), schemes.end()) << s << " is not in deepdive";
  }
  // "rotation2025": the issue-38 ablation, the control first, every arm with full, canonical and
  // buildable (KVQuant's cal=auto aside), every method head present.
  EXPECT_EQ(sets[4].name, "rotation2025");
  const auto rot = parse_arm_list("rotation2025");
  ASSERT_EQ(rot.size(), 28u);
  EXPECT_EQ(rot[0], control_arm());
  std::set<std::string> heads;
  for (const auto& a : rot) {
    EXPECT_EQ(a.policy, "full") << a.spec();
    heads.insert(spec_head(a.scheme));
    if (a.scheme.find(":cal=auto") != std::string::npos) continue;
    EXPECT_EQ(make_cache_scheme(a.scheme)->spec(), a.scheme) << a.spec();
  }
  for (const std::string h : {"tq", "turboquant", "polar", "qjl", "kivi", "kvquant", "had", "int4", "int3", "int2"}) {
    EXPECT_TRUE(heads.count(h)) << h << " is not in rotation2025";
  }
}
