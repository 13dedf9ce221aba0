// SPDX-License-Identifier: Apache-2.0
// The block store under the CacheManager: the pool (free list, reference counts), every
// quantizer's StoredLayout against its QuantizedTensor (same bytes), block lists (holes,
// merging, per-channel groups), and the bytes a cache reserves against the bytes it stores.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "cache/block_list.h"
#include "cache/block_pool.h"
#include "cache/cache_manager_access.h"
#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using cache::Block;
using cache::BlockFormat;
using cache::BlockList;
using cache::BlockPool;
using cache::StreamFormats;
using testing::make_config;
using testing::positions_range;

TEST(BlockPool, FreeListReferenceCountsAndSlabs) {
  BlockPool pool(100);  // rounded to 104 B
  EXPECT_EQ(pool.block_bytes(), 104);
  const auto a = pool.allocate(), b = pool.allocate();
  EXPECT_NE(a, b);
  EXPECT_EQ(pool.blocks_in_use(), 2);
  EXPECT_EQ(pool.data(b) - pool.data(a), 104);  // carved in address order
  const int64_t per_slab = pool.blocks_allocated();
  EXPECT_EQ(per_slab, 256 * 1024 / 104);
  pool.retain(a);
  pool.release(a);
  EXPECT_EQ(pool.refcount(a), 1);
  pool.release(a);
  EXPECT_EQ(pool.blocks_in_use(), 1);
  EXPECT_EQ(pool.allocate(), a);  // LIFO: the freed block comes back first
  for (int64_t i = 2; i < per_slab; ++i) pool.allocate();
  EXPECT_EQ(pool.blocks_allocated(), per_slab);
  pool.allocate();  // a second slab
  EXPECT_EQ(pool.blocks_allocated(), 2 * per_slab);
  EXPECT_THROW(pool.release(static_cast<cache::BlockId>(2 * per_slab - 1)), InternalError);  // never allocated
  pool.clear();
  EXPECT_EQ(pool.blocks_in_use(), 0);
  EXPECT_EQ(pool.slab_bytes(), 0);
}

// StoredLayout is exactly QuantizedTensor's layout: encode() writes quantize()'s bytes and
// decode() reproduces dequantize() bit for bit, for every registered format.
TEST(StoredLayout, EncodeDecodeAreQuantizeDequantizeByteForByte) {
  const std::vector<std::string> specs = {"fp32",  "fp16",    "bf16",   "fp8:e4m3", "fp8:e5m2", "fp8:e4m3:scaled",
                                          "int8",  "int4",    "int2",   "int8:g16", "int4:g8",  "int2:g4",
                                          "int8:g8:chan", "int4:g16:chan", "int2:g4:chan", "int3", "int3:g8",
                                          "int3:g16:chan", "had(fp32)", "had(int4:g8)", "had(int3:g8:chan)",
                                          "had(fp8:e4m3:scaled)"};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  const int64_t d = 32, t = 48;
  const at::Tensor x = at::randn({1, 1, t, d}, gen) * 3.0 + 0.5;
  for (const auto& spec : specs) {
    auto q = make_quantizer(spec);
    const StoredLayout l = q->stored_layout(d);
    const QuantizedTensor qt = q->quantize(x);
    const int64_t groups = t / l.group_tokens;
    auto bytes_of = [](const at::Tensor& a) { return a.defined() ? a.numel() * static_cast<int64_t>(a.element_size()) : 0; };
    EXPECT_EQ(groups * l.code_bytes, bytes_of(as_tensor(qt.codes))) << spec;
    const int64_t meta = groups * l.meta_count * kvcache::dtype_size(l.meta_dtype);
    if (!l.tensor_scale) {
      EXPECT_EQ(meta, bytes_of(as_tensor(qt.scales))) << spec;
    }
    EXPECT_EQ(l.has_zeros ? meta : 0, bytes_of(as_tensor(qt.zeros))) << spec;
    EXPECT_DOUBLE_EQ(static_cast<double>(l.group_bytes()) * 8 / static_cast<double>(l.group_tokens * d),
                     q->bits_per_value(d))
        << spec;
    // Raw encode into buffers of the layout's sizes.
    const float ts = q->fit_tensor_scale(x);
    std::vector<uint8_t> codes(static_cast<size_t>(groups * l.code_bytes)), sc(static_cast<size_t>(meta)),
        ze(static_cast<size_t>(meta));
    const at::Tensor xf = x.contiguous();
    const EncodeStatus st = q->encode(xf.data_ptr<float>(), groups, d, ts, {codes.data(), sc.data(), ze.data()});
    EXPECT_FALSE(st.overflow || st.nonfinite) << spec;
    EXPECT_EQ(std::memcmp(codes.data(), qt.codes.data(), codes.size()), 0) << spec;
    if (l.meta_count > 0) {
      EXPECT_EQ(std::memcmp(sc.data(), qt.scales.data(), sc.size()), 0) << spec;
    }
    if (l.has_zeros) {
      EXPECT_EQ(std::memcmp(ze.data(), qt.zeros.data(), ze.size()), 0) << spec;
    }
    if (l.tensor_scale) {
      EXPECT_EQ(ts, as_tensor(qt.scales).item<float>()) << spec;
    }
    at::Tensor out = at::empty({t, d});
    q->decode({codes.data(), sc.data(), ze.data()}, groups, d, ts, out.data_ptr<float>());
    EXPECT_TRUE(at::equal(out.view({1, 1, t, d}), kvcache::dequantize(*q, qt))) << spec;
  }
  EXPECT_EQ(make_quantizer("int4:g32:chan")->stored_layout(64).group_tokens, 32);
  EXPECT_FALSE(make_quantizer("int4:g32:chan")->stored_layout(64).token_readable());
  EXPECT_THROW(make_quantizer("int4:g24")->stored_layout(64), InvalidArgument);  // 64 % 24
  EXPECT_THROW(make_quantizer("had(int4)")->stored_layout(48), InvalidArgument);  // not a power of two
  // int3: 8 codes in 3 bytes, + fp16 scale and zero per group.
  EXPECT_EQ(make_quantizer("int3:g32")->stored_layout(64).code_bytes, 24);
  EXPECT_EQ(make_quantizer("int3:g32:chan")->stored_layout(64).code_bytes, 12 * 64);
  EXPECT_EQ(make_quantizer("had(int3:g32)")->stored_layout(64).code_bytes, 24);
}

TEST(StoredLayout, Fp16OverflowIsReportedNotWritten) {
  auto q = make_quantizer("int4");
  const StoredLayout l = q->stored_layout(8);
  std::vector<float> x(8, 1.0f);
  x[3] = 1e6f;  // the fp16 scale of this token overflows
  std::vector<uint8_t> codes(static_cast<size_t>(l.code_bytes)), meta(static_cast<size_t>(l.meta_bytes()));
  EXPECT_TRUE(q->encode(x.data(), 1, 8, 1.0f, {codes.data(), meta.data(), meta.data() + l.meta_bytes() / 2}).overflow);
}

/// Formats of one stream for tests: int4 per token (or per channel) + fp16 residual + fp32.
struct Formats {
  std::unique_ptr<Quantizer> main, res, fp32;
  std::vector<std::unique_ptr<BlockPool>> pools;
  StreamFormats f;
  Formats(const std::string& spec, int64_t d, int64_t cap) {
    main = make_quantizer(spec);
    res = make_quantizer("fp16");
    fp32 = make_quantizer("fp32");
    auto add = [&](const Quantizer& q, int64_t c) {
      pools.push_back(std::make_unique<BlockPool>(BlockFormat::bytes_for(q, d, c)));
      return BlockFormat(q, d, c, pools.back().get());
    };
    const StoredLayout ml = main->stored_layout(d);
    f.f[StreamFormats::kMain] = add(*main, ml.token_readable() ? cap : ml.group_tokens);
    f.f[StreamFormats::kResidual] = add(*res, cap);
    f.f[StreamFormats::kFallback] = add(*fp32, cap);
    if (!ml.token_readable()) f.f[StreamFormats::kConverted] = add(*res, ml.group_bytes() / (2 * d));
  }
};

std::vector<float> rows(int64_t n, int64_t d, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto t = at::randn({n, d}, gen).contiguous();
  return std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + n * d);
}

std::vector<int64_t> iota(int64_t first, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = first + i;
  return v;
}

// int4 per token, D 8: a token stores 4 B of codes + 2 B scale + 2 B zero = 8 B; blocks of
// 4 tokens reserve 4 × 4 + 8 (scales) + 8 (zeros) = 32 B.
TEST(BlockList, HolesFreeEmptyBlocksAndAdjacentBlocksMerge) {
  Formats F("int4", 8, 4);
  BlockList L(&F.f);
  const auto x = rows(10, 8, 1);
  const auto pos = iota(100, 10);
  L.append(StreamFormats::kMain, x.data(), pos.data(), 10, 1.0f);
  L.check("append");
  EXPECT_EQ(L.blocks().size(), 3u);  // 4 + 4 + 2
  EXPECT_EQ(L.live(), 10);
  EXPECT_EQ(L.bytes_resident(), 80);
  EXPECT_EQ(L.bytes_reserved(), 3 * 32);
  // Evict a hole in block 0: nothing merges (3 + 4 > 4).
  const int64_t e1[] = {1};
  L.evict(e1, 1, 1.0f);
  L.check("hole");
  EXPECT_EQ(L.blocks().size(), 3u);
  EXPECT_EQ(L.bytes_resident(), 72);
  EXPECT_EQ(L.bytes_reserved(), 96);
  // Evict two of block 1 (resident indices 3, 4 = positions 104, 105): blocks 0 (3 live) and
  // 1 (2 live) do not fit one block, but block 1 and 2 (2 + 2) do: they merge, freeing one.
  const int64_t e2[] = {3, 4};
  L.evict(e2, 2, 1.0f);
  L.check("merge");
  ASSERT_EQ(L.blocks().size(), 2u);
  EXPECT_EQ(L.bytes_reserved(), 64);
  std::vector<int64_t> p;
  L.live_positions(p);
  EXPECT_EQ(p, (std::vector<int64_t>{100, 102, 103, 106, 107, 108, 109}));
  // The survivors keep their stored values exactly (rows moved, never requantized).
  std::vector<float> got;
  L.live_rows(got, 1.0f);
  auto q = make_quantizer("int4");
  const auto ref = kvcache::dequantize(*q, q->quantize(at::from_blob(const_cast<float*>(x.data()), {1, 1, 10, 8}).clone()));
  for (size_t i = 0; i < p.size(); ++i) {
    for (int64_t j = 0; j < 8; ++j) {
      EXPECT_EQ(got[i * 8 + static_cast<size_t>(j)], ref[0][0][p[i] - 100][j].item<float>());
    }
  }
  // Evicting a whole block frees it at once.
  const int64_t e3[] = {0, 1, 2};
  L.evict(e3, 3, 1.0f);
  L.check("free");
  EXPECT_EQ(L.live(), 4);
  EXPECT_EQ(L.blocks().size(), 1u);
  EXPECT_EQ(L.bytes_reserved(), 32);
  // Appending after a merged block continues in it when it has room, else a new block.
  const auto y = rows(1, 8, 2);
  const int64_t p110 = 110;
  L.append(StreamFormats::kMain, y.data(), &p110, 1, 1.0f);
  L.check("append after");
  EXPECT_EQ(L.blocks().size(), 2u);
  L.clear();
  EXPECT_EQ(F.pools[0]->blocks_in_use(), 0);
}

TEST(BlockList, PopFrontDrainsTheResidualInOrder) {
  Formats F("int4", 8, 4);
  BlockList R(&F.f);
  const auto x = rows(6, 8, 3);
  const auto pos = iota(0, 6);
  R.append(StreamFormats::kResidual, x.data(), pos.data(), 6, 1.0f);
  std::vector<float> out(3 * 8);
  std::vector<int64_t> op(3);
  R.pop_front(3, out.data(), op.data(), 1.0f);
  R.check("pop");
  EXPECT_EQ(op, (std::vector<int64_t>{0, 1, 2}));
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], static_cast<float>(at::Half(x[i])));
  EXPECT_EQ(R.live(), 3);
  R.pop_front(2, nullptr, nullptr, 1.0f);  // empties block 0: freed
  EXPECT_EQ(R.blocks().size(), 1u);
  EXPECT_EQ(R.bytes_reserved(), 4 * 8 * 2);
}

// A per-channel group (int4, g 8, D 8: 32 B codes + 16 + 16 B metadata = 64 B) is one block.
// Survivors whose fp16 rows (16 B each) fit the group's 64 B — at most 4 — move to a small
// fp16 block of capacity 4 (64 B reserved: never more than the group); more stay in the group.
TEST(BlockList, PerChannelGroupsConvertOrKeepTheirBytes) {
  Formats F("int4:g8:chan", 8, 16);
  BlockList L(&F.f);
  const auto x = rows(24, 8, 4);
  const auto pos = iota(0, 24);
  L.append(StreamFormats::kMain, x.data(), pos.data(), 24, 1.0f);
  EXPECT_EQ(L.blocks().size(), 3u);
  EXPECT_EQ(L.bytes_resident(), 3 * 64);
  std::vector<float> before;
  L.live_rows(before, 1.0f);
  // Group 0 keeps 4 (→ fp16), group 1 keeps 5 (stays, 3 dead slots), group 2 loses all.
  std::vector<int64_t> e = {0, 2, 4, 6, 8, 10, 12};
  for (int64_t i = 16; i < 24; ++i) e.push_back(i);
  L.evict(e.data(), static_cast<int64_t>(e.size()), 1.0f);
  L.check("convert");
  ASSERT_EQ(L.blocks().size(), 2u);
  EXPECT_EQ(L.blocks()[0].format, StreamFormats::kConverted);
  EXPECT_EQ(L.blocks()[1].format, StreamFormats::kMain);
  EXPECT_EQ(L.blocks()[1].filled - L.blocks()[1].live, 3);
  EXPECT_EQ(L.bytes_resident(), 4 * 16 + 64);
  EXPECT_EQ(L.bytes_reserved(), 64 + 64);
  std::vector<int64_t> p;
  L.live_positions(p);
  EXPECT_EQ(p, (std::vector<int64_t>{1, 3, 5, 7, 9, 11, 13, 14, 15}));
  std::vector<float> after;
  L.live_rows(after, 1.0f);
  for (size_t i = 0; i < p.size(); ++i) {
    for (int64_t j = 0; j < 8; ++j) {
      const float b = before[static_cast<size_t>(p[i]) * 8 + static_cast<size_t>(j)];
      // Converted rows: the dequantized value rounded to fp16 once; quantized rows: exact.
      EXPECT_EQ(after[i * 8 + static_cast<size_t>(j)], i < 4 ? static_cast<float>(at::Half(b)) : b);
    }
  }
}

// Without eviction a cache reserves little more than it stores (partly filled last blocks);
// the exact numbers for a small case, and the ratio at 4096 tokens.
TEST(CacheMemory, ReservedAgainstResident) {
  TorchCache small(make_config(1, 2, 2, 8, "fp16", "full"));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  small.append(0, testing::randn({1, 2, 70, 8}, gen), testing::randn({1, 2, 70, 8}, gen), positions_range(0, 70));
  // 70 tokens × (K + V) × 2 heads × 16 B; blocks of 64 tokens × 16 B: two per stream and head.
  EXPECT_EQ(small.stats().bytes_resident, 70 * 2 * 2 * 16);
  EXPECT_EQ(small.stats().bytes_reserved, 2 * 2 * 2 * 64 * 16);
  for (const std::string quant : {"fp32", "fp16", "int8", "int4", "int2", "kivi:k2:v2:g32:r128"}) {
    TorchCache m(make_config(2, 14, 2, 64, quant, "full"));
    for (int64_t l = 0; l < 2; ++l) {
      m.append(l, testing::randn({1, 2, 4096, 64}, gen), testing::randn({1, 2, 4096, 64}, gen),
               positions_range(0, 4096));
    }
    m.end_step(StepKind::kPrefillEnd);
    m.check_invariants();
    const auto s = m.stats();
    EXPECT_LE(static_cast<double>(s.bytes_reserved), 1.05 * static_cast<double>(s.bytes_resident)) << quant;
    EXPECT_EQ(s.bytes_reserved_peak, s.bytes_reserved) << quant;
  }
}

// A decode eviction from the middle touches O(1) blocks: the other blocks keep their memory
// (same block ids) and nothing is moved but inside the touched block's merge.
TEST(CacheMemory, ScatteredEvictionTouchesOnlyItsBlock) {
  auto c = make_config(1, 2, 1, 8, "int8", "random:seed4@200");
  TorchCache m(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  m.append(0, testing::randn({1, 1, 200, 8}, gen), testing::randn({1, 1, 200, 8}, gen), positions_range(0, 200));
  m.end_step(StepKind::kPrefillEnd);
  const auto before = cache::CacheManagerAccess::stream(m.core(), 0, false);
  m.append(0, testing::randn({1, 1, 1, 8}, gen), testing::randn({1, 1, 1, 8}, gen), positions_range(200, 1));
  m.end_step(StepKind::kDecode);
  m.check_invariants();
  const auto after = cache::CacheManagerAccess::stream(m.core(), 0, false);
  EXPECT_EQ(testing::physical_length(m, 0), 200);
  EXPECT_EQ(after.dead_slots[0], 1);  // one hole, in one block
  EXPECT_EQ(after.blocks[0], before.blocks[0]);  // 201 tokens still need 4 blocks of 64
}

}  // namespace
}  // namespace kvcache
