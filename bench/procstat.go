package bench

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// procCounters are a process's wake-ups and I/O system calls so far: the
// per-message costs that do not batch at low rates (each context switch is
// a goroutine's thread parking or waking; each read or write syscall one
// trip through the kernel for a NATS connection).
type procCounters struct {
	Switches int64 // voluntary + involuntary context switches, all threads
	Syscalls int64 // read + write system calls (/proc/<pid>/io syscr + syscw)
}

func (a procCounters) minus(b procCounters) procCounters {
	return procCounters{Switches: a.Switches - b.Switches, Syscalls: a.Syscalls - b.Syscalls}
}

// readProcCounters sums the counters of pid's threads. Threads that exited
// take their switches with them, so a delta can undercount; Go keeps its
// threads, so over a run it does not.
func readProcCounters(pid int) (procCounters, error) {
	var c procCounters
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	if err != nil || len(tasks) == 0 {
		return c, fmt.Errorf("process %d: no tasks (%v)", pid, err)
	}
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue // the thread exited meanwhile
		}
		v, err := procValues(b, "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
		if err != nil {
			return c, fmt.Errorf("%s: %w", t, err)
		}
		c.Switches += v[0] + v[1]
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return c, fmt.Errorf("process %d io: %w", pid, err)
	}
	v, err := procValues(b, "syscr", "syscw")
	if err != nil {
		return c, fmt.Errorf("process %d io: %w", pid, err)
	}
	c.Syscalls = v[0] + v[1]
	return c, nil
}

// procValues reads the named "name: value" lines of a /proc file
// (/proc/<pid>/status, io), in names' order, a value's " kB" unit dropped;
// each must be present.
func procValues(b []byte, names ...string) ([]int64, error) {
	vals := make([]int64, len(names))
	found := 0
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		name, val, ok := bytes.Cut(sc.Bytes(), []byte{':'})
		if !ok {
			continue
		}
		for i, n := range names {
			if string(name) == n {
				v, err := strconv.ParseInt(string(bytes.TrimSuffix(bytes.TrimSpace(val), []byte(" kB"))), 10, 64)
				if err != nil {
					return nil, fmt.Errorf("%s: %w", n, err)
				}
				vals[i] = v
				found++
			}
		}
	}
	if found != len(names) {
		return nil, errors.New("missing fields")
	}
	return vals, nil
}
