// SPDX-License-Identifier: Apache-2.0
#include "cache/radix_tree.h"

#include <algorithm>
#include <queue>
#include <sstream>
#include <tuple>

#include "kvcache/error.h"

namespace kvcache::cache {

struct RadixTree::Node {
  using Key = std::vector<int64_t>;  ///< the first page of a child's edge
  std::vector<int64_t> key;          ///< edge tokens (whole pages; empty at a root)
  std::vector<PageId> pages;         ///< one per page of `key`
  Node* parent = nullptr;
  std::map<Key, std::unique_ptr<Node>> children;
  int64_t lock_ref = 0;
  int64_t last_access = 0;
  uint64_t serial = 0;  ///< creation order: ties of last_access evict the older node first
  int64_t page = 1;     ///< the namespace's page size

  Key first_page() const { return Key(key.begin(), key.begin() + page); }
};

RadixTree::RadixTree(std::function<int64_t()> clock) : clock_(std::move(clock)) {}

RadixTree::~RadixTree() = default;

int64_t RadixTree::tick() { return clock_ ? clock_() : ++ticks_; }

RadixTree::Node* RadixTree::root(const Namespace& ns) {
  KV_INTERNAL_ASSERT(ns.page_tokens >= 1, "RadixTree namespace '", ns.key, "' page ", ns.page_tokens);
  auto& r = roots_[ns.key];
  if (!r) {
    r = std::make_unique<Node>();
    r->page = ns.page_tokens;
  }
  KV_INTERNAL_ASSERT(r->page == ns.page_tokens, "RadixTree namespace '", ns.key, "' has pages of ", r->page,
                     " tokens, not ", ns.page_tokens);
  return r.get();
}

int64_t RadixTree::lock_ref(const Node* node) { return node->lock_ref; }

RadixTree::Node* RadixTree::split(Node* c, int64_t pages) {
  Node* parent = c->parent;
  const int64_t page = c->page;
  const Node::Key at = c->first_page();
  auto top = std::make_unique<Node>();
  top->page = page;
  top->key.assign(c->key.begin(), c->key.begin() + pages * page);
  top->pages.assign(c->pages.begin(), c->pages.begin() + pages);
  top->parent = parent;
  top->lock_ref = c->lock_ref;  // every lock through c passes through top
  top->last_access = c->last_access;
  top->serial = ++serial_;
  c->key.erase(c->key.begin(), c->key.begin() + pages * page);
  c->pages.erase(c->pages.begin(), c->pages.begin() + pages);
  std::unique_ptr<Node> lower = std::move(parent->children[at]);
  lower->parent = top.get();
  top->children[lower->first_page()] = std::move(lower);
  Node* t = top.get();
  parent->children[at] = std::move(top);
  ++nodes_;
  return t;
}

RadixTree::Node* RadixTree::walk(const Namespace& ns, const int64_t* tokens, int64_t n, int64_t* matched,
                                 std::vector<PageId>* out) {
  Node* node = root(ns);
  const int64_t page = node->page;
  n -= n % page;
  const int64_t now = tick();
  node->last_access = now;
  int64_t i = 0;
  while (i < n) {
    auto it = node->children.find(Node::Key(tokens + i, tokens + i + page));
    if (it == node->children.end()) break;
    Node* c = it->second.get();
    const auto edge = static_cast<int64_t>(c->pages.size());
    int64_t k = 1;  // the first page matched by the key
    while (k < edge && i + (k + 1) * page <= n &&
           std::equal(tokens + i + k * page, tokens + i + (k + 1) * page, c->key.begin() + k * page)) {
      ++k;
    }
    if (k < edge) c = split(c, k);
    c->last_access = now;
    if (out != nullptr) out->insert(out->end(), c->pages.begin(), c->pages.end());
    i += k * page;
    node = c;
    if (k < edge) break;
  }
  *matched = i;
  return node;
}

RadixTree::Match RadixTree::match(const Namespace& ns, const int64_t* tokens, int64_t n) {
  Match m;
  m.node = walk(ns, tokens, n, &m.tokens, &m.pages);
  return m;
}

int64_t RadixTree::cached_tokens(const Namespace& ns, const int64_t* tokens, int64_t n) const {
  const auto r = roots_.find(ns.key);
  if (r == roots_.end()) return 0;
  const Node* node = r->second.get();
  const int64_t page = node->page;
  KV_INTERNAL_ASSERT(page == ns.page_tokens, "RadixTree namespace '", ns.key, "' has pages of ", page, " tokens, not ",
                     ns.page_tokens);
  n -= n % page;
  int64_t i = 0;
  while (i < n) {
    const auto it = node->children.find(Node::Key(tokens + i, tokens + i + page));
    if (it == node->children.end()) break;
    const Node* c = it->second.get();
    const auto edge = static_cast<int64_t>(c->pages.size());
    int64_t k = 1;
    while (k < edge && i + (k + 1) * page <= n &&
           std::equal(tokens + i + k * page, tokens + i + (k + 1) * page, c->key.begin() + k * page)) {
      ++k;
    }
    i += k * page;
    if (k < edge) break;
    node = c;
  }
  return i;
}

RadixTree::Node* RadixTree::insert(const Namespace& ns, const int64_t* tokens, int64_t n,
                                   const std::function<PageId(int64_t page)>& make_page) {
  const int64_t page = root(ns)->page;
  n -= n % page;
  int64_t i = 0;
  Node* node = walk(ns, tokens, n, &i, nullptr);
  if (i == n) return node;
  auto leaf = std::make_unique<Node>();
  leaf->page = page;
  leaf->key.assign(tokens + i, tokens + n);
  for (int64_t p = i / page; p < n / page; ++p) leaf->pages.push_back(make_page(p));
  leaf->parent = node;
  leaf->last_access = node->last_access;
  leaf->serial = ++serial_;
  pages_ += static_cast<int64_t>(leaf->pages.size());
  ++nodes_;
  Node* l = leaf.get();
  node->children[leaf->first_page()] = std::move(leaf);
  return l;
}

void RadixTree::lock(Node* node) {
  for (Node* n = node; n != nullptr && n->parent != nullptr; n = n->parent) ++n->lock_ref;
}

void RadixTree::unlock(Node* node) {
  for (Node* n = node; n != nullptr && n->parent != nullptr; n = n->parent) {
    KV_INTERNAL_ASSERT(n->lock_ref > 0, "RadixTree::unlock of an unlocked node");
    --n->lock_ref;
  }
}

int64_t RadixTree::evict(const std::function<bool()>& enough, const std::function<void(PageId)>& free_page) {
  using Entry = std::tuple<int64_t, uint64_t, Node*>;  // (last_access, serial, leaf): smallest first
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
  std::vector<Node*> stack;
  for (auto& [ns, r] : roots_) stack.push_back(r.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (auto& [k, c] : n->children) stack.push_back(c.get());
    if (n->parent != nullptr && n->children.empty() && n->lock_ref == 0) heap.emplace(n->last_access, n->serial, n);
  }
  int64_t freed = 0;
  while (!heap.empty() && !enough()) {
    Node* leaf = std::get<2>(heap.top());
    heap.pop();
    const Node::Key at = leaf->first_page();
    while (!leaf->pages.empty() && !enough()) {
      free_page(leaf->pages.back());
      leaf->pages.pop_back();
      leaf->key.resize(leaf->key.size() - static_cast<size_t>(leaf->page));
      --pages_;
      ++freed;
    }
    if (!leaf->pages.empty()) break;  // enough, with part of this leaf left
    Node* parent = leaf->parent;
    parent->children.erase(at);
    --nodes_;
    if (parent->parent != nullptr && parent->children.empty() && parent->lock_ref == 0) {
      heap.emplace(parent->last_access, parent->serial, parent);
    }
  }
  return freed;
}

void RadixTree::for_each_page(const std::function<void(PageId, bool)>& fn) const {
  std::vector<const Node*> stack;
  for (const auto& [ns, r] : roots_) stack.push_back(r.get());
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    for (const auto& [k, c] : n->children) stack.push_back(c.get());
    for (PageId p : n->pages) fn(p, n->lock_ref > 0);
  }
}

void RadixTree::for_each_page_in_order(
    const std::function<void(const Namespace& ns, PageId page, PageId parent, const int64_t* tokens)>& fn) const {
  for (const auto& [key, r] : roots_) {
    const Namespace ns{key, r->page};
    // (node, the page before its first one); children pushed in reverse key order.
    std::vector<std::pair<const Node*, PageId>> stack;
    for (auto it = r->children.rbegin(); it != r->children.rend(); ++it) stack.emplace_back(it->second.get(), -1);
    while (!stack.empty()) {
      auto [n, parent] = stack.back();
      stack.pop_back();
      for (size_t i = 0; i < n->pages.size(); ++i) {
        fn(ns, n->pages[i], parent, n->key.data() + static_cast<int64_t>(i) * n->page);
        parent = n->pages[i];
      }
      for (auto it = n->children.rbegin(); it != n->children.rend(); ++it) stack.emplace_back(it->second.get(), parent);
    }
  }
}

std::string RadixTree::dump(const std::string& ns_key) const {
  std::ostringstream os;
  std::function<void(const Node*)> children = [&](const Node* n) {
    bool first = true;
    for (const auto& [k, c] : n->children) {
      if (!first) os << ",";
      first = false;
      os << "[";
      for (size_t i = 0; i < c->key.size(); ++i) os << (i ? "," : "") << c->key[i];
      os << "]";
      if (!c->children.empty()) {
        os << "{";
        children(c.get());
        os << "}";
      }
    }
  };
  const auto it = roots_.find(ns_key);
  if (it != roots_.end()) children(it->second.get());
  return os.str();
}

void RadixTree::check(const std::vector<const Node*>& locks) const {
  std::map<const Node*, int64_t> own;
  for (const Node* n : locks) ++own[n];
  int64_t pages = 0, nodes = 0;
  // Returns the locks in n's subtree.
  std::function<int64_t(const Node*)> visit = [&](const Node* n) -> int64_t {
    int64_t locked = 0;
    for (const auto& [k, c] : n->children) {
      const int64_t page = n->page;
      KV_CHECK(c->parent == n, InternalError, "RadixTree: broken parent link");
      KV_CHECK(c->page == page && !c->key.empty() && static_cast<int64_t>(c->key.size()) % page == 0 &&
                   static_cast<int64_t>(c->pages.size()) * page == static_cast<int64_t>(c->key.size()),
               InternalError, "RadixTree: edge of ", c->key.size(), " tokens with ", c->pages.size(), " pages");
      KV_CHECK(c->first_page() == k, InternalError, "RadixTree: child keyed by another first page");
      pages += static_cast<int64_t>(c->pages.size());
      ++nodes;
      locked += visit(c.get());
    }
    const auto it = own.find(n);
    if (it != own.end()) locked += it->second;
    KV_CHECK(n->parent == nullptr || n->lock_ref == locked, InternalError, "RadixTree: a node's lock_ref is ",
             n->lock_ref, " but ", locked, " locks are held at or below it");
    return locked;
  };
  for (const auto& [ns, r] : roots_) visit(r.get());
  KV_CHECK(pages == pages_ && nodes == nodes_, InternalError, "RadixTree: ", pages, " pages / ", nodes,
           " nodes counted, ", pages_, " / ", nodes_, " recorded");
}

}  // namespace kvcache::cache
