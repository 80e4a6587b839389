package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// A bench killed outright (SIGKILL: no handler of its runs) leaves no
// kvactors serve behind: its --external child dies with it
// (bench.StartTied). An orphaned node would hold its ports, its pool
// and a core of the machine the next run measures on.
func TestAKilledBenchLeavesNoServeBehind(t *testing.T) {
	cmd := exec.Command(binary, "bench", "--external", "--duration", "60s", "--shm-dir", t.TempDir())
	p := startProc(t, cmd)
	var child int
	testkit.Eventually(t, 30*time.Second, 10*time.Millisecond, func() error {
		if child = childOf(cmd.Process.Pid); child == 0 {
			return errors.New("the bench has started no child yet")
		}
		return nil
	})
	t.Cleanup(func() { _ = syscall.Kill(child, syscall.SIGKILL) }) // should the test fail
	// Killed before it has served, the child would die of its first write
	// to the gone bench's pipe: wait until the run is under way (the child
	// has spent 0.3 s of CPU on it).
	testkit.Eventually(t, 60*time.Second, 10*time.Millisecond, func() error {
		if ticks := cpuTicks(child); ticks < 30 {
			return fmt.Errorf("the child serve has run %d ticks of CPU, want 30", ticks)
		}
		return nil
	})
	require.NoError(t, cmd.Process.Kill())
	p.waitExit(t, time.Now(), 10*time.Second)
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		if state := procState(child); state != "" && state != "Z" {
			return fmt.Errorf("the bench's child serve (pid %d) still runs (state %s)", child, state)
		}
		return nil
	})
}

// A bench-compare killed outright leaves neither its bench nor that bench's
// serve behind: both die with their parent (bench.StartTied). The serve is
// stopped (SIGSTOP) first, so that the bench, waiting on it, cannot end on
// its own before the kill, however short its --duration.
func TestAKilledBenchCompareLeavesNoBenchBehind(t *testing.T) {
	cmd := exec.Command(binary, "bench-compare", "--a", binary, "--b", binary, "--pairs", "1",
		"--duration", "50ms", "--engines", "1", "--shm-dir", t.TempDir())
	startProc(t, cmd)
	var bench, serve int
	testkit.Eventually(t, 30*time.Second, 10*time.Millisecond, func() error {
		// After its exec: the parent-death signal is set by then.
		if bench = childRunning(cmd.Process.Pid, "bench"); bench == 0 {
			return errors.New("bench-compare has started no bench yet")
		}
		if serve = childRunning(bench, "serve"); serve == 0 {
			return fmt.Errorf("the bench (pid %d) has started no serve yet", bench)
		}
		return nil
	})
	t.Cleanup(func() { killIfOurs(bench); killIfOurs(serve) }) // should the test fail
	require.NoError(t, syscall.Kill(serve, syscall.SIGSTOP))
	require.NoError(t, cmd.Process.Kill())
	// Not p.waitExit: a bench left behind would hold its output pipes open.
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		for _, pid := range []int{cmd.Process.Pid, bench, serve} {
			if state := procState(pid); state != "" && state != "Z" {
				return fmt.Errorf("pid %d (%s) still runs (state %s)", pid, procArgs(pid), state)
			}
		}
		return nil
	})
}

// childRunning is a child of pid running `kvactors cmd` (past its exec),
// 0 if none.
func childRunning(pid int, cmd string) int {
	c := childOf(pid)
	if args := procArgs(c); c == 0 || len(args) < 2 || args[1] != cmd {
		return 0
	}
	return c
}

// procArgs is pid's command line.
func procArgs(pid int) []string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
}

// cpuTicks is the user and system CPU pid has spent, in clock ticks.
func cpuTicks(pid int) int {
	path := fmt.Sprintf("/proc/%d/stat", pid)
	utime, _ := statField(path, 11)
	stime, _ := statField(path, 12)
	u, _ := strconv.Atoi(utime)
	st, _ := strconv.Atoi(stime)
	return u + st
}

// childOf is a child process of pid, 0 if none.
func childOf(pid int) int {
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, f := range stats {
		if ppid, ok := statField(f, 1); ok && ppid == strconv.Itoa(pid) {
			n, _ := strconv.Atoi(filepath.Base(filepath.Dir(f)))
			return n
		}
	}
	return 0
}

// procState is pid's state letter ("Z": a zombie, dead but not reaped),
// "" once it is gone.
func procState(pid int) string {
	s, _ := statField(fmt.Sprintf("/proc/%d/stat", pid), 0)
	return s
}

// statField is field i after the command name of a /proc/PID/stat file
// (0: the state, 1: the parent's pid); the name is in parentheses and
// may hold spaces, so fields are counted from its closing one.
func statField(path string, i int) (string, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", false
	}
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if i >= len(fields) {
		return "", false
	}
	return fields[i], true
}
