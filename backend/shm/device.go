package shm

import (
	"errors"
	"fmt"
	"runtime/debug"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvactors/kvactors/backend"
)

// ErrFault is returned by Copy when touching a segment faulted, which for a
// mapped file means the engine truncated its object while attached.
var ErrFault = errors.New("memory fault during copy")

// device is one engine's mapped segments. Copies hold mu for reading and
// Close holds it for writing, so Close waits for in-flight copies and no copy
// can touch an unmapped segment; concurrent copies share nothing else.
type device struct {
	engine string
	dir    string // the shm directory the segments were opened in (Recheck)

	mu     sync.RWMutex
	closed bool
	segs   []mapping // guarded by mu; nil after Close
}

// mapping is the mapped part of one segment: mem holds the segment's bytes
// [base, base+len(mem)), of which a copy may touch [lo, base+len(mem)) (lo
// rounded down to its page is base). Every index into mem goes through
// slice, after check.
type mapping struct {
	mem  []byte
	base int64 // segment offset of mem[0], a multiple of the page size
	lo   int64 // first segment byte a copy may touch (>= base)
	size int64 // the whole segment's size, as the object had at attach
	// name is the segment's shm name and dev, ino the object it named at
	// attach (Recheck).
	name     string
	dev, ino uint64
}

// end is the segment offset just past the mapped bytes.
func (m *mapping) end() int64 { return m.base + int64(len(m.mem)) }

// slice is segment bytes [off, off+n), which check has placed in [lo, end).
func (m *mapping) slice(off, n int64) []byte {
	return m.mem[off-m.base : off-m.base+n]
}

var _ backend.Attachment = (*device)(nil)

// SegmentSize returns the size of segment i's object at attach (the whole
// segment, of which only a span may be mapped), or 0 for an index out of
// range or after Close.
func (d *device) SegmentSize(i int) int64 {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if i < 0 || i >= len(d.segs) {
		return 0
	}
	return d.segs[i].size
}

// Copy checks every range before copying any, so a bad range leaves both
// sides untouched; then it copies them in order.
func (d *device) Copy(dir backend.Direction, a backend.Arena, ranges []backend.Range) error {
	if dir != backend.DeviceToHost && dir != backend.HostToDevice {
		return fmt.Errorf("shm: engine %q: unknown direction %d", d.engine, dir)
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return fmt.Errorf("shm: engine %q: device: %w", d.engine, backend.ErrClosed)
	}
	var pool []byte
	if own, ok := a.(*arena); ok {
		// Our own arena is pinned the same way, so closing the pool's memory
		// waits for this copy instead of unmapping under it. Read mem
		// directly: a second RLock via Bytes could deadlock behind Close.
		own.mu.RLock()
		defer own.mu.RUnlock()
		if own.closed {
			return fmt.Errorf("shm: engine %q: arena: %w", d.engine, backend.ErrClosed)
		}
		pool = own.mem
	} else {
		pool = a.Bytes()
	}
	for i, r := range ranges {
		if err := d.check(r, int64(len(pool))); err != nil {
			return fmt.Errorf("shm: engine %q: range %d %+v: %s: %w", d.engine, i, r, err, backend.ErrOutOfRange)
		}
	}
	return d.copyAll(dir, pool, ranges)
}

// check is overflow-safe: with every value known non-negative, off+n <= end
// is tested as n <= end && off <= end-n, which cannot wrap. A segment range
// must lie in the mapped span [lo, end), not merely in the segment.
func (d *device) check(r backend.Range, poolLen int64) error {
	switch {
	case r.Segment < 0 || r.Segment >= len(d.segs):
		return fmt.Errorf("segment %d does not exist (engine has %d)", r.Segment, len(d.segs))
	case r.SegOffset < 0 || r.PoolOff < 0 || r.Len < 0:
		return errors.New("negative offset or length")
	}
	m := &d.segs[r.Segment]
	if end := m.end(); r.SegOffset < m.lo || r.Len > end || r.SegOffset > end-r.Len {
		if m.lo == 0 && end == m.size {
			return fmt.Errorf("past the end of segment %d (%d bytes)", r.Segment, m.size)
		}
		return fmt.Errorf("outside the mapped bytes [%d, %d) of segment %d (%d bytes)", m.lo, end, r.Segment, m.size)
	}
	if r.Len > poolLen || r.PoolOff > poolLen-r.Len {
		return fmt.Errorf("past the end of the arena (%d bytes)", poolLen)
	}
	return nil
}

// copyAll does the copies with panic-on-fault set, so a segment the engine
// truncated under us (SIGBUS) is an error for this copy, not a crash of the
// whole service. The flag is per goroutine and restored on return.
func (d *device) copyAll(dir backend.Direction, pool []byte, ranges []backend.Range) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	i := 0
	defer func() {
		if p := recover(); p != nil {
			f, ok := p.(interface{ Addr() uintptr })
			if !ok {
				panic(p)
			}
			err = fmt.Errorf("shm: engine %q: range %d %+v: %w at %#x (object truncated while attached?)",
				d.engine, i, ranges[i], ErrFault, f.Addr())
		}
	}()
	for ; i < len(ranges); i++ {
		r := ranges[i]
		dev := d.segs[r.Segment].slice(r.SegOffset, r.Len)
		host := pool[r.PoolOff : r.PoolOff+r.Len]
		if dir == backend.DeviceToHost {
			copy(host, dev)
		} else {
			copy(dev, host)
		}
	}
	return nil
}

// Close unmaps every segment once in-flight copies are done. Closing twice
// is fine.
func (d *device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	var errs []error
	for i, m := range d.segs {
		if err := unix.Munmap(m.mem); err != nil {
			errs = append(errs, fmt.Errorf("shm: engine %q: munmap segment %d: %w", d.engine, i, err))
		}
	}
	d.segs = nil
	return errors.Join(errs...)
}

// arena is the host pool's memory: one anonymous private mapping. Its lock
// plays the same role as device.mu: Close waits for copies using it.
type arena struct {
	mu     sync.RWMutex
	closed bool
	mem    []byte // nil after Close
}

var _ backend.Arena = (*arena)(nil)

// Bytes returns the arena's memory, or nil after Close.
func (a *arena) Bytes() []byte {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return a.mem
}

// Close unmaps the arena; closing twice is fine.
func (a *arena) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	a.closed = true
	mem := a.mem
	a.mem = nil
	if err := unix.Munmap(mem); err != nil {
		return fmt.Errorf("shm: munmap arena: %w", err)
	}
	return nil
}
