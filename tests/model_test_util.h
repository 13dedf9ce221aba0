// SPDX-License-Identifier: Apache-2.0
#pragma once
/// Shared helpers of the model tests: paths to ../shared data, and the Python tools of
/// tools/ run with the torch-enabled interpreter KVCACHE_PYTHON.
///
/// ctest runs every test in its own process, so tool outputs (exports, converted and random
/// checkpoints) are cached in <tmp>/kvcache-test-artifacts under a key that hashes the tool
/// sources, the inputs and the arguments; they are written under a temporary name and renamed
/// into place, so parallel test processes never see a partial file.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace kvcache::testing {

namespace fs = std::filesystem;

inline std::string source_dir() { return KVCACHE_SOURCE_DIR; }
inline std::string shared_data() { return source_dir() + "/../shared/data"; }
inline bool have_shared_data() { return fs::is_directory(shared_data() + "/models"); }
inline std::string tool_path(const std::string& tool) { return source_dir() + "/tools/" + tool; }
inline bool have_tool(const std::string& tool) { return fs::is_regular_file(tool_path(tool)); }

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline nlohmann::json read_json(const std::string& path) {
  return nlohmann::json::parse(read_file(path));
}

/// A fresh temp dir for one test, removed with its contents.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("kvcache-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

inline std::string quote(const std::string& s) { return "'" + s + "'"; }

inline fs::path artifact_root() {
  const fs::path p =
      fs::temp_directory_path() / ("kvcache-test-artifacts-" + std::to_string(::getuid()));
  fs::create_directories(p);
  return p;
}

/// Runs `cmd` (a shell command line) with output to `log`; "" on success, else the command
/// and its output.
inline std::string run_logged(const std::string& cmd, const std::string& log) {
  if (std::system((cmd + " > " + quote(log) + " 2>&1").c_str()) == 0) {
    std::error_code ec;
    fs::remove(log, ec);
    return "";
  }
  return "command failed: " + cmd + "\n" + read_file(log);
}

/// The artifact `name` for `key`: if it is not cached yet, `produce(tmp_path)` must create
/// it at tmp_path (a file or a directory) and return "" or an error message.
/// @return the artifact path; `*error` is set (and the path empty) if producing failed.
inline std::string cached_artifact(const std::string& name, const std::string& key,
                                   const std::function<std::string(const std::string&)>& produce,
                                   std::string* error) {
  std::ostringstream h;
  h << std::hex << std::hash<std::string>{}(key + KVCACHE_PYTHON);
  const fs::path final_path = artifact_root() / (h.str() + "-" + name);
  if (fs::exists(final_path)) return final_path.string();
  const fs::path tmp =
      artifact_root() / ("tmp-" + std::to_string(::getpid()) + "-" + h.str() + "-" + name);
  std::error_code ec;
  fs::remove_all(tmp, ec);
  *error = produce(tmp.string());
  if (!error->empty()) {
    fs::remove_all(tmp, ec);
    return "";
  }
  fs::rename(tmp, final_path, ec);
  if (ec) fs::remove_all(tmp, ec);  // another process won the race: use its copy
  return final_path.string();
}

/// `tools/<tool> args` with the torch interpreter.
inline std::string run_tool(const std::string& tool, const std::string& args,
                            const std::string& log) {
  return run_logged(std::string(KVCACHE_PYTHON) + " " + quote(tool_path(tool)) + " " + args, log);
}

/// Key material for a tool run: the tool's source plus the arguments.
/// What a tool's cached output depends on: its own text, the shared Python package the tools
/// import (tools/kvcache_tools/*.py, e.g. the exported model's code), and its arguments.
inline std::string tool_key(const std::string& tool, const std::string& args) {
  std::vector<std::string> pkg;
  const fs::path dir = fs::path(source_dir()) / "tools" / "kvcache_tools";
  if (fs::is_directory(dir)) {
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().extension() == ".py") pkg.push_back(e.path().string());
    }
  }
  std::sort(pkg.begin(), pkg.end());
  std::string key = read_file(tool_path(tool));
  for (const std::string& f : pkg) key += "\n" + f.substr(f.rfind('/') + 1) + "\n" + read_file(f);
  return key + "\n" + args;
}

/// Runs a Python snippet with the torch interpreter; "" on success, else its output.
inline std::string run_python(const std::string& code, const std::string& script_path) {
  std::ofstream(script_path) << code;
  return run_logged(std::string(KVCACHE_PYTHON) + " " + quote(script_path), script_path + ".log");
}

/// tools/export_torchscript.py of a Hugging Face dir, cached. Returns the .pt path.
inline std::string export_hf(const std::string& hf_dir, const std::string& name, std::string* error,
                             const std::string& extra_args = "") {
  const std::string key = tool_key("export_torchscript.py", extra_args) + hf_dir +
                          read_file(hf_dir + "/config.json") +
                          std::to_string(fs::exists(hf_dir + "/model.safetensors")
                                             ? fs::file_size(hf_dir + "/model.safetensors")
                                             : 0);
  return cached_artifact(
      name, key,
      [&](const std::string& out) {
        return run_tool("export_torchscript.py",
                        quote(hf_dir) + " " + quote(out) + " " + extra_args, out + ".log");
      },
      error);
}

}  // namespace kvcache::testing
