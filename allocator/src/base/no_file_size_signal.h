// Writes past a file size limit without the signal that would end the process (Note [A file size limit]).
#pragma once
#include <pthread.h>
#include <signal.h>
#include <time.h>

namespace fragless {

// Note [A file size limit]
// A write past RLIMIT_FSIZE (which clusters set) fails with EFBIG and also sends the writing thread SIGXFSZ,
// whose default action ends the process with a core dump. Our writer threads block every signal (Note
// [Forking while a thread starts]'s quiet threads), so there the limit is a failed write like a full disk:
// counted and said. But the header is written on the thread that makes the allocator (inside a program's
// first allocation), and at exit every record on the exiting thread (Note [Tracing at exit]): a job that had
// done its work was killed there. So those writes block SIGXFSZ on the calling thread for their duration and,
// if the write raised it (it was not pending before), take it back with sigtimedwait before restoring the
// mask: the program's own signal disposition is untouched, and its own writes past the limit still get it.
class NoFileSizeSignal {
 public:
  NoFileSizeSignal() {
    sigemptyset(&xfsz_);
    sigaddset(&xfsz_, SIGXFSZ);
    pthread_sigmask(SIG_BLOCK, &xfsz_, &old_);
    sigset_t pending;
    pending_before_ = sigpending(&pending) == 0 && sigismember(&pending, SIGXFSZ) == 1;
  }
  ~NoFileSizeSignal() {
    sigset_t pending;
    if (!pending_before_ && sigpending(&pending) == 0 && sigismember(&pending, SIGXFSZ) == 1) {
      const timespec now{0, 0};
      (void)sigtimedwait(&xfsz_, nullptr, &now);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  NoFileSizeSignal(const NoFileSizeSignal&) = delete;
  NoFileSizeSignal& operator=(const NoFileSizeSignal&) = delete;

 private:
  sigset_t xfsz_{}, old_{};
  bool pending_before_ = false;
};

}  // namespace fragless
