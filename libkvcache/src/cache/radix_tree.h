// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file radix_tree.h (internal)
/// RadixTree: the prefix index of a MultiSequenceCache — SGLang's RadixAttention tree
/// (methods.md b.8) at page granularity. Keys are token-id sequences truncated to whole pages
/// of P tokens; each node holds the tokens of its edge and one opaque PageId per page of it
/// (the cache's handle on that page's blocks). Children are keyed by their first page. One
/// root per namespace (SGLang's extra_key), each with its page size P, fixed when the namespace
/// is first used: the cache passes the storage key of a sequence's configuration and its block
/// size, so the same tokens stored two ways never alias. P = 1 is SGLang's default.
///
///   match(ns, t)     walks the longest cached prefix of t, page by page; a match that ends
///                    inside an edge splits the node there (no data moves: the page ids are
///                    divided). Returns the pages along the path.
///   insert(ns, t)    walks/splits like match and adds a leaf for the unmatched pages, asking
///                    the caller for a PageId for each new page only (pages already cached
///                    are never duplicated).
///   lock / unlock    SGLang's inc/dec_lock_ref: +1/−1 on the node and each ancestor; a node
///                    with lock_ref > 0 is in use and never evicted.
///   evict(enough)    frees pages of unlocked leaves, least recently used leaf first and each
///                    leaf's pages from the tail (vLLM frees a request's tail blocks first),
///                    deleting emptied leaves and offering their parents, until enough() says so.
///
/// Recency is a logical clock ticked by every match and insert (or an injected one, for tests).
/// Not thread-safe.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kvcache::cache {

class RadixTree {
 public:
  using PageId = int64_t;
  struct Node;

  struct Match {
    std::vector<PageId> pages;  ///< one per matched page, in order
    int64_t tokens = 0;         ///< matched tokens (pages × page_tokens)
    Node* node = nullptr;       ///< the node ending exactly at the match (the root if none)
  };

  /// A namespace: its key and its page size P (tokens, ≥ 1).
  struct Namespace {
    std::string key;
    int64_t page_tokens = 1;
  };

  /// @param clock recency source (default: a counter ticked by every match and insert).
  explicit RadixTree(std::function<int64_t()> clock = {});
  ~RadixTree();
  RadixTree(const RadixTree&) = delete;
  RadixTree& operator=(const RadixTree&) = delete;

  /// The longest cached prefix of tokens[0 .. n) in `ns` (n truncated to whole pages).
  /// @throws InternalError if `ns` was first used with another page size.
  Match match(const Namespace& ns, const int64_t* tokens, int64_t n);
  /// Tokens of the longest cached prefix of tokens[0 .. n) in `ns` (whole pages), as match()
  /// finds it but changing nothing: no split, no recency tick. 0 for a namespace never used.
  int64_t cached_tokens(const Namespace& ns, const int64_t* tokens, int64_t n) const;
  /// Inserts tokens[0 .. n) (whole pages) in `ns`. `make_page(i)` gives the PageId of page i
  /// (tokens [i·P, (i+1)·P)) for each page the tree does not hold yet, in increasing i.
  /// @return the node ending at the last page (the root when n < page_tokens).
  Node* insert(const Namespace& ns, const int64_t* tokens, int64_t n,
               const std::function<PageId(int64_t page)>& make_page);

  /// lock_ref + 1 on `node` and its ancestors (the root excluded).
  void lock(Node* node);
  /// lock_ref − 1 likewise. @throws InternalError on a node that is not locked.
  void unlock(Node* node);

  /// Frees pages of unlocked leaves (LRU leaf first, tail pages first): `free_page(id)` for each,
  /// until `enough()` is true or nothing is evictable. @return pages freed.
  int64_t evict(const std::function<bool()>& enough, const std::function<void(PageId)>& free_page);

  /// Every page held, with whether its node is locked: fn(page, locked).
  void for_each_page(const std::function<void(PageId, bool)>& fn) const;
  /// Every page in pre-order — namespaces and children in key order, a node's pages in order —
  /// so a page comes after the page before it on its path: fn(ns, page, parent, tokens) with
  /// the namespace, the page, the page before it (−1 for a namespace's first page) and the
  /// ns.page_tokens token ids it keys.
  void for_each_page_in_order(
      const std::function<void(const Namespace& ns, PageId page, PageId parent, const int64_t* tokens)>& fn) const;
  /// Pages held in all namespaces.
  int64_t num_pages() const { return pages_; }
  /// Nodes (roots excluded).
  int64_t num_nodes() const { return nodes_; }
  /// The lock count of `node` (tests, invariants).
  static int64_t lock_ref(const Node* node);

  /// The tree of `ns` as text, children in key order: "[1,2]{[3],[4,5]{[6,7]}},[8,9,10,11,12]".
  std::string dump(const std::string& ns_key) const;
  /// Verifies parent links, edge lengths, page counts, and that every node's lock_ref equals
  /// the number of `locks` (the nodes lock() was called on, once each) in its subtree.
  /// @throws InternalError.
  void check(const std::vector<const Node*>& locks) const;

 private:
  Node* root(const Namespace& ns);
  /// Splits `c` after its first `pages` pages; returns the new upper node.
  Node* split(Node* c, int64_t pages);
  /// Walks the cached prefix of tokens[0 .. n) (whole pages), splitting where it ends inside an
  /// edge; touches the path. Returns the last node; `*matched` = tokens matched; `out` the pages.
  Node* walk(const Namespace& ns, const int64_t* tokens, int64_t n, int64_t* matched, std::vector<PageId>* out);
  int64_t tick();

  std::function<int64_t()> clock_;
  int64_t ticks_ = 0;
  uint64_t serial_ = 0;
  int64_t pages_ = 0, nodes_ = 0;
  std::map<std::string, std::unique_ptr<Node>> roots_;
};

}  // namespace kvcache::cache
