// SPDX-License-Identifier: Apache-2.0
#pragma once
// File writes of the library: every whole-file write goes through write_file_atomic, so that a
// crash, a full disk or a bad path never leaves a half-written file or a temporary behind.
#include <string>

namespace kvcache::io {

/// write(2)s all of `data` to `fd`, retrying short writes and EINTR.
/// @throws InvalidArgument naming `path` and the OS error.
void write_all(int fd, const std::string& data, const std::string& path);

/// Replaces `path` with `data` atomically: writes a temporary file in the same directory
/// (`.<name>.tmp-<pid>-<n>`, created exclusively), fsyncs it, renames it over `path` and
/// fsyncs the directory. Readers see the old file or the new one, never a part. On any
/// failure the temporary file is removed and `path` is left as it was.
/// @throws InvalidArgument naming the path and the OS error (e.g. the directory does not
///         exist, `path` is a directory, the disk is full).
void write_file_atomic(const std::string& path, const std::string& data);

/// Checks that `path` exists and is not a directory (an std::ifstream opens a directory
/// without an error and then reads nothing; pipes and devices are fine).
/// @throws InvalidArgument "cannot open <what> '<path>': ...".
void check_readable_file(const std::string& path, const std::string& what);

}  // namespace kvcache::io
