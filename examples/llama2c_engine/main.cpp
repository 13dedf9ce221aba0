// llama2c_engine: an inference engine of its own — a llama2.c checkpoint (the "version 0"
// .bin of Karpathy's llama2.c, e.g. stories260K) and its tokenizer .bin, its own matmuls,
// RMSNorm, SwiGLU and RoPE — that keeps its KV cache in libkvcache through the C API
// (kvcache/c_api.h) and nothing else of the library: no LibTorch, no C++ type of the library.
//
//   llama2c_engine MODEL.bin TOKENIZER.bin [--prompt TEXT | --ids 1,403,...] [--steps N]
//                  [--schemes fp32,int4,...] [--policy full] [--print-ids]
//
// For each cache scheme it generates --steps tokens greedily (the prompt prefilled in one
// chunk, then one token per step, as the project's runner does) and prints the text, the bytes
// the cache stores and reserves, the process's resident-set growth and the decode speed.
// --print-ids also prints `ids <scheme> <prompt ids> | <generated ids>` (what the parity test
// reads). Exit status 0, or 1 with one line on stderr for a bad file, option or cache error.
//
// The model, as run.c computes it: x = embedding(token); per layer
//   xb = rmsnorm(x) · w_att; q = Wq xb, k = Wk xb, v = Wv xb (per head, RoPE on q and k:
//   llama2.c rotates adjacent pairs (2i, 2i+1) by pos / 10000^(2i/D)); the cache appends k, v
//   (rotated by the engine: the cache's rope_theta is 0) and attends q over every cached token
//   (GQA: query head h reads KV head h / (H_q / H_kv)); x += Wo · attention; xb = rmsnorm(x) ·
//   w_ffn; x += W2 (silu(W1 xb) ⊙ W3 xb); logits = Wcls · rmsnorm(x) · w_final.
#include <kvcache/c_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

struct Fail : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------- model

struct Config {
  int dim = 0, hidden = 0, layers = 0, heads = 0, kv_heads = 0, vocab = 0, seq_len = 0;
  bool shared = true;  ///< the classifier is the embedding (a positive vocab_size in the header)
  int head_size() const { return dim / heads; }
  int kv_dim() const { return dim / heads * kv_heads; }
};

struct Weights {
  std::vector<float> emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, wcls;
};

/// Reads a version-0 llama2.c checkpoint: 7 int32 (dim, hidden_dim, n_layers, n_heads,
/// n_kv_heads, vocab_size, seq_len), then the float32 tensors in run.c's order; the file's size
/// must be exactly what the header implies.
void load_model(const std::string& path, Config& c, Weights& w) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Fail(path + ": cannot open the llama2.c checkpoint");
  int32_t h[7];
  if (!f.read(reinterpret_cast<char*>(h), sizeof h)) throw Fail(path + ": shorter than the 28-byte header");
  c.dim = h[0];
  c.hidden = h[1];
  c.layers = h[2];
  c.heads = h[3];
  c.kv_heads = h[4];
  c.shared = h[5] > 0;
  c.vocab = std::abs(h[5]);
  c.seq_len = h[6];
  const char* names[] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
  for (int i = 0; i < 7; ++i) {
    if (h[i] == 0 || (i != 5 && h[i] < 0)) throw Fail(path + ": header field " + names[i] + " = " + std::to_string(h[i]) + " must be positive");
  }
  if (c.dim % c.heads != 0 || c.heads % c.kv_heads != 0 || c.head_size() % 2 != 0) {
    throw Fail(path + ": dim " + std::to_string(c.dim) + ", n_heads " + std::to_string(c.heads) + ", n_kv_heads " +
               std::to_string(c.kv_heads) + " do not fit together");
  }
  const int64_t L = c.layers, D = c.dim, K = c.kv_dim(), H = c.hidden, V = c.vocab, S = c.seq_len;
  struct Part {
    std::vector<float>* dst;
    int64_t n;
  };
  std::vector<float> rope_tables;  // freq_cis_real/imag: llama2.c's legacy tables, unused
  const std::vector<Part> parts = {{&w.emb, V * D},       {&w.rms_att, L * D},   {&w.wq, L * D * D},
                                   {&w.wk, L * K * D},    {&w.wv, L * K * D},    {&w.wo, L * D * D},
                                   {&w.rms_ffn, L * D},   {&w.w1, L * H * D},    {&w.w2, L * D * H},
                                   {&w.w3, L * H * D},    {&w.rms_final, D},     {&rope_tables, S * (D / c.heads)}};
  int64_t need = 28;
  for (const Part& p : parts) need += 4 * p.n;
  if (!c.shared) need += 4 * V * D;
  f.seekg(0, std::ios::end);
  const int64_t size = static_cast<int64_t>(f.tellg());
  if (size != need) {
    throw Fail(path + ": " + std::to_string(size) + " bytes, but its header implies " + std::to_string(need) +
               " (not a version-0 llama2.c checkpoint, or truncated)");
  }
  f.seekg(28);
  for (const Part& p : parts) {
    p.dst->resize(static_cast<size_t>(p.n));
    f.read(reinterpret_cast<char*>(p.dst->data()), static_cast<std::streamsize>(4 * p.n));
  }
  if (c.shared) {
    w.wcls = w.emb;
  } else {
    w.wcls.resize(static_cast<size_t>(V * D));
    f.read(reinterpret_cast<char*>(w.wcls.data()), static_cast<std::streamsize>(4 * V * D));
  }
  if (!f) throw Fail(path + ": read error");
}

// ---------------------------------------------------------------- tokenizer (run.c's)

struct Tokenizer {
  std::vector<std::string> pieces;
  std::vector<float> scores;
  std::map<std::string, int> ids;

  void load(const std::string& path, int vocab) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw Fail(path + ": cannot open the llama2.c tokenizer");
    int32_t max_len = 0;
    if (!f.read(reinterpret_cast<char*>(&max_len), 4)) throw Fail(path + ": truncated tokenizer");
    for (int i = 0; i < vocab; ++i) {
      float score = 0;
      int32_t n = 0;
      if (!f.read(reinterpret_cast<char*>(&score), 4) || !f.read(reinterpret_cast<char*>(&n), 4) || n < 0) {
        throw Fail(path + ": truncated tokenizer at piece " + std::to_string(i) + " of " + std::to_string(vocab));
      }
      std::string s(static_cast<size_t>(n), '\0');
      if (!f.read(s.data(), n)) throw Fail(path + ": truncated tokenizer at piece " + std::to_string(i));
      ids.emplace(s, i);  // the first id of a piece, as run.c's sorted lookup finds one
      pieces.push_back(std::move(s));
      scores.push_back(score);
    }
  }

  /// BOS, a dummy-prefix space, one piece per UTF-8 code point (byte fallback id = byte + 3),
  /// then repeatedly the adjacent merge of the highest score (run.c's encode).
  std::vector<int64_t> encode(const std::string& text) const {
    std::vector<int64_t> t = {1};
    if (text.empty()) return t;
    if (auto it = ids.find(" "); it != ids.end()) t.push_back(it->second);
    for (size_t i = 0; i < text.size();) {
      size_t n = 1;
      while (i + n < text.size() && n < 4 && (static_cast<unsigned char>(text[i + n]) & 0xC0) == 0x80) ++n;
      const std::string cp = text.substr(i, n);
      if (auto it = ids.find(cp); it != ids.end()) {
        t.push_back(it->second);
      } else {
        for (char b : cp) t.push_back(static_cast<unsigned char>(b) + 3);
      }
      i += n;
    }
    while (true) {
      float best = -1e10f;
      int best_id = -1;
      size_t at = 0;
      for (size_t i = 1; i + 1 < t.size(); ++i) {  // never merge with BOS
        auto it = ids.find(pieces[static_cast<size_t>(t[i])] + pieces[static_cast<size_t>(t[i + 1])]);
        if (it != ids.end() && scores[static_cast<size_t>(it->second)] > best) {
          best = scores[static_cast<size_t>(it->second)];
          best_id = it->second;
          at = i;
        }
      }
      if (best_id < 0) break;
      t[at] = best_id;
      t.erase(t.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    return t;
  }

  std::string decode(int64_t prev, int64_t id) const {
    std::string s = pieces.at(static_cast<size_t>(id));
    if (prev == 1 && !s.empty() && s[0] == ' ') s.erase(0, 1);  // after BOS: no leading space
    unsigned byte = 0;
    if (std::sscanf(s.c_str(), "<0x%02X>", &byte) == 1) s = std::string(1, static_cast<char>(byte));
    return s;
  }
};

// ---------------------------------------------------------------- the forward pass

/// y[t] = W x[t] for t < T: W row-major [out, in], x [T, in], y [T, out].
void matmul(const float* w, const float* x, float* y, int64_t T, int64_t in, int64_t out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * in;
    for (int64_t o = 0; o < out; ++o) {
      const float* wr = w + o * in;
      float acc = 0.0f;
      for (int64_t i = 0; i < in; ++i) acc += wr[i] * xt[i];
      y[t * out + o] = acc;
    }
  }
}

/// o = w ⊙ x / sqrt(mean(x²) + 1e-5), per token.
void rmsnorm(const float* x, const float* w, float* o, int64_t T, int64_t n) {
  for (int64_t t = 0; t < T; ++t) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; ++i) ss += x[t * n + i] * x[t * n + i];
    ss = 1.0f / std::sqrt(ss / static_cast<float>(n) + 1e-5f);
    for (int64_t i = 0; i < n; ++i) o[t * n + i] = w[i] * (ss * x[t * n + i]);
  }
}

/// llama2.c's RoPE of `heads` heads of [T, heads·D]: pairs (2i, 2i+1) of each head rotated by
/// pos · 10000^(−2i/D).
void rope(float* x, int64_t T, int64_t heads, int64_t d, const int64_t* pos) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < d; i += 2) {
      const float freq = 1.0f / std::pow(10000.0f, static_cast<float>(i) / static_cast<float>(d));
      const float a = static_cast<float>(pos[t]) * freq, c = std::cos(a), s = std::sin(a);
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + t * heads * d + h * d + i;
        const float v0 = v[0], v1 = v[1];
        v[0] = v0 * c - v1 * s;
        v[1] = v0 * s + v1 * c;
      }
    }
  }
}

/// [T, H·D] (token-major) → [H, T, D] (the cache's head-major layout), and back.
void to_heads(const float* x, float* y, int64_t T, int64_t H, int64_t D) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) std::memcpy(y + (h * T + t) * D, x + (t * H + h) * D, static_cast<size_t>(D) * 4);
  }
}
void from_heads(const float* x, float* y, int64_t T, int64_t H, int64_t D) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) std::memcpy(y + (t * H + h) * D, x + (h * T + t) * D, static_cast<size_t>(D) * 4);
  }
}

void check(kvc_status s, const char* what) {
  if (s != KVC_OK) throw Fail(std::string(what) + ": " + kvc_last_error());
}

class Engine {
 public:
  Engine(const Config& c, const Weights& w) : c_(c), w_(w) {}

  /// Runs tokens [T] at positions p0.. through every layer with `cache`, ends the step as
  /// `step`, and returns the logits of the last token.
  std::vector<float> forward(kvc_cache* cache, const std::vector<int64_t>& tokens, int64_t p0, kvc_step step) {
    const int64_t T = static_cast<int64_t>(tokens.size()), D = c_.dim, K = c_.kv_dim(), H = c_.hidden;
    const int64_t hd = c_.head_size(), hq = c_.heads, hkv = c_.kv_heads;
    std::vector<float> x(static_cast<size_t>(T * D)), xb(x.size()), q(x.size()), att(x.size()), out(x.size());
    std::vector<float> k(static_cast<size_t>(T * K)), v(k.size()), kh(k.size()), vh(k.size()), qh(x.size());
    std::vector<float> h1(static_cast<size_t>(T * H)), h3(h1.size());
    std::vector<int64_t> pos(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      pos[static_cast<size_t>(t)] = p0 + t;
      std::memcpy(&x[static_cast<size_t>(t * D)], &w_.emb[static_cast<size_t>(tokens[static_cast<size_t>(t)] * D)],
                  static_cast<size_t>(D) * 4);
    }
    for (int64_t l = 0; l < c_.layers; ++l) {
      rmsnorm(x.data(), &w_.rms_att[static_cast<size_t>(l * D)], xb.data(), T, D);
      matmul(&w_.wq[static_cast<size_t>(l * D * D)], xb.data(), q.data(), T, D, D);
      matmul(&w_.wk[static_cast<size_t>(l * K * D)], xb.data(), k.data(), T, D, K);
      matmul(&w_.wv[static_cast<size_t>(l * K * D)], xb.data(), v.data(), T, D, K);
      rope(q.data(), T, hq, hd, pos.data());
      rope(k.data(), T, hkv, hd, pos.data());
      to_heads(q.data(), qh.data(), T, hq, hd);
      to_heads(k.data(), kh.data(), T, hkv, hd);
      to_heads(v.data(), vh.data(), T, hkv, hd);
      check(kvc_append(cache, l, kh.data(), vh.data(), KVC_FLOAT32, T, pos.data()), "kvc_append");
      check(kvc_attend(cache, l, qh.data(), KVC_FLOAT32, T, pos.data(), att.data()), "kvc_attend");
      from_heads(att.data(), out.data(), T, hq, hd);
      matmul(&w_.wo[static_cast<size_t>(l * D * D)], out.data(), xb.data(), T, D, D);
      for (size_t i = 0; i < x.size(); ++i) x[i] += xb[i];
      rmsnorm(x.data(), &w_.rms_ffn[static_cast<size_t>(l * D)], xb.data(), T, D);
      matmul(&w_.w1[static_cast<size_t>(l * H * D)], xb.data(), h1.data(), T, D, H);
      matmul(&w_.w3[static_cast<size_t>(l * H * D)], xb.data(), h3.data(), T, D, H);
      for (size_t i = 0; i < h1.size(); ++i) h1[i] = h1[i] / (1.0f + std::exp(-h1[i])) * h3[i];
      matmul(&w_.w2[static_cast<size_t>(l * D * H)], h1.data(), xb.data(), T, H, D);
      for (size_t i = 0; i < x.size(); ++i) x[i] += xb[i];
    }
    check(kvc_end_step(cache, step), "kvc_end_step");
    std::vector<float> last(static_cast<size_t>(D)), logits(static_cast<size_t>(c_.vocab));
    rmsnorm(&x[static_cast<size_t>((T - 1) * D)], w_.rms_final.data(), last.data(), 1, D);
    matmul(w_.wcls.data(), last.data(), logits.data(), 1, D, c_.vocab);
    return logits;
  }

 private:
  const Config& c_;
  const Weights& w_;
};

int64_t argmax(const std::vector<float>& v) {
  return static_cast<int64_t>(std::max_element(v.begin(), v.end()) - v.begin());  // the first maximum
}

int64_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

struct Run {
  std::vector<int64_t> ids;
  kvc_stats stats{};
  int64_t rss_growth = 0;
  double tokens_per_s = 0;
};

Run generate(const Config& c, const Weights& w, const std::vector<int64_t>& prompt, int64_t steps,
             const std::string& scheme, const std::string& policy) {
  kvc_config cfg;
  kvc_config_init(&cfg);
  cfg.scheme = scheme.c_str();
  cfg.policy = policy.c_str();
  cfg.num_layers = c.layers;
  cfg.num_q_heads = c.heads;
  cfg.num_kv_heads = c.kv_heads;
  cfg.head_dim = c.head_size();
  cfg.context_length = static_cast<int64_t>(prompt.size()) + steps;
  cfg.rope_theta = 0;  // the engine rotates its keys itself (llama2.c's pairwise RoPE)
  Run r;
  const int64_t rss0 = rss_bytes();
  kvc_cache* cache = nullptr;
  check(kvc_cache_create(&cfg, &cache), ("kvc_cache_create (" + scheme + ")").c_str());
  Engine engine(c, w);
  try {
    std::vector<float> logits = engine.forward(cache, prompt, 0, KVC_STEP_PREFILL_END);
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t next = argmax(logits);
      r.ids.push_back(next);
      if (s + 1 < steps) logits = engine.forward(cache, {next}, static_cast<int64_t>(prompt.size()) + s, KVC_STEP_DECODE);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.tokens_per_s = secs > 0 ? static_cast<double>(steps) / secs : 0;
    check(kvc_stats_get(cache, &r.stats), "kvc_stats_get");
    r.rss_growth = rss_bytes() - rss0;
  } catch (...) {
    kvc_cache_destroy(cache);
    throw;
  }
  kvc_cache_destroy(cache);
  return r;
}

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 3) {
      std::fprintf(stderr,
                   "usage: %s MODEL.bin TOKENIZER.bin [--prompt TEXT | --ids 1,2,...] [--steps N] "
                   "[--schemes a,b,...] [--policy P] [--print-ids]\n",
                   argv[0]);
      return 2;
    }
    std::string prompt_text = "Once upon a time", ids_arg, schemes_arg = "fp32,fp16,bf16,fp8:e4m3,int8,int4,int2",
                policy = "full";
    int64_t steps = 60;
    bool print_ids = false;
    for (int i = 3; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw Fail(a + " needs a value");
        return argv[++i];
      };
      if (a == "--prompt") {
        prompt_text = value();
      } else if (a == "--ids") {
        ids_arg = value();
      } else if (a == "--steps") {
        const std::string v = value();
        char* end = nullptr;
        steps = std::strtoll(v.c_str(), &end, 10);
        if (*end != '\0' || steps < 1 || steps > 1000000) throw Fail("--steps " + v + ": expected an integer in [1, 1000000]");
      } else if (a == "--schemes") {
        schemes_arg = value();
      } else if (a == "--policy") {
        policy = value();
      } else if (a == "--print-ids") {
        print_ids = true;
      } else {
        throw Fail("unknown option '" + a + "'");
      }
    }
    Config c;
    Weights w;
    load_model(argv[1], c, w);
    Tokenizer tok;
    tok.load(argv[2], c.vocab);
    std::vector<int64_t> prompt;
    if (!ids_arg.empty()) {
      for (const std::string& s : split(ids_arg)) {
        char* end = nullptr;
        const long long id = std::strtoll(s.c_str(), &end, 10);
        if (*end != '\0' || id < 0 || id >= c.vocab) {
          throw Fail("--ids: '" + s + "' is not a token id in [0, " + std::to_string(c.vocab) + ")");
        }
        prompt.push_back(id);
      }
      if (prompt.empty()) throw Fail("--ids: no token id");
    } else {
      prompt = tok.encode(prompt_text);
    }
    std::printf("%s: dim %d, %d layers, %d query / %d KV heads of %d, vocab %d; libkvcache %s (C API)\n", argv[1], c.dim,
                c.layers, c.heads, c.kv_heads, c.head_size(), c.vocab, kvc_version());
    std::printf("prompt %zu tokens, %lld new, policy %s\n", prompt.size(), static_cast<long long>(steps), policy.c_str());
    (void)generate(c, w, prompt, 1, "fp32", "full");  // warm-up: first-use allocations are not a cache's
    for (const std::string& scheme : split(schemes_arg)) {
      const Run r = generate(c, w, prompt, steps, scheme, policy);
      const double values = static_cast<double>(r.stats.tokens_resident) * 2 * c.kv_heads * c.head_size();
      std::printf("%-22s %6.2f bits/value  %8lld B stored  %8lld B reserved  RSS %+7.2f MB  %8.1f tok/s\n",
                  scheme.c_str(), values > 0 ? 8.0 * static_cast<double>(r.stats.bytes_resident) / values : 0.0,
                  static_cast<long long>(r.stats.bytes_resident), static_cast<long long>(r.stats.bytes_reserved),
                  static_cast<double>(r.rss_growth) / 1e6, r.tokens_per_s);
      std::string text;
      int64_t prev = 1;
      for (int64_t id : prompt) {
        if (id != 1) text += tok.decode(prev, id);
        prev = id;
      }
      for (int64_t id : r.ids) {
        text += tok.decode(prev, id);
        prev = id;
      }
      std::printf("  %s\n", text.c_str());
      if (print_ids) std::printf("ids %s %s | %s\n", scheme.c_str(), join(prompt).c_str(), join(r.ids).c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama2c_engine: error: %s\n", e.what());
    return 1;
  }
}
