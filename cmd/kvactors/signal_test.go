package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// proc is a started command: its stdout and stderr line by line (a
// carriage return ends a line too: a progress bar redraws with one), and
// its end.
type proc struct {
	cmd    *exec.Cmd
	lines  chan string
	exited chan struct{} // closed once it exited; err is then its Wait's
	err    error
}

// startProc starts cmd, reading its output; the test's end kills it.
func startProc(t *testing.T, cmd *exec.Cmd) *proc {
	t.Helper()
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	p := &proc{cmd: cmd, lines: make(chan string, 1<<16), exited: make(chan struct{})}
	var reading sync.WaitGroup
	for _, r := range []io.Reader{stdout, stderr} {
		reading.Go(func() {
			sc := bufio.NewScanner(r)
			sc.Split(splitLines)
			for sc.Scan() {
				select {
				case p.lines <- sc.Text():
				default: // no one reads this far: drop, never block the command
				}
			}
		})
	}
	go func() {
		reading.Wait()
		p.err = cmd.Wait() // after the last read: Wait closes the pipes
		close(p.lines)
		close(p.exited)
	}()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-p.exited })
	return p
}

// splitLines is bufio.ScanLines ending a line at '\r' as well as '\n'.
func splitLines(data []byte, atEOF bool) (int, []byte, error) {
	if i := bytes.IndexAny(data, "\r\n"); i >= 0 {
		return i + 1, data[:i], nil
	}
	if atEOF && len(data) > 0 {
		return len(data), data, nil
	}
	return 0, nil, nil
}

// waitExit waits up to timeout for the command to exit and returns its
// exit status and how long after since it came.
func (p *proc) waitExit(t *testing.T, since time.Time, timeout time.Duration) (int, time.Duration) {
	t.Helper()
	select {
	case <-p.exited:
	case <-time.After(timeout):
		t.Fatalf("%s did not exit within %v", p.cmd.Args[1], timeout)
	}
	took := time.Since(since)
	if p.err == nil {
		return 0, took
	}
	exit, ok := p.err.(*exec.ExitError)
	require.True(t, ok, "%v", p.err)
	return exit.ExitCode(), took
}

// firstSignalHeldUp sends the process its first sig, waits for the line
// saying it stops (stopping), and fails the test if the stop was not held
// up: a second signal sent next must find it still stopping.
func (p *proc) firstSignalHeldUp(t *testing.T, sig os.Signal, stopping string) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(sig))
	waitLine(t, p.lines, stopping, 10*time.Second)
	select {
	case <-p.exited:
		t.Fatalf("the stop was not held up: exited (%v)", p.err)
	default:
	}
}

// waitLine reads lines until one contains want, returning what was read.
func waitLine(t *testing.T, lines <-chan string, want string, timeout time.Duration) string {
	t.Helper()
	var seen []string
	deadline := time.After(timeout)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("exited before a line with %q:\n%s", want, strings.Join(seen, "\n"))
			}
			seen = append(seen, l)
			if strings.Contains(l, want) {
				return strings.Join(seen, "\n")
			}
		case <-deadline:
			t.Fatalf("no line with %q after %v:\n%s", want, timeout, strings.Join(seen, "\n"))
		}
	}
}

// SIGTERM while the embedded NATS server starts stops serve at once: the
// wait for the server's listeners (up to 10 s) ends with the signal. A
// websocket port in use (--nats-config) keeps the server from ever being
// ready, so the signal lands inside that wait.
func TestServeStopsPromptlyDuringTheEmbeddedStart(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	conf := filepath.Join(t.TempDir(), "nats.conf")
	require.NoError(t, os.WriteFile(conf, []byte(fmt.Sprintf("websocket {\n  host: 127.0.0.1\n  port: %d\n  no_tls: true\n}\n",
		ln.Addr().(*net.TCPAddr).Port)), 0o600))
	cmd := exec.Command(binary, "serve", "--nats-config", conf, "--nats-port", "-1", "--http", "off",
		"--shm-dir", t.TempDir(), "--pool-bytes", "1M")
	p := startProc(t, cmd)
	waitLine(t, p.lines, "websocket", 20*time.Second) // the server started, and cannot become ready
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	code, took := p.waitExit(t, time.Now(), 30*time.Second)
	require.Less(t, took, 5*time.Second, "the start's 10 s wait ran on")
	require.Equal(t, 0, code)
}

// blackhole is a loopback TCP proxy to a NATS server that can go silent:
// once held it forwards nothing either way but keeps every connection
// open, so a client waiting on the server (a drain, a flush, a request)
// waits until its own timeout. testkit.Link's Cut closes the connections
// instead, which a client sees at once.
type blackhole struct {
	URL  string
	held atomic.Bool
}

func newBlackhole(t *testing.T, target string) *blackhole {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	b := &blackhole{URL: "nats://" + ln.Addr().String()}
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	pipe := func(dst, src net.Conn) {
		defer func() { _ = dst.Close(); _ = src.Close() }()
		buf := make([]byte, 64<<10)
		for {
			n, err := src.Read(buf)
			if err != nil {
				return
			}
			if b.held.Load() {
				continue // swallowed
			}
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, s)
			mu.Unlock()
			go pipe(c, s)
			go pipe(s, c)
		}
	}()
	return b
}

// A second SIGTERM while a graceful shutdown is held up (its NATS stopped
// answering, so the drain waits out --shutdown-timeout) exits at once with
// 143 (128+SIGTERM) and says so; the first alone keeps waiting.
func TestServeSecondSignalForcesExit(t *testing.T) {
	s := testkit.NATSServer(t)
	bh := newBlackhole(t, s.Addr().String())
	cmd := exec.Command(binary, "serve", "--nats", bh.URL, "--http", "off", "--shm-dir", t.TempDir(),
		"--pool-bytes", "1M", "--shutdown-timeout", "2m", "--log-level", "info")
	p := startProc(t, cmd)
	waitLine(t, p.lines, "kvactors ready", 20*time.Second)
	bh.held.Store(true)
	p.firstSignalHeldUp(t, syscall.SIGTERM, "shutting down")
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	code, took := p.waitExit(t, time.Now(), 20*time.Second) // the drain alone waits 30 s (2m/4) per subscription
	t.Logf("exited %v after the second SIGTERM", took)
	require.Equal(t, 128+int(syscall.SIGTERM), code)
	waitLine(t, p.lines, "second signal: exiting now", time.Second)
}

// demo: a second Ctrl-C while the first's stop is held up (the node's
// shutdown waits on a NATS that stopped answering) exits at once, 130,
// saying so.
func TestDemoSecondCtrlCForcesExit(t *testing.T) {
	s := testkit.NATSServer(t)
	bh := newBlackhole(t, s.Addr().String())
	cmd := exec.Command(binary, "demo", "--nats", bh.URL, "--requests", "400", "--spread", "60s",
		"--shm-dir", t.TempDir(), "--pool-bytes", "64MiB")
	p := startProc(t, cmd)
	waitLine(t, p.lines, "/400)", 20*time.Second) // the bar moved: engines run
	bh.held.Store(true)
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	// The summary comes before the node's shutdown, which NATS now holds up.
	waitLine(t, p.lines, "not checked: the run was interrupted", 30*time.Second)
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	code, took := p.waitExit(t, time.Now(), 20*time.Second)
	t.Logf("exited %v after the second Ctrl-C", took)
	require.Less(t, took, 5*time.Second, "the node's shutdown (up to 10 s) ran on")
	require.Equal(t, 130, code)
	waitLine(t, p.lines, "kvactors demo: second SIGINT: exiting now", time.Second)
}

// SIGTERM while a clustered serve opens its ownership bucket stops it at
// once (exit 0, as during the NATS wait), leaving nothing behind: the
// bucket's JetStream requests end with the signal rather than run out
// their 30 s. A subscriber that takes the JetStream API's requests and
// never answers (the server has no JetStream of its own) holds the start
// there, as a JetStream without a meta leader would.
func TestServeStopsPromptlyDuringTheClusteredStart(t *testing.T) {
	s := testkit.NATSServerWith(t, func(o *server.Options) { o.JetStream = false })
	nc := testkit.Connect(t, s)
	asked := make(chan string, 64)
	sub, err := nc.Subscribe("$JS.API.>", func(m *nats.Msg) {
		select {
		case asked <- m.Subject:
		default:
		}
	})
	require.NoError(t, err)
	defer func() { _ = sub.Unsubscribe() }()
	require.NoError(t, nc.Flush())
	shm := t.TempDir()
	cmd := exec.Command(binary, "serve", "--nats", s.ClientURL(), "--cluster", "--http", "off",
		"--shm-dir", shm, "--pool-bytes", "1M", "--skip-node-id-check", "--node-id", "sigterm-start")
	p := startProc(t, cmd)
	select {
	case subj := <-asked:
		t.Logf("held at %s", subj)
	case <-p.exited:
		t.Fatalf("exited before asking JetStream: %v", p.err)
	case <-time.After(20 * time.Second):
		t.Fatal("no JetStream request within 20s")
	}
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	code, took := p.waitExit(t, time.Now(), 40*time.Second)
	require.Less(t, took, 5*time.Second, "the bucket's 30 s wait ran on")
	require.Equal(t, 0, code)
	left, err := os.ReadDir(shm)
	require.NoError(t, err)
	require.Empty(t, left, "left in --shm-dir")
}
