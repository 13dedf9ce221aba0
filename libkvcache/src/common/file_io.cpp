// SPDX-License-Identifier: Apache-2.0
#include "common/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "kvcache/error.h"

namespace kvcache::io {

void write_all(int fd, const std::string& data, const std::string& path) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0 && errno == EINTR) continue;
    KV_CHECK_ARG(n > 0, "cannot write '", path, "': ", std::strerror(n < 0 ? errno : EIO));
    off += static_cast<size_t>(n);
  }
}

void write_file_atomic(const std::string& path, const std::string& data) {
  KV_CHECK_ARG(!path.empty() && path.back() != '/', "cannot write '", path, "': not a file name");
  static std::atomic<uint64_t> counter{0};
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  const std::string tmp = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) + "." + name +
                          ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  KV_CHECK_ARG(fd >= 0, "cannot write '", path, "': cannot create a file in '", dir, "': ", std::strerror(errno));
  bool open = true;
  try {
    write_all(fd, data, path);
    KV_CHECK_ARG(::fsync(fd) == 0, "cannot write '", path, "': fsync failed: ", std::strerror(errno));
    open = false;
    KV_CHECK_ARG(::close(fd) == 0, "cannot write '", path, "': close failed: ", std::strerror(errno));
  } catch (...) {
    if (open) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw InvalidArgument(detail::str_cat("cannot write '", path, "': ", std::strerror(err)));
  }
  // Make the rename itself durable.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}

void check_readable_file(const std::string& path, const std::string& what) {
  struct stat st {};
  KV_CHECK_ARG(::stat(path.c_str(), &st) == 0, "cannot open ", what, " '", path, "': ", std::strerror(errno));
  KV_CHECK_ARG(!S_ISDIR(st.st_mode), "cannot open ", what, " '", path, "': it is a directory");
}

std::string bytes_text(int64_t n) {
  std::string unit;
  if (n >= (int64_t{1} << 30) && n % (int64_t{1} << 30) == 0) {
    unit = std::to_string(n >> 30) + " GiB";
  } else if (n >= (int64_t{1} << 20) && n % (int64_t{1} << 20) == 0) {
    unit = std::to_string(n >> 20) + " MiB";
  } else if (n >= 1024 && n % 1024 == 0) {
    unit = std::to_string(n >> 10) + " KiB";
  }
  return std::to_string(n) + " bytes" + (unit.empty() ? "" : " (" + unit + ")");
}

namespace {

const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "it is a directory";
  if (S_ISCHR(m)) return "it is a character device, not a regular file";
  if (S_ISBLK(m)) return "it is a block device, not a regular file";
  if (S_ISFIFO(m)) return "it is a FIFO (named pipe), not a regular file";
  if (S_ISSOCK(m)) return "it is a socket, not a regular file";
  return "it is not a regular file";
}

}  // namespace

std::string read_regular_file(const std::string& path, const std::string& what, int64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO without a writer returns at once (then refused below) instead
  // of waiting; it changes nothing for a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  KV_CHECK_ARG(fd >= 0, "cannot read ", what, " '", path, "': ", std::strerror(errno));
  std::string data;
  try {
    struct stat st {};
    KV_CHECK_ARG(::fstat(fd, &st) == 0, "cannot read ", what, " '", path, "': ", std::strerror(errno));
    KV_CHECK_ARG(S_ISREG(st.st_mode), "cannot read ", what, " '", path, "': ", file_kind(st.st_mode));
    KV_CHECK_ARG(st.st_size <= max_bytes, "cannot read ", what, " '", path, "': it is ", st.st_size,
                 " bytes, more than the ", bytes_text(max_bytes), " a ", what, " may have");
    data.reserve(static_cast<size_t>(st.st_size));
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      KV_CHECK_ARG(n >= 0, "cannot read ", what, " '", path, "': ", std::strerror(errno));
      if (n == 0) break;
      data.append(buf, static_cast<size_t>(n));
      // (the file grew while it was read)
      KV_CHECK_ARG(static_cast<int64_t>(data.size()) <= max_bytes, "cannot read ", what, " '", path,
                   "': it holds more than the ", bytes_text(max_bytes), " a ", what, " may have");
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return data;
}

void check_line_lengths(const std::string& data, const std::string& what, const std::string& path,
                        int64_t max_line) {
  size_t start = 0;
  for (int64_t line = 1; start < data.size(); ++line) {
    size_t nl = data.find('\n', start);
    if (nl == std::string::npos) nl = data.size();
    const auto len = static_cast<int64_t>(nl - start);
    KV_CHECK_ARG(len <= max_line, what, " '", path, "': line ", line, " is ", len, " bytes long, more than the ",
                 bytes_text(max_line), " a line may have");
    start = nl + 1;
  }
}

}  // namespace kvcache::io
