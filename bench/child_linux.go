//go:build linux

package bench

import (
	"os/exec"
	"syscall"
)

// dieWithParent has the kernel kill the child serve when the thread that
// started it goes, which startChild keeps until the child has exited: a
// bench killed (SIGKILL, a forced exit) leaves no node behind, holding its
// ports, its pool and a core of the machine the next run measures on.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
