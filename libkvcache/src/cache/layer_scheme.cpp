// SPDX-License-Identifier: Apache-2.0
// The per-layer scheme `layers(<scheme>*<n>;...)` (kvcache/cache_scheme.h): consecutive runs of
// layers, each stored by its own cache scheme (KVTuner-style per-layer mixed K/V precision,
// arXiv 2502.04420). Its registration entry joins the scheme list of cache_scheme.cpp.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/layer_runs.h"
#include "registry/registry.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"

namespace kvcache {
namespace {

/// The most layers one run may name (far beyond any model; keeps the sums small).
constexpr int64_t kMaxRunLayers = 1000000;

const ParamTable& layers_table() {
  static const ParamTable t{
      "layers",
      "per-layer schemes (KVTuner-style mixed K/V precision, arXiv 2502.04420): layers(<scheme>*<n>;<scheme>*<n>;...) "
      "stores the first n layers with the first scheme, the next ones with the next; the counts must sum to the "
      "model's layers ('*1' may be left out)",
      {}};
  return t;
}

/// One run: `count` consecutive layers stored by `scheme`.
struct Run {
  std::shared_ptr<const CacheScheme> scheme;
  int64_t count = 1;
};

class LayerScheme final : public CacheScheme {
 public:
  LayerScheme(std::vector<Run> runs, std::string text) : runs_(std::move(runs)), text_(std::move(text)) {
    for (const auto& r : runs_) total_ += r.count;
    for (const auto& r : runs_) {
      const auto need = r.scheme->required_key_storage();
      if (!need) continue;
      KV_CHECK_ARG(!key_storage_ || *key_storage_ == *need, "cache scheme '", text_,
                   "': its layers need different key storages (pre-RoPE and post-RoPE keys); one cache stores one");
      key_storage_ = need;
    }
  }

  std::string spec() const override {
    std::string s = "layers(";
    for (size_t i = 0; i < runs_.size(); ++i) {
      s += (i ? ";" : "") + runs_[i].scheme->spec();
      if (runs_[i].count != 1) s += "*" + std::to_string(runs_[i].count);
    }
    return s + ")";
  }

  LayerStreams streams(const CacheGeometry& g, int64_t layer, int64_t residual_length) const override {
    KV_CHECK_ARG(g.num_layers == total_, "cache scheme '", text_, "': its runs cover ", total_, " layer",
                 total_ == 1 ? "" : "s", " (", counts(), "), the model has ", g.num_layers,
                 " (expected counts summing to ", g.num_layers, ")");
    KV_CHECK_ARG(layer >= 0 && layer < g.num_layers, "cache scheme '", text_, "': layer ", layer, " out of range [0, ",
                 g.num_layers, ")");
    int64_t first = 0;
    for (const auto& r : runs_) {
      if (layer < first + r.count) {
        // The run's scheme sees the same geometry and the same layer index (a scheme whose
        // quantizers differ per layer, e.g. calibrated ones, resolves the model's layer).
        return r.scheme->streams(g, layer, residual_length);
      }
      first += r.count;
    }
    KV_INTERNAL_ASSERT(false, "layers scheme: layer ", layer, " past its runs");
    return {};
  }

  std::optional<KeyStorage> required_key_storage() const override { return key_storage_; }

 private:
  std::string counts() const {
    std::string s;
    for (size_t i = 0; i < runs_.size(); ++i) s += (i ? " + " : "") + std::to_string(runs_[i].count);
    return s;
  }

  std::vector<Run> runs_;
  std::string text_;  ///< as written (errors name the user's text)
  int64_t total_ = 0;
  std::optional<KeyStorage> key_storage_;
};

std::unique_ptr<CacheScheme> make_layer_scheme(const std::string& inner) {
  const std::string text = "layers(" + inner + ")";
  std::vector<Run> runs;
  int64_t total = 0;
  const auto items = detail::split_layer_runs(inner);
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string& item = items[i];
    const std::string where = detail::str_cat("cache scheme '", text, "': run ", i + 1, " '", item, "'");
    KV_CHECK_ARG(!item.empty(), "cache scheme '", text, "': run ", i + 1,
                 " is empty (expected <scheme>*<layers> runs separated by ';', e.g. "
                 "'layers(kivi:k8:v4:g32:r128*4;kivi:k4:v2:g32:r128*20)')");
    // The count follows the last '*' outside parentheses; none: one layer.
    const size_t star = detail::layer_run_star(item);
    Run r;
    const std::string scheme = star == std::string::npos ? item : item.substr(0, star);
    if (star != std::string::npos) r.count = parse_integer(item.substr(star + 1), where + ": layer count", 1, kMaxRunLayers);
    KV_CHECK_ARG(!scheme.empty(), where, " names no scheme before '*' (expected e.g. 'int4*12')");
    KV_CHECK_ARG(spec_head(scheme) != "layers", where, ": a run cannot itself be per-layer (write its runs in place)");
    try {
      r.scheme = make_cache_scheme(scheme);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat(where, ": ", e.what()));
    }
    total += r.count;
    KV_CHECK_ARG(total <= kMaxRunLayers, "cache scheme '", text, "': its runs cover more than ", kMaxRunLayers, " layers");
    // Canonical: consecutive runs of one canonical scheme merge.
    if (!runs.empty() && runs.back().scheme->spec() == r.scheme->spec()) {
      runs.back().count += r.count;
    } else {
      runs.push_back(std::move(r));
    }
  }
  return std::make_unique<LayerScheme>(std::move(runs), text);
}

}  // namespace

namespace registry {

Entry layer_scheme_entry() {
  Entry e;
  e.kind = SpecKind::kCacheScheme;
  e.table = &layers_table();
  e.wrapper = true;
  e.scheme = [](const ParsedSpec&, const std::string& inner) -> std::unique_ptr<CacheScheme> {
    return make_layer_scheme(inner);
  };
  return e;
}

}  // namespace registry

std::string layers_scheme_spec(const std::vector<std::string>& per_layer) {
  KV_CHECK_ARG(!per_layer.empty(), "layers_scheme_spec: no layer");
  std::string inner;
  for (size_t i = 0; i < per_layer.size(); ++i) inner += (i ? ";" : "") + per_layer[i];
  return make_cache_scheme("layers(" + inner + ")")->spec();
}

}  // namespace kvcache
