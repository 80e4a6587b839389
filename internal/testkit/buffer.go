package testkit

import (
	"bytes"
	"fmt"
	"sync"
)

// SyncBuffer is a bytes.Buffer that many goroutines may write (a child
// process's output, a node's logs) while a test reads it.
type SyncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *SyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String is what was written so far.
func (b *SyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TailBuffer keeps the last Max bytes written (at least; it trims in
// chunks), for a log a test prints only if it fails: a long test that logs
// a lot cannot grow it without bound.
type TailBuffer struct {
	Max int

	mu      sync.Mutex
	buf     []byte
	dropped int64
}

func (b *TailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - b.Max; over > b.Max { // trim at 2×Max, so a write costs O(1) amortized
		b.dropped += int64(over)
		b.buf = append(b.buf[:0], b.buf[over:]...)
	}
	return len(p), nil
}

// String is the tail kept, after a line saying how much was dropped before
// it, if any.
func (b *TailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dropped == 0 {
		return string(b.buf)
	}
	return fmt.Sprintf("[%d bytes dropped]\n%s", b.dropped, b.buf)
}
