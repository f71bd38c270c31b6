// One message over a Unix socket with file descriptors riding along (SCM_RIGHTS): the legacy IPC listener
// (preload_ipc.cpp) and the two-process tests send shares this way.
#pragma once
#include <sys/socket.h>

#include <cstddef>
#include <cstring>
#include <vector>

namespace fragless_fd {

constexpr std::size_t kMaxFds = 250;  // SCM_RIGHTS carries at most 253 descriptors a message (SCM_MAX_FD)

// Sends n bytes (a zero byte when n is 0: a message carries at least one) and nfds descriptors. The bytes
// sent, or -1.
inline ssize_t send_message(int sock, const void* data, std::size_t n, const int* fds, std::size_t nfds) {
  char zero = 0;
  iovec iov{n ? const_cast<void*>(data) : &zero, n ? n : 1};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * (nfds ? nfds : 1)));
  if (nfds) {
    m.msg_control = control.data();
    m.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  return sendmsg(sock, &m, MSG_NOSIGNAL);
}

// Receives one message of at most `cap` bytes and up to `max_fds` descriptors, appended to *fds (received
// close-on-exec). Its length; -1 on failure, or when the bytes or the descriptors did not fit (those that
// came are appended all the same, for the caller to close).
inline ssize_t recv_message(int sock, void* data, std::size_t cap, std::vector<int>* fds, std::size_t max_fds = kMaxFds) {
  iovec iov{data, cap};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * max_fds));
  m.msg_control = control.data();
  m.msg_controllen = control.size();
  const ssize_t n = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
  for (cmsghdr* c = n >= 0 ? CMSG_FIRSTHDR(&m) : nullptr; c; c = CMSG_NXTHDR(&m, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      const std::size_t at = fds->size();
      fds->resize(at + k);
      std::memcpy(fds->data() + at, CMSG_DATA(c), k * sizeof(int));
    }
  return n >= 0 && (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ? -1 : n;
}

}  // namespace fragless_fd
