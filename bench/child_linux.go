//go:build linux

package bench

import (
	"os/exec"
	"syscall"
)

// tieToParent has the kernel kill the child when the thread that started
// it goes, which StartTied keeps until the child has exited, and puts the
// child in a process group of its own: a terminal's Ctrl-C, sent to its
// foreground group, reaches the parent alone, which stops the child with a
// signal of its own. Reaching both, it would be the child's second signal,
// forcing its exit (cmd/kvactors signalContext).
func tieToParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
}
