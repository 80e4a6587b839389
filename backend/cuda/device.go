//go:build cuda

package cuda

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/kvactors/kvactors/backend"
)

// device is one engine's segments mapped into the backend's context.
type device struct {
	w     *worker
	ptrs  []cu.DevicePtr // base of each segment in this context
	sizes []int64        // declared bytes of each segment
	owned bool           // ptrs came from cuIpcOpenMemHandle: Close unmaps them

	// mu orders Close after the copies running: Copy holds it shared while
	// its copy is in flight, Close exclusively.
	mu     sync.RWMutex
	closed bool
}

var _ backend.Rechecker = (*device)(nil)

// Recheck always passes: a cuda_ipc segment names its allocation by handle,
// not by a file name another object can take over. A restarted engine
// exports new allocations, whose handles differ, so its register is a spec
// change and is remapped already.
func (d *device) Recheck() error { return nil }

// SegmentSize is the declared size of segment i, 0 for no such segment.
func (d *device) SegmentSize(i int) int64 {
	if i < 0 || i >= len(d.sizes) {
		return 0
	}
	return d.sizes[i]
}

// Copy checks every range (all or nothing), merges neighbours (see plan),
// queues one async copy per merged range on a stream of the worker and
// returns once the event recorded after them has completed. An arena from
// elsewhere (not pinned by this backend) is copied synchronously instead.
// A CUDA failure fails this Copy with an *Error naming the call; one that
// breaks the context also shows in Backend.Healthy and fails later copies.
func (d *device) Copy(dir backend.Direction, a backend.Arena, ranges []backend.Range) error {
	if dir != backend.DeviceToHost && dir != backend.HostToDevice {
		return fmt.Errorf("cuda: copy direction %d unknown", dir)
	}
	if a == nil {
		return errors.New("cuda: copy without an arena")
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return fmt.Errorf("cuda: device: %w", backend.ErrClosed)
	}
	host := a.Bytes()
	merged, err := plan(ranges, d.sizes, int64(len(host)))
	if err != nil {
		return err
	}
	if len(merged) == 0 {
		return nil
	}
	c := &call{reply: make(chan error, 1)}
	if ar, ok := a.(*arena); ok && ar.w == d.w {
		c.cp = &copyWork{dir: dir, dev: d, arena: ar, ranges: merged}
	} else {
		c.fn = func() error { return d.w.copySync(dir, d, host, merged) }
	}
	if err := d.w.submit(c); err != nil {
		return fmt.Errorf("cuda: copy %s: %w", dir, err)
	}
	return nil
}

// copySync copies with the synchronous calls, for arenas that are not this
// backend's pinned memory: async copies need page-locked memory, and the
// driver stages pageable memory itself. It blocks the worker meanwhile, which
// is the price of a foreign arena. Only from the worker goroutine.
func (w *worker) copySync(dir backend.Direction, d *device, host []byte, ranges []backend.Range) error {
	if err := w.health(); err != nil {
		return err
	}
	if _, ok := w.devices[d]; !ok {
		return fmt.Errorf("device: %w", backend.ErrClosed)
	}
	for _, r := range ranges {
		p := unsafe.Pointer(&host[r.PoolOff]) // plan checked it: Len > 0, inside host
		dptr := d.ptrs[r.Segment] + cu.DevicePtr(r.SegOffset)
		var err error
		if dir == backend.HostToDevice {
			err = check("cuMemcpyHtoD", cu.MemcpyHtoD(dptr, p, r.Len))
		} else {
			err = check("cuMemcpyDtoH", cu.MemcpyDtoH(p, dptr, r.Len))
		}
		if err != nil {
			return w.note(err)
		}
	}
	// cuMemcpyHtoD from pageable memory may return once the bytes are
	// staged, before they land; Copy promises they have landed.
	return w.note(check("cuCtxSynchronize", cu.Synchronize()))
}

// Close waits for this device's copies, then closes its IPC mappings.
// Calling it again returns nil.
func (d *device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	err := d.w.do(func() error { return d.w.unmap(d) })
	if errors.Is(err, backend.ErrClosed) {
		return nil // the backend's Close already unmapped it
	}
	if err != nil {
		return fmt.Errorf("cuda: close device: %w", err)
	}
	return nil
}
