package tailbuf

import (
	"fmt"
	"sync"
)

// Buffer keeps the last Max bytes written (at least: it trims in chunks),
// safe for concurrent writers and readers. The zero value keeps nothing
// past each trim; set Max.
type Buffer struct {
	Max int

	mu      sync.Mutex
	buf     []byte
	dropped int64
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - b.Max; over > b.Max { // trimmed at 2×Max, so a write costs O(1) amortized
		b.dropped += int64(over)
		b.buf = append(b.buf[:0], b.buf[over:]...)
	}
	return len(p), nil
}

// String is the tail kept, after a line saying how much was dropped before
// it, if any.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dropped == 0 {
		return string(b.buf)
	}
	return fmt.Sprintf("[%d bytes dropped]\n%s", b.dropped, b.buf)
}
