// SPDX-License-Identifier: Apache-2.0
// Whole-file writes (src/common/file_io.h): atomic replacement, nothing half-written, no
// temporary file left behind on any failure; the study's writers go through it.
#include "common/file_io.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kvcache/error.h"
#include "kvcache/study/report.h"
#include "kvcache/study/results.h"
#include "kvcache/study/task.h"

namespace kvcache {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "kvcache_file_io_XXXXXX").string();
    path = ::mkdtemp(t.data());
  }
  ~TempDir() { fs::remove_all(path); }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string message(const std::function<void()>& call) {
  try {
    call();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

TEST(FileIo, AtomicWriteCreatesAndReplaces) {
  TempDir d;
  const std::string f = (d.path / "a.txt").string();
  io::write_file_atomic(f, "first\n");
  EXPECT_EQ(slurp(f), "first\n");
  io::write_file_atomic(f, "second");
  EXPECT_EQ(slurp(f), "second");
  io::write_file_atomic(f, "");
  EXPECT_EQ(slurp(f), "");
  EXPECT_EQ(d.entries(), std::vector<std::string>{"a.txt"});  // no temporary left
}

// A path that is a directory, or in a directory that does not exist: an error naming the
// path, and nothing created or left behind.
TEST(FileIo, FailuresLeaveNothingBehind) {
  TempDir d;
  fs::create_directory(d.path / "summary.md");
  EXPECT_THAT(message([&] { io::write_file_atomic((d.path / "summary.md").string(), "x"); }),
              HasSubstr("cannot write '" + (d.path / "summary.md").string() + "': Is a directory"));
  EXPECT_EQ(d.entries(), std::vector<std::string>{"summary.md"});
  EXPECT_TRUE(fs::is_directory(d.path / "summary.md"));
  EXPECT_THAT(message([&] { io::write_file_atomic((d.path / "no" / "x.txt").string(), "x"); }),
              HasSubstr("cannot write '" + (d.path / "no" / "x.txt").string() + "': cannot create a file in '" +
                        (d.path / "no").string() + "': No such file or directory"));
  EXPECT_EQ(d.entries(), std::vector<std::string>{"summary.md"});
  EXPECT_EQ(message([&] { io::write_file_atomic(d.path.string() + "/", "x"); }),
            "cannot write '" + d.path.string() + "/': not a file name");
}

// A write that fails halfway (the file-size limit stands in for a full disk): the old file is
// untouched and the temporary is removed.
TEST(FileIo, AFailedWriteKeepsTheOldFile) {
  TempDir d;
  const std::string f = (d.path / "results.jsonl").string();
  io::write_file_atomic(f, "old\n");
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto* previous = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 16;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string m = message([&] { io::write_file_atomic(f, std::string(100, 'x')); });
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  EXPECT_THAT(m, HasSubstr("cannot write '" + f + "': File too large"));
  EXPECT_EQ(slurp(f), "old\n");
  EXPECT_EQ(d.entries(), std::vector<std::string>{"results.jsonl"});
}

// The study's writers use it: merge into a directory path, summaries over a directory, tasks
// into a missing directory; none leaves a temporary file.
TEST(FileIo, StudyWritersAreAtomic) {
  TempDir d;
  study::ResultRow r;
  r.kind = "task";
  r.arm = "fp32+full";
  r.task = "t0";
  r.model = "m";
  fs::create_directory(d.path / "out.jsonl");
  EXPECT_THAT(message([&] { study::write_results((d.path / "out.jsonl").string(), {r}); }), HasSubstr("Is a directory"));
  study::write_results((d.path / "rows.jsonl").string(), {r});
  EXPECT_EQ(study::read_results((d.path / "rows.jsonl").string()).size(), 1u);
  EXPECT_THAT(message([&] { (void)study::read_results((d.path / "out.jsonl").string()); }),
              HasSubstr("cannot open results file '" + (d.path / "out.jsonl").string() + "': it is a directory"));
  fs::create_directory(d.path / "summary.md");
  const auto s = study::summarize({r}, "m", "fp32+full");
  EXPECT_THAT(message([&] { study::write_summary_files(s, d.path.string()); }), HasSubstr("Is a directory"));
  EXPECT_THAT(message([&] { study::write_tasks_jsonl((d.path / "no" / "t.jsonl").string(), {}); }),
              HasSubstr("No such file or directory"));
  EXPECT_THAT(message([&] { (void)study::read_tasks_jsonl(d.path.string()); }),
              HasSubstr("cannot open task file '" + d.path.string() + "': it is a directory"));
  EXPECT_EQ(d.entries(), (std::vector<std::string>{"out.jsonl", "rows.jsonl", "summary.md"}));
}

}  // namespace
}  // namespace kvcache
