// SPDX-License-Identifier: Apache-2.0
// The `kvquant` cache scheme (KVQuant, arXiv 2401.18079): per-layer calibrated key and value
// quantizers (quant/kvquant_quantizer.h) from a calibration file (kvcache/kvquant.h).
#include "cache/kvquant_scheme.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <mutex>
#include <sstream>

#include "kvcache/error.h"
#include "kvcache/kvquant.h"
#include "quant/kvquant_quantizer.h"

namespace kvcache {
namespace {

const ParamTable& kvquant_table() {
  static const ParamTable t = [] {
    ParamTable tt{"kvquant",
                  "KVQuant (arXiv 2401.18079): pre-RoPE keys per channel with calibrated static ranges, values "
                  "per token, per-layer non-uniform (k-means) codebooks, dense-and-sparse fp16 outliers",
                  {{"b", "bits per dense value (2^b centroids per layer and per K/V)", ParamDef::Kind::kInt, 4, 2, 4,
                    {}},
                   {"o", "outlier percent kept exactly in fp16 (1 = the paper's 1%, sparsity 0.99; 0 = none)",
                    ParamDef::Kind::kFloat, 0, 0, 9.99, {}},
                   {"c", "key outlier slots per token (0 = the default max(2, ceil(4 D (1 - p))); beyond them the "
                    "farthest are kept, the rest clamped)", ParamDef::Kind::kInt, 0, 0, 4096, {}},
                   {"f", "first tokens kept in fp16 (attention sinks; 0 = off)", ParamDef::Kind::kInt, 0, 0,
                    static_cast<double>(kMaxTokens), {}},
                   {"qnorm", "Q-Norm: match the dequantised mean and std per layer (the paper's 2-bit setting)",
                    ParamDef::Kind::kChoice, 0, 0, 0, {"noqnorm", "qnorm"}},
                   {"cal", "calibration file written by kv_study calibrate (required)", ParamDef::Kind::kText, 0, 0, 0,
                    {}}}};
    tt.params[0].shown = true;
    tt.params[0].allowed = {2, 3, 4};
    return tt;
  }();
  return t;
}

/// Calibration files by path, re-read when the file changes (size or modification time):
/// every CacheConfig::validate() and CacheManager builds the scheme again.
std::shared_ptr<const KvquantCalibration> load_cached(const std::string& path) {
  static std::mutex mu;
  struct Held {
    uintmax_t size = 0;
    std::filesystem::file_time_type mtime;
    std::shared_ptr<const KvquantCalibration> cal;
  };
  static std::map<std::string, Held> held;
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  const auto mtime = ec ? std::filesystem::file_time_type{} : std::filesystem::last_write_time(path, ec);
  std::lock_guard<std::mutex> lock(mu);
  if (!ec) {
    const auto it = held.find(path);
    if (it != held.end() && it->second.size == size && it->second.mtime == mtime) return it->second.cal;
  }
  auto cal = std::make_shared<const KvquantCalibration>(load_kvquant_calibration(path));
  if (!ec) held[path] = Held{size, mtime, cal};
  return cal;
}

class KvquantScheme final : public CacheScheme {
 public:
  explicit KvquantScheme(const ParsedSpec& p)
      : bits_(static_cast<int>(p.integer("b"))), percent_(p.num("o")), slots_(p.integer("c")), sinks_(p.integer("f")),
        qnorm_(p.choice("qnorm") == "qnorm"), path_(p.str("cal")), spec_(p.canonical()), text_(p.text()) {
    KV_CHECK_ARG(!path_.empty(), "cache scheme '", text_,
                 "': KVQuant needs its calibration: add ':cal=<file>' (write one with 'kv_study calibrate --model M "
                 "--out FILE'), or in 'kv_study run' ':cal=auto' (the run calibrates its model)");
    KV_CHECK_ARG(path_ != kKvquantAutoCalibration, "cache scheme '", text_, "': cal=", kKvquantAutoCalibration,
                 " is resolved by 'kv_study run' (it calibrates the model into the run directory); here name a file "
                 "written by 'kv_study calibrate --model M --out FILE'");
    try {
      cal_ = load_cached(path_);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat("cache scheme '", text_, "': ", e.what()));
    }
    const double sparsity = 1.0 - percent_ / 100.0;
    const KvquantLevel* level = nullptr;
    for (const auto& l : cal_->levels) {
      if (std::fabs(l.sparsity - sparsity) < 1e-9) level = &l;
    }
    if (level == nullptr) {
      std::ostringstream held;
      for (const auto& l : cal_->levels) held << (held.tellp() > 0 ? ", " : "") << (1.0 - l.sparsity) * 100.0 << "%";
      KV_CHECK_ARG(false, "cache scheme '", text_, "': calibration '", path_, "' holds no level for o", percent_,
                   " (", percent_, "% outliers, sparsity ", sparsity, "); it holds ", held.str(),
                   " (kv_study calibrate --sparsity sets them)");
    }
    KV_CHECK_ARG(slots_ == 0 || percent_ > 0, "cache scheme '", text_, "': c", slots_,
                 " sets key outlier slots, but o0 keeps no outliers (add e.g. ':o1')");
    KV_CHECK_ARG(slots_ <= cal_->head_dim, "cache scheme '", text_, "': c", slots_, " key outlier slots exceed head_dim ",
                 cal_->head_dim, " of calibration '", path_, "'");
    size_t bi = 0;
    try {
      bi = cal_->bits_index(bits_);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat("cache scheme '", text_, "': calibration '", path_, "': ", e.what()));
    }
    for (int64_t l = 0; l < cal_->num_layers; ++l) {
      const KvquantLayerCalibration& lc = level->layers[static_cast<size_t>(l)];
      LayerStreams s;
      for (int stream = 0; stream < 2; ++stream) {
        auto st = std::make_shared<quant::KvquantStream>();
        st->keys = stream == 0;
        st->bits = bits_;
        st->sparsity = level->sparsity;
        const KvquantCodebook& cb = (st->keys ? lc.key_codebooks : lc.value_codebooks)[bi];
        st->lut = cb.centroids;
        for (float c : cb.centroids) st->dec.push_back(qnorm_ ? cb.qnorm_scale * c + cb.qnorm_shift : c);
        st->num_heads = cal_->num_kv_heads;
        st->head_dim = cal_->head_dim;
        st->key_slots = slots_ > 0 ? slots_ : -1;
        if (st->keys) {
          st->lower = lc.key_lower;
          st->upper = lc.key_upper;
        }
        st->name = spec_ + "{layer " + std::to_string(l) + "}";
        StreamSpec& ss = st->keys ? s.key : s.value;
        const std::shared_ptr<const quant::KvquantStream> cst = st;
        ss.quantizer = std::make_shared<quant::KvquantQuantizer>(cst, 0);
        if (st->keys) {
          for (int64_t h = 0; h < cal_->num_kv_heads; ++h) {
            ss.head_quantizers.push_back(std::make_shared<quant::KvquantQuantizer>(cst, h));
          }
        }
        ss.residual = 0;
        ss.flush = ResidualFlush::kSliding;
        ss.residual_dtype = DType::kFloat16;
        ss.sink_tokens = sinks_;
      }
      layers_.push_back(std::move(s));
    }
  }

  std::string spec() const override { return spec_; }

  LayerStreams streams(const CacheGeometry& g, int64_t layer, int64_t residual_length) const override {
    KV_CHECK_ARG(g.num_layers == cal_->num_layers && g.num_kv_heads == cal_->num_kv_heads && g.head_dim == cal_->head_dim,
                 "cache scheme '", spec_, "': calibration '", path_, "' is for a model of [L=", cal_->num_layers,
                 ", H_kv=", cal_->num_kv_heads, ", D=", cal_->head_dim, "], this cache is [L=", g.num_layers,
                 ", H_kv=", g.num_kv_heads, ", D=", g.head_dim, "] (calibrate this model: kv_study calibrate)");
    KV_CHECK_ARG(layer >= 0 && layer < g.num_layers, "cache scheme '", spec_, "': layer ", layer, " out of range [0, ",
                 g.num_layers, ")");
    KV_CHECK_ARG(residual_length == 0, "cache scheme '", spec_,
                 "' keeps no full-precision residual window (KVQuant quantizes every token; 'f' keeps the first "
                 "ones); CacheConfig::residual_length must be 0, got ",
                 residual_length);
    return layers_[static_cast<size_t>(layer)];
  }

  std::optional<KeyStorage> required_key_storage() const override { return KeyStorage::kPreRoPE; }

 private:
  int bits_;
  double percent_;
  int64_t slots_;  ///< 0: the default rule
  int64_t sinks_;
  bool qnorm_;
  std::string path_, spec_, text_;
  std::shared_ptr<const KvquantCalibration> cal_;
  std::vector<LayerStreams> layers_;
};

}  // namespace

namespace registry {

Entry kvquant_entry() {
  Entry e;
  e.kind = SpecKind::kCacheScheme;
  e.table = &kvquant_table();
  e.scheme = [](const ParsedSpec& p, const std::string&) -> std::unique_ptr<CacheScheme> {
    return std::make_unique<KvquantScheme>(p);
  };
  return e;
}

}  // namespace registry
}  // namespace kvcache
