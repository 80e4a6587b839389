package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// The bench tests below interrupt their runs: --duration is long so that a
// run cannot end first, and costs them no time.

// bench follows serve's and demo's rule: a second SIGINT while the first's
// stop is held up (its child serve, stopped by SIGSTOP, answers nothing and
// cannot stop: the bench would wait 30 s for it) exits at once with 130,
// saying so, and the serve dies with it.
func TestBenchSecondSignalForcesExit(t *testing.T) {
	cmd := exec.Command(binary, "bench", "--external", "--duration", "60s", "--engines", "1", "--shm-dir", t.TempDir())
	p := startProc(t, cmd)
	serve := runningChild(t, cmd.Process.Pid, "serve")
	stopProc(t, serve)
	p.firstSignalHeldUp(t, os.Interrupt, "kvactors bench: stopping its phase and node")
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	code, took := p.waitExit(t, time.Now(), 10*time.Second)
	t.Logf("exited %v after the second SIGINT", took)
	out := drain(p.lines)
	require.Equal(t, 130, code, out)
	require.Contains(t, out, "kvactors bench: second SIGINT: exiting now")
	awaitGone(t, serve)
}

// bench-compare: a second SIGTERM while the first's stop is held up (its
// bench waits on a stopped serve) exits at once with 143, and neither the
// bench nor its serve is left.
func TestBenchCompareSecondSignalForcesExit(t *testing.T) {
	cmd := exec.Command(binary, "bench-compare", "--a", binary, "--b", binary, "--pairs", "1",
		"--duration", "60s", "--engines", "1", "--shm-dir", t.TempDir())
	p := startProc(t, cmd)
	bench := runningChild(t, cmd.Process.Pid, "bench")
	serve := runningChild(t, bench, "serve")
	stopProc(t, serve)
	p.firstSignalHeldUp(t, syscall.SIGTERM, "kvactors bench-compare: stopping the running bench")
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	// Not p.waitExit: a bench left behind would hold the output pipe open.
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		if s := procState(cmd.Process.Pid); s != "" && s != "Z" {
			return fmt.Errorf("bench-compare still runs (state %s)", s)
		}
		return nil
	})
	awaitGone(t, bench, serve)
	code, _ := p.waitExit(t, time.Now(), 10*time.Second)
	out := drain(p.lines)
	require.Equal(t, 128+int(syscall.SIGTERM), code, out)
	require.Contains(t, out, "kvactors bench-compare: second SIGTERM: exiting now")
}

// A Ctrl-C at a terminal reaches its foreground process group: bench-compare
// alone, which stops its bench, which stops its serve, each with one signal
// (in groups of their own, the bench and the serve would otherwise take
// bench-compare's as their second and exit at once). bench-compare exits
// 130 and leaves nothing running.
func TestBenchCompareCtrlCStopsItsBench(t *testing.T) {
	cmd := exec.Command(binary, "bench-compare", "--a", binary, "--b", binary, "--pairs", "1",
		"--duration", "60s", "--engines", "1", "--shm-dir", t.TempDir())
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // a terminal's job
	p := startProc(t, cmd)
	bench := runningChild(t, cmd.Process.Pid, "bench")
	serve := runningChild(t, bench, "serve")
	require.NoError(t, syscall.Kill(-cmd.Process.Pid, syscall.SIGINT))
	var out []string
	timeout := time.After(30 * time.Second)
	for open := true; open; {
		select {
		case l, ok := <-p.lines:
			out, open = append(out, l), ok
		case <-timeout:
			t.Fatalf("bench-compare did not stop after Ctrl-C:\n%s", strings.Join(out, "\n"))
		}
	}
	code, _ := p.waitExit(t, time.Now(), 10*time.Second)
	all := strings.Join(out, "\n")
	require.Equal(t, exitInterrupted, code, all)
	require.Contains(t, all, "kvactors bench-compare: interrupted after 0 of 2 runs")
	require.Contains(t, all, "kvactors bench: interrupted", "the bench stopped gracefully")
	require.NotContains(t, all, ": second SIG", "no process took a second signal")
	awaitGone(t, bench, serve)
}

// stopProc stops pid (SIGSTOP) and waits until it is stopped: kill returns
// once the signal is queued, and one sent meanwhile is taken first if its
// number is lower. A bench's SIGINT to a serve just started, not yet
// handling signals, would then end the serve, and the bench's stop would
// not be held up by it.
func stopProc(t *testing.T, pid int) {
	t.Helper()
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if s := procState(pid); s != "T" {
			return fmt.Errorf("pid %d is not stopped yet (state %q)", pid, s)
		}
		return nil
	})
}

// runningChild waits for a child of pid running `kvactors cmd`, past its
// exec (its parent-death signal set), and returns its pid; the test's end
// kills it should the test fail.
func runningChild(t *testing.T, pid int, cmd string) int {
	t.Helper()
	var c int
	testkit.Eventually(t, 30*time.Second, 10*time.Millisecond, func() error {
		if c = childRunning(pid, cmd); c == 0 {
			return fmt.Errorf("pid %d has started no %s yet", pid, cmd)
		}
		return nil
	})
	t.Cleanup(func() { killIfOurs(c) })
	return c
}

// killIfOurs kills pid should it still run the binary under test, and not
// a process that took its number since.
func killIfOurs(pid int) {
	if args := procArgs(pid); len(args) > 0 && args[0] == binary {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// drain is what is left of an exited command's output.
func drain(lines <-chan string) string {
	var out []string
	for l := range lines {
		out = append(out, l)
	}
	return strings.Join(out, "\n")
}

// awaitGone waits until every pid has exited (a zombie counts: dead, not
// yet reaped by whoever inherited it).
func awaitGone(t *testing.T, pids ...int) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		for _, pid := range pids {
			if s := procState(pid); s != "" && s != "Z" {
				return fmt.Errorf("pid %d (%s) still runs (state %s)", pid, procArgs(pid), s)
			}
		}
		return nil
	})
}

// A first signal stops bench and bench-compare at once while a wait on NATS
// is under way, here their first engine's register request (nats.go's own
// timeout: 10 s). Its node is a stand-in serve that prints the serving line
// of a NATS server whose only register subscriber never answers, and stops
// at once when signalled.
func TestBenchFirstSignalEndsARegisterWait(t *testing.T) {
	for _, c := range []struct {
		name string
		args func(serve string) []string
		sig  os.Signal
		said string
	}{
		{"bench", func(serve string) []string { return []string{"bench", "--external", "--serve-binary", serve} },
			os.Interrupt, "kvactors bench: interrupted"},
		{"bench-compare", func(serve string) []string {
			return []string{"bench-compare", "--a", serve, "--b", serve, "--pairs", "1"}
		}, syscall.SIGTERM, "kvactors bench-compare: interrupted after 0 of 2 runs"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := testkit.NATSServer(t)
			registers := testkit.Subscribe(t, testkit.Connect(t, s), "*.*.register")
			args := append(c.args(standInServe(t, s.ClientURL())), "--duration", "60s", "--engines", "1", "--shm-dir", t.TempDir())
			p := startProc(t, exec.Command(binary, args...))
			select {
			case <-registers:
			case <-time.After(30 * time.Second):
				t.Fatal("no register request came")
			}
			require.NoError(t, p.cmd.Process.Signal(c.sig))
			code, took := p.waitExit(t, time.Now(), 20*time.Second)
			t.Logf("exited %v after the signal", took)
			out := drain(p.lines)
			require.Less(t, took, 5*time.Second, "the register's 10 s wait ran on:\n%s", out)
			require.Equal(t, exitInterrupted, code, out)
			require.Contains(t, out, c.said)
		})
	}
}

// standInServe writes a stand-in for kvactors serve: it prints serve's
// serving line, naming natsURL, and waits; the bench's SIGINT ends it (the
// default action of sleep, which it becomes).
func standInServe(t *testing.T, natsURL string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "serve")
	script := fmt.Sprintf("#!/bin/sh\necho 'kvactors serving: nats %s, prefix \"stand-in\", admin http 127.0.0.1:1'\nexec sleep 600\n", natsURL)
	require.NoError(t, os.WriteFile(path, []byte(script), 0o755))
	return path
}
