// SPDX-License-Identifier: Apache-2.0
// The one registry of spec heads (registry/registry.h, kvcache/registry.h).
#include "registry/registry.h"

#include <map>
#include <sstream>

#include "kvcache/error.h"

namespace kvcache {
namespace registry {
namespace {

/// Spellings users have written in arm files that are not (or no longer) registered heads:
/// each is accepted as the head it maps to (and canonicalized to it: spec() prints the new one).
const std::map<std::string, std::string>& old_spellings() {
  static const std::map<std::string, std::string> m = {
      {"pyramidkv", "pyramid"},  // the study's arm parser once listed PyramidKV under this name
  };
  return m;
}

std::string where_it_belongs(SpecKind k) {
  switch (k) {
    case SpecKind::kQuantizer:
      return "a quantizer: use it as a cache scheme (CacheConfig::scheme, the part before '+' of an arm)";
    case SpecKind::kCacheScheme:
      return "a cache scheme: use it as CacheConfig::scheme (the part before '+' of an arm), or make_cache_scheme";
    case SpecKind::kPolicy:
      return "an eviction policy: use it as CacheConfig::policy (the part after '+' of an arm)";
  }
  return "";
}

}  // namespace

const std::vector<Entry>& entries() {
  static const std::vector<Entry> all = [] {
    std::vector<Entry> v = quantizer_entries();
    for (auto& e : scheme_entries()) v.push_back(std::move(e));
    for (auto& e : policy_entries()) v.push_back(std::move(e));
    std::map<std::string, size_t> seen;
    for (size_t i = 0; i < v.size(); ++i) {
      KV_INTERNAL_ASSERT(v[i].table != nullptr && !v[i].table->head.empty(), "registry: entry ", i, " has no table");
      const auto [it, fresh] = seen.emplace(v[i].table->head, i);
      KV_INTERNAL_ASSERT(fresh, "registry: head '", v[i].table->head, "' registered twice (as ", to_string(v[it->second].kind),
                         " and as ", to_string(v[i].kind), ")");
      KV_INTERNAL_ASSERT(old_spellings().count(v[i].table->head) == 0, "registry: '", v[i].table->head,
                         "' is listed as an old spelling");
    }
    return v;
  }();
  return all;
}

const Entry* find(const std::string& head) {
  const auto old = old_spellings().find(head);
  const std::string& h = old == old_spellings().end() ? head : old->second;
  for (const auto& e : entries()) {
    if (e.table->head == h) return &e;
  }
  return nullptr;
}

std::string heads(std::initializer_list<SpecKind> kinds) {
  std::ostringstream os;
  for (const auto& e : entries()) {
    for (SpecKind k : kinds) {
      if (e.kind == k) os << (os.tellp() > 0 ? ", " : "") << e.table->head;
    }
  }
  return os.str();
}

Parsed parse(const std::string& text, SpecKind want, std::initializer_list<SpecKind> known) {
  const std::string head = spec_head(text);
  KV_CHECK_ARG(!head.empty(), "spec '", text, "' has no head (grammar: head(:field)*, e.g. 'int4:g64')");
  const auto old = old_spellings().find(head);
  if (old != old_spellings().end()) return parse(old->second + text.substr(head.size()), want, known);
  const Entry* e = find(head);
  if (e == nullptr) {
    throw InvalidArgument(detail::str_cat("unknown ", to_string(want), " '", head, "' in spec '", text,
                                          "'; registered: ", heads(known)));
  }
  bool builds = false;
  for (SpecKind k : known) builds = builds || e->kind == k;
  KV_CHECK_ARG(builds || (want == SpecKind::kQuantizer && e->quantizer), "spec '", text, "': '", head, "' is ",
               where_it_belongs(e->kind), " (expected ", want == SpecKind::kPolicy ? "an " : "a ", to_string(want), ")");
  Parsed p;
  p.entry = e;
  if (e->wrapper) {
    const auto w = split_wrapper(text);
    KV_CHECK_ARG(w.has_value(), "spec '", text, "': '", head, "' wraps another spec: write ", head,
                 "(<spec>), e.g. '", head, "(int4)'");
    p.fields = ParsedSpec::parse(w->outer, *e->table);
    p.inner = w->inner;
  } else {
    KV_CHECK_ARG(text.find_first_of("()") == std::string::npos, "spec '", text, "': '", head,
                 "' takes fields 'head(:field)*', not a wrapped '(spec)'");
    p.fields = ParsedSpec::parse(text, *e->table);
  }
  return p;
}

}  // namespace registry

const char* to_string(SpecKind kind) {
  switch (kind) {
    case SpecKind::kQuantizer:
      return "quantizer";
    case SpecKind::kCacheScheme:
      return "cache scheme";
    case SpecKind::kPolicy:
      return "eviction policy";
  }
  return "?";
}

std::vector<RegisteredSpec> registered_specs() {
  std::vector<RegisteredSpec> out;
  for (const auto& e : registry::entries()) out.push_back({e.kind, *e.table, e.wrapper});
  return out;
}

std::optional<SpecKind> spec_kind(const std::string& spec) {
  const registry::Entry* e = registry::find(spec_head(spec));
  if (e == nullptr) return std::nullopt;
  return e->kind;
}

}  // namespace kvcache
