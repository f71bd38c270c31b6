// The host driver's fork() handlers (Note [Host memory across fork] in host_driver.cpp). They must be
// installed before the background workers' (state/background.cpp), so that their prepare handler runs after
// the workers' has paused every worker: pthread_atfork runs prepare handlers in the reverse order of
// installation. Installing twice is harmless.
#pragma once

namespace fragless {

void install_host_fork_handlers();
// The handlers themselves, for a fork that began before they were installed (Note [Handlers installed during a
// fork], state/background.cpp).
void host_before_fork();
void host_after_fork_parent();
void host_after_fork_child();
// Whether host_before_fork has taken the host drivers' locks in the fork under way on this thread; where it has
// and the workers' handler has not run, the load handler lets them go, takes the device locks, and takes them
// again: a device lock is never waited for while a host driver's lock is held (the same Note).
bool host_fork_locks_held();
void host_let_go_in_fork();
void host_take_again_in_fork();

}  // namespace fragless
