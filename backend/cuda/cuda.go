//go:build cuda

package cuda

import (
	"errors"
	"fmt"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
)

// Backend is the CUDA backend of one device. It is safe for concurrent use;
// every CUDA call runs on its worker goroutine.
type Backend struct {
	cfg Config
	w   *worker
}

// New opens the backend for cfg.Device; see Open.
func New(cfg Config) (backend.Backend, error) {
	b, err := Open(cfg)
	if err != nil {
		return nil, err
	}
	return b, nil
}

// Open retains the device's primary context and creates cfg.Streams streams
// on a dedicated goroutine. Close releases them.
func Open(cfg Config) (*Backend, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	w, err := startWorker(cfg)
	if err != nil {
		return nil, fmt.Errorf("cuda: device %d: %w", cfg.Device, err)
	}
	return &Backend{cfg: cfg, w: w}, nil
}

// Name returns "cuda".
func (b *Backend) Name() string { return Name }

// Healthy returns nil while the context works. After an error that breaks
// the context (device lost, uncorrectable ECC, illegal address) it returns
// that error, a *Error, for good: the process must restart to use the GPU
// again. After Close it returns an error wrapping backend.ErrClosed.
func (b *Backend) Healthy() error {
	if err := b.w.health(); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// Close waits for copies in flight, then frees every arena and device mapping
// still open and releases the context: Bytes of this backend's arenas are
// invalid afterwards. Close it after its arenas' and devices' users stopped.
func (b *Backend) Close() error {
	if err := b.w.close(); err != nil {
		return fmt.Errorf("cuda: close: %w", err)
	}
	return nil
}

// arena is pinned host memory from cuMemHostAlloc.
type arena struct {
	w     *worker
	ptr   unsafe.Pointer
	bytes []byte
}

// AllocArena returns bytes of pinned host memory: page-locked memory is what
// lets the GPU's DMA engines copy asynchronously at full bandwidth.
func (b *Backend) AllocArena(bytes int64) (backend.Arena, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("cuda: arena of %d bytes: must be > 0", bytes)
	}
	a := &arena{w: b.w}
	err := b.w.do(func() error {
		p, err := hostAlloc(bytes)
		if err != nil {
			return err
		}
		a.ptr = p
		b.w.arenas[a] = struct{}{}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: arena of %d bytes: %w", bytes, err)
	}
	a.bytes = unsafe.Slice((*byte)(a.ptr), bytes)
	return a, nil
}

// Bytes is the pinned memory, valid until Close of the arena or the backend.
func (a *arena) Bytes() []byte { return a.bytes }

// Close frees the memory once copies in flight are done; again is a no-op.
func (a *arena) Close() error {
	err := a.w.do(func() error { return a.w.free(a) })
	if errors.Is(err, backend.ErrClosed) {
		return nil // the backend's Close already freed it
	}
	return wrap("cuda: close arena", err)
}

// free releases an arena once. Only from the worker goroutine.
func (w *worker) free(a *arena) error {
	if _, ok := w.arenas[a]; !ok {
		return nil
	}
	err := w.drain()
	delete(w.arenas, a)
	return errors.Join(err, hostFree(a.ptr))
}

// Attach maps the engine's CUDA IPC segments into this backend's context.
// Every segment must be cuda_ipc on the configured device with bytes > 0;
// anything else wraps backend.ErrBadSegment, as does an allocation smaller
// than its declared bytes.
func (b *Backend) Attach(engine string, segs []messages.Segment) (backend.Attachment, error) {
	parsed, err := parseSegments(b.cfg.Device, segs)
	if err != nil {
		return nil, fmt.Errorf("cuda: engine %q: %w", engine, err)
	}
	d := &device{w: b.w, sizes: make([]int64, len(parsed)), owned: true}
	err = b.w.do(func() error {
		for i, s := range parsed {
			p, err := ipcOpen(&s.handle)
			if err != nil {
				return errors.Join(fmt.Errorf("segment %d: %w", i, err), b.w.unmapPtrs(d.ptrs))
			}
			d.ptrs = append(d.ptrs, p)
			d.sizes[i] = s.bytes
			size, _, err := p.AddressRange()
			if err != nil {
				return errors.Join(fmt.Errorf("segment %d: %w", i, check("cuMemGetAddressRange", err)), b.w.unmapPtrs(d.ptrs))
			}
			if size < s.bytes {
				err := fmt.Errorf("segment %d: allocation of %d bytes, spec says %d: %w", i, size, s.bytes, backend.ErrBadSegment)
				return errors.Join(err, b.w.unmapPtrs(d.ptrs))
			}
		}
		b.w.devices[d] = struct{}{}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: engine %q: %w", engine, err)
	}
	return d, nil
}

// attachPointers makes a device of allocations this process owns, without
// IPC; Close leaves them mapped. It lets tests run the copy path where
// opening a handle of the same process is refused.
func (b *Backend) attachPointers(ptrs []cu.DevicePtr, sizes []int64) (*device, error) {
	d := &device{w: b.w, ptrs: ptrs, sizes: sizes}
	err := b.w.do(func() error {
		b.w.devices[d] = struct{}{}
		return nil
	})
	return d, err
}

// unmap closes a device's IPC mappings once. Only from the worker goroutine.
func (w *worker) unmap(d *device) error {
	if _, ok := w.devices[d]; !ok {
		return nil
	}
	err := w.drain()
	delete(w.devices, d)
	if !d.owned {
		return err
	}
	return errors.Join(err, w.unmapPtrs(d.ptrs))
}

// unmapPtrs closes IPC mappings, reporting every failure. Only from the
// worker goroutine.
func (w *worker) unmapPtrs(ptrs []cu.DevicePtr) error {
	var errs []error
	for _, p := range ptrs {
		errs = append(errs, ipcClose(p))
	}
	return errors.Join(errs...)
}
