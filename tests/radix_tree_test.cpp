// SPDX-License-Identifier: Apache-2.0
// The prefix index (src/cache/radix_tree.h): SGLang's own demo vector (methods.md b.8) for
// insert/split/match, pages, namespaces, locks and LRU eviction with an injected clock.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "cache/radix_tree.h"
#include "kvcache/error.h"

namespace kvcache {
namespace {

using cache::RadixTree;
using Ids = std::vector<int64_t>;

/// Inserts `t`, giving each new page the id 100·i + page (i = the insert's number): the ids say
/// which insert created a page and where.
struct Inserter {
  Inserter(RadixTree& t, RadixTree::Namespace n) : tree(t), ns(std::move(n)) {}
  RadixTree& tree;
  RadixTree::Namespace ns;
  int64_t calls = 0;
  std::vector<int64_t> made;  ///< pages created by the last insert
  RadixTree::Node* operator()(const Ids& t) {
    ++calls;
    made.clear();
    return tree.insert(ns, t.data(), static_cast<int64_t>(t.size()), [&](int64_t page) {
      made.push_back(100 * calls + page);
      return 100 * calls + page;
    });
  }
};

TEST(RadixTree, SglangDemoVectorInsertSplitMatch) {
  // methods.md b.8: insert [1,2,3], [1,2,3], [1,2,4,5], [1,2,4,5,6,7], [8,9,10,11,12] →
  // root → [1,2] → {[3], [4,5] → [6,7]}, and [8..12]; match [1,2,4,9] returns the indices of
  // [1,2,4] and splits [4,5] into [4] → [5].
  RadixTree tree;
  Inserter ins(tree, {"", 1});
  ins({1, 2, 3});
  EXPECT_EQ(ins.made, (Ids{100, 101, 102}));
  ins({1, 2, 3});
  EXPECT_TRUE(ins.made.empty()) << "a prefix already cached is never duplicated";
  ins({1, 2, 4, 5});
  EXPECT_EQ(ins.made, (Ids{302, 303}));  // pages 2 and 3 only: [1,2] is shared
  EXPECT_EQ(tree.dump(""), "[1,2]{[3],[4,5]}");
  ins({1, 2, 4, 5, 6, 7});
  EXPECT_EQ(ins.made, (Ids{404, 405}));
  ins({8, 9, 10, 11, 12});
  EXPECT_EQ(tree.dump(""), "[1,2]{[3],[4,5]{[6,7]}},[8,9,10,11,12]");
  EXPECT_EQ(tree.num_pages(), 12);
  EXPECT_EQ(tree.num_nodes(), 5);

  const Ids q{1, 2, 4, 9};
  const RadixTree::Match m = tree.match({"", 1}, q.data(), 4);
  EXPECT_EQ(m.tokens, 3);
  EXPECT_EQ(m.pages, (Ids{100, 101, 302}));  // the KV of 1, 2 (first insert) and 4 (third)
  EXPECT_EQ(tree.dump(""), "[1,2]{[3],[4]{[5]{[6,7]}}},[8,9,10,11,12]");
  EXPECT_EQ(tree.num_pages(), 12) << "a split moves no page";
  EXPECT_EQ(tree.num_nodes(), 6);
  tree.check({});

  const Ids none{7, 1};
  EXPECT_EQ(tree.match({"", 1}, none.data(), 2).tokens, 0);
  const Ids all{1, 2, 4, 5, 6, 7, 8};
  EXPECT_EQ(tree.match({"", 1}, all.data(), 7).pages, (Ids{100, 101, 302, 303, 404, 405}));
}

// cached_tokens counts what match() would match, without splitting a node or ticking the
// clock (end_step uses it to plan what it publishes before the step may be refused).
TEST(RadixTree, CachedTokensPeeksWithoutChangingTheTree) {
  int64_t now = 0, ticks = 0;
  RadixTree tree([&] {
    ++ticks;
    return ++now;
  });
  Inserter ins(tree, {"a", 2});
  ins({1, 2, 3, 4, 5, 6});
  ins({1, 2, 7, 8});
  const std::string before = tree.dump("a");
  EXPECT_EQ(before, "[1,2]{[3,4,5,6],[7,8]}");
  const int64_t ticks_before = ticks;
  const Ids q{1, 2, 3, 4, 9, 9, 5};
  EXPECT_EQ(tree.cached_tokens({"a", 2}, q.data(), 7), 4);  // [1,2] and [3,4]: inside the edge [3,4,5,6]
  EXPECT_EQ(tree.cached_tokens({"a", 2}, q.data(), 3), 2);  // n truncated to whole pages
  EXPECT_EQ(tree.cached_tokens({"a", 2}, q.data(), 1), 0);
  const Ids r{1, 2, 7, 8, 1, 1};
  EXPECT_EQ(tree.cached_tokens({"a", 2}, r.data(), 6), 4);
  EXPECT_EQ(tree.cached_tokens({"b", 2}, r.data(), 6), 0);  // a namespace never used
  EXPECT_EQ(tree.dump("a"), before) << "no split";
  EXPECT_EQ(ticks, ticks_before) << "no recency tick";
  EXPECT_EQ(tree.match({"a", 2}, q.data(), 7).tokens, 4);  // match agrees, and splits
  EXPECT_EQ(tree.dump("a"), "[1,2]{[3,4]{[5,6]},[7,8]}");
}

TEST(RadixTree, PagesMatchWholeAndNamespacesNeverAlias) {
  RadixTree tree;
  const RadixTree::Namespace fp16{"fp16", 2}, int4{"int4", 2};
  Inserter a(tree, fp16);
  a({1, 2, 3, 4, 5});  // 5 tokens: two whole pages, the fifth token is not cached
  EXPECT_EQ(a.made, (Ids{100, 101}));
  EXPECT_EQ(tree.dump("fp16"), "[1,2,3,4]");
  const Ids q{1, 2, 3, 9};
  const auto m = tree.match(fp16, q.data(), 4);
  EXPECT_EQ(m.tokens, 2) << "a page matches whole or not at all";
  EXPECT_EQ(m.pages, (Ids{100}));
  EXPECT_EQ(tree.dump("fp16"), "[1,2]{[3,4]}");
  const Ids same{1, 2, 3, 4};
  EXPECT_EQ(tree.match(int4, same.data(), 4).tokens, 0) << "the same tokens in another namespace";
  Inserter b(tree, int4);
  b({1, 2, 3, 4});
  EXPECT_EQ(b.made, (Ids{100, 101})) << "int4 gets pages of its own";
  EXPECT_EQ(tree.num_pages(), 4);
  EXPECT_THROW(tree.match({"fp16", 4}, q.data(), 4), InternalError) << "a namespace keeps its page size";
}

TEST(RadixTree, LocksAndLruEvictionLeavesFirstTailFirst) {
  int64_t now = 0;
  RadixTree tree([&] { return now; });
  const RadixTree::Namespace ns{"", 1};
  Inserter ins(tree, ns);
  now = 10;
  RadixTree::Node* a = ins({1, 2, 3, 4});  // pages 100..103
  now = 20;
  ins({1, 2, 7});  // [1,2] → {[3,4], [7]}: page 202
  now = 30;
  RadixTree::Node* c = ins({9, 8});  // 300, 301
  tree.lock(a);
  EXPECT_EQ(RadixTree::lock_ref(a), 1);
  tree.check({a});
  EXPECT_THROW(tree.check({}), InternalError) << "the check counts the locks";

  std::vector<int64_t> freed;
  auto free_page = [&](int64_t p) { freed.push_back(p); };
  // Three pages: the LRU unlocked leaf is [7] (20), then [9,8] (30) from its tail; [3,4] is locked.
  int64_t budget = 3;
  auto enough = [&] { return static_cast<int64_t>(freed.size()) >= budget; };
  EXPECT_EQ(tree.evict(enough, free_page), 3);
  EXPECT_EQ(freed, (Ids{202, 301, 300}));
  EXPECT_EQ(tree.dump(""), "[1,2]{[3,4]}");
  // Everything else is locked: nothing more to free.
  budget = 10;
  EXPECT_EQ(tree.evict(enough, free_page), 0);
  tree.unlock(a);
  EXPECT_THROW(tree.unlock(a), InternalError);
  now = 40;
  EXPECT_EQ(tree.evict(enough, free_page), 4);
  EXPECT_EQ(freed, (Ids{202, 301, 300, 103, 102, 101, 100})) << "the leaf, tail first, then its emptied parent";
  EXPECT_EQ(tree.num_pages(), 0);
  EXPECT_EQ(tree.num_nodes(), 0);
  tree.check({});
  (void)c;
}

TEST(RadixTree, PartialEvictionKeepsTheLeafHead) {
  RadixTree tree;
  const RadixTree::Namespace ns{"", 2};
  Inserter ins(tree, ns);
  ins({1, 2, 3, 4, 5, 6});
  std::vector<int64_t> freed;
  EXPECT_EQ(tree.evict([&] { return !freed.empty(); }, [&](int64_t p) { freed.push_back(p); }), 1);
  EXPECT_EQ(freed, (Ids{102}));
  EXPECT_EQ(tree.dump(""), "[1,2,3,4]");
  const Ids q{1, 2, 3, 4, 5, 6};
  EXPECT_EQ(tree.match(ns, q.data(), 6).pages, (Ids{100, 101}));
  tree.check({});
}

TEST(RadixTree, PagesInOrderComeAfterTheirParents) {
  // The SGLang demo tree, pages of 1 token, plus a namespace of 2-token pages: pre-order, children
  // in key order, each page with the page before it on its path (−1 first) and its tokens.
  RadixTree tree;
  Inserter ins(tree, {"a", 1});
  ins({1, 2, 3});
  ins({1, 2, 4, 5});
  ins({8, 9});
  Inserter two(tree, {"b", 2});
  two({7, 7, 6, 6});
  std::vector<std::string> got;
  tree.for_each_page_in_order([&](const RadixTree::Namespace& ns, RadixTree::PageId page, RadixTree::PageId parent,
                                  const int64_t* tokens) {
    std::string t;
    for (int64_t i = 0; i < ns.page_tokens; ++i) t += (i ? "," : "") + std::to_string(tokens[i]);
    got.push_back(ns.key + ":" + std::to_string(page) + "<" + std::to_string(parent) + " [" + t + "]");
  });
  EXPECT_EQ(got, (std::vector<std::string>{"a:100<-1 [1]", "a:101<100 [2]", "a:102<101 [3]", "a:202<101 [4]",
                                           "a:203<202 [5]", "a:300<-1 [8]", "a:301<300 [9]", "b:100<-1 [7,7]",
                                           "b:101<100 [6,6]"}));
}

}  // namespace
}  // namespace kvcache
