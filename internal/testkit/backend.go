package testkit

import "github.com/kvactors/kvactors/backend"

// HeapArena is pool memory on the Go heap: a backend.Arena for tests that
// need no shared memory.
type HeapArena []byte

func (a HeapArena) Bytes() []byte { return a }
func (a HeapArena) Close() error  { return nil }

// NopDevice is a backend device that copies nothing and holds segments of
// any size.
type NopDevice struct{}

func (NopDevice) SegmentSize(int) int64                                        { return 1 << 30 }
func (NopDevice) Copy(backend.Direction, backend.Arena, []backend.Range) error { return nil }
func (NopDevice) Close() error                                                 { return nil }
