//go:build cuda

package cuda

import (
	"encoding/hex"
	"errors"
	"fmt"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
)

// DeviceBuffer is device memory allocated the way an engine allocates its KV
// cache, exported by IPC. It plays the engine in tests and GPU checks: put
// Segment in an EngineSpec, fill it with Write, verify with Read.
type DeviceBuffer struct {
	w      *worker
	ptr    cu.DevicePtr
	bytes  int64
	device int
	handle [ipcHandleSize]byte
}

// AllocDevice allocates bytes of device memory (cuMemAlloc) and exports its
// IPC handle.
func (b *Backend) AllocDevice(bytes int64) (*DeviceBuffer, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("cuda: device buffer of %d bytes: must be > 0", bytes)
	}
	buf := &DeviceBuffer{w: b.w, bytes: bytes, device: b.cfg.Device}
	err := b.w.do(func() error {
		p, err := cu.MemAlloc(bytes)
		if err != nil {
			return check("cuMemAlloc", err)
		}
		h, err := ipcHandle(p)
		if err != nil {
			return errors.Join(err, check("cuMemFree", cu.MemFree(p)))
		}
		buf.ptr, buf.handle = p, h
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: device buffer of %d bytes: %w", bytes, err)
	}
	return buf, nil
}

// Segment describes the buffer as an EngineSpec segment.
func (d *DeviceBuffer) Segment() messages.Segment {
	return messages.Segment{CUDAIPC: hex.EncodeToString(d.handle[:]), Device: d.device, Bytes: d.bytes}
}

// Len is the buffer's size in bytes.
func (d *DeviceBuffer) Len() int64 { return d.bytes }

// Write copies p to the buffer at off and waits for the whole context: the
// synchronous copy runs on the legacy stream, which the backend's
// non-blocking streams do not wait for, so a later Copy must not overtake it.
func (d *DeviceBuffer) Write(off int64, p []byte) error {
	if !inside(off, int64(len(p)), d.bytes) {
		return fmt.Errorf("cuda: write [%d, +%d) to a %d-byte buffer: %w", off, len(p), d.bytes, backend.ErrOutOfRange)
	}
	if len(p) == 0 {
		return nil
	}
	return wrap("cuda: write", d.w.do(func() error {
		if err := check("cuMemcpyHtoD", cu.MemcpyHtoD(d.ptr+cu.DevicePtr(off), unsafe.Pointer(&p[0]), int64(len(p)))); err != nil {
			return err
		}
		return check("cuCtxSynchronize", cu.Synchronize())
	}))
}

// Read copies the buffer at off into p. It waits for the whole context first,
// so copies the backend queued earlier have landed.
func (d *DeviceBuffer) Read(off int64, p []byte) error {
	if !inside(off, int64(len(p)), d.bytes) {
		return fmt.Errorf("cuda: read [%d, +%d) from a %d-byte buffer: %w", off, len(p), d.bytes, backend.ErrOutOfRange)
	}
	if len(p) == 0 {
		return nil
	}
	return wrap("cuda: read", d.w.do(func() error {
		if err := check("cuCtxSynchronize", cu.Synchronize()); err != nil {
			return err
		}
		return check("cuMemcpyDtoH", cu.MemcpyDtoH(unsafe.Pointer(&p[0]), d.ptr+cu.DevicePtr(off), int64(len(p))))
	}))
}

// Free releases the memory. Engines attached to it must have closed their
// mappings first: freeing an allocation still mapped elsewhere is undefined
// behaviour in CUDA.
func (d *DeviceBuffer) Free() error {
	return wrap("cuda: free device buffer", d.w.do(func() error {
		if d.ptr == 0 {
			return nil
		}
		p := d.ptr
		d.ptr = 0
		return check("cuMemFree", cu.MemFree(p))
	}))
}

// wrap prefixes err with what, keeping nil nil.
func wrap(what string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s: %w", what, err)
}
