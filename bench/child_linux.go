//go:build linux

package bench

import (
	"os/exec"
	"syscall"
)

// dieWithParent has the kernel kill the child when the thread that started
// it goes, which StartTied keeps until the child has exited.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
