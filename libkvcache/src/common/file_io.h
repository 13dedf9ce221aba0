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

/// The whole of `path`, which must be a regular file of at most `max_bytes` bytes. Checked
/// before anything is read (opened without blocking, so a FIFO is refused, not waited on): a
/// directory, a device, a FIFO or a socket would be read without end or not at all.
/// @throws InvalidArgument "cannot read <what> '<path>': <why>", naming the kind of file, or
///         the size and the limit ("... is 2147483648 bytes, more than the 1073741824 bytes
///         (1 GiB) a <what> may have").
std::string read_regular_file(const std::string& path, const std::string& what, int64_t max_bytes);

/// Throws unless every line of `data` (split at '\n') has at most `max_line` bytes, naming
/// `what`, `path`, the first longer line's number (1-based), its length and the limit.
void check_line_lengths(const std::string& data, const std::string& what, const std::string& path,
                        int64_t max_line);

/// "1073741824 bytes (1 GiB)": a limit as the messages state it.
std::string bytes_text(int64_t n);

}  // namespace kvcache::io
