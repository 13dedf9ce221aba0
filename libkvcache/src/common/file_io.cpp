// SPDX-License-Identifier: Apache-2.0
#include "common/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

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

}  // namespace kvcache::io
