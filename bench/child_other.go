//go:build !linux

package bench

import "os/exec"

// tieToParent: only Linux has a parent-death signal; elsewhere a killed
// bench leaves its children running, and a Ctrl-C reaches them too.
func tieToParent(*exec.Cmd) {}
