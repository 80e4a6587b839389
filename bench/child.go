package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/kvactors/kvactors/internal/tailbuf"
)

// child is a running `kvactors serve`.
type child struct {
	cmd      *exec.Cmd
	natsURL  string
	httpAddr string
	stderr   *tailbuf.Buffer
	done     <-chan struct{} // closed once it has exited
}

var servingLine = regexp.MustCompile(`^kvactors serving: nats (\S+), prefix "[^"]*", admin http (\S+)`)

// startChild starts bin serve on free ports, with extra flags after the
// bench's own, and waits for its serving line.
func startChild(ctx context.Context, cfg Config, prefix string, extra ...string) (*child, error) {
	bin := cfg.ServeBinary
	if bin == "" {
		var err error
		if bin, err = os.Executable(); err != nil {
			return nil, fmt.Errorf("find the kvactors binary: %w", err)
		}
	}
	args := []string{"serve", "--nats-port", "-1", "--http", "127.0.0.1:0", "--prefix", prefix,
		"--pool-bytes", strconv.FormatInt(eventPoolBytes, 10), "--shm-dir", cfg.ShmDir,
		"--log-level", "error"}
	if cfg.ExternalProfile != nil || cfg.ExternalAllocs != nil || cfg.ExternalTrace != nil || cfg.ExternalLevelProfile != nil {
		args = append(args, "--pprof") // /debug/pprof is off by default
	}
	args = append(args, extra...)
	cmd := exec.Command(bin, args...)
	cmd.Env = childEnv(cfg.ExternalProcs)
	c := &child{cmd: cmd, stderr: &tailbuf.Buffer{Max: 4096}}
	cmd.Stderr = c.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	lines := make(chan string, 1)
	if c.done, err = StartTied(cmd, func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if m := servingLine.FindStringSubmatch(sc.Text()); m != nil {
				lines <- m[1] + " " + m[2]
			}
		}
	}); err != nil {
		return nil, fmt.Errorf("start %s serve: %w", bin, err)
	}
	select {
	case l := <-lines:
		c.natsURL, c.httpAddr, _ = strings.Cut(l, " ")
		return c, nil
	case <-c.done:
		return nil, fmt.Errorf("kvactors serve exited before serving: %s: %s", cmd.ProcessState, c.stderrTail())
	case <-ctx.Done():
		c.stop()
		return nil, ctx.Err()
	case <-time.After(60 * time.Second):
		c.stop()
		return nil, fmt.Errorf("kvactors serve did not start within 60s: %s", c.stderrTail())
	}
}

// StartTied starts cmd so that it dies with this process, however this
// ends (a forced exit, SIGKILL): a killed bench leaves no child behind,
// holding its ports, its pool and a core of the machine the next run
// measures on. The child is this process's to stop: it runs in a process
// group of its own (tieToParent). The kernel's parent-death signal follows
// the thread that started the child, not the process, so cmd starts on a
// goroutine that keeps its OS thread locked until cmd has exited: the
// runtime never ends that thread while cmd runs. during, if not nil, runs
// on that goroutine between the start and cmd.Wait (reading a pipe of
// cmd's, which Wait closes). StartTied returns once cmd has started or
// failed to; exited is closed after its Wait, with cmd.ProcessState set.
func StartTied(cmd *exec.Cmd, during func()) (exited <-chan struct{}, err error) {
	tieToParent(cmd)
	done, started := make(chan struct{}), make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		if during != nil {
			during()
		}
		_ = cmd.Wait()
		close(done)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return done, nil
}

// childEnv drops KVACTORS_* settings of the caller's environment, so the
// child runs with the flags above and the defaults only. GOGC, GOMEMLIMIT
// and GOMAXPROCS pass through: they are what a run may want to compare;
// procs, when positive, sets the child's GOMAXPROCS (Config.ExternalProcs).
func childEnv(procs int) []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "KVACTORS_") || (procs > 0 && strings.HasPrefix(kv, "GOMAXPROCS=")) {
			continue
		}
		env = append(env, kv)
	}
	if procs > 0 {
		env = append(env, "GOMAXPROCS="+strconv.Itoa(procs))
	}
	return env
}

// stop ends the child with SIGINT (it shuts down gracefully), SIGKILL
// after 30 s.
func (c *child) stop() {
	_ = c.cmd.Process.Signal(os.Interrupt)
	select {
	case <-c.done:
	case <-time.After(30 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// cpuSeconds is the child's user + system time: /proc/<pid>/stat fields
// 14 and 15, in clock ticks of 1/100 s (USER_HZ on Linux).
func (c *child) cpuSeconds() (float64, error) {
	return procCPUSeconds(c.cmd.Process.Pid)
}

func procCPUSeconds(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("child cpu: %w", err)
	}
	return parseStatCPU(b)
}

// parseStatCPU reads utime + stime from a /proc/<pid>/stat line. The
// command name (field 2) may hold spaces, so fields count from its ')'.
func parseStatCPU(stat []byte) (float64, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("child cpu: no ')' in stat %q", stat)
	}
	f := strings.Fields(string(stat[i+1:]))
	// f[0] is field 3 (state): utime is field 14, stime field 15.
	if len(f) < 13 {
		return 0, fmt.Errorf("child cpu: short stat %q", stat)
	}
	ut, err1 := strconv.ParseUint(f[11], 10, 64)
	st, err2 := strconv.ParseUint(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, fmt.Errorf("child cpu: %w", err)
	}
	const userHZ = 100
	return float64(ut+st) / userHZ, nil
}

// maxRSS is the child's VmHWM in bytes (0 when unreadable).
func (c *child) maxRSS() int64 { return c.memory().HWM }

// memStatus is a process's resident memory from /proc/<pid>/status, in
// bytes: HWM is the peak of RSS (anon + mapped files + the shared memory it
// touched: the pool, the engines' segments it copied from); Anon is what it
// allocated itself (heap, stacks).
type memStatus struct {
	HWM, Anon int64
}

// memory reads the child's memStatus (zeros when unreadable).
// stderrTail is the end of the child's stderr, for an error message.
func (c *child) stderrTail() string { return strings.TrimSpace(c.stderr.String()) }

func (c *child) memory() memStatus {
	var m memStatus
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", c.cmd.Process.Pid))
	if err != nil {
		return m
	}
	if kb, err := procValues(b, "VmHWM", "RssAnon"); err == nil {
		m.HWM, m.Anon = kb[0]<<10, kb[1]<<10
	}
	return m
}

// await polls done every 2 ms (leaving the cores to the child it measures)
// until it holds, the child exits, ctx ends or timeout passes.
func (c *child) await(ctx context.Context, what string, timeout time.Duration, done func() bool) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for !done() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-c.done:
			return fmt.Errorf("kvactors serve exited waiting for %s: %s: %s", what, c.cmd.ProcessState, c.stderrTail())
		case <-deadline.C:
			return fmt.Errorf("timed out after %v waiting for %s (child: %s)", timeout, what, c.stderrTail())
		case <-tick.C:
		}
	}
	return nil
}
