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
		v, err := procFields(b, ':', "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
		if err != nil {
			return c, fmt.Errorf("%s: %w", t, err)
		}
		c.Switches += v
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return c, fmt.Errorf("process %d io: %w", pid, err)
	}
	if c.Syscalls, err = procFields(b, ':', "syscr", "syscw"); err != nil {
		return c, fmt.Errorf("process %d io: %w", pid, err)
	}
	return c, nil
}

// procFields sums the named "name<sep> value" lines of a /proc file; each
// must be present.
func procFields(b []byte, sep byte, names ...string) (int64, error) {
	var sum int64
	found := 0
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		name, val, ok := bytes.Cut(sc.Bytes(), []byte{sep})
		if !ok {
			continue
		}
		for _, n := range names {
			if string(name) == n {
				v, err := strconv.ParseInt(string(bytes.TrimSpace(val)), 10, 64)
				if err != nil {
					return 0, fmt.Errorf("%s: %w", n, err)
				}
				sum += v
				found++
			}
		}
	}
	if found != len(names) {
		return 0, errors.New("missing fields")
	}
	return sum, nil
}
