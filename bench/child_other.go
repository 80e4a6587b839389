//go:build !linux

package bench

import "os/exec"

// dieWithParent: only Linux has a parent-death signal; elsewhere a killed
// bench leaves its children running.
func dieWithParent(*exec.Cmd) {}
